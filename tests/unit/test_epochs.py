"""The epochs arbiter: racing transitions of one epoch, leases, and finish_epoch's decisions."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from deltalake import DeltaTable

from rmq_spark import EpochLostError, LocalTransactionState, Message, Store
from rmq_spark.checkback.epoch_checker import EpochChecker
from rmq_spark.delta.store_clock import StoreClock
from rmq_spark.spark.epoch_records import (
    ABANDONED,
    CLOSED,
    OPEN,
    closed_epoch,
    lease_clock,
    read_epoch,
)
from rmq_spark.spark.epochs import abandon, abort_attempt, close, finish_epoch, hold, release, renew
from tests.conftest import commitlog, race

EPOCHS = 12
LATER = datetime.now(UTC) + timedelta(days=1)


def _closer(root: str, name: str, barrier, out) -> None:
    store = Store.open(root, create=False)
    results = []
    for epoch in range(EPOCHS):
        barrier.wait(timeout=60)
        row = close(store, "racing-sink", epoch, None, [f"{name}-{epoch}"], name)
        results.append((epoch, row.transaction_ids, row.transaction_ids == (f"{name}-{epoch}",)))
    out.put((name, results))


def test_two_processes_closing_the_same_epochs(store: Store) -> None:
    results = race(_closer, [(store.root, name) for name in ("driver", "checker")])
    for epoch in range(EPOCHS):
        (_, d_winners, d_mine), (_, c_winners, c_mine) = (
            results["driver"][epoch],
            results["checker"][epoch],
        )
        assert d_winners == c_winners == closed_epoch(store, "racing-sink", epoch)
        assert d_mine != c_mine  # exactly one of them won
    rows = store.read("epochs")
    assert rows.num_rows == EPOCHS  # one row per epoch, never two


def _writer_or_abandon(root: str, name: str, barrier, out) -> None:
    """A writer's transition of each epoch (``name`` "close": its commit closes it,
    "release": its abort abandons it) and the check-back's abandonment of expired epochs
    ("checker"), racing; puts each side's ``(state, generation)`` per epoch."""
    store = Store.open(root, create=False)
    results = []
    for epoch in range(EPOCHS):
        barrier.wait(timeout=60)
        if name == "close":
            row = close(store, "s", epoch, 0, [f"t{epoch}"], "sink")
        elif name == "release":
            row = release(store, "s", epoch, "w")
        else:
            row = abandon(store, "s", epoch, 0, LATER)
        results.append((row.state, row.generation))
    out.put((name, results))


def test_close_and_abandon_racing_never_both_win(store: Store) -> None:
    for epoch in range(EPOCHS):
        hold(store, "s", epoch, "w", lease_seconds=1)  # expired at LATER
    results = race(_writer_or_abandon, [(store.root, name) for name in ("close", "checker")])
    for epoch in range(EPOCHS):
        final = read_epoch(store, "s", epoch)
        # Both sides see the same outcome: whichever transition committed first.
        assert results["close"][epoch][0] == results["checker"][epoch][0] == final.state
        assert final.state in (CLOSED, ABANDONED)
        assert (final.transaction_ids == (f"t{epoch}",)) == (final.state == CLOSED)


def _staged(store: Store, *bodies: bytes) -> list[str]:
    prepared = store.prepare([Message("Orders", b) for b in bodies], "pipeline")
    return [p.transaction_id for p in prepared]


def test_finish_epoch_commits_the_list_and_rolls_back_the_rest(store: Store) -> None:
    first, second = _staged(store, b"a", b"b")
    outcome = finish_epoch(store, "s", 0, [(first, 0)], "pipeline", "sink")
    assert outcome.first and outcome.committed == (first,) and outcome.rolled_back == ()
    replay = finish_epoch(store, "s", 0, [(second, 0)], "pipeline", "sink")
    assert not replay.first and replay.committed == (first,) and replay.rolled_back == (second,)
    assert commitlog(store).column("body").to_pylist() == [b"a"]
    decisions = store.read("op").to_pylist()
    assert {d["transaction_id"]: d["decision"] for d in decisions} == {
        first: LocalTransactionState.COMMIT.value,
        second: LocalTransactionState.ROLLBACK.value,
    }


