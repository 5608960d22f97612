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
import pyarrow.compute as pc
from pyspark.sql import DataFrame, SparkSession

from rmq_spark.model.config import TransactionSettings
from rmq_spark.model.messages import PROPERTY_CHECK_IMMUNITY, check_immunity, named_shard
from rmq_spark.model.schema import PENDING_SCHEMA, TIMESTAMP
from rmq_spark.store.facade import Store

#: Reasons in the check batch.
CHECK, NOT_YET_DUE, TOO_OLD, UNROUTED, MISPLACED = (
    "check",
    "not yet due",
    "older than max check age",
    "no checker for producer group",
    "its id names another shard",
)

#: The check batch: a pending row, then what the round made of it (the checker's ``answer``
#: and ``error`` are added when the round ends).
CHECK_BATCH_SCHEMA = pa.schema(
    list(PENDING_SCHEMA)
    + [
        pa.field("first_seen", TIMESTAMP, nullable=False),
        pa.field("check_count", pa.int32(), nullable=False),
        pa.field("age_seconds", pa.float64(), nullable=False),
        pa.field("immunity_seconds", pa.float64(), nullable=False),
        pa.field("new", pa.bool_(), nullable=False),
        pa.field("epoch_message", pa.bool_(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("body", pa.binary()),
    ]
)


def check_batch(
    store: Store,
    pending: pa.Table,
    routed: Collection[str],
    settings: TransactionSettings,
    now: datetime,
    stored_ages: Mapping[str, float] | None = None,
) -> pa.Table:
    """The ``pending`` transactions classified at ``now`` (:data:`CHECK_BATCH_SCHEMA`), with
    the bodies of the due ones.

    ``routed`` are the producer groups that have a checker. ``stored_ages``: how long the
    transactions new to the pending list had been stored, on the store's clock
    (:attr:`PendingUpdate.stored_ages <rmq_spark.checkback.pending.PendingUpdate>`); a new
    transaction's clock starts that long before ``now`` (else at ``now``).

    Made in Arrow, in this process: the batch is frozen for the rest of the run (which writes
    ``op`` and ``check_state``), and a round on an idle shard starts no Spark job.
    """
    ids = pending.column("transaction_id")
    state = store.read("check_state", ["transaction_id", "first_seen", "check_count"])
    seen = pc.index_in(ids, value_set=state.column("transaction_id").combine_chunks())
    ages = stored_ages or {}
    stored_age = pa.array(list(ages.values()), pa.float64()).take(
        pc.index_in(ids, value_set=pa.array(list(ages), pa.string()))
    )
    now_us = pa.scalar(now, TIMESTAMP).value
    first_seen = pc.coalesce(
        state.column("first_seen").take(seen).cast(TIMESTAMP).cast(pa.int64()),
        pc.subtract(now_us, pc.trunc(pc.multiply(stored_age, 1e6)).cast(pa.int64())),
        now_us,
    )
    age = pc.divide(pc.subtract(now_us, first_seen).cast(pa.float64()), 1e6)
    immunity = _immunity(pending, settings.max_check_age)
    epoch_message = pc.is_valid(pending.column("sink_id"))
    groups = pa.array(sorted(routed), pa.string())
    group_routed = pc.is_in(pending.column("producer_group"), value_set=groups)
    reason = pc.case_when(
        pc.make_struct(
            _misplaced(ids, store.shard),
            pc.greater(age, settings.max_check_age),
            pc.invert(pc.or_(group_routed, epoch_message)),
            pc.less(age, pc.max_element_wise(immunity, settings.transaction_timeout)),
        ),
        MISPLACED,
        TOO_OLD,
        UNROUTED,
        NOT_YET_DUE,
        CHECK,
    )
    made = {
        "first_seen": first_seen.cast(TIMESTAMP),
        "check_count": pc.coalesce(
            state.column("check_count").take(seen), pa.scalar(0, pa.int32())
        ),
        "age_seconds": age,
        "immunity_seconds": immunity,
        "new": pc.is_null(seen),
        "epoch_message": epoch_message,
        "reason": reason,
    }
    classified = pending.select(PENDING_SCHEMA.names)
    for name, column in made.items():
        classified = classified.append_column(name, column)
    classified = classified.append_column("body", _bodies(store, classified))
    return classified.cast(CHECK_BATCH_SCHEMA)


def _immunity(pending: pa.Table, max_check_age: float) -> pa.Array:
    """Each message's check immunity in seconds (:func:`check_immunity`: 0 for none or a
    value that is not a number of seconds), at most ``max_check_age``."""
    asked = pc.map_lookup(pending.column("properties"), PROPERTY_CHECK_IMMUNITY, "first")
    return pa.array(
        [min(check_immunity(v), max_check_age) for v in asked.to_pylist()], pa.float64()
    )


def _misplaced(ids: pa.ChunkedArray, shard: int) -> pa.Array:
    """Whether each transaction id names a shard other than ``shard``, or none
    (:func:`named_shard`): a half row another Delta writer put in the wrong shard is never
    decided here (nor there, where it has no half message)."""
    return pa.array([named_shard(t) != shard for t in ids.to_pylist()], pa.bool_())


def _bodies(store: Store, classified: pa.Table) -> pa.ChunkedArray:
    """The bodies of the due transactions' representative messages, read by id (null for the
    others)."""
    due = classified.filter(pc.equal(classified.column("reason"), CHECK))
    if not due.num_rows:
        return pa.chunked_array([pa.nulls(classified.num_rows, pa.binary())])
    half = store.half_messages(due.column("transaction_id").to_pylist())
    keys = ["transaction_id", "msg_id"]
    rows = classified.select(keys).append_column("row", pa.array(range(classified.num_rows)))
    found = rows.join(half.select([*keys, "body"]), keys, join_type="left outer")
    return found.sort_by("row").column("body")


def as_dataframe(spark: SparkSession, batch: pa.Table) -> DataFrame:
    """``batch`` (a check batch, or some of its rows) as a Spark DataFrame, empty or not."""
    # One chunk: pyspark 4.2 drops the chunks after an empty one (shards' batches concatenated),
    # and cannot take a table without chunks (an empty filter result).
    return spark.createDataFrame(
        batch.combine_chunks() if batch.num_rows else batch.schema.empty_table()
    )
