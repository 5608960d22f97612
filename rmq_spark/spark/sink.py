"""Transactional writes: ``df.write.format("rmqtx")``, ``df.writeStream.format("rmqtx")`` and
:func:`publish_with_delta_write`.

>>> (df.select("body", "keys", "tags")
...    .write.format("rmqtx").mode("append")
...    .option("path", "storage").option("topic", "OrderEvents")
...    .option("producerGroup", "order-pipeline")
...    .save())

Input columns: ``body`` (binary or string, required), and optionally ``topic`` (per row; else
the ``topic`` option), ``keys``, ``tags`` (strings) and ``properties`` (map<string,string>).
Any other column is an error unless ``extraColumnsAsProperties`` is true, which carries them
as string properties.

=============================  ========  =========  =============================================
option                         required  default    meaning
=============================  ========  =========  =============================================
``path``                       no        conf       store root
``producerGroup``              yes                  producer group of the staged transactions
``topic``                      no                   topic of rows without a ``topic`` column
``sinkId``                     no        see below  names the writer in ``epochs``; a stream
                                                    defaults to its query id (kept by the
                                                    checkpoint), a batch write to a new id
``extraColumnsAsProperties``   no        false      carry unknown columns as properties
``leaseTimeout``               no        10m        how long an epoch stays held for a writer
                                                    that sends no heartbeat (running tasks
                                                    renew it every fifth of it)
``storage.<KEY>``              no        conf       a storage option over ``[store]
                                                    storage_options`` (``storage.AWS_REGION``)
=============================  ========  =========  =============================================

Protocol: every task holds the epoch (see :mod:`rmq_spark.spark.epochs`) and renews its lease while
it runs, writes its rows as half messages (durable, invisible) in one transaction and reports
it; Spark's commit of the job or micro-batch closes the epoch with the reported transactions,
COMMITs them and publishes; abort rolls them back. Halves of failed task attempts, of a
replayed micro-batch, or of a driver that died before committing are resolved by the
check-back job's built-in epoch checker: committed only if they are on the epoch's list,
rolled back otherwise; never twice. An epoch whose lease ran out is abandoned by the check-back
job, and its writer's commit then fails (the job is retried) instead of publishing part of it.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql import DataFrame
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import BinaryType, MapType, StringType, StructField, StructType

from rmq_spark.model.config import (
    StoreSettings,
    configure_logging,
    load_settings,
    parse_duration,
    reject_unknown,
    split_storage_options,
)
from rmq_spark.model.errors import InvalidMessageError, InvalidOptionError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import (
    MAX_PROPERTY_BYTES,
    PROPERTY_CHECK_IMMUNITY,
    SECONDS,
    check_group,
    check_topic,
    new_id,
    new_ids,
    queues_for,
)
from rmq_spark.model.schema import HALF_SCHEMA, TIMESTAMP
from rmq_spark.spark.epochs import (
    EpochOutcome,
    Lease,
    abandon_attempt,
    close,
    delta_commit_marker,
    finish_epoch,
    landed_delta_write,
)
from rmq_spark.store.facade import Store, normalise_root

log = logging.getLogger(__name__)

PATH, TOPIC, PRODUCER_GROUP, SINK_ID, EXTRA_COLUMNS, LEASE_TIMEOUT = (
    "path",
    "topic",
    "producerGroup",
    "sinkId",
    "extraColumnsAsProperties",
    "leaseTimeout",
)
WRITE_OPTIONS = (PATH, TOPIC, PRODUCER_GROUP, SINK_ID, EXTRA_COLUMNS, LEASE_TIMEOUT)
#: Default of ``leaseTimeout``: an epoch is presumed abandoned after this long without a
#: heartbeat from any of its running tasks.
DEFAULT_LEASE_TIMEOUT = "10m"
#: The shortest ``leaseTimeout``: heartbeats come every fifth of it.
_MIN_LEASE_SECONDS = 1.0
#: Spark passes these to every stream writer; they are Spark's, not ours.
_SPARK_OPTIONS = frozenset({"checkpointlocation", "queryname"})
#: Input columns and the Spark types they may have.
INPUT_COLUMNS: dict[str, tuple[type, ...]] = {
    "body": (BinaryType, StringType),
    "topic": (StringType,),
    "keys": (StringType,),
    "tags": (StringType,),
    "properties": (MapType,),
}


@dataclass(frozen=True)
class WriterOptions:
    """Validated options and input layout of an ``rmqtx`` write."""

    path: str
    producer_group: str
    topic: str | None
    sink_id: str | None
    #: Input columns carried as properties (``extraColumnsAsProperties``).
    extra_columns: tuple[str, ...]
    settings: StoreSettings
    #: Seconds an epoch stays held without a heartbeat (``leaseTimeout``).
    lease_seconds: float = 600.0

    @classmethod
    def parse(cls, options: Mapping[str, str], schema: StructType) -> WriterOptions:
        """Validate the options and the input columns (keys are case-insensitive)."""
        given, storage = split_storage_options(
            {k.lower(): v for k, v in options.items() if k.lower() not in _SPARK_OPTIONS}
        )
        reject_unknown(given, WRITE_OPTIONS, "writing format('rmqtx')")
        group = given.get(PRODUCER_GROUP.lower())
        if not group:
            raise InvalidOptionError(
                "option 'producerGroup' is required: the producer group the staged "
                "transactions belong to (e.g. .option('producerGroup', 'order-pipeline'))."
            )
        topic = given.get(TOPIC.lower())
        extra_flag = given.get(EXTRA_COLUMNS.lower(), "false").strip().lower()
        if extra_flag not in ("true", "false"):
            raise InvalidOptionError(
                f"option 'extraColumnsAsProperties' is 'true' or 'false', not {extra_flag!r}."
            )
        extra = _check_columns(schema, carry_extra=extra_flag == "true")
        if topic is None and "topic" not in schema.names:
            raise InvalidOptionError(
                "no topic: give option 'topic', or a 'topic' column for per-row topics."
            )
        lease = parse_duration(
            given.get(LEASE_TIMEOUT.lower(), DEFAULT_LEASE_TIMEOUT), LEASE_TIMEOUT
        )
        if lease < _MIN_LEASE_SECONDS:
            raise InvalidOptionError(
                f"option 'leaseTimeout' is {lease:g} s; it needs at least {_MIN_LEASE_SECONDS:g} "
                "s (e.g. '10m'): the check-back job abandons an epoch whose lease ran out."
            )
        settings = load_settings()
        try:
            return cls(
                path=given.get(PATH.lower()) or settings.store.path,
                producer_group=check_group(group),
                topic=None if topic is None else check_topic(topic),
                sink_id=_check_sink_id(given.get(SINK_ID.lower())),
                extra_columns=extra,
                settings=settings.store.with_storage_options(storage),
                lease_seconds=lease,
            )
        except InvalidMessageError as exc:
            raise InvalidOptionError(f"write option: {exc.message}") from exc


#: What a ``sinkId`` may hold: it names epochs in tables, logs and ``rmqtx status``.
_SINK_ID = re.compile(r"[A-Za-z0-9._:%|-]{1,255}", re.ASCII)


def _check_sink_id(sink_id: str | None) -> str | None:
    if sink_id is not None and not _SINK_ID.fullmatch(sink_id):
        raise InvalidOptionError(
            f"option 'sinkId' {sink_id[:80]!r} is not valid; use 1 to 255 characters of "
            "letters, digits and . _ : % | - (e.g. 'orders-sink')."
        )
    return sink_id


def _check_columns(schema: StructType, *, carry_extra: bool) -> tuple[str, ...]:
    if "body" not in schema.names:
        raise InvalidOptionError(
            f"the input has no 'body' column (columns: {', '.join(schema.names)}); select or "
            "alias the message payload as 'body' (binary or string)."
        )
    extra = []
    for field in schema.fields:
        allowed = INPUT_COLUMNS.get(field.name)
        if allowed is None:
            extra.append(field.name)
        elif not isinstance(field.dataType, allowed) or not _string_map(field):
            raise InvalidOptionError(
                f"column {field.name!r} has type {field.dataType.simpleString()}; it needs "
                f"{' or '.join(t.typeName() for t in allowed)}"
                + (" of string to string." if field.name == "properties" else ".")
            )
    if extra and not carry_extra:
        raise InvalidOptionError(
            f"unexpected input column(s) {', '.join(repr(c) for c in extra)}; the sink takes "
            f"{', '.join(INPUT_COLUMNS)}. Drop them, or set option "
            "'extraColumnsAsProperties' to 'true' to carry them as message properties."
        )
    return tuple(extra)


def _string_map(field: StructField) -> bool:
    """False for a map column whose keys or values are not strings."""
    kind = field.dataType
    return not isinstance(kind, MapType) or (
        isinstance(kind.keyType, StringType) and isinstance(kind.valueType, StringType)
    )


@dataclass(frozen=True)
class Staged(WriterCommitMessage):
    """What one task attempt staged: one transaction of ``count`` half messages, in the
    epoch's ``generation``."""

    sink_id: str
    epoch: int
    transaction_id: str | None
    count: int
    generation: int = 0


