"""The consumer side of RocketMQ 5's ``MessagingService`` over a store's consumer groups
(:mod:`rmq_spark.store.deliveries`): what the official clients' ``SimpleConsumer`` and
``PushConsumer`` call.

* ``QueryAssignment``: one assignment per topic, queue -1, as RocketMQ's proxy gives for "pop"
  consumption (the server picks the queues);
* ``ReceiveMessage``: up to ``batch_size`` committed messages of the topic that match the
  filter (``*`` or ``TagA || TagB``; SQL92 is refused), invisible to the group for
  ``invisible_duration`` (1 s to 12 h; 60 s when not given, as a push consumer's, renewed
  while the consumer works on them with ``auto_renew``), waiting up to
  ``long_polling_timeout`` (at most 30 s) for one;
  ``MESSAGE_NOT_FOUND`` when none came;
* ``AckMessage``, ``ChangeInvisibleDuration`` (a new receipt handle) and
  ``ForwardMessageToDeadLetterQueue``: ``INVALID_RECEIPT_HANDLE`` for a handle that is not
  the latest of its message or has expired.

Every call is checked against the signing account's ``subscribe`` and ``groups``
(:func:`rmq_spark.serve.accounts.check_subscribe`). Receives and acknowledgements of all
clients are group-committed: one Delta commit a batch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import grpc
from google.protobuf import duration_pb2
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as service_pb

from rmq_spark.group_commit import GroupCommitter
from rmq_spark.model.errors import InvalidMessageError, RmqSparkError
from rmq_spark.model.messages import TOPIC_MAX_LENGTH, check_group, is_tag
from rmq_spark.serve import calls
from rmq_spark.serve.accounts import Account, check_subscribe
from rmq_spark.serve.auth import authenticate
from rmq_spark.serve.protocol import (
    Code,
    RequestError,
    check_consumed_topic,
    status,
    stored_message,
)
from rmq_spark.store.deliveries import (
    Ack,
    ChangeInvisible,
    DeadLetter,
    InvalidHandleError,
    Receive,
    Received,
    Renew,
    Sweep,
    dead_letter_topic,
)

log = logging.getLogger("rmq_spark.serve.service")

#: How often messages whose last hand-out ended are dead-lettered.
_SWEEP_SECONDS = 1.0
#: How often a long-polling receive looks again for a message.
_POLL_SECONDS = 0.1
#: The invisible durations a receive may ask for (an extension may ask for 0: visible now).
_INVISIBLE_SECONDS = (1.0, 12 * 3600.0)
#: The invisible duration of a receive that asks for none (a push consumer's): the proxy's.
DEFAULT_INVISIBLE_SECONDS = 60.0
#: How long the messages of a receive with ``auto_renew`` are kept invisible at most while
#: their consumer works on them (renewed every third of their invisible duration).
_MAX_RENEW_SECONDS = 3600.0
#: The most messages one receive hands out (RocketMQ's clients ask for 32 at most by default).
MAX_RECEIVE_BATCH = 1024
#: How long a receive waits when the client says nothing (the clients' default), and at most.
_DEFAULT_POLLING_SECONDS, _MAX_POLLING_SECONDS = 20.0, 30.0
#: How much of a receive's deadline is kept for the reply to reach the client.
_REPLY_MARGIN_SECONDS = 1.0


def tag_filter(expression: pb.FilterExpression) -> frozenset[str] | None:
    """The tags a filter expression keeps (None: every message), as RocketMQ reads a TAG
    expression: ``*`` or tags joined with ``||``.

    Raises
    ------
    RequestError
        ``ILLEGAL_FILTER_EXPRESSION`` for an SQL92 expression or a tag that is not one.
    """
    if expression.type == pb.SQL:
        raise RequestError(
            Code.ILLEGAL_FILTER_EXPRESSION,
            "SQL92 filters are not supported by rmqtx serve; subscribe with a tag expression "
            "('*' or 'TagA || TagB').",
        )
    text = expression.expression.strip()
    if not text or text == "*":
        return None
    tags = [t.strip() for t in text.split("||")]
    if not all(is_tag(t) for t in tags):
        raise RequestError(
            Code.ILLEGAL_FILTER_EXPRESSION,
            f"filter expression {text[:80]!r} is not '*' or tags joined with '||'.",
        )
    return frozenset(tags)


def _seconds(duration: duration_pb2.Duration) -> float:
    return duration.seconds + duration.nanos / 1e9


def _group(name: str) -> str:
    try:
        check_group(name)
    except InvalidMessageError as exc:
        raise RequestError(Code.ILLEGAL_CONSUMER_GROUP, exc.message) from exc
    if len(dead_letter_topic(name)) > TOPIC_MAX_LENGTH:  # its dead letters need a topic name
        raise RequestError(
            Code.ILLEGAL_CONSUMER_GROUP,
            f"consumer group {name[:40]!r}... is {len(name)} characters long; a group that "
            f"consumes is at most {TOPIC_MAX_LENGTH - len(dead_letter_topic(''))} (its "
            "dead-letter topic is named after it).",
        )
    return name


def _invisible(duration: duration_pb2.Duration, low: float = _INVISIBLE_SECONDS[0]) -> float:
    high = _INVISIBLE_SECONDS[1]
    seconds = _seconds(duration)
    if not low <= seconds <= high:
        raise RequestError(
            Code.ILLEGAL_INVISIBLE_TIME,
            f"invisible duration {seconds:g} s is out of {low:g} s to {high:g} s.",
        )
    return seconds


def received_message(received: Received, topic: str, invisible_seconds: float) -> pb.Message:
    """A message handed out, as the client gets it: with its receipt handle, its delivery
    attempt, its offset and the invisible duration it was handed out for."""
    row, handout = received.message, received.handout
    kind = pb.TRANSACTION if row["transaction_id"] else pb.NORMAL
    message = stored_message(row, topic, kind)
    system = message.system_properties
    system.queue_offset = row["queue_offset"]
    system.receipt_handle = handout.handle
    system.delivery_attempt = handout.attempt
    system.invisible_duration.FromTimedelta(timedelta(seconds=invisible_seconds))
    return message


@dataclass
class _Renewal:
    """A hand-out kept invisible while its consumer works on it: until when at most, for how
    long each renewal, and when it was last renewed (event-loop times)."""

    stop: float
    seconds: float
    last: float


class ConsumerCalls:
    """The consumer calls of :class:`rmq_spark.serve.service.MessagingService` (a base class
    of it, which gives ``store``, ``accounts``, ``topics`` and ``endpoint``)."""

    store: Any
    accounts: Mapping[str, Account]
    topics: frozenset[str] | None
    endpoint: tuple[str, int]
    _consumers: GroupCommitter[Any, Any] | None = None
    #: The invisible duration of a receive that asks for none (a push consumer's).
    invisible_seconds: float = DEFAULT_INVISIBLE_SECONDS

    def start_consumers(self, max_batch: int, linger: float) -> None:
        """Start the group committer of consumer requests (blocking)."""
        #: Per client: (group, topic, handle) received with auto_renew, and its renewals.
        self._renewing: dict[str, dict[tuple[str, str, str], _Renewal]] = {}
        self._consumers = GroupCommitter(
            "rmqtx-serve-consumers", self.store.deliveries.handle, max_batch, linger, wave=False
        )

    def close_consumers(self) -> None:
        """Finish the consumer requests queued (blocking)."""
        if self._consumers is not None:
            self._consumers.close()

    async def upkeep(self, stop: asyncio.Event) -> None:
        """Until ``stop`` is set, every :data:`_SWEEP_SECONDS`: dead-letter the messages whose
        last hand-out ended unacknowledged (no consumer of their group may come again), and
        renew the hand-outs of receives with ``auto_renew`` that their consumers still work on
        and that are due (a third of their invisible duration after the last renewal). An error
        is logged and the next round tries again."""
        while not stop.is_set():
            try:
                with contextlib.suppress(RequestError):  # logged by _submit
                    await self._submit(Sweep())
                await self._renew()
            except Exception:
                log.exception("a round of dead-lettering and renewals failed; the next one retries")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _SWEEP_SECONDS)

    def _renew_while_consumed(self, client: str, receive: Receive, got: list[Received]) -> None:
        """Keep renewing what ``client`` received with ``auto_renew`` until it acknowledges
        it, asks for it again later (``ChangeInvisibleDuration``), goes away, or an hour."""
        now = asyncio.get_running_loop().time()
        renewal = _Renewal(now + _MAX_RENEW_SECONDS, receive.invisible_seconds, now)
        mine = self._renewing.setdefault(client, {})
        for r in got:
            mine[(receive.group, receive.topic, r.handout.handle)] = renewal

    def _consumed(self, group: str, topic: str, handle: str) -> None:
        """Renew ``handle`` no more (acknowledged, extended, dead-lettered)."""
        for mine in self._renewing.values():
            mine.pop((group, topic, handle), None)

    def forget_client(self, client: str) -> None:
        """``client`` went away: what it received with ``auto_renew`` comes back when its
        invisible duration ends."""
        self._renewing.pop(client, None)

    async def _renew(self) -> None:
        now = asyncio.get_running_loop().time()
        due = []
        for client, mine in self._renewing.items():
            for key, renewal in list(mine.items()):
                if renewal.stop <= now:
                    del mine[key]
                elif renewal.last + renewal.seconds / 3 - _SWEEP_SECONDS <= now:
                    due.append((client, key, renewal))
        if not due:
            return
        # At least 10 rounds long, so that the next renewal lands before it ends even on a
        # loaded machine.
        results = await asyncio.gather(
            *(self._submit(Renew(*key, max(r.seconds, 10 * _SWEEP_SECONDS))) for _, key, r in due),
            return_exceptions=True,
        )
        for (client, key, renewal), result in zip(due, results, strict=True):
            if isinstance(result, InvalidHandleError):  # done, or expired: renewed no more
                self._renewing.get(client, {}).pop(key, None)
            elif not isinstance(result, BaseException):  # else retried next round
                renewal.last = now

    async def _submit(self, request: Any) -> Any:
        assert self._consumers is not None
        try:
            return await calls.result(self._consumers.submit(request))
        except InvalidHandleError as exc:  # this request's alone: its caller is told
            return exc
        except RmqSparkError as exc:
            log.error("a consumer request failed: %s", exc)
            raise RequestError(Code.INTERNAL_SERVER_ERROR, str(exc)) from exc

    def _subscriber(self, account: Account | None, topic: pb.Resource, group: pb.Resource) -> str:
        check_consumed_topic(topic.name, self.topics)
        name = _group(group.name)
        check_subscribe(account, topic.name, name)
        return name

    @calls.signed(service_pb.QueryAssignmentResponse)
    async def QueryAssignment(
        self,
        request: service_pb.QueryAssignmentRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.QueryAssignmentResponse:
        self._subscriber(account, request.topic, request.group)
        endpoints = request.endpoints
        if not endpoints.addresses:
            host, port = self.endpoint
            endpoints = pb.Endpoints(scheme=pb.IPv4, addresses=[pb.Address(host=host, port=port)])
        queue = pb.MessageQueue(
            topic=request.topic,
            id=-1,  # the server picks the queues (RocketMQ's "pop")
            permission=pb.READ_WRITE,
            broker=pb.Broker(name="rmqtx", id=0, endpoints=endpoints),
            accept_message_types=[pb.NORMAL, pb.TRANSACTION],
        )
        return service_pb.QueryAssignmentResponse(
            status=status(Code.OK), assignments=[pb.Assignment(message_queue=queue)]
        )

    async def ReceiveMessage(
        self, request: service_pb.ReceiveMessageRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[service_pb.ReceiveMessageResponse]:
        try:
            account = authenticate(calls.metadata(context), self.accounts)
            topic = request.message_queue.topic
            group = self._subscriber(account, topic, request.group)
            receive = Receive(
                group,
                topic.name,
                tag_filter(request.filter_expression),
                min(max(request.batch_size, 1), MAX_RECEIVE_BATCH),
                _invisible(request.invisible_duration)
                if request.HasField("invisible_duration")
                else self.invisible_seconds,
            )
            got = await self._poll(receive, request, context)
        except RequestError as exc:
            log.info("ReceiveMessage refused: %s", exc.message)
            yield service_pb.ReceiveMessageResponse(status=status(exc.code, exc.message))
            return
        if not got:
            yield service_pb.ReceiveMessageResponse(
                status=status(Code.MESSAGE_NOT_FOUND, "no new message")
            )
            return
        delivered = service_pb.ReceiveMessageResponse()
        delivered.delivery_timestamp.GetCurrentTime()
        yield delivered
        for received in got:
            yield service_pb.ReceiveMessageResponse(
                message=received_message(received, receive.topic, receive.invisible_seconds)
            )
        yield service_pb.ReceiveMessageResponse(status=status(Code.OK))
        if request.auto_renew:  # the client has them (a reply it never got is not renewed)
            client = calls.metadata(context).get("x-mq-client-id", "")
            self._renew_while_consumed(client, receive, got)

    async def _poll(
        self,
        receive: Receive,
        request: service_pb.ReceiveMessageRequest,
        context: grpc.aio.ServicerContext,
    ) -> list[Received]:
        """Receive, again every :data:`_POLL_SECONDS` until a message comes or the long
        polling timeout (within the call's deadline) ends."""
        loop = asyncio.get_running_loop()
        wait = (
            min(_seconds(request.long_polling_timeout), _MAX_POLLING_SECONDS)
            if request.HasField("long_polling_timeout")
            else _DEFAULT_POLLING_SECONDS
        )
        remaining = context.time_remaining()
        if remaining is not None:
            wait = min(wait, remaining - _REPLY_MARGIN_SECONDS)
        deadline = loop.time() + wait
        while True:
            got = await self._submit(receive)
            if got or loop.time() + _POLL_SECONDS > deadline:
                return got
            await asyncio.sleep(_POLL_SECONDS)

    @calls.signed(service_pb.AckMessageResponse)
    async def AckMessage(
        self,
        request: service_pb.AckMessageRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.AckMessageResponse:
        group = self._subscriber(account, request.topic, request.group)
        results = await asyncio.gather(
            *(self._ack(Ack(group, request.topic.name, e.receipt_handle)) for e in request.entries)
        )
        entries = [
            service_pb.AckMessageResultEntry(
                message_id=e.message_id, receipt_handle=e.receipt_handle, status=_status_of(r)
            )
            for e, r in zip(request.entries, results, strict=True)
        ]
        codes = {e.status.code for e in entries}
        overall = (
            entries[0].status
            if len(codes) == 1 and entries
            else status(Code.MULTIPLE_RESULTS if entries else Code.OK)
        )
        return service_pb.AckMessageResponse(status=overall, entries=entries)

    async def _ack(self, ack: Ack) -> Any:
        self._consumed(ack.group, ack.topic, ack.handle)
        return await self._acknowledge(ack)

    async def _acknowledge(self, ack: Ack) -> Any:
        """Acknowledge: at once when the handle is the latest of a message in flight as this
        server knows it, the commit following in the next batch (as RocketMQ's broker writes
        an acknowledgement after answering it: killed before, the message comes back after its
        invisible duration); otherwise after the batch that checks it against the table."""
        assert self._consumers is not None
        if not self.store.deliveries.in_flight_here(ack.group, ack.topic, ack.handle):
            return await self._submit(ack)
        self._consumers.submit(ack).add_done_callback(_acknowledged)
        return None

    @calls.signed(service_pb.ChangeInvisibleDurationResponse)
    async def ChangeInvisibleDuration(
        self,
        request: service_pb.ChangeInvisibleDurationRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.ChangeInvisibleDurationResponse:
        group = self._subscriber(account, request.topic, request.group)
        change = ChangeInvisible(
            group,
            request.topic.name,
            request.receipt_handle,
            _invisible(request.invisible_duration, low=0.0),
        )
        self._consumed(group, request.topic.name, request.receipt_handle)
        handle = _handled(await self._submit(change))
        return service_pb.ChangeInvisibleDurationResponse(
            status=status(Code.OK), receipt_handle=handle
        )

    @calls.signed(service_pb.ForwardMessageToDeadLetterQueueResponse)
    async def ForwardMessageToDeadLetterQueue(
        self,
        request: service_pb.ForwardMessageToDeadLetterQueueRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.ForwardMessageToDeadLetterQueueResponse:
        group = self._subscriber(account, request.topic, request.group)
        self._consumed(group, request.topic.name, request.receipt_handle)
        _handled(await self._submit(DeadLetter(group, request.topic.name, request.receipt_handle)))
        return service_pb.ForwardMessageToDeadLetterQueueResponse(status=status(Code.OK))


def _acknowledged(slot: Any) -> None:
    """The outcome of an acknowledgement answered before its commit."""
    error = slot.exception()
    if error is not None:
        log.warning("an acknowledgement answered OK was not recorded: %s", error)
        return
    if isinstance(slot.result(), InvalidHandleError):
        log.info("an acknowledgement answered OK came too late: %s", slot.result().message)


def _handled(result: Any) -> Any:
    """A result, or its invalid handle raised as the client's error."""
    if isinstance(result, InvalidHandleError):
        raise RequestError(Code.INVALID_RECEIPT_HANDLE, result.message)
    return result


def _status_of(result: Any) -> pb.Status:
    if isinstance(result, InvalidHandleError):
        return status(Code.INVALID_RECEIPT_HANDLE, result.message)
    return status(Code.OK)
