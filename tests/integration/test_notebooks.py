"""The notebooks run top to bottom (a failing cell fails the test), and are stored with the
outputs of the code they hold now (``make notebook-outputs`` stores them)."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest

from tests.notebook_outputs import NOTEBOOKS, SOURCES_KEY, execute, sources_hash


def test_there_are_notebooks() -> None:
    assert [n.name for n in NOTEBOOKS] == [
        "01_quick_start.ipynb",
        "02_streaming_pipeline.ipynb",
        "03_operations.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_stored_with_the_outputs_of_its_code(path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert notebook.metadata.get(SOURCES_KEY) == sources_hash(notebook), (
        f"{path.name}: its outputs are not those of its code as it is now; run "
        "'make notebook-outputs' and commit the notebooks"
    )
    assert all(cell.get("execution_count") is not None for cell in code), path.name
    outputs = [o for cell in code for o in cell.get("outputs", [])]
    assert outputs and not [o for o in outputs if o.output_type == "error"], path.name


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Top to bottom, leaving no ``rmq-*`` folder in the temporary directory (they did, #48)."""
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # the kernel's tempfile.mkdtemp
    outputs = [o for cell in execute(path).cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    assert not [p.name for p in tmp_path.iterdir() if p.name.startswith("rmq-")]
    if path.stem == "03_operations":
        assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not drawn"
        # The consumer group really lags: 0 after its run, 8 after the orders placed since.
        shown = "\n".join(o.get("data", {}).get("text/plain", "") for o in outputs)
        lags = re.findall(
            r"after (?:its run|10 more orders)\s+billing\s+OrderEvents\s+(\d+)", shown
        )
        assert lags == ["0", "8"], shown


def _code(name: str) -> str:
    notebook = nbformat.read(Path(NOTEBOOKS[0]).parent / name, as_version=4)
    return "\n".join(cell.source for cell in notebook.cells if cell.cell_type == "code")


def test_notebooks_show_what_a_reader_copies() -> None:
    """They imported undocumented helpers (``rmq_spark.ops.demo.OrderService``,
    ``make_orders``, ``ops.report.read_table``), so the listener, the thing to learn, was out
    of sight; 02's "stopped half-way" never stopped a running query (#48)."""
    for path in NOTEBOOKS:
        code = _code(path.name)
        assert "rmq_spark.ops.demo" not in code and "rmq_spark.ops.report" not in code, path.name
        assert "shutil.rmtree(workdir)" in code, f"{path.name} leaves its temporary folder"
    for name in ("01_quick_start.ipynb", "03_operations.ipynb"):
        code = _code(name)
        assert "(TransactionListener):" in code and "def check_local_transaction" in code, name
    pipeline = _code("02_streaming_pipeline.ipynb")
    assert 'processingTime="1 second"' in pipeline and "query.stop()" in pipeline
