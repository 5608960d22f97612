"""Opening a store: its marker, its tables created or checked, and tables of an older layout
brought up to date.

Rule 7 (bad input loses nothing) for roots: a root that is not an rmq-spark store, a newer
layout, or a table that is missing, unreadable or foreign fails with an error naming it, before
anything is written; an older layout-1 store gets the tables and columns added since, without
refusing it or changing a row.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import itertools
import json
import logging
import os
import re
import stat
import sys
import threading
import time
import uuid
from collections.abc import Collection, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO

import fsspec
import pyarrow as pa
from deltalake import Field as DeltaField
from deltalake.exceptions import DeltaError, TableNotFoundError
from fsspec.implementations.local import LocalFileSystem

from rmq_spark.delta.retry import backoff, retry_commits
from rmq_spark.delta.storage import (
    PROBE_PREFIX,
    check_conditional_put,
    check_conditional_writes,
    filesystem,
)
from rmq_spark.delta.tables import DeltaTables
from rmq_spark.model.errors import (
    CorruptStoreError,
    NotAStoreError,
    StorageConfigError,
    StoreError,
    StoreVersionError,
)
from rmq_spark.model.failpoints import failpoint
from rmq_spark.model.schema import COLUMNS_ADDED_LATER, TABLES

if TYPE_CHECKING:
    from rmq_spark.delta.s3requests import S3Requests

log = logging.getLogger(__name__)

#: The newest layout this rmq-spark reads. Layout 5 is a store whose half messages may wait in
#: intake objects (:mod:`rmq_spark.store.intake`) until they are landed in ``half``: a release
#: that records a decision in ``op`` without landing them first, or whose check-back job does
#: not land those a killed producer left, would lose them, so it refuses the store. Layout 4 is
#: a store whose transactions may be
#: decided by decision objects (:mod:`rmq_spark.store.arbiter`): a release that decides in
#: ``op`` alone would let a second decision win, so it refuses the store. Layout 3 is a store
#: of several shards with one CommitLog, the root's (:mod:`rmq_spark.store.shards`): a release
#: that reads one shard only, or a CommitLog per shard, refuses it instead of missing messages.
LAYOUT_VERSION = 5
#: The layout of a store whose transactions may be decided by decision objects, without intake.
OBJECTS_LAYOUT = 4
#: A store of shards that each had a CommitLog (rmq-spark of 2026-11-25 to 27): a writer that
#: opens it merges them into the root's (:meth:`rmq_spark.store.shards.Shards.merge_commitlogs`).
SHARDED_COMMITLOGS_LAYOUT = 2
#: The layout of a store of one shard (any release since layout 1 reads it).
ONE_SHARD_LAYOUT = 1

MARKER_FILE = "_rmqtx_store.json"
#: The folder under a store's root that holds its shards 1, 2, ... (``shards/<k>/``).
SHARDS_DIR = "shards"

STORE_FORMAT = "rmq-spark-store"
#: How many times a raise of the marker compares and swaps before it gives up.
_SWAPS = 20
#: How long a raise waits for another process's hold of the marker's lock (a raise takes
#: milliseconds; one stopped while holding it would hold up every other raise for as long).
_LOCK_WAIT_SECONDS = 30.0
#: Held with the marker's lock (:func:`_marker_lock`) by the thread of this process raising it.
_RAISING = threading.Lock()
#: What a process making a store leaves beside its tables before the marker: a marker staged
#: for its rename (:func:`_write_marker`) and a conditional-write probe. Met by the next maker
#: (the first was killed, or is at work beside it), neither makes the root foreign.
_MAKERS_FILES = re.compile(
    rf"^(?:{re.escape(MARKER_FILE)}\.[0-9a-f]{{32}}\.tmp|{re.escape(PROBE_PREFIX)}[0-9a-f]{{32}})$"
)

#: Tables added to layout 1 after its first stores were made: opening an older store creates
#: them (empty) instead of refusing it. Any other missing table is damage.
TABLES_ADDED_LATER = ("consumer_offsets", "deliveries", "epochs", "locks", "pending")


def open_or_create(tables: DeltaTables, create: bool, shard: int = 0) -> int:
    """Check the store at ``tables.root`` (shard ``shard`` of a store: 0 for its root) and
    bring it up to date, or create it (``create``) when the root is empty or missing; return
    its marker's layout version."""
    check_conditional_writes(tables.storage_options)
    fs, root = filesystem(tables.root, tables.storage_options)
    marker = f"{root.rstrip('/')}/{MARKER_FILE}"
    if _reached(fs, marker, tables.root):
        meta = _check_marker(tables.root, fs, marker)
        _check_shard(tables.root, meta, shard)
        for name in TABLES_ADDED_LATER:
            if not fs.exists(f"{root.rstrip('/')}/{name}"):
                tables.create(name)
                log.info("store %s: created table %r, new in this version", tables.root, name)
        for name in TABLES:
            _check_table(tables, name)
        return int(meta["layout_version"])
    if fs.isfile(root):  # on an object store a folder is a prefix: it may vanish, never a file
        raise NotAStoreError(
            f"{tables.root!r} is a file, not an rmq-spark store; give a directory path."
        )
    try:
        entries = {Path(p.rstrip("/")).name for p in fs.ls(root, detail=False)}
    except FileNotFoundError:
        entries = set()
    # A README (storage/ ships one), hidden files or another maker's files do not make a root
    # foreign.
    entries = {
        e
        for e in entries
        if not e.startswith(".") and e != "README.md" and _MAKERS_FILES.match(e) is None
    }
    if entries - set(TABLES):
        raise NotAStoreError(
            f"{tables.root!r} holds data that is not an rmq-spark store (no {MARKER_FILE}; found "
            f"{', '.join(sorted(entries)[:5])}). Use an empty directory or an existing store."
        )
    if not create:
        raise StoreError(
            f"no rmq-spark store at {tables.root!r}; check the path (--path, option 'path' or "
            "store.path). A store is made when a producer or Store.open(create=True) first "
            "opens it."
        )
    check_conditional_put(tables.root, tables.storage_options)
    for name in TABLES:
        tables.create(name)
        _check_table(tables, name)
        failpoint("layout.table")
    # The marker is written last: a store is complete once it exists. Only if absent: a
    # maker stalled here must not take back what another maker's store has become since.
    meta = {"format": STORE_FORMAT, "layout_version": ONE_SHARD_LAYOUT}
    if shard:
        meta = {**meta, "layout_version": LAYOUT_VERSION, "shard": shard}
    if not _write_marker(fs, marker, {**meta, "created": str(datetime.now(UTC))}, create=True):
        meta = _check_marker(tables.root, fs, marker)
        _check_shard(tables.root, meta, shard)
        return int(meta["layout_version"])
    log.info("created rmq-spark store at %s", tables.root)
    return int(meta["layout_version"])


