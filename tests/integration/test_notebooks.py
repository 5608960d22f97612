"""The notebooks run top to bottom (a failing cell fails the test), and are stored with the
outputs of the code they hold now (``make notebook-outputs`` stores them)."""

from __future__ import annotations

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
def test_notebook_runs(path: Path) -> None:
    outputs = [o for cell in execute(path).cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    if path.stem == "03_operations":
        assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not drawn"
