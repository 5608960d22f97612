"""A child process whose disk fills up: the process's file size limit refuses a write part-way,
as a full disk would (``EFBIG`` rather than ``ENOSPC``, the same path through the code)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_on_a_full_disk(root: Path, limit: int, body: str) -> subprocess.CompletedProcess[str]:
    """Run ``body`` in a child Python that has ``store``, a Store at ``root`` with intake on
    (its folders already made), and ``Message``, and whose files cannot grow past ``limit``
    bytes."""
    child = textwrap.dedent(
        f"""
        import resource, signal
        from rmq_spark import Message, Store
        from rmq_spark.model.config import StoreSettings
        store = Store.open({str(root)!r}, settings=StoreSettings(intake=True))
        store.prepare([Message("Warm", b"x")], "Warm")  # the folders, the marker: made
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))
        """
    ) + textwrap.dedent(body)
    return subprocess.run(
        [sys.executable, "-c", child], cwd=REPO, capture_output=True, text=True, timeout=120
    )
