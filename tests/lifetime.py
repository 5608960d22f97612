"""Helpers that tie a test's child processes to the test run's lifetime."""

from __future__ import annotations

import ctypes
import signal


def die_with_parent() -> None:
    """In a child, before exec: get SIGKILLed when its parent dies (Linux
    ``PR_SET_PDEATHSIG``), so a killed test run leaves no servers or workers behind."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
