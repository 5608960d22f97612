"""`rmqtx status` and `rmqtx tail`: every figure checked against a store built to match."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from datetime import UTC, datetime, timedelta
from pathlib import Path

from rmq_spark import Decision, LocalTransactionState, Message, Store
from rmq_spark.checkback.checkers import CallableChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import RetentionSettings, TransactionSettings
from rmq_spark.ops.status import store_status
from rmq_spark.ops.views import VIEWS, groups_view, store_view, topics_view, transactions_view
from tests.lifetime import die_with_parent

REPO = Path(__file__).resolve().parents[2]
COMMIT, ROLLBACK = LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK


def rmqtx(store_root: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--path", store_root, *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )


def build(spark, store: Store) -> None:
    """Orders: 3 committed (2 txns + 1 normal send), 1 rolled back, 1 pending; Payments: 2
    committed; group 'flaky': 1 transaction discarded at the check max; consumer 'billing'
    has read 1 message of Orders."""
    orders = store.prepare([Message("Orders", f"o{i}", keys=f"k{i}") for i in range(4)], "shop")
    store.end_transactions(
        [
            Decision(orders[0].transaction_id, "shop", COMMIT),
            Decision(orders[1].transaction_id, "shop", COMMIT),
            Decision(orders[2].transaction_id, "shop", ROLLBACK),
        ]
    )
    store.send([Message("Orders", "n1", keys="k9")], "shop")
    pay = store.prepare([Message("Payments", f"p{i}") for i in range(2)], "pay")
    store.end_transactions([Decision(p.transaction_id, "pay", COMMIT) for p in pay])
    store.prepare([Message("Audit", "x", tags="UNKNOWN")], "flaky")
    settings = TransactionSettings(transaction_timeout=0.0, transaction_check_max=1)
    # Only 'flaky' is routed: its one transaction is UNKNOWN, discarded at the check max of 1;
    # 'shop''s pending transaction stays pending (unrouted, skipped).
    flaky = {"flaky": CallableChecker("tests.checker_functions:by_tag")}
    CheckBackJob(spark, store, flaky, settings, skip_unrouted=True).run_once()
    (
        spark.readStream.format("rmqtx")
        .option("path", store.root)
        .option("topic", "Orders")
        .option("consumerGroup", "billing")
        .option("maxMessagesPerTrigger", 1)
        .load()
        .writeStream.format("noop")
        .trigger(availableNow=True)
        .start()
        .awaitTermination(120)
    )


def test_status_json_every_figure(spark, store: Store) -> None:
    build(spark, store)
    now = datetime.now(UTC) + timedelta(seconds=10)
    status = store_status(store, now)
    topics = {t["topic"]: t for t in status["topics"]}
    assert topics["Orders"]["committed"] == 3
    assert sum(topics["Orders"]["queues"].values()) == 3  # dense offsets: next = count
    assert topics["Payments"]["committed"] == 2
    assert "Audit" not in topics  # discarded, never committed
    groups = {g["producer_group"]: g for g in status["producer_groups"]}
    assert groups["shop"]["pending_transactions"] == 1
    assert groups["shop"]["pending_messages"] == 1
    assert groups["shop"]["committed_last_hour"] == 2
    assert groups["shop"]["rolled_back_last_hour"] == 1
    assert 10 <= groups["shop"]["oldest_pending_age_seconds"] < 300
    assert groups["pay"]["pending_transactions"] == 0
    assert groups["pay"]["oldest_pending_age_seconds"] is None
    assert groups["pay"]["committed_last_hour"] == 1 or groups["pay"]["committed_last_hour"] == 2
    assert groups["flaky"]["rolled_back_last_hour"] == 1
    assert groups["flaky"]["pending_transactions"] == 0
    (billing,) = status["consumer_groups"]
    assert billing["consumer_group"] == "billing" and billing["topic"] == "Orders"
    # The run read everything: its last batch is recorded too, and the group has no lag.
    assert billing["lag"] == 0 and sum(billing["queues"].values()) == 3
    assert status["discards"] == {"messages": 1, "transactions": 1, "not_redriven": 1}
    run = status["last_check_back"]
    assert run["status"] == "finished" and run["discarded"] == 1
    assert run["unrouted"] == 1  # 'shop''s pending transaction: no checker, skipped

    cli = rmqtx(store.root, "status", "--json")
    assert cli.returncode == 0, cli.stderr
    printed = json.loads(cli.stdout)
    assert printed["topics"] == status["topics"]
    assert printed["discards"] == status["discards"]
    text = rmqtx(store.root, "status")
    assert text.returncode == 0
    assert "Orders" in text.stdout and "billing" in text.stdout and "discards: 1" in text.stdout
    assert "1 unrouted (no checker for their group)" in text.stdout
    _check_views(store, now)


def _check_views(store: Store, now: datetime) -> None:
    """``status groups | transactions | topics | store`` on the store of ``build`` (#49)."""
    retention = RetentionSettings()
    (billing,) = groups_view(store, retention, now)["groups"]
    assert billing["lag"] == 0 and billing["queues"]  # the queues holding Orders
    for queue in billing["queues"]:
        assert queue["committed_offset"] in (queue["end_offset"], None)
        assert queue["lag"] == 0
    moved = [q for q in billing["queues"] if q["end_offset"]]
    assert all(10 <= q["last_progress_age_seconds"] < 300 for q in moved)
    store.send([Message("Orders", f"late{i}") for i in range(2)], "shop")
    (billing,) = groups_view(store, retention, now)["groups"]
    assert billing["lag"] == 2 and sum(q["lag"] for q in billing["queues"]) == 2

    view = transactions_view(store, retention, now)
    shop = next(g for g in view["producer_groups"] if g["producer_group"] == "shop")
    # One pending transaction, in the bucket of its age (build takes a minute on a busy host).
    bucket = "< 1 min" if shop["oldest_pending_age_seconds"] < 60 else "1-10 min"
    assert shop["pending_by_age"] == {"< 1 min": 0, "1-10 min": 0, "10-60 min": 0, "> 1 h": 0} | {
        bucket: 1
    }
    (run,) = view["check_back_runs"]
    assert (run["unrouted"], run["discarded"], run["status"]) == (1, 1, "finished")

    topics = {t["topic"]: t for t in topics_view(store, retention, now)["topics"]}
    orders = topics["Orders"]
    assert (orders["messages"], orders["last_minute"], orders["last_hour"]) == (5, 5, 5)
    assert sum(q["next"] for q in orders["queues"].values()) == 5
    assert orders["oldest_stored"] is not None and "Audit" not in topics

    (shard,) = store_view(store, retention, now)["shards"]
    assert shard["tables"]["commitlog"]["rows"] == 7 and shard["tables"]["op"]["version"] >= 1

    for name, view_of in VIEWS.items():
        cli = rmqtx(store.root, "status", name, "--json")
        assert cli.returncode == 0, cli.stderr
        printed = json.loads(cli.stdout)
        assert printed.keys() == view_of(store, retention).keys(), name
    assert (
        json.loads(rmqtx(store.root, "status", "groups", "--json").stdout)["groups"][0]["lag"] == 2
    )
    text = rmqtx(store.root, "status", "transactions").stdout
    assert "pending transactions by producer group" in text and "10-60 min" in text


def test_status_watch_and_tail_follow_until_ctrl_c(store: Store) -> None:
    """``status --watch`` prints again until Ctrl-C; ``tail --follow`` prints each message
    as it is committed (#49); both end with exit code 0 on Ctrl-C."""
    store.send([Message("Orders", "first")], "shop")
    watch = _start(store.root, "status", "topics", "--watch", "1s")
    follow = _start(store.root, "tail", "Orders", "--follow", "--json")
    waiting = _start(store.root, "tail", "Later", "--follow", "--json")  # no messages yet
    try:
        assert "first" in follow.stdout.readline()  # the tail before following
        store.send([Message("Orders", f"new{i}") for i in range(3)], "shop")
        seen = [json.loads(follow.stdout.readline())["body"] for _ in range(3)]
        assert sorted(seen) == ["new0", "new1", "new2"]
        assert "Waiting for its first" in waiting.stderr.readline()
        store.send([Message("Later", "at last")], "shop")
        assert json.loads(waiting.stdout.readline())["body"] == "at last"
        screens = 0
        while screens < 2:
            screens += watch.stdout.readline().count("\x1b[2J")
    finally:
        for child in (watch, follow, waiting):
            child.send_signal(signal.SIGINT)
    assert watch.wait(30) == 0 and follow.wait(30) == 0 and waiting.wait(30) == 0
    assert "Traceback" not in watch.stderr.read() + follow.stderr.read()
    refused = rmqtx(store.root, "status", "--watch", "5")
    assert refused.returncode == 2 and "'5s'" in refused.stderr


def _start(store_root: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "rmq_spark.ops.cli", "--path", store_root, *args],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=die_with_parent,
    )


