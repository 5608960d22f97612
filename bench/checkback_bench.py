"""Check-back benchmark: one run over N half messages of which 90% are already decided.

Builds the store directly with deltalake (half: N rows; op: 0.9 N decisions, marked as
published), then times one CheckBackJob.run_once() with a transaction timeout of 0 so every
pending transaction is due: a third commits, a third rolls back, a third stays UNKNOWN.
Prints seconds and half messages reconciled per second for each N, and the cost ratio
between sizes (linear growth means time ratio ~ size ratio).

Then the idle cost: rounds on a store of ``--shards`` shards, each with a few transactions not
yet due (what a check-back loop does most of the time), beside one trivial Spark job on the
same session.

Usage: python bench/checkback_bench.py [--sizes 250000,1000000,4000000] [--shards 8]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from decided import append_decisions, mark_published
from deltalake import write_deltalake

from rmq_spark import LocalTransactionState, Message, MessageExt, Store, get_spark
from rmq_spark.checkback.checkers import CallableChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import StoreSettings, TransactionSettings
from rmq_spark.model.schema import HALF_SCHEMA, WRITER_COLUMNS

CHUNK = 250_000


def by_tag(msg: MessageExt) -> LocalTransactionState:
    return LocalTransactionState.coerce(msg.tags)


def build(store: Store, size: int) -> None:
    now = datetime.now(UTC)
    for start in range(0, size, CHUNK):
        ids = [f"{i:016d}" for i in range(start, min(size, start + CHUNK))]
        n = len(ids)
        tags = [("COMMIT", "ROLLBACK", "UNKNOWN")[int(i) % 3] for i in ids]
        write_deltalake(
            store.table_uri("half"),
            pa.Table.from_pydict(
                {
                    "transaction_id": ids,
                    "msg_id": ids,
                    "producer_group": ["bench"] * n,
                    "topic": ["Bench"] * n,
                    "queue_id": [int(i) % 4 for i in ids],
                    "keys": ids,
                    "tags": tags,
                    "body": [b"x" * 100] * n,
                    "properties": [[]] * n,
                    "born_timestamp": [now] * n,
                    "store_timestamp": [now] * n,
                    **{f.name: [None] * n for f in WRITER_COLUMNS},
                },
                schema=HALF_SCHEMA,
            ),
            mode="append",
        )
        decided = [i for i in ids if int(i) % 10 != 0]  # 90% decided
        append_decisions(store, decided, now)
    # Those decisions count as already published: record the cursor as the publisher would.
    mark_published(store)


def timed_run(spark, root: Path, size: int) -> tuple[int, float]:
    """Build a store of ``size`` half messages and time one check-back run over it."""
    store = Store.open(root)
    build(store, size)
    job = CheckBackJob(
        spark, store, {"bench": CallableChecker(by_tag)}, TransactionSettings(transaction_timeout=0)
    )
    start = time.perf_counter()
    summary = job.run_once().summary
    elapsed = time.perf_counter() - start
    assert summary.checked == summary.pending_found == size // 10
    return summary.pending_found, elapsed


def idle_rounds(spark, root: Path, shards: int, rounds: int = 10) -> None:
    """Time rounds on a store of ``shards`` shards with 2 transactions not yet due in each,
    beside one trivial Spark job."""
    store = Store.open(root, settings=StoreSettings(shards=shards))
    for shard in range(shards):
        store.shard_store(shard).prepare([Message("Bench", b"x", tags="COMMIT")] * 2, "bench")
    job = CheckBackJob(
        spark,
        store,
        {"bench": CallableChecker(by_tag)},
        TransactionSettings(transaction_timeout=3600),
    )
    job.run_once()  # each shard's pending list made once
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        summary = job.run_once().summary
        times.append(time.perf_counter() - start)
        assert summary.not_yet_due == 2 * shards
    spark_times = []
    for _ in range(rounds):
        start = time.perf_counter()
        spark.range(1).count()
        spark_times.append(time.perf_counter() - start)
    median, job_median = sorted(times)[rounds // 2], sorted(spark_times)[rounds // 2]
    shard = median / shards
    print(
        f"idle round, {shards} shards (2 pending each, not due): {median * 1000:.0f} ms a round, "
        f"{shard * 1000:.0f} ms a shard (median of {rounds}); "
        f"one spark.range(1).count(): {job_median * 1000:.0f} ms; "
        f"a shard's round / that job: {shard / job_median:.2f}x"
    )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="250000,1000000,4000000")
    parser.add_argument("--shards", type=int, default=8)
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    logging.basicConfig(level=logging.WARNING)
    spark = get_spark("rmq-checkback-bench", extra_conf={"spark.ui.enabled": "false"})
    with tempfile.TemporaryDirectory(prefix="rmq-cb-bench-") as tmp:
        timed_run(spark, Path(tmp) / "warm-up", 20_000)  # JVM warm-up, not reported
        print(
            f"{'half msgs':>10} {'pending':>8} {'seconds':>8} {'msgs/s':>10} "
            f"{'time ratio':>10} {'size ratio':>10}"
        )
        base_size, base_time = sizes[0], 0.0
        for size in sizes:
            pending, elapsed = timed_run(spark, Path(tmp) / f"s{size}", size)
            base_time = base_time or elapsed
            print(
                f"{size:>10,} {pending:>8,} {elapsed:>8.1f} {size / elapsed:>10,.0f} "
                f"{elapsed / base_time:>10.2f} {size / base_size:>10.2f}",
                flush=True,
            )
        idle_rounds(spark, Path(tmp) / "idle", args.shards)
    spark.stop()


if __name__ == "__main__":
    main()
