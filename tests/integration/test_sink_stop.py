"""Stopping a streaming ``rmqtx`` sink (``query.stop()``) while its tasks are staging, and the
writers' aborts: every half message the aborted attempt staged, in every task (killed ones
and zombies whose commit messages the driver never got included), is rolled back at the next
check-back round; a restart from the checkpoint publishes every row once; the stop is quiet."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql.types import StringType, StructField, StructType

from rmq_spark import Store
from rmq_spark.model.errors import EpochLostError
from rmq_spark.model.failpoints import ENV, MARKER_ENV
from rmq_spark.ops.status import format_status, store_status
from rmq_spark.spark.epoch_records import ABANDONED, CLOSED, OPEN, read_epoch
from rmq_spark.spark.epochs import close, hold
from rmq_spark.spark.sink import RmqTxBatchWriter, RmqTxStreamWriter
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.spark.source import RmqTxDataSource
from rmq_spark.spark.staging import stage
from tests.integration.test_sink import (
    INPUT,
    add_input,
    bodies,
    check_back,
    pending,
    rows,
    run_stream,
    stream_input,
    write,
)

ROWS = [f"m{i}" for i in range(40)]


@contextlib.contextmanager
def failpoint_in_tasks(spark, name: str, marker: Path) -> Iterator[None]:
    """Arm failpoint ``name`` in the Python workers of ``format("rmqtx")`` writes started in
    the block: the data source is registered again with the failpoint in its workers'
    environment (a worker factory of its own), then registered back without it."""
    environment = spark.sparkContext.environment
    environment.update({ENV: name, MARKER_ENV: str(marker)})
    try:
        spark.dataSource.register(RmqTxDataSource)
        yield
    finally:
        environment.pop(ENV)
        environment.pop(MARKER_ENV)
        spark.dataSource.register(RmqTxDataSource)


@contextlib.contextmanager
def jvm_log(spark) -> Iterator[list[str]]:
    """What Spark's JVM logs while the block runs (through the session's log4j2
    configuration: its levels and filters apply), one ``LEVEL logger: message`` line each,
    stack traces included."""
    jvm = spark.sparkContext._jvm
    core = jvm.org.apache.logging.log4j.core
    context = jvm.org.apache.logging.log4j.LogManager.getContext(False)
    root = context.getConfiguration().getRootLogger()
    text = jvm.java.io.StringWriter()
    layout = core.layout.PatternLayout.newBuilder().withPattern("%p %c: %m%n%ex").build()
    appender = (
        core.appender.WriterAppender.newBuilder()
        .setName("rmqtx-test-capture")
        .setTarget(text)
        .setLayout(layout)
        .build()
    )
    appender.start()
    root.addAppender(appender, None, None)
    context.updateLoggers()
    lines: list[str] = []
    try:
        yield lines
    finally:
        root.removeAppender("rmqtx-test-capture")
        context.updateLoggers()
        appender.stop()
        lines.extend(text.toString().splitlines())


def wait_for(condition, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.5)


def staged_transactions(store: Store, epoch: int) -> set[str]:
    half = store.read("half")
    return {
        t
        for t, e in zip(
            half.column("transaction_id").to_pylist(), half.column("epoch").to_pylist(), strict=True
        )
        if e == epoch
    }


def kill_if_alive(marker: Path) -> None:
    """End the paused task's Python worker if it is still there (Spark kills the worker of a
    killed task; this only makes sure no paused process outlives the test), checking first
    that the pid is still a PySpark worker's."""
    with contextlib.suppress(OSError, ValueError):
        pid = int(marker.read_text())
        if b"pyspark" in Path(f"/proc/{pid}/cmdline").read_bytes():
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("tasks", [4, 1])
def test_a_stopped_stream_rolls_back_every_task_and_restarts_exactly_once(
    spark, store: Store, tmp_path: Path, tasks: int
) -> None:
    """``query.stop()`` while a micro-batch of ``tasks`` tasks is staging. The first task to
    stage its halves pauses before it can report them (its commit message never reaches the
    driver, as for a task killed between its stage and its report); with 4 tasks the other 3
    finish and report. Before: the epoch stayed OPEN for its 10-minute lease, so the paused
    task's halves stayed pending ("writer alive") after the stop, and Spark printed
    TaskKilledException stack traces at ERROR. Now the abort abandons the epoch at once: one
    check-back round rolls back every half of the attempt, nothing of it is visible, and the
    restarted query publishes every row once."""
    source, checkpoint, marker = tmp_path / "in", tmp_path / "ckpt", tmp_path / "paused"
    add_input(spark, source, ROWS)
    with failpoint_in_tasks(spark, "sink.staged:pause", marker):
        query = (
            stream_input(spark, source)
            .repartition(tasks)
            .writeStream.format("rmqtx")
            .option("checkpointLocation", str(checkpoint))
            .option("path", store.root)
            .option("topic", "Orders")
            .option("producerGroup", "pipeline")
            .start()
        )
    try:
        # Every task staged: the paused one, and (4 tasks) the 3 that reported.
        wait_for(lambda: len(staged_transactions(store, 0)) == tasks, f"{tasks} staged tasks")
        wait_for(marker.exists, "the paused task")
        staged = staged_transactions(store, 0)
        query_id = json.loads((checkpoint / "metadata").read_text())["id"]
        assert read_epoch(store, query_id, 0).state == OPEN
        with jvm_log(spark) as logged:
            query.stop()
    finally:
        query.stop()
        kill_if_alive(marker)

    row = read_epoch(store, query_id, 0)
    # query.stop() interrupts the stream's thread, which then calls the writer's abort: now
    # and then the interrupt lands in the abort's own call to its Python worker before it
    # runs (3 runs in about 9 here; Spark's "failed to abort" line is not logged). Then the
    # epoch stays OPEN, and the paused task's halves are rolled back once the restart closes
    # the epoch without them (or its lease runs out); that is the only excuse taken here.
    aborted = row.state == ABANDONED
    assert (row.state, row.generation) == ((ABANDONED if aborted else OPEN), 0)
    assert not aborted or row.closed_by.startswith("abort:")  # by this run of the query
    assert bodies(store) == []  # nothing of the stopped attempt is visible
    if aborted:
        check_back(spark, store)
        assert pending(store) == set()  # one round: the paused task's halves too
        assert bodies(store) == []
    # A quiet stop: nothing from Spark at ERROR, no TaskKilledException stack traces.
    assert not [line for line in logged if "TaskKilledException" in line]
    assert not [line for line in logged if line.startswith(("ERROR", "FATAL"))]

    run_stream(spark, store, source, checkpoint)  # the restart replays batch 0
    assert bodies(store) == sorted(ROWS)  # every row once
    row = read_epoch(store, query_id, 0)
    assert (row.state, row.generation) == (CLOSED, 1 if aborted else 0)
    assert staged.isdisjoint(row.transaction_ids)
    check_back(spark, store)
    assert pending(store) == set()
    assert bodies(store) == sorted(ROWS)


