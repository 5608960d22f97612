"""The clocks rmq-spark reads: the current time in UTC, and a caller's clock read in UTC."""

from __future__ import annotations

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
