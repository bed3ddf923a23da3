"""Mesh: an ordered set of named axes with sizes, simulated in-process or backed by a DeviceMesh."""

from __future__ import annotations

import math
import operator
from collections.abc import Sequence
from typing import Any

from ._errors import SpmdError, suggest


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
        return tuple(self._shape)

    @property
    def axis_sizes(self) -> tuple[int, ...]:
        return tuple(self._shape.values())

    @property
    def size(self) -> int:
        """Number of instances (devices): the product of the axis sizes."""
        return math.prod(self._shape.values())

    def axis_size(self, axes: str | Sequence[str]) -> int:
        names = (axes,) if isinstance(axes, str) else tuple(axes)
        unknown = [a for a in names if a not in self._shape]
        if unknown:
            raise SpmdError(
                f"Mesh.axis_size: unknown axis {unknown[0]!r}; the mesh has axes "
                f"{self.axis_names}.{suggest(unknown[0], self.axis_names)}"
            )
        return math.prod(self._shape[a] for a in names)

    def coords(self, linear_index: int) -> dict[str, int]:
        """Mesh coordinates of the instance with row-major ``linear_index``."""
        if not 0 <= linear_index < self.size:
            raise SpmdError(
                f"Mesh.coords: linear index {linear_index} is out of range for {self!r} "
                f"({self.size} instances). Fix: pass 0..{self.size - 1}."
            )
        out = {}
        for name in reversed(self.axis_names):
            linear_index, out[name] = divmod(linear_index, self._shape[name])
        return dict(reversed(list(out.items())))

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
        from ._display import mesh_html

        return mesh_html(self)


def _is_index(s: Any) -> bool:
    """An integer size that is not a bool (numpy and 0-dim integer tensors included)."""
    if isinstance(s, bool):
        return False
    try:
        operator.index(s)
    except TypeError:
        return False
    return True


def _distributed_ready() -> bool:
    import sys

    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def make_mesh(
    shape: Sequence[int] | int,
    axis_names: Sequence[str] | str,
    *,
    device_type: str | None = None,
    simulated: bool | None = None,
) -> Mesh:
    """Make a mesh: simulated in this process unless ``torch.distributed`` is initialized.

    Args:
        shape: axis sizes, e.g. ``(2, 4)``.
        axis_names: one name per axis, e.g. ``("dp", "tp")``.
        device_type: for a real mesh, ``"cpu"`` (gloo) or ``"cuda"`` (NCCL); default: the
            process group's backend decides.
        simulated: force a simulated mesh (True) or a real one (False); default: real exactly
            when a process group is initialized.

    Example:
        >>> mesh = make_mesh((2, 4), ("dp", "tp"))
        >>> mesh.shape
        {'dp': 2, 'tp': 4}
    """
    if isinstance(shape, int):
        shape = (shape,)
    if isinstance(axis_names, str):
        axis_names = (axis_names,)
    want_real = _distributed_ready() if simulated is None else not simulated
    if not want_real:
        return Mesh(shape, axis_names, device_type=device_type or "cpu")
    from .backends.distributed import make_distributed_mesh

    return make_distributed_mesh(tuple(shape), tuple(axis_names), device_type)


def as_mesh(mesh: Any, where: str) -> Mesh:
    """Accept a Mesh or a user's DeviceMesh with mesh_dim_names."""
    if isinstance(mesh, Mesh):
        return mesh
    if type(mesh).__name__ == "DeviceMesh":
        from .backends.distributed import mesh_from_device_mesh

        return mesh_from_device_mesh(mesh)
    raise SpmdError(
        f"{where}: mesh= must be a named_spmd Mesh or a DeviceMesh with mesh_dim_names, got "
        f"{type(mesh).__name__}. Fix: mesh = named_spmd.make_mesh((2, 4), ('dp', 'tp'))."
    )
