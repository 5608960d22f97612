"""Scale-out benchmark: transactional sends of N producer processes on one store, the way a
deployment runs them, with an object store's round trip on every request.

A MinIO server on loopback sits behind :mod:`tests.latency_proxy` (``--delay-ms`` a request, 20 by
default; real S3 is slower), and the store is on ``s3://`` through it (``--local``: on local
disk instead, no proxy). For each run ``PxS`` of ``--runs``, P producer processes with S sender
threads each start together and send for ``--seconds``: every sender, in a loop, sends a half
message (``send_message_in_transaction``), and ends it with COMMIT (``end_transaction``, which
returns once the decision is durable), as fast as it can or ``--rate`` transactions a second
(the publish lag is measured where the CPU is not saturated). Printed per run: transactions
per second of all processes together, its ratio to the first run, the send latency (half
durable, local transaction, decision durable) at p50 and p99, the time from a COMMIT's
decision to its publish (the ``op`` row's ``decided_timestamp`` to the CommitLog row's
``store_timestamp``, taken as the publish commit is built: add one commit for the time until a
reader sees it) at p50 and p99 over the COMMITs decided during the sends, the share of the
machine's CPU busy during the run (near 100%: the run measures the machine, not the store),
the producer processes' own CPU time a transaction (every thread, native ones included; MinIO
and the proxy are not in it), and the requests per transaction the proxy counted, by kind, and
how many of them were background work: all but the send path's, which are, for each commit of
``half`` (with ``store.intake`` off: a run written ``PxS:commit``; with it on, the default on
S3, the PUT of each intake object instead, :data:`INTAKE_PUT`, and the ``half`` commits that
land them are background work), and of ``op`` for the transactions decided there, its data
file PUT, its log entry PUT and the two GETs of its reachability check (:data:`COMMIT_PUT`),
and the PUT of each decision object (:data:`DECISION_PUT`; the ``op`` commits that land those
decisions are background work). Last, issue 47's goals for the runs made (``1x4``, ``16x4``,
``1x64``), each with what was measured.

The store of each run has one shard per producer process (``rmq_spark.store.shards``: each
process appends to logs of its own), or ``--shards`` N for every run, or K for one run written
``PxSxK`` (``16x4x1``: every process appends to the same logs, as before shards). A run written
``PxS:commit`` makes each send a ``half`` commit (``store.intake = false``), for a comparison in
the same run. A run written ``PxS:floor`` is the store's own floor, no rmq-spark: each sender
makes two sequential PUTs a transaction (a 256 B object, then a put-if-absent of another), the
two round trips a transaction needs at least, with the client rmq-spark uses; its figures are
what this machine's object store (MinIO and the proxy, on the producers' cores) gives, and the
goals print each run beside its floor.

Usage: python bench/scale_bench.py [--runs 1x4:floor,1x4,1x4:commit,16x4,1x64:floor,1x64]
                                   [--seconds 20]
                                   [--delay-ms 20]
                                   [--rate TX_PER_SENDER_PER_S] [--shards N] [--local]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

from rmq_spark import (  # noqa: E402
    LocalTransactionState,
    Message,
    Store,
    TransactionListener,
    TransactionMQProducer,
)
from rmq_spark.delta.storage import filesystem  # noqa: E402
from rmq_spark.model.config import StoreSettings  # noqa: E402
from rmq_spark.model.messages import object_decided  # noqa: E402
from tests import minio  # noqa: E402
from tests.latency_proxy import LatencyProxy  # noqa: E402

BODY = b"x" * 256
#: A PUT of a commit of ``half`` or ``op`` (a shard's or the root's): a data file or a log
#: entry. Each log entry PUT is followed by the two GETs of the commit's reachability check.
COMMIT_PUT = re.compile(r"/(half|op)/(?:_delta_log/\d{20}\.json|[^/]+\.parquet)$")
#: The PUT of an intake object (``rmq_spark.store.intake``).
INTAKE_PUT = re.compile(r"/half/_rmqtx_intake/[^/]+\.arrow$")
#: The PUT of a transaction's decision object (``rmq_spark.store.arbiter``).
DECISION_PUT = re.compile(r"/op/_rmqtx_decisions/[^/]+\.json$")
#: Seconds a producer process stays up after its sends: its last COMMITs are published by the
#: running publisher, as in a service that goes on running (sixteen processes stopping at one
#: moment would each publish their own, racing for the CommitLog).
LINGER = 3.0


class EndedLater(TransactionListener):
    """The local transaction ends after the send returns: the sender ends it explicitly."""

    def execute_local_transaction(self, msg, arg):  # noqa: ANN001, ANN201
        return LocalTransactionState.UNKNOWN

    def check_local_transaction(self, msg):  # noqa: ANN001, ANN201
        return LocalTransactionState.COMMIT


def worker(
    root: str,
    options: dict[str, str],
    senders: int,
    start: float,
    seconds: float,
    rate: float,
    intake: bool,
):
    """One producer process: ``senders`` threads send from ``start`` (wall clock) on for
    ``seconds``, each ``rate`` transactions a second at most (0: one after the other); print
    ``{"count": n, "latencies": [...], "cpu": s}`` (seconds; ``cpu``: the process's CPU time
    during the sends, every thread, native ones included) on stdout. ``intake``: the
    ``store.intake`` setting."""
    settings = StoreSettings(path=root, storage_options=options, intake=intake)
    store = Store.open(settings=settings, create=False)
    latencies: list[float] = []
    by_object: list[bool] = []  # list.append is atomic
    lock = threading.Lock()
    group = f"bench-{os.getpid()}"
    with TransactionMQProducer(group, store=store, listener=EndedLater()) as producer:
        warm = producer.send_message_in_transaction(Message("bench", BODY))
        producer.end_transaction(warm, LocalTransactionState.COMMIT)
        time.sleep(max(0.0, start - time.time()))
        end = start + seconds

        def send() -> None:
            mine: list[float] = []
            due = start + (random.random() / rate if rate else 0.0)  # senders spread out
            while time.time() < end:
                if rate:
                    time.sleep(max(0.0, due - time.time()))
                    due += 1 / rate
                t0 = time.perf_counter()
                result = producer.send_message_in_transaction(Message("bench", BODY))
                producer.end_transaction(result, LocalTransactionState.COMMIT)
                if time.time() <= end:
                    mine.append(time.perf_counter() - t0)
                    by_object.append(object_decided(result.transaction_id))
            with lock:
                latencies.extend(mine)

        cpu = _run_cpu(senders, send)
        time.sleep(max(0.0, end + LINGER - time.time()))
    counts = {"count": len(latencies), "objects": sum(by_object)}
    print(json.dumps({**counts, "latencies": latencies, "cpu": cpu}), flush=True)


def _run_cpu(senders: int, send: Callable[[], None]) -> float:
    """Run ``send`` on ``senders`` threads until each returns; the process's CPU seconds
    meanwhile (every thread, native ones included)."""
    threads = [threading.Thread(target=send) for _ in range(senders)]
    before = os.times()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = os.times()
    return after.user - before.user + after.system - before.system


def floor_worker(root: str, options: dict[str, str], senders: int, start: float, seconds: float):
    """The store's floor: ``senders`` threads, each making two sequential PUTs a transaction (a
    body, then a put-if-absent), from ``start`` for ``seconds``; prints as :func:`worker`."""
    fs, path = filesystem(root, options)
    latencies: list[float] = []
    lock = threading.Lock()
    fs.pipe_file(f"{path}/floor/warm", BODY)
    time.sleep(max(0.0, start - time.time()))
    end = start + seconds

    def send() -> None:
        mine: list[float] = []
        while time.time() < end:
            t0 = time.perf_counter()
            key = f"{path}/floor/{uuid.uuid4().hex}"
            fs.pipe_file(f"{key}.arrow", BODY)
            fs.pipe_file(f"{key}.json", b"{}", mode="create")
            if time.time() <= end:
                mine.append(time.perf_counter() - t0)
        with lock:
            latencies.extend(mine)

    cpu = _run_cpu(senders, send)
    count = len(latencies)
    print(json.dumps({"count": count, "objects": count, "latencies": latencies, "cpu": cpu}))


def publish_lags(root: str, options: dict[str, str], since: float, until: float) -> np.ndarray:
    """Seconds from each COMMIT decided between ``since`` and ``until`` (wall clock) to its
    publish, from the store's own tables."""
    store = Store.open(settings=StoreSettings(path=root, storage_options=options), create=False)
    shards = store.shards()
    op = pa.concat_tables(s.read("op", ["transaction_id", "decided_timestamp"]) for s in shards)
    published = store.read("commitlog", ["transaction_id", "store_timestamp"])
    both = published.join(op, "transaction_id")
    decided = both["decided_timestamp"].cast(pa.int64()).to_numpy() / 1e6
    both = both.filter(pa.array((decided >= since) & (decided < until)))
    lag = pc.subtract(both["store_timestamp"], both["decided_timestamp"]).cast(pa.int64())
    return lag.to_numpy() / 1e6


