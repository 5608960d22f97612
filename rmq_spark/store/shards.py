"""A store of several shards: producer processes on many hosts, each appending to logs of its
own.

One Delta log takes about one commit per storage round trip, and writers racing for its next
version take turns: on an object store, producer processes that all append to the same ``half``
and ``op`` made the store slower as they were added. So a store may have shards. Shard 0 is
the root's own tables; shard ``k`` is a complete store under ``<root>/shards/<k>/`` (its own
``half``, ``op``, CommitLog, pending list, check-back state, discards, epochs and locks), made
by :func:`rmq_spark.store.layout.open_or_create` like any store.

Every rule of docs/contract.md holds within a shard by the code that keeps it for a store;
what makes the shards one store:

* **First decision wins** (rule 3): a transaction's id names its shard
  (:func:`rmq_spark.model.messages.shard_of`), so every decider, whoever it is, records its
  decision in that shard's ``op``; a decision for another shard's transaction is refused
  (:meth:`rmq_spark.store.decisions.Decisions.write_decisions`).
* **One CommitLog, dense and replayable offsets** (rules 2 and 5): every shard publishes into
  the root's CommitLog (a shard has none of its own), so a Delta reader of that one table reads
  every committed message, shards made later included. Shard ``k`` owns the queue ids
  ``k * 1000 + q`` (:data:`rmq_spark.model.messages.SHARD_QUEUE_STRIDE`) and records its own
  ``op`` cursor (:func:`rmq_spark.store.queues.op_cursor_app_id`): two shards' publish commits
  never conflict, and two publishers of one shard always do.
* **Nothing is lost** (rule 4): a shard exists once its marker, written last, exists, and a
  store never loses one; before its first shard beyond the root is made, the root's marker
  says layout 2, which an older rmq-spark (reading the root's tables only) refuses.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import pyarrow as pa
from deltalake import DeltaTable

from rmq_spark.delta.retry import retry_commits
from rmq_spark.delta.txnlog import app_transactions
from rmq_spark.model.errors import StoreError
from rmq_spark.model.failpoints import failpoint
from rmq_spark.store.layout import open_or_create, raise_layout, shard_uri, shards_found
from rmq_spark.store.queues import (
    FOREIGN_OP_APP_ID,
    OP_CURSOR_APP_ID,
    foreign_op_app_id,
    op_cursor_app_id,
)

if TYPE_CHECKING:
    from rmq_spark.store.facade import Store

log = logging.getLogger(__name__)

#: Shards opened (or made) at once: each open reads a dozen tables' logs.
_OPENERS = 8


class Shards:
    """The shards of the store whose root is ``root``: found, opened once, and made.

    Parameters
    ----------
    root : Store
        The store's root (shard 0).
    make : callable
        ``make(k)``: a :class:`Store` object for shard ``k`` (not opened yet).
    """

    def __init__(self, root: Store, make: Callable[[int], Store]) -> None:
        self.root = root
        self._make = make
        self._found: set[int] = {0}
        self._open: dict[int, Store] = {0: root}
        self._listed = False
        self._lock = threading.Lock()

    def numbers(self, *, refresh: bool) -> list[int]:
        """The shards' numbers, 0 first, without opening them; ``refresh`` looks for shards
        made since (one listing)."""
        if refresh or not self._listed:
            self._listed = True
            with self._lock:
                known = set(self._found)
            found = shards_found(self.root._tables, known)
            with self._lock:
                self._found.update(found)
        with self._lock:
            return sorted(self._found)

    def all(self, *, refresh: bool) -> list[Store]:
        """Every shard's store, by number; ``refresh`` looks for shards made since."""
        numbers = self.numbers(refresh=refresh)
        self._add([k for k in numbers if k not in self._open], create=False)
        with self._lock:
            return [self._open[k] for k in numbers]

    def opened(self) -> list[Store]:
        """The shards' stores opened so far in this process, by number."""
        with self._lock:
            return [self._open[k] for k in sorted(self._open)]

    def get(self, shard: int) -> Store:
        """Shard ``shard``'s store, opened on first use (a process that writes to one shard
        opens only that one); looks for new shards when it is not known yet."""
        if shard not in self._found:
            self.numbers(refresh=True)
        if shard not in self._found:
            raise StoreError(
                f"the store at {self.root.root!r} has no shard {shard} (it has "
                f"{len(self._found)}); a transaction or queue of shard {shard} comes from "
                "another store."
            )
        if shard not in self._open:
            self._add([shard], create=False)
        return self._open[shard]

    def grow(self, count: int) -> None:
        """Make the store have at least ``count`` shards (idempotent, safe to race)."""
        missing = [k for k in range(1, count) if k not in self.numbers(refresh=True)]
        if not missing:
            return
        raise_layout(self.root._tables)
        failpoint("shards.marked")
        self._add(missing, create=True)
        failpoint("shards.made")
        raise_layout(self.root._tables, count)
        log.info("store %s: %d shard(s) now (made %s)", self.root.root, count, missing)

    def merge_commitlogs(self) -> None:
        """Bring a store whose shards each had a CommitLog (layout 2) to one CommitLog: each
        shard's messages, queue offsets and ``op`` cursor go into the root's in one commit per
        shard (idempotent, safe to race: a commit records that it merged that shard), then the
        root's marker says layout 3. Run by a writer that opens the store, before it publishes
        anything; processes of the older release must be stopped first (they would go on
        publishing into their shard's own CommitLog)."""
        for k in self.numbers(refresh=True)[1:]:
            moved = retry_commits(
                f"merge shard {k}'s CommitLog", "commitlog", lambda n, k=k: self._merge(k)
            )
            if moved:
                log.info("store %s: merged %d message(s) of shard %d", self.root.root, moved, k)
        raise_layout(self.root._tables)

    def _merge(self, k: int) -> int:
        """One attempt at :meth:`merge_commitlogs` of shard ``k``; the messages it moved."""
        tables = self.root._tables
        merged = f"rmqtx.merged_commitlog.{k}"
        head = tables.head("commitlog", reload=True)
        if merged in head.txns:
            return 0
        source_uri = f"{shard_uri(self.root.root, k)}/commitlog"
        source = DeltaTable(source_uri, storage_options=tables.deltalake_options)
        renamed = {OP_CURSOR_APP_ID: op_cursor_app_id(k), FOREIGN_OP_APP_ID: foreign_op_app_id(k)}
        app_ids = {
            renamed.get(a, a): v
            for a, v in app_transactions(source, source_uri, tables.storage_options).items()
        }
        batches = source.to_pyarrow_dataset().to_batches()
        files = tables.write_stream("commitlog", (pa.table(b) for b in batches))
        info = {"rmqtx.operation": f"merge the CommitLog of shard {k}"}
        tables.commit("commitlog", files, head.snapshot, {**app_ids, merged: 1}, info, head.version)
        return sum(json.loads(f.stats)["numRecords"] for f in files)

    def _add(self, numbers: list[int], *, create: bool) -> None:
        def opened(k: int) -> Store:
            store = self._make(k)
            open_or_create(store._tables, create, k)
            return store

        if not numbers:
            return
        with ThreadPoolExecutor(min(_OPENERS, len(numbers))) as pool:
            stores = list(pool.map(opened, numbers))
        with self._lock:
            self._found.update(numbers)
            for k, store in zip(numbers, stores, strict=True):
                self._open.setdefault(k, store)
