"""The boundary of a call on a real mesh: global values (or DTensors) in, DTensors out.

* A ``DTensor`` input gives its local shard; its placements must be what the in_spec says.
* A plain tensor input is the global value, present on every rank; this rank takes its block,
  and the backward gathers the blocks of the gradient so that every rank holds the global one
  (``_dist_plain``, which the compile path shares).
* Outputs become DTensors with placements from out_specs; under a ``torch.func`` transform (whose
  wrappers cannot carry a DTensor) or while ``make_fx`` traces (whose graph cannot build one) they
  are plain tensors holding the global value instead, and a traced call takes no DTensor.
* A call of ``SpmdFunction.local`` takes this rank's blocks as they are (:func:`block_input`) and
  returns its blocks as plain tensors (:func:`local_output`): no DTensor, gather or scatter.
* A tuple entry in non-mesh order (``P(('tp', 'dp'))`` on a ``('dp', 'tp')`` mesh) has no DTensor
  placement: one ppermute moves the blocks between the spec's order and DTensor's mesh order.

The DTensor conversions themselves (placements, the cached-spec ``to_local`` / ``from_local``) are
``_dist_dtensor``. Every conversion is differentiable as many times as asked: with
``create_graph=True`` (or under a transform) the backwards go through the collectives' bridge
instead of the raw communication.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection
from typing import Any, TypeGuard

import torch
from torch.autograd import forward_ad
from torch.distributed.tensor import DTensor

from .. import _torch_private as torch_private
from .._errors import SpecError
from .._spec import PartitionSpec, output_settles
from .._types import Vma
from ._dist_dtensor import (
    _from_local,
    grad_placements,
    placements,
    to_local_fast,
    to_locals_fast,
)
from ._dist_plain import boundary_collective, first_holds, gather_blocks, plain_input

# --- inputs --------------------------------------------------------------------------------------


def inputs(
    ctx,
    leaves: list[Any],
    specs: list[PartitionSpec],
    is_block: bool,
    converted: tuple[int, ...] | None,
    uneven_input: Callable,
    memo: dict | None = None,
) -> list[Any]:
    """The call's local leaves, typed (a replay on one rank needs no types); ``converted``: the
    positions of the only leaves to convert (a replay's, ``Replay.replayed_conversions``: the
    others are handed through as they are); ``is_block``: the leaves are this rank's blocks
    already (``SpmdFunction.local``); ``uneven_input(ctx, leaf, spec, i)``: a leaf's block in
    an uneven call (``_dist_uneven.local_input``, passed in: that module builds on this one,
    which does not import it back). The DTensors of the common case are converted together,
    in one autograd node (:func:`_dtensor_inputs`), the others one by one; every leaf is
    checked in order (an error names the first bad one); ``memo``: the call's ``Call.memo``,
    where the leaves handed through as they are (:func:`_handed_through`) are kept."""
    at = range(len(leaves)) if converted is None else converted
    local = list(leaves)
    batched, grads = [], []
    batching = _batching(ctx, is_block)
    through = _handed_through(ctx, leaves, specs, memo) if batching else ()
    wanted = _wanted(ctx, leaves, specs, memo) if batching else {}
    for i in at:
        leaf = leaves[i]
        if not isinstance(leaf, torch.Tensor) or i in through:
            continue
        if batching and _parameter(leaf):
            batched.append(i)
            grads.append(checked_dtensor(ctx, leaf, specs[i], i, wanted.get(i)))
        elif is_block:
            local[i] = block_input(ctx, leaf, i)
        elif ctx.uneven:
            local[i] = uneven_input(ctx, leaf, specs[i], i)
        else:
            local[i] = local_input(ctx, leaf, specs[i], i)
    if batched:
        made = _dtensor_inputs(
            ctx, [leaves[i] for i in batched], [specs[i] for i in batched], grads
        )
        for i, x in zip(batched, made):
            local[i] = x
    if not ctx.replaying:  # in order: a planned call numbers its inputs
        ctx.stamp_inputs(local, specs, memo)  # (every leaf: ``converted`` is a replay's)
    return local


def refuse_traced_dtensors(label: str, leaves: list[Any]) -> None:
    """A call that ``make_fx`` traces takes plain tensors: its graph records dispatched ops
    only, and a DTensor's local block is read outside them (the graph would keep the traced
    values as constants, and a replay return the traced inputs' outputs)."""
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, DTensor):
            raise SpecError(
                f"spmd_map of {label}: argument leaf {i} (in flattening order) is a DTensor, "
                "but make_fx traces the call, and its graph cannot read a DTensor's local "
                "block: it would keep this trace's values as constants. Fix: trace the local "
                "call, make_fx(f.local), on this rank's blocks (x.to_local()); or pass the "
                "global value as a plain tensor (x.full_tensor()), which the traced call "
                "returns as plain tensors too."
            )


