"""What the ranks of a real mesh must agree on, checked across them.

* Every call (``check_call_agrees``): the same mapped function on tensor inputs of the same global
  shapes, dtypes and requires_grad (under the grad mode), and the same recollection of the
  signature's last call where an uneven call relies on one (``_dist_uneven``); one small
  all-reduce of a checksum, overlapped with the body (a replay may carry its first exchange
  right behind it: ``_dist_carried``).
* Debug mode (``NAMED_SPMD_DEBUG=1``): plain-tensor inputs hold the same values on every rank
  (``check_inputs_agree``), and outputs typed invariant over the axes their out_spec does not
  name hold the same values on the ranks that return them once (``check_replicas_agree``); both
  by exchanging short digests through the failure board's store.
"""

from __future__ import annotations

import hashlib
import zlib
from typing import TYPE_CHECKING, Any

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_private as torch_private
from .._accounting import CommEvent, active, record_into
from .._errors import SpmdError
from . import _dist_carried
from ._dist_buckets import bucket_bytes
from ._dist_comm import _DTYPE_CODES, dtype_code
from ._dist_exchange import exchange
from ._dist_pvary import digest, hoists_early

if TYPE_CHECKING:
    from .._call import Call
    from .._spec import PartitionSpec
    from .distributed import DistributedContext


# --- every call: the ranks call the same function on inputs of the same shapes ---------------------


_INT62 = (1 << 62) - 1  # the checksum and its negation fit an int64


def begin(ctx: DistributedContext, call: Call, hoistable: tuple, traced: bool) -> None:
    """The start-of-call check (:func:`check_call_agrees`; ``hoistable``: a replay's, ``Plan``);
    in a call ``make_fx`` traces, finished at once, out of the trace (a traced tensor has no
    value to read)."""
    args = (ctx, call.leaves, call.local, hoistable, call.memo)
    if not traced:
        check_call_agrees(*args)
        return
    with torch_private.no_dispatch_modes():
        check_call_agrees(*args)
        ctx.mesh.finish_pending_check()


def check_call_agrees(
    ctx: DistributedContext,
    leaves: list[Any],
    local: bool = False,
    hoistable: tuple = (),
    memo: dict | None = None,
) -> None:
    """Gloo aborts the whole process (SIGABRT, no Python error) when the ranks of a collective
    pass buffers of different sizes, as inputs of different global shapes on different ranks make
    them. One small all-reduce per call compares a checksum of the function and of the tensor
    inputs' global shapes, dtypes and requires_grad; it also keeps the ranks within one call of
    each other, which lets a rank left waiting in an earlier call name the one that moved on
    (``_dist_waiting._ahead``). Only when the checksums differ are the descriptions exchanged.
    It is started here and finished (``mesh.finish_pending_check``) before the call's first
    collective (``Comm``) or at the end of the body, so the body's computation until then
    overlaps it.
    It also compares what decides, beside the inputs, how the call communicates (ranks that
    differ there would sum mismatched elements, or wait): the bucket size and debug mode, and
    the inputs a replay pvarys at its entry, ``hoistable`` (``_dist_pvary``; none where a rank
    types the call, having read a type in its planned one: then no rank makes them).
    ``memo``: the call's ``Call.memo``, where the leaves' description is kept."""
    mesh = ctx.mesh
    # the latest failed call this rank knows of: a rank that finished a call in which another
    # failed, without needing it, disagrees and learns of it here (``_disagree``)
    known = mesh.board.known_failure()
    grad = torch.is_grad_enabled()
    settings = (bucket_bytes(), mesh.debug)
    metadata = hash((local, known, settings, _described(leaves, grad, memo)))
    checksum = (metadata ^ zlib.crc32(ctx.fn_label.encode())) & _INT62
    # and what this rank recalls of the signature's last call (an uneven call's shapes), which
    # the call relies on only where every rank recalls the same
    # and the casts a replay would make at its entry, which it makes only where every rank would
    # and the exchange a replay carries right behind the check (``_dist_carried``: the digest
    # holds its slots), which it makes there only where every rank promised it
    recalled = (ctx.recall_shapes(checksum) ^ digest(hoistable)) & _INT62
    promised = _dist_carried.promise(ctx, hoistable)
    comm = mesh.check_comm()
    started = comm.start_agree(checksum ^ recalled, "the start-of-call check")
    if active():  # a collective of the call: CommMode counts it, as a boundary event
        event = CommEvent("pmax", comm.axes, "forward", (2,), torch.int64, boundary=True)
        record_into(active(), event)

    def finish() -> None:
        mesh.pending_check = None
        deferred = _dist_carried.keep_promise(mesh)
        if not comm.agreed(started, "the start-of-call check"):
            _disagree(ctx, leaves, grad, local, known, recalled, settings, promised, hoistable)
        _dist_carried.settle(ctx)
        _dist_carried.fill(ctx, deferred)

    mesh.pending_check = finish


