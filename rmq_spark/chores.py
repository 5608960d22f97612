"""Work a commit asks for but must not wait for (compacting and cleaning a table), done on one
background thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Chores:
    """Runs ``work(key)`` on one background (daemon) thread for each key asked for. A key asked
    for again before its chore started runs once. ``work`` must not raise.

    A process that exits with chores under way leaves them as a crash would: compactions and
    log cleanups are safe to stop at any point, and the next one does what this one did not.
    """

    def __init__(self, name: str, work: Callable[[str], None]) -> None:
        self._work = work
        self._asked: dict[str, None] = {}  # insertion-ordered set
        self._busy = False
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def ask(self, key: str) -> None:
        """Have ``work(key)`` run soon; returns at once."""
        with self._changed:
            self._asked[key] = None
            self._changed.notify_all()

    def wait(self) -> None:
        """Block until every chore asked for so far is done."""
        with self._changed:
            self._changed.wait_for(lambda: not self._asked and not self._busy)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._asked))
                key = next(iter(self._asked))
                del self._asked[key]
                self._busy = True
            try:
                self._work(key)
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