def run(
    root: str,
    options: dict[str, str],
    processes: int,
    senders: int,
    seconds: float,
    rate: float,
    proxy: LatencyProxy | None,
    way: str,
):
    """Start ``processes`` workers together (``way``: ``intake``, ``commit`` or ``floor``);
    return (transactions/s, latencies, requests counted by the proxy from the start to the end
    of the sends, how many of them were not the send path's, the share of CPU busy, the
    wall-clock start of the sends, the producer processes' CPU seconds a transaction)."""
    start = time.time() + 10 + processes * 1.5  # every worker has opened the store by then
    env = {**os.environ, "RMQ_BENCH_OPTIONS": json.dumps(options)}
    argv = [sys.executable, __file__, "--worker", root, *map(str, (senders, start, seconds, rate))]
    argv.append(way)
    procs = [
        subprocess.Popen(
            argv,
            stdout=subprocess.PIPE,
            env=env,
        )
        for _ in range(processes)
    ]
    time.sleep(max(0.0, start - time.time()))
    if proxy is not None:
        proxy.take_counts()
        proxy.requests.clear()  # type: ignore[union-attr]
    machine = _cpu_times()
    time.sleep(seconds)
    busy = _busy(machine, _cpu_times())
    counts = proxy.take_counts() if proxy is not None else {}
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=seconds + 600)
        if p.returncode != 0:
            raise SystemExit(f"a producer process failed (exit {p.returncode})")
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    latencies = np.array([x for r in results for x in r["latencies"]])
    count = sum(r["count"] for r in results)
    op_share = 1 - sum(r["objects"] for r in results) / max(count, 1)
    if way == "floor":
        sent = sum(counts.values())
    else:
        sent = _send_path(proxy.requests or [], op_share, way == "intake") if proxy else 0
    background = sum(counts.values()) - sent if proxy else 0
    cpu = sum(r["cpu"] for r in results) / max(count, 1)
    return count / seconds, latencies, counts, background, busy, start, cpu