def _write_marker(
    fs: fsspec.AbstractFileSystem, marker: str, meta: dict, *, create: bool = False
) -> bool:
    """Write the marker whole or not at all: a process opening the store meanwhile reads the
    old marker or the new one, never a half-written one (an object store's PUT is atomic; on
    a local filesystem the file is renamed, or linked, into place). With ``create``, only if
    there is none: False when there is."""
    data = json.dumps(meta).encode()
    if not isinstance(fs, LocalFileSystem):
        try:
            fs.pipe_file(marker, data, **({"mode": "create"} if create else {}))
        except FileExistsError:
            return False
        return True
    staged = f"{marker}.{uuid.uuid4().hex}.tmp"
    fs.pipe_file(staged, data)
    failpoint("layout.staged")
    if not create:
        fs.mv(staged, marker)
        return True
    try:
        os.link(staged, marker)
    except FileExistsError:
        return False
    finally:
        os.unlink(staged)
    return True


def raise_layout(tables: DeltaTables, shards: int = 1, version: int = OBJECTS_LAYOUT) -> None:
    """Raise the root marker of a store to ``version`` (:data:`OBJECTS_LAYOUT`, or
    :data:`LAYOUT_VERSION` before a process's first intake object; idempotent, never lowered)
    before its first shard beyond the root is made, or its first transaction id that a
    decision object decides:
    from then on an older rmq-spark, which would read the root's tables only or decide in
    ``op`` alone, refuses the store. With ``shards``, once they are made, record that the store
    has at least that many (the marker's count never goes down), so that a shard removed by
    hand is an error, not messages silently gone."""
    fs, root = filesystem(tables.root, tables.storage_options)
    marker = f"{root.rstrip('/')}/{MARKER_FILE}"

    def wanted(meta: dict, counted: int) -> dict:
        raised = {**meta, "layout_version": max(int(meta["layout_version"]), version)}
        return {**raised, "shards": max(int(meta.get("shards", 1)), shards, counted)}

    meta = _check_marker(tables.root, fs, marker)
    if wanted(meta, 1) == meta:  # raised already (a marker is never lowered): no lock
        return
    with _marker_lock(fs, marker):
        meta, tag = _tagged_marker(tables.root, fs, marker)
        failpoint("layout.read")
        counted = int(meta.get("shards", 1))
        for attempt in range(_SWAPS):
            new = wanted(meta, counted)
            if new == meta:
                return
            if _swap_marker(fs, marker, new, tag):
                log.info(
                    "store %s: layout version %d, %d shard(s)",
                    tables.root,
                    new["layout_version"],
                    new["shards"],
                )
                # An older rmq-spark rewrites the marker without a condition: this rewrite
                # may land after its grow's (read before it, stalled). Every shard made before
                # it is listed after it, and counted again.
                counted = _made(fs, root, new["shards"])
            else:
                backoff(attempt)
            meta, tag = _tagged_marker(tables.root, fs, marker)
    raise StoreError(
        f"the marker of the store at {tables.root!r} changed under each of {_SWAPS} attempts "
        "to raise it; if its endpoint or a proxy alters ETags, If-Match cannot hold: check "
        "the endpoint."
    )


