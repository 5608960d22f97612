"""What a check-back round reports: its summary, its check batch, and its ``check_runs`` row.

Keeps docs/contract.md, rule 6 in view of the operator: every outcome a RocketMQ user knows
(checked, COMMIT, ROLLBACK, UNKNOWN asked again, rolled back at the check max, older than the
max check age, not yet due within timeout or immunity, a checker that raised) is counted by
name. Every round, a failing one too, records a row in ``check_runs``; a failure to record it
is logged and never hides the round's own outcome.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from datetime import datetime

import pyarrow as pa
from pyspark.sql import DataFrame

from rmq_spark.model.config import format_duration
from rmq_spark.model.schema import CHECK_RUNS_SCHEMA
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CheckBackSummary:
    """What one check-back run found and decided (also a row of ``check_runs``)."""

    run_id: str
    started: datetime
    finished: datetime
    duration_seconds: float
    pending_found: int
    checked: int
    committed: int
    rolled_back: int
    unknown: int
    already_decided: int
    discarded: int
    skipped_for_age: int
    not_yet_due: int
    unrouted: int
    errors: int
    oldest_pending_age_seconds: float | None
    status: str
    message: str | None

    def format(self) -> str:
        """A readable multi-line summary for logs and terminals."""
        oldest = format_duration(self.oldest_pending_age_seconds)
        rows = [
            ("pending found", self.pending_found, f"oldest pending: {oldest}"),
            ("checked", self.checked, "asked a checker this run"),
            ("committed", self.committed, "checker said COMMIT; now visible"),
            ("rolled back", self.rolled_back, "checker said ROLLBACK"),
            ("unknown", self.unknown, "asked again next run"),
            (
                "already decided",
                self.already_decided,
                "decided first by another: the producer or another check-back run",
            ),
            ("discarded", self.discarded, "rolled back at the check max; see discard table"),
            ("skipped for age", self.skipped_for_age, "older than the max check age"),
            ("not yet due", self.not_yet_due, "younger than timeout or immunity; writer alive"),
            ("unrouted", self.unrouted, "no checker configured for their producer group"),
            ("checker errors", self.errors, "checker raised; counted as unknown"),
        ]
        lines = [
            f"check-back run {self.run_id} {self.status} in "
            f"{format_duration(self.duration_seconds)}"
            + (f": {self.message}" if self.message else "")
        ]
        lines += [f"  {name:<16}{value:>10,}   {note}" for name, value, note in rows]
        return "\n".join(lines)


@dataclass(frozen=True)
class CheckBackResult:
    """A run's summary and its check batch.

    ``check_batch`` has one row per pending transaction: its representative message, the
    ``age_seconds``, ``check_count`` before the run, the ``reason`` it was checked or not,
    and the checker's ``answer`` and ``error`` (null when not asked).
    """

    summary: CheckBackSummary
    check_batch: DataFrame


#: The counts of a summary (its ``int`` fields).
_COUNTS = [f.name for f in fields(CheckBackSummary) if f.type == "int"]


def _summary(
    run_id: str,
    started: datetime,
    finished: datetime,
    counts: Mapping[str, int],
    oldest: float | None,
    status: str,
    message: str | None,
) -> CheckBackSummary:
    return CheckBackSummary(
        run_id=run_id,
        started=started,
        finished=finished,
        duration_seconds=(finished - started).total_seconds(),
        oldest_pending_age_seconds=oldest,
        status=status,
        message=message,
        **{name: counts.get(name, 0) for name in _COUNTS},
    )


def record_run(
    store: Store,
    run_id: str,
    started: datetime,
    finished: datetime,
    counts: Counter[str],
    oldest: float | None,
    status: str,
    message: str | None,
) -> CheckBackSummary:
    """Summarise a run from its ``counts``; append it to ``check_runs`` (logged if that fails)."""
    summary = _summary(run_id, started, finished, counts, oldest, status, message)
    try:
        store.append("check_runs", pa.Table.from_pylist([asdict(summary)], CHECK_RUNS_SCHEMA))
    except Exception:
        log.exception("could not record check-back run %s in check_runs", run_id)
    return summary


def combine_summaries(
    summaries: Mapping[int, CheckBackSummary], failed: Sequence[int]
) -> CheckBackSummary:
    """One summary of a run's rounds on the shards of a store (all of one ``run_id``).

    Parameters
    ----------
    summaries : mapping of int to CheckBackSummary
        The rounds' summaries by shard, a failed round's too (at least one).
    failed : sequence of int
        The shards whose round failed: each counts as one error, and the run as failed.

    Returns
    -------
    CheckBackSummary
        Counts summed, from the first start to the last finish, the oldest pending age the
        largest, and the failed rounds' messages.
    """
    counts: Counter[str] = Counter()
    for s in summaries.values():
        counts.update({name: getattr(s, name) for name in _COUNTS})
    counts["errors"] += len(failed)
    parts = list(summaries.values())
    ages = [s.oldest_pending_age_seconds for s in parts if s.oldest_pending_age_seconds is not None]
    messages = [f"shard {k}: {summaries[k].message or 'failed'}" for k in failed if k in summaries]
    return _summary(
        parts[0].run_id,
        min(s.started for s in parts),
        max(s.finished for s in parts),
        counts,
        max(ages, default=None),
        "failed" if failed else "finished",
        "; ".join(messages)[:1000] or None,
    )
