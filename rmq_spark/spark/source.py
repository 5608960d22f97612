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

Options (case-insensitive; an unknown option is an error listing the valid ones):

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
``consumerGroup``      no                     streaming only: record the group's progress in
                                              the ``consumer_offsets`` table (for lag) after
                                              each micro-batch, the last of a run included
``failOnDataLoss``     no          true       a read starting below a queue's earliest offset
                                              (retention removed messages it had not read)
                                              fails naming the lost ranges; ``false``: warn
                                              and read on from the earliest offset
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

``endingOffsets`` and ``endingTimestamp`` are batch-only (an error on a stream);
``maxMessagesPerTrigger`` on a batch read is ignored with a warning. Streaming offsets carry a
format version and the CommitLog's table id, so a checkpoint restarted against another store
fails instead of misreading.

Only committed messages exist in the CommitLog, so nothing pending or rolled back can appear.
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

import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession
from pyspark.sql.datasource import (
    DataSource,
    DataSourceReader,
    DataSourceStreamReader,
    InputPartition,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from rmq_spark.delta.reads import read_files
from rmq_spark.model.config import (
    StoreSettings,
    load_settings,
    parse_int,
    reject_unknown,
    split_storage_options,
)
from rmq_spark.model.errors import InvalidMessageError, InvalidOptionError
from rmq_spark.model.messages import check_group, check_topic, is_tag
from rmq_spark.model.schema import CONSUMER_OFFSETS_SCHEMA
from rmq_spark.spark.offsets import (
    Offsets,
    check_queues,
    earliest_offsets,
    latest_offsets,
    parse_offsets,
    resolve,
    to_json,
)
from rmq_spark.spark.reading import FILE_SCHEMA, CommitLogSlice, plan_slices, read_slice
from rmq_spark.spark.sink import RmqTxBatchWriter, RmqTxStreamWriter
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.store.facade import Store

#: The source's output schema, as Spark DDL (nullability as in the CommitLog).
SOURCE_SCHEMA = (
    "topic string not null, queue_id int not null, queue_offset bigint not null, "
    "msg_id string not null, transaction_id string, producer_group string, keys string, "
    "tags string, body binary not null, properties map<string,string>, "
    "born_timestamp timestamp not null, store_timestamp timestamp not null"
)

log = logging.getLogger(__name__)

PATH, TOPIC, STARTING_OFFSETS, ENDING_OFFSETS, STARTING_TIMESTAMP, TAGS = (
    "path",
    "topic",
    "startingOffsets",
    "endingOffsets",
    "startingTimestamp",
    "tags",
)
ENDING_TIMESTAMP = "endingTimestamp"
MAX_MESSAGES_PER_TRIGGER, CONSUMER_GROUP = "maxMessagesPerTrigger", "consumerGroup"
FAIL_ON_DATA_LOSS = "failOnDataLoss"
BATCH_OPTIONS = (
    PATH,
    TOPIC,
    STARTING_OFFSETS,
    ENDING_OFFSETS,
    STARTING_TIMESTAMP,
    ENDING_TIMESTAMP,
    TAGS,
    FAIL_ON_DATA_LOSS,
)
STREAM_OPTIONS = (
    PATH,
    TOPIC,
    STARTING_OFFSETS,
    STARTING_TIMESTAMP,
    TAGS,
    MAX_MESSAGES_PER_TRIGGER,
    CONSUMER_GROUP,
    FAIL_ON_DATA_LOSS,
)
#: Version of the offset format this source writes into checkpoints.
OFFSET_FORMAT_VERSION = 1
TIMESTAMP_COLUMNS = ("queue_id", "queue_offset", "store_timestamp")


@dataclass(frozen=True)
class ReaderOptions:
    """Validated options of an ``rmqtx`` read."""

    path: str
    topics: tuple[str, ...]
    starting: str | Offsets
    ending: str | Offsets
    starting_timestamp: int | None
    #: Batch only: stop before the first message stored at or after it (ms since epoch).
    ending_timestamp: int | None
    #: None means every tag (``*``).
    tags: frozenset[str] | None
    #: Streaming admission control; None means no limit.
    max_messages_per_trigger: int | None = None
    #: Streaming only: record this group's progress for lag reporting.
    consumer_group: str | None = None
    #: The store settings (queues per topic, storage options) of the settings file.
    settings: StoreSettings = field(default_factory=StoreSettings)
    #: Fail a read that starts below a queue's earliest offset (retention removed messages it
    #: has not read); when false, warn and read on from the earliest offset.
    fail_on_data_loss: bool = True

    def open_store(self) -> Store:
        """The store read, opened with the configured settings (its storage options too)."""
        return Store.open(self.path, settings=self.settings, create=False)

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool = False) -> ReaderOptions:
        """Validate the options of a batch or streaming read (keys are case-insensitive)."""
        given, storage = split_storage_options({k.lower(): v for k, v in options.items()})
        allowed = STREAM_OPTIONS if streaming else BATCH_OPTIONS
        for batch_only in (ENDING_OFFSETS, ENDING_TIMESTAMP):
            if streaming and batch_only.lower() in given:
                raise InvalidOptionError(
                    f"option {batch_only!r} is for batch reads only; a stream reads on as "
                    "messages are committed (use Trigger.AvailableNow to stop at the latest "
                    "offsets)."
                )
        for stream_only in (MAX_MESSAGES_PER_TRIGGER, CONSUMER_GROUP):
            if not streaming and stream_only.lower() in given:
                log.warning("option %r only applies to streaming reads; ignored", stream_only)
                given.pop(stream_only.lower())
        reject_unknown(given, allowed, "format('rmqtx')")
        topic_text = given.get(TOPIC.lower())
        if not topic_text or not topic_text.strip():
            raise InvalidOptionError(
                "option 'topic' is required: one topic, or several separated by commas "
                "(e.g. .option('topic', 'OrderEvents'))."
            )
        topics = tuple(
            _option_value(check_topic, t.strip(), prefix="option 'topic': ")
            for t in topic_text.split(",")
        )
        starting = parse_offsets(
            given.get(STARTING_OFFSETS.lower(), "earliest"), STARTING_OFFSETS, topics
        )
        ending = parse_offsets(given.get(ENDING_OFFSETS.lower(), "latest"), ENDING_OFFSETS, topics)
        if ending == "earliest":
            raise InvalidOptionError(
                "option 'endingOffsets' cannot be 'earliest'; use 'latest' or per-queue offsets."
            )
        store_settings = load_settings().store.with_storage_options(storage)
        return cls(
            path=given.get(PATH.lower()) or store_settings.path,
            settings=store_settings,
            topics=topics,
            starting=starting,
            ending=ending,
            starting_timestamp=_timestamp(given, STARTING_TIMESTAMP),
            ending_timestamp=_timestamp(given, ENDING_TIMESTAMP),
            tags=parse_tags(given.get(TAGS.lower(), "*")),
            max_messages_per_trigger=None
            if MAX_MESSAGES_PER_TRIGGER.lower() not in given
            else parse_int(given[MAX_MESSAGES_PER_TRIGGER.lower()], MAX_MESSAGES_PER_TRIGGER, 1),
            consumer_group=None
            if CONSUMER_GROUP.lower() not in given
            else _option_value(
                check_group, given[CONSUMER_GROUP.lower()], CONSUMER_GROUP, prefix="option "
            ),
            fail_on_data_loss=_boolean(given, FAIL_ON_DATA_LOSS, default=True),
        )


