"""The check-back job's built-in checker for half messages staged by transactional writers
(the ``rmqtx`` sink and :func:`rmq_spark.spark.sink.publish_with_delta_write`): it answers from
the epoch's state (:mod:`rmq_spark.spark.epochs`), abandoning an epoch whose writer's lease ran
out, so a staged transaction is rolled back only when no writer can list it any more (rule 8).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime
from urllib.parse import urlsplit

from pyspark.sql import DataFrame

from rmq_spark.checkback.checkers import ANSWER_SCHEMA, Checker
from rmq_spark.delta.storage import scheme
from rmq_spark.model.clock import Clock
from rmq_spark.model.errors import StoreError
from rmq_spark.spark.epoch_records import (
    ABANDONED,
    CLOSED,
    OPEN,
    Epoch,
    landed_delta_write,
    lease_clock,
    read_epoch,
    read_epochs,
)
from rmq_spark.spark.epochs import COMMIT, ROLLBACK, UNKNOWN, abandon, close
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: The epoch checker's answer for a transaction whose writer still holds the epoch's lease:
#: not a check (RocketMQ's check immunity), so it never spends the check budget.
WRITER_ALIVE = "WRITER_ALIVE"


def check_delta_table(store: Store, table_uri: str, sink_id: str) -> None:
    """Refuse to open, with the store's credentials, a business table that a half row names
    unless it is on the store's own filesystem (scheme and bucket) or the operator's
    ``[store] delta_tables`` names it or a prefix of it: half rows can be written around the
    sink, and would otherwise send check-back, credentials and all, to any table."""

    def filesystem_of(uri: str) -> tuple[str, str]:
        return scheme(uri), urlsplit(uri).netloc if "://" in uri else ""

    if filesystem_of(table_uri) == filesystem_of(store.root) or any(
        table_uri.startswith(allowed) for allowed in store.settings.delta_tables
    ):
        return
    raise StoreError(
        f"sink {sink_id!r} names the Delta table {table_uri!r}, which is not on the store's "
        f"filesystem ({store.root}) and not in [store] delta_tables; check-back does not open "
        "it with the store's credentials. If that is your business table, add it (or a prefix "
        "of it) to delta_tables in the settings file; its transactions stay UNKNOWN until then."
    )


@dataclass(frozen=True)
class _Pending:
    transaction_id: str
    producer_group: str
    sink_id: str
    epoch: int
    generation: int
    delta_table: str | None


class EpochChecker(Checker):
    """Built-in checker for half messages staged by transactional writers.

    For a pending transaction of (sink, epoch), by the epoch's state: CLOSED, COMMIT when it is
    on the list, else ROLLBACK; ABANDONED, or OPEN in a later generation, ROLLBACK; OPEN in its
    generation with a live lease, :data:`WRITER_ALIVE` (not a check: no budget spent); OPEN
    with the lease run out, the epoch is :func:`abandon`\\ ed first (a conflicting write: the
    writer's close and the abandonment cannot both win), then ROLLBACK. For
    ``publish_with_delta_write`` the local transaction is the business table's commit of
    application transaction (sink id, epoch): once the table holds it, the epoch is closed
    with the transaction that commit names. Each transaction is answered on its own: one that
    cannot be answered is UNKNOWN with its error, and the others are not held back.
    """

    kind = "epoch"

    def __init__(self, store: Store, clock: Clock | None = None) -> None:
        self.store = store
        #: Leases are judged on the store's clock (:func:`lease_clock`), as they are written.
        self.clock = lease_clock(store, clock)

    def check(self, batch: DataFrame) -> DataFrame:
        columns = ["transaction_id", "producer_group", "sink_id", "epoch", "generation"]
        pending = [
            _Pending(*(r[c] for c in columns), r["delta_table"])
            for r in batch.select(*columns, "delta_table").collect()
        ]
        now = self.clock()
        epochs: dict[tuple[str, int], Epoch | None] = {}
        try:
            epochs.update(read_epochs(self.store, {(p.sink_id, p.epoch) for p in pending}))
        except Exception:
            log.warning("could not read the epochs table; answering one by one", exc_info=True)
        answers = []
        for p in pending:
            try:
                answers.append((p.transaction_id, self._answer(p, epochs, now), None))
            except Exception as exc:
                error = f"{type(exc).__name__}: {exc}"[:500]
                answers.append((p.transaction_id, UNKNOWN.value, error))
        return batch.sparkSession.createDataFrame(answers, ANSWER_SCHEMA)

    def _answer(
        self, p: _Pending, epochs: dict[tuple[str, int], Epoch | None], now: datetime
    ) -> str:
        key = (p.sink_id, p.epoch)
        if key not in epochs:
            epochs[key] = read_epoch(self.store, *key)
        row = epochs[key]
        if p.delta_table is not None and (row is None or row.state == OPEN):
            row = epochs[key] = self._close_landed(p, row)
        if row is not None and row.state == OPEN and row.generation == p.generation:
            if row.lease_expires is not None and row.lease_expires > now:
                return WRITER_ALIVE
        if row is None or (row.state == OPEN and row.generation == p.generation):
            row = epochs[key] = abandon(self.store, p.sink_id, p.epoch, p.generation, now)
            if row.state == ABANDONED:
                log.warning(
                    "epoch %d of sink %r abandoned: its writer's lease ran out at %s",
                    p.epoch,
                    p.sink_id,
                    row.lease_expires,
                )
        if row.state == CLOSED:
            return (COMMIT if p.transaction_id in (row.transaction_ids or ()) else ROLLBACK).value
        if row.state == OPEN and row.generation == p.generation:
            return WRITER_ALIVE  # renewed between our read and the abandonment
        return ROLLBACK.value

    def _close_landed(self, p: _Pending, row: Epoch | None) -> Epoch | None:
        """Close a Delta-write epoch whose business commit landed, with the transaction that
        commit names (or, for a commit without a name, this one)."""
        assert p.delta_table is not None
        check_delta_table(self.store, p.delta_table, p.sink_id)
        landed, named = landed_delta_write(
            p.delta_table, p.sink_id, p.epoch, self.store.settings.storage_options
        )
        if not landed:
            return row
        winner = named or p.transaction_id
        generation = (
            p.generation if winner == p.transaction_id else _generation_of(self.store, winner)
        )
        if generation is None:
            return row
        return close(self.store, p.sink_id, p.epoch, generation, [winner], "check-back:epoch")


def _generation_of(store: Store, transaction_id: str) -> int | None:
    halves = store.half_messages([transaction_id])
    if not halves.num_rows:
        return None
    return halves.column("generation")[0].as_py()
