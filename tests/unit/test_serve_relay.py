"""The port ``rmqtx serve`` shares between TLS and plaintext (:class:`PortSharing`): each
connection is relayed to one of two loopback listeners by its first byte, and no client holds
a relay once either side is done."""

from __future__ import annotations

import asyncio

import pytest

pytest.importorskip("rocketmq", reason="the serve extra (rocketmq-python-client) is not installed")

from rmq_spark.serve import tls  # noqa: E402


async def _backend(handle) -> tuple[asyncio.Server, int]:
    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


def test_a_client_that_stays_silent_after_the_server_closed_holds_no_relay() -> None:
    """gRPC closes a connection whose preface is wrong; a client that then says nothing kept
    its relay (a task and two descriptors) forever: fifty of them exhaust nothing, thousands
    the server's descriptors (found by review)."""

    async def scenario() -> int:
        async def close_after_one_byte(reader, writer):
            await reader.read(1)
            writer.close()

        backend, port = await _backend(close_after_one_byte)
        sharing = tls.PortSharing(port, port)
        public = await sharing.start("127.0.0.1", 0)
        clients = []
        for _ in range(20):
            reader, writer = await asyncio.open_connection("127.0.0.1", public)
            writer.write(b"X")  # then nothing, never closing
            await writer.drain()
            clients.append((reader, writer))
        for reader, _ in clients:
            assert await asyncio.wait_for(reader.read(10), 5) == b""  # the relay ended it
        await asyncio.sleep(tls.LINGER_SECONDS + 0.5)
        left = len(sharing._relays)
        await sharing.close()
        backend.close()
        return left

    assert asyncio.run(scenario()) == 0


def test_bytes_pass_both_ways_by_the_first_byte() -> None:
    async def scenario() -> tuple[bytes, bytes]:
        async def echo(tag: bytes):
            async def handle(reader, writer):
                writer.write(tag + await reader.read(100))
                await writer.drain()
                writer.close()

            return handle

        plain, plain_port = await _backend(await echo(b"plain:"))
        secure, secure_port = await _backend(await echo(b"tls:"))
        sharing = tls.PortSharing(plain_port, secure_port)
        public = await sharing.start("127.0.0.1", 0)
        got = []
        for first in (b"PRI * HTTP/2.0", b"\x16\x03\x01"):
            reader, writer = await asyncio.open_connection("127.0.0.1", public)
            writer.write(first)
            await writer.drain()
            got.append(await asyncio.wait_for(reader.read(100), 5))
            writer.close()
        await sharing.close()
        plain.close()
        secure.close()
        return got[0], got[1]

    assert asyncio.run(scenario()) == (b"plain:PRI * HTTP/2.0", b"tls:\x16\x03\x01")
