"""The store: half topic, op topic and CommitLog as Delta tables under one root, and the
broker semantics over them (prepare, end-transaction, publish, normal send).

How the contract (DESIGN.md section 3) is kept:

* **Invisible until committed.** Half messages live only in ``half``; consumers read only
  ``commitlog``, which holds committed messages and nothing else.
* **First decision wins.** ``op`` has one row per decided transaction. A decision is an append
  made on the snapshot in which the transaction was read as undecided, and it records a Delta
  application transaction for the bucket of each transaction id it decides
  (:func:`decision_app_id`). Two deciders racing on the same transaction set the same id, so
  Delta's optimistic concurrency check refuses the second commit (as for racing publishers);
  the loser retries, sees the winner's row, and reports the request as refused (or as a no-op
  when it asked for the same thing). An append costs a few milliseconds where a MERGE cost tens;
  two deciders of different transactions in one bucket only retry.
* **Committed exactly once, dense offsets.** Only the publisher writes ``commitlog``. Each
  publish commit records, as Delta application transactions (``txn`` actions), the ``op``
  version it has published up to and the next offset of every queue it wrote. Two publishers
  racing set the same application ids, so Delta refuses the second commit; it retries from
  the new state. Nothing is read-then-written without that check, so offsets are dense, only
  grow, and no committed message is published twice or skipped. A backlog goes out in
  commits of bounded size, whole ``op`` versions each, in decision order; the application
  transactions are read once per ``commitlog`` snapshot (:mod:`rmq_spark.delta.txnlog`), not once
  per queue. Normal messages get their
  ``msg_id`` once per publish, and a retry after a failure that does not say whether the
  commit landed looks them up in ``commitlog`` before writing them again.
* **Nothing is lost.** ``prepare`` returns only after the half message's Delta commit.
  A crash after a COMMIT decision but before its publish is repaired by the next publish,
  which starts from the recorded ``op`` version. Every write retries commits lost to
  concurrent writers (``CommitFailedError``: nothing landed). Work done after a commit has
  landed (compaction) never turns it into an error: a caller told "failed" would retry.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import closing, contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import unquote

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
from deltalake import CommitProperties, DeltaTable, QueryBuilder, Transaction
from deltalake import Field as DeltaField
from deltalake.exceptions import (
    CommitFailedError,
    DeltaError,
    DeltaProtocolError,
    SchemaMismatchError,
    TableNotFoundError,
)
from deltalake.table import TableMerger
from deltalake.transaction import AddAction

from rmq_spark.delta.chores import Chores
from rmq_spark.delta.commit import appendable, checkpoint, checkpoint_interval
from rmq_spark.delta.commit import commit as commit_direct
from rmq_spark.delta.files import (
    LargeVersion,
    admitting,
    commit_files,
    read_ahead,
    stored_share,
    write_files,
    write_in_parallel,
)
from rmq_spark.delta.storage import (
    arrow_filesystem,
    check_conditional_put,
    check_conditional_writes,
    deltalake_options,
    filesystem,
)
from rmq_spark.delta.txnlog import app_transactions, clean_log, commit_infos, follow
from rmq_spark.model.config import Settings, StoreSettings
from rmq_spark.model.errors import (
    CorruptStoreError,
    NotAStoreError,
    RmqSparkError,
    StorageConfigError,
    StoreError,
    StoreVersionError,
)
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.messages import (
    LocalTransactionState,
    Message,
    check_group,
    new_id,
    queue_for,
    validate_message,
)
from rmq_spark.model.schema import (
    COLUMNS_ADDED_LATER,
    COMMITLOG_SCHEMA,
    HALF_SCHEMA,
    LOCKS_SCHEMA,
    OP_SCHEMA,
    TABLES,
    TIMESTAMP,
    WRITER_COLUMNS,
)
from rmq_spark.store.recent import RecentHalves

log = logging.getLogger(__name__)
_T = TypeVar("_T")

LAYOUT_VERSION = 1
MARKER_FILE = "_rmqtx_store.json"
STORE_FORMAT = "rmq-spark-store"
#: Application id under which ``commitlog`` records the last ``op`` version it published.
OP_CURSOR_APP_ID = "rmqtx.publish.op_version"
#: Application id under which ``commitlog`` records the commit time (ms, plus the clock skew
#: allowed) of the newest ``op`` commit of another Delta writer the publisher passed: a
#: transaction made before it may have had its decision removed (a RESTORE or DELETE) and be
#: decided again, so its COMMIT is published only if ``commitlog`` does not hold it yet.
FOREIGN_OP_APP_ID = "rmqtx.publish.foreign_op_millis"
#: How far a host's clock, which stamps the transaction ids it makes, may run ahead of the
#: foreign writer's (:data:`FOREIGN_OP_APP_ID`).
_CLOCK_SKEW_MILLIS = 10 * 60 * 1000
#: Hex digits of the millisecond clock that begins every id
#: (:func:`rmq_spark.model.messages.new_id`).
_ID_MILLIS_DIGITS = 12
#: Application ids under which ``pending`` records the ``half`` and ``op`` versions it covers.
PENDING_HALF_APP_ID = "rmqtx.pending.half_version"
PENDING_OP_APP_ID = "rmqtx.pending.op_version"
#: Log entries of an internal table that no reader's cursor needs are kept this long (seconds,
#: or the ``log_retention`` if shorter), for the operations under way: a commit's conflict
#: check reads the commits after its snapshot.
UNNEEDED_LOG_SECONDS = 10.0
#: A publish of one large decision (streamed) logs how far it is at INFO this often.
PROGRESS_SECONDS = 30.0
_QUEUE_APP_ID_PREFIX = "rmqtx.queue."
_QUEUE_APP_ID = _QUEUE_APP_ID_PREFIX + "{topic}.{queue_id}"
_EARLIEST_APP_ID_PREFIX = "rmqtx.earliest."
_EARLIEST_APP_ID = _EARLIEST_APP_ID_PREFIX + "{topic}.{queue_id}"
_DECISION_APP_ID = "rmqtx.decision.{bucket}"
#: ``commitInfo`` key of a decision commit of ``op``: the transactions it COMMITs, in order
#: (JSON). The publisher reads them from the log: the data files an append added can be
#: compacted away and vacuumed before a lagging publisher reads them.
COMMITS_KEY = "rmqtx.commits"
#: ``op.decided_by`` of a COMMIT recorded again for a transaction that is published but whose
#: decision another Delta writer removed from ``op`` (a RESTORE or DELETE): check-back records
#: it instead of asking the checker, and the publisher never publishes it.
DECIDED_BY_RECOVERY = "check-back:recovered"
#: Buckets of transaction ids for the decision arbiter: ``op``'s snapshot keeps one
#: application id per bucket, however many transactions were ever decided.
DECISION_BUCKETS = 1024
#: Tables added to layout 1 after its first stores were made: opening an older store creates
#: them (empty) instead of refusing it. Any other missing table is damage.
TABLES_ADDED_LATER = ("consumer_offsets", "epochs", "locks", "pending")
#: How long a compaction holds its table's lock at most (a killed compactor's lock expires).
_COMPACTION_LOCK_SECONDS = 600.0
_MAX_COMMIT_ATTEMPTS = 200
#: Retries of a publish whose failure did not tell whether it landed.
_MAX_UNSURE_ATTEMPTS = 3
#: Compact a table after every this many commits: deltalake's commit cost grows with the
#: number of files in the snapshot, and every group commit adds one.
COMPACT_EVERY_COMMITS = 50
#: The kinds of chores a commit asks for (see :meth:`Store._soon`).
_CHORES = ("checkpoint", "maintain")
_COMPACT_TARGET_BYTES = 16 * 1024 * 1024
#: A compaction rewrites at most this many files (its commit names each one it removes).
_COMPACT_MAX_FILES = 10_000


def queue_app_id(topic: str, queue_id: int) -> str:
    """The application id whose version is the next offset of a queue in ``commitlog``."""
    return _QUEUE_APP_ID.format(topic=topic, queue_id=queue_id)


def decision_app_id(transaction_id: str) -> str:
    """The application id an ``op`` commit deciding ``transaction_id`` records: one per bucket
    of ids (CRC-32, stable across processes), so racing deciders of a transaction conflict."""
    bucket = zlib.crc32(transaction_id.encode()) % DECISION_BUCKETS
    return _DECISION_APP_ID.format(bucket=bucket)


def earliest_app_id(topic: str, queue_id: int) -> str:
    """The application id whose version is the earliest offset still in a queue of
    ``commitlog`` (absent: 0). Set by retention (:mod:`rmq_spark.store.retention`)."""
    return _EARLIEST_APP_ID.format(topic=topic, queue_id=queue_id)


class EndTransactionStatus(StrEnum):
    """What happened to an end-transaction request."""

    #: This request decided the transaction.
    APPLIED = "APPLIED"
    #: The transaction already had the same decision; nothing changed.
    ALREADY_DECIDED = "ALREADY_DECIDED"
    #: The transaction already had the opposite decision, which stays in force.
    REFUSED = "REFUSED"


@dataclass(frozen=True)
class Decision:
    """A request to end one transaction.

    Parameters
    ----------
    transaction_id : str
        The transaction to end.
    producer_group : str
        The group that owns it.
    state : LocalTransactionState
        ``COMMIT`` or ``ROLLBACK``.
    decided_by : str
        Who decides: ``producer``, ``check-back``, ``sink``... (kept in ``op`` for audits).
    """

    transaction_id: str
    producer_group: str
    state: LocalTransactionState
    decided_by: str = "producer"


@dataclass(frozen=True)
class EndTransactionResult:
    """The outcome of an end-transaction request.

    ``decision`` is the decision in force after the request: the requested one when
    ``status`` is ``APPLIED`` or ``ALREADY_DECIDED``, the earlier one when ``REFUSED``.
    """

    transaction_id: str
    requested: LocalTransactionState
    status: EndTransactionStatus
    decision: LocalTransactionState


@dataclass(frozen=True)
class PreparedMessage:
    """A half message that is durable in the ``half`` table."""

    msg_id: str
    transaction_id: str
    queue_id: int
    half_version: int
    store_timestamp: datetime


@dataclass(frozen=True)
class PublishResult:
    """What one publish wrote into ``commitlog``."""

    published: int
    op_version: int
    commitlog_version: int | None
    #: (msg_id, queue_id, queue_offset) of the normal messages handed to this publish, in order.
    sent: list[tuple[str, int, int]] = field(default_factory=list)


def _now() -> datetime:
    return datetime.now(UTC)


def _backoff(attempt: int) -> None:
    time.sleep(min(0.2, 0.002 * 2 ** min(attempt, 7)) * random.uniform(0.5, 1.5))


@dataclass(frozen=True)
class _Head:
    """The CommitLog as a publisher last found it: its latest ``version`` and application
    transactions ``txns``, when that was found (``time.monotonic()``, before looking), and a
    snapshot (at or before ``version``) for its metadata."""

    snapshot: DeltaTable
    version: int
    txns: Mapping[str, int]
    found: float


class _Unsure(Exception):
    """A commit failed in a way that does not say whether it landed; retry after checking."""


def retry_commits(what: str, name: str, attempt: Callable[[int], _T]) -> _T:
    """Call ``attempt(n)`` until it returns, retrying (with backoff) each time a commit is lost
    to a concurrent writer. A ``CommitFailedError`` means nothing landed, so the next attempt
    starts from the new table state; ``_Unsure`` is retried the same way, and the attempt
    itself checks first whether the failed commit landed."""
    for n in range(_MAX_COMMIT_ATTEMPTS):
        try:
            return attempt(n)
        except (CommitFailedError, _Unsure):
            log.debug("%s lost a race (attempt %d); retrying", what, n + 1)
            _backoff(n)
    raise StoreError(
        f"could not {what} after {_MAX_COMMIT_ATTEMPTS} attempts: too many concurrent writers "
        f"on the {name} table."
    )


@contextmanager
def _refused_if_cleaned(table: DeltaTable) -> Iterator[None]:
    """Turn deltalake's refusal to commit on a snapshot whose successors' log entries were
    cleaned into a lost race: nothing landed, and :func:`retry_commits` tries again from the
    latest version. It happens to a blind append on a cached snapshot (after a clock skew
    between hosts), and to an operation that outlives ``UNNEEDED_LOG_SECONDS`` while others
    commit and clean."""
    version = table.version()
    try:
        yield
    except DeltaError as exc:
        if str(exc) != f"Invalid table version: {version}":
            raise
        raise CommitFailedError(
            f"the log after version {version} was cleaned under this snapshot"
        ) from exc


def relisting(action: Callable[[], _T]) -> _T:
    """Run a deltalake action that lists a table's log, again when the listing had a hole.

    On a local filesystem a listing made while commits land can miss an entry made during it
    and still see a later one (directory order is not name order), and deltalake refuses it
    ("Expected contiguous commit files"). Seen about once in 20 s of one thread reading
    ``half`` while another sent; listing again sees both entries.
    """
    for _ in range(_RELISTINGS - 1):
        try:
            return action()
        except DeltaError as exc:
            if _LISTING_GAP not in str(exc):
                raise
            log.debug("a log listing raced a commit (%s); listing again", exc)
    return action()


#: deltalake's refusal of a log listing with a hole in it, and how often to list again.
_LISTING_GAP = "Expected contiguous commit files"
_RELISTINGS = 5


def _plain_type(dtype: pa.DataType) -> pa.DataType:
    """The same type with string/binary views replaced by plain strings/binaries."""
    if dtype == pa.string_view():
        return pa.string()
    if dtype == pa.binary_view():
        return pa.binary()
    if pa.types.is_map(dtype):
        return pa.map_(_plain_type(dtype.key_type), _plain_type(dtype.item_type))
    if pa.types.is_list(dtype) or pa.types.is_large_list(dtype):
        return pa.list_(_plain_type(dtype.value_type))
    return dtype


def read_arrow(stream: object) -> pa.Table:
    """Read an Arrow C stream (deltalake returns arro3 objects, with view types) as plain
    pyarrow types, which every compute kernel supports."""
    table = pa.RecordBatchReader.from_stream(stream).read_all()
    schema = pa.schema([f.with_type(_plain_type(f.type)) for f in table.schema])
    return table.cast(schema)


def _conform(table: pa.Table, schema: pa.Schema) -> pa.Table:
    """Select and cast columns to ``schema`` (deltalake may hand back view/large types)."""
    columns = [table.column(f.name).cast(f.type) for f in schema]
    return pa.Table.from_arrays(columns, schema=schema)


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
        Returns the current UTC time for the timestamps this process writes.
    """

    def __init__(
        self, root: str, settings: StoreSettings, clock: Callable[[], datetime] | None = None
    ) -> None:
        self.root = root
        self.settings = settings
        self.clock = clock or _now
        # DeltaTable objects are not thread-safe; each thread keeps its own, refreshed
        # incrementally instead of replaying the log on every operation, and when each was
        # last brought up to date (time.monotonic()).
        self._tables = threading.local()
        self._refreshed = threading.local()
        self._heads = threading.local()  # each thread's _Head of the CommitLog
        #: Half messages this process prepared, until it publishes them (a publisher that
        #: finds a whole chunk here does not read ``half`` back).
        self._recent = RecentHalves()
        #: The newest version of each table this process committed: where a blind append
        #: starts looking for a free version when its cached snapshot is older.
        self._known: dict[str, int] = {}
        self._known_lock = threading.Lock()
        #: Per table: (snapshot version, checkpoint interval or None), see _direct_interval.
        self._writers: dict[str, tuple[int, int | None]] = {}
        #: Background checkpoints, and compactions with log cleanups, by kind (see
        #: :meth:`maintain_in_background`).
        self._chores: dict[str, Chores] = {}

    # ------------------------------------------------------------------ opening
    @classmethod
    def open(
        cls,
        path: str | Path | None = None,
        *,
        settings: Settings | StoreSettings | None = None,
        create: bool = True,
        clock: Callable[[], datetime] | None = None,
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
            Create an empty store when the root is empty or missing.
        clock : callable, optional
            Returns the current UTC time for the timestamps this process writes (the
            default is the system clock).

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
        store._open_or_create(create)
        return store

    def table_uri(self, name: str) -> str:
        """URI of one of the store's tables (``half``, ``op`` or ``commitlog``)."""
        if name not in TABLES:
            raise StoreError(f"unknown table {name!r}; the store has {', '.join(TABLES)}.")
        return f"{self.root.rstrip('/')}/{name}"

    def table(self, name: str, *, latest: bool = True) -> DeltaTable:
        """One of the store's tables as a deltalake ``DeltaTable``.

        Parameters
        ----------
        name : str
            ``half``, ``op`` or ``commitlog``.
        latest : bool, default True
            Bring the snapshot up to the newest version. Blind appends do not need it, as
            long as the snapshot is younger than half of ``UNNEEDED_LOG_SECONDS``: the log
            entries after an older one may have been cleaned, and deltalake refuses to
            commit on it.
        """
        cache, refreshed = self._tables.__dict__, self._refreshed.__dict__
        table = cache.get(name)
        now = time.monotonic()
        if table is None:
            uri = self.table_uri(name)
            table = cache[name] = relisting(
                lambda: DeltaTable(uri, storage_options=self._storage_options)
            )
        elif latest or now - refreshed[name] > self._unneeded_log_seconds / 2:
            relisting(table.update_incremental)
        else:
            return table
        refreshed[name] = now
        return table

    @property
    def _unneeded_log_seconds(self) -> float:
        return min(UNNEEDED_LOG_SECONDS, self.settings.log_retention)

    @property
    def _storage_options(self) -> dict[str, str] | None:
        return deltalake_options(self.settings.storage_options)

    def _check_writes(self) -> None:
        """Before this process first writes to the store through its endpoint: refuse an object
        store that ignores conditional writes (:func:`check_conditional_put`, probed once per
        process, root and options; a reader needs no write permission and is not probed)."""
        check_conditional_put(self.root, self.settings.storage_options)

    def _fs(self) -> tuple[fsspec.AbstractFileSystem, str]:
        return filesystem(self.root, self.settings.storage_options)

    def _open_or_create(self, create: bool) -> None:
        check_conditional_writes(self.settings.storage_options)
        fs, root = self._fs()
        marker = f"{root.rstrip('/')}/{MARKER_FILE}"
        if _reached(fs, marker, self.root):
            self._check_marker(fs, marker)
            for name in TABLES_ADDED_LATER:
                if not fs.exists(f"{root.rstrip('/')}/{name}"):
                    self._create_table(name)
                    log.info("store %s: created table %r, new in this version", self.root, name)
            for name in TABLES:
                self._check_table(name)
            return
        if fs.exists(root) and not fs.isdir(root):
            raise NotAStoreError(
                f"{self.root!r} is a file, not an rmq-spark store; give a directory path."
            )
        entries = (
            {Path(p.rstrip("/")).name for p in fs.ls(root, detail=False)}
            if fs.exists(root)
            else set()
        )
        # A README (storage/ ships one) or hidden files do not make a root foreign.
        entries = {e for e in entries if not e.startswith(".") and e != "README.md"}
        if entries - set(TABLES):
            raise NotAStoreError(
                f"{self.root!r} holds data that is not an rmq-spark store (no {MARKER_FILE}; found "
                f"{', '.join(sorted(entries)[:5])}). Use an empty directory or an existing store."
            )
        if not create:
            raise StoreError(
                f"no rmq-spark store at {self.root!r}; check the path (--path, option 'path' or "
                "store.path). A store is made when a producer or Store.open(create=True) first "
                "opens it."
            )
        check_conditional_put(self.root, self.settings.storage_options)
        for name in TABLES:
            self._create_table(name)
            self._check_table(name)
        # The marker is written last: a store is complete once it exists.
        with fs.open(marker, "w") as out:
            json.dump(
                {"format": STORE_FORMAT, "layout_version": LAYOUT_VERSION, "created": str(_now())},
                out,
            )
        log.info("created rmq-spark store at %s", self.root)

    def _create_table(self, name: str) -> None:
        schema, partition_by, properties = TABLES[name]
        DeltaTable.create(
            self.table_uri(name),
            schema=schema,
            mode="ignore",
            partition_by=partition_by or None,
            name=f"rmqtx_{name}",
            configuration=properties,
            storage_options=self._storage_options,
        )

    def _check_marker(self, fs: fsspec.AbstractFileSystem, marker: str) -> None:
        try:
            with fs.open(marker, "r") as src:
                meta = json.load(src)
            version = int(meta["layout_version"])
            if meta["format"] != STORE_FORMAT:
                raise ValueError(f"format is {meta['format']!r}")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise CorruptStoreError(
                f"the store marker {MARKER_FILE} under {self.root!r} is unreadable ({exc}); "
                "the root is damaged or was not written by rmq-spark."
            ) from exc
        if version > LAYOUT_VERSION:
            raise StoreVersionError(
                f"the store at {self.root!r} has layout version {version}, but this rmq-spark "
                f"reads layout version {LAYOUT_VERSION} at most; upgrade rmq-spark."
            )

    def _check_table(self, name: str) -> None:
        expected = [f.name for f in TABLES[name][0]]
        try:
            found = [f.name for f in self.table(name).schema().fields]
        except (TableNotFoundError, DeltaError, OSError) as exc:
            raise CorruptStoreError(
                f"table {name!r} of the store at {self.root!r} is missing or unreadable ({exc})."
            ) from exc
        added = COLUMNS_ADDED_LATER.get(name, [])
        if added and found == expected[: -len(added)]:
            self._add_columns(name, added)
            found = expected
        if found != expected:
            raise CorruptStoreError(
                f"table {name!r} of the store at {self.root!r} has columns {found}, expected "
                f"{expected}; it was not written by this rmq-spark layout."
            )

    def _add_columns(self, name: str, added: list[pa.Field]) -> None:
        """Bring a table of an older layout-1 store up to date (idempotent, race-safe)."""

        def attempt(_: int) -> None:
            table = self.table(name)
            if len(table.schema().fields) < len(TABLES[name][0]):  # else another process did
                table.alter.add_columns([DeltaField.from_arrow(f) for f in added])
            # Older epochs rows are all closed; open ones have no closer yet.
            for column in ("closed_by", "closed_timestamp") if name == "epochs" else ():
                if not next(
                    f for f in self.table(name).schema().fields if f.name == column
                ).nullable:
                    self.table(name).alter.drop_column_not_null(column)

        retry_commits(f"add columns to {name}", name, attempt)
        log.info(
            "store %s: added column(s) %s to table %r", self.root, [f.name for f in added], name
        )

    # ------------------------------------------------------------------ prepare
    def prepare(
        self,
        messages: Sequence[Message],
        producer_group: str,
        *,
        transaction_ids: Sequence[str] | None = None,
        born_timestamp: datetime | None = None,
        validated: bool = False,
    ) -> list[PreparedMessage]:
        """Write half messages (durable, invisible) in one Delta commit.

        Parameters
        ----------
        messages : sequence of Message
            Validated before anything is written; one invalid message fails the whole call.
        producer_group : str
            The producer group that owns the transactions.
        transaction_ids : sequence of str, optional
            One per message; several messages may share a transaction. Defaults to a new
            transaction per message.
        born_timestamp : datetime, optional
            The producer's clock at send time (defaults to now).
        validated : bool, default False
            The messages and the group were checked already (:func:`validate_message`,
            :func:`check_group`); they are not checked again. A producer checks each message as
            it is sent, so its group commit, which every sender waits for, skips the checks.

        Returns
        -------
        list of PreparedMessage
            In the order of ``messages``, all with the same ``half_version``.
        """
        if not validated:
            check_group(producer_group)
            for message in messages:
                validate_message(message, self.settings.max_body_bytes)
        fresh_ids = transaction_ids is None
        if transaction_ids is None:
            transaction_ids = [new_id() for _ in messages]
        if len(transaction_ids) != len(messages):
            raise RmqSparkError("transaction_ids must have one entry per message.")
        if not messages:
            return []
        born = born_timestamp or self.clock()
        stored = self.clock()
        msg_ids = [new_id() for _ in messages]
        keys = [m.keys_string for m in messages]
        queue_ids = [queue_for(k, self.settings.queue_nums) for k in keys]
        half = pa.Table.from_pydict(
            {
                "transaction_id": list(transaction_ids),
                "msg_id": msg_ids,
                "producer_group": [producer_group] * len(messages),
                "topic": [m.topic for m in messages],
                "queue_id": queue_ids,
                "keys": keys,
                "tags": [m.tags for m in messages],
                "body": [m.body_bytes for m in messages],
                "properties": [list(dict(m.properties).items()) for m in messages],
                "born_timestamp": [born] * len(messages),
                "store_timestamp": [stored] * len(messages),
                **{f.name: [None] * len(messages) for f in WRITER_COLUMNS},
            },
            schema=HALF_SCHEMA,
        )
        version = self.append("half", half)
        if fresh_ids:
            self._recent.add(half)
        return [
            PreparedMessage(mid, tid, qid, version, stored)
            for mid, tid, qid in zip(msg_ids, transaction_ids, queue_ids, strict=True)
        ]

    def append(self, name: str, data: pa.Table, app_ids: Mapping[str, int] | None = None) -> int:
        """Append rows to one of the store's tables in one commit (one with no rows records
        ``app_ids`` alone); return the committed version.

        ``app_ids`` (application id to version) are recorded with the commit, which then
        fails (and is retried from the latest snapshot) if a concurrent commit recorded one of
        them. Without them an append never conflicts; a lost race for the version (under many
        concurrent writers) is retried, like :meth:`merge` and :meth:`publish`.
        """
        version = self._append(name, [data] if data.num_rows else [], app_ids, always=True)
        assert version is not None
        return version

    def append_batches(self, name: str, rows: Iterable[pa.Table]) -> int | None:
        """Blind-append rows given batch by batch to one of the store's tables in one commit,
        holding one batch in memory at a time (deltalake's writer holds all its input, several
        times over); return the version committed, or a later one (None: ``rows`` was empty).

        The files are written first, invisible; an error raised while ``rows`` is iterated
        commits nothing. A retried commit adds the same files again, which Delta reconciles
        by path: a commit that landed although it reported a failure stores nothing twice.
        """
        return self._append(name, rows, None, always=False)

    def _append(
        self,
        name: str,
        rows: Iterable[pa.Table],
        app_ids: Mapping[str, int] | None,
        *,
        always: bool,
    ) -> int | None:
        """Write ``rows`` as new files of a table and commit them (nothing when there are
        none, unless ``always``), retrying lost races."""
        self._check_writes()
        schema, partitions, _ = TABLES[name]
        partition = partitions[0] if partitions else None
        uri, options = self.table_uri(name), self.settings.storage_options
        files = write_files(uri, iter(rows), schema, partition, options)
        if not files and not always:
            return None
        version = retry_commits(
            f"append to {name}",
            name,
            lambda n: self._commit_files(name, files, self.table(name, latest=n > 0), app_ids),
        )
        self._after_commit(name, version)
        return version

    def _commit_files(
        self,
        name: str,
        files: list[AddAction],
        snapshot: DeltaTable,
        app_ids: Mapping[str, int] | None = None,
        info: Mapping[str, str] | None = None,
        after: int | None = None,
        removes: Sequence[Mapping[str, object]] = (),
    ) -> int:
        """One attempt (for :func:`retry_commits`) at committing written data files as an
        append to a table on ``snapshot`` (or, with ``removes``, a compaction of a table
        appended to directly); return the committed version.

        The log entry is written directly (:mod:`rmq_spark.delta.commit`, about 1 ms) unless
        the table needs more of a writer than that (then deltalake commits it). Without
        ``app_ids`` the commit may go after versions this process committed since
        ``snapshot`` (an append does not depend on what it read); with them, conflicts are
        checked from ``snapshot`` on, or from ``after``: a later version the caller read the
        log up to (:func:`follow`), with no change of the table since ``snapshot``.
        """
        partitions = TABLES[name][1]
        interval = self._direct_interval(name, snapshot)
        if interval is None:
            properties = CommitProperties(
                app_transactions=[Transaction(a, v) for a, v in (app_ids or {}).items()],
                custom_metadata=dict(info or {}),
            )
            with _refused_if_cleaned(snapshot):
                commit_files(snapshot, files, partitions[0] if partitions else None, properties)
            return snapshot.version()
        after = snapshot.version() if after is None else after
        with self._known_lock:
            if not app_ids and not removes:
                after = max(after, self._known.get(name, after))
        uri = self.table_uri(name)
        version = commit_direct(
            uri,
            self.settings.storage_options,
            after,
            files,
            app_ids=app_ids,
            info=info,
            removes=removes,
        )
        with self._known_lock:
            self._known[name] = max(version, self._known.get(name, version))
        if version % interval == 0:
            self._soon("checkpoint", name, lambda: self._checkpoint(name, version))
        return version

    def _checkpoint(self, name: str, version: int) -> None:
        """Write a table's checkpoint at ``version`` (:func:`checkpoint`). Never raises: the
        commit has landed, and the next interval writes one."""
        try:
            relisting(lambda: checkpoint(self.table_uri(name), self._storage_options, version))
        except Exception:
            log.warning(
                "checkpoint of %s at version %d failed (the commit itself landed); the next "
                "interval writes one",
                name,
                version,
                exc_info=True,
            )

    def _direct_interval(self, name: str, snapshot: DeltaTable) -> int | None:
        """The checkpoint interval of a table that :func:`commit_direct` appends to, None when
        deltalake commits its appends (:func:`appendable`); known per snapshot version."""
        version = snapshot.version()
        cached = self._writers.get(name)
        if cached is None or cached[0] != version:
            interval = checkpoint_interval(snapshot) if appendable(snapshot) else None
            cached = self._writers[name] = (version, interval)
        return cached[1]

    def merge(
        self,
        name: str,
        source: pa.Table,
        on: str | Sequence[str],
        clauses: Callable[[TableMerger], TableMerger],
        commit_properties: CommitProperties | None = None,
    ) -> dict[str, Any]:
        """MERGE ``source`` (alias ``s``) into a table (alias ``t``) where the ``on`` columns
        are equal.

        ``clauses`` adds the WHEN clauses to deltalake's ``TableMerger``. A commit lost to a
        concurrent writer is retried from the new snapshot, so conditions in the clauses are
        evaluated against what is really there. ``commit_properties`` go with the commit (for
        example application transactions recorded with it).
        """
        keys = [on] if isinstance(on, str) else list(on)

        self._check_writes()

        def attempt(_: int) -> tuple[dict[str, Any], int]:
            table = self.table(name)
            with _refused_if_cleaned(table):
                merger = table.merge(
                    source,
                    predicate=" AND ".join(f"t.{k} = s.{k}" for k in keys),
                    source_alias="s",
                    target_alias="t",
                    commit_properties=commit_properties,
                )
                return clauses(merger).execute(), table.version()

        metrics, version = retry_commits(f"MERGE into {name}", name, attempt)
        self._after_commit(name, version)
        return metrics

    def _after_commit(self, name: str, version: int) -> None:
        """Compact and clean the log every ``COMPACT_EVERY_COMMITS`` commits (:meth:`_soon`)."""
        if version % COMPACT_EVERY_COMMITS == 0:
            self._soon("maintain", name, lambda: self._maintain(name))

    def _soon(self, kind: str, name: str, work: Callable[[], None]) -> None:
        """Run ``work``, a chore of a ``kind`` of :data:`_CHORES` on table ``name`` that a
        commit asks for and that never raises: now, on the committing thread, or after
        :meth:`maintain_in_background` on the background thread of its kind."""
        chores = self._chores.get(kind)
        if chores is not None:
            chores.ask(name, work)
        else:
            work()

    def maintain_in_background(self) -> None:
        """Write checkpoints, compact and clean tables after their commits on background
        threads of this process from now on, so that no commit waits for them (a producer's
        sends: one send in 50 would wait 50 to 100 ms for a compaction, one in 100 some 20 ms
        for a checkpoint). Checkpoints have a thread of their own: a compaction that takes
        long must not hold them back, or every snapshot load (the next compaction's too)
        would replay more of the log. Idempotent; :meth:`finish_maintenance` waits for what
        is asked."""
        with self._known_lock:
            if not self._chores:
                self._chores = {kind: Chores(f"rmqtx-{kind}-{self.root}") for kind in _CHORES}

    def finish_maintenance(self) -> None:
        """Wait until the background checkpoints, compactions and log cleanups asked for so
        far are done (a no-op without :meth:`maintain_in_background`)."""
        for chores in self._chores.values():
            chores.wait()

    def _maintain(self, name: str) -> None:
        """Compact a table and clean its log. Never raises: the commit that asked has landed,
        and a caller told it failed would retry it and duplicate what it wrote."""
        failpoint("store.maintain")
        try:
            self.compact(name)
            if name != "commitlog":
                self.clean_log(name)
        except Exception:
            log.warning(
                "compaction or log cleanup of %s failed (the commits themselves landed); a "
                "later commit will ask again",
                name,
                exc_info=True,
            )

    def clean_log(self, name: str) -> int:
        """Delete the Delta log entries of an internal table that a checkpoint covers and that
        no reader needs any more; return how many files went.

        Runs after every ``COMPACT_EVERY_COMMITS`` commits of a table. On a local filesystem
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
        latest = self.table(name).version()
        kept = min(latest, self.published_op_version() + 1) if name == "op" else latest
        now = self.clock()
        rules = [(kept, now - timedelta(seconds=self.settings.log_retention))]
        if not self._held("maintain", f"compact:{name}"):
            lagging = self._pending_cursors().get(name) if name in ("half", "op") else None
            if lagging is not None:
                kept = min(kept, lagging + 1)
            rules.append((kept, now - timedelta(seconds=self._unneeded_log_seconds)))
        deleted = clean_log(self.table_uri(name), self.settings.storage_options, rules)
        if deleted:
            log.debug("deleted %d log entries of %s", deleted, name)
        return deleted

    def _held(self, *locks: str) -> bool:
        """Whether one of the ``locks`` is held (taken and not expired)."""
        names = ", ".join(sql_string(n) for n in locks)
        held = self.query("locks", f"name IN ({names}) AND expires > {sql_time(self.clock())}")
        return held.num_rows > 0

    def _pending_cursors(self) -> dict[str, int]:
        """The ``half`` and ``op`` versions the pending list covers (none before its first
        update)."""
        uri, options = self.table_uri("pending"), self.settings.storage_options
        cursors = app_transactions(self.table("pending"), uri, options)
        by_table = {"half": PENDING_HALF_APP_ID, "op": PENDING_OP_APP_ID}
        return {name: cursors[app] for name, app in by_table.items() if app in cursors}

    def compact(self, *names: str) -> dict[str, int]:
        """Rewrite the small files of the store's tables into larger ones.

        Runs automatically every ``COMPACT_EVERY_COMMITS`` commits of a table. Compaction
        changes no data (``dataChange=false``): consumers, including Delta's own streaming
        source, see nothing. Compactions of one table take turns through a lock in ``locks``
        (deltalake would let two concurrent ones both commit, storing every row twice); a
        table being compacted elsewhere is skipped. A compaction racing a writer that rewrites
        the same files loses to it (Delta's conflict check), which is not an error.

        Parameters
        ----------
        *names : str
            Tables to compact (default: all).

        Returns
        -------
        dict
            Files removed per table compacted.
        """
        removed = {}
        # The lock table is not compacted: its MERGEs keep one live file per lock.
        for name in [n for n in names or TABLES if n != "locks"]:
            holder = new_id()
            if not self.lock(f"compact:{name}", holder, _COMPACTION_LOCK_SECONDS):
                log.debug("%s is being compacted by another process; skipped", name)
                continue
            try:
                metrics = self._compact_table(name)
            except CommitFailedError as exc:
                log.debug("compaction of %s lost a race (%s); the next one will do it", name, exc)
                continue
            finally:
                self.lock(f"compact:{name}", holder, 0.0)
            removed[name] = int(metrics.get("numFilesRemoved", 0))
            log.debug("compacted %s: %s", name, metrics)
        return removed

    def _compact_table(self, name: str) -> dict[str, Any]:
        """Rewrite a table's files smaller than ``_COMPACT_TARGET_BYTES`` (its compaction lock
        held); return the metrics.

        A table appended to directly is compacted the same way (:func:`commit_direct` with
        ``removes``): appends that land meanwhile do not conflict with it, and it takes the
        next free version in about 50 us a try. deltalake's OPTIMIZE, used for the other
        tables, gives up after 15 tries, each of which lists the log: against a producer
        committing hundreds of times a second it lost every time, and ``half`` grew by a
        file per commit for as long as the sends went on.
        """
        self._check_writes()
        snapshot = self.table(name)
        if self._direct_interval(name, snapshot) is None:
            return relisting(lambda: snapshot.optimize.compact(target_size=_COMPACT_TARGET_BYTES))
        files = with_uris(snapshot, self.table_uri(name))
        small = files.filter(pc.less(files.column("size_bytes"), _COMPACT_TARGET_BYTES))
        small = small.sort_by([("modification_time", "ascending"), ("path", "ascending")])
        small = small.slice(0, _COMPACT_MAX_FILES)  # the next compaction does the rest
        partitions = TABLES[name][1]
        column = f"partition.{partitions[0]}" if partitions else None
        values = [None] if column is None else pc.unique(small.column(column)).to_pylist()
        removed = added = 0
        for value in values:
            group = small if column is None else small.filter(pc.equal(small.column(column), value))
            if group.num_rows > 1:
                added += self._rewrite(name, snapshot, group, value)
                removed += group.num_rows
        return {"numFilesRemoved": removed, "numFilesAdded": added}

    def _rewrite(self, name: str, snapshot: DeltaTable, files: pa.Table, value: str | None) -> int:
        """Rewrite ``files`` (add actions of ``snapshot``, of one partition ``value``, oldest
        first) as larger ones in one commit that changes no data; return how many files it
        added."""
        schema, partitions, _ = TABLES[name]
        partition = partitions[0] if partitions else None
        stored = pa.schema([f for f in schema if f.name != partition])
        uri, options = self.table_uri(name), self.settings.storage_options

        def rows() -> Iterator[pa.Table]:
            uris, sizes = files.column("uri").to_pylist(), files.column("size_bytes").to_pylist()
            start = 0
            while start < len(uris):  # about _COMPACT_TARGET_BYTES of files a read
                stop, size = start + 1, sizes[start]
                while stop < len(uris) and size + sizes[stop] <= _COMPACT_TARGET_BYTES:
                    size, stop = size + sizes[stop], stop + 1
                read = read_files(uris[start:stop], stored, options)
                if partition is not None:
                    read = read.append_column(
                        schema.field(partition), pa.repeat(pa.scalar(value), read.num_rows)
                    )
                yield read.select(schema.names)
                start = stop

        adds = write_files(uri, rows(), schema, partition, options, data_change=False)
        where = {partition: value} if partition else {}
        paths, sizes = files.column("path").to_pylist(), files.column("size_bytes").to_pylist()
        removes = [
            {"path": p, "size": n, "partition_values": where}
            for p, n in zip(paths, sizes, strict=True)
        ]
        info = {"rmqtx.operation": "compact"}
        self._commit_files(name, adds, snapshot, info=info, removes=removes)
        return len(adds)

    def lock(self, name: str, holder: str, seconds: float) -> bool:
        """Take (or, with ``seconds`` 0, release) the lock ``name`` for ``holder``: granted
        when free, expired, or ``holder``'s already. Racing takers conflict in Delta's
        optimistic concurrency check; exactly one gets it."""
        now = self.clock()
        source = pa.Table.from_pylist(
            [
                {
                    "name": name,
                    "holder": holder,
                    "expires": now + timedelta(seconds=seconds),
                    "now": now,
                }
            ],
            schema=LOCKS_SCHEMA.append(pa.field("now", TIMESTAMP)),
        )
        self.merge(
            "locks",
            source,
            "name",
            lambda m: m.when_matched_update(
                {"holder": "s.holder", "expires": "s.expires"},
                predicate="t.expires <= s.now OR t.holder = s.holder",
            ).when_not_matched_insert({c: f"s.{c}" for c in LOCKS_SCHEMA.names}),
        )
        rows = self.query("locks", f"name = {sql_string(name)}")
        return rows.column("holder").to_pylist() == [holder]

    # ------------------------------------------------------------------ end transaction
    def end_transactions(
        self, decisions: Sequence[Decision], *, publish: bool = True
    ) -> list[EndTransactionResult]:
        """Decide transactions; the first decision recorded for a transaction wins.

        Parameters
        ----------
        decisions : sequence of Decision
            COMMIT or ROLLBACK requests. A transaction named twice in one call is decided by
            its first entry.
        publish : bool, default True
            Publish committed messages into ``commitlog`` before returning.

        Returns
        -------
        list of EndTransactionResult
            One per decision, in order.
        """
        for d in decisions:
            if d.state not in (LocalTransactionState.COMMIT, LocalTransactionState.ROLLBACK):
                raise RmqSparkError(
                    f"end-transaction takes COMMIT or ROLLBACK, not {d.state!s} "
                    f"(transaction {d.transaction_id!r}); UNKNOWN means 'do not end it yet'."
                )
        first: dict[str, Decision] = {}
        for d in decisions:
            first.setdefault(d.transaction_id, d)
        before = self._record_decisions(list(first.values()))
        self._recent.discard(
            t for t, d in first.items() if before.get(t, d.state) is LocalTransactionState.ROLLBACK
        )
        results = []
        for d in decisions:
            in_force = before.get(d.transaction_id, first[d.transaction_id].state)
            if d is first[d.transaction_id] and d.transaction_id not in before:
                status = EndTransactionStatus.APPLIED
            elif in_force == d.state:
                status = EndTransactionStatus.ALREADY_DECIDED
            else:
                status = EndTransactionStatus.REFUSED
            results.append(EndTransactionResult(d.transaction_id, d.state, status, in_force))
        refused = [r for r in results if r.status is EndTransactionStatus.REFUSED]
        if refused:
            log.warning(
                "refused %d late conflicting decision(s), e.g. %s %s (already %s)",
                len(refused),
                refused[0].requested.value,
                refused[0].transaction_id,
                refused[0].decision.value,
            )
        if publish:
            self.publish()
        return results

    def _record_decisions(self, decisions: list[Decision]) -> dict[str, LocalTransactionState]:
        """Append new decisions to ``op``; return the decisions that were already there.

        The returned dict holds the transactions decided *before* this call, with their
        decision; the ones this call decided are not in it.
        """
        ids = [d.transaction_id for d in decisions]

        def attempt(_: int) -> tuple[dict[str, LocalTransactionState], int | None]:
            op = self.table("op")
            existing = self._decisions_of(op, ids)
            fresh = [d for d in decisions if d.transaction_id not in existing]
            if not fresh:
                return existing, None
            return existing, self.write_decisions(op, fresh)

        existing, version = retry_commits(f"record {len(decisions)} decision(s)", "op", attempt)
        if version is not None:
            self._after_commit("op", version)
        return existing

    def write_decisions(self, op: DeltaTable, decisions: Sequence[Decision]) -> int:
        """Append ``decisions`` to the ``op`` snapshot ``op``, in which none of them is decided;
        return the committed version.

        The commit records :func:`decision_app_id` of every transaction, so it fails with
        ``CommitFailedError`` (nothing landed) when a commit after ``op``'s version decided one
        of them, or another transaction of the same bucket: the caller reads again and retries.
        """
        self._check_writes()
        decided_at = self.clock()
        rows = pa.Table.from_pydict(
            {
                "transaction_id": [d.transaction_id for d in decisions],
                "producer_group": [d.producer_group for d in decisions],
                "decision": [d.state.value for d in decisions],
                "decided_by": [d.decided_by for d in decisions],
                "decided_timestamp": [decided_at] * len(decisions),
            },
            schema=OP_SCHEMA,
        )
        version = op.version() + 1
        arbiters = sorted({decision_app_id(d.transaction_id) for d in decisions})
        files = write_files(
            self.table_uri("op"), iter([rows]), OP_SCHEMA, None, self.settings.storage_options
        )
        committed = [
            d.transaction_id
            for d in decisions
            if d.state is LocalTransactionState.COMMIT and d.decided_by != DECIDED_BY_RECOVERY
        ]
        return self._commit_files(
            "op",
            files,
            op,
            app_ids=dict.fromkeys(arbiters, version),
            info={"rmqtx.operation": "decide", COMMITS_KEY: json.dumps(committed)},
        )

    def decisions(
        self, transaction_ids: Sequence[str], *, op: DeltaTable | None = None
    ) -> dict[str, LocalTransactionState]:
        """The decisions recorded in ``op`` for the given transactions.

        Parameters
        ----------
        transaction_ids : sequence of str
            Transactions to look up (files are pruned by their id statistics).
        op : DeltaTable, optional
            The ``op`` snapshot to read (default: the latest).

        Returns
        -------
        dict of str to LocalTransactionState
            COMMIT or ROLLBACK per decided transaction; undecided ones are absent.
        """
        return self._decisions_of(op or self.table("op"), list(transaction_ids))

    def published(self, transaction_ids: Sequence[str]) -> set[str]:
        """Which of the given transactions have messages in ``commitlog`` (files pruned by id).

        A pending transaction that is published had its decision removed from ``op`` by
        another Delta writer (a RESTORE or DELETE): see :data:`DECIDED_BY_RECOVERY`.
        """
        rows = self._rows_by_id(
            self.data_files("commitlog"), "commitlog", transaction_ids, ["transaction_id"]
        )
        return set(rows.column("transaction_id").to_pylist())

    def discarded(self, transaction_ids: Sequence[str]) -> set[str]:
        """Which of the given transactions have rows in ``discard`` (files pruned by id)."""
        rows = self._rows_by_id(self.data_files("discard"), "discard", transaction_ids)
        return set(rows.column("transaction_id").to_pylist())

    def _decisions_of(self, op: DeltaTable, ids: list[str]) -> dict[str, LocalTransactionState]:
        rows = self._rows_by_id(with_uris(op, self.table_uri("op")), "op", ids)
        return {
            tid: LocalTransactionState(dec)
            for tid, dec in zip(
                rows.column("transaction_id").to_pylist(),
                rows.column("decision").to_pylist(),
                strict=True,
            )
        }

    # ------------------------------------------------------------------ publish
    def publish(self, normal: Sequence[tuple[Message, str]] = ()) -> PublishResult:
        """Move committed messages into ``commitlog``, and send normal messages.

        Publishes every COMMIT recorded in ``op`` before the call (by anyone) that no publisher
        has published yet, plus the given normal messages, with dense per-queue offsets, in
        decision order. Safe to call from any number of processes at once; a crash at any point
        loses nothing and duplicates nothing.

        Parameters
        ----------
        normal : sequence of (Message, producer_group)
            Non-transactional messages to send (already validated), all in one commit: the
            last one, after the committed messages.

        Returns
        -------
        PublishResult
            What this call wrote (over all its commits), and where the normal messages went.

        Notes
        -----
        A backlog is published in successive commits of at most ``publish_max_messages``
        messages and ``publish_max_bytes`` body bytes (store settings), each holding whole
        ``op`` versions and moving the ``op`` cursor to the last one it holds, so memory stays
        bounded and racing publishers share the work instead of repeating one huge write. One
        ``op`` version larger than the limits (a large sink epoch) is one commit of its own.

        The normal messages get their ``msg_id`` and timestamps once, before the first attempt,
        so every attempt writes the same messages. Each commit is retried on its own (see
        :meth:`_publish_chunk`); another publisher that published a chunk first makes this one
        go on from where that one stopped.
        """
        self._check_writes()
        unsent = self._normal_rows(normal)  # ids and timestamps fixed for every attempt
        target = self.table("op").version()
        published, sent = 0, []
        while True:
            result, done = self._publish_chunk(target, unsent)
            published += result.published
            sent += result.sent
            if done:
                return PublishResult(published, result.op_version, result.commitlog_version, sent)
            failpoint("publish.chunk")

    def _publish_chunk(self, target: int, unsent: pa.Table) -> tuple[PublishResult, bool]:
        """Publish the next chunk of committed messages up to ``op`` version ``target`` in one
        commit, with the normal messages ``unsent`` if it is the last; return what it wrote and
        whether it was the last.

        A commit lost to a concurrent publisher (``CommitFailedError``) did not land and is
        retried from the new state. Before writing, the attempt checks that no other publisher
        moved the ``op`` cursor while it read the chunk (it would write data files for a commit
        bound to fail). A failure that does not say whether the commit landed (an I/O error, or
        a step after the commit such as writing a checkpoint) is retried as well: a landed
        chunk moved the cursor, and the normal messages' ids are looked up in ``commitlog`` (by
        file statistics) and not written again if they are there.
        """
        landed: list[tuple[str, int, int]] = []  # normal messages an unsure attempt did send
        unsure: list[Exception] = []

        def attempt(n: int) -> tuple[PublishResult, bool]:
            nonlocal unsent
            if unsure and unsent.num_rows:
                found = self._landed(unsent)
                if found is not None:
                    log.warning("the unsure publish had landed; not sending its messages again")
                    landed.extend(found)
                    unsent = unsent.slice(0, 0)
            head = self._commitlog_head(reload=n > 0)
            cursor = head.txns.get(OP_CURSOR_APP_ID, -1)
            if len(unsure) > _MAX_UNSURE_ATTEMPTS:
                if not landed:
                    raise StoreError(
                        f"could not publish: {unsure[-1]} ({len(unsure)} times); the normal "
                        "messages given were not sent. Check the store's filesystem, then retry."
                    ) from unsure[-1]
                # They were sent; committed transactions left over go with the next publish.
                return PublishResult(len(landed), cursor, head.version, list(landed)), True
            if cursor >= target and unsent.num_rows == 0:
                version = head.version if landed else None
                return PublishResult(len(landed), cursor, version, list(landed)), True
            # ``target`` was read from this thread's op snapshot: no newer one is needed.
            guard = head.txns.get(FOREIGN_OP_APP_ID, 0)
            end, batch, guard = self._next_chunk(
                self.table("op", latest=False), cursor, target, guard
            )
            streamed = isinstance(batch, LargeVersion)
            # A streamed version leaves the normal messages to a commit of their own.
            last = end >= target and not (streamed and unsent.num_rows)
            if last and not streamed:
                batch = pa.concat_tables([batch, unsent])
            # Catch up before writing, so that a publisher that lost the race writes no files.
            # The chunk was read for ``cursor``: the newer version may be written on only if
            # its cursor is the same (else the chunk would be published twice); offsets come
            # from it, and Delta's conflict check guards both against any later commit.
            read_version, head = head.version, self._commitlog_head(reload=False)
            if head.version != read_version and head.txns.get(OP_CURSOR_APP_ID, -1) != cursor:
                raise CommitFailedError("another publisher moved the op cursor")
            queues = self._per_queue(_QUEUE_APP_ID_PREFIX, head.txns)
            if streamed:
                stream, next_offsets, written = self._stream_offsets(batch, queues, end)
                batch = COMMITLOG_SCHEMA.empty_table()
            else:
                batch, next_offsets = self._assign_offsets(queues, batch)
                written = batch.num_rows
            app_ids = {queue_app_id(t, q): n for (t, q), n in next_offsets.items()}
            if end > cursor:
                app_ids[OP_CURSOR_APP_ID] = end
            if guard > head.txns.get(FOREIGN_OP_APP_ID, 0):
                app_ids[FOREIGN_OP_APP_ID] = guard
            uri, options = self.table_uri("commitlog"), self.settings.storage_options
            try:
                if streamed:
                    # Closed here: a write that stops early (a writer failed) stops the reader's
                    # helper thread now, not when the traceback that holds it is collected.
                    with closing(read_ahead(stream)) as ahead:
                        files = write_in_parallel(uri, ahead, *_COMMITLOG_FILES, options)
                else:
                    files = write_files(uri, iter([batch]), *_COMMITLOG_FILES, options)
                version = self._commit_files(
                    "commitlog",
                    files,
                    head.snapshot,
                    app_ids,
                    {"rmqtx.operation": "publish"},
                    after=head.version,
                )
            except (CommitFailedError, SchemaMismatchError, DeltaProtocolError, StoreError):
                raise  # nothing landed: a lost race (retried) or a bug (raised)
            except (DeltaError, OSError) as exc:
                unsure.append(exc)
                log.warning("publish failed without telling whether it landed (%s); checking", exc)
                raise _Unsure from exc
            self._after_commit("commitlog", version)
            normal_rows = batch.filter(pc.is_null(batch.column("transaction_id")))
            sent = list(
                zip(
                    normal_rows.column("msg_id").to_pylist(),
                    normal_rows.column("queue_id").to_pylist(),
                    normal_rows.column("queue_offset").to_pylist(),
                    strict=True,
                )
            )
            if streamed:
                log.info(
                    "published one large decision (op version %d): %s message(s) in commitlog "
                    "version %d",
                    end,
                    f"{written:,}",
                    version,
                )
            log.debug("published %d message(s) up to op version %d", written, end)
            result = PublishResult(written + len(landed), max(end, cursor), version, landed + sent)
            return result, last

        return retry_commits("publish", "commitlog", attempt)

    def _commitlog_head(self, *, reload: bool) -> _Head:
        """The CommitLog's latest version and application transactions, for a publish.

        A publisher commits to the CommitLog in every publish, and its snapshot update would
        list the CommitLog's whole log (kept 30 days) each time on a local filesystem. So,
        while the version this thread found last is younger than half of
        ``UNNEEDED_LOG_SECONDS`` (no entry after it can have been cleaned), the entries after
        it are read instead (:func:`follow`). A table change among them, ``reload`` (a retry),
        an older head, or a table that deltalake commits to (it needs the latest snapshot)
        loads the snapshot.
        """
        now = time.monotonic()
        head: _Head | None = getattr(self._heads, "commitlog", None)
        if not reload and head is not None and now - head.found < self._unneeded_log_seconds / 2:
            uri, options = self.table_uri("commitlog"), self.settings.storage_options
            followed = follow(uri, options, head.version, head.txns)
            if followed is not None:
                head = self._heads.commitlog = _Head(head.snapshot, *followed, now)
                return head
        snapshot = self.table("commitlog")
        head = _Head(snapshot, snapshot.version(), self._app_transactions(snapshot), now)
        direct = self._direct_interval("commitlog", snapshot) is not None
        self._heads.commitlog = head if direct else None
        return head

    def published_op_version(self, commitlog: DeltaTable | None = None) -> int:
        """The last ``op`` version published into a ``commitlog`` snapshot (default: the
        latest); -1 when nothing was ever published."""
        return self._app_transactions(commitlog or self.table("commitlog")).get(
            OP_CURSOR_APP_ID, -1
        )

    def _app_transactions(self, commitlog: DeltaTable) -> Mapping[str, int]:
        return app_transactions(
            commitlog, self.table_uri("commitlog"), self.settings.storage_options
        )

    def next_offsets(self, commitlog: DeltaTable | None = None) -> dict[tuple[str, int], int]:
        """The next offset of every queue that holds messages, ``{(topic, queue_id): offset}``.

        Read once per ``commitlog`` snapshot (see :mod:`rmq_spark.delta.txnlog`): the cost does not
        grow with the number of topics and queues.

        Parameters
        ----------
        commitlog : DeltaTable, optional
            The snapshot to read; defaults to the latest.
        """
        commitlog = commitlog or self.table("commitlog")
        return self._per_queue(_QUEUE_APP_ID_PREFIX, self._app_transactions(commitlog))

    def earliest_stored(self, commitlog: DeltaTable | None = None) -> dict[tuple[str, int], int]:
        """The earliest offset still stored of every queue retention has trimmed (absent: 0),
        read like :meth:`next_offsets`."""
        commitlog = commitlog or self.table("commitlog")
        return self._per_queue(_EARLIEST_APP_ID_PREFIX, self._app_transactions(commitlog))

    def _per_queue(self, prefix: str, txns: Mapping[str, int]) -> dict[tuple[str, int], int]:
        """``{(topic, queue_id): version}`` of the application ids ``prefix + topic.queue``
        among the CommitLog's application transactions ``txns``."""
        versions = {}
        for app_id, version in txns.items():
            if app_id.startswith(prefix):
                topic, queue_id = app_id[len(prefix) :].rsplit(".", 1)
                versions[(topic, int(queue_id))] = version
        return versions

    def _landed(self, rows: pa.Table) -> list[tuple[str, int, int]] | None:
        """``(msg_id, queue_id, queue_offset)`` of the normal messages ``rows`` if an earlier
        attempt put them into ``commitlog`` (in the order of ``rows``), else None."""
        ids = rows.column("msg_id").to_pylist()
        found = self._rows_by_id(self.data_files("commitlog"), "commitlog", ids, column="msg_id")
        if found.num_rows == 0:
            return None
        where = {
            r["msg_id"]: (r["queue_id"], r["queue_offset"])
            for r in found.select(["msg_id", "queue_id", "queue_offset"]).to_pylist()
        }
        if found.num_rows != len(ids) or len(where) != len(ids):
            raise CorruptStoreError(
                f"{found.num_rows} row(s) of one publish of {len(ids)} message(s) are in "
                "commitlog: one Delta commit landed in part, or a msg_id is stored twice."
            )
        return [(m, *where[m]) for m in ids]

    def _next_chunk(
        self, op: DeltaTable, cursor: int, target: int, guard: int
    ) -> tuple[int, pa.Table, int]:
        """The next chunk to publish: ``(end, rows, guard)``, the half messages of the
        transactions committed in ``op`` versions (cursor, end], in decision order, for the
        largest ``end <= target`` within the publish limits (but at least one version), and
        the :data:`FOREIGN_OP_APP_ID` to record (``guard``, or a newer foreign commit's time).

        Memory stays bounded: the change feed is read in growing windows of versions only until
        ``publish_max_messages`` committed transactions are found (each has one message or
        more), and only the half messages of those are read.
        """
        max_messages = self.settings.publish_max_messages
        decided, found, end, window = [], 0, cursor, 16
        while end < target and found < max_messages:
            stop = min(target, end + window)
            commits, foreign = self._commits_in(op, end + 1, stop)
            decided.append(commits)
            guard = max(guard, foreign)
            found += commits.num_rows
            end, window = stop, window * 2
        if not found:
            return end, COMMITLOG_SCHEMA.empty_table(), guard
        decisions = pa.concat_tables(decided)
        versions = decisions.column("_commit_version").to_numpy()
        if found > max_messages:
            end = _cut(versions, max_messages)
            decisions = decisions.filter(pa.array(versions <= end))
        decisions = self._not_published(decisions, guard)
        if not decisions.num_rows:
            return end, COMMITLOG_SCHEMA.empty_table(), guard
        txn_ids = decisions.column("transaction_id")
        halves = self._recent.take(txn_ids.to_pylist())
        if halves is None:
            # Cut the chunk before reading it, by what its transactions take in ``half`` (a
            # sink epoch has a whole task's rows in each): one version over the limits alone
            # is streamed instead of read whole.
            files = self.data_files("half")
            size, rows = stored_share(files, txn_ids, ["size_bytes", "num_records"])
            limits = self.settings.publish_max_bytes, max_messages
            versions = decisions.column("_commit_version").to_numpy()
            over = (np.cumsum(size) > limits[0]) | (np.cumsum(rows) > limits[1])
            if over.any():
                end = _cut(versions, int(np.argmax(over)))
                keep = versions <= end
                decisions = decisions.filter(pa.array(keep))
                txn_ids = decisions.column("transaction_id")
                if size[keep].sum() > limits[0] or rows[keep].sum() > limits[1]:
                    return end, LargeVersion(files, txn_ids), guard
            halves = self.half_messages(txn_ids.to_pylist(), files)
        # Decision order first, then send order: a transaction's rows are stored in one
        # append, in send order, and read back in file order.
        rank = pc.index_in(halves.column("transaction_id"), value_set=txn_ids).to_numpy()
        halves = _stable_sort(halves, rank)
        versions = decisions.column("_commit_version").to_numpy()[np.sort(rank)]
        sizes = pc.binary_length(halves.column("body")).to_numpy(zero_copy_only=False)
        over = (np.arange(1, len(versions) + 1) > max_messages) | (
            np.cumsum(sizes) > self.settings.publish_max_bytes
        )
        if over.any():
            end = _cut(versions, int(np.argmax(over)))
            halves = halves.slice(0, int(np.searchsorted(versions, end, side="right")))
        return end, _as_commitlog(halves, self.clock()), guard

    def _not_published(self, decisions: pa.Table, guard: int) -> pa.Table:
        """``decisions`` (``_COMMITTED`` rows) without the transactions made before ``guard``
        (:data:`FOREIGN_OP_APP_ID`) that ``commitlog`` already holds: decided again after
        another Delta writer removed their decisions, they are not published twice."""
        ids = decisions.column("transaction_id")
        older = pc.less(pc.utf8_slice_codeunits(ids, 0, _ID_MILLIS_DIGITS), f"{guard:012X}")
        suspects = pc.filter(ids, older).to_pylist() if guard else []
        again = self.published(suspects) if suspects else set()
        if not again:
            return decisions
        log.error(
            "%d transaction(s) decided again after another Delta writer changed op, e.g. %s, "
            "are in the CommitLog already: not published twice (see the README's Guarantees)",
            len(again),
            min(again),
        )
        return decisions.filter(pc.invert(pc.is_in(ids, value_set=pa.array(sorted(again)))))

    def _stream_offsets(
        self, version: LargeVersion, next_offsets: Mapping[tuple[str, int], int], op_version: int
    ) -> tuple[Iterator[pa.Table], dict[tuple[str, int], int], int]:
        """The committed messages of ``op_version``, too large to hold, as a stream of
        CommitLog rows with offsets after ``next_offsets``: ``(stream, the next offsets of the
        queues it moves, messages)``.

        A first pass reads only the routing columns to count each queue's messages (the commit
        names its queues' next offsets); the second reads the messages a batch at a time, and
        logs its progress every :data:`PROGRESS_SECONDS`.
        """
        options = self.settings.storage_options
        routing = read_files(
            version.uris,
            pa.schema([HALF_SCHEMA.field(c) for c in ("transaction_id", "topic", "queue_id")]),
            options,
            version.keep,
        )
        counts = routing.group_by(["topic", "queue_id"]).aggregate([("topic", "count")])
        moved = {
            (r["topic"], r["queue_id"]): next_offsets.get((r["topic"], r["queue_id"]), 0)
            + r["topic_count"]
            for r in counts.to_pylist()
        }
        now = self.clock()

        def stream() -> Iterator[pa.Table]:
            running = dict(next_offsets)
            copied, started = 0, time.monotonic()
            reported = started
            for rows in version.batches(options):
                rows, advanced = self._assign_offsets(running, _as_commitlog(rows, now))
                running.update(advanced)
                yield rows
                copied += rows.num_rows
                if time.monotonic() - reported >= PROGRESS_SECONDS:
                    reported = time.monotonic()
                    log.info(
                        "publishing one large decision (op version %d): %s of %s message(s) "
                        "copied into commitlog (%d%%, %.0f s)",
                        op_version,
                        f"{copied:,}",
                        f"{routing.num_rows:,}",
                        100 * copied // max(routing.num_rows, 1),
                        reported - started,
                    )
            if {k: running.get(k) for k in moved} != moved:
                raise CorruptStoreError(
                    "the half messages of one decision differ between two reads of the same "
                    "snapshot: a data file of half changed under the publisher."
                )

        return stream(), moved, routing.num_rows

    def _commits_in(self, op: DeltaTable, first: int, last: int) -> tuple[pa.Table, int]:
        """``(transaction_id, _commit_version)`` of the COMMITs recorded in ``op`` versions
        first..last, in decision order, and the commit time (ms) of the newest commit of
        another Delta writer among them (0 if none).

        Decision commits name their COMMITs in their ``commitInfo`` (:data:`COMMITS_KEY`), read
        from the log; the change feed is read only for decisions of an older rmq-spark (written
        by MERGE, :func:`_legacy_decisions`), or for the whole range when its log entries are
        gone. Only decisions the store wrote are published: a commit of another Delta writer
        (a RESTORE re-adding files a compaction replaced, which the change feed reports as
        inserts; a DELETE; an append) is logged and not applied.
        """
        try:
            infos = commit_infos(self.table_uri("op"), self.settings.storage_options, first, last)
        except LookupError:
            return _changed_commits(op, first, last), 0
        parts, foreign = [_COMMITTED.empty_table()], 0
        for version, info in infos.items():
            if COMMITS_KEY in info:
                ids = json.loads(info[COMMITS_KEY])
                parts.append(pa.table([ids, [version] * len(ids)], schema=_COMMITTED))
            elif _legacy_decisions(info):
                parts.append(_changed_commits(op, version, version))
            elif foreign_change(info):
                log.error(
                    "op version %d was not written by rmq-spark (%s by %s): its rows are not "
                    "published. Decisions it removed leave their transactions pending again "
                    "(check-back records those already published as committed again, and asks "
                    "about the others); undo it with RESTORE TABLE ... TO VERSION AS OF %d "
                    "(see the README's Guarantees)",
                    version,
                    info.get("operation", "an unnamed operation"),
                    info.get("engineInfo", "an unknown engine"),
                    version - 1,
                )
                made = int(info.get("timestamp") or time.time() * 1000)
                foreign = max(foreign, made + _CLOCK_SKEW_MILLIS)
        return pa.concat_tables(parts), foreign

    def half_messages(
        self, transaction_ids: Sequence[str], files: pa.Table | None = None
    ) -> pa.Table:
        """The half messages of the given transactions (``half`` schema).

        ``files``: the add actions of the latest ``half`` snapshot (:meth:`data_files`) when
        the caller has read them already.
        """
        if files is None:
            files = self.data_files("half")
        return _conform(self._rows_by_id(files, "half", transaction_ids), HALF_SCHEMA)

    def _rows_by_id(
        self,
        files: pa.Table,
        name: str,
        ids: Sequence[str],
        columns: Sequence[str] | None = None,
        column: str = "transaction_id",
    ) -> pa.Table:
        """Rows whose ``column`` (an id) is in ``ids``, in the snapshot of table ``name`` whose
        add actions are ``files`` (:func:`with_uris`), in file order; only ``columns`` (which
        hold ``column``) if given.

        Files whose statistics of ``column`` admit none of the ids are not read (ids are
        time-ordered, so a lookup reads few files). Partition columns are read as nulls.
        """
        wanted = sorted(set(ids))
        return read_files(
            admitting(files, wanted, column),
            TABLES[name][0],
            self.settings.storage_options,
            lambda rows: pc.is_in(rows.column(column), value_set=pa.array(wanted, pa.string())),
            columns,
        )

    def data_files(self, name: str) -> pa.Table:
        """The data files of a table's latest snapshot: Delta's add actions (path, size,
        partition values, per-column min/max) plus each file's ``uri``."""
        return with_uris(self.table(name), self.table_uri(name))

    def query(self, name: str, where: str) -> pa.Table:
        """Rows of one of the store's tables matching a SQL condition (DataFusion), in plain
        Arrow types. Quote values with :func:`sql_string`.

        Files are pruned by their column statistics; ids are time-ordered, so lookups by id
        read few files. (pyarrow dataset filters are not used: files written by deltalake's
        MERGE carry view types that pyarrow's statistics pruning cannot compare.)
        """
        return self.sql(name, f"SELECT * FROM {name} WHERE {where}")

    def read(self, name: str, columns: Sequence[str] | None = None) -> pa.Table:
        """One of the store's tables whole (or some of its columns), in plain Arrow types.

        Read through DataFusion, like :meth:`sql`: deltalake's ``to_pyarrow_table`` can abort
        the interpreter at exit on object stores, and the CLI's exit codes would lie.
        """
        chosen = ", ".join(f'"{c}"' for c in columns) if columns else "*"
        return self.sql(name, f"SELECT {chosen} FROM {name}")

    def sql(
        self,
        name: str,
        statement: str,
        *,
        version: int | None = None,
        table: DeltaTable | None = None,
    ) -> pa.Table:
        """Run a SQL ``statement`` (DataFusion) over one of the store's tables, registered
        under its name, in plain Arrow types.

        Parameters
        ----------
        name : str
            The table, as named in ``statement``.
        statement : str
            A SELECT; quote values with :func:`sql_string`.
        version : int, optional
            Read this version of the table instead of the latest.
        table : DeltaTable, optional
            Read this snapshot (a caller that commits on it next).
        """
        if table is None:
            table = (
                self.table(name)
                if version is None
                else DeltaTable(
                    self.table_uri(name), version=version, storage_options=self._storage_options
                )
            )
        return read_arrow(QueryBuilder().register(name, table).execute(statement))

    def _normal_rows(self, normal: Sequence[tuple[Message, str]]) -> pa.Table:
        now = self.clock()
        keys = [m.keys_string for m, _ in normal]
        return pa.Table.from_pydict(
            {
                "topic": [m.topic for m, _ in normal],
                "queue_id": [queue_for(k, self.settings.queue_nums) for k in keys],
                "queue_offset": [0] * len(normal),
                "msg_id": [new_id() for _ in normal],
                "transaction_id": [None] * len(normal),
                "producer_group": [g for _, g in normal],
                "keys": keys,
                "tags": [m.tags for m, _ in normal],
                "body": [m.body_bytes for m, _ in normal],
                "properties": [list(dict(m.properties).items()) for m, _ in normal],
                "born_timestamp": [now] * len(normal),
                "store_timestamp": [now] * len(normal),
            },
            schema=COMMITLOG_SCHEMA,
        )

    @staticmethod
    def _assign_offsets(
        next_offsets: Mapping[tuple[str, int], int], batch: pa.Table
    ) -> tuple[pa.Table, dict[tuple[str, int], int]]:
        """Give each row the next dense offset of its queue (``next_offsets``: the snapshot's);
        return the rows and the next offset of each queue they went to."""
        queues = batch.select(["topic", "queue_id"])
        offsets = np.zeros(batch.num_rows, dtype=np.int64)
        next_offset: dict[tuple[str, int], int] = {}
        for key in queues.group_by(["topic", "queue_id"]).aggregate([]).to_pylist():
            topic, queue_id = key["topic"], key["queue_id"]
            mine = pc.and_(
                pc.equal(queues.column("topic"), topic),
                pc.equal(queues.column("queue_id"), queue_id),
            )
            rows = np.flatnonzero(mine.to_numpy(zero_copy_only=False))
            start = next_offsets.get((topic, queue_id), 0)
            offsets[rows] = np.arange(start, start + len(rows))
            next_offset[(topic, queue_id)] = start + len(rows)
        batch = batch.set_column(
            batch.schema.get_field_index("queue_offset"),
            COMMITLOG_SCHEMA.field("queue_offset"),
            pa.array(offsets, pa.int64()),
        )
        return batch, next_offset

    # ------------------------------------------------------------------ normal send
    def send(self, messages: Sequence[Message], producer_group: str) -> PublishResult:
        """Send normal (non-transactional) messages: visible at once, in one commit."""
        check_group(producer_group)
        for message in messages:
            validate_message(message, self.settings.max_body_bytes)
        return self.publish([(m, producer_group) for m in messages])


