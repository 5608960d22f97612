"""Tables written by the Python side (deltalake) read back by Spark (delta-spark)."""

from __future__ import annotations

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.schema import COMMITLOG_SCHEMA, HALF_SCHEMA, OP_SCHEMA
from tests.conftest import commitlog


def test_spark_reads_every_table_as_written(spark, store: Store) -> None:
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
        [Decision(prepared[0].transaction_id, "pg", LocalTransactionState.COMMIT)]
    )
    store.send([Message("Payments", b"normal")], "svc")

    for name, schema in (("half", HALF_SCHEMA), ("op", OP_SCHEMA), ("commitlog", COMMITLOG_SCHEMA)):
        df = spark.read.format("delta").load(store.table_uri(name))
        assert df.columns == schema.names, name
        python_rows = store.table(name).to_pyarrow_table().num_rows
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
    committed = rows[prepared[0].msg_id]
    assert committed["properties"] == {"region": "eu", "CHECK_IMMUNITY_TIME_IN_SECONDS": "30"}
    assert committed["keys"] == "k1 k2"

    op = spark.read.format("delta").load(store.table_uri("op")).collect()
    assert [(r["transaction_id"], r["decision"]) for r in op] == [
        (prepared[0].transaction_id, "COMMIT")
    ]
