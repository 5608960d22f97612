"""Retention (``rmqtx maintain``) on real Delta tables: what it removes, what it never removes,
and that a killed or doubled run loses and duplicates nothing."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.parse import unquote

import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.discards import redrive
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import RetentionSettings, Settings, StoreSettings
from rmq_spark.spark.offsets import earliest_offsets, latest_offsets
from rmq_spark.store.decisions import EndTransactionStatus
from rmq_spark.store.landing import LATE_END_SECONDS
from rmq_spark.store.retention import maintain
from tests.conftest import Clock, commitlog, race

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK
CHECK_MAX = "check-back:check-max"
NOT_FOUND, APPLIED = EndTransactionStatus.NOT_FOUND, EndTransactionStatus.APPLIED
REPO = Path(__file__).resolve().parents[2]
T0 = datetime(2026, 1, 1, tzinfo=UTC)
LATER = T0 + timedelta(hours=73)  # past the default 72 h retentions
KEEP_FILES = RetentionSettings(deleted_file_retention=0)


@pytest.fixture
def clock() -> Clock:
    return Clock(T0)


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Store:
    return Store.open(tmp_path / "store", settings=StoreSettings(intake=False), clock=clock)


def send(store: Store, topic: str, n: int, keys: str = "k") -> None:
    store.send([Message(topic, f"{topic}-{i}".encode(), keys=keys) for i in range(n)], "pg")


def offsets_by_queue(store: Store) -> dict[tuple[str, int], list[int]]:
    rows = commitlog(store).select(["topic", "queue_id", "queue_offset"]).to_pylist()
    found: dict[tuple[str, int], list[int]] = {}
    for r in rows:
        found.setdefault((r["topic"], r["queue_id"]), []).append(r["queue_offset"])
    return found


def assert_dense_from_earliest(store: Store, topics: list[str]) -> None:
    earliest, latest = earliest_offsets(store, topics), latest_offsets(store, topics)
    for (topic, queue), offsets in offsets_by_queue(store).items():
        first = earliest[topic].get(queue, 0)
        assert offsets == list(range(first, latest[topic][queue])), (topic, queue)


def test_expired_messages_leave_and_each_queue_stays_dense(store: Store, clock: Clock) -> None:
    send(store, "Old", 5)
    send(store, "Mixed", 3, keys="a")
    clock.now = T0 + timedelta(hours=10)
    send(store, "Mixed", 2, keys="a")
    clock.now = LATER
    summary = maintain(store, KEEP_FILES)
    latest = latest_offsets(store, ["Old", "Mixed"])
    (old,), (mixed,) = latest["Old"], latest["Mixed"]
    assert earliest_offsets(store, ["Old", "Mixed"]) == {"Old": {old: 5}, "Mixed": {mixed: 3}}
    assert commitlog(store).column("body").to_pylist() == [b"Mixed-0", b"Mixed-1"]
    assert (summary.messages_expired, summary.queues_advanced) == (8, 2)
    assert_dense_from_earliest(store, ["Old", "Mixed"])
    send(store, "Old", 2)  # a queue emptied by retention goes on from its next offset
    assert offsets_by_queue(store)[("Old", old)] == [5, 6]
    assert maintain(store, KEEP_FILES).messages_expired == 0  # nothing more is old enough


def test_a_message_stored_by_a_slow_clock_leaves_no_hole(store: Store, clock: Clock) -> None:
    """Publishers' clocks differ: an old timestamp above a young one in the same queue stays
    until the young one expires too, so the queue never has a hole."""
    clock.now = T0 + timedelta(hours=50)
    send(store, "Orders", 1)
    clock.now = T0  # a publisher whose clock is 50 h behind
    send(store, "Orders", 1)
    clock.now = LATER
    maintain(store, KEEP_FILES)
    ((queue, offsets),) = offsets_by_queue(store).items()
    assert offsets == [0, 1]
    clock.now = LATER + timedelta(hours=50)
    maintain(store, KEEP_FILES)
    assert offsets_by_queue(store) == {}
    assert earliest_offsets(store, ["Orders"]) == {"Orders": {queue[1]: 2}}


def decide(store: Store, txns: list[str], state, decided_by="producer", publish=True) -> None:
    store.end_transactions([Decision(t, "pg", state, decided_by) for t in txns], publish=publish)


def history(store: Store) -> dict[str, str]:
    """One transaction of each kind retention must tell apart, all decided (or not) at T0."""
    names = ["committed", "rolled_back", "undecided", "maxed", "maxed_redriven", "maxed_bare"]
    names.append("unpublished")
    prepared = store.prepare([Message("Orders", n.encode()) for n in names], "pg")
    ids = {n: p.transaction_id for n, p in zip(names, prepared, strict=True)}
    decide(store, [ids["committed"]], COMMIT)
    decide(store, [ids["rolled_back"]], ROLLBACK)
    decide(store, [ids[n] for n in ("maxed", "maxed_redriven", "maxed_bare")], ROLLBACK, CHECK_MAX)
    # The check-back job records the discards of two; its write for the third was cut off.
    job = CheckBackJob(None, store, {})
    job._insert_discards([ids["maxed"], ids["maxed_redriven"]], store.clock())
    (ids["redriven"],) = redrive(store, [ids["maxed_redriven"]])
    decide(store, [ids["redriven"]], COMMIT)
    decide(store, [ids["unpublished"]], COMMIT, publish=False)
    return ids


def remaining(store: Store, table: str) -> set[str]:
    return set(store.read(table).column("transaction_id").to_pylist())


def test_only_decided_published_transactions_leave(store: Store, clock: Clock) -> None:
    ids = history(store)
    visible = commitlog(store).num_rows
    clock.now = LATER
    summary = maintain(store, RetentionSettings(file_reserved_time=10 * 86400))
    name = {v: k for k, v in ids.items()}
    # Discards and re-driven transactions stay (see the last test).
    kept = {"undecided", "maxed_bare", "unpublished", "redriven"}
    assert {name[t] for t in remaining(store, "half")} == kept
    assert {name[t] for t in remaining(store, "op")} == kept - {"undecided"}
    assert {name[t] for t in remaining(store, "discard")} == {"maxed", "maxed_redriven"}
    expired = {"committed", "rolled_back", "maxed", "maxed_redriven"}
    assert summary.transactions_expired == len(expired)
    assert (summary.half_removed, summary.op_removed) == (4, 4)
    # Their decision objects go with them; the others' stay (a re-drive's id is decided in op).
    objects = store.object_decisions(list(ids.values()))
    assert {name[t] for t in objects} == kept - {"undecided", "redriven"}
    assert commitlog(store).num_rows == visible  # messages follow file_reserved_time only
    # Nothing comes back: only the discard never re-driven is re-driven, and once.
    again = redrive(store)
    assert store.half_messages(again).column("body").to_pylist() == [b"maxed"]
    decide(store, [ids["rolled_back"]], COMMIT)  # a late opposite decision publishes nothing
    bodies = commitlog(store).column("body").to_pylist()
    assert sorted(bodies) == [b"committed", b"maxed_redriven", b"unpublished"]


def test_a_late_decision_after_retention_is_not_found(store: Store, clock: Clock) -> None:
    """Retention removed a decided transaction; a decider that did not send it (another process,
    or this one restarted) ends it again, the other way: ``NOT_FOUND``, nothing recorded, so
    ``op`` never says the published transaction was rolled back."""
    ids = history(store)
    clock.now = LATER
    maintain(store, KEEP_FILES)
    late = Store.open(store.root, create=False, clock=clock)
    op_before = store.read("op").num_rows
    results = late.end_transactions(
        [Decision(ids["committed"], "pg", ROLLBACK), Decision(ids["undecided"], "pg", COMMIT)]
    )
    assert [r.status for r in results] == [NOT_FOUND, APPLIED]
    assert store.read("op").num_rows == op_before + 1
    assert ids["committed"] not in remaining(store, "op")
    assert store.object_decisions([ids["committed"]]) == {}


LATE_END = """
import os, sys
from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer
from tests.unit.test_producer import ScriptedListener
with TransactionMQProducer("pg", ScriptedListener(), store=Store.open(sys.argv[1])) as producer:
    sent = producer.send_message_in_transaction(Message("Orders", b"x"), None)  # UNKNOWN
    print(sent.transaction_id, flush=True)
    os.environ["RMQ_SPARK_FAILPOINT"] = "decision.end:stop"
    ended = producer.end_transaction(sent, LocalTransactionState.ROLLBACK)  # at once
    print(ended.status.value, flush=True)
