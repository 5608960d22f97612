"""The torture test's orchestrator: starts the workers, feeds the inputs, kills and restarts
processes at random (seeded) moments, samples check-back state, then drives the store to
quiescence and checks the invariants (:mod:`tests.torture.invariants`).

Run it with ``python -m tests.torture.run --seed S --minutes M`` or ``make torture``.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests import minio
from tests.lifetime import die_with_parent
from tests.torture import local_db
from tests.torture.invariants import Violation, check_invariants
from tests.torture.report import format_report
from tests.torture.workers import (
    BATCH_TOPIC,
    BROKEN_GROUP,
    DELTA_TOPIC,
    PRODUCER_TOPIC,
    QUEUE_NUMS,
    STREAM_TOPIC,
    read_delta,
    shard_queues,
    shard_roots,
)

REPO = Path(__file__).resolve().parents[2]
PYTHON = sys.executable
TOPICS = (PRODUCER_TOPIC, STREAM_TOPIC, BATCH_TOPIC, DELTA_TOPIC)


@dataclass
class Options:
    seed: int
    chaos_seconds: float
    root: Path
    #: Mean seconds between two SIGKILLs by the orchestrator.
    kill_every: float = 12.0
    producers: int = 2
    producer_threads: int = 2
    #: Shards of the store (``[store] shards`` of the settings file every process reads): each
    #: producer process claims one while there are enough; the other writers use shard 0.
    shards: int = 1
    check_back_jobs: int = 2
    check_max: int = 3
    transaction_timeout: float = 2.0
    check_interval: float = 5.0  # the CLI refuses shorter intervals
    #: Run the compactor process (Store.compact() every few seconds).
    compactor: bool = True
    #: Longest the finisher (drain + quiescence) may take per attempt.
    finish_timeout: float = 1800.0
    #: Seconds a Spark worker is left alone after its start-up before it may be killed.
    jvm_grace: float = 30.0
    #: Run the careless or hostile producer (tests.torture.workers.hostile) beside the others.
    hostile: bool = True
    #: Mean seconds between two acts of another Delta writer or a stall (see meddle); 0: none.
    meddle_every: float = 8.0
    #: Print the timeline (starts, kills, ...) as it happens.
    verbose: bool = True
    #: A store on ``s3://`` (MinIO behind tests.latency_proxy) instead of local disk: the
    #: storage options of the server, given to every process in its environment.
    storage_options: dict = field(default_factory=dict)
    #: ``[store] intake`` (None: the default, on; rmq_spark.store.intake).
    intake: bool | None = None


@dataclass
class Worker:
    """One long-running role, restarted after every death until the chaos ends."""

    name: str
    kind: str  # producer, writer, check-back, compactor
    jvm: bool
    incarnation: int = 0
    proc: subprocess.Popen | None = None
    log: object = None
    restart_at: float | None = 0.0
    failpoint: str | None = None
    started_at: float = 0.0
    #: Size of its log when this incarnation started (readiness is looked for after it).
    log_offset: int = 0
    ready: bool = False
    ready_at: float = 0.0

    #: A line that says the worker is up and working: a check-back job has finished its
    #: first round (the first Spark jobs of a JVM take a minute or more on a loaded 2-core
    #: machine), the others have started (their JVM is up).
    @property
    def ready_marker(self) -> bytes:
        return (
            b"rmq_spark.checkback.job: check-back run "
            if self.kind == "check-back"
            else b" imports "
        )


@dataclass
class Stats:
    started: Counter = field(default_factory=Counter)
    kills: Counter = field(default_factory=Counter)
    failpoint_kills: Counter = field(default_factory=Counter)
    failpoints_armed: Counter = field(default_factory=Counter)
    exits: Counter = field(default_factory=Counter)
    unexpected_exits: list = field(default_factory=list)
    resumes: int = 0
    resumes_concurrent: int = 0
    samples: int = 0
    stream_files: int = 0
    batch_inputs: int = 0
    quiesce_rounds: list = field(default_factory=list)
    finish_attempts: int = 0
    finish_ok: bool = False
    max_check_count: int = 0
    timeline: list = field(default_factory=list)
    warm_up: float = 0.0
    #: Acts of another Delta writer on the store's tables, and stalls, by kind.
    meddling: Counter = field(default_factory=Counter)
    #: Published messages another Delta writer removed from the CommitLog (RESTORE, DELETE).
    messages_removed: int = 0


def next_offsets(commitlog, shard: int) -> dict[tuple[str, int], int]:
    """The next offset of each queue of shard ``shard`` that ever held a message, from the
    store's CommitLog (``commitlog``, a DeltaTable): ``{(topic, queue_id): offset}``."""
    from rmq_spark.store.queues import queue_app_id

    return {
        (topic, q): offset
        for topic in TOPICS
        for q in shard_queues(shard)
        if (offset := commitlog.transaction_version(queue_app_id(topic, q))) is not None
    }


