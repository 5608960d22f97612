"""Retrying what loses a race on a Delta log: commits lost to a concurrent writer, and log
listings that raced a commit.

A ``CommitFailedError`` means nothing landed, so a retry starts from the new table state and
stores nothing twice (rule 2); a failure that does not say whether a commit landed
(:class:`Unsure`) is retried only after the attempt itself has checked.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError, DeltaError

from rmq_spark.model.errors import StoreError

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_MAX_COMMIT_ATTEMPTS = 200


def backoff(attempt: int) -> None:
    """Wait before attempt ``attempt + 1`` of a write that lost an optimistic race (jittered,
    growing, at most about 0.3 s)."""
    time.sleep(min(0.2, 0.002 * 2 ** min(attempt, 7)) * random.uniform(0.5, 1.5))


class Unsure(Exception):
    """A commit failed in a way that does not say whether it landed; retry after checking."""


def retry_commits(what: str, name: str, attempt: Callable[[int], _T]) -> _T:
    """Call ``attempt(n)`` until it returns, retrying (with backoff) each time a commit is lost
    to a concurrent writer. A ``CommitFailedError`` means nothing landed, so the next attempt
    starts from the new table state; ``Unsure`` is retried the same way, and the attempt
    itself checks first whether the failed commit landed."""
    for n in range(_MAX_COMMIT_ATTEMPTS):
        try:
            return attempt(n)
        except (CommitFailedError, Unsure):
            log.debug("%s lost a race (attempt %d); retrying", what, n + 1)
            backoff(n)
    raise StoreError(
        f"could not {what} after {_MAX_COMMIT_ATTEMPTS} attempts: too many concurrent writers "
        f"on the {name} table."
    )


@contextmanager
def refused_if_cleaned(table: DeltaTable) -> Iterator[None]:
    """Turn deltalake's refusal to commit on a snapshot whose successors' log entries were
    cleaned into a lost race: nothing landed, and :func:`retry_commits` tries again from the
    latest version. It happens to a blind append on a cached snapshot (after a clock skew
    between hosts), and to an operation that outlives the log cleanup horizon while others
    commit and clean."""
    version = table.version()
    try:
        yield
    except DeltaError as exc:
        if str(exc) != f"Invalid table version: {version}":
            raise
        raise CommitFailedError(
            f"the log after version {version} was cleaned under this snapshot"
        ) from exc


#: deltalake's refusal of a log listing with a hole in it, and how often to list again.
_LISTING_GAP = "Expected contiguous commit files"
_RELISTINGS = 5


def relisting(action: Callable[[], _T]) -> _T:
    """Run a deltalake action that lists a table's log, again when the listing was outdated
    by the time it was read.

    * On a local filesystem a listing made while commits land can miss an entry made during
      it and still see a later one (directory order is not name order), and deltalake refuses
      it ("Expected contiguous commit files"). Seen about once in 20 s of one thread reading
      ``half`` while another sent; listing again sees both entries.
    * Another process's log cleanup can delete a checkpoint (or entry) after the listing named
      it and before it was read ("Object at location .../_delta_log/... not found"): the torture
      test saw a store fail to open so. Listing again finds the newer checkpoint.
    """
    for _ in range(_RELISTINGS - 1):
        try:
            return action()
        except DeltaError as exc:
            if not _outdated_listing(str(exc)):
                raise
            log.debug("a log listing raced a commit or a log cleanup (%s); listing again", exc)
    return action()


def _outdated_listing(message: str) -> bool:
    return _LISTING_GAP in message or ("/_delta_log/" in message and " not found" in message)
