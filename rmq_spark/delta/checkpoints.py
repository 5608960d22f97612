"""Checkpoints written from what the committing process already holds.

deltalake's ``create_checkpoint`` loads the table at the version and writes the checkpoint
from that replay: the previous checkpoint and every log entry since, each entry read twice,
twice over (on S3, four GETs an entry: a third of a transaction's requests), then a fresh
``DeltaTable`` for the log cleanup. A table rmq-spark appends to directly is checkpointed by
the process whose commit reached the interval, which wrote most of the entries since the
previous checkpoint itself, and wrote or read that checkpoint. :class:`Checkpointer` keeps
both, reads only the entries other writers made (once each, all at once), applies them to the
previous checkpoint's rows and writes the new checkpoint and its ``_last_checkpoint`` hint:
on S3 a GET of the hint and two PUTs where deltalake made hundreds of requests.

The checkpoint is deltalake's classic single-file layout, column for column
(:data:`CHECKPOINT_SCHEMA`), with Delta's rules: the newest ``protocol``, ``metaData`` and
``txn`` of each application id; the files added and not removed since; the tombstones of
removed files younger than the table's ``delta.deletedFileRetentionDuration``. What it does
not know is left to deltalake's replay, which writes the checkpoint instead: a previous
checkpoint of another layout or in parts (delta-spark's), a protocol or an action beyond an
append's (deletion vectors, domain metadata, row tracking: another engine's writes), a field
it has no column for, an entry that cannot be read (cleaned under a stalled writer).
"""

from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from rmq_spark.delta.commit import (
    APPEND_FEATURES,
    CHECKPOINT_NAME,
    ENTRY_NAME,
    bucket_and_prefix,
    complete,
    s3_names_from,
)
from rmq_spark.delta.storage import deltalake_options, filesystem, scheme
from rmq_spark.delta.txnlog import clean_log, hint_version, modified
from rmq_spark.delta.vacuum import interval_seconds
from rmq_spark.model.failpoints import failpoint

log = logging.getLogger(__name__)


