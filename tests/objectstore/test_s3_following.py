"""The publisher's following of ``op`` on S3 (:meth:`DeltaTables.latest_version`): each entry
read once, one GET that finds none a call, and a GET of the ``_last_checkpoint`` hint every
``fresh_seconds``; no snapshot update replaying the entries again (each twice)."""

from __future__ import annotations

import time

import pytest

from rmq_spark import Store
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.schema import TABLES
from tests.latency_proxy import LatencyProxy
from tests.unit.test_following import decide

pytestmark = pytest.mark.objectstore

FRESH = 0.3


def test_following_op_reads_each_entry_once(minio) -> None:
    root = minio.root()
    store = Store.open(settings=StoreSettings(path=root, storage_options=minio.storage_options))
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0, record=True).start()
    try:
        options = dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        follower = DeltaTables(root, TABLES, options, FRESH)
        first = follower.latest_version("op")
        proxy.requests.clear()  # type: ignore[union-attr]
        calls, began = 0, time.monotonic()
        while time.monotonic() - began < FRESH * 5:
            latest = decide(store, 2)
            assert follower.latest_version("op") == latest
            calls += 1
        entries = [t for m, t in proxy.requests or [] if m == "GET" and "/op/_delta_log/0" in t]
        hints = [t for m, t in proxy.requests or [] if "_last_checkpoint" in t]
        lists = [t for m, t in proxy.requests or [] if m == "LIST"]
        assert len(entries) <= (latest - first) + calls, (len(entries), latest - first, calls)
        assert 1 <= len(hints) <= 6 and not lists, (hints, lists)
    finally:
        proxy.stop()
