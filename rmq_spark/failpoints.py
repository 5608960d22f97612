"""Crash points for fault tests. ``RMQ_SPARK_FAILPOINT=<name>`` makes the whole session die
with SIGKILL when the code reaches that point: the session leader's process group (the driver
and its JVM) and the caller's own group (PySpark's worker daemon has a group of its own), as
when a machine is lost. ``RMQ_SPARK_FAILPOINT=<name>:raise`` instead raises in the first
attempt of a Spark task (Spark then retries it). Unset, a failpoint costs one environment
lookup.

Names: ``sink.staged`` (a task's half messages are durable), ``sink.closed`` (the epoch's
row is in ``epochs``, nothing decided yet), ``sink.published`` (the epoch is published, Spark
has not recorded the batch yet), ``delta.staged``, ``delta.written`` and ``delta.closed``
(the same steps of :func:`rmq_spark.sink.publish_with_delta_write`), ``redrive.claimed``
(:func:`rmq_spark.checkback.redrive` has claimed discard rows, staged nothing yet),
``pending.computed`` (:func:`rmq_spark.pending.update_pending` has computed the new pending
rows, committed nothing yet).
"""

from __future__ import annotations

import os
import signal

ENV = "RMQ_SPARK_FAILPOINT"


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
