"""The check-back job: reconcile ``op`` against ``half`` and resolve pending transactions.

RocketMQ's compensation loop (``TransactionalMessageCheckService``) as a Spark job. One round:

1. **Pending** = half messages with no op record (an anti-join; nothing already decided is
   ever checked, unlike apache/rocketmq#1517), kept incrementally in the ``pending`` table
   (:mod:`rmq_spark.checkback.pending`).
2. **Check batch** (:mod:`rmq_spark.checkback.batch`): pending transactions classified by age
   against the transaction timeout, their check immunity and the max check age.
3. **Routing** (:mod:`rmq_spark.checkback.routing`): each producer group's checker answers
   COMMIT / ROLLBACK / UNKNOWN, on Spark's executors; a failing group does not stop the others.
4. **Decisions** (:mod:`rmq_spark.checkback.decisions`) go through the producers'
   end-transaction path, so the first decision wins and nothing is published twice, whoever
   races; a decision another Delta writer removed from ``op`` is recorded again, never
   published again. UNKNOWN spends one check (:mod:`rmq_spark.checkback.state`); at
   ``transaction_check_max`` the transaction is rolled back and its messages recorded in
   ``discard`` (:mod:`rmq_spark.checkback.discards`).
5. **Report** (:mod:`rmq_spark.checkback.summary`): every run writes a row to ``check_runs``
   and returns a :class:`CheckBackResult` whose ``check_batch`` DataFrame shows what was asked
   and why.

Keeps DESIGN.md section 3, rule 6 as a whole (RocketMQ's check-back loop, through the modules
above): one group's checker failing, or the job dying, never holds back the groups already
done, since each group's answers are applied before the next group is asked; a transactional
writer's transaction never spends the check budget (only its epoch decides its fate). Keeps
rule 9: a round reads what is pending and what was added since the last round, never the
decided history.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rmq_spark.checkback.batch import CHECK, NOT_YET_DUE, TOO_OLD, UNROUTED, check_batch
from rmq_spark.checkback.checkers import Checker
from rmq_spark.checkback.decisions import DECIDED_BY_CHECKER, decide, recover_removed
from rmq_spark.checkback.discards import DECIDED_BY_CHECK_MAX, insert_discards, repair_discards
from rmq_spark.checkback.epoch_checker import WRITER_ALIVE, EpochChecker
from rmq_spark.checkback.pending import PendingUpdate, update_pending
from rmq_spark.checkback.routing import ANSWERS_ARROW, ANSWERS_DDL, ask, misconfigured
from rmq_spark.checkback.state import STATE_COLUMNS, start_clocks, update_check_state
from rmq_spark.checkback.summary import CheckBackResult, record_run
from rmq_spark.model.config import RetentionSettings, TransactionSettings
from rmq_spark.model.messages import new_id
from rmq_spark.store.facade import Store
from rmq_spark.store.retention import maintain

log = logging.getLogger(__name__)


def _utcnow() -> datetime:
    return datetime.now(UTC)


class CheckBackJob:
    """Resolve pending transactions of a store.

    Parameters
    ----------
    spark : SparkSession
        Session with Delta Lake (see :func:`rmq_spark.get_spark`).
    store : Store
        The store to reconcile.
    checkers : mapping of producer group to Checker
        Routing: which checker answers for which producer group.
    settings : TransactionSettings, optional
        Timeout, check max and max check age (RocketMQ defaults).
    skip_unrouted : bool, default False
        Pending transactions of groups without a checker are an error at start unless this is
        set; then they are left pending and reported as ``unrouted``.
    retention : RetentionSettings, optional
        When given, :meth:`run_forever` also runs maintenance (:func:`rmq_spark.store.retention.
        maintain`) every ``retention.maintenance_interval``.
    clock : callable, optional
        Returns the current UTC time (tests move it).

    Examples
    --------
    >>> job = CheckBackJob(spark, store, {"order-service": CallableChecker("svc:check")})
    >>> print(job.run_once().summary.format())
    """

    def __init__(
        self,
        spark: SparkSession,
        store: Store,
        checkers: Mapping[str, Checker],
        settings: TransactionSettings | None = None,
        *,
        skip_unrouted: bool = False,
        retention: RetentionSettings | None = None,
        clock: Callable[[], datetime] = _utcnow,
    ) -> None:
        self.spark = spark
        self.store = store
        self.checkers = dict(checkers)
        self.settings = settings or TransactionSettings()
        self.skip_unrouted = skip_unrouted
        self.retention = retention
        self.clock = clock
        #: This run's pending transactions (set when its check batch is made).
        self._pending: PendingUpdate | None = None
        #: This run's misconfigured checkers: ``{group: what is wrong}``.
        self._broken: dict[str, str] = {}

    # ------------------------------------------------------------------ entry points
    def run_once(self) -> CheckBackResult:
        """One check-back round. Always records a ``check_runs`` row, even when it fails."""
        run_id, started = new_id(), self.clock()
        counts: Counter[str] = Counter()
        batch: DataFrame | None = None
        oldest: float | None = None
        status, message = "finished", None
        try:
            self._broken = misconfigured(self.spark, self.checkers)
            self.store.publish()  # finish publishes cut off by a crash, before reading state
            repair_discards(self.store, self.settings.transaction_check_max, self.clock)
            batch = self._check_batch(started)
            pending = batch.drop("body", "properties").toArrow()
            reasons = Counter(pending.column("reason").to_pylist())
            counts["pending_found"] = pending.num_rows
            counts["not_yet_due"] = reasons[NOT_YET_DUE]
            counts["skipped_for_age"] = reasons[TOO_OLD]
            counts["unrouted"] = reasons[UNROUTED]
            oldest = pc.max(pending.column("age_seconds")).as_py()
            self._report_unrouted(pending)
            answers, ended = self._check_groups(batch, pending, started, counts)
            self._start_clocks(pending, ended)
            batch = batch.join(
                self.spark.createDataFrame(answers, ANSWERS_DDL), "transaction_id", "left"
            )
            self.store.publish()
        except Exception as exc:
            status, message = "failed", f"{type(exc).__name__}: {exc}"[:1000]
            raise
        finally:
            summary = record_run(
                self.store, run_id, started, self.clock(), counts, oldest, status, message
            )
            log_level = logging.INFO if status == "finished" else logging.ERROR
            log.log(log_level, "%s", summary.format())
        assert batch is not None
        return CheckBackResult(summary, batch)

    def run_forever(self, interval: float, stop: threading.Event) -> int:
        """Run a round every ``interval`` seconds until ``stop`` is set; return rounds run.

        A failing round is logged and the loop goes on (the next round starts from the
        tables, so nothing is left behind).
        """
        rounds = 0
        maintained: float | None = None
        while not stop.is_set():
            started = time.monotonic()
            try:
                self.run_once()
            except Exception:
                log.exception("check-back round failed; retrying in %.0f s", interval)
            rounds += 1
            if self._maintenance_due(maintained):
                maintained = time.monotonic()
                try:
                    maintain(self.store, self.retention, clock=self.clock)
                except Exception:
                    log.exception("maintenance failed; the next one starts from the tables")
            stop.wait(max(0.0, interval - (time.monotonic() - started)))
        log.info("check-back loop stopped after %d round(s)", rounds)
        return rounds

    def _maintenance_due(self, last: float | None) -> bool:
        if self.retention is None or self.retention.maintenance_interval <= 0:
            return False
        return last is None or time.monotonic() - last >= self.retention.maintenance_interval

    # ------------------------------------------------------------------ steps
    def _check_batch(self, now: datetime) -> DataFrame:
        """Pending transactions, classified, frozen for the rest of the run."""
        self._pending = update_pending(self.store)
        return check_batch(
            self.spark, self.store, self._pending.rows, self.checkers, self.settings, now
        )

    def _report_unrouted(self, pending: pa.Table) -> None:
        """Warn about pending transactions of groups with no checker (left pending, counted
        as unrouted: UNKNOWN for their group, never the end of the round or of the loop);
        with ``skip_unrouted`` they are expected, and only counted."""
        unrouted = pending.filter(pc.equal(pending.column("reason"), UNROUTED))
        if unrouted.num_rows and not self.skip_unrouted:
            groups = sorted(set(unrouted.column("producer_group").to_pylist()))
            log.warning(
                "%d pending transaction(s) belong to producer group(s) with no checker: %s; "
                "they stay pending. Add [checkers.<group>] to conf/rmq-spark.toml (or pass them "
                "to CheckBackJob), or run with skip_unrouted / --skip-unrouted if that is meant.",
                unrouted.num_rows,
                ", ".join(groups),
            )

    def _check_groups(
        self, batch: DataFrame, pending: pa.Table, now: datetime, counts: Counter[str]
    ) -> tuple[pa.Table, set[str]]:
        """Ask each group's checker and apply its answers before the next group, so one
        group failing (or the job dying) never holds back the groups already done.

        Returns the answers and the transactions that are now decided."""
        due = pending.filter(pc.equal(pending.column("reason"), CHECK))
        ended = recover_removed(self.store, due, counts)
        if ended:
            gone = pa.array(sorted(ended), pa.string())
            due = due.filter(pc.invert(pc.is_in(due.column("transaction_id"), value_set=gone)))
            batch = batch.where(~F.col("transaction_id").isin(gone.to_pylist()))
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
        self, group: str, epoch_message: bool, batch: DataFrame, ids: pa.ChunkedArray
    ) -> pa.Table:
        """The answers of ``group``'s checker (or the epoch checker) about ``ids``."""
        checker = EpochChecker(self.store, self.clock) if epoch_message else self.checkers[group]
        broken = None if epoch_message else self._broken.get(group)
        return ask(checker, group, epoch_message, batch, ids, broken)

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
        check_max = self.settings.transaction_check_max
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
        """Record the discards of transactions this job rolled back at its check max."""
        insert_discards(self.store, transaction_ids, now, self.settings.transaction_check_max)
