"""``format("rmqtx")``: committed messages of an rmq-spark store as a batch and streaming source.

>>> rmq_spark.register(spark)          # get_spark() does it for you
>>> df = (spark.read.format("rmqtx")
...       .option("path", "storage").option("topic", "OrderEvents")
...       .option("tags", "OrderCreated || OrderPaid")
...       .load())

Output schema (fixed): ``topic`` string, ``queue_id`` int, ``queue_offset`` long, ``msg_id``
string, ``transaction_id`` string (null for normal messages), ``producer_group`` string,
``keys`` string, ``tags`` string, ``body`` binary, ``properties`` map<string,string>,
``born_timestamp`` timestamp, ``store_timestamp`` timestamp (when the message became visible).

Streaming:

>>> stream = (spark.readStream.format("rmqtx")
...           .option("path", "storage").option("topic", "OrderEvents")
...           .option("maxMessagesPerTrigger", 10000)
...           .load())

Options (case-insensitive; an unknown option is an error listing the valid ones, raised by
``load()``):

=====================  ==========  =========  ==================================================
option                 required    default    meaning
=====================  ==========  =========  ==================================================
``path``               no          conf       store root (``store.path`` of conf/rmq-spark.toml)
``topic``              yes                    one topic, or several separated by commas
``startingOffsets``    no          earliest   ``earliest``, ``latest`` or ``{"T": {"0": 42}}``
``endingOffsets``      no          latest     ``latest`` or a JSON like ``startingOffsets``
``startingTimestamp``  no                     ms since epoch: start at the first message stored
                                              at or after it (overrides ``startingOffsets``)
``endingTimestamp``    no                     batch only, ms since epoch: stop before the first
                                              message stored at or after it
``tags``               no          ``*``      RocketMQ subscription: ``*`` or ``TagA || TagB``
``maxMessagesPerTrigger`` no       none       streaming only: most messages per micro-batch,
                                              shared fairly over queues (AvailableNow honours it)
``maxBytesPerTrigger`` no          none       streaming only: soft cap on a micro-batch's bytes
                                              (``64m``, ``1g``; stored bytes, estimated from the
                                              CommitLog files' sizes and row counts); at least
                                              one message a batch; with ``maxMessagesPerTrigger``
                                              the cap hit first wins
``consumerGroup``      no                     streaming only: record the group's progress in
                                              the ``consumer_offsets`` table (for lag) after
                                              each micro-batch, the last of a run included
``failOnDataLoss``     no          true       a read starting below a queue's earliest offset
                                              (retention removed messages it had not read)
                                              fails naming the lost ranges; ``false``: warn
                                              and read on from the earliest offset
``failOnMissingTopic`` no          false      a topic with no messages in the store fails
                                              ``load()``; ``false``: a warning naming the
                                              store's topics (and a close match)
``storage.<KEY>``      no          conf       a storage option over ``[store] storage_options``
                                              (e.g. ``storage.AWS_ENDPOINT_URL``)
=====================  ==========  =========  ==================================================

A queue id in ``startingOffsets`` / ``endingOffsets`` must be one of the store's queues
(``0 .. store.queue_nums - 1`` of the settings, or a queue holding messages); anything else
is an error. A stream honours a named starting offset as given, also for a queue with no
messages yet: reading that queue starts there once it fills up. Queues not named start at
the earliest offset.

``consumerGroup`` progress is recorded when Spark asks for the next batch's end
(:meth:`RmqTxStreamReader.latestOffset`, whose start is the end of a batch Spark has
finished), and in :meth:`RmqTxStreamReader.commit`. An idle query asks at every trigger, and a
``Trigger.AvailableNow`` run once more after its last batch, so a caught-up group shows no lag;
only a query stopped between a batch and its next trigger leaves that batch unrecorded until
the query runs again. The progress is for lag only, never read back.

Options are checked at ``load()`` (:meth:`RmqTxDataSource.schema`; they are parsed in
:mod:`rmq_spark.spark.source_options`), with the store: it must exist, and a topic with no
messages is a warning (or an error). Spark does not tell a source at ``load()`` whether it is a
batch or a stream, so what only the kind decides is checked when the query runs:
``endingOffsets`` and ``endingTimestamp`` are batch-only (an error on a stream);
``maxMessagesPerTrigger``, ``maxBytesPerTrigger`` and ``consumerGroup`` on a batch read are
ignored with a warning. A schema given to the read (``.schema(...)``) is refused unless it is
the source's own, at the first action of a batch (the query start of a stream): Spark runs no
code of the source at ``load()`` then. Streaming offsets carry a format version and the
CommitLog's table id, so a checkpoint restarted against another store fails instead of
misreading. The source's ``latestOffset`` in ``StreamingQueryProgress`` holds the latest offsets
and ``messagesBehindLatest``, the backlog after the batch.

Only committed messages exist in the CommitLog, so nothing pending or rolled back can appear.
A store of several shards (``[store] shards``) has one CommitLog that every shard publishes
into, each queue under its store-wide id (shard ``k``'s from ``k * 1000``): a shard made while
a stream runs has its queues read from their first offset, as any queue that appears later.
Offsets are per (topic, queue) and dense. Tasks split the CommitLog by data file (each file is
read once; ``topic``, the offset range and the timestamps skip files by their statistics);
within a task every queue's rows come in offset order.

Filters are not pushed into the reader: Spark 4.2.0 keeps a Python data source's read plan,
pushed filters included, on the DataFrame and reuses it for later queries of that DataFrame
(``df.where(...).count()`` then ``df.count()`` would count the filtered rows). Select what to
read with the options (``topic``, ``tags``, offsets and timestamps), which prune files just
the same. Spark also plans a DataFrame's read once: call ``load()`` again to see messages
committed since.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from typing import Any, NoReturn, TypeVar

import pyarrow as pa
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.pandas.types import from_arrow_schema
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from rmq_spark.model.errors import InvalidOptionError, RmqSparkError
from rmq_spark.model.schema import COMMITLOG_SCHEMA, CONSUMER_OFFSETS_SCHEMA
from rmq_spark.spark import interrupt
from rmq_spark.spark.offsets import (
    Offsets,
    admit,
    check_queues,
    check_topics,
    earliest_offsets,
    latest_offsets,
    resolve,
    stored_offsets,
    to_json,
)
from rmq_spark.spark.reading import CommitLogSlice, plan_slices, read_slice, timestamp_offsets
from rmq_spark.spark.sink import RmqTxBatchWriter, RmqTxStreamWriter
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.spark.source_options import ENDING_OFFSETS, STARTING_OFFSETS, ReaderOptions
from rmq_spark.store.facade import Store

T = TypeVar("T")

#: The source's output schema: the CommitLog's, as the reader yields its rows.
SOURCE_SCHEMA: StructType = from_arrow_schema(COMMITLOG_SCHEMA)

#: Version of the offset format this source writes into checkpoints.
OFFSET_FORMAT_VERSION = 1


def check_at_load(options: ReaderOptions, store: Store | None = None) -> None:
    """What ``load()`` checks in the store: it exists, the offsets name its queues, and the
    topics have messages (see :func:`check_topics`).

    Raises
    ------
    NotAStoreError
        ``path`` holds no store.
    InvalidOptionError
        An offset names a queue the store does not have, or (``failOnMissingTopic``) a topic
        has no messages.
    """
    store = store or options.open_store()
    stored, _ = stored_offsets(store)
    latest = {t: {q: o for (topic, q), o in stored.items() if topic == t} for t in options.topics}
    shards = len(store.shards())
    for spec, option in ((options.starting, STARTING_OFFSETS), (options.ending, ENDING_OFFSETS)):
        check_queues(spec, option, options.settings.queue_nums, latest, shards)
    check_topics(
        options.topics, sorted({t for t, _ in stored}), store.root, options.fail_on_missing_topic
    )


def check_schema(schema: StructType) -> None:
    """Refuse a schema given to the read (``.schema(...)``) that is not the source's own."""
    if _columns(schema) != _columns(SOURCE_SCHEMA):
        raise InvalidOptionError(
            "format('rmqtx') has a fixed schema and cannot be set with a custom one; remove "
            f".schema(...) from the read (got {_ddl(schema)!r}). Its schema is: "
            f"{_ddl(SOURCE_SCHEMA)}. Select, rename or cast columns after load()."
        )


