"""Decided history for the check-back benchmarks, written straight into the store's tables."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime

import pyarrow as pa
from deltalake import CommitProperties, Transaction, write_deltalake

from rmq_spark import Store
from rmq_spark.model.schema import OP_SCHEMA
from rmq_spark.store.queues import OP_CURSOR_APP_ID


def append_decisions(store: Store, ids: Sequence[str], now: datetime) -> None:
    """One ``op`` row per id (odd ids COMMIT, even ROLLBACK), in one append."""
    write_deltalake(
        store.table_uri("op"),
        pa.Table.from_pydict(
            {
                "transaction_id": list(ids),
                "producer_group": ["bench"] * len(ids),
                "decision": ["COMMIT" if int(i) % 2 else "ROLLBACK" for i in ids],
                "decided_by": ["producer"] * len(ids),
                "decided_timestamp": [now] * len(ids),
            },
            schema=OP_SCHEMA,
        ),
        mode="append",
    )


def mark_published(store: Store) -> None:
    """Record every decision so far as published, as the publisher's cursor would."""
    write_deltalake(
        store.table_uri("commitlog"),
        store.table("commitlog").schema().to_arrow().empty_table(),
        mode="append",
        commit_properties=CommitProperties(
            app_transactions=[Transaction(OP_CURSOR_APP_ID, store.table("op").version())]
        ),
    )
