"""The producer services' local state (SQLite): the torture test's ground truth.

Every producer worker owns one SQLite database. Before it sends a half message it records
the *intent* (business key, plan, how many times the checker should stall); its local
transaction inserts the key into ``orders`` and marks the intent ``committed``, in one SQLite
transaction that only succeeds while the intent is still ``pending``. The checker
(:func:`check_order`, run by the check-back job on Spark's executors) answers from the same
database: COMMIT when the order exists; otherwise it *fences* the intent (``pending`` ->
``aborted``) so the local transaction can never commit later, and answers ROLLBACK. So the
database alone says, for every key, whether its message must be visible, independently of
the system under test.
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

from rmq_spark import LocalTransactionState, MessageExt, TransactionListener

COMMIT, ROLLBACK, UNKNOWN = (
    LocalTransactionState.COMMIT,
    LocalTransactionState.ROLLBACK,
    LocalTransactionState.UNKNOWN,
)

#: Message property naming the producer's database (so the checker knows where to look).
PROPERTY_DB = "TORTURE_DB"

#: Producer plans: what the listener does, and the weight of each.
PLANS = {
    "COMMIT": 30,  # local commit, answer COMMIT
    "ROLLBACK": 12,  # no local write, answer ROLLBACK
    "UNKNOWN_BEFORE": 10,  # no local write, answer UNKNOWN: the check-back must roll back
    "UNKNOWN_AFTER": 12,  # local commit, answer UNKNOWN: the check-back must commit
    "UNKNOWN_AFTER_LATE_END": 5,  # as UNKNOWN_AFTER, then end_transaction(COMMIT) later
    "RAISE_BEFORE": 5,  # listener raises before writing
    "RAISE_AFTER": 6,  # listener raises after the local commit
    "SLOW_COMMIT": 6,  # local commit after a pause (races the check-back's fencing)
}

SCHEMA = """
CREATE TABLE IF NOT EXISTS intents (
    key TEXT PRIMARY KEY,
    plan TEXT NOT NULL,
    status TEXT NOT NULL,          -- pending, committed, rolled_back, aborted, send_failed
    stall_checks INTEGER NOT NULL, -- the checker answers UNKNOWN (or raises) this many times
    checks INTEGER NOT NULL DEFAULT 0,
    transaction_id TEXT,
    created REAL NOT NULL,
    decided REAL
);
CREATE TABLE IF NOT EXISTS orders (
    key TEXT PRIMARY KEY,
    committed REAL NOT NULL
);
"""


def connect(path: str | Path) -> sqlite3.Connection:
    """A connection in autocommit mode (transactions are explicit ``BEGIN IMMEDIATE``)."""
    conn = sqlite3.connect(str(path), timeout=120, isolation_level=None)
    conn.execute("PRAGMA busy_timeout = 120000")
    return conn


def create(path: str | Path) -> None:
    """Create a producer database (WAL, so readers never block the service)."""
    conn = connect(path)
    conn.execute("PRAGMA journal_mode = WAL")
    conn.executescript(SCHEMA)
    conn.close()


def record_intent(conn: sqlite3.Connection, key: str, plan: str, stall_checks: int) -> None:
    conn.execute(
        "INSERT INTO intents (key, plan, status, stall_checks, created) VALUES (?, ?, ?, ?, ?)",
        (key, plan, "pending", stall_checks, time.time()),
    )


def local_commit(conn: sqlite3.Connection, key: str) -> bool:
    """The local transaction: insert the order, unless the checker fenced the intent."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        (status,) = conn.execute("SELECT status FROM intents WHERE key = ?", (key,)).fetchone()
        if status != "pending":
            conn.execute("ROLLBACK")
            return False
        now = time.time()
        conn.execute("INSERT INTO orders (key, committed) VALUES (?, ?)", (key, now))
        conn.execute(
            "UPDATE intents SET status = 'committed', decided = ? WHERE key = ?", (now, key)
        )
        conn.execute("COMMIT")
        return True
    except BaseException:
        conn.execute("ROLLBACK")
        raise


