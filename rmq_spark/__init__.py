"""rmq-spark: RocketMQ-style transactional messages on Spark and Delta Lake, with no broker.

The public API at a glance:

* :class:`Store` - the half topic, op topic and CommitLog as Delta tables under one root.
* :class:`TransactionMQProducer` and :class:`TransactionListener` - the producer API.
* :class:`Message`, :class:`MessageExt`, :class:`LocalTransactionState` - the message model.
* :func:`get_spark` - a local SparkSession with Delta Lake configured.
* :func:`register` - registers ``format("rmqtx")``, the batch source of committed messages.
"""

from rmq_spark._version import __version__
from rmq_spark.model.config import Settings, load_settings
from rmq_spark.model.errors import (
    CorruptStoreError,
    DataLossError,
    EpochLostError,
    InvalidMessageError,
    InvalidOptionError,
    NotAStoreError,
    ProducerStateError,
    RmqSparkError,
    StorageConfigError,
    StoreError,
    StoreVersionError,
)
from rmq_spark.model.messages import LocalTransactionState, Message, MessageExt
from rmq_spark.producer import (
    SendResult,
    SendStatus,
    TransactionListener,
    TransactionMQProducer,
    TransactionSendResult,
)
from rmq_spark.spark.session import get_spark
from rmq_spark.spark.sink import publish_with_delta_write
from rmq_spark.spark.source import register
from rmq_spark.store.decisions import Decision, EndTransactionResult, EndTransactionStatus
from rmq_spark.store.facade import Store
from rmq_spark.store.publishing import PublishResult

__all__ = [
    "publish_with_delta_write",
    "CorruptStoreError",
    "DataLossError",
    "Decision",
    "EndTransactionResult",
    "EndTransactionStatus",
    "EpochLostError",
    "InvalidMessageError",
    "InvalidOptionError",
    "LocalTransactionState",
    "Message",
    "MessageExt",
    "NotAStoreError",
    "ProducerStateError",
    "PublishResult",
    "RmqSparkError",
    "SendResult",
    "SendStatus",
    "Settings",
    "Store",
    "StorageConfigError",
    "StoreError",
    "StoreVersionError",
    "TransactionListener",
    "TransactionMQProducer",
    "TransactionSendResult",
    "__version__",
    "get_spark",
    "load_settings",
    "register",
]
