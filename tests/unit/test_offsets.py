"""Offsets JSON as users write it (startingOffsets / endingOffsets): exact, or a clear error;
and how much of a backlog a micro-batch admits (maxMessagesPerTrigger, maxBytesPerTrigger)."""

from __future__ import annotations

import pyarrow as pa
import pytest

from rmq_spark import InvalidOptionError
from rmq_spark.spark.offsets import admit, parse_offsets, share, stored_bytes


@pytest.mark.parametrize(
    "text",
    [
        '{"T": {"0": 1.5}}',  # int() truncated it to 1
        '{"T": {"0": "7"}}',  # int() took the string
        '{"T": {"0": true}}',
        '{"T": {"0": 9223372036854775808}}',  # past int64: Spark's long cannot hold it
        '{"T": {"1.5": 3}}',
        '{"T": {"\\u0663": 3}}',  # an Arabic-Indic digit: int() reads 3
        '{"T": {" 1": 3}}',
        '{"T": [1, 2]}',
    ],
)
def test_offsets_that_are_not_exact_json_integers_are_refused(text: str) -> None:
    with pytest.raises(InvalidOptionError, match="startingOffsets.*e.g."):
        parse_offsets(text, "startingOffsets", ["T"])


def test_exact_offsets_pass() -> None:
    assert parse_offsets('{"T": {"0": 42, "3": -2, "1": -1}}', "startingOffsets", ["T"]) == {
        "T": {0: 42, 3: -2, 1: -1}
    }


def _files(*rows: tuple) -> pa.Table:
    """CommitLog add actions: (topic, queues, offsets, size_bytes, num_records)."""
    return pa.table(
        {
            "partition.topic": [r[0] for r in rows],
            "min.queue_id": [r[1][0] for r in rows],
            "max.queue_id": [r[1][1] for r in rows],
            "min.queue_offset": [r[2][0] for r in rows],
            "max.queue_offset": [r[2][1] for r in rows],
            "size_bytes": [r[3] for r in rows],
            "num_records": [r[4] for r in rows],
        }
    )


def test_a_message_cap_is_shared_fairly_over_queues() -> None:
    a, b, c = ("T", 0), ("T", 1), ("T", 2)
    assert share({a: 5, b: 5, c: 0}, 3) == {a: 2, b: 1, c: 0}
    assert share({a: 1, b: 9}, 6) == {a: 1, b: 5}
    assert share({a: 5, b: 5}, None) == {a: 5, b: 5}


def test_a_byte_cap_fills_queues_by_their_sizes_and_always_admits_one() -> None:
    a, b = ("T", 0), ("T", 1)
    cost = {a: lambda n: 3000 * n, b: lambda n: 100 * n}
    # Equal counts while both fit, then the small messages take what is left.
    assert share({a: 5, b: 50}, None, 10_000, cost) == {a: 3, b: 10}
    assert share({a: 5, b: 50}, 4, 10_000, cost) == {a: 2, b: 2}  # the message cap first
    assert share({a: 5, b: 5}, None, 10, cost) == {a: 1, b: 0}  # below one message: one


def test_stored_bytes_come_from_file_sizes_and_row_counts() -> None:
    files = _files(
        ("T", (0, 0), (0, 9), 10_000, 10),  # queue 0, 1000 bytes a message
        ("T", (0, 1), (10, 19), 40_000, 20),  # queues 0 and 1 together, 2000 bytes a message
        ("U", (0, 0), (0, 99), 10**9, 100),  # another topic
    )
    cost = stored_bytes(files, {("T", 0): 5, ("T", 1): 12}, {("T", 0): 20, ("T", 1): 20})
    assert [cost[("T", 0)](n) for n in (0, 5, 6, 15)] == [0, 5000, 7000, 25_000]
    assert cost[("T", 1)](8) == 16_000
    assert stored_bytes(files, {("T", 3): 0}, {("T", 3): 5})[("T", 3)](5) == 0  # no file


def test_admit_caps_a_batch_by_estimated_bytes() -> None:
    files = _files(("T", (0, 1), (0, 9), 20_000, 20))  # 1000 bytes a message
    latest = {"T": {0: 10, 1: 10}}
    assert admit({}, latest, None, 4500, lambda: files) == {"T": {0: 2, 1: 2}}
    assert admit({"T": {0: 9, 1: 10}}, latest, None, 1, lambda: files) == {"T": {0: 10, 1: 10}}
    assert admit({}, latest, 3, None) == {"T": {0: 2, 1: 1}}
