"""rmq-spark beside the systems users would run instead, measured in one run on one machine.

* producer: transactional sends/s with 64 senders (``producer_bench.py``) beside Apache
  RocketMQ's own ``TransactionProducer`` benchmark against a real broker, with ``SYNC_FLUSH``
  and with the default ``ASYNC_FLUSH``; one sender beside RocketMQ with one thread;
* latency: one sender's send and send-to-readable p50/p99, and commit to visible in a stream
  (``latency_bench.py``);
* sink: ``df.write.format("rmqtx")`` beside ``format("delta")`` (``sink_bench.py``, medians
  of pairs that alternate which goes first), and
  Spark's Kafka sink beside Parquet (the Kafka anchor);
* source: ``readStream.format("rmqtx")`` beside Delta's streaming source on the same
  CommitLog, with random and with repeated bodies (``source_bench.py``), and Spark's Kafka
  source on a local broker.

The peers come from the anchor scripts in ``../shared/anchors`` (see :mod:`peers`); a peer
that is not there is reported as such and its ratio left out. Each benchmark runs in its own
process, one after the other, so none shares the machine with another.

Usage: python bench/side_by_side.py [--messages 1000000] [--producer-messages 160000]
                                    [--rocketmq-seconds 60] [--sink-repeat 3]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import peers

HERE = Path(__file__).parent
T = TypeVar("T")


def run(script: str, *args: object) -> str:
    """Run a benchmark script in its own process; echo and return its output."""
    print(f"--- {script} {' '.join(map(str, args))}", flush=True)
    done = subprocess.run(
        [sys.executable, str(HERE / script), *map(str, args)],
        check=True,
        capture_output=True,
        text=True,
    )
    print(done.stdout, flush=True)
    return done.stdout


def measured(measure: Callable[..., T | None], *args: object, **kwargs: object) -> T | None:
    """A peer's figure, or None (reported as not run) when its script failed: one broken
    peer does not throw away the rest of an hour-long run."""
    try:
        return measure(*args, **kwargs)
    except RuntimeError as exc:
        print(f"!!! {getattr(measure, '__name__', 'peer')} failed: {exc}", flush=True)
        return None


def number(pattern: str, text: str) -> float | None:
    """The number the pattern's group captures in ``text`` (commas allowed), or None."""
    found = re.search(pattern, text)
    return None if found is None else float(found.group(1).replace(",", ""))


