"""Transactions begun and decided: half messages written, and the first decision that wins.

* **Invisible until committed** (rule 1). :meth:`Decisions.prepare` writes half messages into
  ``half`` only; consumers read only ``commitlog``.
* **Nothing is lost** (rule 4). ``prepare`` returns only after the half message's Delta commit,
  or (``store.intake``) the put of its intake object (:mod:`rmq_spark.store.intake`), which
  :class:`rmq_spark.store.landing.Landing` lands in ``half`` before it lands any decision in
  ``op``.
* **First decision wins** (rule 3). A transaction whose id says so
  (:func:`rmq_spark.model.messages.object_decided`: every id this store makes on a local
  filesystem or S3) is decided by its decision object, one conditional put
  (:mod:`rmq_spark.store.arbiter`); its decision is then *landed* in ``op``, at once or (a
  producer's, :meth:`Decisions.end` with ``land=False``) by the process's background publisher
  with the other decisions of that moment, in one commit. The decision object says which
  decision won; ``op`` only ever records that one.
* ``op`` has one row per decided transaction. A decision (or a landing) is an append made on the
  snapshot in which the transaction was read as undecided, and it records a Delta application
  transaction for the bucket of each transaction id it decides (:func:`decision_app_id`). Two
  writers racing on the same transaction set the same id, so Delta's optimistic concurrency
  check refuses the second commit; the loser retries and sees the winner's row. For the other
  transactions (ids from an older rmq-spark, or of a filesystem with no put-if-absent) that is
  the arbiter: the loser reports the request as refused (or as a no-op when it asked for the
  same thing). Two writers of different transactions in one bucket only retry.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum

import pyarrow as pa
from deltalake import DeltaTable

from rmq_spark.delta.retry import retry_commits
from rmq_spark.delta.storage import check_conditional_put
from rmq_spark.model.clock import elapsed
from rmq_spark.model.errors import RmqSparkError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import (
    LocalTransactionState,
    Message,
    check_group,
    new_id,
    object_decided,
    queue_for,
    shard_of,
    shard_transaction_id,
    validate_message,
)
from rmq_spark.model.schema import HALF_SCHEMA, OP_SCHEMA, WRITER_COLUMNS
from rmq_spark.store.arbiter import DecisionObjects, supports_objects
from rmq_spark.store.context import StoreConcept, StoreContext
from rmq_spark.store.intake import Intake
from rmq_spark.store.landing import Landing
from rmq_spark.store.layout import LAYOUT_VERSION, OBJECTS_LAYOUT
from rmq_spark.store.oplog import COMMITS_KEY, DECIDED_BY_RECOVERY
from rmq_spark.store.own_writes import OWN_COMMITS_KEPT, MadeIds, OwnDecisions, decision_app_id
from rmq_spark.store.reads import decisions_of

log = logging.getLogger(__name__)


class EndTransactionStatus(StrEnum):
    """What happened to an end-transaction request."""

    #: This request decided the transaction.
    APPLIED = "APPLIED"
    #: The transaction already had the same decision; nothing changed.
    ALREADY_DECIDED = "ALREADY_DECIDED"
    #: The transaction already had the opposite decision, which stays in force.
    REFUSED = "REFUSED"
    #: The store holds no half message of the transaction: its id is not one a send returned,
    #: or retention removed the transaction after it was decided. Nothing was recorded.
    NOT_FOUND = "NOT_FOUND"


@dataclass(frozen=True)
class Decision:
    """A request to end one transaction.

    Parameters
    ----------
    transaction_id : str
        The transaction to end.
    producer_group : str
        The group that owns it.
    state : LocalTransactionState
        ``COMMIT`` or ``ROLLBACK``.
    decided_by : str
        Who decides: ``producer``, ``check-back``, ``sink``... (kept in ``op`` for audits).
    decided : datetime, optional
        When it was decided (default: when ``op`` records it); a decision object's, landed.
    """

    transaction_id: str
    producer_group: str
    state: LocalTransactionState
    decided_by: str = "producer"
    decided: datetime | None = None


@dataclass(frozen=True)
class EndTransactionResult:
    """The outcome of an end-transaction request.

    ``decision`` is the decision in force after the request: the requested one when
    ``status`` is ``APPLIED`` or ``ALREADY_DECIDED``, the earlier one when ``REFUSED``,
    ``UNKNOWN`` when ``NOT_FOUND``.
    """

    transaction_id: str
    requested: LocalTransactionState
    status: EndTransactionStatus
    decision: LocalTransactionState


@dataclass(frozen=True)
class PreparedMessage:
    """A half message, durable: in the ``half`` table, or in an intake object landed there later."""

    msg_id: str
    transaction_id: str
    queue_id: int
    #: The ``half`` version that holds it; None while it is in an intake object
    #: (:mod:`rmq_spark.store.intake`), landed later.
    half_version: int | None
    store_timestamp: datetime


#: A prepare of at most this many new transactions makes ids that decision objects decide
#: (:mod:`rmq_spark.store.arbiter`), on a local filesystem and on S3; a larger one (a bulk
#: prepare) makes ids decided in ``op``. The arbiter is fixed when the id is made, whoever
#: decides. On S3 + 20 ms a decision object is one round trip instead of the three of an
#: ``op`` commit: with 64 senders, whose decisions come some thirty together, objects for all
#: of them made 367 transactions a second against 320, p99 273 ms against 512
#: (``bench/scale_bench.py``). On local disk an ``op`` commit is a millisecond and a file per
#: transaction costs more than it saves: 64 senders made 2,472 to 3,290 a second with objects,
#: 4,315 to 4,400 without.
OBJECT_DECIDED_BATCH = {"file": 8, "s3": 64}


class Decisions(StoreConcept):
    """Half messages written and transactions decided in one store's ``half`` and ``op``."""

    def __init__(self, context: StoreContext, raise_layout: Callable[[int], None]) -> None:
        super().__init__(context)
        self._own = threading.local()
        self._made = MadeIds()
        #: Raises the store's layout (:func:`rmq_spark.store.layout.raise_layout`); called once,
        #: before the first transaction id that a decision object decides is made.
        self._raise_layout: Callable[[int], None] | None = raise_layout
        self._objects = (
            DecisionObjects(self.tables.uri("op"), self.tables.storage_options)
            if supports_objects(self.tables.root)
            else None
        )
        self._objects_batch = OBJECT_DECIDED_BATCH[
            "file" if self._objects is None or self._objects.local else "s3"
        ]
        #: The shard's intake objects (:mod:`rmq_spark.store.intake`): where this process makes
        #: the half messages of transactions that decision objects decide durable in one put
        #: when it ``stages`` (else in a ``half`` commit), and lands those of others; None on
        #: a filesystem that holds no decision objects.
        self.intake = (
            Intake(context, stages=self.settings.intake) if self._objects is not None else None
        )
        #: :attr:`intake` when this process's prepares stage intake objects there.
        self._staging = self.intake if self.intake is not None and self.intake.stages else None
        #: Decisions won by their objects and not landed in ``op`` yet (``end(land=False)``).
        self.landing = Landing(self.tables, self.record, self._made, self.intake, self._staging)

    def prepare(
        self,
        messages: Sequence[Message],
        producer_group: str,
        *,
        transaction_ids: Sequence[str] | None = None,
        born_timestamp: datetime | None = None,
        validated: bool = False,
    ) -> list[PreparedMessage]:
        """Write half messages (durable, invisible) in one Delta commit.

        Parameters
        ----------
        messages : sequence of Message
            Validated before anything is written; one invalid message fails the whole call.
        producer_group : str
            The producer group that owns the transactions.
        transaction_ids : sequence of str, optional
            One per message; several messages may share a transaction. Defaults to a new
            transaction per message.
        born_timestamp : datetime, optional
            The producer's clock at send time (defaults to now).
        validated : bool, default False
            The messages and the group were checked already (:func:`validate_message`,
            :func:`check_group`); they are not checked again. A producer checks each message as
            it is sent, so its group commit, which every sender waits for, skips the checks.

        Returns
        -------
        list of PreparedMessage
            In the order of ``messages``, all with the same ``half_version``.
        """
        if not validated:
            check_group(producer_group)
            for message in messages:
                validate_message(message, self.settings.max_body_bytes)
        fresh_ids = transaction_ids is None
        by_object = False
        made = elapsed()
        if transaction_ids is None:
            # Their decisions will come as few together: one conditional put each is the
            # cheapest first decision. Many together share one op commit instead.
            by_object = self._objects is not None and len(messages) <= self._objects_batch
            raise_layout = self._raise_layout
            if by_object and raise_layout is not None:
                raise_layout(OBJECTS_LAYOUT if self._staging is None else LAYOUT_VERSION)
                self._raise_layout = None
            transaction_ids = [
                shard_transaction_id(self.shard, object_decided=by_object) for _ in messages
            ]
        if len(transaction_ids) != len(messages):
            raise RmqSparkError("transaction_ids must have one entry per message.")
        self._check_shard(transaction_ids)
        if not messages:
            return []
        born = born_timestamp or self.clock()
        stored = self.clock()
        msg_ids = [new_id() for _ in messages]
        keys = [m.keys_string for m in messages]
        queue_ids = [self.queue_base + queue_for(k, self.settings.queue_nums) for k in keys]
        half = pa.Table.from_pydict(
            {
                "transaction_id": list(transaction_ids),
                "msg_id": msg_ids,
                "producer_group": [producer_group] * len(messages),
                "topic": [m.topic for m in messages],
                "queue_id": queue_ids,
                "keys": keys,
                "tags": [m.tags for m in messages],
                "body": [m.body_bytes for m in messages],
                "properties": [list(dict(m.properties).items()) for m in messages],
                "born_timestamp": [born] * len(messages),
                "store_timestamp": [stored] * len(messages),
                **{f.name: [None] * len(messages) for f in WRITER_COLUMNS},
            },
            schema=HALF_SCHEMA,
        )
        if fresh_ids and by_object and self._staging is not None:
            self._staging.stage(half)
            version = None
        else:
            version = self.tables.append("half", [half])
        if fresh_ids:
            self.recent.add(half)
            self._made.add(transaction_ids, made)
        return [
            PreparedMessage(mid, tid, qid, version, stored)
            for mid, tid, qid in zip(msg_ids, transaction_ids, queue_ids, strict=True)
        ]

    def end(
        self, decisions: Sequence[Decision], *, land: bool = True, in_half: bool = False
    ) -> list[EndTransactionResult]:
        """Decide transactions; the first decision recorded for a transaction wins.

        Parameters
        ----------
        decisions : sequence of Decision
            COMMIT or ROLLBACK requests. A transaction named twice in one call is decided by
            its first entry.
        land : bool, default True
            Record the decisions in ``op`` before returning. False: the decisions won by their
            decision objects are durable when this returns and wait for :attr:`landing` (a
            producer's background publisher lands them with the others of that moment; a
            process that dies first leaves them to the check-back job).
        in_half : bool, default False
            The caller knows these transactions' half messages are in ``half``: it read them
            there (the check-back job) or its tasks committed them (a sink's epoch). No intake
            object of theirs needs landing first (:class:`Landing`), and none is looked for.
            Otherwise a transaction is decided only if the store holds its half messages
            (:meth:`Landing.missing`).

        Returns
        -------
        list of EndTransactionResult
            One per decision, in order; ``NOT_FOUND`` for a transaction the store holds no
            half message of, for which nothing is recorded.
        """
        for d in decisions:
            if d.state not in (LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK):
                raise RmqSparkError(
                    f"end-transaction takes COMMIT or ROLLBACK, not {d.state!s} "
                    f"(transaction {d.transaction_id!r}); UNKNOWN means 'do not end it yet'."
                )
        first: dict[str, Decision] = {}
        for d in decisions:
            first.setdefault(d.transaction_id, d)
        self._check_shard(list(first))
        failpoint("decision.end")
        missing = set() if in_half else self.landing.missing(list(first))
        first = {t: d for t, d in first.items() if t not in missing}
        by_object = [d for t, d in first.items() if object_decided(t)]
        before, landing = self._claim(by_object)
        if landing:
            failpoint("decision.claimed")
        rest = [d for t, d in first.items() if not object_decided(t)]
        try:
            if rest:
                before.update(self.record(rest))
        finally:  # what the objects decided is in force whatever happens to the rest
            self.landing.add(landing, in_half)
        if land:
            self.landing.land()
        self.recent.discard(
            t for t, d in first.items() if before.get(t, d.state) is LocalTransactionState.ROLLBACK
        )
        results = []
        for d in decisions:
            if d.transaction_id in missing:
                status, in_force = EndTransactionStatus.NOT_FOUND, LocalTransactionState.UNKNOWN
                results.append(EndTransactionResult(d.transaction_id, d.state, status, in_force))
                continue
            in_force = before.get(d.transaction_id, first[d.transaction_id].state)
            if d is first[d.transaction_id] and d.transaction_id not in before:
                status = EndTransactionStatus.APPLIED
            elif in_force == d.state:
                status = EndTransactionStatus.ALREADY_DECIDED
            else:
                status = EndTransactionStatus.REFUSED
            results.append(EndTransactionResult(d.transaction_id, d.state, status, in_force))
        refused = [r for r in results if r.status is EndTransactionStatus.REFUSED]
        if refused:
            log.warning(
                "refused %d late conflicting decision(s), e.g. %s %s (already %s)",
                len(refused),
                refused[0].requested.value,
                refused[0].transaction_id,
                refused[0].decision.value,
            )
        if missing:
            log.warning(
                "%d end-transaction request(s) for transactions the store holds no half message "
                "of (never sent, or removed by retention after their decision), e.g. %s: "
                "nothing recorded",
                len(missing),
                sorted(missing)[0],
            )
        return results

    def _claim(
        self, decisions: list[Decision]
    ) -> tuple[dict[str, LocalTransactionState], list[Decision]]:
        """Put the decision objects of ``decisions``; return the decisions that were already
        there (as :meth:`record`) and what to land in ``op``: each transaction's
        decision object (a recovery's COMMIT of a transaction already published lands as
        :data:`DECIDED_BY_RECOVERY`, so that it is not published again)."""
        if not decisions:
            return {}, []
        if self._objects is None:
            raise RmqSparkError(
                f"transaction {decisions[0].transaction_id!r} is decided by a decision object, "
                f"which {self.tables.root!r} cannot hold (no put-if-absent on this filesystem); "
                "decide it where the store is on a local filesystem or S3."
            )
        # Before this process's first write to the store (with intake, a decision can be):
        # an endpoint that ignores If-None-Match would let two decisions win.
        check_conditional_put(self.tables.root, self.tables.storage_options)
        claims = self._objects.claim(
            [(d.transaction_id, d.producer_group, d.state, d.decided_by) for d in decisions],
            self.clock(),
        )
        before: dict[str, LocalTransactionState] = {}
        landing = []
        for d, c in zip(decisions, claims, strict=True):
            if not c.won:
                before[d.transaction_id] = c.state
            recovered = d.decided_by == DECIDED_BY_RECOVERY and c.state is d.state
            by = d.decided_by if recovered else c.decided_by
            landing.append(Decision(c.transaction_id, c.producer_group, c.state, by, c.decided))
        return before, landing

    def object_decisions(self, transaction_ids: Sequence[str]) -> dict[str, Decision]:
        """The decisions in force of those of ``transaction_ids`` that their decision objects
        decided (:mod:`rmq_spark.store.arbiter`), landed in ``op`` or not."""
        ids = [t for t in transaction_ids if object_decided(t)]
        if not ids or self._objects is None:
            return {}
        return {
            t: Decision(t, c.producer_group, c.state, c.decided_by, c.decided)
            for t, c in self._objects.read(ids).items()
        }

    def remove_objects(self, transaction_ids: Sequence[str]) -> None:
        """Delete the decision objects of transactions retention removed from ``half`` and
        ``op`` (:meth:`rmq_spark.store.arbiter.DecisionObjects.remove`)."""
        ids = [t for t in transaction_ids if object_decided(t)]
        if ids and self._objects is not None:
            self._objects.remove(ids)

    def record(self, decisions: list[Decision]) -> dict[str, LocalTransactionState]:
        """Append new decisions to ``op``; return the decisions that were already there.

        The returned dict holds the transactions decided *before* this call, with their
        decision; the ones this call decided are not in it.
        """
        ids = [d.transaction_id for d in decisions]
        arbiters = {decision_app_id(t) for t in ids}
        if not hasattr(self._own, "decisions"):
            self._own.decisions = OwnDecisions()
        own: OwnDecisions = self._own.decisions

        def attempt(n: int) -> tuple[dict[str, LocalTransactionState], int | None]:
            # The log as this thread last found it (the hot path: no listing); its snapshot
            # holds every decision of these transactions unless another writer recorded an
            # arbiter of theirs after it, or this thread decided one of them since: then, on a
            # retry, and every OWN_COMMITS_KEPT own commits, the latest snapshot.
            head = self.tables.head("op", reload=n > 0)
            own.since(head.snapshot.version())
            moved = {
                (a, head.txns[a]) for a in arbiters if head.txns.get(a) != head.snapshot_txns.get(a)
            }
            if len(own.commits) >= OWN_COMMITS_KEPT or not own.recorded(moved) or own.decided(ids):
                head = self.tables.head("op", reload=True)
                own.since(head.snapshot.version())
            unknown = self._made.after(ids, head.loaded)  # to the snapshot: made since
            lookup = [t for t in ids if t not in unknown]
            existing = decisions_of(self.tables, head.snapshot, lookup) if lookup else {}
            fresh = [d for d in decisions if d.transaction_id not in existing]
            if not fresh:
                return existing, None
            version = self.write_decisions(head.snapshot, fresh, after=head.version)
            own.add(version, head.version + 1, [d.transaction_id for d in fresh])
            return existing, version

        existing, _ = retry_commits(f"record {len(decisions)} decision(s)", "op", attempt)
        return existing

    def _check_shard(self, transaction_ids: Sequence[str]) -> None:
        """Refuse transactions of another shard: each is kept, and decided, in the shard its
        id names (:mod:`rmq_spark.store.shards`)."""
        strangers = [t for t in transaction_ids if shard_of(t) != self.shard]
        if strangers:
            raise RmqSparkError(
                f"transaction {strangers[0]!r} belongs to shard {shard_of(strangers[0])} of the "
                f"store, not to shard {self.shard}: write and decide it there (Store.shard_store; "
                "Store.end_transactions on the store's root routes each decision to its shard)."
            )

    def write_decisions(
        self, op: DeltaTable, decisions: Sequence[Decision], *, after: int | None = None
    ) -> int:
        """Append ``decisions`` to the ``op`` snapshot ``op``, in which none of them is decided;
        return the committed version.

        The commit records :func:`decision_app_id` of every transaction, so it fails with
        ``CommitFailedError`` (nothing landed) when a commit after ``op``'s version (or after
        ``after``, a later version up to which the caller knows that no commit recorded one of
        those application ids) decided one of them, or another transaction of the same bucket:
        the caller reads again and retries.
        """
        self._check_shard([d.transaction_id for d in decisions])
        decided_at = self.clock()
        rows = pa.Table.from_pydict(
            {
                "transaction_id": [d.transaction_id for d in decisions],
                "producer_group": [d.producer_group for d in decisions],
                "decision": [d.state.value for d in decisions],
                "decided_by": [d.decided_by for d in decisions],
                "decided_timestamp": [d.decided or decided_at for d in decisions],
            },
            schema=OP_SCHEMA,
        )
        version = (op.version() if after is None else after) + 1
        arbiters = sorted({decision_app_id(d.transaction_id) for d in decisions})
        files = self.tables.write("op", [rows])
        committed = [
            d.transaction_id
            for d in decisions
            if d.state is LocalTransactionState.COMMIT and d.decided_by != DECIDED_BY_RECOVERY
        ]
        return self.tables.commit(
            "op",
            files,
            op,
            app_ids=dict.fromkeys(arbiters, version),
            info={"rmqtx.operation": "decide", COMMITS_KEY: json.dumps(committed)},
            after=after,
        )
