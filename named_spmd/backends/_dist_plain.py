"""Plain tensors at the boundary of a call on a real mesh, on both of its paths: the eager one
(``_dist_io``) and the one Dynamo traces (``_dist_compile``).

* A plain tensor input is the global value, present on every rank; this rank takes its block
  (:func:`plain_input`), and the backward gathers the blocks of the gradient so that every rank
  holds the global one (:class:`ScatterInput`, :func:`gather_blocks`).
* A partial-sum input (unreduced or reduced axes) is parts of that value, or its gradient is
  (:func:`partial_input`).
* :func:`boundary_collective` runs a collective at the boundary, outside the user's function.

A call that Dynamo traces takes the same code; where it must differ, ``is_compiling`` picks
the Function: one without its forward-mode and vmap rules (:class:`TracedScatterInput`, as the
bridge's ``_autodiff.TracedCollectiveFn``), whose backward gathers the gradient by a collective
of the graph.
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch_private as torch_private
from .._accounting import CommEvent, active, on_backward, record_into
from .._autodiff import apply as bridge_apply
from .._autodiff import below_functionalize, differentiable
from .._collectives._record import PVARY_RECORD, RECORDS, tag_derivatives
from .._layout import assemble, block
from .._spec import PartitionSpec


def _fast(cls: Any) -> Any:
    """``cls.apply`` without the Python argument binding (see ``_autodiff``)."""
    return torch_private.function_base_apply.__get__(None, cls)


def _transformed(fn: Any, x: torch.Tensor, *rest: Any) -> Any:
    """``fn.apply`` under a torch.func transform (functorch wraps the Function: the full Python
    path), run below a ``functionalize`` on top, which has no rule for Functions."""
    if (
        torch_private.transforms_active()
        and torch_private.current_interpreter().key() == torch_private.TransformType.Functionalize
    ):
        return below_functionalize(x, lambda t: _transformed(fn, t, *rest))
    return fn.apply(x, *rest)


def plain_input(ctx, leaf: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    """This rank's block of the plain tensor argument ``leaf`` under ``spec`` (``ctx``: the
    call's context): ``leaf`` itself where every rank's block is the whole of it."""
    mesh = ctx.mesh
    if leaf.device.type != mesh.device.type:
        leaf = leaf.to(mesh.device)
    if spec.unreduced or spec.reduced:
        return partial_input(ctx, leaf, spec)
    return _scatter(leaf, ctx, spec)


def _scatter(leaf: torch.Tensor, ctx, spec: PartitionSpec) -> torch.Tensor:
    """This rank's block of the global value ``leaf``; its backward gathers the gradient."""
    mesh = ctx.mesh
    if mesh.single_axes.issuperset(spec.axes):  # blocks of size-1 axes are the whole
        return leaf
    if not differentiable(leaf):
        return _block(leaf, spec, mesh)
    if torch_private.transforms_active():
        return _transformed(ScatterInput, leaf, ctx, spec)
    if torch.compiler.is_compiling():
        return TracedScatterInput.apply(leaf, ctx, spec)
    return _scatter_input(leaf, ctx, spec)


