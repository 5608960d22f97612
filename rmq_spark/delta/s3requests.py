"""The S3 requests of a transaction, signed here: whole-object GETs and PUTs.

Every transaction on an ``s3://`` store makes about six requests, most of them GETs and PUTs of
objects of a few hundred bytes (log entries, decision objects, hints). Through s3fs each costs
1.5 to 2 ms of CPU (aiobotocore's request pipeline, its event hooks, endpoint rules and
response parsing, on an asyncio loop in another thread), and a producer at 1 x 4 on S3 spent
three quarters of its CPU there (``py-spy --gil``). Here they cost about a tenth of that: a
request signed with AWS Signature Version 4 and sent on a keep-alive connection of the
calling thread (:mod:`rmq_spark.delta.http1`).

:class:`S3FileSystem` is s3fs's filesystem with those calls (``cat_file`` of a whole object,
``cat`` of several, ``pipe_file``, and ``rm`` of objects named: a DeleteObjects request a
thousand keys) made this way; listings, recursive deletes, ranged reads, multipart uploads and
everything else stay s3fs's. Same behaviour as s3fs for its callers:
a missing object raises ``FileNotFoundError``, a PUT with ``mode="create"`` (``If-None-Match:
*``) of an existing object ``FileExistsError``. Besides:

* Credentials are botocore's (the store's options, else the environment, the profile, a
  container or instance role, web identity...), refreshed as botocore refreshes them; none
  found is a ``StorageConfigError`` (``AWS_SKIP_SIGNATURE=true`` for a public bucket).
* Region and endpoint come from the store's options or the environment, as for s3fs.
  Without an endpoint, AWS's virtual-hosted addresses are used (path style for buckets
  that cannot be host names); a 301 or a 400 naming the bucket's region switches that
  bucket to it. With an endpoint (MinIO, a gateway), path style under it, or with
  ``AWS_VIRTUAL_HOSTED_STYLE_REQUEST`` true the endpoint as the bucket's host (as deltalake
  does). TLS verifies against the system's roots or ``AWS_CA_BUNDLE``. Behind an HTTP proxy
  (``HTTPS_PROXY`` or ``HTTP_PROXY`` set) s3fs makes these requests too
  (:func:`rmq_spark.delta.storage.filesystem`).
* A request is retried after a connection error, a 5xx, a 429 or a throttling answer, with
  jittered backoff, 5 attempts in all (s3fs's count); a conditional PUT answered 409
  (another PUT of the key under way) is put again; a keep-alive connection the server closed
  while idle is replaced at once. A put-if-absent whose answer was lost and whose retry is
  refused reads the object: its own bytes there mean it wrote them.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import hmac
import html
import logging
import os
import random
import re
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any
from xml.sax.saxutils import escape as xml_escape

import botocore.exceptions
import botocore.session
import s3fs
from botocore.credentials import Credentials
from fsspec.core import has_magic

from rmq_spark.delta.http1 import Connection, Response
from rmq_spark.delta.parallel import each
from rmq_spark.model.errors import StorageConfigError

log = logging.getLogger(__name__)

_ATTEMPTS = 5
_TIMEOUT = 60.0
#: Overwrites larger than this go through s3fs (a multipart upload above its chunk size);
#: a put-if-absent is one PUT whatever its size (s3fs's multipart upload drops the condition).
_SMALL = 8 * 1024 * 1024
#: The most keys one DeleteObjects request takes.
_DELETED_AT_ONCE = 1000
#: What a key escapes in a DeleteObjects body besides ``&<>``: a CR an XML parser would read as LF.
_XML_KEY = {"\r": "&#13;"}
_EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
_RETRIED_STATUS = {429, 500, 502, 503, 504}
_THROTTLED = {"SlowDown", "Throttling", "ThrottlingException", "RequestTimeout"}
_DNS_BUCKET = re.compile(r"^[a-z0-9][a-z0-9-]{1,61}[a-z0-9]$")
#: What a request on a keep-alive connection the server closed while idle raises.
_STALE = (BrokenPipeError, ConnectionResetError, ssl.SSLEOFError)
#: How long a credential chain that found nothing is not asked again (each request would).
_NO_CREDENTIALS_SECONDS = 5.0


class S3Error(OSError):
    """An S3 request refused for a reason other than a missing or existing object."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        #: The HTTP status of the refusal; None when no answer came.
        self.status = status


