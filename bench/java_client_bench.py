"""Transactional sends with the official RocketMQ 5 Java client: `rmqtx serve` beside RocketMQ.

What is measured (issue 34's benchmark): the official Java client
(``org.apache.rocketmq:rocketmq-client-java``, from Maven Central) running
``bench/java_client/TransactionalProducer.java``, its transactional-producer example:
``beginTransaction()``, ``send(message, transaction)``, ``commit()``, back to back from
``SENDERS`` threads sharing one ``Producer``. Per transaction, the latency is send + commit as the
client sees it (``commit()`` returns when the server answered the EndTransaction); tx/s is the
number of committed transactions over the wall time of the measured loop. Before the clock
starts, each run sends ``--warmup`` transactions (JIT, TLS handshakes, route lookups) that are not
counted. After the loop the producer rolls one transaction back and leaves one open
(``open-0``), then waits up to ``--open-wait`` seconds for the server to ask its
``TransactionChecker`` about it over the telemetry stream: "checked" says whether that happened.

Targets, one after the other in one run (never at the same time: they would share the CPUs):

* **rocketmq**: Apache RocketMQ 5.5.0's gRPC proxy in local mode (embedded broker, async flush:
  SEND_OK once the message is in the page cache), started by ``bench/rocketmq_proxy.py`` with
  the topic created as a TRANSACTION topic. The client connects with TLS (the proxy's
  self-signed test certificate).
* **serve**: ``rmqtx serve`` on a fresh local store (a temporary directory), TLS with a
  self-signed certificate made here with openssl, the access key checked, and beside it the
  check-back job (``rmqtx check --interval 5s``, the topic's group with ``kind = "clients"``),
  which lists the open transactions the server asks the clients about. Its default TLS mode,
  ``permissive``, relays each connection through the port it shares between TLS and
  plaintext; ``--serve-tls-modes permissive,enforcing`` runs it a second time as
  ``serve-enforcing`` (TLS straight to the gRPC server) to show what the relay costs.

Each target runs the producer once per sender count (``--senders 1,64`` with ``--count
200,3000``), each in a fresh JVM. The table has tx/s, p50 and p99 (ms), errors and whether
``open-0`` was checked, then the ratio serve/rocketmq of tx/s at each sender count and issue
47's goals beside what was measured: at least 1.0x RocketMQ's proxy at 64 senders and 0.5x at
one, with a p99 at most twice the proxy's.

Jars: ``bench/java_client/pom.xml`` into ``.tools/java-client/lib`` and
``bench/java_client/proxy-pom.xml`` into ``.tools/rocketmq-5.5.0/lib`` (``mvn``, once); the
producer is compiled with ``javac`` into ``.tools/java-client/classes``. Needs a JDK (17 is what
was used), Maven and openssl.

Usage: python bench/java_client_bench.py [--senders 1,64] [--count 200,3000]
           [--warmup 500,1280] [--open-wait 90] [--only rocketmq|serve]
           [--serve-tls-modes permissive,enforcing] [--keep] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from rocketmq_proxy import (  # noqa: E402
    RocketMQProxy,
    free_port,
    port_open,
    run_mvn,
    stop_process,
    tail,
)

REPO = Path(__file__).resolve().parent.parent
CLIENT_DIR = REPO / "bench" / "java_client"
CLIENT_TOOLS = REPO / ".tools" / "java-client"
TOPIC = "TopicA"
ACCESS_KEY = "yourAccessKey"
SECRET_KEY = "yourSecretKey"


#: The settings of the serve target's store: the check-back job asks the topic's clients
#: (through the server) about transactions open for 2 s; the client's account.
SERVE_SETTINGS = """\
[store]
path = "{store}"

[serve.accounts.{access_key}]
secret_key = "{secret_key}"
topics = ["{topic}"]

[transaction]
transaction_timeout = "2s"
transaction_check_interval = "2s"

