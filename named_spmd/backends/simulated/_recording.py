"""Accounting of implicit pvary on the simulated backend (only while a ``CommMode`` records).

Where an invariant operand meets a varying one, a real mesh casts it to varying (``pvary``:
identity forward, psum of its gradient backward; docs/design.md section 2, rule 2). The simulated
backend needs no such op (vmap already sums the gradient of an unbatched tensor), so this mode
only *reports* that psum: for each op of the per-device function it finds the operands that are
invariant over axes another operand varies over and tags each such (tensor, missing axes) once per
call with a backward marker, reusing the tagged alias for every later use. A replicated weight used
by ten ops is thus reported as one psum of its gradient, as the real backend runs it. The cache
is by tensor object: a tensor derived from an invariant one (``w.T``, ``w[0]``) is computed
invariantly and cast at its own mixing sites, so it costs its own psum (as in JAX); a single
``ns.pvary(w, axes)`` up front makes every derived use varying and costs one psum in all.

The mode is pushed only while recording, so the fast path pays nothing. It does not see the
backend's own collective implementations (they run with torch function modes off: their internal
ops mix the level tokens with stacked values, which is no user-level mixing) and while autograd runs a backward pass inside the call
(the per-instance transposes run by an inner ``torch.func.grad``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ..._accounting import CommEvent, memo_cast, needs_grad, on_backward
from ..._operands import NOT_OPS, is_inplace, swap_operands, tensor_operands
from ..._partial import value_operands
from ..._torch_private import current_graph_task_id


class ImplicitPvaryRecorder(TorchFunctionMode):
    """Tags each implicitly pvary'd (tensor, axes) of one call with its backward psum event."""

    def __init__(self, ctx: Any):
        super().__init__()
        self.ctx = ctx
        # (id(tensor), axes) -> its tagged alias (an entry of ``_accounting.memo_cast``)
        self.cache: dict[tuple[int, tuple[str, ...]], tuple] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func not in NOT_OPS and current_graph_task_id() == -1:
            operands = tensor_operands(args, kwargs)
            if len(operands) > 1:
                args, kwargs = self._tag(func, operands, args, kwargs)
        return func(*args, **(kwargs or {}))

    def _tag(self, func, operands, args, kwargs):
        vmas = [self.ctx.vma(t) for t in operands]
        operands, vmas = value_operands(func, args, kwargs, operands, vmas)  # x.view_as(y): x
        union = vmas[0]
        for v in vmas[1:]:
            union = union.union(v)
        swap: dict[int, torch.Tensor] = {}
        for t, v in zip(operands, vmas):
            if v is not union and id(t) not in swap and needs_grad(t):
                missing = v.missing(union.present(self.ctx.mesh.axis_names))
                if v.partial or union.partial:  # section 3: R -> V costs no psum, I -> R one
                    missing = _psum_axes(self.ctx.mesh.axis_names, v, union, missing)
                if missing:
                    swap[id(t)] = self._alias(t, missing)
        if not swap:
            return args, kwargs
        if is_inplace(func) and args and isinstance(args[0], torch.Tensor):
            swap.pop(id(args[0]), None)  # never redirect the tensor written in place
        return swap_operands(args, kwargs, swap)

    def _alias(self, t: torch.Tensor, missing: tuple[str, ...]) -> torch.Tensor:
        if self.ctx.single_axes.issuperset(missing):  # a group of one: no psum to report
            return t

        def tagged() -> torch.Tensor:
            event = CommEvent("psum", missing, "backward", tuple(t.shape), t.dtype, implicit=True)
            return on_backward(t, event)

        return memo_cast(self.cache, (id(t), missing), t, tagged)


def _psum_axes(names, v, union, missing) -> tuple[str, ...]:
    """The axes over which the implicit cast of an operand of type ``v`` in an op of type
    ``union`` sums the gradient: invariant -> varying and invariant -> reduced do, reduced ->
    varying does not (the gradient stays a partial sum)."""
    return tuple(
        a
        for a in names
        if (a in missing and a not in v.reduced)
        or (a in union.reduced and v.state(a) == "invariant")
    )
