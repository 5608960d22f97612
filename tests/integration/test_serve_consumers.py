"""Consumers through ``rmqtx serve`` (#50): RocketMQ's official Python ``SimpleConsumer`` and
``PushConsumer``, unchanged, in child processes (tests/serve_clients/consumer.py) against real
server processes, reading what the store's producers committed while Spark reads the same
topic with ``format("rmqtx")``."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from rmq_spark import LocalTransactionState, Message, Store
from rmq_spark.store.decisions import Decision
from tests.integration.test_serve import (
    SETTINGS,
    Server,
    run_client,
    run_go,
    start_server,
)
from tests.lifetime import die_with_parent

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("rocketmq") is None,
    reason="the serve extra (rocketmq-python-client) is not installed",
)

CONSUMER = Path(__file__).resolve().parents[1] / "serve_clients" / "consumer.py"
AK, SK = "inventory-ak", "inventory-sk"
ACCOUNTS = f"""
[serve.accounts.{AK}]
secret_key = "{SK}"
topics = ["StockGo", "Orders", "TxOrders"]
subscribe = ["Stock*", "%DLQ%*", "TxOrders"]
groups = ["inventory*", "audit", "pusher", "dlq-reader", "shared"]

[serve.accounts.billing]
secret_key = "billing-sk"
topics = ["Billing"]
"""
#: Every group starts at a topic's first message; a message is handed out twice at most; a
#: push consumer's are invisible for 5 s, renewed while it works on them.
OPTIONS = (
    "--auto-offset-reset",
    "earliest",
    "--max-delivery-attempts",
    "2",
    "--invisible-duration",
    "5s",
)


def conf_for(folder: Path, root: Path) -> Path:
    """A settings file naming the store ``root`` (for servers sharing a store)."""
    folder.mkdir(parents=True, exist_ok=True)
    conf = folder / "rmq-spark.toml"
    conf.write_text(SETTINGS.replace("[store]\n", f'[store]\npath = "{root}"\n') + ACCOUNTS)
    return conf


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    folder = tmp_path_factory.mktemp("serve-consumers")
    served = start_server(folder, *OPTIONS, accounts=ACCOUNTS)
    try:
        yield served
    finally:
        if served.process.poll() is None:
            served.stop()


def consume(folder: Path, server: Server, scenario: str, *args: str, **kw) -> dict:
    return run_client(folder, server, scenario, *args, access=AK, secret=SK, client=CONSUMER, **kw)


def produce(
    root: Path, topic: str, *, committed=(), rolled_back=(), normal=(), pending=(), tag=None
):
    """Write what a producer would: transactions committed, rolled back and left open, and
    normal messages; published before this returns."""
    store = Store.open(root, create=False)
    if normal:
        store.send([Message(topic, b, tags=tag) for b in normal], "producer")
    halves = [*committed, *rolled_back, *pending]
    if not halves:
        return
    prepared = store.prepare([Message(topic, b, tags=tag) for b in halves], "producer")
    states = [LocalTransactionState.COMMIT] * len(committed) + [
        LocalTransactionState.ROLLBACK
    ] * len(rolled_back)
    store.end_transactions(
        [
            Decision(p.transaction_id, "producer", s, "test")
            for p, s in zip(prepared, states, strict=False)
        ]
    )
    store.publish()


def read_topic(spark, server: Server, topic: str, expression: str) -> list:  # noqa: ANN001
    """``expression`` of every message of ``topic``, read with ``format("rmqtx")``."""
    frame = spark.read.format("rmqtx").option("path", str(server.root)).option("topic", topic)
    return [r[0] for r in frame.load().selectExpr(expression).collect()]


def bodies(got: list[dict]) -> Counter[str]:
    return Counter(g["body"] for g in got)


def test_simple_consumers_get_each_committed_message_once_per_group(
    spark, server: Server, tmp_path: Path
) -> None:
    produce(
        server.root,
        "Stock",
        committed=["c1", "c2"],
        rolled_back=["r1"],
        normal=["n1", "n2"],
        pending=["p1"],
    )
    wanted = Counter({"c1": 1, "c2": 1, "n1": 1, "n2": 1})
    first = consume(tmp_path / "a", server, "receive", "inventory", "Stock", "*", "4", "20")
    assert bodies(first["got"]) == wanted
    assert {g["attempt"] for g in first["got"]} == {1}
    # Another group gets everything too; the first, having acknowledged, nothing more.
    assert (
        bodies(consume(tmp_path / "b", server, "receive", "audit", "Stock", "*", "4", "20")["got"])
        == wanted
    )
    assert (
        consume(tmp_path / "c", server, "receive", "inventory", "Stock", "*", "1", "3")["got"] == []
    )
    # Spark reads the same topic at the same time, and sees the same messages.
    assert Counter(read_topic(spark, server, "Stock", "CAST(body AS STRING)")) == wanted


def test_go_and_python_consumers_read_what_a_go_producer_committed_beside_spark(
    spark, server: Server, go_client: Path, tmp_path: Path
) -> None:
    """#50's acceptance: the Go client's transactional-producer example writes through the
    server; its push-consumer and simple-consumer examples and the Python SimpleConsumer,
    unchanged but for the endpoint, each get every committed message once, in their own
    groups, while Spark reads the same topic."""

    def go(mode: str, group: str = "") -> list[dict[str, str]]:
        env = {"RMQTX_ACCESS_KEY": AK, "RMQTX_SECRET_KEY": SK, "RMQTX_TOPIC": "StockGo"}
        return run_go(
            go_client, server, tmp_path / mode, mode, "3", env=env | {"RMQTX_GROUP": group}
        )

    sent = sorted(r["sent"] for r in go("example"))
    assert len(sent) == 3
    for mode, group in (("push", "inventory-go-push"), ("simple", "inventory-go-simple")):
        got = go(mode, group)
        assert sorted(r["consumed"] for r in got) == sent, mode
        assert {r["attempt"] for r in got} == {"1"}
    python = consume(
        tmp_path / "python", server, "receive", "inventory-py", "StockGo", "*", "3", "20"
    )
    assert sorted(g["id"] for g in python["got"]) == sent
    assert sorted(read_topic(spark, server, "StockGo", "properties['UNIQ_KEY']")) == sent


def test_transactions_through_the_server_reach_consumers_committed_once_never_rolled_back(
    server: Server, tmp_path: Path
) -> None:
    """The official Python producer commits a transaction and rolls one back (then tries to
    commit it) through the server; a consumer group gets the committed one once, the other
    never."""
    sent = run_client(tmp_path / "producer", server, "basic", access=AK, secret=SK)
    got = consume(tmp_path / "c", server, "receive", "inventory-tx", "TxOrders", "*", "2", "8")
    assert [g["id"] for g in got["got"]] == [sent["committed"]]
    assert sent["rolled_back"] not in {g["id"] for g in got["got"]}


def test_a_message_not_acknowledged_comes_back_and_can_be_extended(
    server: Server, tmp_path: Path
) -> None:
    produce(server.root, "Stock2", normal=["slow"])
    result = consume(tmp_path, server, "neglect", "inventory2", "Stock2", "2")
    hand_outs = result["hand_outs"]
    assert [h["attempt"] for h in hand_outs] == [1, 2]
    assert len({h["id"] for h in hand_outs}) == 1
    assert result["extended"] is True
    assert result["after_extension"] == []  # extended past the first invisible duration
    assert "INVALID_RECEIPT_HANDLE" in result["old_handle"] or "40" in result["old_handle"]
    assert result["acked"] is True


def test_a_push_consumer_and_dead_letters_after_the_last_attempt(
    server: Server, tmp_path: Path
) -> None:
    produce(server.root, "Stock3", normal=["fine", "poison"])
    result = consume(tmp_path / "push", server, "push", "pusher", "Stock3", "12", "poison", "0")
    consumed = result["consumed"]
    assert [c["attempt"] for c in consumed if c["body"] == "fine"] == [1]
    assert sorted(c["attempt"] for c in consumed if c["body"] == "poison") == [1, 2]
    dlq = consume(tmp_path / "dlq", server, "receive", "dlq-reader", "%DLQ%pusher", "*", "1", "20")
    assert bodies(dlq["got"]) == Counter({"poison": 1})


def test_a_push_consumer_slower_than_the_invisible_duration_gets_each_message_once(
    server: Server, tmp_path: Path
) -> None:
    """The push consumer receives with ``auto_renew``: the server renews the messages while
    its listener works on them (12 s each, the invisible duration 5 s), as RocketMQ's proxy."""
    produce(server.root, "Stock7", normal=["slow-1", "slow-2"])
    result = consume(tmp_path, server, "push", "inventory7", "Stock7", "18", "", "12")
    assert bodies(result["consumed"]) == Counter({"slow-1": 1, "slow-2": 1})
    assert {c["attempt"] for c in result["consumed"]} == {1}


