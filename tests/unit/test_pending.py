"""Incremental pending transactions equal the full anti-join of half and op, on random histories
with compactions, vacuums, late stages, re-drive MERGEs, killed updates, lost state and two
updaters at once (real Delta tables, no Spark)."""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pyarrow as pa
import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback import pending as pending_module
from rmq_spark.checkback.pending import pending_now, scan_pending, update_pending
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.messages import new_id
from rmq_spark.model.schema import HALF_SCHEMA, PENDING_SCHEMA, WRITER_COLUMNS
from rmq_spark.store.maintenance import PENDING_HALF_APP_ID
from tests.conftest import race

#: Random histories per run: 60 in the suite (under a minute); RMQ_PENDING_HISTORIES=300 (or
#: more) for the full equivalence check.
HISTORIES = int(os.environ.get("RMQ_PENDING_HISTORIES", "60"))
STEPS = 12


def open_store(root: Path) -> Store:
    return Store.open(root, settings=Settings(store=StoreSettings(queue_nums=2)))


def oracle(store: Store) -> list[dict]:
    """half anti-join op, in plain Python: per pending transaction its first message by msg_id
    (without the body) and its message count."""
    decided = set(store.query("op", "true").column("transaction_id").to_pylist())
    by_txn: dict[str, list[dict]] = {}
    for row in store.query("half", "true").to_pylist():
        if row["transaction_id"] not in decided:
            by_txn.setdefault(row["transaction_id"], []).append(row)
    result = []
    for tid in sorted(by_txn):
        first = min(by_txn[tid], key=lambda r: r["msg_id"])
        result.append(
            {**{c: first[c] for c in PENDING_SCHEMA.names[:-1]}, "message_count": len(by_txn[tid])}
        )
    return result


def stored(store: Store) -> list[dict]:
    rows = store.query("pending", "true").to_pylist()
    return sorted(rows, key=lambda r: r["transaction_id"])


def plain(rows: list[dict]) -> list[dict]:
    """Rows with properties as sorted lists (maps come back as lists of tuples)."""
    return [{**r, "properties": sorted(r["properties"] or [])} for r in rows]


class History:
    """A random history of one store, with the pending transactions checked after updates."""

    def __init__(self, root: Path, rng: random.Random) -> None:
        self.root, self.rng, self.store = root, rng, open_store(root)
        self.decided_unstaged: list[str] = []

    def undecided(self) -> list[str]:
        return [r["transaction_id"] for r in oracle(self.store)]

    def step(self) -> None:
        action = self.rng.choices(
            [
                self.prepare,
                self.add_to_pending,
                self.decide,
                self.stage_late,
                self.merge_half,
                self.compact,
                self.vacuum,
                self.update,
                self.killed_update,
                self.two_updaters,
                self.lose_pending,
                self.retire,
            ],
            weights=[6, 2, 4, 3, 1, 1, 1, 4, 1, 1, 0.3, 1],
        )[0]
        action()

    def prepare(self) -> None:
        n = self.rng.randint(1, 4)
        tids = [new_id() for _ in range(self.rng.randint(1, n))]
        self.store.prepare(
            [
                Message("T", b"b", tags=self.rng.choice([None, "a"]), properties={"p": str(i)})
                for i in range(n)
            ],
            self.rng.choice(["g1", "g2"]),
            transaction_ids=[self.rng.choice(tids) for _ in range(n)],
        )

    def add_to_pending(self) -> None:
        undecided = self.undecided()
        if undecided:
            tid = self.rng.choice(undecided)
            self.store.prepare([Message("T", b"more")], "g1", transaction_ids=[tid])

    def decide(self) -> None:
        undecided = self.undecided()
        chosen = self.rng.sample(undecided, k=min(len(undecided), self.rng.randint(1, 3)))
        state = self.rng.choice(list(LocalTransactionState)[:2])
        self.store.end_transactions(
            [Decision(t, "g1", state) for t in chosen], publish=self.rng.random() < 0.3
        )

    def stage_late(self) -> None:
        """Decide a transaction with no half message yet, or stage a message of one decided
        earlier (a late stage of a rolled-back epoch attempt): often with updates between."""
        if self.decided_unstaged and self.rng.random() < 0.6:
            tid = self.decided_unstaged.pop()
            self.store.prepare([Message("T", b"late")], "g1", transaction_ids=[tid])
            return
        tid = new_id()
        rollback = LocalTransactionState.ROLLBACK
        self.store.end_transactions([Decision(tid, "g1", rollback)], publish=False)
        self.decided_unstaged.append(tid)

    def merge_half(self) -> None:
        """Half messages inserted by a MERGE, as a re-drive stages them."""
        now = self.store.clock()
        rows = pa.Table.from_pylist(
            [
                {
                    "transaction_id": new_id(),
                    "msg_id": new_id(),
                    "producer_group": "g2",
                    "topic": "T",
                    "queue_id": 1,
                    "body": b"r",
                    "properties": [("REDRIVEN_FROM_TRANSACTION_ID", "x")],
                    "born_timestamp": now,
                    "store_timestamp": now,
                    **{f.name: None for f in WRITER_COLUMNS},
                }
            ],
            schema=HALF_SCHEMA,
        )
        self.store.merge(
            "half", rows, ["transaction_id", "msg_id"], lambda m: m.when_not_matched_insert_all()
        )

    def retire(self) -> None:
        """Retention: the half rows of some decided transactions, then their op rows, are
        deleted by MERGEs (as rmq_spark.store.retention does)."""
        decided = self.store.query("op", "true").column("transaction_id").to_pylist()
        chosen = self.rng.sample(decided, k=min(len(decided), self.rng.randint(1, 3)))
        if not chosen:
            return
        ids = pa.table({"transaction_id": pa.array(chosen, pa.string())})
        for name in ("half", "op"):
            self.store.merge(name, ids, "transaction_id", lambda m: m.when_matched_delete())

    def compact(self) -> None:
        self.store.compact("half", "op")

    def vacuum(self) -> None:
        """Compact and vacuum at once: the change feed of older versions is gone."""
        self.store.compact("half", "op")
        for name in ("half", "op"):
            self.store.table(name).vacuum(
                retention_hours=0, enforce_retention_duration=False, dry_run=False
            )

    def update(self) -> None:
        update_pending(self.store)
        self.check()

    def killed_update(self) -> None:
        before = stored(self.store)
        self.prepare()
        self.decide()

        def die(name: str) -> None:
            if name == "pending.computed":
                raise RuntimeError("killed")

        original = pending_module.failpoint
        pending_module.failpoint = die
        try:
            with pytest.raises(RuntimeError, match="killed"):
                update_pending(self.store)
        finally:
            pending_module.failpoint = original
        assert stored(self.store) == before

    def two_updaters(self) -> None:
        self.prepare()
        self.decide()
        barrier = threading.Barrier(2)
        errors: list[BaseException] = []

        def run() -> None:
            try:
                other = open_store(self.root)
                barrier.wait()
                update_pending(other)
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=run) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        self.check()

    def lose_pending(self) -> None:
        """The pending table is lost (a restart from nothing): it is rebuilt."""
        shutil.rmtree(self.root / "pending")
        self.store = open_store(self.root)

    def check(self) -> None:
        assert plain(stored(self.store)) == plain(oracle(self.store))


