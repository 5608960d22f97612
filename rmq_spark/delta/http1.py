"""A keep-alive HTTP/1.1 connection for :mod:`rmq_spark.delta.s3requests`: one request at a
time, its answer read whole.

``http.client`` parses every answer's headers with the ``email`` package; against MinIO on
loopback, a 256-byte PUT or GET through it cost 262 to 310 us of the client's CPU, and through
this 133 to 162 us. S3 answers with a status line, a handful of headers and a body whose length
is given (or chunked): that is all that is read here.

What the connection does for its caller: TLS verified with the caller's context (the host's
name for SNI and the check), ``TCP_NODELAY``, the request's head and a small body in one send,
1xx answers skipped, a chunked or length-delimited body, and the connection closed when the
server says ``Connection: close``, sends a body until its end, or anything fails midway (the
stream's place is then unknown). A connection the server closed while idle is replaced before
a request is sent on it; one closed while a request was on its way raises
``ConnectionResetError``, as does an answer cut short; an answer that is not HTTP raises
:class:`ProtocolError`. All are ``OSError``\\ s.
"""

from __future__ import annotations

import select
import socket
import ssl
import urllib.parse
from collections.abc import Mapping
from typing import BinaryIO, NamedTuple

#: The longest status or header line read, and the most headers (``http.client``'s limits).
_MAX_LINE = 65536
_MAX_HEADERS = 100
#: A body at least this large is sent after the head, not copied onto it.
_SEPARATE_BODY = 64 * 1024


class ProtocolError(ConnectionError):
    """An answer that is not HTTP/1.x as an S3 endpoint speaks it."""


class Response(NamedTuple):
    """A request's answer: its status, its headers (names in lower case) and its body."""

    status: int
    headers: dict[str, str]
    body: bytes


class Connection:
    """A keep-alive connection to ``host`` (``name`` or ``name:port``), TLS when ``secure``."""

    def __init__(self, host: str, secure: bool, tls: ssl.SSLContext, timeout: float) -> None:
        parts = urllib.parse.urlsplit(f"//{host}")
        self._name = parts.hostname or host
        self._port = parts.port or (443 if secure else 80)
        self._tls = tls if secure else None
        self._timeout = timeout
        self.sock: socket.socket | None = None
        self._reader: BinaryIO | None = None

    def request(
        self, method: str, target: str, body: bytes, headers: Mapping[str, str]
    ) -> Response:
        """Send a request (``headers`` without ``Content-Length``: it is added here) and read
        its answer whole."""
        lines = [f"{method} {target} HTTP/1.1", *(f"{k}: {v}" for k, v in headers.items())]
        if body or method in ("PUT", "POST"):
            lines.append(f"content-length: {len(body)}")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        try:
            sock, reader = self._open()
            if len(body) < _SEPARATE_BODY:
                sock.sendall(head + body)
            else:
                sock.sendall(head)
                sock.sendall(body)
            response, keep = _read_response(reader)
        except BaseException:
            self.close()
            raise
        if not keep:
            self.close()
        return response

    def close(self) -> None:
        """Close the connection; the next request opens another."""
        sock, reader, self.sock, self._reader = self.sock, self._reader, None, None
        if reader is not None:
            reader.close()
        if sock is not None:
            sock.close()

    def _open(self) -> tuple[socket.socket, BinaryIO]:
        if self.sock is not None and _readable(self.sock):
            # Closed by the server while idle (or an answer no request asked for, a 408): a
            # request sent there would be lost, its outcome unknown.
            self.close()
        if self.sock is None or self._reader is None:
            sock = socket.create_connection((self._name, self._port), timeout=self._timeout)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                if self._tls is not None:
                    sock = self._tls.wrap_socket(sock, server_hostname=self._name)
            except BaseException:
                sock.close()
                raise
            self.sock, self._reader = sock, sock.makefile("rb")
        return self.sock, self._reader


def _read_response(reader: BinaryIO) -> tuple[Response, bool]:
    """The answer on ``reader``, and whether the connection may carry another request."""
    while True:
        status_line = _line(reader)
        if not status_line:
            raise ConnectionResetError("the server closed the connection without answering")
        version, _, rest = status_line.partition(b" ")
        try:
            status = int(rest[:3])
        except ValueError:
            status = 0
        if not version.startswith(b"HTTP/1.") or not 100 <= status <= 599:
            raise ProtocolError(f"not an HTTP answer: {status_line[:80]!r}")
        headers = _headers(reader)
        if status >= 200:  # an informational answer (100 Continue) comes before the real one
            break
    tokens = {t.strip() for t in headers.get("connection", "").lower().split(",")}
    keep = version != b"HTTP/1.0" and "close" not in tokens
    if status in (204, 304):
        return Response(status, headers, b""), keep
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return Response(status, headers, _chunked(reader)), keep
    length = headers.get("content-length")
    if length is None:  # the body runs to the connection's end
        return Response(status, headers, reader.read()), False
    try:
        size = int(length)
    except ValueError:
        size = -1
    if size < 0:
        raise ProtocolError(f"a Content-Length that is not a length: {length[:40]!r}")
    return Response(status, headers, _exactly(reader, size)), keep


def _headers(reader: BinaryIO) -> dict[str, str]:
    """The header lines up to the blank line: taken in one read when they are all in the
    reader's buffer already (an S3 answer's usually are), else line by line."""
    buffered = reader.peek(_MAX_LINE)  # type: ignore[attr-defined]
    if buffered.startswith(b"\r\n"):  # no headers
        reader.read(2)
        return {}
    end = buffered.find(b"\r\n\r\n")
    if end > 0:
        lines = reader.read(end + 4)[:end].split(b"\r\n")
    else:
        lines = []
        while (line := _line(reader)) not in (b"\r\n", b"\n"):
            if not line:
                raise ConnectionResetError("the answer ended inside its headers")
            lines.append(line)
            if len(lines) > _MAX_HEADERS:
                break
    if len(lines) > _MAX_HEADERS:
        raise ProtocolError(f"more than {_MAX_HEADERS} headers in an answer")
    headers: dict[str, str] = {}
    for line in lines:
        name, sep, value = line.partition(b":")
        if not sep:
            raise ProtocolError(f"a header line without a colon: {line[:80]!r}")
        headers[name.strip().lower().decode("latin-1")] = value.strip().decode("latin-1")
    return headers


def _chunked(reader: BinaryIO) -> bytes:
    parts = []
    while True:
        size_line = _line(reader).split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError:
            raise ProtocolError(f"a chunk size that is not a number: {size_line[:40]!r}") from None
        if size == 0:
            _headers(reader)  # the trailer
            return b"".join(parts)
        parts.append(_exactly(reader, size))
        _line(reader)


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read (or its end) before a request is sent on it."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))


def _exactly(reader: BinaryIO, size: int) -> bytes:
    data = reader.read(size)
    if len(data) != size:
        raise ConnectionResetError(f"the answer ended after {len(data)} of {size} bytes")
    return data


def _line(reader: BinaryIO) -> bytes:
    line = reader.readline(_MAX_LINE + 1)
    if len(line) > _MAX_LINE:
        raise ProtocolError(f"an answer's line is longer than {_MAX_LINE} bytes")
    return line
