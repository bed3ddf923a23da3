"""Every private torch name named_spmd uses, in one place, with why.

torch's private APIs change between releases. Keeping them here means a torch upgrade touches
this file only, and ``tests/test_torch_private.py`` pins each name's behaviour (and fails when
any other module names ``torch._``, ``_functorch``, ``_c10d_functional``, DTensor or
AsyncCollectiveTensor internals, ``Tensor._base``, forward AD's level or ``getrefcount``). Names of ``torch.distributed`` are resolved on first use (:func:`dist`), so
``import named_spmd`` does not import the distributed stack.
"""

from __future__ import annotations

import functools
import operator
import sys
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import torch
import torch.utils._device
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback
from torch.autograd import forward_ad

TORCH_VERSION = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
if TORCH_VERSION < (2, 13):  # pragma: no cover - the gate the pins below were written for
    raise ImportError(f"named_spmd needs torch >= 2.13, found {torch.__version__}")

# --- functorch: entering vmap levels ourselves and reading a tensor's batch levels --------------
# The simulated backend enters one vmap level per mesh axis directly (torch.func.vmap's own
# wrappers cost more than a small collective) and reads a tensor's vma off its levels.
functorch = torch._C._functorch
maybe_get_level = functorch.maybe_get_level
maybe_get_bdim = functorch.maybe_get_bdim
get_unwrapped = functorch.get_unwrapped
is_batchedtensor = functorch.is_batchedtensor
is_transform_wrapped = functorch.is_functorch_wrapped_tensor
maybe_current_level = functorch.maybe_current_level
get_interpreter_stack = functorch.get_interpreter_stack
add_batch_dim = functorch._add_batch_dim
remove_batch_dim = functorch._remove_batch_dim
unwrap_if_dead = functorch.unwrap_if_dead
vmap_increment_nesting = functorch._vmap_increment_nesting
vmap_decrement_nesting = functorch._vmap_decrement_nesting
unwrap_for_grad = functorch._unwrap_for_grad
wrap_for_grad = functorch._wrap_for_grad
TransformType = functorch.TransformType
#: The transforms that differentiate (torch.func.grad / vjp, and jvp).
GRAD_LIKE = (TransformType.Grad, TransformType.Jvp)
transforms_active = torch._C._are_functorch_transforms_active
# Plain tensors even under functionalize & co (cached tokens and permutation tables).
DisableFuncTorch = torch._C._DisableFuncTorch


def lazy_load_decompositions() -> None:
    """torch.func.vmap registers some batching rules on first use; we enter levels ourselves."""
    from torch._functorch.vmap import lazy_load_decompositions as load

    load()


def current_interpreter() -> Any:
    from torch._functorch.pyfunctorch import retrieve_current_functorch_interpreter

    return retrieve_current_functorch_interpreter()


def single_level_functions() -> Any:
    """Context manager that lets a ``SingleLevelFunction`` be applied at a grad level."""
    from torch._functorch.utils import enable_single_level_autograd_function

    return enable_single_level_autograd_function()


def functional_unwrap(x: torch.Tensor, reapply_views: bool) -> torch.Tensor:
    from torch._functorch.eager_transforms import _maybe_unwrap_functional_tensor

    return _maybe_unwrap_functional_tensor(x, reapply_views=reapply_views)


def functional_wrap(x: torch.Tensor, level: int) -> torch.Tensor:
    from torch._functorch.eager_transforms import _maybe_wrap_functional_tensor

    return _maybe_wrap_functional_tensor(x, level)


def set_fwd_grad_enabled(enabled: bool) -> Any:
    from torch.autograd.forward_ad import _set_fwd_grad_enabled

    return _set_fwd_grad_enabled(enabled)


# A Function applied at one functorch level (what generate_single_level_function builds).
SingleLevelFunction = torch.autograd.function._SingleLevelFunction

