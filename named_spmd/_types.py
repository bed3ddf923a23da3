"""The type of a value inside spmd_map: dtype, per-device shape and vma (varying mesh axes).

Kept a small immutable object (not a bare frozenset) so that a later state, such as a pending sum
over an axis, can be added without changing its users (DESIGN.md section 8).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

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


def vma_text(vma: Iterable[str], axis_order: Iterable[str] = ()) -> str:
    """``{dp,tp}`` with axes in mesh order when given, else sorted."""
    order = {a: i for i, a in enumerate(axis_order)}
    names = sorted(vma, key=lambda a: (order.get(a, len(order)), a))
    return "{" + ",".join(names) + "}"


@dataclass(frozen=True)
class VType:
    """``f32[8,4]{dp}``: dtype, per-device shape, and the mesh axes the value varies over."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    vma: frozenset[str]
    axis_order: tuple[str, ...] = ()

    def __repr__(self) -> str:
        dims = ",".join(str(s) for s in self.shape)
        return f"{short_dtype(self.dtype)}[{dims}]{vma_text(self.vma, self.axis_order)}"

    def _repr_html_(self) -> str:
        from ._display import vtype_html

        return vtype_html(self)
