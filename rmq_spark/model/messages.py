"""The message model: messages, transaction states, ids, and RocketMQ's validation rules."""

from __future__ import annotations

import enum
import itertools
import math
import os
import re
import secrets
import threading
import time
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.model.errors import InvalidMessageError, RmqSparkError

#: RocketMQ's topic rule (``TopicValidator``): letters, digits, ``%``, ``|``, ``_`` and ``-``.
TOPIC_PATTERN = re.compile(r"^[%|a-zA-Z0-9_-]+$")
TOPIC_MAX_LENGTH = 127
#: RocketMQ's default ``maxMessageSize``.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

HALF_TOPIC = "RMQ_SYS_TRANS_HALF_TOPIC"
OP_TOPIC = "RMQ_SYS_TRANS_OP_HALF_TOPIC"
CHECK_MAX_TOPIC = "TRANS_CHECK_MAX_TIME_TOPIC"
#: Topics the broker owns; user writes to them are refused (RocketMQ ``TopicValidator``).
SYSTEM_TOPICS = frozenset(
    {
        HALF_TOPIC,
        OP_TOPIC,
        CHECK_MAX_TOPIC,
        "TBW102",
        "SCHEDULE_TOPIC_XXXX",
        "BenchmarkTest",
        "OFFSET_MOVED_EVENT",
        "SELF_TEST_TOPIC",
        "RMQ_SYS_TRACE_TOPIC",
        "RMQ_SYS_SELF_TEST_TOPIC",
    }
)
SYSTEM_TOPIC_PREFIXES = ("rmq_sys_", "RMQ_SYS_", "%RETRY%", "%DLQ%")

#: Per-message property: seconds before the first check-back (RocketMQ's name).
PROPERTY_CHECK_IMMUNITY = "CHECK_IMMUNITY_TIME_IN_SECONDS"
#: A number of seconds as a property holds it: ASCII digits, an optional decimal part.
SECONDS = re.compile(r"[0-9]+(\.[0-9]+)?", re.ASCII)
#: RocketMQ stores a message's keys, tags and properties in one block of at most this many
#: bytes (its length is a 16-bit signed field).
MAX_PROPERTY_BYTES = 32767
#: RocketMQ joins several keys with one space (``MessageConst.KEY_SEPARATOR``).
KEY_SEPARATOR = " "


class LocalTransactionState(enum.StrEnum):
    """Outcome of a local transaction, as in RocketMQ's ``LocalTransactionState``.

    ``COMMIT`` makes the half message visible, ``ROLLBACK`` discards it, ``UNKNOWN`` leaves it
    pending for the check-back job.
    """

    COMMIT = "COMMIT"
    ROLLBACK = "ROLLBACK"
    UNKNOWN = "UNKNOWN"

    @classmethod
    def coerce(cls, value: object) -> LocalTransactionState:
        """Map a listener's or checker's answer to a state.

        Recognised, exactly as spelled: a member, its name (``"COMMIT"``, ``"ROLLBACK"``,
        ``"UNKNOWN"``), and RocketMQ's Java names (``"COMMIT_MESSAGE"``,
        ``"ROLLBACK_MESSAGE"``, ``"UNKNOW"``). Anything else (``None``, ``"commit"``,
        ``" ROLLBACK"``...) is ``UNKNOWN``: a guess must never commit or roll back, and
        UNKNOWN only means the check-back job asks again.
        """
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            return _STATE_NAMES.get(value, cls.UNKNOWN)
        return cls.UNKNOWN


#: The spellings :meth:`LocalTransactionState.coerce` recognises (Python's and RocketMQ's).
_STATE_NAMES = {
    **{state.value: state for state in LocalTransactionState},
    "COMMIT_MESSAGE": LocalTransactionState.COMMIT,
    "ROLLBACK_MESSAGE": LocalTransactionState.ROLLBACK,
    "UNKNOW": LocalTransactionState.UNKNOWN,
}


_HEX_DIGITS = np.frombuffer(b"0123456789ABCDEF", np.uint8)
#: The most ids :func:`new_ids` makes at once (32 bytes each, 32-bit Arrow offsets).
_MAX_BULK_IDS = (2**31 - 1) // 32
_id_lock = threading.Lock()
_id_counter = itertools.count()


