"""The ``rmqtx`` commands that show a store: ``status`` (its views, ``--watch``), ``tail``
(``--follow``) and ``ui`` (:mod:`rmq_spark.ops.ui.server`)."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable

import pyarrow as pa
from deltalake.exceptions import DeltaError

from rmq_spark.model.config import Settings, parse_duration
from rmq_spark.model.errors import InvalidOptionError, RmqSparkError
from rmq_spark.ops.views import VIEWS
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: ``status --watch``'s shortest interval, and how often ``tail --follow`` looks.
MIN_WATCH_INTERVAL = FOLLOW_INTERVAL = 1.0
#: ANSI: clear the terminal and go to its top left (``status --watch``).
CLEAR_SCREEN = "\x1b[2J\x1b[H"
UI_SUMMARY = "a web dashboard of the store's views, on loopback, refreshing itself"


def add_status_arguments(parser: argparse.ArgumentParser) -> None:
    """``rmqtx status``'s arguments."""
    parser.add_argument(
        "view",
        nargs="?",
        choices=sorted(VIEWS),
        help="one view in detail: groups (lag per queue), transactions (pending by age, "
        "check-back runs), topics (rates, oldest stored), store (shards, tables); default: "
        "a summary of each",
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")
    parser.add_argument(
        "--watch",
        nargs="?",
        const="2s",
        metavar="INTERVAL",
        help="print it again every INTERVAL (default 2s) until Ctrl-C",
    )


def add_tail_arguments(parser: argparse.ArgumentParser) -> None:
    """``rmqtx tail``'s arguments."""
    parser.add_argument("topic", help="the topic (names are case-sensitive; status lists them)")
    parser.add_argument("-n", "--count", type=int, default=10, help="how many (default 10)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "-f",
        "--follow",
        action="store_true",
        help="then print each new message as it is committed, until Ctrl-C",
    )


def add_ui_arguments(parser: argparse.ArgumentParser) -> None:
    """``rmqtx ui``'s arguments."""
    parser.add_argument(
        "--host",
        default="127.0.0.1",
        help="address to bind (default 127.0.0.1); beyond loopback it serves HTTPS to the "
        "accounts with dashboard = true only",
    )
    parser.add_argument("--port", type=int, default=8088, help="port (default 8088; 0: any free)")
    parser.add_argument(
        "--sample-interval",
        default="30s",
        metavar="INTERVAL",
        help="how often the lag charts sample the consumer groups (default 30s)",
    )
    parser.add_argument(
        "--tls-cert",
        help="PEM certificate chain beyond loopback (default: a self-signed one made at start)",
    )
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")


def run_status(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.ops.status import format_status, store_status, to_json
    from rmq_spark.ops.view_text import FORMATS

    interval = parse_duration(args.watch, "--watch") if args.watch else None
    if interval is not None and interval < MIN_WATCH_INTERVAL:
        raise InvalidOptionError(
            f"--watch needs at least {MIN_WATCH_INTERVAL:g}s, not {args.watch}."
        )
    store = Store.open(args.path, settings=settings, create=False)

    def show() -> None:
        if args.view is None:
            status = store_status(store)
            text = format_status(status)
        else:
            status = VIEWS[args.view](store, settings.retention)
            text = FORMATS[args.view](status)
        if args.json:
            print(to_json(status) if interval is None else json.dumps(status, default=str))
        elif interval is not None:
            print(CLEAR_SCREEN + text + f"\n\nevery {args.watch}; Ctrl-C stops")
        else:
            print(text)
        sys.stdout.flush()

    return repeat(show, interval)


def repeat(show: Callable[[], None], interval: float | None) -> int:
    """``show()`` once, or every ``interval`` seconds until Ctrl-C; the exit code (0). While
    repeating, a look that fails (a store that did not answer) is logged and tried again."""
    if interval is None:
        show()
        return 0
    try:
        while True:
            started = time.monotonic()
            try:
                show()
            except (OSError, DeltaError, pa.ArrowException) as exc:
                log.warning("could not read the store (%s); trying again", exc)
            time.sleep(max(0.0, interval - (time.monotonic() - started)))
    except KeyboardInterrupt:
        return 0


def run_tail(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.ops.status import to_json
    from rmq_spark.ops.tail import Follower, format_tail, tail

    if args.count < 1:
        raise RmqSparkError(f"-n/--count needs to be at least 1, not {args.count}.")
    store = Store.open(args.path, settings=settings, create=False)
    if not args.follow:
        messages = tail(store, args.topic, args.count)
        print(to_json(messages) if args.json else format_tail(messages))
        return 0
    # Following: the newest from one snapshot, oldest first, then each message committed
    # after that snapshot; with --json, one JSON object a line.
    commitlog = store.table("commitlog")
    try:
        messages = tail(store, args.topic, args.count, commitlog)
    except InvalidOptionError as exc:  # no messages yet (or all expired): wait for some
        print(f"rmqtx tail: {exc} Waiting for its first.", file=sys.stderr, flush=True)
        messages = []
    if messages:
        print(
            "\n".join(json.dumps(m) for m in reversed(messages))
            if args.json
            else format_tail(messages[::-1]),
            flush=True,
        )
    follow = Follower(store, args.topic, commitlog)

    def show() -> None:
        for message in follow.new_messages():
            print(json.dumps(message) if args.json else format_tail([message], header=False))
        sys.stdout.flush()

    return repeat(show, FOLLOW_INTERVAL)


def run_ui(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.ops.ui.server import is_loopback, serve, tls_context
    from rmq_spark.serve.accounts import accounts_from_settings

    interval = parse_duration(args.sample_interval, "--sample-interval")
    if interval < MIN_WATCH_INTERVAL:
        raise InvalidOptionError(f"--sample-interval needs at least {MIN_WATCH_INTERVAL:g}s.")
    accounts = accounts_from_settings(settings.serve)
    # Beyond loopback, TLS (made after the accounts are known to allow it at all).
    wider = not is_loopback(args.host) and any(a.dashboard for a in accounts.values())
    tls = tls_context(args.host, args.tls_cert, args.tls_key) if wider else None
    store = Store.open(args.path, settings=settings, create=False)
    serve(
        store,
        settings.retention,
        args.host,
        args.port,
        interval,
        accounts,
        tls,
        lambda s: print(s, flush=True),
    )
    return 0
