"""Collectives on a real mesh as autograd Functions whose backward is the transpose.

Each collective is one ``torch.autograd.Function`` (forward: the communication, through a
:class:`~._dist_comm.Comm`; backward: the transpose of DESIGN.md section 3; jvp: the same linear
map on the tangent), with ``setup_context`` so that ``torch.func.grad`` / ``vjp`` / ``jvp`` work
inside the per-device function. Two costs measured in DESIGN.md section 5 are avoided:

* ``Function.apply`` binds its arguments with ``inspect`` (about 10 us on this machine even more)
  when ``setup_context`` is defined; with no torch.func transform active we call the C
  implementation directly, and with nothing to differentiate we skip the Function entirely.
* A copy per collective: the forward reduces into a fresh buffer (it must: the operand is the
  user's), but the backward of ``pvary`` (the data-parallel gradient reduction of a replicated
  weight, the largest message of a training step) reduces the incoming gradient *in place*
  when nothing else can see it: no view, no other holder of its storage or its TensorImpl, and
  no Python reference beyond the autograd engine's (autograd may hand one gradient tensor to two
  consumers, and a hook may keep it). :func:`_exclusive` checks exactly that.
"""

from __future__ import annotations

import sys

import torch
from torch._C import _functorch
from torch.autograd import forward_ad
from torch.distributed._functional_collectives import (
    AsyncCollectiveTensor as _AsyncCollectiveTensor,
)

from ._dist_comm import MAX, MIN, SUM, Comm
from ._dist_donate import storage_counts

_register_work = torch._C._distributed_c10d._register_work
_AccumulateGrad = torch._C._functions.AccumulateGrad
_wait_tensor_op = torch.ops._c10d_functional.wait_tensor.default
_below_autograd = torch._C._AutoDispatchBelowAutograd
_queue_callback = torch.autograd.Variable._execution_engine.queue_callback

_transforms_active = torch._C._are_functorch_transforms_active
_base_apply = torch._C._FunctionBase.__dict__["apply"]
_contiguous = torch.contiguous_format


def _differentiable(x: torch.Tensor) -> bool:
    """Whether a collective on ``x`` must record autograd (or forward-mode) information."""
    return (
        _transforms_active()
        or (x.requires_grad and torch.is_grad_enabled())
        or forward_ad._current_level >= 0
    )


def _fast_apply(cls):
    """Give ``cls`` a ``fast`` apply that skips the Python argument binding of Function.apply."""
    cls.fast = _base_apply.__get__(None, cls)
    return cls


def _apply(cls, *args):
    if _transforms_active():  # functorch needs the full Python path (it wraps the Function)
        return cls.apply(*args)
    return cls.fast(*args)


# --- who else can see a gradient? ----------------------------------------------------------------

# (TensorImpl uses, storage uses, Python refs, Python refs to the storage object)
_BASELINE: list[tuple[int, int, int, int]] = []


def _refs(g: torch.Tensor) -> int:
    return sys.getrefcount(g)


def _counts(g: torch.Tensor) -> tuple[int, int, int, int] | None:
    try:
        storage, storage_refs = storage_counts(g)  # the same counts as forward donation
    except (RuntimeError, NotImplementedError):
        return None
    return g._use_count(), storage, _refs(g), storage_refs


def _exclusive(g: torch.Tensor, probe: bool = False) -> bool:
    """True when the backward that received ``g`` may overwrite it: called directly from a
    Function's backward. The references the autograd engine itself holds differ between torch
    versions, so they are measured once (:func:`_calibrate`) on a gradient nothing else holds."""
    if probe:
        _BASELINE.append(_counts(g))
        return False
    if type(g) is not torch.Tensor:  # a wrapper (subclass): its storage is not what we count
        return False
    if g._base is not None or not g.is_contiguous() or _functorch.is_functorch_wrapped_tensor(g):
        return False
    counts = _counts(g)
    if counts is None or not _BASELINE or _BASELINE[0] is None:
        return False
    base = _BASELINE[0]
    return all(c <= b for c, b in zip(counts, base))


class _Calibrate(torch.autograd.Function):
    """Measures the engine's references to a gradient nothing else holds (Python-version
    independent): the same call shape as a real backward calling :func:`_exclusive`."""

    @staticmethod
    def forward(x):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        _exclusive(g, probe=True)
        return g


