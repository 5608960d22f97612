"""Consumers with the official RocketMQ 5 Python client: `rmqtx serve` beside RocketMQ's proxy.

What is measured (issue 50's benchmark), for each target one after the other in one run and for
each consumer count (``--consumers 1,16``), every consumer a process of its own running the
client's ``SimpleConsumer`` (receive 32, invisible 30 s, acknowledge each message):

* **throughput**: ``--messages`` normal messages are sent to a fresh topic first, then the
  consumers of a new group start together; messages received and acknowledged per second, from
  the start to the last acknowledgement;
* **latency**: the consumers of another new group wait on another fresh topic while a producer
  sends ``--rate`` messages a second for ``--seconds``; commit (the send's reply) to receive,
  p50 and p99 (ms), each message stamped with the producer's clock in a property.

Targets: **rocketmq**, Apache RocketMQ 5.5.0's gRPC proxy in local mode
(``bench/rocketmq_proxy.py``, the groups created with ``mqadmin updateSubGroup``; a new group
starts at a topic's first message while it is in memory); **serve**, ``rmqtx serve`` on a
fresh local store with ``--auto-offset-reset earliest`` (the same start), every topic served,
the access key checked. The table prints each row beside the proxy's and their ratio (issue
50's goal: at least 0.5x the proxy's throughput, p99 commit to receive within 1 s on a local
store).

Usage: python bench/consumer_bench.py [--consumers 1,16] [--messages 4000] [--rate 100]
                                      [--seconds 10] [--only rocketmq|serve] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from rocketmq_proxy import (  # noqa: E402
    CLUSTER,
    RocketMQProxy,
    free_port,
    port_open,
    stop_process,
)

REPO = HERE.parent
ACCESS_KEY, SECRET_KEY = "benchAccessKey", "benchSecretKey"
SERVE_SETTINGS = """\
[store]
path = "{store}"

