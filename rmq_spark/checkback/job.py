"""The check-back job: reconcile ``op`` against ``half`` and resolve pending transactions.

RocketMQ's compensation loop (``TransactionalMessageCheckService``) as a Spark job. A round
runs on every shard of the store (:mod:`rmq_spark.store.shards`), one after the other, each
shard's with its own tables (:class:`rmq_spark.checkback.round.CheckRound`); one shard
failing does not stop the others. On each shard:

1. **Pending** = half messages with no op record (an anti-join; nothing already decided is
   ever checked, unlike apache/rocketmq#1517), kept incrementally in the ``pending`` table
   (:mod:`rmq_spark.checkback.pending`).
2. **Check batch** (:mod:`rmq_spark.checkback.batch`): pending transactions classified by age
   against the transaction timeout, their check immunity and the max check age, in Arrow: a
   round that asks no checker starts no Spark job.
3. **Routing** (:mod:`rmq_spark.checkback.routing`): each producer group's checker answers
   COMMIT / ROLLBACK / UNKNOWN, on Spark's executors; a failing group does not stop the others.
4. **Decisions** (:mod:`rmq_spark.checkback.decisions`) go through the producers'
   end-transaction path, so the first decision wins and nothing is published twice, whoever
   races; a decision another Delta writer removed from ``op`` is recorded again, never
   published again. UNKNOWN spends one check (:mod:`rmq_spark.checkback.state`); at
   ``transaction_check_max`` the transaction is rolled back and its messages recorded in
   ``discard`` (:mod:`rmq_spark.checkback.discards`).
5. **Report** (:mod:`rmq_spark.checkback.summary`): every run writes a row to each shard's
   ``check_runs`` and returns a :class:`CheckBackResult` whose ``check_batch`` DataFrame shows
   what was asked and why, over every shard.

Keeps docs/contract.md, rule 6 as a whole (RocketMQ's check-back loop, through the modules
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
from collections.abc import Mapping
from datetime import datetime

import pyarrow as pa
from pyspark.sql import SparkSession

from rmq_spark.checkback.batch import as_dataframe
from rmq_spark.checkback.checkers import Checker
from rmq_spark.checkback.decisions import ObjectLooks
from rmq_spark.checkback.discards import insert_discards
from rmq_spark.checkback.round import CheckRound, RoundResult
from rmq_spark.checkback.routing import misconfigured
from rmq_spark.checkback.summary import CheckBackResult, CheckBackSummary, combine_summaries
from rmq_spark.model.clock import Clock, in_utc, utc_now
from rmq_spark.model.config import RetentionSettings, TransactionSettings
from rmq_spark.model.messages import new_id
from rmq_spark.store.facade import Store
from rmq_spark.store.fanout import on_every_shard
from rmq_spark.store.retention import maintain

log = logging.getLogger(__name__)


class CheckBackJob:
    """Resolve pending transactions of a store.

    Parameters
    ----------
    spark : SparkSession
        Session with Delta Lake (see :func:`rmq_spark.get_spark`).
    store : Store
        The store to reconcile: each round covers every shard of it (:meth:`Store.shards`).
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
        Returns the current UTC time (tests move it; a naive time is read as UTC).

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
        clock: Clock = utc_now,
    ) -> None:
        self.spark = spark
        self.store = store
        self.checkers = dict(checkers)
        self.settings = settings or TransactionSettings()
        self.skip_unrouted = skip_unrouted
        self.retention = retention
        self.clock = in_utc(clock)
        #: Per shard, whose decision objects its rounds read (kept from round to round).
        self._looks: dict[int, ObjectLooks] = {}

    # ------------------------------------------------------------------ entry points
    def run_once(self) -> CheckBackResult:
        """One check-back round on every shard of the store (:meth:`Store.shards`).

        Each shard's round records its row in that shard's ``check_runs``, even when it
        fails; all rows of a run share its ``run_id``. On a store of one shard the result is
        that round's; with several, one summary of them all (counts summed, the oldest pending
        age the largest) and the union of their check batches.

        Raises
        ------
        ShardsFailedError
            With several shards, a round failed on some of them (the others were done); its
            ``result`` is the combined summary. On a store of one shard a failing round raises
            what it raised.
        """
        run_id = new_id()
        broken = misconfigured(self.spark, self.checkers)
        rounds: dict[int, CheckRound] = {}

        def run(shard: Store) -> RoundResult:
            looks = self._looks.setdefault(shard.shard, ObjectLooks())
            rounds[shard.shard] = CheckRound(self, shard, broken, looks)
            return rounds[shard.shard].run(run_id)

        def combine(
            results: dict[int, RoundResult], failures: dict[int, Exception]
        ) -> RoundResult | CheckBackSummary:
            summary = combine_summaries(
                {k: r.summary for k, r in sorted(rounds.items()) if r.summary is not None},
                sorted(failures),
            )
            log.log(
                logging.ERROR if failures else logging.INFO,
                "all %d shards: %s",
                len(rounds),
                summary.format(),
            )
            if failures:
                return summary  # what ShardsFailedError carries
            batches = [r.batch for _, r in sorted(results.items())]
            return RoundResult(summary, pa.concat_tables(batches))

        result = on_every_shard(self.store.shards(refresh=True), "check-back round", run, combine)
        assert isinstance(result, RoundResult)
        return CheckBackResult(result.summary, as_dataframe(self.spark, result.batch))

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

    def _insert_discards(self, transaction_ids: list[str], now: datetime) -> None:
        """Record the discards of transactions rolled back at the check max in the job's store."""
        insert_discards(self.store, transaction_ids, now, self.settings.transaction_check_max)
