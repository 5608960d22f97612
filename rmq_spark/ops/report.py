"""Read-side views of a store with Spark (delta-spark): transaction states and summaries, over
every shard of the store."""

from __future__ import annotations

from functools import reduce

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rmq_spark.store.facade import Store

#: Transaction states as operators see them.
COMMITTED, ROLLED_BACK, PENDING = "COMMITTED", "ROLLED_BACK", "PENDING"


def read_table(spark: SparkSession, store: Store, name: str) -> DataFrame:
    """One of the store's Delta tables (``half``, ``op``, ``commitlog``) as a DataFrame: the
    union of that table in every shard of the store (:meth:`Store.shards`; the CommitLog is
    one table, the root's)."""
    uris = dict.fromkeys(s.table_uri(name) for s in store.shards(refresh=True))
    tables = [spark.read.format("delta").load(uri) for uri in uris]
    return reduce(DataFrame.unionByName, tables)


def transaction_states(spark: SparkSession, store: Store) -> DataFrame:
    """One row per half message with the state of its transaction.

    Columns: ``transaction_id``, ``msg_id``, ``producer_group``, ``topic``, ``keys``,
    ``store_timestamp`` (of the half message), ``state`` (COMMITTED, ROLLED_BACK or PENDING),
    ``visible`` (the message is in the CommitLog) and ``queue_offset``.
    """
    half = read_table(spark, store, "half")
    op = read_table(spark, store, "op").select("transaction_id", "decision")
    visible = read_table(spark, store, "commitlog").select("msg_id", "queue_offset")
    state = (
        F.when(F.col("decision") == "COMMIT", F.lit(COMMITTED))
        .when(F.col("decision") == "ROLLBACK", F.lit(ROLLED_BACK))
        .otherwise(F.lit(PENDING))
    )
    return (
        half.join(op, "transaction_id", "left")
        .join(visible, "msg_id", "left")
        .select(
            "transaction_id",
            "msg_id",
            "producer_group",
            "topic",
            "keys",
            "store_timestamp",
            state.alias("state"),
            F.col("queue_offset").isNotNull().alias("visible"),
            "queue_offset",
        )
    )


def state_counts(states: DataFrame) -> DataFrame:
    """Counts per producer group and state, with how many of them consumers can see."""
    return (
        states.groupBy("producer_group", "state")
        .agg(F.count("*").alias("messages"), F.sum(F.col("visible").cast("int")).alias("visible"))
        .orderBy("producer_group", "state")
    )
