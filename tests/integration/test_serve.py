"""``rmqtx serve`` as a real process, with RocketMQ's official Python client
(``rocketmq-python-client``) and a raw gRPC stub in child processes
(tests/serve_clients/producer.py); what they did is read back from the store's tables."""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import importlib.util
import json
import os
import re
import signal
import ssl
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from rmq_spark import Store
from rmq_spark.checkback.checkers import CallableChecker, ClientsChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import TransactionSettings
from rmq_spark.model.messages import shard_of
from tests.conftest import settings_file
from tests.lifetime import die_with_parent

# Not imported here: importing the client creates ~/logs/rocketmq_python/ in the real home.
pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("rocketmq") is None,
    reason="the serve extra (rocketmq-python-client) is not installed",
)

CLIENT = Path(__file__).resolve().parents[1] / "serve_clients" / "producer.py"
AK, SK = "test-ak", "test-sk"
MAX_BODY = 65536
SETTINGS = f"""\
[store]
max_body_bytes = {MAX_BODY}

[transaction]
transaction_timeout = "2s"
transaction_check_interval = "1s"
"""
#: Two accounts: the tests' clients (TxOrders, Orders) and another (Billing only).
ACCOUNTS = f"""
[serve.accounts.{AK}]
secret_key = "{SK}"
topics = ["Orders", "TxOrders"]

[serve.accounts.billing]
secret_key_env = "BILLING_SECRET_KEY"
topics = ["Billing*"]
"""
BILLING_SK = "b1ll1ng-secret"
#: The raw scenario's messages that must be refused (RAW-<name>-<run id>).
REFUSED_NAMES = {
    "SYSPROP",
    "IMMUNITY",
    "CONTROL",
    "DELAYED",
    "GROUPED",
    "HUGE",
    "TRUNCATED",
    "BOMB",
}
LISTENING = re.compile(r"listening on [\d.]+:(\d+)")


@dataclass
class Server:
    process: subprocess.Popen[bytes]
    endpoint: str
    root: Path
    log: Path

    def stop(self, timeout: float = 60) -> int:
        self.process.send_signal(signal.SIGTERM)
        return self.process.wait(timeout)


def start_server(folder: Path, *extra: str, conf: Path | None = None, accounts: str = "") -> Server:
    """``rmqtx serve`` on a new store under ``folder`` (or the store of the settings file
    ``conf``) with ``accounts`` (settings), on a free port."""
    folder.mkdir(parents=True, exist_ok=True)
    root, log = folder / "store", folder / "server.log"
    command = [sys.executable, "-m", "rmq_spark.ops.cli"]
    if conf is None:
        conf = folder / "rmq-spark.toml"
        conf.write_text(SETTINGS + accounts)
        command += ["--path", str(root)]
    command += ["--conf", str(conf), "serve"]
    with log.open("wb") as out:
        process = subprocess.Popen(
            [*command, "--port", "0", *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=die_with_parent,
            env={**os.environ, "BILLING_SECRET_KEY": BILLING_SK},
        )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        found = LISTENING.search(log.read_text())
        if found:
            return Server(process, f"127.0.0.1:{found.group(1)}", root, log)
        assert process.poll() is None, log.read_text()
        time.sleep(0.1)
    process.kill()
    raise AssertionError(f"the server did not start:\n{log.read_text()}")


def run_client(
    folder: Path,
    server: Server,
    scenario: str,
    *args: str,
    access: str = AK,
    secret: str = SK,
    env: dict[str, str] | None = None,
    client: Path = CLIENT,
):
    """Run a client scenario (of ``client``) in a child process; return its JSON result."""
    home = folder / "home"
    home.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, str(client), scenario, server.endpoint, access, secret, *args],
        env={**os.environ, "HOME": str(home), **(env or {})},
        capture_output=True,
        timeout=120,
        preexec_fn=die_with_parent,
    )
    assert done.returncode == 0, done.stderr.decode() + done.stdout.decode()
    return json.loads(done.stdout.decode().strip().splitlines()[-1])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A server with two accounts and three topics, shared by the module's tests."""
    folder = tmp_path_factory.mktemp("serve")
    topics = ("--topic", "Orders", "--topic", "TxOrders", "--topic", "Billing")
    served = start_server(folder, *topics, accounts=ACCOUNTS)
    try:
        yield served
    finally:
        if served.process.poll() is None:
            served.stop()


