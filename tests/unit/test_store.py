"""Broker semantics on real Delta tables (no Spark): visibility, first decision wins, offsets."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import subprocess
import sys
import textwrap
import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake
from deltalake.exceptions import CommitFailedError
from deltalake.table import TableMerger

from rmq_spark import (
    CorruptStoreError,
    Decision,
    EndTransactionStatus,
    InvalidMessageError,
    LocalTransactionState,
    Message,
    NotAStoreError,
    RmqSparkError,
    Store,
    StoreError,
    StoreVersionError,
)
from rmq_spark.checkback.pending import update_pending
from rmq_spark.delta.compaction import compact as compact_table
from rmq_spark.delta.storage import filesystem
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.messages import shard_transaction_id
from rmq_spark.model.schema import CHECKPOINT_INTERVAL, LOCKS_SCHEMA
from rmq_spark.store import decisions as decisions_module
from rmq_spark.store.layout import MARKER_FILE
from rmq_spark.store.own_writes import OwnDecisions, decision_app_id
from tests.conftest import commitlog, committing
from tests.latency_proxy import LatencyProxy

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK


def decide(store: Store, prepared, state, **kw):
    return store.end_transactions([Decision(p.transaction_id, "pg", state) for p in prepared], **kw)


def test_half_messages_are_durable_but_invisible(any_store: Store) -> None:
    any_store = committing(any_store)
    prepared = any_store.prepare([Message("Orders", b"a"), Message("Orders", b"b")], "pg")
    assert any_store.read("half").num_rows == 2
    assert commitlog(any_store).num_rows == 0
    assert any_store.publish().published == 0
    assert commitlog(any_store).num_rows == 0
    assert {p.half_version for p in prepared} == {1}


def test_commit_visible_once_rollback_never(any_store: Store) -> None:
    a, b, c = any_store.prepare(
        [
            Message("Orders", b"a", tags="T", keys="k"),
            Message("Orders", b"b"),
            Message("Pay", b"c"),
        ],
        "pg",
    )
    results = decide(any_store, [a, c], COMMIT) + decide(any_store, [b], ROLLBACK)
    assert [r.status for r in results] == [EndTransactionStatus.APPLIED] * 3
    for _ in range(3):
        any_store.publish()
    visible = commitlog(any_store)
    assert sorted(visible.column("body").to_pylist()) == [b"a", b"c"]
    row = visible.filter(pa.compute.equal(visible.column("body"), b"a")).to_pylist()[0]
    assert (row["msg_id"], row["transaction_id"]) == (a.msg_id, a.transaction_id)
    assert (row["tags"], row["keys"], row["producer_group"]) == ("T", "k", "pg")
    assert row["store_timestamp"] >= row["born_timestamp"]


def test_first_decision_wins_and_duplicates_are_noops(any_store: Store) -> None:
    (p,) = any_store.prepare([Message("Orders", b"a")], "pg")
    (first,) = decide(any_store, [p], COMMIT)
    (late,) = decide(any_store, [p], ROLLBACK)
    (again,) = decide(any_store, [p], COMMIT)
    assert first.status is EndTransactionStatus.APPLIED
    assert (late.status, late.decision) == (EndTransactionStatus.REFUSED, COMMIT)
    assert (again.status, again.decision) == (EndTransactionStatus.ALREADY_DECIDED, COMMIT)
    assert commitlog(any_store).num_rows == 1
    assert any_store.read("op").num_rows == 1


def test_a_decision_from_a_stale_snapshot_is_refused_by_delta(any_store: Store) -> None:
    """The arbiter itself: a decider that read ``op`` before a rival decided the transaction
    cannot commit its own decision (Delta refuses it), whatever the timing."""
    a, b = any_store.prepare([Message("Orders", b"a"), Message("Orders", b"b")], "pg")
    stale = DeltaTable(any_store.table_uri("op"), storage_options=any_store._storage_options)
    decide(any_store, [a], ROLLBACK)
    with pytest.raises(CommitFailedError):
        any_store.write_decisions(stale, [Decision(a.transaction_id, "pg", COMMIT)])
    assert any_store.decisions([a.transaction_id]) == {a.transaction_id: ROLLBACK}
    # Another transaction's decision lands on the same stale snapshot (unless it shares the
    # bucket, which only means a retry).
    other = DeltaTable(any_store.table_uri("op"), storage_options=any_store._storage_options)
    if decision_app_id(b.transaction_id) != decision_app_id(a.transaction_id):
        decide(any_store, [a], ROLLBACK)  # an ALREADY_DECIDED no-op writes nothing
        any_store.write_decisions(other, [Decision(b.transaction_id, "pg", COMMIT)])
        assert any_store.decisions([b.transaction_id]) == {b.transaction_id: COMMIT}


def test_a_decider_that_skips_reading_the_log_still_loses_to_a_rival(any_store: Store) -> None:
    """A decider that has been deciding alone reads no log before its next decision (its head
    is its own last commit), and its own decisions have moved its arbiters past its ``op``
    snapshot. A rival's decisions made since, in the same arbiter bucket as one of its own
    or not, still win: its commit finds their versions taken and their arbiters recorded."""
    ids = [shard_transaction_id(0) for _ in range(400)]
    by_bucket: dict[str, list[str]] = {}
    for t in ids:
        by_bucket.setdefault(decision_app_id(t), []).append(t)
    own, shared = next(pair for pair in by_bucket.values() if len(pair) >= 2)[:2]
    other = next(t for t in ids if decision_app_id(t) not in {decision_app_id(own)})
    prepared = any_store.prepare(
        [Message("Orders", t) for t in (own, shared, other)],
        "pg",
        transaction_ids=[own, shared, other],
    )
    rival = Store.open(any_store.root, settings=any_store.settings, create=False)
    decide(any_store, prepared[:1], COMMIT)  # alone: its head is calm, the bucket moved by it
    decide(rival, prepared[1:], ROLLBACK)
    results = decide(any_store, prepared[1:], COMMIT) + decide(any_store, prepared[:1], COMMIT)
    assert [(r.status, r.decision) for r in results] == [
        (EndTransactionStatus.REFUSED, ROLLBACK),
        (EndTransactionStatus.REFUSED, ROLLBACK),
        (EndTransactionStatus.ALREADY_DECIDED, COMMIT),
    ]
    assert any_store.read("op").num_rows == 3
    any_store.publish()
    assert commitlog(any_store).column("transaction_id").to_pylist() == [own]


def test_half_messages_another_writer_stored_twice_are_read_and_published_once(
    any_store: Store,
) -> None:
    """Two compactions of the same ``half`` files, rmq-spark's and a user's deltalake
    ``optimize.compact()``, can both land: deltalake lets a commit that removes files another
    ``dataChange=false`` commit removed first go on (torture, seed 21), and ``half`` then holds
    those messages twice. They were published twice, and check-back's rounds failed on every
    shard from then on (its MERGE of check state met two rows of one transaction). A message is
    its ``msg_id``: it is read, checked and published once."""
    any_store = committing(any_store)
    prepared = any_store.prepare([Message("Orders", b"a"), Message("Orders", b"b")], "pg")
    uri, options = any_store.table_uri("half"), any_store._storage_options
    twice = DeltaTable(uri, storage_options=options).to_pyarrow_table()
    write_deltalake(uri, twice, mode="append", storage_options=options)
    other = Store.open(any_store.root, settings=any_store.settings, create=False)
    assert other.half_messages([prepared[0].transaction_id]).num_rows == 1
    decide(other, prepared, COMMIT)
    assert sorted(commitlog(other).column("body").to_pylist()) == [b"a", b"b"]


def test_a_transaction_made_after_the_op_snapshot_is_not_looked_up_there_and_still_loses(
    any_store: Store, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Deciding a transaction made after the decider's ``op`` snapshot was loaded reads no
    ``op`` file (nobody could decide it before its id existed: a read on every decision's path
    on S3). One made before is looked up; a rival's decision of one made after moved its
    arbiter, and still wins."""
    looked_up: list[list[str]] = []
    decisions_of = decisions_module.decisions_of

    def counted(tables, op, ids):
        looked_up.append(list(ids))
        return decisions_of(tables, op, ids)

    monkeypatch.setattr(decisions_module, "decisions_of", counted)
    early = any_store.prepare([Message("Orders", b"early")], "pg")
    decide(any_store, early, COMMIT)  # loads the op snapshot, after early was made
    assert looked_up == [[early[0].transaction_id]]
    later = [any_store.prepare([Message("Orders", f"later{i}")], "pg")[0] for i in range(3)]
    looked_up.clear()
    assert {r.status for r in decide(any_store, later[1:], COMMIT)} == {
        EndTransactionStatus.APPLIED
    }
    assert looked_up == []
    rival = Store.open(any_store.root, settings=any_store.settings, create=False)
    decide(rival, later[:1], ROLLBACK)  # looks it up: the rival did not make it
    looked_up.clear()
    (result,) = decide(any_store, later[:1], COMMIT)
    assert (result.status, result.decision) == (EndTransactionStatus.REFUSED, ROLLBACK)
    assert looked_up == [[later[0].transaction_id]]
    any_store.publish()
    published = set(commitlog(any_store).column("transaction_id").to_pylist())
    assert published == {p.transaction_id for p in early + later[1:]}