def mark(conn: sqlite3.Connection, key: str, status: str) -> None:
    """Move a still-pending intent to ``status`` (rolled_back, send_failed)."""
    conn.execute(
        "UPDATE intents SET status = ?, decided = ? WHERE key = ? AND status = 'pending'",
        (status, time.time(), key),
    )


def set_transaction(conn: sqlite3.Connection, key: str, transaction_id: str) -> None:
    conn.execute("UPDATE intents SET transaction_id = ? WHERE key = ?", (transaction_id, key))


class OrderListener(TransactionListener):
    """The producer service's listener; ``arg`` is ``(key, plan)``. One per thread (SQLite
    connections are not shared between threads)."""

    def __init__(self, db: str | Path, slow_seconds: float = 0.0) -> None:
        self.db = str(db)
        self.slow_seconds = slow_seconds
        self._conn: sqlite3.Connection | None = None

    @property
    def conn(self) -> sqlite3.Connection:
        if self._conn is None:
            self._conn = connect(self.db)
        return self._conn

    def execute_local_transaction(self, msg: MessageExt, arg: object) -> LocalTransactionState:
        key, plan = arg  # type: ignore[misc]
        set_transaction(self.conn, key, msg.transaction_id or "")
        if plan == "COMMIT":
            return COMMIT if local_commit(self.conn, key) else ROLLBACK
        if plan == "ROLLBACK":
            mark(self.conn, key, "rolled_back")
            return ROLLBACK
        if plan == "UNKNOWN_BEFORE":
            return UNKNOWN
        if plan in ("UNKNOWN_AFTER", "UNKNOWN_AFTER_LATE_END"):
            local_commit(self.conn, key)
            return UNKNOWN
        if plan == "RAISE_BEFORE":
            raise RuntimeError(f"torture: listener raises before the local write of {key}")
        if plan == "RAISE_AFTER":
            local_commit(self.conn, key)
            raise RuntimeError(f"torture: listener raises after the local write of {key}")
        if plan == "SLOW_COMMIT":
            time.sleep(self.slow_seconds)
            return COMMIT if local_commit(self.conn, key) else ROLLBACK
        raise AssertionError(f"unknown plan {plan!r}")

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        return check_order(msg)


def check_order(msg: MessageExt) -> LocalTransactionState:
    """The producer groups' checker (``tests.torture.local_db:check_order``), answered from
    the producer's SQLite database. Stalls (UNKNOWN, or raising every other time) for the
    intent's ``stall_checks`` first checks, then tells the truth, fencing what never ran."""
    conn = connect(msg.properties[PROPERTY_DB])
    try:
        conn.execute("BEGIN IMMEDIATE")
        row = conn.execute(
            "SELECT status, stall_checks, checks FROM intents WHERE key = ?", (msg.keys,)
        ).fetchone()
        if row is None:
            conn.execute("ROLLBACK")
            raise LookupError(f"torture: no intent for key {msg.keys!r}")
        status, stall, checks = row
        checks += 1
        conn.execute("UPDATE intents SET checks = ? WHERE key = ?", (checks, msg.keys))
        if checks <= stall:
            conn.execute("COMMIT")
            if checks % 2 == 0:
                raise RuntimeError(f"torture: order database busy for {msg.keys}")
            return UNKNOWN
        ordered = conn.execute("SELECT 1 FROM orders WHERE key = ?", (msg.keys,)).fetchone()
        if ordered:
            conn.execute("COMMIT")
            return COMMIT
        if status == "pending":  # fence: the local transaction can no longer commit
            conn.execute(
                "UPDATE intents SET status = 'aborted', decided = ? WHERE key = ?",
                (time.time(), msg.keys),
            )
        conn.execute("COMMIT")
        return ROLLBACK
    finally:
        conn.close()


def read_truth(path: str | Path) -> tuple[dict[str, dict], set[str]]:
    """``({key: intent row}, {keys with a committed order})`` of one database."""
    conn = connect(path)
    try:
        conn.row_factory = sqlite3.Row
        intents = {r["key"]: dict(r) for r in conn.execute("SELECT * FROM intents")}
        orders = {r["key"] for r in conn.execute("SELECT key FROM orders")}
    finally:
        conn.close()
    return intents, orders
