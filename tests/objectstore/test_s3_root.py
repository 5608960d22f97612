"""A store root on S3, served by a real MinIO server: the CLI and its exit codes, check-back,
Spark's sink and source, and storage options that would break the contract.

(The contract tests of tests/unit/test_store.py and tests/integration/test_processes.py run
on an S3 root too, through the ``any_store`` fixture; tests/cluster runs Spark executors on
a standalone cluster against one.)
"""

from __future__ import annotations

import contextlib
import http.client
import http.server
import json
import os
import subprocess
import sys
import textwrap
import threading
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import functions as F

from rmq_spark import (
    LocalTransactionState,
    Message,
    StorageConfigError,
    Store,
    TransactionListener,
    TransactionMQProducer,
)
from rmq_spark.delta.storage import filesystem
from rmq_spark.model.config import Settings, StoreSettings
from tests.conftest import commitlog, committing, settings_file

pytestmark = pytest.mark.objectstore
REPO = Path(__file__).resolve().parents[2]


def rmqtx(conf: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--conf", str(conf), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_status_tail_and_check_back_on_s3(s3_store: Store, tmp_path: Path) -> None:
    store = s3_store
    store.send([Message("Orders", f"n{i}") for i in range(3)], "shop")
    store.prepare(
        [Message("Orders", "c", tags="COMMIT"), Message("Orders", "r", tags="ROLLBACK")], "pg"
    )
    conf = settings_file(store, tmp_path)
    # Reading the store must not abort the interpreter at exit (deltalake's to_pyarrow_table
    # did, now and then, on S3): every run's exit code is the truth.
    for _ in range(6):
        status = rmqtx(conf, "status", "--json")
        assert status.returncode == 0, status.stderr
    figures = json.loads(status.stdout)
    assert figures["topics"][0]["committed"] == 3
    tail = rmqtx(conf, "tail", "Orders", "-n", "5")
    assert tail.returncode == 0, tail.stderr
    assert all(f"n{i}" in tail.stdout for i in range(3))
    # Check-back on S3: Spark reads the store's tables through S3A (jars and settings from
    # get_spark), and the checker's answers are published.
    check = rmqtx(conf, "check", "--once", "--checker", "pg=tests.checker_functions:by_tag")
    assert check.returncode == 0, check.stderr[-3000:]
    bodies = sorted(commitlog(store).column("body").to_pylist())
    assert bodies == [b"c", b"n0", b"n1", b"n2"]


def test_options_turning_off_conditional_writes_are_refused(minio, tmp_path: Path) -> None:
    root = minio.root("unsafe")
    unsafe = {**minio.storage_options, "AWS_S3_LOCKING_PROVIDER": "dynamodb"}
    settings = Settings(store=StoreSettings(path=root, storage_options=unsafe))
    with pytest.raises(StorageConfigError, match="AWS_S3_LOCKING_PROVIDER.*conditional writes"):
        Store.open(settings=settings)
    fs, path = filesystem(root, minio.storage_options)
    assert not fs.exists(path)  # nothing was written
    conf = tmp_path / "unsafe.toml"
    options = ", ".join(f'{k} = "{v}"' for k, v in unsafe.items())
    conf.write_text(f'[store]\npath = "{root}"\nstorage_options = {{ {options} }}\n')
    status = rmqtx(conf, "status")
    assert status.returncode == 2
    assert "UNSAFE_STORAGE" in status.stderr and "AWS_S3_LOCKING_PROVIDER" in status.stderr


def test_spark_sink_and_source_on_s3_with_storage_options(spark, minio, tmp_path: Path) -> None:
    """The root and its credentials given only as ``storage.<KEY>`` options: the sink's tasks,
    its driver-side publish, and the source's planning and read tasks all reach MinIO."""
    root = minio.root("spark")
    storage = {f"storage.{k}": v for k, v in minio.storage_options.items()}
    rows = spark.range(40).select(F.col("id").cast("string").alias("body"))
    (
        rows.repartition(3)
        .write.format("rmqtx")
        .mode("append")
        .option("path", root)
        .option("topic", "Orders")
        .option("producerGroup", "pipeline")
        .options(**storage)
        .save()
    )
    read = spark.read.format("rmqtx").option("path", root).option("topic", "Orders")
    batch = read.options(**storage).load()
    assert sorted(int(r.body) for r in batch.select("body").collect()) == list(range(40))
    offsets = batch.groupBy("queue_id").agg(F.count("*").alias("n"), F.max("queue_offset"))
    assert all(r["n"] == r["max(queue_offset)"] + 1 for r in offsets.collect())  # dense
    stream = (
        spark.readStream.format("rmqtx")
        .option("path", root)
        .option("topic", "Orders")
        .options(**storage)
        .load()
        .writeStream.format("memory")
        .queryName("s3_stream")
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    stream.awaitTermination(300)
    assert spark.table("s3_stream").count() == 40


class _NoConditionalWrites(http.server.BaseHTTPRequestHandler):
    """A proxy in front of MinIO that answers a refused conditional PUT (412) with 200, as an
    object store that ignores If-None-Match does: the losing writer believes it committed."""

    protocol_version = "HTTP/1.1"
    upstream = ""

    def _forward(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else None
        host = urllib.parse.urlsplit(self.upstream).netloc
        connection = http.client.HTTPConnection(host, timeout=60)
        headers = {k: v for k, v in self.headers.items() if k.lower() != "connection"}
        connection.request(self.command, self.path, body=body, headers=headers)
        answer = connection.getresponse()
        data = answer.read()
        status = answer.status
        if status == 412 and self.command == "PUT" and "If-None-Match" in self.headers:
            status, data = 200, b""
        self.send_response(status)
        for key, value in answer.getheaders():
            if key.lower() not in ("content-length", "transfer-encoding", "connection"):
                self.send_header(key, value)
        length = answer.getheader("Content-Length") if self.command == "HEAD" else None
        self.send_header("Content-Length", length or str(len(data)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)
        connection.close()

    do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _forward

    def log_message(self, *args: object) -> None:
        pass


@contextlib.contextmanager
def _ignoring_conditional_writes(minio) -> Iterator[dict[str, str]]:
    """Storage options that reach MinIO through a :class:`_NoConditionalWrites` proxy."""
    handler = type("Proxy", (_NoConditionalWrites,), {"upstream": minio.endpoint})
    proxy = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=proxy.serve_forever, daemon=True).start()
    try:
        yield {**minio.storage_options, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.server_port}"}
    finally:
        proxy.shutdown()


def test_a_store_ignoring_conditional_writes_is_refused(minio) -> None:
    with _ignoring_conditional_writes(minio) as options:
        root = minio.root("ignores-if-none-match")
        settings = Settings(store=StoreSettings(path=root, storage_options=options))
        with pytest.raises(StorageConfigError, match="does not honour conditional writes"):
            Store.open(settings=settings)
        fs, path = filesystem(root, minio.storage_options)
        assert not fs.exists(path)  # no store was made, and the probe cleaned up after itself


def test_an_existing_store_reached_through_such_an_endpoint_refuses_writes(minio) -> None:
    """The probe ran only when a store was created: an existing store opened through an
    endpoint that ignores If-None-Match (the environment, per-read options or a gateway can
    change it after creation) took sends whose commits could overwrite each other. The first
    write of a process to a root and endpoint probes it; reads need no write permission."""
    root = minio.root("existing")
    Store.open(
        settings=Settings(store=StoreSettings(path=root, storage_options=minio.storage_options))
    )
    with _ignoring_conditional_writes(minio) as options:
        store = Store.open(
            settings=Settings(store=StoreSettings(path=root, storage_options=options))
        )
        assert store.read("half").num_rows == 0
        with pytest.raises(StorageConfigError, match="does not honour conditional writes"):
            store.prepare([Message("T", b"unsafe")], "pg")
        assert store.read("half").num_rows == 0


class _Orders(TransactionListener):
    def execute_local_transaction(self, msg, arg):
        return arg

    def check_local_transaction(self, msg):
        return LocalTransactionState.UNKNOWN


def test_a_producer_configured_only_by_the_settings_file_sends_to_s3(
    s3_store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RMQ_SPARK_CONF", str(settings_file(s3_store, tmp_path)))
    with TransactionMQProducer("shop", _Orders()) as producer:
        assert producer.store.root == s3_store.root
        for i, state in enumerate(["COMMIT", "ROLLBACK", "COMMIT"]):
            producer.send_message_in_transaction(Message("Orders", f"o{i}"), arg=state)
        producer.send(Message("Orders", "normal"))
    assert sorted(commitlog(s3_store).column("body").to_pylist()) == [b"normal", b"o0", b"o2"]


def test_s3_credentials_stay_off_the_spark_driver_s_command_line(tmp_path: Path) -> None:
    """get_spark put the secret key and session token into the builder's spark.hadoop.fs.s3a.*
    settings, which PySpark hands to spark-submit as arguments: anyone on the host could read
    them with ps. They are set in the Hadoop configuration once the JVM is up."""
    secret, token = "SECRET-" + "x" * 16, "TOKEN-" + "y" * 16
    child = textwrap.dedent(
        """
        import os, sys
        from rmq_spark.model.config import Settings, StoreSettings
        from rmq_spark.spark.session import get_spark
        secret, token = os.environ["TEST_SECRET"], os.environ["TEST_TOKEN"]
        options = {"AWS_ACCESS_KEY_ID": "AK", "AWS_SECRET_ACCESS_KEY": secret,
                   "AWS_SESSION_TOKEN": token, "AWS_ENDPOINT_URL": "http://127.0.0.1:9"}
        settings = Settings(store=StoreSettings(path="s3://b/root", storage_options=options))
        spark = get_spark("secrets", settings=settings)
        conf = spark.sparkContext._jsc.hadoopConfiguration()
        print("HADOOP", conf.get("fs.s3a.secret.key") == secret,
              conf.get("fs.s3a.session.token") == token, flush=True)
        lines = []
        for pid in os.listdir("/proc"):
            try:
                lines.append(open(f"/proc/{pid}/cmdline", "rb").read())
            except OSError:
                pass
        print("ON_A_COMMAND_LINE", any(secret.encode() in c or token.encode() in c
                                       for c in lines), flush=True)
        spark.stop()
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", child],
        capture_output=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "TEST_SECRET": secret, "TEST_TOKEN": token},
    )
    out = proc.stdout.decode()
    assert "HADOOP True True" in out, proc.stderr.decode()[-2000:]
    assert "ON_A_COMMAND_LINE False" in out


def _open_sharded(root: str, options: dict[str, str], shards: int, barrier, out) -> None:
    barrier.wait()
    settings = StoreSettings(path=root, queue_nums=2, shards=shards, storage_options=options)
    try:
        store = Store.open(settings=settings)
        out.put((str(os.getpid()), (shards, [s.shard for s in store.shards(refresh=True)])))
    except Exception as exc:  # reported, not raised: the race's other sides still report
        out.put((str(os.getpid()), f"{type(exc).__name__}: {exc}"))


@pytest.mark.parametrize("shards", [(4, 4, 4), (4, 2, 3)])
def test_producers_starting_together_on_a_fresh_s3_root_all_open_it(minio, shards) -> None:
    """docs/deployment.md's deployment: several producer processes start at once on a fresh s3://
    root, each asking for shards. Each opens the store (none trips over another's probe,
    half-made shard or rewritten marker) with at least the shards it asked for, and the store
    ends with as many as the largest asked for."""
    from tests.conftest import race

    for _ in range(3):
        root = minio.root()
        results = race(_open_sharded, [(root, minio.storage_options, n) for n in shards])
        assert all(isinstance(r, tuple) for r in results.values()), results
        assert all(seen[:asked] == list(range(asked)) for asked, seen in results.values())
        settings = StoreSettings(path=root, storage_options=minio.storage_options)
        opened = Store.open(settings=settings, create=False)
        assert opened.shard_numbers(refresh=True) == list(range(max(shards)))


def _grow_one_at_a_time(root: str, options: dict[str, str], barrier, out) -> None:
    barrier.wait()
    settings = StoreSettings(path=root, queue_nums=2, storage_options=options)
    store = Store.open(settings=settings, create=False)
    for n in range(3, 13):
        store.grow(n)
    out.put(("grower", n))


def test_a_reader_looking_for_shards_while_the_store_grows_never_fails(minio) -> None:
    """The streaming source looks for new shards every few seconds, check-back and status at
    start: while another process grows the store (its root marker rewritten in place), each
    look succeeds, and the shards it finds only grow."""
    import multiprocessing as mp

    root = minio.root()
    settings = StoreSettings(
        path=root, queue_nums=2, shards=2, storage_options=minio.storage_options
    )
    reader = Store.open(settings=settings)
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    grower = ctx.Process(
        target=_grow_one_at_a_time, args=(root, minio.storage_options, barrier, out)
    )
    grower.start()
    barrier.wait()
    seen = [reader.shard_numbers(refresh=True)]
    while grower.is_alive():
        seen.append(reader.shard_numbers(refresh=True))
    seen.append(reader.shard_numbers(refresh=True))
    grower.join(timeout=60)
    assert out.get(timeout=10) == ("grower", 12)
    assert seen[-1] == list(range(12))
    assert all(len(a) <= len(b) for a, b in zip(seen, seen[1:], strict=False))


def test_vacuum_on_s3_deletes_what_was_removed_long_ago_and_only_that(s3_store: Store) -> None:
    """VACUUM by removal time on an object store: the removals written down under the table
    (a prefix that does not exist yet at first), read back when due, deleted in bulk."""
    s3_store = committing(s3_store)
    import time

    from rmq_spark.model.config import RetentionSettings
    from rmq_spark.store.retention import maintain

    for i in range(4):
        s3_store.prepare([Message("Orders", f"o-{i}".encode())], "pg")
    s3_store.table("half").alter.set_table_properties(
        {"delta.deletedFileRetentionDuration": "interval 1 seconds"}
    )
    s3_store.compact("half")
    fs, path = filesystem(s3_store.table_uri("half"), s3_store.settings.storage_options)

    def data_files() -> set[str]:
        fs.invalidate_cache()
        return {p for p in fs.find(path) if p.endswith(".parquet") and "/_" not in p[len(path) :]}

    before = data_files()
    maintain(s3_store, RetentionSettings())
    assert data_files() == before
    assert fs.find(f"{path}/_rmqtx_vacuum")  # written down
    time.sleep(2.5)
    s3_store.table("half").create_checkpoint()
    summary = maintain(s3_store, RetentionSettings())
    live = {f"{path}/{p}" for p in s3_store.data_files("half").column("path").to_pylist()}
    assert data_files() == live and summary.files_vacuumed["half"] == len(before) - len(live)
    assert sorted(s3_store.read("half").column("body").to_pylist()) == [
        f"o-{i}".encode() for i in range(4)
    ]
