"""Why an output's type does not fit its out_spec: the VmaError's text for each output, with the
fixes (a reduction inside the function, or the out_spec naming the axes on the dims that hold
their blocks, as the value's block record says)."""

from __future__ import annotations

from typing import Any

import torch

from ._context import SpmdContext
from ._spec import PartitionSpec
from ._types import Vma, shape_shown, type_text


def varying_problem(
    where: str,
    leaf: torch.Tensor,
    spec: PartitionSpec,
    extra: Vma,
    ctx: SpmdContext,
) -> str:
    """An output varying over ``extra``, axes its out_spec does not name."""
    order = ctx.mesh.axis_names
    axes = tuple(a for a in order if a in extra)
    vtype = type_text(leaf.dtype, shape_shown(leaf), ctx.vma(leaf), order)
    named = f"ns.psum(y, {axes[0] if len(axes) == 1 else axes!r})"
    return (
        f"  - {where} has type {vtype}: it varies over {axes}, but its out_spec {spec!r} does "
        f"not name {'them' if len(axes) > 1 else repr(axes[0])}, which claims one replicated copy.\n"
        f"    Fix 1: reduce inside the function, e.g. {named} (or pmean / pmax / "
        f"all_gather(..., to='invariant')) if the instances hold parts of one value.\n"
        f"    Fix 2: {_naming_fix(spec, axes, leaf.dim(), ctx.held_blocks(leaf))}"
    )


def unreduced_problem(where: str, leaf: torch.Tensor, spec: PartitionSpec, ctx: SpmdContext) -> str:
    """An output unreduced where its out_spec does not say so, or the other way round."""
    vma = ctx.vma(leaf)
    vtype = type_text(leaf.dtype, shape_shown(leaf), vma, ctx.mesh.axis_names)
    order = ctx.mesh.axis_names
    extra = tuple(a for a in order if a in vma.unreduced - spec.unreduced)
    if extra:
        return (
            f"  - {where} has type {vtype}: it is unreduced over {extra} (each instance holds "
            f"a partial sum), but its out_spec {spec!r} does not say so.\n"
            f"    Fix 1: reduce inside the function, e.g. ns.psum(y, {extra[0]!r}).\n"
            f"    Fix 2: return the partial sums: P(..., unreduced={set(extra)!r}) (summed "
            "on the simulated mesh, a DTensor with Partial() placement on a real one)."
        )
    missing = tuple(a for a in order if a in spec.unreduced - vma.unreduced)
    return (
        f"  - {where} has type {vtype}: its out_spec {spec!r} says unreduced over {missing}, "
        "but the value is not a partial sum there. Fix: drop those axes from unreduced=, or "
        f"cast a varying value with ns.pcast(y, {missing[0]!r}, to='unreduced')."
    )


def _naming_fix(spec: PartitionSpec, axes: tuple[str, ...], rank: int, layout: Any) -> str:
    """The out_spec naming ``axes`` besides ``spec``'s own, for an output of ``rank`` dims:
    each axis on the dim that holds its blocks, where ``layout`` (the value's record of them,
    ``_blocks``; None: not known) says which. Named on another dim, the blocks would come back
    concatenated where they do not belong (a vocabulary split on dim 2 stacked on dim 0). An
    axis no dim is known to hold goes to dim 0, and the text says to choose its dim."""
    if rank == 0:
        return (
            "name the axis in out_specs (a rank-0 output needs a singleton dim first: return "
            "y.reshape(1)) to get every instance's block concatenated."
        )
    held = [list(spec.entry_axes(d)) for d in range(rank)]
    unknown = []
    for a in axes:
        dims = [] if layout is None or a in layout.opaque else layout.dims
        where = [d for d, on in enumerate(dims) if a in on]
        if len(where) == 1:
            held[where[0]].append(a)
        else:
            unknown.append(a)
    crowded = [d for d, e in enumerate(held) if len(e) > 1 and any(a in axes for a in e)]
    entries = [list(e) for e in held]
    entries[0][len(spec.entry_axes(0)) : len(spec.entry_axes(0))] = unknown
    named = PartitionSpec(
        *(None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries),
        unreduced=spec.unreduced.difference(axes),  # (an axis has one state in a spec)
        reduced=spec.reduced.difference(axes),
    )
    if not unknown and not crowded:
        return (
            f"name {_axes_text(axes)} in out_specs on the "
            f"{'dims that hold their' if len(axes) > 1 else 'dim that holds its'} blocks, e.g. "
            f"{named!r}, to get every instance's block concatenated in its place."
        )
    notes = [
        f"dim {d} holds blocks of {_axes_text(tuple(held[d]))}: list them major first, as they "
        "were split"
        for d in crowded
    ]
    if unknown:
        them = "it" if len(unknown) == 1 else "them"
        notes.append(
            f"no dim of this value is known to hold blocks of {_axes_text(tuple(unknown))}, so "
            f"this puts {them} on dim 0: name {them} on the dim along which the instances' "
            "values belong"
        )
    return (
        f"name {_axes_text(axes)} in out_specs to get every instance's block concatenated, "
        f"e.g. {named!r} ({'; '.join(notes)})."
    )


def _axes_text(axes: tuple[str, ...]) -> str:
    return repr(axes[0]) if len(axes) == 1 else repr(axes)