class ObjectChanged(OSError):
    """A PUT ``if_match`` refused: the object was changed or removed since it was read."""


class S3Requests:
    """Signed whole-object GETs and PUTs on one S3 endpoint with one set of credentials."""

    def __init__(self, options: Mapping[str, str]) -> None:
        opts = {str(k).upper(): str(v) for k, v in options.items()}
        env = os.environ
        self._opts = opts
        self._session = botocore.session.Session(profile=opts.get("AWS_PROFILE"))
        self._credentials: Any = None
        #: The process whose lock :attr:`_credentials_lock` is (a forked child makes its own:
        #: the parent's may have been held by another thread at the fork).
        self._lock_pid = os.getpid()
        self._credentials_lock = threading.Lock()
        self._none_found_at = -_NO_CREDENTIALS_SECONDS
        self._anonymous = opts.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true")
        #: The region of each bucket (told by S3 when a request went to another), and of any.
        self._regions: dict[str, str] = {}
        self.region = (
            opts.get("AWS_REGION")
            or opts.get("AWS_DEFAULT_REGION")
            or env.get("AWS_REGION")
            or _profiled(self._session.get_config_variable, "region")
            or "us-east-1"
        )
        endpoint = (
            opts.get("AWS_ENDPOINT_URL")
            or opts.get("AWS_ENDPOINT")
            or env.get("AWS_ENDPOINT_URL_S3")
            or env.get("AWS_ENDPOINT_URL")
        )
        self.endpoint = urllib.parse.urlsplit(endpoint) if endpoint else None
        # With an endpoint, virtual-hosted requests go to the endpoint as given (deltalake's
        # object_store: it names the bucket's host); without one, to the bucket's AWS host.
        virtual = opts.get("AWS_VIRTUAL_HOSTED_STYLE_REQUEST", "").lower() in ("1", "true")
        self.virtual = virtual or self.endpoint is None
        cafile = opts.get("AWS_CA_BUNDLE") or env.get("AWS_CA_BUNDLE")
        self._tls = ssl.create_default_context(cafile=cafile)
        self._local = threading.local()
        self._keys: dict[tuple[str, str, str], bytes] = {}

    # ------------------------------------------------------------------ requests
    def get(self, path: str) -> bytes:
        """The object at ``path`` (``bucket/key``); ``FileNotFoundError`` when absent."""
        return self.get_tagged(path)[0]

    def get_tagged(self, path: str) -> tuple[bytes, str]:
        """The object at ``path`` and its ETag (for :meth:`put`'s ``if_match``)."""
        response, _ = self._request("GET", path)
        if response.status == 404:
            raise FileNotFoundError(path)
        return response.body, response.headers.get("etag", "")

    def put(
        self, path: str, data: bytes, *, if_absent: bool = False, if_match: str | None = None
    ) -> None:
        """Write ``data`` as ``path``; with ``if_absent`` only if no object is there
        (``FileExistsError`` otherwise), with ``if_match`` only if the object there still has
        that ETag (:class:`ObjectChanged` otherwise). A conditional PUT sent again after its
        answer was lost and refused finds its own bytes there: it wrote them, and returns."""
        headers = {"if-none-match": "*"} if if_absent else {}
        if if_match is not None:
            headers["if-match"] = if_match
        response, unsure = self._request("PUT", path, data, headers)
        if response.status == 404:
            if if_match is not None and _error(response.body)[0] == "NoSuchKey":
                raise ObjectChanged(f"s3://{path} was removed")
            raise FileNotFoundError(f"s3://{path}: no such bucket")
        if response.status == 412:
            if unsure and self._same(path, data):
                return
            raise FileExistsError(path) if if_absent else ObjectChanged(f"s3://{path} changed")

    def delete(self, paths: Sequence[str]) -> None:
        """Delete the objects at ``paths`` (``bucket/key``), a thousand a request (S3's
        DeleteObjects); absent ones are skipped. A key S3 would not delete raises (the first
        one named): ``PermissionError`` for AccessDenied, else :class:`S3Error`."""
        buckets: dict[str, list[str]] = {}
        for path in paths:
            bucket, _, key = path.partition("/")
            buckets.setdefault(bucket, []).append(key)
        chunks = [
            (bucket, keys[i : i + _DELETED_AT_ONCE])
            for bucket, keys in buckets.items()
            for i in range(0, len(keys), _DELETED_AT_ONCE)
        ]
        each(lambda chunk: self._delete(*chunk), chunks, "deletes")

    def _delete(self, bucket: str, keys: Sequence[str]) -> None:
        listed = "".join(f"<Object><Key>{xml_escape(k, _XML_KEY)}</Key></Object>" for k in keys)
        body = f"<Delete><Quiet>true</Quiet>{listed}</Delete>".encode()
        md5 = base64.b64encode(hashlib.md5(body, usedforsecurity=False).digest()).decode()
        response, _ = self._request("POST", f"{bucket}/", body, {"content-md5": md5}, "delete=")
        if response.status == 404:
            raise FileNotFoundError(f"s3://{bucket}: no such bucket")
        refused = re.search(rb"<Error>(.*?)</Error>", response.body, re.S)
        if refused is not None:
            key = re.search(rb"<Key>(.*?)</Key>", refused.group(1), re.S)
            code, message = _error(refused.group(1))
            named = html.unescape(key.group(1).decode()) if key else "?"
            text = f"S3 DELETE s3://{bucket}/{named}: {code or ''} {message or ''}".strip()
            raise PermissionError(text) if code == "AccessDenied" else S3Error(text)

    def _same(self, path: str, data: bytes) -> bool:
        try:
            return self.get(path) == data
        except FileNotFoundError:
            return False

    def _request(
        self,
        method: str,
        path: str,
        body: bytes = b"",
        headers: Mapping[str, str] | None = None,
        query: str = "",
    ) -> tuple[Response, bool]:
        """The request's answer (200 or 204; 404; 412 to a PUT), and whether an earlier
        attempt may have been carried out, its answer lost. Any other answer raises, after
        the retries it takes. ``query``: the request's canonical query string (``delete=``)."""
        bucket, _, key = path.partition("/")
        answered = {200, 204, 404} | ({412} if method == "PUT" else set())
        unsure = False
        attempt = 0
        while True:
            attempt += 1
            region = self._regions.get(bucket, self.region)
            host, target, secure = self._address(bucket, key, region)
            signed = self._sign(method, host, target, query, body, dict(headers or {}), region)
            reused = self._has_connection(host, secure)
            wire = f"{target}?{query}" if query else target
            try:
                response = self._connection(host, secure).request(method, wire, body, signed)
            except ssl.SSLCertVerificationError as exc:
                self._drop(host, secure)
                raise S3Error(f"S3 {method} s3://{path}: {exc} (set AWS_CA_BUNDLE?)") from exc
            except OSError as exc:
                self._drop(host, secure)
                unsure = unsure or method == "PUT"
                if reused and isinstance(exc, _STALE):
                    attempt -= 1  # an idle connection the server closed: again, at once
                    continue
                if attempt == _ATTEMPTS:
                    raise S3Error(f"S3 {method} s3://{path}: {exc}") from exc
                _backoff(attempt)
                continue
            status = response.status
            if status in answered:
                return response, unsure
            code, message = _error(response.body)
            told = response.headers.get("x-amz-bucket-region")
            if told and told != region and status in (301, 400) and attempt < _ATTEMPTS:
                log.info("s3://%s is in %s, not %s: addressing it there", bucket, told, region)
                self._regions[bucket] = told
                continue
            conflict = status == 409 and code == "ConditionalRequestConflict"
            # A 5xx may come back after the write landed (a gateway's timeout).
            unsure = unsure or (method == "PUT" and (status >= 500 or conflict))
            if attempt < _ATTEMPTS and (
                status in _RETRIED_STATUS or code in _THROTTLED or conflict
            ):
                _backoff(attempt)
                continue
            text = f"S3 {method} s3://{path}: {status} {code or ''} {message or ''}".strip()
            raise PermissionError(text) if status == 403 else S3Error(text, status)

    def _address(self, bucket: str, key: str, region: str) -> tuple[str, str, bool]:
        """The host, the request target and whether TLS is on, for ``bucket``'s ``key``."""
        quoted = urllib.parse.quote(key, safe="/~")
        if self.endpoint is not None:
            host, secure = self.endpoint.netloc, self.endpoint.scheme == "https"
            prefix = self.endpoint.path.rstrip("/")
            if self.virtual:  # the endpoint is the bucket's own host
                return host, f"{prefix}/{quoted}", secure
            return host, f"{prefix}/{bucket}/{quoted}", secure
        domain = "amazonaws.com.cn" if region.startswith("cn-") else "amazonaws.com"
        if _DNS_BUCKET.match(bucket) and "." not in bucket:
            return f"{bucket}.s3.{region}.{domain}", f"/{quoted}", True
        return f"s3.{region}.{domain}", f"/{bucket}/{quoted}", True

    def _sign(
        self,
        method: str,
        host: str,
        target: str,
        query: str,
        body: bytes,
        headers: dict[str, str],
        region: str,
    ) -> dict[str, str]:
        """``headers`` with the request signed (AWS Signature Version 4), or as they are for
        an anonymous request (``AWS_SKIP_SIGNATURE``)."""
        payload = hashlib.sha256(body).hexdigest() if body else _EMPTY_SHA256
        headers |= {"host": host, "x-amz-content-sha256": payload}
        if self._anonymous:
            return headers
        creds = _profiled(self._resolved().get_frozen_credentials)  # refreshed when due
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        day = stamp[:8]
        headers["x-amz-date"] = stamp
        if creds.token:
            headers["x-amz-security-token"] = creds.token
        names = sorted(headers)
        canonical = "\n".join(
            [
                method,
                target,
                query,
                "".join(f"{n}:{str(headers[n]).strip()}\n" for n in names),
                ";".join(names),
                payload,
            ]
        )
        scope = f"{day}/{region}/s3/aws4_request"
        to_sign = "\n".join(
            ["AWS4-HMAC-SHA256", stamp, scope, hashlib.sha256(canonical.encode()).hexdigest()]
        )
        signature = hmac.new(
            self._signing_key(creds.secret_key, day, region), to_sign.encode(), hashlib.sha256
        ).hexdigest()
        headers["authorization"] = (
            f"AWS4-HMAC-SHA256 Credential={creds.access_key}/{scope}, "
            f"SignedHeaders={';'.join(names)}, Signature={signature}"
        )
        return headers

    def _resolved(self) -> Any:
        """The credentials: the store's keys when given, else botocore's chain, looked up
        again (at most every few seconds) while it finds none: an instance role not
        reachable yet."""
        found = self._credentials
        if found is not None:
            return found
        if self._lock_pid != os.getpid():
            self._lock_pid, self._credentials_lock = os.getpid(), threading.Lock()
        with self._credentials_lock:
            if self._credentials is None:
                self._credentials = self._looked_up()
            return self._credentials

    def _looked_up(self) -> Any:
        opts = self._opts
        if "AWS_ACCESS_KEY_ID" in opts and "AWS_SECRET_ACCESS_KEY" in opts:
            return Credentials(
                opts["AWS_ACCESS_KEY_ID"],
                opts["AWS_SECRET_ACCESS_KEY"],
                opts.get("AWS_SESSION_TOKEN"),
            )
        found = None
        if time.monotonic() - self._none_found_at >= _NO_CREDENTIALS_SECONDS:
            try:
                found = _profiled(self._session.get_credentials)
            except StorageConfigError:
                self._none_found_at = time.monotonic()
                raise
        if found is None:
            self._none_found_at = time.monotonic()
            raise StorageConfigError(
                "no AWS credentials found for the store (not in its storage options, the "
                "environment, the profile or an instance or container role); set "
                "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_SKIP_SIGNATURE=true "
                "for a public bucket."
            )
        return found

    def _signing_key(self, secret: str, day: str, region: str) -> bytes:
        cached = (secret, day, region)
        key = self._keys.get(cached)
        if key is None:
            key = hmac.new(f"AWS4{secret}".encode(), day.encode(), hashlib.sha256).digest()
            for part in (region, "s3", "aws4_request"):
                key = hmac.new(key, part.encode(), hashlib.sha256).digest()
            if len(self._keys) > 16:  # days and regions gone by
                self._keys = {}
            self._keys[cached] = key
        return key

    def _connections(self) -> dict[tuple[str, bool], Connection]:
        """The calling thread's connections (a forked child makes its own: the parent's
        sockets are the parent's)."""
        pid = os.getpid()
        if getattr(self._local, "pid", None) != pid:
            self._local.conns = {}
            self._local.pid = pid
        return self._local.conns

    def _has_connection(self, host: str, secure: bool) -> bool:
        conn = self._connections().get((host, secure))
        return conn is not None and conn.sock is not None

    def _connection(self, host: str, secure: bool) -> Connection:
        conns = self._connections()
        conn = conns.get((host, secure))
        if conn is None:
            conn = conns[(host, secure)] = Connection(host, secure, self._tls, _TIMEOUT)
        return conn

    def _drop(self, host: str, secure: bool) -> None:
        conn = self._connections().pop((host, secure), None)
        if conn is not None:
            conn.close()


