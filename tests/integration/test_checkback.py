"""The check-back job on real Spark and Delta: eligibility, routing, check max, races."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import write_deltalake

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.checkers import (
    ANSWER_SCHEMA,
    CallableChecker,
    Checker,
    ClientsChecker,
    TableChecker,
)
from rmq_spark.checkback.discards import redrive
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import RetentionSettings, StoreSettings, TransactionSettings
from rmq_spark.ops.demo import OrderService
from rmq_spark.ops.status import store_status
from rmq_spark.store.retention import maintain
from tests.conftest import Clock, commitlog, foreign_compaction_after_the_stores, race

BY_TAG = "tests.checker_functions:by_tag"
REPO = Path(__file__).resolve().parents[2]


def job(spark, store, clock, checkers=None, **settings) -> CheckBackJob:
    defaults = {"transaction_timeout": 6.0, "transaction_check_max": 3}
    return CheckBackJob(
        spark,
        store,
        checkers if checkers is not None else {"pg": CallableChecker(BY_TAG)},
        TransactionSettings(**{**defaults, **settings}),
        clock=clock,
    )


def start_clocks(spark, store, clock, checkers=None, **settings) -> None:
    """A first round sees the pending transactions (starting their clocks), then 10 s pass.
    That round checks nothing whatever time passed since they were stored (their ages are
    real; a loaded machine took 30 s to get there), so its timeout is an hour."""
    first = {**settings, "transaction_timeout": 3600.0}
    assert job(spark, store, clock, checkers, **first).run_once().summary.checked == 0
    clock.advance(10)


def prepare(store: Store, *tags: str, group: str = "pg", **kw) -> list[str]:
    prepared = store.prepare(
        [Message("Orders", f"body-{t}", tags=t, keys=f"key-{i}", **kw) for i, t in enumerate(tags)],
        group,
    )
    return [p.transaction_id for p in prepared]


def visible_ids(store: Store) -> list[str]:
    return commitlog(store).column("transaction_id").to_pylist()


def pending(store: Store) -> set[str]:
    half = set(store.read("half").column("transaction_id").to_pylist())
    return half - set(store.read("op").column("transaction_id").to_pylist())


def test_young_messages_wait_for_the_timeout(spark, store: Store) -> None:
    clock = Clock()
    ids = prepare(store, "COMMIT", "ROLLBACK")
    first = job(spark, store, clock).run_once().summary
    assert (first.pending_found, first.not_yet_due, first.checked) == (2, 2, 0)
    # Their clocks started when they were stored, a moment before that round.
    clock.now = min(store.read("check_state").column("first_seen").to_pylist())
    clock.advance(5.9)
    assert job(spark, store, clock).run_once().summary.checked == 0
    clock.advance(0.2)
    result = job(spark, store, clock).run_once()
    s = result.summary
    assert (s.checked, s.committed, s.rolled_back, s.pending_found) == (2, 1, 1, 2)
    assert visible_ids(store) == [ids[0]]
    assert pending(store) == set()
    reasons = {
        r["transaction_id"]: (r["reason"], r["answer"]) for r in result.check_batch.collect()
    }
    assert reasons == {ids[0]: ("check", "COMMIT"), ids[1]: ("check", "ROLLBACK")}
    # Decided messages are never checked again (apache/rocketmq#1517).
    clock.advance(60)
    again = job(spark, store, clock).run_once().summary
    assert (again.pending_found, again.checked) == (0, 0)
    assert store.read("check_state").num_rows == 0


def test_immunity_delays_the_first_check_without_spending_budget(spark, store: Store) -> None:
    clock = Clock()
    (tid,) = prepare(store, "UNKNOWN", properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "30"})
    for _ in range(5):  # five rounds inside the immunity window
        summary = job(spark, store, clock).run_once().summary
        assert (summary.not_yet_due, summary.checked) == (1, 0)
        clock.advance(5)
    state = store.read("check_state").to_pylist()
    assert [(s["transaction_id"], s["check_count"]) for s in state] == [(tid, 0)]
    clock.advance(6)
    assert job(spark, store, clock).run_once().summary.checked == 1


def test_unknown_until_check_max_then_rolled_back_discarded_and_redriven(spark, store) -> None:
    clock = Clock()
    (tid,) = prepare(store, "UNKNOWN")
    start_clocks(spark, store, clock)
    counts = []
    for _ in range(3):
        s = job(spark, store, clock).run_once().summary
        counts.append((s.checked, s.unknown, s.discarded))
        clock.advance(10)
    assert counts == [(1, 1, 0), (1, 1, 0), (1, 0, 1)]
    op = store.read("op").to_pylist()
    assert [(o["transaction_id"], o["decision"], o["decided_by"]) for o in op] == [
        (tid, "ROLLBACK", "check-back:check-max")
    ]
    discard = store.read("discard").to_pylist()
    assert [(d["transaction_id"], d["check_count"], d["body"]) for d in discard] == [
        (tid, 3, b"body-UNKNOWN")
    ]
    assert visible_ids(store) == []
    # Re-driving puts the message back into the cycle with a fresh budget.
    (new_tid,) = redrive(store)
    assert redrive(store) == []
    assert pending(store) == {new_tid}
    s = job(spark, store, clock).run_once().summary
    assert (s.pending_found, s.not_yet_due) == (1, 1)
    clock.advance(10)
    assert job(spark, store, clock).run_once().summary.unknown == 1
    # Unanswered again up to the check max: discarded again (a row of its own), re-drivable.
    for _ in range(2):
        clock.advance(10)
        s = job(spark, store, clock).run_once().summary
    assert s.discarded == 1
    discard = store.read("discard").to_pylist()
    assert sorted((d["transaction_id"], d["redriven_transaction_id"]) for d in discard) == sorted(
        [(tid, new_tid), (new_tid, None)]
    )
    (third,) = redrive(store)
    assert pending(store) == {third}


def test_checker_that_raises_counts_as_unknown(spark, store: Store) -> None:
    clock = Clock()
    prepare(store, "RAISE", "COMMIT")
    start_clocks(spark, store, clock)
    result = job(spark, store, clock).run_once()
    s = result.summary
    assert (s.checked, s.errors, s.unknown, s.committed) == (2, 1, 1, 1)
    errors = [r["error"] for r in result.check_batch.collect() if r["error"]]
    assert errors and "order database unreachable" in errors[0]
    state = store.read("check_state").to_pylist()
    assert [(r["check_count"], "unreachable" in r["last_error"]) for r in state] == [(1, True)]


def test_producer_decision_during_check_wins(spark, store: Store) -> None:
    clock = Clock()
    prepare(store, "ANY", properties={"test_store": store.root})
    checkers = {"pg": CallableChecker("tests.checker_functions:commit_after_producer_rollback")}
    start_clocks(spark, store, clock, checkers)
    s = job(spark, store, clock, checkers).run_once().summary
    assert (s.checked, s.committed, s.already_decided) == (1, 0, 1)
    op = store.read("op").to_pylist()
    assert [(o["decision"], o["decided_by"]) for o in op] == [("ROLLBACK", "producer")]
    assert visible_ids(store) == []


def test_two_jobs_at_once_never_double_commit_or_double_count(spark, store: Store) -> None:
    clock = Clock()
    commit_ids = prepare(store, *["COMMIT"] * 6)
    unknown_ids = prepare(store, *["UNKNOWN"] * 3)
    start_clocks(spark, store, clock)
    jobs = [job(spark, store, clock, transaction_check_max=10) for _ in range(2)]
    errors: list[BaseException] = []

    def run(j: CheckBackJob) -> None:
        try:
            j.run_once()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(j,)) for j in jobs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert sorted(visible_ids(store)) == sorted(commit_ids)
    counts = {r["transaction_id"]: r["check_count"] for r in store.read("check_state").to_pylist()}
    assert counts == dict.fromkeys(unknown_ids, 1)
    runs = store.read("check_runs").to_pylist()
    assert sum(r["committed"] for r in runs) == 6
    assert sum(r["already_decided"] for r in runs) == sum(r["checked"] for r in runs) - 6 - sum(
        r["unknown"] for r in runs
    )


def test_producer_clock_skew_does_not_change_eligibility(spark, tmp_path) -> None:
    for skew_hours in (-100, +100):
        skewed = Store.open(  # sends in half (intake objects: the storage's times count)
            tmp_path / f"s{skew_hours}",
            settings=StoreSettings(intake=False),
            clock=lambda h=skew_hours: datetime.now(UTC) + timedelta(hours=h),
        )
        prepare(skewed, "COMMIT")
        clock = Clock()
        first = job(spark, skewed, clock).run_once().summary
        assert (first.not_yet_due, first.skipped_for_age, first.checked) == (1, 0, 0)
        clock.advance(7)
        assert job(spark, skewed, clock).run_once().summary.committed == 1


def test_max_check_age_skips_and_reports(spark, store: Store) -> None:
    clock = Clock()
    prepare(store, "UNKNOWN")
    job(spark, store, clock, max_check_age=3600).run_once()
    clock.advance(3601)
    s = job(spark, store, clock, max_check_age=3600).run_once().summary
    assert (s.skipped_for_age, s.checked, s.pending_found) == (1, 0, 1)
    assert s.oldest_pending_age_seconds == pytest.approx(3601, abs=1)


def test_table_checker_and_listener_checker(spark, store: Store, tmp_path) -> None:
    business = str(tmp_path / "payments")
    write_deltalake(business, pa.table({"payment_id": ["key-0"]}))
    service = OrderService(tmp_path / "orders.sqlite")
    with service._connect() as db:
        db.execute("INSERT INTO orders VALUES ('key-1', 'ada', 1.0)")
    clock = Clock()
    paid = prepare(store, "x", "y", group="payments")  # key-0 found, key-1 not
    ordered = prepare(store, "x", "y", group="orders")  # key-1 in the orders db, key-0 not
    checkers = {
        "payments": TableChecker(business, "payment_id", deadline=60),
        "orders": CallableChecker(service.check_local_transaction),
    }
    start_clocks(spark, store, clock, checkers)
    s = job(spark, store, clock, checkers).run_once().summary
    assert (s.committed, s.rolled_back, s.unknown) == (2, 1, 1)
    assert sorted(visible_ids(store)) == sorted([paid[0], ordered[1]])
    clock.advance(60)
    s = job(spark, store, clock, checkers).run_once().summary
    assert (s.rolled_back, s.pending_found) == (1, 1)
    assert pending(store) == set()


@pytest.mark.parametrize(
    ("broken", "match"),
    [
        (CallableChecker("no_such_module:f"), "cannot be imported"),
        (CallableChecker("tests.checker_functions:nope"), "'nope' not found"),
        (CallableChecker("tests.checker_functions"), "not of the form"),
        (TableChecker("/no/such/table", "id", 1), "cannot read Delta table"),
    ],
)
def test_a_misconfigured_checker_holds_back_only_its_own_group(
    spark, store, broken, match, caplog: pytest.LogCaptureFixture
) -> None:
    """A checker whose module or table is missing raised CHECKER_CONFIG out of run_once(), and
    no group was checked. Now its group's transactions count as checker errors (UNKNOWN), named
    in the log, and every other group is checked as usual."""
    clock = Clock()
    prepare(store, "COMMIT")
    (other,) = prepare(store, "COMMIT", group="other")
    checkers = {"pg": broken, "other": CallableChecker(BY_TAG)}
    start_clocks(spark, store, clock, checkers)
    with caplog.at_level("ERROR", logger="rmq_spark"):
        s = job(spark, store, clock, checkers).run_once().summary
    assert (s.committed, s.errors, s.unknown) == (1, 1, 1)
    assert visible_ids(store) == [other]
    assert re.search(f"producer group 'pg'.*{match}", caplog.text)
    runs = store.read("check_runs").to_pylist()
    assert [r["status"] for r in runs] == ["finished", "finished"]


def test_a_group_without_a_checker_is_reported_not_fatal(spark, store: Store) -> None:
    """A pending transaction of a group with no checker made the round (and `rmqtx check
    --interval`) fail; it is counted as unrouted and left pending, and the others go on."""
    clock = Clock()
    (routed,) = prepare(store, "COMMIT")
    prepare(store, "COMMIT", group="nobody")
    start_clocks(spark, store, clock)
    s = job(spark, store, clock).run_once().summary
    assert (s.committed, s.unrouted) == (1, 1)
    assert visible_ids(store) == [routed]


def test_unrouted_groups_can_be_left_pending(spark, store: Store) -> None:
    clock = Clock()
    prepare(store, "COMMIT")
    prepare(store, "COMMIT", group="nobody")
    j = CheckBackJob(spark, store, {"pg": CallableChecker(BY_TAG)}, clock=clock, skip_unrouted=True)
    j.run_once()
    clock.advance(10)
    s = j.run_once().summary
    assert (s.committed, s.unrouted) == (1, 1)


@pytest.mark.parametrize("immunity", ["1_0", "abc", "１０", " 10 ", "NaN", "9" * 400])
def test_a_garbage_immunity_property_stops_nobody(spark, store: Store, immunity: str) -> None:
    """One half message whose CHECK_IMMUNITY_TIME_IN_SECONDS is not a number (a sink stores
    any value) failed every round with CAST_INVALID_INPUT under ANSI mode, for every group.
    It counts as no immunity; the round checks everyone."""
    clock = Clock()
    (good,) = prepare(store, "COMMIT")
    rows = store.half_messages([good]).to_pylist()
    rows[0] |= {
        "transaction_id": "garbage-immunity",
        "msg_id": "garbage-immunity",
        "producer_group": "other",
        "properties": [("CHECK_IMMUNITY_TIME_IN_SECONDS", immunity)],
    }
    store.append("half", pa.Table.from_pylist(rows, schema=store.half_messages([]).schema))
    checkers = {"pg": CallableChecker(BY_TAG), "other": CallableChecker(BY_TAG)}
    start_clocks(spark, store, clock, checkers)
    s = job(spark, store, clock, checkers).run_once().summary
    assert s.committed == 2
    assert sorted(visible_ids(store)) == sorted([good, "garbage-immunity"])


def test_summary_is_readable(spark, store: Store) -> None:
    prepare(store, "COMMIT")
    text = job(spark, store, Clock()).run_once().summary.format()
    assert "check-back run" in text and "pending found" in text and "not yet due" in text


class GatedChecker(Checker):
    """Answers UNKNOWN on the driver once the test opens the gate: holds a run mid-way,
    after it has read its snapshot of pending transactions."""

    kind = "gated"

    def __init__(self) -> None:
        self.asked, self.gate = threading.Event(), threading.Event()

    def check(self, batch):
        ids = [r["transaction_id"] for r in batch.select("transaction_id").collect()]
        self.asked.set()
        assert self.gate.wait(timeout=300), "the test never opened the gate"
        return batch.sparkSession.createDataFrame(
            [(t, "UNKNOWN", None) for t in ids], ANSWER_SCHEMA
        )


def test_an_older_job_keeps_the_check_state_a_newer_job_recorded(spark, store: Store) -> None:
    clock = Clock()
    prepare(store, "UNKNOWN")
    start_clocks(spark, store, clock)
    gated = GatedChecker()
    errors: list[BaseException] = []

    def run_older() -> None:
        try:
            job(spark, store, clock, {"pg": gated}).run_once()
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    older = threading.Thread(target=run_older)
    older.start()
    try:
        assert gated.asked.wait(timeout=300)  # the older job's snapshot is taken
        (late,) = prepare(store, "UNKNOWN")  # a transaction only the newer job sees
        clock.advance(1)
        job(spark, store, clock).run_once()
        seen = clock.now
    finally:
        gated.gate.set()
        older.join()
    assert not errors
    state = {r["transaction_id"]: r for r in store.read("check_state").to_pylist()}
    assert late in state, "the older job forgot a transaction it never saw"
    # Its clock started when it was stored (a moment before the newer job's round).
    assert seen - timedelta(seconds=30) <= state[late]["first_seen"] <= seen
    assert state[late]["check_count"] == 0


def discard_all(spark, store: Store) -> list[dict]:
    """Three discarded transactions (one of two messages), through the check max."""
    clock = Clock()
    prepare(store, "UNKNOWN", "UNKNOWN")
    store.prepare(
        [Message("Orders", b"a", tags="UNKNOWN"), Message("Orders", b"b", tags="UNKNOWN")],
        "pg",
        transaction_ids=["two-messages"] * 2,
    )
    start_clocks(spark, store, clock, transaction_check_max=1)
    assert job(spark, store, clock, transaction_check_max=1).run_once().summary.discarded == 3
    return store.read("discard").to_pylist()


def live_transactions(store: Store) -> dict[str, list[str]]:
    """msg_id -> the undecided half transactions holding it."""
    decided = set(store.read("op").column("transaction_id").to_pylist())
    live: dict[str, list[str]] = {}
    for h in store.read("half").to_pylist():
        if h["transaction_id"] not in decided:
            live.setdefault(h["msg_id"], []).append(h["transaction_id"])
    return live


def assert_redriven_exactly_once(store: Store, discarded: list[dict]) -> None:
    live = live_transactions(store)
    marks = {r["msg_id"]: r for r in store.read("discard").to_pylist()}
    assert sorted(live) == sorted(d["msg_id"] for d in discarded)
    for d in discarded:
        assert live[d["msg_id"]] == [marks[d["msg_id"]]["redriven_transaction_id"]], d["msg_id"]
    # The messages of one discarded transaction stay together in one new transaction.
    two = {
        marks[d["msg_id"]]["redriven_transaction_id"]
        for d in discarded
        if d["transaction_id"] == "two-messages"
    }
    assert len(two) == 1


REDRIVE = (
    "from rmq_spark import Store; from rmq_spark.checkback.discards import redrive; "
    "import sys; redrive(Store.open(sys.argv[1], create=False))"
)


def test_resume_killed_between_claim_and_stage_is_finished_by_the_next(spark, store) -> None:
    discarded = discard_all(spark, store)
    child = subprocess.run(
        [sys.executable, "-c", REDRIVE, store.root],
        env={**os.environ, "RMQ_SPARK_FAILPOINT": "redrive.claimed"},
        cwd=REPO,
        start_new_session=True,  # the failpoint kills the child's whole session
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL
    marks = store.read("discard").column("redriven_transaction_id")
    assert marks.null_count == 0 and live_transactions(store) == {}  # claimed, not staged
    assert len(redrive(store)) == 3
    assert redrive(store) == []
    assert_redriven_exactly_once(store, discarded)
    clock = Clock()
    assert job(spark, store, clock).run_once().summary.pending_found == 3


def _resume(root: str, name: str, barrier, out) -> None:
    store = Store.open(root, create=False)
    barrier.wait(timeout=120)
    out.put((name, redrive(store)))


def test_two_resumes_at_once_redrive_each_message_once(spark, store: Store) -> None:
    discarded = discard_all(spark, store)
    results = race(_resume, [(store.root, "a"), (store.root, "b")])
    assert set(results["a"]) | set(results["b"]) == {
        r["redriven_transaction_id"] for r in store.read("discard").to_pylist()
    }
    assert_redriven_exactly_once(store, discarded)


def test_check_max_rollbacks_cut_off_before_their_discard_are_repaired(spark, store) -> None:
    """A job killed between a check-max rollback and its discard write: the next round
    records the discard, whether it has to look at the whole op table (no recorded op
    version yet) or only at what was decided since the recorded one."""
    from rmq_spark.checkback.discards import DECIDED_BY_CHECK_MAX
    from rmq_spark.model.messages import LocalTransactionState
    from rmq_spark.store.decisions import Decision

    clock = Clock()

    def cut_off(tid: str) -> None:
        rollback = LocalTransactionState.ROLLBACK
        store.end_transactions([Decision(tid, "pg", rollback, DECIDED_BY_CHECK_MAX)])

    first, second = prepare(store, "UNKNOWN", "UNKNOWN")
    cut_off(first)
    job(spark, store, clock).run_once()
    discarded = store.read("discard").column("transaction_id").to_pylist()
    assert discarded == [first]
    cut_off(second)
    job(spark, store, clock).run_once()
    discarded = store.read("discard").column("transaction_id").to_pylist()
    assert sorted(discarded) == sorted([first, second])
    job(spark, store, clock).run_once()
    assert store.read("discard").num_rows == 2


def test_a_round_that_asks_nobody_runs_no_spark_job(spark, store: Store) -> None:
    """Classifying the pending list is in-memory work: a round with transactions not yet due,
    or none at all, starts no Spark job (it made three, 0.4 s a shard, every round)."""
    prepare(store, "COMMIT", "ROLLBACK")
    spark.sparkContext.setJobGroup("idle-round", "jobs of this thread's round")
    try:
        result = job(spark, store, Clock(), transaction_timeout=3600.0).run_once()
    finally:
        spark.sparkContext.setLocalProperty("spark.jobGroup.id", None)
    assert (result.summary.pending_found, result.summary.not_yet_due) == (2, 2)
    assert spark.sparkContext.statusTracker().getJobIdsForGroup("idle-round") == []
    assert {r["reason"] for r in result.check_batch.collect()} == {"not yet due"}


def test_rounds_do_not_read_the_decided_history(spark, store: Store) -> None:
    """Once a round has recorded what it covered, the next rounds read only what is pending and
    new: decided history whose data files are gone does not stop them (a full scan would)."""
    from rmq_spark.model.messages import LocalTransactionState
    from rmq_spark.store.decisions import Decision

    clock = Clock()
    old = prepare(store, "COMMIT", "COMMIT")
    store.end_transactions([Decision(t, "pg", LocalTransactionState.COMMIT) for t in old])
    job(spark, store, clock).run_once()
    old_files = store.data_files("half").column("uri").to_pylist()
    new = prepare(store, "COMMIT", "UNKNOWN")
    for uri in old_files:
        os.remove(uri)  # the history's files: a full scan of half would fail
    clock.advance(10)
    job(spark, store, clock).run_once()
    clock.advance(10)
    s = job(spark, store, clock).run_once().summary
    assert (s.pending_found, s.committed, s.unknown) == (2, 1, 1)
    assert set(visible_ids(store)) == set(old) | {new[0]}


def test_the_check_loop_runs_maintenance(spark, store: Store) -> None:
    """``rmqtx check`` (run_forever) applies retention every maintenance_interval."""
    from rmq_spark.model.config import RetentionSettings

    clock = Clock()
    Store.open(store.root, clock=lambda: clock.now - timedelta(hours=100)).send(
        [Message("Orders", b"old")], "pg"
    )
    store.send([Message("Orders", b"new")], "pg")
    loop = CheckBackJob(
        spark, store, {"pg": CallableChecker(BY_TAG)}, retention=RetentionSettings(), clock=clock
    )
    stop = threading.Event()

    original = loop.run_once

    def one_round():
        stop.set()  # the loop finishes this round (and its maintenance), then stops
        return original()

    loop.run_once = one_round
    assert loop.run_forever(60.0, stop) == 1
    bodies = store.read("commitlog").column("body").to_pylist()
    assert bodies == [b"new"]


def test_check_state_of_a_transaction_retention_removed_is_forgotten(spark, store) -> None:
    """A transaction decided and removed by retention before a round saw its decision leaves
    no check_state row behind (it has neither op nor half rows to be recognised by)."""
    from rmq_spark.model.config import RetentionSettings
    from rmq_spark.model.messages import LocalTransactionState
    from rmq_spark.store.decisions import Decision
    from rmq_spark.store.retention import maintain

    clock = Clock()
    (txn,) = prepare(store, "UNKNOWN")
    start_clocks(spark, store, clock)
    state = store.read("check_state")
    assert state.column("transaction_id").to_pylist() == [txn]
    store.end_transactions([Decision(txn, "pg", LocalTransactionState.ROLLBACK)])
    maintain(store, RetentionSettings(transaction_reserved_time=0))
    assert store.half_messages([txn]).num_rows == 0 and store.decisions([txn]) == {}
    job(spark, store, clock).run_once()
    assert store.read("check_state").num_rows == 0


def test_decisions_a_restore_of_op_removed_are_recovered_not_published_again(
    spark, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A RESTORE (or DELETE) of ``op`` removes transactions' decisions: they were pending
    again, the checker said COMMIT a second time and the publisher copied published messages
    into the CommitLog twice, or published one rolled back at the check max beside its
    re-driven copy (issue 29.4). Check-back records a due transaction's decision again when
    it is in the CommitLog (COMMIT, not published again) or in ``discard`` (ROLLBACK)."""
    from deltalake import DeltaTable

    clock = Clock()
    (maxed,) = prepare(store, "UNKNOWN")
    start_clocks(spark, store, clock)
    assert job(spark, store, clock, transaction_check_max=1).run_once().summary.discarded == 1
    before = DeltaTable(store.table_uri("op")).version() - 1
    ids = []
    for tag in ("COMMIT", "COMMIT", "COMMIT"):
        (tid,) = prepare(store, tag)
        store.end_transactions([Decision(tid, "pg", LocalTransactionState.COMMIT)])
        ids.append(tid)
    DeltaTable(store.table_uri("op")).restore(before)  # every decision goes
    assert pending(store) == {maxed, *ids}
    always = {"pg": CallableChecker("tests.checker_functions:always_commit")}
    start_clocks(spark, store, clock, always)
    with caplog.at_level(logging.ERROR, logger="rmq_spark"):
        s = job(spark, store, clock, always).run_once().summary
    assert (s.checked, s.already_decided, s.committed) == (0, 4, 0)
    assert pending(store) == set()
    assert store.decisions([maxed, *ids]) == {
        maxed: LocalTransactionState.ROLLBACK,
        **dict.fromkeys(ids, LocalTransactionState.COMMIT),
    }
    assert "3 already published as COMMIT" in caplog.text
    (redriven,) = redrive(store)
    store.publish()
    assert sorted(visible_ids(store)) == sorted(ids)
    assert pending(store) == {redriven}


