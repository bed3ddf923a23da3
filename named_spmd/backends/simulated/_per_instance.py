"""The per-instance execution of a simulated call: one thread per instance, each on its own block.

vmap batches blocks of one shape only; blocks of different sizes (a dim the axes do not divide)
need each instance to run on its own. Here each instance runs the per-device function on a
thread of its own (instance 0 on the caller's), typed per tensor by stamps and ``VmaMode`` as on
a real mesh (torch's function-mode stack is per thread, and so is the active call): the types,
the out_specs check and the partial-sum inference are the real mesh's. The collectives' primitives
meet (``_meeting``): the last instance to arrive computes every instance's result with ordinary
torch ops, so the autograd graph joins the instances and ``backward`` from the caller needs no
threads. Like a real mesh, an instance may read values (``.item()``, ``print``, a Python ``if``),
as long as every instance calls the same collectives in one order.

What it does not do (each a clear error or documented): a collective under a ``torch.func``
transform (functorch's levels are per thread), a call under an outer transform, random ops
inside the function (the threads would draw from the one generator in no fixed order; ``ns.random``
runs: its draws are seeded per instance).
"""

from __future__ import annotations

import contextlib
import copy
import functools
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from ... import _torch_private as torch_private
from ..._errors import (
    SpecError,
    SpmdError,
    fn_label,
    operand_dtypes_differ,
    operand_shapes_differ,
    shared_input_written,
    told_per_instance,
)
from ..._layout import (
    chunk_sizes,
    concat_blocks,
    coords_of,
    coords_text,
    group_size,
    groups,
    index_of,
    instances_problem,
    layout_problem,
    split_all,
    split_index,
)
from ..._mesh import Mesh
from ..._spec import PartitionSpec
from ..._stamps import MemberContext
from ..._tracking import VmaMode
from . import _stacked as stacked
from ._agreeing import check_one_value, shared_inputs
from ._meeting import Aborted, Meeting

if TYPE_CHECKING:
    from ..._call import Call

Tensor = torch.Tensor


class InstanceContext(MemberContext):
    """One instance's call: stamped types; primitives that meet the other instances."""

    def __init__(self, mesh: Mesh, fn: Any, meeting: Meeting, index: int, device: torch.device):
        super().__init__(mesh, fn)
        self.meeting = meeting
        self.index = index
        self.coords = coords_of(index, mesh.axis_names, mesh._shape)
        self.device = device
        self.op = ""  # the collective being applied (what a mismatch names)
        self.operand_shape: tuple[int, ...] = ()  # its operand's, as given (``all_to_all``)

    def member(self, axes: tuple[str, ...]) -> int:
        return index_of(axes, self.coords, self.mesh._shape)

    def member_device(self) -> torch.device:
        return self.device

    def apply(self, rec, x, axes, params, user_operand=False):
        # The primitives are plain differentiable torch ops across the instances: autograd
        # differentiates them (no declared transpose needed), as under vmap.
        if torch_private.transforms_active():
            raise SpmdError(
                f"{rec.name} in {self.fn_label}: a collective under a torch.func transform "
                "inside the per-device function cannot run on the per-instance simulation "
                "(each instance's transform levels live on its own thread). Fix: use even "
                "blocks (the vmap simulation), or differentiate outside the mapped function."
            )
        self.op, self.operand_shape = rec.name, tuple(x.shape)
        with torch_private.DisableTorchFunction():
            return rec.forward(self, x, axes, params)

    def _meet(self, x: Any, axes, params: tuple, per_group) -> Tensor:
        members = groups(tuple(axes), tuple(self.mesh._shape.items()))
        key = (self.op, axes, params)
        return self.meeting.exchange(
            self.index, key, x, lambda xs: _each_group(members, xs, per_group, self)
        )

    uneven = True  # the members' blocks may differ in size

    # --- primitives -----------------------------------------------------------------------
    def all_gather_tiled(self, x, axes, dim, sizes=None):
        return self._meet(x, axes, ("tiled", dim), functools.partial(_gather_tiled, dim, self))

    def reduce_scatter_tiled(self, x, axes, dim, sizes=None):
        return self._meet(x, axes, ("tiled", dim), functools.partial(_scatter_chunks, dim, self))

    def pvary(self, x, axes):
        return x.view_as(x)  # autograd sums the gradients of every instance's use

    def own_block(self, x, axes, dim):
        return x.select(dim, self.member(axes))

    def all_reduce(self, x, axes, op):
        return self._meet(x, axes, (op,), functools.partial(_reduce, op, self))

    def all_gather(self, x, axes):
        return self._meet(x, axes, (), functools.partial(_gather, self))

    def reduce_scatter(self, x, axes, dim):
        return self._meet(x, axes, (dim,), functools.partial(_reduce_scatter, dim, self))

    def all_to_all(self, x, axes, dim):
        # with the operand's shape as given (``x`` may be its blocks, ``split_blocks``): the
        # shapes the members' operands are compared by, as on a real mesh
        given = (x, self.operand_shape)
        return self._meet(given, axes, (dim,), functools.partial(_all_to_all, dim, self))

    own_values = True  # each instance's tensors are its own: sizes may differ, read on host

    def all_to_all_sizes(self, x, axes, dim, sent, received):
        # each member's chunk sizes travel with its operand: they differ between members
        return self._meet((x, sent), axes, ("sizes", dim), functools.partial(_sized, dim))

    def permute(self, x, axes, pairs):
        return self._meet(x, axes, (pairs,), functools.partial(_permute, pairs, self))

    def broadcast(self, x, axes, root):
        return self._meet(x, axes, (root,), functools.partial(_broadcast, root, self))