@contextlib.contextmanager
def _marker_lock(fs: fsspec.AbstractFileSystem, marker: str) -> Iterator[None]:
    """On a local filesystem (or NFS), hold the marker's lock (``flock`` of a file beside it,
    released when the process ends) so that a marker read and rewritten is not rewritten by
    another process in between (one stopped while holding it delays the others' raises, up to
    :data:`_LOCK_WAIT_SECONDS` and then a ``StoreError``, never lets them be undone); an object
    store's marker is compared and swapped instead (:func:`_swap_marker`)."""
    if not isinstance(fs, LocalFileSystem):
        yield
        return
    path = f"{marker}.lock"
    held_too_long = StoreError(
        f"another process or thread has held {path} for over {_LOCK_WAIT_SECONDS:.0f} s while "
        "raising the store's layout (a raise takes milliseconds: is it stopped? `fuser "
        f"{path}` names a process); resume or end it, then retry."
    )
    deadline = time.monotonic() + _LOCK_WAIT_SECONDS
    # On NFS, flock is a POSIX lock, which the threads of a process share.
    if not _RAISING.acquire(timeout=_LOCK_WAIT_SECONDS):
        raise held_too_long
    try:
        with _lock_file(path) as lock:
            for attempt in itertools.count():
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise held_too_long from None
                    backoff(attempt)
            yield
    finally:
        _RAISING.release()


def _lock_file(path: str) -> BinaryIO:
    """The marker's lock file, opened for writing (on NFS a lock needs it); made, if missing,
    as writable as the store's folder and in its group, so that every account that may write
    the store may lock it, whatever the umask of the process that made it.

    Raises
    ------
    StoreError
        The lock is not a regular file (a link, left by anyone who may write the folder, would
        be followed to a file of this account's), or this account may not open it.
    """
    # Not following a link; not waiting for a reader of a FIFO.
    flags = os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            _make_lock_file(path)
            fd = os.open(path, flags)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError(errno.ELOOP, "not a regular file", path)
            return os.fdopen(fd, "ab")
        except BaseException:
            os.close(fd)
            raise
    except OSError as exc:
        refused = _lock_refused(path, exc.errno)
        if refused is None:
            raise
        raise refused from None


def _lock_refused(path: str, error: int | None) -> StoreError | None:
    """The error of a lock file this account cannot use, by the ``errno`` of its open; None
    for another error (raised as it is)."""
    if error in (errno.ELOOP, errno.ENXIO, errno.EISDIR):
        return StoreError(
            f"{path} is not a regular file (a link?): remove it; the next raise of the store's "
            "layout makes it again."
        )
    if error in (errno.EACCES, errno.EPERM):
        return StoreError(
            f"this account may not open {path} for writing (made by an older rmq-spark with its "
            "maker's umask?): give it the store folder's read and write bits and group "
            "(chmod, chgrp)."
        )
    return None


