"""Transactional writes: ``df.write.format("rmqtx")``, ``df.writeStream.format("rmqtx")`` and
:func:`publish_with_delta_write`.

>>> (df.select("body", "keys", "tags")
...    .write.format("rmqtx").mode("append")
...    .option("path", "storage").option("topic", "OrderEvents")
...    .option("producerGroup", "order-pipeline")
...    .save())

Input columns: ``body`` (binary or string, required), and optionally ``topic`` (per row; else
the ``topic`` option), ``keys``, ``tags`` (strings) and ``properties`` (map<string,string>).
Any other column is an error unless ``extraColumnsAsProperties`` is true, which carries them
as string properties.

=============================  ========  =========  =============================================
option                         required  default    meaning
=============================  ========  =========  =============================================
``path``                       no        conf       store root
``producerGroup``              yes                  producer group of the staged transactions
``topic``                      no                   topic of rows without a ``topic`` column
``sinkId``                     no        see below  names the writer in ``epochs``; a stream
                                                    defaults to its query id (kept by the
                                                    checkpoint), a batch write to a new id
``extraColumnsAsProperties``   no        false      carry unknown columns as properties
``leaseTimeout``               no        10m        how long an epoch stays held for a writer
                                                    that sends no heartbeat (running tasks
                                                    renew it every fifth of it)
``storage.<KEY>``              no        conf       a storage option over ``[store]
                                                    storage_options`` (``storage.AWS_REGION``)
=============================  ========  =========  =============================================

Protocol: every task holds the epoch (see :mod:`rmq_spark.spark.epochs`) and renews its lease while
it runs, writes its rows as half messages (durable, invisible) in one transaction and reports
it; Spark's commit of the job or micro-batch closes the epoch with the reported transactions,
COMMITs them and publishes. Spark's abort (a failed job, a stopped query) rolls back what the
reported tasks staged and abandons the epoch at once, so that the check-back job rolls back at
its next round what the other tasks staged (killed ones, or still running ones), and a replay
of the epoch reopens it; a batch write's made-up sink id is never used again, so its epoch is
closed empty instead. Halves of failed task attempts, of a replayed micro-batch, or of a
driver that died before committing are resolved by the check-back job's built-in epoch
checker: committed only if they are on the epoch's list, rolled back otherwise; never twice.
An epoch whose lease ran out is abandoned by the check-back job, and its writer's commit then
fails (the job is retried) instead of publishing part of it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql import DataFrame
from pyspark.sql.datasource import (
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)

from rmq_spark.model.config import configure_logging
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import new_id
from rmq_spark.spark.epoch_records import (
    ABANDONED,
    CLOSED,
    Epoch,
    delta_commit_marker,
    landed_delta_write,
)
from rmq_spark.spark.epochs import (
    EpochOutcome,
    Lease,
    abandon_attempt,
    abort_attempt,
    finish_epoch,
)
from rmq_spark.spark.sink_options import (
    DEFAULT_LEASE_TIMEOUT,
    LEASE_TIMEOUT,
    PATH,
    PRODUCER_GROUP,
    TOPIC,
    WriterOptions,
)
from rmq_spark.spark.staging import Staged, stage
from rmq_spark.store.facade import Store
from rmq_spark.store.layout import normalise_root

log = logging.getLogger(__name__)


def _report(outcome: EpochOutcome, staged: Sequence[Staged], seconds: float) -> None:
    """Log what an epoch's commit staged and published."""
    count = sum(m.count for m in staged)
    log.info(
        "rmqtx sink %s epoch %d: %d message(s) staged in %d transaction(s); %s (%.1f s)",
        outcome.sink_id,
        outcome.epoch,
        count,
        len(staged),
        f"committed and published {len(outcome.committed)} transaction(s)"
        if outcome.first
        else f"already closed by an earlier attempt: rolled back {len(outcome.rolled_back)}",
        seconds,
    )


def _staged(messages: Sequence[WriterCommitMessage | None]) -> list[Staged]:
    """The commit messages of tasks that staged something."""
    return [m for m in messages if isinstance(m, Staged) and m.transaction_id]


def _pairs(staged: Sequence[Staged]) -> list[tuple[str, int]]:
    """The (transaction, generation) pairs of what tasks staged."""
    return [(m.transaction_id, m.generation) for m in staged if m.transaction_id]


def _aborted(row: Epoch | None, rolled_back: int) -> str:
    """What an abort did to an epoch and its halves, given the epoch's row after it."""
    reported = (
        f"rolled back the {rolled_back} transaction(s) its tasks reported"
        if rolled_back
        else "no task had reported"
    )
    if row is None:
        return "no task held it, nothing was staged"
    if row.state == ABANDONED:
        return (
            f"{reported}; the epoch is abandoned (generation {row.generation}), so the next "
            "check-back round rolls back whatever its other tasks staged, and a new attempt "
            "of it (a restarted query, a re-run with the same sinkId) publishes in generation "
            f"{row.generation + 1}"
        )
    if row.state == CLOSED and not row.transaction_ids:
        return (
            f"{reported}; the epoch is closed empty (its sink id is not used again), so the "
            "next check-back round rolls back whatever its other task attempts staged"
        )
    if row.state == CLOSED:
        return f"it was closed before with {len(row.transaction_ids)} transaction(s), which stand"
    return f"{reported}; the epoch is held by {row.owner!r}, another writer, and left to it"


