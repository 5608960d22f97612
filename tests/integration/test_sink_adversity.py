"""Transactional writers under a hostile schedule: jobs that outlive the check budget while
check-back rounds run, epochs abandoned under a live writer, spoofed internal markers, one
broken pending message among good ones, sink ids reused by a new checkpoint, new store paths."""

from __future__ import annotations

import threading
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark.sql import functions as F

from rmq_spark import LocalTransactionState, Message, Store, publish_with_delta_write
from rmq_spark.checkback.checkers import CallableChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import TransactionSettings
from rmq_spark.spark.epoch_records import ABANDONED, delta_commit_marker, read_epoch
from rmq_spark.spark.epochs import close
from rmq_spark.spark.sink_options import WriterOptions
from tests.integration.test_sink import add_input, bodies, held_stage, pending, run_stream, write

#: A check max the slow partition outlives many times over.
TIGHT = TransactionSettings(transaction_timeout=0.0, transaction_check_max=2)


def slow_rows(spark, gate: Path, n: int = 20):
    """``n`` rows in two partitions; the second one's first row waits until ``gate`` exists
    (the test opens it once check-back rounds have spent the check budget many times)."""
    gate_path = str(gate)

    @F.udf("string")
    def body(i):
        import os
        import time

        deadline = time.monotonic() + 600
        while i == n // 2 and not os.path.exists(gate_path) and time.monotonic() < deadline:
            time.sleep(0.2)
        return f"m{i}"

    return spark.range(0, n, 1, numPartitions=2).select(body("id").alias("body"))


class CheckBackRounds:
    """Check-back rounds back to back in a thread (as a scheduled job would run them); opens
    ``gate`` after ``rounds`` of them, counted from the first that found pending transactions."""

    def __init__(
        self, spark, store: Store, gate: Path, rounds: int, clock=lambda: datetime.now(UTC)
    ) -> None:
        self.job = CheckBackJob(spark, store, {}, TIGHT, clock=clock)
        self.gate, self.wanted, self.rounds = gate, rounds, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            # Counted from the first round that found the early task's halves: rounds run
            # before any task staged (Spark's Python workers are slow to start on a busy
            # machine) would open the gate before a check could spend a budget or abandon an
            # epoch.
            if self.job.run_once().summary.pending_found or self.rounds:
                self.rounds += 1
            if self.rounds >= self.wanted:
                self.gate.touch()

    def __enter__(self) -> CheckBackRounds:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join(timeout=300)


@pytest.mark.parametrize("lease", [None, "3s"])
def test_a_job_outliving_the_check_budget_publishes_everything(
    spark, store: Store, tmp_path: Path, lease: str | None
) -> None:
    """Defect: the early task's halves were rolled back at the check max while the slow task
    ran; the driver's COMMIT was refused and the write reported success with half the rows."""
    options = {} if lease is None else {"leaseTimeout": lease}  # 3 s: heartbeats keep it
    gate, wanted = tmp_path / "gate", TIGHT.transaction_check_max + 3
    with CheckBackRounds(spark, store, gate, wanted) as rounds:
        write(slow_rows(spark, gate), store, sinkId="long-job", **options)
    assert rounds.rounds >= wanted  # the early task's halves outlived the check budget
    CheckBackJob(spark, store, {}, TIGHT).run_once()
    assert bodies(store) == sorted(f"m{i}" for i in range(20))
    assert pending(store) == set()
    assert store.read("discard").num_rows == 0


def test_a_writer_whose_epoch_is_abandoned_fails_and_its_retry_publishes_once(
    spark, store: Store, tmp_path: Path
) -> None:
    """A check-back job whose clock is past the lease (the writer looks dead: as after a stall
    longer than leaseTimeout) abandons the epoch under the running job: the job fails instead
    of publishing part of its rows, and running it again publishes every row once."""
    later = datetime.now(UTC) + timedelta(hours=1)
    gate = tmp_path / "gate"
    with (
        CheckBackRounds(spark, store, gate, 2, clock=lambda: later),
        pytest.raises(Exception, match="EPOCH_LOST"),
    ):
        write(slow_rows(spark, gate), store, sinkId="stalled-job")
    assert read_epoch(store, "stalled-job", 0).state == ABANDONED
    assert bodies(store) == []
    write(slow_rows(spark, gate), store, sinkId="stalled-job")  # the retry
    CheckBackJob(spark, store, {}, TIGHT).run_once()
    assert bodies(store) == sorted(f"m{i}" for i in range(20))
    assert pending(store) == set()
    # Abandoned at least once (a round after the first job's task retries re-took the epoch,
    # on a slow machine, abandons it again: generation 2); every row published once above.
    assert read_epoch(store, "stalled-job", 0).generation >= 1


def test_user_messages_cannot_pass_for_sink_messages(spark, store: Store) -> None:
    """A service forwarding a consumed message with its properties copied: its own checker
    decides it (before: the epoch checker rolled it back, or raised for the whole group)."""
    forwarded = {"RMQTX_SINK_ID": "write-123", "RMQTX_EPOCH": "0"}
    prepared = store.prepare(
        [
            Message("Orders", b"forwarded", properties=forwarded),
            Message("Orders", b"half-copied", properties={"RMQTX_SINK_ID": "write-123"}),
        ],
        "order-service",
    )
    checker = CallableChecker(lambda msg: LocalTransactionState.COMMIT)
    summary = CheckBackJob(spark, store, {"order-service": checker}, TIGHT).run_once().summary
    assert summary.committed == 2 and summary.errors == 0
    assert bodies(store) == ["forwarded", "half-copied"]
    assert {p.transaction_id for p in prepared}.isdisjoint(pending(store))


