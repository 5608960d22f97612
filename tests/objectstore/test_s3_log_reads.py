"""Reads of a log on S3 that cost follows the work, not the log's length: the publisher's
following of ``op`` (:meth:`DeltaTables.latest_version`: each entry read once, one GET that
finds none a call, and a GET of the ``_last_checkpoint`` hint every ``fresh_seconds``; no
snapshot update replaying the entries again, each twice), and a commit's catching up after a
lost put (a listing from the version it lost on, not of the whole log)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta

import pytest
from deltalake import DeltaTable

from rmq_spark import Store
from rmq_spark.delta.checkpoints import Checkpointer
from rmq_spark.delta.commit import commit
from rmq_spark.delta.files import write_files
from rmq_spark.delta.storage import deltalake_options
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.delta.txnlog import app_transactions, clean_log
from rmq_spark.model.config import StoreSettings
from rmq_spark.model.errors import CorruptStoreError
from rmq_spark.model.schema import TABLES
from tests.latency_proxy import LatencyProxy
from tests.objectstore.test_s3_checkpoints import append, new_table
from tests.unit.test_checkpoints import SCHEMA, rows
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


def test_a_lost_put_lists_the_log_from_its_version_on(minio) -> None:
    """A commit whose base is old (a publisher of one shard into the store's CommitLog, whose
    log keeps a month of entries) finds the versions taken since with one listing from there."""
    uri = f"{minio.root('lost')}/t"
    options = minio.storage_options
    new_table(uri, options)
    for n in range(1, 12):
        append(uri, options, n, Checkpointer(options))
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0, record=True).start()
    try:
        options = dict(options, AWS_ENDPOINT_URL=proxy.endpoint)
        adds = write_files(uri, iter([rows(99, 1)]), SCHEMA, "part", options)
        proxy.requests.clear()  # type: ignore[union-attr]
        assert commit(uri, options, 3, adds) == 12  # versions 4 to 11 taken since
        lists = [t for m, t in proxy.requests or [] if m == "LIST"]
        assert len(lists) == 1 and "start-after=" in lists[0], lists
    finally:
        proxy.stop()


def test_a_log_cleanup_deletes_the_expired_entries_in_one_request(
    minio, young_entries_cleaned: None
) -> None:
    """S3 deletes up to 1,000 keys a request: a cleanup after every checkpoint (100 commits)
    must not cost a DELETE an entry."""
    uri = f"{minio.root('cleanup')}/t"
    options = minio.storage_options
    new_table(uri, options)
    checkpointer = Checkpointer(options)
    for n in range(1, 12):
        append(uri, options, n, checkpointer)
    checkpointer.checkpoint(uri, 11)
    time.sleep(1.1)  # the store's clock is a HEAD's Last-Modified: whole seconds
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0, record=True).start()
    try:
        via = dict(options, AWS_ENDPOINT_URL=proxy.endpoint)
        n = clean_log(uri, via, [(11, datetime.now(UTC) + timedelta(hours=1))])
        assert n == 11
        deletes = [(m, t) for m, t in proxy.requests or [] if m in ("DELETE", "POST")]
        # The probe of the store's clock is one; the entries 0 to 10 go in one more.
        assert len(deletes) == 2, deletes
    finally:
        proxy.stop()
    table = DeltaTable(uri, storage_options=deltalake_options(options))
    assert table.version() == 11 and table.to_pyarrow_table().num_rows == 1 + 11 * 2


def test_a_lease_renewal_and_a_look_at_it_are_a_few_requests(minio) -> None:
    """Every producer process renews its leases every few seconds, idle or not. A renewal is a
    GET that finds no newer entry, the file and entry PUTs and the reachability check (two
    GETs at once); a look at another's lease reads the entries since the last (deltalake's
    MERGE and the read after it made 24 requests a renewal, a look 6)."""
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0, record=True).start()
    try:
        settings = StoreSettings(
            path=minio.root(),
            storage_options=dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint),
        )
        holder, other = Store.open(settings=settings), Store.open(settings=settings, create=False)
        assert holder.lock("lease", "me", 60.0) and other.lock_holder("lease") == "me"
        proxy.requests.clear()  # type: ignore[union-attr]
        for _ in range(5):
            assert holder.lock("lease", "me", 60.0)
        renewals = list(proxy.requests or [])
        proxy.requests.clear()  # type: ignore[union-attr]
        for _ in range(5):
            assert other.lock_holder("lease") == "me"
        looks = list(proxy.requests or [])
        assert len(renewals) <= 5 * 5, renewals
        assert len(looks) <= 5 + 5 + 1, looks  # the five new entries, a GET that finds none
    finally:
        proxy.stop()


@pytest.mark.parametrize(
    ("status", "code"),
    [(403, "AccessDenied"), (400, "InvalidRequest"), (503, "SlowDown")],
)
@pytest.mark.parametrize(
    "refused", ["00000000000000000003.json", "00000000000000000002.checkpoint"]
)
def test_a_log_file_refused_is_not_called_damaged(
    minio, status: int, code: str, refused: str
) -> None:
    """A log entry or checkpoint that is there but refused (an IAM policy's AccessDenied, a
    request the endpoint rejects, throttling past every retry) fails with what the store
    answered: 'the log is damaged' would send an operator to repair a table that is whole. Only
    a file that is not there is missing."""
    uri = f"{minio.root('refused')}/t"
    new_table(uri, minio.storage_options)
    checkpointer = Checkpointer(minio.storage_options)
    for n in range(1, 4):
        append(uri, minio.storage_options, n, checkpointer)
        if n == 2:
            checkpointer.checkpoint(uri, 2)
    table = DeltaTable(uri, storage_options=deltalake_options(minio.storage_options))
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0).start()
    try:
        options = dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        proxy.refuse(f"/_delta_log/{refused}", status, code, times=100)  # past every retry
        with pytest.raises(OSError) as raised:
            app_transactions(table, uri, options)
        assert not isinstance(raised.value, CorruptStoreError), raised.value
        proxy.allow()
        assert app_transactions(table, uri, options) == {"app": 3}  # whole, once answered
    finally:
        proxy.stop()