def local_input(ctx, leaf: torch.Tensor, spec: PartitionSpec, i: int):
    """This rank's block of argument leaf ``i`` (``ctx``: the call's DistributedContext)."""
    transformed = torch_private.transforms_active()
    if transformed:
        _under_transform(ctx, leaf, i)
    if isinstance(leaf, DTensor):
        return _from_dtensor(ctx, leaf, spec, i, transformed, None)
    return plain_input(ctx, leaf, spec)


def _whole(mesh, spec: PartitionSpec) -> bool:
    """Whether a plain tensor under ``spec`` is every rank's block as it is: no partial sum,
    split over axes of size 1 only (nothing to gather or scatter)."""
    return not (spec.unreduced or spec.reduced) and mesh.single_axes.issuperset(spec.axes)


def _handed_through(ctx, leaves: list[Any], specs: list[PartitionSpec], memo) -> frozenset[int]:
    """The positions of the plain tensor leaves that are their own block (:func:`local_input`
    hands them through: on the mesh's device type, :func:`_whole`), where no transform is
    active (``_batching``); in ``memo`` (``Call.memo``: its key holds each leaf's type and
    device, its tree structure each spec)."""
    through = None if memo is None else memo.get("handed through")
    if through is None:
        mesh = ctx.mesh
        through = frozenset(
            i
            for i, (x, spec) in enumerate(zip(leaves, specs))
            if isinstance(x, torch.Tensor)
            and not isinstance(x, DTensor)
            and x.device.type == mesh.device.type
            and _whole(mesh, spec)
        )
        if memo is not None:
            memo["handed through"] = through
    return through


def _wanted(ctx, leaves: list[Any], specs: list[PartitionSpec], memo) -> dict[int, tuple]:
    """Position -> the placements its spec means, for each DTensor leaf (what
    :func:`checked_dtensor` compares its own with); in ``memo`` (``Call.memo``: its key holds
    each leaf's type and shape, its tree structure each spec)."""
    wanted = None if memo is None else memo.get("placements")
    if wanted is None:
        wanted = {
            i: placements(ctx.mesh, spec, x.dim())
            for i, (x, spec) in enumerate(zip(leaves, specs))
            if isinstance(x, DTensor)
        }
        if memo is not None:
            memo["placements"] = wanted
    return wanted


def block_input(ctx, leaf: torch.Tensor, i: int) -> torch.Tensor:
    """Argument leaf ``i`` of a local call: this rank's block already, and its gradient this
    rank's block of the global gradient, as for a DTensor's local tensor (a replicated input's:
    the whole gradient; a reduced one's: this rank's partial sum of it, as a DTensor input's
    ``Partial`` gradient)."""
    if isinstance(leaf, DTensor):
        raise SpecError(
            f"spmd_map of {ctx.fn_label}: argument leaf {i} (in flattening order) is a DTensor, "
            "but a local call takes this rank's blocks as plain tensors. Fix: call the function "
            "itself (f(...)), which takes DTensors; or hold the blocks as plain tensors "
            "(ns.shard(tree, mesh, specs, blocks=True) makes them). A DTensor's to_local() is "
            "its block in the mesh's axis order, which differs from the spec's for a tuple "
            "entry such as P(('tp', 'dp')) on a ('dp', 'tp') mesh."
        )
    if torch_private.transforms_active():
        _under_transform(ctx, leaf, i)
    return leaf if leaf.device.type == ctx.mesh.device.type else leaf.to(ctx.mesh.device)


def _under_transform(ctx, leaf: torch.Tensor, i: int) -> None:
    """A call under a torch.func transform: refuse a DTensor the transform wraps."""
    inner = torch_private.innermost(leaf)
    if inner is not leaf and isinstance(inner, DTensor):
        raise SpecError(
            f"spmd_map of {ctx.fn_label}: argument leaf {i} is a DTensor that a torch.func "
            "transform wraps; functorch's wrappers cannot carry DTensors (they hide its "
            "placements and mix it with plain tensors). Fix: pass the global value as a plain "
            "tensor (x.full_tensor()) to the transformed function; under the transform the "
            "call returns plain global tensors too. A DTensor closed over (not transformed) "
            "works."
        )