_MAP = pa.map_(pa.field("key", pa.string(), False), pa.field("value", pa.string()))
_NAMES = pa.list_(pa.field("element", pa.string(), False))
_DELETION_VECTOR = pa.struct(
    [
        pa.field("storageType", pa.string(), False),
        pa.field("pathOrInlineDv", pa.string(), False),
        pa.field("offset", pa.int32()),
        pa.field("sizeInBytes", pa.int32(), False),
        pa.field("cardinality", pa.int64(), False),
    ]
)
#: The columns of a checkpoint, as deltalake writes them.
CHECKPOINT_SCHEMA = pa.schema(
    [
        pa.field(
            "add",
            pa.struct(
                [
                    pa.field("path", pa.string(), False),
                    pa.field("partitionValues", _MAP, False),
                    pa.field("size", pa.int64(), False),
                    pa.field("modificationTime", pa.int64(), False),
                    pa.field("dataChange", pa.bool_(), False),
                    pa.field("stats", pa.string()),
                    pa.field("tags", _MAP),
                    pa.field("deletionVector", _DELETION_VECTOR),
                    pa.field("baseRowId", pa.int64()),
                    pa.field("defaultRowCommitVersion", pa.int64()),
                    pa.field("clusteringProvider", pa.string()),
                ]
            ),
        ),
        pa.field(
            "remove",
            pa.struct(
                [
                    pa.field("path", pa.string(), False),
                    pa.field("deletionTimestamp", pa.int64()),
                    pa.field("dataChange", pa.bool_(), False),
                    pa.field("extendedFileMetadata", pa.bool_()),
                    pa.field("partitionValues", _MAP),
                    pa.field("size", pa.int64()),
                    pa.field("stats", pa.string()),
                    pa.field("tags", _MAP),
                    pa.field("deletionVector", _DELETION_VECTOR),
                    pa.field("baseRowId", pa.int64()),
                    pa.field("defaultRowCommitVersion", pa.int64()),
                ]
            ),
        ),
        pa.field(
            "metaData",
            pa.struct(
                [
                    pa.field("id", pa.string(), False),
                    pa.field("name", pa.string()),
                    pa.field("description", pa.string()),
                    pa.field(
                        "format",
                        pa.struct(
                            [
                                pa.field("provider", pa.string(), False),
                                pa.field("options", _MAP, False),
                            ]
                        ),
                        False,
                    ),
                    pa.field("schemaString", pa.string(), False),
                    pa.field("partitionColumns", _NAMES, False),
                    pa.field("createdTime", pa.int64()),
                    pa.field("configuration", _MAP, False),
                ]
            ),
        ),
        pa.field(
            "protocol",
            pa.struct(
                [
                    pa.field("minReaderVersion", pa.int32(), False),
                    pa.field("minWriterVersion", pa.int32(), False),
                    pa.field("readerFeatures", _NAMES),
                    pa.field("writerFeatures", _NAMES),
                ]
            ),
        ),
        pa.field(
            "txn",
            pa.struct(
                [
                    pa.field("appId", pa.string(), False),
                    pa.field("version", pa.int64(), False),
                    pa.field("lastUpdated", pa.int64()),
                ]
            ),
        ),
        pa.field(
            "domainMetadata",
            pa.struct(
                [
                    pa.field("domain", pa.string(), False),
                    pa.field("configuration", pa.string(), False),
                    pa.field("removed", pa.bool_(), False),
                ]
            ),
        ),
        pa.field(
            "sidecar",
            pa.struct(
                [
                    pa.field("path", pa.string(), False),
                    pa.field("sizeInBytes", pa.int64(), False),
                    pa.field("modificationTime", pa.int64(), False),
                    pa.field("tags", _MAP),
                ]
            ),
        ),
    ]
)
#: The actions a checkpoint holds, and those it leaves out; any other is left to deltalake.
_KEPT = ("add", "remove", "metaData", "protocol", "txn")
_SKIPPED = frozenset({"commitInfo", "cdc"})
#: The fields of each kept action (a log entry with another is left to deltalake).
_FIELDS = {k: frozenset(CHECKPOINT_SCHEMA.field(k).type.names) for k in _KEPT}
#: Delta's defaults of ``delta.deletedFileRetentionDuration`` and ``delta.logRetentionDuration``.
_DEFAULT_TOMBSTONE_RETENTION = "interval 1 week"
_DEFAULT_LOG_RETENTION = "interval 30 days"


class _Unknown(Exception):
    """Something this writer leaves to deltalake's replay (the message says what)."""


