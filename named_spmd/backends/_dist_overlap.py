"""The gradient psum of a pvary on a real mesh: in place where possible, overlapped with backward.

The backward of ``pvary`` (the data-parallel gradient reduction of a replicated weight, the
largest message of a training step) is where a real mesh spends its communication. Two costs are
avoided:

* A copy: the incoming gradient is reduced *in place* when nothing else can see it: no view, no
  other holder of its storage or its TensorImpl, and no Python reference beyond the autograd
  engine's (autograd may hand one gradient tensor to two consumers, and a hook may keep it).
  :func:`._dist_donation.exclusive` checks exactly that.
* A stall: the reduction only starts here and is waited for at the end of the backward pass
  (:func:`_reduce_during_backward`), as DDP overlaps its bucketed all-reduce with backward.
* A fixed cost per gradient: gradients smaller than a bucket are packed into buckets, one
  all-reduce each (:mod:`._dist_buckets`, :func:`_into_bucket`).
"""

from __future__ import annotations

import functools
from typing import Any, TypeGuard

import torch
from torch.distributed.tensor import DTensor

from .. import _torch_private as torch_private
from .._torch_private import async_buffer, async_wait
from . import _dist_buckets as buckets
from . import _dist_donation as donation
from ._dist_comm import Comm

_contiguous = torch.contiguous_format


def _ACT() -> type:
    """The wrapper of a pending gradient (torch's ``AsyncCollectiveTensor``, detached fast)."""
    return torch_private.dist().PendingGradient


def _is_async(t: Any) -> bool:
    """Whether ``t`` waits on first use: ours, or torch's class (a view of ours is one)."""
    return isinstance(t, torch_private.dist().AsyncCollectiveTensor)


def _reduce_during_backward(buf: torch.Tensor, comm: Comm) -> torch.Tensor:
    """``buf`` summed over ``comm``, overlapped with the rest of the backward pass.

    The gradient psum of a replicated parameter is the largest message of a training step, and
    waiting for it where it arises would stall the backward (and, on an oversubscribed host,
    every rank behind the slowest). So, as DDP overlaps its bucketed all-reduce with backward,
    the reduction only starts here. The result is an ``AsyncCollectiveTensor`` (torch's
    functional collectives' wait-on-first-use tensor): any op that reads it, such as the sum
    with a second gradient contribution, waits for the sum first (its accumulation into an
    existing ``.grad`` is postponed instead: :func:`_defer_accumulation`). At the end of the
    backward pass, a callback waits for the rest through the failure board (so a failed peer
    raises RankFailedError rather than hanging) and releases torch's record of the work: no
    reduction outlives the backward that started it; then the leaves' ``.grad`` that received
    the wrapper get the plain tensor (:func:`when_reduced`). A backward that raises runs no final
    callbacks: its reductions stay in ``_PENDING`` until :func:`finish_pending` (the next call on
    the mesh) finishes them."""
    work = comm.start_all_reduce_(buf)
    torch_private.dist().register_work(buf, work)
    key = id(work)  # unique while the entry keeps the work alive
    _PENDING[key] = (comm, work, buf, [])

    def finish():
        entry = _PENDING.pop(key, None)
        if entry is not None:  # else finish_pending did it
            _finish(*entry)

    try:
        torch_private.queue_callback(finish)
    except RuntimeError:  # not inside an autograd engine backward: finish now
        finish()
        return buf
    pending = _ACT()(buf)
    pending._named_spmd_work = work
    return pending


# id(work) -> (comm, work, buffer, what to run once it is done): overlapped reductions (a
# gradient's, or a bucket's: then the work is its BucketWork and its members the buffers)
# started or filling, not finished
_PENDING: dict[int, tuple[Comm, object, torch.Tensor | None, list]] = {}


def _finish(comm: Comm, work, buf: torch.Tensor | None, then: list) -> None:
    if type(work) is buckets.BucketWork:
        bucket = work.bucket
        bucket.wait()  # starts it if still open; the comm's failure-aware wait; copies back
        for member in bucket.members:
            _forget_work(member)  # so that a later read does not wait again
        bucket.members = []
    else:
        assert buf is not None  # a lone gradient's entry names its buffer
        comm.finish(work)
        _forget_work(buf)
    for fn in then:
        fn()


def _work_of(g: torch.Tensor):
    """The work of a pending gradient from :func:`_reduce_during_backward` or
    :func:`_into_bucket`, else None."""
    return g.__dict__.get("_named_spmd_work") if _is_async(g) else None


