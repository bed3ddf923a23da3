"""Every collective and axis_index against the per-instance reference (tests/_reference.py).

Meshes (8,), (2,4), (2,2,2); single axes and tuples of axes in both orders; tiled and untiled;
operands varying over every axis, over some, or over none; float64 throughout.
"""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest
import torch
from _reference import check_against_reference, run_reference

import named_spmd as ns
from named_spmd import P

# mesh, the in_spec that makes the operand vary over every axis, and the axis choices to test
MESHES = {
    "8": ((8,), ("i",), P(None, "i"), ["i", ("i",)]),
    "2x4": ((2, 4), ("a", "b"), P("b", None, "a"), ["a", "b", ("a", "b"), ("b", "a")]),
    "2x2x2": (
        (2, 2, 2),
        ("a", "b", "c"),
        P(("c", "a"), "b"),
        [
            "a",
            "c",
            ("a", "b"),
            ("b", "a"),
            ("a", "c"),
            ("c", "b"),
            ("a", "b", "c"),
            ("c", "a", "b"),
        ],
    ),
}


def _names(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


# Each case: (id, program(o, x, axes, n), axes it removes from the operand's vma)
def _cases():
    ring = lambda n: [(i, (i + 1) % n) for i in range(n)]  # noqa: E731
    partial = lambda n: [(0, n - 1), (n - 1, 0)] if n > 1 else []  # noqa: E731
    shuffle = lambda n: [(3 * i + 1) % n for i in range(n)] if n % 3 else list(range(n))[::-1]  # noqa: E731
    return [
        ("psum", lambda o, x, A, n: o.psum(x, A), True),
        ("pmean", lambda o, x, A, n: o.pmean(x, A), True),
        ("pmax", lambda o, x, A, n: o.pmax(x, A), True),
        ("pmin", lambda o, x, A, n: o.pmin(x, A), True),
        ("all_gather-axis0", lambda o, x, A, n: o.all_gather(x, A), False),
        ("all_gather-axis2", lambda o, x, A, n: o.all_gather(x, A, axis=2), False),
        ("all_gather-axis-1", lambda o, x, A, n: o.all_gather(x, A, axis=-1), False),
        ("all_gather-tiled0", lambda o, x, A, n: o.all_gather(x, A, tiled=True), False),
        ("all_gather-tiled1", lambda o, x, A, n: o.all_gather(x, A, axis=1, tiled=True), False),
        ("all_gather-tiled-1", lambda o, x, A, n: o.all_gather(x, A, axis=-1, tiled=True), False),
        ("all_gather-inv", lambda o, x, A, n: o.all_gather(x, A, axis=1, to="invariant"), True),
        (
            "all_gather-inv-tiled",
            lambda o, x, A, n: o.all_gather(x, A, axis=2, tiled=True, to="invariant"),
            True,
        ),
        ("psum_scatter-0", lambda o, x, A, n: o.psum_scatter(x, A), False),
        ("psum_scatter--3", lambda o, x, A, n: o.psum_scatter(x, A, scatter_dimension=-3), False),
        (
            "psum_scatter-tiled1",
            lambda o, x, A, n: o.psum_scatter(x, A, scatter_dimension=1, tiled=True),
            False,
        ),
        (
            "psum_scatter-tiled0",
            lambda o, x, A, n: o.psum_scatter(x, A, scatter_dimension=0, tiled=True),
            False,
        ),
        ("all_to_all-0-0", lambda o, x, A, n: o.all_to_all(x, A, 0, 0), False),
        ("all_to_all-0-2", lambda o, x, A, n: o.all_to_all(x, A, 0, 2), False),
        ("all_to_all-0--1", lambda o, x, A, n: o.all_to_all(x, A, 0, -1), False),
        ("all_to_all-tiled-1-0", lambda o, x, A, n: o.all_to_all(x, A, 1, 0, tiled=True), False),
        ("all_to_all-tiled-1-2", lambda o, x, A, n: o.all_to_all(x, A, 1, 2, tiled=True), False),
        ("all_to_all-tiled-0-1", lambda o, x, A, n: o.all_to_all(x, A, 0, 1, tiled=True), False),
        ("all_to_all-tiled-1-1", lambda o, x, A, n: o.all_to_all(x, A, 1, 1, tiled=True), False),
        ("ppermute-ring", lambda o, x, A, n: o.ppermute(x, A, ring(n)), False),
        ("ppermute-partial", lambda o, x, A, n: o.ppermute(x, A, partial(n)), False),
        ("pshuffle", lambda o, x, A, n: o.pshuffle(x, A, shuffle(n)), False),
        ("pbroadcast-0", lambda o, x, A, n: o.pbroadcast(x, A, 0), True),
        ("pbroadcast-last", lambda o, x, A, n: o.pbroadcast(x, A, n - 1), True),
        ("axis_index", lambda o, x, A, n: x * 10 + o.axis_index(A), False),
        ("axis_size", lambda o, x, A, n: x * o.axis_size(A), False),
    ]


CASES = _cases()
NEEDS_VARYING = ("psum", "psum_scatter")  # an invariant operand is an error for these


def _params():
    for mesh_id, (_, _, _, axis_choices) in MESHES.items():
        for axes in axis_choices:
            for case_id, prog, removes in CASES:
                yield pytest.param(mesh_id, axes, prog, removes, id=f"{mesh_id}-{axes}-{case_id}")


def _global_input(mesh: ns.Mesh, spec: P, local_shape, seed: int) -> torch.Tensor:
    shape = [
        size * math.prod(mesh.shape[a] for a in spec.entry_axes(d))
        for d, size in enumerate(local_shape)
    ]
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g, dtype=torch.float64)