def _reached(fs: fsspec.AbstractFileSystem, marker: str, root: str) -> bool:
    """Whether the store's marker exists; an object store that cannot be reached (no endpoint
    there, a refused connection, no DNS name) is a clear configuration error, not a
    traceback."""
    try:
        return fs.exists(marker)
    except Exception as exc:
        if not type(exc).__module__.startswith(("botocore", "aiobotocore", "aiohttp")):
            raise
        raise StorageConfigError(
            f"cannot reach the store at {root!r}: {exc}. Check the endpoint "
            "(AWS_ENDPOINT_URL in [store] storage_options or the environment), the network "
            "and the credentials."
        ) from exc


def with_uris(table: DeltaTable, base: str) -> pa.Table:
    """The add actions of a snapshot (flattened statistics) plus each file's ``uri`` under the
    table URI ``base``."""
    files = read_arrow(table.get_add_actions(flatten=True))
    # An add action's path is a relative, percent-encoded URI (Delta protocol).
    uris = [f"{base.rstrip('/')}/{unquote(p)}" for p in files.column("path").to_pylist()]
    return files.append_column("uri", pa.array(uris, pa.string()))


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
    return _conform(ordered, _COMMITTED)


#: The schema and partition column of CommitLog data files.
_COMMITLOG_FILES = (COMMITLOG_SCHEMA, "topic")

