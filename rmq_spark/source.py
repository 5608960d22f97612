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
``tags``               no          ``*``      RocketMQ subscription: ``*`` or ``TagA || TagB``
``maxMessagesPerTrigger`` no       none       streaming only: most messages per micro-batch,
                                              shared fairly over queues (AvailableNow honours it)
``consumerGroup``      no                     streaming only: record the group's progress in
                                              the ``consumer_offsets`` table (for lag)
=====================  ==========  =========  ==================================================

``endingOffsets`` is batch-only (an error on a stream); ``maxMessagesPerTrigger`` on a batch
read is ignored with a warning. Streaming offsets carry a format version and the CommitLog's
table id, so a checkpoint restarted against another store fails instead of misreading.

Only committed messages exist in the CommitLog, so nothing pending or rolled back can appear.
Offsets are per (topic, queue) and dense; each queue is read by its own task, in offset order.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
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

from rmq_spark.config import load_settings, parse_int
from rmq_spark.errors import InvalidMessageError, InvalidOptionError
from rmq_spark.model import check_group, check_topic
from rmq_spark.offsets import Offsets, latest_offsets, parse_offsets, resolve, to_json
from rmq_spark.schema import COMMITLOG_SCHEMA, CONSUMER_OFFSETS_SCHEMA
from rmq_spark.store import Store, sql_list

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
MAX_MESSAGES_PER_TRIGGER, CONSUMER_GROUP = "maxMessagesPerTrigger", "consumerGroup"
BATCH_OPTIONS = (PATH, TOPIC, STARTING_OFFSETS, ENDING_OFFSETS, STARTING_TIMESTAMP, TAGS)
STREAM_OPTIONS = (
    PATH,
    TOPIC,
    STARTING_OFFSETS,
    STARTING_TIMESTAMP,
    TAGS,
    MAX_MESSAGES_PER_TRIGGER,
    CONSUMER_GROUP,
)
#: Version of the offset format this source writes into checkpoints.
OFFSET_FORMAT_VERSION = 1
_TAG = re.compile(r"^[^|\s][^|]*$")


@dataclass(frozen=True)
class ReaderOptions:
    """Validated options of an ``rmqtx`` read."""

    path: str
    topics: tuple[str, ...]
    starting: str | Offsets
    ending: str | Offsets
    starting_timestamp: int | None
    #: None means every tag (``*``).
    tags: frozenset[str] | None
    #: Streaming admission control; None means no limit.
    max_messages_per_trigger: int | None = None
    #: Streaming only: record this group's progress for lag reporting.
    consumer_group: str | None = None

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool = False) -> ReaderOptions:
        """Validate the options of a batch or streaming read (keys are case-insensitive)."""
        given = {k.lower(): v for k, v in options.items()}
        allowed = STREAM_OPTIONS if streaming else BATCH_OPTIONS
        if streaming and ENDING_OFFSETS.lower() in given:
            raise InvalidOptionError(
                "option 'endingOffsets' is for batch reads only; a stream reads on as messages "
                "are committed (use Trigger.AvailableNow to stop at the latest offsets)."
            )
        for stream_only in (MAX_MESSAGES_PER_TRIGGER, CONSUMER_GROUP):
            if not streaming and stream_only.lower() in given:
                log.warning("option %r only applies to streaming reads; ignored", stream_only)
                given.pop(stream_only.lower())
        unknown = sorted(set(given) - {o.lower() for o in allowed})
        if unknown:
            raise InvalidOptionError(
                f"unknown option(s) {', '.join(repr(u) for u in unknown)} for format('rmqtx'); "
                f"valid options: {', '.join(allowed)}."
            )
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
        timestamp = given.get(STARTING_TIMESTAMP.lower())
        return cls(
            path=given.get(PATH.lower()) or load_settings().store.path,
            topics=topics,
            starting=starting,
            ending=ending,
            starting_timestamp=None
            if timestamp is None
            else parse_int(timestamp, STARTING_TIMESTAMP, 0),
            tags=parse_tags(given.get(TAGS.lower(), "*")),
            max_messages_per_trigger=None
            if MAX_MESSAGES_PER_TRIGGER.lower() not in given
            else parse_int(given[MAX_MESSAGES_PER_TRIGGER.lower()], MAX_MESSAGES_PER_TRIGGER, 1),
            consumer_group=None
            if CONSUMER_GROUP.lower() not in given
            else _option_value(
                check_group, given[CONSUMER_GROUP.lower()], CONSUMER_GROUP, prefix="option "
            ),
        )


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
    if not all(tags) or not all(_TAG.match(t) for t in tags):
        raise InvalidOptionError(
            f"option 'tags' {expression!r} is not a subscription expression; use '*' or "
            "'TagA || TagB'."
        )
    return frozenset(tags)


@dataclass(frozen=True)
class QueueRange(InputPartition):
    """One task: offsets [start, end) of one queue."""

    path: str
    topic: str
    queue_id: int
    start: int
    end: int
    tags: frozenset[str] | None


def queue_ranges(options: ReaderOptions, start: Offsets, end: Offsets) -> list[QueueRange]:
    """One partition per queue with something to read between ``start`` and ``end``."""
    return [
        QueueRange(options.path, topic, queue_id, start[topic][queue_id], stop, options.tags)
        for topic in sorted(end)
        for queue_id, stop in sorted(end[topic].items())
        if stop > start[topic].get(queue_id, 0)
    ]


