"""Outputs of unequal blocks whose value is one instance's: under ``check_vma=False``, an
output whose blocks differ in shape or dtype over axes its out_spec does not keep is the value
of the instance at coordinate 0 there, as the simulated mesh returns it (``_dist_uneven``).
Under ``check_vma=True`` such an output is the simulated mesh's error (typed invariant, its
instances differ): ``_dist_uneven._layouts`` raises it. Where ranks that branched on values
return outputs of other types, every rank takes coordinate 0's value alike (:func:`differing`)."""

from __future__ import annotations

import torch

from .. import _torch_private as torch_private
from .._autodiff import differentiable
from .._errors import SpmdError, grad_apart, types_apart_in_grad
from .._layout import coords_of, coords_text, index_of
from .._spec import PartitionSpec, output_settles


def where_apart(mesh, spec: PartitionSpec, kinds, shape_at) -> tuple[dict, dict, list[str]] | None:
    """Where blocks differ in shape or dtype from the block of the instance at coordinate 0 of
    the axes ``spec`` does not keep (:func:`_at_first`): the coordinates of that coordinate-0
    instance and of the first instance that differs from it (typed invariant there: the
    simulated mesh's error), and every axis over which some block differs; None: none differs."""
    names, sizes = mesh.axis_names, mesh._shape
    pairs = []
    for i, kind in enumerate(kinds):
        at = coords_of(i, names, sizes)
        first = _at_first(at, spec)
        if kind != kinds[index_of(names, first, sizes)] or shape_at(at) != shape_at(first):
            pairs.append((first, at))
    if not pairs:
        return None
    return (*pairs[0], [a for a in names if any(f[a] != at[a] for f, at in pairs)])


def _at_first(coords: dict[str, int], spec: PartitionSpec) -> dict[str, int]:
    """``coords`` on the axes ``spec`` keeps (names or declares unreduced), 0 on the others
    (where an unkept value is the instance's at 0: ``_dist_io.local_output``)."""
    kept = (*spec.axes, *spec.unreduced)
    return {a: c if a in kept else 0 for a, c in coords.items()}


def first_coords(mesh, spec: PartitionSpec) -> dict[str, int]:
    return _at_first(mesh.my_coords, spec)  # the instance whose block this rank's output takes


def as_first(ctx, y: torch.Tensor, spec: PartitionSpec, first, differ) -> torch.Tensor:
    """Output ``y``, whose blocks differ over the axes ``differ`` that ``spec`` does not keep
    (``check_vma=False``), as the value of the instance at coordinate 0 there, which the
    simulated mesh returns: this rank's block swapped for zeros of that instance's block shape
    and dtype where it differs (``first``; :class:`_AsFirst`), typed varying over ``differ``
    (they differ there, whatever the type says) so that ``_dist_io.local_output`` broadcasts it
    from coordinate 0 there. Where the type says invariant, no gradient (:class:`_NoGradient`)."""
    mesh, vma = ctx.mesh, ctx.vma(y)
    if first is not None:
        y = _AsFirst.apply(y, *first)
    settled = output_settles(vma, spec, mesh.axis_names, mesh.single_axes)[0]
    invariant = tuple(a for a in differ if a not in settled)
    if invariant and differentiable(y):  # (alike on every rank: its backward raises on each)
        y = _NoGradient.apply(y, ctx.fn_label, spec, invariant)
    return ctx.stamp(y, vma.add(tuple(differ)))


class _NoGradient(torch.autograd.Function):
    """The value of an output typed invariant over axes where its blocks differ: its backward
    raises. A rank that returns coordinate 0's value in place of its own block cannot give its
    own invariant values the cotangent that they hold whole on every rank (a psum's transpose
    takes it from each rank's own copy), so every input's gradient would be wrong."""

    @staticmethod
    def forward(y, label, spec, axes):
        return y.view_as(y)

    @staticmethod
    def setup_context(node, inputs, output):
        node.label, node.spec, node.axes = inputs[1:]

    @staticmethod
    def jvp(node, gy, *_):  # forward mode: coordinate 0's tangent, broadcast with its value
        return gy.view_as(gy)

    @staticmethod
    def backward(node, g):
        raise SpmdError(
            f"spmd_map of {node.label}: an output under out_spec {node.spec} is typed invariant "
            f"over {', '.join(node.axes)} but its blocks differ in shape or dtype there "
            "(check_vma=False): the call returns the value of the instance at coordinate 0, "
            "but a real mesh cannot differentiate it (every rank but that one holds another "
            "block). Fix: make the invariant values that meet the block's size varying over "
            f"{node.axes!r} (ns.pvary(s, {node.axes!r}), before they do), or name the axes "
            "in the out_spec; check_vma=True tells which output values are invariant."
        )