def test_one_broken_pending_message_does_not_hold_back_its_group(
    spark, store: Store, tmp_path: Path
) -> None:
    options = WriterOptions.parse(
        {"path": store.root, "topic": "Orders", "producerGroup": "pipeline"},
        spark.createDataFrame([("x",)], "body string").schema,
    )
    batch = [pa.record_batch({"body": ["good"]})]
    good = held_stage(store, batch, options, "closed-job", 0)
    close(store, "closed-job", 0, 0, [good.transaction_id], "sink")  # the driver died here
    broken_table = tmp_path / "not-a-delta-table"
    broken_table.mkdir()
    held_stage(
        store, [pa.record_batch({"body": ["bad"]})], options, "delta-job", 0, str(broken_table)
    )
    job = CheckBackJob(spark, store, {}, TIGHT)
    result = job.run_once()
    assert bodies(store) == ["good"]
    answers = {r["transaction_id"]: r for r in result.check_batch.collect()}
    assert answers[good.transaction_id]["answer"] == "COMMIT"
    (bad,) = pending(store)
    assert answers[bad]["answer"] == "UNKNOWN" and "not-a-delta-table" in answers[bad]["error"]


def test_the_delta_write_names_the_attempt_that_is_published(
    spark, store: Store, tmp_path: Path
) -> None:
    """Two attempts staged for one Delta-write epoch, the driver died after the Delta write:
    check-back publishes the attempt the Delta commit names, not whichever it meets first."""
    table = str(tmp_path / "orders")
    options = WriterOptions.parse(
        {"path": store.root, "topic": "OrderEvents", "producerGroup": "orders"},
        spark.createDataFrame([("x",)], "body string").schema,
    )
    first = held_stage(store, [pa.record_batch({"body": ["first"]})], options, "job", 0, table)
    second = held_stage(store, [pa.record_batch({"body": ["second"]})], options, "job", 0, table)
    spark.createDataFrame([(1,)], "order_id int").write.format("delta").option(
        "txnAppId", "job"
    ).option("txnVersion", 0).option(
        "userMetadata", delta_commit_marker("job", 0, second.transaction_id)
    ).save(table)
    CheckBackJob(spark, store, {}, TIGHT).run_once()
    assert bodies(store) == ["second"]
    assert first.transaction_id not in pending(store)  # rolled back


def test_a_delta_write_that_raises_after_landing_still_publishes(
    spark, store: Store, tmp_path: Path
) -> None:
    """The Delta commit lands, then a post-commit hook fails and the write raises: the rows are
    in the table, so the messages must be published (not rolled back), and the call succeeds.

    The hook is Delta's symlink manifest, made to fail by a file where its directory goes;
    ``postCommitHook.throwOnError`` turns the hook's failure into the write's error."""
    table = tmp_path / "orders"
    spark.createDataFrame([], "order_id int").write.format("delta").option(
        "delta.compatibility.symlinkFormatManifest.enabled", "true"
    ).save(str(table))
    (table / "_symlink_format_manifest").write_text("not a directory")
    conf = "spark.databricks.delta.postCommitHook.throwOnError"
    spark.conf.set(conf, "true")
    try:
        outcome = publish_with_delta_write(
            spark.createDataFrame([(1,)], "order_id int"),
            str(table),
            spark.createDataFrame([("order 1 created",)], "body string"),
            app_id="orders-job",
            version=0,
            producer_group="orders",
            topic="OrderEvents",
            path=store.root,
        )
    finally:
        spark.conf.unset(conf)
    assert outcome.first and len(outcome.committed) == 1
    assert spark.read.format("delta").load(str(table)).count() == 1
    assert bodies(store) == ["order 1 created"]
    assert pending(store) == set()


def test_a_sink_id_reused_by_a_new_checkpoint_is_an_error(
    spark, store: Store, tmp_path: Path
) -> None:
    source = tmp_path / "in"
    add_input(spark, source, ["a"])
    run_stream(spark, store, source, tmp_path / "ckpt-1", sinkId="orders")
    add_input(spark, source, ["b"])
    with pytest.raises(Exception, match="belongs to .*new sinkId"):
        run_stream(spark, store, tmp_path / "in", tmp_path / "ckpt-2", sinkId="orders")
    assert bodies(store) == ["a"]


def test_the_first_write_to_a_new_path_creates_the_store(spark, tmp_path: Path) -> None:
    root = tmp_path / "new" / "store"
    df = spark.createDataFrame([("a",), ("b",)], "body string")
    df.write.format("rmqtx").mode("append").option("path", str(root)).option(
        "topic", "Orders"
    ).option("producerGroup", "pipeline").save()
    assert bodies(Store.open(root, create=False)) == ["a", "b"]


def test_a_path_holding_other_data_is_refused_before_any_task(spark, tmp_path: Path) -> None:
    (tmp_path / "data.csv").write_text("x\n")
    with pytest.raises(Exception, match="NOT_AN_RMQ_SPARK_STORE"):
        spark.createDataFrame([("a",)], "body string").write.format("rmqtx").mode("append").option(
            "path", str(tmp_path)
        ).option("topic", "Orders").option("producerGroup", "pipeline").save()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data.csv"]
