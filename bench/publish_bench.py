"""Publish benchmark: latency of a transactional send and of a 1,000-message epoch, on an empty
store and on one whose CommitLog already holds --history messages in --topics topics.

The history is written directly with deltalake the way the publisher writes it (dense queue
offsets and the queue application transactions), one commit per topic, as a compacted store
would hold it. In the same run, on each store:
* a transactional send: ``send_message_in_transaction`` (COMMIT) until its message is published
  (``flush``), --sends times;
* an epoch: 1,000 half messages of one transaction over the topics (what a sink task stages),
  then its COMMIT and publish, --epochs times.
Prints the median latencies and their ratio history / empty (goal: at most 1.5x), and the
slowest of each (a compaction, after each checkpoint of a table, lands in one of them).

Usage: python bench/publish_bench.py [--history 500000] [--topics 100] [--sends 15] [--epochs 5]
       (the issue's size: --history 5000000)
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pyarrow as pa
from deltalake import CommitProperties, Transaction, write_deltalake

from rmq_spark import (
    Decision,
    LocalTransactionState,
    Message,
    Store,
    TransactionListener,
    TransactionMQProducer,
)
from rmq_spark.model.messages import new_id
from rmq_spark.model.schema import COMMITLOG_SCHEMA, TIMESTAMP
from rmq_spark.store.queues import queue_app_id

QUEUES = 4
EPOCH_MESSAGES = 1000


class CommitAll(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT

    def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT


def build_history(
    store: Store, messages: int, topics: list[str], stored: list[datetime] | None = None
) -> None:
    """``messages`` committed messages spread over ``topics``, one commit per topic; the
    topic's messages stored at ``stored[i]`` (default: now)."""
    per_topic = messages // len(topics)
    index = np.arange(per_topic)
    for number, topic in enumerate(topics):
        now = pa.scalar(stored[number] if stored else datetime.now(UTC), TIMESTAMP)
        queue_ids = (index % QUEUES).astype(np.int32)
        ids = [f"{topic}-{i:012d}" for i in range(per_topic)]
        rows = pa.table(
            {
                "topic": pa.array([topic] * per_topic, pa.string()),
                "queue_id": pa.array(queue_ids, pa.int32()),
                "queue_offset": pa.array(index // QUEUES, pa.int64()),
                "msg_id": pa.array(ids, pa.string()),
                "transaction_id": pa.array(ids, pa.string()),
                "producer_group": pa.array(["history"] * per_topic, pa.string()),
                "keys": pa.nulls(per_topic, pa.string()),
                "tags": pa.nulls(per_topic, pa.string()),
                "body": pa.array([b"h" * 100] * per_topic, pa.binary()),
                "properties": pa.array([[]] * per_topic, COMMITLOG_SCHEMA.field("properties").type),
                "born_timestamp": pa.array([now.as_py()] * per_topic, TIMESTAMP),
                "store_timestamp": pa.array([now.as_py()] * per_topic, TIMESTAMP),
            },
            schema=COMMITLOG_SCHEMA,
        )
        counts = np.bincount(queue_ids, minlength=QUEUES)
        write_deltalake(
            store.table_uri("commitlog"),
            rows,
            mode="append",
            partition_by=["topic"],
            commit_properties=CommitProperties(
                app_transactions=[
                    Transaction(queue_app_id(topic, q), int(counts[q])) for q in range(QUEUES)
                ]
            ),
        )


def send_latency(store: Store, topics: list[str], sends: int) -> list[float]:
    times = []
    with TransactionMQProducer("bench", CommitAll(), store=store) as producer:
        for i in range(sends):
            start = time.perf_counter()
            producer.send_message_in_transaction(
                Message(topics[i % len(topics)], b"b" * 256, keys=f"k{i}")
            )
            producer.flush()
            times.append(time.perf_counter() - start)
    return times


def epoch_latency(store: Store, topics: list[str], epochs: int) -> list[float]:
    times = []
    for e in range(epochs):
        messages = [
            Message(topics[i % len(topics)], b"e" * 256, keys=f"e{e}-{i}")
            for i in range(EPOCH_MESSAGES)
        ]
        txn = new_id()
        start = time.perf_counter()
        store.prepare(messages, "bench", transaction_ids=[txn] * len(messages))
        store.end_transactions(
            [Decision(txn, "bench", LocalTransactionState.COMMIT, decided_by="sink")],
            in_half=True,  # as the sink's epoch commit: its tasks committed the half messages
        )
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--history", type=int, default=500_000)
    parser.add_argument("--topics", type=int, default=100)
    parser.add_argument("--sends", type=int, default=15)
    parser.add_argument("--epochs", type=int, default=5)
    args = parser.parse_args()
    topics = [f"T{t:03d}" for t in range(args.topics)]
    with tempfile.TemporaryDirectory(prefix="rmq-publish-bench-") as tmp:
        empty = Store.open(Path(tmp) / "empty")
        full = Store.open(Path(tmp) / "history")
        start = time.perf_counter()
        build_history(full, args.history, topics)
        print(
            f"publish benchmark: empty store vs {args.history:,} messages in {args.topics} "
            f"topics (built in {time.perf_counter() - start:.0f} s)"
        )
        results = {}
        for name, store in (("empty", empty), ("history", full)):
            send_latency(store, topics, 2)  # warm-up: imports, first table loads
            results[name] = (
                send_latency(store, topics, args.sends),
                epoch_latency(store, topics, args.epochs),
            )
        for i, label in enumerate(("transactional send", f"{EPOCH_MESSAGES}-message epoch")):
            base, after = results["empty"][i], results["history"][i]
            ratio = statistics.median(after) / statistics.median(base)
            print(
                f"  {label + ':':<28} median empty {statistics.median(base):6.3f} s, history "
                f"{statistics.median(after):6.3f} s: ratio {ratio:4.2f}x (goal <= 1.5x); "
                f"max {max(base):6.3f} s / {max(after):6.3f} s"
            )


if __name__ == "__main__":
    main()
