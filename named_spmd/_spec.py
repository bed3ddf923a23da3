"""PartitionSpec: one entry per leading tensor dim, each None, an axis name or a tuple of names."""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from typing import Any

from . import _torch_private as torch_private
from ._errors import SpecError, suggest
from ._types import Vma, render


class Blocks:
    """A spec entry that splits a dim into blocks of given sizes: ``P(Blocks("x", (4, 3, 3)))``.

    ``axes`` is an axis name or a tuple of names (first major, as in a plain entry); ``sizes``
    gives one block size per member of their group, in row-major order, and must add up to the
    dim's size. A domain decomposition whose blocks are not ``torch.chunk``'s (the default for a
    dim the axes do not divide: ``ceil(n / k)`` each, the last ones smaller) says so with it.
    """

    __slots__ = ("axes", "sizes")

    def __init__(self, axes: str | tuple[str, ...], sizes: Any) -> None:
        names = (axes,) if isinstance(axes, str) else tuple(axes) if _names(axes) else None
        if not names:
            raise SpecError(
                f"Blocks(axes, sizes): axes must be an axis name or a tuple of names; got "
                f"{axes!r}. Fix: write e.g. Blocks('x', (4, 3, 3))."
            )
        try:
            counts = tuple(operator.index(s) for s in sizes)
        except TypeError:
            counts = None
        if counts is None or any(s < 0 for s in counts):
            raise SpecError(
                f"Blocks({axes!r}, {sizes!r}): sizes must be a sequence of non-negative "
                "integers, one block size per member of the axes' group. Fix: write e.g. "
                "Blocks('x', (4, 3, 3))."
            )
        self.axes: tuple[str, ...] = names
        self.sizes: tuple[int, ...] = counts

    def __repr__(self) -> str:
        axes = self.axes[0] if len(self.axes) == 1 else self.axes
        return f"Blocks({axes!r}, {self.sizes!r})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Blocks):
            return NotImplemented
        return self.axes == other.axes and self.sizes == other.sizes

    def __hash__(self) -> int:
        return hash((Blocks, self.axes, self.sizes))

    def __reduce__(self) -> tuple[Any, ...]:
        return (Blocks, (self.axes, self.sizes))


def _names(axes: object) -> bool:
    return isinstance(axes, (tuple, list)) and all(isinstance(a, str) for a in axes)


SpecEntry = None | str | tuple[str, ...] | Blocks


def _canonical_entry(entry: object) -> SpecEntry:
    if entry is None or isinstance(entry, (str, Blocks)):
        return entry
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        names = tuple(entry)
        if len(names) == 0:
            return None
        return names[0] if len(names) == 1 else names
    raise SpecError(
        f"P(...) entries must be None, an axis name or a tuple of axis names; got {entry!r}. "
        "Fix: write e.g. P('dp', None) or P(('dp', 'tp'))."
    )


