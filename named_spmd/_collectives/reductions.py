"""Reductions over a group: psum, pmean, pmax, pmin. One section each: the public function,
then its record (policy, type and shape rules, forward on the primitives, transpose)."""

from __future__ import annotations

import functools
from typing import Any

import torch

from .._context import Axes, SpmdContext
from .._errors import CollectiveError
from ._checks import Invariant, axis_sizes, check_reducible, dtype_and_device
from ._fused import reduce_tree
from ._record import (
    DROP_INVARIANT,
    RECORDS,
    REQUIRE_VARYING,
    Collective,
    Params,
    backward_op,
    no_backward_op,
    same_shape,
    without_axes,
)

AxisName = str | tuple[str, ...]


# --- psum ----------------------------------------------------------------------------------------


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
    return PSUM.bind(x, axis_name)


def _identity_transpose(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    return g


def _psum_of_invariant(op: Invariant) -> str:
    return (
        f"psum over {op.axes} would add {op.copies} identical copies of it and multiply it by "
        f"{op.copies}. JAX does that silently; named_spmd refuses. Fix: drop {op.invariant} from "
        "the collective's axes if the value is already the total, or write "
        f"x * {axis_sizes(op.invariant)} if you really mean to multiply."
    )


def _summable(ctx: SpmdContext, t: torch.Tensor, axes: Axes, params: Params) -> Params:
    check_reducible(ctx, t, "psum", "sum")
    return params


PSUM = Collective(
    name="psum",
    check=_summable,
    policy=REQUIRE_VARYING,
    vma=without_axes,
    shape=same_shape,
    forward=lambda ctx, x, axes, params: ctx.all_reduce(x, axes, "sum"),
    transpose=_identity_transpose,  # pvary: the same data, no communication
    backward_op=no_backward_op,
    donates=True,
    tree=reduce_tree,  # a pytree's leaves reduced together where a backend asks
    invariant_operand=_psum_of_invariant,
    unreduced="reduce",  # of a partial sum: the total (U -> I; transpose I -> R, no communication)
)


# --- pmean ---------------------------------------------------------------------------------------


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
    return PMEAN.bind(x, axis_name)


def _pmean_forward(ctx: SpmdContext, x: torch.Tensor, axes: Axes, params: Params) -> torch.Tensor:
    total = ctx.all_reduce(x, axes, "sum")
    if ctx.single_axes.issuperset(axes) and (total is not x or x is getattr(ctx, "donated", None)):
        return total  # a group of one: the sum (a new tensor, or one handed back) is the mean
    return total / ctx.mesh.axis_size(axes)


def _mean_operand(ctx: SpmdContext, t: torch.Tensor, axes: Axes, params: Params) -> Params:
    dtype = dtype_and_device(t)[0]
    if not (dtype.is_floating_point or dtype.is_complex):
        raise CollectiveError(
            f"pmean in {ctx.fn_label}: the operand is {dtype}, and a mean of integers or "
            "truth values is not one of them (torch.mean refuses them too). Fix: pmean of "
            "x.float() (or psum for a count)."
        )
    check_reducible(ctx, t, "pmean", "sum")
    return params


PMEAN = Collective(
    name="pmean",
    check=_mean_operand,
    policy=DROP_INVARIANT,
    vma=without_axes,
    shape=same_shape,
    forward=_pmean_forward,
    transpose=lambda ctx, g, axes, params, node: g / ctx.mesh.axis_size(axes),
    backward_op=no_backward_op,
    donates=True,
    tree=reduce_tree,  # a pytree's leaves reduced together where a backend asks
    unreduced="reduce",
)


# --- pmax, pmin ----------------------------------------------------------------------------------


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
    return PMAX.bind(x, axis_name)


def pmin(x: Any, axis_name: AxisName) -> Any:
    """``pmin(x: T{A,...}, A) -> T{...}``: elementwise minimum over the group.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> ns.spmd_map(lambda x: ns.pmin(x, "i"), mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())(torch.arange(4.0))
        tensor([0.])

    Backward: to the instance holding the minimum; ties split evenly (see :func:`pmax`).
    """
    return PMIN.bind(x, axis_name)


def _tie_share(ctx: SpmdContext, x: torch.Tensor, y: torch.Tensor, axes: Axes) -> torch.Tensor:
    """Each member's share of the gradient of an extremum: 1/count where it holds the value."""
    mask = (x == y).to(y.dtype if y.is_floating_point() else torch.get_default_dtype())
    # through apply, not the primitive: under a user vmap of a grad inside the function the
    # mask is batched, and only the bridge's vmap rule unbatches it for real communication
    return mask / ctx.apply(RECORDS["psum"], mask, axes, ())  # a copy: mask is read again


def _extremum_transpose(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    x, y = node.saved_tensors
    return g * _tie_share(ctx, x, y, axes)


def _extremum_jvp(
    ctx: SpmdContext, rec: Collective, t: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    x, y = node.saved_tensors
    return ctx.apply(RECORDS["psum"], t * _tie_share(ctx, x, y, axes), axes, ())


def _ordered_operand(
    ctx: SpmdContext, t: torch.Tensor, axes: Axes, params: Params, *, name: str
) -> Params:
    if t.is_complex():
        raise CollectiveError(
            f"{name} in {ctx.fn_label}: the operand is complex ({t.dtype}), which has no order. "
            f"Fix: take {name} of a real value, e.g. of x.abs() or of x.real and x.imag apart."
        )
    check_reducible(ctx, t, name, name[1:])
    return params


def _extremum(name: str, op: str) -> Collective:
    return Collective(
        name=name,
        check=functools.partial(_ordered_operand, name=name),
        policy=DROP_INVARIANT,
        vma=without_axes,
        shape=same_shape,
        forward=lambda ctx, x, axes, params: ctx.all_reduce(x, axes, op),
        transpose=_extremum_transpose,
        jvp=_extremum_jvp,
        jvp_ops=("psum", "psum"),  # of the tie mask, and of the tangent's share
        backward_op=backward_op("psum"),  # of the tie mask
        saves=True,
        donates=True,
        tree=reduce_tree,  # (elementwise: its saved operand and result are the concatenation's)
        unreduced=None,  # not linear: the extremum of partial sums is not that of the totals
    )


PMAX = _extremum("pmax", "max")
PMIN = _extremum("pmin", "min")
