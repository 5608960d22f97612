"""Source benchmark: stream N committed messages (1 KiB random bodies) with Trigger.AvailableNow.

Builds a store whose CommitLog holds N committed messages on one topic (4 queues), written
directly with deltalake the way the publisher writes them, then reads them to Spark's `noop`
sink twice in the same run:
* `readStream.format("rmqtx")` (this project's Python data source);
* `readStream.format("delta")` on the same CommitLog table (Delta's own streaming source),
  the baseline.
Prints messages/s for both and their ratio.

Usage: python bench/source_bench.py [--messages 1000000] [--body-bytes 1024] [--repeated-body]
                                    [--s3]
(--s3: the same on an S3 root served by MinIO, in the same run; needs make objectstore)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, Transaction, write_deltalake
from roots import Root, bench_roots, spark_for

from rmq_spark import Store
from rmq_spark.delta.storage import deltalake_options
from rmq_spark.model.schema import COMMITLOG_SCHEMA
from rmq_spark.spark.offsets import latest_offsets
from rmq_spark.spark.reading import plan_slices, read_slice
from rmq_spark.store.queues import queue_app_id

QUEUES = 4
CHUNK = 100_000


def build(store: Store, count: int, body_bytes: int, repeated: bool) -> None:
    now = datetime.now(UTC)
    next_offset = [0] * QUEUES
    for start in range(0, count, CHUNK):
        n = min(CHUNK, count - start)
        queues = [(start + i) % QUEUES for i in range(n)]
        offsets = []
        for q in queues:
            offsets.append(next_offset[q])
            next_offset[q] += 1
        ids = [f"{start + i:032d}" for i in range(n)]
        write_deltalake(
            store.table_uri("commitlog"),
            pa.Table.from_pydict(
                {
                    "topic": ["Bench"] * n,
                    "queue_id": queues,
                    "queue_offset": offsets,
                    "msg_id": ids,
                    "transaction_id": ids,
                    "producer_group": ["bench"] * n,
                    "keys": ids,
                    "tags": ["TagA"] * n,
                    "body": [b"x" * body_bytes] * n
                    if repeated
                    else [os.urandom(body_bytes) for _ in range(n)],
                    "properties": [[]] * n,
                    "born_timestamp": [now] * n,
                    "store_timestamp": [now] * n,
                },
                schema=COMMITLOG_SCHEMA,
            ),
            mode="append",
            partition_by=["topic"],
            storage_options=deltalake_options(store.settings.storage_options),
            commit_properties=CommitProperties(
                app_transactions=[
                    Transaction(queue_app_id("Bench", q), next_offset[q]) for q in range(QUEUES)
                ]
            ),
        )


def python_side_read(store: Store) -> float:
    """Seconds to run every read task of the whole CommitLog in this process (no Spark)."""
    start = time.perf_counter()
    end = latest_offsets(store, ["Bench"])
    for task in plan_slices(store, {}, end):
        for _ in read_slice(task):
            pass
    return time.perf_counter() - start


def timed_stream(df, checkpoint: Path) -> float:
    start = time.perf_counter()
    query = (
        df.writeStream.format("noop")
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return time.perf_counter() - start


def measure(spark, root: Root, args: argparse.Namespace, checkpoints: Path) -> tuple[float, float]:
    """Seconds of Delta's streaming source and of rmqtx's on one root's CommitLog."""
    store = root.store()
    build(store, args.messages, args.body_bytes, args.repeated_body)
    rmqtx = root.rmqtx(spark.readStream, store).option("topic", "Bench").load()
    delta = spark.readStream.format("delta").load(store.table_uri("commitlog"))
    timed_stream(delta, checkpoints / "warm-delta")  # JVM warm-up, not reported
    cold_s = timed_stream(rmqtx, checkpoints / "warm-rmqtx")  # starts the Python workers
    delta_s = timed_stream(delta, checkpoints / "delta")
    rmqtx_s = timed_stream(rmqtx, checkpoints / "rmqtx")
    n = args.messages
    read_s = python_side_read(store)
    print(f"  first rmqtx query (starts Python workers): {cold_s:6.1f} s")
    print(f"  readStream.format('delta'): {delta_s:6.1f} s  {n / delta_s:>10,.0f} msg/s")
    print(f"  readStream.format('rmqtx'): {rmqtx_s:6.1f} s  {n / rmqtx_s:>10,.0f} msg/s")
    print(f"  ratio rmqtx / delta: {delta_s / rmqtx_s:.2f}x")
    print(
        f"  where rmqtx's time goes: the tasks' Python-side reads take {read_s:.1f} s of "
        "CPU in one process (spread over the cores); the rest is Spark's Arrow hand-off "
        "from Python to the JVM and the micro-batch"
    )
    return delta_s, rmqtx_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument(
        "--repeated-body",
        action="store_true",
        help="one body repeated (Parquet compresses it away) instead of random bytes",
    )
    parser.add_argument("--s3", action="store_true", help="also on an S3 root served by MinIO")
    args = parser.parse_args()
    kind = "one repeated body" if args.repeated_body else "random bodies"
    print(f"source benchmark: {args.messages:,} committed messages of {args.body_bytes} B ({kind})")
    with bench_roots(args.s3) as roots, tempfile.TemporaryDirectory() as checkpoints:
        spark = spark_for(roots, "rmq-source-bench")
        results = {}
        for root in roots:
            print(f"on {root.label}:", flush=True)
            results[root.label] = measure(spark, root, args, Path(checkpoints) / root.label)
        n = args.messages
        print(f"{'root':<14} {'delta msg/s':>12} {'rmqtx msg/s':>12} {'ratio':>6}")
        for label, (delta_s, rmqtx_s) in results.items():
            print(
                f"{label:<14} {n / delta_s:12,.0f} {n / rmqtx_s:12,.0f} {delta_s / rmqtx_s:5.2f}x"
            )
        spark.stop()


if __name__ == "__main__":
    main()
