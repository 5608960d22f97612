"""Staging: a task's rows, validated, written as the half messages of one transaction.

:func:`stage` turns the rows a writer task receives into half messages (durable, invisible to
consumers) tagged with the writer's epoch, in one commit of the ``half`` table, and reports
them as a :class:`Staged` commit message for the driver to close the epoch with. It keeps
docs/contract.md rule 7 (bad input gets a clear error and loses nothing): a null, empty or oversized
body, a bad topic, tag or property, or text that is not UTF-8 is refused, naming the problem,
before anything is committed; and rule 1 (invisible until committed): staged rows are half
messages, which no consumer reads until their epoch commits them.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql.datasource import WriterCommitMessage

from rmq_spark.model.errors import InvalidMessageError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import (
    MAX_PROPERTY_BYTES,
    PROPERTY_CHECK_IMMUNITY,
    SECONDS,
    check_topic,
    new_id,
    new_ids,
    queues_for,
)
from rmq_spark.model.schema import HALF_SCHEMA, TIMESTAMP
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.store.facade import Store


@dataclass(frozen=True)
class Staged(WriterCommitMessage):
    """What one task attempt staged: one transaction of ``count`` half messages, in the
    epoch's ``generation``, for the writer ``owner`` (a stream's query id: the driver's abort
    learns it from here)."""

    sink_id: str
    epoch: int
    transaction_id: str | None
    count: int
    generation: int = 0
    owner: str | None = None


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
    """Validate one batch of input rows and build its half-message rows of ``txn``."""
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
    """An optional input column cast to ``type_``, or None when the input has none."""
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
