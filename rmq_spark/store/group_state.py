"""The state of the consumer groups of ``rmqtx serve`` (:mod:`rmq_spark.store.deliveries`):
what the rows of the ``deliveries`` table say of a group, in any order (:func:`replay`), the
rows a batch adds (:class:`Changes`), where each group is (:func:`progress`, for status), and
the table trimmed to the rows that still say something (:func:`trim`, for maintenance)."""

from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.delta.compaction import compact as compact_table
from rmq_spark.delta.reads import read_files
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.schema import DELIVERIES_SCHEMA

log = logging.getLogger(__name__)


def queue_app_id(group: str, topic: str, queue_id: int) -> str:
    """The application id each commit changing ``group``'s state of a queue records (names
    of groups and topics have no ``/``)."""
    return f"{_group_prefix(group)}{topic}/{queue_id}"


def _group_prefix(group: str) -> str:
    return f"rmqtx.pop/{group}/"


@dataclass(frozen=True)
class Handout:
    """One hand-out of a message: which, which attempt (from 1), how many times extended,
    until when it is invisible, and its nonce."""

    topic: str
    queue_id: int
    queue_offset: int
    attempt: int
    change: int
    invisible_until: datetime
    nonce: str

    @property
    def handle(self) -> str:
        """The receipt handle a client acknowledges with."""
        return f"{self.queue_id}.{self.queue_offset}.{self.attempt}.{self.change}.{self.nonce}"

    @property
    def key(self) -> tuple[str, int, int]:
        return (self.topic, self.queue_id, self.queue_offset)


def handle_key(topic: str, handle: str) -> tuple[str, int, int] | None:
    """The message a receipt handle of ``topic`` names, ``(topic, queue_id, offset)``; None
    for text that is not one of :attr:`Handout.handle`'s."""
    try:
        queue_id, offset, attempt, change, _ = handle.split(".")
        int(attempt), int(change)
        return (topic, int(queue_id), int(offset))
    except ValueError:
        return None


@dataclass
class GroupState:
    """What the table says of one group: where each queue's fresh messages start, the topics
    it started on, its messages in flight, and the application ids' versions it reflects."""

    frontier: dict[tuple[str, int], int] = field(default_factory=dict)
    started: set[str] = field(default_factory=set)
    in_flight: dict[tuple[str, int, int], Handout] = field(default_factory=dict)
    #: Messages decided for the dead-letter topic and not yet known to be published there:
    #: when it was decided.
    dead: dict[tuple[str, int, int], datetime] = field(default_factory=dict)
    done: OrderedDict[str, None] = field(default_factory=OrderedDict)
    seen: dict[str, int] = field(default_factory=dict)


class Changes:
    """The rows and application ids of one batch, and the CommitLog view it reads."""

    def __init__(self, now: datetime) -> None:
        self.now = now
        self.rows: list[dict[str, Any]] = []
        self.touched: dict[str, str] = {}  # application id -> group
        #: (group, message key) to publish to the dead-letter topic after this batch's commit:
        #: decided in it, or decided long ago by a process killed before it published them.
        self.dead: list[tuple[str, tuple[str, int, int]]] = []

    def add(self, group: str, topic: str, queue_id: int, offset: int, kind: str, **more) -> None:
        self.rows.append(
            {
                "consumer_group": group,
                "topic": topic,
                "queue_id": queue_id,
                "queue_offset": offset,
                "kind": kind,
                "recorded_timestamp": self.now,
                **more,
            }
        )
        self.touched[queue_app_id(group, topic, queue_id)] = group

    def handed(self, group: str, h: Handout) -> None:
        self.add(
            group,
            *h.key,
            "deliver",
            attempt=h.attempt,
            change=h.change,
            invisible_until=h.invisible_until,
            handle=h.handle,
        )


@dataclass(frozen=True)
class QueueProgress:
    """Where a consumer group of ``rmqtx serve`` is in one queue."""

    #: The next offset never handed out to the group (None: the queue was never looked at,
    #: it starts at its first stored message).
    frontier: int | None
    #: Messages handed out and neither acknowledged nor dead-lettered.
    in_flight: int
    #: When the group's state of this queue last changed.
    changed: datetime


def progress(rows: pa.Table) -> dict[tuple[str, str], dict[int, QueueProgress]]:
    """Per (group, topic) and queue, where each consumer group is, from the rows of the
    ``deliveries`` table."""
    last = _last_changes(rows)
    out: dict[tuple[str, str], dict[int, QueueProgress]] = {}
    for group in pc.unique(rows.column("consumer_group")).to_pylist():
        state = replay(rows.filter(pc.equal(rows.column("consumer_group"), group)))
        flying = Counter((t, q) for t, q, _ in state.in_flight)
        for r in last.filter(pc.equal(last.column("consumer_group"), group)).to_pylist():
            topic, queue_id = r["topic"], r["queue_id"]
            if queue_id < 0:
                continue  # a topic's start
            out.setdefault((group, topic), {})[queue_id] = QueueProgress(
                state.frontier.get((topic, queue_id)),
                flying[(topic, queue_id)],
                r["recorded_timestamp_max"],
            )
    return out


def _last_changes(rows: pa.Table) -> pa.Table:
    """When each (group, topic, queue) last changed: ``recorded_timestamp_max``."""
    return rows.group_by(["consumer_group", "topic", "queue_id"]).aggregate(
        [("recorded_timestamp", "max")]
    )


