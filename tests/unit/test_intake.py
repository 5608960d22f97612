"""Intake objects (rmq_spark.store.intake): a send durable in one put, landed in ``half`` once,
before any decision of it reaches ``op``, by its writer or by whoever finds it left."""

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
from collections import Counter
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from deltalake import DeltaTable

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.model.config import RetentionSettings, Settings, StoreSettings, load_settings
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.model.failpoints import ENV, MARKER_ENV
from rmq_spark.store.decisions import EndTransactionStatus
from rmq_spark.store.intake import INTAKE_DIR
from rmq_spark.store.layout import LAYOUT_VERSION, MARKER_FILE, OBJECTS_LAYOUT
from rmq_spark.store.retention import maintain
from tests.conftest import Clock, commitlog
from tests.full_disk import run_on_a_full_disk

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.objectstore)])
def settings(request: pytest.FixtureRequest, tmp_path: Path) -> Settings:
    """Settings of a store with intake (on by default on S3, turned on on local disk)."""
    if request.param == "s3":
        chosen: Settings = request.getfixturevalue("s3_settings")
    else:
        chosen = Settings(store=StoreSettings(path=str(tmp_path / "store"), queue_nums=2))
    return replace(chosen, store=replace(chosen.store, intake=True))


def _open(settings: Settings) -> Store:
    return Store.open(settings=settings)


def _objects(store: Store) -> list[str]:
    intake = store._decisions.intake
    assert intake is not None
    return intake._listed(0.0, float("inf"))


def _half_ids(store: Store) -> list[str]:
    """Every row of ``half`` as stored (``Store.read`` reads copies once)."""
    table = DeltaTable(store.table_uri("half"), storage_options=store._storage_options)
    return sorted(table.to_pyarrow_table(columns=["transaction_id"]).column(0).to_pylist())


def test_a_send_is_durable_in_one_object_and_lands_before_its_decision(
    settings: Settings,
) -> None:
    store = _open(settings)
    (p,) = store.prepare([Message("T", b"x")], "pg")
    assert _half_ids(store) == [] and len(_objects(store)) == 1
    (ended,) = store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)], land=False)
    assert ended.status is EndTransactionStatus.APPLIED
    assert store.land_decisions() == 1
    assert _half_ids(store) == [p.transaction_id]
    assert store.read("op").column("transaction_id").to_pylist() == [p.transaction_id]
    assert _objects(store) == []
    store.publish()
    assert store.read("commitlog").column("transaction_id").to_pylist() == [p.transaction_id]


def test_half_messages_still_in_an_intake_object_are_found_by_another_process(
    settings: Settings,
) -> None:
    """``rmqtx serve`` looks a transaction up to end it (its owner, its topics) when it does
    not remember it (ended before, or sent before a restart): one not landed yet is there."""
    store = _open(settings)
    (p,) = store.prepare([Message("T", b"x", keys="k")], "pg")
    other = _open(settings)
    assert other.half_messages([p.transaction_id]).num_rows == 0  # half alone: not landed yet
    (row,) = other.half_messages([p.transaction_id, "nobody"], staged=True).to_pylist()
    assert (row["transaction_id"], row["topic"], row["producer_group"]) == (
        p.transaction_id,
        "T",
        "pg",
    )
    store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])  # landed and deleted
    assert _objects(store) == []
    (row,) = other.half_messages([p.transaction_id], staged=True).to_pylist()
    assert row["transaction_id"] == p.transaction_id


def test_a_decider_in_another_process_lands_the_half_first(settings: Settings) -> None:
    """A transaction sent through one process and decided through another (two ``rmqtx
    serve`` behind one address): the decider lands the sender's intake object before it
    records the decision in ``op``, so the publisher finds the message to publish."""
    other, sender, decider = _open(settings), _open(settings), _open(settings)
    (unrelated,) = other.prepare([Message("T", b"y")], "pg")
    (p,) = sender.prepare([Message("T", b"x")], "pg")
    decider.end_transactions([Decision(p.transaction_id, "pg", COMMIT)], publish=False)
    assert _half_ids(decider) == [p.transaction_id]
    assert len(_objects(decider)) == 1  # the other writer's, whose ids do not cover it
    decider.publish()
    assert decider.read("commitlog").column("transaction_id").to_pylist() == [p.transaction_id]
    sender.land_decisions()  # its own landing finds it landed
    other.land_decisions()
    assert _half_ids(sender) == sorted([p.transaction_id, unrelated.transaction_id])


