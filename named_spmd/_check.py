"""What ``spmd_map(...).check(*args)`` takes and returns: ShapeDtype, OutputCheck, CheckReport."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ._accounting import CommEvent, CommMode
from ._mesh import Mesh
from ._spec import PartitionSpec
from ._types import VType, render, short_dtype


@dataclass(frozen=True)
class ShapeDtype:
    """A stand-in for a global tensor in :meth:`SpmdFunction.check`: its shape and dtype only.

    Nothing of size ``shape`` is ever allocated, so a 64-GB activation costs nothing to check.

    Args:
        shape: the global shape.
        dtype: the dtype (default float32).
        requires_grad: whether the check differentiates with respect to it; default: exactly
            when the dtype is floating point. ``True`` stands for an argument that requires
            grad: an in-place write into it is refused, as autograd refuses it in the call.

    Example:
        >>> ShapeDtype((1024, 4096), torch.bfloat16)
        ShapeDtype(bf16[1024,4096])
    """

    shape: tuple[int, ...]
    dtype: torch.dtype = torch.float32
    requires_grad: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"ShapeDtype({short_dtype(self.dtype)}[{','.join(map(str, self.shape))}])"


@dataclass(frozen=True)
class OutputCheck:
    """One output leaf of a checked program."""

    path: str  # key path such as "output[0]['y']"
    spec: PartitionSpec
    type: VType  # per-instance dtype, shape and vma
    global_shape: tuple[int, ...]


@dataclass
class CheckReport:
    """What :meth:`SpmdFunction.check` found: output types and the communication of one step.

    Attributes:
        fn_label: the checked function.
        mesh: its mesh.
        outputs: one :class:`OutputCheck` per tensor output leaf.
        out: the output pytree with a global :class:`ShapeDtype` per tensor leaf.
        events: the logical collectives one instance runs, forward then backward.
    """

    fn_label: str
    mesh: Mesh
    outputs: list[OutputCheck]
    out: Any
    events: list[CommEvent] = field(default_factory=list)

    @property
    def forward(self) -> list[CommEvent]:
        return [e for e in self.events if e.direction == "forward"]

    @property
    def backward(self) -> list[CommEvent]:
        return [e for e in self.events if e.direction == "backward"]

    @property
    def comms(self) -> CommMode:
        """The events as a :class:`CommMode` (``count``, ``counts``, ``summary``)."""
        mode = CommMode()
        mode.events = list(self.events)
        return mode

    @property
    def types(self) -> list[VType]:
        """Per-instance type of each tensor output leaf, e.g. ``f32[4,8]{dp}``."""
        return [o.type for o in self.outputs]

    def __repr__(self) -> str:
        return render("check_text", self)

    def _repr_html_(self) -> str:
        return render("check_html", self)
