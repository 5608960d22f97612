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
from deltalake import DeltaTable

from rmq_spark.delta.reads import read_files
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.ops.status import printable, table_lines
from rmq_spark.spark.reading import FILE_SCHEMA
from rmq_spark.store.facade import Store

#: Characters of a body ``tail`` shows.
BODY_PREVIEW = 60


def tail(
    store: Store, topic: str, count: int = 10, commitlog: DeltaTable | None = None
) -> list[dict[str, Any]]:
    """The newest ``count`` committed messages of ``topic`` (of every shard), newest first, in
    the ``commitlog`` snapshot (default: the latest).

    Raises InvalidOptionError (listing the topics) when the topic has no messages.
    """
    files = store.data_files("commitlog", commitlog).to_pylist()
    mine = [f for f in files if f["partition.topic"] == topic]
    if not mine:
        topics = sorted({f["partition.topic"] for f in files})
        raise InvalidOptionError(
            f"topic {topic!r} has no committed messages in {store.root}; topics with messages: "
            f"{', '.join(topics) or '(none)'}."
        )
    # Newest files first, until no file left can hold a message newer than the count-th
    # newest read (a compacted file's newest message can be new while most of it is old).
    latest = datetime.max.replace(tzinfo=UTC)  # a file without statistics: read it
    mine.sort(key=lambda f: f["max.store_timestamp"] or latest, reverse=True)
    read: list[pa.Table] = []
    newest = pa.Table.from_batches([], FILE_SCHEMA)
    for f in mine:
        if (
            newest.num_rows >= count
            and (f["max.store_timestamp"] or latest)
            < newest.column("store_timestamp")[count - 1].as_py()
        ):
            break
        read.append(read_files([f["uri"]], FILE_SCHEMA, store.settings.storage_options))
        newest = pa.concat_tables(read).sort_by(
            [("store_timestamp", "descending"), ("queue_offset", "descending")]
        )
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

    def __init__(self, store: Store, topic: str, commitlog: DeltaTable | None = None) -> None:
        """Follow ``topic`` from the end of the ``commitlog`` snapshot (default: the latest):
        the one ``tail`` read, so that nothing committed in between is missed."""
        self.store, self.topic = store, topic
        self.next = self._ends(commitlog)

    def _ends(self, commitlog: DeltaTable | None = None) -> dict[int, int]:
        ends = self.store.next_offsets(commitlog)
        return {q: o for (t, q), o in ends.items() if t == self.topic}

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