def stored(root: Path | Store, timeout: float = 30, until=lambda counts: True) -> Counter[str]:
    """How many times each client message id (``UNIQ_KEY``) is in the CommitLog (of every
    shard), once
    ``until(counts)`` holds (COMMITs are published in the background) or ``timeout`` passed."""
    store = root if isinstance(root, Store) else Store.open(root, create=False)
    deadline = time.monotonic() + timeout
    while True:
        counts = Counter(
            dict(p)["UNIQ_KEY"]
            for p in store.read("commitlog", ["properties"]).column("properties").to_pylist()
        )
        if until(counts) or time.monotonic() > deadline:
            return counts
        time.sleep(0.2)


def decisions(root: Path) -> dict[str, tuple[str, str]]:
    op = Store.open(root, create=False).read("op").to_pylist()
    return {r["transaction_id"]: (r["decision"], r["decided_by"]) for r in op}


def test_send_commit_rollback_with_the_official_client(server: Server, tmp_path: Path) -> None:
    result = run_client(tmp_path, server, "basic")
    counts = stored(server.root, until=lambda c: c[result["committed"]] > 0)
    assert counts[result["normal"]] == 1
    assert counts[result["committed"]] == 1
    assert counts[result["rolled_back"]] == 0
    assert "40008" in result["refused"] and "already ROLLBACK" in result["refused"]
    ops = decisions(server.root)
    assert ops[result["committed_txn"]] == ("COMMIT", "producer")
    assert ops[result["rolled_back_txn"]] == ("ROLLBACK", "producer")
    rows = Store.open(server.root, create=False).read("commitlog").to_pylist()
    (normal,) = [r for r in rows if dict(r["properties"])["UNIQ_KEY"] == result["normal"]]
    assert (normal["topic"], normal["producer_group"]) == ("Orders", "Orders")
    assert (normal["tags"], normal["keys"], normal["body"]) == ("TagA", "k-normal", b"normal")
    assert dict(normal["properties"])["origin"] == "serve-test"


@contextlib.contextmanager
def check_back_job(spark, root: Path, group: str) -> Iterator[CheckBackJob]:
    """The check-back job on a thread, with the ``clients`` checker for ``group``: it keeps
    the ``pending`` table the server reads, and counts the checks."""
    store = Store.open(root, create=False)
    job = CheckBackJob(
        spark,
        store,
        {group: ClientsChecker()},
        TransactionSettings(transaction_timeout=2.0, transaction_check_interval=1.0),
    )
    stop = threading.Event()
    thread = threading.Thread(target=job.run_forever, args=(1.0, stop))
    thread.start()
    try:
        yield job
    finally:
        stop.set()
        thread.join(120)


def test_open_transactions_resolved_by_the_clients_checker(
    spark, server: Server, tmp_path: Path
) -> None:
    """The check-back job (``kind = "clients"`` for the topic's group) and the server together:
    the job keeps the pending transactions, the server asks the group's connected clients."""
    orphan = run_client(tmp_path / "killed", server, "orphan")
    # A new client of the group answers for the one that died, and for its own open ones.
    with check_back_job(spark, server.root, "TxOrders"):
        result = run_client(tmp_path / "new", server, "checked", orphan["orphan"])
    commit_id, commit_txn = result["sent"]["commit: open"]
    rollback_id, rollback_txn = result["sent"]["rollback: open"]
    assert {k: result["checked"].get(k) for k in (orphan["orphan"], commit_id, rollback_id)} == {
        orphan["orphan"]: "COMMIT",
        commit_id: "COMMIT",
        rollback_id: "ROLLBACK",
    }
    ops = decisions(server.root)
    assert ops[orphan["orphan_txn"]] == ("COMMIT", "check-back:client")
    assert ops[commit_txn] == ("COMMIT", "check-back:client")
    assert ops[rollback_txn] == ("ROLLBACK", "check-back:client")
    counts = stored(server.root, until=lambda c: c[commit_id] and c[orphan["orphan"]])
    assert (counts[orphan["orphan"]], counts[commit_id], counts[rollback_id]) == (1, 1, 0)
    # Read as every consumer reads: format("rmqtx"), exactly once, the rolled back never.
    read = (
        spark.read.format("rmqtx")
        .option("path", str(server.root))
        .option("topic", "TxOrders")
        .load()
        .selectExpr("properties['UNIQ_KEY'] AS id")
        .collect()
    )
    ids = Counter(r.id for r in read)
    assert (ids[orphan["orphan"]], ids[commit_id], ids[rollback_id]) == (1, 1, 0)


