"""Abstract backend: run the per-device function once, on meta tensors, to check a program.

``spmd_map(...).check(*args)`` gives output types and the communication a run would do, or the
error a run would raise, without data, without communication and without running every instance:
the per-device function runs *once*, on meta tensors of the per-instance shapes. Every instance of
a mesh runs the same program on blocks of the same shapes, so one abstract instance stands for all
of them; nothing here grows with the number of instances or the global sizes (a 4096-instance
mesh is checked as fast as a 2-instance one). Blocks of different sizes break that premise: such a
call is checked per instance (:meth:`AbstractBackend._run_per_instance`), each instance on meta
blocks of its own shape, at a cost that grows with the number of instances, as the call's does.

It is a backend like the others: the same call path as a run (``SpmdFunction._call``), the same
dispatch of every collective, per-tensor vma stamps and ``VmaMode`` as on the real backend. A
collective's forward is its record's shape rule; its backward is the record's transpose through
the generic autograd bridge, on meta tensors, so ``CommMode`` records the backward communication
as the backward pass reaches each collective.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import optree
import torch
from torch.overrides import TorchFunctionMode

from .. import _torch_private as torch_private
from .._accounting import CommMode
from .._autodiff import apply as bridge_apply
from .._autodiff import differentiable
from .._capabilities import Capabilities
from .._check import CheckReport, OutputCheck, ShapeDtype
from .._errors import SpmdError, user_line
from .._layout import global_shape, is_even, local_shape
from .._mesh import Mesh
from .._operands import METADATA, NOT_OPS, is_inplace
from .._spec import PartitionSpec
from .._stamps import TrackedContext
from .._tracking import VmaMode
from .._types import Vma, VType

if TYPE_CHECKING:
    from .._call import Call
    from . import Backend

_META = torch.device("meta")


def _empty(shape: Any, dtype: torch.dtype) -> torch.Tensor:
    with torch_private.DisableTorchFunction():
        return torch.empty(tuple(shape), dtype=dtype, device=_META)


class AbstractContext(TrackedContext):
    """Collectives compute only their output shapes, on meta tensors."""

    def __init__(self, mesh, fn):
        super().__init__(mesh, fn)
        # id(real tensor) -> (tensor, its meta alias), see AbstractVmaMode
        self.meta_aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def axis_index(self, axes):
        return self.stamp(_empty((), torch.int64), Vma.of(axes))

    def per_member(self, axes, make):
        with torch_private.DisableTorchFunction():  # one member's shape and dtype stand for all
            value = make(0)
        return self.stamp(_empty(value.shape, value.dtype), Vma.of(axes))

    def apply(self, rec, x, axes, params, user_operand=False):
        with torch_private.DisableTorchFunction():
            if differentiable(x):
                return bridge_apply(rec, self, x, axes, params)
            return self.forward(rec, x, axes, params)

    def forward(self, rec, x, axes, params):
        return _empty(rec.shape(tuple(x.shape), self.mesh.axis_size(axes), params), x.dtype)

    # The primitives, for the transposes that use them directly: shapes only.
    def pvary(self, x, axes):
        return _empty(x.shape, x.dtype)

    def all_reduce(self, x, axes, op):
        return _empty(x.shape, x.dtype)

    def all_gather(self, x, axes):
        return _empty((self.mesh.axis_size(axes), *x.shape), x.dtype)

    def reduce_scatter(self, x, axes, dim):
        return _empty(x.shape[:dim] + x.shape[dim + 1 :], x.dtype)

    def all_to_all(self, x, axes, dim):
        return _empty(x.shape, x.dtype)

    def permute(self, x, axes, pairs):
        return _empty(x.shape, x.dtype)

    def broadcast(self, x, axes, root):
        return _empty(x.shape, x.dtype)

    def own_block(self, x, axes, dim):
        return _empty(x.shape[:dim] + x.shape[dim + 1 :], x.dtype)


class AbstractVmaMode(VmaMode):
    """VmaMode that also moves real (closed-over) tensors to meta where they meet meta ones.

    One meta alias per real tensor per call, so the implicit pvary cache still sees one tensor."""

    ctx: AbstractContext

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = _on_meta(self.ctx.meta_aliases, args, kwargs)
        return super().__torch_function__(func, types, args, kwargs)


class MetaAliases(TorchFunctionMode):
    """What :class:`AbstractVmaMode` adds to ``VmaMode``, as a mode of its own: an instance of
    the per-instance check enters it inside its own vma mode (so it runs first)."""

    def __init__(self) -> None:
        super().__init__()
        self.aliases: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        args, kwargs = _on_meta(self.aliases, args, kwargs)
        return as_the_kernel_would(func, args, kwargs or {})


def _on_meta(aliases: dict, args: tuple, kwargs: dict | None) -> tuple[tuple, dict | None]:
    """``args`` and ``kwargs`` with every real tensor replaced by its meta alias, those in a
    list or tuple argument too (``torch.cat([block, closed_over])``)."""
    if any(not t.is_meta for t in _operand_tensors(args, kwargs)):
        args = tuple(_meta(aliases, a) for a in args)
        if kwargs:
            kwargs = {k: _meta(aliases, v) for k, v in kwargs.items()}
    return args, kwargs


def _operand_tensors(args: tuple, kwargs: dict | None) -> Iterator[torch.Tensor]:
    """The tensors among ``args`` and ``kwargs``' values, those in a list or tuple too."""
    for a in (*args, *kwargs.values()) if kwargs else args:
        if isinstance(a, torch.Tensor):
            yield a
        elif type(a) in (list, tuple):
            yield from _operand_tensors(a, None)


