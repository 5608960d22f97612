"""The cache of half messages a process prepared (rmq_spark/recent.py)."""

from __future__ import annotations

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.recent import RecentHalves


def test_a_chunk_is_served_whole_or_not_at_all(store: Store) -> None:
    prepared = store.prepare([Message("Orders", f"m{i}".encode()) for i in range(3)], "pg")
    ids = [p.transaction_id for p in prepared]
    cache = RecentHalves()
    cache.add(store.half_messages(ids))
    assert cache.take([ids[0], "someone-else's"]) is None  # a miss takes nothing
    rows = cache.take([ids[2], ids[0], ids[2]])
    assert rows.column("transaction_id").to_pylist() == [ids[2], ids[0]]
    assert (
        rows.to_pylist()
        == store.half_messages([ids[2], ids[0]]).sort_by([("body", "descending")]).to_pylist()
    )
    assert cache.take([ids[0]]) is None  # taken once
    assert cache.take([ids[1]]).num_rows == 1


def test_memory_is_bounded_oldest_first(store: Store) -> None:
    prepared = store.prepare([Message("Orders", b"x" * 100) for _ in range(5)], "pg")
    ids = [p.transaction_id for p in prepared]
    cache = RecentHalves(max_bytes=250)
    cache.add(store.half_messages(ids))
    assert cache.take(ids[:3]) is None
    assert cache.take(ids[3:]).num_rows == 2


def test_rolled_back_transactions_leave_the_producers_cache(store: Store) -> None:
    (p,) = store.prepare([Message("Orders", b"a")], "pg")
    store.end_transactions([Decision(p.transaction_id, "pg", LocalTransactionState.ROLLBACK)])
    assert store._recent.take([p.transaction_id]) is None
