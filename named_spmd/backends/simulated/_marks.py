"""Unreduced and reduced values on the simulated backend (docs/design.md section 2.2).

The vmap levels tell varying (batched) from invariant (unbatched), and nothing else: an
unreduced value is batched like a varying one, a reduced value unbatched like an invariant one.
So such values carry a *mark*, ``(call token, Vma)`` in the tensor's ``__dict__`` (as the
tracked backends' stamps), and :class:`PartialMode` types every op of the call by the partial-sum
algebra (``_partial.combine``) once the first marked value exists: a call without unreduced or
reduced values pushes no mode and pays nothing. Values need nothing else: vmap computes them, and
autograd through the levels sums the gradient of an unbatched (reduced) input as the real
backend's unreduced gradient sums to.

The same mode gives an implicit pvary its physical form where that pays (:func:`input_axes`):
the input of a contraction invariant over an axis its weight varies over.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ... import _blocks
from ... import _torch_private as torch_private
from ..._calls import PARTIAL_ATTR
from ..._operands import METADATA, NOT_OPS, result_tensors, tensor_operands
from ..._partial import typed_call
from ..._types import Vma

ATTR = PARTIAL_ATTR
_BLOCKS = _blocks.ATTR
UNTYPED = NOT_OPS | METADATA  # run as they are: no value computed, or no tensor result


def mark_of(x: torch.Tensor, token: object) -> Vma | None:
    """``x``'s mark in the call of ``token``, or None."""
    m = x.__dict__.get(ATTR)
    return m[1] if m is not None and m[0] is token else None


def set_mark(x: torch.Tensor, token: object, vma: Vma, kept: bool = False) -> None:
    """Mark ``x`` with ``vma`` where partial, else drop its mark; ``kept``: mark it whatever
    ``vma`` (once a transform inside the call handed back marked values: a tensor on their
    storage, a cast of one to varying, must not read as one of them, :func:`marked_within`)."""
    if vma.partial or kept:
        x.__dict__[ATTR] = (token, vma)
    elif ATTR in x.__dict__:
        del x.__dict__[ATTR]


# A torch.func transform entered inside the call (a user's vmap, grad or jvp) wraps the call's
# tensors in wrappers of its own level, and hands back what its wrappers hold (grad, jvp) or a
# view of it (vmap moves its batch dim): a mark must be read through the wrappers and reach the
# tensors handed back, or a partial sum would pass there as a varying value, unchecked.


def marked_within(ctx: Any, x: torch.Tensor) -> Vma | None:
    """The mark of a tensor that has none of its own (:func:`mark_of`) where a transform inside
    the call made or wraps it: that of a tensor its wrappers hold, above the call's levels, or
    for one a transform handed back, that of the marked result it is or views (the tensor
    :func:`set_mark_within` noted, itself or as the base of the view)."""
    token = ctx.token
    while torch_private.maybe_get_level(x) > ctx.inner_level:
        x = torch_private.get_unwrapped(x)
        m = mark_of(x, token)
        if m is not None:
            return m
    if not ctx.transform_marks:
        return None
    plain = torch_private.innermost(x)
    for held in (plain, torch_private.tensor_base(plain)):
        hit = ctx.transform_marks.get(id(held))
        if hit is not None and hit[0]() is held:
            return hit[1]
    return None


def set_mark_within(ctx: Any, x: torch.Tensor, vma: Vma) -> None:
    """:func:`set_mark` of a result, and where a transform inside the call made it, of the
    tensors its wrappers hold down to the call's levels; a partial sum's innermost tensor noted
    by identity (for the view a vmap hands back: :func:`marked_within`), weakly: the note
    keeps no tensor alive, and a tensor that only shares its storage (the input a cast aliased)
    is not typed by it."""
    token = ctx.token
    set_mark(x, token, vma, bool(ctx.transform_marks))
    if torch_private.maybe_get_level(x) <= ctx.inner_level:
        return
    while torch_private.maybe_get_level(x) > ctx.inner_level:
        x = torch_private.get_unwrapped(x)
        set_mark(x, token, vma, True)
    if vma.partial:
        plain = torch_private.innermost(x)
        ctx.transform_marks[id(plain)] = (weakref.ref(plain), vma)