def test_two_accounts_cannot_send_to_end_or_be_asked_about_each_others_transactions(
    spark, server: Server, tmp_path: Path
) -> None:
    """RocketMQ's ACL, kept small: account ``billing`` may publish to ``Billing*`` only. Its
    key neither routes, sends to nor ends a transaction of ``TxOrders`` (an open one of the
    tests' account), and a stream of it that declares ``TxOrders`` is asked about nothing,
    while one of the owner's is (and its answer, with no ``source`` as the Go client sends,
    is recorded as a check answer)."""
    orphan = run_client(tmp_path / "killed", server, "orphan")
    other = {"access": "billing", "secret": BILLING_SK}
    crossed = run_client(tmp_path / "cross", server, "cross", orphan["orphan_txn"], **other)
    assert crossed["route"][0] == "FORBIDDEN"
    assert (
        "'billing' may neither publish to nor subscribe to topic 'TxOrders'" in crossed["route"][1]
    )
    assert crossed["send"] == "FORBIDDEN" and crossed["end"][0] == "FORBIDDEN"
    assert crossed["own_send"] == "OK"
    # The official client signed as billing: its producer of TxOrders gets no route.
    official = run_client(tmp_path / "official", server, "refused-send", "TxOrders", **other)
    assert official["refused"]
    client_log = (tmp_path / "official/home/logs/rocketmq_python/rocketmq_client.log").read_text()
    assert "40300" in client_log and "publish to nor subscribe to topic 'TxOrders'" in client_log
    assert orphan["orphan_txn"] not in decisions(server.root)
    with check_back_job(spark, server.root, "TxOrders"):
        # Neither answers: the server asks the group's clients in turn, every second.
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            heard = {
                who: pool.submit(run_client, tmp_path / who, server, "listen", "10", "none", **a)
                for who, a in [("owner", {}), ("other", other)]
            }
            asked = {who: f.result()["asked"] for who, f in heard.items()}
        assert orphan["orphan_txn"] in asked["owner"]
        assert asked["other"] == []
        run_client(tmp_path / "answer", server, "listen", "10", "commit")
    assert decisions(server.root)[orphan["orphan_txn"]] == ("COMMIT", "check-back:client")


def run_go(
    binary: Path, server: Server, folder: Path, *args: str, env: dict[str, str] | None = None
) -> list[dict[str, str]]:
    """Run the Go client against ``server`` as the tests' account (or as ``env`` says);
    return what it reported."""
    folder.mkdir(parents=True)
    account = {"RMQTX_ACCESS_KEY": AK, "RMQTX_SECRET_KEY": SK, "RMQTX_TOPIC": "TxOrders"}
    done = subprocess.run(
        [str(binary), *args],
        env={
            **os.environ,
            "HOME": str(folder),
            "RMQTX_ENDPOINT": server.endpoint,
            **account,
            **(env or {}),
        },
        capture_output=True,
        timeout=180,
        preexec_fn=die_with_parent,
    )
    assert done.returncode == 0, done.stderr.decode()[-3000:] + done.stdout.decode()[-3000:]
    reported = []
    for line in done.stdout.decode().splitlines():
        with contextlib.suppress(ValueError):
            fields = json.loads(line)
            if isinstance(fields, dict) and {"sent", "checked", "consumed"} & set(fields):
                reported.append(fields)
    return reported


def test_the_go_clients_transaction_example_runs_with_its_defaults(
    spark, server: Server, go_client: Path, tmp_path: Path
) -> None:
    """The Go client (golang/v5 5.1.4) uses TLS unless told otherwise, and its transaction
    example never turns it off: against a default server it runs unchanged but for the
    endpoint, and a transaction it leaves open is answered by its checker."""
    sent = [r["sent"] for r in run_go(go_client, server, tmp_path / "example", "example", "3")]
    assert len(sent) == 3
    with check_back_job(spark, server.root, "TxOrders"):
        reported = run_go(go_client, server, tmp_path / "open", "open")
    (opened,) = [r for r in reported if "sent" in r]
    assert {"checked": opened["sent"]} in reported
    assert decisions(server.root)[opened["transaction"]] == ("COMMIT", "check-back:client")
    ids = [*sent, opened["sent"]]
    stored(server.root, until=lambda c: all(c[i] for i in ids))
    read = (
        spark.read.format("rmqtx")
        .option("path", str(server.root))
        .option("topic", "TxOrders")
        .load()
        .selectExpr("properties['UNIQ_KEY'] AS id", "tags", "keys")
        .collect()
    )
    found = Counter(r.id for r in read if r.id in ids)
    assert found == dict.fromkeys(ids, 1)
    assert {(r.tags, r.keys) for r in read if r.id in ids} == {("ab", "a b")}


