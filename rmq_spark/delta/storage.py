"""One storage configuration for a store root, translated for each client.

The store's ``[store] storage_options`` are written once, in deltalake's
vocabulary (``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ...).  This module
translates them for fsspec (s3fs refuses deltalake's ``AWS_*`` keys) and for
Spark's Hadoop filesystems (``spark.hadoop.fs.s3a.*``), and refuses options
that would turn off the conditional writes that first-decision-wins and dense
offsets rest on.
"""

from __future__ import annotations

import difflib
import functools
import os
import threading
import urllib.parse
import uuid
from collections.abc import Mapping
from typing import Any

import fsspec
import pyarrow.fs as pafs

from rmq_spark.model.errors import StorageConfigError
from rmq_spark.model.failpoints import failpoint


def scheme(uri: str) -> str:
    """The URI scheme of a store root or table (``file`` for local paths)."""
    return uri.split("://", 1)[0].lower() if "://" in uri else "file"


def is_s3(uri: str) -> bool:
    """Whether ``uri`` is on S3 (``s3://`` or ``s3a://``)."""
    return scheme(uri) in ("s3", "s3a")


def filesystem(uri: str, options: Mapping[str, str]) -> tuple[fsspec.AbstractFileSystem, str]:
    """The fsspec filesystem and the path within it of ``uri``, with the store's options.

    Raises
    ------
    StorageConfigError
        When the filesystem's fsspec package (s3fs, gcsfs, adlfs) is not installed, naming
        the extra that installs it.
    """
    try:
        if is_s3(uri) and not _proxied():
            # Whole-object GETs and PUTs signed here (one a tenth of s3fs's CPU).
            from rmq_spark.delta.s3requests import S3FileSystem

            fs = S3FileSystem(**fsspec_options(uri, options), store_options=options)
            return fs, fs._strip_protocol(uri)
        return fsspec.core.url_to_fs(uri, **fsspec_options(uri, options))
    except ImportError as exc:
        extra = _FAMILIES.get(scheme(uri), "s3")
        raise StorageConfigError(
            f"{uri!r} needs an fsspec filesystem that is not installed ({exc}); "
            f"install it with: pip install 'rmq-spark[{extra}]'."
        ) from exc


def _proxied() -> bool:
    """Whether requests go out through an HTTP proxy (which only s3fs's client speaks)."""
    return any(
        os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "HTTP_PROXY", "http_proxy")
    )


def arrow_filesystem(uri: str, options: Mapping[str, str]) -> pafs.FileSystem:
    """A pyarrow filesystem for reading the files under ``uri``: pyarrow's own for local
    paths and S3 (its C++ client reads Parquet in parallel ranges), fsspec's otherwise."""
    if scheme(uri) == "file":
        return pafs.LocalFileSystem()
    if is_s3(uri):
        return _arrow_s3(tuple(sorted(_upper(options).items())))
    fs, _ = filesystem(uri, options)
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs))


@functools.cache
def _arrow_s3(options: tuple[tuple[str, str], ...]) -> pafs.S3FileSystem:
    opts = dict(options)
    kw: dict[str, Any] = {
        "access_key": opts.get("AWS_ACCESS_KEY_ID"),
        "secret_key": opts.get("AWS_SECRET_ACCESS_KEY"),
        "session_token": opts.get("AWS_SESSION_TOKEN"),
        "region": opts.get("AWS_REGION") or opts.get("AWS_DEFAULT_REGION"),
        "tls_ca_file_path": opts.get("AWS_CA_BUNDLE") or os.environ.get("AWS_CA_BUNDLE"),
    }
    if opts.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true"):  # keys or not, unsigned
        kw |= {"anonymous": True, "access_key": None, "secret_key": None, "session_token": None}
    endpoint = (
        opts.get("AWS_ENDPOINT_URL")
        or opts.get("AWS_ENDPOINT")
        or os.environ.get("AWS_ENDPOINT_URL")
    )
    if endpoint:
        parts = urllib.parse.urlsplit(endpoint)
        kw |= {"endpoint_override": parts.netloc + parts.path, "scheme": parts.scheme}
    # A file written whole before its first part fills goes up as one PUT, not three requests
    # of a multipart upload (each an object store's round trip).
    kw["allow_delayed_open"] = True
    return pafs.S3FileSystem(**{k: v for k, v in kw.items() if v is not None})