def session_processes(sid: int) -> list[tuple[int, int]]:
    """(pid, process group) of every live process in session ``sid``."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[3]) == sid:
            found.append((int(entry), int(fields[2])))
    return found


def kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL every process group of the worker's session (driver, JVM, PySpark daemon and
    its workers: the daemon runs in a group of its own), as when a machine is lost."""
    groups = {pgid for _, pgid in session_processes(proc.pid)} | {proc.pid}
    for pgid in groups:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


class Orchestrator:
    def __init__(self, options: Options) -> None:
        self.o = options
        self.rng = random.Random(options.seed)
        #: Which shard another Delta writer meddles with (its own sequence: a run of one shard
        #: draws what it drew before there were shards).
        self.shard_rng = random.Random(f"{options.seed}/shards")
        self.root = options.root
        self.run_dir = self.root
        self.store = (
            f"s3://{minio.BUCKET}/torture-{options.seed}"
            if options.storage_options
            else str(self.root / "store")
        )
        self.logs = self.root / "logs"
        self.stats = Stats()
        self.violations: list[Violation] = []
        self.t0 = time.monotonic()
        self.workers: list[Worker] = []
        self.transient: list[tuple[str, subprocess.Popen, object]] = []
        self.check_seen: dict[str, tuple[int, object]] = {}
        #: Transactions whose decision a RESTORE of op removed (see forget_check_counts).
        self.undecided_by_restore: set[str] = set()
        self.queue_seen: dict[str, int] = {}
        self.stream_seq = 0
        self.batch_seq = 0
        self.order_id = 0
        #: Stalled (SIGSTOPped) workers: name -> (their process, when to resume them).
        self.stalled: dict[str, tuple[subprocess.Popen, float]] = {}

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        from rmq_spark import Store
        from rmq_spark.model.config import CONF_ENV, load_settings

        for d in (self.logs, self.root / "inputs" / "batches", self.root / "dbs"):
            d.mkdir(parents=True, exist_ok=True)
        o = self.o
        producers = {}
        for i in range(o.producers):
            db = self.root / "dbs" / f"producer-{i}.sqlite"
            local_db.create(db)
            producers[f"producer-{i}"] = {"db": str(db), "group": f"svc-{i % 2}"}
        self.conf = self.root / "rmq-spark.toml"
        checker = 'kind = "callable"\nfunction = "tests.torture.local_db:check_order"\n'
        checkers = "".join(f"\n[checkers.svc-{g}]\n{checker}" for g in range(min(2, o.producers)))
        if o.hostile:  # its other group has no checker at all
            missing = self.root / "no-such-table"
            checkers += (
                f'\n[checkers.{BROKEN_GROUP}]\nkind = "table"\ntable = "{missing}"\n'
                'column = "key"\n'
            )
        # Check-back opens a business table off the store's filesystem only when it is listed.
        business = f'delta_tables = ["{self.root / "business"}"]' if o.storage_options else ""
        self.conf.write_text(
            f"""# written by the torture test (seed {o.seed})
[store]
path = "{self.store}"
queue_nums = {QUEUE_NUMS}
shards = {o.shards}
{business}
{"" if o.intake is None else f"intake = {str(o.intake).lower()}"}

[transaction]
transaction_timeout = "{o.transaction_timeout}s"
transaction_check_interval = "{o.check_interval}s"
transaction_check_max = {o.check_max}
max_check_age = "72h"

[spark]
"spark.master" = "local[1]"
"spark.driver.memory" = "1g"
"spark.sql.shuffle.partitions" = "2"
"spark.default.parallelism" = "2"
"spark.ui.enabled" = "false"

[logging]
level = "INFO"
{checkers}"""
        )
        self.env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(
                [str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
            CONF_ENV: str(self.conf),
            "PYTHONUNBUFFERED": "1",
            **o.storage_options,
        }
        self.env.pop("RMQ_SPARK_FAILPOINT", None)
        self.env.setdefault("RMQ_SPARK_JARS", str(REPO / ".jars"))
        os.environ[CONF_ENV] = str(self.conf)
        Store.open(self.store, settings=load_settings(self.conf))  # makes the shards
        #: Every shard's root, by index.
        self.shards = shard_roots(self.store)
        if len(self.shards) != o.shards:
            raise RuntimeError(
                f"the store at {self.store} has shards {sorted(self.shards)}, not {o.shards}"
            )
        self.run = {
            "seed": o.seed,
            "root": self.store,
            "run_dir": str(self.run_dir),
            "producers": producers,
            "shards": o.shards,
            "producer_threads": o.producer_threads,
            "producer_pause": 1.5,
            "check_max": o.check_max,
            "transaction_timeout": o.transaction_timeout,
            "stream_input": str(self.root / "inputs" / "stream"),
            "stream_checkpoint": str(self.root / "checkpoints" / "stream"),
            "batch_inputs": str(self.root / "inputs" / "batches"),
            "batch_progress": str(self.root / "batch-progress.txt"),
            "business_table": str(self.root / "business"),
            "foreign_removed": str(self.root / "foreign-removed.jsonl"),
            "foreign_undecided": str(self.root / "foreign-undecided.jsonl"),
            "slow_task_probability": 0.15,
            "very_slow_task_probability": 0.04,
            "failing_task_probability": 0.12,
            "quiesce_rounds": 40,
        }
        self.run_json = self.root / "run.json"
        self.run_json.write_text(json.dumps(self.run, indent=2))
        self.feed_stream()  # the stream's source table must exist before the query starts
        for name in producers:
            self.workers.append(Worker(name, "producer", jvm=False))
        self.workers.append(Worker("writer", "writer", jvm=True))
        for i in range(o.check_back_jobs):
            self.workers.append(Worker(f"check-back-{i}", "check-back", jvm=True))
        if o.compactor:
            self.workers.append(Worker("compactor", "compactor", jvm=False))
        if o.hostile:
            self.workers.append(Worker("hostile", "hostile", jvm=False))

    # ------------------------------------------------------------------ inputs
    def feed_stream(self) -> None:
        from deltalake import write_deltalake

        n = self.rng.randint(5, 40)
        keys = [f"s{self.stream_seq + i:06d}" for i in range(n)]
        self.stream_seq += n
        bodies = [f"{k}:" + "y" * self.rng.randint(1, 400) for k in keys]
        write_deltalake(
            self.run["stream_input"], pa.table({"key": keys, "body": bodies}), mode="append"
        )
        self.stats.stream_files += 1

    def pending_batches(self) -> int:
        done = Path(self.run["batch_progress"])
        finished = set(done.read_text().split("\n")) if done.exists() else set()
        return sum(
            1
            for j in range(self.batch_seq)
            if f"delta batch-{j:05d}" not in finished or f"sink batch-{j:05d}" not in finished
        )

    def feed_batch(self) -> None:
        """One sink batch and one ``publish_with_delta_write`` batch (the batch file last:
        it tells the writer both are there)."""
        j = self.batch_seq
        folder = Path(self.run["batch_inputs"])
        n = self.rng.randint(3, 30)
        keys = [f"d{j:05d}-{i:03d}" for i in range(n)]
        delta = pa.table(
            {
                "key": keys,
                "body": [f"{k}:" + "z" * self.rng.randint(1, 200) for k in keys],
                "order_id": pa.array(range(self.order_id, self.order_id + n), pa.int64()),
            }
        )
        self.order_id += n
        n = self.rng.randint(5, 60)
        keys = [f"b{j:05d}-{i:03d}" for i in range(n)]
        sink = pa.table(
            {"key": keys, "body": [f"{k}:" + "w" * self.rng.randint(1, 300) for k in keys]}
        )
        for name, table in ((f"delta-{j:05d}", delta), (f"batch-{j:05d}", sink)):
            tmp = folder / f".{name}.tmp"
            pq.write_table(table, tmp)
            os.rename(tmp, folder / f"{name}.parquet")
        self.batch_seq += 1
        self.stats.batch_inputs += 1

    # ------------------------------------------------------------------ processes
    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def note(self, text: str) -> None:
        line = f"{self.elapsed():7.1f}s {text}"
        self.stats.timeline.append(line)
        if self.o.verbose:
            print(line, flush=True)
        with open(self.logs / "orchestrator.log", "a") as out:
            out.write(line + "\n")

    def argv(self, w: Worker) -> list[str]:
        if w.kind == "check-back":
            return [
                PYTHON, "-m", "rmq_spark.ops.cli", "--path", self.store, "check",
                "--interval", f"{self.o.check_interval}s",
            ]  # fmt: skip
        return [PYTHON, "-m", "tests.torture.workers", str(self.run_json), w.kind, w.name,
                str(w.incarnation)]  # fmt: skip

    def spawn(self, name: str, argv: list[str], failpoint: str | None = None):
        env = dict(self.env)
        if failpoint:
            env["RMQ_SPARK_FAILPOINT"] = failpoint
        log = open(self.logs / f"{name}.log", "ab")
        log.write(f"\n===== {' '.join(argv)} failpoint={failpoint}\n".encode())
        log.flush()
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent,
        )
        return proc, log

    def start(self, w: Worker) -> None:
        w.incarnation += 1
        w.failpoint = None
        if w.kind == "writer":
            draw = self.rng.random()
            if draw < 0.2:
                w.failpoint = "sink.staged:raise"  # first attempts fail after staging
            elif draw < 0.45:
                w.failpoint = self.rng.choice(
                    ["sink.staged", "sink.closed", "sink.published"]
                    + ["delta.staged", "delta.written", "delta.closed"]
                )
        elif w.kind == "producer" and self.rng.random() < 0.25:
            # Dies with decisions in their objects only: check-back records them. With intake,
            # or with sends in intake objects only (before or while landing them), or landed and
            # not deleted: check-back lands them (once); or (local disk) with a send's temp file
            # written, not renamed: that send was never acknowledged.
            intake = self.o.intake is not False
            landing = ["intake.landing", "intake.listing", "intake.landed"]
            points = ["decision.claimed"] + (landing if intake else [])
            points += ["intake.written"] if intake and not self.o.storage_options else []
            w.failpoint = self.rng.choice(points)
        if w.failpoint:
            self.stats.failpoints_armed[w.failpoint] += 1
        log_path = self.logs / f"{w.name}.log"
        w.log_offset = log_path.stat().st_size if log_path.exists() else 0
        w.ready = False
        w.proc, w.log = self.spawn(f"{w.name}", self.argv(w), w.failpoint)
        w.started_at = self.elapsed()
        w.restart_at = None
        self.stats.started[w.kind] += 1
        self.note(f"start {w.name}#{w.incarnation} pid {w.proc.pid} failpoint={w.failpoint}")

    def reap(self, chaos: bool) -> None:
        for w in self.workers:
            if w.proc is None or w.proc.poll() is None:
                continue
            rc = w.proc.returncode
            w.log.close()
            self.stats.exits[f"{w.kind} rc={rc}"] += 1
            if rc == -signal.SIGKILL and w.failpoint and ":" not in w.failpoint:
                self.stats.failpoint_kills[w.failpoint] += 1
                self.note(f"{w.name}#{w.incarnation} killed itself at failpoint {w.failpoint}")
            elif rc == 3:
                self.violations.append(
                    Violation("harness", f"{w.name} imported rmq_spark from the wrong place")
                )
            else:
                tail = self.tail(w.name)
                self.stats.unexpected_exits.append((w.name, w.incarnation, rc, tail))
                self.note(f"{w.name}#{w.incarnation} exited rc={rc}: {tail[-300:]}")
            w.proc = None
            if chaos:
                w.restart_at = self.elapsed() + self.rng.uniform(0.5, 3.0)

    def tail(self, name: str, lines: int = 6) -> str:
        try:
            text = (self.logs / f"{name}.log").read_bytes().decode(errors="replace")
        except OSError:
            return ""
        wanted = [
            line
            for line in text.splitlines()
            if "Error" in line or "Exception" in line or "error" in line or "failed" in line
        ]
        return " | ".join((wanted or text.splitlines())[-lines:])[-1500:]

    def is_ready(self, w: Worker) -> bool:
        """Whether the worker's incarnation is up: a SIGKILL during a JVM's start-up (a minute
        on a loaded 2-core machine) would only test that Spark can start."""
        if not w.ready and w.proc is not None:
            with open(self.logs / f"{w.name}.log", "rb") as src:
                src.seek(w.log_offset)
                w.ready = w.ready_marker in src.read()
            if w.ready:
                w.ready_at = self.elapsed()
                self.note(
                    f"{w.name}#{w.incarnation} ready after {self.elapsed() - w.started_at:.1f} s"
                )
        return w.ready

    #: Log lines of failures the system reported loudly (allowed by the contract; counted).
    LOUD = {
        "producer send raised": "send failed",
        "producer end-transaction failed": "end-transaction failed",
        "producer late end failed": "late end failed",
        "sink / delta write failed (retried)": "failed (retrying)",
        "check-back round failed": "check-back round failed",
        "stream query failed": "StreamingQueryException",
    }

    def loud_failures(self) -> dict:
        found: dict = {}
        for path in sorted(self.logs.glob("*.log")):
            for line in path.read_text(errors="replace").splitlines():
                for what, needle in self.LOUD.items():
                    if needle in line:
                        entry = found.setdefault(what, {"count": 0, "example": ""})
                        entry["count"] += 1
                        entry["example"] = entry["example"] or f"{path.stem}: {line[:300]}"
        return found

    def killable(self, w: Worker) -> bool:
        """Up, and (for a Spark worker) up long enough to have started some work."""
        if w.proc is None or not self.is_ready(w):
            return False
        return not w.jvm or self.elapsed() - w.ready_at >= self.o.jvm_grace

    def kill(self, w: Worker, why: str = "chaos") -> None:
        if w.proc is None:
            return
        kill_session(w.proc)
        w.log.close()
        self.stats.kills[w.kind] += 1
        self.note(
            f"SIGKILL {w.name}#{w.incarnation} ({why}) after {self.elapsed() - w.started_at:.1f} s"
        )
        w.proc = None
        w.restart_at = self.elapsed() + self.rng.uniform(0.5, 3.0)

    def maybe_resume(self, dt: float) -> None:
        """``rmqtx resume`` now and then (every 20 s on average); sometimes two at once,
        sometimes killed."""
        self.transient = [t for t in self.transient if t[1].poll() is None]
        if self.transient or self.rng.random() > dt / 20:
            return
        n = 2 if self.rng.random() < 0.35 else 1
        self.stats.resumes += n
        self.stats.resumes_concurrent += n == 2
        for i in range(n):
            argv = [PYTHON, "-m", "rmq_spark.ops.cli", "--path", self.store, "resume"]
            proc, log = self.spawn(f"resume-{self.stats.resumes}-{i}", argv)
            self.transient.append((f"resume-{self.stats.resumes}-{i}", proc, log))
            self.stats.started["resume"] += 1
        self.note(f"resume x{n}")

    # ------------------------------------------------------------------ other writers
    def meddle(self, dt: float) -> None:
        """Now and then, between the workers' steps, what users and machines do to a store:
        another Delta writer (deltalake, as delta-spark would) compacts a table (OPTIMIZE),
        writes a checkpoint at an odd version, vacuums with Delta's retention, RESTOREs ``op``
        a few versions back (removing decisions: check-back must record them again, none
        published twice), RESTOREs the CommitLog or DELETEs a few of its rows (published
        messages lost: each must make a read fail loudly with DATA_LOSS naming it; the rows
        removed are recorded for the invariants); or a process that commits is stalled
        (SIGSTOP: a GC or swap stall, a paused VM) for longer than the log cleanup's horizon
        (10 s), then resumed. Another Delta writer acts on a table of a shard picked at random
        (seeded)."""
        from deltalake import DeltaTable

        now = self.elapsed()
        for name, (proc, resume_at) in list(self.stalled.items()):
            if now >= resume_at or proc.poll() is not None:
                self.signal_session(proc, signal.SIGCONT)
                del self.stalled[name]
                self.note(f"SIGCONT {name}")
        if not self.o.meddle_every or self.rng.random() >= dt / self.o.meddle_every:
            return
        act = self.rng.choice(["optimize", "checkpoint", "vacuum", "stall", "restore", "delete"])
        table = {"restore": self.rng.choice(["op", "commitlog"]), "delete": "commitlog"}.get(
            act, self.rng.choice(["half", "op", "commitlog", "check_state", "discard"])
        )
        if act == "stall":
            live = [
                w for w in self.workers
                if w.kind in ("producer", "compactor") and self.killable(w)
                and w.name not in self.stalled
            ]  # fmt: skip
            if not live:
                return
            w = self.rng.choice(live)
            seconds = self.rng.uniform(12, 25)
            self.signal_session(w.proc, signal.SIGSTOP)
            self.stalled[w.name] = (w.proc, now + seconds)
            self.note(f"SIGSTOP {w.name}#{w.incarnation} for {seconds:.0f} s")
        else:
            shard = self.shard_rng.randrange(len(self.shards))
            where = f"{table} of shard {shard}" if len(self.shards) > 1 else table
            try:
                # A store of shards has one CommitLog, the root's.
                base = self.shards[0] if table == "commitlog" else self.shards[shard]
                delta = DeltaTable(f"{base}/{table}")
                if act == "optimize":
                    delta.optimize.compact()
                elif act == "checkpoint":
                    delta.create_checkpoint()
                elif act == "restore":
                    delta.restore(max(0, delta.version() - self.rng.randint(1, 5)))
                elif act == "delete":
                    delta.delete(self.some_published(delta, shard))
                else:
                    delta.vacuum(dry_run=False)
            except Exception as exc:  # a foreign writer may lose a race too; that is all
                self.note(f"foreign {act} of {where} failed: {exc!r}"[:300])
                return
            removed = self.record_removed(delta) if table == "commitlog" else 0
            if act == "restore" and table == "op":
                self.forget_check_counts(delta)
            self.note(
                f"foreign {act} of {where} at version {delta.version()}"
                + (f": {removed} published message(s) removed" if removed else "")
            )
            if self.o.shards > 1:
                self.stats.meddling[f"on shard {shard}"] += 1
        self.stats.meddling[f"{act} {table}" if act == "restore" else act] += 1

    def forget_check_counts(self, op) -> None:
        """A transaction whose decision a RESTORE of ``op`` removed is pending again: its
        ``check_state`` row goes when check-back forgets the decided transaction (before or
        after the RESTORE), and a later round starts its clock anew before it records the
        decision again without asking. Its check counts are not sampled any more; it is
        recorded for the invariants (its checker is asked again if a RESTORE of the CommitLog
        removed its messages too, and they may then be published again)."""
        version = op.version()
        before = read_delta(op.table_uri, ["transaction_id"], version - 1).column(0).to_pylist()
        after = set(read_delta(op.table_uri, ["transaction_id"], version).column(0).to_pylist())
        undecided = set(before) - after
        self.undecided_by_restore.update(undecided)
        with open(self.run["foreign_undecided"], "a") as out:
            out.writelines(json.dumps(txn) + "\n" for txn in sorted(undecided))

    def some_published(self, commitlog, shard: int) -> str:
        """A DELETE predicate for one to three published messages of one queue of shard
        ``shard`` (whose CommitLog is ``commitlog``)."""
        queues = [(t, q, n) for (t, q), n in next_offsets(commitlog, shard).items() if n]
        if not queues:
            return "false"
        topic, q, next_offset = self.rng.choice(queues)
        first = self.rng.randrange(next_offset)
        return (
            f"topic = '{topic}' AND queue_id = {q} AND queue_offset >= {first} "
            f"AND queue_offset < {first + self.rng.randint(1, 3)}"
        )

    def record_removed(self, commitlog) -> int:
        """Record the published messages a foreign commit of the CommitLog removed (its rows
        before and not after), for the invariants: they may be missing, loudly."""
        version = commitlog.version()
        columns = ["topic", "queue_id", "queue_offset", "msg_id", "keys"]
        after = set(read_delta(commitlog.table_uri, ["msg_id"], version).column(0).to_pylist())
        before = read_delta(commitlog.table_uri, columns, version - 1).to_pylist()
        removed = [row for row in before if row["msg_id"] not in after]
        with open(self.run["foreign_removed"], "a") as out:
            out.writelines(json.dumps(row) + "\n" for row in removed)
        self.stats.messages_removed += len(removed)
        return len(removed)

    def signal_session(self, proc: subprocess.Popen, signum: int) -> None:
        """Send ``signum`` to every process group of a worker's session."""
        for pgid in {pgid for _, pgid in session_processes(proc.pid)} | {proc.pid}:
            try:
                os.killpg(pgid, signum)
            except ProcessLookupError:
                pass

    # ------------------------------------------------------------------ sampling
    def sample(self) -> None:
        """Check counts never go down; queue offsets never go down (in every shard)."""
        from deltalake import DeltaTable

        from rmq_spark.store.queues import queue_app_id

        states, decided, staged = [], set(), set()
        try:
            for root in self.shards.values():
                states.append(
                    read_delta(
                        f"{root}/check_state", ["transaction_id", "check_count", "first_seen"]
                    )
                )
                # Read after check_state: a transaction decided before that read is in op (of
                # its shard, the one of its check_state row). Only pending ones count (a
                # decided one's row may be forgotten and, by a job with an older snapshot,
                # started again; that spends nobody's budget).
                for ids, name in ((decided, "op"), (staged, "half")):
                    ids.update(
                        read_delta(f"{root}/{name}", ["transaction_id"]).column(0).to_pylist()
                    )
            commitlog = DeltaTable(f"{self.shards[0]}/commitlog")  # the store's one
        except Exception as exc:  # a snapshot read racing a writer: try next time
            self.note(f"sample failed: {exc!r}"[:300])
            return
        state = pa.concat_tables(states)
        self.stats.samples += 1
        at = self.elapsed()
        for txn, count, first in zip(
            state.column("transaction_id").to_pylist(),
            state.column("check_count").to_pylist(),
            state.column("first_seen").to_pylist(),
            strict=True,
        ):
            self.stats.max_check_count = max(self.stats.max_check_count, count)
            if txn in decided or txn not in staged or txn in self.undecided_by_restore:
                continue
            seen = self.check_seen.get(txn)
            if seen is not None and count < seen[0]:
                self.violations.append(
                    Violation(
                        "check count went down",
                        f"transaction {txn}: check_count {seen[0]} (first_seen {seen[1]}, "
                        f"sampled at {seen[2]:.1f}s) then {count} (first_seen {first}, sampled "
                        f"at {at:.1f}s)",
                    )
                )
            if seen is None or count >= seen[0]:
                self.check_seen[txn] = (count, first, at)
        for shard in self.shards:
            for (topic, q), version in next_offsets(commitlog, shard).items():
                app = queue_app_id(topic, q)
                if version < self.queue_seen.get(app, -1):
                    self.violations.append(
                        Violation(
                            "queue offset went down",
                            f"{app}: next offset {self.queue_seen[app]} then {version}",
                        )
                    )
                self.queue_seen[app] = max(version, self.queue_seen.get(app, -1))

    def grow(self) -> None:
        """Halfway through the chaos of a store of shards, one shard more (as an operator's
        ``rmqtx shards --set``): producers started from now on may claim it, and its messages
        go into the store's one CommitLog like the others'."""
        from rmq_spark import Store
        from rmq_spark.model.config import load_settings

        count = len(self.shards) + 1
        Store.open(self.store, settings=load_settings(self.conf), create=False).grow(count)
        self.shards = shard_roots(self.store)
        self.run["shards"] = len(self.shards)  # what the invariants expect to find
        self.note(f"store grown to {len(self.shards)} shards")
        self.stats.meddling["shard growth"] += 1

    # ------------------------------------------------------------------ phases
    def chaos(self) -> None:
        o = self.o
        # Warm-up: the JVM workers start first, alone (a JVM takes a minute to start on a
        # loaded 2-core machine); the others join when the chaos clock starts.
        for w in self.workers:
            if w.jvm:
                self.start(w)
            else:
                w.restart_at = None
        # The chaos clock starts once every worker is up (JVMs take a minute to start on a
        # loaded machine), or after 240 s at the latest.
        end = None
        next_feed, next_batch, next_sample = 0.0, 0.0, 0.0
        tick, last = 0.5, self.elapsed()
        grown = False
        while end is None or time.monotonic() < end:
            # Chaos is drawn per second passed, not per step: a step that reads every shard
            # of an s3:// root behind the latency proxy can take many seconds.
            now = self.elapsed()
            dt, last = now - last, now
            self.reap(chaos=True)
            ready = [self.is_ready(w) for w in self.workers if w.proc is not None]
            if end is None and ((ready and all(ready)) or now > 240):
                end = time.monotonic() + o.chaos_seconds
                self.stats.warm_up = now
                self.note(f"Spark workers up: {o.chaos_seconds:.0f} s of chaos from now")
                for w in self.workers:
                    if w.proc is None and w.restart_at is None:
                        self.start(w)
            for w in self.workers:
                if w.proc is None and w.restart_at is not None and now >= w.restart_at:
                    self.start(w)
            if end is not None and now >= next_feed:
                self.feed_stream()
                next_feed = now + self.rng.uniform(2, 5)
            if end is not None and now >= next_batch and self.pending_batches() < 2:
                self.feed_batch()
                next_batch = now + self.rng.uniform(2, 6)
            if now >= next_sample:
                self.sample()
                next_sample = now + max(2.0, 2 * (self.elapsed() - now))
            if end is not None and self.rng.random() < dt / o.kill_every:
                live = [w for w in self.workers if self.killable(w)]
                weights = [
                    {"compactor": 1, "check-back": 1, "writer": 3}.get(w.kind, 3) for w in live
                ]
                if live:
                    self.kill(self.rng.choices(live, weights)[0])
            if end is not None:
                self.maybe_resume(dt)
                self.meddle(dt)
                if not grown and o.shards > 1 and time.monotonic() >= end - o.chaos_seconds / 2:
                    self.grow()
                    grown = True
            time.sleep(tick)
        for name, (proc, _) in self.stalled.items():
            self.signal_session(proc, signal.SIGCONT)
            self.note(f"SIGCONT {name} (end of chaos)")
        self.stalled = {}
        self.note("chaos over: SIGKILL every worker")
        (self.run_dir / "STOP").write_text("stop")
        self.reap(chaos=False)
        for w in self.workers:
            if w.proc is not None:
                self.kill(w, "end of chaos")
                w.restart_at = None
        for _name, proc, log in self.transient:
            if proc.poll() is None:
                kill_session(proc)
                self.stats.kills["resume"] += 1
            log.close()
        self.transient = []
        self.sample()

    def finish(self) -> None:
        """Drain the writers and run re-drive + check-back to quiescence (no faults)."""
        (self.run_dir / "STOP").unlink()
        for attempt in range(3):
            self.stats.finish_attempts += 1
            self.stats.started["finish"] += 1
            argv = [PYTHON, "-m", "tests.torture.workers", str(self.run_json), "finish",
                    "finish", str(attempt)]  # fmt: skip
            proc, log = self.spawn("finish", argv)
            self.note(f"finish #{attempt} pid {proc.pid}")
            deadline = time.monotonic() + self.o.finish_timeout
            while proc.poll() is None and time.monotonic() < deadline:
                time.sleep(2)
                self.sample()
            if proc.poll() is None:
                kill_session(proc)
            log.close()
            rounds = [
                json.loads(line[len("QUIESCE ") :])
                for line in (self.logs / "finish.log").read_text(errors="replace").splitlines()
                if line.startswith("QUIESCE ")
            ]
            self.stats.quiesce_rounds = rounds
            self.note(f"finish #{attempt} rc={proc.returncode} rounds={len(rounds)}")
            if proc.returncode == 0:
                self.stats.finish_ok = True
                return
            self.stats.unexpected_exits.append(
                ("finish", attempt, proc.returncode, self.tail("finish"))
            )
        self.violations.append(
            Violation(
                "no quiescence",
                "the finisher (drain + re-drive + check-back rounds) did not reach quiescence: "
                + self.tail("finish"),
            )
        )

    def run_all(self) -> dict:
        self.setup()
        self.note(
            f"seed {self.o.seed}, chaos {self.o.chaos_seconds:.0f} s, root {self.root}, "
            f"{self.o.shards} shard(s)"
        )
        try:
            self.chaos()
            chaos_end = self.elapsed()
            self.finish()
        finally:
            for w in self.workers:
                if w.proc is not None:
                    kill_session(w.proc)
        errors = self.run_dir / "harness_errors.txt"
        if errors.exists():
            for line in errors.read_text().splitlines():
                self.violations.append(Violation("harness", line))
        results = check_invariants(self.run, self.store)
        results.facts["loud failures"] = self.loud_failures()
        self.violations.extend(results.violations)
        return {
            "seed": self.o.seed,
            "chaos_seconds": round(chaos_end, 1),
            "duration_seconds": round(self.elapsed(), 1),
            "root": str(self.root),
            "options": {k: str(v) for k, v in self.o.__dict__.items()},
            "stats": self.stats,
            "facts": results.facts,
            "violations": self.violations,
        }