def _described(leaves: list[Any], grad: bool, memo: dict | None) -> int:
    """A hash of each tensor leaf's global shape, dtype and, under grad mode ``grad``,
    requires_grad (a rank whose input alone requires grad runs the backward collectives alone,
    and waits for its peers there for ever), the same in every process (``hash`` of int tuples,
    a ``torch.Size`` one, is; of a str it is not). Kept in ``memo`` (``Call.memo``, whose key
    holds every leaf's shape, dtype and requires_grad) per grad mode."""
    key = "start-of-call check" if grad else "start-of-call check, no grad"
    described = None if memo is None else memo.get(key)
    if described is None:
        codes = _DTYPE_CODES  # (dtype_code and its memo, read inline: one entry per tensor leaf)
        described = hash(
            tuple(
                (x.shape, codes.get(x.dtype) or dtype_code(x.dtype), grad and x.requires_grad)
                for x in leaves
                if isinstance(x, torch.Tensor)
            )
        )
        if memo is not None:
            memo[key] = described
    return described


def _disagree(
    ctx: DistributedContext,
    leaves: list[Any],
    grad: bool,
    local: bool,
    known: int,
    recalled: int,
    settings: tuple[int, bool],
    promised: int,
    hoistable: tuple,
) -> None:
    """The checksums differ: exchange the descriptions and raise on every rank alike, or, where
    only what the ranks recall of the signature's last call differs, forget it on every rank
    alike (the call then exchanges every shape afresh), unless some ranks made a replay's entry
    casts before the check and others not (``_dist_pvary.hoists_early``: the call is refused).
    A carried exchange that some rank promised (``promised``: this one's slots) is made on every
    rank first (``_dist_carried``)."""
    mesh = ctx.mesh
    shapes = ", ".join(
        f"{list(x.shape)} {str(x.dtype)[6:]}{' requires_grad' if grad and x.requires_grad else ''}"
        for x in leaves
        if isinstance(x, torch.Tensor)
    )
    mine = f"{ctx.fn_label}{'.local' if local else ''}({shapes})"
    # (told only where the inputs are alike)
    mine += f" [settings: gradient buckets of {settings[0]} bytes, debug mode {settings[1]}]"
    board = mesh.board
    got = exchange(
        board,
        "call",
        board.ranks,
        f"{known} {int(bool(promised))} {int(hoists_early(hoistable))} {recalled} {mine}",
        f"rank {mesh.rank}",
        "the start-of-call check",
    )
    # known, promised, hoisted early, recalled, call
    fields = {r: v.split(" ", 4) for r, v in got.items()}
    _dist_carried.drain(mesh, any(f[1] == "1" for f in fields.values()))
    knowns = {r: int(f[0]) for r, f in fields.items()}
    got = {r: f[4] for r, f in fields.items()}
    latest = max(knowns.values())
    if len(set(got.values())) == 1 and len(set(knowns.values())) == 1:  # (the recalled differ)
        early = sorted(r for r, f in fields.items() if f[2] == "1")
        if early and len(early) < len(fields):
            raise _hoisted_apart(ctx, hoistable, early)
        ctx.forget_shapes()  # (where every rank hoisted early, alike: kept)
        return
    if len(set(got.values())) == 1:  # the same call: some ranks missed a failure
        missed = sorted(r for r, k in knowns.items() if k < latest)
        raise board.missed_failure(latest, missed)
    board.learned(latest)  # on every rank alike
    inputs = {r: v[: v.rindex(" [settings: ")] for r, v in got.items()}
    if len(set(inputs.values())) > 1:  # (the inputs differ: their gradients follow from that)
        got = inputs
    lines = "\n".join(f"    {board.where(r)}: {v}" for r, v in got.items())
    kind = "block" if local else "global"
    raise SpmdError(
        f"spmd_map of {ctx.fn_label}: the ranks called different mapped functions, or passed "
        f"tensor inputs of different {kind} shapes, dtypes or requires_grad (function(the "
        f"{kind} shape and dtype of each tensor leaf, in flattening order, and requires_grad "
        f"where grad mode is on and it does); .local: a call with blocks):\n"
        f"{lines}\nEvery rank must call the same function (all f(...) or all f.local(...)) on "
        f"inputs of the same {kind} shapes and requires_grad ("
        + (
            "each rank's block under its spec, equal in shape on every rank"
            if local
            else "a plain tensor is the global value, present on every rank"
        )
        + "). Fix: make the inputs' shapes, their requires_grad, the grad mode, the call "
        "sequence, ns.set_grad_bucket_mb and debug mode (ns.set_debug) independent "
        "of the rank."
    )


