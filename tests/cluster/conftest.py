"""A Spark standalone cluster started by the tests: a master and two workers, each a JVM of its
own on loopback (pyspark's ``spark-class``), with one core each. Executors run in processes of
their own, in the workers' working directories, so nothing can lean on the driver's memory or
working directory. Drivers are submitted with ``spark-submit --master spark://...``.

The store root is on S3 (the session's MinIO server), as on a real cluster whose hosts share
no disk; streaming checkpoints are kept there too.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pyspark
import pytest

from rmq_spark import Store
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.spark.session import delta_jars, s3_jars
from tests.lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
#: Given to spark-class and spark-submit: their own lookup asks whatever python3 is on PATH.
SPARK_HOME = str(Path(pyspark.__file__).parent)
LOG4J2 = REPO / "rmq_spark" / "log4j2.properties"

pytestmark = [pytest.mark.cluster, pytest.mark.objectstore]


@dataclass
class Cluster:
    """A running standalone cluster."""

    master: str
    web: str
    work_dirs: list[Path]
    processes: list[subprocess.Popen] = field(default_factory=list)

    def workers(self) -> list[dict]:
        with urllib.request.urlopen(f"{self.web}/json/", timeout=10) as answer:
            return json.load(answer)["workers"]

    def stop(self) -> None:
        for process in reversed(self.processes):
            os.killpg(process.pid, 9)
            process.wait()


def _spawn(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with log.open("wb") as out:
        return subprocess.Popen(
            args,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )


def _bound(log: Path, pattern: str, process: subprocess.Popen, deadline: float) -> str:
    """The first match of ``pattern`` (one group) in ``log``, waiting for the process to log it."""
    while True:
        found = re.search(pattern, log.read_text(errors="replace"))
        if found:
            return found.group(1)
        if process.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"no {pattern!r} in {log.name}: {log.read_text()[-3000:]}")
        time.sleep(0.2)


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """A master and two one-core workers on loopback, stopped (SIGKILL) at the end.

    Every port is chosen by the JVM that binds it (port 0) and read from its log: a port found
    free here and bound later by a JVM can be taken in between, and the master's web UI then
    moves to the next port while the tests ask whatever server holds the first one.
    """
    base = tmp_path_factory.mktemp("cluster")
    env = {
        **os.environ,
        "SPARK_HOME": SPARK_HOME,
        "SPARK_LOCAL_IP": "127.0.0.1",
        "SPARK_LOG_DIR": str(base / "logs"),
        # Executors run this interpreter (it has rmq_spark) and find the tests' checkers.
        "PYSPARK_PYTHON": sys.executable,
        "PYTHONPATH": str(REPO),
    }
    spark_class = str(BIN / "spark-class")
    deadline = time.monotonic() + 180
    master_log = base / "master.log"
    master = _spawn(
        [spark_class, "org.apache.spark.deploy.master.Master", "--host", "127.0.0.1"]
        + ["--port", "0", "--webui-port", "0"],
        master_log,
        env,
    )
    cluster = Cluster("", "", [], [master])
    web_ui = r"Bound MasterWebUI to \S+ and started at (http://\S+)"
    cluster.master = _bound(master_log, r"Starting Spark master at (spark://\S+)", master, deadline)
    cluster.web = _bound(master_log, web_ui, master, deadline)
    for n in (1, 2):
        work = base / f"worker{n}"
        work.mkdir()
        cluster.work_dirs.append(work)
        cluster.processes.append(
            _spawn(
                [spark_class, "org.apache.spark.deploy.worker.Worker", cluster.master]
                + ["--host", "127.0.0.1", "--cores", "1", "--memory", "1500m"]
                + ["--work-dir", str(work), "--webui-port", "0"],
                base / f"worker{n}.log",
                env,
            )
        )
    while True:
        try:
            if sum(w["state"] == "ALIVE" for w in cluster.workers()) == 2:
                break
        except OSError:
            pass
        if time.monotonic() > deadline:
            cluster.stop()
            logs = {p.name: p.read_text()[-1500:] for p in base.glob("*.log")}
            pytest.fail(f"the standalone cluster did not start in 180 s: {logs}")
        time.sleep(1)
    yield cluster
    cluster.stop()


@pytest.fixture
def cluster_store(minio) -> Store:
    """An empty store on S3, for the cluster."""
    settings = StoreSettings(path=minio.root("cluster"), storage_options=minio.storage_options)
    return Store.open(settings=Settings(store=settings))


def submit(
    cluster: Cluster,
    conf: Path,
    program: list[str],
    *,
    driver_env: dict[str, str] | None = None,
    executor_env: dict[str, str] | None = None,
) -> subprocess.Popen:
    """Start ``spark-submit --master spark://...`` of ``program`` (a script and its arguments)
    in a session of its own (so a test can SIGKILL the whole driver), with the delta and S3A
    jars, and the settings file in ``$RMQ_SPARK_CONF`` of the driver and the executors."""
    confs = {
        "spark.pyspark.python": sys.executable,
        "spark.pyspark.driver.python": sys.executable,
        "spark.executor.memory": "1g",
        "spark.executor.cores": "1",
        "spark.cores.max": "2",
        "spark.ui.enabled": "false",
        "spark.sql.shuffle.partitions": "4",
        "spark.task.maxFailures": "4",
        "spark.executorEnv.PYTHONPATH": str(REPO),
        "spark.executorEnv.RMQ_SPARK_CONF": str(conf),
        **{f"spark.executorEnv.{k}": v for k, v in (executor_env or {}).items()},
    }
    # The jars are at this path on every node (all on this machine): on the class path, as a
    # cluster with them installed has them. Given as --jars (local: ones too), every executor
    # copies them into its work folder: 667 MB of S3A jars each, 8 GB a test session, which
    # filled the drive until MinIO refused writes.
    classpath = ":".join(delta_jars() + s3_jars())
    confs["spark.executor.extraClassPath"] = classpath
    args = [str(BIN / "spark-submit"), "--master", cluster.master]
    args += ["--driver-class-path", classpath]
    args += ["--driver-java-options", f"-Dlog4j2.configurationFile=file:{LOG4J2}"]
    for key, value in confs.items():
        args += ["--conf", f"{key}={value}"]
    env = {
        **os.environ,
        "SPARK_HOME": SPARK_HOME,
        "RMQ_SPARK_CONF": str(conf),
        "PYTHONPATH": str(REPO),
        **(driver_env or {}),
    }
    return subprocess.Popen(
        args + program,
        cwd=conf.parent,  # not the repository: the driver must not lean on its files
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        preexec_fn=die_with_parent,
    )


def finish(process: subprocess.Popen, timeout: float = 600) -> str:
    """Wait for a submitted driver; its stdout. Fails with its output when it failed."""
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, f"driver exit {process.returncode}:\n{err[-5000:]}"
    return out
