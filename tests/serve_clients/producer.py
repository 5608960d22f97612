"""RocketMQ 5 clients against ``rmqtx serve``, run as child processes by
tests/integration/test_serve.py: the official Python client (``rocketmq-python-client``),
unchanged, and a raw gRPC stub for what the client never sends (a retry with the same message
id, an illegal topic, a body over the limit).

Usage: ``python producer.py SCENARIO ENDPOINT ACCESS_KEY SECRET_KEY [ARG...]``; the last line
printed is the scenario's result as JSON. Run it with ``HOME`` set to a temporary folder: the
client writes its log under ``~/logs/rocketmq_python/``.
"""

from __future__ import annotations

import datetime
import gzip
import hashlib
import hmac
import json
import os
import sys
import threading
import time

import grpc
from google.protobuf.timestamp_pb2 import Timestamp
from rocketmq import (
    ClientConfiguration,
    Credentials,
    Message,
    Producer,
    TransactionChecker,
    TransactionResolution,
)
from rocketmq.grpc_protocol import definition_pb2 as pb
from rocketmq.grpc_protocol import service_pb2 as service_pb
from rocketmq.grpc_protocol import service_pb2_grpc as service_grpc

TOPIC, TX_TOPIC = "Orders", "TxOrders"
#: The most one request to ``rmqtx serve`` carries (RocketMQ's proxy's transport limit).
REQUEST_BYTES = 130 * 1024 * 1024


def message(topic: str, body: bytes, key: str | None = None) -> Message:
    m = Message()
    m.topic = topic
    m.body = body
    m.tag = "TagA"
    if key:
        m.keys = key
    m.add_property("origin", "serve-test")
    return m