class S3FileSystem(s3fs.S3FileSystem):
    """s3fs's filesystem, with whole-object reads and writes, and deletes of objects named,
    made by :class:`S3Requests`."""

    def __init__(self, *args: Any, store_options: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.requests = requests_for(
            tuple(sorted((str(k), str(v)) for k, v in store_options.items()))
        )

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kw: Any):  # noqa: ANN201
        if start is not None or end is not None or kw:
            return super().cat_file(path, start=start, end=end, **kw)
        return self.requests.get(self._strip_protocol(path))

    def cat(
        self, path: str | Sequence[str], recursive: bool = False, on_error: str = "raise", **kw: Any
    ):  # noqa: ANN201
        if isinstance(path, str) or recursive or kw:
            return super().cat(path, recursive=recursive, on_error=on_error, **kw)
        paths = [self._strip_protocol(p) for p in path]

        def read(p: str) -> bytes | Exception:
            try:
                return self.requests.get(p)
            except Exception as exc:
                # Not the object's: the store's configuration or rights, for every object.
                if on_error == "raise" or isinstance(exc, (StorageConfigError, PermissionError)):
                    raise
                return exc

        found = dict(zip(paths, each(read, paths, "reads"), strict=True))
        if on_error == "omit":
            return {p: v for p, v in found.items() if isinstance(v, bytes)}
        return found

    def pipe_file(self, path: str, value: bytes, mode: str = "overwrite", **kw: Any) -> None:
        if (
            kw
            or mode not in ("overwrite", "create")
            or (mode == "overwrite" and len(value) > _SMALL)
        ):
            return super().pipe_file(path, value, mode=mode, **kw)
        self.requests.put(self._strip_protocol(path), bytes(value), if_absent=mode == "create")
        if self.dircache:  # empty unless listings are cached (rmq-spark does not cache them)
            self.invalidate_cache(path)
        return None

    def rm(
        self, path: str | Sequence[str], recursive: bool = False, maxdepth: int | None = None
    ) -> None:
        """Delete objects by name (:meth:`S3Requests.delete`; names of no object are skipped,
        as S3 skips them); folders, globs and recursive deletes are s3fs's."""
        paths = [path] if isinstance(path, str) else list(path)
        stripped = [self._strip_protocol(p) for p in paths]
        folders = any(p.endswith("/") for p in paths) or any(
            has_magic(p) or "/" not in p for p in stripped
        )
        if recursive or maxdepth is not None or folders:
            super().rm(path, recursive=recursive, maxdepth=maxdepth)
            return
        self.requests.delete(stripped)
        if self.dircache:
            for p in stripped:
                self.invalidate_cache(p)


