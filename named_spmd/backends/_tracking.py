"""Per-tensor vma tracking for backends that run one instance per process (or none at all).

The simulated backend reads vma off its vmap levels. The distributed and abstract backends run the
per-device function once, on local tensors, so they stamp every tensor with its vma instead:
inputs from their in_specs, collectives' outputs by their rule (``SpmdContext.stamp``), and every
other torch op by :class:`VmaMode`: the union of its operands' vma (DESIGN.md section 2, rule 2).
Where an invariant operand meets a varying one, the mode inserts the implicit pvary once per
(tensor, axes) for the call, so a replicated weight used by ten ops costs one gradient psum.

A stamp is ``(call token, frozenset)`` kept in the tensor's ``__dict__``: a tensor that carries a
stamp from another call (or none) is invariant here, like any closed-over tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._context import SpmdContext

_EMPTY: frozenset[str] = frozenset()
_ATTR = "_named_spmd_vma"


class TrackedContext(SpmdContext):
    """A call whose tensors carry their vma as a stamp. Subclasses implement the collectives."""

    def __init__(self, mesh, fn):
        super().__init__(mesh, fn)
        self.call_token = object()
        # (id(tensor), axes) -> (tensor, its varying alias); the tensor is kept alive so that
        # its id is not reused during the call.
        self.pvary_cache: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, torch.Tensor]] = {}

    def vma(self, x: torch.Tensor) -> frozenset[str]:
        stamp = x.__dict__.get(_ATTR)
        return stamp[1] if stamp is not None and stamp[0] is self.call_token else _EMPTY

    def stamp(self, x: torch.Tensor, vma) -> torch.Tensor:
        if vma or _ATTR in x.__dict__:
            x.__dict__[_ATTR] = (self.call_token, frozenset(vma))
        return x

    def cached_pvary(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """The implicit pvary of ``t`` over ``axes``: one alias per (tensor, axes) per call."""
        from .._collectives import implicit_pvary

        key = (id(t), axes)
        hit = self.pvary_cache.get(key)
        if hit is None:
            hit = self.pvary_cache[key] = (t, implicit_pvary(self, t, axes))
        return hit[1]


def _operand_vmas(ctx: TrackedContext, args, kwargs, found: list) -> None:
    for a in args:
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    found.append(b)
    if kwargs:
        for a in kwargs.values():
            if isinstance(a, torch.Tensor):
                found.append(a)


def _replace(obj: Any, swap: dict[int, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        return swap.get(id(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(o, swap) for o in obj)
    return obj


class VmaMode(TorchFunctionMode):
    """Stamps every op's outputs with the union of its operands' vma; inserts implicit pvary."""

    def __init__(self, ctx: TrackedContext, *, insert_pvary: bool = True):
        super().__init__()
        self.ctx = ctx
        self.insert_pvary = insert_pvary

    def __torch_function__(self, func, types, args=(), kwargs=None):
        operands: list[torch.Tensor] = []
        _operand_vmas(self.ctx, args, kwargs, operands)
        if not operands:
            return func(*args, **(kwargs or {}))
        vma_of = self.ctx.vma
        vmas = [vma_of(t) for t in operands]
        union = vmas[0].union(*vmas[1:]) if len(vmas) > 1 else vmas[0]
        if not union:
            return func(*args, **(kwargs or {}))
        if self.insert_pvary and len(vmas) > 1 and any(v != union for v in vmas):
            args, kwargs = self._vary_operands(operands, vmas, union, args, kwargs)
        out = func(*args, **(kwargs or {}))
        return self._stamp_outputs(out, union)

    def _vary_operands(self, operands, vmas, union, args, kwargs):
        swap = {}
        for t, v in zip(operands, vmas):
            if v != union and id(t) not in swap:
                missing = tuple(a for a in self.ctx.mesh.axis_names if a in union and a not in v)
                swap[id(t)] = self.ctx.cached_pvary(t, missing)
        args = _replace(args, swap)
        if kwargs:
            kwargs = {k: _replace(v, swap) for k, v in kwargs.items()}
        return args, kwargs

    def _stamp_outputs(self, out, union):
        if isinstance(out, torch.Tensor):
            self.ctx.stamp(out, union)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, torch.Tensor):
                    self.ctx.stamp(o, union)
        return out