def _stored_ago(store: Store, seconds: float) -> None:
    """Make every ``half`` commit so far look ``seconds`` older on the store's clock (its log
    entries' modification times), as if the half messages had been stored that long ago."""
    log = Path(store.table_uri("half")) / "_delta_log"
    for entry in log.glob("*.json"):
        then = entry.stat().st_mtime - seconds
        os.utime(entry, (then, then))


def test_one_round_resolves_what_is_already_overdue(spark, store: Store) -> None:
    """Ages start when the half message was stored, on the store's clock: a round on
    transactions stored minutes ago (while no check-back job ran) checks them at once, and
    leaves a transaction stored just now for later."""
    now = lambda: datetime.now(UTC)  # noqa: E731
    job(spark, store, now).run_once()  # the job's first round, on an empty store
    committed, rolled_back = prepare(store, "COMMIT", "ROLLBACK")
    _stored_ago(store, 120)
    (fresh,) = prepare(store, "COMMIT")
    s = job(spark, store, now).run_once().summary
    assert (s.pending_found, s.checked, s.committed, s.rolled_back, s.not_yet_due) == (
        3,
        2,
        1,
        1,
        1,
    )
    assert s.oldest_pending_age_seconds == pytest.approx(120, abs=60)
    assert pending(store) == {fresh}
    assert visible_ids(store) == [committed]


