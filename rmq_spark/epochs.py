"""Epochs of transactional writers: which attempt of an epoch is the one that counts.

A transactional writer (the ``rmqtx`` sink, :func:`rmq_spark.sink.publish_with_delta_write`)
stages an epoch's messages as half messages, one transaction per task attempt, tagged with
the sink id and epoch (message properties ``RMQTX_SINK_ID`` / ``RMQTX_EPOCH``). Closing the
epoch inserts one ``epochs`` row listing the transactions that count, with a MERGE that
inserts only when the (sink, epoch) row is absent: racing closers conflict and exactly one
list wins. Those transactions are COMMITted and every other attempt of the epoch (a failed
task, a replay after a restart, a driver that died before committing) is rolled back, so an
epoch is published once whatever fails and whoever finishes the job: the driver, a replay of
the epoch, or the check-back job's :class:`EpochChecker`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

import pyarrow as pa
from deltalake import DeltaTable
from pyspark.sql import DataFrame

from rmq_spark.checkers import ANSWER_SCHEMA, Checker
from rmq_spark.failpoints import failpoint
from rmq_spark.model import (
    PROPERTY_DELTA_TABLE,
    PROPERTY_EPOCH,
    PROPERTY_SINK_ID,
    LocalTransactionState,
)
from rmq_spark.schema import EPOCHS_SCHEMA
from rmq_spark.store import Decision, Store

log = logging.getLogger(__name__)

COMMIT, ROLLBACK, UNKNOWN = (
    LocalTransactionState.COMMIT,
    LocalTransactionState.ROLLBACK,
    LocalTransactionState.UNKNOWN,
)


@dataclass(frozen=True)
class EpochOutcome:
    """What closing an epoch did."""

    sink_id: str
    epoch: int
    #: The transactions that count for the epoch (ours, or an earlier closer's).
    committed: tuple[str, ...]
    #: Staged transactions rolled back because another attempt's list won.
    rolled_back: tuple[str, ...]
    #: Whether this call's list won (False: the epoch was closed before, e.g. a replay).
    first: bool


def closed_epoch(store: Store, sink_id: str, epoch: int) -> tuple[str, ...] | None:
    """The transactions that count for a closed epoch, or None while it is open."""
    rows = store.table("epochs").to_pyarrow_table(
        filters=[("sink_id", "=", sink_id), ("epoch", "=", epoch)],
        columns=["transaction_ids"],
    )
    if not rows.num_rows:
        return None
    return tuple(rows.column("transaction_ids")[0].as_py() or ())


def close_epoch(
    store: Store, sink_id: str, epoch: int, transaction_ids: Sequence[str], closed_by: str
) -> tuple[tuple[str, ...], bool]:
    """Close an epoch with ``transaction_ids`` unless it is closed already (first wins).

    Returns the winning list and whether it is ours.
    """
    existing = closed_epoch(store, sink_id, epoch)
    if existing is not None:
        return existing, False
    row = pa.Table.from_pylist(
        [
            {
                "sink_id": sink_id,
                "epoch": epoch,
                "transaction_ids": list(transaction_ids),
                "closed_by": closed_by,
                "closed_timestamp": datetime.now(UTC),
            }
        ],
        schema=EPOCHS_SCHEMA,
    )
    store.merge("epochs", row, ["sink_id", "epoch"], lambda m: m.when_not_matched_insert_all())
    winner = closed_epoch(store, sink_id, epoch)
    assert winner is not None  # the MERGE committed, by us or by a racing closer
    return winner, winner == tuple(transaction_ids)


def finish_epoch(
    store: Store,
    sink_id: str,
    epoch: int,
    staged: Sequence[str],
    producer_group: str,
    closed_by: str,
) -> EpochOutcome:
    """Close an epoch with the ``staged`` transactions, then COMMIT the winning list and roll
    back staged transactions that lost; publish. Safe to repeat after any crash."""
    winners, first = close_epoch(store, sink_id, epoch, staged, closed_by)
    failpoint(f"{closed_by}.closed")
    losers = tuple(t for t in staged if t not in set(winners))
    decisions = [Decision(t, producer_group, COMMIT, closed_by) for t in winners]
    decisions += [Decision(t, producer_group, ROLLBACK, closed_by) for t in losers]
    if decisions:
        store.end_transactions(decisions)
    return EpochOutcome(sink_id, epoch, winners, losers, first)


class EpochChecker(Checker):
    """Built-in checker for half messages staged by transactional writers.

    For a pending transaction of (sink, epoch): if the epoch is closed, COMMIT when the
    transaction is on its list, else ROLLBACK. If it is open and the message names a Delta
    table (``publish_with_delta_write``), the local transaction is that table's commit of
    application transaction (sink id, epoch): once the table has it, this checker closes the
    epoch with the transaction (first closer wins) and answers accordingly. Otherwise the epoch
    may still commit: UNKNOWN (after the check max it is rolled back, as any transaction).
    """

    kind = "epoch"

    def __init__(self, store: Store) -> None:
        self.store = store

    def check(self, batch: DataFrame) -> DataFrame:
        rows = batch.select("transaction_id", "producer_group", "properties").collect()
        # Each (sink, epoch) is looked up once per run, however many attempts are pending.
        known: dict[tuple[str, int], tuple[str, ...] | None] = {}
        answers = [self._answer(r, known) for r in rows]
        return batch.sparkSession.createDataFrame(answers, ANSWER_SCHEMA)

    def _answer(
        self, row: object, known: dict[tuple[str, int], tuple[str, ...] | None]
    ) -> tuple[str, str, str | None]:
        txn, props = row["transaction_id"], dict(row["properties"] or {})
        sink_id, epoch = props[PROPERTY_SINK_ID], int(props[PROPERTY_EPOCH])
        if (sink_id, epoch) not in known:
            known[(sink_id, epoch)] = closed_epoch(self.store, sink_id, epoch)
        winners = known[(sink_id, epoch)]
        table = props.get(PROPERTY_DELTA_TABLE)
        if winners is None and table is not None:
            version = DeltaTable(table).transaction_version(sink_id)
            if version is not None and version >= epoch:
                winners = known[(sink_id, epoch)] = finish_epoch(
                    self.store, sink_id, epoch, [txn], row["producer_group"], "check-back:epoch"
                ).committed
        if winners is None:
            return txn, UNKNOWN.value, f"epoch {epoch} of sink {sink_id!r} is not closed yet"
        return txn, (COMMIT if txn in winners else ROLLBACK).value, None