class PartitionSpec(tuple):
    """How a tensor is split over mesh axes: ``P('dp', None)``, ``P(('dp', 'tp'))``, ``P()``.

    Entry ``d`` says how tensor dim ``d`` is split: ``None`` (not split), an axis name (split into
    ``size(axis)`` equal blocks) or a tuple of names (split into ``prod(sizes)`` blocks, first name
    major). Missing trailing entries mean ``None``; ``P()`` is fully replicated.

    ``unreduced`` and ``reduced`` name axes over which the value is a partial sum (each instance
    holds a part; an output's parts are summed) or reduced (one value whose gradient is left
    unreduced): docs/design.md section 2.2.
    """

    unreduced: frozenset[str]
    reduced: frozenset[str]

    def __new__(cls, *entries: object, unreduced: Any = (), reduced: Any = ()) -> PartitionSpec:
        spec = super().__new__(cls, tuple(_canonical_entry(e) for e in entries))
        spec.unreduced = _axis_set(unreduced, "unreduced")
        spec.reduced = _axis_set(reduced, "reduced")
        return spec

    def __repr__(self) -> str:
        extra = [f"{k}={set(sorted(v))!r}" for k, v in self._states() if v]
        return "P(" + ", ".join([repr(e) for e in self] + extra) + ")"

    def _states(self) -> tuple[tuple[str, frozenset[str]], ...]:
        return (("unreduced", self.unreduced), ("reduced", self.reduced))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, tuple):
            return NotImplemented
        if not tuple.__eq__(self, other):
            return False
        if isinstance(other, PartitionSpec):
            return self.unreduced == other.unreduced and self.reduced == other.reduced
        return not self.unreduced and not self.reduced

    def __ne__(self, other: object) -> bool:
        eq = self.__eq__(other)
        return eq if eq is NotImplemented else not eq

    def __hash__(self) -> int:
        if not self.unreduced and not self.reduced:
            return tuple.__hash__(self)
        return hash((tuple(self), self.unreduced, self.reduced))

    def _repr_html_(self) -> str:
        return render("spec_html", self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickling and copy: the canonical constructor
        if not self.unreduced and not self.reduced:
            return (PartitionSpec, tuple(self))
        return (_make_spec, (tuple(self), self.unreduced, self.reduced))

    def entry_axes(self, dim: int) -> tuple[str, ...]:
        """Axis names that split ``dim`` (major first); () when not split."""
        if dim >= len(self):
            return ()
        e = self[dim]
        if e is None:
            return ()
        if isinstance(e, str):
            return (e,)
        return e.axes if isinstance(e, Blocks) else e

    def entry_sizes(self, dim: int) -> tuple[int, ...] | None:
        """The block sizes a :class:`Blocks` entry gives ``dim``; None for any other entry."""
        e = self[dim] if dim < len(self) else None
        return e.sizes if isinstance(e, Blocks) else None

    @property
    def explicit(self) -> bool:
        """Whether an entry gives its block sizes (:class:`Blocks`); computed once per spec."""
        explicit = self.__dict__.get("_explicit")
        if explicit is None:
            explicit = _memo(self, "_explicit", any(isinstance(e, Blocks) for e in self))
        return explicit

    def without_sizes(self) -> PartitionSpec:
        """This spec with each :class:`Blocks` entry replaced by its axes."""
        if not self.explicit:
            return self
        entries = [e.axes if isinstance(e, Blocks) else e for e in self]
        return PartitionSpec(*entries, unreduced=self.unreduced, reduced=self.reduced)

    def vma(self) -> Vma:
        """The type of a value under this spec: varying over the axes that split it, unreduced
        and reduced over those it names so."""
        vma = self.__dict__.get("_vma")  # computed once per spec: read for every input leaf
        if vma is None:
            if not self.unreduced and not self.reduced:
                vma = Vma.of(self.axes)
            else:
                vma = Vma.make(self.axes, self.unreduced, self.reduced)
            _memo(self, "_vma", vma)
        return vma

    @property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec names, in order of appearance (computed once per spec: read on
        every call, for every input and output leaf). Not ``functools.cached_property``: on
        Python 3.11 it takes a lock, which torch.compile cannot trace."""
        axes = self.__dict__.get("_axes")
        if axes is None:
            axes = _memo(
                self, "_axes", tuple(a for d in range(len(self)) for a in self.entry_axes(d))
            )
        return axes


def _memo(spec: PartitionSpec, name: str, value: Any) -> Any:
    """``value`` kept on ``spec`` for its next reads; not while Dynamo traces, to which a write
    to a spec the mapped function holds is a side effect (``torch.export`` warns of it)."""
    if not torch_private.memo_would_be_guarded():
        spec.__dict__[name] = value
    return value


P = PartitionSpec


def output_settles(
    vma: Vma, spec: PartitionSpec, order: tuple[str, ...], single: frozenset[str] = frozenset()
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """What the boundary settles for an output of type ``vma`` under ``spec``, as axes in
    ``order`` (those of ``single``, size 1, aside: their members are all one instance). An axis
    the spec names or declares unreduced keeps each instance's value (a block, or a part of the
    sum); any other axis returns one value. ``(unkept, copies)``:

    * ``unkept``: the instances may differ there (varying, or unreduced), but the spec keeps one
      value (only under ``check_vma=False``): the value of the instance at coordinate 0;
    * ``copies``: the spec keeps every instance's value, but they hold one (invariant, or
      reduced): each copy is a block (tiled) or a part (summed, n times the value), and the
      copies' cotangents differ, so the backward sums them (a psum over ``copies``)."""
    unkept: list[str] = []
    copies: list[str] = []
    for a in order:
        if a in single:
            continue
        differ = a in vma.varying or a in vma.unreduced
        kept = a in spec.axes or a in spec.unreduced
        if differ and not kept:
            unkept.append(a)
        elif kept and not differ:
            copies.append(a)
    return tuple(unkept), tuple(copies)


