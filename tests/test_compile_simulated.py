"""torch.compile and the simulated mesh: a compiled function called inside the per-device function
runs uncompiled there (Dynamo cannot trace under the simulation's vmap levels), with the numbers of
the uncompiled piece, forward and backward (backends/simulated/_compiled.py); a mapped call inside a
compiled program runs eagerly, with a graph break around it (SpmdFunction.__call__)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

import named_spmd as ns
from named_spmd import P


def _mlp(piece):
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def f(x, w1, b1, w2):
        return ns.psum(piece(x @ w1 + b1) @ w2, "tp")

    specs = (P("dp", None), P(None, "tp"), P("tp"), P("tp", None))
    return ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=P("dp", None))


def _args():
    g = torch.Generator().manual_seed(0)
    shapes = ((6, 5), (5, 8), (8,), (8, 3))
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def _raw(h):
    return torch.tanh(h) * torch.sigmoid(h)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_piece_inside_runs_uncompiled_with_the_same_numbers(backend):
    counter = CompileCounterWithBackend(backend)
    piece = torch.compile(_raw, backend=counter, fullgraph=True)
    compiled, plain = _mlp(piece), _mlp(_raw)
    args = _args()
    for _ in range(2):  # the first call meets the refusal and runs again; the second runs at once
        got, want = compiled(*args), plain(*args)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
        g_got = torch.autograd.grad((got * got).sum(), args)
        g_want = torch.autograd.grad((want * want).sum(), args)
        for a, b in zip(g_got, g_want):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    assert counter.frame_count == 0  # nothing was compiled: the piece ran its original code
    # outside the mapped function the piece still compiles
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.allclose(piece(x), _raw(x))
    assert counter.frame_count == 1


def _dict_mlp():
    """Parameters in a dict (what pytree-prefix in_specs invite)."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def f(x, p):
        return ns.psum(_raw(x @ p["w1"] + p["b1"]) @ p["w2"], "tp")

    specs = (P("dp", None), {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)})
    return ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=P("dp", None))


# Dynamo itself (torch 2.13, variables/builder.py wrap_tensor) reads `.grad` of the non-leaf
# tensor it hands across the graph break; under the default warning filters nothing is shown
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_program_runs_a_simulated_call_eagerly_with_the_same_numbers(backend):
    """The whole call inside a compiled step: a graph break around it, the ops around it
    compiled; values and gradients are the eager step's, whatever the arguments' pytree."""
    f = _dict_mlp()
    x, w1, b1, w2 = _args()
    params = {"w1": w1, "b1": b1, "w2": w2}

    def step(x, p):
        return (f(torch.sin(x), p) ** 2).sum() * 0.5

    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter)
    for _ in range(2):
        got, want = compiled(x, params), step(x, params)
        assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
        g_got = torch.autograd.grad(got, [x, *params.values()])
        g_want = torch.autograd.grad(want, [x, *params.values()])
        for a, b in zip(g_got, g_want):
            assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)
    # sin before the call and the loss after it compiled, once each: no recompile on step 2
    assert counter.frame_count == 2


def test_fullgraph_names_why_a_simulated_call_cannot_be_traced():
    f = _dict_mlp()
    x, w1, b1, w2 = _args()
    compiled = torch.compile(lambda x, p: f(x, p).sum(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="simulated mesh runs eagerly") as info:
        compiled(x, {"w1": w1, "b1": b1, "w2": w2})
    assert "fullgraph=True" in str(info.value)  # the fix
