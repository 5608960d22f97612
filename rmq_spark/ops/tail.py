"""The newest committed messages of a topic, in every shard of a store: what ``rmqtx tail``
prints (read with deltalake and pyarrow, no Spark).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

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


def format_tail(messages: Sequence[Mapping[str, Any]]) -> str:
    """``tail`` as a readable table (bodies cut to ``BODY_PREVIEW`` characters)."""
    return "\n".join(
        table_lines(
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
    )


def _preview(body: str) -> str:
    flat = printable(body.replace("\n", " "))
    return flat if len(flat) <= BODY_PREVIEW else flat[: BODY_PREVIEW - 3] + "..."
