"""The operator's view of a store, read with deltalake and pyarrow (no Spark, so it is quick):
what ``rmqtx status`` and ``rmqtx tail`` print.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow.compute as pc

from rmq_spark.delta.reads import read_files
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.spark.offsets import latest_offsets
from rmq_spark.spark.reading import FILE_SCHEMA
from rmq_spark.store.facade import Store

#: The ``check_runs`` columns ``status`` reports for the last check-back run.
RUN_COLUMNS = (
    "started",
    "status",
    "duration_seconds",
    "pending_found",
    "committed",
    "rolled_back",
    "unknown",
    "discarded",
    "message",
)
#: Characters of a body ``tail`` shows.
BODY_PREVIEW = 60


def store_status(store: Store, now: datetime | None = None) -> dict[str, Any]:
    """Topics, producer groups, consumer groups, discards and the last check-back run.

    Returns a JSON-ready dict (timestamps as ISO strings, ages in seconds).
    """
    now = now or datetime.now(UTC)
    files = store.data_files("commitlog")
    counts = files.group_by("partition.topic").aggregate([("num_records", "sum")]).to_pylist()
    committed = {r["partition.topic"]: r["num_records_sum"] for r in counts}
    latest = latest_offsets(store, sorted(committed))
    return {
        "store": store.root,
        "generated": now.isoformat(),
        "topics": [
            {
                "topic": topic,
                "committed": committed[topic],
                "queues": {str(q): o for q, o in sorted(latest[topic].items())},
            }
            for topic in sorted(committed)
        ],
        "producer_groups": _producer_groups(store, now),
        "consumer_groups": _consumer_groups(store, latest),
        "discards": _discards(store),
        "last_check_back": _last_run(store),
    }


def _producer_groups(store: Store, now: datetime) -> list[dict[str, Any]]:
    half = store.read("half", ["transaction_id", "producer_group", "store_timestamp"])
    op = store.read("op", ["transaction_id", "producer_group", "decision"])
    pending = half.filter(
        pc.invert(pc.is_in(half.column("transaction_id"), op.column("transaction_id")))
    )
    groups: dict[str, dict[str, Any]] = {}

    def group(name: str) -> dict[str, Any]:
        return groups.setdefault(
            name,
            {
                "producer_group": name,
                "pending_transactions": 0,
                "pending_messages": 0,
                "oldest_pending_age_seconds": None,
                "committed_transactions": 0,
                "rolled_back_transactions": 0,
            },
        )

    for row in (
        pending.group_by("producer_group")
        .aggregate(
            [
                ("transaction_id", "count_distinct"),
                ("transaction_id", "count"),
                ("store_timestamp", "min"),
            ]
        )
        .to_pylist()
    ):
        g = group(row["producer_group"])
        g["pending_transactions"] = row["transaction_id_count_distinct"]
        g["pending_messages"] = row["transaction_id_count"]
        g["oldest_pending_age_seconds"] = round(
            (now - row["store_timestamp_min"]).total_seconds(), 3
        )
    for row in (
        op.group_by(["producer_group", "decision"])
        .aggregate([("transaction_id", "count")])
        .to_pylist()
    ):
        key = (
            "committed_transactions" if row["decision"] == "COMMIT" else "rolled_back_transactions"
        )
        group(row["producer_group"])[key] = row["transaction_id_count"]
    return [groups[name] for name in sorted(groups)]


def _consumer_groups(store: Store, latest: Mapping[str, Mapping[int, int]]) -> list[dict[str, Any]]:
    rows = store.read("consumer_offsets").to_pylist()
    progress: dict[tuple[str, str], dict[int, int]] = {}
    for r in rows:
        progress.setdefault((r["consumer_group"], r["topic"]), {})[r["queue_id"]] = r["next_offset"]
    return [
        {
            "consumer_group": group,
            "topic": topic,
            "lag": sum(max(0, end - done.get(q, 0)) for q, end in latest.get(topic, {}).items()),
            "queues": {str(q): o for q, o in sorted(done.items())},
        }
        for (group, topic), done in sorted(progress.items())
    ]


def _discards(store: Store) -> dict[str, int]:
    discard = store.read("discard", ["transaction_id", "redriven_transaction_id"])
    waiting = discard.filter(pc.is_null(discard.column("redriven_transaction_id")))
    return {
        "messages": discard.num_rows,
        "transactions": len(pc.unique(discard.column("transaction_id"))),
        "not_redriven": waiting.num_rows,
    }


def _last_run(store: Store) -> dict[str, Any] | None:
    runs = store.read("check_runs", list(RUN_COLUMNS))
    if not runs.num_rows:
        return None
    last = runs.take([pc.index(runs.column("started"), pc.max(runs.column("started"))).as_py()])
    row = last.to_pylist()[0]
    row["started"] = row["started"].isoformat()
    return row


def tail(store: Store, topic: str, count: int = 10) -> list[dict[str, Any]]:
    """The newest ``count`` committed messages of ``topic``, newest first.

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


def to_json(value: Any) -> str:
    """Indented JSON for ``--json``."""
    return json.dumps(value, indent=2, sort_keys=False, default=str)


def format_status(status: Mapping[str, Any]) -> str:
    """``store_status`` as readable tables."""
    parts = [f"store {status['store']}  ({status['generated']})", ""]
    parts += _section(
        "topics",
        ["topic", "committed", "next offsets"],
        [
            [t["topic"], t["committed"], " ".join(f"{q}:{o}" for q, o in t["queues"].items())]
            for t in status["topics"]
        ],
    )
    parts += _section(
        "producer groups",
        [
            "producer group",
            "pending txns",
            "pending msgs",
            "oldest pending",
            "committed",
            "rolled back",
        ],
        [
            [
                g["producer_group"],
                g["pending_transactions"],
                g["pending_messages"],
                _age(g["oldest_pending_age_seconds"]),
                g["committed_transactions"],
                g["rolled_back_transactions"],
            ]
            for g in status["producer_groups"]
        ],
    )
    parts += _section(
        "consumer groups",
        ["consumer group", "topic", "lag"],
        [[c["consumer_group"], c["topic"], c["lag"]] for c in status["consumer_groups"]],
    )
    d = status["discards"]
    parts += [
        f"discards: {d['messages']} message(s) in {d['transactions']} transaction(s), "
        f"{d['not_redriven']} not re-driven (rmqtx resume re-drives them)",
        "",
    ]
    run = status["last_check_back"]
    parts.append(
        "last check-back run: none"
        if run is None
        else (
            f"last check-back run: {run['started']} {run['status']} in "
            f"{run['duration_seconds']:.1f} s: {run['pending_found']} pending, "
            f"{run['committed']} committed, {run['rolled_back']} rolled back, "
            f"{run['unknown']} unknown, {run['discarded']} discarded"
        )
    )
    return "\n".join(parts)


def format_tail(messages: Sequence[Mapping[str, Any]]) -> str:
    """``tail`` as a readable table (bodies cut to ``BODY_PREVIEW`` characters)."""
    return "\n".join(
        _table(
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


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (control characters, escape
    sequences, line and paragraph separators) written as its Python escape: stored messages
    and names are anyone's input, and must neither drive the operator's terminal nor forge
    rows of a table."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _section(title: str, header: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return [f"{title}: none", ""]
    return [f"{title}:", *_table(header, rows), ""]


def _table(header: list[str], rows: list[list[Any]]) -> list[str]:
    cells = [header, *[[printable(str(c)) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return ["  " + line for line in lines]