@dataclass(frozen=True)
class _Writer:
    """Who stages: the writer columns of its half messages."""

    sink_id: str
    epoch: int
    generation: int
    delta_table: str | None = None


def stage(
    store: Store,
    batches: Iterable[pa.RecordBatch],
    options: WriterOptions,
    sink_id: str,
    epoch: int,
    generation: int,
    delta_table: str | None = None,
) -> Staged:
    """Validate rows and write them as half messages of one new transaction (one commit), in
    ``generation`` of the epoch (hold it first: :class:`rmq_spark.spark.epochs.Lease`). The rows are
    written as they arrive, one batch in memory at a time, and committed at the end.

    Raises InvalidMessageError, naming the problem, before anything is committed.
    """
    txn = new_id()
    writer = _Writer(sink_id, epoch, generation, delta_table)
    count = 0

    def halves() -> Iterator[pa.Table]:
        nonlocal count
        for batch in batches:
            if batch.num_rows:
                rows = _half_rows(pa.Table.from_batches([batch]), options, txn, writer)
                count += rows.num_rows
                yield rows

    if store.append_batches("half", halves()) is None:
        return Staged(sink_id, epoch, None, 0, generation)
    failpoint("sink.staged")
    return Staged(sink_id, epoch, txn, count, generation)


def _half_rows(table: pa.Table, options: WriterOptions, txn: str, writer: _Writer) -> pa.Table:
    n = table.num_rows
    for name in table.column_names:
        if name != "body":  # bytes, or a string column only read as bytes
            try:
                table.column(name).validate(full=True)
            except pa.ArrowInvalid as exc:
                raise InvalidMessageError(
                    f"column {name!r} holds text that is not valid UTF-8 ({exc}); decode the "
                    "bytes it came from (for example with CAST(... AS STRING) of valid UTF-8, "
                    "or replace bad bytes), or carry them in the body."
                ) from exc
    body = table.column("body").cast(pa.binary())
    if body.null_count:
        raise InvalidMessageError(f"{body.null_count} row(s) have a null 'body'.")
    sizes = pc.binary_length(body)
    limit = options.settings.max_body_bytes
    empty = pc.sum(pc.equal(sizes, 0)).as_py()
    if empty:
        raise InvalidMessageError(f"{empty} row(s) have an empty body; drop them.")
    large = pc.sum(pc.greater(sizes, limit)).as_py()
    if large:
        raise InvalidMessageError(
            f"{large} row(s) have a body over the limit of {limit} bytes; split them, or raise "
            "store.max_body_bytes."
        )
    topic = _column(table, "topic", pa.string())
    if topic is None:
        topic = pa.chunked_array([pa.repeat(pa.scalar(options.topic, pa.string()), n)])
    elif topic.null_count:
        if options.topic is None:
            raise InvalidMessageError(
                f"{topic.null_count} row(s) have a null 'topic' and no option 'topic' is set."
            )
        topic = pc.fill_null(topic, options.topic)
    for name in pc.unique(topic).to_pylist():
        check_topic(name)
    keys = _column(table, "keys", pa.string())
    tags = _column(table, "tags", pa.string())
    if tags is not None:
        # model.is_tag, vectorised (Arrow's whitespace trim agrees with str.strip()).
        bad = pc.or_(
            pc.or_(pc.equal(pc.utf8_length(tags), 0), pc.match_substring(tags, "|")),
            pc.not_equal(pc.utf8_trim_whitespace(tags), tags),
        )
        count = pc.sum(bad).as_py()
        if count:
            example = pc.filter(tags, bad)[0].as_py()
            raise InvalidMessageError(
                f"{count} row(s) have a 'tags' value no subscription can name, e.g. "
                f"{example!r}: a tag is one non-empty string with no '|' and no leading or "
                "trailing whitespace (use null for no tag)."
            )
    now = datetime.now(UTC)
    return pa.table(
        {
            "transaction_id": pa.repeat(pa.scalar(txn, pa.string()), n),
            "msg_id": new_ids(n),
            "producer_group": pa.repeat(pa.scalar(options.producer_group, pa.string()), n),
            "topic": topic,
            "queue_id": queues_for(keys, n, options.settings.queue_nums),
            "keys": keys if keys is not None else pa.nulls(n, pa.string()),
            "tags": tags if tags is not None else pa.nulls(n, pa.string()),
            "body": body,
            "properties": _properties(table, options.extra_columns),
            "born_timestamp": pa.repeat(pa.scalar(now, TIMESTAMP), n),
            "store_timestamp": pa.repeat(pa.scalar(now, TIMESTAMP), n),
            "sink_id": pa.repeat(pa.scalar(writer.sink_id, pa.string()), n),
            "epoch": pa.repeat(pa.scalar(writer.epoch, pa.int64()), n),
            "generation": pa.repeat(pa.scalar(writer.generation, pa.int32()), n),
            "delta_table": pa.repeat(pa.scalar(writer.delta_table, pa.string()), n),
        },
        schema=HALF_SCHEMA,
    )


