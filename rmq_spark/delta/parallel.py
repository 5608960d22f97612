"""Many small requests at once: thread pools per process for I/O-bound work on objects."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TypeVar

#: Requests of one call at once (a check-back round reads thousands of objects).
PARALLEL = 16

_T = TypeVar("_T")
_R = TypeVar("_R")
_PREFIX = "rmqtx-each-"
_pools: dict[str, ThreadPoolExecutor] = {}
_lock = threading.Lock()


def _forget_pools() -> None:
    """In a forked child: the parent's pools have no threads there, and its lock may be held."""
    global _lock
    _pools.clear()
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_forget_pools)


def each(
    work: Callable[[_T], _R], items: Iterable[_T], pool: str, parallel: int = PARALLEL
) -> list[_R]:
    """``work`` on each item, up to ``parallel`` at once (the pool's first call's) on the
    process's pool named ``pool`` (one a purpose: a decision's puts never queue behind a
    publisher's reads); the results in order, or the first failing item's exception.

    A call of one item runs on the caller's thread, and so does every item of a call from one
    of the pools' threads (waiting on a pool from its own threads could wait forever). At
    interpreter exit the pools take no new work: the items not yet submitted are done on the
    caller's thread."""
    items = list(items)
    if len(items) <= 1 or threading.current_thread().name.startswith(_PREFIX):
        return [work(i) for i in items]
    with _lock:
        executor = _pools.get(pool)
        if executor is None:
            executor = _pools[pool] = ThreadPoolExecutor(parallel, f"{_PREFIX}{pool}")
    futures: list[Future[_R]] = []
    try:
        for item in items:
            futures.append(executor.submit(work, item))
    except RuntimeError as exc:  # cannot schedule new futures after interpreter shutdown
        if "shutdown" not in str(exc):
            raise  # e.g. no thread could start: the item may be queued and run yet
        inline = [work(i) for i in items[len(futures) :]]
        return [f.result() for f in futures] + inline
    return [f.result() for f in futures]
