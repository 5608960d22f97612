"""What a maintenance run (:func:`rmq_spark.store.retention.maintain`) removed, on one shard
of a store or on all of them."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field

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

    def format(self) -> str:
        """A readable multi-line summary for logs and terminals."""
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
        lines = [f"maintenance run {self.run_id} finished in {self.duration_seconds:.1f} s"]
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
