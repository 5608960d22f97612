"""The check-back job: reconcile ``op`` against ``half`` and resolve pending transactions.

RocketMQ's compensation loop (``TransactionalMessageCheckService``) as a Spark job:

1. **Pending** = half messages with no op record (an anti-join; nothing already decided is
   ever checked, unlike apache/rocketmq#1517), kept incrementally in the ``pending`` table
   (:mod:`rmq_spark.checkback.pending`): a round reads what is pending and what was added since the
   last round, never the decided history (rule 9). Bodies are read by id for the due
   transactions only.
2. **Check batch**: pending transactions whose age is at least the transaction timeout and
   their own ``CHECK_IMMUNITY_TIME_IN_SECONDS``, and at most the maximum check age (older ones
   are skipped and reported). Ages are measured on this job's clock from when it first saw the
   transaction (``check_state.first_seen``), never on the producer's clock
   (apache/rocketmq#9640); immunity only delays the first check and never spends the check
   budget (apache/rocketmq#8311).
3. **Routing**: each producer group's checker answers COMMIT / ROLLBACK / UNKNOWN, on Spark's
   executors. A checker that raises counts as UNKNOWN; a failing group does not stop the
   others (apache/rocketmq#9500).
4. **Decisions** go through the producers' end-transaction path, so the first decision wins
   and nothing is published twice, whoever races. UNKNOWN increments the check count with a
   conditional MERGE, so two jobs running the same batch count once. At
   ``transaction_check_max`` the transaction is rolled back and its messages recorded in the
   ``discard`` table (RocketMQ's ``TRANS_CHECK_MAX_TIME_TOPIC``), from where
   :func:`redrive` puts them back into the cycle, each message exactly once (claim with a
   conditional MERGE, then stage with an insert-if-absent MERGE; see its notes).
5. **Check state** (``first_seen``, ``check_count``) is forgotten only for transactions that
   have an ``op`` row, never for ones missing from this run's snapshot: a concurrent job with
   a newer snapshot may have just recorded them, and forgetting would postpone their check
   max and max age for ever.
6. **Discard repair**: a check-max rollback whose discard write a crash cut off is found among
   the ``op`` rows inserted since the op version recorded in ``discard``.

Every run writes a row to ``check_runs`` and returns a :class:`CheckBackResult` whose
``check_batch`` DataFrame shows what was asked and why.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import UTC, datetime

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import DeltaError
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rmq_spark.checkback.checkers import Checker, CheckerConfigError
from rmq_spark.checkback.epoch_checker import WRITER_ALIVE, EpochChecker
from rmq_spark.checkback.pending import PendingUpdate, inserted_since, update_pending
from rmq_spark.model.config import RetentionSettings, TransactionSettings
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import PROPERTY_CHECK_IMMUNITY, LocalTransactionState, new_id
from rmq_spark.model.schema import (
    CHECK_RUNS_SCHEMA,
    CHECK_STATE_SCHEMA,
    DISCARD_SCHEMA,
    HALF_MESSAGE_SCHEMA,
    HALF_SCHEMA,
)
from rmq_spark.store.facade import DECIDED_BY_RECOVERY, Decision, EndTransactionStatus, Store
from rmq_spark.store.retention import maintain

log = logging.getLogger(__name__)

#: ``op.decided_by`` of transactions rolled back for reaching the check max.
DECIDED_BY_CHECK_MAX = "check-back:check-max"
DECIDED_BY_CHECKER = "check-back"

#: Reasons in the check batch.
CHECK, NOT_YET_DUE, TOO_OLD, UNROUTED = (
    "check",
    "not yet due",
    "older than max check age",
    ("no checker for producer group"),
)
_DECISION_CHUNK = 20_000
#: Application id under which ``discard`` records the ``op`` version up to which every
#: check-max rollback has its discard rows.
DISCARD_CURSOR_APP_ID = "rmqtx.discard.op_version"
#: Op versions a discard repair may lag behind before it records how far it has looked.
_DISCARD_CURSOR_LAG = 20
_STATE_COLUMNS = ["transaction_id", "producer_group", "first_seen", "check_count"]
ANSWERS_DDL = "transaction_id string, answer string, error string"
_ANSWERS_ARROW = pa.schema(
    [("transaction_id", pa.string()), ("answer", pa.string()), ("error", pa.string())]
)


@dataclass(frozen=True)
class CheckBackSummary:
    """What one check-back run found and decided (also a row of ``check_runs``)."""

    run_id: str
    started: datetime
    finished: datetime
    duration_seconds: float
    pending_found: int
    checked: int
    committed: int
    rolled_back: int
    unknown: int
    already_decided: int
    discarded: int
    skipped_for_age: int
    not_yet_due: int
    unrouted: int
    errors: int
    oldest_pending_age_seconds: float | None
    status: str
    message: str | None

    def format(self) -> str:
        """A readable multi-line summary for logs and terminals."""
        oldest = (
            "-"
            if self.oldest_pending_age_seconds is None
            else f"{self.oldest_pending_age_seconds:,.1f} s"
        )
        rows = [
            ("pending found", self.pending_found, f"oldest pending: {oldest}"),
            ("checked", self.checked, "asked a checker this run"),
            ("committed", self.committed, "checker said COMMIT; now visible"),
            ("rolled back", self.rolled_back, "checker said ROLLBACK"),
            ("unknown", self.unknown, "asked again next run"),
            ("already decided", self.already_decided, "the producer decided first"),
            ("discarded", self.discarded, "rolled back at the check max; see discard table"),
            ("skipped for age", self.skipped_for_age, "older than the max check age"),
            ("not yet due", self.not_yet_due, "younger than timeout or immunity; writer alive"),
            ("unrouted", self.unrouted, "no checker configured for their producer group"),
            ("checker errors", self.errors, "checker raised; counted as unknown"),
        ]
        lines = [
            f"check-back run {self.run_id} {self.status} in {self.duration_seconds:.1f} s"
            + (f": {self.message}" if self.message else "")
        ]
        lines += [f"  {name:<16}{value:>10,}   {note}" for name, value, note in rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckBackResult:
    """A run's summary and its check batch.

    ``check_batch`` has one row per pending transaction: its representative message, the
    ``age_seconds``, ``check_count`` before the run, the ``reason`` it was checked or not,
    and the checker's ``answer`` and ``error`` (null when not asked).
    """

    summary: CheckBackSummary
    check_batch: DataFrame


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
    def _misconfigured(self) -> dict[str, str]:
        """``{group: what is wrong}`` for the checkers whose configuration is broken (a module
        that cannot be imported, a table that cannot be read), each logged as an error."""
        broken = {}
        for group, checker in self.checkers.items():
            try:
                checker.validate(self.spark)
            except Exception as exc:  # a module raising at import is a broken checker too
                detail = exc.message if isinstance(exc, CheckerConfigError) else repr(exc)
                broken[group] = f"producer group {group!r}: {detail}"
                log.error(
                    "%s; its transactions count as UNKNOWN this round, the other groups are "
                    "checked as usual",
                    broken[group],
                )
        return broken

    def run_once(self) -> CheckBackResult:
        """One check-back round. Always records a ``check_runs`` row, even when it fails."""
        run_id, started = new_id(), self.clock()
        counts: Counter[str] = Counter()
        batch: DataFrame | None = None
        oldest: float | None = None
        status, message = "finished", None
        try:
            self._broken = self._misconfigured()
            self.store.publish()  # finish publishes cut off by a crash, before reading state
            self._repair_discards()
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
            summary = self._record_run(run_id, started, counts, oldest, status, message)
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
        # Read whole now, not by Spark's Delta source: its snapshot reads the checkpoint when
        # the query runs, by when another job's log cleanup may have removed it.
        state = self._to_spark(
            self.store.read("check_state", ["transaction_id", "first_seen", "check_count"])
        )
        pending = self._to_spark(self._pending.rows)
        now_lit = F.lit(now).cast("timestamp")
        first_seen = F.coalesce(F.col("first_seen"), now_lit)
        age = F.unix_micros(now_lit) - F.unix_micros(first_seen)
        # try_cast: one message whose property is not a number (a sink stores any value) must
        # not fail the round for everyone (ANSI mode's CAST_INVALID_INPUT); it has no immunity,
        # and neither has a negative, infinite or NaN value (NaN sorts above every number).
        asked = F.col("properties").getItem(PROPERTY_CHECK_IMMUNITY).try_cast("double")
        immunity = F.when(
            (asked >= 0) & (asked < float("inf")) & ~F.isnan(asked),
            F.least(asked, F.lit(self.settings.max_check_age)),
        ).otherwise(F.lit(0.0))
        routed = list(self.checkers)
        group_routed = F.col("producer_group").isin(routed) if routed else F.lit(False)
        reason = (
            F.when(F.col("age_seconds") > self.settings.max_check_age, TOO_OLD)
            .when(~(group_routed | F.col("epoch_message")), UNROUTED)
            .when(
                F.col("age_seconds")
                < F.greatest(F.lit(self.settings.transaction_timeout), F.col("immunity_seconds")),
                NOT_YET_DUE,
            )
            .otherwise(CHECK)
        )
        classified = (
            pending.join(state, "transaction_id", "left")
            .select(
                "*",
                (age / 1e6).alias("age_seconds"),
                immunity.alias("immunity_seconds"),
                F.col("first_seen").isNull().alias("new"),
                # Set only by the sink and publish_with_delta_write, never from user input.
                F.col("sink_id").isNotNull().alias("epoch_message"),
            )
            .withColumn("first_seen", first_seen)
            .withColumn("check_count", F.coalesce("check_count", F.lit(0)).cast("int"))
            .withColumn("reason", reason)
        )
        # Frozen: the run writes op and check_state, which must not change what it decides.
        classified = classified.localCheckpoint(eager=True)
        return classified.join(self._bodies(classified), ["transaction_id", "msg_id"], "left")

    def _bodies(self, classified: DataFrame) -> DataFrame:
        """The bodies of the due transactions' representative messages, read by id."""
        due = classified.where(F.col("reason") == CHECK).select("transaction_id").toArrow()
        half = self.store.half_messages(due.column("transaction_id").to_pylist())
        return self._to_spark(half.select(["transaction_id", "msg_id", "body"]))

    def _to_spark(self, table: pa.Table) -> DataFrame:
        # Spark cannot take an Arrow table without chunks (an empty filter result).
        return self.spark.createDataFrame(table if table.num_rows else table.schema.empty_table())

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
        ended = self._recover_removed(due, counts)
        if ended:
            gone = pa.array(sorted(ended), pa.string())
            due = due.filter(pc.invert(pc.is_in(due.column("transaction_id"), value_set=gone)))
            batch = batch.where(~F.col("transaction_id").isin(gone.to_pylist()))
        answers = [_ANSWERS_ARROW.empty_table()]
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

    def _recover_removed(self, due: pa.Table, counts: Counter[str]) -> set[str]:
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
        published = self.store.published(ids)
        discarded = self.store.discarded(ids) - published
        if not published and not discarded:
            return set()
        rows = due.select(_STATE_COLUMNS).to_pylist()
        log.error(
            "%d pending transaction(s) were decided before, e.g. %s: another Delta writer "
            "removed their decisions from op (a RESTORE or DELETE); recording them again, "
            "%d already published as COMMIT (not published twice), %d discarded as ROLLBACK "
            "(see the README's Guarantees)",
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
            counts["already_decided"] += len(self._decide(again, decided_by, counts))
        return published | discarded

    def _ask(
        self, group: str, epoch_message: bool, batch: DataFrame, ids: pa.ChunkedArray
    ) -> pa.Table:
        checker = EpochChecker(self.store, self.clock) if epoch_message else self.checkers[group]
        broken = None if epoch_message else self._broken.get(group)
        log.info(
            "asking the %s checker of %r about %d transaction(s)", checker.kind, group, len(ids)
        )
        group_batch = batch.where(
            (F.col("reason") == CHECK)
            & (F.col("producer_group") == group)
            & (F.col("epoch_message") == epoch_message)
        )
        try:
            if broken is not None:
                raise CheckerConfigError(broken)
            answer = checker.check(group_batch).toArrow()
        except Exception as exc:
            log.error(
                "checker of producer group %r failed: %s; its transactions count "
                "as UNKNOWN this run",
                group,
                str(exc).splitlines()[0],
            )
            error = f"checker failed: {type(exc).__name__}: {exc}"[:500]
            answer = pa.table(
                {
                    "transaction_id": ids,
                    "state": [LocalTransactionState.UNKNOWN.value] * len(ids),
                    "error": [error] * len(ids),
                }
            )
        return answer.rename_columns(_ANSWERS_ARROW.names).cast(_ANSWERS_ARROW)

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
        by_id = {r["transaction_id"]: r for r in due.select(_STATE_COLUMNS).to_pylist()}
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

        self._decide(decided, DECIDED_BY_CHECKER, counts)
        discarded = self._decide(
            [{**r, "answer": "ROLLBACK"} for r in at_max], DECIDED_BY_CHECK_MAX, counts
        )
        counts["discarded"] += len(discarded)
        counts["unknown"] += len(still_unknown)
        self._insert_discards(discarded, now)
        self._update_check_state(
            [{**r, "new_count": r["check_count"] + 1, "checked_at": now} for r in still_unknown]
            # A live writer's transaction is not checked: its clock starts, its count stays.
            + [{**r, "new_count": r["check_count"], "checked_at": None} for r in alive]
        )
        return {r["transaction_id"] for r in decided + at_max}

    def _start_clocks(self, pending: pa.Table, ended: set[str]) -> None:
        """Record when pending transactions were first seen; forget decided ones."""
        new = pending.filter(
            pc.and_(pending.column("new"), pc.not_equal(pending.column("reason"), CHECK))
        )
        self._update_check_state(
            [
                {**r, "new_count": r["check_count"], "checked_at": None, "error": None}
                for r in new.select(_STATE_COLUMNS).to_pylist()
            ]
        )
        self._forget(ended)

    def _decide(
        self, rows: Sequence[Mapping[str, object]], decided_by: str, counts: Counter[str]
    ) -> list[str]:
        """End transactions in chunks; return the ids this run decided."""
        applied: list[str] = []
        for start in range(0, len(rows), _DECISION_CHUNK):
            chunk = rows[start : start + _DECISION_CHUNK]
            results = self.store.end_transactions(
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

    def _update_check_state(self, updates: list[dict[str, object]]) -> None:
        if not updates:
            return
        source = pa.Table.from_pylist(
            [
                {
                    "transaction_id": u["transaction_id"],
                    "producer_group": u["producer_group"],
                    "first_seen": u["first_seen"],
                    "check_count": u["new_count"],
                    "last_check_timestamp": u["checked_at"],
                    "last_error": u["error"],
                    "expected_count": u["check_count"],
                }
                for u in updates
            ],
            schema=CHECK_STATE_SCHEMA.append(pa.field("expected_count", pa.int32())),
        )
        self.store.merge(
            "check_state",
            source,
            "transaction_id",
            lambda m: m.when_matched_update(
                {
                    "check_count": "s.check_count",
                    "last_check_timestamp": "s.last_check_timestamp",
                    "last_error": "s.last_error",
                },
                # Two jobs that checked the same batch count once.
                predicate="t.check_count = s.expected_count",
            ).when_not_matched_insert({c: f"s.{c}" for c in CHECK_STATE_SCHEMA.names}),
        )

    def _forget(self, ended: set[str]) -> None:
        """Drop the check_state rows of transactions that are over: decided (``ended`` by
        this run, or with an ``op`` row), or with no half message left (retention removed
        them after their decision; a pending transaction's half messages are never removed).
        Never by absence from this run's snapshot: a concurrent job with a newer snapshot may
        have recorded a transaction this run never saw, and forgetting it would restart its
        clock and check count, postponing check max and max age for ever. Only rows of
        transactions outside this run's pending ones are looked up, so the cost follows the
        pending transactions, not the history."""
        assert self._pending is not None
        known = self.store.read("check_state", ["transaction_id"])
        known_ids = set(known.column("transaction_id").to_pylist())
        pending_ids = set(self._pending.rows.column("transaction_id").to_pylist())
        unsure = sorted(known_ids - ended - pending_ids)
        decided = set(self.store.decisions(unsure))
        undecided = [t for t in unsure if t not in decided]
        staged = set(self.store.half_messages(undecided).column("transaction_id").to_pylist())
        gone = (known_ids & ended) | decided | (set(undecided) - staged)
        if gone:
            ids = pa.table({"transaction_id": pa.array(sorted(gone), pa.string())})
            self.store.merge(
                "check_state", ids, "transaction_id", lambda m: m.when_matched_delete()
            )

    def _repair_discards(self) -> None:
        """Record check-max rollbacks whose discard write was cut off by a crash.

        Reads the ``op`` rows inserted since the op version recorded in ``discard`` (an
        application transaction, recorded with the repairs, or when it lags
        ``_DISCARD_CURSOR_LAG`` op versions behind), so the cost follows the new decisions.
        """
        discard = self.store.table("discard")
        cursor = discard.transaction_version(DISCARD_CURSOR_APP_ID)
        op = self.store.table("op")
        version = op.version()
        if cursor is not None and cursor >= version:
            return
        maxed = self._check_max_rollbacks(op, cursor)
        missing = sorted(set(maxed) - self.store.discarded(maxed))
        if missing or cursor is None or version - cursor >= _DISCARD_CURSOR_LAG:
            self._insert_discards(missing, self.clock(), op_version=version)

    def _check_max_rollbacks(self, op: DeltaTable, cursor: int | None) -> list[str]:
        """Transactions rolled back at the check max in ``op`` versions after ``cursor``."""
        if cursor is not None:
            try:
                return [
                    r["transaction_id"]
                    for r in inserted_since(
                        op, cursor, ["transaction_id", "decided_by"]
                    ).to_pylist()
                    if r["decided_by"] == DECIDED_BY_CHECK_MAX
                ]
            except (DeltaError, OSError, pa.ArrowException) as exc:
                log.warning(
                    "op change feed unreadable (%s); scanning op for check-max rollbacks", exc
                )
        maxed = self.store.query("op", f"decided_by = '{DECIDED_BY_CHECK_MAX}'")
        return maxed.column("transaction_id").to_pylist()

    def _insert_discards(
        self, transaction_ids: list[str], now: datetime, *, op_version: int | None = None
    ) -> None:
        """Record discards; with ``op_version``, in the same commit record that every
        check-max rollback up to that ``op`` version has its discard rows."""
        cursor = None if op_version is None else {DISCARD_CURSOR_APP_ID: op_version}
        if not transaction_ids:
            if cursor is not None:
                self.store.append("discard", DISCARD_SCHEMA.empty_table(), cursor)
            return
        half = self.store.half_messages(transaction_ids)
        n = half.num_rows
        rows = pa.Table.from_arrays(
            [half.column(c) for c in HALF_MESSAGE_SCHEMA.names]
            + [
                pa.array([self.settings.transaction_check_max] * n, pa.int32()),
                pa.array([now] * n, DISCARD_SCHEMA.field("discarded_timestamp").type),
                pa.nulls(n, pa.string()),
            ],
            schema=DISCARD_SCHEMA,
        )
        # A re-driven message keeps its msg_id: each discarded transaction has its own row.
        self.store.merge(
            "discard",
            rows,
            ["transaction_id", "msg_id"],
            lambda m: m.when_not_matched_insert_all(),
            None
            if cursor is None
            else CommitProperties(app_transactions=[Transaction(*c) for c in cursor.items()]),
        )
        log.warning(
            "discarded %d message(s) after %d unanswered checks; inspect the discard "
            "table and re-drive with 'rmqtx resume'",
            n,
            self.settings.transaction_check_max,
        )

    def _record_run(
        self,
        run_id: str,
        started: datetime,
        counts: Counter[str],
        oldest: float | None,
        status: str,
        message: str | None,
    ) -> CheckBackSummary:
        finished = self.clock()
        values = {f.name: counts[f.name] for f in fields(CheckBackSummary) if f.type == "int"}
        summary = CheckBackSummary(
            run_id=run_id,
            started=started,
            finished=finished,
            duration_seconds=(finished - started).total_seconds(),
            oldest_pending_age_seconds=oldest,
            status=status,
            message=message,
            **values,
        )
        try:
            self.store.append(
                "check_runs", pa.Table.from_pylist([asdict(summary)], CHECK_RUNS_SCHEMA)
            )
        except Exception:
            log.exception("could not record check-back run %s in check_runs", run_id)
        return summary


def redrive(store: Store, transaction_ids: Sequence[str] | None = None) -> list[str]:
    """Put discarded messages back into the check-back cycle.

    Each discarded message is prepared again as a half message of a new transaction (same
    ``msg_id``, property ``REDRIVEN_FROM_TRANSACTION_ID``), with a fresh check budget.

    Parameters
    ----------
    store : Store
        The store.
    transaction_ids : sequence of str, optional
        The discarded transactions to re-drive; all not yet re-driven when omitted.

    Returns
    -------
    list of str
        The new transaction ids this call claimed or staged.

    Raises
    ------
    InvalidOptionError
        One of ``transaction_ids`` is not in the discard table, or was re-driven already.

    Notes
    -----
    Each message is re-driven exactly once, however many re-drives run at once and wherever
    one dies. First each discard row is *claimed*: a conditional MERGE sets its
    ``redriven_transaction_id`` only where it is still null, so of two racing re-drives one
    claims it (Delta refuses the other's commit, whose retry finds it claimed). Then every
    claimed row whose new half message is missing is *staged*, by a MERGE into ``half`` that
    inserts only when that (transaction, message) is absent: a re-drive that died between the
    two steps is finished by the next one, and two re-drives finishing the same row insert it
    once.
    """
    discard = store.read("discard")
    rows = [r for r in discard.to_pylist() if r["redriven_transaction_id"] is None]
    if transaction_ids is not None:
        wanted = set(transaction_ids)
        unstaged = {r["transaction_id"] for r in _claimed_unstaged(store, discard)}
        unknown = wanted - {r["transaction_id"] for r in rows} - unstaged
        if unknown:
            raise InvalidOptionError(
                f"not in the discard table (or already re-driven): {', '.join(sorted(unknown))}"
            )
        rows = [r for r in rows if r["transaction_id"] in wanted]
    claimed = _claim_discards(store, rows)
    failpoint("redrive.claimed")
    staged = _stage_redriven(store, _claimed_unstaged(store, store.read("discard")))
    if claimed or staged:
        log.info(
            "re-drove discarded messages into the check-back cycle: claimed %d, staged %d",
            len(claimed),
            len(staged),
        )
    return sorted(claimed | staged)


def _claim_discards(store: Store, rows: list[dict[str, object]]) -> set[str]:
    """Give each discarded transaction of ``rows`` a new transaction id, in the discard rows
    whose ``redriven_transaction_id`` is still null; return the new ids this call set."""
    if not rows:
        return set()
    new_ids = {r["transaction_id"]: new_id() for r in rows}
    marks = pa.table(
        {
            "transaction_id": pa.array([r["transaction_id"] for r in rows], pa.string()),
            "msg_id": pa.array([r["msg_id"] for r in rows], pa.string()),
            "redriven_transaction_id": pa.array(
                [new_ids[r["transaction_id"]] for r in rows], pa.string()
            ),
        }
    )
    metrics = store.merge(
        "discard",
        marks,
        ["transaction_id", "msg_id"],
        lambda m: m.when_matched_update(
            {"redriven_transaction_id": "s.redriven_transaction_id"},
            predicate="t.redriven_transaction_id IS NULL",
        ),
    )
    log.info(
        "claimed %d discarded message(s) for re-driving", metrics.get("num_target_rows_updated")
    )
    claimed = store.read("discard", ["redriven_transaction_id"])
    return set(new_ids.values()) & set(claimed.column(0).to_pylist())


def _claimed_unstaged(store: Store, discard: pa.Table) -> list[dict[str, object]]:
    """Discard rows claimed for re-driving whose new transaction is neither in ``half`` nor
    decided (a re-drive died before staging them)."""
    claimed = [r for r in discard.to_pylist() if r["redriven_transaction_id"] is not None]
    if not claimed:
        return []
    new_ids = sorted({r["redriven_transaction_id"] for r in claimed})
    half = store.half_messages(new_ids).select(["transaction_id", "msg_id"]).to_pylist()
    staged = {(h["transaction_id"], h["msg_id"]) for h in half}
    decided = store.decisions(new_ids)
    return [
        r
        for r in claimed
        if (r["redriven_transaction_id"], r["msg_id"]) not in staged
        and r["redriven_transaction_id"] not in decided
    ]


def _stage_redriven(store: Store, rows: list[dict[str, object]]) -> set[str]:
    """Insert the half messages of claimed discard rows, each only if absent from ``half``;
    return their new transaction ids, or none if a concurrent re-drive inserted them all."""
    if not rows:
        return set()
    now = store.clock()
    half = pa.Table.from_pylist(
        [
            {
                # Discard keeps no writer columns: a re-driven message is its group's own.
                **{c: r.get(c) for c in HALF_SCHEMA.names},
                "transaction_id": r["redriven_transaction_id"],
                "properties": list(dict(r["properties"] or ()).items())
                + [("REDRIVEN_FROM_TRANSACTION_ID", r["transaction_id"])],
                "store_timestamp": now,
            }
            for r in rows
        ],
        schema=HALF_SCHEMA,
    )
    metrics = store.merge(
        "half", half, ["transaction_id", "msg_id"], lambda m: m.when_not_matched_insert_all()
    )
    if not metrics.get("num_target_rows_inserted"):
        return set()  # a concurrent re-drive staged them first
    return set(half.column("transaction_id").to_pylist())
