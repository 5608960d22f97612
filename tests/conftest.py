"""Shared fixtures: a fresh store per test, one local SparkSession per test session, and one
MinIO server per test session for the object-store tier."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pytest
from deltalake import DeltaTable

from rmq_spark import Store
from rmq_spark.model.config import Settings, StoreSettings

# The Spark processes tests start (sink children, rmqtx check, notebooks) run without the UI,
# turned off as a user would: many at once would run out of UI ports (4040 and 16 more).
os.environ.setdefault("PYSPARK_SUBMIT_ARGS", "--conf spark.ui.enabled=false pyspark-shell")


class Clock:
    """A clock a test moves by hand, from now or from ``start``."""

    def __init__(self, start: datetime | None = None) -> None:
        self.now = start or datetime.now(UTC)

    def __call__(self) -> datetime:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += timedelta(seconds=seconds)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    """An empty store on local disk whose sends are ``half`` commits (``store.intake`` off):
    the unit tests of commits, compaction and retention make those commits by sending; the
    intake objects have tests of their own, the S3 store and the integration tests' default."""
    settings = Settings(store=StoreSettings(queue_nums=2, intake=False))
    return Store.open(tmp_path / "store", settings=settings)


@pytest.fixture
def no_aws_credentials(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """No AWS setting in the environment, no configuration or credentials file, no instance
    role: botocore's chain finds nothing unless a test puts it there."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_"):
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


@pytest.fixture
def young_entries_cleaned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Log cleanups in this process may delete entries of any age (no LOG_ENTRY_MIN_AGE): for
    tests of the retention rules that make hours pass with a clock ahead, or clean at once,
    within seconds of real time."""
    from rmq_spark.delta import txnlog

    monkeypatch.setattr(txnlog, "LOG_ENTRY_MIN_AGE", 0.0)


@pytest.fixture(scope="session")
def minio(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """A MinIO server on loopback (``make objectstore`` builds it). Without the binary the
    object-store tests are skipped, except under ``make test``, where that is an error."""
    from tests import minio as server

    if not server.binary().exists():
        reason = f"no MinIO at {server.binary()}; run 'make objectstore'"
        if os.environ.get("RMQ_SPARK_OBJECTSTORE") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    running = server.start(tmp_path_factory.mktemp("minio") / "data")
    yield running
    running.stop()


@pytest.fixture
def s3_settings(minio) -> Settings:
    """Settings of a fresh store root on the MinIO server (``s3://rmqtx/store-<random>``)."""
    return Settings(
        store=StoreSettings(path=minio.root(), queue_nums=2, storage_options=minio.storage_options)
    )


@pytest.fixture
def s3_store(s3_settings: Settings) -> Store:
    """An empty store on the MinIO server."""
    return Store.open(settings=s3_settings)


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.objectstore)])
def any_store(request: pytest.FixtureRequest) -> Store:
    """An empty store on local disk, and one on S3 (MinIO): the contract holds on both."""
    return request.getfixturevalue("store" if request.param == "local" else "s3_store")


@pytest.fixture(scope="session")
def spark() -> Iterator[object]:
    """The session's one local[2] SparkSession, with Delta Lake, without the UI."""
    from rmq_spark.spark.session import get_spark

    session = get_spark(
        "rmq-spark-tests",
        master="local[2]",
        extra_conf={"spark.ui.enabled": "false", "spark.sql.shuffle.partitions": "4"},
    )
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


def foreign_compaction_after_the_stores(store: Store, table: str) -> None:
    """A deltalake ``optimize.compact()`` of ``table`` that read the table before rmq-spark's
    compaction of the same files committed, and commits after it: deltalake lets it land
    (the files it removes were removed by a ``dataChange=false`` commit), and every row of
    those files is stored twice (the suite's torture run, seed 5)."""

    def stored() -> int:
        return pc.sum(store.data_files(table).column("num_records")).as_py()

    before = stored()
    stale = DeltaTable(store.table_uri(table), storage_options=store._storage_options)
    assert store.compact(table)[table] > 1
    stale.optimize.compact()
    assert stored() == 2 * before


def committing(store: Store) -> Store:
    """``store``'s root opened with every send a ``half`` commit (``store.intake`` off, as the
    ``store`` fixture), for tests of those commits: by default a send puts an intake object."""
    return Store.open(store.root, settings=dataclasses.replace(store.settings, intake=False))


def commitlog(store: Store) -> pa.Table:
    """Everything consumers can see, ordered by topic, queue and offset."""
    table = store.read("commitlog")
    return table.sort_by(
        [("topic", "ascending"), ("queue_id", "ascending"), ("queue_offset", "ascending")]
    )


def settings_file(store: Store, folder: Path) -> Path:
    """A settings file naming ``store``'s root and storage options, as an operator writes it
    (check-back rounds take no time-out, for tests)."""
    options = ", ".join(f'{k} = "{v}"' for k, v in store.settings.storage_options.items())
    conf = folder / "rmq.toml"
    conf.write_text(
        f'[store]\npath = "{store.root}"\nqueue_nums = {store.settings.queue_nums}\n'
        f"storage_options = {{ {options} }}\n"
        '[transaction]\ntransaction_timeout = "0s"\n'
    )
    return conf
