"""Typed errors raised by rmq-spark.

Every error carries a stable ``error_class`` (for scripts and tests) and a message that names
the problem, echoes the bad value and says how to fix it, because messages raised inside Spark
tasks reach the user wrapped by Spark and must make sense on their own.
"""

from __future__ import annotations


class RmqSparkError(Exception):
    """Root of all rmq-spark errors.

    Parameters
    ----------
    message : str
        Human-readable explanation, including how to fix the problem.
    """

    error_class = "RMQ_SPARK_ERROR"

    def __init__(self, message: str) -> None:
        super().__init__(f"[{self.error_class}] {message}")
        self.message = message


class InvalidMessageError(RmqSparkError, ValueError):
    """A message breaks a RocketMQ rule (topic name, system topic, body size, properties...)."""

    error_class = "INVALID_MESSAGE"


class InvalidOptionError(RmqSparkError, ValueError):
    """An option or configuration value is unknown, missing or malformed."""

    error_class = "INVALID_OPTION"


class StoreError(RmqSparkError):
    """The store root cannot be used (not an rmq-spark store, newer layout, corrupt table)."""

    error_class = "STORE_ERROR"


class NotAStoreError(StoreError):
    """The root exists and holds data, but it is not an rmq-spark store."""

    error_class = "NOT_AN_RMQ_SPARK_STORE"


class StorageConfigError(StoreError):
    """The store's object storage, or its storage options, cannot keep the contract (no
    conditional writes, a missing filesystem package)."""

    error_class = "UNSAFE_STORAGE"


class StoreVersionError(StoreError):
    """The store was written by a newer rmq-spark with a layout this version cannot read."""

    error_class = "UNSUPPORTED_STORE_LAYOUT"


class CorruptStoreError(StoreError):
    """A table of the store is missing, unreadable or has a foreign schema."""

    error_class = "CORRUPT_STORE"


class ProducerStateError(RmqSparkError, RuntimeError):
    """The producer is used before ``start()`` or after ``shutdown()``."""

    error_class = "PRODUCER_STATE"


class EpochLostError(RmqSparkError, RuntimeError):
    """A transactional writer's epoch cannot publish what it staged: it was abandoned (its
    lease ran out) or belongs to another writer. The write fails so that it is retried."""

    error_class = "EPOCH_LOST"


class DataLossError(RmqSparkError):
    """A read starts below the earliest offset still stored: retention removed the messages
    in between (Spark's Kafka source fails the same way unless ``failOnDataLoss`` is false)."""

    error_class = "DATA_LOSS"
