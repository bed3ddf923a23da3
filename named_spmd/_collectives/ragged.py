"""ragged_all_to_all, with JAX's semantics: slices of rows of any sizes, sent by offsets and
sizes per peer, written at offsets into an output buffer. Every shape is static (the sizes and
offsets are int tensors), so it runs under vmap; the public function, then its record."""

from __future__ import annotations

import functools
import math
from typing import Any, NamedTuple, cast

import torch

from .._calls import current
from .._context import Axes, SpmdContext
from .._errors import CollectiveError
from .._layout import ragged_written
from .._torch_private import (
    DisableTorchFunction,
    batched_above,
    is_transform_wrapped,
)
from .._types import Vma
from ._record import PVARY, RECORDS, Collective, Params, backward_op, implicit_pvary, same_vma

AxisName = str | tuple[str, ...]


def ragged_all_to_all(
    operand: torch.Tensor,
    output: torch.Tensor,
    input_offsets: torch.Tensor,
    send_sizes: torch.Tensor,
    output_offsets: torch.Tensor,
    recv_sizes: torch.Tensor,
    axis_name: AxisName,
) -> torch.Tensor:
    """``ragged_all_to_all(operand: T{A,...}, output, ...) -> T{A,...}``: ``jax.lax.ragged_all_to_all``.

    The four metadata are int tensors of one length K, a multiple of the group size n; slot k
    belongs to member ``k // (K // n)``. This instance sends ``operand[input_offsets[k] :
    input_offsets[k] + send_sizes[k]]`` to slot k's member, where it is written at row
    ``output_offsets[k]`` of that member's result (the *receiver's* rows: offsets in the sender's
    frame, as in JAX); ``recv_sizes[k]`` is the number of rows this instance receives from slot
    k's member. The result is ``output`` (``[M, *operand.shape[1:]]``) with the received rows
    written in; its other rows are ``output``'s. Sizes must agree (``send_sizes`` equals
    ``all_to_all(recv_sizes)``) and slices lie within the operand and the output.

    Checked where values are the instance's own (the per-instance simulation, a real mesh: one
    host synchronisation, which a real mesh needs anyway for the split sizes of its
    ``all_to_all_single``), and in a real mesh's traced graph (``torch.compile``, ``make_fx``)
    when it runs; under vmap and in ``.check()`` they cannot be read: rows that fall outside
    are dropped there. Under vmap every slot travels padded to the operand's rows (one
    even all_to_all); a real mesh sends the rows alone.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("i",))
        >>> @ns.spmd_map(mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P("i"))
        ... def f(x, out, in_off, send, out_off, recv):
        ...     return ns.ragged_all_to_all(x, out, in_off, send, out_off, recv, "i")
        >>> f(torch.tensor([1., 2, 2, 3, 4, 0]), torch.zeros(8),  # JAX's docstring example
        ...   torch.tensor([0, 1, 0, 1]), torch.tensor([1, 2, 1, 1]),
        ...   torch.tensor([0, 0, 1, 2]), torch.tensor([1, 1, 2, 1]))
        tensor([1., 3., 0., 0., 2., 2., 4., 0.])

    Backward: a ragged_all_to_all of the cotangent back to the operand's rows (the offsets seen
    from the other side), and the cotangent of ``output`` where no row was written.
    """
    ctx = current("ragged_all_to_all")
    ctx.in_collective += 1  # its own ops are no ops of the user's program
    try:
        if ctx.deferred:  # (a real mesh's replay: ppermutes not made yet)
            ctx.make_deferred()
        axes = ctx.check_axes(axis_name, "ragged_all_to_all")
        given = [input_offsets, send_sizes, output_offsets, recv_sizes]
        with DisableTorchFunction():  # inspection only: the vma mode's dispatch buys nothing
            _check_args(ctx, axes, operand, output, given)
            if any(_batched_inside(ctx, t) for t in given):  # (before a real mesh reads them)
                raise CollectiveError(f"ragged_all_to_all in {ctx.fn_label}: {_BATCHED_META}")
            rows, m = operand.shape[0], output.shape[0]
        meta = _stacked(ctx, given)
        # each slot's peer values: where its rows came from, where they go, how many, and the
        # peer's buffers' rows (on every backend: each reports the same exchange)
        exchanged = _with_bounds(ctx, meta, rows, m)
        peer = ctx.carried_metadata(exchanged, axes)
        if peer is None:
            peer = RECORDS["all_to_all"].bind(exchanged, axes, 1, 1, True, None, None)
        told = None
        if ctx.own_values:
            with DisableTorchFunction():  # host values read, no op of the program
                told, meta = _checked_values(ctx, axes, rows, m, meta, peer)
        else:
            meta = ctx.checked_ragged(axes, meta, peer, rows, m)
        input_offsets, send_sizes, output_offsets, recv_sizes = _rows(ctx, meta, 0, 1, 2, 3)
        from_offsets, placed_at = _rows(ctx, peer, 0, 2)
        params = Ragged(
            m,
            rows,
            input_offsets,
            send_sizes,
            output_offsets,
            recv_sizes,
            placed_at,
            from_offsets,
            told=told,
        )
        missing = ctx.vma(peer).varying - ctx.vma(operand).varying
        if missing:  # the rows moved depend on values that vary there
            in_order = tuple(a for a in ctx.mesh.axis_names if a in missing)
            operand = implicit_pvary(ctx, operand, in_order)
        placed = RAGGED_ALL_TO_ALL.bind(operand, axes, params)
        # the rows written: a mask of the peers' values, typed as they are (``peer`` varies
        # wherever ``meta`` does), made outside the vma mode (typed one by one, its seven ops
        # cost a tenth of a real mesh's call). It must come from the very sizes and offsets
        # the backend placed rows by (the agreed ones): a real mesh leaves ``placed``'s other
        # rows unset, which only this mask keeps out of the result
        with DisableTorchFunction():
            written = ragged_written(m, placed_at, recv_sizes)
            written = written.reshape(-1, *([1] * (output.dim() - 1)))
        return torch.where(ctx.stamp(written, ctx.vma(peer)), placed, output)
    finally:
        ctx.in_collective -= 1


