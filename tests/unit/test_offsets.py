"""Offsets JSON as users write it (startingOffsets / endingOffsets): exact, or a clear error."""

from __future__ import annotations

import pytest

from rmq_spark import InvalidOptionError
from rmq_spark.spark.offsets import parse_offsets


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
