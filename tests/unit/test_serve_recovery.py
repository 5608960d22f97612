"""Check-back through the clients of ``rmqtx serve``: which transactions the server asks its
connected clients about (the pending list the check-back job keeps, read from the store)."""

from __future__ import annotations

import asyncio

import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.pending import update_pending
from rmq_spark.model.config import TransactionSettings

pytest.importorskip("rocketmq", reason="the serve extra (rocketmq-python-client) is not installed")

from rmq_spark.serve.recovery import ClientCheckBack, Clients  # noqa: E402


def test_only_transactions_still_open_are_asked_about(store: Store) -> None:
    """The job's pending list is as old as its last round: a transaction decided since then
    was asked about all the same (the Java client's checker saw committed transactions)."""
    decided, still_open = (
        store.prepare([Message("TxOrders", f"m{i}")], "TxOrders")[0].transaction_id
        for i in range(2)
    )
    update_pending(store)  # the job's round
    store.end_transactions(
        [Decision(decided, "TxOrders", LocalTransactionState.COMMIT)], publish=False
    )
    clients = Clients()
    client = clients.connect("client-1")
    clients.note_topics("client-1", "", ["TxOrders"])
    loop = ClientCheckBack(store, clients, TransactionSettings(transaction_timeout=0.0))
    assert asyncio.run(loop.round()) == 1
    command = client.outbox.get_nowait()
    assert command.recover_orphaned_transaction_command.transaction_id == still_open
    assert asyncio.run(loop.round()) == 0  # once a check interval
