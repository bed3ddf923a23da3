"""The README's quick start runs as written, and its two set-up commands stay the documented ones."""

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parent.parent / "README.md"


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


@pytest.mark.parametrize("index", range(len(python_blocks())))
def test_readme_python_block_runs(index):
    exec(compile(python_blocks()[index], f"README.md block {index}", "exec"), {})


def test_readme_names_the_ci_test_command():
    ci = (README.parent / ".ci" / "run").read_text()
    assert "python -m pytest" in README.read_text()
    assert "python -m pytest" in ci
    assert "torch==2.13.0" in ci


def test_readme_error_text_matches_the_library():
    import torch

    import named_spmd as ns
    from named_spmd import P

    mesh = ns.make_mesh((2, 4), ("dp", "tp"))

    @ns.spmd_map(mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp", None))
    def mlp(x, w):
        return torch.relu(x @ w).sum(-1, keepdim=True)

    with pytest.raises(ns.VmaError) as err:
        mlp(torch.randn(8, 16), torch.randn(16, 32))
    text = README.read_text()
    for line in str(err.value).splitlines()[1:]:
        assert line in text, line
