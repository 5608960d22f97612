"""The check batch: a round's pending transactions, each with the reason it is asked or not.

Keeps docs/contract.md, rule 6: a pending transaction is asked once its age is at least
the transaction timeout and its own ``CHECK_IMMUNITY_TIME_IN_SECONDS``, and at most the
maximum check age (older ones are skipped and reported); only groups with a checker are asked
(transactional writers' messages go to the built-in epoch checker), and only transactions of
the round's shard (a half row whose id names another shard, which only another Delta writer
can put there, is left pending and reported, never decided and never the end of a round).
Ages are measured on the check-back job's clock from ``check_state.first_seen``, which starts
when the half message was stored, on the store's clock (how long before the round its log
entry was written), or when a round first saw the transaction where the store cannot say;
never on the producer's clock (apache/rocketmq#9640). So one round resolves a transaction that
is already overdue when it first runs. Immunity
only delays the first check and never spends the check budget (apache/rocketmq#8311). Keeps
rule 9: the batch is built from the pending list (:mod:`rmq_spark.checkback.pending`), and
bodies are read by id for the due transactions only, never from the decided history.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from datetime import datetime

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rmq_spark.model.config import TransactionSettings
from rmq_spark.model.messages import PROPERTY_CHECK_IMMUNITY, SHARD_ID_PATTERN
from rmq_spark.store.facade import Store

#: Reasons in the check batch.
CHECK, NOT_YET_DUE, TOO_OLD, UNROUTED, MISPLACED = (
    "check",
    "not yet due",
    "older than max check age",
    "no checker for producer group",
    "its id names another shard",
)


def check_batch(
    spark: SparkSession,
    store: Store,
    pending: pa.Table,
    routed: Collection[str],
    settings: TransactionSettings,
    now: datetime,
    stored_ages: Mapping[str, float] | None = None,
) -> DataFrame:
    """The ``pending`` transactions, classified at ``now``, frozen for the rest of the run.

    ``routed`` are the producer groups that have a checker. ``stored_ages``: how long the
    transactions new to the pending list had been stored, on the store's clock
    (:attr:`PendingUpdate.stored_ages <rmq_spark.checkback.pending.PendingUpdate>`); a new
    transaction's clock starts that long before ``now`` (else at ``now``).
    """
    # Read whole now, not by Spark's Delta source: its snapshot reads the checkpoint when
    # the query runs, by when another job's log cleanup may have removed it.
    state = _to_spark(
        spark, store.read("check_state", ["transaction_id", "first_seen", "check_count"])
    )
    now_lit = F.lit(now).cast("timestamp")
    ages = pa.table(
        {
            "transaction_id": pa.array(list(stored_ages or {}), pa.string()),
            "stored_age": pa.array(list((stored_ages or {}).values()), pa.float64()),
        }
    )
    stored = F.timestamp_micros(F.unix_micros(now_lit) - (F.col("stored_age") * 1e6).cast("long"))
    first_seen = F.coalesce(F.col("first_seen"), stored, now_lit)
    age = F.unix_micros(now_lit) - F.unix_micros(first_seen)
    # try_cast: one message whose property is not a number (a sink stores any value) must
    # not fail the round for everyone (ANSI mode's CAST_INVALID_INPUT); it has no immunity,
    # and neither has a negative, infinite or NaN value (NaN sorts above every number).
    asked = F.col("properties").getItem(PROPERTY_CHECK_IMMUNITY).try_cast("double")
    immunity = F.when(
        (asked >= 0) & (asked < float("inf")) & ~F.isnan(asked),
        F.least(asked, F.lit(settings.max_check_age)),
    ).otherwise(F.lit(0.0))
    groups = list(routed)
    group_routed = F.col("producer_group").isin(groups) if groups else F.lit(False)
    # A transaction is decided in the shard its id names; a half row another Delta writer put
    # in the wrong shard is never decided here (nor there, where it has no half message).
    named = F.regexp_extract("transaction_id", SHARD_ID_PATTERN, 1)
    shard = F.when(named == "", F.lit(0)).otherwise(named.cast("int"))
    reason = (
        F.when(shard != store.shard, MISPLACED)
        .when(F.col("age_seconds") > settings.max_check_age, TOO_OLD)
        .when(~(group_routed | F.col("epoch_message")), UNROUTED)
        .when(
            F.col("age_seconds")
            < F.greatest(F.lit(settings.transaction_timeout), F.col("immunity_seconds")),
            NOT_YET_DUE,
        )
        .otherwise(CHECK)
    )
    classified = (
        _to_spark(spark, pending)
        .join(state, "transaction_id", "left")
        .join(_to_spark(spark, ages), "transaction_id", "left")
        .select(
            "*",
            (age / 1e6).alias("age_seconds"),
            immunity.alias("immunity_seconds"),
            F.col("first_seen").isNull().alias("new"),
            # Set only by the sink and publish_with_delta_write, never from user input.
            F.col("sink_id").isNotNull().alias("epoch_message"),
        )
        .withColumn("first_seen", first_seen)
        .drop("stored_age")
        .withColumn("check_count", F.coalesce("check_count", F.lit(0)).cast("int"))
        .withColumn("reason", reason)
    )
    # Frozen: the run writes op and check_state, which must not change what it decides.
    classified = classified.localCheckpoint(eager=True)
    return classified.join(_bodies(spark, store, classified), ["transaction_id", "msg_id"], "left")


def _bodies(spark: SparkSession, store: Store, classified: DataFrame) -> DataFrame:
    """The bodies of the due transactions' representative messages, read by id."""
    due = classified.where(F.col("reason") == CHECK).select("transaction_id").toArrow()
    half = store.half_messages(due.column("transaction_id").to_pylist())
    return _to_spark(spark, half.select(["transaction_id", "msg_id", "body"]))


def _to_spark(spark: SparkSession, table: pa.Table) -> DataFrame:
    """``table`` as a Spark DataFrame, empty or not."""
    # Spark cannot take an Arrow table without chunks (an empty filter result).
    return spark.createDataFrame(table if table.num_rows else table.schema.empty_table())
