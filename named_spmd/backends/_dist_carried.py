"""A replay's first exchange carried right behind its start-of-call check, so that the call
waits once for both (each wait on gloo is a round of the ranks' scheduling).

A planned call whose first process-group call is the exchange of a ``ragged_all_to_all``'s
``[ROWS, K]`` metadata (over the whole mesh, its axes in mesh order, at most :data:`SLOTS` slots
per member, on the host) notes its slots (``DistributedContext.carried_slots``); its plan
keeps them (``_dist_pvary.Hoistable.carried``), and each replay of the plan promises, in its
start-of-call checksum, one all_to_all of ``[n, WIDTH]`` int64 on the check's group before any
other collective: that exchange's rows where its first collective is that exchange
(:func:`peers`: started before the check is waited for), else a row of zeros
(:func:`keep_promise`). Every rank sends one width whatever it sends, so ranks whose calls went
apart stay in step: each row starts with a tag (the slots, or 0), and where the tags differ
every rank raises the same error. Where the checksums differ (some ranks promised, others did
not), the ranks learn who promised in the check's exchange of descriptions, and those that did
not send zeros (:func:`drain`), so the exchange completes before the check's error or the call.

A call's first ``ppermute`` rides so too (:func:`permute`), where its plan ran it first over the
whole mesh on an operand of at most :data:`BYTES` bytes, of the shape and dtype that the replay
assumes: an even call's plan notes them (:func:`first_permute`), an uneven call recalls the
signature's last call (``UnevenPrimitives``). Each rank sends every member a row of the tag (the
digest of its pairs, axes and the assumed shape and dtype, negative), the flag "my operand has
another shape or dtype" and, to its destination, the operand's bytes. A flag set: the ppermute
runs again uncarried (an uneven call's as a flagged one does: the shapes and dtypes exchanged,
and compared).

A carried ppermute is deferred (:func:`defer`; an even call's: :func:`first_permute`, an uneven
call's: ``UnevenPrimitives``): its result is a buffer made when something reads it
(``SpmdContext.deferred``: an op of the call's replay that reads it, a collective, the end of
the body: each finishes the check, :func:`fill`). The ppermutes that follow it before then, of
operands not read from a deferred result, ride in the same exchange while their bytes fit in
the row (a halo exchange's two directions, the four sides of a 2-D block: one wait for all of
them and the check). Each is sent from a copy of its operand taken when called (a later write
to the operand is not sent), and the tag digests them all; any flag set, each moves again, in
call order, right after the exchange (``Deferred.redo``).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .. import _torch_private as torch_private
from .._accounting import CommEvent, record, recording
from .._errors import SpmdError
from .._operands import reads_any
from ._dist_comm import dtype_code, dtype_of

if TYPE_CHECKING:
    from ._dist_comm import Comm
    from ._dist_mesh import DistributedMesh
    from .distributed import DistributedContext

SLOTS = 8  # slots per member carried at most (``ROWS`` int64 each)
ROWS = 6  # ragged_all_to_all's metadata per slot: the four, and the operand's and output's rows
BYTES = 4096  # a carried ppermute's operand, at most
# a row (one width whatever it carries: ranks whose calls went apart still pair up): the tag,
# then the metadata of the receiver's slots, or a ppermute's flag and operand bytes
WIDTH = max(1 + ROWS * SLOTS, 2 + BYTES // 8)
_TAGS = (1 << 61) - 1  # a ppermute's tag: minus one plus its digest's low bits
_NAME = "the start-of-call check's carried exchange"


class Carried:
    """One replay's promised exchange: ``slots`` (K) the plan's, ``tag`` what this rank sent
    (K: its metadata; 0: zeros), ``started`` the exchange in flight (None: not yet); ``kind``
    the (shape, dtype code) an even call's carried ppermute assumes (None: none, or uneven)."""

    def __init__(self, comm: Comm, slots: int, kind: tuple | None = None):
        self.comm, self.slots, self.kind = comm, slots, kind
        self.tag = 0
        self.started: tuple[Any, torch.Tensor] | None = None
        self.pending: list[Deferred] = []  # the ppermutes deferred into it, in call order
        self.used = 0  # the bytes of a row their operands take

    def start(self, meta: torch.Tensor | None) -> None:
        """Send ``meta`` ([ROWS, K] int64, slot k for member ``k // (K // n)``), or zeros."""
        n = self.comm.n
        rows = torch.zeros(n, WIDTH, dtype=torch.int64)
        if meta is not None:
            per = meta.shape[1] // n
            rows[:, 0] = meta.shape[1]
            h = meta.shape[0]
            rows[:, 1 : 1 + h * per] = meta.reshape(h, n, per).transpose(0, 1).reshape(n, -1)
        self.send(rows)

    def send(self, rows: torch.Tensor) -> None:
        """Send ``rows`` ([n, WIDTH] int64, row j to member j; its tag in column 0)."""
        self.tag = int(rows[0, 0])
        self.started = self.comm.start_all_to_all(rows)

    def finish(self, ctx: DistributedContext) -> torch.Tensor:
        """The rows received, in member order; where some member's tag is not this one's, the
        calls went apart before their first collective: every rank raises alike."""
        assert self.started is not None
        got = self.comm.finish_all_to_all(self.started, _NAME)
        tags = got[:, 0].tolist()
        if any(t != self.tag for t in tags):
            members: dict[int, list[int]] = {}
            for i, t in enumerate(tags):
                members.setdefault(t, []).append(i)
            # a ppermute's row: its flag in bit 0 of column 1, the count carried above it
            count = {t: int(got[ms[0], 1]) >> 1 if t < 0 else 0 for t, ms in members.items()}
            several = sum(t < 0 for t in members) > 1  # ppermutes of other pairs or axes
            several = several and len({count[t] for t in members if t < 0}) == 1
            told = ", ".join(
                f"members {ms}{'' if k else ' of the mesh'} "
                + _first_collective(t, k + 1 if several else 0, count[t])
                for k, (t, ms) in enumerate(sorted(members.items(), key=lambda e: (not e[0], e[1])))
            )
            raise ctx.alike(
                SpmdError(
                    f"spmd_map of {ctx.fn_label}: the ranks' calls went apart before their first "
                    f"collective: {told}, where the call's earlier run of the same inputs ran one "
                    "first collective on every rank. Fix: make the collectives a call runs, and "
                    "their order and arguments, independent of the rank (Python state that "
                    "differs between ranks)."
                )
            )
        return got