def trim(tables: Any, now: datetime) -> dict[str, int]:
    """Rewrite the ``deliveries`` table as the rows that still say something, when they are
    under half of it (else compact its small files, changing nothing): each group's starts,
    each queue's last frontier and each message's last hand-out while it is in flight; not the
    hand-outs and acknowledgements of messages done. The caller holds the table's compaction
    lock; returns the metrics of :func:`rmq_spark.delta.compaction.compact`.

    A group's state is the same read before and after (rows committed meanwhile stay), so
    the servers' memory of it and their application ids stay valid; what a group costs to
    read follows what it has in flight, not how many messages it ever consumed (rule 9)."""
    snapshot = tables.snapshot("deliveries")
    files = tables.data_files("deliveries", snapshot)
    stored = sum(files.column("num_records").to_pylist())
    if not stored:
        return {"numFilesRemoved": 0, "numFilesAdded": 0}
    rows = read_files(
        files.column("uri").to_pylist(),
        DELIVERIES_SCHEMA,
        tables.storage_options,
        sizes=files.column("size_bytes").to_pylist(),
    )
    kept = Changes(now)
    last = {
        (r["consumer_group"], r["topic"], r["queue_id"]): r["recorded_timestamp_max"]
        for r in _last_changes(rows).to_pylist()
    }
    for group in pc.unique(rows.column("consumer_group")).to_pylist():
        state = replay(rows.filter(pc.equal(rows.column("consumer_group"), group)))
        for topic in sorted(state.started):
            kept.add(group, topic, -1, 0, "start")
        for (topic, queue_id), offset in sorted(state.frontier.items()):
            changed = last.get((group, topic, queue_id), now)  # what status shows as progress
            kept.add(group, topic, queue_id, offset, "frontier", recorded_timestamp=changed)
        for handout in state.in_flight.values():
            kept.handed(group, handout)
        for key, decided in state.dead.items():  # not yet known to be published
            kept.add(group, *key, "dead", recorded_timestamp=decided)
    if 2 * len(kept.rows) > stored or tables.direct_interval("deliveries", snapshot) is None:
        return compact_table(tables, "deliveries")  # (a deltalake commit would not remove)
    adds = tables.write("deliveries", [pa.Table.from_pylist(kept.rows, schema=DELIVERIES_SCHEMA)])
    removes = [
        {"path": p, "size": n, "partition_values": {}}
        for p, n in zip(
            files.column("path").to_pylist(), files.column("size_bytes").to_pylist(), strict=True
        )
    ]
    tables.commit("deliveries", adds, snapshot, info={"rmqtx.operation": "trim"}, removes=removes)
    log.debug("trimmed deliveries: %d rows to %d", stored, len(kept.rows))
    return {"numFilesRemoved": len(removes), "numFilesAdded": len(adds)}


def seen(group: str, head: Any) -> dict[str, int]:
    """The versions of ``group``'s application ids in a head."""
    return seen_in(group, head.txns)


def seen_in(group: str, txns: Mapping[str, int]) -> dict[str, int]:
    prefix = _group_prefix(group)
    return {a: v for a, v in txns.items() if a.startswith(prefix)}


def _order(handout: Handout) -> tuple[int, int, datetime]:
    """Which of two hand-outs of a message is the later: attempts, then extensions, then
    renewals (which keep the handle)."""
    return handout.attempt, handout.change, handout.invisible_until


def replay(rows: pa.Table) -> GroupState:
    """A group's state from its rows (any order)."""
    state = GroupState()
    latest: dict[tuple[str, int, int], Handout] = {}
    done: set[tuple[str, int, int]] = set()
    dead: dict[tuple[str, int, int], datetime] = {}
    for r in rows.to_pylist():
        key = (r["topic"], r["queue_id"], r["queue_offset"])
        kind = r["kind"]
        if kind == "start":
            state.started.add(r["topic"])
        elif kind == "frontier":
            queue = (r["topic"], r["queue_id"])
            state.frontier[queue] = max(state.frontier.get(queue, 0), r["queue_offset"])
        elif kind == "done":
            done.add(key)
            if r["handle"] is not None:
                state.done[r["handle"]] = None
        elif kind == "dead":
            dead[key] = r["recorded_timestamp"]
        elif kind == "deliver":
            handout = Handout(
                *key, r["attempt"], r["change"], r["invisible_until"], r["handle"].rsplit(".")[-1]
            )
            known = latest.get(key)
            if known is None or _order(known) < _order(handout):
                latest[key] = handout
    state.in_flight = {k: h for k, h in latest.items() if k not in done and k not in dead}
    state.dead = {k: t for k, t in dead.items() if k not in done}
    return state


def read_group(tables: DeltaTables, group: str, snapshot: Any) -> pa.Table:
    """The rows of ``group`` in a ``deliveries`` snapshot (files pruned by their statistics)."""
    files = tables.data_files("deliveries", snapshot).to_pylist()
    mine = [
        f
        for f in files
        if f["min.consumer_group"] is None
        or f["min.consumer_group"] <= group <= f["max.consumer_group"]
    ]
    return read_files(
        [f["uri"] for f in mine],
        DELIVERIES_SCHEMA,
        tables.storage_options,
        lambda rows: pc.equal(rows.column("consumer_group"), group),
        sizes=[f["size_bytes"] for f in mine],
    )