[checkers.{topic}]
kind = "clients"
"""


def serve_commands(
    conf: Path, port: int, cert: Path, key: Path, topic: str, tls_mode: str = "permissive"
) -> list[list[str]]:
    """`rmqtx serve` and the check-back job beside it, on the store of ``conf``."""
    rmqtx = [str(REPO / ".venv" / "bin" / "rmqtx"), "--conf", str(conf)]
    serve = ["serve", "--port", str(port), "--tls-cert", str(cert), "--tls-key", str(key)]
    serve += ["--tls-mode", tls_mode, "--topic", topic]
    return [rmqtx + serve, rmqtx + ["check", "--interval", "5s"]]


@dataclass
class Result:
    target: str
    senders: int
    count: int
    sends: int
    errors: int
    seconds: float
    tx_per_s: float
    p50_ms: float
    p99_ms: float
    checked_open: bool
    checked: list[str] = field(default_factory=list)


def client_classpath() -> str:
    """Fetch the Java client (once), compile TransactionalProducer (when changed): classpath."""
    lib = CLIENT_TOOLS / "lib"
    marker = lib / ".fetched"
    pom = CLIENT_DIR / "pom.xml"
    if not (marker.exists() and marker.read_text() == pom.read_text()):
        run_mvn(pom, CLIENT_TOOLS / ".m2", lib)
        marker.write_text(pom.read_text())
    source = CLIENT_DIR / "TransactionalProducer.java"
    classes = CLIENT_TOOLS / "classes"
    compiled = classes / "TransactionalProducer.class"
    if not compiled.exists() or compiled.stat().st_mtime < source.stat().st_mtime:
        classes.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            ["javac", "-d", str(classes), "-cp", f"{lib}/*", str(source)],
            check=True,
        )
    return f"{lib}/*{os.pathsep}{classes}"


def run_producer(
    classpath: str,
    target: str,
    endpoint: str,
    senders: int,
    count: int,
    warmup: int,
    open_wait: int,
    home: Path,
) -> Result:
    """One run of TransactionalProducer in a fresh JVM; its JSON line as a Result."""
    home.mkdir(parents=True, exist_ok=True)
    cmd = [
        "java",
        "-Xmx1g",
        # the client logs to ${user.home}/logs/rocketmq/: keep that out of the real home
        f"-Duser.home={home}",
        "-cp",
        classpath,
        "TransactionalProducer",
        endpoint,
        TOPIC,
        ACCESS_KEY,
        SECRET_KEY,
        str(count),
        str(senders),
        str(open_wait),
        str(warmup),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600 + open_wait)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(
            f"producer against {target} failed ({proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )
    # the shaded client finds no SLF4J binding and says so; anything else is worth showing
    noise = [line for line in proc.stderr.splitlines() if line and not line.startswith("SLF4J:")]
    if noise:
        print(f"  [{target}] producer stderr ({len(noise)} lines):", *noise[:5], sep="\n    ")
    out = json.loads(lines[-1])
    ms = np.array(out["latencies_ms"] or [float("nan")])
    return Result(
        target=target,
        senders=senders,
        count=count,
        sends=out["sends"],
        errors=out["errors"],
        seconds=out["seconds"],
        tx_per_s=out["sends"] / out["seconds"] if out["seconds"] else 0.0,
        p50_ms=float(np.percentile(ms, 50)),
        p99_ms=float(np.percentile(ms, 99)),
        checked_open="open-0" in out["checked"],
        checked=sorted(set(out["checked"])),
    )


def make_cert(directory: Path) -> tuple[Path, Path]:
    """A self-signed certificate for localhost / 127.0.0.1 (openssl), valid one day."""
    cert, key = directory / "cert.pem", directory / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "1",
            "-subj",
            "/CN=localhost",
            "-addext",
            "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


class Serve:
    """`rmqtx serve` and the check-back job on a fresh store, TLS, started and stopped here."""

    def __init__(self, workdir: Path, topic: str = TOPIC, tls_mode: str = "permissive") -> None:
        self.workdir = workdir
        self.port = free_port()
        self.cert, self.key = make_cert(workdir)
        self.store = workdir / "store"
        conf = workdir / "rmq-spark.toml"
        conf.write_text(
            SERVE_SETTINGS.format(
                store=self.store, topic=topic, access_key=ACCESS_KEY, secret_key=SECRET_KEY
            )
        )
        self.cmd, self.check_cmd = serve_commands(
            conf, self.port, self.cert, self.key, topic, tls_mode
        )
        self.procs: list[tuple[str, subprocess.Popen]] = []

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _spawn(self, name: str, cmd: list[str]) -> subprocess.Popen:
        print(f"  {name}:", shlex.join(cmd), flush=True)
        with open(self.workdir / f"{name}.out", "wb") as out:
            proc = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
        self.procs.append((name, proc))
        return proc

    def start(self) -> None:
        proc = self._spawn("serve", self.cmd)
        log = self.workdir / "serve.out"
        deadline = time.monotonic() + 120
        while not port_open(self.port):
            if proc.poll() is not None:
                raise RuntimeError(f"serve exited with {proc.returncode}:\n{tail(log)}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"serve not listening after 120 s:\n{tail(log)}")
            time.sleep(0.2)
        self._spawn("check-back", self.check_cmd)

    def stop(self) -> None:
        """The check-back job first, serve last."""
        while self.procs:
            name, proc = self.procs.pop()
            stop_process(name, proc)


def run_target(
    target: str,
    endpoint: str,
    classpath: str,
    plan: list[tuple[int, int, int]],
    open_wait: int,
    home: Path,
) -> list[Result]:
    results = []
    for senders, count, warmup in plan:
        result = run_producer(classpath, target, endpoint, senders, count, warmup, open_wait, home)
        print(
            f"  {target}: {senders} senders, {result.sends} tx in {result.seconds:.2f} s = "
            f"{result.tx_per_s:.0f} tx/s, p50 {result.p50_ms:.1f} ms, p99 {result.p99_ms:.1f} "
            f"ms, errors {result.errors}, checked {result.checked[:5]}",
            flush=True,
        )
        results.append(result)
    return results


def table(results: list[Result]) -> str:
    rows = [
        f"{'target':<16} {'senders':>7} {'tx/s':>8} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'errors':>6}  open-0 checked"
    ]
    for r in results:
        rows.append(
            f"{r.target:<16} {r.senders:>7} {r.tx_per_s:>8.0f} {r.p50_ms:>8.1f} {r.p99_ms:>8.1f} "
            f"{r.errors:>6}  {'yes' if r.checked_open else 'no'}"
        )
    by = {(r.target, r.senders): r for r in results}
    for senders in sorted({r.senders for r in results}):
        serve = by.get(("serve", senders))
        for base in sorted({r.target for r in results} - {"serve"}):
            other = by.get((base, senders))
            if serve and other and other.tx_per_s:
                rows.append(
                    f"serve/{base} at {senders} senders: {serve.tx_per_s / other.tx_per_s:.2f}x "
                    f"tx/s, p99 {serve.p99_ms:.1f} vs {other.p99_ms:.1f} ms"
                )
    rows += goals(by)
    return "\n".join(rows)


#: Issue 47's goal for ``rmqtx serve``: its tx/s at least this share of RocketMQ's proxy's, by
#: sender count, with a p99 at most twice the proxy's.
GOALS = {1: 0.5, 64: 1.0}


def goals(by: dict[tuple[str, int], Result]) -> list[str]:
    """Issue 47's goals, each beside what the run measured (serve against rocketmq)."""
    rows = []
    for senders, share in GOALS.items():
        serve, proxy = by.get(("serve", senders)), by.get(("rocketmq", senders))
        if serve and proxy and proxy.tx_per_s and proxy.p99_ms:
            ratio, p99 = serve.tx_per_s / proxy.tx_per_s, serve.p99_ms / proxy.p99_ms
            met = ratio >= share and p99 <= 2
            rows.append(
                f"goal at {senders} senders: >= {share:.1f}x tx/s and p99 <= 2x the proxy's: "
                f"{ratio:.2f}x, p99 {p99:.1f}x  {'met' if met else 'missed'}"
            )
    return rows


