"""Accounting of implicit pvary on the simulated backend (only while a ``CommMode`` records).

Where an invariant operand meets a varying one, a real mesh casts it to varying (``pvary``:
identity forward, psum of its gradient backward; DESIGN.md section 2, rule 2). The simulated
backend needs no such op (vmap already sums the gradient of an unbatched tensor), so this mode
only *reports* that psum: for each op of the per-device function it finds the operands that are
invariant over axes another operand varies over and tags each such (tensor, missing axes) once per
call with a backward marker, reusing the tagged alias for every later use. A replicated weight used
by ten ops is thus reported as one psum of its gradient, as the real backend runs it. The cache
is by tensor object: a tensor derived from an invariant one (``w.T``, ``w[0]``) is computed
invariantly and cast at its own mixing sites, so it costs its own psum (as in JAX); a single
``ns.pvary(w, axes)`` up front makes every derived use varying and costs one psum in all.

The mode is pushed only while recording, so the fast path pays nothing. It is paused inside the
backend's own collective implementations (their internal ops mix the level tokens with stacked
values, which is no user-level mixing) and while autograd runs a backward pass inside the call
(the per-instance transposes run by an inner ``torch.func.grad``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .._accounting import CommEvent, needs_grad, on_backward
from ._tracking import swap_operands, tensor_operands

# Context methods that only read state: no need to pause the mode around them.
_NOT_WRAPPED = frozenset({"vma", "check_axes"})
# Functions that route through __torch_function__ but compute nothing from their operands.
_NOT_OPS = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})


def _in_place(func: Any) -> bool:
    name = getattr(func, "__name__", "")
    return name.startswith("__i") or (name.endswith("_") and not name.endswith("__"))


class ImplicitPvaryRecorder(TorchFunctionMode):
    """Tags each implicitly pvary'd (tensor, axes) of one call with its backward psum event."""

    def __init__(self, ctx: Any):
        super().__init__()
        self.ctx = ctx
        self.paused = 0
        # (id(tensor), axes) -> (tensor, tagged alias); the tensor is kept alive so that its id
        # is not reused during the call.
        self.cache: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.paused and func not in _NOT_OPS and torch._C._current_graph_task_id() == -1:
            operands = tensor_operands(args, kwargs)
            if len(operands) > 1:
                args, kwargs = self._tag(func, operands, args, kwargs)
        return func(*args, **(kwargs or {}))

    def _tag(self, func, operands, args, kwargs):
        vmas = [self.ctx.vma(t) for t in operands]
        union = frozenset().union(*vmas)
        swap: dict[int, torch.Tensor] = {}
        for t, v in zip(operands, vmas):
            if v != union and id(t) not in swap and needs_grad(t):
                missing = tuple(a for a in self.ctx.mesh.axis_names if a in union and a not in v)
                swap[id(t)] = self._alias(t, missing)
        if not swap:
            return args, kwargs
        if _in_place(func) and args and isinstance(args[0], torch.Tensor):
            swap.pop(id(args[0]), None)  # never redirect the tensor written in place
        args, kwargs = swap_operands(args, kwargs, swap)
        return args, kwargs

    def _alias(self, t: torch.Tensor, missing: tuple[str, ...]) -> torch.Tensor:
        key = (id(t), missing)
        hit = self.cache.get(key)
        if hit is None:
            event = CommEvent("psum", missing, "backward", tuple(t.shape), t.dtype, implicit=True)
            hit = self.cache[key] = (t, on_backward(t, event))
        return hit[1]

    def pausing(self, method: Callable) -> Callable:
        def paused(*args, **kwargs):
            self.paused += 1
            try:
                return method(*args, **kwargs)
            finally:
                self.paused -= 1

        return paused


def run_recording(ctx: Any, body: Callable, local: list) -> Any:
    """Run ``body(local, ctx)`` with implicit pvary accounting (the caller checks recording())."""
    mode = ImplicitPvaryRecorder(ctx)
    for name in dir(type(ctx)):
        attr = getattr(ctx, name)
        if not name.startswith("__") and name not in _NOT_WRAPPED and callable(attr):
            # An instance attribute shadows the method for this call only.
            setattr(ctx, name, mode.pausing(attr))
    with mode:
        return body(local, ctx)
