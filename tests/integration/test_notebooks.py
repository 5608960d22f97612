"""The notebooks run top to bottom (a failing cell fails the test), and are stored without
outputs."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_there_are_notebooks() -> None:
    assert [n.name for n in NOTEBOOKS] == [
        "01_quick_start.ipynb",
        "02_streaming_pipeline.ipynb",
        "03_operations.ipynb",
    ]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path: Path, tmp_path: Path) -> None:
    notebook = nbformat.read(path, as_version=4)
    assert all(
        not cell.get("outputs") and cell.get("execution_count") is None
        for cell in notebook.cells
        if cell.cell_type == "code"
    ), f"{path.name} is committed with outputs; clear them"
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    )
    client.execute()
    outputs = [o for cell in notebook.cells for o in cell.get("outputs", [])]
    assert not [o for o in outputs if o.output_type == "error"]
    if path.stem == "03_operations":
        assert any("image/png" in o.get("data", {}) for o in outputs), "the plot was not drawn"