# --- printing a transform's tensors --------------------------------------------------------------
# torch prints a functorch-wrapped tensor as its wrappers ("BatchedTensor(lvl=2, bdim=0, value=..."),
# through one module function that ``repr`` looks up at each call, and formats a 0-d tensor with
# ``.item()``, which vmap refuses. The simulated backend shows its values per mesh coordinate
# instead: these hooks let it answer first for a wrapped tensor; torch's own code runs whenever
# a hook returns None (every tensor that is not the backend's, and plain tensors never reach them).
is_gradtrackingtensor = functorch.is_gradtrackingtensor
_PRINT_HOOKS: dict[str, Any] = {}


def hook_wrapper_printing(text: Any, formatted: Any) -> None:
    """``text(t) -> str | None`` prints a wrapped tensor ``t`` (``repr``, ``str``, ``print``);
    ``formatted(t, spec) -> str | None`` formats one (``format``, f-strings). Installed once."""
    if not _PRINT_HOOKS:
        import torch._tensor_str as tensor_str

        torch_text = tensor_str._functorch_wrapper_str_intern
        torch_format = torch.Tensor.__format__

        def wrapper_text(tensor: torch.Tensor, *, tensor_contents: Any = None) -> str:
            shown = _PRINT_HOOKS["text"](tensor)
            return torch_text(tensor, tensor_contents=tensor_contents) if shown is None else shown

        def wrapper_format(self: torch.Tensor, format_spec: str) -> str:
            if is_transform_wrapped(self):
                shown = _PRINT_HOOKS["formatted"](self, format_spec)
                if shown is not None:
                    return shown
            return torch_format(self, format_spec)

        tensor_str._functorch_wrapper_str_intern = wrapper_text
        torch.Tensor.__format__ = wrapper_format  # type: ignore[method-assign]
    _PRINT_HOOKS.update(text=text, formatted=formatted)


# --- entering a grad level ----------------------------------------------------------------------
# torch.func.grad, grad_and_value and vjp (so jacrev and hessian too) enter their grad level
# through one context manager, which looks up ``_grad_increment_nesting`` /
# ``_grad_decrement_nesting`` as globals of eager_transforms at each call. The simulated backend
# wraps those two names to learn when a grad level is entered inside its call (its implicit pvary
# then needs a real op: backends/simulated/_inner_grad.py), at no cost to any other code. Dynamo
# traces the context manager itself (by identity), never these globals, so compiled code is
# unaffected.
_GRAD_HOOKS: dict[str, Any] = {}


def hook_grad_levels(entered: Any, leaving: Any) -> None:
    """``entered(level)`` right after a grad level is entered, ``leaving(level)`` right before
    one is left (also when the transform raises). Installed once."""
    if not _GRAD_HOOKS:
        import torch._functorch.eager_transforms as eager

        increment, decrement = eager._grad_increment_nesting, eager._grad_decrement_nesting

        def grad_increment_nesting() -> int:
            level = increment()
            _GRAD_HOOKS["entered"](level)
            return level

        def grad_decrement_nesting() -> Any:
            _GRAD_HOOKS["leaving"](functorch.maybe_current_level())
            return decrement()

        eager._grad_increment_nesting = grad_increment_nesting
        eager._grad_decrement_nesting = grad_decrement_nesting
    _GRAD_HOOKS.update(entered=entered, leaving=leaving)


# --- the gradients of torch.func.grad and vjp -----------------------------------------------------
# torch.func.grad (and grad_and_value) and vjp's pullback (so jacrev and hessian too) compute their
# gradients through ``_autograd_grad``, looked up as a global of eager_transforms at each call. The
# simulated backend wraps it to give each gradient its input's type inside its call
# (backends/simulated/_inner_grad.py), at no cost to any other code.
_GRADIENT_HOOKS: dict[str, Any] = {}


