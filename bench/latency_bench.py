"""Latency benchmark: one sender's transactions, and how soon consumers see a commit.

Measured in one run, on a fresh local store:

* **one sender**, sequential transactions that COMMIT (256 B bodies): how long
  ``send_message_in_transaction`` takes (half message durable, local transaction run, the
  COMMIT handed to the background committer, as RocketMQ's oneway ``endTransaction``), and how
  long until the decision is recorded and the message published (``flush()``): the latency
  from send to readable by a consumer. p50 and p99.
* **commit to visible**: a streaming query (``readStream.format("rmqtx")``, processing-time
  trigger, ``foreachBatch``) runs while ``--senders`` threads send ``--rate`` transactions per
  second in all; for each message, the time from ``send_message_in_transaction`` returning
  COMMIT to the micro-batch that holds it. p50, p99 and the trigger for reference.

Usage: python bench/latency_bench.py [--transactions 400] [--rate 1000] [--seconds 30]
                                     [--log-retention 0s]
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from rmq_spark import (
    LocalTransactionState,
    Message,
    Store,
    TransactionListener,
    TransactionMQProducer,
    get_spark,
)
from rmq_spark.model.config import StoreSettings, parse_duration

BODY = b"x" * 256


class CommitAll(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return LocalTransactionState.COMMIT

    def check_local_transaction(self, msg):
        return LocalTransactionState.COMMIT


def percentiles(seconds: list[float]) -> str:
    ms = np.array(seconds) * 1000
    return f"p50 {np.percentile(ms, 50):7.1f} ms  p99 {np.percentile(ms, 99):7.1f} ms"


def one_sender(store: Store, transactions: int) -> tuple[list[float], list[float]]:
    """Per transaction: seconds in ``send_message_in_transaction``, and until published."""
    sends, visible = [], []
    with TransactionMQProducer("latency", CommitAll(), store=store) as producer:
        for i in range(transactions):
            start = time.perf_counter()
            producer.send_message_in_transaction(Message("Latency", BODY, keys=f"k{i}"))
            sends.append(time.perf_counter() - start)
            producer.flush()
            visible.append(time.perf_counter() - start)
    return sends, visible


def commit_to_visible(
    store: Store, rate: int, seconds: float, senders: int, trigger: str, checkpoint: str
) -> tuple[list[float], int]:
    """Seconds from each COMMIT to the micro-batch that holds its message; messages sent.

    Measured in the steady state: one message is sent and awaited first, so that the first
    micro-batches, which start Spark's Python workers, are reported on their own.
    """
    spark = get_spark("rmq-latency-bench", extra_conf={"spark.ui.enabled": "false"})
    committed: dict[str, float] = {}
    seen: list[float] = []

    def batch(df, _batch_id: int) -> None:
        now = time.time()
        for row in df.select("msg_id").collect():
            if row.msg_id in committed:
                seen.append(now - committed[row.msg_id])

    query = (
        spark.readStream.format("rmqtx")
        .option("path", store.root)
        .option("topic", "Visible")
        .load()
        .writeStream.foreachBatch(batch)
        .option("checkpointLocation", checkpoint)
        .trigger(processingTime=trigger)
        .start()
    )
    sent, warm_batches = [0] * senders, -1
    try:
        with TransactionMQProducer("visible", CommitAll(), store=store) as producer:
            result = producer.send_message_in_transaction(Message("Visible", BODY, keys="warm"))
            committed[result.msg_id] = time.time()
            while not seen:
                time.sleep(0.05)
            print(f"  warm-up: the first message was seen after {seen.pop():.2f} s")
            # The warm-up batch may not have reported its progress yet: skip it as well.
            warm_batches = (query.lastProgress.batchId if query.lastProgress else -1) + 1
            stop = time.monotonic() + seconds

            def sender(n: int) -> None:
                interval, due = senders / rate, time.monotonic()
                while due < stop:
                    message = Message("Visible", BODY, keys=str(n))
                    result = producer.send_message_in_transaction(message)
                    committed[result.msg_id] = time.time()
                    sent[n] += 1
                    due += interval
                    time.sleep(max(0.0, due - time.monotonic()))

            pool = [threading.Thread(target=sender, args=(n,)) for n in range(senders)]
            for t in pool:
                t.start()
            for t in pool:
                t.join()
        deadline = time.monotonic() + 60
        while len(seen) < sum(sent) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        query.stop()
    print_durations([p for p in query.recentProgress if p.batchId > warm_batches])
    return seen, sum(sent)


def print_durations(progress: list) -> None:
    """Where a micro-batch's time goes: the median and maximum of each phase Spark reports."""
    phases: dict[str, list[int]] = {}
    for p in progress:
        if p.numInputRows:
            for phase, ms in p.durationMs.items():
                phases.setdefault(phase, []).append(ms)
    print("  micro-batches with rows, per phase (ms): median / max")
    for phase, ms in sorted(phases.items(), key=lambda kv: -np.median(kv[1])):
        print(f"    {phase:<18} {np.median(ms):7.0f} / {max(ms):7.0f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--transactions", type=int, default=400)
    parser.add_argument("--rate", type=int, default=1000, help="transactions/s for the stream")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--senders", type=int, default=32)
    parser.add_argument("--trigger", default="1 second")
    parser.add_argument(
        "--log-retention",
        help="the store's log_retention for the one-sender run (e.g. 0s: clean at every "
        "checkpoint, to see the cost of a store that has run longer than the retention)",
    )
    args = parser.parse_args()
    logging.getLogger("py4j").setLevel(logging.WARNING)
    with tempfile.TemporaryDirectory(prefix="rmq-bench-") as tmp:
        settings = StoreSettings()
        if args.log_retention is not None:
            settings = replace(settings, log_retention=parse_duration(args.log_retention, "log"))
        sends, visible = one_sender(
            Store.open(Path(tmp) / "one", settings=settings), args.transactions
        )
        print(f"one sender, {args.transactions} sequential transactions:")
        print(f"  send_message_in_transaction: {percentiles(sends)}  ({1 / np.mean(sends):.0f}/s)")
        print(f"  send to published (readable): {percentiles(visible)}")
        eighth = max(1, args.transactions // 8)
        first, last = slice(None, eighth), slice(-eighth, None)
        print(
            "  as the store grows, median send / send to readable: first eighth "
            f"{np.median(sends[first]) * 1000:.1f} / {np.median(visible[first]) * 1000:.1f} ms, "
            f"last eighth {np.median(sends[last]) * 1000:.1f} / "
            f"{np.median(visible[last]) * 1000:.1f} ms"
        )
        seen, sent = commit_to_visible(
            Store.open(Path(tmp) / "stream"),
            args.rate,
            args.seconds,
            args.senders,
            args.trigger,
            str(Path(tmp) / "checkpoint"),
        )
        print(
            f"commit to visible in a stream (trigger {args.trigger}), {sent / args.seconds:,.0f} "
            f"transactions/s from {args.senders} senders for {args.seconds:g} s:"
        )
        print(f"  {percentiles(seen)}  ({len(seen):,} of {sent:,} messages seen)")


if __name__ == "__main__":
    main()
