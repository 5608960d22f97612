"""rmq-spark on a Spark standalone cluster (two workers, executors in their own processes) with
its store on S3 (MinIO): the sink from executors, the streaming source and sink restarting
from checkpoints on S3, check-back through spark-submit, and kill -9 of an executor and of the
driver in the middle of a sink epoch."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pyarrow.compute as pc
import pytest

from rmq_spark import Message, Store
from rmq_spark.model.failpoints import ENV as FAILPOINT
from rmq_spark.model.failpoints import MARKER_ENV
from tests.cluster.conftest import REPO, finish, submit
from tests.conftest import commitlog, settings_file

pytestmark = [pytest.mark.cluster, pytest.mark.objectstore]
JOBS = str(Path(__file__).with_name("jobs.py"))


def visible(store: Store, topic: str) -> list[str]:
    rows = commitlog(store)
    rows = rows.filter(pc.equal(rows.column("topic"), topic))
    return sorted(b.decode() for b in rows.column("body").to_pylist())


def assert_dense(store: Store, topic: str) -> None:
    rows = commitlog(store).filter(pc.equal(commitlog(store).column("topic"), topic))
    for q in set(rows.column("queue_id").to_pylist()):
        offsets = sorted(
            rows.filter(pc.equal(rows.column("queue_id"), q)).column("queue_offset").to_pylist()
        )
        assert offsets == list(range(len(offsets))), (topic, q)


def test_batch_sink_writes_from_executors(spark_cluster, cluster_store, tmp_path: Path) -> None:
    conf = settings_file(cluster_store, tmp_path)
    out = finish(submit(spark_cluster, conf, [JOBS, "batch-sink", cluster_store.root, "200"]))
    driver_pid = json.loads(out.strip().splitlines()[-1])["driver_pid"]
    assert visible(cluster_store, "Orders") == sorted(str(i) for i in range(200))
    assert_dense(cluster_store, "Orders")
    properties = [dict(p) for p in commitlog(cluster_store).column("properties").to_pylist()]
    pids = {p["pid"] for p in properties}
    assert str(driver_pid) not in pids
    # Every row was made in an executor's working directory under a worker's work dir.
    work = [str(w) for w in spark_cluster.work_dirs]
    assert all(any(p["cwd"].startswith(w) for w in work) for p in properties)
    # The executors used the jars where they are: a copy per executor of every submission
    # (667 MB of S3A jars) filled the drive over a test session.
    copied = [str(j) for w in spark_cluster.work_dirs for j in w.glob("app-*/*/*.jar")]
    assert not copied, copied


def test_streaming_source_and_sink_restart_from_checkpoints_on_s3(
    spark_cluster, cluster_store, minio, tmp_path: Path
) -> None:
    store = cluster_store
    conf = settings_file(store, tmp_path)
    checkpoint = f"{store.root}/_checkpoints/relay"
    store.send([Message("Orders", f"a{i}") for i in range(50)], "shop")
    finish(submit(spark_cluster, conf, [JOBS, "relay", store.root, checkpoint]))
    assert visible(store, "Copies") == sorted(f"a{i}" for i in range(50))
    store.send([Message("Orders", f"b{i}") for i in range(30)], "shop")
    finish(submit(spark_cluster, conf, [JOBS, "relay", store.root, checkpoint]))
    expected = sorted([f"a{i}" for i in range(50)] + [f"b{i}" for i in range(30)])
    assert visible(store, "Copies") == expected  # the restart read only the new ones
    assert_dense(store, "Copies")


def test_check_back_through_spark_submit(spark_cluster, cluster_store, tmp_path: Path) -> None:
    store = cluster_store
    tags = ["COMMIT", "ROLLBACK", "COMMIT", "ROLLBACK", "COMMIT"]
    store.prepare([Message("Orders", f"m{i}", tags=t) for i, t in enumerate(tags)], "pg")
    conf = settings_file(store, tmp_path)
    job = str(REPO / "jobs" / "check_back.py")
    args = ["--once", "--checker", "pg=tests.checker_functions:by_tag"]
    finish(submit(spark_cluster, conf, [job, *args]))
    assert visible(store, "Orders") == ["m0", "m2", "m4"]


def _wait_for(path: Path, process, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if process.poll() is not None:
            raise AssertionError(f"driver ended before the failpoint: {process.stderr.read()}")
        assert time.monotonic() < deadline, "the failpoint was not reached"
        time.sleep(0.5)
    time.sleep(0.5)  # the pid is written right after the file is made


def _executor_of(pid: int) -> int:
    """The executor JVM that runs Python process ``pid`` (its nearest such ancestor)."""
    while pid > 1:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"CoarseGrainedExecutorBackend" in cmdline:
            return pid
        stat = Path(f"/proc/{pid}/stat").read_text()
        pid = int(stat[stat.rindex(")") + 2 :].split()[1])
    raise AssertionError("no executor JVM above the paused task")


def test_kill_9_of_an_executor_mid_epoch(spark_cluster, cluster_store, tmp_path: Path) -> None:
    """A task has staged its half messages; its executor is SIGKILLed before the epoch is
    committed. Spark runs the task again on another executor; every row is visible once."""
    store = cluster_store
    conf = settings_file(store, tmp_path)
    marker = tmp_path / "paused"
    driver = submit(
        spark_cluster,
        conf,
        [JOBS, "batch-sink", store.root, "120"],
        executor_env={FAILPOINT: "sink.staged:pause", MARKER_ENV: str(marker)},
    )
    _wait_for(marker, driver)
    executor = _executor_of(int(marker.read_text()))
    os.kill(executor, signal.SIGKILL)
    finish(driver)
    assert visible(store, "Orders") == sorted(str(i) for i in range(120))  # once each
    assert_dense(store, "Orders")
    staged = Counter(store.read("half", ["transaction_id"]).column("transaction_id").to_pylist())
    assert len(staged) > 4  # the killed attempt's halves are there, and were not published


def test_kill_9_of_the_driver_mid_epoch(spark_cluster, cluster_store, tmp_path: Path) -> None:
    """The streaming driver dies (SIGKILL to its whole session) when an epoch is closed and
    not yet committed; the restarted query and a check-back run publish it exactly once."""
    store = cluster_store
    conf = settings_file(store, tmp_path)
    checkpoint = f"{store.root}/_checkpoints/relay"
    store.send([Message("Orders", f"a{i}") for i in range(60)], "shop")
    killed = submit(
        spark_cluster,
        conf,
        [JOBS, "relay", store.root, checkpoint],
        driver_env={FAILPOINT: "sink.closed"},
    )
    killed.communicate(timeout=600)
    assert killed.returncode == -signal.SIGKILL
    assert len(visible(store, "Copies")) < 60
    finish(submit(spark_cluster, conf, [JOBS, "relay", store.root, checkpoint]))
    # Check-back resolves what the dead driver's epoch left, here started as `rmqtx check
    # --master spark://...` (no spark-submit: get_spark hands the cluster its jars).
    check = subprocess.run(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--conf", str(conf), "check", "--once"]
        + ["--master", spark_cluster.master],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert check.returncode == 0, check.stderr[-5000:]
    assert visible(store, "Copies") == sorted(f"a{i}" for i in range(60))
    assert_dense(store, "Copies")
