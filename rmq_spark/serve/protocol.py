"""RocketMQ 5's protocol messages (``apache.rocketmq.v2``) to and from the store's messages.

The generated code comes with the official Python client (``rocketmq.grpc_protocol`` of
``rocketmq-python-client``). Importing it imports the client package, which creates
``~/logs/rocketmq_python/`` for its own log file.

The client's message id (``system_properties.message_id``) is kept in the stored message's
properties as ``UNIQ_KEY``, RocketMQ's name for it, and is the id the server replies with; the
store gives each stored message an id of its own (``msg_id``).
"""

from __future__ import annotations

import hashlib
import re
import zlib
from collections.abc import Mapping, Sequence
from typing import Any

from google.protobuf import duration_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as service_pb

from rmq_spark.model.errors import InvalidMessageError
from rmq_spark.model.messages import (
    PROPERTY_CHECK_IMMUNITY,
    Message,
    check_group,
    check_topic,
    is_tag,
    validate_message,
)
from rmq_spark.store.deliveries import DLQ_PREFIX

#: The property holding the client's message id (RocketMQ ``MessageConst.PROPERTY_UNIQ_CLIENT_
#: MESSAGE_ID_KEYIDX``).
UNIQ_KEY = "UNIQ_KEY"
#: Properties a client may not set (``ILLEGAL_MESSAGE_PROPERTY_KEY``): RocketMQ's system
#: properties (``MessageConst.STRING_HASH_SET``, which its proxy refuses) and those a broker
#: acts on (a delay, a check immunity: a client asks for those with system properties).
RESERVED_PROPERTIES = frozenset(
    {
        UNIQ_KEY,
        PROPERTY_CHECK_IMMUNITY,
        *"""TRACE_ON MSG_REGION KEYS TAGS WAIT DELAY RETRY_TOPIC REAL_TOPIC REAL_QID TRAN_MSG
        PGROUP MIN_OFFSET MAX_OFFSET BUYER_ID ORIGIN_MESSAGE_ID TRANSFER_FLAG CORRECTION_FLAG
        MQ2_FLAG RECONSUME_TIME MAX_RECONSUME_TIMES CONSUME_START_TIME POP_CK POP_CK_OFFSET
        1ST_POP_TIME TRAN_PREPARED_QUEUE_OFFSET DUP_INFO EXTEND_UNIQ_INFO INSTANCE_ID
        CORRELATION_ID REPLY_TO_CLIENT TTL ARRIVE_TIME PUSH_REPLY_TIME CLUSTER MSG_TYPE
        INNER_MULTI_QUEUE_OFFSET TIMER_DELAY_SEC TIMER_DELIVER_MS TIMER_ENQUEUE_MS
        TIMER_DEQUEUE_MS TIMER_ROLL_TIMES TIMER_OUT_MS TIMER_DEL_UNIQKEY TIMER_DELAY_LEVEL
        __BORNHOST BORN_TIMESTAMP __STARTDELIVERTIME __transactionId__ TRANSACTION_CHECK_TIMES
        __SHARDINGKEY TRACE_CONTEXT""".split(),
    }
)
#: Properties with names of this prefix are RocketMQ's transient ones, never stored.
TRANSIENT_PREFIX = "__RMQ.TRANSIENT."
#: The longest check immunity a client's ``orphaned_transaction_recovery_duration`` sets.
_MAX_RECOVERY_SECONDS = 365 * 86400
#: A push consumer's wait before each new attempt at a message its listener failed: RocketMQ's
#: ``messageDelayLevel`` from 1 s (1s 5s 10s 30s 1m 2m ... 10m 20m 30m 1h 2h).
CONSUMER_BACKOFF_SECONDS = (
    1,
    5,
    10,
    30,
    60,
    120,
    180,
    240,
    300,
    360,
    420,
    480,
    540,
    600,
    1200,
    1800,
    3600,
    7200,
)
#: The most user properties one message may have (the proxy's ``userPropertyMaxNum``).
MAX_USER_PROPERTIES = 128