def test_a_rivals_arbiter_recorded_at_the_version_of_a_decider_own_is_not_taken_for_its(
    any_store: Store,
) -> None:
    """Application-id versions are the version a commit first tried, not the one it landed at:
    a rival that decided from the same head as the decider's own last commit records its
    buckets at the same version. Read from the log, the rival's bucket looked like one the
    decider had moved itself, so it decided a transaction the rival had already decided."""
    buckets: dict[str, str] = {}  # three transactions in three buckets (1 in 350 draws collide)
    while len(buckets) < 3:
        t = shard_transaction_id(0)
        buckets.setdefault(decision_app_id(t), t)
    ids = list(buckets.values())
    t, u, v = any_store.prepare(
        [Message("Orders", str(i)) for i in range(3)], "pg", transaction_ids=ids
    )
    stale = DeltaTable(any_store.table_uri("op"), storage_options=any_store._storage_options)
    decide(any_store, [u], COMMIT)  # the decider's own commit, at the version after stale
    rival = Store.open(any_store.root, settings=any_store.settings, create=False)
    rival.write_decisions(stale, [Decision(t.transaction_id, "pg", ROLLBACK)])  # same version
    decide(any_store, [v], COMMIT)  # lands after the rival's: the next decision reads the log
    (result,) = decide(any_store, [t], COMMIT)
    assert (result.status, result.decision) == (EndTransactionStatus.REFUSED, ROLLBACK)
    assert sorted(any_store.read("op").column("transaction_id").to_pylist()) == sorted(ids)


