"""``rmqtx serve``: RocketMQ 5 clients write into the store through RocketMQ's gRPC protocol
(:mod:`rmq_spark.serve`).

:func:`add_arguments` adds its options to ``rmqtx``'s subparser and :func:`run` runs it.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Sequence

from rmq_spark.model.config import Settings, parse_duration
from rmq_spark.model.errors import InvalidMessageError, InvalidOptionError
from rmq_spark.model.messages import check_topic

#: Where access keys came from before accounts moved to the settings file: refused with a
#: pointer to the settings, never echoed.
_OLD_ACCESS_KEYS_ENV = "RMQTX_SERVE_ACCESS_KEYS"
_ACCOUNTS_HELP = (
    "accounts (access keys, secrets and their topics) are in the settings file: "
    '[serve.accounts.<access key>] with secret_key_env = "<VARIABLE>" (or secret_key) and '
    'topics = ["<topic>", "<prefix>*"] (see docs/serve.md)'
)

SUMMARY = "serve RocketMQ 5 clients (gRPC): their sends and transactions go into the store"
EXAMPLES = """\
  rmqtx serve                                 every topic, on 127.0.0.1:8081, TLS and plaintext
  rmqtx serve --topic Orders --topic Payments
  rmqtx --conf serve.toml serve --host 0.0.0.0 --tls-mode enforcing \
      --tls-cert server.pem --tls-key server.key

  Accounts are in the settings file (never on the command line), e.g. in serve.toml:
    [serve.accounts.orders]
    secret_key_env = "ORDERS_SECRET_KEY"
    topics = ["Orders", "OrderEvents*"]"""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the options of ``rmqtx serve`` to its subparser (``--conf`` and ``--path`` are
    ``rmqtx``'s own)."""
    parser.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)"
    )
    parser.add_argument(
        "--port", type=int, default=8081, help="port to listen on (default 8081; 0: any)"
    )
    parser.add_argument(
        "--topic",
        action="append",
        default=[],
        help="a topic to serve (repeatable; default: every valid topic name)",
    )
    parser.add_argument("--access-key", action="append", default=[], help=argparse.SUPPRESS)
    parser.add_argument(
        "--tls-mode",
        choices=("permissive", "enforcing", "disabled"),  # rmq_spark.serve.tls.TlsMode
        default="permissive",
        help="permissive: TLS and plaintext on the port, as RocketMQ's proxy (default); "
        "enforcing: TLS only; disabled: plaintext only",
    )
    parser.add_argument(
        "--tls-cert", help="PEM certificate chain (default: a self-signed one made at start)"
    )
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument(
        "--max-delivery-attempts",
        type=int,
        default=16,
        help="deliveries of a message a consumer group does not acknowledge before it goes to "
        "the group's dead-letter topic %%DLQ%%<group> (default 16, as RocketMQ)",
    )
    parser.add_argument(
        "--auto-offset-reset",
        choices=("latest", "earliest"),
        default="latest",
        help="where a consumer group starts on a topic it never read: its end (latest, the "
        "default, as RocketMQ's proxy) or its first stored message (earliest)",
    )
    parser.add_argument(
        "--invisible-duration",
        default="60s",
        help="how long a message received without an invisible duration (a push consumer's) "
        "stays invisible, renewed while the consumer works on it (default 60s, as RocketMQ)",
    )
    parser.add_argument(
        "--grace",
        default="10s",
        help="how long the calls under way get to finish at SIGTERM (default 10s)",
    )


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run ``rmqtx serve`` until SIGTERM or SIGINT; return the exit code.

    Parameters
    ----------
    args : argparse.Namespace
        The parsed arguments (:func:`add_arguments`).
    settings : Settings
        The settings ``rmqtx`` loaded (``--conf``).

    Raises
    ------
    RmqSparkError
        For bad options (an invalid topic, a malformed access key, unreadable TLS files).
    """
    from rmq_spark.serve.accounts import accounts_from_settings
    from rmq_spark.serve.server import ServeOptions, serve
    from rmq_spark.serve.tls import TlsMode
    from rmq_spark.store.facade import Store

    if not 0 <= args.port <= 65535:
        raise InvalidOptionError(f"--port needs to be 0 to 65535, not {args.port}.")
    if args.access_key:
        raise InvalidOptionError(f"--access-key is gone (argv is public): {_ACCOUNTS_HELP}.")
    if os.environ.get(_OLD_ACCESS_KEYS_ENV):
        raise InvalidOptionError(f"${_OLD_ACCESS_KEYS_ENV} is no longer read: {_ACCOUNTS_HELP}.")
    options = ServeOptions(
        host=args.host,
        port=args.port,
        topics=_topics(args.topic),
        accounts=accounts_from_settings(settings.serve),
        tls_mode=TlsMode(args.tls_mode),
        tls_cert=args.tls_cert,
        tls_key=args.tls_key,
        grace=parse_duration(args.grace, "--grace"),
        max_delivery_attempts=args.max_delivery_attempts,
        auto_offset_reset=args.auto_offset_reset,
        invisible_duration=parse_duration(args.invisible_duration, "--invisible-duration"),
    )
    store = Store.open(getattr(args, "path", None), settings=settings)
    serve(store, options, settings.transaction)
    return 0


def _topics(names: Sequence[str]) -> frozenset[str] | None:
    for name in names:
        try:
            check_topic(name)
        except InvalidMessageError as exc:
            raise InvalidOptionError(f"--topic {name!r}: {exc.message}") from exc
    return frozenset(names) or None
