"""`spark.readStream.format("rmqtx")`: visibility, admission control, checkpoint replay."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path

import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.messages import queue_for

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK


def stream(spark, store: Store, **options):
    reader = spark.readStream.format("rmqtx").option("path", store.root).option("topic", "Orders")
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def commit(store: Store, bodies: list[str], state=COMMIT) -> list[str]:
    prepared = store.prepare([Message("Orders", b, keys=b) for b in bodies], "pg")
    store.end_transactions([Decision(p.transaction_id, "pg", state) for p in prepared])
    return [p.msg_id for p in prepared]


def run_available(df, checkpoint: Path, row) -> tuple[list[tuple[int, list]], list]:
    """Run to the latest offsets with Trigger.AvailableNow; return each batch's id and
    ``row(r)`` of its rows, and the query's progress reports."""
    batches: list[tuple[int, list]] = []

    def collect(batch_df, batch_id: int) -> None:
        batches.append((batch_id, [row(r) for r in batch_df.collect()]))

    query = (
        df.writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    try:
        assert query.awaitTermination(300)
        progress = query.recentProgress
    finally:
        query.stop()
    return batches, progress


def run_batches(df, checkpoint: Path) -> list[tuple[int, list[str]]]:
    """Run to the latest offsets with Trigger.AvailableNow; return (batch id, msg ids)."""
    batches, _ = run_available(df, checkpoint, lambda r: r["msg_id"])
    return [(batch_id, sorted(ids)) for batch_id, ids in batches]


def test_only_committed_and_later_commits_arrive(spark, store: Store) -> None:
    first = commit(store, ["a", "b"])
    commit(store, ["rolled-back"], ROLLBACK)
    (pending,) = store.prepare([Message("Orders", b"late", keys="late")], "pg")
    name = f"rmqtx_{uuid.uuid4().hex}"
    query = stream(spark, store).writeStream.format("memory").queryName(name).start()
    try:
        query.processAllAvailable()
        assert sorted(r["msg_id"] for r in spark.table(name).collect()) == sorted(first)
        store.end_transactions([Decision(pending.transaction_id, "pg", COMMIT)])
        query.processAllAvailable()
        rows = spark.table(name).collect()
    finally:
        query.stop()
    assert sorted(r["msg_id"] for r in rows) == sorted([*first, pending.msg_id])
    assert b"rolled-back" not in {bytes(r["body"]) for r in rows}


def test_max_messages_per_trigger_with_available_now(spark, store: Store, tmp_path) -> None:
    ids = commit(store, [f"m{i}" for i in range(10)])
    batches = run_batches(stream(spark, store, maxMessagesPerTrigger="3"), tmp_path / "cp")
    assert [len(b) for _, b in batches] == [3, 3, 3, 1]
    assert sorted(i for _, b in batches for i in b) == sorted(ids)


def test_restart_replays_the_same_batch_then_goes_on(spark, store: Store, tmp_path) -> None:
    checkpoint = tmp_path / "cp"
    commit(store, [f"m{i}" for i in range(5)])
    df = stream(spark, store, maxMessagesPerTrigger="2")
    first = run_batches(df, checkpoint)
    assert [len(b) for _, b in first] == [2, 2, 1]
    # As in Spark's own exactly-once tests: forget the last batch's commit, add data, restart.
    last_id, last_rows = first[-1]
    (checkpoint / "commits" / str(last_id)).unlink()
    (checkpoint / "commits" / f".{last_id}.crc").unlink(missing_ok=True)
    more = commit(store, ["n1", "n2", "n3"])
    second = run_batches(df, checkpoint)
    assert second[0] == (last_id, last_rows)  # the same offsets, so the same messages
    seen = [i for _, b in first[:-1] + second for i in b]
    assert len(seen) == len(set(seen)) == 8
    assert set(more) <= set(seen)


def test_concurrent_producer_while_streaming_loses_nothing(spark, store: Store, tmp_path) -> None:
    import threading

    sent: list[str] = []
    done = threading.Event()

    def produce() -> None:
        for i in range(20):
            sent.extend(commit(store, [f"c{i}-{j}" for j in range(3)]))
        done.set()

    name = f"rmqtx_{uuid.uuid4().hex}"
    query = (
        stream(spark, store, maxMessagesPerTrigger="7")
        .writeStream.format("memory")
        .queryName(name)
        .trigger(processingTime="200 milliseconds")
        .start()
    )
    producer = threading.Thread(target=produce)
    try:
        producer.start()
        producer.join(timeout=300)
        assert done.is_set()
        query.processAllAvailable()
        seen = [r["msg_id"] for r in spark.table(name).collect()]
    finally:
        query.stop()
    assert len(seen) == len(set(seen))
    assert sorted(seen) == sorted(sent)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"maxMessagesPerTrigger": "0"}, "maxMessagesPerTrigger needs to be an integer >= 1"),
        ({"maxBytesPerTrigger": "lots"}, "'maxBytesPerTrigger' needs a size .* such as '1048576'"),
        (
            {"maxOffsetsPerTrigger": "5"},
            r"unknown option\(s\) 'maxOffsetsPerTrigger'.*use 'maxMessagesPerTrigger'.*"
            "valid options: path",
        ),
        ({"startingOffset": "earliest"}, "did you mean 'startingOffsets'"),
        ({"consumerGroup": "bad group!"}, "option consumerGroup 'bad group!' is not valid"),
    ],
)
def test_bad_stream_options_fail_at_load(spark, store: Store, options, match) -> None:
    """Raised by readStream...load() itself, as Spark's Kafka source does: no query starts."""
    from pyspark.errors import StreamingQueryException

    with pytest.raises(Exception, match=match) as raised:
        stream(spark, store, **options)
    assert not isinstance(raised.value, StreamingQueryException)
    assert "STREAM_FAILED" not in str(raised.value)


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"endingOffsets": "latest"}, "'endingOffsets' is for batch reads only"),
        ({"endingTimestamp": "0"}, "'endingTimestamp' is for batch reads only"),
    ],
)
def test_batch_only_options_fail_when_the_stream_starts(
    spark, store: Store, tmp_path, options, match
) -> None:
    """Spark does not tell a source at load() whether it is read as a stream; these fail at
    the query's start, with the source's message (not PySpark's UnboundLocalError)."""
    df = stream(spark, store, **options)  # a batch read takes them
    with pytest.raises(Exception, match=match) as raised:
        run_batches(df, tmp_path / "cp")
    assert "UnboundLocalError" not in str(raised.value)


