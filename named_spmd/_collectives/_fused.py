"""A reduction of a pytree by one collective per group of leaves, where a backend asks for it.

Each collective of a real mesh is a round trip through its group (a few hundred microseconds on
gloo, more with more ranks), so ``pmean(grads, "dp")`` on a dict of 30 gradients, the data-parallel
step written as in JAX, would cost 30 of them (XLA combines such all-reduces; so does DDP's
bucketing). Here, for a record whose ``tree`` is :func:`reduce_tree` (one whose forward on a
concatenation is the concatenation of its forwards), the tensor leaves of one call that share a
dtype, device, requires_grad and type are concatenated, reduced by one application of the record
and split back into tensors of their own. Values, types, gradients and the ``CommMode`` events (one
per leaf) are the per-leaf collectives': the sum of a concatenation is the concatenation of the
sums, element by element (on more than two ranks gloo's ring may add an element's terms in another
order: equal to rounding, as with DDP's buckets).

Only the common case fuses, the same on every rank (nothing here depends on a rank's own state):
every leaf a plain tensor varying over every axis of the collective (no implicit cast, no
unreduced operand, no group of one), no ``torch.func`` transform or forward-mode AD, and a
backend that gives a size bound (``SpmdContext.fused_below``: a leaf of at least that many bytes
is reduced alone, where two copies cost more than a round trip). Anything else takes the per-leaf
path, whole.
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .._accounting import CommEvent, record
from .._accounting import _local as _modes
from .._context import Axes, SpmdContext
from .._torch_private import DisableTorchFunction, forward_level, transforms_active
from .._types import Vma
from ._checks import check_copyable, torch_copies
from ._record import _apply, tag_derivatives

Tensor = torch.Tensor
_PLAIN = (Tensor, torch.nn.Parameter)


def reduce_tree(rec: Any, ctx: SpmdContext, x: Any, axes: Axes, params: tuple) -> Any:
    """``rec`` applied to every tensor leaf of the pytree ``x``, fused where the module doc says
    (a record's ``tree``); None where nothing fuses: ``Collective.bind`` then maps the per-leaf
    path over the tree."""
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
        if len(members) == 1 or vma is None:
            for i in members:
                out[i] = _apply(rec, ctx, leaves[i], axes, params)
            continue
        results = _fused(rec, ctx, [leaves[i] for i in members], vma, axes, params)
        for i, o in zip(members, results):
            out[i] = o
    return optree.tree_unflatten(treedef, out)


def _groups(
    rec: Any, ctx: SpmdContext, leaves: list, axes: Axes, params: tuple, limit: int
) -> list[tuple[Vma | None, list[int]]] | None:
    """The leaves' positions by what they fuse by, in order of first appearance (type None:
    each alone), with each leaf's argument checks made (``_record._apply``'s, in tree order,
    before any communication); None where some leaf is not the common case or none fuses."""
    if len(leaves) < 2 or (ctx.single_axes and ctx.single_axes.issuperset(axes)):
        return None
    groups: dict[Any, tuple[Vma | None, list[int]]] = {}
    for i, t in enumerate(leaves):
        if type(t) not in _PLAIN:
            return None
        vma = ctx.vma(t)
        if vma.partial or not vma.varying.issuperset(axes):
            return None
        if not torch_copies(t.dtype):
            check_copyable(ctx, rec.name, t)
        ctx.check_operand(rec, t, axes, params)
        if t.numel() * t.element_size() < limit:
            key: Any = (t.dtype, t.device, t.requires_grad, vma)
            groups.setdefault(key, (vma, []))[1].append(i)
        else:
            groups[i] = (None, [i])
    if all(len(members) == 1 for _, members in groups.values()):
        return None
    return list(groups.values())


def _fused(
    rec: Any, ctx: SpmdContext, ts: list[Tensor], vma: Vma, axes: Axes, params: tuple
) -> list[Tensor]:
    """``rec`` on each of ``ts`` (one dtype, device, requires_grad and type ``vma``) by one
    application to their concatenation (the steps of ``_record._apply`` for such operands)."""
    # cat and split are the collective's own ops, not the program's: no mode types them
    with DisableTorchFunction():
        flat = torch.cat([t.reshape(-1) for t in ts])
    ctx.stamp(flat, vma)
    # (flat is this frame's alone: a backend may reduce it in place)
    reduced = ctx.apply(rec, flat, axes, params, True)
    with DisableTorchFunction():
        # (torch's stub types the out= overload only; without out= it returns the parts)
        parts: list[Tensor] = torch.split_with_sizes_copy(  # type: ignore[func-returns-value,assignment]
            reduced, [t.numel() for t in ts]
        )
        outs = [p.view(t.shape) for p, t in zip(parts, ts)]
    result = rec.vma(vma, axes, params)
    accounting = bool(_modes.stack)  # one event per leaf, as each leaf's collective records
    for i, t in enumerate(ts):
        if accounting:
            record(CommEvent(rec.name, axes, "forward", tuple(t.shape), t.dtype))
            outs[i] = tag_derivatives(rec, outs[i], t, axes, params)
        outs[i] = ctx.stamp(outs[i], result)
    return outs