"""


def test_a_sender_stopped_past_retention_ends_its_own_transaction_not_found(
    store: Store, clock: Clock, tmp_path: Path
) -> None:
    """A producer's local transaction answers UNKNOWN; the producer ends it at once, and stops
    (SIGSTOP) as it takes the request. Check-back commits the transaction, it is published, and
    retention removes it. Resumed, the end is ``NOT_FOUND``: the stop counts as time since
    the send, so the producer looks for its half message, and ``op`` holds no ROLLBACK of a
    published message."""
    marker = tmp_path / "stopped.pid"
    proc = subprocess.Popen(
        [sys.executable, "-c", LATE_END, store.root],
        cwd=REPO,
        stdout=subprocess.PIPE,
        env={**os.environ, "RMQ_SPARK_FAILPOINT_MARKER": str(marker)},
    )
    try:
        tid = proc.stdout.readline().decode().strip()
        while not marker.exists() or not marker.read_text().strip():
            assert proc.poll() is None
            time.sleep(0.05)
        stopped = time.monotonic()
        decide(store, [tid], COMMIT, "check-back:checker")
        assert commitlog(store).column("body").to_pylist() == [b"x"]
        clock.now = LATER
        assert maintain(store, KEEP_FILES).half_removed == 1
        time.sleep(max(0.0, stopped + 2 * LATE_END_SECONDS - time.monotonic()))
        os.kill(proc.pid, signal.SIGCONT)
        assert proc.stdout.readline().decode().strip() == "NOT_FOUND"
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert tid not in remaining(store, "op") and store.object_decisions([tid]) == {}


MAINTAIN = (
    "import sys; from datetime import datetime; from rmq_spark import Store; "
    "from rmq_spark.store.retention import maintain; "
    "now = datetime.fromisoformat(sys.argv[2]); "
    "print(maintain(Store.open(sys.argv[1], create=False, clock=lambda: now)).format())"
)


@pytest.mark.parametrize("failpoint", ["maintain.commitlog", "maintain.half"])
def test_a_killed_run_is_finished_by_the_next(store: Store, clock: Clock, failpoint: str) -> None:
    send(store, "Orders", 3)
    ids = history(store)
    clock.now = LATER
    child = subprocess.run(
        [sys.executable, "-c", MAINTAIN, store.root, LATER.isoformat()],
        env={**os.environ, "RMQ_SPARK_FAILPOINT": failpoint},
        cwd=REPO,
        start_new_session=True,  # the failpoint kills the child's whole session
        timeout=300,
    )
    assert child.returncode == -signal.SIGKILL
    # The killed run's lock is still held: a run before it expires does nothing.
    assert maintain(store).skipped
    clock.now = LATER + timedelta(hours=2)
    summary = maintain(store)
    assert summary.skipped is None
    kept = {"undecided", "maxed_bare", "unpublished", "redriven"}
    assert {k for k, v in ids.items() if v in remaining(store, "half")} == kept
    assert {k for k, v in ids.items() if v in remaining(store, "op")} == kept - {"undecided"}
    assert {k for k, v in ids.items() if v in remaining(store, "discard")} == {
        "maxed",
        "maxed_redriven",
    }
    assert commitlog(store).num_rows == 0
    assert_dense_from_earliest(store, ["Orders"])
    assert store.half_messages(redrive(store)).column("body").to_pylist() == [b"maxed"]


def _maintain(root: str, now: str, barrier, out) -> None:
    store = Store.open(root, create=False, clock=lambda: datetime.fromisoformat(now))
    barrier.wait(timeout=120)
    summary = maintain(store, KEEP_FILES)
    out.put((summary.run_id, summary))


def test_two_runs_at_once_remove_everything_once(store: Store, clock: Clock) -> None:
    send(store, "Orders", 4)
    history(store)
    runs = race(_maintain, [(store.root, LATER.isoformat()), (store.root, LATER.isoformat())])
    done = [s for s in runs.values() if s.skipped is None]
    assert len(done) >= 1
    assert sum(s.messages_expired for s in done) == 4 + 2  # the sends and 2 committed
    assert sum(s.transactions_expired for s in done) >= 4
    assert sum(s.half_removed for s in done) == 4
    assert commitlog(store).num_rows == 0


def test_vacuum_leaves_only_the_files_the_rows_need(store: Store, clock: Clock) -> None:
    for _ in range(6):
        send(store, "Orders", 20)
    clock.now = LATER
    send(store, "Orders", 5)
    summary = maintain(store, KEEP_FILES)
    assert summary.files_vacuumed["commitlog"] > 0
    table = Path(store.table_uri("commitlog"))
    on_disk = sum(
        f.stat().st_size
        for f in table.rglob("*.parquet")
        if "_delta_log" not in f.parts and "_change_data" not in f.parts
    )
    assert on_disk == summary.live_bytes["commitlog"]
    assert [r["body"] for r in commitlog(store).to_pylist()] == [
        f"Orders-{i}".encode() for i in range(5)
    ]


def test_a_redrive_reading_discard_before_a_run_stages_nothing_twice(
    store: Store, clock: Clock
) -> None:
    """Found by the torture test: a re-drive read ``discard`` (a row claimed for a new
    transaction), then retention removed that transaction's half and op rows, then the
    re-drive looked for them, found nothing, and staged the message again: published twice.
    Retention keeps re-driven transactions and discard rows, so what a re-drive reads stays."""
    from rmq_spark.checkback.discards import _claimed_unstaged, _stage_redriven

    ids = history(store)
    stale = store.read("discard")  # what a running re-drive has read
    clock.now = LATER
    maintain(store, RetentionSettings(file_reserved_time=10 * 86400))
    assert _stage_redriven(store, _claimed_unstaged(store, stale)) == set()
    decide(store, [ids["redriven"]], COMMIT)
    bodies = commitlog(store).column("body").to_pylist()
    assert sorted(bodies) == [b"committed", b"maxed_redriven", b"unpublished"]


def test_a_sub_hour_file_retention_is_rounded_up_not_down(store: Store, clock: Clock) -> None:
    """deltalake's VACUUM takes whole hours: 30 minutes was rounded down to RETAIN 0 HOURS, and
    the files a read planned a moment before still needed were deleted under it."""
    for _ in range(6):
        send(store, "Orders", 20)
    before = store.table("commitlog").file_uris()
    clock.now = LATER
    send(store, "Orders", 5)
    summary = maintain(store, RetentionSettings(deleted_file_retention=1800))
    assert summary.messages_expired == 120
    assert summary.files_vacuumed["commitlog"] == 0
    assert all(Path(uri).exists() for uri in before)


def _on_disk(store: Store, name: str) -> set[str]:
    table = Path(store.table_uri(name))
    return {
        str(f.relative_to(table))
        for f in table.rglob("*.parquet")
        if not {"_delta_log", "_change_data", "_rmqtx_vacuum"} & set(f.relative_to(table).parts)
    }


def test_files_removed_long_ago_are_vacuumed_after_a_checkpoint_dropped_their_tombstones(
    store: Store,
) -> None:
    """A checkpoint keeps a removed file's tombstone only for the table's retention, and the
    tables checkpoint every 100 commits: by the time a removal was old enough to vacuum, its
    tombstone was gone from the snapshot, and deltalake's VACUUM (which finds what to delete in
    the tombstones) deleted nothing. Every file compaction replaced stayed in storage for good.
    Here the table's retention is a second (an hour, passed) and a checkpoint comes between."""
    for i in range(6):
        store.prepare([Message("Orders", f"o-{i}".encode())], "pg")
    store.table("half").alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "interval 1 seconds"}
    )
    store.compact("half")
    live = {unquote(p) for p in store.data_files("half").column("path").to_pylist()}
    removed = _on_disk(store, "half") - live
    assert len(removed) >= 6
    maintain(store, RetentionSettings())  # seen while the tombstones are young: kept
    assert removed <= _on_disk(store, "half")
    time.sleep(2.5)  # the second, and the step of a second its removals file is named by
    store.table("half").create_checkpoint()  # drops the expired tombstones
    summary = maintain(store, RetentionSettings())
    assert _on_disk(store, "half") == live
    assert summary.files_vacuumed["half"] == len(removed)
    assert sorted(store.read("half").column("body").to_pylist()) == [
        f"o-{i}".encode() for i in range(6)
    ]


