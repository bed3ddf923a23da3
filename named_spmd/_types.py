"""The type of a value inside spmd_map: its per-axis states (:class:`Vma`) and :class:`VType`.

A value's *vma* says, per mesh axis, how the instances' copies relate: **varying** (they may
differ) or **invariant** (provably identical, the default for every axis not listed). Every rule
of the type system (docs/design.md section 2) is written with :class:`Vma`'s algebra, never with
set arithmetic at the call site, so a further per-axis state (a pending sum over an axis, see
the design's "what comes next") is added here without touching the rules' users.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

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
    """The per-axis states of a value: the mesh axes it varies over; invariant over the rest.

    Immutable and interned: ``Vma.of(axes)`` returns one object per set of axes, so equal types
    compare (and cache) by identity, and the results of the algebra are memoized. A ``Vma`` also
    compares equal to the ``frozenset`` of its varying axes (what ``ns.vma`` returns).
    """

    __slots__ = ("varying", "_hash", "_union", "_remove", "_add")
    _interned: dict[frozenset[str], Vma] = {}

    varying: frozenset[str]
    _hash: int
    _union: dict[Vma, Vma]  # memos of the algebra
    _remove: dict[tuple[str, ...], Vma]
    _add: dict[tuple[str, ...], Vma]

    def __new__(cls, varying: Iterable[str] = ()) -> Vma:
        return cls.of(varying)

    @classmethod
    def of(cls, varying: Iterable[str]) -> Vma:
        key = varying if type(varying) is frozenset else frozenset(varying)
        found = cls._interned.get(key)
        if found is None:
            found = object.__new__(cls)
            object.__setattr__(found, "varying", key)
            object.__setattr__(found, "_hash", hash(key))
            for memo in ("_union", "_remove", "_add"):
                object.__setattr__(found, memo, {})
            found = cls._interned.setdefault(key, found)
        return found

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("Vma is immutable")

    def __reduce__(self) -> tuple[Any, ...]:  # pickling and copying keep the interning
        return (Vma.of, (self.varying,))

    # --- the algebra ------------------------------------------------------------------------
    def union(self, other: Vma) -> Vma:
        """The type of an op's result: varying wherever some operand varies (rule 2)."""
        if other is self:
            return self
        found = self._union.get(other)
        if found is None:
            found = self._union[other] = Vma.of(self.varying | other.varying)
        return found

    def remove(self, axes: tuple[str, ...]) -> Vma:
        """Invariant over ``axes`` (what a reduction over them gives)."""
        found = self._remove.get(axes)
        if found is None:
            found = self._remove[axes] = Vma.of(self.varying.difference(axes))
        return found

    def add(self, axes: tuple[str, ...]) -> Vma:
        """Varying over ``axes`` too (what a pvary over them gives)."""
        found = self._add.get(axes)
        if found is None:
            found = self._add[axes] = Vma.of(self.varying.union(axes))
        return found

    def covers(self, axes: Iterable[str]) -> bool:
        """Whether the value varies over every axis of ``axes``."""
        return self.varying.issuperset(axes)

    def missing(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The axes of ``axes`` (in their order) the value is invariant over."""
        return tuple(a for a in axes if a not in self.varying)

    def present(self, axes: Iterable[str]) -> tuple[str, ...]:
        """The axes of ``axes`` (in their order) the value varies over."""
        return tuple(a for a in axes if a in self.varying)

    def __le__(self, other: Vma | Iterable[str]) -> bool:
        """Subset: every axis this value varies over is allowed by ``other``."""
        allowed = other.varying if isinstance(other, Vma) else frozenset(other)
        return self.varying <= allowed

    # --- container protocol -------------------------------------------------------------------
    def __contains__(self, axis: object) -> bool:
        return axis in self.varying

    def __iter__(self) -> Iterator[str]:
        return iter(self.varying)

    def __len__(self) -> int:
        return len(self.varying)

    def __bool__(self) -> bool:
        return bool(self.varying)

    def __eq__(self, other: object) -> bool:
        if other is self:
            return True
        if isinstance(other, Vma):
            return False  # interned: equal types are one object
        if isinstance(other, (frozenset, set)):
            return self.varying == other
        return NotImplemented

    def __hash__(self) -> int:
        return self._hash

    def text(self, axis_order: Iterable[str] = ()) -> str:
        """``{dp,tp}`` with axes in mesh order when given, else sorted."""
        order = {a: i for i, a in enumerate(axis_order)}
        names = sorted(self.varying, key=lambda a: (order.get(a, len(order)), a))
        return "{" + ",".join(names) + "}"

    def __repr__(self) -> str:
        return f"Vma({self.text()})"


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


def _type_repr(dtype: torch.dtype, shape: tuple[int, ...], vma: Vma, order: tuple[str, ...]) -> str:
    return repr(VType(dtype, shape, vma, order))


#: How error messages write a value's type. The real backend's compile path
#: (backends/_dist_compile.py) replaces the entry, on import, with a version that runs eagerly
#: while torch.compile traces (Dynamo cannot build the slotted ``VType``); wrapped here, it would
#: import Dynamo with named_spmd.
TYPE_TEXT = [_type_repr]


def type_text(dtype: torch.dtype, shape: tuple[int, ...], vma: Vma, order: tuple[str, ...]) -> str:
    """``repr(VType(...))`` for an error message (see :data:`TYPE_TEXT`)."""
    return TYPE_TEXT[0](dtype, shape, vma, order)
