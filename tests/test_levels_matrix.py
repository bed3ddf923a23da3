"""Correctness matrix of the simulated backend's level primitives (backends/simulated/_levels.py).

Each collective is run alone, between two nonlinear elementwise maps, through every transform
(autograd and torch.func outside, a user vmap / grad / vjp / jvp inside the per-device function,
double backward, jacrev, jacfwd, functionalize) and compared with the same transform applied to a
dense single-device program written by hand from docs/design.md section 3, in float64.

The whole matrix runs twice: on the fast path (direct unwrapping of vmap levels, taken when only
vmaps sit above the collective's level) and with the fast path disabled (the autograd.Function
fallback), and a separate test pins *which* path each transform takes, so that the matrix cannot
silently test the fallback only. The fast path rests on private functorch APIs: a torch upgrade
that breaks them must fail here.

Runtime: about 15 s on 2 cores.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
from _reference import REF, assert_close_within, run_reference  # noqa: I001 (tests/ is on sys.path)
from torch.func import functionalize, grad, jacfwd, jacrev, jvp, vjp, vmap

import named_spmd as ns
from named_spmd import P
from named_spmd.backends.simulated import _levels, _lowered

F64 = torch.float64
TOL = 1e-10
A, B, C3 = 2, 3, 2
MESH = ns.make_mesh((A, B), ("a", "b"))
MESH3 = ns.make_mesh((A, B, C3), ("a", "b", "c"))


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def pre(t):
    return torch.sin(t)


def post(y):
    return y * torch.cos(y)


# --- the cases: (per-device collective, its dense global twin, specs) --------------------------


@dataclass(frozen=True)
class Case:
    collective: Callable  # per-device: (namespace of collectives, local tensor) -> local tensor
    dense: Callable  # global: pre(X) -> global result (plain torch)
    in_spec: P
    out_spec: P
    shape: tuple[int, ...]  # global input shape
    mesh: ns.Mesh = MESH


def _blocks_b(t):  # [6, 9] -> [6, b, 3]: the column blocks of the b instances
    return t.reshape(6, B, 3)


def _ppermute_dense(t):
    blocks = _blocks_b(t)
    return torch.cat([torch.zeros_like(blocks[:, :1]), blocks[:, :-1]], 1).reshape(6, 9)


CASES = {
    "psum b": Case(
        lambda o, x: o.psum(x, "b"), lambda t: _blocks_b(t).sum(1), P("a", "b"), P("a"), (6, 9)
    ),
    "psum (a, b)": Case(
        lambda o, x: o.psum(x, ("a", "b")),
        lambda t: t.reshape(A, 3, B, 3).sum((0, 2)),
        P("a", "b"),
        P(),
        (6, 9),
    ),
    "pmax b": Case(
        lambda o, x: o.pmax(x, "b"), lambda t: _blocks_b(t).amax(1), P("a", "b"), P("a"), (6, 9)
    ),
    "pmin a": Case(
        lambda o, x: o.pmin(x, "a"),
        lambda t: t.reshape(A, 3, 9).amin(0),
        P("a", "b"),
        P(None, "b"),
        (6, 9),
    ),
    "all_gather tiled varying": Case(
        lambda o, x: o.all_gather(x, "b", axis=1, tiled=True),
        lambda t: t.repeat(1, B),
        P("a", "b"),
        P("a", "b"),
        (6, 9),
    ),
    "all_gather untiled invariant": Case(
        lambda o, x: o.all_gather(x, "b", axis=1, to="invariant"),
        _blocks_b,
        P("a", "b"),
        P("a"),
        (6, 9),
    ),
    "all_gather (a, b) invariant": Case(
        lambda o, x: o.all_gather(x, ("a", "b"), tiled=True, to="invariant"),
        lambda t: t.reshape(A, 3, B, 3).permute(0, 2, 1, 3).reshape(18, 3),
        P("a", "b"),
        P(),
        (6, 9),
    ),
    "psum_scatter tiled": Case(
        lambda o, x: o.psum_scatter(x, "b", scatter_dimension=1, tiled=True),
        lambda t: _blocks_b(t).sum(1),
        P("a", "b"),
        P("a", "b"),
        (6, 9),
    ),
    "psum_scatter untiled": Case(
        lambda o, x: o.psum_scatter(x, "b", scatter_dimension=0),
        lambda t: t.reshape(A, 3, B, 3).sum(2).reshape(18),
        P("a", "b"),
        P(("a", "b")),
        (6, 9),
    ),
    "ppermute": Case(
        lambda o, x: o.ppermute(x, "b", [(0, 1), (1, 2)]),
        _ppermute_dense,
        P("a", "b"),
        P("a", "b"),
        (6, 9),
    ),
    "all_to_all": Case(
        lambda o, x: o.all_to_all(x, "b", 0, 1, tiled=True),
        lambda t: t.reshape(A, 27),
        P("a", "b"),
        P("a", "b"),
        (6, 9),
    ),
    "pvary": Case(
        lambda o, x: o.pvary(x, "b"), lambda t: t.repeat(1, B), P("a", None), P("a", "b"), (6, 9)
    ),
    "3 axes: psum (c, a)": Case(
        lambda o, x: o.psum(x, ("c", "a")),
        lambda t: t.reshape(A, 3, B, C3, 3).sum((0, 3)).reshape(3, 9),
        P("a", ("b", "c")),
        P(None, "b"),
        (6, 18),
        MESH3,
    ),
    "3 axes: all_gather (c, a)": Case(
        lambda o, x: o.all_gather(x, ("c", "a"), tiled=True, to="invariant"),
        lambda t: t.reshape(A, 3, B, C3, 3).permute(3, 0, 1, 2, 4).reshape(12, 9),
        P("a", ("b", "c")),
        P(None, "b"),
        (6, 18),
        MESH3,
    ),
}


def mapped(case: Case, per_device: Callable, in_specs=None, out_specs=None):
    return ns.spmd_map(
        per_device,
        mesh=case.mesh,
        in_specs=case.in_spec if in_specs is None else in_specs,
        out_specs=case.out_spec if out_specs is None else out_specs,
    )


def programs(case: Case) -> tuple[Callable, Callable]:
    """(spmd program, dense program), both global -> global: post(collective(pre(x)))."""
    col = functools.partial(case.collective, ns)
    spmd = mapped(case, lambda x: post(col(pre(x))))
    return spmd, lambda x: post(case.dense(pre(x)))


def inputs(case: Case):
    x = _randn(*case.shape, seed=1)
    y = case.dense(x)
    return x, _randn(*case.shape, seed=2), _randn(*y.shape, seed=3)  # x, tangent, cotangent


# --- transforms applied to both programs -------------------------------------------------------


def _autograd(f, x, v, k):
    x = x.clone().requires_grad_()
    return torch.autograd.grad((f(x) * k).sum(), x)


def _double_backward(f, x, v, k):
    x = x.clone().requires_grad_()
    (g,) = torch.autograd.grad((f(x) * k).sum(), x, create_graph=True)
    return torch.autograd.grad((g * v).sum(), x)


def _func_double_grad(f, x, v, k):
    return grad(lambda x: (grad(lambda y: (f(y) * k).sum())(x) * v).sum())(x)


OUTSIDE: dict[str, Callable] = {
    "forward": lambda f, x, v, k: f(x),
    "autograd": _autograd,
    "double backward": _double_backward,
    "func.grad": lambda f, x, v, k: grad(lambda x: (f(x) * k).sum())(x),
    "func.grad of func.grad": _func_double_grad,
    "func.vjp": lambda f, x, v, k: vjp(f, x)[1](k),
    "func.jvp": lambda f, x, v, k: jvp(f, (x,), (v,)),
    "jacrev": lambda f, x, v, k: jacrev(f)(x),
    "jacfwd": lambda f, x, v, k: jacfwd(f)(x),
    "vmap outside": lambda f, x, v, k: vmap(f)(torch.stack([x, v])),
    "functionalize": lambda f, x, v, k: functionalize(f)(x),
}


def _inside(case: Case, name: str):
    """(spmd result, dense result) of a transform applied inside the per-device function."""
    x, v, k = inputs(case)
    col, dense = functools.partial(case.collective, ns), case.dense
    spec_in, spec_out = case.in_spec, case.out_spec
    if name.startswith("user vmap inside"):  # the collective runs per slice of a user vmap
        d = 1 if name.endswith("dim 1") else 0  # a batch dim not in front moves the others
        f = mapped(
            case,
            lambda x: post(vmap(col, in_dims=d)(torch.stack([pre(x), x * x], dim=d))).prod(0),
        )
        g = lambda x: post(torch.stack([dense(pre(x)), dense(x * x)])).prod(0)  # noqa: E731
        return _autograd(f, x, v, k) + (f(x),), _autograd(g, x, v, k) + (g(x),)
    if name == "functionalize inside":
        f = mapped(case, lambda x: functionalize(lambda u: post(col(pre(u))))(x))
        return f(x), post(dense(pre(x)))
    if name == "grad inside":  # per-instance gradient of a local loss (collectives transposed)
        f = mapped(case, lambda x: grad(lambda u: post(col(pre(u))).sum())(x), out_specs=spec_in)
        return f(x), grad(lambda x: post(dense(pre(x))).sum())(x)
    if name == "vjp inside":
        f = mapped(
            case,
            lambda x, k: vjp(lambda u: post(col(pre(u))), x)[1](k)[0],
            in_specs=(spec_in, spec_out),
            out_specs=spec_in,
        )
        return f(x, k), vjp(lambda x: post(dense(pre(x))), x)[1](k)[0]
    if name == "jvp inside":
        f = mapped(
            case,
            lambda x, v: jvp(lambda u: post(col(pre(u))), (x,), (v,))[1],
            in_specs=(spec_in, spec_in),
        )
        return f(x, v), jvp(lambda x: post(dense(pre(x))), (x,), (v,))[1]
    if name == "jvp of grad inside":  # forward over reverse: tangents of the transposes
        per_device = lambda x, v: jvp(  # noqa: E731
            grad(lambda u: post(col(pre(u))).sum()), (x,), (v,)
        )[1]
        f = mapped(case, per_device, in_specs=(spec_in, spec_in), out_specs=spec_in)
        return f(x, v), jvp(grad(lambda x: post(dense(pre(x))).sum()), (x,), (v,))[1]
    if name == "vmap of grad inside":
        f = mapped(
            case,
            lambda x: vmap(grad(lambda u: post(col(pre(u))).sum()))(torch.stack([x, 2 * x])).sum(0),
            out_specs=spec_in,
        )
        want = sum(grad(lambda x: post(dense(pre(x))).sum())(s * x) for s in (1.0, 2.0))
        return f(x), want
    raise KeyError(name)


INSIDE = [
    "user vmap inside",
    "user vmap inside, batch dim 1",
    "functionalize inside",
    "grad inside",
    "vjp inside",
    "jvp inside",
    "vmap of grad inside",
    "jvp of grad inside",
]
# Transforms whose collectives have a grad / jvp interpreter above their level.
GRAD_OR_JVP_INSIDE = {
    "grad inside",
    "vjp inside",
    "jvp inside",
    "vmap of grad inside",
    "jvp of grad inside",
}


def close(got, want, what=""):
    assert_close_within(got, want, TOL, what)


# --- path control ------------------------------------------------------------------------------


class _Counting:
    """Counts applications of the Functions (``slow``: GatherLevel / VaryLevel, custom vmap
    rules; ``lowered``: the single-level Functions under a grad / jvp inside); ``fast=False``
    sends every primitive through GatherLevel / VaryLevel."""

    def __init__(self, monkeypatch, fast: bool):
        self.fast = fast
        self.counts = {"slow": 0, "lowered": 0}
        for fn, kind in [
            (_levels.GatherLevel, "slow"),
            (_levels.VaryLevel, "slow"),
            (_lowered._GatherAbove, "lowered"),
            (_lowered._VaryAbove, "lowered"),
            (_lowered._SumAbove, "lowered"),
        ]:
            original = fn.apply

            def counted(*args, _original=original, _kind=kind):
                self.counts[_kind] += 1
                return _original(*args)

            monkeypatch.setattr(fn, "apply", counted)
        if not fast:
            monkeypatch.setattr(_levels, "FAST", False)

    @property
    def slow(self) -> int:
        return self.counts["slow"]

    @property
    def lowered(self) -> int:
        return self.counts["lowered"]


@pytest.fixture(params=["fast", "fallback"])
def path(request, monkeypatch):
    return _Counting(monkeypatch, request.param == "fast")


# --- tests -------------------------------------------------------------------------------------


@pytest.mark.parametrize("case_name", list(CASES))
def test_dense_twin_matches_per_instance_reference(case_name):
    """The hand-written dense programs are themselves checked against tests/_reference.py."""
    case = CASES[case_name]
    x, _, _ = inputs(case)
    collective = functools.partial(case.collective, REF)
    want = run_reference(collective, case.mesh, case.in_spec, case.out_spec, x)
    close(case.dense(x), want, case_name)


@pytest.mark.parametrize("transform", list(OUTSIDE))
@pytest.mark.parametrize("case_name", list(CASES))
def test_transform_outside(case_name, transform, path):
    case = CASES[case_name]
    spmd, dense = programs(case)
    x, v, k = inputs(case)
    close(OUTSIDE[transform](spmd, x, v, k), OUTSIDE[transform](dense, x, v, k), transform)


@pytest.mark.parametrize("transform", INSIDE)
@pytest.mark.parametrize("case_name", list(CASES))
def test_transform_inside(case_name, transform, path):
    if transform == "functionalize inside" and not path.fast:
        # A limitation of functorch's custom_function_call, which the fast path avoids.
        with pytest.raises(RuntimeError, match="Functionalize rule for custom_function_call"):
            _inside(CASES[case_name], transform)
        return
    got, want = _inside(CASES[case_name], transform)
    close(got, want, transform)


@pytest.mark.parametrize(
    "transform", ["forward", "autograd", "func.grad", "func.jvp", "jacrev", "vmap outside"]
)
def test_outside_transforms_take_the_fast_path(transform, monkeypatch):
    counting = _Counting(monkeypatch, fast=True)
    for case in CASES.values():
        spmd, _ = programs(case)
        OUTSIDE[transform](spmd, *inputs(case))
    assert counting.counts == {"slow": 0, "lowered": 0}


@pytest.mark.parametrize(
    "transform", ["user vmap inside", "user vmap inside, batch dim 1", "functionalize inside"]
)
def test_user_vmap_or_functionalize_inside_takes_the_fast_path(transform, monkeypatch):
    counting = _Counting(monkeypatch, fast=True)
    for case in CASES.values():
        _inside(case, transform)
    assert counting.counts == {"slow": 0, "lowered": 0}


@pytest.mark.parametrize("transform", sorted(GRAD_OR_JVP_INSIDE))
def test_grad_or_jvp_inside_applies_single_level_functions(transform, monkeypatch):
    """A grad / jvp interpreter above the collective's level must not be bypassed: the
    per-instance transposes live in the single-level Functions' backward / jvp."""
    counting = _Counting(monkeypatch, fast=True)
    for case in CASES.values():
        _inside(case, transform)
    assert counting.lowered > 0
    assert counting.slow == 0


