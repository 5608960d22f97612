"""Check-back: the job that resolves pending transactions (RocketMQ's check-back loop as a
Spark job), its checkers (per producer group) and the pending list it works from.

The names a user needs are here: ``from rmq_spark.checkback import CheckBackJob, TableChecker``.
"""

from rmq_spark.checkback.checkers import CallableChecker, Checker, TableChecker
from rmq_spark.checkback.discards import DECIDED_BY_CHECK_MAX, redrive
from rmq_spark.checkback.job import CheckBackJob
from rmq_spark.checkback.summary import CheckBackResult, CheckBackSummary

__all__ = [
    "DECIDED_BY_CHECK_MAX",
    "CallableChecker",
    "CheckBackJob",
    "CheckBackResult",
    "CheckBackSummary",
    "Checker",
    "TableChecker",
    "redrive",
]
