"""`spark.read.format("rmqtx")`: committed messages only, offsets, tags, and option errors."""

from __future__ import annotations

import json
import time

import pytest

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.offsets import latest_offsets, to_json

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
        ({"topic": "Orders", "tags": "A || "}, "not a subscription expression"),
    ],
)
def test_bad_options_are_clear_errors(spark, store: Store, options, match) -> None:
    with pytest.raises(Exception, match=match):
        read(spark, store, **options).collect()


def test_not_a_store(spark, tmp_path) -> None:
    with pytest.raises(Exception, match="no rmq-spark store"):
        spark.read.format("rmqtx").option("path", str(tmp_path / "x")).option(
            "topic", "Orders"
        ).load().collect()