def test_a_writer_whose_epoch_was_abandoned_fails_loudly(store: Store) -> None:
    held = hold(store, "s", 7, "query-1", lease_seconds=5)
    assert (held.state, held.generation) == (OPEN, 0)
    (txn,) = _staged(store, b"early")
    assert abandon(store, "s", 7, 0, datetime.now(UTC)).state == OPEN  # lease still alive
    assert abandon(store, "s", 7, 0, LATER).state == ABANDONED
    assert not renew(store, "s", 7, 0, lease_seconds=5)  # a late heartbeat does not revive it
    with pytest.raises(EpochLostError, match="abandoned by the check-back job"):
        finish_epoch(store, "s", 7, [(txn, 0)], "pipeline", "sink")
    assert commitlog(store).num_rows == 0  # nothing published...
    op = store.read("op").to_pylist()
    assert [(d["transaction_id"], d["decision"]) for d in op] == [(txn, "ROLLBACK")]
    # ...and the retry reopens the epoch in the next generation and publishes everything.
    retry = hold(store, "s", 7, "query-1", lease_seconds=5)
    assert (retry.state, retry.generation) == (OPEN, 1)
    (again,) = _staged(store, b"early")
    outcome = finish_epoch(store, "s", 7, [(again, 1)], "pipeline", "sink")
    assert outcome.first and commitlog(store).column("body").to_pylist() == [b"early"]


def test_transactions_of_two_generations_are_never_published(store: Store) -> None:
    hold(store, "s", 0, "job", lease_seconds=5)
    abandon(store, "s", 0, 0, LATER)
    assert hold(store, "s", 0, "job", lease_seconds=5).generation == 1
    old, new = _staged(store, b"a", b"b")
    with pytest.raises(EpochLostError, match="generations"):
        finish_epoch(store, "s", 0, [(old, 0), (new, 1)], "pipeline", "sink")
    assert commitlog(store).num_rows == 0
    assert read_epoch(store, "s", 0).state == OPEN  # a clean retry can still close it


def test_an_epoch_belongs_to_one_owner(store: Store) -> None:
    hold(store, "orders", 0, "query-1", lease_seconds=60)
    with pytest.raises(EpochLostError, match="belongs to 'query-1'.*new sinkId"):
        hold(store, "orders", 0, "query-2", lease_seconds=60)
    close(store, "orders", 0, 0, [], "sink")
    with pytest.raises(EpochLostError, match="belongs to 'query-1'"):
        hold(store, "orders", 0, "query-2", lease_seconds=60)
    assert hold(store, "orders", 0, "query-1", lease_seconds=60).state == CLOSED  # a replay


def test_epochs_stay_readable_as_the_table_grows_and_is_compacted(store: Store) -> None:
    """MERGE writes string_view files; after compaction, pyarrow's dataset filters could not
    compare them (found by the torture test: every sink task failed to hold its epoch)."""
    from rmq_spark.spark.epoch_records import read_epochs

    for epoch in range(70):  # past CHECKPOINT_INTERVAL commits: compacted
        hold(store, f"sink{epoch % 3}", epoch, "owner", lease_seconds=60)
        if epoch % 2:
            close(store, f"sink{epoch % 3}", epoch, 0, [f"t{epoch}"], "sink")
    rows = read_epochs(store, [(f"sink{e % 3}", e) for e in range(70)])
    assert len(rows) == 70
    history = DeltaTable(store.table_uri("epochs")).history()
    assert any(h["operation"] == "OPTIMIZE" for h in history)  # maintained after its checkpoint
    assert all((r.state == CLOSED) == bool(r.epoch % 2) for r in rows.values())
    assert rows[("sink1", 1)].transaction_ids == ("t1",)


