"""``ragged_all_to_all``'s rows on a real mesh: one ``all_to_all_single`` with split sizes.

The forward's exchange also tells every member each member's problem (``ragged._problem``:
sizes that disagree with a peer's, a slice outside a buffer), in a head of ``ragged.PROBLEM``
int64 before each block of rows, so that every member of the group raises the first member's
error, with no collective of its own: a member that raised alone would leave the others inside
the exchange, and the mesh out of step. Every member sends by the sizes both ends of each slot
read alike from the metadata exchange, which carries each member's operand and output rows
(``ragged._agreed_sizes``: 0 for a slot whose sizes disagree or whose slice misses a buffer),
so the exchange pairs sizes that agree and allocates no more than the buffers hold; no rows are
placed where any member told a problem.

Where the group is the whole mesh, every rank raises the error alike and the mesh stays in step.
Where it is a sub-group (an axis of a larger mesh), only its members learn the problem: they
raise the ``CollectiveError``, while the ranks of the other groups, which saw none, go on and
raise ``RankFailedError`` naming a failing rank and its error at their next exchange over the
mesh (the outputs' block sizes, or a collective of theirs); every later call on the mesh then
raises ``SpmdError`` (its process groups are out of step: restart the job).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .. import _torch_private as torch_private
from .._collectives.ragged import PROBLEM, problem_error, problem_row
from .._errors import CollectiveError

if TYPE_CHECKING:
    from .._context import Axes, SpmdContext
    from .distributed import DistributedContext

_NAME = "ragged_all_to_all"


def ragged_rows(
    ctx: DistributedContext,
    axes: Axes,
    x: torch.Tensor,
    m: int,
    meta: tuple[torch.Tensor, ...],
    told: tuple[int, ...] | None,
) -> torch.Tensor:
    """``SpmdContext.ragged_all_to_all`` on a real mesh: the offsets and sizes ``meta`` read on
    the host (one synchronisation), the rows sent alone, then placed at their offsets in an
    ``[m, ...]`` buffer, zeroed in a transpose. ``told``: this member's problem row (the
    forward's; None: a transpose, whose sizes the forward checked), sent with the rows (see the
    module doc); the forward's result is read only where rows were written
    (``ragged_all_to_all`` takes ``output``'s elsewhere), so its other rows are left unset
    there, not zeroed. Every slice lies within ``x`` (the forward's sizes are the agreed
    ones)."""
    comm = ctx.mesh.comm(axes)
    off, size, at, got = torch.stack(meta).tolist()
    per = len(size) // comm.n  # slots per member
    sent = [sum(size[j * per : (j + 1) * per]) for j in range(comm.n)]
    back = [sum(got[j * per : (j + 1) * per]) for j in range(comm.n)]
    if told is None:
        pieces = [x[o : o + s] for o, s in zip(off, size) if s] or [x[:0]]
        arrived = comm.all_to_all_rows(torch.cat(pieces), sent, back, _NAME).split(back)
    else:
        arrived = _told_rows(ctx, axes, x, (off, size), (sent, back), told)
    out = (x.new_zeros if told is None else x.new_empty)((m, *x.shape[1:]))
    for j, rows in enumerate(arrived):  # member j's slots, in slot order
        row = 0
        for k in range(j * per, (j + 1) * per):
            s = got[k]
            if s:
                out[at[k] : at[k] + s] = rows[row : row + s]
                row += s
    return out


def _told_rows(
    ctx: DistributedContext,
    axes: Axes,
    x: torch.Tensor,
    slices: tuple[list[int], list[int]],
    splits: tuple[list[int], list[int]],
    told: tuple[int, ...],
) -> list[torch.Tensor]:
    """The rows received from each member (in member order), each member's block behind the
    head of its sender's problem row; raises the first member's problem on every member alike.
    ``slices``: the slots' offsets and sizes in ``x``, member by member; ``splits``: the rows
    sent to and received from each member."""
    comm = ctx.mesh.comm(axes)
    (off, size), (sent, back) = slices, splits
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row
    # (NCCL sends device tensors)
    head = torch.tensor((*told, *_PADDED[len(told) :]), dtype=torch.int64, device=x.device)
    parts: list[torch.Tensor] = []
    pad = None
    per = len(size) // comm.n
    for j, r in enumerate(sent):  # each member's block: the head, its slots' rows, padding
        parts.append(head.view(torch.uint8))
        for k in range(j * per, (j + 1) * per):
            if size[k]:
                parts.append(_bytes(x[off[k] : off[k] + size[k]]))
        padding = _length(r, row) - _HEAD_BYTES - r * row
        if padding:  # zeros: never read, but the bytes on the wire stay deterministic
            pad = head.new_zeros(_ALIGN // 8).view(torch.uint8) if pad is None else pad
            parts.append(pad[:padding])
    lengths = [_length(r, row) for r in sent]
    sizes = [_length(r, row) for r in back]
    received = comm.all_to_all_rows(torch.cat(parts), lengths, sizes, _NAME).split(sizes)
    told_by = torch.stack([b[:_HEAD_BYTES] for b in received]).view(torch.int64).tolist()
    first = next((i for i, t in enumerate(told_by) if t[0]), None)
    if first is not None:
        error = problem_error(ctx.fn_label, axes, first, tuple(told_by[first]))
        raise ctx.alike(error) if comm.n == ctx.mesh.size else error
    if row == 0:  # (rows of no elements: nothing moved but the heads)
        return [x.new_zeros((r, *x.shape[1:])) for r in back]
    # (each block starts at a multiple of _ALIGN, of every element size: viewed, not copied)
    each = [b[_HEAD_BYTES : _HEAD_BYTES + r * row] for b, r in zip(received, back)]
    return [b.view(x.dtype).view(-1, *x.shape[1:]) for b in each]


def _length(rows: int, row: int) -> int:
    """A block's bytes: its head, its ``rows`` of ``row`` bytes, padding to _ALIGN."""
    return -(-(_HEAD_BYTES + rows * row) // _ALIGN) * _ALIGN


#: int64 before each block: a problem row, padded to an even count (a multiple of _ALIGN bytes)
_HEAD = PROBLEM + PROBLEM % 2
_HEAD_BYTES = _HEAD * 8
_PADDED = (0,) * _HEAD  # a head's int64 past the problem row
_ALIGN = 16  # a block's bytes, a multiple of every element size (complex128's) and of int64's


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as their bytes (one dim of uint8): gloo moves them beside the int64 head; a
    view where they are contiguous and plain."""
    rows = rows.resolve_conj().resolve_neg().contiguous()
    return rows.reshape(-1).view(torch.uint8)


def checked_in_graph(
    ctx: SpmdContext,
    axes: Axes,
    member: int,
    metadata: tuple[torch.Tensor, torch.Tensor],
    rows: int,
    m: int,
) -> torch.Tensor:
    """``SpmdContext.checked_ragged`` in a traced graph on a real mesh (``torch.compile``,
    ``make_fx``) for this rank's ``member`` index in the group of ``axes``: the values are
    read when the graph runs, by ops of the graph. Each rank's problem row (and its member
    index) is gathered over the whole mesh, and every rank raises the first one's problem alike
    before any row moves: a rank that raised alone would leave the others inside the exchange,
    or, over a sub-group, the other groups' ranks inside their next collective over the mesh
    (a traced graph has no failure board to tell them). The metadata the exchange sends by come
    out of the check, which the graph then runs first."""
    meta, peer = metadata
    n = ctx.mesh.axis_size(axes)
    with torch_private.DisableTorchFunction():  # metadata of the exchange, no op of the program
        told = _ragged_problem(meta, peer, n, rows, m, member)
        every = ctx.all_gather(told, tuple(ctx.mesh.axis_names))
        try:
            checked = _ragged_checked(meta, every, ctx.fn_label, ",".join(axes))
        except CollectiveError as error:  # (raised while make_fx traces: in every rank's call)
            raise ctx.alike(error) from None
    return ctx.stamp(checked, ctx.vma(meta))


@torch.library.custom_op("named_spmd::ragged_problem", mutates_args=())
def _ragged_problem(
    meta: torch.Tensor, peer: torch.Tensor, n: int, rows: int, m: int, member: int
) -> torch.Tensor:
    """This member's :data:`PROBLEM` row (zeros: none) of its metadata and its peers', then
    its index in the group."""
    # (on meta's device and dtype, as the fake says: a graph on NCCL gathers it from the GPU)
    return meta.new_tensor(problem_row(meta.tolist(), peer.tolist(), n, rows, m) + (member,))


@_ragged_problem.register_fake
def _(
    meta: torch.Tensor, peer: torch.Tensor, n: int, rows: int, m: int, member: int
) -> torch.Tensor:
    return meta.new_empty(PROBLEM + 1)


@torch.library.custom_op("named_spmd::ragged_checked", mutates_args=())
def _ragged_checked(meta: torch.Tensor, every: torch.Tensor, label: str, axes: str) -> torch.Tensor:
    """``meta`` (a copy), where no rank told a problem in ``every`` (a row per rank of the
    mesh: its :data:`PROBLEM` row and its member index); else the first rank's error."""
    told = every.reshape(-1, PROBLEM + 1).tolist()
    first = next((t for t in told if t[0]), None)
    if first is not None:
        raise problem_error(label, tuple(axes.split(",")), first[PROBLEM], tuple(first[:PROBLEM]))
    return meta.clone()


@_ragged_checked.register_fake
def _(meta: torch.Tensor, every: torch.Tensor, label: str, axes: str) -> torch.Tensor:
    return torch.empty_like(meta)
