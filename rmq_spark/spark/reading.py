"""Reading committed messages straight from the CommitLog's data files (each shard's).

The driver plans tasks from the Delta snapshot's add actions: it keeps the files whose
statistics overlap the offset ranges, then cuts them, in offset order, into tasks of about
``TASK_BYTES``. Each file is read by one task only. A task reads
its files with pyarrow (multi-threaded, row groups pruned by statistics), keeps the rows in
its offset ranges, and returns them with every queue's rows in offset order, as Arrow record
batches (files as the publisher writes them already are; others are sorted). Timestamps become
offsets by reading the same files, pruned by their ``store_timestamp`` statistics
(:func:`timestamp_offsets`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from functools import partial, reduce
from itertools import groupby

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import InputPartition

from rmq_spark.delta.reads import read_files, with_uris
from rmq_spark.delta.txnlog import check_readable
from rmq_spark.model.errors import CorruptStoreError, DataLossError
from rmq_spark.model.schema import COMMITLOG_SCHEMA
from rmq_spark.spark.offsets import (
    Offsets,
    describe_ranges,
    skip_lost,
)
from rmq_spark.store.commitlog_reader import overlaps
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: One task reads files of at most this many bytes and rows (a larger single file is one
#: task): Parquet sizes are compressed, so rows bound the work for compressible bodies.
TASK_BYTES = 128 * 1024 * 1024
TASK_ROWS = 128 * 1024
#: Arrow batches handed to Spark hold about this many bytes, and at most ``BATCH_ROWS`` rows
#: (Spark's own default for Arrow batches): the JVM reads a batch, then copies it into rows,
#: and a batch that stays in the CPU's cache between the two is copied faster (1 KiB bodies:
#: 10,000-row batches read at 234k msg/s, 2,000-row ones at 261k, mean of four runs each).
BATCH_BYTES = 2 * 1024 * 1024
BATCH_ROWS = 10_000
#: The CommitLog's data file schema: ``topic`` is the partition column, not in the files.
FILE_SCHEMA = pa.schema([f for f in COMMITLOG_SCHEMA if f.name != "topic"])
#: The columns :func:`timestamp_offsets` reads.
TIMESTAMP_COLUMNS = ("queue_id", "queue_offset", "store_timestamp")
#: The columns that say where a message is (:func:`_check_stored` reads only these).
_ROUTING = pa.schema([FILE_SCHEMA.field("queue_id"), FILE_SCHEMA.field("queue_offset")])
#: And the message's id (:func:`_read_once` reads these).
_IDS = pa.schema([*_ROUTING, FILE_SCHEMA.field("msg_id")])


@dataclass(frozen=True)
class CommitLogSlice(InputPartition):
    """One read task: some CommitLog data files and what to keep from them."""

    #: (topic, file URI), in offset order.
    files: tuple[tuple[str, str], ...]
    #: (topic, queue id, first offset, end offset) ranges to keep.
    ranges: tuple[tuple[str, int, int, int], ...]
    #: Subscription tags to keep (None: every tag).
    tags: frozenset[str] | None
    storage_options: tuple[tuple[str, str], ...]
    #: (topic, queue id, first offset, end offset) ranges an earlier task reads
    #: (:func:`_read_once`).
    skip: tuple[tuple[str, int, int, int], ...] = ()


def plan_slices(
    store: Store,
    start: Offsets,
    end: Offsets,
    tags: frozenset[str] | None = None,
    fail_on_data_loss: bool = True,
    task_bytes: int = TASK_BYTES,
    task_rows: int = TASK_ROWS,
) -> list[CommitLogSlice]:
    """The read tasks for offsets ``[start, end)`` of every queue in ``end``.

    A queue whose ``start`` is below its earliest offset in the snapshot planned from (its
    messages were removed by retention) raises :class:`rmq_spark.model.errors.DataLossError`, or
    with ``fail_on_data_loss`` false is read from the earliest offset (see
    :func:`rmq_spark.spark.offsets.skip_lost`). So do offsets of the ranges that are not stored
    (:func:`_check_stored`): another Delta writer removed published messages.

    A store of shards has one CommitLog, its root's: every queue is read from it.
    """
    commitlog = store.table("commitlog")
    trimmed = store.earliest_stored(commitlog)
    begin = skip_lost(
        {t: {q: start.get(t, {}).get(q, 0) for q in queues} for t, queues in end.items()},
        {t: {q: trimmed.get((t, q), 0) for q in queues} for t, queues in end.items()},
        fail=fail_on_data_loss,
    )
    ranges = tuple(
        (topic, queue_id, begin[topic][queue_id], stop)
        for topic in sorted(end)
        for queue_id, stop in sorted(end[topic].items())
        if stop > begin[topic][queue_id]
    )
    if not ranges:
        return []
    check_readable(commitlog, store.table_uri("commitlog"))
    wanted = {(t, q): (s, e) for t, q, s, e in ranges}
    files = with_uris(commitlog, store.table_uri("commitlog")).to_pylist()
    files = [f for f in files if overlaps(f, wanted)]
    options = tuple(sorted(store.settings.storage_options.items()))
    twice = _check_stored(files, ranges, dict(options), fail_on_data_loss)
    files.sort(key=lambda f: (f["partition.topic"], f["min.queue_offset"] or 0, f["uri"]))
    slices: list[CommitLogSlice] = []
    batch: list[tuple[str, str]] = []
    size = rows = 0
    for f in files:
        if batch and (size + f["size_bytes"] > task_bytes or rows + f["num_records"] > task_rows):
            slices.append(CommitLogSlice(tuple(batch), ranges, tags, options))
            batch, size, rows = [], 0, 0
        batch.append((f["partition.topic"], f["uri"]))
        size += f["size_bytes"]
        rows += f["num_records"]
    if batch:
        slices.append(CommitLogSlice(tuple(batch), ranges, tags, options))
    return _read_once(slices, twice, dict(options)) if twice else slices


def _check_stored(
    files: list[dict], ranges: tuple[tuple[str, int, int, int], ...], options: dict, fail: bool
) -> list[tuple[str, int, int, int]]:
    """Check that every offset of ``ranges`` is stored in ``files`` (the data files whose
    statistics admit them), reading only their routing columns; returns the ranges that
    hold an offset stored more than once.

    The publisher assigns dense offsets and only retention removes messages (a prefix of each
    queue, with its earliest offset recorded in the same commit). A hole is a message another
    Delta writer removed: a DELETE, a RESTORE to an earlier version, an overwrite. It raises
    :class:`DataLossError` naming the missing ranges, or with ``fail`` false is logged as a
    warning and read past. An offset stored twice is another writer's copy
    (:func:`_read_once`).
    """
    missing: list[tuple[str, int, int, int]] = []
    twice: list[tuple[str, int, int, int]] = []
    for topic in sorted({t for t, *_ in ranges}):
        wanted = [(q, first, end) for t, q, first, end in ranges if t == topic]
        uris = [f["uri"] for f in files if f["partition.topic"] == topic]
        rows = read_files(uris, _ROUTING, options, partial(_wanted, wanted, None, []))
        queues = rows.column("queue_id").to_numpy()
        offsets = rows.column("queue_offset").to_numpy()
        order = np.lexsort((offsets, queues))
        queues, offsets = queues[order], offsets[order]
        for queue_id, first, end in wanted:
            lo, hi = np.searchsorted(queues, queue_id), np.searchsorted(queues, queue_id, "right")
            stored = offsets[lo:hi]
            distinct = stored[np.diff(stored, prepend=first - 1) != 0]
            if len(distinct) < len(stored):
                twice.append((topic, queue_id, first, end))
            if len(distinct) == end - first:
                continue  # every offset of [first, end)
            bounds = np.concatenate([[first - 1], distinct, [end]])
            gaps = np.flatnonzero(np.diff(bounds) > 1)
            missing += [(topic, queue_id, int(bounds[i]) + 1, int(bounds[i + 1])) for i in gaps]
    if not missing:
        return twice
    lost = sum(end - first for *_, first, end in missing)
    named = describe_ranges(missing)
    if fail:
        raise DataLossError(
            f"{lost} published message(s) are missing from the CommitLog: {named}. Another "
            "Delta writer removed them (a DELETE, RESTORE or overwrite of the store's commitlog "
            "table; see docs/guarantees.md), and they cannot be read. Restore the table "
            "to a version that has them, or set option failOnDataLoss to false to read on past "
            "them (with a warning)."
        )
    log.warning(
        "%d published message(s) are missing from the CommitLog (failOnDataLoss is false; "
        "another Delta writer removed them): %s",
        lost,
        named,
    )
    return twice


def _read_once(
    slices: list[CommitLogSlice], twice: list[tuple[str, int, int, int]], options: dict
) -> list[CommitLogSlice]:
    """``slices`` made to read every offset of the ranges ``twice`` once: a copy in a later
    task than the first that holds the offset is skipped there (a task drops the copies it
    reads side by side itself, :func:`_in_queue_order`).

    Copies come from other Delta writers: a deltalake ``optimize.compact()`` that raced
    rmq-spark's compaction of the same files lands beside it (deltalake lets a commit go on
    when a ``dataChange=false`` commit removed its files first), or rows appended again. A
    message is its ``msg_id``: two different messages at one offset are a corrupt store, and
    raise :class:`CorruptStoreError`.
    """
    first_task: dict[tuple[str, int, int], tuple[str, int]] = {}
    planned: list[CommitLogSlice] = []
    rows_read = 0
    for task, s in enumerate(slices):
        skip: list[tuple[str, int, int]] = []
        for topic, files in groupby(s.files, key=lambda f: f[0]):
            wanted = [(q, first, end) for t, q, first, end in twice if t == topic]
            if not wanted:
                continue
            rows = read_files(
                [u for _, u in files], _IDS, options, partial(_wanted, wanted, None, [])
            )
            rows_read += rows.num_rows
            for q, offset, msg_id in zip(
                *(rows.column(c).to_pylist() for c in _IDS.names), strict=True
            ):
                kept = first_task.setdefault((topic, q, offset), (msg_id, task))
                if kept[0] != msg_id:
                    raise CorruptStoreError(
                        f"the CommitLog stores different messages at offset {offset} of {topic} "
                        f"queue {q} ({kept[0]} and {msg_id}): another Delta writer added rows "
                        "the store did not publish. Undo that commit (RESTORE TABLE ... TO "
                        "VERSION AS OF the version before it)."
                    )
                if kept[1] != task:
                    skip.append((topic, q, offset))
        planned.append(replace(s, skip=_as_ranges(skip)))
    log.warning(
        "%d copies of published messages in %s are stored in the CommitLog beside them: another "
        "Delta writer's compaction raced rmq-spark's, or appended published rows again. Each "
        "message is read once.",
        rows_read - len(first_task),
        describe_ranges(twice),
    )
    return planned


def _as_ranges(offsets: list[tuple[str, int, int]]) -> tuple[tuple[str, int, int, int], ...]:
    """(topic, queue id, offset) triples as (topic, queue id, first, end) ranges."""
    ranges: list[tuple[str, int, int, int]] = []
    for topic, q, offset in sorted(set(offsets)):
        if ranges and ranges[-1][:2] == (topic, q) and ranges[-1][3] == offset:
            ranges[-1] = (topic, q, ranges[-1][2], offset + 1)
        else:
            ranges.append((topic, q, offset, offset + 1))
    return tuple(ranges)


def read_slice(task: CommitLogSlice) -> Iterator[pa.RecordBatch]:
    """The rows of one task in the source schema; each queue's rows in offset order."""
    options = dict(task.storage_options)
    for topic, files in groupby(task.files, key=lambda f: f[0]):
        ranges = [(q, s, e) for t, q, s, e in task.ranges if t == topic]
        skip = [(q, s, e) for t, q, s, e in task.skip if t == topic]
        rows = read_files(
            [uri for _, uri in files],
            FILE_SCHEMA,
            options,
            partial(_wanted, ranges, task.tags, skip),
        )
        if not rows.num_rows:
            continue
        rows = _in_queue_order(rows)
        columns = [
            pa.repeat(pa.scalar(topic, pa.string()), rows.num_rows)
            if f.name == "topic"
            else rows.column(f.name)
            for f in COMMITLOG_SCHEMA
        ]
        table = pa.Table.from_arrays(columns, schema=COMMITLOG_SCHEMA)
        rows_per_batch = BATCH_BYTES * table.num_rows // max(table.nbytes, 1)
        yield from table.to_batches(max_chunksize=max(1, min(BATCH_ROWS, rows_per_batch)))


