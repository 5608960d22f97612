"""A Kafka user's habits and typos in ``format("rmqtx")`` options: the error names the option
rmq-spark uses instead (no Spark needed: options are parsed before any read or write)."""

from __future__ import annotations

import pytest
from pyspark.sql.types import BinaryType, StringType, StructField, StructType

from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.spark.sink_options import WriterOptions
from rmq_spark.spark.source import ReaderOptions


@pytest.mark.parametrize(
    ("option", "value", "streaming", "hint"),
    [
        ("subscribe", "Orders", False, "Spark's Kafka option; use 'topic'"),
        ("subscribePattern", "Ord.*", True, "Spark's Kafka option; use 'topic'"),
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


def test_writer_option_names_from_kafka_and_typos() -> None:
    schema = StructType([StructField("value", BinaryType()), StructField("key", StringType())])
    with pytest.raises(InvalidOptionError, match="'kafka.bootstrap.servers'.*use 'path'"):
        WriterOptions.parse(
            {"topic": "T", "producerGroup": "g", "kafka.bootstrap.servers": "h:9092"}, schema
        )
    with pytest.raises(InvalidOptionError, match="did you mean 'producerGroup'"):
        WriterOptions.parse({"topic": "T", "producerGrop": "g"}, schema)
