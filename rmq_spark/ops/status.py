"""The operator's view of a store, read with deltalake and pyarrow (no Spark, so it is quick):
what ``rmqtx status`` prints, over every shard of the store (:mod:`rmq_spark.store.shards`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.model.config import format_duration
from rmq_spark.spark.epoch_records import staged_in
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
    every shard of the store (:meth:`Store.shards`), and each shard's pending transactions.

    Returns a JSON-ready dict (timestamps as ISO strings, ages in seconds).
    """
    now = now or datetime.now(UTC)
    shards = store.shards(refresh=True)
    files = store.data_files("commitlog").select(["partition.topic", "num_records"])
    counts = files.group_by("partition.topic").aggregate([("num_records", "sum")]).to_pylist()
    committed = {r["partition.topic"]: r["num_records_sum"] for r in counts}
    latest = _next_offsets(store)
    pending = {s.shard: _pending(s) for s in shards}
    writing = {t: w for s in shards for t, w in _sink_writers(s, pending[s.shard]).items()}
    return {
        "store": store.root,
        "generated": now.isoformat(),
        "shards": [
            {
                "shard": k,
                "pending_transactions": len(pc.unique(rows.column("transaction_id"))),
                "pending_messages": rows.num_rows,
            }
            for k, rows in pending.items()
        ],
        "topics": [
            {
                "topic": topic,
                "committed": committed[topic],
                "queues": {str(q): o for q, o in sorted(latest.get(topic, {}).items())},
            }
            for topic in sorted(committed)
        ],
        "producer_groups": _producer_groups(
            pa.concat_tables(pending.values()),
            writing,
            _union(
                shards, lambda s: s.read("op", ["transaction_id", "producer_group", "decision"])
            ),
            now,
        ),
        # Consumer groups commit their offsets to the root (shard 0) alone.
        "consumer_groups": _consumer_groups(store.shard_store(0), latest),
        "discards": _discards(
            _union(
                shards, lambda s: s.read("discard", ["transaction_id", "redriven_transaction_id"])
            )
        ),
        "last_check_back": _last_run(
            _union(shards, lambda s: s.read("check_runs", ["run_id", "finished", *RUN_COLUMNS]))
        ),
    }


def _union(
    shards: Sequence[Store], read: Callable[[Store], pa.Table], columns: Sequence[str] | None = None
) -> pa.Table:
    """``read`` of every shard (its ``columns``), one table: queue and transaction ids are
    each shard's own."""
    tables = [read(s) for s in shards]
    return pa.concat_tables([t.select(list(columns)) if columns else t for t in tables])


def _next_offsets(store: Store) -> dict[str, dict[int, int]]:
    """The next offset of every queue that holds messages, ``{topic: {queue_id: offset}}``,
    in the store's CommitLog (every shard's queues)."""
    latest: dict[str, dict[int, int]] = {}
    for (topic, queue_id), offset in sorted(store.next_offsets().items()):
        latest.setdefault(topic, {})[queue_id] = offset
    return latest


def _pending(store: Store) -> pa.Table:
    """One shard's half messages whose transaction is undecided; their ``store_timestamp`` is
    where check-back's clock for the transaction started (``check_state.first_seen``), so that
    the ages shown are the ones check-back measures, and the producer's stamp until a round
    has seen it."""
    half = store.read(
        "half",
        ["transaction_id", "producer_group", "store_timestamp", "sink_id", "epoch", "generation"],
    )
    op = store.read("op", ["transaction_id"])
    pending = half.filter(
        pc.invert(pc.is_in(half.column("transaction_id"), op.column("transaction_id")))
    )
    clocks = store.read("check_state", ["transaction_id", "first_seen"])
    seen = pending.join(clocks, "transaction_id", join_type="left outer")
    since = pc.coalesce(seen.column("first_seen"), seen.column("store_timestamp"))
    return seen.drop_columns(["first_seen"]).set_column(
        seen.schema.get_field_index("store_timestamp"), "store_timestamp", since
    )


def _sink_writers(store: Store, pending: pa.Table) -> dict[str, bool]:
    """For each pending transaction a transactional writer staged, whether its writer is at
    work (its epoch open in its generation) or its epoch was aborted (the next check-back round
    rolls it back): :func:`rmq_spark.spark.epoch_records.staged_in`."""
    staged = pending.filter(pc.is_valid(pending.column("sink_id")))
    return staged_in(store, staged.to_pylist()) if staged.num_rows else {}


def _producer_groups(
    pending: pa.Table, writing: Mapping[str, bool], op: pa.Table, now: datetime
) -> list[dict[str, Any]]:
    groups: dict[str, dict[str, Any]] = {}

    def group(name: str) -> dict[str, Any]:
        return groups.setdefault(
            name,
            {
                "producer_group": name,
                "pending_transactions": 0,
                "pending_messages": 0,
                "oldest_pending_age_seconds": None,
                "in_running_sink_epochs": 0,
                "in_aborted_sink_epochs": 0,
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
    for transaction, group_name in dict(
        zip(
            pending.column("transaction_id").to_pylist(),
            pending.column("producer_group").to_pylist(),
            strict=True,
        )
    ).items():
        if transaction in writing:
            key = "in_running_sink_epochs" if writing[transaction] else "in_aborted_sink_epochs"
            group(group_name)[key] += 1
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


def _discards(discard: pa.Table) -> dict[str, int]:
    waiting = discard.filter(pc.is_null(discard.column("redriven_transaction_id")))
    return {
        "messages": discard.num_rows,
        "transactions": len(pc.unique(discard.column("transaction_id"))),
        "not_redriven": waiting.num_rows,
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
    if len(shards) > 1:
        parts += _section(
            "shards",
            ["shard", "pending txns", "pending msgs"],
            [[s["shard"], s["pending_transactions"], s["pending_messages"]] for s in shards],
        )
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
            "sink epochs",
            "committed",
            "rolled back",
        ],
        [
            [
                g["producer_group"],
                g["pending_transactions"],
                g["pending_messages"],
                format_duration(g["oldest_pending_age_seconds"]),
                _sink_epochs(g),
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
    or the next check-back round, which rolls back an aborted epoch's (aborted)."""
    running, aborted = group["in_running_sink_epochs"], group["in_aborted_sink_epochs"]
    parts = [f"{running} running"] if running else []
    parts += [f"{aborted} aborted (rolled back next round)"] if aborted else []
    return ", ".join(parts) or "-"


def _section(title: str, header: list[str], rows: list[list[Any]]) -> list[str]:
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
