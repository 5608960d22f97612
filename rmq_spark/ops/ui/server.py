"""``rmqtx ui``: the operator's views of a store as web pages, on loopback.

A small HTTP server of Python's standard library (no framework to install or keep up to date:
the pages are static files of this package, the data is JSON). ``/api/<view>`` answers with
exactly what ``rmqtx status <view> --json`` prints (:mod:`rmq_spark.ops.views`; ``/api/status``
is the summary), and ``/api/lag`` with the lag of each consumer group sampled every
``sample_seconds`` since the server started (the store keeps only the current offsets). The
pages draw their charts with uPlot, served from the package (no CDN: clusters are often
offline), and refresh themselves.

It binds loopback only: the pages show every topic, group and message count of the store with
no access control of their own. Reach it from elsewhere through an SSH tunnel
(``ssh -L 8088:127.0.0.1:8088 host``).
"""

from __future__ import annotations

import ipaddress
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from rmq_spark.model.config import RetentionSettings
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.ops.status import store_status
from rmq_spark.ops.views import VIEWS, groups_view
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

STATIC = Path(__file__).parent / "static"
#: Files the pages load, by path, with their content types.
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript", ".css": "text/css"}
#: Lag samples kept per consumer group and topic (a day at one a minute).
SAMPLES_KEPT = 1440


class Dashboard:
    """The data behind the pages: the views of one store, and the lag sampled over time."""

    def __init__(self, store: Store, retention: RetentionSettings, sample_seconds: float):
        self.store, self.retention, self.sample_seconds = store, retention, sample_seconds
        self.lag: dict[str, deque[tuple[str, int]]] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()

    def view(self, name: str) -> dict[str, Any]:
        """``status <name>``'s JSON (``status``: the summary; ``lag``: the samples)."""
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
        view = groups_view(self.store, self.retention)
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


def make_server(dashboard: Dashboard, host: str, port: int) -> ThreadingHTTPServer:
    """The HTTP server of ``dashboard`` on ``host:port`` (port 0: any free port)."""
    if not _loopback(host):
        raise InvalidOptionError(
            f"rmqtx ui binds loopback only (not {host}): its pages have no access control of "
            "their own. Reach it from another host through an SSH tunnel, e.g. "
            "ssh -L 8088:127.0.0.1:8088 <this host>."
        )

    class Handler(BaseHTTPRequestHandler):
        server_version = "rmqtx-ui"

        def do_GET(self) -> None:  # noqa: N802 (the standard library's name)
            path = self.path.split("?", 1)[0]
            if path.startswith("/api/"):
                self._api(path.removeprefix("/api/"))
            else:
                self._static("index.html" if path == "/" else path.lstrip("/"))

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
            file = (STATIC / name).resolve()
            if not file.is_relative_to(STATIC.resolve()) or not file.is_file():
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

    return ThreadingHTTPServer((host, port), Handler)


def _loopback(host: str) -> bool:
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
    ready: Callable[[str], None] = print,
) -> None:
    """Serve the dashboard until interrupted (Ctrl-C, SIGTERM as KeyboardInterrupt)."""
    dashboard = Dashboard(store, retention, sample_seconds)
    server = make_server(dashboard, host, port)
    sampler = threading.Thread(target=dashboard.run_sampler, name="rmqtx-ui-lag", daemon=True)
    sampler.start()
    bound_host, bound_port = server.server_address[:2]
    ready(f"rmqtx ui: http://{bound_host}:{bound_port}/ on the store {store.root} (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        dashboard.stop()
        server.server_close()
