"""The notebooks run headless (nbclient) in quick mode: a cell that raises, or an ``assert`` in a notebook that
fails (each compares against DynamicCache, exact attention or the committed JSON), fails the test.
``make notebooks`` runs them with ``PIKV_NOTEBOOKS=full`` on the real models."""

from __future__ import annotations

from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOKS = sorted((Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))


def test_every_notebook_is_collected():
    assert [p.stem[:2] for p in NOTEBOOKS] == ["01", "02", "03", "04"]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_runs(path, monkeypatch):
    monkeypatch.delenv("PIKV_NOTEBOOKS", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(
        notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(path.parent)}}
    ).execute()
    outputs = [o for cell in notebook.cells if cell.cell_type == "code" for o in cell.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    assert any(o.output_type == "stream" for o in outputs)  # the notebook printed its measurements
