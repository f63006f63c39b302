"""The Colab notebooks: stored without outputs, and each runs top to bottom in test mode.

Each notebook executes in a fresh Jupyter kernel (nbclient) the way Colab would run it, except that
EJAX_NOTEBOOK_MODE=test shrinks every run (one sim task, a few training steps, a few RL updates).
The kernel starts in colab/ like a notebook opened from a checkout, sees one CPU device (the 8 fake
devices of tests/conftest.py are dropped, as on a Colab CPU runtime) and writes under tmp_path.
"""

from __future__ import annotations

import pathlib
import time

import nbformat
import pytest
from nbclient import NotebookClient

COLAB = pathlib.Path(__file__).resolve().parents[1] / "colab"
NOTEBOOKS = ("quickstart", "packing", "rl_vla3", "scaling")
PNG = "image/png"


def _read(name: str) -> nbformat.NotebookNode:
  return nbformat.read(COLAB / f"{name}.ipynb", as_version=4)


def test_every_notebook_is_listed():
  assert sorted(path.stem for path in COLAB.glob("*.ipynb")) == sorted(NOTEBOOKS)


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_stored_without_outputs_and_opens_with_what_and_how_long(name):
  notebook = _read(name)
  nbformat.validate(notebook)
  for index, cell in enumerate(notebook.cells):
    if cell.cell_type == "code":
      assert cell.outputs == [] and cell.execution_count is None, (
          f"colab/{name}.ipynb cell {index} has stored outputs: clear them "
          "(jupyter nbconvert --clear-output --inplace colab/*.ipynb)")
  first = notebook.cells[0]
  assert first.cell_type == "markdown" and "**Time:**" in first.source, "the first cell says what it shows and how long it takes"
  install = notebook.cells[1].source
  assert 'find_spec("ejax") is None' in install and "!pip install" in install


def _needs_image(source: str) -> bool:
  return "plt.show()" in source or "Image(filename" in source


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_in_test_mode(name, tmp_path, monkeypatch):
  monkeypatch.setenv("EJAX_NOTEBOOK_MODE", "test")
  monkeypatch.setenv("EJAX_NOTEBOOK_WORKDIR", str(tmp_path))
  monkeypatch.setenv("JAX_PLATFORMS", "cpu")
  monkeypatch.setenv("MPLBACKEND", "module://matplotlib_inline.backend_inline")
  monkeypatch.delenv("XLA_FLAGS", raising=False)
  notebook = _read(name)
  client = NotebookClient(notebook, timeout=600, kernel_name="python3",
                          resources={"metadata": {"path": str(COLAB)}})
  start = time.perf_counter()
  client.execute()  # raises CellExecutionError, naming the cell, on any error
  print(f"colab/{name}.ipynb: {time.perf_counter() - start:.0f} s")
  for index, cell in enumerate(notebook.cells):
    if cell.cell_type == "code" and _needs_image(cell.source):
      assert any(PNG in output.get("data", {}) for output in cell.outputs), (
          f"colab/{name}.ipynb cell {index} draws a figure but produced no PNG output")
  if name == "quickstart":
    html = [output["data"].get("text/html", "") for cell in notebook.cells if cell.cell_type == "code"
            for output in cell.outputs if "data" in output]
    assert any("<video" in text and "base64" in text for text in html), "the rollout video is not embedded"
