"""Check-back history benchmark: does a round's time follow the pending transactions or the
decided history?

Builds two stores directly with deltalake (bulk appends, not through the producer):
* **history**: H decided and published transactions (half + op rows, the publisher's op cursor
  recorded in commitlog), then P pending transactions;
* **baseline**: the same P pending transactions only.
Then runs CheckBackJob rounds on each (transaction timeout 0, a checker that answers UNKNOWN,
so all P are asked every round and stay pending). Round 1 has no recorded state and rebuilds
it from a full scan (reported, not compared); rounds 2 and 3 are the steady state. Before
each steady round 1% of P new transactions are prepared and 1% decided, so every round has
new work to fold in. Prints the best steady round of each store and their ratio (the issue's
bar: at most 1.5x with H = 5,000,000 and P = 10,000).

Usage: python bench/checkback_history_bench.py [--history 500000] [--pending 10000]
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

from rmq_spark import Decision, LocalTransactionState, Message, MessageExt, Store, get_spark
from rmq_spark.checkback.checkers import CallableChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import TransactionSettings
from rmq_spark.model.messages import new_ids
from rmq_spark.model.schema import HALF_SCHEMA, WRITER_COLUMNS

CHUNK = 250_000
STEADY_ROUNDS = 2


def unknown(msg: MessageExt) -> LocalTransactionState:
    return LocalTransactionState.UNKNOWN


def half_rows(ids: list[str], body: bytes) -> pa.Table:
    now, n = datetime.now(UTC), len(ids)
    return pa.Table.from_pydict(
        {
            "transaction_id": ids,
            "msg_id": ids,
            "producer_group": ["bench"] * n,
            "topic": ["Bench"] * n,
            "queue_id": [i % 4 for i in range(n)],
            "keys": ids,
            "tags": [None] * n,
            "body": [body] * n,
            "properties": [[]] * n,
            "born_timestamp": [now] * n,
            "store_timestamp": [now] * n,
            **{f.name: [None] * n for f in WRITER_COLUMNS},
        },
        schema=HALF_SCHEMA,
    )


def build_history(store: Store, size: int, decided: datetime | None = None) -> None:
    """``size`` decided transactions (at ``decided``, default now), counted as already
    published."""
    now = decided or datetime.now(UTC)
    for start in range(0, size, CHUNK):
        ids = [f"{i:016d}" for i in range(start, min(size, start + CHUNK))]
        write_deltalake(store.table_uri("half"), half_rows(ids, b"x" * 100), mode="append")
        append_decisions(store, ids, now)
    mark_published(store)


def timed_rounds(spark, root: Path, history: int, pending: list[str]) -> tuple[float, float]:
    """Build a store, run the rounds; return (first round, best steady round) seconds."""
    store = Store.open(root)
    if history:
        build_history(store, history)
    write_deltalake(store.table_uri("half"), half_rows(pending, b"y" * 100), mode="append")
    job = CheckBackJob(
        spark,
        store,
        {"bench": CallableChecker(unknown)},
        TransactionSettings(transaction_timeout=0, transaction_check_max=100),
    )
    times = []
    fresh: list[str] = []
    for round_no in range(1 + STEADY_ROUNDS):
        if round_no:
            new = store.prepare([Message("Bench", b"z")] * (len(pending) // 100), "bench")
            store.end_transactions(
                [
                    Decision(p.transaction_id, "bench", LocalTransactionState.ROLLBACK)
                    for p in new[: len(new) // 2]
                ],
                publish=False,
            )
            fresh += [p.transaction_id for p in new[len(new) // 2 :]]
        start = time.perf_counter()
        summary = job.run_once().summary
        times.append(time.perf_counter() - start)
        assert summary.pending_found == summary.unknown == len(pending) + len(fresh), summary
    return times[0], min(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--history", type=int, default=500_000)
    parser.add_argument("--pending", type=int, default=10_000)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    spark = get_spark("rmq-checkback-history-bench", extra_conf={"spark.ui.enabled": "false"})
    pending = new_ids(args.pending).to_pylist()
    with tempfile.TemporaryDirectory(prefix="rmq-cb-history-") as tmp:
        timed_rounds(spark, Path(tmp) / "warm-up", 0, new_ids(1_000).to_pylist())  # JVM warm-up
        first_base, base = timed_rounds(spark, Path(tmp) / "baseline", 0, pending)
        first_big, big = timed_rounds(spark, Path(tmp) / "history", args.history, pending)
    print(f"{'store':>32} {'first round s':>14} {'steady round s':>15}")
    print(f"{f'{args.pending:,} pending only':>32} {first_base:>14.1f} {base:>15.2f}")
    label = f"{args.pending:,} pending + {args.history:,} decided"
    print(f"{label:>32} {first_big:>14.1f} {big:>15.2f}")
    print(f"steady round time ratio (history / baseline): {big / base:.2f}x")
    spark.stop()


if __name__ == "__main__":
    main()
