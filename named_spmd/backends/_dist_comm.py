"""Communication on one group of a real mesh, indexed in the order of a tuple of axes.

A :class:`Comm` is this rank's view of the group of ``axes`` (an ordered tuple of mesh axis
names): the member with *tuple index* ``i`` is the one whose coordinates on ``axes``, read
row-major with the first name major, give ``i`` (docs/design.md section 3). One process group serves
every order of the same set of axes; where its group ranks are not in tuple order, blocks are
reordered here, so ``('tp', 'dp')`` and ``('dp', 'tp')`` both follow their own row-major order.

Every method returns a fresh buffer or writes into one the caller owns, calls the process group
directly (the ``dist.*`` wrappers cost microseconds per call and dispatch through torch function
modes), and waits through the mesh's :class:`~._dist_failures.FailureBoard` so that a failed peer
ends the wait with an error naming it instead of a hang. A group's work outlives its wait (the
backend's worker thread lets go of it a moment later) and keeps the thread-local state it was
made under, so it is started with no torch function mode on the stack: through the modes it would
hold the call's context.
"""

from __future__ import annotations

import datetime
import zlib
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from .._errors import SpmdError
from .._torch_private import without_function_modes
from ._dist_exchange import check_same_call
from ._dist_failures import POLL_S
from ._dist_waiting import wait as wait_for

_SLICE = datetime.timedelta(seconds=POLL_S)
_LAYOUTS = 256  # the flagged ppermutes' splits a Comm keeps (per pairs, size, unit and device)
SUM, MAX, MIN = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN


_DTYPE_CODES: dict[torch.dtype, int] = {}


def dtype_code(dtype: torch.dtype) -> int:
    """``dtype`` as an int, the same in every process (where ranks compare dtypes)."""
    code = _DTYPE_CODES.get(dtype)
    if code is None:
        code = _DTYPE_CODES[dtype] = zlib.crc32(str(dtype).encode())
    return code


def dtype_of(code: int) -> torch.dtype | None:
    """The dtype of torch's whose :func:`dtype_code` is ``code`` (None: none is)."""
    if not _DTYPES_BY_CODE:
        dtypes = (d for d in vars(torch).values() if isinstance(d, torch.dtype))
        _DTYPES_BY_CODE.update((dtype_code(d), d) for d in dtypes)
    return _DTYPES_BY_CODE.get(code)


_DTYPES_BY_CODE: dict[int, torch.dtype] = {}


def _real(t: torch.Tensor) -> torch.Tensor:
    """``t`` as reals, a view of ``t`` (a complex ``t`` as pairs), so that a reduction in place
    of it leaves its result in ``t``: for a buffer the library owns, never a conjugate view
    (torch has none of one, and raises)."""
    return torch.view_as_real(t) if t.is_complex() else t


def _pairs(t: torch.Tensor) -> torch.Tensor:
    """A caller's complex ``t`` as pairs of reals. A conjugate view (``x.conj()``) is conjugated
    first, into a copy, not a view of ``t``."""
    return _real(t.resolve_conj())


# --- dtypes on the wire --------------------------------------------------------------------------
# Gloo moves and reduces only these dtypes; given another (complex, int16, the unsigned 16- to
# 64-bit integers, float8, bit dtypes) it raises mid-collective on some ranks, and the ranks fall
# out of step. So complex values travel as pairs of their real dtype, every other dtype is moved
# as its bytes and reduced through a wider integer dtype, exactly (the collectives' checks refuse,
# on every backend alike, the reductions torch itself has no kernel for). The functions below are
# functional: the eager collectives (here) and the traced ones (``_dist_compile``) share them.
_NATIVE = frozenset(
    {
        *(torch.float16, torch.bfloat16, torch.float32, torch.float64),
        *(torch.int8, torch.uint8, torch.int32, torch.int64, torch.bool),
    }
)
_WIDER = {torch.int16: torch.int32, torch.uint16: torch.int32, torch.uint32: torch.int64}
_SIGN64 = -(2**63)  # uint64 XOR this, read as int64, keeps the order (max, min)


