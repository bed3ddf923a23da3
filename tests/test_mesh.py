"""Mesh: names, sizes, coordinates; spmd_map on meshes of other shapes and nesting orders."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from _reference import check_against_reference

import named_spmd as ns
from named_spmd import P
from named_spmd.backends.simulated import _plan


def test_mesh_shape_names_and_size():
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    assert isinstance(mesh, ns.Mesh)
    assert mesh.shape == {"dp": 2, "tp": 4} and list(mesh.shape) == ["dp", "tp"]
    assert mesh.axis_names == ("dp", "tp") and mesh.axis_sizes == (2, 4)
    assert mesh.size == 8
    assert mesh.axis_size("tp") == 4 and mesh.axis_size(("tp", "dp")) == 8
    assert mesh.axis_size(()) == 1 and mesh.axis_size(["dp"]) == 2
    with pytest.raises(ns.SpmdError, match=r"unknown axis 'pp'; the mesh has axes \('dp', 'tp'\)"):
        mesh.axis_size(("tp", "pp", "qq"))  # the first unknown one
    assert mesh.kind == "simulated"
    assert repr(mesh) == "Mesh(dp=2, tp=4; simulated)"
    mesh.shape["dp"] = 99  # shape is a copy: the mesh cannot be mutated through it
    assert mesh.shape["dp"] == 2


def test_short_forms_equality_and_hash():
    assert ns.make_mesh(8, "i") == ns.make_mesh((8,), ("i",))
    assert ns.make_mesh((2, 4), ("dp", "tp")) != ns.make_mesh((4, 2), ("dp", "tp"))
    assert ns.make_mesh((2, 4), ("dp", "tp")) != ns.make_mesh((2, 4), ("tp", "dp"))
    assert len({ns.make_mesh((2, 4), ("a", "b")), ns.make_mesh([2, 4], ["a", "b"])}) == 1
    mesh = ns.make_mesh((2, 2), ("a", "b"))
    assert copy.deepcopy(mesh) == mesh


def test_coords_are_row_major_first_axis_major():
    mesh = ns.make_mesh((2, 3, 2), ("a", "b", "c"))
    want = [dict(zip("abc", c)) for c in itertools.product(range(2), range(3), range(2))]
    assert [mesh.coords(k) for k in range(mesh.size)] == want


def test_html_repr_mentions_every_axis():
    html = ns.make_mesh((2, 4), ("dp", "tp"))._repr_html_()
    assert isinstance(html, str) and "dp" in html and "tp" in html


# --- other mesh shapes ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "sizes, names",
    [
        ((1,), ("solo",)),
        ((3,), ("i",)),
        ((3, 2), ("x", "y")),
        ((1, 4), ("a", "b")),
        ((2, 1, 3), "abc"),
    ],
)
def test_odd_mesh_shapes_match_the_reference(sizes, names):
    mesh = ns.make_mesh(sizes, tuple(names))
    names = mesh.axis_names
    n = mesh.size
    x = torch.randn(n * 2, 6, dtype=torch.float64)

    def prog(o, x):
        everyone = tuple(reversed(names))
        s = o.psum(x, everyone)
        g = o.all_gather(x, everyone, axis=1, tiled=True)
        r = o.ppermute(x, names, [(i, (i + 1) % n) for i in range(n)])
        a = o.all_to_all(g, names[0], 1, 0, tiled=True)
        return s, g, r, a + o.axis_index(everyone)

    specs = (P(), P(None, names), P(names), P(names))
    check_against_reference(prog, mesh, P(names), specs, x)


# --- the nesting order is a performance choice, never a semantic one -----------------------------


@pytest.mark.parametrize("big", ["dp", "tp"])
def test_results_do_not_depend_on_the_nesting_order(big):
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    # a large operand replicated over `big` makes `big` the innermost vmap level
    other = "tp" if big == "dp" else "dp"
    x = torch.randn(8, 4, dtype=torch.float64)
    w = torch.randn(4 * mesh.shape[other], 64, dtype=torch.float64)
    in_specs = (P(("dp", "tp")), P(None, other))  # w is replicated over `big` only
    sized = [(t.numel() * t.element_size(), s) for t, s in zip((x, w), in_specs)]
    order = _plan._default_order(mesh, sized)
    assert order[-1] == big

    def prog(o, x, w):
        h = o.all_gather(x, other, axis=1, tiled=True) @ w  # [1, 4 * n_other] @ [.., 64 / n]
        return o.psum_scatter(h, ("tp", "dp"), scatter_dimension=1, tiled=True), o.psum(h, big)

    out_specs = (P(None, ("tp", "dp")), P(None, other))
    check_against_reference(prog, mesh, in_specs, out_specs, x, w)
