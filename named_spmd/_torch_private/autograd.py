"""autograd, forward AD, checkpoint's device-context marker, the torch-function mode stack,
make_fx's dispatch mode, a view's source and the reference counts donation compares."""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._device
from torch.autograd import forward_ad

# --- autograd ----------------------------------------------------------------------------------
# Function.apply binds its arguments in Python (~10 us) when setup_context is defined; the C
# apply skips that where no torch.func transform needs the Python path.
function_base_apply = torch._C._FunctionBase.__dict__["apply"]
current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
# (torch's stubs lack AccumulateGrad and Tensor._use_count, both bound in C++)
AccumulateGrad = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
AddBackward = torch._C._functions.AddBackward0  # type: ignore[attr-defined]  # (a + b)'s node
below_autograd = torch._C._AutoDispatchBelowAutograd


# What a reentrant checkpoint's forward (``CheckpointFunction.forward``, under no_grad) calls
# first through the torch function modes: ``torch.no_grad().__enter__``'s grad-mode switch.
set_grad_enabled = torch._C._set_grad_enabled


def in_reentrant_checkpoint() -> bool:
    """Whether the caller runs inside ``torch.utils.checkpoint``'s reentrant forward
    (``CheckpointFunction.forward``, a few frames up), whose recomputation in backward runs
    outside whatever context the forward ran in."""
    # the chain is CheckpointFunction.forward -> no_grad.__enter__ -> set_grad_enabled's
    # switch -> the mode: a few frames; matched by code object, as other functions of that
    # module are named forward too (checkpoint_sequential's segments, non-reentrant)
    code = _reentrant_forward_code()
    frame = sys._getframe(1)
    for _ in range(6):
        frame = frame.f_back  # type: ignore[assignment]
        if frame is None:
            return False
        if frame.f_code is code:
            return True
    return False


def _reentrant_forward_code() -> Any:
    from torch.utils import checkpoint  # (lazy: a heavy import, needed only here)

    return checkpoint.CheckpointFunction.forward.__code__


def queue_callback(fn: Any) -> None:
    """Run ``fn`` at the end of the current backward pass (RuntimeError outside one)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


# The innermost forward-AD dual level, -1 outside ``forward_ad.dual_level`` (a module global torch
# reassigns, with no public reader): a collective records its jvp only inside one. A partial of the
# builtin getattr reads it with no Python frame (``_autodiff.differentiable`` is per collective).
forward_level = functools.partial(getattr, forward_ad, "_current_level")


@functools.cache
def control_flow_exceptions() -> tuple[type[BaseException], ...]:
    """Exceptions torch raises through user code to steer itself, not failures of it:
    non-reentrant checkpointing stops a recomputation early with one (in double backward too)."""
    from torch.utils.checkpoint import _StopRecomputationError

    return (_StopRecomputationError,)


# --- torch.utils.checkpoint: how a recomputation finds its call again ---------------------------
# Non-reentrant checkpoint re-enters, around its recomputation in backward, the innermost
# torch-function mode of the forward that is a ``DeviceContext`` (torch.utils.checkpoint:
# "recompute_fn should respect the device context of the original forward"). A call pushes one
# (``_calls.CallMarker``) so that the recomputation re-establishes the call (docs/design.md
# section 8). The mode stack is edited directly: a marker is removed wherever it sits, since a
# ``torch.device`` block entered inside the call reorders the stack.
DeviceContext = torch.utils._device.DeviceContext


def saved_tensors_hooks_active() -> bool:
    """Whether saved-tensor hooks are in effect: inside a non-reentrant checkpoint's forward (or
    a user's ``saved_tensors_hooks``). A call that saw none needs no marker in its replays."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


function_mode_depth = torch.overrides._len_torch_function_stack
function_mode_at = torch._C._get_function_stack_at  # the mode at depth i, 0 the bottom
push_function_mode = torch.overrides._push_mode
pop_function_mode = torch.overrides._pop_mode


