"""The torture test's worker processes, started (and SIGKILLed, and restarted) by
:mod:`tests.torture.orchestrator`.

Usage: python -m tests.torture.workers RUN_JSON KIND NAME INCARNATION

Kinds:

* ``producer``: a producer service: threads sending transactional messages whose local
  transaction is an SQLite write (:mod:`tests.torture.local_db`), with random outcomes.
* ``writer``: one Spark driver running ``df.writeStream.format("rmqtx")`` from a Delta input
  table fed by the orchestrator (restarted from its checkpoint) and, meanwhile,
  ``df.write.format("rmqtx")`` batches (one ``sinkId`` per input batch, so an operator's retry
  is idempotent) and ``publish_with_delta_write`` batches, in input order; with slow and
  failing task attempts.
* ``compactor``: ``Store.compact()`` of every shard and retention (``maintain``, transactions
  expiring 5 to 30 s after their decision) every few seconds.
* ``finish``: after the chaos: drains the stream and the batches (no faults), then runs
  re-drive + check-back rounds with everything due until nothing is pending. Prints one JSON
  line per round (``QUIESCE {...}``).

Check-back jobs and resumes are the product's own CLI (``python -m rmq_spark.ops.cli``).
"""

from __future__ import annotations

import json
import os
import random
import sys
import threading
import time
import traceback
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

#: Topics and producer groups of the writers.
STREAM_TOPIC, STREAM_GROUP = "TortureStream", "pipeline-stream"
BATCH_TOPIC, BATCH_GROUP = "TortureBatch", "pipeline-batch"
DELTA_TOPIC, DELTA_GROUP, DELTA_APP = "TortureDelta", "pipeline-delta", "torture-delta"
PRODUCER_TOPIC = "TortureOrders"
#: Queues per topic and shard (``[store] queue_nums`` of the settings file the run writes).
QUEUE_NUMS = 4


def read_delta(path: str | Path, columns: list[str] | None = None, version: int | None = None):
    """A Delta table (some columns; the latest version or ``version``) as pyarrow, read
    through DataFusion as the store reads: deltalake's ``to_pyarrow_table`` leaves Arrow
    threads releasing its Python filesystem, which aborts the interpreter at exit now and then
    (SIGABRT, "terminate called")."""
    from deltalake import DeltaTable, QueryBuilder

    from rmq_spark.delta.reads import read_arrow

    chosen = ", ".join(f'"{c}"' for c in columns) if columns else "*"
    query = QueryBuilder().register("t", DeltaTable(str(path), version=version))
    return read_arrow(query.execute(f"SELECT {chosen} FROM t"))