def _stacked(ctx: SpmdContext, given: list[torch.Tensor]) -> torch.Tensor:
    """The four metadata as one ``[4, K]`` int64 tensor, typed as the stack of them would be:
    made outside the vma mode (whose general path, for a list of operands, costs more than the
    stack), but where one holds a partial sum, whose typing is the algebra's (section 2.2)."""
    wide = [t if t.dtype == torch.int64 else t.to(torch.int64) for t in given]
    vmas = [ctx.vma(t) for t in given]
    if any(v.partial for v in vmas):
        return torch.stack(wide)
    with DisableTorchFunction():
        meta = torch.stack(wide)
    return ctx.stamp(meta, functools.reduce(Vma.union, vmas))


def _rows(ctx: SpmdContext, t: torch.Tensor, *rows: int) -> tuple[torch.Tensor, ...]:
    """Rows of ``t`` (metadata of the exchange), typed as ``t``, made outside the vma mode (by
    ``select``: Dynamo refuses a stamp on a result of ``unbind``, a multi-output op)."""
    vma = ctx.vma(t)
    with DisableTorchFunction():
        return tuple(ctx.stamp(t.select(0, i), vma) for i in rows)


class Ragged(NamedTuple):
    """The record's parameters: the result's rows, the operand's, and per slot (``[K]`` int
    tensors) the operand's offsets and sizes, the offsets in the receiver's rows (sender's
    frame), the sizes received, where they are placed here (this member's frame), and where in
    their sender's operand they came from."""

    m: int
    rows: int
    offsets: torch.Tensor
    sizes: torch.Tensor
    out_offsets: torch.Tensor
    received: torch.Tensor
    placed_at: torch.Tensor
    from_offsets: torch.Tensor
    #: leading dims batched by a torch.func.vmap inside the function: each batch element's rows
    #: are sent by the same offsets and sizes
    batch: int = 0
    #: the forward's :data:`PROBLEM` row, where the backend tells its members' problems in the
    #: data exchange (:attr:`SpmdContext.tells_ragged_problems`); None: checked already
    told: tuple[int, ...] | None = None

    def transposed(self) -> Ragged:
        """The rows go back: read where they were placed, write where they came from."""
        return Ragged(
            self.rows,
            self.m,
            self.placed_at,
            self.received,
            self.from_offsets,
            self.sizes,
            self.offsets,
            self.out_offsets,
            self.batch,
        )


