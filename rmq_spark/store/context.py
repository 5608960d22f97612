"""What the store's concepts share: one store's tables, settings and clock, and the half
messages this process prepared until they are published."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.messages import SHARD_QUEUE_STRIDE
from rmq_spark.store.recent import RecentHalves


@dataclass(frozen=True)
class StoreContext:
    """One store's shared parts, handed to each of its concepts (:class:`StoreConcept`).

    Parameters
    ----------
    tables : DeltaTables
        The store's tables (the Delta layer).
    settings : StoreSettings
        Queue count, body size limit, publish limits, retention of log entries.
    clock : callable
        Returns the current UTC time for the timestamps written.
    recent : RecentHalves
        Half messages this process prepared, until they are published (a publisher that
        finds a whole chunk here does not read ``half`` back).
    shard : int
        Which shard of its store these tables are (0: the root; :mod:`rmq_spark.store.shards`).
    """

    tables: DeltaTables
    settings: StoreSettings
    clock: Callable[[], datetime]
    recent: RecentHalves
    shard: int = 0

    @property
    def queue_base(self) -> int:
        """The first queue id of this shard: its queues are ``queue_base + 0 .. queue_nums - 1``."""
        return self.shard * SHARD_QUEUE_STRIDE


class StoreConcept:
    """A concept of the store (decisions, publishing's chunks, maintenance), made with the
    store's shared parts.

    Parameters
    ----------
    context : StoreContext
        The store's tables, settings, clock and recently prepared half messages.
    """

    def __init__(self, context: StoreContext) -> None:
        self.tables, self.settings = context.tables, context.settings
        self.clock, self.recent = context.clock, context.recent
        self.shard, self.queue_base = context.shard, context.queue_base
