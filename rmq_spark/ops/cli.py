"""The ``rmqtx`` command line: run the check-back job, re-drive discarded messages, maintain,
show and grow a store; each over every shard of the store (:mod:`rmq_spark.store.shards`).
The commands that show a store (``status``, ``tail``, ``ui``) are in
:mod:`rmq_spark.ops.view_cli`, ``serve`` in :mod:`rmq_spark.ops.serve_cli`.

Every subcommand's ``--help`` shows its examples (:data:`EXAMPLES`); ``--conf`` and ``--path``
go before the subcommand or after it.
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
from rmq_spark.model.messages import MAX_SHARDS
from rmq_spark.ops import serve_cli, view_cli
from rmq_spark.store.facade import Store

log = logging.getLogger("rmq_spark.ops.cli")

#: Exit codes: 0 done, 1 a run failed, 2 bad usage or configuration, 3 ``check --once`` left
#: pending transactions unchecked for want of a checker for their producer group.
EXIT_OK, EXIT_FAILED, EXIT_CONFIG, EXIT_UNROUTED = 0, 1, 2, 3
#: Shortest pause between check-back rounds (seconds) that ``rmqtx check`` accepts.
MIN_CHECK_INTERVAL = 5.0
#: ``maintain`` asks before expiring messages younger than this (seconds).
_DAY = 86400.0


#: Examples shown by each subcommand's ``--help``.
EXAMPLES = {
    "check": """\
  rmqtx check --once                          one round on the configured store, then exit
  rmqtx check --interval 30s                  a round every 30 s until SIGTERM or Ctrl-C
  rmqtx check --once --checker order-service=my_service.checks:check_order
  rmqtx check --once --path s3://bucket/store --master spark://host:7077""",
    "resume": """\
  rmqtx resume                                re-drive every discarded message
  rmqtx resume --transaction-id 0193A1...     re-drive one discarded transaction""",
    "maintain": """\
  rmqtx maintain --dry-run                    what it would expire, per topic and queue
  rmqtx maintain                              expire old messages and decided transactions
  rmqtx maintain --conf prod.toml             with the [retention] settings of prod.toml""",
    "status": """\
  rmqtx status                                topics, groups, consumer lag, discards, last run
  rmqtx status --json | jq .consumer_groups   the same, for scripts
  rmqtx status groups                         lag per consumer group and queue, last progress
  rmqtx status transactions --watch           pending by age, check-back runs; every 2 s
  rmqtx status topics --json                  messages, rates, oldest stored, as JSON
  rmqtx status store                          shards, table versions and sizes, retention""",
    "shards": """\
  rmqtx shards                                how many shards the store has
  rmqtx shards --set 4 --yes                  grow the store to 4 shards (never fewer)""",
    "ui": """\
  rmqtx ui                                    http://127.0.0.1:8088/ : overview, groups, ...
  rmqtx ui --port 9000 --sample-interval 10s  another port; lag charts sampled every 10 s""",
    "tail": """\
  rmqtx tail OrderEvents                      the 10 newest committed messages of a topic
  rmqtx tail OrderEvents -n 50 --json         the 50 newest, as JSON
  rmqtx tail OrderEvents --follow             then each new message as it is committed""",
    "serve": serve_cli.EXAMPLES,
}


