"""Fixtures of the integration tests shared by several modules."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

GO_CLIENT = Path(__file__).resolve().parents[1] / "serve_clients" / "go"


@pytest.fixture(scope="module")
def go_client(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Go client's examples (tests/serve_clients/go), built with the machine's
    Go; the client's module comes from the Go module proxy. Without Go the test is skipped,
    except under ``make test`` (``RMQ_SPARK_GO=required``), where that is an error."""
    if shutil.which("go") is None:
        reason = "no Go toolchain ('go') on PATH"
        if os.environ.get("RMQ_SPARK_GO") == "required":
            pytest.fail(reason)
        pytest.skip(reason)
    binary = tmp_path_factory.mktemp("go") / "go-client"
    subprocess.run(
        ["go", "build", "-o", str(binary), "."],
        cwd=GO_CLIENT,
        env={**os.environ, "GOFLAGS": "-mod=readonly"},
        check=True,
        capture_output=True,
        timeout=900,
    )
    return binary