def test_a_user_schema_fails_when_the_stream_starts(spark, store: Store, tmp_path) -> None:
    df = (
        spark.readStream.format("rmqtx")
        .schema("body binary")
        .option("path", store.root)
        .option("topic", "Orders")
        .load()
    )
    with pytest.raises(Exception, match="has a fixed schema and cannot be set") as raised:
        run_batches(df, tmp_path / "cp")
    assert "UnboundLocalError" not in str(raised.value)


def test_a_missing_topic_fails_stream_load_with_fail_on_missing_topic(spark, store) -> None:
    commit(store, ["a"])
    with pytest.raises(Exception, match=r"'orders' have no messages.*did you mean 'Orders'"):
        stream(spark, store, topic="orders", failOnMissingTopic="true")
    stream(spark, store, topic="orders")  # a warning only: the topic may get messages later


def run_sized(df, checkpoint: Path) -> tuple[list[list[tuple[str, int]]], list]:
    """Run to the latest offsets with Trigger.AvailableNow; return each non-empty batch's
    (msg id, body size) and the query's progress reports."""
    batches, progress = run_available(df, checkpoint, lambda r: (r["msg_id"], len(r["body"])))
    return [rows for _, rows in batches if rows], progress


def test_max_bytes_per_trigger_bounds_batches(spark, store: Store, tmp_path) -> None:
    """10 messages of 1 KiB, at most 3 KiB a batch: bounded batches, none lost or repeated.
    Sizes are estimated from the CommitLog files (stored bytes, about 1.4 KiB a message
    here), so batches hold 2 messages (2 KiB of bodies)."""
    import os

    prepared = store.prepare(
        [Message("Orders", os.urandom(1024), keys=f"k{i}") for i in range(10)], "pg"
    )
    store.end_transactions([Decision(p.transaction_id, "pg", COMMIT) for p in prepared])
    ids = sorted(p.msg_id for p in prepared)
    batches, progress = run_sized(stream(spark, store, maxBytesPerTrigger="3k"), tmp_path / "a")
    assert len(batches) >= 4
    assert all(1 <= len(b) <= 3 and sum(size for _, size in b) <= 3 * 1024 for b in batches)
    assert sorted(i for b in batches for i, _ in b) == ids  # nothing lost, nothing twice
    # The backlog after each batch, in the progress the source reports (reportLatestOffset).
    latest = [json.loads(p.sources[0].latestOffset) for p in progress if p.numInputRows]
    behind = [offset["messagesBehindLatest"] for offset in latest]
    assert behind == [10 - sum(len(b) for b in batches[: i + 1]) for i in range(len(batches))]
    assert latest[0]["offsets"] == {
        "Orders": {str(q): n for q, n in sorted(_per_queue(store).items())}
    }
    # Spark names a Python source by its JVM class (PythonMicroBatchStream...@309fb014, #49):
    # the progress says what it reads beside its offsets.
    assert {offset["source"] for offset in latest} == {"rmqtx[topic=Orders]"}
    # Combined with maxMessagesPerTrigger, the cap hit first wins.
    both = stream(spark, store, maxBytesPerTrigger="1m", maxMessagesPerTrigger="4")
    assert [len(b) for b in run_sized(both, tmp_path / "b")[0]] == [4, 4, 2]
    # A cap below one message still reads one a batch: progress is guaranteed.
    tiny = run_sized(stream(spark, store, maxBytesPerTrigger="1"), tmp_path / "c")[0]
    assert [len(b) for b in tiny] == [1] * 10