def test_wrong_secret_and_unknown_topic_refused(server: Server, tmp_path: Path) -> None:
    wrong = run_client(tmp_path, server, "refused-send", "Orders", secret="not-the-secret")
    unknown = run_client(tmp_path, server, "refused-send", "NoSuchTopic")
    # The client only logs why a route failed, and then cannot send.
    assert wrong["refused"] and unknown["refused"]
    client_log = (tmp_path / "home/logs/rocketmq_python/rocketmq_client.log").read_text()
    assert "40100" in client_log and "signature mismatch" in client_log
    assert "40402" in client_log and "'NoSuchTopic' not found" in client_log
    store = Store.open(server.root, create=False)
    for table in ("half", "commitlog"):
        assert b"must not be stored" not in store.read(table, ["body"]).column("body").to_pylist()


def test_raw_requests_retries_and_refusals(server: Server, tmp_path: Path) -> None:
    run_id = uuid.uuid4().hex[:8]
    result = run_client(tmp_path, server, "raw", run_id, str(MAX_BODY))
    first, retry = result["normal"]
    assert first["code"] == retry["code"] == "OK"
    assert first["message_id"] == retry["message_id"] == f"RAW-NORMAL-{run_id}"
    half, half_retry = result["half"]
    assert half["code"] == half_retry["code"] == "OK"
    assert half["transaction_id"] == half_retry["transaction_id"]
    assert result["commit"]["code"] == result["commit_again"]["code"] == "OK"
    assert result["rollback_late"]["code"] == "INVALID_TRANSACTION_ID"
    assert "already COMMIT" in result["rollback_late"]["message"]
    assert result["unknown_txn"]["code"] == "INVALID_TRANSACTION_ID"
    assert "unknown transaction" in result["unknown_txn"]["message"]
    assert result["illegal_topic"]["code"] == "ILLEGAL_TOPIC"
    assert "'bad topic!'" in result["illegal_topic"]["message"]
    assert result["unknown_topic"]["code"] == "TOPIC_NOT_FOUND"
    assert result["too_large"]["code"] == "MESSAGE_BODY_TOO_LARGE"
    assert f"limit of {MAX_BODY} bytes" in result["too_large"]["message"]
    assert result["unsigned"] == "UNAUTHORIZED"
    # Over gRPC's own limit for the body limit: still RocketMQ's code, not RESOURCE_EXHAUSTED.
    assert result["huge"]["code"] == "MESSAGE_BODY_TOO_LARGE"
    for name in ("system_property", "immunity", "control"):
        assert result[name]["code"] == "ILLEGAL_MESSAGE_PROPERTY_KEY", result[name]
    assert "'__STARTDELIVERTIME'" in result["system_property"]["message"]
    assert result["delayed"]["code"] == result["grouped"]["code"] == "UNSUPPORTED"
    # GZIP bodies: every member unzipped; a cut stream refused, not stored in part; bodies that
    # unzip to more than one request may carry refused before any is stored (or held at once).
    assert result["gzip"]["code"] == "OK", result["gzip"]
    assert result["truncated"]["code"] == "MESSAGE_CORRUPTED"
    assert "ends before" in result["truncated"]["message"]
    assert result["bomb"]["code"] == "MESSAGE_BODY_TOO_LARGE", result["bomb"]
    assert "fewer messages" in result["bomb"]["message"]
    assert "delayed delivery" in result["delayed"]["message"]
    assert "ordered delivery" in result["grouped"]["message"]
    # A message id reused for another message: both stored (a retry of the second, once).
    first_id, second_id, retried_id = result["reused_id"]
    assert [first_id["code"], second_id["code"], retried_id["code"]] == ["OK"] * 3
    assert result["recall"][0] == "UNSUPPORTED" and "rolling" in result["recall"][1]
    halves = Store.open(server.root, create=False).read("half").to_pylist()
    ids = Counter(dict(h["properties"])["UNIQ_KEY"] for h in halves)
    assert ids[f"RAW-HALF-{run_id}"] == 1
    counts = stored(server.root, until=lambda c: c[f"RAW-HALF-{run_id}"] > 0)
    assert counts[f"RAW-NORMAL-{run_id}"] == 1 and counts[f"RAW-HALF-{run_id}"] == 1
    assert not any(run_id in k and ("BAD" in k or "LARGE" in k or "UNKNOWN" in k) for k in ids)
    reused = stored(server.root, until=lambda c: c[f"RAW-REUSED-{run_id}"] >= 2)
    assert reused[f"RAW-REUSED-{run_id}"] == 2
    assert not [k for k in reused if run_id in k and k.split("-")[1] in REFUSED_NAMES]
    commitlog = Store.open(server.root, create=False).read("commitlog", ["properties", "body"])
    bodies = {dict(r["properties"])["UNIQ_KEY"]: r["body"] for r in commitlog.to_pylist()}
    assert bodies[f"RAW-GZIP-{run_id}"] == b"two gzip members"
    assert "Traceback" not in server.log.read_text()