@functools.cache
def requests_for(options: tuple[tuple[str, str], ...]) -> S3Requests:
    """One :class:`S3Requests` a process for a store's options: its connections and its
    credentials (botocore's chain asks an instance role over the network) are shared."""
    return S3Requests(dict(options))


def _profiled(lookup: Callable[..., Any], *args: Any) -> Any:
    """``lookup(*args)`` of botocore's configuration or credentials; what it fails with (an
    unknown profile, a key without its secret, a failing ``credential_process`` or role) is a
    ``StorageConfigError``: the store's, not an object's."""
    try:
        return lookup(*args)
    except botocore.exceptions.ProfileNotFound as exc:
        raise StorageConfigError(
            f"{exc}: set AWS_PROFILE (in the store's storage options or the environment) to a "
            "profile of ~/.aws/config or ~/.aws/credentials."
        ) from exc
    except botocore.exceptions.BotoCoreError as exc:
        raise StorageConfigError(f"the store's AWS credentials: {exc}") from exc


def _error(body: bytes) -> tuple[str | None, str | None]:
    """The ``Code`` and ``Message`` of an S3 error document."""
    text = body.decode("utf-8", "replace")
    code = re.search(r"<Code>(.*?)</Code>", text)
    message = re.search(r"<Message>(.*?)</Message>", text)
    return (code.group(1) if code else None), (message.group(1) if message else None)


def _backoff(attempt: int) -> None:
    time.sleep(random.uniform(0, min(2.0, 0.05 * 2**attempt)))