Code = pb.Code
#: A control character (Unicode category Cc), refused in property names and values.
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


class RequestError(Exception):
    """A request refused with RocketMQ's status ``code`` and a message saying why."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def status(code: int, message: str | None = None) -> pb.Status:
    """A response status; every response carries one (clients refuse a response without)."""
    return pb.Status(code=code, message=message if message is not None else Code.Name(code))


def check_topic_name(topic: str, topics: frozenset[str] | None) -> None:
    """Refuse an invalid topic name (``ILLEGAL_TOPIC``) or, when the server serves a fixed set
    of topics, one outside it (``TOPIC_NOT_FOUND``)."""
    try:
        check_topic(topic)
    except InvalidMessageError as exc:
        raise RequestError(Code.ILLEGAL_TOPIC, exc.message) from exc
    if topics is not None and topic not in topics:
        raise RequestError(
            Code.TOPIC_NOT_FOUND,
            f"topic {topic!r} not found: this server does not serve it (rmqtx serve --topic).",
        )


def check_consumed_topic(topic: str, topics: frozenset[str] | None) -> None:
    """Refuse a topic consumers may not read: as :func:`check_topic_name`, except that a
    consumer group's dead-letter topic (``%DLQ%<group>``, a system topic) is read like any."""
    group = topic.removeprefix(DLQ_PREFIX)
    if group != topic:
        try:
            check_group(group)
            return
        except InvalidMessageError as exc:
            raise RequestError(Code.ILLEGAL_TOPIC, exc.message) from exc
    check_topic_name(topic, topics)


#: The largest request gRPC takes, as RocketMQ's proxy (``grpcMaxInboundMessageSize``).
MAX_RECEIVE_BYTES = 130 * 1024 * 1024


def request_limit(max_body_bytes: int) -> int:
    """The most bytes one request carries: the proxy's transport limit, or room for a body over
    ``max_body_bytes`` (so that it is refused with RocketMQ's code, not gRPC's)."""
    return max(2 * max_body_bytes + (1 << 20), MAX_RECEIVE_BYTES)


def to_messages(
    protos: Sequence[pb.Message], topics: frozenset[str] | None, max_body_bytes: int
) -> list[Message | RequestError]:
    """The store's message for each message of a ``SendMessageRequest``, or the error that
    refuses it (:func:`to_message`).

    Raises
    ------
    RequestError
        ``MESSAGE_BODY_TOO_LARGE`` for the whole request when its bodies unzip to more than
        :func:`request_limit` in all: GZIP bodies must not make a small request hold more
        memory than the largest plain one. Unzipping stops there.
    """
    limit = request_limit(max_body_bytes)
    room = limit
    messages: list[Message | RequestError] = []
    for proto in protos:
        try:
            message = to_message(proto, topics, max_body_bytes)
        except RequestError as exc:
            messages.append(exc)
            continue
        room -= len(message.body)
        if room < 0:
            raise RequestError(
                Code.MESSAGE_BODY_TOO_LARGE,
                f"the bodies of a request's {len(protos)} messages unzip to over "
                f"{limit} bytes, the most one request carries; send "
                "fewer messages a request.",
            )
        messages.append(message)
    return messages