def new_id() -> str:
    """A unique, time-ordered 32-hex-digit id: 48-bit millisecond clock, a 16-bit per-process
    counter and 64 random bits.

    Time order keeps ids written together close in Delta file statistics, so lookups by id
    prune files; the counter keeps ids made one after another in one process in order.
    """
    with _id_lock:
        count = next(_id_counter) & 0xFFFF
    return f"{time.time_ns() // 1_000_000:012X}{count:04X}{secrets.token_hex(8).upper()}"


def new_ids(count: int) -> pa.StringArray:
    """``count`` unique ids in one call, in order: one :func:`new_id`'s clock and counter, 32
    random bits shared by the call, and the index in 8 hex digits (for bulk writes: made as
    one Arrow buffer, without a Python string per id)."""
    if not 0 <= count <= _MAX_BULK_IDS:
        raise ValueError(f"new_ids makes 0 to {_MAX_BULK_IDS} ids at once, not {count}")
    prefix = np.frombuffer(new_id()[:24].encode(), np.uint8)
    shifts = np.arange(28, -4, -4, dtype=np.uint32)
    nibbles = (np.arange(count, dtype=np.uint32)[:, None] >> shifts) & 0xF
    data = np.empty((count, 32), np.uint8)
    data[:, :24] = prefix
    data[:, 24:] = _HEX_DIGITS[nibbles]
    offsets = np.arange(0, 32 * count + 1, 32, dtype=np.int32)
    return pa.Array.from_buffers(
        pa.string(), count, [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    )


@dataclass(frozen=True)
class Message:
    """A message to send, as in RocketMQ's ``Message``.

    Parameters
    ----------
    topic : str
        Destination topic: ``^[%|a-zA-Z0-9_-]+$``, at most 127 characters, not a system topic.
    body : bytes or str
        Payload; a ``str`` is encoded as UTF-8. At most the store's ``max_body_bytes``.
    tags : str, optional
        One tag, used by consumers' subscription expressions (``TagA || TagB``): not
        empty, no ``|``, no leading or trailing whitespace (see :func:`is_tag`).
    keys : str or iterable of str, optional
        Business keys for lookup; several keys are joined with a space as in RocketMQ. An
        iterable is read once, here, and kept as a tuple.
    properties : mapping of str to str, optional
        User properties, e.g. ``{"CHECK_IMMUNITY_TIME_IN_SECONDS": "30"}``.
    """

    topic: str
    body: bytes | str
    tags: str | None = None
    keys: str | Iterable[str] | None = None
    properties: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # A generator would be used up by validation and stored as no keys at all.
        if self.keys is not None and not isinstance(self.keys, str | tuple):
            try:
                object.__setattr__(self, "keys", tuple(self.keys))
            except TypeError:
                pass  # not iterable: validate_message names the problem

    @property
    def body_bytes(self) -> bytes:
        """The body as bytes."""
        return self.body.encode("utf-8") if isinstance(self.body, str) else bytes(self.body)

    @property
    def keys_string(self) -> str | None:
        """The keys as RocketMQ stores them: one string, keys separated by a space (None for
        no keys, an empty iterable included)."""
        if self.keys is None or isinstance(self.keys, str):
            return self.keys
        return KEY_SEPARATOR.join(self.keys) or None


@dataclass(frozen=True)
class MessageExt:
    """A stored message, as a checker or consumer sees it (RocketMQ's ``MessageExt``).

    Half messages carry their real topic and queue; ``queue_offset`` is set only once the
    message is committed into its topic.
    """

    topic: str
    queue_id: int
    msg_id: str
    transaction_id: str | None
    producer_group: str | None
    keys: str | None
    tags: str | None
    body: bytes
    properties: dict[str, str]
    born_timestamp: datetime
    store_timestamp: datetime
    queue_offset: int | None = None


def check_topic(topic: object) -> str:
    """Validate a user topic name; return it or raise :class:`InvalidMessageError`."""
    if not isinstance(topic, str):
        raise InvalidMessageError(
            f"topic needs to be a string but got {type(topic).__name__} ({topic!r})."
        )
    if not topic:
        raise InvalidMessageError("topic is empty; give the destination topic name.")
    if len(topic) > TOPIC_MAX_LENGTH:
        raise InvalidMessageError(
            f"topic {topic[:40]!r}... is {len(topic)} characters long; RocketMQ allows at most "
            f"{TOPIC_MAX_LENGTH}. Use a shorter name."
        )
    if not TOPIC_PATTERN.fullmatch(topic):
        raise InvalidMessageError(
            f"topic {topic!r} has characters RocketMQ does not allow; a topic must match "
            f"{TOPIC_PATTERN.pattern} (letters, digits, '%', '|', '_', '-')."
        )
    if topic in SYSTEM_TOPICS or topic.startswith(SYSTEM_TOPIC_PREFIXES):
        raise InvalidMessageError(
            f"topic {topic!r} is a system topic reserved by the broker; user messages cannot "
            "be written to it. Choose another topic name."
        )
    return topic


def is_topic(topic: object) -> bool:
    """Whether ``topic`` is a user topic name (:func:`check_topic` would take it)."""
    try:
        check_topic(topic)
    except InvalidMessageError:
        return False
    return True


def is_tag(tag: object) -> bool:
    """Whether ``tag`` is a tag a subscription expression (``TagA || TagB``) can name.

    Subscriptions split on ``||`` and strip whitespace around each tag, so a tag is a
    non-empty string with no ``|`` and no leading or trailing whitespace. The source's
    ``tags`` option and every writer apply this one rule.
    """
    return isinstance(tag, str) and bool(tag) and "|" not in tag and tag == tag.strip()


def check_group(group: object, what: str = "producer_group") -> str:
    """Validate a producer or consumer group name (same character rule as topics)."""
    if not isinstance(group, str) or not group:
        raise InvalidMessageError(f"{what} needs to be a non-empty string but got {group!r}.")
    if len(group) > 255 or not TOPIC_PATTERN.fullmatch(group):
        raise InvalidMessageError(
            f"{what} {group!r} is not valid; use at most 255 characters matching "
            f"{TOPIC_PATTERN.pattern}."
        )
    return group


def validate_message(message: object, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES) -> Message:
    """Check a message against RocketMQ's rules before anything is written.

    Parameters
    ----------
    message : Message
        The message to check.
    max_body_bytes : int
        The body size limit (RocketMQ ``maxMessageSize``, 4 MiB by default).

    Returns
    -------
    Message
        The same message.

    Raises
    ------
    InvalidMessageError
        Naming the broken rule and how to fix it.
    """
    if not isinstance(message, Message):
        raise InvalidMessageError(
            f"expected an rmq_spark.Message but got {type(message).__name__}; build one with "
            "Message(topic=..., body=...)."
        )
    check_topic(message.topic)
    if not isinstance(message.body, bytes | bytearray | memoryview | str):
        raise InvalidMessageError(
            f"body needs to be bytes or str but got {type(message.body).__name__}."
        )
    if isinstance(message.body, str):
        _check_utf8(message.body, "body")
    size = len(message.body_bytes)
    if size == 0:
        raise InvalidMessageError(f"message to topic {message.topic!r} has an empty body.")
    if size > max_body_bytes:
        raise InvalidMessageError(
            f"body of {size} bytes for topic {message.topic!r} exceeds the limit of "
            f"{max_body_bytes} bytes; send smaller messages or raise max_body_bytes."
        )
    tags = message.tags
    if tags is not None and not is_tag(tags):
        raise InvalidMessageError(
            f"tags needs to be a single tag string (no '|', no leading or trailing whitespace, "
            f"not empty) that a subscription 'TagA || TagB' can name, but got {tags!r}: "
            f"{_tag_problem(tags)}."
        )
    keys = message.keys
    if keys is not None and not isinstance(keys, str):
        if not isinstance(keys, tuple):
            raise InvalidMessageError(
                f"keys need to be a string or an iterable of strings but got "
                f"{type(keys).__name__} ({keys!r})."
            )
        if not all(isinstance(k, str) for k in keys):
            raise InvalidMessageError(f"keys need to be strings but got {keys!r}.")
    if not isinstance(message.properties, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in message.properties.items()
    ):
        raise InvalidMessageError(
            f"properties need to be a mapping of str to str but got {message.properties!r}."
        )
    _check_property_block(message)
    immunity = message.properties.get(PROPERTY_CHECK_IMMUNITY)
    if immunity is not None and not SECONDS.fullmatch(immunity):
        raise InvalidMessageError(
            f"property {PROPERTY_CHECK_IMMUNITY}={immunity!r} is not a number of seconds "
            "(ASCII digits, an optional decimal point); use e.g. '30'."
        )
    return message


def check_immunity(value: str | None) -> float:
    """The seconds of check immunity a message's ``CHECK_IMMUNITY_TIME_IN_SECONDS`` asks for:
    0 when it has none, or when the value is not a number of seconds as producers write it
    (:data:`SECONDS`): a row another Delta writer stored may hold anything, and one such value
    must not stop the checks of every transaction."""
    if value is None or not SECONDS.fullmatch(value):
        return 0.0
    seconds = float(value)
    return seconds if math.isfinite(seconds) else 0.0


def _check_utf8(text: str, what: str) -> int:
    """The UTF-8 size of ``text``; an error naming ``what`` when it has no UTF-8 form (a lone
    surrogate, as ``surrogateescape`` decoding of file names and environment values makes)."""
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise InvalidMessageError(
            f"{what} {text[:40]!r} cannot be stored as UTF-8 ({exc.reason} at position "
            f"{exc.start}); decode the text it came from with errors='replace', or send bytes "
            "in the body instead."
        ) from exc


def _check_property_block(message: Message) -> None:
    """Keys, tags and properties: storable as UTF-8, and together within RocketMQ's property
    block (:data:`MAX_PROPERTY_BYTES`)."""
    size = _check_utf8(message.keys_string or "", "keys") + _check_utf8(message.tags or "", "tags")
    for name, value in message.properties.items():
        size += _check_utf8(name, "property name") + _check_utf8(value, f"property {name!r}")
        if size > MAX_PROPERTY_BYTES:
            break
    if size > MAX_PROPERTY_BYTES:
        raise InvalidMessageError(
            f"keys, tags and properties of a message to {message.topic!r} take more than "
            f"{MAX_PROPERTY_BYTES} bytes (RocketMQ's limit for a message's properties); put "
            "large values in the body."
        )


def _tag_problem(tag: object) -> str:
    """Why ``tag`` is not a tag (see :func:`is_tag`)."""
    if not isinstance(tag, str):
        return f"it is a {type(tag).__name__}"
    if not tag:
        return "it is empty; use None for no tag"
    if "|" in tag:
        return "it has a '|'"
    return "it has leading or trailing whitespace"


#: Queue ids of shard ``k`` of a store are ``k * SHARD_QUEUE_STRIDE + 0 .. queue_nums - 1``:
#: every queue lives in one shard's CommitLog, and shard 3's queue 2 reads as 3002.
SHARD_QUEUE_STRIDE = 1000
#: The most shards a store may have.
MAX_SHARDS = 1000

#: What follows :func:`new_id` in a transaction id decided by its decision object
#: (:func:`shard_transaction_id`, :mod:`rmq_spark.store.arbiter`): lower case, so never a digit.
OBJECT_DECIDED_MARK = "d"
#: A transaction id of shard ``k`` >= 1 (:func:`shard_transaction_id`); group ``shard`` is ``k``.
_SHARD_SUFFIX = re.compile(r"[0-9A-F]{32}d?\.(?P<shard>[1-9][0-9]*)", re.ASCII)
#: What an id of a shard looks like to a reader, canonical or not (``<id>.01``, ``<id>.0``).
_SHARD_SHAPED = re.compile(r"[0-9A-F]{32}d?\.[0-9]+", re.ASCII)
_OBJECT_DECIDED = re.compile(r"^[0-9A-F]{32}d(?:\.[1-9][0-9]*)?\Z", re.ASCII)


def named_shard(transaction_id: str) -> int | None:
    """The shard a transaction id names: ``k`` for an id made by shard ``k``
    (:func:`shard_transaction_id`: 32 hex digits, a dot and ``k``), 0 for any other id; None
    for one shaped like a shard's id that no shard makes (``<id>.0``, ``<id>.01``, a shard
    past :data:`MAX_SHARDS`), which names no transaction. The whole id is matched: one with a
    line break after it is not a shard's."""
    found = _SHARD_SUFFIX.fullmatch(transaction_id)
    if found is not None:
        digits = found.group("shard")
        return int(digits) if len(digits) <= len(str(MAX_SHARDS)) else None
    return None if _SHARD_SHAPED.fullmatch(transaction_id) else 0


def shard_of(transaction_id: str) -> int:
    """The shard of the store that holds a transaction (:func:`named_shard`).

    Raises
    ------
    RmqSparkError
        The id has a shard's shape but no shard makes it (``<id>.0``, ``<id>.01``): it names
        no transaction, and a decision for it would be recorded for nothing.
    """
    shard = named_shard(transaction_id)
    if shard is None:
        raise RmqSparkError(
            f"{transaction_id[:80]!r} is not a transaction id rmq-spark made: a shard's ids end "
            "in '.<shard>' with no leading zero (shard 0's have no suffix). Use the id the send "
            "returned."
        )
    return shard


def shard_transaction_id(shard: int, *, object_decided: bool = False) -> str:
    """A new transaction id of shard ``shard`` (:func:`new_id`, with ``.<shard>`` after it
    beyond shard 0), so that every decider finds the transaction's shard in its id.

    ``object_decided``: the id says (:data:`OBJECT_DECIDED_MARK` after :func:`new_id`) that the
    transaction's first decision is the one whose decision object is put first
    (:mod:`rmq_spark.store.arbiter`), so that every decider uses the same arbiter.
    """
    mark = OBJECT_DECIDED_MARK if object_decided else ""
    return f"{new_id()}{mark}.{shard}" if shard else f"{new_id()}{mark}"


def object_decided(transaction_id: str) -> bool:
    """Whether a transaction's decision object decides it (see :func:`shard_transaction_id`);
    any other transaction is decided in its shard's ``op`` alone."""
    return _OBJECT_DECIDED.match(transaction_id) is not None


def shard_of_queue(queue_id: int) -> int:
    """The shard whose CommitLog holds a queue (see :data:`SHARD_QUEUE_STRIDE`)."""
    return queue_id // SHARD_QUEUE_STRIDE


def queue_for(keys: str | None, queue_nums: int) -> int:
    """Pick a queue: messages with the same keys share a queue (and so keep their order)."""
    if keys:
        # crc32, not hash(): Python's hash() is salted per process.
        return zlib.crc32(keys.encode("utf-8")) % queue_nums
    return int.from_bytes(os.urandom(2), "big") % queue_nums


def queues_for(keys: pa.ChunkedArray | pa.Array | None, count: int, queue_nums: int) -> pa.Array:
    """:func:`queue_for` of each of ``count`` rows' ``keys`` (None: no row has keys), as an
    int32 array: one checksum per distinct keys, a random queue for each row without keys."""
    queues = np.frombuffer(os.urandom(2 * count), ">u2").astype(np.int32) % queue_nums
    if keys is not None:
        if isinstance(keys, pa.ChunkedArray):
            keys = keys.combine_chunks()
        keys = pc.if_else(pc.equal(keys, ""), pa.scalar(None, keys.type), keys)
        encoded = pc.dictionary_encode(keys)
        per_key = np.array(
            [queue_for(k, queue_nums) for k in encoded.dictionary.to_pylist()], np.int32
        )
        has_keys = encoded.indices.is_valid().to_numpy(zero_copy_only=False)
        index = encoded.indices.fill_null(0).to_numpy(zero_copy_only=False)
        if len(per_key):
            queues = np.where(has_keys, per_key[index], queues)
    return pa.array(queues, pa.int32())
