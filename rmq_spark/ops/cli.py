"""The ``rmqtx`` command line: run the check-back job, re-drive discarded messages.

Examples
--------
rmqtx check --once                       # one check-back round on the configured store
rmqtx check --interval 30s               # a round every 30 s (at least 5s) until SIGTERM
rmqtx check --once --checker order-service=my_service.checks:check_order
rmqtx resume                             # re-drive every discarded message
rmqtx maintain                           # apply retention: expire old messages, vacuum
rmqtx status                             # topics, producer/consumer groups, discards, last run
rmqtx status --json                      # the same, for scripts
rmqtx tail OrderEvents -n 20             # newest committed messages of a topic
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Sequence

from rmq_spark.checkback.checkers import (
    CallableChecker,
    Checker,
    checkers_from_config,
    resolve_function,
)
from rmq_spark.model.config import Settings, configure_logging, load_settings, parse_duration
from rmq_spark.model.errors import InvalidOptionError, RmqSparkError
from rmq_spark.store.facade import Store

log = logging.getLogger("rmq_spark.ops.cli")

#: Exit codes: 0 done, 1 a run failed, 2 bad usage or configuration.
EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2
#: Shortest pause between check-back rounds (seconds) that ``rmqtx check`` accepts.
MIN_CHECK_INTERVAL = 5.0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rmqtx`` (all subcommands)."""
    parser = argparse.ArgumentParser(
        prog="rmqtx", description="rmq-spark: transactional messages on Spark and Delta Lake."
    )
    parser.add_argument(
        "--conf", help="settings file (default: $RMQ_SPARK_CONF or conf/rmq-spark.toml)"
    )
    parser.add_argument("--path", help="store root (default: store.path of the settings)")
    sub = parser.add_subparsers(dest="command", required=True)

    check = sub.add_parser("check", help="run the check-back job (resolve pending transactions)")
    check.add_argument(
        "--master",
        default="local[2]",
        help="Spark master URL, e.g. spark://host:7077 (default local[2]; under spark-submit, "
        "its --master is used)",
    )
    mode = check.add_mutually_exclusive_group()
    mode.add_argument("--once", action="store_true", help="run one round and exit")
    mode.add_argument(
        "--interval",
        help="time from one round's start to the next, e.g. 30s, at least 5s "
        "(default: transaction.transaction_check_interval)",
    )
    check.add_argument(
        "--checker",
        action="append",
        default=[],
        metavar="GROUP=MODULE:FUNCTION",
        help="route a producer group to a Python checker function (repeatable)",
    )
    check.add_argument(
        "--skip-unrouted",
        action="store_true",
        help="expect groups without a checker: count their pending transactions, do not warn",
    )

    resume = sub.add_parser("resume", help="re-drive discarded messages into the check-back cycle")
    resume.add_argument(
        "--transaction-id",
        action="append",
        metavar="ID",
        help="a discarded transaction to re-drive (repeatable; default: all)",
    )

    sub.add_parser(
        "maintain",
        help="apply the [retention] settings: expire old messages and decided transactions, "
        "vacuum unused files (rmqtx check also does it every maintenance_interval)",
    )

    status = sub.add_parser(
        "status",
        help="topics, pending transactions per producer group, consumer lag, discards, last run",
    )
    status.add_argument("--json", action="store_true", help="print JSON instead of tables")

    tail = sub.add_parser("tail", help="print the newest committed messages of a topic")
    tail.add_argument("topic")
    tail.add_argument("-n", "--count", type=int, default=10, help="how many (default 10)")
    tail.add_argument("--json", action="store_true", help="print JSON instead of a table")
    return parser


def _checkers(settings: Settings, overrides: Sequence[str]) -> dict[str, Checker]:
    checkers = checkers_from_config(settings.checkers)
    for spec in overrides:
        group, sep, function = spec.partition("=")
        if not sep:
            raise RmqSparkError(f"--checker {spec!r} is not GROUP=MODULE:FUNCTION.")
        checkers.update(checkers_from_config({group: {"kind": "callable", "function": function}}))
    return checkers


def _check_interval(args: argparse.Namespace, settings: Settings) -> float | None:
    """The loop's interval (None with ``--once``), refused below :data:`MIN_CHECK_INTERVAL`."""
    if args.once:
        return None
    if args.interval:
        name, text = "--interval", args.interval
        interval = parse_duration(args.interval, name)
    else:
        name = "transaction.transaction_check_interval"
        interval = settings.transaction.transaction_check_interval
        text = f"{interval:g}s"
    if interval < MIN_CHECK_INTERVAL:
        raise InvalidOptionError(
            f"{name} {text} is below the minimum of {MIN_CHECK_INTERVAL:g} s: every round "
            "spends one check of each unanswered transaction's budget "
            "(transaction_check_max), so rounds back to back would discard them within "
            "seconds. Use e.g. 30s (RocketMQ 5's default), or --once from a scheduler."
        )
    return interval


def _check(args: argparse.Namespace, settings: Settings) -> int:
    # Every argument is checked before the store is opened or Spark started.
    interval = _check_interval(args, settings)
    checkers = _checkers(settings, args.checker)
    for checker in checkers.values():
        if isinstance(checker, CallableChecker) and isinstance(checker.function, str):
            resolve_function(checker.function)
    store = Store.open(args.path, settings=settings, create=False)

    from rmq_spark.checkback.job import CheckBackJob
    from rmq_spark.spark.session import get_spark

    spark = get_spark(
        "rmqtx-check-back", master=args.master, settings=settings, store_root=store.root
    )
    job = CheckBackJob(
        spark,
        store,
        checkers,
        settings.transaction,
        skip_unrouted=args.skip_unrouted,
        retention=settings.retention,
    )
    if interval is None:
        job.run_once()
        return EXIT_OK
    stop = threading.Event()

    def request_stop(signum: int, _frame: object) -> None:
        log.info("received %s; stopping after the current round", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    log.info(
        "check-back loop every %.0f s on %s (SIGTERM or Ctrl-C stops it)", interval, store.root
    )
    job.run_forever(interval, stop)
    return EXIT_OK


def _resume(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.checkback.discards import redrive

    store = Store.open(args.path, settings=settings, create=False)
    new_ids = redrive(store, args.transaction_id)
    print(f"re-drove {len(new_ids)} discarded message(s); the check-back job will check them again")
    return EXIT_OK


def _maintain(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.store.retention import maintain

    summary = maintain(Store.open(args.path, settings=settings, create=False), settings.retention)
    print(summary.format())
    return EXIT_OK


def _status(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.ops.status import format_status, store_status, to_json

    status = store_status(Store.open(args.path, settings=settings, create=False))
    print(to_json(status) if args.json else format_status(status))
    return EXIT_OK


def _tail(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.ops.status import format_tail, tail, to_json

    if args.count < 1:
        raise RmqSparkError(f"-n/--count needs to be at least 1, not {args.count}.")
    messages = tail(Store.open(args.path, settings=settings, create=False), args.topic, args.count)
    print(to_json(messages) if args.json else format_tail(messages))
    return EXIT_OK


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``rmqtx``; returns the exit code."""
    args = build_parser().parse_args(argv)
    try:
        settings = load_settings(args.conf)
        configure_logging(settings.log_level)
        handler = {
            "check": _check,
            "resume": _resume,
            "maintain": _maintain,
            "status": _status,
            "tail": _tail,
        }[args.command]
        return handler(args, settings)
    except RmqSparkError as exc:
        print(f"rmqtx {args.command}: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    except Exception:
        log.exception("rmqtx %s failed", args.command)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
