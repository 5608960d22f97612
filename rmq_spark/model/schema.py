"""Arrow schemas of the store's Delta tables (documented column by column in storage/README.md)."""

from __future__ import annotations

import pyarrow as pa

TIMESTAMP = pa.timestamp("us", tz="UTC")
PROPERTIES = pa.map_(pa.string(), pa.string())

#: What every stored message carries after its ids and routing columns.
_MESSAGE_PAYLOAD = [
    pa.field("keys", pa.string()),
    pa.field("tags", pa.string()),
    pa.field("body", pa.binary(), nullable=False),
    pa.field("properties", PROPERTIES),
    pa.field("born_timestamp", TIMESTAMP, nullable=False),
    pa.field("store_timestamp", TIMESTAMP, nullable=False),
]

#: A half message as a producer sent it (also the first columns of ``discard``).
_HALF_MESSAGE = [
    pa.field("transaction_id", pa.string(), nullable=False),
    pa.field("msg_id", pa.string(), nullable=False),
    pa.field("producer_group", pa.string(), nullable=False),
    pa.field("topic", pa.string(), nullable=False),
    pa.field("queue_id", pa.int32(), nullable=False),
    *_MESSAGE_PAYLOAD,
]
#: Which transactional writer staged a half message: set only by the ``rmqtx`` sink and
#: ``publish_with_delta_write`` (never from user input, so no message can pass for one), null
#: for producer sends. Routes the message to the built-in epoch checker.
WRITER_COLUMNS = [
    pa.field("sink_id", pa.string()),
    pa.field("epoch", pa.int64()),
    #: The epoch's generation when the attempt staged (see rmq_spark/spark/epochs.py).
    pa.field("generation", pa.int32()),
    #: For ``publish_with_delta_write``: absolute URI of the Delta table written.
    pa.field("delta_table", pa.string()),
]

#: RMQ_SYS_TRANS_HALF_TOPIC: prepared messages, durable and invisible to consumers.
HALF_SCHEMA = pa.schema([*_HALF_MESSAGE, *WRITER_COLUMNS])
#: The message columns of ``half`` (what ``discard`` keeps of a half message).
HALF_MESSAGE_SCHEMA = pa.schema(_HALF_MESSAGE)

#: RMQ_SYS_TRANS_OP_HALF_TOPIC: one row per decided transaction; the arbiter of rule 3 for the
#: transactions that no decision object decides (:mod:`rmq_spark.store.arbiter`).
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
        *_MESSAGE_PAYLOAD,
    ]
)

#: Pending transactions (half messages with no ``op`` row), one row per transaction: its first
#: message by ``msg_id`` without the body, and how many half messages it has. Maintained
#: incrementally by rmq_spark/checkback/pending.py; the half and op versions it covers are Delta
#: application transactions of its commits.
PENDING_SCHEMA = pa.schema(
    [f for f in HALF_SCHEMA if f.name != "body"]
    + [pa.field("message_count", pa.int64(), nullable=False)]
)

#: Check-back bookkeeping: one row per pending transaction the check-back job has seen.
#: Ages are measured on the check-back job's clock from ``first_seen``, never on producers'.
CHECK_STATE_SCHEMA = pa.schema(
    [
        pa.field("transaction_id", pa.string(), nullable=False),
        pa.field("producer_group", pa.string(), nullable=False),
        pa.field("first_seen", TIMESTAMP, nullable=False),
        pa.field("check_count", pa.int32(), nullable=False),
        pa.field("last_check_timestamp", TIMESTAMP),
        pa.field("last_error", pa.string()),
    ]
)

#: TRANS_CHECK_MAX_TIME_TOPIC: messages rolled back after ``transaction_check_max`` checks.
DISCARD_SCHEMA = pa.schema(
    _HALF_MESSAGE
    + [
        pa.field("check_count", pa.int32(), nullable=False),
        pa.field("discarded_timestamp", TIMESTAMP, nullable=False),
        pa.field("redriven_transaction_id", pa.string()),
    ]
)