def test_the_first_round_on_a_store_resolves_what_is_overdue(spark, store: Store) -> None:
    """A store's first round rebuilds its pending list from a full scan, which knows no
    version per transaction: it takes each as stored when the latest half message was (never
    older than it is), which on a store whose producers went quiet minutes ago is overdue."""
    (committed,) = prepare(store, "COMMIT")
    _stored_ago(store, 120)
    s = job(spark, store, lambda: datetime.now(UTC)).run_once().summary
    assert (s.pending_found, s.checked, s.committed) == (1, 1, 1)
    assert visible_ids(store) == [committed]


def test_a_producers_clock_does_not_make_a_transaction_due(spark, tmp_path: Path) -> None:
    """A producer whose clock is an hour behind writes store timestamps an hour old; its
    transaction is still not due in the first round (apache/rocketmq#9640)."""
    behind = Store.open(
        tmp_path / "store",
        settings=StoreSettings(intake=False),  # its send in half, timestamped by its clock
        clock=lambda: datetime.now(UTC) - timedelta(hours=1),
    )
    prepare(behind, "COMMIT")
    s = job(spark, Store.open(tmp_path / "store"), lambda: datetime.now(UTC)).run_once().summary
    assert (s.pending_found, s.checked, s.not_yet_due) == (1, 0, 1)
    # rmqtx status shows the age check-back measures, not the producer's clock's.
    (group,) = store_status(Store.open(tmp_path / "store"))["producer_groups"]
    assert group["oldest_pending_age_seconds"] < 60


