"""A TCP proxy on loopback that gives every HTTP request an object store's round trip, and
counts requests by method: put in front of MinIO, it turns a disk-fast S3 server into one
that costs what S3 costs (20-50 ms a request), so a benchmark shows how many sequential round
trips a design needs.

Each request (request line and headers, then ``Content-Length`` bytes of body) is held for
``delay_ms`` once, when its headers arrive, then passed on; responses pass at once. Requests
are counted by method (``GET``, ``PUT``, ``HEAD``, ``POST``, ``DELETE``), and ``LIST`` apart
from ``GET`` (a GET with ``list-type=`` or on a bucket with a ``prefix=``).

:meth:`LatencyProxy.refuse` answers requests whose target holds a given text with an S3
error of its own (an IAM policy's ``AccessDenied``, a throttled ``SlowDown``) instead of passing
them on: the store's client sees the real response of a real HTTP exchange.

Usage as a program: python tests/latency_proxy.py LISTEN_PORT TARGET_PORT DELAY_MS
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading
from collections import Counter
from concurrent.futures import Future


class LatencyProxy:
    """A proxy on ``127.0.0.1:port`` to ``127.0.0.1:target`` that delays each request.

    Parameters
    ----------
    target : int
        The server's port.
    delay_ms : float
        The delay added to every request.
    port : int, default 0
        The port to listen on (0: a free one, see :attr:`port` after :meth:`start`).
    record : bool, default False
        Keep every request's method and target in :attr:`requests` (to see where they go).
    """

    def __init__(self, target: int, delay_ms: float, port: int = 0, record: bool = False) -> None:
        self.target, self.delay, self.port = target, delay_ms / 1000, port
        self.counts: Counter[str] = Counter()
        self.requests: list[tuple[str, str]] | None = [] if record else None
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: asyncio.AbstractServer | None = None
        #: [text in the target, status, S3 error code, requests left to refuse]
        self._refusals: list[list] = []

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> LatencyProxy:
        """Listen, on a thread of its own."""
        self._thread.start()
        started: Future[asyncio.AbstractServer] = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._handle, "127.0.0.1", self.port), self._loop
        )
        self._server = started.result(timeout=10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        """Stop listening, close the connections and end the thread."""
        asyncio.run_coroutine_threadsafe(self._close(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    async def _close(self) -> None:
        if self._server is not None:
            self._server.close()
        tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def refuse(self, text: str, status: int = 403, code: str = "AccessDenied", times: int = 1):
        """Answer the next ``times`` requests whose target holds ``text`` with HTTP ``status``
        and the S3 error ``code``, without passing them on."""
        self._refusals.append([text, status, code, times])

    def allow(self) -> None:
        """Refuse nothing any more."""
        self._refusals.clear()

    def _refusal(self, method: str, target: str) -> bytes | None:
        """The response refusing a ``method`` request for ``target``, if one is due."""
        for refusal in self._refusals:
            text, status, code, left = refusal
            if left > 0 and text in target:
                refusal[3] -= 1
                body = f"<?xml version='1.0'?><Error><Code>{code}</Code></Error>".encode()
                body = b"" if method == "HEAD" else body
                head = (
                    f"HTTP/1.1 {status} {code}\r\nContent-Type: application/xml\r\n"
                    f"Content-Length: {len(body)}\r\n\r\n"
                )
                return head.encode() + body
        return None

    def take_counts(self) -> Counter[str]:
        """The requests counted since the last call, by method; the count starts again."""
        counts = self.counts.copy()
        self.counts.clear()
        return counts

    async def _handle(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter):
        try:
            server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            client_w.close()
            return
        with contextlib.suppress(asyncio.CancelledError):  # stop() ends every connection
            await asyncio.gather(
                self._requests(client_r, server_w, client_w),
                _pipe(server_r, client_w),
                return_exceptions=True,
            )

    async def _requests(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        client: asyncio.StreamWriter,
    ):
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                method, target, length = _parse(head)
                kind = "LIST" if _is_list(method, target) else method
                self.counts[kind] += 1
                if self.requests is not None:
                    self.requests.append((kind, target))
                if self.delay:
                    await asyncio.sleep(self.delay)
                refusal = self._refusal(method, target)
                if refusal is not None:  # the body is read and dropped (clients send no more
                    if length is None:  # than one request at a time on a connection)
                        await _forward_chunked(reader, _Dropped())
                    else:
                        await reader.readexactly(length)
                    client.write(refusal)
                    await client.drain()
                    continue
                writer.write(head)
                if length is None:
                    await _forward_chunked(reader, writer)
                else:
                    writer.write(await reader.readexactly(length))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        except asyncio.CancelledError:
            pass
        finally:
            writer.close()


def _parse(head: bytes) -> tuple[str, str, int | None]:
    """A request's method, target and body length (None: a chunked body)."""
    lines = head.decode("latin-1").split("\r\n")
    method, target, *_ = lines[0].split(" ")
    length: int | None = 0
    for line in lines[1:]:
        name, _, value = line.partition(":")
        name, value = name.strip().lower(), value.strip().lower()
        if name == "content-length":
            length = int(value)
        elif name == "transfer-encoding" and "chunked" in value:
            return method, target, None
    return method, target, length


async def _forward_chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Pass on a chunked body: chunks up to the last (size 0), then trailers to a blank line."""
    while True:
        size_line = await reader.readuntil(b"\r\n")
        writer.write(size_line)
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        writer.write(await reader.readexactly(size + 2))
    while (line := await reader.readuntil(b"\r\n")) != b"\r\n":
        writer.write(line)
    writer.write(line)


class _Dropped:
    """Where a refused request's chunked body goes."""

    def write(self, data: bytes) -> None:
        pass


def _is_list(method: str, target: str) -> bool:
    return method == "GET" and ("list-type=" in target or "prefix=" in target)


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while data := await reader.read(1 << 16):
            writer.write(data)
            await writer.drain()
    except (ConnectionError, asyncio.CancelledError):
        pass
    finally:
        writer.close()


if __name__ == "__main__":
    listen, target, delay = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
    proxy = LatencyProxy(target, delay, listen).start()
    print(f"{proxy.endpoint} -> 127.0.0.1:{target}, +{delay:g} ms a request", flush=True)
    threading.Event().wait()