def _per_queue(store: Store) -> dict[int, int]:
    return {q: n for (t, q), n in store.next_offsets().items() if t == "Orders"}


def test_delta_streaming_source_sees_the_same_messages(spark, store: Store, tmp_path) -> None:
    commit(store, [f"m{i}" for i in range(6)])
    commit(store, ["x"], ROLLBACK)
    store.send([Message("Other", b"o")], "pg")
    via_rmqtx = {i for _, b in run_batches(stream(spark, store), tmp_path / "a") for i in b}
    delta = (
        spark.readStream.format("delta")
        .load(store.table_uri("commitlog"))
        .where("topic = 'Orders'")
    )
    via_delta = {i for _, b in run_batches(delta, tmp_path / "b") for i in b}
    assert via_rmqtx == via_delta and len(via_delta) == 6
    assert delta.columns == stream(spark, store).columns


def test_consumer_group_progress_is_recorded(spark, store: Store, tmp_path) -> None:
    commit(store, [f"m{i}" for i in range(5)])
    df = stream(spark, store, consumerGroup="billing", maxMessagesPerTrigger="2")
    batches = run_batches(df, tmp_path / "cp")
    assert [len(b) for _, b in batches] == [2, 2, 1]
    progress = store.read("consumer_offsets").to_pylist()
    assert {r["consumer_group"] for r in progress} == {"billing"}
    # The last batch of the run is recorded too: a caught-up group has no lag.
    assert sum(r["next_offset"] for r in progress) == 5
    with pytest.raises(Exception, match="option consumerGroup 'bad group!' is not valid"):
        run_batches(stream(spark, store, consumerGroup="bad group!"), tmp_path / "cp2")


def _keys_for(queue_id: int, queue_nums: int = 4) -> str:
    return next(k for k in (f"k{i}" for i in range(1000)) if queue_for(k, queue_nums) == queue_id)


