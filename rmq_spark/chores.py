"""Work a commit asks for but must not wait for (a checkpoint, compacting and cleaning a table),
done on one background thread."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Chores:
    """Runs the work asked for under each key on one background (daemon) thread, in the order
    asked. A key asked for again before its chore started runs once, the latest work asked
    (a checkpoint of a newer version). The work must not raise.

    A process that exits with chores under way leaves them as a crash would: compactions and
    log cleanups are safe to stop at any point, and the next one does what this one did not.
    """

    def __init__(self, name: str) -> None:
        self._asked: dict[str, Callable[[], None]] = {}
        self._busy = False
        self._changed = threading.Condition()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def ask(self, key: str, work: Callable[[], None]) -> None:
        """Have ``work()`` run soon; returns at once."""
        with self._changed:
            self._asked[key] = work
            self._changed.notify_all()

    def wait(self) -> None:
        """Block until every chore asked for so far is done."""
        with self._changed:
            self._changed.wait_for(lambda: not self._asked and not self._busy)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._asked))
                work = self._asked.pop(next(iter(self._asked)))
                self._busy = True
            try:
                work()
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()
