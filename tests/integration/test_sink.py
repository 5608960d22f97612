"""`df.write.format("rmqtx")` / `writeStream`: epochs publish once; bad input publishes nothing."""

from __future__ import annotations

import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable

from rmq_spark import Store, publish_with_delta_write
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import TransactionSettings
from rmq_spark.spark.epoch_records import closed_epoch
from rmq_spark.spark.epochs import Lease
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.spark.staging import stage
from tests.conftest import commitlog

INPUT = "body string, keys string, tags string"


def write(df, store: Store, **options) -> None:
    writer = df.write.format("rmqtx").mode("append").option("path", store.root)
    defaults = {"topic": "Orders", "producerGroup": "pipeline"}
    for key, value in {**defaults, **options}.items():
        writer = writer.option(key, value)
    writer.save()


def rows(spark, n: int, prefix: str = "m"):
    return spark.createDataFrame(
        [(f"{prefix}{i}", f"k{i % 3}", "TagA" if i % 2 else "TagB") for i in range(n)], INPUT
    )


def check_back(spark, store: Store) -> None:
    settings = TransactionSettings(transaction_timeout=0.0, transaction_check_max=3)
    CheckBackJob(spark, store, {}, settings).run_once()


def pending(store: Store) -> set[str]:
    half = set(store.read("half").column("transaction_id").to_pylist())
    return half - set(store.read("op").column("transaction_id").to_pylist())


def bodies(store: Store) -> list[str]:
    return sorted(b.decode() for b in commitlog(store).column("body").to_pylist())


def held_stage(store: Store, batches, options, sink_id: str, epoch: int, table=None):
    """Stage as a writer task does: holding the epoch (owner: the sink id)."""
    with Lease(store, sink_id, epoch, sink_id, lease_seconds=600) as held:
        return stage(store, batches, options, sink_id, epoch, held.generation, table)


def test_batch_write_publishes_exactly_the_input(spark, store: Store) -> None:
    df = spark.createDataFrame(
        [
            ("a", "k1", "TagA", "Orders", {"p": "1"}),
            ("b", None, None, "Payments", None),
            ("c", "k2 k3", "TagB", None, {}),
        ],
        "body string, keys string, tags string, topic string, properties map<string,string>",
    )
    write(df, store)
    log = commitlog(store).to_pylist()
    assert sorted((r["topic"], r["body"], r["keys"], r["tags"]) for r in log) == [
        ("Orders", b"a", "k1", "TagA"),
        ("Orders", b"c", "k2 k3", "TagB"),  # no per-row topic: the option's
        ("Payments", b"b", None, None),
    ]
    props = {r["body"]: r["properties"] for r in log}
    assert props == {b"a": [("p", "1")], b"b": [], b"c": []}  # no internal properties
    half = store.read("half").to_pylist()
    (sink_id,) = {h["sink_id"] for h in half}
    assert sink_id.startswith("write-") and {h["epoch"] for h in half} == {0}
    assert {r["producer_group"] for r in log} == {"pipeline"}
    assert len(closed_epoch(store, sink_id, 0)) >= 1
    assert pending(store) == set()
    # Spark reads back what it wrote.
    assert (
        spark.read.format("rmqtx")
        .option("path", store.root)
        .option("topic", "Orders,Payments")
        .load()
        .count()
        == 3
    )


def test_same_sink_id_publishes_once(spark, store: Store) -> None:
    write(rows(spark, 5), store, sinkId="nightly-2026-11-22")
    write(rows(spark, 5), store, sinkId="nightly-2026-11-22")  # a re-run of the same job
    assert len(bodies(store)) == 5
    assert pending(store) == set()


def test_extra_columns_as_properties(spark, store: Store) -> None:
    df = spark.createDataFrame([("a", 7, "EU")], "body string, order_id int, region string")
    write(df, store, extraColumnsAsProperties="true")
    (row,) = commitlog(store).to_pylist()
    assert dict(row["properties"])["order_id"] == "7"
    assert dict(row["properties"])["region"] == "EU"


