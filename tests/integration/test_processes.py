"""Real processes: racing decisions, concurrent publishers, and kill -9 at each step."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.model.config import StoreSettings
from tests.conftest import commitlog, race

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK
REPO = Path(__file__).resolve().parents[2]


def _race_worker(root: str, settings, txns: list[str], state: str, barrier, out) -> None:
    store = Store.open(root, settings=settings, create=False)
    statuses = []
    for txn in txns:
        barrier.wait(timeout=60)
        (result,) = store.end_transactions([Decision(txn, "pg", LocalTransactionState(state))])
        statuses.append((txn, result.status.value, result.decision.value))
    out.put((state, statuses))


def test_two_processes_racing_to_decide(any_store: Store) -> None:
    store, rounds = any_store, 25
    prepared = store.prepare([Message("Orders", str(i)) for i in range(rounds)], "pg")
    txns = [p.transaction_id for p in prepared]
    results = race(
        _race_worker, [(store.root, store.settings, txns, s) for s in ("COMMIT", "ROLLBACK")]
    )
    visible = set(commitlog(store).column("transaction_id").to_pylist())
    winners = Counter()
    for i, txn in enumerate(txns):
        commit_side, rollback_side = results["COMMIT"][i], results["ROLLBACK"][i]
        statuses = sorted([commit_side[1], rollback_side[1]])
        assert statuses == ["APPLIED", "REFUSED"], (i, commit_side, rollback_side)
        # Both sides agree on the decision in force, and consumers see exactly that.
        assert commit_side[2] == rollback_side[2]
        assert (txn in visible) == (commit_side[2] == "COMMIT")
        winners[commit_side[2]] += 1
    assert commitlog(store).num_rows == winners["COMMIT"]


def _publisher(root: str, settings, n: int, tag: str) -> None:
    store = Store.open(root, settings=settings, create=False)
    for i in range(n):
        store.send([Message("Orders", f"{tag}-{i}", keys="one-queue")], "pg")


def test_concurrent_publishers_keep_offsets_dense(any_store: Store) -> None:
    store, ctx = any_store, mp.get_context("spawn")
    procs = [
        ctx.Process(target=_publisher, args=(store.root, store.settings, 15, t)) for t in "abc"
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=300)
        assert p.exitcode == 0
    rows = commitlog(store).to_pylist()
    assert sorted(r["body"] for r in rows) == sorted(
        f"{t}-{i}".encode() for t in "abc" for i in range(15)
    )
    assert [r["queue_offset"] for r in rows] == list(range(45))
    for t in "abc":  # each publisher's messages keep their order within the queue
        mine = [int(r["body"].split(b"-")[1]) for r in rows if r["body"].startswith(t.encode())]
        assert mine == sorted(mine)


def _preparer(root: str, name: str, threads: int, intake: bool, barrier, out) -> None:
    store = Store.open(root, settings=StoreSettings(intake=intake), create=False)
    errors: list[str] = []

    def prepare(i: int) -> None:
        try:
            store.prepare([Message("Orders", f"{name}-{i}")], "pg")
        except Exception as exc:  # reported below
            errors.append(f"{type(exc).__name__}: {exc}")

    workers = [threading.Thread(target=prepare, args=(i,)) for i in range(threads)]
    barrier.wait(timeout=120)
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    out.put((name, errors))


@pytest.mark.parametrize("intake", [False, True])
def test_many_producers_preparing_at_once_all_succeed(store: Store, intake: bool) -> None:
    # 16 processes x 4 threads blind-append at once: deltalake alone gives up after its own
    # commit retries (CommitFailedError) for a good part of them on 2 cores. With intake each
    # puts its objects, which a recoverer (check-back) lands, once, after the processes end.
    procs, threads = 16, 4
    results = race(_preparer, [(store.root, f"p{i}", threads, intake) for i in range(procs)])
    assert {name: errors for name, errors in results.items() if errors} == {}
    assert store.land_intake(0.0) == (procs * threads if intake else 0)
    bodies = store.read("half").column("body").to_pylist()
    assert sorted(bodies) == sorted(
        f"p{p}-{i}".encode() for p in range(procs) for i in range(threads)
    )


CHILD = textwrap.dedent(
    """
    import sys, time
    from rmq_spark import Decision, LocalTransactionState, Message, Store
    store = Store.open(sys.argv[1], create=False)
    step = sys.argv[2]
    (p,) = store.prepare([Message("Orders", b"payload")], "pg")
    if step == "after-decision":
        store.end_transactions(
            [Decision(p.transaction_id, "pg", LocalTransactionState.COMMIT)],
            publish=False,
        )
    print(p.transaction_id, flush=True)
    time.sleep(600)
    """
)


def _run_child_until_killed(root: str, step: str) -> str:
    child = subprocess.Popen(
        [sys.executable, "-c", CHILD, root, step],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        line = child.stdout.readline().split()
        assert line, "child died before reporting"
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL
    return line[0]


def test_half_message_survives_kill_between_prepare_and_end(store: Store) -> None:
    txn = _run_child_until_killed(store.root, "after-prepare")
    reopened = Store.open(store.root, create=False)
    half = reopened.half_messages([txn], staged=True)  # in half, or in its intake object
    assert half.column("transaction_id").to_pylist() == [txn]
    assert half.column("body").to_pylist() == [b"payload"]
    assert reopened.read("op").num_rows == 0
    assert commitlog(reopened).num_rows == 0
    # Whoever decides later (the check-back job) still can, exactly once.
    reopened.end_transactions([Decision(txn, "pg", COMMIT, "check-back")])
    reopened.publish()
    assert commitlog(reopened).column("transaction_id").to_pylist() == [txn]


def test_kill_after_decision_before_publish(store: Store) -> None:
    txn = _run_child_until_killed(store.root, "after-decision")
    reopened = Store.open(store.root, create=False)
    assert commitlog(reopened).num_rows == 0
    assert reopened.publish().published == 1
    assert reopened.publish().published == 0
    assert commitlog(reopened).column("transaction_id").to_pylist() == [txn]


PUBLISH_LOOP = textwrap.dedent(
    """
    import sys
    from rmq_spark import Decision, LocalTransactionState, Message, Store
    store = Store.open(sys.argv[1], create=False)
    print("ready", flush=True)
    i = 0
    while True:
        prepared = store.prepare([Message("Orders", f"t{i}-{j}") for j in range(3)], "pg")
        store.end_transactions(
            [Decision(p.transaction_id, "pg", LocalTransactionState.COMMIT)
             for p in prepared]
        )
        store.send([Message("Orders", f"n{i}")], "pg")
        i += 1
    """
)


@pytest.mark.parametrize("delay", [0.3, 0.9, 1.7])
def test_kill_while_writing_leaves_a_consistent_store(store: Store, delay: float) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", PUBLISH_LOOP, store.root],
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert child.stdout.readline().strip() == "ready"
    time.sleep(delay)
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=30)
    reopened = Store.open(store.root, create=False)
    reopened.publish()  # repairs a decision whose publish was cut off
    rows = commitlog(reopened).to_pylist()
    ids = [r["msg_id"] for r in rows]
    assert len(ids) == len(set(ids)), "a message was published twice"
    queues: dict = {}
    for r in rows:
        queues.setdefault(r["queue_id"], []).append(r["queue_offset"])
    for offsets in queues.values():
        assert offsets == list(range(len(offsets)))
    committed = set(reopened.read("op").column("transaction_id").to_pylist())
    assert {r["transaction_id"] for r in rows if r["transaction_id"]} == committed