def _check_args(ctx: SpmdContext, axes: Axes, operand: Any, output: Any, meta: list) -> None:
    where = f"ragged_all_to_all in {ctx.fn_label}"
    for name, t in (("operand", operand), ("output", output)):
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            raise CollectiveError(
                f"{where}: {name} must be a tensor of rank >= 1 (rows along dim 0), got "
                f"{_what(t)}. Fix: pass x.reshape(-1, ...) with the rows first."
            )
    if output.shape[1:] != operand.shape[1:] or output.dtype != operand.dtype:
        raise CollectiveError(
            f"{where}: output {tuple(output.shape)} {output.dtype} must have the operand's row "
            f"shape and dtype ({tuple(operand.shape[1:])}, {operand.dtype}). Fix: make the "
            "output buffer with operand.new_zeros((M, *operand.shape[1:]))."
        )
    n = ctx.mesh.axis_size(axes)
    lengths = {t.shape[0] if isinstance(t, torch.Tensor) and t.dim() == 1 else -1 for t in meta}
    ints = all(
        isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()
        for t in meta
    )
    k = lengths.pop() if len(lengths) == 1 else -1
    if not ints or k <= 0 or k % n:
        got = ", ".join(_what(t) for t in meta)
        raise CollectiveError(
            f"{where}: input_offsets, send_sizes, output_offsets and recv_sizes must be 1-D "
            f"integer tensors of one length, a positive multiple of the group size {n} of "
            f"{axes} (got {got}). Fix: one int tensor of n entries each (slot j for member j)."
        )


def _what(t: Any) -> str:
    if isinstance(t, torch.Tensor):
        return f"{t.dtype} of shape {tuple(t.shape)}"
    return type(t).__name__


def _with_bounds(ctx: SpmdContext, meta: torch.Tensor, rows: int, m: int) -> torch.Tensor:
    """``meta`` and two rows more, the operand's rows and the output's in every slot: both ends
    of a slot then read whether its slice lies within its sender's operand and its receiver's
    output (:func:`_agreed_sizes`)."""
    with DisableTorchFunction():  # metadata of the exchange, no op of the program
        bounds = meta.new_tensor([[rows], [m]]).expand(2, meta.shape[1])
        return ctx.stamp(torch.cat([meta, bounds]), ctx.vma(meta))


def _checked_values(
    ctx: SpmdContext, axes: Axes, rows: int, m: int, meta: torch.Tensor, peer: torch.Tensor
) -> tuple[tuple[int, ...] | None, torch.Tensor]:
    """The sizes agree with the peers' and the slices lie within the buffers (host values):
    this member's first problem raised, or, where the backend tells its members' problems in
    the data exchange (a real mesh: a member that raised alone would leave the others inside
    it), returned as its :data:`PROBLEM` row (zeros: none) with the metadata to send by, each
    slot's size the one both its ends read alike (:func:`_agreed_sizes`), so that the exchange
    pairs sizes that agree and moves no rows from or to outside a buffer."""
    mine, theirs = meta.tolist(), peer.tolist()
    told = problem_row(mine, theirs, ctx.mesh.axis_size(axes), rows, m)
    if not ctx.tells_ragged_problems:
        if told[0]:
            raise problem_error(ctx.fn_label, axes, int(ctx.axis_index(axes)), told)
        return None, meta
    sent, received = _agreed_sizes(mine, theirs, rows, m)
    if sent == mine[1] and received == mine[3]:
        return told, meta
    agreed = meta.new_tensor([mine[0], sent, mine[2], received])
    return told, ctx.stamp(agreed, ctx.vma(meta))


