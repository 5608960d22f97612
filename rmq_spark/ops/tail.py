"""The newest committed messages of a topic, in every shard of a store: what ``rmqtx tail``
prints (read with deltalake and pyarrow, no Spark).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.delta.reads import read_files
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.ops.status import printable, table_lines
from rmq_spark.spark.reading import FILE_SCHEMA
from rmq_spark.store.facade import Store

#: Characters of a body ``tail`` shows.
BODY_PREVIEW = 60


def tail(store: Store, topic: str, count: int = 10) -> list[dict[str, Any]]:
    """The newest ``count`` committed messages of ``topic`` (of every shard), newest first.

    Raises InvalidOptionError (listing the topics) when the topic has no messages.
    """
    files = store.data_files("commitlog").to_pylist()
    mine = [f for f in files if f["partition.topic"] == topic]
    if not mine:
        topics = sorted({f["partition.topic"] for f in files})
        raise InvalidOptionError(
            f"topic {topic!r} has no committed messages in {store.root}; topics with messages: "
            f"{', '.join(topics) or '(none)'}."
        )
    # Newest files first, until they hold enough rows.
    mine.sort(
        key=lambda f: f["max.store_timestamp"] or datetime.min.replace(tzinfo=UTC), reverse=True
    )
    chosen, rows = [], 0
    for f in mine:
        chosen.append(f["uri"])
        rows += f["num_records"]
        if rows >= count:
            break
    table = read_files(chosen, FILE_SCHEMA, store.settings.storage_options)
    newest = table.sort_by([("store_timestamp", "descending"), ("queue_offset", "descending")])
    return [_message_row(topic, r) for r in newest.slice(0, count).to_pylist()]


def _message_row(topic: str, row: Mapping[str, Any]) -> dict[str, Any]:
    body = bytes(row["body"])
    return {
        "topic": topic,
        "queue_id": row["queue_id"],
        "queue_offset": row["queue_offset"],
        "msg_id": row["msg_id"],
        "keys": row["keys"],
        "tags": row["tags"],
        "store_timestamp": row["store_timestamp"].isoformat(),
        "body": body.decode("utf-8", errors="replace"),
        "properties": dict(row["properties"] or ()),
    }


class Follower:
    """The messages of a topic committed since the last look, in every queue from where the
    last look ended (``rmqtx tail --follow``): each look costs a read of the CommitLog's
    offsets, and of the new files when there are new messages."""

    def __init__(self, store: Store, topic: str) -> None:
        self.store, self.topic = store, topic
        self.next = self._ends()

    def _ends(self) -> dict[int, int]:
        return {q: o for (t, q), o in self.store.next_offsets().items() if t == self.topic}

    def new_messages(self) -> list[dict[str, Any]]:
        """The messages committed since the last call, oldest first."""
        ends = self._ends()
        grown = {q: (self.next.get(q, 0), e) for q, e in ends.items() if e > self.next.get(q, 0)}
        if not grown:
            return []
        files = self.store.data_files("commitlog")
        low = min(start for start, _ in grown.values())
        chosen = files.filter(
            pc.and_(
                pc.equal(files.column("partition.topic"), self.topic),
                pc.fill_null(pc.greater_equal(files.column("max.queue_offset"), low), True),
            )
        )

        def new(rows: pa.Table) -> pa.ChunkedArray:
            queue, offset = rows.column("queue_id"), rows.column("queue_offset")
            masks = [
                pc.and_(
                    pc.equal(queue, q),
                    pc.and_(pc.greater_equal(offset, start), pc.less(offset, end)),
                )
                for q, (start, end) in grown.items()
            ]
            return functools.reduce(pc.or_, masks)

        table = read_files(
            chosen.column("uri").to_pylist(), FILE_SCHEMA, self.store.settings.storage_options, new
        )
        self.next.update(ends)
        ordered = table.sort_by(
            [
                ("store_timestamp", "ascending"),
                ("queue_id", "ascending"),
                ("queue_offset", "ascending"),
            ]
        )
        return [_message_row(self.topic, r) for r in ordered.to_pylist()]


def format_tail(messages: Sequence[Mapping[str, Any]], *, header: bool = True) -> str:
    """``tail`` as a readable table (bodies cut to ``BODY_PREVIEW`` characters); without
    ``header``, the rows alone (``--follow``'s lines after the first table)."""
    lines = table_lines(
        ["queue", "offset", "stored", "keys", "tags", "body"],
        [
            [
                m["queue_id"],
                m["queue_offset"],
                m["store_timestamp"],
                m["keys"] or "",
                m["tags"] or "",
                _preview(m["body"]),
            ]
            for m in messages
        ],
    )
    return "\n".join(lines if header else lines[2:])


def _preview(body: str) -> str:
    flat = printable(body.replace("\n", " "))
    return flat if len(flat) <= BODY_PREVIEW else flat[: BODY_PREVIEW - 3] + "..."
