"""examples/engine_quickstart.ipynb runs top to bottom in a real Jupyter kernel (nbclient + ipykernel).

A kernel executes cells inside its own running event loop, which is where engines built on asyncio usually
break; the notebook also awaits the async API at top level.
"""

from __future__ import annotations

import os
import re
import sys

import nbformat
from nbclient import NotebookClient

NOTEBOOK = os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "examples", "engine_quickstart.ipynb")


def cell_text(cell) -> str:
    return "".join(o.get("text", "") or "".join(o.get("data", {}).get("text/plain", "")) for o in cell.outputs)


def test_engine_quickstart_notebook_executes(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    # Prove the kernel is this virtual environment's ipykernel, not some other Python's.
    notebook.cells.insert(0, nbformat.v4.new_code_cell("import sys; print(sys.prefix)"))
    client = NotebookClient(notebook, kernel_name="python3", timeout=600, resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError on the first failing cell

    assert cell_text(notebook.cells[0]).strip() == sys.prefix
    outputs = "\n".join(cell_text(cell) for cell in notebook.cells if cell.cell_type == "code")
    assert "'What is the capital of France?' ->" in outputs
    second = int(re.search(r"cached tokens of the second request: *(\d+)", outputs).group(1))
    prompt = int(re.search(r"prompt tokens: *(\d+)", outputs).group(1))
    assert 0 < second < prompt, "the second request reuses the shared system prompt from the radix cache"
    assert "'finish_reason'" in outputs
