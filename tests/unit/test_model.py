from __future__ import annotations

import pytest

from rmq_spark import InvalidMessageError, LocalTransactionState, Message
from rmq_spark.model import new_id, queue_for, validate_message


@pytest.mark.parametrize(
    ("message", "match"),
    [
        (Message("bad topic", b"x"), "characters RocketMQ does not allow"),
        (Message("a" * 128, b"x"), "at most 127"),
        (Message("", b"x"), "topic is empty"),
        (Message(42, b"x"), "topic needs to be a string"),  # type: ignore[arg-type]
        (Message("RMQ_SYS_TRANS_HALF_TOPIC", b"x"), "system topic"),
        (Message("RMQ_SYS_TRANS_OP_HALF_TOPIC", b"x"), "system topic"),
        (Message("TRANS_CHECK_MAX_TIME_TOPIC", b"x"), "system topic"),
        (Message("rmq_sys_anything", b"x"), "system topic"),
        (Message("%DLQ%group", b"x"), "system topic"),
        (Message("Orders", b""), "empty body"),
        (Message("Orders", 12), "body needs to be bytes or str"),  # type: ignore[arg-type]
        (Message("Orders", b"x", tags="A||B"), "single tag"),
        (Message("Orders", b"x", keys=["k", 1]), "keys need to be strings"),  # type: ignore[list-item]
        (Message("Orders", b"x", properties={"a": 1}), "mapping of str to str"),  # type: ignore[dict-item]
        (
            Message("Orders", b"x", properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "soon"}),
            "not a number of seconds",
        ),
    ],
)
def test_invalid_messages_name_the_problem(message: Message, match: str) -> None:
    with pytest.raises(InvalidMessageError, match=match):
        validate_message(message)


def test_body_limit_is_configurable() -> None:
    validate_message(Message("Orders", b"x" * 10), max_body_bytes=10)
    with pytest.raises(InvalidMessageError, match="exceeds the limit of 10 bytes"):
        validate_message(Message("Orders", b"x" * 11), max_body_bytes=10)


def test_not_a_message() -> None:
    with pytest.raises(InvalidMessageError, match="expected an rmq_spark.Message"):
        validate_message({"topic": "Orders"})


def test_valid_names_pass() -> None:
    message = Message("Order_Events-1%|x", "body", tags="TagA", keys=["k1", "k2"])
    assert validate_message(message) is message
    assert message.keys_string == "k1 k2"
    assert message.body_bytes == b"body"


@pytest.mark.parametrize(
    ("answer", "state"),
    [
        (LocalTransactionState.COMMIT, LocalTransactionState.COMMIT),
        ("commit", LocalTransactionState.COMMIT),
        ("ROLLBACK_MESSAGE", LocalTransactionState.ROLLBACK),
        (None, LocalTransactionState.UNKNOWN),
        (True, LocalTransactionState.UNKNOWN),
        ("maybe", LocalTransactionState.UNKNOWN),
    ],
)
def test_listener_answers_coerce(answer: object, state: LocalTransactionState) -> None:
    assert LocalTransactionState.coerce(answer) is state


def test_ids_are_unique_and_time_ordered() -> None:
    ids = [new_id() for _ in range(2000)]
    assert len(set(ids)) == len(ids)
    assert all(len(i) == 32 for i in ids)
    assert [i[:12] for i in ids] == sorted(i[:12] for i in ids)


def test_same_keys_same_queue() -> None:
    assert len({queue_for("order-7", 4) for _ in range(20)}) == 1
    assert {queue_for(None, 4) for _ in range(200)} == {0, 1, 2, 3}
