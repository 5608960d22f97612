"""Appends committed by writing the Delta log entry directly (rmq_spark.delta.commit), on real
tables: racing writers of both kinds, conflicts, checkpoints, and processes killed mid-commit."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, TableFeatures, write_deltalake
from deltalake.exceptions import CommitFailedError

from rmq_spark import Decision, LocalTransactionState, Message, Store, StoreError
from rmq_spark.delta.commit import appendable, commit
from rmq_spark.delta.files import KEPT_FILE_BYTES, WrittenFiles, write_files
from rmq_spark.delta.reads import read_arrow, read_files
from rmq_spark.delta.storage import filesystem
from rmq_spark.delta.txnlog import LOG_ENTRY_MIN_AGE
from rmq_spark.model.config import RetentionSettings, Settings, StoreSettings
from rmq_spark.model.messages import new_id
from rmq_spark.model.schema import HALF_SCHEMA
from rmq_spark.store.retention import maintain
from tests.conftest import committing

REPO = Path(__file__).resolve().parents[2]


def open_store(root: Path) -> Store:
    return Store.open(root, settings=Settings(store=StoreSettings(queue_nums=2, intake=False)))


def half_files(store: Store, body: bytes = b"x"):
    """Data files of one half message, written and not committed."""
    table = _half_rows(body)
    options = store.settings.storage_options
    return write_files(store.table_uri("half"), iter([table]), HALF_SCHEMA, None, options)


def _half_rows(body: bytes, queue_id: int = 0) -> pa.Table:
    """One half message as rows of ``half``."""
    now = datetime.now(UTC)
    row = {f.name: None for f in HALF_SCHEMA}
    row |= {
        "transaction_id": new_id(),
        "msg_id": new_id(),
        "producer_group": "pg",
        "topic": "T",
        "queue_id": queue_id,
        "body": body,
        "born_timestamp": now,
        "store_timestamp": now,
    }
    return pa.Table.from_pylist([row], schema=HALF_SCHEMA)


def contiguous(uri: str) -> list[int]:
    """The versions of the table's log entries; asserts there is no gap after the oldest."""
    names = sorted(p.name for p in (Path(uri) / "_delta_log").glob("*.json"))
    versions = [int(n[:20]) for n in names]
    assert versions == list(range(versions[0], versions[-1] + 1))
    return versions