def test_sigterm_stops_cleanly(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server")
    log = server.log.read_text()
    assert "PLAINTEXT" not in log
    assert "no accounts configured" in log and "serving every valid topic name" in log
    result = run_client(tmp_path, server, "basic")
    assert server.stop() == 0
    log = server.log.read_text()
    assert "rmqtx serve stopped: 3 sends, 1 transactions committed, 1 rolled back" in log
    assert "Traceback" not in log
    counts = stored(server.root, timeout=0)
    assert (counts[result["normal"]], counts[result["committed"]]) == (1, 1)


def test_plaintext_beyond_this_host_is_warned_about(tmp_path: Path) -> None:
    server = start_server(tmp_path / "server", "--host", "0.0.0.0", accounts=ACCOUNTS)
    try:
        warned = r"WARNING .* serving PLAINTEXT beyond this host \(0\.0\.0\.0\)"
        assert re.search(warned, server.log.read_text())
    finally:
        assert server.stop() == 0


def test_tls(tmp_path: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1"]
        + ["-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"]
        + ["-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    server = start_server(tmp_path / "server", "--tls-cert", str(cert), "--tls-key", str(key))
    try:
        assert "(TLS and plaintext)" in server.log.read_text()
        trust = {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(cert)}
        result = run_client(tmp_path, server, "tls-send", env=trust)
        assert stored(server.root, timeout=0)[result["normal"]] == 1
    finally:
        assert server.stop() == 0


@pytest.mark.parametrize(
    ("mode", "expected"),
    [
        ("permissive", {"plaintext": "OK", "tls": "OK"}),
        ("enforcing", {"plaintext": "UNAVAILABLE", "tls": "OK"}),
        ("disabled", {"plaintext": "OK", "tls": "UNAVAILABLE"}),
    ],
)
def test_tls_modes_on_one_port(tmp_path: Path, mode: str, expected: dict[str, str]) -> None:
    """RocketMQ's proxy serves TLS and plaintext on one port by default, with a certificate
    it makes: the Java and Go clients' TLS default and the Python client's plaintext one both
    connect unchanged."""
    server = start_server(tmp_path / "server", "--tls-mode", mode, accounts=ACCOUNTS)
    try:
        env = {}
        if mode != "disabled":
            host, port = server.endpoint.split(":")
            served = tmp_path / "served.pem"  # the certificate the server made, as fetched
            served.write_text(ssl.get_server_certificate((host, int(port))))
            env = {"GRPC_DEFAULT_SSL_ROOTS_FILE_PATH": str(served)}
            assert "self-signed certificate made at start (SHA-256" in server.log.read_text()
        got = {
            kind: run_client(tmp_path / kind, server, "heartbeat", kind, env=env)["code"]
            for kind in expected
        }
        assert got == expected
    finally:
        assert server.stop() == 0
    assert "Traceback" not in server.log.read_text()


@pytest.mark.parametrize(
    ("option", "error"),
    [
        (["--access-key", "orders:s3cr3t"], "--access-key is gone (argv is public)"),
        (["--topic", "RMQ_SYS_TRANS_HALF_TOPIC"], "is a system topic"),
        (["--tls-cert", "cert.pem"], "TLS needs both a certificate and a key"),
        (["--tls-cert", "cert.pem", "--tls-key", "key.pem"], "TLS file 'cert.pem' does not exist"),
        (["--port", "70000"], "--port needs to be 0 to 65535"),
    ],
)
def test_bad_options_refused_before_serving(tmp_path: Path, option: list[str], error: str) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "rmq_spark.ops.cli",
            "--path",
            str(tmp_path / "store"),
            "serve",
            *option,
        ],
        env={**os.environ, "HOME": str(tmp_path)},
        capture_output=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert error in done.stderr.decode() and "s3cr3t" not in done.stderr.decode()
    assert not (tmp_path / "store").exists()


def test_the_readme_example_runs_against_the_server(server: Server, tmp_path: Path) -> None:
    """docs/serve.md's producer example, as pasted but for the endpoint and the access key."""
    readme = (Path(__file__).resolve().parents[2] / "docs" / "serve.md").read_text()
    start = readme.index("```python\nfrom rocketmq import")
    code = readme[start + len("```python\n") : readme.index("```", start + 3)]
    code = code.replace("127.0.0.1:8081", server.endpoint)
    code = code.replace('Credentials("orders", "s3cr3t")', f'Credentials("{AK}", "{SK}")')
    home = tmp_path / "home"
    home.mkdir()
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "HOME": str(home)},
        capture_output=True,
        timeout=120,
        preexec_fn=die_with_parent,
    )
    assert done.returncode == 0, done.stderr.decode()
    store = Store.open(server.root, create=False)
    deadline = time.monotonic() + 30
    while True:
        rows = [r for r in store.read("commitlog").to_pylist() if r["keys"] == "order-42"]
        if rows or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert [(r["topic"], r["body"]) for r in rows] == [("TxOrders", b"order 42 paid")]


