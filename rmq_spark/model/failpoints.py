"""Crash points for fault tests. ``RMQ_SPARK_FAILPOINT=<name>`` makes the whole session die
with SIGKILL when the code reaches that point: the session leader's process group (the driver
and its JVM) and the caller's own group (PySpark's worker daemon has a group of its own), as
when a machine is lost. ``RMQ_SPARK_FAILPOINT=<name>:raise`` instead raises in the first
attempt of a Spark task (Spark then retries it). ``RMQ_SPARK_FAILPOINT=<name>:pause`` makes
the first process that reaches the point write its pid to ``$RMQ_SPARK_FAILPOINT_MARKER`` and
sleep until it is killed (a test kills it, or its executor, from outside); later ones go on.
``RMQ_SPARK_FAILPOINT=<name>:stop`` makes the first process that reaches the point write its pid
there and stop itself with SIGSTOP, as a GC or swap stall or a paused VM would; a test resumes it
with SIGCONT. Unset, a failpoint costs one environment lookup.

Names: ``sink.staged`` (a task's half messages are durable), ``sink.closed`` (the epoch's
row is in ``epochs``, nothing decided yet), ``sink.published`` (the epoch is published, Spark
has not recorded the batch yet), ``delta.staged``, ``delta.written`` and ``delta.closed``
(the same steps of :func:`rmq_spark.spark.sink.publish_with_delta_write`), ``redrive.claimed``
(:func:`rmq_spark.checkback.discards.redrive` has claimed discard rows, staged nothing yet),
``pending.computed`` (:func:`rmq_spark.checkback.pending.update_pending` has computed the
new pending rows, committed nothing yet), ``deltacommit.staged`` and ``deltacommit.committed``
(a direct append's log entry is staged, or has taken its version; :mod:`rmq_spark.delta.commit`),
``deltacommit.checkpoint`` (a checkpoint after a direct append starts), ``checkpoint.written``
(its file is in place, the ``_last_checkpoint`` hint not yet;
:mod:`rmq_spark.delta.checkpoints`), ``store.maintain``
(a compaction and log cleanup that a commit asked for starts); the steps of making a shard
(:meth:`rmq_spark.store.shards.Shards.grow`): ``shards.marked`` (the root's marker says
layout 3 or more, no shard made yet), ``storage.probed`` (an S3 conditional-write probe is written,
not yet removed), ``layout.table`` (a new store's or shard's first table is created, the
others not yet), ``layout.staged`` (a marker is staged on local disk, not renamed into place)
and ``shards.made`` (the shards' markers are in place, the root's count not raised yet);
``layout.read`` (the root's marker is read to be raised, not rewritten yet;
:func:`rmq_spark.store.layout.raise_layout`);
``deliveries.decided`` (messages decided for a dead-letter topic are committed, not yet
published there; :mod:`rmq_spark.store.deliveries`); ``decision.end`` (an end-transaction
request is taken, nothing looked up or decided yet) and ``decision.claimed`` (transactions'
decision objects are put, their decisions not recorded in ``op``;
:mod:`rmq_spark.store.decisions`); ``intake.landing`` (a producer's background landing of the
intake objects it staged starts: its sends returned, nothing of them is in ``half``),
``intake.listing`` (a landing that must list the intake objects has read ``half``'s
snapshot, not listed them yet), ``intake.written`` (on local disk, an intake object's temp
file is written, not renamed into place), ``intake.read`` (a recovery has read the intake
objects it found, landed nothing yet) and
``intake.landed`` (a landing's commit is in ``half``, its objects not deleted yet;
:mod:`rmq_spark.store.intake`).
"""

from __future__ import annotations

import os
import signal
import threading
import time

ENV = "RMQ_SPARK_FAILPOINT"
MARKER_ENV = "RMQ_SPARK_FAILPOINT_MARKER"


def failpoint(name: str) -> None:
    """Die here (SIGKILL to the session) if ``RMQ_SPARK_FAILPOINT`` names it."""
    armed = os.environ.get(ENV)
    if armed == name:
        os.killpg(os.getsid(0), signal.SIGKILL)
        os.killpg(os.getpgid(0), signal.SIGKILL)
    if armed == f"{name}:raise":
        from pyspark import TaskContext

        context = TaskContext.get()
        if context is not None and context.attemptNumber() == 0:
            raise RuntimeError(f"failpoint {name}: first task attempt fails")
    if armed == f"{name}:pause" and _first_here():
        while True:
            time.sleep(60)
    if armed == f"{name}:stop" and _first_here():
        # To this thread: sent to the process, the stop was taken by another thread, and this
        # one went on for some milliseconds on a busy machine (past the point under test).
        signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)


def _first_here() -> bool:
    """Whether this process is the first to reach the armed point (it writes its pid to the
    marker file; later ones find the file there)."""
    try:
        fd = os.open(os.environ[MARKER_ENV], os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        return False
    os.write(fd, str(os.getpid()).encode())
    os.close(fd)
    return True
