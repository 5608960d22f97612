"""The epochs arbiter: racing closers of one epoch, and finish_epoch's decisions."""

from __future__ import annotations

from rmq_spark import LocalTransactionState, Message, Store
from rmq_spark.epochs import close_epoch, closed_epoch, finish_epoch
from tests.conftest import commitlog, race

EPOCHS = 12


def _closer(root: str, name: str, barrier, out) -> None:
    store = Store.open(root, create=False)
    results = []
    for epoch in range(EPOCHS):
        barrier.wait(timeout=60)
        winners, mine = close_epoch(store, "racing-sink", epoch, [f"{name}-{epoch}"], name)
        results.append((epoch, winners, mine))
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
    rows = store.table("epochs").to_pyarrow_table()
    assert rows.num_rows == EPOCHS  # one row per epoch, never two


def test_finish_epoch_commits_the_list_and_rolls_back_the_rest(store: Store) -> None:
    staged = store.prepare([Message("Orders", b"a"), Message("Orders", b"b")], "pipeline")
    first, second = (p.transaction_id for p in staged)
    outcome = finish_epoch(store, "s", 0, [first], "pipeline", "sink")
    assert outcome.first and outcome.committed == (first,) and outcome.rolled_back == ()
    replay = finish_epoch(store, "s", 0, [second], "pipeline", "sink")
    assert not replay.first and replay.committed == (first,) and replay.rolled_back == (second,)
    assert commitlog(store).column("body").to_pylist() == [b"a"]
    decisions = store.table("op").to_pyarrow_table().to_pylist()
    assert {d["transaction_id"]: d["decision"] for d in decisions} == {
        first: LocalTransactionState.COMMIT.value,
        second: LocalTransactionState.ROLLBACK.value,
    }
