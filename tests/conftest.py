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


def race(target, sides: list[tuple]) -> dict:
    """Run ``target(*args, barrier, out)`` in one spawned process per ``args`` of ``sides``,
    in lock-step on a shared barrier; each puts ``(name, result)`` on ``out``. Returns
    ``{name: result}``."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(len(sides)), ctx.Queue()
    procs = [ctx.Process(target=target, args=(*args, barrier, out)) for args in sides]
    for p in procs:
        p.start()
    results = dict(out.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    return results


def commitlog(store: Store) -> pa.Table:
    """Everything consumers can see, ordered by topic, queue and offset."""
    table = store.table("commitlog").to_pyarrow_table()
    return table.sort_by(
        [("topic", "ascending"), ("queue_id", "ascending"), ("queue_offset", "ascending")]
    )
