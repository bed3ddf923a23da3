"""Attention on the simulated mesh: one call of torch's kernel for every instance at once.

``scaled_dot_product_attention`` under the mesh's vmap levels has no good form in torch 2.13:
its fused kernels have no batching rule (vmap runs the CPU flash kernel once per instance, with
a warning; CUDA's memory-efficient backward raises) and its math form batches, at two to five
times one fused call's time on CPU. Attention is independent per batch and head, so
:func:`at_once` runs it on the tensors below the levels: each operand with the levels' dims in
front (a dim of size 1 where it is invariant), flattened into the batch dim, one sdpa (torch
picks the kernel, as it does on a real mesh), the result wrapped back at the levels an operand
varies over. Autograd sees ordinary ops, as on ``_levels``' fast path, and the kernel's own
backward: where torch's is not differentiated again (CPU flash), double backward through
attention raises torch's error, as it does outside the mesh and on a real one.

Where that does not apply it returns None and the call's marker runs the math form under vmap:
a transform or forward-mode AD in play (a grad inside the function needs per-instance
derivatives; flash has no forward-mode rule), a ``CommMode`` recording (its recorder reads
implicit pvarys off the levels), dropout, grouped heads, operands of other than 4 dims or a mask
of other than 2 or 4 (torch would pick another kernel, with other errors, per instance), or
operands whose batch dims differ or that do not fit.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.overrides import TorchFunctionMode

from ... import _torch_private as torch_private

Tensor = torch.Tensor
_SDPA = F.scaled_dot_product_attention


class AttentionMode(TorchFunctionMode):
    """Pushed by the call's marker around an attention op (``SpmdContext.attention``): runs it
    at once for every instance where :func:`at_once` applies, else in its math form."""

    def __init__(self, ctx: Any) -> None:
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is _SDPA:
            out = at_once(self.ctx, *args, **kwargs)
            if out is not None:
                return out
            with sdpa_kernel(SDPBackend.MATH):  # batches over the levels
                return func(*args, **kwargs)
        return func(*args, **kwargs)


def at_once(
    ctx: Any,
    q: Any,
    k: Any,
    v: Any,
    attn_mask: Any = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> Tensor | None:
    """sdpa of every instance in one call (module doc); None where it does not apply."""
    if dropout_p or enable_gqa or ctx.recorder is not None:
        return None
    if not (isinstance(q, Tensor) and isinstance(k, Tensor) and isinstance(v, Tensor)):
        return None
    d = q.dim()
    # torch picks the kernel by the operands' ranks: the per-instance call's pick (and its
    # errors, such as a mask beside ``is_causal``) is the flattened call's only for 4-d operands
    # and a mask of 2 or 4 dims
    if attn_mask is not None and not (isinstance(attn_mask, Tensor) and attn_mask.dim() in (2, 4)):
        return None
    if d != 4 or k.dim() != d or v.dim() != d or not q.shape[:-2] == k.shape[:-2] == v.shape[:-2]:
        return None
    if (
        q.shape[-1] != k.shape[-1]
        or k.shape[-2] != v.shape[-2]
        or not q.dtype == k.dtype == v.dtype
    ):
        return None  # an error: the math form raises it, told per instance as any op's
    if ctx.outer_level != 1 or torch_private.maybe_current_level() != ctx.inner_level:
        return None  # a transform below or above the levels
    if torch_private.forward_level() >= 0:
        return None
    operands = [q, k, v]
    if attn_mask is not None:
        mask = _mask(attn_mask, q, k)
        if mask is None:
            return None
        operands.append(mask)
    levels = sorted(ctx.level_axis)
    found = [_below(t, levels) for t in operands]
    below = [b for b in found if b is not None]
    if len(below) != len(operands):
        return None
    batched = [any(on[i] for _, on in below) for i in range(len(levels))]
    lead = [ctx.sizes[ctx.level_axis[lv]] if on else 1 for lv, on in zip(levels, batched)]
    n = len(levels)
    flat = [t.expand(*lead, *t.shape[n:]).flatten(0, n + d - 4) for t, _ in below]
    mf = flat[3] if len(flat) > 3 else None
    out = _SDPA(flat[0], flat[1], flat[2], attn_mask=mf, is_causal=is_causal, scale=scale)
    kept = [size for size, on in zip(lead, batched) if on]
    out = out.reshape(*kept, *q.shape[:-1], v.shape[-1])
    for lv, on in zip(levels, batched):  # outermost first: each takes the leading dim
        if on:
            out = torch_private.add_batch_dim(out, 0, lv)
    return out


def _mask(mask: Any, q: Tensor, k: Tensor) -> Tensor | None:
    """``mask`` expanded to the attention weights' shape ``[..., L, S]``; None where it does not
    broadcast to it or is of another dtype than a bool or ``q``'s (an error the math form tells)."""
    if not isinstance(mask, Tensor) or mask.dtype not in (torch.bool, q.dtype):
        return None
    full = (*q.shape[:-1], k.shape[-2])
    try:
        if torch.broadcast_shapes(mask.shape, full) != full:
            return None
    except RuntimeError:
        return None
    return mask.expand(full)


def _below(x: Tensor, levels: list[int]) -> tuple[Tensor, tuple[bool, ...]] | None:
    """``x``'s tensor below the levels with one leading dim per level, outermost first (the
    level's batch dim, or a dim of size 1 where ``x`` is invariant over it), and at which levels
    it is batched; None for a wrapper that is not one of the levels'."""
    at: dict[int, int] = {}  # level -> its dim in ``t``
    t = x
    while (lv := torch_private.maybe_get_level(t)) >= levels[0]:
        if lv not in levels or not torch_private.is_batchedtensor(t):
            return None
        bd = torch_private.maybe_get_bdim(t)
        t = torch_private.get_unwrapped(t)
        for other, dim in at.items():  # the unwrapped tensor has the level's dim at ``bd``
            if dim >= bd:
                at[other] = dim + 1
        at[lv] = bd
    ours = [lv for lv in levels if lv in at]
    t = t.movedim([at[lv] for lv in ours], list(range(len(ours))))
    for i, lv in enumerate(levels):
        if lv not in at:
            t = t.unsqueeze(i)
    return t, tuple(lv in at for lv in levels)
