"""Plans of the simulated backend: the vmap nesting order and how inputs enter and outputs leave.

What only depends on the mesh, the specs and the shapes (the nesting order, how each input is
viewed as [mesh dims, *local] and each output assembled back) is computed once and cached:
per call that Python costs more than the vmap itself on small operands. The block geometry itself
is ``named_spmd._layout``'s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import torch

from ..._blocks import holds_blocks
from ..._layout import physical_layout
from ..._mesh import Mesh
from ..._spec import PartitionSpec
from . import _stacked as stacked


def _default_order(mesh: Mesh, sized: Sequence[tuple[int, PartitionSpec]]) -> list[str]:
    """Mesh axes outermost first, for inputs of ``sized`` = (bytes, spec). Innermost is the axis
    with the most input bytes replicated over it: vmap then batches the large replicated
    operands (weights) last, so they are not copied once per outer instance
    (benchmarks/bench_simulated.py: the rows "dp outermost" against "default order")."""
    replicated = dict.fromkeys(mesh.axis_names, 0)
    for nbytes, spec in sized:
        named = set(spec.axes)
        per_instance = nbytes // max(1, math.prod(mesh.shape[b] for b in named))
        for a in mesh.axis_names:
            if a not in named:
                replicated[a] += per_instance
    order = list(mesh.axis_names)
    return sorted(order, key=lambda a: (replicated[a], -order.index(a)))


class Entry(NamedTuple):
    """How the inputs of a call enter the levels: fixed by its ``Call.memo`` (the mapped
    function, the tree structure, the leaves' shapes and dtypes) and the nesting order asked
    for, so made once per memo (:func:`input_entry`). Leaves by their position."""

    order: tuple[str, ...]  # the nesting order, outermost first
    views: tuple[tuple[int, list[int], list[int] | None], ...]  # (leaf, reshape, permutation)
    batched: tuple[tuple[int, ...], ...]  # per axis of ``order``: the leaves batched at it
    partial: tuple[int, ...]  # leaves whose spec is unreduced or reduced over some axes
    blocks: tuple[int, ...]  # leaves holding blocks of mesh axes (``_blocks.mark``)
    first: int | None  # the first tensor leaf: its device is the call's


def input_entry(call: Any, forced: tuple[str, ...] | None) -> Entry:
    """``call``'s :class:`Entry` (``forced``: the nesting order ``simulation_order`` asks)."""
    key = ("simulated entry", forced)
    entry = call.memo.get(key)
    if entry is None:
        entry = call.memo[key] = _make_entry(call.mesh, call.leaves, call.specs, forced)
    return entry


def _make_entry(
    mesh: Mesh, leaves: list[Any], specs: list[PartitionSpec], forced: tuple[str, ...] | None
) -> Entry:
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    inputs = tuple((tuple(leaves[i].shape), leaves[i].element_size(), specs[i]) for i in tensor_pos)
    order, plans = _input_plan(tuple(mesh.shape.items()), mesh, inputs, forced)
    # a leaf no axis splits enters as it is: no view (nor its node in backward) per call
    views = tuple(
        (i, split, perm)
        for i, (split, perm, _) in zip(tensor_pos, plans)
        if perm is not None or split != list(leaves[i].shape)
    )
    batched = tuple(
        tuple(i for i, (_, _, axes) in zip(tensor_pos, plans) if a in axes) for a in order
    )
    partial = tuple(i for i in tensor_pos if specs[i].reduced or specs[i].unreduced)
    blocks = tuple(i for i in tensor_pos if holds_blocks(specs[i], leaves[i].dim()))
    return Entry(order, views, batched, partial, blocks, tensor_pos[0] if tensor_pos else None)


# The caches key on the mesh's (name, size) items as well as the mesh: Mesh equality ignores
# the axis order, which the plans depend on.
@functools.lru_cache(maxsize=1024)
def _input_plan(axes: tuple, mesh: Mesh, inputs: tuple, order: tuple[str, ...] | None) -> tuple:
    """For ``inputs`` = ((shape, itemsize, spec) per tensor leaf): (nesting order, and per
    input: reshape, permutation (None: identity), the axes it is batched at)."""
    if order is None:
        sized = [(math.prod(shape) * size, spec) for shape, size, spec in inputs]
        order = tuple(_default_order(mesh, sized))
    plans = []
    for shape, _, spec in inputs:
        split, perm = physical_layout(shape, spec, mesh._shape, order)
        plans.append((split, None if perm == sorted(perm) else perm, frozenset(spec.axes)))
    return order, plans


@functools.lru_cache(maxsize=1024)
def _output_plan(
    shape: tuple[int, ...], present: tuple[str, ...], spec: PartitionSpec, axes: tuple, mesh: Mesh
) -> tuple:
    """How :func:`from_physical` assembles: (instance-0 index or None, sizes of the dims to tile
    in front, permutation (None: identity), final sizes)."""
    named = set(spec.axes)
    kept = [a for a in present if a in named]
    index = None
    shape_list = list(shape)
    if len(kept) < len(present):  # varying over an unnamed axis (check_vma=False): instance 0
        index = tuple(slice(None) if a in named else 0 for a in present)
        shape_list = [s for a, s in zip(present, shape) if a in named] + shape_list[len(present) :]
    tiles = []
    for a in sorted(named.difference(kept)):  # invariant over a named axis: identical blocks
        tiles.append(mesh.shape[a])
        kept.insert(0, a)
        shape_list.insert(0, mesh.shape[a])
    perm: list[int] = []
    sizes: list[int] = []
    for d in range(len(shape_list) - len(kept)):
        group = [kept.index(a) for a in spec.entry_axes(d)] + [len(kept) + d]
        perm.extend(group)
        sizes.append(math.prod([shape_list[i] for i in group]))  # a list: Dynamo traces it
    return index, tiles, None if perm == sorted(perm) else perm, sizes


def partial_input(ctx: Any, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    """An input unreduced over A: the member at coordinate 0 of A holds the global value, the
    others zeros (parts that sum to it). Reduced: unbatched as an invariant input; the mark
    says reduced. ``ctx``: a simulated call's context (``pvary``, a ``tokens`` dict)."""
    x = x.view_as(x)  # a tensor object of the call's own, for the mark
    for a in spec.unreduced:
        x = ctx.pvary(x, (a,))
        x = torch.where(ctx.tokens[a] == 0, x, torch.zeros_like(x))
    return x


def from_physical(
    y: torch.Tensor,
    present: Sequence[str],
    spec: PartitionSpec,
    mesh: Mesh,
    cached: bool = True,
) -> torch.Tensor:
    """[one dim per axis of ``present`` (nesting order), *local] -> global tensor per ``spec``.

    ``present`` are the axes the output is batched at. An axis the spec does not name contributes
    its instance-0 copy (invariant when checked); an axis the spec names but the output is
    invariant over is tiled. ``cached=False`` while Dynamo traces (it warns about the plan's
    ``lru_cache``)."""
    if spec.unreduced:  # partial sums over those axes: the output is their total
        dims = [i for i, a in enumerate(present) if a in spec.unreduced]
        # unbatched over some (check_vma=False, an invariant or reduced value): equal parts
        copies = math.prod([mesh.shape[a] for a in spec.unreduced if a not in present])
        if dims:
            parts = y.movedim(dims, list(range(len(dims)))).flatten(0, len(dims) - 1)
            y = stacked.reduce(parts, stacked.reduction("sum", y.dtype))
            present = [a for a in present if a not in spec.unreduced]
        if copies > 1:
            y = y * copies
    axes = tuple(mesh.shape.items())
    plan = _output_plan if cached else _output_plan.__wrapped__
    index, tiles, perm, sizes = plan(tuple(y.shape), tuple(present), spec, axes, mesh)
    if index is not None:
        y = y[index]
    for n in tiles:  # each new one in front: the last one leads, as in the plan
        y = y.expand(n, *y.shape)
    if perm is not None:
        y = y.permute(perm)
    return y.reshape(sizes)  # a list: rank-0 outputs have no dims
