"""The HTTP/1.1 connection of the S3 client (:mod:`rmq_spark.delta.http1`) against a real TCP
server on loopback that answers with the bytes each test scripts: the shapes of answer an S3
endpoint, a gateway or a load balancer may send, and the broken ones."""

from __future__ import annotations

import socket
import ssl
import threading
import time
from collections.abc import Iterator

import pytest

from rmq_spark.delta.http1 import Connection, ProtocolError
from rmq_spark.delta.s3requests import S3Requests


class Closing(bytes):
    """An answer after which the scripted server closes the connection."""


class Scripted:
    """A server that reads each request's head (and its ``Content-Length`` body) and sends the
    next scripted answer (then closes the connection after a :class:`Closing` one); ``None``
    closes the connection instead of answering. It counts connections."""

    def __init__(self, answers: list[bytes | None]) -> None:
        self.answers = answers
        self.requests: list[bytes] = []
        self.connections = 0
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self._listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while self.answers:
            conn, _ = self._listener.accept()
            self.connections += 1
            with conn, conn.makefile("rb") as reader:
                while self.answers:
                    lines = []
                    while (line := reader.readline()) not in (b"\r\n", b""):
                        lines.append(line)
                    if not lines:
                        break
                    sizes = [int(h[15:]) for h in lines if h.lower().startswith(b"content-length:")]
                    body = reader.read(sizes[0]) if sizes else b""
                    self.requests.append(b"".join(lines) + b"\r\n" + body)
                    answer = self.answers.pop(0)
                    if answer is None:
                        break
                    conn.sendall(answer)
                    if isinstance(answer, Closing):
                        break

    def close(self) -> None:
        self._listener.close()


@pytest.fixture
def serve() -> Iterator:
    servers: list[Scripted] = []

    def start(*answers: bytes | None) -> tuple[Scripted, Connection]:
        server = Scripted(list(answers))
        servers.append(server)
        return server, Connection(server.host, False, ssl.create_default_context(), 5.0)

    yield start
    for server in servers:
        server.close()


OK = b'HTTP/1.1 200 OK\r\nContent-Length: 2\r\nETag: "e"\r\n\r\nok'


def test_answers_of_a_known_length_share_one_connection(serve) -> None:
    server, conn = serve(OK, OK)
    first = conn.request("PUT", "/b/k", b"body", {"host": server.host})
    assert (first.status, first.headers["etag"], first.body) == (200, '"e"', b"ok")
    assert conn.request("GET", "/b/k", b"", {"host": server.host}).body == b"ok"
    assert server.connections == 1
    put, get = server.requests
    assert put.startswith(b"PUT /b/k HTTP/1.1\r\n") and b"content-length: 4\r\n" in put
    assert put.endswith(b"\r\n\r\nbody")
    assert b"content-length" not in get


def test_a_chunked_body_with_extensions_and_a_trailer(serve) -> None:
    chunked = (
        b"HTTP/1.1 404 Not Found\r\nTransfer-Encoding: chunked\r\n\r\n"
        b"5;ext=1\r\n<Code\r\n3\r\n>x<\r\n0\r\nX-Trailer: t\r\n\r\n"
    )
    server, conn = serve(chunked, OK)
    answer = conn.request("GET", "/b/missing", b"", {"host": server.host})
    assert (answer.status, answer.body) == (404, b"<Code>x<")
    assert conn.request("GET", "/b/k", b"", {"host": server.host}).body == b"ok"
    assert server.connections == 1


def test_an_informational_answer_is_skipped(serve) -> None:
    server, conn = serve(b"HTTP/1.1 100 Continue\r\n\r\n" + OK)
    assert conn.request("PUT", "/b/k", b"x", {"host": server.host}).status == 200


@pytest.mark.parametrize(
    "closing",
    [
        b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.0 200 OK\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\nConnection: keep-alive, close\r\nContent-Length: 2\r\n\r\nok",
        b"HTTP/1.1 200 OK\r\n\r\nok",  # no length: the body runs to the connection's end
    ],
)
def test_an_answer_that_ends_the_connection_is_followed_by_a_new_one(serve, closing) -> None:
    server, conn = serve(Closing(closing), OK)
    assert conn.request("GET", "/b/k", b"", {"host": server.host}).body == b"ok"
    assert conn.sock is None
    assert conn.request("GET", "/b/k", b"", {"host": server.host}).body == b"ok"
    assert server.connections == 2


