"""The end-to-end demo: an order service publishing ``OrderCreated`` events transactionally.

The order service's local transaction inserts the order into its own database (SQLite here).
Some orders commit, some are declined (ROLLBACK), and some hit a database timeout after the
row was or was not written, so the service cannot tell (UNKNOWN): those wait for check-back,
which asks :meth:`OrderService.check_local_transaction` and finds the truth in the database.
"""

from __future__ import annotations

import json
import logging
import random
import sqlite3
import threading
from dataclasses import dataclass
from pathlib import Path

from rmq_spark.model.messages import LocalTransactionState, Message, MessageExt
from rmq_spark.producer import TransactionListener, TransactionMQProducer, TransactionSendResult
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

TOPIC = "OrderEvents"
PRODUCER_GROUP = "order-service"


@dataclass(frozen=True)
class Order:
    """One order placed with the demo's order service."""

    order_id: str
    customer: str
    amount: float
    #: What goes wrong in the local transaction: None, "declined", "timeout-after-write",
    #: or "timeout-before-write".
    fault: str | None = None


class OrderService(TransactionListener):
    """A toy order service whose local transaction is an INSERT into its own database.

    It holds no live resources (each call opens its own connection), so it pickles: its
    ``check_local_transaction`` runs on Spark's executors as a check-back checker.

    Parameters
    ----------
    database : str or Path
        The SQLite file holding the orders table (created if missing).
    """

    def __init__(self, database: str | Path) -> None:
        self.database = str(database)
        with self._connect() as db:
            db.execute(
                "CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, customer TEXT, "
                "amount REAL)"
            )

    def _connect(self) -> sqlite3.Connection:
        return sqlite3.connect(self.database, timeout=30)

    def execute_local_transaction(self, msg: MessageExt, arg: Order) -> LocalTransactionState:
        """Insert the order; decline large amounts; simulate database timeouts."""
        if arg.fault == "declined":
            return LocalTransactionState.ROLLBACK
        if arg.fault == "timeout-before-write":
            raise TimeoutError(f"database timed out before writing order {arg.order_id}")
        with self._connect() as db:
            db.execute(
                "INSERT INTO orders VALUES (?, ?, ?)", (arg.order_id, arg.customer, arg.amount)
            )
        if arg.fault == "timeout-after-write":
            raise TimeoutError(f"database commit of order {arg.order_id} timed out")
        return LocalTransactionState.COMMIT

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        """The order exists: COMMIT. It does not: the insert never happened, ROLLBACK."""
        with self._connect() as db:
            found = db.execute("SELECT 1 FROM orders WHERE order_id = ?", (msg.keys,)).fetchone()
        return LocalTransactionState.COMMIT if found else LocalTransactionState.ROLLBACK


def make_orders(count: int, seed: int | None = None) -> list[Order]:
    """A mix of orders: 60% succeed, 20% are declined, 20% time out (half of those after
    the order row was written). Order ids are new on every call unless ``seed`` is given."""
    rng = random.Random(seed)
    faults = [None] * 6 + ["declined"] * 2 + ["timeout-after-write", "timeout-before-write"]
    prefix = f"{rng.getrandbits(32):08x}"
    return [
        Order(
            f"order-{prefix}-{i:04d}",
            rng.choice(["ada", "grace", "linus", "barbara"]),
            round(rng.uniform(5, 500), 2),
            faults[i % len(faults)],
        )
        for i in range(count)
    ]


def place_orders(
    store: Store, service: OrderService, orders: list[Order], threads: int = 4
) -> list[TransactionSendResult]:
    """Send one ``OrderCreated`` event per order in a transaction, from several threads."""
    results: list[TransactionSendResult] = []
    lock = threading.Lock()

    def worker(chunk: list[Order]) -> None:
        for order in chunk:
            message = Message(
                TOPIC,
                json.dumps({"order_id": order.order_id, "amount": order.amount}),
                tags="OrderCreated",
                keys=order.order_id,
                properties={"customer": order.customer},
            )
            result = producer.send_message_in_transaction(message, order)
            with lock:
                results.append(result)

    with TransactionMQProducer(PRODUCER_GROUP, service, store=store) as producer:
        pool = [threading.Thread(target=worker, args=(orders[i::threads],)) for i in range(threads)]
        for thread in pool:
            thread.start()
        for thread in pool:
            thread.join()
    return results
