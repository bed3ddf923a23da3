"""Abstract backend: run the per-device function once, on meta tensors, to check a program.

``spmd_map(...).check(*args)`` gives output types and the communication a run would do, or the
error a run would raise, without data, without communication and without running every instance:
the per-device function runs *once*, on meta tensors of the per-instance shapes. Every instance of
a mesh runs the same program on blocks of the same shapes, so one abstract instance stands for all
of them; nothing here grows with the number of instances or the global sizes (a 4096-instance
mesh is checked as fast as a 2-instance one).

vma is tracked per tensor (``TrackedContext`` stamps, ``VmaMode`` for ordinary ops), the same
machinery the distributed backend uses, and collectives go through the same public layer, so the
checks and messages are the ones a real run produces. Backward communication is found by running
autograd on the meta outputs: the public layer tags each collective's output with the collective
its transpose runs, and ``CommMode`` records those as the backward pass reaches them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import optree
import torch

from .. import _context
from .._accounting import CommEvent, CommMode
from .._errors import SpmdError
from .._mesh import Mesh
from .._spec import PartitionSpec
from .._types import VType, short_dtype
from ._tracking import TrackedContext, VmaMode

_META = torch.device("meta")


@dataclass(frozen=True)
class ShapeDtype:
    """A stand-in for a global tensor in :meth:`SpmdFunction.check`: its shape and dtype only.

    Nothing of size ``shape`` is ever allocated, so a 64-GB activation costs nothing to check.

    Args:
        shape: the global shape.
        dtype: the dtype (default float32).
        requires_grad: whether the check differentiates with respect to it; default: exactly
            when the dtype is floating point.

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
        from .._display import check_report_text

        return check_report_text(self)

    def _repr_html_(self) -> str:
        from .._display import check_report_html

        return check_report_html(self)


