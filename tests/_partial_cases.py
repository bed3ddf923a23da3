"""Partial-sum programs shared by tests/test_partial_sums.py (simulated, abstract) and
tests/partial_dist.py (real processes): the errors of the partial-sum algebra, each with the
substrings its message must hold, and deferred gradient reduction over microbatches."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

F64 = torch.float64


def _seeded(*shapes: tuple[int, ...]) -> Callable[[], tuple]:
    def args() -> tuple:
        gen = torch.Generator().manual_seed(5)
        return tuple(torch.randn(s, generator=gen, dtype=F64) for s in shapes)

    return args


def _partial(x, w):
    """The row-parallel product, declared a partial sum over tp."""
    return ns.pcast(x @ w, "tp", to="unreduced")


def _attention_scores(qkv):
    q, k, _ = qkv.chunk(3, dim=-1)
    return q @ k.T


def _write_into(value):
    """``u[0] = value(u, c)`` into the partial sum ``u`` of a varying ``x``, then its psum."""

    def fn(x, c):
        u = ns.pcast(x, "tp", to="unreduced").clone()
        u[0] = value(u, c)
        return ns.psum(u, "tp")

    return fn


def _write_partial(x, c):
    c = c.clone()
    c[0] = ns.pcast(x, "tp", to="unreduced")[0, 0]
    return c


def _write_at_varying(x, i):
    u = ns.pcast(x, "tp", to="unreduced").clone()
    u[i] = 0.0
    return ns.psum(u, "tp")


@dataclass
class ErrorCase:
    fn: Callable[..., Any]
    in_specs: Any
    out_specs: Any
    args: Callable[[], tuple]
    error: type = ns.VmaError
    pinned: tuple[str, ...] = ()


_ROW = (P(None, "tp"), P("tp", None))
_XW = _seeded((4, 6), (6, 3))

ERRORS: dict[str, ErrorCase] = {
    # the bias added before the row-parallel psum: counted once per instance
    "bias_before_psum": ErrorCase(
        lambda x, w, b: ns.psum(_partial(x, w) + b, "tp"),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (3,)),
        pinned=(
            "add in `<lambda>`",
            "an operand is unreduced over 'tp'",
            "adds a value invariant over 'tp' to a partial sum",
            "Fix: reduce it first, e.g. y = ns.psum(y, 'tp')",
            "ns.pcast(y, 'tp', to='varying')",
        ),
    ),
    "linear_bias_on_partial": ErrorCase(
        lambda x, w, b: ns.psum(
            F.linear(_partial(x, w), ns.pcast(torch.eye(3, dtype=F64), "tp", to="reduced"), b),
            "tp",
        ),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (3,)),
        pinned=("linear in `<lambda>`", "adds the bias to the partial product"),
    ),
    # torch.div(r, u) by its keywords: the divisor is still ``other``
    "divides_by_partial_by_keywords": ErrorCase(
        lambda x, w: ns.psum(
            torch.div(
                input=ns.pcast(torch.ones(4, 3, dtype=F64), "tp", to="reduced"),
                other=_partial(x, w),
            ),
            "tp",
        ),
        _ROW,
        P(),
        _XW,
        pinned=("div in `<lambda>`", "it divides by a partial sum"),
    ),
    # each instance would read its own part
    "reads_partial_on_host": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w) * _partial(x, w).sum().item(), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("item in `<lambda>`", "reads the partial sum's values on the host"),
    ),
    "views_partial_bits": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w).view(torch.float32), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("view in `<lambda>`", "views the partial sum's bits as torch.float32"),
    ),
    "nonlinear_on_partial": ErrorCase(
        lambda x, w: ns.psum(torch.relu(_partial(x, w)), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("relu in `<lambda>`", "is not linear"),
    ),
    "exp_on_partial": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w).exp(), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("exp in `<lambda>`", "is not linear"),
    ),
    "partial_times_partial": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w) * _partial(x, w), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("mul in", "multiplies two partial sums"),
    ),
    "partial_matmul_partial": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w) @ _partial(x, w).T, "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("matmul in", "multiplies two partial sums"),
    ),
    "partial_times_invariant": ErrorCase(
        lambda x, w, s: ns.psum(_partial(x, w) * s, "tp"),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (3,)),
        pinned=("mul in", "by a value invariant over 'tp' (its gradient would be a partial sum)"),
    ),
    "divide_by_partial": ErrorCase(
        lambda x, w: ns.psum(x[:, :3] / _partial(x, w), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("div in", "divides by a partial sum"),
    ),
    "compare_partial": ErrorCase(
        lambda x, w: ns.psum((_partial(x, w) > 0).to(F64), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("gt in", "is not linear"),
    ),
    "norm_of_partial": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w).norm().reshape(1), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("norm", "is not linear"),
    ),
    "pmax_of_partial": ErrorCase(
        lambda x, w: ns.pmax(_partial(x, w), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("pmax in `<lambda>`", "the operand is unreduced over ('tp',)", "ns.psum(x, 'tp')"),
    ),
    "unreduced_output_unnamed": ErrorCase(
        lambda x, w: _partial(x, w),
        _ROW,
        P(),
        _XW,
        pinned=("output has type f64[4,3]{U:tp}", "P(..., unreduced={'tp'})"),
    ),
    # writes into a partial sum, and of one into a whole value: each instance writes its part
    "write_constant_into_partial": ErrorCase(
        _write_into(lambda u, c: 1.0),
        (P("tp"), P()),
        P(),
        _seeded((4, 3), (3,)),
        pinned=("__setitem__ in", "writes a constant into a partial sum", "ns.psum(y, 'tp')"),
    ),
    "write_invariant_into_partial": ErrorCase(
        _write_into(lambda u, c: c),
        (P("tp"), P()),
        P(),
        _seeded((4, 3), (3,)),
        pinned=("__setitem__ in", "writes a value invariant over 'tp' into a partial sum"),
    ),
    "write_partial_into_invariant": ErrorCase(
        _write_partial,
        (P("tp"), P()),
        P(),
        _seeded((4, 3), (3,)),
        pinned=("__setitem__ in", "writes a partial sum into a tensor invariant over 'tp'"),
    ),
    "fill_constant_into_partial": ErrorCase(
        lambda x, c: ns.psum(ns.pcast(x, "tp", to="unreduced").clone().fill_(1.0), "tp"),
        (P("tp"), P()),
        P(),
        _seeded((4, 3), (3,)),
        pinned=("fill_ in", "writes a constant into a partial sum"),
    ),
    "copy_invariant_into_partial": ErrorCase(
        lambda x, c: ns.psum(ns.pcast(x, "tp", to="unreduced").clone().copy_(c), "tp"),
        (P("tp"), P()),
        P(),
        _seeded((4, 3), (3,)),
        pinned=("copy_ in", "writes a value invariant over 'tp' into a partial sum"),
    ),
    "copy_partial_into_invariant": ErrorCase(
        lambda x, c: c.clone().copy_(ns.pcast(x, "tp", to="unreduced")[0]),
        (P("tp"), P()),
        P(),
        _seeded((4, 3), (3,)),
        pinned=("copy_ in", "writes a partial sum into a tensor invariant over 'tp'"),
    ),
    "write_at_varying_index": ErrorCase(
        _write_at_varying,
        (P("tp"), P("tp")),
        P(),
        lambda: (*_seeded((4, 3))(), torch.tensor([0, 1])),
        pinned=("__setitem__ in", "its index operand is varying there"),
    ),
    # casts to a non-floating dtype round (or test) each part before the sum
    "int_cast_of_partial": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w).to(torch.int32), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("to in `<lambda>`", "casts the partial sum to torch.int32", "not linear"),
    ),
    "int_sum_of_partial": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w).detach().sum(0, dtype=torch.int64), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("sum in `<lambda>`", "casts the partial sum to torch.int64"),
    ),
    "bool_cast_of_partial": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w).to(torch.bool), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("to in `<lambda>`", "casts the partial sum to torch.bool, which tests"),
    ),
    # where: the instances must pick alike, between two partial sums
    "where_on_varying_condition": ErrorCase(
        lambda x, w: ns.psum(torch.where(x[:, :3] > 0, _partial(x, w), _partial(x, w)), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("where in", "its condition is varying over 'tp'"),
    ),
    "where_partial_or_invariant": ErrorCase(
        lambda x, w, c: ns.psum(torch.where(c > 0, _partial(x, w), c), "tp"),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (3,)),
        pinned=("where in", "selects between a partial sum and a value invariant over 'tp'"),
    ),
    # a constant given by keyword, or as True, is added to every part too
    "constant_by_keyword": ErrorCase(
        lambda x, w: ns.psum(torch.add(_partial(x, w), other=1.0), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("add in `<lambda>`", "adds a constant to a partial sum"),
    ),
    "numpy_constant_added": ErrorCase(  # numpy's scalars are numbers to torch too
        lambda x, w: ns.psum(_partial(x, w) + np.int64(1), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("add in `<lambda>`", "adds a constant to a partial sum"),
    ),
    "true_added": ErrorCase(
        lambda x, w: ns.psum(_partial(x, w) + True, "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("add in `<lambda>`", "adds a constant to a partial sum"),
    ),
    "true_selected": ErrorCase(
        lambda x, w, c: ns.psum(torch.where(c > 0, True, _partial(x, w)), "tp"),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (3,)),
        pinned=("where in", "selects a constant beside a partial sum"),
    ),
    # a linear op writing a partial sum into a closed-over tensor: each instance writes its part
    # there (per instance all into the one tensor: the psum then counts the last part twice)
    "partial_written_through_out": ErrorCase(
        lambda x, w, c: ns.psum(torch.cumsum(_partial(x, w), 0, out=c), "tp"),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (4, 3)),
        pinned=("cumsum in `<lambda>`", "writes the result into out=, a tensor invariant"),
    ),
    "partial_written_into_a_reduced_input": ErrorCase(
        lambda x, w, r: ns.psum(r.mul_(_partial(x, w)), "tp"),
        (*_ROW, P(reduced={"tp"})),
        P(),
        _seeded((4, 6), (6, 3), (4, 3)),
        pinned=("mul_ in `<lambda>`", "writes the result into its operand (in place), a tensor"),
    ),
    # a rounding division rounds each part (after the same division without rounding, which
    # the algebra accepts and remembers)
    "rounding_division": ErrorCase(
        lambda x, w: ns.psum(
            torch.div(_partial(x, w), 2) + torch.div(_partial(x, w), 2, rounding_mode="floor"),
            "tp",
        ),
        _ROW,
        P(),
        _XW,
        pinned=("div in `<lambda>`", "div is not linear"),
    ),
    # --- the same bugs written the ordinary way: the contraction of blocks split over tp on both
    # operands is seen (the inference from the specs), no annotation
    "inferred_bias_before_psum": ErrorCase(
        lambda x, w, b: ns.psum(x @ w + b, "tp"),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (3,)),
        pinned=(
            "add in `<lambda>`",
            "operand types: f64[4,3]{U:tp}, f64[3]{}",
            "adds a value invariant over 'tp' to a partial sum",
            "Fix: reduce it first, e.g. y = ns.psum(y, 'tp')",
        ),
    ),
    "inferred_linear_bias": ErrorCase(
        lambda x, w, b: ns.psum(F.linear(x, w.T, b), "tp"),
        (*_ROW, P()),
        P(),
        _seeded((4, 6), (6, 3), (3,)),
        pinned=(
            "linear in `<lambda>`",
            "contracts a dim split over 'tp' on both operands",
            "adds the bias to that partial sum",
            "y = ns.psum(F.linear(x, w), 'tp') + b",
        ),
    ),
    "inferred_nonlinear": ErrorCase(
        lambda x, w: ns.psum(torch.relu(x @ w), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("relu in `<lambda>`", "{U:tp}", "is not linear"),
    ),
    "inferred_partial_times_partial": ErrorCase(
        lambda x, w: ns.psum((x @ w) * (x @ w), "tp"),
        _ROW,
        P(),
        _XW,
        pinned=("mul in", "multiplies two partial sums"),
    ),
    # a loss taken before the psum: the output head's row-parallel logits (hidden dim split over
    # tp on both sides) go into the cross entropy as they are, each instance's partial sum
    "inferred_loss_before_psum": ErrorCase(
        lambda h, w_out, target: ns.psum(F.cross_entropy(h @ w_out, target).reshape(1), "tp"),
        (*_ROW, P()),
        P(),
        lambda: (*_seeded((4, 6), (6, 3))(), torch.tensor([0, 2, 1, 1])),
        pinned=("cross_entropy in `<lambda>`", "f64[4,3]{U:tp}", "is not linear"),
    ),
    # a packed qkv weight split along its input dim (P("tp", None)) where the hidden dim of x is
    # split too: q, k and v are partial sums, and q @ k.T multiplies two of them
    "inferred_packed_qkv_split": ErrorCase(
        lambda x, w_qkv: ns.psum(_attention_scores(x @ w_qkv), "tp"),
        (P(None, "tp"), P("tp", None)),
        P(),
        _seeded((4, 6), (6, 9)),
        pinned=("matmul in", "multiplies two partial sums"),
    ),
    # vocabulary-parallel logits returned without naming tp: Fix 2 names it on the dim of the
    # vocabulary blocks (dim 2), not on dim 0, where their concatenation would be laid out wrong
    "vocab_logits_unnamed": ErrorCase(
        lambda h, w_out: h @ w_out,
        (P(), P(None, "tp")),
        P(),
        _seeded((2, 3, 4), (4, 6)),
        pinned=(
            "output has type f64[2,3,3]{tp}: it varies over ('tp',)",
            "Fix 2: name 'tp' in out_specs on the dim that holds its blocks, e.g. "
            "P(None, None, 'tp')",
        ),
    ),
    "bad_cast": ErrorCase(
        lambda x, w: ns.pcast(ns.psum(x @ w, "tp"), "tp", to="unreduced"),
        _ROW,
        P(),
        _XW,
        pinned=("pcast in `<lambda>`", "cannot cast a value of type f64[4,3]{} over ('tp',)"),
    ),
}


def run_error(name: str, simulated: bool | None = None, check: bool = False) -> dict:
    """The error class and message of :data:`ERRORS` ``name`` on a (2,) "tp" mesh."""
    case = ERRORS[name]
    mesh = ns.make_mesh((2,), ("tp",), simulated=simulated)
    f = ns.spmd_map(case.fn, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs)
    try:
        f.check(*case.args()) if check else f(*case.args())
    except ns.SpmdError as e:
        return {"error": type(e).__name__, "message": str(e)}
    return {"error": None, "message": ""}


# --- deferred gradient reduction --------------------------------------------------------------


def _mlp_loss(params, x, y):
    h = torch.tanh(x @ params["w1"] + params["b1"])
    return ns.psum(((h @ params["w2"] - y) ** 2).sum().reshape(1), "dp")


def mlp_data(micro: int = 4):
    gen = torch.Generator().manual_seed(7)
    params = {
        "w1": torch.randn(5, 8, generator=gen, dtype=F64),
        "b1": torch.randn(8, generator=gen, dtype=F64),
        "w2": torch.randn(8, 2, generator=gen, dtype=F64),
    }
    batches = [
        (torch.randn(4, 5, generator=gen, dtype=F64), torch.randn(4, 2, generator=gen, dtype=F64))
        for _ in range(micro)
    ]
    return params, batches


def dense_grads(micro: int = 4) -> dict[str, torch.Tensor]:
    params, batches = mlp_data(micro)
    ps = {k: v.clone().requires_grad_() for k, v in params.items()}
    for x, y in batches:
        h = torch.tanh(x @ ps["w1"] + ps["b1"])
        ((h @ ps["w2"] - y) ** 2).sum().backward()
    return {k: p.grad for k, p in ps.items()}


def deferred_grads(mesh, micro: int = 4):
    """Gradient accumulation over ``micro`` microbatches with reduced parameters: no gradient
    communication per microbatch (the gradients stay partial sums: ``Partial()`` DTensors on a
    real mesh), then one psum per parameter. Returns the summed gradients (in name order), the
    placements of the accumulated gradients, and the CommMode counts."""
    params, batches = mlp_data(micro)
    reduced = P(reduced={"dp"})
    params = ns.shard({k: v.requires_grad_() for k, v in params.items()}, mesh, reduced)
    step = ns.spmd_map(_mlp_loss, mesh=mesh, in_specs=(reduced, P("dp"), P("dp")), out_specs=P())
    total = ns.spmd_map(
        lambda g: ns.psum(g, "dp"), mesh=mesh, in_specs=P(unreduced={"dp"}), out_specs=P()
    )
    with ns.CommMode() as comms:
        for x, y in batches:
            step(params, x, y).sum().backward()
        placements = {k: str(getattr(p.grad, "placements", "plain")) for k, p in params.items()}
        grads = [total(params[k].grad) for k in sorted(params)]
    grads = [g.full_tensor() if hasattr(g, "full_tensor") else g for g in grads]
    counts = {f"{d} {op} {axes}": n for (d, op, axes), n in comms.counts().items()}
    return [g.detach() for g in grads], placements, counts


# --- values crossing the call boundary with unreduced / reduced specs ---------------------------
# Each case runs on a (2,) "x" mesh, simulated or real, and returns global values as lists (for
# the real workers' JSON): tests/test_partial_sums.py compares both backends with each other,
# with JAX's shard_map and with the dense function's gradients.

BOUNDARY_X = torch.tensor([0.5, -1.0, 2.0, 0.25], dtype=F64)
BOUNDARY_COT = torch.tensor([1.0, -2.0, 3.0, 0.5], dtype=F64)


def _full(t: torch.Tensor) -> torch.Tensor:
    """The global value: a real mesh's DTensor summed or gathered, a simulated one's as is."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _listed(**values: Any) -> dict:
    return {k: v.detach().tolist() if isinstance(v, torch.Tensor) else v for k, v in values.items()}


