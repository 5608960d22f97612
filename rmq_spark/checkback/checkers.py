"""Checkers: how the check-back job learns what became of a pending transaction.

A checker serves one producer group and turns a DataFrame of pending transactions (the check
batch, one representative message per transaction) into a DataFrame of answers with columns
``transaction_id``, ``state`` (COMMIT / ROLLBACK / UNKNOWN) and ``error``. Checkers run as
Spark jobs: the callable checker in parallel on executors over Arrow batches, the table
checker as a join.

Configure them in ``conf/rmq-spark.toml``::

    [checkers.order-service]
    kind = "callable"
    function = "my_service.checks:check_order"   # takes a MessageExt, returns a state

    [checkers.payments]
    kind = "table"
    table = "s3://lake/payments"                 # a Delta table
    column = "payment_id"                        # a message key found here means COMMIT
    deadline = "1h"                              # absent after this long means ROLLBACK

    [checkers.Orders]
    kind = "clients"                             # RocketMQ 5 clients of rmqtx serve

or pass them to :class:`rmq_spark.checkback.job.CheckBackJob` directly.
"""

from __future__ import annotations

import importlib
import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Mapping
from dataclasses import fields
from typing import Any

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from rmq_spark.model.config import parse_duration
from rmq_spark.model.errors import RmqSparkError
from rmq_spark.model.messages import LocalTransactionState, MessageExt, check_group

log = logging.getLogger(__name__)

#: Columns of a checker's answer.
ANSWER_SCHEMA = "transaction_id string, state string, error string"
_ANSWER_ARROW = pa.schema(
    [("transaction_id", pa.string()), ("state", pa.string()), ("error", pa.string())]
)


class CheckerConfigError(RmqSparkError):
    """A checker is misconfigured (unknown kind, module or function, missing table...)."""

    error_class = "CHECKER_CONFIG"


class Checker(ABC):
    """Decides pending transactions of one producer group."""

    #: Short name shown in logs and summaries.
    kind = "checker"

    def validate(self, spark: SparkSession) -> None:  # noqa: B027 - optional hook
        """Fail fast at job start if the checker cannot work (raise CheckerConfigError)."""

    @abstractmethod
    def check(self, batch: DataFrame) -> DataFrame:
        """Answer for every transaction of ``batch``.

        Parameters
        ----------
        batch : DataFrame
            The check batch rows of this checker's producer group: the columns of the
            ``half`` table plus ``age_seconds`` and ``check_count``.

        Returns
        -------
        DataFrame
            ``transaction_id``, ``state`` and ``error``, one row per transaction.
        """