#: The filesystem family of each scheme, which is also the name of the extra installing it.
_FAMILIES = {"s3": "s3", "s3a": "s3", "gs": "gcs", "gcs": "gcs"} | dict.fromkeys(
    ("abfs", "abfss", "az", "adl"), "adls"
)


# Options that make deltalake fall back from conditional puts to an external
# lock (or to no protection at all).
_UNSAFE = {
    "AWS_S3_LOCKING_PROVIDER": "a locking provider replaces conditional puts",
    "AWS_S3_ALLOW_UNSAFE_RENAME": "unsafe rename gives up atomic commits",
    "AWS_CONDITIONAL_PUT": "only the default (etag/If-None-Match) is safe",
}


#: Storage options users spell most (deltalake's names): a key close to one of these and not
#: one of them is a typo, reported instead of ignored (a misspelt credential read as damage).
_KNOWN = (
    "AWS_ACCESS_KEY_ID",
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_REGION",
    "AWS_DEFAULT_REGION",
    "AWS_ENDPOINT_URL",
    "AWS_ENDPOINT",
    "AWS_ALLOW_HTTP",
    "AWS_PROFILE",
    "AWS_VIRTUAL_HOSTED_STYLE_REQUEST",
    "AWS_S3_ALLOW_UNSAFE_RENAME",
    "AWS_S3_LOCKING_PROVIDER",
    "AWS_CONDITIONAL_PUT",
    "GOOGLE_SERVICE_ACCOUNT",
    "GOOGLE_SERVICE_ACCOUNT_KEY",
    "GOOGLE_APPLICATION_CREDENTIALS",
    "AZURE_STORAGE_ACCOUNT_NAME",
    "AZURE_STORAGE_ACCOUNT_KEY",
    "AZURE_STORAGE_SAS_KEY",
    "AZURE_STORAGE_CLIENT_ID",
    "AZURE_STORAGE_CLIENT_SECRET",
    "AZURE_STORAGE_TENANT_ID",
    "ALLOW_HTTP",
    "TIMEOUT",
    "CONNECT_TIMEOUT",
    # Others object_store and deltalake take, near the ones above: never a typo.
    "AWS_ENDPOINT_URL_S3",
    "AWS_ENDPOINT_URL_DYNAMODB",
    "AWS_METADATA_ENDPOINT",
    "AWS_STS_ENDPOINT",
    "AWS_STS_REGIONAL_ENDPOINTS",
    "AWS_ROLE_ARN",
    "AWS_ROLE_SESSION_NAME",
    "AWS_WEB_IDENTITY_TOKEN_FILE",
    "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
    "AWS_CONTAINER_CREDENTIALS_FULL_URI",
    "AWS_SSE_KMS_KEY_ID",
    "AWS_SKIP_SIGNATURE",
    "AWS_IMDSV1_FALLBACK",
    "AWS_EC2_METADATA_DISABLED",
    "AWS_S3_EXPRESS",
    "AWS_REQUEST_PAYER",
    "AWS_CHECKSUM_ALGORITHM",
    "AWS_COPY_IF_NOT_EXISTS",
    "AWS_SERVER_SIDE_ENCRYPTION",
    "AWS_SSE_BUCKET_KEY_ENABLED",
    "AWS_FORCE_CREDENTIAL_LOAD",
)


