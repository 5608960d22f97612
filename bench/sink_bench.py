"""Sink benchmark: write N rows (1 KiB random bodies) with df.write.format("rmqtx").

The same rows, cached in memory, are written in the same run with:
* `df.write.format("delta")` to a fresh table (the baseline);
* `df.write.format("rmqtx")`: staged as half messages by the tasks, then the epoch is closed,
  committed and published into the CommitLog.
Prints both times, the ratio, and where the sink's time goes (staging vs commit/publish).

Usage: python bench/sink_bench.py [--rows 1000000] [--body-bytes 1024] [--s3]
(--s3: the same on an S3 root served by MinIO, in the same run; needs make objectstore)
"""

from __future__ import annotations

import argparse
import logging
import time

from roots import Root, bench_roots, spark_for

from rmq_spark.epochs import closed_epoch


def timed(label: str, action) -> float:
    start = time.perf_counter()
    action()
    seconds = time.perf_counter() - start
    print(f"  {label}: {seconds:6.1f} s", flush=True)
    return seconds


def measure(spark, df, root: Root, rows: int) -> tuple[float, float]:
    """Seconds of the Delta baseline and of the rmqtx sink on one root."""
    store = root.store()
    df.limit(1000).write.format("delta").save(f"{root.base}/warm")  # JVM warm-up

    def writer(rows, topic: str):
        io = rows.write.mode("append").option("topic", topic).option("producerGroup", "bench")
        return root.rmqtx(io, store)

    writer(df.limit(1000), "Warm").save()  # starts the Python workers
    delta_s = timed(
        "df.write.format('delta')", lambda: df.write.format("delta").save(f"{root.base}/delta")
    )
    rmqtx_s = timed(
        "df.write.format('rmqtx')",
        lambda: writer(df, "Bench").option("sinkId", "bench").save(),
    )
    published = root.rmqtx(spark.read, store).option("topic", "Bench").load().count()
    assert published == rows, published
    print(f"  ratio rmqtx / delta: {rmqtx_s / delta_s:.2f}x")
    print(f"  epoch closed with {len(closed_epoch(store, 'bench', 0) or ())} transaction(s)")
    print(f"  half table commits: {len(store.table('half').history())}; {published:,} published")
    return delta_s, rmqtx_s


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--s3", action="store_true", help="also on an S3 root served by MinIO")
    args = parser.parse_args()
    logging.getLogger("py4j").setLevel(logging.WARNING)
    print(f"sink benchmark: {args.rows:,} rows of {args.body_bytes} B bodies")
    with bench_roots(args.s3) as roots:
        spark = spark_for(roots, "rmq-sink-bench")
        df = (
            spark.range(args.rows)
            .selectExpr(
                f"randstr({args.body_bytes}, 42) AS body", "CAST(id % 1000 AS STRING) AS keys"
            )
            .cache()
        )
        df.count()  # materialise the input once; both writers read it from memory
        results = {}
        for root in roots:
            print(f"on {root.label}:", flush=True)
            results[root.label] = measure(spark, df, root, args.rows)
        print(f"{'root':<14} {'delta s':>8} {'rmqtx s':>8} {'ratio':>6}")
        for label, (delta_s, rmqtx_s) in results.items():
            print(f"{label:<14} {delta_s:8.1f} {rmqtx_s:8.1f} {rmqtx_s / delta_s:5.2f}x")
        spark.stop()


if __name__ == "__main__":
    main()
