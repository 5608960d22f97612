"""VACUUM by removal time: a file a table removed is deleted from storage once it has been
removed for the retention asked, however briefly the table's checkpoints keep its tombstone.

deltalake's VACUUM finds what to delete in the tombstones of the snapshot (its full mode goes
by file times, which a writer that stalls between writing a file and committing it would lose
its file to). A checkpoint drops a tombstone once it is older than the table's
``delta.deletedFileRetentionDuration``, and the store's tables checkpoint every 100 commits:
by the time a removal was old enough to vacuum, its tombstone was gone, and nothing was ever
deleted (every file a compaction replaced stayed in storage). Keeping tombstones in the
checkpoints as long as the files are kept costs more: every compaction of the CommitLog's
week in every checkpoint and in every snapshot a reader loads (at 15 publishes a second, 72 h
of them made a 130 MB checkpoint that took 0.59 s to load; 2 h, 3.7 MB and 0.07 s:
``bench/tombstones_bench.py``).

So the tables keep tombstones for two hours (:data:`rmq_spark.model.schema.TOMBSTONES`), and
each maintenance run, which comes every hour, writes down the tombstones it finds with when
they are due in the table's ``_rmqtx_vacuum/`` folder (Delta readers and VACUUMs skip folders
that start with an underscore), and deletes the files written down there that are due and that
the table does not use again (a RESTORE can bring one back). A file removed while no
maintenance ran for longer than the table keeps tombstones is not written down, and stays;
so does one that an object store refused to delete (s3fs does not report those).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Mapping
from typing import Any
from urllib.parse import unquote

import pyarrow.compute as pc
import pyarrow.parquet as pq
from deltalake import DeltaTable

from rmq_spark.delta.commit import checkpoint_interval
from rmq_spark.delta.reads import read_arrow
from rmq_spark.delta.removals import listed_records, read_records, write_records
from rmq_spark.delta.storage import filesystem, scheme
from rmq_spark.delta.txnlog import _checkpoint_at_or_before, _commits

log = logging.getLogger(__name__)

#: Delta's default ``delta.deletedFileRetentionDuration``.
_DEFAULT_RETENTION = 7 * 86400.0
_INTERVAL = re.compile(r"^\s*interval\s+(\d+)\s+(second|minute|hour|day|week)s?\s*$", re.I)
_UNIT_SECONDS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}


def tombstone_retention(table: DeltaTable) -> float:
    """How long ``table``'s checkpoints keep a tombstone, in seconds: its
    ``delta.deletedFileRetentionDuration`` (Delta's default, a week, when unset)."""
    value = table.metadata().configuration.get("delta.deletedFileRetentionDuration")
    return _DEFAULT_RETENTION if value is None else interval_seconds(value)


def interval_seconds(value: str) -> float:
    """A Delta interval property (``interval 2 hours``) in seconds; Delta's default retention,
    a week, for one that is not ``interval N unit``."""
    match = _INTERVAL.match(value)
    if match is None:
        return _DEFAULT_RETENTION
    return int(match.group(1)) * _UNIT_SECONDS[match.group(2).lower()]


def vacuum(
    uri: str,
    storage_options: Mapping[str, str],
    snapshot: Callable[[], DeltaTable],
    retention: float,
) -> list[str]:
    """Delete the files of the table at ``uri`` removed more than ``retention`` seconds ago,
    and write down the removals not yet due; return the paths deleted (relative to the table's
    root). ``snapshot`` loads the table's latest snapshot.

    Removals are written down in files named by when they become due (in steps of a 24th of
    the retention, an hour at most), so a run reads only the ones due, not the whole retention
    (a week of the CommitLog's compactions). The snapshot is loaded after the due ones are
    read: a file live in it was brought back (a RESTORE) and stays; one removed since is in its
    tombstones."""
    fs, path = filesystem(uri, storage_options)
    base = path.rstrip("/")
    now = time.time()
    ripe = [p for p, at in listed_records(fs, base).items() if at <= now]
    # A copy is written only of removals not due yet: one due is a killed run's, abandoned.
    due = set(read_records(fs, [p for p in ripe if not p.endswith(".tmp")]))
    table = snapshot()
    step = int(min(max(retention // 24, 1), 3600))
    waiting: dict[int, dict[str, int]] = {}
    for p, ms in _tombstones(fs, f"{base}/_delta_log", table).items():
        due_at = ms / 1000 + retention
        if due_at <= now:
            due.add(p)
        else:  # in the file of the step it falls due in
            waiting.setdefault(math.ceil(due_at / step) * step, {})[p] = ms
    for at, removals in waiting.items():  # before anything is deleted: a killed run loses none
        write_records(fs, base, at, removals, local=scheme(uri) == "file")
    live = {unquote(p) for p in read_arrow(table.get_add_actions()).column("path").to_pylist()}
    deleted = sorted(due - live)
    _delete(fs, [f"{base}/{p}" for p in deleted])
    _delete(fs, ripe)  # another run may have taken them in too, and deleted them
    return deleted


def _delete(fs: Any, paths: list[str]) -> None:
    """Delete ``paths``, in one request a thousand on an object store; the ones already gone
    (an earlier run, killed midway, deleted them) are skipped."""
    if not paths:
        return
    try:
        fs.rm(paths)
    except FileNotFoundError:
        for path in paths:
            with contextlib.suppress(FileNotFoundError):
                fs.rm_file(path)


def _tombstones(fs: Any, log_path: str, table: DeltaTable) -> dict[str, int]:
    """The removals ``table``'s snapshot holds (its checkpoint's and those of the commits
    after it): each file's path, decoded, and when it was removed (ms since the epoch)."""
    version = table.version()
    first_seen = int(time.time() * 1000)  # a removal that does not say when: from now on
    start, files = _checkpoint_at_or_before(fs, log_path, version, checkpoint_interval(table))
    found: dict[str, int] = {}
    for file in files:
        column = pq.read_table(file, columns=["remove"], filesystem=fs).column("remove")
        column = column.drop_null()
        paths = pc.struct_field(column, "path").to_pylist()
        times = pc.struct_field(column, "deletionTimestamp").to_pylist()
        found.update((unquote(p), int(t or first_seen)) for p, t in zip(paths, times, strict=True))
    for content in _commits(fs, log_path, start + 1, version).values():
        for line in content.splitlines():
            if b'"remove"' in line:
                action = json.loads(line).get("remove")
                if action is not None:
                    found[unquote(action["path"])] = int(
                        action.get("deletionTimestamp") or first_seen
                    )
    return found