def _calibrate() -> None:
    """Run once at import, outside any backward (a nested backward may hold other references)."""
    x = torch.zeros(2, requires_grad=True)
    with torch.enable_grad():
        (_Calibrate.apply(x) * 2.0).sum().backward()
    del _BASELINE[1:]


# --- layouts shared by forward and backward ------------------------------------------------------


def _stack_dim(x: torch.Tensor, dim: int, n: int, tiled: bool) -> torch.Tensor:
    """[..., dim, ...] -> [n, ...]: chunk j of ``dim`` first (untiled: ``dim`` has size n)."""
    if tiled:
        x = x.unflatten(dim, (n, -1))
    return x.movedim(dim, 0)


def _unstack_dim(stacked: torch.Tensor, dim: int, tiled: bool) -> torch.Tensor:
    """Inverse of :func:`_stack_dim`: [n, ...] -> the blocks along ``dim``."""
    out = stacked.movedim(0, dim)
    return out.flatten(dim, dim + 1) if tiled else out


def _own_block(g: torch.Tensor, comm: Comm, dim: int, tiled: bool) -> torch.Tensor:
    if not tiled:
        return g.select(dim, comm.index)
    size = g.shape[dim] // comm.n
    return g.narrow(dim, comm.index * size, size)


# --- plain implementations (no autograd) ---------------------------------------------------------


def _psum(x, comm):
    return comm.all_reduce_(x.clone(memory_format=_contiguous))


def _all_gather(x, comm, axis, tiled):
    return _unstack_dim(comm.all_gather(x), axis, tiled)


def _psum_scatter(x, comm, dim, tiled):
    return comm.reduce_scatter(_stack_dim(x, dim, comm.n, tiled))


def _all_to_all(x, comm, split, concat, tiled):
    received = comm.all_to_all(_stack_dim(x, split, comm.n, tiled))  # [n_src, *chunk]
    if tiled:
        return _unstack_dim(received, concat, True)
    return received.movedim(0, concat)


def _reversed(pairs):
    return tuple((d, s) for s, d in pairs)


# --- the Functions -------------------------------------------------------------------------------