def _column(table: pa.Table, name: str, type_: pa.DataType) -> pa.ChunkedArray | None:
    return table.column(name).cast(type_) if name in table.column_names else None


def _properties(table: pa.Table, extra: Sequence[str]) -> pa.Array:
    """Each row's properties: its own, then its extra columns."""
    n, kind = table.num_rows, HALF_SCHEMA.field("properties").type
    if "properties" not in table.column_names and not extra:
        _check_properties([[]] * n, table)
        return pa.nulls(n, kind)
    user = (
        table.column("properties").to_pylist() if "properties" in table.column_names else [None] * n
    )
    carried = {c: table.column(c).cast(pa.string()).to_pylist() for c in extra}
    rows = []
    for i, props in enumerate(user):
        merged = dict(props or ())
        merged.update((c, v[i]) for c, v in carried.items() if v[i] is not None)
        rows.append(list(merged.items()))
    _check_properties(rows, table)
    return pa.array(rows, kind)


def _check_properties(rows: list[list[tuple[str, str | None]]], table: pa.Table) -> None:
    """The producer API's rules for properties (:func:`rmq_spark.model.messages.validate_message`):
    no null values, the check immunity in plain seconds (the check-back job would otherwise
    give it none), and keys, tags and properties within RocketMQ's property block."""
    nulls = Counter(name for row in rows for name, value in row if value is None)
    if nulls:
        name, count = nulls.most_common(1)[0]
        raise InvalidMessageError(
            f"{count} row(s) have a null value of property {name!r}; give it a value or leave "
            "the property out (the producer API refuses null properties too)."
        )
    immunity = [v for row in rows for k, v in row if k == PROPERTY_CHECK_IMMUNITY]
    bad = [v for v in immunity if not SECONDS.fullmatch(v)]
    if bad:
        raise InvalidMessageError(
            f"{len(bad)} row(s) have property {PROPERTY_CHECK_IMMUNITY}={bad[0]!r} is not a "
            "number of seconds (ASCII digits, an optional decimal point); use e.g. '30'."
        )
    sizes = np.zeros(len(rows), np.int64)
    for column in ("keys", "tags"):
        if column in table.column_names:
            length = pc.binary_length(table.column(column).cast(pa.binary()))
            sizes += pc.fill_null(length, 0).to_numpy().astype(np.int64)
    if any(rows):
        sizes += np.array([sum(len(k.encode()) + len(v.encode()) for k, v in r) for r in rows])
    over = np.flatnonzero(sizes > MAX_PROPERTY_BYTES)
    if len(over):
        raise InvalidMessageError(
            f"{len(over)} row(s) have keys, tags and properties of more than "
            f"{MAX_PROPERTY_BYTES} bytes together (RocketMQ's limit for a message's properties), "
            f"e.g. {int(sizes[over[0]])} bytes; put large values in the body."
        )


