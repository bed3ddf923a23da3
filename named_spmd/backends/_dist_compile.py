"""A call on a real mesh traced by ``torch.compile``: the distributed backend's compile path.

When Dynamo traces a mapped function (``torch.compile(spmd_map(f, ...))``, or a compiled
function that calls one), :func:`run` replaces the eager ``run`` of ``distributed.py``. The
backend interface is the same (docs/design.md section 5.6); only what Dynamo cannot trace changes:

* the primitives call the functional collective ops (``_torch_private.funcol``, each
  followed by ``wait_tensor``) instead of ``ProcessGroup`` methods, so the graph carries every
  collective and Inductor may reorder and overlap them; ``permute`` is an ``all_to_all_single``
  with one non-empty split each way;
* every collective runs inside the autograd bridge of ``_autodiff`` (as
  ``TracedCollectiveFn``): Dynamo traces its forward and backward, and the backward is the
  record's transpose, so an implicit pvary's psum appears in the backward graph;
* the boundary (plain and DTensor inputs, outputs) is the eager path's, ``_dist_io``; where
  Dynamo needs other code it decides in place (``is_compiling``: DTensor's own conversions,
  Functions without the jvp and vmap rules Dynamo refuses);
* types are ``_traced``'s (stamps set with ``setattr``, every op typed by
  ``CompiledVmaMode``): type inference, the out_specs check and every ``SpmdError`` happen
  once, at trace time;
* the process group facts (group name, member index, rank order) come from
  ``torch_private.trace_constant`` functions: constants of the graph;
* nothing of the eager machinery runs in the graph: no start-of-call check, no failure board,
  no overlapped gradient psum, no donation, no CommMode events (a compiled call's collectives
  are the graph's nodes; count them there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _torch_private as torch_private
from .._autodiff import apply as bridge_apply
from .._errors import SpmdError
from .._spec import specialize
from .._stamps import TrackedContext
from .._traced import CompiledVmaMode, TracedContext, route_view_attributes
from .._types import INVARIANT
from ._dist_comm import on_wire, permute_splits, reduce_wire, unreceived
from ._dist_io import block_input, global_output, local_input, local_output
from ._dist_ragged import checked_in_graph

if TYPE_CHECKING:
    from .._call import Call
    from .._context import SpmdContext

_F = torch_private.funcol()  # bound at import: Dynamo reads module attributes as constants


@torch_private.trace_constant
def _group(mesh: Any, axes: tuple[str, ...]) -> tuple[str, int, int, tuple | None]:
    """(group name, size, this rank's tuple index, tuple index -> group rank or None when they
    agree) of the group of ``axes``: run eagerly at trace time, a constant of the graph."""
    comm = mesh.comm(axes)
    order = None if comm._to_group is None else tuple(comm.group_rank)
    return comm.group.group_name, comm.n, comm.index, order


def _wait(t: torch.Tensor) -> torch.Tensor:
    return _F.wait(t)


def _from_group(x: torch.Tensor, order: tuple | None) -> torch.Tensor:
    """Blocks in group-rank order (dim 0) -> tuple order."""
    return x if order is None else x.index_select(0, torch.tensor(order, device=x.device))


def _to_group(x: torch.Tensor, order: tuple | None) -> torch.Tensor:
    """Blocks in tuple order (dim 0) -> group-rank order."""
    if order is None:
        return x
    inverse = sorted(range(len(order)), key=order.__getitem__)
    return x.index_select(0, torch.tensor(inverse, device=x.device))


class FuncolPrimitives:
    """The backend primitives as functional collective ops (``_torch_private.funcol``, each
    followed by ``wait_tensor``): a graph records them as ops, where a ``ProcessGroup`` method
    would run once at trace time and leave its result a constant of the graph. Used by a call
    that Dynamo traces (:class:`CompiledContext`) and by one that ``make_fx`` traces
    (``distributed.ProxyTracedContext``: ``torch.func.linearize``, ``torch.export``)."""

    mesh: Any  # a DistributedMesh

    if TYPE_CHECKING:  # the context's own (TrackedContext.stamp)

        def stamp(self, x: torch.Tensor, vma: Any) -> torch.Tensor: ...

    def psum_in_backward(self, g, axes, node):
        return self.all_reduce(g, axes, "sum")

    def axis_index(self, axes):
        return self.stamp(torch.tensor(_group(self.mesh, axes)[2]), INVARIANT.add(axes))

    def per_member(self, axes, make):
        with torch_private.DisableTorchFunction():
            value = make(_group(self.mesh, axes)[2])
        return self.stamp(value, INVARIANT.add(axes))

    def pvary(self, x, axes):
        return x.view_as(x)

    # Every primitive puts its operand on the wire as the eager collectives do (``_dist_comm``:
    # dtypes gloo lacks as bytes or through a wider dtype), so both paths give the same bits.
    def all_reduce(self, x, axes, op):
        name = _group(self.mesh, axes)[0]
        wire, back = reduce_wire(x, op == "sum", f"in {op} over {axes}")
        return back(_wait(_F.all_reduce(wire, op, name)))

    def all_gather(self, x, axes):
        return on_wire(x, lambda t: self._all_gather(t, axes))

    def _all_gather(self, x, axes):
        name, n, _, order = _group(self.mesh, axes)
        out = _wait(_F.all_gather(x.contiguous(), n, name))
        return _from_group(out.reshape(n, *x.shape), order)

    def reduce_scatter(self, x, axes, dim):
        name, n, _, order = _group(self.mesh, axes)
        stacked = _to_group(x.movedim(dim, 0) if dim != 0 else x, order)
        wire, back = reduce_wire(stacked.contiguous(), True, f"in psum_scatter over {axes}")
        chunk = wire.shape[1:]  # funcol splits dim 0 into n pieces: fold n into it
        flat = wire.reshape(-1, *chunk[1:]) if chunk else wire
        out = _wait(_F.reduce_scatter(flat, "sum", n, name))
        return back(out.reshape(chunk))

    def all_to_all(self, x, axes, dim):
        moved = on_wire(x.movedim(dim, 0) if dim != 0 else x, lambda t: self._all_to_all(t, axes))
        return moved.movedim(0, dim) if dim != 0 else moved

    def _all_to_all(self, x, axes):
        name, n, _, order = _group(self.mesh, axes)
        stacked = _to_group(x, order).contiguous()
        per = stacked[0].numel()
        flat = stacked.reshape(n * per)
        out = _wait(_F.all_to_all(flat, [per] * n, [per] * n, name))
        return _from_group(out.reshape(stacked.shape), order)

    def permute(self, x, axes, pairs):
        """An all_to_all_single with one non-empty split each way, as on the eager path."""
        return on_wire(x, lambda t: self._permute(t, axes, pairs))

    def _permute(self, x, axes, pairs):
        name, n, me, order = _group(self.mesh, axes)
        block = x.contiguous().reshape(-1)
        to_group = range(n) if order is None else order
        src, received, sent = permute_splits(pairs, me, block.numel(), to_group)
        if any(s != d for s, d in pairs):
            send = block if any(sent) else block[:0]
            arrived = _wait(_F.all_to_all(send, received, sent, name))
        out = unreceived(x, src, me)
        return arrived.reshape(x.shape) if out is None else out

    def broadcast(self, x, axes, root):
        name, _, _, order = _group(self.mesh, axes)
        src = root if order is None else order[root]
        return on_wire(x, lambda t: _wait(_F.broadcast(t.contiguous(), src, name)))

    def own_block(self, x, axes, dim):
        return x.select(dim, _group(self.mesh, axes)[2])

    def checked_ragged(self, axes, meta, peer, rows, m):
        member = _group(self.mesh, axes)[2]
        return checked_in_graph(cast("SpmdContext", self), axes, member, (meta, peer), rows, m)


class _OnMesh(FuncolPrimitives):
    """The funcol primitives of one mesh, outside any call (what :func:`one_op` replays)."""

    def __init__(self, mesh: Any):
        self.mesh = mesh


_ONE_OP: list[Callable[[torch.Tensor], torch.Tensor]] = []  # op key -> the primitive it runs
_ONE_OP_KEYS: dict[tuple, int] = {}


@torch.library.custom_op("named_spmd::collective", mutates_args=())
def _collective(x: torch.Tensor, key: int) -> torch.Tensor:
    return _ONE_OP[key](x)


def one_op(mesh: Any, primitive: str, x: torch.Tensor, *params: Any) -> torch.Tensor:
    """``FuncolPrimitives.<primitive>(x, *params)`` on ``mesh`` as one op of a make_fx graph.

    As separate ops, a collective and its ``wait_tensor`` may end up on two sides of a graph's
    constant folding (``torch.func.linearize`` folds what depends on no tangent): the folded
    collective is issued once and its buffer read later without the wait, so the graph reads a
    stale value. One op that waits inside is folded, or not, whole."""
    key = (id(mesh), primitive, params)
    k = _ONE_OP_KEYS.get(key)
    if k is None:
        run = getattr(_OnMesh(mesh), primitive)
        k = _ONE_OP_KEYS[key] = len(_ONE_OP)
        _ONE_OP.append(lambda t: run(t, *params))
    return _collective(x, k)


class CompiledContext(FuncolPrimitives, TracedContext):
    """A traced call on a real mesh: funcol primitives."""

    mesh: Any  # a DistributedMesh (distributed.py imports this module)

    @classmethod
    def twin(cls, ctx: TrackedContext) -> CompiledContext:
        """The compile path's context for an eager call ``ctx``, made while Dynamo traces a
        piece compiled inside that call (``ns.compile``): it shares the call's token, so the
        stamps the eager path wrote (in ``__dict__``, read here with ``getattr``) are this
        call's, and Dynamo does not recompile per call."""
        twin = cls(ctx.mesh, ctx.fn)
        twin.call_token = ctx.call_token
        return twin

    # --- the bridge -------------------------------------------------------------------------
    def apply(self, rec, x, axes, params, user_operand=False):
        with torch_private.DisableTorchFunction():  # the collective's own ops need no types
            if x.requires_grad and torch.is_grad_enabled():
                return bridge_apply(rec, self, x, axes, params)
            return rec.forward(self, x, axes, params)


