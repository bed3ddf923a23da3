"""Reducing a temporary in place in the forward pass (no autograd involved).

``ns.psum(h @ w, "tp")`` without autograd: the operand is a temporary that only the call chain
of the public collective references, so the all-reduce may overwrite it instead of a copy (a
4 MB copy costs a quarter of a 4 MB gloo all-reduce). Whether a user still holds the operand is
read off its reference counts (Python references, TensorImpl uses, storage uses, Python
references to its storage object), compared with those of a temporary sent through the very
same chain once (:func:`calibrate`): a named variable, a list entry, a view, a tensor saved by
autograd or shared storage all add one, and so does a held ``x.untyped_storage()`` to the last
count (torch keeps one storage object per storage: holding it adds no storage use). If the
interpreter does not count a named variable apart from a temporary, donation stays off.
:class:`~.distributed.DistributedContext` reads ``sys.getrefcount`` first thing in its
reductions, at the same frame depth as :class:`_Probe` here.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

from .._mesh import Mesh
from ._tracking import TrackedContext

_DONATE: dict[str, Any] = {}


class _Probe(TrackedContext):
    """Records, from the same frame depth as DistributedContext's reductions, the counts of
    the operand."""

    def _seen(self, x, refs):
        self.seen = (refs, x._use_count(), *storage_counts(x))
        return x.clone()

    def psum(self, x, axes):
        refs = sys.getrefcount(x)
        return self._seen(x, refs)

    def psum_varying(self, x, axes):
        refs = sys.getrefcount(x)
        if self.vma(x) >= set(axes):
            return self.stamp(self._seen(x, refs), self.vma(x) - set(axes))
        return None

    def pmax(self, x, axes):
        refs = sys.getrefcount(x)
        return self._seen(x, refs)

    pmin = pmax


def storage_counts(x: torch.Tensor) -> tuple[int, int]:
    """Uses of ``x``'s storage, and Python references to its storage object (a user may hold
    ``x.untyped_storage()``)."""
    storage = x.untyped_storage()
    return _storage_use_count(storage._cdata), sys.getrefcount(storage)


_storage_use_count = torch._C._storage_Use_Count


def calibrate() -> None:
    from .. import _accounting, _context
    from .. import _collectives as C

    saved = getattr(_accounting._local, "stack", None)
    _accounting._local.stack = []  # a CommMode around the first call must not see the probes
    try:
        _probe_chains(C, _context)
    finally:
        _accounting._local.stack = saved


def _probe_chains(C, _context) -> None:
    """Limits for the two call chains: ``ns.psum``'s direct one (``psum_varying``, "fast") and
    the generic one of every other reduction (and of psum while a CommMode records)."""
    mesh = Mesh((2,), ("i",))
    for chain, ops in (("fast", (C.psum,)), ("generic", (C.pmean, C.pmax, C.pmin))):
        temps, named = [], []
        for op in ops:
            for case in ("temporary", "named"):
                ctx = _Probe(mesh, calibrate)
                _context.push(ctx)
                try:
                    if case == "temporary":
                        op(ctx.stamp(torch.zeros(2), {"i"}), "i")
                    else:
                        operand = ctx.stamp(torch.zeros(2), {"i"})
                        op(operand, "i")
                finally:
                    _context.pop()
                (temps if case == "temporary" else named).append(ctx.seen)
        refs = min(t[0] for t in temps)
        ok = all(n[0] > refs for n in named)
        limits = (refs, *(min(t[k] for t in temps) for k in (1, 2, 3)))
        _DONATE[chain] = limits if ok else None
    _DONATE["ok"] = _DONATE["fast"] is not None and _DONATE["generic"] is not None


def donatable(x: torch.Tensor, refs: int, chain: str = "generic") -> bool:
    """Whether nothing but the collective's own call ``chain`` references ``x``."""
    if x.requires_grad or x._base is not None or not x.is_contiguous():
        return False
    if "ok" not in _DONATE:  # first use (the public collectives are importable by now)
        calibrate()
    limits = _DONATE[chain]
    if limits is None:
        return False
    max_refs, max_uses, max_storage, max_storage_refs = limits
    try:
        if refs > max_refs or x._use_count() > max_uses:
            return False
        storage, storage_refs = storage_counts(x)
    except (RuntimeError, NotImplementedError):  # tensors without storage (wrappers)
        return False
    return storage <= max_storage and storage_refs <= max_storage_refs
