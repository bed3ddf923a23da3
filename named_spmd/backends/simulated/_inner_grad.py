"""Implicit pvary under a torch.func.grad / vjp *inside* the per-device function.

Where an invariant operand meets a varying one, a real mesh casts it (``pvary``: identity
forward, psum of its gradient backward; docs/design.md section 2, rule 2). The simulated mesh
normally needs no op there: an unbatched tensor used at a batched level gets its gradient summed
over the level by vmap itself, for autograd *outside* the call. A grad level entered *inside* the
call sits above the vmap levels, though: its backward runs per instance and leaves this
instance's contribution, batched, in the cotangent of an unbatched value. The psum must then come
from the cast itself, at the grad level.

So while a grad level is open inside a simulated call (``_torch_private.hook_grad_levels`` tells
when), :class:`InnerGradMode` casts every differentiable invariant operand that meets varying ones
with the real ``implicit_pvary`` (at the grad level its backward is the psum: ``_lowered``), once
per (tensor, axes) for the outermost such grad. A call without a grad inside pushes no mode and
pays nothing. Forward mode (``torch.func.jvp``, jacfwd) needs no cast: the tangent of a pvary is
the pvary of the tangent, which vmap's broadcasting gives.

Unreduced and reduced operands are left to the partial-sum algebra (``PartialMode``), as outside
a grad: their casts do not sum gradients the same way (section 3).
"""

from __future__ import annotations

import threading
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ... import _calls
from ... import _torch_private as torch_private
from ..._accounting import memo_cast, needs_grad
from ..._collectives._record import implicit_pvary
from ..._operands import NOT_OPS, is_inplace, swap_operands, tensor_operands
from ._primitives import SimulatedContext


class InnerGradMode(TorchFunctionMode):
    """Casts invariant operands that meet varying ones, inside a grad level of a simulated call."""

    def __init__(self, ctx: Any):
        super().__init__()
        self.ctx = ctx
        # (id(tensor), axes) -> its varying alias (an entry of ``_accounting.memo_cast``)
        self.cache: dict[tuple[int, tuple[str, ...]], tuple] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if (
            func not in NOT_OPS and torch_private.current_graph_task_id() == -1
        ):  # not a backward formula
            operands = tensor_operands(args, kwargs)
            if len(operands) > 1:
                args, kwargs = self._cast(func, operands, args, kwargs)
        return func(*args, **(kwargs or {}))

    def _cast(self, func, operands, args, kwargs):
        vmas = [self.ctx.vma(t) for t in operands]
        union = vmas[0]
        for v in vmas[1:]:
            union = union.union(v)
        if union.partial:
            return args, kwargs
        names = self.ctx.mesh.axis_names
        swap: dict[int, torch.Tensor] = {}
        for t, v in zip(operands, vmas):
            if v is not union and id(t) not in swap and needs_grad(t):
                missing = v.missing(union.present(names))
                if missing:
                    swap[id(t)] = self._alias(t, missing)
        if is_inplace(func) and args and isinstance(args[0], torch.Tensor):
            swap.pop(id(args[0]), None)  # never redirect the tensor written in place
        return swap_operands(args, kwargs, swap) if swap else (args, kwargs)

    def _alias(self, t: torch.Tensor, missing: tuple[str, ...]) -> torch.Tensor:
        return memo_cast(self.cache, (id(t), missing), t, implicit_pvary, self.ctx, t, missing)


def typed_gradients(inputs: tuple, grads: tuple) -> tuple:
    """The gradients torch.func.grad / vjp computed inside a simulated call, each made varying
    over the axes its input varies over (``pvary``, whose transpose a derivative of the gradient
    needs). A cotangent has its primal's type, as in JAX and on a real mesh
    (``_tracking.VmaMode._gradients``); read off the levels, the gradient of a varying input
    whose value is the same on every instance (the transpose of a psum) was typed invariant."""
    ctx = _calls.active()
    if not isinstance(ctx, SimulatedContext):
        return grads
    names = ctx.mesh.axis_names
    typed = []
    for x, g in zip(inputs, grads):
        if isinstance(g, torch.Tensor):
            # vjp's pullback runs after its grad level was left: its inputs are dead wrappers
            g = torch_private.unwrap_if_dead(g)
            want, have = ctx.vma(torch_private.unwrap_if_dead(x)), ctx.vma(g)
            if not (want.partial or have.partial):
                missing = have.missing(want.present(names))
                if missing:
                    g = implicit_pvary(ctx, g, missing, record=False)
        typed.append(g)
    return tuple(typed)


class _Open(threading.local):
    def __init__(self) -> None:
        self.modes: list[tuple[int, InnerGradMode]] = []  # (grad level, its mode), innermost last


_open = _Open()


def entered(level: int) -> None:
    """A grad level was entered: inside a simulated call with no mode on yet, push one."""
    ctx = _calls.active()
    if not isinstance(ctx, SimulatedContext) or level <= ctx.inner_level:
        return
    if any(mode.ctx is ctx for _, mode in _open.modes):  # a grad inside a grad: one mode
        return
    mode = InnerGradMode(ctx)
    torch_private.push_function_mode(mode)
    _open.modes.append((level, mode))


def leaving(level: int | None) -> None:
    """A grad level is being left: remove the mode pushed when it was entered, wherever it sits
    on the mode stack (a mode pushed inside the grad and still on, e.g. ``PartialMode``, stays)."""
    modes = _open.modes
    if not modes or modes[-1][0] != level:
        return
    _, mode = modes.pop()
    torch_private.remove_function_mode(lambda m: m is mode)
