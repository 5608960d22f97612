"""The cache of half messages a process prepared (rmq_spark/store/recent.py)."""

from __future__ import annotations

import pyarrow as pa

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.store.recent import RecentHalves


def test_a_chunk_is_served_whole_or_not_at_all_and_forgotten_either_way(store: Store) -> None:
    prepared = store.prepare([Message("Orders", f"m{i}".encode()) for i in range(3)], "pg")
    ids = [p.transaction_id for p in prepared]
    cache = RecentHalves()
    cache.add(store.half_messages(ids))
    assert cache.take([ids[1], "someone-else's"]) is None  # a miss: read from half
    assert cache.take([ids[1]]) is None  # and forgotten, stale once published
    rows = cache.take([ids[2], ids[0], ids[2]])
    assert rows.column("transaction_id").to_pylist() == [ids[2], ids[0]]
    assert (
        rows.to_pylist()
        == store.half_messages([ids[2], ids[0]]).sort_by([("body", "descending")]).to_pylist()
    )
    assert cache.take([ids[0]]) is None  # taken once


def _prepared(store: Store, count: int) -> pa.Table:
    prepared = store.prepare([Message("Orders", b"x" * 100) for _ in range(count)], "pg")
    return store.half_messages([p.transaction_id for p in prepared])


def test_memory_is_bounded_oldest_first(store: Store) -> None:
    cache = RecentHalves(max_bytes=250)
    first, second = _prepared(store, 2), _prepared(store, 2)
    cache.add(first)
    cache.add(second)
    assert cache.take(first.column("transaction_id").to_pylist()[:1]) is None
    assert cache.take(second.column("transaction_id").to_pylist()).num_rows == 2


def test_a_prepare_is_counted_until_its_last_transaction_leaves(store: Store) -> None:
    # The kept rows are rows of the prepare's table: one left keeps all of it in memory.
    cache = RecentHalves(max_bytes=250)
    first, second = _prepared(store, 2), _prepared(store, 1)
    cache.add(first)
    taken, left = first.column("transaction_id").to_pylist()
    assert cache.take([taken]).num_rows == 1
    cache.add(second)  # 200 + 100 bytes held: over the limit, the oldest goes
    assert cache.take([left]) is None
    assert cache.take(second.column("transaction_id").to_pylist()).num_rows == 1


def test_rows_of_many_prepares_come_in_few_chunks(store: Store) -> None:
    # One chunk per prepare, not per row: the publisher's Parquet writer pays per chunk.
    cache = RecentHalves()
    tables = [_prepared(store, 3) for _ in range(4)]
    for rows in tables:
        cache.add(rows)
    ids = [t for rows in tables for t in rows.column("transaction_id").to_pylist()]
    taken = cache.take(ids[::-1])
    assert sorted(taken.column("transaction_id").to_pylist()) == sorted(ids)
    assert taken.column("body").num_chunks <= len(tables)


def test_rolled_back_transactions_leave_the_producers_cache(store: Store) -> None:
    (p,) = store.prepare([Message("Orders", b"a")], "pg")
    store.end_transactions([Decision(p.transaction_id, "pg", LocalTransactionState.ROLLBACK)])
    assert store._recent.take([p.transaction_id]) is None


def test_rows_are_forgotten_once_another_process_published(store: Store) -> None:
    """Rows of transactions another process published are stale (retention may remove them,
    and one decided again after that must publish nothing): a publish that finds the cursor
    past where this process's last publish read forgets every row, and so does a first one."""
    cache = RecentHalves()
    rows = _prepared(store, 2)
    ids = rows.column("transaction_id").to_pylist()
    cache.add(rows)
    cache.publishing(4)  # this process's first publish
    assert cache.take(ids) is None
    cache.published_to(7)
    cache.add(rows)
    cache.publishing(7)  # where this process's last publish read to: nobody else published
    assert cache.take(ids[:1]).num_rows == 1
    cache.published_to(9)
    cache.publishing(12)  # another process published versions 10 to 12
    assert cache.take(ids[1:]) is None