class BodyChecker(TransactionChecker):
    """Commits a transaction whose body starts with ``commit``, rolls back the others."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}
        self.changed = threading.Condition()

    def check(self, msg: Message) -> TransactionResolution:
        commit = msg.body.startswith(b"commit")
        with self.changed:
            self.seen[msg.message_id] = "COMMIT" if commit else "ROLLBACK"
            self.changed.notify_all()
        return TransactionResolution.COMMIT if commit else TransactionResolution.ROLLBACK


def producer(
    endpoint: str, ak: str, sk: str, checker: TransactionChecker | None = None, tls: bool = False
):
    config = ClientConfiguration(endpoint, Credentials(ak, sk), request_timeout=5)
    p = Producer(config, (TOPIC, TX_TOPIC), checker, tls_enable=tls)
    p.startup()
    return p


def basic(endpoint: str, ak: str, sk: str) -> dict:
    """A normal send, a transaction committed, one rolled back and then committed (refused)."""
    p = producer(endpoint, ak, sk, BodyChecker())
    try:
        normal = p.send(message(TOPIC, b"normal", "k-normal"))
        tx = p.begin_transaction()
        committed = p.send(message(TX_TOPIC, b"committed", "k-commit"), tx)
        tx.commit()
        tx = p.begin_transaction()
        rolled_back = p.send(message(TX_TOPIC, b"rolled back", "k-rollback"), tx)
        tx.rollback()
        try:
            tx.commit()
            refused = None
        except Exception as exc:  # ClientException(code, message)
            refused = str(exc)
        return {
            "normal": normal.message_id,
            "committed": committed.message_id,
            "committed_txn": committed.transaction_id,
            "rolled_back": rolled_back.message_id,
            "rolled_back_txn": rolled_back.transaction_id,
            "refused": refused,
        }
    finally:
        p.shutdown()


def orphan(endpoint: str, ak: str, sk: str) -> None:
    """Send a half message whose body says commit, print it, and die without ending it."""
    p = producer(endpoint, ak, sk, BodyChecker())
    tx = p.begin_transaction()
    sent = p.send(message(TX_TOPIC, b"commit: orphaned"), tx)
    print(json.dumps({"orphan": sent.message_id, "orphan_txn": sent.transaction_id}), flush=True)
    os._exit(0)  # no shutdown, no end-transaction: as if killed


def checked(endpoint: str, ak: str, sk: str, *waited: str) -> dict:
    """Leave two transactions open and answer the server's checks until they and the
    ``waited`` message ids were checked."""
    checker = BodyChecker()
    p = producer(endpoint, ak, sk, checker)
    try:
        sent = {}
        for body in (b"commit: open", b"rollback: open"):
            receipt = p.send(message(TX_TOPIC, body), p.begin_transaction())
            sent[body.decode()] = (receipt.message_id, receipt.transaction_id)
        expected = {mid for mid, _ in sent.values()} | set(waited)
        with checker.changed:
            checker.changed.wait_for(lambda: expected <= set(checker.seen), timeout=60)
        time.sleep(1.0)  # the checker's EndTransaction is sent after check() returns
        return {"sent": sent, "checked": checker.seen}
    finally:
        p.shutdown()


def refused_send(endpoint: str, ak: str, sk: str, topic: str) -> dict:
    """A normal send that should fail (wrong secret, unknown topic)."""
    p = producer(endpoint, ak, sk)
    try:
        p.send(message(topic, b"must not be stored"))
        return {"refused": False}
    except Exception as exc:
        return {"refused": True, "error": f"{type(exc).__name__}: {exc}"}
    finally:
        p.shutdown()


def tls_send(endpoint: str, ak: str, sk: str) -> dict:
    """A normal send over TLS (the server's certificate is trusted through
    ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``)."""
    p = producer(endpoint, ak, sk, tls=True)
    try:
        return {"normal": p.send(message(TOPIC, b"over TLS")).message_id}
    finally:
        p.shutdown()


def heartbeat(endpoint: str, ak: str, sk: str, kind: str) -> dict:
    """One signed Heartbeat over a ``plaintext`` or ``tls`` channel (the server's certificate
    trusted through ``GRPC_DEFAULT_SSL_ROOTS_FILE_PATH``): its status code, or the gRPC error
    of a connection the server does not take."""
    channel = (
        grpc.secure_channel(endpoint, grpc.ssl_channel_credentials())
        if kind == "tls"
        else grpc.insecure_channel(endpoint)
    )
    stub = service_grpc.MessagingServiceStub(channel)
    try:
        response = stub.Heartbeat(
            service_pb.HeartbeatRequest(), metadata=_metadata(ak, sk), timeout=10
        )
        return {"code": pb.Code.Name(response.status.code)}
    except grpc.RpcError as exc:
        return {"code": exc.code().name}


def _metadata(ak: str, sk: str) -> list[tuple[str, str]]:
    stamp = datetime.datetime.now().strftime("%Y%m%dT%H%M%SZ")
    signature = hmac.new(sk.encode(), stamp.encode(), hashlib.sha1).hexdigest()
    return [
        ("x-mq-date-time", stamp),
        ("x-mq-client-id", "raw-stub"),
        (
            "authorization",
            f"MQv2-HMAC-SHA1 Credential={ak}, SignedHeaders=x-mq-date-time, Signature={signature}",
        ),
    ]


def _raw_message(topic: str, message_id: str, body: bytes, kind: int) -> pb.Message:
    m = pb.Message(topic=pb.Resource(name=topic), body=body)
    m.system_properties.message_id = message_id
    m.system_properties.message_type = kind
    m.system_properties.body_encoding = pb.IDENTITY
    return m


def raw(endpoint: str, ak: str, sk: str, run_id: str, limit: str) -> dict:
    """Sends and end-transactions through a raw stub; the status code of each."""
    stub = service_grpc.MessagingServiceStub(grpc.insecure_channel(endpoint))
    md = _metadata(ak, sk)

    def send(topic: str, message_id: str, body: bytes, kind: int = pb.NORMAL):
        return send_request([_raw_message(topic, message_id, body, kind)])

    def send_request(messages: list[pb.Message]) -> dict:
        request = service_pb.SendMessageRequest(messages=messages)
        response = stub.SendMessage(request, metadata=md, timeout=60)
        entry = response.entries[0] if response.entries else None
        return {
            "code": pb.Code.Name(response.status.code),
            "message": response.status.message,
            "message_id": entry.message_id if entry else None,
            "transaction_id": entry.transaction_id if entry else None,
        }

    def end(transaction_id: str, resolution: int) -> dict:
        request = service_pb.EndTransactionRequest(
            topic=pb.Resource(name=TX_TOPIC),
            transaction_id=transaction_id,
            resolution=resolution,
            source=pb.SOURCE_CLIENT,
        )
        response = stub.EndTransaction(request, metadata=md, timeout=30)
        return {"code": pb.Code.Name(response.status.code), "message": response.status.message}

    def refused(name: str, properties=None, delivery=None, group=None) -> dict:
        m = _raw_message(TOPIC, f"RAW-{name}-{run_id}", b"must not be stored", pb.NORMAL)
        m.user_properties.update(properties or {})
        if delivery is not None:
            m.system_properties.delivery_timestamp.CopyFrom(delivery)
        if group is not None:
            m.system_properties.message_group = group
        response = stub.SendMessage(service_pb.SendMessageRequest(messages=[m]), metadata=md)
        return {"code": pb.Code.Name(response.status.code), "message": response.status.message}

    def zipped(message_id: str, body: bytes) -> pb.Message:
        m = _raw_message(TOPIC, message_id, body, pb.NORMAL)
        m.system_properties.body_encoding = pb.GZIP
        return m

    digits = b"".join(str(i).encode() for i in range(10000))  # 38,890 B, barely compressible
    cut = gzip.compress(digits)
    # Each body unzips to the limit exactly, all of them to more than one request may carry.
    bomb = gzip.compress(bytes(int(limit)))
    bombs = [zipped(f"RAW-BOMB-{run_id}-{i}", bomb) for i in range(REQUEST_BYTES // int(limit) + 1)]
    later = Timestamp()
    later.FromSeconds(int(time.time()) + 3600)
    recall = stub.RecallMessage(
        service_pb.RecallMessageRequest(topic=pb.Resource(name=TOPIC), recall_handle="x"),
        metadata=md,
        timeout=30,
    )
    reused = f"RAW-REUSED-{run_id}"
    normal_id, half_id = f"RAW-NORMAL-{run_id}", f"RAW-HALF-{run_id}"
    first_half = send(TX_TOPIC, half_id, b"retried half", pb.TRANSACTION)
    txn = first_half["transaction_id"]
    return {
        "normal": [send(TOPIC, normal_id, b"retried normal") for _ in range(2)],
        "half": [first_half, send(TX_TOPIC, half_id, b"retried half", pb.TRANSACTION)],
        "commit": end(txn, pb.COMMIT),
        "commit_again": end(txn, pb.COMMIT),
        "rollback_late": end(txn, pb.ROLLBACK),
        "unknown_txn": end("0" * 32, pb.COMMIT),
        "illegal_topic": send("bad topic!", f"RAW-BAD-{run_id}", b"x"),
        "unknown_topic": send("NoSuchTopic", f"RAW-UNKNOWN-{run_id}", b"x"),
        "too_large": send(TOPIC, f"RAW-LARGE-{run_id}", b"x" * (int(limit) + 1)),
        "huge": send(TOPIC, f"RAW-HUGE-{run_id}", b"x" * (4 * 1024 * 1024)),
        "gzip": send_request(
            [zipped(f"RAW-GZIP-{run_id}", gzip.compress(b"two gzip ") + gzip.compress(b"members"))]
        ),
        "truncated": send_request([zipped(f"RAW-TRUNCATED-{run_id}", cut[: len(cut) // 2])]),
        "bomb": send_request(bombs),
        "system_property": refused("SYSPROP", properties={"__STARTDELIVERTIME": "1"}),
        "immunity": refused("IMMUNITY", properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "600"}),
        "control": refused("CONTROL", properties={"bell\a": "x"}),
        "delayed": refused("DELAYED", delivery=later),
        "grouped": refused("GROUPED", group="g1"),
        "reused_id": [send(TOPIC, reused, body) for body in (b"first", b"second", b"second")],
        "recall": [pb.Code.Name(recall.status.code), recall.status.message],
        "unsigned": pb.Code.Name(
            stub.Heartbeat(service_pb.HeartbeatRequest(), timeout=30).status.code
        ),
    }


def cross(endpoint: str, ak: str, sk: str, other_txn: str) -> dict:
    """What another account's key may do (the server allows it topic ``Billing`` only): the
    status code of a route, a send and an end of ``other_txn`` on ``TxOrders``, and of a
    send to its own topic."""
    stub = service_grpc.MessagingServiceStub(grpc.insecure_channel(endpoint))
    md = _metadata(ak, sk)

    def send(topic: str) -> str:
        message = _raw_message(topic, f"CROSS-{topic}-{time.time_ns()}", b"cross", pb.NORMAL)
        request = service_pb.SendMessageRequest(messages=[message])
        return pb.Code.Name(stub.SendMessage(request, metadata=md, timeout=30).status.code)

    route = stub.QueryRoute(
        service_pb.QueryRouteRequest(topic=pb.Resource(name=TX_TOPIC)), metadata=md, timeout=30
    )
    end = stub.EndTransaction(
        service_pb.EndTransactionRequest(
            topic=pb.Resource(name=TX_TOPIC),
            transaction_id=other_txn,
            resolution=pb.ROLLBACK,
            source=pb.SOURCE_SERVER_CHECK,
        ),
        metadata=md,
        timeout=30,
    )
    return {
        "route": [pb.Code.Name(route.status.code), route.status.message],
        "send": send(TX_TOPIC),
        "end": [pb.Code.Name(end.status.code), end.status.message],
        "own_send": send("Billing"),
    }


def listen(endpoint: str, ak: str, sk: str, seconds: str, answer: str) -> dict:
    """A telemetry stream that declares ``TxOrders`` and collects for ``seconds`` the
    transactions the server asks about; ``answer`` ``commit``: COMMITs each with no
    ``source``, as the Go client's checker does (else none is answered)."""
    stub = service_grpc.MessagingServiceStub(grpc.insecure_channel(endpoint))
    done = threading.Event()

    def commands():
        settings = pb.Settings(client_type=pb.PRODUCER)
        settings.publishing.topics.append(pb.Resource(name=TX_TOPIC))
        yield service_pb.TelemetryCommand(settings=settings)
        done.wait()

    asked: list[str] = []
    stream = stub.Telemetry(commands(), metadata=_metadata(ak, sk))
    threading.Timer(float(seconds), lambda: (done.set(), stream.cancel())).start()
    try:
        for command in stream:
            if command.WhichOneof("command") == "recover_orphaned_transaction_command":
                asked.append(command.recover_orphaned_transaction_command.transaction_id)
                if answer == "commit":
                    ended = stub.EndTransaction(
                        service_pb.EndTransactionRequest(
                            topic=pb.Resource(name=TX_TOPIC),
                            transaction_id=asked[-1],
                            resolution=pb.COMMIT,
                        ),
                        metadata=_metadata(ak, sk),
                        timeout=30,
                    )
                    assert ended.status.code == pb.OK, ended.status
    except grpc.RpcError as exc:
        if exc.code() != grpc.StatusCode.CANCELLED:
            return {"asked": asked, "error": exc.code().name}
    return {"asked": asked}


