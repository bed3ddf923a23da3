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
