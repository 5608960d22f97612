"""Appends committed by writing their Delta log entry directly.

A producer's send waits for one commit of ``half``. deltalake spends 6 to 8 ms on a commit of
one small file, most of it outside the commit itself: it lists the whole ``_delta_log``
several times (about 8.5 us an entry on a local filesystem), replays the snapshot and runs
its post-commit hooks. Writing the file with pyarrow and the log entry here costs about 1 ms.

This is the Delta protocol's optimistic commit for appends. The data files are written first,
invisible. The log entry ``{version:020}.json`` is then written only if absent: a hard link
of a complete file on a local filesystem, a PUT with ``If-None-Match: *`` on S3, so a reader
never sees a partial entry and two writers never both take a version. When another writer
took the version, its entry is read:

* a ``metaData`` or ``protocol`` action conflicts (the table changed under this commit), and
  so does a ``txn`` action for one of the application ids this commit records (Delta's
  ``ConcurrentTransactionException``: first decision wins, offsets stay dense);
* anything else (appends, compactions, deletes) does not conflict with an append, and the
  next version is tried. A compaction (``removes``) conflicts besides with a commit that
  removed one of the files it rewrites.

A commit that rewrites the table as of the version it read (``exclusive``: the locks,
:mod:`rmq_spark.store.locks`) conflicts with every commit after that version.

A conflict raises ``CommitFailedError``: nothing landed, and ``Store``'s retry starts again
from the latest snapshot. So does an entry gone before it could be read.

A put only if absent is sound only while no entry at or after its version can have been
deleted. A writer whose base version is old (a stale snapshot; a GC or swap stall, a paused VM
between reading the log and putting) can find that others committed past a checkpoint and
the log cleanup deleted the entries below it: its put then succeeds in the cleaned hole, below
the checkpoint every reader starts from. So after the put the commit confirms it is
reachable (:meth:`_Log.reachable`: no checkpoint at or after it, and the entry before it still
there) and otherwise counts as lost:
``CommitFailedError``, retried at the table's head. The stray entry is unreachable; the log
cleanup deletes it with the others below the checkpoint. (A retried append adds the same files,
which Delta reconciles by path; decisions and publishes record application ids, which conflict.)

That check costs a round trip, and it is made after every put. A commit that went on from its
own commit of moments before once skipped it, trusting that no log cleanup deletes an entry
younger than a few seconds on the store's clock; but a local log entry is a hard link of a
file staged earlier and keeps the staging time, an S3 object keeps the time its PUT began, and
a writer may stall for minutes in between, so a stalled writer's entry looked old the moment
it landed, was cleaned, and the next put filled its version below the checkpoint (an
acknowledged send lost). No file time proves a put reachable; the check does.

The commit that reaches the table's ``delta.checkpointInterval`` is followed by the
checkpoint and the expired-log cleanup, as deltalake's post-commit hook does
(:mod:`rmq_spark.delta.checkpoints`). Tables on filesystems other
than local and S3 are committed by deltalake; tables that need more of a writer than Parquet
files with statistics (column mapping, row tracking, CHECK constraints...) are refused, by
either path: :func:`appendable`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from typing import Any
from urllib.parse import unquote

import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable
from deltalake.exceptions import CommitFailedError
from deltalake.transaction import AddAction

from rmq_spark._version import __version__
from rmq_spark.delta.removals import listed_records, read_records
from rmq_spark.delta.storage import filesystem, is_s3, scheme
from rmq_spark.model.errors import StoreError
from rmq_spark.model.failpoints import failpoint

log_ = logging.getLogger(__name__)

#: Writer features an append of Parquet files with statistics satisfies by itself (the
#: features of writer versions 2 to 4 are checked further by :func:`appendable`).
APPEND_FEATURES = frozenset(
    {"appendOnly", "invariants", "checkConstraints", "changeDataFeed", "generatedColumns"}
)
#: The name of a staged log entry or checkpoint in ``_delta_log`` (hidden: Delta readers skip
#: it).
STAGED_NAME = re.compile(r"^\.[0-9a-f]{32}\.(?:json|checkpoint\.parquet)\.tmp$")
#: A commit's log entry.
ENTRY_NAME = re.compile(r"^\d{20}\.json$")
#: A classic checkpoint file (one file, or part ``i`` of ``n``) of version ``group(1)``.
CHECKPOINT_NAME = re.compile(r"^(\d{20})\.checkpoint(?:\.(\d{10})\.(\d{10}))?\.parquet$")
#: Actions of a concurrent commit that conflict with any append.
_TABLE_CHANGES = ("metaData", "protocol")


def appendable(table: DeltaTable) -> bool:
    """Whether :func:`commit` appends to ``table``: True on a local filesystem or S3 (where
    writes only if absent are known to hold), False elsewhere (deltalake commits there).

    Raises
    ------
    StoreError
        When the table asks more of a writer than Parquet files with statistics: column
        mapping, row tracking or another writer feature, a CHECK constraint, an invariant or
        a generated column. No writer of rmq-spark enforces those (files written ahead of
        their commit cannot be checked by deltalake either); the store's tables are not to
        be altered.
    """
    protocol = table.protocol()
    unsupported = sorted(set(protocol.writer_features or ()) - APPEND_FEATURES)
    if protocol.min_reader_version > 1 or (
        protocol.min_writer_version > 4 and protocol.writer_features is None
    ):
        unsupported.append(f"protocol {protocol.min_reader_version}/{protocol.min_writer_version}")
    unsupported += [
        f"{key} on column {f.name}"
        for f in table.schema().fields
        for key in ("delta.invariants", "delta.generationExpression")
        if key in f.metadata
    ]
    unsupported += [k for k in table.metadata().configuration if k.startswith("delta.constraints.")]
    if unsupported:
        raise StoreError(
            f"the table at {table.table_uri} asks more of a writer than rmq-spark does "
            f"({', '.join(unsupported)}); its tables must not be altered. Undo the change "
            "(for example ALTER TABLE ... DROP CONSTRAINT) or restore the store."
        )
    return scheme(table.table_uri) == "file" or is_s3(table.table_uri)


def checkpoint_interval(table: DeltaTable) -> int:
    """The table's ``delta.checkpointInterval`` (Delta's default: 100)."""
    return int(table.metadata().configuration.get("delta.checkpointInterval", "100"))


def commit(
    uri: str,
    storage_options: Mapping[str, str],
    after: int,
    adds: Sequence[AddAction],
    *,
    app_ids: Mapping[str, int] | None = None,
    info: Mapping[str, str] | None = None,
    removes: Sequence[Mapping[str, object]] = (),
    landed: Callable[[int, bytes], None] | None = None,
    exclusive: bool = False,
) -> int:
    """Commit ``adds`` as one append to the table at ``uri`` whose latest known version is
    ``after``, or with ``removes`` as a compaction; return the version committed.

    Parameters
    ----------
    uri : str
        The table's URI (local path or ``s3://``).
    storage_options : mapping
        The store's storage options.
    after : int
        A version of the table the caller knows; the commit takes the first free version
        after it that no conflicting commit precedes.
    adds : sequence of AddAction
        The data files, already written.
    app_ids : mapping, optional
        Application transactions (``appId`` to version) recorded with the commit; a
        concurrent commit recording one of them conflicts.
    info : mapping, optional
        Extra ``commitInfo`` fields (deltalake's ``custom_metadata``).
    removes : sequence of mapping, optional
        Files (add actions: ``path``, ``size``, ``partition_values``) that ``adds`` rewrite:
        without changing data when no add changes data (a compaction: every action has
        ``dataChange`` false). A concurrent commit that removed one of them first conflicts.
    landed : callable, optional
        Told ``(version, entry)``, the log entry's bytes, once the commit is known reachable.
    exclusive : bool, default False
        The commit rewrites the table as of ``after`` (Delta's serializable overwrite): any
        commit after ``after`` conflicts.

    Raises
    ------
    CommitFailedError
        Nothing landed: a conflicting commit came first, or the log after ``after`` was
        cleaned. Retry from the latest snapshot.
    """
    log = _Log(uri, storage_options)
    now = int(time.time() * 1000)
    ours = dict(app_ids or {})
    rewritten = {str(r["path"]) for r in removes}
    changes = any(a.data_change for a in adds)
    compaction = bool(removes) and not changes
    lines = [
        {
            "commitInfo": {
                "timestamp": now,
                "operation": "OPTIMIZE" if compaction else "WRITE",
                "operationParameters": (
                    {}
                    if compaction
                    else {"mode": "Overwrite" if removes or exclusive else "Append"}
                ),
                "isBlindAppend": not ours and not removes and not exclusive,
                "engineInfo": f"rmq-spark/{__version__}",
                "clientVersion": f"rmq-spark-{__version__}",
                **(info or {}),
            }
        },
        *({"txn": {"appId": a, "version": v, "lastUpdated": now}} for a, v in ours.items()),
        *({"remove": _remove(r, now, changes)} for r in removes),
        *({"add": _add(a)} for a in adds),
    ]
    entry = "\n".join(json.dumps(line, separators=(",", ":")) for line in lines).encode()
    version = after + 1
    with log.staged(entry) as put:
        failpoint("deltacommit.staged")
        while not put(version):
            if exclusive:  # whatever took it conflicts: nothing to read
                raise CommitFailedError(f"version {version} of {uri} was taken after {after}")
            taken = log.taken_from(version)
            for v in sorted(taken):
                _check_no_conflict(taken[v], ours, rewritten, uri, v)
            version = max(taken) + 1
        failpoint("deltacommit.committed")
    if not log.reachable(version, [a.path for a in adds]):
        log_.warning(
            "a commit to %s put version %d where the log had been cleaned (it stalled past a "
            "checkpoint and the log cleanup); no reader sees it, so it is made again",
            uri,
            version,
        )
        raise CommitFailedError(
            f"version {version} of {uri} was put below a newer checkpoint, where the log had "
            "been cleaned: no reader would see it"
        )
    if landed is not None:
        landed(version, entry)
    return version


def _add(action: AddAction) -> dict[str, object]:
    fields = asdict(action)
    return {
        "path": fields["path"],
        "partitionValues": dict(fields["partition_values"]),
        "size": fields["size"],
        "modificationTime": fields["modification_time"],
        "dataChange": fields["data_change"],
        "stats": fields["stats"],
    }


def _remove(file: Mapping[str, object], now: int, data_change: bool) -> dict[str, object]:
    return {
        "path": file["path"],
        "deletionTimestamp": now,
        "dataChange": data_change,
        "extendedFileMetadata": True,
        "partitionValues": dict(file.get("partition_values") or {}),  # type: ignore[call-overload]
        "size": file["size"],
    }


def _check_no_conflict(
    entry: bytes, ours: Mapping[str, int], rewritten: set[str], uri: str, version: int
) -> None:
    for line in entry.splitlines():
        if not line.strip():
            continue
        action = json.loads(line)
        changed = next((k for k in _TABLE_CHANGES if k in action), None)
        if changed is not None:
            raise CommitFailedError(f"version {version} of {uri} changed the table ({changed})")
        removed = action.get("remove")
        if removed is not None and removed.get("path") in rewritten:
            raise CommitFailedError(f"version {version} of {uri} removed {removed['path']!r} first")
        txn = action.get("txn")
        if txn is not None and txn.get("appId") in ours:
            raise CommitFailedError(
                f"version {version} of {uri} recorded application id {txn['appId']!r} first"
            )


class _Log:
    """The ``_delta_log`` directory of one table: entries read, tested and written only if
    absent."""

    def __init__(self, uri: str, storage_options: Mapping[str, str]) -> None:
        self.local = scheme(uri) == "file"
        self.fs, path = filesystem(uri, storage_options)
        self.path = f"{path.rstrip('/')}/_delta_log"

    def name(self, version: int) -> str:
        return f"{self.path}/{version:020d}.json"

    def read(self, version: int) -> bytes:
        try:
            return self.fs.cat_file(self.name(version))
        except FileNotFoundError as exc:
            raise CommitFailedError(
                f"log entry {version} was cleaned before this commit could check it"
            ) from exc

    def taken_from(self, version: int) -> dict[int, bytes]:
        """The entries of ``version`` (found taken) and of the versions after it taken too.

        On a local filesystem only ``version``'s: the next put finds the next. On an object
        store a writer whose head is old (others committed meanwhile, as the publishers of a
        store's shards into its one CommitLog do) would spend two round trips a version
        catching up; instead one listing finds the entries after ``version`` and one round
        of GETs at once reads them all."""
        if self.local:
            return {version: self.read(version)}
        after = sorted(
            int(name[:20])
            for name in s3_names_from(self.fs, self.path, version + 1)
            if ENTRY_NAME.match(name) is not None
        )
        versions = [version]
        for v in after:
            if v != versions[-1] + 1:
                break
            versions.append(v)
        found = self.fs.cat([self.name(v) for v in versions], on_error="return")
        taken = {}
        for v in versions:
            data = found.get(self.name(v))
            if not isinstance(data, bytes):
                if v == version:
                    return {version: self.read(version)}  # not listed yet: read alone
                break
            taken[v] = data
        return taken

    def staged(self, entry: bytes) -> _Staged:
        return _Staged(self, entry)

    def reachable(self, version: int, paths: Sequence[str]) -> bool:
        """Whether readers reach the entry just put at ``version``, which adds the files
        ``paths``.

        A checkpoint at or after it (the ``_last_checkpoint`` hint, or when the entry before
        it is gone a listing, shows one) is where readers start. A put in a cleaned hole came
        after that checkpoint, which holds the table without these files. A put that landed
        in order and stalled before this check is in it, its files live or, when compacted
        away since, as tombstones; made again, they would be added beside the compacted copy
        of their rows. So the checkpoint decides, and when it names none of them (a put that
        stalled longer than the tombstones of a compaction are kept), the entries up to it do:
        only a put that readers saw can have its files removed. The hint and the entry before
        go out at once.
        """
        hint_path = f"{self.path}/_last_checkpoint"
        before = self.name(version - 1)
        found = self.fs.cat([hint_path, before] if version else [hint_path], on_error="return")
        hint = parse_hint(found.get(hint_path))  # -1: the entry before decides
        if hint < version and (version == 0 or isinstance(found.get(before), bytes)):
            return True
        # The entry before is gone (the cleanup deletes oldest first, and only below a
        # checkpoint), or the hint is past this version: the first checkpoint after it.
        checkpoints: dict[int, list[str]] = {}
        names = os.listdir(self.path) if self.local else s3_names_from(self.fs, self.path, version)
        for name in names:
            match = CHECKPOINT_NAME.match(name)
            if match is not None and int(match.group(1)) >= version:
                checkpoints.setdefault(int(match.group(1)), []).append(f"{self.path}/{name}")
        whole = [v for v, files in checkpoints.items() if complete(files)]
        if not whole:
            return True
        first = min(whole)
        if not paths or not set(paths).isdisjoint(self._files_in(checkpoints[first])):
            return bool(paths)
        return self._removed(version, first, paths)

    def _removed(self, version: int, checkpoint: int, paths: Sequence[str]) -> bool:
        """Whether a commit removed one of ``paths``, added by the entry put at ``version``
        that the first checkpoint after it (``checkpoint``) does not name: an entry up to that
        checkpoint, not cleaned yet, or the removals the store's VACUUM wrote down say so.

        Raises
        ------
        StoreError
            Neither says so, and one of the files is gone from storage: removed and vacuumed
            after readers saw the put, or (a put in a cleaned hole) deleted by another tool's
            VACUUM as a file no table used. Which one cannot be told, so the commit is neither
            made again (it would name a file that is gone) nor reported as made.
        """
        wanted = {unquote(p) for p in paths}
        names = [self.name(v) for v in range(version + 1, checkpoint + 1)]
        for entry in self.fs.cat(names, on_error="return").values():
            for line in entry.splitlines() if isinstance(entry, bytes) else ():
                action = json.loads(line).get("remove") if b'"remove"' in line else None
                if action is not None and unquote(action["path"]) in wanted:
                    return True
        root = self.path.removesuffix("/_delta_log")
        written = [p for p in listed_records(self.fs, root) if not p.endswith(".tmp")]
        if wanted.intersection(read_records(self.fs, written)):
            return True
        gone = [p for p in wanted if not self.fs.exists(f"{root}/{p}")]
        if gone:
            raise StoreError(
                f"version {version} of {root} was put after a stall so long that whether "
                f"readers saw it cannot be told: its file {gone[0]} is gone from storage and "
                "no commit or VACUUM record names it removed. It is not made again; retry "
                "what it was written for."
            )
        return False

    def _files_in(self, checkpoint: list[str]) -> set[str]:
        """The paths a checkpoint names: its live files and its tombstones."""
        named: set[str] = set()
        for path in checkpoint:
            actions = pq.read_table(path, columns=["add", "remove"], filesystem=self.fs)
            for column in ("add", "remove"):
                named.update(
                    p for p in pc.struct_field(actions.column(column), "path").to_pylist() if p
                )
        return named


def parse_hint(hint: object) -> int:
    """The version a read ``_last_checkpoint`` hint names; -1 when there was none (a read
    error) or it is unreadable."""
    try:
        return int(json.loads(hint)["version"])  # type: ignore[arg-type]
    except (ValueError, KeyError, TypeError):
        return -1


def complete(files: list[str]) -> bool:
    """Whether the files of one checkpoint version are a whole checkpoint (one file, or every
    part ``i`` of ``n``)."""
    parts = [CHECKPOINT_NAME.match(f.rsplit("/", 1)[-1]).group(3) for f in files]  # type: ignore[union-attr]
    return parts == [None] or (
        None not in parts and len(set(parts)) == 1 and len(files) == int(parts[0])
    )


def bucket_and_prefix(fs: Any, log_path: str) -> tuple[str, str]:
    """The bucket of an S3 ``_delta_log`` and the key prefix of its files."""
    bucket, _, key = fs._strip_protocol(log_path).partition("/")
    return bucket, f"{key}/"


def s3_names_from(fs: Any, log_path: str, start: int) -> list[str]:
    """The names in an S3 ``_delta_log`` of version ``start`` and later (``ListObjectsV2``
    after every name of the version before; s3fs lists a whole prefix), 1,000 a request."""
    bucket, prefix = bucket_and_prefix(fs, log_path)
    after = f"{prefix}{start - 1:020d}~" if start else prefix  # "~" sorts after ".json"
    names: list[str] = []
    kwargs = {"Bucket": bucket, "Prefix": prefix, "StartAfter": after}
    while True:
        page = fs.call_s3("list_objects_v2", **kwargs)
        names += [item["Key"][len(prefix) :] for item in page.get("Contents", [])]
        if not page.get("IsTruncated"):
            return names
        kwargs["ContinuationToken"] = page["NextContinuationToken"]


class _Staged:
    """An entry ready to be put at a version: on a local filesystem a complete hidden file
    (:data:`STAGED_NAME`) hard-linked to each version tried, removed at the end (one a crash
    left behind goes with the log cleanup); on S3 a conditional PUT."""

    def __init__(self, log: _Log, entry: bytes) -> None:
        self.log, self.entry = log, entry
        self.temp = f"{log.path}/.{uuid.uuid4().hex}.json.tmp" if log.local else None  # STAGED_NAME

    def __enter__(self) -> object:
        if self.temp is not None:
            with open(self.temp, "wb") as out:
                out.write(self.entry)
        return self.put

    def __exit__(self, *_: object) -> None:
        if self.temp is not None:
            with contextlib.suppress(FileNotFoundError):  # taken by the cleanup: see put
                os.unlink(self.temp)

    def put(self, version: int) -> bool:
        """Write the entry as ``version``; False when that version is taken."""
        target = self.log.name(version)
        try:
            if self.temp is not None:
                try:
                    os.link(self.temp, target)
                except FileNotFoundError:
                    # Stalled longer than the log retention, the staged entry was taken for
                    # one a crash left behind: stage it again.
                    self.__enter__()
                    os.link(self.temp, target)
            else:
                self.log.fs.pipe_file(target, self.entry, mode="create")
        except FileExistsError:  # S3: 412 Precondition Failed (rmq_spark.delta.s3requests)
            return False
        return True