def _mapped(fn: Callable, mesh, compiled: bool, **kwargs: Any) -> Callable:
    """``ns.spmd_map(fn, ...)``, traced by ``torch.compile`` (fullgraph) if ``compiled``."""
    f = ns.spmd_map(fn, mesh=mesh, **kwargs)
    if not compiled:
        return f
    torch._dynamo.reset()  # every mapped function shares its call's code object: fresh limits
    traced = torch.compile(f, backend="eager", fullgraph=True)

    def call(*args: Any) -> Any:
        with warnings.catch_warnings():
            # Dynamo's own look at a non-leaf input's .grad while it traces (any compiled
            # function taking one warns so), not the program's
            warnings.filterwarnings("ignore", "The .grad attribute of a Tensor that is not a leaf")
            return traced(*args)

    return call


def _unreduced_roundtrip(mesh, compiled: bool = False) -> dict:
    """A partial-sum output (a Partial() DTensor on a real mesh) fed back into an unreduced
    in_spec and reduced there: its cotangent is the reduced value's, once."""
    mk = _mapped(
        lambda v: ns.pcast(torch.tanh(v), "x", to="unreduced"),
        mesh,
        compiled,
        in_specs=P("x"),
        out_specs=P(unreduced={"x"}),
    )
    ar = _mapped(
        lambda u: ns.psum(u, "x") ** 2,
        mesh,
        compiled,
        in_specs=P(unreduced={"x"}),
        out_specs=P(),
    )
    a = BOUNDARY_X.clone().requires_grad_()
    parts = mk(a)
    out = ar(parts)
    (_full(out) * BOUNDARY_COT[:2]).sum().backward()
    leaf = parts.detach().requires_grad_()  # a leaf holding the partial sums
    (_full(ar(leaf)) * BOUNDARY_COT[:2]).sum().backward()
    return _listed(parts=_full(parts), out=_full(out), grad=a.grad, leaf_grad=_full(leaf.grad))