def _boolean(given: Mapping[str, str], option: str, *, default: bool) -> bool:
    value = str(given.get(option.lower(), default)).strip().lower()
    if value not in ("true", "false"):
        raise InvalidOptionError(f"option {option!r} needs 'true' or 'false' but got {value!r}.")
    return value == "true"


def _timestamp(given: Mapping[str, str], option: str) -> int | None:
    value = given.get(option.lower())
    if value is None:
        return None
    millis = parse_int(value, option, 0)
    if millis > _MAX_MILLIS:
        raise InvalidOptionError(
            f"option {option!r} is {millis} ms since the epoch, after the year 9999; give "
            "milliseconds since 1970-01-01 UTC, e.g. 1767225600000 for 2026-01-01."
        )
    return millis


#: The last millisecond a timestamp can name (9999-12-31T23:59:59.999 UTC).
_MAX_MILLIS = 253_402_300_799_999


def _option_value(check: Callable[..., str], value: str, *args: str, prefix: str) -> str:
    """Run a message-model check on an option's value; its error becomes an option error."""
    try:
        return check(value, *args)
    except InvalidMessageError as exc:
        raise InvalidOptionError(f"{prefix}{exc.message}") from exc


def parse_tags(expression: str) -> frozenset[str] | None:
    """A RocketMQ subscription expression: ``*`` (all) or ``TagA || TagB``."""
    text = expression.strip()
    if text in ("", "*"):
        return None
    tags = [t.strip() for t in text.split("||")]
    if not all(is_tag(t) for t in tags):
        raise InvalidOptionError(
            f"option 'tags' {expression!r} is not a subscription expression; use '*' or "
            "'TagA || TagB'."
        )
    return frozenset(tags)


