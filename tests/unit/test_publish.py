"""Publishing a backlog in bounded chunks, and queue offsets read once per snapshot (no Spark).

Every chunked publish must keep the contract: each committed message in ``commitlog`` exactly
once, dense offsets per queue, decision order, whatever publishers race or die.
"""

from __future__ import annotations

import os
import random
import re
import subprocess
import sys
import textwrap
import threading
import time
from collections import defaultdict
from pathlib import Path
from urllib.parse import unquote

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.delta.files import read_ahead, write_in_parallel
from rmq_spark.delta.reads import read_arrow
from rmq_spark.delta.storage import arrow_filesystem, scheme
from rmq_spark.delta.txnlog import app_transactions, follow
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.errors import CorruptStoreError, StoreError
from rmq_spark.model.schema import COMMITLOG_SCHEMA, TABLES
from rmq_spark.store.queues import OP_CURSOR_APP_ID, assign_offsets, queue_app_id
from tests.conftest import commitlog, foreign_compaction_after_the_stores, race
from tests.latency_proxy import LatencyProxy

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK
REPO = Path(__file__).resolve().parents[2]


def open_store(root: Path | str, **limits: int) -> Store:
    return Store.open(root, settings=Settings(store=StoreSettings(queue_nums=3, **limits)))


def backlog(store: Store, decisions: int, seed: int = 7) -> list[str]:
    """Decide ``decisions`` transactions one op version each (some rolled back, some of several
    messages, in an order unlike their sends), publishing nothing; return the bodies of the
    committed messages in decision order."""
    rng = random.Random(seed)
    prepared: list[tuple[str, list[str]]] = []
    for t in range(decisions):
        bodies = [f"t{t}-m{m}" for m in range(rng.choice([1, 1, 1, 2, 4]))]
        txn = f"txn-{t:04d}"
        store.prepare(
            [Message(rng.choice(["A", "B"]), b, keys=f"k{rng.randrange(5)}") for b in bodies],
            "pg",
            transaction_ids=[txn] * len(bodies),
        )
        prepared.append((txn, bodies))
    rng.shuffle(prepared)
    expected = []
    for txn, bodies in prepared:
        state = COMMIT if rng.random() < 0.8 else ROLLBACK
        store.end_transactions([Decision(txn, "pg", state)], publish=False)
        if state is COMMIT:
            expected += bodies
    return expected


def publish_commits(store: Store) -> list[list[bytes]]:
    """The bodies written by each publish commit of ``commitlog``, in commit order."""
    changes = read_arrow(store.table("commitlog").load_cdf(starting_version=0))
    changes = changes.filter(pc.equal(changes.column("_change_type"), "insert"))
    by_version: dict[int, list[bytes]] = defaultdict(list)
    for row in changes.sort_by([("_commit_version", "ascending")]).to_pylist():
        by_version[row["_commit_version"]].append(row["body"])
    return [by_version[v] for v in sorted(by_version)]


def check_published(store: Store, expected: list[str]) -> None:
    """Exactly once; commits hold consecutive runs of the decision order; in each queue, dense
    offsets in decision order; the op cursor at the end."""
    commit_of = {b.decode(): i for i, bodies in enumerate(publish_commits(store)) for b in bodies}
    assert sorted(commit_of) == sorted(expected) and len(commit_of) == len(expected)
    order = [commit_of[b] for b in expected]
    assert order == sorted(order)
    rows = commitlog(store).to_pylist()
    queues: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in rows:
        queues[(r["topic"], r["queue_id"])].append(r)
    for queue, mine in queues.items():
        assert [r["queue_offset"] for r in mine] == list(range(len(mine))), queue
        bodies = {r["body"].decode() for r in mine}
        assert [r["body"].decode() for r in mine] == [b for b in expected if b in bodies], queue
    assert store.next_offsets() == {q: len(mine) for q, mine in queues.items()}
    cursor = store.table("commitlog").transaction_version(OP_CURSOR_APP_ID)
    assert cursor == store.table("op").version()


