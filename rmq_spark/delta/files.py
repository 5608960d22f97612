"""Writing more rows than memory holds: sink stages, and publishing a large ``op`` version.

deltalake's writer holds its whole input, several times over (256 MiB of bodies grew a
process by 0.9 to 1.9 GiB), so handing it a sink task's partition, or the publish of a sink
epoch (one decision committing every row a job wrote, published by one Python process on the
driver), would fail any write larger than that process's memory. Here rows are written with
pyarrow's streaming Parquet writer, one batch in memory at a time, into new data files with
the statistics readers prune by, and the files are committed in one Delta commit (deltalake's
``create_write_transaction``: the same conflict check, application ids included, as any
append). A publish reads a large version from ``half`` the same way, a batch at a time.
"""

from __future__ import annotations

import functools
import json
import os
import queue
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cached_property
from typing import Any
from urllib.parse import quote

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable
from deltalake.transaction import AddAction

from rmq_spark.delta.storage import arrow_filesystem, filesystem, is_s3
from rmq_spark.model.schema import HALF_SCHEMA

#: Where file statistics' timestamps count their milliseconds from.
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
#: Rows per batch read from ``half`` by a publish (also the row groups it writes).
BATCH_ROWS = 32_768
#: A CommitLog file is closed at about this many bytes (deltalake's default target).
FILE_BYTES = 100 * 1024 * 1024
#: A parallel write (:func:`write_in_parallel`) cuts its rows into pieces of about this many
#: bytes of Arrow data, each its own file(s), and has this many threads write them.
PIECE_BYTES = 32 * 1024 * 1024
PARALLEL_WRITERS = max(1, min(4, os.cpu_count() or 1))
#: A row group holds about this many bytes of Arrow data at most: what a reader of the file
#: holds in memory at once (a publish reading ``half`` a batch at a time, the source).
ROW_GROUP_BYTES = 8 * 1024 * 1024
#: Bytes a data file's output stream gathers before writing: the Parquet writer writes every
#: page header, page and footer separately (about 60 writes for a producer's file of 64
#: messages of 256 B); buffered, such a file is one write. Allocated when the file is opened,
#: so small: a publish keeps a file open per topic.
STREAM_BUFFER_BYTES = 64 * 1024
#: A data file on S3 up to this size is one PUT of bytes gathered in memory (:class:`_Gathered`).
GATHERED_BYTES = 8 * 1024 * 1024
#: Columns whose statistics the written files carry (what readers prune by): ids, routing
#: columns and timestamps; not bodies, keys or properties.
_STATS_COLUMNS = frozenset(
    {
        "transaction_id",
        "msg_id",
        "producer_group",
        "topic",
        "queue_id",
        "queue_offset",
        "born_timestamp",
        "store_timestamp",
        "sink_id",
        "epoch",
        "generation",
    }
)

#: Columns whose values rarely repeat: dictionary encoding them is wasted work (pyarrow tries
#: it for every row group before falling back; 10 to 15% of writing 1 KiB bodies).
_UNIQUE_COLUMNS = frozenset({"body", "msg_id", "queue_offset"})
#: Columns without Parquet statistics: no reader filters on them, and a min/max of every
#: body costs as much again.
_LARGE_COLUMNS = frozenset({"body", "properties"})
#: Columns of at most this many rows get their statistics in Python (:func:`_min_max`).
_FEW_ROWS = 16


@dataclass(frozen=True)
class LargeVersion:
    """The committed transactions of one ``op`` version and the ``half`` files (add actions
    with their ``uri``, in the order they were stored) that may hold them."""

    files: pa.Table
    transaction_ids: pa.ChunkedArray

    @cached_property
    def uris(self) -> list[str]:
        """The files whose statistics admit one of the transactions, in stored order."""
        return admitting(self.files, self.transaction_ids.to_pylist()).column("uri").to_pylist()

    def keep(self, rows: pa.Table) -> pa.ChunkedArray:
        """Mask of the rows of these transactions."""
        return pc.is_in(rows.column("transaction_id"), value_set=self.transaction_ids)

    def batches(self, storage_options: Mapping[str, str]) -> Iterator[pa.Table]:
        """The half messages of the transactions, a batch at a time, in stored order (a
        transaction's messages in send order)."""
        for uri in self.uris:
            dataset = pads.dataset(
                [fsspec.core.strip_protocol(uri)],
                schema=HALF_SCHEMA,  # older files lack columns added later: null
                format="parquet",
                filesystem=arrow_filesystem(uri, storage_options),
            )
            for batch in dataset.to_batches(batch_size=BATCH_ROWS):
                rows = pa.Table.from_batches([batch])
                keep = self.keep(rows)
                if pc.all(keep).as_py() is not True:  # a sink task's file is one transaction
                    rows = rows.filter(keep)
                if rows.num_rows:
                    yield rows


