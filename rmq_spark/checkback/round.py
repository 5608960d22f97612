"""One check-back round on one store: a shard's (:mod:`rmq_spark.store.shards`).

The steps of a round (:mod:`rmq_spark.checkback.job` says what each keeps): publish what a
crash cut off, repair discards, make the check batch, ask each group's checker and apply its
answers, start the clocks of new pending transactions, record the run in ``check_runs``. Each
shard has its own ``pending``, ``check_state``, ``discard`` and ``check_runs``, so a round on a
shard's :class:`Store` is the round on a store of one shard; :class:`CheckBackJob
<rmq_spark.checkback.job.CheckBackJob>` runs one on every shard.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.checkback.batch import (
    CHECK,
    MISPLACED,
    NOT_YET_DUE,
    TOO_OLD,
    UNROUTED,
    check_batch,
)
from rmq_spark.checkback.decisions import (
    DECIDED_BY_CHECKER,
    ObjectLooks,
    decide,
    recover_unrecorded,
)
from rmq_spark.checkback.discards import DECIDED_BY_CHECK_MAX, insert_discards, repair_discards
from rmq_spark.checkback.epoch_checker import WRITER_ALIVE, EpochChecker
from rmq_spark.checkback.pending import PendingUpdate, update_pending
from rmq_spark.checkback.routing import ANSWERS_ARROW, ask, with_answers
from rmq_spark.checkback.state import STATE_COLUMNS, start_clocks, update_check_state
from rmq_spark.checkback.summary import CheckBackSummary, record_run
from rmq_spark.store.facade import Store

if TYPE_CHECKING:
    from rmq_spark.checkback.job import CheckBackJob

log = logging.getLogger("rmq_spark.checkback.job")


@dataclass(frozen=True)
class RoundResult:
    """A round's summary and its check batch, in Arrow (the job shows its shards' rounds as
    one DataFrame)."""

    summary: CheckBackSummary
    batch: pa.Table


class CheckRound:
    """One check-back round of ``job`` on ``store`` (the job's store, or one of its shards).

    Parameters
    ----------
    job : CheckBackJob
        The job: its Spark session, checkers, settings and clock.
    store : Store
        The store (shard) the round resolves.
    broken : dict of str to str
        This run's misconfigured checkers, ``{group: what is wrong}``.
    looks : ObjectLooks
        Whose decision objects the job's rounds on this store read.
    """

    def __init__(
        self, job: CheckBackJob, store: Store, broken: dict[str, str], looks: ObjectLooks
    ) -> None:
        self.job = job
        self.store = store
        self._broken = broken
        self._looks = looks
        #: This round's pending transactions (set when its check batch is made).
        self._pending: PendingUpdate | None = None
        #: The round's summary, once recorded (a failed round's too).
        self.summary: CheckBackSummary | None = None

    def run(self, run_id: str) -> RoundResult:
        """Run the round; always records a ``check_runs`` row, even when it fails."""
        started = self.job.clock()
        counts: Counter[str] = Counter()
        batch: pa.Table | None = None
        oldest: float | None = None
        status, message = "finished", None
        try:
            self.store.publish()  # finish publishes cut off by a crash, before reading state
            repair_discards(self.store, self.job.settings.transaction_check_max, self.job.clock)
            batch = self._check_batch(started)
            pending = batch.drop_columns(["body", "properties"])
            counts["pending_found"] = pending.num_rows
            counts.update(_left_counts(pending))
            oldest = pc.max(pending.column("age_seconds")).as_py()
            self._report_unrouted(pending)
            answers, ended = self._check_groups(batch, pending, started, counts)
            self._start_clocks(pending, ended)
            batch = with_answers(batch, answers)
            self.store.publish()
        except Exception as exc:
            status, message = "failed", f"{type(exc).__name__}: {exc}"[:1000]
            raise
        finally:
            self.summary = record_run(
                self.store, run_id, started, self.job.clock(), counts, oldest, status, message
            )
            log_level = logging.INFO if status == "finished" else logging.ERROR
            log.log(log_level, "%s", self.summary.format())
        assert batch is not None
        return RoundResult(self.summary, batch)

    def _check_batch(self, now: datetime) -> pa.Table:
        """Pending transactions, classified, frozen for the rest of the run."""
        # Half messages still in intake objects their writer left (killed) are pending too.
        self.store.land_intake(self.job.settings.transaction_timeout, now.timestamp())
        self._pending = update_pending(self.store)
        return check_batch(
            self.store,
            self._pending.rows,
            self.job.checkers,
            self.job.settings,
            now,
            self._pending.stored_ages,
        )

    def _report_unrouted(self, pending: pa.Table) -> None:
        """Warn about pending transactions of groups with no checker (left pending, counted
        as unrouted: UNKNOWN for their group, never the end of the round or of the loop);
        with ``skip_unrouted`` they are expected, and only counted."""
        misplaced = pending.filter(pc.equal(pending.column("reason"), MISPLACED))
        if misplaced.num_rows:
            log.warning(
                "shard %d: %d pending transaction(s) have ids of another shard (e.g. %s), which "
                "only another Delta writer can have written into this shard's half table; they "
                "stay pending and are never decided. Remove those rows if they are not yours.",
                self.store.shard,
                misplaced.num_rows,
                misplaced.column("transaction_id")[0],
            )
        unrouted = pending.filter(pc.equal(pending.column("reason"), UNROUTED))
        if unrouted.num_rows and not self.job.skip_unrouted:
            groups = sorted(set(unrouted.column("producer_group").to_pylist()))
            log.warning(
                "%d pending transaction(s) belong to producer group(s) with no checker: %s; "
                "they stay pending. Add [checkers.<group>] to conf/rmq-spark.toml (or pass them "
                "to CheckBackJob), or run with skip_unrouted / --skip-unrouted if that is meant.",
                unrouted.num_rows,
                ", ".join(groups),
            )

    def _check_groups(
        self, batch: pa.Table, pending: pa.Table, now: datetime, counts: Counter[str]
    ) -> tuple[pa.Table, set[str]]:
        """Ask each group's checker and apply its answers before the next group, so one
        group failing (or the job dying) never holds back the groups already done.

        Returns the answers and the transactions that are now decided."""
        due = pending.filter(pc.equal(pending.column("reason"), CHECK))
        # Decisions a killed decider left in their objects are recorded whatever the routing,
        # age cap or immunity: nothing but the transaction timeout holds them back.
        ripe = pending.filter(
            pc.and_(
                pc.greater_equal(
                    pending.column("age_seconds"), self.job.settings.transaction_timeout
                ),
                pc.not_equal(pending.column("reason"), MISPLACED),
            )
        )
        picked = self._looks.pick(ripe)
        try:
            ended = recover_unrecorded(self.store, due, picked, counts)
        except Exception:
            self._looks.forget(picked)  # not read after all
            raise
        if ended:
            gone = pa.array(sorted(ended), pa.string())
            due = due.filter(pc.invert(pc.is_in(due.column("transaction_id"), value_set=gone)))
            # Recorded from their objects: not left pending for their reason after all.
            counts.subtract(
                _left_counts(pending.filter(pc.is_in(pending.column("transaction_id"), gone)))
            )
            batch = batch.filter(pc.invert(pc.is_in(batch.column("transaction_id"), gone)))
        answers = [ANSWERS_ARROW.empty_table()]
        for group in sorted(set(due.column("producer_group").to_pylist())):
            mine = due.filter(pc.equal(due.column("producer_group"), group))
            # Messages staged by transactional writers go to the built-in epoch checker.
            for epoch_message in (False, True):
                part = mine.filter(pc.equal(mine.column("epoch_message"), epoch_message))
                if part.num_rows:
                    answer = self._ask(group, epoch_message, batch, part.column("transaction_id"))
                    ended |= self._apply(part, answer, now, counts, budget=not epoch_message)
                    answers.append(answer)
        return pa.concat_tables(answers), ended

    def _ask(
        self, group: str, epoch_message: bool, batch: pa.Table, ids: pa.ChunkedArray
    ) -> pa.Table:
        """The answers of ``group``'s checker (or the epoch checker) about ``ids``."""
        checker = (
            EpochChecker(self.job.store.shard_store(0), self.job.clock)
            if epoch_message
            else self.job.checkers[group]
        )
        broken = None if epoch_message else self._broken.get(group)
        return ask(self.job.spark, checker, group, epoch_message, batch, ids, broken)

    def _apply(
        self,
        due: pa.Table,
        answers: pa.Table,
        now: datetime,
        counts: Counter[str],
        *,
        budget: bool = True,
    ) -> set[str]:
        """Record decisions, check counts and discards for one group's answers.

        Without ``budget`` (transactions of transactional writers) the check max never rolls
        a transaction back: only its epoch decides its fate (see :mod:`rmq_spark.spark.epochs`).
        """
        by_id = {r["transaction_id"]: r for r in due.select(STATE_COLUMNS).to_pylist()}
        rows = [{**by_id[a["transaction_id"]], **a} for a in answers.to_pylist()]
        alive = [r for r in rows if r["answer"] == WRITER_ALIVE]
        rows = [r for r in rows if r["answer"] != WRITER_ALIVE]
        counts["not_yet_due"] += len(alive)
        counts["checked"] += len(rows)
        counts["errors"] += sum(1 for r in rows if r["error"])
        decided = [r for r in rows if r["answer"] in ("COMMIT", "ROLLBACK")]
        undecided = [r for r in rows if r["answer"] not in ("COMMIT", "ROLLBACK")]
        check_max = self.job.settings.transaction_check_max
        spent = [budget and r["check_count"] + 1 >= check_max for r in undecided]
        at_max = [r for r, out in zip(undecided, spent, strict=True) if out]
        still_unknown = [r for r, out in zip(undecided, spent, strict=True) if not out]

        decide(self.store, decided, DECIDED_BY_CHECKER, counts)
        discarded = decide(
            self.store, [{**r, "answer": "ROLLBACK"} for r in at_max], DECIDED_BY_CHECK_MAX, counts
        )
        counts["discarded"] += len(discarded)
        counts["unknown"] += len(still_unknown)
        self._insert_discards(discarded, now)
        update_check_state(
            self.store,
            [{**r, "new_count": r["check_count"] + 1, "checked_at": now} for r in still_unknown]
            # A live writer's transaction is not checked: its clock starts, its count stays.
            + [{**r, "new_count": r["check_count"], "checked_at": None} for r in alive],
        )
        return {r["transaction_id"] for r in decided + at_max}

    def _start_clocks(self, pending: pa.Table, ended: set[str]) -> None:
        """Record when pending transactions were first seen; forget decided ones."""
        assert self._pending is not None
        pending_ids = set(self._pending.rows.column("transaction_id").to_pylist())
        start_clocks(self.store, pending, pending_ids, ended)

    def _insert_discards(self, transaction_ids: list[str], now: datetime) -> None:
        """Record the discards of transactions this round rolled back at its check max."""
        insert_discards(self.store, transaction_ids, now, self.job.settings.transaction_check_max)


def _left_counts(pending: pa.Table) -> Counter[str]:
    """The summary's counts of ``pending`` transactions left pending for their reason."""
    reasons = Counter(pending.column("reason").to_pylist())
    return Counter(
        not_yet_due=reasons[NOT_YET_DUE],
        skipped_for_age=reasons[TOO_OLD],
        unrouted=reasons[UNROUTED] + reasons[MISPLACED],
    )
