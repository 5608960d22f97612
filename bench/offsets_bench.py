"""Offsets benchmark: the source's ``latestOffset`` on a CommitLog with many queues and commits.

Builds a store whose CommitLog has --topics topics x 4 queues and --commits publish commits
(each writing one message to each of --queues-per-commit random queues, with the queue and
cursor application transactions a publish records), written directly with deltalake and
compacted every ``CHECKPOINT_INTERVAL`` commits as the store's maintenance does. Then,
in the same run:
* baseline: every queue's next offset asked of deltalake one queue at a time
  (``DeltaTable.transaction_version``, the per-queue log replay rmq-spark used before);
* ``RmqTxStreamReader.latestOffset`` (what Spark calls every trigger): the reader's start (it
  opens the store and reads the offsets once), a first call, a call after one more commit, and
  a call on an unchanged table;
* ``latest_offsets`` on a fresh ``Store`` (a new process's first read).
Prints seconds and ratios against the baseline; the goal is under 0.5 s per ``latestOffset``.

Usage: python bench/offsets_bench.py [--topics 100] [--commits 1000] [--queues-per-commit 40]
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from pyspark.sql.datasource import ReadAllAvailable

from rmq_spark import Store
from rmq_spark.model.schema import CHECKPOINT_INTERVAL, COMMITLOG_SCHEMA
from rmq_spark.spark.offsets import latest_offsets
from rmq_spark.spark.source import RmqTxStreamReader
from rmq_spark.spark.source_options import ReaderOptions
from rmq_spark.store.queues import OP_CURSOR_APP_ID, queue_app_id

QUEUES = 4


def publish_like(store: Store, queues: list[tuple[str, int]], offsets: dict, cursor: int) -> None:
    """One commit as a publish writes it: a message per queue, queue and cursor txns."""
    now = datetime.now(UTC)
    rows = []
    for topic, queue_id in queues:
        offset = offsets.get((topic, queue_id), 0)
        offsets[(topic, queue_id)] = offset + 1
        rows.append(
            {
                "topic": topic,
                "queue_id": queue_id,
                "queue_offset": offset,
                "msg_id": f"{topic}-{queue_id}-{offset}",
                "body": b"x",
                "properties": [],
                "born_timestamp": now,
                "store_timestamp": now,
            }
        )
    txns = [Transaction(queue_app_id(t, q), offsets[(t, q)]) for t, q in queues]
    write_deltalake(
        store.table_uri("commitlog"),
        pa.Table.from_pylist(rows, schema=COMMITLOG_SCHEMA),
        mode="append",
        partition_by=["topic"],
        commit_properties=CommitProperties(
            app_transactions=[*txns, Transaction(OP_CURSOR_APP_ID, cursor)]
        ),
    )


def timed(action) -> tuple[float, object]:
    start = time.perf_counter()
    result = action()
    return time.perf_counter() - start, result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--commits", type=int, default=1000)
    parser.add_argument("--queues-per-commit", type=int, default=40)
    args = parser.parse_args()
    topics = [f"T{t:03d}" for t in range(args.topics)]
    all_queues = [(t, q) for t in topics for q in range(QUEUES)]
    rng = random.Random(1)
    with tempfile.TemporaryDirectory(prefix="rmq-offsets-bench-") as tmp:
        store = Store.open(Path(tmp) / "store")
        offsets: dict = {}

        def build() -> None:
            for c in range(args.commits):
                publish_like(store, rng.sample(all_queues, args.queues_per_commit), offsets, c)
                if (c + 1) % CHECKPOINT_INTERVAL == 0:
                    store.compact("commitlog")  # as the maintenance does

        build_s, _ = timed(build)
        uri = store.table_uri("commitlog")
        print(
            f"offsets benchmark: {args.topics} topics x {QUEUES} queues, {args.commits} commits "
            f"of {args.queues_per_commit} queues each (built in {build_s:.0f} s)"
        )

        def per_queue() -> dict:
            table = DeltaTable(uri)
            return {q: table.transaction_version(queue_app_id(*q)) for q in all_queues}

        base_s, expected = timed(per_queue)
        options = ReaderOptions.parse(
            {"path": store.root, "topic": ",".join(topics)}, streaming=True
        )
        open_s, reader = timed(lambda: RmqTxStreamReader(options))
        start = reader.initialOffset()
        first_s, end = timed(lambda: reader.latestOffset(start, ReadAllAvailable()))
        got = {(t, int(q)): o for t, qs in end["offsets"].items() for q, o in qs.items()}
        assert got == {q: v for q, v in expected.items() if v is not None}, "offsets differ"
        publish_like(store, rng.sample(all_queues, args.queues_per_commit), offsets, args.commits)
        next_s, _ = timed(lambda: reader.latestOffset(start, ReadAllAvailable()))
        same_s, _ = timed(lambda: reader.latestOffset(start, ReadAllAvailable()))
        fresh_s, _ = timed(lambda: latest_offsets(Store.open(store.root, create=False), topics))
        print(f"  baseline, transaction_version per queue (fresh table): {base_s:7.3f} s")
        for label, seconds in [
            ("stream reader start (opens the store, first read)", open_s),
            ("latestOffset, first call", first_s),
            ("latestOffset after one more commit", next_s),
            ("latestOffset on an unchanged table", same_s),
            ("latest_offsets on a freshly opened Store", fresh_s),
        ]:
            print(
                f"  {label + ':':<53}{seconds:7.3f} s  ({base_s / seconds:6.1f}x faster; "
                f"goal < 0.5 s)"
            )


if __name__ == "__main__":
    main()