def _wanted(
    ranges: list[tuple[int, int, int]],
    tags: frozenset[str] | None,
    skip: list[tuple[int, int, int]],
    rows: pa.Table,
) -> pa.ChunkedArray:
    """Mask of the rows inside one of the (queue, start, end) ranges and none of ``skip``,
    with a wanted tag."""
    mask = _in_ranges(ranges, rows)
    if skip:
        mask = pc.and_(mask, pc.invert(_in_ranges(skip, rows)))
    if tags is not None:
        mask = pc.and_(mask, pc.is_in(rows.column("tags"), pa.array(sorted(tags), pa.string())))
    return mask


def _in_ranges(ranges: list[tuple[int, int, int]], rows: pa.Table) -> pa.ChunkedArray:
    """Mask of the rows inside one of the (queue, start, end) ranges."""
    queue, offset = rows.column("queue_id"), rows.column("queue_offset")
    masks = [
        pc.and_(pc.equal(queue, q), pc.and_(pc.greater_equal(offset, s), pc.less(offset, e)))
        for q, s, e in ranges
    ]
    return reduce(pc.or_, masks)


def _in_queue_order(rows: pa.Table) -> pa.Table:
    """``rows`` with every queue's rows in offset order, each offset once (a copy another
    Delta writer stored is the same message, :func:`_read_once`). Files as the publisher
    writes them already are (queues interleave, each in order), so the common case copies
    nothing."""
    queues = rows.column("queue_id").to_numpy()
    offsets = rows.column("queue_offset").to_numpy()
    grouped = np.lexsort((np.arange(len(queues)), queues))  # stable: by queue, then position
    same_queue = queues[grouped][1:] == queues[grouped][:-1]
    if np.all(np.diff(offsets[grouped])[same_queue] > 0):
        return rows
    order = np.lexsort((offsets, queues))
    queues, offsets = queues[order], offsets[order]
    first = np.concatenate([[True], (queues[1:] != queues[:-1]) | (offsets[1:] != offsets[:-1])])
    return rows.combine_chunks().take(order[first])  # one chunk: far faster


