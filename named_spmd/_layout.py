"""Block geometry: the one place that says which block of a tensor an instance holds.

* Instances of a mesh are numbered row-major over the axis names (first name major), and so are
  the members of the group of a tuple of axes (docs/design.md section 3).
* A PartitionSpec splits tensor dim ``d`` into ``k = prod(size(a) for a in spec.entry_axes(d))``
  blocks; the instance at mesh coordinates ``c`` holds block ``index(entry_axes(d), c)``. The
  blocks are equal where ``k`` divides the dim; otherwise they follow ``torch.chunk`` (DTensor's
  ``Shard``: ``ceil(n / k)`` each, the last ones smaller, perhaps empty), unless a ``Blocks``
  entry gives the sizes (:func:`dim_sizes`).
* Collectives move the blocks of one dim: ``split_blocks`` views a dim as ``n`` blocks and
  ``unstack_dim`` lays a leading stack of ``n`` blocks back along a dim.

Every backend, the display and the check mode use these functions; none writes the arithmetic
again.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence

import torch

from ._errors import SpecError, SpmdError, bullet_list
from ._spec import PartitionSpec, spec_problems

Sizes = Mapping[str, int]


# --- instance indices ---------------------------------------------------------------------------


def index_of(axes: Iterable[str], coords: Mapping[str, int], sizes: Sizes) -> int:
    """Row-major index of ``coords`` over ``axes`` (first name major)."""
    index = 0
    for a in axes:
        index = index * sizes[a] + coords[a]
    return index


def coords_text(coords: Mapping[str, int]) -> str:
    """An instance's coordinates as messages write them: ``dp=0, tp=1``."""
    return ", ".join(f"{a}={c}" for a, c in coords.items())


def coords_of(index: int, axes: Sequence[str], sizes: Sizes) -> dict[str, int]:
    """Inverse of :func:`index_of`: the coordinates on ``axes`` of row-major ``index``."""
    out: dict[str, int] = {}
    for a in reversed(axes):
        index, out[a] = divmod(index, sizes[a])
    return {a: out[a] for a in axes}


def group_coords(axes: Sequence[str], coords: Mapping[str, int], sizes: Sizes) -> list[dict]:
    """The full coordinates of the members of the group of ``axes`` that contains ``coords``,
    in row-major order over ``axes``."""
    count = math.prod([sizes[a] for a in axes])
    return [{**coords, **coords_of(i, axes, sizes)} for i in range(count)]


@functools.lru_cache(maxsize=256)
def groups(axes: tuple[str, ...], shape: tuple[tuple[str, int], ...]) -> list[list[int]]:
    """The groups of ``axes`` on a mesh of ``shape`` (its (name, size) pairs in order): each the
    instance indices (row-major over the mesh) of its members in member order, the groups in
    the order of their first instance. Cached: read at every collective of a per-instance or
    uneven call (callers do not modify it)."""
    sizes = dict(shape)
    names = tuple(sizes)
    seen: set[int] = set()
    out = []
    for i in range(math.prod(sizes.values())):
        if i not in seen:
            coords = coords_of(i, names, sizes)
            members = [index_of(names, c, sizes) for c in group_coords(axes, coords, sizes)]
            seen.update(members)
            out.append(members)
    return out


def group_size(axes: Iterable[str], sizes: Sizes) -> int:
    return math.prod([sizes[a] for a in axes])


# --- a tensor under a spec ----------------------------------------------------------------------


