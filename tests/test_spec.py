"""PartitionSpec: canonical form, axes, and the block layout it means on a mesh."""

from __future__ import annotations

import copy
import itertools
import pickle

import pytest
import torch
from _reference import all_coords, local_block

import named_spmd as ns
from named_spmd import P
from named_spmd._spec import spec_problems


def test_p_is_the_partition_spec_and_a_tuple():
    assert P is ns.PartitionSpec
    assert isinstance(P("dp"), tuple) and P() == ()


@pytest.mark.parametrize(
    "written, canonical",
    [
        (P(("dp",)), P("dp")),
        (P(()), P(None)),
        (P(["dp", "tp"]), P(("dp", "tp"))),
        (P(None, ("tp", "dp")), P(None, ("tp", "dp"))),
    ],
)
def test_entries_have_one_canonical_form(written, canonical):
    assert written == canonical and tuple(written) == tuple(canonical)


def test_axes_entry_axes_and_repr():
    spec = P(("tp", "dp"), None, "pp")
    assert spec.axes == ("tp", "dp", "pp")
    assert spec.entry_axes(0) == ("tp", "dp") and spec.entry_axes(1) == ()
    assert spec.entry_axes(2) == ("pp",) and spec.entry_axes(7) == ()
    assert repr(spec) == "P(('tp', 'dp'), None, 'pp')"
    assert repr(P()) == "P()"
    assert P(("tp", "dp")) != P(("dp", "tp"))  # order matters: the first name is major


def test_pickle_and_copy_keep_the_type():
    spec = P("dp", ("tp", "pp"))
    for clone in (pickle.loads(pickle.dumps(spec)), copy.deepcopy(spec), copy.copy(spec)):
        assert type(clone) is P and clone == spec


def test_spec_problems_collects_everything():
    mesh_shape = {"dp": 2, "tp": 4}
    assert spec_problems(P("dp", "tp"), (4, 8), mesh_shape, "x") == []
    problems = spec_problems(P(("dp", "dp"), "tq", "tp"), (4, 8, 6), mesh_shape, "x")
    text = "\n".join(problems)
    assert len(problems) == 3, problems
    assert "'dp' appears more than once" in text
    assert "unknown mesh axis 'tq'" in text
    assert "dim 2 has size 6, not divisible by 4" in text


# --- the layout: which block each instance receives ----------------------------------------------

MESH = ns.make_mesh((2, 2, 2), ("a", "b", "c"))
SPECS = [
    P(),
    P("a"),
    P(None, "c"),
    P(("a", "b")),
    P(("b", "a")),
    P(("c", "a", "b"), None),
    P("b", ("c", "a")),
    P(("a", "c"), "b"),
]


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_each_instance_receives_the_block_its_coordinates_select(spec):
    x = torch.arange(8 * 4, dtype=torch.float64).reshape(8, 4)
    everyone = MESH.axis_names

    def blocks(x):  # stack every instance's local block, instances in row-major order
        return x.unsqueeze(0)

    got = ns.spmd_map(blocks, mesh=MESH, in_specs=spec, out_specs=P(everyone))(x)
    want = torch.cat(
        [local_block(x, spec, MESH.shape, c).unsqueeze(0) for c in all_coords(MESH.shape)]
    )
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_identity_round_trips_for_every_spec(spec):
    x = torch.randn(8, 4, dtype=torch.float64)
    y = ns.spmd_map(lambda x: x, mesh=MESH, in_specs=spec, out_specs=spec)(x)
    torch.testing.assert_close(y, x, rtol=0, atol=0)


@pytest.mark.parametrize("axes", list(itertools.permutations(("a", "b", "c"), 2)))
def test_tuple_entry_block_index_is_row_major_over_the_tuple(axes):
    """The block an instance receives under P(axes) is block number axis_index(axes)."""
    x = torch.arange(4, dtype=torch.float64)

    def f(x):
        return x - ns.axis_index(axes)

    y = ns.spmd_map(f, mesh=MESH, in_specs=P(axes), out_specs=P(axes))(x)
    torch.testing.assert_close(y, torch.zeros(4, dtype=torch.float64))


def test_missing_trailing_entries_mean_none_and_none_means_p():
    x = torch.randn(4, 6, dtype=torch.float64)

    def shapes(x, w):
        return torch.tensor([x.shape[0], x.shape[1], w.shape[0]])

    out = ns.spmd_map(shapes, mesh=MESH, in_specs=(P("a"), None), out_specs=P())(x, x)
    assert out.tolist() == [2, 6, 4]
