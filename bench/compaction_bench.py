"""Compaction benchmark: the rows the compactions after checkpoints read and rewrite, for each
message a producer sends one commit at a time (a sender on its own: a file a commit).

Every checkpoint interval (100 commits) a compaction runs, as the store's maintenance runs
one. The baseline, on a second store in the same run, rewrites every file under the target
size each time (what ``Store.compact()`` does, and what the automatic ones did until
2026-11-29): a table's one growing file is read and written again every interval until it
reaches 16 MiB. The store's own, by size tiers, rewrites a file only into one with half as
many rows again at least.

Usage: python bench/compaction_bench.py [--messages 3000]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from datetime import UTC, datetime

from producer_bench import rows

from rmq_spark import Store
from rmq_spark.delta.compaction import compact
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.delta.txnlog import clean_log
from rmq_spark.model.schema import CHECKPOINT_INTERVAL, TABLES


def run(root: str, messages: int, tiered: bool) -> tuple[int, float, int]:
    """Append ``messages`` half messages to a store's ``half``, one a commit, compacting it
    every interval; return the rows the compactions wrote, their CPU seconds and the files
    ``half`` is left with. The commits go through the store's Delta layer without its
    maintenance (whose compactions after checkpoints would run beside these); its log is
    cleaned after each compaction, as the maintenance does."""
    Store.open(root)
    tables = DeltaTables(root, TABLES, {}, fresh_seconds=1.0)
    rewritten, cpu = 0, 0.0
    for sent in range(1, messages + 1):
        tables.append("half", [rows(1, b"x" * 256)])
        if sent % CHECKPOINT_INTERVAL == 0:
            before = set(tables.data_files("half").column("path").to_pylist())
            start = time.process_time()
            compact(tables, "half", tiered=tiered)
            cpu += time.process_time() - start
            files = tables.data_files("half").to_pylist()
            rewritten += sum(f["num_records"] for f in files if f["path"] not in before)
            # The log cleanup that follows each checkpoint, as the store's maintenance does.
            now = datetime.now(UTC)
            clean_log(tables.uri("half"), {}, [(tables.snapshot("half").version(), now)])
    return rewritten, cpu, len(files)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=3000)
    args = parser.parse_args()
    print(
        f"compaction benchmark: {args.messages} messages, a commit each, ``half`` compacted "
        f"every {CHECKPOINT_INTERVAL} commits"
    )
    results = {}
    for name, tiered in (("every small file (baseline)", False), ("size tiers", True)):
        with tempfile.TemporaryDirectory(prefix="rmq-compaction-") as root:
            results[name] = rewritten, cpu, files = run(root, args.messages, tiered)
        print(
            f"  {name:<28} {rewritten / args.messages:6.1f} rows rewritten a message, "
            f"{1e6 * cpu / args.messages:6.0f} us of compaction CPU a message, "
            f"{files} file(s) left"
        )
    (base, base_cpu, _), (tier, tier_cpu, _) = results.values()
    print(f"  ratio: {tier / base:.2f}x the rows, {tier_cpu / base_cpu:.2f}x the CPU")


if __name__ == "__main__":
    main()