def check_option_names(options: Mapping[str, str]) -> None:
    """Refuse a storage option whose name is a near miss of a known one.

    Raises
    ------
    StorageConfigError
        Naming the key and the one it most likely means.
    """
    for key in map(str, options):
        if key.upper() in _KNOWN:
            continue
        close = difflib.get_close_matches(key.upper(), _KNOWN, n=1, cutoff=0.85)
        if close:
            raise StorageConfigError(
                f"unknown storage option {key!r}; did you mean {close[0]!r}? Fix its name in "
                "[store] storage_options (or the storage.<KEY> option)."
            )


def _upper(options: Mapping[str, str]) -> dict[str, str]:
    return {str(k).upper(): str(v) for k, v in options.items()}


def check_conditional_writes(options: Mapping[str, str]) -> None:
    """Refuse options that disable conditional writes.

    Parameters
    ----------
    options : mapping
        deltalake storage options.

    Raises
    ------
    StorageConfigError
        Naming the offending key and what to do instead.
    """
    check_option_names(options)
    for key, value in _upper(options).items():
        if key in _UNSAFE and value.strip().lower() not in ("", "false", "etag"):
            raise StorageConfigError(
                f"storage option {key}={value!r} turns off conditional writes "
                f"({_UNSAFE[key]}); rmq-spark needs If-None-Match commits. "
                f"Remove {key} from [store] storage_options and use a store "
                "that supports conditional PUT (AWS S3, MinIO)."
            )


def deltalake_options(options: Mapping[str, str]) -> dict[str, str] | None:
    """Return the options for ``deltalake`` (``None`` when empty), checked.

    Parameters
    ----------
    options : mapping
        The configured storage options.

    Returns
    -------
    dict or None
        Options for ``DeltaTable``/``write_deltalake``.
    """
    check_conditional_writes(options)
    return dict(options) or None


def fsspec_options(root: str, options: Mapping[str, str]) -> dict[str, Any]:
    """Translate the options into fsspec keyword arguments for ``root``'s scheme.

    Parameters
    ----------
    root : str
        The store root (``s3://``, ``gs://``, ``abfss://`` or a local path).
    options : mapping
        The configured (deltalake) storage options.

    Returns
    -------
    dict
        kwargs for ``fsspec.core.url_to_fs``: s3fs's ``key``/``secret``/``token``/
        ``endpoint_url``/``client_kwargs``, gcsfs's ``token``, adlfs's ``account_name``/
        ``account_key``; empty for local roots. Listings are never cached: a cached listing
        of a Delta log hides the commits made since (a new commit would read as missing).
    """
    family = _FAMILIES.get(scheme(root))
    if family is None:
        return {}
    opts = _upper(options)
    kw: dict[str, Any] = {"use_listings_cache": False}
    kw |= {key: opts[name] for name, key in _FSSPEC_KEYS[family].items() if name in opts}
    if family == "s3":
        region = opts.get("AWS_REGION") or opts.get("AWS_DEFAULT_REGION")
        client = {"region_name": region, "verify": opts.get("AWS_CA_BUNDLE")}
        if any(client.values()):
            kw["client_kwargs"] = {k: v for k, v in client.items() if v}
        if opts.get("AWS_SKIP_SIGNATURE", "").lower() in ("1", "true"):
            kw["anon"] = True  # a public bucket, as deltalake reads it
        # A whole-file read is one GET. Otherwise s3fs first asks for the size (a HEAD, and
        # for a missing file a LIST too) to cut large files into ranges read at once; what
        # is read through fsspec (log entries, hints, markers) is small.
        kw["max_concurrency"] = 1
    return kw


#: deltalake's option names and the fsspec keyword each becomes, per filesystem package.
_FSSPEC_KEYS = {
    "s3": {
        "AWS_ACCESS_KEY_ID": "key",
        "AWS_SECRET_ACCESS_KEY": "secret",
        "AWS_SESSION_TOKEN": "token",
        "AWS_ENDPOINT": "endpoint_url",
        "AWS_ENDPOINT_URL": "endpoint_url",
        "AWS_PROFILE": "profile",
    },
    "gcs": {"GOOGLE_SERVICE_ACCOUNT_PATH": "token", "GOOGLE_SERVICE_ACCOUNT": "token"},
    "adls": {
        "AZURE_STORAGE_ACCOUNT_NAME": "account_name",
        "AZURE_STORAGE_ACCOUNT_KEY": "account_key",
    },
}