def _from_dtensor(
    ctx, leaf: DTensor, spec: PartitionSpec, i: int, transformed: bool, uneven_local: Any
):
    """``leaf``'s local block, checked against ``spec``; ``uneven_local(mesh, leaf, grads)``:
    the conversion of a DTensor whose blocks differ in size (``_dist_uneven``), or None."""
    mesh = ctx.mesh
    grads = checked_dtensor(ctx, leaf, spec, i, None)
    if uneven_local is not None:
        local = uneven_local(mesh, leaf, grads)
    else:
        local = to_local_fast(mesh, leaf, grads, transformed)
    return in_spec_order(ctx, local, spec)


def _batching(ctx, is_block: bool) -> bool:
    """Whether the call's parameters (:func:`_parameter`) take one autograd node
    (:func:`_dtensor_inputs`): an even call under grad mode, with no transform and no
    forward-mode AD active. Decided once per call."""
    return (
        not is_block
        and not ctx.uneven
        and torch.is_grad_enabled()
        and not torch_private.transforms_active()
        and torch_private.forward_level() < 0
    )


def _parameter(leaf: torch.Tensor) -> TypeGuard[DTensor]:
    """Whether argument leaf ``leaf`` is a leaf DTensor that requires grad, whose local tensor
    :func:`_dtensor_inputs` takes with the call's others. Not an activation: a gradient asked
    for it alone (``torch.autograd.grad(loss, [h])``) would run the node, and so every
    parameter's backward and gradient psum."""
    return isinstance(leaf, DTensor) and leaf.requires_grad and leaf.is_leaf


def _dtensor_inputs(ctx, leaves: list[DTensor], specs: list[PartitionSpec], grads: list):
    """The local blocks of ``leaves`` (each :func:`_parameter`, checked against its spec:
    ``grads``, its gradient placements), converted together."""
    locals_ = to_locals_fast(ctx.mesh, leaves, grads)
    return [in_spec_order(ctx, x, spec) for x, spec in zip(locals_, specs)]


def checked_dtensor(ctx, leaf: DTensor, spec: PartitionSpec, i: int, want: tuple | None) -> tuple:
    """Check that DTensor argument leaf ``i`` is laid out as ``spec`` says on the call's mesh;
    the placements of its gradient: its own, but a partial sum's (reduced or unreduced axes).
    ``want``: the placements ``spec`` means for it, where known (:func:`_wanted`; else None)."""
    mesh = ctx.mesh
    theirs = leaf.device_mesh
    if theirs is not mesh.device_mesh and not _same_grid(theirs, mesh):
        where = f"spmd_map of {ctx.fn_label}: argument leaf {i}"
        raise SpecError(
            f"{where} is a DTensor on DeviceMesh {theirs.mesh.tolist()} with dims "
            f"{theirs.mesh_dim_names}, not on the mapped mesh {mesh.grid.tolist()} "
            f"{mesh.axis_names}. Fix: create it on the same mesh (mesh.device_mesh), or pass "
            "a plain tensor holding the global value."
        )
    if want is None:
        want = placements(mesh, spec, leaf.dim())
    if tuple(leaf.placements) != want:
        where = f"spmd_map of {ctx.fn_label}: argument leaf {i}"
        raise SpecError(
            f"{where} is a DTensor with placements {tuple(leaf.placements)}, but its in_spec "
            f"{spec!r} on mesh axes {mesh.axis_names} means placements {want}. Fix: "
            f"x.redistribute(mesh.device_mesh, {list(want)}), or change the in_spec."
        )
    return grad_placements(mesh, spec, leaf.dim()) if spec.reduced or spec.unreduced else want


@torch_private.trace_constant  # (read at trace time: a DeviceMesh's grid is a tensor)
def _same_grid(theirs, mesh) -> bool:
    """Whether DeviceMesh ``theirs`` has the mapped mesh's axis names and grid."""
    names = tuple(theirs.mesh_dim_names or ())
    return names == mesh.axis_names and torch.equal(theirs.mesh.cpu(), mesh.grid)


