"""Work a commit asks for but must not wait for (a checkpoint, compacting and cleaning a table),
done on one background thread."""

from __future__ import annotations

import atexit
import threading
import weakref
from collections.abc import Callable, Sequence


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


class ChoreKinds:
    """The chores of several ``kinds`` that commits ask for: run at once on the asking thread,
    or, after :meth:`in_background`, on one background :class:`Chores` thread per kind."""

    def __init__(self, name: str, kinds: Sequence[str]) -> None:
        self._name, self._kinds = name, tuple(kinds)
        self._threads: dict[str, Chores] = {}
        self._lock = threading.Lock()

    def soon(self, kind: str, key: str, work: Callable[[], None]) -> None:
        """Run ``work``, a chore of ``kind`` on ``key`` that never raises: now, on the asking
        thread, or after :meth:`in_background` on the background thread of its kind."""
        chores = self._threads.get(kind)
        if chores is not None:
            chores.ask(key, work)
        else:
            work()

    def in_background(self) -> None:
        """Run chores on background threads of this process from now on, one per kind
        (idempotent); :meth:`wait` waits for what is asked."""
        with self._lock:
            if not self._threads:
                self._threads = {k: Chores(f"rmqtx-{k}-{self._name}") for k in self._kinds}

    def wait(self) -> None:
        """Wait until the background chores asked for so far are done (a no-op without
        :meth:`in_background`)."""
        for chores in self._threads.values():
            chores.wait()


_open: weakref.WeakSet[Chores] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for chores in list(_open):
        chores.close()
