"""The boundary of a call on a real mesh: global values (or DTensors) in, DTensors out.

* A ``DTensor`` input gives its local shard; its placements must be what the in_spec says.
* A plain tensor input is the global value, present on every rank; this rank takes its block,
  and the backward gathers the blocks of the gradient so that every rank holds the global one.
* Outputs become DTensors with placements from out_specs.
* A tuple entry in non-mesh order (``P(('tp', 'dp'))`` on a ``('dp', 'tp')`` mesh) has no DTensor
  placement: one ppermute moves the blocks between the spec's order and DTensor's mesh order.

DTensor's own ``to_local`` / ``from_local`` rebuild a ``DTensorSpec`` (a dataclass with checks)
for every tensor, forward and backward, which costs tens of microseconds per tensor: a sizeable
part of a small training step. :class:`_LocalOf` and :class:`_DTensorOf` do the same conversions
with one spec per (placements, shape, stride, dtype) per mesh, made once, and fall back to the
public methods wherever the fast path does not apply.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Sequence

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
from torch.distributed.tensor._utils import compute_global_tensor_info

from .._errors import SpecError
from .._spec import PartitionSpec
from . import _dist_autograd as ops

_no_torch_function = torch._C.DisableTorchFunction


def placements(mesh, spec: PartitionSpec, rank: int) -> tuple:
    """DTensor placements of ``spec`` on ``mesh`` (cached per mesh)."""
    key = (spec, rank)
    hit = mesh.placements_cache.get(key)
    if hit is None:
        out = [Replicate() for _ in mesh.axis_names]
        for d in range(rank):
            for a in spec.entry_axes(d):
                out[mesh.axis_names.index(a)] = Shard(d)
        hit = mesh.placements_cache[key] = tuple(out)
    return hit


# --- fast DTensor conversions --------------------------------------------------------------------


def _spec_for(mesh, local: torch.Tensor, places: tuple) -> DTensorSpec:
    key = (places, tuple(local.shape), local.stride(), local.dtype)
    spec = mesh.dtensor_specs.get(key)
    if spec is None:
        shape, stride = compute_global_tensor_info(local, mesh.device_mesh, list(places))
        meta = TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
        spec = mesh.dtensor_specs[key] = DTensorSpec(mesh.device_mesh, places, tensor_meta=meta)
    return copy.copy(spec)  # DTensor ops may annotate their spec: never share one


def _wrap(mesh, local: torch.Tensor, places: tuple, requires_grad: bool = False) -> DTensor:
    return DTensor(local, _spec_for(mesh, local, places), requires_grad=requires_grad)


class _LocalOf(torch.autograd.Function):
    """``dtensor.to_local()``; backward wraps the gradient with a cached spec."""

    @staticmethod
    def forward(d, mesh):
        local = d._local_tensor
        return local.view_as(local)  # a fresh tensor object: autograd metadata goes on it

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.places = inputs[1], tuple(inputs[0].placements)
        ctx.leaf = inputs[0] if inputs[0].is_leaf else None

    @staticmethod
    def backward(ctx, g):
        g = ops.settled(g)
        if ctx.leaf is not None:  # its .grad may hold the pending wrapper: plain once reduced
            ops.when_reduced(g, lambda leaf=ctx.leaf, mesh=ctx.mesh: _plain_local_grad(leaf, mesh))
        return _wrap(ctx.mesh, g, ctx.places), None


class _DTensorOf(torch.autograd.Function):
    """``DTensor.from_local(local, ..., run_check=False)`` with a cached spec; backward takes
    the gradient's local tensor (redistributed first if its placements differ)."""

    @staticmethod
    def forward(local, mesh, places):
        return _wrap(mesh, local.view_as(local), places, local.requires_grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.places = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        if isinstance(g, DTensor):
            if tuple(g.placements) != ctx.places:
                g = g.redistribute(ctx.mesh.device_mesh, ctx.places)
            g = g._local_tensor
        return g, None, None


def _plain_local_grad(leaf: DTensor, mesh) -> None:
    """The DTensor form of :func:`_dist_autograd.plain_grad`."""
    grad = leaf.grad
    if isinstance(grad, DTensor) and ops.is_pending_wrapper(grad._local_tensor):
        leaf.grad = _wrap(mesh, grad._local_tensor.elem, tuple(grad.placements))


for _cls in (_LocalOf, _DTensorOf):
    ops._fast_apply(_cls)


def to_local_fast(mesh, d: DTensor) -> torch.Tensor:
    if ops._transforms_active():  # torch.func around the call: DTensor's own path
        return d.to_local()
    if not ops._differentiable(d):
        return d._local_tensor.view_as(d._local_tensor)
    return ops._apply(_LocalOf, d, mesh)


def _from_local(mesh, local: torch.Tensor, places: tuple) -> DTensor:
    if ops._transforms_active():
        return DTensor.from_local(local, mesh.device_mesh, places, run_check=False)
    if not ops._differentiable(local):
        return _wrap(mesh, local.view_as(local), places)
    return ops._apply(_DTensorOf, local, mesh, places)


# --- inputs --------------------------------------------------------------------------------------


def local_input(mesh, leaf: torch.Tensor, spec: PartitionSpec, fn_label: str, i: int):
    """This rank's block of argument leaf ``i``."""
    if isinstance(leaf, DTensor):
        return _from_dtensor(mesh, leaf, spec, fn_label, i)
    if leaf.device.type != mesh.device.type:
        leaf = leaf.to(mesh.device)
    if not spec.axes:
        return leaf
    if ops._differentiable(leaf):
        return ops._apply(_ScatterInput, leaf, mesh, spec)
    return _block(leaf, spec, mesh)


def _from_dtensor(mesh, leaf: DTensor, spec: PartitionSpec, fn_label: str, i: int):
    where = f"spmd_map of {fn_label}: argument leaf {i}"
    theirs = leaf.device_mesh
    if theirs is not mesh.device_mesh and (
        tuple(theirs.mesh_dim_names or ()) != mesh.axis_names
        or not torch.equal(theirs.mesh.cpu(), mesh.grid)
    ):
        raise SpecError(
            f"{where} is a DTensor on DeviceMesh {theirs.mesh.tolist()} with dims "
            f"{theirs.mesh_dim_names}, not on the mapped mesh {mesh.grid.tolist()} "
            f"{mesh.axis_names}. Fix: create it on the same mesh (mesh.device_mesh), or pass "
            "a plain tensor holding the global value."
        )
    want = placements(mesh, spec, leaf.dim())
    if tuple(leaf.placements) != want:
        raise SpecError(
            f"{where} is a DTensor with placements {tuple(leaf.placements)}, but its in_spec "
            f"{spec!r} on mesh axes {mesh.axis_names} means placements {want}. Fix: "
            f"x.redistribute(mesh.device_mesh, {list(want)}), or change the in_spec."
        )
    local = to_local_fast(mesh, leaf)
    for axes in _non_mesh_order_entries(mesh, spec):
        ordered = _in_mesh_order(mesh, axes)
        local = ops.ppermute(local, mesh.comm(ordered), _relayout_pairs(mesh, axes))
    return local


def _block(x: torch.Tensor, spec: PartitionSpec, mesh) -> torch.Tensor:
    """This rank's block of the global ``x``."""
    for d in range(x.dim()):
        axes = spec.entry_axes(d)
        if axes:
            size = x.shape[d] // mesh.axis_size(axes)
            x = x.narrow(d, mesh.index_of(axes, mesh.my_coords) * size, size)
    return x


def _assemble(stacked: torch.Tensor, spec: PartitionSpec, mesh) -> torch.Tensor:
    """[n, *block] (blocks row-major over spec.axes) -> the global tensor."""
    local = stacked.shape[1:]
    split = [d for d in range(len(local)) if spec.entry_axes(d)]
    counts = [mesh.axis_size(spec.entry_axes(d)) for d in split]
    x = stacked.reshape(*counts, *local)
    perm, sizes = [], []
    for d in range(len(local)):
        if d in split:
            perm.append(split.index(d))
            sizes.append(counts[split.index(d)] * local[d])
        else:
            sizes.append(local[d])
        perm.append(len(split) + d)
    return x.permute(*perm).reshape(sizes)


class _ScatterInput(torch.autograd.Function):
    """Global value -> this rank's block; backward gathers the blocks of the gradient, so every
    rank holds the global gradient of the global input (as the simulated backend returns)."""

    @staticmethod
    def forward(x, mesh, spec):
        return _block(x, spec, mesh)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.spec = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        stacked = ctx.mesh.comm(ctx.spec.axes).all_gather(g, "gradient of a plain input")
        return _assemble(stacked, ctx.spec, ctx.mesh), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _block(t, ctx.spec, ctx.mesh)


ops._fast_apply(_ScatterInput)


# --- outputs -------------------------------------------------------------------------------------


def _in_mesh_order(mesh, axes: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a in axes)


def _non_mesh_order_entries(mesh, spec: PartitionSpec) -> list[tuple[str, ...]]:
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


def global_output(mesh, y: torch.Tensor, spec: PartitionSpec, vma) -> DTensor:
    """The DTensor of output ``y`` (vma ``vma``) under ``spec``."""
    names = mesh.axis_names
    unnamed_varying = tuple(a for a in names if a in vma and a not in spec.axes)
    named_invariant = tuple(a for a in names if a in spec.axes and a not in vma)
    with _no_torch_function():
        if unnamed_varying:  # check_vma=False: member 0's value, as the simulated backend
            y = ops.broadcast(y, mesh.comm(unnamed_varying))
        if named_invariant:  # identical blocks tiled: their cotangents differ and must be summed
            y = ops.pvary(y, mesh.comm(named_invariant))
        for axes in _non_mesh_order_entries(mesh, spec):
            pairs = tuple((d, s) for s, d in _relayout_pairs(mesh, axes))
            y = ops.ppermute(y, mesh.comm(_in_mesh_order(mesh, axes)), pairs)
        return _from_local(mesh, y, placements(mesh, spec, y.dim()))
