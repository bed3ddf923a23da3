"""Unreduced and reduced values on the simulated backend (docs/design.md section 2.2).

The vmap levels tell varying (batched) from invariant (unbatched), and nothing else: an
unreduced value is batched like a varying one, a reduced value unbatched like an invariant one.
So such values carry a *mark*, ``(call token, Vma)`` in the tensor's ``__dict__`` (as the
tracked backends' stamps), and :class:`PartialMode` types every op of the call by the partial-sum
algebra (``_partial.combine``) once the first marked value exists: a call without unreduced or
reduced values pushes no mode and pays nothing. Values need nothing else: vmap computes them, and
autograd through the levels sums the gradient of an unbatched (reduced) input as the real
backend's unreduced gradient sums to.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ... import _blocks
from ..._operands import METADATA, NOT_OPS, tensor_operands
from ..._partial import typed_call
from ..._types import Vma

ATTR = "_named_spmd_partial"
_BLOCKS = _blocks.ATTR
UNTYPED = NOT_OPS | METADATA  # run as they are: no value computed, or no tensor result


def mark_of(x: torch.Tensor, token: object) -> Vma | None:
    """``x``'s mark in the call of ``token``, or None."""
    m = x.__dict__.get(ATTR)
    return m[1] if m is not None and m[0] is token else None


def set_mark(x: torch.Tensor, token: object, vma: Vma) -> None:
    if vma.partial:
        x.__dict__[ATTR] = (token, vma)
    elif ATTR in x.__dict__:
        del x.__dict__[ATTR]


def _first_tensor(out: Any) -> torch.Tensor:
    return (
        out
        if isinstance(out, torch.Tensor)
        else next(o for o in out if isinstance(o, torch.Tensor))
    )


class PartialMode(TorchFunctionMode):
    """Types the ops of a call in which unreduced or reduced values exist, or inputs holding
    blocks of mesh axes (whose contractions make unreduced values: ``_blocks``)."""

    def __init__(self, ctx: Any):
        super().__init__()
        self.ctx = ctx

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return self.typed(func, args, kwargs or {})[0]

    def typed(self, func: Any, args: tuple, kwargs: dict) -> tuple[Any, Vma | None, bool]:
        """``func``'s result; the type marked on its tensors (None: their marks were left as
        they were); whether an operand held blocks (the results' block records were then
        written or dropped by ``_blocks.after_op``). A plan (``_planned``) keeps the last two."""
        if func in UNTYPED:
            return func(*args, **kwargs), None, False
        operands = tensor_operands(args, kwargs)
        token = self.ctx.token
        marked = blocked = False
        for t in operands:
            d = t.__dict__
            m = d.get(ATTR)
            if m is not None and m[0] is token:
                marked = True
            m = d.get(_BLOCKS)
            if m is not None and m[0] is token:
                blocked = True
        if not marked and not blocked:
            return func(*args, **kwargs), None, False
        vma = None
        if marked:
            vmas = [self.ctx.vma(t) for t in operands]
            out, vma = typed_call(self.ctx, func, args, kwargs, operands, vmas)
        else:
            out = func(*args, **kwargs)
        if blocked:
            axes = _blocks.after_op(
                self.ctx, token, func, args, kwargs, operands, out, self.ctx.vma
            )
            if axes:
                vma = _blocks.unreduced_over(vma or self.ctx.vma(_first_tensor(out)), axes)
                self.ctx.forget_last_vma()  # the result's type changes below
        if vma is not None:
            for o in out if isinstance(out, (list, tuple)) else (out,):
                if isinstance(o, torch.Tensor):
                    set_mark(o, token, vma)
        return out, vma, blocked