def read_ahead(rows: Iterator[pa.Table], depth: int = 2) -> Iterator[pa.Table]:
    """``rows``, made on a helper thread up to ``depth`` batches ahead of the consumer: a
    publish of a large version reads and numbers the next batch while the last one is being
    compressed and written (pyarrow does both without the GIL). An exception of ``rows`` is
    raised to the consumer; a consumer that stops early stops the helper."""
    ready: queue.Queue[object] = queue.Queue(maxsize=depth)
    stopped = threading.Event()
    end = object()

    def make() -> None:
        try:
            for item in rows:
                if not _hand_over(ready, item, stopped):
                    return
            _hand_over(ready, end, stopped)
        except BaseException as exc:  # raised again by the consumer
            _hand_over(ready, exc, stopped)

    helper = threading.Thread(target=make, name="rmqtx-read-ahead", daemon=True)
    helper.start()
    try:
        while (item := ready.get()) is not end:
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stopped.set()
        helper.join()


def _hand_over(ready: queue.Queue[object], item: object, stopped: threading.Event) -> bool:
    """Put ``item`` for the consumer unless it stopped; whether it was put."""
    while not stopped.is_set():
        try:
            ready.put(item, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def admitting(files: pa.Table, ids: Sequence[str], column: str = "transaction_id") -> pa.Table:
    """The files (add actions) whose statistics of ``column`` admit one of ``ids``, in the
    files' order."""
    first, stop = id_ranges(files, np.sort(np.array(list(ids), dtype=object)), column)
    return files.filter(pa.array(stop > first, pa.bool_()))


def id_ranges(
    files: pa.Table, ranked: np.ndarray, column: str = "transaction_id"
) -> tuple[np.ndarray, np.ndarray]:
    """Per file (add action): the run ``[first, stop)`` of the sorted ids ``ranked`` that its
    statistics of ``column`` admit (a file without statistics admits them all)."""
    low = files.column(f"min.{column}").to_pylist()
    high = files.column(f"max.{column}").to_pylist()
    first, stop = [], []
    for lo, hi in zip(low, high, strict=True):
        unknown = lo is None or hi is None
        first.append(0 if unknown else np.searchsorted(ranked, lo, "left"))
        stop.append(len(ranked) if unknown else np.searchsorted(ranked, hi, "right"))
    return np.array(first, dtype=np.int64), np.array(stop, dtype=np.int64)


def stored_share(
    files: pa.Table, transaction_ids: pa.ChunkedArray, columns: Sequence[str]
) -> list[np.ndarray]:
    """Per file statistic of ``columns`` (``size_bytes``, ``num_records``), an upper estimate
    of each transaction's share of it in ``half``: every file its id statistics admit, shared
    equally among the transactions of ``transaction_ids`` that the file admits (a sink stage
    writes one transaction per file; a producer's prepare many per file)."""
    ids = np.array(transaction_ids.to_pylist(), dtype=object)
    order = np.argsort(ids, kind="stable")
    first, stop = id_ranges(files, ids[order])
    held = stop - first
    admits = held > 0
    shares = []
    for column in columns:
        per_id = np.array(files.column(column).to_pylist(), dtype=float)[admits] / held[admits]
        share = np.zeros(len(ids) + 1)
        np.add.at(share, first[admits], per_id)
        np.add.at(share, stop[admits], -per_id)
        stored = np.zeros(len(ids))
        stored[order] = np.cumsum(share)[:-1]
        shares.append(stored)
    return shares


def write_files(
    uri: str,
    rows: Iterator[pa.Table],
    schema: pa.Schema,
    partition: str | None,
    storage_options: Mapping[str, str],
    *,
    data_change: bool = True,
    kept: WrittenFiles | None = None,
) -> list[AddAction]:
    """Write ``rows`` (``schema``) as new data files of the Delta table at ``uri``, streaming,
    one file at a time per value of the ``partition`` column; return their add actions, with
    the statistics readers prune by. The files are invisible until a commit adds them; files
    no commit adds are removed by VACUUM. ``data_change=False``: the rows are stored already
    (a compaction), and Delta's streaming readers skip the files. ``kept``: where the bytes of
    the small files written go as well."""
    fs = arrow_filesystem(uri, storage_options)
    base = fsspec.core.strip_protocol(uri).rstrip("/")
    file_schema = pa.schema([f for f in schema if f.name != partition])
    put = _signed_put(uri, storage_options)
    open_files: dict[str | None, _File] = {}
    done: list[AddAction] = []
    try:
        for batch in rows:
            values = [None] if partition is None else pc.unique(batch[partition]).to_pylist()
            for value in values:
                part = batch
                if len(values) > 1:
                    part = batch.filter(pc.equal(batch[partition], value))
                current = open_files.get(value)
                if current is None:
                    current = open_files[value] = _File(
                        fs, base, file_schema, partition, value, data_change, kept, put
                    )
                current.write(part.select(file_schema.names))
                if current.size >= FILE_BYTES:
                    done.append(open_files.pop(value).close())
        done += [f.close() for f in open_files.values()]
        open_files.clear()
    finally:
        for f in open_files.values():
            f.discard()
    return done


def _signed_put(uri: str, options: Mapping[str, str]) -> Callable[[str, bytes], None] | None:
    """The PUT of :class:`rmq_spark.delta.s3requests.S3Requests` for a table on S3; None
    elsewhere, or where s3fs makes the requests (behind an HTTP proxy)."""
    if not is_s3(uri):
        return None
    from rmq_spark.delta.s3requests import S3FileSystem  # s3fs is an extra's

    fs = filesystem(uri, options)[0]
    return fs.requests.put if isinstance(fs, S3FileSystem) else None


def write_in_parallel(
    uri: str,
    rows: Iterator[pa.Table],
    schema: pa.Schema,
    partition: str | None,
    storage_options: Mapping[str, str],
    writers: int = PARALLEL_WRITERS,
    piece_bytes: int = PIECE_BYTES,
) -> list[AddAction]:
    """:func:`write_files`, on ``writers`` threads: ``rows`` are cut into pieces of about
    ``piece_bytes`` of consecutive rows, each written into files of its own by the next
    free thread (pyarrow encodes and compresses without the GIL). A publish of a large version
    wrote one file at a time, at most one core busy. Memory: a piece per thread at most (a
    new piece waits for a free thread, and ``rows`` waits with it). The add actions come in
    the order of the rows."""
    free = threading.Semaphore(writers)
    pieces: list[Future[list[AddAction]]] = []
    current: queue.Queue[pa.Table | None] | None = None
    size = 0

    def write(piece: queue.Queue[pa.Table | None]) -> list[AddAction]:
        try:
            return write_files(uri, iter(piece.get, None), schema, partition, storage_options)
        finally:
            free.release()

    with ThreadPoolExecutor(writers, thread_name_prefix="rmqtx-writer") as pool:
        try:
            for batch in rows:
                if current is None:
                    free.acquire()
                    if any(p.done() and p.exception() for p in pieces):
                        break  # raised below, in order
                    current, size = queue.Queue(), 0
                    pieces.append(pool.submit(write, current))
                current.put(batch)
                size += batch.nbytes
                if size >= piece_bytes or pieces[-1].done():  # done early: it failed
                    current.put(None)
                    current = None
        finally:
            if current is not None:
                current.put(None)
        return [action for piece in pieces for action in piece.result()]


def commit_files(
    table: DeltaTable,
    actions: list[AddAction],
    partition: str | None,
    commit_properties: CommitProperties,
) -> None:
    """Commit ``actions`` as one append on ``table``'s snapshot (Delta's conflict check
    applies, application ids included), and bring ``table`` up to date (to that commit or a
    later one)."""
    table.create_write_transaction(
        actions,
        mode="append",
        schema=table.schema(),
        partition_by=[partition] if partition else None,
        commit_properties=commit_properties,
    )
    table.update_incremental()


#: The largest data file whose rows :class:`WrittenFiles` keeps (their Arrow buffers' size).
KEPT_FILE_BYTES = 1024 * 1024
#: How many bytes of rows :class:`WrittenFiles` keeps at most (the oldest files go first).
KEPT_BYTES = 16 * 1024 * 1024


class WrittenFiles:
    """The rows of the small data files this process wrote lately (the Arrow tables written),
    by path, for its own compaction of them (:func:`rmq_spark.delta.reads.read_files`) to
    take without a request or a Parquet decode: a table appended to directly gets a file a
    commit, and its compaction every checkpoint interval read each back, a GET a file on an
    object store (1.3 of a transaction's requests at 1 x 4 on S3), and about half a
    millisecond of CPU a file anywhere (the decode of a footer of every column). A file is
    taken out when read; the oldest go past :data:`KEPT_BYTES`. Data files are never rewritten
    in place, so what is kept is what the store holds."""

    def __init__(self, limit: int = KEPT_BYTES) -> None:
        self._limit = limit
        self._files: OrderedDict[str, pa.Table] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()

    def add(self, path: str, rows: pa.Table) -> None:
        with self._lock:
            self._files[path] = rows
            self._bytes += rows.get_total_buffer_size()
            while self._bytes > self._limit:
                self._bytes -= self._files.popitem(last=False)[1].get_total_buffer_size()

    def take(self, paths: Sequence[str]) -> dict[str, pa.Table]:
        """The kept rows of those of ``paths`` that are kept, no longer kept."""
        with self._lock:
            found = {p: self._files.pop(p) for p in paths if p in self._files}
            self._bytes -= sum(t.get_total_buffer_size() for t in found.values())
        return found


class _Gathered:
    """A data file on S3 gathered in memory and PUT whole when closed: one request signed by
    :class:`rmq_spark.delta.s3requests.S3Requests`, about a third of the CPU (and a millisecond
    less) of arrow's S3 stream, whose AWS SDK a producer's small files paid on every commit.
    Past :data:`GATHERED_BYTES` it goes on through arrow's stream (a multipart upload). The
    Parquet writer writes through it as a file object; its :class:`_File` closes it."""

    closed = False

    def __init__(self, fs: pafs.FileSystem, path: str, put: Callable[[str, bytes], None]) -> None:
        self._fs, self._path, self._put = fs, path, put
        self._parts: list[bytes] = []
        self._stream: pa.NativeFile | None = None
        self.size = 0

    def tell(self) -> int:
        return self.size

    def writable(self) -> bool:
        return True

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass

    def write(self, data: bytes) -> int:
        if self._stream is not None:
            self._stream.write(data)
        else:
            self._parts.append(bytes(data))
            if self.size + len(data) > GATHERED_BYTES:
                self._stream = self._fs.open_output_stream(
                    self._path, buffer_size=STREAM_BUFFER_BYTES
                )
                for part in self._parts:
                    self._stream.write(part)
                self._parts = []
        self.size += len(data)
        return len(data)

    def finish(self) -> None:
        """Store the file."""
        if self._stream is not None:
            self._stream.close()
        else:
            self._put(self._path, b"".join(self._parts))

    def abandon(self) -> None:
        """Store nothing more (a file no commit will add)."""
        if self._stream is not None:
            self._stream.close()  # what went up is left for VACUUM, as a crash leaves it


class _File:
    """One data file being written, and the statistics of what it holds."""

    def __init__(
        self,
        fs: object,
        base: str,
        schema: pa.Schema,
        partition: str | None,
        value: str | None,
        data_change: bool,
        kept: WrittenFiles | None,
        put: Callable[[str, bytes], None] | None = None,
    ) -> None:
        self.partition = None if partition is None else {partition: value}
        directory = "" if partition is None else f"{partition}={quote(str(value), safe='')}/"
        self.relative = f"{directory}part-{uuid.uuid4()}-c000.rmqtx.snappy.parquet"
        if directory and isinstance(fs, pafs.LocalFileSystem):  # object stores have no folders
            fs.create_dir(f"{base}/{directory}", recursive=True)  # type: ignore[attr-defined]
        self.path, self.kept = f"{base}/{self.relative}", kept
        self.stream: pa.NativeFile | _Gathered = (
            fs.open_output_stream(self.path, buffer_size=STREAM_BUFFER_BYTES)  # type: ignore[attr-defined]
            if put is None
            else _Gathered(fs, self.path, put)  # type: ignore[arg-type]
        )
        #: The rows written, for ``kept``, while they are no more than KEPT_FILE_BYTES.
        self.written: list[pa.Table] | None = None if kept is None else []
        self.written_bytes = 0
        dictionary, statistics, self.columns = _column_choices(schema)
        self.writer = pq.ParquetWriter(
            self.stream,
            schema,
            compression="snappy",
            use_dictionary=dictionary,
            write_statistics=statistics,
        )
        self.rows = 0
        self.data_change = data_change
        self.low: dict[str, object] = {}
        self.high: dict[str, object] = {}
        self.nulls = dict.fromkeys(self.columns, 0)

    @property
    def size(self) -> int:
        return self.stream.tell()

    def write(self, rows: pa.Table) -> None:
        # A row group per batch, split when its bytes would go over ROW_GROUP_BYTES.
        per_group = max(1, rows.num_rows * ROW_GROUP_BYTES // max(rows.nbytes, 1))
        self.writer.write_table(rows, row_group_size=per_group)
        self.rows += rows.num_rows
        if self.written is not None:
            self.written_bytes += rows.nbytes
            if self.written_bytes > KEPT_FILE_BYTES:
                self.written = None
            else:  # a copy: the rows may be slices of a far larger buffer (a Spark batch read
                # zero-copy, its other columns dropped) or of one their caller goes on changing
                self.written.append(rows.take(np.arange(rows.num_rows)))
        for name in self.columns:
            column = rows.column(name)
            self.nulls[name] += column.null_count
            low, high = _min_max(column)
            if low is not None:
                self.low[name] = min(self.low.get(name, low), low)
                self.high[name] = max(self.high.get(name, high), high)

    def discard(self) -> None:
        """Close a file no commit will add (a write that failed): it is left for VACUUM, as
        a crash leaves it. The stream is the caller's to close, not the Parquet writer's; an
        open S3 stream would finish its upload whenever it was collected."""
        try:
            self.writer.close()
        finally:
            if isinstance(self.stream, _Gathered):
                self.stream.abandon()
            else:
                self.stream.close()

    def close(self) -> AddAction:
        self.writer.close()
        size = self.stream.tell()
        if isinstance(self.stream, _Gathered):
            self.stream.finish()
        else:
            self.stream.close()
        if self.kept is not None and self.written:
            self.kept.add(self.path, pa.concat_tables(self.written))
        stats = {
            "numRecords": self.rows,
            "minValues": {k: _stat(v, up=False) for k, v in self.low.items()},
            "maxValues": {k: _stat(v, up=True) for k, v in self.high.items()},
            "nullCount": self.nulls,
        }
        return AddAction(
            path=quote(self.relative, safe="/="),
            size=size,
            partition_values=self.partition or {},
            modification_time=int(time.time() * 1000),
            data_change=self.data_change,
            stats=json.dumps(stats),
        )


@functools.cache
def _column_choices(schema: pa.Schema) -> tuple[list[str], list[str], list[str]]:
    """The columns of ``schema`` that are dictionary encoded, that carry Parquet statistics,
    and whose Delta statistics a file records."""
    names = schema.names
    return (
        [n for n in names if n not in _UNIQUE_COLUMNS],
        [n for n in names if n not in _LARGE_COLUMNS],
        [n for n in names if n in _STATS_COLUMNS],
    )


def _min_max(column: pa.ChunkedArray) -> tuple[Any, Any]:
    """The least and greatest value of ``column`` (None, None when all are null). A few rows
    (a producer's commit) are compared in Python, a tenth of a compute kernel's call: ids
    and names as strings (code point order is UTF-8's byte order, as Arrow compares them),
    numbers and timestamps as such."""
    if len(column) <= _FEW_ROWS:
        values = [v for v in column.to_pylist() if v is not None]
        return (min(values), max(values)) if values else (None, None)
    low, high = pc.min_max(column).values()
    return low.as_py(), high.as_py()


def _stat(value: object, up: bool) -> object:
    """A statistic as Delta writes it: timestamps in milliseconds, rounded outwards (``up``
    for a maximum) so that the range still holds every row, ISO 8601 in UTC. In whole
    numbers: a float of microseconds since 1970 rounds a date past the 23rd century to the
    wrong millisecond, and a reader pruning by it would skip the row."""
    if not isinstance(value, datetime):
        return value
    micros = (value.replace(tzinfo=value.tzinfo or UTC) - _EPOCH) // timedelta(microseconds=1)
    millis = -(-micros // 1000) if up else micros // 1000
    moment = _EPOCH + timedelta(milliseconds=millis)
    return moment.isoformat(timespec="milliseconds").replace("+00:00", "Z")
