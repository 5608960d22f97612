"""Tombstones benchmark: what a table's checkpoints cost when they keep the tombstones of its
removed files for two hours (the store's tables now) or for longer (the CommitLog kept Delta's
week), at a steady publish rate.

Each publish adds a file that a compaction removes soon after, so a checkpoint carries one
tombstone per publish of the retention window. A table is built with that many tombstones
(written as Delta log entries, as a week of compactions leaves them), then timed: loading its
snapshot (what every reader that opens the table pays) and writing its checkpoint (every 100
commits). The baseline is the same table with the two hours' tombstones.

Usage: python bench/tombstones_bench.py [--rate 15] [--hours 2,24]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time

import pyarrow as pa
from deltalake import DeltaTable, write_deltalake


def build(rows: int) -> str:
    """A table whose snapshot holds ``rows`` tombstones removed a moment ago."""
    root = tempfile.mkdtemp(prefix="rmq-tombstones-")
    write_deltalake(root, pa.table({"a": [1]}))
    now = int(time.time() * 1000)
    log = os.path.join(root, "_delta_log")
    for version, action in ((1, "add"), (2, "remove")):
        with open(os.path.join(log, f"{version:020d}.json"), "w") as out:
            for i in range(rows):
                path = f"part-{i:09d}.snappy.parquet"
                body = (
                    {"path": path, "partitionValues": {}, "size": 2048, "modificationTime": now}
                    | {"dataChange": True, "stats": '{"numRecords":1}'}
                    if action == "add"
                    else {"path": path, "deletionTimestamp": now, "dataChange": False}
                )
                out.write(json.dumps({action: body}) + "\n")
    DeltaTable(root).create_checkpoint()
    return root


def checkpoint_bytes(root: str) -> int:
    """The size of the table's newest checkpoint (what a reader on S3 GETs to load it)."""
    log = os.path.join(root, "_delta_log")
    newest = max(f for f in os.listdir(log) if f.endswith(".checkpoint.parquet"))
    return os.path.getsize(os.path.join(log, newest))


def measure(root: str, repeats: int = 3) -> tuple[float, float]:
    """Best of ``repeats``: (snapshot load, checkpoint write) in seconds."""
    loads, writes = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        table = DeltaTable(root)
        loaded = time.perf_counter()
        table.create_checkpoint()
        loads.append(loaded - started)
        writes.append(time.perf_counter() - loaded)
    return min(loads), min(writes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=float, default=15.0, help="publishes per second")
    parser.add_argument("--hours", default="2,24", help="tombstone windows to time, in hours")
    args = parser.parse_args()
    windows = [float(h) for h in args.hours.split(",")]
    print(f"tombstones benchmark: {args.rate:g} publishes/s, a checkpoint every 100 commits")
    print(
        f"{'window':>8} {'tombstones':>11} {'load':>9} {'checkpoint':>11} {'size':>9} "
        f"{'per commit':>11} ratio"
    )
    base = None
    for hours in windows:
        rows = int(args.rate * hours * 3600)
        root = build(rows)
        load, write = measure(root)
        per_commit = (load + write) / 100  # a checkpoint (its fresh replay included) per 100
        size = checkpoint_bytes(root)
        shutil.rmtree(root)
        base = base or per_commit
        print(
            f"{hours:>7g}h {rows:>11,} {load:>8.3f}s {write:>10.3f}s "
            f"{size / 1e6:>7.1f}MB "
            f"{per_commit * 1000:>9.2f}ms {per_commit / base:>5.1f}x"
        )
    print("a week (Delta's default, which the CommitLog kept) is 168 h")


if __name__ == "__main__":
    main()
