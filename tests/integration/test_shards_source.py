"""`format("rmqtx")` on a store of several shards: every shard's CommitLog is read, each
committed message once, with replayable offsets, and shards made later are read too."""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.errors import DataLossError
from rmq_spark.model.messages import shard_of_queue
from rmq_spark.spark.offsets import latest_offsets
from rmq_spark.spark.reading import plan_slices, read_slice
from tests.integration.test_source_stream import run_available, run_batches

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK


def _open(root: Path | str, shards: int) -> Store:
    return Store.open(root, settings=StoreSettings(queue_nums=2, shards=shards))


@pytest.fixture
def sharded(tmp_path: Path) -> Store:
    """A store of three shards on local disk."""
    return _open(tmp_path / "store", 3)


def commit(store: Store, shard: int, bodies: list[str], state=COMMIT) -> list[str]:
    """Messages prepared in shard ``shard`` of ``store``, then decided through its root (which
    routes each decision to its transaction's shard); their msg ids."""
    prepared = store.shard_store(shard).prepare(
        [Message("Orders", b, keys=b) for b in bodies], "pg"
    )
    store.end_transactions([Decision(p.transaction_id, "pg", state) for p in prepared])
    return [p.msg_id for p in prepared]


def fill(store: Store, shards: range, n: int = 4, tag: str = "m") -> list[str]:
    """``n`` committed messages in each of ``shards``, with a rolled-back and a pending one
    beside them; the committed ones' msg ids."""
    ids = []
    for k in shards:
        ids += commit(store, k, [f"{tag}{k}-{i}" for i in range(n)])
        commit(store, k, [f"{tag}{k}-rolled-back"], ROLLBACK)
        store.shard_store(k).prepare([Message("Orders", f"{tag}{k}-pending")], "pg")
    return ids


def stream(spark, store: Store, **options):
    reader = spark.readStream.format("rmqtx").option("path", store.root).option("topic", "Orders")
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def read(spark, store: Store, **options) -> list[tuple[str, int, int]]:
    """A batch read: (msg id, queue id, queue offset) of every row, sorted."""
    reader = spark.read.format("rmqtx").option("path", store.root).option("topic", "Orders")
    for key, value in options.items():
        reader = reader.option(key, value)
    return sorted((r["msg_id"], r["queue_id"], r["queue_offset"]) for r in reader.load().collect())


def test_a_batch_read_returns_every_shards_committed_messages_once(spark, sharded: Store) -> None:
    committed = fill(sharded, range(3))
    rows = read(spark, sharded)
    assert sorted(m for m, _, _ in rows) == sorted(committed)  # nothing pending or rolled back
    assert {shard_of_queue(q) for _, q, _ in rows} == {0, 1, 2}
    by_queue: dict[int, list[int]] = {}
    for _, queue, offset in rows:
        by_queue.setdefault(queue, []).append(offset)
    assert all(sorted(o) == list(range(len(o))) for o in by_queue.values())


def test_starting_offsets_and_timestamps_cover_every_shard(spark, sharded: Store) -> None:
    fill(sharded, range(3))
    time.sleep(0.01)
    since = int(time.time() * 1000)
    time.sleep(0.01)
    later = fill(sharded, range(3), n=2, tag="late")
    assert [m for m, _, _ in read(spark, sharded, startingTimestamp=str(since))] == sorted(later)
    everything = read(spark, sharded)
    queue = max(q for _, q, _ in everything)  # one of shard 2's
    assert shard_of_queue(queue) == 2
    offsets = f'{{"Orders": {{"{queue}": 1}}}}'
    assert read(spark, sharded, startingOffsets=offsets) == [
        r for r in everything if r[1] != queue or r[2] >= 1
    ]
    assert read(spark, sharded, endingOffsets=offsets) == [  # the queues it names only
        r for r in everything if r[1] == queue and r[2] < 1
    ]
    with pytest.raises(Exception, match=r"names queue 3000 .*3 shards, shard k with queues k \*"):
        read(spark, sharded, startingOffsets='{"Orders": {"3000": 0}}')