def read_range(partition: QueueRange) -> Iterator[pa.RecordBatch]:
    """The committed messages of one queue range, in offset order, as Arrow batches."""
    store = Store.open(partition.path, create=False)
    where = (
        f"topic = {sql_list([partition.topic])} AND queue_id = {partition.queue_id} "
        f"AND queue_offset >= {partition.start} AND queue_offset < {partition.end}"
    )
    rows = store.query("commitlog", where).sort_by("queue_offset")
    if partition.tags is not None:
        rows = rows.filter(pc.is_in(rows.column("tags"), pa.array(sorted(partition.tags))))
    columns = [rows.column(f.name).cast(f.type) for f in COMMITLOG_SCHEMA]
    yield from pa.Table.from_arrays(columns, schema=COMMITLOG_SCHEMA).to_batches()


def timestamp_offsets(store: Store, topics: tuple[str, ...], millis: int, end: Offsets) -> Offsets:
    """Per queue, the first offset stored at or after ``millis`` (the end when none is)."""
    rows = store.table("commitlog").to_pyarrow_table(
        columns=["topic", "queue_id", "queue_offset", "store_timestamp"]
    )
    since = pa.scalar(millis * 1000, COMMITLOG_SCHEMA.field("store_timestamp").type)
    rows = rows.filter(
        pc.and_(
            pc.is_in(rows.column("topic"), pa.array(list(topics))),
            pc.greater_equal(rows.column("store_timestamp"), since),
        )
    )
    first: dict[tuple[str, int], int] = {}
    for topic, queue_id, offset in zip(
        rows.column("topic").to_pylist(),
        rows.column("queue_id").to_pylist(),
        rows.column("queue_offset").to_pylist(),
        strict=True,
    ):
        key = (topic, queue_id)
        first[key] = min(offset, first.get(key, offset))
    return {t: {q: first.get((t, q), stop) for q, stop in end[t].items()} for t in end}


class RmqTxBatchReader(DataSourceReader):
    """Batch reader: resolves offsets once on the driver, one task per queue range."""

    def __init__(self, options: ReaderOptions) -> None:
        self.options = options
        store = Store.open(options.path, create=False)
        latest = latest_offsets(store, options.topics)
        self.end = resolve(options.ending, latest)
        if options.starting_timestamp is not None:
            self.start = timestamp_offsets(
                store, options.topics, options.starting_timestamp, self.end
            )
        else:
            self.start = resolve(options.starting, self.end)

    def partitions(self) -> list[QueueRange]:
        return queue_ranges(self.options, self.start, self.end)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # With nothing to read, partitions() is empty and Spark still runs one task with a
        # placeholder partition.
        return read_range(partition) if isinstance(partition, QueueRange) else iter(())


class RmqTxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Streaming reader: offsets are ``{"version", "store", "offsets": {topic: {queue: n}}}``.

    ``store`` is the CommitLog's Delta table id, so a checkpoint restarted against another
    store fails instead of reading wrong offsets. Queues that appear later start at offset 0.
    """

    def __init__(self, options: ReaderOptions) -> None:
        self.options = options
        self.max_per_trigger = options.max_messages_per_trigger
        self._target: Offsets | None = None
        store = Store.open(options.path, create=False)
        self._store_id = store.table("commitlog").metadata().id

    def _latest(self) -> Offsets:
        return latest_offsets(Store.open(self.options.path, create=False), self.options.topics)

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
            store = Store.open(self.options.path, create=False)
            start = timestamp_offsets(
                store, self.options.topics, self.options.starting_timestamp, latest
            )
        else:
            start = resolve(self.options.starting, latest)
        return self._encode(start)

    def getDefaultReadLimit(self) -> ReadLimit:
        if self.max_per_trigger is None:
            return ReadAllAvailable()
        return ReadMaxRows(self.max_per_trigger)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = self._latest()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        begin = self._decode(start)
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

    def partitions(self, start: dict, end: dict) -> list[QueueRange]:
        return queue_ranges(self.options, self._decode(start), self._decode(end))

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return read_range(partition) if isinstance(partition, QueueRange) else iter(())

    def commit(self, end: dict) -> None:
        """Record the consumer group's progress (``consumerGroup``); never used for reading:
        the checkpoint alone decides what a query reads. Spark commits a batch's offsets when
        the next batch starts, so the recorded progress trails the query by one batch."""
        group = self.options.consumer_group
        if group is None:
            return
        offsets = self._decode(end)
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
            Store.open(self.options.path, create=False).merge(
                "consumer_offsets",
                rows,
                ["consumer_group", "topic", "queue_id"],
                lambda m: m.when_matched_update_all().when_not_matched_insert_all(),
            )


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
    """The ``rmqtx`` data source (see the module docstring for schema and options)."""

    @classmethod
    def name(cls) -> str:
        return "rmqtx"

    def schema(self) -> str:
        return SOURCE_SCHEMA

    def reader(self, schema: object) -> RmqTxBatchReader:
        return RmqTxBatchReader(ReaderOptions.parse(self.options))

    def streamReader(self, schema: object) -> RmqTxStreamReader:
        return RmqTxStreamReader(ReaderOptions.parse(self.options, streaming=True))


def register(spark: SparkSession) -> None:
    """Register ``format("rmqtx")`` with a SparkSession (``get_spark`` does it for you)."""
    spark.dataSource.register(RmqTxDataSource)