def hook_transform_gradients(after: Any) -> None:
    """``after(inputs, grads)`` (returning the gradients) on every tuple of gradients that
    torch.func.grad or vjp computes. Installed once."""
    if not _GRADIENT_HOOKS:
        import torch._functorch.eager_transforms as eager

        compute = eager._autograd_grad

        def autograd_grad(
            outputs: Any,
            inputs: Any,
            grad_outputs: Any = None,
            retain_graph: bool = False,
            create_graph: bool = True,
        ) -> tuple:
            grads = compute(outputs, inputs, grad_outputs, retain_graph, create_graph)
            return _GRADIENT_HOOKS["after"](inputs, grads)

        eager._autograd_grad = autograd_grad
    _GRADIENT_HOOKS.update(after=after)


# --- autograd ----------------------------------------------------------------------------------
# Function.apply binds its arguments in Python (~10 us) when setup_context is defined; the C
# apply skips that where no torch.func transform needs the Python path.
function_base_apply = torch._C._FunctionBase.__dict__["apply"]
current_graph_task_id = torch._C._current_graph_task_id  # -1 outside a backward pass
# (torch's stubs lack AccumulateGrad and Tensor._use_count, both bound in C++)
AccumulateGrad = torch._C._functions.AccumulateGrad  # type: ignore[attr-defined]
below_autograd = torch._C._AutoDispatchBelowAutograd


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
# (``_context.CallMarker``) so that the recomputation re-establishes the call (docs/design.md
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


# Library-internal ops run without the user-visible TorchFunctionModes (vma tracking).
DisableTorchFunction = torch._C.DisableTorchFunction

# --- make_fx (torch.func.linearize, torch.export, AOT autograd) ---------------------------------
_PROXY_MODE = torch._C._TorchDispatchModeKey.PROXY


def proxy_tracing() -> bool:
    """Whether ``make_fx`` traces: its proxy mode is on the dispatch mode stack. Its graph
    records only dispatched ops, so a call then communicates with functional collectives, and
    reads values (a check's result) of its own tensors made outside the trace
    (:func:`no_dispatch_modes`)."""
    return torch._C._get_dispatch_mode(_PROXY_MODE) is not None


def no_dispatch_modes() -> Any:
    """A context without the dispatch modes (``make_fx``'s proxy mode among them): the
    library's bookkeeping (the start-of-call check) runs eagerly, not into a traced graph."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


# --- reference counts: may a buffer be overwritten in place? ----------------------------------
# A view's base tensor, None for a non-view (``Tensor._base``): a view shares its buffer, so it is
# never overwritten. An attrgetter: a C call that keeps no reference to the tensor it is given
# (donation compares the tensor's reference counts with calibrated ones right after).
tensor_base = operator.attrgetter("_base")
refcount = sys.getrefcount  # the Python reference count of an object (CPython)


def use_counts(x: torch.Tensor) -> tuple[int, int, int]:
    """(TensorImpl uses, storage uses, Python references to the storage object) of ``x``."""
    storage = x.untyped_storage()
    return x._use_count(), torch._C._storage_Use_Count(storage._cdata), sys.getrefcount(storage)  # type: ignore[attr-defined]


# --- torch.distributed (resolved on first use) ---------------------------------------------------


@functools.cache
def dist() -> SimpleNamespace:
    """The private torch.distributed names of the real backend."""
    import torch.distributed as td
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    return SimpleNamespace(
        # torch's registry of in-flight works: wait_tensor finds the work of a buffer there
        register_work=torch._C._distributed_c10d._register_work,
        wait_tensor=torch.ops._c10d_functional.wait_tensor.default,
        AsyncCollectiveTensor=AsyncCollectiveTensor,
        PendingGradient=_pending_gradient_class(AsyncCollectiveTensor),
        # DTensor's constructor DTensor(local, spec, requires_grad=): from_local without its
        # checks and the spec it rebuilds on every call (specs come from dtensor_spec, cached)
        new_dtensor=functools.partial(_new_dtensor, DTensor),
        DTensorSpec=DTensorSpec,
        TensorMeta=TensorMeta,
        compute_global_tensor_info=compute_global_tensor_info,
        default_store=td.distributed_c10d._get_default_store,
    )


def _new_dtensor(cls: type, local: torch.Tensor, spec: Any, requires_grad: bool = False) -> Any:
    """``DTensor(local, spec, requires_grad=)``. ``DTensor.__new__`` is the C constructor
    ``Tensor._dtensor__new__`` (it sets the spec and the local tensor); ``DTensor.__init__`` only
    marks the construction for ``torch.export``, behind two decorators that cost most of the
    construction (about 20 of 25 us). Eager calls skip it; traced ones keep the whole constructor."""
    if torch.compiler.is_compiling():
        return cls(local, spec, requires_grad=requires_grad)
    return torch.Tensor._dtensor__new__(cls, local, spec, requires_grad=requires_grad)


def _pending_gradient_class(act: type) -> type:
    """``AsyncCollectiveTensor`` with a fast path for ``detach``, which ``AccumulateGrad``
    applies once to every gradient it stores: torch's class walks the arguments with pytree
    maps for every op but ``view`` (about a third of a data-parallel GPT backward, measured).
    ``AccumulateGrad``'s ``grad += pending`` into a ``.grad`` that exists (gradient accumulation)
    may be postponed to the end of the backward pass instead of waiting for the sum now: the
    backend's ``defer_accumulation(target, pending)`` says whether it took it."""
    detach = torch.ops.aten.detach.default
    add_ = torch.ops.aten.add_.Tensor

    class PendingGradient(act):
        defer_accumulation: Any = None  # set by the backend

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func is detach and not kwargs:
                return cls(func(args[0].elem))  # a view: nothing to wait for, as torch's
            if (
                func is add_
                and not kwargs
                and type(args[0]) is torch.Tensor
                and type(args[1]) is cls
                and cls.defer_accumulation is not None
                and cls.defer_accumulation(args[0], args[1])
            ):
                return args[0]
            return super().__torch_dispatch__(func, types, args, kwargs)

    return PendingGradient


