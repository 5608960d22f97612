"""Options of ``format("rmqtx")`` writes and :func:`rmq_spark.spark.sink.publish_with_delta_write`.

:meth:`WriterOptions.parse` validates the options (case-insensitive keys, the table in
:mod:`rmq_spark.spark.sink`) and the input columns once, on the driver, before anything is
staged. It keeps docs/contract.md rule 7 (bad input gets a clear error and loses nothing): an
unknown or misspelled option, a missing ``producerGroup``, topic or ``body`` column, a column
of the wrong type, or an extra column not asked for fails fast with a message naming it and
the fix.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from pyspark.sql.types import BinaryType, MapType, StringType, StructField, StructType

from rmq_spark.model.config import (
    StoreSettings,
    load_settings,
    parse_duration,
    reject_unknown,
    split_storage_options,
)
from rmq_spark.model.errors import InvalidMessageError, InvalidOptionError
from rmq_spark.model.messages import check_group, check_topic

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
#: Spark passes these to a stream writer when the query was given them as options; they are
#: Spark's, not ours (the checkpoint tells a stream's abort its query id).
_CHECKPOINT = "checkpointlocation"
_SPARK_OPTIONS = frozenset({_CHECKPOINT, "queryname"})
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
    #: A stream's ``checkpointLocation``, when given as an option of the query.
    checkpoint: str | None = None

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
                checkpoint=next((v for k, v in options.items() if k.lower() == _CHECKPOINT), None),
            )
        except InvalidMessageError as exc:
            raise InvalidOptionError(f"write option: {exc.message}") from exc


#: What a ``sinkId`` may hold: it names epochs in tables, logs and ``rmqtx status``.
_SINK_ID = re.compile(r"[A-Za-z0-9._:%|-]{1,255}", re.ASCII)


def _check_sink_id(sink_id: str | None) -> str | None:
    """The ``sinkId`` option, if given, checked against :data:`_SINK_ID`."""
    if sink_id is not None and not _SINK_ID.fullmatch(sink_id):
        raise InvalidOptionError(
            f"option 'sinkId' {sink_id[:80]!r} is not valid; use 1 to 255 characters of "
            "letters, digits and . _ : % | - (e.g. 'orders-sink')."
        )
    return sink_id


def _check_columns(schema: StructType, *, carry_extra: bool) -> tuple[str, ...]:
    """Check the input columns' names and types; return the extra ones to carry."""
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