[serve.accounts.{access_key}]
secret_key = "{secret_key}"
topics = ["*"]
subscribe = ["*"]
groups = ["*"]
"""

#: Seconds the consumer processes get to start before the clock does.
_START_SECONDS = 8.0


def _config(endpoint: str):  # noqa: ANN202
    from rocketmq import ClientConfiguration, Credentials

    return ClientConfiguration(endpoint, Credentials(ACCESS_KEY, SECRET_KEY), request_timeout=10)


def produce(endpoint: str, topic: str, count: int, rate: float) -> None:
    """Send ``count`` normal messages from 8 threads (``rate`` > 0: that many a second from
    one), each stamped with the send's time."""
    from rocketmq import Message, Producer

    producer = Producer(_config(endpoint), (topic,))
    producer.startup()
    try:

        def send(n: int) -> None:
            due = time.time()
            for _ in range(n):
                if rate:
                    due += 1 / rate
                    time.sleep(max(0.0, due - time.time()))
                m = Message()
                m.topic, m.body = topic, b"x" * 256
                m.add_property("sent", repr(time.time()))
                producer.send(m)

        threads = 1 if rate else 8
        workers = [
            threading.Thread(target=send, args=(count // threads + (i < count % threads),))
            for i in range(threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        producer.shutdown()


def consume(
    endpoint: str, topic: str, group: str, start: float, until: float, idle: float = 0.0
) -> dict:
    """One consumer: from ``start`` (wall clock) receive and acknowledge until ``until`` (or,
    with ``idle``, until it got nothing for that many seconds); the time of each
    acknowledgement and each message's commit-to-receive latency."""
    from rocketmq import FilterExpression, SimpleConsumer

    consumer = SimpleConsumer(
        _config(endpoint), group, {topic: FilterExpression("*")}, await_duration=2
    )
    consumer.startup()
    acked, latencies = [], []
    try:
        time.sleep(max(0.0, start - time.time()))
        while time.time() < until and not (
            idle and time.time() - max(acked[-1:] or [start]) > idle
        ):
            try:
                messages = consumer.receive(32, 30)
            except Exception:  # noqa: BLE001 (RocketMQ's proxy refuses receives for a while
                time.sleep(0.2)  # after the client's start: its settings are not in yet)
                continue
            for message in messages:
                received = time.time()
                consumer.ack(message)
                acked.append(time.time())
                latencies.append(received - float(message.properties["sent"]))
    finally:
        consumer.shutdown()
    return {"acked": acked, "latencies": latencies}


def run_consumers(
    endpoint: str,
    topic: str,
    group: str,
    consumers: int,
    seconds: float,
    home: Path,
    idle: float = 0.0,
) -> tuple[list[subprocess.Popen], float]:
    """``consumers`` processes of :func:`consume` started together (each stopping after
    ``seconds``, or ``idle`` seconds without a message), and the start (wall clock)."""
    start = time.time() + _START_SECONDS
    argv = [sys.executable, __file__, "--consume", endpoint, topic, group, str(start)]
    env = {**os.environ, "HOME": str(home)}
    procs = [
        subprocess.Popen([*argv, str(start + seconds), str(idle)], stdout=subprocess.PIPE, env=env)
        for _ in range(consumers)
    ]
    return procs, start


def collect(procs) -> list[dict]:  # noqa: ANN001
    results = []
    for p in procs:
        out, _ = p.communicate(timeout=600)
        if p.returncode:
            raise SystemExit(f"a consumer failed (exit {p.returncode})")
        results.append(json.loads(out.decode().strip().splitlines()[-1]))
    return results


def measure(target: str, endpoint: str, consumers: int, args, home: Path) -> dict:  # noqa: ANN001
    env = {**os.environ, "HOME": str(home)}
    topic = f"Bench{consumers}"
    subprocess.run(
        [sys.executable, __file__, "--produce", endpoint, topic, str(args.messages), "0"],
        env=env,
        check=True,
    )
    procs, start = run_consumers(
        endpoint, topic, f"bench-{consumers}", consumers, 120, home, idle=5.0
    )
    acked = sorted(t for r in collect(procs) for t in r["acked"])
    done = acked[args.messages - 1] if len(acked) >= args.messages else float("nan")
    throughput = args.messages / (done - start)
    # Latency: consumers wait on a fresh topic while a producer sends at a rate.
    topic = f"Latency{consumers}"
    subprocess.run(
        [sys.executable, __file__, "--produce", endpoint, topic, "1", "0"], env=env, check=True
    )  # the topic exists (the proxy's consumers need a route) and the group starts before
    # Every message counts: the consumers go on (up to 2 minutes) until none came for 8 s.
    procs, start = run_consumers(
        endpoint, topic, f"latency-{consumers}", consumers, 120, home, idle=8.0
    )
    time.sleep(max(0.0, start + 1 - time.time()))
    count = int(args.rate * args.seconds)
    subprocess.run(
        [sys.executable, __file__, "--produce", endpoint, topic, str(count), str(args.rate)],
        env=env,
        check=True,
    )
    latencies = np.array([x for r in collect(procs) for x in r["latencies"]]) * 1000
    p50, p99 = (float(np.percentile(latencies, q)) if len(latencies) else 0.0 for q in (50, 99))
    print(
        f"  {target}, {consumers} consumer(s): {throughput:.0f} msg/s received and acked "
        f"({len(acked)} acks); commit to receive p50 {p50:.0f} ms, p99 {p99:.0f} ms "
        f"({len(latencies)} of {count + 1})",
        flush=True,
    )
    return {"throughput": throughput, "p50": p50, "p99": p99}


def start_serve(folder: Path):  # noqa: ANN201
    """``rmqtx serve`` on a fresh store in ``folder``; its endpoint and a function that stops
    it."""
    folder.mkdir()
    conf = folder / "rmq-spark.toml"
    conf.write_text(
        SERVE_SETTINGS.format(store=folder / "store", access_key=ACCESS_KEY, secret_key=SECRET_KEY)
    )
    port = free_port()
    rmqtx = [str(REPO / ".venv" / "bin" / "rmqtx"), "--conf", str(conf), "serve"]
    with open(folder / "serve.out", "wb") as out:
        proc = subprocess.Popen(
            [*rmqtx, "--port", str(port), "--auto-offset-reset", "earliest"],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + 120
    while not port_open(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"rmqtx serve did not start: {(folder / 'serve.out').read_text()}")
        time.sleep(0.2)
    return f"127.0.0.1:{port}", lambda: stop_process("serve", proc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--consumers", default="1,16")
    parser.add_argument("--messages", type=int, default=4000)
    parser.add_argument("--rate", type=float, default=100.0)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--only", choices=["rocketmq", "serve"])
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    counts = [int(c) for c in args.consumers.split(",")]
    results: dict[str, dict[int, dict]] = {}
    work = Path(tempfile.mkdtemp(prefix="rmq-consumer-bench-"))
    home = work / "home"
    home.mkdir()
    for target in ("rocketmq", "serve"):
        if args.only and target != args.only:
            continue
        print(f"{target}:", flush=True)
        if target == "rocketmq":
            server = RocketMQProxy(grpc_port=0, keep=args.keep).start()
            for c in counts:
                for topic in (f"Bench{c}", f"Latency{c}"):
                    server.create_topic(topic, "NORMAL")
                for group in (f"bench-{c}", f"latency-{c}"):  # the proxy refuses unknown ones
                    server.mqadmin("updateSubGroup", "-c", CLUSTER, "-g", group)
            endpoint, stop = server.endpoint, server.stop
        else:
            endpoint, stop = start_serve(work / "serve")
        try:
            results[target] = {c: measure(target, endpoint, c, args, home) for c in counts}
        finally:
            stop()
    print(
        f"\n{'consumers':>10} {'target':>9} {'msg/s':>8} {'p50 ms':>8} {'p99 ms':>8} {'ratio':>6}"
    )
    for c in counts:
        for target, by_count in results.items():
            r = by_count[c]
            base = results.get("rocketmq", {}).get(c)
            ratio = f"{r['throughput'] / base['throughput']:.2f}x" if base else "-"
            print(
                f"{c:>9} {target:>9} {r['throughput']:9.0f} {r['p50']:9.0f} {r['p99']:9.0f} "
                f"{ratio:>9}"
            )


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--produce":
        endpoint, topic, count, rate = sys.argv[2:6]
        produce(endpoint, topic, int(count), float(rate))
    elif len(sys.argv) > 1 and sys.argv[1] == "--consume":
        endpoint, topic, group, start, until, *idle = sys.argv[2:8]
        result = consume(endpoint, topic, group, float(start), float(until), float(*idle or [0]))
        print(json.dumps(result), flush=True)
    else:
        main()
