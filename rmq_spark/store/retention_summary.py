"""What a maintenance run (:func:`rmq_spark.store.retention.maintain`) removed, on one shard
of a store or on all of them, and what it would expire (``rmqtx maintain --dry-run``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from rmq_spark.model.config import format_duration

log = logging.getLogger("rmq_spark.store.retention")

#: The counts a summary of several shards sums.
_SUMMED = (
    "messages_expired",
    "queues_advanced",
    "transactions_expired",
    "half_removed",
    "op_removed",
    "duration_seconds",
)


@dataclass
class MaintenanceSummary:
    """What one maintenance run removed."""

    run_id: str
    skipped: str | None = None
    #: Committed messages deleted from the CommitLog, and the queues whose earliest offset moved.
    messages_expired: int = 0
    queues_advanced: int = 0
    #: Expired transactions, and the rows removed for them.
    transactions_expired: int = 0
    half_removed: int = 0
    op_removed: int = 0
    #: Files deleted from storage per table, and the bytes the tables' live files hold after.
    files_vacuumed: dict[str, int] = field(default_factory=dict)
    live_bytes: dict[str, int] = field(default_factory=dict)
    duration_seconds: float = 0.0
    #: The shards maintained (a store of several), and those another run held the lock of.
    shards: int = 1
    shards_skipped: list[int] = field(default_factory=list)

    def brief(self) -> str:
        """The summary in one line, for logs (``format`` is the table a terminal shows)."""
        if self.skipped:
            return f"maintenance run {self.run_id} skipped: {self.skipped}"
        return (
            f"maintenance run {self.run_id} finished in {format_duration(self.duration_seconds)}: "
            f"{self.messages_expired:,} message(s) expired, {self.transactions_expired:,} "
            f"decided transaction(s) removed, {sum(self.files_vacuumed.values()):,} file(s) "
            "vacuumed"
        )

    def format(self) -> str:
        """A readable multi-line summary for terminals."""
        if self.skipped:
            return f"maintenance run {self.run_id} skipped: {self.skipped}"
        rows = [
            (
                "messages expired",
                self.messages_expired,
                f"{self.queues_advanced} queue(s) moved up",
            ),
            ("transactions", self.transactions_expired, "decided, published, past retention"),
            ("half rows", self.half_removed, "removed"),
            ("op rows", self.op_removed, "removed"),
            ("files vacuumed", sum(self.files_vacuumed.values()), "deleted from storage"),
            ("live bytes", sum(self.live_bytes.values()), "in the tables' current files"),
        ]
        lines = [
            f"maintenance run {self.run_id} finished in {format_duration(self.duration_seconds)}"
        ]
        if self.shards > 1:
            skipped = ", ".join(map(str, self.shards_skipped))
            lines[0] += f" over {self.shards} shards" + (
                f" (skipped, another run holds their lock: {skipped})" if skipped else ""
            )
        lines += [f"  {name:<18}{value:>14,}   {note}" for name, value, note in rows]
        return "\n".join(lines)

    @classmethod
    def combined(cls, run_id: str, done: Mapping[int, MaintenanceSummary]) -> MaintenanceSummary:
        """One summary of the maintenance runs ``done`` on the shards of a store.

        Parameters
        ----------
        run_id : str
            The run's id.
        done : mapping of int to MaintenanceSummary
            Each shard's summary, by shard (a skipped one's too).

        Returns
        -------
        MaintenanceSummary
            Counts summed, and the shards skipped; skipped when every shard was.
        """
        skipped = [k for k, part in sorted(done.items()) if part.skipped]
        parts = [part for part in done.values() if not part.skipped]
        total = cls(run_id=run_id, shards=len(done), shards_skipped=skipped)
        for name in _SUMMED:
            setattr(total, name, sum(getattr(part, name) for part in parts))
        for name in ("files_vacuumed", "live_bytes"):
            for part in parts:
                for table, n in getattr(part, name).items():
                    getattr(total, name)[table] = getattr(total, name).get(table, 0) + n
        if done and len(skipped) == len(done):
            total.skipped = "another maintenance run holds the maintain lock of every shard"
        log.info("%s", total.format())
        return total


@dataclass(frozen=True)
class QueueExpiry:
    """What retention takes from one CommitLog queue: the offsets ``lowest`` up to (not
    including) ``earliest``, its new earliest offset; ``next_offset`` is the queue's end."""

    topic: str
    queue_id: int
    lowest: int
    earliest: int
    next_offset: int

    @property
    def messages(self) -> int:
        """How many messages it expires."""
        return self.earliest - self.lowest

    @property
    def emptied(self) -> bool:
        """Whether it expires every message of the queue."""
        return self.earliest == self.next_offset


def format_expiry(plan: Sequence[QueueExpiry], kept: float) -> str:
    """What a maintenance run would expire from the CommitLog, per topic and queue, for a
    ``file_reserved_time`` of ``kept`` seconds."""
    plan = [e for e in plan if e.messages]
    if not plan:
        return f"no message is older than file_reserved_time ({kept:g} s): nothing would expire"
    rows = [f"{'topic':<24} {'queue':>5} {'expire':>10}  offsets", "-" * 60]
    for e in plan:
        left = "none left" if e.emptied else f"kept from {e.earliest}"
        rows.append(
            f"{e.topic:<24} {e.queue_id:>5} {e.messages:>10,}  {e.lowest}..{e.earliest - 1}, {left}"
        )
    total = sum(e.messages for e in plan)
    return "\n".join([f"would expire {total:,} message(s) older than {kept:g} s:", *rows])


def emptied_topics(plan: Sequence[QueueExpiry]) -> list[str]:
    """The topics whose every queue ``plan`` (of every queue) empties."""
    topics = sorted({e.topic for e in plan})
    return [t for t in topics if all(e.emptied for e in plan if e.topic == t)]
