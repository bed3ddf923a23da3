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
    the host (one synchronisation), the rows sent alone, then placed at their offsets in a zero
    ``[m, ...]`` buffer. ``told``: this member's problem row (the forward's; None: a transpose,
    whose sizes the forward checked), sent with the rows (see the module doc). Every slice lies
    within ``x`` (the forward's sizes are the agreed ones)."""
    comm = ctx.mesh.comm(axes)
    off, size, at, got = torch.stack(list(meta)).tolist()
    per = len(size) // comm.n  # slots per member
    pieces = [x[o : o + s] for o, s in zip(off, size)]
    sent = [sum(size[j * per : (j + 1) * per]) for j in range(comm.n)]
    back = [sum(got[j * per : (j + 1) * per]) for j in range(comm.n)]
    if told is None:
        arrived = comm.all_to_all_rows(torch.cat(pieces), sent, back, _NAME).split(back)
    else:
        arrived = _told_rows(ctx, axes, x, pieces, (sent, back), told)
    out = x.new_zeros((m, *x.shape[1:]))
    for j, rows in enumerate(arrived):  # member j's slots, in slot order
        mine = slice(j * per, (j + 1) * per)
        for start, piece in zip(at[mine], rows.split(got[mine])):
            out[start : start + piece.shape[0]] = piece
    return out


def _told_rows(
    ctx: DistributedContext,
    axes: Axes,
    x: torch.Tensor,
    pieces: list[torch.Tensor],
    splits: tuple[list[int], list[int]],
    told: tuple[int, ...],
) -> list[torch.Tensor]:
    """The rows received from each member (in member order), each member's block behind the
    head of its sender's problem row; raises the first member's problem on every member alike.
    ``pieces``: the slots' rows, member by member; ``splits``: the rows sent to and received
    from each member."""
    comm = ctx.mesh.comm(axes)
    sent, back = splits
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row
    head = torch.zeros(_HEAD, dtype=torch.int64, device=x.device)  # (NCCL sends device tensors)
    head[: len(told)] = torch.tensor(told, device=x.device)
    heads = _HEAD * 8  # a head's bytes

    def length(r: int) -> int:  # a block's bytes: its head, its rows, padding to _ALIGN
        return -(-(heads + r * row) // _ALIGN) * _ALIGN

    lengths = [length(s) for s in sent]
    # zeros: the padding is never read, but the bytes on the wire stay deterministic
    buffer = torch.zeros(sum(lengths), dtype=torch.uint8, device=x.device)
    pieces_left = iter(pieces)
    start = 0
    for block_bytes in lengths:  # each member's block: the head, then its slots' rows
        buffer[start : start + heads] = head.view(torch.uint8)
        at = start + heads
        for _ in range(len(pieces) // comm.n):
            piece = _bytes(next(pieces_left))
            buffer[at : at + piece.numel()] = piece
            at += piece.numel()
        start += block_bytes
    sizes = [length(r) for r in back]
    received = comm.all_to_all_rows(buffer, lengths, sizes, _NAME).split(sizes)
    told_by = [block[:heads].view(torch.int64).tolist() for block in received]
    first = next((i for i, t in enumerate(told_by) if t[0]), None)
    if first is not None:
        error = problem_error(ctx.fn_label, axes, first, tuple(told_by[first]))
        raise ctx.alike(error) if comm.n == ctx.mesh.size else error
    if row == 0:  # (rows of no elements: nothing moved but the heads)
        return [x.new_zeros((r, *x.shape[1:])) for r in back]
    # (each block starts at a multiple of _ALIGN, of every element size: viewed, not copied)
    each = [block[heads : heads + r * row] for block, r in zip(received, back)]
    return [b.view(x.dtype).view(-1, *x.shape[1:]) for b in each]


#: int64 before each block: a problem row, padded to an even count (a multiple of _ALIGN bytes)
_HEAD = PROBLEM + PROBLEM % 2
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
