"""Tables written by the Python side (pyarrow files, rmq-spark's own log entries, deltalake)
read back by Spark (delta-spark)."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.model.config import RetentionSettings, Settings, StoreSettings
from rmq_spark.model.schema import COMMITLOG_SCHEMA, HALF_SCHEMA, OP_SCHEMA
from rmq_spark.store.retention import maintain
from tests.conftest import commitlog


@pytest.mark.parametrize(
    "publish_max_messages",
    # 1: the COMMIT's version is over the publish limits, so it is streamed, a batch at a time
    # (rmq_spark/delta/files.py); else it is written in one piece. Either way the files are
    # pyarrow's, with statistics and a log entry of rmq-spark's own (rmq_spark/delta/commit.py).
    [10_000, 1],
    ids=["published-whole", "streamed"],
)
def test_spark_reads_every_table_as_written(
    spark, tmp_path: Path, publish_max_messages: int
) -> None:
    limits = StoreSettings(queue_nums=2, publish_max_messages=publish_max_messages)
    store = Store.open(tmp_path / "store", settings=Settings(store=limits))
    prepared = store.prepare(
        [
            Message(
                "Orders",
                b"\x00\xffbinary",
                tags="TagA",
                keys=["k1", "k2"],
                properties={"region": "eu", "CHECK_IMMUNITY_TIME_IN_SECONDS": "30"},
            ),
            Message("Orders", "text body"),
        ],
        "pg",
    )
    store.end_transactions(
        [Decision(prepared[0].transaction_id, "pg", LocalTransactionState.COMMIT)], publish=False
    )
    Store.open(store.root, settings=store.settings).publish()  # not this process's own halves
    store.send([Message("Payments", b"normal")], "svc")

    paths = store.data_files("commitlog").column("path").to_pylist()
    assert paths and all(".rmqtx." in p for p in paths)

    for name, schema in (("half", HALF_SCHEMA), ("op", OP_SCHEMA), ("commitlog", COMMITLOG_SCHEMA)):
        df = spark.read.format("delta").load(store.table_uri(name))
        assert df.columns == schema.names, name
        python_rows = store.read(name).num_rows
        assert df.count() == python_rows, name

    rows = {
        r["msg_id"]: r
        for r in spark.read.format("delta").load(store.table_uri("commitlog")).collect()
    }
    expected = commitlog(store).to_pylist()
    assert set(rows) == {r["msg_id"] for r in expected}
    for want in expected:
        got = rows[want["msg_id"]]
        assert bytes(got["body"]) == want["body"]
        assert got["properties"] == dict(want["properties"] or [])
        assert (got["topic"], got["queue_id"], got["queue_offset"]) == (
            want["topic"],
            want["queue_id"],
            want["queue_offset"],
        )
        assert (got["keys"], got["tags"], got["transaction_id"]) == (
            want["keys"],
            want["tags"],
            want["transaction_id"],
        )
        assert got["store_timestamp"].timestamp() == want["store_timestamp"].timestamp()
    # Data skipping by the files' statistics keeps every row (timestamps to the microsecond).
    table = spark.read.format("delta").load(store.table_uri("commitlog"))
    for want in expected:
        found = table.where(
            (F.col("msg_id") == want["msg_id"])
            & (F.col("queue_offset") == want["queue_offset"])
            & (F.col("born_timestamp") == F.lit(want["born_timestamp"]))
            & (F.col("store_timestamp") == F.lit(want["store_timestamp"]))
        )
        assert found.count() == 1, want["msg_id"]
    committed = rows[prepared[0].msg_id]
    assert committed["properties"] == {"region": "eu", "CHECK_IMMUNITY_TIME_IN_SECONDS": "30"}
    assert committed["keys"] == "k1 k2"

    op = spark.read.format("delta").load(store.table_uri("op")).collect()
    assert [(r["transaction_id"], r["decision"]) for r in op] == [
        (prepared[0].transaction_id, "COMMIT")
    ]


def test_deletion_vectors_on_the_commitlog_are_refused_not_read_through(
    spark, tmp_path: Path
) -> None:
    """A user enables deletion vectors on the CommitLog and deletes rows with delta-spark: the
    files still hold the rows, and format("rmqtx") read them (delta-spark 98 rows, rmqtx 100).
    The read now refuses the table, naming the feature and how to rewrite it."""
    store = Store.open(tmp_path / "store", settings=Settings(store=StoreSettings(queue_nums=2)))
    for b in range(5):
        store.send([Message("T", f"{b}-{i}", keys=str(i)) for i in range(20)], "pg")
    uri = store.table_uri("commitlog")
    spark.sql(f"ALTER TABLE delta.`{uri}` SET TBLPROPERTIES ('delta.enableDeletionVectors' = true)")
    spark.sql(f"DELETE FROM delta.`{uri}` WHERE queue_offset = 3")
    assert spark.read.format("delta").load(uri).count() == 98  # offset 3 of both queues
    reader = spark.read.format("rmqtx").option("path", store.root).option("topic", "T")
    with pytest.raises(Exception, match="deletionVectors"):
        reader.load().count()


def test_delta_s_own_source_on_the_commitlog_reads_on_past_retention(spark, tmp_path: Path) -> None:
    """docs/reading.md's Delta-path consumer: with skipChangeCommits, retention's deletes of expired
    messages do not stop Delta's streaming source (without it: DELTA_SOURCE_IGNORE_DELETE at
    the first expiry)."""
    now = [datetime(2026, 1, 1, tzinfo=UTC)]
    store = Store.open(tmp_path / "store", clock=lambda: now[0])
    store.send([Message("OrderEvents", f"old-{i}") for i in range(10)], "pg")
    checkpoint = str(tmp_path / "checkpoint")

    out = str(tmp_path / "out")

    def run() -> list[str]:
        events = (
            spark.readStream.format("delta")
            .option("skipChangeCommits", "true")
            .load(store.table_uri("commitlog"))
            .where("topic = 'OrderEvents'")
        )
        query = (
            events.selectExpr("CAST(body AS STRING) AS body")
            .writeStream.format("delta")
            .option("checkpointLocation", checkpoint)
            .trigger(availableNow=True)
            .start(out)
        )
        try:
            query.awaitTermination(120)
            assert query.exception() is None
        finally:
            query.stop()
        return sorted(r.body for r in spark.read.format("delta").load(out).collect())

    assert len(run()) == 10
    now[0] += timedelta(hours=73)
    store.send([Message("OrderEvents", "new")], "pg")
    assert maintain(store, RetentionSettings(deleted_file_retention=0)).messages_expired == 10
    assert run() == sorted(["new", *(f"old-{i}" for i in range(10))])


def test_delta_spark_reads_through_the_stores_own_checkpoints_and_writes_on(
    spark, tmp_path: Path
) -> None:
    """The CommitLog checkpointed by rmq-spark (rmq_spark/delta/checkpoints.py, not
    deltalake): delta-spark reads every message through the checkpoint, appends with OPTIMIZE
    after it, and the next checkpoint (whoever writes it) keeps what delta-spark wrote."""
    from deltalake import DeltaTable

    store = Store.open(tmp_path / "store", settings=Settings(store=StoreSettings(queue_nums=2)))
    uri = store.table_uri("commitlog")
    store.table("commitlog").alter.set_table_properties({"delta.checkpointInterval": "5"})
    for n in range(6):
        store.send([Message("Orders", f"m{n}")], "svc")
    store.finish_maintenance()
    log_dir = Path(uri) / "_delta_log"
    ours = sorted(log_dir.glob("*.checkpoint.parquet"))
    assert ours, "no checkpoint was written"
    assert spark.read.format("delta").load(uri).count() == 6
    spark.sql(f"OPTIMIZE delta.`{uri}`")
    for n in range(6, 12):
        store.send([Message("Orders", f"m{n}")], "svc")
    store.finish_maintenance()
    assert sorted(log_dir.glob("*.checkpoint.parquet"))[-1] != ours[-1]
    bodies = spark.read.format("delta").load(uri).select("body").collect()
    assert sorted(bytes(r.body) for r in bodies) == sorted(f"m{n}".encode() for n in range(12))
    assert DeltaTable(uri).to_pyarrow_table().num_rows == 12
