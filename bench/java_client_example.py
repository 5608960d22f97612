"""The official RocketMQ 5 Java client's transactional-producer example, unchanged but for the
endpoint, against `rmqtx serve` (issue 34), on demand: ``make java-client-example``.

The client's jar (``org.apache.rocketmq:rocketmq-client-java`` 5.0.8, from Maven Central) holds
the compiled example, ``org.apache.rocketmq.client.java.example.ProducerTransactionMessageExample``,
and the ``ProducerSingleton`` it takes its producer from, whose source names the endpoint
(``foobar.com:8080``). This script takes ``ProducerSingleton.java`` from the client's sources
jar, puts the server's endpoint in place of ``foobar.com:8080``, compiles it ahead of the jar
on the classpath and runs the jar's example class as it is: its topic
(``yourTransactionTopic``) and access key and secret (``yourAccessKey``, ``yourSecretKey``) are
what the server is started with. TLS as the client's default. Then it reads the store with
``format("rmqtx")`` and exits 0 when the example's committed message is there exactly once, 1
otherwise.

Needs a JDK, Maven and openssl (as ``make bench-serve``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]

from java_client_bench import CLIENT_TOOLS, Serve, client_classpath  # noqa: E402

VERSION = "5.0.8"
EXAMPLE = "org.apache.rocketmq.client.java.example.ProducerTransactionMessageExample"
SINGLETON = "org/apache/rocketmq/client/java/example/ProducerSingleton.java"
TOPIC = "yourTransactionTopic"
BODY = b"This is a transaction message for Apache RocketMQ"


def sources_jar() -> Path:
    """The client's sources jar, from Maven Central (once)."""
    repo = CLIENT_TOOLS / ".m2"
    artifact = f"org.apache.rocketmq:rocketmq-client-java:{VERSION}:jar:sources"
    jar = repo / "org/apache/rocketmq/rocketmq-client-java" / VERSION
    jar = jar / f"rocketmq-client-java-{VERSION}-sources.jar"
    if not jar.exists():
        subprocess.run(
            ["mvn", "-B", "-q", "dependency:get", f"-Dartifact={artifact}"]
            + [f"-Dmaven.repo.local={repo}"],
            check=True,
        )
    return jar


def singleton_for(endpoint: str, classes: Path, classpath: str) -> None:
    """Compile ``ProducerSingleton`` with ``endpoint`` for ``foobar.com:8080`` into ``classes``."""
    source = zipfile.ZipFile(sources_jar()).read(SINGLETON).decode()
    assert '"foobar.com:8080"' in source, "the example's endpoint is not where it was"
    path = classes.parent / "src" / SINGLETON
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source.replace('"foobar.com:8080"', f'"{endpoint}"'))
    classes.mkdir(parents=True, exist_ok=True)
    subprocess.run(["javac", "-d", str(classes), "-cp", classpath, str(path)], check=True)


def wait_for_commit(store: Path, example: subprocess.Popen, seconds: float) -> bool:
    """Whether the example's transaction was committed (in ``op``) within ``seconds``."""
    from rmq_spark import Store

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and example.poll() is None:
        if store.exists():
            op = Store.open(store, create=False).read("op", ["decision"])
            if "COMMIT" in op.column("decision").to_pylist():
                return True
        time.sleep(0.5)
    return False


def read_back(store: Path) -> list[bytes]:
    """The bodies of the topic's committed messages, read with ``format("rmqtx")``."""
    from rmq_spark.spark.session import get_spark

    spark = get_spark("java-client-example", master="local[1]")
    rows = (
        spark.read.format("rmqtx").option("path", str(store)).option("topic", TOPIC).load()
    ).collect()
    spark.stop()
    return [bytes(r.body) for r in rows]


def main() -> int:
    classpath = client_classpath()
    with tempfile.TemporaryDirectory(prefix="java-client-example-") as tmp:
        work = Path(tmp)
        serve = Serve(work, topic=TOPIC)
        classes = work / "classes"
        singleton_for(serve.endpoint, classes, classpath)
        serve.start()
        try:
            # The example leaves its producer open (its close() is commented out), so its JVM
            # does not exit: it is stopped once the message is committed, or after 120 s.
            example = subprocess.Popen(
                ["java", "-cp", f"{classes}:{classpath}", EXAMPLE],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                cwd=work,
                env={**os.environ, "HOME": str(work)},
            )
            committed = wait_for_commit(serve.store, example, 120)
            example.terminate()
            example.wait(30)
        finally:
            serve.stop()
        print(f"the example's transaction {'committed' if committed else 'NOT committed'}")
        if not committed:
            return 1
        bodies = read_back(serve.store)
    print(f"committed messages of {TOPIC} read with format('rmqtx'): {bodies}")
    ok = bodies == [BODY]
    print("PASS: the example's message is there exactly once" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
