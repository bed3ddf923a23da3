"""Every collective record's declared transpose and jvp, checked in one process in seconds.

The simulated backend differentiates its primitives, and a group of one runs plain torch ops, so
neither ever runs a record's ``transpose`` or ``jvp``: the real backend does (through the
autograd bridge). Here every record of ``RECORDS`` runs on a mesh of instances in threads
(``tests/_rules_mesh.py``) whose primitives are plain communication, as on a real mesh, so only
the declared rules differentiate it. For each record, parameter set and group of a (2, 2) and a
(2, 3) mesh, in float64:

* the forward's result has the type the record's ``vma`` rule says (identical copies where it
  says invariant or reduced);
* the jvp is the forward's linearisation (central finite differences), and the bridge's
  forward mode gives it;
* the transpose is the jvp's adjoint: ``<transpose(g), t> == <g, jvp(t)>`` summed over the
  instances, each value counted once (an invariant value's identical copies once, not once per
  instance: the pairing of section 8 of docs/design.md), and its result has the operand's
  cotangent type; the bridge's backward gives it;
* second order, through the declared rules only: the transpose of the transpose is the jvp, the
  jvp of the transpose is the transpose of the tangent, and the transpose of the jvp is the
  transpose.

A new record needs a case below (a test fails until it has one).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from _ragged import routing
from _rules_mesh import forward_ad, run_instances

import named_spmd as ns
from named_spmd._autodiff import apply as bridge_apply
from named_spmd._collectives import RECORDS
from named_spmd._layout import split_blocks, unstack_dim
from named_spmd._types import Vma

EPS = 1e-6  # central differences in float64: error ~1e-12 on these (piecewise) linear maps
MESHES = {(2, 2): ns.make_mesh((2, 2), ("a", "b")), (2, 3): ns.make_mesh((2, 3), ("a", "b"))}
GROUPS = [("a",), ("b",), ("a", "b"), ("b", "a")]
# the state over the collective's axes each record's forward takes (after its operand policy)
OPERAND = {"pvary": "invariant", "preduced": "invariant", "reduced_vary": "reduced"}
OPERAND |= {"unreduced_vary": "unreduced", "reduced_invariant": "reduced"}


@dataclass(frozen=True)
class Case:
    params: tuple
    shape: tuple[int, ...]
    #: the operand's values equal over the group (pmax / pmin: every member holds the extremum,
    #: which shares the gradient; no finite differences there, the forward has a kink)
    ties: bool = False
    #: member index -> its parameters, where they differ between members (ragged_all_to_all's
    #: offsets and sizes); ``params`` is member 0's, for the type and shape rules
    member: Any = None


def _ring(n: int) -> tuple[tuple[int, int], ...]:
    return tuple((i, (i + 1) % n) for i in range(n))


def cases(name: str, n: int) -> list[Case]:
    """Each record's parameter sets (normalised, as ``prepare`` / ``check`` return them) for a
    group of ``n`` members, with an operand shape they fit."""
    if name == "all_gather":
        return [
            Case((dim, tiled, to), (2, 3))
            for to in ("varying", "invariant", "reduced")
            for tiled, dims in ((True, (0, 1)), (False, (0, 1, 2)))
            for dim in dims
        ]
    if name == "psum_scatter":
        return [
            Case((0, True), (2 * n, 3)),
            Case((1, True), (3, 2 * n)),
            Case((0, False), (n, 3)),
            Case((1, False), (3, n)),
        ]
    if name == "all_to_all":
        tiled = [
            Case((s, c, True, None, None), _sized((2, 3), s, 2 * n)) for s in (0, 1) for c in (0, 1)
        ]
        sizes = [Case((s, s, True, (2,) * n, (2,) * n), _sized((2, 3), s, 2 * n)) for s in (0, 1)]
        untiled = [
            Case((s, c, False, None, None), _sized((2, 3), s, n)) for s in (0, 1) for c in (0, 1)
        ]
        return tiled + sizes + untiled
    if name == "ragged_all_to_all":
        return [
            Case(r.params(0), (r.rows, 3), member=r.params)
            for r in (routing(n, 1, seed=n), routing(n, 2, seed=n + 1))
        ]
    if name == "ppermute":
        return [Case((_ring(n),), (2, 3)), Case((((0, n - 1),),), (2, 3))]
    if name == "pshuffle":  # member i gets member perm[i]'s value: (src, dst) pairs
        perm = [(i + 1) % n for i in range(n)]
        return [Case((tuple((src, dst) for dst, src in enumerate(perm)),), (2, 3))]
    if name == "pbroadcast":
        return [Case((0,), (2, 3)), Case((n - 1,), (2, 3))]
    if name in ("pmax", "pmin"):
        return [Case((), (2, 3)), Case((), (2, 3), ties=True)]
    if name in ("psum", "pmean", "pvary") or name in _CASTS:
        return [Case((), (2, 3))]
    return []


_CASTS = ("preduced", "vary_unreduced", "reduced_vary", "unreduced_vary", "reduced_invariant")


def _sized(shape: tuple[int, ...], dim: int, size: int) -> tuple[int, ...]:
    out = list(shape)
    out[dim] = size
    return tuple(out)


def test_every_record_has_cases():
    """A record without a case here would have its rules checked nowhere in the fast suite."""
    missing = [name for name in RECORDS if not cases(name, 2)]
    assert not missing, f"add cases for {missing} to tests/test_transpose_rules.py"


# --- values of a type, and the pairing of values with cotangents --------------------------------


def dual(vma: Vma) -> Vma:
    """The type of a cotangent of a value of type ``vma``: unreduced and reduced swap."""
    return Vma.make(vma.varying, vma.reduced, vma.unreduced)


def values(mesh, vma: Vma, shape, gen) -> list[torch.Tensor]:
    """One value per instance, of type ``vma``: drawn once per coordinates over the axes where
    the instances' copies differ (varying, unreduced), identical over the others."""
    drawn: dict[tuple, torch.Tensor] = {}
    out = []
    for coords in _instances(mesh):
        key = tuple(c if _differ(vma, a) else None for a, c in coords.items())
        if key not in drawn:
            drawn[key] = torch.randn(shape, dtype=torch.float64, generator=gen)
        out.append(drawn[key])
    return out


