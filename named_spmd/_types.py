"""The type of a value inside spmd_map: its per-axis states (:class:`Vma`) and :class:`VType`.

A value's *vma* says, per mesh axis, how the instances' copies relate: **varying** (they may
differ), **invariant** (provably identical, the default for every axis not listed),
**unreduced** (each instance holds a partial sum of the true value) or **reduced** (one value,
whose gradient is a partial sum). Every rule of the type system (docs/design.md section 2)
is written with :class:`Vma`'s algebra, never with set arithmetic at the call site.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

from . import _torch_private as torch_private
from ._torch_private import trace_constant

_SHORT_DTYPES = {
    torch.float64: "f64",
    torch.float32: "f32",
    torch.float16: "f16",
    torch.bfloat16: "bf16",
    torch.int64: "i64",
    torch.int32: "i32",
    torch.int16: "i16",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "bool",
    torch.complex64: "c64",
    torch.complex128: "c128",
}


def short_dtype(dtype: torch.dtype) -> str:
    return _SHORT_DTYPES.get(dtype, str(dtype).replace("torch.", ""))


class Vma:
    """The per-axis states of a value: the axes it varies over, the axes over which it is
    unreduced (``U``) or reduced (``R``); invariant over the rest.

    Immutable and interned: ``Vma.of(axes)`` (varying only) and ``Vma.make(v, u, r)`` return one
    object per states, so equal types compare (and cache) by identity, and the results of the
    algebra are memoized. A ``Vma`` without U or R axes compares equal to the ``frozenset`` of
    its varying axes (what ``ns.vma`` returns). ``partial`` says whether it has U or R axes: the
    hot paths test that one flag and take the two-state rules otherwise.
    """

    __slots__ = (
        "varying",
        "unreduced",
        "reduced",
        "partial",
        "_hash",
        "_union",
        "_remove",
        "_add",
        "_to_state",
    )
    _interned: dict[frozenset[str], Vma] = {}
    _interned_partial: dict[tuple[frozenset[str], frozenset[str], frozenset[str]], Vma] = {}

    varying: frozenset[str]
    unreduced: frozenset[str]
    reduced: frozenset[str]
    partial: bool
    _hash: int
    _union: dict[Vma, Vma]  # memos of the algebra
    _remove: dict[tuple[str, ...], Vma]
    _add: dict[tuple[str, ...], Vma]
    _to_state: dict[tuple[Any, str], Vma]

    def __new__(cls, varying: Iterable[str] = ()) -> Vma:
        return cls.of(varying)

    @classmethod
    def of(cls, varying: Iterable[str]) -> Vma:
        key = varying if type(varying) is frozenset else frozenset(varying)
        found = cls._interned.get(key)
        if found is None:
            found = cls._interned.setdefault(key, cls._new(key, _EMPTY, _EMPTY))
        return found

    @classmethod
    def make(
        cls, varying: Iterable[str], unreduced: Iterable[str] = (), reduced: Iterable[str] = ()
    ) -> Vma:
        """The type varying over ``varying``, unreduced over ``unreduced``, reduced over
        ``reduced`` (three disjoint sets of axes)."""
        v, u, r = frozenset(varying), frozenset(unreduced), frozenset(reduced)
        if not u and not r:
            return cls.of(v)
        if v & u or v & r or u & r:
            raise ValueError(f"an axis has one state: varying={v}, unreduced={u}, reduced={r}")
        key = (v, u, r)
        found = cls._interned_partial.get(key)
        if found is None:
            found = cls._interned_partial.setdefault(key, cls._new(v, u, r))
        return found

    @classmethod
    def _new(cls, v: frozenset[str], u: frozenset[str], r: frozenset[str]) -> Vma:
        found = object.__new__(cls)
        for name, value in (("varying", v), ("unreduced", u), ("reduced", r)):
            object.__setattr__(found, name, value)
        object.__setattr__(found, "partial", bool(u or r))
        object.__setattr__(found, "_hash", hash(v) if not (u or r) else hash((v, u, r)))
        for memo in ("_union", "_remove", "_add", "_to_state"):
            object.__setattr__(found, memo, {})
        return found

    # interned: a change to one would change every value of that type
    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Vma is immutable")

    def __delattr__(self, name: str) -> None:
        raise AttributeError("Vma is immutable")

    def __reduce__(self) -> tuple[Any, ...]:  # pickling and copying keep the interning
        return (Vma.make, (self.varying, self.unreduced, self.reduced))

    # --- the algebra ------------------------------------------------------------------------
    def union(self, other: Vma) -> Vma:
        """The type of an op's result: varying wherever some operand varies (rule 2). With U or
        R axes this is only the bookkeeping (varying wins over reduced); whether the op may mix
        those states at all is ``_partial.combine``'s question."""
        if other is self:
            return self
        found = self._union.get(other)
        if found is None:
            v = self.varying | other.varying
            if not self.partial and not other.partial:
                found = Vma.of(v)
            else:
                u = (self.unreduced | other.unreduced) - v
                found = Vma.make(v, u, (self.reduced | other.reduced) - v - u)
            self._union[other] = found
        return found

    def remove(self, axes: tuple[str, ...]) -> Vma:
        """Invariant over ``axes`` where it varies or is unreduced there (what a reduction over
        them gives); reduced axes stay reduced."""
        found = self._remove.get(axes)
        if found is None:
            v = self.varying.difference(axes)
            found = Vma.make(v, self.unreduced.difference(axes), self.reduced)
            self._remove[axes] = found
        return found

    def add(self, axes: tuple[str, ...]) -> Vma:
        """Varying over ``axes`` too (what a pvary, a cast to varying or a scatter gives)."""
        found = self._add.get(axes)
        if found is None:
            v = self.varying.union(axes)
            if not self.partial:
                found = Vma.of(v)
            else:
                found = Vma.make(v, self.unreduced.difference(axes), self.reduced.difference(axes))
            self._add[axes] = found
        return found

    def to_state(self, axes: Iterable[str], state: str) -> Vma:
        """The same type with ``axes`` moved to ``state`` ("varying", "invariant", "unreduced"
        or "reduced"): the casts' rule (a partial sum's collective asks it on every call)."""
        if torch_private.memo_would_be_guarded():
            return self._state_made(frozenset(axes), state)
        try:
            return self._to_state[axes, state]
        except (KeyError, TypeError):  # (not yet, or ``axes`` unhashable: a list)
            pass
        found = self._state_made(frozenset(axes), state)
        if isinstance(axes, (frozenset, tuple)):
            self._to_state[axes, state] = found
        return found

    def _state_made(self, axes: frozenset[str], state: str) -> Vma:
        v, u, r = self.varying - axes, self.unreduced - axes, self.reduced - axes
        if state == "varying":
            v |= axes
        elif state == "unreduced":
            u |= axes
        elif state == "reduced":
            r |= axes
        return Vma.make(v, u, r)

    def state(self, axis: str) -> str:
        """``axis``' state: "varying", "unreduced", "reduced" or "invariant"."""
        if axis in self.varying:
            return "varying"
        if axis in self.unreduced:
            return "unreduced"
        if axis in self.reduced:
            return "reduced"
        return "invariant"

    def covers(self, axes: Iterable[str]) -> bool:
        """Whether the value varies over every axis of ``axes``."""
        return self.varying.issuperset(axes)

    def missing(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The axes of ``axes`` (in their order) the value does not vary over."""
        return tuple(a for a in axes if a not in self.varying)

    def present(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The axes of ``axes`` (in their order) the value varies over."""
        return tuple(a for a in axes if a in self.varying)

    def __le__(self, other: Vma | Iterable[str]) -> bool:
        """Subset: every axis this value varies over is allowed by ``other``."""
        allowed = other.varying if isinstance(other, Vma) else frozenset(other)
        return self.varying <= allowed

    # --- container protocol (the varying axes) ---------------------------------------------
    def __contains__(self, axis: object) -> bool:
        return axis in self.varying

    def __iter__(self) -> Iterator[str]:
        return iter(self.varying)

    def __len__(self) -> int:
        return len(self.varying)

    def __bool__(self) -> bool:  # anything but invariant everywhere
        return bool(self.varying) or self.partial

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, Vma):
            return False  # interned: equal types are one object
        if isinstance(other, (frozenset, set)):
            return not self.partial and self.varying == other
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def text(self, axis_order: Iterable[str] = ()) -> str:
        """``{dp,tp}`` (varying axes), ``{dp, U:tp, R:ep}`` with U and R axes; axes in mesh
        order when given, else sorted."""
        order = {a: i for i, a in enumerate(axis_order)}

        def names(axes: frozenset[str]) -> str:
            return ",".join(sorted(axes, key=lambda a: (order.get(a, len(order)), a)))

        parts = [names(self.varying)] if self.varying else []
        parts += [f"U:{names(self.unreduced)}"] if self.unreduced else []
        parts += [f"R:{names(self.reduced)}"] if self.reduced else []
        return "{" + ", ".join(parts) + "}"

    def __repr__(self) -> str:
        return f"Vma({self.text()})"


