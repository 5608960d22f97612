"""The operator's view of a store, read with deltalake and pyarrow (no Spark, so it is quick):
what ``rmqtx status`` prints, over every shard of the store (:mod:`rmq_spark.store.shards`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.model.config import RetentionSettings, format_duration
from rmq_spark.ops.views import (
    discards,
    groups_view,
    newest_runs,
    producer_groups,
    topics_view,
)
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
    "unrouted",
    "discarded",
    "message",
)
#: The counts among :data:`RUN_COLUMNS`, summed over the shards of a run.
_RUN_COUNTS = ("pending_found", "committed", "rolled_back", "unknown", "unrouted", "discarded")


def store_status(store: Store, now: datetime | None = None) -> dict[str, Any]:
    """Topics, producer groups, consumer groups, discards and the last check-back run, over
    every shard of the store (:meth:`Store.shards`), and each shard's pending transactions:
    what ``rmqtx status`` prints, a summary of the views of :mod:`rmq_spark.ops.views` and
    read as they are (the cost follows the work, not the history).

    Returns a JSON-ready dict (timestamps as ISO strings, ages in seconds).
    """
    now = now or datetime.now(UTC)
    shards = store.shards(refresh=True)
    groups, pending = producer_groups(shards, now)
    intake = {s.shard: s.intake_waiting(now.timestamp()) for s in shards}
    topics = topics_view(store, RetentionSettings(), now)["topics"]
    consumers = groups_view(store, RetentionSettings(), now)["groups"]
    return {
        "store": store.root,
        "generated": now.isoformat(),
        "shards": [
            {
                "shard": k,
                "pending_transactions": txns,
                "pending_messages": msgs,
                # Sends of a killed producer in intake objects (pending too, not counted above
                # until check-back lands them) or of a running one about to be landed.
                **dict(zip(("intake_objects", "oldest_intake_seconds"), intake[k], strict=True)),
            }
            for k, (txns, msgs) in pending.items()
        ],
        "topics": [
            {
                "topic": t["topic"],
                "committed": t["messages"],
                "queues": {q: o["next"] for q, o in t["queues"].items()},
            }
            for t in topics
        ],
        "producer_groups": groups,
        "consumer_groups": [
            {
                "consumer_group": c["consumer_group"],
                "reader": c["reader"],
                "topic": c["topic"],
                "lag": c["lag"],
                "queues": {
                    str(q["queue_id"]): q["committed_offset"]
                    for q in c["queues"]
                    if q["committed_offset"] is not None
                },
            }
            for c in consumers
        ],
        "discards": discards(shards),
        "last_check_back": _last_run(newest_runs(shards, 1, ["run_id", "finished", *RUN_COLUMNS])),
    }


def _last_run(runs: pa.Table) -> dict[str, Any] | None:
    """The newest check-back run: the newest row of ``check_runs`` with the rows of the same
    run on the other shards (counts summed; failed when a shard's round failed)."""
    if not runs.num_rows:
        return None
    newest = pc.index(runs.column("started"), pc.max(runs.column("started"))).as_py()
    rows = runs.filter(pc.equal(runs.column("run_id"), runs.column("run_id")[newest])).to_pylist()
    row = {c: rows[0][c] for c in RUN_COLUMNS}
    if len(rows) > 1:
        row.update({c: sum(r[c] for r in rows) for c in _RUN_COUNTS})
        row["started"] = min(r["started"] for r in rows)
        finished = max(r["finished"] for r in rows)
        row["duration_seconds"] = (finished - row["started"]).total_seconds()
        failed = [r for r in rows if r["status"] != "finished"]
        row["status"] = failed[0]["status"] if failed else "finished"
        row["message"] = "; ".join(r["message"] for r in failed if r["message"]) or None
    row["started"] = row["started"].isoformat()
    return row


def to_json(value: Any) -> str:
    """Indented JSON for ``--json``."""
    return json.dumps(value, indent=2, sort_keys=False, default=str)


def format_status(status: Mapping[str, Any]) -> str:
    """``store_status`` as readable tables."""
    shards = status["shards"]
    parts = [f"store {status['store']}, {len(shards)} shard(s)  ({status['generated']})", ""]
    if len(shards) > 1 or any(s["intake_objects"] for s in shards):
        parts += section(
            "shards",
            ["shard", "pending txns", "pending msgs", "intake objects", "oldest intake"],
            [
                [
                    s["shard"],
                    s["pending_transactions"],
                    s["pending_messages"],
                    s["intake_objects"],
                    format_duration(s["oldest_intake_seconds"]),
                ]
                for s in shards
            ],
        )
    parts += section(
        "topics",
        ["topic", "committed", "next offsets"],
        [
            [t["topic"], t["committed"], " ".join(f"{q}:{o}" for q, o in t["queues"].items())]
            for t in status["topics"]
        ],
    )
    parts += section(
        "producer groups",
        [
            "producer group",
            "pending txns",
            "pending msgs",
            "oldest pending",
            "sink epochs",
            "committed 1 h",
            "rolled back 1 h",
        ],
        [
            [
                g["producer_group"],
                g["pending_transactions"],
                g["pending_messages"],
                format_duration(g["oldest_pending_age_seconds"]),
                _sink_epochs(g),
                g["committed_last_hour"],
                g["rolled_back_last_hour"],
            ]
            for g in status["producer_groups"]
        ],
    )
    parts += section(
        "consumer groups",
        ["consumer group", "reader", "topic", "lag"],
        [
            [c["consumer_group"], c["reader"], c["topic"], c["lag"]]
            for c in status["consumer_groups"]
        ],
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
            f"{format_duration(run['duration_seconds'])}: {run['pending_found']} pending, "
            f"{run['committed']} committed, {run['rolled_back']} rolled back, "
            f"{run['unknown']} unknown, {run['unrouted']} unrouted (no checker for their "
            f"group), {run['discarded']} discarded"
        )
    )
    return "\n".join(parts)


def printable(text: str) -> str:
    """``text`` with every character a terminal would act on (control characters, escape
    sequences, line and paragraph separators) written as its Python escape: stored messages
    and names are anyone's input, and must neither drive the operator's terminal nor forge
    rows of a table."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _sink_epochs(group: Mapping[str, Any]) -> str:
    """What a group's pending transactions staged by sinks wait for: their writer (running),
    or the next check-back round, which commits those their closed epoch lists and rolls
    back an aborted epoch's."""
    parts = [
        f"{group[key]} {label}"
        for key, label in (
            ("in_running_sink_epochs", "running"),
            ("in_committed_sink_epochs", "committed next round"),
            ("in_aborted_sink_epochs", "aborted (rolled back next round)"),
        )
        if group[key]
    ]
    return ", ".join(parts) or "-"


def section(title: str, header: list[str], rows: list[list[Any]]) -> list[str]:
    if not rows:
        return [f"{title}: none", ""]
    return [f"{title}:", *table_lines(header, rows), ""]


def table_lines(header: list[str], rows: list[list[Any]]) -> list[str]:
    """``rows`` under ``header`` as the lines of an indented text table (cells made
    :func:`printable`)."""
    cells = [header, *[[printable(str(c)) for c in r] for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return ["  " + line for line in lines]
