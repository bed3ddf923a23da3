"""Blocks of unequal sizes on a real mesh: each rank holds its own block.

A call takes uneven blocks where the simulated mesh does (``ns.simulate_per_instance()`` active,
or an input's ``Blocks`` entry giving unequal sizes), so that both accept and refuse the same
inputs; such a call runs with ``_dist_uneven_primitives.UnevenPrimitives`` and its inputs and
outputs go through here. An even call's outputs do where its function read a value that
varies (``DistributedContext.compares_outputs``: its ranks may return other shapes); its path
is ``_dist_io`` otherwise.

* Inputs: a plain tensor's block is cut by ``_layout.block`` (torch.chunk's blocks, or the
  ``Blocks`` sizes); its gradient gathers the blocks padded to the largest (gloo gathers equal
  sizes only) and trims them. A ``DTensor`` whose ``Shard`` blocks differ in size gives its
  local block (DTensor splits as torch.chunk does), its gradient a DTensor of its global shape.
* Outputs: one exchange per call (:func:`agree`; one all-reduce of a flag where every rank's
  row is the one of the signature's last call) of every rank's output tree, out_specs error
  and every output's block rank, dtype, type axes, whether it requires grad, and shape (a few
  integers, in rows of one width: ranks may return other trees or blocks of other ranks, or
  fail the out_specs check alone, which every rank then tells alike). After a read of a
  varying value that exchange is the end-of-call meeting (``_dist_steps.meet``, the ranks
  may have branched apart): an output requiring grad whose type differs between ranks is
  refused there on every rank. Then a ``DTensor`` of the global
  shape where DTensor can hold the blocks (torch.chunk's, each split dim over one axis), else
  the global value as a plain tensor on every rank (one padded all_gather), as the simulated
  mesh returns it.
* Collectives: :class:`UnevenPrimitives` (``_dist_uneven_primitives``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_private as torch_private
from .._accounting import active
from .._autodiff import differentiable
from .._errors import SpecError, SpmdError, VmaError, invariant_differs
from .._layout import (
    block,
    chunk_sizes,
    concat_blocks,
    coords_of,
    coords_text,
    dim_sizes,
    dtensor_holds,
    group_size,
    index_of,
    instances_problem,
    is_even,
    layout_problem,
)
from .._spec import PartitionSpec
from . import _dist_io as io
from . import _dist_plain as plain
from ._dist_comm import dtype_code, dtype_of
from ._dist_dtensor import placements, uneven_from_local, uneven_to_local
from ._dist_steps import HEAD as _HEAD
from ._dist_steps import KIND as _KIND
from ._dist_steps import SLOTS as _SLOTS
from ._dist_steps import WIDTH as _WIDTH
from ._dist_steps import exchange, meet
from ._dist_uneven_first import (
    as_first,
    differing,
    differs,
    first_coords,
    refuse_grads_apart,
    where_apart,
)
from ._dist_uneven_primitives import all_true, pad

if TYPE_CHECKING:
    from .._call import Call

Sizes = tuple[int, ...]


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
        return plain.partial_input(ctx, leaf, spec, _scatter)
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
    def jvp(node, gx, *_):  # forward mode: the tangent's block, as the value's
        return block(gx, node.spec, node.spmd.mesh._shape, node.spmd.mesh.my_coords)

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
    are DTensor's (:func:`dtensor_holds`)."""
    where = f"spmd_map of {ctx.fn_label}: argument leaf {i}"
    sizes = ctx.mesh._shape
    for d, n in enumerate(leaf.shape):
        axes = [a for a in spec.entry_axes(d) if sizes[a] > 1]
        blocks = dim_sizes(spec, d, n, sizes) if axes else ()
        if len(set(blocks)) <= 1:
            continue
        if len(axes) > 1:
            if dtensor_holds(spec, [None] * d + [blocks], sizes):
                continue
            raise SpecError(
                f"{where} is a DTensor whose dim {d} ({n}) is split unevenly over {tuple(axes)}: "
                "DTensor splits it over one mesh dim after the other (torch.chunk of a chunk), "
                f"which gives other blocks than the spec {spec!r} (torch.chunk over the group of "
                f"{group_size(axes, sizes)}: {blocks}). Fix: pass the global value as a plain "
                "tensor (x.full_tensor()), or split the dim over one axis."
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


def agree(ctx, outs: list[torch.Tensor], call: Call) -> list[tuple]:
    """Every rank's outputs compared (one exchange: :func:`_every_block`; where they are the
    signature's last call's, one all-reduce: :func:`_recalled_blocks`), so that the ranks
    raise alike what the simulated mesh raises: first the error of the first instance whose
    out_specs check failed (``Call.out_error``: a rank that raised it has no ``outs``), then
    outputs that differ between ranks (trees, ranks, layouts). Else, per output, its layout
    (:func:`_layouts`), worked out once per every rank's shapes and kept on the mesh."""
    mesh = ctx.mesh
    ctx.record_shapes()  # (before its exchange: its failure is on every rank alike)
    failed = call.out_error
    told = (0, 0) if failed is None else (_KINDS.index(_kind(failed)) + 1, len(_text(failed)))
    structure = (0, 0) if failed is not None else call.structure()
    ys = [(y, differs(ctx, y), differentiable(y)) for y in outs]
    if ctx.values_read:  # the ranks may have branched: all meet at the end first, with their rows
        row = list(_row(structure, told, ys, _SLOTS, _WIDTH))
        met = tuple(map(tuple, meet(ctx, None, mesh.axis_names, row)))
        rows, width = _every_block(mesh, structure, told, ys, met)
    else:
        rows, width = _recalled_blocks(ctx, structure, told, ys) or _every_block(
            mesh, structure, told, ys
        )
    first = next((i for i, row in enumerate(rows) if row[2]), None)
    if first is not None:
        raise _first_failure(ctx, rows[first], first, failed)
    specs = call.out_specs()
    key = (rows, tuple(specs), ctx.checked)  # all that _layouts reads
    layouts = mesh.uneven_outputs.get(key)
    if layouts is None:
        layouts = _layouts(ctx, rows, width, outs, specs, call.out_wheres())
        if len(mesh.uneven_outputs) >= _KEPT:
            mesh.uneven_outputs.clear()
        mesh.uneven_outputs[key] = layouts
    ctx.record_rows((width, rows))  # (no rank raised: every rank records them)
    return layouts


def outputs(ctx, outs: list[torch.Tensor], call: Call, layouts: list[tuple]) -> list[torch.Tensor]:
    """The call's outputs from every rank's blocks of unequal sizes, laid out as
    :func:`agree` found (see the module doc); a local call's: this rank's blocks."""
    out = []
    for y, spec, (per_dim, first, apart, differ) in zip(outs, call.out_specs(), layouts):
        y = differing(ctx, y, spec, differ)
        if apart is not None:  # check_vma=False (else _layouts raised)
            y = as_first(ctx, y, spec, first, apart[2])
        if call.local:
            out.append(io.local_output(ctx, y, spec))
        elif per_dim is None:
            out.append(io.global_output(ctx, y, spec))
        else:
            out.append(_output(ctx, y, spec, per_dim))
    return out


_KEPT = 64  # the output layouts a mesh keeps (a repeated call finds its own)
# The classes of an out_specs error that a rank tells the others (another: an SpmdError).
_KINDS: tuple[type[SpmdError], ...] = (SpmdError, SpecError, VmaError)


def _kind(e: SpmdError) -> type[SpmdError]:
    return type(e) if type(e) in _KINDS else SpmdError


def _text(e: SpmdError) -> bytes:
    return str(e).encode()


def _first_failure(ctx, row: Sequence[int], first: int, failed: SpmdError | None) -> SpmdError:
    """The error of instance ``first``'s out_specs check (``row``: its row of
    :func:`_every_block`), raised on every rank: its own there, elsewhere one of its class and
    message (one broadcast of the message from that rank), as the simulated mesh raises the
    first failing instance's error."""
    mesh = ctx.mesh
    comm = mesh.comm(mesh.axis_names)
    kind, length = row[2], row[3]
    own = failed if comm.index == first else None
    sent = (
        torch.zeros(length, dtype=torch.int64, device=mesh.device)
        if own is None
        else torch.tensor(list(_text(own)), dtype=torch.int64, device=mesh.device)
    )
    text = bytes(comm.broadcast(sent, first, "out_specs error").tolist()) if length else b""
    error = own if own is not None else _KINDS[kind - 1](text.decode())
    if hasattr(error, "add_note"):  # (Python 3.11)
        coords = coords_text(coords_of(first, mesh.axis_names, mesh._shape))
        error.add_note(
            f"[named_spmd] the out_specs check failed on rank {comm.tuple_ranks[first]} (mesh "
            f"coordinates {coords}), the first instance where it failed; every rank raises "
            "this error, and the next call runs."
        )
    return ctx.alike(error)


def _recalled_blocks(
    ctx, structure: tuple[int, int], told: tuple[int, int], ys: list[tuple]
) -> tuple[tuple[tuple[int, ...], ...], int] | None:
    """The rows of :func:`_every_block` where they are those of the signature's last call,
    which every rank recalls alike (the start-of-call check compared them): each rank compares
    its own row with its recalled one, and one all-reduce tells whether every rank's matched
    (a row holds everything the rows are read for, so equal rows give the same outputs, errors
    and layouts). None: nothing recalled, or some rank's row differs (then the exchange)."""
    recalled = ctx.recalled_rows()
    if recalled is None:
        return None
    width, rows = recalled
    mesh = ctx.mesh
    slots = (len(rows[0]) - _HEAD) // (_KIND + width)
    mine = _row(structure, told, ys, slots, width)
    me = index_of(mesh.axis_names, mesh.my_coords, mesh._shape)
    if not all_true(mesh.check_comm(), mine == rows[me], "the outputs' block shapes"):
        return None
    return rows, width


def _row(
    structure: tuple[int, int], told: tuple[int, int], ys: list[tuple], slots, width
) -> tuple[int, ...]:
    """This rank's row of :func:`_every_block` in ``slots`` slots of ``width`` dims."""
    mine = [*structure, *told]
    for y, apart, grad in ys[:slots]:
        mine += [y.dim(), dtype_code(y.dtype), apart, int(grad), *y.shape[:width]]
        mine += [0] * (width - y.dim())
    mine += [0] * (_slot(slots, width) - len(mine))
    return tuple(mine)


def _every_block(
    mesh, structure: tuple[int, int], told: tuple[int, int], ys: list[tuple], met=None
) -> tuple[tuple[tuple[int, ...], ...], int]:
    """Every rank's row, row-major over the mesh: its output tree's ``structure``
    (``Call.structure``), its out_specs error ``told`` (its class in :data:`_KINDS` from 1, the
    length of its message; zeros: none), then a slot per output block ``ys`` (the first
    ``slots``): the block's rank, dtype, the axes its type differs over (``differs``), whether
    it requires grad (``differentiable``) and its shape in ``width`` dims, zeros after and in
    unused slots, so that no row's length depends on what the rank returned (gloo gathers one
    length; every rank then tells a difference alike). One exchange; another of wider rows
    where every rank returned the same tree, of more than :data:`_SLOTS` outputs or blocks of
    more than :data:`_WIDTH` dims. Returns the rows and their slots' ``width``. ``met``: the
    first exchange's rows, where the ranks met with them (``_dist_steps.meet``)."""
    comm, slots, width = mesh.comm(mesh.axis_names), _SLOTS, _WIDTH
    while True:
        mine = list(_row(structure, told, ys, slots, width))
        rows = met if met is not None else tuple(map(tuple, exchange(comm, mine)))
        met = None
        if any(row[2] or row[:2] != rows[0][:2] for row in rows):  # (agree tells it)
            return rows, width
        count = rows[0][0]
        ranks = [row[_slot(k, width)] for row in rows for k in range(min(count, slots))]
        widest = max(ranks, default=0)
        if count <= slots and widest <= width:
            return rows, width
        slots, width = max(slots, count), max(width, widest)


def _slot(j: int, width: int) -> int:
    """Where output ``j``'s slot starts in a row of :func:`_every_block` (after its
    :data:`_HEAD`; each slot: :data:`_KIND` integers, then ``width`` dims)."""
    return _HEAD + j * (_KIND + width)


def _layouts(ctx, rows, width: int, outs, specs, wheres) -> list[tuple]:
    """Per output, its blocks' sizes per dim (:func:`_blocks_of`; None: not split; an output
    of no axis of the mesh's is its own rank's block), the block shape and dtype of the
    ``first_coords`` instance where this rank's differ (else None) and ``where_apart``
    (``_dist_uneven_first``), from every rank's row (:func:`_every_block`). The simulated
    mesh's errors, in its order (raised on every rank alike: every rank has every row):
    different trees or blocks of a rank the out_specs refuse, then per output its layout's,
    then (``check_vma``) blocks that differ where it is typed invariant."""
    mesh = ctx.mesh

    def shape_of(i: int, j: int) -> list[int]:
        at = _slot(j, width)
        return rows[i][at + _KIND : at + _KIND + rows[i][at]]

    problem = instances_problem(
        f"spmd_map of {ctx.fn_label}",
        [(row[0], row[1]) for row in rows],
        shape_of,
        specs,
        wheres,
        mesh._shape,
    )
    if problem is not None:
        raise ctx.alike(problem)
    layouts = []
    for j, (y, spec, where) in enumerate(zip(outs, specs, wheres)):
        kinds, shape_at = _kinds_and_shapes(ctx, rows, _slot(j, width), spec)
        per_dim = None
        if not mesh.single_axes.issuperset((*spec.axes, *spec.unreduced)):
            per_dim = _blocks_of(ctx, y, spec, kinds, shape_at, where)
        apart = where_apart(mesh, spec, kinds, shape_at)
        if apart is not None and ctx.checked:  # (every rank has every row: raised alike)
            axes = [a for a in apart[1] if apart[1][a] != apart[0][a]]
            texts = (coords_text(apart[0]), coords_text(apart[1]))
            raise ctx.alike(invariant_differs(ctx.fn_label, where, spec, axes, *texts))
        first = (
            tuple(shape_at({})),
            kinds[index_of(mesh.axis_names, first_coords(mesh, spec), mesh._shape)][1],
        )
        mine = None if first == (tuple(y.shape), y.dtype) else first
        differ = 0
        for row in rows:
            differ |= row[_slot(j, width) + 2]
        layouts.append((per_dim, mine, apart, differ))
    refuse_grads_apart(ctx, rows, [_slot(j, width) for j in range(len(wheres))], wheres)
    return layouts


def _kinds_and_shapes(
    ctx, rows: list[list[int]], at: int, spec: PartitionSpec
) -> tuple[list, Callable]:
    """The output at ``at`` (under ``spec``) in every rank's row (:func:`_every_block`): every
    instance's block rank and dtype, and the block shape of the instance at ``coords`` (the
    ``first_coords`` one's elsewhere)."""
    mesh = ctx.mesh
    kinds = [(row[at], dtype_of(row[at + 1])) for row in rows]
    base = first_coords(mesh, spec)

    def shape_at(coords) -> list[int]:
        row = rows[index_of(mesh.axis_names, {**base, **coords}, mesh._shape)]
        return row[at + _KIND : at + _KIND + row[at]]

    return kinds, shape_at


def _blocks_of(ctx, y: torch.Tensor, spec: PartitionSpec, kinds, shape_at, where: str) -> tuple:
    """Per dim of output ``y``, its blocks' sizes in member order (None where unsplit), from
    every instance's block rank and dtype (``kinds``) and shape (``shape_at``); the simulated
    mesh's error where they cannot be laid out under ``spec`` (raised on every rank alike:
    every rank has every row)."""
    mesh = ctx.mesh
    names, sizes = mesh.axis_names, mesh._shape
    problem = layout_problem(kinds, shape_at, spec, sizes, names, where)
    if problem is not None:
        raise ctx.alike(SpecError(f"spmd_map of {ctx.fn_label}: {problem}"))
    per_dim: list[Sizes | None] = []
    for d in range(y.dim()):
        axes = spec.entry_axes(d)
        per_dim.append(
            tuple(shape_at(coords_of(m, axes, sizes))[d] for m in range(group_size(axes, sizes)))
            if axes
            else None
        )
    return tuple(per_dim)


def _output(ctx, y: torch.Tensor, spec: PartitionSpec, per_dim: tuple) -> torch.Tensor:
    """Output ``y`` whose blocks have the sizes ``per_dim`` (:func:`_blocks_of`): a DTensor of
    the global shape, or the global value (see the module doc)."""
    mesh = ctx.mesh
    names, sizes = mesh.axis_names, mesh._shape
    if all(s is None or min(s) == max(s) for s in per_dim):
        return io.global_output(ctx, y, spec)
    y = io.local_output(ctx, y, spec)
    shape = tuple(y.shape[d] if s is None else sum(s) for d, s in enumerate(per_dim))
    if dtensor_holds(spec, per_dim, sizes) and not _plain_wanted(y):
        return uneven_from_local(mesh, y, placements(mesh, spec, y.dim()), shape)
    unreduced = tuple(a for a in names if a in spec.unreduced and a not in mesh.single_axes)
    if unreduced:  # parts of the value: their sum, as the simulated mesh returns
        y = plain.boundary_collective(ctx, "psum", y, unreduced, ())
    return gather(ctx, y, spec, list(per_dim), "forward")


def _plain_wanted(y: torch.Tensor) -> bool:
    """Where a DTensor cannot be returned: a forward-mode tangent (no DTensor rule for it)."""
    return io._has_tangent(y)


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
            padded = pad(padded, d, max(blocks))
    if differentiable(padded):
        stacked = plain.boundary_collective(
            ctx, "all_gather", padded, spec.axes, (0, False, "invariant"), direction, modes
        )
    else:
        modes = active() or modes
        if modes:
            plain.record_boundary(modes, "all_gather", padded, spec.axes, direction)
        stacked = mesh.comm(spec.axes).all_gather(padded, "gradient of a plain input")
    pieces = []
    for m, piece in enumerate(stacked.unbind(0)):
        coords = coords_of(m, spec.axes, sizes)
        for d, blocks in enumerate(per_dim):
            if blocks is not None:
                piece = piece.narrow(d, 0, blocks[index_of(spec.entry_axes(d), coords, sizes)])
        pieces.append(piece)
    return concat_blocks(pieces, spec, sizes, spec.axes)