def test_many_deciders_at_once_one_decision_each(store: Store) -> None:
    """Threads with a store each race COMMIT against ROLLBACK on the same transactions: one
    APPLIED per transaction, everyone agrees on the decision in force, one op row each."""
    prepared = store.prepare([Message("Orders", str(i)) for i in range(20)], "pg")
    ids = [p.transaction_id for p in prepared]
    results: dict[int, list] = {}

    def decider(n: int) -> None:
        mine = Store.open(store.root, settings=store.settings, create=False)
        state = COMMIT if n % 2 else ROLLBACK
        results[n] = mine.end_transactions(
            [Decision(t, "pg", state) for t in ids], publish=bool(n % 3)
        )

    threads = [threading.Thread(target=decider, args=(n,)) for n in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    op = store.read("op")
    assert sorted(op.column("transaction_id").to_pylist()) == sorted(ids)
    in_force = store.decisions(ids)
    for i, txn in enumerate(ids):
        outcomes = [results[n][i] for n in results]
        assert [r.status for r in outcomes].count(EndTransactionStatus.APPLIED) == 1
        assert {r.decision for r in outcomes} == {in_force[txn]}
    store.publish()
    committed = {t for t, d in in_force.items() if d is COMMIT}
    assert sorted(commitlog(store).column("transaction_id").to_pylist()) == sorted(committed)


def test_rollback_then_commit_is_refused(store: Store) -> None:
    (p,) = store.prepare([Message("Orders", b"a")], "pg")
    decide(store, [p], ROLLBACK)
    (late,) = decide(store, [p], COMMIT)
    assert (late.status, late.decision) == (EndTransactionStatus.REFUSED, ROLLBACK)
    assert commitlog(store).num_rows == 0


def test_same_transaction_twice_in_one_call(store: Store) -> None:
    (p,) = store.prepare([Message("Orders", b"a")], "pg")
    d = [Decision(p.transaction_id, "pg", s) for s in (COMMIT, ROLLBACK, COMMIT)]
    statuses = [r.status for r in store.end_transactions(d)]
    assert statuses == ["APPLIED", "REFUSED", "ALREADY_DECIDED"]
    assert commitlog(store).num_rows == 1


def test_multi_message_transaction_commits_together(any_store: Store) -> None:
    first = any_store.prepare(
        [Message("Orders", b"1"), Message("Orders", b"2")], "pg", transaction_ids=["tx-epoch-1"] * 2
    )
    second = any_store.prepare([Message("Orders", b"3")], "pg", transaction_ids=["tx-epoch-1"])
    assert first[0].half_version < second[0].half_version
    any_store.end_transactions([Decision("tx-epoch-1", "pg", COMMIT, "sink")])
    assert sorted(commitlog(any_store).column("body").to_pylist()) == [b"1", b"2", b"3"]


def test_offsets_are_dense_per_queue_and_follow_commit_order(any_store: Store) -> None:
    prepared = any_store.prepare([Message("Orders", str(i), keys="same") for i in range(5)], "pg")
    for p in reversed(prepared):
        decide(any_store, [p], COMMIT)
    any_store.send([Message("Orders", "n", keys="same")], "pg")
    rows = commitlog(any_store).to_pylist()
    assert [r["queue_offset"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert [r["body"] for r in rows] == [b"4", b"3", b"2", b"1", b"0", b"n"]
    assert len({r["queue_id"] for r in rows}) == 1


def test_crash_between_decision_and_publish_is_repaired(any_store: Store) -> None:
    (p,) = any_store.prepare([Message("Orders", b"a")], "pg")
    decide(any_store, [p], COMMIT, publish=False)  # as if the decider died right after op commit
    assert commitlog(any_store).num_rows == 0
    assert any_store.publish().published == 1
    assert any_store.publish().published == 0
    assert commitlog(any_store).num_rows == 1


def test_publisher_lagging_past_compaction_and_vacuum_publishes_all(store: Store) -> None:
    """Decisions recorded, the publisher gone for longer than the tombstone retention: op is
    compacted and its old files vacuumed before anyone publishes. Nothing may be lost."""
    prepared = store.prepare([Message("Orders", str(i).encode()) for i in range(6)], "pg")
    for p, state in zip(prepared, [COMMIT, ROLLBACK] * 3, strict=True):
        decide(store, [p], state, publish=False)
    store.compact("op")
    store.table("op").vacuum(retention_hours=0, enforce_retention_duration=False, dry_run=False)
    assert store.publish().published == 3
    assert sorted(commitlog(store).column("body").to_pylist()) == [b"0", b"2", b"4"]


def test_normal_send_is_visible_with_offsets(store: Store) -> None:
    result = store.send(
        [Message("Orders", b"n1", keys="k"), Message("Orders", b"n2", keys="k")], "pg"
    )
    assert [(qid, off) for _, qid, off in result.sent] == [
        (result.sent[0][1], 0),
        (result.sent[0][1], 1),
    ]
    assert commitlog(store).column("transaction_id").null_count == 2


def test_invalid_message_writes_nothing(store: Store) -> None:
    with pytest.raises(InvalidMessageError, match="system topic"):
        store.prepare([Message("Orders", b"ok"), Message("RMQ_SYS_TRANS_HALF_TOPIC", b"x")], "pg")
    with pytest.raises(InvalidMessageError, match="producer_group"):
        store.prepare([Message("Orders", b"ok")], "bad group!")
    assert store.table("half").version() == 0


def test_end_transaction_rejects_unknown_state(store: Store) -> None:
    (p,) = store.prepare([Message("Orders", b"a")], "pg")
    with pytest.raises(RmqSparkError, match="UNKNOWN means 'do not end it yet'"):
        decide(store, [p], LocalTransactionState.UNKNOWN)


def test_reopen_existing_store(store: Store) -> None:
    store.send([Message("Orders", b"n")], "pg")
    again = Store.open(store.root, create=False)
    assert commitlog(again).num_rows == 1


def test_foreign_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("a,b\n")
    with pytest.raises(NotAStoreError, match="not an rmq-spark store"):
        Store.open(tmp_path)
    assert (tmp_path / "data.csv").read_text() == "a,b\n"


def test_file_root_is_refused(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotAStoreError, match="is a file"):
        Store.open(tmp_path / "f")


def test_missing_root_without_create(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="no rmq-spark store"):
        Store.open(tmp_path / "nothing", create=False)


def test_newer_layout_is_refused(store: Store) -> None:
    marker = Path(store.root) / MARKER_FILE
    marker.write_text(json.dumps({"format": "rmq-spark-store", "layout_version": 99}))
    with pytest.raises(StoreVersionError, match="layout version 99.*upgrade rmq-spark"):
        Store.open(store.root)


@pytest.mark.parametrize("content", ["{not json", '{"format": "other", "layout_version": 1}', "[]"])
def test_corrupt_marker(store: Store, content: str) -> None:
    (Path(store.root) / MARKER_FILE).write_text(content)
    with pytest.raises(CorruptStoreError, match="unreadable"):
        Store.open(store.root)


def test_foreign_table_is_refused(store: Store, tmp_path: Path) -> None:
    write_deltalake(
        store.table_uri("op"), pa.table({"x": [1]}), mode="overwrite", schema_mode="overwrite"
    )
    with pytest.raises(CorruptStoreError, match="table 'op'.*has columns \\['x'\\]"):
        Store.open(store.root)


def test_tables_added_later_are_created_in_an_older_store(store: Store) -> None:
    import shutil

    shutil.rmtree(Path(store.root) / "epochs")
    reopened = Store.open(store.root, create=False)
    assert reopened.read("epochs").num_rows == 0


def test_columns_added_later_are_added_to_an_older_store(store: Store) -> None:
    """A layout-1 store from before the writer and epoch-state columns: opening it adds them;
    its closed epochs stay closed and its half messages stay readable."""
    import shutil
    from datetime import UTC, datetime

    from deltalake import DeltaTable

    from rmq_spark.model.schema import EPOCH_STATE_COLUMNS, EPOCHS_SCHEMA, HALF_MESSAGE_SCHEMA
    from rmq_spark.spark.epoch_records import CLOSED, read_epoch
    from rmq_spark.spark.epochs import hold

    old_epochs = pa.schema(
        [f.with_nullable(f.name not in ("closed_by", "closed_timestamp")) for f in EPOCHS_SCHEMA]
    ).remove(len(EPOCHS_SCHEMA) - 1)
    for _ in EPOCH_STATE_COLUMNS[1:]:
        old_epochs = old_epochs.remove(len(old_epochs) - 1)
    (prepared,) = store.prepare([Message("Orders", b"old")], "pg")
    old_half = store.half_messages([prepared.transaction_id]).select(HALF_MESSAGE_SCHEMA.names)
    for name, schema, rows in [
        ("half", HALF_MESSAGE_SCHEMA, old_half),
        (
            "epochs",
            old_epochs,
            [
                {
                    "sink_id": "s",
                    "epoch": 0,
                    "transaction_ids": ["t"],
                    "closed_by": "sink",
                    "closed_timestamp": datetime.now(UTC),
                }
            ],
        ),
    ]:
        shutil.rmtree(Path(store.root) / name)
        DeltaTable.create(store.table_uri(name), schema=schema)
        write_deltalake(
            store.table_uri(name),
            pa.Table.from_pylist(
                list(rows.to_pylist()) if isinstance(rows, pa.Table) else rows, schema=schema
            ),
            mode="append",
        )
    reopened = Store.open(store.root, create=False)
    assert reopened.half_messages([prepared.transaction_id]).column("sink_id").to_pylist() == [None]
    old = read_epoch(reopened, "s", 0)
    assert (old.state, old.transaction_ids) == (CLOSED, ("t",))
    assert hold(reopened, "s", 1, "w", lease_seconds=60).generation == 0  # new rows work
    assert Store.open(store.root, create=False).read("epochs").num_rows == 2


def test_missing_table_is_refused(store: Store) -> None:
    import shutil

    shutil.rmtree(Path(store.root) / "half")
    with pytest.raises(CorruptStoreError, match="table 'half'.*missing or unreadable"):
        Store.open(store.root)


def test_file_uri_root(tmp_path: Path) -> None:
    uri = (tmp_path / "s").as_uri()
    store = Store.open(uri)
    store.send([Message("Orders", b"x")], "pg")
    assert Store.open(uri).read("commitlog").num_rows == 1


def test_compaction_changes_no_data_and_publishing_goes_on(store: Store) -> None:
    for i in range(6):
        (p,) = store.prepare([Message("Orders", f"m{i}", keys="k")], "pg")
        decide(store, [p], COMMIT if i % 2 == 0 else ROLLBACK)
    before = {
        name: store.table(name)
        .to_pyarrow_table()
        .sort_by("msg_id" if name != "op" else "transaction_id")
        for name in ("half", "op", "commitlog")
    }
    files_before = len(store.table("half").file_uris())
    removed = store.compact()
    assert removed["half"] == files_before and len(store.table("half").file_uris()) == 1
    for name, table in before.items():
        key = "msg_id" if name != "op" else "transaction_id"
        assert store.table(name).to_pyarrow_table().sort_by(key).equals(table), name
    # The publisher reads op's change feed across the compaction commit, and goes on.
    (p,) = store.prepare([Message("Orders", "after", keys="k")], "pg")
    decide(store, [p], COMMIT)
    rows = commitlog(store).to_pylist()
    assert [r["body"] for r in rows] == [b"m0", b"m2", b"m4", b"after"]
    assert [r["queue_offset"] for r in rows] == [0, 1, 2, 3]


def test_compaction_failure_after_a_landed_append_is_not_an_error(store: Store) -> None:
    # The commit that reaches the checkpoint interval compacts the table. A data file lost
    # underneath (an over-eager VACUUM, a lifecycle rule) makes that compaction fail for real;
    # the append that triggered it has landed and must not be reported as failed (its caller would
    # retry and write it twice).
    first = store.prepare([Message("Orders", b"first")], "pg")[0]
    while store.table("half").version() < CHECKPOINT_INTERVAL - 1:
        store.prepare([Message("Orders", b"filler")], "pg")
    (lost,) = [u for u in store.table("half").file_uris() if first.transaction_id in _ids_in(u)]
    Path(lost).unlink()
    (p,) = store.prepare([Message("Orders", b"after")], "pg")
    assert p.half_version == CHECKPOINT_INTERVAL
    assert store.half_messages([p.transaction_id]).column("body").to_pylist() == [b"after"]


def _ids_in(uri: str) -> list[str]:
    return pq.read_table(uri, columns=["transaction_id"]).column(0).to_pylist()


def test_publish_that_landed_but_reported_a_failure_sends_once(store: Store) -> None:
    # deltalake writes a checkpoint right after the commit that reaches the checkpoint
    # interval; when the checkpoint cannot be written, write_deltalake raises although the
    # commit landed. The publish must find its messages in commitlog instead of sending them
    # again under new ids.
    table = store.table("commitlog")
    landing = table.version() + 2  # after the property change below, the send's commit
    table.alter.set_table_properties({"delta.checkpointInterval": str(landing + 1)})
    log_dir = Path(store.table_uri("commitlog")) / "_delta_log"
    (log_dir / f"{landing:020d}.checkpoint.parquet").mkdir()  # the checkpoint cannot be written
    result = store.send([Message("Orders", b"once", keys="k")], "pg")
    rows = commitlog(store).to_pylist()
    assert store.table("commitlog").version() == landing
    assert [r["body"] for r in rows] == [b"once"]
    assert result.sent == [(rows[0]["msg_id"], rows[0]["queue_id"], 0)]
    # The store goes on normally.
    store.send([Message("Orders", b"next", keys="k")], "pg")
    assert [r["queue_offset"] for r in commitlog(store).to_pylist()] == [0, 1]


def _compactor(root: str, name: str, barrier, out) -> None:
    store = Store.open(root, create=False)
    barrier.wait(timeout=60)
    out.put((name, store.compact("half")))


@pytest.mark.objectstore
def test_a_table_is_maintained_after_each_checkpoint_from_it(minio) -> None:
    """A table is compacted and its log cleaned once a checkpoint interval, right after the
    checkpoint, on a snapshot loaded from it: the interval's log entries, which the checkpoint
    holds, are not read again (bringing the maintenance's snapshot up to date read each one
    twice, two GETs a commit on S3, as many as the sends' own)."""
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0.0, record=True).start()
    try:
        root = minio.root()
        direct = Store.open(
            settings=Settings(
                store=StoreSettings(path=root, storage_options=minio.storage_options, intake=False)
            )
        )
        direct.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
        options = dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        store = Store.open(
            settings=Settings(store=StoreSettings(path=root, storage_options=options, intake=False))
        )
        store.maintain_in_background()
        bodies: list[bytes] = []

        def send_until(version: int) -> None:
            while True:
                bodies.append(str(len(bodies)).encode())
                if store.prepare([Message("Orders", bodies[-1])], "pg")[0].half_version >= version:
                    break
            store.finish_maintenance()

        send_until(10)  # the first interval: the maintenance thread has a snapshot since
        proxy.requests.clear()
        send_until(20)
        requests = list(proxy.requests)
        assert store.data_files("half").num_rows == 1  # compacted
        assert sorted(store.read("half").column("body").to_pylist()) == sorted(bodies)
        replayed = []
        for i, (method, target) in enumerate(requests):
            written = re.search(r"/half/_delta_log/(\d+)\.checkpoint\.parquet$", target)
            if method == "PUT" and written:
                replayed += [
                    t
                    for m, t in requests[i:]
                    if m == "GET"
                    and (entry := re.search(r"/half/_delta_log/(\d+)\.json$", t))
                    and int(entry.group(1)) <= int(written.group(1))
                ]
        # The compaction's commit checks that the entry before it is there; nothing else.
        assert replayed and len(replayed) <= 1, replayed
        # Each small file compacted is read in one request (not its size, footer and data).
        read = [(m, t) for m, t in requests if re.search(r"/half/part-[^/]*\.parquet$", t)]
        assert {m for m, _ in read} == {"GET", "PUT"}, read
        assert sum(m == "GET" for m, _ in read) == len({t for m, t in read if m == "GET"})
    finally:
        proxy.stop()


def test_two_compactions_at_once_never_duplicate_rows(tmp_path: Path) -> None:
    """deltalake lets two concurrent OPTIMIZEs both commit the same rewrite (every row twice):
    compactions of a table take turns."""
    from tests.conftest import race

    for trial in range(3):
        store = Store.open(tmp_path / f"s{trial}", settings=StoreSettings(intake=False))
        for i in range(30):
            store.prepare([Message("Orders", f"m{i}".encode())], "pg")
        results = race(_compactor, [(store.root, n) for n in ("a", "b")])
        assert sum(r.get("half", 0) for r in results.values()) >= 30  # one of them compacted
        half = store.read("half")
        assert half.num_rows == 30 and len(set(half.column("msg_id").to_pylist())) == 30


def _log_entries(store: Store, name: str) -> int:
    fs, path = filesystem(f"{store.table_uri(name)}/_delta_log", store.settings.storage_options)
    return sum(p.endswith(".json") for p in fs.ls(path, detail=False))


@pytest.fixture
def short_log_store(any_store: Store, young_entries_cleaned: None) -> Store:
    """A store whose internal tables' logs are cleaned as soon as a checkpoint covers them
    (on local disk and on S3, whose listings tell the age differently)."""
    settings = dataclasses.replace(any_store.settings, log_retention=0.0, intake=False)
    return Store.open(any_store.root, settings=settings)


def test_the_log_of_an_internal_table_stays_bounded(short_log_store: Store) -> None:
    """A store that has grown for months: every commit lists the log on a local filesystem,
    so a log that only grows makes every send slower (rule 9)."""
    for i in range(230):
        short_log_store.prepare([Message("Orders", str(i).encode())], "pg")
    assert short_log_store.table("half").version() > 200  # appends, and compactions
    assert _log_entries(short_log_store, "half") <= 2 * CHECKPOINT_INTERVAL
    assert short_log_store.read("half").num_rows == 230


def test_the_op_log_a_lagging_publisher_needs_is_kept(short_log_store: Store) -> None:
    """Decisions recorded, nobody publishing for longer than the log retention: the op
    commits after the publish cursor must survive the cleanup, or COMMITs would be lost."""
    store = short_log_store
    prepared = store.prepare([Message("Orders", str(i).encode()) for i in range(210)], "pg")
    for p in prepared:
        decide(store, [p], COMMIT, publish=False)
    store.clean_log("op")
    assert store.publish().published == 210
    assert commitlog(store).num_rows == 210
    # Decided and published one by one past the next checkpoint: the cursor moves, and the
    # maintenance after that checkpoint cleans the log.
    for p in store.prepare([Message("Orders", b"more")] * 100, "pg"):
        decide(store, [p], COMMIT)
    assert _log_entries(store, "op") <= 2 * CHECKPOINT_INTERVAL
    assert commitlog(store).num_rows == 310


def test_a_snapshot_whose_log_was_cleaned_under_it_still_updates(short_log_store: Store) -> None:
    """A producer idle for longer than the log retention while others wrote: the commits after
    its cached snapshot are gone, and deltalake brings it up to date from the checkpoint."""
    idle = Store.open(short_log_store.root, settings=short_log_store.settings)
    assert idle.table("half").version() == 0
    for i in range(230):
        short_log_store.prepare([Message("Orders", str(i).encode())], "pg")
    assert idle.table("half").version() == short_log_store.table("half").version()
    idle.prepare([Message("Orders", b"after")], "pg")
    assert short_log_store.read("half").num_rows == 231


@pytest.mark.usefixtures("young_entries_cleaned")
@pytest.mark.parametrize("large", [False, True], ids=["append", "streamed"])
@pytest.mark.parametrize("skew", [False, True], ids=["idle", "clock-skew"])
def test_a_writer_appends_after_the_log_was_cleaned_under_its_snapshot(
    any_store: Store, large: bool, skew: bool
) -> None:
    """A producer idle for longer than the log retention while another wrote (or whose
    snapshot is younger, but the other's clock runs two hours ahead): the log entries after
    its cached snapshot are gone, and deltalake refuses to commit on it ("Invalid table
    version"); every later send of that process failed."""
    any_store = committing(any_store)
    retention = 3600.0 if skew else 0.0
    settings = dataclasses.replace(any_store.settings, log_retention=retention)
    ahead = (lambda: datetime.now(UTC) + timedelta(hours=2)) if skew else None
    writer = Store.open(any_store.root, settings=settings, clock=ahead)
    idle = Store.open(any_store.root, settings=settings)
    idle.prepare([Message("Orders", b"before")], "pg")  # caches its half snapshot
    for i in range(230):
        writer.prepare([Message("Orders", str(i).encode())], "pg")
    assert _log_entries(writer, "half") <= 2 * CHECKPOINT_INTERVAL  # it was cleaned
    if large:
        rows = writer.read("half").slice(0, 3)
        assert idle.append_batches("half", iter([rows])) is not None
    else:
        idle.prepare([Message("Orders", b"after")], "pg")
    stored = writer.data_files("half").column("num_records").to_pylist()
    assert sum(stored) == (234 if large else 232)  # the 3 rows appended again too


def _ahead(minutes: float) -> Callable[[], datetime]:
    return lambda: datetime.now(UTC) + timedelta(minutes=minutes)


@pytest.mark.usefixtures("young_entries_cleaned")
def test_a_busy_store_keeps_minutes_not_the_log_retention_of_log(tmp_path: Path) -> None:
    """A store sending for an hour at the default 15 min log retention: every commit lists
    the log on a local filesystem (about 8.5 us an entry here: 8.5 ms a send with 200 entries,
    58 ms with 6,000), so 15 minutes of commits made sends ten times slower. Entries that no
    reader's cursor needs go after ten seconds (here the clock is two minutes ahead)."""
    store = Store.open(tmp_path, settings=StoreSettings(intake=False), clock=_ahead(2))
    assert store.settings.log_retention == 900.0  # the default
    for i in range(430):
        if i % 25 == 0:
            update_pending(store)  # the check-back job keeps up
        store.prepare([Message("Orders", str(i).encode())], "pg")
    # A checkpoint and a cleanup every 100 commits, the pending list 25 sends behind.
    assert _log_entries(store, "half") <= 2 * CHECKPOINT_INTERVAL
    assert store.read("half").num_rows == 430


@pytest.mark.usefixtures("young_entries_cleaned")
def test_the_log_a_lagging_check_back_job_needs_is_kept_for_the_log_retention(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The pending list reads half's and op's change feeds after its cursors: entries after
    them stay for the log retention (here two minutes old of 15), so the next update is
    incremental; past it (20 minutes old) they go, and the update rebuilds from a full scan."""
    for minutes, full_scan in ((2, False), (20, True)):
        store = Store.open(
            tmp_path / str(minutes), settings=StoreSettings(intake=False), clock=_ahead(minutes)
        )
        update_pending(store)
        for i in range(230):
            store.prepare([Message("Orders", str(i).encode())], "pg")
        caplog.clear()
        with caplog.at_level("INFO", logger="rmq_spark.checkback.pending"):
            assert update_pending(store).rows.num_rows == 230
        assert ("full scan" in caplog.text) is full_scan, caplog.text


def _long_run(tmp_path: Path, lock: str) -> tuple[Store, DeltaTable, list[str]]:
    """A store whose ``lock`` is held by a run that started on a snapshot of ``half`` with ten
    sends, and 230 sends since, on a clock two minutes ahead."""
    store = Store.open(tmp_path, settings=StoreSettings(intake=False), clock=_ahead(2))
    ids = [store.prepare([Message("Orders", b"old")], "pg")[0].transaction_id for _ in range(10)]
    assert store.lock(lock, "a long run", 3600.0)
    snapshot = DeltaTable(store.table_uri("half"))  # where the long operation started
    for i in range(230):
        store.prepare([Message("Orders", str(i).encode())], "pg")
    return store, snapshot, ids


def test_a_long_compaction_keeps_the_log_its_commit_checks(tmp_path: Path) -> None:
    """A compaction of a large half table can take minutes while sends go on: its commit
    checks the commits after its snapshot, and deltalake refuses it if they were cleaned
    ("Invalid table version"). While it holds its lock, only entries past the log retention
    go (here they are two minutes old of 15)."""
    store, snapshot, _ = _long_run(tmp_path, "compact:half")
    assert snapshot.optimize.compact()["numFilesRemoved"] == 10
    assert store.read("half").num_rows == 240


def test_a_long_maintenance_run_keeps_the_log_its_commit_checks(tmp_path: Path) -> None:
    """The same for a maintenance run's retention MERGE: a commit that lost to the sends is a
    lost race (``Store.merge`` retries it from the latest snapshot), never a broken table."""
    store, snapshot, ids = _long_run(tmp_path, "maintain")
    merge = snapshot.merge(
        pa.table({"transaction_id": ids}),
        "t.transaction_id = s.transaction_id",
        source_alias="s",
        target_alias="t",
    ).when_matched_delete()
    with pytest.raises(CommitFailedError):
        merge.execute()
    assert store.read("half").num_rows == 240


def test_a_merge_that_outlives_the_log_of_its_snapshot_is_retried(tmp_path: Path) -> None:
    """A MERGE (a lock, a check-back state update) that runs longer than the log entries
    after its snapshot live, while another process commits and cleans: deltalake refuses its
    commit ("Invalid table version"), which is a lost race, retried from the latest snapshot."""
    settings = StoreSettings(log_retention=0.0, intake=False)
    store, other = Store.open(tmp_path, settings=settings), Store.open(tmp_path, settings=settings)
    attempts = []

    def slow(merger: TableMerger) -> TableMerger:
        if not attempts:  # the first attempt outlives its snapshot's log
            for _ in range(230):
                assert other.lock("busy", "other", 60.0)
        attempts.append(1)
        return merger.when_not_matched_insert({c: f"s.{c}" for c in ("name", "holder", "expires")})

    row = {"name": "slow", "holder": "me", "expires": datetime.now(UTC)}
    store.merge("locks", pa.Table.from_pylist([row], schema=LOCKS_SCHEMA), "name", slow)
    assert len(attempts) == 2
    assert store.query("locks", "name = 'slow'").num_rows == 1


def test_a_log_listing_that_raced_a_commit_is_listed_again(store: Store) -> None:
    """On a local filesystem a listing made while commits land can miss an entry and see a
    later one (about once in 20 s of one thread reading ``half`` while another sent);
    deltalake refuses such a log. Here the entry shows up on the second listing, as it does
    on disk."""
    from deltalake.exceptions import DeltaError

    from rmq_spark.delta.retry import relisting

    for i in range(3):
        store.prepare([Message("Orders", str(i).encode())], "pg")
    log_dir = Path(store.table_uri("half")) / "_delta_log"
    entry = log_dir / f"{2:020d}.json"
    hidden = log_dir / "late.json.tmp"
    entry.rename(hidden)
    listings = []

    def load() -> DeltaTable:
        listings.append(1)
        if len(listings) == 2:
            hidden.rename(entry)
        return DeltaTable(store.table_uri("half"))

    assert relisting(load).version() == 3
    assert len(listings) == 2
    with pytest.raises(DeltaError):  # any other error is not listed again
        relisting(lambda: DeltaTable(store.table_uri("half"), version=99))


def test_a_snapshot_is_loaded_while_another_process_cleans_the_log(tmp_path: Path) -> None:
    """Another process writes checkpoints and cleans the log (retention 0) while this one
    loads snapshots: a checkpoint the listing named can be deleted before it is read. Seen
    in the torture test as a store that failed to open (CORRUPT_STORE, 'checkpoint ... not
    found'); a load lists the log again instead. Before the fix, about 20 of these a second."""
    from rmq_spark.delta.retry import relisting

    uri = str(tmp_path / "t")
    rows = pa.table({"a": [1]})
    settings = {"delta.logRetentionDuration": "interval 0 seconds"}
    write_deltalake(uri, rows, configuration=settings)
    cleaner = textwrap.dedent(
        f"""
        import time
        import pyarrow as pa
        from deltalake import DeltaTable, write_deltalake
        stop = time.monotonic() + 6
        while time.monotonic() < stop:
            write_deltalake({uri!r}, pa.table({{"a": [1]}}), mode="append")
            table = DeltaTable({uri!r})
            table.create_checkpoint()
            table.cleanup_metadata()
        """
    )
    proc = subprocess.Popen([sys.executable, "-c", cleaner], stderr=subprocess.PIPE)
    loads = 0
    try:
        while proc.poll() is None:
            relisting(lambda: DeltaTable(uri)).version()
            loads += 1
    finally:
        proc.wait(timeout=60)
    assert proc.returncode == 0, proc.stderr.read().decode()
    assert loads > 20


def test_a_compaction_changes_no_data_and_keeps_partitions(store: Store) -> None:
    """The CommitLog is partitioned by topic and streamed by Delta's own source: its
    compaction rewrites each topic's files apart, and marks every action ``dataChange``
    false (Delta's streaming source skips them instead of delivering the rows again)."""
    for i in range(6):
        store.send([Message("A", f"a{i}"), Message("B", f"b{i}")], "pg")
    before = commitlog(store)
    assert store.compact("commitlog") == {"commitlog": 12}
    assert commitlog(store).equals(before)
    table = store.table("commitlog")
    assert sorted(store.data_files("commitlog").column("partition.topic").to_pylist()) == [
        "A",
        "B",
    ]
    log = Path(store.table_uri("commitlog")) / "_delta_log"
    changes = []
    for version in (table.version() - 1, table.version()):  # a commit per topic
        lines = (log / f"{version:020d}.json").read_text().splitlines()
        actions = [json.loads(line) for line in lines]
        changes += [a.get("add") or a.get("remove") for a in actions if "add" in a or "remove" in a]
    assert len(changes) == 14 and not any(c["dataChange"] for c in changes)
    assert {c["partitionValues"]["topic"] for c in changes} == {"A", "B"}


def test_a_decision_another_writer_made_since_this_writers_last_look_wins(store: Store) -> None:
    """A writer decides on the ``op`` log as it last found it, without listing the log again:
    another process's decision of the same transaction in between must still win (first
    decision wins), and one of another transaction must not get in the way."""
    other = Store.open(store.root, create=False)  # another process's view of the store
    p, q, r = store.prepare([Message("T", f"m{i}") for i in range(3)], "pg")
    store.end_transactions([Decision(q.transaction_id, "pg", LocalTransactionState.COMMIT)])
    other.end_transactions([Decision(p.transaction_id, "pg", LocalTransactionState.ROLLBACK)])
    other.end_transactions([Decision(r.transaction_id, "pg", LocalTransactionState.COMMIT)])
    (late,) = store.end_transactions(
        [Decision(p.transaction_id, "pg", LocalTransactionState.COMMIT)]
    )
    assert (late.status, late.decision) == (
        EndTransactionStatus.REFUSED,
        LocalTransactionState.ROLLBACK,
    )
    (again,) = store.end_transactions(
        [Decision(r.transaction_id, "pg", LocalTransactionState.ROLLBACK)]
    )
    assert again.status is EndTransactionStatus.REFUSED
    assert sorted(store.read("commitlog").column("transaction_id").to_pylist()) == sorted(
        [q.transaction_id, r.transaction_id]
    )


def test_a_thread_s_own_decisions_are_counted_as_commits_come_and_go() -> None:
    """What a thread's own ``op`` commits recorded is counted, not rebuilt for each decision:
    an arbiter two kept commits recorded stays recorded when the snapshot takes the first."""
    own = OwnDecisions()
    a, b = "tx-a", "tx-b"
    own.add(11, 10, [a])
    own.add(12, 10, [a, b])  # the same arbiters, recorded again at the same version
    arbiters = {(decision_app_id(a), 10), (decision_app_id(b), 10)}
    assert own.recorded(arbiters) and own.decided([a]) and own.decided([b])
    own.since(11)
    assert own.recorded(arbiters) and own.decided([a])
    assert [c[0] for c in own.commits] == [12]
    own.since(12)
    assert not own.recorded({(decision_app_id(a), 10)}) and not own.decided([a, b])
    assert own.recorded(set()) and own.commits == []


def test_the_compactions_after_checkpoints_rewrite_each_row_a_few_times(store: Store) -> None:
    """The compaction after each checkpoint rewrote every file under the target size: a table
    that adds a file a commit had its one growing file read and written again every interval,
    and one sender's compactions read 17 rows a message over its first 3,000 messages, more
    with every message. Tiered, a row is only rewritten into a file at least half as large
    again; ``Store.compact()`` still rewrites every small file."""
    store = committing(store)
    rewritten = sends = 0
    for _ in range(40):
        for _ in range(10):
            decide(store, store.prepare([Message("Orders", b"x" * 256)], "pg"), COMMIT)
            sends += 1
        before = set(store.data_files("half").column("path").to_pylist())
        compact_table(store._tables, "half", tiered=True)
        files = store.data_files("half").to_pylist()
        rewritten += sum(f["num_records"] for f in files if f["path"] not in before)
        # Nothing new: a no-op, not an error (which would skip the log cleanup after it).
        assert compact_table(store._tables, "half", tiered=True)["numFilesRemoved"] == 0
    assert store.read("half").num_rows == sends
    assert rewritten <= 6 * sends, rewritten  # every small file each time: 20 a row
    assert len(files) <= 8, [f["size_bytes"] for f in files]
    assert store.compact("half") == {"half": len(files)}
    assert store.data_files("half").num_rows == 1


def test_the_maintenance_after_a_checkpoint_of_a_topic_with_one_file_does_not_fail(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A topic of the CommitLog with one small file has nothing to rewrite by size tiers: the
    compaction after a checkpoint failed on it (an empty selection), and with it the
    maintenance, every interval."""
    store.send([Message("Lone", b"x")], "pg")
    for i in range(4):
        store.send([Message("Busy", f"m{i}")], "pg")
    with caplog.at_level(logging.WARNING, logger="rmq_spark"):
        for name in ("commitlog", "half", "op"):
            store._maintenance._maintain(name)
    assert "failed" not in caplog.text
    topics = store.data_files("commitlog").column("partition.topic").to_pylist()
    assert sorted(topics) == ["Busy", "Lone"]
