"""What the next publish commit holds: the half messages of the transactions committed in a
window of ``op`` versions, in decision order, within the publish limits.

Rule 2 (exactly once) and rule 9 (cost follows the work): a chunk holds whole ``op`` versions,
so the cursor moves past exactly what it published; memory stays bounded (the decisions are
read in growing windows only until the limits are reached, and one version too large to hold
is streamed); transactions decided again after another writer changed ``op`` are published
only if the CommitLog does not hold them yet.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from datetime import datetime

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from rmq_spark.delta.files import LargeVersion, stored_share
from rmq_spark.delta.reads import read_files
from rmq_spark.model.errors import CorruptStoreError
from rmq_spark.model.schema import COMMITLOG_SCHEMA, HALF_SCHEMA, TIMESTAMP
from rmq_spark.store.context import StoreConcept
from rmq_spark.store.oplog import commits_in
from rmq_spark.store.queues import assign_offsets
from rmq_spark.store.reads import KEYS, discarded, half_messages, once, published

log = logging.getLogger(__name__)

#: A publish of one large decision (streamed) logs how far it is at INFO this often.
PROGRESS_SECONDS = 30.0

#: Hex digits of the millisecond clock that begins every id
#: (:func:`rmq_spark.model.messages.new_id`).
_ID_MILLIS_DIGITS = 12


class Chunks(StoreConcept):
    """Reads the chunks a publisher commits (see the module docstring)."""

    def next_chunk(self, cursor: int, target: int, guard: int) -> tuple[int, pa.Table, int]:
        """The next chunk to publish: ``(end, rows, guard)``, the half messages of the
        transactions committed in ``op`` versions (cursor, end], in decision order, for the
        largest ``end <= target`` within the publish limits (but at least one version), and
        the :data:`rmq_spark.store.queues.FOREIGN_OP_APP_ID` to record (``guard``, or a newer
        foreign commit's time).

        Memory stays bounded: the change feed is read in growing windows of versions only until
        ``publish_max_messages`` committed transactions are found (each has one message or
        more), and only the half messages of those are read.
        """
        self.recent.publishing(cursor)
        end, rows, guard = self._next_chunk(cursor, target, guard)
        self.recent.published_to(end)
        return end, rows, guard

    def _next_chunk(self, cursor: int, target: int, guard: int) -> tuple[int, pa.Table, int]:
        max_messages = self.settings.publish_max_messages
        decided, found, end, window = [], 0, cursor, 16
        while end < target and found < max_messages:
            stop = min(target, end + window)
            commits, foreign = commits_in(self.tables, end + 1, stop)
            decided.append(commits)
            guard = max(guard, foreign)
            found += commits.num_rows
            end, window = stop, window * 2
        if not found:
            return end, COMMITLOG_SCHEMA.empty_table(), guard
        decisions = pa.concat_tables(decided)
        versions = decisions.column("_commit_version").to_numpy()
        if found > max_messages:
            end = _cut(versions, max_messages)
            decisions = decisions.filter(pa.array(versions <= end))
        committed = decisions.column("transaction_id")
        decisions = self._not_published(decisions, guard)
        if decisions.num_rows < len(committed):  # those published already: stale if kept
            kept = set(decisions.column("transaction_id").to_pylist())
            self.recent.discard(t for t in committed.to_pylist() if t not in kept)
        if not decisions.num_rows:
            return end, COMMITLOG_SCHEMA.empty_table(), guard
        txn_ids = decisions.column("transaction_id")
        halves = self.recent.take(txn_ids.to_pylist())
        if halves is None:
            # Cut the chunk before reading it, by what its transactions take in ``half`` (a
            # sink epoch has a whole task's rows in each): one version over the limits alone
            # is streamed instead of read whole.
            files = self.tables.data_files("half")
            size, rows = stored_share(files, txn_ids, ["size_bytes", "num_records"])
            limits = self.settings.publish_max_bytes, max_messages
            versions = decisions.column("_commit_version").to_numpy()
            over = (np.cumsum(size) > limits[0]) | (np.cumsum(rows) > limits[1])
            if over.any():
                end = _cut(versions, int(np.argmax(over)))
                keep = versions <= end
                decisions = decisions.filter(pa.array(keep))
                txn_ids = decisions.column("transaction_id")
                if size[keep].sum() > limits[0] or rows[keep].sum() > limits[1]:
                    return end, LargeVersion(files, txn_ids), guard
            halves = half_messages(self.tables, txn_ids.to_pylist(), files)
        # Decision order first, then send order: a transaction's rows are stored in one
        # append, in send order, and read back in file order.
        rank = pc.index_in(halves.column("transaction_id"), value_set=txn_ids).to_numpy()
        halves = _stable_sort(halves, rank)
        versions = decisions.column("_commit_version").to_numpy()[np.sort(rank)]
        sizes = pc.binary_length(halves.column("body")).to_numpy(zero_copy_only=False)
        over = (np.arange(1, len(versions) + 1) > max_messages) | (
            np.cumsum(sizes) > self.settings.publish_max_bytes
        )
        if over.any():
            end = _cut(versions, int(np.argmax(over)))
            halves = halves.slice(0, int(np.searchsorted(versions, end, side="right")))
        return end, _as_commitlog(halves, self.clock()), guard

    def _not_published(self, decisions: pa.Table, guard: int) -> pa.Table:
        """``decisions`` (``_COMMITTED`` rows) without the transactions made before ``guard``
        (:data:`rmq_spark.store.queues.FOREIGN_OP_APP_ID`) that ``commitlog`` or ``discard``
        already holds: decided again after another Delta writer removed their decisions, they
        are not published twice, and one rolled back at the check max comes back only through
        its re-drive (torture, seed 5)."""
        ids = decisions.column("transaction_id")
        older = pc.less(pc.utf8_slice_codeunits(ids, 0, _ID_MILLIS_DIGITS), f"{guard:012X}")
        suspects = pc.filter(ids, older).to_pylist() if guard else []
        if not suspects:
            return decisions
        again = published(self.tables, suspects)
        maxed = discarded(self.tables, suspects) - again
        for found, where in (
            (again, "in the CommitLog already: not published twice"),
            (maxed, "in discard (rolled back at the check max): published only by a re-drive"),
        ):
            if found:
                log.error(
                    "%d transaction(s) decided again after another Delta writer changed op, "
                    "e.g. %s, are %s (see docs/guarantees.md)",
                    len(found),
                    min(found),
                    where,
                )
        skip = sorted(again | maxed)
        return decisions.filter(pc.invert(pc.is_in(ids, value_set=pa.array(skip, pa.string()))))

    def stream_offsets(
        self, version: LargeVersion, next_offsets: Mapping[tuple[str, int], int], op_version: int
    ) -> tuple[Iterator[pa.Table], dict[tuple[str, int], int], int]:
        """The committed messages of ``op_version``, too large to hold, as a stream of
        CommitLog rows with offsets after ``next_offsets``: ``(stream, the next offsets of the
        queues it moves, messages)``.

        A first pass reads only the routing columns to count each queue's messages (the commit
        names its queues' next offsets); the second reads the messages a batch at a time, and
        logs its progress every :data:`PROGRESS_SECONDS`.
        """
        options = self.settings.storage_options
        stored = read_files(
            version.uris,
            pa.schema(
                [HALF_SCHEMA.field(c) for c in ("transaction_id", "msg_id", "topic", "queue_id")]
            ),
            options,
            version.keep,
        )
        routing = once(stored, "half")
        # Copies another Delta writer stored (rare): the stream skips the ids it has seen.
        seen: set[tuple[str, str]] | None = set() if routing.num_rows < stored.num_rows else None
        counts = routing.group_by(["topic", "queue_id"]).aggregate([("topic", "count")])
        moved = {
            (r["topic"], r["queue_id"]): next_offsets.get((r["topic"], r["queue_id"]), 0)
            + r["topic_count"]
            for r in counts.to_pylist()
        }
        now = self.clock()

        def stream() -> Iterator[pa.Table]:
            running = dict(next_offsets)
            copied, started = 0, time.monotonic()
            reported = started
            for rows in version.batches(options):
                if seen is not None and not (rows := _unseen(rows, seen)).num_rows:
                    continue
                rows, advanced = assign_offsets(running, _as_commitlog(rows, now))
                running.update(advanced)
                yield rows
                copied += rows.num_rows
                if time.monotonic() - reported >= PROGRESS_SECONDS:
                    reported = time.monotonic()
                    log.info(
                        "publishing one large decision (op version %d): %s of %s message(s) "
                        "copied into commitlog (%d%%, %.0f s)",
                        op_version,
                        f"{copied:,}",
                        f"{routing.num_rows:,}",
                        100 * copied // max(routing.num_rows, 1),
                        reported - started,
                    )
            if {k: running.get(k) for k in moved} != moved:
                raise CorruptStoreError(
                    "the half messages of one decision differ between two reads of the same "
                    "snapshot: a data file of half changed under the publisher."
                )

        return stream(), moved, routing.num_rows


def _unseen(rows: pa.Table, seen: set[tuple[str, str]]) -> pa.Table:
    """The ``rows`` whose transaction and ``msg_id`` are not in ``seen`` yet, each once; adds
    them to it."""
    keep = []
    ids = zip(*(rows.column(c).to_pylist() for c in KEYS["half"]), strict=True)
    for i, key in enumerate(ids):
        if key not in seen:
            seen.add(key)
            keep.append(i)
    return rows if len(keep) == rows.num_rows else rows.take(pa.array(keep, pa.int64()))


def _as_commitlog(halves: pa.Table, now: datetime) -> pa.Table:
    """Half messages as CommitLog rows stored at ``now`` (offsets still to assign)."""
    columns = {
        name: halves.column(name) for name in COMMITLOG_SCHEMA.names if name in HALF_SCHEMA.names
    }
    columns["queue_offset"] = pa.repeat(pa.scalar(0, pa.int64()), halves.num_rows)
    columns["store_timestamp"] = pa.repeat(pa.scalar(now, TIMESTAMP), halves.num_rows)
    return pa.table(
        {name: columns[name] for name in COMMITLOG_SCHEMA.names}, schema=COMMITLOG_SCHEMA
    )


def _cut(versions: np.ndarray, first_over: int) -> int:
    """The last ``op`` version of a chunk whose rows (sorted by ``op`` version) go over the
    publish limits at row ``first_over``: the versions before that row's, or the first version
    whole when the row is in it."""
    over = int(versions[first_over])
    return over - 1 if over > versions[0] else over


#: Above this many runs of equal rank, _stable_sort copies rows instead of slicing runs.
_MAX_SLICED_RUNS = 64


def _stable_sort(rows: pa.Table, rank: np.ndarray) -> pa.Table:
    """``rows`` stably sorted by ``rank``. Runs of equal rank move as zero-copy slices (an
    epoch's few large transactions); many small runs are gathered into one chunk."""
    if len(rank) < 2 or bool(np.all(rank[:-1] <= rank[1:])):
        return rows
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    if len(starts) > _MAX_SLICED_RUNS:
        # One chunk first: pyarrow's take over many chunks of large binaries is ~20x slower.
        return rows.combine_chunks().take(np.argsort(rank, kind="stable"))
    ends = np.r_[starts[1:], len(rank)]
    order = np.argsort(rank[starts], kind="stable")
    return pa.concat_tables([rows.slice(starts[i], ends[i] - starts[i]) for i in order])
