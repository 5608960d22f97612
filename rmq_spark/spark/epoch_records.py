"""Where epochs are recorded: the ``epochs`` rows and the marker of a Delta write.

The state machine of :mod:`rmq_spark.spark.epochs` lives in one ``epochs`` row per (sink,
epoch). This module reads those rows (:func:`read_epochs`, :func:`read_epoch`,
:func:`closed_epoch`) and writes them only by a conditional Delta MERGE on the row
(:func:`merge_epoch`), so racing transitions conflict and exactly one applies. It also reads
and writes the evidence :func:`rmq_spark.spark.sink.publish_with_delta_write` leaves in the
business table: the ``userMetadata`` marker naming the staged transaction
(:func:`delta_commit_marker`, :func:`landed_delta_write`).

It keeps docs/contract.md rule 8 (no partial success) at the storage level: every transition is
decided by the MERGE's condition on the stored row, never by what a writer read before, and
the caller is handed the row as it is after the MERGE, whichever transition won.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import pyarrow as pa
from deltalake import DeltaTable

from rmq_spark.delta.reads import sql_string
from rmq_spark.delta.storage import deltalake_options
from rmq_spark.delta.store_clock import StoreClock
from rmq_spark.model.clock import Clock, in_utc, utc_now
from rmq_spark.model.errors import StoreError
from rmq_spark.model.schema import EPOCHS_SCHEMA
from rmq_spark.store.facade import Store

#: The states an ``epochs`` row holds (their transitions: :mod:`rmq_spark.spark.epochs`).
OPEN, CLOSED, ABANDONED = "OPEN", "CLOSED", "ABANDONED"
#: Delta ``userMetadata`` prefix of a ``publish_with_delta_write`` commit: names the staged
#: transaction that goes with the business rows.
DELTA_COMMIT_MARKER = "rmqtx-epoch:"


@dataclass(frozen=True)
class Epoch:
    """One row of ``epochs``."""

    sink_id: str
    epoch: int
    state: str
    generation: int
    #: CLOSED: the transactions that count.
    transaction_ids: tuple[str, ...] | None
    lease_expires: datetime | None
    owner: str | None
    closed_by: str | None


_CLOCKS: dict[str, StoreClock] = {}
_CLOCKS_LOCK = threading.Lock()


def lease_clock(store: Store, clock: Clock | None = None) -> Clock:
    """The clock leases are written and judged on: ``clock`` when a caller gives one other
    than the system clock (a test's), else now on the store's clock (one
    :class:`~rmq_spark.delta.store_clock.StoreClock` a store and process). A lease is written
    by a sink's tasks and judged by the check-back job, on other hosts than theirs."""
    if clock is not None and clock is not utc_now:
        return in_utc(clock)
    uri = store.table_uri("epochs")
    with _CLOCKS_LOCK:
        if uri not in _CLOCKS:
            _CLOCKS[uri] = StoreClock(uri, store.settings.storage_options)
        return _CLOCKS[uri]


# --------------------------------------------------------------------------- reading
def read_epochs(store: Store, keys: Iterable[tuple[str, int]]) -> dict[tuple[str, int], Epoch]:
    """The ``epochs`` rows of the given (sink, epoch) keys that exist, in one read (of the
    files whose statistics may hold those epochs: a sink's history is never read whole)."""
    wanted = set(keys)
    if not wanted:
        return {}
    sinks = ", ".join(sql_string(s) for s in sorted({s for s, _ in wanted}))
    epochs = ", ".join(str(int(e)) for e in sorted({e for _, e in wanted}))
    rows = store.query("epochs", f"sink_id IN ({sinks}) AND epoch IN ({epochs})")
    found = {}
    for r in rows.to_pylist():
        key = (r["sink_id"], r["epoch"])
        if key in wanted:
            found[key] = Epoch(
                sink_id=r["sink_id"],
                epoch=r["epoch"],
                # Rows of older stores have no state: they were all closed.
                state=r["state"] or CLOSED,
                generation=r["generation"] or 0,
                transaction_ids=None
                if r["transaction_ids"] is None
                else tuple(r["transaction_ids"]),
                lease_expires=r["lease_expires"],
                owner=r["owner"],
                closed_by=r["closed_by"],
            )
    return found


#: What a pending transaction a transactional writer staged waits for (:func:`staged_in`).
RUNNING, LISTED, DROPPED = "running", "listed", "dropped"


def staged_in(store: Store, staged: Iterable[Mapping[str, Any]]) -> dict[str, str]:
    """For transactions a transactional writer staged (rows with ``transaction_id``,
    ``sink_id``, ``epoch`` and ``generation``), what they wait for: ``RUNNING``, their writer
    (their epoch is OPEN in their generation, or not opened yet); ``LISTED``, the next
    check-back round, which commits them (their epoch was CLOSED with them, and the writer
    stopped before its decisions); ``DROPPED``, the next check-back round, which rolls them
    back (closed without them, abandoned or reopened)."""
    rows = list(staged)
    epochs = read_epochs(store, {(r["sink_id"], r["epoch"]) for r in rows})
    waits = {}
    for r in rows:
        e = epochs.get((r["sink_id"], r["epoch"]))
        if e is None or (e.state == OPEN and e.generation == (r["generation"] or 0)):
            waits[r["transaction_id"]] = RUNNING
        elif e.state == CLOSED and r["transaction_id"] in e.transaction_ids:
            waits[r["transaction_id"]] = LISTED
        else:
            waits[r["transaction_id"]] = DROPPED
    return waits


def read_epoch(store: Store, sink_id: str, epoch: int) -> Epoch | None:
    """The ``epochs`` row of one (sink, epoch), or None if no writer has touched it."""
    return read_epochs(store, [(sink_id, epoch)]).get((sink_id, epoch))


def closed_epoch(store: Store, sink_id: str, epoch: int) -> tuple[str, ...] | None:
    """The transactions that count for a closed epoch, or None while it is not closed."""
    row = read_epoch(store, sink_id, epoch)
    return row.transaction_ids if row is not None and row.state == CLOSED else None


# --------------------------------------------------------------------------- writing
def merge_epoch(
    store: Store,
    sink_id: str,
    epoch: int,
    values: Mapping[str, Any],
    clauses: Callable[[Any], Any],
) -> Epoch:
    """MERGE a one-row source (alias ``s``: ``values`` plus the key; values that are not
    columns of ``epochs`` are timestamps for the clauses' conditions) into ``epochs`` with
    ``clauses``, then read the row back: whatever transition won is what the caller sees."""
    columns = {f.name: None for f in EPOCHS_SCHEMA} | {"sink_id": sink_id, "epoch": epoch}
    columns |= values
    schema = EPOCHS_SCHEMA
    for name in columns.keys() - set(EPOCHS_SCHEMA.names):
        schema = schema.append(pa.field(name, pa.timestamp("us", tz="UTC")))
    source = pa.Table.from_pylist([columns], schema=schema)
    store.merge("epochs", source, ["sink_id", "epoch"], clauses)
    row = read_epoch(store, sink_id, epoch)
    assert row is not None  # the MERGE committed, by us or by a racing writer
    return row


def insert_all(merger: Any) -> Any:
    """Add to a MERGE the clause that inserts the source row when the epoch has none."""
    return merger.when_not_matched_insert({c: f"s.{c}" for c in EPOCHS_SCHEMA.names})


# --------------------------------------------------------------------------- Delta writes
def delta_commit_marker(sink_id: str, epoch: int, transaction_id: str) -> str:
    """The ``userMetadata`` a ``publish_with_delta_write`` commit carries."""
    payload = {"sink_id": sink_id, "epoch": epoch, "transaction_id": transaction_id}
    return DELTA_COMMIT_MARKER + json.dumps(payload, sort_keys=True)


def landed_delta_write(
    table_uri: str, sink_id: str, epoch: int, storage_options: Mapping[str, str]
) -> tuple[bool, str | None]:
    """Whether the business table holds application transaction (``sink_id``, ``epoch``), and
    the staged transaction its commit names (None when the commit carries no marker)."""
    try:
        table = DeltaTable(table_uri, storage_options=deltalake_options(storage_options))
        version = table.transaction_version(sink_id)
        history = table.history() if version is not None and version >= epoch else []
    except Exception as exc:
        raise StoreError(
            f"cannot read the Delta table {table_uri!r} written by sink {sink_id!r} "
            f"(publish_with_delta_write): {exc}"
        ) from exc
    if version is None or version < epoch:
        return False, None
    for commit in history:
        text = commit.get("userMetadata") or ""
        if text.startswith(DELTA_COMMIT_MARKER):
            meta = json.loads(text[len(DELTA_COMMIT_MARKER) :])
            if meta["sink_id"] == sink_id and meta["epoch"] == epoch:
                return True, meta["transaction_id"]
    return True, None
