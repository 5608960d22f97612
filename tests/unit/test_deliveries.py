"""Consumer groups over the CommitLog (rmq_spark/store/deliveries.py): hand-outs, invisibility,
redelivery with attempts counted, dead letters, tag filters, groups apart, and two processes
serving one group (two stores opened on one root), on real Delta tables."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rmq_spark import LocalTransactionState, Message, Store
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.store.decisions import Decision
from rmq_spark.store.deliveries import (
    Ack,
    ChangeInvisible,
    DeadLetter,
    InvalidHandleError,
    Receive,
    Renew,
    Sweep,
    dead_letter_topic,
)
from tests.conftest import Clock


@pytest.fixture
def clock() -> Clock:
    return Clock()


def open_store(root: Path, clock: Clock) -> Store:
    settings = Settings(store=StoreSettings(queue_nums=2))
    return Store.open(root, settings=settings, clock=clock)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "store"


@pytest.fixture
def store(root: Path, clock: Clock) -> Store:
    return open_store(root, clock)


def receive(store: Store, group: str = "g", topic: str = "T", n: int = 32, **kw) -> list:
    request = Receive(group, topic, kw.get("tags"), n, kw.get("invisible", 30.0))
    return store.deliveries.handle([request])[0]


def ack(store: Store, handle: str, group: str = "g", topic: str = "T"):
    return store.deliveries.handle([Ack(group, topic, handle)])[0]


def bodies(received: list) -> list[bytes]:
    return sorted(r.message["body"] for r in received)


def send(store: Store, *bodies_: str, topic: str = "T", tags: str | None = None) -> None:
    store.send([Message(topic, b, tags=tags, keys=b) for b in bodies_], "p")


def test_a_group_starts_at_the_end_and_gets_each_message_once_until_acknowledged(store, clock):
    send(store, "old")
    assert receive(store) == []  # the group's start: the end of the topic
    send(store, "a", "b", "c")
    got = receive(store)
    assert bodies(got) == [b"a", b"b", b"c"]
    assert {r.handout.attempt for r in got} == {1}
    assert receive(store) == []  # in flight: invisible to the group
    for r in got:
        assert ack(store, r.handout.handle) is None
    clock.advance(60)
    assert receive(store) == []  # acknowledged: never again


def test_earliest_start_and_each_group_gets_everything(store):
    send(store, "a", "b")
    store.deliveries.configure(max_attempts=16, start="earliest")
    assert bodies(receive(store, "g1")) == [b"a", b"b"]
    assert bodies(receive(store, "g2")) == [b"a", b"b"]


def test_not_acknowledged_comes_back_with_its_attempt_counted(store, clock):
    receive(store)
    send(store, "a")
    first = receive(store, invisible=10)[0]
    clock.advance(9)
    assert receive(store) == []
    clock.advance(2)
    again = receive(store)[0]
    assert again.message["body"] == b"a" and again.handout.attempt == 2
    # The first hand-out's handle is no longer valid; the latest one is.
    assert isinstance(ack(store, first.handout.handle), InvalidHandleError)
    assert ack(store, again.handout.handle) is None
    assert ack(store, again.handout.handle) is None  # a retried acknowledgement


def test_an_expired_handle_is_refused(store, clock):
    receive(store)
    send(store, "a")
    got = receive(store, invisible=10)[0]
    clock.advance(11)
    error = ack(store, got.handout.handle)
    assert isinstance(error, InvalidHandleError) and "expired" in str(error)


def test_change_invisible_duration_gives_a_new_handle_and_keeps_it_invisible(store, clock):
    receive(store)
    send(store, "a")
    got = receive(store, invisible=10)[0]
    new = store.deliveries.handle([ChangeInvisible("g", "T", got.handout.handle, 100)])[0]
    assert isinstance(new, str) and new != got.handout.handle
    clock.advance(50)
    assert receive(store) == []
    assert isinstance(ack(store, got.handout.handle), InvalidHandleError)
    assert ack(store, new) is None


def test_a_renewal_keeps_the_handle_valid_and_the_message_invisible(root, store, clock):
    receive(store)
    send(store, "a")
    got = receive(store, invisible=10)[0]
    clock.advance(8)
    assert store.deliveries.handle([Renew("g", "T", got.handout.handle, 10)]) == [None]
    clock.advance(8)  # past the first invisible duration
    assert receive(store) == [] and receive(open_store(root, clock)) == []
    assert ack(store, got.handout.handle) is None
    clock.advance(60)
    assert receive(store) == []


def test_after_the_last_attempt_a_message_goes_to_the_dead_letter_topic(store, clock):
    store.deliveries.configure(max_attempts=2, start="latest")
    receive(store)
    send(store, "poison", tags="TagA")
    for attempt in (1, 2):
        got = receive(store, invisible=5)
        assert [r.handout.attempt for r in got] == [attempt]
        clock.advance(6)
    assert receive(store) == []
    dlq = dead_letter_topic("g")
    rows = store.query("commitlog", f"topic = '{dlq}'").to_pylist()
    assert [(r["body"], r["tags"]) for r in rows] == [(b"poison", "TagA")]
    assert dict(rows[0]["properties"])["RETRY_TOPIC"] == "T"
    # A dead-letter topic is read like any other.
    store.deliveries.configure(max_attempts=2, start="earliest")
    assert bodies(receive(store, "ops", dlq)) == [b"poison"]


def test_a_sweep_dead_letters_without_waiting_for_a_receive(store, clock):
    store.deliveries.configure(max_attempts=1, start="latest")
    receive(store)
    send(store, "poison")
    receive(store, invisible=5)
    assert store.deliveries.handle([Sweep()]) == [None]  # not yet over
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 0
    clock.advance(6)
    assert store.deliveries.handle([Sweep()]) == [None]
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 1
    clock.advance(60)
    assert receive(store) == []


def test_forward_to_the_dead_letter_topic_on_request(store):
    receive(store)
    send(store, "a")
    got = receive(store)[0]
    assert store.deliveries.handle([DeadLetter("g", "T", got.handout.handle)]) == [None]
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 1


def test_tag_filters(store, clock):
    receive(store)
    send(store, "a", tags="TagA")
    send(store, "b", tags="TagB")
    send(store, "c")
    assert bodies(receive(store, tags=frozenset({"TagA", "TagB"}))) == [b"a", b"b"]
    clock.advance(60)  # the filtered ones are passed over, not handed out later
    assert bodies(receive(store, tags=frozenset({"TagA", "TagB"}))) == [b"a", b"b"]
    assert receive(store, tags=None) == []


def test_a_message_the_groups_filter_no_longer_takes_is_passed_over_not_handed_out(store, clock):
    receive(store)
    send(store, "a", tags="TagA")
    receive(store, invisible=5)
    clock.advance(6)
    assert receive(store, tags=frozenset({"TagB"})) == []
    clock.advance(60)
    assert receive(store) == []  # done for the group


def test_two_consumers_of_a_group_share_the_messages(store):
    receive(store)
    send(store, *(f"m{i}" for i in range(10)))
    one, two = receive(store, n=4), receive(store, n=100)
    assert len(one) == 4 and len(two) == 6
    assert sorted(bodies(one) + bodies(two)) == sorted(f"m{i}".encode() for i in range(10))


def test_only_committed_messages_are_handed_out(store):
    receive(store)
    prepared = store.prepare([Message("T", b"kept"), Message("T", b"dropped")], "p")
    assert receive(store) == []  # half messages: not yet
    store.end_transactions(
        [
            Decision(prepared[0].transaction_id, "p", LocalTransactionState.COMMIT, "test"),
            Decision(prepared[1].transaction_id, "p", LocalTransactionState.ROLLBACK, "test"),
        ]
    )
    assert bodies(receive(store)) == [b"kept"]


def test_two_processes_serve_one_group_together(root, store, clock):
    other = open_store(root, clock)  # another process: its own tables, heads and memory
    receive(store)
    send(store, *(f"m{i}" for i in range(6)))
    mine = receive(store, n=3)
    theirs = receive(other, n=100)
    assert len(mine) == 3 and len(theirs) == 3
    assert not set(bodies(mine)) & set(bodies(theirs))
    # Either process acknowledges the other's hand-outs.
    for r in mine:
        assert ack(other, r.handout.handle) is None
    for r in theirs:
        assert ack(store, r.handout.handle) is None
    clock.advance(60)
    assert receive(store) == [] and receive(other) == []


def test_a_restart_keeps_what_was_acknowledged_and_hands_out_again_what_was_in_flight(
    root, store, clock
):
    receive(store)
    send(store, "acked", "in flight")
    got = {r.message["body"]: r for r in receive(store, invisible=10)}
    ack(store, got[b"acked"].handout.handle)
    restarted = open_store(root, clock)
    assert receive(restarted) == []  # still invisible
    clock.advance(11)
    again = receive(restarted)
    assert bodies(again) == [b"in flight"] and again[0].handout.attempt == 2


def test_a_handle_that_is_not_one_is_refused(store):
    receive(store)
    for handle in ("", "x", "1.2.3", "a.b.c.d.e"):
        assert isinstance(ack(store, handle), InvalidHandleError)


def test_maintenance_trims_what_is_done_and_the_groups_read_the_same(root, store, clock):
    other = open_store(root, clock)  # a server whose memory of the group predates the trim
    receive(store)
    send(store, *(f"m{i}" for i in range(30)))
    for _ in range(3):
        for r in receive(store, n=10):
            ack(store, r.handout.handle)
    send(store, "held")
    held = receive(other, invisible=10)
    assert bodies(held) == [b"held"]
    before = store.read("deliveries").num_rows
    store.compact("deliveries")
    rows = store.read("deliveries")
    assert rows.num_rows < before / 5
    assert set(rows.column("kind").to_pylist()) == {"start", "frontier", "deliver"}
    # The same state, read again or kept in memory: the held message is still in flight.
    restarted = open_store(root, clock)
    assert receive(restarted) == [] and receive(store) == []
    assert ack(other, held[0].handout.handle) is None
    clock.advance(60)
    assert receive(restarted) == []


def test_status_shows_a_serve_group_with_its_lag_and_messages_in_flight(store):
    from rmq_spark.model.config import RetentionSettings
    from rmq_spark.ops.views import groups_view

    receive(store)
    send(store, "a", "b", "c")
    got = receive(store, n=2)
    ack(store, got[0].handout.handle)
    (group,) = groups_view(store, RetentionSettings())["groups"]
    # One message in flight, one never handed out.
    assert (group["consumer_group"], group["reader"], group["topic"]) == ("g", "serve", "T")
    assert group["lag"] == 2 and sum(q["in_flight"] for q in group["queues"]) == 1


def test_a_message_acknowledged_on_another_server_is_not_dead_lettered(root, store, clock):
    """Review: the sweep published before the commit that decided, so a message acknowledged
    through another server (unseen by this one's memory) went to the dead-letter topic too."""
    other = open_store(root, clock)
    for s in (store, other):
        s.deliveries.configure(max_attempts=1, start="latest")
    receive(store)
    send(store, "m")
    (got,) = receive(store, invisible=5)  # its last attempt
    receive(other)  # the other server knows the group
    assert ack(other, got.handout.handle) is None
    clock.advance(6)
    assert store.deliveries.handle([Sweep()]) == [None]
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 0


def test_two_servers_sweeping_one_group_dead_letter_each_message_once(root, store, clock):
    other = open_store(root, clock)
    for s in (store, other):
        s.deliveries.configure(max_attempts=1, start="latest")
    receive(store)
    send(store, "a", "b")
    assert len(receive(store, invisible=5)) == 2
    receive(other)
    clock.advance(6)
    for s in (store, other, store):
        s.deliveries.handle([Sweep()])
    rows = store.query("commitlog", "topic = '%DLQ%g'")
    assert sorted(rows.column("body").to_pylist()) == [b"a", b"b"]
    # Recorded as published: nobody sends them again, even long after.
    clock.advance(600)
    for s in (store, other, open_store(root, clock)):
        s.deliveries.handle([Sweep()])
        receive(s)
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 2


def test_a_dead_letter_decided_by_a_killed_server_is_published_by_another(root, store, clock):
    """Killed after the commit that decided, before the publish: another server publishes it,
    once the decision is old enough to be an orphan."""
    from rmq_spark.store import deliveries as module

    receive(store)
    send(store, "m")
    receive(store, invisible=0.2)
    time.sleep(0.3)
    code = (
        "import sys; from pathlib import Path; from rmq_spark import Store; "
        "from rmq_spark.store.deliveries import Receive; "
        "s = Store.open(Path(sys.argv[1]), create=False); "
        "s.deliveries.configure(max_attempts=1, start='latest'); "
        "s.deliveries.handle([Receive('g', 'T', None, 1, 30.0)])"
    )
    env = {**os.environ, "RMQ_SPARK_FAILPOINT": "deliveries.decided"}
    child = subprocess.run(
        [sys.executable, "-c", code, str(root)], env=env, start_new_session=True, timeout=120
    )
    assert child.returncode == -signal.SIGKILL
    assert "dead" in store.read("deliveries").column("kind").to_pylist()
    survivor = open_store(root, clock)
    survivor.deliveries.configure(max_attempts=1, start="latest")
    clock.advance(5)
    receive(survivor)  # serves the group: finds the decision, not yet an orphan
    survivor.deliveries.handle([Sweep()])
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 0
    clock.advance(module.ORPHANED_DEAD_SECONDS + 30)  # the child's clock ran a few s ahead
    survivor.deliveries.handle([Sweep()])
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 1
    clock.advance(600)
    survivor.deliveries.handle([Sweep()])
    assert store.query("commitlog", "topic = '%DLQ%g'").num_rows == 1