class Checkpointer:
    """Writes the checkpoints of the tables a process commits to directly, and keeps the log
    entries it put for the readers of the log in the process (:meth:`entries`).

    :meth:`committed` is told every log entry the process put (its bytes, at its version);
    :meth:`checkpoint` writes the checkpoint of a version from the newest complete checkpoint
    before it (the one the process wrote last, or read), the entries it was told of, and the
    others read from the log. Thread-safe; memory: at most :data:`MAX_KEPT` entries a table
    and the last checkpoint written.
    """

    #: Entries kept per table (two checkpoint intervals of the store's tables).
    MAX_KEPT = 200

    def __init__(self, storage_options: Mapping[str, str]) -> None:
        self.storage_options = storage_options
        self._lock = threading.Lock()
        self._entries: dict[str, dict[int, bytes]] = {}
        self._last: dict[str, tuple[int, pa.Table]] = {}

    def committed(self, uri: str, version: int, entry: bytes) -> None:
        """Remember the log entry this process put at ``version`` of the table at ``uri``."""
        with self._lock:
            entries = self._entries.setdefault(uri, {})
            entries[version] = entry
            if len(entries) > self.MAX_KEPT:
                del entries[min(entries)]

    def entries(self, uri: str) -> dict[int, bytes]:
        """The log entries this process put to the table at ``uri`` that no checkpoint it
        wrote covers yet (version: bytes), for readers of the log not to read them again."""
        with self._lock:
            return dict(self._entries.get(uri, {}))

    def checkpoint(self, uri: str, version: int) -> None:
        """Write the checkpoint of ``version`` of the table at ``uri`` (unless the log holds
        one as new), then delete the log entries older than its ``delta.logRetentionDuration``
        that a checkpoint covers (unless its ``delta.enableExpiredLogCleanup`` is false):
        deltalake's post-commit hook, which a direct commit does not run.

        The checkpoint it starts from is the newest complete one the log lists before
        ``version``, not the ``_last_checkpoint`` hint: a hint can lag (its writer died
        between the two PUTs), and the log after a lagging hint's checkpoint can hold an entry
        a stalled writer put where the cleanup had been (:func:`rmq_spark.delta.commit.commit`
        refuses it, and its files are committed again elsewhere). The listing starts at the
        hint's version, as deltalake's does on an object store (the CommitLog keeps a month of
        entries: a listing of them all is thousands of requests); a newer checkpoint is after
        it."""
        failpoint("deltacommit.checkpoint")
        fs, path = filesystem(uri, self.storage_options)
        log_path = f"{path.rstrip('/')}/_delta_log"
        local = scheme(uri) == "file"
        checkpoints, entries = _listing(fs, log_path, hint_version(fs, log_path), local=local)
        newest = max(checkpoints, default=-1)
        if newest >= version:
            self._forget(uri, newest)
            with self._lock:
                self._last.pop(uri, None)  # another process checkpoints this table now
            return  # another writer's is as new (a writer that stalled finds its version cleaned)
        try:
            table, configuration = self._build(uri, fs, log_path, checkpoints, entries, version)
        except _Unknown as why:
            log.debug("checkpoint of %s at %d left to deltalake: %s", uri, version, why)
            configuration = self._deltalake_checkpoint(uri, version)
        else:
            _write(fs, log_path, version, table, local=local)
            with self._lock:
                self._last[uri] = (version, table)
            self._forget(uri, version)
        if configuration.get("delta.enableExpiredLogCleanup", "true").lower() != "false":
            retention = interval_seconds(
                configuration.get("delta.logRetentionDuration", _DEFAULT_LOG_RETENTION)
            )
            cut = datetime.now(UTC) - timedelta(seconds=retention)
            if _oldest_written(fs, log_path, local=local) < cut.timestamp():
                clean_log(uri, self.storage_options, [(version, cut)])

    def _forget(self, uri: str, version: int) -> None:
        """Drop the entries a checkpoint at ``version`` covers."""
        with self._lock:
            entries = self._entries.get(uri, {})
            for v in [v for v in entries if v <= version]:
                del entries[v]

    def _deltalake_checkpoint(self, uri: str, version: int) -> dict[str, str]:
        table = DeltaTable(
            uri, version=version, storage_options=deltalake_options(self.storage_options)
        )
        table.create_checkpoint()
        with self._lock:
            self._last.pop(uri, None)
        return dict(table.metadata().configuration)

    def _build(
        self,
        uri: str,
        fs: Any,
        log_path: str,
        checkpoints: Mapping[int, list[str]],
        listed: set[int],
        version: int,
    ) -> tuple[pa.Table, dict[str, str]]:
        """The checkpoint of ``version``, and the table's configuration then."""
        base_version = max((v for v in checkpoints if v < version), default=-1)
        kept = self.entries(uri)
        with self._lock:
            last = self._last.get(uri)
        if base_version < 0:
            base = CHECKPOINT_SCHEMA.empty_table()
        elif last is not None and last[0] == base_version:
            base = last[1]
        elif len(checkpoints[base_version]) != 1:
            raise _Unknown(f"checkpoint {base_version} is in parts")
        else:
            base = _read_checkpoint(fs, checkpoints[base_version][0])
        wanted = range(base_version + 1, version + 1)
        if any(v not in listed for v in wanted):
            raise _Unknown(f"the log from {base_version + 1} to {version} is not whole")
        missing = [f"{log_path}/{v:020d}.json" for v in wanted if v not in kept]
        found = fs.cat(missing, on_error="return") if missing else {}
        entries = []
        for v in wanted:
            entry = kept.get(v, found.get(f"{log_path}/{v:020d}.json"))
            if not isinstance(entry, bytes):
                raise _Unknown(f"log entry {v} could not be read ({entry!r:.200})")
            entries.append(entry)
        return _apply(base, entries)


