"""What a collective is: one :class:`Collective` record, applied by one :func:`Collective.bind`.

A record holds everything the library knows about one collective (in the spirit of JAX's
primitive blocks in ``jax/_src/lax/parallel.py`` and equinox's ``create_vprim``):

* ``prepare`` / ``check``: argument checks, once per call and once per tensor operand, each
  returning the normalised parameters (a tuple) or raising an :class:`~.._errors.SpmdError`;
* ``policy``: what an operand invariant over some of the axes gets: an implicit pvary
  (``PVARY``), an error (``REQUIRE_VARYING``: a sum would multiply it), or the identity over
  those axes (``DROP_INVARIANT``: its mean, max or min over them is itself);
* ``vma`` and ``shape``: the type rule and the shape rule (the abstract backend's forward);
* ``forward``: the collective written with the backend primitives of :class:`~.._context.
  SpmdContext`;
* ``transpose`` and ``jvp``: the backward and forward-mode rules, written with other records,
  which the generic autograd bridge (``_autodiff``) applies on backends whose primitives are
  plain communication (through :meth:`Collective.backward` and :meth:`Collective.tangent`,
  under the rule for primitives inside a rule, ``_rules``);
* ``invariant_operand``: the consequence and fix in the error for an operand invariant over
  some of the axes (``REQUIRE_VARYING`` records);
* ``backward_op``: the collective its transpose runs, for the communication accounting.

Public collectives are thin: ``def psum(x, axis_name): return PSUM.bind(x, axis_name)``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import optree
import torch

from .._accounting import CommEvent, on_backward, record, recording, tag
from .._accounting import _local as _modes
from .._autodiff import differentiable
from .._blocks import forget as forget_blocks
from .._calls import current
from .._context import Axes, SpmdContext
from .._donation import hands_back
from .._errors import CollectiveError, VmaError
from .._torch_private import DisableTorchFunction, refcount, tensor_base, transforms_active
from .._types import Vma, shape_shown, type_text
from . import _rules
from ._checks import (
    Invariant,
    check_copyable,
    dtype_and_device,
    raise_invariant_operand,
    torch_copies,
)

# Operand policies: what an operand invariant over some axes of the collective gets.
PVARY = "pvary"
REQUIRE_VARYING = "require varying"
DROP_INVARIANT = "drop invariant"

Tensor = torch.Tensor
Params = tuple
#: Every record by name: transposes refer to other collectives through it.
RECORDS: dict[str, Collective] = {}


def _linear_jvp(
    ctx: SpmdContext, rec: Collective, t: Tensor, axes: Axes, params: Params, node: Any
) -> Tensor:
    return ctx.apply(rec, t, axes, params)


@dataclass(frozen=True, eq=False)
class Collective:
    """One collective: see the module docstring for the fields."""

    name: str
    policy: str | None
    vma: Callable[[Vma, Axes, Params], Vma]
    shape: Callable[[tuple[int, ...], int, Params], tuple[int, ...]]
    forward: Callable[..., Tensor]
    transpose: Callable[..., Tensor]
    backward_op: Callable[[Params], str | None]
    prepare: Callable[..., Params] | None = None
    check: Callable[[SpmdContext, Tensor, Axes, Params], Params] | None = None
    jvp: Callable[..., Tensor] = _linear_jvp
    #: the parameters for an operand with one more leading (batch) dim: a user's vmap inside
    #: the function; elementwise collectives keep theirs, the others shift their dims by one
    batched: Callable[[Params], Params] = lambda params: params
    #: what an operand unreduced over some of the axes gets: "reduce" (psum, pmean and
    #: psum_scatter sum the partial sums: those axes count as varying), "move" (a linear data
    #: movement over *other* axes keeps it unreduced; over its U axes it is an error), "cast"
    #: (pcast checks states itself) or None (an error: pmax, pmin are not linear). Section 8.
    unreduced: str | None = "move"
    saves: bool = False  # the transpose reads the operand and the result (node.saved_tensors)
    forward_event: bool = True  # recorded as forward communication (pvary has none)
    #: the collectives its ``jvp`` runs, for the accounting (None: the collective itself where
    #: it communicates in forward, nothing where it does not): see :attr:`tangent_ops`
    jvp_ops: tuple[str, ...] | None = None
    #: the forward's result is its operand's all-reduce: a backend may reduce the user's operand
    #: in place where nothing else holds it (``SpmdContext.apply``'s ``user_operand``)
    donates: bool = False
    makes_partial: bool = False  # the result may be unreduced or reduced for a plain operand
    #: the forward is a view of the operand and the transpose the identity (varying <->
    #: unreduced): differentiated by autograd as the view it is, never through the bridge's
    #: Function, whose view outputs autograd refuses to write into (the simulated mesh's take it)
    plain_view: bool = False
    #: what the collective would do to an operand invariant over some of its axes, and the fix:
    #: the rest of the error after "the operand is invariant over ... (its type ...), so "
    #: (``REQUIRE_VARYING`` records; see :class:`Invariant`)
    invariant_operand: Callable[[Invariant], str] | None = None
    #: how a pytree operand is applied where it may be done at once (a ``_fused.Packing``:
    #: the leaves of one type concatenated, where a backend asks); None: leaf by leaf
    tree: Callable[..., Any] | None = None
    #: the result is one value over its axes though typed varying (all_gather to "varying"):
    #: a write into it is refused as into a cast's (the simulated mesh's copies: one memory)
    cast_result: Callable[[Params], bool] | None = None

    def __post_init__(self) -> None:
        if self.policy is REQUIRE_VARYING and self.invariant_operand is None:
            raise CollectiveError(
                f"collective {self.name!r}: its policy refuses an invariant operand, and the "
                "record gives no invariant_operand message. Fix (for the record's author): "
                "invariant_operand=..., saying what the collective would do to such an operand "
                "and the fix that fits it (see psum's and psum_scatter's)."
            )
        RECORDS[self.name] = self

    @property
    def tangent_ops(self) -> tuple[str, ...]:
        """The collectives that computing a forward-mode tangent of its result runs."""
        if self.jvp_ops is not None:
            return self.jvp_ops
        return (self.name,) if self.forward_event else ()

    def __repr__(self) -> str:
        return f"<collective {self.name}>"

    def invariant_result(self, axes: Axes, params: Params) -> bool:
        """Whether the result is invariant over some of ``axes`` (psum, pmean, pmax, pmin,
        pbroadcast, all_gather to "invariant"): its cotangent then holds one value there. A
        result unreduced or reduced there (the casts, all_gather to "reduced") has a cotangent
        of parts or one value summed elsewhere, and needs no pvary."""
        out = self.vma(Vma.of(axes), axes, params)
        if not out.partial:  # the common case, on the accounting's path
            return not out.varying.issuperset(axes)
        return not (out.varying | out.unreduced | out.reduced).issuperset(axes)

    def backward(
        self, ctx: SpmdContext, g: Tensor, axes: Axes, params: Params, node: Any
    ) -> Tensor:
        """The transpose, as the autograd bridge applies it. When the backward is itself
        differentiated, the cotangent of a result invariant over ``axes`` (psum, pmax,
        all_gather to "invariant", ...) holds one value there and the transpose makes it
        varying: that step is a pvary, whose own transpose is the psum a second derivative
        needs (written as plain ops instead, it would be differentiated as the identity). The
        transpose then reaches the other instances only through records (``_rules``). A
        call that Dynamo traces applies the transpose alone (``_autodiff.TracedCollectiveFn``)."""
        if differentiable(g):
            pvaried = self.invariant_result(axes, params)
            if pvaried:
                g = ctx.apply(PVARY_RECORD, g, axes, ())
            ctx = _rules.checked(ctx, self.name, "transpose", pvaried)
        return self.transpose(ctx, g, axes, params, node)

    def tangent(self, ctx: SpmdContext, t: Tensor, axes: Axes, params: Params, node: Any) -> Tensor:
        """The jvp, as the autograd bridge applies it (under the rule for primitives when the
        tangent is differentiated again; never while Dynamo traces: it refuses a custom jvp,
        ``_autodiff.TracedCollectiveFn``)."""
        if differentiable(t):
            ctx = _rules.checked(ctx, self.name, "jvp", False)
        return self.jvp(ctx, self, t, axes, params, node)

    def bind(self, x: Any, axis_name: Any, *args: Any) -> Any:
        """Apply the collective to ``x`` (a tensor or a pytree of tensors) in the active call."""
        ctx = current(self.name)
        ctx.in_collective += 1  # its own ops are no ops of the user's program (``_plan``)
        try:
            if ctx.deferred:  # (a real mesh's replay: ppermutes not made yet)
                ctx.make_deferred(self, (x, args))
            axes = ctx.check_axes(axis_name, self.name)
            params = self.prepare(ctx, axes, *args) if self.prepare is not None else args
            apply = _replayed if ctx.replaying else _apply
            if isinstance(x, Tensor):
                return apply(self, ctx, x, axes, params, True)
            if self.tree is not None:
                out = self.tree(self, ctx, x, axes, params)
                if out is not None:
                    return out
            return optree.tree_map(
                lambda t: apply(self, ctx, _tensor(self, ctx, t), axes, params), x
            )
        finally:
            ctx.in_collective -= 1


def _tensor(rec: Collective, ctx: SpmdContext, t: Any) -> Tensor:
    if not isinstance(t, Tensor):
        raise CollectiveError(
            f"{rec.name} in {ctx.fn_label}: expected tensors (or a pytree of tensors), got a leaf "
            f"of type {type(t).__name__}. Fix: convert it with torch.as_tensor(...) first."
        )
    return t


def _apply(
    rec: Collective,
    ctx: SpmdContext,
    t: Tensor,
    axes: Axes,
    params: Params,
    user_operand: bool = False,
) -> Tensor:
    """The one path every collective takes: checks, operand policy, type rule, accounting,
    the backend's run of the forward, and the result's type. ``user_operand``: ``t`` is the
    tensor the user's code passed (not a leaf of a pytree), which a backend may reduce in place
    (``SpmdContext.apply``)."""
    # (a compiled call runs the probe at trace time, unguarded: the branch leaves the graph)
    if rec.forward_event and not torch_copies(dtype_and_device(t)[0]):
        check_copyable(ctx, rec.name, t)
    if rec.check is not None or ctx.values_read:  # (after a read: every rank's step, too)
        params = ctx.check_operand(rec, t, axes, params)
    vma = ctx.vma(t)
    if vma.partial:
        vma = _partial_operand(rec, ctx, t, vma, axes)
    if rec.policy is not None and not vma.varying.issuperset(axes):  # Vma.covers, inlined
        policy = rec.policy
        if policy is PVARY:
            t = implicit_pvary(ctx, t, vma.missing(axes))
            vma = vma.add(axes)
        elif policy is REQUIRE_VARYING:
            raise_invariant_operand(ctx, rec, t, axes, params)
        else:  # DROP_INVARIANT
            axes = vma.present(axes)
            if not axes:
                return t
    if ctx.single_axes and ctx.single_axes.issuperset(axes):  # a group of one instance
        return _apply_alone(rec, ctx, t, axes, params, vma)
    accounting = bool(_modes.stack)  # recording(), inlined: every collective passes here
    if accounting and rec.forward_event:
        record(CommEvent(rec.name, axes, "forward", tuple(t.shape), t.dtype))
    out = ctx.apply(rec, t, axes, params, user_operand)
    if rec.saves and out.requires_grad:
        out = _fresh(out)
    forget_blocks(out)  # its blocks are not its operand's (the forward's ops may have copied them)
    if accounting:
        out = tag_derivatives(rec, out, t, axes, params, ctx=ctx)
    if ctx.stamps or vma.partial or rec.makes_partial:
        result = rec.vma(vma, axes, params)
        new = ctx.stamps and result.varying - vma.varying - vma.unreduced
        if new or (ctx.stamps and rec.cast_result is not None):
            note_cast_result(rec, ctx, out, vma, bool(new), axes, params)
        return ctx.stamp(out, result)
    return out


def note_cast_result(
    rec: Collective, ctx: Any, out: Tensor, vma: Vma, new: bool, axes: Axes, params: Params
) -> None:
    """Note ``out``'s memory where it is an invariant value made varying (``vma``: its operand's
    type; ``new``: it varies over axes the operand did not): the identity on data, a view of its
    operand's memory on a tracked backend (where not, as in a check, its own memory stands for
    it), whose writes are checked against the type it stands for (``note_cast_root``). Not
    while compiled, which Dynamo cannot trace (a compiled call takes such writes: design 7)."""
    if torch.compiler.is_compiling():
        return
    if not new and (rec.cast_result is None or not rec.cast_result(params)):
        return
    root = tensor_base(out)
    ctx.note_cast_root(
        out if root is None else root, vma if new else vma.to_state(axes, "invariant")
    )


def _fresh(out: Tensor) -> Tensor:
    """A copy of ``out``, a result that its backward reads (pmax's, to find the instance holding
    the maximum): as in JAX a collective's result is a fresh value, so a user's write into it
    must not change its gradient (torch would refuse the backward: "modified by an inplace
    operation"). Only where differentiated; the copy is as large as the result."""
    return out.clone()


def tag_derivatives(
    rec: Collective,
    out: Tensor,
    t: Tensor,
    axes: Axes,
    params: Params,
    boundary: bool = False,
    ctx: Any = None,
) -> Tensor:
    """``out`` tagged with the collectives that its backward and its forward-mode tangent run,
    and those that the backward's differentiation runs: the transpose of a result that dropped
    ``axes`` starts with a pvary (:meth:`Collective.backward`), whose transpose is a psum; a
    transpose that communicates (a linear collective's) transposes back to the collective itself
    and has its tangent; a nonlinear one's (pmax's tie mask) reads saved values, not the
    cotangent. ``boundary``: a collective of a real mesh's call boundary (``CommEvent``).
    ``ctx``: the call whose user gets ``out`` (a detached alias then, not a view: ``tag``)."""

    def event(op: str, direction: str, x: Tensor) -> CommEvent:
        return CommEvent(op, axes, direction, tuple(x.shape), x.dtype, boundary=boundary)

    back = rec.backward_op(params)
    backward = () if back is None else (event(back, "backward", out),)
    tangent = tuple(event(op, "tangent", t) for op in rec.tangent_ops)
    again: tuple[CommEvent, ...] = ()
    if rec.forward_event and rec.invariant_result(axes, params):
        again = (event("psum", "backward", out),)
    elif rec.forward_event and back is not None:
        again = (event(rec.name, "backward", t),)
    linear = () if rec.saves else tuple(replace(e, direction="tangent") for e in backward)
    # (not under a transform where types are stamps: a wrapped alias is typed by its base)
    detached = ctx is not None and not (ctx.stamps and transforms_active())
    return tag(out, backward, tangent, (again, linear), detached)


def _replayed(
    rec: Collective,
    ctx: SpmdContext,
    t: Tensor,
    axes: Axes,
    params: Params,
    user_operand: bool = False,
) -> Tensor:
    """A collective in a replay (``SpmdContext.replaying``: a mesh of one instance, its types
    checked by an earlier call, ``_replay``): the argument checks and the forward on the one
    member, differentiated by torch. A reduction of the user's operand (``user_operand``) that
    nothing else holds hands it back, not a copy (``_donation.hands_back``)."""
    # first, before this frame refers to t again: the count the backend calibrated
    refs = refcount(t) if user_operand and rec.donates else 0
    if rec.check is not None:
        params = rec.check(ctx, t, axes, params)
    group = ctx.alone()
    if refs and hands_back(t, refs):
        group.donated = t
    with DisableTorchFunction():
        return rec.forward(group, t, axes, params)


def _partial_operand(rec: Collective, ctx: SpmdContext, t: Tensor, vma: Vma, axes: Axes) -> Vma:
    """The type a collective sees for an operand with unreduced axes: those it reduces count as
    varying (a sum of partial sums is the total); a linear movement over other axes keeps them;
    anything else is a :class:`VmaError` (the instances' parts would be moved or compared as if
    each were the value)."""
    bad = vma.unreduced if rec.unreduced is None else vma.unreduced.intersection(axes)
    if not bad or rec.unreduced == "cast":
        return vma
    if rec.unreduced == "reduce":
        return vma.to_state(bad, "varying")
    names = tuple(a for a in ctx.mesh.axis_names if a in bad)
    raise VmaError(
        f"{rec.name} in {ctx.fn_label}: the operand is unreduced over {names} (type "
        f"{type_text(t.dtype, shape_shown(t), vma, ctx.mesh.axis_names)}): each instance holds a "
        f"partial sum, which {rec.name} would treat as the value. Fix: reduce it first with "
        f"ns.psum(x, {names[0] if len(names) == 1 else names!r}) (or ns.psum_scatter), or "
        f"ns.pcast(x, {names[0] if len(names) == 1 else names!r}, to='varying') if each "
        "instance's part is meant as a local value."
    )


def _apply_alone(
    rec: Collective, ctx: SpmdContext, t: Tensor, axes: Axes, params: Params, vma: Vma
) -> Tensor:
    """A collective over axes of size 1: nothing is communicated or recorded. Backends that
    read types off the value (the simulated one) run it as usual, the level ops being local;
    the others run its forward on :class:`GroupOfOne` and stamp the declared type."""
    if not ctx.stamps:
        out = ctx.apply(rec, t, axes, params)
        forget_blocks(out)
        if vma.partial or rec.makes_partial:
            return ctx.stamp(out, rec.vma(vma, axes, params))
        return out
    with DisableTorchFunction():  # the forward's own ops need no type: the result is stamped
        out = rec.forward(ctx.alone(), t, axes, params)
    return ctx.stamp(out, rec.vma(vma, axes, params))


def same_vma(vma: Vma, axes: Axes, params: Params) -> Vma:
    return vma


def without_axes(vma: Vma, axes: Axes, params: Params) -> Vma:
    return vma.remove(axes)


def same_shape(shape: tuple[int, ...], n: int, params: Params) -> tuple[int, ...]:
    return shape


def no_backward_op(params: Params) -> None:
    return None


def backward_op(name: str) -> Callable[[Params], str]:
    return lambda params: name


# --- pvary: the cast every mixing site uses (the type system's rule 2) --------------------------


def _pvary_transpose(ctx: SpmdContext, g: Tensor, axes: Axes, params: Params, node: Any) -> Tensor:
    # synchronously where the gradient is differentiated, or the node was recorded under a
    # torch.func transform (its overlapped sum's pending wrapper would reach the next backward
    # as a tensor without storage); a transpose applied as a rule has no node
    if differentiable(g) or node is None or node.in_transform:
        return ctx.apply(RECORDS["psum"], g, axes, ())
    return ctx.psum_in_backward(g, axes, node)


PVARY_RECORD = Collective(
    name="pvary",
    policy=None,  # pvary's own check refuses axes the operand already varies over
    vma=lambda vma, axes, params: vma.add(axes),
    shape=same_shape,
    forward=lambda ctx, x, axes, params: ctx.pvary(x, axes),
    transpose=_pvary_transpose,
    backward_op=backward_op("psum"),
    check=lambda ctx, t, axes, params: _pvary_check(ctx, t, axes, params),
    forward_event=False,
)


def implicit_pvary(ctx: SpmdContext, t: Tensor, missing: Axes, record: bool = True) -> Tensor:
    """``t`` made varying over ``missing`` (axes it is invariant over): identity forward, psum
    backward. Where an invariant operand meets a varying one (rule 2). Over axes where ``t`` is
    reduced the cast costs nothing in backward (its gradient stays a partial sum: section 3).
    ``record=False``: no backward psum recorded for a ``CommMode`` (the caller records the
    logical one, :func:`record_implicit_psum`)."""
    vma = ctx.vma(t)
    if vma.reduced:
        reduced = tuple(a for a in missing if a in vma.reduced)
        if reduced:
            t = ctx.apply(RECORDS["reduced_vary"], t, reduced, ())
            t = ctx.stamp(t, vma := vma.add(reduced))
            missing = tuple(a for a in missing if a not in reduced)
            if not missing:
                return t
    alone = ctx.single_axes.issuperset(missing)  # a group of one: no psum in backward
    if alone and ctx.stamps:
        return ctx.stamp(t.view_as(t), vma.add(missing))
    out = ctx.apply(PVARY_RECORD, t, missing, ())
    if record and not alone:
        out = record_implicit_psum(out, missing)
    return ctx.stamp(out, vma.add(missing))


def record_implicit_psum(out: Tensor, missing: Axes) -> Tensor:
    """``out``, whose gradient a CommMode (if one records) counts as the backward psum over
    ``missing`` of an implicit pvary."""
    if not _modes.stack:  # recording(), inlined: every implicit pvary passes here
        return out
    event = CommEvent("psum", missing, "backward", tuple(out.shape), out.dtype, implicit=True)
    return on_backward(out, event)


def implicit_cast(ctx: SpmdContext, t: Tensor, axes: Axes, to: str) -> Tensor:
    """``t`` cast to ``to`` over ``axes`` where an op mixes it with values in that state: an
    invariant operand beside reduced ones cast to reduced, whose backward psum is recorded as
    implicit; a reduced value written into an invariant tensor cast to invariant (``to``
    "invariant": its backward communicates nothing)."""
    rec = RECORDS["preduced" if to == "reduced" else "reduced_invariant"]
    out = ctx.apply(rec, t, axes, ())
    if to == "reduced" and recording() and not ctx.single_axes.issuperset(axes):
        event = CommEvent("psum", axes, "backward", tuple(out.shape), out.dtype, implicit=True)
        out = on_backward(out, event)
    return ctx.stamp(out, rec.vma(ctx.vma(t), axes, ()))


def _pvary_check(ctx: SpmdContext, t: Tensor, axes: Axes, params: Params) -> Params:
    already = ctx.vma(t).present(axes)
    if already:
        raise ctx.type_error(
            t,
            lambda shape: VmaError(
                f"pvary in {ctx.fn_label}: the operand already varies over {already} (type "
                f"{type_text(t.dtype, shape, ctx.vma(t), ctx.mesh.axis_names)}). Fix: pvary "
                "only over axes it is invariant over."
            ),
        )
    return params


def pvary(x: Any, axis_name: str | tuple[str, ...]) -> Any:
    """``pvary(x: T{...}, A) -> T{A,...}``: declare an invariant value varying over A.

    Identity on data. Raises if ``x`` already varies over an axis of A. Mixing an invariant value
    with a varying one does this implicitly, once per (tensor, axes).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("i",))
        >>> @ns.spmd_map(mesh=mesh, in_specs=ns.P(), out_specs=ns.P("i"))
        ... def f(w):
        ...     v = ns.pvary(w, "i")  # same data, now typed as varying over "i"
        ...     return v * (ns.axis_index("i") + 1)
        >>> f(torch.ones(1))
        tensor([1., 2.])

    Backward: psum over A.
    """
    return PVARY_RECORD.bind(x, axis_name)