def test_direct_and_deltalake_writers_racing_lose_and_duplicate_nothing(tmp_path: Path) -> None:
    """Four producers (each its own Store, so its own idea of the latest version), a deltalake
    writer and compactions append to ``half`` at once: every row lands exactly once and the
    log has no gap, as deltalake and Spark-side readers expect."""
    root = tmp_path / "s"
    open_store(root)
    sent: list[str] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def producer(i: int) -> None:
        try:
            store = open_store(root)
            for n in range(30):
                for p in store.prepare([Message("T", f"{i}-{n}-{k}") for k in range(3)], "pg"):
                    with lock:
                        sent.append(p.msg_id)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def deltalake_writer() -> None:
        try:
            store = open_store(root)
            for n in range(20):
                rows = _half_rows(f"dl-{n}".encode())
                # deltalake gives up after its 15 tries against hundreds of direct commits a
                # second (CommitFailedError: nothing landed); a writer tries again, and a row
                # that did land after all would show twice below.
                for attempt in range(50):
                    try:
                        write_deltalake(store.table_uri("half"), rows, mode="append")
                        break
                    except CommitFailedError:
                        time.sleep(0.01 * attempt)
                else:
                    raise AssertionError(f"deltalake's append of dl-{n} never landed")
                with lock:
                    sent.append(rows.column("msg_id")[0].as_py())
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def compactor() -> None:
        try:
            store = open_store(root)
            for _ in range(5):
                store.compact("half")
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=producer, args=(i,)) for i in range(4)]
    threads += [threading.Thread(target=deltalake_writer), threading.Thread(target=compactor)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    store = open_store(root)
    stored = store.read("half", ["msg_id"]).column("msg_id").to_pylist()
    assert sorted(stored) == sorted(sent) and len(sent) == 4 * 30 * 3 + 20
    contiguous(store.table_uri("half"))


def test_written_files_are_described_by_their_add_actions(any_store: Store) -> None:
    """The size an add action gives is the stored file's (readers find the Parquet footer by
    it), through the output stream's buffer: one file of a single small batch (a producer's)
    and one of several batches and row groups, on local disk and S3."""
    fs, _ = filesystem(any_store.root, any_store.settings.storage_options)
    uri = any_store.table_uri("half")
    small = _half_rows(b"s")
    large = [pa.concat_tables([_half_rows(os.urandom(3000), q) for q in range(400)])] * 3
    for batches in ([small], large):
        [action] = write_files(
            uri, iter(batches), HALF_SCHEMA, None, any_store.settings.storage_options
        )
        path = f"{uri}/{action.path}"
        assert action.size == fs.size(path) > 0
        with fs.open(path, "rb") as stored:
            data = pq.read_table(stored)
        assert data.num_rows == sum(b.num_rows for b in batches)
        assert json.loads(action.stats)["numRecords"] == data.num_rows
        assert data.column("body").to_pylist() == pa.concat_tables(batches)["body"].to_pylist()


def test_a_commit_after_a_table_change_is_refused_and_the_append_retried(any_store: Store) -> None:
    """A metaData action between the snapshot and the commit conflicts: nothing lands. The
    Store's append then retries on the new snapshot."""
    any_store = committing(any_store)
    uri, options = any_store.table_uri("half"), any_store.settings.storage_options
    before = any_store.table("half").version()
    files = half_files(any_store)
    DeltaTable(uri, storage_options=any_store._storage_options).alter.set_table_properties(
        {"delta.logRetentionDuration": "interval 2 days"}
    )
    with pytest.raises(CommitFailedError, match="changed the table"):
        commit(uri, options, before, files)
    assert DeltaTable(uri, storage_options=any_store._storage_options).version() == before + 1
    (p,) = any_store.prepare([Message("T", b"after")], "pg")
    assert p.half_version == before + 2
    assert any_store.half_messages([p.transaction_id]).num_rows == 1


def test_an_application_id_recorded_first_refuses_the_later_commit(any_store: Store) -> None:
    """Two commits on one snapshot naming the same application id: the second is refused
    (first decision wins, offsets stay dense); one naming another id lands after both."""
    uri, options = any_store.table_uri("half"), any_store.settings.storage_options
    base = any_store.table("half").version()
    assert commit(uri, options, base, half_files(any_store), app_ids={"a": 1}) == base + 1
    with pytest.raises(CommitFailedError, match="application id 'a'"):
        commit(uri, options, base, half_files(any_store), app_ids={"a": 2})
    assert commit(uri, options, base, half_files(any_store), app_ids={"b": 1}) == base + 2
    table = DeltaTable(uri, storage_options=any_store._storage_options)
    assert table.transaction_version("a") == 1 and table.transaction_version("b") == 1
    assert table.version() == base + 2


def test_a_compaction_loses_to_a_commit_that_removed_a_file_it_rewrites(any_store: Store) -> None:
    """A compaction read its files from a snapshot; meanwhile a DELETE (retention) rewrote one
    of them without a row. Committing the compaction would bring the deleted row back (and
    keep the other files' rows twice), so it conflicts; an append meanwhile does not."""
    any_store = committing(any_store)
    uri, options = any_store.table_uri("half"), any_store.settings.storage_options
    sent = [any_store.prepare([Message("T", f"m{i}".encode())], "pg")[0] for i in range(3)]
    snapshot = any_store.table("half")
    files = read_arrow(snapshot.get_add_actions(flatten=True)).to_pydict()
    removes = [
        {"path": p, "size": n, "partition_values": {}}
        for p, n in zip(files["path"], files["size_bytes"], strict=True)
    ]
    rewritten = half_files(any_store, b"the rows of the three files")
    any_store.prepare([Message("T", b"appended meanwhile")], "pg")
    assert commit(uri, options, snapshot.version(), rewritten, removes=removes[:1]) > 0
    gone = sent[1].transaction_id
    DeltaTable(uri, storage_options=any_store._storage_options).delete(f"transaction_id = '{gone}'")
    with pytest.raises(CommitFailedError, match="removed"):
        commit(uri, options, snapshot.version(), rewritten, removes=removes[1:])
    assert any_store.half_messages([gone]).num_rows == 0


def test_a_commit_on_a_base_whose_log_was_cleaned_is_refused(store: Store) -> None:
    """The log after a version may have been cleaned since a writer read it (others committed
    past a checkpoint, the cleanup deleted the entries below): a commit on it takes the first
    free version, a hole below the checkpoint that no reader sees. It must be refused, not
    reported as landed."""
    uri = store.table_uri("half")
    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
    base = store.table("half").version()
    for n in range(25):
        store.prepare([Message("T", f"m{n}")], "pg")
    _cleaned(store)
    assert not (Path(uri) / "_delta_log" / f"{base:020d}.json").exists()
    files = half_files(store, b"late")
    with pytest.raises(CommitFailedError, match="below a newer checkpoint"):
        commit(uri, {}, base, files)
    assert b"late" not in DeltaTable(uri).to_pyarrow_table(columns=["body"]).column("body")


def test_direct_commits_are_checkpointed_at_the_interval(store: Store) -> None:
    uri = store.table_uri("half")
    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
    for n in range(25):
        store.prepare([Message("T", f"m{n}")], "pg")
    version = store.table("half").version()
    compactions = [h for h in DeltaTable(uri).history() if h["operation"] == "OPTIMIZE"]
    assert version == 26 + len(compactions) and len(compactions) == 2  # one after each
    checkpoints = sorted(p.name for p in (Path(uri) / "_delta_log").glob("*.checkpoint.parquet"))
    assert checkpoints == [f"{v:020d}.checkpoint.parquet" for v in (10, 20)]
    fresh = DeltaTable(uri)
    assert fresh.version() == version and fresh.to_pyarrow_table().num_rows == 25


@pytest.mark.parametrize(
    ("change", "named"),
    [
        (lambda t: t.alter.add_constraint({"known_queue": "queue_id >= 0"}), "known_queue"),
        (
            lambda t: t.alter.add_feature(
                TableFeatures.RowTracking, allow_protocol_versions_increase=True
            ),
            "rowTracking",
        ),
    ],
    ids=["check-constraint", "row-tracking"],
)
def test_a_table_that_asks_more_of_a_writer_is_refused_clearly(
    store: Store, change, named: str
) -> None:
    """A CHECK constraint or a writer feature is the writer's to honour; files written ahead
    of their commit cannot be checked, so rmq-spark refuses such a table instead of writing
    what it may not, and says how to undo the change. Nothing is written."""
    assert appendable(store.table("half"))
    change(store.table("half"))
    before = store.table("half").version()
    with pytest.raises(StoreError, match=f"{named}.*must not be altered"):
        store.prepare([Message("T", b"refused")], "pg")
    assert store.table("half").version() == before
    assert store.read("half").num_rows == 0


def test_a_writer_that_goes_on_from_its_own_commit_still_sees_another_writers(
    any_store: Store,
) -> None:
    """A writer that has just committed alone goes on from its own commit without reading the
    log. Another writer's append since is found by its put (both land, once each); a table
    change since is found the same way and refused as before, with nothing written."""
    any_store = committing(any_store)
    (first,) = any_store.prepare([Message("T", b"first")], "pg")
    uri, options = any_store.table_uri("half"), any_store._storage_options
    foreign = DeltaTable(uri, storage_options=options)
    files = half_files(any_store, b"foreign")
    commit(uri, any_store.settings.storage_options, foreign.version(), files)
    (second,) = any_store.prepare([Message("T", b"second")], "pg")
    assert second.half_version == first.half_version + 2
    bodies = any_store.read("half").column("body").to_pylist()
    assert sorted(bodies) == [b"first", b"foreign", b"second"]
    any_store.prepare([Message("T", b"third")], "pg")  # alone again
    DeltaTable(uri, storage_options=options).alter.add_constraint({"known_queue": "queue_id >= 0"})
    before = DeltaTable(uri, storage_options=options).version()
    with pytest.raises(StoreError, match="known_queue.*must not be altered"):
        any_store.prepare([Message("T", b"refused")], "pg")
    assert DeltaTable(uri, storage_options=options).version() == before


def run_killed(store: Store, failpoint: str, sends: int = 1) -> None:
    child = textwrap.dedent(
        f"""
        from rmq_spark import Message, Store
        from rmq_spark.model.config import Settings, StoreSettings
        settings = Settings(store=StoreSettings(queue_nums=2, intake=False))
        store = Store.open({store.root!r}, settings=settings)
        for n in range({sends}):
            store.prepare([Message("T", b"killed")], "pg")
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child],
        env={**os.environ, "PYTHONPATH": str(REPO), "RMQ_SPARK_FAILPOINT": failpoint},
        start_new_session=True,  # the failpoint kills the child's whole session
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr.decode()


def test_a_process_killed_with_its_entry_staged_commits_nothing(store: Store) -> None:
    (kept,) = store.prepare([Message("T", b"kept")], "pg")
    before = store.table("half").version()
    run_killed(store, "deltacommit.staged")
    log_dir = Path(store.table_uri("half")) / "_delta_log"
    (staged,) = log_dir.glob(".*.json.tmp")
    assert store.table("half").version() == before
    assert store.read("half", ["body"]).column("body").to_pylist() == [b"kept"]
    (after,) = store.prepare([Message("T", b"after")], "pg")
    assert after.half_version == before + 1
    # The log cleanup takes the abandoned entry once it is older than every rule's time.
    old = time.time() - 3600
    os.utime(staged, (old, old))
    store.clean_log("half")
    assert not staged.exists()
    assert DeltaTable(store.table_uri("half")).to_pyarrow_table().num_rows == 2


def test_a_process_killed_after_taking_the_checkpoint_version_leaves_a_readable_table(
    store: Store,
) -> None:
    """Killed after its commit took the interval's version and before the checkpoint: the
    message is durable (a half message the check-back job resolves), the table reads, and the
    next interval is checkpointed."""
    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "5"})
    while store.table("half").version() % 5 != 4:
        store.prepare([Message("T", b"before")], "pg")
    run_killed(store, "deltacommit.committed")
    uri = store.table_uri("half")
    killed_at = DeltaTable(uri).version()
    assert killed_at % 5 == 0
    assert not (Path(uri) / "_delta_log" / f"{killed_at:020d}.checkpoint.parquet").exists()
    for n in range(5):
        (p,) = store.prepare([Message("T", f"after-{n}")], "pg")
    assert (Path(uri) / "_delta_log" / f"{killed_at + 5:020d}.checkpoint.parquet").exists()
    bodies = DeltaTable(uri).to_pyarrow_table(columns=["body"]).column("body").to_pylist()
    assert bodies.count(b"killed") == 1 and b"after-4" in bodies
    store.end_transactions([Decision(p.transaction_id, "pg", LocalTransactionState.COMMIT)])
    assert store.published_op_version() >= 1


def _stopped_prepare(store: Store, tmp_path: Path, failpoint: str) -> subprocess.Popen:
    """A child process whose prepare of one half message ``b"stalled"`` stops itself (SIGSTOP)
    at ``failpoint``; returned once it is stopped there. It prints its half version.

    It prepares ``b"warm"`` first: the stalled commit goes on from the child's own last
    commit, as a busy producer's do."""
    marker = tmp_path / "stopped.pid"
    child = textwrap.dedent(
        f"""
        import json, os
        from rmq_spark import Message, Store
        from rmq_spark.model.config import Settings, StoreSettings
        settings = Settings(store=StoreSettings(queue_nums=2, intake=False))
        store = Store.open({store.root!r}, settings=settings)
        store.prepare([Message("T", b"warm")], "pg")
        os.environ["RMQ_SPARK_FAILPOINT"] = {f"{failpoint}:stop"!r}
        (prepared,) = store.prepare([Message("T", b"stalled")], "pg")
        print(json.dumps({{"half_version": prepared.half_version}}))
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        env={
            **os.environ,
            "PYTHONPATH": str(REPO),
            "RMQ_SPARK_FAILPOINT_MARKER": str(marker),
        },
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    deadline = time.monotonic() + 120
    while not (marker.exists() and marker.read_text()) or _state(proc.pid) != "T":
        assert proc.poll() is None, proc.stderr.read().decode()
        assert time.monotonic() < deadline, "the child never reached its commit"
        time.sleep(0.05)
    return proc


def _resumed(proc: subprocess.Popen) -> int:
    """Resume a stopped child; the half version its prepare returned."""
    os.kill(proc.pid, signal.SIGCONT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err.decode()
    return json.loads(out.decode().strip().splitlines()[-1])["half_version"]


def _cleaned(store: Store) -> int:
    """The log cleanup of ``half`` on a clock two minutes ahead (past UNNEEDED_LOG_SECONDS),
    once the entries are older than LOG_ENTRY_MIN_AGE (it deletes no younger one, whatever
    its clock); how many files it deleted."""
    time.sleep(LOG_ENTRY_MIN_AGE)
    later = datetime.now(UTC) + timedelta(minutes=2)
    return Store.open(store.root, settings=store.settings, clock=lambda: later).clean_log("half")


def test_a_log_cleanup_whose_clock_runs_ahead_deletes_no_young_entry(store: Store) -> None:
    """A cleanup on a host whose clock runs minutes ahead deletes nothing written less than
    LOG_ENTRY_MIN_AGE ago on the store's clock (a reader that listed the log moments ago
    finds what it listed)."""
    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
    for n in range(25):
        store.prepare([Message("T", f"m{n}")], "pg")
    ahead = datetime.now(UTC) + timedelta(minutes=2)
    assert (
        Store.open(store.root, settings=store.settings, clock=lambda: ahead).clean_log("half") == 0
    )
    assert _cleaned(store) > 0


def test_a_commit_paused_past_a_checkpoint_and_log_cleanup_is_not_lost(
    store: Store, tmp_path: Path
) -> None:
    """A process stopped (SIGSTOP: a GC or swap stall, a paused VM) between reading the log
    and putting its entry, while others commit past a checkpoint and the log cleanup
    deletes the entries below it: its put-if-absent lands in the cleaned hole, where no reader
    looks. The commit must see that and go again at the table's head: the prepare that returns
    is readable, once."""
    uri = store.table_uri("half")
    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
    proc = _stopped_prepare(store, tmp_path, "deltacommit.staged")
    try:
        target = store.table("half").version() + 1  # the version the stopped commit will put
        for n in range(25):
            store.prepare([Message("T", f"m{n}")], "pg")
        _cleaned(store)
        assert not (Path(uri) / "_delta_log" / f"{target:020d}.json").exists()
    finally:
        reported = _resumed(proc)
    fresh = DeltaTable(uri)
    bodies = fresh.to_pyarrow_table(columns=["body"]).column("body").to_pylist()
    assert bodies.count(b"stalled") == 1
    assert 20 < reported <= fresh.version()


def test_a_commit_paused_after_its_put_is_not_made_twice(store: Store, tmp_path: Path) -> None:
    """Stopped right after its put landed, while others commit past a checkpoint, a compaction
    rewrites its file and the log cleanup runs: it finds a checkpoint after its version, as a
    commit put in a cleaned hole does, but this one is in the table. Made again, its file
    would be added a second time beside the compacted copy of its rows."""
    uri = store.table_uri("half")
    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
    proc = _stopped_prepare(store, tmp_path, "deltacommit.committed")
    try:
        for n in range(25):
            store.prepare([Message("T", f"m{n}")], "pg")
        store.compact("half")  # each checkpoint's maintenance has compacted already
        assert len(store.data_files("half")) == 1  # the stalled commit's file rewritten too
        for n in range(10):
            store.prepare([Message("T", f"after-{n}")], "pg")
        _cleaned(store)
    finally:
        reported = _resumed(proc)
    bodies = DeltaTable(uri).to_pyarrow_table(columns=["body"]).column("body").to_pylist()
    assert bodies.count(b"stalled") == 1
    assert reported < 10


@pytest.mark.parametrize("vacuumed", [False, True])
def test_a_commit_paused_after_its_put_is_not_made_twice_once_its_tombstone_expired(
    store: Store, tmp_path: Path, vacuumed: bool
) -> None:
    """As above, but the compaction's tombstone of its file expired before the checkpoint after
    its version was written (a stall longer than ``delta.deletedFileRetentionDuration``), and
    the entries after it were cleaned: as for a put in a cleaned hole, nothing in the log names
    its file. The removal the compaction wrote down for VACUUM does (no maintenance ran): only
    a put that readers saw can have its file removed. Once a VACUUM deleted the file, nothing
    tells the two apart: the prepare fails, and is made neither twice nor with a file that is
    gone."""
    uri = store.table_uri("half")
    store.table("half").alter.set_table_properties(
        {
            "delta.checkpointInterval": "10",
            "delta.deletedFileRetentionDuration": "interval 3 seconds",
        }
    )
    proc = _stopped_prepare(store, tmp_path, "deltacommit.committed")
    try:
        for n in range(5):
            store.prepare([Message("T", f"m{n}")], "pg")
        store.compact("half")  # writes the removal down, due in 3 s
        time.sleep(3.5)  # its tombstone expires
        for n in range(25):
            store.prepare([Message("T", f"after-{n}")], "pg")
        _cleaned(store)
        if vacuumed:
            assert maintain(store, RetentionSettings()).files_vacuumed["half"] > 0
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=300)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    assert (proc.returncode != 0) is vacuumed
    if vacuumed:
        assert b"cannot be told" in err
    bodies = DeltaTable(uri).to_pyarrow_table(columns=["body"]).column("body").to_pylist()
    assert bodies.count(b"stalled") == 1


def _state(pid: int) -> str:
    """A process's state letter (``T``: stopped)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_a_commit_right_after_its_own_is_not_lost_where_a_stalled_writers_entry_was_cleaned(
    store: Store, tmp_path: Path
) -> None:
    """A local log entry is a hard link of a file staged earlier, so it keeps the staging time.
    A writer stopped (SIGSTOP) between staging and linking links an entry that looks old at
    once; another writer reaches a checkpoint and the log cleanup runs. The cleanup must not
    delete that entry while it keeps the one before (a young commit of X), and X's next
    commit, moments after its own, must not land in a hole below the checkpoint: the send that
    returns OK is read by a fresh reader, once."""
    uri = store.table_uri("half")
    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
    stalled = _stopped_prepare(store, tmp_path, "deltacommit.staged")
    other = open_store(store.root)
    ahead = datetime.now(UTC) + timedelta(minutes=2)
    cleaner = Store.open(store.root, settings=store.settings, clock=lambda: ahead)
    try:
        time.sleep(LOG_ENTRY_MIN_AGE + 1)  # the stalled writer's staged entry is old now
        while store.table("half").version() % 10 != 6:
            other.prepare([Message("T", b"pad")], "pg")
        store.prepare([Message("T", b"A0")], "pg")
        (a,) = store.prepare([Message("T", b"A")], "pg")  # put at the first version it tried
    finally:
        linked = _resumed(stalled)
    (c,) = other.prepare([Message("T", b"C")], "pg")
    assert (linked, c.half_version) == (a.half_version + 1, a.half_version + 2)
    assert c.half_version % 10 == 0  # its commit wrote the checkpoint
    assert cleaner.clean_log("half") > 0
    assert (Path(uri) / "_delta_log" / f"{linked:020d}.json").exists()  # kept after A, young
    # Within two seconds of A on an idle machine: the shortcut dropped here trusted that no
    # cleanup could have reached A's next version so soon, and put B there (lost, 0 rows).
    (b,) = store.prepare([Message("T", b"B")], "pg")
    bodies = DeltaTable(uri).to_pyarrow_table(columns=["body"]).column("body").to_pylist()
    assert bodies.count(b"B") == 1 and bodies.count(b"stalled") == 1
    assert b.half_version > c.half_version


@pytest.mark.usefixtures("young_entries_cleaned")
def test_a_checkpoint_a_newer_one_covers_is_skipped_without_a_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A producer resumed after a pause runs the checkpoint its last commit asked for, of a
    version others have since checkpointed past and cleaned: nothing to do, and nothing to
    warn about (it warned with a traceback, 'No files in log segment')."""
    from rmq_spark.delta.checkpoints import Checkpointer
    from rmq_spark.delta.tables import _checkpoint

    store.table("half").alter.set_table_properties({"delta.checkpointInterval": "10"})
    for n in range(25):
        store.prepare([Message("T", f"m{n}")], "pg")
    later = datetime.now(UTC) + timedelta(minutes=2)
    assert Store.open(store.root, settings=store.settings, clock=lambda: later).clean_log("half")
    caplog.clear()
    with caplog.at_level("WARNING"):
        _checkpoint(Checkpointer({}), store.table_uri("half"), 10)
    assert not caplog.records
    assert not (
        Path(store.table_uri("half")) / "_delta_log" / f"{10:020d}.checkpoint.parquet"
    ).exists()


def test_written_files_keep_the_newest_small_files_up_to_their_bound(tmp_path: Path) -> None:
    """A compaction takes the rows of the files its process wrote from memory, as written:
    small files only, the oldest dropped past the bound, each taken once; and reads them, in
    order among files it reads from the store, as the store holds them."""
    row = pa.table({"a": pa.array([1], pa.int64())})
    kept = WrittenFiles(limit=2 * row.get_total_buffer_size())
    for name in ("a", "b", "c"):
        kept.add(name, row)
    assert list(kept.take(["a", "b", "c"])) == ["b", "c"] and kept.take(["c"]) == {}
    (tmp_path / "t").mkdir()
    uri = str(tmp_path / "t")
    kept = WrittenFiles()
    bodies = [os.urandom(100), os.urandom(KEPT_FILE_BYTES + 1), os.urandom(100), b"b"]
    adds = [
        write_files(uri, iter([_half_rows(b)]), HALF_SCHEMA, None, {}, kept=kept)[0] for b in bodies
    ]
    paths = [f"{uri}/{a.path}" for a in adds]
    taken = kept.take([paths[0], paths[1], paths[3]])
    assert sorted(taken) == sorted([paths[0], paths[3]])  # not the large one
    # Kept as another writer's schema would have it (every column nullable): conformed.
    loose = pa.schema([f.with_nullable(True) for f in HALF_SCHEMA])
    assert not kept.take([paths[2]])[paths[2]].schema.equals(loose)
    kept.add(paths[2], pq.read_table(paths[2]).cast(loose))
    read = read_files(paths, HALF_SCHEMA, {}, sizes=[a.size for a in adds], kept=kept)
    assert read.column("body").to_pylist() == bodies  # store, store, kept, store: in order
    assert read.equals(pq.ParquetDataset(paths, schema=HALF_SCHEMA).read())
    assert kept.take(paths) == {}


def test_written_files_keep_a_copy_of_rows_that_share_a_larger_buffer(tmp_path: Path) -> None:
    """Rows read zero-copy from an Arrow stream (as a Spark batch is) are slices of the whole
    message, columns dropped included: kept as they were, a small file's rows held all of it
    for as long, past the bound that counts the rows' own bytes."""
    big = _half_rows(b"x").append_column("dropped", pa.array([os.urandom(4 << 20)]))
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, big.schema) as stream:
        stream.write_table(big)
    rows = pa.ipc.open_stream(sink.getvalue()).read_all().select(HALF_SCHEMA.names)
    (tmp_path / "t").mkdir()
    kept = WrittenFiles()
    (add,) = write_files(str(tmp_path / "t"), iter([rows]), HALF_SCHEMA, None, {}, kept=kept)
    (held,) = kept.take([f"{tmp_path / 't'}/{add.path}"]).values()
    assert held.equals(rows)
    buffers = [b for c in held.columns for a in c.chunks for b in a.buffers() if b is not None]
    assert all(b.parent is None for b in buffers)  # its own, not the stream's 4 MiB


