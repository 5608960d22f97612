"""Checker functions for the check-back tests (imported by name on Spark's executors)."""

from __future__ import annotations

import os

from rmq_spark import LocalTransactionState, MessageExt


def by_tag(msg: MessageExt) -> LocalTransactionState:
    """Answer with the message's tag: COMMIT, ROLLBACK, UNKNOWN, or RAISE to fail."""
    if msg.tags == "RAISE":
        raise RuntimeError(f"order database unreachable for {msg.keys}")
    return LocalTransactionState.coerce(msg.tags)


def commit_after_producer_rollback(msg: MessageExt) -> LocalTransactionState:
    """Let the producer decide ROLLBACK while the check is running, then answer COMMIT."""
    from rmq_spark import Decision, Store

    store = Store.open(msg.properties["test_store"], create=False)
    store.end_transactions(
        [Decision(msg.transaction_id, msg.producer_group, LocalTransactionState.ROLLBACK)]
    )
    return LocalTransactionState.COMMIT


def slow_commit(msg: MessageExt) -> LocalTransactionState:
    """COMMIT, slowly when the tag says so (lets a test kill the job mid-run)."""
    if msg.tags == "SLOW":
        import time

        time.sleep(float(os.environ.get("RMQ_TEST_SLOW_SECONDS", "600")))
    return LocalTransactionState.COMMIT


def always_commit(msg: MessageExt) -> LocalTransactionState:
    """COMMIT everything."""
    return LocalTransactionState.COMMIT
