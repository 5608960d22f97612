"""Consumer groups over the CommitLog, after RocketMQ 5's "pop" consumption: what its proxy
serves to ``SimpleConsumer`` and ``PushConsumer``, and what ``rmqtx serve`` serves here.

Per consumer group, every committed message of a subscribed topic is handed out at least
once. A message handed out is invisible to the group's other consumers until it is
acknowledged or its invisible duration ends; then it is handed out again, its delivery attempt
counted. After the group's last attempt (``max_delivery_attempts``) it goes to the group's
dead-letter topic ``%DLQ%<group>``, a topic of the store like any other. Groups are
independent of each other and of Spark readers. A group that first looks at a topic starts at
its end (RocketMQ's proxy does the same) or, with ``start="earliest"``, at its first message
still stored; a queue that gets its first message later is read from its start.

Every change is a row of the ``deliveries`` table (:mod:`rmq_spark.store.group_state`), and
the changes of many requests go in one commit (:meth:`Deliveries.handle` takes a batch). A
commit records, for every (group, topic, queue) it changes, an application id
(:func:`~rmq_spark.store.group_state.queue_app_id`): two processes serving one group conflict
on a queue they both changed, and the one that lost reads the group again from the table and
decides again. So several ``rmqtx serve`` processes on one root serve one group together, and
a restart loses nothing acknowledged and hands out again what was in flight.

A receipt handle names one hand-out of one message (queue, offset, attempt, extension and a
random nonce): acknowledging or extending needs the latest one, before it expires.
"""

from __future__ import annotations

import logging
import random
import secrets
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timedelta
from typing import Any

import pyarrow as pa
from deltalake.exceptions import CommitFailedError

from rmq_spark.delta.retry import retry_commits
from rmq_spark.delta.txnlog import follow
from rmq_spark.model.errors import InvalidOptionError, RmqSparkError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import Message
from rmq_spark.model.schema import DELIVERIES_SCHEMA
from rmq_spark.store.commitlog_reader import CommitLogReader, CommitLogView
from rmq_spark.store.context import StoreConcept, StoreContext
from rmq_spark.store.group_state import (
    Changes,
    GroupState,
    Handout,
    handle_key,
    read_group,
    replay,
    seen,
    seen_in,
)

log = logging.getLogger(__name__)

#: RocketMQ's default: a message is handed out at most this many times, then dead-lettered.
MAX_DELIVERY_ATTEMPTS = 16
#: The dead-letter topic of a group is this prefix and the group's name (RocketMQ's).
DLQ_PREFIX = "%DLQ%"
#: Properties a dead-lettered message gets (RocketMQ's names): its topic, and its stored id.
RETRY_TOPIC, ORIGIN_MESSAGE_ID = "RETRY_TOPIC", "ORIGIN_MESSAGE_ID"
#: Where a group starts on a topic it never looked at.
STARTS = ("latest", "earliest")
#: An acknowledgement is answered before its commit only if its hand-out has this long left.
_ACK_MARGIN_SECONDS = 1.0
#: Seconds after which a message decided for the dead-letter topic and not recorded as
#: published there is published again (the process that decided it was killed).
ORPHANED_DEAD_SECONDS = 60.0
#: How many offsets of one queue a receive reads at most beyond what it hands out.
_READ_AHEAD = 1024
#: Handles acknowledged lately, remembered so that a retried acknowledgement succeeds.
_REMEMBERED_DONE = 100_000


class InvalidHandleError(RmqSparkError):
    """A receipt handle that is not the latest of a message in flight, or has expired."""

    error_class = "INVALID_RECEIPT_HANDLE"


def dead_letter_topic(group: str) -> str:
    """The dead-letter topic of a consumer group."""
    return f"{DLQ_PREFIX}{group}"


@dataclass(frozen=True)
class Receive:
    """Hand out up to ``max_messages`` messages of ``topic`` with a tag in ``tags`` (None:
    any), invisible to the group for ``invisible_seconds``."""

    group: str
    topic: str
    tags: frozenset[str] | None
    max_messages: int
    invisible_seconds: float


@dataclass(frozen=True)
class Ack:
    """Acknowledge the hand-out ``handle`` of a message of ``topic``."""

    group: str
    topic: str
    handle: str


