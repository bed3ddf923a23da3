"""Simulated backend: every instance of the mesh runs in this process under nested vmap.

One functorch vmap level per mesh axis, entered directly by :func:`run` (the nesting order is a
performance choice: :func:`simulation_order`, ``_plan._default_order``). A tensor's vma is the set of *our* levels it is
batched at: "unbatched at this level" is exactly "invariant over this axis". Every collective is
built from the level primitives of ``_levels`` (gather / reduce / vary / scatter / permute over
one level) plus ordinary torch ops, so autograd outside the simulation yields the global gradient
with no extra machinery. Those primitives act on the levels directly (a few microseconds) and
fall back to autograd.Functions with per-instance transposes under a grad or jvp *inside* the
per-device function.

Modules: this one (:func:`run`, the backend object); ``_primitives`` (the context and its
primitives); ``_plan``
(nesting order, cached input / output plans); ``_levels`` (the per-level primitives and their
fallback Functions); ``_lowered`` (the primitives under a grad / jvp inside the per-device
function); ``_recording`` (implicit-pvary accounting while a ``CommMode`` records);
``_inner_grad`` (implicit pvary under a torch.func.grad / vjp inside the per-device function);
``_instances`` (a value's per-instance blocks: printing inside the function); ``_diagnose`` (torch
errors of the user's code told per instance); ``_traced`` (the compile path: a call traced by
torch.compile, under public vmap, loaded only then).
"""

from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, cast

import torch

from ... import _blocks
from ... import _torch_private as torch_private
from ..._accounting import recording
from ..._calls import request_uneven_blocks, uneven_blocks_requested
from ..._capabilities import Capabilities
from ..._errors import SpmdError, VmaError, fn_label, reentrant_checkpoint
from ..._mesh import Mesh
from . import _inner_grad, _one_instance, _per_instance, _planned
from . import _instances as _instances  # installs the per-instance printing of values
from ._compiled import compiled_pieces_eagerly
from ._diagnose import explained
from ._plan import from_physical, input_entry, partial_input
from ._primitives import SimulatedContext
from ._recording import ImplicitPvaryRecorder

if TYPE_CHECKING:
    from ..._call import Call
    from ..._replay import Replay

# a grad level entered inside a call casts its implicit pvarys (``_inner_grad``)
torch_private.hook_grad_levels(_inner_grad.entered, _inner_grad.leaving)
# and gives the gradients torch.func.grad / vjp compute inside a call their inputs' types
torch_private.hook_transform_gradients(_inner_grad.typed_gradients)
# copy.deepcopy / copy.copy of an instance's value (a vmap-batched tensor) copy it, as a real mesh's
torch_private.copy_wrapped_deeply()
torch_private.copy_wrapped_shallowly()
# a Parameter made of an instance's value is a leaf that requires grad, as a real mesh's rank makes it
torch_private.parameters_made_wrapped(_instances.instance_leaf)
# a neg view (``x.conj().imag``) runs on every instance, as on a real mesh's rank
torch_private.batch_neg_views()


# vmap's warning that an op runs per instance through its fallback ("There is a performance
# drop ..."): the simulation, not the user, chose vmap, and a real mesh's rank runs the op
# plainly. Ignored while the user's function runs under the levels, and only then (a vmap of
# the user's own inside it too, and another thread's: the warning does not tell them apart);
# put in ``warnings.filters`` directly, without ``catch_warnings``, whose version bump would
# show again every warning already shown once at its line.
_FALLBACK_WARNING = (
    "ignore",
    re.compile("There is a performance drop because we have not yet implemented the batching"),
    UserWarning,
    None,
    0,
)


@torch_private.trace_constant  # (while Dynamo traces: run then, around the traced body)
def _hide_fallback_warning() -> bool:
    cast(list, warnings.filters).insert(0, _FALLBACK_WARNING)  # (a list; typed a Sequence)
    return True


@torch_private.trace_constant
def _show_fallback_warning() -> bool:
    with contextlib.suppress(ValueError):  # (the user replaced the list)
        cast(list, warnings.filters).remove(_FALLBACK_WARNING)
    return True