def _differ(vma: Vma, axis: str) -> bool:
    return vma.state(axis) in ("varying", "unreduced")


def _instances(mesh) -> list[dict[str, int]]:
    names, sizes = mesh.axis_names, mesh.shape
    return [dict(zip(names, c)) for c in itertools.product(*(range(sizes[a]) for a in names))]


def pairing(mesh, vma: Vma, cotangents, primals) -> torch.Tensor:
    """``<cotangent, primal>`` for values of type ``vma``, summed over the instances: the
    identical copies of an invariant value count once (weight 1/size of each such axis);
    varying and unreduced values count per instance (an unreduced value is the sum of its parts,
    paired with its reduced cotangent), and so do reduced ones (paired with the parts of their
    unreduced cotangent)."""
    weight = 1.0
    for a in mesh.axis_names:
        if vma.state(a) == "invariant":
            weight /= mesh.shape[a]
    return weight * sum((c * p).sum() for c, p in zip(cotangents, primals))


def assert_typed(mesh, vma: Vma, got: list[torch.Tensor], what: str) -> None:
    """The values are identical over the axes ``vma`` says hold one value (invariant, reduced)."""
    first: dict[tuple, torch.Tensor] = {}
    for coords, value in zip(_instances(mesh), got):
        key = tuple(c if _differ(vma, a) else None for a, c in coords.items())
        if key in first:
            torch.testing.assert_close(
                value, first[key], msg=lambda m: f"{what}: not one value: {m}"
            )
        else:
            first[key] = value