CHURN = """
import os, sys
folder = sys.argv[1]
names = [os.path.join(folder, f"0-0-churn{i}.arrow") for i in range(64)]
while True:
    for name in names:
        open(name, "wb").close()
    for name in names:
        os.unlink(name)
"""


def test_a_listing_is_whole_while_other_objects_come_and_go(tmp_path: Path) -> None:
    """Objects landed and deleted by other processes while a listing reads the folder: the
    objects that stay are listed each time (a deletion between reading the folder and reading
    an entry's time threw the whole listing away, and a late end found its own send missing)."""
    settings = Settings(store=StoreSettings(path=str(tmp_path / "store"), intake=True))
    store = _open(settings)
    (p,) = store.prepare([Message("T", b"x")], "pg")
    folder = os.path.dirname(_objects(store)[0])
    churn = subprocess.Popen([sys.executable, "-c", CHURN, folder])
    try:
        listed = [store.intake_covering([p.transaction_id]) for _ in range(2000)]
    finally:
        churn.kill()
        churn.wait()
    assert sum(found != {p.transaction_id} for found in listed) == 0  # listings that missed it


def test_a_writer_whose_object_a_decider_landed_still_lands_its_own_decision(
    settings: Settings,
) -> None:
    """A decider in another process lands the sender's intake object (one of its two
    transactions is decided there), and deletes it. The sender finds its object gone, but
    ``half`` holds the other transaction: its own decision of it lands at once, not a check-back
    round later."""
    sender, decider = _open(settings), _open(settings)
    mine, theirs = sender.prepare([Message("T", b"a"), Message("T", b"b")], "pg")
    decider.end_transactions([Decision(theirs.transaction_id, "pg", COMMIT)], publish=False)
    assert _objects(sender) == []  # landed by the decider, and deleted
    sender.end_transactions([Decision(mine.transaction_id, "pg", COMMIT)], land=False)
    sender.land_decisions()
    decided = sender.read("op").column("transaction_id").to_pylist()
    assert sorted(decided) == sorted([mine.transaction_id, theirs.transaction_id])


def test_a_writer_stalled_between_its_snapshot_and_its_listing_still_lands_its_decision(
    tmp_path: Path,
) -> None:
    """A sender's landing reads ``half``'s snapshot and stops (SIGSTOP) before it lists the
    intake objects. Meanwhile a decider lands the sender's object (it decides the object's other
    transaction) and deletes it. Resumed, the sender finds its object gone and its transaction
    not in the snapshot it read before: it must look again, not drop its own COMMIT as removed
    by retention (before, the COMMIT reached op only when a check-back round found it)."""
    root, marker = tmp_path / "store", tmp_path / "stopped.pid"
    settings = Settings(store=StoreSettings(path=str(root), queue_nums=2, intake=True))
    child = textwrap.dedent(
        f"""
        from rmq_spark import Decision, LocalTransactionState, Message, Store
        from rmq_spark.model.config import StoreSettings
        store = Store.open({str(root)!r}, settings=StoreSettings(intake=True))
        (first,) = store.prepare([Message("T", b"first")], "pg")
        print(first.transaction_id, flush=True)
        input()  # decided (and its object landed) by the decider
        mine, theirs = store.prepare([Message("T", b"mine"), Message("T", b"theirs")], "pg")
        print(mine.transaction_id, theirs.transaction_id, flush=True)
        commit = Decision(mine.transaction_id, "pg", LocalTransactionState.COMMIT)
        store.end_transactions([commit], land=False)
        store.land_decisions()
        print(" ".join(store.read("op").column("transaction_id").to_pylist()), flush=True)
        """
    )
    sender = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV: "intake.listing:stop", MARKER_ENV: str(marker)},
        start_new_session=True,
    )
    assert sender.stdin is not None and sender.stdout is not None
    decider = _open(settings)
    try:
        first = sender.stdout.readline().strip()
        # The decider lands the sender's first object: its writer's bucket is recorded in half
        # by another process, so the sender's landing reads the snapshot and lists.
        decider.end_transactions([Decision(first, "pg", COMMIT)], publish=False)
        sender.stdin.write("\n")
        sender.stdin.flush()
        mine, theirs = sender.stdout.readline().split()
        while not marker.exists() or not marker.read_text().strip():
            assert sender.poll() is None, "the sender ended before its failpoint"
            time.sleep(0.05)
        decider.end_transactions([Decision(theirs, "pg", COMMIT)], publish=False)
        assert _objects(decider) == []  # landed by the decider, and deleted
        os.kill(sender.pid, signal.SIGCONT)
        decided = sender.communicate(timeout=120)[0].split()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(sender.pid, signal.SIGKILL)
    assert sorted(decided) == sorted([first, mine, theirs])