def _reduce_during_backward(buf: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``buf`` summed over ``comm``, overlapped with the rest of the backward pass.

    The gradient psum of a replicated parameter is the largest message of a training step, and
    waiting for it where it arises would stall the backward (and, on an oversubscribed host,
    every rank behind the slowest). So, as DDP overlaps its bucketed all-reduce with backward,
    the reduction only starts here. The result is an ``AsyncCollectiveTensor`` (torch's
    functional collectives' wait-on-first-use tensor): any op that reads it, such as the
    accumulation of a second gradient contribution, waits for the sum first. At the end of the
    backward pass, a callback waits for the rest through the failure board (so a failed peer
    raises RankFailedError rather than hanging) and releases torch's record of the work: no
    reduction outlives the backward that started it; then the leaves' ``.grad`` that received
    the wrapper get the plain tensor (:func:`when_reduced`). A backward that raises runs no final
    callbacks: its reductions stay in ``_PENDING`` until :func:`finish_pending` (the next call on
    the mesh) finishes them."""
    work = comm.start_all_reduce_(buf)
    _register_work(buf, work)
    key = id(work)  # unique while the entry keeps the work alive
    _PENDING[key] = (comm, work, buf, [])

    def finish():
        entry = _PENDING.pop(key, None)
        if entry is not None:  # else finish_pending did it
            _finish(*entry)

    try:
        _queue_callback(finish)
    except RuntimeError:  # not inside an autograd engine backward: finish now
        finish()
        return buf
    pending = _AsyncCollectiveTensor(buf)
    pending._named_spmd_work = work
    return pending


# id(work) -> (comm, work, buffer, what to run once it is done): overlapped reductions started
# and not finished yet
_PENDING: dict[int, tuple[Comm, object, torch.Tensor, list]] = {}


def _finish(comm: Comm, work, buf: torch.Tensor, then: list) -> None:
    comm.finish(work)
    _forget_work(buf)  # so that a later read does not wait again
    for fn in then:
        fn()


def _work_of(g: torch.Tensor):
    """The work of a pending gradient from :func:`_reduce_during_backward`, else None."""
    return g.__dict__.get("_named_spmd_work") if type(g) is _AsyncCollectiveTensor else None


def when_reduced(g: torch.Tensor, fn) -> None:
    """Run ``fn()`` once the overlapped reduction behind the pending gradient ``g`` is done (at
    the end of the backward pass); nothing if ``g`` is not pending."""
    work = _work_of(g)
    entry = _PENDING.get(id(work)) if work is not None else None
    if entry is not None and entry[1] is work:
        entry[3].append(fn)


def is_pending_wrapper(t: torch.Tensor) -> bool:
    return type(t) is _AsyncCollectiveTensor


def plain_grad(leaf: torch.Tensor) -> None:
    """Give ``leaf`` its gradient as the plain tensor, where the accumulation stored the pending
    wrapper (a finished one): ``.grad`` then copies, pickles and exposes its storage as usual."""
    grad = leaf.grad
    if is_pending_wrapper(grad):
        leaf.grad = grad.elem


def finish_pending() -> None:
    """Finish the overlapped reductions left by backward passes that raised (the engine runs
    no final callbacks then): otherwise each would stay in torch's work registry, with its
    gradient buffer, for the life of the process. Called outside any backward pass."""
    while _PENDING:
        _finish(*_PENDING.pop(next(iter(_PENDING))))


def settled(g: torch.Tensor) -> torch.Tensor:
    """``g`` itself, or the plain buffer of a pending gradient from
    :func:`_reduce_during_backward` whose reduction has already finished: later reads then
    skip the wrapper's dispatch (the gradient accumulation alone costs one per parameter)."""
    work = _work_of(g)
    if work is not None and work.is_completed():
        _forget_work(g.elem)
        return g.elem
    return g


def _forget_work(buf: torch.Tensor) -> None:
    """Drop torch's record of the finished work on ``buf``: what ``wait_tensor`` does, called
    below autograd, which skips the op's Python autograd wrapper (about 15 us)."""
    with _below_autograd():
        _wait_tensor_op(buf)


@_fast_apply
class PvaryFn(torch.autograd.Function):
    """Identity forward; psum backward (in place on a gradient nothing else holds)."""

    @staticmethod
    def forward(x, comm):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g):
        if type(g) is _AsyncCollectiveTensor:  # chained pvary: the sum of the one below first
            g = g.trigger_wait()
        if _differentiable(g):
            return psum(g, ctx.comm), None
        buf = g if _exclusive(g) else g.clone(memory_format=_contiguous)
        pending = _reduce_during_backward(buf, ctx.comm)
        source = ctx.next_functions[0][0]
        if type(source) is _AccumulateGrad:  # a plain leaf: its .grad becomes this
            when_reduced(pending, lambda leaf=source.variable: plain_grad(leaf))
        return pending, None

    @staticmethod
    def jvp(ctx, t, _):
        return t.view_as(t)


@_fast_apply
class PsumFn(torch.autograd.Function):
    @staticmethod
    def forward(x, comm):
        return _psum(x, comm)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return g, None

    @staticmethod
    def jvp(ctx, t, _):
        return psum(t, ctx.comm)


@_fast_apply
class ExtremumFn(torch.autograd.Function):
    """pmax / pmin: the gradient goes to the members holding the extremum, split among ties
    (as ``torch.amax`` does), which costs one psum of the tie mask."""

    @staticmethod
    def forward(x, comm, op):
        name = "pmax" if op is MAX else "pmin"
        return comm.all_reduce_(x.clone(memory_format=_contiguous), op, name)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]
        ctx.save_for_backward(inputs[0], output)
        ctx.save_for_forward(inputs[0], output)

    @staticmethod
    def _share(ctx):
        x, y = ctx.saved_tensors
        mask = (x == y).to(y.dtype if y.is_floating_point() else torch.get_default_dtype())
        count = ctx.comm.all_reduce_(mask.clone(), SUM, "psum")
        return mask / count

    @staticmethod
    def backward(ctx, g):
        return g * ExtremumFn._share(ctx), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return psum(t * ExtremumFn._share(ctx), ctx.comm)


