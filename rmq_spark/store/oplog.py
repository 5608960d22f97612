"""What the ``op`` log says: which commits are decisions the store wrote, and which COMMITs
they hold.

Rule 2 (committed exactly once) against other Delta writers: only decisions the store itself
wrote are published. A decision commit names its COMMITs in its ``commitInfo``
(:data:`COMMITS_KEY`); a commit of another writer (a RESTORE re-adding files a compaction
replaced, which the change feed reports as inserts; a DELETE; an append) is logged and never
applied, and its time is handed to the publisher, which then checks that transactions decided
again after it are not in the CommitLog already.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from deltalake import DeltaTable

from rmq_spark.delta.reads import conform, read_arrow
from rmq_spark.delta.tables import DeltaTables

log = logging.getLogger(__name__)

#: ``commitInfo`` key of a decision commit of ``op``: the transactions it COMMITs, in order
#: (JSON). The publisher reads them from the log: the data files an append added can be
#: compacted away and vacuumed before a lagging publisher reads them.
COMMITS_KEY = "rmqtx.commits"

#: ``op.decided_by`` of a COMMIT recorded again for a transaction that is published but whose
#: decision another Delta writer removed from ``op`` (a RESTORE or DELETE): check-back records
#: it instead of asking the checker, and the publisher never publishes it.
DECIDED_BY_RECOVERY = "check-back:recovered"

#: How far a host's clock, which stamps the transaction ids it makes, may run ahead of the
#: foreign writer's (:data:`rmq_spark.store.queues.FOREIGN_OP_APP_ID`).
_CLOCK_SKEW_MILLIS = 10 * 60 * 1000

#: What :func:`commits_in` returns: COMMITted transactions and their ``op`` version.
_COMMITTED = pa.schema([("transaction_id", pa.string()), ("_commit_version", pa.int64())])

#: Operations on ``op`` that change no decision: compactions, the table's creation, vacuums
#: and changes of its properties or protocol.
_NO_DATA_CHANGE = frozenset(
    {
        "OPTIMIZE",
        "CREATE TABLE",
        "VACUUM START",
        "VACUUM END",
        "SET TBLPROPERTIES",
        "UNSET TBLPROPERTIES",
        "UPGRADE PROTOCOL",
        "ADD FEATURE",
        "ADD CONSTRAINT",
        "DROP CONSTRAINT",
        "ADD COLUMNS",
        "CHANGE COLUMN",
        "REORG",
        "CHECKPOINT",
    }
)

#: The MERGE condition of decisions written by an older rmq-spark, and of retention's deletes.
_DECISION_MERGE = "t.transaction_id = s.transaction_id"


def commits_in(tables: DeltaTables, first: int, last: int) -> tuple[pa.Table, int]:
    """``(transaction_id, _commit_version)`` of the COMMITs recorded in ``op`` versions
    first..last, in decision order, and the commit time (ms) of the newest commit of
    another Delta writer among them (0 if none).

    Decision commits name their COMMITs in their ``commitInfo`` (:data:`COMMITS_KEY`), read
    from the log; the change feed is read only for decisions of an older rmq-spark (written
    by MERGE, :func:`_legacy_decisions`), or for the whole range when its log entries are
    gone: only then is a snapshot of ``op`` loaded (bringing it up to date reads each entry
    since its version twice, a GET each on S3). Only decisions the
    store wrote are published: a commit of another Delta writer (a RESTORE re-adding files a
    compaction replaced, which the change feed reports as inserts; a DELETE; an append) is
    logged and not applied.
    """

    def changed(start: int, end: int) -> pa.Table:  # on a snapshot that holds ``end``
        op = tables.snapshot("op", latest=False)
        return _changed_commits(op if op.version() >= end else tables.snapshot("op"), start, end)

    try:
        infos = tables.commit_infos("op", first, last)
    except LookupError:
        return changed(first, last), 0
    parts, foreign = [_COMMITTED.empty_table()], 0
    for version, info in infos.items():
        if COMMITS_KEY in info:
            ids = json.loads(info[COMMITS_KEY])
            parts.append(pa.table([ids, [version] * len(ids)], schema=_COMMITTED))
        elif _legacy_decisions(info):
            parts.append(changed(version, version))
        elif foreign_change(info):
            log.error(
                "op version %d was not written by rmq-spark (%s by %s): its rows are not "
                "published. Decisions it removed leave their transactions pending again "
                "(check-back records those already published as committed again, and asks "
                "about the others); undo it with RESTORE TABLE ... TO VERSION AS OF %d "
                "(see docs/guarantees.md)",
                version,
                info.get("operation", "an unnamed operation"),
                info.get("engineInfo", "an unknown engine"),
                version - 1,
            )
            made = int(info.get("timestamp") or time.time() * 1000)
            foreign = max(foreign, made + _CLOCK_SKEW_MILLIS)
    return pa.concat_tables(parts), foreign


def _changed_commits(op: DeltaTable, first: int, last: int) -> pa.Table:
    """``(transaction_id, _commit_version)`` of the COMMITs inserted into ``op`` versions
    first..last, read from its change data feed, in decision order."""
    changes = read_arrow(op.load_cdf(starting_version=first, ending_version=last))
    changes = changes.filter(
        pc.and_(
            pc.equal(changes.column("_change_type"), "insert"),
            pc.equal(changes.column("decision"), "COMMIT"),
            pc.not_equal(changes.column("decided_by"), DECIDED_BY_RECOVERY),
        )
    )
    ordered = changes.sort_by([("_commit_version", "ascending")])
    return conform(ordered, _COMMITTED)


def _merge_by_transaction(info: Mapping[str, Any]) -> bool:
    """Whether an ``op`` commit is deltalake's MERGE on ``transaction_id``, as rmq-spark writes
    them: decisions of an older version, and retention's deletes."""
    parameters = info.get("operationParameters") or {}
    return (
        info.get("operation") == "MERGE"
        and str(info.get("engineInfo", info.get("clientVersion", ""))).startswith("delta-rs")
        and parameters.get("mergePredicate") == _DECISION_MERGE
    )


def _legacy_decisions(info: Mapping[str, Any]) -> bool:
    """Whether an ``op`` commit without :data:`COMMITS_KEY` holds decisions of an older
    rmq-spark: a MERGE on ``transaction_id`` that inserted rows."""
    metrics = info.get("operationMetrics") or {}
    return _merge_by_transaction(info) and metrics.get("num_target_rows_inserted") != 0


def foreign_change(info: Mapping[str, Any]) -> bool:
    """Whether an ``op`` commit without :data:`COMMITS_KEY` is another writer's change of its
    rows (not a compaction, vacuum or property change, nor rmq-spark's own retention)."""
    return not (
        info.get("operation") in _NO_DATA_CHANGE
        or "rmqtx.operation" in info
        or _merge_by_transaction(info)
    )