# --- what the last instance to arrive computes, per group -----------------------------------------


def _each_group(groups, xs: list[Any], per_group, ctx: InstanceContext) -> list[Tensor]:
    out: list[Any] = [None] * len(xs)
    for members in groups:
        _same_dtypes(ctx, [xs[m][0] if isinstance(xs[m], tuple) else xs[m] for m in members])
        for m, r in zip(members, per_group([xs[m] for m in members])):
            out[m] = r
    return out


def _same_dtypes(ctx: InstanceContext, xs: Sequence[Tensor]) -> None:
    # every collective moves one dtype: a real mesh sends bytes, read as its own operand's
    if len({x.dtype for x in xs}) > 1:
        raise operand_dtypes_differ(ctx.op, ctx.fn_label, [x.dtype for x in xs])


def _same_shapes(ctx: InstanceContext, xs: Sequence[Tensor]) -> None:
    _same(ctx, [tuple(x.shape) for x in xs])


def _same(ctx: InstanceContext, shapes: list[tuple]) -> None:
    """Every member's operand of one shape (``shapes``, in member order), or the error."""
    if len(set(shapes)) > 1:
        raise operand_shapes_differ(ctx.op, ctx.fn_label, shapes)


def _copies(x: Tensor, n: int) -> list[Tensor]:
    """One tensor per member (each gets its own stamp, and may write into its own)."""
    return [x] + [x.clone() for _ in range(n - 1)]


def _total(op: str, ctx: InstanceContext, xs: list[Tensor]) -> Tensor:
    """The elementwise ``op`` of the members' operands, in the operands' dtype."""
    _same_shapes(ctx, xs)
    return stacked.reduce(xs, stacked.reduction(op, xs[0].dtype))


def _reduce(op: str, ctx: InstanceContext, xs: list[Tensor]) -> list[Tensor]:
    return _copies(_total(op, ctx, xs), len(xs))


def _gather(ctx: InstanceContext, xs: list[Tensor]) -> list[Tensor]:
    _same_shapes(ctx, xs)
    return _copies(torch.stack(xs), len(xs))


def _gather_tiled(dim: int, ctx: InstanceContext, xs: list[Tensor]) -> list[Tensor]:
    """The blocks concatenated along ``dim``, whatever their sizes there (one copy each); their
    other dims must agree."""
    shapes = [tuple(x.shape) for x in xs]
    if len({s[:dim] + s[dim + 1 :] for s in shapes}) > 1:
        raise operand_shapes_differ(ctx.op, ctx.fn_label, shapes, but=dim)
    return _copies(torch.cat(xs, dim), len(xs))


def _scatter_chunks(dim: int, ctx: InstanceContext, xs: list[Tensor]) -> list[Tensor]:
    """The sum, member j keeping block j of ``dim`` as ``P(axes)`` splits a dim
    (``_layout.dim_sizes``: torch.chunk's sizes where the group does not divide it)."""
    total = _total("sum", ctx, xs)
    sizes = chunk_sizes(total.shape[dim], len(xs))
    return _own(total.split(sizes, dim))


