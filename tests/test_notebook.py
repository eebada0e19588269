"""benchmarks/zero_vs_ddp.ipynb executes headless at its small size (ZX_NOTEBOOK_SMALL=1:
it runs a small fake-backend memory benchmark and a quick optimizer benchmark itself)
with the venv's own kernel, no cell raises, and the plots come out as images.
nbclient/nbformat/ipykernel/matplotlib are test dependencies (make test installs them):
if they are missing this test fails rather than skips."""
import os
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

REPO = Path(__file__).resolve().parent.parent
NOTEBOOK = REPO / "benchmarks" / "zero_vs_ddp.ipynb"
TIMEOUT_S = 110           # per cell; the whole notebook takes well under this


def test_notebook_executes_small(tmp_path, monkeypatch):
    try:
        import nbformat
        from nbclient import NotebookClient
        from nbclient.exceptions import CellExecutionError
        import ipykernel  # noqa: F401  (the kernel the client starts)
        import matplotlib  # noqa: F401
    except ImportError as e:
        pytest.fail(f"notebook dependencies missing ({e}); `make test` installs nbconvert nbclient "
                    f"ipykernel matplotlib into .venv")

    monkeypatch.setenv("ZX_NOTEBOOK_SMALL", "1")
    monkeypatch.setenv("ZX_REPO", str(REPO))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("MPLCONFIGDIR", str(tmp_path / "mpl"))
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, timeout=TIMEOUT_S, kernel_name="python3",
                            resources={"metadata": {"path": str(REPO / "benchmarks")}})
    t0 = time.perf_counter()
    try:
        client.execute()
    except CellExecutionError as e:
        pytest.fail(f"a notebook cell raised:\n{e}")
    elapsed = time.perf_counter() - t0
    nbformat.write(nb, tmp_path / "executed.ipynb")

    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, errors
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert images, "the executed notebook has no image outputs"
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    # the kernel is this interpreter's environment: it imported this checkout's zero_ext
    assert str(REPO / "zero_ext") in text, text[:2000]
    print(f"notebook executed in {elapsed:.1f} s, {len(images)} images")