def _agreed_sizes(mine: list, theirs: list, rows: int, m: int) -> tuple[list, list]:
    """Each slot's rows sent and received as both its ends read them from the exchanged
    metadata (``theirs`` with the peers' buffer rows, :func:`_with_bounds`): its sender's size
    where its receiver expects as many and the slice lies within the sender's operand and the
    receiver's output, else 0. A member that saw no problem of its own reads the same: another
    member's buffer may be the one a slice misses."""
    offsets, sizes, out_offsets, expected = mine
    from_offsets, peer_sizes, placed_at, peer_expected, peer_rows, peer_m = theirs
    sent = [
        _fits(o, s, at, e, out_rows, rows)
        for o, s, at, e, out_rows in zip(offsets, sizes, out_offsets, peer_expected, peer_m)
    ]
    received = [
        _fits(o, s, at, e, m, in_rows)
        for o, s, at, e, in_rows in zip(from_offsets, peer_sizes, placed_at, expected, peer_rows)
    ]
    return sent, received


def _fits(offset: int, size: int, at: int, expected: int, out_rows: int, rows: int) -> int:
    """A slot's ``size`` rows where they agree with the ``expected`` and lie within both
    buffers (``rows`` the operand's, ``out_rows`` the output's), else 0."""
    inside = 0 <= offset and offset + size <= rows and 0 <= at and at + size <= out_rows
    return size if size == expected and size >= 0 and inside else 0


#: A member's problem as integers (its kind, then what its message reads), so that every member
#: tells the first member's alike: (1, slot, its peer, sent, expected, the peer's expected, the
#: peer's sent), or (2, slot, start, size, rows, 0: operand / 1: output); () none.
PROBLEM = 7


def problem_row(meta: list, peer: list, n: int, rows: int, m: int) -> tuple[int, ...]:
    """This member's :data:`PROBLEM` row (all zeros: none) of its metadata ``meta`` and its
    peers' ``peer`` (host values, the exchanged rows)."""
    problem = _problem(meta, peer[:4], n, rows, m)
    return problem + (0,) * (PROBLEM - len(problem))


