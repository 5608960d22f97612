"""TLS for ``rmqtx serve`` as RocketMQ's proxy serves it: TLS and plaintext on one port by
default, so that the official clients connect with their own defaults (the Java and Go clients
use TLS unless told otherwise, the Python client does not).

* :class:`TlsMode`: ``permissive`` (the default: both on one port), ``enforcing`` (TLS only),
  ``disabled`` (plaintext only), the proxy's ``tls.server.mode``.
* :func:`self_signed`: the certificate served when TLS is on and none is given, made at start
  as the proxy makes one. The Java and Go clients do not verify the server's certificate by
  default; give a certificate of your own (``--tls-cert``) for clients that do.
* :class:`PortSharing`: in permissive mode, the public port is a small TCP relay that reads
  a connection's first byte (``0x16`` opens a TLS handshake, anything else is HTTP/2's
  plaintext preface) and passes the connection on, byte for byte, to the gRPC server's TLS
  or plaintext listener on loopback. The gRPC server then sees every client as coming from
  loopback; the relay logs each client's address.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import ipaddress
import logging
import socket

log = logging.getLogger(__name__)

#: The first byte of a TLS record that carries a handshake (a ClientHello).
_TLS_HANDSHAKE = 0x16
#: How much one read of a relayed connection takes at most.
_CHUNK = 256 * 1024
#: How long a new connection may take to send its first byte (gRPC's own handshake timeout
#: is 120 s; a client that connects and says nothing holds no relay longer than this).
FIRST_BYTE_SECONDS = 20.0
#: Once one side of a relayed connection is done, how long the other may go on (to pass on
#: what is in flight) before the relay ends both: a client that stays silent after the server
#: closed held its relay, a task and two descriptors, forever.
LINGER_SECONDS = 2.0


class TlsMode(enum.Enum):
    """Which connections the server's port takes (RocketMQ proxy's ``tls.server.mode``)."""

    PERMISSIVE = "permissive"
    ENFORCING = "enforcing"
    DISABLED = "disabled"


def self_signed(host: str) -> tuple[bytes, bytes, str]:
    """A new self-signed certificate for ``host``, this host's name, ``localhost`` and the
    loopback addresses: ``(private key PEM, certificate PEM, SHA-256 fingerprint)``, valid
    for a year."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    names: list[x509.GeneralName] = [x509.DNSName("localhost"), x509.DNSName(socket.gethostname())]
    for address in {"127.0.0.1", "::1", host}:
        with contextlib.suppress(ValueError):
            names.append(x509.IPAddress(ipaddress.ip_address(address)))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "rmqtx serve")])
    now = datetime.datetime.now(datetime.UTC)
    certificate = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=365))
        .add_extension(x509.SubjectAlternativeName(names), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    fingerprint = certificate.fingerprint(hashes.SHA256()).hex(":").upper()
    return key_pem, certificate.public_bytes(serialization.Encoding.PEM), fingerprint


class PortSharing:
    """The public port of a permissive server: relays each connection to the gRPC server's
    TLS or plaintext listener on loopback, by its first byte (see the module docstring).

    Parameters
    ----------
    plaintext_port, tls_port : int
        The gRPC server's listeners on 127.0.0.1.
    """

    def __init__(self, plaintext_port: int, tls_port: int) -> None:
        self._ports = {False: plaintext_port, True: tls_port}
        self._server: asyncio.Server | None = None
        self._relays: set[asyncio.Task[None]] = set()

    async def start(self, host: str, port: int) -> int:
        """Listen on ``host:port``; return the port (``port`` 0: a free one).

        Raises
        ------
        OSError
            The address cannot be listened on.
        """
        self._server = await asyncio.start_server(self._accept, host, port)
        return self._server.sockets[0].getsockname()[1]

    def stop_listening(self) -> None:
        """Take no new connection (those under way go on)."""
        if self._server is not None:
            self._server.close()

    async def close(self) -> None:
        """End every connection still relayed."""
        self.stop_listening()
        for relay in list(self._relays):
            relay.cancel()
        await asyncio.gather(*self._relays, return_exceptions=True)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        relay = asyncio.current_task()
        assert relay is not None
        self._relays.add(relay)
        try:
            await self._relay(reader, writer)
        except OSError:
            pass  # either side went away (reset, or gone before its end was passed on)
        except asyncio.CancelledError:
            pass  # the server is stopping (close): this relay task ends here, quietly
        finally:
            self._relays.discard(relay)
            writer.close()

    async def _relay(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            first = await asyncio.wait_for(reader.read(1), FIRST_BYTE_SECONDS)
        except TimeoutError:
            log.info("closed a connection from %s that sent nothing", _peer(writer))
            return
        if not first:
            return
        tls = first[0] == _TLS_HANDSHAKE
        log.debug("%s connection from %s", "TLS" if tls else "plaintext", _peer(writer))
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self._ports[tls])
        server_w.write(first)
        pipes = [
            asyncio.ensure_future(_pipe(reader, server_w)),
            asyncio.ensure_future(_pipe(server_r, writer)),
        ]
        try:
            _, going = await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
            if going:
                await asyncio.wait(going, timeout=LINGER_SECONDS)
        finally:
            for pipe in pipes:
                pipe.cancel()
            await asyncio.gather(*pipes, return_exceptions=True)  # retrieved: no warnings
            server_w.close()


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy ``reader`` to ``writer`` until the end, then end ``writer``'s side."""
    while chunk := await reader.read(_CHUNK):
        writer.write(chunk)
        await writer.drain()
    if writer.can_write_eof():
        with contextlib.suppress(OSError):  # the other side is gone already
            writer.write_eof()


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if peer else "an unknown address"
