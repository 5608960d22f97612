"""Producer benchmark: transactional sends per second with 1, 8 and 64 concurrent senders.

Baselines measured in the same run:
* bulk append: the same rows in one plain deltalake append (the ceiling for one writer);
* per-message append: each sender appends its row to a plain Delta table with deltalake,
  one commit per message (what a service writing events one by one would do). Its cost grows
  with every commit, so it runs on the first --baseline-messages rows only.

"first/last tenth" is the send rate in the first and in the last tenth of a run: a producer
that slows down as its store grows shows it there (run enough messages for that to show).

"CPU per send" splits the process's CPU time by who spent it: the senders' threads, the
group committers of half messages (prepare) and of decisions, the publisher lease's loop
(publish), the background maintenance (compaction, log cleanup, checkpoints) and the native
thread pools of deltalake and Arrow. On two cores, sends/s can be at most 2 s / (CPU per
send), and the Python threads share one interpreter lock.

Usage: python bench/producer_bench.py [--messages 4000] [--body-bytes 256] [--intake on]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
from deltalake import write_deltalake
from deltalake.exceptions import CommitFailedError

from rmq_spark import (
    LocalTransactionState,
    Message,
    Store,
    TransactionListener,
    TransactionMQProducer,
)
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.schema import HALF_SCHEMA, WRITER_COLUMNS


class CommitAll(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT

    def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT


def run_threads(
    senders: int,
    total: int,
    send: Callable[[int], None],
    done: list[float] | None = None,
    cpu: list[float] | None = None,
) -> float:
    """Run ``total`` sends split over ``senders`` threads; return elapsed seconds. ``done``
    gets each send's completion time (``time.perf_counter()``), ``cpu`` each thread's CPU
    seconds."""
    per = total // senders  # callers pass a multiple of senders

    def worker(n: int) -> None:
        start = time.thread_time()
        for i in range(per):
            send(n * per + i)
            if done is not None:
                done.append(time.perf_counter())
        if cpu is not None:
            cpu.append(time.thread_time() - start)

    pool = [threading.Thread(target=worker, args=(n,)) for n in range(senders)]
    start = time.perf_counter()
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return time.perf_counter() - start


def append_retrying(uri: str, data: pa.Table) -> None:
    """A plain append; deltalake gives up after 15 rebases under heavy contention."""
    while True:
        try:
            write_deltalake(uri, data, mode="append")
            return
        except CommitFailedError:
            continue


def tenths(done: list[float]) -> tuple[float, float]:
    """Sends per second in the first and the last tenth of the run (a rate that falls as the
    store grows shows here)."""
    done = sorted(done)
    start, end = done[0], done[-1]
    tenth = (end - start) / 10 or 1e-9
    first = sum(t < start + tenth for t in done) / tenth
    last = sum(t > end - tenth for t in done) / tenth
    return first, last


#: Python thread names (prefixes) of the producer's and the store's threads, by role.
ROLES = {
    "rmqtx-prepare-": "prepare",
    "rmqtx-end-": "decisions",
    "rmqtx-publisher": "publish",
    "rmqtx-maintain-": "maintenance",
    "rmqtx-checkpoint-": "maintenance",
}


def thread_cpu() -> dict[int, float]:
    """CPU seconds of each thread of this process, by native thread id (Linux's /proc; none
    elsewhere)."""
    if not os.path.isdir("/proc/self/task"):
        return {}
    tick = os.sysconf("SC_CLK_TCK")
    found = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        found[int(tid)] = (int(fields[11]) + int(fields[12])) / tick
    return found


def cpu_split(before: dict[int, float], process: float, senders: float, sends: int) -> str:
    """Microseconds of CPU per send by role, from :func:`thread_cpu` before and now, the
    process's and the sender threads' CPU seconds over the same run."""
    total = f"CPU per send: {1e6 * process / sends:,.0f} us"
    if not before:
        return total
    roles = {
        t.native_id: role
        for t in threading.enumerate()
        for p, role in ROLES.items()
        if t.name.startswith(p)
    }
    spent = {"senders": senders}
    for tid, seconds in thread_cpu().items():
        role = roles.get(tid)
        if role is not None:
            spent[role] = spent.get(role, 0.0) + seconds - before.get(tid, 0.0)
    spent["native pools and the rest"] = max(process - sum(spent.values()), 0.0)
    parts = ", ".join(f"{role} {1e6 * s / sends:,.0f}" for role, s in spent.items())
    return f"{total} ({parts})"


def rows(count: int, body: bytes) -> pa.Table:
    now = pa.scalar(time.time_ns() // 1000, pa.timestamp("us", tz="UTC"))
    return pa.Table.from_pydict(
        {
            "transaction_id": [f"t{i}" for i in range(count)],
            "msg_id": [f"m{i}" for i in range(count)],
            "producer_group": ["bench"] * count,
            "topic": ["Bench"] * count,
            "queue_id": [0] * count,
            "keys": [f"k{i}" for i in range(count)],
            "tags": [None] * count,
            "body": [body] * count,
            "properties": [[]] * count,
            "born_timestamp": [now] * count,
            "store_timestamp": [now] * count,
            **{f.name: [None] * count for f in WRITER_COLUMNS},
        },
        schema=HALF_SCHEMA,
    )


#: The runs: this many senders each.
SENDERS = (1, 8, 64)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--body-bytes", type=int, default=256)
    parser.add_argument(
        "--baseline-messages",
        type=int,
        default=400,
        help="messages for the per-message append baseline (its cost grows with every commit)",
    )
    parser.add_argument(
        "--intake",
        choices=("on", "off"),
        default="on",
        help="store.intake (on by default): sends staged as intake objects; off: half commits",
    )
    args = parser.parse_args()
    if args.messages < max(SENDERS) or args.baseline_messages < max(SENDERS):
        parser.error(
            f"--messages and --baseline-messages need at least {max(SENDERS)}: one a sender"
        )
    body = b"x" * args.body_bytes
    print(
        f"producer benchmark: {args.messages} messages of {args.body_bytes} B per run, "
        f"intake {args.intake}"
    )
    with tempfile.TemporaryDirectory(prefix="rmq-bench-") as tmp:
        bulk_uri = str(Path(tmp) / "bulk")
        start = time.perf_counter()
        write_deltalake(bulk_uri, rows(args.messages, body))
        bulk_rate = args.messages / (time.perf_counter() - start)
        print(
            f"baseline: plain deltalake bulk append of the same rows, one commit: "
            f"{bulk_rate:,.0f} rows/s\n"
        )
        print(
            f"{'senders':>7} {'transactional msg/s':>20} {'first/last tenth':>17} "
            f"{'plain append/msg msg/s':>23} {'vs per-msg':>10} {'vs bulk':>8}"
        )
        for senders in SENDERS:
            total = args.messages if senders > 1 else max(200, args.messages // 10)
            total -= total % senders
            path = str(Path(tmp) / f"store-{senders}")
            store = Store.open(
                settings=Settings(store=StoreSettings(path=path, intake=args.intake == "on"))
            )
            done: list[float] = []
            sender_cpu: list[float] = []
            with TransactionMQProducer("bench", CommitAll(), store=store) as producer:
                before, process = thread_cpu(), time.process_time()
                elapsed = run_threads(
                    senders,
                    total,
                    lambda i, p=producer: p.send_message_in_transaction(
                        Message("Bench", body, keys=f"k{i}")
                    ),
                    done,
                    sender_cpu,
                )
                # Until every COMMIT is published: end-to-end, not just the sends.
                flush_start = time.perf_counter()
                producer.flush()
                elapsed += time.perf_counter() - flush_start
                split = cpu_split(before, time.process_time() - process, sum(sender_cpu), total)
            published = store.read("commitlog", ["msg_id"]).num_rows
            assert published == total, (published, total)
            plain_uri = str(Path(tmp) / f"plain-{senders}")
            one = rows(1, body)
            write_deltalake(plain_uri, one)
            plain_total = args.baseline_messages - args.baseline_messages % senders
            plain = run_threads(
                senders, plain_total, lambda i, u=plain_uri, d=one: append_retrying(u, d)
            )
            tx_rate, plain_rate = total / elapsed, plain_total / plain
            first, last = tenths(done)
            print(
                f"{senders:>7} {tx_rate:>20,.0f} {f'{first:,.0f} / {last:,.0f}':>17} "
                f"{plain_rate:>23,.0f} "
                f"{tx_rate / plain_rate:>9.1f}x {tx_rate / bulk_rate:>7.2f}x\n"
                f"{'':>7} {split}",
                flush=True,
            )


if __name__ == "__main__":
    main()
