from __future__ import annotations

import pyarrow as pa
import pytest

from rmq_spark import InvalidMessageError, LocalTransactionState, Message
from rmq_spark.model.messages import new_id, new_ids, queue_for, queues_for, validate_message


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
        (Message("Orders", b"x", tags="a|b"), "no '|'"),
        (Message("Orders", b"x", tags=" padded"), "leading or trailing whitespace"),
        (Message("Orders", b"x", tags="padded\t"), "leading or trailing whitespace"),
        (Message("Orders", b"x", tags=""), "empty"),
        (Message("Orders", b"x", tags=7), "single tag"),  # type: ignore[arg-type]
        (Message("Orders", b"x", keys=5), "keys need to be a string or an iterable"),  # type: ignore[arg-type]
        (Message("Orders", b"x", keys=["k", 1]), "keys need to be strings"),  # type: ignore[list-item]
        (Message("Orders", b"x", properties={"a": 1}), "mapping of str to str"),  # type: ignore[dict-item]
        (
            Message("Orders", b"x", properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": "soon"}),
            "not a number of seconds",
        ),
        # Python's float() takes these; Spark's cast (and RocketMQ's parse) does not.
        *(
            (
                Message("Orders", b"x", properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": bad}),
                "not a number of seconds",
            )
            for bad in ("1_0", "\uff11\uff10", " 10", "10 ", "1e3", "inf", "nan", "-0", "+5")
        ),
        # Lone surrogates (surrogateescape-decoded file names, environment values) cannot be
        # stored as UTF-8: they failed the whole group commit they were part of.
        (Message("Orders", b"x", keys="k\udcff"), "keys.*UTF-8"),
        (Message("Orders", b"x", tags="t\udcff"), "tags.*UTF-8"),
        (Message("Orders", b"x", properties={"k\udcff": "v"}), "property name.*UTF-8"),
        (Message("Orders", b"x", properties={"k": "v\ud800"}), "property 'k'.*UTF-8"),
        (Message("Orders", "body\udcff"), "body.*UTF-8"),
        # RocketMQ stores keys, tags and properties in one property block of at most 32767 bytes.
        (Message("Orders", b"x", keys="k" * 40_000), "32767 bytes"),
        (Message("Orders", b"x", properties={"big": "v" * 20_000_000}), "32767 bytes"),
    ],
)
def test_invalid_messages_name_the_problem(message: Message, match: str) -> None:
    with pytest.raises(InvalidMessageError, match=match):
        validate_message(message)


@pytest.mark.parametrize("seconds", ["0", "30", "2.5", "3600"])
def test_immunity_in_plain_seconds_passes(seconds: str) -> None:
    validate_message(
        Message("Orders", b"x", properties={"CHECK_IMMUNITY_TIME_IN_SECONDS": seconds})
    )


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
        ("COMMIT", LocalTransactionState.COMMIT),
        ("ROLLBACK", LocalTransactionState.ROLLBACK),
        # RocketMQ's Java enum names, as users porting a listener write them.
        ("COMMIT_MESSAGE", LocalTransactionState.COMMIT),
        ("ROLLBACK_MESSAGE", LocalTransactionState.ROLLBACK),
        ("UNKNOW", LocalTransactionState.UNKNOWN),
        # Anything else is UNKNOWN: a guess must never commit or roll back.
        ("commit", LocalTransactionState.UNKNOWN),
        ("Commit_Message", LocalTransactionState.UNKNOWN),
        (" ROLLBACK", LocalTransactionState.UNKNOWN),
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


def test_bulk_ids_are_one_prefix_and_the_index_in_hex() -> None:
    ids = new_ids(70_000).to_pylist()
    assert len(set(ids)) == len(ids) == 70_000
    assert ids == sorted(ids) and {i[:24] for i in ids} == {ids[0][:24]}
    assert [i[24:] for i in ids[:2] + ids[-1:]] == ["00000000", "00000001", f"{69_999:08X}"]
    assert new_ids(5).to_pylist()[0][:12] >= ids[0][:12]  # time-ordered with new_id
    assert new_ids(0).to_pylist() == []


def test_bulk_queues_agree_with_one_message_queues() -> None:
    keys = [f"order-{i % 50}" for i in range(2_000)]
    assert queues_for(pa.chunked_array([keys[:7], keys[7:]]), 2_000, 8).to_pylist() == [
        queue_for(k, 8) for k in keys
    ]
    spread = queues_for(pa.array([None, ""] * 200), 400, 4).to_pylist()
    assert set(spread) == {0, 1, 2, 3}  # rows without keys go to random queues, each its own
    assert set(queues_for(None, 400, 4).to_pylist()) == {0, 1, 2, 3}
    assert queues_for(pa.array([], pa.string()), 0, 4).to_pylist() == []


def test_keys_from_a_generator_are_kept() -> None:
    message = Message("Orders", b"x", keys=(k for k in ["order-7", "user-3"]))
    assert validate_message(message) is message
    assert message.keys == ("order-7", "user-3")
    assert message.keys_string == "order-7 user-3"  # validation did not consume them
    assert queue_for(message.keys_string, 4) == queue_for("order-7 user-3", 4)
    assert Message("Orders", b"x", keys=iter([])).keys_string is None


@pytest.mark.parametrize("tag", ["TagA", "Tag A", "*", "a-b_c.d", "标签"])
def test_tags_a_subscription_can_name_pass(tag: str) -> None:
    from rmq_spark.spark.source_options import parse_tags

    validate_message(Message("Orders", b"x", tags=tag))
    assert tag in parse_tags(f"Other || {tag}")


@pytest.mark.parametrize("name", ["Orders\n", "Orders\r\n"])
def test_a_name_with_a_line_break_is_refused(name: str) -> None:
    """``^...$`` with ``re.match`` took ``'Orders\\n'``: a topic or group could then forge a
    line of ``rmqtx status`` (review of #49)."""
    from rmq_spark.model.messages import check_group, check_topic

    with pytest.raises(InvalidMessageError, match="has characters RocketMQ does not allow"):
        check_topic(name)
    with pytest.raises(InvalidMessageError, match="is not valid"):
        check_group(name, "producer_group")
