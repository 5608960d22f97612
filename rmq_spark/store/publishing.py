"""Publishing: committed messages (and normal sends) moved into the CommitLog with dense
per-queue offsets.

* **Committed exactly once, dense offsets** (rules 2 and 5). Only the publisher writes
  ``commitlog``. Each publish commit records, as Delta application transactions, the ``op``
  version it has published up to and the next offset of every queue it wrote
  (:mod:`rmq_spark.store.queues`). Two publishers racing set the same application ids, so
  Delta refuses the second commit; it retries from the new state. Nothing is read-then-written
  without that check, so offsets are dense, only grow, and no committed message is published
  twice or skipped. A backlog goes out in commits of bounded size, whole ``op`` versions each,
  in decision order (:mod:`rmq_spark.store.chunks`). Normal messages get their ``msg_id``
  once per publish, and a retry after a failure that does not say whether the commit landed
  looks them up in ``commitlog`` before writing them again.
* **A store of shards** (:mod:`rmq_spark.store.shards`): each shard's ``op`` has a cursor of
  its own, and the root's publisher takes every shard's COMMITs into the same commits, so one
  publisher makes one commit a round however many shards there are (publishers of one shard
  each, racing for the one log, waited seconds for each other at 16 processes).
* **Nothing is lost** (rule 4). A crash after a COMMIT decision but before its publish is
  repaired by the next publish, which starts from the recorded ``op`` version.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import closing
from dataclasses import dataclass, field
from typing import TypeVar

import pyarrow as pa
import pyarrow.compute as pc
from deltalake.exceptions import (
    CommitFailedError,
    DeltaError,
    DeltaProtocolError,
    SchemaMismatchError,
)

from rmq_spark.delta.files import LargeVersion, read_ahead
from rmq_spark.delta.retry import Unsure, retry_commits
from rmq_spark.model.errors import CorruptStoreError, StoreError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import Message, new_id, queue_for
from rmq_spark.model.schema import COMMITLOG_SCHEMA
from rmq_spark.store.chunks import Chunks
from rmq_spark.store.queues import (
    _QUEUE_APP_ID_PREFIX,
    assign_offsets,
    foreign_op_app_id,
    op_cursor_app_id,
    per_queue,
    queue_app_id,
)
from rmq_spark.store.reads import rows_by_id

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Retries of a publish whose failure did not tell whether it landed.
_MAX_UNSURE_ATTEMPTS = 3


@dataclass(frozen=True)
class PublishResult:
    """What one publish wrote into ``commitlog``."""

    published: int
    op_version: int
    commitlog_version: int | None
    #: (msg_id, queue_id, queue_offset) of the normal messages handed to this publish, in order.
    sent: list[tuple[str, int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class _Part:
    """What one publish commit takes from one shard's ``op``: the half messages of the
    transactions committed in versions (``cursor``, ``end``] (rows, or one version too large to
    hold), short of ``target`` or not, and the foreign-writer guard to record."""

    lane: Publisher
    cursor: int
    end: int
    target: int
    rows: pa.Table | LargeVersion
    guard: int


class Publisher:
    """Publishes one shard's COMMITs (and, at the root of a store of shards, every shard's)
    into the store's one ``commitlog`` (see the module docstring); safe to use from any number
    of threads and processes at once.

    Parameters
    ----------
    chunks : Chunks
        Reads what each publish commit holds; its tables, settings and clock are the
        publisher's.
    lanes : callable, optional
        The root of a store of shards: returns the other shards' publishers, whose COMMITs
        each publish of this one takes too, in the same commits.
    """

    def __init__(
        self, chunks: Chunks, lanes: Callable[[], Sequence[Publisher]] | None = None
    ) -> None:
        self.chunks = chunks
        self.tables = chunks.tables
        self.clock = chunks.clock
        self.queue_nums = chunks.settings.queue_nums
        self.queue_base = chunks.queue_base
        self.shard = chunks.shard
        #: This shard's op cursor and foreign-writer guard in the store's one CommitLog.
        self.cursor_id = op_cursor_app_id(chunks.shard)
        self.foreign_id = foreign_op_app_id(chunks.shard)
        self._lanes = lanes
        #: The thread that reads this shard's ``op`` and ``half`` for the root's publishes
        #: (it keeps their snapshots, one per table, as every thread does).
        self._worker: ThreadPoolExecutor | None = None
        self._worker_lock = threading.Lock()

    def publish(
        self, normal: Sequence[tuple[Message, str]] = (), *, latest: bool = True
    ) -> PublishResult:
        """Move committed messages into ``commitlog``, and send normal messages.

        Publishes every COMMIT recorded in ``op`` before the call (by anyone) that no publisher
        has published yet, plus the given normal messages, with dense per-queue offsets, in
        decision order; at the root of a store of shards, every shard's COMMITs, in the same
        commits (one store-wide publisher makes one commit per round, not one per shard). Safe
        to call from any number of processes at once; a crash at any point loses nothing and
        duplicates nothing.

        Parameters
        ----------
        normal : sequence of (Message, producer_group)
            Non-transactional messages to send (already validated), all in one commit: the
            last one, after the committed messages.
        latest : bool, default True
            False: publish up to the ``op`` version this process just read or wrote (it has
            just decided transactions: every decision that concerns them is at or before it),
            without listing ``op``'s log again; later decisions are their deciders' to publish.

        Returns
        -------
        PublishResult
            What this call wrote (over all its commits), and where the normal messages went;
            ``op_version`` is this shard's.

        Notes
        -----
        A backlog is published in successive commits of at most ``publish_max_messages``
        messages and ``publish_max_bytes`` body bytes (store settings) per shard, each holding
        whole ``op`` versions and moving each shard's ``op`` cursor to the last one it holds,
        so memory stays bounded and racing publishers share the work instead of repeating one
        huge write. One ``op`` version larger than the limits (a large sink epoch) is one
        commit of its own.

        The normal messages get their ``msg_id`` and timestamps once, before the first attempt,
        so every attempt writes the same messages. Each commit is retried on its own (see
        :meth:`_publish_chunk`); another publisher that published a chunk first makes this one
        go on from where that one stopped.
        """
        unsent = self._normal_rows(normal)  # ids and timestamps fixed for every attempt
        lanes = [self, *(self._lanes() if self._lanes else ())]
        targets = dict(zip(lanes, self._each(lanes, lambda p: p._target(latest)), strict=True))
        published, sent = 0, []
        while True:
            result, done = self._publish_chunk(targets, unsent)
            published += result.published
            sent += result.sent
            if done:
                return PublishResult(published, result.op_version, result.commitlog_version, sent)
            failpoint("publish.chunk")

    def _target(self, latest: bool) -> int:
        """The ``op`` version to publish up to (see :meth:`publish`)."""
        return self.tables.latest_version("op") if latest else self.tables.known_version("op")

    def _each(self, lanes: Sequence[Publisher], work: Callable[[Publisher], T]) -> list[T]:
        """``work(lane)`` for each lane, this shard's on this thread, the others' at once on
        their own threads (on an object store, a shard's reads are round trips)."""
        futures = [None if p is self else p._on_worker(work) for p in lanes]
        done = [work(self) if f is None else None for f in futures]
        return [d if f is None else f.result() for d, f in zip(done, futures, strict=True)]

    def _on_worker(self, work: Callable[[Publisher], T]) -> Future[T]:
        with self._worker_lock:
            if self._worker is None:
                self._worker = ThreadPoolExecutor(1, f"rmqtx-publish-shard-{self.shard}")
        return self._worker.submit(work, self)

    def _part(self, cursor: int, target: int, guard: int) -> _Part:
        """This shard's part of the next publish commit (on the thread of its snapshots)."""
        end, rows, guard = self.chunks.next_chunk(cursor, target, guard)
        return _Part(self, cursor, end, target, rows, guard)

    def _publish_chunk(
        self, targets: Mapping[Publisher, int], unsent: pa.Table
    ) -> tuple[PublishResult, bool]:
        """Publish the next chunk of committed messages of each shard up to its ``op``
        version in ``targets`` in one commit, with the normal messages ``unsent`` if it is the
        last; return what it wrote and whether it was the last.

        A commit lost to a concurrent publisher (``CommitFailedError``) did not land and is
        retried from the new state. Before writing, the attempt checks that no other publisher
        moved an ``op`` cursor while it read the chunk (it would write data files for a commit
        bound to fail). A failure that does not say whether the commit landed (an I/O error, or
        a step after the commit such as writing a checkpoint) is retried as well: a landed
        chunk moved the cursors, and the normal messages' ids are looked up in ``commitlog``
        (by file statistics) and not written again if they are there.
        """
        landed: list[tuple[str, int, int]] = []  # normal messages an unsure attempt did send
        unsure: list[Exception] = []

        def attempt(n: int) -> tuple[PublishResult, bool]:
            nonlocal unsent
            if unsure and unsent.num_rows:
                found = self._landed(unsent)
                if found is not None:
                    log.warning("the unsure publish had landed; not sending its messages again")
                    landed.extend(found)
                    unsent = unsent.slice(0, 0)
            head = self.tables.head("commitlog", reload=n > 0)
            cursor = head.txns.get(self.cursor_id, -1)
            if len(unsure) > _MAX_UNSURE_ATTEMPTS:
                if not landed:
                    raise StoreError(
                        f"could not publish: {unsure[-1]} ({len(unsure)} times); the normal "
                        "messages given were not sent. Check the store's filesystem, then retry."
                    ) from unsure[-1]
                # They were sent; committed transactions left over go with the next publish.
                return PublishResult(len(landed), cursor, head.version, list(landed)), True
            behind = [
                (p, head.txns.get(p.cursor_id, -1), t)
                for p, t in targets.items()
                if head.txns.get(p.cursor_id, -1) < t
            ]
            if not behind and unsent.num_rows == 0:
                version = head.version if landed else None
                return PublishResult(len(landed), cursor, version, list(landed)), True
            parts = self._each(
                [p for p, _, _ in behind],
                lambda p: p._part(
                    head.txns.get(p.cursor_id, -1), targets[p], head.txns.get(p.foreign_id, 0)
                ),
            )
            # One version too large to hold is streamed, in a commit of its own.
            streamed = next((q for q in parts if isinstance(q.rows, LargeVersion)), None)
            if streamed is not None:
                parts = [streamed]
            finished = len(parts) == len(behind) and all(q.end >= q.target for q in parts)
            # A streamed version leaves the normal messages to a commit of their own.
            last = finished and not (streamed and unsent.num_rows)
            if streamed is None:
                batch = pa.concat_tables([q.rows for q in parts] + ([unsent] if last else []))
            # Catch up before writing, so that a publisher that lost the race writes no files.
            # The chunk was read for these cursors: the newer version may be written on only
            # if they are the same (else a chunk would be published twice); offsets come from
            # it, and Delta's conflict check guards both against any later commit.
            read_version, head = head.version, self.tables.head("commitlog", reload=False)
            if head.version != read_version and any(
                head.txns.get(q.lane.cursor_id, -1) != q.cursor for q in parts
            ):
                raise CommitFailedError("another publisher moved an op cursor")
            queues = per_queue(_QUEUE_APP_ID_PREFIX, head.txns)
            if streamed is not None:
                stream, next_offsets, written = streamed.lane.chunks.stream_offsets(
                    streamed.rows, queues, streamed.end
                )
                batch = COMMITLOG_SCHEMA.empty_table()
            else:
                batch, next_offsets = assign_offsets(queues, batch)
                written = batch.num_rows
            app_ids = {queue_app_id(t, q): n for (t, q), n in next_offsets.items()}
            for q in parts:
                if q.end > q.cursor:
                    app_ids[q.lane.cursor_id] = q.end
                if q.guard > head.txns.get(q.lane.foreign_id, 0):
                    app_ids[q.lane.foreign_id] = q.guard
            try:
                if streamed is not None:
                    # Closed here: a write that stops early (a writer failed) stops the reader's
                    # helper thread now, not when the traceback that holds it is collected.
                    with closing(read_ahead(stream)) as ahead:
                        files = self.tables.write_stream("commitlog", ahead)
                else:
                    files = self.tables.write("commitlog", [batch])
                version = self.tables.commit(
                    "commitlog",
                    files,
                    head.snapshot,
                    app_ids,
                    {"rmqtx.operation": "publish"},
                    after=head.version,
                )
            except (CommitFailedError, SchemaMismatchError, DeltaProtocolError, StoreError):
                raise  # nothing landed: a lost race (retried) or a bug (raised)
            except (DeltaError, OSError) as exc:
                unsure.append(exc)
                log.warning("publish failed without telling whether it landed (%s); checking", exc)
                raise Unsure from exc
            normal_rows = batch.filter(pc.is_null(batch.column("transaction_id")))
            sent = list(
                zip(
                    normal_rows.column("msg_id").to_pylist(),
                    normal_rows.column("queue_id").to_pylist(),
                    normal_rows.column("queue_offset").to_pylist(),
                    strict=True,
                )
            )
            if streamed is not None:
                log.info(
                    "published one large decision (op version %d of shard %d): %s message(s) "
                    "in commitlog version %d",
                    streamed.end,
                    streamed.lane.shard,
                    f"{written:,}",
                    version,
                )
            log.debug("published %d message(s) of %d shard(s)", written, len(parts))
            mine = max([cursor] + [q.end for q in parts if q.lane is self])
            result = PublishResult(written + len(landed), mine, version, landed + sent)
            return result, last

        return retry_commits("publish", "commitlog", attempt)

    def _landed(self, rows: pa.Table) -> list[tuple[str, int, int]] | None:
        """``(msg_id, queue_id, queue_offset)`` of the normal messages ``rows`` if an earlier
        attempt put them into ``commitlog`` (in the order of ``rows``), else None."""
        ids = rows.column("msg_id").to_pylist()
        files = self.tables.data_files("commitlog")
        found = rows_by_id(self.tables, files, "commitlog", ids, column="msg_id")
        if found.num_rows == 0:
            return None
        where = {
            r["msg_id"]: (r["queue_id"], r["queue_offset"])
            for r in found.select(["msg_id", "queue_id", "queue_offset"]).to_pylist()
        }
        if found.num_rows != len(ids) or len(where) != len(ids):
            raise CorruptStoreError(
                f"{found.num_rows} row(s) of one publish of {len(ids)} message(s) are in "
                "commitlog: one Delta commit landed in part, or a msg_id is stored twice."
            )
        return [(m, *where[m]) for m in ids]

    def _normal_rows(self, normal: Sequence[tuple[Message, str]]) -> pa.Table:
        now = self.clock()
        keys = [m.keys_string for m, _ in normal]
        return pa.Table.from_pydict(
            {
                "topic": [m.topic for m, _ in normal],
                "queue_id": [self.queue_base + queue_for(k, self.queue_nums) for k in keys],
                "queue_offset": [0] * len(normal),
                "msg_id": [new_id() for _ in normal],
                "transaction_id": [None] * len(normal),
                "producer_group": [g for _, g in normal],
                "keys": keys,
                "tags": [m.tags for m, _ in normal],
                "body": [m.body_bytes for m, _ in normal],
                "properties": [list(dict(m.properties).items()) for m, _ in normal],
                "born_timestamp": [now] * len(normal),
                "store_timestamp": [now] * len(normal),
            },
            schema=COMMITLOG_SCHEMA,
        )