def test_a_connection_closed_while_idle_is_replaced_before_a_request(serve) -> None:
    """A keep-alive connection the server (or a load balancer) closed while idle: the request
    goes out on a new one, not into the closed one, where its outcome would be unknown."""
    server, conn = serve(Closing(OK), OK)
    conn.request("GET", "/b/k", b"", {"host": server.host})
    time.sleep(0.2)  # the server's close reaches this end
    assert conn.request("PUT", "/b/k", b"x", {"host": server.host}).body == b"ok"
    assert server.connections == 2


def test_a_connection_closed_while_a_request_is_on_it_is_a_connection_reset(serve) -> None:
    """What the S3 client retries at once on a reused connection (a PUT's outcome unknown)."""
    server, conn = serve(OK, None, OK)
    conn.request("GET", "/b/k", b"", {"host": server.host})
    with pytest.raises(ConnectionResetError, match="without answering"):
        conn.request("GET", "/b/k", b"", {"host": server.host})
    assert conn.sock is None
    assert conn.request("GET", "/b/k", b"", {"host": server.host}).body == b"ok"


@pytest.mark.parametrize(
    ("answer", "error", "match"),
    [
        (b"SSH-2.0-OpenSSH\r\n\r\n", ProtocolError, "not an HTTP answer"),
        (b"HTTP/1.1 2xx OK\r\n\r\n", ProtocolError, "not an HTTP answer"),
        (b"HTTP/1.1 200 OK\r\nno colon\r\n\r\n", ProtocolError, "without a colon"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: many\r\n\r\n", ProtocolError, "not a length"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: -1\r\n\r\n", ProtocolError, "not a length"),
        (b"HTTP/1.1 200 OK\r\nX-Amz-Request-Id: 1\r\n", ConnectionResetError, "inside"),
        (
            b"HTTP/1.1 200 OK\r\n" + b"X: y\r\n" * 101 + b"\r\n",
            ProtocolError,
            "more than 100 headers",
        ),
        (b"HTTP/1.1 200 OK\r\nX: " + b"y" * 70000 + b"\r\n\r\n", ProtocolError, "longer"),
        (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", ProtocolError, "chunk"),
        (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nshort", ConnectionResetError, "5 of 10"),
    ],
)
def test_a_broken_answer_raises_and_drops_the_connection(serve, answer, error, match) -> None:
    server, conn = serve(Closing(answer))
    with pytest.raises(error, match=match):
        conn.request("GET", "/b/k", b"", {"host": server.host})
    assert conn.sock is None
    assert issubclass(error, OSError)  # the S3 client retries OSErrors


def test_headers_longer_than_the_read_buffer_are_read_line_by_line(serve) -> None:
    many = b"".join(b"X-Meta-%03d: %s\r\n" % (i, b"v" * 200) for i in range(60))
    answer = b"HTTP/1.1 200 OK\r\n" + many + b"Content-Length: 2\r\n\r\nok"
    server, conn = serve(answer, OK)
    first = conn.request("GET", "/b/k", b"", {"host": server.host})
    assert (first.body, len(first.headers), first.headers["x-meta-059"]) == (b"ok", 61, "v" * 200)
    assert conn.request("GET", "/b/k", b"", {"host": server.host}).body == b"ok"


def test_a_large_body_is_sent_whole(serve) -> None:
    server, conn = serve(OK)
    body = bytes(range(256)) * 1024  # 256 KiB: sent after the head, not copied onto it
    assert conn.request("PUT", "/b/big", body, {"host": server.host}).status == 200
    assert server.requests[0].endswith(b"\r\n\r\n" + body)


def test_a_key_s3_would_not_delete_is_an_error_naming_it(serve) -> None:
    """DeleteObjects answers 200 and lists the keys it did not delete: not a silent success."""
    result = (
        b"<DeleteResult><Error><Key>b&amp;c.json</Key><Code>AccessDenied</Code>"
        b"<Message>Access Denied</Message></Error></DeleteResult>"
    )
    answer = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(result), result)
    server, _ = serve(answer)
    requests = S3Requests(
        {"AWS_ENDPOINT_URL": f"http://{server.host}", "AWS_SKIP_SIGNATURE": "true"}
    )
    with pytest.raises(PermissionError, match=r"s3://bucket/b&c.json: AccessDenied Access"):
        requests.delete(["bucket/a\r.json", "bucket/b&c.json"])
    (sent,) = server.requests
    assert sent.startswith(b"POST /bucket/?delete= HTTP/1.1\r\n")
    assert b"<Key>a&#13;.json</Key>" in sent and b"<Key>b&amp;c.json</Key>" in sent
    assert b"content-md5: " in sent
