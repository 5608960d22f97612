"""The store among other Delta writers (issue 29): a user's deltalake or delta-spark commits on
the store's tables, a stalled process, and the log cleanup must never lose or resurrect a
message silently."""

from __future__ import annotations

import json
import logging
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable, write_deltalake

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.discards import DECIDED_BY_CHECK_MAX, insert_discards, redrive
from rmq_spark.delta.txnlog import checkpoint_guess
from rmq_spark.model.config import RetentionSettings
from rmq_spark.model.errors import CorruptStoreError, DataLossError
from rmq_spark.model.messages import shard_transaction_id
from rmq_spark.model.schema import CHECK_STATE_SCHEMA, CHECKPOINT_INTERVAL, COMMITLOG_SCHEMA
from rmq_spark.spark.offsets import latest_offsets
from rmq_spark.spark.reading import TASK_ROWS, plan_slices, read_slice
from rmq_spark.store.reads import once
from rmq_spark.store.retention import maintain
from tests.conftest import Clock, commitlog, foreign_compaction_after_the_stores

COMMIT = LocalTransactionState.COMMIT


def test_the_checkpoint_guess_is_the_multiple_of_the_interval_at_or_before() -> None:
    """Checkpoints are written at versions that are multiples of the interval; the guess was
    one version short of it (19 for 20), so every lookup listed the whole log."""
    assert [checkpoint_guess(v, 10) for v in (9, 10, 15, 19, 20, 21)] == [0, 10, 10, 10, 20, 20]
    assert checkpoint_guess(100, 100) == 100


def _commit_each(store: Store, n: int, topic: str = "T") -> list[str]:
    """``n`` transactions, each prepared and committed on its own (a commit of op each)."""
    ids = []
    for i in range(n):
        (p,) = store.prepare([Message(topic, f"m{i}")], "pg")
        store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
        ids.append(p.transaction_id)
    return ids


