"""The per-transaction check state (``check_state``): when check-back first saw a pending
transaction and how many times it asked about it.

Keeps docs/contract.md, rule 6: a transaction's clock (``first_seen``, from which its age
against the timeout, immunity and max check age is measured) starts on the check-back job's
clock, and each UNKNOWN spends one check of its ``transaction_check_max`` budget, counted with
a conditional MERGE so that two jobs checking the same batch count once. The state is
forgotten only for transactions that are over (decided, or with no half message left), never
for ones missing from a run's snapshot: a concurrent job with a newer snapshot may have just
recorded them, and forgetting would postpone their check max and max age for ever. Keeps
rule 9: only rows outside the run's pending transactions are looked up, so the cost follows
the pending transactions, not the decided history.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.checkback.batch import CHECK
from rmq_spark.model.schema import CHECK_STATE_SCHEMA
from rmq_spark.store.facade import Store

#: The columns of a check batch row that ``check_state`` keeps.
STATE_COLUMNS = ["transaction_id", "producer_group", "first_seen", "check_count"]


def update_check_state(store: Store, updates: list[dict[str, object]]) -> None:
    """Insert or count ``updates`` (``STATE_COLUMNS`` plus ``new_count``, ``checked_at`` and
    ``error``), each only where ``check_count`` is still the one the run read."""
    if not updates:
        return
    source = pa.Table.from_pylist(
        [
            {
                "transaction_id": u["transaction_id"],
                "producer_group": u["producer_group"],
                "first_seen": u["first_seen"],
                "check_count": u["new_count"],
                "last_check_timestamp": u["checked_at"],
                "last_error": u["error"],
                "expected_count": u["check_count"],
            }
            for u in updates
        ],
        schema=CHECK_STATE_SCHEMA.append(pa.field("expected_count", pa.int32())),
    )
    store.merge(
        "check_state",
        source,
        "transaction_id",
        lambda m: m.when_matched_update(
            {
                "check_count": "s.check_count",
                "last_check_timestamp": "s.last_check_timestamp",
                "last_error": "s.last_error",
            },
            # Two jobs that checked the same batch count once.
            predicate="t.check_count = s.expected_count",
        ).when_not_matched_insert({c: f"s.{c}" for c in CHECK_STATE_SCHEMA.names}),
    )


def start_clocks(store: Store, pending: pa.Table, pending_ids: set[str], ended: set[str]) -> None:
    """Record when the check batch's unasked ``pending`` transactions were first seen; forget
    those that are over."""
    new = pending.filter(
        pc.and_(pending.column("new"), pc.not_equal(pending.column("reason"), CHECK))
    )
    update_check_state(
        store,
        [
            {**r, "new_count": r["check_count"], "checked_at": None, "error": None}
            for r in new.select(STATE_COLUMNS).to_pylist()
        ],
    )
    forget(store, pending_ids, ended)


def forget(store: Store, pending_ids: set[str], ended: set[str]) -> None:
    """Drop the check_state rows of transactions that are over: decided (``ended`` by
    this run, or with an ``op`` row), or with no half message left (retention removed
    them after their decision; a pending transaction's half messages are never removed).
    Never by absence from this run's snapshot (``pending_ids``): a concurrent job with a newer
    snapshot may have recorded a transaction this run never saw, and forgetting it would
    restart its clock and check count, postponing check max and max age for ever. Only rows of
    transactions outside this run's pending ones are looked up, so the cost follows the
    pending transactions, not the history."""
    known = store.read("check_state", ["transaction_id"])
    known_ids = set(known.column("transaction_id").to_pylist())
    unsure = sorted(known_ids - ended - pending_ids)
    decided = set(store.decisions(unsure))
    undecided = [t for t in unsure if t not in decided]
    staged = set(store.half_messages(undecided).column("transaction_id").to_pylist())
    gone = (known_ids & ended) | decided | (set(undecided) - staged)
    if gone:
        ids = pa.table({"transaction_id": pa.array(sorted(gone), pa.string())})
        store.merge("check_state", ids, "transaction_id", lambda m: m.when_matched_delete())
