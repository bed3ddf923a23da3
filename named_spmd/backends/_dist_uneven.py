"""Blocks of unequal sizes on a real mesh: each rank holds its own block.

A call takes uneven blocks where the simulated mesh does (``ns.simulate_per_instance()`` active,
or an input's ``Blocks`` entry giving unequal sizes), so that both accept and refuse the same
inputs; such a call runs with :class:`UnevenPrimitives` and its inputs and outputs go through
here. An even call never does: its path is ``_dist_io`` alone, unchanged.

* Inputs: a plain tensor's block is cut by ``_layout.block`` (torch.chunk's blocks, or the
  ``Blocks`` sizes); its gradient gathers the blocks padded to the largest (gloo gathers equal
  sizes only) and trims them. A ``DTensor`` whose ``Shard`` blocks differ in size gives its
  local block (DTensor splits as torch.chunk does), its gradient a DTensor of its global shape.
* Outputs: one all_gather of every output's block shape per call (a few integers), then a
  ``DTensor`` of the global shape where DTensor can hold the blocks (torch.chunk's, each split
  dim over one axis), else the global value as a plain tensor on every rank (one padded
  all_gather), as the simulated mesh returns it.
* Collectives: a tiled all_gather concatenates blocks of any sizes (a size exchange, then the
  padded gather); a tiled psum_scatter keeps torch.chunk's blocks; both pass the block sizes to
  their transposes as an extra parameter (:meth:`UnevenPrimitives.sized`), so the transpose of
  a gather of ``Blocks`` sizes scatters to those sizes.
* Operand shapes: exchanged once per collective that takes one shape on every member; a
  ppermute of a signature called again assumes its last call's and checks them in its own
  collective (:meth:`UnevenPrimitives.recall_shapes` and the section after it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_private as torch_private
from .._accounting import active
from .._autodiff import differentiable
from .._errors import SpecError, SpmdError, operand_shapes_differ
from .._layout import (
    block,
    chunk_sizes,
    concat_blocks,
    coords_of,
    dim_sizes,
    given_sizes_problem,
    grid_problem,
    group_size,
    groups,
    index_of,
    is_even,
)
from .._spec import PartitionSpec
from . import _dist_io as io
from ._dist_dtensor import placements, uneven_from_local, uneven_to_local

Sizes = tuple[int, ...]

# The collectives whose tiled form passes block sizes to its transpose: their own parameter
# count (the sizes come after it).
_SIZED = {"all_gather": 3, "psum_scatter": 2}
_WIDTH = 17  # the shape exchange's row: the rank, then up to 16 sizes (more: not compared)


_RECORDS = 64  # the signatures whose ppermutes' shapes a mesh keeps


def _common(shapes: list[tuple[int, ...]] | None) -> tuple[int, ...] | None:
    """The one shape of every instance, or None (different shapes, or past the width)."""
    if shapes is None or any(s != shapes[0] for s in shapes):
        return None
    return shapes[0]


_UNKNOWN: Any = object()  # every instance's operand shapes: not exchanged yet


class _Checked(tuple):
    """The parameters :meth:`UnevenPrimitives.check_operand` returns, carrying every
    instance's operand shapes from its exchange (None past :data:`_WIDTH` dims), so that
    :meth:`UnevenPrimitives.sized` of the same operand exchanges them once. Only the
    collective's own path (``_record._apply``) passes them on, to the ``apply`` of that
    operand, on every rank alike; ``sized`` returns a plain tuple, so a transpose never sees
    them."""

    shapes: list[tuple[int, ...]] | None

    def __new__(cls, params: tuple, shapes: list[tuple[int, ...]] | None) -> _Checked:
        made = super().__new__(cls, params)
        made.shapes = shapes
        return made


def _pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` (gloo gathers equal shapes)."""
    short = size - x.shape[dim]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x, x.new_zeros(shape)], dim)


def _exchange(comm, values: list[int]) -> list[list[int]]:
    """Every member's ``values`` (one length on every member), in member order."""
    mine = torch.tensor(values, dtype=torch.int64, device=comm.mesh.device)
    return comm.all_gather(mine, "block sizes").tolist()