def test_starting_offsets_of_a_queue_without_messages_yet_are_honoured(
    spark, store: Store, tmp_path
) -> None:
    four = Store.open(store.root, settings=Settings(store=StoreSettings(queue_nums=4)))
    q0, q3 = _keys_for(0), _keys_for(3)

    def send(keys: str, n: int) -> list[str]:
        prepared = four.prepare(
            [Message("Orders", f"{keys}-{i}", keys=keys) for i in range(n)], "pg"
        )
        four.end_transactions([Decision(p.transaction_id, "pg", COMMIT) for p in prepared])
        return [p.msg_id for p in prepared]

    first = send(q0, 4)
    df = stream(spark, store, startingOffsets='{"Orders": {"0": 2, "3": 5}}')
    batches = run_batches(df, tmp_path / "cp")
    assert sorted(i for _, b in batches for i in b) == sorted(first[2:])
    later = send(q3, 7)  # queue 3 appears after the query started
    batches = run_batches(df, tmp_path / "cp")
    assert sorted(i for _, b in batches for i in b) == sorted(later[5:])


@pytest.mark.parametrize("offsets", ['{"Orders": {"4": 0}}', '{"Orders": {"0": 0, "17": 3}}'])
def test_starting_offsets_of_a_queue_the_store_does_not_have_are_an_error(
    spark, store: Store, tmp_path, offsets
) -> None:
    commit(store, ["a"])
    with pytest.raises(Exception, match=r"names queue (4|17) of topic 'Orders'.*queues 0 to 3"):
        run_batches(stream(spark, store, startingOffsets=offsets), tmp_path / "cp")
    with pytest.raises(Exception, match=r"names queue (4|17) of topic 'Orders'.*queues 0 to 3"):
        spark.read.format("rmqtx").option("path", store.root).option("topic", "Orders").option(
            "startingOffsets", offsets
        ).load().collect()


def test_a_checkpoint_behind_retention_fails_or_skips_the_lost_range(
    spark, store: Store, tmp_path
) -> None:
    """Retention removed messages a stopped stream had not read: by default the restarted
    stream fails naming the lost range; with failOnDataLoss false it reads exactly the rest."""
    from datetime import UTC, datetime, timedelta

    from rmq_spark.store.retention import maintain

    long_ago = datetime.now(UTC) - timedelta(hours=100)
    old = Store.open(store.root, clock=lambda: long_ago)

    def send(s: Store, bodies: list[str]) -> list[str]:
        return [
            m for m, _, _ in s.send([Message("Orders", b, keys="k") for b in bodies], "pg").sent
        ]

    send(old, ["o0", "o1"])
    checkpoint = tmp_path / "cp"
    assert len(run_batches(stream(spark, store), checkpoint)[0][1]) == 2
    send(old, ["o2", "o3", "o4"])
    young = send(store, ["y0", "y1"])
    assert maintain(store).messages_expired == 5
    queue = queue_for("k", store.settings.queue_nums)
    with pytest.raises(Exception, match=rf"DATA_LOSS.*Orders queue {queue} offsets \[2, 5\)"):
        run_batches(stream(spark, store), checkpoint)
    batches = run_batches(stream(spark, store, failOnDataLoss="false"), checkpoint)
    assert [ids for _, ids in batches] == [sorted(young)]


def test_a_single_batch_run_and_an_idle_query_record_a_caught_up_group(
    spark, store: Store, tmp_path
) -> None:
    commit(store, ["a", "b", "c"])
    assert [
        len(b) for _, b in run_batches(stream(spark, store, consumerGroup="once"), tmp_path / "o")
    ] == [3]
    name = f"rmqtx_{uuid.uuid4().hex}"
    query = (
        stream(spark, store, consumerGroup="idle")
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "i"))
        .trigger(processingTime="1 second")
        .start()
    )
    try:
        query.processAllAvailable()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and _recorded(store, "idle") != 3:
            time.sleep(0.5)
    finally:
        query.stop()
    assert {g: _recorded(store, g) for g in ("once", "idle")} == {"once": 3, "idle": 3}


def _recorded(store: Store, group: str) -> int:
    rows = store.query("consumer_offsets", f"consumer_group = '{group}'")
    return sum(rows.column("next_offset").to_pylist())
