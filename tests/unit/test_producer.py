"""The producer API on a real store: listeners, group commit from many threads, states."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from rmq_spark import (
    EndTransactionStatus,
    InvalidMessageError,
    InvalidOptionError,
    LocalTransactionState,
    Message,
    MessageExt,
    ProducerStateError,
    SendStatus,
    Store,
    TransactionListener,
    TransactionMQProducer,
)
from tests.conftest import commitlog

REPO = Path(__file__).resolve().parents[2]


class ScriptedListener(TransactionListener):
    """Answers with ``arg``; raises when ``arg`` is an exception."""

    def __init__(self) -> None:
        self.seen: list[MessageExt] = []

    def execute_local_transaction(self, msg: MessageExt, arg: object) -> LocalTransactionState:
        self.seen.append(msg)
        if isinstance(arg, Exception):
            raise arg
        return arg  # type: ignore[return-value]

    def check_local_transaction(self, msg: MessageExt) -> LocalTransactionState:
        return LocalTransactionState.UNKNOWN


def pending_ids(store: Store) -> set[str]:
    half = set(store.read("half").column("transaction_id").to_pylist())
    return half - set(store.read("op").column("transaction_id").to_pylist())


def test_lifecycle_commit_rollback_unknown(store: Store) -> None:
    listener = ScriptedListener()
    with TransactionMQProducer("orders", listener, store=store) as producer:
        c = producer.send_message_in_transaction(Message("Orders", b"c"), "COMMIT")
        r = producer.send_message_in_transaction(Message("Orders", b"r"), "ROLLBACK")
        u = producer.send_message_in_transaction(Message("Orders", b"u"), "UNKNOWN")
    assert [x.local_transaction_state for x in (c, r, u)] == ["COMMIT", "ROLLBACK", "UNKNOWN"]
    assert all(x.send_status is SendStatus.SEND_OK for x in (c, r, u))
    assert commitlog(store).column("msg_id").to_pylist() == [c.msg_id]
    assert pending_ids(store) == {u.transaction_id}
    seen = listener.seen[0]
    assert (seen.msg_id, seen.transaction_id, seen.producer_group) == (
        c.msg_id,
        c.transaction_id,
        "orders",
    )


@pytest.mark.parametrize("answer", [RuntimeError("db down"), None, "perhaps"])
def test_listener_failure_counts_as_unknown(store: Store, answer: object) -> None:
    with TransactionMQProducer("orders", ScriptedListener(), store=store) as producer:
        result = producer.send_message_in_transaction(Message("Orders", b"x"), answer)
    assert result.local_transaction_state is LocalTransactionState.UNKNOWN
    assert pending_ids(store) == {result.transaction_id}
    assert commitlog(store).num_rows == 0


def test_explicit_end_transaction_first_decision_wins(store: Store) -> None:
    with TransactionMQProducer("orders", ScriptedListener(), store=store) as producer:
        result = producer.send_message_in_transaction(Message("Orders", b"x"), "UNKNOWN")
        first = producer.end_transaction(result, LocalTransactionState.ROLLBACK)
        late = producer.end_transaction(result, LocalTransactionState.COMMIT)
    assert first.status is EndTransactionStatus.APPLIED
    assert (late.status, late.decision) == ("REFUSED", "ROLLBACK")
    assert commitlog(store).num_rows == 0


def test_concurrent_senders_from_threads(store: Store) -> None:
    threads, per_thread = 16, 12
    results: list = []
    lock = threading.Lock()

    def worker(n: int) -> None:
        for i in range(per_thread):
            state = ("COMMIT", "ROLLBACK", "UNKNOWN")[(n + i) % 3]
            r = producer.send_message_in_transaction(
                Message("Orders", f"{n}-{i}", keys=f"order-{n}"), state
            )
            with lock:
                results.append(r)

    with TransactionMQProducer("orders", ScriptedListener(), store=store) as producer:
        pool = [threading.Thread(target=worker, args=(n,)) for n in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()
        normal = [producer.send(Message("Orders", f"n{i}")) for i in range(3)]
    committed = {r.msg_id for r in results if r.local_transaction_state == "COMMIT"}
    visible = commitlog(store)
    ids = visible.column("msg_id").to_pylist()
    assert len(ids) == len(set(ids))
    assert set(ids) == committed | {n.msg_id for n in normal}
    assert pending_ids(store) == {
        r.transaction_id for r in results if r.local_transaction_state == "UNKNOWN"
    }
    # Group commit: far fewer half-table commits than messages.
    assert store.table("half").version() < threads * per_thread / 2
    # Offsets dense per queue, and a message keeps its queue's order per sender.
    for (_topic, _queue), rows in _by_queue(visible).items():
        assert [r["queue_offset"] for r in rows] == list(range(len(rows)))


def _by_queue(table) -> dict:
    groups: dict = {}
    for row in table.to_pylist():
        groups.setdefault((row["topic"], row["queue_id"]), []).append(row)
    return groups


def test_normal_send_result(store: Store) -> None:
    with TransactionMQProducer("svc", store=store) as producer:
        a = producer.send(Message("Events", b"a", keys="k"))
        b = producer.send(Message("Events", b"b", keys="k"))
    assert (a.queue_id, a.queue_offset, b.queue_offset) == (b.queue_id, 0, 1)


def test_misuse_is_a_clear_error(store: Store) -> None:
    producer = TransactionMQProducer("orders", ScriptedListener(), store=store)
    with pytest.raises(ProducerStateError, match="not started"):
        producer.send_message_in_transaction(Message("Orders", b"x"))
    with (
        TransactionMQProducer("svc", store=store) as no_listener,
        pytest.raises(ProducerStateError, match="no TransactionListener"),
    ):
        no_listener.send_message_in_transaction(Message("Orders", b"x"))
    with producer, pytest.raises(InvalidMessageError, match="exceeds the limit"):
        producer.send_message_in_transaction(Message("Orders", b"x" * (4 * 1024 * 1024 + 1)))
    assert store.table("half").version() == 0


def test_shutdown_while_many_threads_send_never_hangs_nor_fails_accepted_sends(
    store: Store,
) -> None:
    class SlowListener(ScriptedListener):
        """Commits after a short local transaction, so shutdown lands while some run."""

        def __init__(self) -> None:
            super().__init__()
            self.executed: set[str] = set()

        def execute_local_transaction(self, msg: MessageExt, arg: object) -> LocalTransactionState:
            time.sleep(0.02)
            self.executed.add(msg.transaction_id)
            return LocalTransactionState.COMMIT

    listener = SlowListener()
    producer = TransactionMQProducer("orders", listener, store=store).start()
    results: list = []
    refused: list[ProducerStateError] = []
    unexpected: list[BaseException] = []
    lock = threading.Lock()
    started = threading.Barrier(17)

    def sender(n: int) -> None:
        started.wait()
        for i in range(1000):
            try:
                r = producer.send_message_in_transaction(Message("Orders", f"{n}-{i}"))
            except ProducerStateError as exc:
                with lock:
                    refused.append(exc)
                return
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                with lock:
                    unexpected.append(exc)
                return
            with lock:
                results.append(r)

    senders = [threading.Thread(target=sender, args=(n,), daemon=True) for n in range(16)]
    for t in senders:
        t.start()
    started.wait()
    time.sleep(1.0)  # let every sender get going, then shut down under them
    stopper = threading.Thread(target=producer.shutdown, daemon=True)
    stopper.start()
    stopper.join(timeout=30)
    assert not stopper.is_alive(), "shutdown() hung while sends were in flight"
    for t in senders:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in senders), "a sender hung after shutdown"
    assert not unexpected, unexpected
    assert len(refused) == 16 and all("nothing was sent" in str(e) for e in refused)
    # A refused send was refused before its half message: every half message belongs to a
    # returned result, every local transaction that ran has its result, and shutdown
    # recorded (and published) every COMMIT before returning.
    assert results
    half = set(store.read("half").column("transaction_id").to_pylist())
    assert half == {r.transaction_id for r in results} == listener.executed
    assert set(commitlog(store).column("msg_id").to_pylist()) == {r.msg_id for r in results}
    assert not pending_ids(store)


@pytest.mark.parametrize("chore", ["store.maintain", "deltacommit.checkpoint"])
def test_no_send_waits_for_a_compaction_or_a_checkpoint(
    store: Store, tmp_path: Path, chore: str
) -> None:
    """Every 100th commit of a table asks for its checkpoint (some 20 ms), followed by its
    compaction and log cleanup (50 to 100 ms): a producer does them on background threads.
    Here that chore never ends (it pauses at a failpoint), and the sends after it still
    complete; a send that waited would hang. The chore did start: it wrote its pid. A paused
    compaction does not hold back the next checkpoints either (they keep snapshot loads
    short)."""
    marker = tmp_path / "paused"
    child = textwrap.dedent(
        f"""
        import os
        import time
        from rmq_spark import LocalTransactionState, Message, Store, TransactionMQProducer
        from tests.unit.test_producer import ScriptedListener
        COMMIT = LocalTransactionState.COMMIT
        from rmq_spark.model.config import StoreSettings
        store = Store.open({store.root!r}, settings=StoreSettings(intake=False))
        producer = TransactionMQProducer("pg", ScriptedListener(), store=store).start()
        def send(count):
            for i in range(count):
                producer.send_message_in_transaction(Message("T", b"x"), COMMIT)
        send(120)
        deadline = time.monotonic() + 60
        while not os.path.exists({str(marker)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)  # the chore starts, and pauses for good
        send(120)
        producer.flush()
        log = os.path.join(store.table_uri("half"), "_delta_log")
        second = os.path.join(log, "%020d.checkpoint.parquet" % 200)
        while {chore == "store.maintain"} and time.monotonic() < deadline and not (
            os.path.exists(second)
        ):
            time.sleep(0.05)  # the next checkpoint is not held back by a paused compaction
        print(store.table("half").version(), flush=True)
        os._exit(0)  # shutdown() would wait for the paused chore
        """
    )
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RMQ_SPARK_FAILPOINT": f"{chore}:pause",
        "RMQ_SPARK_FAILPOINT_MARKER": str(marker),
    }
    proc = subprocess.run(
        [sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 240
    assert marker.read_text().isdigit()  # the chore started, and never ended
    assert commitlog(store).num_rows == 240
    checkpoints = {
        int(p.name.split(".")[0])
        for p in (Path(store.table_uri("half")) / "_delta_log").glob("*.checkpoint.parquet")
    }
    assert checkpoints == ({100, 200} if chore == "store.maintain" else set())


def test_half_stays_compacted_while_a_producer_sends(store: Store) -> None:
    """A producer commits to ``half`` hundreds of times a second while its compactions run
    on a background thread. deltalake's OPTIMIZE gave up after 15 tries against that, every
    time, and ``half`` grew by a file per send for as long as the sends went on; a compaction
    now takes the next free version as an append does."""
    with TransactionMQProducer("pg", ScriptedListener(), store=store) as producer:
        for _ in range(1500):
            producer.send_message_in_transaction(Message("T", b"x"), LocalTransactionState.COMMIT)
        files = len(store.data_files("half"))  # before shutdown's last compaction
    assert files < 300
    assert commitlog(store).num_rows == 1500


def test_shutdown_finishes_the_compactions_its_sends_asked_for(store: Store) -> None:
    listener = ScriptedListener()
    with TransactionMQProducer("pg", listener, store=store) as producer:
        for _ in range(110):
            producer.send_message_in_transaction(Message("T", b"x"), LocalTransactionState.COMMIT)
    # The 100th commit of half asked for a checkpoint and then a compaction; both are done
    # when shutdown returns.
    assert len(store.data_files("half")) < 20


@pytest.mark.parametrize("bad", ["keys", "tags", "property"])
def test_an_unencodable_message_fails_its_sender_only(store: Store, bad: str) -> None:
    """A lone surrogate passed validation and failed the group commit it shared: 14 of 15
    concurrent good senders failed with its error. It is refused as it is sent."""
    poison = {
        "keys": {"keys": "k\udcff"},
        "tags": {"tags": "t\udcff"},
        "property": {"properties": {"origin": "file-\udcff"}},
    }[bad]
    barrier = threading.Barrier(16)
    results: dict[int, object] = {}

    def sender(n: int) -> None:
        message = Message("Orders", f"m{n}", **(poison if n == 0 else {}))
        barrier.wait()
        try:
            results[n] = producer.send_message_in_transaction(message, "COMMIT")
        except Exception as exc:
            results[n] = exc

    with TransactionMQProducer("orders", ScriptedListener(), store=store) as producer:
        threads = [threading.Thread(target=sender, args=(n,)) for n in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    assert isinstance(results[0], InvalidMessageError) and "UTF-8" in str(results[0])
    assert all(results[n].send_status is SendStatus.SEND_OK for n in range(1, 16))
    assert commitlog(store).num_rows == 15


@pytest.mark.parametrize("max_batch", ["16", None, 0, 1.5, True])
def test_a_bad_max_batch_is_refused_at_once(store: Store, max_batch: object) -> None:
    """max_batch="16" was accepted; the committer thread died on the first send and every send
    and shutdown() then blocked for ever."""
    with pytest.raises(InvalidOptionError, match="max_batch needs to be an int of at least 1"):
        TransactionMQProducer("orders", ScriptedListener(), store=store, max_batch=max_batch)


@pytest.mark.parametrize(
    ("result", "state", "match"),
    [
        ("01A20F", "COMMIT", "needs the TransactionSendResult.*got str"),
        (None, "COMMIT", "needs the TransactionSendResult.*got NoneType"),
        ("sent", "commit!", "state of COMMIT or ROLLBACK.*'commit!'"),
        ("sent", 1, "state of COMMIT or ROLLBACK.*1"),
    ],
)
def test_end_transaction_with_wrong_types_is_a_clear_error(
    store: Store, result: object, state: object, match: str
) -> None:
    """Wrong types gave a bare AttributeError from inside the producer."""
    with TransactionMQProducer("orders", ScriptedListener(), store=store) as producer:
        sent = producer.send_message_in_transaction(Message("Orders", b"u"), "UNKNOWN")
        with pytest.raises(InvalidOptionError, match=match):
            producer.end_transaction(sent if result == "sent" else result, state)