def test_a_stalled_writer_and_a_recoverer_land_it_once(settings: Settings) -> None:
    """The writer stalls after its put; a recoverer lands its objects; the writer resumes and
    lands them too: ``half`` holds each message once."""
    writer, recoverer = _open(settings), _open(settings)
    prepared = writer.prepare([Message("T", b"a"), Message("T", b"b")], "pg")
    prepared += writer.prepare([Message("T", b"c")], "pg")
    assert recoverer.land_intake(0.0) == 3
    assert writer.land_decisions() == 0
    assert _half_ids(writer) == sorted(p.transaction_id for p in prepared)
    assert _objects(writer) == []


def test_an_object_landed_but_not_deleted_is_not_landed_again(settings: Settings) -> None:
    """The writer landed its object and its deletion failed (the object is still there): a
    recoverer finds its transactions in ``half`` and only deletes it."""
    writer = _open(settings)
    (p,) = writer.prepare([Message("T", b"x")], "pg")
    intake = writer._decisions.intake
    (name,) = _objects(writer)
    data = intake.fs.cat_file(name)
    writer.land_decisions()
    intake._put(name, data)  # as if its deletion had failed
    recoverer = _open(settings)
    assert recoverer.land_intake(0.0) == 0
    assert _half_ids(recoverer) == [p.transaction_id]
    assert _objects(recoverer) == []


def test_writers_and_recoverers_racing_land_each_message_once(settings: Settings) -> None:
    """Three writers send and land while two recoverers land whatever they find, at once."""
    writers = [_open(settings) for _ in range(3)]
    recoverers = [_open(settings) for _ in range(2)]
    sent: list[str] = []
    lock = threading.Lock()
    start = threading.Barrier(5)

    def write(store: Store) -> None:
        start.wait()
        for i in range(6):
            ids = [p.transaction_id for p in store.prepare([Message("T", b"%d" % i)], "pg")]
            with lock:
                sent.extend(ids)
            store.land_decisions()

    def recover(store: Store) -> None:
        start.wait()
        for _ in range(12):
            store.land_intake(0.0)

    threads = [threading.Thread(target=write, args=(w,)) for w in writers]
    threads += [threading.Thread(target=recover, args=(r,)) for r in recoverers]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for w in writers:
        w.land_decisions()
    counts = Counter(_half_ids(writers[0]))
    assert sorted(counts) == sorted(sent) and set(counts.values()) == {1}