def view_source(t: torch.Tensor, sources: dict[int, torch.Tensor]) -> torch.Tensor | None:
    """The tensor ``t`` is a view of, where one built-in view op (not an ``autograd.Function``)
    made ``t`` directly from a leaf that requires grad (its node is ``AccumulateGrad``) or from
    a tensor of ``sources`` (``id`` of its ``grad_fn`` -> it); else None. (``Tensor._is_view``
    and ``AccumulateGrad.variable``: private.)"""
    node = t.grad_fn
    if (
        node is None
        or not t._is_view()
        or isinstance(node, torch.autograd.function.BackwardCFunction)
    ):
        return None
    nexts = node.next_functions
    if len(nexts) != 1:
        return None
    below: Any = nexts[0][0]  # torch's stubs lack AccumulateGrad's variable
    source = below.variable if type(below) is AccumulateGrad else sources.get(id(below))
    if source is None or source.untyped_storage().data_ptr() != t.untyped_storage().data_ptr():
        return None
    return source


def has_post_accumulate_hooks(leaf: torch.Tensor) -> bool:
    """Whether ``register_post_accumulate_grad_hook`` gave ``leaf`` hooks (they read ``.grad``
    right after each accumulation)."""
    return bool(getattr(leaf, "_post_accumulate_grad_hooks", None))


def local_tensor(d: Any) -> torch.Tensor:
    """A DTensor's local tensor without the autograd-recording ``to_local``."""
    return d._local_tensor


def dtensor_spec(device_mesh: Any, local: torch.Tensor, placements: tuple) -> Any:
    """The ``DTensorSpec`` of the DTensor whose local tensor on this rank is ``local``: what
    ``DTensor.from_local`` builds on every call (the caller caches it per layout)."""
    d = dist()
    shape, stride = d.compute_global_tensor_info(local, device_mesh, list(placements))
    meta = d.TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return d.DTensorSpec(device_mesh, placements, tensor_meta=meta)


