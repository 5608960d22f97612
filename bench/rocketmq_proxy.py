"""Apache RocketMQ 5.5.0's gRPC proxy in local mode, as a reference server for benchmarks.

What it runs, all on loopback and all from jars fetched from Maven Central (no RocketMQ
distribution, nothing outside this repository at run time):

* ``fetch_jars()``: ``mvn dependency:copy-dependencies`` on ``bench/java_client/proxy-pom.xml``
  (``rocketmq-proxy``, ``rocketmq-namesrv``, ``rocketmq-tools`` 5.5.0 and their runtime
  dependencies) into ``.tools/rocketmq-5.5.0/lib``, with the Maven repository in
  ``.tools/rocketmq-5.5.0/.m2``. Idempotent: a marker file records the pom it was fetched for.
* ``RocketMQProxy``: a name server JVM (``NamesrvStartup``), then the proxy JVM
  (``ProxyStartup -pm local``), which embeds a broker (``BrokerController``) configured here:
  store directories under a temporary directory, a 128 MiB commit-log file instead of 1 GiB,
  ``-Xmx512m``, and the scan for transactions to check back every 2 s
  (``transactionCheckInterval``, default 30 s), so a transaction left open is checked 6-8 s
  after its send. ``transactionTimeOut`` stays at its default, 6 s: the broker writes its
  records of commits and rollbacks in batches every 3 s (``transactionOpBatchInterval``), so a
  shorter timeout makes it check transactions that were already committed. It waits until the
  proxy's gRPC port accepts connections, creates topics with ``mqadmin updateTopic``
  (``+message.type=TRANSACTION``: the route carries the topic's message type and the Java
  client refuses a transactional send to a NORMAL topic; a topic that does not exist fails the
  producer's start, ``autoCreateTopicEnable`` does not apply to gRPC routes), and on
  ``stop()`` sends SIGTERM to the two JVMs it started (by their pids; SIGKILL after a grace
  period) and deletes the temporary directory.

TLS: the proxy's gRPC port takes TLS and plaintext on the same port (``tls.server.mode``
defaults to ``permissive``), and with ``tlsTestModeEnable`` (the default, written out in the
proxy's config here) it serves a self-signed certificate it generates at start. The official
Java client has TLS on by default and does not verify the server's certificate, so it connects
as is.

Usage (by hand):
    python bench/rocketmq_proxy.py fetch
    python bench/rocketmq_proxy.py run [--grpc-port 8081] [--topic TopicA] [--keep]
        (starts everything, prints the endpoint, runs until Ctrl-C, then stops)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROCKETMQ_VERSION = "5.5.0"
REPO = Path(__file__).resolve().parent.parent
POM = REPO / "bench" / "java_client" / "proxy-pom.xml"
TOOLS = REPO / ".tools" / f"rocketmq-{ROCKETMQ_VERSION}"
CLUSTER = "DefaultCluster"
BROKER_NAME = "broker-bench"


def run_mvn(pom: Path, repo_local: Path, lib: Path) -> None:
    """Copy ``pom``'s runtime dependencies into ``lib`` (Maven repository ``repo_local``)."""
    if shutil.which("mvn") is None:
        raise RuntimeError("mvn (Apache Maven) is needed to fetch the jars from Maven Central")
    lib.mkdir(parents=True, exist_ok=True)
    print(f"fetching the jars of {pom.name} from Maven Central into {lib}", flush=True)
    result = subprocess.run(
        [
            "mvn",
            "--batch-mode",
            "--quiet",
            "-f",
            str(pom),
            f"-Dmaven.repo.local={repo_local}",
            "dependency:copy-dependencies",
            "-DincludeScope=runtime",
            f"-DoutputDirectory={lib}",
        ],
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise RuntimeError(f"mvn failed for {pom}:\n{result.stdout[-4000:]}{result.stderr[-4000:]}")


def fetch_jars(pom: Path = POM, tools: Path = TOOLS) -> Path:
    """Fetch the jars ``pom`` names into ``tools/lib`` unless already there; returns ``lib``."""
    lib = tools / "lib"
    marker = lib / ".fetched"
    stamp = pom.read_text()
    if marker.exists() and marker.read_text() == stamp:
        return lib
    run_mvn(pom, tools / ".m2", lib)
    marker.write_text(stamp)
    return lib


def bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A free port below Linux's ephemeral range (32768 and up): a port there that is free now
    can be taken by any outgoing connection before the server binds it (seen on a busy host)."""
    for _ in range(1000):
        port = random.randrange(20000, 32000)
        if bindable(port):
            return port
    raise RuntimeError("no free port in 20000-32000")


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def free_port_block(offsets: tuple[int, ...]) -> int:
    """A base port ``p`` with ``p + o`` free for every offset (the broker opens p-2, p, p+1)."""
    for _ in range(100):
        base = free_port()
        if all(bindable(base + o) for o in offsets):
            return base
    raise RuntimeError("no free block of ports for the broker")


def wait_until(
    what: str, ready: Callable[[], bool], proc: subprocess.Popen, log: Path, timeout: float
) -> None:
    """Poll ``ready()`` until true; fail with the log's tail if ``proc`` exits or time runs out."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ready():
            return
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}:\n{tail(log)}")
        time.sleep(0.2)
    raise RuntimeError(f"{what} not up after {timeout:.0f} s:\n{tail(log)}")


def tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return f"(no {path})"


def stop_process(name: str, proc: subprocess.Popen, grace: float = 30) -> None:
    """SIGTERM one process started here, SIGKILL after ``grace`` seconds."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        print(f"  {name} pid {proc.pid} did not stop, killing", file=sys.stderr)
        proc.kill()
        proc.wait()


class RocketMQProxy:
    """A name server and a local-mode proxy (with its embedded broker), started and stopped here.

    ``grpc_port=0`` picks a free port. Use as a context manager or call ``start()``/``stop()``.
    """

    def __init__(
        self,
        grpc_port: int = 8081,
        workdir: Path | None = None,
        heap: str = "512m",
        keep: bool = False,
        check_after_ms: int = 6000,
        check_interval_ms: int = 2000,
    ) -> None:
        self._auto_grpc_port = grpc_port == 0
        self.grpc_port = grpc_port or free_port()
        self.heap = heap
        self.keep = keep
        self.check_after_ms = check_after_ms
        self.check_interval_ms = check_interval_ms
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="rocketmq-proxy-"))
        self.lib: Path | None = None
        self.namesrv_port = 0
        self.broker_port = 0
        self.remoting_port = 0
        self._procs: dict[str, subprocess.Popen] = {}

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def namesrv(self) -> str:
        return f"127.0.0.1:{self.namesrv_port}"

    def _java(self, name: str, main: str, args: list[str], heap: str, logback: str) -> None:
        home = self.workdir / "home"
        home.mkdir(parents=True, exist_ok=True)
        log = self.workdir / f"{name}.out"
        cmd = [
            "java",
            "-server",
            f"-Xms{heap}",
            f"-Xmx{heap}",
            f"-XX:MaxDirectMemorySize={heap}",
            "-XX:+UseG1GC",
            "-Djava.net.preferIPv4Stack=true",
            # RocketMQ logs to ${user.home}/logs/rocketmqlogs; keep them in the work directory.
            f"-Duser.home={home}",
            f"-Drocketmq.home.dir={self.workdir}",
            # One lib directory holds every module's logback file: pick this JVM's.
            f"-Drmq.logback.configurationFile={logback}",
            "-cp",
            f"{self.lib}/*",
            main,
            *args,
        ]
        with open(log, "wb") as out:
            self._procs[name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )

    def _write_configs(self) -> tuple[Path, Path, Path]:
        store = self.workdir / "store"
        namesrv_conf = self.workdir / "namesrv.conf"
        namesrv_conf.write_text(f"listenPort={self.namesrv_port}\nbindAddress=127.0.0.1\n")
        broker_conf = self.workdir / "broker.conf"
        broker_conf.write_text(
            "\n".join(
                [
                    f"brokerClusterName={CLUSTER}",
                    f"brokerName={BROKER_NAME}",
                    "brokerId=0",
                    "brokerRole=ASYNC_MASTER",
                    # the default, written out: SEND_OK once in the page cache, fsync later
                    "flushDiskType=ASYNC_FLUSH",
                    f"namesrvAddr={self.namesrv}",
                    "brokerIP1=127.0.0.1",
                    "bindAddress=127.0.0.1",
                    f"listenPort={self.broker_port}",
                    f"storePathRootDir={store}",
                    f"storePathCommitLog={store}/commitlog",
                    # 128 MiB commit-log files (default 1 GiB, mmapped)
                    "mappedFileSizeCommitLog=134217728",
                    "autoCreateTopicEnable=true",
                    # check back half messages older than this (ms), scanning this often
                    f"transactionTimeOut={self.check_after_ms}",
                    f"transactionCheckInterval={self.check_interval_ms}",
                    "",
                ]
            )
        )
        proxy_conf = self.workdir / "rmq-proxy.json"
        proxy_conf.write_text(
            json.dumps(
                {
                    "rocketMQClusterName": CLUSTER,
                    "proxyMode": "local",
                    "namesrvAddr": self.namesrv,
                    "grpcServerPort": self.grpc_port,
                    "remotingListenPort": self.remoting_port,
                    "brokerConfigPath": str(broker_conf),
                    # TLS with a self-signed certificate made at start (plaintext also accepted)
                    "tlsTestModeEnable": True,
                },
                indent=2,
            )
        )
        return namesrv_conf, broker_conf, proxy_conf

    def start(self, topics: tuple[str, ...] = (), attempts: int = 3) -> RocketMQProxy:
        """Start both JVMs and create ``topics``; new ports and another try on a port clash."""
        self.lib = fetch_jars()
        for attempt in range(1, attempts + 1):
            try:
                self._start_once()
                for topic in topics:
                    self.create_topic(topic)
                return self
            except BaseException as exc:
                self._stop_jvms()
                if attempt < attempts and "Address already in use" in str(exc):
                    print("[rocketmq] a port was taken meanwhile, new ports", file=sys.stderr)
                    if self._auto_grpc_port:
                        self.grpc_port = free_port()
                    continue
                self.stop()
                raise
        raise AssertionError("unreachable")

    def _start_once(self) -> None:
        if port_open(self.grpc_port):
            raise RuntimeError(f"port {self.grpc_port} is already in use")
        self.namesrv_port = free_port()
        self.remoting_port = free_port()
        self.broker_port = free_port_block((-2, 0, 1))
        shutil.rmtree(self.workdir / "store", ignore_errors=True)  # from a failed attempt
        namesrv_conf, broker_conf, proxy_conf = self._write_configs()
        self._java(
            "namesrv",
            "org.apache.rocketmq.namesrv.NamesrvStartup",
            ["-c", str(namesrv_conf)],
            "256m",
            "rmq.namesrv.logback.xml",
        )
        wait_until(
            "name server",
            lambda: port_open(self.namesrv_port),
            self._procs["namesrv"],
            self.workdir / "namesrv.out",
            60,
        )
        self._java(
            "proxy",
            "org.apache.rocketmq.proxy.ProxyStartup",
            ["-pm", "local", "-pc", str(proxy_conf), "-bc", str(broker_conf)],
            self.heap,
            "rmq.proxy.logback.xml",
        )
        out = self.workdir / "proxy.out"
        wait_until(
            "proxy",
            lambda: (
                "startup successfully" in out.read_text(errors="replace")
                and port_open(self.grpc_port)
            ),
            self._procs["proxy"],
            out,
            120,
        )

    def mqadmin(self, *args: str) -> str:
        """Run ``mqadmin`` (RocketMQ's admin tool) against this name server; returns stdout."""
        home = self.workdir / "home"
        result = subprocess.run(
            [
                "java",
                "-Xmx256m",
                f"-Duser.home={home}",
                f"-Drocketmq.home.dir={self.workdir}",
                "-Drmq.logback.configurationFile=rmq.tools.logback.xml",
                "-cp",
                f"{self.lib}/*",
                "org.apache.rocketmq.tools.command.MQAdminStartup",
                *args,
                "-n",
                self.namesrv,
            ],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"mqadmin {args[0]} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def create_topic(self, topic: str, message_type: str = "TRANSACTION", queues: int = 8) -> None:
        """Create ``topic`` on the cluster with RocketMQ 5's ``message.type`` attribute."""
        # The broker registers with the name server a moment after it boots; until then the
        # cluster is unknown to mqadmin.
        deadline = time.monotonic() + 60
        while True:
            try:
                out = self.mqadmin(
                    "updateTopic",
                    "-c",
                    CLUSTER,
                    "-t",
                    topic,
                    "-r",
                    str(queues),
                    "-w",
                    str(queues),
                    "-a",
                    f"+message.type={message_type}",
                )
                if "success" in out:
                    return
                err = out
            except RuntimeError as exc:
                err = str(exc)
            if time.monotonic() > deadline:
                raise RuntimeError(f"could not create topic {topic}:\n{err}")
            time.sleep(1)

    def _stop_jvms(self, grace: float = 30) -> None:
        """SIGTERM the JVMs started here (proxy first), SIGKILL after ``grace`` seconds."""
        for name in ("proxy", "namesrv"):
            proc = self._procs.pop(name, None)
            if proc is not None:
                stop_process(f"[rocketmq] {name}", proc, grace)

    def stop(self, grace: float = 30) -> None:
        """Stop the JVMs; delete the work directory if it was made here (unless ``keep``)."""
        self._stop_jvms(grace)
        if self._own_workdir and not self.keep:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> RocketMQProxy:
        return self.start() if not self._procs else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("fetch", help="fetch the jars into .tools/ (idempotent)")
    run = sub.add_parser("run", help="start name server + proxy, run until Ctrl-C")
    run.add_argument("--grpc-port", type=int, default=8081, help="0: any free port")
    run.add_argument("--topic", action="append", default=[], help="TRANSACTION topic to create")
    run.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    args = parser.parse_args()
    if args.command == "fetch":
        lib = fetch_jars()
        print(f"{len(list(lib.glob('*.jar')))} jars in {lib}")
        return
    proxy = RocketMQProxy(grpc_port=args.grpc_port, keep=args.keep)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    try:
        proxy.start(topics=tuple(args.topic or ["TopicA"]))
        print(
            f"RocketMQ {ROCKETMQ_VERSION} proxy (local mode): gRPC {proxy.endpoint}, "
            f"name server {proxy.namesrv}, work dir {proxy.workdir}",
            flush=True,
        )
        while not stop:
            time.sleep(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        proxy.stop()


if __name__ == "__main__":
    main()