class Deferred(NamedTuple):
    """A ppermute deferred into the carried exchange: its ``result`` (filled by :func:`fill`),
    a copy of its ``operand``, the (shape, dtype code) every member's operand is assumed of
    (``kind``), whether this one's is (``own``: else its flag is set), where its bytes lie in a
    row, and how it moves again, uncarried, where some member's flag is set (``redo``)."""

    result: torch.Tensor
    operand: torch.Tensor
    axes: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]
    kind: tuple
    own: bool
    offset: int
    size: int
    redo: Callable[[torch.Tensor], torch.Tensor]

    def label(self) -> str:
        """What the tag digests of it: pairs, axes, assumed shape and dtype code (``hash`` of a
        str is salted per process: the tag is a blake2b of the labels)."""
        return f"{self.pairs}|{self.axes}|{tuple(self.kind[0])}|{self.kind[1]}"


def _first_collective(tag: int, told: int, count: int) -> str:
    """What the members that sent ``tag`` ran first (``told``: the group's number from 1, where
    several groups ran as many ppermutes of other pairs or axes; else 0; ``count``: how many
    ppermutes they carried)."""
    if tag > 0:
        return "exchanged a ragged_all_to_all's offsets and sizes first"
    if tag < 0:
        ran = "a ppermute" if count <= 1 else f"{count} ppermutes (before reading their results)"
        return f"ran {ran} first{f' (pairs or axes #{told})' if told else ''}"
    return "ran another collective first (or none)"


def promise(ctx: DistributedContext, hoistable: tuple) -> int:
    """At the start-of-call check: the replay's promise (the slots of the exchange it carries;
    minus the element size of the ppermute it carries; 0: none), which the checksum compares
    (the plan's, and the recalled shape that decides a ppermute's); the mesh keeps it until
    the exchange is made."""
    mesh = ctx.mesh
    slots = getattr(hoistable, "carried", 0)
    kind = getattr(hoistable, "carried_kind", None)
    shape = getattr(ctx, "first_permute_shape", None) if kind is None else kind[0]
    if slots < 0 and not _permute_fits(shape, -slots):
        slots = 0
    mesh.carried = Carried(mesh.check_comm(), slots, kind) if slots else None
    return slots


