"""Autograd and torch.func transforms through spmd_map: the correctness matrix.

The simulated backend rests on private functorch APIs (vmap levels, custom vmap rules of
autograd.Functions, the per-level fast path of backends/simulated/_levels.py). A torch upgrade
that breaks them must fail here, loudly (docs/design.md section 5). Every entry applies one
transform to the mapped program and the same transform to an independent dense single-device
program, and compares the numbers (float64, max abs error < 1e-10). The whole matrix runs twice:
plain, and while a CommMode records (which pushes a TorchFunctionMode inside the call).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from _reference import assert_close_within
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap

import named_spmd as ns
from named_spmd import P

F64 = torch.float64
TOL = 1e-10
MESH = ns.make_mesh((2, 2), ("a", "b"))
SWAP = [(0, 1), (1, 0)]


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


def test_grad_inside_of_implicitly_varying_value_is_per_instance():
    """Documented difference from JAX (see spmd_map's docstring): without the explicit pvary,
    the simulated backend inserts none, so an inner grad w.r.t. an invariant value used with
    varying data is this instance's contribution (varying), not their psum. The out_specs check
    catches a replicated claim; naming the axes returns the contributions, which sum to dL/dW."""

    @ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P())
    def claims_replicated(x, w, k):
        return grad(lambda w: inner_loss(x, w, k))(w)

    with pytest.raises(ns.VmaError, match="varies over"):
        claims_replicated(X, W, K)

    @ns.spmd_map(mesh=MESH, in_specs=(P("a", "b"), P(), P("a", None)), out_specs=P())
    def summed(x, w, k):
        return ns.psum(grad(lambda w: inner_loss(x, w, k))(w), ("a", "b"))

    close(summed(X, W, K), torch.func.grad(dense_loss, argnums=1)(X, W, K))
