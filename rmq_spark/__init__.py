"""rmq-spark: RocketMQ-style transactional messages on Spark and Delta Lake, with no broker."""

from rmq_spark._version import __version__

__all__ = ["__version__"]