class UnevenPrimitives:
    """The primitives of a call whose members' blocks may differ in size (mixed into the
    real mesh's context)."""

    uneven = True
    mesh: Any  # (the context's: a DistributedMesh)

    def sized(self, rec, x: torch.Tensor, axes, params: tuple) -> tuple:
        """``params``, with the blocks' sizes appended for a tiled all_gather / psum_scatter
        (their transposes need them); first, for a collective that takes one shape on every
        member, the shapes compared. Every instance's shapes come from one exchange: the one
        :meth:`check_operand` made for this operand where it made one (``_Checked``)."""
        shapes = params.shapes if isinstance(params, _Checked) else _UNKNOWN
        params = tuple(params)
        self._guess = None
        gathers = rec.name == "all_gather" and params[1]  # blocks of any sizes, concatenated
        if rec.name == "ppermute" and self._seen is not None:
            self._permuted_shapes(x, axes, params[0])
        elif rec.forward_event and not gathers:
            self._same_shapes(rec.name, x, axes, shapes)
        base = _SIZED.get(rec.name)
        if base is None or not params[1] or len(params) != base:
            return params
        comm = self.mesh.comm(axes)
        if gathers:
            return (*params, self._gathered_sizes(rec.name, x, axes, params[0], shapes))
        return (*params, chunk_sizes(x.shape[params[0]], comm.n))  # psum_scatter's blocks

    # --- the ppermutes of a signature called again ------------------------------------------
    # A ppermute's members must pass one shape, known before the data moves (gloo fails or waits
    # on different sizes): a call exchanges every instance's shape first. A call whose
    # signature (the function, the inputs' global shapes and dtypes: the start-of-call check's)
    # ran before instead assumes, at its k-th ppermute over the whole mesh, the one shape every
    # instance passed to the k-th of the last such call, and the ppermute itself carries one
    # more element to every member: whether this member's operand has another shape. Any flag
    # set, every member learns it in that collective, and all exchange the shapes then (the
    # simulated mesh's error where they differ) and move the data again. Every rank assumes
    # the same: the start-of-call check compares a digest of what each recalls (``_dist_agree``),
    # and a rank that recalls otherwise than another makes every rank forget it.

    _signature = 0
    _recalled: tuple | None = None  # the last call's shapes, by ppermute, or None
    _seen: list | None = None  # this call's, until its outputs are made (then recorded)
    _guess: tuple[int, ...] | None = None  # the shape the next permute assumes

    def recall_shapes(self, signature: int) -> int:
        self._signature, self._seen = signature, []
        self._recalled = self.mesh.shape_records.get(signature)
        if self._recalled is None:
            return 0
        # (of ints only: hash() of a str, or of None before Python 3.12, differs by process)
        return hash(tuple((-1,) if s is None else s for s in self._recalled))

    def forget_shapes(self) -> None:
        self._recalled = None

    def _permuted_shapes(self, x: torch.Tensor, axes, pairs) -> None:
        """Before a ppermute's data moves: the shape it assumes (``_guess``), or every
        instance's shape exchanged and compared."""
        mesh = self.mesh
        if mesh.pending_check is not None:  # first: whether every rank recalls the same
            mesh.pending_check()
        assert self._seen is not None
        k, recalled = len(self._seen), self._recalled
        guess = recalled[k] if recalled is not None and k < len(recalled) else None
        moves = any(s != d for s, d in pairs)  # (else nothing moves: no flag either)
        if guess is not None and moves and mesh.comm(axes).n == mesh.size:
            self._guess = guess
            self._seen.append(guess)
            return
        shapes = self._every_shape(x)
        self._seen.append(_common(shapes))
        self._same_shapes("ppermute", x, axes, shapes)

    def permute(self, x, axes, pairs):
        guess, self._guess = self._guess, None
        if guess is None:
            return super().permute(x, axes, pairs)  # type: ignore[misc]
        differs = tuple(x.shape) != guess
        comm = self.mesh.comm(axes)
        out, flagged = comm.permute_flagged(x.new_zeros(guess) if differs else x, pairs, differs)
        if not flagged:
            return out
        shapes = self._every_shape(x)  # (every member knows it: the flags went to all)
        assert self._seen is not None
        self._seen[-1] = _common(shapes)
        self._same_shapes("ppermute", x, axes, shapes)
        return super().permute(x, axes, pairs)  # type: ignore[misc]

    def record_shapes(self) -> None:
        """The call's outputs are made: what its ppermutes' operands were, for the next call
        of its signature (the oldest signature's forgotten past :data:`_RECORDS`)."""
        if self._seen is None:
            return
        records = self.mesh.shape_records
        records.pop(self._signature, None)
        records[self._signature] = tuple(self._seen)
        if len(records) > _RECORDS:
            del records[next(iter(records))]
        self._seen = None

    def check_operand(self, rec, x: torch.Tensor, axes, params: tuple) -> tuple:
        """Every instance's argument checks, in instance order, on its operand's shape (one
        exchange): the error of the first instance whose operand fails them, raised on every
        rank alike, as the simulated mesh raises it (a rank that raised alone would leave the
        others inside the collective)."""
        mine = tuple(x.shape)
        shapes = self._every_shape(x) if rec.forward_event else None
        checked, result = set(), None
        for shape in shapes or [mine]:
            if shape not in checked:
                checked.add(shape)
                out = rec.check(
                    self, x if shape == mine else self._stand_in(x, shape), axes, params
                )
                result = out if shape == mine else result
        assert result is not None  # this rank's shape is among every instance's
        return _Checked(result, shapes) if rec.forward_event else result

    def _stand_in(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A meta tensor of another instance's operand shape, of ``x``'s dtype and type."""
        with torch_private.DisableTorchFunction():
            meta = torch.empty(shape, dtype=x.dtype, device="meta")
        return self.stamp(meta, self.vma(x))  # type: ignore[attr-defined]

    def _every_shape(self, x: torch.Tensor) -> list[tuple[int, ...]] | None:
        """Every instance's operand shape, row-major over the mesh (one exchange over the whole
        mesh); None past :data:`_WIDTH` dims."""
        if x.dim() >= _WIDTH:
            return None
        mine = [x.dim(), *x.shape] + [0] * (_WIDTH - 1 - x.dim())
        rows = _exchange(self.mesh.comm(self.mesh.axis_names), mine)
        return [tuple(r[1 : 1 + r[0]]) for r in rows]

    def _groups(self, axes) -> list[list[int]]:
        """The groups of ``axes`` (instance indices), in the simulated mesh's order."""
        return groups(tuple(axes), tuple(self.mesh._shape.items()))

    def _groups_of(self, axes, shapes: list[tuple[int, ...]]) -> list[list[tuple[int, ...]]]:
        """The members' shapes of every group of ``axes``, groups in the simulated mesh's order."""
        return [[shapes[m] for m in g] for g in self._groups(axes)]

    def _gathered_sizes(
        self, op: str, x: torch.Tensor, axes, dim: int, shapes: Any = _UNKNOWN
    ) -> tuple[int, ...]:
        """The members' sizes along ``dim`` of a tiled all_gather, from one exchange of every
        instance's shape (``shapes``, where given); in every group the other dims must agree
        (the simulated mesh's error, raised on every rank alike: gloo would fail or wait)."""
        if shapes is _UNKNOWN:
            shapes = self._every_shape(x)
        if shapes is None:
            return tuple(s for (s,) in _exchange(self.mesh.comm(axes), [x.shape[dim]]))
        for group in self._groups_of(axes, shapes):
            if len({s[:dim] + s[dim + 1 :] for s in group}) > 1:
                raise operand_shapes_differ(op, self.fn_label, group, but=dim)  # type: ignore[attr-defined]
        mesh = self.mesh
        me = index_of(mesh.axis_names, mesh.my_coords, mesh._shape)
        mine = next(g for g in self._groups(axes) if me in g)
        return tuple(shapes[m][dim] for m in mine)

    def _same_shapes(self, op: str, x: torch.Tensor, axes, shapes: Any = _UNKNOWN) -> None:
        """The simulated mesh's error for members' operands of different shapes, for the first
        group that has them, raised on every rank alike (the shapes of every instance are
        exchanged first, unless given: gloo would fail or wait)."""
        if shapes is _UNKNOWN:
            shapes = self._every_shape(x)
        for group in self._groups_of(axes, shapes or []) if shapes is not None else ():
            if any(s != group[0] for s in group):
                raise operand_shapes_differ(op, self.fn_label, group)  # type: ignore[attr-defined]

    def all_gather_tiled(self, x, axes, dim, sizes=None):
        comm = self.mesh.comm(axes)
        if sizes is None:
            sizes = tuple(s for (s,) in _exchange(comm, [x.shape[dim]]))
        if min(sizes) == max(sizes):
            return super().all_gather_tiled(x, axes, dim)  # type: ignore[misc]
        stacked = comm.all_gather(_pad(x, dim, max(sizes)))
        return torch.cat([b.narrow(dim, 0, s) for b, s in zip(stacked.unbind(0), sizes)], dim)

    def reduce_scatter_tiled(self, x, axes, dim, sizes=None):
        comm = self.mesh.comm(axes)
        if sizes is None:
            sizes = chunk_sizes(x.shape[dim], comm.n)
        if min(sizes) == max(sizes):
            return super().reduce_scatter_tiled(x, axes, dim)  # type: ignore[misc]
        top = max(sizes)
        stacked = torch.stack([_pad(b, dim, top) for b in x.split(list(sizes), dim)])
        return comm.reduce_scatter(stacked).narrow(dim, 0, sizes[comm.index])

    def own_block_tiled(self, x, axes, dim, sizes):
        i = self.mesh.comm(axes).index
        return x.narrow(dim, sum(sizes[:i]), sizes[i])