def to_message(proto: pb.Message, topics: frozenset[str] | None, max_body_bytes: int) -> Message:
    """The store's message for a message a client sent, checked in the order RocketMQ's proxy
    checks it.

    Raises
    ------
    RequestError
        With the code RocketMQ's proxy answers for the broken rule.
    """
    topic = proto.topic.name
    check_topic_name(topic, topics)
    system = proto.system_properties
    if not system.message_id:
        raise RequestError(Code.ILLEGAL_MESSAGE_ID, f"a message to {topic!r} has no message_id.")
    _check_properties(topic, proto.user_properties)
    if system.message_type not in (pb.NORMAL, pb.TRANSACTION):
        raise RequestError(
            Code.UNSUPPORTED,
            f"message type {pb.MessageType.Name(system.message_type)} is not supported; "
            "this server takes NORMAL and TRANSACTION messages.",
        )
    for feature, asked in (
        ("delayed delivery (delivery_timestamp)", system.HasField("delivery_timestamp")),
        ("ordered delivery (message_group)", system.HasField("message_group")),
    ):
        if asked:
            raise RequestError(
                Code.UNSUPPORTED,
                f"{feature} is not supported; send the message to {topic!r} without it.",
            )
    body = _decoded_body(proto, max_body_bytes)
    if not body:
        raise RequestError(Code.MESSAGE_BODY_EMPTY, f"a message to {topic!r} has an empty body.")
    if system.HasField("tag") and not is_tag(system.tag):
        raise RequestError(
            Code.ILLEGAL_MESSAGE_TAG,
            f"tag {system.tag!r} is not valid (empty, with '|' or surrounding whitespace).",
        )
    properties = {**proto.user_properties, UNIQ_KEY: system.message_id}
    if system.HasField("orphaned_transaction_recovery_duration"):
        # The client's own check immunity, as the proxy takes it.
        duration = system.orphaned_transaction_recovery_duration
        seconds = min(max(duration.seconds, 0), _MAX_RECOVERY_SECONDS)  # no overflow
        properties[PROPERTY_CHECK_IMMUNITY] = str(seconds)
    message = Message(
        topic=topic,
        body=body,
        tags=system.tag if system.HasField("tag") else None,
        keys=tuple(system.keys) or None,
        properties=properties,
    )
    try:
        return validate_message(message, max_body_bytes)
    except InvalidMessageError as exc:
        raise RequestError(Code.BAD_REQUEST, exc.message) from exc


def _check_properties(topic: str, properties: Mapping[str, str]) -> None:
    """Refuse the user properties RocketMQ's proxy refuses."""
    if len(properties) > MAX_USER_PROPERTIES:
        raise RequestError(
            Code.MESSAGE_PROPERTIES_TOO_LARGE,
            f"a message to {topic!r} has {len(properties)} properties; at most "
            f"{MAX_USER_PROPERTIES} are taken.",
        )
    for name, value in properties.items():
        if name in RESERVED_PROPERTIES or name.startswith(TRANSIENT_PREFIX):
            why = "is a RocketMQ system property"
        elif not name:
            why = "is empty"
        elif _CONTROL.search(name) or _CONTROL.search(value):
            why = "has a control character in its name or value"
        else:
            continue
        raise RequestError(
            Code.ILLEGAL_MESSAGE_PROPERTY_KEY,
            f"property {name!r} of a message to {topic!r} {why}; use another name (a delay "
            "or a check immunity is a system property of the client's message).",
        )


def _decoded_body(proto: pb.Message, max_body_bytes: int) -> bytes:
    """The body as sent, or unzipped (refused when it is or unzips to over the limit)."""
    body = proto.body
    if proto.system_properties.body_encoding == pb.GZIP:
        try:
            body = _unzipped(body, max_body_bytes)
        except zlib.error as exc:
            raise RequestError(
                Code.MESSAGE_CORRUPTED,
                f"the GZIP body of a message to {proto.topic.name!r} cannot be unzipped: {exc}",
            ) from exc
    if len(body) > max_body_bytes:
        raise RequestError(
            Code.MESSAGE_BODY_TOO_LARGE,
            f"the body of a message to {proto.topic.name!r} is over the limit of "
            f"{max_body_bytes} bytes (store.max_body_bytes); send smaller messages.",
        )
    return body


def _unzipped(body: bytes, limit: int) -> bytes:
    """Every GZIP member of ``body`` unzipped, one after the other (as Java's
    ``GZIPInputStream`` reads them), up to one byte over ``limit``.

    Raises
    ------
    zlib.error
        For a member that is not GZIP or ends before its end (a cut stream, which zlib alone
        would answer with the part it could unzip).
    """
    out = bytearray()
    while True:
        member = zlib.decompressobj(16 + zlib.MAX_WBITS)
        out += member.decompress(body, limit + 1 - len(out))
        if len(out) > limit:
            return bytes(out)
        if not member.eof:
            raise zlib.error("the stream ends before its GZIP trailer (cut short)")
        body = member.unused_data
        if not body:
            return bytes(out)


