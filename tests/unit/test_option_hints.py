"""A Kafka user's habits and typos in ``format("rmqtx")`` options: the error names the option
rmq-spark uses instead (no Spark needed: options are parsed before any read or write)."""

from __future__ import annotations

import pytest
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.spark.source_options import ReaderOptions


@pytest.mark.parametrize(
    ("option", "value", "streaming", "hint"),
    [
        ("subscribe", "Orders", False, "Spark's Kafka option; use 'topic'"),
        ("subscribePattern", "Ord.*", True, "a pattern of topics is not supported; name the"),
        ("includeHeaders", "true", True, "'includeHeaders' is Spark's Kafka option: not needed"),
        ("minPartitions", "8", False, "one Spark partition per queue"),
        ("minOffsetsPerTrigger", "8", True, "'minOffsetsPerTrigger'.*not supported"),
        ("maxTriggerDelay", "5m", True, "'maxTriggerDelay'.*not supported"),
        ("maxOffsetsPerTrigger", "5", True, "use 'maxMessagesPerTrigger'"),
        ("kafka.bootstrap.servers", "host:9092", False, "use 'path'"),
        ("kafka.group.id", "billing", True, "use 'consumerGroup'"),
        ("groupIdPrefix", "billing", True, "use 'consumerGroup'"),
        ("startingOffsetsByTimestamp", "{}", True, "use 'startingTimestamp'"),
        ("startingOffset", "earliest", True, "did you mean 'startingOffsets'"),
        ("consumergrup", "billing", True, "did you mean 'consumerGroup'"),
    ],
)
def test_reader_option_names_from_kafka_and_typos(option, value, streaming, hint) -> None:
    with pytest.raises(InvalidOptionError, match=f"unknown option.*{hint}.*valid options: path"):
        ReaderOptions.parse({"topic": "Orders", option: value}, streaming=streaming)


def test_a_kafka_option_is_named_as_kafka_spells_it_whatever_spark_passes() -> None:
    """Spark hands a data source its option names lower-cased: the hint said
    'maxoffsetspertrigger' (#48)."""
    with pytest.raises(InvalidOptionError) as refused:
        ReaderOptions.parse({"topic": "Orders", "maxoffsetspertrigger": "5"}, streaming=True)
    assert "unknown option(s) 'maxOffsetsPerTrigger'" in refused.value.message
    assert "'maxOffsetsPerTrigger' is Spark's Kafka option; use 'maxMessagesPerTrigger'" in (
        refused.value.message
    )


@pytest.mark.parametrize("pattern", ["Order.*", "Order[AB]", "^Orders$", "(Orders)"])
def test_a_topic_pattern_is_refused_as_a_pattern(pattern) -> None:
    """``topic=Order.*`` (a Kafka user's subscribePattern) said only that the topic "has
    characters RocketMQ does not allow" (#48)."""
    with pytest.raises(InvalidOptionError) as refused:
        ReaderOptions.parse({"topic": pattern}, streaming=True)
    message = refused.value.message
    assert f"option 'topic': {pattern!r} is a pattern" in message
    assert "name the topics, separated by commas" in message
    assert "rmqtx status" in message


def test_writer_option_names_from_kafka_and_typos() -> None:
    schema = StructType([StructField("value", BinaryType()), StructField("key", StringType())])
    with pytest.raises(InvalidOptionError, match="'kafka.bootstrap.servers'.*use 'path'"):
        WriterOptions.parse(
            {"topic": "T", "producerGroup": "g", "kafka.bootstrap.servers": "h:9092"}, schema
        )
    with pytest.raises(InvalidOptionError, match="did you mean 'producerGroup'"):
        WriterOptions.parse({"topic": "T", "producerGrop": "g"}, schema)


@pytest.mark.parametrize(
    ("value", "size"), [("1", 1), ("3k", 3072), ("3 KB", 3072), ("64m", 64 << 20), ("1g", 1 << 30)]
)
def test_max_bytes_per_trigger_takes_spark_byte_strings(value, size) -> None:
    options = ReaderOptions.parse({"topic": "Orders", "maxBytesPerTrigger": value}, streaming=True)
    assert options.max_bytes_per_trigger == size


@pytest.mark.parametrize("value", ["0", "lots", "-1k", "1.5m", "3 kilobytes"])
def test_a_bad_max_bytes_per_trigger_shows_examples(value) -> None:
    with pytest.raises(InvalidOptionError, match="'maxBytesPerTrigger' needs a size.*'64m'"):
        ReaderOptions.parse({"topic": "Orders", "maxBytesPerTrigger": value}, streaming=True)


def test_load_accepts_the_options_of_both_kinds_and_checks_their_values() -> None:
    """At load() Spark does not say whether the read is a batch or a stream (streaming=None)."""
    both = {"topic": "Orders", "endingOffsets": "latest", "maxMessagesPerTrigger": "5"}
    assert ReaderOptions.parse(both, streaming=None).max_messages_per_trigger == 5
    with pytest.raises(InvalidOptionError, match="'endingOffsets' is for batch reads only"):
        ReaderOptions.parse(both, streaming=True)
    assert ReaderOptions.parse(both).max_messages_per_trigger is None  # a batch: a warning
    with pytest.raises(InvalidOptionError, match="maxMessagesPerTrigger needs to be an integer"):
        ReaderOptions.parse({"topic": "Orders", "maxMessagesPerTrigger": "0"}, streaming=None)
    with pytest.raises(InvalidOptionError, match="did you mean 'failOnMissingTopic'"):
        ReaderOptions.parse({"topic": "Orders", "failOnMissingTopics": "true"}, streaming=None)
    assert ReaderOptions.parse({"topic": "O", "failOnMissingTopic": "TRUE"}).fail_on_missing_topic