def _meta(aliases: dict, a: Any) -> Any:
    if type(a) in (list, tuple):
        return type(a)(_meta(aliases, x) for x in a)
    if not isinstance(a, torch.Tensor) or a.is_meta:
        return a
    hit = aliases.get(id(a))
    if hit is None:
        alias = _empty(a.shape, a.dtype)
        with torch_private.DisableTorchFunction():
            alias.requires_grad_(a.requires_grad)
        hit = aliases[id(a)] = (a, alias)
    return hit[1]


# --- empty operands: the real kernel's verdict ----------------------------------------------------

#: Ops that are no computation of an operand's values: never run again on stand-ins.
_NOT_PROBED = NOT_OPS | METADATA | {torch.Tensor.register_hook, torch.Tensor.retain_grad}
#: The most elements an op's meta outputs may hold for its run on CPU stand-ins (which
#: allocates them) after meta let it through; above, meta's verdict stands.
_PROBE_LIMIT = 1 << 20


def as_the_kernel_would(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func`` on meta tensors, failing as a real kernel would where an operand is empty.

    Meta kernels check shapes, not the checks some CPU and CUDA kernels make of an empty
    operand: a max over an empty dim, or an index into one, passes on meta and raises on the
    call (an empty block: 9 rows over 4 are 3, 3, 3, 0), and other ops raise another class of
    error. So where an operand is empty, the op runs again on CPU stand-ins (``_stand_in``:
    no memory but the outputs'), and the CPU kernel's error is the op's, the error the call
    raises (``_per_instance._raise_first`` names the instance and its empty block). No operand
    empty: one look at the operands' sizes, nothing run."""
    empty = _empty_operand(args, kwargs)
    try:
        out = func(*args, **kwargs)
    except Exception:
        error = _cpu_error(func, args, kwargs) if empty else None
        if error is not None:
            raise error  # noqa: B904 - the meta error is its context
        raise
    if empty and _numel(out) <= _PROBE_LIMIT:
        error = _cpu_error(func, args, kwargs)
        if error is not None:
            raise error
    return out


def _empty_operand(args: tuple, kwargs: dict) -> bool:
    """Whether an operand (or a tensor in a list of them, ``torch.cat``'s) is empty."""
    with torch_private.DisableTorchFunction():
        return any(t.numel() == 0 for t in _operand_tensors(args, kwargs))


def _cpu_error(func: Any, args: tuple, kwargs: dict) -> BaseException | None:
    """The error ``func`` raises on CPU stand-ins of its operands, or None: where it runs,
    where it is no op of values (``_NOT_PROBED``), where it writes into a non-empty tensor (a
    stand-in cannot take the write), where the CPU has no kernel (its dtype, a device's own op:
    the CPU cannot say), and where it raises as well with its empty operands made non-empty
    (size 1 along each empty dim): then the error is of the stand-ins' values (zeros: a
    singular matrix), not of an operand's emptiness, and the call need not raise it."""
    if func in _NOT_PROBED:
        return None
    with torch_private.DisableTorchFunction():
        target = args[0] if args and is_inplace(func) else kwargs.get("out")
        if isinstance(target, torch.Tensor) and target.numel() > 0:
            return None
        error = _error_on(func, args, kwargs, _stand_in)
        if error is None or _error_on(func, args, kwargs, _filled_stand_in) is not None:
            return None
        return error


def _error_on(func: Any, args: tuple, kwargs: dict, stand_in: Callable) -> BaseException | None:
    """The error ``func`` raises on ``stand_in``'s CPU stand-ins of its operands, or None where
    it runs or the CPU cannot say (no stand-in or no kernel for a dtype)."""
    try:
        operands: Any = (args, kwargs)  # optree's PyTree is a class to mypy
        stand_in_args, stand_in_kwargs = optree.tree_map(stand_in, operands)
    except Exception:  # noqa: BLE001 - no stand-in for a tensor (its dtype): cannot say
        return None
    try:
        with torch.no_grad():
            func(*stand_in_args, **stand_in_kwargs)
    except NotImplementedError:
        return None
    except Exception as e:  # noqa: BLE001 - the kernel's verdict, told by the caller
        return None if "not implemented for" in str(e) else e
    return None


def _stand_in(a: Any) -> Any:
    """A CPU tensor of ``a``'s shape, strides and dtype holding nothing: empty as it is, else
    a zero expanded to its shape (the values of operands met by an empty one: zeros)."""
    if not isinstance(a, torch.Tensor):
        return a
    if a.numel() == 0:
        return torch.empty_strided(a.shape, a.stride(), dtype=a.dtype)
    return torch.zeros((), dtype=a.dtype).expand(a.shape)


def _filled_stand_in(a: Any) -> Any:
    """``_stand_in``, but an empty ``a`` made zeros of size 1 along each empty dim (of memory
    of its own where small: an op may write into it)."""
    if not isinstance(a, torch.Tensor) or a.numel() > 0:
        return _stand_in(a)
    shape = tuple(max(n, 1) for n in a.shape)
    if math.prod(shape) <= _PROBE_LIMIT:
        return torch.zeros(shape, dtype=a.dtype)
    return torch.zeros((), dtype=a.dtype).expand(shape)


def _numel(out: Any) -> int:
    return sum(t.numel() for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor))


# --- the backend ----------------------------------------------------------------------------------


def to_meta(leaf: Any) -> Any:
    """A global argument leaf as a meta tensor (ShapeDtype and tensors; others unchanged),
    requiring grad where the argument does, a leaf where it is one (``ShapeDtype``'s are): an
    in-place write into it is refused where autograd refuses it in the call
    (``AbstractBackend._writable``)."""
    if not isinstance(leaf, (ShapeDtype, torch.Tensor)):
        return leaf
    meta = torch.empty(tuple(leaf.shape), dtype=leaf.dtype, device=_META)
    if not (leaf.requires_grad and wants_grad(leaf)):
        return meta
    meta.requires_grad_()
    return meta if getattr(leaf, "is_leaf", True) else meta.clone()


def wants_grad(leaf: Any) -> bool:
    """Whether check() differentiates with respect to the argument leaf ``leaf``."""
    if isinstance(leaf, ShapeDtype) and leaf.requires_grad is not None:
        return leaf.requires_grad and (leaf.dtype.is_floating_point or leaf.dtype.is_complex)
    dtype = getattr(leaf, "dtype", None)
    return isinstance(dtype, torch.dtype) and (dtype.is_floating_point or dtype.is_complex)


_VALUES_UNDER_VMAP = (
    "Code that reads values (.item(), .tolist(), nonzero(), Python if on a tensor) fails on "
    "the simulated mesh too. Fix: keep per-device code data-independent, e.g. torch.where / "
    "masks instead of branching on values."
)
_VALUES_PER_INSTANCE = (
    "This call runs per instance (uneven blocks or ns.simulate_per_instance), where reading "
    "values works, but a check has none. Fix: run the call on the simulated mesh to check it, "
    "or keep per-device code data-independent (torch.where / masks instead of branching on "
    "values)."
)

# Messages of torch errors that mean "this op needs tensor values, which meta tensors lack".
_NEEDS_DATA = ("meta", "data pointer", "no data", "data-dependent", "storage")


#: Runs a call per instance, each on its own block and thread, meeting at each collective
#: (the simulated backend's ``_per_instance.run``; the API hands it over: a backend imports no
#: other backend). Its keywords ``inner_mode`` and ``first`` are what a check needs.
PerInstance = Callable[..., list[torch.Tensor]]


class AbstractBackend:
    """One check: runs the call abstractly and keeps what :meth:`report` needs.

    ``like``: the backend whose call this check stands for; the check takes blocks of unequal
    sizes exactly where it does (its ``capabilities.uneven_blocks`` and ``uneven_state()``;
    never traced, never on blocks: ``.check()`` takes global values). Such a call (or one
    run per instance on request) is checked per instance with ``per_instance``, on meta tensors:
    each instance's own block shapes, so a collective over operands of different shapes is the
    error the call raises, and the output shapes are the call's."""

    name = "abstract"

    def __init__(
        self,
        grads: list[bool],
        backward: bool,
        like: Backend,
        per_instance: PerInstance | None = None,
    ):
        uneven = like.capabilities.uneven_blocks
        self.capabilities = Capabilities(traceable=False, local_blocks=False, uneven_blocks=uneven)
        self.grads = grads
        self.backward = backward
        self.like = like
        self.per_instance = per_instance
        self.ctx: Any = None  # the (first) instance's context, made by run()
        self.outputs: list[torch.Tensor] = []
        self.output_vmas: list[Any] = []  # their types in the call
        self.comms = CommMode()
        self.instances = False  # whether the check ran per instance

    def accepts(self, mesh: Mesh) -> bool:
        return True

    def uneven_state(self) -> bool:
        return self.like.uneven_state()

    def run(self, call: Call) -> list[Any]:
        mesh, leaves, specs = call.mesh, call.leaves, call.specs
        if self._runs_per_instance(mesh, leaves, specs):
            return self._run_per_instance(call)
        ctx = self.ctx = AbstractContext(mesh, call.fn)
        local = [
            self._local(x, s, mesh, g) if isinstance(x, torch.Tensor) else x
            for x, s, g in zip(leaves, specs, self.grads)
        ]
        versions = call.input_versions(local)
        with self.comms:
            with torch.device(_META), AbstractVmaMode(ctx):
                outs = call.body(local, ctx)
            call.check_writes(local, versions, outs)
            if self.backward:
                _run_backward(outs)
        self.outputs = outs
        self.output_vmas = [ctx.vma(o) for o in outs]  # (before the call forgets its types)
        sizes = mesh._shape
        return [
            ShapeDtype(global_shape(y.shape, s, sizes), y.dtype)
            for y, s in zip(outs, call.out_specs())
        ]

    def _runs_per_instance(self, mesh: Mesh, leaves: list[Any], specs) -> bool:
        """Whether the call runs per instance: asked for, or some input's blocks differ in
        size (the input checks let such a split through only where ``like`` takes it)."""
        if mesh.size == 1 or self.per_instance is None:
            return False
        return self.uneven_state() or any(
            isinstance(x, torch.Tensor) and not is_even(x.shape, s, mesh._shape)
            for x, s in zip(leaves, specs)
        )

    def _run_per_instance(self, call: Call) -> list[Any]:
        """Every instance on its own meta blocks (nothing of a block's size is allocated, but
        the cost grows with the number of instances, as the call's does)."""
        assert self.per_instance is not None  # _runs_per_instance
        self.instances = True
        leaves = call.leaves
        for i, (x, g) in enumerate(zip(leaves, self.grads)):
            if isinstance(x, torch.Tensor):
                leaves[i] = self._writable(x, x, g)

        def first(ctx: Any, outs: list[torch.Tensor]) -> None:
            self.ctx, self.outputs = ctx, outs
            self.output_vmas = [ctx.vma(o) for o in outs]

        versions = call.input_versions(leaves)
        with self.comms:
            with torch.device(_META):
                outs = self.per_instance(call, inner_mode=MetaAliases, first=first)
            call.check_writes(leaves, versions, outs)
            if self.backward:
                _run_backward(outs)
        return [ShapeDtype(tuple(y.shape), y.dtype) for y in outs]

    def _local(self, x: torch.Tensor, spec: PartitionSpec, mesh: Mesh, grad: bool):
        local = _empty(local_shape(x.shape, spec, mesh._shape), x.dtype)
        local = self._writable(local, x, grad)
        assert self.ctx is not None  # made by run()
        return self.ctx.stamp_input(local, spec)

    def _writable(self, x: torch.Tensor, like: torch.Tensor, grad: bool) -> torch.Tensor:
        """The stand-in ``x`` of the meta argument ``like`` (``to_meta``), taking an in-place
        write exactly where the call's block does: a leaf where the argument is a leaf that
        requires grad (autograd refuses the write, on every backend); else no leaf (a copy),
        requiring grad where the argument does or the check differentiates with respect to it
        (``grad``), or a tensor that requires none."""
        if like.requires_grad and like.is_leaf:
            return x.requires_grad_()
        if not (like.requires_grad or grad and self.backward):
            return x
        with torch_private.DisableTorchFunction():
            return x.detach().requires_grad_().clone()

    def explain(self, error: RuntimeError, where: str) -> SpmdError | None:
        if isinstance(error, NotImplementedError) and "Meta tensors" in str(error):
            return SpmdError(
                f"{where}: check() runs the per-device function on shapes only (meta tensors), "
                f"and torch has no shape rule for the op at {user_line(error)}:\n"
                f"  {type(error).__name__}: {str(error).splitlines()[0]}\n"
                "Fix: run the call itself (on the simulated mesh) to check it."
            )
        if not any(s in str(error) for s in _NEEDS_DATA):
            return None
        return SpmdError(
            f"{where}: check() runs the per-device function on shapes only, and the "
            f"function needs tensor values at {user_line(error)}:\n"
            f"  {type(error).__name__}: {str(error).splitlines()[0]}\n"
            + (_VALUES_PER_INSTANCE if self.instances else _VALUES_UNDER_VMAP)
        )

    def report(self, fn_label: str, mesh: Mesh, out: Any, paths, specs) -> CheckReport:
        """The CheckReport of the call that ran; ``paths`` and ``specs`` per tensor output."""
        assert self.ctx is not None  # made by run()
        outputs = []
        global_leaves = iter(g for g in optree.tree_leaves(out) if isinstance(g, ShapeDtype))
        for path, leaf, vma, spec in zip(paths, self.outputs, self.output_vmas, specs):
            vtype = VType(leaf.dtype, tuple(leaf.shape), vma, mesh.axis_names)
            outputs.append(OutputCheck(path, spec, vtype, next(global_leaves).shape))
        return CheckReport(fn_label, mesh, outputs, out, list(self.comms.events))


def _run_backward(outs: list[torch.Tensor]) -> None:
    needed = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    if needed:
        torch.autograd.backward(needed, [_empty(o.shape, o.dtype) for o in needed])


__all__ = ["AbstractBackend", "AbstractContext", "to_meta", "wants_grad"]
