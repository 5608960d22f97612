"""What ``rmqtx serve`` writes to its store: half messages, decisions and normal messages,
group-committed.

A server writes as a producer process does (:mod:`rmq_spark.store.publish_loop`): to the shard
it claims, with a background publisher and maintenance, and it publishes its own COMMITs when
it stops. Sends and decisions from every client are handed to two group committers, so one
Delta commit carries every half message (or every decision and normal message) that arrived
while the previous one was written.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rmq_spark.group_commit import GroupCommitter, Slot
from rmq_spark.model.messages import Message
from rmq_spark.store.decisions import Decision
from rmq_spark.store.facade import Store
from rmq_spark.store.publish_loop import (
    BackgroundPublisher,
    end_in_background,
    publish_own,
    publisher_for,
)

#: How long a group commit waits for more sends or decisions once clients are concurrent:
#: their requests arrive spread out (not in waves, as a producer's threads do), and with 64
#: senders batches of 3 ms held 5 to 8 items, each a Delta commit whose CPU the clients'
#: requests then lacked (measured: 20 ms gave about 40% more transactions per second in
#: three paired runs of ``make bench-serve``; 5 ms and 40 ms gave fewer, docs/benchmarks.md).
LINGER_SECONDS = 0.02


class ServerWrites:
    """A server's writes to ``store``, in at most ``max_batch`` items a commit.

    Call :meth:`start` before :meth:`prepare` and :meth:`end`, and :meth:`close` at the end
    (both blocking).
    """

    def __init__(self, store: Store, max_batch: int) -> None:
        self.store = store
        #: The shard written to (the store itself until :meth:`start`).
        self.writer = store
        self._max_batch = max_batch
        self._publisher: BackgroundPublisher | None = None
        self._prepare: GroupCommitter[tuple[Message, str], Any] | None = None
        self._end: GroupCommitter[Decision | tuple[Message, str], Any] | None = None

    def start(self) -> None:
        """Pick the shard to write to (as a producer process does), start the publisher, the
        maintenance and the group committers."""
        self._publisher = publisher_for(self.store)
        self.writer = self._publisher.writer
        self.writer.maintain_in_background()
        # wave=False: remote callers' requests arrive spread out, not in waves.
        self._prepare = GroupCommitter(
            "rmqtx-serve-prepare", self._prepare_batch, self._max_batch, LINGER_SECONDS, wave=False
        )
        self._end = GroupCommitter(
            "rmqtx-serve-end", self._end_batch, self._max_batch, LINGER_SECONDS, wave=False
        )

    def prepare(self, message: Message, group: str) -> Slot[Any]:
        """Store a half message of ``group``: its :class:`Prepared` once durable."""
        assert self._prepare is not None, "start() first"
        return self._prepare.submit((message, group))

    def end(self, item: Decision | tuple[Message, str]) -> Slot[Any]:
        """End a transaction (its :class:`EndTransactionResult`), or publish a normal message
        ``(message, group)`` (its ``(topic, queue, offset)``, or the exception its publish
        raised)."""
        assert self._end is not None, "start() first"
        return self._end.submit(item)

    def close(self) -> None:
        """Finish what the committers hold, publish this server's COMMITs, stop the publisher
        and wait for the maintenance asked for."""
        for committer in (self._prepare, self._end):
            if committer is not None:
                committer.close()
        if self._publisher is not None:
            self._publisher.stop()
        publish_own(self.writer, "this server")
        self.writer.finish_maintenance()

    def _prepare_batch(self, items: list[tuple[Message, str]]) -> list[Any]:
        """Prepare each group's sends in turn; a group whose write fails fails its own sends
        alone (its exception as their result): the groups before it are stored, and sends
        answered as failed would be sent again."""
        by_group: dict[str, list[int]] = {}
        for i, (_, group) in enumerate(items):
            by_group.setdefault(group, []).append(i)
        results: list[Any] = [None] * len(items)
        for group, indexes in by_group.items():
            try:
                prepared: list[Any] = self.writer.prepare(
                    [items[i][0] for i in indexes], group, validated=True
                )
            except Exception as exc:
                prepared = [exc] * len(indexes)
            for i, p in zip(indexes, prepared, strict=True):
                results[i] = p
        return results

    def _end_batch(self, items: list[Decision | tuple[Message, str]]) -> list[Any]:
        decisions = [i for i in items if isinstance(i, Decision)]
        normal = [i for i in items if not isinstance(i, Decision)]
        ended = iter(end_in_background(self.store, self._publisher, decisions, normal=bool(normal)))
        try:
            sent: Sequence[Any] = self.writer.publish(normal, latest=False).sent if normal else []
        except Exception as exc:
            if not decisions:
                raise
            # The decisions are durable (their callers succeeded); the normal messages failed.
            sent = [exc] * len(normal)
        published = iter(sent)
        return [next(ended) if isinstance(i, Decision) else next(published) for i in items]
