"""The ``rmqtx serve`` process: a gRPC server (``grpc.aio``) speaking RocketMQ 5's client
protocol in front of a store, until SIGTERM or SIGINT.

A stop is graceful: the server stops accepting calls, ends the clients' telemetry streams, lets
the calls under way finish for up to the grace period (the store's writes of sends already
received finish even when their client gave up), publishes its COMMITs and logs one line of
what it did.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from rocketmq.grpc_protocol import service_pb2_grpc as service_grpc

from rmq_spark.model.config import TransactionSettings
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.serve.accounts import Account
from rmq_spark.serve.protocol import request_limit
from rmq_spark.serve.recovery import ClientCheckBack, Clients
from rmq_spark.serve.service import Counters, MessagingService
from rmq_spark.serve.tls import PortSharing, TlsMode, self_signed
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServeOptions:
    """How ``rmqtx serve`` listens and whom it serves.

    Parameters
    ----------
    host : str, default "127.0.0.1"
        The address to listen on (loopback: only this host's clients).
    port : int, default 8081
        The port (0: any free port, logged at start).
    topics : frozenset of str, optional
        The topics served (others are ``TOPIC_NOT_FOUND``); None serves every valid name.
    accounts : mapping of str to Account
        The accounts clients sign as, by access key (:mod:`rmq_spark.serve.accounts`);
        empty accepts every client.
    tls_mode : TlsMode, default PERMISSIVE
        TLS and plaintext on the port, TLS only or plaintext only (:mod:`rmq_spark.serve.tls`).
    tls_cert, tls_key : str, optional
        PEM files of the server's certificate chain and private key (default, with TLS on:
        a self-signed certificate made at start).
    grace : float, default 10.0
        Seconds the calls under way get to finish at a stop.
    max_delivery_attempts : int, default 16
        How many times a consumer group gets a message it does not acknowledge before the
        message goes to the group's dead-letter topic ``%DLQ%<group>``.
    auto_offset_reset : str, default "latest"
        Where a consumer group starts on a topic it never read: ``latest`` (its end, as
        RocketMQ's proxy) or ``earliest`` (its first message still stored).
    invisible_duration : float, default 60.0
        Seconds a message received without an invisible duration (a push consumer's) stays
        invisible, renewed while its consumer works on it.
    """

    host: str = "127.0.0.1"
    port: int = 8081
    topics: frozenset[str] | None = None
    accounts: Mapping[str, Account] = field(default_factory=dict)
    tls_mode: TlsMode = TlsMode.PERMISSIVE
    tls_cert: str | None = None
    tls_key: str | None = None
    grace: float = 10.0
    max_delivery_attempts: int = 16
    auto_offset_reset: str = "latest"
    invisible_duration: float = 60.0

    def __post_init__(self) -> None:
        if not 1 <= self.invisible_duration <= 12 * 3600:
            raise InvalidOptionError(
                f"--invisible-duration needs to be 1s to 12h, not {self.invisible_duration:g} s."
            )
        if (self.tls_cert is None) != (self.tls_key is None):
            raise InvalidOptionError(
                "TLS needs both a certificate and a key (--tls-cert, --tls-key)."
            )
        if self.tls_cert is not None and self.tls_mode is TlsMode.DISABLED:
            raise InvalidOptionError(
                "--tls-cert is given but --tls-mode is disabled; drop one of them."
            )
        for path in (self.tls_cert, self.tls_key):
            if path is not None and not Path(path).is_file():
                raise InvalidOptionError(f"TLS file {path!r} does not exist or is not a file.")


@dataclass(frozen=True)
class ServeSummary:
    """What a server did between its start and its stop."""

    sends: int
    committed: int
    rolled_back: int
    checks_sent: int


def serve(
    store: Store, options: ServeOptions, transaction: TransactionSettings | None = None
) -> ServeSummary:
    """Serve RocketMQ 5 clients from ``store`` until SIGTERM or SIGINT.

    Parameters
    ----------
    store : Store
        The store's root.
    options : ServeOptions
        Where to listen, topics, access keys, TLS.
    transaction : TransactionSettings, optional
        The check-back pace (``transaction_timeout``, ``transaction_check_interval``);
        default: the built-in settings.

    Returns
    -------
    ServeSummary
        What the server did (also logged at stop).

    Raises
    ------
    InvalidOptionError
        An unreadable TLS file, or an address the server cannot listen on.
    """
    credentials = _credentials(options)
    return asyncio.run(_serve(store, options, transaction or TransactionSettings(), credentials))


def _credentials(options: ServeOptions) -> grpc.ServerCredentials | None:
    """The server's TLS credentials (None: TLS disabled): its files, or a certificate made
    now (its fingerprint logged, for clients that pin it)."""
    if options.tls_mode is TlsMode.DISABLED:
        return None
    if options.tls_cert is None or options.tls_key is None:
        key, cert, fingerprint = self_signed(options.host)
        log.info("TLS with a self-signed certificate made at start (SHA-256 %s)", fingerprint)
        return grpc.ssl_server_credentials([(key, cert)])
    try:
        pair = (Path(options.tls_key).read_bytes(), Path(options.tls_cert).read_bytes())
    except OSError as exc:
        raise InvalidOptionError(f"cannot read a TLS file: {exc}") from exc
    return grpc.ssl_server_credentials([pair])


async def _listen(
    server: grpc.aio.Server, options: ServeOptions, credentials: grpc.ServerCredentials | None
) -> tuple[int, PortSharing | None]:
    """Open the server's port as its TLS mode says: ``(port, the relay of a permissive one)``."""
    address = f"{options.host}:{options.port}"
    try:
        if credentials is None:
            return server.add_insecure_port(address), None
        if options.tls_mode is TlsMode.ENFORCING:
            return server.add_secure_port(address, credentials), None
        sharing = PortSharing(
            server.add_insecure_port("127.0.0.1:0"),
            server.add_secure_port("127.0.0.1:0", credentials),
        )
        return await sharing.start(options.host, options.port), sharing
    except (RuntimeError, OSError) as exc:
        raise InvalidOptionError(f"cannot listen on {address}: {exc} (is it in use?)") from exc


async def _serve(
    store: Store,
    options: ServeOptions,
    transaction: TransactionSettings,
    credentials: grpc.ServerCredentials | None,
) -> ServeSummary:
    loop = asyncio.get_running_loop()
    store.deliveries.configure(
        max_attempts=options.max_delivery_attempts, start=options.auto_offset_reset
    )
    receivable = request_limit(store.settings.max_body_bytes)  # beyond: RESOURCE_EXHAUSTED
    server = grpc.aio.server(options=[("grpc.max_receive_message_length", receivable)])
    port, sharing = await _listen(server, options, credentials)
    clients = Clients()
    service = MessagingService(
        store,
        topics=options.topics,
        accounts=options.accounts,
        clients=clients,
        endpoint=(options.host, port),
    )
    await loop.run_in_executor(None, service.start)
    service_grpc.add_MessagingServiceServicer_to_server(service, server)
    checkback = ClientCheckBack(store, clients, transaction)
    stop = asyncio.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    await server.start()
    _announce(options, port, store.root)
    checking = asyncio.create_task(checkback.run(stop))
    service.invisible_seconds = options.invisible_duration
    sweeping = asyncio.create_task(service.upkeep(stop))
    await stop.wait()
    log.info("stopping: no new calls; the calls under way get %.0f s", options.grace)
    clients.close_all()
    if sharing is not None:
        sharing.stop_listening()
    await server.stop(options.grace)
    if sharing is not None:
        await sharing.close()
    clients.close_all()
    await service.finish_sends()
    await checking
    await sweeping
    await loop.run_in_executor(None, service.close)
    summary = _summary(service.counters, checkback.checks_sent)
    log.info(
        "rmqtx serve stopped: %d sends, %d transactions committed, %d rolled back, %d checks sent",
        summary.sends,
        summary.committed,
        summary.rolled_back,
        summary.checks_sent,
    )
    return summary


#: How each TLS mode is announced at start.
_MODES = {
    TlsMode.PERMISSIVE: "TLS and plaintext",
    TlsMode.ENFORCING: "TLS",
    TlsMode.DISABLED: "plaintext",
}


def _announce(options: ServeOptions, port: int, root: str) -> None:
    log.info(
        "rmqtx serve listening on %s:%d (%s) for the store at %s",
        options.host,
        port,
        _MODES[options.tls_mode],
        root,
    )
    if options.topics is None:
        log.info("serving every valid topic name (no --topic given)")
    else:
        log.info("serving topics %s", ", ".join(sorted(options.topics)))
    log.info(
        "open transactions are asked of their clients once the check-back job lists them: run "
        "'rmqtx check' with [checkers.<topic>] kind = \"clients\" (the topic is the group)"
    )
    if options.tls_mode is not TlsMode.ENFORCING and not _loopback(options.host):
        log.warning(
            "serving PLAINTEXT beyond this host (%s): anyone on the network path reads what "
            "plaintext clients send and can replay their signed requests for about a day; "
            "give those clients TLS and --tls-mode enforcing",
            options.host,
        )
    if not options.accounts:
        log.warning(
            "no accounts configured: any client that can reach %s:%d may send and end "
            "transactions; give each its [serve.accounts.<access key>] in the settings file",
            options.host,
            port,
        )


def _loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this host only."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _summary(counters: Counters, checks_sent: int) -> ServeSummary:
    return ServeSummary(counters.sends, counters.committed, counters.rolled_back, checks_sent)
