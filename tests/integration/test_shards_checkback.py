"""The check-back job, status and re-drive over a store of several shards, on real Spark."""

from __future__ import annotations

import re
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pyarrow as pa
import pytest

from rmq_spark import Message, Store
from rmq_spark.checkback import round as check_round
from rmq_spark.checkback.batch import MISPLACED
from rmq_spark.checkback.checkers import CallableChecker
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.model.config import StoreSettings, TransactionSettings
from rmq_spark.model.messages import shard_of
from rmq_spark.model.schema import CONSUMER_OFFSETS_SCHEMA
from rmq_spark.ops.cli import EXIT_OK, main
from rmq_spark.ops.status import format_status, store_status
from rmq_spark.store.fanout import ShardsFailedError
from tests.conftest import Clock

BY_TAG = "tests.checker_functions:by_tag"


@pytest.fixture
def sharded(tmp_path: Path) -> Store:
    """An empty store of three shards, two queues each, whose sends are ``half`` commits."""
    settings = StoreSettings(shards=3, queue_nums=2, intake=False)
    return Store.open(tmp_path / "store", settings=settings)


def job(spark, store: Store, clock: Clock, **settings) -> CheckBackJob:
    return CheckBackJob(
        spark,
        store,
        {"pg": CallableChecker(BY_TAG)},
        TransactionSettings(**{"transaction_timeout": 6.0, "transaction_check_max": 3, **settings}),
        clock=clock,
    )


def prepare(store: Store, shard: int, tag: str) -> str:
    """A half message of group ``pg`` in ``shard``, that ``by_tag`` answers with ``tag``."""
    (p,) = store.shard_store(shard).prepare([Message("Orders", f"body-{tag}", tags=tag)], "pg")
    assert shard_of(p.transaction_id) == shard
    return p.transaction_id


def decisions(store: Store, shard: int) -> dict[str, str]:
    op = store.shard_store(shard).read("op").to_pylist()
    return {o["transaction_id"]: o["decision"] for o in op}


def test_one_round_resolves_every_shard(spark, sharded: Store) -> None:
    clock = Clock()
    committed, rolled_back = prepare(sharded, 0, "COMMIT"), prepare(sharded, 2, "ROLLBACK")
    # Their clocks start when they were stored: a minute's timeout leaves them not yet due in
    # the first round, however long the session took to start.
    first = job(spark, sharded, clock, transaction_timeout=60.0).run_once().summary
    assert (first.pending_found, first.not_yet_due, first.checked) == (2, 2, 0)
    clock.now += timedelta(seconds=70)

    result = job(spark, sharded, clock, transaction_timeout=60.0).run_once()
    s = result.summary
    assert (s.pending_found, s.checked, s.committed, s.rolled_back) == (2, 2, 1, 1)
    assert (s.status, s.errors) == ("finished", 0)
    assert 70 <= s.oldest_pending_age_seconds < 130
    answers = {r["transaction_id"]: r["answer"] for r in result.check_batch.collect()}
    assert answers == {committed: "COMMIT", rolled_back: "ROLLBACK"}
    assert decisions(sharded, 0) == {committed: "COMMIT"}
    assert decisions(sharded, 2) == {rolled_back: "ROLLBACK"}
    assert sharded.read("commitlog").column("transaction_id").to_pylist() == [committed]
    # Every shard recorded its round, all under the run's id.
    runs = [
        {r["run_id"]: r for r in sharded.shard_store(k).read("check_runs").to_pylist()}
        for k in range(3)
    ]
    assert [set(r) for r in runs] == [{first.run_id, s.run_id}] * 3
    assert [r[s.run_id]["checked"] for r in runs] == [1, 0, 1]

    status = store_status(sharded)
    assert status["last_check_back"]["committed"] == 1
    assert status["last_check_back"]["rolled_back"] == 1
    assert status["last_check_back"]["pending_found"] == 2


def test_a_failing_shard_does_not_stop_the_others(spark, sharded: Store, monkeypatch) -> None:
    clock = Clock()
    ids = [prepare(sharded, k, "COMMIT") for k in range(3)]
    update_pending = check_round.update_pending

    def broken_in_shard_1(store: Store):
        if store.shard == 1:
            raise OSError("shard 1 unreachable")
        return update_pending(store)

    monkeypatch.setattr(check_round, "update_pending", broken_in_shard_1)
    with pytest.raises(ShardsFailedError, match="shard 1: OSError: shard 1 unreachable") as e:
        job(spark, sharded, clock, transaction_timeout=0.0).run_once()
    summary = e.value.result
    assert (summary.status, summary.committed, summary.errors) == ("failed", 2, 1)
    assert "shard 1" in summary.message
    published = sharded.read("commitlog").column("transaction_id").to_pylist()
    assert sorted(published) == sorted([ids[0], ids[2]])  # the store's one CommitLog
    assert decisions(sharded, 2) == {ids[2]: "COMMIT"}
    assert decisions(sharded, 1) == {}
    (failed,) = sharded.shard_store(1).read("check_runs").to_pylist()
    assert failed["status"] == "failed" and "unreachable" in failed["message"]
    assert store_status(sharded)["last_check_back"]["status"] == "failed"


