"""Randomness policy: random factories draw the same stream on every instance, so they are
invariant; the simulated backend and the check-only (tracked) backend agree on that."""

import pytest
import torch

import named_spmd as ns
from named_spmd import P

RANDOM_FACTORIES = {
    "rand": lambda x: torch.rand(3),
    "rand_like": lambda x: torch.rand_like(x),
    "randn_like": lambda x: torch.randn_like(x),
    "randint_like": lambda x: torch.randint_like(x, 5),
}


def _vma_inside(make, run_check: bool) -> frozenset:
    seen = {}

    def f(x):
        seen["vma"] = ns.vma(make(x))
        return x

    mapped = ns.spmd_map(f, mesh=ns.make_mesh((2,), ("i",)), in_specs=P("i"), out_specs=P("i"))
    if run_check:
        mapped.check(torch.ones(4))
    else:
        mapped(torch.ones(4))
    return seen["vma"]


@pytest.mark.parametrize("name", sorted(RANDOM_FACTORIES))
def test_random_factories_are_invariant_on_both_backends(name):
    simulated = _vma_inside(RANDOM_FACTORIES[name], run_check=False)
    checked = _vma_inside(RANDOM_FACTORIES[name], run_check=True)
    assert simulated == checked == frozenset()


def test_random_values_are_the_same_on_every_instance():
    mesh = ns.make_mesh((4,), ("i",))
    torch.manual_seed(0)
    draws = ns.spmd_map(
        lambda x: x + torch.randn(1, 5), mesh=mesh, in_specs=P("i"), out_specs=P("i")
    )(torch.zeros(4, 5))
    torch.manual_seed(0)
    expected = torch.randn(1, 5).expand(4, 5)
    torch.testing.assert_close(draws, expected)


def test_simulation_order_changes_nothing_but_speed():
    """The nesting order override gives the same values, gradients and vma; a bad order raises."""
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    seen = {}

    @ns.spmd_map(mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp", None))
    def mlp(x, w):
        h = torch.tanh(x @ w)
        seen.setdefault("vma", []).append(ns.vma(h))
        return ns.psum(h.sum(-1, keepdim=True), "tp")

    x = torch.randn(8, 16, dtype=torch.float64, requires_grad=True)
    w = torch.randn(16, 32, dtype=torch.float64, requires_grad=True)
    results = []
    for order in (None, ("dp", "tp"), ("tp", "dp")):
        with ns.simulation_order(*order) if order else _nullcontext():
            y = mlp(x, w)
        results.append((y, *torch.autograd.grad(y.sum(), (x, w))))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(a, b)
    assert seen["vma"] == [frozenset({"dp", "tp"})] * 3
    with ns.simulation_order("dp"), pytest.raises(ns.SpmdError, match="exactly once each"):
        mlp(x, w)


def _nullcontext():
    import contextlib

    return contextlib.nullcontext()
