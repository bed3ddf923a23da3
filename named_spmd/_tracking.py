"""Per-op vma tracking: :class:`VmaMode`, the torch-function mode of stamped calls (``_stamps``).

Every torch op of the per-device function gets the union of its operands' vma (docs/design.md
section 2, rule 2) as its results' stamp. Where an invariant operand meets a varying one, the
mode inserts the implicit pvary once per (tensor, axes) for the call, so a replicated weight used
by ten ops costs one gradient psum.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.compiler import is_compiling
from torch.overrides import TorchFunctionMode

from . import _blocks
from ._accounting import memo_cast
from ._errors import VmaError, reentrant_checkpoint
from ._operands import (
    METADATA,
    NOT_OPS,
    READS_VALUES,
    is_inplace,
    result_tensors,
    swap_operands,
    tensor_operands,
    value_operands_read,
    write_target,
)
from ._partial import SHAPE_ONLY, check_cast, combine, has_tensor, value_operands
from ._stamps import _ATTR, TrackedContext, stamp_inner, storage_address
from ._torch_private import in_reentrant_checkpoint, set_grad_enabled, tensor_base
from ._torch_private import is_transform_wrapped as _is_wrapped
from ._types import INVARIANT, Vma

Tensor = torch.Tensor
_BLOCKS = _blocks.ATTR


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


# Random factories shaped like an operand draw from the stream every instance shares (the
# randomness policy: same seed, same values), so their result is invariant like any factory's,
# as on the simulated backend, where vmap's randomness="same" leaves them unbatched.
_RANDOM_LIKE = frozenset({torch.rand_like, torch.randn_like, torch.randint_like})
# the mode runs these as they are (the grad-mode switch: checked for a reentrant checkpoint)
_UNTYPED = _RANDOM_LIKE | NOT_OPS | METADATA | {set_grad_enabled}


def _check_inplace(ctx: TrackedContext, func, args, kwargs, union: Vma, inplace=is_inplace) -> None:
    """An in-place op (or ``out=``) whose target is less varying than its operands would write
    varying values through the implicit pvary's alias into a tensor still typed invariant: every
    instance would hold different values in what is typed replicated (the simulated backend's
    vmap refuses the write too)."""
    target = write_target(func, args, kwargs, inplace)
    if target is None:
        return
    axes = ctx.vma(target).missing(union.present(ctx.mesh.axis_names))
    if axes:
        name = getattr(func, "__name__", "")
        raise VmaError(
            f"{name} in {ctx.fn_label}: writes a value varying over {axes} into a tensor that is "
            f"invariant over {axes} (an in_spec P() input or a closed-over tensor), which would "
            "then hold different values on different instances while typed replicated. Fix: "
            "compute out of place (y = x + v instead of x += v)."
        )


def _kept_by_write(ctx: TrackedContext, func, args, kwargs, union: Vma, inplace) -> Vma:
    """The type of an op ``union`` types reduced, where it writes (in place, or ``out=``) into a
    tensor invariant over some of those axes: the written tensor keeps its type, so the result
    is invariant there, and the reduced operands are cast to invariant (their cotangents, the
    same on every instance, made parts of a sum), not the target to reduced (a write cannot
    change the type of the tensor written, and the real mesh's cast is a view of a custom
    Function, which autograd refuses to write into)."""
    target = write_target(func, args, kwargs, inplace)
    if target is None:
        return union
    held = ctx.vma(target)
    kept = [a for a in union.reduced if held.state(a) == "invariant"]
    return union.to_state(kept, "invariant") if kept else union


# A write into an invariant value made varying, which shares its operand's memory (a real mesh's
# pvary; the simulated mesh's copies of it, one memory, refuse the write): the one text of it
CAST_WRITE = (
    "writes into an invariant value made varying (ns.pvary, ns.pcast(..., to='varying'), "
    "all_gather(..., to='varying'), or an op that mixed it with a varying one), which shares its "
    "operand's memory: the write would change the operand, typed replicated, on one instance "
    "only. Fix: write into a copy (v = ns.pvary(w, 'dp').clone()), or compute out of place "
    "(y = v + 1 rather than v.add_(1))."
)


def check_cast_alias(ctx: TrackedContext, func, target: Tensor | None) -> None:
    """A write into memory of an operand that an explicit cast to varying handed back as a view
    (``TrackedContext.cast_roots``), where ``target`` varies over axes the operand does not:
    the write would change the operand, invariant over them, on this rank only."""
    if target is None:
        return
    cast = _cast_root(ctx, target)
    if cast is None:
        return
    axes = cast[1].missing(ctx.vma(target).present(ctx.mesh.axis_names))
    if axes:
        name = getattr(func, "__name__", "")
        raise VmaError(f"{name} in {ctx.fn_label}: {CAST_WRITE}")


def _cast_root(ctx: TrackedContext, target: Tensor) -> tuple[Tensor, Vma, int] | None:
    """The recorded cast (its memory, its operand's type, its storage's address) whose memory
    ``target`` is: by its view's base, else by storage (``.detach()`` and ``.data`` of a view
    have no base)."""
    base = tensor_base(target)
    cast = ctx.cast_roots.get(id(target if base is None else base))
    if cast is not None:
        return cast
    ptr = storage_address(target)
    if not ptr:
        return None
    return next((c for c in ctx.cast_roots.values() if c[2] == ptr), None)


class VmaMode(TorchFunctionMode):
    """Stamps every op's outputs with the union of its operands' vma; inserts implicit pvary."""

    inplace = staticmethod(is_inplace)  # whether an op writes into its first argument

    def __init__(self, ctx: TrackedContext, *, insert_pvary: bool = True):
        super().__init__()
        self.ctx = ctx
        self.insert_pvary = insert_pvary
        self.token = ctx.call_token
        self._axes_of: dict = {}  # stamp -> its axes in mesh order
        self._alone_of: dict = {}  # stamp -> whether its axes all have size 1
        self._union_of: dict = {}  # (stamp, stamp) -> the stamp of their union
        self._missing_of: dict = {}  # (stamp, union's stamp) -> the axes to pvary over

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # Fast path (most ops): tensors as operands, positional or keyword (not in lists: those
        # take the general path), typed without partial states. Their stamps are compared by
        # identity; where they differ, the union's stamp comes from a memo per pair of stamps.
        # Then the result takes that stamp object as is; an operand typed below it gets its
        # implicit pvary alias from the call's caches, or none where the missing axes all have
        # size 1. Costs about one dict lookup per operand on top of the mode's own dispatch.
        if func in READS_VALUES and not self.ctx.values_read and not self.ctx.in_collective:
            self._note_values(func, args, kwargs)
        if func in _UNTYPED:
            if func is set_grad_enabled and not is_compiling() and in_reentrant_checkpoint():
                raise reentrant_checkpoint(f"spmd_map of {self.ctx.fn_label}")
            out = func(*args, **(kwargs or {}))
            return self._gradients(args, kwargs, out) if func is torch.autograd.grad else out
        if self.ctx.cast_roots:  # (an explicit cast to varying was made: its writes checked)
            check_cast_alias(self.ctx, func, write_target(func, args, kwargs, self.inplace))
        token, aliased = self.token, self.ctx.alias_cache
        common = None
        plain = mixed = blocks = False
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, Tensor):
                d = a.__dict__
                s = d.get(_ATTR)
                if d.get(_BLOCKS) is not None:  # (forget leaves None)
                    blocks = True
                if s is None or s[0] is not token:
                    # torch.func inside: a wrapper's vma is its unwrapped tensor's (tensors with
                    # a cached alias were checked when it was made)
                    if id(a) not in aliased and (_is_wrapped(a) or self.ctx.transform_results):
                        return self._general(func, args, kwargs)
                    plain = True
                elif s[1] is INVARIANT:  # typed invariant in this call (a P() input, again)
                    plain = True
                elif common is None:
                    common = s
                elif s is not common:
                    common = self._union(common, s)
                    if common is None:  # partial states: the algebra decides (section 2.2)
                        return self._general(func, args, kwargs)
                    mixed = True
            elif isinstance(a, (list, tuple)) and not _plain_values(a):
                # tensors in a list (torch.cat), or in a tuple of torch.return_types
                return self._general(func, args, kwargs)
        if common is None:
            return func(*args, **(kwargs or {}))
        if common[1].partial:  # unreduced or reduced axes: the op must be checked (section 2.2)
            return self._general(func, args, kwargs)
        if (plain or mixed) and func in SHAPE_ONLY:  # x.view_as(y): x's type (as vmap's)
            return self._general(func, args, kwargs)
        given = args, kwargs
        if (plain or mixed) and self.insert_pvary:  # operands typed below the union: pvary
            if is_inplace(func) or (kwargs and "out" in kwargs):
                _check_inplace(self.ctx, func, args, kwargs, common[1])
                # the target takes the stamp; maybe the caller's (``Call.unstamp``)
                if args and is_inplace(func):
                    self.ctx.handed_back(args[0])
                else:  # (out=)
                    self.ctx.note_handed_back(None, args, kwargs)
            if not self._alone(common):
                args, kwargs = self._vary_below(args, kwargs, common)
        out = func(*args, **kwargs) if kwargs else func(*args)
        if blocks:  # an operand holds blocks of mesh axes: the op may make a partial sum
            operands = tensor_operands(*given)
            vma = self._blocks(func, given, operands, out, common[1])
            if vma is not common[1]:
                return self._stamp_outputs(out, vma)
        if type(out) is Tensor or isinstance(out, Tensor):
            out.__dict__[_ATTR] = common
            if _is_wrapped(out):
                stamp_inner(self.ctx, out, common)
        elif isinstance(out, (list, tuple)):
            for o in result_tensors(out):
                o.__dict__[_ATTR] = common
                if _is_wrapped(o):
                    stamp_inner(self.ctx, o, common)
        return out

    def _note_values(self, func, args, kwargs) -> None:
        """Set ``ctx.values_read`` where ``func`` reads (or sizes its result by) the values of
        an operand that varies, or holds partial sums, over an axis of several instances."""
        ctx, alone = self.ctx, self.ctx.single_axes
        for t in value_operands_read(func, args, kwargs):
            v = ctx.vma(t)
            if not (alone.issuperset(v.varying) and alone.issuperset(v.unreduced)):
                ctx.values_read = True
                return

    def _gradients(self, args, kwargs, grads):
        """The results of ``torch.autograd.grad`` (torch.func.grad and vjp inside the function
        call it): autograd computes them outside the mode, and each cotangent has the type of
        its input (the transpose of every op keeps the operand's type), but for partial states,
        which swap (a partial sum's cotangent is reduced, a reduced value's unreduced: section
        2.2), varying also where a cotangent given varies and its output does not (its gradient
        then differs between instances, as on the simulated mesh; typed by the input alone, it
        would be a varying value typed invariant)."""
        inputs = kwargs.get("inputs") if kwargs and "inputs" in kwargs else args[1]
        inputs = (inputs,) if isinstance(inputs, Tensor) else inputs
        given = _given_vma(self.ctx, args, kwargs)
        for x, g in zip(inputs, grads):
            if isinstance(g, Tensor):
                vma = self.ctx.vma(x)
                if vma.partial:
                    vma = Vma.make(vma.varying, vma.reduced, vma.unreduced)
                vma = vma if given is INVARIANT or vma.partial else vma.union(given)
                if vma is not INVARIANT:
                    self.ctx.pin(g, vma)
        return grads

    def _union(self, a, b):
        """The stamp of the union of stamps ``a`` and ``b`` (memo per pair: a call meets few
        pairs, the same ones in every block); None where either has partial states."""
        key = (a, b)
        hit = self._union_of.get(key)
        if hit is None:
            if a[1].partial or b[1].partial:
                return None
            hit = self._union_of[key] = self.ctx.stamp_of(a[1].union(b[1]))
        return hit

    def _vary_below(self, args, kwargs, common):
        """``args`` and ``kwargs`` with every operand typed below ``common`` replaced by its
        implicit pvary alias over the axes it lacks (one per tensor and axes per call, through
        :meth:`TrackedContext.cached_pvary`; none over axes of size 1, the identity: see
        :meth:`_alone`). An invariant tensor's alias is also remembered per tensor, the usual
        hit."""
        token, cache, swap = self.token, self.ctx.alias_cache, {}
        for a in (*args, *kwargs.values()) if kwargs else args:
            if not isinstance(a, Tensor) or a in swap:
                continue
            s = a.__dict__.get(_ATTR)
            if s is None or s[0] is not token or s[1] is INVARIANT:
                swap[a] = memo_cast(cache, id(a), a, self._alias_to, a, common, tag=common)
            elif s is not common:
                missing = self._missing(s, common)
                if missing:
                    swap[a] = self.ctx.cached_pvary(a, missing)
        if not swap:
            return args, kwargs
        return swap_operands(args, kwargs, swap, _itself)

    def _alias_to(self, a: Tensor, common) -> Tensor:
        """The varying alias of the invariant ``a`` that reaches the stamp ``common``."""
        return self.ctx.cached_pvary(a, self._mesh_order(common))

    def _missing(self, stamp, common) -> tuple[str, ...]:
        """:meth:`_pvary_axes` of the types of two stamps (memo per pair)."""
        key = (stamp, common)
        hit = self._missing_of.get(key)
        if hit is None:
            hit = self._missing_of[key] = self._pvary_axes(stamp[1], common[1])
        return hit

    def _pvary_axes(self, vma: Vma, union: Vma) -> tuple[str, ...]:
        """The axes, in mesh order, over which an operand of type ``vma`` is pvary'd to reach
        ``union``: those it lacks; none where they all have size 1 (the identity: see
        :meth:`_alone`)."""
        missing = vma.missing(union.present(self.ctx.mesh.axis_names))
        return () if self.ctx.single_axes.issuperset(missing) else missing

    def _mesh_order(self, stamp) -> tuple[str, ...]:
        axes = self._axes_of.get(stamp)
        if axes is None:
            axes = self._axes_of[stamp] = tuple(
                n for n in self.ctx.mesh.axis_names if n in stamp[1]
            )
        return axes

    def _alone(self, stamp) -> bool:
        """Whether every axis ``stamp`` varies over has size 1: a pvary over them would be the
        identity forward and backward (no psum, nothing recorded), and the op's result takes
        the union's stamp anyway, so no alias is made (a (1,1) mesh: one per parameter)."""
        alone = self._alone_of.get(stamp)
        if alone is None:
            alone = self._alone_of[stamp] = self.ctx.single_axes.issuperset(self._mesh_order(stamp))
        return alone

    def _general(self, func, args, kwargs):
        """Any op: the union of the operands' vma; implicit pvary of the invariant ones."""
        operands = tensor_operands(args, kwargs)
        if not operands:
            return func(*args, **(kwargs or {}))
        vma_of = self.ctx.vma
        vmas = [vma_of(t) for t in operands]
        if any(v.partial for v in vmas):
            return self._partial(func, args, kwargs, operands, vmas)
        operands, vmas = value_operands(func, args, kwargs, operands, vmas)
        union = vmas[0]
        for v in vmas[1:]:
            union = union.union(v)
        if not union:
            return func(*args, **(kwargs or {}))
        given = args, kwargs
        if self.insert_pvary and len(vmas) > 1 and any(v is not union for v in vmas):
            _check_inplace(self.ctx, func, args, kwargs, union, self.inplace)
            args, kwargs = self._vary_operands(operands, vmas, union, args, kwargs)
        out = self._run(func, args, kwargs)
        return self._stamp_outputs(out, self._blocks(func, given, operands, out, union))

    def _run(self, func, args, kwargs):
        """The op itself, whose outputs get types (and block records)."""
        return func(*args, **(kwargs or {}))

    def _partial(self, func, args, kwargs, operands, vmas):
        """An op with unreduced or reduced operands: typed by the partial-sum algebra (section
        8); invariant operands are cast to the result's varying and reduced axes."""
        union = combine(self.ctx, func, args, kwargs, operands, vmas)
        if not isinstance(union, Vma):  # not known linear: an error if it computes a tensor
            out = func(*args, **(kwargs or {}))
            if has_tensor(out):
                raise union()
            return out
        given = args, kwargs
        if union.reduced:
            union = _kept_by_write(self.ctx, func, args, kwargs, union, self.inplace)
        if self.insert_pvary and len(vmas) > 1 and any(v is not union for v in vmas):
            _check_inplace(self.ctx, func, args, kwargs, union, self.inplace)
            args, kwargs = self._vary_operands(operands, vmas, union, args, kwargs)
        out = self._run(func, args, kwargs)
        check_cast(self.ctx, func, operands, vmas, union, out)
        return self._stamp_outputs(out, self._blocks(func, given, operands, out, union))

    def _blocks(self, func, given, operands, out, union: Vma) -> Vma:
        """``union``, made unreduced over the axes a contraction of blocks makes it so
        (``_blocks``); the layouts are read off the operands as given (an implicit pvary's
        alias is the same value, and holds the same blocks)."""
        if not _blocks.recorded(operands, self.token):
            return union
        args, kwargs = given
        axes = _blocks.after_op(
            self.ctx, self.token, func, args, kwargs, operands, out, self.ctx.vma
        )
        return _blocks.unreduced_over(union, axes) if axes else union

    def _vary_operands(self, operands, vmas, union, args, kwargs):
        swap = {}
        names = self.ctx.mesh.axis_names
        for t, v in zip(operands, vmas):
            if v is not union and t not in swap:
                missing = self._pvary_axes(v, union)
                alias = self.ctx.cached_pvary(t, missing) if missing else t
                if union.reduced:  # an invariant operand beside reduced ones: cast to reduced
                    axes = tuple(
                        a for a in names if a in union.reduced and v.state(a) == "invariant"
                    )
                    if axes:
                        alias = self.ctx.cached_cast(alias, axes, "reduced")
                if v.reduced:  # written into a tensor invariant there (_kept_by_write)
                    axes = tuple(
                        a for a in names if a in v.reduced and union.state(a) == "invariant"
                    )
                    if axes:
                        alias = self.ctx.cached_cast(alias, axes, "invariant")
                if alias is not t:
                    swap[t] = alias  # keyed by the tensor: id() of a traced input is a guard
        if not swap:
            return args, kwargs
        return swap_operands(args, kwargs, swap, _itself)

    def _stamp_outputs(self, out, union):
        stamp = self.ctx.stamp_of(union)
        for o in result_tensors(out):
            o.__dict__[_ATTR] = stamp
            if _is_wrapped(o):
                stamp_inner(self.ctx, o, stamp)
        return out


def _given_vma(ctx: TrackedContext, args: Any, kwargs: dict | None) -> Vma:
    """The axes over which a cotangent given to ``torch.autograd.grad`` (its ``grad_outputs``)
    varies while its output does not: no implicit pvary's transpose sums it there, so the
    gradients differ between instances there (JAX refuses such a cotangent)."""
    kwargs = kwargs or {}
    outputs = kwargs.get("outputs", args[0] if args else ())
    given = kwargs.get("grad_outputs", args[2] if len(args) > 2 else None)
    outputs = (outputs,) if isinstance(outputs, Tensor) else outputs
    given = (given,) if isinstance(given, Tensor) else (given or ())
    extra: set[str] = set()
    for out, g in zip(outputs, given):
        if isinstance(g, Tensor) and isinstance(out, Tensor):
            v = ctx.vma(g)
            if v.varying and not v.partial:
                extra.update(v.varying - ctx.vma(out).varying)
    return Vma.of(tuple(a for a in ctx.mesh.axis_names if a in extra)) if extra else INVARIANT


def _plain_values(values) -> bool:
    """Whether no tensor is among ``values`` (an op's keyword values, or a list argument such
    as layer_norm's ``normalized_shape``): then the fast path types the op by its positional
    tensors alone (``is_causal=True``, ``dim=-1``)."""
    for v in values:
        if isinstance(v, (Tensor, list, tuple)):
            return False
    return True
