"""torch.compile and the simulated mesh: a compiled function called inside the per-device function
runs uncompiled there (Dynamo cannot trace under the simulation's vmap levels), with the numbers of
the uncompiled piece, forward and backward (backends/simulated/_compiled.py)."""

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