def timestamp_offsets(store: Store, topics: tuple[str, ...], millis: int, end: Offsets) -> Offsets:
    """Per queue, the first offset stored at or after ``millis`` (capped at ``end``).

    Only files whose newest ``store_timestamp`` reaches ``millis`` are read, three columns each,
    from the CommitLog of every shard of ``store``.
    """
    since = datetime.fromtimestamp(millis / 1000, UTC)
    files: dict[str, list[str]] = {}
    for f in store.data_files("commitlog").to_pylist():
        newest = f["max.store_timestamp"]
        if f["partition.topic"] in topics and (newest is None or newest >= since):
            files.setdefault(f["partition.topic"], []).append(f["uri"])
    columns = pa.schema([FILE_SCHEMA.field(c) for c in TIMESTAMP_COLUMNS])
    since_scalar = pa.scalar(since, columns.field("store_timestamp").type)
    result: Offsets = {}
    for topic, queues in end.items():
        rows = read_files(
            files.get(topic, []),
            columns,
            store.settings.storage_options,
            lambda t: pc.greater_equal(t.column("store_timestamp"), since_scalar),
        )
        first = rows.group_by("queue_id").aggregate([("queue_offset", "min")]).to_pylist()
        found = {r["queue_id"]: r["queue_offset_min"] for r in first}
        result[topic] = {q: min(found.get(q, stop), stop) for q, stop in queues.items()}
    return result