def in_spec_order(ctx, local: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    """A DTensor's local block ``local`` with its blocks in ``spec``'s order: a tuple entry
    in non-mesh order moves them (one ppermute)."""
    mesh = ctx.mesh
    for axes in _non_mesh_order_entries(mesh, spec):
        ordered = _in_mesh_order(mesh, axes)
        local = boundary_collective(ctx, "ppermute", local, ordered, (_relayout_pairs(mesh, axes),))
    return local


# --- outputs -------------------------------------------------------------------------------------


def _in_mesh_order(mesh, axes: Collection[str]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a in axes)


def _non_mesh_order_entries(mesh, spec: PartitionSpec) -> list[tuple[str, ...]]:
    if len(spec.axes) < 2:  # (the common case: no entry names several axes)
        return []
    entries = [spec.entry_axes(d) for d in range(len(spec))]
    return [e for e in entries if len(e) > 1 and e != _in_mesh_order(mesh, e)]


def _relayout_pairs(mesh, axes: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """Pairs (in the mesh-order group of ``axes``) that move block ``b`` from the rank whose
    mesh-order index is ``b`` (DTensor's layout) to the rank whose ``axes``-order index is ``b``."""
    ordered = _in_mesh_order(mesh, axes)
    pairs = []
    for combo in itertools.product(*(range(mesh.shape[a]) for a in ordered)):
        coords = dict(zip(ordered, combo))
        pairs.append((mesh.index_of(axes, coords), mesh.index_of(ordered, coords)))
    return tuple(pairs)


def _has_tangent(y: torch.Tensor) -> bool:
    """Whether ``y`` carries a forward-mode tangent."""
    return torch_private.forward_level() >= 0 and forward_ad.unpack_dual(y).tangent is not None


def global_output(ctx, y: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    """The DTensor of output ``y`` under ``spec`` (``ctx``: the call's DistributedContext), or
    its global value as a plain tensor under a transform, while ``make_fx`` traces, or with a
    forward-mode tangent."""
    mesh = ctx.mesh
    y = local_output(ctx, y, spec)
    # (Dynamo guards the forward-mode level itself, and refuses a tangent: not read there)
    if (
        torch_private.transforms_active()
        or torch_private.graph_traced()
        or (not torch.compiler.is_compiling() and _has_tangent(y))
    ):
        # a functorch wrapper hides a DTensor's methods, a DTensor cannot carry a forward-mode
        # tangent (torch has no DTensor rule for forward AD), and make_fx's graph cannot make one
        # (a DTensor built outside its dispatched ops is a constant of the graph: a replay would
        # return the traced inputs' output): the global value, as a plain tensor (an unreduced
        # output's: the sum of the parts, as the simulated mesh returns it)
        parts = tuple(a for a in _in_mesh_order(mesh, spec.unreduced) if a not in mesh.single_axes)
        if parts:
            y = boundary_collective(ctx, "psum", y, parts, ())
        with torch_private.DisableTorchFunction():
            return gather_blocks(ctx, y, spec, "forward")
    for axes in _non_mesh_order_entries(mesh, spec):
        pairs = tuple((d, s) for s, d in _relayout_pairs(mesh, axes))
        y = boundary_collective(ctx, "ppermute", y, _in_mesh_order(mesh, axes), (pairs,))
    with torch_private.DisableTorchFunction():
        return _from_local(mesh, y, placements(mesh, spec, y.dim()))


def local_output(ctx, y: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    """This rank's block of output ``y`` under ``spec``, a plain tensor: ``y`` itself, where the
    type agrees with the spec; settled where it does not (see below)."""
    mesh = ctx.mesh
    if mesh.size == 1:  # every axis has size 1: one instance, nothing to settle
        return y
    vma: Vma = ctx.vma(y)
    unkept, copies = output_settles(vma, spec, mesh.axis_names, mesh.single_axes)
    if unkept:  # check_vma=False: member 0's value, as the simulated backend (a broadcast:
        # bit for bit, of any dtype; a masked psum would turn -0.0 into 0.0)
        y = boundary_collective(ctx, "pbroadcast", y, unkept, (0,))
    reduced = tuple(a for a in mesh.axis_names if a in vma.reduced and a not in mesh.single_axes)
    if reduced:  # a reduced value's cotangent is unreduced: parts of the global cotangent
        y = first_holds(y, mesh, reduced, False, True)
    if copies:  # identical blocks tiled (or parts summed): their cotangents must be summed
        y = boundary_collective(ctx, "pvary", y, copies, ())
    return y