def test_abort_and_check_back_abandoning_at_once_agree(store: Store) -> None:
    for epoch in range(EPOCHS):
        hold(store, "s", epoch, "w", lease_seconds=1)  # expired at LATER
    results = race(_writer_or_abandon, [(store.root, name) for name in ("release", "checker")])
    for epoch in range(EPOCHS):
        final = read_epoch(store, "s", epoch)
        assert (final.state, final.generation) == (ABANDONED, 0)
        assert results["release"][epoch] == results["checker"][epoch] == (ABANDONED, 0)
        assert final.closed_by in ("abort", "check-back:lease-expired")


def test_an_abort_abandons_only_an_open_epoch_of_its_writer(store: Store) -> None:
    """The abort abandons the epoch at once, whatever its lease; not a CLOSED epoch (its list
    stands) nor one another writer holds; a new attempt reopens it in the next generation."""
    hold(store, "s", 0, "query-1", lease_seconds=600)
    assert release(store, "s", 0, "query-2").state == OPEN  # not its writer's
    row = release(store, "s", 0, "query-1")  # the lease has 10 minutes left
    assert (row.state, row.generation, row.closed_by) == (ABANDONED, 0, "abort")
    assert release(store, "s", 0, "query-1") == row  # twice: nothing more
    assert not renew(store, "s", 0, 0, lease_seconds=600)  # a zombie's heartbeat
    assert hold(store, "s", 0, "query-1", lease_seconds=600).generation == 1
    close(store, "s", 0, 1, ["t"], "sink")
    closed = read_epoch(store, "s", 0)
    assert release(store, "s", 0, "query-1") == closed
    assert release(store, "s", 9, "query-1") is None  # never held: no row made


def test_aborting_a_made_up_sink_id_closes_its_epoch_empty(store: Store) -> None:
    """A batch write's own sink id is never used again: its abort closes the epoch empty
    (every attempt's halves are rolled back), and rolls back what it was told of at once."""
    hold(store, "write-1", 0, "write-1", lease_seconds=600)
    (txn,) = _staged(store, b"a")
    row = abort_attempt(store, "write-1", 0, [(txn, 0)], "pipeline", "write-1", reused=False)
    assert (row.state, row.transaction_ids, row.closed_by) == (CLOSED, (), "abort")
    op = store.read("op").to_pylist()
    assert [(d["transaction_id"], d["decision"]) for d in op] == [(txn, "ROLLBACK")]


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.objectstore)])
def test_a_writer_whose_host_clock_runs_behind_keeps_its_lease(
    request: pytest.FixtureRequest, where: str
) -> None:
    """A task on an executor whose clock runs 15 minutes behind the check-back host's holds an
    epoch with a 10-minute lease. Written on the task's own clock, the lease had run out on the
    check-back host's clock before it was taken: the epoch was abandoned while its tasks
    staged, and every retry again (review). Leases are written and judged on the store's clock,
    which each host reads as its own clock plus a measured offset."""
    store: Store = request.getfixturevalue("store" if where == "local" else "s3_store")
    behind = lambda: datetime.now(UTC) - timedelta(minutes=15)  # noqa: E731
    # The premise: on the task's own clock, the lease is over as soon as it is taken.
    hold(store, "s", 1, "w", lease_seconds=600, clock=behind)
    assert abandon(store, "s", 1, 0, EpochChecker(store).clock()).state == ABANDONED
    # On the store's clock, read from the task's host: alive until the check-back host's
    # store clock passes it, 10 minutes on.
    on_the_store = StoreClock(store.table_uri("epochs"), store.settings.storage_options, behind)
    assert abs(on_the_store.offset - timedelta(minutes=15)) < timedelta(seconds=3)
    hold(store, "s", 2, "w", lease_seconds=600, clock=on_the_store)
    checker = EpochChecker(store).clock
    assert isinstance(checker, StoreClock) and lease_clock(store) is checker  # the defaults
    assert abandon(store, "s", 2, 0, checker()).state == OPEN
    assert abandon(store, "s", 2, 0, checker() + timedelta(minutes=11)).state == ABANDONED