def test_a_stream_with_max_messages_per_trigger_reads_every_shard_exactly_once(
    spark, sharded: Store, tmp_path: Path
) -> None:
    committed = fill(sharded, range(3))
    batches = run_batches(
        stream(spark, sharded, maxMessagesPerTrigger="5", consumerGroup="billing"),
        tmp_path / "cp",
    )
    assert [len(ids) for _, ids in batches] == [5, 5, 2]
    seen = [i for _, ids in batches for i in ids]
    assert sorted(seen) == sorted(committed)
    # The group's progress is in the root's consumer_offsets, by global queue id.
    progress = sharded.read("consumer_offsets").to_pylist()
    assert {shard_of_queue(r["queue_id"]) for r in progress} == {0, 1, 2}
    assert sum(r["next_offset"] for r in progress) == len(committed)
    assert all(sharded.shard_store(k).read("consumer_offsets").num_rows == 0 for k in (1, 2))
    stored = sum(sharded.data_files("commitlog").column("size_bytes").to_pylist())
    by_bytes = run_batches(
        stream(spark, sharded, maxBytesPerTrigger=str(stored // 3)), tmp_path / "bytes"
    )
    assert len(by_bytes) >= 3
    assert sorted(i for _, ids in by_bytes for i in ids) == sorted(committed)


def test_a_restart_from_the_checkpoint_replays_the_same_batch(
    spark, sharded: Store, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "cp"
    fill(sharded, range(3), n=3)
    df = stream(spark, sharded, maxMessagesPerTrigger="4")
    first = run_batches(df, checkpoint)
    assert [len(ids) for _, ids in first] == [4, 4, 1]
    # As in Spark's own exactly-once tests: forget the last batch's commit, add data, restart.
    last_id, last_rows = first[-1]
    (checkpoint / "commits" / str(last_id)).unlink()
    (checkpoint / "commits" / f".{last_id}.crc").unlink(missing_ok=True)
    more = fill(sharded, range(3), n=1, tag="n")
    second = run_batches(df, checkpoint)
    assert second[0] == (last_id, last_rows)  # the same offsets, so the same messages
    seen = [i for _, ids in first[:-1] + second for i in ids]
    assert len(seen) == len(set(seen)) == 12
    assert set(more) <= set(seen)


def test_a_shard_made_after_the_query_started_is_read(
    spark, sharded: Store, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "cp"
    before = fill(sharded, range(3))
    df = stream(spark, sharded)
    assert sorted(i for _, ids in run_batches(df, checkpoint) for i in ids) == sorted(before)
    grown = _open(sharded.root, 4)  # a producer of the store opens it with four shards
    after = fill(grown, range(4), n=2, tag="after")
    batches, _ = run_available(df, checkpoint, lambda r: (r["msg_id"], r["queue_id"]))
    rows = [r for _, b in batches for r in b]
    assert sorted(i for i, _ in rows) == sorted(after)
    assert {shard_of_queue(q) for _, q in rows} == {0, 1, 2, 3}


def test_a_running_stream_finds_a_shard_made_while_it_runs(spark, tmp_path: Path) -> None:
    store = _open(tmp_path / "store", 1)
    before = commit(store, 0, ["a", "b"])
    name = f"rmqtx_{uuid.uuid4().hex}"
    query = (
        stream(spark, store)
        .writeStream.format("memory")
        .queryName(name)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(processingTime="1 second")
        .start()
    )
    try:
        query.processAllAvailable()
        after = commit(_open(store.root, 2), 1, ["c", "d"])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(spark.table(name).collect()) < 4:
            time.sleep(1)
        rows = spark.table(name).collect()
    finally:
        query.stop()
    assert sorted(r["msg_id"] for r in rows) == sorted(before + after)


def test_rows_removed_from_one_shards_queues_are_data_loss(sharded: Store) -> None:
    fill(sharded, range(3))
    end = latest_offsets(sharded, ["Orders"])
    DeltaTable(sharded.table_uri("commitlog")).delete("queue_offset = 0 AND queue_id >= 2000")
    with pytest.raises(DataLossError, match=r"Orders queue 200\d offsets \[0, 1\)"):
        plan_slices(sharded, {}, end)
    rows = pa.concat_tables(
        pa.Table.from_batches(list(read_slice(s)))
        for s in plan_slices(sharded, {}, end, fail_on_data_loss=False)
    )
    holed = [q for q in end["Orders"] if shard_of_queue(q) == 2]
    assert rows.num_rows == 12 - len(holed)
    assert plan_slices(sharded, {"Orders": dict.fromkeys(holed, 1)}, end)  # past the holes


def test_deltas_own_streaming_source_reads_every_shard_from_one_table(
    spark, sharded: Store, tmp_path: Path
) -> None:
    """The Delta path: a sharded store's committed messages, exactly once, from one Delta
    table (the root's CommitLog) with Delta's own streaming source, shards made later
    included, and replayably from its checkpoint; nothing pending or rolled back."""
    before = fill(sharded, range(3))
    assert sorted(
        DeltaTable(sharded.table_uri("commitlog")).to_pyarrow_table()["msg_id"].to_pylist()
    ) == sorted(before)
    checkpoint = tmp_path / "delta-cp"
    df = spark.readStream.format("delta").load(sharded.table_uri("commitlog"))
    first, _ = run_available(df, checkpoint, lambda r: r["msg_id"])
    assert sorted(i for _, ids in first for i in ids) == sorted(before)
    after = fill(_open(sharded.root, 4), range(4), n=2, tag="after")
    second, _ = run_available(df, checkpoint, lambda r: r["msg_id"])
    assert sorted(i for _, ids in second for i in ids) == sorted(after)


@pytest.mark.objectstore
def test_a_sharded_store_on_s3_is_read_whole(spark, s3_settings, tmp_path: Path) -> None:
    """On an object store too: the shards' offsets and plans are read on threads of their own
    (``storage.<KEY>`` options reach every shard)."""
    store = Store.open(settings=replace(s3_settings.store, shards=3))
    committed = fill(store, range(3))
    storage = {f"storage.{k}": v for k, v in store.settings.storage_options.items()}
    assert sorted(m for m, _, _ in read(spark, store, **storage)) == sorted(committed)
    batches = run_batches(stream(spark, store, maxMessagesPerTrigger="5", **storage), tmp_path)
    assert sorted(i for _, ids in batches for i in ids) == sorted(committed)