def _listing(
    fs: Any, log_path: str, start: int, *, local: bool
) -> tuple[dict[int, list[str]], set[int]]:
    """The complete checkpoints of a log from version ``start`` on (version: files) and the
    versions of its entries from there, listed by name: on S3 from that key on, locally from
    the names of the directory (no file is looked at)."""
    start = max(start, 0)
    if local:
        names = [n for n in os.listdir(log_path) if n >= f"{start:020d}"]
    else:
        names = s3_names_from(fs, log_path, start)
    checkpoints: dict[int, list[str]] = {}
    entries: set[int] = set()
    for name in names:
        if CHECKPOINT_NAME.match(name) is not None:
            checkpoints.setdefault(int(name[:20]), []).append(f"{log_path}/{name}")
        elif ENTRY_NAME.match(name) is not None:
            entries.add(int(name[:20]))
    return {v: sorted(f) for v, f in checkpoints.items() if complete(f)}, entries


def _oldest_written(fs: Any, log_path: str, *, local: bool) -> float:
    """When the oldest entry of a log was written (epoch seconds; -inf when unknown): when
    after the cleanup's cut, it has nothing to delete and its listing of the whole log is
    spared. Only ever skips work: a file time that cannot be read counts as old."""
    if local:
        names = [n for n in os.listdir(log_path) if ENTRY_NAME.match(n) is not None]
        found = [f"{log_path}/{min(names)}"] if names else []
        written = modified(fs.info(found[0])) if found else None
    else:
        bucket, prefix = bucket_and_prefix(fs, log_path)
        page = fs.call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=20)
        oldest = [
            i for i in page.get("Contents", []) if ENTRY_NAME.match(i["Key"].rsplit("/", 1)[-1])
        ]
        written = modified(oldest[0]) if oldest else None
    return float("-inf") if written is None else written


def _write(fs: Any, log_path: str, version: int, table: pa.Table, *, local: bool) -> None:
    """Put the checkpoint file, whole or not at all (on a local filesystem a hidden file
    renamed into place), then the hint."""
    buffer = io.BytesIO()
    pq.write_table(table, buffer, compression="snappy")
    data = buffer.getvalue()
    target = f"{log_path}/{version:020d}.checkpoint.parquet"
    if local:
        staged = f"{log_path}/.{uuid.uuid4().hex}.checkpoint.parquet.tmp"  # STAGED_NAME
        try:
            with open(staged, "wb") as out:
                out.write(data)
            os.replace(staged, target)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staged)
    else:
        fs.pipe_file(target, data)
    failpoint("checkpoint.written")
    if hint_version(fs, log_path) >= version:
        return  # a newer one was written meanwhile: the hint must not go back (clean_log)
    hint = {
        "version": version,
        "size": table.num_rows,
        "sizeInBytes": len(data),
        "numOfAddFiles": table.num_rows - table.column("add").null_count,
    }
    fs.pipe_file(f"{log_path}/_last_checkpoint", json.dumps(hint).encode())


def _shape(kind: pa.DataType) -> object:
    """A type's nesting and names, whatever its nullability and its maps' entry names."""
    if isinstance(kind, pa.MapType):
        return ("map", _shape(kind.key_type), _shape(kind.item_type))
    if isinstance(kind, pa.ListType):
        return ("list", _shape(kind.value_type))
    if isinstance(kind, pa.StructType):
        return tuple((f.name, _shape(f.type)) for f in kind)
    return str(kind)


_CHECKPOINT_SHAPE = _shape(pa.struct(list(CHECKPOINT_SCHEMA)))


def _read_checkpoint(fs: Any, path: str) -> pa.Table:
    try:
        table = pq.read_table(path, filesystem=fs)
    except (OSError, ValueError) as exc:
        raise _Unknown(f"the checkpoint {path} could not be read ({exc})") from exc
    if _shape(pa.struct(list(table.schema))) != _CHECKPOINT_SHAPE:
        raise _Unknown(f"the checkpoint {path} has another layout")
    return table.cast(CHECKPOINT_SCHEMA)


