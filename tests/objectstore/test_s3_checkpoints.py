"""Checkpoints of a table on S3 (MinIO) written from the process's own entries
(rmq_spark.delta.checkpoints): the log listed from the hint's version on, a newer checkpoint
than a lagging hint found, and the expired-log cleanup run only when the oldest entry is old."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pytest
from deltalake import DeltaTable, write_deltalake

from rmq_spark.delta.checkpoints import Checkpointer
from rmq_spark.delta.commit import commit
from rmq_spark.delta.files import write_files
from rmq_spark.delta.storage import deltalake_options, filesystem
from tests.latency_proxy import LatencyProxy
from tests.unit.test_checkpoints import SCHEMA, checkpoint_state, rows

pytestmark = pytest.mark.objectstore


def new_table(uri: str, options: dict[str, str], **config: str) -> None:
    """A partitioned table of one row whose checkpoints are left to the test (``config``: more
    table properties)."""
    first = pa.Table.from_pylist([{"key": "k0", "n": 0, "part": "a"}], SCHEMA)
    write_deltalake(
        uri,
        first,
        partition_by=["part"],
        configuration={"delta.checkpointInterval": "100000", **config},
        storage_options=deltalake_options(options),
    )


def append(uri: str, options: dict[str, str], n: int, checkpointer: Checkpointer) -> int:
    adds = write_files(uri, iter([rows(n, 2)]), SCHEMA, "part", options)
    version = DeltaTable(uri, storage_options=deltalake_options(options)).version()
    return commit(
        uri,
        options,
        version,
        adds,
        app_ids={"app": n},
        landed=lambda v, e: checkpointer.committed(uri, v, e),
    )


def test_a_checkpoint_on_s3_starts_from_the_newest_listed_and_cleans_when_due(
    minio, tmp_path: Path, young_entries_cleaned: None
) -> None:
    options = minio.storage_options
    uri = f"{minio.root('checkpoints')}/t"
    new_table(uri, options, **{"delta.logRetentionDuration": "interval 2 seconds"})
    fs, path = filesystem(uri, options)
    log = f"{path}/_delta_log"
    checkpointer = Checkpointer(options)
    for n in range(1, 4):
        append(uri, options, n, checkpointer)
    checkpointer.checkpoint(uri, 3)
    lagging = fs.cat_file(f"{log}/_last_checkpoint")
    for n in range(4, 7):
        append(uri, options, n, checkpointer)
    checkpointer.checkpoint(uri, 6)
    fs.pipe_file(f"{log}/_last_checkpoint", lagging)  # as if its writer died before the hint
    for v in (4, 5, 6):
        fs.rm_file(f"{log}/{v:020d}.json")  # cleaned below checkpoint 6
    append(uri, options, 7, Checkpointer(options))
    Checkpointer(options).checkpoint(uri, 7)  # a fresh process: nothing in memory
    local = tmp_path / "7.checkpoint.parquet"
    local.write_bytes(fs.cat_file(f"{log}/{7:020d}.checkpoint.parquet"))
    state = checkpoint_state(local)
    assert state["txn"] == {"app": 7} and len(state["add"]) == 1 + 7 * 2
    table = DeltaTable(uri, storage_options=deltalake_options(options))
    assert table.version() == 7 and table.to_pyarrow_table().num_rows == 1 + 7 * 2
    assert json.loads(fs.cat_file(f"{log}/_last_checkpoint"))["version"] == 7
    # Entries older than the retention, below a checkpoint: the next checkpoint cleans them,
    # oldest first up to the gap left above (7 goes with the next cleanup).
    time.sleep(2.5)
    append(uri, options, 8, checkpointer)
    checkpointer.checkpoint(uri, 8)
    fs.invalidate_cache(log)
    left = sorted(
        int(p.rsplit("/", 1)[-1][:20])
        for p in fs.ls(log)
        if p.endswith(".json") and p.rsplit("/", 1)[-1][:20].isdigit()
    )
    assert left == [7, 8]


def test_a_checkpoint_on_s3_lists_the_log_from_the_hint_on(minio) -> None:
    """A CommitLog keeps a month of entries: no listing of the checkpoint (or of the check
    whether the cleanup is due) starts at the log's beginning and reads it all."""
    proxy = LatencyProxy(int(minio.endpoint.rsplit(":", 1)[1]), 0, record=True).start()
    try:
        options = dict(minio.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
        uri = f"{minio.root('listing')}/t"
        new_table(uri, options)
        checkpointer = Checkpointer(options)
        for n in range(1, 4):
            append(uri, options, n, checkpointer)
        checkpointer.checkpoint(uri, 3)
        for n in range(4, 6):
            append(uri, options, n, checkpointer)
        proxy.requests.clear()  # type: ignore[union-attr]
        checkpointer.checkpoint(uri, 5)
        lists = [t for m, t in proxy.requests or [] if m == "LIST" and "_delta_log" in t]
        assert lists and all("start-after=" in t or "max-keys=" in t for t in lists), lists
    finally:
        proxy.stop()