def _hoisted_apart(ctx: DistributedContext, hoistable: tuple, early: list[int]) -> SpmdError:
    """The error of a replay that some ranks entered with its casts made before the check and
    others not (their gradients' all-reduces would differ); the plan checks first again."""
    if hoists_early(hoistable):
        hoistable.agreed = False  # type: ignore[attr-defined]
    board = ctx.mesh.board
    where = ", ".join(board.where(r) for r in early)
    error = SpmdError(
        f"spmd_map of {ctx.fn_label}: {where} made this call's implicit casts of its replicated "
        "inputs at its entry, before the start-of-call check finished, as an earlier call of the "
        "same plan agreed on every rank; the other ranks did not (their plans were made after a "
        "call that failed on some ranks only). Their gradients' all-reduces would not match, so "
        "every rank refuses this call, and the next one checks first. Fix: call it again."
    )
    ctx.alike(error)
    return error


# --- debug mode: values that must be equal on every rank ------------------------------------------


def _digest(t: torch.Tensor) -> str:
    """A short fingerprint of a tensor's bytes, dtype and shape (equal values, equal digests);
    of a transform's wrapper (a call under a user's vmap), those of the tensor it holds. A
    conjugate or negative view is read as its values (torch has no byte view of one). Read with
    torch.func's transforms off: under a user's grad or jvp over the call they would wrap the
    copies again (a wrapper has no storage to read)."""
    with torch_private.DisableFuncTorch():
        t = torch_private.innermost(t).detach().resolve_conj().resolve_neg()
        raw = t.contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()
    meta = f"{t.dtype}{tuple(t.shape)}".encode()
    return hashlib.blake2b(raw + meta, digest_size=8).hexdigest()


def check_inputs_agree(
    ctx: DistributedContext, leaves: list[Any], block_specs: list[PartitionSpec] | None = None
) -> None:
    """A plain-tensor input is the global value, taken as present on every rank: check it is
    (a model initialised differently per rank would otherwise be mixed silently). In a local
    call (``block_specs``: the leaves are blocks under these specs) only the blocks every rank
    holds whole are checked: those of specs that split nothing and hold no partial sums."""
    mesh = ctx.mesh
    plain = [
        i
        for i, x in enumerate(leaves)
        if isinstance(x, torch.Tensor)
        and not isinstance(x, DTensor)
        and (block_specs is None or not (block_specs[i].axes or block_specs[i].unreduced))
    ]
    if not plain:
        return
    mine = ",".join(_digest(leaves[i]) for i in plain)
    ranks = list(range(mesh.size))
    got = exchange(mesh.board, "inputs", ranks, mine, f"rank {mesh.rank}", "the input check")
    differ = sorted(
        {
            plain[k]
            for v in got.values()
            for k, d in enumerate(v.split(","))
            if d != mine.split(",")[k]
        }
    )
    if differ:
        why = (
            "they are replicated blocks of a local call, which every rank holds whole"
            if block_specs is not None
            else "a plain tensor is the global value, the same on every rank"
        )
        raise SpmdError(
            f"spmd_map of {ctx.fn_label}: debug check: plain-tensor input leaves {differ} (in "
            f"flattening order) differ between ranks, but {why}. Fix: seed every "
            "rank alike before making it (or broadcast it from rank 0), or pass DTensors laid "
            "out as the in_specs say."
        )


def check_replicas_agree(ctx: DistributedContext, outs: list[Any], specs: list[Any]) -> None:
    """An output typed invariant over the axes its out_spec does not name is returned once: check
    the copies the ranks of each such group hold are equal (typed invariant, they must be)."""
    mesh = ctx.mesh
    for k, (y, spec) in enumerate(zip(outs, specs)):
        replicated = tuple(a for a in mesh.axis_names if a not in spec.axes)
        replicated = tuple(a for a in replicated if mesh.shape[a] > 1)
        if not replicated or not isinstance(y, torch.Tensor):
            continue
        comm = mesh.comm(replicated)
        got = exchange(
            mesh.board,
            f"outputs/{comm.key}",
            comm.members,
            _digest(y),
            f"rank {mesh.rank}",
            f"output {k}",
        )
        if len(set(got.values())) > 1:
            raise SpmdError(
                f"spmd_map of {ctx.fn_label}: debug check: output {k} is typed invariant over "
                f"{replicated}, so it is returned once, but the ranks of that group hold different "
                f"values (ranks {sorted(got)}). Random draws with a per-rank seed are the usual "
                "cause (torch.manual_seed(rank)): random ops are typed as the same stream on "
                "every instance. Fix: seed every rank alike, or make the value depend on "
                "ns.axis_index and name the axis in out_specs."
            )
