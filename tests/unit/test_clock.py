"""A caller's clock that returns naive times (``datetime.utcnow``'s kind) is read in UTC by
every part that takes one, not as the host's local time: left naive, a check-back round would
land intake objects by local time (``datetime.timestamp``) and age transactions in UTC
(Arrow), hours apart on a host away from UTC."""

from __future__ import annotations

import time
from collections.abc import Iterator
from datetime import UTC, datetime

import pytest

from rmq_spark.checkback.epoch_checker import EpochChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.clock import in_utc, utc_now
from rmq_spark.store.facade import Store


@pytest.fixture
def host_in_tokyo(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process's local time zone is UTC+9 (restored after)."""
    monkeypatch.setenv("TZ", "Asia/Tokyo")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def naive_utc() -> datetime:
    return datetime.now(UTC).replace(tzinfo=None)


def _off_by(clock_time: datetime) -> float:
    return abs(clock_time.timestamp() - time.time())


def test_a_naive_time_is_off_by_the_utc_offset_unless_read_in_utc(host_in_tokyo: None) -> None:
    assert _off_by(naive_utc()) > 8 * 3600  # the premise: Python reads it as local time
    assert _off_by(in_utc(naive_utc)()) < 60
    aware = in_utc(lambda: datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC))()
    assert aware == datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    assert in_utc(None) is utc_now


def test_every_clock_parameter_reads_naive_times_in_utc(
    spark, store: Store, host_in_tokyo: None
) -> None:
    clocks = {
        "Store": Store.open(store.root, clock=naive_utc).clock,
        "CheckBackJob": CheckBackJob(spark, store, {}, clock=naive_utc).clock,
        "EpochChecker": EpochChecker(store, clock=naive_utc).clock,
    }
    assert {name: _off_by(clock()) < 60 for name, clock in clocks.items()} == dict.fromkeys(
        clocks, True
    )