@pytest.mark.parametrize(
    ("columns", "data", "options", "match"),
    [
        ("keys string", [("k",)], {}, "the input has no 'body' column"),
        (INPUT, [("a", "k", "T")], {"producerGroup": ""}, "option 'producerGroup' is required"),
        (INPUT, [("a", "k", "T")], {"topicc": "x"}, r"unknown option\(s\) 'topicc'.*valid"),
        (INPUT, [("a", "k", "T")], {"topic": "bad topic!"}, "topic 'bad topic!'"),
        (INPUT, [("a", "k", "T")], {"topic": "RMQ_SYS_TRANS_HALF_TOPIC"}, "system topic"),
        ("body string, extra int", [("a", 1)], {}, "unexpected input column\\(s\\) 'extra'"),
        ("body int", [(1,)], {}, "column 'body' has type int; it needs binary or string"),
        ("body string, properties map<string,int>", [("a", {"k": 1})], {}, "of string to str"),
        ("body string, topic string", [("a", "%DLQ%x")], {}, "system topic"),
        ("body string", [("a",), (None,)], {}, "1 row\\(s\\) have a null 'body'"),
        (
            "body string",
            [("a",), ("x" * (4 * 2**20 + 1),)],
            {},
            "1 row\\(s\\) have a body over the limit of 4194304 bytes",
        ),
        ("body string", [("",)], {}, "1 row\\(s\\) have an empty body"),
        # A newline in a sinkId forged log lines and status rows.
        ("body string", [("a",)], {"sinkId": "s\nERROR forged"}, "option 'sinkId'"),
        ("body string", [("a",)], {"sinkId": "x" * 256}, "option 'sinkId'"),
        (
            "body string, properties map<string,string>",
            [("a", {"k": None})],
            {},
            "1 row\\(s\\) have a null value of property 'k'",
        ),
        (
            "body string, properties map<string,string>",
            [("a", {"CHECK_IMMUNITY_TIME_IN_SECONDS": "1_0"})],
            {},
            "CHECK_IMMUNITY_TIME_IN_SECONDS='1_0' is not a number of seconds",
        ),
        (
            "body string, properties map<string,string>",
            [("a", {"big": "v" * 40_000})],
            {},
            "more than 32767 bytes",
        ),
        ("body string, keys string", [("a", "k" * 40_000)], {}, "more than 32767 bytes"),
    ],
)
def test_bad_input_fails_clearly_and_publishes_nothing(
    spark, store: Store, columns, data, options, match
) -> None:
    with pytest.raises(Exception, match=match):
        write(spark.createDataFrame(data, columns), store, **options)
    # Good rows staged by other tasks are rolled back: by the job's abort, or, for a task
    # that finished after the abort (Spark cancels it, its Python worker may still write),
    # by the check-back job: the abort closed the epoch empty.
    assert commitlog(store).num_rows == 0
    deadline = time.monotonic() + 60
    while True:
        check_back(spark, store)
        if not pending(store) or time.monotonic() > deadline:
            break
        time.sleep(2)  # a cancelled task may still be staging
    assert pending(store) == set()
    assert commitlog(store).num_rows == 0


def test_overwrite_is_refused(spark, store: Store) -> None:
    with pytest.raises(Exception, match="only appends"):
        rows(spark, 1).write.format("rmqtx").mode("overwrite").option("path", store.root).option(
            "topic", "Orders"
        ).option("producerGroup", "pipeline").save()


def stream_input(spark, source: Path):
    return spark.readStream.format("delta").option("maxFilesPerTrigger", 1).load(str(source))


def add_input(spark, source: Path, bodies_: list[str]) -> None:
    spark.createDataFrame([(b, b, "T") for b in bodies_], INPUT).coalesce(1).write.format(
        "delta"
    ).mode("append").save(str(source))


def run_stream(spark, store: Store, source: Path, checkpoint: Path, **options) -> None:
    writer = (
        stream_input(spark, source)
        .writeStream.format("rmqtx")
        .option("checkpointLocation", str(checkpoint))
        .option("path", store.root)
        .option("topic", "Orders")
        .option("producerGroup", "pipeline")
    )
    for key, value in options.items():
        writer = writer.option(key, value)
    query = writer.trigger(availableNow=True).start()
    try:
        assert query.awaitTermination(300)
    finally:
        query.stop()


def test_stream_publishes_each_epoch_once_and_rolls_back_orphans(
    spark, store: Store, tmp_path: Path
) -> None:
    source, checkpoint = tmp_path / "in", tmp_path / "ckpt"
    add_input(spark, source, ["a", "b"])
    add_input(spark, source, ["c"])
    # Halves a failed task attempt of epoch 0 left behind (same sink, same epoch).
    options = WriterOptions.parse(
        {"path": store.root, "topic": "Orders", "producerGroup": "pipeline"},
        rows(spark, 1).schema,
    )
    batch = pa.record_batch({"body": ["a"], "keys": ["a"], "tags": ["T"]})
    orphan = stage(store, [batch], options, "orders-stream", 0, generation=0)
    run_stream(spark, store, source, checkpoint, sinkId="orders-stream")
    assert bodies(store) == ["a", "b", "c"]
    assert closed_epoch(store, "orders-stream", 0) is not None
    assert closed_epoch(store, "orders-stream", 1) is not None
    assert pending(store) == {orphan.transaction_id}
    check_back(spark, store)
    assert pending(store) == set()
    assert bodies(store) == ["a", "b", "c"]

    # Spark replays the last epoch when its commit record is missing (a crash after our
    # commit, before Spark's): the replay is rolled back, nothing is published twice.
    (checkpoint / "commits" / "1").unlink()
    (checkpoint / "commits" / ".1.crc").unlink(missing_ok=True)
    add_input(spark, source, ["d"])
    run_stream(spark, store, source, checkpoint, sinkId="orders-stream")
    assert bodies(store) == ["a", "b", "c", "d"]
    assert pending(store) == set()


