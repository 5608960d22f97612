"""Half messages this process prepared, kept until it publishes them.

A producer publishes its own COMMITs moments after it prepared them; reading their half
messages back from ``half`` costs a snapshot update and a file read per publish, a third of a
small publish. The rows a prepare wrote are exactly what ``half`` holds for its transactions:
``half`` is append-only, each of these transactions was made whole by that one prepare (its id
was new), and retention removes only transactions that are published or rolled back. So a
publish that finds every transaction of its chunk here uses these rows; any miss (another
process prepared it, or the cache dropped it) reads ``half`` as before. Memory is bounded by
body bytes, oldest first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import pyarrow as pa
import pyarrow.compute as pc

#: Body bytes kept at most; the oldest transactions are dropped first.
MAX_BYTES = 32 * 1024 * 1024


class RecentHalves:
    """A bounded, thread-safe map of transaction id to its half messages (``half`` rows)."""

    def __init__(self, max_bytes: int = MAX_BYTES) -> None:
        self._max_bytes = max_bytes
        self._bytes = 0
        self._rows: OrderedDict[str, tuple[pa.Table, int]] = OrderedDict()
        self._lock = threading.Lock()

    def add(self, rows: pa.Table) -> None:
        """Keep ``rows``: one message per transaction, each transaction whole."""
        sizes = pc.binary_length(rows.column("body")).to_pylist()
        ids = rows.column("transaction_id").to_pylist()
        with self._lock:
            for i, (txn, size) in enumerate(zip(ids, sizes, strict=True)):
                self._rows[txn] = (rows.slice(i, 1), size)
                self._bytes += size
            while self._bytes > self._max_bytes and self._rows:
                self._bytes -= self._rows.popitem(last=False)[1][1]

    def take(self, transaction_ids: Sequence[str]) -> pa.Table | None:
        """The rows of all ``transaction_ids`` (each once, in their order), removed from the
        cache; None (and nothing removed) when one of them is not here."""
        wanted = list(dict.fromkeys(transaction_ids))  # as a table read: each one once
        with self._lock:
            if not wanted or any(t not in self._rows for t in wanted):
                return None
            taken = [self._rows.pop(t) for t in wanted]
            self._bytes -= sum(size for _, size in taken)
        return pa.concat_tables([rows for rows, _ in taken])

    def discard(self, transaction_ids: Iterable[str]) -> None:
        """Forget transactions that will not be published (rolled back)."""
        with self._lock:
            for txn in transaction_ids:
                entry = self._rows.pop(txn, None)
                if entry is not None:
                    self._bytes -= entry[1]