def _reduce_scatter(dim: int, ctx: InstanceContext, xs: list[Tensor]) -> list[Tensor]:
    total = _total("sum", ctx, xs)
    return _own(total.unbind(dim))


def _own(blocks: Sequence[Tensor]) -> list[Tensor]:
    """Each member's block as a tensor of its own, as a real mesh's receive buffer: a view of
    the one total would be a multi-output op's, which autograd refuses a write into, and its
    writes would meet the other members' in the total's autograd history."""
    return [b.clone() for b in blocks]


def _all_to_all(dim: int, ctx: InstanceContext, given: list[tuple]) -> list[Tensor]:
    _same(ctx, [shape for _, shape in given])
    xs = [x for x, _ in given]
    return [torch.stack([x.select(dim, i) for x in xs], dim) for i in range(len(xs))]


def _sized(dim: int, xs: list[Any]) -> list[Tensor]:
    """Member i gets chunk i of every member's operand (cut by that member's sizes),
    concatenated along ``dim`` in member order."""
    chunks = [x.split(list(sent), dim) for x, sent in xs]
    return [torch.cat([c[i] for c in chunks], dim) for i in range(len(xs))]


def _broadcast(root: int, ctx: InstanceContext, xs: list[Tensor]) -> list[Tensor]:
    _same_shapes(ctx, xs)
    return [xs[root].clone() for _ in xs]


def _permute(pairs, ctx: InstanceContext, xs: list[Tensor]) -> list[Tensor]:
    # one shape for every member, as a real mesh's receive buffers (each its own operand's)
    _same_shapes(ctx, xs)
    source = {dst: src for src, dst in pairs}
    # a member that receives nothing gets zeros still joined to its operand in autograd (a zero
    # gradient), as on a real mesh: its backward runs (and a CommMode counts it) on every member
    return [xs[source[j]].clone() if j in source else xs[j].clone().zero_() for j in range(len(xs))]


# --- the call ------------------------------------------------------------------------------------


class _InstanceMode(VmaMode):
    """The vma tracking of one instance, refusing random ops (their draws would depend on the
    order in which the threads reach them)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if _draws(getattr(func, "__name__", ""), args, kwargs):
            raise SpmdError(
                f"{getattr(func, '__name__', func)} in {self.ctx.fn_label}: random ops cannot "
                "run on the per-instance simulation (its instance threads would draw from the "
                "one generator in no fixed order). Fix: ns.random's draws (seeded per "
                "instance: the same values as the vmap simulation and a real mesh), or draw "
                "the values outside the mapped function and pass them in."
            )
        return super().__torch_function__(func, types, args, kwargs)


_RANDOM_NAMES = frozenset(
    {"rand", "randn", "randint", "randperm", "rand_like", "randn_like", "randint_like"}
    | {"bernoulli", "bernoulli_", "normal", "normal_", "uniform_", "multinomial", "poisson"}
    | {"random_", "exponential_", "geometric_", "cauchy_", "log_normal_", "gumbel_softmax"}
    | {"fractional_max_pool2d", "fractional_max_pool3d", "native_dropout"}
)
# Ops that draw only while training: the position of their flag, and its default.
_WHILE_TRAINING = {
    name: (2, True)
    for name in (
        *("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout"),
        *("feature_alpha_dropout", "feature_dropout", "dropout_", "alpha_dropout_"),
    )
} | {"rrelu": (3, False), "rrelu_": (3, False)}


def _draws(name: str, args: tuple, kwargs: dict | None) -> bool:
    """Whether an op of this name, called so, draws random numbers (dropout in eval mode does
    not; rrelu draws only with ``training=True``)."""
    if name in _RANDOM_NAMES:
        return True
    if name not in _WHILE_TRAINING:
        return False
    index, default = _WHILE_TRAINING[name]
    kwargs = kwargs or {}
    flag = kwargs.get(
        "training", kwargs.get("train", args[index] if len(args) > index else default)
    )
    return bool(flag)


def _inputs(mesh: Mesh, leaves: list[Any], specs: list[PartitionSpec]) -> list[list[Any]]:
    """Every instance's blocks of the leaves: a tensor object of its own for every tensor leaf
    (each instance stamps its own), views of the caller's tensors (autograd joins them)."""
    names, sizes = mesh.axis_names, mesh._shape
    per_leaf = [
        split_all(leaf, spec, sizes) if isinstance(leaf, Tensor) and spec.axes else None
        for leaf, spec in zip(leaves, specs)
    ]
    out = []
    for i in range(mesh.size):
        coords = coords_of(i, names, sizes)
        mine: list[Any] = []
        for leaf, spec, blocks in zip(leaves, specs, per_leaf):
            if not isinstance(leaf, Tensor):
                mine.append(leaf)
                continue
            x = leaf if blocks is None else blocks[split_index(spec, leaf.dim(), sizes, coords)]
            x = torch_private.leaf_stand_in(x)
            if any(coords[a] != 0 for a in spec.unreduced):
                x = torch.zeros_like(x)  # parts of the value: the first member's is the value
            mine.append(x)
        out.append(mine)
    return out


