"""The clocks rmq-spark reads: the current time in UTC, a caller's clock read in UTC, and the
time a process has been running, stops included."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime

Clock = Callable[[], datetime]


def utc_now() -> datetime:
    """The current time, in UTC: every default clock."""
    return datetime.now(UTC)


def in_utc(clock: Clock | None) -> Clock:
    """``clock`` (default :func:`utc_now`) with its times made aware: a naive time is read as
    UTC, as every ``clock`` parameter's docstring says. Left naive, it would be read as UTC by
    Arrow and as the host's local time by ``datetime.timestamp``, and ages would be off by the
    host's UTC offset."""
    if clock is None or clock is utc_now:
        return utc_now

    def now() -> datetime:
        time = clock()
        return time.replace(tzinfo=UTC) if time.tzinfo is None else time

    return now


def elapsed() -> float:
    """Seconds on a clock that only goes forward and counts the time the process was stopped
    (SIGSTOP) or the machine suspended: ``CLOCK_BOOTTIME`` on Linux (``time.monotonic()``
    leaves a suspend out), ``time.monotonic()`` elsewhere. Only differences of its readings in
    one process mean anything."""
    return time.clock_gettime(_BOOTTIME) if _BOOTTIME is not None else time.monotonic()


_BOOTTIME: int | None = getattr(time, "CLOCK_BOOTTIME", None)
