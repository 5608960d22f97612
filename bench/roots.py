"""Where a benchmark runs: local disk, and with ``--s3`` also an S3 root on a MinIO server
(``make objectstore`` builds it), so each figure is printed for both in the same run."""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import SparkSession

from rmq_spark import Store, get_spark
from rmq_spark.model.config import Settings, StoreSettings

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests import minio  # noqa: E402  (the test tier's MinIO launcher)


@dataclass(frozen=True)
class Root:
    """A place to benchmark on: a label, a base URI and its storage options."""

    label: str
    base: str
    storage_options: dict[str, str] = field(default_factory=dict)

    def store(self, name: str = "store") -> Store:
        """A fresh store under the base."""
        settings = StoreSettings(path=f"{self.base}/{name}", storage_options=self.storage_options)
        return Store.open(settings=settings)

    def rmqtx(self, io, store: Store):
        """``io`` (a reader or writer, batch or streaming) as ``format("rmqtx")`` on ``store``,
        with this root's storage options as ``storage.<KEY>`` options."""
        options = {f"storage.{k}": v for k, v in self.storage_options.items()}
        return io.format("rmqtx").option("path", store.root).options(**options)


@contextmanager
def bench_roots(s3: bool) -> Iterator[list[Root]]:
    """Local disk, and MinIO when ``s3``; the server is stopped and the data removed after."""
    with tempfile.TemporaryDirectory(prefix="rmq-bench-") as tmp:
        roots = [Root("local disk", f"{tmp}/local")]
        server = minio.start(Path(tmp) / "minio" / "data") if s3 else None
        if server is not None:
            roots.append(Root("MinIO s3://", server.root("bench"), server.storage_options))
        try:
            yield roots
        finally:
            if server is not None:
                server.stop()


def spark_for(roots: list[Root], app: str) -> SparkSession:
    """One local SparkSession that reaches every root (S3A jars and settings for MinIO)."""
    last = roots[-1]
    store = StoreSettings(path=last.base, storage_options=last.storage_options)
    return get_spark(app, settings=Settings(store=store), extra_conf={"spark.ui.enabled": "false"})
