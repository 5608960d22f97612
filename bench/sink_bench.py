"""Sink benchmark: write N rows (1 KiB random bodies) with df.write.format("rmqtx").

The same rows, cached in memory, are written in the same run with:
* `df.write.format("delta")` to a fresh table (the baseline);
* `df.write.format("rmqtx")`: staged as half messages by the tasks, then the epoch is closed,
  committed and published into the CommitLog.
Prints both times and the ratio. With --repeat N, N pairs of writes alternate which writer
goes first (the second of a pair pays for the first one's page-cache writeback), and the
summary gives each writer's median time and the median of the pairs' ratios: on a noisy
machine one pair can be off by half, and the machine's speed drifts within a run, so the two
writers' median times can come from pairs run at different speeds. Each rmqtx write is split
at the moment its epoch closed (``epochs``): before, Spark's tasks staged the rows; after,
the driver's commit copied them into the CommitLog. The staging alone, against Delta's
write, is what a sink writing every row once would cost.

Usage: python bench/sink_bench.py [--rows 1000000] [--body-bytes 1024] [--repeat 3] [--s3]
(--s3: the same on an S3 root served by MinIO, in the same run; needs make objectstore)
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time

from roots import Root, bench_roots, spark_for

from rmq_spark.spark.epoch_records import closed_epoch


def timed(label: str, action) -> float:
    start = time.perf_counter()
    action()
    seconds = time.perf_counter() - start
    print(f"  {label}: {seconds:6.1f} s", flush=True)
    return seconds


def closed_at(store, sink_id: str) -> float:
    """When the sink's epoch 0 was closed (its tasks had staged everything), in epoch seconds."""
    rows = store.query("epochs", f"sink_id = '{sink_id}' AND epoch = 0")
    return rows.column("closed_timestamp")[0].as_py().timestamp()


def measure(spark, df, root: Root, rows: int, repeat: int) -> dict[str, float]:
    """Over ``repeat`` pairs of writes on one root (each to a new table or topic): the median
    seconds of the Delta baseline, of the rmqtx sink and of its tasks' staging, and the
    median of the pairs' ratios of rmqtx, and of its staging, to Delta."""
    store = root.store()
    df.limit(1000).write.format("delta").save(f"{root.base}/warm")  # JVM warm-up

    def writer(rows, topic: str):
        io = rows.write.mode("append").option("topic", topic).option("producerGroup", "bench")
        return root.rmqtx(io, store)

    writer(df.limit(1000), "Warm").save()  # starts the Python workers
    times: dict[str, list[float]] = {"delta": [], "rmqtx": [], "staging": []}
    for n in range(repeat):
        writes = {
            "delta": lambda n=n: df.write.format("delta").save(f"{root.base}/delta-{n}"),
            "rmqtx": lambda n=n: writer(df, f"Bench{n}").option("sinkId", f"bench-{n}").save(),
        }
        started = {}
        for name in sorted(writes, reverse=n % 2 == 1):  # delta first, then rmqtx first...
            started[name] = time.time()
            times[name].append(timed(f"df.write.format({name!r}) #{n + 1}", writes[name]))
        staging = closed_at(store, f"bench-{n}") - started["rmqtx"]
        times["staging"].append(staging)
        print(
            f"    of which the tasks' staging {staging:.1f} s, the driver's commit and publish "
            f"{times['rmqtx'][-1] - staging:.1f} s"
        )
        published = root.rmqtx(spark.read, store).option("topic", f"Bench{n}").load().count()
        assert published == rows, published
        print(f"  ratio of pair #{n + 1}: {times['rmqtx'][-1] / times['delta'][-1]:.2f}x")
    print(f"  epoch closed with {len(closed_epoch(store, 'bench-0', 0) or ())} transaction(s)")
    medians = {k: statistics.median(v) for k, v in times.items()}
    for k in ("rmqtx", "staging"):
        medians[f"{k} ratio"] = statistics.median(
            mine / delta for mine, delta in zip(times[k], times["delta"], strict=True)
        )
    return medians


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--body-bytes", type=int, default=1024)
    parser.add_argument("--repeat", type=int, default=3, help="pairs of writes (medians)")
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
            results[root.label] = measure(spark, df, root, args.rows, args.repeat)
        medians = f", medians of {args.repeat} pairs" if args.repeat > 1 else ""
        print(
            f"{'root':<14} {'delta s':>8} {'rmqtx s':>8} {'ratio':>6} {'staging s':>9} "
            f"{'ratio':>6}{medians}"
        )
        for label, m in results.items():
            print(
                f"{label:<14} {m['delta']:8.1f} {m['rmqtx']:8.1f} {m['rmqtx ratio']:5.2f}x "
                f"{m['staging']:9.1f} {m['staging ratio']:5.2f}x"
            )
        spark.stop()


if __name__ == "__main__":
    main()