def _options(spark, store: Store, **extra: str) -> dict[str, str]:
    return {"path": store.root, "topic": "Orders", "producerGroup": "pipeline", **extra}


def _stage(store: Store, spark, sink_id: str, epoch: int, generation: int, body: str):
    """Stage one task's halves in ``generation`` (as a task that held it does)."""
    options = WriterOptions.parse(_options(spark, store), rows(spark, 1).schema)
    batch = pa.record_batch({"body": [body], "keys": [body], "tags": ["T"]})
    return stage(store, [batch], options, sink_id, epoch, generation)


def test_an_abort_rolls_back_what_a_zombie_task_stages_after_it(
    spark, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """The driver aborts with the commit message of one task; another task of the attempt
    (same generation) is still running and stages after the abort. Both are rolled back, the
    reported one at once and the zombie's at the next check-back round; the abort logs one
    INFO line saying so; the replay reopens the epoch and publishes once."""
    schema = rows(spark, 1).schema
    writer = RmqTxStreamWriter(WriterOptions.parse(_options(spark, store), schema))
    held = hold(store, "q", 3, "q", lease_seconds=600)
    reported = _stage(store, spark, "q", 3, held.generation, "a")
    (group,) = store_status(store)["producer_groups"]
    assert (group["in_running_sink_epochs"], group["in_aborted_sink_epochs"]) == (1, 0)
    with caplog.at_level("INFO", logger="rmq_spark"):
        writer.abort([reported, None], 3)
    (line,) = [r for r in caplog.records if r.name.startswith("rmq_spark")]
    assert line.levelname == "INFO" and "epoch 3 aborted" in line.getMessage()
    assert "check-back" in line.getMessage()
    zombie = _stage(store, spark, "q", 3, held.generation, "b")  # staged after the abort
    assert reported.transaction_id not in pending(store)  # rolled back by the abort itself
    assert read_epoch(store, "q", 3).state == ABANDONED
    # rmqtx status says what the zombie's half waits for: the next check-back round.
    (group,) = [g for g in store_status(store)["producer_groups"] if g["pending_transactions"]]
    assert (group["in_running_sink_epochs"], group["in_aborted_sink_epochs"]) == (0, 1)
    assert "1 aborted (rolled back next round)" in format_status(store_status(store))
    check_back(spark, store)
    assert pending(store) == set()  # the zombie's halves too
    assert zombie.transaction_id is not None
    assert bodies(store) == []
    # The replay (the restarted query) reopens the epoch in the next generation.
    again = hold(store, "q", 3, "q", lease_seconds=600)
    assert (again.state, again.generation) == (OPEN, 1)


@pytest.mark.parametrize("sink_id", [None, "nightly"])
def test_a_task_that_holds_the_epoch_after_its_write_was_aborted_stages_nothing(
    spark, store: Store, sink_id: str | None
) -> None:
    """A task of a failed write that starts after the driver's abort (Spark cancels tasks
    asynchronously) must not reopen the abandoned epoch for itself: its halves would wait for
    its lease (10 minutes) instead of the next round (with a made-up sink id the epoch is
    closed empty: it would stage for nothing). It fails, staging nothing; a re-run with the
    same ``sinkId`` (a new attempt) reopens the epoch and publishes once."""
    options = WriterOptions.parse(
        _options(spark, store, **({} if sink_id is None else {"sinkId": sink_id})),
        rows(spark, 1).schema,
    )
    writer = RmqTxBatchWriter(options)
    batch = pa.record_batch({"body": ["a"], "keys": ["a"], "tags": ["T"]})
    reported = writer.write(iter([batch]))
    writer.abort([reported, None])
    with pytest.raises(EpochLostError, match="aborted"):
        writer.write(iter([batch]))  # the late task, after the abort
    check_back(spark, store)
    assert pending(store) == set()  # one round
    assert bodies(store) == []
    if sink_id is not None:
        assert read_epoch(store, sink_id, 0).state == ABANDONED
        again = RmqTxBatchWriter(options)
        again.commit([again.write(iter([batch]))])
        assert bodies(store) == ["a"]
        assert read_epoch(store, sink_id, 0).generation == 1


@pytest.mark.parametrize("sink_id", [None, "nightly"])
def test_an_abort_before_any_task_held_the_epoch_fences_the_late_tasks_too(
    store: Store, sink_id: str | None
) -> None:
    """A write whose job failed before any of its tasks held the epoch (a task failing before
    it staged): the abort still records the attempt, so a task of it that starts afterwards
    stages nothing, and a new attempt publishes."""
    schema = StructType([StructField(c, StringType()) for c in ("body", "keys", "tags")])
    extra = {} if sink_id is None else {"sinkId": sink_id}
    options = WriterOptions.parse(_options(None, store, **extra), schema)
    writer = RmqTxBatchWriter(options)
    writer.abort([None, None])
    batch = pa.record_batch({"body": ["a"], "keys": ["a"], "tags": ["T"]})
    with pytest.raises(EpochLostError, match="aborted"):
        writer.write(iter([batch]))
    assert pending(store) == set()
    if sink_id is not None:
        again = RmqTxBatchWriter(options)
        again.commit([again.write(iter([batch]))])
        assert bodies(store) == ["a"]


def test_an_abort_after_the_commit_closed_the_epoch_changes_nothing(spark, store: Store) -> None:
    """Spark aborts a micro-batch whose commit failed after closing the epoch: the epoch stays
    CLOSED with its list, and the listed transactions are committed, not rolled back."""
    schema = rows(spark, 1).schema
    writer = RmqTxStreamWriter(WriterOptions.parse(_options(spark, store), schema))
    held = hold(store, "q", 0, "q", lease_seconds=600)
    staged = _stage(store, spark, "q", 0, held.generation, "a")
    close(store, "q", 0, held.generation, [staged.transaction_id], "sink")
    before = read_epoch(store, "q", 0)
    writer.abort([staged], 0)
    assert read_epoch(store, "q", 0) == before
    assert bodies(store) == ["a"]
    assert pending(store) == set()


@pytest.mark.parametrize("sink_id", [None, "nightly"])
def test_a_failed_batch_write_rolls_back_everything(
    spark, store: Store, sink_id: str | None
) -> None:
    """The batch writer's abort: with a made-up sink id (never used again) the epoch is closed
    empty, as before; with a ``sinkId`` it is abandoned, and a re-run publishes once."""
    bad = spark.createDataFrame([("a", "k", "T"), ("b", "k", "T"), (None, "k", "T")], INPUT)
    options = {} if sink_id is None else {"sinkId": sink_id}
    with pytest.raises(Exception, match="null 'body'"):
        write(bad.repartition(3), store, **options)
    # The write's other tasks may still be staging when it fails; the round after them must
    # roll back what they staged (a round before them leaves it to the next round).
    tracker = spark.sparkContext._jsc.sc().statusTracker()
    wait_for(
        lambda: not any(e.numRunningTasks() for e in tracker.getExecutorInfos()),
        "the failed write's tasks to end",
        60,
    )
    check_back(spark, store)
    assert pending(store) == set()
    assert bodies(store) == []
    (row,) = store.read("epochs").to_pylist()
    expected = CLOSED if sink_id is None else ABANDONED
    assert (row["state"], row["closed_by"].split(":")[0]) == (expected, "abort")
    if sink_id is not None:
        write(rows(spark, 3), store, sinkId=sink_id)
        assert bodies(store) == ["m0", "m1", "m2"]
        assert read_epoch(store, sink_id, 0).generation == 1


def test_a_real_task_failure_still_logs_its_error(spark, store: Store) -> None:
    """The stop is quiet because only the abort path's lines are filtered: a task that fails
    is still logged at ERROR with its exception."""
    bad = spark.createDataFrame([(None, "k", "T")], INPUT)
    with jvm_log(spark) as logged, pytest.raises(Exception, match="null 'body'"):
        write(bad, store)
    text = "\n".join(logged)
    assert "ERROR org.apache.spark.executor.Executor: Exception in task" in text
    assert "null 'body'" in text


def test_a_batch_writer_abort_is_one_info_line(
    spark, store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    """A batch writer's abort with nothing staged says so at INFO, once."""
    writer = RmqTxBatchWriter(WriterOptions.parse(_options(spark, store), rows(spark, 1).schema))
    with caplog.at_level("INFO", logger="rmq_spark"):
        writer.abort([None, None])
    lines = [r for r in caplog.records if r.name.startswith("rmq_spark")]
    assert [r.levelname for r in lines] == ["INFO"]


#: A streaming script as a user writes it: a query into the rmqtx sink, awaited in the main
#: thread (interrupted by Ctrl-C), then a second one stopped with ``query.stop()``; the script
#: ends without stopping Spark.
INTERRUPTED_SCRIPT = r"""
import sys, time
from rmq_spark import get_spark

spark = get_spark(extra_conf={"spark.ui.enabled": "false"})

def start(name):
    rows = spark.readStream.format("rate").option("rowsPerSecond", 20).load()
    query = (
        rows.selectExpr("CAST(value AS STRING) AS keys", "CAST(value AS STRING) AS body")
        .writeStream.format("rmqtx").queryName(name)
        .option("path", sys.argv[1]).option("topic", "Ticks").option("producerGroup", "ticks")
        .option("checkpointLocation", f"{sys.argv[2]}/{name}")
        .trigger(processingTime="500 milliseconds").start()
    )
    while query.lastProgress is None or query.lastProgress["numInputRows"] == 0:
        time.sleep(0.2)
    return query

query = start("ticks")
print("READY", flush=True)
query.awaitTermination()
print("AWAITED", query.isActive, flush=True)
query = start("ticks-again")
query.stop()
print("STOPPED", flush=True)
"""


def test_ctrl_c_and_stop_print_one_line_and_no_traceback(tmp_path: Path) -> None:
    """Ctrl-C on a script awaiting an rmqtx sink printed about 170 lines of py4j and
    KeyboardInterrupt tracebacks and no line about the epoch; a ``query.stop()`` printed an
    ``EOFError`` traceback of PySpark's accumulator server (#48). Ctrl-C here is SIGINT to the
    script's process group, as a terminal sends it (Spark's JVM included)."""
    child = subprocess.Popen(
        [sys.executable, "-c", INTERRUPTED_SCRIPT, str(tmp_path / "store"), str(tmp_path / "cp")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    lines: list[str] = []
    try:
        for raw in child.stdout:
            lines.append(raw.decode(errors="replace").rstrip("\n"))
            if lines[-1] == "READY":
                os.killpg(child.pid, signal.SIGINT)
        child.wait(timeout=120)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.pid, signal.SIGKILL)
    output = "\n".join(lines)
    assert child.returncode == 0, output
    assert "AWAITED False" in lines and "STOPPED" in lines, output
    ours = [line for line in lines if line.startswith("rmqtx: Ctrl-C: stopping streaming query")]
    assert len(ours) == 1 and "'ticks'" in ours[0] and "was the last committed" in ours[0], output
    for noise in ("Traceback", "KeyboardInterrupt", "EOFError", "Py4J", "Exception"):
        assert noise not in output, f"{noise!r} printed:\n{output}"


def test_status_says_a_closed_epochs_listed_halves_are_committed_next_round(
    spark, store: Store
) -> None:
    """A writer that died between closing its epoch and recording its decisions leaves the
    listed halves pending: the epoch checker commits them next round, but status called them
    "aborted (rolled back next round)" (review of #49)."""
    held = hold(store, "w", 5, "w", lease_seconds=600)
    listed = _stage(store, spark, "w", 5, held.generation, "kept")
    dropped = _stage(store, spark, "w", 5, held.generation, "extra")  # a failed attempt's
    close(store, "w", 5, held.generation, [listed.transaction_id], "w")
    (group,) = [g for g in store_status(store)["producer_groups"] if g["pending_transactions"]]
    assert group["in_committed_sink_epochs"] == 1 and group["in_aborted_sink_epochs"] == 1
    assert "1 committed next round, 1 aborted" in format_status(store_status(store))
    check_back(spark, store)
    assert pending(store) == set() and bodies(store) == ["kept"]
    assert dropped.transaction_id is not None
