"""Real peer systems run side by side with rmq-spark's benchmarks, through the shared anchor
scripts (``../shared/anchors`` next to the repository, or ``$RMQ_SPARK_ANCHORS``).

* :func:`rocketmq_tx`: Apache RocketMQ's own ``TransactionProducer`` benchmark against a real
  name server and broker (``rocketmq/run.sh``).
* :func:`kafka_spark`: Spark's Kafka connector against a single-node KRaft broker
  (``kafka/fetch.sh``, ``kafka/broker.sh``, ``kafka/bench_kafka.py``).

The project does not need the anchors to build or test: when they are absent each function
logs one line saying why and returns ``None``. A peer that is present but fails raises
:class:`RuntimeError` with the tail of its output. The peers' own output goes to the DEBUG log.

Manual use::

    python bench/peers.py rocketmq --threads 64 --body-bytes 256 --seconds 60 --flush SYNC_FLUSH
    python bench/peers.py kafka --messages 100000
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import shutil
import subprocess
import threading
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("bench.peers")

ANCHORS_ENV = "RMQ_SPARK_ANCHORS"
#: Where ``kafka/fetch.sh`` puts the broker jars, the connector jars and the venv. The script
#: writes there unconditionally (it ignores ``KAFKA_ANCHOR_HOME``), so the other Kafka scripts
#: are pointed at the same place.
KAFKA_HOME = Path("/tmp/anchors/kafka")
FLUSH_TYPES = ("ASYNC_FLUSH", "SYNC_FLUSH")
TAIL_LINES = 40

_RMQ_LINE = re.compile(
    r"^rocketmq-tx threads=(?P<threads>\d+) body=(?P<body>\d+) tps=(?P<tps>\d+(?:\.\d+)?)\b"
    r"(?:.*?\bavg_rt_ms=(?P<rt>\d+(?:\.\d+)?))?"
)
_KAFKA_SINK = re.compile(
    r"^kafka-sink N=(?P<n>\d+) secs=(?P<secs>[\d.]+) parquet_secs=(?P<parquet>[\d.]+)\b"
)
_KAFKA_SOURCE = re.compile(r"^kafka-source N=(?P<n>\d+) secs=[\d.]+ msg_per_s=(?P<rate>[\d.]+)")


@dataclass(frozen=True)
class RocketMQResult:
    """The summary of one ``rocketmq/run.sh`` run.

    Attributes
    ----------
    threads : int
        Send threads of ``TransactionProducer``.
    body_bytes : int
        Message body size in bytes.
    flush : str
        The broker's ``flushDiskType``: ``"ASYNC_FLUSH"`` or ``"SYNC_FLUSH"``.
    tps : float
        Mean committed-send rate over the report windows after the warm-up one.
    avg_rt_ms : float or None
        Mean send round trip in milliseconds, when the summary line has it.
    line : str
        The raw ``rocketmq-tx ...`` summary line.
    """

    threads: int
    body_bytes: int
    flush: str
    tps: float
    avg_rt_ms: float | None
    line: str


@dataclass(frozen=True)
class KafkaResult:
    """The summary of one ``kafka/bench_kafka.py`` run.

    Attributes
    ----------
    messages : int
        Messages written to and read back from the topic.
    sink_seconds : float
        Seconds of ``df.write.format("kafka")`` for all messages.
    parquet_seconds : float
        Seconds of ``df.write.format("parquet")`` for the same cached rows.
    source_msgs_per_s : float
        Messages per second of ``readStream.format("kafka")`` into ``noop`` (after a warm-up).
    lines : list of str
        The raw ``kafka-sink ...`` and ``kafka-source ...`` lines.
    """

    messages: int
    sink_seconds: float
    parquet_seconds: float
    source_msgs_per_s: float
    lines: list[str]


def anchors_dir() -> Path | None:
    """The shared anchors directory, or ``None`` (logged) when it is absent.

    Returns
    -------
    pathlib.Path or None
        ``$RMQ_SPARK_ANCHORS`` when set, else ``<repo root>/../shared/anchors``, if it exists.
    """
    configured = os.environ.get(ANCHORS_ENV)
    if configured:
        path = Path(configured).expanduser()
    else:
        path = Path(__file__).resolve().parents[1].parent / "shared" / "anchors"
    if not path.is_dir():
        how = f"${ANCHORS_ENV}" if configured else f"default; set ${ANCHORS_ENV} to override"
        log.warning("peer anchors not found at %s (%s): skipping", path, how)
        return None
    return path


def _anchor_files(peer: str, names: Sequence[str]) -> Path | None:
    """The ``peer`` subdirectory of the anchors when it holds ``names`` and java is on PATH."""
    root = anchors_dir()
    if root is None:
        return None
    here = root / peer
    missing = [name for name in names if not (here / name).is_file()]
    if missing:
        log.warning("%s anchor incomplete at %s (missing %s): skipping", peer, here, missing)
        return None
    if shutil.which("java") is None:
        log.warning("%s anchor needs java on PATH, none found: skipping", peer)
        return None
    return here


def _run(
    cmd: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float | None = None
) -> list[str]:
    """Run ``cmd`` to completion, its output (stdout and stderr) to the DEBUG log.

    Parameters
    ----------
    cmd : sequence of str
        The command line.
    env : mapping, optional
        Variables added to this process's environment.
    timeout : float, optional
        Seconds before the command is sent SIGTERM (then SIGKILL after 60 s).

    Returns
    -------
    list of str
        Every output line.

    Raises
    ------
    PeerFailed
        When the command exits non-zero or times out; the message carries its output's tail,
        and ``lines`` every line.
    """
    name = next((Path(c).name for c in cmd if c.endswith((".sh", ".py"))), Path(cmd[0]).name)
    log.debug("run %s", " ".join(cmd))
    proc = subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        text=True,
        errors="replace",
        env={**os.environ, **env} if env else None,
    )
    lines: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            line = raw.rstrip("\n")
            lines.append(line)
            log.debug("[%s] %s", name, line)

    reader = threading.Thread(target=pump, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
    finally:
        if proc.poll() is None:  # timeout or interrupt: the scripts clean up on SIGTERM
            proc.terminate()
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        reader.join(timeout=10)
    if timed_out or proc.returncode != 0:
        why = f"timed out after {timeout:.0f} s" if timed_out else f"exit code {proc.returncode}"
        tail = "\n".join(deque(lines, maxlen=TAIL_LINES))
        raise PeerFailed(f"{' '.join(cmd)}: {why}; last output:\n{tail}", lines)
    return lines


class PeerFailed(RuntimeError):
    """A peer's script failed; ``lines`` is everything it printed."""

    def __init__(self, message: str, lines: list[str]) -> None:
        super().__init__(message)
        self.lines = lines