def remove_function_mode(found: Callable[[Any], bool]) -> Any:
    """Take the topmost torch function mode for which ``found(mode)`` is true off the stack,
    wherever it sits (a ``torch.device`` block moves DeviceContext modes to the bottom), the
    modes above it staying on in their order; returns it, or None where there is none."""
    above = []
    removed = None
    while function_mode_depth():
        mode = pop_function_mode()
        if found(mode):
            removed = mode
            break
        above.append(mode)
    for mode in reversed(above):
        push_function_mode(mode)
    return removed


def without_function_modes(start: Any) -> Any:
    """``start()`` (a c10d collective's start) with the torch function mode stack empty. A work
    keeps a copy of the thread-local state it was made under, the mode stack among it, until
    the backend's worker thread lets go of it, after the wait returns (on gloo a moment later, or
    longer on a loaded host); a call's modes hold its context, and with it its inputs."""
    n = function_mode_depth()
    if not n:
        return start()
    modes = [pop_function_mode() for _ in range(n)]
    try:
        return start()
    finally:
        for mode in reversed(modes):
            push_function_mode(mode)


# Library-internal ops run without the user-visible TorchFunctionModes (vma tracking).
DisableTorchFunction = torch._C.DisableTorchFunction
# Whether an op on (or an attribute read of) a tensor dispatches through ``__torch_function__``:
# a mode on the stack or a subclass's override, and torch function not disabled. Where it does
# not, a read needs no DisableTorchFunction (entering one costs more than the read).
has_torch_function = torch._C._has_torch_function_unary
_function_modes_on = torch._C._is_torch_function_mode_enabled


def unseen_reads(read: Callable[..., Any], *args: Any) -> Any:
    """``read(*args)``, a walk over many tensors' metadata (types, shapes, versions), with no
    torch function mode seeing each read: under one (``torch.set_default_device``'s
    ``DeviceContext``, a user's mode), every attribute read is a call into its Python
    ``__torch_function__``. Entered only where a mode is on: entering costs more than a read."""
    if not _function_modes_on():
        return read(*args)
    with DisableTorchFunction():
        return read(*args)


# --- make_fx (torch.func.linearize, torch.export, AOT autograd) ---------------------------------
_PROXY_MODE = torch._C._TorchDispatchModeKey.PROXY


def proxy_tracing() -> bool:
    """Whether ``make_fx`` traces: its proxy mode is on the dispatch mode stack. Its graph
    records only dispatched ops, so a call then communicates with functional collectives, and
    reads values (a check's result) of its own tensors made outside the trace
    (:func:`no_dispatch_modes`)."""
    return torch._C._get_dispatch_mode(_PROXY_MODE) is not None


def graph_traced() -> bool:
    """Whether ``make_fx`` (:func:`proxy_tracing`) or ``torch.export`` (non-strict: make_fx
    pre-dispatch, whose mode is not on the dispatch stack; strict: Dynamo) records the call
    into a graph that is run again: a real call's outputs are then plain global tensors, made
    by the graph's own ops (a DTensor built outside them would be a constant of the graph). The
    dispatch stack is not read while Dynamo traces (it cannot)."""
    if torch.compiler.is_exporting():
        return True
    return not torch.compiler.is_dynamo_compiling() and proxy_tracing()


def dispatch_modes_active() -> bool:
    """Whether a dispatch mode is on (``make_fx``'s proxy mode, a fake or functional mode)."""
    return torch._C._len_torch_dispatch_stack() > 0


