"""The sink's per-row tag check, through a task's staging step on a real store (no Spark)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyspark.sql.types import StringType, StructField, StructType

from rmq_spark import InvalidMessageError, Message, Store
from rmq_spark.model.messages import validate_message
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.spark.source_options import parse_tags
from rmq_spark.spark.staging import stage

SCHEMA = StructType([StructField(c, StringType()) for c in ("body", "keys", "tags")])


def options(store: Store) -> WriterOptions:
    return WriterOptions.parse(
        {"path": store.root, "topic": "Orders", "producerGroup": "pipeline"}, SCHEMA
    )


@pytest.mark.parametrize(
    ("tag", "match"),
    [
        ("a|b", r"1 row\(s\) have a 'tags' value no subscription can name.*'a\|b'"),
        (" padded", r"1 row\(s\) have a 'tags' value no subscription can name.*' padded'"),
        ("padded\n", r"1 row\(s\) have a 'tags' value no subscription can name"),
        ("", r"1 row\(s\) have a 'tags' value no subscription can name.*''"),
        ("A||B", r"1 row\(s\) have a 'tags' value no subscription can name"),
    ],
)
def test_tags_no_subscription_can_name_are_refused(store: Store, tag: str, match: str) -> None:
    batch = pa.record_batch({"body": ["a", "b"], "keys": ["k", "k"], "tags": ["Fine", tag]})
    with pytest.raises(InvalidMessageError, match=match):
        stage(store, [batch], options(store), "sink", 0, generation=0)
    assert store.table("half").version() == 0  # nothing staged
    with pytest.raises(InvalidMessageError):  # the producer's rule is the same
        validate_message(Message("Orders", b"x", tags=tag))


def test_tags_a_subscription_can_name_are_staged(store: Store) -> None:
    tags = ["TagA", "Tag A", "*", None, "标签"]
    batch = pa.record_batch({"body": list("abcde"), "keys": list("kkkkk"), "tags": tags})
    staged = stage(store, [batch], options(store), "sink", 0, generation=0)
    assert staged.count == 5
    for tag in filter(None, tags):
        assert tag in parse_tags(f"Other || {tag}")
        validate_message(Message("Orders", b"x", tags=tag))