def _rocketmq_summary(threads: int, body_bytes: int, lines: list[str]) -> str | None:
    """The ``rocketmq-tx`` summary line computed from the benchmark's own 10 s reports the way
    ``run.sh`` computes it (the first window is warm-up), when the script died before printing
    it but after its reports (None: fewer than two reports)."""
    windows = [re.search(r"Send TPS:\s*(\d+).*?AVG RT\(ms\):\s*([\d.]+)", line) for line in lines]
    measured = [m for m in windows if m][1:]
    if not measured:
        return None
    tps = sum(int(m[1]) for m in measured) / len(measured)
    rt = sum(float(m[2]) for m in measured) / len(measured)
    return f"rocketmq-tx threads={threads} body={body_bytes} tps={tps:.0f} avg_rt_ms={rt:.1f}"


def rocketmq_tx(
    threads: int, body_bytes: int, seconds: int, flush: str = "ASYNC_FLUSH"
) -> RocketMQResult | None:
    """Transactional sends on a real RocketMQ 5.5.0 broker: ``rocketmq/run.sh``.

    Starts a name server and one broker on loopback with ``flushDiskType=<flush>``, runs
    RocketMQ's ``TransactionProducer`` benchmark (every local transaction commits), then stops
    both and deletes the store. Jars are fetched into ``/tmp/anchors/rocketmq`` on first use.

    Parameters
    ----------
    threads : int
        Send threads (each loops ``sendMessageInTransaction`` back to back).
    body_bytes : int
        Body size in bytes, at least 37 (the benchmark's header).
    seconds : int
        Benchmark time; the script reports every 10 s and drops the first (warm-up) window, so
        use a multiple of 10, at least 20 (anything else is rounded down to tens).
    flush : {"ASYNC_FLUSH", "SYNC_FLUSH"}
        The broker's ``flushDiskType``. ``ASYNC_FLUSH`` (the script's default) answers from the
        page cache; ``SYNC_FLUSH`` makes each half-message send wait for the disk flush.

    Returns
    -------
    RocketMQResult or None
        The parsed summary, or ``None`` (logged) when the anchors are absent.

    Raises
    ------
    ValueError
        On arguments the script would reject.
    RuntimeError
        When ``run.sh`` fails or prints no summary line.
    """
    if flush not in FLUSH_TYPES:
        raise ValueError(f"flush must be one of {FLUSH_TYPES}, not {flush!r}")
    if threads < 1 or body_bytes < 37 or seconds < 1:
        raise ValueError("need threads >= 1, body_bytes >= 37 and seconds >= 1")
    if seconds < 20 or seconds % 10:
        log.warning(
            "rocketmq: seconds=%d: reports come every 10 s and the first is warm-up; "
            "use a multiple of 10, >= 20",
            seconds,
        )
    here = _anchor_files("rocketmq", ["run.sh", "fetch.sh", "pom.xml"])
    if here is None:
        return None
    start = time.perf_counter()
    # start-up of two JVMs (<= 180 s by the script's own limits) + bench + verify + stop
    try:
        lines = _run(
            [str(here / "run.sh"), str(threads), str(body_bytes), str(seconds)],
            env={"FLUSH_DISK_TYPE": flush},
            timeout=seconds + 600,
        )
    except PeerFailed as failed:
        # run.sh has died after the benchmark (its note on unexpected checks ends in a SIGPIPE
        # under pipefail when there are many): its reports are still good.
        computed = _rocketmq_summary(threads, body_bytes, failed.lines)
        if computed is None:
            raise
        log.warning("rocketmq: %s; summary computed from its reports", str(failed).split(";")[0])
        lines = [*failed.lines, computed]
    summary = [m for m in map(_RMQ_LINE.match, lines) if m]
    if not summary:
        tail = "\n".join(lines[-TAIL_LINES:])
        raise RuntimeError(f"rocketmq run.sh printed no rocketmq-tx summary line:\n{tail}")
    for extra in lines:  # the script's own check of what reached the broker, and its warnings
        if extra.startswith("[verify]"):
            log.info("rocketmq: %s", extra)
        elif extra.startswith("[bench] note"):
            log.warning("rocketmq: %s", extra)
    m = summary[-1]
    line = m.string
    log.info("rocketmq: %s (flush=%s, %.0f s wall)", line, flush, time.perf_counter() - start)
    if "warm-up window only" in line:
        log.warning("rocketmq: only the warm-up window was measured; use seconds >= 20")
    return RocketMQResult(
        threads=int(m["threads"]),
        body_bytes=int(m["body"]),
        flush=flush,
        tps=float(m["tps"]),
        avg_rt_ms=float(m["rt"]) if m["rt"] is not None else None,
        line=line,
    )


