"""Ctrl-C and stopped queries, quietly: what a person sees is one line, not tracebacks.

PySpark's own SIGINT handler calls the JVM from inside the signal handler, on the main thread,
which is usually itself waiting in a call to the JVM (``query.awaitTermination()``): py4j
then logs a re-entrant call and a ``KeyboardInterrupt`` at ERROR with their tracebacks, the
script dies with a third, and the JVM, losing its Python side, logs the query's failure. About
170 lines, none of them about the epoch (#48). :func:`install` puts a handler before it that,
while streaming queries run, stops them as ``query.stop()`` does (from a thread of its own, so
that the main thread's call to the JVM is left alone), and logs one line per query: the
sink's epoch in flight is rolled back by the stop and replayed once from the checkpoint
(docs/sink.md). ``awaitTermination()`` then returns as after any stop. A second Ctrl-C, or one
while no query runs, goes to PySpark's handler (it cancels the running jobs).

It also keeps a stopped query's interrupted task from printing an ``EOFError`` traceback:
PySpark's accumulator server reports any connection the JVM closes as an error, and a stopped
task's connection is closed mid-way.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql.streaming import StreamingQuery

log = logging.getLogger(__name__)

#: How often the handler looks whether the queries stopped (a second Ctrl-C is taken then).
_POLL_SECONDS = 0.2


def install(spark: SparkSession) -> None:
    """Make Ctrl-C stop ``spark``'s streaming queries quietly, and quiet the accumulator
    server; idempotent. Only on the main thread, and only over PySpark's own SIGINT handler
    (a handler the application installed is left alone)."""
    _quiet_accumulator_server(spark)
    if threading.current_thread() is not threading.main_thread():
        return
    current = signal.getsignal(signal.SIGINT)
    if isinstance(current, _StopQueriesOnInterrupt) or not _is_pysparks(current):
        return
    signal.signal(signal.SIGINT, _StopQueriesOnInterrupt(spark, current))


def _is_pysparks(handler: Any) -> bool:
    return callable(handler) and getattr(handler, "__module__", "").startswith("pyspark.")


class _StopQueriesOnInterrupt:
    """The SIGINT handler: stop the active streaming queries, or hand over to PySpark's."""

    def __init__(self, spark: SparkSession, fallback: Callable[[int, FrameType | None], Any]):
        self.spark = spark
        self.fallback = fallback
        self.stopping = False

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if self.stopping:  # a second Ctrl-C while the queries stop: the user insists
            self.fallback(signum, frame)
            return
        self.stopping = True
        try:
            queries = self._off_thread(lambda: self.spark.streams.active)
            if not queries:  # none, or the session is going away: PySpark's handler
                self.fallback(signum, frame)
                return
            for query in queries:
                # Every attribute of a query calls the JVM: read off the main thread too.
                label, batch = self._off_thread(lambda q=query: _describe(q)) or ("?", "?")
                # Logged here, on the main thread: a thread of ours that logs could wait
                # forever for a logging lock the interrupted main thread holds.
                log.warning(
                    "rmqtx: Ctrl-C: stopping streaming query %s (%s); a batch in flight is "
                    "rolled back and replayed once when the query restarts from its "
                    "checkpoint. Ctrl-C again interrupts at once.",
                    label,
                    batch,
                )
                self._off_thread(query.stop)
        finally:
            self.stopping = False

    @staticmethod
    def _off_thread(call: Callable[[], Any]) -> Any:
        """``call()`` on a thread of its own (it calls the JVM, and the main thread may be in
        such a call already), waited for here; None if it raised."""
        result: list[Any] = [None]

        def run() -> None:
            with contextlib.suppress(Exception):
                result[0] = call()

        worker = threading.Thread(target=run, name="rmqtx-interrupt", daemon=True)
        worker.start()
        while worker.is_alive():
            worker.join(_POLL_SECONDS)  # a second Ctrl-C is taken between the waits
        return result[0]


def _describe(query: StreamingQuery) -> tuple[str, str]:
    """(its name, or id; its last committed batch), read from the JVM."""
    progress = query.lastProgress
    batch = (
        f"batch {progress['batchId']} was the last committed"
        if progress
        else ("no batch committed yet")
    )
    return (f"'{query.name}'" if query.name else str(query.id)), batch


def _quiet_accumulator_server(spark: SparkSession) -> None:
    """PySpark's accumulator server prints an ``EOFError`` traceback for a connection the JVM
    closed, which a stopped query's interrupted task does; that is no error (the JVM opens a
    new connection for its next update), so it is logged at DEBUG instead."""
    server = getattr(spark.sparkContext, "_accumulatorServer", None)
    if server is None or getattr(server.handle_error, "rmqtx_quiet", False):
        return
    default = server.handle_error

    def handle_error(request: Any, client_address: Any) -> None:
        if isinstance(sys.exc_info()[1], EOFError):
            log.debug("the JVM closed an accumulator connection %s", client_address)
            return
        default(request, client_address)

    handle_error.rmqtx_quiet = True  # type: ignore[attr-defined]
    server.handle_error = handle_error
