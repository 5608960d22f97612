"""Pending transactions, kept incrementally: ``half`` anti-join ``op`` without reading the history.

The ``pending`` table holds one row per transaction that has half messages and no ``op`` row:
its first message by ``msg_id`` (without the body) and its ``message_count``. Each commit of
``pending`` records, as Delta application transactions, the ``half`` and ``op`` versions it
covers. :func:`update_pending` reads what was inserted into ``half`` (appends and MERGE inserts)
and ``op`` after those versions from their change data feeds, applies it to the pending rows, and
overwrites ``pending`` with the result and the new versions in one commit. A round's cost
follows the pending transactions and the new work, never the decided history (rule 9).

How it stays exact (it always equals the full anti-join of the versions it covers):

* **A killed update** commits nothing (one commit holds the rows and the versions), so the
  next one starts from the old state.
* **Two updates at once** set the same application ids and remove the same file, so Delta
  refuses the second commit; it retries from the winner's state.
* **A new half message of a transaction decided earlier** (an ``op`` row older than the
  covered op version, e.g. a late stage of a rolled-back epoch attempt) is looked up in ``op``
  by id (files pruned by their id statistics) before it becomes pending.
* **No cursors, or a change feed that cannot be read** (a new or upgraded store, change files
  vacuumed, compacted files vacuumed, log cleaned up): the update rebuilds from a full scan and
  logs why.
* **Another Delta writer changed ``op``** (a RESTORE or DELETE removing decisions, which the
  feed of inserts does not show): the update rebuilds from a full scan, so the transactions
  whose decisions went are pending again and check-back records them again (see
  :meth:`rmq_spark.checkback.job.CheckBackJob`).

Every update rewrites the table, so every ``VACUUM_EVERY_UPDATES`` versions it vacuums the
files older versions left behind (past the table's one-hour tombstone retention) and cleans its
log (:meth:`rmq_spark.store.facade.Store.clean_log`).

Deleted half rows (retention) are ignored: retention deletes only decided transactions, which
are not pending. Nothing but this module writes ``pending``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake
from deltalake.exceptions import DeltaError

from rmq_spark.delta.reads import read_arrow, read_files, row_keys, with_uris
from rmq_spark.delta.retry import retry_commits
from rmq_spark.delta.txnlog import commit_infos, entry_times
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.schema import PENDING_SCHEMA, TABLES
from rmq_spark.store.facade import Store
from rmq_spark.store.maintenance import PENDING_HALF_APP_ID, PENDING_OP_APP_ID
from rmq_spark.store.oplog import foreign_change

log = logging.getLogger(__name__)

#: Every this many updates of ``pending`` vacuum its old files and clean its log.
VACUUM_EVERY_UPDATES = 50

#: The half columns ``pending`` keeps (all but the body).
_HALF_COLUMNS = [n for n in PENDING_SCHEMA.names if n != "message_count"]


@dataclass(frozen=True)
class PendingUpdate:
    """The pending transactions at the ``half`` and ``op`` versions they cover."""

    #: One row per pending transaction (``pending`` schema), sorted by ``transaction_id``.
    rows: pa.Table
    half_version: int
    op_version: int
    #: How long each transaction that became pending in this update had been stored when the
    #: update committed, in seconds, on the store's clock (the modification times of its half
    #: message's log entry and of this update's; after a rebuild, of the latest half entry's, a
    #: lower bound); absent when the store gives no times.
    stored_ages: Mapping[str, float] = field(default_factory=dict)


def update_pending(store: Store) -> PendingUpdate:
    """Bring the ``pending`` table up to the latest ``half`` and ``op`` versions.

    Parameters
    ----------
    store : Store
        The store.

    Returns
    -------
    PendingUpdate
        The pending transactions this update committed (or found up to date).

    Notes
    -----
    Safe to run from any number of processes at once and to kill at any point: see the
    module docstring.
    """
    return retry_commits("update pending transactions", "pending", lambda _: _attempt(store))


def scan_pending(store: Store) -> pa.Table:
    """The pending transactions by a full scan of ``half`` and ``op`` (``pending`` schema).

    Reads the whole history: what :func:`update_pending` rebuilds from when it has to.
    """
    half, op = store.table("half"), store.table("op")
    return _scan(store, half, op)


def pending_now(store: Store) -> pa.Table:
    """The pending transactions at the latest ``half`` and ``op`` versions (``pending``
    schema), without writing anything: the ``pending`` table moved on by what was written
    since it, as :func:`update_pending` would (a full scan where it would rebuild). What
    ``rmqtx status`` shows, at the cost of a check-back round's read; why it scans in full is
    logged at DEBUG (the next check-back round logs it when it rebuilds)."""
    return _computed(store, quiet=True)[0]


def _computed(
    store: Store, *, quiet: bool = False
) -> tuple[pa.Table, DeltaTable, int, int, dict[str, int] | None, bool]:
    """(pending rows, the ``pending`` table, half version, op version, the half version
    each new transaction was stored in where known, whether ``pending`` is already there)."""
    pending = store.table("pending")
    half_cursor = pending.transaction_version(PENDING_HALF_APP_ID)
    op_cursor = pending.transaction_version(PENDING_OP_APP_ID)
    # op first: a half message read later is looked up against this op snapshot.
    op = store.table("op")
    half = store.table("half")
    half_version, op_version = half.version(), op.version()
    current = _read(store, pending)
    if (half_cursor, op_cursor) == (half_version, op_version):
        return current, pending, half_version, op_version, None, True
    stored_in: dict[str, int] | None = None  # known on the change feed's path only

    def note(level: int, message: str, *args: object) -> None:
        log.log(logging.DEBUG if quiet else level, message, *args)

    if half_cursor is None or op_cursor is None:
        note(
            logging.INFO, "pending transactions: no recorded versions; rebuilding from a full scan"
        )
        rows = _scan(store, half, op)
    elif half_cursor > half_version or op_cursor > op_version:
        note(
            logging.WARNING,
            "pending transactions cover half version %d and op version %d, beyond the tables' "
            "versions %d and %d (tables replaced?); rebuilding from a full scan",
            half_cursor,
            op_cursor,
            half_version,
            op_version,
        )
        rows = _scan(store, half, op)
    elif foreign := _foreign_versions(store, op_cursor, op_version):
        note(
            logging.WARNING,
            "pending transactions: op version %d was written by another Delta writer; "
            "rebuilding from a full scan",
            foreign[0],
        )
        rows = _scan(store, half, op)
    else:
        try:
            rows, stored_in = _advance(store, current, half, half_cursor, op, op_cursor)
        except (DeltaError, OSError, pa.ArrowException) as exc:
            note(
                logging.WARNING,
                "pending transactions: the change feed of half versions %d-%d or op versions "
                "%d-%d cannot be read (%s); rebuilding from a full scan",
                half_cursor + 1,
                half_version,
                op_cursor + 1,
                op_version,
                str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
            )
            rows = _scan(store, half, op)
    return rows, pending, half_version, op_version, stored_in, False


def _attempt(store: Store) -> PendingUpdate:
    rows, pending, half_version, op_version, stored_in, up_to_date = _computed(store)
    if up_to_date:
        return PendingUpdate(rows, half_version, op_version)
    if stored_in is None:
        # A rebuild knows no version per transaction: each is taken as stored in the latest
        # half version (so its age is never overstated) unless its clock started already.
        stored_in = dict.fromkeys(rows.column("transaction_id").to_pylist(), half_version)
    failpoint("pending.computed")
    write_deltalake(
        pending,
        rows,
        mode="overwrite",
        commit_properties=CommitProperties(
            app_transactions=[
                Transaction(PENDING_HALF_APP_ID, half_version),
                Transaction(PENDING_OP_APP_ID, op_version),
            ],
            custom_metadata={"rmqtx.operation": "update pending"},
        ),
    )
    log.debug("pending transactions: %d at half %d, op %d", rows.num_rows, half_version, op_version)
    if pending.version() % VACUUM_EVERY_UPDATES == 0:
        _vacuum(store, pending)
    return PendingUpdate(rows, half_version, op_version, _stored_ages(store, stored_in))


def _stored_ages(store: Store, stored_in: Mapping[str, int]) -> dict[str, float]:
    """How long each transaction had been stored, by the version of ``half`` it was stored in,
    when ``pending``'s latest commit was written: both times are modification times of log
    entries, so the store's clock, not a producer's or this job's (apache/rocketmq#9640).
    Empty when the listings fail (the transactions' ages then start now)."""
    if not stored_in:
        return {}
    options = store.settings.storage_options
    try:
        stored = entry_times(store.table_uri("half"), options, min(stored_in.values()))
        updates = entry_times(store.table_uri("pending"), options, 0)
    except OSError as exc:
        log.info("pending transactions: no store times for their ages (%s)", exc)
        return {}
    if not updates:
        return {}
    now = updates[max(updates)]
    return {t: max(0.0, now - stored[v]) for t, v in stored_in.items() if v in stored}


def _foreign_versions(store: Store, cursor: int, version: int) -> list[int]:
    """The versions of ``op`` after ``cursor`` up to ``version`` that another Delta writer
    made (:func:`rmq_spark.store.oplog.foreign_change`); all of them when their log entries are
    gone (the change feed could not be read either)."""
    try:
        infos = commit_infos(
            store.table_uri("op"), store.settings.storage_options, cursor + 1, version
        )
    except LookupError:
        return list(range(cursor + 1, version + 1))
    return [v for v, info in infos.items() if foreign_change(info)]


def _vacuum(store: Store, pending: DeltaTable) -> None:
    """Delete the files of older versions (every update rewrites the table) once they are past
    the table's tombstone retention, and the log entries past the store's ``log_retention``.
    Never raises: the update has landed."""
    try:
        deleted = pending.vacuum(dry_run=False)
        store.clean_log("pending")
    except Exception:
        log.warning("vacuum of the pending table failed; a later update retries", exc_info=True)
        return
    log.debug("vacuumed %d old file(s) of the pending table", len(deleted))


def _advance(
    store: Store,
    current: pa.Table,
    half: DeltaTable,
    half_cursor: int,
    op: DeltaTable,
    op_cursor: int,
) -> tuple[pa.Table, dict[str, int]]:
    """``current`` (pending at the cursors) moved on to the tables' versions, and the
    ``half`` version each transaction new in it was first stored in."""
    inserted = inserted_since(half, half_cursor, [*_HALF_COLUMNS, "_commit_version"])
    # The op snapshot is read before the change feeds and never moved while in use.
    rows = current
    stored_in: dict[str, int] = {}
    if inserted.num_rows:
        ones = pa.array([1] * inserted.num_rows, pa.int64())
        new = _reduce(inserted.select(_HALF_COLUMNS).append_column("message_count", ones))
        new_ids = pc.filter(
            new.column("transaction_id"),
            pc.invert(pc.is_in(new.column("transaction_id"), value_set=current.column(0))),
        )
        # Transactions not pending before may have been decided before the op cursor.
        decided = store.decisions(new_ids.to_pylist(), op=op)
        new = _without(new, decided)
        rows = _reduce(pa.concat_tables([current, new]))
        first = inserted.group_by("transaction_id").aggregate([("_commit_version", "min")])
        stored_in = dict(
            zip(
                first.column("transaction_id").to_pylist(),
                first.column("_commit_version_min").to_pylist(),
                strict=True,
            )
        )
    decided_now = inserted_since(op, op_cursor, ["transaction_id"]).column("transaction_id")
    return _without(rows, decided_now.to_pylist()), stored_in


def inserted_since(table: DeltaTable, cursor: int, columns: list[str]) -> pa.Table:
    """The ``columns`` of the rows inserted into ``table`` (appends and MERGE inserts) after
    version ``cursor``, up to the version of its snapshot, read from its change data feed.

    Raises deltalake's or pyarrow's errors when the feed of that range cannot be read.
    """
    version = table.version()
    if version <= cursor:
        return pa.table({c: pa.array([], pa.string()) for c in columns})
    changes = read_arrow(
        table.load_cdf(
            starting_version=cursor + 1,
            ending_version=version,
            columns=[*columns, "_change_type"],
        )
    )
    return changes.filter(pc.equal(changes.column("_change_type"), "insert"))


def _scan(store: Store, half: DeltaTable, op: DeltaTable) -> pa.Table:
    """Pending transactions of the ``half`` and ``op`` snapshots, by reading both whole."""
    schema = pa.schema([PENDING_SCHEMA.field(c) for c in _HALF_COLUMNS])
    options = store.settings.storage_options
    decided = read_files(
        with_uris(op, store.table_uri("op")).column("uri").to_pylist(),
        pa.schema([TABLES["op"][0].field("transaction_id")]),
        options,
    ).column("transaction_id")
    rows = read_files(
        with_uris(half, store.table_uri("half")).column("uri").to_pylist(),
        schema,
        options,
        lambda t: pc.invert(pc.is_in(t.column("transaction_id"), value_set=decided)),
    )
    ones = pa.array([1] * rows.num_rows, pa.int64())
    return _reduce(rows.append_column("message_count", ones))


def _read(store: Store, pending: DeltaTable) -> pa.Table:
    uris = with_uris(pending, store.table_uri("pending")).column("uri").to_pylist()
    return read_files(uris, PENDING_SCHEMA, store.settings.storage_options)


def _reduce(rows: pa.Table) -> pa.Table:
    """One row per transaction: its first message by ``msg_id``, with the summed
    ``message_count``; sorted by ``transaction_id``."""
    rows = _conform(rows)
    if rows.num_rows == 0:
        return rows
    groups = rows.group_by("transaction_id").aggregate(
        [("msg_id", "min"), ("message_count", "sum")]
    )
    key = row_keys(rows, ["transaction_id", "msg_id"])
    first_key = row_keys(groups, ["transaction_id", "msg_id_min"])
    first = rows.filter(pc.is_in(key, value_set=first_key)).sort_by("transaction_id")
    groups = groups.sort_by("transaction_id")
    return first.set_column(
        PENDING_SCHEMA.get_field_index("message_count"),
        PENDING_SCHEMA.field("message_count"),
        groups.column("message_count_sum").cast(pa.int64()),
    )


def _without(rows: pa.Table, transaction_ids: Sequence[str]) -> pa.Table:
    if not len(transaction_ids):
        return rows
    ids = pa.array(list(transaction_ids), pa.string())
    return rows.filter(pc.invert(pc.is_in(rows.column("transaction_id"), value_set=ids)))


def _conform(rows: pa.Table) -> pa.Table:
    return pa.Table.from_arrays(
        [rows.column(f.name).cast(f.type) for f in PENDING_SCHEMA], schema=PENDING_SCHEMA
    )