_EMPTY: frozenset[str] = frozenset()
INVARIANT = Vma.of(frozenset())


def vma_text(vma: Iterable[str], axis_order: Iterable[str] = ()) -> str:
    """``{dp,tp}``: see :meth:`Vma.text`."""
    return (vma if isinstance(vma, Vma) else Vma.of(vma)).text(axis_order)


class VType:
    """``f32[8,4]{dp}``: dtype, per-device shape, and the mesh axes the value varies over."""

    __slots__ = ("dtype", "shape", "vma", "axis_order")

    dtype: torch.dtype
    shape: tuple[int, ...]
    vma: Vma
    axis_order: tuple[str, ...]

    def __init__(
        self,
        dtype: torch.dtype,
        shape: Iterable[int],
        vma: Vma | Iterable[str],
        axis_order: Iterable[str] = (),
    ) -> None:
        object.__setattr__(self, "dtype", dtype)
        object.__setattr__(self, "shape", tuple(shape))
        object.__setattr__(self, "vma", vma if isinstance(vma, Vma) else Vma.of(vma))
        object.__setattr__(self, "axis_order", tuple(axis_order))

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("VType is immutable")

    def _key(self) -> tuple:
        return (self.dtype, self.shape, self.vma, self.axis_order)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, VType) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        dims = ",".join(str(s) for s in self.shape)
        return f"{short_dtype(self.dtype)}[{dims}]{self.vma.text(self.axis_order)}"

    def _repr_html_(self) -> str:
        return render("vtype_html", self)


#: Renderers by kind ("vtype_html", "check_text", ...). ``_display``, a higher layer, fills this
#: when the package loads, so value types render without importing upward.
RENDERERS: dict[str, Callable[[Any], str]] = {}


def render(kind: str, value: Any) -> str:
    """The one way value types reach the renderers registered in :data:`RENDERERS`."""
    return RENDERERS[kind](value)


def data_dependent(t: torch.Tensor) -> bool:
    """Whether Dynamo traces ``t`` with a size known only when the program runs (which it can
    neither format nor specialize)."""
    return torch_private.memo_would_be_guarded() and torch_private.has_data_dependent_size(t)


def shape_shown(t: torch.Tensor) -> tuple:
    """A tensor's shape as a message names it: ``?`` for each dim of a data-dependent size."""
    return ("?",) * t.dim() if data_dependent(t) else tuple(t.shape)


@trace_constant  # Dynamo cannot build the slotted VType: run eagerly at trace time
def type_text(dtype: torch.dtype, shape: tuple[int, ...], vma: Vma, order: tuple[str, ...]) -> str:
    """``repr(VType(...))``: how error messages write a value's type."""
    return repr(VType(dtype, shape, vma, order))
