"""Locks and leases in a store's ``locks`` table: who publishes, compacts a table or maintains.

A lock is a row (``name``, ``holder``, ``expires``), granted when nobody holds it, it expired,
or it is the taker's already. Taking, renewing or releasing one is a compare-and-swap of the
whole table. The taker reads every row at the latest version it knows, decides, and rewrites
them all as one data file in a direct commit (:func:`rmq_spark.delta.commit.commit`) that
removes the files it read and is *exclusive*: any commit after the version it read, another
taker's or another Delta writer's, refuses it, and it decides again on what is there now.
So exactly one of racing takers gets a lock, whatever the timings, and nothing another
writer put in the table is dropped or missed.

The commit carries its rows in its ``commitInfo`` too (:data:`ROWS_FIELD`). The rows at a
version rmq-spark wrote are known from that version's log entry, which a process that follows
the log reads anyway (its own from memory): a renewal on S3 by a thread that looked within
``fresh_seconds`` is a GET that finds no newer entry, the data file and entry PUTs and the
reachability check, five requests (a thread that looked longer ago loads the snapshot first).
deltalake's MERGE and the read after it made 24 and took half a second at 20 ms a request, and
every producer process renews the publisher lease every 3.3 s and its shard's claim every 20 s,
idle or not. A version another writer made (an older release's MERGE, delta-spark) has its rows
read from the table. On a filesystem the direct commit does not write (other than local and
S3) deltalake MERGEs the lock's row, as before.

Every lock of a store shares its one table, so takes of different locks conflict too (one of
them retries): fine for a few takes a second, the publisher lease, the claims and the
compaction and maintenance locks.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

import pyarrow as pa

from rmq_spark.delta.reads import sql_string
from rmq_spark.delta.retry import retry_commits
from rmq_spark.model.schema import LOCKS_SCHEMA, TIMESTAMP
from rmq_spark.store.context import StoreConcept
from rmq_spark.store.reads import query

#: The ``commitInfo`` field of a lock commit that holds the rows it wrote and their file.
ROWS_FIELD = "rmqtx.locks"


@dataclass(frozen=True)
class _Table:
    """The ``locks`` table at ``version``: each lock's holder and expiry, and the data files
    that hold them (``path``, ``size``, ``partition_values``)."""

    version: int
    rows: dict[str, tuple[str, datetime]]
    files: list[dict[str, object]]

    def holder(self, name: str, now: datetime) -> str | None:
        row = self.rows.get(name)
        return row[0] if row is not None and row[1] > now else None


class Locks(StoreConcept):
    """The locks of one store (or shard): see the module docstring."""

    def take(self, name: str, holder: str, seconds: float) -> bool:
        """Take (or, with ``seconds`` 0, release) the lock ``name`` for ``holder``: granted
        when free, expired, or ``holder``'s already; exactly one of racing takers gets it. A
        lock not granted writes nothing."""

        def attempt(n: int) -> bool:
            head = self.tables.head("locks", reload=n > 0)
            if self.tables.direct_interval("locks", head.snapshot) is None:
                return self._merge(name, holder, seconds)
            table = self._at(head.version)
            now = self.clock()
            if table.holder(name, now) not in (None, holder):
                return False
            rows = {**table.rows, name: (holder, now + timedelta(seconds=seconds))}
            names = sorted(rows)
            data = pa.table(
                {
                    "name": names,
                    "holder": [rows[n][0] for n in names],
                    "expires": pa.array([rows[n][1] for n in names], TIMESTAMP),
                },
                schema=LOCKS_SCHEMA,
            )
            files = self.tables.write("locks", [data])
            written = {
                "rows": [[n, rows[n][0], _micros(rows[n][1])] for n in names],
                "files": [{"path": f.path, "size": f.size} for f in files],
            }
            self.tables.commit(
                "locks",
                files,
                head.snapshot,
                info={ROWS_FIELD: json.dumps(written, separators=(",", ":"))},
                after=table.version,
                removes=table.files,
                exclusive=True,
            )
            return True

        return retry_commits(f"take the lock {name}", "locks", attempt)

    def holder(self, name: str) -> str | None:
        """Who holds the lock ``name`` (None: nobody, or the lock expired)."""
        return self._latest().holder(name, self.clock())

    def held(self, *names: str) -> bool:
        """Whether one of the locks ``names`` is held (taken and not expired)."""
        table, now = self._latest(), self.clock()
        return any(table.holder(n, now) is not None for n in names)

    def _latest(self) -> _Table:
        """The table at its latest version (the log followed from this thread's last look)."""
        return self._at(self.tables.latest_version("locks"))

    def _at(self, version: int) -> _Table:
        """The table at ``version``, from its log entry when a lock commit wrote it, else
        read (at the latest version: what a commit on it checks from)."""
        try:
            info = self.tables.commit_infos("locks", version, version).get(version, {})
        except LookupError:  # cleaned under a stalled thread: read the table
            info = {}
        if ROWS_FIELD in info:
            written = json.loads(info[ROWS_FIELD])
            rows = {n: (h, _moment(us)) for n, h, us in written["rows"]}
            files = [{**f, "partition_values": {}} for f in written["files"]]
            return _Table(version, rows, files)
        snapshot = self.tables.snapshot("locks")
        read = self.tables.sql("locks", "SELECT * FROM locks", table=snapshot).to_pylist()
        rows = {}
        for row in sorted(read, key=lambda r: r["expires"]):  # a name twice: the later expiry holds
            rows[row["name"]] = (row["holder"], row["expires"])
        on_disk = self.tables.data_files("locks", snapshot).select(["path", "size_bytes"])
        files = [
            {"path": f["path"], "size": f["size_bytes"], "partition_values": {}}
            for f in on_disk.to_pylist()
        ]
        return _Table(snapshot.version(), rows, files)

    def _merge(self, name: str, holder: str, seconds: float) -> bool:
        """Take the lock with deltalake's MERGE (a table the direct commit does not write)."""
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
        self.tables.merge(
            "locks",
            source,
            "name",
            lambda m: m.when_matched_update(
                {"holder": "s.holder", "expires": "s.expires"},
                predicate="t.expires <= s.now OR t.holder = s.holder",
            ).when_not_matched_insert({c: f"s.{c}" for c in LOCKS_SCHEMA.names}),
        )
        rows = query(self.tables, "locks", f"name = {sql_string(name)}")
        return rows.column("holder").to_pylist() == [holder]


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)


def _micros(moment: datetime) -> int:
    return (moment - _EPOCH) // timedelta(microseconds=1)


def _moment(micros: int) -> datetime:
    return _EPOCH + timedelta(microseconds=micros)