def test_status_counts_every_shard_and_lag_over_every_queue(sharded: Store) -> None:
    now = datetime.now(UTC)
    prepare(sharded, 1, "UNKNOWN")
    prepare(sharded, 2, "UNKNOWN")
    prepare(sharded, 2, "UNKNOWN")
    sharded.send([Message("Orders", "a", keys="k")], "pg")
    sharded.shard_store(2).send([Message("Orders", f"b{i}", keys="k") for i in range(3)], "pg")
    (root_queue, shard_queue) = sorted({q for _, q in sharded.next_offsets()})
    assert shard_queue // 1000 == 2
    # The consumer group has read shard 0's message, none of shard 2's.
    sharded.append(
        "consumer_offsets",
        pa.Table.from_pylist(
            [
                {
                    "consumer_group": "billing",
                    "topic": "Orders",
                    "queue_id": root_queue,
                    "next_offset": 1,
                    "updated_timestamp": now,
                }
            ],
            CONSUMER_OFFSETS_SCHEMA,
        ),
    )
    status = store_status(sharded, now)
    assert [(s["shard"], s["pending_transactions"]) for s in status["shards"]] == [
        (0, 0),
        (1, 1),
        (2, 2),
    ]
    (orders,) = status["topics"]
    assert orders["committed"] == 4
    assert orders["queues"] == {str(root_queue): 1, str(shard_queue): 3}
    (billing,) = status["consumer_groups"]
    assert billing["lag"] == 3
    (pg,) = status["producer_groups"]
    assert (pg["pending_transactions"], pg["committed_last_hour"]) == (3, 0)
    text = format_status(status)
    assert f"store {sharded.root}, 3 shard(s)" in text
    rows = r"shards:\n.*\n.*\n +0 +0 +0 +0 +-\n +1 +1 +1 +0 +-\n +2 +2 +2 +0 +-\n"
    assert re.search(rows, text), text


def test_a_discard_is_redriven_in_its_own_shard(spark, sharded: Store, capsys) -> None:
    clock = Clock()
    lost = prepare(sharded, 2, "UNKNOWN")
    once = job(spark, sharded, clock, transaction_timeout=0.0, transaction_check_max=1)
    assert once.run_once().summary.discarded == 1
    shard = sharded.shard_store(2)
    assert [d["transaction_id"] for d in shard.read("discard").to_pylist()] == [lost]

    assert main(["--path", sharded.root, "resume"]) == EXIT_OK
    assert "re-drove 1 discarded message(s)" in capsys.readouterr().out
    (again,) = shard.read("discard").column("redriven_transaction_id").to_pylist()
    assert shard_of(again) == 2
    redriven = [h for h in shard.read("half").to_pylist() if h["transaction_id"] == again]
    assert [dict(h["properties"])["REDRIVEN_FROM_TRANSACTION_ID"] for h in redriven] == [lost]
    assert all(sharded.shard_store(k).read("half").num_rows == 0 for k in (0, 1))
    status = store_status(sharded)
    assert status["discards"] == {"messages": 1, "transactions": 1, "not_redriven": 0}


def test_a_half_message_with_another_shards_id_stops_no_round(spark, sharded: Store) -> None:
    """Another Delta writer appends half rows whose ids name another shard (a copy from shard
    1 into the root, a shard-0 id into shard 1) or no shard (``<id>.0``, ``<id>.01``, whose
    decision failed every round in shard 0): no decider may record them in the wrong shard's
    op, and they must not stop check-back for everyone (apache/rocketmq#9500). An id with a
    line break after a shard's suffix is no shard's id: shard 0's, decided there alone."""
    from deltalake import write_deltalake

    from rmq_spark.model.messages import new_id, shard_transaction_id

    clock = Clock()
    honest = prepare(sharded, 1, "COMMIT")
    row = sharded.shard_store(1).read("half").to_pylist()[0]
    broken = shard_transaction_id(2) + "\n"
    strays = {
        0: [shard_transaction_id(1), f"{new_id()}.0", f"{new_id()}.01", broken],
        1: [new_id()],
    }
    for shard, ids in strays.items():
        uri = sharded.shard_store(shard).table_uri("half")
        rows = [{**row, "transaction_id": t, "msg_id": f"m-{t}"} for t in ids]
        write_deltalake(uri, pa.Table.from_pylist(rows, sharded.read("half").schema), mode="append")
    job(spark, sharded, clock, transaction_timeout=60.0).run_once()
    clock.now += timedelta(seconds=70)

    result = job(spark, sharded, clock, transaction_timeout=60.0).run_once()
    s = result.summary
    assert (s.status, s.errors, s.committed, s.unrouted) == ("finished", 0, 2, 4)
    reasons = {r["transaction_id"]: r["reason"] for r in result.check_batch.collect()}
    assert {t for t, r in reasons.items() if r == MISPLACED} == set(strays[0][:3] + strays[1])
    assert decisions(sharded, 1) == {honest: "COMMIT"}
    assert decisions(sharded, 0) == {broken: "COMMIT"}
    assert decisions(sharded, 2) == {}
