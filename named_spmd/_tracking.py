"""Per-tensor vma tracking for backends that run one instance per process (or none at all).

The simulated backend reads vma off its vmap levels. The distributed and abstract backends run the
per-device function once, on local tensors, so they stamp every tensor with its vma instead:
inputs from their in_specs, collectives' outputs by their rule (``SpmdContext.stamp``), and every
other torch op by :class:`VmaMode`: the union of its operands' vma (docs/design.md section 2, rule 2).
Where an invariant operand meets a varying one, the mode inserts the implicit pvary once per
(tensor, axes) for the call, so a replicated weight used by ten ops costs one gradient psum.

A stamp is ``(call token, Vma)`` kept in the tensor's ``__dict__``: a tensor that carries a
stamp from another call (or none) is invariant here, like any closed-over tensor.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from . import _blocks
from ._collectives._record import implicit_cast, implicit_pvary
from ._context import SpmdContext
from ._errors import VmaError
from ._partial import SHAPE_ONLY, check_cast, combine, has_tensor, value_operands
from ._torch_private import DisableTorchFunction, tensor_base
from ._torch_private import get_unwrapped as _unwrap
from ._torch_private import is_transform_wrapped as _is_wrapped
from ._torch_private import transforms_active as _transforms_active
from ._types import INVARIANT, Vma

Tensor = torch.Tensor
_ATTR = "_named_spmd_vma"
_SRC = "_named_spmd_src"  # a planned call's numbering of its typed tensors (``_plan``)
_BLOCKS = _blocks.ATTR
STAMP_ATTR = _ATTR  # the attribute holding a tensor's stamp (read with getattr where traced)


class Number:
    """The n-th tensor a planned call typed, as a replay's guard key (``_plan``): compared by
    identity, so that no argument value (an int) is ever mistaken for one."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"#{self.n}"


_NUMBERS: list[Number] = []  # interned: the n-th of every call is one object


def _number(n: int) -> Number:
    while len(_NUMBERS) <= n:
        _NUMBERS.append(Number(len(_NUMBERS)))
    return _NUMBERS[n]