@contextlib.contextmanager
def fallback_warning_hidden() -> Iterator[None]:
    """vmap's fallback warning (``_FALLBACK_WARNING``) ignored inside; the eager and the
    compiled simulations run the user's function in it."""
    _hide_fallback_warning()
    try:
        yield
    finally:
        _show_fallback_warning()


def _run_body(
    call: Call, local, ctx: SimulatedContext, blocks: bool, table: Replay | None
) -> list[torch.Tensor]:
    mode = None
    if blocks and ctx.partial_mode is None:
        # inputs hold blocks: every op is typed, for the contractions that make partial sums,
        # once per signature (``_planned``)
        mode = ctx.partial_mode = _planned.begin(ctx, local, table)
        if ctx.marks_calls:  # run by the call's marker: one torch-function mode per op
            ctx.marker_typing = mode
        else:
            mode.__enter__()
    try:
        with fallback_warning_hidden():
            outs = list(call.body(local, ctx))
    finally:
        ctx.end_partial()
        ctx.varied.clear()  # (see ``SimulatedContext.varied``)
        ctx.input_numbers = None  # (by id: the inputs' ids are theirs only while they live)
    if mode is not None:
        _planned.finish(mode, table)
    return outs


# --- entering and leaving the simulation --------------------------------------------------
#
# The nesting order and the input / output plans are ``_plan``'s (cached per mesh, specs and
# shapes).

_override = threading.local()


@contextlib.contextmanager
def simulation_order(*axis_names: str) -> Iterator[None]:
    """Force the nesting order (outermost first) of simulated calls made inside the block.

    The default (``_plan._default_order``) puts
    innermost the axis that the most input bytes are replicated over, so replicated weights are
    not copied once per outer instance; override it to measure what that buys, or where the
    heuristic guesses wrong. Values, gradients and vma do not depend on the order, only speed
    and memory do.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2, 2), ("dp", "tp"))
        >>> f = ns.spmd_map(lambda x: ns.psum(x, "tp"), mesh=mesh, in_specs=ns.P("dp", "tp"), out_specs=ns.P("dp"))
        >>> with ns.simulation_order("tp", "dp"):  # dp innermost
        ...     f(torch.ones(2, 4))
        tensor([[2., 2.],
                [2., 2.]])
    """
    saved = getattr(_override, "order", None)
    _override.order = tuple(axis_names)
    try:
        yield
    finally:
        _override.order = saved


@contextlib.contextmanager
def simulate_per_instance() -> Iterator[None]:
    """Run simulated calls made inside the block per instance: each instance of the mesh on a
    thread of its own, on its own block, meeting the others at each collective (the
    execution that uneven blocks take anyway, ``_per_instance``), instead of all at once under
    vmap. The per-device function may then read values, as on a real mesh: ``.item()``,
    ``print`` of a block, a Python ``if`` on a value (each instance calling the same
    collectives). Values, gradients and types are vmap's; it costs a thread switch per
    collective and runs the instances one op at a time. Calls made inside the block take a dim
    the axes do not divide, in torch.chunk's blocks, on every backend: a real mesh then gives
    each rank its own block, with the same numbers (docs/uneven.md).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("x",))
        >>> f = ns.spmd_map(lambda v: v * int(v.sum().item() > 4), mesh=mesh, in_specs=ns.P("x"), out_specs=ns.P("x"))
        >>> with ns.simulate_per_instance():
        ...     f(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        tensor([0., 0., 3., 4.])
    """
    with request_uneven_blocks():
        yield


