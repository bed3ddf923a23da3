"""Per-vmap-level primitives from which the simulated backend builds every collective.

The simulation nests one vmap level per mesh axis. Each axis also gets a *token*, ``arange(size)``
batched at that level only; it doubles as ``axis_index`` and identifies the level to the
fallback Functions below.

Fast path (module bottom): when only vmaps sit above the level (no torch.func.grad / jvp inside
the per-device function), the primitives unwrap the operand's batch levels above the collective's
level, act on the tensor as seen at that level and wrap the result back, with private functorch
APIs and ordinary torch ops only: ``gather`` (varying -> invariant stack ``[n, *local]``, a view),
``gather_reduce`` (psum / pmax / pmin over one level, one op), ``vary`` (invariant -> varying, an
expand), ``scatter`` (invariant ``[n, ...]`` -> varying, the dim becomes the batch dim: no op) and
``permute`` (ppermute over one level, one index_select). A few microseconds each; transforms
outside the simulation see only the ordinary ops. Their math on the members' dim is
``_stacked``'s, as the compiled path's.

Fallback: ``GatherLevel`` / ``VaryLevel``, autograd.Functions with a ``vmap`` staticmethod (about
120 us per level visited). functorch calls their vmap rule only at levels where some operand is
batched; the token makes that happen at exactly the axis' level. At a level where only the operand
is batched (another axis, or a user's own vmap) the rule moves that batch dim to the front and
re-applies, counting ``k`` leading dims that are not the operand's own. Their ``backward`` / ``jvp``
are the per-instance transposes that a torch.func.grad / jvp *inside* the per-device function
needs. With the fast path on, a grad / jvp inside first goes to ``_lowered`` (one single-level
Function applied at that interpreter); the Functions here remain for what it does not handle.
tests/test_levels_matrix.py runs every collective through every transform on both paths.
"""

from __future__ import annotations

import torch

from ... import _torch_private as torch_private
from . import _stacked as stacked
from ._lowered import _GatherAbove, _lowered, _SumAbove, _VaryAbove


def _pass_through(fn, x, xd, token, k):
    return fn.apply(x.movedim(xd, 0), token, k + 1), 0


class _LevelFunction(torch.autograd.Function):
    """A fallback Function of one level: its vmap rule runs it at the token's level (never its
    forward); each subclass gives the rule, the transpose and the tangent."""

    @staticmethod
    def forward(x, token, k):
        raise RuntimeError("named_spmd internal error: a level Function ran outside its level")

    @staticmethod
    def setup_context(ctx, inputs, output):
        # k: dims peeled by user vmap levels between ours and the transform calling backward/jvp;
        # the level's own dim sits after them. The token is an index, never differentiated.
        _, token, ctx.k = inputs
        ctx.save_for_backward(token)
        ctx.token = token


class GatherLevel(_LevelFunction):
    @staticmethod
    def backward(ctx, grad):
        # Transpose of "stack the group's values": every instance keeps its own slice (of the
        # stacked dim, which sits after the k peeled dims).
        (token,) = ctx.saved_tensors
        return stacked.member_slice(grad, ctx.k, token), None, None

    @staticmethod
    def jvp(ctx, x_t, _token_t, _k_t):
        # Linear: the tangent is gathered like the primal (an inner torch.func.jvp).
        return GatherLevel.apply(x_t, ctx.token, ctx.k)

    @staticmethod
    def vmap(info, in_dims, x, token, k):
        xd, td, _ = in_dims
        if td is None:
            return _pass_through(GatherLevel, x, xd, token, k)
        # physical [n, k outer-peeled dims, *local] -> unbatched here: [k dims, n, *local]
        x = stacked.copies(x, info.batch_size) if xd is None else x.movedim(xd, 0)
        return _not_a_view(stacked.gather(x, k)), None


class VaryLevel(_LevelFunction):
    @staticmethod
    def backward(ctx, grad):
        # Transpose of pvary is psum over the level.
        (token,) = ctx.saved_tensors
        return stacked.reduce(GatherLevel.apply(grad, token, ctx.k), "sum", ctx.k), None, None

    @staticmethod
    def jvp(ctx, x_t, _token_t, _k_t):
        return VaryLevel.apply(x_t, ctx.token, ctx.k)

    @staticmethod
    def vmap(info, in_dims, x, token, k):
        xd, td, _ = in_dims
        if td is None:
            return _pass_through(VaryLevel, x, xd, token, k)
        if xd is not None:  # already varying: nothing to do
            return _not_a_view(x), xd
        return _not_a_view(stacked.copies(x, info.batch_size)), 0


