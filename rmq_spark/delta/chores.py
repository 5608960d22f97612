"""Work a commit asks for but must not wait for (a checkpoint, compacting and cleaning a table),
done on one background thread."""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable


class Chores:
    """Runs the work asked for under each key on one background (daemon) thread, in the order
    asked. A key asked for again before its chore started runs once, the latest work asked
    (a checkpoint of a newer version). The work must not raise.

    At exit, chores not started yet are dropped, as a crash would leave them (compactions and
    log cleanups are safe to skip; the next one does what this one did not), and the chore
    under way is waited for: a daemon thread stopped by the interpreter's shutdown inside
    pyarrow's C++ aborts the whole process (SIGABRT, "FATAL: exception not rethrown").
    """

    def __init__(self, name: str) -> None:
        self._asked: dict[str, Callable[[], None]] = {}
        self._busy = False
        self._closed = False
        self._changed = threading.Condition()
        _open.add(self)
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

    def close(self) -> None:
        """Drop the chores not started yet and wait for the one under way."""
        with self._changed:
            self._closed = True
            self._asked.clear()
            self._changed.notify_all()
            self._changed.wait_for(lambda: not self._busy)

    def _run(self) -> None:
        while True:
            with self._changed:
                self._changed.wait_for(lambda: bool(self._asked) or self._closed)
                if self._closed:
                    return
                work = self._asked.pop(next(iter(self._asked)))
                self._busy = True
            try:
                work()
            finally:
                with self._changed:
                    self._busy = False
                    self._changed.notify_all()


_open: weakref.WeakSet[Chores] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for chores in list(_open):
        chores.close()
