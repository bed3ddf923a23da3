"""Types and indices inside spmd_map: pvary (the cast), axis_index, axis_size, vma, typeof."""

from __future__ import annotations

from typing import Any

import torch

from .._calls import current
from .._context import SpmdContext
from .._errors import CollectiveError, SpmdError
from .._layout import chunk_sizes, dim_offsets
from .._types import VType
from ._record import pvary

AxisName = str | tuple[str, ...]


def axis_index(axis_name: AxisName) -> torch.Tensor:
    """``axis_index(A) -> i64[]{A}``: this instance's index along A (row-major over a tuple).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2, 2), ("a", "b"))
        >>> f = ns.spmd_map(lambda: ns.axis_index(("a", "b")).reshape(1), mesh=mesh, in_specs=(), out_specs=ns.P(("a", "b")))
        >>> f()
        tensor([0, 1, 2, 3])
    """
    ctx = current("axis_index")
    return ctx.axis_index(ctx.check_axes(axis_name, "axis_index"))


def axis_size(axis_name: AxisName) -> int:
    """``axis_size(A) -> int``: the number of instances in the group of A (no communication)."""
    ctx = current("axis_size")
    return ctx.mesh.axis_size(ctx.check_axes(axis_name, "axis_size"))


def block_sizes(size: int, axis_name: AxisName, *, mesh: Any = None) -> tuple[int, ...]:
    """The sizes of the blocks a dim of global ``size`` split over ``axis_name`` has, one per
    member of the group, in member order (row-major over a tuple): equal where the group size
    divides ``size``, else ``torch.chunk``'s (``ceil(size / n)`` each, the last ones smaller,
    perhaps empty), as ``P(axis_name)`` splits an input. Inside spmd_map the mesh is the call's;
    outside, pass ``mesh=``. What a halo exchange or a mask over uneven blocks needs.

    Example:
        >>> import named_spmd as ns
        >>> ns.block_sizes(10, "x", mesh=ns.make_mesh((4,), ("x",)))
        (3, 3, 3, 1)
    """
    ctx = None if mesh is not None else current("block_sizes")
    the_mesh = mesh if mesh is not None else ctx.mesh  # type: ignore[union-attr]
    axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    if ctx is not None:
        axes = ctx.check_axes(axis_name, "block_sizes")
    n = the_mesh.axis_size(axes)
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise CollectiveError(
            f"block_sizes: size must be a non-negative int (a global dim's size), got {size!r}."
        )
    return chunk_sizes(size, n)  # equal blocks where n divides the size


def block_offsets(size: int, axis_name: AxisName, *, mesh: Any = None) -> tuple[int, ...]:
    """Where each block of :func:`block_sizes` starts in the global dim (member order).

    Example:
        >>> import named_spmd as ns
        >>> ns.block_offsets(10, "x", mesh=ns.make_mesh((4,), ("x",)))
        (0, 3, 6, 9)
    """
    return dim_offsets(block_sizes(size, axis_name, mesh=mesh))


def _asking_for_types(op: str) -> SpmdContext:
    """The active call, noted as one whose function reads types (never replayed untyped: a
    replay has no types to give, ``named_spmd._replay``)."""
    ctx = current(op)
    ctx.types_read = True
    if ctx.replaying:
        raise SpmdError(
            f"{op} in {ctx.fn_label}: this call runs untyped, as a replay of an earlier call with "
            "the same signature on a mesh of one instance, and that call asked for no type: the "
            "function's Python control flow changed between calls of one signature. Fix: type "
            "every call with ns.set_debug(True), or ask for the types on every call (the first "
            "one with this signature included)."
        )
    return ctx


def vma(x: Any) -> frozenset[str]:
    """The mesh axes over which ``x`` may differ between instances (inside spmd_map).

    Non-tensors are invariant: ``frozenset()``.
    """
    ctx = _asking_for_types("vma")
    if not isinstance(x, torch.Tensor):
        return frozenset()
    return ctx.vma(x).varying


def typeof(x: Any) -> VType:
    """The compact type of ``x`` inside spmd_map, e.g. ``f32[8,4]{dp}`` (per-device shape)."""
    ctx = _asking_for_types("typeof")
    if not isinstance(x, torch.Tensor):
        raise CollectiveError(
            f"typeof in {ctx.fn_label}: expected a tensor, got {type(x).__name__}."
        )
    return VType(x.dtype, tuple(x.shape), ctx.vma(x), ctx.mesh.axis_names)


__all__ = ["axis_index", "axis_size", "block_offsets", "block_sizes", "pvary", "typeof", "vma"]