@dataclass(frozen=True)
class ChangeInvisible:
    """Keep the hand-out ``handle`` invisible for ``invisible_seconds`` from now; the result
    is the new handle."""

    group: str
    topic: str
    handle: str
    invisible_seconds: float


@dataclass(frozen=True)
class Renew:
    """Keep the hand-out ``handle`` invisible for ``invisible_seconds`` from now under the same
    handle, while its consumer works on it (RocketMQ's ``auto_renew``)."""

    group: str
    topic: str
    handle: str
    invisible_seconds: float


@dataclass(frozen=True)
class DeadLetter:
    """Send the message of the hand-out ``handle`` to the group's dead-letter topic now."""

    group: str
    topic: str
    handle: str


@dataclass(frozen=True)
class Sweep:
    """Dead-letter the messages of the groups this process knows whose last hand-out's
    invisible duration ended, as RocketMQ's broker does without waiting for a receive."""


@dataclass(frozen=True)
class _Published:
    """The message ``key`` of ``group`` is in the dead-letter topic: it is done."""

    group: str
    key: tuple[str, int, int]


Request = Receive | Ack | ChangeInvisible | Renew | DeadLetter | Sweep


@dataclass(frozen=True)
class Received:
    """A message handed out: the hand-out and the CommitLog row (without ``topic``)."""

    handout: Handout
    message: Mapping[str, Any]


