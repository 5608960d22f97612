"""A store of shards (rmq_spark.store.shards): made, found and refused like stores; decisions
kept in their transaction's shard; producer processes each writing to a shard of their own."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime
from pathlib import Path

import pyarrow as pa
import pytest

from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.errors import (
    CorruptStoreError,
    InvalidOptionError,
    NotAStoreError,
    RmqSparkError,
)
from rmq_spark.model.messages import new_id, shard_of, shard_transaction_id
from rmq_spark.model.schema import COMMITLOG_SCHEMA, TABLES
from rmq_spark.store.decisions import Decision, EndTransactionStatus
from rmq_spark.store.layout import MARKER_FILE, OBJECTS_LAYOUT, shard_uri
from rmq_spark.store.queues import OP_CURSOR_APP_ID, queue_app_id
from tests.conftest import commitlog, race
from tests.unit.test_producer import ScriptedListener

REPO = Path(__file__).resolve().parents[2]
COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK


def _open(root: Path, shards: int = 1, **settings: object) -> Store:
    return Store.open(root, settings=StoreSettings(queue_nums=2, shards=shards, **settings))


def _marker(root: Path) -> dict:
    return json.loads((root / MARKER_FILE).read_text())


def test_transaction_ids_name_their_shard_and_nothing_else_does() -> None:
    assert shard_of(shard_transaction_id(0)) == 0
    assert shard_of(shard_transaction_id(7)) == 7
    # Ids a user or an older release made are the root's, whatever they end with.
    for other in ("order-17.3", "tx.1", "a" * 32 + ".1", "A" * 32 + ".x"):
        assert shard_of(other) == 0


def test_a_store_grows_shards_and_the_root_says_so_first(tmp_path: Path) -> None:
    root = tmp_path / "store"
    store = _open(root)
    assert [s.shard for s in store.shards()] == [0]
    assert _marker(root)["layout_version"] == 1  # a store of one shard: any release reads it
    grown = _open(root, shards=3)
    assert [s.shard for s in grown.shards()] == [0, 1, 2]
    assert _marker(root)["layout_version"] == OBJECTS_LAYOUT  # an older release refuses it now
    assert _marker(root / "shards" / "2")["shard"] == 2
    # Another process finds them; fewer shards in its settings remove none.
    assert [s.shard for s in _open(root, shards=2).shards()] == [0, 1, 2]
    # A process that opened the store before sees the shards made since once it looks again.
    _open(root, shards=4)
    assert [s.shard for s in store.shards()] == [0]
    assert [s.shard for s in store.shards(refresh=True)] == [0, 1, 2, 3]


def test_a_shard_is_not_a_store_of_its_own(tmp_path: Path) -> None:
    _open(tmp_path / "store", shards=2)
    with pytest.raises(NotAStoreError, match=r"is shard 1 of the rmq-spark store at .*open that"):
        Store.open(tmp_path / "store" / "shards" / "1")


def test_shard_counts_out_of_range_are_refused(tmp_path: Path) -> None:
    conf = tmp_path / "rmq.toml"
    conf.write_text("[store]\nshards = 0\n")
    from rmq_spark.model.config import load_settings

    with pytest.raises(InvalidOptionError, match=r"store.shards needs to be an integer from 1"):
        load_settings(conf)
    conf.write_text("[store]\nqueue_nums = 1001\n")
    with pytest.raises(InvalidOptionError, match=r"queue_nums needs to be an integer from 1 to"):
        load_settings(conf)


def test_decisions_stay_in_their_transactions_shard(tmp_path: Path) -> None:
    store = _open(tmp_path / "store", shards=3)
    two = store.shard_store(2)
    prepared = two.prepare([Message("T", b"a", keys="k")], "g")[0]
    assert shard_of(prepared.transaction_id) == 2
    assert 2000 <= prepared.queue_id < 2002  # shard 2's queues
    # The root routes a decision to the transaction's shard...
    (applied,) = store.end_transactions([Decision(prepared.transaction_id, "g", COMMIT)])
    assert applied.status is EndTransactionStatus.APPLIED
    # ...so a rival decision made through the shard itself is refused, not applied twice.
    (late,) = two.end_transactions([Decision(prepared.transaction_id, "g", ROLLBACK)])
    assert late.status is EndTransactionStatus.REFUSED and late.decision is COMMIT
    # A decider that writes into the wrong shard's op is stopped before anything is written.
    with pytest.raises(RmqSparkError, match=r"belongs to shard 2 of the store, not to shard 0"):
        store.write_decisions(store.table("op"), [Decision(prepared.transaction_id, "g", COMMIT)])
    assert store.read("op").num_rows == 0
    # Nor is a half message of shard 2 written into another shard.
    with pytest.raises(RmqSparkError, match=r"belongs to shard 2 of the store, not to shard 1"):
        store.shard_store(1).prepare(
            [Message("T", b"b")], "g", transaction_ids=[shard_transaction_id(2)]
        )
    assert store.shard_store(1).read("half").num_rows == 0
    # Published into the store's one CommitLog, the root's: the shard has none of its own.
    rows = commitlog(store).to_pylist()
    assert [(r["transaction_id"], r["queue_id"], r["queue_offset"]) for r in rows] == [
        (prepared.transaction_id, prepared.queue_id, 0)
    ]
    assert two.table_uri("commitlog") == store.table_uri("commitlog")
    assert not (tmp_path / "store" / "shards" / "2" / "commitlog").exists()


def test_the_roots_publish_takes_every_shards_commits_in_one_commit(tmp_path: Path) -> None:
    """The store's one publisher publishes every shard: the root's ``publish()`` (the lease
    holder's loop, check-back) takes each shard's COMMITs, in one CommitLog commit; a shard's
    own publish takes its own."""
    store = _open(tmp_path / "store", shards=3)
    committed = []
    for k in (0, 1, 2, 2):
        shard = store.shard_store(k)
        (prepared,) = shard.prepare([Message("T", f"m{len(committed)}", keys="k")], "g")
        shard.end_transactions([Decision(prepared.transaction_id, "g", COMMIT)], publish=False)
        committed.append(prepared)
    before = store.table("commitlog").version()
    assert store.publish().published == 4
    assert store.table("commitlog").version() == before + 1
    rows = commitlog(store).to_pylist()
    assert sorted((r["msg_id"], r["queue_id"], r["queue_offset"]) for r in rows) == sorted(
        (p.msg_id, p.queue_id, 0 if p is not committed[3] else 1) for p in committed
    )
    assert [store.shard_store(k).published_op_version() for k in range(3)] == [1, 1, 2]
    assert store.publish().published == 0
    (later,) = store.shard_store(1).prepare([Message("T", "later")], "g")
    store.end_transactions([Decision(later.transaction_id, "g", COMMIT)], publish=False)
    assert store.shard_store(2).publish().published == 0
    assert store.shard_store(1).publish().published == 1


def test_a_transaction_of_an_unknown_shard_names_the_problem(tmp_path: Path) -> None:
    store = _open(tmp_path / "store", shards=2)
    stranger = shard_transaction_id(9)
    with pytest.raises(RmqSparkError, match=r"has no shard 9 \(it has 2\)"):
        store.end_transactions([Decision(stranger, "g", COMMIT)])


@pytest.mark.parametrize("suffix", [".01", ".0", ".007"])
def test_an_id_shaped_like_a_shards_but_made_by_none_is_refused(tmp_path: Path, suffix) -> None:
    """``<id>.01`` or ``<id>.0`` names shard 1 or 0 to a reader, but no shard makes it: ending
    it must not record a decision (APPLIED) for a transaction that does not exist."""
    store = _open(tmp_path / "store", shards=2)
    (prepared,) = store.shard_store(1).prepare([Message("T", "m")], "g")
    made = prepared.transaction_id.rsplit(".", 1)[0]
    with pytest.raises(RmqSparkError, match=r"is not a transaction id rmq-spark made"):
        store.end_transactions([Decision(made + suffix, "g", COMMIT)])
    assert all(s.read("op").num_rows == 0 for s in store.shards())


def test_producers_claim_shards_of_their_own_and_share_when_all_are_taken(
    tmp_path: Path,
) -> None:
    settings = Settings(store=StoreSettings(path=str(tmp_path / "store"), queue_nums=2, shards=2))
    producers = [
        TransactionMQProducer("g", ScriptedListener(), settings=settings).start() for _ in range(3)
    ]
    try:
        sent = [p.send_message_in_transaction(Message("T", b"x"), COMMIT) for p in producers]
        for p in producers:
            p.flush()
        shards = [shard_of(s.transaction_id) for s in sent]
        assert sorted(shards[:2]) == [0, 1]  # the first two took a shard each
        assert shards[2] in (0, 1)  # the third shares one
        claimed = [p._publisher.claimed for p in producers]
        assert claimed == [True, True, False]
        assert sum(p._publisher.holding for p in producers) <= 1  # one publishes every shard
    finally:
        for p in producers:
            p.shutdown()
    root = Store.open(tmp_path / "store")
    visible = commitlog(root).column("msg_id").to_pylist()
    assert sorted(visible) == sorted(s.msg_id for s in sent)


def _grow(root: str, barrier, out) -> None:
    barrier.wait()
    store = Store.open(root, settings=StoreSettings(shards=4))
    out.put((str(id(store)), [s.shard for s in store.shards()]))


def test_two_processes_growing_a_store_at_once_both_succeed(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    _open(Path(root))
    results = race(_grow, [(root,), (root,)])
    assert list(results.values()) == [[0, 1, 2, 3], [0, 1, 2, 3]]


def test_producer_processes_on_a_store_of_shards_publish_every_commit_once(
    tmp_path: Path,
) -> None:
    """Four real producer processes at once on four shards: each writes only to its shard's
    logs, and every COMMIT is in the store's one CommitLog exactly once, with dense offsets."""
    root = tmp_path / "store"
    _open(root, shards=4)
    child = textwrap.dedent(
        f"""
        import json, os, pathlib, sys, time
        from rmq_spark import LocalTransactionState, Message, TransactionMQProducer
        from rmq_spark.model.config import Settings, StoreSettings
        from tests.unit.test_producer import ScriptedListener
        settings = Settings(store=StoreSettings(path={str(root)!r}, queue_nums=2, shards=4))
        ready = pathlib.Path({str(tmp_path)!r}) / "ready"
        with TransactionMQProducer("g", ScriptedListener(), settings=settings) as producer:
            (ready / str(os.getpid())).touch()  # all four send at once, each on its shard
            while len(list(ready.iterdir())) < 4:
                time.sleep(0.01)
            sent = [
                producer.send_message_in_transaction(
                    Message("T", b"x", keys=str(i)),
                    LocalTransactionState.COMMIT if i % 3 else LocalTransactionState.ROLLBACK,
                )
                for i in range(30)
            ]
        print(json.dumps([[s.transaction_id, s.msg_id, s.local_transaction_state.value]
                          for s in sent]))
        """
    )
    (tmp_path / "ready").mkdir()
    procs = [
        subprocess.Popen([sys.executable, "-c", child], cwd=REPO, stdout=subprocess.PIPE, text=True)
        for _ in range(4)
    ]
    outputs = [json.loads(p.communicate(timeout=300)[0]) for p in procs]
    assert all(p.returncode == 0 for p in procs)
    shards_used = [{shard_of(t) for t, _, _ in out} for out in outputs]
    assert sorted(s for used in shards_used for s in used) == [0, 1, 2, 3]  # one each
    committed = sorted(m for out in outputs for _, m, state in out if state == "COMMIT")
    store = Store.open(root)
    rows = commitlog(store).to_pylist()
    assert sorted(r["msg_id"] for r in rows) == committed
    by_queue: dict[int, list[int]] = {}
    for r in rows:
        by_queue.setdefault(r["queue_id"], []).append(r["queue_offset"])
    assert all(sorted(o) == list(range(len(o))) for o in by_queue.values())
    assert {q // 1000 for q in by_queue} == {0, 1, 2, 3}


def test_a_shard_removed_by_hand_is_an_error_not_a_silent_loss(tmp_path: Path) -> None:

    root = tmp_path / "store"
    store = _open(root, shards=3)
    assert _marker(root)["shards"] == 3
    two = store.shard_store(2)
    two.end_transactions(
        [Decision(p.transaction_id, "g", COMMIT) for p in two.prepare([Message("T", b"x")], "g")]
    )
    shutil.rmtree(root / "shards" / "2")
    with pytest.raises(CorruptStoreError, match=r"shard\(s\) \[2\] of the store .* are missing"):
        store.shards(refresh=True)  # a process that knew it
    with pytest.raises(CorruptStoreError, match=r"its marker counts 3 shard\(s\)"):
        Store.open(root).shards()  # and one that never did


def test_a_reader_with_more_shards_in_its_settings_changes_nothing(tmp_path: Path) -> None:
    """Readers (status, the source and its tasks, check-back) open with ``create=False``: a
    consumer sharing the producers' settings file must not grow the store (it may have
    read-only credentials), whatever its ``shards`` says."""
    root = tmp_path / "store"
    _open(root, shards=2)
    marker = _marker(root)
    reader = Store.open(root, settings=StoreSettings(queue_nums=2, shards=5), create=False)
    assert reader.shard_numbers(refresh=True) == [0, 1]
    assert sorted(p.name for p in (root / "shards").iterdir()) == ["1"]
    assert _marker(root) == marker


def test_a_shard_whose_maker_was_killed_before_its_marker_is_made_by_the_next(
    tmp_path: Path,
) -> None:
    """Making a shard is resumable from every step: a process killed after creating some of a
    shard's tables, with its marker staged but not renamed into place, or beside another
    process's conditional-write probe, leaves a folder the next grower completes."""
    root = tmp_path / "store"
    _open(root, shards=2)
    partial = root / "shards" / "2"
    tables = DeltaTables(str(partial), TABLES, {}, 5.0)  # as a killed maker left them
    tables.create("half")
    tables.create("op")
    (partial / f"{MARKER_FILE}.0123456789abcdef0123456789abcdef.tmp").write_text("{")
    (partial / "_rmqtx_probe_0123456789abcdef0123456789abcdef").write_text("")
    grown = _open(root, shards=3)
    assert grown.shard_numbers(refresh=True) == [0, 1, 2]
    assert _marker(partial)["shard"] == 2
    (prepared,) = grown.shard_store(2).prepare([Message("T", "m")], "pg")
    assert shard_of(prepared.transaction_id) == 2


_GROW = """
import json, sys
from rmq_spark import Store
from rmq_spark.model.config import StoreSettings
root, options, shards = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
Store.open(settings=StoreSettings(path=root, queue_nums=2, shards=shards, storage_options=options))
"""


@pytest.mark.parametrize("where", ["local", pytest.param("s3", marks=pytest.mark.objectstore)])
def test_a_grower_killed_at_any_step_of_making_a_shard_leaves_a_store_the_next_one_grows(
    where: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    """A real process growing the store is killed (SIGKILL) at each step of making a shard in
    turn: the store stays readable (a reader finds the shards made, the half-made one not),
    and the next grower completes the shard, which then takes transactions."""
    if where == "s3":
        minio = request.getfixturevalue("minio")
        root, options = minio.root(), minio.storage_options
        steps = ["shards.marked", "storage.probed", "layout.table", "shards.made"]
    else:
        root, options = str(tmp_path / "store"), {}
        steps = ["shards.marked", "layout.table", "layout.staged", "shards.made"]

    def settings(shards: int) -> StoreSettings:
        return StoreSettings(path=root, queue_nums=2, shards=shards, storage_options=options)

    Store.open(settings=settings(1))
    for shards, step in enumerate(steps, start=2):
        killed = subprocess.run(
            [sys.executable, "-c", _GROW, root, json.dumps(options), str(shards)],
            env={**os.environ, "PYTHONPATH": str(REPO), "RMQ_SPARK_FAILPOINT": step},
            start_new_session=True,  # the failpoint kills the child's whole session
            capture_output=True,
            timeout=300,
        )
        assert killed.returncode == -signal.SIGKILL, (step, killed.stderr.decode()[-2000:])
        reader = Store.open(settings=settings(1), create=False)
        made = shards if step == "shards.made" else shards - 1
        assert reader.shard_numbers(refresh=True) == list(range(made)), step
        grown = Store.open(settings=settings(shards))
        assert grown.shard_numbers(refresh=True) == list(range(shards)), step
        new = grown.shard_store(shards - 1)
        (prepared,) = new.prepare([Message("T", step)], "g")
        grown.end_transactions([Decision(prepared.transaction_id, "g", COMMIT)])
        assert prepared.msg_id in commitlog(grown).column("msg_id").to_pylist(), step
    assert Store.open(settings=settings(1), create=False).shard_numbers(refresh=True) == list(
        range(len(steps) + 1)
    )


def _as_layout_2(root: Path) -> list[str]:
    """Turn a fresh store of two shards into one of the release before one CommitLog (layout
    2): shard 1 has a CommitLog of its own, with two published messages, its queue's next
    offset and its ``op`` cursor; the root's marker says layout 2. The two msg ids."""
    own = DeltaTables(shard_uri(str(root), 1), TABLES, {}, 5.0)  # no located tables
    own.create("commitlog")
    ids = [new_id(), new_id()]
    now = datetime.now(UTC)
    rows = pa.Table.from_pylist(
        [
            {
                "topic": "T", "queue_id": 1000, "queue_offset": i, "msg_id": m,
                "transaction_id": shard_transaction_id(1), "producer_group": "g", "keys": None,
                "tags": None, "body": b"old", "properties": [], "born_timestamp": now,
                "store_timestamp": now,
            }
            for i, m in enumerate(ids)
        ],
        schema=COMMITLOG_SCHEMA,
    )  # fmt: skip
    own.append("commitlog", [rows], {queue_app_id("T", 1000): 2, OP_CURSOR_APP_ID: 0})
    marker = _marker(root)
    (root / MARKER_FILE).write_text(json.dumps({**marker, "layout_version": 2}))
    return ids


def test_a_store_of_a_commitlog_per_shard_is_merged_by_its_first_writer(tmp_path: Path) -> None:
    """A store made by the release whose shards each had a CommitLog: a reader of this release
    refuses it (it would miss those messages), and its first writer merges every shard's
    messages, queue offsets and op cursor into the root's CommitLog, once, however many
    writers open it."""
    root = tmp_path / "store"
    _open(root, shards=2)
    ids = _as_layout_2(root)
    with pytest.raises(RmqSparkError, match=r"has a CommitLog per shard \(layout 2\)"):
        Store.open(root, settings=StoreSettings(queue_nums=2), create=False)
    results = race(_open_as_writer, [(str(root),), (str(root),)])
    assert sorted(results.values()) == [2, 2]
    store = Store.open(root, create=False)
    assert _marker(root)["layout_version"] == OBJECTS_LAYOUT
    assert sorted(commitlog(store).column("msg_id").to_pylist()) == sorted(ids)
    assert store.shard_store(1).published_op_version() == 0
    (prepared,) = store.shard_store(1).prepare([Message("T", b"new")], "g")
    store.end_transactions([Decision(prepared.transaction_id, "g", COMMIT)])
    rows = commitlog(store).to_pylist()
    offsets = {r["msg_id"]: (r["queue_id"], r["queue_offset"]) for r in rows}
    assert offsets[prepared.msg_id] == (prepared.queue_id, 2 if prepared.queue_id == 1000 else 0)


def _open_as_writer(root: str, barrier, out) -> None:
    barrier.wait()
    store = Store.open(root, settings=StoreSettings(queue_nums=2))
    out.put((str(os.getpid()), commitlog(store).num_rows))
