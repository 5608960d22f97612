"""Background chores at process exit: the one under way finishes, the ones not started are
dropped, and the process exits cleanly (a daemon thread stopped by the interpreter's shutdown
inside pyarrow's C++ aborted the check-back job with SIGABRT)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent(
    """
    import io, threading, time
    import pyarrow as pa, pyarrow.parquet as pq
    from rmq_spark.delta.chores import Chores

    table = pa.table({"x": pa.array(range(1_000_000))})
    started = threading.Event()

    def checkpoint():
        started.set()
        time.sleep(0.5)
        for _ in range(10):
            pq.write_table(table, io.BytesIO())
        print("checkpoint written", flush=True)

    chores = Chores("test-chores")
    chores.ask("checkpoint", checkpoint)
    chores.ask("cleanup", lambda: print("cleanup ran", flush=True))
    started.wait()
    print("exiting", flush=True)
    """
)


def test_exit_waits_for_the_chore_under_way_and_drops_the_rest() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exiting", "checkpoint", "written"], done.stdout