def _unchecked(in_spec: Any, out_spec: Any, fn: Callable = lambda v: v * v) -> Callable:
    """``fn`` under ``check_vma=False`` with an unreduced in_spec or out_spec."""

    def run(mesh, compiled: bool = False) -> dict:
        f = _mapped(fn, mesh, compiled, in_specs=in_spec, out_specs=out_spec, check_vma=False)
        x = BOUNDARY_X.clone().requires_grad_()
        out = _full(f(x))
        (out * BOUNDARY_COT[: out.shape[0]]).sum().backward()
        return _listed(out=out, grad=x.grad)

    return run


def _passed_twice(first: Any, second: Any) -> Callable:
    """One tensor passed at two argument positions with different specs: each its own type
    (read in eager calls; a traced call reads none)."""

    def run(mesh, compiled: bool = False) -> dict:
        types: list[str] = []

        def body(u, v):
            if not compiled:
                types.extend(str(ns.typeof(t)) for t in (u, v))
            r, i = (u, v) if first.reduced else (v, u)
            return ns.psum(ns.pcast(r, "x", to="varying") * torch.sin(i), "x") + i

        f = _mapped(body, mesh, compiled, in_specs=(first, second), out_specs=P())
        plain = _full(f(BOUNDARY_X, BOUNDARY_X))  # without autograd: the tensor itself, twice
        t = BOUNDARY_X.clone().requires_grad_()
        out = _full(f(t, t))
        (out * BOUNDARY_COT).sum().backward()
        return _listed(out=out, plain=plain, grad=t.grad, types=types or None)

    return run


BOUNDARY: dict[str, Callable[..., dict]] = {
    "unreduced_roundtrip": _unreduced_roundtrip,
    "unchecked_invariant_to_unreduced": _unchecked(P(), P(unreduced={"x"})),
    "unchecked_varying_to_unreduced": _unchecked(P("x"), P(unreduced={"x"})),
    # linear: v * v of a partial sum is an error whatever check_vma says
    "unchecked_unreduced_to_invariant": _unchecked(P(unreduced={"x"}), P(), lambda v: v + v),
    "passed_twice_reduced_first": _passed_twice(P(reduced={"x"}), P()),
    "passed_twice_invariant_first": _passed_twice(P(), P(reduced={"x"})),
}
