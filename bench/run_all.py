"""Run every benchmark in bench/ in turn (make bench)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCHES = [
    "producer_bench.py",
    "latency_bench.py",
    "publish_bench.py",
    "offsets_bench.py",
    "checkback_bench.py",
    "checkback_history_bench.py",
    "retention_bench.py",
    "compaction_bench.py",
    "source_bench.py",
    "sink_bench.py",
]

if __name__ == "__main__":
    here = Path(__file__).parent
    for bench in BENCHES:
        print(f"=== {bench}", flush=True)
        subprocess.run([sys.executable, str(here / bench)], check=True)