class TrackedContext(SpmdContext):
    """A call whose tensors carry their vma as a stamp. Subclasses implement the primitives."""

    def __init__(self, mesh, fn):
        super().__init__(mesh, fn)
        self.call_token = object()
        self._stamps: dict[int, tuple[object, Vma]] = {}  # id(type) -> its stamp
        # id(invariant tensor) -> (tensor, stamp, its varying alias): VmaMode's fast path
        self.alias_cache: dict[int, tuple[torch.Tensor, tuple, torch.Tensor]] = {}
        # (id(tensor), axes) -> (tensor, its varying alias); the tensor is kept alive so that
        # its id is not reused during the call.
        self.pvary_cache: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, torch.Tensor]] = {}
        # storage address -> (tensor, stamp) of values computed inside a torch.func transform:
        # a transform may hand back a new view of them (vmap moving its batch dim), which has
        # no stamp of its own (only views are looked up: a tensor that owns its storage and has
        # no stamp is invariant, even where a varying view of it was recorded). Kept alive, so
        # that no other tensor gets the address meanwhile.
        self.transform_results: dict[int, tuple[torch.Tensor, tuple[object, Vma]]] = {}
        # a planned or replayed call (``_plan``): each typed tensor gets the next number, and
        # each implicit cast's alias is remembered with what it was made from
        self.numbering = False
        self.numbered = 0
        self.recipes: dict[int, tuple[torch.Tensor, tuple]] | None = None

    def vma(self, x: torch.Tensor) -> Vma:
        stamp = x.__dict__.get(_ATTR)
        if stamp is not None and stamp[0] is self.call_token:
            return stamp[1]
        if _is_wrapped(x):  # a torch.func transform inside the function wrapped a stamped tensor
            return self.vma(_unwrap(x))
        return self._view_vma(x)

    def _view_vma(self, x: torch.Tensor) -> Vma:
        """The type of an unstamped tensor: a view's (one that no op of the mode made: an alias
        functorch made of a wrapped tensor, a batch dim moved, the expanded copies a user vmap
        hands back of a result it did not batch) is its base's, else, inside a torch.func
        transform, that of the transform result it shares storage with; a tensor that is no
        view is invariant."""
        base = _view_base(x)
        if base is None or x.is_meta:
            return INVARIANT
        stamp = base.__dict__.get(_ATTR)
        if stamp is not None and stamp[0] is self.call_token:
            return stamp[1]
        if not self.transform_results:
            return INVARIANT
        hit = self.transform_results.get(x.untyped_storage().data_ptr())
        return INVARIANT if hit is None else hit[1][1]

    def stamp_of(self, vma: Vma) -> tuple[object, Vma]:
        """The stamp for ``vma``, one per call and type: equal types share one stamp object, so
        :class:`VmaMode` compares operands by identity."""
        key = id(vma)  # types are interned and never freed: identity is equality (an int key
        # hashes in C, on the hot path of every collective)
        stamp = self._stamps.get(key)
        if stamp is None:
            stamp = self._stamps[key] = (self.call_token, vma)
        return stamp

    def stamp(self, x: torch.Tensor, vma: Vma) -> torch.Tensor:
        if vma is not INVARIANT or _ATTR in x.__dict__:
            if vma is not INVARIANT and not _is_wrapped(x) and _transforms_active():
                x = _own_storage(x)
            x.__dict__[_ATTR] = stamp = self.stamp_of(vma)
            if _is_wrapped(x):  # a collective under a user vmap: the tensor vmap hands back
                _stamp_inner(self, x, stamp)  # is the unwrapped one, which must keep the type
        if self.numbering:
            self.number(x)
        return x

    def number(self, x: torch.Tensor) -> None:
        """Give ``x`` the call's next number (``_plan``: the key a replay's guard compares)."""
        x.__dict__[_SRC] = (self.call_token, _number(self.numbered))
        self.numbered += 1

    def held_blocks(self, x: torch.Tensor) -> Any:
        return _blocks.recorded_layout(x, self.call_token)

    def pin(self, x: torch.Tensor, vma: Vma) -> torch.Tensor:
        """:meth:`stamp`, invariant types included (which ``stamp`` leaves implicit)."""
        x.__dict__[_ATTR] = stamp = self.stamp_of(vma)
        if _is_wrapped(x):
            _stamp_inner(self, x, stamp)
        if self.numbering:
            self.number(x)
        return x

    def stamp_input(self, x: torch.Tensor, spec: Any) -> torch.Tensor:
        """An input leaf under ``spec``: its type, and the blocks its dims hold. Stamped even
        where invariant: one tensor passed at two argument positions (a backend hands a
        replicated input through as is) gets a tensor object per position, each typed by its
        own spec; and an invariant input may be the caller's tensor, or a view of it, whose
        storage a varying alias made inside a torch.func transform also holds (see ``vma``)."""
        held = x.__dict__.get(_ATTR)
        if held is not None and held[0] is self.call_token:
            with DisableTorchFunction():
                x = x.view_as(x)
        self.pin(x, spec.vma())
        _blocks.mark(x, spec, self.call_token)
        return x

    def cached_cast(self, t: torch.Tensor, axes: tuple[str, ...], to: str) -> torch.Tensor:
        """``ns.pcast(t, axes, to=to)``, one per (tensor, axes, state) per call: the implicit
        cast of an invariant operand meeting reduced ones (its gradient summed once)."""
        alias = self.memo_alias(t, axes + (to,), lambda: implicit_cast(self, t, axes, to))
        if self.recipes is not None:
            self.recipes[id(alias)] = (t, ("cast", axes, to))
        return alias

    def cached_pvary(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """The implicit pvary of ``t`` over ``axes``: one alias per (tensor, axes) per call."""
        alias = self.memo_alias(t, axes, lambda: self.implicit_pvary(t, axes))
        if self.recipes is not None:
            self.recipes[id(alias)] = (t, ("pvary", axes))
        return alias

    def memo_alias(self, t: torch.Tensor, tag: tuple[str, ...], make) -> torch.Tensor:
        """``make()``, once per (``t``, ``tag``) per call (the caches of implicit casts)."""
        key = (id(t), tag)
        hit = self.pvary_cache.get(key)
        if hit is None:
            hit = self.pvary_cache[key] = (t, make())
        return hit[1]

    def implicit_pvary(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """The alias :meth:`cached_pvary` caches (a backend may place the pvary elsewhere)."""
        return implicit_pvary(self, t, axes)


def tensor_operands(args: Any, kwargs: dict | None) -> list[torch.Tensor]:
    """The tensors among an op's arguments (top level and one list/tuple level down)."""
    found: list[torch.Tensor] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found


def swap_operands(args: Any, kwargs: dict | None, swap: dict, key: Any = id):
    """``args`` and ``kwargs`` with each tensor whose ``key`` is in ``swap`` replaced (keyed by
    the tensor itself where Dynamo may trace: ``id`` of a traced input is a guard)."""
    if type(args) is tuple:  # (the usual case, one level inlined: this runs for every cast)
        args = tuple(
            [
                swap.get(key(a), a)
                if isinstance(a, torch.Tensor)
                else _replace(a, swap, key)
                if isinstance(a, (list, tuple))
                else a
                for a in args
            ]
        )
    else:
        args = _replace(args, swap, key)
    if kwargs:
        kwargs = {k: _replace(v, swap, key) for k, v in kwargs.items()}
    return args, kwargs


def _replace(obj: Any, swap: dict, key: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return swap.get(key(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(o, swap, key) for o in obj)
    return obj


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


# Random factories shaped like an operand draw from the stream every instance shares (the
# randomness policy: same seed, same values), so their result is invariant like any factory's,
# as on the simulated backend, where vmap's randomness="same" leaves them unbatched.
_RANDOM_LIKE = frozenset({torch.rand_like, torch.randn_like, torch.randint_like})
# Calls that take tensors but compute no value from them: differentiation itself (which
# torch.func.grad / vjp inside the function call too). Treated as ops, they would mix the
# invariant loss with the varying inputs and pvary the loss, doubling gradients per axis size.
NOT_OPS = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})
# Reads of a tensor's metadata (a collective's own checks read dtype and device): no tensor
# results, nothing to type.
_METADATA = frozenset(
    {
        Tensor.dtype.__get__,  # type: ignore[attr-defined]
        Tensor.device.__get__,
        Tensor.shape.__get__,  # type: ignore[attr-defined]
        Tensor.is_floating_point,
        Tensor.is_complex,
        Tensor.dim,
    }
)
_UNTYPED = _RANDOM_LIKE | NOT_OPS | _METADATA  # the mode runs these as they are


_INPLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
    + ("and", "or", "xor", "lshift", "rshift")
) | {"__setitem__"}


_IS_INPLACE: dict = {}  # func -> whether it writes into its first argument (memo: hot path)


def is_inplace(func) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``, ``__setitem__``)."""
    return _is_inplace(func)


def _is_inplace(func) -> bool:
    hit = _IS_INPLACE.get(func)
    if hit is None:
        name = getattr(func, "__name__", "")
        hit = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
        _IS_INPLACE[func] = hit
    return hit


def _check_inplace(
    ctx: TrackedContext, func, args, kwargs, union: Vma, inplace=_is_inplace
) -> None:
    """An in-place op (or ``out=``) whose target is less varying than its operands would write
    varying values through the implicit pvary's alias into a tensor still typed invariant: every
    instance would hold different values in what is typed replicated (the simulated backend's
    vmap refuses the write too)."""
    target = args[0] if args and inplace(func) else (kwargs or {}).get("out")
    if not isinstance(target, Tensor):
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


class VmaMode(TorchFunctionMode):
    """Stamps every op's outputs with the union of its operands' vma; inserts implicit pvary."""

    inplace = staticmethod(_is_inplace)  # whether an op writes into its first argument

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
        if func in _UNTYPED:
            out = func(*args, **(kwargs or {}))
            return self._gradients(args, kwargs, out) if func is torch.autograd.grad else out
        token, aliased = self.token, self.ctx.alias_cache
        common = None
        plain = mixed = blocks = False
        for a in (*args, *kwargs.values()) if kwargs else args:
            if isinstance(a, Tensor):
                d = a.__dict__
                s = d.get(_ATTR)
                if _BLOCKS in d:
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
            elif (type(a) is list or type(a) is tuple) and not _plain_values(a):
                return self._general(func, args, kwargs)  # tensors in a list (torch.cat)
        if common is None:
            return func(*args, **(kwargs or {}))
        if common[1].partial:  # unreduced or reduced axes: the op must be checked (section 2.2)
            return self._general(func, args, kwargs)
        if (plain or mixed) and func in SHAPE_ONLY:  # x.view_as(y): x's type (as vmap's)
            return self._general(func, args, kwargs)
        given = args, kwargs
        if (plain or mixed) and self.insert_pvary:  # operands typed below the union: pvary
            if _is_inplace(func) or (kwargs and "out" in kwargs):
                _check_inplace(self.ctx, func, args, kwargs, common[1])
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
                _stamp_inner(self.ctx, out, common)
        elif isinstance(out, (list, tuple)):
            for o in out:
                if isinstance(o, Tensor):
                    o.__dict__[_ATTR] = common
                    if _is_wrapped(o):
                        _stamp_inner(self.ctx, o, common)
        return out

    def _gradients(self, args, kwargs, grads):
        """The results of ``torch.autograd.grad`` (torch.func.grad and vjp inside the function
        call it): autograd computes them outside the mode, and each cotangent has the type of
        its input (the transpose of every op keeps the operand's type), varying also where a
        cotangent given varies and its output does not (its gradient then differs between
        instances, as on the simulated mesh; typed by the input alone, it was a varying value
        typed invariant)."""
        inputs = kwargs.get("inputs") if kwargs and "inputs" in kwargs else args[1]
        inputs = (inputs,) if isinstance(inputs, Tensor) else inputs
        given = _given_vma(self.ctx, args, kwargs)
        for x, g in zip(inputs, grads):
            if isinstance(g, Tensor):
                vma = self.ctx.vma(x)
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
                hit = cache.get(id(a))
                if hit is None or hit[1] is not common:
                    alias = self.ctx.cached_pvary(a, self._mesh_order(common))
                    hit = cache[id(a)] = (a, common, alias)  # a: keeps its id unique
                swap[a] = hit[2]
            elif s is not common:
                missing = self._missing(s, common)
                if missing:
                    swap[a] = self.ctx.cached_pvary(a, missing)
        if not swap:
            return args, kwargs
        return swap_operands(args, kwargs, swap, _itself)

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
        if self.insert_pvary and len(vmas) > 1 and any(v is not union for v in vmas):
            _check_inplace(self.ctx, func, args, kwargs, union)
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
                if alias is not t:
                    swap[t] = alias  # keyed by the tensor: id() of a traced input is a guard
        if not swap:
            return args, kwargs
        return swap_operands(args, kwargs, swap, _itself)

    def _stamp_outputs(self, out, union):
        stamp = self.ctx.stamp_of(union)
        for o in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(o, torch.Tensor):
                o.__dict__[_ATTR] = stamp
                if _is_wrapped(o):
                    _stamp_inner(self.ctx, o, stamp)
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


def _own_storage(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied where it is a view: a collective's varying result that a torch.func
    transform inside the function does not wrap (a user vmap's unbatched value), whose view
    the transform may hand back (vmap expands an unbatched result over its batch). That view
    is typed by its base (``TrackedContext.vma``), which must then be the typed result, not
    the collective's buffer or, for a pvary, its invariant operand."""
    if _view_base(x) is None:
        return x
    with DisableTorchFunction():
        return x.clone()


def _view_base(x: torch.Tensor) -> torch.Tensor | None:
    """A view's base (None for a non-view), read without the modes (a mode types the result of
    a property as it does an op's)."""
    with DisableTorchFunction():
        return tensor_base(x)


def _plain_values(values) -> bool:
    """Whether no tensor is among ``values`` (an op's keyword values, or a list argument such
    as layer_norm's ``normalized_shape``): then the fast path types the op by its positional
    tensors alone (``is_causal=True``, ``dim=-1``)."""
    for v in values:
        if isinstance(v, Tensor) or type(v) is list or type(v) is tuple:
            return False
    return True


def _stamp_inner(ctx: TrackedContext, x: torch.Tensor, stamp) -> None:
    """Stamp the tensors a torch.func transform wrapped ``x`` around, and remember the
    innermost one's storage: the transform returns the unwrapped tensor (or a view of it) to
    the per-device function, which must keep the type (an unstamped tensor reads as
    invariant, and a varying value typed invariant is silently wrong)."""
    while _is_wrapped(x):
        x = _unwrap(x)
        x.__dict__[_ATTR] = stamp
    if stamp[1] is not INVARIANT and not x.is_meta:
        base = _view_base(x)
        held = None if base is None else base.__dict__.get(_ATTR)
        if base is not None and (held is None or held[0] is not ctx.call_token):
            # x aliases a tensor typed otherwise (a pvary is a view of its operand): that one
            # keeps its own type, which the storage would no longer tell. A stamp of another
            # call (the caller's tensor, typed in an earlier call) is no type here: replaced.
            base.__dict__[_ATTR] = ctx.stamp_of(ctx.vma(base))
        ctx.transform_results[x.untyped_storage().data_ptr()] = (x, stamp)
