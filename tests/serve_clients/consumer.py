"""RocketMQ 5's official Python consumers (``rocketmq-python-client``), unchanged, against
``rmqtx serve``: run as child processes by tests/integration/test_serve_consumers.py.

Usage: ``python consumer.py SCENARIO ENDPOINT ACCESS_KEY SECRET_KEY [ARG...]``; the last line
printed is the scenario's result as JSON. Run it with ``HOME`` set to a temporary folder: the
client writes its log under ``~/logs/rocketmq_python/``.
"""

from __future__ import annotations

import json
import sys
import threading
import time

from rocketmq import (
    ClientConfiguration,
    ConsumeResult,
    Credentials,
    FilterExpression,
    MessageListener,
    PushConsumer,
    SimpleConsumer,
)


def simple(endpoint: str, ak: str, sk: str, group: str, topic: str, tags: str) -> SimpleConsumer:
    config = ClientConfiguration(endpoint, Credentials(ak, sk), request_timeout=5)
    consumer = SimpleConsumer(config, group, {topic: FilterExpression(tags)}, await_duration=2)
    consumer.startup()
    return consumer


def seen(message) -> dict:  # noqa: ANN001
    return {
        "id": message.message_id,
        "body": message.body.decode(),
        "tag": message.tag,
        "attempt": message.delivery_attempt,
    }


def receive(
    endpoint: str, ak: str, sk: str, group: str, topic: str, tags: str, want: str, seconds: str
) -> dict:
    """Receive (and acknowledge) until ``want`` messages came or ``seconds`` passed."""
    consumer = simple(endpoint, ak, sk, group, topic, tags)
    got: list[dict] = []
    try:
        deadline = time.monotonic() + float(seconds)
        while len(got) < int(want) and time.monotonic() < deadline:
            for message in consumer.receive(32, 30):
                consumer.ack(message)
                got.append(seen(message))
    finally:
        consumer.shutdown()
    return {"got": got}


def neglect(endpoint: str, ak: str, sk: str, group: str, topic: str, rounds: str) -> dict:
    """Receive one message and never acknowledge it: it comes back after its invisible
    duration, ``rounds`` times; then extend the last hand-out, and acknowledge with an old
    handle (refused) and with the new one."""
    consumer = simple(endpoint, ak, sk, group, topic, "*")
    hand_outs: list[dict] = []
    try:
        deadline = time.monotonic() + 60
        message = None
        while len(hand_outs) < int(rounds) and time.monotonic() < deadline:
            for message in consumer.receive(1, 2):
                hand_outs.append(seen(message))
        result: dict = {"hand_outs": hand_outs}
        if message is not None and len(hand_outs) == int(rounds):
            old = message.receipt_handle
            consumer.change_invisible_duration(message, 20)  # the client keeps the new handle
            new = message.receipt_handle
            result["extended"] = new != old
            time.sleep(3)  # past the first invisible duration: still invisible
            result["after_extension"] = [seen(m) for m in consumer.receive(1, 2)]
            message.receipt_handle = old
            try:
                consumer.ack(message)
                result["old_handle"] = "accepted"
            except Exception as exc:  # noqa: BLE001 (the client's error is the result)
                result["old_handle"] = f"{type(exc).__name__}: {exc}"
            message.receipt_handle = new
            consumer.ack(message)
            result["acked"] = True
    finally:
        consumer.shutdown()
    return result


def forbidden(endpoint: str, ak: str, sk: str, group: str, topic: str) -> dict:
    """A receive the account may not make."""
    consumer = simple(endpoint, ak, sk, group, topic, "*")
    try:
        consumer.receive(1, 10)
        return {"error": None}
    except Exception as exc:  # noqa: BLE001 (the client's error is the result)
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        consumer.shutdown()


def hold(endpoint: str, ak: str, sk: str, group: str, topic: str, want: str) -> dict:
    """Receive ``want`` messages (invisible for 5 s), acknowledge the first half, print what
    was acknowledged and what is held, then wait to be killed."""
    consumer = simple(endpoint, ak, sk, group, topic, "*")
    got: list = []
    deadline = time.monotonic() + 60
    while len(got) < int(want) and time.monotonic() < deadline:
        got += consumer.receive(int(want) - len(got), 5)
    acked = got[: len(got) // 2]
    for message in acked:
        consumer.ack(message)
    held = got[len(acked) :]
    print(json.dumps({"acked": [seen(m) for m in acked], "held": [seen(m) for m in held]}))
    sys.stdout.flush()
    time.sleep(600)
    return {}


class _Counting(MessageListener):
    def __init__(self, fail: set[str], slow: float) -> None:
        self.fail, self.slow = fail, slow
        self.lock = threading.Lock()
        self.consumed: list[dict] = []

    def consume(self, message) -> ConsumeResult:  # noqa: ANN001
        with self.lock:
            self.consumed.append(seen(message))
        time.sleep(self.slow)
        if message.body.decode() in self.fail:
            return ConsumeResult.FAILURE
        return ConsumeResult.SUCCESS


def push(
    endpoint: str, ak: str, sk: str, group: str, topic: str, seconds: str, fail: str, slow: str
) -> dict:
    """A PushConsumer for ``seconds`` whose listener takes ``slow`` seconds a message; the
    bodies in ``fail`` (comma-separated) fail every time."""
    config = ClientConfiguration(endpoint, Credentials(ak, sk), request_timeout=5)
    listener = _Counting(set(filter(None, fail.split(","))), float(slow))
    consumer = PushConsumer(config, group, listener, {topic: FilterExpression("*")})
    consumer.startup()
    try:
        time.sleep(float(seconds))
    finally:
        consumer.shutdown()
    with listener.lock:
        return {"consumed": listener.consumed}


SCENARIOS = {
    "receive": receive,
    "neglect": neglect,
    "forbidden": forbidden,
    "hold": hold,
    "push": push,
}

if __name__ == "__main__":
    print(json.dumps(SCENARIOS[sys.argv[1]](*sys.argv[2:])), flush=True)
