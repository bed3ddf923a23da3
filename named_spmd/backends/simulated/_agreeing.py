"""Outputs typed invariant must hold one value: checked where each instance computes its own.

The types see tensors only. A Python number that differs between instances (a block's size
where blocks are uneven, a value read with ``.item()``) makes an invariant-typed tensor whose
value differs between them: ``ns.psum(v.sum(), "x") / v.numel()`` over blocks of 3, 3, 3 and 1
rows. An out_spec that does not name the axis would then return one instance's value, silently
(a real mesh: each rank its own, in a DTensor said to be replicated; blocks of other shapes it
tells from its outputs' rows, ``_dist_uneven``). The per-instance execution
holds every instance's output, so it compares them, to the rounding a kernel may differ by
between threads; the vmap execution cannot differ (one program, every instance's shapes alike).
Nor may the instances write an input whose blocks they share (:func:`shared_inputs`).
"""

from __future__ import annotations

import collections
from collections.abc import Mapping

import torch

from ... import _torch_private as torch_private
from ..._errors import invariant_differs
from ..._layout import coords_of, coords_text, index_of
from ..._mesh import Mesh
from ..._spec import PartitionSpec

#: (rtol, atol) per dtype, as torch.testing's defaults; other dtypes compare exactly
_TOLERANCE = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex32: (1e-3, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.complex128: (1e-7, 1e-7),
}


def check_one_value(
    mesh: Mesh, values: list[torch.Tensor], spec: PartitionSpec, label: str, where: str
) -> None:
    """Raise a ``VmaError`` where the instances along an axis ``spec`` neither names nor sums
    (the output is typed invariant there) hold values that differ."""
    names, sizes = mesh.axis_names, mesh._shape
    kept = set(spec.axes) | set(spec.unreduced)
    if (
        all(a in kept for a in names)
        or not isinstance(values[0], torch.Tensor)
        or values[0].is_meta
    ):
        return
    for i, value in enumerate(values):
        at = coords_of(i, names, sizes)
        first = at | {a: 0 for a in names if a not in kept}
        j = index_of(names, first, sizes)
        if j != i and not _same(values[j], value):
            axes = [a for a in names if a not in kept and at[a] != 0]
            raise invariant_differs(label, where, spec, axes, coords_text(first), coords_text(at))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    a, b = a.detach(), b.detach()
    if a.shape != b.shape:
        return False  # (told by the out_specs' shape check first)
    if a.dtype != b.dtype:  # (instances that returned other dtypes: allclose refuses them)
        return False
    tolerance = _TOLERANCE.get(a.dtype)
    if a.dtype is torch.complex32:  # (torch.equal has no complex32 kernel)
        a, b = a.to(torch.complex64), b.to(torch.complex64)
    if torch.equal(a, b):  # the usual case, and the cheap test
        return True
    if tolerance is None:  # exact, but for NaNs (float8 & co: compared as float32)
        if not a.is_floating_point():
            return False
        a, b, tolerance = a.float(), b.float(), (0.0, 0.0)
    return torch.allclose(a, b, rtol=tolerance[0], atol=tolerance[1], equal_nan=True)


def shared_inputs(
    sizes: Mapping[str, int], leaves: list[object], specs: list[PartitionSpec]
) -> list[tuple]:
    """``(leaf, spec, version)`` of each input tensor whose blocks several instances share (an
    axis of size > 1 its spec does not name: each one writes it) and whose version counter tells
    (not an inference tensor's, which has none, or one that another input's writes bump too)."""
    tensors = [
        (x, s, x.untyped_storage().data_ptr())
        for x, s in zip(leaves, specs)
        if isinstance(x, torch.Tensor)
    ]
    storages = collections.Counter(at for _, _, at in tensors)
    return [
        (x, s, torch_private.version(x))
        for x, s, at in tensors
        if storages[at] == 1 and not x.is_inference()
        if any(n > 1 and a not in s.axes and a not in s.unreduced for a, n in sizes.items())
    ]