def no_dispatch_modes() -> Any:
    """A context without the dispatch modes (``make_fx``'s proxy mode among them): the
    library's bookkeeping (the start-of-call check) runs eagerly, not into a traced graph."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


def unobserved(run: Callable[[], Any]) -> Any:
    """``run()`` with nothing watching it: no Python trace or profile function, no torch
    function or dispatch mode. Reference counts calibrated under ``run`` are a bare
    interpreter's, whatever a debugger, tracer or logging mode around the import holds (such a
    holder would make a tensor held elsewhere count as one nothing holds)."""
    trace, profile = sys.gettrace(), sys.getprofile()
    sys.settrace(None)
    sys.setprofile(None)
    try:
        with no_dispatch_modes():
            return without_function_modes(run)
    finally:
        sys.settrace(trace)
        sys.setprofile(profile)


# --- reference counts: may a buffer be overwritten in place? ----------------------------------
# A view's base tensor, None for a non-view (``Tensor._base``): a view shares its buffer, so it is
# never overwritten. An attrgetter: a C call that keeps no reference to the tensor it is given
# (donation compares the tensor's reference counts with calibrated ones right after).
tensor_base = operator.attrgetter("_base")
refcount = sys.getrefcount  # the Python reference count of an object (CPython)


#: ``x``'s version counter (``Tensor._version``), which every in-place write to its storage
#: through ``x`` or a view of it bumps: whether an input was written. An attrgetter: read for
#: every tensor input under grad mode, twice per call, ``map`` over it runs no Python frame.
version: Callable[[torch.Tensor], int] = operator.attrgetter("_version")


def use_counts(x: torch.Tensor) -> tuple[int, int, int]:
    """(TensorImpl uses, storage uses, Python references to the storage object) of ``x``."""
    storage = x.untyped_storage()
    return x._use_count(), torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)  # type: ignore[attr-defined]


def view_source(
    t: torch.Tensor, sources: dict[tuple[int, int], torch.Tensor]
) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, where one built-in view op (not an ``autograd.Function``)
    made ``t`` directly from a leaf that requires grad (its node is ``AccumulateGrad``) or from
    a tensor of ``sources`` (``(id(x.grad_fn), x.output_nr)`` -> ``x``: a node may make several
    tensors); else None, and where ``t`` is
    :func:`watched` (its hooks must see its own gradient). (``Tensor._is_view`` and
    ``AccumulateGrad.variable``: private.)"""
    node = t.grad_fn
    if (
        node is None
        or not t._is_view()
        or isinstance(node, torch.autograd.function.BackwardCFunction)
        or watched(t)
    ):
        return None
    nexts = node.next_functions
    if len(nexts) != 1:
        return None
    below: Any = nexts[0][0]  # torch's stubs lack AccumulateGrad's variable
    source = (
        below.variable if type(below) is AccumulateGrad else sources.get((id(below), nexts[0][1]))
    )
    if source is None or source.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return None
    # the view is remade from the source's alias by ``as_strided``, which keeps the alias's
    # dtype and no conj or neg bit: not a view that changes them (``w.conj()``,
    # ``view_as_complex(w)``), whose remade copy would hold other values
    if t.dtype != source.dtype or t.is_conj() != source.is_conj() or t.is_neg() != source.is_neg():
        return None
    return source


def leaves_reached(node: Any) -> list[torch.Tensor]:
    """The leaves whose ``AccumulateGrad`` the gradient handed to ``node`` reaches as itself or
    as a view of itself: through sums and differences (both operands of ``a + b`` get the
    cotangent, the minuend of ``a - b``), clones and views (a chain of any length). A pending
    gradient may then reach each one's ``.grad``. Each node once: sums of one sum (``h + h``)
    would make the paths, not the nodes, grow exponentially. (``AccumulateGrad.variable``:
    private.)"""
    leaves, todo, seen = [], [node], {node}
    while todo:
        below = todo.pop()
        if type(below) is AccumulateGrad:
            leaves.append(below.variable)
        elif type(below).__name__ in _PASSING_NODES:
            for nxt, _ in below.next_functions:
                if nxt is not None and nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
    return leaves


