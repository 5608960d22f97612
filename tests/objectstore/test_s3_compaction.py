"""A compaction on S3 reads back none of the small files its own process wrote moments before
(they are kept in memory, up to a bound), and every file another process wrote, one GET each;
the compacted table holds every row once either way."""

from __future__ import annotations

import pytest

from rmq_spark.delta.compaction import compact
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.schema import TABLES
from rmq_spark.store.facade import Store
from tests.latency_proxy import LatencyProxy
from tests.unit.test_deltacommit import _half_rows

pytestmark = pytest.mark.objectstore


def test_a_compaction_reads_back_only_the_files_of_other_processes(minio) -> None:
    root = minio.root()
    Store.open(settings=StoreSettings(path=root, storage_options=minio.storage_options))
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0, record=True).start()
    try:
        options = dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        mine, other = (DeltaTables(root, TABLES, options, 5.0) for _ in range(2))
        for n in range(6):
            mine.append("half", [_half_rows(b"m%d" % n)])
        for n in range(4):
            other.append("half", [_half_rows(b"o%d" % n)])
        proxy.requests.clear()  # type: ignore[union-attr]
        metrics = compact(mine, "half")
        reads = [t for m, t in proxy.requests or [] if m == "GET" and t.endswith(".parquet")]
        bodies = sorted(
            mine.snapshot("half").to_pyarrow_table(columns=["body"])["body"].to_pylist()
        )
    finally:
        proxy.stop()
    assert metrics["numFilesRemoved"] == 10
    assert len(reads) == 4, reads
    assert bodies == sorted([b"m%d" % n for n in range(6)] + [b"o%d" % n for n in range(4)])