#: Tracing a call under a torch.func transform is not supported: Dynamo reads an input's
#: requires_grad from before the transform set it (the boundary's Functions would be traced
#: without their backward), and torch's functional collectives take no wrapped tensors.
_UNDER_TRANSFORM = (
    "{where}: torch.compile traces this call under a torch.func transform that the compiled "
    "function applies (torch.compile(torch.func.grad(f))), which a real mesh's compile path "
    "does not support (docs/design.md section 7). Fix: compile the mapped function (or a "
    "function calling it) and take gradients with loss.backward() or torch.autograd.grad, "
    "which differentiate the compiled graph; or run the torch.func transform eagerly."
)


def run(call: Call) -> list[Any]:
    """``distributed.run`` while Dynamo traces: see the module docstring. The boundary is the
    eager path's (``_dist_io``); each argument position gets a tensor object of its own (a
    view where the block is the leaf itself), on which its stamp goes."""
    if torch_private.transforms_active():  # (a transform the compiled program applies)
        raise SpmdError(_UNDER_TRANSFORM.format(where=call.mapped.where))
    route_view_attributes()
    ctx = CompiledContext(call.mesh, call.fn)
    ctx.checked = call.mapped.check_vma
    local_call = call.local  # SpmdFunction.local: this rank's blocks in and out
    local = list(call.leaves)
    with torch_private.DisableTorchFunction():
        for i, (leaf, spec) in enumerate(zip(call.leaves, call.specs)):
            if isinstance(leaf, torch.Tensor):
                x = block_input(ctx, leaf, i) if local_call else local_input(ctx, leaf, spec, i)
                # A DTensor's block dims are symbols of their own, and the only ones Dynamo
                # guards: its global shape, specialized by the input checks, is a constant of
                # the graph that no guard checks. Left symbolic, the graph would serve a call
                # of another shape with the traced global shape (its inputs' gradients of the
                # traced shape). The compile paths trace static shapes.
                specialize(x.shape)
                local[i] = ctx.stamp_input(x.view_as(x) if x is leaf else x, spec)
    with CompiledVmaMode(ctx):
        outs = call.body(local, ctx)
    with torch_private.DisableTorchFunction():
        if local_call:  # a view each: Dynamo would set the body's stamps on the tensors it returns
            return [local_output(ctx, y, s).view_as(y) for y, s in zip(outs, call.out_specs())]
        return [global_output(ctx, y, s) for y, s in zip(outs, call.out_specs())]