def when_reduced(g: torch.Tensor, fn) -> bool:
    """Run ``fn()`` once the overlapped reduction behind the pending gradient ``g`` is done (at
    the end of the backward pass); nothing if ``g`` is not pending. Whether it will run."""
    work = _work_of(g)
    entry = _PENDING.get(id(work)) if work is not None else None
    if entry is not None and entry[1] is work:
        entry[3].append(fn)
        return True
    return False


def into_leaf(g: torch.Tensor, leaf: torch.Tensor, fix) -> None:
    """The pending gradient ``g`` goes to ``leaf``'s ``AccumulateGrad`` (a plain leaf, or a
    DTensor one whose local tensor ``g`` becomes): ``fix()`` gives the leaf's ``.grad`` its plain
    tensor once the reduction is done (:func:`when_reduced`), and an accumulation into an
    existing ``.grad`` may wait for it there (:func:`_defer_accumulation`). Nothing if ``g`` is
    not pending."""
    work = _work_of(g)
    if work is not None:
        _into_leaf(g, work, leaf, fix)


def _into_leaf(g: torch.Tensor, work, leaf: torch.Tensor, fix) -> None:
    """:func:`into_leaf` for a pending gradient whose work the caller knows (one lookup for
    both registrations: every gradient of a step passes here)."""
    g.__dict__["_named_spmd_into"] = leaf
    entry = _PENDING.get(id(work))
    if entry is not None and entry[1] is work:
        entry[3].append(fix)


def _defer_accumulation(target: torch.Tensor, pending: torch.Tensor) -> bool:
    """``target += pending``, run once the sum behind ``pending`` is in (at the end of the
    backward pass) instead of waiting for it now, where ``target`` is the ``.grad`` (or a DTensor
    ``.grad``'s local tensor) of the leaf ``pending`` accumulates into: a second micro-batch's
    gradients then keep their buckets and their overlap. Not where the leaf has
    post-accumulate-grad hooks (they read ``.grad`` at once) or the backward records a graph."""
    leaf = pending.__dict__.get("_named_spmd_into")
    if leaf is None or torch.is_grad_enabled() or torch_private.has_post_accumulate_hooks(leaf):
        return False
    grad = leaf.grad
    local = torch_private.local_tensor(grad) if isinstance(grad, DTensor) else grad
    if local is not target:
        return False
    return when_reduced(pending, lambda: target.add_(async_buffer(pending)))


def is_pending_wrapper(t: torch.Tensor | None) -> TypeGuard[Any]:
    """Whether ``t`` is a pending gradient (typed Any: its class is only known at run time)."""
    return _is_async(t)


def plain_grad(leaf: torch.Tensor) -> None:
    """Give ``leaf`` its gradient as the plain tensor, where the accumulation stored the pending
    wrapper (a finished one): ``.grad`` then copies, pickles and exposes its storage as usual."""
    grad = leaf.grad
    if is_pending_wrapper(grad):
        leaf.grad = async_buffer(grad)


def finish_pending() -> None:
    """Finish the overlapped reductions left by backward passes that raised (the engine runs
    no final callbacks then): otherwise each would stay in torch's work registry, with its
    gradient buffer, for the life of the process. Called outside any backward pass."""
    buckets.start_open()
    while _PENDING:
        _finish(*_PENDING.pop(next(iter(_PENDING))))


def settled(g: torch.Tensor) -> torch.Tensor:
    """``g`` itself, or the plain buffer of a pending gradient from
    :func:`_reduce_during_backward` whose reduction has already finished: later reads then
    skip the wrapper's dispatch (the gradient accumulation alone costs one per parameter)."""
    work = _work_of(g)
    if work is not None and work.is_completed():
        _forget_work(async_buffer(g))  # g is an AsyncCollectiveTensor
        return async_buffer(g)
    return g


def _forget_work(buf: torch.Tensor) -> None:
    """Drop torch's record of the finished work on ``buf``: what ``wait_tensor`` does, called
    below autograd, which skips the op's Python autograd wrapper (about 15 us)."""
    with torch_private.below_autograd():
        torch_private.dist().wait_tensor(buf)


