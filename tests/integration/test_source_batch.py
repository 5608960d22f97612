"""`spark.read.format("rmqtx")`: committed messages only, offsets, tags, and option errors."""

from __future__ import annotations

import json
import os
import time

import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.model.config import StoreSettings
from rmq_spark.spark.offsets import latest_offsets, to_json

COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK


def read(spark, store: Store, **options):
    reader = spark.read.format("rmqtx").option("path", store.root)
    for key, value in options.items():
        reader = reader.option(key, value)
    return reader.load()


def publish(store: Store, topic: str, bodies: list[str], state=COMMIT, tags=None, keys="k"):
    prepared = store.prepare([Message(topic, b, tags=tags, keys=keys) for b in bodies], "pg")
    store.end_transactions([Decision(p.transaction_id, "pg", state) for p in prepared])
    return prepared


def bodies(df) -> list[bytes]:
    return [bytes(r["body"]) for r in df.orderBy("topic", "queue_id", "queue_offset").collect()]


def test_reads_only_committed_messages(spark, store: Store) -> None:
    committed = publish(store, "Orders", ["a", "b"])
    publish(store, "Orders", ["rolled-back"], state=ROLLBACK)
    store.prepare([Message("Orders", b"pending")], "pg")
    store.send([Message("Other", b"elsewhere")], "pg")
    df = read(spark, store, topic="Orders")
    assert df.schema.simpleString().startswith("struct<topic:string,queue_id:int,queue_offset:")
    rows = df.collect()
    assert sorted(bytes(r["body"]) for r in rows) == [b"a", b"b"]
    assert {r["msg_id"] for r in rows} == {p.msg_id for p in committed}
    assert [r["queue_offset"] for r in df.orderBy("queue_offset").collect()] == [0, 1]
    assert sorted(bodies(read(spark, store, topic="Orders, Other"))) == [b"a", b"b", b"elsewhere"]


def test_offsets_and_tags(spark, store: Store) -> None:
    publish(store, "Orders", [f"m{i}" for i in range(5)], tags="TagA")
    publish(store, "Orders", ["x", "y"], tags="TagB")
    publish(store, "Orders", ["z"], tags="TagC")
    (queue,) = latest_offsets(store, ["Orders"])["Orders"]
    assert to_json(latest_offsets(store, ["Orders"])) == {"Orders": {str(queue): 8}}
    window = {
        "startingOffsets": json.dumps({"Orders": {str(queue): 2}}),
        "endingOffsets": json.dumps({"Orders": {str(queue): 6}}),
    }
    assert bodies(read(spark, store, topic="Orders", **window)) == [b"m2", b"m3", b"m4", b"x"]
    assert bodies(read(spark, store, topic="Orders", startingOffsets="latest")) == []
    assert bodies(read(spark, store, topic="Orders", tags="TagB || TagC")) == [b"x", b"y", b"z"]
    assert len(bodies(read(spark, store, topic="Orders", tags="*"))) == 8


def test_starting_timestamp(spark, store: Store) -> None:
    publish(store, "Orders", ["old"])
    time.sleep(0.05)
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    publish(store, "Orders", ["new1", "new2"])
    assert bodies(read(spark, store, topic="Orders", startingTimestamp=str(cut))) == [
        b"new1",
        b"new2",
    ]
    future = str(int(time.time() * 1000) + 60_000)
    assert bodies(read(spark, store, topic="Orders", startingTimestamp=future)) == []


