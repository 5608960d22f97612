"""Compaction of a table's small files into larger ones, changing no data.

A compaction commit is ``dataChange=false``: consumers, Delta's own streaming source included,
see nothing, and no committed row is dropped or stored twice (rules 2 and 4). A table appended
to directly is compacted with a direct commit that removes the files it rewrote: appends that
land meanwhile do not conflict with it, and it takes the next free version in about 50 us a
try. deltalake's OPTIMIZE, used for the other tables, gives up after 15 tries, each of which
lists the log: against a producer committing hundreds of times a second it lost every time,
and ``half`` grew by a file per commit for as long as the sends went on.

A compaction given the columns that make two rows copies of one row keeps each such row once
among the files it reads together (about ``_COMPACT_TARGET_BYTES``): another writer's
compaction that raced one of rmq-spark's can land beside it (deltalake lets a commit remove
files that a ``dataChange=false`` commit removed first), storing the rows of those files
twice, and readers would meet the copies for good.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Sequence
from typing import Any
from urllib.parse import unquote

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from rmq_spark.delta.reads import once_per_key, read_files
from rmq_spark.delta.removals import write_records
from rmq_spark.delta.retry import relisting
from rmq_spark.delta.storage import check_conditional_put, filesystem, scheme
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.delta.vacuum import tombstone_retention

_COMPACT_TARGET_BYTES = 16 * 1024 * 1024

#: A compaction rewrites at most this many files (its commit names each one it removes).
_COMPACT_MAX_FILES = 10_000


def compact(
    tables: DeltaTables,
    name: str,
    copies: Sequence[str] = (),
    newest: Sequence[str] = (),
    tiered: bool = False,
    written_down: bool = False,
) -> dict[str, Any]:
    """Rewrite a table's files smaller than ``_COMPACT_TARGET_BYTES`` (the caller holds the
    table's compaction lock); return the metrics (``numFilesRemoved``, ``numFilesAdded``,
    ``numCopiesRemoved``). ``copies``: the columns that make two rows copies of one row; of
    the copies among the files read together, the row in force is kept (the first with the
    greatest ``newest`` columns: :func:`once_per_key`), on a table appended to directly.
    ``tiered``: only the files :func:`_tiered` picks (the compactions that follow checkpoints).
    ``written_down``: the removals are written down for VACUUM (:mod:`rmq_spark.delta.removals`),
    due when the table's checkpoints drop their tombstones, as a VACUUM run would write them:
    for a table whose VACUUM keeps removed files that long.
    A compaction that loses a race to a writer rewriting the same files raises deltalake's
    ``CommitFailedError``: nothing landed."""
    check_conditional_put(tables.root, tables.storage_options)
    snapshot = tables.snapshot(name)
    if tables.direct_interval(name, snapshot) is None:
        return relisting(lambda: snapshot.optimize.compact(target_size=_COMPACT_TARGET_BYTES))
    files = tables.data_files(name, snapshot)
    small = files.filter(pc.less(files.column("size_bytes"), _COMPACT_TARGET_BYTES))
    small = small.sort_by([("modification_time", "ascending"), ("path", "ascending")])
    small = small.slice(0, _COMPACT_MAX_FILES)  # the next compaction does the rest
    partitions = tables.specs[name][1]
    column = f"partition.{partitions[0]}" if partitions else None
    values = [None] if column is None else pc.unique(small.column(column)).to_pylist()
    removed = added = 0
    once = _Once(copies, newest)
    for value in values:
        group = small if column is None else small.filter(pc.equal(small.column(column), value))
        if tiered:
            group = _tiered(group)
        if group.num_rows > 1:
            added += _rewrite(tables, name, snapshot, group, value, once, written_down)
            removed += group.num_rows
    return {"numFilesRemoved": removed, "numFilesAdded": added, "numCopiesRemoved": once.dropped}


def _tiered(files: pa.Table) -> pa.Table:
    """``files`` (small ones of one partition, oldest first) without the largest ones that
    each hold more than twice the rows of the smaller ones together. A row is then only
    rewritten into a file with half as many rows again at least: a store that adds a file a
    commit rewrites each row a few times on its way to ``_COMPACT_TARGET_BYTES``, not once a
    checkpoint interval (one sender's compactions read 17 rows a message over its first 3,000
    messages, more with every message, rewriting one growing file again and again). By rows,
    not age (a compaction's file lands among the commits made while it ran) nor bytes (a small
    Parquet file is mostly its footer); a file without statistics counts no rows."""
    rows = pc.fill_null(files.column("num_records"), 0).to_pylist()
    smaller = sum(rows)
    left_out = set()
    for i in sorted(range(len(rows)), key=rows.__getitem__, reverse=True):
        smaller -= rows[i]
        if rows[i] <= 2 * smaller:
            break
        left_out.add(i)
    return files.filter(pa.array([i not in left_out for i in range(len(rows))], pa.bool_()))


class _Once:
    """Rows read together by a compaction, each copy of a row (equal in ``key``) kept once."""

    def __init__(self, key: Sequence[str], newest: Sequence[str]) -> None:
        self.key, self.newest = key, newest
        self.dropped = 0

    def __call__(self, rows: pa.Table) -> pa.Table:
        if not self.key:
            return rows
        kept = once_per_key(rows, self.key, self.newest)
        self.dropped += rows.num_rows - kept.num_rows
        return kept


def _rewrite(
    tables: DeltaTables,
    name: str,
    snapshot: DeltaTable,
    files: pa.Table,
    value: str | None,
    once: _Once,
    written_down: bool,
) -> int:
    """Rewrite ``files`` (add actions of ``snapshot``, of one partition ``value``, oldest
    first) as larger ones in one commit that changes no data (but for ``once``'s copies);
    return how many files it added. ``written_down``: see :func:`compact`."""
    schema, partitions, _ = tables.specs[name]
    partition = partitions[0] if partitions else None
    stored = pa.schema([f for f in schema if f.name != partition])

    def rows() -> Iterator[pa.Table]:
        uris, sizes = files.column("uri").to_pylist(), files.column("size_bytes").to_pylist()
        start = 0
        while start < len(uris):  # about _COMPACT_TARGET_BYTES of files a read
            stop, size = start + 1, sizes[start]
            while stop < len(uris) and size + sizes[stop] <= _COMPACT_TARGET_BYTES:
                size, stop = size + sizes[stop], stop + 1
            read = read_files(
                uris[start:stop],
                stored,
                tables.storage_options,
                sizes=sizes[start:stop],
                kept=tables.written,
            )
            if partition is not None:
                read = read.append_column(
                    schema.field(partition), pa.repeat(pa.scalar(value), read.num_rows)
                )
            yield once(read.select(schema.names))
            start = stop

    adds = tables.write(name, rows(), data_change=False)
    where = {partition: value} if partition else {}
    paths, sizes = files.column("path").to_pylist(), files.column("size_bytes").to_pylist()
    removes = [
        {"path": p, "size": n, "partition_values": where} for p, n in zip(paths, sizes, strict=True)
    ]
    tables.commit(name, adds, snapshot, info={"rmqtx.operation": "compact"}, removes=removes)
    if written_down:
        # Found there by a put of one of these files that stalled past its tombstone, before
        # any VACUUM ran (rmq_spark.delta.commit): only a put readers saw is removed.
        now = time.time()
        fs, path = filesystem(tables.uri(name), tables.storage_options)
        write_records(
            fs,
            path.rstrip("/"),
            math.ceil(now + tombstone_retention(snapshot)),
            {unquote(p): int(now * 1000) for p in paths},
            local=scheme(tables.uri(name)) == "file",
        )
    return len(adds)
