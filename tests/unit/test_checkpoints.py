"""Checkpoints written from the process's own entries and previous checkpoint
(rmq_spark.delta.checkpoints), checked against deltalake's own checkpoint of the same log:
random histories of direct appends and compactions, deltalake appends and deletes, table
property changes; what it leaves to deltalake; a crash between its two writes; a lagging hint."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable, write_deltalake

from rmq_spark.delta.checkpoints import CHECKPOINT_SCHEMA, Checkpointer
from rmq_spark.delta.checkpoints import _shape as shape
from rmq_spark.delta.commit import commit
from rmq_spark.delta.files import write_files

REPO = Path(__file__).resolve().parents[2]
SCHEMA = pa.schema([("key", pa.string()), ("n", pa.int64()), ("part", pa.string())])


def make_table(uri: str, **configuration: str) -> None:
    rows = pa.Table.from_pylist([{"key": "k0", "n": 0, "part": "a"}], SCHEMA)
    config = {"delta.checkpointInterval": "100000", **configuration}
    write_deltalake(uri, rows, partition_by=["part"], configuration=config)


def rows(n: int, count: int) -> pa.Table:
    return pa.Table.from_pylist(
        [{"key": f"k{n}-{i}", "n": n, "part": "ab"[i % 2]} for i in range(count)], SCHEMA
    )


def direct_append(uri: str, n: int, checkpointer: Checkpointer | None, app: str | None) -> int:
    adds = write_files(uri, iter([rows(n, 3)]), SCHEMA, "part", {})
    landed = None if checkpointer is None else lambda v, e: checkpointer.committed(uri, v, e)
    return commit(
        uri,
        {},
        DeltaTable(uri).version(),
        adds,
        app_ids={app: n} if app else None,
        landed=landed,
    )


def appended(tmp_path: Path, count: int, app: str | None = None) -> tuple[str, Checkpointer]:
    """A table with ``count`` direct appends after its first commit, all told to the
    checkpointer returned."""
    uri = str(tmp_path / "t")
    make_table(uri)
    checkpointer = Checkpointer({})
    for n in range(1, count + 1):
        direct_append(uri, n, checkpointer, app)
    return uri, checkpointer


def live_files(uri: str) -> list[dict[str, Any]]:
    return pa.table(DeltaTable(uri).get_add_actions(flatten=False)).to_pylist()


def direct_compaction(uri: str, checkpointer: Checkpointer, rng: random.Random) -> None:
    """Rewrite a few live files as one (a compaction, as the store's maintenance makes)."""
    version = DeltaTable(uri).version()
    chosen = rng.sample(live_files(uri), min(len(live_files(uri)), rng.randint(2, 5)))
    read = []
    for file in chosen:
        data = pq.read_table(f"{uri}/{file['path']}")
        part = pa.array([file["partition"]["part"]] * data.num_rows, pa.string())
        read.append(data.append_column("part", part).select(SCHEMA.names).cast(SCHEMA))
    adds = write_files(uri, iter([pa.concat_tables(read)]), SCHEMA, "part", {}, data_change=False)
    removes = [
        {"path": f["path"], "size": f["size_bytes"], "partition_values": f["partition"]}
        for f in chosen
    ]
    commit(
        uri,
        {},
        version,
        adds,
        removes=removes,
        landed=lambda v, e: checkpointer.committed(uri, v, e),
    )


def checkpoint_state(path: Path) -> dict[str, Any]:
    """What a checkpoint says: live files, tombstones, application ids, metadata, protocol."""
    state: dict[str, Any] = {"add": {}, "remove": set(), "txn": {}}
    for row in pq.read_table(path).to_pylist():
        if row["add"]:
            add = row["add"]
            stats = json.loads(add["stats"]) if add["stats"] else None
            values = sorted(dict(add["partitionValues"]).items())
            state["add"][add["path"]] = (add["size"], values, stats)
        if row["remove"]:
            state["remove"].add(row["remove"]["path"])
        if row["txn"]:
            state["txn"][row["txn"]["appId"]] = row["txn"]["version"]
        if row["metaData"]:
            meta = row["metaData"]
            state["metaData"] = (meta["id"], sorted(dict(meta["configuration"]).items()))
        if row["protocol"]:
            state["protocol"] = row["protocol"]
    return state


def deltalakes_checkpoint(uri: str, version: int, scratch: Path) -> Path:
    """deltalake's checkpoint of ``version``, made from a copy of the log's entries alone."""
    shutil.rmtree(scratch, ignore_errors=True)
    log = scratch / "_delta_log"
    log.mkdir(parents=True)
    for entry in (Path(uri) / "_delta_log").glob("*.json"):
        if int(entry.name[:20]) <= version:
            shutil.copy(entry, log / entry.name)
    DeltaTable(str(scratch), version=version).create_checkpoint()
    return log / f"{version:020d}.checkpoint.parquet"


def ours(uri: str, version: int) -> Path:
    return Path(uri) / "_delta_log" / f"{version:020d}.checkpoint.parquet"


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_checkpoints_of_random_histories_say_what_deltalakes_replay_says(
    tmp_path: Path, seed: int, caplog: pytest.LogCaptureFixture
) -> None:
    """Direct appends (told or not told to the checkpointer, some with application ids),
    compactions, deltalake appends and deletes and property changes, checkpointed at random
    versions, each from the one before: every checkpoint holds what deltalake's checkpoint of
    a copy of the entries holds, and the table reads the same through it."""
    caplog.set_level("DEBUG", "rmq_spark.delta.checkpoints")
    rng = random.Random(seed)
    uri = str(tmp_path / "t")
    make_table(uri)
    checkpointer = Checkpointer({})
    checked = 0
    for n in range(1, 70):
        step = rng.random()
        if step < 0.45:
            told = checkpointer if rng.random() < 0.8 else None  # another process's entry
            direct_append(uri, n, told, rng.choice([None, "app-1", "app-2"]))
        elif step < 0.6:
            direct_compaction(uri, checkpointer, rng)
        elif step < 0.7:
            write_deltalake(uri, rows(n, 2), mode="append", partition_by=["part"])
        elif step < 0.78:
            DeltaTable(uri).delete(f"n = {rng.randint(0, n)}")
        elif step < 0.83:
            DeltaTable(uri).alter.set_table_properties(
                {"delta.logRetentionDuration": f"interval {30 + n} days"}
            )
        else:
            version = DeltaTable(uri).version()
            checkpointer.checkpoint(uri, version)
            expected = deltalakes_checkpoint(uri, version, tmp_path / "ref")
            assert checkpoint_state(ours(uri, version)) == checkpoint_state(expected)
            checked += 1
    assert checked >= 3
    assert not [r for r in caplog.records if "left to deltalake" in r.getMessage()]
    # Read through the newest checkpoint, the table holds the files the entries alone hold.
    version = DeltaTable(uri).version()
    checkpointer.checkpoint(uri, version)
    reference = deltalakes_checkpoint(uri, version, tmp_path / "ref").parents[1]
    for made in ("_last_checkpoint", f"{version:020d}.checkpoint.parquet"):
        (reference / "_delta_log" / made).unlink()
    assert relative(DeltaTable(uri), uri) == relative(DeltaTable(str(reference)), reference)
    assert DeltaTable(uri).to_pyarrow_table().num_rows > 0


def relative(table: DeltaTable, root: object) -> list[str]:
    return sorted(u.split(str(root), 1)[1] for u in table.file_uris())


def test_the_checkpoint_layout_is_deltalakes(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    make_table(uri)
    direct_append(uri, 1, None, "app")
    checkpointer = Checkpointer({})
    checkpointer.checkpoint(uri, 1)
    written = pq.read_schema(ours(uri, 1))
    expected = pq.read_schema(deltalakes_checkpoint(uri, 1, tmp_path / "ref"))
    assert shape(pa.struct(list(written))) == shape(pa.struct(list(expected)))
    assert written.names == CHECKPOINT_SCHEMA.names
    hint = json.loads((Path(uri) / "_delta_log" / "_last_checkpoint").read_text())
    assert hint["version"] == 1 and hint["numOfAddFiles"] == 3 and hint["size"] == 6


def test_a_table_beyond_appends_is_checkpointed_by_deltalake(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Deletion vectors enabled by another engine: the checkpoint is left to deltalake's
    replay, and says what it says."""
    from deltalake import TableFeatures

    uri = str(tmp_path / "t")
    make_table(uri)
    checkpointer = Checkpointer({})
    direct_append(uri, 1, checkpointer, None)
    DeltaTable(uri).alter.add_feature(
        TableFeatures.DeletionVectors, allow_protocol_versions_increase=True
    )
    write_deltalake(uri, rows(2, 2), mode="append", partition_by=["part"])
    version = DeltaTable(uri).version()
    with caplog.at_level("DEBUG", "rmq_spark.delta.checkpoints"):
        checkpointer.checkpoint(uri, version)
    assert [r for r in caplog.records if "left to deltalake" in r.getMessage()]
    expected = deltalakes_checkpoint(uri, version, tmp_path / "ref")
    assert checkpoint_state(ours(uri, version)) == checkpoint_state(expected)


def test_tombstones_older_than_the_tables_retention_are_dropped(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    make_table(uri, **{"delta.deletedFileRetentionDuration": "interval 2 seconds"})
    checkpointer = Checkpointer({})
    for n in range(1, 5):
        direct_append(uri, n, checkpointer, None)
    old = {f["path"] for f in live_files(uri)}
    direct_compaction(uri, checkpointer, random.Random(0))
    old -= {f["path"] for f in live_files(uri)}
    checkpointer.checkpoint(uri, DeltaTable(uri).version())
    assert checkpoint_state(ours(uri, DeltaTable(uri).version()))["remove"] == old
    time.sleep(2.5)
    kept = {f["path"] for f in live_files(uri)}
    direct_compaction(uri, checkpointer, random.Random(1))
    young = kept - {f["path"] for f in live_files(uri)}
    version = DeltaTable(uri).version()
    checkpointer.checkpoint(uri, version)
    assert checkpoint_state(ours(uri, version))["remove"] == young


def test_a_writer_killed_between_the_checkpoint_and_its_hint_leaves_both_usable(
    tmp_path: Path,
) -> None:
    """Killed after the checkpoint file and before the hint: readers find the checkpoint by
    listing, and the next checkpoint starts from it, not from the hint's older one."""
    uri = str(tmp_path / "t")
    make_table(uri)
    checkpointer = Checkpointer({})
    for n in range(1, 4):
        direct_append(uri, n, checkpointer, f"app-{n % 2}")
    checkpointer.checkpoint(uri, 3)
    for n in range(4, 7):
        direct_append(uri, n, checkpointer, f"app-{n % 2}")
    child = textwrap.dedent(
        f"""
        from rmq_spark.delta.checkpoints import Checkpointer
        Checkpointer({{}}).checkpoint({uri!r}, 6)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child],
        env={**os.environ, "PYTHONPATH": str(REPO), "RMQ_SPARK_FAILPOINT": "checkpoint.written"},
        start_new_session=True,
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()
    hint = json.loads((Path(uri) / "_delta_log" / "_last_checkpoint").read_text())
    assert hint["version"] == 3 and ours(uri, 6).exists()
    assert DeltaTable(uri).version() == 6
    direct_append(uri, 7, None, "app-1")
    # The next one starts from the listed checkpoint 6: with entries 4 to 6 gone, the
    # lagging hint's checkpoint 3 would have left it to deltalake (and 6 is all it needs).
    for v in (4, 5, 6):
        (Path(uri) / "_delta_log" / f"{v:020d}.json").unlink()
    Checkpointer({}).checkpoint(uri, 7)
    state = checkpoint_state(ours(uri, 7))
    assert state["txn"] == {"app-0": 6, "app-1": 7}
    assert len(state["add"]) == 1 + 7 * 2


def test_an_entry_put_where_the_log_was_cleaned_is_not_checkpointed(tmp_path: Path) -> None:
    """A stalled writer's put that filled a cleaned version below a newer checkpoint (the
    commit refused it and made it again elsewhere) stays out of every later checkpoint, even
    when the hint lags behind that checkpoint."""
    uri, checkpointer = appended(tmp_path, 4)
    checkpointer.checkpoint(uri, 2)
    lagging = (Path(uri) / "_delta_log" / "_last_checkpoint").read_text()
    checkpointer.checkpoint(uri, 4)
    (Path(uri) / "_delta_log" / "_last_checkpoint").write_text(lagging)
    orphan = write_files(uri, iter([rows(99, 1)]), SCHEMA, "part", {})
    entry = json.dumps({"add": {**_add_json(orphan[0])}}).encode()
    (Path(uri) / "_delta_log" / f"{3:020d}.json").write_bytes(entry)  # the refilled hole
    direct_append(uri, 5, None, None)
    Checkpointer({}).checkpoint(uri, 5)
    assert orphan[0].path not in checkpoint_state(ours(uri, 5))["add"]
    assert orphan[0].path not in relative(DeltaTable(uri), f"{uri}/")


def _add_json(action: Any) -> dict[str, Any]:
    return {
        "path": action.path,
        "partitionValues": dict(action.partition_values),
        "size": action.size,
        "modificationTime": action.modification_time,
        "dataChange": True,
        "stats": action.stats,
    }


def test_readers_of_the_log_take_the_process_own_entries_from_memory(tmp_path: Path) -> None:
    """Following the log, reading commitInfos and application ids: an entry this process put
    is not read again (here its file is moved away: only the memory has it)."""
    from rmq_spark.delta.txnlog import app_transactions, commit_infos, follow

    uri = str(tmp_path / "t")
    make_table(uri)
    checkpointer = Checkpointer({})
    version = direct_append(uri, 1, checkpointer, "app")
    table = DeltaTable(uri)
    entry = Path(uri) / "_delta_log" / f"{version:020d}.json"
    entry.rename(tmp_path / "away.json")
    own = checkpointer.entries(uri)
    assert follow(uri, {}, version - 1, {}, own=own) == (version, {"app": 1})
    assert commit_infos(uri, {}, version, version, own)[version]["operation"] == "WRITE"
    assert app_transactions(table, uri, {}, own) == {"app": 1}
    assert follow(uri, {}, version - 1, {}) == (version - 1, {})  # without it: not found


@pytest.mark.usefixtures("young_entries_cleaned")
def test_the_log_after_a_lagging_hint_is_not_cleaned(tmp_path: Path) -> None:
    """A writer died between a checkpoint and its hint: the log cleanup keeps everything from
    the hint's checkpoint on, where rmq-spark's readers and a commit's reachability check
    start (cleaned below the newer checkpoint, the application ids could not be read)."""
    from rmq_spark.delta.txnlog import app_transactions, clean_log

    uri, checkpointer = appended(tmp_path, 3, "app")
    checkpointer.checkpoint(uri, 3)
    lagging = (Path(uri) / "_delta_log" / "_last_checkpoint").read_text()
    for n in range(4, 7):
        direct_append(uri, n, checkpointer, "app")
    checkpointer.checkpoint(uri, 6)
    (Path(uri) / "_delta_log" / "_last_checkpoint").write_text(lagging)
    clean_log(uri, {}, [(6, datetime.now(UTC) + timedelta(hours=1))])
    assert min(int(p.name[:20]) for p in (Path(uri) / "_delta_log").glob("*.json")) == 3
    assert app_transactions(DeltaTable(uri), uri, {}) == {"app": 6}
    # The hint back at 6, the entries before it go.
    (Path(uri) / "_delta_log" / "_last_checkpoint").write_text(json.dumps({"version": 6}))
    clean_log(uri, {}, [(6, datetime.now(UTC) + timedelta(hours=1))])
    assert min(int(p.name[:20]) for p in (Path(uri) / "_delta_log").glob("*.json")) == 6


def test_a_checkpoint_written_late_does_not_take_the_hint_back(tmp_path: Path) -> None:
    from rmq_spark.delta.checkpoints import _write

    uri, checkpointer = appended(tmp_path, 6)
    checkpointer.checkpoint(uri, 6)
    log = Path(uri) / "_delta_log"
    stalled = pq.read_table(ours(uri, 6))  # any table: what matters is the version, 3
    _write(fsspec.filesystem("file"), str(log), 3, stalled, local=True)
    assert json.loads((log / "_last_checkpoint").read_text())["version"] == 6


def test_a_tombstone_without_a_deletion_time_expires_as_deltalake_has_it(tmp_path: Path) -> None:
    uri = str(tmp_path / "t")
    make_table(uri)
    checkpointer = Checkpointer({})
    direct_append(uri, 1, checkpointer, None)
    gone = live_files(uri)[0]["path"]
    entry = {"remove": {"path": gone, "dataChange": True}}
    version = DeltaTable(uri).version() + 1
    (Path(uri) / "_delta_log" / f"{version:020d}.json").write_text(json.dumps(entry))
    checkpointer.checkpoint(uri, version)
    expected = deltalakes_checkpoint(uri, version, tmp_path / "ref")
    assert checkpoint_state(ours(uri, version)) == checkpoint_state(expected)
    assert gone not in checkpoint_state(ours(uri, version))["remove"]