def keep_promise(mesh: DistributedMesh) -> Carried | None:
    """As the check is finished: the promised exchange, zeros where no call made it yet, or
    the deferred ppermutes' operands; the exchange where it carries those (:func:`fill`)."""
    carried = mesh.carried
    if carried is None or carried.started is not None:
        return None
    if not carried.pending:
        carried.start(None)
        return None
    comm, me = carried.comm, carried.comm.index
    rows = torch.zeros(comm.n, WIDTH, dtype=torch.int64)
    rows[:, 0] = _tag("; ".join(d.label() for d in carried.pending))
    rows[:, 1] = len(carried.pending) << 1 | int(not all(d.own for d in carried.pending))
    for d in carried.pending:
        dst = next((b for a, b in d.pairs if a == me), None)
        if d.own and dst is not None and dst != me:
            sent = d.operand.reshape(-1).view(torch.uint8)
            rows[dst, 2:].view(torch.uint8)[d.offset : d.offset + d.size].copy_(sent)
    carried.send(rows)
    return carried


def fill(ctx: DistributedContext, carried: Carried | None) -> None:
    """After the check agreed: the deferred ppermutes' results (``carried``: their exchange,
    :func:`keep_promise`), read from its rows; where some member's flag is set, or the check's
    disagreement drained the exchange, each moved again uncarried, in call order."""
    if carried is None:
        return
    ctx.deferred = ()
    mesh = ctx.mesh
    got = None
    if mesh.carried is carried:
        mesh.carried = None
        got = carried.finish(ctx)
        if bool((got[:, 1] & 1).any()):
            got = None
    me = carried.comm.index
    with torch_private.DisableTorchFunction(), torch.no_grad():
        for d in carried.pending:
            d.result.copy_(d.redo(d.operand) if got is None else _received(got, d, me))


def _received(got: torch.Tensor, d: Deferred, me: int) -> torch.Tensor:
    """What member ``me`` receives of deferred ppermute ``d`` (zeros where no one sends to it)."""
    src = next((a for a, b in d.pairs if b == me), None)
    if src is None:
        return torch.zeros_like(d.operand)
    if src == me:
        return d.operand
    piece = got[src, 2:].view(torch.uint8)[d.offset : d.offset + d.size]
    return piece.view(d.operand.dtype).view(d.operand.shape)


def settle(ctx: DistributedContext) -> None:
    """After the check agreed: an exchange of zeros is waited for here (the ranks that sent
    their metadata wait in :func:`peers`); tags that differ raise on every rank alike."""
    carried = ctx.mesh.carried
    if carried is not None and not carried.tag:
        ctx.mesh.carried = None
        carried.finish(ctx)


def drain(mesh: DistributedMesh, promised: bool) -> None:
    """The checksums differ and some rank promised (``promised``: any did): every rank takes
    part in one exchange (zeros where this rank made none) and its rows go unused."""
    if not promised:
        return
    carried = mesh.carried
    if carried is None:
        carried = Carried(mesh.check_comm(), 0)
        carried.start(None)
    mesh.carried = None
    assert carried.started is not None
    carried.comm.finish_all_to_all(carried.started, _NAME)


def _fits(ctx: DistributedContext, meta: torch.Tensor, axes: tuple[str, ...]) -> bool:
    mesh = ctx.mesh
    vma = ctx.vma(meta)
    return (
        type(ctx).carries_first_exchange
        and axes == mesh.axis_names
        and meta.device.type == "cpu"
        and meta.shape[0] == ROWS
        and meta.shape[1] <= SLOTS * mesh.size
        and not ctx.values_read
        and not vma.partial
        and vma.varying.issuperset(axes)
    )