class _AsFirst(torch.autograd.Function):
    """Zeros of the block shape and dtype of the instance whose value an unkept output takes
    (coordinate 0 of the axes its spec does not keep), where this rank's block differs: the
    broadcast then moves one shape, and this rank's block, whose value is not returned, gets a
    zero gradient, as on the simulated mesh."""

    @staticmethod
    def forward(y, shape, dtype):
        return y.new_zeros(shape, dtype=dtype)

    @staticmethod
    def setup_context(node, inputs, output):
        y = inputs[0]
        node.shape, node.dtype, node.device = y.shape, y.dtype, y.device
        node.first = inputs[1:]

    @staticmethod
    def jvp(node, gy, *_):  # zeros, as the value: the broadcast brings coordinate 0's tangent
        shape, dtype = node.first
        return gy.new_zeros(shape, dtype=dtype)

    @staticmethod
    def backward(node, g):
        return g.new_zeros(node.shape, dtype=node.dtype, device=node.device), None, None


def differs(ctx, y: torch.Tensor) -> int:
    """The axes over which output ``y``'s type says that the instances' values may differ
    (varying or unreduced: where its out_spec does not keep them, the boundary takes coordinate
    0's value), as bits in mesh order."""
    vma = ctx.vma(y)
    bits = 0
    for k, a in enumerate(ctx.mesh.axis_names):
        if a in vma.varying or a in vma.unreduced:
            bits |= 1 << k
    return bits


def differing(ctx, y: torch.Tensor, spec: PartitionSpec, differ: int) -> torch.Tensor:
    """Output ``y``, typed varying too over the axes its out_spec ``spec`` does not keep where
    another rank's output differs (``differ``: every rank's :func:`differs` together; ranks
    that took other branches after a read of a varying value, under ``check_vma=False``), so
    that every rank takes coordinate 0's value alike (one broadcast on every rank, where a
    rank's own type would leave it out of the others')."""
    extra = differ & ~differs(ctx, y)
    if not extra:
        return y
    names = ctx.mesh.axis_names
    axes = tuple(
        a
        for k, a in enumerate(names)
        if extra >> k & 1 and a not in spec.axes and a not in spec.unreduced
    )
    if not axes:  # (a kept axis: each rank's block, as its own type settles it)
        return y
    with torch_private.DisableTorchFunction():
        view = y.view_as(y)  # (its own stamp: ``y`` may be an input, typed as it is)
    return ctx.stamp(view, ctx.vma(y).add(axes))


def refuse_grads_apart(ctx, rows, slots: list[int], wheres) -> None:
    """The error, on every rank alike, of an output that requires grad on some rank but not
    all, or whose type (the axes it differs over) differs between ranks where it requires grad
    (``rows``: every rank's outputs' row, ``_dist_uneven._every_block``; ``slots``: where each
    output's starts): the ranks branched apart, and their backward passes would run other
    collectives, each waiting on others."""
    mesh = ctx.mesh

    def coords(i: int) -> str:
        return f"({coords_text(coords_of(i, mesh.axis_names, mesh._shape))})"

    for at, where in zip(slots, wheres):
        types: dict[int, list[int]] = {}
        for i, row in enumerate(rows):
            types.setdefault(row[at + 2], []).append(i)
        grads = [row[at + 3] for row in rows]
        if any(grads) and not all(grads):
            apart = ", ".join(coords(i) for i, grad in enumerate(grads) if not grad)
            raise ctx.alike(grad_apart(ctx.fn_label, where, apart))
        if len(types) < 2 or not any(grads):
            continue
        text = "; ".join(
            f"{_type_text(mesh.axis_names, bits)} at " + ", ".join(coords(i) for i in ins)
            for bits, ins in types.items()
        )
        raise ctx.alike(types_apart_in_grad(ctx.fn_label, where, text))


def _type_text(names: tuple[str, ...], bits: int) -> str:
    axes = tuple(a for k, a in enumerate(names) if bits >> k & 1)
    return f"varying or unreduced over {axes}" if axes else "invariant"
