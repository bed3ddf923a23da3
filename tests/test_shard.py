"""ns.shard / ns.unshard: on a simulated mesh here, on a real (2, 2) mesh by tests/shard_dist.py
(4 gloo processes on 127.0.0.1, with a hard timeout), both against the global tensors."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import named_spmd as ns
from named_spmd import P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import launch  # noqa: E402


@pytest.fixture
def mesh():
    return ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)


def tree():
    return {
        "w": torch.randn(4, 8, dtype=torch.float64, requires_grad=True),
        "b": torch.nn.Parameter(torch.randn(8, dtype=torch.float64)),
        "ids": torch.arange(8),
        "n": 3,
    }


SPECS = {"w": P(None, ("tp", "dp")), "b": P(("dp", "tp")), "ids": P("dp"), "n": None}


def test_simulated_shard_returns_new_leaves_holding_the_global_values(mesh):
    t = tree()
    s = ns.shard(t, mesh, SPECS)
    for k in ("w", "b", "ids"):
        assert type(s[k]) is type(t[k]) and s[k] is not t[k], k
        assert torch.equal(s[k], t[k].detach()) and s[k].dtype == t[k].dtype, k
        assert s[k].is_leaf and s[k].requires_grad == t[k].requires_grad, k
        assert s[k].data_ptr() != t[k].data_ptr(), k  # an optimizer step leaves t alone
    assert s["n"] == 3
    back = ns.unshard(s)
    assert all(back[k] is s[k] for k in s)  # global values already


def test_simulated_sharded_tree_feeds_a_call_with_the_same_specs(mesh):
    t = tree()
    s = ns.shard(t, mesh, SPECS)
    f = ns.spmd_map(lambda p: p, mesh=mesh, in_specs=(SPECS,), out_specs=SPECS)
    out = f(s)
    for k in ("w", "b", "ids"):
        torch.testing.assert_close(out[k], t[k].detach(), rtol=0, atol=0)


def test_spec_problems_are_listed_once_with_the_tree_path(mesh):
    with pytest.raises(ns.SpecError) as e:
        ns.shard(
            {"w": torch.ones(10, 4), "k": "x"}, mesh, {"w": P(("dp", "tp"), "pt"), "k": P("dp")}
        )
    text = str(e.value)
    assert text.startswith("ns.shard: the tree does not fit specs on mesh {'dp': 2, 'tp': 2}")
    assert "tree['w']: dim 0 has size 10, which ('dp', 'tp') (4 members) do not divide" in text
    assert "unknown mesh axis 'pt'" in text and "Did you mean 'tp'?" in text
    assert "tree['k'] is a str, not a tensor" in text and "Fix: give it P()" in text


def test_specs_that_are_not_a_prefix_name_the_place(mesh):
    with pytest.raises(ns.SpecError) as e:
        ns.shard({"w": torch.ones(4), "b": torch.ones(4)}, mesh, {"w": P("dp")})
    text = str(e.value)
    assert "ns.shard: specs is not a pytree prefix of the tree." in text
    assert "no entry for 'b'" in text and "Fix: give one P(...) per leaf or subtree" in text
    with pytest.raises(ns.SpecError, match="specs must contain PartitionSpecs"):
        ns.shard(torch.ones(4), mesh, "dp")


def test_local_blocks_need_a_real_mesh(mesh):
    with pytest.raises(ns.SpmdError) as e:
        ns.shard({"w": torch.ones(2, 4)}, mesh, P("dp"), local=True)
    assert "is simulated: this one process holds every instance" in str(e.value)
    assert "Fix: pass the global tensors" in str(e.value)
    with pytest.raises(ns.SpecError, match="unknown mesh axis 'pt'"):  # checked first, as real
        ns.shard({"w": torch.ones(2, 4)}, mesh, P("pt"), local=True)


def test_unshard_without_dtensors_returns_the_tree():
    t = tree()
    back = ns.unshard(t)
    assert all(back[k] is t[k] for k in t)


@pytest.mark.distributed
def test_real_mesh_shard_unshard_checkpoint_and_calls(tmp_path):
    world = 4
    finished = launch(
        [os.path.join("tests", "shard_dist.py")], world, 180, SHARD_CKPT_DIR=str(tmp_path / "ck")
    )
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 12 * world, finished.outputs[0][-3000:]
    bad = [o for o in outcomes if o["problems"]]
    assert bad == [], bad[:4]


def test_docstring_example_runs():
    import doctest

    import named_spmd._shard

    result = doctest.testmod(named_spmd._shard, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_simulated_blocks_are_the_global_values_as_new_leaves(mesh):
    """One process holds every instance: its blocks are the global values (copies, so an
    optimizer stepping them leaves the caller's tensors alone, as on a real mesh)."""
    t = tree()
    b = ns.shard(t, mesh, SPECS, blocks=True)
    for k in ("w", "b", "ids"):
        assert torch.equal(b[k], t[k]) and b[k] is not t[k] and b[k].is_leaf
        assert b[k].requires_grad == t[k].requires_grad
    assert isinstance(b["b"], torch.nn.Parameter) and b["n"] == 3


UNEVEN = {"rows": P("tp"), "grid": P("dp", "tp"), "even_tuple": P(("dp", "tp"))}


def uneven_tree():
    g = torch.Generator().manual_seed(3)
    return {
        "rows": torch.randn(5, 3, generator=g, dtype=torch.float64),  # 3, 2 over tp
        "grid": torch.randn(3, 7, generator=g, dtype=torch.float64),  # 2, 1 x 4, 3
        "even_tuple": torch.randn(8, 5, generator=g, dtype=torch.float64),
    }


def test_a_dim_the_axes_do_not_divide_is_split_as_spmd_map_splits_it(mesh):
    """spmd_map's uneven blocks (torch.chunk's): the sharded leaves are the global values and
    feed a call with the same specs, whose blocks are those of the dense tensors (a real mesh:
    tests/shard_dist.py ``check_uneven``)."""
    t = uneven_tree()
    s = ns.shard(t, mesh, UNEVEN)
    assert all(torch.equal(s[k], t[k]) and s[k] is not t[k] for k in t)

    def scaled(p):  # each block scaled by its number (+1) over its spec's axes: the blocks seen
        return {k: v * (ns.axis_index(UNEVEN[k].axes) + 1) for k, v in p.items()}

    out = ns.spmd_map(scaled, mesh=mesh, in_specs=(UNEVEN,), out_specs=UNEVEN)(s)
    want = {k: v.clone() for k, v in t.items()}  # torch.chunk's blocks, scaled in place
    for tp, blk in enumerate(want["rows"].chunk(2, 0)):  # 3, 2 rows
        blk *= tp + 1
    for dp, rows in enumerate(want["grid"].chunk(2, 0)):  # 2, 1 rows x 4, 3 columns
        for tp, blk in enumerate(rows.chunk(2, 1)):
            blk *= 2 * dp + tp + 1
    for i, blk in enumerate(want["even_tuple"].chunk(4, 0)):
        blk *= i + 1
    for k in t:
        torch.testing.assert_close(out[k], want[k], rtol=0, atol=0)


def test_uneven_blocks_no_dtensor_holds_are_refused_on_every_mesh(mesh):
    """A tuple entry over a dim its axes do not divide: torch.chunk's blocks (3, 3, 3, 1) are
    not DTensor's nested split (3, 2, 3, 2), so ns.shard says so (the real mesh alike:
    tests/shard_dist.py ``check_uneven``)."""
    with pytest.raises(ns.SpecError) as e:
        ns.shard({"x": torch.ones(10, 2)}, mesh, P(("dp", "tp")))
    text = str(e.value)
    assert "tree['x']: dim 0 has size 10, which ('dp', 'tp') (4 members) do not divide" in text
    assert "blocks of (3, 3, 3, 1), but a DTensor splits a dim over one mesh dim" in text
    assert "Fix: split dim 0 over one axis, pad it to a multiple of 4" in text
    # 7 rows: torch.chunk's 2, 2, 2, 1 are DTensor's chunks of chunks (the real mesh's DTensor)
    seven = torch.arange(7.0)
    assert torch.equal(ns.shard(seven, mesh, P(("dp", "tp"))), seven)


def test_blocks_of_a_dim_the_axes_do_not_divide_are_refused_on_every_mesh(mesh):
    """blocks=True makes what a local call takes, equal blocks on every rank: a real mesh's
    ``f.local`` refuses torch.chunk's unequal blocks, so ns.shard refuses them on every mesh
    (the real mesh alike: tests/shard_dist.py ``check_uneven``)."""
    with pytest.raises(ns.SpecError) as e:
        ns.shard({"rows": torch.ones(5, 3)}, mesh, {"rows": P("tp")}, blocks=True)
    text = str(e.value)
    assert "tree['rows']: dim 0 has size 5, which ('tp',) (2 members) do not divide" in text
    assert "its blocks would be (3, 2)" in text and "Fix: pad dim 0 to a multiple of 2" in text
    assert ns.shard(torch.ones(6, 3), mesh, P("tp"), blocks=True).shape == (6, 3)
