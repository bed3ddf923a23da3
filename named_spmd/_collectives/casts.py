"""``pcast``: the casts between the four per-axis states (docs/design.md sections 2.2 and 3).

Each cast is the identity on every instance's data; what changes is the type, and with it the
transpose (JAX's ``jax.lax.pcast``):

=================  ============================  =====================================
cast               backward (the transpose)      communication in backward
=================  ============================  =====================================
I -> V (pvary)     psum (V -> I)                 one psum
I -> R             psum of unreduced (U -> I)    one psum
V -> U             cast R -> V                   none
R -> V             cast V -> U                   none
U -> V             the identity per instance     none (named_spmd's escape hatch: the
                                                 instance's partial sum as a local value)
R -> I             the first instance's part     none (implicit only: a reduced value
                   (I -> U)                      written into an invariant tensor)
=================  ============================  =====================================
"""

from __future__ import annotations

from typing import Any

import optree
import torch

from .._calls import current
from .._context import Axes, SpmdContext
from .._errors import CollectiveError, VmaError
from .._types import VType
from ._record import (
    PVARY_RECORD,
    Collective,
    Params,
    _pvary_transpose,
    backward_op,
    no_backward_op,
    same_shape,
)

AxisName = str | tuple[str, ...]
_TO = ("varying", "reduced", "unreduced")


def _view(ctx: SpmdContext, x: torch.Tensor, axes: Axes, params: Params) -> torch.Tensor:
    return x.view_as(x)  # a new tensor object: it gets its own type


def _identity(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    return g


def _first_part(
    ctx: SpmdContext, g: torch.Tensor, axes: Axes, params: Params, node: Any
) -> torch.Tensor:
    return torch.where(ctx.axis_index(axes) == 0, g, torch.zeros_like(g))


def _cast(
    name: str, to: str, forward: Any, transpose: Any, back: Any, plain_view: bool = False
) -> Collective:
    return Collective(
        name=name,
        policy=None,  # pcast checks the operand's state itself
        vma=lambda vma, axes, params: vma.to_state(axes, to),
        shape=same_shape,
        forward=forward,
        transpose=transpose,
        backward_op=back,
        forward_event=False,
        makes_partial=True,
        unreduced="cast",
        plain_view=plain_view,
    )


def _view_cast(name: str, to: str) -> Collective:
    """A cast between varying and unreduced: a plain view of the operand whose transpose is the
    identity, which autograd differentiates as the view it is (``Collective.plain_view``)."""
    return _cast(name, to, _view, _identity, no_backward_op, plain_view=True)


#: I -> R: the value is kept; its gradient, a partial sum, is summed here (psum of unreduced)
PREDUCED = _cast("preduced", "reduced", _view, _pvary_transpose, backward_op("psum"))
#: R -> I, made only by a write of a reduced value into an invariant tensor (a write keeps the
#: type of the tensor written): the value is kept; its cotangent, the same on every instance,
#: becomes the first instance's part (zeros elsewhere), which the reduced value's transpose sums
REDUCED_INVARIANT = _cast("reduced_invariant", "invariant", _view, _first_part, no_backward_op)
#: V -> U: each instance's value becomes its part of a sum; the cotangent (reduced) is cast back
VARY_UNREDUCED = _view_cast("vary_unreduced", "unreduced")
#: R -> V: the value is the same everywhere (on the simulated mesh it becomes batched); the
#: cotangent stays each instance's partial sum: no communication
REDUCED_VARY = _cast(
    "reduced_vary",
    "varying",
    lambda ctx, x, axes, params: ctx.pvary(x, axes),
    _identity,
    no_backward_op,
)
#: U -> V: the instance's partial sum taken as its local value
UNREDUCED_VARY = _view_cast("unreduced_vary", "varying")

_CASTS = {
    ("invariant", "varying"): PVARY_RECORD,
    ("invariant", "reduced"): PREDUCED,
    ("varying", "unreduced"): VARY_UNREDUCED,
    ("reduced", "varying"): REDUCED_VARY,
    ("unreduced", "varying"): UNREDUCED_VARY,
}


def pcast(x: Any, axis_name: AxisName, *, to: str) -> Any:
    """``pcast(x, A, to=...)``: change x's state over A; the identity on every instance's data.

    Args:
        x: a tensor or pytree of tensors, in one state (varying, invariant, unreduced or
            reduced) over every axis of ``axis_name``.
        axis_name: a mesh axis name or a tuple of names.
        to: ``"varying"`` (from invariant: :func:`pvary`; from reduced: no communication in
            backward; from unreduced: each instance's partial sum taken as its local value),
            ``"reduced"`` (from invariant: the gradient is summed here, once) or
            ``"unreduced"`` (from varying: the instances' values are parts of one sum).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("i",))
        >>> @ns.spmd_map(mesh=mesh, in_specs=ns.P("i"), out_specs=ns.P())
        ... def f(x):
        ...     u = ns.pcast(x, "i", to="unreduced")  # x's blocks are parts of one sum
        ...     return ns.psum(2 * u, "i")  # linear ops keep it unreduced
        >>> f(torch.tensor([1.0, 2.0]))
        tensor([6.])

    Backward: I -> V and I -> R: a psum; V -> U, R -> V, U -> V: none (the table in
    docs/design.md section 3).
    """
    ctx = current("pcast")
    axes = ctx.check_axes(axis_name, "pcast")
    if to not in _TO:
        raise CollectiveError(
            f"pcast in {ctx.fn_label}: unknown to={to!r}. Fix: to='varying', 'reduced' or "
            "'unreduced'."
        )

    def one(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            raise CollectiveError(
                f"pcast in {ctx.fn_label}: expected tensors (or a pytree of tensors), got a leaf "
                f"of type {type(t).__name__}. Fix: convert it with torch.as_tensor(...) first."
            )
        if ctx.replaying:  # every cast is the identity on the data of one instance
            return t
        vma = ctx.vma(t)
        states = {vma.state(a) for a in axes}
        if to == "unreduced" == next(iter(states)) and len(states) == 1:
            # already unreduced: a contraction the library saw made it so (section 2.3)
            return t
        rec = _CASTS.get((next(iter(states)), to)) if len(states) == 1 else None
        if rec is None:
            raise VmaError(
                f"pcast in {ctx.fn_label}: cannot cast a value of type "
                f"{VType(t.dtype, tuple(t.shape), vma, ctx.mesh.axis_names)} over {axes} to "
                f"{to} (its states there: {sorted(states)}). The casts are invariant -> "
                "varying or reduced, varying -> unreduced, reduced -> varying and unreduced -> "
                "varying. Fix: reduce an unreduced value with ns.psum; cast one state at a time."
            )
        return rec.bind(t, axes)

    if isinstance(x, torch.Tensor):
        return one(x)
    return optree.tree_map(one, x)


__all__ = ["pcast"]
