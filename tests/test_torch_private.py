"""Private torch names live in named_spmd/_torch_private.py only, and each still does what the
library relies on (a torch upgrade that changes one fails here, by name).
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest
import torch

from named_spmd import _torch_private as P

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "named_spmd"
# What marks a private torch name (in code, strings and comments alike).
PRIVATE = re.compile(
    r"torch\._|torch\.ops\._|_functorch|_c10d_functional|_dtensor_spec|_local_tensor"
    r"|getrefcount|_use_count|_storage_Use_Count|_SingleLevelFunction|_execution_engine"
)


def private_names_outside(package: pathlib.Path) -> list[str]:
    """``file:line: text`` for every line outside _torch_private.py naming a private torch name."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.name == "_torch_private.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line):
                found.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    return found


def test_no_module_but_torch_private_names_a_private_torch_api():
    assert private_names_outside(PACKAGE) == []


def test_the_scan_finds_a_private_name(tmp_path):
    """The scan is not vacuous: a module naming ``torch._C`` is reported."""
    (tmp_path / "named_spmd").mkdir()
    (tmp_path / "named_spmd" / "_leaky.py").write_text(
        "import torch\nx = torch._C._get_tracing_state\n"
    )
    (tmp_path / "named_spmd" / "_torch_private.py").write_text("x = torch._C\n")  # allowed there
    found = private_names_outside(tmp_path / "named_spmd")
    assert found == ["named_spmd/_leaky.py:2: x = torch._C._get_tracing_state"]


# --- pins: each private name still behaves as the library uses it -----------------------------


def test_vmap_levels_entered_directly_round_trip():
    level = P.vmap_increment_nesting(3, "same")
    try:
        assert P.maybe_current_level() == level
        x = P.add_batch_dim(torch.arange(6.0).reshape(3, 2), 0, level)
        assert P.maybe_get_level(x) == level and P.is_batchedtensor(x)
        assert P.maybe_get_bdim(x) == 0
        assert P.get_unwrapped(x).shape == (3, 2)
        assert P.is_transform_wrapped(x)
        back = P.remove_batch_dim(x * 2, level, 3, 0)
    finally:
        P.vmap_decrement_nesting()
    assert torch.equal(back, torch.arange(6.0).reshape(3, 2) * 2)
    assert P.maybe_get_level(torch.ones(1)) == -1
    assert [i.key() for i in P.get_interpreter_stack() or []] == []


def test_transforms_active_and_the_current_interpreter():
    seen = []

    def f(x):
        seen.append((P.transforms_active(), P.current_interpreter().key()))
        return (x * x).sum()

    assert not P.transforms_active()
    torch.func.grad(f)(torch.ones(2))
    assert seen == [(True, P.TransformType.Grad)]


def test_function_base_apply_runs_a_function_without_python_binding():
    class Double(torch.autograd.Function):
        @staticmethod
        def forward(x):
            return x * 2

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 2

    fast = P.function_base_apply.__get__(None, Double)
    x = torch.ones(3, requires_grad=True)
    fast(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_single_level_function_applies_at_a_grad_level():
    class Identity(P.SingleLevelFunction):
        @staticmethod
        def forward(x):
            return x.view_as(x)

        @staticmethod
        def setup_context(ctx, inputs, output):
            pass

        @staticmethod
        def backward(ctx, g):
            return g * 3

    def f(x):
        with P.single_level_functions():
            return Identity.apply(x).sum()

    assert torch.equal(torch.func.grad(f)(torch.ones(2)), torch.full((2,), 3.0))


def test_reference_and_use_counts_see_every_holder():
    x = torch.ones(2)
    refs = P.refcount(x)
    also = x
    assert P.refcount(x) == refs + 1
    del also
    uses, storage_uses, storage_refs = P.use_counts(x)
    view = x.view(2)
    assert P.use_counts(x)[1] == storage_uses + 1  # a view is one more use of the storage
    held = x.untyped_storage()
    assert P.use_counts(x)[2] == storage_refs + 1  # a held storage object: one more reference
    del view, held
    assert isinstance(uses, int)


def test_queue_callback_refuses_outside_a_backward_pass():
    with pytest.raises(RuntimeError):
        P.queue_callback(lambda: None)
    ran = []

    class Hook(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.view_as(x)

        @staticmethod
        def backward(ctx, g):
            P.queue_callback(lambda: ran.append(True))
            return g

    Hook.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert ran == [True]


def test_graph_task_id_and_below_autograd():
    assert P.current_graph_task_id() == -1
    seen = []
    x = torch.ones(1, requires_grad=True)
    x.register_hook(lambda g: seen.append(P.current_graph_task_id()) or g)
    (x * 2).sum().backward()
    assert seen and seen[0] != -1
    with P.below_autograd():
        assert not (x * 2).requires_grad


def test_disable_torch_function_and_functorch():
    class Seen(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Seen.calls += 1
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(1) + 1
        with P.DisableTorchFunction():
            torch.ones(1) + 1
    assert Seen.calls == 2  # ones and add, outside the disabled block only
    P.vmap_increment_nesting(2, "same")
    try:
        with P.DisableFuncTorch():
            assert P.maybe_get_level(torch.arange(2)) == -1
    finally:
        P.vmap_decrement_nesting()


def test_the_distributed_names_resolve_lazily():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "from named_spmd import _torch_private as P\n"
        "assert 'torch.distributed.tensor' not in set(sys.modules) - before\n"
        "d = P.dist()\n"
        "assert callable(d.register_work) and callable(d.default_store)\n"
        "assert d.AsyncCollectiveTensor.__name__ == 'AsyncCollectiveTensor'\n"
        "assert d.wait_tensor.name() == '_c10d_functional::wait_tensor'\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