@pytest.mark.parametrize("rows", [3, 40])
def test_a_written_files_statistics_are_those_of_its_rows(tmp_path: Path, rows: int) -> None:
    """A file's min/max statistics (what readers skip files by) are its rows' least and
    greatest values as Arrow orders them, nulls left out, whether computed in Python (a few
    rows) or by Arrow: strings beyond ASCII, timestamps, integers and an all-null column."""
    import pyarrow.compute as pc

    schema = pa.schema([f.with_nullable(True) for f in HALF_SCHEMA])  # nulls anywhere
    names = ["zeta", "Ωmega", "éclair", "alpha", None, "日本"]
    born = datetime(2026, 1, 1, tzinfo=UTC)
    table = pa.Table.from_pydict(
        {
            f.name: [None] * rows
            for f in schema
            if f.name not in ("transaction_id", "topic", "queue_id", "born_timestamp")
        }
        | {
            "transaction_id": [new_id() for _ in range(rows)],
            "topic": [names[i % len(names)] for i in range(rows)],
            "queue_id": [(i * 7919) % 13 - 6 for i in range(rows)],
            # The last: past the 23rd century, where a float's milliseconds round inwards.
            "born_timestamp": [born + timedelta(microseconds=i * 999_999) for i in range(rows - 1)]
            + [datetime(2300, 6, 1, 0, 0, 0, 999, tzinfo=UTC)],
        },
        schema=schema,
    )
    (tmp_path / "t").mkdir()
    (add,) = write_files(str(tmp_path / "t"), iter([table]), schema, None, {})
    stats = json.loads(add.stats)
    assert stats["numRecords"] == rows
    for name in ("transaction_id", "topic", "queue_id"):
        low, high = (v.as_py() for v in pc.min_max(table.column(name)).values())
        assert (stats["minValues"][name], stats["maxValues"][name]) == (low, high), name
    assert stats["nullCount"]["topic"] == table.column("topic").null_count
    assert stats["minValues"]["born_timestamp"] == "2026-01-01T00:00:00.000Z"
    assert stats["maxValues"]["born_timestamp"] == "2300-06-01T00:00:00.001Z"
    (late,) = write_files(str(tmp_path / "t"), iter([table.slice(rows - 1)]), schema, None, {})
    assert json.loads(late.stats)["minValues"]["born_timestamp"] == "2300-06-01T00:00:00.000Z"
    assert "sink_id" not in stats["minValues"]  # all null: no min, no max
