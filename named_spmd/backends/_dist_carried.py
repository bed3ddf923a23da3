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

A call's first ``ppermute`` rides so too, where its plan ran it first over the whole mesh on an
operand of at most :data:`BYTES` bytes, of the shape and dtype that the replay assumes: an even
call's plan notes them (:func:`first_permute`), an uneven call recalls the signature's last call
(``UnevenPrimitives``). It is deferred (:func:`defer`): its result is a buffer made when
something reads it (``SpmdContext.deferred``: an op of the call's replay that reads it, or any
tensor whose memory cannot be told, as a transform's wrapper; a compiled piece; a collective;
the end of the body: each finishes the check, :func:`fill`). The ppermutes that follow it before
then (at most :data:`DEFERRED`), of operands not read from a deferred result, ride in the same
exchange while their bytes fit (a halo exchange's two directions, the four sides of a 2-D block:
one wait for all of them and the check), each sent from a copy of its operand taken when called
(a later write to it is not sent). Each rank sends every member a row of the tag (a digest of
the ppermutes' pairs, axes and assumed shapes and dtypes, negative), a status (how many; whether
it was sent at a read, after which more may follow; the flag "an operand has another shape or
dtype"), the tags of the first 1, 2, ... of them and, to each destination, the operands' bytes.
The ppermutes every member carried ride, where their tags agree (:func:`_riding`); a member that
read a result sooner (a rank's own ``print``) carried fewer, and the others move their later
ones again, uncarried, in call order, as that member calls them; a flag set moves every one
again (``Deferred.redo``: an uneven call's exchanges the shapes and dtypes first, and compares
them). A rank whose call raises before the exchange sends it first (:func:`abandon`).
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
BYTES = 8192  # the carried ppermutes' operands, at most (two 1024-float32 halo rows)
DEFERRED = 8  # ppermutes carried together, at most
# a row (one width whatever it carries: ranks whose calls went apart still pair up): the tag,
# then the metadata of the receiver's slots, or the ppermutes' status (:func:`keep_promise`),
# the tags of their first 1, 2, ... and, from column ``_HEAD``, their operands' bytes
_HEAD = 2 + DEFERRED
WIDTH = max(1 + ROWS * SLOTS, _HEAD + BYTES // 8)
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
        #: it is sent where a result is read (more ppermutes may follow before the next
        #: collective), not at another collective or the body's end (:func:`keep_promise`)
        self.reading = False

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

    def finish(self, ctx: DistributedContext, ppermutes: bool = False) -> torch.Tensor:
        """The rows received, in member order; where some member's tag is not this one's, the
        calls went apart before their first collective: every rank raises alike (but where
        every member carried ppermutes: ``ppermutes``, :func:`_riding` judges)."""
        assert self.started is not None
        got = self.comm.finish_all_to_all(self.started, _NAME)
        tags = got[:, 0].tolist()
        if any(t != self.tag for t in tags) and not (ppermutes and all(t < 0 for t in tags)):
            raise _apart(ctx, got)
        return got


def _apart(ctx: DistributedContext, got: torch.Tensor) -> SpmdError:
    """The error every rank raises alike where the rows ``got`` say that the members' calls
    went apart before their first collective."""
    members: dict[int, list[int]] = {}
    for i, t in enumerate(got[:, 0].tolist()):
        members.setdefault(t, []).append(i)
    count = {t: int(got[ms[0], 1]) >> 2 if t < 0 else 0 for t, ms in members.items()}
    several = sum(t < 0 for t in members) > 1  # ppermutes of other pairs or axes
    several = several and len({count[t] for t in members if t < 0}) == 1
    told = ", ".join(
        f"members {ms}{'' if k else ' of the mesh'} "
        + _first_collective(t, k + 1 if several else 0, count[t])
        for k, (t, ms) in enumerate(sorted(members.items(), key=lambda e: (not e[0], e[1])))
    )
    return ctx.alike(
        SpmdError(
            f"spmd_map of {ctx.fn_label}: the ranks' calls went apart before their first "
            f"collective: {told}, where the call's earlier run of the same inputs ran one first "
            "collective on every rank. Fix: make the collectives a call runs, and their order "
            "and arguments, independent of the rank (Python state that differs between ranks)."
        )
    )


class Deferred(NamedTuple):
    """A ppermute deferred into the carried exchange: its ``result`` (filled by :func:`fill`),
    a copy of its ``operand``, the (shape, dtype code) every member's operand is assumed of
    (``kind``), whether this one's is (``own``: else its flag is set), where its bytes lie in a
    row, and how it moves again, uncarried: where some member's flag is set (``redo``), and
    where some member carried fewer, as that member's uncarried call of it does (``again``)."""

    result: torch.Tensor
    operand: torch.Tensor
    axes: tuple[str, ...]
    pairs: tuple[tuple[int, int], ...]
    kind: tuple
    own: bool
    offset: int
    size: int
    redo: Callable[[torch.Tensor], torch.Tensor]
    again: Callable[[torch.Tensor], torch.Tensor]

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
        ran = "a ppermute" if count <= 1 else f"{count} ppermutes"
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
    comm, me, pending = carried.comm, carried.comm.index, carried.pending
    rows = torch.zeros(comm.n, WIDTH, dtype=torch.int64)
    labels = [d.label() for d in pending]
    prefixes = [_tag("; ".join(labels[: k + 1])) for k in range(len(pending))]
    rows[:, 0] = prefixes[-1]
    # the status: how many, whether more may follow (sent at a read), whether a flag is set
    flagged = not all(d.own for d in pending)
    rows[:, 1] = len(pending) << 2 | int(carried.reading) << 1 | int(flagged)
    rows[:, 2 : 2 + len(pending)] = torch.tensor(prefixes)
    for d in pending:
        dst = next((b for a, b in d.pairs if a == me), None)
        if d.own and dst is not None and dst != me:
            sent = d.operand.reshape(-1).view(torch.uint8)
            rows[dst, _HEAD:].view(torch.uint8)[d.offset : d.offset + d.size].copy_(sent)
    carried.send(rows)
    return carried


def _riding(ctx: DistributedContext, got: torch.Tensor) -> tuple[int, int]:
    """How many of the deferred ppermutes ride in the rows ``got`` (0: every one moves again,
    uncarried, where a member's flag is set), and how many every member carried: as many as
    every member carried ride, where their first ones agree (the same tag); a member that
    carried fewer at a read (a rank's own ``print`` of a result) calls the others later,
    which the members that carried them move again, in order, as it does (``Deferred.again``).
    Members whose ppermutes differ, or one that carried fewer and then ran another collective
    or ended its body, went apart: every rank raises alike."""
    status = got[:, 1].tolist()
    counts = [s >> 2 for s in status]
    m = min(counts)
    ended = any((s & 2) == 0 for s, c in zip(status, counts) if c == m)
    if len(set(got[:, 1 + m].tolist())) > 1 or (ended and max(counts) > m):
        ctx.mesh.board.check(_NAME)  # (a rank that raised sent its rows: the board tells it)
        raise _apart(ctx, got)
    return (0 if any(s & 1 for s in status) else m), m


def fill(ctx: DistributedContext, carried: Carried | None) -> None:
    """After the check agreed: the deferred ppermutes' results (``carried``: their exchange,
    :func:`keep_promise`), read from its rows; where some member's flag is set, or the check's
    disagreement drained the exchange, each moved again uncarried, in call order."""
    if carried is None:
        return
    unmade, ctx.deferred = ctx.deferred, ()  # (restored where the exchange raises)
    try:
        _fill(ctx, carried)
    except BaseException:
        ctx.deferred = unmade
        raise


def _fill(ctx: DistributedContext, carried: Carried) -> None:
    mesh = ctx.mesh
    got, riding, every = None, 0, len(carried.pending)
    if mesh.carried is carried:  # (else drained: the check's disagreement took it)
        mesh.carried = None
        got = carried.finish(ctx, ppermutes=True)
        riding, every = _riding(ctx, got)
    me = carried.comm.index
    # (read inside a transform, a torch.func.grad of the result: filled outside it)
    with torch_private.DisableFuncTorch(), torch_private.DisableTorchFunction():
        for k, d in enumerate(carried.pending):
            # (a result made under inference mode is written in it, wherever it is read;
            # inference_mode(False) would turn grad mode on: the copy would enter autograd)
            with torch.inference_mode() if d.result.is_inference() else torch.no_grad():
                if got is not None and k < riding:
                    made = _received(got, d, me)
                else:
                    made = (d.redo if k < every else d.again)(d.operand)
                d.result.copy_(made)


def abandon(mesh: DistributedMesh) -> None:
    """This rank's call raised, its error not posted yet: the deferred ppermutes sent and the
    exchange waited for, so that no peer is left inside it (the mesh would be out of step);
    the peers learn of the error at their next collective or call."""
    carried = mesh.carried
    if carried is not None and carried.pending and carried.started is None:
        keep_promise(mesh)
        assert carried.started is not None
        try:
            carried.comm.finish_all_to_all(carried.started, _NAME)
        except Exception:  # noqa: BLE001 - a peer failed too: the board tells of both
            pass


def _received(got: torch.Tensor, d: Deferred, me: int) -> torch.Tensor:
    """What member ``me`` receives of deferred ppermute ``d`` (zeros where no one sends to it)."""
    src = next((a for a, b in d.pairs if b == me), None)
    if src is None:
        return torch.zeros_like(d.operand)
    if src == me:
        return d.operand
    piece = got[src, _HEAD:].view(torch.uint8)[d.offset : d.offset + d.size]
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


def _tag(text: str) -> int:
    """A negative tag digesting ``text`` (blake2b, not ``hash``: str hashes are salted per
    process)."""
    digest = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return -1 - (int.from_bytes(digest, "big") & _TAGS)


def _permute_fits(shape: tuple[int, ...] | None, element_size: int) -> bool:
    return shape is not None and math.prod(shape) * element_size <= BYTES


def permute_noted(ctx: DistributedContext, x: torch.Tensor, axes: tuple[str, ...], pairs) -> None:
    """A planned call's ppermute: where it is the call's first collective and a replay could
    carry it (:func:`defer`), its element size noted for the plan."""
    mesh = ctx.mesh
    if mesh.pending_check is not None and mesh.carried is None and _permute_carries(ctx, x, axes):
        ctx.carried_slots = -x.element_size()


def _permute_carries(ctx: DistributedContext, x: torch.Tensor, axes: tuple[str, ...]) -> bool:
    return axes == ctx.mesh.axis_names and x.device.type == "cpu" and not ctx.values_read


def first_permute(ctx: DistributedContext, x: torch.Tensor, axes: tuple[str, ...], pairs) -> Any:
    """An even call's ppermute while the start-of-call check is pending: in a replay that
    promised to carry its first, the result deferred (:func:`defer`; the first assumed of the
    shape and dtype its plan noted, its flag set where it is not), or None where it runs
    uncarried, after those deferred; in a planned call, None, the first's shape and dtype
    noted for the plan."""
    mesh = ctx.mesh
    if mesh.pending_check is None or not type(ctx).carries_first_exchange:
        return None
    carried = mesh.carried
    kind = (tuple(x.shape), dtype_code(x.dtype))
    if carried is not None and carried.kind is not None:
        comm = mesh.comm(axes)
        pairs = tuple((int(s), int(d)) for s, d in pairs)
        first = not carried.pending  # (of the noted kind, or its flag set)
        assumed, own = (carried.kind, kind == carried.kind) if first else (kind, True)
        # (None: it runs uncarried, after the deferred ones)
        return defer(ctx, x, axes, pairs, assumed, own, lambda t: comm.permute(t, pairs))
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
    again: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """The result of ``x``'s ppermute deferred into the promised exchange (module doc; ``kind``,
    ``own``, ``redo``, ``again`` (``redo`` unless given): :class:`Deferred`'s), or None where
    it cannot ride there: no exchange promised or one sent already, :data:`DEFERRED` deferred
    already, an operand read from a deferred result; and but for the first (its flag set
    instead, its bytes not sent) an empty operand, one not over the whole mesh on the host, or
    bytes beyond the row's."""
    carried = ctx.mesh.carried
    if carried is None or carried.started is not None:
        return None
    dtype = dtype_of(kind[1])
    size = 0 if dtype is None else math.prod(kind[0]) * dtype.itemsize
    fits = own and size and carried.used + size <= BYTES and _permute_carries(ctx, x, axes)
    if carried.pending and (
        not fits
        or len(carried.pending) >= DEFERRED
        or (ctx.deferred and reads_any(ctx.deferred, (x,), None))
    ):
        carried.reading = True  # (it runs next, uncarried: more ppermutes follow)
        return None
    if not fits:
        own, size = False, 0
    operand = x.detach().resolve_conj().resolve_neg().clone(memory_format=torch.contiguous_format)
    result = torch.empty_like(operand)
    entry = Deferred(
        result, operand, tuple(axes), pairs, kind, own, carried.used, size, redo, again or redo
    )
    carried.pending.append(entry)
    carried.used += -(-size // 16) * 16  # (each operand's bytes aligned for any dtype)
    ctx.deferred = (*ctx.deferred, result)
    return result


def deferring(ctx: DistributedContext) -> bool:
    """Whether ppermutes are deferred into the promised exchange, not yet sent."""
    carried = ctx.mesh.carried
    return carried is not None and bool(carried.pending) and carried.started is None


def make_deferred(ctx: DistributedContext, rec: Any = None, given: Any = None) -> None:
    """``SpmdContext.make_deferred``: the check finished (:func:`fill`), but before a ppermute
    whose arguments ``given`` (its operand, and its pairs, which may hold tensors) read no
    deferred result (:func:`first_permute` decides: it may ride along)."""
    ppermute = rec is not None and rec.name == "ppermute" and isinstance(given[0], torch.Tensor)
    if ppermute and not reads_any(ctx.deferred, given, None):
        return
    carried = ctx.mesh.carried
    if carried is not None:  # (a read, or a ppermute: more ppermutes may follow)
        carried.reading = rec is None or ppermute
    ctx.mesh.finish_pending_check()
    refuse_unmade(ctx)


def refuse_unmade(ctx: DistributedContext) -> None:
    """Refuse to go on where the call's deferred ppermutes were never made: their exchange
    raised (on every rank alike), and the function caught the error; a read of a result, or
    the body's end (a result returned unread), would find no values."""
    if ctx.deferred:
        raise ctx.alike(
            SpmdError(
                f"spmd_map of {ctx.fn_label}: a ppermute's result is read or returned after "
                "the exchange that carried it failed (an error this function caught). Fix: let "
                "the error propagate."
            )
        )


def permute_promised(ctx: DistributedContext) -> bool:
    """Whether this call promised its first collective as a carried ppermute, not yet made."""
    carried = ctx.mesh.carried
    return carried is not None and carried.slots < 0 and carried.started is None
