"""PartitionSpec: one entry per leading tensor dim, each None, an axis name or a tuple of names."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from ._errors import SpecError, suggest
from ._types import render

SpecEntry = None | str | tuple[str, ...]


def _canonical_entry(entry: object) -> SpecEntry:
    if entry is None or isinstance(entry, str):
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
    """

    def __new__(cls, *entries: object) -> PartitionSpec:
        return super().__new__(cls, tuple(_canonical_entry(e) for e in entries))

    def __repr__(self) -> str:
        return "P(" + ", ".join(repr(e) for e in self) + ")"

    def _repr_html_(self) -> str:
        return render("spec_html", self)

    def __reduce__(self) -> tuple[Any, ...]:  # pickling and copy: the canonical constructor
        return (PartitionSpec, tuple(self))

    def entry_axes(self, dim: int) -> tuple[str, ...]:
        """Axis names that split ``dim`` (major first); () when not split."""
        if dim >= len(self):
            return ()
        e = self[dim]
        if e is None:
            return ()
        return (e,) if isinstance(e, str) else e

    @functools.cached_property
    def axes(self) -> tuple[str, ...]:
        """Every axis the spec names, in order of appearance (computed once per spec: read on
        every call, for every input and output leaf)."""
        return tuple(a for d in range(len(self)) for a in self.entry_axes(d))


P = PartitionSpec


def spec_problems(
    spec: PartitionSpec, shape: tuple[int, ...], mesh_shape: Mapping[str, int], where: str
) -> list[str]:
    """Every way ``spec`` fails to fit a tensor of ``shape`` on the mesh (empty list: it fits)."""
    key = (spec, tuple(shape), tuple(mesh_shape.items()))
    if key in _fits:  # checked on every call: remember what fitted
        return []
    problems = _spec_problems(spec, shape, mesh_shape, where)
    if not problems:
        if len(_fits) > 4096:
            _fits.clear()
        _fits.add(key)
    return problems


_fits: set[tuple] = set()


def _spec_problems(
    spec: PartitionSpec, shape: tuple[int, ...], mesh_shape: Mapping[str, int], where: str
) -> list[str]:
    problems = []
    if len(spec) > len(shape):
        problems.append(
            f"{where}: {spec!r} has {len(spec)} entries but the tensor has rank {len(shape)} "
            f"(shape {list(shape)}). Fix: give at most {len(shape)} entries"
            + (" (a rank-0 value can only take P())." if len(shape) == 0 else ".")
        )
        return problems
    seen: set[str] = set()
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
            n = 1
            for a in axes:
                n *= mesh_shape[a]
            if shape[d] % n != 0:
                sizes = " * ".join(f"{a}={mesh_shape[a]}" for a in axes)
                problems.append(
                    f"{where}: dim {d} has size {shape[d]}, not divisible by {n} ({sizes}) as "
                    f"{spec!r} requires. Fix: pad dim {d} to a multiple of {n}, or split another dim."
                )
    return problems
