"""The store: the half topic, op topic and CommitLog as Delta tables under one root, and the
broker operations on them, as one object users and the other wings hold.

:class:`Store` is a small facade over the concepts, each kept in one module that opens with
the contract rule(s) it keeps (docs/contract.md):

* :mod:`rmq_spark.store.layout` - opening, creating and checking a store (rule 7);
* :mod:`rmq_spark.store.decisions` - half messages and the first decision that wins (rules 1, 3, 4);
* :mod:`rmq_spark.store.publishing` and :mod:`rmq_spark.store.chunks` - committed messages
  into the CommitLog, exactly once (rules 2, 4, 5);
* :mod:`rmq_spark.store.queues` - dense offsets and where each queue stands (rule 5);
* :mod:`rmq_spark.store.oplog` - which ``op`` commits are decisions the store wrote (rule 2);
* :mod:`rmq_spark.store.maintenance` - compaction, log cleanup, locks (rules 4, 9);
* :mod:`rmq_spark.store.reads` - rows by id, decisions and SQL (rule 9).

They stand on one another in that order, bottom up: reads and queues, then decisions and
publishing, then maintenance; all of them on the Delta layer (:class:`DeltaTables`), which
owns files, log entries, retries and checkpoints, and tells maintenance of each commit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable
from deltalake.table import TableMerger

from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.clock import Clock, in_utc
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.errors import StoreError, StoreVersionError
from rmq_spark.model.messages import (
    LocalTransactionState,
    Message,
    check_group,
    object_decided,
    shard_of,
    validate_message,
)
from rmq_spark.model.schema import TABLES
from rmq_spark.store import queues, reads
from rmq_spark.store.chunks import Chunks
from rmq_spark.store.context import StoreContext
from rmq_spark.store.decisions import Decision, Decisions, EndTransactionResult, PreparedMessage
from rmq_spark.store.deliveries import Deliveries
from rmq_spark.store.layout import (
    SHARDED_COMMITLOGS_LAYOUT,
    normalise_root,
    open_or_create,
    raise_layout,
    shard_uri,
)
from rmq_spark.store.maintenance import UNNEEDED_LOG_SECONDS, Maintenance
from rmq_spark.store.publishing import Publisher, PublishResult
from rmq_spark.store.recent import RecentHalves
from rmq_spark.store.shards import Shards

log = logging.getLogger(__name__)


class Store:
    """An rmq-spark store: the Delta tables under one root, and the broker operations on them.

    Open one with :meth:`Store.open`. A ``Store`` is thread-safe: every operation loads the
    table state it needs and commits through Delta's optimistic concurrency control.

    Parameters
    ----------
    root : str
        The store root URI (absolute local path or ``scheme://`` URI).
    settings : StoreSettings
        Queue count, body size limit and storage options.
    clock : callable, optional
        Returns the current UTC time for the timestamps this process writes (a naive time
        is read as UTC).
    """

    def __init__(
        self,
        root: str,
        settings: StoreSettings,
        clock: Clock | None = None,
        *,
        shard: int = 0,
        shards: Shards | None = None,
    ) -> None:
        self.root = root
        self.settings = settings
        self.clock = in_utc(clock)
        #: Which shard of its store this is (0: the root; :mod:`rmq_spark.store.shards`).
        self.shard = shard
        self._shards = shards or Shards(self, self._make_shard)
        # A store of shards has one CommitLog, the root's: every shard publishes into it.
        owner = self._shards.root
        located = {"commitlog": owner.table_uri("commitlog")} if shard else {}
        fresh = min(UNNEEDED_LOG_SECONDS, settings.log_retention) / 2
        self._tables = DeltaTables(root, TABLES, settings.storage_options, fresh, located)
        context = StoreContext(self._tables, settings, self.clock, RecentHalves(), shard)
        self._recent = context.recent
        self._decisions = Decisions(context, lambda v: raise_layout(owner._tables, version=v))
        self._deliveries = None if shard else Deliveries(context, self._send_dead_letters)
        # The root publishes every shard's COMMITs with its own, in the same commits.
        lanes = None if shard else self._other_publishers
        self._publisher = Publisher(Chunks(context), lanes)
        elsewhere = {"commitlog": owner._maintenance} if shard else {}
        self._maintenance = Maintenance(context, elsewhere)

    @classmethod
    def open(
        cls,
        path: str | Path | None = None,
        *,
        settings: Settings | StoreSettings | None = None,
        create: bool = True,
        clock: Clock | None = None,
    ) -> Store:
        """Open the store at ``path``, creating it on first use.

        Parameters
        ----------
        path : str or Path, optional
            Store root: a local path, a ``file://`` URI or an object-store URI. Defaults to
            ``store.path`` of the settings (``storage/`` in ``conf/rmq-spark.toml``).
        settings : Settings or StoreSettings, optional
            Defaults to the built-in defaults.
        create : bool, default True
            Create an empty store when the root is empty or missing, and make the shards
            ``shards`` of the settings asks for. A reader opens with False: it never changes
            the store's layout (and may have read-only credentials).
        clock : callable, optional
            Returns the current UTC time for the timestamps this process writes (the
            default is the system clock; a naive time is read as UTC).

        Raises
        ------
        NotAStoreError
            The root holds data that is not an rmq-spark store.
        StoreVersionError
            The store has a newer layout version than this rmq-spark understands.
        CorruptStoreError
            The store's marker or one of its tables is unreadable or foreign.
        """
        store_settings = settings.store if isinstance(settings, Settings) else settings
        store_settings = store_settings or StoreSettings()
        store = cls(normalise_root(str(path or store_settings.path)), store_settings, clock)
        if open_or_create(store._tables, create) == SHARDED_COMMITLOGS_LAYOUT:
            if not create:
                raise StoreVersionError(
                    f"the store at {store.root!r} has a CommitLog per shard (layout "
                    f"{SHARDED_COMMITLOGS_LAYOUT}); this rmq-spark reads one CommitLog. Stop the "
                    "store's producers of the older release, then open it once as a writer (start "
                    "a producer, or Store.open(path) in Python), which merges them."
                )
            store._shards.merge_commitlogs()
        if create and store_settings.shards > 1:
            store.grow(store_settings.shards)
        return store

    def grow(self, shards: int) -> None:
        """Make the store have at least ``shards`` shards (idempotent, safe to race, resumed
        from wherever a killed grower stopped); a store never loses one."""
        self._shards.grow(shards)

    # ------------------------------------------------------------------ shards
    def _make_shard(self, shard: int) -> Store:
        return Store(
            shard_uri(self.root, shard), self.settings, self.clock, shard=shard, shards=self._shards
        )

    def _other_publishers(self) -> list[Publisher]:
        return [s._publisher for s in self._shards.all(refresh=False)[1:]]

    @property
    def queue_base(self) -> int:
        """The first queue id of this shard: its queues are ``queue_base + 0 .. queue_nums - 1``
        (:data:`rmq_spark.model.messages.SHARD_QUEUE_STRIDE`)."""
        return self._decisions.queue_base

    def shards(self, *, refresh: bool = False) -> list[Store]:
        """Every shard of this store, by index (the root, shard 0, first; ``[self]`` for a
        store of one shard). ``refresh`` looks for shards made since the last look (one
        listing); the stores are opened once and kept."""
        return self._shards.all(refresh=refresh)

    def shard_numbers(self, *, refresh: bool = False) -> list[int]:
        """The numbers of this store's shards, 0 first, without opening them (``refresh``: as
        in :meth:`shards`)."""
        return self._shards.numbers(refresh=refresh)

    def shard_store(self, shard: int) -> Store:
        """Shard ``shard`` of this store (0: the root)."""
        return self._shards.get(shard)

    # ------------------------------------------------------------------ tables
    def table_uri(self, name: str) -> str:
        """URI of one of the store's tables (``half``, ``op``, ``commitlog``...)."""
        if name not in TABLES:
            raise StoreError(f"unknown table {name!r}; the store has {', '.join(TABLES)}.")
        return self._tables.uri(name)

    def table(self, name: str, *, latest: bool = True) -> DeltaTable:
        """One of the store's tables as a deltalake ``DeltaTable`` (this thread's snapshot,
        brought to the newest version unless ``latest`` is False)."""
        self.table_uri(name)
        return self._tables.snapshot(name, latest=latest)

    @property
    def _storage_options(self) -> dict[str, str] | None:
        return self._tables.deltalake_options

    def append(self, name: str, data: pa.Table, app_ids: Mapping[str, int] | None = None) -> int:
        """Append rows to one of the store's tables in one commit (one with no rows records
        ``app_ids`` alone); return the committed version.

        ``app_ids`` (application id to version) are recorded with the commit, which then
        fails (and is retried from the latest snapshot) if a concurrent commit recorded one of
        them. Without them an append never conflicts.
        """
        version = self._tables.append(name, [data] if data.num_rows else [], app_ids)
        assert version is not None
        return version

    def append_batches(self, name: str, rows: Iterable[pa.Table]) -> int | None:
        """Blind-append rows given batch by batch to one of the store's tables in one commit,
        holding one batch in memory at a time; return the version committed, or a later one
        (None: ``rows`` was empty). An error raised while ``rows`` is iterated commits
        nothing."""
        return self._tables.append(name, rows, always=False)

    def merge(
        self,
        name: str,
        source: pa.Table,
        on: str | Sequence[str],
        clauses: Callable[[TableMerger], TableMerger],
        commit_properties: CommitProperties | None = None,
    ) -> dict[str, Any]:
        """MERGE ``source`` (alias ``s``) into a table (alias ``t``) where the ``on`` columns
        are equal, retrying lost races (see :meth:`DeltaTables.merge`)."""
        return self._tables.merge(name, source, on, clauses, commit_properties)

    @property
    def deliveries(self) -> Deliveries:
        """The consumer groups of ``rmqtx serve``, kept on the store's root
        (:mod:`rmq_spark.store.deliveries`)."""
        if self._deliveries is None:
            raise StoreError(
                f"consumer groups are kept on the store's root, not in shard {self.shard}: use "
                "the Store opened on the root."
            )
        return self._deliveries

    # ------------------------------------------------------------------ transactions
    def prepare(
        self,
        messages: Sequence[Message],
        producer_group: str,
        *,
        transaction_ids: Sequence[str] | None = None,
        born_timestamp: datetime | None = None,
        validated: bool = False,
    ) -> list[PreparedMessage]:
        """Write half messages (durable, invisible) in one Delta commit; see
        :meth:`Decisions.prepare`."""
        return self._decisions.prepare(
            messages,
            producer_group,
            transaction_ids=transaction_ids,
            born_timestamp=born_timestamp,
            validated=validated,
        )

    def end_transactions(
        self,
        decisions: Sequence[Decision],
        *,
        publish: bool = True,
        land: bool = True,
        in_half: bool = False,
    ) -> list[EndTransactionResult]:
        """Decide transactions; the first decision recorded for a transaction wins.

        Parameters
        ----------
        decisions : sequence of Decision
            COMMIT or ROLLBACK requests. A transaction named twice in one call is decided by
            its first entry.
        publish : bool, default True
            Publish committed messages into ``commitlog`` before returning (with ``land``).
        land : bool, default True
            Record the decisions in ``op`` before returning; False leaves a decision that its
            decision object decided to :meth:`land_decisions` (see :meth:`Decisions.end`).
        in_half : bool, default False
            The caller knows these transactions' half messages are in ``half`` (see
            :meth:`Decisions.end`).

        Returns
        -------
        list of EndTransactionResult
            One per decision, in order: ``NOT_FOUND``, with nothing recorded, for a transaction
            the store holds no half message of (an id no send returned, or one retention
            removed after its decision).
        """
        by_shard: dict[int, list[int]] = {}
        for i, d in enumerate(decisions):
            by_shard.setdefault(shard_of(d.transaction_id), []).append(i)
        if set(by_shard) <= {self.shard}:
            results = self._decisions.end(decisions, land=land, in_half=in_half)
            if publish and land:
                self.publish(latest=False)
            return results
        ended: dict[int, EndTransactionResult] = {}
        for shard, indexes in by_shard.items():
            part = self.shard_store(shard).end_transactions(
                [decisions[i] for i in indexes], publish=publish, land=land, in_half=in_half
            )
            ended.update(zip(indexes, part, strict=True))
        return [ended[i] for i in range(len(decisions))]

    def land_decisions(self) -> int:
        """Record in ``op`` the decisions of this process that ``end_transactions(...,
        land=False)`` left to it, in every shard opened here; return how many COMMITs.

        A shard whose landing fails keeps its decisions for the next call (they are in force
        in their decision objects meanwhile) and holds up no other shard: the failure is
        logged, and raised once every shard was tried."""
        landed, failure = 0, None
        for shard in self._shards.opened():
            try:
                landed += shard._decisions.landing.land()
            except Exception as exc:
                log.warning("recording decisions in op of %s failed (%s)", shard.root, exc)
                failure = exc
        if failure is not None:
            raise failure
        return landed

    def land_intake(self, older_than: float, now: float | None = None) -> int:
        """Land in this store's (shard's) ``half`` the intake objects that their writers left
        unlanded and that are at least ``older_than`` seconds old at ``now`` (seconds since the
        epoch; default: the machine's clock); return how many transactions that was
        (:meth:`rmq_spark.store.intake.Intake.recover`)."""
        intake = self._decisions.intake
        return 0 if intake is None else intake.recover(older_than, now)

    def intake_waiting(self, now: float) -> tuple[int, float | None]:
        """The intake objects of this store (shard) not deleted yet, and the oldest one's age
        in seconds at ``now`` (:meth:`rmq_spark.store.intake.Intake.waiting`)."""
        intake = self._decisions.intake
        return (0, None) if intake is None else intake.waiting(now)

    def intake_covering(self, transaction_ids: Sequence[str]) -> set[str]:
        """Those of ``transaction_ids`` an intake object of this store (shard) may hold
        (:meth:`rmq_spark.store.intake.Intake.covering`)."""
        intake = self._decisions.intake
        return set() if intake is None else intake.covering(transaction_ids)

    def remove_decision_objects(self, transaction_ids: Sequence[str]) -> None:
        """Delete the decision objects of transactions of this shard that retention removed
        from ``half`` and ``op``."""
        self._decisions.remove_objects(transaction_ids)

    def object_decisions(self, transaction_ids: Sequence[str]) -> dict[str, Decision]:
        """The decisions in force of the transactions among ``transaction_ids`` that a decision
        object decided (:mod:`rmq_spark.store.arbiter`), whether ``op`` records them yet or not;
        the others are absent."""
        by_shard: dict[int, list[str]] = {}
        for t in transaction_ids:
            if object_decided(t):  # any other id (a misplaced row's too) has no object
                by_shard.setdefault(shard_of(t), []).append(t)
        found: dict[str, Decision] = {}
        for shard, ids in by_shard.items():
            store = self if shard == self.shard else self.shard_store(shard)
            found.update(store._decisions.object_decisions(ids))
        return found

    def write_decisions(self, op: DeltaTable, decisions: Sequence[Decision]) -> int:
        """Append ``decisions``, undecided in the ``op`` snapshot ``op``, in one commit that
        fails if a later one decided any of them; see :meth:`Decisions.write_decisions`."""
        return self._decisions.write_decisions(op, decisions)

    def decisions(
        self, transaction_ids: Sequence[str], *, op: DeltaTable | None = None
    ) -> dict[str, LocalTransactionState]:
        """The decisions recorded in ``op`` (default: the latest snapshot) for the given
        transactions; undecided ones are absent."""
        return reads.decisions(self._tables, transaction_ids, op=op)

    def published(self, transaction_ids: Sequence[str]) -> set[str]:
        """Which of the given transactions have messages in ``commitlog``."""
        return reads.published(self._tables, transaction_ids)

    def discarded(self, transaction_ids: Sequence[str]) -> set[str]:
        """Which of the given transactions have rows in ``discard``."""
        return reads.discarded(self._tables, transaction_ids)

    # ------------------------------------------------------------------ publishing
    def publish(
        self, normal: Sequence[tuple[Message, str]] = (), *, latest: bool = True
    ) -> PublishResult:
        """Move committed messages into ``commitlog``, and send normal messages (already
        validated, as ``(message, producer_group)``) in its last commit; see
        :meth:`Publisher.publish` (``latest=False``: up to the decisions this process has just
        made). The root of a store of shards publishes every shard's COMMITs (the shards
        known to it: :meth:`shards`); a shard, its own."""
        return self._publisher.publish(normal, latest=latest)

    def send(self, messages: Sequence[Message], producer_group: str) -> PublishResult:
        """Send normal (non-transactional) messages: visible at once, in one commit."""
        check_group(producer_group)
        for message in messages:
            validate_message(message, self.settings.max_body_bytes)
        return self.publish([(m, producer_group) for m in messages])

    def _send_dead_letters(self, messages: Sequence[Message], consumer_group: str) -> None:
        """Publish messages to a consumer group's dead-letter topic (a system topic, which
        :meth:`send` refuses)."""
        self.publish([(m, consumer_group) for m in messages], latest=False)

    def next_offsets(self, commitlog: DeltaTable | None = None) -> dict[tuple[str, int], int]:
        """The next offset of every queue that holds messages, ``{(topic, queue_id): offset}``,
        in a ``commitlog`` snapshot (default: the latest), read once per snapshot."""
        return queues.next_offsets(self._tables, commitlog)

    def earliest_stored(self, commitlog: DeltaTable | None = None) -> dict[tuple[str, int], int]:
        """The earliest offset still stored of every queue retention has trimmed (absent: 0),
        read like :meth:`next_offsets`."""
        return queues.earliest_stored(self._tables, commitlog)

    def published_op_version(self, commitlog: DeltaTable | None = None) -> int:
        """The last ``op`` version published into a ``commitlog`` snapshot (default: the
        latest); -1 when nothing was ever published."""
        return queues.published_op_version(self._tables, self.shard, commitlog)

    # ------------------------------------------------------------------ reads
    def half_messages(
        self,
        transaction_ids: Sequence[str],
        files: pa.Table | None = None,
        *,
        staged: bool = False,
    ) -> pa.Table:
        """The half messages of the given transactions (``half`` schema); ``files``: the add
        actions of the latest ``half`` snapshot (:meth:`data_files`) if read already.
        ``staged``: those of transactions ``half`` lacks are also looked for in the intake
        objects not landed yet, then in ``half`` again (landed after the first read)."""
        rows = reads.half_messages(self._tables, transaction_ids, files)
        intake = self._decisions.intake
        return rows if not staged or intake is None else intake.half_messages(transaction_ids, rows)

    def data_files(self, name: str, snapshot: DeltaTable | None = None) -> pa.Table:
        """The data files of a table's ``snapshot`` (default: the latest): Delta's add actions
        (path, size, partition values, per-column min/max) plus each file's ``uri``."""
        return self._tables.data_files(name, snapshot)

    def query(self, name: str, where: str) -> pa.Table:
        """Rows of one of the store's tables matching a SQL condition (DataFusion), in plain
        Arrow types. Quote values with :func:`rmq_spark.delta.reads.sql_string`."""
        return reads.query(self._tables, name, where)

    def read(self, name: str, columns: Sequence[str] | None = None) -> pa.Table:
        """One of the store's tables whole (or some of its columns), in plain Arrow types."""
        return reads.read(self._tables, name, columns)

    def sql(
        self,
        name: str,
        statement: str,
        *,
        version: int | None = None,
        table: DeltaTable | None = None,
    ) -> pa.Table:
        """Run a SQL ``statement`` (DataFusion) over one of the store's tables, registered
        under its name, in plain Arrow types: the latest snapshot, ``version``, or the
        snapshot ``table`` (a caller that commits on it next)."""
        return self._tables.sql(name, statement, version=version, table=table)

    # ------------------------------------------------------------------ maintenance
    def compact(self, *names: str) -> dict[str, int]:
        """Rewrite the small files of the store's tables (default: all) into larger ones,
        changing no data; return the files removed per table compacted. Runs automatically
        after each checkpoint of a table (every ``delta.checkpointInterval`` commits)."""
        return self._maintenance.compact(*names)

    def clean_log(self, name: str) -> int:
        """Delete the Delta log entries of an internal table that a checkpoint covers and that
        no reader needs any more; return how many files went."""
        return self._maintenance.clean_log(name)

    def lock(self, name: str, holder: str, seconds: float) -> bool:
        """Take (or, with ``seconds`` 0, release) the lock ``name`` for ``holder``: granted
        when free, expired, or ``holder``'s already; exactly one of racing takers gets it."""
        return self._maintenance.locks.take(name, holder, seconds)

    def lock_holder(self, name: str) -> str | None:
        """Who holds the lock ``name`` (None: nobody, or the lock expired)."""
        return self._maintenance.locks.holder(name)

    def maintain_in_background(self) -> None:
        """Write checkpoints, compact and clean tables after their commits on background
        threads of this process from now on, so that no commit waits for them (a producer's
        sends: one send in 100 would wait some 20 ms for a checkpoint, then 50 to 100 ms for
        the compaction after it). Checkpoints have a thread of their own: a compaction that
        takes long must not hold them back (a stalled checkpoint holds back the maintenance
        that follows it). Idempotent; :meth:`finish_maintenance` waits for what is asked."""
        self._tables.chores.in_background()

    def finish_maintenance(self) -> None:
        """Wait until the background checkpoints, compactions and log cleanups asked for so
        far are done (a no-op without :meth:`maintain_in_background`)."""
        self._tables.chores.wait()
