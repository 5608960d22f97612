"""The transactional producer API for services, after RocketMQ's ``TransactionMQProducer``.

Example
-------
>>> class OrderListener(TransactionListener):
...     def execute_local_transaction(self, msg, arg):
...         save_order(arg)                      # the local transaction
...         return LocalTransactionState.COMMIT
...     def check_local_transaction(self, msg):
...         return LocalTransactionState.COMMIT if order_exists(msg.keys) else \\
...             LocalTransactionState.UNKNOWN
>>> with TransactionMQProducer("order-service", OrderListener(), path="storage") as producer:
...     result = producer.send_message_in_transaction(Message("Orders", b"..."), arg=order)

Many threads may share one producer. Their half messages are group-committed: each Delta
commit carries every message that arrived while the previous commit was being written, so
throughput grows with concurrency instead of collapsing to one commit per message.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

from rmq_spark.group_commit import GroupCommitter, Slot
from rmq_spark.model.config import Settings, load_settings
from rmq_spark.model.errors import InvalidOptionError, ProducerStateError
from rmq_spark.model.messages import (
    LocalTransactionState,
    Message,
    MessageExt,
    check_group,
    validate_message,
)
from rmq_spark.store.decisions import Decision, EndTransactionResult, PreparedMessage
from rmq_spark.store.facade import Store
from rmq_spark.store.publish_loop import (
    BackgroundPublisher,
    end_in_background,
    publish_own,
    publisher_for,
)

log = logging.getLogger(__name__)

#: Concurrent senders come back in waves (all of one commit's senders at once, for their half
#: messages and then for their decisions); waiting this long for the wave merges it into the
#: next commit instead of splitting senders into two alternating half-size batches.
_LINGER_SECONDS = 0.003


class SendStatus(StrEnum):
    """RocketMQ's send status. Failures raise exceptions instead of returning a status."""

    SEND_OK = "SEND_OK"


class TransactionListener(ABC):
    """The application's side of a transaction (RocketMQ's ``TransactionListener``)."""

    @abstractmethod
    def execute_local_transaction(self, msg: MessageExt, arg: Any) -> LocalTransactionState:
        """Run the local transaction after the half message is durable.

        Parameters
        ----------
        msg : MessageExt
            The half message (with its ``msg_id`` and ``transaction_id``).
        arg : Any
            The ``arg`` given to :meth:`TransactionMQProducer.send_message_in_transaction`.

        Returns
        -------
        LocalTransactionState
            ``COMMIT``, ``ROLLBACK`` or ``UNKNOWN`` (or a name that
            :meth:`LocalTransactionState.coerce` recognises, RocketMQ's ``"COMMIT_MESSAGE"``
            included). Raising, or returning anything else (``None``, ``"commit"``...),
            counts as ``UNKNOWN``: the check-back job asks again later.
        """

    @abstractmethod
    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        """Answer a check-back: what became of the local transaction of ``msg``?

        Must be idempotent and answer from durable state (the local database), since it may
        run in another process long after the send. Raising counts as ``UNKNOWN``.
        """


@dataclass(frozen=True)
class SendResult:
    """Result of a normal send."""

    send_status: SendStatus
    msg_id: str
    topic: str
    queue_id: int
    queue_offset: int


@dataclass(frozen=True)
class TransactionSendResult:
    """Result of :meth:`TransactionMQProducer.send_message_in_transaction`.

    ``local_transaction_state`` is what the listener answered. The end-transaction request
    is sent asynchronously, as RocketMQ's oneway ``endTransaction`` is; call
    :meth:`TransactionMQProducer.flush` to wait until it is recorded in ``op`` and published.
    """

    send_status: SendStatus
    msg_id: str
    transaction_id: str
    topic: str
    queue_id: int
    local_transaction_state: LocalTransactionState


