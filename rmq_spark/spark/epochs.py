"""Epochs of transactional writers: which attempt of an epoch counts, and when a writer is gone.

A transactional writer (the ``rmqtx`` sink, :func:`rmq_spark.spark.sink.publish_with_delta_write`)
stages an epoch's messages as half messages, one transaction per task attempt, tagged in the
``half`` table's writer columns (``sink_id``, ``epoch``, ``generation``, ``delta_table``) that
only these writers set. Each (sink, epoch) has one row in ``epochs``, a small state machine
whose every transition is a conditional Delta MERGE on that row, so racing transitions conflict
and exactly one applies. This module is the machine: its transitions, leases, and finishing
an epoch (how the rows are read and written: :mod:`rmq_spark.spark.epoch_records`). The states:

* **OPEN** (generation *g*, lease): a writer is at work. Tasks :func:`hold` the epoch before
  they stage (opening it, or reopening an ABANDONED one as generation *g* + 1) and renew its
  lease by heartbeat while they run (:class:`Lease`).
* **CLOSED** (list): the writer's commit :func:`close`\\ s the epoch with the transactions that
  count, only if it is still OPEN in the generation its transactions were staged in. Those are
  COMMITted; every other attempt of the epoch (a failed task, a replay, a dead driver's) is
  rolled back.
* **ABANDONED** (generation *g*): the check-back job found the lease run out (the writer is
  presumed dead) and :func:`abandon`\\ ed the epoch, or the writer's abort :func:`release`\\ d
  it at once (no attempt of it will close the epoch); only then are generation-*g*
  transactions rolled back, those of tasks the driver never heard from included. A task of
  the aborted attempt that holds the epoch after the abort (Spark cancels tasks
  asynchronously) is refused: only a new attempt reopens it. A writer that
  was alive after all cannot close it any more: its commit fails loudly
  (:class:`EpochLostError`), Spark retries, and the retry reopens the epoch.

So a staged transaction is rolled back only when no writer can list it any more, never because
a check budget ran out while its writer was running (contract rule 8), and a writer either
publishes everything it staged or fails.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from rmq_spark.delta.reads import sql_string
from rmq_spark.model.clock import Clock, utc_now
from rmq_spark.model.errors import EpochLostError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import LocalTransactionState
from rmq_spark.spark.epoch_records import (
    ABANDONED,
    CLOSED,
    OPEN,
    Epoch,
    insert_all,
    lease_clock,
    merge_epoch,
    read_epoch,
)
from rmq_spark.store.decisions import Decision
from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

COMMIT, ROLLBACK, UNKNOWN = (
    LocalTransactionState.COMMIT,
    LocalTransactionState.ROLLBACK,
    LocalTransactionState.UNKNOWN,
)
#: A lease is renewed when less than this share of it is left.
_RENEW_BELOW = 0.5


@dataclass(frozen=True)
class EpochOutcome:
    """What closing an epoch did."""

    sink_id: str
    epoch: int
    #: The transactions that count for the epoch (ours, or an earlier closer's).
    committed: tuple[str, ...]
    #: Staged transactions rolled back because another attempt's list won.
    rolled_back: tuple[str, ...]
    #: Whether this call's list won (False: the epoch was closed before, e.g. a replay).
    first: bool


def aborted_by(attempt: str | None) -> str:
    """``closed_by`` of an epoch that attempt ``attempt`` of its writer aborted."""
    return "abort" if attempt is None else f"abort:{attempt}"


def _refuse_aborted(row: Epoch, attempt: str | None) -> None:
    """Refuse an epoch to a task of the attempt that aborted it (released, or closed empty)."""
    if attempt is not None and row.state != OPEN and row.closed_by == aborted_by(attempt):
        raise EpochLostError(
            f"epoch {row.epoch} of sink {row.sink_id!r} was aborted by this task's own write "
            "attempt (its job failed or its query stopped): the task stages nothing. A new "
            "attempt (a re-run, a restarted query) reopens the epoch."
        )


# --------------------------------------------------------------------------- transitions
def hold(
    store: Store,
    sink_id: str,
    epoch: int,
    owner: str,
    lease_seconds: float,
    clock: Clock | None = None,
    attempt: str | None = None,
) -> Epoch:
    """Take the epoch for a writer about to stage: open it (generation 0), reopen it when it
    was ABANDONED (next generation), or renew its lease when it is OPEN. Stage with the
    returned row's ``generation``.

    Raises
    ------
    EpochLostError
        The epoch belongs to another owner (e.g. a stream restarted with the same ``sinkId``
        but a new checkpoint), or write attempt ``attempt`` (made on the writer's driver)
        aborted it: a late task of a failed job must not reopen it for itself.
    """
    row = read_epoch(store, sink_id, epoch)
    now = lease_clock(store, clock)()
    _check_owner(row, owner)
    if row is not None:
        _refuse_aborted(row, attempt)
        if row.state == CLOSED or _fresh(row, now, lease_seconds):
            return row
    expires = now + timedelta(seconds=lease_seconds)
    reopen = f"t.state = '{ABANDONED}'"
    if attempt is not None:  # never for the attempt that aborted it
        reopen += f" AND coalesce(t.closed_by, '') <> {sql_string(aborted_by(attempt))}"
    row = merge_epoch(
        store,
        sink_id,
        epoch,
        {
            "state": OPEN,
            "generation": 0,
            "lease_expires": expires,
            "owner": owner,
            "renew_below": now + timedelta(seconds=lease_seconds * _RENEW_BELOW),
        },
        lambda m: insert_all(
            m.when_matched_update(
                {"lease_expires": "s.lease_expires"},
                predicate=f"t.state = '{OPEN}' AND t.lease_expires < s.renew_below",
            ).when_matched_update(
                {
                    "state": "s.state",
                    "generation": "t.generation + 1",
                    "lease_expires": "s.lease_expires",
                    "owner": "s.owner",
                    "closed_by": "s.closed_by",
                    "closed_timestamp": "s.closed_timestamp",
                },
                predicate=reopen,
            )
        ),
    )
    _check_owner(row, owner)
    _refuse_aborted(row, attempt)
    return row


def _fresh(row: Epoch, now: datetime, lease_seconds: float) -> bool:
    """Whether an OPEN epoch's lease has more than the renewal share left."""
    return (
        row.state == OPEN
        and row.lease_expires is not None
        and row.lease_expires - now > timedelta(seconds=lease_seconds * _RENEW_BELOW)
    )


def _check_owner(row: Epoch | None, owner: str) -> None:
    """Refuse an epoch another owner holds (an ABANDONED one is free to take)."""
    if row is None or row.owner is None or row.owner == owner or row.state == ABANDONED:
        return
    raise EpochLostError(
        f"epoch {row.epoch} of sink {row.sink_id!r} belongs to {row.owner!r}, not to "
        f"{owner!r}: a sink id names one writer (a stream restarted from a new checkpoint with "
        "the same sinkId would otherwise have its batches taken for replays and dropped). Use "
        "a new sinkId, or restart the query from its own checkpoint."
    )


def renew(
    store: Store,
    sink_id: str,
    epoch: int,
    generation: int,
    lease_seconds: float,
    clock: Clock | None = None,
) -> bool:
    """Push the lease of an OPEN epoch on (a heartbeat); False once the epoch is not OPEN in
    ``generation`` any more."""
    now = lease_clock(store, clock)()
    row = read_epoch(store, sink_id, epoch)
    if row is None or row.state != OPEN or row.generation != generation:
        return False
    if _fresh(row, now, lease_seconds):
        return True
    row = merge_epoch(
        store,
        sink_id,
        epoch,
        {
            "generation": generation,
            "lease_expires": now + timedelta(seconds=lease_seconds),
            "renew_below": now + timedelta(seconds=lease_seconds * _RENEW_BELOW),
        },
        lambda m: m.when_matched_update(
            {"lease_expires": "s.lease_expires"},
            predicate=(
                f"t.state = '{OPEN}' AND t.generation = s.generation "
                "AND t.lease_expires < s.renew_below"
            ),
        ),
    )
    return row.state == OPEN and row.generation == generation


class Lease:
    """Hold an epoch while staging: :func:`hold` on enter, then renew the lease from a
    background thread every fifth of ``lease_seconds`` until exit.

    >>> with Lease(store, "orders", 12, owner, 600) as epoch:
    ...     stage(..., generation=epoch.generation)
    """

    def __init__(
        self,
        store: Store,
        sink_id: str,
        epoch: int,
        owner: str,
        lease_seconds: float,
        attempt: str | None = None,
    ) -> None:
        self.store, self.sink_id, self.epoch = store, sink_id, epoch
        self.owner, self.lease_seconds, self.attempt = owner, lease_seconds, attempt
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Epoch:
        row = hold(
            self.store,
            self.sink_id,
            self.epoch,
            self.owner,
            self.lease_seconds,
            attempt=self.attempt,
        )
        if row.state == OPEN:
            self._thread = threading.Thread(
                target=self._beat, args=(row.generation,), name="rmqtx-lease", daemon=True
            )
            self._thread.start()
        return row

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _beat(self, generation: int) -> None:
        while not self._stop.wait(self.lease_seconds / 5):
            try:
                args = (self.store, self.sink_id, self.epoch, generation, self.lease_seconds)
                if not renew(*args):
                    log.warning(
                        "epoch %d of sink %r is no longer held by this writer (abandoned or "
                        "closed); its commit will tell",
                        self.epoch,
                        self.sink_id,
                    )
                    return
            except Exception:  # a missed heartbeat is not fatal; the lease has slack
                log.warning(
                    "could not renew the lease of epoch %d of sink %r",
                    self.epoch,
                    self.sink_id,
                    exc_info=True,
                )


def close(
    store: Store,
    sink_id: str,
    epoch: int,
    generation: int | None,
    transaction_ids: Sequence[str],
    closed_by: str,
) -> Epoch:
    """Close the epoch with ``transaction_ids`` if it is OPEN in ``generation`` (any state but
    CLOSED when ``generation`` is None, as for an abort's empty close), or absent. Returns
    the row after: CLOSED with our list when we won."""
    condition = (
        f"t.state <> '{CLOSED}'"
        if generation is None
        else f"t.state = '{OPEN}' AND t.generation = {int(generation)}"
    )
    return merge_epoch(
        store,
        sink_id,
        epoch,
        {
            "state": CLOSED,
            "generation": generation or 0,
            "transaction_ids": list(transaction_ids),
            "closed_by": closed_by,
            "closed_timestamp": utc_now(),
        },
        lambda m: insert_all(
            m.when_matched_update(
                {
                    "state": "s.state",
                    "transaction_ids": "s.transaction_ids",
                    "closed_by": "s.closed_by",
                    "closed_timestamp": "s.closed_timestamp",
                },
                predicate=f"t.state IS NOT NULL AND {condition}",
            )
        ),
    )


def abandon(store: Store, sink_id: str, epoch: int, generation: int, now: datetime) -> Epoch:
    """Mark an OPEN epoch whose lease ran out before ``now`` ABANDONED (or an epoch with no
    row, whose writer never held it). Returns the row after, whoever won."""
    return merge_epoch(
        store,
        sink_id,
        epoch,
        {
            "state": ABANDONED,
            "generation": generation,
            "closed_by": "check-back:lease-expired",
            "closed_timestamp": now,
            "now": now,
        },
        lambda m: insert_all(
            m.when_matched_update(
                {
                    "state": "s.state",
                    "closed_by": "s.closed_by",
                    "closed_timestamp": "s.closed_timestamp",
                },
                predicate=(
                    f"t.state = '{OPEN}' AND t.generation = s.generation "
                    "AND t.lease_expires < s.now"
                ),
            )
        ),
    )


# --------------------------------------------------------------------------- finishing
def finish_epoch(
    store: Store,
    sink_id: str,
    epoch: int,
    staged: Sequence[tuple[str, int]],
    producer_group: str,
    closed_by: str,
) -> EpochOutcome:
    """Close an epoch with the ``staged`` (transaction, generation) pairs, COMMIT the winning
    list, roll back staged transactions that lost, and publish. Safe to repeat after a crash.

    Raises
    ------
    EpochLostError
        What was staged cannot be published: the epoch was abandoned under the writer, its
        transactions span generations, it belongs to another owner, or a listed transaction
        was not committed. Staged transactions are rolled back first.
    """
    txns = [t for t, _ in staged]
    generations = {g for _, g in staged}
    if len(generations) > 1:
        _roll_back(store, txns, producer_group, closed_by)
        raise EpochLostError(
            f"epoch {epoch} of sink {sink_id!r} was abandoned while this writer was staging "
            f"(its tasks staged in generations {sorted(generations)}): nothing of it is "
            "published. The job fails so that it is retried."
        )
    row = close(store, sink_id, epoch, generations.pop() if generations else None, txns, closed_by)
    failpoint(f"{closed_by}.closed")
    if row.state != CLOSED:
        _roll_back(store, txns, producer_group, closed_by)
        raise EpochLostError(
            f"epoch {epoch} of sink {sink_id!r} was abandoned by the check-back job (no "
            f"heartbeat from its writer before {row.lease_expires}): its {len(txns)} staged "
            "transaction(s) are rolled back and nothing is published. The job fails so that it "
            "is retried; raise the writer's lease timeout if its tasks stall for longer."
        )
    winners = row.transaction_ids or ()
    losers = tuple(t for t in txns if t not in set(winners))
    decisions = [Decision(t, producer_group, COMMIT, closed_by) for t in winners]
    decisions += [Decision(t, producer_group, ROLLBACK, closed_by) for t in losers]
    # in_half: each was committed to half by a task of this epoch before the task returned.
    results = store.end_transactions(decisions, in_half=True) if decisions else []
    lost = [r for r in results[: len(winners)] if r.decision is not COMMIT]
    if lost:
        raise EpochLostError(
            f"epoch {epoch} of sink {sink_id!r} is closed with {len(winners)} transaction(s), "
            f"but {len(lost)} of them were rolled back before (e.g. {lost[0].transaction_id}): "
            "their messages are not published."
        )
    return EpochOutcome(sink_id, epoch, winners, losers, tuple(txns) == winners)


def _roll_back(store: Store, txns: Sequence[str], group: str, decided_by: str) -> None:
    """Roll back staged transactions (none: nothing to do)."""
    if txns:
        store.end_transactions(
            [Decision(t, group, ROLLBACK, decided_by) for t in txns], in_half=True
        )


def abandon_attempt(
    store: Store, sink_id: str, epoch: int, staged: Sequence[tuple[str, int]], group: str
) -> None:
    """Roll back an attempt's transactions (a failed job), unless the epoch was closed with
    them: then finish it, since a decision promised by the epoch's list must not be undone."""
    _settle(store, read_epoch(store, sink_id, epoch), staged, group)


def _settle(store: Store, row: Epoch | None, staged: Sequence[tuple[str, int]], group: str) -> None:
    """Decide what an aborted attempt staged, by the epoch's ``row``: finish an epoch CLOSED
    with a list (it stands: listed transactions are committed, the others rolled back), roll
    back everything otherwise."""
    if row is not None and row.state == CLOSED and row.transaction_ids and staged:
        finish_epoch(store, row.sink_id, row.epoch, staged, group, "abort")
    else:
        _roll_back(store, [t for t, _ in staged], group, "abort")


def release(
    store: Store, sink_id: str, epoch: int, owner: str | None, attempt: str | None = None
) -> Epoch | None:
    """Abandon an OPEN epoch at once, whatever its lease, in its current generation: what a
    writer's abort does, since no attempt of that writer will close the epoch any more.

    The check-back job's epoch checker then rolls back, at its next round, every transaction
    staged in that generation: those of tasks the driver never heard from (killed, or still
    running and staging after the abort), which otherwise would wait for the lease to run out.
    A new attempt of the epoch (a restarted query replaying its batch, a re-run with the same
    sink id) reopens it in the next generation (:func:`hold`). Only an OPEN epoch changes, and,
    when ``owner`` is given, only one that ``owner`` holds: a CLOSED epoch keeps its list; an
    abandonment by the check-back job racing this one conflicts with it, and one of them
    applies (the same state). ``closed_by`` names the aborting ``attempt``
    (:func:`aborted_by`), whose late tasks :func:`hold` then refuses.

    Returns
    -------
    Epoch or None
        The row after (whoever changed it), or None when no writer ever held the epoch and
        no ``attempt`` is given (with one, the abort is recorded: ABANDONED, generation 0).
    """
    row = read_epoch(store, sink_id, epoch)
    if row is None and attempt is None:
        return None
    if row is not None and (row.state != OPEN or (owner is not None and row.owner != owner)):
        return row
    held = f"t.state = '{OPEN}'" + ("" if owner is None else " AND t.owner = s.owner")

    def clauses(m: Any) -> Any:
        released = m.when_matched_update(
            {
                "state": "s.state",
                "closed_by": "s.closed_by",
                "closed_timestamp": "s.closed_timestamp",
            },
            predicate=held,
        )
        # No task held it yet (one failed before it could): the abort is recorded all the
        # same, so that the attempt's tasks that start after it are refused.
        return insert_all(released) if row is None else released

    return merge_epoch(
        store,
        sink_id,
        epoch,
        {
            "state": ABANDONED,
            "generation": 0,
            "owner": owner,
            "closed_by": aborted_by(attempt),
            "closed_timestamp": utc_now(),
        },
        clauses,
    )


def abort_attempt(
    store: Store,
    sink_id: str,
    epoch: int,
    staged: Sequence[tuple[str, int]],
    group: str,
    owner: str | None,
    *,
    reused: bool = True,
    attempt: str | None = None,
) -> Epoch | None:
    """A writer's abort: end the epoch for this writer, then decide the (transaction,
    generation) pairs its tasks reported.

    Parameters
    ----------
    store : Store
        The store.
    sink_id, epoch : str, int
        The epoch.
    staged : sequence of (str, int)
        What the tasks that reported staged (rolled back at once, unless the epoch was
        closed with them: then its list stands, see :func:`abandon_attempt`).
    group : str
        Their producer group.
    owner : str or None
        The writer holding the epoch (a stream's query id), if known.
    reused : bool, default True
        Whether the epoch's id is used again (a stream's micro-batch is replayed with the same
        id by a restarted query; a batch write's ``sinkId`` by a re-run): then the epoch is
        :func:`release`\\ d (ABANDONED: a replay reopens it). A batch write's made-up sink id
        is never used again: the epoch is closed empty, so every attempt's halves, of any
        generation, are rolled back. A stream's epoch must never be closed empty: its replay
        would publish nothing.
    attempt : str or None
        The aborting write attempt (made on the writer's driver): its late tasks cannot
        reopen the released epoch (:func:`hold`).

    Returns
    -------
    Epoch or None
        The epoch's row after, or None when no writer ever held it and no ``attempt`` is
        given.
    """
    if reused:
        row = release(store, sink_id, epoch, owner, attempt)
    else:
        row = close(store, sink_id, epoch, None, [], aborted_by(attempt))
    _settle(store, row, staged, group)
    return row
