"""The Delta layer's one door: the store's tables under one root, and how rows get into them.

The store's concepts say what they want ("append these rows to ``half``", "commit these files
on this snapshot unless another writer recorded one of these application ids", "MERGE this");
this class owns how: per-thread snapshots, data files, the log entry (written directly by
:mod:`rmq_spark.delta.commit` where the table allows it, else by deltalake), retries of lost
races (:mod:`rmq_spark.delta.retry`), checkpoints at the table's interval, and the chores a
commit asks for, run on the committing thread or in the background (:mod:`rmq_spark.delta.chores`).

Rule 4 (nothing is lost) is kept here for every write: a call returns only after its commit
landed, a commit that lost a race is retried from the new state, and work done after a commit
has landed (a checkpoint, a listener's chore) never turns it into an error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

import pyarrow as pa
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction
from deltalake.exceptions import CommitFailedError
from deltalake.table import TableMerger
from deltalake.transaction import AddAction

from rmq_spark.delta.checkpoints import Checkpointer
from rmq_spark.delta.chores import ChoreKinds
from rmq_spark.delta.commit import appendable, checkpoint_interval
from rmq_spark.delta.commit import commit as commit_direct
from rmq_spark.delta.files import WrittenFiles, commit_files, write_files, write_in_parallel
from rmq_spark.delta.reads import read_arrow, with_uris
from rmq_spark.delta.retry import refused_if_cleaned, relisting, retry_commits
from rmq_spark.delta.storage import check_conditional_put, deltalake_options, filesystem
from rmq_spark.delta.txnlog import app_transactions, commit_infos, follow, hint_version
from rmq_spark.model.clock import elapsed

log = logging.getLogger(__name__)

#: A table's schema, partition columns and table properties.
TableSpec = tuple[pa.Schema, list[str], dict[str, str]]
#: The kinds of chores a commit asks for (see :class:`ChoreKinds`).
_CHORES = ("checkpoint", "maintain")
#: The most ``commitInfo`` actions :meth:`DeltaTables.latest_version` keeps per table and thread.
_MAX_KEPT_INFOS = 4096
#: How many checks of the ``_last_checkpoint`` hint (one every ``fresh_seconds``) a thread
#: following a table's log makes before it loads the snapshot again anyway: a hint that lags a
#: newer checkpoint (its writer died between the two) hides a cleanup under it from the check.
RELOAD_CHECKS = 12


@dataclass(frozen=True)
class Head:
    """A table as a writer last found it: its latest ``version`` and application transactions
    ``txns``, when that was found (``time.monotonic()``, before looking), and a snapshot (at or
    before ``version``) for its metadata, with the application transactions as of it
    (``snapshot_txns``): an application id whose version differs between the two was
    recorded by a commit after the snapshot (each commit recording one has seen every commit
    before it that recorded it, so its version only grows)."""

    snapshot: DeltaTable
    version: int
    txns: Mapping[str, int]
    found: float
    snapshot_txns: Mapping[str, int]
    #: ``version`` is this thread's own commit, put at the first version it tried: no other
    #: writer was seen, and the next commit goes on without reading the log first.
    calm: bool = False
    #: :func:`rmq_spark.model.clock.elapsed` once ``snapshot`` was loaded: nothing that came to
    #: exist after it (a transaction id made since) is in the snapshot.
    loaded: float = 0.0


class DeltaTables:
    """The Delta tables under ``root`` named by ``specs``, and every write to them.

    Thread-safe: each thread keeps its own snapshots (deltalake's are not thread-safe),
    refreshed incrementally instead of replaying the log on every operation.

    Parameters
    ----------
    root : str
        The root URI; table ``name`` is ``root/name``.
    specs : mapping
        Table name to :data:`TableSpec`.
    storage_options : mapping
        The store's storage options (fsspec names; see :mod:`rmq_spark.delta.storage`).
    fresh_seconds : float
        How long a snapshot or head may be used without a look at the log: half of the time
        after which log entries no reader needs may be cleaned.
    located : mapping, optional
        Tables that live elsewhere, by name: their URIs (a shard's CommitLog is its store's).
    """

    def __init__(
        self,
        root: str,
        specs: Mapping[str, TableSpec],
        storage_options: Mapping[str, str],
        fresh_seconds: float,
        located: Mapping[str, str] | None = None,
    ) -> None:
        self.root = root
        self.located = dict(located or {})
        self.specs = specs
        self.storage_options = storage_options
        self.fresh_seconds = fresh_seconds
        self._snapshots = threading.local()
        self._refreshed = threading.local()
        self._heads = threading.local()
        self._followed = threading.local()
        self._infos = threading.local()
        #: The newest version of each table this process committed: where a blind append
        #: starts looking for a free version when its cached snapshot is older.
        self._known: dict[str, int] = {}
        self._lock = threading.Lock()
        #: Per table: (snapshot version, checkpoint interval or None): direct_interval.
        self._writers: dict[str, tuple[int, int | None]] = {}
        #: Checkpoints and maintenance that commits ask for (see ChoreKinds).
        self.chores = ChoreKinds(root, _CHORES)
        self._checkpointer = Checkpointer(storage_options)
        #: The small data files this process wrote, for its compactions (see WrittenFiles).
        self.written = WrittenFiles()
        self._listeners: list[Callable[[str], None]] = []

    # ------------------------------------------------------------------ tables
    @property
    def deltalake_options(self) -> dict[str, str] | None:
        """The storage options as deltalake takes them."""
        return deltalake_options(self.storage_options)

    def uri(self, name: str) -> str:
        """The URI of table ``name``."""
        return self.located.get(name) or f"{self.root.rstrip('/')}/{name}"

    def snapshot(self, name: str, *, latest: bool = True) -> DeltaTable:
        """This thread's snapshot of a table, brought to the newest version (``latest``), or
        kept as it is while younger than :attr:`fresh_seconds` (enough for a blind append:
        the log entries after an older one may have been cleaned, and deltalake refuses to
        commit on it)."""
        cache, refreshed = self._snapshots.__dict__, self._refreshed.__dict__
        table = cache.get(name)
        now = time.monotonic()
        if table is None:
            uri = self.uri(name)
            table = cache[name] = relisting(
                lambda: DeltaTable(uri, storage_options=self.deltalake_options)
            )
        elif latest or now - refreshed[name] > self.fresh_seconds:
            relisting(table.update_incremental)
        else:
            return table
        refreshed[name] = now
        return table

    def latest_version(self, name: str) -> int:
        """A table's latest version, for a thread that looks at it often without committing to
        it (the publisher, at every shard's ``op``): the log entries after the version this
        thread found last are read (one request when there is none, :func:`follow`), and their
        ``commitInfo`` kept for :meth:`commit_infos`.

        Following is sound while no entry after that version can have been cleaned. An entry
        is cleaned only below a checkpoint, so every :attr:`fresh_seconds` the
        ``_last_checkpoint`` hint is read (one request): one naming a version after the one
        found has the snapshot brought up to date (deltalake starts from that checkpoint); so
        does every :data:`RELOAD_CHECKS`-th check (a hint can lag its checkpoint). An entry
        missing after a cleanup under a stalled thread delays what follows it by no more. A
        snapshot update instead of the check read every entry since the last again, twice
        (two GETs an entry on S3, a transaction's largest background cost).
        """
        now = time.monotonic()
        # (version, when the hint was last checked, checks since the snapshot was updated)
        found = self._followed.__dict__.get(name)
        infos = self._infos.__dict__.setdefault(name, {})
        if len(infos) > _MAX_KEPT_INFOS:
            infos.clear()  # nobody asked for them: another publisher published those versions
        uri, own = self._own(name)
        if found is not None and now - found[1] >= self.fresh_seconds:
            checks = found[2] + 1  # by time too: a thread that looks seldom checks seldom
            fresh = self.fresh_seconds
            checks = max(checks, int((now - found[1]) / fresh) if fresh else RELOAD_CHECKS)
            behind = checks >= RELOAD_CHECKS or self._hint(uri) > found[0]
            found = None if behind else (found[0], now, checks)
        if found is not None:
            followed = follow(uri, self.storage_options, found[0], {}, infos, own)
            if followed is not None:
                self._followed.__dict__[name] = (followed[0], *found[1:])
                return followed[0]
        version = self.snapshot(name).version()
        self._followed.__dict__[name] = (version, now, 0)
        return version

    def _hint(self, uri: str) -> int:
        """The version a table's ``_last_checkpoint`` names (-1: none)."""
        return hint_version(*filesystem(f"{uri.rstrip('/')}/_delta_log", self.storage_options))

    def commit_infos(self, name: str, first: int, last: int) -> dict[int, dict]:
        """The ``commitInfo`` of each commit ``first..last`` of a table
        (:func:`rmq_spark.delta.txnlog.commit_infos`), without reading again those
        :meth:`latest_version` read on this thread; those before ``first`` are forgotten."""
        kept = self._infos.__dict__.get(name, {})
        for version in [v for v in kept if v < first]:
            del kept[version]
        if all(v in kept for v in range(first, last + 1)):
            return {v: kept[v] for v in range(first, last + 1)}
        uri, own = self._own(name)
        return commit_infos(uri, self.storage_options, first, last, own)

    def known_version(self, name: str) -> int:
        """The newest version of a table this thread's snapshot holds or this process
        committed, without a look at the log unless the snapshot is older than
        :attr:`fresh_seconds`."""
        with self._lock:
            known = self._known.get(name, -1)
        return max(self.snapshot(name, latest=False).version(), known)

    def at_version(self, name: str, version: int) -> DeltaTable:
        """A table as of ``version``."""
        return DeltaTable(self.uri(name), version=version, storage_options=self.deltalake_options)

    def create(self, name: str) -> None:
        """Create table ``name`` by its spec, unless it exists (another process creating it at
        the same moment wins: its version 0 is the same table)."""
        schema, partition_by, properties = self.specs[name]
        try:
            DeltaTable.create(
                self.uri(name),
                schema=schema,
                mode="ignore",
                partition_by=partition_by or None,
                name=f"rmqtx_{name}",
                configuration=properties,
                storage_options=self.deltalake_options,
            )
        except CommitFailedError:
            if not DeltaTable.is_deltatable(self.uri(name), self.deltalake_options):
                raise

    def app_transactions(self, name: str, snapshot: DeltaTable | None = None) -> Mapping[str, int]:
        """The application transactions (``txn`` actions) of a snapshot (default: the latest)."""
        snapshot = snapshot or self.snapshot(name)
        uri, own = self._own(name)
        return app_transactions(snapshot, uri, self.storage_options, own)

    def _own(self, name: str) -> tuple[str, dict[int, bytes]]:
        """A table's URI and the log entries this process put to it that readers of the log
        here take from memory (:meth:`Checkpointer.entries`)."""
        uri = self.uri(name)
        return uri, self._checkpointer.entries(uri)

    def head(self, name: str, *, reload: bool) -> Head:
        """A table's latest version and application transactions, for a writer that commits
        to it on every call (a publisher).

        Its snapshot update would list the table's whole log each time on a local filesystem.
        So, while the version this thread found last is younger than :attr:`fresh_seconds`
        (the entries after it are still there, but for a commit's reachability check nothing
        counts on that), the entries after it are read instead
        (:func:`follow`), or none at all while the head is :attr:`Head.calm` (this thread's
        own commit found no other writer: a commit on it checks the entries it finds taken, so
        one that another writer made since only costs a retry). A table change among them,
        ``reload`` (a retry), an older head, or a table that deltalake commits to (it needs the
        latest snapshot) loads the snapshot.
        """
        now = time.monotonic()
        head: Head | None = getattr(self._heads, name, None)
        if not reload and head is not None and now - head.found < self.fresh_seconds:
            if head.calm:
                return head
            uri, own = self._own(name)
            followed = follow(uri, self.storage_options, head.version, head.txns, own=own)
            if followed is not None:
                head = replace(head, version=followed[0], txns=followed[1], found=now)
                setattr(self._heads, name, head)
                return head
        snapshot = self.snapshot(name)
        loaded = elapsed()
        txns = self.app_transactions(name, snapshot)
        head = Head(snapshot, snapshot.version(), txns, now, txns, loaded=loaded)
        direct = self.direct_interval(name, snapshot) is not None
        setattr(self._heads, name, head if direct else None)
        return head

    def data_files(self, name: str, snapshot: DeltaTable | None = None) -> pa.Table:
        """The data files of a snapshot (default: the latest): Delta's add actions (path, size,
        partition values, per-column min/max) plus each file's ``uri``."""
        return with_uris(snapshot or self.snapshot(name), self.uri(name))

    def sql(
        self,
        name: str,
        statement: str,
        *,
        version: int | None = None,
        table: DeltaTable | None = None,
    ) -> pa.Table:
        """Run a SQL ``statement`` (DataFusion) over a table registered under its name, in
        plain Arrow types: the latest snapshot, ``version`` or the snapshot ``table``."""
        if table is None:
            table = self.snapshot(name) if version is None else self.at_version(name, version)
        return read_arrow(QueryBuilder().register(name, table).execute(statement))

    # ------------------------------------------------------------------ writes
    def on_checkpoint(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(table)`` once per checkpoint interval of a table's commits (its
        ``delta.checkpointInterval``, :data:`rmq_spark.model.schema.CHECKPOINT_INTERVAL`):
        after the checkpoint of a commit this process made at a multiple of the interval, on
        the thread that wrote it, written or failed; for a table deltalake commits to, after
        the commit whose post-commit hook wrote one (:meth:`_interval_reached`). It must not
        raise."""
        self._listeners.append(listener)

    def _interval_reached(self, name: str, version: int, snapshot: DeltaTable) -> None:
        """Tell the listeners of a commit that deltalake made if its post-commit hook wrote a
        checkpoint: deltalake does when the version after it is at the interval (version 99
        of 100), where a direct commit asks for one at the interval (version 100)."""
        if (version + 1) % checkpoint_interval(snapshot) == 0:
            for listener in self._listeners:
                listener(name)

    def _checkpoint_then_tell(self, name: str, version: int) -> None:
        """Write the checkpoint of ``version`` of a table this process committed directly,
        then tell the listeners (a failed checkpoint leaves the work to the next interval's;
        the maintenance it is followed by is done all the same)."""
        _checkpoint(self._checkpointer, self.uri(name), version)
        for listener in self._listeners:
            listener(name)

    def write(
        self, name: str, rows: Iterable[pa.Table], *, data_change: bool = True
    ) -> list[AddAction]:
        """Write ``rows`` as new data files of a table, invisible until committed.

        Before this process first writes to the root through its endpoint, an object store
        that ignores conditional writes is refused (:func:`check_conditional_put`, probed once
        per process, root and options)."""
        check_conditional_put(self.root, self.storage_options)
        schema, partitions, _ = self.specs[name]
        partition = partitions[0] if partitions else None
        return write_files(
            self.uri(name),
            iter(rows),
            schema,
            partition,
            self.storage_options,
            data_change=data_change,
            kept=self.written if data_change else None,
        )

    def write_stream(self, name: str, rows: Iterator[pa.Table]) -> list[AddAction]:
        """Write a stream of rows (too large to hold) as data files, on several threads."""
        check_conditional_put(self.root, self.storage_options)
        schema, partitions, _ = self.specs[name]
        partition = partitions[0] if partitions else None
        return write_in_parallel(self.uri(name), rows, schema, partition, self.storage_options)

    def append(
        self,
        name: str,
        rows: Iterable[pa.Table],
        app_ids: Mapping[str, int] | None = None,
        *,
        always: bool = True,
    ) -> int | None:
        """Write ``rows`` as new files of a table and commit them (nothing when there are
        none, unless ``always``), retrying lost races; return the version committed (None:
        nothing to commit).

        ``app_ids`` (application id to version) are recorded with the commit, which then
        fails (and is retried from the latest snapshot) if a concurrent commit recorded one of
        them. Without them an append never conflicts. A retried commit adds the same files
        again, which Delta reconciles by path: one that landed although it reported a failure
        stores nothing twice.
        """
        files = self.write(name, rows)
        if not files and not always:
            return None

        def attempt(n: int) -> int:
            if name in self._writers and self._writers[name][1] is None:  # deltalake commits
                return self.commit(name, files, self.snapshot(name, latest=n > 0), app_ids)
            # The head, not a snapshot refreshed every fresh_seconds (a listing and a replay
            # of the log's newest entries on the sender's path, up to hundreds of ms on S3).
            head = self.head(name, reload=n > 0)
            return self.commit(name, files, head.snapshot, app_ids, after=head.version)

        return retry_commits(f"append to {name}", name, attempt)

    def commit(
        self,
        name: str,
        files: list[AddAction],
        snapshot: DeltaTable,
        app_ids: Mapping[str, int] | None = None,
        info: Mapping[str, str] | None = None,
        after: int | None = None,
        removes: Sequence[Mapping[str, object]] = (),
        exclusive: bool = False,
    ) -> int:
        """One attempt (for :func:`retry_commits`) at committing written data files as an
        append to a table on ``snapshot`` (or, with ``removes``, a compaction of a table
        appended to directly; ``exclusive``, a rewrite of it as of ``after`` that any later
        commit conflicts with); return the committed version.

        The log entry is written directly (:mod:`rmq_spark.delta.commit`, about 1 ms) unless
        the table needs more of a writer than that (then deltalake commits it). Without
        ``app_ids`` the commit may go after versions this process committed since
        ``snapshot`` (an append does not depend on what it read); with them, conflicts are
        checked from ``snapshot`` on, or from ``after``: a later version the caller read the
        log up to (:meth:`head`), with no change of the table since ``snapshot``. A commit
        right after this thread's head moves the head to it (the next :meth:`head` reads on
        from there).
        """
        started = time.monotonic()
        interval = self.direct_interval(name, snapshot)
        head: Head | None = getattr(self._heads, name, None)
        if interval is None:
            partitions = self.specs[name][1]
            properties = CommitProperties(
                app_transactions=[Transaction(a, v) for a, v in (app_ids or {}).items()],
                custom_metadata=dict(info or {}),
            )
            with refused_if_cleaned(snapshot):
                commit_files(snapshot, files, partitions[0] if partitions else None, properties)
            version = snapshot.version()
            self._interval_reached(name, version, snapshot)
        else:
            after = snapshot.version() if after is None else after
            with self._lock:
                if not app_ids and not removes and not exclusive:
                    after = max(after, self._known.get(name, after))
            version = commit_direct(
                self.uri(name),
                self.storage_options,
                after,
                files,
                app_ids=app_ids,
                info=info,
                removes=removes,
                landed=partial(self._checkpointer.committed, self.uri(name)),
                exclusive=exclusive,
            )
            with self._lock:
                self._known[name] = max(version, self._known.get(name, version))
            if head is not None and head.version == version - 1 and not removes:
                txns = {**head.txns, **(app_ids or {})}
                calm = version == after + 1
                head = replace(head, version=version, txns=txns, found=started, calm=calm)
                setattr(self._heads, name, head)
            elif head is not None and head.calm:
                setattr(self._heads, name, replace(head, calm=False))  # another writer came
            if version % interval == 0:
                self.chores.soon(
                    "checkpoint", name, lambda: self._checkpoint_then_tell(name, version)
                )
        return version

    def merge(
        self,
        name: str,
        source: pa.Table,
        on: str | Sequence[str],
        clauses: Callable[[TableMerger], TableMerger],
        commit_properties: CommitProperties | None = None,
    ) -> dict[str, Any]:
        """MERGE ``source`` (alias ``s``) into a table (alias ``t``) where the ``on`` columns
        are equal; return deltalake's metrics.

        ``clauses`` adds the WHEN clauses to deltalake's ``TableMerger``. A commit lost to a
        concurrent writer is retried from the new snapshot, so conditions in the clauses are
        evaluated against what is really there. ``commit_properties`` go with the commit (for
        example application transactions recorded with it).
        """
        keys = [on] if isinstance(on, str) else list(on)
        check_conditional_put(self.root, self.storage_options)

        def attempt(_: int) -> tuple[dict[str, Any], DeltaTable, int]:
            table = self.snapshot(name)
            before = table.version()
            with refused_if_cleaned(table):
                merger = table.merge(
                    source,
                    predicate=" AND ".join(f"t.{k} = s.{k}" for k in keys),
                    source_alias="s",
                    target_alias="t",
                    commit_properties=commit_properties,
                )
                return clauses(merger).execute(), table, before

        metrics, table, before = retry_commits(f"MERGE into {name}", name, attempt)
        if table.version() != before:  # a MERGE that changes nothing commits nothing
            self._interval_reached(name, table.version(), table)
        return metrics

    def direct_interval(self, name: str, snapshot: DeltaTable) -> int | None:
        """The checkpoint interval of a table that :func:`commit_direct` appends to, None when
        deltalake commits its appends (:func:`appendable`); known per snapshot version."""
        version = snapshot.version()
        cached = self._writers.get(name)
        if cached is None or cached[0] != version:
            interval = checkpoint_interval(snapshot) if appendable(snapshot) else None
            cached = self._writers[name] = (version, interval)
        return cached[1]


def _checkpoint(checkpointer: Checkpointer, uri: str, version: int) -> None:
    """Write the checkpoint of the table at ``uri`` at ``version``
    (:meth:`Checkpointer.checkpoint`). Never raises: the commit has landed, and the next
    interval writes one."""
    try:
        relisting(lambda: checkpointer.checkpoint(uri, version))
    except Exception:
        log.warning(
            "checkpoint of %s at version %d failed (the commit itself landed); the next "
            "interval writes one",
            uri,
            version,
            exc_info=True,
        )
