"""The store among other Delta writers (issue 29): a user's deltalake or delta-spark commits on
the store's tables, a stalled process, and the log cleanup must never lose or resurrect a
message silently."""

from __future__ import annotations

import logging

import pytest
from deltalake import DeltaTable

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.store import COMPACT_EVERY_COMMITS
from rmq_spark.txnlog import checkpoint_guess
from tests.conftest import commitlog

COMMIT = LocalTransactionState.COMMIT


def test_the_checkpoint_guess_is_the_multiple_of_the_interval_at_or_before() -> None:
    """Checkpoints are written at versions that are multiples of the interval; the guess was
    one version short of it (19 for 20), so every lookup listed the whole log."""
    assert [checkpoint_guess(v, 10) for v in (9, 10, 15, 19, 20, 21)] == [0, 10, 10, 10, 20, 20]
    assert checkpoint_guess(100, 100) == 100


def _commit_each(store: Store, n: int, topic: str = "T") -> list[str]:
    """``n`` transactions, each prepared and committed on its own (a commit of op each)."""
    ids = []
    for i in range(n):
        (p,) = store.prepare([Message(topic, f"m{i}")], "pg")
        store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
        ids.append(p.transaction_id)
    return ids


def test_a_restore_of_op_to_before_a_compaction_publishes_nothing_again(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """RESTORE re-adds the files a compaction replaced, with dataChange true; the change data
    feed reports their rows as inserts, and the publisher copied every committed transaction
    into the CommitLog again with new offsets. Only decisions the store wrote are published;
    the foreign commit is reported, not applied."""
    committed = _commit_each(store, COMPACT_EVERY_COMMITS + 5)
    op = DeltaTable(store.table_uri("op"))
    compaction = next(h["version"] for h in op.history() if h["operation"] == "OPTIMIZE")
    op.restore(compaction - 1)
    with caplog.at_level(logging.WARNING, logger="rmq_spark"):
        (p,) = store.prepare([Message("T", b"after")], "pg")
        store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
    ids = commitlog(store).column("transaction_id").to_pylist()
    assert sorted(ids) == sorted([*committed, p.transaction_id])
    assert "RESTORE" in caplog.text and "not written by rmq-spark" in caplog.text
