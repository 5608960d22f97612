"""Jobs and reports over every shard of a store (:mod:`rmq_spark.store.shards`).

A job that runs over "the store" (check-back, re-drive of discards, maintenance) runs today's
code on each shard's :class:`Store`, one after the other. A store of one shard is that one
store: the work runs on it as it always did, and whatever it raises is raised. With several
shards, one shard failing does not stop the others: its error is logged, the others are done,
and the job fails at its end (:class:`ShardsFailedError`), after its combined result is made.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import TypeVar

from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

T = TypeVar("T")
R = TypeVar("R")


class ShardsFailedError(Exception):
    """A job ran on every shard of a store and failed on some of them (the others were done).

    Parameters
    ----------
    what : str
        The job (``"check-back round"``, ``"maintenance"``...).
    failures : mapping of int to Exception
        What each failed shard raised, by shard index.
    result : object, optional
        The combined result of the shards that ran (their summary), for the caller to show.
    """

    def __init__(self, what: str, failures: Mapping[int, Exception], result: object = None) -> None:
        named = "; ".join(
            f"shard {k}: {type(e).__name__}: {e}" for k, e in sorted(failures.items())
        )
        super().__init__(
            f"{what} failed on {len(failures)} shard(s), the others were done: {named}"
        )
        self.failures = dict(failures)
        self.result = result


def on_every_shard(
    shards: Sequence[Store],
    what: str,
    work: Callable[[Store], T],
    combine: Callable[[dict[int, T], dict[int, Exception]], R],
) -> R | T:
    """Run ``work`` on each of ``shards`` (a store's :meth:`Store.shards`) and combine the
    results.

    Parameters
    ----------
    shards : sequence of Store
        The shards, by index.
    what : str
        The job's name, for logs and errors.
    work : callable
        ``work(shard)``: the job on one shard's store.
    combine : callable
        ``combine(results, failures)``: one result from the shards' results and errors (both
        by shard index).

    Returns
    -------
    object
        ``work``'s result on a store of one shard (not combined); else the combined result.

    Raises
    ------
    ShardsFailedError
        ``work`` raised on some shards (with several; with one, what it raised is raised).
    """
    if len(shards) == 1:
        return work(shards[0])
    results: dict[int, T] = {}
    failures: dict[int, Exception] = {}
    for shard in shards:
        log.info("%s: shard %d of %d", what, shard.shard, len(shards))
        try:
            results[shard.shard] = work(shard)
        except Exception as exc:
            log.exception("%s failed on shard %d; the other shards go on", what, shard.shard)
            failures[shard.shard] = exc
    combined = combine(results, failures)
    if failures:
        raise ShardsFailedError(what, failures, combined) from next(iter(failures.values()))
    return combined