def _out_spec(mesh: ns.Mesh, vma: set[str]) -> P:
    """Name the varying axes on dim 0 (reverse mesh order, to exercise a non-trivial order)."""
    names = tuple(a for a in reversed(mesh.axis_names) if a in vma)
    return P(names) if names else P()


@pytest.mark.parametrize("mesh_id, axes, prog, removes", list(_params()))
def test_collective_matches_reference(mesh_id, axes, prog, removes):
    sizes, names, in_spec, _ = MESHES[mesh_id]
    mesh = ns.make_mesh(sizes, names)
    n = mesh.axis_size(_names(axes))
    x = _global_input(mesh, in_spec, (n, 2 * n, 3), seed=len(mesh_id) + n)
    vma = set(names) - set(_names(axes)) if removes else set(names)
    got = check_against_reference(
        lambda o, x: prog(o, x, axes, n), mesh, in_spec, _out_spec(mesh, vma), x
    )
    assert got.dtype == torch.float64


# --- operands invariant over some or all of the collective's axes (implicit pvary) ---------------

PARTIAL_OPERANDS = {
    "invariant": P(),  # varies over nothing
    "a-only": P("a"),  # varies over a, invariant over b (and c)
}
OK_ON_INVARIANT = [c for c in CASES if not c[0].startswith(NEEDS_VARYING)]


@pytest.mark.parametrize("operand", list(PARTIAL_OPERANDS))
@pytest.mark.parametrize("axes", [("a", "b"), ("b", "a"), "b"])
@pytest.mark.parametrize("case", OK_ON_INVARIANT, ids=[c[0] for c in OK_ON_INVARIANT])
def test_collective_of_partly_invariant_operand(case, axes, operand):
    _, prog, removes = case
    mesh = ns.make_mesh((2, 4), ("a", "b"))
    spec = PARTIAL_OPERANDS[operand]
    n = mesh.axis_size(_names(axes))
    x = _global_input(mesh, spec, (n, 2 * n, 3), seed=7)
    before = set(spec.axes)
    vma = before - set(_names(axes)) if removes else before | set(_names(axes))
    check_against_reference(lambda o, x: prog(o, x, axes, n), mesh, spec, _out_spec(mesh, vma), x)


def test_psum_over_a_subset_of_the_operand_vma():
    mesh = ns.make_mesh((2, 2, 2), ("a", "b", "c"))
    x = _global_input(mesh, P("a", ("c", "b")), (3, 2), seed=3)

    def prog(o, x):
        return o.psum(x, ("c", "a")), o.psum_scatter(x, "b", scatter_dimension=1, tiled=True)

    check_against_reference(prog, mesh, P("a", ("c", "b")), (P(None, "b"), P("a", ("c", "b"))), x)