def test_a_clients_group_is_asked_by_rmqtx_serve_and_counts_as_unknown_here(
    spark, store: Store
) -> None:
    """A group whose checker is its own clients (``kind = "clients"``, connected to ``rmqtx
    serve``, which asks them over their telemetry streams) is UNKNOWN to the job: its
    transactions wait for the clients' answers, and with no answer they are rolled back and
    discarded at the check max, as RocketMQ does with a group no client of which is online."""
    clock = Clock()
    clients = {"Orders": ClientsChecker()}
    (txn,) = prepare(store, "COMMIT", group="Orders")
    start_clocks(spark, store, clock, clients, transaction_check_max=2)
    s = job(spark, store, clock, clients, transaction_check_max=2).run_once().summary
    assert (s.checked, s.unknown, s.committed, s.discarded) == (1, 1, 0, 0)
    clock.advance(10)
    s = job(spark, store, clock, clients, transaction_check_max=2).run_once().summary
    assert s.discarded == 1
    assert store.decisions([txn]) == {txn: LocalTransactionState.ROLLBACK}


@pytest.mark.parametrize(
    ("table", "after"), [("half", 5), ("op", 5), ("check_state", 2), ("discard", 5)]
)
def test_rows_a_foreign_compaction_stored_twice_change_no_outcome(
    spark, store: Store, table: str, after: int
) -> None:
    """Another writer's compaction racing the store's leaves every row of the files both
    rewrote stored twice (the suite's torture runs met it on ``half`` and ``commitlog``). No
    transaction's outcome changes: the committed are published once, the rolled back never,
    each transaction left unanswered is discarded and re-driven once, and every check-back
    round succeeds."""
    clock = Clock()
    ids = [prepare(store, t)[0] for t in ("COMMIT", "ROLLBACK", "UNKNOWN")]  # a half file each
    (own,) = prepare(store, "own")
    store.end_transactions([Decision(own, "pg", LocalTransactionState.COMMIT)])
    rounds = []
    for i in range(10):
        if i == 1:
            ids += prepare(store, "UNKNOWN")  # discarded a round after the first
        if i == after:
            foreign_compaction_after_the_stores(store, table)
        if i == 6:
            redriven = redrive(store)
            assert len(redriven) == 2 and redrive(store) == []
        rounds.append(job(spark, store, clock).run_once().summary)
        clock.advance(10)
    assert sorted(visible_ids(store)) == sorted([ids[0], own])
    assert [s.discarded for s in rounds] == [0, 0, 0, 1, 1, 0, 0, 0, 0, 2]
    assert pending(store) == set()
    runs = store.read("check_runs")
    assert set(runs.column("status").to_pylist()) == {"finished"}, runs.to_pylist()


