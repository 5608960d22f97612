"""README.md's Python examples run as pasted: in order, in one Python session started in an
empty folder (the model the README states), so the documentation cannot drift from the code.

Every fenced block carries a language tag; only ```python blocks run, and a Python block marked
``<!-- not run: why -->`` on the line before is only compiled. The blocks run in one child
process (this suite's SparkSession stays untouched), each in the namespace the blocks before it
left, with the working directory a fresh temporary folder; the first block that raises, or
leaves a streaming query running, fails the test, named by its README line and first line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<why>.+?)\s*-->$")
#: The whole README run, Spark's start included; a block still running then is named.
TIMEOUT = 420

#: Runs in the child: ``python -c RUNNER blocks.json report.json``.
RUNNER = r"""
import json, sys, time, traceback

blocks = json.load(open(sys.argv[1]))
report = {"done": [], "failed": None}

def save():
    with open(sys.argv[2], "w") as out:
        json.dump(report, out)

namespace = {"__name__": "__main__"}
try:
    for block in blocks:
        report["running"] = block["line"]
        save()
        print(f"\n===== README.md line {block['line']}: {block['first']}", flush=True)
        started = time.monotonic()
        # Padded so that tracebacks name the README's own line numbers.
        code = compile("\n" * (block["line"] - 1) + block["code"], "README.md", "exec")
        try:
            exec(code, namespace)
            from pyspark.sql import SparkSession

            spark = SparkSession.getActiveSession()
            running = [q.name or q.id for q in spark.streams.active] if spark else []
            if running:
                raise AssertionError(f"streaming queries still running after it: {running}")
        except BaseException:
            report["failed"] = {"line": block["line"], "error": traceback.format_exc()}
            save()
            sys.exit(1)
        report["done"].append([block["line"], round(time.monotonic() - started, 1)])
        sys.stdout.flush()
    report["running"] = None
    save()
finally:
    from pyspark.sql import SparkSession

    if SparkSession.getActiveSession() is not None:
        SparkSession.getActiveSession().stop()
"""


@dataclass(frozen=True)
class Block:
    """One fenced block of the README."""

    line: int  # README line of its first line of code
    language: str
    code: str
    not_run: str | None  # why, when marked ``<!-- not run: ... -->``

    @property
    def first(self) -> str:
        return next((s for s in self.code.splitlines() if s.strip()), "")

    def name(self) -> str:
        return f"README.md line {self.line} ({self.first!r})"


def readme_blocks(text: str) -> list[Block]:
    """Every fenced block of ``text``, in order."""
    lines = text.splitlines()
    blocks, opened = [], None
    for number, line in enumerate(lines, start=1):
        if not line.startswith("```"):
            continue
        if opened is None:
            opened = number
            continue
        before = lines[opened - 2].strip() if opened >= 2 else ""
        marked = NOT_RUN.match(before)
        blocks.append(
            Block(
                line=opened + 1,
                language=lines[opened - 1][3:].strip(),
                code="\n".join(lines[opened : number - 1]) + "\n",
                not_run=marked["why"] if marked else None,
            )
        )
        opened = None
    assert opened is None, f"README.md line {opened}: a code block is never closed"
    return blocks


def test_every_block_is_tagged_and_python_compiles() -> None:
    blocks = readme_blocks(README.read_text())
    untagged = [b.line - 1 for b in blocks if not b.language]
    assert not untagged, (
        f"README.md fences at lines {untagged} have no language: tag them (```python runs in "
        "the test; ```bash, ```toml, ```text do not)"
    )
    python = [b for b in blocks if b.language == "python"]
    not_run = [b.name() for b in python if b.not_run is not None]
    assert len(python) - len(not_run) >= 5, "the README's runnable examples are gone"
    assert len(not_run) <= 2, f"keep Python blocks that do not run rare: {not_run}"
    for block in python:
        try:
            compile(block.code, block.name(), "exec")
        except SyntaxError as exc:
            raise AssertionError(f"{block.name()} is not valid Python: {exc}") from exc


def test_docs_blocks_are_tagged_and_python_compiles() -> None:
    """docs/*.md's blocks as the README's: tagged, and each Python block valid (the one of
    docs/serve.md runs against a server in tests/integration/test_serve.py)."""
    docs = sorted((REPO / "docs").glob("*.md"))
    assert docs, "docs/ is gone"
    for doc in docs:
        blocks = readme_blocks(doc.read_text())
        untagged = [b.line - 1 for b in blocks if not b.language]
        assert not untagged, f"{doc.name}: fences at lines {untagged} have no language"
        for block in (b for b in blocks if b.language == "python"):
            compile(block.code, f"{doc.name} line {block.line}", "exec")


def test_readme_python_blocks_run_in_order(tmp_path: Path) -> None:
    blocks = [b for b in readme_blocks(README.read_text()) if b.language == "python"]
    runnable = [b for b in blocks if b.not_run is None]
    folder = tmp_path / "fresh"
    folder.mkdir()
    blocks_file, report_file = tmp_path / "blocks.json", tmp_path / "report.json"
    blocks_file.write_text(
        json.dumps([{"line": b.line, "first": b.first, "code": b.code} for b in runnable])
    )
    # As a new user: no settings file named, no failpoint armed, not under spark-submit.
    unset = ("RMQ_SPARK_CONF", "RMQ_SPARK_FAILPOINT", "PYSPARK_GATEWAY_PORT")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = str(REPO)
    started = time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", RUNNER, str(blocks_file), str(report_file)],
        cwd=folder,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # Spark's JVM and Python workers go with it on a time-out
    )
    try:
        output, _ = child.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        output, _ = child.communicate()
    elapsed = time.monotonic() - started
    log = output.decode(errors="replace")
    print(log[-20000:])
    report = json.loads(report_file.read_text()) if report_file.exists() else {}
    by_line = {b.line: b for b in runnable}
    failed = report.get("failed")
    if failed:
        raise AssertionError(
            f"{by_line[failed['line']].name()} raised:\n{failed['error']}\n"
            f"--- the run's output, last lines ---\n{log[-6000:]}"
        )
    if report.get("running"):
        raise AssertionError(
            f"{by_line[report['running']].name()} was still running after {elapsed:.0f} s "
            f"(exit code {child.returncode}):\n{log[-6000:]}"
        )
    assert child.returncode == 0, f"exit code {child.returncode}:\n{log[-6000:]}"
    assert [line for line, _ in report["done"]] == [b.line for b in runnable]
    print("seconds per block:", report["done"], f"total {elapsed:.0f} s")
