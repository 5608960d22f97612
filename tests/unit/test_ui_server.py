"""``rmqtx ui``'s server against hostile clients, in this process (no browser, no Spark): a web
page's DNS rebinding, a client that drips its headers, a flood of idle connections, odd paths
(review of #49)."""

from __future__ import annotations

import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest

from rmq_spark import Message, Store
from rmq_spark.model.config import RetentionSettings
from rmq_spark.ops.ui import server as ui


@pytest.fixture
def running(store: Store, monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    monkeypatch.setattr(ui, "HEADERS_DEADLINE", 1.0)
    monkeypatch.setattr(ui, "MAX_CONNECTIONS", 4)
    store.send([Message("Orders", "x")], "shop")
    dashboard = ui.Dashboard(store, RetentionSettings(), 60.0)
    server = ui.make_server(dashboard, "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server.server_address[1]
    server.shutdown()
    dashboard.stop()


def get(port: int, path: str, host: str | None = None) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    connection.putrequest("GET", path, skip_host=host is not None)
    if host is not None:
        connection.putheader("Host", host)
    connection.endheaders()
    response = connection.getresponse()
    return response.status, response.read()


def test_only_loopback_names_are_served(running: int) -> None:
    """A page on evil.example whose name resolves to 127.0.0.1 read every view."""
    assert get(running, "/api/topics")[0] == 200
    assert get(running, "/api/topics", host=f"localhost:{running}")[0] == 200
    assert get(running, "/api/topics", host=f"[::1]:{running}")[0] == 200
    status, body = get(running, "/api/topics", host=f"evil.example:{running}")
    assert status == 421 and b"Orders" not in body
    assert get(running, "/", host="evil.example")[0] == 421


def test_odd_paths_are_not_found(running: int) -> None:
    for path in ("/a%00b", "/\x00", "/" + "x" * 5000, "/../../setup.py", "/api/../x"):
        assert get(running, path.replace("\x00", "%00"))[0] == 404, path


def test_a_client_that_drips_its_headers_is_cut_off(running: int) -> None:
    with socket.create_connection(("127.0.0.1", running), timeout=5) as slow:
        started = time.monotonic()
        try:
            for byte in b"GET /api/topics HTTP/1.0\r\nHost: localhost\r\n":
                slow.sendall(bytes([byte]))
                time.sleep(0.2)
        except OSError:
            pass  # cut off while sending
        assert slow.recv(100) == b""  # closed by the server
        assert time.monotonic() - started < 5


def test_a_flood_of_idle_connections_gets_no_thread_each(running: int) -> None:
    before = set(threading.enumerate())
    idle = [socket.create_connection(("127.0.0.1", running), timeout=5) for _ in range(20)]
    try:
        time.sleep(0.5)
        serving = [t for t in set(threading.enumerate()) - before if "process_request" in t.name]
        assert len(serving) <= 4  # the slots; the other 16 were closed at once
    finally:
        for s in idle:
            s.close()
    time.sleep(1.5)  # the deadline frees the slots
    assert get(running, "/api/topics")[0] == 200
