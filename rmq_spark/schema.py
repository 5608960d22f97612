"""Arrow schemas of the store's Delta tables (documented column by column in storage/README.md)."""

from __future__ import annotations

import pyarrow as pa

TIMESTAMP = pa.timestamp("us", tz="UTC")
PROPERTIES = pa.map_(pa.string(), pa.string())

#: RMQ_SYS_TRANS_HALF_TOPIC: prepared messages, durable and invisible to consumers.
HALF_SCHEMA = pa.schema(
    [
        pa.field("transaction_id", pa.string(), nullable=False),
        pa.field("msg_id", pa.string(), nullable=False),
        pa.field("producer_group", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("queue_id", pa.int32(), nullable=False),
        pa.field("keys", pa.string()),
        pa.field("tags", pa.string()),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("properties", PROPERTIES),
        pa.field("born_timestamp", TIMESTAMP, nullable=False),
        pa.field("store_timestamp", TIMESTAMP, nullable=False),
    ]
)

#: RMQ_SYS_TRANS_OP_HALF_TOPIC: one row per decided transaction; the arbiter of rule 3.
OP_SCHEMA = pa.schema(
    [
        pa.field("transaction_id", pa.string(), nullable=False),
        pa.field("producer_group", pa.string(), nullable=False),
        pa.field("decision", pa.string(), nullable=False),
        pa.field("decided_by", pa.string(), nullable=False),
        pa.field("decided_timestamp", TIMESTAMP, nullable=False),
    ]
)

#: The CommitLog: committed messages only, in their real topics, with dense queue offsets.
#: Its columns are exactly the output schema of ``spark.read.format("rmqtx")``.
COMMITLOG_SCHEMA = pa.schema(
    [
        pa.field("topic", pa.string(), nullable=False),
        pa.field("queue_id", pa.int32(), nullable=False),
        pa.field("queue_offset", pa.int64(), nullable=False),
        pa.field("msg_id", pa.string(), nullable=False),
        pa.field("transaction_id", pa.string()),
        pa.field("producer_group", pa.string()),
        pa.field("keys", pa.string()),
        pa.field("tags", pa.string()),
        pa.field("body", pa.binary(), nullable=False),
        pa.field("properties", PROPERTIES),
        pa.field("born_timestamp", TIMESTAMP, nullable=False),
        pa.field("store_timestamp", TIMESTAMP, nullable=False),
    ]
)

#: Table properties of the internal tables. Nobody streams from them, and removed-file
#: tombstones kept for a week would make every commit slower (deltalake's commit cost grows
#: with the tombstones in the snapshot), so they are kept for an hour. Do not VACUUM them with
#: a shorter retention than your longest-running reader.
_INTERNAL = {
    "delta.enableChangeDataFeed": "true",
    "delta.deletedFileRetentionDuration": "interval 1 hours",
}

#: Table name -> (schema, partition columns, table properties).
TABLES: dict[str, tuple[pa.Schema, list[str], dict[str, str]]] = {
    "half": (HALF_SCHEMA, [], _INTERNAL),
    "op": (OP_SCHEMA, [], _INTERNAL),
    "commitlog": (COMMITLOG_SCHEMA, ["topic"], {"delta.enableChangeDataFeed": "true"}),
}
