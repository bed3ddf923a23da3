"""May a reduction overwrite its operand? (Backends with ``SpmdContext.donates``.)

``ns.psum(h @ w, "tp")`` without autograd: the operand is a temporary that only the collective's
own call chain references, so the all-reduce may overwrite it instead of a copy (a 4 MB copy
costs a quarter of a 4 MB gloo all-reduce). Whether a user still holds the operand is read off
its reference counts (Python references, TensorImpl uses, storage uses, Python references to its
storage object), compared with those of a temporary sent through the very same chain once
(:func:`calibrate`): a named variable, a list entry, a view, a tensor saved by autograd or shared
storage all add one, and so does a held ``x.untyped_storage()`` to the last count (torch keeps
one storage object per storage: holding it adds no storage use). If the interpreter does not
count a named variable apart from a temporary, donation stays off. ``Collective.bind`` reads
the reference count first thing, which is the frame depth the probe measures.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import _accounting, _calls
from .._context import SpmdContext
from .._mesh import Mesh
from .._torch_private import DisableFuncTorch, DisableTorchFunction, tensor_base, use_counts
from .._types import Vma

_LIMITS: list[tuple[int, ...] | None] = []  # [limits] once calibrated
#: The donating reductions (psum, pmean, pmax, pmin), registered by ``reductions`` when it loads:
#: the chain a temporary is measured through is theirs.
PROBED_OPS: list[Callable[[Any, str], Any]] = []
_probed: list[tuple[int, int, int, int]] | None = None  # counts seen while calibrating


def _counts(x: torch.Tensor, refs: int) -> tuple[int, int, int, int] | None:
    try:
        return (refs, *use_counts(x))
    except (RuntimeError, NotImplementedError):  # tensors without storage (wrappers)
        return None


def donatable(x: torch.Tensor, refs: int) -> bool:
    """Whether nothing but the collective's own call chain references ``x``."""
    with DisableTorchFunction():  # tensor methods below would each pay the vma mode's dispatch
        return _donatable(x, refs)


def _donatable(x: torch.Tensor, refs: int) -> bool:
    if x.requires_grad or tensor_base(x) is not None or not x.is_contiguous():
        return False
    if _probed is not None:
        counts = _counts(x, refs)
        if counts is not None:
            _probed.append(counts)
        return False
    if not _LIMITS:
        calibrate()
    limits = _LIMITS[0]
    if limits is None:
        return False
    counts = _counts(x, refs)
    if counts is None:
        return False
    refs, uses, storage_uses, storage_refs = counts  # compared one by one: a hot path
    max_refs, max_uses, max_storage_uses, max_storage_refs = limits
    return (
        refs <= max_refs
        and uses <= max_uses
        and storage_uses <= max_storage_uses
        and storage_refs <= max_storage_refs
    )


def calibrate() -> None:
    """Send a temporary and a named operand through every donating reduction once (on a
    two-instance probe backend that moves no data) and keep the temporaries' counts."""
    global _probed
    temps: list[tuple[int, int, int, int]] = []
    named: list[tuple[int, int, int, int]] = []
    saved_modes = _accounting.suspend()  # a CommMode around the first call must not see these
    try:
        # Under a torch.func transform (a first call inside grad or jvp) the probe temporaries
        # would be functorch wrappers, whose reference counts are not those of plain tensors.
        with DisableFuncTorch():
            for op in PROBED_OPS:
                for seen, temporary in ((temps, True), (named, False)):
                    _probed = []
                    ctx = _Probe()
                    _calls.push(ctx)
                    try:
                        if temporary:
                            op(torch.zeros(2), "i")
                        else:
                            operand = torch.zeros(2)
                            op(operand, "i")
                    finally:
                        _calls.pop()
                    seen.extend(_probed)
    finally:
        _probed = None
        _accounting.resume(saved_modes)
    refs = min(t[0] for t in temps)
    ok = bool(temps) and len(named) == len(temps) and all(n[0] > refs for n in named)
    limits = (refs, *(min(t[k] for t in temps) for k in (1, 2, 3)))
    _LIMITS[:] = [limits if ok else None]


class _Probe(SpmdContext):
    """A two-instance backend on which every operand varies over "i" and every primitive
    returns its operand unchanged: only the reference counts are of interest."""

    donates = True

    def __init__(self) -> None:
        super().__init__(Mesh((2,), ("i",)), calibrate)

    def vma(self, x: torch.Tensor) -> Vma:
        return Vma.of(("i",))

    def axis_index(self, axes: Any) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64)

    def per_member(self, axes: Any, make: Any) -> torch.Tensor:
        return make(0)

    def _same(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x

    pvary = all_reduce = all_gather = reduce_scatter = all_to_all = _same
    permute = broadcast = own_block = _same