def on_wire(x: torch.Tensor, run: Any) -> torch.Tensor:
    """``run(x)`` for a data movement (its result a fresh contiguous tensor of ``x``'s dtype,
    shaped like ``x`` but for leading dims), on a dtype the backend moves: a complex ``x`` as
    pairs of reals, another dtype gloo lacks as a view of its bytes (one more dim, of the item
    size); the result viewed back, bit for bit. The movement's own copies then run on bytes too,
    which torch has kernels for where it has none for the dtype (the sub-byte ones)."""
    if x.dtype in _NATIVE:
        return run(x)
    if x.is_complex():
        return torch.view_as_complex(on_wire(_pairs(x), run))
    return run(x.unsqueeze(-1).view(torch.uint8)).view(x.dtype).squeeze(-1)


def _same(wire: torch.Tensor) -> torch.Tensor:
    return wire


def reduce_wire(t: torch.Tensor, summed: bool, where: str) -> tuple[torch.Tensor, Any]:
    """``(wire, back)``: ``t`` in a dtype the backend reduces exactly (a sum if ``summed``, else a
    max or min): ``t`` itself, a view of its bits, or a copy (wider, or of a conjugate view); and
    ``back``, the reduced wire -> the value in ``t``'s dtype (a view of the wire where the wire is
    a view of ``t``, so that a reduction in place of such a wire leaves its result in ``t``)."""
    if t.is_complex():
        wire, back = reduce_wire(_pairs(t), summed, where)
        return wire, lambda w: torch.view_as_complex(back(w))
    if t.dtype is torch.bool and summed:  # gloo adds their bytes (True + True = 2): the
        # sum of truth values is their "or", as on the simulated mesh
        return t.to(torch.int32), lambda w: w.to(torch.bool)  # nonzero: True
    if t.dtype in _NATIVE:
        return t, _same
    wider = _WIDER.get(t.dtype)
    if wider is not None:  # integers: the sum wraps alike after the cast back
        dtype = t.dtype
        return t.to(wider), lambda w: w.to(dtype)
    if t.dtype is torch.uint64:  # the same bits summed modulo 2**64; ordered after the XOR
        bits = t.view(torch.int64)
        if summed:
            return bits, lambda w: w.view(torch.uint64)
        return bits ^ _SIGN64, lambda w: (w ^ _SIGN64).view(torch.uint64)
    raise SpmdError(  # the collectives' checks refuse these first; an internal caller must not
        f"{where}: torch.distributed cannot reduce {t.dtype}. Fix: reduce x.to(torch.float32)."
    )


def unreceived(x: torch.Tensor, src: int | None, me: int) -> torch.Tensor | None:
    """A ppermute's result on member ``me`` where no peer sends to it (``src``, from
    :func:`permute_splits`): zeros where nothing arrives, a copy of its own ``x`` where it
    sends to itself; None where a peer's block arrives."""
    if src is None:
        return torch.zeros_like(x, memory_format=torch.contiguous_format)
    if src == me:
        return x.clone(memory_format=torch.contiguous_format)
    return None


def permute_splits(pairs, me: int, numel: int, group_rank) -> tuple:
    """``(src, received, sent)`` of a ppermute's ``all_to_all_single`` on tuple member ``me``:
    the member it receives from (or None), and the split sizes in group-rank order
    (``group_rank``: tuple index -> group rank), one non-empty split each way at most."""
    dst = next((d for s, d in pairs if s == me), None)
    src = next((s for s, d in pairs if d == me), None)
    received, sent = [0] * len(group_rank), [0] * len(group_rank)
    if dst is not None and dst != me:
        sent[group_rank[dst]] = numel
    if src is not None and src != me:
        received[group_rank[src]] = numel
    return src, received, sent


