"""Run the notebooks top to bottom and store them with their outputs (tables and plots), so that
a code host shows what they show: ``make notebook-outputs`` (``python -m tests.notebook_outputs``).

Each notebook records a hash of its code cells' sources in its metadata (:data:`SOURCES_KEY`);
the suite checks that the stored outputs come from the code as it is now
(tests/integration/test_notebooks.py): edit a cell and forget to run this, and it fails.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))
#: The notebook metadata key holding :func:`sources_hash` of the code its outputs came from.
SOURCES_KEY = "rmq_spark_sources"


def sources_hash(notebook: nbformat.NotebookNode) -> str:
    """A hash of the notebook's code cells, in order."""
    digest = hashlib.sha256()
    for cell in notebook.cells:
        if cell.cell_type == "code":
            digest.update(cell.source.encode() + b"\0")
    return digest.hexdigest()


def execute(path: Path) -> nbformat.NotebookNode:
    """The notebook at ``path``, run top to bottom in its folder (a failing cell raises)."""
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(path.parent)}},
    ).execute()
    return notebook


def main() -> int:
    for path in NOTEBOOKS:
        print(f"running {path.name} ...", flush=True)
        notebook = execute(path)
        notebook.metadata[SOURCES_KEY] = sources_hash(notebook)
        nbformat.write(notebook, path)
    print(f"stored {len(NOTEBOOKS)} notebook(s) with their outputs", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
