"""Block geometry (``named_spmd._layout``): uneven blocks as torch.chunk and DTensor's Shard
make them, explicit sizes (``ns.Blocks``), and the public ``ns.block_sizes`` helper."""

from __future__ import annotations

import itertools
import pickle

import pytest
import torch

import named_spmd as ns
from named_spmd import P
from named_spmd._layout import (
    block,
    chunk_sizes,
    concat_blocks,
    dim_sizes,
    is_even,
    split_all,
    split_index,
)
from named_spmd._spec import spec_problems


def _chunk_reference(size: int, n: int) -> list[int]:
    """torch.chunk's block sizes, padded with empty blocks to n (DTensor's Shard does that)."""
    sizes = [c.shape[0] for c in torch.arange(size).chunk(n)] if size else []
    return sizes + [0] * (n - len(sizes))


@pytest.mark.parametrize("size, n", [(s, n) for s in range(0, 13) for n in range(1, 6)])
def test_chunk_sizes_are_torch_chunk_padded_with_empty_blocks(size, n):
    assert list(chunk_sizes(size, n)) == _chunk_reference(size, n)


def test_divisible_dims_keep_equal_blocks_and_others_follow_chunk():
    sizes = {"dp": 2, "tp": 4}
    assert dim_sizes(P("tp"), 0, 8, sizes) == (2, 2, 2, 2)
    assert dim_sizes(P("tp"), 0, 10, sizes) == (3, 3, 3, 1)
    assert dim_sizes(P(("dp", "tp")), 0, 13, sizes) == (2,) * 6 + (1, 0)
    assert dim_sizes(P(ns.Blocks("tp", (4, 3, 3, 0))), 0, 10, sizes) == (4, 3, 3, 0)
    assert is_even((8, 3), P("tp"), sizes) and not is_even((10, 3), P("tp"), sizes)
    assert not is_even((8,), P(ns.Blocks("dp", (5, 3))), sizes)
    assert is_even((8,), P(ns.Blocks("dp", (4, 4))), sizes)


MESH_SHAPES = [{"a": 2, "b": 3}, {"a": 3}]
SPECS = [P("a"), P(None, "b"), P(("a", "b")), P("b", "a"), P(ns.Blocks("a", (1, 4)), "b")]


@pytest.mark.parametrize(
    "shape, spec", [((5, 7), s) for s in SPECS] + [((6, 9), s) for s in SPECS[:4]]
)
def test_blocks_are_the_chunks_of_each_dim_and_concat_back(shape, spec):
    """Each instance's block is torch.chunk's (or the given sizes') piece of every split dim,
    and concatenating the blocks in row-major order gives the global tensor back."""
    sizes = {"a": 2, "b": 3}
    x = torch.arange(shape[0] * shape[1]).reshape(shape)
    order = [a for a in sizes if a in spec.axes]
    blocks = []
    for values in itertools.product(*(range(sizes[a]) for a in order)):
        coords = dict(zip(order, values))
        got = block(x, spec, sizes, coords)
        want = x
        for d in range(2):
            axes = spec.entry_axes(d)
            if axes:
                index = 0
                for a in axes:
                    index = index * sizes[a] + coords[a]
                given = spec.entry_sizes(d)
                pieces = (
                    want.split(list(given), d)
                    if given is not None
                    else want.chunk(_n(axes, sizes), d)
                )
                pieces = list(pieces) + [want.narrow(d, 0, 0)] * (_n(axes, sizes) - len(pieces))
                want = pieces[index]
        assert torch.equal(got, want), (coords, got, want)
        # all blocks at once (one split per dim), and where this one is among them
        assert torch.equal(split_all(x, spec, sizes)[split_index(spec, 2, sizes, coords)], want)
        blocks.append(got)
    assert torch.equal(concat_blocks(blocks, spec, sizes, order), x)


def _n(axes, sizes):
    n = 1
    for a in axes:
        n *= sizes[a]
    return n


def test_blocks_entry_repr_equality_pickle_and_errors():
    e = ns.Blocks("x", [4, 3, 3])
    assert repr(P(e, None)) == "P(Blocks('x', (4, 3, 3)), None)"
    assert e == ns.Blocks(("x",), (4, 3, 3)) and hash(e) == hash(ns.Blocks("x", (4, 3, 3)))
    spec = P(e, "y")
    assert pickle.loads(pickle.dumps(spec)) == spec
    assert spec.axes == ("x", "y") and spec.entry_axes(0) == ("x",)
    assert spec.entry_sizes(0) == (4, 3, 3) and spec.entry_sizes(1) is None
    with pytest.raises(ns.SpecError, match="non-negative integers"):
        ns.Blocks("x", (4, -1))
    with pytest.raises(ns.SpecError, match="non-negative integers"):
        ns.Blocks("x", (4, 2.5))
    with pytest.raises(ns.SpecError, match="axis name or a tuple of names"):
        ns.Blocks(3, (4,))


def test_spec_problems_of_uneven_dims_and_explicit_sizes():
    mesh_shape = {"x": 3}
    # a dim the axes do not divide: a problem only where the caller takes equal blocks alone
    assert "not divisible by 3" in spec_problems(P("x"), (10,), mesh_shape, "w")[0]
    assert spec_problems(P("x"), (10,), mesh_shape, "w", uneven=True) == []
    # explicit sizes must add up and count one block per member, uneven or not
    for bad in ((4, 3, 2), (5, 5)):
        (text,) = spec_problems(P(ns.Blocks("x", bad)), (10,), mesh_shape, "w", uneven=True)
        assert "Fix: give 3 block sizes that add up to 10" in text, text
    (text,) = spec_problems(P(ns.Blocks("x", (4, 3, 3))), (10,), mesh_shape, "w")
    assert "blocks of unequal sizes" in text and "Fix:" in text
    assert spec_problems(P(ns.Blocks("x", (4, 3, 3))), (10,), mesh_shape, "w", uneven=True) == []
    assert spec_problems(P(ns.Blocks("x", (2, 2, 2))), (6,), mesh_shape, "w") == []


def test_block_sizes_helper_outside_and_inside_a_call():
    mesh = ns.make_mesh((2, 3), ("a", "b"))
    assert ns.block_sizes(10, "b", mesh=mesh) == tuple(_chunk_reference(10, 3))
    assert ns.block_sizes(13, ("a", "b"), mesh=mesh) == tuple(_chunk_reference(13, 6))
    assert ns.block_offsets(10, "b", mesh=mesh) == (0, 4, 8)
    seen = []

    def f(x):
        seen.append((ns.block_sizes(12, "b"), ns.block_offsets(7, ("a", "b"))))
        return x

    ns.spmd_map(f, mesh=mesh, in_specs=P("a"), out_specs=P("a"))(torch.ones(4))
    assert seen == [((4, 4, 4), (0, 2, 4, 6, 7, 7))]
    with pytest.raises(ns.CollectiveError, match="outside spmd_map"):
        ns.block_sizes(10, "b")
    with pytest.raises(ns.CollectiveError, match="non-negative int"):
        ns.block_sizes(-1, "b", mesh=mesh)


def test_explicit_equal_blocks_run_as_a_plain_split():
    mesh = ns.make_mesh((2,), ("x",))
    x = torch.arange(6.0)
    f = ns.spmd_map(
        lambda v: v * 2, mesh=mesh, in_specs=P(ns.Blocks("x", (3, 3))), out_specs=P("x")
    )
    torch.testing.assert_close(f(x), x * 2)