# --- one case on every instance -----------------------------------------------------------------


class _Saved:
    """The autograd node a saving record's rules read (``node.saved_tensors``)."""

    def __init__(self, *saved: torch.Tensor) -> None:
        self.saved_tensors = saved


def _grad(out: torch.Tensor, wrt: torch.Tensor, cotangent: torch.Tensor) -> torch.Tensor:
    """d<cotangent, out>/d wrt through the graph the rules recorded (zeros where none)."""
    if not out.requires_grad:
        return torch.zeros_like(wrt)
    (got,) = torch.autograd.grad(out, wrt, cotangent, allow_unused=True)
    return torch.zeros_like(wrt) if got is None else got


def instance_rules(ctx, rec, axes, params, x, t, g, dg) -> dict[str, torch.Tensor]:
    """Every rule of ``rec`` on this instance: the primal ``x``, a tangent ``t`` of it, and two
    cotangents ``g``, ``dg`` of the result."""
    fwd = rec.forward
    y = fwd(ctx, x, axes, params)
    node = _Saved(x, y) if rec.saves else None
    out = {"y": y, "jvp": rec.tangent(ctx, t, axes, params, node)}
    out["fd"] = (fwd(ctx, x + EPS * t, axes, params) - fwd(ctx, x - EPS * t, axes, params)) / (
        2 * EPS
    )
    out["T(g)"] = rec.backward(ctx, g, axes, params, node)
    out["T(dg)"] = rec.backward(ctx, dg, axes, params, node)
    # the bridge, reverse mode: the backward of the collective is its transpose
    xr = x.clone().requires_grad_()
    out["bridge T(g)"] = _grad(bridge_apply(rec, ctx, xr, axes, params), xr, g)
    # second order, reverse over reverse: transposing the transpose gives the jvp
    gr = g.clone().requires_grad_()
    out["TT(t)"] = _grad(rec.backward(ctx, gr, axes, params, node), gr, t)
    # reverse over forward: transposing the jvp gives the transpose
    tr = t.clone().requires_grad_()
    out["jvp^T(g)"] = _grad(rec.tangent(ctx, tr, axes, params, node), tr, g)
    with forward_ad(ctx):
        # the bridge, forward mode: the tangent of the collective is its jvp
        y_dual = bridge_apply(rec, ctx, fwAD.make_dual(x, t), axes, params)
        out["bridge jvp"] = _tangent(y_dual, y)
        # forward over reverse: the jvp of the transpose is the transpose of the tangent
        x_dual = rec.backward(ctx, fwAD.make_dual(g, dg), axes, params, node)
        out["jvp of T"] = _tangent(x_dual, x)
    return out


