"""Keeping a store small and fast as it ages: compaction, log cleanup and the locks they take.

* **Nothing is lost** (rule 4). Compaction changes no data (``dataChange=false``) and never
  drops a committed message; compactions of one table take turns through a lock in ``locks``
  (deltalake would let two concurrent ones both commit, storing every row twice). Work asked
  for after a commit has landed never turns that commit into an error: a caller told "failed"
  would retry it and duplicate what it wrote.
* **Cost follows the work** (rule 9). Every table is compacted once a checkpoint interval
  (:data:`rmq_spark.model.schema.CHECKPOINT_INTERVAL` commits), right after the checkpoint, by
  size tiers (each row is rewritten a few times, not once an interval until its file is
  full), and the log entries of internal tables that no reader needs are deleted, so that no
  operation slows down with the store's age. Right after the checkpoint, bringing the maintenance's
  snapshot up to date reads the checkpoint (a few ranged GETs on an object store), not the
  interval's log entries (deltalake reads each twice: two GETs a commit on S3).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from datetime import timedelta

from deltalake.exceptions import CommitFailedError

from rmq_spark.delta.compaction import compact as compact_table
from rmq_spark.delta.txnlog import clean_log
from rmq_spark.model.errors import StoreError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import new_id
from rmq_spark.model.schema import TABLES
from rmq_spark.store.context import StoreConcept, StoreContext
from rmq_spark.store.group_state import trim as trim_deliveries
from rmq_spark.store.locks import Locks
from rmq_spark.store.queues import published_op_version
from rmq_spark.store.reads import COPY_KEYS, NEWEST

log = logging.getLogger(__name__)

#: Application ids under which ``pending`` records the ``half`` and ``op`` versions it covers.
PENDING_HALF_APP_ID = "rmqtx.pending.half_version"

PENDING_OP_APP_ID = "rmqtx.pending.op_version"

#: Log entries of an internal table that no reader's cursor needs are kept this long (seconds,
#: or the ``log_retention`` if shorter), for the operations under way: a commit's conflict
#: check reads the commits after its snapshot.
UNNEEDED_LOG_SECONDS = 10.0

#: How long a compaction holds its table's lock at most (a killed compactor's lock expires).
_COMPACTION_LOCK_SECONDS = 600.0


class Maintenance(StoreConcept):
    """Compaction and log cleanup of one store's tables, and their locks (:attr:`locks`).

    Once made, it asks for a compaction and log cleanup of a table after each of its
    checkpoints (a listener of the Delta layer's checkpoint intervals), run as the Delta layer
    runs chores: on the committing thread, or in the background.
    """

    def __init__(
        self, context: StoreContext, elsewhere: Mapping[str, Maintenance] | None = None
    ) -> None:
        super().__init__(context)
        #: Tables of another store (a shard's CommitLog is its store's), compacted by that
        #: store's maintenance, under its lock: two compactions at once store rows twice.
        self.elsewhere = dict(elsewhere or {})
        self.locks = Locks(context)
        self.tables.on_checkpoint(self._after_checkpoint)

    def _after_checkpoint(self, name: str) -> None:
        """Compact and clean the log once a checkpoint interval."""
        self.tables.chores.soon("maintain", name, lambda: self._maintain(name))

    def _maintain(self, name: str) -> None:
        """Compact a table and clean its log. Never raises: the commit that asked has landed,
        and a caller told it failed would retry it and duplicate what it wrote."""
        failpoint("store.maintain")
        try:
            self.compact(name, tiered=True)
            if name != "commitlog":
                self.clean_log(name)
        except Exception:
            log.warning(
                "compaction or log cleanup of %s failed (the commits themselves landed); a "
                "later commit will ask again",
                name,
                exc_info=True,
            )

    def compact(self, *names: str, tiered: bool = False) -> dict[str, int]:
        """Rewrite the small files of the store's tables into larger ones.

        Runs automatically after each checkpoint of a table. Compaction
        changes no data (``dataChange=false``): consumers, including Delta's own streaming
        source, see nothing. Compactions of one table take turns through a lock in ``locks``
        (deltalake would let two concurrent ones both commit, storing every row twice); a
        table being compacted elsewhere is skipped. A compaction racing a writer that rewrites
        the same files loses to it (Delta's conflict check), which is not an error.

        Parameters
        ----------
        *names : str
            Tables to compact (default: all).
        tiered : bool
            Rewrite only the small files that grow a row's file by half at least (what runs
            after checkpoints: each row is rewritten a few times, not once an interval); by
            default, every file smaller than the target.

        Returns
        -------
        dict
            Files removed per table compacted.
        """
        removed = {}
        # The lock table is not compacted: each take rewrites it as one file (store.locks).
        for name in [n for n in names or TABLES if n != "locks"]:
            if name in self.elsewhere:
                removed.update(self.elsewhere[name].compact(name, tiered=tiered))
                continue
            holder = new_id()
            if not self.locks.take(f"compact:{name}", holder, _COMPACTION_LOCK_SECONDS):
                log.debug("%s is being compacted by another process; skipped", name)
                continue
            try:
                if name == "deliveries":
                    metrics = trim_deliveries(self.tables, self.clock())
                else:
                    metrics = compact_table(
                        self.tables,
                        name,
                        COPY_KEYS.get(name, ()),
                        NEWEST.get(name, ()),
                        tiered,
                        # The CommitLog's VACUUM keeps files as long as retention says, whose
                        # log keeps the removals longer than its checkpoints (30 days).
                        written_down=name != "commitlog",
                    )
            except CommitFailedError as exc:
                log.debug("compaction of %s lost a race (%s); the next one will do it", name, exc)
                continue
            finally:
                self.locks.take(f"compact:{name}", holder, 0.0)
            removed[name] = int(metrics.get("numFilesRemoved", 0))
            if metrics.get("numCopiesRemoved"):
                log.warning(
                    "the compaction of %s kept %d row(s) once that another Delta writer's "
                    "compaction had stored twice (it landed beside rmq-spark's on the same "
                    "files); leave compacting the store's tables to rmq-spark",
                    name,
                    metrics["numCopiesRemoved"],
                )
            log.debug("compacted %s: %s", name, metrics)
        return removed

    def clean_log(self, name: str) -> int:
        """Delete the Delta log entries of an internal table that a checkpoint covers and that
        no reader needs any more; return how many files went.

        Runs after each checkpoint of a table. On a local filesystem
        every commit and snapshot update lists the whole log (about 8.5 us an entry), so a log
        that only grew would make every operation slower with the store's age (rule 9), and
        one kept for minutes of a busy store's commits makes sends several times slower.
        Entries go once they are:

        * older than ``UNNEEDED_LOG_SECONDS`` (or the ``log_retention`` if shorter), for the
          operations under way, and not after a reader's cursor, unless a long operation on
          the table holds its lock (a maintenance run, a compaction): its commit checks the
          commits after its snapshot;
        * or older than ``log_retention`` and not after the publisher's cursor: the pending
          list (:mod:`rmq_spark.checkback.pending`) of a check-back job that lags that much
          rebuilds from a full scan, while the ``op`` entries the publisher has yet to read are
          kept whatever their age (they name the COMMITs to publish).

        The CommitLog is not cleaned here: readers stream it with Delta's own source, so its
        log follows the table's ``delta.logRetentionDuration``.
        """
        if name == "commitlog":
            raise StoreError("the CommitLog's log follows its own delta.logRetentionDuration.")
        kept = latest = self.tables.snapshot(name).version()
        if name == "op":
            kept = min(latest, published_op_version(self.tables, self.shard) + 1)
        now = self.clock()
        rules = [(kept, now - timedelta(seconds=self.settings.log_retention))]
        if not self.locks.held("maintain", f"compact:{name}"):
            lagging = self._pending_cursors().get(name) if name in ("half", "op") else None
            if lagging is not None:
                kept = min(kept, lagging + 1)
            rules.append(
                (
                    kept,
                    now - timedelta(seconds=min(UNNEEDED_LOG_SECONDS, self.settings.log_retention)),
                )
            )
        deleted = clean_log(self.tables.uri(name), self.tables.storage_options, rules)
        if deleted:
            log.debug("deleted %d log entries of %s", deleted, name)
        return deleted

    def _pending_cursors(self) -> dict[str, int]:
        """The ``half`` and ``op`` versions the pending list covers (none before its first
        update)."""
        cursors = self.tables.app_transactions("pending")
        by_table = {"half": PENDING_HALF_APP_ID, "op": PENDING_OP_APP_ID}
        return {name: cursors[app] for name, app in by_table.items() if app in cursors}