def _columns(schema: StructType) -> list[tuple[str, object, bool]]:
    return [(f.name, f.dataType, f.nullable) for f in schema.fields]


def _ddl(schema: StructType) -> str:
    """A schema as Spark DDL (``name type [not null], ...``)."""
    return ", ".join(
        f"{f.name} {f.dataType.simpleString()}{'' if f.nullable else ' not null'}"
        for f in schema.fields
    )


class RmqTxBatchReader(DataSourceReader):
    """Batch reader: resolves offsets once on the driver, then reads only the CommitLog files
    whose statistics overlap them (``topic``, offsets and timestamps prune files)."""

    def __init__(self, options: ReaderOptions, *, checked: bool = True) -> None:
        self.options = options
        store = options.open_store()
        if not checked:
            check_at_load(options, store)
        latest = latest_offsets(store, options.topics)
        self.end = resolve(options.ending, latest)
        if options.ending_timestamp is not None:
            self.end = timestamp_offsets(store, options.topics, options.ending_timestamp, self.end)
        if options.starting_timestamp is not None:
            self.start = timestamp_offsets(
                store, options.topics, options.starting_timestamp, self.end
            )
        else:
            earliest = earliest_offsets(store, options.topics)
            self.start = resolve(options.starting, self.end, earliest=earliest)

    def partitions(self) -> list[CommitLogSlice]:
        store = self.options.open_store()
        return plan_slices(
            store, self.start, self.end, self.options.tags, self.options.fail_on_data_loss
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition)


class RmqTxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Streaming reader: offsets are ``{"version", "store", "offsets": {topic: {queue: n}}}``.

    ``store`` is the Delta table id of the root's CommitLog (shard 0's), so a checkpoint
    restarted against another store fails instead of reading wrong offsets. Queues that appear
    later (a new shard's too) start at offset 0, unless ``startingOffsets`` names them: a named
    offset is honoured as given, also for a queue with no messages yet (or fewer than the
    offset yet).

    The store is opened at Spark's first call, not here: Spark also makes a reader to plan
    each micro-batch's tasks, which only needs :meth:`read`. ``checked=False``: the checks of
    ``load()`` (:func:`check_at_load`) have not run yet (the read was given a schema); they run
    with that first call.
    """

    def __init__(self, options: ReaderOptions, *, checked: bool = True) -> None:
        self.options = options
        self.max_per_trigger = options.max_messages_per_trigger
        self.max_bytes_per_trigger = options.max_bytes_per_trigger
        self._target: Offsets | None = None
        self._opened: Store | None = None
        self._store_id: str | None = None
        self._unchecked = not checked
        #: The consumer group's progress this reader recorded last (see _record_progress).
        self._recorded: Offsets | None = None
        #: What :meth:`reportLatestOffset` reports (set by :meth:`latestOffset`).
        self._reported: dict | None = None

    def __getstate__(self) -> dict:
        # Spark pickles the reader for its read tasks; they open the store themselves.
        return {**self.__dict__, "_opened": None}

    def _store(self) -> Store:
        """The store, opened once per reader: every trigger reads only what changed since."""
        if self._opened is None:
            store = self.options.open_store()
            if self._unchecked:
                check_at_load(self.options, store)
                self._unchecked = False
            self._store_id = store.table("commitlog").metadata().id
            self._opened = store
        return self._opened

    def _latest(self) -> Offsets:
        """The latest offsets of the subscribed topics."""
        return latest_offsets(self._store(), self.options.topics)

    def _encode(self, offsets: Offsets) -> dict:
        self._store()
        return {
            "version": OFFSET_FORMAT_VERSION,
            "store": self._store_id,
            "offsets": to_json(offsets),
        }

    def _decode(self, offset: dict) -> Offsets:
        self._store()
        if offset.get("version") != OFFSET_FORMAT_VERSION or offset.get("store") != self._store_id:
            raise InvalidOptionError(
                f"the checkpoint's offset {offset!r} was written for another store or offset "
                f"format (this store's CommitLog id is {self._store_id!r}, format "
                f"{OFFSET_FORMAT_VERSION}); use a new checkpoint location for this store."
            )
        return {t: {int(q): int(o) for q, o in qs.items()} for t, qs in offset["offsets"].items()}

    def initialOffset(self) -> dict:
        latest = self._latest()
        if self.options.starting_timestamp is not None:
            start = timestamp_offsets(
                self._store(), self.options.topics, self.options.starting_timestamp, latest
            )
        else:
            earliest = earliest_offsets(self._store(), self.options.topics)
            start = resolve(self.options.starting, latest, earliest=earliest, cap=False)
        return self._encode(start)

    def getDefaultReadLimit(self) -> ReadLimit:
        """``maxMessagesPerTrigger`` as ``ReadMaxRows``, else ``maxBytesPerTrigger`` as
        ``ReadMaxBytes``, else ``ReadAllAvailable``.

        PySpark 4.2 passes only one ReadLimit (it has no composite one, as Scala's
        ``ReadLimit.compositeLimit``), so with both options the byte cap is applied from the
        option next to the ``ReadMaxRows`` Spark hands back (:meth:`latestOffset`).
        """
        if self.max_per_trigger is not None:
            return ReadMaxRows(self.max_per_trigger)
        if self.max_bytes_per_trigger is not None:
            return ReadMaxBytes(self.max_bytes_per_trigger)
        return ReadAllAvailable()

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = self._decode(start)
        # Spark asks for the next batch's end only once the batch ending at ``start`` is
        # done: ``commit`` comes a batch later, and never for a run's last batch, which would
        # leave a caught-up group showing that batch as lag.
        self._record_progress(begin)
        latest = self._target if self._target is not None else self._latest()
        max_messages, max_bytes = self._caps(limit)
        end = admit(
            begin, latest, max_messages, max_bytes, lambda: self._store().data_files("commitlog")
        )
        behind = sum(
            max(0, o - end.get(t, {}).get(q, 0)) for t, qs in latest.items() for q, o in qs.items()
        )
        self._reported = {
            **self._encode(latest),
            "messagesBehindLatest": behind,
            "source": f"rmqtx[topic={','.join(self.options.topics)}]",
        }
        return self._encode(end)

    def _caps(self, limit: ReadLimit) -> tuple[int | None, int | None]:
        """(most messages, most bytes) of the next batch under Spark's ``limit``: the limit
        :meth:`getDefaultReadLimit` gave, with the other option's cap beside it; no cap at all
        for ``ReadAllAvailable``, which Spark passes for Trigger.Once (a source obeys it)."""
        if isinstance(limit, ReadAllAvailable):
            return None, None
        if isinstance(limit, ReadMaxRows):
            return limit.max_rows, self.max_bytes_per_trigger
        if isinstance(limit, ReadMaxBytes):
            return self.max_per_trigger, limit.max_bytes
        return self.max_per_trigger, self.max_bytes_per_trigger

    def reportLatestOffset(self) -> dict | None:
        """The latest offsets the last :meth:`latestOffset` saw (under Trigger.AvailableNow:
        its target), with ``messagesBehindLatest``: the messages after the end of the batch it
        planned (the backlog), and ``source``, what it reads (``rmqtx[topic=Orders]``: Spark
        names a Python source by its JVM class, ``PythonMicroBatchStream...@309fb014``, in the
        progress's ``description``). Spark shows them as the source's ``latestOffset`` in
        ``StreamingQueryProgress``; they are never read back."""
        return self._reported

    def partitions(self, start: dict, end: dict) -> list[CommitLogSlice]:
        return plan_slices(
            self._store(),
            self._decode(start),
            self._decode(end),
            self.options.tags,
            self.options.fail_on_data_loss,
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition)

    def commit(self, end: dict) -> None:
        """Record the consumer group's progress (``consumerGroup``) up to ``end``, the end of
        a batch Spark has finished; never used for reading: the checkpoint alone decides what
        a query reads."""
        self._record_progress(self._decode(end))

    def _record_progress(self, offsets: Offsets) -> None:
        """Record ``offsets`` as the consumer group's progress in ``consumer_offsets`` (one
        MERGE, skipped when this reader recorded the same offsets last)."""
        group = self.options.consumer_group
        if group is None or offsets == self._recorded:
            return
        now = datetime.now(UTC)
        rows = pa.Table.from_pylist(
            [
                {
                    "consumer_group": group,
                    "topic": t,
                    "queue_id": q,
                    "next_offset": o,
                    "updated_timestamp": now,
                }
                for t, queues in offsets.items()
                for q, o in queues.items()
            ],
            schema=CONSUMER_OFFSETS_SCHEMA,
        )
        if rows.num_rows:
            self._store().merge(
                "consumer_offsets",
                rows,
                ["consumer_group", "topic", "queue_id"],
                lambda m: m.when_matched_update_all().when_not_matched_insert_all(),
            )
        self._recorded = offsets


def _read(partition: InputPartition) -> Iterator[pa.RecordBatch]:
    # With nothing to read, partitions() is empty and Spark still runs one task with a
    # placeholder partition.
    return read_slice(partition) if isinstance(partition, CommitLogSlice) else iter(())


def _ours_first(method: Callable[..., T]) -> Callable[..., T]:
    """A data source hook whose rmq-spark error reaches the user without the traceback through
    rmq-spark's modules: Spark puts the hook's whole traceback before the error's own line
    (``[PYTHON_DATA_SOURCE_ERROR] Failed to create Python data source instance: Traceback
    ...``), and the line that says what to fix came about eight lines down."""

    @functools.wraps(method)
    def hook(*args: Any, **kwargs: Any) -> T:
        try:
            return method(*args, **kwargs)
        except RmqSparkError as exc:
            raise exc.with_traceback(None) from None

    return hook


class RmqTxDataSource(DataSource):
    """The ``rmqtx`` data source: reads committed messages (see the module docstring for
    schema and options) and writes transactionally (see :mod:`rmq_spark.spark.sink`)."""

    @classmethod
    def name(cls) -> str:
        return "rmqtx"

    @_ours_first
    def schema(self) -> StructType:
        """The fixed output schema (:data:`SOURCE_SCHEMA`); the read's options are checked here.

        Spark calls this at ``load()`` (``spark.read`` and ``spark.readStream`` alike), the one
        hook it runs then, so a bad option fails ``load()`` with its own message, before any
        query. Spark does not tell the data source yet whether it is read as a batch or a
        stream: options of either kind pass here
        (:data:`~rmq_spark.spark.source_options.READ_OPTIONS`), and :meth:`reader` /
        :meth:`streamReader` check what only the kind decides (``endingOffsets`` on a stream is
        an error; ``maxMessagesPerTrigger`` on a batch, a warning). The store is checked too
        (:func:`check_at_load`): it exists, named queues exist, topics have messages.

        Spark skips this when the read was given a schema (``.schema(...)``): then nothing of
        the source runs at ``load()``, and the factories check the schema and all the above.
        """
        check_at_load(ReaderOptions.parse(self.options, streaming=None))
        self._checked_at_load = True
        return SOURCE_SCHEMA

    @_ours_first
    def reader(self, schema: StructType) -> RmqTxBatchReader:
        check_schema(schema)
        return RmqTxBatchReader(ReaderOptions.parse(self.options), checked=self._checked())

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        try:
            check_schema(schema)
            options = ReaderOptions.parse(self.options, streaming=True)
        except RmqSparkError as exc:
            return _RefusedStreamReader(exc)
        return RmqTxStreamReader(options, checked=self._checked())

    def _checked(self) -> bool:
        """Whether :meth:`schema` checked this read at ``load()`` (Spark pickles this object
        with what :meth:`schema` set, and calls the factories on that copy)."""
        return getattr(self, "_checked_at_load", False)

    @_ours_first
    def writer(self, schema: StructType, overwrite: bool) -> RmqTxBatchWriter:
        return RmqTxBatchWriter(_writer_options(self.options, schema, overwrite))

    @_ours_first
    def streamWriter(self, schema: StructType, overwrite: bool) -> RmqTxStreamWriter:
        return RmqTxStreamWriter(_writer_options(self.options, schema, overwrite))


class _RefusedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream reader that raises ``error`` (a bad option of the stream) at Spark's first call.

    PySpark 4.2's streaming runner calls ``stop()`` on the reader even when the factory that
    makes it raised, and reports that ``UnboundLocalError`` in place of the factory's error;
    raised from a reader's method, the error reaches the user as it is.
    """

    def __init__(self, error: RmqSparkError) -> None:
        self.error = error

    def _refuse(self) -> NoReturn:
        raise self.error

    def initialOffset(self) -> dict:
        self._refuse()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        self._refuse()

    def getDefaultReadLimit(self) -> ReadLimit:
        self._refuse()

    def prepareForTriggerAvailableNow(self) -> None:
        self._refuse()

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        self._refuse()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        self._refuse()


def _writer_options(
    options: Mapping[str, str], schema: StructType, overwrite: bool
) -> WriterOptions:
    if overwrite:
        raise InvalidOptionError(
            "format('rmqtx') only appends: a topic's messages are never overwritten. Use "
            "mode('append') (or outputMode('append') on a stream)."
        )
    return WriterOptions.parse(options, schema)


def register(spark: SparkSession) -> None:
    """Register ``format("rmqtx")`` with a SparkSession (``get_spark`` does it for you).

    Also makes Ctrl-C stop the session's streaming queries with one line each instead of
    tracebacks (:mod:`rmq_spark.spark.interrupt`)."""
    spark.dataSource.register(RmqTxDataSource)
    interrupt.install(spark)