@functools.cache
def _token(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` on ``device``, made once: two factory calls cost ~15% of a small call.
    Shared between calls, so never handed to user code (see SimulatedContext.axis_index)."""
    with torch_private.DisableFuncTorch():  # a plain tensor, even under functionalize & co
        return torch.arange(n, device=device)


@functools.cache
def _load_decompositions() -> None:
    # torch.func.vmap registers some batching rules lazily on first use; we enter vmap levels
    # ourselves, so trigger it once.
    torch_private.lazy_load_decompositions()


def run(call: Call) -> list[torch.Tensor]:
    """Run ``call.body`` (per instance: local leaves -> local output tensors) on every instance.

    Returns the output tensors assembled to global values with ``call.out_specs()`` (known
    only once the body has run).

    The vmap levels are entered directly (what ``torch.func.vmap`` does inside, one level per
    axis, outermost first) rather than through nested ``vmap`` wrappers: that saves building the
    wrappers per call and, on the way out, lets an output stay free of the axes it is invariant
    over. ``vmap(out_dims=0)`` would expand it over them, and the instance-0 selection that
    followed cost a zero fill, a copy and a sum of the full expanded size in backward."""
    mesh, fn, leaves, specs = call.mesh, call.fn, call.leaves, call.specs
    if mesh.size == 1:  # nothing to batch: the function runs once (``_one_instance``)
        return _one_instance.run(call)
    _load_decompositions()
    forced = getattr(_override, "order", None)
    if forced is not None and sorted(forced) != sorted(mesh.axis_names):
        raise SpmdError(
            f"spmd_map of {fn_label(fn)}: simulation_order{forced} does not list the mesh's axes "
            f"{mesh.axis_names} exactly once each. Fix: e.g. "
            f"ns.simulation_order{tuple(reversed(mesh.axis_names))}."
        )
    entry = input_entry(call, forced)
    local = list(leaves)
    for i, split, perm in entry.views:
        x = leaves[i].reshape(split)
        local[i] = x if perm is None else x.permute(perm)
    device = torch.device("cpu") if entry.first is None else leaves[entry.first].device
    # a call whose inputs hold blocks is typed per op once per signature (``_planned``); its
    # table is looked up outside the levels (a transform around the call is typed every time)
    table = _planned.lookup(call) if entry.blocks else None
    order = entry.order
    tokens = {a: _token(mesh.shape[a], device) for a in order}
    levels: list[int] = []
    try:
        for a, batched in zip(order, entry.batched):  # outermost first: each input's mesh
            level = torch_private.vmap_increment_nesting(mesh.shape[a], "same")  # dims lead
            levels.append(level)  # in nesting order
            for i in batched:
                local[i] = torch_private.add_batch_dim(local[i], 0, level)
            tokens[a] = torch_private.add_batch_dim(tokens[a], 0, level)
        ctx = SimulatedContext(mesh, fn, tokens)
        for i in entry.partial:
            local[i] = ctx.stamp(partial_input(ctx, local[i], specs[i]), specs[i].vma())
        for i in entry.blocks:
            _blocks.mark(local[i], specs[i], ctx.token)
        blocks = bool(entry.blocks)
        if recording():  # report implicit pvary's backward psum; off the fast path
            ctx.recorder = ImplicitPvaryRecorder(ctx)
            with ctx.recorder:
                outs = _run_body(call, local, ctx, blocks, table)
        else:
            outs = _run_body(call, local, ctx, blocks, table)
        present: list[list[str]] = [[] for _ in outs]
        while levels:  # innermost first, each while its level is still the top one
            level, a = levels[-1], order[len(levels) - 1]
            for j, y in enumerate(outs):
                y = torch_private.unwrap_if_dead(y)
                if torch_private.maybe_get_level(y) == level:
                    y = torch_private.remove_batch_dim(y, level, mesh.shape[a], 0)
                    present[j].insert(0, a)
                outs[j] = y
            torch_private.vmap_decrement_nesting()
            levels.pop()
    finally:
        for _ in levels:
            torch_private.vmap_decrement_nesting()
    return [from_physical(y, p, s, mesh) for y, p, s in zip(outs, present, call.out_specs())]


# Messages of functorch errors that mean "this code cannot run per instance under vmap".
_VMAP_LIMITS = (
    "vmap",
    "Batching rule",
    "batched tensor",
    ".item()",
    "data-dependent",
    "Cannot access data pointer",  # .tolist() / .numpy() of a batched tensor
)
# ... and those of an in-place write whose operand has instances the target lacks (an ``out=``
# op has no batching rule at all: vmap refuses it whatever the target)
_INPLACE_UNDER_VMAP = (
    "inplace arithmetic",
    "doesn't match the broadcast shape",
    "fallback path doesn't work on out=",
)


# vmap's message for an op it cannot batch, naming the aten op and overload
_NO_BATCHING_RULE = re.compile(r"Batching rule not implemented for (aten::[\w.]+)")


def _writes(op: str) -> bool:
    """Whether aten ``op`` (``aten::name.overload``) writes into an argument: an in-place
    variant (``add_``) or an ``out=`` overload (``add.out``, ``sum.IntList_out``)."""
    name, _, overload = op.removeprefix("aten::").partition(".")
    return name.endswith("_") or overload == "out" or overload.endswith("_out")


def _no_batching_rule(op: str, error: RuntimeError, where: str) -> SpmdError:
    if op.endswith(".Tensor"):
        fix = (
            "Its `.Tensor` form takes as a tensor an argument that torch also takes as a Python "
            "number (a start, length, index or size). Fix: pass a Python int there, e.g. "
            "torch.narrow(x, 0, 1, 2) rather than torch.narrow(x, 0, torch.tensor(1), 2); a "
            "position known only as a tensor can select with torch.index_select instead."
        )
    else:
        fix = (
            "Fix: an equivalent that vmap batches (Python numbers rather than tensors for "
            "scalar arguments, indexing, torch.index_select or torch.gather)."
        )
    return SpmdError(
        f"{where}: the simulated mesh runs every instance at once under torch.func.vmap, which "
        f"has no batching rule for `{op}` (the op with these argument types); no write is "
        f"involved, and a real mesh, each rank running its own block, needs none:\n  {error}\n"
        + fix
    )


def _raised_in_checkpoint(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        tb = tb.tb_next
    return False


# torch errors of the user's code told per instance; compiled pieces of it run uncompiled
_run_eagerly = compiled_pieces_eagerly(explained(run))


class SimulatedBackend:
    """Every instance in this process, under nested vmap (the default backend)."""

    name = "simulated"
    # _traced: the whole call traced into the graph; one process holds every instance; blocks
    # of unequal sizes run per instance (``_per_instance``)
    capabilities = Capabilities(traceable=True, local_blocks=False, uneven_blocks=True)

    def accepts(self, mesh: Mesh) -> bool:
        return mesh.device_mesh is None

    def make_mesh(
        self, shape: tuple[int, ...], names: tuple[str, ...], device_type: str | None
    ) -> Mesh:
        """``make_mesh`` of a mesh simulated in this process (``backends.make_mesh``)."""
        return Mesh(shape, names, device_type=device_type or "cpu")

    def uneven_state(self) -> bool:
        """Whether calls made now run per instance (``simulate_per_instance``)."""
        return uneven_blocks_requested()

    def run(self, call: Call) -> list[torch.Tensor]:
        if torch.compiler.is_compiling():  # traced by torch.compile: the graph's own path
            from . import _traced  # imports Dynamo, loaded by now (not with every eager call)

            return _traced.run(call)
        mesh, versions = call.mesh, call.input_versions(call.leaves)
        if mesh.size > 1 and (self.uneven_state() or call.unequal_blocks()):
            outs = _per_instance.run(call)
        else:
            outs = _run_eagerly(call)
        call.check_writes(call.leaves, versions, outs)
        return outs

    def explain(self, error: RuntimeError, where: str) -> SpmdError | None:
        text = str(error)
        missing = _NO_BATCHING_RULE.search(text)
        if missing is not None and not _writes(missing.group(1)):
            return _no_batching_rule(missing.group(1), error, where)
        if any(s in text for s in _INPLACE_UNDER_VMAP):
            return VmaError(
                f"{where}: an in-place write failed under the simulated mesh:\n  {error}\n"
                "If it writes a value that varies over mesh axes into a tensor invariant over "
                "them (an in_spec P() input or a closed-over tensor), every instance would "
                "hold different values in what is typed replicated. Fix: compute out of "
                "place (y = x + v instead of x += v)."
            )
        if "setup_context" in text and _raised_in_checkpoint(error):
            return reentrant_checkpoint(where)
        if any(s in text for s in _VMAP_LIMITS):
            return SpmdError(
                f"{where}: the per-device function failed under the simulated mesh, "
                f"which runs every instance at once with torch.func.vmap:\n  {error}\n"
                "Per-instance code cannot use .item(), data-dependent Python control flow "
                "(if on tensor values), nonzero(), or in-place writes into captured tensors. "
                "Fix: use torch.where / masks instead of branching on values."
            )
        return None


BACKEND = SimulatedBackend()