def _query_id(checkpoint: str | None) -> str | None:
    """The id of the streaming query whose checkpoint is ``checkpoint`` (the ``id`` in Spark's
    ``metadata`` file), when it is on the local filesystem and readable; else None."""
    if checkpoint is None:
        return None
    parts = urlsplit(checkpoint)
    if parts.scheme not in ("", "file"):
        return None
    try:
        with (Path(parts.path if parts.scheme else checkpoint) / "metadata").open() as meta:
            return json.loads(meta.readline())["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


class _EpochWriter:
    """What the batch and the streaming writer share: staging in tasks, ending on the driver."""

    def __init__(self, options: WriterOptions) -> None:
        self.options = options
        #: This write attempt (a batch write, a run of a streaming query), made on the
        #: driver: its tasks cannot reopen an epoch its own abort released.
        self.attempt = new_id()
        # On the driver, before any task: a new path becomes a store (as format("delta")
        # makes a table); a path holding anything else is refused here.
        Store.open(options.path, settings=options.settings)

    def _store(self) -> Store:
        return Store.open(self.options.path, settings=self.options.settings, create=False)

    def _stage(
        self, iterator: Iterator[pa.RecordBatch], sink_id: str, epoch: int, owner: str
    ) -> Staged:
        store = self._store()
        lease = Lease(store, sink_id, epoch, owner, self.options.lease_seconds, self.attempt)
        with lease as held:
            staged = stage(store, iterator, self.options, sink_id, epoch, held.generation)
        return dataclasses.replace(staged, owner=owner)

    def _commit(self, messages: Sequence[WriterCommitMessage | None], epoch: int) -> None:
        staged = _staged(messages)
        if not staged:
            return
        configure_logging("INFO")
        started = time.perf_counter()
        outcome = finish_epoch(
            self._store(),
            staged[0].sink_id,
            epoch,
            _pairs(staged),
            self.options.producer_group,
            "sink",
        )
        failpoint("sink.published")
        _report(outcome, staged, time.perf_counter() - started)

    def _abort(
        self,
        messages: Sequence[WriterCommitMessage | None],
        sink_id: str,
        epoch: int,
        owner: str | None,
        *,
        reused: bool = True,
    ) -> None:
        """End the epoch for this writer (:func:`abort_attempt`) and log, once at INFO, what
        becomes of its halves: an abort is how Spark stops a query, not only a failure (which
        Spark reports itself)."""
        configure_logging("INFO")
        staged = _staged(messages)
        group = self.options.producer_group
        try:
            row = abort_attempt(
                self._store(),
                sink_id,
                epoch,
                _pairs(staged),
                group,
                owner,
                reused=reused,
                attempt=self.attempt,
            )
        except Exception:
            # Spark's own "failed to abort" line is not logged (log4j2.properties): say it.
            log.exception(
                "rmqtx sink %s epoch %d: the abort failed; what it staged is rolled back by "
                "the check-back job once the epoch's lease runs out, or when a restart closes "
                "the epoch",
                sink_id,
                epoch,
            )
            raise
        log.info("rmqtx sink %s epoch %d aborted: %s", sink_id, epoch, _aborted(row, len(staged)))


class RmqTxBatchWriter(_EpochWriter, DataSourceArrowWriter):
    """``df.write.format("rmqtx")``: one epoch (0) of a sink id made for this write, unless
    option ``sinkId`` names one (a second write with the same ``sinkId`` publishes nothing:
    the id's epoch is closed, as with Delta's ``txnAppId``)."""

    def __init__(self, options: WriterOptions) -> None:
        super().__init__(options)
        self.sink_id = options.sink_id or f"write-{new_id()}"

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Staged:
        return self._stage(iterator, self.sink_id, 0, owner=self.sink_id)

    def commit(self, messages: list[WriterCommitMessage | None]) -> None:
        self._commit(messages, 0)

    def abort(self, messages: list[WriterCommitMessage | None]) -> None:
        # A made-up id is never used again: its epoch is closed empty, so the check-back job
        # rolls back halves of every task attempt at once.
        reused = self.options.sink_id is not None
        self._abort(messages, self.sink_id, 0, owner=self.sink_id, reused=reused)


class RmqTxStreamWriter(_EpochWriter, DataSourceStreamArrowWriter):
    """``df.writeStream.format("rmqtx")``: epoch = micro-batch id, sink id = option ``sinkId``
    or the query id (kept in the checkpoint, so a restarted query continues its epochs)."""

    def write(self, iterator: Iterator[pa.RecordBatch]) -> Staged:
        context = TaskContext.get()
        assert context is not None
        query_id = context.getLocalProperty("sql.streaming.queryId")
        epoch = int(context.getLocalProperty("streaming.sql.batchId"))
        return self._stage(iterator, self.options.sink_id or query_id, epoch, owner=query_id)

    def commit(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        self._commit(messages, batchId)

    def abort(self, messages: list[WriterCommitMessage | None], batchId: int) -> None:
        """Abort a micro-batch (a failed batch, or ``query.stop()`` killing its tasks): the
        epoch is abandoned at once, never closed (a restarted query replays the batch with the
        same id, and must publish it). Spark runs this on the driver without the query id;
        it comes from a task's commit message, else from the checkpoint's ``metadata``."""
        reported = [m for m in messages if isinstance(m, Staged)]
        owner = next((m.owner for m in reported if m.owner), None)
        owner = owner or _query_id(self.options.checkpoint)
        sink_id = self.options.sink_id or next((m.sink_id for m in reported), None) or owner
        if sink_id is not None:
            self._abort(messages, sink_id, batchId, owner)
            return
        configure_logging("INFO")
        log.info(
            "rmqtx stream epoch %d aborted before any task reported, and the writer cannot "
            "tell its query (no sinkId, no checkpointLocation option on a local path): what "
            "its tasks staged is rolled back by the check-back job once the epoch's lease "
            "(leaseTimeout, %g s) runs out",
            batchId,
            self.options.lease_seconds,
        )


def publish_with_delta_write(
    rows: DataFrame,
    table: str,
    messages: DataFrame,
    *,
    app_id: str,
    version: int,
    producer_group: str,
    topic: str | None = None,
    path: str | None = None,
    lease_timeout: str | float = DEFAULT_LEASE_TIMEOUT,
) -> EpochOutcome:
    """Append ``rows`` to the Delta table ``table`` and publish ``messages``, atomically.

    The local transaction of RocketMQ's protocol is the Delta write, made idempotent with
    Delta's ``txnAppId`` = ``app_id`` and ``txnVersion`` = ``version`` (in a ``foreachBatch``,
    pass the query's name and the batch id). The messages are staged first (durable,
    invisible), then the rows are written (the commit's ``userMetadata`` names the staged
    transaction), then the epoch (``app_id``, ``version``) is closed and its messages
    committed. A crash anywhere is repaired by re-running the batch (Delta skips a version it
    has; the epoch publishes once) or by the check-back job, whose epoch checker commits the
    messages exactly when ``table`` holds ``version`` for ``app_id``.

    Parameters
    ----------
    rows : DataFrame
        Business rows to append to ``table``.
    table : str
        Path or URI of the business Delta table.
    messages : DataFrame
        Messages, with the columns of ``df.write.format("rmqtx")`` (``body``, ...).
    app_id, version : str, int
        Delta's idempotent-writer id and version (the epoch).
    producer_group : str
        Producer group of the staged transaction.
    topic : str, optional
        Topic of messages without a ``topic`` column.
    path : str, optional
        Store root (default: conf).
    lease_timeout : str or float, default "10m"
        How long the epoch stays held if this process stops sending heartbeats.

    Returns
    -------
    EpochOutcome
        Whether this call's messages were committed, or an earlier attempt's were.

    Raises
    ------
    EpochLostError
        The epoch was abandoned under this call (its lease ran out): nothing is published;
        run the batch again.

    Notes
    -----
    A re-run whose Delta write is skipped (an earlier attempt's rows landed) publishes the
    messages it staged itself: the earlier attempt's may have been rolled back with its
    abandoned generation. Compute ``messages`` deterministically from the batch (no ``uuid()``
    or ``now()``), as for any Spark retry, so that every attempt stages the same messages.
    """
    options = {
        PATH: path,
        PRODUCER_GROUP: producer_group,
        TOPIC: topic,
        LEASE_TIMEOUT: str(lease_timeout),
    }
    parsed = WriterOptions.parse({k: v for k, v in options.items() if v}, messages.schema)
    store = Store.open(parsed.path, settings=parsed.settings)
    table_uri = normalise_root(table)
    with Lease(store, app_id, version, app_id, parsed.lease_seconds) as held:
        staged = stage(
            store,
            messages.toArrow().to_batches(),
            parsed,
            app_id,
            version,
            held.generation,
            table_uri,
        )
        pairs = _pairs([staged])
        failpoint("delta.staged")
        try:
            (
                rows.write.format("delta")
                .mode("append")
                .option("txnAppId", app_id)
                .option("txnVersion", version)
                .option("userMetadata", delta_commit_marker(app_id, version, staged.transaction_id))
                .save(table)
            )
        except Exception:
            landed, _ = landed_delta_write(
                table_uri, app_id, version, parsed.settings.storage_options
            )
            if not landed:
                abandon_attempt(store, app_id, version, pairs, producer_group)
                raise
            log.warning(
                "the Delta write of %s version %d reported an error but landed; publishing",
                app_id,
                version,
                exc_info=True,
            )
        failpoint("delta.written")
        return finish_epoch(store, app_id, version, pairs, producer_group, "delta")