def flood(endpoint: str, ak: str, sk: str, senders: str) -> None:
    """Send and commit transactions from ``senders`` threads until the server goes; print a
    JSON line as each send and each commit returns (the test kills the server meanwhile)."""
    p = producer(endpoint, ak, sk, BodyChecker())
    out = threading.Lock()

    def report(**fields: str) -> None:
        with out:
            print(json.dumps(fields), flush=True)

    def send(thread: int) -> None:
        for i in range(1_000_000):
            try:
                tx = p.begin_transaction()
                receipt = p.send(message(TX_TOPIC, f"commit: {thread}-{i}".encode()), tx)
                report(sent=receipt.message_id)
                tx.commit()
                report(committed=receipt.message_id)
            except Exception:
                return

    threads = [threading.Thread(target=send, args=(t,)) for t in range(int(senders))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    os._exit(0)  # the server is gone: no orderly shutdown


SCENARIOS = {
    "basic": basic,
    "orphan": orphan,
    "checked": checked,
    "refused-send": refused_send,
    "raw": raw,
    "tls-send": tls_send,
    "flood": flood,
    "cross": cross,
    "heartbeat": heartbeat,
    "listen": listen,
}

if __name__ == "__main__":
    scenario, *args = sys.argv[1:]
    print(json.dumps(SCENARIOS[scenario](*args)), flush=True)