def local_shape(shape: Sequence[int], spec: PartitionSpec, sizes: Sizes) -> tuple[int, ...]:
    """The per-instance block shape of a global ``shape`` (the spec must divide it)."""
    return tuple(s // group_size(spec.entry_axes(d), sizes) for d, s in enumerate(shape))


def global_shape(shape: Sequence[int], spec: PartitionSpec, sizes: Sizes) -> tuple[int, ...]:
    """The global shape whose blocks under ``spec`` have the per-instance ``shape``."""
    return tuple(s * group_size(spec.entry_axes(d), sizes) for d, s in enumerate(shape))


def block_global_shape(
    shape: Sequence[int], spec: PartitionSpec, sizes: Mapping[str, int]
) -> tuple[int, ...]:
    """:func:`global_shape` of a block given by a caller, whose spec may name an axis the mesh
    does not have: it counts 1 (the spec checks report it)."""
    return global_shape(shape, spec, {**dict.fromkeys(spec.axes, 1), **sizes})


def chunk_sizes(size: int, n: int) -> tuple[int, ...]:
    """The sizes of ``n`` blocks of a dim of ``size``, as ``torch.chunk`` and DTensor's
    ``Shard`` split it: ``ceil(size / n)`` each, the last ones smaller, perhaps empty (10 over
    4: 3, 3, 3, 1; 5 over 4: 2, 2, 1, 0)."""
    c = -(-size // n)
    return tuple(max(0, min(c, size - i * c)) for i in range(n))


def dim_sizes(spec: PartitionSpec, d: int, size: int, sizes: Sizes) -> tuple[int, ...]:
    """The block sizes of dim ``d`` (global ``size``) under ``spec``, member order (row-major
    over the entry's axes): the :class:`~._spec.Blocks` entry's, else equal blocks where the
    axes divide the dim, else :func:`chunk_sizes`. A dim ``spec`` does not split: one block."""
    given = spec.entry_sizes(d)
    if given is not None:
        return given
    return chunk_sizes(size, group_size(spec.entry_axes(d), sizes))  # equal where n divides


def dim_offsets(block_sizes: Sequence[int]) -> tuple[int, ...]:
    """Where each block starts: the running sum of the sizes before it."""
    return tuple(itertools.accumulate(block_sizes, initial=0))[:-1]


def is_even(shape: Sequence[int], spec: PartitionSpec, sizes: Sizes) -> bool:
    """Whether every instance's block of a global ``shape`` under ``spec`` has one shape."""
    if not spec.axes:  # (memoized on the spec: most leaves, parameters, split nothing)
        return True
    for d, size in enumerate(shape):
        axes = spec.entry_axes(d)
        if not axes:
            continue
        given = spec.entry_sizes(d)
        if given is None:  # torch.chunk's blocks (:func:`chunk_sizes`): equal iff n divides
            if size % group_size(axes, sizes):
                return False
        elif len(set(given)) > 1:
            return False
    return True


def gives_unequal_blocks(
    leaves: Sequence[object], specs: Sequence[PartitionSpec], sizes: Sizes
) -> bool:
    """Whether some tensor leaf's blocks differ in size (a dim its axes do not divide, or a
    ``Blocks`` entry of unequal sizes): the one test of whether a call runs on blocks of
    unequal sizes (per instance on the simulated mesh, ``_dist_uneven`` on a real one, eagerly
    inside a compiled program)."""
    for x, spec in zip(leaves, specs):
        if isinstance(x, torch.Tensor) and not is_even(x.shape, spec, sizes):
            return True
    return False


def dtensor_holds(spec: PartitionSpec, per_dim: Sequence, sizes: Sizes) -> bool:
    """Whether DTensor's ``Shard`` holds blocks of the sizes ``per_dim`` (per dim; None: not
    split; member order): each unequal split over its axes in mesh order (``sizes``' order),
    in the sizes DTensor's split gives, over one mesh dim after another (torch.chunk's where
    one axis splits the dim; 7 over 2 x 2 is 2, 2, 2, 1 as torch.chunk's, but 10 is 3, 2, 3, 2
    where torch.chunk's are 3, 3, 3, 1)."""
    order = list(sizes)
    for d, blocks in enumerate(per_dim):
        if blocks is None or min(blocks) == max(blocks):
            continue
        axes = [a for a in spec.entry_axes(d) if sizes[a] > 1]
        if axes != sorted(axes, key=order.index):
            return False  # (DTensor holds the mesh order's block where the spec's differs)
        nested: tuple[int, ...] = (sum(blocks),)
        for a in axes:
            nested = tuple(b for size in nested for b in chunk_sizes(size, sizes[a]))
        if tuple(blocks) != nested:
            return False
    return True


def layout_problem(
    kinds: Sequence[tuple[int, torch.dtype]],
    shape_at: Callable[[dict[str, int]], Sequence[int]],
    spec: PartitionSpec,
    sizes: Sizes,
    names: Sequence[str],
    where: str,
) -> str | None:
    """Where the blocks of output ``where`` cannot be laid back under ``spec`` (the one check
    of both backends, so that they raise the same message): ``kinds`` gives every instance's
    block rank and dtype, ``shape_at(coords)`` the block shape of the instance at ``coords``
    over the mesh's axis ``names``. The message; else None."""
    split = any(sizes[a] > 1 for a in spec.axes)
    problem = _kinds_problem(kinds, spec, sizes, names) if split else None
    if problem is None:
        problem = _grid_problem(shape_at, kinds[0][0], spec, sizes, names)
    if problem is None and spec.explicit:  # the sizes a Blocks entry gives must be the blocks'
        named = [a for a in names if a in spec.axes]
        zeros = dict.fromkeys(names, 0)
        shapes = [
            shape_at({**zeros, **coords_of(b, named, sizes)})
            for b in range(group_size(named, sizes))
        ]
        problem = _given_sizes_problem(shapes, spec, sizes, named)
    return None if problem is None else f"{where}: {problem}"


def _kinds_problem(
    kinds: Sequence[tuple[int, torch.dtype]],
    spec: PartitionSpec,
    sizes: Sizes,
    names: Sequence[str],
) -> str | None:
    """Where some instance's block differs from instance 0's in rank or dtype (every
    instance's, those of the axes ``spec`` does not name too: a real mesh lays out each rank's
    own): blocks of any sizes are concatenated, never of different ranks or dtypes."""
    rank, dtype = kinds[0]
    for i, (other_rank, other_dtype) in enumerate(kinds):
        if other_rank != rank or other_dtype != dtype:
            what = "ranks" if other_rank != rank else "dtypes"
            return (
                f"the instances' blocks have different {what}: the instance at "
                f"{coords_of(0, names, sizes)} returned a {dtype} block of rank {rank}, the "
                f"instance at {coords_of(i, names, sizes)} a {other_dtype} block of rank "
                f"{other_rank}; {spec!r} concatenates blocks of any sizes, but of one rank and "
                "one dtype. Fix: return a block of the same rank and dtype on every "
                "instance: a branch on the block's size or on ns.axis_index must not drop a dim "
                "(keep it: x.sum(0, keepdim=True)) nor change the dtype (x.to(dtype))."
            )
    return None


def _grid_problem(
    shape_at: Callable[[dict[str, int]], Sequence[int]],
    rank: int,
    spec: PartitionSpec,
    sizes: Sizes,
    names: Sequence[str],
) -> str | None:
    """Along each dim a block's size must depend only on the axes ``spec`` names on that dim
    (the blocks of a row share its height), and the parts summed over unreduced axes must have
    one shape."""
    named = [a for a in names if a in spec.axes]
    summed = [a for a in names if a in spec.unreduced]
    zeros = dict.fromkeys(names, 0)
    for b in range(group_size(named, sizes)):
        coords = {**zeros, **coords_of(b, named, sizes)}
        shape = list(shape_at(coords))
        for d in range(rank):
            entry = spec.entry_axes(d)
            home = {**zeros, **{a: coords[a] for a in entry}}
            if shape_at(home)[d] != shape[d]:
                return (
                    f"its blocks cannot be laid back under {spec!r}: along dim {d} the "
                    f"block at {_named(coords, named)} has size {shape[d]} and the block at "
                    f"{_named(home, named)} {shape_at(home)[d]}, but {spec!r} splits dim {d} "
                    f"over {entry or 'no axis'} only. Fix: name on each dim the axes over which "
                    "the blocks' sizes vary there (as the in_specs split them), or pad the "
                    "blocks to one size."
                )
        for u in range(1, group_size(summed, sizes)):
            part = {**coords, **coords_of(u, summed, sizes)}
            if list(shape_at(part)) != shape:
                return (
                    f"the parts of {spec!r} summed over {tuple(summed)} have different "
                    f"shapes ({list(shape_at(part))} at {_named(part, names)}, {shape} at "
                    f"{_named(coords, names)}). Fix: reduce inside the function (ns.psum) "
                    "where the parts have one shape, or pad them to one shape."
                )
    return None


def _named(coords: Mapping[str, int], axes: Sequence[str]) -> dict[str, int]:
    return {a: coords[a] for a in axes}


def _given_sizes_problem(
    shapes: Sequence[Sequence[int]], spec: PartitionSpec, sizes: Sizes, named: Sequence[str]
) -> str | None:
    """Where an out_spec's ``Blocks`` entry does not give the sizes of the blocks returned
    (``shapes``: one per instance of the ``named`` axes, row-major)."""
    for b, shape in enumerate(shapes):
        coords = coords_of(b, named, sizes)
        for d in range(min(len(spec), len(shape))):
            given = spec.entry_sizes(d)
            if given is not None and shape[d] != given[index_of(spec.entry_axes(d), coords, sizes)]:
                return (
                    f"{spec[d]!r} gives dim {d} blocks of sizes {given}, but the instance "
                    f"at {coords} returned a block of size {shape[d]} there. Fix: give the "
                    "sizes the blocks have, or name the axes without sizes (their blocks are "
                    "concatenated whatever their sizes)."
                )
    return None


def block(
    x: torch.Tensor, spec: PartitionSpec, sizes: Sizes, coords: Mapping[str, int]
) -> torch.Tensor:
    """The block of the global ``x`` held by the instance at ``coords`` (a view); blocks of a
    dim split unevenly have the sizes :func:`dim_sizes` gives."""
    for d in range(x.dim()):
        axes = spec.entry_axes(d)
        if not axes:
            continue
        i = index_of(axes, coords, sizes)
        if spec.explicit or x.shape[d] % group_size(axes, sizes):
            blocks = dim_sizes(spec, d, x.shape[d], sizes)
            x = x.narrow(d, sum(blocks[:i]), blocks[i])
        else:
            size = x.shape[d] // group_size(axes, sizes)
            x = x.narrow(d, i * size, size)
    return x


def split_all(x: torch.Tensor, spec: PartitionSpec, sizes: Sizes) -> list[torch.Tensor]:
    """Every block of the global ``x`` under ``spec``, from one ``split`` per split dim (so
    that autograd joins their gradients with one concatenation, where a ``narrow`` per block
    would fill a zero tensor of the global size per block). Ordered by :func:`split_index`."""
    pieces = [x]
    for d in range(x.dim()):
        if spec.entry_axes(d):
            part = dim_sizes(spec, d, x.shape[d], sizes)
            pieces = [q for p in pieces for q in p.split(part, d)]
    return pieces


def split_index(spec: PartitionSpec, rank: int, sizes: Sizes, coords: Mapping[str, int]) -> int:
    """Where the block held at ``coords`` is in :func:`split_all`'s list (first split dim
    major)."""
    index = 0
    for d in range(rank):
        axes = spec.entry_axes(d)
        if axes:
            index = index * group_size(axes, sizes) + index_of(axes, coords, sizes)
    return index


def concat_blocks(
    blocks: Sequence[torch.Tensor], spec: PartitionSpec, sizes: Sizes, order: Sequence[str]
) -> torch.Tensor:
    """The global tensor whose blocks under ``spec`` are ``blocks``: one per instance of the
    axes ``spec`` names, row-major over ``order`` (the mesh's axis order restricted to them).
    Each split dim is laid back by concatenation, so blocks may differ in size along it."""
    axes = [a for a in order if a in spec.axes]
    grid = {i: b for i, b in enumerate(blocks)}
    for d in reversed(range(blocks[0].dim() if blocks else 0)):
        entry = spec.entry_axes(d)
        if not entry:
            continue
        rest = [a for a in axes if a not in entry]
        merged = {}
        for r in range(group_size(rest, sizes)):
            outer = coords_of(r, rest, sizes)
            parts = []
            for m in range(group_size(entry, sizes)):
                c = {**outer, **coords_of(m, entry, sizes)}
                parts.append(grid[index_of(axes, c, sizes)])
            merged[r] = torch.cat(parts, d)
        grid, axes = merged, rest
    return grid[0]


def assemble(stacked: torch.Tensor, spec: PartitionSpec, sizes: Sizes) -> torch.Tensor:
    """``[n, *block]`` (blocks row-major over ``spec.axes``) -> the global tensor."""
    local = stacked.shape[1:]
    split = [d for d in range(len(local)) if spec.entry_axes(d)]
    counts = [group_size(spec.entry_axes(d), sizes) for d in split]
    x = stacked.reshape(*counts, *local)
    perm, out = [], []
    for d in range(len(local)):
        if d in split:
            perm.append(split.index(d))
            out.append(counts[split.index(d)] * local[d])
        else:
            out.append(local[d])
        perm.append(len(split) + d)
    return x.permute(*perm).reshape(out)


def physical_layout(
    shape: Sequence[int], spec: PartitionSpec, sizes: Sizes, order: Sequence[str]
) -> tuple[list[int], list[int]]:
    """(reshape, permutation) taking a global tensor to ``[one dim per named axis, in the
    order of order, *local block]`` (views, no copy): the simulated backend's batch dims."""
    split: list[int] = []
    position: dict[str, int] = {}
    local_dims: list[int] = []
    for d, size in enumerate(shape):
        axes = spec.entry_axes(d)
        for a in axes:
            position[a] = len(split)
            split.append(sizes[a])
        local_dims.append(len(split))
        split.append(size // group_size(axes, sizes))
    return split, [position[a] for a in order if a in position] + local_dims


# --- the blocks of one dim, as collectives move them ----------------------------------------------


def split_blocks(x: torch.Tensor, dim: int, n: int, tiled: bool) -> torch.Tensor:
    """``dim`` as n blocks: tiled, ``[.., n*c, ..] -> [.., n, c, ..]``; untiled it has size n."""
    return x.unflatten(dim, (n, -1)) if tiled else x


def unstack_dim(stacked: torch.Tensor, dim: int, tiled: bool) -> torch.Tensor:
    """``[n, ...]`` (member j's block first) -> the blocks along ``dim``, in member order."""
    out = stacked.movedim(0, dim) if dim != 0 else stacked
    return out.flatten(dim, dim + 1) if tiled else out


# --- ragged rows (ragged_all_to_all): value-dependent placement with static shapes -----------------


def _rows_along(sizes: torch.Tensor, n: int, device: torch.device) -> tuple:
    """``(r, valid)``: row numbers ``0..n-1`` and, per slot k, which of them lie within
    ``sizes[k]`` (``[K, n]``)."""
    r = torch.arange(n, device=device)
    return r, r < sizes.unsqueeze(-1)


def _trailing(mask: torch.Tensor, x: torch.Tensor, lead: int) -> torch.Tensor:
    """``mask`` with unit dims for ``x``'s dims after its first ``lead``."""
    return mask.reshape(*mask.shape, *([1] * (x.dim() - lead)))


def ragged_pack(x: torch.Tensor, offsets: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``[K, N, *x.shape[1:]]``: slot k holds ``x``'s rows ``offsets[k] : offsets[k] + sizes[k]``
    (``N = x.shape[0]`` rows, zeros after the slot's size). Index ops only: the placement depends
    on values, the shapes do not (so it runs under vmap)."""
    n = x.shape[0]
    r, valid = _rows_along(sizes, n, x.device)
    index = torch.where(valid, offsets.unsqueeze(-1) + r, 0).clamp(0, max(n - 1, 0))
    rows = x.index_select(0, index.reshape(-1)).unflatten(0, tuple(index.shape))
    return torch.where(_trailing(valid, rows, 2), rows, x.new_zeros(()))


def ragged_place(
    received: torch.Tensor, m: int, offsets: torch.Tensor, sizes: torch.Tensor
) -> torch.Tensor:
    """``[m, *received.shape[2:]]``: slot k's first ``sizes[k]`` rows of ``received`` (``[K, N,
    ...]``) written at rows ``offsets[k]...``, zeros elsewhere (rows that would fall outside are
    dropped)."""
    k, n = received.shape[:2]
    r, valid = _rows_along(sizes, n, received.device)
    target = offsets.unsqueeze(-1) + r
    valid = valid & (target >= 0) & (target < m)
    target = torch.where(valid, target, m)  # one spare row takes what is not written
    out = received.new_zeros((m + 1, *received.shape[2:]))
    return out.index_add(0, target.reshape(-1), received.flatten(0, 1))[:m]


def ragged_written(m: int, offsets: torch.Tensor, sizes: torch.Tensor) -> torch.Tensor:
    """``[m]`` bool: the rows that some slot (``offsets[k]``, ``sizes[k]``) writes."""
    rows = torch.arange(m, device=offsets.device).unsqueeze(-1)
    return ((rows >= offsets) & (rows < offsets + sizes)).any(-1)


def instances_problem(
    where: str,
    structures: Sequence[tuple[int, int]],
    shape_of: Callable[[int, int], Sequence[int]],
    specs: Sequence[PartitionSpec],
    wheres: Sequence[str],
    mesh_shape: Mapping[str, int],
) -> SpmdError | None:
    """What the instances of a call run per instance must agree on once all returned (a real
    mesh's ranks: from one exchange), told alike wherever it is checked: the output tree
    (``structures``: each instance's ``Call.structure()``), then each output's rank under its
    out_spec (``shape_of(i, j)``: instance i's block of output j; ``check_outputs`` leaves
    such a problem here). The error of the first instance that fails; else None."""
    names = tuple(mesh_shape)
    count = structures[0][0]
    for i, structure in enumerate(structures):
        if structure != structures[0]:
            n = structure[0]
            return SpmdError(
                f"{where}: the instances returned different output trees: the instance at "
                f"{coords_of(0, names, mesh_shape)} returned {count} "
                f"tensor{'' if count == 1 else 's'}, the instance at "
                f"{coords_of(i, names, mesh_shape)} {n}"
                + (", in a tree of other containers or keys" if n == count else "")
                + ". The instances' outputs are laid out together, leaf by leaf, under "
                "out_specs. Fix: return the same tree on every instance: a branch on the "
                "block's size or on ns.axis_index must not add, drop or rename an output "
                "(return an empty block or zeros there instead)."
            )
    for i in range(len(structures)):
        problems: list[str] = []
        for j, (spec, at) in enumerate(zip(specs, wheres)):
            shape = tuple(shape_of(i, j))
            if len(spec) > len(shape):
                problems += spec_problems(spec.without_sizes(), shape, mesh_shape, at)
        if problems:
            return SpecError(
                f"{where}: the outputs of the instance at {coords_of(i, names, mesh_shape)} do "
                "not fit out_specs:\n" + bullet_list(problems)
            )
    return None
