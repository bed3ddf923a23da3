"""The simulated backend's level primitives under a grad or jvp *inside* the per-device function.

``_levels``' primitives call :func:`_lowered` when a torch.func.grad / vjp / jvp (or a
functionalize, or a user vmap over one of those) sits above their level; the single-level
Functions here apply the primitive at that interpreter and give it its per-instance transpose,
calling ``_levels``' primitives again one level down. The two modules call each other: this one
reaches ``_levels`` through the module (``_levels.gather``, ``_levels.FAST``), so it is loaded
by ``_levels``' own import of it.
"""

from __future__ import annotations

import torch

from ... import _torch_private as torch_private
from . import _levels
from . import _stacked as stacked

# --- under a grad or jvp inside the per-device function -----------------------------------------
#
# A torch.func.grad / vjp / jvp inside the per-device function puts a grad or jvp interpreter
# above our levels; the primitives then need their per-instance transposes at that level. Rather
# than functorch's custom_function_call machinery (a generated Function class per call and
# ~120 us of Python per level), a single-level Function is applied at that level, the way
# functorch's generate_single_level_function does, whose forward lowers past the interpreter and
# calls the primitive again; a user vmap above is peeled as the Functions' vmap rule does
# (``k`` counts the peeled dims). Once only vmaps remain above, the fast path takes over.

_FUNCTIONALIZE = torch_private.TransformType.Functionalize
_JVP = torch_private.TransformType.Jvp


def _lowered(fn_above, again, x, token, n, level, top, k):
    """Apply ``fn_above`` at the grad / jvp interpreter on top, or peel the user vmap on top and
    call ``again`` one level down. None for anything else (the Functions' path)."""
    if not _levels.FAST:
        return None
    interpreter = torch_private.current_interpreter()
    key = interpreter.key()
    if key in torch_private.GRAD_LIKE:
        with torch_private.single_level_functions():
            return fn_above.apply(x, token, n, level, top, k, interpreter, again)
    if key == _FUNCTIONALIZE:  # the primitives do not mutate: unwrap, run below, wrap
        return _under_functionalize(interpreter, again, x, token, n, level, top, k)
    if key != _levels._VMAP or interpreter.level() <= level:
        return None
    lv = interpreter.level()
    if torch_private.maybe_get_level(x) != lv:  # not batched here: nothing to peel
        with interpreter.lower():
            return again(x, token, n, level, top, k)
    bd = torch_private.maybe_get_bdim(x)
    x = torch_private.get_unwrapped(x)
    with interpreter.lower():
        out = again(x.movedim(bd, 0), token, n, level, top, k + 1)
    return torch_private.add_batch_dim(out, 0, lv)


def _under_functionalize(interpreter, again, x, token, n, level, top, k):
    views = interpreter.functionalize_add_back_views()
    inner = torch_private.functional_unwrap(x, reapply_views=views)
    with interpreter.lower():
        out = again(inner, token, n, level, top, k)
    return torch_private.functional_wrap(out, interpreter.level())


def _run_lowered(primitive, x, token, n, level, top, k, interpreter):
    """The forward of a single-level Function: unwrap ``x`` at the interpreter's level, run
    ``primitive`` below it with grad mode back on (a Function's forward runs without it, and the
    levels below may differentiate), wrap the result back."""
    own = interpreter.level()
    inner = torch_private.unwrap_for_grad(x, own)
    with torch.enable_grad(), torch_private.set_fwd_grad_enabled(True), interpreter.lower():
        out = primitive(inner, token, n, level, top, k)
        if interpreter.key() == _JVP:
            # A result that is a view of ``x`` (a gather, a vary) gets its tangent by a copy into
            # the view of x's tangent, which overlapping memory (an expand) refuses.
            out = out.clone()
    return torch_private.wrap_for_grad(out, own)


class _LinearAbove(torch_private.SingleLevelFunction):
    """A linear level primitive (``again``: gather, vary, psum) at a grad / jvp level: its
    forward runs the primitive below the interpreter, its tangent is the primitive of the
    tangent; each subclass gives the per-instance transpose (``backward``)."""

    @staticmethod
    def forward(x, token, n, level, top, k, interpreter, again):
        return _run_lowered(again, x, token, n, level, top, k, interpreter)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, ctx.token, ctx.n, ctx.level, ctx.top, ctx.k, _, ctx.again = inputs

    @staticmethod
    def jvp(ctx, x_t, *_):
        return ctx.again(x_t, ctx.token, ctx.n, ctx.level, ctx.top, ctx.k)


_NONES = (None,) * 7


class _GatherAbove(_LinearAbove):
    """:func:`gather` at a grad / jvp level; backward keeps the own slice (the transpose)."""

    @staticmethod
    def backward(ctx, grad):
        return (stacked.member_slice(grad, ctx.k, ctx.token), *_NONES)


class _VaryAbove(_LinearAbove):
    """:func:`vary` at a grad / jvp level; backward is the psum over the level (the transpose)."""

    @staticmethod
    def backward(ctx, grad):
        gathered = _levels.gather(grad, ctx.token, ctx.n, ctx.level, ctx.top, ctx.k)
        return (stacked.reduce(gathered, "sum", ctx.k), *_NONES)


class _SumAbove(_LinearAbove):
    """A psum over one level at a grad / jvp level: one Function instead of a gather and a sum
    recorded there. Backward is the per-instance transpose of psum, pvary: the identity."""

    @staticmethod
    def backward(ctx, grad):
        return (grad, *_NONES)