def _report(outcome: EpochOutcome, staged: Sequence[Staged], seconds: float) -> None:
    count = sum(m.count for m in staged)
    log.info(
        "rmqtx sink %s epoch %d: %d message(s) staged in %d transaction(s); %s (%.1f s)",
        outcome.sink_id,
        outcome.epoch,
        count,
        len(staged),
        f"committed and published {len(outcome.committed)} transaction(s)"
        if outcome.first
        else f"already closed by an earlier attempt: rolled back {len(outcome.rolled_back)}",
        seconds,
    )


def _staged(messages: Sequence[WriterCommitMessage | None]) -> list[Staged]:
    """The commit messages of tasks that staged something."""
    return [m for m in messages if isinstance(m, Staged) and m.transaction_id]


def _pairs(staged: Sequence[Staged]) -> list[tuple[str, int]]:
    return [(m.transaction_id, m.generation) for m in staged if m.transaction_id]


class _EpochWriter:
    """What the batch and the streaming writer share: staging in tasks, ending on the driver."""

    def __init__(self, options: WriterOptions) -> None:
        self.options = options
        # On the driver, before any task: a new path becomes a store (as format("delta")
        # makes a table); a path holding anything else is refused here.
        Store.open(options.path, settings=options.settings)

    def _store(self) -> Store:
        return Store.open(self.options.path, settings=self.options.settings, create=False)

    def _stage(
        self, iterator: Iterator[pa.RecordBatch], sink_id: str, epoch: int, owner: str
    ) -> Staged:
        store = self._store()
        with Lease(store, sink_id, epoch, owner, self.options.lease_seconds) as held:
            return stage(store, iterator, self.options, sink_id, epoch, held.generation)

    def _commit(self, messages: Sequence[WriterCommitMessage | None], epoch: int) -> None:
        staged = _staged(messages)
        if not staged:
            return
        configure_logging("INFO")
        started = time.perf_counter()
        outcome = finish_epoch(
            self._store(),
            staged[0].sink_id,
            epoch,
            _pairs(staged),
            self.options.producer_group,
            "sink",
        )
        failpoint("sink.published")
        _report(outcome, staged, time.perf_counter() - started)

    def _abort(self, messages: Sequence[WriterCommitMessage | None], epoch: int) -> None:
        staged = _staged(messages)
        if staged:
            group = self.options.producer_group
            abandon_attempt(self._store(), staged[0].sink_id, epoch, _pairs(staged), group)
            log.warning(
                "rmqtx sink %s epoch %d aborted: rolled back %d transaction(s)",
                staged[0].sink_id,
                epoch,
                len(staged),
            )