def _make_lock_file(path: str) -> None:
    """Make the lock file with the folder's read and write bits and group before it is there
    for others to open: made aside, then linked into place (a lock another process made
    meanwhile stays: it may be held)."""
    folder = os.stat(os.path.dirname(path))
    aside = f"{path}.{uuid.uuid4().hex}.tmp"
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        _share(fd, folder)
        try:
            os.link(aside, path)
        except FileExistsError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            # A filesystem without hard links: made in place, shared at once.
            with contextlib.suppress(FileExistsError):
                made = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    _share(made, folder)
                finally:
                    os.close(made)
    finally:
        os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(aside)


def _share(fd: int, folder: os.stat_result) -> None:
    """Give the file of ``fd`` the group and the read and write bits of ``folder``."""
    with contextlib.suppress(OSError):  # not in that group, or a filesystem without modes
        os.fchown(fd, -1, folder.st_gid)
    with contextlib.suppress(OSError):
        os.fchmod(fd, folder.st_mode & 0o666)


def _swap_marker(fs: fsspec.AbstractFileSystem, marker: str, meta: dict, tag: str | None) -> bool:
    """Rewrite the marker as ``meta`` if it is still the one read, whose ETag was ``tag``
    (on S3, ``If-Match``; on a local filesystem the caller holds :func:`_marker_lock`): False
    when another process rewrote it meanwhile. Other object stores rewrite it without a
    condition."""
    requests = _signed(fs)
    if not tag or requests is None:
        if requests is not None:
            log.warning("the store's endpoint gave its marker no ETag: marker rewritten as is")
        return _write_marker(fs, marker, meta)
    from rmq_spark.delta.s3requests import ObjectChanged, S3Error

    try:
        requests.put(marker, json.dumps(meta).encode(), if_match=tag)
    except ObjectChanged:
        return False
    except S3Error as exc:
        if exc.status != 501:  # Not Implemented
            raise
        log.warning("the store's endpoint does not take If-Match (%s): marker rewritten as is", exc)
        return _write_marker(fs, marker, meta)
    return True


def _signed(fs: fsspec.AbstractFileSystem) -> S3Requests | None:
    """The S3 client of ``fs`` when it is rmq-spark's (:mod:`rmq_spark.delta.s3requests`,
    imported only for an ``s3://`` store: s3fs is an extra)."""
    module = sys.modules.get("rmq_spark.delta.s3requests")
    return fs.requests if module is not None and isinstance(fs, module.S3FileSystem) else None


def _listed(fs: fsspec.AbstractFileSystem, root: str) -> set[int]:
    """The shard numbers that ``shards/`` lists (made, or being made): one listing."""
    folder = f"{root.rstrip('/')}/{SHARDS_DIR}"
    fs.invalidate_cache(folder)
    try:
        names = [Path(p.rstrip("/")).name for p in fs.ls(folder, detail=False)]
    except FileNotFoundError:
        return set()
    return {int(n) for n in names if n.isdigit() and int(n) > 0}


def _made(fs: fsspec.AbstractFileSystem, root: str, counted: int) -> int:
    """How many shards the store has at least: ``counted``, or one more than the highest
    shard beyond it whose marker (written last) exists."""
    folder = f"{root.rstrip('/')}/{SHARDS_DIR}"
    beyond = sorted((k for k in _listed(fs, root) if k >= counted), reverse=True)
    return next((k + 1 for k in beyond if fs.exists(f"{folder}/{k}/{MARKER_FILE}")), counted)


def shard_uri(root: str, shard: int) -> str:
    """The root of shard ``shard`` (1, 2, ...) of the store at ``root``."""
    return f"{root.rstrip('/')}/{SHARDS_DIR}/{shard}"


def shards_found(tables: DeltaTables, known: Collection[int]) -> list[int]:
    """The shards beyond the root of the store at ``tables.root`` that exist and are not in
    ``known``: one listing of ``shards/`` (a request on an object store), a read of the root's
    marker, then a look at the marker of each new one (a shard exists once its marker, written
    last, does).

    Raises
    ------
    CorruptStoreError
        A shard the root's marker counts, or one in ``known``, is gone (removed by hand): its
        messages, pending transactions and offsets would otherwise vanish without a word.
    """
    fs, root = filesystem(tables.root, tables.storage_options)
    folder = f"{root.rstrip('/')}/{SHARDS_DIR}"
    listed = _listed(fs, root)
    recorded = int(
        _check_marker(tables.root, fs, f"{root.rstrip('/')}/{MARKER_FILE}").get("shards", 1)
    )
    gone = sorted((set(range(1, recorded)) | set(known)) - listed - {0})
    if gone:
        raise CorruptStoreError(
            f"shard(s) {gone} of the store at {tables.root!r} are missing (its marker counts "
            f"{recorded} shard(s)): a shard's folder was removed, and with it its messages and "
            "pending transactions. Restore it (shards/<k>/) from a backup; nothing reads or "
            "writes the store until then."
        )
    return [k for k in sorted(listed - set(known)) if fs.exists(f"{folder}/{k}/{MARKER_FILE}")]


