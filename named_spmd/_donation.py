"""May a collective give back or overwrite its operand instead of a copy of it?

Only where nothing but the collective's own call chain holds the operand: then no one can see
the result share its memory. Whether anything else holds it is read off its reference counts
(Python references, TensorImpl uses, storage uses, Python references to its storage object),
compared with those of a tensor nothing else holds, sent once through the very same chain (a
*calibration*, per chain, when its backend loads: outside any call or backward pass, with nothing
watching). A named variable, a list entry, a view, a tensor saved by autograd or shared storage
all add one, and so does a held ``x.untyped_storage()`` to the last count (torch keeps one
storage object per storage: holding it adds no storage use). Each caller reads the Python count
first thing, at the frame depth the calibration measured. Where the interpreter does not count a
named variable apart from a temporary, the chain never donates.

The chains: ``"forward"``, ``"backward"``, ``"pvary"`` (a real mesh's reductions and gradient
psums, ``backends/_dist_donation.py``); ``"replayed"`` (a replay's reduction over a group of
one, :func:`hands_back`, calibrated by ``_replay``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from . import _accounting
from . import _torch_private as torch_private

Counts = tuple[int, int, int, int]  # (Python refs, TensorImpl uses, storage uses, storage refs)
#: chain -> the counts a tensor nothing else holds has there (None: never donate), once calibrated
LIMITS: dict[str, Counts | None] = {}
_probed: list[Counts] | None = None  # counts seen while calibrating


def alone(x: torch.Tensor, refs: int, chain: str) -> bool:
    """Whether nothing but ``chain`` references ``x`` (``refs``: its Python reference count,
    read by the caller first thing); the caller has ruled out what counts cannot speak for (a
    subclass, a view, a tensor without storage). While calibrating: records the counts, False."""
    try:
        uses, storage_uses, storage_refs = torch_private.use_counts(x)
    except (RuntimeError, NotImplementedError):  # tensors without storage (wrappers)
        return False
    if _probed is not None:
        _probed.append((refs, uses, storage_uses, storage_refs))
        return False
    limits = LIMITS.get(chain)
    if limits is None:
        return False
    max_refs, max_uses, max_storage_uses, max_storage_refs = limits  # one by one: a hot path
    return (
        refs <= max_refs
        and uses <= max_uses
        and storage_uses <= max_storage_uses
        and storage_refs <= max_storage_refs
    )


def hands_back(x: torch.Tensor, refs: int) -> bool:
    """Whether a replay's reduction over a group of one may return its operand ``x`` itself
    (``refs``: its Python reference count, read first thing in ``_record._replayed``): a plain
    tensor with its own storage that nothing else references (chain ``"replayed"``), not a leaf
    that requires grad (a write into the result would be refused), not under saved-tensor hooks
    (what they pack is not counted). Torch differentiates the replay, so the result keeps the
    operand's graph."""
    return torch_private.unseen_reads(_hands_back, x, refs)


def _hands_back(x: torch.Tensor, refs: int) -> bool:
    if (
        type(x) is not torch.Tensor
        or (x.requires_grad and x.grad_fn is None)
        or torch_private.tensor_base(x) is not None
        or torch_private.is_transform_wrapped(x)
        or not x.data_ptr()  # (a wrapper without storage: its counts say nothing)
        or torch_private.saved_tensors_hooks_active()
    ):
        return False
    return alone(x, refs, "replayed")


def probe(run: Callable[[], None]) -> list[Counts]:
    """The counts :func:`alone` sees while ``run()`` runs, with nothing watching
    (``torch_private.unobserved``: a tracer or logging mode around the import would hold values
    and raise them) and no CommMode seeing its collectives."""
    global _probed
    _probed = []
    saved_modes = _accounting.suspend()
    try:
        # (under a torch.func transform the probe's tensors would be functorch wrappers)
        with torch_private.DisableFuncTorch():
            torch_private.unobserved(run)
        return _probed
    finally:
        _probed = None
        _accounting.resume(saved_modes)


def limits_of(temporaries: list[Counts], named: list[Counts]) -> Counts | None:
    """A chain's limits from the counts of temporaries and of named operands sent through it:
    the temporaries', where every named one has more Python references (else None)."""
    refs = min((t[0] for t in temporaries), default=0)
    if not temporaries or len(named) != len(temporaries) or any(n[0] <= refs for n in named):
        return None
    uses, storage_uses, storage_refs = (min(t[k] for t in temporaries) for k in (1, 2, 3))
    return (refs, uses, storage_uses, storage_refs)
