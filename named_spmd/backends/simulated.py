"""Simulated backend: every instance of the mesh runs in this process under nested vmap.

One ``torch.func.vmap`` level per mesh axis. A tensor's vma is the set of *our* levels it is
batched at: "unbatched at this level" is exactly "invariant over this axis". Every collective is
built from the two level primitives of ``_levels`` plus ordinary torch ops, so autograd outside
the simulation yields the global gradient with no extra machinery.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C import _functorch
from torch.func import vmap

from .._accounting import recording
from .._context import SpmdContext
from .._mesh import Mesh
from .._spec import PartitionSpec
from . import _levels
from ._implicit import run_recording


class SimulatedContext(SpmdContext):
    """A running simulated call: one token per axis, batched at that axis' level only."""

    def __init__(self, mesh: Mesh, fn: Any, tokens: dict[str, torch.Tensor]):
        super().__init__(mesh, fn)
        self.tokens = tokens
        self.level_axis = {_functorch.maybe_get_level(t): a for a, t in tokens.items()}
        self.axis_level = {a: lv for lv, a in self.level_axis.items()}
        self.inner_level = max(self.level_axis, default=0)
        self.outer_level = min(self.level_axis, default=0)
        self.sizes = mesh.shape  # a copy; Mesh.shape builds a new dict per access

    def vma(self, x: torch.Tensor) -> frozenset[str]:
        # Walk the wrappers from the outside in; ours are consecutive levels and any wrapper at
        # one of them is our vmap's (levels are stack depths), so stop below the outermost.
        found = []
        while True:
            level = _functorch.maybe_get_level(x)
            if level < self.outer_level:  # also -1: a plain tensor
                return frozenset(found)
            axis = self.level_axis.get(level)
            if axis is not None:
                found.append(axis)
            x = _functorch.get_unwrapped(x)

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        index = self.tokens[axes[0]]
        for a in axes[1:]:
            index = index * self.sizes[a] + self.tokens[a]
        return index

    # --- primitives -----------------------------------------------------------------------
    def gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Invariant stack ``[n, *local]`` of the group's values, row-major over ``axes``."""
        for a in reversed(axes):  # minor axis first, so the major one ends up outermost
            x = _levels.gather(
                x, self.tokens[a], self.sizes[a], self.axis_level[a], self.inner_level
            )
        return x.flatten(0, len(axes) - 1) if len(axes) > 1 else x

    def pvary(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        for a in axes:
            x = _levels.vary(x, self.tokens[a], self.sizes[a], self.axis_level[a], self.inner_level)
        return x

    def _mine(self, stacked: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Row ``axis_index(axes)`` of an invariant ``[n, ...]`` tensor: varying over axes.

        Under a grad or jvp *inside* the per-device function the stack is pvary'd first: the
        transpose of that pvary (a psum) is what brings every instance's cotangent of its row back
        to the stack. Without such a transform above, autodiff happens outside the simulation,
        where the batching already sums, and the pvary would be a wasted op."""
        level = min(self.axis_level[a] for a in axes)
        if not _levels.vmaps_only_above(level, self.inner_level):
            stacked = self.pvary(stacked, axes)
        return stacked.index_select(0, self.axis_index(axes).reshape(1)).squeeze(0)

    # --- collectives ----------------------------------------------------------------------
    def psum(self, x, axes):
        return self.gather(x, axes).sum(0)

    def pmax(self, x, axes):
        return self.gather(x, axes).amax(0)

    def pmin(self, x, axes):
        return self.gather(x, axes).amin(0)

    def all_gather(self, x, axes, axis, tiled, invariant):
        out = self.gather(x, axes).movedim(0, axis)
        if tiled:
            out = out.flatten(axis, axis + 1)
        return out if invariant else self.pvary(out, axes)

    def psum_scatter(self, x, axes, dim, tiled):
        total = self.psum(x, axes)
        if tiled:  # dim of size n*c -> [n, c]: instance i keeps block i
            total = total.unflatten(dim, (self.mesh.axis_size(axes), -1))
        return self._mine(total.movedim(dim, 0), axes)

    def all_to_all(self, x, axes, split, concat, tiled):
        n = self.mesh.axis_size(axes)
        stacked = self.gather(x, axes)  # [n_src, *local]
        chunks = stacked.unflatten(split + 1, (n, -1)).movedim(split + 1, 0)  # [n_dst, n_src, ...]
        received = self._mine(chunks, axes)  # [n_src, *local with split dim / n]
        if not tiled:
            return received.squeeze(split + 1).movedim(0, concat)
        return received.movedim(0, concat).flatten(concat, concat + 1)

    def ppermute(self, x, axes, pairs):
        n = self.mesh.axis_size(axes)
        source = [0] * n
        receives = [False] * n
        for src, dst in pairs:
            source[dst], receives[dst] = src, True
        got = self._mine(self.gather(x, axes).index_select(0, torch.tensor(source)), axes)
        if all(receives):
            return got
        keep = self._mine(torch.tensor(receives), axes)
        return torch.where(keep, got, torch.zeros_like(got))


# --- entering and leaving the simulation --------------------------------------------------


def nesting_order(mesh: Mesh, leaves: Sequence[Any], specs: Sequence[PartitionSpec]) -> list[str]:
    """Mesh axes outermost first. Innermost is the axis with the most input bytes replicated
    over it: vmap then batches the large replicated operands (weights) last, so they are not
    copied once per outer instance (3.8x versus 1.1-1.2x measured; DESIGN.md section 5)."""
    replicated = dict.fromkeys(mesh.axis_names, 0)
    for leaf, spec in zip(leaves, specs):
        if isinstance(leaf, torch.Tensor):
            named = set(spec.axes)
            for a in mesh.axis_names:
                if a not in named:
                    replicated[a] += (
                        leaf.numel()
                        * leaf.element_size()
                        // max(1, math.prod(mesh.shape[b] for b in named))
                    )
    order = list(mesh.axis_names)
    return sorted(order, key=lambda a: (replicated[a], -order.index(a)))


def to_physical(
    x: torch.Tensor, spec: PartitionSpec, mesh: Mesh, order: Sequence[str]
) -> torch.Tensor:
    """Global tensor -> [mesh dims of the named axes, in nesting order, *local block]."""
    shape: list[int] = []
    position: dict[str, int] = {}
    local_dims: list[int] = []
    for d, size in enumerate(x.shape):
        axes = spec.entry_axes(d)
        for a in axes:
            position[a] = len(shape)
            shape.append(mesh.shape[a])
        local_dims.append(len(shape))
        shape.append(size // math.prod(mesh.shape[a] for a in axes))
    named = [position[a] for a in order if a in position]
    return x.reshape(shape).permute(*named, *local_dims)


def from_physical(
    y: torch.Tensor, spec: PartitionSpec, mesh: Mesh, order: Sequence[str]
) -> torch.Tensor:
    """[one dim per mesh axis in nesting order, *local] -> global tensor per ``spec``.

    Axes the spec does not name contribute their instance-0 copy (invariant when checked)."""
    named = set(spec.axes)
    index = tuple(slice(None) if a in named else 0 for a in order)
    y = y[index]
    kept = [a for a in order if a in named]
    local_rank = y.dim() - len(kept)
    perm: list[int] = []
    sizes: list[int] = []
    for d in range(local_rank):
        group = [kept.index(a) for a in spec.entry_axes(d)] + [len(kept) + d]
        perm.extend(group)
        sizes.append(math.prod(y.shape[i] for i in group))
    return y.permute(perm).reshape(sizes)  # a list: rank-0 outputs have no dims


def run(
    mesh: Mesh,
    fn: Callable[..., Any],
    leaves: list[Any],
    specs: list[PartitionSpec],
    body: Callable[[list[Any], SimulatedContext], list[torch.Tensor]],
    out_specs_of: Callable[[], list[PartitionSpec]],
) -> list[torch.Tensor]:
    """Run ``body`` (per instance: local leaves -> local output tensors) on every instance.

    Returns the output tensors assembled to global values with ``out_specs_of()`` (known only
    once the body has run)."""
    order = nesting_order(mesh, leaves, specs)
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    physical = [to_physical(leaves[i], specs[i], mesh, order) for i in tensor_pos]
    tokens = [torch.arange(mesh.shape[a]) for a in order]

    def innermost(*flat):
        local = list(leaves)
        for i, t in zip(tensor_pos, flat[: len(tensor_pos)]):
            local[i] = t
        ctx = SimulatedContext(mesh, fn, dict(zip(order, flat[len(tensor_pos) :])))
        if recording():  # report implicit pvary's backward psum; off the fast path
            return tuple(run_recording(ctx, body, local))
        return tuple(body(local, ctx))

    nested = innermost
    for depth in reversed(range(len(order))):
        axis = order[depth]
        in_dims = tuple(0 if axis in specs[i].axes else None for i in tensor_pos)
        token_dims = tuple(0 if j == depth else None for j in range(len(order)))
        nested = vmap(nested, in_dims=in_dims + token_dims, out_dims=0, randomness="same")
    outs = nested(*physical, *tokens)
    return [from_physical(y, s, mesh, order) for y, s in zip(outs, out_specs_of())]
