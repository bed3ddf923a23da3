"""The simulated mesh traced by ``torch.compile``: the simulated backend's compile path.

When Dynamo traces a call on a simulated mesh (``torch.compile(spmd_map(f, ...))``, or a
compiled step that calls one), :func:`run` replaces the eager ``run`` of the package. The eager
path enters functorch's vmap levels through private calls Dynamo cannot trace, and its primitives
are autograd Functions, which do not compile under vmap. Here instead:

* the instances are the public ``torch.func.vmap``, one per mesh axis (outermost first, in mesh
  order), which Dynamo traces;
* every primitive that moves data between instances is one custom op, :func:`_collective`,
  whose only implementation is its vmap rule (:func:`_rule`): at each vmap level it moves the
  level's batch dim in front and calls itself one level down, until every axis of the
  collective is an explicit dim; there :func:`_every_member` computes every member's result
  with ``_stacked``'s math, and the result goes back up, batched at the levels it varies over. The
  level of axis ``a`` is recognised by the per-axis token (``arange`` of the axis size) that is
  batched there. Autograd and Inductor see only ordinary ops: a gradient flows through them
  as through any batched program, and the transposes need no rule of ours;
* types are stamps (``_traced.TracedContext``) and every op is typed by ``CompiledVmaMode``,
  once, at trace time: an implicit pvary is a view (its psum in backward is vmap's own sum over
  the broadcast operand);
* attention runs as sdpa's math decomposition, which batches over the levels (the CPU flash
  kernel sdpa picks would run once per instance: :class:`_SimulatedVmaMode`).

Not on this path: ``torch.func`` transforms (grad, jvp) inside the per-device function (the
custom op has no autograd rule at a transform's level), ``CommMode`` events, and the
per-instance wording of torch's errors.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ... import _torch_private as torch_private
from ..._errors import SpmdError
from ..._layout import physical_layout
from ..._masked_fill import NOT_MASKED, SETITEM, as_masked_fill
from ..._mesh import Mesh
from ..._spec import PartitionSpec
from ..._traced import CompiledVmaMode, TracedContext, route_view_attributes, warm_types_eagerly
from ..._types import INVARIANT
from . import _stacked as stacked
from . import fallback_warning_hidden
from ._plan import from_physical, partial_input
from ._sized import (
    index_put_as_setitem,
    may_be_sized_by_values,
    sized_by_values_refusal,
    writes_through_masks,
)

if TYPE_CHECKING:
    from ..._call import Call

# --- the one custom op ------------------------------------------------------------------------
#
# ``tokens``: one per mesh axis (mesh order), batched at that axis' level only; ``axes``: the
# collective's axes (mesh indices, row-major order of the group); ``params``: the kind's ints;
# ``peeled``: the axis of each explicit leading dim (-1: a vmap level not ours); ``sizes``: the
# mesh's axis sizes.


@torch.library.custom_op(
    "named_spmd::simulated_collective",
    mutates_args=(),
    schema="(Tensor x, Tensor[] tokens, str kind, int[] axes, int[] params, int[] peeled, "
    "int[] sizes) -> Tensor",
)
def _collective(x, tokens, kind, axes, params, peeled, sizes):
    raise RuntimeError(_OUTSIDE)


@_collective.register_fake
def _(x, tokens, kind, axes, params, peeled, sizes):
    raise RuntimeError(_OUTSIDE)


_OUTSIDE = "named_spmd's simulated collective runs only under the simulation's vmap levels"


def _rule(info, in_dims, x, tokens, kind, axes, params, peeled, sizes):
    """The op at one vmap level: peel the level into an explicit leading dim and go one level
    down, or, once every axis of the group is explicit, compute (:func:`_every_member`)."""
    x_dim, token_dims = in_dims[0], in_dims[1]
    axis = next((a for a, d in enumerate(token_dims) if d is not None), -1)
    named = axis in axes
    if x_dim is None:
        if not named:  # x is the same on every instance of this level: so is the result
            return _collective(x, tokens, kind, axes, params, peeled, sizes), None
        x = stacked.copies(x, info.batch_size)  # typed varying, held once: every member's copy
    else:
        x = x.movedim(x_dim, 0)
    peeled = [axis, *peeled]
    with torch_private.DisableTorchFunction():
        if all(a in peeled for a in axes):
            out = _every_member(x, kind, axes, params, peeled, sizes)
        else:
            out = _collective(x, tokens, kind, axes, params, peeled, sizes)
    return out, (None if named and kind in _INVARIANT_RESULTS else 0)


torch.library.register_vmap(_collective, _rule)


def _every_member(x, kind, axes, params, peeled, sizes):
    """Every member's result at once. ``x``: ``[one dim per peeled level, *local]``; the
    result: the same peeled dims (the group's dims dropped for an invariant result), *local."""
    m = len(peeled)
    group = [peeled.index(a) for a in axes]
    others = [i for i in range(m) if i not in group]
    z = x.permute(*group, *others, *range(m, x.dim())).flatten(0, len(group) - 1)
    out = _KINDS[kind](z, len(others), params)
    if kind in _INVARIANT_RESULTS:
        return out
    out = out.unflatten(0, [sizes[a] for a in axes])
    order = group + others
    return out.permute(*[order.index(i) for i in range(m)], *range(m, out.dim()))


def _permute(z: torch.Tensor, k: int, params: list[int]) -> torch.Tensor:
    source, receives = stacked.permutation(z.shape[0], zip(params[::2], params[1::2]))
    mask = None if all(receives) else torch.tensor(receives, device=z.device)
    return stacked.permute(z, torch.tensor(source, device=z.device), mask)


# Each kind: z = [G (the group's members, row-major), *batch (k dims), *local] -> the result
# (``_stacked``), from the kind's ints.
_KINDS: dict[str, Callable[[torch.Tensor, int, list[int]], torch.Tensor]] = {
    "sum": lambda z, k, p: stacked.reduce(z, "sum"),
    "max": lambda z, k, p: stacked.reduce(z, "max"),
    "min": lambda z, k, p: stacked.reduce(z, "min"),
    "gather": lambda z, k, p: stacked.gather(z, k),
    "broadcast": lambda z, k, p: stacked.broadcast(z, p[0]),
    "reduce_scatter": lambda z, k, p: stacked.reduce_scatter(z, p[0], k),
    "all_to_all": lambda z, k, p: stacked.all_to_all(z, p[0], k),
    "permute": _permute,
    "own": lambda z, k, p: stacked.own(z, p[0], k),
}
_INVARIANT_RESULTS = frozenset({"sum", "max", "min", "gather", "broadcast"})


# --- the context ------------------------------------------------------------------------------


@torch_private.trace_constant
def _under_grad() -> bool:
    """Whether a torch.func grad / jvp transform is the innermost one (run eagerly at trace
    time: Dynamo enters the transforms' levels while it traces them)."""
    interpreter = torch_private.current_interpreter()
    return interpreter is not None and interpreter.key() in torch_private.GRAD_LIKE


@torch_private.trace_constant
def _innermost_level() -> int:
    """The mesh's innermost vmap level (run eagerly at trace time, inside the levels Dynamo
    entered while tracing them)."""
    return torch_private.maybe_current_level() or 0


_UNDER_GRAD = (
    "spmd_map of {fn}: a collective under torch.func.grad / vjp / jvp inside the per-device "
    "function cannot be compiled on the simulated mesh (its compiled collectives have no rule "
    "for a transform inside the instances). Fix: differentiate outside the mapped call "
    "(loss.backward() on its output, or torch.func.grad around the compiled call), or run this "
    "call eagerly, where torch.func transforms inside the function work."
)


class TracedSimulatedContext(TracedContext):
    """A simulated call traced by Dynamo: the primitives are :func:`_collective`."""

    def __init__(self, mesh: Mesh, fn: Callable[..., Any], tokens: dict[str, torch.Tensor]):
        super().__init__(mesh, fn)
        self.tokens = tokens  # axis -> arange(size), batched at the axis' level
        self.token_list = list(tokens.values())
        self.index_of = {a: i for i, a in enumerate(tokens)}
        self.sizes = [mesh.shape[a] for a in tokens]
        self.inner_level = _innermost_level()  # a vmap of the user's above it batches

    def _op(self, x: torch.Tensor, kind: str, axes: tuple[str, ...], *params: int):
        if _under_grad():
            raise SpmdError(_UNDER_GRAD.format(fn=self.fn_label))
        return _collective(
            x, self.token_list, kind, [self.index_of[a] for a in axes], list(params), [], self.sizes
        )

    def apply(self, rec, x, axes, params, user_operand=False):
        with torch_private.DisableTorchFunction():  # the collective's own ops need no types
            return rec.forward(self, x, axes, params)

    # --- primitives -------------------------------------------------------------------------
    def axis_index(self, axes):
        index = self.tokens[axes[0]]
        for a in axes[1:]:
            index = index * self.sizes[self.index_of[a]] + self.tokens[a]
        return self.stamp(index.clone() if len(axes) == 1 else index, INVARIANT.add(axes))

    def per_member(self, axes, make):
        with torch_private.DisableTorchFunction():
            stacked = torch.stack([make(i) for i in range(self.mesh.axis_size(axes))])
            return self.stamp(self.own_block(stacked, axes, 0), INVARIANT.add(axes))

    def pvary(self, x, axes):
        return x.view_as(x)

    def all_reduce(self, x, axes, op):
        return self._op(x, stacked.reduction(op, x.dtype), axes)

    def all_gather(self, x, axes):
        return self._op(x, "gather", axes)

    def reduce_scatter(self, x, axes, dim):
        return self._op(x, "reduce_scatter", axes, dim % x.dim())

    def all_to_all(self, x, axes, dim):
        return self._op(x, "all_to_all", axes, dim % x.dim())

    def permute(self, x, axes, pairs):
        return self._op(x, "permute", axes, *(i for pair in pairs for i in pair))

    def broadcast(self, x, axes, root):
        return self._op(x, "broadcast", axes, root)

    def own_block(self, x, axes, dim):
        return self._op(x, "own", axes, dim % x.dim())


# --- the call -----------------------------------------------------------------------------------


class _SimulatedVmaMode(CompiledVmaMode):
    """:class:`CompiledVmaMode` inside the mesh's vmap levels: attention runs as its math
    decomposition, which batches over the levels (torch 2.13 has no batching rule for the CPU
    flash kernel ``scaled_dot_product_attention`` picks, so vmap would run it once per
    instance, a call of its fixed cost each); an op whose result's size depends on a varying
    operand's values raises the eager call's error, or names the limit (``_sized.py``),
    rather than fail inside Dynamo's tracer."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if writes_through_masks(func):  # as the eager call's marker (``_masked_fill``)
            op = lambda f, a: self.__torch_function__(f, types, a)  # noqa: E731
            out = as_masked_fill(func, args, kwargs, op)
            if out is NOT_MASKED:
                out = index_put_as_setitem(self.ctx, func, args, kwargs, op)
            if out is not NOT_MASKED:
                return None if func is SETITEM else out
        return super().__torch_function__(func, types, args, kwargs)

    def _general(self, func, args, kwargs):
        if may_be_sized_by_values(func, args, kwargs):
            refusal = sized_by_values_refusal(self.ctx, func, args, kwargs)
            if refusal is not None:
                raise SpmdError(refusal)
        return super()._general(func, args, kwargs)

    def _run(self, func, args, kwargs):
        if func is F.scaled_dot_product_attention:
            math = _math_attention_args(*args, **(kwargs or {}))
            if math is not None:  # a multi-output op: the base class views each of its tensors
                return super()._run(torch_private.sdpa_math, *math)[0]
        return super()._run(func, args, kwargs)


def _math_attention_args(
    q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
):
    """sdpa's arguments as ``sdpa_math``'s; None with dropout (random draws) or grouped heads,
    which sdpa itself runs."""
    if dropout_p or enable_gqa:
        return None
    return (q, k, v, attn_mask, 0.0, is_causal), {"scale": scale}


def run(call: Call) -> list[torch.Tensor]:
    """The simulated ``run`` while Dynamo traces: see the module docstring."""
    route_view_attributes()
    mesh, fn, leaves, specs = call.mesh, call.fn, call.leaves, call.specs
    names = mesh.axis_names
    warm_types_eagerly(names)
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    device = leaves[tensor_pos[0]].device if tensor_pos else torch.device("cpu")
    tokens = [torch.arange(mesh.shape[a], device=device) for a in names]
    physical = [_physical(leaves[i], specs[i], mesh) for i in tensor_pos]

    def per_instance(inputs: list[torch.Tensor], tokens: list[torch.Tensor]):
        ctx = TracedSimulatedContext(mesh, fn, dict(zip(names, tokens)))
        local = list(leaves)
        for i, x in zip(tensor_pos, inputs):
            spec = specs[i]
            x = partial_input(ctx, x, spec) if spec.reduced or spec.unreduced else x.view_as(x)
            local[i] = ctx.stamp_input(x, spec)
        with _SimulatedVmaMode(ctx), fallback_warning_hidden():
            outs = call.body(local, ctx)
        return outs or [tokens[0]]  # vmap needs an output; an unused one

    mapped = per_instance
    for a in reversed(names):  # innermost first: the outermost wrapper is the mesh's first axis
        in_dims = (
            [0 if a in specs[i].axes else None for i in tensor_pos],
            [0 if b == a else None for b in names],
        )
        mapped = torch.func.vmap(mapped, in_dims=in_dims, randomness="same")
    # a tensor ``fn`` reads but does not take (a mapped method's ``self.w``) is one Dynamo meets
    # first inside the levels, where exporting copies it with a requires_grad_ vmap refuses
    with torch_private.export_clones_allowed():
        outs = mapped(physical, tokens)
    with torch_private.DisableTorchFunction():
        return [
            from_physical(y, names, s, mesh, cached=False) for y, s in zip(outs, call.out_specs())
        ]


def _physical(x: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> torch.Tensor:
    """A global input as ``[one dim per axis its spec names, in mesh order, *local]``."""
    split, perm = physical_layout(tuple(x.shape), spec, mesh._shape, mesh.axis_names)
    x = x.reshape(split)
    return x if perm == list(range(len(perm))) else x.permute(perm)


__all__ = ["run"]
