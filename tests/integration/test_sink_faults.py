"""kill -9 at every step of a transactional sink epoch (and a task retried after staging),
then a restart and one check-back run: every input row is published exactly once and nothing
from the killed attempt appears."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from deltalake import DeltaTable

from rmq_spark import Store
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import TransactionSettings
from rmq_spark.model.failpoints import ENV
from tests.conftest import commitlog

REPO = Path(__file__).resolve().parents[2]
BATCHES = [[f"o{b}-{i}" for i in range(4)] for b in range(3)]


def run_child(mode: str, paths: dict[str, Path], failpoint: str | None, expect: int) -> None:
    """Run the pipeline in its own process; its exit code must be ``expect`` (its output is
    shown otherwise)."""
    env = {k: v for k, v in os.environ.items() if k != ENV}
    if failpoint:
        env[ENV] = failpoint
    args = [paths[k] for k in ("store", "input", "checkpoint", "business")]
    child = subprocess.run(
        [sys.executable, "-m", "tests.sink_child", mode, *map(str, args)],
        cwd=REPO,
        env=env,
        start_new_session=True,
        capture_output=True,
        timeout=600,
    )
    assert child.returncode == expect, child.stderr.decode(errors="replace")[-4000:]


@pytest.mark.parametrize(
    ("mode", "failpoint"),
    [
        ("batch", "sink.staged:raise"),
        ("stream", "sink.staged"),
        ("stream", "sink.closed"),
        ("stream", "sink.published"),
        ("foreach", "delta.staged"),
        ("foreach", "delta.written"),
        ("foreach", "delta.closed"),
    ],
)
def test_kill_at_each_step_then_restart(spark, store: Store, tmp_path: Path, mode, failpoint):
    paths = {
        "store": Path(store.root),
        "input": tmp_path / "input",
        "checkpoint": tmp_path / "checkpoint",
        "business": tmp_path / "orders",
    }
    for batch in BATCHES:
        spark.createDataFrame(
            [(b, b, i) for i, b in enumerate(batch)], "body string, keys string, order_id int"
        ).coalesce(1).write.format("delta").mode("append").save(str(paths["input"]))

    if failpoint.endswith(":raise"):
        run_child(mode, paths, failpoint, 0)  # Spark retried the failed task
    else:
        run_child(mode, paths, failpoint, -signal.SIGKILL)
        run_child(mode, paths, None, 0)
    CheckBackJob(
        spark, store, {}, TransactionSettings(transaction_timeout=0.0, transaction_check_max=3)
    ).run_once()

    expected = sorted(b for batch in BATCHES for b in batch)
    published = sorted(b.decode() for b in commitlog(store).column("body").to_pylist())
    assert published == expected  # each input row once, nothing from the killed attempt
    half = set(store.read("half").column("transaction_id").to_pylist())
    decided = set(store.read("op").column("transaction_id").to_pylist())
    assert half <= decided  # nothing left pending
    if mode == "foreach":
        orders = DeltaTable(str(paths["business"])).to_pyarrow_table()
        assert orders.num_rows == len(expected)  # the business table agrees: once each
        assert DeltaTable(str(paths["business"])).transaction_version("orders-pipeline") == 2