def refuse_transforms(ctx, traced: bool) -> None:
    """A call under a torch.func transform (or traced by ``make_fx``) takes even blocks only,
    as on the simulated mesh, whose per-instance execution cannot run under one."""
    if traced or torch_private.transforms_active():
        raise SpmdError(
            f"spmd_map of {ctx.fn_label}: a call with blocks of unequal sizes cannot run under "
            "a torch.func transform (as on the simulated mesh, whose per-instance execution "
            "cannot). Fix: use even blocks (pad the dim), or Tensor.backward / "
            "torch.autograd.grad around the call."
        )


# --- inputs --------------------------------------------------------------------------------------


def local_input(ctx, leaf, spec: PartitionSpec, i: int):
    """This rank's block of argument leaf ``i`` in an uneven call."""
    mesh = ctx.mesh
    if not isinstance(leaf, torch.Tensor) or is_even(leaf.shape, spec, mesh._shape):
        return io.local_input(ctx, leaf, spec, i)
    if isinstance(leaf, DTensor):
        return _dtensor_input(ctx, leaf, spec, i)
    if leaf.device.type != mesh.device.type:
        leaf = leaf.to(mesh.device)
    if spec.unreduced or spec.reduced:
        return io._partial_input(ctx, leaf, spec, _scatter)
    return _scatter(leaf, ctx, spec)


