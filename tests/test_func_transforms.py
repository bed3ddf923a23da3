"""Autograd and torch.func transforms through spmd_map: the correctness matrix.

The simulated backend rests on private functorch APIs (vmap levels, custom vmap rules of
autograd.Functions, the per-level fast path of backends/simulated/_levels.py). A torch upgrade
that breaks them must fail here, loudly (docs/design.md section 6). Every entry applies one
transform to the mapped program and the same transform to an independent dense single-device
program, and compares the numbers (float64, max abs error < 1e-10). The whole matrix runs twice:
plain, and while a CommMode records (which pushes a TorchFunctionMode inside the call).
"""

from __future__ import annotations

import contextlib
import functools
import random
import types

import pytest
import torch
from _programs import torch_ops
from _reference import assert_close_within
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import named_spmd as ns
from named_spmd import P, _torch_private
from named_spmd.backends.simulated import _inner_grad, _levels

F64 = torch.float64
TOL = 1e-10
MESH = ns.make_mesh((2, 2), ("a", "b"))
SWAP = [(0, 1), (1, 0)]
TORCH_OPS = torch_ops(ns)


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


X, W, C = _randn(4, 8, seed=0), _randn(8, 8, seed=1), _randn(2, seed=2)
K = _randn(4, 8, seed=3)


def close(got, want, what=""):
    assert_close_within(got, want, TOL, what)


# --- the program: every collective kind on the way, with a dense twin -------------------------


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(None, "b"), P()), out_specs=P())
def spmd_f(x, w, c):
    u = ns.all_gather(x, "b", axis=1, tiled=True)  # [2, 8]: the rows of block a
    v = torch.tanh(u @ w)  # [2, 4]: tanh(X @ W)[rows a, cols b]
    r = ns.ppermute(v, "a", SWAP)  # row blocks swapped
    s = ns.psum_scatter(r, "b", scatter_dimension=1, tiled=True)  # [2, 2]
    m = ns.pmax(s, "a")
    return ns.psum(m * m * c, "b")  # c is invariant: an implicit pvary


def dense_f(x, w, c):
    v = torch.tanh(x @ w)
    r = torch.cat([v[2:], v[:2]])
    s = r[:, :4] + r[:, 4:]
    m = torch.maximum(s[:2], s[2:])
    return (m[:, :2] ** 2 + m[:, 2:] ** 2) * c


def scalar(f):
    return lambda x, w, c: (f(x, w, c) * torch.tensor([[1.0, -2.0], [0.5, 3.0]], dtype=F64)).sum()


# --- inside the per-device function --------------------------------------------------------------


def inner_loss(x, w, k):
    """L(X) = sum(tanh(X @ W) * K): each instance computes its row block a (identical over b,
    though typed varying there after the all_gather, hence pmean rather than psum over b)."""
    u = ns.all_gather(x, "b", axis=1, tiled=True)
    return ns.pmean(ns.psum((torch.tanh(u @ w) * k).sum(), "a"), "b")


def dense_loss(x, w, k):
    return (torch.tanh(x @ w) * k).sum()


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P("a", "b"))
def grad_inside_x(x, w, k):
    # The per-instance gradient, collectives transposed: it is this instance's block of dL/dX.
    return grad(inner_loss)(x, w, k)


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P())
def grad_inside_w(x, w, k):
    # w is invariant; with an explicit pvary its transpose is a psum, so the result is the full,
    # invariant dL/dW, as jax.grad inside shard_map gives.
    return grad(lambda w: inner_loss(x, ns.pvary(w, ("a", "b")), k))(w)


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P())
def grad_inside_w_implicit(x, w, k):
    # the same without the pvary: the implicit cast where w meets the varying rows sums too
    return grad(lambda w: inner_loss(x, w, k))(w)


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P("a", "b"))
def grad_of_vmap_inside(x, w, k):
    # a user vmap inside a grad inside the function: the level Functions see peeled dims
    def loss(x):
        rows = vmap(lambda xr, kr: inner_loss(xr[None], w, kr[None]))(x, k)
        return rows.sum()

    return grad(loss)(x)


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P("a", "b"))
def vjp_inside(x, w, k):
    _, pull = vjp(lambda x: inner_loss(x, w, k), x)
    return pull(torch.ones((), dtype=F64))[0]


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", "b")), out_specs=P())
def jvp_inside(x, w, t):
    return jvp(lambda x: inner_loss(x, w, torch.ones(2, 8, dtype=F64)), (x,), (t,))[1]


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(None, "b")), out_specs=P("a", "b"))
def vmap_inside(x, w):
    # rows one at a time through the collectives, as a user vmap inside the function
    return vmap(lambda r: torch.tanh(ns.all_gather(r, "b", tiled=True) @ w))(x)


@ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P("a", "b"))
def jacrev_inside(x, w, k):
    return jacrev(lambda x: inner_loss(x, w, k))(x)


def _dense_grad_x(x, w, k):
    return torch.func.grad(dense_loss)(x, w, k)


# --- the matrix ----------------------------------------------------------------------------------


def _autograd_backward(f):
    x, w, c = (t.clone().requires_grad_() for t in (X, W, C))
    scalar(f)(x, w, c).backward()
    return x.grad, w.grad, c.grad


def _autograd_grad(f):
    inputs = [t.clone().requires_grad_() for t in (X, W, C)]
    return torch.autograd.grad(scalar(f)(*inputs), inputs)


def _double_backward(f):
    x = X.clone().requires_grad_()
    (gx,) = torch.autograd.grad(scalar(f)(x, W, C), x, create_graph=True)
    return torch.autograd.grad((gx * K).sum(), x)[0]


XB = _randn(3, 4, 8, seed=4)
W8 = _randn(8, 8, seed=9)
TX, TW, TC = _randn(4, 8, seed=5), _randn(8, 8, seed=6), _randn(2, seed=7)

OUTSIDE = {
    "Tensor.backward": _autograd_backward,
    "autograd.grad": _autograd_grad,
    "func.grad": lambda f: grad(scalar(f), argnums=(0, 1, 2))(X, W, C),
    "func.vjp": lambda f: vjp(f, X, W, C)[1](_randn(2, 2, seed=8)),
    "func.jvp": lambda f: jvp(f, (X, W, C), (TX, TW, TC)),
    "jacrev": lambda f: jacrev(f, argnums=(0, 2))(X, W, C),
    "jacfwd": lambda f: jacfwd(f, argnums=(0, 2))(X, W, C),
    "hessian": lambda f: hessian(lambda c: scalar(f)(X, W, c))(C),
    "double backward": _double_backward,
    "jvp of grad": lambda f: jvp(lambda x: grad(scalar(f))(x, W, C), (X,), (TX,)),
    "vmap outside": lambda f: vmap(f, in_dims=(0, None, None))(XB, W, C),
    "vmap of grad": lambda f: vmap(grad(scalar(f)), in_dims=(0, None, None))(XB, W, C),
    "functionalize": lambda f: torch.func.functionalize(f)(X, W, C),
}

INSIDE = {
    "grad inside (varying input)": (lambda: grad_inside_x(X, W, K), lambda: _dense_grad_x(X, W, K)),
    "grad inside (invariant input, explicit pvary)": (
        lambda: grad_inside_w(X, W, K),
        lambda: torch.func.grad(dense_loss, argnums=1)(X, W, K),
    ),
    "grad inside (invariant input, implicit pvary)": (
        lambda: grad_inside_w_implicit(X, W, K),
        lambda: torch.func.grad(dense_loss, argnums=1)(X, W, K),
    ),
    "grad of user vmap inside": (
        lambda: grad_of_vmap_inside(X, W, K),
        lambda: _dense_grad_x(X, W, K),
    ),
    "vjp inside": (lambda: vjp_inside(X, W, K), lambda: _dense_grad_x(X, W, K)),
    "jvp inside": (
        lambda: jvp_inside(X, W, TX),
        lambda: jvp(lambda x: dense_loss(x, W, torch.ones(4, 8, dtype=F64)), (X,), (TX,))[1],
    ),
    "jacrev inside": (lambda: jacrev_inside(X, W, K), lambda: _dense_grad_x(X, W, K)),
    "user vmap inside": (lambda: vmap_inside(X, W8), lambda: torch.tanh(X @ W8)),
}


@pytest.fixture(params=["plain", "recording"])
def mode(request):
    """Run each entry plain and under a recording CommMode (the implicit-pvary mode path)."""
    return ns.CommMode() if request.param == "recording" else contextlib.nullcontext()


@pytest.fixture(params=["plain", "recording", "fallback"])
def path_and_mode(request, monkeypatch):
    """As ``mode``, and once with every level primitive through the fallback Functions."""
    if request.param == "fallback":
        monkeypatch.setattr(_levels, "FAST", False)
    return ns.CommMode() if request.param == "recording" else contextlib.nullcontext()


