"""Shared fixtures: a fresh store per test, and one local SparkSession per test session."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest

from rmq_spark import Store
from rmq_spark.config import Settings, StoreSettings


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """An empty store on local disk."""
    return Store.open(tmp_path / "store", settings=Settings(store=StoreSettings(queue_nums=2)))


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """The session's one local[2] SparkSession, with Delta Lake."""
    from rmq_spark.session import get_spark

    session = get_spark("rmq-spark-tests")
    yield session
    session.stop()


def commitlog(store: Store) -> pa.Table:
    """Everything consumers can see, ordered by topic, queue and offset."""
    table = store.table("commitlog").to_pyarrow_table()
    return table.sort_by(
        [("topic", "ascending"), ("queue_id", "ascending"), ("queue_offset", "ascending")]
    )
