"""A simulated value's per-instance blocks: for printing it, and for replaying a failed op.

Inside the per-device function a value that varies over mesh axes is one tensor batched at the
simulation's vmap levels; torch would print it as nested ``BatchedTensor(lvl=..., bdim=...)``
wrappers around the stacked data. :class:`Instances` peels those levels and selects one mesh
coordinate's block, a plain tensor: exactly what that instance's rank holds on a real mesh.

``print(x)`` / ``repr`` / ``str`` of such a value show its type (``f32[2,6]{dp}``, as
``ns.typeof``) and one block per coordinate of the axes it varies over (``dp=0: tensor(...)``),
the same along the axes it is invariant over; an invariant value is an ordinary tensor and prints
as one. A 0-d value in an f-string or ``format`` gives every instance's number (``dp=0: 1.50; dp=1:
2.50``), where torch's ``.item()`` would be refused under vmap. The hooks are installed into
torch's printing once (``_torch_private.hook_wrapper_printing``) and answer only for a tensor whose
outermost wrapper is a level of the running simulated call; anything else prints as torch prints
it (a user's own ``torch.func.vmap`` inside the function shows its wrapper around our view).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ... import _calls
from ... import _torch_private as torch_private
from ..._types import VType

#: More instances than this print as the first and last half of it around an elision line.
MAX_SHOWN = 16


@dataclass
class Instances:
    """A value's blocks: ``base`` (below the simulation's levels) and, from the lowest level up,
    the (axis, batch dim) of each level it is batched at."""

    axes: tuple[str, ...]  # the axes it varies over, in mesh order
    base: torch.Tensor
    dims: list[tuple[str, int]]

    def block(self, coords: dict[str, int]) -> torch.Tensor:
        """The block of the instance at ``coords`` (a view of ``base``)."""
        t = self.base
        for axis, bdim in self.dims:  # each level's batch dim counts the dims below it only
            t = t.select(bdim, coords[axis])
        return t


def coordinates(axes: tuple[str, ...], sizes: dict[str, int]) -> Iterator[dict[str, int]]:
    """Every coordinate of ``axes``, row-major (the first axis major)."""
    for values in itertools.product(*(range(sizes[a]) for a in axes)):
        yield dict(zip(axes, values))


def simulated_call() -> Any:
    """The running simulated call's context, or None (no call, or another backend's)."""
    ctx = _calls.active()
    return ctx if hasattr(ctx, "level_axis") else None


def instance_leaf(p: torch.Tensor) -> torch.Tensor | None:
    """The tensor below the running simulated call's levels that holds every instance's block
    of ``p`` (a Parameter made inside the call: each instance's own leaf on a real mesh's rank);
    None outside a call, or where a transform of the user's wraps ``p`` (above the simulation's
    levels: inside the function, or below: around the call), as it would wrap a rank's."""
    ctx = simulated_call()
    found = None if ctx is None else instances(p, ctx)
    if found is None or torch_private.is_transform_wrapped(found.base):
        return None
    return found.base


def instances(x: torch.Tensor, ctx: Any) -> Instances | None:
    """``x``'s blocks in the call ``ctx``; None where a transform level above the simulation's
    (a user's vmap or grad inside the function) wraps ``x``."""
    if torch_private.maybe_get_level(x) > ctx.inner_level:
        return None
    peeled: list[tuple[str, int]] = []
    while (
        torch_private.maybe_get_level(x) >= ctx.outer_level
    ):  # our levels are consecutive stack depths
        peeled.append(
            (ctx.level_axis[torch_private.maybe_get_level(x)], torch_private.maybe_get_bdim(x))
        )
        x = torch_private.get_unwrapped(x)
    peeled.reverse()
    found = {a for a, _ in peeled}
    return Instances(tuple(a for a in ctx.mesh.axis_names if a in found), x, peeled)


def label(coords: dict[str, int]) -> str:
    return ", ".join(f"{a}={i}" for a, i in coords.items())


def shown(view: Instances, sizes: dict[str, int]) -> Iterator[dict[str, int] | int]:
    """The coordinates to show; an int (how many are left out) where the middle is elided."""
    count = math.prod(sizes[a] for a in view.axes)
    half = MAX_SHOWN // 2
    for i, coords in enumerate(coordinates(view.axes, sizes)):
        if count <= MAX_SHOWN or i < half or i >= count - half:
            yield coords
        elif i == half:
            yield count - MAX_SHOWN


# --- the printing hooks ---------------------------------------------------------------------------


def _printable(x: torch.Tensor) -> tuple[Any, Instances] | None:
    """The call and ``x``'s blocks, with plain data under them, if ``x`` is the call's and varies;
    None: torch prints it."""
    ctx = simulated_call()
    if ctx is None or torch_private.maybe_get_level(x) not in ctx.level_axis:
        return None
    view = instances(x, ctx)
    if view is None:
        return None
    base = view.base
    while torch_private.is_transform_wrapped(base):  # a transform around the call: the same values
        if not torch_private.is_gradtrackingtensor(base):
            return None  # a user's vmap around the call: its own batch dim; torch shows it
        base = torch_private.get_unwrapped(base)
    view.base = base.detach()
    return ctx, view


def text(x: torch.Tensor) -> str | None:
    """``repr`` of a varying value of the running call: its type, then one block per coordinate."""
    found = _printable(x)
    if found is None:
        return None
    ctx, view = found
    vtype = VType(x.dtype, tuple(x.shape), ctx.vma(x), ctx.mesh.axis_names)
    same = [a for a in ctx.mesh.axis_names if a not in view.axes]
    lines = [f"{vtype} per instance" + (f", the same along {', '.join(same)}:" if same else ":")]
    for coords in shown(view, ctx.sizes):
        if isinstance(coords, int):
            lines.append(f"... {coords} more instances ...")
            continue
        head = f"{label(coords)}: "
        block = repr(view.block(coords)).split("\n")  # aligned under the first line
        lines.append(head + block[0])
        lines += [" " * len(head) + line if line else line for line in block[1:]]
    return "\n".join(lines)


def formatted(x: torch.Tensor, spec: str) -> str | None:
    """``format(x, spec)`` of a 0-d varying value: every instance's number, formatted by ``spec``."""
    if x.dim() != 0:
        return None  # torch formats it as str(x), or refuses a spec, as for a plain tensor
    found = _printable(x)
    if found is None:
        return None
    ctx, view = found
    parts = []
    with torch_private.DisableFuncTorch():  # plain blocks
        for coords in shown(view, ctx.sizes):
            if isinstance(coords, int):
                parts.append(f"... {coords} more")
            else:
                parts.append(f"{label(coords)}: {format(view.block(coords).item(), spec)}")
    return "; ".join(parts)


torch_private.hook_wrapper_printing(text, formatted)
