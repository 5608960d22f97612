"""The publisher lease: one producer process publishes every producer's COMMITs, and another
takes over when it dies (a real process, killed with SIGKILL)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest

from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.store.publish_loop import LEASE, LOCAL_LINGER, OBJECT_STORE_LINGER, linger
from tests.conftest import commitlog
from tests.unit.test_producer import ScriptedListener

REPO = Path(__file__).resolve().parents[2]
LEASE_SECONDS = 2.0
COMMIT = LocalTransactionState.COMMIT


def _settings(root: Path, lease: float = LEASE_SECONDS, shards: int = 1) -> Settings:
    return Settings(
        store=StoreSettings(
            path=str(root), queue_nums=2, publish_interval=0.05, publish_lease=lease, shards=shards
        )
    )


def _visible(store: Store, msg_ids: set[str], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while not msg_ids <= set(commitlog(store).column("msg_id").to_pylist()):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def _commit(producer: TransactionMQProducer) -> str:
    """A transaction ended by an explicit COMMIT, which returns once it is recorded."""
    sent = producer.send_message_in_transaction(Message("T", b"x"), LocalTransactionState.UNKNOWN)
    producer.end_transaction(sent, COMMIT)
    return sent.msg_id


@pytest.fixture(params=[1, 3], ids=["one shard", "three shards"])
def holder(request: pytest.FixtureRequest, tmp_path: Path):
    """A producer process that took the publisher lease, sent one COMMIT, and waits; on a
    store of one shard, and of three (it claims one; the lease is the store's)."""
    child = textwrap.dedent(
        f"""
        import sys, time
        from rmq_spark import Store, TransactionMQProducer
        from tests.unit.test_publish_loop import _commit, _settings
        from tests.unit.test_producer import ScriptedListener
        from pathlib import Path
        root = Path({str(tmp_path / "store")!r})
        store = Store.open(settings=_settings(root, shards={request.param}))
        producer = TransactionMQProducer("pg", ScriptedListener(), store=store).start()
        while not producer._publisher.holding:
            time.sleep(0.02)
        print(_commit(producer), flush=True)
        time.sleep(600)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", child],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        yield proc, proc.stdout.readline().strip()
    finally:
        proc.kill()
        proc.wait()


def test_the_lease_holder_publishes_every_producers_commits_and_another_takes_over(
    tmp_path: Path, holder: tuple[subprocess.Popen, str]
) -> None:
    proc, first = holder
    store = Store.open(settings=_settings(tmp_path / "store"))
    assert store.lock_holder(LEASE).split(":")[1] == str(proc.pid)
    with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
        # Published by the other process's loop: this one holds no lease and never flushes
        # (with shards, it writes to a shard the other process does not).
        assert producer._publisher.claimed == (len(store.shard_numbers()) > 1)
        mine = _commit(producer)
        assert _visible(store, {first, mine}, 10)
        assert not producer._publisher.holding
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        later = _commit(producer)
        # Nobody renews the lease: this process takes it over and publishes its COMMIT.
        assert _visible(store, {later}, LEASE_SECONDS + 10)
        assert producer._publisher.holding
        assert store.lock_holder(LEASE) == producer._publisher.holder
    # A clean shutdown gives the lease back; every message is there once.
    assert store.lock_holder(LEASE) is None
    assert sorted(commitlog(store).column("msg_id").to_pylist()) == sorted([first, mine, later])


def test_end_transaction_returns_once_recorded_and_flush_waits_for_the_publish(
    tmp_path: Path,
) -> None:
    """With another holder of the lease that does not publish (stalled), a COMMIT is durable
    when ``end_transaction`` returns (its decision object), recorded in ``op`` by the producer's
    background publisher, but not visible; ``flush`` publishes it."""
    store = Store.open(settings=_settings(tmp_path / "store"))
    assert store.lock(LEASE, "stalled-host:1:x", 600)
    with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
        sent = producer.send_message_in_transaction(
            Message("T", b"x"), LocalTransactionState.UNKNOWN
        )
        producer.end_transaction(sent, COMMIT)
        msg_id = sent.msg_id
        assert store.object_decisions([sent.transaction_id])[sent.transaction_id].state is COMMIT
        deadline = time.monotonic() + 10
        while not store.read("op").num_rows and time.monotonic() < deadline:
            time.sleep(0.02)
        assert store.read("op").column("decision").to_pylist() == ["COMMIT"]
        assert not _visible(store, {msg_id}, 1.0)
        producer.flush()
        assert _visible(store, {msg_id}, 0)
    assert commitlog(store).column("msg_id").to_pylist() == [msg_id]


@contextmanager
def _hanging_looks(producer: TransactionMQProducer, monkeypatch: pytest.MonkeyPatch):
    """The producer's renewals of the publisher lease hang from its next one on (it held the
    lease by then); yields once one hangs, and lets them go at the end."""
    deadline = time.monotonic() + 30
    while not producer._publisher.holding and time.monotonic() < deadline:
        time.sleep(0.02)
    looking, release = threading.Event(), threading.Event()
    renew = Store.lock

    def hanging(self: Store, name: str, holder: str, seconds: float) -> bool:
        if seconds:
            looking.set()
            release.wait(60)
        return renew(self, name, holder, seconds)

    monkeypatch.setattr(Store, "lock", hanging)
    try:
        assert looking.wait(30)
        yield
    finally:
        release.set()


def test_a_slow_look_at_the_lease_holds_up_no_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A look at the lease reads and MERGEs ``locks``, several round trips on an object
    store, and the publisher's thread took it between publishes: COMMITs waited for it (the
    publish lag's p99 on S3 was a second). A look that hangs holds up no publish."""
    store = Store.open(settings=_settings(tmp_path / "store", lease=6.0))
    with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
        with _hanging_looks(producer, monkeypatch):
            assert _visible(store, {_commit(producer)}, 10)


def test_a_process_whose_look_at_the_lease_hangs_past_it_stops_publishing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past its lease another process takes the lease over: a holder whose look hangs that
    long no longer holds it."""
    store = Store.open(settings=_settings(tmp_path / "store"))
    with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
        with _hanging_looks(producer, monkeypatch):
            assert producer._publisher.holding
            time.sleep(LEASE_SECONDS)
            assert not producer._publisher.holding


@pytest.mark.parametrize("linger", [0.0, 0.3])
def test_the_publisher_lingers_so_that_the_commits_of_a_moment_go_out_together(
    tmp_path: Path, linger: float
) -> None:
    """Four senders COMMIT for a second and a half: with ``store.publish_linger`` at 0.3 s the
    holder publishes at most one commit every 0.3 s (each of them many transactions), without
    it about one for each COMMIT that finds the loop idle."""
    settings = _settings(tmp_path / "store")
    settings = replace(settings, store=replace(settings.store, publish_linger=linger))
    store = Store.open(settings=settings)
    with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
        deadline = time.monotonic() + 10
        while not producer._publisher.holding and time.monotonic() < deadline:
            time.sleep(0.05)
        first = store.table("commitlog").version()
        deadline, sent = time.monotonic() + 1.5, []

        def send() -> None:
            while time.monotonic() < deadline:
                sent.append(_commit(producer))

        senders = [threading.Thread(target=send) for _ in range(4)]
        for t in senders:
            t.start()
        for t in senders:
            t.join()
        assert _visible(store, set(sent), 10)
        commits = store.table("commitlog").version() - first
    if linger:
        assert commits <= 1.5 / linger + 3, (commits, len(sent))
    else:
        assert commits > 1.5 / 0.3 + 3, (commits, len(sent))


def test_the_linger_is_short_on_local_disk_and_a_fifth_of_a_second_on_an_object_store() -> None:
    assert linger(StoreSettings(), "/data/store") == LOCAL_LINGER == 0.05
    assert linger(StoreSettings(), "s3://bucket/store") == OBJECT_STORE_LINGER == 0.2
    assert linger(StoreSettings(publish_linger=0.5), "/data/store") == 0.5
    assert linger(StoreSettings(publish_linger=0.0), "s3://bucket/store") == 0.0
