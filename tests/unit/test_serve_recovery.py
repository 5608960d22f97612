"""Check-back through the clients of ``rmqtx serve``: which transactions the server asks its
connected clients about (the pending list the check-back job keeps, read from the store)."""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.pending import update_pending
from rmq_spark.model.config import TransactionSettings
from tests.conftest import Clock

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


@pytest.mark.parametrize("immunity", ["abc", "NaN", "inf", "1e400", "9" * 400, "1_0", " 10 "])
def test_a_garbage_immunity_property_stops_nobody(store: Store, immunity: str) -> None:
    """A half message whose CHECK_IMMUNITY_TIME_IN_SECONDS is not a number of seconds (another
    Delta writer's row) failed every round of the server's check-back, so no client was asked
    about any transaction. It counts as no immunity, as in the check-back job's rounds."""
    (good,) = store.prepare([Message("TxOrders", "good")], "TxOrders")
    rows = store.half_messages([good.transaction_id]).to_pylist()
    rows[0] |= {
        "transaction_id": "garbage-immunity",
        "msg_id": "garbage-immunity",
        "properties": [("CHECK_IMMUNITY_TIME_IN_SECONDS", immunity)],
    }
    store.append("half", pa.Table.from_pylist(rows, schema=store.half_messages([]).schema))
    update_pending(store)
    clients = Clients()
    client = clients.connect("client-1")
    clients.note_topics("client-1", None, ["TxOrders"])
    loop = ClientCheckBack(store, clients, TransactionSettings(transaction_timeout=0.0))
    assert asyncio.run(loop.round()) == 2
    asked = set()
    while not client.outbox.empty():
        asked.add(client.outbox.get_nowait().recover_orphaned_transaction_command.transaction_id)
    assert asked == {good.transaction_id, "garbage-immunity"}


def test_an_immunity_shorter_than_the_timeout_does_not_make_a_transaction_due(
    store: Store,
) -> None:
    """Rule 6: a transaction is asked about once its age is at least the transaction timeout
    and its check immunity; a short immunity does not shorten the timeout."""
    store.prepare(
        [Message("TxOrders", "m", properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "0"})], "TxOrders"
    )
    update_pending(store)
    clients = Clients()
    clients.connect("client-1")
    clients.note_topics("client-1", None, ["TxOrders"])
    loop = ClientCheckBack(store, clients, TransactionSettings(transaction_timeout=3600.0))
    assert asyncio.run(loop.round()) == 0


def test_a_transaction_sent_by_a_host_whose_clock_is_behind_is_not_asked_early(
    tmp_path: Path,
) -> None:
    """Another server (or producer) whose clock runs an hour behind this one's stores a half
    message: aged by its ``store_timestamp``, this server asked the client at once, while the
    local transaction was still running (a checker that answers ROLLBACK when it finds no
    record then wins over the producer's COMMIT). Ages start when this server first finds a
    transaction pending, on its own clock (apache/rocketmq#9640)."""
    root = tmp_path / "store"
    behind = Store.open(root, clock=Clock(datetime.now(UTC) - timedelta(hours=1)))
    behind.prepare([Message("TxOrders", "m")], "TxOrders")
    here = Store.open(root)
    here.land_intake(0.0)  # the job's round
    update_pending(here)
    clients = Clients()
    client = clients.connect("client-1")
    clients.note_topics("client-1", None, ["TxOrders"])
    loop = ClientCheckBack(here, clients, TransactionSettings(transaction_timeout=1.0))
    assert asyncio.run(loop.round()) == 0
    time.sleep(1.1)
    assert asyncio.run(loop.round()) == 1
    assert client.outbox.qsize() == 1
