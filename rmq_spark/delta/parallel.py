"""Many small requests at once: one thread pool per process for I/O-bound work on objects."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

#: Requests of one call at once (a check-back round reads thousands of objects).
PARALLEL = 16

_T = TypeVar("_T")
_R = TypeVar("_R")
_pool: ThreadPoolExecutor | None = None
_pool_pid = 0
_lock = threading.Lock()
_NAME = "rmqtx-request"


def each(work: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
    """``work`` on each item, up to :data:`PARALLEL` at once; the results in order, or the
    first item's exception. One item runs on the caller's thread, and so do all when the caller
    is one of the pool's (its threads waiting on their own pool could wait forever). A pool
    inherited through a fork has no threads (a forked child makes its own); at interpreter exit
    the pool takes no work, and the items are done one by one."""
    global _pool, _pool_pid
    items = list(items)
    if len(items) <= 1 or threading.current_thread().name.startswith(_NAME):
        return [work(i) for i in items]
    with _lock:
        if _pool is None or _pool_pid != os.getpid():
            _pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix=_NAME)
            _pool_pid = os.getpid()
        pool = _pool
    try:
        futures = [pool.submit(work, i) for i in items]
    except RuntimeError:  # cannot schedule new futures after interpreter shutdown
        return [work(i) for i in items]
    return [f.result() for f in futures]
