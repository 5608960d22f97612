"""Locks and leases (:mod:`rmq_spark.store.locks`): exactly one of racing takers gets a lock,
whatever other writers do to the ``locks`` table, and what a taker decides on is the whole
table."""

from __future__ import annotations

import random
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake
from deltalake.exceptions import CommitFailedError, DeltaError

from rmq_spark import Store
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.schema import LOCKS_SCHEMA


def _foreign(store: Store, name: str, holder: str, seconds: float) -> None:
    """Another Delta writer appends a lock row (an older release's MERGE, a delta-spark job)."""
    row = {
        "name": name,
        "holder": holder,
        "expires": datetime.now(UTC) + timedelta(seconds=seconds),
    }
    rows = pa.Table.from_pylist([row], schema=LOCKS_SCHEMA)
    # deltalake refuses an append racing a rewrite ("a concurrent transaction deleted data this
    # operation read"): the writer retries, a while, as a job would (on a loaded machine, S3
    # appends that take longer than the renewals' 50 ms lose many times in a row)
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        try:
            return write_deltalake(
                store.table_uri("locks"),
                rows,
                mode="append",
                storage_options=store._storage_options,
            )
        except (CommitFailedError, DeltaError):  # a listing raced a commit, too
            time.sleep(random.uniform(0.0, 0.05))
    raise AssertionError("the foreign append lost every race for 120 s")


def test_racing_takers_one_wins_each_round(tmp_path: Path) -> None:
    """Six processes' stores race for one lock, five rounds: one gets it each round, the
    others are refused, and the table holds one row for it, the winner's."""
    Store.open(tmp_path, settings=StoreSettings())
    stores = [Store.open(tmp_path, settings=StoreSettings(), create=False) for _ in range(6)]
    for _ in range(5):
        start, granted = threading.Barrier(len(stores)), {}

        def take(n: int, start: threading.Barrier = start, granted: dict = granted) -> None:
            start.wait()
            granted[n] = stores[n].lock("x", f"holder-{n}", 60.0)

        threads = [threading.Thread(target=take, args=(n,)) for n in range(len(stores))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        winners = [n for n, won in granted.items() if won]
        assert len(winners) == 1, granted
        assert stores[0].lock_holder("x") == f"holder-{winners[0]}"
        assert stores[0].query("locks", "name = 'x'").column("holder").to_pylist() == [
            f"holder-{winners[0]}"
        ]
        assert stores[winners[0]].lock("x", f"holder-{winners[0]}", 0.0)  # released


def test_a_lock_is_taken_over_once_it_expires_and_renewed_by_its_holder(any_store: Store) -> None:
    other = Store.open(any_store.root, settings=any_store.settings, create=False)
    assert any_store.lock("x", "a", 0.5)
    assert not other.lock("x", "b", 60.0) and other.lock_holder("x") == "a"
    assert any_store.lock("x", "a", 0.5)  # renewed
    threading.Event().wait(0.6)
    assert other.lock_holder("x") is None
    assert other.lock("x", "b", 60.0) and any_store.lock_holder("x") == "b"
    assert not any_store.lock("x", "a", 60.0)


def test_another_writers_rows_are_kept_and_seen(any_store: Store) -> None:
    """A lock row another writer appended holds like any other: it is refused to others, kept
    by the rewrites of other locks, and seen by a process that last read a rewrite of ours."""
    assert any_store.lock("a", "mine", 60.0)
    _foreign(any_store, "b", "old", 60.0)
    other = Store.open(any_store.root, settings=any_store.settings, create=False)
    assert not other.lock("b", "new", 60.0) and other.lock_holder("b") == "old"
    assert any_store.lock("a", "mine", 60.0) and other.lock("c", "new", 60.0)
    assert any_store.lock_holder("b") == "old" and not any_store.lock("b", "new", 60.0)
    assert sorted(any_store.read("locks").column("name").to_pylist()) == ["a", "b", "c"]


def test_a_foreign_append_racing_the_takes_is_never_lost_to_them(any_store: Store) -> None:
    """Rows another writer appends while a holder renews its lock in a loop: every one of them
    stays in the table and holds (a rewrite that went on past a commit it had not read would
    have decided, and recorded, the locks without it)."""
    done, refused = threading.Event(), []

    def renew() -> None:
        while not done.is_set():
            if not any_store.lock("a", "mine", 60.0):
                refused.append(1)
            done.wait(0.05)

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        for i in range(15):
            _foreign(any_store, f"f{i}", "old", 3600.0)
    finally:
        done.set()
        renewer.join()
    assert not refused
    other = Store.open(any_store.root, settings=any_store.settings, create=False)
    for i in range(15):
        assert other.lock_holder(f"f{i}") == "old", i
        assert not other.lock(f"f{i}", "new", 60.0), i
        assert any_store.lock_holder(f"f{i}") == "old", i
    assert any_store.lock("a", "mine", 60.0)