def _scatter(leaf: torch.Tensor, ctx, spec: PartitionSpec) -> torch.Tensor:
    if differentiable(leaf):
        return _ScatterUneven.apply(leaf, ctx, spec)
    return block(leaf, spec, ctx.mesh._shape, ctx.mesh.my_coords)


class _ScatterUneven(torch.autograd.Function):
    """Global value -> this rank's block of an uneven split; backward gathers the gradient's
    blocks (every rank holds the global gradient, as on the simulated mesh)."""

    @staticmethod
    def forward(x, ctx, spec):
        return block(x, spec, ctx.mesh._shape, ctx.mesh.my_coords)

    @staticmethod
    def setup_context(node, inputs, output):
        node.spmd, node.spec, node.shape = inputs[1], inputs[2], tuple(inputs[0].shape)
        node.modes = active()

    @staticmethod
    def backward(node, g):
        sizes = _split_sizes(node.spec, node.shape, node.spmd.mesh._shape)
        return gather(node.spmd, g, node.spec, sizes, "backward", node.modes), None, None


def _split_sizes(spec: PartitionSpec, shape, mesh_sizes) -> list[Sizes | None]:
    """Per dim of a global ``shape``: its blocks' sizes in member order, None where unsplit."""
    return [
        dim_sizes(spec, d, n, mesh_sizes) if spec.entry_axes(d) else None
        for d, n in enumerate(shape)
    ]


