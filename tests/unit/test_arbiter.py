"""Decision objects: the first decision wins in one conditional put (rule 3), on local disk and
S3, and ``op`` records that decision and no other."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.discards import DECIDED_BY_CHECK_MAX
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.errors import CorruptStoreError
from rmq_spark.model.messages import object_decided, shard_of, shard_transaction_id
from rmq_spark.store.arbiter import DECISIONS_DIR
from rmq_spark.store.decisions import EndTransactionStatus
from rmq_spark.store.layout import MARKER_FILE, OBJECTS_LAYOUT
from rmq_spark.store.publish_loop import publish_own

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK
REPO = Path(__file__).resolve().parents[2]


def _op_rows(store: Store) -> list[tuple[str, str]]:
    op = store.read("op")
    return sorted(
        zip(op.column("transaction_id").to_pylist(), op.column("decision").to_pylist(), strict=True)
    )


def test_ids_say_which_arbiter_decides_them() -> None:
    for shard in (0, 1, 12):
        made = shard_transaction_id(shard, object_decided=True)
        assert object_decided(made) and shard_of(made) == shard
        older = shard_transaction_id(shard)
        assert not object_decided(older) and shard_of(older) == shard
    for other in ("order-17", "d", "a" * 32 + "d", "A" * 31 + "d", "A" * 32 + "d.0"):
        assert not object_decided(other)


def test_racing_deciders_one_wins_and_op_records_it(any_store: Store) -> None:
    """Eight threads decide each of five transactions at once, half COMMIT and half ROLLBACK:
    one of them applies, every other is refused or already decided with the winner's decision,
    and ``op`` holds one row, the winner's."""
    prepared = any_store.prepare([Message("T", f"m{i}".encode()) for i in range(5)], "pg")
    ids = [p.transaction_id for p in prepared]
    assert all(object_decided(t) for t in ids)
    barrier = threading.Barrier(8)
    results: dict[int, list] = {}

    def decide(n: int) -> None:
        barrier.wait()
        state = COMMIT if n % 2 else ROLLBACK
        results[n] = any_store.end_transactions(
            [Decision(t, "pg", state, f"decider-{n}") for t in ids], publish=False
        )

    threads = [threading.Thread(target=decide, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, t in enumerate(ids):
        outcomes = [results[n][i] for n in range(8)]
        applied = [o for o in outcomes if o.status is EndTransactionStatus.APPLIED]
        assert len(applied) == 1
        winner = applied[0].decision
        assert {o.decision for o in outcomes} == {winner}
        for o in outcomes:
            if o is not applied[0]:
                expected = (
                    EndTransactionStatus.ALREADY_DECIDED
                    if o.requested is winner
                    else EndTransactionStatus.REFUSED
                )
                assert o.status is expected
        assert any_store.object_decisions([t])[t].state is winner
    assert _op_rows(any_store) == sorted(
        (t, any_store.object_decisions([t])[t].state.value) for t in ids
    )


def test_a_decision_left_unlanded_is_durable_and_lands_once(any_store: Store) -> None:
    """``land=False`` (a producer's end-transaction): the decision is in force when the call
    returns, ``op`` records it when the process lands it, and a late rival's decision is
    refused before and after."""
    (p,) = any_store.prepare([Message("T", b"x")], "pg")
    t = p.transaction_id
    (first,) = any_store.end_transactions([Decision(t, "pg", COMMIT)], publish=False, land=False)
    assert first.status is EndTransactionStatus.APPLIED
    assert _op_rows(any_store) == []
    (late,) = any_store.end_transactions([Decision(t, "pg", ROLLBACK, "check-back")], land=False)
    assert (late.status, late.decision) == (EndTransactionStatus.REFUSED, COMMIT)
    assert any_store.land_decisions() == 1  # the COMMIT, once (the rival saw it too)
    assert _op_rows(any_store) == [(t, "COMMIT")]
    assert any_store.land_decisions() == 0
    (again,) = any_store.end_transactions([Decision(t, "pg", COMMIT)])
    assert again.status is EndTransactionStatus.ALREADY_DECIDED
    assert _op_rows(any_store) == [(t, "COMMIT")]
    any_store.publish()
    assert any_store.read("commitlog").column("transaction_id").to_pylist() == [t]


def test_ids_of_an_older_release_are_still_decided_in_op(store: Store) -> None:
    """A transaction whose id has no mark (made by an older rmq-spark) keeps ``op`` as its
    arbiter: no decision object is ever put for it."""
    t = shard_transaction_id(0)
    store.prepare([Message("T", b"x")], "pg", transaction_ids=[t])
    (r,) = store.end_transactions([Decision(t, "pg", ROLLBACK)])
    assert r.status is EndTransactionStatus.APPLIED
    (late,) = store.end_transactions([Decision(t, "pg", COMMIT)])
    assert late.status is EndTransactionStatus.REFUSED
    assert store.object_decisions([t]) == {}
    assert not (Path(store.table_uri("op")) / DECISIONS_DIR).exists()


def test_the_first_object_decided_id_raises_the_layout(tmp_path: Path) -> None:
    """An older rmq-spark decides in ``op`` alone: the store's marker goes to the layout it
    refuses before the first id that a decision object decides is handed out."""
    root = tmp_path / "store"
    store = Store.open(root, settings=StoreSettings(intake=False))  # intake: layout 5, below
    assert json.loads((root / MARKER_FILE).read_text())["layout_version"] == 1
    store.prepare([Message("T", b"x")], "pg")
    assert json.loads((root / MARKER_FILE).read_text())["layout_version"] == OBJECTS_LAYOUT == 4


def test_a_damaged_decision_object_is_an_error_that_names_it(store: Store) -> None:
    (p,) = store.prepare([Message("T", b"x")], "pg")
    folder = Path(store.table_uri("op")) / DECISIONS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{p.transaction_id}.json").write_text("not json")
    with pytest.raises(CorruptStoreError, match=f"{p.transaction_id}.json is not one rmq-spark"):
        store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
    assert _op_rows(store) == []


def test_vacuum_of_op_keeps_the_decision_objects(store: Store) -> None:
    """deltalake's VACUUM (with no retention) skips folders that start with an underscore."""
    (p,) = store.prepare([Message("T", b"x")], "pg")
    store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
    DeltaTable(store.table_uri("op")).vacuum(
        retention_hours=0, enforce_retention_duration=False, dry_run=False
    )
    assert store.object_decisions([p.transaction_id])[p.transaction_id].state is COMMIT


def test_a_producer_killed_before_landing_leaves_its_decision_in_force(tmp_path: Path) -> None:
    """A producer process whose end-transaction returned is SIGKILLed before its background
    publisher landed the decision (a linger of ten seconds): the decision object holds it, a
    later decider is refused, and landing it records the producer's decision."""
    root = tmp_path / "store"
    child = textwrap.dedent(
        f"""
        import sys, time
        from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer
        from rmq_spark.model.config import StoreSettings
        from tests.unit.test_producer import ScriptedListener
        store = Store.open({str(root)!r}, settings=StoreSettings(publish_linger=10.0))
        with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
            sent = producer.send_message_in_transaction(
                Message("T", b"x"), LocalTransactionState.UNKNOWN
            )
            producer.end_transaction(sent, LocalTransactionState.COMMIT)
            print(sent.transaction_id, flush=True)
            time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    try:
        t = proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()
    assert object_decided(t)
    store = Store.open(root)
    assert _op_rows(store) == []
    (late,) = store.end_transactions([Decision(t, "pg", ROLLBACK, "check-back")], publish=False)
    assert (late.status, late.decision) == (EndTransactionStatus.REFUSED, COMMIT)
    assert _op_rows(store) == [(t, "COMMIT")]
    store.publish()
    assert store.read("commitlog").column("transaction_id").to_pylist() == [t]


def test_a_losing_request_of_the_same_decision_lands_the_winners_author(store: Store) -> None:
    """A check-max ROLLBACK that loses to the producer's ROLLBACK (put, not landed yet) lands
    the producer's decision: recorded as the check max's, it would have been repaired into
    ``discard`` and re-driven, a message its producer rolled back."""
    (p,) = store.prepare([Message("T", b"x")], "pg")
    t = p.transaction_id
    producer = Store.open(store.root)  # another process, which stops before landing
    producer.end_transactions([Decision(t, "pg", ROLLBACK, "producer")], land=False)
    (late,) = store.end_transactions([Decision(t, "pg", ROLLBACK, DECIDED_BY_CHECK_MAX)])
    assert late.status is EndTransactionStatus.ALREADY_DECIDED
    assert store.read("op").column("decided_by").to_pylist() == ["producer"]


def test_a_failing_landing_holds_up_no_publish(store: Store) -> None:
    """A landing that keeps failing (``op`` altered to ask more of a writer) leaves its
    decisions in force in their objects, and the COMMITs already landed are published."""
    a, b = (p.transaction_id for p in store.prepare([Message("T", b"a"), Message("T", b"b")], "pg"))
    store.end_transactions([Decision(a, "pg", COMMIT)], publish=False)
    store.end_transactions([Decision(b, "pg", COMMIT)], land=False)
    DeltaTable(store.table_uri("op")).alter.add_constraint({"known": "decision IS NOT NULL"})
    publish_own(store, "this test")
    assert store.read("commitlog").column("transaction_id").to_pylist() == [a]
    assert store.object_decisions([b])[b].state is COMMIT


def test_a_normal_message_sent_after_a_commit_comes_after_it(tmp_path: Path) -> None:
    """A COMMIT's landing waits for the publisher's linger; a normal message sent to the same
    queue right after it is still stored after it."""
    from rmq_spark import TransactionMQProducer
    from rmq_spark.model.config import StoreSettings
    from tests.unit.test_producer import ScriptedListener

    store = Store.open(tmp_path / "store", settings=StoreSettings(publish_linger=2.0))
    with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
        sent = producer.send_message_in_transaction(
            Message("T", b"committed", keys="k"), LocalTransactionState.UNKNOWN
        )
        producer.end_transaction(sent, COMMIT)
        producer.send(Message("T", b"normal", keys="k"))
    rows = store.read("commitlog").sort_by("queue_offset")
    assert rows.column("body").to_pylist() == [b"committed", b"normal"]


def test_a_prepare_of_many_transactions_leaves_their_decisions_to_op(any_store: Store) -> None:
    """Decisions that come many together share one ``op`` commit: a prepare of more than
    ``OBJECT_DECIDED_BATCH`` new transactions (a bulk prepare) makes ids decided there."""
    from rmq_spark.store.decisions import OBJECT_DECIDED_BATCH

    most = OBJECT_DECIDED_BATCH["s3" if any_store.root.startswith("s3://") else "file"]
    many = any_store.prepare([Message("T", b"x")] * (most + 1), "pg")
    assert not any(object_decided(p.transaction_id) for p in many)
    few = any_store.prepare([Message("T", b"x")] * most, "pg")
    assert all(object_decided(p.transaction_id) for p in few)


def test_a_misplaced_or_foreign_id_has_no_decision_object(store: Store) -> None:
    """Serve's recovery looks up the objects of pending rows: an id naming a shard the store
    does not have (a foreign writer's misplaced row) is not routed there, and an id with a
    trailing newline is not object-decided."""
    stray = shard_transaction_id(7, object_decided=False)
    assert store.object_decisions([stray, "x" * 3]) == {}
    assert not object_decided(shard_transaction_id(0, object_decided=True) + "\n")


def test_a_decision_for_a_transaction_never_sent_records_nothing(any_store: Store) -> None:
    """An id the store holds no half message of (mistyped, made up, another store's) is
    ``NOT_FOUND``, as RocketMQ's broker answers a commit it finds no half message for: no
    decision object, no ``op`` row, nothing published. Its real neighbours are decided."""
    (sent,) = any_store.prepare([Message("T", b"real")], "pg")
    other = Store.open(any_store.root, settings=any_store.settings, create=False)
    ghosts = [shard_transaction_id(0, object_decided=True), shard_transaction_id(0)]
    asked = [Decision(t, "pg", COMMIT) for t in [*ghosts, sent.transaction_id]]
    results = other.end_transactions(asked)
    assert [(r.status, r.decision) for r in results] == [
        (EndTransactionStatus.NOT_FOUND, LocalTransactionState.UNKNOWN),
        (EndTransactionStatus.NOT_FOUND, LocalTransactionState.UNKNOWN),
        (EndTransactionStatus.APPLIED, COMMIT),
    ]
    assert _op_rows(any_store) == [(sent.transaction_id, "COMMIT")]
    assert other.object_decisions(ghosts) == {}
    assert other.read("commitlog").column("body").to_pylist() == [b"real"]


@pytest.mark.parametrize("when", ["in a forked child", "at interpreter exit"])
def test_a_batch_decides_in_a_forked_child_and_at_interpreter_exit(
    tmp_path: Path, when: str
) -> None:
    """Batches of two or more are claimed on a thread pool: a child forked after the parent
    used it inherits a pool without threads, and at interpreter exit the pool takes no work.
    Either way the batch is decided (a child that hung or raised would fail here)."""
    root = tmp_path / "store"
    child = textwrap.dedent(
        f"""
        import atexit, os, sys
        from rmq_spark import Decision, LocalTransactionState, Message, Store
        store = Store.open({str(root)!r})
        def decide():
            ids = [p.transaction_id for p in store.prepare([Message("T", b"x")] * 2, "pg")]
            store.end_transactions(
                [Decision(t, "pg", LocalTransactionState.COMMIT) for t in ids], publish=False
            )
            print("decided", flush=True)
        decide()
        if {when!r} == "at interpreter exit":
            atexit.register(decide)
        else:
            pid = os.fork()
            if pid == 0:
                decide()
                os._exit(0)
            os._exit(os.waitpid(pid, 0)[1])
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["decided", "decided"]
    assert [d for _, d in _op_rows(Store.open(root))] == ["COMMIT"] * 4


def test_rounds_read_the_objects_of_ripe_transactions_not_due_every_tenth_round() -> None:
    """A due transaction's decision object is read every round; one left pending for another
    reason (unrouted, too old, not yet due) the first round and then every tenth; one that is
    no longer ripe is forgotten."""
    from rmq_spark.checkback.batch import CHECK, TOO_OLD, UNROUTED
    from rmq_spark.checkback.decisions import LOOK_AGAIN_ROUNDS, ObjectLooks

    looks = ObjectLooks()
    ripe = pa.table(
        {"transaction_id": ["due", "old", "lost"], "reason": [CHECK, TOO_OLD, UNROUTED]}
    )
    read = [
        looks.pick(ripe if n < 3 else ripe.slice(0, 2)) for n in range(2 * LOOK_AGAIN_ROUNDS - 1)
    ]
    ids = [r.column("transaction_id").to_pylist() for r in read]
    assert ids[0] == ["due", "old", "lost"]
    assert ids[1:LOOK_AGAIN_ROUNDS] == [["due"]] * (LOOK_AGAIN_ROUNDS - 1)
    assert ids[LOOK_AGAIN_ROUNDS] == ["due", "old"]
    assert looks.pick(ripe).column("transaction_id").to_pylist() == ["due", "lost"]
    # A round whose reads failed read nothing: the next reads them again.
    failed = ObjectLooks()
    failed.forget(failed.pick(ripe))
    assert failed.pick(ripe).column("transaction_id").to_pylist() == ["due", "old", "lost"]