def test_tail_and_errors(store: Store, tmp_path: Path) -> None:
    store.send([Message("Orders", f"m{i}", keys=f"k{i}", tags="T") for i in range(5)], "shop")
    store.send([Message("Orders", "last", keys="z")], "shop")
    out = rmqtx(store.root, "tail", "Orders", "-n", "3", "--json")
    assert out.returncode == 0, out.stderr
    messages = json.loads(out.stdout)
    assert len(messages) == 3 and messages[0]["body"] == "last"
    table = rmqtx(store.root, "tail", "Orders")
    assert table.returncode == 0 and "last" in table.stdout and "m0" in table.stdout

    unknown = rmqtx(store.root, "tail", "Nope")
    assert unknown.returncode == 2
    assert "topic 'Nope' has no committed messages" in unknown.stderr
    assert "Orders" in unknown.stderr
    missing = rmqtx(str(tmp_path / "not-a-store"), "status")
    assert missing.returncode == 2 and "no rmq-spark store" in missing.stderr


def test_tail_escapes_what_would_drive_the_terminal(store: Store) -> None:
    """Bodies, keys and tags were printed raw: escape sequences reached the operator's
    terminal, and a newline in keys forged a row of the table."""
    store.send(
        [
            Message(
                "Orders",
                "\x1b]0;owned\x07\x1b[2J body",
                keys="k\nforged  row",
                tags="T\x1b[31m",
                properties={"p": "\x1b[5m"},
            )
        ],
        "shop",
    )
    out = rmqtx(store.root, "tail", "Orders")
    assert out.returncode == 0, out.stderr
    assert "\x1b" not in out.stdout and "\x07" not in out.stdout
    assert len(out.stdout.strip().splitlines()) == 3  # header, rule, one row
    assert "\\x1b]0;owned\\x07" in out.stdout and "k\\nforged" in out.stdout