def _dtensor_input(ctx, leaf: DTensor, spec: PartitionSpec, i: int) -> torch.Tensor:
    """A DTensor whose Shard blocks differ in size: its local block, where the spec's blocks
    are DTensor's (torch.chunk's over one mesh axis per dim)."""
    where = f"spmd_map of {ctx.fn_label}: argument leaf {i}"
    sizes = ctx.mesh._shape
    for d, n in enumerate(leaf.shape):
        axes = [a for a in spec.entry_axes(d) if sizes[a] > 1]
        blocks = dim_sizes(spec, d, n, sizes) if axes else ()
        if len(set(blocks)) <= 1:
            continue
        if len(axes) > 1:
            raise SpecError(
                f"{where} is a DTensor whose dim {d} ({n}) is split unevenly over {tuple(axes)}: "
                "DTensor splits it over one mesh dim after the other (torch.chunk of a chunk), "
                f"which gives other blocks than the spec {spec!r} (torch.chunk over the group of "
                f"{group_size(axes, sizes)}). Fix: pass the global value as a plain tensor "
                "(x.full_tensor()), or split the dim over one axis."
            )
        if blocks != chunk_sizes(n, sizes[axes[0]]):
            raise SpecError(
                f"{where} is a DTensor, whose Shard blocks are torch.chunk's "
                f"{chunk_sizes(n, sizes[axes[0]])} along dim {d}, but its in_spec {spec!r} "
                f"gives {blocks}. Fix: pass the global value as a plain tensor "
                "(x.full_tensor()), or give the in_spec without sizes."
            )
    return io._from_dtensor(ctx, leaf, spec, i, False, uneven_to_local)


# --- outputs -------------------------------------------------------------------------------------


def outputs(ctx, outs: list[torch.Tensor], specs: list[PartitionSpec]) -> list[torch.Tensor]:
    """The call's outputs, from every rank's blocks of unequal sizes (see the module doc)."""
    mesh = ctx.mesh
    ctx.record_shapes()  # (before its exchange: its failure is on every rank alike)
    split = [not mesh.single_axes.issuperset(s.axes) for s in specs]
    if not any(split):
        return [io.global_output(ctx, y, s) for y, s in zip(outs, specs)]
    mine = [n for y, cut in zip(outs, split) if cut for n in y.shape]
    rows = _exchange(
        mesh.comm(mesh.axis_names), mine
    )  # every rank's shapes, row-major over the mesh
    result, at = [], 0
    for y, spec, cut in zip(outs, specs, split):
        if not cut:
            result.append(io.global_output(ctx, y, spec))
            continue

        result.append(_output(ctx, y, spec, _shapes_of(ctx, rows, at, y.dim())))
        at += y.dim()
    return result


def _shapes_of(ctx, rows: list[list[int]], at: int, rank: int):
    """The block shape of one output (its dims at ``at`` of every rank's row) held by the
    instance at ``coords`` (this rank's coordinates elsewhere)."""
    mesh = ctx.mesh

    def shape_at(coords) -> list[int]:
        row = rows[index_of(mesh.axis_names, {**mesh.my_coords, **coords}, mesh._shape)]
        return row[at : at + rank]

    return shape_at


