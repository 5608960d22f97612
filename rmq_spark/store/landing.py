"""Landing: decisions their objects won, recorded in ``op`` after their half messages.

A transaction decided by its decision object (:mod:`rmq_spark.store.arbiter`) is in force as
soon as the object is put; :meth:`rmq_spark.store.decisions.Decisions.end` with ``land=False``
leaves it here, and the process's background publisher lands the decisions of a moment in one
``op`` commit. ``op`` must never hold a decision before ``half`` holds its messages (rule 4:
check-back and the publisher read a transaction's messages in ``half``), so a landing first
lands the intake objects that may hold them (:mod:`rmq_spark.store.intake`). For the same
reason, a decision is taken only for a transaction whose half messages the store holds
(:meth:`Landing.missing`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.clock import elapsed
from rmq_spark.model.messages import LocalTransactionState, object_decided
from rmq_spark.store.intake import Intake
from rmq_spark.store.reads import held_in_half

if TYPE_CHECKING:
    from rmq_spark.store.decisions import Decision
    from rmq_spark.store.own_writes import MadeIds

log = logging.getLogger(__name__)

#: An end of a transaction this process made within this many seconds of its making is decided
#: without a look in ``half`` (:meth:`Landing.missing`); a later one (after an UNKNOWN, or a
#: stall) costs that look, on an object store a listing and a read or two.
LATE_END_SECONDS = 1.0


class Landing:
    """The decisions of one store (shard) won by their objects and not in ``op`` yet.

    Parameters
    ----------
    tables : DeltaTables
        The shard's tables.
    record : callable
        Appends decisions to ``op`` and returns those already there
        (:meth:`rmq_spark.store.decisions.Decisions.record`).
    made : MadeIds
        The transaction ids this process made (whose half messages it landed or committed).
    intake : Intake, optional
        The shard's intake objects (None on a filesystem that holds no decision objects).
    staging : Intake, optional
        ``intake`` when this process's prepares stage intake objects there (landed first).
    """

    def __init__(
        self,
        tables: DeltaTables,
        record: Callable[[list[Decision]], dict[str, LocalTransactionState]],
        made: MadeIds,
        intake: Intake | None,
        staging: Intake | None,
    ) -> None:
        self._tables = tables
        self._record = record
        self._made = made
        self._intake = intake
        self._staging = staging
        self._unlanded: list[Decision] = []
        #: Of those, the transactions read in ``half`` by their decider.
        self._in_half: set[str] = set()
        self._queue_lock = threading.Lock()
        #: One landing at a time: a flush waits for the one under way.
        self._landing = threading.Lock()

    def add(self, decisions: Sequence[Decision], in_half: bool) -> None:
        """Keep ``decisions`` (won by their objects) for the next :meth:`land`; ``in_half``:
        their decider read these transactions in ``half`` (the check-back job), so no intake
        object of theirs needs landing first."""
        with self._queue_lock:
            self._unlanded.extend(decisions)
            if in_half:
                self._in_half.update(d.transaction_id for d in decisions)

    def land(self) -> int:
        """Record in ``op`` the decisions kept so far, in one commit; return how many COMMITs
        that was. One landing at a time: a call waits for the one under way. A failed landing
        keeps its decisions for the next."""
        with self._landing:
            # The decisions first, then their half messages: each of these transactions was
            # staged before it was decided, so the intake objects staged by now hold all of
            # them (taken the other way round, a send staged and decided while its intake
            # landing was under way would reach op first: see rmq_spark.store.intake).
            with self._queue_lock:
                batch, self._unlanded = self._unlanded, []
            # A transaction decided twice here (a rival refused): its object's decision, once.
            first: dict[str, Decision] = {}
            for d in batch:
                first.setdefault(d.transaction_id, d)
            batch = list(first.values())
            landed: list[str] = []
            try:
                if self._staging is not None:
                    landed, removed = self._staging.land()
                    # Landed by another process while this one was stalled, and removed from
                    # half by retention since: decided and published long ago.
                    batch = [d for d in batch if d.transaction_id not in removed]
                if batch:
                    self._land_halves([d.transaction_id for d in batch], landed)
                    self._land(batch)
            except BaseException:
                with self._queue_lock:
                    self._unlanded[:0] = batch
                raise
            finally:
                if self._staging is not None:
                    self._staging.delete(landed)
            return sum(d.state is LocalTransactionState.COMMIT for d in batch)

    def missing(self, transaction_ids: list[str]) -> set[str]:
        """Those of ``transaction_ids`` the store holds no half message of: a decision for one
        would be recorded for nothing (rule 7), or, after retention removed a transaction
        decided long ago, against the decision its consumers saw (rule 3).

        A transaction this process made less than :data:`LATE_END_SECONDS` ago (on
        :func:`~rmq_spark.model.clock.elapsed`, which counts a SIGSTOP or a suspend) is there:
        check-back decides none before the transaction timeout (6 s) and retention removes a
        decided one days later. The others (sent by another process, or ended late: after an
        UNKNOWN, or a stop) are looked for in the intake objects, then in ``half`` (only their
        ids are read): an object landed after the listing is in ``half`` by then (a landing
        deletes an object after its commit). What this does not see (docs/limitations.md): a
        pause the guest's clocks do not count (a hypervisor's pause or a live migration) within
        that second, or any stop between this look and the decision; and on a store whose
        listings lag behind its puts (not S3, MinIO or a local disk), a send just staged by
        another process, reported ``NOT_FOUND`` and left to check-back.
        """
        made = self._made.after(transaction_ids, elapsed() - LATE_END_SECONDS)
        strangers = [t for t in transaction_ids if t not in made]
        if strangers and self._intake is not None:
            covered = self._intake.covering(strangers)
            strangers = [t for t in strangers if t not in covered]
        if not strangers:
            return set()
        return set(strangers) - held_in_half(self._tables, strangers)

    def _land_halves(self, transaction_ids: Sequence[str], landed: Sequence[str]) -> None:
        """Land the intake objects of the shard when a transaction of ``transaction_ids`` was
        not prepared by this process (whose own objects :meth:`land` landed already): its half
        messages may still be in an intake object of another process, and ``op`` must not
        hold a decision before ``half`` holds its messages. ``landed``: the objects this
        process has just landed (not deleted yet), which hold none of those."""
        with self._queue_lock:
            read = {t for t in transaction_ids if t in self._in_half}
            self._in_half -= read
        strangers = [t for t in transaction_ids if object_decided(t) and t not in read]
        made = self._made.after(strangers, float("-inf"))
        if len(made) < len(strangers) and self._intake is not None:
            # Only the objects whose id range covers them: the others' writers land those.
            covering = [t for t in strangers if t not in made]
            self._intake.recover(0.0, covering=covering, just_landed=landed)

    def _land(self, decisions: list[Decision]) -> None:
        """Record in ``op`` decisions their objects decided (one per transaction)."""
        recorded = self._record(decisions)
        wrong = [d for d in decisions if recorded.get(d.transaction_id, d.state) != d.state]
        if wrong:
            log.error(
                "op records %s for transaction %s against its decision object's %s: another "
                "writer (an rmq-spark before decision objects, or a foreign Delta writer) "
                "decided it there; consumers see op's decision",
                recorded[wrong[0].transaction_id].value,
                wrong[0].transaction_id,
                wrong[0].state.value,
            )