def test_the_error_of_a_bad_option_comes_first_in_what_the_user_sees(spark, store: Store):
    """Spark puts a data source hook's traceback before its error, and the line saying what
    to fix came about eight lines down, after rmq-spark's frames (#48): now it is the fourth,
    for a read and for a write."""
    with pytest.raises(Exception) as raised:
        read(spark, store, topics="Orders")
    assert "[INVALID_OPTION] unknown option(s) 'topics'" in "\n".join(
        str(raised.value).splitlines()[:4]
    )
    rows = spark.createDataFrame([("b",)], "body STRING")
    with pytest.raises(Exception) as raised:
        rows.write.format("rmqtx").mode("append").option("path", store.root).option(
            "topik", "T"
        ).save()
    assert "[INVALID_OPTION] unknown option(s) 'topik'" in "\n".join(
        str(raised.value).splitlines()[:4]
    )


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"topics": "Orders"}, r"unknown option\(s\) 'topics'.*valid options: path, topic"),
        ({}, "option 'topic' is required"),
        ({"topic": "bad topic"}, "option 'topic'.*characters RocketMQ does not allow"),
        ({"topic": "RMQ_SYS_TRANS_HALF_TOPIC"}, "option 'topic'.*system topic"),
        ({"topic": "Orders", "startingOffsets": "{oops"}, r"Expected e\.g\. \{"),
        ({"topic": "Orders", "startingOffsets": '{"Else": {"0": 1}}'}, "not in option 'topic'"),
        ({"topic": "Orders", "endingOffsets": "earliest"}, "cannot be 'earliest'"),
        ({"topic": "Orders", "startingTimestamp": "yesterday"}, "startingTimestamp needs"),
        # Past the year 9999: a bare OSError from datetime before.
        ({"topic": "Orders", "startingTimestamp": "99999999999999999"}, "after the year 9999"),
        # Seconds, as from time.time(): read as milliseconds, the read started in 1970.
        (
            {"topic": "Orders", "startingTimestamp": "1767225600"},
            r"looks like seconds \(2026-01-01 00:00:00 UTC\); give milliseconds: 1767225600000",
        ),
        ({"topic": "Orders", "startingOffsets": '{"Orders": {"0": 1.5}}'}, r"Expected e\.g\."),
        ({"topic": "Orders", "tags": "A || "}, "not a subscription expression"),
    ],
)
def test_bad_options_are_clear_errors_of_load(spark, store: Store, options, match) -> None:
    """Raised by load() itself (as Spark's Kafka source does), with the source's message."""
    with pytest.raises(Exception, match=match) as raised:
        read(spark, store, **options)
    assert "UnboundLocalError" not in str(raised.value)


def test_a_user_schema_is_refused_unless_it_is_the_source_schema(spark, store: Store) -> None:
    """Spark runs no code of a Python data source at load() when the read is given a schema,
    so the first action is the earliest point: before any task, with the fixed schema named
    (not DATA_SOURCE_RETURN_SCHEMA_MISMATCH from inside a task)."""
    from rmq_spark.spark.source import SOURCE_SCHEMA

    publish(store, "Orders", ["a"])
    custom = (
        spark.read.format("rmqtx")
        .schema("topic string, body binary")
        .option("path", store.root)
        .option("topic", "Orders")
        .load()
    )
    with pytest.raises(Exception, match="has a fixed schema and cannot be set") as raised:
        custom.collect()
    assert "topic string not null, queue_id int not null" in str(raised.value)
    assert "RETURN_SCHEMA_MISMATCH" not in str(raised.value)

    def own(**options):
        reader = spark.read.format("rmqtx").schema(SOURCE_SCHEMA).option("path", store.root)
        return reader.options(**options).load()

    assert bodies(own(topic="Orders")) == [b"a"]
    with pytest.raises(Exception, match="have no messages in the store"):  # checked all the same
        own(topic="Orders2", failOnMissingTopic="true").collect()


def test_not_a_store(spark, tmp_path) -> None:
    with pytest.raises(Exception, match="no rmq-spark store"):
        spark.read.format("rmqtx").option("path", str(tmp_path / "x")).option(
            "topic", "Orders"
        ).load()


def test_a_missing_topic_is_a_warning_at_load(store: Store, caplog) -> None:
    """The check load() runs (RmqTxDataSource.schema, in Spark's Python worker; called here
    in-process to see its log): a topic the store has no messages of, a case typo among them."""
    from rmq_spark.spark.source import RmqTxDataSource

    publish(store, "OrderEvents", ["a"])
    publish(store, "Payments", ["p"])
    with caplog.at_level("WARNING", logger="rmq_spark"):
        RmqTxDataSource({"path": store.root, "topic": "orderevents, Payments"}).schema()
    assert "topic(s) 'orderevents' have no messages in the store" in caplog.text
    assert "did you mean 'OrderEvents'?" in caplog.text
    assert "its topics: OrderEvents, Payments" in caplog.text
    assert "failOnMissingTopic" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="rmq_spark"):
        RmqTxDataSource({"path": store.root, "topic": "OrderEvents"}).schema()
    assert caplog.text == ""


def test_a_missing_topic_fails_load_with_fail_on_missing_topic(spark, store: Store) -> None:
    publish(store, "OrderEvents", ["a"])
    with pytest.raises(Exception, match=r"'Orderevents' have no messages.*did you mean 'OrderEv"):
        read(spark, store, topic="Orderevents", failOnMissingTopic="true")
    assert bodies(read(spark, store, topic="Orderevents")) == []  # a warning only
    assert bodies(read(spark, store, topic="OrderEvents", failOnMissingTopic="true")) == [b"a"]


def test_ending_timestamp_and_a_time_window(spark, store: Store) -> None:
    publish(store, "Orders", ["before"])
    time.sleep(0.05)
    start = int(time.time() * 1000)
    publish(store, "Orders", ["inside1", "inside2"])
    time.sleep(0.05)
    stop = int(time.time() * 1000)
    time.sleep(0.05)
    publish(store, "Orders", ["after"])
    window = {"startingTimestamp": str(start), "endingTimestamp": str(stop)}
    assert bodies(read(spark, store, topic="Orders", **window)) == [b"inside1", b"inside2"]
    assert bodies(read(spark, store, topic="Orders", endingTimestamp=str(start))) == [b"before"]
    assert bodies(read(spark, store, topic="Orders", endingTimestamp="0")) == []