def peers(ctx: DistributedContext, meta: torch.Tensor, axes: tuple[str, ...]) -> Any:
    """``ragged_all_to_all``'s exchange of ``meta`` ([ROWS, K] int64) where the start-of-call check
    carries it (a replay that promised it: this is its first collective), as the tiled
    all_to_all would return it, typed and counted alike; else None (the caller exchanges), and
    in a planned call whose first collective this is, its slots noted for the plan."""
    mesh = ctx.mesh
    carried = mesh.carried
    if carried is None or carried.started is not None:
        if mesh.pending_check is not None and carried is None and _fits(ctx, meta, axes):
            ctx.carried_slots = meta.shape[1]
        return None
    if meta.shape[1] != carried.slots or not _fits(ctx, meta, axes):
        return None  # (the check sends zeros for it; the ranks that sent metadata raise)
    with torch_private.DisableTorchFunction():  # the exchange's own ops, no ops of the program
        carried.start(meta)
        mesh.finish_pending_check()  # (the checksums differ: drained, and the exchange runs)
        if mesh.carried is not carried:
            return None
        mesh.carried = None
        got = carried.finish(ctx)
        n, per, h = mesh.size, carried.slots // mesh.size, meta.shape[0]
        peer = got[:, 1 : 1 + h * per].reshape(n, h, per).transpose(0, 1).reshape(h, -1)
    if recording():  # the exchange's event, as ``Collective._apply`` records it
        record(CommEvent("all_to_all", axes, "forward", (h, n * per), meta.dtype))
    return ctx.stamp(peer, ctx.vma(meta))


def _permute_tag(axes, pairs: tuple, shape: tuple, code: int) -> int:
    """A carried ppermute's tag (negative): a digest of its pairs, axes and the recalled operand
    shape and dtype (``code``), so that ranks whose first ppermutes differ in them raise alike
    rather than pair up (an operand of another shape or dtype than the recalled one sets its
    flag instead)."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return _tag(f"{pairs}|{names}|{tuple(shape)}|{code}")


def _tag(text: str) -> int:
    """A negative tag digesting ``text`` (blake2b, not ``hash``: str hashes are salted per
    process)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "big") & _TAGS)


def _permute_fits(shape: tuple[int, ...] | None, element_size: int) -> bool:
    return shape is not None and math.prod(shape) * element_size <= BYTES


def permute_noted(ctx: DistributedContext, x: torch.Tensor, axes: tuple[str, ...], pairs) -> None:
    """A planned call's ppermute: where it is the call's first collective and a replay could
    carry it (:func:`permute`), its element size noted for the plan."""
    mesh = ctx.mesh
    if mesh.pending_check is not None and mesh.carried is None and _permute_carries(ctx, x, axes):
        ctx.carried_slots = -x.element_size()


def _permute_carries(ctx: DistributedContext, x: torch.Tensor, axes: tuple[str, ...]) -> bool:
    return axes == ctx.mesh.axis_names and x.device.type == "cpu" and not ctx.values_read


def first_permute(ctx: DistributedContext, x: torch.Tensor, axes: tuple[str, ...], pairs) -> Any:
    """An even call's ppermute, where it is the call's first collective: the result where the
    replay promised to carry it (:func:`permute`, assuming the shape and dtype its plan noted);
    None where it runs uncarried (an operand of another shape or dtype on some member: every
    member then moves it again), and in a planned call its shape and dtype noted for the plan."""
    mesh = ctx.mesh
    if mesh.pending_check is None or not type(ctx).carries_first_exchange:
        return None
    carried = mesh.carried
    kind = (tuple(x.shape), dtype_code(x.dtype))
    if carried is not None and carried.kind is not None:
        if kind != carried.kind and not carried.pending:  # (its flag set: moved again)
            return permute(ctx, x, axes, pairs, carried.kind, True)[0]
        comm = mesh.comm(axes)
        pairs = tuple((int(s), int(d)) for s, d in pairs)
        # (None: it runs uncarried, after the deferred ones)
        return defer(ctx, x, axes, pairs, kind, True, lambda t: comm.permute(t, pairs))
    permute_noted(ctx, x, axes, pairs)
    if ctx.carried_slots < 0:
        ctx.carried_kind = kind
    return None