def _store_options(parser: argparse.ArgumentParser, *, default: object) -> None:
    """``--conf`` and ``--path``, accepted before the subcommand and after it."""
    parser.add_argument(
        "--conf",
        default=default,
        help="settings file (default: $RMQ_SPARK_CONF or conf/rmq-spark.toml)",
    )
    parser.add_argument(
        "--path", default=default, help="store root (default: store.path of the settings)"
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``rmqtx`` (all subcommands)."""
    from rmq_spark._version import __version__

    parser = argparse.ArgumentParser(
        prog="rmqtx",
        description="rmq-spark: transactional messages on Spark and Delta Lake.",
        epilog="Run 'rmqtx COMMAND --help' for a command's options and examples.",
    )
    parser.add_argument("--version", action="version", version=f"rmqtx {__version__}")
    _store_options(parser, default=None)
    # After the subcommand too; not given there, they keep what was given before it.
    common = argparse.ArgumentParser(add_help=False)
    _store_options(common, default=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def command(name: str, summary: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name,
            parents=[common],
            help=summary,
            description=summary[0].upper() + summary[1:] + ".",
            epilog="examples:\n" + EXAMPLES[name],
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )

    check = command("check", "run the check-back job (resolve pending transactions)")
    check.add_argument(
        "--master",
        default="local[2]",
        help="Spark master URL, e.g. spark://host:7077 (default local[2]; under spark-submit, "
        "its --master is used)",
    )
    mode = check.add_mutually_exclusive_group()
    mode.add_argument(
        "--once",
        action="store_true",
        help="run one round and exit (exit code 3 when pending transactions of a producer "
        "group without a checker were left unchecked, unless --skip-unrouted)",
    )
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

    resume = command("resume", "re-drive discarded messages into the check-back cycle")
    resume.add_argument(
        "--transaction-id",
        action="append",
        metavar="ID",
        help="a discarded transaction to re-drive (repeatable; default: all)",
    )

    maintain = command(
        "maintain",
        "apply the [retention] settings: expire old messages and decided transactions, "
        "vacuum unused files (rmqtx check also does it every maintenance_interval)",
    )
    maintain.add_argument(
        "--dry-run", action="store_true", help="say what would expire, per queue; change nothing"
    )
    maintain.add_argument(
        "--yes",
        action="store_true",
        help="expire without asking even messages younger than a day or a whole topic",
    )

    view_cli.add_status_arguments(
        command(
            "status",
            "topics, pending transactions per producer group, consumer lag, discards, last run",
        )
    )

    shards = command(
        "shards",
        "show how many shards the store has, or grow it: producer processes on many hosts "
        "each write to a shard of their own",
    )
    shards.add_argument(
        "--set",
        type=int,
        metavar="N",
        help=f"make the store have N shards (1 to {MAX_SHARDS}); a store never loses a shard",
    )
    shards.add_argument(
        "--yes", action="store_true", help="grow the store without asking (cannot be undone)"
    )

    view_cli.add_tail_arguments(command("tail", "print the newest committed messages of a topic"))
    view_cli.add_ui_arguments(command("ui", view_cli.UI_SUMMARY))
    serve_cli.add_arguments(command("serve", serve_cli.SUMMARY))
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
        unrouted = job.run_once().summary.unrouted
        if unrouted and not args.skip_unrouted:
            print(
                f"rmqtx check: {unrouted} pending transaction(s) were not checked: their producer "
                "group has no checker (route it: [checkers.<group>] in the settings, or "
                "--checker GROUP=MODULE:FUNCTION; or pass --skip-unrouted if that is meant), or "
                "their ids name another shard (rows another Delta writer put there: see the "
                "warning above).",
                file=sys.stderr,
            )
            return EXIT_UNROUTED
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
    print(
        f"re-drove {len(new_ids)} discarded message(s); the check-back job will check them again"
        if new_ids
        else "nothing to re-drive: no discarded message waits"
    )
    return EXIT_OK


def _maintain(args: argparse.Namespace, settings: Settings) -> int:
    from rmq_spark.store.retention import expiry_plan, maintain
    from rmq_spark.store.retention_summary import emptied_topics, format_expiry

    store = Store.open(args.path, settings=settings, create=False)
    plan = expiry_plan(store, settings.retention)
    kept = settings.retention.file_reserved_time
    if args.dry_run:
        print(format_expiry(plan, kept) + "\nnothing changed (--dry-run)")
        return EXIT_OK
    emptied = emptied_topics(plan)
    if any(e.messages for e in plan) and (kept < _DAY or emptied):
        why = (
            f"younger than a day (file_reserved_time {kept:g} s)"
            if kept < _DAY
            else (f"every message of topic(s) {', '.join(emptied)}")
        )
        _confirm(
            args, f"{format_expiry(plan, kept)}\nThis deletes messages {why}; it cannot be undone."
        )
    summary = maintain(store, settings.retention)
    print(summary.format())
    return EXIT_OK


def _confirm(args: argparse.Namespace, what: str) -> None:
    """Go on when ``--yes`` was given or the person at the terminal types ``yes``; else stop
    with an error that says what was not done."""
    if args.yes:
        return
    if sys.stdin.isatty():
        print(what)
        if input("Type 'yes' to go on: ").strip().lower() == "yes":
            return
    raise InvalidOptionError(f"{what} Nothing was changed; to go on, run it again with --yes.")


def _shards(args: argparse.Namespace, settings: Settings) -> int:
    if args.set is not None and not 1 <= args.set <= MAX_SHARDS:
        raise InvalidOptionError(
            f"--set needs a shard count from 1 to {MAX_SHARDS}, not {args.set}."
        )
    # Opened as a reader: only --set grows it, whatever [store] shards says.
    store = Store.open(args.path, settings=settings, create=False)
    had = len(store.shards(refresh=True))
    wanted = had if args.set is None else args.set
    if wanted < had:
        raise InvalidOptionError(
            f"the store at {store.root} has {had} shards and cannot have fewer: a shard holds "
            f"transactions, queues and their offsets that no other shard has. --set {had} or "
            "more, or leave it as it is."
        )
    if wanted > had:
        _confirm(
            args,
            f"Growing the store at {store.root} from {had} to {wanted} shards cannot be undone: "
            "a store never loses a shard, and processes of an rmq-spark older than shards "
            "must be stopped first (they would not see the new shards).",
        )
        store.grow(wanted)
    now = len(store.shards(refresh=True))
    print(f"store {store.root}: {now} shard(s)" + (f" (had {had})" if now != had else ""))
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
            "status": view_cli.run_status,
            "shards": _shards,
            "tail": view_cli.run_tail,
            "ui": view_cli.run_ui,
            "serve": serve_cli.run,
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
