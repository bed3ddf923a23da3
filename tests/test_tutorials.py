"""Every tutorial executes top to bottom through a real Jupyter kernel; a cell that raises fails.

Each ``tutorials/NN_*.py`` (a jupytext percent script) is converted to a notebook and executed by
nbclient in an ipykernel running *this* interpreter (a kernelspec written at test time, so the
kernel sees the same environment as the tests). The tutorials assert their own claims against
references in their cells, so "executes" means "its claims hold". They run two at a time (each in
its own kernel process) to keep the suite's wall time down; each must finish within a minute,
except those that launch 4 processes with torchrun (two minutes), which run one after the other
so that they do not compete for the cores with each other.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import jupytext
import nbclient
import pytest

TUTORIALS = Path(__file__).resolve().parent.parent / "tutorials"
PATHS = sorted(TUTORIALS.glob("[0-9][0-9]_*.py"))
CELL_TIMEOUT_S = 60
TORCHRUN = ("09", "10")  # tutorials that launch 4 processes
KERNEL = "named-spmd-tests"


def _kernelspec_dir(root: Path) -> Path:
    """A kernelspec whose argv is this interpreter (not whatever 'python' is on PATH)."""
    spec = root / "kernels" / KERNEL
    spec.mkdir(parents=True, exist_ok=True)
    (spec / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "named_spmd tests",
                "language": "python",
            }
        )
    )
    return root


def _execute(path: Path) -> tuple[float, object]:
    """Run one tutorial; returns (seconds, executed notebook or the exception it raised)."""
    start = time.perf_counter()
    try:
        nb = jupytext.read(path)
        client = nbclient.NotebookClient(
            nb,
            kernel_name=KERNEL,
            timeout=CELL_TIMEOUT_S,
            resources={"metadata": {"path": str(TUTORIALS)}},
        )
        client.execute()
        return time.perf_counter() - start, nb
    except Exception as e:  # reported by the test of this tutorial
        return time.perf_counter() - start, e


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    root = _kernelspec_dir(tmp_path_factory.mktemp("jupyter"))
    old = os.environ.get("JUPYTER_PATH")
    os.environ["JUPYTER_PATH"] = os.pathsep.join(filter(None, [str(root), old]))
    try:
        # The torchrun ones in one task, one after the other; the longest tasks first so that
        # the last one to finish is a short one.
        launching = [p for p in PATHS if p.name[:2] in TORCHRUN]
        tasks = [launching] + sorted(
            ([p] for p in PATHS if p not in launching),
            key=lambda t: t[0].name[:2] in ("06", "07"),
            reverse=True,
        )
        with ThreadPoolExecutor(max_workers=2) as pool:
            done = pool.map(lambda task: [(p, _execute(p)) for p in task], tasks)
            results = {p: r for task in done for p, r in task}
    finally:
        if old is None:
            os.environ.pop("JUPYTER_PATH", None)
        else:
            os.environ["JUPYTER_PATH"] = old
    return results


def test_the_tutorials_are_numbered_1_to_13():
    assert [p.name[:2] for p in PATHS] == [f"{i:02d}" for i in range(1, 14)]


@pytest.mark.parametrize("path", PATHS, ids=[p.stem for p in PATHS])
def test_tutorial_executes_in_a_jupyter_kernel(executed, path):
    seconds, result = executed[path]
    print(f"{path.name}: {seconds:.1f}s")  # shown with pytest -s
    if isinstance(result, Exception):
        pytest.fail(f"{path.name} failed after {seconds:.1f}s:\n{result}", pytrace=False)
    outputs = [
        o for cell in result.cells if cell.cell_type == "code" for o in cell.get("outputs", [])
    ]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert outputs, f"{path.name} shows nothing"
    limit = 120 if path.name[:2] in TORCHRUN else 60
    assert seconds < limit, f"{path.name} took {seconds:.1f}s"


def test_rich_outputs_render_as_html(executed):
    """The quick start displays a mesh and a check report: Jupyter receives text/html for them."""
    _, nb = executed[TUTORIALS / "01_quickstart.py"]
    if isinstance(nb, Exception):
        pytest.fail(str(nb), pytrace=False)
    html = [
        o["data"]["text/html"]
        for cell in nb.cells
        for o in cell.get("outputs", [])
        if "text/html" in o.get("data", {})
    ]
    assert any("named-spmd-mesh" in h for h in html)
    assert any("named-spmd-check" in h for h in html)


def test_quickstart_runs_as_a_plain_script():
    """README's set-up command runs it with python, outside Jupyter."""
    done = subprocess.run(
        [sys.executable, str(TUTORIALS / "01_quickstart.py")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "y matches the single-device computation" in done.stdout


def test_tutorials_readme_lists_each_tutorial_once():
    text = (TUTORIALS / "README.md").read_text()
    for path in PATHS:
        lines = [line for line in text.splitlines() if f"({path.name})" in line]
        assert len(lines) == 1, path.name
        assert re.match(r"^\d+\. \[.+\]\(" + re.escape(path.name) + r"\): \S", lines[0]), lines[0]