def check_command(row: Mapping[str, Any], transaction_id: str) -> service_pb.TelemetryCommand:
    """The ``RecoverOrphanedTransactionCommand`` for a pending half message (a ``half`` row)."""
    return service_pb.TelemetryCommand(
        recover_orphaned_transaction_command=service_pb.RecoverOrphanedTransactionCommand(
            message=stored_message(row, row["topic"], pb.TRANSACTION),
            transaction_id=transaction_id,
        )
    )


def stored_message(row: Mapping[str, Any], topic: str, message_type: int) -> pb.Message:
    """A stored message (a ``half`` or CommitLog row) as a client gets it.

    It carries what the client sent (its message id, tag, keys and properties), an IDENTITY
    encoding and an MD5 digest: MD5 in upper-case hex is what every official client computes
    alike (their CRC32 texts differ), and a client drops a message without a known encoding.
    """
    properties = dict(row["properties"] or {})
    message = pb.Message(body=row["body"])
    message.topic.name = topic
    message.user_properties.update(
        {k: v for k, v in properties.items() if k not in RESERVED_PROPERTIES}
    )
    system = message.system_properties
    system.message_id = properties.get(UNIQ_KEY, row["msg_id"])
    system.message_type = message_type
    system.body_encoding = pb.IDENTITY
    system.body_digest.type = pb.MD5
    system.body_digest.checksum = hashlib.md5(row["body"]).hexdigest().upper()
    system.queue_id = row["queue_id"]
    if row["tags"] is not None:
        system.tag = row["tags"]
    if row["keys"]:
        system.keys.extend(row["keys"].split(" "))
    system.born_timestamp.FromDatetime(row["born_timestamp"])
    system.store_timestamp.FromDatetime(row["store_timestamp"])
    return message


def settings_reply(
    client: pb.Settings, max_body_bytes: int, max_delivery_attempts: int
) -> service_pb.TelemetryCommand:
    """The server's answer to a client's settings: its topics echoed, the store's body limit
    (0 would make the Python client refuse every send), an exponential backoff (the Java, Go,
    C# and Node clients require one) and metrics off (on, clients would export them to the
    endpoints named here). A consumer gets its subscription back, not ordered, and as many
    attempts as its group's messages are delivered (a push consumer forwards a message to the
    dead-letter topic after its last)."""
    reply = pb.Settings()
    reply.client_type = client.client_type or pb.PRODUCER
    if client.HasField("access_point"):
        reply.access_point.CopyFrom(client.access_point)
    consumer = client.client_type in (pb.PUSH_CONSUMER, pb.SIMPLE_CONSUMER)
    if consumer:  # how long a push consumer waits before a failed message comes back
        reply.backoff_policy.max_attempts = max_delivery_attempts
        reply.backoff_policy.customized_backoff.next.extend(
            duration_pb2.Duration(seconds=s) for s in CONSUMER_BACKOFF_SECONDS
        )
    else:
        reply.backoff_policy.max_attempts = 3
        backoff = reply.backoff_policy.exponential_backoff
        backoff.initial.CopyFrom(duration_pb2.Duration(nanos=10_000_000))
        backoff.max.CopyFrom(duration_pb2.Duration(seconds=1))
        backoff.multiplier = 2.0
    if client.HasField("request_timeout"):
        reply.request_timeout.CopyFrom(client.request_timeout)
    else:
        reply.request_timeout.CopyFrom(duration_pb2.Duration(seconds=3))
    if consumer:
        reply.subscription.CopyFrom(client.subscription)
        reply.subscription.fifo = False
        reply.subscription.receive_batch_size = client.subscription.receive_batch_size or 32
    else:
        reply.publishing.topics.extend(client.publishing.topics)
        reply.publishing.max_body_size = max_body_bytes
        reply.publishing.validate_message_type = True
    reply.user_agent.CopyFrom(client.user_agent)
    reply.metric.on = False
    return service_pb.TelemetryCommand(status=status(Code.OK), settings=reply)
