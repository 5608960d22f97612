"""Check-back through the clients of ``rmqtx serve``: which transactions the server asks its
connected clients about (the pending list the check-back job keeps, read from the store)."""

from __future__ import annotations

import asyncio

import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.pending import update_pending
from rmq_spark.model.config import TransactionSettings

pytest.importorskip("rocketmq", reason="the serve extra (rocketmq-python-client) is not installed")

from rmq_spark.serve.accounts import Account  # noqa: E402
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
    clients.note_topics("client-1", None, ["TxOrders"])
    loop = ClientCheckBack(store, clients, TransactionSettings(transaction_timeout=0.0))
    assert asyncio.run(loop.round()) == 1
    command = client.outbox.get_nowait()
    assert command.recover_orphaned_transaction_command.transaction_id == still_open
    assert asyncio.run(loop.round()) == 0  # once a check interval


def test_a_client_is_asked_only_about_topics_its_account_may_publish(store: Store) -> None:
    """A transaction's group need not be one of its topics (a producer of the Python API names
    its own group): a stream of an account allowed ``Orders*`` that declared ``OrdersApp`` was
    sent a pending ``Payroll`` message of the group ``OrdersApp``, body included (review)."""
    store.prepare([Message("Payroll", "salary")], "OrdersApp")
    update_pending(store)
    clients = Clients()
    orders = Account("orders", "s", ("Orders*",))
    payroll = Account("payroll", "s", ("Payroll", "OrdersApp"))
    intruder, owner = clients.connect("c1", orders), clients.connect("c2", payroll)
    for client in (intruder, owner):
        clients.note_topics(client.client_id, client.account, ["OrdersApp"])
    loop = ClientCheckBack(store, clients, TransactionSettings(transaction_timeout=0.0))
    for _ in range(2):  # asked in turn: each round the next candidate
        asyncio.run(loop.round())
        loop._last_asked.clear()
    assert intruder.outbox.empty()
    assert owner.outbox.qsize() == 2
