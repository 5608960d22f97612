"""RocketMQ 5's ``MessagingService`` (producer side) over an rmq-spark store.

Each call becomes the store's own operation:

* ``QueryRoute``: the store's queues (of the shard this server writes to) as the route, with
  the endpoint the client used as the broker, so that a client reaching the server by any name
  keeps using that name;
* ``SendMessage``: a NORMAL message is published at once (like :meth:`Store.send`); a
  TRANSACTION message is a half message, durable before the reply. Sends are group-committed:
  one Delta commit carries every send that arrived while the previous one was written;
* ``EndTransaction``: COMMIT or ROLLBACK; the first decision wins. A repeated identical
  decision is OK; an unknown transaction, or one already decided the other way, is refused
  with ``INVALID_TRANSACTION_ID``. An answer to a check (source ``SOURCE_SERVER_CHECK``) is
  recorded as decided by ``check-back:client``;
* ``Telemetry``: settings sync, and the stream check-back writes to
  (:mod:`rmq_spark.serve.recovery`);
* ``Heartbeat`` and ``NotifyClientTermination``: acknowledged.

**The producer group is the topic.** RocketMQ 5 clients send no producer group; RocketMQ's
proxy registers a producer under each of its topics and stamps half messages with the topic
as their group, so check-back asks the clients of that topic. The server does the same.

**Retried sends are stored once per process.** A client retries a send that failed or timed
out with the same message id; a retry of a send in flight or done (the same topic, message id,
type, tag, keys, properties and body, among the last :data:`REMEMBERED_SENDS` sends) gets the
first send's result, so a retried half message never becomes a second transaction. Another
message that reuses a message id is stored, as RocketMQ's proxy does. Retries reaching
another ``rmqtx serve`` process are not recognised.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass

import grpc
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as service_pb
from rocketmq.grpc_protocol import service_pb2_grpc as service_grpc

from rmq_spark.model.errors import RmqSparkError
from rmq_spark.model.messages import LocalTransactionState, Message, is_topic, shard_of
from rmq_spark.serve import calls
from rmq_spark.serve.accounts import Account, check_publish, check_route
from rmq_spark.serve.auth import authenticate
from rmq_spark.serve.consuming import ConsumerCalls
from rmq_spark.serve.protocol import (
    UNIQ_KEY,
    Code,
    RequestError,
    check_consumed_topic,
    settings_reply,
    status,
    to_messages,
)
from rmq_spark.serve.recovery import Client, Clients
from rmq_spark.serve.writes import LINGER_SECONDS, ServerWrites
from rmq_spark.store.decisions import Decision, EndTransactionResult, EndTransactionStatus
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: How many sends (topic, message id) a process remembers to recognise retries.
REMEMBERED_SENDS = 100_000
#: How many of its own open transactions a process remembers (others are looked up in the
#: store when they are ended).
REMEMBERED_TRANSACTIONS = 100_000
#: Settings replies are not queued for a client with this many commands unread.
_MAX_OUTBOX = 64
#: Who decided, in ``op``, a transaction ended by a client's answer to a check.
DECIDED_BY_CLIENT_CHECK = "check-back:client"
_RESOLUTIONS = {
    pb.COMMIT: LocalTransactionState.COMMIT,
    pb.ROLLBACK: LocalTransactionState.ROLLBACK,
}


@dataclass
class Counters:
    """What a server did, for its summary at stop."""

    sends: int = 0
    committed: int = 0
    rolled_back: int = 0


#: What a pull consumer's call is answered.
_NO_PULL = (
    "pull consumption (PullMessage and consumer offsets) is not served by rmqtx serve: use a "
    'SimpleConsumer or a PushConsumer, or read with Spark, spark.readStream.format("rmqtx").'
)


class MessagingService(ConsumerCalls, service_grpc.MessagingServiceServicer):
    """The ``MessagingService`` servicer (for ``grpc.aio``) over one store.

    Parameters
    ----------
    store : Store
        The store's root.
    topics : frozenset of str, optional
        The topics served; None serves every valid topic name.
    accounts : mapping of str to Account
        By access key (:mod:`rmq_spark.serve.accounts`); empty accepts unsigned requests.
    clients : Clients
        The registry of telemetry streams, shared with the check-back loop.
    endpoint : tuple of (str, int)
        The server's own host and port, the broker of a route when the client named none.
    max_batch : int, default 1024
        Most sends or decisions in one Delta commit.

    Notes
    -----
    The method names are gRPC's. Call :meth:`start` before serving and :meth:`close` after
    the gRPC server stopped.
    """

    def __init__(
        self,
        store: Store,
        *,
        topics: frozenset[str] | None,
        accounts: Mapping[str, Account],
        clients: Clients,
        endpoint: tuple[str, int],
        max_batch: int = 1024,
    ) -> None:
        self.store = store
        self.topics = topics
        self.accounts = dict(accounts)
        self.clients = clients
        self.endpoint = endpoint
        self.counters = Counters()
        self._max_batch = max_batch
        self._max_body = store.settings.max_body_bytes
        self._writes = ServerWrites(store, max_batch)
        #: Sends in flight or done, by :func:`_retry_key`.
        self._sends: OrderedDict[bytes, asyncio.Task[service_pb.SendResultEntry]] = OrderedDict()
        #: This process's open transactions: their producer group and topics.
        self._transactions: OrderedDict[str, tuple[str, frozenset[str]]] = OrderedDict()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the store's writes (:class:`ServerWrites`: the shard to write to is picked
        as a producer process does) and the consumers' (blocking)."""
        self._writes.start()
        self.start_consumers(self._max_batch, LINGER_SECONDS)

    async def finish_sends(self) -> None:
        """Wait for the sends under way (their clients may have gone)."""
        running = [t for t in self._sends.values() if not t.done()]
        if running:
            await asyncio.wait(running)

    def close(self) -> None:
        """Finish the writes under way and publish this server's COMMITs (blocking)."""
        self.close_consumers()
        self._writes.close()

    # -------------------------------------------------------------- routes, liveness
    @calls.signed(service_pb.QueryRouteResponse)
    async def QueryRoute(
        self,
        request: service_pb.QueryRouteRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.QueryRouteResponse:
        check_consumed_topic(request.topic.name, self.topics)  # a dead-letter topic too
        check_route(account, request.topic.name)
        endpoints = request.endpoints
        if not endpoints.addresses:
            host, port = self.endpoint
            endpoints = pb.Endpoints(scheme=pb.IPv4, addresses=[pb.Address(host=host, port=port)])
        broker = pb.Broker(name="rmqtx", id=0, endpoints=endpoints)  # id 0: a master
        queues = [
            pb.MessageQueue(
                topic=request.topic,
                id=self._writes.writer.queue_base + i,
                permission=pb.READ_WRITE,
                broker=broker,
                accept_message_types=[pb.NORMAL, pb.TRANSACTION],
            )
            for i in range(self._writes.writer.settings.queue_nums)
        ]
        return service_pb.QueryRouteResponse(status=status(Code.OK), message_queues=queues)

    @calls.signed(service_pb.HeartbeatResponse)
    async def Heartbeat(
        self,
        request: service_pb.HeartbeatRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.HeartbeatResponse:
        return service_pb.HeartbeatResponse(status=status(Code.OK))

    @calls.signed(service_pb.NotifyClientTerminationResponse)
    async def NotifyClientTermination(
        self,
        request: service_pb.NotifyClientTerminationRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.NotifyClientTerminationResponse:
        log.info("client %s terminated", calls.metadata(context).get("x-mq-client-id"))
        return service_pb.NotifyClientTerminationResponse(status=status(Code.OK))

    # -------------------------------------------------------------- telemetry
    async def Telemetry(
        self,
        request_iterator: AsyncIterator[service_pb.TelemetryCommand],
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[service_pb.TelemetryCommand]:
        metadata = calls.metadata(context)
        try:
            account = authenticate(metadata, self.accounts)
        except RequestError as exc:
            log.warning("refused a telemetry stream from %s: %s", context.peer(), exc.message)
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, exc.message)
        client_id = metadata.get("x-mq-client-id") or uuid.uuid4().hex
        client = self.clients.connect(client_id, account)
        log.info("client %s connected (%s)", client.client_id, context.peer())
        reader = asyncio.create_task(self._read_telemetry(request_iterator, client, account))
        try:
            while (command := await client.outbox.get()) is not None:
                yield command
        finally:
            reader.cancel()
            if self.clients.disconnect(client):  # gone, not reconnected
                self.forget_client(client.client_id)
            log.info("client %s disconnected", client.client_id)

    async def _read_telemetry(
        self,
        commands: AsyncIterator[service_pb.TelemetryCommand],
        client: Client,
        account: Account | None,
    ) -> None:
        try:
            async for command in commands:
                if command.WhichOneof("command") == "settings":
                    topics = [t.name for t in command.settings.publishing.topics]
                    self._note_topics(client.client_id, account, topics)
                    if client.outbox.qsize() < _MAX_OUTBOX:  # else it does not read them
                        client.outbox.put_nowait(
                            settings_reply(
                                command.settings,
                                self._max_body,
                                self.store.deliveries.max_attempts,
                            )
                        )
                else:
                    log.debug("client %s sent %s", client.client_id, command.WhichOneof("command"))
        except (grpc.aio.AioRpcError, asyncio.CancelledError):
            pass  # the stream ended; the writer below ends too
        finally:
            client.outbox.put_nowait(None)

    # -------------------------------------------------------------- sends
    @calls.signed(service_pb.SendMessageResponse)
    async def SendMessage(
        self,
        request: service_pb.SendMessageRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.SendMessageResponse:
        if not request.messages:
            return service_pb.SendMessageResponse(
                status=status(Code.MESSAGE_CORRUPTED, "the request has no message to send.")
            )
        try:
            messages = to_messages(request.messages, self.topics, self._max_body)
        except RequestError as exc:
            log.info("send request refused: %s", exc.message)
            return service_pb.SendMessageResponse(status=status(exc.code, exc.message))
        client_id = calls.metadata(context).get("x-mq-client-id", "")
        entries = await asyncio.gather(
            *(
                self._send(p, m, client_id, account)
                for p, m in zip(request.messages, messages, strict=True)
            )
        )
        codes = {e.status.code for e in entries}
        overall = (
            entries[0].status
            if len(codes) == 1
            else status(Code.MULTIPLE_RESULTS, "the messages have different results")
        )
        return service_pb.SendMessageResponse(status=overall, entries=entries)

    async def _send(
        self,
        proto: pb.Message,
        message: Message | RequestError,
        client_id: str,
        account: Account | None,
    ) -> service_pb.SendResultEntry:
        try:
            if isinstance(message, RequestError):
                raise message
            check_publish(account, message.topic)
        except RequestError as exc:
            log.info("send to %r refused: %s", proto.topic.name, exc.message)
            return service_pb.SendResultEntry(status=status(exc.code, exc.message))
        self._note_topics(client_id, account, [message.topic])
        transactional = proto.system_properties.message_type == pb.TRANSACTION
        key = _retry_key(message, transactional, account)
        task = self._sends.get(key)
        if task is None:
            task = asyncio.create_task(self._store(key, message, transactional))
            self._sends[key] = task
            while len(self._sends) > REMEMBERED_SENDS:
                self._sends.popitem(last=False)
        else:
            log.info(
                "send of message %s to %r retried: answered once",
                message.properties[UNIQ_KEY],
                message.topic,
            )
        # Shielded: a client giving up on its call must not stop the store's write.
        return await asyncio.shield(task)

    async def _store(
        self, key: bytes, message: Message, transactional: bool
    ) -> service_pb.SendResultEntry:
        """Store one message (the send's task, shared with its retries)."""
        group = message.topic
        message_id = message.properties[UNIQ_KEY]
        try:
            if transactional:
                prepared = await calls.result(self._writes.prepare(message, group))
                self._remember_transaction(prepared.transaction_id, group, message.topic)
                entry = service_pb.SendResultEntry(
                    message_id=message_id, transaction_id=prepared.transaction_id
                )
            else:
                sent = await calls.result(self._writes.end((message, group)))
                if isinstance(sent, Exception):
                    raise sent  # the publish of this batch's normal messages failed
                _, _, offset = sent
                entry = service_pb.SendResultEntry(message_id=message_id, offset=offset)
        except Exception as exc:
            log.exception("storing message %s of topic %r failed", message_id, message.topic)
            if self._sends.get(key) is asyncio.current_task():
                del self._sends[key]  # a retry tries again
            return service_pb.SendResultEntry(
                status=status(
                    Code.INTERNAL_ERROR, f"the store failed to write the message ({exc}); retry."
                )
            )
        self.counters.sends += 1
        entry.status.CopyFrom(status(Code.OK))
        return entry

    def _note_topics(self, client_id: str, account: Account | None, topics: list[str]) -> None:
        """Have the client asked about the open transactions of those of ``topics`` its
        account may be asked about."""
        asked = [
            t
            for t in topics
            if is_topic(t)
            and (self.topics is None or t in self.topics)
            and (account is None or account.may_be_asked(t))
        ]
        if len(asked) < len(topics):
            log.info(
                "client %s (account %r) is not asked about topic(s) %s",
                client_id,
                account and account.access_key,
                ", ".join(sorted(set(topics) - set(asked))),
            )
        self.clients.note_topics(client_id, account, asked)

    def _remember_transaction(self, transaction_id: str, group: str, topic: str) -> None:
        self._transactions[transaction_id] = (group, frozenset([topic]))
        while len(self._transactions) > REMEMBERED_TRANSACTIONS:
            self._transactions.popitem(last=False)

    # -------------------------------------------------------------- transactions
    @calls.signed(service_pb.EndTransactionResponse)
    async def EndTransaction(
        self,
        request: service_pb.EndTransactionRequest,
        context: grpc.aio.ServicerContext,
        account: Account | None,
    ) -> service_pb.EndTransactionResponse:
        outcome = await self._end_transaction(request, account)
        return service_pb.EndTransactionResponse(status=status(Code.OK, outcome))

    async def _end_transaction(
        self, request: service_pb.EndTransactionRequest, account: Account | None
    ) -> str:
        """Decide the transaction; return what happened, or raise :class:`RequestError`."""
        transaction_id = request.transaction_id
        if not transaction_id:
            raise RequestError(Code.INVALID_TRANSACTION_ID, "the request has no transaction_id.")
        state = _RESOLUTIONS.get(request.resolution)
        if state is None:
            return "no resolution: the transaction stays open for check-back"
        owner = self._transactions.get(transaction_id)
        if owner is None:
            loop = asyncio.get_running_loop()
            owner = await loop.run_in_executor(None, self._owner_of, transaction_id)
        if owner is None:
            raise RequestError(
                Code.INVALID_TRANSACTION_ID,
                f"unknown transaction {transaction_id!r}: the store has no half message with "
                "this id; end the transaction_id that the transactional send returned.",
            )
        group, topics = owner
        for topic in sorted(topics):  # its messages' topics, whatever the request names
            check_publish(account, topic)
        # An answer to a check this server sent is a check answer: the Go client sends no source.
        by_check = request.source == pb.SOURCE_SERVER_CHECK or (
            request.source != pb.SOURCE_CLIENT and self.clients.was_asked(transaction_id)
        )
        decided_by = DECIDED_BY_CLIENT_CHECK if by_check else "producer"
        result: EndTransactionResult = await calls.result(
            self._writes.end(Decision(transaction_id, group, state, decided_by))
        )
        if result.status is EndTransactionStatus.NOT_FOUND:  # retention removed it meanwhile
            raise RequestError(
                Code.INVALID_TRANSACTION_ID,
                f"unknown transaction {transaction_id!r}: the store no longer holds its half "
                "message (retention removed it after its decision); nothing was recorded.",
            )
        if result.status is EndTransactionStatus.REFUSED:
            raise RequestError(
                Code.INVALID_TRANSACTION_ID,
                f"transaction {transaction_id!r} is already {result.decision.value}; the first "
                f"decision wins, so {state.value} is refused.",
            )
        if result.status is EndTransactionStatus.APPLIED:
            self._transactions.pop(transaction_id, None)
            if state is LocalTransactionState.COMMIT:
                self.counters.committed += 1
            else:
                self.counters.rolled_back += 1
            log.debug("transaction %s: %s by %s", transaction_id, state.value, decided_by)
        return f"{state.value} {result.status.value.lower()}"

    def _owner_of(self, transaction_id: str) -> tuple[str, frozenset[str]] | None:
        """The producer group and the topics of a transaction the store holds, or None
        (blocking)."""
        try:
            shard = self.store.shard_store(shard_of(transaction_id))
        except RmqSparkError:
            return None  # a shard the store does not have
        halves = shard.half_messages([transaction_id], staged=True)
        if not halves.num_rows:
            return None
        group = halves.column("producer_group")[0].as_py()
        return group, frozenset(halves.column("topic").to_pylist())

    # -------------------------------------------------------------- not served
    RecallMessage = calls.unsupported(
        service_pb.RecallMessageResponse,
        "recalling a message is not supported: a transactional send is recalled by rolling "
        "its transaction back; a normal message is in the CommitLog once sent.",
    )
    PullMessage = calls.unsupported(service_pb.PullMessageResponse, _NO_PULL, stream=True)
    UpdateOffset = calls.unsupported(service_pb.UpdateOffsetResponse, _NO_PULL)
    GetOffset = calls.unsupported(service_pb.GetOffsetResponse, _NO_PULL)
    QueryOffset = calls.unsupported(service_pb.QueryOffsetResponse, _NO_PULL)
    SyncLiteSubscription = calls.unsupported(service_pb.SyncLiteSubscriptionResponse, _NO_PULL)


def _retry_key(message: Message, transactional: bool, account: Account | None) -> bytes:
    """What a retry of a send has in common with it: its account and the whole message (its
    client message id included, in the properties), not only the id, which a client may
    reuse."""
    digest = hashlib.sha256(message.body_bytes)
    signer = account.access_key if account else None
    fields = (signer, message.topic, transactional, message.tags, message.keys_string)
    digest.update(repr((fields, sorted(message.properties.items()))).encode())
    return digest.digest()
