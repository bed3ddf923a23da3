"""The implicit pvary on a real mesh, its common case with the layers between the cast and the
communication left out.

Every replicated parameter of a data-parallel step is cast once per call (``implicit_pvary``) and
its gradient summed once per backward pass (``_dist_overlap.psum_in_backward``). In the common
case (the operand invariant or varying, not reduced, over axes of more than one instance; grad
mode on; no ``torch.func`` transform, no forward-mode AD, no ``CommMode`` recording) the generic
path only runs the bridge's Function (``_autodiff.CollectiveFn``) and stamps the result, through
the collective's checks, its accounting, the context's ``apply``, the bridge's dispatch and the
record's transpose: about twenty Python calls per parameter and call, and six per gradient.
:class:`Pvary` is the bridge's Function for that case: the same node, with the same saved
state, whose forward is the pvary's (a new tensor object on the same data) and whose backward
goes straight to the overlapped, bucketed psum; a backward that is itself differentiated takes
the bridge's own transpose. Everything else takes the generic path, so values, gradients,
types and ``CommMode`` events are those of the generic path.
"""

from __future__ import annotations

from typing import Any

import torch

from .._accounting import _local as _modes
from .._autodiff import _NONES, CollectiveFn, differentiable
from .._collectives._record import PVARY_RECORD, implicit_pvary
from .._stamps import _ATTR
from .._torch_private import (
    DisableTorchFunction,
    forward_level,
    function_base_apply,
    transforms_active,
)
from . import _dist_overlap as overlap


class Pvary(CollectiveFn):
    """``CollectiveFn`` for the implicit pvary of the common case (module doc)."""

    @staticmethod
    def forward(x, rec, spmd, axes, params):
        return x.view_as(x)  # the pvary primitive: a new tensor object that gets its own stamp

    @staticmethod
    def backward(node, g):
        if differentiable(g):  # a differentiated backward: the bridge's transpose (a psum record)
            return CollectiveFn.backward(node, g)
        return overlap.psum_in_backward(g, node.spmd.mesh.comm(node.axes), node, "pvary"), *_NONES


_apply = function_base_apply.__get__(None, Pvary)


def pvary(ctx: Any, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """``implicit_pvary(ctx, t, axes)``: through :class:`Pvary` where the generic path would only
    apply the bridge and stamp (``ctx``: a plain ``DistributedContext``)."""
    held = t.__dict__.get(_ATTR)  # (ctx.vma, its usual case inlined)
    vma = held[1] if held is not None and held[0] is ctx.call_token else ctx.vma(t)
    if (
        vma.reduced
        or _modes.stack  # a CommMode records the cast's backward psum (the generic path)
        or not t.requires_grad
        or not torch.is_grad_enabled()
        or transforms_active()
        or forward_level() >= 0
        or ctx.single_axes.issuperset(axes)
    ):
        return implicit_pvary(ctx, t, axes)
    with DisableTorchFunction():
        out = _apply(t, PVARY_RECORD, ctx, axes, ())
    # ctx.stamp (no transform: no wrapped tensor, no storage to own)
    out.__dict__[_ATTR] = ctx.stamp_of(vma.add(axes))
    if ctx.numbering:
        ctx.number(out)
    return out


def probe(ctx: Any) -> None:
    """One gradient through :class:`Pvary` on the donation calibration's probe context, whose
    mesh communicates nothing (``_dist_donation.calibrate``: the chain's reference counts)."""
    x = torch.zeros(2, requires_grad=True)
    with torch.enable_grad():
        y = _apply(x, PVARY_RECORD, ctx, ("i",), ())
        (y * 2.0).sum().backward()
