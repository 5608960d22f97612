"""Now on a store's clock, read on any host: for times one host writes and another judges.

A sink's lease is written by its tasks, on executors, and judged by the check-back job, on
another host; compared on each host's own clock, an executor whose clock ran behind by more
than the lease had its epochs abandoned while its tasks were staging (each retry again), and one
ahead kept a dead writer's halves pending for longer. :class:`StoreClock` reads this host's clock
plus its offset from the store's: the modification time of an empty file the store stamps
(:func:`rmq_spark.delta.txnlog.store_time`), measured again every :data:`MEASURE_EVERY`
seconds. A measurement is trusted only when its requests took at most
:data:`MEASURE_WITHIN` seconds (the offset is then right to that, plus the store's time
resolution: a second on S3): one a stall or a slow store spread over longer is made again, and
until one succeeds the last offset stands. On a filesystem that gives no times, the offset is 0.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from datetime import datetime, timedelta

from rmq_spark.delta.storage import filesystem
from rmq_spark.delta.txnlog import store_time
from rmq_spark.model.clock import Clock, elapsed, utc_now

log = logging.getLogger(__name__)

#: Seconds an offset is used before it is measured again (a host's clock may be stepped).
MEASURE_EVERY = 60.0
#: The longest a measurement may take to be trusted.
MEASURE_WITHIN = 2.0
#: Measurements made in a row before the last offset is kept for now.
_ATTEMPTS = 3


class StoreClock:
    """Now on the store's clock, for the Delta table at ``uri`` (its log holds the probes).

    Parameters
    ----------
    uri : str
        A table of the store.
    storage_options : mapping, optional
        The store's credentials and endpoint.
    local : callable, optional
        This host's clock (default: the system clock); a test gives a skewed one.
    """

    def __init__(
        self, uri: str, storage_options: Mapping[str, str] | None, local: Clock = utc_now
    ) -> None:
        self._fs, self._log = filesystem(f"{uri.rstrip('/')}/_delta_log", storage_options)
        self._local = local
        self._offset: timedelta | None = None
        self._measured = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> datetime:
        with self._lock:
            if self._offset is None or elapsed() - self._measured > MEASURE_EVERY:
                self._measure()
            assert self._offset is not None
            return self._local() + self._offset

    @property
    def offset(self) -> timedelta:
        """The store's clock minus this host's, as last measured."""
        self()
        assert self._offset is not None
        return self._offset

    def _measure(self) -> None:
        for _ in range(_ATTEMPTS):
            started, before = elapsed(), self._local()
            stamped = store_time(self._fs, self._log)
            took = elapsed() - started
            if stamped is None:
                self._offset = timedelta(0)
                break
            if took <= MEASURE_WITHIN:
                middle = before + timedelta(seconds=took / 2)
                self._offset = datetime.fromtimestamp(stamped, middle.tzinfo) - middle
                break
        else:
            log.warning(
                "the store's clock could not be read within %.0f s (%d tries); the offset of "
                "this host's clock from it stays %s",
                MEASURE_WITHIN,
                _ATTEMPTS,
                self._offset if self._offset is not None else "unknown (taken as 0)",
            )
            if self._offset is None:
                self._offset = timedelta(0)
        self._measured = elapsed()
