"""The README's and docs/'s Python examples run as pasted: in order, in one Python session
started in an empty folder (the working folder the README sets up), the README's first and then
those of the docs/ pages that continue its session; then the README's shell commands marked
``<!-- run: ... -->`` run in that folder with the project's ``rmqtx`` on ``PATH``. So the
documentation cannot drift from the code, and the commands see the store the examples wrote.

Every fenced block carries a language tag; only ```python blocks run, and a Python block marked
``<!-- not run: why -->`` on the line before is only compiled. The blocks run in one child
process (this suite's SparkSession stays untouched), each in the namespace the blocks before it
left; the first block that raises, or leaves a streaming query running, fails the test, named
by its file, line and first line.
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
DOCS = REPO / "docs"
#: The docs/ pages whose Python examples continue the README's session, in the order they run.
CONTINUED = ("reading.md", "sink.md")
NOT_RUN = re.compile(r"^<!--\s*not run:\s*(?P<why>.+?)\s*-->$")
SHELL_RUN = re.compile(r"^<!--\s*run:.*-->$")
#: The whole run, Spark's start included; a block still running then is named.
TIMEOUT = 480

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
        report["running"] = [block["file"], block["line"]]
        save()
        print(f"\n===== {block['file']} line {block['line']}: {block['first']}", flush=True)
        started = time.monotonic()
        # Padded so that tracebacks name the page's own line numbers.
        code = compile("\n" * (block["line"] - 1) + block["code"], block["file"], "exec")
        try:
            exec(code, namespace)
            from pyspark.sql import SparkSession

            spark = SparkSession.getActiveSession()
            running = [q.name or q.id for q in spark.streams.active] if spark else []
            if running:
                raise AssertionError(f"streaming queries still running after it: {running}")
        except BaseException:
            report["failed"] = {
                "at": [block["file"], block["line"]], "error": traceback.format_exc()
            }
            save()
            sys.exit(1)
        report["done"].append([block["file"], block["line"], round(time.monotonic() - started, 1)])
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
    """One fenced block of a Markdown page."""

    file: str  # the page, relative to the repository
    line: int  # the page's line of its first line of code
    language: str
    code: str
    not_run: str | None  # why, when marked ``<!-- not run: ... -->``
    shell_run: bool  # a shell block marked ``<!-- run: ... -->``

    @property
    def first(self) -> str:
        return next((s for s in self.code.splitlines() if s.strip()), "")

    def name(self) -> str:
        return f"{self.file} line {self.line} ({self.first!r})"


def readme_blocks(page: Path) -> list[Block]:
    """Every fenced block of ``page``, in order."""
    file = str(page.relative_to(REPO))
    lines = page.read_text().splitlines()
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
                file=file,
                line=opened + 1,
                language=lines[opened - 1][3:].strip(),
                code="\n".join(lines[opened : number - 1]) + "\n",
                not_run=marked["why"] if marked else None,
                shell_run=SHELL_RUN.match(before) is not None,
            )
        )
        opened = None
    assert opened is None, f"{file} line {opened}: a code block is never closed"
    return blocks


def test_every_block_is_tagged_and_python_compiles() -> None:
    for page in [README, *sorted(DOCS.glob("*.md"))]:
        blocks = readme_blocks(page)
        untagged = [b.line - 1 for b in blocks if not b.language]
        assert not untagged, (
            f"{page.name}: fences at lines {untagged} have no language: tag them (```python "
            "runs in the test; ```bash, ```toml, ```text do not)"
        )
        for block in (b for b in blocks if b.language == "python"):
            try:
                compile(block.code, block.name(), "exec")
            except SyntaxError as exc:
                raise AssertionError(f"{block.name()} is not valid Python: {exc}") from exc


def test_every_python_block_runs_or_says_why_not() -> None:
    """A docs/ page with a runnable Python block must be in CONTINUED, or it never runs."""
    readme = [b for b in readme_blocks(README) if b.language == "python"]
    assert len([b for b in readme if b.not_run is None]) >= 4, "the README's examples are gone"
    assert all(b.not_run is None for b in readme), "every README example runs"
    for page in sorted(DOCS.glob("*.md")):
        runnable = [b for b in readme_blocks(page) if b.language == "python" and not b.not_run]
        assert not runnable or page.name in CONTINUED, (
            f"{runnable[0].name()} never runs: add {page.name} to CONTINUED, or mark the block "
            "<!-- not run: why -->"
        )


def test_readme_and_docs_examples_run_in_order_then_its_commands(tmp_path: Path) -> None:
    pages = [README, *(DOCS / name for name in CONTINUED)]
    runnable = [
        b
        for page in pages
        for b in readme_blocks(page)
        if b.language == "python" and b.not_run is None
    ]
    folder = tmp_path / "rmq-tour"
    folder.mkdir()
    blocks_file, report_file = tmp_path / "blocks.json", tmp_path / "report.json"
    blocks_file.write_text(
        json.dumps(
            [{"file": b.file, "line": b.line, "first": b.first, "code": b.code} for b in runnable]
        )
    )
    # As a new user: no settings file named, no failpoint armed, not under spark-submit, and
    # the project's environment active (its python and rmqtx first on PATH).
    unset = ("RMQ_SPARK_CONF", "RMQ_SPARK_FAILPOINT", "PYSPARK_GATEWAY_PORT")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    env["PYTHONPATH"] = str(REPO)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
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
    by_place = {(b.file, b.line): b for b in runnable}
    failed = report.get("failed")
    if failed:
        raise AssertionError(
            f"{by_place[tuple(failed['at'])].name()} raised:\n{failed['error']}\n"
            f"--- the run's output, last lines ---\n{log[-6000:]}"
        )
    if report.get("running"):
        raise AssertionError(
            f"{by_place[tuple(report['running'])].name()} was still running after "
            f"{elapsed:.0f} s (exit code {child.returncode}):\n{log[-6000:]}"
        )
    assert child.returncode == 0, f"exit code {child.returncode}:\n{log[-6000:]}"
    assert [(f, line) for f, line, _ in report["done"]] == list(by_place)
    print("seconds per block:", report["done"], f"total {elapsed:.0f} s")
    _run_readme_commands(folder, env)


def _run_readme_commands(folder: Path, env: dict[str, str]) -> None:
    """The README's shell blocks marked ``<!-- run: ... -->``, line by line, in the working
    folder: they must work there, on the store the Python examples wrote (#48: they named
    ``.venv/bin/rmqtx``, which the working folder does not have, and the repository's store)."""
    shell = [b for b in readme_blocks(README) if b.shell_run]
    assert shell, "the README's commands to run are gone"
    outputs = {}
    for block in shell:
        for command in (c.split("#")[0].strip() for c in block.code.splitlines()):
            if not command:
                continue
            done = subprocess.run(
                ["bash", "-c", command], cwd=folder, env=env, capture_output=True, timeout=120
            )
            text = done.stdout.decode() + done.stderr.decode()
            assert done.returncode == 0, (
                f"{block.name()}: {command!r} exited {done.returncode}:\n{text}"
            )
            outputs[command.split()[1]] = text
    # The examples' store: its topic and the group the README's stream recorded.
    assert "OrderEvents" in outputs["status"] and "billing" in outputs["status"], outputs["status"]
    assert "o-1" in outputs["tail"], outputs["tail"]