@pytest.mark.parametrize("group", ["pg", "unchecked"])
def test_a_decision_its_killed_producer_never_recorded_is_recorded_not_asked(
    spark, store: Store, group: str
) -> None:
    """A producer's end-transaction returns once its decision object is put; its process lands
    the decision in ``op`` a linger later. Killed (SIGKILL) in between, it leaves the
    transaction pending in ``op``: the round records the object's COMMIT without asking the
    checker (which would answer ROLLBACK for this tag), and it is published; so it is for a
    group with no checker."""
    child = (
        "import time\n"
        "from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer\n"
        "from rmq_spark.model.config import StoreSettings\n"
        "from tests.unit.test_producer import ScriptedListener\n"
        f"store = Store.open({store.root!r}, settings=StoreSettings(queue_nums=2, "
        "publish_linger=10.0, intake=False))\n"
        f"with TransactionMQProducer({group!r}, ScriptedListener(), store=store) as producer:\n"
        "    sent = producer.send_message_in_transaction(\n"
        "        Message('Orders', b'x', tags='ROLLBACK'), LocalTransactionState.UNKNOWN)\n"
        "    producer.end_transaction(sent, LocalTransactionState.COMMIT)\n"
        "    print(sent.transaction_id, flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE)
    try:
        tid = proc.stdout.readline().decode().strip()
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert pending(store) == {tid}
    clock = Clock()
    start_clocks(spark, store, clock)
    s = job(spark, store, clock).run_once().summary
    assert (s.checked, s.already_decided, s.committed, s.rolled_back) == (0, 1, 0, 0)
    # Recorded, so not also left pending: a one-shot `rmqtx check` exits 3 on unrouted ones.
    assert (s.pending_found, s.unrouted, s.not_yet_due, s.skipped_for_age) == (1, 0, 0, 0)
    assert store.decisions([tid]) == {tid: LocalTransactionState.COMMIT}
    store.publish()
    assert visible_ids(store) == [tid]


def test_sends_a_killed_producer_left_in_intake_objects_are_landed_then_resolved(
    spark, store: Store
) -> None:
    """A producer with intake (the default on S3) is SIGKILLed as its publisher starts landing
    its sends (the ``intake.landing`` failpoint): their half messages are only in intake
    objects. A round lands those older than the transaction timeout before it reads ``half``
    (their ages start there, on the store's clock); the one its producer committed (in its
    decision object) is then recorded without asking and published, the one left UNKNOWN is
    pending like any other."""
    child = (
        "import time\n"
        "from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer\n"
        "from rmq_spark.model.config import StoreSettings\n"
        "from tests.unit.test_producer import ScriptedListener\n"
        f"store = Store.open({store.root!r}, settings=StoreSettings(queue_nums=2, intake=True, "
        "publish_linger=1.0))\n"
        "with TransactionMQProducer('pg', ScriptedListener(), store=store) as producer:\n"
        "    for answer in ('COMMIT', 'UNKNOWN'):\n"
        "        sent = producer.send_message_in_transaction(\n"
        "            Message('Orders', b'x', tags='ROLLBACK'), LocalTransactionState(answer))\n"
        "        print(sent.transaction_id, flush=True)\n"
        "    time.sleep(600)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env={**os.environ, "RMQ_SPARK_FAILPOINT": "intake.landing"},
        start_new_session=True,  # the failpoint kills the child's whole session
    )
    try:
        committed, unknown = (proc.stdout.readline().decode().strip() for _ in range(2))
        assert proc.wait(timeout=120) == -signal.SIGKILL
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert pending(store) == set()  # nothing in half yet
    clock = Clock()
    start_clocks(spark, store, clock)  # too young for its hour-long timeout: left to the writer
    assert pending(store) == set()
    job(spark, store, clock).run_once()  # lands them; their ages start at the landing
    assert pending(store) == {committed, unknown}
    clock.advance(10)
    s = job(spark, store, clock).run_once().summary
    # The COMMIT in force in its object, not the checker's ROLLBACK for the tag; the other
    # was asked, and rolled back.
    assert (s.pending_found, s.already_decided, s.committed, s.rolled_back) == (2, 1, 0, 1)
    assert pending(store) == set()
    store.publish()
    assert visible_ids(store) == [committed]


@pytest.mark.parametrize(
    ("intake", "stop_at"), [(True, "intake.landing"), (False, "decision.claimed")]
)
def test_a_writer_stalled_past_retention_sends_nothing_again(
    spark, store: Store, tmp_path: Path, intake: bool, stop_at: str
) -> None:
    """A producer that has published its own first send stops (SIGSTOP) as its publisher starts
    landing a COMMITted send that is only in its intake object, or (without intake) as it has
    put the COMMIT's decision object. A
    round records the COMMIT that object holds (landing the intake object first); the message
    is published; 73 hours later retention removes the transaction. Resumed, the producer must
    not land the rows or the decision it still holds, nor publish the rows it keeps for its own
    publishes: the message would be published a second time (rule 2)."""
    marker, go = tmp_path / "stopped.pid", tmp_path / "go"
    child = (
        "import os, time\n"
        "from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer\n"
        "from rmq_spark.model.config import StoreSettings\n"
        "from tests.unit.test_producer import ScriptedListener\n"
        f"settings = StoreSettings(queue_nums=2, intake={intake})\n"
        f"store = Store.open({store.root!r}, settings=settings)\n"
        "with TransactionMQProducer('pg', ScriptedListener(), store=store) as producer:\n"
        "    warm = producer.send_message_in_transaction(\n"
        "        Message('Orders', b'w', tags='COMMIT'), LocalTransactionState.COMMIT)\n"
        "    producer.flush()  # published by this producer\n"
        "    print(warm.transaction_id, flush=True)\n"
        f"    os.environ['RMQ_SPARK_FAILPOINT'] = '{stop_at}:stop'\n"
        "    sent = producer.send_message_in_transaction(\n"
        "        Message('Orders', b'x', tags='COMMIT'), LocalTransactionState.COMMIT)\n"
        "    print(sent.transaction_id, flush=True)\n"
        f"    while not os.path.exists({str(go)!r}):\n"
        "        time.sleep(0.05)\n"
        "    producer.flush()\n"
        "print('flushed', flush=True)\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env={**os.environ, "RMQ_SPARK_FAILPOINT_MARKER": str(marker)},
        start_new_session=True,
    )
    try:
        warm = proc.stdout.readline().decode().strip()
        while not marker.exists() or not marker.read_text().strip():
            assert proc.poll() is None
            time.sleep(0.05)
        clock = Clock()
        start_clocks(spark, store, clock)
        decided = 0
        for _ in range(2):  # an intake object is landed first, its age starting there
            decided += job(spark, store, clock).run_once().summary.already_decided
            clock.advance(10)
        assert decided == 1 and pending(store) == set()  # its decision object's COMMIT
        (tid,) = set(store.read("half").column("transaction_id").to_pylist()) - {warm}
        store.publish()
        assert sorted(visible_ids(store)) == sorted([warm, tid])
        later = Store.open(store.root, clock=lambda: clock.now + timedelta(hours=73))
        assert maintain(later, RetentionSettings()).half_removed == 2
        assert visible_ids(store) == []  # its CommitLog file expired too (consumed long ago)
        os.kill(proc.pid, signal.SIGCONT)
        go.touch()
        assert proc.stdout.readline().decode().strip() == tid
        assert proc.stdout.readline().decode().strip() == "flushed"
        assert proc.wait(timeout=60) == 0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    store.publish()
    assert visible_ids(store) == []  # not published a second time
    assert store.read("half").num_rows == 0
