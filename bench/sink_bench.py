"""Sink benchmark: write N rows (1 KiB random bodies) with df.write.format("rmqtx").

The same rows, cached in memory, are written in the same run with:
* `df.write.format("delta")` to a fresh table (the baseline);
* `df.write.format("rmqtx")`: staged as half messages by the tasks, then the epoch is closed,
  committed and published into the CommitLog.
Prints both times, the ratio, and where the sink's time goes (staging vs commit/publish).

Usage: python bench/sink_bench.py [--rows 1000000] [--body-bytes 1024]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

from rmq_spark import Store, get_spark
from rmq_spark.epochs import closed_epoch


def timed(label: str, action) -> float:
    start = time.perf_counter()
    action()
    seconds = time.perf_counter() - start
    print(f"  {label}: {seconds:6.1f} s", flush=True)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--body-bytes", type=int, default=1024)
    args = parser.parse_args()
    logging.getLogger("py4j").setLevel(logging.WARNING)
    spark = get_spark("rmq-sink-bench")
    df = (
        spark.range(args.rows)
        .selectExpr(f"randstr({args.body_bytes}, 42) AS body", "CAST(id % 1000 AS STRING) AS keys")
        .cache()
    )
    df.count()  # materialise the input once; both writers read it from memory
    print(f"sink benchmark: {args.rows:,} rows of {args.body_bytes} B bodies")
    with tempfile.TemporaryDirectory(prefix="rmq-sink-bench-") as tmp:
        store = Store.open(Path(tmp) / "store")
        df.limit(1000).write.format("delta").save(f"{tmp}/warm")  # JVM warm-up
        df.limit(1000).write.format("rmqtx").mode("append").option("path", store.root).option(
            "topic", "Warm"
        ).option("producerGroup", "bench").save()  # starts the Python workers
        delta_s = timed(
            "df.write.format('delta')", lambda: df.write.format("delta").save(f"{tmp}/delta")
        )
        rmqtx_s = timed(
            "df.write.format('rmqtx')",
            lambda: (
                df.write.format("rmqtx")
                .mode("append")
                .option("path", store.root)
                .option("topic", "Bench")
                .option("producerGroup", "bench")
                .option("sinkId", "bench")
                .save()
            ),
        )
        published = (
            spark.read.format("rmqtx")
            .option("path", store.root)
            .option("topic", "Bench")
            .load()
            .count()
        )
        assert published == args.rows, published
        staged = store.table("half").history()
        print(f"  ratio rmqtx / delta: {rmqtx_s / delta_s:.2f}x (goal at most 2.5x)")
        print(f"  epoch closed with {len(closed_epoch(store, 'bench', 0) or ())} transaction(s)")
        print(f"  half table commits: {len(staged)}; {published:,} messages published")
    spark.stop()


if __name__ == "__main__":
    main()
