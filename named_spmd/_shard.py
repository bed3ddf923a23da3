"""``ns.shard`` and ``ns.unshard``: a pytree of global tensors laid out on a mesh by specs, and back.

The layout ``shard`` gives a leaf is exactly the one ``spmd_map`` returns for an output with that
spec (docs/design.md, "Sharding a pytree"): a DTensor on a real mesh, the global tensor itself on
a simulated one (where one process holds every instance and calls take global values anyway).
So a sharded tree passes straight into a call whose in_specs are the same specs, and a call's
outputs are already what ``shard`` would make of their global values.
"""

from __future__ import annotations

import sys
from typing import Any, cast

import optree
import torch

from ._api import as_mesh
from ._errors import SpecError, SpmdError, bullet_list
from ._layout import block_global_shape, dim_sizes, dtensor_holds
from ._spec import PartitionSpec, spec_problems
from ._tree import (
    _first_mismatch,
    broadcast_specs,
    check_spec_types,
    flatten_with_paths,
    path_text,
    unflatten,
    without_addresses,
)


def shard(tree: Any, mesh: Any, specs: Any, *, local: bool = False, blocks: bool = False) -> Any:
    """Lay out every tensor of ``tree`` on ``mesh`` as ``specs`` say (``jax.device_put`` with a
    ``NamedSharding``).

    Args:
        tree: a pytree whose tensor leaves are global values (as ``spmd_map`` takes them), or
            DTensors on the same mesh (laid out anew: ``redistribute``).
        mesh: a :class:`Mesh` or a ``DeviceMesh`` with ``mesh_dim_names``.
        specs: a pytree prefix of ``tree`` of ``P(...)`` (the grammar of ``in_specs``, tuple
            entries such as ``P(('dp', 'tp'))`` included; ``None`` means ``P()``). A dim its
            axes do not divide is split as ``torch.chunk`` splits it (``spmd_map``'s uneven
            blocks, DTensor's ``Shard``: 10 rows over 4 are 3, 3, 3, 1) where it is split over
            one axis of more than one member; over several (in mesh order), where DTensor's
            split, over one mesh dim after another, gives the same blocks (7 rows over 2 x 2:
            2, 2, 2, 1), else no DTensor holds them (10 rows: 3, 2, 3, 2 against 3, 3, 3, 1): a
            ``SpecError``, on every mesh.
        local: the tensor leaves are this process's blocks (the block its spec gives this
            rank's mesh coordinates: data each rank loaded itself), not global values, of equal
            shapes and dtypes on every rank (else a ``SpecError`` on every rank). A real mesh
            only: one process of a simulated mesh holds every instance, so there it is an
            ``SpmdError`` (pass the global tensors).
        blocks: return this process's blocks as plain tensors (what ``SpmdFunction.local``
            takes; no DTensor, so an optimizer steps plain tensors) instead of DTensors. On a
            simulated mesh the process holds every instance: its blocks are the global values,
            the copies made without it. A dim its axes do not divide is a ``SpecError`` here,
            on every mesh: a local call takes equal blocks.

    Returns:
        The same structure with every tensor leaf replaced by a new leaf tensor holding its own
        data, with the leaf's ``requires_grad`` (an ``nn.Parameter`` stays one); other leaves
        pass through. On a real mesh each is a ``DTensor`` with the placements ``spmd_map`` uses
        for that spec (rank 0's values are scattered, as ``distribute_tensor`` does, so ranks
        that initialised differently still agree). On a simulated mesh each is a copy of the
        global tensor: the value a call's output with that out_spec has there.

    It makes new leaves (parameters to train), it is not a differentiable op: inside a
    differentiated computation pass global tensors or DTensors to ``spmd_map`` directly.

    Example:
        >>> import torch, named_spmd as ns
        >>> from named_spmd import P
        >>> mesh = ns.make_mesh((2, 2), ("dp", "tp"))
        >>> params = {"w": torch.ones(4, 8), "b": torch.zeros(8)}
        >>> sharded = ns.shard(params, mesh, {"w": P(None, "tp"), "b": P()})
        >>> torch.equal(ns.unshard(sharded)["w"], params["w"])
        True
    """
    where = "ns.shard"
    mesh = as_mesh(mesh, where)
    paths, leaves, treedef = flatten_with_paths(tree)
    wheres = [f"tree{path_text(p)}" for p in paths]
    agreed = local and mesh.kind != "simulated"  # (the ranks' trees and blocks are their own)
    try:
        leaf_specs = _specs_for(specs, tree, where)
    except SpecError:
        if agreed:  # raised on every rank alike, or the ranks' trees or specs differ
            _check_equal_blocks(mesh, treedef, specs, leaves, wheres, True)
        raise
    problems = []
    for path, leaf, spec in zip(paths, leaves, leaf_specs):
        at = f"tree{path_text(path)}"
        if isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            if local:  # (equal blocks on every rank: a block's shape gives the global one)
                shape = block_global_shape(shape, spec, mesh.shape)
            problems += spec_problems(spec, shape, mesh.shape, at, uneven=True, given=False)
            problems += _dtensor_problems(spec, shape, mesh.shape, at)
            if blocks:
                problems += _unequal_block_problems(spec, shape, mesh.shape, at)
        elif spec.axes:
            problems.append(
                f"{at} is a {type(leaf).__name__}, not a tensor, but its spec {spec!r} splits "
                "it. Fix: give it P() (or None)."
            )
    if agreed:
        # before raising: a spec problem one rank alone sees would leave its peers in this
        # agreement, paired with that rank's next collective
        _check_equal_blocks(mesh, treedef, specs, leaves, wheres, bool(problems))
    if problems:
        raise SpecError(
            f"{where}: the tree does not fit specs on mesh {mesh.shape}:\n" + bullet_list(problems)
        )
    if mesh.kind == "simulated":
        if local:
            raise SpmdError(
                f"{where}(..., local=True): {mesh!r} is simulated: this one process holds every "
                "instance, so it has no blocks of its own. Fix: pass the global tensors (without "
                "local=True); local=True is for a real mesh, where each rank holds its block."
            )
        out = [_copy(x) if isinstance(x, torch.Tensor) else x for x in leaves]
    else:
        from .backends._dist_shard import shard_leaves  # loaded only for a real mesh

        out = shard_leaves(mesh, leaves, leaf_specs, wheres, local, blocks)
    return unflatten(treedef, out)


