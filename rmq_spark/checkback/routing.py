"""Routing: ask each producer group's checker about its due transactions.

Keeps docs/contract.md, rule 6: checks are routed by producer group (messages staged by
transactional writers go to the built-in epoch checker), and a checker that raises, or whose
configuration is broken (a module that cannot be imported, a table that cannot be read),
answers UNKNOWN for its own group only: the other groups are checked as usual
(apache/rocketmq#9500).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

import pyarrow as pa
import pyarrow.compute as pc
from pyspark.sql import SparkSession

from rmq_spark.checkback.batch import CHECK, as_dataframe
from rmq_spark.checkback.checkers import Checker, CheckerConfigError
from rmq_spark.model.messages import LocalTransactionState

log = logging.getLogger(__name__)

ANSWERS_ARROW = pa.schema(
    [("transaction_id", pa.string()), ("answer", pa.string()), ("error", pa.string())]
)


def misconfigured(spark: SparkSession, checkers: Mapping[str, Checker]) -> dict[str, str]:
    """``{group: what is wrong}`` for the checkers whose configuration is broken (a module
    that cannot be imported, a table that cannot be read), each logged as an error."""
    broken = {}
    for group, checker in checkers.items():
        try:
            checker.validate(spark)
        except Exception as exc:  # a module raising at import is a broken checker too
            detail = exc.message if isinstance(exc, CheckerConfigError) else repr(exc)
            broken[group] = f"producer group {group!r}: {detail}"
            log.error(
                "%s; its transactions count as UNKNOWN this round, the other groups are "
                "checked as usual",
                broken[group],
            )
    return broken


def ask(
    spark: SparkSession,
    checker: Checker,
    group: str,
    epoch_message: bool,
    batch: pa.Table,
    ids: pa.ChunkedArray,
    broken: str | None = None,
) -> pa.Table:
    """``checker``'s answers (``ANSWERS_ARROW``) for ``group``'s due transactions ``ids`` in
    the check ``batch``; UNKNOWN for all of them, with the error, if it raises or is
    ``broken``."""
    log.info("asking the %s checker of %r about %d transaction(s)", checker.kind, group, len(ids))
    mine = pc.and_(
        pc.and_(
            pc.equal(batch.column("reason"), CHECK),
            pc.equal(batch.column("producer_group"), group),
        ),
        pc.equal(batch.column("epoch_message"), epoch_message),
    )
    try:
        if broken is not None:
            raise CheckerConfigError(broken)
        answer = checker.check(as_dataframe(spark, batch.filter(mine))).toArrow()
    except Exception as exc:
        log.error(
            "checker of producer group %r failed: %s; its transactions count as UNKNOWN this run",
            group,
            str(exc).splitlines()[0],
        )
        error = f"checker failed: {type(exc).__name__}: {exc}"[:500]
        answer = pa.table(
            {
                "transaction_id": ids,
                "state": [LocalTransactionState.UNKNOWN.value] * len(ids),
                "error": [error] * len(ids),
            }
        )
    return answer.rename_columns(ANSWERS_ARROW.names).cast(ANSWERS_ARROW)


def with_answers(batch: pa.Table, answers: pa.Table) -> pa.Table:
    """The check ``batch`` with each transaction's checker ``answer`` and ``error`` (null when
    it was not asked)."""
    at = pc.index_in(
        batch.column("transaction_id"), value_set=answers.column("transaction_id").combine_chunks()
    )
    for name in ("answer", "error"):
        batch = batch.append_column(ANSWERS_ARROW.field(name), answers.column(name).take(at))
    return batch