def psum_in_backward(g: torch.Tensor, comm: Comm | None, node, chain: str = "backward"):
    """The transpose of a pvary outside any transform: the gradient's sum over ``comm``,
    started here and overlapped with the rest of backward (in place on a gradient nothing else
    holds). ``node`` is the pvary's autograd context; ``chain``: the call chain that reached
    here, whose references to ``g`` the donation check calibrated (``_dist_donation``)."""
    if _is_async(g):  # chained pvary: the sum of the one below first
        g = async_wait(g)
    # no copy where nothing else holds g (the count of this frame's references is calibrated)
    if donation.exclusive(g, torch_private.refcount(g), chain):
        buf = g
    else:
        buf = g.clone(memory_format=_contiguous)
    if comm is None:  # the calibration's probe (_dist_donation): nothing to reduce
        return buf
    task = torch_private.current_graph_task_id()
    cap = buckets.bucket_bytes(task)
    if task != -1 and buckets.bucketed(buf.numel() * buf.element_size(), cap):
        pending = _into_bucket(buf, comm, task, cap)
    else:  # alone
        pending = _reduce_during_backward(buf, comm)
    source = node.next_functions[0][0]
    if type(source) is torch_private.AccumulateGrad:  # a plain leaf: its .grad becomes this
        work = pending.__dict__.get("_named_spmd_work")  # None: reduced already (no backward)
        if work is not None:
            leaf = source.variable
            _into_leaf(pending, work, leaf, functools.partial(plain_grad, leaf))
    else:
        into_leaves_below(pending, source, lambda leaf: functools.partial(plain_grad, leaf))
    return pending


def into_leaves_below(g: torch.Tensor, node, fix) -> None:
    """:func:`when_reduced` ``fix(leaf)`` for each leaf that the pending gradient ``g``, handed
    to the autograd ``node``, reaches as itself or as a view of itself
    (:func:`torch_private.leaves_reached`): the last of them to accumulate keeps a pending
    gradient as its ``.grad`` (``AccumulateGrad`` copies it for the others), which ``fix``
    replaces by the plain tensor. Nothing if ``g`` is not pending."""
    if _work_of(g) is None:
        return
    for leaf in torch_private.leaves_reached(node):
        when_reduced(g, fix(leaf))


def _into_bucket(buf: torch.Tensor, comm: Comm, task: int, cap: int) -> torch.Tensor:
    """``buf`` (a gradient the caller owns) added to the open bucket of its key (a new one if
    none, or if it does not fit: the open one then starts): returns it behind an
    AsyncCollectiveTensor that waits for the bucket's sum, which is copied back into ``buf``."""
    key = (task, id(comm.group), buf.dtype, buf.device)  # a bucket never mixes these
    work = buckets.OPEN.get(key)
    if work is None or not work.bucket.add(buf):
        if work is not None:
            work.bucket.start()
        work = _open_bucket(key, comm, cap, task)
        work.bucket.add(buf)  # (a gradient smaller than a bucket fits an empty one)
    d = torch_private.dist()
    d.register_work(buf, work)  # a read of buf waits for (and starts) its bucket
    pending = d.PendingGradient(buf)
    pending._named_spmd_work = work
    return pending


def _open_bucket(key: tuple, comm: Comm, cap: int, task: int):
    """A new bucket, finished at the end of this backward pass, after every open bucket of it
    has started."""
    work = buckets.BucketWork(buckets.Bucket(key, comm, cap))
    buckets.OPEN[key] = work
    _PENDING[id(work)] = (comm, work, None, [])

    def finish():
        buckets.start_open(task)
        entry = _PENDING.pop(id(work), None)
        if entry is not None:  # else finish_pending did it
            _finish(*entry)

    torch_private.queue_callback(
        finish
    )  # inside a backward pass: the caller checked the graph task
    return work


def _view_of(pending: torch.Tensor, view: Any) -> torch.Tensor:
    """A view of the pending gradient ``pending`` (torch's class wraps it) as a pending gradient
    of the same work: a leaf reached through views (a DTensor's ``_LocalOf``) then gets the plain
    tensor once reduced, as ``pending`` itself would (:func:`into_leaf`). A conjugate or negative
    view (``ConjBackward``'s ``g.conj()``) is waited for and handed on plain: torch's wrapper
    around a tensor with the conj or neg bit reads without the bit in arithmetic."""
    buf = async_buffer(view)
    if buf.is_conj() or buf.is_neg():
        async_wait(pending)
        return buf
    out = _ACT()(buf)
    work = pending.__dict__.get("_named_spmd_work")
    if work is not None:
        out._named_spmd_work = work
    return out


_pending = torch_private.dist().PendingGradient
_pending.defer_accumulation, _pending.view_of = _defer_accumulation, _view_of