def test_an_older_commitlog_keeps_tombstones_for_two_hours_after_maintenance(
    store: Store, clock: Clock
) -> None:
    """The CommitLog kept tombstones for Delta's week (the property was unset), and every
    checkpoint carried a week of compactions; a maintenance run brings an older store's tables
    to two hours once it has written their removals down, and files are still kept for
    ``deleted_file_retention``. A retention an operator set stays."""
    key = "delta.deletedFileRetentionDuration"
    _drop_property(store, "commitlog", key)
    store.table("op").alter.set_table_properties({key: "interval 3 days"})
    assert key not in store.table("commitlog").metadata().configuration
    for _ in range(3):
        send(store, "Orders", 2)
    store.compact("commitlog")
    before = _on_disk(store, "commitlog")
    summary = maintain(store, RetentionSettings())
    assert store.table("commitlog").metadata().configuration[key] == "interval 2 hours"
    assert store.table("op").metadata().configuration[key] == "interval 3 days"
    assert summary.files_vacuumed["commitlog"] == 0
    assert _on_disk(store, "commitlog") == before  # removed a moment ago: kept a week
    written = list(Path(store.table_uri("commitlog"), "_rmqtx_vacuum").glob("*.parquet"))
    assert len(written) >= 1


def _drop_property(store: Store, name: str, key: str) -> None:
    """Make a table as an older store's was: its metadata without ``key`` (a commit of a
    ``metaData`` action, as any Delta writer's)."""
    log = Path(store.table_uri(name), "_delta_log")
    first = (log / f"{0:020d}.json").read_text().splitlines()
    meta = next(json.loads(line) for line in first if '"metaData"' in line)
    meta["metaData"]["configuration"].pop(key, None)
    version = store.table(name).version() + 1
    info = {"commitInfo": {"timestamp": int(time.time() * 1000), "operation": "SET TBLPROPERTIES"}}
    (log / f"{version:020d}.json").write_text(json.dumps(info) + "\n" + json.dumps(meta) + "\n")


