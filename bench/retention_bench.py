"""Retention benchmark: one maintenance run on a store whose CommitLog holds --expired messages
past the retention and --kept younger ones, with --transactions decided and published
transactions past their own retention in ``half`` and ``op``.

The history is written with the store's own operations under a clock set 100 h back (sends of
--chunk messages per commit; transactions prepared, committed and published --chunk at a time),
then compacted as the publisher would have. Prints the run's summary, its time, and the disk
use of each table's data files before and after VACUUM, beside the bytes the retained rows'
live files hold (goal: after vacuum, disk use is what the retained rows need).

Usage: python bench/retention_bench.py [--expired 500000] [--kept 10000] [--transactions 20000]
       (the issue's size: --expired 5000000)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.model.config import RetentionSettings
from rmq_spark.store.retention import maintain

TOPICS = [f"T{t:02d}" for t in range(10)]


def data_bytes(table: Path) -> int:
    """Bytes of a table's data files on disk (not its log or change files)."""
    return sum(
        f.stat().st_size
        for f in table.rglob("*.parquet")
        if "_delta_log" not in f.parts and "_change_data" not in f.parts
    )


def fill(root: Path, expired: int, kept: int, transactions: int, chunk: int) -> Store:
    now = datetime.now(UTC)
    old = Store.open(root, clock=lambda: now - timedelta(hours=100))
    body = b"x" * 200
    for start in range(0, expired, chunk):
        n = min(chunk, expired - start)
        old.send([Message(TOPICS[i % len(TOPICS)], body, keys=f"k{i}") for i in range(n)], "pg")
    for start in range(0, transactions, chunk):
        n = min(chunk, transactions - start)
        prepared = old.prepare([Message("Orders", body) for _ in range(n)], "pg")
        old.end_transactions(
            [Decision(p.transaction_id, "pg", LocalTransactionState.COMMIT) for p in prepared]
        )
    young = Store.open(root)
    for start in range(0, kept, chunk):
        n = min(chunk, kept - start)
        young.send([Message(TOPICS[i % len(TOPICS)], body, keys=f"y{i}") for i in range(n)], "pg")
    young.compact()
    return young


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--expired", type=int, default=500_000)
    parser.add_argument("--kept", type=int, default=10_000)
    parser.add_argument("--transactions", type=int, default=20_000)
    parser.add_argument("--chunk", type=int, default=50_000)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="rmq-retention-bench-") as tmp:
        root = Path(tmp) / "store"
        started = time.perf_counter()
        store = fill(root, args.expired, args.kept, args.transactions, args.chunk)
        built = time.perf_counter() - started
        tables = ("commitlog", "half", "op")
        before = {t: data_bytes(root / t) for t in tables}
        started = time.perf_counter()
        # Files are vacuumed at once here; in production they wait deleted_file_retention.
        summary = maintain(store, RetentionSettings(deleted_file_retention=0))
        took = time.perf_counter() - started
        for t in ("half", "op"):  # what the next run does once their 2 h file retention passed
            store.table(t).vacuum(
                retention_hours=0, enforce_retention_duration=False, dry_run=False
            )
        print(
            f"retention benchmark: {args.expired:,} expired + {args.kept:,} kept messages, "
            f"{args.transactions:,} expired transactions (store built in {built:.0f} s)"
        )
        print(summary.format())
        print(
            f"  maintenance run: {took:.1f} s "
            f"({summary.messages_expired / took:,.0f} messages expired/s)"
        )
        for t in tables:
            after = data_bytes(root / t)
            live = summary.live_bytes[t]
            print(
                f"  {t:<10} data on disk {before[t] / 1e6:9.3f} MB -> {after / 1e6:9.3f} MB; "
                f"live files {live / 1e6:9.3f} MB (on disk / live {after / max(live, 1):.2f})"
            )


if __name__ == "__main__":
    main()