class TransactionMQProducer:
    """A transactional producer bound to a producer group and a store.

    Parameters
    ----------
    producer_group : str
        The producer group; check-backs for its transactions are routed by this name.
    listener : TransactionListener, optional
        Runs and checks local transactions. Required for
        :meth:`send_message_in_transaction`.
    store : Store, optional
        An open store. Give either ``store`` or ``path``.
    path : str or Path, optional
        Store root to open (created on first use).
    settings : Settings, optional
        Settings used when opening ``path`` (default: the settings file, found as
        :func:`rmq_spark.model.config.load_settings` finds it, so its storage options apply).
    max_batch : int, default 1024
        Most messages group-committed in one Delta commit.

    Notes
    -----
    Use it as a context manager, or call :meth:`start` and :meth:`shutdown`. ``shutdown``
    lets every send already under way finish (half message, local transaction, decision
    recorded) and refuses sends that start after it, before they write anything.
    """

    def __init__(
        self,
        producer_group: str,
        listener: TransactionListener | None = None,
        *,
        store: Store | None = None,
        path: str | Path | None = None,
        settings: Settings | None = None,
        max_batch: int = 1024,
    ) -> None:
        self.producer_group = check_group(producer_group)
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise InvalidOptionError(
                f"max_batch needs to be an int of at least 1 but got {max_batch!r} "
                f"({type(max_batch).__name__})."
            )
        self.listener = listener
        self.store = store or Store.open(path, settings=settings or load_settings())
        #: The shard this producer writes to while started (the store itself, unless it has
        #: several shards: :func:`publisher_for`).
        self._writer = self.store
        self._max_batch = max_batch
        self._prepare: GroupCommitter[Message, PreparedMessage] | None = None
        self._end: GroupCommitter[Decision | Message, Any] | None = None
        self._publisher: BackgroundPublisher | None = None
        self._pending: set[Slot[Any]] = set()
        #: Guards the committers, ``_pending``, ``_in_flight`` and ``_closing``; never held
        #: while waiting on a committer, whose completion callbacks take it.
        self._lock = threading.Condition()
        #: Operations (sends, end-transactions) admitted and not finished yet.
        self._in_flight = 0
        self._closing = False
        self._local = threading.local()

    # -------------------------------------------------------------- lifecycle
    def start(self) -> TransactionMQProducer:
        """Start the background committers. Returns ``self``."""
        with self._lock:
            self._lock.wait_for(lambda: not self._closing)
            if self._prepare is None:
                self._publisher = publisher_for(self.store)
                self._writer = self._publisher.writer
                self._writer.maintain_in_background()
                self._prepare = GroupCommitter(
                    f"rmqtx-prepare-{self.producer_group}",
                    self._prepare_batch,
                    self._max_batch,
                    linger=_LINGER_SECONDS,
                )
                self._end = GroupCommitter(
                    f"rmqtx-end-{self.producer_group}",
                    self._end_batch,
                    self._max_batch,
                    linger=_LINGER_SECONDS,
                )
        return self

    def shutdown(self) -> None:
        """Finish the sends under way, then stop the background committers.

        Sends that have started complete normally: their half message is written, their
        local transaction runs, and their COMMIT or ROLLBACK is recorded and published before
        ``shutdown`` returns, as are the compactions their commits asked for (done on
        a background thread, so that no send waits for one). Sends that start after
        ``shutdown`` was called raise :class:`ProducerStateError` before anything is written,
        so retrying them elsewhere is safe. A no-op on a producer that is not started.

        Raises
        ------
        ProducerStateError
            When called from inside a listener of this producer (it would wait for itself).
        """
        if getattr(self._local, "depth", 0):
            raise ProducerStateError(
                f"shutdown() of producer {self.producer_group!r} was called from inside one of "
                "its own sends (a TransactionListener); call it from another thread."
            )
        with self._lock:
            self._lock.wait_for(lambda: not self._closing)
            if self._prepare is None or self._end is None or self._publisher is None:
                return
            self._closing = True
            self._lock.wait_for(lambda: self._in_flight == 0)
            committers, publisher = (self._prepare, self._end), self._publisher
        try:
            # Nothing can be submitted any more: closing drains what is queued, decisions
            # included, and completion callbacks can take the lock meanwhile.
            for committer in committers:
                committer.close()
            publisher.stop()
            publish_own(self._writer, "this producer")
            self._writer.finish_maintenance()
        finally:
            with self._lock:
                self._prepare = self._end = self._publisher = None
                self._closing = False
                self._lock.notify_all()

    def __enter__(self) -> TransactionMQProducer:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def flush(self, timeout: float | None = None) -> None:
        """Block until every end-transaction sent so far is recorded in ``op`` and what it
        committed is published (visible to consumers), or ``timeout`` seconds went by."""
        with self._lock:
            pending = list(self._pending)
        deadline = None if timeout is None else time.monotonic() + timeout
        for slot in pending:
            if not slot.wait(None if deadline is None else deadline - time.monotonic()):
                return
        publish_own(self._writer, "this producer")

    @contextmanager
    def _admitted(
        self,
    ) -> Iterator[tuple[GroupCommitter[Message, PreparedMessage], GroupCommitter[Any, Any]]]:
        """Admit one operation: the committers stay up until it ends (``shutdown`` waits)."""
        with self._lock:
            prepare, end = self._prepare, self._end
            if self._closing or prepare is None or end is None:
                state = "shutting down" if self._closing else "not started (or shut down)"
                raise ProducerStateError(
                    f"producer {self.producer_group!r} is {state}; nothing was sent. Call "
                    "start() or use it in a 'with' block, and send before shutdown()."
                )
            self._in_flight += 1
        self._local.depth = getattr(self._local, "depth", 0) + 1
        try:
            yield prepare, end
        finally:
            self._local.depth -= 1
            with self._lock:
                self._in_flight -= 1
                if self._in_flight == 0:
                    self._lock.notify_all()

    # -------------------------------------------------------------- sending
    def send_message_in_transaction(self, msg: Message, arg: Any = None) -> TransactionSendResult:
        """Send a half message, run the local transaction, and end the transaction.

        The half message is durable before ``execute_local_transaction`` runs. A COMMIT or
        ROLLBACK answer is sent asynchronously; an UNKNOWN answer (or an exception, or
        ``None``) leaves the message pending for the check-back job.

        Parameters
        ----------
        msg : Message
            The message to publish if the local transaction commits.
        arg : Any, optional
            Passed to ``execute_local_transaction``.

        Returns
        -------
        TransactionSendResult

        Raises
        ------
        InvalidMessageError
            The message breaks a rule; nothing was written.
        ProducerStateError
            The producer has no listener or is shut down; nothing was written.
        OSError, RmqSparkError
            The half message's write failed (a full disk, an object store that failed every
            attempt, a stall of over an hour); the local transaction was not run. A write
            whose answer was lost may have stored it: check-back then asks the checker.
        """
        if self.listener is None:
            raise ProducerStateError(
                f"producer {self.producer_group!r} has no TransactionListener; pass one to "
                "TransactionMQProducer(...) to send transactional messages."
            )
        validate_message(msg, self.store.settings.max_body_bytes)
        with self._admitted() as (prepare, end):
            return self._send_in_transaction(prepare, end, msg, arg)

    def _send_in_transaction(
        self,
        prepare: GroupCommitter[Message, PreparedMessage],
        end: GroupCommitter[Any, Any],
        msg: Message,
        arg: Any,
    ) -> TransactionSendResult:
        prepared = prepare.submit(msg).result()
        view = MessageExt(
            topic=msg.topic,
            queue_id=prepared.queue_id,
            msg_id=prepared.msg_id,
            transaction_id=prepared.transaction_id,
            producer_group=self.producer_group,
            keys=msg.keys_string,
            tags=msg.tags,
            body=msg.body_bytes,
            properties=dict(msg.properties),
            born_timestamp=prepared.store_timestamp,
            store_timestamp=prepared.store_timestamp,
        )
        state = self._run_local_transaction(view, arg)
        result = TransactionSendResult(
            SendStatus.SEND_OK,
            prepared.msg_id,
            prepared.transaction_id,
            msg.topic,
            prepared.queue_id,
            state,
        )
        if state is not LocalTransactionState.UNKNOWN:
            self._end_async(end, result, state)
        return result

    def _run_local_transaction(self, view: MessageExt, arg: Any) -> LocalTransactionState:
        assert self.listener is not None
        try:
            answer = self.listener.execute_local_transaction(view, arg)
        except Exception as exc:
            log.warning(
                "execute_local_transaction raised %r for transaction %s; treating it as UNKNOWN "
                "(the check-back job will ask check_local_transaction)",
                exc,
                view.transaction_id,
            )
            log.debug("execute_local_transaction traceback", exc_info=True)
            return LocalTransactionState.UNKNOWN
        state = LocalTransactionState.coerce(answer)
        if state is LocalTransactionState.UNKNOWN and answer is not LocalTransactionState.UNKNOWN:
            log.warning(
                "execute_local_transaction returned %r for transaction %s; treating it as UNKNOWN",
                answer,
                view.transaction_id,
            )
        return state

    def _end_async(
        self,
        end: GroupCommitter[Any, Any],
        result: TransactionSendResult,
        state: LocalTransactionState,
    ) -> None:
        future = end.submit(self._decision(result, state))
        with self._lock:
            self._pending.add(future)
        # Outside the lock: on a future already done, the callback runs here and takes it.
        future.add_done_callback(self._end_done)

    def _end_done(self, future: Slot[Any]) -> None:
        with self._lock:
            self._pending.discard(future)
        if future.exception() is not None:
            log.warning(
                "end-transaction failed (%s); the message stays pending until check-back "
                "resolves it",
                future.exception(),
            )

    def end_transaction(
        self, result: TransactionSendResult, state: LocalTransactionState
    ) -> EndTransactionResult:
        """End a transaction explicitly and wait for the outcome.

        Useful when the local transaction finishes after ``send_message_in_transaction``
        returned UNKNOWN. The first decision recorded wins: a conflicting late request comes
        back with status ``REFUSED`` and the decision in force. A transaction the store holds
        no half message of (retention removed it after its decision, for example while this
        process was stopped; or a result of another store) comes back ``NOT_FOUND``, and
        nothing is recorded.

        Returns once the decision is durable. A COMMIT becomes visible to consumers when the
        store's publisher moves it into the CommitLog, within about ``store.publish_linger``
        and one publish (:mod:`rmq_spark.store.publish_loop`); :meth:`flush` waits for it.
        """
        with self._admitted() as (_, end):
            return end.submit(self._decision(result, state)).result()

    def _decision(self, result: TransactionSendResult, state: LocalTransactionState) -> Decision:
        if not isinstance(result, TransactionSendResult):
            raise InvalidOptionError(
                "end_transaction needs the TransactionSendResult that send_message_in_transaction "
                f"returned but got {type(result).__name__} ({result!r:.80})."
            )
        try:
            state = LocalTransactionState(state)
        except ValueError as exc:
            raise InvalidOptionError(
                f"end_transaction needs a state of COMMIT or ROLLBACK (LocalTransactionState) but "
                f"got {state!r:.80}."
            ) from exc
        return Decision(result.transaction_id, self.producer_group, state, "producer")

    def send(self, msg: Message) -> SendResult:
        """Send a normal (non-transactional) message; it is visible when this returns."""
        validate_message(msg, self.store.settings.max_body_bytes)
        with self._admitted() as (_, end):
            return end.submit(msg).result()

    # -------------------------------------------------------------- batch handlers
    def _prepare_batch(self, messages: list[Message]) -> list[PreparedMessage]:
        return self._writer.prepare(messages, self.producer_group, validated=True)

    def _end_batch(self, items: list[Decision | Message]) -> list[Any]:
        decisions = [i for i in items if isinstance(i, Decision)]
        normal = [i for i in items if isinstance(i, Message)]
        ended = iter(end_in_background(self.store, self._publisher, decisions, normal=bool(normal)))
        if not normal:
            return [next(ended) for _ in items]
        try:
            # Normal messages are sent by publishing them (after what was committed up to the
            # op version this thread knows: no listing of op's log).
            published = self._writer.publish(
                [(m, self.producer_group) for m in normal], latest=False
            )
        except Exception as exc:
            if not decisions:
                raise
            # The decisions are durable: their callers succeeded. The normal messages failed.
            return [next(ended) if isinstance(i, Decision) else exc for i in items]
        sent = iter(
            SendResult(SendStatus.SEND_OK, mid, m.topic, qid, offset)
            for m, (mid, qid, offset) in zip(normal, published.sent, strict=True)
        )
        return [next(ended) if isinstance(i, Decision) else next(sent) for i in items]