def test_a_producer_killed_before_landing_leaves_its_sends_to_the_check_back_job(
    tmp_path: Path,
) -> None:
    """A producer whose sends returned is SIGKILLed when its publisher starts landing them: the
    sends are durable in their objects, the check-back job's landing puts them in ``half``, and
    the COMMIT in force in its decision object is then landed and published, once."""
    root = tmp_path / "store"
    child = textwrap.dedent(
        f"""
        import time
        from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer
        from rmq_spark.model.config import StoreSettings
        from tests.unit.test_producer import ScriptedListener
        store = Store.open({str(root)!r}, settings=StoreSettings(intake=True, publish_linger=1.0))
        with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
            for answer in (LocalTransactionState.COMMIT, LocalTransactionState.UNKNOWN):
                sent = producer.send_message_in_transaction(Message("T", b"x"), answer)
                print(sent.transaction_id, flush=True)
            time.sleep(600)
        """
    )
    env = {**os.environ, "RMQ_SPARK_FAILPOINT": "intake.landing"}
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env=env,
        start_new_session=True,  # the failpoint kills the child's whole session
    )
    try:
        committed, unknown = proc.stdout.readline().strip(), proc.stdout.readline().strip()
        assert proc.wait(timeout=60) == -9  # the failpoint's SIGKILL, at the landing
    finally:
        proc.kill()
    store = Store.open(root)
    assert _half_ids(store) == [] and len(_objects(store)) == 2
    assert store.land_intake(0.0) == 2
    assert _half_ids(store) == sorted([committed, unknown])
    # The check-back job's landing of a decision it finds in a decision object:
    (late,) = store.end_transactions(
        [Decision(committed, "pg", ROLLBACK, "check-back")], publish=False, in_half=True
    )
    assert (late.status, late.decision) == (EndTransactionStatus.REFUSED, COMMIT)
    store.publish()
    assert store.read("commitlog").column("transaction_id").to_pylist() == [committed]
    assert store.object_decisions([unknown]) == {}


def test_a_young_object_is_left_to_its_writer(settings: Settings) -> None:
    writer, recoverer = _open(settings), _open(settings)
    writer.prepare([Message("T", b"x")], "pg")
    assert recoverer.land_intake(3600.0) == 0
    assert len(_objects(recoverer)) == 1


def test_a_damaged_object_is_an_error_that_names_it_and_holds_up_no_other(
    settings: Settings, caplog: pytest.LogCaptureFixture
) -> None:
    """An object that is not Arrow (damaged, or put there by hand) is logged as an error naming
    it and left where it is; the others are landed (a round failing on it would stop every
    transaction's progress)."""
    store = _open(settings)
    (p,) = store.prepare([Message("T", b"x")], "pg")
    intake = store._decisions.intake
    bad = f"{intake.path}/0000-0000-{'f' * 16}.arrow"
    intake._put(bad, b"not arrow")
    with caplog.at_level("ERROR", logger="rmq_spark.store.intake"):
        assert _open(settings).land_intake(0.0) == 1
    assert f"{INTAKE_DIR}/0000-0000-" in caplog.text and "not one rmq-spark wrote" in caplog.text
    assert _half_ids(store) == [p.transaction_id]
    (left,) = _objects(store)  # the damaged one, untouched
    assert left.endswith(bad.rsplit("/", 1)[-1]) and intake.fs.cat_file(left) == b"not arrow"


def test_intake_is_a_boolean_setting(tmp_path: Path) -> None:
    conf = tmp_path / "rmq.toml"
    conf.write_text('[store]\nintake = "yes"\n')
    with pytest.raises(InvalidOptionError, match="store.intake needs true or false"):
        load_settings(conf)
    conf.write_text("[store]\nintake = false\n")
    assert load_settings(conf).store.intake is False