def _apply(base: pa.Table, entries: list[bytes]) -> tuple[pa.Table, dict[str, str]]:
    """The checkpoint of ``base`` (a checkpoint's rows) followed by ``entries`` (the log
    entries after it, in order), and the table's configuration."""
    for column in ("domainMetadata", "sidecar"):
        if base.column(column).null_count != base.num_rows:
            raise _Unknown(f"the previous checkpoint holds {column} actions")
    adds: dict[str, dict[str, Any]] = {}
    removes: dict[str, dict[str, Any]] = {}
    txns: dict[str, dict[str, Any]] = {}
    latest: dict[str, dict[str, Any]] = {}
    for entry in entries:
        for line in entry.splitlines():
            if not line.strip():
                continue
            action = json.loads(line)
            if not isinstance(action, dict) or len(action) != 1:
                raise _Unknown(f"a log entry holds {line[:200]!r}")
            ((kind, body),) = action.items()
            if kind not in _FIELDS and kind not in _SKIPPED:
                raise _Unknown(f"a log entry holds a {kind} action")
            if kind in _SKIPPED:
                continue
            if set(body) - _FIELDS[kind]:
                raise _Unknown(f"a {kind} action has fields {sorted(set(body) - _FIELDS[kind])}")
            if kind == "add":
                removes.pop(body["path"], None)
                adds[body["path"]] = body
            elif kind == "remove":
                adds.pop(body["path"], None)
                removes[body["path"]] = body
            elif kind == "txn":
                txns[body["appId"]] = body
            else:
                latest[kind] = body
    metadata = latest.get("metaData") or _only(base, "metaData")
    protocol = latest.get("protocol") or _only(base, "protocol")
    _check_protocol(protocol)
    configuration = dict(metadata.get("configuration") or {})
    if "delta.setTransactionRetentionDuration" in configuration:
        raise _Unknown("the table expires application ids")
    if any(a.get("deletionVector") for a in adds.values()):
        raise _Unknown("an add has a deletion vector")
    retention = interval_seconds(
        configuration.get("delta.deletedFileRetentionDuration", _DEFAULT_TOMBSTONE_RETENTION)
    )
    expired = int((time.time() - retention) * 1000)  # deltalake's rule, on this host's clock
    touched = list(adds) + list(removes)
    live = _not_in(base, "add", "path", touched)
    young = pc.invert(pc.less(pc.struct_field(base.column("remove"), "deletionTimestamp"), expired))
    tombstones = pc.and_(_not_in(base, "remove", "path", touched), pc.fill_null(young, False))
    apps = _not_in(base, "txn", "appId", list(txns))
    kept = base.filter(pc.or_(pc.or_(live, tombstones), apps))
    rows = [{"protocol": protocol}, {"metaData": metadata}]
    rows += [{"txn": t} for t in txns.values()]
    rows += [{"add": a} for a in adds.values()]
    rows += [
        {"remove": r}
        for r in removes.values()
        if (r.get("deletionTimestamp") or 0) >= expired  # none: expired, as deltalake has it
    ]
    new = pa.Table.from_pylist(rows, CHECKPOINT_SCHEMA)
    return pa.concat_tables([new, kept]).combine_chunks(), configuration


def _not_in(base: pa.Table, column: str, field: str, values: list[str]) -> pa.Array:
    """Whether each row of ``base`` is a ``column`` action whose ``field`` is not one of
    ``values`` (false for the rows of other actions)."""
    named = pc.struct_field(base.column(column), field)
    absent = pc.invert(pc.is_in(named, pa.array(values, pa.string())))
    return pc.and_(pc.is_valid(base.column(column)), pc.fill_null(absent, False))


def _only(base: pa.Table, column: str) -> dict[str, Any]:
    """The one ``column`` action of a checkpoint, as a log entry writes it."""
    found = base.column(column).drop_null().to_pylist()
    if len(found) != 1:
        raise _Unknown(f"the previous checkpoint holds {len(found)} {column} actions")
    action = found[0]
    for key in ("configuration",):
        if isinstance(action.get(key), list):
            action[key] = dict(action[key])
    if "format" in action and isinstance(action["format"].get("options"), list):
        action["format"]["options"] = dict(action["format"]["options"])
    return action


def _check_protocol(protocol: Mapping[str, Any]) -> None:
    unknown = set(protocol.get("writerFeatures") or ()) - APPEND_FEATURES
    if protocol.get("minReaderVersion", 1) > 1 or protocol.get("readerFeatures") or unknown:
        raise _Unknown(f"the protocol asks more than appends ({dict(protocol)})")
