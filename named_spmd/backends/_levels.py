"""Two per-vmap-level primitives from which the simulated backend builds every collective.

The simulation nests one ``torch.func.vmap`` level per mesh axis. Each axis also gets a *token*,
``arange(size)`` batched at that level only: passing it as an operand makes functorch call the
Function's vmap rule at exactly that level (functorch only visits levels where some operand is
batched), and it doubles as ``axis_index``. At a level where only the operand is batched (another
axis, or a user's own vmap) the rule moves that batch dim to the front and re-applies, counting
``k`` leading dims that are not the operand's own.

* ``GatherLevel``: varying over the axis -> invariant stack ``[n, *local]`` (a view, no copy).
* ``VaryLevel``: invariant over the axis -> varying broadcast (an expand, no copy).

Their autograd through ops of the vmap rule gives the global gradient when differentiating outside
the simulation; ``backward`` (the per-instance transpose) serves torch.func.grad *inside* it.
"""

from __future__ import annotations

import torch
from torch._C import _functorch


def _save_level(ctx, inputs):
    # k: dims peeled by user vmap levels between ours and the transform calling backward/jvp;
    # the level's own dim sits after them. The token is an index, never differentiated.
    _, token, ctx.k = inputs
    ctx.save_for_backward(token)
    ctx.token = token


def _pass_through(fn, x, xd, token, k):
    return fn.apply(x.movedim(xd, 0), token, k + 1), 0


class GatherLevel(torch.autograd.Function):
    @staticmethod
    def forward(x, token, k):
        raise RuntimeError("named_spmd internal error: GatherLevel reached outside its vmap level")

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_level(ctx, inputs)

    @staticmethod
    def backward(ctx, grad):
        # Transpose of "stack the group's values": every instance keeps its own slice (of the
        # stacked dim, which sits after the k peeled dims).
        (token,) = ctx.saved_tensors
        return grad.index_select(ctx.k, token.reshape(1)).squeeze(ctx.k), None, None

    @staticmethod
    def jvp(ctx, x_t, _token_t, _k_t):
        # Linear: the tangent is gathered like the primal (an inner torch.func.jvp).
        return GatherLevel.apply(x_t, ctx.token, ctx.k)

    @staticmethod
    def vmap(info, in_dims, x, token, k):
        xd, td, _ = in_dims
        if td is None:
            return _pass_through(GatherLevel, x, xd, token, k)
        if xd is None:  # invariant here: n identical copies
            x = x.unsqueeze(0).expand(info.batch_size, *x.shape)
        else:
            x = x.movedim(xd, 0)
        # physical [n, k outer-peeled dims, *local] -> unbatched here: [k dims, n, *local]
        return x.movedim(0, k), None


class VaryLevel(torch.autograd.Function):
    @staticmethod
    def forward(x, token, k):
        raise RuntimeError("named_spmd internal error: VaryLevel reached outside its vmap level")

    @staticmethod
    def setup_context(ctx, inputs, output):
        _save_level(ctx, inputs)

    @staticmethod
    def backward(ctx, grad):
        # Transpose of pvary is psum over the level.
        (token,) = ctx.saved_tensors
        return GatherLevel.apply(grad, token, ctx.k).sum(ctx.k), None, None

    @staticmethod
    def jvp(ctx, x_t, _token_t, _k_t):
        return VaryLevel.apply(x_t, ctx.token, ctx.k)

    @staticmethod
    def vmap(info, in_dims, x, token, k):
        xd, td, _ = in_dims
        if td is None:
            return _pass_through(VaryLevel, x, xd, token, k)
        if xd is not None:  # already varying: nothing to do
            return x, xd
        return x.unsqueeze(0).expand(info.batch_size, *x.shape), 0


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

_VMAP = _functorch.TransformType.Vmap


def vmaps_only_above(level: int, known_top: int) -> bool:
    """Whether every functorch interpreter above ``level`` is a vmap.

    ``known_top`` is a level known to be a vmap with only vmaps between it and ``level`` (the
    simulation's innermost level): functorch levels are stack depths, so while the current level
    is ``known_top`` the stack above ``level`` is exactly that."""
    top = _functorch.maybe_current_level()
    if top == known_top:
        return True
    return all(i.key() == _VMAP for i in _functorch.get_interpreter_stack() if i.level() > level)


def _peel(x: torch.Tensor, level: int) -> tuple[torch.Tensor, list[tuple[int, int]]] | None:
    """``x`` as seen at ``level``, and the (level, batch dim) pairs removed, outermost first.

    None if a non-vmap wrapper sits above ``level`` (the caller then takes the slow path)."""
    peeled = []
    while True:
        lv = _functorch.maybe_get_level(x)
        if lv <= level:
            return x, peeled
        if not _functorch.is_batchedtensor(x):
            return None
        peeled.append((lv, _functorch.maybe_get_bdim(x)))
        x = _functorch.get_unwrapped(x)


def _rewrap(x: torch.Tensor, peeled: list[tuple[int, int]], shift: int) -> torch.Tensor:
    # ``shift``: dims the result gained in front of the peeled levels' view of it.
    for lv, bd in reversed(peeled):
        x = _functorch._add_batch_dim(x, bd + shift, lv)
    return x


def gather(x: torch.Tensor, token: torch.Tensor, n: int, level: int, top: int) -> torch.Tensor:
    """Varying over ``token``'s level -> invariant stack ``[n, *local]`` (a view, no copy)."""
    if vmaps_only_above(level, top):
        found = _peel(x, level)
        if found is not None:
            t, peeled = found
            if _functorch.maybe_get_level(t) == level:  # batched here: its dim is the stack
                bd = _functorch.maybe_get_bdim(t)
                t = _functorch.get_unwrapped(t)
                stacked = t if bd == 0 else t.movedim(bd, 0)
            else:  # invariant here: n identical copies
                stacked = t.expand(n, *t.shape)
            return _rewrap(stacked, peeled, 1)
    return GatherLevel.apply(x, token, 0)


def vary(x: torch.Tensor, token: torch.Tensor, n: int, level: int, top: int) -> torch.Tensor:
    """Invariant over ``token``'s level -> varying broadcast (an expand, no copy)."""
    if vmaps_only_above(level, top):
        found = _peel(x, level)
        if found is not None:
            t, peeled = found
            if _functorch.maybe_get_level(t) == level:  # already varying
                return x
            copies = _functorch._add_batch_dim(t.expand(n, *t.shape), 0, level)
            return _rewrap(copies, peeled, 0)
    return VaryLevel.apply(x, token, 0)