def _tangent(dual_value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    tangent = fwAD.unpack_dual(dual_value).tangent
    return torch.zeros_like(like) if tangent is None else tangent


@dataclass
class Run:
    """Every instance's rules of one case, and the types they are checked against."""

    mesh: Any
    in_vma: Vma
    out_vma: Vma
    t: list[torch.Tensor]
    g: list[torch.Tensor]
    got: dict[str, list[torch.Tensor]]
    label: str
    ties: bool
    n: int  # the group size


def run_case(mesh, rec, axes, case: Case, bystanders: str, seed: int) -> Run:
    """The rules of ``rec`` with ``case``'s parameters over ``axes``, on every instance; the
    other mesh axes are ``bystanders`` ("varying" or "invariant") for the operand."""
    others = tuple(a for a in mesh.axis_names if a not in axes)
    in_vma = Vma.of(others if bystanders == "varying" else ()).to_state(
        axes, OPERAND.get(rec.name, "varying")
    )
    out_vma = rec.vma(in_vma, axes, case.params)
    out_shape = rec.shape(case.shape, mesh.axis_size(axes), case.params)
    gen = torch.Generator().manual_seed(seed)
    x = values(mesh, in_vma.remove(axes) if case.ties else in_vma, case.shape, gen)
    t = values(mesh, in_vma, case.shape, gen)
    g, dg = (values(mesh, dual(out_vma), out_shape, gen) for _ in range(2))

    def program(ctx):
        k = ctx.k
        params = case.params if case.member is None else case.member(int(ctx.axis_index(axes)))
        return instance_rules(ctx, rec, axes, params, x[k], t[k], g[k], dg[k])

    results = run_instances(mesh, program)
    got = {key: [r[key] for r in results] for key in results[0]}
    label = f"{rec.name}{case.params} over {axes} on {tuple(mesh.shape.values())}"
    label += " with ties" if case.ties else ""
    return Run(mesh, in_vma, out_vma, t, g, got, label, case.ties, mesh.axis_size(axes))


def check(run: Run, rec) -> None:
    mesh, got, label = run.mesh, run.got, run.label

    def same(key: str, reference: str) -> None:
        for k, (a, b) in enumerate(zip(got[key], got[reference])):
            torch.testing.assert_close(
                a,
                b,
                atol=1e-9,
                rtol=1e-9,
                msg=lambda m: f"{label}, instance {k}: {key} != {reference}: {m}",
            )

    assert_typed(mesh, run.out_vma, got["y"], f"{label}: the forward's result")
    if not run.ties:
        same("fd", "jvp")  # the jvp is the forward's linearisation
    else:  # every member holds the extremum: an even share each, as torch.amax gives
        for k, (got_k, g_k) in enumerate(zip(got["T(g)"], run.g)):
            copies = [torch.zeros_like(g_k).requires_grad_() for _ in range(run.n)]
            (share,) = torch.autograd.grad(torch.stack(copies).amax(0), copies[0], g_k)
            torch.testing.assert_close(got_k, share, msg=lambda m: f"{label}, {k}: ties {m}")
    same("bridge jvp", "jvp")
    lhs = pairing(mesh, run.in_vma, got["T(g)"], run.t)
    rhs = pairing(mesh, run.out_vma, run.g, got["jvp"])
    assert torch.allclose(lhs, rhs, rtol=1e-9, atol=1e-9), (
        f"{label}: the transpose is not the jvp's adjoint: <T(g), t> = {lhs.item():.12g}, "
        f"<g, jvp(t)> = {rhs.item():.12g}"
    )
    if rec.name != "unreduced_vary":  # the escape hatch: each part taken as a local value
        assert_typed(mesh, dual(run.in_vma), got["T(g)"], f"{label}: the transpose's result")
    same("bridge T(g)", "T(g)")
    same("TT(t)", "jvp")
    same("jvp^T(g)", "T(g)")
    same("jvp of T", "T(dg)")


@pytest.mark.parametrize("shape", list(MESHES), ids=str)
@pytest.mark.parametrize("name", sorted(RECORDS))
def test_declared_rules(name, shape):
    """Every case of one record on one mesh: every group, every parameter set. The operand
    varies over the other mesh axis on (2, 2) and is invariant over it on (2, 3)."""
    mesh, rec = MESHES[shape], RECORDS[name]
    bystanders = "varying" if shape == (2, 2) else "invariant"
    runs = [(axes, case) for axes in GROUPS for case in cases(name, mesh.axis_size(axes))]
    for seed, (axes, case) in enumerate(runs):
        check(run_case(mesh, rec, axes, case, bystanders, seed), rec)


# --- the rule for primitives inside a rule (README.md, "Primitives inside a rule") --------------


@pytest.fixture
def author_record():
    """Records a test defines like a contributor would, taken out of RECORDS afterwards."""
    made: list[str] = []

    def make(base: str, name: str, **rules):
        made.append(name)
        return dataclasses.replace(RECORDS[base], name=name, **rules)

    yield make
    for name in made:
        RECORDS.pop(name, None)


def _scatter_by_primitive(ctx, g, axes, params, node):
    """psum_scatter's transpose (an all_gather to varying) written with the primitive."""
    dim, tiled = params
    return unstack_dim(ctx.all_gather(g, axes), dim, tiled)


def _scatter_by_own_block(ctx, g, axes, params, node):
    """all_gather's transpose (a psum_scatter) as a psum, then the block by the primitive."""
    dim, tiled, _ = params
    total = ctx.apply(RECORDS["psum"], g, axes, ())
    return ctx.own_block(split_blocks(total, dim, ctx.mesh.axis_size(axes), tiled), axes, dim)


def _psum_jvp_by_primitive(ctx, rec, t, axes, params, node):
    return ctx.all_reduce(t, axes, "sum")


def _first_and_second(mesh, rec, axes, params, shape, out_shape):
    """Every instance's transpose of a cotangent, first order and differentiated again."""
    gen = torch.Generator().manual_seed(0)
    g = values(mesh, Vma.of(mesh.axis_names), out_shape, gen)

    def program(ctx):
        first = rec.backward(ctx, g[ctx.k], axes, params, None)
        gr = g[ctx.k].clone().requires_grad_()
        return first, _grad(rec.backward(ctx, gr, axes, params, None), gr, torch.ones(shape))

    return run_instances(mesh, program)


@pytest.mark.parametrize(
    ("base", "rule", "params", "shapes", "primitive"),
    [
        ("psum_scatter", _scatter_by_primitive, (1, True), ((3, 4), (3, 2)), "ctx.all_gather"),
        ("all_gather", _scatter_by_own_block, (1, True, "varying"), ((3, 2), (3, 4)), "own_block"),
    ],
    ids=["communicating primitive", "own_block without pvary"],
)
def test_primitive_in_a_transpose_differentiated_again(
    author_record, base, rule, params, shapes, primitive
):
    """A transpose written with a primitive gives the right first-order values, and a clear
    error for its author where its result is differentiated again (it would be wrong there)."""
    mesh, axes = MESHES[(2, 2)], ("a",)
    shape, out_shape = shapes
    rec = author_record(base, f"{base}_by_primitive", transpose=rule)
    with pytest.raises(ns.CollectiveError) as caught:
        _first_and_second(mesh, rec, axes, params, shape, out_shape)
    message = str(caught.value)
    assert f"the transpose of collective '{base}_by_primitive'" in message
    assert primitive in message and "Fix (for the record's author)" in message
    # first order the primitive is fine: the declared record's values
    gen = torch.Generator().manual_seed(0)
    g = values(mesh, Vma.of(mesh.axis_names), out_shape, gen)
    got = run_instances(mesh, lambda ctx: rec.backward(ctx, g[ctx.k], axes, params, None))
    want = run_instances(
        mesh, lambda ctx: RECORDS[base].backward(ctx, g[ctx.k], axes, params, None)
    )
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_primitive_in_a_jvp(author_record):
    """A jvp reaches the other instances through records too: under forward mode its result
    is a dual's tangent, which forward mode over the backward differentiates again."""
    mesh, axes = MESHES[(2, 2)], ("b",)
    rec = author_record("psum", "psum_by_primitive", jvp=_psum_jvp_by_primitive)
    gen = torch.Generator().manual_seed(0)
    x, t = (values(mesh, Vma.of(mesh.axis_names), (2, 3), gen) for _ in range(2))

    def program(ctx):
        with forward_ad(ctx):
            bridge_apply(rec, ctx, fwAD.make_dual(x[ctx.k], t[ctx.k]), axes, ())

    with pytest.raises(
        ns.CollectiveError,
        match=r"the jvp of collective 'psum_by_primitive' "
        r"calls the backend primitive ctx\.all_reduce.*RECORDS\['psum'\]",
    ):
        run_instances(mesh, program)