#: What :meth:`Store._commits_in` returns: COMMITted transactions and their ``op`` version.
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


def _as_commitlog(halves: pa.Table, now: datetime) -> pa.Table:
    """Half messages as CommitLog rows stored at ``now`` (offsets still to assign)."""
    columns = {
        name: halves.column(name) for name in COMMITLOG_SCHEMA.names if name in HALF_SCHEMA.names
    }
    columns["queue_offset"] = pa.repeat(pa.scalar(0, pa.int64()), halves.num_rows)
    columns["store_timestamp"] = pa.repeat(pa.scalar(now, TIMESTAMP), halves.num_rows)
    return pa.table(
        {name: columns[name] for name in COMMITLOG_SCHEMA.names}, schema=COMMITLOG_SCHEMA
    )


def _cut(versions: np.ndarray, first_over: int) -> int:
    """The last ``op`` version of a chunk whose rows (sorted by ``op`` version) go over the
    publish limits at row ``first_over``: the versions before that row's, or the first version
    whole when the row is in it."""
    over = int(versions[first_over])
    return over - 1 if over > versions[0] else over


#: Above this many runs of equal rank, _stable_sort copies rows instead of slicing runs.
_MAX_SLICED_RUNS = 64


def _stable_sort(rows: pa.Table, rank: np.ndarray) -> pa.Table:
    """``rows`` stably sorted by ``rank``. Runs of equal rank move as zero-copy slices (an
    epoch's few large transactions); many small runs are gathered into one chunk."""
    if len(rank) < 2 or bool(np.all(rank[:-1] <= rank[1:])):
        return rows
    starts = np.flatnonzero(np.r_[True, rank[1:] != rank[:-1]])
    if len(starts) > _MAX_SLICED_RUNS:
        # One chunk first: pyarrow's take over many chunks of large binaries is ~20x slower.
        return rows.combine_chunks().take(np.argsort(rank, kind="stable"))
    ends = np.r_[starts[1:], len(rank)]
    order = np.argsort(rank[starts], kind="stable")
    return pa.concat_tables([rows.slice(starts[i], ends[i] - starts[i]) for i in order])