class _Reshaped(torch.autograd.Function):
    """A fresh meta tensor of ``shape`` standing for a collective's output; backward likewise.

    Values do not exist here, only shapes and the autograd edge, which carries the backward pass
    to the collective's transpose (recorded by the public layer)."""

    @staticmethod
    def forward(x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.empty(shape, dtype=x.dtype, device=_META)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.in_shape, ctx.in_dtype = tuple(inputs[0].shape), inputs[0].dtype

    @staticmethod
    def backward(ctx, grad):
        return torch.empty(ctx.in_shape, dtype=ctx.in_dtype, device=_META), None


def _as(x: torch.Tensor, shape) -> torch.Tensor:
    with torch._C.DisableTorchFunction():
        return _Reshaped.apply(x, tuple(shape))


class AbstractContext(TrackedContext):
    """Collectives compute only their output shapes, on meta tensors."""

    def __init__(self, mesh, fn):
        super().__init__(mesh, fn)
        # id(real tensor) -> (tensor, its meta alias), see AbstractVmaMode
        self.meta_aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def axis_index(self, axes):
        with torch._C.DisableTorchFunction():
            index = torch.empty((), dtype=torch.int64, device=_META)
        return self.stamp(index, frozenset(axes))

    def pvary(self, x, axes):
        return _as(x, x.shape)

    def psum(self, x, axes):
        return _as(x, x.shape)

    pmax = pmin = psum

    def all_gather(self, x, axes, axis, tiled, invariant):
        shape = list(x.shape)
        n = self.mesh.axis_size(axes)
        if tiled:
            shape[axis] *= n
        else:
            shape.insert(axis, n)
        return _as(x, shape)

    def psum_scatter(self, x, axes, dim, tiled):
        shape = list(x.shape)
        if tiled:
            shape[dim] //= self.mesh.axis_size(axes)
        else:
            del shape[dim]
        return _as(x, shape)

    def all_to_all(self, x, axes, split, concat, tiled):
        shape = list(x.shape)
        if tiled:
            n = self.mesh.axis_size(axes)
            shape[split] //= n
            shape[concat] *= n
        else:  # the split dim (of size n) moves to concat
            shape.insert(concat, shape.pop(split))
        return _as(x, shape)

    def ppermute(self, x, axes, pairs):
        return _as(x, x.shape)


class AbstractVmaMode(VmaMode):
    """VmaMode that also moves real (closed-over) tensors to meta where they meet meta ones.

    One meta alias per real tensor per call, so the implicit pvary cache still sees one tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(isinstance(a, torch.Tensor) and not a.is_meta for a in args) or (
            kwargs and any(isinstance(a, torch.Tensor) and not a.is_meta for a in kwargs.values())
        ):
            args = tuple(self._meta(a) for a in args)
            if kwargs:
                kwargs = {k: self._meta(v) for k, v in kwargs.items()}
        return super().__torch_function__(func, types, args, kwargs)

    def _meta(self, a: Any) -> Any:
        if not isinstance(a, torch.Tensor) or a.is_meta:
            return a
        aliases = self.ctx.meta_aliases
        hit = aliases.get(id(a))
        if hit is None:
            with torch._C.DisableTorchFunction():
                alias = torch.empty(a.shape, dtype=a.dtype, device=_META)
                alias.requires_grad_(a.requires_grad)
            hit = aliases[id(a)] = (a, alias)
        return hit[1]


# --- entry point ----------------------------------------------------------------------------------


def _to_meta(leaf: Any) -> Any:
    if isinstance(leaf, ShapeDtype):
        return torch.empty(leaf.shape, dtype=leaf.dtype, device=_META)
    if isinstance(leaf, torch.Tensor):
        return torch.empty(tuple(leaf.shape), dtype=leaf.dtype, device=_META)
    return leaf


def _wants_grad(leaf: Any) -> bool:
    if isinstance(leaf, ShapeDtype) and leaf.requires_grad is not None:
        return leaf.requires_grad and (leaf.dtype.is_floating_point or leaf.dtype.is_complex)
    dtype = getattr(leaf, "dtype", None)
    return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)


def _local(meta: torch.Tensor, spec: PartitionSpec, mesh: Mesh, grad: bool) -> torch.Tensor:
    shape = [
        size // mesh.axis_size(spec.entry_axes(d)) if spec.entry_axes(d) else size
        for d, size in enumerate(meta.shape)
    ]
    local = torch.empty(shape, dtype=meta.dtype, device=_META)
    return local.requires_grad_(grad)


def _global_shape(local: torch.Tensor, spec: PartitionSpec, mesh: Mesh) -> tuple[int, ...]:
    return tuple(
        size * math.prod(mesh.shape[a] for a in spec.entry_axes(d))
        for d, size in enumerate(local.shape)
    )


def check(smap: Any, args: tuple, backward: bool = True) -> CheckReport:
    """Run ``smap`` (an SpmdFunction) abstractly on ``args``; see ``SpmdFunction.check``."""
    if _context.active() is not None:
        raise SpmdError(
            f"{smap.where}.check was called inside another spmd_map; nesting is not supported."
        )
    grads = [_wants_grad(x) for x in optree.tree_leaves(args, none_is_leaf=True)]
    meta_args = optree.tree_map(_to_meta, args, none_is_leaf=True)
    leaves, specs, in_tree = smap._input_leaves(meta_args)
    mesh = smap.mesh
    ctx = AbstractContext(mesh, smap.fn)
    local = [
        ctx.stamp(_local(x, s, mesh, g and backward), frozenset(s.axes))
        if isinstance(x, torch.Tensor)
        else x
        for x, s, g in zip(leaves, specs, grads)
    ]
    with CommMode() as comms:
        _context.push(ctx)
        try:
            with torch.device(_META), AbstractVmaMode(ctx):
                out = _call_abstract(smap, optree.tree_unflatten(in_tree, local))
            paths, out_leaves, out_specs, out_tree = smap._check_outputs(out, ctx)
        finally:
            _context.pop()
        if backward:
            _run_backward(out_leaves)
    return _report(smap, ctx, paths, out_leaves, out_specs, out_tree, comms.events)


# Messages of torch errors that mean "this op needs tensor values, which meta tensors lack".
_NEEDS_DATA = ("meta", "data pointer", "no data", "data-dependent", "storage")


def _call_abstract(smap: Any, args: tuple) -> Any:
    try:
        return smap._call_user(args)
    except SpmdError:
        raise
    except (NotImplementedError, RuntimeError) as e:
        if not any(s in str(e) for s in _NEEDS_DATA):
            raise
        raise SpmdError(
            f"{smap.where}: check() runs the per-device function on shapes only, and the "
            f"function needs tensor values:\n  {type(e).__name__}: {str(e).splitlines()[0]}\n"
            "Code that reads values (.item(), .tolist(), nonzero(), Python if on a tensor) "
            "fails on the simulated mesh too. Fix: keep per-device code data-independent, "
            "e.g. torch.where / masks instead of branching on values."
        ) from e


def _run_backward(out_leaves: list[Any]) -> None:
    outs = [x for x in out_leaves if isinstance(x, torch.Tensor) and x.requires_grad]
    if outs:
        seeds = [torch.empty(o.shape, dtype=o.dtype, device=_META) for o in outs]
        torch.autograd.backward(outs, seeds)


def _report(smap, ctx, paths, out_leaves, out_specs, out_tree, events) -> CheckReport:
    from .._tree import path_text

    mesh = smap.mesh
    outputs = []
    global_leaves = []
    for path, leaf, spec in zip(paths, out_leaves, out_specs):
        if not isinstance(leaf, torch.Tensor):
            global_leaves.append(leaf)
            continue
        vtype = VType(leaf.dtype, tuple(leaf.shape), ctx.vma(leaf), mesh.axis_names)
        shape = _global_shape(leaf, spec, mesh)
        outputs.append(OutputCheck("output" + path_text(path), spec, vtype, shape))
        global_leaves.append(ShapeDtype(shape, leaf.dtype))
    out = optree.tree_unflatten(out_tree, global_leaves)
    return CheckReport(smap.label, mesh, outputs, out, list(events))


__all__ = ["AbstractContext", "CheckReport", "OutputCheck", "ShapeDtype", "check"]
