"""The views of :mod:`rmq_spark.ops.views` as text tables, in one set of units: durations as
:func:`~rmq_spark.model.config.format_duration` writes them, counts with thousands separators,
sizes in KB/MB/GB, times as how long ago."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime
from typing import Any

from rmq_spark.model.config import format_duration
from rmq_spark.ops.status import printable, section
from rmq_spark.ops.views import AGE_BUCKETS


def format_groups(view: Mapping[str, Any]) -> str:
    """``status groups``: one row per consumer group, topic and queue."""
    rows = [
        [
            g["consumer_group"],
            g["reader"],
            g["topic"],
            q["queue_id"],
            _count(q["committed_offset"]),
            _count(q["end_offset"]),
            _count(q["lag"]),
            _count(q["in_flight"]),
            _ago(q["last_progress_age_seconds"]),
        ]
        for g in view["groups"]
        for q in g["queues"]
    ]
    totals = [
        printable(f"{g['consumer_group']} on {g['topic']}: lag {_count(g['lag'])}")
        + (
            f", {_count(g['expired_unread'])} expired before it read them (DATA_LOSS)"
            if g["expired_unread"]
            else ""
        )
        for g in view["groups"]
    ]
    header = [
        "consumer group",
        "reader",
        "topic",
        "queue",
        "committed",
        "end",
        "lag",
        "in flight",
        "last progress",
    ]
    return _page(view, [*section("consumer groups", header, rows), *totals])


def format_transactions(view: Mapping[str, Any]) -> str:
    """``status transactions``: pending by producer group and age, discards, check-back runs."""
    groups = [
        [
            g["producer_group"],
            _count(g["pending_transactions"]),
            _count(g["pending_messages"]),
            format_duration(g["oldest_pending_age_seconds"]),
            *[_count(g["pending_by_age"][label]) for label, _ in AGE_BUCKETS],
            _count(
                g["in_running_sink_epochs"]
                + g["in_committed_sink_epochs"]
                + g["in_aborted_sink_epochs"]
            ),
            _count(g["committed_last_hour"]),
            _count(g["rolled_back_last_hour"]),
        ]
        for g in view["producer_groups"]
    ]
    header = ["producer group", "pending txns", "pending msgs", "oldest"]
    header += [label for label, _ in AGE_BUCKETS]
    header += ["by sinks", "committed 1 h", "rolled back 1 h"]
    d = view["discards"]
    runs = [
        [
            r["started"][:19].replace("T", " "),
            r["status"],
            format_duration(r["duration_seconds"]),
            _count(r["pending_found"]),
            _count(r["committed"]),
            _count(r["rolled_back"]),
            _count(r["unknown"]),
            _count(r["unrouted"]),
            _count(r["errors"]),
            _count(r["discarded"]),
        ]
        for r in view["check_back_runs"]
    ]
    run_header = ["started (UTC)", "status", "took", "pending", "committed", "rolled back"]
    run_header += ["unknown", "unrouted", "checker errors", "discarded"]
    return _page(
        view,
        [
            *section("pending transactions by producer group", header, groups),
            f"discards: {_count(d['messages'])} message(s) in {_count(d['transactions'])} "
            f"transaction(s), {_count(d['not_redriven'])} not re-driven (rmqtx resume)",
            "",
            *section("check-back runs, newest first", run_header, runs),
        ],
    )


def format_topics(view: Mapping[str, Any]) -> str:
    """``status topics``: messages, rates and the retention horizon per topic."""
    rows = [
        [
            t["topic"],
            _count(t["messages"]),
            len(t["queues"]),
            _count(t["last_minute"]),
            _count(t["last_hour"]),
            f"{t['last_minute'] / 60:,.1f}/s",
            _since(view, t["oldest_stored"]),
            format_duration(t["expires_after_seconds"]),
        ]
        for t in view["topics"]
    ]
    header = ["topic", "messages", "queues", "last min", "last hour", "rate (1 min)"]
    header += ["oldest stored", "kept for"]
    return _page(view, section("topics", header, rows))


def format_store(view: Mapping[str, Any]) -> str:
    """``status store``: shards, each table's Delta version and size, retention."""
    rows = [
        [s["shard"], name, t["version"], _count(t["files"]), _count(t["rows"]), _size(t["bytes"])]
        for s in view["shards"]
        for name, t in s["tables"].items()
    ]
    r = view["retention"]
    kept = (
        f"retention: messages kept {format_duration(r['file_reserved_time_seconds'])}, decided "
        f"transactions {format_duration(r['transaction_reserved_time_seconds'])}, maintenance "
        f"every {format_duration(r['maintenance_interval_seconds'])}"
    )
    header = ["shard", "table", "version", "files", "rows", "size"]
    return _page(
        view, [f"{len(view['shards'])} shard(s); {kept}", "", *section("tables", header, rows)]
    )


#: ``rmqtx status VIEW``'s text, by view name.
FORMATS: Mapping[str, Callable[[Mapping[str, Any]], str]] = {
    "groups": format_groups,
    "transactions": format_transactions,
    "topics": format_topics,
    "store": format_store,
}


def _page(view: Mapping[str, Any], lines: list[str]) -> str:
    generated = view["generated"][:19].replace("T", " ")
    return "\n".join([f"store {view['store']}  ({generated} UTC)", "", *lines]).rstrip()


def _count(value: int | None) -> str:
    return "-" if value is None else f"{value:,}"


def _ago(seconds: float | None) -> str:
    return "never" if seconds is None else f"{format_duration(seconds)} ago"


def _since(view: Mapping[str, Any], then: str | None) -> str:
    if then is None:
        return "-"
    age = datetime.fromisoformat(view["generated"]) - datetime.fromisoformat(then)
    return _ago(max(0.0, age.total_seconds()))


def _size(size: int) -> str:
    for unit, scale in (("GB", 1 << 30), ("MB", 1 << 20), ("KB", 1 << 10)):
        if size >= scale:
            return f"{size / scale:,.1f} {unit}"
    return f"{size} B"