def ratio(mine: float | None, theirs: float | None) -> str:
    return "n/a" if not mine or not theirs else f"{mine / theirs:.2f}x"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--messages", type=int, default=1_000_000)
    # About as long as the broker's 60 s at 64 senders: a rate that falls as the store grows
    # shows (the one-sender run sends a tenth of them).
    parser.add_argument("--producer-messages", type=int, default=160_000)
    parser.add_argument("--rocketmq-seconds", type=int, default=60)
    # Pairs of sink writes (medians): the ratio of one pair swung from 0.95x to 1.67x.
    parser.add_argument("--sink-repeat", type=int, default=3)
    args = parser.parse_args()
    rows: list[tuple[str, str, str, str]] = []

    producer = run("producer_bench.py", "--messages", args.producer_messages)
    rmq_64 = number(r"\n\s+64\s+([\d,]+)", producer)
    tenths_64 = re.search(r"\n\s+64\s+[\d,]+\s+([\d,]+ / [\d,]+)", producer)
    rmq_1 = number(r"\n\s+1\s+([\d,]+)", producer)
    sync64 = measured(peers.rocketmq_tx, 64, 256, args.rocketmq_seconds, flush="SYNC_FLUSH")
    async64 = measured(peers.rocketmq_tx, 64, 256, args.rocketmq_seconds, flush="ASYNC_FLUSH")
    sync1 = measured(peers.rocketmq_tx, 1, 256, args.rocketmq_seconds, flush="SYNC_FLUSH")
    for label, peer in (("SYNC_FLUSH", sync64), ("ASYNC_FLUSH", async64)):
        rows.append(
            (
                "transactional sends/s, 64 senders, 256 B",
                f"{rmq_64:,.0f} (first/last tenth {tenths_64.group(1) if tenths_64 else 'n/a'})"
                if rmq_64
                else "n/a",
                f"RocketMQ {label}: {peer.tps:,.0f}" if peer else "RocketMQ: not run",
                ratio(rmq_64, peer.tps if peer else None)
                + (" (issue 47's goal: >= 1.00x)" if label == "ASYNC_FLUSH" else ""),
            )
        )
    rows.append(
        (
            "one sender, sequential transactions/s",
            f"{rmq_1:,.0f}" if rmq_1 else "n/a",
            f"RocketMQ SYNC_FLUSH, 1 thread: {sync1.tps:,.0f}" if sync1 else "RocketMQ: not run",
            ratio(rmq_1, sync1.tps if sync1 else None),
        )
    )

    latency = run("latency_bench.py")
    send = re.search(r"send_message_in_transaction: (p50 .*? ms\s+p99 .*? ms)", latency)
    readable = re.search(r"published \(readable\): (p50 .*? ms\s+p99 .*? ms)", latency)
    visible = re.search(r"commit to visible.*\n\s+(p50 .*? ms\s+p99 .*? ms)", latency)
    rows.append(
        (
            "one sender: send_message_in_transaction",
            send.group(1) if send else "n/a",
            f"RocketMQ avg send {sync1.avg_rt_ms} ms" if sync1 and sync1.avg_rt_ms else "",
            "issue 47's goal: p50 <= 2 ms",
        )
    )
    rows.append(("one sender: send to readable", readable.group(1) if readable else "n/a", "", ""))
    rows.append(
        (
            "commit to visible, 1 s trigger, 1,000 tx/s",
            visible.group(1) if visible else "n/a",
            "",
            "goal: p99 <= 2 s",
        )
    )

    sink = run("sink_bench.py", "--rows", args.messages, "--repeat", args.sink_repeat)
    found = re.search(r"local disk\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)x\s+([\d.]+)\s+([\d.]+)x", sink)
    sink_delta, sink_rmqtx, sink_ratio, staging, staging_ratio = (
        (float(g) for g in found.groups()) if found else (None,) * 5
    )
    kafka = measured(peers.kafka_spark, args.messages)
    kafka_sink = (
        f"; Kafka sink {kafka.sink_seconds:.1f} s, Parquet {kafka.parquet_seconds:.1f} s"
        if kafka
        else "; Kafka: not run"
    )
    rows.append(
        (
            f"sink: {args.messages:,} rows of 1 KiB, s (median of {args.sink_repeat})",
            f"{sink_rmqtx} (tasks' staging {staging})",
            f"delta {sink_delta}{kafka_sink}",
            f"{sink_ratio}x Delta (goal <= 1.25x); staging {staging_ratio}x"
            " (medians of the pairs' ratios)",
        )
    )
    for flag in ((), ("--repeated-body",)):
        source = run("source_bench.py", "--messages", args.messages, *flag)
        found = re.search(r"local disk\s+([\d,]+)\s+([\d,]+)\s+[\d.]+x", source)
        delta_rate, rmqtx_rate = (
            (float(g.replace(",", "")) for g in found.groups()) if found else (None, None)
        )
        peer = f"delta {delta_rate:,.0f}" if delta_rate else "delta: n/a"
        versus = f"{ratio(rmqtx_rate, delta_rate)} Delta"
        if kafka and not flag:
            peer += f"; Kafka {kafka.source_msgs_per_s:,.0f}"
            versus += f", {ratio(rmqtx_rate, kafka.source_msgs_per_s)} Kafka"
        kind = "repeated body" if flag else "random bodies"
        rows.append(
            (
                f"source msg/s, AvailableNow to noop, {kind}",
                f"{rmqtx_rate:,.0f}" if rmqtx_rate else "n/a",
                peer,
                versus,
            )
        )

    print("\n=== side by side, one run")
    width = max(len(r[0]) for r in rows)
    for measure, mine, peer, r in rows:
        print(f"{measure:<{width}} | {mine:<36} | {peer:<44} | {r}")


if __name__ == "__main__":
    main()
