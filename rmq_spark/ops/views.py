"""The operator's views of a store, as Kafka's and RocketMQ's operators read theirs: what
``rmqtx status groups | transactions | topics | store`` print (``--json`` for each), read with
deltalake and pyarrow (no Spark).

Each view's cost follows the work, not the history: offsets come from the CommitLog's recorded
application transactions, message counts and time ranges from its files' statistics, rates
from the files written in the last hour alone, pending transactions from the ``pending`` table
moved on by what was written since (:func:`rmq_spark.checkback.pending.pending_now`), and
decisions from the ``op`` files of the last hour (``bench/status_bench.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.checkback.pending import pending_now
from rmq_spark.delta.reads import read_files
from rmq_spark.model.config import RetentionSettings
from rmq_spark.model.schema import TABLES
from rmq_spark.spark.epoch_records import DROPPED, LISTED, RUNNING, staged_in
from rmq_spark.store.facade import Store
from rmq_spark.store.group_state import progress as serve_progress

#: Pending transactions by age: (label, upper bound in seconds).
AGE_BUCKETS = (("< 1 min", 60.0), ("1-10 min", 600.0), ("10-60 min", 3600.0), ("> 1 h", None))
#: Check-back runs ``status transactions`` lists, newest first.
RUNS_SHOWN = 10
#: The count a sink-staged pending transaction adds to, by what it waits for: its writer, or
#: the next check-back round, which commits it (listed in its closed epoch) or rolls it back.
_SINK_EPOCH_KEYS = {
    RUNNING: "in_running_sink_epochs",
    LISTED: "in_committed_sink_epochs",
    DROPPED: "in_aborted_sink_epochs",
}
_HOUR = timedelta(hours=1)
_MINUTE = timedelta(minutes=1)


def groups_view(
    store: Store, retention: RetentionSettings, now: datetime | None = None
) -> dict[str, Any]:
    """Per consumer group, topic and queue: the committed (next) offset, the end offset, the
    lag and when the group last moved, like ``kafka-consumer-groups --describe``: the groups
    of Spark readers (``reader`` spark) and those ``rmqtx serve`` serves to RocketMQ clients
    (``reader`` serve: their committed offset is the next one never handed out, and their lag
    counts the messages in flight too). A queue the group has not read yet counts from the
    queue's earliest stored offset; messages retention removed before the group read them are
    counted apart (``expired_unread``), not as lag."""
    now = now or datetime.now(UTC)
    ends, earliest = store.next_offsets(), store.earliest_stored()
    root = store.shard_store(0)
    progress: dict[tuple[str, str, str], dict[int, tuple[int | None, int, datetime]]] = {}
    for r in root.read("consumer_offsets").to_pylist():
        key = ("spark", r["consumer_group"], r["topic"])
        progress.setdefault(key, {})[r["queue_id"]] = (r["next_offset"], 0, r["updated_timestamp"])
    for (group, topic), queues in serve_progress(root.read("deliveries")).items():
        progress[("serve", group, topic)] = {
            q: (p.frontier, p.in_flight, p.changed) for q, p in queues.items()
        }
    groups = []
    for (reader, group, topic), done in sorted(progress.items(), key=lambda kv: kv[0][1:]):
        queue_ids = sorted({q for t, q in ends if t == topic} | set(done))
        queues = []
        for q in queue_ids:
            end = ends.get((topic, q), 0)
            committed, in_flight, moved = done.get(q, (None, 0, None))
            first = earliest.get((topic, q), 0)
            start = max(committed, first) if committed is not None else first
            queues.append(
                {
                    "queue_id": q,
                    "committed_offset": committed,
                    "end_offset": end,
                    "lag": max(0, end - start) + in_flight,
                    "in_flight": in_flight,
                    # Messages retention removed before the group read them (its next read
                    # fails with DATA_LOSS, or skips them with failOnDataLoss=false).
                    "expired_unread": max(0, first - committed) if committed is not None else 0,
                    "last_progress": moved.isoformat() if moved else None,
                    "last_progress_age_seconds": _age(now, moved),
                }
            )
        groups.append(
            {
                "consumer_group": group,
                "topic": topic,
                "reader": reader,
                "lag": sum(q["lag"] for q in queues),
                "expired_unread": sum(q["expired_unread"] for q in queues),
                "queues": queues,
            }
        )
    return {"store": store.root, "generated": now.isoformat(), "groups": groups}


def transactions_view(
    store: Store, retention: RetentionSettings, now: datetime | None = None
) -> dict[str, Any]:
    """Per producer group: pending transactions by age, those a sink staged (waiting for
    their writer, or in an aborted epoch), decisions of the last hour; the discards; the last
    check-back runs (with their unrouted and checker errors)."""
    now = now or datetime.now(UTC)
    shards = store.shards(refresh=True)
    groups, _ = producer_groups(shards, now)
    return {
        "store": store.root,
        "generated": now.isoformat(),
        "producer_groups": groups,
        "discards": discards(shards),
        "check_back_runs": _runs(newest_runs(shards, RUNS_SHOWN)),
    }


def producer_groups(
    shards: list[Store], now: datetime
) -> tuple[list[dict[str, Any]], dict[int, tuple[int, int]]]:
    """Each producer group's pending transactions (by age, and those sinks staged) and
    decisions of the last hour, over ``shards``; and each shard's (pending transactions,
    pending messages)."""
    groups: dict[str, dict[str, Any]] = {}

    def group(name: str) -> dict[str, Any]:
        return groups.setdefault(
            name,
            {
                "producer_group": name,
                "pending_transactions": 0,
                "pending_messages": 0,
                "oldest_pending_age_seconds": None,
                "pending_by_age": {label: 0 for label, _ in AGE_BUCKETS},
                "in_running_sink_epochs": 0,
                "in_committed_sink_epochs": 0,
                "in_aborted_sink_epochs": 0,
                "committed_last_hour": 0,
                "rolled_back_last_hour": 0,
            },
        )

    per_shard = {}
    for s in shards:
        pending = pending_now(s)
        per_shard[s.shard] = (
            pending.num_rows,
            pc.sum(pending.column("message_count")).as_py() or 0,
        )
        clocks = s.read("check_state", ["transaction_id", "first_seen"])
        columns = ["transaction_id", "producer_group", "store_timestamp", "message_count"]
        seen = pending.select(columns).join(clocks, "transaction_id", join_type="left outer")
        since = pc.coalesce(seen.column("first_seen"), seen.column("store_timestamp"))
        for name, count, started in zip(
            seen.column("producer_group").to_pylist(),
            seen.column("message_count").to_pylist(),
            since.to_pylist(),
            strict=True,
        ):
            g, age = group(name), _age(now, started) or 0.0
            g["pending_transactions"] += 1
            g["pending_messages"] += count
            g["oldest_pending_age_seconds"] = max(g["oldest_pending_age_seconds"] or 0.0, age)
            g["pending_by_age"][_bucket(age)] += 1
        staged = pending.filter(pc.is_valid(pending.column("sink_id")))
        waits = staged_in(s, staged.to_pylist()) if staged.num_rows else {}
        for name, transaction in zip(
            staged.column("producer_group").to_pylist(),
            staged.column("transaction_id").to_pylist(),
            strict=True,
        ):
            group(name)[_SINK_EPOCH_KEYS[waits[transaction]]] += 1
        for name, decision in _recent(s, "op", "decided_timestamp", now - _HOUR, "decision"):
            key = "committed_last_hour" if decision == "COMMIT" else "rolled_back_last_hour"
            group(name)[key] += 1
    return [groups[name] for name in sorted(groups)], per_shard


def discards(shards: list[Store]) -> dict[str, int]:
    """Messages and transactions in ``discard`` (check max reached), and those not re-driven."""
    discard = _union(
        shards, lambda s: s.read("discard", ["transaction_id", "redriven_transaction_id"])
    )
    return {
        "messages": discard.num_rows,
        "transactions": len(pc.unique(discard.column("transaction_id"))),
        "not_redriven": pc.sum(pc.is_null(discard.column("redriven_transaction_id"))).as_py() or 0,
    }


def topics_view(
    store: Store, retention: RetentionSettings, now: datetime | None = None
) -> dict[str, Any]:
    """Per topic: messages stored, queues and their offsets, messages stored in the last
    minute and hour (and in each minute of the hour, oldest first), and the oldest stored
    (retention expires it ``file_reserved_time`` after it was stored). A topic whose messages
    all expired is listed with none."""
    now = now or datetime.now(UTC)
    files = store.data_files("commitlog")
    stats = (
        files.group_by("partition.topic")
        .aggregate([("num_records", "sum"), ("min.store_timestamp", "min")])
        .to_pylist()
    )
    stored = {r["partition.topic"]: r for r in stats}
    ends, earliest = store.next_offsets(), store.earliest_stored()
    recent = _recent(store, "commitlog", "store_timestamp", now - _HOUR, "store_timestamp")
    minute_ago = now - _MINUTE
    topics = []
    for topic in sorted({t for t, _ in ends} | set(stored)):
        queues = sorted(q for t, q in ends if t == topic)
        hour = [ts for t, ts in recent if t == topic]
        oldest = stored.get(topic, {}).get("min.store_timestamp_min")
        topics.append(
            {
                "topic": topic,
                "messages": stored.get(topic, {}).get("num_records_sum") or 0,
                "queues": {
                    str(q): {"earliest": earliest.get((topic, q), 0), "next": ends[(topic, q)]}
                    for q in queues
                },
                "last_minute": sum(1 for ts in hour if ts >= minute_ago),
                "last_hour": len(hour),
                "per_minute": _per_minute(hour, now),
                "oldest_stored": oldest.isoformat() if oldest else None,
                "expires_after_seconds": retention.file_reserved_time,
            }
        )
    return {"store": store.root, "generated": now.isoformat(), "topics": topics}


def store_view(
    store: Store, retention: RetentionSettings, now: datetime | None = None
) -> dict[str, Any]:
    """The store's shards, each table's Delta version and live data, and retention."""
    now = now or datetime.now(UTC)
    shards = []
    for s in store.shards(refresh=True):
        tables = {}
        for name in TABLES:
            if name == "commitlog" and s.shard:
                continue  # one CommitLog, the root's
            files = s.data_files(name)
            tables[name] = {
                "version": s.table(name).version(),
                "files": files.num_rows,
                "bytes": pc.sum(files.column("size_bytes")).as_py() or 0,
                "rows": pc.sum(files.column("num_records")).as_py() or 0,
            }
        shards.append({"shard": s.shard, "tables": tables})
    return {
        "store": store.root,
        "generated": now.isoformat(),
        "shards": shards,
        "retention": {
            "file_reserved_time_seconds": retention.file_reserved_time,
            "transaction_reserved_time_seconds": retention.transaction_reserved_time,
            "maintenance_interval_seconds": retention.maintenance_interval,
        },
    }


#: ``rmqtx status VIEW``: each view by name.
#: Each takes the store, the ``[retention]`` settings (what expires when) and the time.
VIEWS: Mapping[str, Callable[[Store, RetentionSettings], dict[str, Any]]] = {
    "groups": groups_view,
    "transactions": transactions_view,
    "topics": topics_view,
    "store": store_view,
}


def _recent(
    store: Store, table: str, column: str, since: datetime, value: str
) -> list[tuple[str, Any]]:
    """(producer group, or topic for the CommitLog; ``value``) of the rows of ``table`` whose
    ``column`` is at or after ``since``, reading only the files whose statistics say they may
    hold one."""
    files = store.data_files(table)
    if not files.num_rows:
        return []
    newest = files.column(f"max.{column}")
    chosen = files.filter(pc.fill_null(pc.greater_equal(newest, pa.scalar(since)), True))
    schema = TABLES[table][0]
    partitioned = "partition.topic" in chosen.column_names  # the CommitLog's files: no topic
    key = None if partitioned else "producer_group"
    columns = [c for c in dict.fromkeys([key, column, value]) if c]
    parts = (
        [
            (t, chosen.filter(pc.equal(chosen.column("partition.topic"), t)))
            for t in pc.unique(chosen.column("partition.topic")).to_pylist()
        ]
        if partitioned
        else [(None, chosen)]
    )
    out: list[tuple[str, Any]] = []
    for topic, part in parts:
        rows = read_files(
            part.column("uri").to_pylist(),
            pa.schema([schema.field(c) for c in columns]),
            store.settings.storage_options,
            lambda t: pc.greater_equal(t.column(column), pa.scalar(since)),
            sizes=part.column("size_bytes").to_pylist(),
        )
        keys = [topic] * rows.num_rows if partitioned else rows.column(key).to_pylist()
        out += zip(keys, rows.column(value).to_pylist(), strict=True)
    return out


def newest_runs(shards: list[Store], count: int, columns: list[str] | None = None) -> pa.Table:
    """The ``check_runs`` rows of each shard's ``count`` newest check-back runs at least,
    reading the newest files only (the table grows by a row a round and is never trimmed)."""
    schema = TABLES["check_runs"][0]
    fields = pa.schema([schema.field(c) for c in columns]) if columns else schema
    tables = []
    for s in shards:
        files = s.data_files("check_runs").sort_by([("max.started", "descending")])
        chosen, rows = [], 0
        for uri, records in zip(
            files.column("uri").to_pylist(), files.column("num_records").to_pylist(), strict=True
        ):
            if rows >= count:
                break
            chosen.append(uri)
            rows += records if records is not None else count  # no statistics: read on
        tables.append(read_files(chosen, fields, s.settings.storage_options))
    return pa.concat_tables(tables)


#: The counts of a ``check_runs`` row, summed over the shards of a run.
_RUN_COUNTS = (
    "pending_found", "checked", "committed", "rolled_back", "unknown", "already_decided",
    "discarded", "unrouted", "errors",
)  # fmt: skip


def _runs(runs: pa.Table) -> list[dict[str, Any]]:
    """The newest check-back runs, one row a run (a run of several shards summed)."""
    by_run: dict[str, dict[str, Any]] = {}
    for r in runs.to_pylist():
        run = by_run.get(r["run_id"])
        if run is None:
            by_run[r["run_id"]] = dict(r)
            continue
        for key in _RUN_COUNTS:
            run[key] += r[key]
        run["started"] = min(run["started"], r["started"])
        run["finished"] = max(run["finished"], r["finished"])
        if r["status"] != "finished":
            run["status"], run["message"] = r["status"], r["message"]
    newest = sorted(by_run.values(), key=lambda r: r["started"], reverse=True)[:RUNS_SHOWN]
    return [
        {
            **{k: v for k, v in r.items() if k not in ("started", "finished")},
            "started": r["started"].isoformat(),
            "duration_seconds": (r["finished"] - r["started"]).total_seconds(),
        }
        for r in newest
    ]


def _union(shards: list[Store], read: Callable[[Store], pa.Table]) -> pa.Table:
    return pa.concat_tables([read(s) for s in shards])


def _age(now: datetime, then: datetime | None) -> float | None:
    return None if then is None else round(max(0.0, (now - then).total_seconds()), 3)


def _per_minute(stamps: list[datetime], now: datetime) -> list[int]:
    """How many of ``stamps`` fall in each of the last 60 minutes, the oldest minute first."""
    counts = [0] * 60
    for stamp in stamps:
        minutes_ago = int((now - stamp).total_seconds() // 60)
        if 0 <= minutes_ago < 60:
            counts[59 - minutes_ago] += 1
    return counts


def _bucket(age: float) -> str:
    return next(label for label, bound in AGE_BUCKETS if bound is None or age < bound)