def _body_on(
    ctx: InstanceContext,
    body: Callable[..., Any],
    local: list[Any],
    specs: list[PartitionSpec],
    inner_mode: Callable[[], Any] | None,
) -> list[Tensor]:
    local = [ctx.stamp_input(x, s) if isinstance(x, Tensor) else x for x, s in zip(local, specs)]
    with _InstanceMode(ctx), inner_mode() if inner_mode else contextlib.nullcontext():
        return body(local, ctx)


def run(
    call: Call,
    *,
    inner_mode: Callable[[], Any] | None = None,
    first: Callable[[InstanceContext, list[Tensor]], None] | None = None,
) -> list[Tensor]:
    """``call.body`` on every instance, each on its own thread and block; outputs assembled.

    For the check mode, which runs this on meta tensors: ``inner_mode`` makes a torch-function
    mode each instance enters inside its own (one that moves closed-over tensors to meta), and
    ``first`` is given instance 0's context and outputs (what its report types)."""
    mesh, fn, leaves, specs = call.mesh, call.fn, call.leaves, call.specs
    label = fn_label(fn)
    if torch_private.transforms_active():
        raise SpmdError(
            f"spmd_map of {label}: a call under a torch.func transform cannot run on the "
            "per-instance simulation (functorch's levels are per thread). Fix: use even blocks "
            "(the vmap simulation), or Tensor.backward / torch.autograd.grad around the call."
        )
    n = mesh.size
    meeting = Meeting(n, label, mesh.axis_names, mesh._shape)
    device = next((x.device for x in leaves if isinstance(x, Tensor)), torch.device("cpu"))
    with torch_private.DisableTorchFunction():  # our bookkeeping: no op of the program
        inputs = _inputs(mesh, leaves, specs)
    shared = shared_inputs(mesh._shape, leaves, specs)
    outs: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n
    records = [copy.copy(call) for _ in range(n)]  # each instance records its own outputs
    state = _caller_state(device.type)
    modes = [torch_private.function_mode_at(i) for i in range(torch_private.function_mode_depth())]

    def instance(i: int) -> None:
        ctx = InstanceContext(mesh, fn, meeting, i, device)
        failed = True
        try:
            outs[i] = _body_on(ctx, records[i].body, inputs[i], specs, inner_mode)
            failed = False
            if i == 0 and first is not None:
                first(ctx, outs[i])
        except BaseException as e:  # noqa: BLE001 - told by the caller's thread
            errors[i] = e
        finally:
            meeting.finish(i, failed)

    def worker(i: int) -> None:
        with contextlib.ExitStack() as stack:
            for enter in state:
                stack.enter_context(enter())
            for m in modes:  # the caller's torch-function modes (a torch.device block & co)
                torch_private.push_function_mode(m)
            try:
                instance(i)
            finally:
                for _ in modes:
                    torch_private.pop_function_mode()

    others = [_POOL.submit(worker, i) for i in range(1, n)]
    instance(0)
    for f in others:
        f.result()  # (worker catches everything: the errors are in ``errors``)
    _raise_first(meeting, errors, call, inputs)
    for x, spec, version in shared:
        if torch_private.version(x) != version:
            raise shared_input_written(f"spmd_map of {label}", tuple(x.shape), spec)
    call.take_outputs(records[0])
    wheres = call.out_wheres()
    problem = instances_problem(
        f"spmd_map of {label}",
        [r.structure() for r in records],
        lambda i, j: outs[i][j].shape,
        call.out_specs(),
        wheres,
        mesh._shape,
    )
    if problem is not None:
        raise problem
    return [
        _assemble(mesh, [o[j] for o in outs], s, label, wheres[j], call.mapped.check_vma)
        for j, s in enumerate(call.out_specs())
    ]


