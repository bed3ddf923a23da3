"""Mesh: an ordered set of named axes with sizes (a value type; ``make_mesh`` is in ``_api``).

A plain :class:`Mesh` is simulated in this process; the distributed backend subclasses it for a
mesh backed by a ``DeviceMesh``. Which backend runs a call is the backend registry's choice
(``backends.backend_for``), not the mesh's.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from ._errors import SpmdError, suggest
from ._layout import coords_of
from ._types import render


class Mesh:
    """Named mesh axes with sizes. ``kind`` is ``"simulated"`` or ``"distributed"``.

    A simulated mesh runs every instance inside this process (nested ``torch.func.vmap``); a
    distributed one wraps a ``torch.distributed.device_mesh.DeviceMesh`` with named dims.
    """

    def __init__(
        self,
        shape: Sequence[int],
        axis_names: Sequence[str],
        *,
        device_mesh: Any = None,
        device_type: str = "cpu",
    ):
        shape = tuple(shape)
        if not all(_is_index(s) for s in shape):  # int() would truncate 2.5 to 2 silently
            raise SpmdError(
                f"make_mesh: axis sizes must be integers, got {shape}. Fix: e.g. "
                "make_mesh((2, 4), ('dp', 'tp'))."
            )
        shape = tuple(int(s) for s in shape)
        axis_names = tuple(axis_names)
        problems = []
        if len(shape) != len(axis_names):
            problems.append(f"{len(shape)} sizes {shape} but {len(axis_names)} names {axis_names}")
        if any(not isinstance(a, str) or not a for a in axis_names):
            problems.append(f"axis names must be non-empty strings, got {axis_names}")
        if len(set(axis_names)) != len(axis_names):
            problems.append(f"axis names must be unique, got {axis_names}")
        if any(s < 1 for s in shape):
            problems.append(f"axis sizes must be positive, got {shape}")
        if problems:
            raise SpmdError(
                "make_mesh: " + "; ".join(problems) + ". Fix: e.g. make_mesh((2, 4), ('dp', 'tp'))."
            )
        self._shape = dict(zip(axis_names, shape))
        # (read several times per call and per collective: made once)
        self._names, self._size = axis_names, math.prod(shape)
        #: the axes of size 1: a group of them is one instance, with nothing to exchange
        self.single_axes = frozenset(a for a, n in self._shape.items() if n == 1)
        self.device_mesh = device_mesh
        self.device_type = device_type

    @property
    def kind(self) -> str:
        return "simulated" if self.device_mesh is None else "distributed"

    @property
    def shape(self) -> dict[str, int]:
        """Ordered ``{axis name: size}``."""
        return dict(self._shape)

    @property
    def axis_names(self) -> tuple[str, ...]:
        return self._names

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self._shape.values())

    @property
    def size(self) -> int:
        """Number of instances (devices): the product of the axis sizes."""
        return self._size

    def axis_size(self, axes: str | Sequence[str]) -> int:
        size = 1  # (a loop, not comprehensions: read by collectives inside calls)
        for a in (axes,) if isinstance(axes, str) else axes:
            n = self._shape.get(a)
            if n is None:
                raise SpmdError(
                    f"Mesh.axis_size: unknown axis {a!r}; the mesh has axes "
                    f"{self.axis_names}.{suggest(a, self.axis_names)}"
                )
            size *= n
        return size

    def coords(self, linear_index: int) -> dict[str, int]:
        """Mesh coordinates of the instance with row-major ``linear_index``."""
        if not 0 <= linear_index < self.size:
            raise SpmdError(
                f"Mesh.coords: linear index {linear_index} is out of range for {self!r} "
                f"({self.size} instances). Fix: pass 0..{self.size - 1}."
            )
        return coords_of(linear_index, self.axis_names, self._shape)

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, Mesh)
            and self._shape == other._shape
            and self.device_mesh is other.device_mesh
        )

    def __hash__(self) -> int:
        return hash((tuple(self._shape.items()), id(self.device_mesh)))

    def __repr__(self) -> str:
        axes = ", ".join(f"{a}={s}" for a, s in self._shape.items())
        where = "" if self.kind == "simulated" else f", {self.device_type}"
        return f"Mesh({axes}; {self.kind}{where})"

    def _repr_html_(self) -> str:
        return render("mesh_html", self)


def _is_index(s: Any) -> bool:
    """An integer size that is not a bool (numpy and 0-dim integer tensors included)."""
    if isinstance(s, bool):
        return False
    try:
        operator.index(s)
    except TypeError:
        return False
    return True