def test_program_matches_dense():
    close(spmd_f(X, W, C), dense_f(X, W, C))


@pytest.mark.parametrize("name", list(OUTSIDE))
def test_transform_outside(name, mode):
    with mode:
        got = OUTSIDE[name](spmd_f)
    close(got, OUTSIDE[name](dense_f), name)


@pytest.mark.parametrize("name", list(INSIDE))
def test_transform_inside(name, mode):
    run, dense = INSIDE[name]
    with mode:
        got = run()
    close(got, dense(), name)


# --- inside, on random programs with implicit pvary, against JAX's shard_map -----------------------
#
# An invariant value that meets varying ones is cast implicitly (pvary); under a grad inside the
# per-device function the cast's transpose, a psum over the axes, must run inside that grad, as
# jax.grad inside shard_map does (the simulated mesh otherwise gives each instance's own
# contribution). Each program is a random straight-line mix of elementwise ops, implicit casts and
# collectives over three inputs (varying over every axis, invariant, varying over one axis), all
# of which are differentiated; the same program and transform run in jax.shard_map.

NAMES = ("a", "b")
L = 3  # every value is a local vector of L elements
RANDOM_SEEDS = range(8)
RANDOM_TRANSFORMS = ["grad", "vjp", "jacrev", "jacfwd", "hessian", "jvp"]
_STEP_KINDS = "tanh mul add scale_sum psum pmean pvary ppermute all_gather".split()


def draw_program(seed: int) -> tuple[str, list[tuple]]:
    """(the axis the third input varies over, the steps), drawn with a type model so that every
    program is valid in JAX too (collectives reduce or move axes their operand varies over)."""
    rng = random.Random(seed)
    c_axis = rng.choice(NAMES)
    vmas = [frozenset(NAMES), frozenset(), frozenset({c_axis})]
    steps: list[tuple] = []
    while len(steps) < 4 or (len(steps) < 8 and rng.random() < 0.7):
        i, j = rng.randrange(len(vmas)), rng.randrange(len(vmas))
        kind, v = rng.choice(_STEP_KINDS), vmas[i]
        present, absent = sorted(v), [a for a in NAMES if a not in v]
        if kind in ("psum", "pmean") and present:
            axes = tuple(rng.sample(present, rng.randint(1, len(present))))
            steps.append((kind, i, axes))
            vmas.append(v - set(axes))
        elif kind == "pvary" and absent:
            axes = tuple(rng.sample(absent, rng.randint(1, len(absent))))
            steps.append((kind, i, axes))
            vmas.append(v | set(axes))
        elif kind == "ppermute" and present:
            steps.append((kind, i, rng.choice(present)))
            vmas.append(v)
        elif kind == "all_gather" and present:
            axis, to = rng.choice(present), rng.choice(["varying", "invariant"])
            steps.append((kind, i, (axis, to)))
            vmas.append(v if to == "varying" else v - {axis})
        elif kind in ("mul", "add", "scale_sum"):  # an implicit pvary wherever the types differ
            steps.append((kind, i, j))
            vmas.append(v | vmas[j])
        else:
            steps.append(("tanh", i, None))
            vmas.append(v)
    return c_axis, steps


def random_program(o, steps, x, w, c):
    pool = [x, w, c]
    for kind, i, p in steps:
        a = pool[i]
        if kind == "tanh":
            r = o.tanh(a)
        elif kind == "mul":
            r = a * pool[p]
        elif kind == "add":
            r = a + pool[p]
        elif kind == "scale_sum":
            r = a * o.tanh(o.sum(pool[p]))
        elif kind in ("psum", "pmean", "pvary"):
            r = getattr(o, kind)(a, p)
        elif kind == "ppermute":
            r = o.ppermute(a, p, SWAP)
        else:
            r = o.sum(o.tanh(o.all_gather(a, p[0], axis=0, to=p[1])), 0)
        pool.append(r)
    # every input reaches the output, the invariant one through an implicit pvary
    return pool[-1] + o.pmean(o.tanh(x * w * c), NAMES)