def int_list(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--senders", type=int_list, default=[1, 64])
    parser.add_argument("--count", type=int_list, default=[200, 3000], help="per sender count")
    parser.add_argument("--warmup", type=int_list, default=[500, 1280], help="per sender count")
    parser.add_argument("--open-wait", type=int, default=90, help="seconds to wait for open-0")
    parser.add_argument("--only", choices=["rocketmq", "serve"], help="run one target only")
    parser.add_argument(
        "--serve-tls-modes",
        default="permissive",
        help="the serve target once per TLS mode (serve, serve-enforcing, ...)",
    )
    parser.add_argument("--proxy-heap", default="512m", help="heap of the proxy+broker JVM")
    parser.add_argument("--keep", action="store_true", help="keep work directories (logs)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    if not (len(args.senders) == len(args.count) == len(args.warmup)):
        parser.error("--senders, --count and --warmup need one value per sender count")
    for tool in ("java", "javac", "mvn", "openssl"):
        if shutil.which(tool) is None:
            parser.error(f"{tool} is needed")
    plan = list(zip(args.senders, args.count, args.warmup, strict=True))
    # SIGTERM unwinds like Ctrl-C, so the servers started here are stopped on the way out
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))

    classpath = client_classpath()
    workdir = Path(tempfile.mkdtemp(prefix="java-client-bench-"))
    results: list[Result] = []
    try:
        if args.only in (None, "rocketmq"):
            print(
                f"rocketmq: starting the RocketMQ 5.5.0 proxy (local mode), heap {args.proxy_heap}",
                flush=True,
            )
            proxy = RocketMQProxy(grpc_port=0, heap=args.proxy_heap, keep=args.keep)
            with proxy.start(topics=(TOPIC,)):
                print(f"  proxy: {proxy.endpoint} (work dir {proxy.workdir})", flush=True)
                results += run_target(
                    "rocketmq",
                    proxy.endpoint,
                    classpath,
                    plan,
                    args.open_wait,
                    workdir / "home-rocketmq",
                )
        for mode in args.serve_tls_modes.split(",") if args.only in (None, "serve") else ():
            target = "serve" if mode == "permissive" else f"serve-{mode}"
            print(f"{target}: starting on a fresh local store, --tls-mode {mode}", flush=True)
            (workdir / target).mkdir()
            serve = Serve(workdir / target, tls_mode=mode)
            try:
                serve.start()
                results += run_target(
                    target,
                    serve.endpoint,
                    classpath,
                    plan,
                    args.open_wait,
                    workdir / f"home-{target}",
                )
            finally:
                serve.stop()
    finally:
        if args.keep:
            print(f"work directory kept: {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)

    print()
    print(table(results))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps([asdict(r) for r in results], indent=2) + "\n")


if __name__ == "__main__":
    main()