def _make_spec(entries: tuple, unreduced: frozenset[str], reduced: frozenset[str]) -> PartitionSpec:
    return PartitionSpec(*entries, unreduced=unreduced, reduced=reduced)


def _axis_set(axes: Any, what: str) -> frozenset[str]:
    if isinstance(axes, str):
        return frozenset((axes,))
    if isinstance(axes, (tuple, list, set, frozenset)) and all(isinstance(a, str) for a in axes):
        return frozenset(axes)
    raise SpecError(
        f"P(..., {what}=...) takes an axis name or a set of names; got {axes!r}. "
        f"Fix: write e.g. P('dp', {what}={{'tp'}})."
    )


def spec_problems(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    mesh_shape: Mapping[str, int],
    where: str,
    uneven: bool = False,
    given: bool | None = None,
    shown: Sequence[Any] | None = None,
) -> list[str]:
    """Every way ``spec`` fails to fit a tensor of ``shape`` on the mesh (empty list: it fits).
    ``uneven``: the caller takes a dim the axes do not divide (``torch.chunk``'s blocks,
    ``_layout.dim_sizes``); ``given`` (default: ``uneven``): it takes the unequal sizes a
    :class:`Blocks` entry gives, on that entry's dim. ``shown`` (default: ``shape``): the
    tensor's shape as the messages name it, where ``shape`` stands in for it."""
    given = uneven if given is None else given
    shown = shape if shown is None else shown
    if torch_private.memo_would_be_guarded():
        # (the memo's lookup also specialized the dims; dims left symbolic break the real
        # mesh's block arithmetic)
        specialize(shape)
        return _spec_problems(spec, shape, mesh_shape, where, uneven, given, shown)
    key = (spec, tuple(shape), tuple(mesh_shape.items()), uneven, given)
    if key in _fits:  # checked on every call: remember what fitted
        return []
    problems = _spec_problems(spec, shape, mesh_shape, where, uneven, given, shown)
    if not problems:
        if len(_fits) > 4096:
            _fits.clear()
        _fits.add(key)
    return problems


_fits: set[tuple] = set()


def specialize(shape: Any) -> None:
    """While Dynamo traces: make it specialize the dims of ``shape`` (hashing them does; after a
    shape change Dynamo would otherwise make them symbolic). The compile paths trace static
    shapes."""
    hash(tuple(shape))


def _spec_problems(
    spec: PartitionSpec,
    shape: tuple[int, ...],
    mesh_shape: Mapping[str, int],
    where: str,
    uneven: bool,
    takes_given: bool,
    shown: Sequence[Any],
) -> list[str]:
    problems = []
    if len(spec) > len(shape):
        problems.append(
            f"{where}: {spec!r} has {len(spec)} entries but the tensor has rank {len(shape)} "
            f"(shape {_shape_text(shown)}). Fix: give at most {len(shape)} entries"
            + (" (a rank-0 value can only take P())." if len(shape) == 0 else ".")
        )
        return problems
    seen: set[str] = set()
    problems += _state_problems(spec, mesh_shape, where)
    for d in range(len(spec)):
        axes = spec.entry_axes(d)
        for a in axes:
            if a not in mesh_shape:
                problems.append(
                    f"{where}: unknown mesh axis {a!r} in {spec!r}; the mesh has axes "
                    f"{tuple(mesh_shape)}.{suggest(a, mesh_shape)} Fix: name one of those axes, "
                    "or add the axis to the mesh."
                )
            elif a in seen:
                problems.append(
                    f"{where}: axis {a!r} appears more than once in {spec!r}; an axis can split "
                    "at most one dim. Fix: name it once, or use a tuple entry like P(('dp', 'tp'))."
                )
            seen.add(a)
        if axes and all(a in mesh_shape for a in axes):
            problems += _split_problems(
                spec, d, shape[d], axes, mesh_shape, where, uneven, takes_given
            )
    return problems