@_fast_apply
class AllGatherFn(torch.autograd.Function):
    @staticmethod
    def forward(x, comm, axis, tiled, invariant):
        return _all_gather(x, comm, axis, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.axis, ctx.tiled, ctx.invariant = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        if ctx.invariant:  # the cotangent is identical on the group: keep the own block
            return _own_block(g, ctx.comm, ctx.axis, ctx.tiled), None, None, None, None
        return psum_scatter(g, ctx.comm, ctx.axis, ctx.tiled), None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return all_gather(t, ctx.comm, ctx.axis, ctx.tiled, ctx.invariant)


@_fast_apply
class PsumScatterFn(torch.autograd.Function):
    @staticmethod
    def forward(x, comm, dim, tiled):
        return _psum_scatter(x, comm, dim, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.dim, ctx.tiled = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.comm, ctx.dim, ctx.tiled, False), None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return psum_scatter(t, ctx.comm, ctx.dim, ctx.tiled)


@_fast_apply
class AllToAllFn(torch.autograd.Function):
    @staticmethod
    def forward(x, comm, split, concat, tiled):
        return _all_to_all(x, comm, split, concat, tiled)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.split, ctx.concat, ctx.tiled = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        out = all_to_all(g, ctx.comm, ctx.concat, ctx.split, ctx.tiled)
        return out, None, None, None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return all_to_all(t, ctx.comm, ctx.split, ctx.concat, ctx.tiled)


@_fast_apply
class PpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(x, comm, pairs):
        return comm.permute(x, pairs)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm, ctx.pairs = inputs[1:]

    @staticmethod
    def backward(ctx, g):
        return ppermute(g, ctx.comm, _reversed(ctx.pairs)), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return ppermute(t, ctx.comm, ctx.pairs)


@_fast_apply
class BroadcastFn(torch.autograd.Function):
    """Every member gets member 0's value (check_vma=False outputs); backward: member 0 gets
    the cotangent, the others none."""

    @staticmethod
    def forward(x, comm):
        return comm.broadcast_(x.clone(memory_format=_contiguous), 0)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.comm = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return (g if ctx.comm.index == 0 else torch.zeros_like(g)), None

    @staticmethod
    def jvp(ctx, t, _):
        return broadcast(t, ctx.comm)


# --- entry points: the Function when something is differentiated, else the plain op ---------------


def pvary(x: torch.Tensor, comm: Comm) -> torch.Tensor:
    return _apply(PvaryFn, x, comm) if _differentiable(x) else x.view_as(x)


def psum(x: torch.Tensor, comm: Comm, donate: bool = False) -> torch.Tensor:
    """``donate``: the caller proved that nothing else sees ``x``: reduce it in place."""
    if _differentiable(x):
        return _apply(PsumFn, x, comm)
    return comm.all_reduce_(x if donate else x.clone(memory_format=_contiguous))


def pmax(x: torch.Tensor, comm: Comm, donate: bool = False) -> torch.Tensor:
    if _differentiable(x):
        return _apply(ExtremumFn, x, comm, MAX)
    return comm.all_reduce_(x if donate else x.clone(memory_format=_contiguous), MAX, "pmax")


def pmin(x: torch.Tensor, comm: Comm, donate: bool = False) -> torch.Tensor:
    if _differentiable(x):
        return _apply(ExtremumFn, x, comm, MIN)
    return comm.all_reduce_(x if donate else x.clone(memory_format=_contiguous), MIN, "pmin")


def all_gather(x, comm: Comm, axis: int, tiled: bool, invariant: bool) -> torch.Tensor:
    if _differentiable(x):
        return _apply(AllGatherFn, x, comm, axis, tiled, invariant)
    return _all_gather(x, comm, axis, tiled)


def psum_scatter(x, comm: Comm, dim: int, tiled: bool) -> torch.Tensor:
    if _differentiable(x):
        return _apply(PsumScatterFn, x, comm, dim, tiled)
    return _psum_scatter(x, comm, dim, tiled)


def all_to_all(x, comm: Comm, split: int, concat: int, tiled: bool) -> torch.Tensor:
    if _differentiable(x):
        return _apply(AllToAllFn, x, comm, split, concat, tiled)
    return _all_to_all(x, comm, split, concat, tiled)


def ppermute(x, comm: Comm, pairs: tuple[tuple[int, int], ...]) -> torch.Tensor:
    if _differentiable(x):
        return _apply(PpermuteFn, x, comm, pairs)
    return comm.permute(x, pairs)


def broadcast(x, comm: Comm) -> torch.Tensor:
    if _differentiable(x):
        return _apply(BroadcastFn, x, comm)
    return comm.broadcast_(x.clone(memory_format=_contiguous), 0)


_calibrate()
