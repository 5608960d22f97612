"""Options of ``format("rmqtx")`` reads: :class:`ReaderOptions` and the helpers that parse them.

:meth:`ReaderOptions.parse` validates the options (case-insensitive keys, the table in
:mod:`rmq_spark.spark.source`) on the driver: at ``load()`` with the options of both kinds of
read, and when the batch or stream reader is made with what only the kind decides. It keeps
docs/contract.md rule 7 (bad input gets a clear error and loses nothing): an unknown or misspelled
option, a missing topic, a malformed offset, timestamp, size, tag expression or flag, or an
option of the other kind of read fails fast with a message naming it and the fix (a stream-only
option on a batch is a warning). What ``load()`` checks in the store lives in
:mod:`rmq_spark.spark.source`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from rmq_spark.model.config import (
    StoreSettings,
    load_settings,
    parse_int,
    reject_unknown,
    split_storage_options,
)
from rmq_spark.model.errors import InvalidMessageError, InvalidOptionError
from rmq_spark.model.messages import check_group, check_topic, is_tag
from rmq_spark.spark.offsets import FAIL_ON_MISSING_TOPIC, Offsets, parse_offsets
from rmq_spark.store.facade import Store

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
MAX_BYTES_PER_TRIGGER = "maxBytesPerTrigger"
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
    FAIL_ON_MISSING_TOPIC,
)
STREAM_ONLY_OPTIONS = (MAX_MESSAGES_PER_TRIGGER, MAX_BYTES_PER_TRIGGER, CONSUMER_GROUP)
STREAM_OPTIONS = (
    PATH,
    TOPIC,
    STARTING_OFFSETS,
    STARTING_TIMESTAMP,
    TAGS,
    *STREAM_ONLY_OPTIONS,
    FAIL_ON_DATA_LOSS,
    FAIL_ON_MISSING_TOPIC,
)
#: What ``load()`` accepts: Spark does not tell a data source yet whether it is read as a
#: batch or a stream (see :meth:`~rmq_spark.spark.source.RmqTxDataSource.schema`).
READ_OPTIONS = (*BATCH_OPTIONS[:-2], *STREAM_ONLY_OPTIONS, *BATCH_OPTIONS[-2:])


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
    #: Streaming admission control: soft cap on a micro-batch's (stored) bytes; None: no cap.
    max_bytes_per_trigger: int | None = None
    #: Fail at ``load()`` when a topic has no messages in the store (else a warning).
    fail_on_missing_topic: bool = False

    def open_store(self) -> Store:
        """The store read, opened with the configured settings (its storage options too)."""
        return Store.open(self.path, settings=self.settings, create=False)

    @classmethod
    def parse(cls, options: Mapping[str, str], *, streaming: bool | None = False) -> ReaderOptions:
        """Validate the options of a batch or streaming read (keys are case-insensitive).

        ``streaming=None``: a read whose kind is not known yet (``load()``, see
        :meth:`~rmq_spark.spark.source.RmqTxDataSource.schema`): the options of both kinds are
        accepted and checked.
        """
        given, storage = split_storage_options({k.lower(): v for k, v in options.items()})
        allowed = (
            READ_OPTIONS if streaming is None else STREAM_OPTIONS if streaming else BATCH_OPTIONS
        )
        for batch_only in (ENDING_OFFSETS, ENDING_TIMESTAMP):
            if streaming and batch_only.lower() in given:
                raise InvalidOptionError(
                    f"option {batch_only!r} is for batch reads only; a stream reads on as "
                    "messages are committed (use Trigger.AvailableNow to stop at the latest "
                    "offsets)."
                )
        for stream_only in STREAM_ONLY_OPTIONS:
            if streaming is False and stream_only.lower() in given:
                log.warning("option %r only applies to streaming reads; ignored", stream_only)
                given.pop(stream_only.lower())
        reject_unknown(given, allowed, "format('rmqtx')")
        topic_text = given.get(TOPIC.lower())
        if not topic_text or not topic_text.strip():
            raise InvalidOptionError(
                "option 'topic' is required: one topic, or several separated by commas "
                "(e.g. .option('topic', 'OrderEvents'))."
            )
        topics = tuple(_topic(t.strip()) for t in topic_text.split(","))
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
            max_bytes_per_trigger=_byte_size(given, MAX_BYTES_PER_TRIGGER),
            fail_on_missing_topic=_boolean(given, FAIL_ON_MISSING_TOPIC, default=False),
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
    if _SECONDS_LIKE <= millis < _SECONDS_LIKE * 100:
        seconds = datetime.fromtimestamp(millis, UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
        raise InvalidOptionError(
            f"option {option!r} is {millis}: in milliseconds since the epoch, as Kafka's, that "
            f"is in January 1970. It looks like seconds ({seconds}); give milliseconds: "
            f"{millis * 1000}."
        )
    if millis > _MAX_MILLIS:
        raise InvalidOptionError(
            f"option {option!r} is {millis} ms since the epoch, after the year 9999; give "
            "milliseconds since 1970-01-01 UTC, e.g. 1767225600000 for 2026-01-01."
        )
    return millis


#: The last millisecond a timestamp can name (9999-12-31T23:59:59.999 UTC).
_MAX_MILLIS = 253_402_300_799_999
#: Timestamps from this up to 100 times it read as January 1970 to March 1973 in milliseconds,
#: and as 2001 to 5138 in seconds: given in seconds (refused).
_SECONDS_LIKE = 1_000_000_000

#: A size as Spark's byte strings write it (``maxBytesPerTrigger`` of Delta's source): bytes,
#: or a binary multiple: 1k = 1024.
_BYTE_SIZE = re.compile(r"^\s*(\d+)\s*(b|k|kb|kib|m|mb|mib|g|gb|gib|t|tb|tib)?\s*$", re.I)
_BYTE_UNITS = {"b": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def _byte_size(given: Mapping[str, str], option: str) -> int | None:
    value = given.get(option.lower())
    if value is None:
        return None
    match = _BYTE_SIZE.match(str(value))
    size = 0 if match is None else int(match[1]) * 1024 ** _BYTE_UNITS[(match[2] or "b")[0].lower()]
    if size < 1:
        raise InvalidOptionError(
            f"option {option!r} needs a size of at least 1 byte such as '1048576', '512k', "
            f"'64m' or '1g' but got {value!r}."
        )
    return size


#: Characters of a regular expression that no topic name has.
_PATTERN_CHARACTERS = frozenset(".*+?[](){}^$\\")


def _topic(name: str) -> str:
    """One name of the ``topic`` option; a regular expression (Kafka's ``subscribePattern``
    habit) is refused as such, not as a name with odd characters."""
    if _PATTERN_CHARACTERS.intersection(name):
        raise InvalidOptionError(
            f"option 'topic': {name!r} is a pattern; format('rmqtx') reads topics by name "
            "(Kafka's subscribePattern is not supported): name the topics, separated by commas "
            "('rmqtx status' lists the store's topics)."
        )
    return _option_value(check_topic, name, prefix="option 'topic': ")


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
