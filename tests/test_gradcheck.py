"""torch.autograd.gradcheck (float64) of every collective on a (2, 2) mesh.

Each case is a spmd_map call seen as a function of its global inputs. gradcheck compares the
analytical Jacobian (reverse mode, and forward mode through jvp) with finite differences, and
also runs the backward under vmap (batched gradients), which nests a user vmap outside the
simulation's own levels.
"""

from __future__ import annotations

import pytest
import torch

import named_spmd as ns
from named_spmd import P

MESH = ns.make_mesh((2, 2), ("a", "b"))
AB = ("a", "b")
BA = ("b", "a")


def _case(name, fn, in_specs, out_specs, *shapes):
    return pytest.param(fn, in_specs, out_specs, shapes, id=name)


CASES = [
    _case("psum", lambda x: ns.psum(x, "a"), P("a", "b"), P(None, "b"), (4, 4)),
    _case("psum_two_axes", lambda x: ns.psum(x, BA), P(AB), P(), (8, 2)),
    _case("pmean", lambda x: ns.pmean(x, AB), P("a", "b"), P(), (4, 4)),
    _case("pbroadcast", lambda x: ns.pbroadcast(x, BA, 2), P(AB), P(), (8, 2)),
    _case(
        "pbroadcast_of_invariant",  # an implicit pvary, then the broadcast
        lambda x: ns.pbroadcast(x, "a", 1) * ns.axis_index("b"),
        P(None, "b"),
        P(None, "b"),
        (2, 4),
    ),
    _case("pmax", lambda x: ns.pmax(x, "b"), P("a", "b"), P("a"), (4, 4)),
    _case("pmin", lambda x: ns.pmin(x, AB), P(BA, None), P(), (8, 3)),
    _case("all_gather", lambda x: ns.all_gather(x, "b", axis=1), P("a", "b"), P(AB), (4, 4)),
    _case(
        "all_gather_tiled", lambda x: ns.all_gather(x, BA, axis=1, tiled=True), P(AB), P(AB), (8, 2)
    ),
    _case(
        "all_gather_invariant",
        lambda x: ns.all_gather(x, "a", tiled=True, to="invariant"),
        P("a", "b"),
        P(None, "b"),
        (4, 4),
    ),
    _case(
        "all_gather_of_invariant",  # an implicit pvary, then the gather
        lambda x: ns.all_gather(x, "a", tiled=True),
        P(None, "b"),
        P(None, ("a", "b")),
        (2, 4),
    ),
    _case(
        "psum_scatter",
        lambda x: ns.psum_scatter(x.reshape(2, 2, 2), "a", scatter_dimension=1),
        P("a", "b"),
        P(AB),
        (4, 8),
    ),
    _case(
        "psum_scatter_tiled",
        lambda x: ns.psum_scatter(x, AB, scatter_dimension=1, tiled=True),
        P(AB),
        P(None, AB),
        (8, 8),
    ),
    _case("all_to_all", lambda x: ns.all_to_all(x, "a", 0, 1), P(AB), P(AB), (8, 3)),
    _case(
        "all_to_all_tiled",
        lambda x: ns.all_to_all(x, BA, 1, 0, tiled=True),
        P("a", "b"),
        P(AB),
        (4, 8),
    ),
    _case(
        "ppermute",
        lambda x: ns.ppermute(x, AB, [(0, 1), (1, 3), (3, 2), (2, 0)]),
        P(AB),
        P(AB),
        (8, 2),
    ),
    _case(
        "ppermute_partial",
        lambda x: ns.ppermute(x, "b", [(0, 1)]),
        P("a", "b"),
        P("a", "b"),
        (4, 4),
    ),
    _case("pshuffle", lambda x: ns.pshuffle(x, BA, [2, 0, 3, 1]), P(AB), P(AB), (8, 2)),
    _case("pvary", lambda x: ns.pvary(x, "b"), P("a"), P("a", "b"), (4, 4)),
    _case(
        "axis_index",
        lambda x: x * (1 + ns.axis_index(BA)),
        P("a"),
        P("a", "b"),
        (4, 4),
    ),
    _case(
        "implicit_pvary",
        lambda w, x: torch.tanh(x @ w),
        (P(), P(AB)),
        P(AB),
        (3, 2),
        (8, 3),
    ),
]


@pytest.mark.parametrize("fn, in_specs, out_specs, shapes", CASES)
def test_gradcheck(fn, in_specs, out_specs, shapes):
    f = ns.spmd_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_specs)
    gen = torch.Generator().manual_seed(0)
    inputs = [
        torch.randn(s, generator=gen, dtype=torch.float64, requires_grad=True) for s in shapes
    ]
    assert torch.autograd.gradcheck(
        f,
        inputs,
        check_forward_ad=True,
        check_batched_grad=True,
        check_batched_forward_grad=True,
    )
    assert torch.autograd.gradgradcheck(f, inputs)