# Contractions of an input (first operand) by a weight (second). Where the input is invariant over
# an axis the weight varies over (the residual stream after a psum over tp, against a
# column-parallel weight), vmap's rule for an unbatched operand against a batched one copies the
# weight into one wide matrix and the result out of it, forward and backward: about 2.5x the
# time of one batched matmul, which the input expanded over those levels (a view, stride 0)
# gets. The result's type is the union either way, and the expand's gradient is the sum over
# the level that vmap takes of an unbatched operand's. A varying input against an invariant
# weight needs nothing: vmap folds the input's batch into the matmul's rows. The operands are
# told apart by position (``F.linear``'s input and weight); of ``matmul`` / ``mm`` a parameter
# (a leaf requiring grad) on the left is a weight, left as it is: expanded, its gradient would be
# one per instance, summed.
_INPUT_BY_WEIGHT = frozenset(
    {torch.nn.functional.linear, torch.matmul, torch.Tensor.matmul, torch.mm, torch.Tensor.mm}
)


def input_axes(ctx: Any, func: Any, args: tuple, kwargs: dict) -> tuple[str, ...]:
    """The axes over which to expand ``func``'s input (``args[0]``): those its weight
    (``args[1]``) varies over and it does not; none for other ops, partial sums (their marks
    type them) or an ``out=`` write."""
    if func not in _INPUT_BY_WEIGHT or len(args) < 2 or "out" in kwargs:
        return ()
    x, w = args[0], args[1]
    if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
        return ()
    if func is not torch.nn.functional.linear and x.is_leaf and x.requires_grad:
        return ()  # a parameter on the left (``W @ x.T``): expanded, its gradient per instance
    vx, vw = ctx.vma(x), ctx.vma(w)
    if vw is vx or vx.partial or vw.partial:
        return ()
    return vx.missing(vw.present(ctx.mesh.axis_names))


def transform_inside(ctx: Any) -> bool:
    """Whether a torch.func transform entered inside the call is active (the call's own vmap
    levels are the innermost otherwise)."""
    return torch_private.maybe_current_level() != ctx.inner_level


def with_input_varied(ctx: Any, args: tuple, axes: tuple[str, ...]) -> tuple:
    """``args`` with the input expanded over ``axes``' levels: one alias per tensor and axes per
    call (``SimulatedContext.varied_input``). Left as it is while a ``CommMode`` records (its
    recorder reads the implicit pvary off the operands' levels) or under a transform inside
    the call (the expand is the fast path's, only vmaps above our levels)."""
    if ctx.recorder is not None or transform_inside(ctx):
        return args
    return (ctx.varied_input(args[0], axes), *args[1:])


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

    def typed(
        self, func: Any, args: tuple, kwargs: dict
    ) -> tuple[Any, Vma | None, bool, tuple[str, ...]]:
        """``func``'s result; the type marked on its tensors (None: their marks were left as
        they were); whether an operand held blocks (the results' block records were then
        written or dropped by ``_blocks.after_op``); the axes its input was expanded over
        (:func:`input_axes`). A plan (``_planned``) keeps the last three."""
        if func in UNTYPED:
            return func(*args, **kwargs), None, False, ()
        varied = input_axes(self.ctx, func, args, kwargs)
        operands = tensor_operands(args, kwargs)
        ctx = self.ctx
        token = ctx.token
        marked = blocked = False
        for t in operands:
            d = t.__dict__
            m = d.get(ATTR)
            if m is not None and m[0] is token:
                marked = True
            m = d.get(_BLOCKS)
            if m is not None and m[0] is token:
                blocked = True
        within = ctx.transform_marks or transform_inside(ctx)
        if within and not marked:
            marked = any(marked_within(ctx, t) is not None for t in operands)
        # (the partial-sum algebra below runs the op on its operands as given)
        run = with_input_varied(self.ctx, args, varied) if varied and not marked else args
        if not marked and not blocked:
            return func(*run, **kwargs), None, False, varied
        vma = None
        if marked:
            vmas = [self.ctx.vma(t) for t in operands]
            out, vma = typed_call(self.ctx, func, args, kwargs, operands, vmas)
        else:
            out = func(*run, **kwargs)
        if blocked:
            axes = _blocks.after_op(
                self.ctx, token, func, args, kwargs, operands, out, self.ctx.vma
            )
            if axes:
                vma = _blocks.unreduced_over(vma or self.ctx.vma(_first_tensor(out)), axes)
                self.ctx.forget_last_vma()  # the result's type changes below
        if vma is not None:
            for o in result_tensors(out):
                if within:
                    set_mark_within(ctx, o, vma)
                else:
                    set_mark(o, token, vma)
        return out, vma, blocked, varied