def _send_path(requests: list[tuple[str, str]], op_share: float, intake: bool) -> float:
    """How many of ``requests`` (method, target) the send path made: the intake objects
    (:data:`INTAKE_PUT`) or, with ``intake`` off, the commits of ``half``
    (:data:`COMMIT_PUT`), the decision objects (:data:`DECISION_PUT`), and the share
    ``op_share`` of the commits of ``op`` (the transactions decided there; the others' decisions
    are landed in ``op`` in the background)."""
    puts = [t.partition("?")[0] for m, t in requests if m == "PUT"]
    costs = {"half": 0, "op": 0}
    for t in puts:
        found = COMMIT_PUT.search(t)
        if found:
            costs[found.group(1)] += 3 if t.endswith(".json") else 1
    decisions = sum(1 for t in puts if DECISION_PUT.search(t))
    halves = sum(1 for t in puts if INTAKE_PUT.search(t)) if intake else costs["half"]
    return halves + op_share * costs["op"] + decisions


def _cpu_times() -> list[int]:
    """The machine's CPU time so far, by state (the first line of /proc/stat)."""
    with open("/proc/stat") as stat:
        return [int(n) for n in stat.readline().split()[1:]]


def _busy(before: list[int], after: list[int]) -> float:
    """The share of the machine's CPU time that went to work (not idle or I/O wait) between
    two :func:`_cpu_times`: near 1, the run is bound by the CPU, not the store."""
    spent = [b - a for a, b in zip(before, after, strict=True)]
    idle = spent[3] + spent[4]
    return 1 - idle / max(sum(spent), 1)