def dtensor_spec_shaped(
    device_mesh: Any, placements: tuple, shape: tuple[int, ...], dtype: torch.dtype
) -> Any:
    """The ``DTensorSpec`` of a contiguous DTensor of global ``shape``: what
    ``DTensor.from_local(..., shape=, stride=)`` builds, for local blocks of unequal sizes
    (whose global shape no one rank's block gives)."""
    d = dist()
    stride, step = [], 1
    for size in reversed(shape):  # contiguous, as torch computes it (a size 0 counts 1)
        stride.append(step)
        step *= max(size, 1)
    meta = d.TensorMeta(torch.Size(shape), tuple(reversed(stride)), dtype)
    return d.DTensorSpec(device_mesh, placements, tensor_meta=meta)


# AsyncCollectiveTensor (the wait-on-first-use result of torch's functional collectives, which the
# overlapped gradient psum returns): its plain buffer (``.elem``), and the wait that returns the
# buffer once its reduction is done (``.trigger_wait()``). C calls: no Python frame per gradient.
async_buffer = operator.attrgetter("elem")
async_wait = operator.methodcaller("trigger_wait")


def not_traced(fn: Callable[..., Any], reason: str) -> Callable[..., Any]:
    """``fn`` as ``torch.compiler.disable(fn, reason=reason)`` makes it, without importing Dynamo
    now (``import named_spmd`` must not: it takes a second and imports ``torch.distributed``). Dynamo does
    not inline a function carrying its disable mark: a compiled program breaks its graph there
    (``fullgraph=True`` raises ``Unsupported`` quoting ``reason``); the call then goes through
    ``torch._disable_dynamo``'s wrapper, which Dynamo skips (its module is on Dynamo's skip list)
    and which runs ``fn`` with Dynamo off, importing Dynamo at its first call. Called as a frame
    of its own (from code running eagerly under Dynamo's frame callback), the wrapper's code is
    torch's, which Dynamo never compiles."""
    eager = torch._disable_dynamo(fn)
    eager._torchdynamo_disable = True  # type: ignore[attr-defined]
    eager._torchdynamo_disable_msg = reason  # type: ignore[attr-defined]
    return eager


# --- torch.compile (the compile paths: backends/_dist_compile.py) -------------------------------


@functools.cache
def funcol() -> SimpleNamespace:
    """The functional collective ops (``torch.ops._c10d_functional``) that a compiled call traces
    into its graph: Inductor reorders and overlaps them, as it does for torch's own SimpleFSDP
    and async TP. Each returns a new tensor that ``wait_tensor`` completes."""
    ops = torch.ops._c10d_functional
    return SimpleNamespace(
        all_reduce=ops.all_reduce.default,
        all_gather=ops.all_gather_into_tensor.default,
        reduce_scatter=ops.reduce_scatter_tensor.default,
        all_to_all=ops.all_to_all_single.default,
        broadcast=ops.broadcast.default,
        wait=ops.wait_tensor.default,
    )


