"""Retention: what a store no longer needs leaves it, the way a RocketMQ broker deletes
CommitLog files after ``fileReservedTime``.

:func:`maintain` (``rmqtx maintain``, and ``rmqtx check`` every ``maintenance_interval``)
does, in this order:

1. **CommitLog.** Per queue, the new earliest offset is the smallest offset of a message stored
   within ``file_reserved_time`` (the next offset when there is none); the messages below it
   are deleted. Timestamps alone would not do: publishers' clocks differ, so a queue's
   timestamps are not monotonic, and deleting by age could punch holes. The queue stays dense
   from its earliest offset, which is recorded as a Delta application transaction in the same
   commit as the delete (:func:`rmq_spark.store.queues.earliest_app_id`).
2. **Transactions.** A transaction is *expired* when its decision is older than
   ``transaction_reserved_time``, it is in the ``op`` snapshot that ``commitlog`` records as
   published (so a COMMIT's messages are in the CommitLog), and, when the check max rolled it
   back, its messages are in ``discard``. Undecided half messages are never expired, whatever
   their age. Its ``half`` rows go first and its ``op`` rows last: while a half row exists,
   its ``op`` row is what keeps a late, opposite decision from publishing it; once the half
   rows are gone, a late decision finds nothing to publish. A run killed in between leaves
   only ``op`` rows, which the next run removes. Their decision objects
   (:mod:`rmq_spark.store.arbiter`) go after the ``op`` rows (a run killed in between leaves
   those objects behind).

   ``discard`` rows are kept, and so is every transaction a re-drive created (named in
   ``discard.redriven_transaction_id``): a re-drive decides to stage a claimed row by finding
   its new transaction in neither ``half`` nor ``op``, so removing those rows under a re-drive
   that has read ``discard`` would make it stage, and publish, the message again (found by
   the torture test). Discards are exceptions (transactions that exhausted their check
   budget), so what this keeps stays small.
3. **Files.** VACUUM: files a table stopped using more than its retention ago are deleted
   (``deleted_file_retention`` for the CommitLog, the tables' own 2 h for the internal ones),
   so a reader that planned its files before the delete still finds them; each table's
   removals are written down as they are seen (:mod:`rmq_spark.delta.vacuum`), and an older
   store's tables are brought to 2 h of tombstones.

A store of several shards (:mod:`rmq_spark.store.shards`) is maintained shard by shard, each
with its own tables, as a store of one; one summary tells of them all. Runs take turns through
each shard's ``maintain`` lock; a run that finds it held does nothing there.
``epochs`` rows are kept (one small row per sink epoch: they make a replayed epoch publish
nothing twice), and so is ``check_runs``.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime, timedelta

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction

from rmq_spark.delta.reads import sql_string, sql_time
from rmq_spark.delta.retry import retry_commits
from rmq_spark.delta.vacuum import tombstone_retention, vacuum
from rmq_spark.model.clock import Clock, in_utc
from rmq_spark.model.config import RetentionSettings
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import new_id
from rmq_spark.model.schema import TABLES
from rmq_spark.store.facade import Store
from rmq_spark.store.fanout import on_every_shard
from rmq_spark.store.queues import earliest_app_id
from rmq_spark.store.retention_summary import MaintenanceSummary, QueueExpiry

log = logging.getLogger(__name__)

#: ``op.decided_by`` of check-max rollbacks (their messages must be in ``discard`` first).
_CHECK_MAX = "check-back:check-max"
#: How long a maintenance run holds the store's ``maintain`` lock at most.
_LOCK_SECONDS = 3600.0
#: Transactions removed per MERGE (bounds the memory of one commit).
_CHUNK = 200_000


def maintain(
    store: Store,
    settings: RetentionSettings | None = None,
    *,
    clock: Clock | None = None,
) -> MaintenanceSummary:
    """Remove what the store's retention settings no longer keep (see the module notes), in
    every shard of the store, one after the other.

    Parameters
    ----------
    store : Store
        The store to maintain.
    settings : RetentionSettings, optional
        Retention periods (defaults: RocketMQ's 72 h, Delta's 7 days for files).
    clock : callable, optional
        Returns the current UTC time (default: the store's clock).

    Returns
    -------
    MaintenanceSummary
        What was removed, over every shard; ``skipped`` says why nothing was when another run
        holds the lock (of every shard).

    Raises
    ------
    ShardsFailedError
        With several shards, maintenance failed on some of them (the others were done).
    """
    settings = settings or RetentionSettings()
    run_id = new_id()
    clock = in_utc(clock) if clock else None
    return on_every_shard(
        store.shards(refresh=True),
        "maintenance",
        lambda shard: _maintain_shard(shard, settings, clock, run_id),
        lambda done, _: MaintenanceSummary.combined(run_id, done),
    )


def _maintain_shard(
    store: Store,
    settings: RetentionSettings,
    clock: Clock | None,
    run_id: str,
) -> MaintenanceSummary:
    """Maintain one shard's tables (under its own ``maintain`` lock)."""
    now = (clock or store.clock)()
    summary = MaintenanceSummary(run_id=run_id)
    started = time.monotonic()
    if not store.lock("maintain", summary.run_id, _LOCK_SECONDS):
        summary.skipped = "another maintenance run holds the store's maintain lock"
        log.info("%s", summary.brief())
        return summary
    try:
        if not store.shard:  # the store's one CommitLog is the root's
            _expire_messages(store, now - timedelta(seconds=settings.file_reserved_time), summary)
        failpoint("maintain.commitlog")
        _expire_transactions(
            store, now - timedelta(seconds=settings.transaction_reserved_time), summary
        )
        _vacuum(store, settings, summary)
    finally:
        store.lock("maintain", summary.run_id, 0.0)
    summary.duration_seconds = time.monotonic() - started
    log.info("%s", summary.brief())
    return summary


# --------------------------------------------------------------------------- CommitLog
def expiry_plan(
    store: Store,
    settings: RetentionSettings | None = None,
    *,
    clock: Clock | None = None,
) -> list[QueueExpiry]:
    """What :func:`maintain` would expire from the CommitLog now (``rmqtx maintain --dry-run``),
    for every queue (those it leaves alone too); nothing is changed."""
    settings = settings or RetentionSettings()
    cutoff = in_utc(clock or store.clock)() - timedelta(seconds=settings.file_reserved_time)
    return _queue_expiries(store, store.table("commitlog"), cutoff)


def _queue_expiries(store: Store, commitlog: DeltaTable, cutoff: datetime) -> list[QueueExpiry]:
    """Each queue's messages below the first one stored at or after ``cutoff`` (every queue,
    those with none too)."""
    queues = store.sql(
        "commitlog",
        "SELECT topic, queue_id, MIN(queue_offset) AS lowest, "
        "MAX(queue_offset) + 1 AS next_offset, "
        f"MIN(CASE WHEN store_timestamp >= {sql_time(cutoff)} THEN queue_offset END) "
        "AS keep_from FROM commitlog GROUP BY topic, queue_id ORDER BY topic, queue_id",
        table=commitlog,
    ).to_pylist()
    return [
        QueueExpiry(
            q["topic"],
            q["queue_id"],
            q["lowest"],
            q["next_offset"] if q["keep_from"] is None else q["keep_from"],
            q["next_offset"],
        )
        for q in queues
    ]


def _expire_messages(store: Store, cutoff: datetime, summary: MaintenanceSummary) -> None:
    """Delete each queue's messages below the first one stored at or after ``cutoff``."""

    def attempt(_: int) -> tuple[int, int]:
        commitlog = store.table("commitlog")
        moves = [
            (e.topic, e.queue_id, e.earliest, e.messages)
            for e in _queue_expiries(store, commitlog, cutoff)
            if e.messages
        ]
        if not moves:
            return 0, 0
        predicate = " OR ".join(
            f"(topic = {sql_string(t)} AND queue_id = {q} AND queue_offset < {e})"
            for t, q, e, _ in moves
        )
        metrics = commitlog.delete(
            predicate,
            commit_properties=CommitProperties(
                app_transactions=[Transaction(earliest_app_id(t, q), e) for t, q, e, _ in moves],
                custom_metadata={"rmqtx.operation": "retention"},
            ),
        )
        deleted = int(metrics.get("num_deleted_rows", 0))
        if deleted != sum(n for *_, n in moves):
            log.warning(
                "retention deleted %d CommitLog rows, expected %d from the queue bounds",
                deleted,
                sum(n for *_, n in moves),
            )
        return deleted, len(moves)

    summary.messages_expired, summary.queues_advanced = retry_commits(
        "expire CommitLog messages", "commitlog", attempt
    )


# --------------------------------------------------------------------------- transactions
def _expire_transactions(store: Store, cutoff: datetime, summary: MaintenanceSummary) -> None:
    cursor = store.published_op_version()
    if cursor < 0:
        return  # nothing was ever published (rollbacks alone wait for the first publish)
    expired = store.sql(
        "op",
        f"SELECT transaction_id, decided_by FROM op WHERE decided_timestamp < {sql_time(cutoff)}",
        version=cursor,
    )
    rows = list(
        zip(
            expired.column("transaction_id").to_pylist(),
            expired.column("decided_by").to_pylist(),
            strict=True,
        )
    )
    # Read after op: a re-driven transaction is claimed in discard before it can be decided.
    redriven = set(_discard_column(store, "redriven_transaction_id"))
    recorded = (
        set(_discard_column(store, "transaction_id"))
        if any(by == _CHECK_MAX for _, by in rows)
        else set()
    )
    ids = sorted(t for t, by in rows if t not in redriven and (by != _CHECK_MAX or t in recorded))
    if ids:
        # An intake object landed whose deletion failed would bring its transactions back once
        # their rows are gone: each is deleted here, and the ids one left over covers wait.
        store.land_intake(0.0)
        kept = store.intake_covering(ids)
        ids = [t for t in ids if t not in kept]
    summary.transactions_expired = len(ids)
    for start in range(0, len(ids), _CHUNK):
        chunk = pa.table({"transaction_id": pa.array(ids[start : start + _CHUNK], pa.string())})
        summary.half_removed += _delete_matching(store, "half", chunk)
        failpoint("maintain.half")
        summary.op_removed += _delete_matching(store, "op", chunk)
        # Last: a run killed before leaves a few objects behind, never a decision undone.
        store.remove_decision_objects(ids[start : start + _CHUNK])


def _discard_column(store: Store, column: str) -> list[str]:
    return (
        store.sql("discard", f"SELECT DISTINCT {column} FROM discard WHERE {column} IS NOT NULL")
        .column(0)
        .to_pylist()
    )


def _delete_matching(store: Store, name: str, ids: pa.Table) -> int:
    metrics = store.merge(name, ids, "transaction_id", lambda m: m.when_matched_delete())
    return int(metrics.get("num_target_rows_deleted", 0))


# --------------------------------------------------------------------------- files
def _vacuum(store: Store, settings: RetentionSettings, summary: MaintenanceSummary) -> None:
    names = [n for n in TABLES if n != "commitlog" or not store.shard]
    for name in names:
        retention = (
            settings.deleted_file_retention
            if name == "commitlog"
            else tombstone_retention(store.table(name))
        )
        try:
            removed = vacuum(
                store.table_uri(name),
                store.settings.storage_options,
                lambda n=name: store.table(n),
                retention,
            )
        except Exception:  # the other tables are vacuumed still; the next run tries again
            log.exception("VACUUM of %s failed; the next maintenance run tries again", name)
            continue
        # After the removals it holds are written down: none is lost with the tombstones.
        _keep_tombstones_as_specified(store, name)
        summary.files_vacuumed[name] = len(removed)
        summary.live_bytes[name] = int(sum(store.data_files(name).column("size_bytes").to_pylist()))


def _keep_tombstones_as_specified(store: Store, name: str) -> None:
    """Give a table of an older store that keeps tombstones for Delta's default week (the
    CommitLog did: the property was unset) the retention the store's tables have now
    (:data:`rmq_spark.model.schema.TOMBSTONES`). A retention an operator set stays."""
    key = "delta.deletedFileRetentionDuration"
    wanted = TABLES[name][2].get(key)
    if wanted is None or key in store.table(name).metadata().configuration:
        return

    def attempt(_: int) -> bool:
        latest = store.table(name)
        if key in latest.metadata().configuration:
            return False
        latest.alter.set_table_properties({key: wanted})
        return True

    if retry_commits(f"set {key} of {name}", name, attempt):
        log.info("%s now keeps the tombstones of removed files for %s", name, wanted)