@pytest.mark.parametrize(
    "in_spec, out_spec",
    [
        (P(), P(("a", "b", "c"))),
        (P(), P("c", ("b", "a"))),
        (P("b"), P(("c", "b"), "a")),
        (P(None, "c"), P(("b", "a"), "c")),
    ],
)
def test_outputs_invariant_over_named_axes_are_tiled(in_spec, out_spec):
    """The runner leaves an output free of the axes it is invariant over; out_specs that name
    them get identical blocks, in mesh order, as the per-instance reference assembles them."""
    x = _randn(12, 6, seed=4)
    got = ns.spmd_map(lambda x: x * 2, mesh=MESH3, in_specs=in_spec, out_specs=out_spec)(x)
    close(got, run_reference(lambda x: x * 2, MESH3, in_spec, out_spec, x))


def test_cached_plans_tell_apart_specs_that_are_equal_as_tuples():
    """(P('b', 'a'),) == P(('b', 'a')) as tuples; the per-call caches must not confuse them,
    nor meshes whose axes differ only in order."""
    x2, x1 = _randn(6, 2, seed=5), _randn(6, seed=6)
    for in_specs, x in [((P("b", "a"),), x2), (P(("b", "a")), x1), ((P("b", "a"),), x2)]:
        spec = in_specs[0] if isinstance(in_specs[0], P) else in_specs
        got = ns.spmd_map(lambda x: x + 1, mesh=MESH, in_specs=in_specs, out_specs=spec)(x)
        close(got, x + 1)

    def tag(o, x):  # which instance holds which block
        return x + 10 * o.axis_index("a") + o.axis_index("b")

    swapped = ns.make_mesh((B, A), ("b", "a"))
    spec = P(("a", "b"))
    for mesh in (MESH, swapped, MESH):
        got = ns.spmd_map(functools.partial(tag, ns), mesh=mesh, in_specs=spec, out_specs=spec)(x1)
        close(got, run_reference(functools.partial(tag, REF), mesh, spec, spec, x1))


