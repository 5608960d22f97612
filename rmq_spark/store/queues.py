"""The CommitLog's queues: dense offsets, where each queue stands, and how far ``op`` is
published.

Rule 5 (deterministic offsets) and rule 2 (exactly once) rest on this: every publish commit
records, as Delta application transactions of ``commitlog``, the next offset of each queue it
wrote and the ``op`` version it has published up to. Offsets are assigned from those values
in the snapshot the commit goes on, and two publishers racing set the same application ids,
so Delta refuses the second commit: offsets are never assigned from a read-then-write race.
The values are read once per snapshot (:mod:`rmq_spark.delta.txnlog`), not once per queue.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.schema import COMMITLOG_SCHEMA

#: Application id under which ``commitlog`` records the last ``op`` version it published (of
#: the root's ``op``; shard ``k``'s is :func:`op_cursor_app_id`).
OP_CURSOR_APP_ID = "rmqtx.publish.op_version"

#: Application id under which ``commitlog`` records the commit time (ms, plus the clock skew
#: allowed) of the newest ``op`` commit of another Delta writer the publisher passed: a
#: transaction made before it may have had its decision removed (a RESTORE or DELETE) and be
#: decided again, so its COMMIT is published only if ``commitlog`` does not hold it yet.
FOREIGN_OP_APP_ID = "rmqtx.publish.foreign_op_millis"

_QUEUE_APP_ID_PREFIX = "rmqtx.queue."


def op_cursor_app_id(shard: int) -> str:
    """The application id of the last ``op`` version of shard ``shard`` published into the
    store's one CommitLog (:data:`OP_CURSOR_APP_ID` for the root)."""
    return f"{OP_CURSOR_APP_ID}.{shard}" if shard else OP_CURSOR_APP_ID


def foreign_op_app_id(shard: int) -> str:
    """:data:`FOREIGN_OP_APP_ID` of shard ``shard``'s ``op``."""
    return f"{FOREIGN_OP_APP_ID}.{shard}" if shard else FOREIGN_OP_APP_ID


_QUEUE_APP_ID = _QUEUE_APP_ID_PREFIX + "{topic}.{queue_id}"

_EARLIEST_APP_ID_PREFIX = "rmqtx.earliest."

_EARLIEST_APP_ID = _EARLIEST_APP_ID_PREFIX + "{topic}.{queue_id}"


def queue_app_id(topic: str, queue_id: int) -> str:
    """The application id whose version is the next offset of a queue in ``commitlog``."""
    return _QUEUE_APP_ID.format(topic=topic, queue_id=queue_id)


def earliest_app_id(topic: str, queue_id: int) -> str:
    """The application id whose version is the earliest offset still in a queue of
    ``commitlog`` (absent: 0). Set by retention (:mod:`rmq_spark.store.retention`)."""
    return _EARLIEST_APP_ID.format(topic=topic, queue_id=queue_id)


def per_queue(prefix: str, txns: Mapping[str, int]) -> dict[tuple[str, int], int]:
    """``{(topic, queue_id): version}`` of the application ids ``prefix + topic.queue``
    among the CommitLog's application transactions ``txns``."""
    versions = {}
    for app_id, version in txns.items():
        if app_id.startswith(prefix):
            topic, queue_id = app_id[len(prefix) :].rsplit(".", 1)
            versions[(topic, int(queue_id))] = version
    return versions


def next_offsets(
    tables: DeltaTables, commitlog: DeltaTable | None = None
) -> dict[tuple[str, int], int]:
    """The next offset of every queue that holds messages, ``{(topic, queue_id): offset}``,
    in a ``commitlog`` snapshot (default: the latest)."""
    return per_queue(_QUEUE_APP_ID_PREFIX, tables.app_transactions("commitlog", commitlog))


def earliest_stored(
    tables: DeltaTables, commitlog: DeltaTable | None = None
) -> dict[tuple[str, int], int]:
    """The earliest offset still stored of every queue retention has trimmed (absent: 0)."""
    return per_queue(_EARLIEST_APP_ID_PREFIX, tables.app_transactions("commitlog", commitlog))


def published_op_version(
    tables: DeltaTables, shard: int, commitlog: DeltaTable | None = None
) -> int:
    """The last version of shard ``shard``'s ``op`` published into a ``commitlog`` snapshot
    (default: the latest); -1 when nothing was ever published."""
    return tables.app_transactions("commitlog", commitlog).get(op_cursor_app_id(shard), -1)


def assign_offsets(
    next_offsets: Mapping[tuple[str, int], int], batch: pa.Table
) -> tuple[pa.Table, dict[tuple[str, int], int]]:
    """Give each row the next dense offset of its queue (``next_offsets``: the snapshot's);
    return the rows and the next offset of each queue they went to. Vectorised (a publish of
    one message costs no query plan, one of millions no Python loop over rows)."""
    topics = pc.dictionary_encode(batch.column("topic").combine_chunks())
    codes = topics.indices.to_numpy(zero_copy_only=False).astype(np.int64)
    queue_ids = batch.column("queue_id").to_numpy().astype(np.int64)
    low = int(queue_ids.min()) if len(queue_ids) else 0
    span = int(queue_ids.max()) - low + 1 if len(queue_ids) else 1
    unique, which = np.unique(codes * span + (queue_ids - low), return_inverse=True)
    which = which.reshape(-1)
    counts = np.bincount(which, minlength=len(unique))
    order = np.argsort(which, kind="stable")  # rows of each queue, in batch order
    rank = np.empty(len(which), dtype=np.int64)
    rank[order] = np.arange(len(which)) - np.repeat(np.cumsum(counts) - counts, counts)
    names = topics.dictionary.to_pylist()
    queues = [(names[int(k) // span], int(k) % span + low) for k in unique]
    starts = np.array([next_offsets.get(q, 0) for q in queues], dtype=np.int64)
    offsets = starts[which] + rank
    next_offset = {q: int(s + c) for q, s, c in zip(queues, starts, counts, strict=True)}
    batch = batch.set_column(
        batch.schema.get_field_index("queue_offset"),
        COMMITLOG_SCHEMA.field("queue_offset"),
        pa.array(offsets, pa.int64()),
    )
    return batch, next_offset
