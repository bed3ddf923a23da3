"""Permutations within a group: ppermute, pshuffle, pbroadcast. One section each: the public
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
    Params,
    backward_op,
    no_backward_op,
    same_shape,
    same_vma,
    without_axes,
)

AxisName = str | tuple[str, ...]


def _reversed(pairs: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    return tuple((d, s) for s, d in pairs)


def _permute_forward(ctx: SpmdContext, x: torch.Tensor, axes: Axes, params: Params) -> torch.Tensor:
    return ctx.permute(x, axes, params[0])


def _permutation(name: str, prepare: Any) -> Collective:
    """The record of a permutation whose parameters are its ``(src, dst)`` pairs (made by
    ``prepare`` from the user's arguments): the backend's permute, whose transpose is the same
    collective with every pair reversed."""
    return Collective(
        name=name,
        policy=PVARY,
        vma=same_vma,
        shape=same_shape,
        forward=_permute_forward,
        transpose=lambda ctx, g, axes, params, node: ctx.apply(
            RECORDS[name], g, axes, (_reversed(params[0]),)
        ),
        backward_op=backward_op(name),
        prepare=prepare,
    )


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


PPERMUTE = _permutation(
    "ppermute",
    lambda ctx, axes, perm: (check_pairs(ctx, "ppermute", perm, ctx.mesh.axis_size(axes), axes),),
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


def _pshuffle_prepare(ctx: SpmdContext, axes: Axes, perm: Any) -> Params:
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


PSHUFFLE = _permutation("pshuffle", _pshuffle_prepare)


# --- pbroadcast ----------------------------------------------------------------------------------


def pbroadcast(x: Any, axis_name: AxisName, source: int) -> Any:
    """``pbroadcast(x: T{A,...}, A, source) -> T{...}``: every instance gets instance
    ``source``'s value.

    ``source`` is an ``axis_index(A)`` value (row-major over a tuple of axes). The result is
    identical on the group, so it is invariant over A (JAX's ``pbroadcast``).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> f = ns.spmd_map(lambda x: ns.pbroadcast(x, "i", 2), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())
        >>> f(torch.arange(4.0))
        tensor([2.])

    Backward: instance ``source`` gets the cotangent of the result, the others zero. The
    result is one value invariant over A, whose cotangent every instance already holds whole (as
    for psum, whose transpose is the identity), so no communication runs.
    """
    return PBROADCAST.bind(x, axis_name, source)


def _pbroadcast_prepare(ctx: SpmdContext, axes: Axes, source: Any) -> Params:
    n = ctx.mesh.axis_size(axes)
    try:
        index = operator.index(source)
    except TypeError:
        index = None
    if index is None or not 0 <= index < n or isinstance(source, bool):
        raise CollectiveError(
            f"pbroadcast in {ctx.fn_label}: source must be an instance index along {axes}, an "
            f"integer in 0..{n - 1}, got {source!r}. Fix: e.g. source=0."
        )
    return (index,)


def _pbroadcast_transpose(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    return torch.where(ctx.axis_index(axes) == params[0], g, torch.zeros_like(g))


PBROADCAST = Collective(
    name="pbroadcast",
    policy=PVARY,
    vma=without_axes,
    shape=same_shape,
    forward=lambda ctx, x, axes, params: ctx.broadcast(x, axes, params[0]),
    transpose=_pbroadcast_transpose,
    backward_op=no_backward_op,
    prepare=_pbroadcast_prepare,
)