def test_a_removals_file_cut_short_is_skipped_and_vacuum_goes_on(store: Store) -> None:
    """A removals file cut short (a copy on a filesystem without atomic renames) made every run
    fail on it, and no table was vacuumed again; it is skipped with a warning."""
    for i in range(3):
        store.prepare([Message("Orders", f"o-{i}".encode())], "pg")
    store.compact("half")
    maintain(store, RetentionSettings())
    folder = Path(store.table_uri("half"), "_rmqtx_vacuum")
    written = list(folder.glob("*.parquet"))  # the compaction's, and the VACUUM's
    cut = folder / f"{0:012d}-{'0' * 32}.parquet"
    cut.write_bytes(written[0].read_bytes()[:20])
    abandoned = folder / f".{0:012d}-{'1' * 32}.parquet.tmp"  # a killed run's copy
    abandoned.write_bytes(written[0].read_bytes()[:20])
    summary = maintain(store, RetentionSettings())
    assert not cut.exists() and not abandoned.exists() and all(w.exists() for w in written)
    assert summary.files_vacuumed["half"] == 0


def test_a_file_a_restore_brought_back_is_not_vacuumed(store: Store) -> None:
    """A RESTORE to before a compaction makes the files it replaced live again: written down
    as removed and due, they stay, and every row is still read."""
    for i in range(4):
        store.prepare([Message("Orders", f"o-{i}".encode())], "pg")
    store.table("half").alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "interval 1 seconds"}
    )
    before = store.table("half").version()
    store.compact("half")
    maintain(store, RetentionSettings())  # writes the removals down
    store.table("half").restore(before)
    time.sleep(2.5)
    summary = maintain(store, RetentionSettings())
    live = {unquote(p) for p in store.data_files("half").column("path").to_pylist()}
    assert live <= _on_disk(store, "half")
    assert summary.files_vacuumed["half"] == 1  # the compacted file, removed by the RESTORE
    assert sorted(store.read("half").column("body").to_pylist()) == [
        f"o-{i}".encode() for i in range(4)
    ]


def test_an_intake_object_left_over_brings_no_transaction_back(
    tmp_path: Path, clock: Clock
) -> None:
    """A producer landed its intake object and failed to delete it: retention removes the
    transaction's rows only once the object is gone, so no later landing brings it back to be
    checked (and committed, and published) again."""
    settings = Settings(store=StoreSettings(intake=True))
    store = Store.open(tmp_path / "store", settings=settings, clock=clock)
    (p,) = store.prepare([Message("Orders", b"x")], "pg")
    intake = store._decisions.intake
    (name,) = intake._listed(0.0, float("inf"))
    data = intake.fs.cat_file(name)
    decide(store, [p.transaction_id], COMMIT)
    intake._put(name, data)  # as if its deletion had failed
    clock.now = LATER
    assert maintain(store, RetentionSettings(file_reserved_time=10 * 86400)).half_removed == 1
    assert store.land_intake(0.0) == 0
    assert store.read("half").num_rows == 0 and intake._listed(0.0, float("inf")) == []
