"""Permutations within a group: ppermute, pshuffle. One section each: the public
function, then its record (checks, policy, type and shape rules, forward, transpose)."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import torch

from .._context import Axes, SpmdContext
from .._errors import CollectiveError
from ._checks import check_pairs
from ._record import (
    PVARY,
    RECORDS,
    Collective,
    backward_op,
    same_shape,
    same_vma,
)

AxisName = str | tuple[str, ...]


def _reversed(pairs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    return tuple((d, s) for s, d in pairs)


def _permute_forward(ctx: SpmdContext, x: torch.Tensor, axes: Axes, params, donate: bool):
    return ctx.permute(x, axes, params[0])


# --- ppermute ------------------------------------------------------------------------------------


def ppermute(x: Any, axis_name: AxisName, perm: Sequence[tuple[int, int]]) -> Any:
    """``ppermute(x: T{...}, A, perm) -> T{A,...}``: send along (src, dst) pairs.

    Instance ``dst`` receives ``src``'s value; instances that receive nothing get zeros. Indices are
    ``axis_index(A)`` values (row-major over a tuple of axes).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> ring = [(i, (i + 1) % 4) for i in range(4)]
        >>> f = ns.spmd_map(lambda x: ns.ppermute(x, "i", ring), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P("i"))
        >>> f(torch.arange(4.0))
        tensor([3., 0., 1., 2.])

    Backward: ppermute with every pair reversed.
    """
    return PPERMUTE.bind(x, axis_name, perm)


PPERMUTE = Collective(
    name="ppermute",
    policy=PVARY,
    vma=same_vma,
    shape=same_shape,
    forward=_permute_forward,
    transpose=lambda ctx, g, axes, params, node: ctx.apply(
        RECORDS["ppermute"], g, axes, (_reversed(params[0]),)
    ),
    backward_op=backward_op("ppermute"),
    prepare=lambda ctx, axes, perm: (
        check_pairs(ctx, "ppermute", perm, ctx.mesh.axis_size(axes), axes),
    ),
)


# --- pshuffle ------------------------------------------------------------------------------------


def pshuffle(x: Any, axis_name: AxisName, perm: Sequence[int]) -> Any:
    """``pshuffle(x: T{...}, A, perm) -> T{A,...}``: instance i gets instance ``perm[i]``'s value.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> f = ns.spmd_map(lambda x: ns.pshuffle(x, "i", [3, 2, 1, 0]), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P("i"))
        >>> f(torch.arange(4.0))
        tensor([3., 2., 1., 0.])

    Backward: the inverse shuffle.
    """
    return PSHUFFLE.bind(x, axis_name, perm)


def _pshuffle_prepare(ctx: SpmdContext, axes: Axes, perm: Any):
    n = ctx.mesh.axis_size(axes)
    try:  # operator.index: 1.5 or 0.9 are not indices (int() would truncate them silently)
        order = [operator.index(p) for p in perm]
    except TypeError:
        order = None
    if order is None or sorted(order) != list(range(n)):
        raise CollectiveError(
            f"pshuffle in {ctx.fn_label}: perm must be a permutation of range({n}) (the group "
            f"size of {axes}), got {perm!r}. Fix: e.g. perm=[{', '.join(map(str, range(n - 1, -1, -1)))}]."
        )
    return (tuple((src, dst) for dst, src in enumerate(order)),)


PSHUFFLE = Collective(
    name="pshuffle",
    policy=PVARY,
    vma=same_vma,
    shape=same_shape,
    forward=_permute_forward,
    transpose=lambda ctx, g, axes, params, node: ctx.apply(
        RECORDS["pshuffle"], g, axes, (_reversed(params[0]),)
    ),
    backward_op=backward_op("pshuffle"),
    prepare=_pshuffle_prepare,
)