def defer(
    ctx: DistributedContext,
    x: torch.Tensor,
    axes: tuple[str, ...],
    pairs: tuple[tuple[int, int], ...],
    kind: tuple,
    own: bool,
    redo: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor | None:
    """The result of ``x``'s ppermute deferred into the promised exchange (module doc; ``kind``,
    ``own``, ``redo``: :class:`Deferred`'s), or None where it cannot ride there: no exchange
    promised or one sent already, an operand read from a deferred result, an empty one, one
    not over the whole mesh on the host, or bytes beyond the row's."""
    carried = ctx.mesh.carried
    if carried is None or carried.started is not None:
        return None
    dtype = dtype_of(kind[1])
    size = 0 if dtype is None else math.prod(kind[0]) * dtype.itemsize
    if (
        not size
        or carried.used + size > BYTES
        or not _permute_carries(ctx, x, axes)
        or (ctx.deferred and reads_any(ctx.deferred, (x,), None))
    ):
        return None
    operand = x.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    result = torch.empty_like(operand)
    entry = Deferred(result, operand, tuple(axes), pairs, kind, own, carried.used, size, redo)
    carried.pending.append(entry)
    carried.used += -(-size // 8) * 8  # (each operand's bytes start at a multiple of 8)
    ctx.deferred = (*ctx.deferred, result)
    return result


def deferring(ctx: DistributedContext) -> bool:
    """Whether ppermutes are deferred into the promised exchange, not yet sent."""
    carried = ctx.mesh.carried
    return carried is not None and bool(carried.pending) and carried.started is None


def make_deferred(ctx: DistributedContext, rec: Any = None, x: Any = None) -> None:
    """``SpmdContext.make_deferred``: the check finished (:func:`fill`), but before a ppermute
    of an operand that reads no deferred result (:func:`first_permute` decides: it may ride
    along)."""
    if rec is not None and rec.name == "ppermute" and isinstance(x, torch.Tensor):
        if not reads_any(ctx.deferred, (x,), None):
            return
    ctx.mesh.finish_pending_check()


def permute_promised(ctx: DistributedContext) -> bool:
    """Whether this call promised its first collective as a carried ppermute, not yet made."""
    carried = ctx.mesh.carried
    return carried is not None and carried.slots < 0 and carried.started is None


def permute(
    ctx: DistributedContext,
    x: torch.Tensor,
    axes: tuple[str, ...],
    pairs,
    kind: tuple,
    differs: bool,
) -> tuple[torch.Tensor | None, bool]:
    """The promised ppermute of ``x`` along ``pairs``, every member's operand assumed of
    ``kind`` (the recalled shape and dtype code; ``differs``: ``x`` is not of it): its result
    and whether any member's flag is set (then the caller exchanges the shapes and dtypes, and
    moves the data again), or
    ``(None, False)`` where the check found that the ranks recall otherwise (the call then
    exchanges every shape afresh)."""
    mesh = ctx.mesh
    carried = mesh.carried
    # the promised exchange is made already where the check finished before this ppermute:
    # keep_promise sent this rank's zeros then, and settle (checksums alike) or drain (they
    # differ) took the exchange, so it is gone (None). A rank whose ppermute rode it sent a
    # tag that is not 0, and the exchange raised on every rank alike; none did here, so the
    # ppermute runs uncarried, as on every rank that sent zeros
    if carried is None or carried.started is not None:
        mesh.finish_pending_check()
        return None, False
    comm, me = carried.comm, carried.comm.index
    shape, code = kind
    own = not differs and x.element_size() == -carried.slots
    own = own and _permute_carries(ctx, x, axes)
    pairs = tuple((int(s), int(d)) for s, d in pairs)
    rows = torch.zeros(comm.n, WIDTH, dtype=torch.int64)
    rows[:, 0] = _permute_tag(axes, pairs, shape, code)
    rows[:, 1] = 2 | int(not own)  # (one ppermute, and its flag)
    dst = next((d for s, d in pairs if s == me), None)
    if own and dst is not None and dst != me:
        sent = x.resolve_conj().resolve_neg().contiguous().reshape(-1).view(torch.uint8)
        rows[dst, 2:].view(torch.uint8)[: sent.numel()].copy_(sent)
    carried.send(rows)
    mesh.finish_pending_check()  # (the ranks recall otherwise: drained, and forgotten)
    if mesh.carried is not carried:
        return None, False
    mesh.carried = None
    got = carried.finish(ctx)
    if bool((got[:, 1] & 1).any()):
        return None, True
    src = next((s for s, d in pairs if d == me), None)
    if src is None:
        return torch.zeros_like(x, memory_format=torch.contiguous_format), False
    if src == me:
        return x.clone(memory_format=torch.contiguous_format), False
    size = x.numel() * x.element_size()
    return got[src, 2:].view(torch.uint8)[:size].view(x.dtype).view(shape), False
