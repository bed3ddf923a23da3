"""``ns.shard`` on a real mesh: global tensors (or DTensors) -> DTensors with the placements that
the call boundary (``_dist_dtensor.placements``) gives the same spec.

A tuple entry in mesh order (``P(('dp', 'tp'))`` on a ``('dp', 'tp')`` mesh) is DTensor's own
``[Shard(d), Shard(d)]``: public placements, read left to right, first mesh dim major. A tuple
entry in another order (``P(('tp', 'dp'))``) gets the same placements, the layout a call's output
with that out_spec has; a call with that in_spec relays the blocks by one ppermute at its boundary
(``_dist_io``). Its global value, ``full_tensor()`` and checkpoints are those of the spec.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from .._errors import SpecError
from .._layout import global_shape
from .._spec import PartitionSpec
from ._dist_dtensor import placements
from ._dist_io import _in_mesh_order, _non_mesh_order_entries, _relayout_pairs


def shard_leaves(
    mesh,
    leaves: list[Any],
    specs: list[PartitionSpec],
    where: list[str],
    local: bool,
    blocks: bool = False,
) -> list:
    """Every tensor leaf as a new leaf DTensor laid out by its spec (``blocks``: as this rank's
    block under the spec, a plain tensor); other leaves as they are. ``local``: the leaves are
    this rank's blocks, not global values, that :func:`check_equal_blocks` passed."""
    one = _from_block if local else _shard_one
    out = [
        one(mesh, x, spec, at) if isinstance(x, torch.Tensor) else x
        for x, spec, at in zip(leaves, specs, where)
    ]
    if blocks:
        out = [_own_block(mesh, d, s) if isinstance(d, DTensor) else d for d, s in zip(out, specs)]
    return out


def check_equal_blocks(
    mesh, leaves: list[Any], where: list[str], layout: str, refused: bool
) -> None:
    """``local=True``: every rank passes a tree of one structure under the same specs
    (``layout``: their text, without addresses), blocks of the same shapes (the global shape
    is read off this rank's block) and dtypes (the DTensor's, whose collectives size their
    buffers by it), DTensors (refused) at the same places, and the checks of the tree and
    specs (``refused``: they found a problem) agree. One all-reduce of a digest of all, on every rank before any raises: where
    they differ, a SpecError on every rank, not an abort in a later collective that sizes them
    differently nor a peer left waiting here for a rank that raised; where they agree, the
    checks (deterministic in the structure, specs and shapes) raise the same error on every
    rank or on none."""
    blocks = {
        at: f"{str(x.dtype).removeprefix('torch.')}{list(x.shape)}"
        + (" (a DTensor)" if isinstance(x, DTensor) else "")  # (refused: _from_block)
        for x, at in zip(leaves, where)
        if isinstance(x, torch.Tensor)
    }
    comm = mesh.check_comm()
    digest = zlib.crc32(repr([layout, blocks, refused]).encode())
    if not comm.agreed(comm.start_agree(digest, "ns.shard"), "ns.shard"):
        raise SpecError(
            "ns.shard(..., local=True): the ranks passed blocks of different shapes or dtypes "
            f"(this rank's: {blocks}), trees or specs that differ ({layout}), or specs that "
            "fit the blocks on some ranks only; the global shape is read off each rank's "
            "block, so every rank passes one of the same shape and dtype in the same tree "
            "under the same specs. Fix: cast the blocks to one dtype and pad a dim its axes "
            "do not divide to a multiple of their size on every rank, or pass the global "
            "tensors without local=True (a dim the axes do not divide is then split as "
            "torch.chunk splits it)."
        )


def _own_block(mesh, d: DTensor, spec: PartitionSpec) -> torch.Tensor:
    """This rank's block of ``d`` under ``spec``, a new plain leaf (``d``'s requires_grad, an
    ``nn.Parameter`` if it is one). A tuple entry in another order than the mesh's: DTensor
    holds the mesh order's block here, so one permute brings the spec's (the input boundary's
    relayout; a partial sum stays this rank's part)."""
    value = d.to_local().detach().clone(memory_format=torch.contiguous_format)
    for axes in _non_mesh_order_entries(mesh, spec):
        pairs = _relayout_pairs(mesh, axes)
        value = mesh.comm(_in_mesh_order(mesh, axes)).permute(value, pairs, "ns.shard")
    return _new_leaf(value, d)


def _shard_one(mesh, x: torch.Tensor, spec: PartitionSpec, where: str) -> torch.Tensor:
    places = placements(mesh, spec, x.dim())
    if isinstance(x, DTensor):
        d = _on_mesh(mesh, x, where).redistribute(mesh.device_mesh, places).detach().clone()
    else:
        # distribute_tensor broadcasts a replicated dim *into* its argument on the other ranks:
        # a clone, so the caller's tensor is never overwritten
        d = distribute_tensor(x.detach().clone(), mesh.device_mesh, places)
    return _new_leaf(d, x)


def _from_block(mesh, x: torch.Tensor, spec: PartitionSpec, where: str) -> torch.Tensor:
    """This rank's block -> the DTensor. A tuple entry in another order than the mesh's holds
    the spec's block here but DTensor's layout wants the mesh order's: one permute moves it, as
    the call boundary does for an output."""
    if isinstance(x, DTensor):
        raise SpecError(
            f"ns.shard(..., local=True): {where} is a DTensor, not this rank's block. Fix: "
            "pass it without local=True (it is laid out anew), or pass x.to_local()."
        )
    block = x.detach().to(mesh.device).clone(memory_format=torch.contiguous_format)
    for axes in _non_mesh_order_entries(mesh, spec):
        pairs = tuple((d, s) for s, d in _relayout_pairs(mesh, axes))
        block = mesh.comm(_in_mesh_order(mesh, axes)).permute(block, pairs, "ns.shard")
    shape = global_shape(block.shape, spec, mesh.shape)
    d = DTensor.from_local(
        block,
        mesh.device_mesh,
        placements(mesh, spec, block.dim()),
        shape=torch.Size(shape),
        stride=torch.empty(shape, device="meta").stride(),
    )
    return _new_leaf(d, x)


def _new_leaf(d: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """``d`` with ``x``'s ``requires_grad``, as an ``nn.Parameter`` if ``x`` is one."""
    d.requires_grad_(x.requires_grad)
    if isinstance(x, torch.nn.Parameter):
        return torch.nn.Parameter(d, requires_grad=x.requires_grad)
    return d


def _on_mesh(mesh, x: DTensor, where: str) -> DTensor:
    """``x`` on the mesh's own DeviceMesh (``redistribute`` stays on one DeviceMesh object)."""
    theirs = x.device_mesh
    if theirs is mesh.device_mesh:
        return x
    if tuple(theirs.mesh_dim_names or ()) == mesh.axis_names and torch.equal(
        theirs.mesh.cpu(), mesh.grid
    ):  # the same ranks and names: the same layout
        return DTensor.from_local(
            x.to_local(), mesh.device_mesh, x.placements, shape=x.shape, stride=x.stride()
        )
    raise SpecError(
        f"ns.shard: {where} is a DTensor on DeviceMesh {theirs.mesh.tolist()} with dims "
        f"{theirs.mesh_dim_names}, not on the mesh {mesh.grid.tolist()} {mesh.axis_names}. "
        "Fix: pass its global value (x.full_tensor()) instead."
    )