def resolve_function(spec: str) -> Callable[[MessageExt], Any]:
    """Import ``"package.module:function"``; raise CheckerConfigError naming what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise CheckerConfigError(
            f"checker function {spec!r} is not of the form 'package.module:function'."
        )
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise CheckerConfigError(
            f"checker module {module_name!r} (from {spec!r}) cannot be imported: {exc}. "
            "Install it where Spark's executors run, or fix the name."
        ) from exc
    except Exception as exc:  # the module's own code failed as it was imported
        raise CheckerConfigError(
            f"checker module {module_name!r} (from {spec!r}) raised {type(exc).__name__} as it "
            f"was imported: {exc}. Fix the module (run 'python -c \"import {module_name}\"' "
            "to see the traceback)."
        ) from exc
    target: Any = module
    for part in attr.split("."):
        target = getattr(target, part, None)
        if target is None:
            raise CheckerConfigError(
                f"checker function {attr!r} not found in module {module_name!r} (from {spec!r})."
            )
    if not callable(target):
        raise CheckerConfigError(f"checker {spec!r} is not callable.")
    return target


class CallableChecker(Checker):
    """Calls a Python function per pending transaction, in parallel on Spark's executors.

    Parameters
    ----------
    function : callable or str
        ``f(msg: MessageExt) -> LocalTransactionState``, or its ``"module:function"`` name
        (imported on the executors). A ``TransactionListener``'s ``check_local_transaction``
        works as it is. Raising, or answering anything but COMMIT/ROLLBACK, is UNKNOWN.
    """

    kind = "callable"

    def __init__(self, function: Callable[[MessageExt], Any] | str) -> None:
        self.function = function

    def validate(self, spark: SparkSession) -> None:
        if isinstance(self.function, str):
            resolve_function(self.function)
        elif not callable(self.function):
            raise CheckerConfigError(f"checker {self.function!r} is not callable.")

    def check(self, batch: DataFrame) -> DataFrame:
        function = self.function

        def answer(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
            fn = resolve_function(function) if isinstance(function, str) else function
            for record_batch in batches:
                ids, states, errors = [], [], []
                for row in record_batch.to_pylist():
                    state, error = _ask(fn, _message_of(row))
                    ids.append(row["transaction_id"])
                    states.append(state.value)
                    errors.append(error)
                yield pa.RecordBatch.from_arrays(
                    [pa.array(ids, pa.string()), pa.array(states), pa.array(errors, pa.string())],
                    schema=_ANSWER_ARROW,
                )

        return batch.select(*_MESSAGE_COLUMNS).mapInArrow(answer, ANSWER_SCHEMA)


class TableChecker(Checker):
    """COMMIT when one of the message's keys is in a column of a Delta table.

    A missing key means UNKNOWN (the business write may still land) until the transaction
    has been pending for ``deadline`` seconds on the check-back job's clock, then ROLLBACK.

    Parameters
    ----------
    table : str
        Path or URI of the business Delta table.
    column : str
        The column holding business keys (the producer's ``Message.keys``).
    deadline : float
        Seconds after which an absent key means ROLLBACK.
    """

    kind = "table"

    def __init__(self, table: str, column: str, deadline: float) -> None:
        self.table, self.column, self.deadline = table, column, deadline

    def validate(self, spark: SparkSession) -> None:
        try:
            columns = spark.read.format("delta").load(self.table).columns
        except Exception as exc:
            raise CheckerConfigError(
                f"table checker: cannot read Delta table {self.table!r}: {str(exc).splitlines()[0]}"
            ) from exc
        if self.column not in columns:
            raise CheckerConfigError(
                f"table checker: column {self.column!r} not in {self.table!r} "
                f"(columns: {', '.join(columns)})."
            )

    def check(self, batch: DataFrame) -> DataFrame:
        spark = batch.sparkSession
        business = (
            spark.read.format("delta")
            .load(self.table)
            .select(F.col(self.column).cast("string").alias("_key"))
            .distinct()
        )
        keys = batch.select(
            "transaction_id",
            "age_seconds",
            F.explode_outer(F.split(F.coalesce("keys", F.lit("")), " ")).alias("_key"),
        )
        found = keys.join(business, "_key", "left_semi").select("transaction_id").distinct()
        return (
            batch.select("transaction_id", "age_seconds")
            .join(found.withColumn("_found", F.lit(True)), "transaction_id", "left")
            .select(
                "transaction_id",
                F.when(F.col("_found"), "COMMIT")
                .when(F.col("age_seconds") >= self.deadline, "ROLLBACK")
                .otherwise("UNKNOWN")
                .alias("state"),
                F.lit(None).cast("string").alias("error"),
            )
        )


# --------------------------------------------------------------------------- helpers
#: The check batch columns a checker function sees, as MessageExt fields (a pending message
#: has no queue offset yet).
_MESSAGE_COLUMNS = tuple(f.name for f in fields(MessageExt) if f.name != "queue_offset")


def _message_of(row: Mapping[str, Any]) -> MessageExt:
    return MessageExt(
        topic=row["topic"],
        queue_id=row["queue_id"],
        msg_id=row["msg_id"],
        transaction_id=row["transaction_id"],
        producer_group=row["producer_group"],
        keys=row["keys"],
        tags=row["tags"],
        body=row["body"],
        properties=dict(row["properties"] or ()),
        born_timestamp=row["born_timestamp"],
        store_timestamp=row["store_timestamp"],
    )


def _ask(
    fn: Callable[[MessageExt], Any], msg: MessageExt
) -> tuple[LocalTransactionState, str | None]:
    """Call a checker function; an exception is UNKNOWN with its text kept as the error."""
    try:
        return LocalTransactionState.coerce(fn(msg)), None
    except Exception as exc:  # a checker that throws counts as UNKNOWN (RocketMQ)
        return LocalTransactionState.UNKNOWN, f"{type(exc).__name__}: {exc}"[:500]


class ClientsChecker(Checker):
    """The group's own RocketMQ 5 clients, connected to ``rmqtx serve``, answer for it.

    The server asks them over their telemetry streams (``RecoverOrphanedTransactionCommand``)
    and records their answers as decisions; this job only counts the checks: each round's
    answer here is UNKNOWN, so a transaction no client answers (none connected, as RocketMQ
    asks again later) is rolled back and discarded at the check max, as for every group.
    """

    kind = "clients"

    def check(self, batch: DataFrame) -> DataFrame:
        return batch.select(
            "transaction_id",
            F.lit(LocalTransactionState.UNKNOWN.value).alias("state"),
            F.lit(None).cast("string").alias("error"),
        )


_KINDS = {"callable": ("function",), "table": ("table", "column", "deadline"), "clients": ()}


def checkers_from_config(config: Mapping[str, Mapping[str, Any]]) -> dict[str, Checker]:
    """Build checkers from the ``[checkers.<producer group>]`` sections of the settings.

    Raises
    ------
    CheckerConfigError
        For an invalid group name, unknown kind, or missing/unknown keys.
    """
    checkers: dict[str, Checker] = {}
    for group, section in config.items():
        try:
            check_group(group)
        except RmqSparkError as exc:
            raise CheckerConfigError(f"[checkers.{group}]: {exc.message}") from exc
        kind = section.get("kind")
        if kind not in _KINDS:
            raise CheckerConfigError(
                f"[checkers.{group}] kind = {kind!r}; valid kinds: {', '.join(_KINDS)}."
            )
        wanted = set(_KINDS[kind]) | {"kind"}
        optional = {"deadline"}
        missing = sorted(wanted - set(section) - optional)
        unknown = sorted(set(section) - wanted)
        if missing or unknown:
            raise CheckerConfigError(
                f"[checkers.{group}] (kind {kind!r}) "
                + (f"misses {', '.join(missing)}" if missing else "")
                + ("; " if missing and unknown else "")
                + (f"has unknown key(s) {', '.join(unknown)}" if unknown else "")
                + f"; it takes {', '.join(sorted(wanted))}."
            )
        if kind == "callable":
            checkers[group] = CallableChecker(str(section["function"]))
        elif kind == "clients":
            checkers[group] = ClientsChecker()
        else:
            checkers[group] = TableChecker(
                str(section["table"]),
                str(section["column"]),
                parse_duration(section.get("deadline", "1h"), f"checkers.{group}.deadline"),
            )
    return checkers
