"""Application transactions of a Delta snapshot, read once per snapshot.

deltalake answers ``transaction_version(app_id)`` one application id at a time, and each
answer replays the log since the last checkpoint (about 2 ms per id one commit after a
checkpoint, 46 ms per id with 1,000 commits and no checkpoint, on a commitlog with 400 queue
ids). The CommitLog keeps one application id per queue, so asking for every queue cost topics x
queues x commits since the checkpoint. :func:`app_transactions` reads all of them at once: the
``txn`` column of the newest checkpoint at or before the snapshot plus the ``txn`` actions of the
JSON commits after it (Delta protocol: the last action for an ``appId`` wins). Results are
cached per table and version, and a newer version of a cached table reads only the commits in
between, so a caller polling an unchanged or slowly growing table pays for the new commits only.

Correctness does not rest on this read alone: a writer that assigns offsets from it commits on
the same snapshot with the same application ids, so Delta's conflict check refuses the commit
if another writer moved one of them in the meantime.

Only classic checkpoints (one file, or parts ``{v}.checkpoint.{i}.{n}.parquet``) are read, which
is what deltalake writes; a table using V2 checkpoints is refused with a clear error. Tables must
not set ``delta.setTransactionRetentionDuration``: expired application ids would reset offsets.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import datetime

import fsspec
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from fsspec.implementations.local import LocalFileSystem

from rmq_spark.delta.commit import CHECKPOINT_NAME as _CHECKPOINT
from rmq_spark.delta.commit import STAGED_NAME, parse_hint
from rmq_spark.delta.storage import filesystem
from rmq_spark.model.errors import CorruptStoreError

#: Read the commits since a cached version only when there are at most this many; else start
#: again from the newest checkpoint (which deltalake writes every 100 commits).
_MAX_INCREMENTAL_COMMITS = 200
#: No log cleanup of rmq-spark deletes a log entry younger than this (seconds, on the store's
#: clock): a reader that listed the log moments ago finds the entries it listed.
LOG_ENTRY_MIN_AGE = 4.0
#: What :func:`clean_log` may delete: commits, their checksums, and classic checkpoints.
_LOG_ENTRY = re.compile(r"^(\d{20})\.(?:json|crc|checkpoint(?:\.\d{10}\.\d{10})?\.parquet)$")

_cache: dict[tuple[str, str], tuple[int, dict[str, int]]] = {}
_cache_lock = threading.Lock()


def app_transactions(
    table: DeltaTable,
    uri: str,
    storage_options: Mapping[str, str],
    own: Mapping[int, bytes] | None = None,
) -> Mapping[str, int]:
    """Every application transaction of ``table``'s snapshot: ``{app_id: version}``.

    Parameters
    ----------
    table : DeltaTable
        The snapshot to read (its ``version()``); it is not updated.
    uri : str
        The table's URI (local absolute path or ``scheme://`` URI).
    storage_options : mapping
        fsspec options for object stores (the store's ``storage_options``).
    own : mapping, optional
        Log entries this process put (version: bytes), not read again.

    Returns
    -------
    Mapping of str to int
        The same answers as ``table.transaction_version(app_id)`` for every ``app_id`` the
        snapshot knows. Read-only: it is shared by every caller of the same snapshot.

    Raises
    ------
    CorruptStoreError
        A commit or checkpoint the snapshot needs is missing, unreadable or of a kind this
        reader does not know.
    """
    version = table.version()
    uri = uri.rstrip("/")
    key = (uri, table.metadata().id)  # a table made again at the same place starts afresh
    with _cache_lock:
        cached = _cache.get(key)
    if cached is not None and cached[0] == version:
        return cached[1]
    fs, log_path = filesystem(f"{uri}/_delta_log", storage_options)
    txns = None
    if cached is not None and cached[0] < version <= cached[0] + _MAX_INCREMENTAL_COMMITS:
        try:
            txns = _apply_commits(fs, log_path, dict(cached[1]), cached[0] + 1, version, own)
        except _MissingCommit:
            pass  # cleaned up since: a checkpoint covers it
    if txns is None:
        interval = int(table.metadata().configuration.get("delta.checkpointInterval", 100))
        checkpoint, files = _checkpoint_at_or_before(fs, log_path, version, interval)
        txns = _read_checkpoint(fs, files) if files else {}
        try:
            txns = _apply_commits(fs, log_path, txns, checkpoint + 1, version, own)
        except _MissingCommit as exc:
            raise CorruptStoreError(
                f"the Delta log commit {exc.path!r} is missing ({exc.error!r}); "
                "the table's log is damaged (or was cleaned up under a reader)."
            ) from exc
    with _cache_lock:
        newest = _cache.get(key)
        if newest is None or newest[0] < version:
            _cache[key] = (version, txns)
    return txns


def follow(
    uri: str,
    storage_options: Mapping[str, str],
    version: int,
    txns: Mapping[str, int],
    infos: dict[int, dict] | None = None,
    own: Mapping[int, bytes] | None = None,
) -> tuple[int, Mapping[str, int]] | None:
    """The latest version of a table and its application transactions, ``(version, txns)``,
    from a version the caller knows and its ``txns``: the log entries after it are read one
    by one until the first that does not exist. No listing: on a local filesystem deltalake
    lists the whole log to bring a snapshot up to date, and the CommitLog keeps its log for
    Delta's 30 days (about 100 ms a snapshot update at 3,000 entries). The ``commitInfo`` of
    each entry read goes into ``infos`` (by version), if given. The entries in ``own``
    (version: the entry this process put) are not read again.

    Returns None when one of those entries changes the table (``metaData`` or ``protocol``):
    load a snapshot instead. The caller must know that no entry after ``version`` can have
    been cleaned since: that ``version`` was the latest a short while ago (entries are kept
    for at least ``UNNEEDED_LOG_SECONDS``; a commit on the result checks every entry after it
    and that it is reachable itself), or that the ``_last_checkpoint`` hint names no later
    version (:meth:`rmq_spark.delta.tables.DeltaTables.latest_version`).
    """
    fs, log_path = filesystem(f"{uri.rstrip('/')}/_delta_log", storage_options)
    followed: dict[str, int] | None = None
    own = own or {}
    while True:
        content = own.get(version + 1)
        try:
            content = content or fs.cat_file(f"{log_path}/{version + 1:020d}.json")
        except FileNotFoundError:
            return version, txns if followed is None else followed
        for line in content.splitlines():
            if b'"metaData"' in line or b'"protocol"' in line or b'"txn"' in line:
                action = json.loads(line)
                if "metaData" in action or "protocol" in action:
                    return None
                if "txn" in action:
                    followed = dict(txns) if followed is None else followed
                    followed[action["txn"]["appId"]] = int(action["txn"]["version"])
        version += 1
        if infos is not None:
            infos[version] = _commit_info(content)


#: Reader features that change nothing for a reader of the data files as they are.
_HARMLESS_READER_FEATURES = frozenset({"vacuumProtocolCheck"})


def check_readable(table: DeltaTable, uri: str) -> None:
    """Refuse a table whose reader protocol asks for what rmq-spark's readers do not apply.

    rmq-spark reads the data files an add action names, whole. A table with deletion vectors
    (a delta-spark DELETE, UPDATE or MERGE once ``delta.enableDeletionVectors`` is set) has
    rows those files still hold but the table does not, and column mapping renames what the
    files store: reading them as they are would deliver messages that were deleted.

    Raises
    ------
    CorruptStoreError
        Naming the features and how to bring the table back to what rmq-spark reads.
    """
    protocol = table.protocol()
    features = set(protocol.reader_features or ()) - _HARMLESS_READER_FEATURES
    if protocol.min_reader_version < 2 or (protocol.min_reader_version == 3 and not features):
        return
    named = ", ".join(sorted(features)) or f"reader version {protocol.min_reader_version}"
    raise CorruptStoreError(
        f"the table at {uri} needs a reader that applies {named}, which rmq-spark's readers do "
        "not: another Delta writer changed it (for example delta.enableDeletionVectors and a "
        "DELETE). Reading its files as they are would deliver deleted rows. Rewrite it without "
        f"them (REORG TABLE delta.`{uri}` APPLY (PURGE), then ALTER TABLE delta.`{uri}` DROP "
        "FEATURE deletionVectors), or RESTORE it to a version before the change; messages "
        "removed are then reported as data loss."
    )


class _MissingCommit(LookupError):
    """A commit file of the log is not there."""

    def __init__(self, path: str, error: object) -> None:
        super().__init__(path)
        self.path, self.error = path, error


def _apply_commits(
    fs: fsspec.AbstractFileSystem,
    log_path: str,
    txns: dict[str, int],
    first: int,
    last: int,
    own: Mapping[int, bytes] | None = None,
) -> dict[str, int]:
    """``txns`` updated with the ``txn`` actions of commits ``first..last``."""
    for content in _commits(fs, log_path, first, last, own).values():
        # In version order: the last action for an app id wins.
        for line in content.splitlines():
            if b'"txn"' in line:
                action = json.loads(line).get("txn")
                if action is not None:
                    txns[action["appId"]] = int(action["version"])
    return txns


def _checkpoint_at_or_before(
    fs: fsspec.AbstractFileSystem, log_path: str, version: int, interval: int
) -> tuple[int, list[str]]:
    """The newest complete classic checkpoint at or before ``version``: (its version, its files),
    or (-1, []) when there is none. ``interval``: the table's checkpoint interval."""
    try:
        hint = json.loads(fs.cat_file(f"{log_path}/_last_checkpoint"))
    except (FileNotFoundError, ValueError):
        hint = None
    if hint is not None and "v2Checkpoint" in hint:
        raise CorruptStoreError(
            f"the Delta table at {log_path!r} uses V2 checkpoints, which rmq-spark does not read; "
            "its tables are written by rmq-spark (deltalake) with classic checkpoints only."
        )
    if hint is not None and int(hint["version"]) <= version:
        found = int(hint["version"])
        parts = int(hint.get("parts") or 0)
        if not parts:
            return found, [f"{log_path}/{found:020d}.checkpoint.parquet"]
        return found, [
            f"{log_path}/{found:020d}.checkpoint.{i:010d}.{parts:010d}.parquet"
            for i in range(1, parts + 1)
        ]
    # A writer checkpointed past this snapshot since it was loaded (or there is no hint). The
    # checkpoint written last before it is the likely one; listing the log, which can hold
    # many commits, is the last resort.
    guess = checkpoint_guess(version, interval)
    if guess > 0 and fs.exists(f"{log_path}/{guess:020d}.checkpoint.parquet"):
        return guess, [f"{log_path}/{guess:020d}.checkpoint.parquet"]
    complete: dict[int, list[str]] = {}
    parts_seen: dict[tuple[int, int], list[str]] = {}
    for path in fs.ls(log_path, detail=False):
        match = _CHECKPOINT.match(path.rsplit("/", 1)[-1])
        if match is None or int(match.group(1)) > version:
            continue
        found = int(match.group(1))
        if match.group(2) is None:
            complete[found] = [path]
        else:
            parts_seen.setdefault((found, int(match.group(3))), []).append(path)
    for (found, parts), paths in parts_seen.items():
        if len(paths) == parts:
            complete.setdefault(found, sorted(paths))
    if not complete:
        return -1, []
    newest = max(complete)
    return newest, complete[newest]


def checkpoint_guess(version: int, interval: int) -> int:
    """The version of the newest checkpoint at or before ``version`` of a table checkpointed
    every ``interval`` commits: the commit whose version is a multiple of the interval is
    checkpointed (deltalake's post-commit hook, and :func:`rmq_spark.delta.commit.checkpoint`)."""
    return version // interval * interval


def _read_checkpoint(fs: fsspec.AbstractFileSystem, files: list[str]) -> dict[str, int]:
    """The ``txn`` actions of a checkpoint. Each part is read whole, in one request: a part
    that is not there or not a checkpoint is a damaged log, a read the store refused is raised
    as the store answered."""
    txns: dict[str, int] = {}
    for path in files:
        try:
            data = fs.cat_file(path)  # a refusal or a lost connection is raised as it is
            column = _txn_column(data)
        except (FileNotFoundError, KeyError, ValueError, pa.ArrowException) as exc:
            raise CorruptStoreError(
                f"the Delta checkpoint {path!r} is missing or unreadable ({exc})."
            ) from exc
        column = column.drop_null()
        for app_id, version in zip(
            pc.struct_field(column, "appId").to_pylist(),
            pc.struct_field(column, "version").to_pylist(),
            strict=True,
        ):
            txns[app_id] = int(version)
    return txns


def _txn_column(data: bytes) -> pa.ChunkedArray:
    """The ``txn`` column of a checkpoint part's bytes (:class:`pyarrow.ArrowException` when
    they are not a checkpoint)."""
    try:
        return pq.read_table(pa.BufferReader(data), columns=["txn"]).column("txn")
    except OSError as exc:  # from bytes in memory: a parquet file's damage, not a read's
        raise pa.ArrowInvalid(str(exc)) from exc


def _commits(
    fs: fsspec.AbstractFileSystem,
    log_path: str,
    first: int,
    last: int,
    own: Mapping[int, bytes] | None = None,
) -> dict[int, bytes]:
    """The JSON of commits ``first..last``, by version in order; :class:`_MissingCommit` for
    one that is not there. Any other failure to read one (refused, throttled past the retries,
    a connection lost) is raised as it is: the log is whole, the store did not answer."""
    own = own or {}
    paths = {v: f"{log_path}/{v:020d}.json" for v in range(first, last + 1)}
    unknown = [p for v, p in paths.items() if v not in own]
    contents = fs.cat(unknown, on_error="return") if unknown else {}
    found = {}
    for version, path in paths.items():
        content = own.get(version, contents.get(path))
        if isinstance(content, Exception) and not isinstance(content, FileNotFoundError):
            raise content
        if not isinstance(content, bytes):
            raise _MissingCommit(path, content)
        found[version] = content
    return found


def commit_infos(
    uri: str,
    storage_options: Mapping[str, str],
    first: int,
    last: int,
    own: Mapping[int, bytes] | None = None,
) -> dict[int, dict]:
    """The ``commitInfo`` action of each commit ``first..last`` of a table (an empty dict for
    a commit without one); the entries in ``own`` (version: the entry this process put) are
    not read.

    Raises
    ------
    LookupError
        A commit's JSON is gone (cleaned up after the log retention).
    """
    fs, log_path = filesystem(f"{uri.rstrip('/')}/_delta_log", storage_options)
    return {
        version: _commit_info(content)
        for version, content in _commits(fs, log_path, first, last, own).items()
    }


def _commit_info(content: bytes) -> dict:
    """The ``commitInfo`` action of a commit's JSON (empty if it has none)."""
    return next(
        (
            json.loads(line)["commitInfo"]
            for line in content.splitlines()
            if line.startswith(b'{"commitInfo"')
        ),
        {},
    )


#: How many files of a log one cleanup deletes at once, oldest first: S3's DeleteObjects
#: takes up to 1,000 keys a request.
_DELETED_AT_ONCE = 1000


def clean_log(
    uri: str, storage_options: Mapping[str, str], rules: Sequence[tuple[int, datetime]]
) -> int:
    """Delete the log entries that no reader of version ``keep_from`` or later needs, for any
    ``(keep_from, older_than)`` of ``rules``: the commits, checksums and checkpoints of the
    versions before the newest complete checkpoint at or before ``keep_from``, when they were
    written before ``older_than``. The log is listed once. Return how many files were deleted.

    This is Delta's expired-log cleanup (``delta.logRetentionDuration``), bounded by a version
    as well as by time. Only the oldest versions go, oldest first (:data:`_DELETED_AT_ONCE` a
    request on S3, where a DELETE an entry cost a request a commit), up to the first that must
    stay (or a gap in the listing), as Delta's own cleanup does: an entry is taken as written
    no earlier than the one before it, since its file time can be far older than its commit (a
    local entry keeps the time it was staged, before a writer's stall). So an entry kept keeps
    every later one. Within a batch S3 deletes in no order, and it does not report a key it
    refused (s3fs asks for quiet answers), so a cleanup can leave gaps, all below the hint's
    checkpoint (see below), where a commit's reachability check (:meth:`_Log.reachable`) finds
    a put by the hint alone; each next cleanup goes on from the oldest entry left. Whatever
    the rules, and however far ahead the caller's clock runs, no
    entry younger than :data:`LOG_ENTRY_MIN_AGE` on the store's clock
    goes (the modification time of a file written for it first, :func:`store_time`; the
    cleaning host's clock, local or shared by NFS, can be anything). A filesystem that gives no
    modification time (it cannot tell the age) has nothing deleted. Staged entries a killed
    direct commit left behind (:data:`rmq_spark.delta.commit.STAGED_NAME`) go when older than
    every rule's time. Nothing at or after the checkpoint the ``_last_checkpoint`` hint names
    goes either (nothing at all without a readable hint): a hint that lags a newer checkpoint
    (its writer died between the two PUTs) is where rmq-spark's readers and a commit's
    reachability check start, and they must find the log whole from there.
    """
    fs, log_path = filesystem(f"{uri.rstrip('/')}/_delta_log", storage_options)
    store_now = store_time(fs, log_path)
    files: dict[int, list[tuple[str, float | None]]] = {}
    checkpoints: dict[int, list[str]] = {}
    staged_before = min(older_than for _, older_than in rules).timestamp()
    abandoned = []
    for path, when in _log_files(fs, log_path):
        name = path.rsplit("/", 1)[-1]
        if STAGED_NAME.match(name) is not None:
            if (when() or staged_before) < staged_before:
                abandoned.append(path)
        if _LOG_ENTRY.match(name) is None:
            continue
        version = int(name[:20])
        files.setdefault(version, []).append((path, when))
        match = _CHECKPOINT.match(name)
        if match is not None:
            checkpoints.setdefault(version, []).append(match.group(3))
    complete = sorted(
        v for v, parts in checkpoints.items() if parts == [None] or len(parts) == int(parts[0])
    )
    # Per rule: entries before this version (the newest checkpoint at or before keep_from
    # and the hint) go when written before this time.
    hint = hint_version(fs, log_path)
    bounds = [
        (max((v for v in complete if v <= min(keep_from, hint)), default=-1), cut.timestamp())
        for keep_from, cut in rules
    ]
    doomed = []
    written = float("-inf")
    for version in sorted(files):
        if doomed and version != doomed[-1][0] + 1:
            break  # a gap (a listing that raced a commit or another cleanup): stop here
        times = [when() for _, when in files[version]]
        if store_now is None or None in times:
            break
        # Delta's own cleanup takes each entry as written no earlier than the one before it:
        # a file time is its staging's, so a stalled writer's entry looks old as it lands.
        written = max(written, *times)  # type: ignore[type-var]
        if store_now - written < LOG_ENTRY_MIN_AGE or not any(
            version < kept and written < cut for kept, cut in bounds
        ):
            break
        doomed += [(version, path) for path, _ in files[version]]
    paths = [p for _, p in doomed] + abandoned
    for first in range(0, len(paths), _DELETED_AT_ONCE):  # one batch after the other
        fs.rm(paths[first : first + _DELETED_AT_ONCE])
    return len(paths)


def _log_files(
    fs: fsspec.AbstractFileSystem, log_path: str
) -> Iterator[tuple[str, Callable[[], float | None]]]:
    """Each file of a log (its path) and how to learn its modification time: from the listing
    on an object store; on a local filesystem from a stat made when asked (None: the file went
    meanwhile). A listing with details stats every entry, about 20 us each: a cleanup every 100
    commits of a busy table looked at thousands (the ten seconds of entries it keeps) to delete
    its oldest few, a fifth of a single sender's CPU."""
    if isinstance(fs, LocalFileSystem):
        with os.scandir(log_path) as entries:
            for entry in entries:
                yield entry.path, functools.partial(_stat_time, entry)
        return
    for info in fs.ls(log_path, detail=True):
        yield info["name"], functools.partial(modified, info)


def _stat_time(entry: os.DirEntry) -> float | None:
    try:
        return entry.stat().st_mtime
    except FileNotFoundError:
        return None


def hint_version(fs: fsspec.AbstractFileSystem, log_path: str) -> int:
    """The version the ``_last_checkpoint`` hint names (-1: none, or unreadable)."""
    hint_path = f"{log_path}/_last_checkpoint"
    return parse_hint(fs.cat([hint_path], on_error="return").get(hint_path))


def store_time(fs: fsspec.AbstractFileSystem, log_path: str) -> float | None:
    """Now on the store's clock: the modification time of an empty file written in the log
    for it, then deleted (named as a staged entry: one a crash leaves behind goes with the
    cleanup); None when the filesystem gives none."""
    probe = f"{log_path}/.{uuid.uuid4().hex}.json.tmp"
    fs.pipe_file(probe, b"")
    try:
        return modified(fs.info(probe))
    finally:
        fs.rm_file(probe)


def entry_times(uri: str, storage_options: Mapping[str, str], first: int) -> dict[int, float]:
    """When each commit of a table from version ``first`` on was written, on the store's clock:
    its log entry's modification time (epoch seconds), from one listing of the log. Commits
    whose time the filesystem does not give are absent."""
    fs, log_path = filesystem(f"{uri.rstrip('/')}/_delta_log", storage_options)
    fs.invalidate_cache(log_path)
    times = {}
    for info in fs.ls(log_path, detail=True):
        name = info["name"].rsplit("/", 1)[-1]
        if name.endswith(".json") and name[:20].isdigit() and int(name[:20]) >= first:
            written = modified(info)
            if written is not None:
                times[int(name[:20])] = written
    return times


def modified(info: Mapping[str, object]) -> float | None:
    """A listing entry's modification time (epoch seconds), as the filesystems spell it."""
    for key in ("mtime", "LastModified", "last_modified", "updated"):
        value = info.get(key)
        if isinstance(value, int | float):
            return float(value)
        if isinstance(value, datetime):
            return value.timestamp()
        if isinstance(value, str):
            try:
                return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
            except ValueError:
                return None
    return None