def print_goals(measured: dict[str, dict[str, float]]) -> None:
    """Issue 47's goals for the runs in ``measured`` (by ``PxS``), each beside its figure, and
    beside the store's floor when ``PxS:floor`` ran."""
    one, many, wide = (measured.get(k) for k in ("1x4", "16x4", "1x64"))
    goals: list[tuple[str, str, bool | None]] = []  # None: a figure, not a goal
    if one:
        goals += [
            (
                "1 x 4: p50 <= 60 ms, p99 <= 150 ms (two round trips)",
                f"p50 {one['p50']:.0f} ms, p99 {one['p99']:.0f} ms",
                one["p50"] <= 60 and one["p99"] <= 150,
            ),
            (
                "1 x 4: background requests <= 2 a transaction",
                f"{one['background']:.1f}",
                one["background"] <= 2,
            ),
            ("1 x 4: CPU <= 2 ms a transaction", f"{one['cpu']:.1f} ms", one["cpu"] <= 2),
        ]
    if wide:
        goals += [
            ("1 x 64: >= 1,000 tx/s", f"{wide['tps']:,.0f} tx/s", wide["tps"] >= 1000),
            (
                "1 x 64: background requests <= 0.2 a transaction",
                f"{wide['background']:.2f}",
                wide["background"] <= 0.2,
            ),
        ]
    for name, run in (("1x4", one), ("16x4", many), ("1x64", wide)):
        floor = measured.get(f"{name}:floor")
        if run and floor:
            goals.append(
                (
                    f"{name.replace('x', ' x ')}: beside the store's floor (two PUTs a tx)",
                    f"{run['tps'] / floor['tps']:.2f}x tx/s, p50 {run['p50'] / floor['p50']:.2f}x",
                    None,
                )
            )
    if one and many:
        scale = many["tps"] / one["tps"]
        goals.append(("16 x 4: >= 6x 1 x 4", f"{scale:.1f}x", scale >= 6))
    if goals:
        print("\nissue 47's goals (S3 with the delay above):")
        for goal, figure, met in goals:
            verdict = "" if met is None else "met" if met else "missed"
            print(f"  {goal:<56} {figure:>22}  {verdict}".rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default="1x4:floor,1x4,16x4:floor,16x4,1x64:floor,1x64")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--delay-ms", type=float, default=20.0)
    parser.add_argument("--shards", type=int, default=None)
    parser.add_argument("--rate", type=float, default=0.0)
    parser.add_argument("--local", action="store_true")
    args = parser.parse_args()
    runs = [
        ([int(n) for n in spec.split("x")], way or "intake", spec + (f":{way}" if way else ""))
        for spec, _, way in (r.partition(":") for r in args.runs.split(","))
    ]
    wrong = [name for _, way, name in runs if way not in ("intake", "commit", "floor")]
    if wrong:
        parser.error(f"--runs: {wrong[0]!r} is not PxS[xK][:commit|:floor]")
    with tempfile.TemporaryDirectory(prefix="rmq-scale-") as tmp:
        server = proxy = None
        if args.local:
            base, options, where = f"{tmp}/stores", {}, "local disk"
        else:
            server = minio.start(Path(tmp) / "minio" / "data")
            port = int(server.endpoint.rsplit(":", 1)[1])
            proxy = LatencyProxy(port, args.delay_ms, record=True).start()
            options = dict(server.storage_options, AWS_ENDPOINT_URL=proxy.endpoint)
            base, where = f"s3://{minio.BUCKET}", f"s3:// (MinIO, +{args.delay_ms:g} ms a request)"
        print(f"scale-out on {where}, {args.seconds:g} s a run, 256 B bodies", flush=True)
        print(
            f"{'producers':>34} {'shards':>6} {'tx/s':>8} {'ratio':>6} {'p50 ms':>8} "
            f"{'p99 ms':>8}  {'published p50/p99 ms':>20} {'cpu':>5} {'cpu ms/tx':>9}  "
            "requests/tx (background)"
        )
        first = None
        measured: dict[str, dict[str, float]] = {}
        try:
            for i, ((processes, senders, *fixed), way, name) in enumerate(runs):
                root = f"{base}/run{i}"
                shards = fixed[0] if fixed else args.shards or processes
                made = StoreSettings(path=root, storage_options=options, shards=shards)
                Store.open(settings=made, create=True)
                tps, lat, counts, background, busy, start, cpu = run(
                    root, options, processes, senders, args.seconds, args.rate, proxy, way
                )
                if way != "floor":
                    first = first or tps
                ratio = f"{tps / first:5.1f}x" if way != "floor" and first else f"{'-':>6}"
                done = max(tps * args.seconds, 1)
                per_tx = " ".join(f"{k} {v / done:.1f}" for k, v in sorted(counts.items()))
                per_tx += f" ({background / done:.1f})" if counts else ""
                label = f"{processes} process(es) x {senders} senders"
                label += "" if way == "intake" else f" ({way})"
                p50, p99 = (np.percentile(lat, q) * 1000 if len(lat) else 0 for q in (50, 99))
                published = "-"
                if way != "floor":
                    lags = publish_lags(root, options, start, start + args.seconds) * 1000
                    published = "/".join(f"{np.percentile(lags, q):.0f}" for q in (50, 99))
                print(
                    f"{label:>34} {shards:>6} {tps:8.0f} {ratio} {p50:8.0f} "
                    f"{p99:8.0f}  {published:>20} {busy:5.0%} {cpu * 1000:9.1f}  {per_tx or '-'}",
                    flush=True,
                )
                measured[name] = {
                    "tps": tps,
                    "p50": p50,
                    "p99": p99,
                    "cpu": cpu * 1000,
                    "background": background / done if counts else float("nan"),
                }
            if proxy is not None:  # the goals are an object store's
                print_goals(measured)
        finally:
            if proxy is not None:
                proxy.stop()
            if server is not None:
                server.stop()


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        root, senders, start, seconds, rate, way = sys.argv[2:8]
        if way == "floor":
            options = json.loads(os.environ["RMQ_BENCH_OPTIONS"])
            floor_worker(root, options, int(senders), float(start), float(seconds))
            sys.exit()
        worker(
            root,
            json.loads(os.environ["RMQ_BENCH_OPTIONS"]),
            int(senders),
            float(start),
            float(seconds),
            float(rate),
            way == "intake",
        )
    else:
        main()