def inductor_graph_pass(fn: Callable[[Any], None], version: str) -> Any:
    """``fn`` (an FX graph -> None, editing it in place) as an Inductor custom graph pass (the
    ``post_grad_custom_pre_pass`` option): a ``CustomGraphPass`` whose ``uuid`` (``version``)
    keys Inductor's FX graph cache; without one, Inductor compiles anew every process."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class _Pass(CustomGraphPass):
        def __call__(self, graph: Any) -> None:
            fn(graph)

        def uuid(self) -> str:
            return version

    return _Pass()


# --- Dynamo: a tensor's view attributes reach the torch function modes, as in eager -------------
# Eager torch hands ``x.T``, ``x.mT``, ``x.H``, ``x.mH``, ``x.real`` and ``x.imag`` to the active
# torch function modes; Dynamo (2.13) traces them straight into the graph
# (``TensorVariable.var_getattr``), so a mode never sees them. A compiled real-mesh call then
# lost the type of ``k.T`` (an untyped tensor reads invariant) and gave a varying value's
# gradient a spurious psum: ring attention's ``q @ k.T`` had a wrong gradient for ``k``.
TENSOR_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag"})


@functools.cache
def route_view_attributes_to_modes() -> bool:
    """Make Dynamo dispatch :data:`TENSOR_VIEW_ATTRIBUTES` of a plain tensor to the symbolic
    torch function mode stack, as eager does (once per process; returns True)."""
    from torch._dynamo.variables import torch_function as tf
    from torch._dynamo.variables.base import VariableTracker
    from torch._dynamo.variables.tensor import TensorVariable

    traced = TensorVariable.var_getattr

    def var_getattr(self: Any, tx: Any, name: str) -> Any:
        if (
            name in TENSOR_VIEW_ATTRIBUTES
            and type(self) is TensorVariable
            and tf.can_dispatch_torch_function(tx, [self], {})
        ):
            getter = VariableTracker.build(tx, getattr(torch.Tensor, name).__get__)
            return tf.dispatch_torch_function(tx, getter, [self], {})
        return traced(self, tx, name)

    TensorVariable.var_getattr = var_getattr  # type: ignore[method-assign]
    return True


def traced_user_stack() -> list:
    """The user's frames Dynamo is tracing, outermost first, with the line being traced last
    (``TracingContext.extract_stack``: what Dynamo's own error messages quote); empty when
    nothing is traced."""
    from torch._guards import TracingContext

    return list(TracingContext.extract_stack())


#: ``scaled_dot_product_attention``'s math decomposition, ``(q, k, v, attn_mask, dropout_p,
#: is_causal, *, scale) -> (out, weights)``: plain ops, which batch under vmap (the CPU flash
#: kernel sdpa picks has no batching rule: vmap runs it once per instance).
sdpa_math = torch.ops.aten._scaled_dot_product_attention_math

#: The class of torch's higher-order ops (checkpoint's tag_activation_checkpoint, cond, ...),
#: whose bodies Dynamo traces into subgraphs of their own.
HigherOrderOperator = torch._ops.HigherOrderOperator

#: Dynamo's frame callback, or None: not None while code runs eagerly as the rest of a
#: compiled function whose frame Dynamo gave up on ("falling back to eager"), where Dynamo tries
#: to compile every frame called from it. The C function itself: calling it starts no Python
#: frame for Dynamo to compile, and Dynamo is not imported. Only outside a trace (Dynamo cannot
#: trace it).
dynamo_frame_callback = _eval_frame_callback


def traced_in_subgraph() -> bool:
    """Whether Dynamo is tracing the body of a higher-order op (``torch.utils.checkpoint``,
    ``torch.cond``, ...) into a subgraph of its own, rather than the frame's root graph (the
    tracer of the instruction translator being traced has a parent). False when nothing is
    traced."""
    from torch._dynamo.symbolic_convert import tls

    tx = getattr(tls, "current_tx", None)
    return tx is not None and not tx.output.is_root_tracer()


def traced_root_frame() -> tuple[str, str] | None:
    """(file, function name) of the frame Dynamo is compiling: the root of the trace, not a
    function it inlines into it; None when nothing is traced."""
    from torch._dynamo.symbolic_convert import tls

    tx = getattr(tls, "current_tx", None)
    if tx is None:
        return None
    code = tx.output.root_tx.f_code
    return code.co_filename, code.co_name


def dynamo_skip_frame() -> Callable[..., None]:
    """Dynamo's ``skip_frame``: called in traced code, Dynamo stops compiling the frame being
    traced and runs it eagerly (imported on demand: it imports Dynamo)."""
    from torch._dynamo import skip_frame

    return skip_frame


def is_dynamo_refusal(error: BaseException) -> bool:
    """Whether ``error`` is torch.compile refusing to trace (Dynamo's ``Unsupported`` and its
    relatives), told by module so that ``torch._dynamo`` is never imported for the check."""
    return type(error).__module__.startswith("torch._dynamo")
