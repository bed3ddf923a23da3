"""The one autograd bridge: any collective, differentiated by its declared transpose.

Backends whose primitives are plain communication (the distributed and abstract backends) run a
collective through :class:`CollectiveFn` whenever something is differentiated: its forward is
the record's forward on the primitives, its backward the record's ``transpose`` and its
forward-mode rule the record's ``jvp``. Transposes are written with other records and applied
through the same bridge, so double backward and ``torch.func`` transforms compose (DTensor's
``Redistribute`` is the model: one Function for every transition).

Two costs measured on the real backend are avoided: ``Function.apply`` binds its arguments in
Python (~10 us) when ``setup_context`` is defined, so with no torch.func transform active the C
``apply`` is called directly; and with nothing to differentiate the Function is skipped.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from ._torch_private import (
    TransformType,
    current_interpreter,
    dispatch_modes_active,
    forward_level,
    function_base_apply,
    functional_unwrap,
    functional_wrap,
    tensor_base,
    transforms_active,
)

if TYPE_CHECKING:
    from ._collectives._record import Collective
    from ._context import Axes, SpmdContext


def differentiable(x: torch.Tensor) -> bool:
    """Whether an op on ``x`` must record autograd (or forward-mode) information."""
    return (
        transforms_active() or (x.requires_grad and torch.is_grad_enabled()) or forward_level() >= 0
    )


def differentiating() -> bool:
    """Whether :func:`differentiable` may hold of any tensor now (grad mode, a torch.func
    transform, forward-mode AD): read once before a loop over many tensors (a backward pass
    that is not differentiated has none)."""
    return torch.is_grad_enabled() or transforms_active() or forward_level() >= 0


def unshared(g: torch.Tensor) -> torch.Tensor:
    """``g``, or a copy of it where an earlier call already returned ``g``: the gradient that
    a backward of the package hands on to an input as a fresh wrapper or view of ``g``.

    Autograd hands one tensor to several consumers (both operands of ``a + b`` get the
    cotangent itself). ``AccumulateGrad`` stores a gradient that nothing else holds as the
    leaf's ``.grad`` without copying it; a fresh DTensor or view around ``g`` is held by
    nothing else (torch's count of ``g``'s own uses misses a DTensor holding it, and views:
    pytorch/pytorch#34082). Two parameters would get ``.grad`` on one storage, and an in-place
    update of one (clipping, weight decay, accumulation) would change the other. The mark
    goes on ``g`` itself: no registry to clear, and it dies with ``g``."""
    held = g.__dict__
    if _HANDED_ON in held:
        return g.clone()  # (a pending gradient's waits for its sum: a plain tensor)
    held[_HANDED_ON] = True
    return g


_HANDED_ON = "_named_spmd_handed_on"


def _own_memory(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``out``, a collective's result; where it is a view of a buffer the collective made (a
    real mesh's receive buffer, reshaped), a tensor of its own over that memory: autograd
    refuses a write into a custom Function's view output, which a plain op's result (and the
    simulated mesh's) takes. A view of ``x``'s memory (a pvary's) stays one."""
    if torch.compiler.is_compiling():  # (a graph places its buffers; Dynamo reads no view base)
        return out
    base = tensor_base(out)
    if base is None or base is x or base is tensor_base(x) or type(out) is not torch.Tensor:
        return out
    if dispatch_modes_active():  # (a tracer's tensors: a traced graph places its buffers)
        return out
    own = torch.empty((0,), dtype=out.dtype, device=out.device)
    return own.set_(out.untyped_storage(), out.storage_offset(), out.size(), out.stride())


class CollectiveFn(torch.autograd.Function):
    """``rec`` applied to ``x`` on ``spmd`` (a backend context); backward: ``rec.transpose``
    (through ``rec.backward``), forward mode: ``rec.jvp`` (through ``rec.tangent``). A call
    that Dynamo traces applies it as :class:`TracedCollectiveFn`."""

    @staticmethod
    def forward(x, rec, spmd, axes, params):
        return _own_memory(spmd.forward(rec, x, axes, params), x)

    @staticmethod
    def setup_context(node, inputs, output):
        x, node.rec, node.spmd, node.axes, node.params = inputs
        # recorded under a torch.func transform: a pending (overlapped) gradient psum's wrapper
        # would lose its Python subclass on its way through functorch and reach the next
        # backward as a plain tensor without storage (see _pvary_transpose)
        node.in_transform = transforms_active()
        if node.rec.saves:
            node.save_for_backward(x, output)
            node.save_for_forward(x, output)

    @staticmethod
    def backward(node, g):
        return node.rec.backward(node.spmd, g, node.axes, node.params, node), *_NONES

    @staticmethod
    def jvp(node, t, *_):
        return node.rec.tangent(node.spmd, t, node.axes, node.params, node)

    @staticmethod
    def vmap(info, in_dims, x, rec, spmd, axes, params):
        """A user's ``torch.func.vmap`` inside the per-device function: the collective runs
        once on the whole batch, the batch dim first and the record's dims shifted past it."""
        if in_dims[0] is None:
            return apply(rec, spmd, x, axes, params), None
        return apply(rec, spmd, x.movedim(in_dims[0], 0), axes, rec.batched(params)), 0


class TracedCollectiveFn(CollectiveFn):
    """The bridge in a call that Dynamo traces: without the forward-mode and vmap rules, as
    Dynamo traces only a Function whose ``jvp`` is torch's own (a custom one is "Unsupported
    custom jvp"), so forward-mode AD and vmap of a compiled call are not traced."""

    jvp = staticmethod(torch.autograd.Function.jvp)
    vmap = staticmethod(torch.autograd.Function.vmap)

    @staticmethod
    def backward(node, g):
        # the transpose alone: a compiled graph's backward is not differentiated again
        # (AOTAutograd refuses double backward), so neither the pvary nor the checked context
        # of ``Collective.backward`` is needed
        return node.rec.transpose(node.spmd, g, node.axes, node.params, node), *_NONES

    @staticmethod
    def setup_context(node, inputs, output):
        # (no save_for_forward: Dynamo has none, and torch's own jvp reads nothing saved)
        x, node.rec, node.spmd, node.axes, node.params = inputs
        node.in_transform = transforms_active()  # (as CollectiveFn's)
        if node.rec.saves:
            node.save_for_backward(x, output)


class ComputedFn(torch.autograd.Function):
    """The bridge's node for a result computed elsewhere, ``made[0]``: one leaf's piece of a
    collective applied once to the concatenation of several operands (``_collectives/
    _fused.py``). Its saving and backward are ``rec``'s on ``x`` alone, so the leaves keep
    nodes of their own, as leaf by leaf: an operand whose result gets no gradient gets none."""

    @staticmethod
    def forward(x, rec, spmd, axes, params, made):
        return _own_memory(made[0], x)

    @staticmethod
    def setup_context(node, inputs, output):
        CollectiveFn.setup_context(node, inputs[:5], output)

    @staticmethod
    def backward(node, g):
        return *CollectiveFn.backward(node, g), None


_NONES = (None,) * 4
fast_apply = function_base_apply.__get__(None, CollectiveFn)
apply_computed = function_base_apply.__get__(None, ComputedFn)


def apply(rec: Collective, spmd: SpmdContext, x: torch.Tensor, axes: Axes, params: Any):
    """``rec`` on ``x`` through the bridge (the caller checked :func:`differentiable`)."""
    if rec.plain_view:  # autograd's own view on every backend: a write reaches x, as simulated
        return rec.forward(spmd, x, axes, params)
    if torch.compiler.is_compiling():
        return TracedCollectiveFn.apply(x, rec, spmd, axes, params)
    if transforms_active():  # functorch needs the full Python path (it wraps the Function)
        if current_interpreter().key() == _FUNCTIONALIZE:
            return below_functionalize(x, lambda t: apply(rec, spmd, t, axes, params))
        return CollectiveFn.apply(x, rec, spmd, axes, params)
    return fast_apply(x, rec, spmd, axes, params)


_FUNCTIONALIZE = TransformType.Functionalize


def below_functionalize(x: torch.Tensor, run: Callable[[torch.Tensor], torch.Tensor]):
    """``run(x)`` one level below a ``torch.func.functionalize`` on top of the functorch stack.

    functorch has no functionalize rule for an ``autograd.Function`` ("NYI: Functionalize rule
    for custom_function_call"); a collective mutates nothing the program can see (it donates
    temporaries only, and not under a transform), so it runs on the unwrapped value and its
    result is wrapped back, as the simulated primitives do under functionalize."""
    interpreter = current_interpreter()
    inner = functional_unwrap(x, reapply_views=interpreter.functionalize_add_back_views())
    with interpreter.lower():
        out = run(inner)
    return functional_wrap(out, interpreter.level())