def read_files(
    uris: Sequence[str],
    schema: pa.Schema,
    storage_options: Mapping[str, str],
    keep: Callable[[pa.Table], pa.ChunkedArray] | None = None,
    columns: Sequence[str] | None = None,
) -> pa.Table:
    """Read Parquet data files of a table directly with pyarrow (multi-threaded).

    Parameters
    ----------
    uris : sequence of str
        File URIs, as ``DeltaTable.file_uris()`` or :meth:`Store.data_files` give them.
    schema : pyarrow.Schema
        The files' schema (partition columns are not in the files).
    storage_options : mapping
        The store's ``storage_options`` (fsspec) for object stores.
    keep : callable, optional
        Returns a boolean mask of the rows to keep. The rows are copied only when some are
        dropped. (Not a dataset filter: files written by deltalake's MERGE carry view types,
        which pyarrow's statistics pruning cannot compare with plain literals.)
    columns : sequence of str, optional
        Read only these columns.
    """
    if columns is not None:
        schema = pa.schema([schema.field(c) for c in columns])
    if not uris:
        return schema.empty_table()
    paths = [fsspec.core.strip_protocol(uri) for uri in uris]
    dataset = pads.dataset(
        paths,
        schema=schema,
        format="parquet",
        filesystem=arrow_filesystem(uris[0], storage_options),
    )
    rows = dataset.to_table(columns=list(columns) if columns is not None else None)
    if keep is None:
        return rows
    mask = keep(rows)
    return rows if pc.all(mask).as_py() and not mask.null_count else rows.filter(mask)


def sql_string(value: str) -> str:
    """``value`` as a SQL string literal (for :meth:`Store.query` conditions)."""
    return "'" + value.replace("'", "''") + "'"


def sql_time(moment: datetime) -> str:
    """``moment`` as a SQL timestamp literal (for :meth:`Store.query` conditions)."""
    return f"TIMESTAMP '{moment.isoformat()}'"


def normalise_root(root: str) -> str:
    """A store root or table location as an absolute URI: absolute local paths for plain
    paths (so that every process resolves them alike); URIs are kept as given."""
    if "://" in root:
        return root
    return str(Path(root).expanduser().resolve())