def _not_a_view(x: torch.Tensor) -> torch.Tensor:
    # Under a jvp above, autograd gives a Function's output that is a view of its input (or the
    # input itself) its tangent by a copy into the view of the input's tangent, which overlapping
    # memory (an expand, a cotangent basis) refuses. The fallback is off the fast path, and a copy
    # costs little next to its Python.
    return x.clone()


# --- fast path ----------------------------------------------------------------------------------
#
# The Functions above go through functorch's custom_function_call machinery: about 120 us of
# Python per vmap level they visit. When every functorch interpreter above the token's level is a
# vmap (ours, or a user's vmap inside the per-device function) the same data movement can be done
# directly: unwrap the operand's batch levels above the token's level (recording their batch
# dims), act on the tensor *as seen at the token's level*, and wrap the result back. Only ordinary
# torch ops (expand, movedim) touch data, so every transform *below* (autograd, torch.func grad /
# jvp / vmap outside the simulation) differentiates or batches them as usual. A grad or jvp
# interpreter above the token's level (torch.func.grad inside the per-device function) needs the
# per-instance transposes of the Functions, so it takes the slow path.

_VMAP = torch_private.TransformType.Vmap
FAST = True  # False: every primitive through the Functions above (the tests run both)


def vmaps_only_above(level: int, known_top: int) -> bool:
    """Whether every functorch interpreter above ``level`` is a vmap.

    ``known_top`` is a level known to be a vmap with only vmaps between it and ``level`` (the
    simulation's innermost level): functorch levels are stack depths, so while the current level
    is ``known_top`` the stack above ``level`` is exactly that."""
    top = torch_private.maybe_current_level()
    if top == known_top:
        return True
    return all(i.key() == _VMAP for i in torch_private.get_interpreter_stack() if i.level() > level)


def _peel(x: torch.Tensor, level: int) -> tuple[torch.Tensor, int, list[tuple[int, int]]] | None:
    """``x`` as seen at ``level``, its own level (``level`` where it is batched there), and the
    (level, batch dim) pairs removed, outermost first.

    None if a non-vmap wrapper sits above ``level`` (the caller then takes the slow path)."""
    peeled = []
    lv = torch_private.maybe_get_level(x)
    while lv > level:
        if not torch_private.is_batchedtensor(x):
            return None
        peeled.append((lv, torch_private.maybe_get_bdim(x)))
        x = torch_private.get_unwrapped(x)
        lv = torch_private.maybe_get_level(x)
    return x, lv, peeled


def _rewrap(x: torch.Tensor, peeled: list[tuple[int, int]], shift: int) -> torch.Tensor:
    # ``shift``: dims the result gained in front of the peeled levels' view of it.
    for lv, bd in reversed(peeled):
        x = torch_private.add_batch_dim(x, bd + shift, lv)
    return x


def _stacked_at(x: torch.Tensor, n: int, level: int, top: int) -> torch.Tensor | None:
    """The fast path of :func:`gather`; None where it does not apply."""
    if not vmaps_only_above(level, top):
        return None
    found = _peel(x, level)
    if found is None:
        return None
    t, lv, peeled = found
    if lv == level:  # batched here: its dim is the stack
        bd = torch_private.maybe_get_bdim(t)
        t = torch_private.get_unwrapped(t)
        stack = t if bd == 0 else t.movedim(bd, 0)
    else:  # invariant here: n identical copies
        stack = stacked.copies(t, n)
    return _rewrap(stack, peeled, 1)


def gather(
    x: torch.Tensor, token: torch.Tensor, n: int, level: int, top: int, k: int = 0
) -> torch.Tensor:
    """Varying over ``token``'s level -> invariant stack ``[n, *local]`` (a view, no copy).

    ``k``: leading dims of ``x`` that a user vmap above has been peeled into (the stack dim goes
    after them); only the lowering path below sets it."""
    out = _stacked_at(x, n, level, top) if FAST else None
    if out is not None:
        return stacked.gather(out, k)
    out = _lowered(_GatherAbove, gather, x, token, n, level, top, k)
    return GatherLevel.apply(x, token, k) if out is None else out


