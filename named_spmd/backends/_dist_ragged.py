"""``ragged_all_to_all``'s rows on a real mesh: one ``all_to_all_single`` with split sizes.

The forward's exchange also tells every member each member's problem (``ragged._problem``:
sizes that disagree with a peer's, a slice outside a buffer), in a head of ``ragged.PROBLEM``
int64 before each block of rows, so that every
member of the group raises the first member's error alike, with no collective of its own: a
member that raised alone would leave the others inside the exchange, and the mesh out of step.
Where a member has a problem it sends by sizes both ends of each slot read alike
(``ragged._checked_values``), zeros for a slice outside its operand, so the exchange pairs
sizes that agree; no rows are placed where any member told one.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from .._collectives.ragged import problem_error

if TYPE_CHECKING:
    from .distributed import DistributedContext

_NAME = "ragged_all_to_all"


def ragged_rows(
    ctx: DistributedContext,
    axes,
    x: torch.Tensor,
    m: int,
    meta: tuple[torch.Tensor, ...],
    told: tuple[int, ...] | None,
) -> torch.Tensor:
    """``SpmdContext.ragged_all_to_all`` on a real mesh: the offsets and sizes ``meta`` read on
    the host (one synchronisation), the rows sent alone, then placed at their offsets in a zero
    ``[m, ...]`` buffer. ``told``: this member's problem row (the forward's; None: a transpose,
    whose sizes the forward checked), sent with the rows (see the module doc)."""
    comm = ctx.mesh.comm(axes)
    off, size, at, got = torch.stack(list(meta)).tolist()
    per = len(size) // comm.n  # slots per member
    pieces = [_piece(x, o, s) for o, s in zip(off, size)]
    sent = [sum(size[j * per : (j + 1) * per]) for j in range(comm.n)]
    back = [sum(got[j * per : (j + 1) * per]) for j in range(comm.n)]
    if told is None:
        arrived = comm.all_to_all_rows(torch.cat(pieces), sent, back, _NAME).split(back)
    else:
        arrived = _told_rows(ctx, axes, x, pieces, per, (sent, back), told)
    out = x.new_zeros((m, *x.shape[1:]))
    for j, rows in enumerate(arrived):  # member j's slots, in slot order
        mine = slice(j * per, (j + 1) * per)
        for start, piece in zip(at[mine], rows.split(got[mine])):
            out[start : start + piece.shape[0]] = piece
    return out


def _piece(x: torch.Tensor, offset: int, size: int) -> torch.Tensor:
    """Rows ``offset : offset + size`` of ``x``; zeros of ``size`` rows where they lie outside
    (a member with a problem sends them: its peers expect that many)."""
    if 0 <= offset and offset + size <= x.shape[0]:
        return x[offset : offset + size]
    return x.new_zeros((size, *x.shape[1:]))


def _told_rows(ctx, axes, x, pieces, per: int, splits, told) -> list[torch.Tensor]:
    """The rows received from each member (in member order), each member's block behind the
    head of its sender's problem row; raises the first member's problem on every member alike."""
    comm = ctx.mesh.comm(axes)
    sent, back = splits
    row = math.prod(x.shape[1:]) * x.element_size()  # bytes per row
    head = torch.zeros(_HEAD, dtype=torch.int64)
    head[: len(told)] = torch.tensor(told)
    head = head.view(torch.uint8)
    heads = head.numel()

    def length(r: int) -> int:  # a block's bytes: its head, its rows, padding to _ALIGN
        return -(-(heads + r * row) // _ALIGN) * _ALIGN

    blocks = []
    for j in range(comm.n):
        rows = _bytes(torch.cat(pieces[j * per : (j + 1) * per]))
        blocks += [head, rows, head.new_zeros(length(sent[j]) - heads - rows.numel())]
    sizes = [length(r) for r in back]
    got = comm.all_to_all_rows(torch.cat(blocks), [length(s) for s in sent], sizes, _NAME)
    received = got.split(sizes)
    told_by = [block[:heads].view(torch.int64).tolist() for block in received]
    first = next((i for i, t in enumerate(told_by) if t[0]), None)
    if first is not None:
        error = problem_error(ctx.fn_label, axes, first, tuple(told_by[first]))
        raise ctx.alike(error) if comm.n == ctx.mesh.size else error
    dtype = x.resolve_conj().resolve_neg().dtype
    if row == 0:  # (rows of no elements: nothing moved but the heads)
        return [x.new_zeros((r, *x.shape[1:])) for r in back]
    # (each block starts at a multiple of _ALIGN, of every element size: viewed, not copied)
    each = [block[heads : heads + r * row] for block, r in zip(received, back)]
    return [b.view(dtype).view(-1, *x.shape[1:]) for b in each]


_HEAD = 8  # int64 before each block: a problem row, padded
_ALIGN = 16  # a block's bytes, a multiple of every element size (complex128's) and of int64's


def _bytes(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as their bytes (one dim of uint8): gloo moves them beside the int64 head."""
    rows = rows.resolve_conj().resolve_neg().contiguous()
    return rows.reshape(-1).view(torch.uint8)