#: One row per check-back run: what it found and decided.
CHECK_RUNS_SCHEMA = pa.schema(
    [
        pa.field("run_id", pa.string(), nullable=False),
        pa.field("started", TIMESTAMP, nullable=False),
        pa.field("finished", TIMESTAMP, nullable=False),
        pa.field("duration_seconds", pa.float64(), nullable=False),
        pa.field("pending_found", pa.int64(), nullable=False),
        pa.field("checked", pa.int64(), nullable=False),
        pa.field("committed", pa.int64(), nullable=False),
        pa.field("rolled_back", pa.int64(), nullable=False),
        pa.field("unknown", pa.int64(), nullable=False),
        pa.field("already_decided", pa.int64(), nullable=False),
        pa.field("discarded", pa.int64(), nullable=False),
        pa.field("skipped_for_age", pa.int64(), nullable=False),
        pa.field("not_yet_due", pa.int64(), nullable=False),
        pa.field("unrouted", pa.int64(), nullable=False),
        pa.field("errors", pa.int64(), nullable=False),
        pa.field("oldest_pending_age_seconds", pa.float64()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("message", pa.string()),
    ]
)

#: Progress of consumer groups reading with ``format("rmqtx")``: the next offset per queue,
#: recorded when a streaming micro-batch commits (for lag; never used to choose offsets).
CONSUMER_OFFSETS_SCHEMA = pa.schema(
    [
        pa.field("consumer_group", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("queue_id", pa.int32(), nullable=False),
        pa.field("next_offset", pa.int64(), nullable=False),
        pa.field("updated_timestamp", TIMESTAMP, nullable=False),
    ]
)

#: Columns of ``epochs`` added after layout 1's first stores (null there means CLOSED).
EPOCH_STATE_COLUMNS = [
    #: OPEN (a writer holds a lease), CLOSED or ABANDONED (the lease ran out).
    pa.field("state", pa.string()),
    #: Bumped when an ABANDONED epoch is reopened; an attempt counts only in its generation.
    pa.field("generation", pa.int32()),
    #: Until when the writer's lease holds (its heartbeats push it on).
    pa.field("lease_expires", TIMESTAMP),
    #: Who writes the epoch: the streaming query id, or the batch writer's sink id.
    pa.field("owner", pa.string()),
]

#: Consumer groups served by ``rmqtx serve`` (RocketMQ 5's ``SimpleConsumer`` and
#: ``PushConsumer``, :mod:`rmq_spark.store.deliveries`): what each group was handed out, one row
#: per change. ``kind`` is ``start`` (the group's first look at a topic, queue_id -1),
#: ``frontier`` (the next offset of a queue never handed out), ``deliver`` (a message handed out,
#: invisible to the group until ``invisible_until``; ``change`` counts its extensions),
#: ``dead`` (decided for the group's dead-letter topic) or ``done`` (acknowledged, or
#: published to the dead-letter topic).
DELIVERIES_SCHEMA = pa.schema(
    [
        pa.field("consumer_group", pa.string(), nullable=False),
        pa.field("topic", pa.string(), nullable=False),
        pa.field("queue_id", pa.int32(), nullable=False),
        pa.field("queue_offset", pa.int64(), nullable=False),
        pa.field("kind", pa.string(), nullable=False),
        pa.field("attempt", pa.int32()),
        pa.field("change", pa.int32()),
        pa.field("invisible_until", TIMESTAMP),
        pa.field("handle", pa.string()),
        pa.field("recorded_timestamp", TIMESTAMP, nullable=False),
    ]
)

#: Epochs of transactional writers (the ``rmqtx`` sink, ``publish_with_delta_write``): one row
#: per (sink, epoch), a small state machine OPEN -> CLOSED or OPEN -> ABANDONED -> OPEN (next
#: generation) whose every transition is a conditional MERGE (see rmq_spark/spark/epochs.py).
EPOCHS_SCHEMA = pa.schema(
    [
        pa.field("sink_id", pa.string(), nullable=False),
        pa.field("epoch", pa.int64(), nullable=False),
        #: CLOSED: the transactions that count (all COMMITted; every other attempt is rolled
        #: back). Null while OPEN or ABANDONED.
        pa.field("transaction_ids", pa.list_(pa.field("element", pa.string(), nullable=False))),
        pa.field("closed_by", pa.string()),
        pa.field("closed_timestamp", TIMESTAMP),
        *EPOCH_STATE_COLUMNS,
    ]
)

#: Leases that let one process at a time do a store-wide chore (compacting a table: deltalake
#: lets two concurrent OPTIMIZEs of one table both commit, which would store every row twice).
LOCKS_SCHEMA = pa.schema(
    [
        pa.field("name", pa.string(), nullable=False),
        pa.field("holder", pa.string(), nullable=False),
        pa.field("expires", TIMESTAMP, nullable=False),
    ]
)

#: Every table is checkpointed every this many commits (its ``delta.checkpointInterval``,
#: deltalake's default made explicit: readers of the log, :mod:`rmq_spark.delta.txnlog`
#: included, replay the commits after the last checkpoint), whatever the operation (append,
#: MERGE, delete, OPTIMIZE); each checkpoint is followed by the table's maintenance
#: (:mod:`rmq_spark.store.maintenance`).
CHECKPOINT_INTERVAL = 100

_CHECKPOINTS = {"delta.checkpointInterval": str(CHECKPOINT_INTERVAL)}

#: How long a table's checkpoints keep the tombstones of removed files: two hours. VACUUM
#: (:mod:`rmq_spark.delta.vacuum`) writes each removal down when it sees it, every hour, and
#: keeps the file as long as the retention asked (for the CommitLog ``deleted_file_retention``,
#: a week by default); tombstones kept for the week would put a week of compactions in every
#: checkpoint, and in every snapshot a reader loads. Delta's own VACUUM takes this property as
#: its default retention: give it your longest reader's (``RETAIN 168 HOURS``).
TOMBSTONES = {"delta.deletedFileRetentionDuration": "interval 2 hours"}

#: Table properties of the internal tables (nobody streams from them).
_INTERNAL = {**_CHECKPOINTS, **TOMBSTONES, "delta.enableChangeDataFeed": "true"}

#: Columns added to existing tables of layout 1 after its first stores were made: opening an
#: older store adds them (null in old rows).
COLUMNS_ADDED_LATER: dict[str, list[pa.Field]] = {
    "half": WRITER_COLUMNS,
    "epochs": EPOCH_STATE_COLUMNS,
}

#: Table name -> (schema, partition columns, table properties).
TABLES: dict[str, tuple[pa.Schema, list[str], dict[str, str]]] = {
    "half": (HALF_SCHEMA, [], _INTERNAL),
    "op": (OP_SCHEMA, [], _INTERNAL),
    # Rewritten whole by each update: no change feed (nobody reads one), tombstones for an hour.
    "pending": (
        PENDING_SCHEMA,
        [],
        {**_CHECKPOINTS, **TOMBSTONES},
    ),
    "check_state": (CHECK_STATE_SCHEMA, [], _INTERNAL),
    "discard": (DISCARD_SCHEMA, [], _INTERNAL),
    "check_runs": (CHECK_RUNS_SCHEMA, [], _CHECKPOINTS),
    "consumer_offsets": (CONSUMER_OFFSETS_SCHEMA, [], _INTERNAL),
    "epochs": (EPOCHS_SCHEMA, [], _INTERNAL),
    "locks": (LOCKS_SCHEMA, [], _INTERNAL),
    "deliveries": (DELIVERIES_SCHEMA, [], _INTERNAL),
    "commitlog": (
        COMMITLOG_SCHEMA,
        ["topic"],
        {**_CHECKPOINTS, **TOMBSTONES, "delta.enableChangeDataFeed": "true"},
    ),
}