def test_offsets_skip_files_by_their_statistics(store: Store) -> None:
    from rmq_spark.spark.reading import plan_slices

    for batch in range(3):
        publish(store, "Orders", [f"b{batch}-{i}" for i in range(4)])
    end = latest_offsets(store, ["Orders"])
    (queue,) = end["Orders"]
    assert sum(len(s.files) for s in plan_slices(store, {}, end)) == 3
    newest = plan_slices(store, {"Orders": {queue: 8}}, end)
    assert sum(len(s.files) for s in newest) == 1
    assert plan_slices(store, end, end) == []


def test_reusing_a_dataframe_after_a_filter_reads_everything(spark, store: Store) -> None:
    """No filter pushdown: Spark 4.2.0 would reuse a pushed-down read plan for df.count()."""
    publish(store, "Orders", ["a"], tags="TagA")
    publish(store, "Orders", ["b"], tags="TagB")
    df = read(spark, store, topic="Orders")
    assert df.where("tags = 'TagA'").count() == 1
    assert df.count() == 2
    publish(store, "Orders", ["c"])
    assert read(spark, store, topic="Orders").count() == 3  # load() again sees new commits


def test_many_files_many_tasks_each_queue_in_order(spark, tmp_path) -> None:
    from rmq_spark.spark.reading import plan_slices, read_slice

    store = Store.open(tmp_path / "wide", settings=StoreSettings(queue_nums=4))
    for i in range(6):
        publish(store, "Odd%|Topic", [f"m{i}-{j}" for j in range(8)])
    end = latest_offsets(store, ["Odd%|Topic"])
    slices = plan_slices(store, {}, end, task_rows=16)
    assert len(slices) == 3
    seen = [r for s in slices for b in read_slice(s) for r in b.to_pylist()]
    assert len(seen) == 48 and len({r["msg_id"] for r in seen}) == 48
    for queue in {r["queue_id"] for r in seen}:
        offsets = [r["queue_offset"] for r in seen if r["queue_id"] == queue]
        assert offsets == sorted(offsets) == list(range(len(offsets)))
    df = read(spark, store, topic="Odd%|Topic")
    assert df.count() == 48
    assert df.rdd.getNumPartitions() == 1  # 6 small files, far under one task's size


def test_a_task_hands_spark_batches_of_about_two_mib(store: Store) -> None:
    """Batches that stay in the CPU's cache between the JVM's Arrow read and its copy into
    rows: 1 KiB bodies come in batches of about BATCH_BYTES, small ones in BATCH_ROWS."""
    from rmq_spark.spark.reading import BATCH_BYTES, BATCH_ROWS, plan_slices, read_slice

    publish(store, "Large", [os.urandom(1024) for _ in range(5_000)])
    publish(store, "Small", [f"s{i}" for i in range(25_000)])
    for topic, expected in (("Large", 5_000), ("Small", 25_000)):
        end = latest_offsets(store, [topic])
        batches = [b for s in plan_slices(store, {}, end) for b in read_slice(s)]
        assert sum(b.num_rows for b in batches) == expected
        assert all(b.num_rows <= BATCH_ROWS and b.nbytes <= 1.1 * BATCH_BYTES for b in batches)
        if topic == "Large":
            assert len(batches) >= 5_000 * 1024 // BATCH_BYTES
        else:
            assert max(b.num_rows for b in batches) == BATCH_ROWS


def test_offsets_below_the_earliest_fail_or_read_from_it(spark, store: Store) -> None:
    from datetime import UTC, datetime, timedelta

    from rmq_spark.store.retention import maintain

    long_ago = datetime.now(UTC) - timedelta(hours=100)
    publish(Store.open(store.root, clock=lambda: long_ago), "Orders", ["o0", "o1", "o2"])
    publish(store, "Orders", ["y0"])
    maintain(store)
    (queue,) = latest_offsets(store, ["Orders"])["Orders"]
    start = json.dumps({"Orders": {str(queue): 1}})
    with pytest.raises(Exception, match=rf"DATA_LOSS.*Orders queue {queue} offsets \[1, 3\)"):
        read(spark, store, topic="Orders", startingOffsets=start).collect()
    assert bodies(
        read(spark, store, topic="Orders", startingOffsets=start, failOnDataLoss="false")
    ) == [b"y0"]
    assert bodies(read(spark, store, topic="Orders")) == [
        b"y0"
    ]  # earliest is the earliest still stored