# the nodes whose backward may hand on the very gradient it gets or a view of it: a sum or a
# difference (``w - b``, ``w + 1``, ``w.sub(1)``: the minuend gets the gradient itself), a clone,
# the views of a parameter (``w.unsqueeze(0).squeeze(0)``, ``w.t().t()``) put between a pvary
# and the parameter, the packing of parameters (``torch.cat([q, k])``, ``torch.stack``: each
# gets a view of the gradient) and a sum (its backward expands the gradient)
_PASSING_NODES = frozenset(
    f"{op}Backward0"
    for op in (
        "Cat",
        "Stack",
        "Sum",
        "T",
        "Transpose",
        "Permute",
        "View",
        "UnsafeView",
        "Unsqueeze",
        "Squeeze",
        "Alias",
        "Add",
        "Sub",
        "Clone",
    )
) | {
    "AddBackward1",
    "SubBackward1",
    "SumBackward1",
    "ExpandBackward0",
    "SqueezeBackward1",
    "SqueezeBackward2",
    "TransposeBackward1",
}


def stale_saved(roots: list[torch.Tensor], starts: list) -> RuntimeError | None:
    """Autograd's error for a tensor that a node between the nodes ``starts`` and ``roots``
    (the call's own graph) saved for the backward pass and that was written in place since:
    what the backward pass would raise at that node; else None. For a call that wrote an input
    in place; its cost: one visit of the call's graph, unpacking each saved tensor (unpacking
    one checks its version). A tensor saved through saved-tensor hooks is not unpacked: a
    checkpoint's unpack hook would rerun its region (its collectives on the writing ranks
    only); under hooks in effect (an outer checkpoint) nothing is: None."""
    if saved_tensors_hooks_active():
        return None
    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = {node for node in starts if node is not None}  # the caller's graph: not walked
    with torch.autograd.graph.disable_saved_tensors_hooks(_HOOKED):
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            for name in _saved_tensor_names(type(node)):
                try:
                    getattr(node, name)
                except RuntimeError as e:  # (a hooked one raises _HOOKED, unpacked by no hook)
                    if is_stale(e):
                        return e
            todo.extend(n for n, _ in node.next_functions if n is not None)
    return None


def _saved_tensor_names(cls: type) -> tuple[str, ...]:
    """The attributes of a node of class ``cls`` that unpack a saved tensor (or a list of
    them): a Function's ``saved_tensors`` (answered before the cache, which would keep a
    Function defined in a call's body alive); else :func:`_generated_saved_names`."""
    function = issubclass(cls, torch.autograd.function.BackwardCFunction)
    return ("saved_tensors",) if function else _generated_saved_names(cls)


@functools.lru_cache(maxsize=4096)
def _generated_saved_names(cls: type) -> tuple[str, ...]:
    """Each ``_saved_<name>`` of an autograd generated node class ``cls`` that has a
    ``_raw_saved_<name>`` twin, which those nodes give tensors alone (their saved ints and
    sizes cannot be stale). Per class (they live as long as torch): ``dir`` costs as much as
    the unpacking."""
    raw = "_raw_saved_"
    names = (n.replace(raw, "_saved_", 1) for n in dir(cls) if n.startswith(raw))
    return tuple(n for n in names if hasattr(cls, n))


_HOOKED = "named_spmd: a saved tensor with hooks is not unpacked outside the backward pass"
# autograd's errors for a saved tensor written since: a plain one, and a custom Function's view
# output (an identity such as CommMode's tag returns one) whose base was written
_STALE = ("modified by an inplace operation", "of its base has been modified inplace")


def is_stale(error: BaseException | None) -> bool:
    """Whether ``error`` is autograd's refusal of a saved tensor written since it was saved."""
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _STALE)


def node_class(function: type[torch.autograd.Function]) -> type:
    """The class of the autograd nodes that ``function.apply`` makes (its ``grad_fn``s)."""
    return function._backward_cls


def watched(x: torch.Tensor) -> bool:
    """Whether something waits for ``x``'s gradient: a ``register_hook`` hook on it, or
    ``retain_grad()``."""
    return bool(getattr(x, "_backward_hooks", None)) or x.retains_grad


def has_post_accumulate_hooks(leaf: torch.Tensor) -> bool:
    """Whether ``register_post_accumulate_grad_hook`` gave ``leaf`` hooks (they read ``.grad``
    right after each accumulation)."""
    return bool(getattr(leaf, "_post_accumulate_grad_hooks", None))
