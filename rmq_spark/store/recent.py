"""Half messages this process prepared, kept until it publishes them.

A producer publishes its own COMMITs moments after it prepared them; reading their half
messages back from ``half`` costs a snapshot update and a file read per publish, a third of a
small publish. The rows a prepare wrote are exactly what ``half`` holds for its transactions:
``half`` is append-only, each of these transactions was made whole by that one prepare (its id
was new), and retention removes only transactions that are published or rolled back. So a
publish that finds every transaction of its chunk here uses these rows; any miss (another
process prepared it, or the cache dropped it) reads ``half`` as before, and forgets the rows
it found here. Memory is bounded by body bytes, oldest first.

Rows of a transaction that another process published are stale: retention may remove it,
and a decision of it recorded again after that (this process stalled between its decision and
its landing, or a late end-transaction) must publish nothing. This process cannot see which
transactions others published, only that they did: a publish that finds the ``op`` cursor past
where this process's last one read (or that is its first) forgets every row first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

#: Body bytes kept at most; the oldest transactions are dropped first.
MAX_BYTES = 32 * 1024 * 1024


class _Prepared:
    """The rows one prepare wrote, and how many of its transactions are still kept."""

    __slots__ = ("kept", "nbytes", "rows")

    def __init__(self, rows: pa.Table) -> None:
        self.rows, self.kept = rows, rows.num_rows
        self.nbytes = pc.sum(pc.binary_length(rows.column("body"))).as_py() or 0


class RecentHalves:
    """A bounded, thread-safe map of transaction id to its half messages (``half`` rows).

    Each transaction's row stays in the table its prepare wrote, which is held (and counted)
    until its last transaction leaves: one transaction left undecided keeps its whole prepare.
    """

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._rows: OrderedDict[str, tuple[_Prepared, int]] = OrderedDict()
        self._lock = threading.Lock()
        #: The ``op`` version up to which this process's last publish read (None: none yet).
        self._read_to: int | None = None

    def add(self, rows: pa.Table) -> None:
        """Keep ``rows``: one message per transaction, each transaction whole."""
        prepared = _Prepared(rows)
        ids = rows.column("transaction_id").to_pylist()
        with self._lock:
            for i, txn in enumerate(ids):
                replaced = self._rows.pop(txn, None)
                if replaced is not None:
                    self._release(replaced)
                self._rows[txn] = (prepared, i)
            self._bytes += prepared.nbytes
            while self._bytes > self._max_bytes and self._rows:
                self._release(self._rows.popitem(last=False)[1])

    def take(self, transaction_ids: Sequence[str]) -> pa.Table | None:
        """The rows of all ``transaction_ids`` (each once), removed from the cache; None when
        one of them is not here (the others are forgotten all the same: the publish reads them
        from ``half``, and kept they would be stale).

        The rows come grouped by the prepare that wrote them, in the order of ``ids`` within
        each group: the caller sorts them. One ``take`` per prepare, not a slice per row (a
        table of a thousand one-row chunks cost the publisher's Parquet writer 30 ms).
        """
        wanted = list(dict.fromkeys(transaction_ids))  # as a table read: each one once
        with self._lock:
            taken = [self._rows.pop(t) for t in wanted if t in self._rows]
            for entry in taken:
                self._release(entry)
            if not wanted or len(taken) < len(wanted):
                return None
        by_prepare: dict[int, tuple[pa.Table, list[int]]] = {}
        for prepared, row in taken:
            by_prepare.setdefault(id(prepared), (prepared.rows, []))[1].append(row)
        return pa.concat_tables([rows.take(picked) for rows, picked in by_prepare.values()])

    def publishing(self, cursor: int) -> None:
        """A publish reads the transactions decided after ``op`` version ``cursor``: forget
        every row when another process published since this one's last publish read (see the
        module docstring)."""
        with self._lock:
            if self._read_to is None or cursor > self._read_to:
                self._rows.clear()
                self._bytes = 0

    def published_to(self, end: int) -> None:
        """A publish read the transactions decided up to ``op`` version ``end``."""
        with self._lock:
            self._read_to = end

    def discard(self, transaction_ids: Iterable[str]) -> None:
        """Forget transactions that will not be published (rolled back)."""
        with self._lock:
            for txn in transaction_ids:
                entry = self._rows.pop(txn, None)
                if entry is not None:
                    self._release(entry)

    def _release(self, entry: tuple[_Prepared, int]) -> None:
        prepared = entry[0]
        prepared.kept -= 1
        if prepared.kept == 0:
            self._bytes -= prepared.nbytes