def test_a_server_killed_with_sends_in_flight_loses_and_doubles_nothing(
    spark, tmp_path: Path
) -> None:
    """``kill -9`` of the server while 8 senders send and commit: every commit a client saw
    succeed is published once; the other sends are absent or resolved by check-back, once."""
    server = start_server(tmp_path / "server", "--topic", "TxOrders")
    home = tmp_path / "home"
    home.mkdir()
    client = subprocess.Popen(
        [sys.executable, str(CLIENT), "flood", server.endpoint, AK, SK, "8"],
        env={**os.environ, "HOME": str(home)},
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        preexec_fn=die_with_parent,
    )
    assert client.stdout is not None
    events = []
    for line in client.stdout:
        events.append(json.loads(line))
        if sum("committed" in e for e in events) >= 40:
            break
    server.process.kill()  # SIGKILL, sends and commits under way
    server.process.wait()
    time.sleep(3)  # replies that reached the client are printed; its retries would go on
    client.kill()
    rest, _ = client.communicate(timeout=60)
    events += [json.loads(line) for line in rest.decode().splitlines()]
    sent = {e["sent"] for e in events if "sent" in e}
    committed = {e["committed"] for e in events if "committed" in e}

    store = Store.open(server.root, create=False)
    store.publish()  # what the next server, producer or check-back round publishes
    job = CheckBackJob(
        spark,
        store,
        {"TxOrders": CallableChecker("tests.checker_functions:always_commit")},
        TransactionSettings(transaction_timeout=0.0),
    )
    for _ in range(3):
        if not job.run_once().summary.pending_found:
            break
    counts = stored(server.root, timeout=0)
    assert committed and committed <= set(counts)
    assert set(counts.values()) == {1}
    halves = store.read("half", ["properties"]).column("properties").to_pylist()
    assert set(counts) <= {dict(p)["UNIQ_KEY"] for p in halves}
    assert sent <= set(counts)  # always_commit: every half message the server kept commits


@pytest.mark.objectstore
def test_two_servers_side_by_side_on_one_s3_root(s3_settings, tmp_path: Path) -> None:
    """Servers keep no state of their own: two on one ``s3://`` root of two shards each
    write to a shard of their own, and what their clients did is stored once."""
    settings = dataclasses.replace(
        s3_settings, store=dataclasses.replace(s3_settings.store, shards=2)
    )
    store = Store.open(settings=settings)
    conf = settings_file(store, tmp_path)
    servers = [start_server(tmp_path / f"server-{i}", conf=conf) for i in range(2)]
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            results = list(
                pool.map(
                    lambda i: run_client(tmp_path / f"client-{i}", servers[i], "basic"), range(2)
                )
            )
        wanted = {r[k] for r in results for k in ("normal", "committed")}
        counts = stored(store, until=lambda c: wanted <= set(c))
        assert {k: counts[k] for k in wanted} == dict.fromkeys(wanted, 1)
        assert all(counts[r["rolled_back"]] == 0 for r in results)
        assert {shard_of(r["committed_txn"]) for r in results} == {0, 1}
    finally:
        for server in servers:
            assert server.stop() == 0
