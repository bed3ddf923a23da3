"""Collectives by axis name: public functions, their vma rules and their accounting.

Each public function validates its arguments against the active call's mesh, applies the vma rule
of DESIGN.md section 3 (implicit pvary of an invariant operand, or an error where pvary would
silently multiply), records the logical collective, and hands the tensor to the backend.
Backends implement the data movement and the transposes.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch

from ._accounting import CommEvent, on_backward, record, recording
from ._collective_checks import check_divisible, check_pairs, checked_dim, require_varying
from ._context import SpmdContext, current
from ._errors import CollectiveError, VmaError
from ._types import VType, vma_text

AxisName = str | Sequence[str]


# --- shared helpers ---------------------------------------------------------------------------


def _map_tensors(x: Any, op: str, ctx: SpmdContext, fn: Callable[[torch.Tensor], torch.Tensor]):
    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            raise CollectiveError(
                f"{op} in {ctx.fn_label}: expected tensors (or a pytree of tensors), got a leaf "
                f"of type {type(t).__name__}. Fix: convert it with torch.as_tensor(...) first."
            )
        return fn(t)

    if isinstance(x, torch.Tensor):  # the common case, without optree's ~3 us
        return fn(x)
    return optree.tree_map(leaf, x)


def _event(op: str, axes: tuple[str, ...], direction: str, t: torch.Tensor, implicit=False):
    return CommEvent(op, axes, direction, tuple(t.shape), t.dtype, implicit)


def _run(ctx, op, axes, t, compute, out_vma, backward_op=None):
    """Record ``op`` forward, run it, tag its output with the backward collective, and give it
    its vma (backends that track vma per tensor store it; the simulated one knows it already)."""
    if recording():  # build the event only when a CommMode listens
        record(_event(op, axes, "forward", t))
    out = compute()
    if backward_op is not None and recording():
        out = on_backward(out, _event(backward_op, axes, "backward", out))
    return ctx.stamp(out, out_vma)


def implicit_pvary(ctx: SpmdContext, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """Make ``t`` varying over ``axes`` where it is invariant (identity forward, psum backward)."""
    missing = tuple(a for a in axes if a not in ctx.vma(t))
    if not missing:
        return t
    out = ctx.pvary(t, missing)
    if recording():
        out = on_backward(out, _event("psum", missing, "backward", out, implicit=True))
    return ctx.stamp(out, ctx.vma(t) | set(missing))


# --- reductions -------------------------------------------------------------------------------


def psum(x: Any, axis_name: AxisName) -> Any:
    """``psum(x: T{A,...}, A) -> T{...}``: elementwise sum over the instances of the group.

    Args:
        x: a tensor or pytree of tensors, varying over every axis of ``axis_name``.
        axis_name: a mesh axis name or a tuple of names.

    Returns:
        The sum, invariant over ``axis_name``. An operand invariant over an axis of ``axis_name``
        is an error (it would be multiplied by the axis size; JAX allows that silently).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> f = ns.spmd_map(lambda x: ns.psum(x, "i"), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())
        >>> f(torch.arange(4.0))
        tensor([6.])

    Backward: pvary (identity per instance), no communication.
    """
    ctx = current("psum")
    axes = ctx.check_axes(axis_name, "psum")
    if isinstance(x, torch.Tensor) and not recording():
        # the common case: the generic bookkeeping below would cost about as much as the sum
        out = ctx.psum_varying(x, axes)
        if out is not None:
            return out

    def one(t):
        require_varying(ctx, t, axes, "psum")
        return _run(ctx, "psum", axes, t, lambda: ctx.psum(t, axes), ctx.vma(t) - set(axes))

    return _map_tensors(x, "psum", ctx, one)


def pmean(x: Any, axis_name: AxisName) -> Any:
    """``pmean(x: T{A,...}, A) -> T{...}``: elementwise mean over the group.

    An operand already invariant over an axis is its own mean there (no error, no communication
    for that axis).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> ns.spmd_map(lambda x: ns.pmean(x, "i"), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())(torch.arange(4.0))
        tensor([1.5000])

    Backward: pvary, divided by the group size; no communication.
    """
    ctx = current("pmean")
    axes = ctx.check_axes(axis_name, "pmean")

    def one(t):
        varying = tuple(a for a in axes if a in ctx.vma(t))
        if not varying:
            return t
        n = ctx.mesh.axis_size(varying)
        return _run(
            ctx, "pmean", varying, t, lambda: ctx.psum(t, varying) / n, ctx.vma(t) - set(axes)
        )

    return _map_tensors(x, "pmean", ctx, one)


def _extremum(op: str, x: Any, axis_name: AxisName) -> Any:
    ctx = current(op)
    axes = ctx.check_axes(axis_name, op)
    compute = ctx.pmax if op == "pmax" else ctx.pmin

    def one(t):
        varying = tuple(a for a in axes if a in ctx.vma(t))
        if not varying:
            return t
        out_vma = ctx.vma(t) - set(axes)
        return _run(ctx, op, varying, t, lambda: compute(t, varying), out_vma, "psum")

    return _map_tensors(x, op, ctx, one)


def pmax(x: Any, axis_name: AxisName) -> Any:
    """``pmax(x: T{A,...}, A) -> T{...}``: elementwise maximum over the group.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> ns.spmd_map(lambda x: ns.pmax(x, "i"), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())(torch.arange(4.0))
        tensor([3.])

    Backward: the gradient goes to the instance holding the maximum; ties split it evenly (as
    ``torch.amax``), which costs one psum of the tie mask on a real mesh. JAX has no derivative.
    """
    return _extremum("pmax", x, axis_name)


def pmin(x: Any, axis_name: AxisName) -> Any:
    """``pmin(x: T{A,...}, A) -> T{...}``: elementwise minimum over the group.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> ns.spmd_map(lambda x: ns.pmin(x, "i"), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())(torch.arange(4.0))
        tensor([0.])

    Backward: to the instance holding the minimum; ties split evenly (see :func:`pmax`).
    """
    return _extremum("pmin", x, axis_name)


# --- data movement ----------------------------------------------------------------------------


def all_gather(
    x: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False, to: str = "varying"
) -> Any:
    """``all_gather(x: T{...}, A) -> T{A,...}``: every instance gets the group's blocks.

    Args:
        x: tensor or pytree of tensors.
        axis_name: axis or tuple of axes (blocks ordered row-major, first name major).
        axis: where the blocks go: a new dim of size n (``tiled=False``) or concatenated along
            existing dim ``axis`` (``tiled=True``).
        to: ``"varying"`` (JAX's default: the result keeps vma A) or ``"invariant"`` (the result
            is known identical on the group: vma loses A, and backward needs no communication).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> g = ns.spmd_map(lambda x: ns.all_gather(x, "i", tiled=True, to="invariant"),
        ...                 mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())
        >>> g(torch.arange(4.0))
        tensor([0., 1., 2., 3.])

    Backward: psum_scatter over the same axes and dim (``to="varying"``); keep the own slice, no
    communication (``to="invariant"``).
    """
    ctx = current("all_gather")
    axes = ctx.check_axes(axis_name, "all_gather")
    if to not in ("varying", "invariant"):
        raise CollectiveError(
            f"all_gather in {ctx.fn_label}: unknown to={to!r}. Fix: use to='varying' (the "
            "default, as in JAX) or to='invariant' (JAX spells it 'invarying')."
        )
    invariant = to == "invariant"

    def one(t):
        if tiled and t.dim() == 0:
            raise CollectiveError(
                f"all_gather in {ctx.fn_label}: tiled=True needs an operand of rank >= 1, got a "
                "scalar. Fix: gather x.reshape(1), or pass tiled=False to stack the scalars."
            )
        d = checked_dim(ctx, t, axis, "all_gather", "axis", extra=0 if tiled else 1)
        t = implicit_pvary(ctx, t, axes)
        back = None if invariant else "psum_scatter"
        out_vma = ctx.vma(t) - set(axes) if invariant else ctx.vma(t)
        return _run(
            ctx,
            "all_gather",
            axes,
            t,
            lambda: ctx.all_gather(t, axes, d, tiled, invariant),
            out_vma,
            back,
        )

    return _map_tensors(x, "all_gather", ctx, one)


def psum_scatter(
    x: Any, axis_name: AxisName, *, scatter_dimension: int = 0, tiled: bool = False
) -> Any:
    """``psum_scatter(x: T{A,...}, A) -> T{A,...}``: sum over the group, keep slice i.

    Instance ``i = axis_index(A)`` keeps slice ``i`` of ``scatter_dimension`` (untiled: that dim
    must have size n and is removed; tiled: it is divided into n blocks).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("i",))
        >>> f = ns.spmd_map(lambda x: ns.psum_scatter(x, "i", tiled=True),
        ...                 mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P("i"))
        >>> f(torch.arange(8.0))
        tensor([ 4.,  6.,  8., 10.])

    Backward: all_gather over the same axes and dim.
    """
    ctx = current("psum_scatter")
    axes = ctx.check_axes(axis_name, "psum_scatter")
    n = ctx.mesh.axis_size(axes)

    def one(t):
        require_varying(ctx, t, axes, "psum_scatter")
        d = checked_dim(ctx, t, scatter_dimension, "psum_scatter", "scatter_dimension")
        check_divisible(ctx, t, d, n, axes, "psum_scatter", "scatter_dimension", tiled)
        return _run(
            ctx,
            "psum_scatter",
            axes,
            t,
            lambda: ctx.psum_scatter(t, axes, d, tiled),
            ctx.vma(t),
            "all_gather",
        )

    return _map_tensors(x, "psum_scatter", ctx, one)


def all_to_all(
    x: Any, axis_name: AxisName, split_axis: int, concat_axis: int, *, tiled: bool = False
) -> Any:
    """``all_to_all(x: T{A,...}, A, split, concat) -> T{A,...}``: chunk j goes to member j.

    ``split_axis`` is cut into n chunks; chunk j goes to member j, which concatenates the chunks
    it receives along ``concat_axis`` in source order. Untiled (JAX's convention): the split dim
    must have size n and is removed, and a new dim of size n appears at ``concat_axis``.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("i",))
        >>> f = ns.spmd_map(lambda x: ns.all_to_all(x, "i", 0, 0, tiled=True),
        ...                 mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P("i"))
        >>> f(torch.arange(4.0))
        tensor([0., 2., 1., 3.])

    Backward: all_to_all with split and concat swapped.
    """
    ctx = current("all_to_all")
    axes = ctx.check_axes(axis_name, "all_to_all")
    n = ctx.mesh.axis_size(axes)

    def one(t):
        s = checked_dim(ctx, t, split_axis, "all_to_all", "split_axis")
        c = checked_dim(ctx, t, concat_axis, "all_to_all", "concat_axis")
        check_divisible(ctx, t, s, n, axes, "all_to_all", "split_axis", tiled)
        t = implicit_pvary(ctx, t, axes)
        return _run(
            ctx,
            "all_to_all",
            axes,
            t,
            lambda: ctx.all_to_all(t, axes, s, c, tiled),
            ctx.vma(t),
            "all_to_all",
        )

    return _map_tensors(x, "all_to_all", ctx, one)


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
    ctx = current("ppermute")
    axes = ctx.check_axes(axis_name, "ppermute")
    pairs = check_pairs(ctx, "ppermute", perm, ctx.mesh.axis_size(axes), axes)

    def one(t):
        t = implicit_pvary(ctx, t, axes)
        compute = lambda: ctx.ppermute(t, axes, pairs)  # noqa: E731
        return _run(ctx, "ppermute", axes, t, compute, ctx.vma(t), "ppermute")

    return _map_tensors(x, "ppermute", ctx, one)


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
    ctx = current("pshuffle")
    axes = ctx.check_axes(axis_name, "pshuffle")
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
    pairs = tuple((src, dst) for dst, src in enumerate(order))

    def one(t):
        t = implicit_pvary(ctx, t, axes)
        compute = lambda: ctx.ppermute(t, axes, pairs)  # noqa: E731
        return _run(ctx, "pshuffle", axes, t, compute, ctx.vma(t), "pshuffle")

    return _map_tensors(x, "pshuffle", ctx, one)


def pvary(x: Any, axis_name: AxisName) -> Any:
    """``pvary(x: T{...}, A) -> T{A,...}``: declare an invariant value varying over A.

    Identity on data. Raises if ``x`` already varies over an axis of A. Mixing an invariant value
    with a varying one does this implicitly, once per (tensor, axes).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("i",))
        >>> @ns.spmd_map(mesh=mesh, in_specs=ns.P(), out_specs=ns.P("i"))
        ... def f(w):
        ...     v = ns.pvary(w, "i")  # same data, now typed as varying over "i"
        ...     return v * (ns.axis_index("i") + 1)
        >>> f(torch.ones(1))
        tensor([1., 2.])

    Backward: psum over A.
    """
    ctx = current("pvary")
    axes = ctx.check_axes(axis_name, "pvary")

    def one(t):
        already = [a for a in axes if a in ctx.vma(t)]
        if already:
            raise VmaError(
                f"pvary in {ctx.fn_label}: the operand already varies over {tuple(already)} (type "
                f"{typeof(t)}). Fix: pvary only over axes it is invariant over."
            )
        out = ctx.pvary(t, axes)
        out = on_backward(out, _event("psum", axes, "backward", out))
        return ctx.stamp(out, ctx.vma(t) | set(axes))

    return _map_tensors(x, "pvary", ctx, one)


# --- indices and types ------------------------------------------------------------------------


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


def vma(x: Any) -> frozenset[str]:
    """The mesh axes over which ``x`` may differ between instances (inside spmd_map).

    Non-tensors are invariant: ``frozenset()``.
    """
    ctx = current("vma")
    if not isinstance(x, torch.Tensor):
        return frozenset()
    return ctx.vma(x)


def typeof(x: Any) -> VType:
    """The compact type of ``x`` inside spmd_map, e.g. ``f32[8,4]{dp}`` (per-device shape)."""
    ctx = current("typeof")
    if not isinstance(x, torch.Tensor):
        raise CollectiveError(
            f"typeof in {ctx.fn_label}: expected a tensor, got {type(x).__name__}."
        )
    return VType(x.dtype, tuple(x.shape), ctx.vma(x), ctx.mesh.axis_names)


__all__ = [
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pshuffle",
    "psum",
    "psum_scatter",
    "pvary",
    "typeof",
    "vma",
    "vma_text",
]
