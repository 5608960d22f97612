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
* **Nothing is lost** (rule 4). A crash after a COMMIT decision but before its publish is
  repaired by the next publish, which starts from the recorded ``op`` version.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import closing
from dataclasses import dataclass, field

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


class Publisher:
    """Publishes into one store's ``commitlog`` (see the module docstring); safe to use from
    any number of threads and processes at once.

    Parameters
    ----------
    chunks : Chunks
        Reads what each publish commit holds; its tables, settings and clock are the
        publisher's.
    """

    def __init__(self, chunks: Chunks) -> None:
        self.chunks = chunks
        self.tables = chunks.tables
        self.clock = chunks.clock
        self.queue_nums = chunks.settings.queue_nums
        self.queue_base = chunks.queue_base
        #: This shard's op cursor and foreign-writer guard in the store's one CommitLog.
        self.cursor_id = op_cursor_app_id(chunks.shard)
        self.foreign_id = foreign_op_app_id(chunks.shard)

    def publish(
        self, normal: Sequence[tuple[Message, str]] = (), *, latest: bool = True
    ) -> PublishResult:
        """Move committed messages into ``commitlog``, and send normal messages.

        Publishes every COMMIT recorded in ``op`` before the call (by anyone) that no publisher
        has published yet, plus the given normal messages, with dense per-queue offsets, in
        decision order. Safe to call from any number of processes at once; a crash at any point
        loses nothing and duplicates nothing.

        Parameters
        ----------
        normal : sequence of (Message, producer_group)
            Non-transactional messages to send (already validated), all in one commit: the
            last one, after the committed messages.
        latest : bool, default True
            False: publish up to the ``op`` version this thread just read or wrote (it has
            just decided transactions: every decision that concerns them is at or before it),
            without listing ``op``'s log again; later decisions are their deciders' to publish.

        Returns
        -------
        PublishResult
            What this call wrote (over all its commits), and where the normal messages went.

        Notes
        -----
        A backlog is published in successive commits of at most ``publish_max_messages``
        messages and ``publish_max_bytes`` body bytes (store settings), each holding whole
        ``op`` versions and moving the ``op`` cursor to the last one it holds, so memory stays
        bounded and racing publishers share the work instead of repeating one huge write. One
        ``op`` version larger than the limits (a large sink epoch) is one commit of its own.

        The normal messages get their ``msg_id`` and timestamps once, before the first attempt,
        so every attempt writes the same messages. Each commit is retried on its own (see
        :meth:`_publish_chunk`); another publisher that published a chunk first makes this one
        go on from where that one stopped.
        """
        unsent = self._normal_rows(normal)  # ids and timestamps fixed for every attempt
        target = self.tables.snapshot("op").version() if latest else self.tables.known_version("op")
        published, sent = 0, []
        while True:
            result, done = self._publish_chunk(target, unsent)
            published += result.published
            sent += result.sent
            if done:
                return PublishResult(published, result.op_version, result.commitlog_version, sent)
            failpoint("publish.chunk")

    def _publish_chunk(self, target: int, unsent: pa.Table) -> tuple[PublishResult, bool]:
        """Publish the next chunk of committed messages up to ``op`` version ``target`` in one
        commit, with the normal messages ``unsent`` if it is the last; return what it wrote and
        whether it was the last.

        A commit lost to a concurrent publisher (``CommitFailedError``) did not land and is
        retried from the new state. Before writing, the attempt checks that no other publisher
        moved the ``op`` cursor while it read the chunk (it would write data files for a commit
        bound to fail). A failure that does not say whether the commit landed (an I/O error, or
        a step after the commit such as writing a checkpoint) is retried as well: a landed
        chunk moved the cursor, and the normal messages' ids are looked up in ``commitlog`` (by
        file statistics) and not written again if they are there.
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
            if cursor >= target and unsent.num_rows == 0:
                version = head.version if landed else None
                return PublishResult(len(landed), cursor, version, list(landed)), True
            # ``target`` was read from this thread's op snapshot: no newer one is needed.
            guard = head.txns.get(self.foreign_id, 0)
            end, batch, guard = self.chunks.next_chunk(
                self.tables.snapshot("op", latest=False), cursor, target, guard
            )
            streamed = isinstance(batch, LargeVersion)
            # A streamed version leaves the normal messages to a commit of their own.
            last = end >= target and not (streamed and unsent.num_rows)
            if last and not streamed:
                batch = pa.concat_tables([batch, unsent])
            # Catch up before writing, so that a publisher that lost the race writes no files.
            # The chunk was read for ``cursor``: the newer version may be written on only if
            # its cursor is the same (else the chunk would be published twice); offsets come
            # from it, and Delta's conflict check guards both against any later commit.
            read_version, head = head.version, self.tables.head("commitlog", reload=False)
            if head.version != read_version and head.txns.get(self.cursor_id, -1) != cursor:
                raise CommitFailedError("another publisher moved the op cursor")
            queues = per_queue(_QUEUE_APP_ID_PREFIX, head.txns)
            if streamed:
                stream, next_offsets, written = self.chunks.stream_offsets(batch, queues, end)
                batch = COMMITLOG_SCHEMA.empty_table()
            else:
                batch, next_offsets = assign_offsets(queues, batch)
                written = batch.num_rows
            app_ids = {queue_app_id(t, q): n for (t, q), n in next_offsets.items()}
            if end > cursor:
                app_ids[self.cursor_id] = end
            if guard > head.txns.get(self.foreign_id, 0):
                app_ids[self.foreign_id] = guard
            try:
                if streamed:
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
            if streamed:
                log.info(
                    "published one large decision (op version %d): %s message(s) in commitlog "
                    "version %d",
                    end,
                    f"{written:,}",
                    version,
                )
            log.debug("published %d message(s) up to op version %d", written, end)
            result = PublishResult(written + len(landed), max(end, cursor), version, landed + sent)
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