def test_backlog_is_published_in_chunks_within_the_message_limit(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", publish_max_messages=5)
    expected = backlog(store, 40)
    result = store.publish()
    assert result.published == len(expected)
    check_published(store, expected)
    commits = publish_commits(store)
    assert all(len(bodies) <= 5 for bodies in commits)
    assert len(commits) >= len(expected) // 5
    assert store.publish().published == 0


def test_backlog_is_published_in_chunks_within_the_byte_limit(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", publish_max_bytes=30)  # bodies of 5 or 6 bytes
    expected = backlog(store, 30, seed=3)
    store.publish()
    check_published(store, expected)
    assert all(sum(len(b) for b in bodies) <= 30 for bodies in publish_commits(store))


def test_one_decision_larger_than_the_limits_is_one_commit(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", publish_max_messages=3)
    store.prepare([Message("A", f"small-{i}") for i in range(2)], "pg", transaction_ids=["s"] * 2)
    store.prepare([Message("A", f"big-{i}") for i in range(8)], "pg", transaction_ids=["b"] * 8)
    for txn in ("s", "b"):
        store.end_transactions([Decision(txn, "pg", COMMIT)], publish=False)
    store.send([Message("A", "normal")], "pg")
    # (Rows of one commit have no order of their own: offsets order them within a queue.)
    commits = [sorted(b.decode() for b in bodies) for bodies in publish_commits(store)]
    assert commits == [
        ["small-0", "small-1"],
        [f"big-{i}" for i in range(8)],  # streamed: normal messages go in a commit of their own
        ["normal"],
    ]
    check_published(store, ["small-0", "small-1", *[f"big-{i}" for i in range(8)], "normal"])


def test_a_large_decision_whose_half_messages_another_writer_stored_twice_is_published_once(
    tmp_path: Path,
) -> None:
    """A deltalake ``optimize.compact()`` of ``half`` racing the store's compaction leaves its
    files' messages stored twice; a decision too large to hold is streamed from the files
    that may hold it, and published every copy."""
    bodies = [f"big-{i}" for i in range(8)]
    store = open_store(tmp_path / "s", publish_max_messages=3)
    for part in (bodies[:4], bodies[4:]):  # two half files
        store.prepare([Message("A", b) for b in part], "pg", transaction_ids=["b"] * 4)
    foreign_compaction_after_the_stores(store, "half")
    other = open_store(tmp_path / "s", publish_max_messages=3)  # reads "b" from half
    other.end_transactions([Decision("b", "pg", COMMIT)])
    rows = commitlog(other)
    assert sorted(b.decode() for b in rows.column("body").to_pylist()) == bodies
    assert sum(other.next_offsets().values()) == len(bodies)  # dense: nothing skipped


def test_a_large_version_reports_its_progress_and_its_end(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Publishing one large decision (a sink epoch of a whole job) can take minutes on the
    driver: it logs how far it is at INFO, every PROGRESS_SECONDS, and when it is done."""
    monkeypatch.setattr("rmq_spark.store.chunks.PROGRESS_SECONDS", 0.0)
    monkeypatch.setattr("rmq_spark.delta.files.BATCH_ROWS", 4)  # batches of 4 rows read from half
    store = open_store(tmp_path / "s", publish_max_messages=3)
    store.prepare([Message("A", f"big-{i}") for i in range(10)], "pg", transaction_ids=["b"] * 10)
    store.end_transactions([Decision("b", "pg", COMMIT)], publish=False)
    caplog.clear()  # what the setup logged (the store's creation, when INFO is on already)
    with caplog.at_level("INFO", logger="rmq_spark.store"):
        store.publish()
    lines = [r.getMessage() for r in caplog.records if r.levelname == "INFO"]
    assert [re.sub(r" \(\d+%, \d+ s\)$", "", line) for line in lines] == [
        "publishing one large decision (op version 1): 4 of 10 message(s) copied into commitlog",
        "publishing one large decision (op version 1): 8 of 10 message(s) copied into commitlog",
        "publishing one large decision (op version 1): 10 of 10 message(s) copied into commitlog",
        "published one large decision (op version 1 of shard 0): 10 message(s) in commitlog "
        "version 1",
    ]
    check_published(store, [f"big-{i}" for i in range(10)])


def test_a_large_version_is_read_ahead_in_order_and_its_errors_reach_the_writer() -> None:
    """A publish of a large version reads its next batches on a helper thread while it writes
    the last one: the writer gets every batch in order, a read error after some batches, and
    a writer that stops early stops the helper."""

    def batches(count: int, fail: bool = False):
        for i in range(count):
            yield pa.table({"n": [i]})
        if fail:
            raise CorruptStoreError("half changed under the publisher")

    assert [b["n"][0].as_py() for b in read_ahead(batches(7))] == list(range(7))
    got = []
    with pytest.raises(CorruptStoreError, match="changed under"):
        for b in read_ahead(batches(5, fail=True)):
            got.append(b["n"][0].as_py())
    assert got == list(range(5))
    before = threading.active_count()
    ahead = read_ahead(batches(1000))
    next(ahead)
    ahead.close()  # a writer that failed
    assert threading.active_count() == before


def test_a_parallel_write_keeps_every_row_once_and_in_order(any_store: Store) -> None:
    """A publish of a large version writes pieces of consecutive rows on several threads: the
    files, in the order of their add actions, hold every row once and in order (per topic,
    the partition), and a failure of the rows or of a writer reaches the caller with no
    thread left behind. (The files are left uncommitted, as a failed publish leaves them.)"""
    schema = pa.schema([("topic", pa.string()), ("n", pa.int64()), ("body", pa.binary())])
    uri, options = any_store.table_uri("commitlog"), any_store.settings.storage_options

    def batches(count: int, fail_after: int | None = None):
        for i in range(count):
            if i == fail_after:
                raise CorruptStoreError("half changed under the publisher")
            n = list(range(i * 100, (i + 1) * 100))
            topics = ["A" if k % 3 else "B" for k in n]
            yield pa.table([topics, n, [os.urandom(100)] * 100], schema=schema)

    def write(rows, file_schema=schema):
        return write_in_parallel(uri, rows, file_schema, "topic", options, 3, 50_000)

    before = threading.active_count()
    actions = write(batches(60))
    assert len(actions) > 2 * 6  # many pieces, a file per topic each
    read = defaultdict(list)
    fs, base = arrow_filesystem(uri, options), fsspec.core.strip_protocol(uri)
    for action in actions:
        (topic,) = action.partition_values.values()
        path = f"{base}/{unquote(action.path)}"
        read[topic] += pq.read_table(path, filesystem=fs).column("n").to_pylist()
    assert read["A"] == [k for k in range(6000) if k % 3] and read["B"] == list(range(0, 6000, 3))
    with pytest.raises(CorruptStoreError, match="changed under"):
        write(batches(60, 40))
    bad = pa.schema([("topic", pa.string()), ("n", pa.string()), ("body", pa.binary())])
    with pytest.raises(ValueError, match="schema does not match"):  # a writer fails
        write(batches(60), bad)
    assert threading.active_count() == before
    if scheme(uri) == "file":
        # The failed writes' files are closed, not left open for the collector to finish.
        fds = [os.path.realpath(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")]
        assert not [f for f in fds if f.startswith(base)], fds


def _racing_publisher(root: str, name: str, barrier, out) -> None:
    store = open_store(root, publish_max_messages=4)
    barrier.wait(timeout=120)
    out.put((name, store.publish().published))


def test_racing_publishers_publish_a_backlog_exactly_once(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", publish_max_messages=4)
    expected = backlog(store, 45, seed=11)
    results = race(_racing_publisher, [(store.root, n) for n in ("a", "b", "c")])
    assert sum(results.values()) == len(expected)
    check_published(store, expected)
    assert all(len(bodies) <= 4 for bodies in publish_commits(store))


def test_publisher_killed_between_chunks_and_rerun_publishes_exactly_once(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s", publish_max_messages=4)
    expected = backlog(store, 30, seed=5)
    child = textwrap.dedent(
        f"""
        from rmq_spark import Store
        from rmq_spark.model.config import Settings, StoreSettings
        settings = Settings(store=StoreSettings(queue_nums=3, publish_max_messages=4))
        Store.open({store.root!r}, settings=settings).publish()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child],
        env={**os.environ, "PYTHONPATH": str(REPO), "RMQ_SPARK_FAILPOINT": "publish.chunk"},
        start_new_session=True,  # the failpoint kills the child's whole session
        capture_output=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr.decode()
    first = publish_commits(store)
    assert len(first) == 1 and 0 < len(first[0]) <= 4  # died after its first chunk
    assert store.publish().published == len(expected) - len(first[0])
    check_published(store, expected)


def test_the_commitlog_log_follows_its_log_retention(tmp_path: Path) -> None:
    """A store that publishes for months: the CommitLog's log entries older than its
    ``delta.logRetentionDuration`` go at each checkpoint (deltalake's post-commit hook did it
    for its own commits; rmq-spark's direct commits must too), or every snapshot update of
    it would list a log that only grows."""
    store = open_store(tmp_path / "s")
    store.table("commitlog").alter.set_table_properties(
        {"delta.checkpointInterval": "5", "delta.logRetentionDuration": "interval 1 seconds"}
    )
    log_dir = Path(store.table_uri("commitlog")) / "_delta_log"
    for i in range(6):
        store.send([Message("A", f"early-{i}")], "svc")
    old = time.time() - 60
    for entry in log_dir.glob("*.json"):
        os.utime(entry, (old, old))
    for i in range(6):
        store.send([Message("A", f"late-{i}")], "svc")
    versions = sorted(int(p.name[:20]) for p in log_dir.glob("*.json"))
    assert versions[0] >= 5, versions  # the early entries a checkpoint covers are gone
    assert commitlog(store).num_rows == 12


@pytest.mark.objectstore
def test_a_publish_reads_each_new_op_entry_once(minio) -> None:
    """The store-wide publisher looks at every shard's ``op`` each round: a snapshot update
    read each new log entry twice and the decisions' ``commitInfo`` read it a third time (a
    GET each on S3, the publisher's round trips that set the publish lag). Following the log
    reads each once."""
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0.0, record=True).start()
    try:
        options = dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        root = minio.root()
        store = Store.open(
            settings=Settings(store=StoreSettings(path=root, storage_options=options))
        )
        store.publish()  # this thread has looked at op: the next publish follows its log
        bodies = backlog(store, 3)
        proxy.requests.clear()
        assert store.publish().published == len(bodies)
        op_entries = [
            t
            for m, t in proxy.requests
            if m == "GET" and re.search(r"/op/_delta_log/\d+\.json$", t)
        ]
        assert op_entries and len(op_entries) == len(set(op_entries)), op_entries
        assert sorted(commitlog(store).column("body").to_pylist()) == sorted(
            b.encode() for b in bodies
        )
    finally:
        proxy.stop()


def test_a_publisher_notices_a_change_of_the_commitlog_made_by_another_writer(
    store: Store,
) -> None:
    """A publisher reads the CommitLog's log on from the version it knows instead of loading
    a snapshot; a table change among those entries (here a CHECK constraint, which its
    writer cannot honour) is seen, and the publish is refused, not written around it."""
    store.send([Message("A", b"before")], "pg")
    DeltaTable(store.table_uri("commitlog")).alter.add_constraint({"small": "queue_id < 100"})
    with pytest.raises(StoreError, match="small.*must not be altered"):
        store.send([Message("A", b"after")], "pg")
    assert commitlog(store).column("body").to_pylist() == [b"before"]


def test_every_table_is_checkpointed(tmp_path: Path) -> None:
    store = open_store(tmp_path / "s")
    for name in TABLES:
        config = store.table(name).metadata().configuration
        assert config.get("delta.checkpointInterval") == "100", name
    # deltalake writes the checkpoint in the commit that reaches the interval, whatever the
    # operation: appends (half), MERGEs (op, locks), publishes (commitlog), compactions.
    for name in ("half", "op", "commitlog", "locks"):
        store.table(name).alter.set_table_properties({"delta.checkpointInterval": "4"})
    for i in range(6):
        (p,) = store.prepare([Message("A", f"m{i}")], "pg")
        store.end_transactions([Decision(p.transaction_id, "pg", COMMIT)])
    store.compact()
    for name in ("half", "op", "commitlog", "locks"):
        log_dir = Path(store.table_uri(name)) / "_delta_log"
        assert list(log_dir.glob("*.checkpoint.parquet")), name


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_next_offsets_equal_transaction_version_on_random_histories(
    tmp_path: Path, seed: int
) -> None:
    rng = random.Random(seed)
    store = open_store(tmp_path / "s")
    uri = store.table_uri("commitlog")
    store.table("commitlog").alter.set_table_properties(
        {"delta.checkpointInterval": str(rng.choice([3, 5, 7]))}
    )
    topics = ["A", "B", "C-x", "D_y"]
    start = store.table("commitlog")
    known = start.version(), dict(app_transactions(start, uri, {}))
    for _ in range(25):
        messages = [
            Message(rng.choice(topics), b"x", keys=f"k{rng.randrange(9)}")
            for _ in range(rng.randrange(1, 6))
        ]
        store.send(messages, "pg")
        if rng.random() < 0.2:
            store.compact("commitlog")
        if rng.random() < 0.4:  # a fresh snapshot, or the cached one moved on incrementally
            _check_offsets(DeltaTable(uri), uri, topics)
    _check_offsets(store.table("commitlog"), uri, topics)
    # Reading the log on from a known version (as a publisher does) finds the same.
    latest = store.table("commitlog")
    assert follow(uri, {}, *known) == (latest.version(), _deltalake_answers(latest, topics))
    # Old snapshots (the newest checkpoint is past them) read the same as deltalake says,
    # also when the checkpoint before them is gone (the log is listed).
    old = rng.sample(range(1, store.table("commitlog").version()), 6)
    for version in old[:3]:
        _check_offsets(DeltaTable(uri, version=version), uri, topics)
    checkpoints = sorted(Path(uri, "_delta_log").glob("*.checkpoint.parquet"))
    for version in old[3:]:
        table = DeltaTable(uri, version=version)
        expected = _deltalake_answers(table, topics)  # deltalake reads the checkpoint lazily
        earlier = [c for c in checkpoints[:-1] if int(c.name.split(".")[0]) <= version]
        if earlier:
            earlier[-1].unlink(missing_ok=True)
        assert dict(app_transactions(table, uri, {})) == expected, version


def _check_offsets(table: DeltaTable, uri: str, topics: list[str]) -> None:
    assert dict(app_transactions(table, uri, {})) == _deltalake_answers(table, topics)


def _deltalake_answers(table: DeltaTable, topics: list[str]) -> dict[str, int]:
    """deltalake's answers for every application id a publish can have written."""
    app_ids = [queue_app_id(t, q) for t in topics for q in range(3)] + [OP_CURSOR_APP_ID]
    answers = {app_id: table.transaction_version(app_id) for app_id in app_ids}
    return {app_id: version for app_id, version in answers.items() if version is not None}


def _grown_mib(setup: str, action: str) -> tuple[str, int]:
    """Run ``setup`` then ``action`` (which sets ``result``) in a new Python process; return
    ``str(result)`` and how many MiB the process's peak memory grew during ``action``."""
    child = "\n".join(
        [
            "import resource",
            textwrap.dedent(setup),
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss",
            textwrap.dedent(action),
            "grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before",
            "print(result, grown // 1024)",
        ]
    )
    out = subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, check=True
    )
    result, grown = out.stdout.split()
    return result, int(grown)


def test_a_decision_larger_than_memory_is_published_in_bounded_memory(tmp_path: Path) -> None:
    """A sink epoch is one decision of every row the job wrote, published by one Python
    process on the driver: reading it whole would fail any epoch larger than that memory.
    Here 256 MiB, published with a peak of well under that (1.4 GiB when read whole)."""
    store = open_store(tmp_path / "s", publish_max_bytes=1 << 20)
    for part in range(4):  # four tasks' stages of one epoch
        bodies = [os.urandom(1 << 20) for _ in range(64)]
        store.prepare([Message("A", b) for b in bodies], "pg", transaction_ids=[f"t{part}"] * 64)
    store.end_transactions([Decision(f"t{part}", "pg", COMMIT) for part in range(4)], publish=False)
    published, grown = _grown_mib(
        f"""
        from rmq_spark import Store
        from rmq_spark.model.config import Settings, StoreSettings
        settings = Settings(store=StoreSettings(queue_nums=3, publish_max_bytes=1 << 20))
        store = Store.open({store.root!r}, settings=settings)
        store.table("commitlog"), store.table("half"), store.table("op")
        """,
        "result = store.publish().published",
    )
    assert int(published) == 256
    assert grown < 160, f"the publisher's peak memory grew by {grown} MiB"
    offsets = defaultdict(list)
    for r in commitlog(store).select(["queue_id", "queue_offset"]).to_pylist():
        offsets[r["queue_id"]].append(r["queue_offset"])
    assert offsets and all(sorted(o) == list(range(len(o))) for o in offsets.values())


def test_a_sink_task_stages_more_rows_than_memory_in_bounded_memory(tmp_path: Path) -> None:
    """A sink task stages its whole partition as one transaction: 256 MiB staged with a peak
    of well under that (deltalake's writer alone would grow the process by over 1 GiB)."""
    store = open_store(tmp_path / "s")
    staged, grown = _grown_mib(
        f"""
        import os
        import pyarrow as pa
        from pyspark.sql.types import BinaryType, StructField, StructType
        from rmq_spark import Store
        from rmq_spark.spark.sink_options import WriterOptions
        from rmq_spark.spark.staging import stage
        schema = StructType([StructField("body", BinaryType())])
        options = WriterOptions.parse(
            {{"path": {store.root!r}, "topic": "A", "producerGroup": "pg"}}, schema
        )
        store = Store.open({store.root!r}, create=False)
        store.table("half")
        def batches():  # as Spark hands them to a task: made as they are read
            for _ in range(64):
                yield pa.record_batch([[os.urandom(1 << 20) for _ in range(4)]], names=["body"])
        """,
        "result = stage(store, batches(), options, 'sink', 0, 0).count",
    )
    assert int(staged) == 256
    assert grown < 160, f"the task's peak memory grew by {grown} MiB"
    assert store.read("half", ["transaction_id"]).num_rows == 256


@pytest.mark.parametrize("rows", [0, 1, 7, 2000])
def test_offsets_are_dense_per_queue_in_the_order_of_the_rows(rows: int) -> None:
    """Each row takes its queue's next offset, in the order of the rows (over several
    chunks), and each queue's next offset is where its last row left it."""
    rng = random.Random(rows)
    made = [
        {f.name: None for f in COMMITLOG_SCHEMA}
        | {"topic": rng.choice(["A", "B", "%RETRY%g"]), "queue_id": rng.randint(0, 3)}
        for _ in range(rows)
    ]
    table = pa.Table.from_pylist(made, COMMITLOG_SCHEMA)
    table = pa.concat_tables([table.slice(0, rows // 3), table.slice(rows // 3)])
    before = {("A", 1): 10, ("B", 3): 4, ("C", 0): 99}
    numbered, after = assign_offsets(before, table)
    expected, running = [], dict(before)
    for row in made:
        queue = (row["topic"], row["queue_id"])
        expected.append(running.get(queue, 0))
        running[queue] = expected[-1] + 1
    assert numbered.column("queue_offset").to_pylist() == expected
    assert after == {q: n for q, n in running.items() if q not in before or n != before[q]}
