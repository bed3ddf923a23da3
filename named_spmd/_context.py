"""The active spmd_map call: which mesh, which user function, which backend.

Collectives look up the innermost active call here; outside spmd_map there is none and they raise
a clear error instead of hanging or failing deep inside torch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from ._errors import CollectiveError, fn_label, suggest
from ._mesh import Mesh

_local = threading.local()


class SpmdContext:
    """What a collective needs from the running call. Backends subclass it."""

    def __init__(self, mesh: Mesh, fn: Any):
        self.mesh = mesh
        self.fn = fn
        self.fn_label = fn_label(fn)

    # --- backend interface -------------------------------------------------------------
    def vma(self, x: torch.Tensor) -> frozenset[str]:
        raise NotImplementedError

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        raise NotImplementedError

    def stamp(self, x: torch.Tensor, vma: frozenset[str] | set[str]) -> torch.Tensor:
        """Record ``x``'s vma where the backend tracks it per tensor; returns ``x``."""
        return x

    def psum_varying(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor | None:
        """``psum(x, axes)`` without the public layer's bookkeeping (checks, vma, accounting),
        where the backend can do that: ``x`` varies over every axis of ``axes``, the result's vma
        needs no stamping and no transform needs more. None otherwise (the default), and then
        the public layer takes its generic path. Only called while no CommMode records."""
        return None

    # --- shared helpers ----------------------------------------------------------------
    def check_axes(self, axis_name: str | Sequence[str], op: str) -> tuple[str, ...]:
        """Normalise an axis name or tuple of names; unknown or repeated names raise."""
        if isinstance(axis_name, str) and axis_name in self.mesh._shape:  # the common case
            return (axis_name,)
        names = self.mesh.axis_names
        try:
            axes = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
        except TypeError:  # an int, None, ...: not a name nor a sequence of names
            axes = ()
        if not axes or not all(isinstance(a, str) for a in axes):
            raise CollectiveError(
                f"{op} in {self.fn_label}: axis_name must be a mesh axis name or a tuple of "
                f"them, got {axis_name!r}. The mesh has axes {names}."
            )
        for a in axes:
            if a not in self.mesh.shape:
                raise CollectiveError(
                    f"{op} in {self.fn_label}: unknown mesh axis {a!r}; the mesh has axes "
                    f"{names}.{suggest(a, names)}"
                )
        if len(set(axes)) != len(axes):
            raise CollectiveError(
                f"{op} in {self.fn_label}: axis_name {axes} repeats an axis. Fix: name each once."
            )
        return axes


def push(ctx: SpmdContext) -> None:
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    stack.append(ctx)


def pop() -> None:
    _local.stack.pop()


def active() -> SpmdContext | None:
    stack = getattr(_local, "stack", None)
    return stack[-1] if stack else None


def current(op: str) -> SpmdContext:
    ctx = active()
    if ctx is None:
        raise CollectiveError(
            f"{op} was called outside spmd_map. Collectives talk to the other instances of a "
            "mesh, so they only exist inside a per-device function. Fix: call it inside a "
            "function decorated with @named_spmd.spmd_map(mesh=..., in_specs=..., out_specs=...)."
        )
    return ctx