def reduce_varying(x: torch.Tensor, level: int, top: int, op: str) -> torch.Tensor | None:
    """``op`` ("sum", "max" or "min") over ``level`` of an ``x`` batched there, on the fast
    path: one op on the tensor as seen at the level, before the levels above are wrapped back on.
    None where ``x`` is invariant over the level or the fast path does not apply."""
    if not FAST or not vmaps_only_above(level, top):
        return None
    found = _peel(x, level)
    if found is None or found[1] != level:
        return None
    t, _, peeled = found
    bd = torch_private.maybe_get_bdim(t)
    return _rewrap(stacked.reduce(torch_private.get_unwrapped(t), op, bd), peeled, 0)


def gather_reduce(
    x: torch.Tensor, token: torch.Tensor, n: int, level: int, top: int, op: str
) -> torch.Tensor:
    """``stacked.reduce(gather(x, ...), op)``: a psum, pmax or pmin over one level."""
    out = reduce_varying(x, level, top, op)
    if out is None and op == "sum":  # a psum under a grad / jvp inside: one Function
        out = _lowered(_SumAbove, _psum, x, token, n, level, top, 0)
    return stacked.reduce(gather(x, token, n, level, top), op) if out is None else out


def _psum(x, token, n, level, top, k):
    # The stack dim is reduced away, so the dims peeled into ``k`` need no care.
    return gather_reduce(x, token, n, level, top, "sum")


def vary(
    x: torch.Tensor, token: torch.Tensor, n: int, level: int, top: int, k: int = 0
) -> torch.Tensor:
    """Invariant over ``token``'s level -> varying broadcast (an expand, no copy)."""
    if FAST:
        if torch_private.maybe_get_level(x) < level and torch_private.maybe_current_level() == top:
            # The common case: batched at nothing from here up, under our levels only.
            return torch_private.add_batch_dim(stacked.copies(x, n), 0, level)
        if vmaps_only_above(level, top):
            found = _peel(x, level)
            if found is not None:
                t, lv, peeled = found
                if lv == level:  # already varying
                    return x
                copies = torch_private.add_batch_dim(stacked.copies(t, n), 0, level)
                return _rewrap(copies, peeled, 0)
    out = _lowered(_VaryAbove, vary, x, token, n, level, top, k)
    return VaryLevel.apply(x, token, k) if out is None else out


def scatter(stack: torch.Tensor, dim: int, level: int, top: int) -> torch.Tensor | None:
    """Invariant ``stack`` with a dim ``dim`` of size n -> varying over the level: instance i
    gets slice i of that dim. The inverse of :func:`gather`, and no op at all: the dim becomes the
    level's batch dim. None where the fast path does not apply.

    Autograd outside the simulation sees no op: each instance's cotangent lands in its own slice,
    exactly the transpose (an all_gather of the cotangents)."""
    if not FAST or not vmaps_only_above(level, top):
        return None
    peeled = []
    x, d = stack, dim
    while True:  # peel the levels above, tracking where ``dim`` sits in each one's value
        lv = torch_private.maybe_get_level(x)
        if lv <= level:
            break
        if not torch_private.is_batchedtensor(x):
            return None
        bd = torch_private.maybe_get_bdim(x)
        if bd <= d:
            d += 1
        peeled.append((lv, bd, d))
        x = torch_private.get_unwrapped(x)
    if lv == level:  # already varying over the level: not a stack of it
        return None
    x = torch_private.add_batch_dim(x, d, level)
    for lv, bd, d in reversed(peeled):  # ``dim`` is gone from each value: later dims shift
        x = torch_private.add_batch_dim(x, bd - 1 if bd > d else bd, lv)
    return x


def permute(
    x: torch.Tensor, level: int, top: int, source: torch.Tensor, receives: torch.Tensor | None
) -> torch.Tensor | None:
    """Instance i gets instance ``source[i]``'s value, or zeros where ``receives[i]`` is False
    (a ppermute over one level): one index_select on the level's batch dim. None where the fast
    path does not apply or ``x`` is not varying over the level."""
    if not FAST or not vmaps_only_above(level, top):
        return None
    found = _peel(x, level)
    if found is None:
        return None
    t, lv, peeled = found
    if lv != level:
        return None
    bd = torch_private.maybe_get_bdim(t)
    out = stacked.permute(torch_private.get_unwrapped(t), source, receives, bd)
    return _rewrap(torch_private.add_batch_dim(out, bd, level), peeled, 0)