def _problem(meta: list, peer: list, n: int, rows: int, m: int) -> tuple[int, ...]:
    offsets, sizes, _, received = meta
    _, peer_sizes, placed_at, peer_received = peer
    per = len(sizes) // n
    for k in range(len(sizes)):
        if sizes[k] != peer_received[k] or received[k] != peer_sizes[k]:
            return (1, k, k // per, sizes[k], received[k], peer_received[k], peer_sizes[k])
        for what, (start, size, bound) in enumerate(
            ((offsets[k], sizes[k], rows), (placed_at[k], received[k], m))
        ):
            if size < 0 or start < 0 or start + size > bound:
                return (2, k, start, size, bound, what)
    return ()


def problem_error(label: str, axes: Axes, member: int, problem: tuple[int, ...]) -> CollectiveError:
    """The error of ``member``'s :data:`PROBLEM` row ``problem`` (not all zeros)."""
    where = f"ragged_all_to_all in {label}: member {member} of {axes}"
    if problem[0] == 1:
        k, peer, sent, expected, peer_expected, peer_sent = problem[1:PROBLEM]
        return CollectiveError(
            f"{where} sends {sent} rows in slot {k} and expects {expected}, but member {peer} "
            f"expects {peer_expected} from it and sends {peer_sent}. Fix: send_sizes must equal "
            "ns.all_to_all(recv_sizes, axis, 0, 0, tiled=True)."
        )
    k, start, size, bound, what = problem[1:6]
    return CollectiveError(
        f"{where}, slot {k}: rows {start}:{start + size} do not lie within the "
        f"{('operand', 'output')[what]}'s {bound} rows. Fix: offsets and sizes must give slices "
        "within the operand (input_offsets, send_sizes) and within the receiver's output "
        "(output_offsets, recv_sizes)."
    )


def _forward(ctx: SpmdContext, x: torch.Tensor, axes: Axes, params: Params) -> torch.Tensor:
    p = cast(Ragged, params)
    if not p.batch:
        return ctx.ragged_all_to_all(
            x, axes, p.m, p.offsets, p.sizes, p.placed_at, p.received, p.told
        )
    # JAX's batching rule: the batch elements' rows one after the other, slot k of element b
    # becoming slot k * B + b (the same member), its offsets shifted by b times the rows
    lead = x.shape[: p.batch]
    b = math.prod(lead)
    shift = torch.arange(b, device=x.device)

    def each(t: torch.Tensor, rows: int = 0) -> torch.Tensor:
        return (t.unsqueeze(-1) + shift * rows).flatten()

    rows = x.flatten(0, p.batch)
    out = ctx.ragged_all_to_all(
        rows,
        axes,
        b * p.m,
        each(p.offsets, p.rows),
        each(p.sizes),
        each(p.placed_at, p.m),
        each(p.received),
        p.told,
    )
    return out.unflatten(0, (*lead, p.m))


def _transpose(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    return ctx.apply(RECORDS["ragged_all_to_all"], g, axes, cast(Ragged, params).transposed())


def _check(ctx: SpmdContext, t: torch.Tensor, axes: Axes, params: Params) -> Params:
    p = cast(Ragged, params)
    if t.dim() <= p.batch or t.shape[p.batch] != p.rows:
        raise CollectiveError(
            f"ragged_all_to_all in {ctx.fn_label}: the operand {tuple(t.shape)} must have "
            f"{p.rows} rows. Fix: call ns.ragged_all_to_all with one tensor, not a pytree."
        )
    return p


def _shape(shape: tuple[int, ...], n: int, params: Params) -> tuple[int, ...]:
    p = cast(Ragged, params)
    return (*shape[: p.batch], p.m, *shape[p.batch + 1 :])


_BATCHED_META = (
    "under torch.func.vmap inside the per-device function, with offsets or sizes that the vmap "
    "batches: each batch element would send by its own. Fix: fold the batch into the rows "
    "(x.flatten(0, 1), with offsets and sizes for every element's slices, K * B of them) and "
    "call it outside the vmap."
)


def _batched_inside(ctx: SpmdContext, t: torch.Tensor) -> bool:
    """Whether a torch.func.vmap of the user's, inside the call, batches ``t`` (the simulated
    mesh's own levels batch every varying value: those are the instances)."""
    return batched_above(t, ctx.inner_level)


def _batched(params: Params) -> Params:
    """Under a torch.func.vmap inside the function: the operand gains a leading dim."""
    p = cast(Ragged, params)
    if any(isinstance(t, torch.Tensor) and is_transform_wrapped(t) for t in p):
        raise CollectiveError(f"ragged_all_to_all {_BATCHED_META}")
    return p._replace(batch=p.batch + 1)


RAGGED_ALL_TO_ALL = Collective(
    name="ragged_all_to_all",
    policy=PVARY,
    vma=same_vma,
    shape=_shape,
    forward=_forward,
    transpose=_transpose,
    backward_op=backward_op("ragged_all_to_all"),
    prepare=lambda ctx, axes, p: p,
    check=_check,
    batched=_batched,
)

__all__ = ["ragged_all_to_all"]