def test_stream_killed_writing_its_first_offsets_restarts(
    spark, store: Store, tmp_path: Path
) -> None:
    """A driver SIGKILLed while Spark writes the first batch's offsets leaves only Hadoop's
    hidden temporary file in offsets/ (seen in the torture test). Spark 4.2 then refused to
    start the query again ("should be empty on batch 0") until someone cleaned the checkpoint
    by hand; sessions from get_spark turn that check off, and the restart publishes once."""
    source, checkpoint = tmp_path / "in", tmp_path / "ckpt"
    add_input(spark, source, ["a", "b"])
    run_stream(spark, store, source, checkpoint, sinkId="s")
    # As the kill leaves it: the offsets written to a temporary file, never renamed.
    offsets = checkpoint / "offsets"
    (offsets / "0").rename(offsets / ".0.6f1c2a0e-7d3b-4c43-9a55-1b2f3e4d5c6b.tmp")
    (offsets / ".0.crc").unlink(missing_ok=True)
    for done in (checkpoint / "commits").iterdir():
        done.unlink()
    run_stream(spark, store, source, checkpoint, sinkId="s")
    assert bodies(store) == ["a", "b"]


def test_stream_sink_id_defaults_to_the_query_id(spark, store: Store, tmp_path: Path) -> None:
    source, checkpoint = tmp_path / "in", tmp_path / "ckpt"
    add_input(spark, source, ["a"])
    run_stream(spark, store, source, checkpoint)
    import json

    query_id = json.loads((checkpoint / "metadata").read_text())["id"]
    (row,) = store.read("half").to_pylist()
    assert row["sink_id"] == query_id


def test_publish_with_delta_write(spark, store: Store, tmp_path: Path) -> None:
    table = str(tmp_path / "orders")
    orders = spark.createDataFrame([(1, "new"), (2, "new")], "order_id int, status string")
    events = spark.createDataFrame([("order 1 created",), ("order 2 created",)], "body string")

    def run():
        return publish_with_delta_write(
            orders,
            table,
            events,
            app_id="orders-job",
            version=0,
            producer_group="orders",
            topic="OrderEvents",
            path=store.root,
        )

    outcome = run()
    assert outcome.first and len(outcome.committed) == 1
    # The same batch again (a replay): Delta skips the version, the epoch publishes nothing.
    again = run()
    assert not again.first and again.rolled_back
    assert spark.read.format("delta").load(table).count() == 2
    assert bodies(store) == ["order 1 created", "order 2 created"]
    assert DeltaTable(table).transaction_version("orders-job") == 0
    assert pending(store) == set()


def test_epoch_checker_commits_when_the_delta_write_landed(
    spark, store: Store, tmp_path: Path
) -> None:
    """The driver died after the Delta write, before closing the epoch: check-back finishes."""
    table = str(tmp_path / "orders")
    options = WriterOptions.parse(
        {"path": store.root, "topic": "OrderEvents", "producerGroup": "orders"},
        rows(spark, 1).schema,
    )
    batch = [pa.record_batch({"body": ["e1", "e2"]})]
    landed = held_stage(store, batch, options, "orders-job", 0, table)
    never = held_stage(store, batch, options, "orders-job", 1, table)  # lease still held
    spark.createDataFrame([(1,)], "order_id int").write.format("delta").option(
        "txnAppId", "orders-job"
    ).option("txnVersion", 0).save(table)
    check_back(spark, store)
    assert bodies(store) == ["e1", "e2"]
    assert pending(store) == {never.transaction_id}  # its write never happened: UNKNOWN
    assert closed_epoch(store, "orders-job", 0) == (landed.transaction_id,)


def test_text_that_is_not_utf8_fails_clearly_and_publishes_nothing(spark, store: Store) -> None:
    """A string column of bytes that are not UTF-8 (CAST of binary) failed the task with a bare
    UnicodeDecodeError; it names the column, and nothing is published."""
    df = spark.sql("SELECT 'a' AS body, CAST(X'FF' AS STRING) AS keys")
    with pytest.raises(Exception, match="column 'keys' holds text that is not valid UTF-8"):
        write(df, store)
    assert commitlog(store).num_rows == 0


def test_check_back_opens_only_the_delta_tables_the_operator_allows(
    spark, store: Store, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A half row names the business table of its Delta-write epoch, and check-back opened
    that URI with the store's credentials: a row written around the sink could send them to
    any table. Tables off the store's filesystem are opened only when [store] delta_tables
    names them (or a prefix); otherwise the transaction stays UNKNOWN, with the reason."""
    options = WriterOptions.parse(
        {"path": store.root, "topic": "OrderEvents", "producerGroup": "orders"},
        rows(spark, 1).schema,
    )
    batch = [pa.record_batch({"body": ["e1"]})]
    foreign = "s3://somebody-else/tables/orders"
    staged = held_stage(store, batch, options, "planted-job", 0, foreign)
    with caplog.at_level("ERROR", logger="rmq_spark"):
        result = CheckBackJob(
            spark, store, {}, TransactionSettings(transaction_timeout=0.0)
        ).run_once()
    answers = {r.transaction_id: r for r in result.check_batch.collect()}
    assert answers[staged.transaction_id].error is not None
    assert "delta_tables" in answers[staged.transaction_id].error
    assert foreign in answers[staged.transaction_id].error
    assert pending(store) == {staged.transaction_id}