def partial_input(ctx, leaf: torch.Tensor, spec: PartitionSpec, scatter=None) -> torch.Tensor:
    """A plain tensor is the global value on every rank, and its gradient the global gradient
    (as on the simulated mesh). Unreduced over A: the member at coordinate 0 of A holds the
    value, the others zeros (parts summing to it), so the gradient is member 0's cotangent. Its
    cotangent, reduced, is the same on every member, so each rank's gradient is its own; under
    ``check_vma=False`` nothing says so, and one psum of member 0's cotangent and zeros
    broadcasts it. Reduced over A: the gradient, a partial sum per member, is summed at the
    boundary (one psum; a DTensor input instead gets a Partial gradient and defers it).
    ``scatter(leaf, ctx, spec)``: how blocks of unequal sizes are cut (``_dist_uneven``)."""
    mesh = ctx.mesh
    x = (scatter or _scatter)(leaf, ctx, spec)
    if spec.unreduced:
        axes = tuple(
            a for a in mesh.axis_names if a in spec.unreduced and a not in mesh.single_axes
        )
        unchecked = bool(axes) and not ctx.checked
        if unchecked and differentiable(x):
            x = boundary_collective(ctx, "pvary", x, axes, ())  # backward: the psum
        x = first_holds(x, mesh, axes, True, unchecked)
    reduced = tuple(a for a in mesh.axis_names if a in spec.reduced and a not in mesh.single_axes)
    if reduced and differentiable(x):
        modes = active()
        x = bridge_apply(RECORDS["preduced"], ctx, x, reduced, ())
        if modes:
            x = on_backward(
                x, CommEvent("psum", reduced, "backward", _shape(x), x.dtype, boundary=True)
            )
    return x


@torch_private.trace_constant  # (a constant of the graph: no guard on the mesh's coordinates)
def first_member(mesh, axes: tuple[str, ...]) -> bool:
    """Whether this rank is the first member (coordinate 0) of the group of ``axes``."""
    return all(mesh.my_coords[a] == 0 for a in axes)


def first_holds(x: torch.Tensor, mesh, axes: tuple[str, ...], forward: bool, backward: bool):
    """:class:`FirstHolds` over ``axes`` (mesh order, no axis of size 1): the parts of ``x``
    (``forward``), of its cotangent (``backward``), or both."""
    parts = TracedFirstHolds if torch.compiler.is_compiling() else FirstHolds
    return parts.apply(x, first_member(mesh, axes), forward, backward)


