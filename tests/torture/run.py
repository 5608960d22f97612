"""Run the torture test: ``python -m tests.torture.run --seed 42 --minutes 10``.

Prints the report (and writes report.txt / report.json to the run directory); exits 1 when an
invariant is violated. The seed fixes every random choice of the orchestrator and the
workers (plans, kills, failpoints, inputs, slow and failing tasks), so a failure replays
(timings still differ from run to run).
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.torture.run", description=__doc__)
    parser.add_argument("--seed", type=int, help="random seed (default: a new one, printed)")
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of chaos")
    parser.add_argument("--root", help="run directory (default: a new temporary directory)")
    parser.add_argument("--kill-every", type=float, default=12.0, help="mean seconds between kills")
    parser.add_argument(
        "--producers", type=int, default=2, help="producer processes (2 threads each)"
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=1,
        help="shards of the store ([store] shards): each producer process claims one while "
        "there are enough",
    )
    parser.add_argument(
        "--s3-delay-ms",
        type=float,
        help="the store on s3:// (MinIO, from make objectstore) behind a proxy adding this many "
        "ms to every request",
    )
    parser.add_argument(
        "--intake",
        choices=("on", "off"),
        help="[store] intake: sends durable in intake objects (default: on)",
    )
    parser.add_argument(
        "--no-compactor",
        action="store_true",
        help="no compactor process (the store still compacts each table after its checkpoints)",
    )
    args = parser.parse_args(argv)
    if args.s3_delay_ms is not None:
        from rmq_spark.model.errors import RmqSparkError
        from rmq_spark.spark.session import s3_jars

        try:
            s3_jars()  # missing, every Spark worker would fail for the whole run
        except RmqSparkError as exc:
            parser.error(str(exc))

    from tests.torture.orchestrator import run

    result, report = run(
        args.seed,
        args.minutes * 60,
        args.root,
        kill_every=args.kill_every,
        compactor=not args.no_compactor,
        producers=args.producers,
        shards=args.shards,
        delay_ms=args.s3_delay_ms,
        intake=None if args.intake is None else args.intake == "on",
    )
    print(report, flush=True)
    return 1 if result["violations"] else 0


if __name__ == "__main__":
    sys.exit(main())
