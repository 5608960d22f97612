"""``rmqtx ui``: the operator's views of a store as web pages, on loopback.

A small HTTP server of Python's standard library (no framework to install or keep up to date:
the pages are static files of this package, the data is JSON). ``/api/<view>`` answers with
exactly what ``rmqtx status <view> --json`` prints (:mod:`rmq_spark.ops.views`; ``/api/status``
is the summary), and ``/api/lag`` with the lag of each consumer group sampled every
``sample_seconds`` since the server started (the store keeps only the current offsets). The
pages draw their charts with uPlot, served from the package (no CDN: clusters are often
offline), and refresh themselves.

On loopback it asks for nothing, as ``rmqtx serve`` there without accounts. Bound wider
(``--host 0.0.0.0``), it takes the accounts of ``rmqtx serve`` (``[serve.accounts.<key>]``) that
have ``dashboard = true`` and nobody else: HTTP Basic with the access key and secret key, over
TLS only (``--tls-cert``/``--tls-key``, else a self-signed certificate made at start, its
fingerprint logged, as ``serve`` does). Every page shows the whole store, so the right is
given per account, never implied by a topic.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import hmac
import ipaddress
import json
import logging
import os
import socket
import ssl
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rmq_spark.model.config import RetentionSettings
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.ops.status import store_status
from rmq_spark.ops.views import VIEWS
from rmq_spark.serve.accounts import Account
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
#: Files the pages load, by path, with their content types.
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css"}
#: What a secret is compared with when the access key is unknown (never equal to one).
_UNKNOWN_SECRET = "\0" * 32
#: A connection silent this long is closed (its TLS handshake included).
CONNECTION_TIMEOUT = 30.0
#: A request's TLS handshake and headers must arrive within this, however slowly they drip.
HEADERS_DEADLINE = 10.0
#: Connections served at once; more are closed at once (no thread each for a flood).
MAX_CONNECTIONS = 64
#: Lag samples kept per consumer group and topic (a day at one a minute).
SAMPLES_KEPT = 1440


class Dashboard:
    """The data behind the pages: the views of one store, and the lag sampled over time."""

    def __init__(self, store: Store, retention: RetentionSettings, sample_seconds: float):
        self.store, self.retention, self.sample_seconds = store, retention, sample_seconds
        self.lag: dict[str, deque[tuple[str, int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # One thread reads the store for every request: the store keeps its table snapshots
        # per thread, so a thread a request would reopen every table every time.
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rmqtx-ui-read")

    def view(self, name: str) -> dict[str, Any]:
        """``status <name>``'s JSON (``status``: the summary; ``lag``: the samples), read on
        the dashboard's one reading thread."""
        return self._reader.submit(self._view, name).result()

    def _view(self, name: str) -> dict[str, Any]:
        if name == "status":
            return store_status(self.store)
        if name == "lag":
            with self._lock:
                return {
                    "store": self.store.root,
                    "generated": datetime.now(UTC).isoformat(),
                    "sample_seconds": self.sample_seconds,
                    "series": {k: list(v) for k, v in self.lag.items()},
                }
        return VIEWS[name](self.store, self.retention)

    def sample(self) -> None:
        """Record each consumer group's lag on each topic now."""
        view = self.view("groups")
        with self._lock:
            for group in view["groups"]:
                key = f"{group['consumer_group']} on {group['topic']}"
                series = self.lag.setdefault(key, deque(maxlen=SAMPLES_KEPT))
                series.append((view["generated"], group["lag"]))

    def run_sampler(self) -> None:
        """Sample every ``sample_seconds`` until :meth:`stop` (a daemon thread's loop)."""
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                self.sample()
            except Exception:  # a store that fails one read must not end the sampling
                log.warning("could not sample the consumer groups' lag", exc_info=True)
            self._stop.wait(max(0.0, self.sample_seconds - (time.monotonic() - started)))

    def stop(self) -> None:
        self._stop.set()
        self._reader.shutdown(wait=False)


