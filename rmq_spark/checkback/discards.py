"""Discards and re-drive: transactions rolled back at the check max, and putting them back.

Keeps docs/contract.md, rule 6: a transaction still UNKNOWN after
``transaction_check_max`` checks is rolled back and its messages are recorded in the
``discard`` table (RocketMQ's ``TRANS_CHECK_MAX_TIME_TOPIC``). Keeps rule 4: nothing is lost,
a check-max rollback whose discard write a crash cut off is found again (see
:func:`repair_discards`), and :func:`redrive` puts discarded messages back into the cycle.
Keeps rule 2: each message is re-driven exactly once, however many re-drives run at once and
wherever one dies (claim with a conditional MERGE, then stage with an insert-if-absent MERGE).
Keeps rule 9: the repair reads the ``op`` rows inserted since the op version recorded in
``discard``, so its cost follows the new decisions, not the history.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from datetime import datetime

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, Transaction
from deltalake.exceptions import DeltaError

from rmq_spark.checkback.pending import inserted_since
from rmq_spark.delta.reads import sql_string
from rmq_spark.model.errors import InvalidOptionError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import shard_transaction_id
from rmq_spark.model.schema import DISCARD_SCHEMA, HALF_MESSAGE_SCHEMA, HALF_SCHEMA
from rmq_spark.store.facade import Store
from rmq_spark.store.fanout import on_every_shard

log = logging.getLogger(__name__)

#: ``op.decided_by`` of transactions rolled back for reaching the check max.
DECIDED_BY_CHECK_MAX = "check-back:check-max"
#: Application id under which ``discard`` records the ``op`` version up to which every
#: check-max rollback has its discard rows.
DISCARD_CURSOR_APP_ID = "rmqtx.discard.op_version"
#: The property of a re-driven half message that names the discarded transaction.
REDRIVEN_FROM = "REDRIVEN_FROM_TRANSACTION_ID"
#: Op versions a discard repair may lag behind before it records how far it has looked.
_DISCARD_CURSOR_LAG = 20


def repair_discards(store: Store, check_max: int, clock: Callable[[], datetime]) -> None:
    """Record check-max rollbacks whose discard write was cut off by a crash.

    Reads the ``op`` rows inserted since the op version recorded in ``discard`` (an
    application transaction, recorded with the repairs, or when it lags
    ``_DISCARD_CURSOR_LAG`` op versions behind), so the cost follows the new decisions.
    """
    discard = store.table("discard")
    cursor = discard.transaction_version(DISCARD_CURSOR_APP_ID)
    op = store.table("op")
    version = op.version()
    if cursor is not None and cursor >= version:
        return
    maxed = _check_max_rollbacks(store, op, cursor)
    missing = sorted(set(maxed) - store.discarded(maxed))
    if missing or cursor is None or version - cursor >= _DISCARD_CURSOR_LAG:
        insert_discards(store, missing, clock(), check_max, op_version=version)


def _check_max_rollbacks(store: Store, op: DeltaTable, cursor: int | None) -> list[str]:
    """Transactions rolled back at the check max in ``op`` versions after ``cursor``."""
    if cursor is not None:
        try:
            return [
                r["transaction_id"]
                for r in inserted_since(op, cursor, ["transaction_id", "decided_by"]).to_pylist()
                if r["decided_by"] == DECIDED_BY_CHECK_MAX
            ]
        except (DeltaError, OSError, pa.ArrowException) as exc:
            log.warning("op change feed unreadable (%s); scanning op for check-max rollbacks", exc)
    maxed = store.query("op", f"decided_by = '{DECIDED_BY_CHECK_MAX}'")
    return maxed.column("transaction_id").to_pylist()


def insert_discards(
    store: Store,
    transaction_ids: list[str],
    now: datetime,
    check_max: int,
    *,
    op_version: int | None = None,
) -> None:
    """Record the discards of ``transaction_ids``, rolled back after ``check_max`` checks;
    with ``op_version``, in the same commit record that every check-max rollback up to that
    ``op`` version has its discard rows."""
    cursor = None if op_version is None else {DISCARD_CURSOR_APP_ID: op_version}
    if not transaction_ids:
        if cursor is not None:
            store.append("discard", DISCARD_SCHEMA.empty_table(), cursor)
        return
    half = store.half_messages(transaction_ids)
    n = half.num_rows
    rows = pa.Table.from_arrays(
        [half.column(c) for c in HALF_MESSAGE_SCHEMA.names]
        + [
            pa.array([check_max] * n, pa.int32()),
            pa.array([now] * n, DISCARD_SCHEMA.field("discarded_timestamp").type),
            pa.nulls(n, pa.string()),
        ],
        schema=DISCARD_SCHEMA,
    )
    # A re-driven message keeps its msg_id: each discarded transaction has its own row.
    store.merge(
        "discard",
        rows,
        ["transaction_id", "msg_id"],
        lambda m: m.when_not_matched_insert_all(),
        None
        if cursor is None
        else CommitProperties(app_transactions=[Transaction(*c) for c in cursor.items()]),
    )
    log.warning(
        "discarded %d message(s) after %d unanswered checks; inspect the discard "
        "table and re-drive with 'rmqtx resume'",
        n,
        check_max,
    )


def redrive(store: Store, transaction_ids: Sequence[str] | None = None) -> list[str]:
    """Put discarded messages back into the check-back cycle, in every shard of the store.

    Each discarded message is prepared again as a half message of a new transaction of its
    own shard (same ``msg_id``, property ``REDRIVEN_FROM_TRANSACTION_ID``), with a fresh check
    budget.

    Parameters
    ----------
    store : Store
        The store.
    transaction_ids : sequence of str, optional
        The discarded transactions to re-drive; all not yet re-driven when omitted.

    Returns
    -------
    list of str
        The new transaction ids this call claimed or staged.

    Raises
    ------
    InvalidOptionError
        One of ``transaction_ids`` is not in the discard table of its shard, or was re-driven
        already (nothing is re-driven then).
    ShardsFailedError
        With several shards, the re-drive failed on some of them (the others were done).

    Notes
    -----
    Each message is re-driven exactly once, however many re-drives run at once and wherever
    one dies. First each discard row is *claimed*: a conditional MERGE sets its
    ``redriven_transaction_id`` only where it is still null, so of two racing re-drives one
    claims it (Delta refuses the other's commit, whose retry finds it claimed). Then every
    claimed row whose new half message is missing is *staged*, by a MERGE into ``half`` that
    inserts only when that (transaction, message) is absent: a re-drive that died between the
    two steps is finished by the next one, and two re-drives finishing the same row insert it
    once.
    """
    shards = store.shards(refresh=True)
    todo = {s.shard: _discards_to_redrive(s, transaction_ids) for s in shards}
    if transaction_ids is not None:
        found = {r["transaction_id"] for rows, _ in todo.values() for r in rows}
        found |= {t for _, unstaged in todo.values() for t in unstaged}
        unknown = set(transaction_ids) - found
        if unknown:
            raise InvalidOptionError(
                f"not in the discard table (or already re-driven): {', '.join(sorted(unknown))}"
            )
    return on_every_shard(
        shards,
        "re-drive of discards",
        lambda shard: _redrive_shard(shard, todo[shard.shard][0]),
        lambda results, _: sorted(t for new_ids in results.values() for t in new_ids),
    )


def _discards_to_redrive(
    store: Store, transaction_ids: Sequence[str] | None
) -> tuple[list[dict[str, object]], set[str]]:
    """One shard's discard rows not re-driven yet, of ``transaction_ids`` (default: all), and
    which of ``transaction_ids`` are claimed but not staged (a re-drive died in between)."""
    discard = store.read("discard")
    rows = [r for r in discard.to_pylist() if r["redriven_transaction_id"] is None]
    if transaction_ids is None:
        return rows, set()
    wanted = set(transaction_ids)
    unstaged = {r["transaction_id"] for r in _claimed_unstaged(store, discard)}
    return [r for r in rows if r["transaction_id"] in wanted], unstaged & wanted


def _redrive_shard(store: Store, rows: list[dict[str, object]]) -> list[str]:
    """Claim ``rows`` (discard rows of this shard), then stage every claimed, unstaged row.

    A discarded transaction in the CommitLog (its ROLLBACK removed by another Delta writer and
    a late COMMIT published before its discard rows were written) is not re-driven: its rows
    are marked as re-driven as itself, so its message stays published once."""
    published = store.published(sorted({str(r["transaction_id"]) for r in rows}))
    if published:
        log.error(
            "%d discarded transaction(s), e.g. %s, are published already (another Delta "
            "writer removed their check-max ROLLBACK from op and a late COMMIT won): not "
            "re-driven, marked as re-driven as themselves (see docs/guarantees.md)",
            len(published),
            min(published),
        )
        _claim_discards(store, [r for r in rows if r["transaction_id"] in published], str)
        rows = [r for r in rows if r["transaction_id"] not in published]
    earlier = _redriven_before(store, rows)
    if earlier:
        log.error(
            "%d discarded transaction(s), e.g. %s, were re-driven before (their message is in "
            "half or published under the new id) but their discard rows say not: another Delta "
            "writer changed discard (a RESTORE or DELETE). Not re-driven twice; marked as "
            "re-driven by those ids again (see docs/guarantees.md)",
            len(earlier),
            min(earlier),
        )
        _claim_discards(store, [r for r in rows if r["transaction_id"] in earlier], earlier.get)
        rows = [r for r in rows if r["transaction_id"] not in earlier]
    claimed = _claim_discards(store, rows, lambda _: shard_transaction_id(store.shard))
    failpoint("redrive.claimed")
    staged = _stage_redriven(store, _claimed_unstaged(store, store.read("discard")))
    if claimed or staged:
        log.info(
            "re-drove discarded messages into the check-back cycle: claimed %d, staged %d",
            len(claimed),
            len(staged),
        )
    return sorted(claimed | staged)


def _redriven_before(store: Store, rows: list[dict[str, object]]) -> dict[str, str]:
    """The transactions of ``rows`` (unclaimed discard rows) whose message an earlier re-drive
    staged all the same, in ``half`` or in the CommitLog (the same ``msg_id`` and topic, with
    ``REDRIVEN_FROM_TRANSACTION_ID``): the id it was re-driven as, by discarded transaction.
    Looked up by message id, so the cost follows the discards, not the tables' history."""
    if not rows:
        return {}
    wanted = {(str(r["transaction_id"]), str(r["msg_id"])) for r in rows}
    topics = ", ".join(sql_string(t) for t in sorted({str(r["topic"]) for r in rows}))
    msg_ids = ", ".join(sql_string(m) for _, m in sorted(wanted, key=lambda k: k[1]))
    earlier: dict[str, str] = {}
    for table in ("half", "commitlog"):
        found = store.query(table, f"topic IN ({topics}) AND msg_id IN ({msg_ids})")
        for row in found.select(["transaction_id", "msg_id", "properties"]).to_pylist():
            source = dict(row["properties"] or ()).get(REDRIVEN_FROM)
            if (source, row["msg_id"]) in wanted:
                earlier[source] = row["transaction_id"]
    return earlier


def _claim_discards(
    store: Store, rows: list[dict[str, object]], new_id: Callable[[str], str]
) -> set[str]:
    """Give each discarded transaction of ``rows`` the transaction id ``new_id`` makes of its
    own, in the discard rows whose ``redriven_transaction_id`` is still null; return the new
    ids this call set."""
    if not rows:
        return set()
    new_ids = {r["transaction_id"]: new_id(str(r["transaction_id"])) for r in rows}
    marks = pa.table(
        {
            "transaction_id": pa.array([r["transaction_id"] for r in rows], pa.string()),
            "msg_id": pa.array([r["msg_id"] for r in rows], pa.string()),
            "redriven_transaction_id": pa.array(
                [new_ids[r["transaction_id"]] for r in rows], pa.string()
            ),
        }
    )
    metrics = store.merge(
        "discard",
        marks,
        ["transaction_id", "msg_id"],
        lambda m: m.when_matched_update(
            {"redriven_transaction_id": "s.redriven_transaction_id"},
            predicate="t.redriven_transaction_id IS NULL",
        ),
    )
    log.info(
        "claimed %d discarded message(s) for re-driving", metrics.get("num_target_rows_updated")
    )
    claimed = store.read("discard", ["redriven_transaction_id"])
    return set(new_ids.values()) & set(claimed.column(0).to_pylist())


def _claimed_unstaged(store: Store, discard: pa.Table) -> list[dict[str, object]]:
    """Discard rows claimed for re-driving whose new transaction is neither in ``half``,
    decided nor published (a re-drive died before staging them; published, its rows may be
    gone from half and op: retention removed them while another writer's change of discard
    hid the claim, see :func:`_redriven_before`)."""
    claimed = [r for r in discard.to_pylist() if r["redriven_transaction_id"] is not None]
    if not claimed:
        return []
    new_ids = sorted({r["redriven_transaction_id"] for r in claimed})
    half = store.half_messages(new_ids).select(["transaction_id", "msg_id"]).to_pylist()
    staged = {(h["transaction_id"], h["msg_id"]) for h in half}
    decided = store.decisions(new_ids)
    unstaged = [
        r
        for r in claimed
        if (r["redriven_transaction_id"], r["msg_id"]) not in staged
        and r["redriven_transaction_id"] not in decided
    ]
    if not unstaged:
        return []
    published = store.published(sorted({r["redriven_transaction_id"] for r in unstaged}))
    return [r for r in unstaged if r["redriven_transaction_id"] not in published]


def _stage_redriven(store: Store, rows: list[dict[str, object]]) -> set[str]:
    """Insert the half messages of claimed discard rows, each only if absent from ``half``;
    return their new transaction ids, or none if a concurrent re-drive inserted them all."""
    if not rows:
        return set()
    now = store.clock()
    half = pa.Table.from_pylist(
        [
            {
                # Discard keeps no writer columns: a re-driven message is its group's own.
                **{c: r.get(c) for c in HALF_SCHEMA.names},
                "transaction_id": r["redriven_transaction_id"],
                "properties": list(dict(r["properties"] or ()).items())
                + [(REDRIVEN_FROM, r["transaction_id"])],
                "store_timestamp": now,
            }
            for r in rows
        ],
        schema=HALF_SCHEMA,
    )
    metrics = store.merge(
        "half", half, ["transaction_id", "msg_id"], lambda m: m.when_not_matched_insert_all()
    )
    if not metrics.get("num_target_rows_inserted"):
        return set()  # a concurrent re-drive staged them first
    return set(half.column("transaction_id").to_pylist())