def test_an_error_inside_leaves_no_vmap_level_behind():
    """The runner enters the vmap levels itself: a failing per-device function must leave the
    functorch stack as it found it, and the next call must work."""

    def fails(x):
        ns.psum(x, "b")
        raise ValueError("boom")

    f = ns.spmd_map(fails, mesh=MESH, in_specs=P("a", "b"), out_specs=P())
    x = _randn(6, 9, seed=7)
    with pytest.raises(ValueError, match="boom"):
        f(x)
    assert torch._C._functorch.maybe_current_level() is None
    with pytest.raises(ValueError, match="boom"):  # also from inside a user transform
        vmap(f)(torch.stack([x, x]))
    assert torch._C._functorch.maybe_current_level() is None
    case = CASES["psum b"]
    spmd, dense = programs(case)
    close(spmd(x), dense(x))


def test_writing_into_axis_index_does_not_leak_into_later_calls():
    """The level tokens are cached between calls; axis_index must hand out a copy."""

    def bump(x):
        i = ns.axis_index("b")
        i += 1
        return x + i

    f = ns.spmd_map(bump, mesh=MESH, in_specs=P("a", "b"), out_specs=P("a", "b"))
    x = _randn(6, 9, seed=8)
    want = x + torch.arange(1, B + 1, dtype=F64).repeat_interleave(3)
    close(f(x), want)
    close(f(x), want)