def _check_shard(root: str, meta: dict, shard: int) -> None:
    found = int(meta.get("shard", 0))
    if found == shard:
        return
    if shard == 0:
        raise NotAStoreError(
            f"{root!r} is shard {found} of the rmq-spark store at "
            f"{root.rstrip('/').rsplit('/', 2)[0]!r}, not a store of its own; open that root."
        )
    raise CorruptStoreError(f"{root!r} should be shard {shard} of its store, but says {found}.")


def _check_marker(root: str, fs: fsspec.AbstractFileSystem, marker: str) -> dict:
    return _tagged_marker(root, fs, marker)[0]


def _tagged_marker(
    root: str, fs: fsspec.AbstractFileSystem, marker: str
) -> tuple[dict, str | None]:
    """The store's marker, checked, and its ETag where the client reads one (S3)."""
    tag, requests = None, _signed(fs)
    try:
        # One GET of the whole object: a ranged read of a marker rewritten meanwhile (a store
        # growing) fails on its changed ETag, though either version is whole.
        if requests is not None:
            data, tag = requests.get_tagged(marker)
        else:
            data = fs.cat_file(marker)
        meta = json.loads(data)
        version = int(meta["layout_version"])
        if meta["format"] != STORE_FORMAT:
            raise ValueError(f"format is {meta['format']!r}")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptStoreError(
            f"the store marker {MARKER_FILE} under {root!r} is unreadable ({exc}); "
            "the root is damaged or was not written by rmq-spark."
        ) from exc
    if version > LAYOUT_VERSION:
        raise StoreVersionError(
            f"the store at {root!r} has layout version {version}, but this rmq-spark "
            f"reads layout version {LAYOUT_VERSION} at most; upgrade rmq-spark."
        )
    return meta, tag


def _check_table(tables: DeltaTables, name: str) -> None:
    expected = [f.name for f in TABLES[name][0]]
    try:
        found = [f.name for f in tables.snapshot(name).schema().fields]
    except (TableNotFoundError, DeltaError, OSError) as exc:
        raise CorruptStoreError(
            f"table {name!r} of the store at {tables.root!r} is missing or unreadable ({exc})."
        ) from exc
    added = COLUMNS_ADDED_LATER.get(name, [])
    if added and found == expected[: -len(added)]:
        _add_columns(tables, name, added)
        found = expected
    if found != expected:
        raise CorruptStoreError(
            f"table {name!r} of the store at {tables.root!r} has columns {found}, expected "
            f"{expected}; it was not written by this rmq-spark layout."
        )


def _add_columns(tables: DeltaTables, name: str, added: list[pa.Field]) -> None:
    """Bring a table of an older layout-1 store up to date (idempotent, race-safe)."""

    def attempt(_: int) -> None:
        table = tables.snapshot(name)
        if len(table.schema().fields) < len(TABLES[name][0]):  # else another process did
            table.alter.add_columns([DeltaField.from_arrow(f) for f in added])
        # Older epochs rows are all closed; open ones have no closer yet.
        for column in ("closed_by", "closed_timestamp") if name == "epochs" else ():
            if not next(
                f for f in tables.snapshot(name).schema().fields if f.name == column
            ).nullable:
                tables.snapshot(name).alter.drop_column_not_null(column)

    retry_commits(f"add columns to {name}", name, attempt)
    log.info("store %s: added column(s) %s to table %r", tables.root, [f.name for f in added], name)


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


def normalise_root(root: str) -> str:
    """A store root or table location as an absolute URI: absolute local paths for plain
    paths (so that every process resolves them alike); URIs are kept as given."""
    if "://" in root:
        return root
    return str(Path(root).expanduser().resolve())