class Comm:
    """The group of ``axes`` seen from this rank, in tuple order."""

    def __init__(
        self,
        mesh: Any,
        axes: tuple[str, ...],
        group: Any,
        tuple_ranks: list[int],
        poll: bool | None = None,
    ):
        self.mesh = mesh  # a DistributedMesh: board (failures), debug flag, poll flag
        # wait in slices, watching for failed peers (the mesh's flag unless told: the check
        # group of a mesh whose own groups are not polled is)
        self.poll = mesh.poll if poll is None else poll
        self.axes = axes
        self.group = group
        self.n = len(tuple_ranks)
        self.tuple_ranks = tuple_ranks  # global rank of each tuple index
        group_ranks = dist.get_process_group_ranks(group)
        self.members = group_ranks
        self.index = tuple_ranks.index(mesh.rank)  # this rank's tuple index
        to_group = [group_ranks.index(r) for r in tuple_ranks]  # tuple index -> group rank
        self.group_rank = to_group
        identity = to_group == list(range(self.n))
        self._to_group = None if identity else torch.tensor(to_group)
        self._from_group = None if identity else torch.argsort(torch.tensor(to_group))
        self.key = "+".join(sorted(axes)) + f"@{min(group_ranks)}"
        # the single-tensor process-group methods (their public names since torch 2.12)
        self._gather = group.all_gather_single
        self._scatter = group.reduce_scatter_single
        self._a2a = group.all_to_all_single
        self._opts = {op: self._reduce_opts(op) for op in (SUM, MAX, MIN)}
        self._async_sum = self._reduce_opts(SUM)
        self._async_sum.asyncOp = True  # on CUDA too: NCCL's own stream, joined at the wait
        self._gather_opts = c10d.AllgatherOptions()
        self._gather_opts.asyncOp = self.poll
        self._scatter_opts = c10d.ReduceScatterOptions()
        # pybind converts a RedOpType to a ReduceOp implicitly; torch's stubs do not say so
        self._scatter_opts.reduceOp = SUM  # type: ignore[assignment]
        self._scatter_opts.asyncOp = self.poll
        self._a2a_opts = c10d.AllToAllOptions()
        self._a2a_opts.asyncOp = self.poll
        self._started_a2a_opts = c10d.AllToAllOptions()
        self._started_a2a_opts.asyncOp = True  # (start_all_to_all: waited for later)
        self._agree_opts = self._reduce_opts(MAX)
        self._agree_opts.asyncOp = True  # started, and finished after some of the body
        self._doings: dict[str, str] = {}  # op -> where a wait for it is (every wait names it)
        self._flagged: dict[tuple, tuple] = {}  # permute_flagged's splits (_flagged_layout)

    def _reduce_opts(self, op):
        opts = c10d.AllreduceOptions()
        opts.reduceOp = op
        opts.asyncOp = self.poll
        return opts

    # --- plumbing -----------------------------------------------------------------------------
    def _doing(self, op: str) -> str:
        doing = self._doings.get(op)
        if doing is None:
            doing = self._doings[op] = f"in {op} over {self.axes}"
        return doing

    def _debug(self, op: str, t: torch.Tensor, extra: str = "") -> None:
        sig = f"{op}({list(t.shape)}, {t.dtype}, axes={self.axes}{extra})"
        check_same_call(self.mesh.board, self.key, self.members, sig, f"rank {self.mesh.rank}")

    def _start(self, op: str, start) -> Any:
        """``start()``, a collective's start, with no torch function mode on the stack (see the
        module's doc); returns its work. A failure to start becomes RankFailedError."""
        try:
            return without_function_modes(start)
        except RuntimeError as e:
            raise self.mesh.board.translate(e, self._doing(op)) from None

    def _issue(self, op: str, start) -> None:
        """Start a collective and wait for it; failures become RankFailedError."""
        self._wait(op, self._start(op, start))

    def _wait(self, op: str, work: Any) -> None:
        if self.poll:
            try:  # (the common case, done within the first slice, is one wait: _waited's)
                wait_for(self.mesh.board, work, self._doing(op), _SLICE, self.members)
            except BaseException:
                if not work.is_completed():  # left in flight: see DistributedMesh.release_groups
                    self.mesh.gave_up = True
                raise
            return
        board = self.mesh.board
        if work is not None:
            try:
                work.wait()
            except RuntimeError as e:
                raise board.translate(e, self._doing(op)) from None

    def start_agree(self, value: int, name: str) -> tuple[Any, torch.Tensor]:
        """Start comparing ``value`` across the group: one all-reduce of two int64 (the max of
        ``value`` and of ``-value``: they agree when the max equals the min). :meth:`agreed`
        finishes it; in between, this rank computes."""
        # (torch.tensor, not frombuffer of packed bytes, which is faster: such a tensor holds a
        # Python object, which gloo's worker thread may free after the interpreter finalizes)
        buf = torch.tensor([value, -value], dtype=torch.int64)
        opts = self._agree_opts
        return self._start(name, lambda: self.group.allreduce([buf], opts)), buf

    def agreed(self, started: tuple[Any, torch.Tensor], name: str) -> bool:
        """Whether every member passed the same value to :meth:`start_agree`."""
        work, buf = started
        self._wait(name, work)
        # max(value) + max(-value) == 0 (one op; not tolist(): a functionalized buffer has none)
        return int(buf.sum()) == 0

    # --- collectives --------------------------------------------------------------------------
    def all_reduce_(self, buf: torch.Tensor, op=SUM, name: str = "psum") -> torch.Tensor:
        """Reduce ``buf`` over the group (the caller owns it: reduced in place, unless its
        dtype travels as a wider copy); returns the result."""
        self._before(name, buf)
        wire, back = reduce_wire(buf, op == SUM, self._doing(name))
        opts = self._opts[op]
        self._issue(name, lambda: self.group.allreduce([wire], opts))
        return buf if back is _same else back(wire)

    def start_all_reduce_(self, buf: torch.Tensor, name: str = "psum") -> Any:
        """Start summing ``buf`` (owned by the caller) over the group in place; returns the work,
        to be finished with :meth:`finish`."""
        self._before(name, buf)
        wire, opts = _real(buf), self._async_sum
        return self._start(name, lambda: self.group.allreduce([wire], opts))

    def finish(self, work: Any, name: str = "psum") -> None:
        """Wait for a work from :meth:`start_all_reduce_` (failures become RankFailedError)."""
        self._wait(name, work)

    def _before(self, name: str, x: torch.Tensor, extra: str | Any = "") -> None:
        """What precedes every collective: the start-of-call check, debug mode's comparison
        (``extra``: the signature's parameters, or a function making them: made in debug mode
        only)."""
        self.mesh.finish_pending_check()
        if self.mesh.debug:
            self._debug(name, x, extra if isinstance(extra, str) else extra())

    def all_gather(self, x: torch.Tensor, name: str = "all_gather") -> torch.Tensor:
        """``[n, *x.shape]``: every member's ``x``, in tuple order."""
        self._before(name, x)
        return on_wire(x, lambda t: self._all_gather(t, name))

    def _all_gather(self, x: torch.Tensor, name: str) -> torch.Tensor:
        x = x.contiguous()
        out = x.new_empty((self.n, *x.shape))
        opts = self._gather_opts
        # c10d splits the output along dim 0 into pieces shaped like the input: add a unit dim
        x1 = x.unsqueeze(0)
        self._issue(name, lambda: self._gather(out, x1, opts))
        return out if self._to_group is None else out.index_select(0, self._to_group)

    def reduce_scatter(self, stacked: torch.Tensor, name: str = "psum_scatter") -> torch.Tensor:
        """Sum ``stacked`` ([n, *chunk], tuple order) over the group; keep this rank's chunk."""
        if self._from_group is not None:
            stacked = stacked.index_select(0, self._from_group)
        stacked = stacked.contiguous()
        self._before(name, stacked)
        out = stacked.new_empty((1, *stacked.shape[1:]))  # unit dim: see all_gather
        opts = self._scatter_opts
        wire, _ = reduce_wire(stacked, True, self._doing(name))
        into, back = reduce_wire(out, True, self._doing(name))
        self._issue(name, lambda: self._scatter(into, wire, opts))
        return back(into)[0]

    def all_to_all(
        self, stacked: torch.Tensor, name: str = "all_to_all", doing: str | None = None
    ) -> torch.Tensor:
        """Send chunk ``j`` of ``stacked`` ([n, *chunk]) to member ``j``; returns the received
        chunks ``[n_src, *chunk]`` in source tuple order. ``doing``: what a failure names in
        place of ``name`` (this rank's own, where debug mode compares ``name``)."""
        self._before(name, stacked)
        return on_wire(stacked, lambda t: self._all_to_all(t, doing or name))

    def _all_to_all(self, stacked: torch.Tensor, name: str) -> torch.Tensor:
        if self._from_group is not None:
            stacked = stacked.index_select(0, self._from_group)
        stacked = stacked.contiguous()
        out = torch.empty_like(stacked)
        opts = self._a2a_opts
        self._issue(name, lambda: self._a2a(out, stacked, [], [], opts))
        return out if self._to_group is None else out.index_select(0, self._to_group)

    def start_all_to_all(self, stacked: torch.Tensor) -> tuple[Any, torch.Tensor]:
        """Start :meth:`all_to_all` of ``stacked`` (contiguous, owned by the caller, a dtype gloo
        moves) without waiting: :meth:`finish_all_to_all` waits. Nothing precedes it (no
        start-of-call check, no debug comparison): the caller has the ranks agree on it."""
        if self._from_group is not None:
            stacked = stacked.index_select(0, self._from_group)
        out = torch.empty_like(stacked)
        opts = self._started_a2a_opts
        return self._start("all_to_all", lambda: self._a2a(out, stacked, [], [], opts)), out

    def finish_all_to_all(self, started: tuple[Any, torch.Tensor], name: str) -> torch.Tensor:
        """Wait for :meth:`start_all_to_all`; the received chunks in source tuple order."""
        work, out = started
        self._wait(name, work)
        return out if self._to_group is None else out.index_select(0, self._to_group)

    def all_to_all_rows(
        self, x: torch.Tensor, sent: list[int], received: list[int], name: str = "all_to_all"
    ) -> torch.Tensor:
        """Send ``x``'s rows in chunks of ``sent[j]`` (tuple order) to member ``j``; returns the
        rows received (``received[i]`` from member ``i``), concatenated in source tuple order.
        The sizes differ between members, so debug mode's comparison of calls does not apply."""
        self.mesh.finish_pending_check()
        return on_wire(x, lambda t: self._all_to_all_rows(t, sent, received, name))

    def _all_to_all_rows(self, x: torch.Tensor, sent, received, name: str) -> torch.Tensor:
        into = x.new_empty((sum(received), *x.shape[1:]))
        opts = self._a2a_opts
        if self._from_group is None:  # tuple order is group-rank order: x is sent as it is
            send, in_splits, out_splits = x.contiguous(), list(sent), list(received)
            self._issue(name, lambda: self._a2a(into, send, out_splits, in_splits, opts))
            return into
        chunks = list(x.split(list(sent)))
        order = self._from_group.tolist()
        send = torch.cat([chunks[t] for t in order])  # group-rank order
        in_splits = [sent[t] for t in order]
        out_splits = [received[t] for t in order]
        self._issue(name, lambda: self._a2a(into, send, out_splits, in_splits, opts))
        pieces = dict(zip(order, into.split(out_splits)))
        return torch.cat([pieces[t] for t in range(self.n)])

    def permute(self, x: torch.Tensor, pairs: tuple[tuple[int, int], ...], name="ppermute"):
        """Send ``x`` along ``(src, dst)`` tuple-index pairs; receive into a fresh buffer (zeros
        when nothing arrives).

        One ``all_to_all_single`` with one non-empty split each way, not a send and a recv:
        gloo closes the connection when a timed wait on a recv times out, so a recv could not
        be waited for in slices (a sender late by one slice broke the mesh), while a
        collective's work can."""
        self._before(name, x, lambda: f", pairs={sorted(pairs)}")
        return on_wire(x, lambda t: self._permute(t, pairs, name))

    def _permute(self, x: torch.Tensor, pairs: tuple[tuple[int, int], ...], name: str):
        me = self.index
        block = x.contiguous().reshape(-1)  # kept alive here until the send completes
        src, received, sent = permute_splits(pairs, me, block.numel(), self.group_rank)
        out = unreceived(x, src, me)
        if out is None:
            out = torch.empty_like(x, memory_format=torch.contiguous_format)
        if all(s == d for s, d in pairs):
            return out  # every pair stays home: no member communicates
        nothing = block.new_empty(0)
        send = block if any(sent) else nothing
        into = out.view(-1) if any(received) else nothing
        opts = self._a2a_opts
        self._issue(name, lambda: self._a2a(into, send, received, sent, opts))
        return out

    def permute_flagged(
        self, x: torch.Tensor, pairs: tuple[tuple[int, int], ...], differs: bool, name="ppermute"
    ) -> tuple[torch.Tensor, bool]:
        """:meth:`permute` of ``x``, every member also sending every other one a flag, one
        element of ``x``'s dtype more to each (the same sizes on every member, whatever the
        flags); returns the result and whether any member's ``differs`` was set (then the
        result is not to be used: every member learns it in this one collective)."""
        self._before(name, x, lambda: f", pairs={sorted(pairs)}, flagged")
        flags: list[bool] = []
        size = x.element_size()
        out = on_wire(x, lambda t: self._permute_flagged(t, pairs, differs, flags, name, size))
        return out, flags[0]

    def _permute_flagged(self, x, pairs, differs: bool, flags: list[bool], name: str, size: int):
        block = x.contiguous().reshape(-1)
        # a flag of as many wire elements as one of the caller's dtype (its bytes, a complex
        # value's two reals), so that the block received after it views back as that dtype
        unit = max(1, size // block.element_size())
        layout = self._flagged_layout(pairs, block.numel(), unit, block.device)
        src, out_splits, in_splits, peers, at = layout
        # per peer in group-rank order: the flag, then this member's block to its destination
        send = block.new_full((sum(in_splits),), int(differs))
        if at is not None:
            send.narrow(0, at, block.numel()).copy_(block)
        into = block.new_empty(sum(out_splits))
        opts = self._a2a_opts
        self._issue(name, lambda: self._a2a(into, send, out_splits, in_splits, opts))
        # every peer's flag read on the host at once (one synchronisation)
        flags.append(differs or any(into.index_select(0, peers).tolist()))
        out = unreceived(x, src, self.index)
        if out is not None:
            return out
        start = sum(out_splits[: self.group_rank[src]])  # the source's flag, then its block
        return into.narrow(0, start + unit, block.numel()).view(x.shape)

    def _flagged_layout(self, pairs, numel: int, unit: int, device: torch.device) -> tuple:
        """The splits of :meth:`permute_flagged` of ``numel`` elements along ``pairs`` (a flag
        of ``unit`` elements to every peer, the block after it to the destination): ``(src,
        out_splits, in_splits, peers, at)``, ``peers`` the received flags' positions, ``at``
        where the block starts in the sent buffer (None: sent nowhere); kept per pairs, sizes
        and device."""
        key = (pairs, numel, unit, device)
        layout = self._flagged.get(key)
        if layout is None:
            mine = self.group_rank[self.index]
            src, received, sent = permute_splits(pairs, self.index, numel, self.group_rank)
            out_splits = [0 if g == mine else unit + n for g, n in enumerate(received)]
            in_splits = [0 if g == mine else unit + n for g, n in enumerate(sent)]
            dst = next((g for g, n in enumerate(sent) if n), None)
            at = None if dst is None else sum(in_splits[:dst]) + unit
            starts = [sum(out_splits[:g]) for g in range(self.n) if g != mine]
            if len(self._flagged) >= _LAYOUTS:
                self._flagged.clear()
            peers = torch.tensor(starts, dtype=torch.int64, device=device)
            layout = (src, out_splits, in_splits, peers, at)
            self._flagged[key] = layout
        return layout

    def broadcast(self, x: torch.Tensor, root: int, name: str = "broadcast") -> torch.Tensor:
        """Tuple member ``root``'s ``x``, in a fresh buffer."""
        self._before(name, x, f", root={root}")
        return on_wire(
            x,
            lambda t: self._broadcast_(t.clone(memory_format=torch.contiguous_format), root, name),
        )

    def _broadcast_(self, buf: torch.Tensor, root: int, name: str) -> torch.Tensor:
        """Overwrite ``buf`` (contiguous, owned by this method) with member ``root``'s ``buf``."""
        opts = c10d.BroadcastOptions()
        opts.rootRank = self.group_rank[root]
        opts.rootTensor = 0
        opts.asyncOp = self.poll
        self._issue(name, lambda: self.group.broadcast([buf], opts))
        return buf