class RmqTxBatchWriter(_EpochWriter, DataSourceArrowWriter):
    """``df.write.format("rmqtx")``: one epoch (0) of a sink id made for this write, unless
    option ``sinkId`` names one (a second write with the same ``sinkId`` publishes nothing:
    the id's epoch is closed, as with Delta's ``txnAppId``)."""

    def __init__(self, options: WriterOptions) -> None:
        super().__init__(options)
        self.sink_id = options.sink_id or f"write-{new_id()}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Staged:
        return self._stage(iterator, self.sink_id, 0, owner=self.sink_id)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self._commit(messages, 0)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        self._abort(messages, 0)
        if self.options.sink_id is None:
            # This id is never used again: closing its epoch empty lets the check-back job
            # roll back halves of failed task attempts at once.
            close(self._store(), self.sink_id, 0, None, [], "abort")


class RmqTxStreamWriter(_EpochWriter, DataSourceStreamArrowWriter):
    """``df.writeStream.format("rmqtx")``: epoch = micro-batch id, sink id = option ``sinkId``
    or the query id (kept in the checkpoint, so a restarted query continues its epochs)."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Staged:
        context = TaskContext.get()
        assert context is not None
        query_id = context.getLocalProperty("sql.streaming.queryId")
        epoch = int(context.getLocalProperty("streaming.sql.batchId"))
        return self._stage(iterator, self.options.sink_id or query_id, epoch, owner=query_id)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self._commit(messages, batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self._abort(messages, batchId)


def publish_with_delta_write(
    rows: DataFrame,
    table: str,
    messages: DataFrame,
    *,
    app_id: str,
    version: int,
    producer_group: str,
    topic: str | None = None,
    path: str | None = None,
    lease_timeout: str | float = DEFAULT_LEASE_TIMEOUT,
) -> EpochOutcome:
    """Append ``rows`` to the Delta table ``table`` and publish ``messages``, atomically.

    The local transaction of RocketMQ's protocol is the Delta write, made idempotent with
    Delta's ``txnAppId`` = ``app_id`` and ``txnVersion`` = ``version`` (in a ``foreachBatch``,
    pass the query's name and the batch id). The messages are staged first (durable,
    invisible), then the rows are written (the commit's ``userMetadata`` names the staged
    transaction), then the epoch (``app_id``, ``version``) is closed and its messages
    committed. A crash anywhere is repaired by re-running the batch (Delta skips a version it
    has; the epoch publishes once) or by the check-back job, whose epoch checker commits the
    messages exactly when ``table`` holds ``version`` for ``app_id``.

    Parameters
    ----------
    rows : DataFrame
        Business rows to append to ``table``.
    table : str
        Path or URI of the business Delta table.
    messages : DataFrame
        Messages, with the columns of ``df.write.format("rmqtx")`` (``body``, ...).
    app_id, version : str, int
        Delta's idempotent-writer id and version (the epoch).
    producer_group : str
        Producer group of the staged transaction.
    topic : str, optional
        Topic of messages without a ``topic`` column.
    path : str, optional
        Store root (default: conf).
    lease_timeout : str or float, default "10m"
        How long the epoch stays held if this process stops sending heartbeats.

    Returns
    -------
    EpochOutcome
        Whether this call's messages were committed, or an earlier attempt's were.

    Raises
    ------
    EpochLostError
        The epoch was abandoned under this call (its lease ran out): nothing is published;
        run the batch again.

    Notes
    -----
    A re-run whose Delta write is skipped (an earlier attempt's rows landed) publishes the
    messages it staged itself: the earlier attempt's may have been rolled back with its
    abandoned generation. Compute ``messages`` deterministically from the batch (no ``uuid()``
    or ``now()``), as for any Spark retry, so that every attempt stages the same messages.
    """
    options = {
        PATH: path,
        PRODUCER_GROUP: producer_group,
        TOPIC: topic,
        LEASE_TIMEOUT: str(lease_timeout),
    }
    parsed = WriterOptions.parse({k: v for k, v in options.items() if v}, messages.schema)
    store = Store.open(parsed.path, settings=parsed.settings)
    table_uri = normalise_root(table)
    with Lease(store, app_id, version, app_id, parsed.lease_seconds) as held:
        staged = stage(
            store,
            messages.toArrow().to_batches(),
            parsed,
            app_id,
            version,
            held.generation,
            table_uri,
        )
        pairs = _pairs([staged])
        failpoint("delta.staged")
        try:
            (
                rows.write.format("delta")
                .mode("append")
                .option("txnAppId", app_id)
                .option("txnVersion", version)
                .option("userMetadata", delta_commit_marker(app_id, version, staged.transaction_id))
                .save(table)
            )
        except Exception:
            landed, _ = landed_delta_write(
                table_uri, app_id, version, parsed.settings.storage_options
            )
            if not landed:
                abandon_attempt(store, app_id, version, pairs, producer_group)
                raise
            log.warning(
                "the Delta write of %s version %d reported an error but landed; publishing",
                app_id,
                version,
                exc_info=True,
            )
        failpoint("delta.written")
        return finish_epoch(store, app_id, version, pairs, producer_group, "delta")