@pytest.mark.parametrize("seed", range(HISTORIES))
def test_incremental_pending_equals_the_full_anti_join(tmp_path: Path, seed: int) -> None:
    history = History(tmp_path / "store", random.Random(seed))
    for _ in range(STEPS):
        history.step()
    # What status reads (no commit) is what an update would write.
    version = history.store.table("pending").version()
    shown = plain(pending_now(history.store).to_pylist())
    assert history.store.table("pending").version() == version
    history.update()
    assert plain(scan_pending(history.store).to_pylist()) == plain(oracle(history.store))
    assert shown == plain(oracle(history.store))


def test_an_update_covers_only_new_versions(store: Store) -> None:
    """Updates read the change feeds since the covered versions: a decided history whose
    older data files are gone (as if never readable) does not matter to later updates."""
    store.prepare([Message("T", b"a")], "g1")
    first = update_pending(store)
    assert first.rows.num_rows == 1 and first.half_version == 1
    again = update_pending(store)
    assert store.table("pending").version() == 1  # up to date: no commit
    assert again.rows.equals(first.rows)
    (p,) = store.prepare([Message("T", b"b")], "g1")
    store.end_transactions(
        [Decision(p.transaction_id, "g1", LocalTransactionState.COMMIT)], publish=False
    )
    third = update_pending(store)
    assert third.rows.num_rows == 1 and third.op_version == 1
    assert store.table("pending").transaction_version(PENDING_HALF_APP_ID) == 2


def test_vacuumed_change_feed_rebuilds_with_a_log_line(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    store.prepare([Message("T", b"a")], "g1")
    update_pending(store)
    for _ in range(3):
        store.prepare([Message("T", b"b")], "g1")
    store.compact("half")
    store.table("half").vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    with caplog.at_level("WARNING", logger="rmq_spark.checkback.pending"):
        rows = update_pending(store).rows
    assert "rebuilding from a full scan" in caplog.text
    assert plain(rows.to_pylist()) == plain(oracle(store))


def _update_in_race(root: str, barrier, out) -> None:
    store = open_store(Path(root))
    barrier.wait()
    out.put((os.getpid(), update_pending(store).half_version))


def test_two_processes_updating_at_once_agree(store: Store) -> None:
    root = Path(store.root)
    update_pending(store)
    store.prepare([Message("T", str(i).encode()) for i in range(5)], "g1")
    results = race(_update_in_race, [(str(root),), (str(root),)])
    assert set(results.values()) == {store.table("half").version()}
    assert plain(stored(store)) == plain(oracle(store))


def test_an_update_killed_before_its_commit_leaves_the_old_state(store: Store) -> None:
    store.prepare([Message("T", b"a")], "g1")
    update_pending(store)
    before = stored(store)
    (p,) = store.prepare([Message("T", b"b")], "g1")
    code = (
        "import sys; from pathlib import Path; from tests.unit.test_pending import open_store; "
        "from rmq_spark.checkback.pending import update_pending; "
        "update_pending(open_store(Path(sys.argv[1])))"
    )
    env = {**os.environ, "RMQ_SPARK_FAILPOINT": "pending.computed"}
    child = subprocess.run(
        [sys.executable, "-c", code, store.root], env=env, start_new_session=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL
    assert stored(store) == before
    update_pending(store)
    assert p.transaction_id in {r["transaction_id"] for r in stored(store)}
    assert plain(stored(store)) == plain(oracle(store))


def test_updates_past_a_vacuum_stay_exact(store: Store) -> None:
    """Every update rewrites the table and every VACUUM_EVERY_UPDATES versions vacuums it."""
    from rmq_spark.checkback.pending import VACUUM_EVERY_UPDATES

    for i in range(VACUUM_EVERY_UPDATES + 2):
        (p,) = store.prepare([Message("T", str(i).encode())], "g1")
        if i % 3 == 0:
            store.end_transactions(
                [Decision(p.transaction_id, "g1", LocalTransactionState.ROLLBACK)], publish=False
            )
        update_pending(store)
    assert store.table("pending").version() > VACUUM_EVERY_UPDATES
    assert plain(stored(store)) == plain(oracle(store))
