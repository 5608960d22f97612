"""The CommitLog as the consumer groups of ``rmqtx serve`` read it (:mod:`rmq_spark.store.
deliveries`): a queue's messages by offset, from the latest snapshot, which is kept while the
table's version stays (a long poll looks every 100 ms: one read of the log's next entry then,
not a listing of the log), and small data files kept read (they never change)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.delta.reads import read_files
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.schema import COMMITLOG_SCHEMA
from rmq_spark.store.queues import earliest_stored, next_offsets

#: Data files of the CommitLog kept read.
_CACHED_FILES = 64
#: Files up to this size are kept; bigger (compacted) ones are read for each range.
_CACHED_FILE_BYTES = 8 << 20
#: The columns of a message in a data file (the topic is the file's partition).
_FILE_SCHEMA = pa.schema([f for f in COMMITLOG_SCHEMA if f.name != "topic"])


def overlaps(file: Mapping[str, object], wanted: Mapping[tuple[str, int], tuple]) -> bool:
    """Whether a file's statistics admit a row of a wanted (topic, queue) offset range."""
    topic = file["partition.topic"]
    q_low, q_high = file["min.queue_id"], file["max.queue_id"]
    o_low, o_high = file["min.queue_offset"], file["max.queue_offset"]
    for (t, q), (s, e) in wanted.items():
        if t != topic:
            continue
        if q_low is not None and q_high is not None and not q_low <= q <= q_high:
            continue
        if o_low is None or o_high is None or (o_high >= s and o_low < e):
            return True
    return False


class CommitLogReader:
    """Reads the CommitLog of one store for one thread (the consumers' group committer)."""

    def __init__(self, tables: DeltaTables) -> None:
        self.tables = tables
        self._files: OrderedDict[str, pa.Table] = OrderedDict()
        self._latest: tuple[int, CommitLogView] | None = None

    def view(self) -> CommitLogView:
        """The latest snapshot's view, the same object while the version stays."""
        version = self.tables.latest_version("commitlog")
        if self._latest is None or self._latest[0] != version:
            snapshot = self.tables.snapshot("commitlog")
            view = CommitLogView(
                self,
                next_offsets(self.tables, snapshot),
                earliest_stored(self.tables, snapshot),
                self.tables.data_files("commitlog", snapshot).to_pylist(),
            )
            self._latest = (snapshot.version(), view)
        return self._latest[1]

    def read_range(
        self, files: list[dict[str, Any]], queue_id: int, first: int, end: int
    ) -> list[dict[str, Any]]:
        """The rows of one queue's offsets ``[first, end)`` in ``files`` (its data files whose
        statistics admit them), in offset order, each offset once."""
        parts = []
        for f in files:
            table = self._files.get(f["uri"])
            if table is None:
                table = read_files(
                    [f["uri"]], _FILE_SCHEMA, self.tables.storage_options, sizes=[f["size_bytes"]]
                )
                if f["size_bytes"] <= _CACHED_FILE_BYTES:
                    self._files[f["uri"]] = table
                    if len(self._files) > _CACHED_FILES:
                        self._files.popitem(last=False)
            else:
                self._files.move_to_end(f["uri"])
            queue, offset = table.column("queue_id"), table.column("queue_offset")
            mask = pc.and_(
                pc.equal(queue, queue_id),
                pc.and_(pc.greater_equal(offset, first), pc.less(offset, end)),
            )
            parts.append(table.filter(mask))
        if not parts:
            return []
        rows = pa.concat_tables(parts).sort_by("queue_offset").to_pylist()
        once = {r["queue_offset"]: r for r in rows}  # another writer's copy of a row: once
        return list(once.values())


class CommitLogView:
    """The CommitLog in one snapshot: each queue's next and earliest offsets, its data files."""

    def __init__(
        self,
        reader: CommitLogReader,
        next_offsets: dict[tuple[str, int], int],
        earliest: dict[tuple[str, int], int],
        files: list[dict[str, Any]],
    ) -> None:
        self._reader, self.next_offsets = reader, next_offsets
        self._earliest, self._files = earliest, files

    def earliest(self, topic: str, queue_id: int) -> int:
        """The first offset of a queue still stored."""
        return self._earliest.get((topic, queue_id), 0)

    def messages(self, topic: str, queue_id: int, first: int, count: int) -> list[dict[str, Any]]:
        """The rows of ``count`` offsets of a queue from ``first`` (those stored)."""
        wanted = {(topic, queue_id): (first, first + count)}
        files = [f for f in self._files if overlaps(f, wanted)]
        return self._reader.read_range(files, queue_id, first, first + count)
