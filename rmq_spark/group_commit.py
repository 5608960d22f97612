"""Group commit: items submitted from many threads handed to one handler in batches, so that a
Delta commit carries every message that arrived while the previous one was being written."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

#: How often a lingering committer looks whether the whole wave is back.
_WAVE_POLL_SECONDS = 0.0002

T = TypeVar("T")
R = TypeVar("R")


class Slot(Generic[R]):
    """One caller's result of a batch: a ``concurrent.futures.Future`` cut down to what the
    producer uses. Each send makes two (its half message, its decision). With 64 senders,
    Futures (a Condition and an RLock each, made, notified and waited on in Python) took about
    a third of the samples that held the GIL; a bare lock, released once, is all C."""

    __slots__ = ("_callbacks", "_done", "_error", "_value")

    def __init__(self) -> None:
        self._done = threading.Lock()
        self._done.acquire()  # released when the result is in
        self._value: R | None = None
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Slot[R]], None]] | None = []

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for the result; False when ``timeout`` seconds went first."""
        if not self._done.acquire(timeout=-1 if timeout is None else max(timeout, 0.0)):
            return False
        self._done.release()
        return True

    def result(self) -> R:
        """The result, or the handler's exception raised."""
        self.wait()
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]

    def exception(self) -> BaseException | None:
        """The handler's exception (after the result is in), or None."""
        return self._error

    def add_done_callback(self, callback: Callable[[Slot[R]], None]) -> None:
        """Call ``callback(self)`` once the result is in (now, if it is)."""
        with _SLOT_CALLBACKS:
            if self._callbacks is not None:
                self._callbacks.append(callback)
                return
        callback(self)

    def _settle(self, value: R | None, error: BaseException | None) -> None:
        self._value, self._error = value, error
        with _SLOT_CALLBACKS:
            callbacks, self._callbacks = self._callbacks, None
        self._done.release()
        for callback in callbacks or ():
            callback(self)


#: Guards every slot's callback list (held for a list operation only).
_SLOT_CALLBACKS = threading.Lock()


class GroupCommitter(Generic[T, R]):
    """Hands items submitted from many threads to ``handler`` in batches, on one thread.

    ``handler`` gets a list of items and returns one result per item, in order (an exception
    as an item's result fails that item's caller alone; one raised fails them all). When the
    last batch had several items (callers are concurrent), the committer waits after the
    first item so that the callers about to submit share the batch; a lone caller never waits.
    With ``wave`` (threads of this process, which come back together when their batch is
    done) it waits until as many items as the last batch had are queued, ``linger`` seconds at
    most; without (remote callers, whose requests arrive spread out) the whole ``linger``: a
    batch then holds what arrived in that time, and fewer, larger commits leave more of a
    busy machine's CPU to the callers.
    """

    _STOP = object()

    def __init__(
        self,
        name: str,
        handler: Callable[[list[T]], Sequence[R]],
        max_batch: int,
        linger: float = 0.0,
        wave: bool = True,
    ) -> None:
        self._handler = handler
        self._max_batch = max_batch
        self._linger = linger
        self._wave = wave
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: T) -> Slot[R]:
        slot: Slot[R] = Slot()
        self._queue.put((item, slot))
        return slot

    def close(self) -> None:
        self._queue.put(self._STOP)
        self._thread.join()

    def _await_wave(self, size: int) -> None:
        """Wait up to ``linger`` seconds for ``size`` items (the last batch's callers coming
        back) to be queued."""
        deadline = time.monotonic() + self._linger
        while self._queue.qsize() + 1 < size and time.monotonic() < deadline:
            time.sleep(_WAVE_POLL_SECONDS)

    def _run(self) -> None:
        stopping = False
        last_batch_size = 0
        while not stopping:
            first = self._queue.get()
            if first is self._STOP:
                return
            if self._linger and last_batch_size > 1:
                if self._wave:
                    self._await_wave(last_batch_size)
                else:
                    time.sleep(self._linger)
            batch = [first]
            while len(batch) < self._max_batch:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is self._STOP:
                    stopping = True
                    break
                batch.append(nxt)
            last_batch_size = len(batch)
            try:
                results = self._handler([item for item, _ in batch])
            except BaseException as exc:  # handed to every waiting caller
                for _, slot in batch:
                    slot._settle(None, exc)
                continue
            for (_, slot), result in zip(batch, results, strict=True):
                if isinstance(result, BaseException):  # this item failed, the others did not
                    slot._settle(None, result)
                else:
                    slot._settle(result, None)