def _check_equal_blocks(
    mesh, treedef: Any, specs: Any, leaves: list, wheres: list[str], refused: bool
) -> None:
    """``local=True`` on a real mesh: the ranks agree on their trees' structure, their specs
    and their blocks (``_dist_shard.check_equal_blocks``), before any raises."""
    from .backends._dist_shard import check_equal_blocks  # loaded only for a real mesh

    text = without_addresses(f"{treedef} {specs!r}")
    check_equal_blocks(mesh, leaves, wheres, text, refused)


def _chunked_dims(spec: PartitionSpec, shape: tuple, sizes: dict):
    """Per dim that named mesh axes split as torch.chunk does (no ``Blocks`` entry): the dim,
    its axes and its blocks' sizes in member order."""
    for d in range(min(len(spec), len(shape))):
        axes = spec.entry_axes(d)
        if axes and spec.entry_sizes(d) is None and set(axes) <= sizes.keys():
            yield d, axes, dim_sizes(spec, d, shape[d], sizes)


def _dtensor_problems(spec: PartitionSpec, shape: tuple, sizes: dict, at: str) -> list[str]:
    """The dims whose blocks (torch.chunk's, where the axes do not divide the dim: spmd_map's
    uneven blocks) no DTensor holds (:func:`dtensor_holds`). (A
    ``Blocks`` entry or an unknown axis: ``spec_problems``.)"""
    problems = []
    for d, axes, blocks in _chunked_dims(spec, shape, sizes):
        if dtensor_holds(spec, [None] * d + [blocks], sizes):
            continue
        problems.append(
            f"{at}: dim {d} has size {shape[d]}, which {axes} ({len(blocks)} members) do not "
            f"divide: spmd_map splits it as torch.chunk does, into blocks of {blocks}, but a "
            "DTensor splits a dim over one mesh dim after another, so no DTensor holds these "
            "blocks (a call's output under this spec is the global value, a plain tensor). "
            f"Fix: split dim {d} over one axis, "
            f"pad it to a multiple of {len(blocks)}, or pass the global tensor to spmd_map "
            "directly (a call splits it itself)."
        )
    return problems