class Deliveries(StoreConcept):
    """The consumer groups of a store (its root), served in batches of requests.

    Parameters
    ----------
    context : StoreContext
        The root store's parts.
    send : callable
        ``send(messages, consumer_group)`` publishes dead letters into the CommitLog.
    """

    def __init__(
        self, context: StoreContext, send: Callable[[Sequence[Message], str], object]
    ) -> None:
        super().__init__(context)
        self._send = send
        self.max_attempts = MAX_DELIVERY_ATTEMPTS
        self.start = "latest"
        self._groups: dict[str, GroupState] = {}
        #: The groups of the batch being served that were not read from the table for it.
        self._unread: set[str] = set()
        #: The head of the batch being served.
        self._head: Any = None
        self._commitlog = CommitLogReader(self.tables)

    def configure(self, *, max_attempts: int, start: str) -> None:
        """Set the delivery attempts before a message is dead-lettered, and where new groups
        start (``latest`` or ``earliest``)."""
        if isinstance(max_attempts, bool) or not isinstance(max_attempts, int) or max_attempts < 1:
            raise InvalidOptionError(
                f"max delivery attempts needs to be an int of at least 1 but got {max_attempts!r}."
            )
        if start not in STARTS:
            raise InvalidOptionError(
                f"a consumer group's start needs to be one of {', '.join(STARTS)}, not {start!r}."
            )
        self.max_attempts, self.start = max_attempts, start

    # ------------------------------------------------------------------ batches
    def handle(self, requests: Sequence[Request]) -> list[Any]:
        """Serve ``requests`` in order with one commit; one result per request: a list of
        :class:`Received` (receive), None (acknowledge, dead-letter), the new handle (change)
        or the :class:`InvalidHandleError` of a request whose handle is not valid.

        The groups are read again from the table, and the batch decided again, when a commit
        finds that another process changed one of their queues since they were read."""
        sweeping = any(isinstance(r, Sweep) for r in requests)
        overdue = self._overdue(self.clock()) if sweeping else set()
        groups = {r.group for r in requests if not isinstance(r, Sweep)} | overdue
        if not groups:
            return [None] * len(requests)
        decided: list[tuple[str, tuple[str, int, int]]] = []

        def attempt(n: int) -> list[Any]:
            if n:
                for g in groups:
                    self._groups.pop(g, None)
            states, head = self._states(groups, self.tables.head("deliveries", reload=n > 0))
            changes = Changes(self.clock())
            view = self._commitlog.view()
            try:
                results = [
                    None if isinstance(r, Sweep) else self._serve(r, states[r.group], changes, view)
                    for r in requests
                ]
                for g in overdue:
                    self._dead_letter_overdue(g, states[g], changes)
                    changes.dead += [(g, key) for key in self._orphaned(states[g], changes.now)]
                if changes.rows:
                    self._commit(changes, states, head)
            except BaseException:
                for g in groups:  # what this attempt changed in memory is not in the table
                    self._groups.pop(g, None)
                raise
            decided.extend(changes.dead)
            return results

        results = retry_commits(f"serve {len(requests)} consumer request(s)", "deliveries", attempt)
        if decided:
            failpoint("deliveries.decided")
            try:
                self._publish_dead(decided)
            except Exception as exc:  # the batch's own results stand: they are committed
                log.warning(
                    "publishing %d dead letter(s) failed (%s); they are published again in %.0f s",
                    len(decided),
                    exc,
                    ORPHANED_DEAD_SECONDS,
                )
        return results

    def _publish_dead(self, decided: list[tuple[str, tuple[str, int, int]]]) -> None:
        """Publish the messages decided for their group's dead-letter topic (after the commit
        that decided them: no other process hands them out or acknowledges them any more),
        then record them done. Killed in between, a message is published again by the next
        sweep of a process that serves its group, once :data:`ORPHANED_DEAD_SECONDS` passed:
        the dead-letter topic gets it at least once."""
        view = self._commitlog.view()
        by_group: dict[str, list[Message]] = {}
        for group, (topic, queue_id, offset) in decided:
            for row in view.messages(topic, queue_id, offset, 1):
                properties = {
                    **dict(row["properties"] or []),
                    RETRY_TOPIC: topic,
                    ORIGIN_MESSAGE_ID: row["msg_id"],
                }
                message = Message(
                    dead_letter_topic(group),
                    row["body"],
                    tags=row["tags"],
                    keys=row["keys"],
                    properties=properties,
                )
                by_group.setdefault(group, []).append(message)
        for group, messages in by_group.items():
            self._send(messages, group)
        self.handle([_Published(group, key) for group, key in decided])

    def _orphaned(self, state: GroupState, now: datetime) -> list[tuple[str, int, int]]:
        """Messages decided for the dead-letter topic so long ago that the process that decided
        them was killed before it published them."""
        since = now - timedelta(seconds=ORPHANED_DEAD_SECONDS)
        return [key for key, decided in state.dead.items() if decided <= since]

    def in_flight_here(self, group: str, topic: str, handle: str) -> bool:
        """Whether ``handle`` is the latest, unexpired hand-out of a message in flight as this
        process last knew the group (read from another thread: a guess the next batch checks
        against the table)."""
        state, key = self._groups.get(group), handle_key(topic, handle)
        handout = state.in_flight.get(key) if state and key else None
        margin = timedelta(seconds=_ACK_MARGIN_SECONDS)  # its batch comes before it expires
        return (
            handout is not None
            and handout.handle == handle
            and handout.invisible_until > self.clock() + margin
        )

    def _overdue(self, now: datetime) -> set[str]:
        """The groups in memory with a message whose last hand-out ended unacknowledged."""
        return {
            group
            for group, state in self._groups.items()
            if any(self._last(h, now) for h in state.in_flight.values())
            or self._orphaned(state, now)
        }

    def _last(self, handout: Handout, now: datetime) -> bool:
        """Whether ``handout`` was a message's last and its invisible duration ended."""
        return handout.attempt >= self.max_attempts and handout.invisible_until <= now

    def _dead_letter_overdue(
        self, group: str, state: GroupState, changes: Changes, topic: str | None = None
    ) -> None:
        """Dead-letter the group's messages (of ``topic``, or all) whose last hand-out ended."""
        for key, handout in sorted(state.in_flight.items()):
            if (topic is None or key[0] == topic) and self._last(handout, changes.now):
                self._dead_letter(group, handout, state, changes)

    def _commit(self, changes: Changes, states: Mapping[str, GroupState], head: Any) -> None:
        rows = pa.Table.from_pylist(changes.rows, schema=DELIVERIES_SCHEMA)
        files = self.tables.write("deliveries", [rows])
        version = head.version + 1
        app_ids = dict.fromkeys(changes.touched, version)
        self.tables.commit("deliveries", files, head.snapshot, app_ids, after=head.version)
        for app_id, group in changes.touched.items():
            states[group].seen[app_id] = version

    def _states(self, groups: set[str], head: Any) -> tuple[dict[str, GroupState], Any]:
        """The groups as this process knows them, each read again from the table when
        another process changed one of its queues (the head shows it); and the head they
        all agree with, after which the batch's commit checks for conflicts."""
        states = {g: self._groups[g] for g in groups if g in self._groups}
        loaded: set[str] = set()
        while stale := {g for g in groups if g not in states or states[g].seen != seen(g, head)}:
            head = self.tables.head("deliveries", reload=True)
            for g in stale:
                state = self._groups[g] = states[g] = replay(
                    read_group(self.tables, g, head.snapshot)
                )
                state.seen = seen(g, head)
            loaded |= stale
        self._unread, self._head = groups - loaded, head
        return states, head

    # ------------------------------------------------------------------ requests
    def _serve(self, request: Request, state: GroupState, changes: Changes, view: CommitLogView):
        if isinstance(request, Receive):
            return self._receive(request, state, changes, view)
        if isinstance(request, _Published):
            if state.dead.pop(request.key, None) is not None:
                changes.add(request.group, *request.key, "done")
            return None
        try:
            handout = self._valid(request, state, changes.now)
        except InvalidHandleError as exc:
            return exc
        if handout is None:  # acknowledged before, with this handle: a retry
            return None
        if isinstance(request, Renew):
            until = changes.now + timedelta(seconds=request.invisible_seconds)
            renewed = replace(handout, invisible_until=max(handout.invisible_until, until))
            state.in_flight[renewed.key] = renewed
            changes.handed(request.group, renewed)
            return None
        if isinstance(request, ChangeInvisible):
            later = replace(
                handout,
                change=handout.change + 1,
                invisible_until=changes.now + timedelta(seconds=request.invisible_seconds),
                nonce=secrets.token_hex(8),
            )
            state.in_flight[later.key] = later
            changes.handed(request.group, later)
            return later.handle
        if isinstance(request, DeadLetter):
            self._dead_letter(request.group, handout, state, changes)
            return None
        self._done(request.group, handout, state, changes)
        return None

    def _valid(
        self, request: Ack | ChangeInvisible | Renew | DeadLetter, state: GroupState, now: datetime
    ):
        """The hand-out a handle names, if it is the latest of its message and unexpired;
        None for one acknowledged already."""
        if request.handle in state.done and isinstance(request, Ack):
            return None
        shown = f"{request.handle[:80]!r}"  # a client's text: not echoed whole
        key = handle_key(request.topic, request.handle)
        if key is None:
            raise InvalidHandleError(f"receipt handle {shown} is not one this server gave out.")
        handout = state.in_flight.get(key)
        if (handout is None or handout.handle != request.handle) and self._may_reread(
            request.group
        ):
            # Another process may have handed it out, or acknowledged it: read the group again.
            raise CommitFailedError(f"receipt handle {shown} is not known here")
        if handout is None or handout.handle != request.handle:
            raise InvalidHandleError(
                f"receipt handle {shown} of topic {request.topic!r} is not the latest of a "
                "message in flight: the message was acknowledged, or handed out again after its "
                "invisible duration ended."
            )
        if handout.invisible_until <= now:
            raise InvalidHandleError(
                f"receipt handle {shown} expired at {handout.invisible_until.isoformat()}: the "
                "message is handed out again. Ask for a longer invisible duration, or extend it "
                "(ChangeInvisibleDuration)."
            )
        return handout

    def _may_reread(self, group: str) -> bool:
        """Whether a handle unknown here is reason to read ``group`` again: it was not read
        for this batch, and the log's entries after this process's head show that another
        process changed it (a made-up handle costs a look at the log, not a read of the
        group)."""
        if group not in self._unread:
            return False
        head = self._head
        followed = follow(
            self.tables.uri("deliveries"), self.settings.storage_options, head.version, head.txns
        )
        return followed is None or seen_in(group, followed[1]) != self._groups[group].seen

    def _done(self, group: str, handout: Handout, state: GroupState, changes: Changes) -> None:
        del state.in_flight[handout.key]
        state.done[handout.handle] = None
        if len(state.done) > _REMEMBERED_DONE:
            state.done.popitem(last=False)
        changes.add(group, *handout.key, "done", attempt=handout.attempt, handle=handout.handle)

    def _dead_letter(
        self, group: str, handout: Handout, state: GroupState, changes: Changes
    ) -> None:
        """Decide to send a message to the group's dead-letter topic: recorded with the
        batch's commit, published after it (:meth:`_publish_dead`)."""
        del state.in_flight[handout.key]
        state.dead[handout.key] = changes.now
        changes.add(
            group,
            *handout.key,
            "dead",
            attempt=handout.attempt,
            handle=handout.handle,
        )
        changes.dead.append((group, handout.key))
        log.info(
            "consumer group %s: message %s.%d.%d dead-lettered after %d attempt(s)",
            group,
            *handout.key,
            handout.attempt,
        )

    def _receive(
        self, request: Receive, state: GroupState, changes: Changes, view: CommitLogView
    ) -> list[Received]:
        group, topic, now = request.group, request.topic, changes.now
        invisible = now + timedelta(seconds=request.invisible_seconds)
        if topic not in state.started:
            self._start(group, topic, state, changes, view)
        self._dead_letter_overdue(group, state, changes, topic)
        out: list[Received] = []
        for key, handout in sorted(state.in_flight.items()):
            if len(out) >= request.max_messages:
                return out
            if key[0] != topic or handout.invisible_until > now:
                continue
            rows = view.messages(topic, key[1], key[2], 1)
            # Gone (retention, another Delta writer), or filtered out by the group's filter
            # now (it changed since): passed over, as a fresh message would be.
            if not rows or (request.tags is not None and rows[0]["tags"] not in request.tags):
                self._done(group, handout, state, changes)
                continue
            again = Handout(topic, key[1], key[2], handout.attempt + 1, 0, invisible, _nonce())
            out.append(self._hand(group, again, rows[0], state, changes))
        queues = sorted(q for t, q in view.next_offsets if t == topic)
        first = random.randrange(len(queues)) if queues else 0  # servers of a group spread
        for i in range(len(queues)):
            queue_id = queues[(first + i) % len(queues)]
            wanted = request.max_messages - len(out)
            if wanted <= 0:
                break
            begin = max(state.frontier.get((topic, queue_id), 0), view.earliest(topic, queue_id))
            end = min(view.next_offsets[(topic, queue_id)], begin + wanted + _READ_AHEAD)
            if begin >= end:
                continue
            frontier = begin
            for row in view.messages(topic, queue_id, begin, end - begin):
                if len(out) >= request.max_messages:
                    break
                frontier = row["queue_offset"] + 1
                if request.tags is None or row["tags"] in request.tags:
                    handout = Handout(topic, queue_id, frontier - 1, 1, 0, invisible, _nonce())
                    out.append(self._hand(group, handout, row, state, changes))
            else:
                frontier = end  # every offset read: those not stored are gone (retention)
            if frontier != state.frontier.get((topic, queue_id)):
                state.frontier[(topic, queue_id)] = frontier
                changes.add(group, topic, queue_id, frontier, "frontier")
        return out

    def _start(
        self, group: str, topic: str, state: GroupState, changes: Changes, view: CommitLogView
    ) -> None:
        """A group's first look at a topic: each queue's fresh messages start at its end
        (``latest``) or at its first stored message; queues without messages yet start at 0."""
        for (t, queue_id), end in view.next_offsets.items():
            if t == topic and (topic, queue_id) not in state.frontier:
                begin = end if self.start == "latest" else view.earliest(t, queue_id)
                state.frontier[(topic, queue_id)] = begin
                changes.add(group, topic, queue_id, begin, "frontier")
        state.started.add(topic)
        changes.add(group, topic, -1, 0, "start")

    def _hand(
        self,
        group: str,
        handout: Handout,
        row: Mapping[str, Any],
        state: GroupState,
        changes: Changes,
    ) -> Received:
        state.in_flight[handout.key] = handout
        changes.handed(group, handout)
        return Received(handout, row)


def _nonce() -> str:
    return secrets.token_hex(8)