def _output(ctx, y: torch.Tensor, spec: PartitionSpec, shape_at) -> torch.Tensor:
    mesh = ctx.mesh
    names, sizes = mesh.axis_names, mesh._shape
    problem = grid_problem(shape_at, y.dim(), spec, sizes, names)  # the same on every rank
    if problem is not None:
        raise SpecError(f"spmd_map of {ctx.fn_label}: {problem}")
    if spec.explicit:  # the sizes a Blocks entry gives must be the blocks' (as simulated)
        named = [a for a in names if a in spec.axes]
        zeros = dict.fromkeys(names, 0)
        shapes = [
            shape_at({**zeros, **coords_of(b, named, sizes)})
            for b in range(group_size(named, sizes))
        ]
        problem = given_sizes_problem(shapes, spec, sizes, named)
        if problem is not None:
            raise SpecError(f"spmd_map of {ctx.fn_label}: {problem}")
    per_dim: list[Sizes | None] = []
    for d in range(y.dim()):
        axes = spec.entry_axes(d)
        per_dim.append(
            tuple(shape_at(coords_of(m, axes, sizes))[d] for m in range(group_size(axes, sizes)))
            if axes
            else None
        )
    if all(s is None or min(s) == max(s) for s in per_dim):
        return io.global_output(ctx, y, spec)
    y = io.local_output(ctx, y, spec)
    shape = tuple(y.shape[d] if s is None else sum(s) for d, s in enumerate(per_dim))
    if _dtensor_holds(spec, per_dim, sizes) and not _plain_wanted(y):
        return uneven_from_local(mesh, y, placements(mesh, spec, y.dim()), shape)
    unreduced = tuple(a for a in names if a in spec.unreduced and a not in mesh.single_axes)
    if unreduced:  # parts of the value: their sum, as the simulated mesh returns
        y = io._boundary(ctx, "psum", y, unreduced, ())
    return gather(ctx, y, spec, per_dim, "forward")


def _plain_wanted(y: torch.Tensor) -> bool:
    """Where a DTensor cannot be returned: a forward-mode tangent (no DTensor rule for it)."""
    return torch_private.forward_level() >= 0 and io._has_tangent(y)


def _dtensor_holds(spec: PartitionSpec, per_dim: list[Sizes | None], sizes) -> bool:
    """Whether DTensor's ``Shard`` has these blocks: each unequal split over one (non-trivial)
    axis, in torch.chunk's sizes."""
    for d, blocks in enumerate(per_dim):
        if blocks is None or min(blocks) == max(blocks):
            continue
        axes = [a for a in spec.entry_axes(d) if sizes[a] > 1]
        if len(axes) > 1 or blocks != chunk_sizes(sum(blocks), sizes[axes[0]]):
            return False
    return True


def gather(
    ctx,
    g: torch.Tensor,
    spec: PartitionSpec,
    per_dim: list[Sizes | None],
    direction: str,
    modes: list | None = None,
) -> torch.Tensor:
    """The global value of which every rank holds its block ``g`` of the sizes ``per_dim``
    (per dim, the blocks' sizes in member order): one all_gather of the blocks padded to the
    largest, trimmed and concatenated (recorded as a boundary all_gather in ``direction``)."""
    mesh = ctx.mesh
    sizes = mesh._shape
    padded = g
    for d, blocks in enumerate(per_dim):
        if blocks is not None:
            padded = _pad(padded, d, max(blocks))
    if differentiable(padded):
        stacked = io._boundary(
            ctx, "all_gather", padded, spec.axes, (0, False, "invariant"), direction, modes
        )
    else:
        modes = active() or modes
        if modes:
            io._record(modes, "all_gather", padded, spec.axes, direction)
        stacked = mesh.comm(spec.axes).all_gather(padded, "gradient of a plain input")
    pieces = []
    for m, piece in enumerate(stacked.unbind(0)):
        coords = coords_of(m, spec.axes, sizes)
        for d, blocks in enumerate(per_dim):
            if blocks is not None:
                piece = piece.narrow(d, 0, blocks[index_of(spec.entry_axes(d), coords, sizes)])
        pieces.append(piece)
    return concat_blocks(pieces, spec, sizes, spec.axes)