def hadoop_settings(options: Mapping[str, str]) -> dict[str, str]:
    """Translate S3 options into Spark ``spark.hadoop.fs.s3a.*`` settings.

    Parameters
    ----------
    options : mapping
        The configured (deltalake) storage options.

    Returns
    -------
    dict
        Spark conf entries; ``s3://`` is mapped to ``S3AFileSystem``.
    """
    # S3A reads credentials from the environment itself, but not the endpoint or region.
    env = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_REGION") if os.environ.get(k)}
    opts = {**env, **_upper(options)}
    p = "spark.hadoop.fs.s3a."
    conf = {
        "spark.hadoop.fs.s3.impl": "org.apache.hadoop.fs.s3a.S3AFileSystem",
    }
    if "AWS_ACCESS_KEY_ID" in opts:
        conf[p + "access.key"] = opts["AWS_ACCESS_KEY_ID"]
    if "AWS_SECRET_ACCESS_KEY" in opts:
        conf[p + "secret.key"] = opts["AWS_SECRET_ACCESS_KEY"]
    if "AWS_SESSION_TOKEN" in opts:
        conf[p + "session.token"] = opts["AWS_SESSION_TOKEN"]
    endpoint = opts.get("AWS_ENDPOINT_URL") or opts.get("AWS_ENDPOINT")
    if endpoint:
        conf[p + "endpoint"] = endpoint
        conf[p + "path.style.access"] = "true"
        conf[p + "connection.ssl.enabled"] = str(not endpoint.lower().startswith("http://")).lower()
    if "AWS_REGION" in opts:
        conf[p + "endpoint.region"] = opts["AWS_REGION"]
    return conf


#: The name of :func:`check_conditional_put`'s scratch object under a root (a ``uuid4().hex``
#: follows): another process's probe, met while opening a store, is not foreign data.
PROBE_PREFIX = "_rmqtx_probe_"
#: (root, options) of the S3 roots this process found to honour conditional writes.
_probed: set[tuple[str, tuple[tuple[str, str], ...]]] = set()
_probed_lock = threading.Lock()


def check_conditional_put(root: str, options: Mapping[str, str]) -> None:
    """Refuse an S3 store that does not honour conditional writes.

    deltalake commits every Delta log entry with a PUT carrying ``If-None-Match: *``; AWS S3
    and MinIO refuse it for an existing key, but some S3-compatible stores ignore the header
    and overwrite, which would let two decisions or two publishes both "win". This writes
    one scratch object twice the same way and expects the second write to be refused. (GCS
    and Azure commit through their own preconditions, which the services always honour.)

    Probed once per process for a root and its options (endpoint included): a store made
    through one endpoint can later be reached through another (the environment, per-read
    options or a gateway change it).

    Raises
    ------
    StorageConfigError
        When the second write succeeded, saying why the store cannot be used.
    """
    if not is_s3(root):
        return
    key = (root, tuple(sorted(_upper(options).items())))
    if key in _probed:
        return
    fs, path = filesystem(root, options)
    probe = f"{path.rstrip('/')}/{PROBE_PREFIX}{uuid.uuid4().hex}"
    fs.pipe_file(probe, b"first", mode="create")
    failpoint("storage.probed")
    try:
        fs.pipe_file(probe, b"second", mode="create")
    except FileExistsError:
        with _probed_lock:
            _probed.add(key)
        return
    finally:
        fs.rm_file(probe)
    raise StorageConfigError(
        f"the object store of {root!r} does not honour conditional writes: a PUT with "
        "If-None-Match: * overwrote an existing object, so concurrent decisions could "
        "overwrite each other. rmq-spark needs a store that refuses it (AWS S3, MinIO, ...); "
        "check the endpoint and any proxy or gateway in front of it."
    )