def _shape_text(shape: Sequence[Any]) -> str:
    """``[5, 3]``; ``[?]`` where the sizes are not known yet (``_types.shape_shown``)."""
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _split_problems(
    spec: PartitionSpec,
    d: int,
    size: int,
    axes: tuple[str, ...],
    mesh_shape: Mapping[str, int],
    where: str,
    uneven: bool,
    takes_given: bool,
) -> list[str]:
    """How dim ``d`` of size ``size`` fails to split over ``axes``: explicit block sizes that do
    not add up, or (where the caller takes only equal blocks) blocks of unequal sizes."""
    n = math.prod([mesh_shape[a] for a in axes])  # (a list: Dynamo traces this)
    given = spec.entry_sizes(d)
    if given is None and (size % n == 0 or uneven):  # the common case, also while traced
        return []
    if given is not None:
        if len(given) != n or sum(given) != size:
            group = " * ".join(f"{a}={mesh_shape[a]}" for a in axes)
            return [
                f"{where}: {spec[d]!r} gives dim {d} {len(given)} blocks adding up to "
                f"{sum(given)}, but the dim has size {size} and its group has {n} members "
                f"({group}). Fix: give {n} block sizes that add up to {size}."
            ]
        if takes_given or len(set(given)) <= 1:
            return []
        return [
            f"{where}: {spec[d]!r} gives dim {d} blocks of unequal sizes; this backend splits "
            f"dims into equal blocks only. Fix: give equal sizes, or pad dim {d} to a multiple "
            f"of {n}."
        ]
    group = " * ".join(f"{a}={mesh_shape[a]}" for a in axes)
    return [
        f"{where}: dim {d} has size {size}, not divisible by {n} ({group}) as "
        f"{spec!r} requires. Fix: pad dim {d} to a multiple of {n}, or split another dim."
    ]


def _state_problems(spec: PartitionSpec, mesh_shape: Mapping[str, int], where: str) -> list[str]:
    """Unknown axes in ``unreduced`` / ``reduced``, or an axis given two states."""
    problems = []
    for what, axes in spec._states():
        for a in sorted(axes):
            if a not in mesh_shape:
                problems.append(
                    f"{where}: unknown mesh axis {a!r} in {what}= of {spec!r}; the mesh has axes "
                    f"{tuple(mesh_shape)}.{suggest(a, mesh_shape)} Fix: name one of those axes."
                )
    both = (spec.unreduced & spec.reduced) | ((spec.unreduced | spec.reduced) & set(spec.axes))
    if both:
        problems.append(
            f"{where}: axes {tuple(sorted(both))} are given two states in {spec!r} (an axis "
            "splits a dim, or is unreduced, or reduced). Fix: name each axis once."
        )
    return problems


def given_sizes_problems(spec: PartitionSpec, shape: tuple[int, ...], where: str) -> list[str]:
    """The sizes an out_spec's ``Blocks`` entries give, for an execution whose blocks all have
    the local block's ``shape`` (an uneven execution checks each instance's block instead)."""
    problems = []
    for d in range(min(len(spec), len(shape))):
        given = spec.entry_sizes(d)
        if given is not None and set(given) != {shape[d]}:
            problems.append(
                f"{where}: {spec[d]!r} gives dim {d} blocks of sizes {given}, but every block "
                f"has size {shape[d]} there. Fix: give the sizes the blocks have, or name the "
                "axes without sizes (their blocks are concatenated whatever their sizes)."
            )
    return problems