# --- axis_index and axis_size on their own ------------------------------------------------------


@pytest.mark.parametrize("mesh_id", list(MESHES))
def test_axis_index_every_choice(mesh_id):
    sizes, names, _, axis_choices = MESHES[mesh_id]
    mesh = ns.make_mesh(sizes, names)
    full = tuple(reversed(names))

    def prog(o):
        idx = [o.axis_index(A).reshape(1) for A in axis_choices]
        return idx, [torch.tensor([o.axis_size(A)]) for A in axis_choices]

    got_idx, got_size = check_against_reference(prog, mesh, (), (P(full), P()))
    # position p of the output enumerates the mesh row-major over `full` (its first name major)
    positions = [
        dict(zip(full, c)) for c in itertools.product(*(range(mesh.shape[a]) for a in full))
    ]
    for A, idx, size in zip(axis_choices, got_idx, got_size):
        assert idx.dtype == torch.int64
        assert size.tolist() == [mesh.axis_size(_names(A))]
        want = []
        for coord in positions:
            i = 0
            for a in _names(A):
                i = i * mesh.shape[a] + coord[a]
            want.append(i)
        assert idx.tolist() == want


def test_pvary_of_invariant_input_matches_reference():
    mesh = ns.make_mesh((2, 4), ("a", "b"))
    w = torch.randn(4, 3, dtype=torch.float64)

    def prog(o, w):
        return o.pvary(w, ("b", "a")) * 2

    got = check_against_reference(prog, mesh, P(), P(("a", "b")), w)
    torch.testing.assert_close(got, (w * 2).repeat(8, 1))


def test_reference_detects_a_wrong_out_spec_claim():
    """The reference itself must be able to fail: a varying value under P() is caught."""
    mesh = ns.make_mesh((4,), ("i",))
    x = torch.arange(4.0, dtype=torch.float64)
    from _reference import REF

    with pytest.raises(AssertionError, match="differs"):
        run_reference(lambda x: REF.ppermute(x, "i", [(0, 1), (1, 0)]), mesh, P("i"), P(), x)


@pytest.mark.parametrize("source", [4, -1, 1.5, True, "0", None])
def test_pbroadcast_source_must_be_an_instance_index(source):
    mesh = ns.make_mesh((4,), ("i",))
    f = ns.spmd_map(
        lambda x: ns.pbroadcast(x, "i", source), mesh=mesh, in_specs=P("i"), out_specs=P()
    )
    with pytest.raises(ns.CollectiveError, match=r"pbroadcast in .*<lambda>.*0\.\.3.*Fix: e\.g\."):
        f(torch.arange(4.0))


_WRITES_INTO_RESULTS = {
    "all_gather to invariant": lambda v: ns.all_gather(v, "tp", tiled=True, to="invariant"),
    "all_gather to reduced": lambda v: ns.all_gather(v, "tp", tiled=True, to="reduced"),
    "pbroadcast": lambda v: ns.pbroadcast(v, "tp", 1),
    "all_to_all": lambda v: ns.all_to_all(v, "tp", 0, 0, tiled=True),
}


@pytest.mark.parametrize("per_instance", [False, True], ids=["vmap", "per_instance"])
@pytest.mark.parametrize("name", sorted(_WRITES_INTO_RESULTS))
def test_a_write_into_a_collective_result_leaves_its_operand(name, per_instance):
    """A collective's result is a tensor of its own, as on a real mesh: a write into it reaches
    neither the operand (read after the write) nor the caller's tensor. (The vmap execution's
    gather is a view of the operand's storage: its primitives copy out of it.)"""
    collective = _WRITES_INTO_RESULTS[name]

    def f(v):
        collective(v).mul_(10)
        return v + 0

    x = torch.arange(16.0)
    g = ns.spmd_map(f, mesh=ns.make_mesh((4,), ("tp",)), in_specs=P("tp"), out_specs=P("tp"))
    with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
        out = g(x)
    torch.testing.assert_close(out, torch.arange(16.0))
    torch.testing.assert_close(x, torch.arange(16.0))