def _caller_state(device_type: str) -> list[Callable[[], Any]]:
    """The caller's thread-local torch state, re-entered on each instance thread: grad and
    inference mode, autocast (for the inputs' device and the CPU), so that every instance computes
    as the caller's thread does (the torch-function modes are pushed separately)."""
    state: list[Callable[[], Any]] = [
        functools.partial(torch.set_grad_enabled, torch.is_grad_enabled())
    ]
    if torch.is_inference_mode_enabled():
        state.append(torch.inference_mode)
    for kind in dict.fromkeys((device_type, "cpu")):  # (no autocast on meta: the check)
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            dtype = torch.get_autocast_dtype(kind)
            cache = torch.is_autocast_cache_enabled()
            state.append(functools.partial(torch.autocast, kind, dtype, cache_enabled=cache))
    return state


# Instance threads, kept between calls (starting seven threads cost more than a small call).
# Every instance of a call must run at once (they meet), so the pool never makes a call wait for
# a thread: it grows to the largest number of instances ever running at once.
_POOL = ThreadPoolExecutor(max_workers=1 << 16, thread_name_prefix="named_spmd-instance")


def _raise_first(
    meeting: Meeting, errors: list[BaseException | None], call: Call, inputs: list[list[Any]]
) -> None:
    """The error of the lowest instance that raised one of its own (the others stopped at a
    meeting that could not complete), naming the instance (a torch op's rejection of its
    operands, an empty block of ``inputs`` among them: an SpmdError, as a real mesh's rank tells
    it)."""
    for i, e in enumerate(errors):
        if e is not None and not isinstance(e, Aborted):
            coords = coords_text(coords_of(i, meeting.names, meeting.sizes))
            where, at = f"spmd_map of {meeting.label}", f"the instance at {coords}"
            told = told_per_instance(e, where, at, call.empty_block(inputs[i]))
            if told is not None:  # as a real mesh's rank tells it
                raise told from e
            if hasattr(e, "add_note") and not isinstance(e, SpmdError) and meeting.n > 1:
                e.add_note(
                    f"[named_spmd] raised by the instance at {coords} (per-instance simulation)"
                )
            raise e
    if meeting.stuck is not None:
        raise meeting.stuck


def _assemble(
    mesh: Mesh, values: list[Tensor], spec: PartitionSpec, label: str, where: str, check: bool
) -> Tensor:
    """The global output ``where`` from every instance's value (row-major over the mesh): the
    blocks of the axes ``spec`` names concatenated, the parts of those it declares unreduced
    summed, and the value at coordinate 0 of any other axis (invariant there, or unchecked)."""
    names, sizes = mesh.axis_names, mesh._shape
    named = [a for a in names if a in spec.axes]
    summed = [a for a in names if a in spec.unreduced]
    problem = layout_problem(
        [(x.dim(), x.dtype) for x in values],
        lambda c: values[index_of(names, c, sizes)].shape,
        spec,
        sizes,
        names,
        where,
    )
    if problem is not None:
        raise SpecError(f"spmd_map of {label}: {problem}")
    if check:  # (check_vma)
        check_one_value(mesh, values, spec, label, where)
    blocks = []
    for b in range(group_size(named, sizes)):
        at = dict.fromkeys(names, 0) | coords_of(b, named, sizes)
        parts = [
            values[index_of(names, at | coords_of(u, summed, sizes), sizes)]
            for u in range(group_size(summed, sizes))
        ]
        blocks.append(functools.reduce(torch.add, parts) if len(parts) > 1 else parts[0])
    if not named:
        return blocks[0].view_as(blocks[0])  # a tensor object of the caller's
    return concat_blocks(blocks, spec, sizes, named)
