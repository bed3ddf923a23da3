"""May a reduction on a real mesh overwrite its operand instead of a copy of it?

Two reductions ask, and both are answered here, against one calibration:

* ``"forward"``: a reduction (a record that ``donates``: psum, pmean, pmax, pmin) of the tensor
  the user's code passed, without autograd, as ``ns.psum(h @ w, "tp")`` under ``torch.no_grad``:
  ``DistributedContext.apply`` asks. A temporary that only the collective's own call chain
  references is reduced in place: no copy of it (about a sixth of such a psum's time at 4 and
  16 MB over gloo) and no second buffer of its size at the peak.
* ``"backward"``: the gradient psum of a pvary (``_dist_overlap.psum_in_backward``), on the
  incoming gradient where only the autograd engine holds it.

Whether anything else holds the tensor is read off its reference counts, against one
calibration per chain (``_donation``), run as the real mesh's backend loads.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _calls
from .. import _donation as donation
from .._autodiff import apply as bridge_apply
from .._collectives._record import PVARY_RECORD
from .._collectives.reductions import pmax, pmean, pmin, psum
from .._donation import LIMITS
from .._mesh import Mesh
from .._torch_private import is_transform_wrapped, tensor_base
from .._types import Vma


def exclusive(x: torch.Tensor, refs: int, kind: str) -> bool:
    """Whether nothing but the calibrated chain of ``kind`` references ``x`` (``refs``: its
    Python reference count, read by the caller first thing). Never a tensor without storage
    (``data_ptr()`` 0): its counts say nothing, and reducing it would read address 0."""
    if (
        type(x) is not torch.Tensor  # a subclass: its storage is not what is counted
        or x.requires_grad
        or tensor_base(x) is not None
        or not x.is_contiguous()
        or is_transform_wrapped(x)
        or not x.data_ptr()  # as a subclass's wrapper that lost its Python class
    ):
        return False
    return donation.alone(x, refs, kind)


def calibrate(context: type) -> None:
    """Measure both chains on the real mesh's context class ``context`` (its own ``apply`` and
    ``psum_in_backward``, on a probe mesh that moves no data): a temporary and a named operand
    through every donating reduction, and a pvary's backward through the bridge."""
    probe = type("Probe", (_Probe, context), {})
    temps, named = [], []
    for op in (psum, pmean, pmax, pmin):
        temps += _probe(functools.partial(_temporary_operand, op), probe)
        named += _probe(functools.partial(_named_operand, op), probe)
    grads = _probe(functools.partial(_gradient_psum, probe), None)
    LIMITS.update(forward=donation.limits_of(temps, named), backward=grads[0] if grads else None)


def calibrate_gradient(chain: str, run: Callable[[Any], None], context: type) -> None:
    """Measure another chain that reaches the gradient psum: ``run(ctx)`` sends one gradient
    through it on a probe call of ``context`` (``_dist_pvary``'s)."""
    probe = type("Probe", (_Probe, context), {})
    grads = _probe(lambda: run(_Probe.made(probe)), None)
    LIMITS[chain] = grads[0] if grads else None


def _temporary_operand(op: Callable[[Any, str], Any]) -> None:
    op(torch.zeros(2), "i")


def _named_operand(op: Callable[[Any, str], Any]) -> None:
    operand = torch.zeros(2)
    op(operand, "i")


def _gradient_psum(probe: type) -> None:
    x = torch.zeros(2, requires_grad=True)
    with torch.enable_grad():
        y = bridge_apply(PVARY_RECORD, _Probe.made(probe), x, ("i",), ())
        (y * 2.0).sum().backward()


def _in_call(run: Callable[[], None], context: type) -> None:
    _calls.push(_Probe.made(context))
    try:
        run()
    finally:
        _calls.pop()


def _probe(run: Callable[[], None], context: type | None) -> list[donation.Counts]:
    """The counts :func:`exclusive` sees while ``run()`` runs (in a call on the probe class
    ``context``, or outside any call)."""
    return donation.probe(run if context is None else functools.partial(_in_call, run, context))


class _ProbeMesh(Mesh):
    def comm(self, axes: Any) -> None:
        return None  # the gradient psum's probe: no communication


class _Probe:
    """Mixed in before the real mesh's context: a two-instance call on which every operand
    varies over "i" and every primitive but pvary returns its operand unchanged; ``apply`` and
    ``psum_in_backward`` are the context's own (the chains measured)."""

    fuses_leaves = False  # (a pytree's leaves each through the chain measured)

    @staticmethod
    def made(context: type) -> Any:
        return context(_ProbeMesh((2,), ("i",)), calibrate)

    def vma(self, x: torch.Tensor) -> Vma:
        return Vma.of(("i",))

    def axis_index(self, axes: Any) -> torch.Tensor:
        return torch.zeros((), dtype=torch.int64)

    def per_member(self, axes: Any, make: Any) -> torch.Tensor:
        return make(0)

    def _same(self, x: Any, *args: Any, **kwargs: Any) -> Any:
        return x

    all_reduce = all_gather = reduce_scatter = all_to_all = _same
    permute = broadcast = own_block = _same
