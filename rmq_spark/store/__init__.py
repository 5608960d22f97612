"""The store: the broker semantics (prepare, decide, publish, offsets, maintenance) over the
Delta layer. :class:`Store` is the facade users and the other wings hold; each concept lives
in a module of its own (see :mod:`rmq_spark.store.facade`)."""

from rmq_spark.store.decisions import (
    Decision,
    EndTransactionResult,
    EndTransactionStatus,
    PreparedMessage,
)
from rmq_spark.store.facade import Store
from rmq_spark.store.publishing import PublishResult

__all__ = [
    "Decision",
    "EndTransactionResult",
    "EndTransactionStatus",
    "PreparedMessage",
    "PublishResult",
    "Store",
]