class FirstHolds(torch.autograd.Function):
    """Parts of a global value, summing to it: the first member's part is the value, the
    others' zeros, in the forward (an unreduced input: the value's parts), in the backward (a
    reduced output: the global cotangent's parts), or both (an unreduced input whose
    cotangents may differ: the parts of the cotangent too, which a psum then sums)."""

    generate_vmap_rule = True  # (elementwise: ``torch.func.vmap`` over the call batches it as is)

    @staticmethod
    def forward(x, first, forward=True, backward=False):
        return x.view_as(x) if first or not forward else torch.zeros_like(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.first, ctx.parts_forward, ctx.parts_back = inputs[1:]

    @staticmethod
    def jvp(ctx, t, *_):
        return t.view_as(t) if ctx.first or not ctx.parts_forward else torch.zeros_like(t)

    @staticmethod
    def backward(ctx, g):
        if differentiable(g):
            # differentiated again (an unreduced input's gradient, a reduced output's
            # cotangent): what the next backward sends back, the same on every member (the
            # seeds of a function computed on every rank), goes on as its parts, else the
            # transposes behind would sum one copy per member; and as a node on every member
            # (zeros made here would be none, and the ranks' backward passes would differ)
            return FirstHolds.apply(g, ctx.first, ctx.parts_back, True), None, None, None
        if ctx.parts_back and not ctx.first:
            g = torch.zeros_like(g)
        return g, None, None, None


def boundary_collective(
    ctx,
    name: str,
    x: torch.Tensor,
    axes: tuple[str, ...],
    params: tuple,
    direction: str = "forward",
    modes: list | None = None,
):
    """Collective ``name`` at the call's boundary, outside the user's function: no type rule,
    the same autodiff as inside. A CommMode records it (and the collective its backward runs)
    as a boundary event, in ``direction``; ``modes``: the CommModes of the forward, for a
    collective run in backward. A pvary's backward psum is not recorded here: the API records
    it on every backend (an output tiled over an axis it is invariant over)."""
    rec = PVARY_RECORD if name == "pvary" else RECORDS[name]
    with torch_private.DisableTorchFunction():
        if differentiable(x):
            out = bridge_apply(rec, ctx, x, axes, params)
        else:
            out = rec.forward(ctx, x, axes, params)
    modes = active() or modes
    if modes and name != "pvary":
        record_boundary(modes, name, x, axes, direction)
        out = tag_derivatives(rec, out, x, axes, params, boundary=True)
    return out


def _shape(x: torch.Tensor) -> tuple[int, ...]:
    return tuple(x.shape)


def record_boundary(modes: list, op: str, x: torch.Tensor, axes: tuple[str, ...], direction: str):
    record_into(modes, CommEvent(op, axes, direction, _shape(x), x.dtype, boundary=True))


def _block(x: torch.Tensor, spec: PartitionSpec, mesh) -> torch.Tensor:
    """This rank's block of the global ``x``."""
    return block(x, spec, mesh._shape, mesh.my_coords)


class ScatterInput(torch.autograd.Function):
    """Global value -> this rank's block; backward gathers the blocks of the gradient, so every
    rank holds the global gradient of the global input (as the simulated backend returns)."""

    @staticmethod
    def forward(x, ctx, spec):
        return _block(x, spec, ctx.mesh)

    @staticmethod
    def setup_context(node, inputs, output):
        node.spmd, node.spec = inputs[1], inputs[2]
        node.modes = active()  # the backward may run on another thread (CUDA)

    @staticmethod
    def backward(node, g):
        return gather_blocks(node.spmd, g, node.spec, "backward", node.modes), None, None

    @staticmethod
    def jvp(node, t, *_):
        return _block(t, node.spec, node.spmd.mesh)

    @staticmethod
    def vmap(info, in_dims, x, ctx, spec):
        """``torch.func.vmap`` over the call: the block of every sample (the batch dim first)."""
        if in_dims[0] is None:
            return ScatterInput.apply(x, ctx, spec), None
        return ScatterInput.apply(x.movedim(in_dims[0], 0), ctx, PartitionSpec(None, *spec)), 0


class TracedFirstHolds(FirstHolds):
    """:class:`FirstHolds` in a call that Dynamo traces: without the forward-mode rule."""

    jvp = staticmethod(torch.autograd.Function.jvp)


class TracedScatterInput(ScatterInput):
    """:class:`ScatterInput` in a call that Dynamo traces: without the forward-mode and vmap
    rules, which Dynamo refuses (``_autodiff.TracedCollectiveFn``)."""

    jvp = staticmethod(torch.autograd.Function.jvp)
    vmap = staticmethod(torch.autograd.Function.vmap)

    @staticmethod
    def backward(node, g):
        return gather_blocks(node.spmd, g, node.spec, "backward", traced=True), None, None


def gather_blocks(
    ctx,
    g: torch.Tensor,
    spec: PartitionSpec,
    direction: str,
    modes: list | None = None,
    traced: bool = False,
) -> torch.Tensor:
    """The global value of which every rank holds its block ``g`` under ``spec``: one all_gather
    (recorded as a boundary event in ``direction``). Differentiated again (double backward, a
    transform), it is the all_gather collective, whose transpose takes the own block back
    without communication. ``traced``: in a backward Dynamo traces, the graph's all_gather
    (``ctx``'s primitive), neither recorded nor differentiable (a compiled backward is not
    differentiated again)."""
    mesh = ctx.mesh
    if mesh.single_axes.issuperset(spec.axes):  # blocks of size-1 axes are the whole
        return g
    if traced:
        stacked = ctx.all_gather(g, spec.axes)
    elif differentiable(g) or torch_private.graph_traced():  # (the graph's own op)
        stacked = boundary_collective(
            ctx, "all_gather", g, spec.axes, (0, False, "invariant"), direction, modes
        )
    else:
        modes = active() or modes
        if modes:
            record_boundary(modes, "all_gather", g, spec.axes, direction)
        stacked = mesh.comm(spec.axes).all_gather(g, "gradient of a plain input")
    return assemble(stacked, spec, mesh._shape)


_scatter_input = _fast(ScatterInput)
