"""Decisions of a check-back round, through the producers' end-transaction path.

Keeps docs/contract.md, rule 3: every decision check-back takes (a checker's answer, a
rollback at the check max, a decision recorded again) goes through ``Store.end_transactions``,
so the first decision wins whoever races, and a transaction the producer decided first is
counted as already decided, not decided again. Keeps rule 2: a decision another Delta writer
removed from ``op`` (a RESTORE or DELETE) is recorded again without asking (see
:func:`recover_removed`), so nothing is published twice and nothing discarded is published
beside its re-driven copy.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.checkback.batch import CHECK
from rmq_spark.checkback.discards import DECIDED_BY_CHECK_MAX
from rmq_spark.checkback.state import STATE_COLUMNS
from rmq_spark.model.messages import LocalTransactionState
from rmq_spark.store.decisions import Decision, EndTransactionStatus
from rmq_spark.store.facade import Store
from rmq_spark.store.oplog import DECIDED_BY_RECOVERY

log = logging.getLogger(__name__)

#: ``op.decided_by`` of transactions a checker decided.
DECIDED_BY_CHECKER = "check-back"
_DECISION_CHUNK = 20_000
#: Rounds of a job between two reads of the decision object of a ripe transaction that is not
#: due (see :class:`ObjectLooks`).
LOOK_AGAIN_ROUNDS = 10


class ObjectLooks:
    """Whose decision objects a job's rounds on one shard read (:func:`land_unlanded`).

    A due transaction's object is read every round: its checker is asked otherwise. A ripe one
    that is not due (its group has no checker, it is older than the max check age, it is
    immune, its writer is alive) may stay pending for days, and its object (a GET, most often
    of nothing: its producer never decided) is read the first round that finds it ripe, then
    every :data:`LOOK_AGAIN_ROUNDS` rounds, not every round. A one-shot run reads them all."""

    def __init__(self) -> None:
        self._round = 0
        self._last: dict[str, int] = {}
        self._lock = threading.Lock()

    def pick(self, ripe: pa.Table) -> pa.Table:
        """The rows of ``ripe`` whose objects this round reads (one call a round)."""
        ids = ripe.column("transaction_id").to_pylist()
        due = [r == CHECK for r in ripe.column("reason").to_pylist()]
        with self._lock:
            self._round += 1
            # Only transactions still ripe are remembered: the others were decided.
            last = {t: self._last[t] for t in ids if t in self._last}
            keep = [
                d or t not in last or self._round - last[t] >= LOOK_AGAIN_ROUNDS
                for t, d in zip(ids, due, strict=True)
            ]
            last.update((t, self._round) for t, k in zip(ids, keep, strict=True) if k)
            self._last = last
        return ripe.filter(pa.array(keep, pa.bool_()))

    def forget(self, picked: pa.Table) -> None:
        """Read the objects of ``picked`` (a round's pick whose reads failed) next round."""
        with self._lock:
            for t in picked.column("transaction_id").to_pylist():
                self._last.pop(t, None)


def decide(
    store: Store, rows: Sequence[Mapping[str, object]], decided_by: str, counts: Counter[str]
) -> list[str]:
    """End transactions in chunks; return the ids this run decided."""
    applied: list[str] = []
    for start in range(0, len(rows), _DECISION_CHUNK):
        chunk = rows[start : start + _DECISION_CHUNK]
        results = store.end_transactions(
            [
                Decision(
                    str(r["transaction_id"]),
                    str(r["producer_group"]),
                    LocalTransactionState(str(r["answer"])),
                    decided_by,
                )
                for r in chunk
            ],
            publish=False,
            in_half=True,
        )
        for result in results:
            if result.status is EndTransactionStatus.APPLIED:
                applied.append(result.transaction_id)
                if decided_by == DECIDED_BY_CHECKER:
                    key = "committed" if result.decision == "COMMIT" else "rolled_back"
                    counts[key] += 1
            else:
                counts["already_decided"] += 1
        if len(rows) > _DECISION_CHUNK:
            log.info("decided %d/%d transactions", start + len(chunk), len(rows))
    return applied


def recover_unrecorded(
    store: Store, due: pa.Table, ripe: pa.Table, counts: Counter[str]
) -> set[str]:
    """Record in ``op``, without asking, the decisions that ``op`` lacks: of ``due``
    transactions, those another Delta writer removed (:func:`recover_removed`); of ``ripe``
    ones (past the transaction timeout, picked by :meth:`ObjectLooks.pick`), those won by a
    decision object whose decider stopped before recording them (:func:`land_unlanded`).
    Return those transactions."""
    ended = recover_removed(store, due, counts)
    if ended:
        gone = pa.array(sorted(ended), pa.string())
        ripe = ripe.filter(pc.invert(pc.is_in(ripe.column("transaction_id"), value_set=gone)))
    return ended | land_unlanded(store, ripe, counts)


def land_unlanded(store: Store, ripe: pa.Table, counts: Counter[str]) -> set[str]:
    """Record in ``op`` the decisions that the decision objects of ``ripe`` transactions hold
    (:mod:`rmq_spark.store.arbiter`): their decider (a producer process killed between its
    decision and its landing) did not; return those transactions. Each costs one read of its
    object; they are counted as already decided (their producer decided first)."""
    found = store.object_decisions(ripe.column("transaction_id").to_pylist())
    if not found:
        return set()
    log.info(
        "%d pending transaction(s) were decided (e.g. %s, %s) but not recorded in op: their "
        "decider stopped first; recording them",
        len(found),
        next(iter(found)),
        next(iter(found.values())).state.value,
    )
    rows = ripe.select(STATE_COLUMNS).to_pylist()
    for decided_by in sorted({d.decided_by for d in found.values()}):
        again = [
            {**r, "answer": found[r["transaction_id"]].state.value}
            for r in rows
            if r["transaction_id"] in found and found[r["transaction_id"]].decided_by == decided_by
        ]
        decide(store, again, decided_by, counts)
    return set(found)


def recover_removed(store: Store, due: pa.Table, counts: Counter[str]) -> set[str]:
    """Record again, without asking, the decisions another Delta writer removed from
    ``op`` (a RESTORE or DELETE) of due transactions, and return those transactions.

    A transaction that is published was committed: a checker's second COMMIT would
    publish it twice, so its COMMIT is recorded again and never published. One in
    ``discard`` was rolled back at the check max: a COMMIT now would publish it beside
    its re-driven copy, so its ROLLBACK is recorded again.
    """
    if not due.num_rows:
        return set()
    ids = due.column("transaction_id").to_pylist()
    published = store.published(ids)
    discarded = store.discarded(ids) - published
    if not published and not discarded:
        return set()
    # Decided since this round read them as pending (by their producer, by another round):
    # nothing was removed, they are only counted.
    decided = set(store.decisions(sorted(published | discarded)))
    counts["already_decided"] += len(decided)
    published, discarded = published - decided, discarded - decided
    if not published and not discarded:
        return decided
    rows = due.select(STATE_COLUMNS).to_pylist()
    log.error(
        "%d pending transaction(s) were decided before, e.g. %s: another Delta writer "
        "removed their decisions from op (a RESTORE or DELETE); recording them again, "
        "%d already published as COMMIT (not published twice), %d discarded as ROLLBACK "
        "(see docs/guarantees.md)",
        len(published) + len(discarded),
        sorted(published | discarded)[0],
        len(published),
        len(discarded),
    )
    for found, answer, decided_by in (
        (published, "COMMIT", DECIDED_BY_RECOVERY),
        (discarded, "ROLLBACK", DECIDED_BY_CHECK_MAX),
    ):
        again = [{**r, "answer": answer} for r in rows if r["transaction_id"] in found]
        # Applied here (op lacked them) or refused by their decision objects (which decide()
        # counts): already decided either way.
        applied = decide(store, again, decided_by, counts)
        counts["already_decided"] += len(applied)
    return published | discarded | decided