def make_server(
    dashboard: Dashboard,
    host: str,
    port: int,
    accounts: Mapping[str, Account] | None = None,
    tls: ssl.SSLContext | None = None,
) -> _Server:
    """The HTTP server of ``dashboard`` on ``host:port`` (port 0: any free port). Beyond
    loopback it needs ``tls`` and the ``accounts`` that may sign in (those with
    ``dashboard = true``); on loopback it takes them when given."""
    signing_in = {k: a for k, a in (accounts or {}).items() if a.dashboard}
    if not is_loopback(host) and not signing_in:
        raise InvalidOptionError(
            f"rmqtx ui bound to {host} needs an account that may sign in: its pages show the "
            "whole store. Give one dashboard = true in the settings file's "
            "[serve.accounts.<access key>] (with its secret_key_env), or stay on loopback and "
            "reach it through an SSH tunnel (ssh -L 8088:127.0.0.1:8088 <this host>)."
        )
    if not is_loopback(host) and tls is None:
        raise InvalidOptionError(f"rmqtx ui bound to {host} serves HTTPS only: give it TLS.")

    class Handler(BaseHTTPRequestHandler):
        server_version = "rmqtx-ui"

        def setup(self) -> None:
            # A client that drips its handshake or headers is cut off at the deadline.
            self._deadline = threading.Timer(HEADERS_DEADLINE, self._cut_off)
            self._deadline.start()
            if isinstance(self.request, ssl.SSLSocket):
                self.request.do_handshake()  # here, in the connection's thread
            super().setup()

        def _cut_off(self) -> None:
            with contextlib.suppress(OSError):
                self.request.shutdown(socket.SHUT_RDWR)

        def parse_request(self) -> bool:
            parsed = super().parse_request()
            self._deadline.cancel()
            return parsed

        def finish(self) -> None:
            self._deadline.cancel()
            super().finish()

        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            if not signing_in and not self._from_loopback_name():
                # A web page the operator visits could make its own name resolve to
                # 127.0.0.1 (DNS rebinding) and read the pages: only loopback names serve.
                self._send(HTTPStatus.MISDIRECTED_REQUEST, "text/plain", b"use a loopback name")
                return
            if signing_in and not self._signed_in():
                self.send_response(HTTPStatus.UNAUTHORIZED)
                self.send_header("WWW-Authenticate", 'Basic realm="rmqtx ui", charset="UTF-8"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
            path = self.path.split("?", 1)[0]
            if path.startswith("/api/"):
                self._api(path.removeprefix("/api/"))
            else:
                self._static("index.html" if path == "/" else path.lstrip("/"))

        def _from_loopback_name(self) -> bool:
            host = (self.headers.get("Host") or "").rsplit(":", 1)[0].strip("[]").lower()
            return host == "localhost" or is_loopback(host)

        def _signed_in(self) -> bool:
            """HTTP Basic: an account with ``dashboard = true`` and its secret key."""
            scheme, _, encoded = (self.headers.get("Authorization") or "").partition(" ")
            if scheme.lower() != "basic":
                return False
            try:
                access_key, _, secret = (
                    base64.b64decode(encoded, validate=True).decode().partition(":")
                )
            except (binascii.Error, UnicodeDecodeError):
                return False
            account = signing_in.get(access_key)
            given = secret.encode()
            # Compared whether the account exists or not, so timing does not tell.
            expected = (account.secret_key if account else _UNKNOWN_SECRET).encode()
            return hmac.compare_digest(given, expected) and account is not None

        def _api(self, name: str) -> None:
            if name not in (*VIEWS, "status", "lag"):
                self._send(HTTPStatus.NOT_FOUND, _TYPES[".js"], b'{"error": "no such view"}')
                return
            try:
                body = json.dumps(dashboard.view(name), default=str).encode()
            except Exception as exc:
                log.warning("ui: view %s failed", name, exc_info=True)
                error = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "application/json", error)
                return
            self._send(HTTPStatus.OK, "application/json", body)

        def _static(self, name: str) -> None:
            try:
                file = (STATIC / name).resolve()
                found = file.is_relative_to(STATIC.resolve()) and file.is_file()
            except (ValueError, OSError):  # a NUL in the path, a name too long
                found = False
            if not found:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found")
                return
            content_type = _TYPES.get(file.suffix, "application/octet-stream")
            self._send(HTTPStatus.OK, content_type, file.read_bytes())

        def _send(self, status: HTTPStatus, content_type: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.send_header("X-Content-Type-Options", "nosniff")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (stdlib's name)
            log.debug("ui: " + format, *args)

    return _Server((host, port), Handler, tls)


class _Server(ThreadingHTTPServer):
    """A thread a connection; with TLS, each connection's handshake runs in its own thread
    (not in the accepting one, which a client that never finishes it would hold up)."""

    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type, tls: ssl.SSLContext | None):
        self.tls = tls
        self.slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            log.debug(
                "ui: %d connections open; closing one from %s", MAX_CONNECTIONS, client_address
            )
            self.shutdown_request(request)
            return
        super().process_request(request, client_address)

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that is not one (plain HTTP on the TLS port, a handshake left half-way, a
        connection dropped) is logged at DEBUG, not printed as a traceback."""
        if isinstance(sys.exc_info()[1], OSError):  # ssl.SSLError and timeouts are OSErrors
            log.debug("ui: connection from %s ended: %s", client_address, sys.exc_info()[1])
            return
        super().handle_error(request, client_address)

    def get_request(self) -> tuple[Any, Any]:
        connection, address = super().get_request()
        connection.settimeout(CONNECTION_TIMEOUT)
        if self.tls is not None:
            connection = self.tls.wrap_socket(
                connection, server_side=True, do_handshake_on_connect=False
            )
        return connection, address


def tls_context(host: str, cert: str | None, key: str | None) -> ssl.SSLContext:
    """A server TLS context of ``cert`` and ``key`` (PEM files), or of a self-signed
    certificate made now (its fingerprint logged)."""
    from rmq_spark.serve.tls import self_signed

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if cert or key:
        if not (cert and key):
            raise InvalidOptionError("--tls-cert and --tls-key go together.")
        context.load_cert_chain(cert, key)
        return context
    key_pem, cert_pem, fingerprint = self_signed(host)
    with tempfile.TemporaryDirectory(prefix="rmqtx-ui-tls-") as folder:
        paths = (Path(folder) / "cert.pem", Path(folder) / "key.pem")
        for path, pem in zip(paths, (cert_pem, key_pem), strict=True):
            path.write_bytes(pem)
            os.chmod(path, 0o600)
        context.load_cert_chain(*paths)
    log.warning(
        "rmqtx ui: a self-signed certificate made at start, SHA-256 fingerprint %s", fingerprint
    )
    return context


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to be loopback
        return False


def serve(
    store: Store,
    retention: RetentionSettings,
    host: str,
    port: int,
    sample_seconds: float,
    accounts: Mapping[str, Account] | None = None,
    tls: ssl.SSLContext | None = None,
    ready: Callable[[str], None] = print,
) -> None:
    """Serve the dashboard until interrupted (Ctrl-C, SIGTERM as KeyboardInterrupt)."""
    dashboard = Dashboard(store, retention, sample_seconds)
    server = make_server(dashboard, host, port, accounts, tls)
    sampler = threading.Thread(target=dashboard.run_sampler, name="rmqtx-ui-lag", daemon=True)
    sampler.start()
    bound_host, bound_port = server.server_address[:2]
    scheme = "https" if tls else "http"
    ready(
        f"rmqtx ui: {scheme}://{bound_host}:{bound_port}/ on the store {store.root} (Ctrl-C stops)"
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dashboard.stop()
        server.server_close()