def test_a_decision_that_comes_during_a_landing_waits_for_its_half(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While the publisher lands the objects staged so far, a sender stages another transaction
    and its decision comes (the prepare and end committers are threads of their own): the
    landing of decisions that follows must not record that decision in ``op`` before its half
    message is in ``half`` (a publisher reading ``half`` would publish nothing for it)."""
    store = _open(settings)
    store.prepare([Message("T", b"first")], "pg")
    intake = store._decisions.intake
    landing = intake._land
    late: list[str] = []

    def land_while_another_is_sent(objects, *, own):  # noqa: ANN001, ANN202
        if not late:
            (p,) = store.prepare([Message("T", b"late")], "pg")
            store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)], land=False)
            late.append(p.transaction_id)
        return landing(objects, own=own)

    monkeypatch.setattr(intake, "_land", land_while_another_is_sent)
    store.land_decisions()
    decided = set(store.read("op").column("transaction_id").to_pylist())
    assert decided <= set(_half_ids(store)), "a decision in op before its half message"
    store.land_decisions()
    assert decided | set(late) == set(store.read("op").column("transaction_id").to_pylist())
    assert set(late) <= set(_half_ids(store))


def test_the_first_intake_object_raises_the_layout_past_older_releases(tmp_path: Path) -> None:
    """A release before intake would record a decision before its half message is in
    ``half``: the store it could open (layout 4) becomes layout 5 before the first object."""
    plain = Store.open(tmp_path / "store", settings=StoreSettings(intake=False))
    plain.prepare([Message("T", b"x")], "pg")
    marker = tmp_path / "store" / MARKER_FILE
    assert json.loads(marker.read_text())["layout_version"] == OBJECTS_LAYOUT
    settings = Settings(store=StoreSettings(path=str(tmp_path / "store"), intake=True))
    _open(settings).prepare([Message("T", b"x")], "pg")
    assert json.loads(marker.read_text())["layout_version"] == LAYOUT_VERSION == 5


def test_status_shows_the_intake_objects_waiting(settings: Settings) -> None:
    """``rmqtx status`` counts the objects not landed yet: a killed producer's sends are
    pending, but in no table until check-back lands them."""
    from rmq_spark.ops.status import format_status, store_status

    writer = _open(settings)
    writer.prepare([Message("T", b"x")], "pg")
    (shard,) = store_status(writer)["shards"]
    assert shard["intake_objects"] == 1 and shard["oldest_intake_seconds"] >= 0
    assert "intake objects" in format_status(store_status(writer))
    writer.land_decisions()
    (shard,) = store_status(writer)["shards"]
    assert (shard["intake_objects"], shard["oldest_intake_seconds"]) == (0, None)
    assert "intake objects" not in format_status(store_status(writer))


def test_a_recoverer_stalled_past_retention_lands_nothing_back(tmp_path: Path) -> None:
    """A recoverer (``land_intake``, as a check-back round runs it) reads a producer's intake
    object and stops (SIGSTOP) before landing it. The producer lands it itself, the transaction
    is committed, published and, 73 hours later, removed by retention. Resumed, the recoverer
    must land nothing: the message would be pending again, and published a second time."""
    root, marker = tmp_path / "store", tmp_path / "stopped.pid"
    settings = Settings(store=StoreSettings(path=str(root), queue_nums=2, intake=True))
    writer = _open(settings)
    (prepared,) = writer.prepare([Message("Orders", b"x")], "pg")
    recoverer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from rmq_spark import Store; print(Store.open({str(root)!r}).land_intake(0.0))",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, ENV: "intake.read:stop", MARKER_ENV: str(marker)},
        start_new_session=True,
    )
    try:
        while not marker.exists() or not marker.read_text().strip():
            assert recoverer.poll() is None, "the recoverer ended before its failpoint"
            time.sleep(0.05)
        writer.end_transactions([Decision(prepared.transaction_id, "pg", COMMIT, "producer")])
        assert _objects(writer) == [] and commitlog(writer).num_rows == 1
        later = Clock(datetime.now(UTC) + timedelta(hours=73))
        assert maintain(Store.open(root, clock=later), RetentionSettings()).half_removed == 1
        os.kill(recoverer.pid, signal.SIGCONT)
        assert recoverer.communicate(timeout=60)[0].decode().split() == ["0"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(recoverer.pid, signal.SIGKILL)
    assert _half_ids(writer) == []
    writer.publish()
    assert commitlog(writer).num_rows == 0


def test_a_temp_file_left_by_a_writer_stalled_before_its_rename_is_swept_and_its_send_fails(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """On local disk an intake object is written to a temp file and renamed into place. A writer
    stopped (SIGSTOP) between the two leaves the temp file; a killed one would leave it forever.
    The check-back job's landing removes temp files an hour old (one it cannot remove is
    logged and holds up nothing); the writer, resumed, finds its temp file gone and its send
    fails with an error that says so: nothing acknowledged is lost, nothing is left behind."""
    root, marker = tmp_path / "store", tmp_path / "stopped.pid"
    child = textwrap.dedent(
        f"""
        from rmq_spark import Message, Store
        from rmq_spark.model.config import StoreSettings
        store = Store.open({str(root)!r}, settings=StoreSettings(intake=True))
        try:
            store.prepare([Message("T", b"x")], "pg")
        except Exception as exc:
            print(type(exc).__name__, exc, flush=True)
        else:
            print("acknowledged", flush=True)
        """
    )
    writer = subprocess.Popen(
        [sys.executable, "-c", child],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, ENV: "intake.written:stop", MARKER_ENV: str(marker)},
        start_new_session=True,
    )
    try:
        while not marker.exists() or not marker.read_text().strip():
            assert writer.poll() is None, "the writer ended before its failpoint"
            time.sleep(0.05)
        folder = root / "half" / INTAKE_DIR
        (temp,) = [p.name for p in folder.iterdir()]
        assert temp.startswith(".") and temp.endswith(".tmp")
        stuck = folder / ".stuck.tmp"  # a temp file that cannot be removed (a folder)
        stuck.mkdir()
        recoverer = Store.open(root)
        assert recoverer.land_intake(0.0) == 0 and recoverer.land_intake(60.0) == 0
        # Young (the sweep waits an hour, whatever the timeout), or no age given: kept.
        assert recoverer.land_intake(60.0, now=time.time() + 3000) == 0
        assert sorted(p.name for p in folder.iterdir()) == sorted([temp, stuck.name])
        with caplog.at_level("WARNING", logger="rmq_spark.store.intake"):
            assert recoverer.land_intake(60.0, now=time.time() + 3700) == 0
        assert [p.name for p in folder.iterdir()] == [stuck.name]
        assert "could not remove the temp file" in caplog.text and ".stuck.tmp" in caplog.text
        stuck.rmdir()
        os.kill(writer.pid, signal.SIGCONT)
        said = writer.communicate(timeout=60)[0]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(writer.pid, signal.SIGKILL)
    assert said.startswith("RmqSparkError") and "was removed before" in said, said
    assert list(folder.iterdir()) == [] and _half_ids(recoverer) == []


def test_a_write_that_fails_leaves_no_temp_file(tmp_path: Path) -> None:
    """A disk that refuses the write part-way (here the process's file size limit, as a full
    disk would) fails the send with the filesystem's error and leaves nothing behind."""
    root = tmp_path / "store"
    said = run_on_a_full_disk(
        root,
        4096,
        """
        try:
            store.prepare([Message("T", b"y" * 65536)], "pg")
        except OSError as exc:
            print("refused", exc.errno, flush=True)
        """,
    )
    assert said.stdout.split() == ["refused", "27"], said.stderr  # EFBIG
    names = [p.name for p in (root / "half" / INTAKE_DIR).iterdir()]
    assert len(names) == 1 and not names[0].startswith("."), names


def test_an_object_whose_time_is_ahead_of_this_clock_is_landed_all_the_same(
    tmp_path: Path,
) -> None:
    """On NFS an object's time is the server's clock, here a minute ahead of this host's. A
    decider in another process lands the objects covering its transaction whatever their age,
    before it records the decision in ``op``; retention lands every object first. Neither may
    skip one dated in the future: the decision would be in ``op`` without its half message."""
    settings = Settings(store=StoreSettings(path=str(tmp_path / "store"), queue_nums=2))
    sender, decider = _open(settings), _open(settings)
    (p,) = sender.prepare([Message("T", b"x")], "pg")
    (q,) = sender.prepare([Message("T", b"y")], "pg")
    ahead = time.time() + 60
    for name in _objects(sender):
        os.utime(name, (ahead, ahead))
    decider.end_transactions([Decision(p.transaction_id, "pg", COMMIT)], publish=False)
    assert _half_ids(decider) == [p.transaction_id]
    assert _open(settings).land_intake(0.0) == 1  # as retention lands them
    assert _half_ids(decider) == sorted([p.transaction_id, q.transaction_id])