def _kafka_fetched(home: Path) -> bool:
    """Whether ``kafka/fetch.sh`` has already filled ``home``."""
    return (
        (home / "venv" / "bin" / "python").is_file()
        and any((home / "broker-lib").glob("kafka_2.13-*.jar"))
        and any((home / "spark-lib").glob("spark-sql-kafka-0-10*.jar"))
    )


def kafka_spark(messages: int) -> KafkaResult | None:
    """Spark's Kafka connector against a real single-node Kafka 4.3.1 broker.

    Runs ``kafka/fetch.sh`` when the jars or the venv are missing under
    ``/tmp/anchors/kafka``, ``broker.sh start``, then ``bench_kafka.py N`` with the anchor's
    own venv (pyspark 4.2.0, ``local[2]``), and always ``broker.sh stop`` afterwards (the
    broker's messages are removed then).

    Parameters
    ----------
    messages : int
        Messages (1 KiB random bodies, ``id % 1000`` keys) written to a 4-partition topic and
        read back.

    Returns
    -------
    KafkaResult or None
        The parsed sink and source figures, or ``None`` (logged) when the anchors are absent.

    Raises
    ------
    ValueError
        When ``messages`` < 1.
    RuntimeError
        When a script fails, the broker is already running, or the summary lines are missing.
    """
    if messages < 1:
        raise ValueError("messages must be >= 1")
    here = _anchor_files("kafka", ["fetch.sh", "broker.sh", "bench_kafka.py"])
    if here is None:
        return None
    env = {"KAFKA_ANCHOR_HOME": str(KAFKA_HOME)}
    start = time.perf_counter()
    if not _kafka_fetched(KAFKA_HOME):
        log.info("kafka: fetching jars and venv into %s", KAFKA_HOME)
        _run([str(here / "fetch.sh")], env=env, timeout=3600)
    broker = str(here / "broker.sh")
    status = _run([broker, "status"], env=env, timeout=60)
    if any(line.startswith("running") for line in status):
        # Someone else's run (or a leftover): not ours to reuse or stop.
        raise RuntimeError(f"kafka anchor broker already {status[-1]}; stop it with {broker} stop")
    try:
        _run([broker, "start"], env=env, timeout=300)
        lines = _run(
            [
                str(KAFKA_HOME / "venv" / "bin" / "python"),
                str(here / "bench_kafka.py"),
                str(messages),
            ],
            env=env,
            timeout=1800 + messages / 100,
        )
    finally:
        _run([broker, "stop"], env=env, timeout=120)
        # The broker keeps the benchmark's messages (a GiB per million) until its next start.
        shutil.rmtree(KAFKA_HOME / "data" / "kraft-logs", ignore_errors=True)
    sink = [m for m in map(_KAFKA_SINK.match, lines) if m]
    source = [m for m in map(_KAFKA_SOURCE.match, lines) if m]
    if not sink or not source:
        tail = "\n".join(lines[-TAIL_LINES:])
        raise RuntimeError(f"bench_kafka.py printed no kafka-sink/kafka-source line:\n{tail}")
    s, r = sink[-1], source[-1]
    log.info("kafka: %s | %s (%.0f s wall)", s.string, r.string, time.perf_counter() - start)
    return KafkaResult(
        messages=int(s["n"]),
        sink_seconds=float(s["secs"]),
        parquet_seconds=float(s["parquet"]),
        source_msgs_per_s=float(r["rate"]),
        lines=[s.string, r.string],
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Command line: run one peer and print its parsed result.

    Parameters
    ----------
    argv : sequence of str, optional
        Arguments (default ``sys.argv[1:]``).

    Returns
    -------
    int
        0 on success, 1 when the peer's anchors are absent.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="stream the peers' output")
    sub = parser.add_subparsers(dest="peer", required=True)
    rmq = sub.add_parser("rocketmq", help="RocketMQ TransactionProducer (rocketmq/run.sh)")
    rmq.add_argument("--threads", type=int, default=64)
    rmq.add_argument("--body-bytes", type=int, default=256)
    rmq.add_argument("--seconds", type=int, default=60, help="multiple of 10, >= 20")
    rmq.add_argument("--flush", choices=FLUSH_TYPES, default="ASYNC_FLUSH")
    kafka = sub.add_parser("kafka", help="Spark's Kafka connector (kafka/bench_kafka.py)")
    kafka.add_argument("--messages", type=int, default=100_000)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    start = time.perf_counter()
    result: RocketMQResult | KafkaResult | None
    if args.peer == "rocketmq":
        result = rocketmq_tx(args.threads, args.body_bytes, args.seconds, args.flush)
    else:
        result = kafka_spark(args.messages)
    if result is None:
        return 1
    print(result)
    print(f"wall-clock {time.perf_counter() - start:.1f} s (incl. start-up and shutdown)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