def shard_roots(root: str) -> dict[int, str]:
    """Every shard of the store at ``root`` (local or on an object store), by index: the root
    itself (shard 0) and ``<root>/shards/<k>`` for each ``k`` whose marker exists (a shard is
    complete once its marker, written last, is). Found through fsspec, not the Store."""
    from rmq_spark.delta.storage import filesystem
    from rmq_spark.store.layout import MARKER_FILE, SHARDS_DIR, shard_uri

    fs, path = filesystem(root, {})
    folder = f"{path.rstrip('/')}/{SHARDS_DIR}"
    fs.invalidate_cache(folder)
    try:
        names = [name.rstrip("/").rsplit("/", 1)[-1] for name in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        names = []
    found = sorted(int(n) for n in names if n.isdigit() and int(n) > 0)
    return {0: root} | {
        k: shard_uri(root, k) for k in found if fs.exists(f"{folder}/{k}/{MARKER_FILE}")
    }


def shard_queues(shard: int) -> range:
    """The queue ids of shard ``shard`` of the torture store (``queue_nums`` per shard)."""
    from rmq_spark.model.messages import SHARD_QUEUE_STRIDE

    return range(shard * SHARD_QUEUE_STRIDE, shard * SHARD_QUEUE_STRIDE + QUEUE_NUMS)


def log(*parts: object) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def harness_error(run: dict, text: str) -> None:
    """Record a fault of the harness itself (reported as a violation by the orchestrator)."""
    with open(Path(run["run_dir"]) / "harness_errors.txt", "a") as out:
        out.write(text.replace("\n", " ") + "\n")


def check_imports(run: dict, spark=None) -> None:
    """rmq_spark must come from the repository under test, here and in Spark's workers."""
    import rmq_spark

    paths = {"driver": rmq_spark.__file__}
    if spark is not None:
        import pyarrow as pa

        def where(batches):
            import rmq_spark as r

            for _ in batches:
                yield pa.RecordBatch.from_pydict({"path": [r.__file__]})

        paths["executor"] = spark.range(1).mapInArrow(where, "path string").collect()[0].path
    for side, path in paths.items():
        if not str(Path(path).resolve()).startswith(str(REPO) + os.sep):
            harness_error(run, f"rmq_spark imported from {path} in the {side}, not from {REPO}")
            raise SystemExit(3)
    log("imports", paths)


def log_shard_claims(run: dict) -> None:
    """In a store of several shards, log which shard each producer of this process claims (and
    the publisher leases it takes and loses)."""
    if run.get("shards", 1) > 1:
        import logging

        claims = logging.getLogger("rmq_spark.store.publish_loop")
        claims.setLevel(logging.INFO)
        claims.addHandler(logging.StreamHandler(sys.stdout))


def stopped(run: dict) -> bool:
    return (Path(run["run_dir"]) / "STOP").exists()


# --------------------------------------------------------------------------- producer
def producer(run: dict, name: str, incarnation: int) -> None:
    from rmq_spark import Message, TransactionMQProducer, load_settings
    from tests.torture import local_db

    check_imports(run)
    log_shard_claims(run)
    spec = run["producers"][name]
    db, group = spec["db"], spec["group"]
    settings = load_settings()
    # The listener dispatches to one OrderListener per thread (SQLite connections are
    # per thread); the producer is shared by the threads, as a service would share it.
    listeners = threading.local()

    class Dispatch(local_db.TransactionListener):
        def execute_local_transaction(self, msg, arg):
            return listeners.value.execute_local_transaction(msg, arg)

        def check_local_transaction(self, msg):
            return local_db.check_order(msg)

    counts = {"sent": 0, "errors": 0}

    def sender(thread: int) -> None:
        rng = random.Random(f"{run['seed']}/{name}/{incarnation}/{thread}")
        conn = local_db.connect(db)
        listeners.value = local_db.OrderListener(db)
        plans, weights = zip(*local_db.PLANS.items(), strict=True)
        n = 0
        while not stopped(run):
            key = f"{name}.{incarnation}.{thread}.{n}"
            n += 1
            plan = rng.choices(plans, weights)[0]
            # Some checkers stall: a few times (absorbed by the check max), or past it (the
            # transaction is discarded and must be re-driven by a resume).
            stall = rng.choices([0, 1, 2, run["check_max"], run["check_max"] + 1], [8, 2, 2, 1, 1])[
                0
            ]
            listeners.value.slow_seconds = rng.uniform(0.5, 2 * run["transaction_timeout"])
            local_db.record_intent(conn, key, plan, stall)
            body = json.dumps({"key": key, "plan": plan, "pad": "x" * rng.randint(0, 300)})
            msg = Message(
                PRODUCER_TOPIC,
                body,
                tags=plan,
                keys=key,
                properties={local_db.PROPERTY_DB: db},
            )
            try:
                result = prod.send_message_in_transaction(msg, arg=(key, plan))
            except Exception as exc:
                counts["errors"] += 1
                local_db.mark(conn, key, "send_failed")
                log("send failed", key, f"{type(exc).__name__}: {exc}"[:300])
                time.sleep(0.5)
                continue
            counts["sent"] += 1
            if plan == "UNKNOWN_AFTER_LATE_END":

                def late(result=result) -> None:
                    time.sleep(rng.uniform(0.5, 3 * run["transaction_timeout"]))
                    try:
                        outcome = prod.end_transaction(result, local_db.COMMIT)
                        log("late end", result.transaction_id, outcome.status.value)
                    except Exception as exc:
                        log("late end failed", f"{type(exc).__name__}: {exc}"[:300])

                threading.Thread(target=late, daemon=True).start()
            time.sleep(rng.uniform(0.0, run["producer_pause"]))

    with TransactionMQProducer(group, Dispatch(), path=run["root"], settings=settings) as prod:
        threads = [
            threading.Thread(target=sender, args=(t,), daemon=True)
            for t in range(run["producer_threads"])
        ]
        for t in threads:
            t.start()
        last = time.monotonic()
        while any(t.is_alive() for t in threads):
            time.sleep(1)
            if time.monotonic() - last > 10:
                log("progress", counts)
                last = time.monotonic()
        log("stopped", counts)


#: The careless or hostile producer's topic and groups: one with no checker, one whose
#: checker's table does not exist (see :func:`hostile`).
HOSTILE_TOPIC = "TortureHostile"
UNROUTED_GROUP, BROKEN_GROUP = "hostile-unrouted", "hostile-broken-table"
HOSTILE_GROUPS = (UNROUTED_GROUP, BROKEN_GROUP)
IMMUNITY = "CHECK_IMMUNITY_TIME_IN_SECONDS"


def _refused_messages() -> list:
    """Messages validation must refuse: text with no UTF-8 form, an immunity that is not plain
    seconds, keys and properties past the property block, an empty body."""
    from rmq_spark import Message

    immunity = IMMUNITY
    return [
        Message(HOSTILE_TOPIC, b"x", keys="k\udcff"),
        Message(HOSTILE_TOPIC, b"x", tags="t\udcff"),
        Message(HOSTILE_TOPIC, "body\udcff"),
        Message(HOSTILE_TOPIC, b"x", properties={"origin": "file-\udcff"}),
        Message(HOSTILE_TOPIC, b"x", properties={immunity: "1_0"}),
        Message(HOSTILE_TOPIC, b"x", properties={immunity: "\uff11\uff10"}),
        Message(HOSTILE_TOPIC, b"x", keys="k" * 40_000),
        Message(HOSTILE_TOPIC, b"x", properties={"big": "v" * 1_000_000}),
        Message(HOSTILE_TOPIC, b""),
    ]


def hostile(run: dict, name: str, incarnation: int) -> None:
    """A careless or hostile producer beside the honest ones. Each round it sends messages that
    validation must refuse (one accepted is a harness error), leaves transactions UNKNOWN in a
    group with no checker and in one whose checker's table is missing, and stages half rows
    around validation, as a failed task attempt of an older sink or a hand-written row would:
    a CHECK_IMMUNITY_TIME_IN_SECONDS that is no number. None of it may stop a check-back round
    or hold back an honest group, and none of it may ever be visible."""
    import pyarrow as pa

    from rmq_spark import (
        InvalidMessageError,
        LocalTransactionState,
        Message,
        TransactionListener,
        TransactionMQProducer,
    )
    from rmq_spark.model.messages import new_id, shard_transaction_id
    from rmq_spark.model.schema import HALF_SCHEMA

    check_imports(run)
    log_shard_claims(run)
    rng = random.Random(f"{run['seed']}/{name}/{incarnation}")
    refused = _refused_messages()

    class Unknown(TransactionListener):
        def execute_local_transaction(self, msg, arg):
            return LocalTransactionState.UNKNOWN

        def check_local_transaction(self, msg):
            return LocalTransactionState.UNKNOWN

    with (
        TransactionMQProducer(UNROUTED_GROUP, Unknown(), path=run["root"]) as unrouted,
        TransactionMQProducer(BROKEN_GROUP, Unknown(), path=run["root"]) as broken,
    ):
        shards, n = broken.store.shards(), 0
        while not stopped(run):
            for bad in rng.sample(refused, 3):
                try:
                    broken.send_message_in_transaction(bad)
                except InvalidMessageError:
                    continue
                harness_error(
                    run, f"{name}: a message validation must refuse was sent: {bad!r:.200}"
                )
            producer = rng.choice([unrouted, broken])
            producer.send_message_in_transaction(Message(HOSTILE_TOPIC, f"hostile-{n}"))
            # Into every shard in turn, as that shard's own transaction.
            store, now = shards[n % len(shards)], datetime.now(UTC)
            row = {f.name: None for f in HALF_SCHEMA} | {
                "transaction_id": shard_transaction_id(store.shard),
                "msg_id": new_id(),
                "producer_group": BROKEN_GROUP,
                "topic": HOSTILE_TOPIC,
                "queue_id": store.queue_base,
                "body": f"garbage-immunity-{n}".encode(),
                "properties": [
                    (
                        "CHECK_IMMUNITY_TIME_IN_SECONDS",
                        rng.choice(["abc", "1_0", "NaN", "-5", "inf"]),
                    )
                ],
                "born_timestamp": now,
                "store_timestamp": now,
            }
            store.append("half", pa.Table.from_pylist([row], schema=HALF_SCHEMA))
            n += 1
            time.sleep(rng.uniform(1.0, 3.0))
        log("stopped after", n, "round(s)")


# --------------------------------------------------------------------------- Spark writers
def spark_session(run: dict, app: str):
    from rmq_spark import get_spark

    spark = get_spark(
        app,
        extra_conf={
            # Up to 2 attempts per task: a failed attempt is retried, as on a cluster.
            "spark.master": "local[2,2]",
            "spark.driver.memory": "1g",
            "spark.sql.shuffle.partitions": "2",
            "spark.default.parallelism": "2",
            "spark.ui.enabled": "false",
        },
    )
    check_imports(run, spark)
    return spark


def chaos(run: dict, tag: str, enabled: bool):
    """A mapInArrow function: some task attempts are slow, some first attempts fail."""
    import pyarrow as pa  # noqa: F401 - used on the executors

    seed, slow, very_slow, fail = (
        run["seed"],
        run["slow_task_probability"],
        run["very_slow_task_probability"],
        run["failing_task_probability"],
    )

    def apply(batches):
        from pyspark import TaskContext

        context = TaskContext.get()
        batch_id = context.getLocalProperty("streaming.sql.batchId") or ""
        rng = random.Random(
            f"{seed}/{tag}/{batch_id}/{context.stageId()}/{context.partitionId()}/"
            f"{context.attemptNumber()}"
        )
        rows = list(batches)
        if enabled:
            draw = rng.random()
            if draw < very_slow:
                time.sleep(rng.uniform(30, 90))
            elif draw < very_slow + slow:
                time.sleep(rng.uniform(2, 8))
            if context.attemptNumber() == 0 and rng.random() < fail:
                raise RuntimeError("torture: this task attempt fails (Spark retries it)")
        yield from rows

    return apply


def _stream_query(run: dict, spark, drain: bool, incarnation: int):
    source = (
        spark.readStream.format("delta")
        .option("maxFilesPerTrigger", 3)
        .load(run["stream_input"])
        .select("key", "body")
    )
    rows = source.repartition(2).mapInArrow(
        chaos(run, f"stream/{incarnation}", not drain), source.schema
    )
    writer = (
        rows.selectExpr("body", "key AS keys")
        .writeStream.format("rmqtx")
        .option("path", run["root"])
        .option("topic", STREAM_TOPIC)
        .option("producerGroup", STREAM_GROUP)
        .option("checkpointLocation", run["stream_checkpoint"])
        .queryName(f"torture_stream_{incarnation}")
    )
    writer = (
        writer.trigger(availableNow=True) if drain else writer.trigger(processingTime="2 seconds")
    )
    return writer.start()


def writer(run: dict, name: str, incarnation: int) -> None:
    """The pipeline driver: a streaming query and, meanwhile, the batch writes (one JVM for
    both: a 2-core machine cannot start many). The batches run on the main thread: a Python
    data source is registered with the session, and writes from another Python thread do
    not find it (DATA_SOURCE_NOT_FOUND)."""
    spark = spark_session(run, "torture-writer")
    query = _stream_query(run, spark, False, incarnation)
    last = [None]

    def watch_stream() -> None:
        if not query.isActive:
            query.awaitTermination()  # raises the query's error: the orchestrator restarts us
            raise RuntimeError("the streaming query stopped")
        progress = query.lastProgress
        if progress and progress.get("batchId") != last[0]:
            last[0] = progress.get("batchId")
            log("micro-batch", last[0], "rows", progress.get("numInputRows"))

    run_batches(run, spark, False, incarnation, watch_stream)
    while True:
        watch_stream()
        time.sleep(2)


def drain_stream(run: dict, spark) -> None:
    for attempt in range(6):
        query = _stream_query(run, spark, True, 1000 + attempt)
        try:
            query.awaitTermination()
            log("stream drained")
            return
        except Exception as exc:
            log("stream drain failed (retrying):", f"{type(exc).__name__}: {exc}"[:500])
            time.sleep(2)
    raise RuntimeError("the stream could not be drained in 6 attempts")


class Progress:
    """Which input batches a writer finished (an operator's run log; may lag a crash)."""

    def __init__(self, path: str) -> None:
        self.path = Path(path)

    def done(self) -> set[str]:
        return set(self.path.read_text().split("\n")) if self.path.exists() else set()

    def add(self, item: str) -> None:
        with open(self.path, "a") as out:
            out.write(item + "\n")
            out.flush()
            os.fsync(out.fileno())


def _batch_inputs(run: dict, kind: str) -> list[Path]:
    return sorted(Path(run["batch_inputs"]).glob(f"{kind}-*.parquet"))


def write_batch(run: dict, spark, path: Path, chaos_on: bool, incarnation: int) -> None:
    source = spark.read.parquet(str(path)).select("key", "body")
    rows = source.repartition(2).mapInArrow(
        chaos(run, f"batch/{path.stem}/{incarnation}", chaos_on), source.schema
    )
    (
        rows.selectExpr("body", "key AS keys")
        .write.format("rmqtx")
        .mode("append")
        .option("path", run["root"])
        .option("topic", BATCH_TOPIC)
        .option("producerGroup", BATCH_GROUP)
        .option("sinkId", f"torture-{path.stem}")  # an operator's retry publishes nothing more
        .save()
    )


def write_delta(run: dict, spark, path: Path) -> None:
    from rmq_spark import publish_with_delta_write

    version = int(path.stem.split("-")[1])
    source = spark.read.parquet(str(path))
    publish_with_delta_write(
        source.select("key", "order_id"),
        run["business_table"],
        source.selectExpr("body", "key AS keys"),
        app_id=DELTA_APP,
        version=version,
        producer_group=DELTA_GROUP,
        topic=DELTA_TOPIC,
        path=run["root"],
    )


def run_batches(run: dict, spark, drain: bool, incarnation: int, idle=lambda: None) -> None:
    """Write every input batch not done yet, in order (Delta versions must not be skipped);
    a failed batch is retried with the same sink id / version, as an operator would."""
    progress = Progress(run["batch_progress"])
    while True:
        idle()
        done = progress.done()
        todo = [
            (kind, p)
            for p in _batch_inputs(run, "batch")
            for kind in ("sink", "delta")
            if f"{kind} {p.stem}" not in done
        ]
        if not todo:
            if drain or stopped(run):
                return
            time.sleep(0.5)
            continue
        kind, path = todo[0]
        delta_path = path.with_name(path.name.replace("batch-", "delta-"))
        for attempt in range(5):
            started = time.monotonic()
            try:
                if kind == "sink":
                    write_batch(run, spark, path, not drain, incarnation)
                else:
                    write_delta(run, spark, delta_path)
                break
            except Exception as exc:
                log(kind, path.stem, "failed (retrying):", f"{type(exc).__name__}: {exc}"[:800])
                time.sleep(1 + attempt)
        else:
            raise RuntimeError(f"{kind} {path.stem} failed 5 times")
        progress.add(f"{kind} {path.stem}")
        log(kind, path.stem, f"done in {time.monotonic() - started:.1f} s")
        if kind == "sink" and not drain:
            hostile_sink(run, spark, path.stem)


#: What a hostile sink's last row carries (SQL), each a row the sink must refuse.
_HOSTILE_ROWS = {
    "not UTF-8": "CAST(X'FF' AS STRING) AS keys",
    "null property": "map('origin', CAST(NULL AS STRING)) AS properties",
    "immunity": "map('CHECK_IMMUNITY_TIME_IN_SECONDS', '1_0') AS properties",
    "huge keys": "repeat('k', 40000) AS keys",
}


def hostile_sink(run: dict, spark, tag: str) -> None:
    """A sink write whose last row the sink must refuse, the good rows in another task: the
    write must fail loudly, and what the good task staged is rolled back (never visible; the
    invariants check both, and that nothing of it stays pending)."""
    kind = random.Random(f"{run['seed']}/hostile-sink/{tag}").choice(sorted(_HOSTILE_ROWS))
    column = _HOSTILE_ROWS[kind].rsplit(" AS ", 1)[1]
    good = "CAST(NULL AS STRING)" if column == "keys" else "CAST(NULL AS MAP<STRING, STRING>)"
    bad = _HOSTILE_ROWS[kind].rsplit(" AS ", 1)[0]
    rows = spark.sql(
        f"SELECT CAST(id AS STRING) AS body, CASE WHEN id = 39 THEN {bad} ELSE {good} END "
        f"AS {column} FROM range(40)"
    ).repartition(2)
    try:
        (
            rows.write.format("rmqtx")
            .mode("append")
            .option("path", run["root"])
            .option("topic", HOSTILE_TOPIC)
            .option("producerGroup", "hostile-sink")
            # Killed before its abort rolled the good task back, the epoch waits for its lease
            # (10 min by default) before check-back abandons it: longer than the finisher waits.
            .option("leaseTimeout", "30s")
            .save()
        )
    except Exception as exc:
        log("hostile sink", kind, "refused:", str(exc).splitlines()[0][:200])
        return
    harness_error(run, f"a sink write with a row of {kind} succeeded")


# --------------------------------------------------------------------------- compactor
def compactor(run: dict, name: str, incarnation: int) -> None:
    """Compaction and retention of every shard: decided, published transactions leave
    ``half``, ``op`` and ``discard`` seconds after their decision (while re-drives, check-back
    jobs, late decisions and epoch replays go on); CommitLog messages are kept, since the
    invariants count them."""
    from rmq_spark import Store
    from rmq_spark.model.config import RetentionSettings
    from rmq_spark.store.retention import maintain

    check_imports(run)
    rng = random.Random(f"{run['seed']}/{name}/{incarnation}")
    store = Store.open(run["root"], create=False)
    while not stopped(run):
        for shard in store.shards(refresh=True):
            started = time.monotonic()
            removed = shard.compact()
            log("compacted shard", shard.shard, removed, f"{time.monotonic() - started:.1f} s")
        # CommitLog files removed are deleted within the run, racing kills, stalls, RESTOREs.
        retention = RetentionSettings(
            file_reserved_time=10 * 365 * 86400.0,
            transaction_reserved_time=rng.uniform(5, 30),
            deleted_file_retention=rng.uniform(20, 90),
        )
        summary = maintain(store, retention)
        log("maintained", summary.format().replace("\n", ";"))
        time.sleep(rng.uniform(2, 6))


# --------------------------------------------------------------------------- finish
def _tuples(store, name: str, columns: list[str]) -> list[tuple]:
    """The rows of table ``name`` of one shard's store, as tuples of ``columns``."""
    return list(zip(*store.read(name, columns).to_pydict().values(), strict=True))


def pending_transactions(store) -> set[str]:
    """Pending transactions of the honest groups (the hostile ones never all end), in every
    shard (a transaction is decided by an op row of its own shard)."""
    pending = set()
    for shard in store.shards(refresh=True):
        half = _tuples(shard, "half", ["transaction_id", "producer_group"])
        decided = {t for (t,) in _tuples(shard, "op", ["transaction_id"])}
        pending |= {t for t, g in half if g not in HOSTILE_GROUPS and t not in decided}
    return pending


def undriven_discards(store) -> list[str]:
    """Transactions of honest groups discarded at the check max and not re-driven yet, in
    every shard (a hostile group's are left discarded: re-driven, they would only come back)."""
    columns = ["transaction_id", "producer_group", "redriven_transaction_id"]
    return sorted(
        {
            t
            for shard in store.shards(refresh=True)
            for t, g, r in _tuples(shard, "discard", columns)
            if r is None and g not in HOSTILE_GROUPS
        }
    )


def finish(run: dict, name: str, incarnation: int) -> None:
    import logging

    from rmq_spark import Store, load_settings
    from rmq_spark.checkback.checkers import checkers_from_config
    from rmq_spark.checkback.discards import redrive
    from rmq_spark.checkback.job import CheckBackJob
    from rmq_spark.model.config import TransactionSettings

    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("rmq_spark").setLevel(logging.INFO)
    spark = spark_session(run, "torture-finish")
    drain_stream(run, spark)
    run_batches(run, spark, True, incarnation)
    log("writers drained")

    settings = load_settings()
    store = Store.open(run["root"], settings=settings, create=False)
    # Everything is due at once: no timeout, no interval; the same check max as the chaos.
    due_now = TransactionSettings(
        transaction_timeout=0.0,
        transaction_check_interval=0.0,
        transaction_check_max=settings.transaction.transaction_check_max,
        max_check_age=30 * 86400.0,
    )
    job = CheckBackJob(spark, store, checkers_from_config(settings.checkers), due_now)
    quiet = 0
    for round_ in range(run["quiesce_rounds"]):
        try:
            # Honest groups' discards, and any a killed resume claimed and did not stage.
            redriven = redrive(store, undriven_discards(store))
        except Exception as exc:
            log("resume failed:", f"{type(exc).__name__}: {exc}"[:500])
            redriven = ["failed"]
        try:
            summary = job.run_once().summary
            summary_row = {
                k: v
                for k, v in summary.__dict__.items()
                if isinstance(v, int) and not isinstance(v, bool)
            }
        except Exception as exc:
            summary_row = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        pending = pending_transactions(store)
        undriven = len(undriven_discards(store))
        print(
            "QUIESCE "
            + json.dumps(
                {
                    "round": round_,
                    "redriven": len(redriven),
                    "summary": summary_row,
                    "pending": len(pending),
                    "undriven_discards": undriven,
                }
            ),
            flush=True,
        )
        # Quiescent: nothing pending, nothing left to re-drive, and a round that changed
        # nothing after that (so late publishes have landed).
        quiet = quiet + 1 if not pending and not undriven and not redriven else 0
        if quiet >= 2:
            log("quiescent after", round_ + 1, "round(s)")
            return
    log("NOT quiescent after", run["quiesce_rounds"], "rounds")
    raise SystemExit(4)


KINDS = {
    "producer": producer,
    "hostile": hostile,
    "writer": writer,
    "compactor": compactor,
    "finish": finish,
}


def main(argv: list[str]) -> None:
    run_json, kind, name, incarnation = argv
    run = json.loads(Path(run_json).read_text())
    log("start", kind, name, incarnation, "pid", os.getpid())
    try:
        KINDS[kind](run, name, int(incarnation))
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.stdout.flush()
        raise SystemExit(1) from None
    log("exit", kind, name)


if __name__ == "__main__":
    main(sys.argv[1:])
