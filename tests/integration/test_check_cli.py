"""`rmqtx check` as a real process: loop mode and signals, kill -9 mid-run, config errors."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rmq_spark import Message, Store
from rmq_spark.checkback.checkers import CallableChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import TransactionSettings
from tests.conftest import commitlog

REPO = Path(__file__).resolve().parents[2]
FUNCS = "tests.checker_functions"


def rmqtx(conf: Path, store: Store, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "rmq_spark.ops.cli",
            "--conf",
            str(conf),
            "--path",
            store.root,
            *args,
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(condition, timeout: float = 600) -> None:
    """Poll ``condition`` (a hang detector: Spark may take minutes to start on a loaded host)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.5)


def conf_file(tmp_path: Path) -> Path:
    conf = tmp_path / "rmq.toml"
    conf.write_text('[transaction]\ntransaction_timeout = "0s"\n[logging]\nlevel = "INFO"\n')
    return conf


def test_loop_stops_cleanly_on_sigterm(store: Store, tmp_path: Path) -> None:
    (p,) = store.prepare([Message("Orders", b"x", tags="COMMIT")], "pg")
    proc = rmqtx(
        conf_file(tmp_path), store, "check", "--interval", "5s", "--checker", f"pg={FUNCS}:by_tag"
    )
    try:
        wait_for(lambda: store.read("check_runs").num_rows >= 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "received SIGTERM" in err and "check-back loop stopped after" in err
    assert commitlog(store).column("transaction_id").to_pylist() == [p.transaction_id]


def test_kill_mid_run_leaves_nothing_half_done(spark, store: Store, tmp_path: Path) -> None:
    a = store.prepare(
        [Message("Orders", b"a1"), Message("Orders", b"a2")], "a", transaction_ids=["tx-a", "tx-a"]
    )
    store.prepare([Message("Orders", b"b", tags="SLOW")], "b", transaction_ids=["tx-b"])
    proc = rmqtx(
        conf_file(tmp_path),
        store,
        "check",
        "--once",
        "--checker",
        f"a={FUNCS}:slow_commit",
        "--checker",
        f"b={FUNCS}:slow_commit",
    )
    try:
        # Group a is decided before group b's (slow) checker answers: kill the job then.
        wait_for(lambda: store.read("op").num_rows == 1)
        time.sleep(1)
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=60)
    finally:
        proc.kill()
    op = store.read("op").to_pylist()
    assert [(o["transaction_id"], o["decision"]) for o in op] == [("tx-a", "COMMIT")]
    assert {r["transaction_id"] for r in commitlog(store).to_pylist()} <= {"tx-a"}
    # The next run publishes a (exactly once) and finishes b.
    later = datetime.now(UTC) + timedelta(seconds=10)
    job = CheckBackJob(
        spark,
        store,
        {g: CallableChecker(f"{FUNCS}:always_commit") for g in "ab"},
        TransactionSettings(transaction_timeout=0),
        clock=lambda: later,
    )
    summary = job.run_once().summary
    assert (summary.committed, summary.pending_found) == (1, 1)
    rows = commitlog(store).to_pylist()
    assert sorted(r["body"] for r in rows) == [b"a1", b"a2", b"b"]
    assert len({r["msg_id"] for r in rows}) == 3
    assert {r["msg_id"] for r in rows if r["transaction_id"] == "tx-a"} == {m.msg_id for m in a}


def test_a_round_that_leaves_unrouted_transactions_exits_3(store: Store, tmp_path: Path) -> None:
    """A group without a checker warned, and ``check --once`` exited 0: a scheduler saw
    success while transactions stayed pending (#48)."""
    store.prepare([Message("Orders", "nobody checks me")], "no-checker-group")
    conf = conf_file(tmp_path)
    done = rmqtx(conf, store, "check", "--once")
    _, err = done.communicate(timeout=600)
    assert done.returncode == 3, err
    assert "1 pending transaction(s) were not checked: their producer group has no checker" in err
    skipped = rmqtx(conf, store, "check", "--once", "--skip-unrouted")
    _, err = skipped.communicate(timeout=600)
    assert skipped.returncode == 0, err


def test_bad_checker_is_a_clear_error_with_exit_code_2(store: Store, tmp_path: Path) -> None:
    proc = rmqtx(conf_file(tmp_path), store, "check", "--once", "--checker", "pg=no_such:fn")
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 2
    assert "checker module 'no_such'" in err and "cannot be imported" in err


def test_a_checker_module_that_raises_at_import_is_a_clear_error(
    store: Store, tmp_path: Path
) -> None:
    """A module that raised as it was imported gave a traceback and exit code 1."""
    (tmp_path / "broken_checker.py").write_text("raise RuntimeError('no database URL set')\n")
    proc = subprocess.run(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--conf", str(conf_file(tmp_path)), "--path",
         store.root, "check", "--once", "--checker", "pg=broken_checker:check"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(REPO)])},
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr
    assert "raised RuntimeError as it was imported: no database URL set" in proc.stderr
    assert "Traceback" not in proc.stderr
