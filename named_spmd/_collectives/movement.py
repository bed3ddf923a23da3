"""Data movement over a group: all_gather, psum_scatter, all_to_all. One section each: the
public function, then its record (checks, policy, type and shape rules, forward on the
primitives, transpose)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .. import _torch_private as torch_private
from .._calls import current
from .._context import Axes, SpmdContext
from .._errors import CollectiveError
from .._layout import coords_text, split_blocks, unstack_dim
from .._types import Vma
from ._checks import Invariant, axis_sizes, axis_text, check_divisible, check_reducible, checked_dim
from ._fused import gather_tree, scatter_tree
from ._record import (
    PVARY,
    RECORDS,
    REQUIRE_VARYING,
    Collective,
    Params,
    backward_op,
    same_vma,
)

AxisName = str | tuple[str, ...]


# --- all_gather ----------------------------------------------------------------------------------


def all_gather(
    x: Any, axis_name: AxisName, *, axis: int = 0, tiled: bool = False, to: str = "varying"
) -> Any:
    """``all_gather(x: T{...}, A) -> T{A,...}``: every instance gets the group's blocks.

    Args:
        x: tensor or pytree of tensors.
        axis_name: axis or tuple of axes (blocks ordered row-major, first name major).
        axis: where the blocks go: a new dim of size n (``tiled=False``) or concatenated along
            existing dim ``axis`` (``tiled=True``).
        to: ``"varying"`` (JAX's default: the result keeps vma A), ``"invariant"`` (the result
            is known identical on the group: vma loses A, and backward needs no communication)
            or ``"reduced"`` (identical on the group, its gradient a partial sum: backward is a
            psum_scatter of that unreduced cotangent; docs/design.md section 3).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("i",))
        >>> g = ns.spmd_map(lambda x: ns.all_gather(x, "i", tiled=True, to="invariant"),
        ...                 mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())
        >>> g(torch.arange(4.0))
        tensor([0., 1., 2., 3.])

    Backward: psum_scatter over the same axes and dim (``to="varying"`` or ``"reduced"``); keep
    the own slice, no communication (``to="invariant"``).
    """
    return ALL_GATHER.bind(x, axis_name, axis, tiled, to)


def _all_gather_prepare(ctx: SpmdContext, axes: Axes, axis: int, tiled: bool, to: str) -> Params:
    if to not in ("varying", "invariant", "reduced"):
        raise CollectiveError(
            f"all_gather in {ctx.fn_label}: unknown to={to!r}. Fix: use to='varying' (the "
            "default, as in JAX), to='invariant' (JAX spells it 'invarying') or to='reduced'."
        )
    return (axis, bool(tiled), to)


def _all_gather_check(ctx: SpmdContext, t: torch.Tensor, axes: Axes, params: Params) -> Params:
    axis, tiled, to = params
    if tiled and t.dim() == 0:
        raise CollectiveError(
            f"all_gather in {ctx.fn_label}: tiled=True needs an operand of rank >= 1, got a "
            "scalar. Fix: gather x.reshape(1), or pass tiled=False to stack the scalars."
        )
    return (
        checked_dim(ctx, t, axis, "all_gather", "axis", extra=0 if tiled else 1),
        tiled,
        to,
    )


def _all_gather_forward(
    ctx: SpmdContext, x: torch.Tensor, axes: Axes, params: Params
) -> torch.Tensor:
    dim, tiled, to = params[0], params[1], params[2]
    # the members' blocks may differ in size along dim (params[3]: their sizes, where known)
    if tiled and (ctx.uneven or len(params) > 3):
        out = ctx.all_gather_tiled(x, axes, dim, *params[3:])
    else:
        out = unstack_dim(ctx.all_gather(x, axes), dim, tiled)
    return ctx.pvary(out, axes) if to == "varying" else out


def _all_gather_transpose(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    dim, tiled, to = params[0], params[1], params[2]
    if len(params) > 3:  # the members' block sizes, from a real mesh's uneven call
        return _uneven_all_gather_transpose(ctx, g, axes, params)
    if to == "invariant":  # the cotangent is identical on the group: keep the own block
        return ctx.own_block(split_blocks(g, dim, ctx.mesh.axis_size(axes), tiled), axes, dim)
    # varying, or reduced: the cotangent is unreduced and its scatter sums the partial sums
    return ctx.apply(RECORDS["psum_scatter"], g, axes, (dim, tiled))


def _uneven_all_gather_transpose(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params
) -> torch.Tensor:
    """The transpose of a tiled all_gather of blocks of the sizes ``params[3]``: a real mesh's
    uneven call appends them (``backends/_dist_uneven``), since the blocks are the operands'
    (``Blocks`` sizes, say), not the torch.chunk blocks a psum_scatter would cut."""
    dim, tiled, to, sizes = params
    if to == "invariant":
        return ctx.own_block_tiled(g, axes, dim, sizes)
    return ctx.apply(RECORDS["psum_scatter"], g, axes, (dim, tiled, sizes))


def _all_gather_vma(vma: Vma, axes: Axes, params: Params) -> Vma:
    to = params[2]
    if to == "varying":
        return vma
    return vma.to_state(axes, "invariant" if to == "invariant" else "reduced")


def _all_gather_shape(shape: tuple[int, ...], n: int, params: Params) -> tuple[int, ...]:
    dim, tiled, _ = params
    out = list(shape)
    if tiled:
        out[dim] *= n
    else:
        out.insert(dim, n)
    return tuple(out)


ALL_GATHER = Collective(
    name="all_gather",
    policy=PVARY,
    vma=_all_gather_vma,
    shape=_all_gather_shape,
    forward=_all_gather_forward,
    transpose=_all_gather_transpose,
    backward_op=lambda params: None if params[2] == "invariant" else "psum_scatter",
    makes_partial=True,  # to="reduced"
    prepare=_all_gather_prepare,
    check=_all_gather_check,
    batched=lambda params: (params[0] + 1, *params[1:]),
    tree=gather_tree,  # a pytree's leaves gathered together where a backend asks
    cast_result=lambda params: params[2] == "varying",
)


# --- psum_scatter --------------------------------------------------------------------------------


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
    return PSUM_SCATTER.bind(x, axis_name, scatter_dimension, tiled)


def _psum_scatter_check(ctx: SpmdContext, t: torch.Tensor, axes: Axes, params: Params) -> Params:
    dim, tiled = params
    n = ctx.mesh.axis_size(axes)
    check_reducible(ctx, t, "psum_scatter", "sum")
    d = checked_dim(ctx, t, dim, "psum_scatter", "scatter_dimension")
    if not (tiled and ctx.uneven):  # uneven: torch.chunk's blocks of a dim n does not divide
        check_divisible(ctx, t, d, n, axes, "psum_scatter", "scatter_dimension", tiled)
    return (d, bool(tiled))


def _psum_scatter_of_invariant(op: Invariant) -> str:
    dim, tiled = op.params
    scattered = f"ns.psum_scatter(ns.pvary(x, {axis_text(op.invariant)}), ...)"
    if len(op.invariant) == len(op.axes):  # x is the same on every member: its block is here
        blocks = f"x.unflatten({dim}, ({op.size}, -1))" if tiled else "x"
        index = f"ns.axis_index({axis_text(op.axes)}).reshape(1)"
        fix = (
            "if x is already the total, take this member's block without communication: "
            f"{blocks}.index_select({dim}, {index}).squeeze({dim})"
        )
    else:
        fix = (
            f"if x is already the total over {op.invariant}, scatter it as varying and divide: "
            f"{scattered} / ({axis_sizes(op.invariant)})"
        )
    return (
        f"psum_scatter over {op.axes} would add {op.copies} identical copies before scattering: "
        f"each member would get {op.copies} times its block. JAX does that silently; named_spmd "
        f"refuses. Fix: {fix}; or write {scattered} if you really mean {op.copies} times the "
        "block."
    )


def _psum_scatter_forward(
    ctx: SpmdContext, x: torch.Tensor, axes: Axes, params: Params
) -> torch.Tensor:
    dim, tiled = params[0], params[1]
    # (params[2:]: the blocks' sizes, see the all_gather transpose)
    if tiled and (ctx.uneven or len(params) > 2):
        return ctx.reduce_scatter_tiled(x, axes, dim, *params[2:])
    return ctx.reduce_scatter(split_blocks(x, dim, ctx.mesh.axis_size(axes), tiled), axes, dim)


def _psum_scatter_shape(shape: tuple[int, ...], n: int, params: Params) -> tuple[int, ...]:
    dim, tiled = params[0], params[1]
    out = list(shape)
    if tiled:
        out[dim] //= n
    else:
        del out[dim]
    return tuple(out)


PSUM_SCATTER = Collective(
    name="psum_scatter",
    policy=REQUIRE_VARYING,
    # varying over A; of an unreduced operand, the scatter of the total (U -> V; transpose:
    # all_gather to reduced, V -> R)
    vma=lambda vma, axes, params: vma.add(axes),
    unreduced="reduce",
    shape=_psum_scatter_shape,
    forward=_psum_scatter_forward,
    # (of an uneven call on a real mesh, params[2] is the blocks' sizes: the gather's too)
    transpose=lambda ctx, g, axes, params, node: ctx.apply(
        RECORDS["all_gather"], g, axes, (params[0], params[1], "varying", *params[2:])
    ),
    backward_op=backward_op("all_gather"),
    check=_psum_scatter_check,
    invariant_operand=_psum_scatter_of_invariant,
    batched=lambda params: (params[0] + 1, *params[1:]),
    tree=scatter_tree,  # a pytree's leaves scattered together where a backend asks
)


# --- all_to_all ----------------------------------------------------------------------------------


def all_to_all(
    x: Any,
    axis_name: AxisName,
    split_axis: int,
    concat_axis: int,
    *,
    tiled: bool = False,
    split_sizes: Sequence[int] | None = None,
) -> Any:
    """``all_to_all(x: T{A,...}, A, split, concat) -> T{A,...}``: chunk j goes to member j.

    ``split_axis`` is cut into n chunks; chunk j goes to member j, which concatenates the chunks
    it receives along ``concat_axis`` in source order. Untiled (JAX's convention): the split dim
    must have size n and is removed, and a new dim of size n appears at ``concat_axis``.

    ``split_sizes`` (tiled, ``split_axis == concat_axis``): this instance's chunk sizes, one
    per member (non-negative, adding up to the dim), as ``all_to_all_single``'s split sizes;
    member i receives chunk i of every member, so its result has their sizes along the dim.
    Sizes that differ between instances give blocks of different sizes: the per-instance
    simulation (``ns.simulate_per_instance()``), its ``.check()`` and a real mesh under it run
    them (each instance tells the others its sizes: one small all_to_all of n int64 more);
    under vmap and in an even call on a real mesh they must be equal (else an error;
    ``ns.ragged_all_to_all`` keeps every shape static).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("i",))
        >>> f = ns.spmd_map(lambda x: ns.all_to_all(x, "i", 0, 0, tiled=True),
        ...                 mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P("i"))
        >>> f(torch.arange(4.0))
        tensor([0., 2., 1., 3.])

    Backward: all_to_all with split and concat swapped (with split sizes: the sizes received).
    """
    if split_sizes is None:
        return ALL_TO_ALL.bind(x, axis_name, split_axis, concat_axis, tiled, None, None)
    ctx = current("all_to_all")
    axes = ctx.check_axes(axis_name, "all_to_all")
    sent = _split_sizes(ctx, axes, split_axis, concat_axis, tiled, split_sizes)
    received = _received_sizes(ctx, axes, sent, getattr(x, "device", None))
    return ALL_TO_ALL.bind(x, axis_name, split_axis, concat_axis, True, sent, received)


def _split_sizes(
    ctx: SpmdContext, axes: Axes, split: int, concat: int, tiled: bool, sizes: Any
) -> tuple[int, ...]:
    n = ctx.mesh.axis_size(axes)
    where = f"all_to_all in {ctx.fn_label}"
    if not tiled or split != concat:
        raise CollectiveError(
            f"{where}: split_sizes needs tiled=True and split_axis == concat_axis (got "
            f"tiled={tiled}, split_axis={split}, concat_axis={concat}): the chunks received "
            "from the members are concatenated along the dim they were cut from. Fix: pass "
            "tiled=True and one axis for both (move the dim with movedim around the call)."
        )
    ok = isinstance(sizes, (tuple, list)) and all(
        isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in sizes
    )
    if not ok or len(sizes) != n:
        raise CollectiveError(
            f"{where}: split_sizes must be {n} non-negative ints (one per member of {axes}), "
            f"got {sizes!r}. Fix: pass a list, e.g. counts.tolist() of a per-member count tensor."
        )
    out = tuple(sizes)
    if not ctx.own_values and len(set(out)) > 1:
        raise _unequal_sizes(where, out)
    return out


def _unequal_sizes(where: str, sizes: tuple[int, ...]) -> CollectiveError:
    return CollectiveError(
        f"{where}: split_sizes {list(sizes)} are not equal, so the members would receive "
        "blocks of different sizes, which this execution cannot hold (the vmap simulation "
        "and the check of a call it runs, an even call on a real mesh, or a traced call: one "
        "shape for every instance). Fix: run the call (and its .check()) under "
        "`with ns.simulate_per_instance():` (each instance on its own block, as on a real "
        "mesh), or keep the shapes static with ns.ragged_all_to_all (offsets and sizes as "
        "tensors, a buffer of fixed size)."
    )


def _received_sizes(
    ctx: SpmdContext, axes: Axes, sent: tuple[int, ...], device: torch.device | None
) -> tuple[int, ...]:
    """The sizes the members send to this one: their sizes, exchanged (a backend whose sizes
    may differ between members), else this one's own (all equal: the check above, or, in an
    even call on a real mesh, :func:`_one_size_in_the_group`).

    Host integers, no values of the program: exchanged on the operand's device, on the CPU
    where it is meta (a check of a call run per instance: the sizes are known there, and its
    meetings exchange them as the call's do), out of sight of the program's modes (which would
    move them to meta)."""
    if not ctx.own_values:
        return sent
    if not ctx.uneven and not ctx.caller_blocks:
        _one_size_in_the_group(ctx, axes, sent)
        return sent
    if device is not None and device.type == "meta":
        device = torch.device("cpu")
    with torch_private.DisableTorchFunction():
        counts = torch.tensor(sent, dtype=torch.int64, device=device)
        return tuple(ALL_TO_ALL.bind(counts, axes, 0, 0, True, None, None).tolist())


def _one_size_in_the_group(ctx: SpmdContext, axes: Axes, sent: tuple[int, ...]) -> None:
    """An even call on a real mesh holds blocks of one shape on every instance, as vmap does:
    its split sizes must be one size, on every member. Each rank knows its own sizes only, so
    the members of the collective's group (the ranks that call it: a branch on another axis
    may leave other groups out) exchange theirs (a few integers, bookkeeping that ``CommMode``
    does not count: the vmap execution exchanges none), and every member raises the same
    error, the simulated mesh's for the first member whose sizes are unequal (a rank raising
    alone would leave the others waiting inside the collective)."""
    every = ctx.every_member(axes, sent)
    where = f"all_to_all in {ctx.fn_label}"
    unequal = next((s for _, s in every if len(set(s)) > 1), None)
    if unequal is not None:
        raise _raised_by_the_group(ctx, axes, _unequal_sizes(where, unequal))
    (first, sizes), *others = every
    other = next(((at, s) for at, s in others if s != sizes), None)
    if other is not None:  # (their operands differ in shape: no vmap execution has them)
        raise _raised_by_the_group(
            ctx,
            axes,
            CollectiveError(
                f"{where}: the instances' split_sizes differ (the instance at "
                f"{coords_text(first)} gives {list(sizes)}, the one at {coords_text(other[0])} "
                f"{list(other[1])}), so their operands and the blocks they receive differ in "
                "size, which an even call on a real mesh cannot hold (one shape for every "
                "instance, as in the vmap simulation). Fix: run the call under "
                "`with ns.simulate_per_instance():` (each instance on its own block)."
            ),
        )


def _raised_by_the_group(ctx: SpmdContext, axes: Axes, error: CollectiveError) -> BaseException:
    """``error``, which every member of the group of ``axes`` raises: marked as raised alike
    (``SpmdContext.alike``) where the group is the whole mesh; else the failure board must tell
    the ranks outside the group, which would wait for its members in a later collective."""
    return ctx.alike(error) if ctx.mesh.axis_size(axes) == ctx.mesh.size else error


def _all_to_all_check(ctx: SpmdContext, t: torch.Tensor, axes: Axes, params: Params) -> Params:
    split_axis, concat_axis, tiled, sent, received = params
    n = ctx.mesh.axis_size(axes)
    s = checked_dim(ctx, t, split_axis, "all_to_all", "split_axis")
    c = checked_dim(ctx, t, concat_axis, "all_to_all", "concat_axis")
    if sent is None:
        check_divisible(ctx, t, s, n, axes, "all_to_all", "split_axis", tiled)
    elif sum(sent) != t.shape[s]:
        raise CollectiveError(
            f"all_to_all in {ctx.fn_label}: split_sizes {list(sent)} add up to {sum(sent)}, but "
            f"the operand's dim {s} has size {t.shape[s]} (shape {tuple(t.shape)}). Fix: give "
            "sizes that add up to the dim."
        )
    return (s, c, bool(tiled), sent, received)


def _all_to_all_forward(
    ctx: SpmdContext, x: torch.Tensor, axes: Axes, params: Params
) -> torch.Tensor:
    split, concat, tiled, sent, received = params
    if sent is not None:
        return ctx.all_to_all_sizes(x, axes, split, sent, received)
    # after the exchange, dim ``split`` indexes the source member instead of the destination
    received = ctx.all_to_all(split_blocks(x, split, ctx.mesh.axis_size(axes), tiled), axes, split)
    if split != concat:
        received = received.movedim(split, concat)
    return received.flatten(concat, concat + 1) if tiled else received


def _all_to_all_shape(shape: tuple[int, ...], n: int, params: Params) -> tuple[int, ...]:
    split, concat, tiled, _, received = params
    out = list(shape)
    if received is not None:
        out[split] = sum(received)
    elif tiled:
        out[split] //= n
        out[concat] *= n
    else:  # the split dim (of size n) moves to concat
        out.insert(concat, out.pop(split))
    return tuple(out)


ALL_TO_ALL = Collective(
    name="all_to_all",
    policy=PVARY,
    vma=same_vma,
    shape=_all_to_all_shape,
    forward=_all_to_all_forward,
    transpose=lambda ctx, g, axes, params, node: ctx.apply(
        RECORDS["all_to_all"], g, axes, (params[1], params[0], params[2], params[4], params[3])
    ),
    backward_op=backward_op("all_to_all"),
    check=_all_to_all_check,
    batched=lambda params: (params[0] + 1, params[1] + 1, *params[2:]),
)

__all__ = ["all_gather", "all_to_all", "psum_scatter"]
