"""Reading the store's tables: rows by transaction or message id, decisions, and SQL.

Rule 9 (cost follows the work): lookups by id read only the data files whose statistics admit
one of the ids (ids are time-ordered, so a lookup reads few files), whatever the history.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from rmq_spark.delta.files import admitting
from rmq_spark.delta.reads import conform, once_per_key, read_files
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.messages import LocalTransactionState
from rmq_spark.model.schema import HALF_SCHEMA, TABLES

log = logging.getLogger(__name__)


def rows_by_id(
    tables: DeltaTables,
    files: pa.Table,
    name: str,
    ids: Sequence[str],
    columns: Sequence[str] | None = None,
    column: str = "transaction_id",
) -> pa.Table:
    """Rows whose ``column`` (an id) is in ``ids``, in the snapshot of table ``name`` whose
    add actions are ``files`` (:meth:`DeltaTables.data_files`), in file order; only
    ``columns`` (which hold ``column``) if given.

    Files whose statistics of ``column`` admit none of the ids are not read (ids are
    time-ordered, so a lookup reads few files). Partition columns are read as nulls.
    """
    wanted = sorted(set(ids))
    admitted = admitting(files, wanted, column)
    return read_files(
        admitted.column("uri").to_pylist(),
        TABLES[name][0],
        tables.storage_options,
        lambda rows: pc.is_in(rows.column(column), value_set=pa.array(wanted, pa.string())),
        columns,
        sizes=admitted.column("size_bytes").to_pylist(),
    )


def half_messages(
    tables: DeltaTables, transaction_ids: Sequence[str], files: pa.Table | None = None
) -> pa.Table:
    """The half messages of the given transactions (``half`` schema), each once.

    ``files``: the add actions of the latest ``half`` snapshot (:meth:`DeltaTables.data_files`) when
    the caller has read them already.

    A half message is its transaction and ``msg_id``: one another Delta writer stored twice
    is read once (:func:`once`), never published or checked again.
    """
    if files is None:
        files = tables.data_files("half")
    return once(conform(rows_by_id(tables, files, "half", transaction_ids), HALF_SCHEMA), "half")


def held_in_half(
    tables: DeltaTables, transaction_ids: Sequence[str], snapshot: DeltaTable | None = None
) -> set[str]:
    """Those of ``transaction_ids`` that the ``half`` snapshot (default: the latest) holds a
    row of; only the ids are read."""
    files = tables.data_files("half", snapshot)
    rows = rows_by_id(tables, files, "half", transaction_ids, ["transaction_id"])
    return set(rows.column("transaction_id").to_pylist())


#: The columns (strings) that identify a row of the store's tables read through this module
#: (a re-driven message keeps its ``msg_id`` under a new transaction).
KEYS = {
    "half": ("transaction_id", "msg_id"),
    "check_state": ("transaction_id",),
    "discard": ("transaction_id", "msg_id"),
}


#: Of the rows of one key, the one in force: the first with the greatest values in these
#: columns, which only grow as the store updates a row in place (nulls least). A copy another
#: writer's compaction brought back from before an update (it read the files before rmq-spark's
#: compaction and a MERGE, and landed after them) loses, and a discard claimed for re-driving
#: stays claimed.
NEWEST = {
    "check_state": ("check_count", "last_check_timestamp"),
    "discard": ("redriven_transaction_id",),
}

#: The columns that make two rows of a table copies of one row, which the store's compaction
#: keeps once (:func:`rmq_spark.delta.compaction.compact`): a row of :data:`KEYS`, a published
#: message at its offset, a decision (all of it: a COMMIT recorded again after another writer
#: removed the first is a row of its own).
COPY_KEYS = {
    **KEYS,
    "commitlog": ("topic", "queue_id", "queue_offset", "msg_id"),
    "op": ("transaction_id", "decision", "decided_by", "decided_timestamp"),
}


def once(rows: pa.Table, name: str) -> pa.Table:
    """``rows`` of table ``name`` with each key (:data:`KEYS`) once: the row in force
    (:data:`NEWEST`, by those of its columns that were read), else the first.

    Another Delta writer can leave rows stored twice: deltalake lets a compaction of files
    that another compaction (rmq-spark's) rewrote first land too. The copies are one row: it
    is read (checked, published, updated) once, and the others are logged as a warning.
    """
    newest = [c for c in NEWEST.get(name, ()) if c in rows.column_names]
    kept = once_per_key(rows, KEYS[name], newest)
    if kept.num_rows < rows.num_rows:
        log.warning(
            "%s holds %d row(s) more than once: another Delta writer's compaction (OPTIMIZE) "
            "landed beside rmq-spark's on the same files. Each is read once, and rmq-spark's "
            "next compaction of those files keeps it once; leave compacting the store's tables "
            "to rmq-spark.",
            name,
            rows.num_rows - kept.num_rows,
        )
    return kept


def decisions_of(
    tables: DeltaTables, op: DeltaTable, ids: list[str]
) -> dict[str, LocalTransactionState]:
    """COMMIT or ROLLBACK of each of ``ids`` decided in the ``op`` snapshot ``op``."""
    rows = rows_by_id(tables, tables.data_files("op", op), "op", ids)
    return {
        tid: LocalTransactionState(dec)
        for tid, dec in zip(
            rows.column("transaction_id").to_pylist(),
            rows.column("decision").to_pylist(),
            strict=True,
        )
    }


def decisions(
    tables: DeltaTables, transaction_ids: Sequence[str], *, op: DeltaTable | None = None
) -> dict[str, LocalTransactionState]:
    """The decisions recorded in ``op`` for the given transactions.

    Parameters
    ----------
    transaction_ids : sequence of str
        Transactions to look up (files are pruned by their id statistics).
    op : DeltaTable, optional
        The ``op`` snapshot to read (default: the latest).

    Returns
    -------
    dict of str to LocalTransactionState
        COMMIT or ROLLBACK per decided transaction; undecided ones are absent.
    """
    return decisions_of(tables, op or tables.snapshot("op"), list(transaction_ids))


def published(tables: DeltaTables, transaction_ids: Sequence[str]) -> set[str]:
    """Which of the given transactions have messages in ``commitlog`` (files pruned by id).

    A pending transaction that is published had its decision removed from ``op`` by
    another Delta writer (a RESTORE or DELETE): see
    :data:`rmq_spark.store.oplog.DECIDED_BY_RECOVERY`.
    """
    rows = rows_by_id(
        tables, tables.data_files("commitlog"), "commitlog", transaction_ids, ["transaction_id"]
    )
    return set(rows.column("transaction_id").to_pylist())


def discarded(tables: DeltaTables, transaction_ids: Sequence[str]) -> set[str]:
    """Which of the given transactions have rows in ``discard`` (files pruned by id)."""
    rows = rows_by_id(tables, tables.data_files("discard"), "discard", transaction_ids)
    return set(rows.column("transaction_id").to_pylist())


def query(tables: DeltaTables, name: str, where: str) -> pa.Table:
    """Rows of one of the store's tables matching a SQL condition (DataFusion), in plain
    Arrow types. Quote values with :func:`rmq_spark.delta.reads.sql_string`.

    Files are pruned by their column statistics; ids are time-ordered, so lookups by id
    read few files. (pyarrow dataset filters are not used: files written by deltalake's
    MERGE carry view types that pyarrow's statistics pruning cannot compare.)
    """
    return tables.sql(name, f"SELECT * FROM {name} WHERE {where}")


def read(tables: DeltaTables, name: str, columns: Sequence[str] | None = None) -> pa.Table:
    """One of the store's tables whole (or some of its columns), in plain Arrow types; a row
    stored twice by another writer is read once when its key columns are read (:func:`once`).

    Read through DataFusion, like :meth:`DeltaTables.sql`: deltalake's ``to_pyarrow_table``
    can abort the interpreter at exit on object stores, and the CLI's exit codes would lie.
    """
    chosen = ", ".join(f'"{c}"' for c in columns) if columns else "*"
    rows = tables.sql(name, f"SELECT {chosen} FROM {name}")
    keyed = name in KEYS and set(KEYS[name]) <= set(rows.column_names)
    return once(rows, name) if keyed else rows