def _proxy(target: int, delay_ms: float) -> tuple[subprocess.Popen, str]:
    """The latency proxy in a process of its own, and its endpoint. Not a thread of this one:
    this process's foreign Delta writer (a deltalake RESTORE, OPTIMIZE...) holds the GIL while
    its own requests wait on the proxy, which stalled every process's requests for minutes."""
    port = minio.free_port()
    proxy = subprocess.Popen(
        [sys.executable, "-m", "tests.latency_proxy", str(port), str(target), str(delay_ms)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proxy.stdout is not None
    proxy.stdout.readline()  # listening
    return proxy, f"http://127.0.0.1:{port}"


def run(seed: int | None = None, seconds: float = 120.0, root: str | Path | None = None,
        delay_ms: float | None = None, **overrides) -> tuple[dict, str]:  # fmt: skip
    """One torture run; returns (result, printable report). With ``delay_ms``, the store is on
    ``s3://`` (a MinIO server of its own) behind a proxy adding that delay to every request."""
    import rmq_spark

    if not str(Path(rmq_spark.__file__).resolve()).startswith(str(REPO) + os.sep):
        raise RuntimeError(
            f"rmq_spark is imported from {rmq_spark.__file__}, not from the checkout under test "
            f"({REPO}); run from {REPO} (python -m tests.torture.run puts the working directory "
            "first on sys.path)."
        )
    seed = seed if seed is not None else random.SystemRandom().randrange(1, 10**9)
    root = Path(root) if root else Path(tempfile.mkdtemp(prefix=f"rmq-torture-{seed}-"))
    root.mkdir(parents=True, exist_ok=True)

    saved = dict(os.environ)
    server = proxy = None
    try:
        if delay_ms is not None:
            # The store on s3://, every request an object store's round trip; every process
            # (this one's own reads and meddling too) finds the server in its environment.
            server = minio.start(root / "minio" / "data")
            proxy, endpoint = _proxy(int(server.endpoint.rsplit(":", 1)[1]), delay_ms)
            overrides["storage_options"] = {**server.storage_options, "AWS_ENDPOINT_URL": endpoint}
            os.environ.update(overrides["storage_options"])
        orchestrator = Orchestrator(
            Options(seed=seed, chaos_seconds=seconds, root=root, **overrides)
        )
        print(
            f"rmq-spark torture: seed {seed}, chaos {seconds:.0f} s, run dir {root}, store "
            f"{orchestrator.store}"
            + (f" (+{delay_ms:g} ms a request)" if proxy else "")
            + f", {orchestrator.o.shards} shard(s)",
            flush=True,
        )
        result = orchestrator.run_all()
    finally:
        # The run points this process at its own settings file (and server); the caller gets
        # its own environment back.
        os.environ.clear()
        os.environ.update(saved)
        if proxy is not None:
            proxy.kill()
            proxy.wait()
        if server is not None:
            server.stop()
    report = format_report(result)
    (root / "report.txt").write_text(report)
    (root / "report.json").write_text(json.dumps(jsonable(result), indent=1))
    return result, report


def jsonable(value):
    """``result`` as plain JSON types (dataclasses, counters, tuples)."""
    if is_dataclass(value):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(v) for v in value]
    if isinstance(value, int | float | str | bool) or value is None:
        return value
    return str(value)