def test_a_restore_of_op_to_before_a_compaction_publishes_nothing_again(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """RESTORE re-adds the files a compaction replaced, with dataChange true; the change data
    feed reports their rows as inserts, and the publisher copied every committed transaction
    into the CommitLog again with new offsets. Only decisions the store wrote are published;
    the foreign commit is reported, not applied."""
    committed = _commit_each(store, CHECKPOINT_INTERVAL + 5)
    op = DeltaTable(store.table_uri("op"))
    compaction = next(h["version"] for h in op.history() if h["operation"] == "OPTIMIZE")
    op.restore(compaction - 1)
    with caplog.at_level(logging.WARNING, logger="rmq_spark"):
        (p,) = store.prepare([Message("T", b"after")], "pg")
        store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
    ids = commitlog(store).column("transaction_id").to_pylist()
    assert sorted(ids) == sorted([*committed, p.transaction_id])
    assert "RESTORE" in caplog.text and "not written by rmq-spark" in caplog.text


@pytest.mark.parametrize("foreign", ["restore", "delete"])
def test_a_transaction_decided_again_after_its_decision_was_removed_is_not_published_twice(
    store: Store, foreign: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A RESTORE or DELETE of op removes decisions of published transactions; a producer that
    ends one again (a retried end_transaction, a late end after check-back decided) found no
    decision, and the publisher copied its messages into the CommitLog a second time."""
    first, second = _commit_each(store, 2)
    op = DeltaTable(store.table_uri("op"))
    if foreign == "restore":
        op.restore(op.version() - 1)
    else:
        op.delete(f"transaction_id = '{second}'")
    with caplog.at_level(logging.ERROR, logger="rmq_spark"):
        store.end_transactions([Decision(second, "pg", COMMIT)])
        (p,) = store.prepare([Message("T", b"after")], "pg")
        store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
    ids = commitlog(store).column("transaction_id").to_pylist()
    assert sorted(ids) == sorted([first, second, p.transaction_id])
    assert "not published twice" in caplog.text


def _sent(store: Store, batches: int = 4, per_batch: int = 20) -> None:
    for b in range(batches):
        store.send([Message("T", f"b{b}-{i}", keys=str(i)) for i in range(per_batch)], "pg")


@pytest.mark.parametrize("foreign", ["delete", "restore"])
def test_published_rows_removed_by_another_writer_are_reported_as_data_loss(
    store: Store, foreign: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's DELETE on the CommitLog, or a RESTORE to an earlier version, removes published
    messages while the queues' offsets stay where they were: the read returned ranges with
    holes and failOnDataLoss never fired. The read plan checks that every offset it is to
    read is stored, and names the missing ranges."""
    _sent(store)
    table = DeltaTable(store.table_uri("commitlog"))
    if foreign == "delete":
        table.delete("queue_offset = 3")
    else:
        table.restore(table.version() - 2)  # the last two publishes' messages go
    end = latest_offsets(store, ["T"])
    with pytest.raises(DataLossError, match=r"T queue \d+ offsets \[\d+, \d+\)"):
        plan_slices(store, {}, end)
    with caplog.at_level(logging.WARNING, logger="rmq_spark"):
        slices = plan_slices(store, {}, end, fail_on_data_loss=False)
    assert "missing" in caplog.text and slices
    read = pa.concat_tables(pa.Table.from_batches(list(read_slice(s))) for s in slices)
    assert read.num_rows == commitlog(store).num_rows < 80


def _read(slices: list) -> pa.Table:
    return pa.concat_tables(
        pa.Table.from_batches(list(read_slice(s)), COMMITLOG_SCHEMA) for s in slices
    )


def test_published_messages_another_writer_stored_twice_are_read_once(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A deltalake ``optimize.compact()`` of the CommitLog that races rmq-spark's compaction of
    the same files lands beside it (deltalake lets a commit go on when the files it removes a
    ``dataChange=false`` commit removed first), and the CommitLog then holds those messages
    twice (the suite's torture run, seed 5). Every read failed with CORRUPT_STORE, and a hole
    beside a copy (as many rows as offsets) was not seen at all. A message is read once, in
    one task, wherever its copies are; a hole is still data loss; two different messages at
    one offset are still a corrupt store."""
    _sent(store, batches=2)
    uri = store.table_uri("commitlog")
    published = commitlog(store)
    queue = published.column("queue_id")[0].as_py()
    second = published.filter(
        pc.and_(pc.equal(published["queue_id"], queue), pc.equal(published["queue_offset"], 1))
    )
    write_deltalake(uri, second, mode="append", partition_by=["topic"])
    DeltaTable(uri).delete(f"queue_id = {queue} AND queue_offset = 0")
    end = latest_offsets(store, ["T"])
    with pytest.raises(DataLossError, match=rf"T queue {queue} offsets \[0, 1\)"):
        plan_slices(store, {}, end)
    lost = published.filter(
        pc.invert(
            pc.and_(pc.equal(published["queue_id"], queue), pc.equal(published["queue_offset"], 0))
        )
    )
    write_deltalake(uri, lost, mode="append", partition_by=["topic"])  # every message again
    with caplog.at_level(logging.WARNING, logger="rmq_spark"):
        for task_rows in (TASK_ROWS, 1):  # one task, and a task for each file
            read = _read(plan_slices(store, {}, end, fail_on_data_loss=False, task_rows=task_rows))
            assert sorted(read.column("msg_id").to_pylist()) == sorted(
                lost.column("msg_id").to_pylist()
            )
    assert "copies of published messages in T queue" in caplog.text
    other = second.set_column(
        second.schema.get_field_index("msg_id"), "msg_id", pa.array(["F" * 32], pa.string())
    )
    write_deltalake(uri, other, mode="append", partition_by=["topic"])
    with pytest.raises(
        CorruptStoreError, match=rf"different messages at offset 1 of T queue {queue}"
    ):
        plan_slices(store, {}, end, fail_on_data_loss=False)


def test_a_read_of_a_dense_commitlog_is_planned_as_before(store: Store) -> None:
    _sent(store)
    end = latest_offsets(store, ["T"])
    start = {"T": {q: 1 for q in end["T"]}}
    slices = plan_slices(store, start, end)
    assert _read(slices).num_rows == 80 - len(end["T"])


def _rolled_back_at_check_max(store: Store, *, object_decided: bool = False) -> tuple[str, int]:
    """A transaction rolled back at the check max (its ROLLBACK in op, its messages in
    discard is the caller's choice), and the op version before its ROLLBACK. By default one
    of an older release (decided in op alone, no decision object)."""
    t = shard_transaction_id(0, object_decided=object_decided)
    (p,) = store.prepare([Message("T", b"maxed", keys="k")], "pg", transaction_ids=[t])
    before = DeltaTable(store.table_uri("op")).version()
    store.end_transactions(
        [Decision(p.transaction_id, "pg", LocalTransactionState.ROLLBACK, DECIDED_BY_CHECK_MAX)]
    )
    return p.transaction_id, before


def test_a_late_commit_after_a_restore_removed_a_check_max_rollback_is_not_published(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Torture, seed 5: check-back rolled a transaction back at the check max and listed it in
    discard, a RESTORE of op removed the ROLLBACK, and a late COMMIT (a round that had read
    the transaction as pending before, or the producer's late end) found no decision: it was
    published, and published again when the discard was re-driven. A transaction in discard
    is never published under its own id; its messages come back only through the re-drive."""
    maxed, before = _rolled_back_at_check_max(store)
    insert_discards(store, [maxed], store.clock(), 3)
    DeltaTable(store.table_uri("op")).restore(before)
    with caplog.at_level(logging.ERROR, logger="rmq_spark"):
        store.end_transactions([Decision(maxed, "pg", COMMIT)])
    assert maxed not in commitlog(store).column("transaction_id").to_pylist()
    assert "in discard" in caplog.text
    (again,) = redrive(store)
    store.end_transactions([Decision(again, "pg", COMMIT)])
    assert commitlog(store).column("body").to_pylist() == [b"maxed"]


def test_a_late_commit_after_a_restore_is_refused_by_the_decision_object(store: Store) -> None:
    """The same RESTORE with a transaction of this release: its decision object still holds the
    check max's ROLLBACK, so the late COMMIT is refused and op records the ROLLBACK again."""
    maxed, before = _rolled_back_at_check_max(store, object_decided=True)
    insert_discards(store, [maxed], store.clock(), 3)
    DeltaTable(store.table_uri("op")).restore(before)
    (late,) = store.end_transactions([Decision(maxed, "pg", COMMIT)])
    assert (late.status.value, late.decision) == ("REFUSED", LocalTransactionState.ROLLBACK)
    assert store.decisions([maxed]) == {maxed: LocalTransactionState.ROLLBACK}
    assert maxed not in commitlog(store).column("transaction_id").to_pylist()
    (again,) = redrive(store)
    store.end_transactions([Decision(again, "pg", COMMIT)])
    assert commitlog(store).column("body").to_pylist() == [b"maxed"]


def test_a_discard_published_under_its_own_id_is_not_re_driven(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The same race, the other way round: the late COMMIT was published before check-back
    wrote the discard rows, so the re-drive would publish the message a second time. The
    re-drive leaves it, marked as re-driven as itself, and says why."""
    maxed, before = _rolled_back_at_check_max(store)
    DeltaTable(store.table_uri("op")).restore(before)
    store.end_transactions([Decision(maxed, "pg", COMMIT)])
    insert_discards(store, [maxed], store.clock(), 3)
    with caplog.at_level(logging.ERROR, logger="rmq_spark"):
        assert redrive(store) == []
    assert "published already" in caplog.text
    assert store.read("discard").column("redriven_transaction_id").to_pylist() == [maxed]
    assert redrive(store) == []
    store.publish()
    assert commitlog(store).column("body").to_pylist() == [b"maxed"]


@pytest.mark.parametrize("then", ["staged", "published"])
def test_a_restore_of_discard_to_before_a_re_drive_re_drives_nothing_twice(
    store: Store, then: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A RESTORE of ``discard`` to before a re-drive's claim (an operator undoing a resume)
    makes the row read as not re-driven. The next re-drive looked for the message under its
    first transaction id only, found nothing, and staged it again: the checker that committed
    the first re-drive committed the second, and the message was published twice (review).
    The re-drive finds the earlier re-drive's message, staged or published, marks the row as
    re-driven by it again, and says why."""
    maxed, _ = _rolled_back_at_check_max(store)
    insert_discards(store, [maxed], store.clock(), 3)
    before_claim = DeltaTable(store.table_uri("discard")).version()
    (first,) = redrive(store)
    if then == "published":
        store.end_transactions([Decision(first, "pg", COMMIT)])
    DeltaTable(store.table_uri("discard")).restore(before_claim)
    if then == "published":  # and its half message removed by retention since: the CommitLog
        later = Store.open(store.root, clock=Clock(datetime.now(UTC) + timedelta(hours=2)))
        removed = maintain(later, RetentionSettings(transaction_reserved_time=3600.0))
        assert (removed.half_removed, removed.messages_expired) == (2, 0)
    assert store.read("discard").column("redriven_transaction_id").to_pylist() == [None]
    with caplog.at_level(logging.ERROR, logger="rmq_spark"):
        assert redrive(store) == []
    assert "re-driven before" in caplog.text
    assert store.read("discard").column("redriven_transaction_id").to_pylist() == [first]
    if then == "staged":
        store.end_transactions([Decision(first, "pg", COMMIT)])
    assert redrive(store) == []
    store.publish()
    assert commitlog(store).column("body").to_pylist() == [b"maxed"]


def test_a_transaction_decided_since_the_round_read_it_is_not_reported_as_removed(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """Torture, seed 5: a round read a transaction as pending, then its producer committed it
    and the publisher published it before the round looked it up in the CommitLog. Nothing was
    removed, but the round logged an ERROR that another Delta writer had removed decisions."""
    from collections import Counter
    from datetime import UTC, datetime

    from rmq_spark.checkback.decisions import recover_removed

    (p,) = store.prepare([Message("T", b"m")], "pg")
    due = pa.Table.from_pylist(
        [
            {
                "transaction_id": p.transaction_id,
                "producer_group": "pg",
                "first_seen": datetime.now(UTC),
                "check_count": 0,
            }
        ]
    )
    store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
    counts: Counter[str] = Counter()
    with caplog.at_level(logging.ERROR, logger="rmq_spark"):
        assert recover_removed(store, due, counts) == {p.transaction_id}
    assert counts["already_decided"] == 1
    assert "removed their decisions" not in caplog.text


def _two_small_files(store: Store, table: str) -> None:
    """Rows of ``table`` in two small files, as the store writes them."""
    if table == "commitlog":
        _sent(store, batches=2)
        return
    for batch in range(2):
        prepared = store.prepare([Message("T", f"{batch}-{i}") for i in range(3)], "pg")
        ids = [p.transaction_id for p in prepared]
        if table == "op":
            store.end_transactions([Decision(t, "pg", COMMIT) for t in ids])
        elif table == "discard":
            insert_discards(store, ids, datetime.now(UTC), 3)
        elif table == "check_state":
            now = datetime.now(UTC)
            rows = [
                {"transaction_id": t, "producer_group": "pg", "first_seen": now, "check_count": 1}
                for t in ids
            ]
            store.append(table, pa.Table.from_pylist(rows, CHECK_STATE_SCHEMA))


def _stored(store: Store, table: str) -> list[dict]:
    """Every row of ``table`` as stored (copies included), in a stable order."""
    rows = DeltaTable(store.table_uri(table)).to_pyarrow_table().to_pylist()
    return sorted(rows, key=repr)


@pytest.mark.parametrize("tiered", [False, True], ids=["compact", "after-checkpoint"])
@pytest.mark.parametrize("table", ["half", "op", "commitlog", "check_state", "discard"])
def test_the_stores_next_compaction_keeps_each_row_another_writer_stored_twice_once(
    store: Store, table: str, tiered: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """Copies a foreign compaction stored beside rmq-spark's stayed for good: every read that
    met them warned again, and the CommitLog's reads re-read the ranges that held them. The
    store's next compaction of the files that hold them keeps each row once, and says so: a
    ``Store.compact()``, and the one after a checkpoint, which leaves out a file only when it
    holds more than twice the rows of the smaller ones (copies hold as many)."""
    _two_small_files(store, table)
    before = _stored(store, table)
    foreign_compaction_after_the_stores(store, table)
    assert len(_stored(store, table)) == 2 * len(before)
    with caplog.at_level(logging.WARNING, logger="rmq_spark"):
        store._maintenance.compact(table, tiered=tiered)
    assert _stored(store, table) == before
    assert f"compaction of {table} kept {len(before)} row(s) once" in caplog.text


def test_the_stores_compaction_keeps_two_different_messages_at_one_offset(store: Store) -> None:
    """Only copies are dropped: a different message another writer added at a published
    offset stays, and reads still refuse the corrupt queue."""
    _sent(store, batches=2)
    uri = store.table_uri("commitlog")
    published = commitlog(store)
    first = published.slice(0, 1)
    other = first.set_column(
        first.schema.get_field_index("msg_id"), "msg_id", pa.array(["F" * 32], pa.string())
    )
    write_deltalake(uri, other, mode="append", partition_by=["topic"])
    store.compact("commitlog")
    assert DeltaTable(uri).to_pyarrow_table().num_rows == published.num_rows + 1
    with pytest.raises(CorruptStoreError, match="different messages at offset 0"):
        plan_slices(store, {}, latest_offsets(store, ["T"]), fail_on_data_loss=False)


@pytest.mark.parametrize("then", ["read", "compacted", "compacted, its clock behind"])
def test_a_discard_claimed_before_a_foreign_compaction_landed_is_not_re_driven_again(
    store: Store, then: str
) -> None:
    """A deltalake ``optimize.compact()`` that read ``discard`` before rmq-spark's compaction
    and commits after a re-drive claimed the rows (a MERGE) lands beside them with the rows as
    they were before the claim. Reads and the store's compaction kept the first row of a key,
    the stale one as often as not (by file order, or by the file time of a writer whose clock
    runs behind): the next re-drive claimed the messages again, re-driving each twice. The
    claimed row is the one in force."""
    for batch in range(2):
        prepared = store.prepare([Message("T", f"{batch}-{i}") for i in range(3)], "pg")
        insert_discards(store, [p.transaction_id for p in prepared], datetime.now(UTC), 3)
    uri = store.table_uri("discard")
    stale = DeltaTable(uri)
    assert store.compact("discard")["discard"] == 2
    assert len(redrive(store)) == 6
    stale.optimize.compact()
    assert DeltaTable(uri).to_pyarrow_table().column("redriven_transaction_id").null_count == 6
    if then == "compacted, its clock behind":  # the foreign file's time, before the claim's
        entry = Path(uri) / "_delta_log" / f"{DeltaTable(uri).version():020}.json"
        actions = [json.loads(line) for line in entry.read_text().splitlines()]
        for action in actions:
            if "add" in action:
                action["add"]["modificationTime"] = 1000
        entry.write_text("\n".join(json.dumps(a) for a in actions) + "\n")
    if then != "read":
        store.compact("discard")
        assert DeltaTable(uri).to_pyarrow_table().column("redriven_transaction_id").null_count == 0
    assert redrive(store) == []
    copies = Counter(DeltaTable(store.table_uri("half")).to_pyarrow_table()["msg_id"].to_pylist())
    assert set(copies.values()) == {2}  # each message: its transaction and one re-drive


def test_of_copies_of_a_check_state_row_the_one_checked_most_is_in_force() -> None:
    """A stale copy of a check-back state (from before a round's MERGE) counts fewer checks:
    it loses, whichever file it is in; rows keep their order."""
    now = datetime.now(UTC)
    rows = pa.Table.from_pylist(
        [
            {"transaction_id": "a", "producer_group": "pg", "first_seen": now, "check_count": 1},
            {"transaction_id": "b", "producer_group": "pg", "first_seen": now, "check_count": 1},
            {"transaction_id": "a", "producer_group": "pg", "first_seen": now, "check_count": 3},
        ],
        CHECK_STATE_SCHEMA,
    )
    read = ["transaction_id", "first_seen", "check_count"]  # what a check-back round reads
    for table in (rows, rows.select(read)):
        kept = once(table, "check_state").select(["transaction_id", "check_count"])
        assert kept.to_pydict() == {"transaction_id": ["b", "a"], "check_count": [1, 3]}