def timestamp_offsets(store: Store, topics: tuple[str, ...], millis: int, end: Offsets) -> Offsets:
    """Per queue, the first offset stored at or after ``millis`` (capped at ``end``).

    Only files whose newest ``store_timestamp`` reaches ``millis`` are read, two columns each.
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


class RmqTxBatchReader(DataSourceReader):
    """Batch reader: resolves offsets once on the driver, then reads only the CommitLog files
    whose statistics overlap them (``topic``, offsets and timestamps prune files)."""

    def __init__(self, options: ReaderOptions) -> None:
        self.options = options
        store = options.open_store()
        latest = latest_offsets(store, options.topics)
        check_queues(options.starting, STARTING_OFFSETS, options.settings.queue_nums, latest)
        check_queues(options.ending, ENDING_OFFSETS, options.settings.queue_nums, latest)
        self.end = resolve(options.ending, latest)
        if options.ending_timestamp is not None:
            self.end = timestamp_offsets(store, options.topics, options.ending_timestamp, self.end)
        if options.starting_timestamp is not None:
            self.start = timestamp_offsets(
                store, options.topics, options.starting_timestamp, self.end
            )
        else:
            self.start = resolve(
                options.starting, self.end, earliest=earliest_offsets(store, options.topics)
            )

    def partitions(self) -> list[CommitLogSlice]:
        store = self.options.open_store()
        return plan_slices(
            store, self.start, self.end, self.options.tags, self.options.fail_on_data_loss
        )

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return _read(partition)


class RmqTxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Streaming reader: offsets are ``{"version", "store", "offsets": {topic: {queue: n}}}``.

    ``store`` is the CommitLog's Delta table id, so a checkpoint restarted against another
    store fails instead of reading wrong offsets. Queues that appear later start at offset 0,
    unless ``startingOffsets`` names them: a named offset is honoured as given, also for a
    queue with no messages yet (or fewer than the offset yet).
    """

    def __init__(self, options: ReaderOptions) -> None:
        self.options = options
        self.max_per_trigger = options.max_messages_per_trigger
        self._target: Offsets | None = None
        self._opened: Store | None = None
        #: The consumer group's progress this reader recorded last (see _record_progress).
        self._recorded: Offsets | None = None
        self._store_id = self._store().table("commitlog").metadata().id
        check_queues(
            options.starting, STARTING_OFFSETS, options.settings.queue_nums, self._latest()
        )

    def __getstate__(self) -> dict:
        # Spark pickles the reader for its read tasks; they open the store themselves.
        return {**self.__dict__, "_opened": None}

    def _store(self) -> Store:
        """The store, opened once per reader: every trigger reads only what changed since."""
        if self._opened is None:
            self._opened = self.options.open_store()
        return self._opened

    def _latest(self) -> Offsets:
        return latest_offsets(self._store(), self.options.topics)

    def _encode(self, offsets: Offsets) -> dict:
        return {
            "version": OFFSET_FORMAT_VERSION,
            "store": self._store_id,
            "offsets": to_json(offsets),
        }

    def _decode(self, offset: dict) -> Offsets:
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
        if self.max_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = self._decode(start)
        # Spark asks for the next batch's end only once the batch ending at ``start`` is
        # done: ``commit`` comes a batch later, and never for a run's last batch, which would
        # leave a caught-up group showing that batch as lag.
        self._record_progress(begin)
        latest = self._target if self._target is not None else self._latest()
        available = {
            (t, q): max(0, end - begin.get(t, {}).get(q, 0))
            for t, queues in latest.items()
            for q, end in queues.items()
        }
        budget = limit.max_rows if isinstance(limit, ReadMaxRows) else None
        grant = _share(available, budget)
        end: Offsets = {t: dict(qs) for t, qs in begin.items()}
        for (t, q), n in grant.items():
            end.setdefault(t, {})[q] = begin.get(t, {}).get(q, 0) + n
        return self._encode(end)

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


def _share(available: Mapping[tuple[str, int], int], budget: int | None) -> dict:
    """Split a row budget fairly over queues (water-filling); None means everything."""
    if budget is None:
        return dict(available)
    grant = dict.fromkeys(available, 0)
    left = budget
    open_queues = sorted(k for k, n in available.items() if n > 0)
    while left > 0 and open_queues:
        share = max(1, left // len(open_queues))
        still_open = []
        for key in open_queues:
            take = min(share, available[key] - grant[key], left)
            grant[key] += take
            left -= take
            if grant[key] < available[key]:
                still_open.append(key)
            if left == 0:
                break
        open_queues = still_open
    return grant


class RmqTxDataSource(DataSource):
    """The ``rmqtx`` data source: reads committed messages (see the module docstring for
    schema and options) and writes transactionally (see :mod:`rmq_spark.spark.sink`)."""

    @classmethod
    def name(cls) -> str:
        return "rmqtx"

    def schema(self) -> str:
        return SOURCE_SCHEMA

    def reader(self, schema: object) -> RmqTxBatchReader:
        return RmqTxBatchReader(ReaderOptions.parse(self.options))

    def streamReader(self, schema: object) -> RmqTxStreamReader:
        return RmqTxStreamReader(ReaderOptions.parse(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> RmqTxBatchWriter:
        return RmqTxBatchWriter(_writer_options(self.options, schema, overwrite))

    def streamWriter(self, schema: StructType, overwrite: bool) -> RmqTxStreamWriter:
        return RmqTxStreamWriter(_writer_options(self.options, schema, overwrite))


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
    """Register ``format("rmqtx")`` with a SparkSession (``get_spark`` does it for you)."""
    spark.dataSource.register(RmqTxDataSource)
