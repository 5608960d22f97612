"""The removals of a table's files written down for a later VACUUM (:mod:`rmq_spark.delta.vacuum`),
in the table's ``_rmqtx_vacuum/`` folder (Delta readers and VACUUMs skip folders that start
with an underscore): a Parquet file of paths and removal times per step of time they fall due
in. They also prove, to a commit that stalled after its put (:mod:`rmq_spark.delta.commit`),
that readers saw its files: only those can have been removed.
"""

from __future__ import annotations

import logging
import re
import uuid
from collections.abc import Mapping
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

log = logging.getLogger(__name__)

#: The folder, under a table's root, of the removals written down for a later VACUUM.
REMOVALS_DIR = "_rmqtx_vacuum"
#: A file of removals written down: when they are due (seconds since the epoch), a unique id;
#: with a leading dot and ``.tmp``, its copy being written (left by a run killed meanwhile).
_RECORDS = re.compile(r"^\.?(\d{12})-[0-9a-f]{32}\.parquet(?:\.tmp)?$")
_REMOVALS_SCHEMA = pa.schema([("path", pa.string()), ("removed_ms", pa.int64())])


def listed_records(fs: Any, table_path: str) -> dict[str, int]:
    """The files of removals of the table at ``table_path`` (copies being written too), each
    with when its removals fall due (seconds since the epoch)."""
    folder = f"{table_path}/{REMOVALS_DIR}"
    fs.invalidate_cache(folder)  # another process's runs write there too
    try:
        listed = fs.ls(folder, detail=False)
    except FileNotFoundError:
        return {}
    names = {p: _RECORDS.match(p.rsplit("/", 1)[-1]) for p in listed}
    return {p: int(m.group(1)) for p, m in names.items() if m is not None}


def read_records(fs: Any, files: list[str]) -> list[str]:
    """The paths written down in ``files``; one that cannot be read (a copy cut short on a
    filesystem without atomic renames) is logged, and its files stay in storage."""
    paths: list[str] = []
    for file in files:
        try:
            paths += pq.read_table(file, filesystem=fs).column("path").to_pylist()
        except (OSError, pa.ArrowInvalid) as exc:
            log.warning("removals file %s is unreadable (%s); its files stay", file, exc)
    return paths


def write_records(
    fs: Any, table_path: str, due: int, removals: Mapping[str, int], *, local: bool
) -> None:
    """Write ``removals`` down, due at ``due`` (seconds since the epoch), whole or not at all:
    a hidden copy renamed into place (an object store's PUT is whole by itself)."""
    folder = f"{table_path}/{REMOVALS_DIR}"
    rows = pa.table([list(removals), list(removals.values())], schema=_REMOVALS_SCHEMA)
    name = f"{due:012d}-{uuid.uuid4().hex}.parquet"
    fs.makedirs(folder, exist_ok=True)
    if local:
        temp = f"{folder}/.{name}.tmp"
        with fs.open(temp, "wb") as out:
            pq.write_table(rows, out)
        fs.mv(temp, f"{folder}/{name}")
    else:
        with fs.open(f"{folder}/{name}", "wb") as out:
            pq.write_table(rows, out)