def _unequal_block_problems(spec: PartitionSpec, shape: tuple, sizes: dict, at: str) -> list:
    """``blocks=True``: the dims whose blocks differ in size (axes that do not divide them).
    A local call (``SpmdFunction.local``) takes equal blocks on every rank: it reads the global
    shape off one rank's block, so a real mesh would refuse these blocks where a simulated one
    takes their global values."""
    problems = []
    for d, axes, blocks in _chunked_dims(spec, shape, sizes):
        if len(set(blocks)) > 1:
            problems.append(
                f"{at}: dim {d} has size {shape[d]}, which {axes} ({len(blocks)} members) do "
                f"not divide: its blocks would be {blocks}, but blocks=True makes the blocks a "
                "local call (f.local) takes, equal on every rank. Fix: pad dim "
                f"{d} to a multiple of {len(blocks)}, or shard without blocks=True and call f "
                "itself (its DTensors carry uneven blocks)."
            )
    return problems


def unshard(tree: Any) -> Any:
    """The inverse of :func:`shard`: every ``DTensor`` of ``tree`` as its global value.

    Each DTensor becomes a plain tensor holding the global value on every rank
    (``full_tensor()``: one all_gather per sharded DTensor, differentiable); every other leaf,
    plain tensors included (a simulated mesh's values are global already), is returned as it is.
    """
    dtensor = _dtensor_type()
    if dtensor is None:  # no DTensor can exist before torch.distributed.tensor is loaded
        return tree
    return optree.tree_map(
        lambda x: cast(Any, x).full_tensor() if isinstance(x, dtensor) else x,
        tree,
        none_is_leaf=True,
    )


def _specs_for(specs: Any, tree: Any, where: str) -> list[PartitionSpec]:
    """One spec per leaf, with errors that speak of ``specs`` and ``tree``."""
    check_spec_types(specs, "specs", where)
    try:
        return broadcast_specs(specs, tree, "in_specs", where)
    except SpecError:
        found = _first_mismatch(specs, tree, ())
        at = (
            f" At specs{path_text(found[0])}: {found[1]} where the tree has {found[2]}."
            if found
            else ""
        )
        raise SpecError(
            f"{where}: specs is not a pytree prefix of the tree.{at} Fix: give one P(...) per "
            "leaf or subtree (a single P applies to every tensor below it), e.g. "
            "{'w': P(None, 'tp'), 'b': P()} for {'w': ..., 'b': ...}."
        ) from None


def _copy(x: torch.Tensor) -> torch.Tensor:
    """A new leaf with its own data, as the real mesh's DTensors are (an optimizer stepping the
    result must not move the caller's tensors on one backend only)."""
    y = x.detach().clone().requires_grad_(x.requires_grad)
    return torch.nn.Parameter(y, requires_grad=x.requires_grad) if _is_param(x) else y


def _is_param(x: torch.Tensor) -> bool:
    return isinstance(x, torch.nn.Parameter)


def _dtensor_type() -> type | None:
    module = sys.modules.get("torch.distributed.tensor")
    return getattr(module, "DTensor", None)


__all__ = ["shard", "unshard"]