def transformed_inside(name, o, T, steps, x, w, c):
    """Transform ``name`` of the program inside the per-device function (``T``: torch.func or
    jax): a tuple of local vectors, one per input (shaped like it) or the jvp's tangent."""
    args = (x, w, c)
    f = lambda *a: random_program(o, steps, *a)  # noqa: E731
    loss = lambda *a: o.sum(f(*a))  # noqa: E731
    if name == "grad":
        return tuple(T.grad(loss, argnums=(0, 1, 2))(*args))
    if name == "vjp":
        out, pull = T.vjp(f, *args)
        return tuple(pull(o.tanh(out)))
    if name in ("jacrev", "jacfwd"):
        return tuple(o.sum(j, 0) for j in getattr(T, name)(f, argnums=(0, 1, 2))(*args))
    if name == "hessian":
        h = T.hessian(loss, argnums=(0, 1, 2))(*args)
        return tuple(o.sum(h[i][0], 1) + o.sum(h[i][1], 1) + o.sum(h[i][2], 1) for i in range(3))
    assert name == "jvp", name
    return (T.jvp(f, args, tuple(o.tanh(a) for a in args))[1],)


def random_inputs(seed: int, c_axis: str):
    specs = (P(NAMES), P(), P(c_axis))
    return specs, (_randn(4 * L, seed=seed), _randn(L, seed=seed + 1), _randn(2 * L, seed=seed + 2))


def random_inside(seed: int, name: str, mesh=MESH):
    """The named_spmd run of program ``seed`` under transform ``name`` inside, on ``mesh``."""
    c_axis, steps = draw_program(seed)
    specs, args = random_inputs(seed, c_axis)
    per_device = functools.partial(transformed_inside, name, TORCH_OPS, torch.func, steps)
    return ns.spmd_map(per_device, mesh=mesh, in_specs=specs, out_specs=P(NAMES))(*args)


@functools.cache
def _jax_random_inside(seed: int) -> dict:
    import _jax

    jax = _jax.jax_module()
    c_axis, steps = draw_program(seed)
    specs, args = random_inputs(seed, c_axis)
    T = types.SimpleNamespace(**{k: getattr(jax, k) for k in RANDOM_TRANSFORMS})

    def prog(o, x, w, c):
        return {k: transformed_inside(k, o, T, steps, x, w, c) for k in RANDOM_TRANSFORMS}

    return _jax.run_jax(prog, (2, 2), NAMES, specs, P(NAMES), *args)


@pytest.mark.parametrize("name", RANDOM_TRANSFORMS)
@pytest.mark.parametrize("seed", RANDOM_SEEDS)
def test_random_inside_matches_jax(seed, name, path_and_mode):
    pytest.importorskip("jax")
    with path_and_mode:
        got = random_inside(seed, name)
    close(got, _jax_random_inside(seed)[name], f"{name} inside, program {seed}")


def test_random_programs_mix_types_inside_the_transforms():
    """The draws are not vacuous: every program casts implicitly, and together they use every
    step kind, among them each collective."""
    kinds = set()
    for seed in RANDOM_SEEDS:
        _, steps = draw_program(seed)
        kinds |= {k for k, _, _ in steps}
    assert kinds == set(_STEP_KINDS)


def _inner_grad_modes() -> int:
    stack = [
        _torch_private.function_mode_at(i) for i in range(_torch_private.function_mode_depth())
    ]
    return sum(isinstance(m, _inner_grad.InnerGradMode) for m in stack)


def test_the_implicit_pvary_mode_is_on_only_while_a_grad_inside_is_open():
    """A call with no grad inside pays nothing (no mode); a grad inside, nested ones included,
    pushes one, which leaves with the outermost grad, also when the function raises in it."""
    seen = []

    def loss(u, x):
        seen.append(_inner_grad_modes())
        return (u * x).sum()

    def per_device(x, w):
        seen.append(_inner_grad_modes())
        g = grad(lambda u: loss(u, x) + grad(lambda v: loss(v, x))(u).sum())(w)
        seen.append(_inner_grad_modes())
        return g

    f = ns.spmd_map(per_device, mesh=MESH, in_specs=(P(("a", "b")), P()), out_specs=P())
    close(f(_randn(8, seed=10), W[0, :2]), _randn(8, seed=10).reshape(4, 2).sum(0))
    assert seen == [0, 1, 1, 0]

    def raises(x, w):
        def fails(u):
            raise ValueError("inside the grad")

        return grad(fails)(w)

    g = ns.spmd_map(raises, mesh=MESH, in_specs=(P(("a", "b")), P()), out_specs=P())
    with pytest.raises(ValueError, match="inside the grad"):
        g(_randn(8, seed=10), W[0, :2])
    assert _inner_grad_modes() == 0
    grad(lambda u: (u * u).sum())(W[0])  # a grad outside any call pushes nothing either
    assert _inner_grad_modes() == 0 and not _inner_grad._open.modes