def test_tag_filters(server: Server, tmp_path: Path) -> None:
    for tag in ("TagA", "TagB", "TagC"):
        produce(server.root, "Stock4", normal=[f"m-{tag}"], tag=tag)
    got = consume(
        tmp_path / "a", server, "receive", "inventory4", "Stock4", "TagA || TagB", "3", "5"
    )
    assert sorted(g["tag"] for g in got["got"]) == ["TagA", "TagB"]


def test_an_account_may_consume_only_what_it_was_granted(server: Server, tmp_path: Path) -> None:
    refused = run_client(
        tmp_path,
        server,
        "forbidden",
        "inventory",
        "Stock",
        access="billing",
        secret="billing-sk",
        client=CONSUMER,
    )
    # Its route is refused (the client says no more than that; the server's log says why).
    assert "route" in refused["error"]
    assert (
        "'billing' may neither publish to nor subscribe to topic 'Stock'" in server.log.read_text()
    )
    # An account that may subscribe to the topic, but not as this group.
    other = consume(tmp_path / "group", server, "forbidden", "someone-else", "Stock")
    assert "Forbidden" in other["error"] and "may not consume" in other["error"]


def test_consumers_of_one_group_on_two_servers_share_the_work(
    server: Server, tmp_path: Path
) -> None:
    """Two servers on one store serve one group: every message once, none twice."""
    second = start_server(
        tmp_path / "second", *OPTIONS, conf=conf_for(tmp_path / "second", server.root)
    )
    try:
        produce(server.root, "Stock5", normal=[f"m{i}" for i in range(40)])
        results: dict[int, dict] = {}

        def run(i: int, on: Server) -> None:
            results[i] = consume(
                tmp_path / f"c{i}", on, "receive", "shared", "Stock5", "*", "40", "10"
            )

        threads = [
            threading.Thread(target=run, args=(i, s)) for i, s in enumerate((server, second))
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        got = results[0]["got"] + results[1]["got"]
        assert bodies(got) == Counter({f"m{i}": 1 for i in range(40)})
    finally:
        second.stop()


def test_kill_9_of_the_server_hands_out_again_what_was_in_flight(tmp_path: Path) -> None:
    server = start_server(tmp_path / "s", *OPTIONS, accounts=ACCOUNTS)
    home = tmp_path / "home"
    home.mkdir()
    produce(server.root, "Stock6", normal=["a", "b", "c", "d"])
    holder = subprocess.Popen(
        [
            sys.executable,
            str(CONSUMER),
            "hold",
            server.endpoint,
            AK,
            SK,
            "inventory6",
            "Stock6",
            "4",
        ],
        stdout=subprocess.PIPE,
        env={**os.environ, "HOME": str(home)},
        preexec_fn=die_with_parent,
    )
    try:
        assert holder.stdout is not None
        held = json.loads(holder.stdout.readline())
        # An acknowledgement is answered before its commit, which the next batch makes (as
        # RocketMQ's broker writes one after answering): the kill comes once they are in.
        store = Store.open(server.root, create=False)
        deadline = time.monotonic() + 30
        while store.read("deliveries").column("kind").to_pylist().count("done") < 2:
            assert time.monotonic() < deadline, "the acknowledgements were never recorded"
            time.sleep(0.1)
        server.process.send_signal(signal.SIGKILL)
        server.process.wait(30)
    finally:
        holder.kill()
    conf = conf_for(tmp_path / "again", server.root)
    restarted = start_server(tmp_path / "again", *OPTIONS, conf=conf)
    try:
        again = consume(
            tmp_path / "after", restarted, "receive", "inventory6", "Stock6", "*", "2", "20"
        )
    finally:
        restarted.stop()
    assert bodies(again["got"]) == Counter(h["body"] for h in held["held"])
    assert {g["attempt"] for g in again["got"]} == {2}
    assert not set(bodies(again["got"])) & {h["body"] for h in held["acked"]}
