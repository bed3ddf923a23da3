"""A collective of a pytree by one collective per group of leaves, where a backend asks for it.

Each collective of a real mesh is a round trip through its group (a few hundred microseconds on
gloo, more with more ranks), so ``pmean(grads, "dp")`` on a dict of 30 gradients, the data-parallel
step written as in JAX, would cost 30 of them, as would ``all_gather(params, "dp", tiled=True)``,
FSDP's gathering of the parameters (XLA combines such collectives; DDP buckets its all-reduces,
FSDP flattens its parameters). Here, for a record whose ``tree`` is a :class:`Packing` (psum,
pmean, pmax, pmin, all_gather, psum_scatter: an elementwise reduction, a gather or a scatter of
rows, whose application to a concatenation holds each leaf's), the tensor leaves of one call
that share a dtype, device, requires_grad and type are concatenated, the record applied once
outside autograd, and each leaf's result read back into a tensor of its own, with an autograd
node of its own whose backward is the record's transpose on that leaf (``_autodiff.ComputedFn``):
a result that gets no gradient gives its operand none, as leaf by leaf (a zero would reach the op
that made the operand, whose backward may communicate, or turn it into NaN). Values, types,
gradients and the ``CommMode`` events (one per leaf) are the per-leaf collectives': the sum of a
concatenation is the concatenation of the sums, element by element (on more than two ranks gloo's
ring may add an element's terms in another order: equal to rounding, as with DDP's buckets).

Only the common case fuses, the same on every rank (nothing here depends on a rank's own state):
every leaf a plain tensor varying over every axis of the collective, or, for a reduction or a
scatter, unreduced there (a partial sum, which it takes as varying: a ZeRO step's gradients; no
implicit cast, no group of one), no ``torch.func`` transform or forward-mode AD, and a
backend that gives a size bound (``SpmdContext.fused_below``: a leaf of at least that many bytes
is applied alone, where copies cost more than a round trip). Anything else takes the per-leaf
path, whole.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optree
import torch

from .._accounting import CommEvent, record
from .._accounting import _local as _modes
from .._autodiff import apply_computed
from .._context import Axes, SpmdContext
from .._layout import split_blocks, unstack_dim
from .._torch_private import DisableTorchFunction, forward_level, transforms_active
from .._types import Vma
from ._checks import check_copyable, torch_copies
from ._record import _apply, _fresh, _partial_operand, note_cast_result, tag_derivatives

Tensor = torch.Tensor
_PLAIN = (Tensor, torch.nn.Parameter)


class Packing:
    """How a record runs on a concatenation: how each operand is laid out in it
    (``pack(operand, parameters, n)``, the argument checks' parameters, n the group's size: a
    flat tensor, or ``[n, m]`` whose row j is member j's share, the leaves then side by side
    along the last dim) and how much of the result is its own (``share(operand, n)``, along
    ``dim``), the parameters of the one application, and how each leaf's result is arranged from
    its piece (``arrange(piece, operand, parameters)``)."""

    def __init__(
        self,
        flat_params: Callable[[tuple], tuple],
        dim: int,
        arrange: Callable,
        pack: Callable[[Tensor, tuple, int], Tensor] = lambda t, p, n: t.reshape(-1),
        share: Callable[[Tensor, int], int] = lambda t, n: t.numel(),
    ):
        self.flat_params, self.dim, self.arrange = flat_params, dim, arrange
        self.pack, self.share = pack, share

    def __call__(self, rec: Any, ctx: SpmdContext, x: Any, axes: Axes, params: tuple) -> Any:
        """``rec`` applied to every tensor leaf of the pytree ``x``, fused where the module doc
        says (a record's ``tree``); None where nothing fuses: ``Collective.bind`` then maps the
        per-leaf path over the tree."""
        limit = ctx.fused_below()
        if not limit or transforms_active() or forward_level() >= 0:
            return None
        leaves, treedef = optree.tree_flatten(x)
        with DisableTorchFunction():  # (reads of dtypes and sizes: no op of the program)
            groups = _groups(rec, ctx, leaves, axes, params, limit)
        if groups is None:
            return None
        out: list[Any] = [None] * len(leaves)
        for vma, members in groups:
            if vma is None or len(members) == 1:
                for i, p in members:
                    out[i] = _apply(rec, ctx, leaves[i], axes, p)
                continue
            ts, ps = [leaves[i] for i, _ in members], [p for _, p in members]
            for (i, _), o in zip(members, self._fused(rec, ctx, ts, vma, axes, ps)):
                out[i] = o
        return optree.tree_unflatten(treedef, out)

    def _fused(
        self, rec: Any, ctx: SpmdContext, ts: list[Tensor], vma: Vma, axes: Axes, ps: list
    ) -> list[Tensor]:
        """``rec`` on each of ``ts`` (one dtype, device, requires_grad and type ``vma``; ``ps``
        their parameters) by one application to their concatenation, outside autograd; each
        leaf's result then gets a node of its own, whose backward is ``rec``'s on that leaf
        (``_autodiff.ComputedFn``), and the rest of ``_record._apply``'s steps."""
        # packing and reading back are the collective's own ops, not the program's: untyped
        n = ctx.mesh.axis_size(axes)
        with torch.no_grad(), DisableTorchFunction():
            flat = torch.cat([self.pack(t, p, n) for t, p in zip(ts, ps)], -1)
            # (flat is this frame's alone: a backend may reduce it in place)
            done = ctx.apply(rec, flat, axes, self.flat_params(ps[0]), True)
            sizes = [self.share(t, n) for t in ts]
            # (torch's stub types the out= overload only; without out= it returns the pieces)
            pieces: list[Tensor] = torch.split_with_sizes_copy(  # type: ignore[func-returns-value,assignment]
                done, sizes, self.dim
            )
            outs = [self.arrange(piece, t, p) for piece, t, p in zip(pieces, ts, ps)]
        accounting = bool(_modes.stack)  # one event per leaf, as each leaf's collective records
        for i, (t, p) in enumerate(zip(ts, ps)):
            if t.requires_grad and torch.is_grad_enabled():
                with DisableTorchFunction():
                    outs[i] = apply_computed(t, rec, ctx, axes, p, [outs[i]])
                    if rec.saves:  # (a write into the result must leave the saved one)
                        outs[i] = _fresh(outs[i])
            if accounting:
                record(CommEvent(rec.name, axes, "forward", tuple(t.shape), t.dtype))
                outs[i] = tag_derivatives(rec, outs[i], t, axes, p, ctx=ctx)
            if ctx.stamps and rec.cast_result is not None:  # (nothing new varies: _groups)
                note_cast_result(rec, ctx, outs[i], vma, False, axes, p)
            outs[i] = ctx.stamp(outs[i], rec.vma(vma, axes, p))
        return outs


def _groups(
    rec: Any, ctx: SpmdContext, leaves: list, axes: Axes, params: tuple, limit: int
) -> list[tuple[Vma | None, list[tuple[int, tuple]]]] | None:
    """The leaves' positions and parameters by what they fuse by, in order of first appearance
    (type None: each alone), with each leaf's argument checks made (``_record._apply``'s, in
    tree order, before any communication); None where some leaf is not the common case or none
    fuses."""
    if len(leaves) < 2 or (ctx.single_axes and ctx.single_axes.issuperset(axes)):
        return None
    groups: dict[Any, tuple[Vma | None, list[tuple[int, tuple]]]] = {}
    for i, t in enumerate(leaves):
        if type(t) not in _PLAIN:
            return None
        vma = ctx.vma(t)
        if vma.partial:  # a partial sum reduced or scattered counts as varying, as leaf by leaf
            if rec.unreduced != "reduce":
                return None  # (the per-leaf path raises, or casts)
            vma = _partial_operand(rec, ctx, t, vma, axes)
        if not vma.varying.issuperset(axes):
            return None
        if not torch_copies(t.dtype):
            check_copyable(ctx, rec.name, t)
        p = ctx.check_operand(rec, t, axes, params)
        if 0 < t.numel() * t.element_size() < limit:
            key: Any = (t.dtype, t.device, t.requires_grad, vma)
            groups.setdefault(key, (vma, []))[1].append((i, p))
        else:
            groups[i] = (None, [(i, p)])
    if all(len(members) == 1 for _, members in groups.values()):
        return None
    return list(groups.values())


def _own(piece: Tensor, t: Tensor, params: tuple) -> Tensor:
    """An elementwise reduction's result for operand ``t``: its piece, in its shape."""
    return piece.view(t.shape)


def _gathered(piece: Tensor, t: Tensor, params: tuple) -> Tensor:
    """all_gather's result for operand ``t`` from its columns of the gather ([n, numel]: member
    j's first): the members' blocks arranged as its parameters (dim, tiled) say."""
    return unstack_dim(piece.view(piece.shape[0], *t.shape), params[0], params[1])


def _scattered_rows(t: Tensor, params: tuple, n: int) -> Tensor:
    """psum_scatter's operand ``t`` as ``[n, m]``: row j the block member j keeps (its dim
    ``params[0]`` split into n blocks, tiled, or of size n) with its dims in order."""
    dim, tiled = params[0], params[1]
    return split_blocks(t, dim, n, tiled).movedim(dim, 0).reshape(n, -1)


def _scattered(piece: Tensor, t: Tensor, params: tuple) -> Tensor:
    """psum_scatter's result for operand ``t``: its piece of the scattered row, in the shape of
    the block (:func:`_scattered_rows`' row with the block dim left out, or divided by n)."""
    dim, tiled = params[0], params[1]
    shape = list(t.shape)
    if tiled:
        shape[dim] = -1  # (the block's size along dim: no leaf of no elements is fused)
    else:
        del shape[dim]
    return piece.view(shape)


#: psum's, pmean's, pmax's and pmin's ``tree``: the reduction of the concatenation
reduce_tree = Packing(lambda p: p, 0, _own)
#: all_gather's ``tree``: one untiled gather along a new first dim, then each leaf's columns
gather_tree = Packing(lambda p: (0, False, *p[2:]), 1, _gathered)
#: psum_scatter's ``tree``: each leaf's blocks as rows, the rows side by side, scattered by row
scatter_tree = Packing(
    lambda p: (0, False), 0, _scattered, _scattered_rows, lambda t, n: t.numel() // n
)
