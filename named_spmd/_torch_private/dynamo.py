"""torch.compile: Dynamo's disable mark, frame callback and trace state, Inductor's custom
graph passes, and the view attributes Dynamo hands to the torch function modes."""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from typing import Any

import torch
from torch._C._dynamo.eval_frame import get_eval_frame_callback as _eval_frame_callback

from .functorch import get_unwrapped, is_batchedtensor, maybe_get_level


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


def trace_constant(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` marked as ``torch.compiler.assume_constant_result`` marks it, without importing
    Dynamo (the public function imports it: ``import named_spmd`` must not). When Dynamo traces
    a call of ``fn``, it runs ``fn`` eagerly on the (constant) arguments and puts the result in
    the graph as a constant: what ``fn`` reads (a memo, the real stack, a probe on real
    tensors) is not traced nor guarded. Eager calls are unaffected. tests/test_torch_private.py
    checks the mark is the public function's."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


#: Whether a memo (a dict or set of the library's) read now would be guarded: while Dynamo
#: traces, it guards the length of every dict and set a trace reads, so an entry added later (by
#: the trace itself, or by an eager call between two steps) would recompile the graph; a caller
#: told True computes without the memo. ``torch.compiler.is_compiling`` itself (Dynamo folds
#: that function to True; no call added on the eager path), so also True inside a
#: :func:`trace_constant` function run at trace time, whose reads are not guarded.
memo_would_be_guarded = torch.compiler.is_compiling


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
# ``x.data`` too: the simulated mesh's mode raises the eager call's error for a varying value's
# (vmap refuses it), which Dynamo otherwise fails on inside its tracer.
TENSOR_VIEW_ATTRIBUTES = frozenset({"T", "mT", "H", "mH", "real", "imag", "data"})


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


#: torch functions eager dispatches to the torch function modes but Dynamo (2.13) traces
#: straight into the graph: they are missing from ``torch.overrides``' list of overridable
#: functions, which Dynamo reads. A compiled call's mode never saw ``torch.index_put_`` (the
#: simulated mesh's masked write, and its typing, skipped).
UNLISTED_OVERRIDABLE = frozenset({torch.index_put_})


@functools.cache
def route_functions_to_modes() -> bool:
    """Make Dynamo dispatch :data:`UNLISTED_OVERRIDABLE` to the torch function modes, as eager
    does, by adding them to its (cached) set of overridable functions (once per process)."""
    from torch._dynamo.variables.torch import get_overridable_functions

    get_overridable_functions().update(UNLISTED_OVERRIDABLE)
    return True


def traced_user_stack() -> list:
    """The user's frames Dynamo is tracing, outermost first, with the line being traced last
    (``TracingContext.extract_stack``: what Dynamo's own error messages quote); empty when
    nothing is traced."""
    from torch._guards import TracingContext

    return list(TracingContext.extract_stack())


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


def traced_marked_dynamic() -> tuple[str, ...]:
    """The input sizes of the frame being traced that ``torch._dynamo.mark_dynamic`` marked,
    as Dynamo names them (``L['x'].size()[0]``): a constraint Dynamo refuses to see specialized
    (``ConstraintViolationError`` once the frame is traced); empty when nothing is traced."""
    from torch._dynamo.symbolic_convert import tls

    tx = getattr(tls, "current_tx", None)
    if tx is None:
        return ()
    marked = []
    for tracked in tx.output.tracked_fakes:
        constraints = getattr(tracked.symbolic_context, "constraint_sizes", None) or ()
        name = tracked.source.name
        marked += [
            f"{name}.size()[{i}]"
            for i, c in enumerate(constraints)
            # (a size Dynamo made dynamic on its own, after a shape change, has a constraint
            # that only warns: it may be specialized)
            if c is not None and not getattr(c, "warn_only", False)
        ]
    return tuple(dict.fromkeys(marked))  # (a DTensor's sizes are tracked more than once)


def traced_root_frame() -> tuple[str, str] | None:
    """(file, function name) of the frame Dynamo is compiling: the root of the trace, not a
    function it inlines into it; None when nothing is traced."""
    from torch._dynamo.symbolic_convert import tls

    tx = getattr(tls, "current_tx", None)
    if tx is None:
        return None
    code = tx.output.root_tx.f_code
    return code.co_filename, code.co_name


def traced_state_of(stack: list) -> tuple:
    """While Dynamo traces: what :func:`forget_restored_state` needs to tell that a mapped call
    left ``stack`` (a list reached from a module global: the active calls) and torch's
    function-mode stack as the trace had them before it; empty when nothing is traced. Per
    stack: "changed" where the trace had already changed it (the change is the caller's,
    Dynamo must replay it), else the identities of its entries' variables (None: ``stack``
    not yet read by the trace, so as it really is)."""
    tx, Modes = _translator_and_modes()
    if tx is None:
        return ()
    modes = tx.symbolic_torch_function_state.mode_stack
    effects = tx.output.side_effects
    listed = effects.id_to_variable.get(id(stack))
    return (
        _entries(effects, listed, None if listed is None else listed.items),
        _entries(effects, effects.id_to_variable.get(id(Modes.stack_value_singleton)), modes),
        Modes.offset,
    )


def _translator_and_modes() -> tuple[Any, Any]:
    """Dynamo's instruction translator now tracing (None where nothing is traced) and its
    variable class of torch's function-mode stack (imported on demand: they import Dynamo)."""
    from torch._dynamo.symbolic_convert import tls
    from torch._dynamo.variables.torch_function import TorchFunctionModeStackVariable

    return getattr(tls, "current_tx", None), TorchFunctionModeStackVariable


def _entries(effects: Any, var: Any, items: Any) -> Any:
    if var is not None and effects.is_modified(var):
        return "changed"
    return None if items is None else tuple(map(id, items))


def forget_restored_state(stack: list, before: tuple) -> None:
    """While Dynamo traces, after a mapped call: Dynamo tracks every change of a list reached
    from a global and of the function-mode stack as a side effect, which ``torch.export``
    (strict) warns of, even where the call restored both (it pushes its context and its modes,
    and pops them). Where they are as ``before`` (:func:`traced_state_of`), they are marked
    unchanged: nothing is left to replay, and nothing to warn of."""
    tx, Modes = _translator_and_modes()
    if tx is None or not before:
        return
    effects = tx.output.side_effects
    listed = effects.id_to_variable.get(id(stack))
    if listed is not None and before[0] != "changed":
        ids = tuple(map(id, listed.items))
        untouched = len(ids) == len(stack) and all(i.source is not None for i in listed.items)
        if ids == before[0] or (before[0] is None and untouched):
            listed.mutation_type.is_modified = False
    modes = effects.id_to_variable.get(id(Modes.stack_value_singleton))
    now = tuple(map(id, tx.symbolic_torch_function_state.mode_stack))
    if modes is not None and before[1] == now and before[2] == Modes.offset:
        modes.mutation_type.is_modified = False


def dynamo_skip_frame() -> Callable[..., None]:
    """Dynamo's ``skip_frame``: called in traced code, Dynamo stops compiling the frame being
    traced and runs it eagerly (imported on demand: it imports Dynamo)."""
    from torch._dynamo import skip_frame

    return skip_frame


def is_dynamo_refusal(error: BaseException) -> bool:
    """Whether ``error`` is torch.compile refusing to trace (Dynamo's ``Unsupported`` and its
    relatives), told by module so that ``torch._dynamo`` is never imported for the check."""
    return type(error).__module__.startswith("torch._dynamo")


def is_dynamo_internal_error(error: BaseException, dirs: tuple[str, ...]) -> bool:
    """Whether ``error`` is Dynamo failing inside its own tracer (``InternalTorchDynamoError``)
    while it traced code of ``dirs``, as a plain ``torch.compile``'d function does when it
    traces named_spmd's eager call. The traced code: the frames that ran below Dynamo's first
    one (a graph break resumes in a frame Dynamo compiles) and the user-code stack Dynamo kept
    on the error it rewrapped (its ``__context__``'s ``real_stack``: private)."""
    if not (is_dynamo_refusal(error) and type(error).__name__ == "InternalTorchDynamoError"):
        return False
    traced = [f.filename for f in getattr(error.__context__, "real_stack", None) or ()]
    under_dynamo, tb = False, error.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        under_dynamo = under_dynamo or path.startswith(_DYNAMO_DIR)
        if under_dynamo:
            traced.append(path)
        tb = tb.tb_next
    return any(path.startswith(dirs) for path in traced)


def compiled_original(fn: Any) -> Any:
    """The module a ``torch.compile``'d module (``OptimizedModule``) wraps (``_orig_mod``:
    private), else ``fn`` itself."""
    return getattr(fn, "_orig_mod", fn) if isinstance(fn, torch.nn.Module) else fn


#: torch's directory, where its own files lie (``torch.__file__``: the package's location)
TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_DYNAMO_DIR = os.path.join(TORCH_DIR, "_dynamo") + os.sep


def torch_file(filename: str) -> bool:
    """Whether ``filename`` is one of torch's own files: a frame of its wrappers around a
    function (``nn.Module.__call__``, the ``torch.no_grad()`` decorator, ``torch.compile``'s),
    never the user's code."""
    return filename.startswith(TORCH_DIR)


def aten_op_sized_by_values(func: Any) -> str | None:
    """An aten op called directly (``torch.ops.aten.nonzero``, or one overload of it) whose
    result's size may depend on its operands' values: its qualified name (``aten::nonzero``);
    None for any other function. torch tags such ops ``dynamic_output_shape``; a packet counts
    where one of its overloads carries the tag (``aten::index``: the ``Tensor`` overload)."""
    if isinstance(func, torch._ops.OpOverload):
        overloads = [func]
    elif isinstance(func, torch._ops.OpOverloadPacket):
        overloads = [getattr(func, name) for name in func.overloads()]
    else:
        return None
    tagged = any(torch.Tag.dynamic_output_shape in op.tags for op in overloads)
    return overloads[0].name().split(".")[0] if tagged and overloads else None


def has_data_dependent_size(tensor: torch.Tensor) -> bool:
    """Whether a tensor Dynamo traces has a size known only when the program runs (an unbacked
    size: ``x[x > 0]``'s, or one made from ``.item()``). Such a size cannot be specialized nor
    formatted while tracing; Dynamo answers this call with a constant. False for a real tensor."""
    from torch.fx.experimental.symbolic_shapes import has_free_unbacked_symbols

    return bool(has_free_unbacked_symbols(tensor))


def batched_above(tensor: torch.Tensor, level: int) -> bool:
    """Whether a vmap level above ``level`` batches ``tensor`` (a wrapper of another transform
    may lie between). Eagerly (and under a tracer that runs the Python code on its own tensors:
    non-strict ``torch.export``, ``make_fx``), the tensor's own wrappers; while Dynamo traces,
    its fake value's, read at trace time (Dynamo cannot trace functorch's level queries;
    ``comptime`` reads the traced tensor's fake value, and Dynamo answers the call with a
    constant)."""
    if not torch.compiler.is_dynamo_compiling():
        return _batched_above(tensor, level)
    from torch._dynamo.comptime import comptime

    comptime(_record_batched_above)
    return _handed_over("batched_above")


def _batched_above(t: torch.Tensor, level: int) -> bool:
    while maybe_get_level(t) > level:
        if is_batchedtensor(t):
            return True
        t = get_unwrapped(t)
    return False


def _record_batched_above(ctx: Any) -> None:
    """At trace time: ``batched_above`` of the fake value of its ``tensor``."""
    tensor, level = ctx.get_local("tensor"), ctx.get_local("level")
    _handing_over["batched_above"] = _batched_above(tensor.as_fake(), level.as_python_constant())


#: What a ``comptime`` callback found, by the name of the function that called it, until the
#: trace constant called right after it takes it out. A side channel: Dynamo's ``comptime``
#: returns None to the traced code whatever the callback returns (it has no expression form),
#: and the only other way back is writing the traced frame's locals through Dynamo's
#: instruction translator, which torch marks free to break (``_i_will_not_complain_if_bc_breaks``).
#: Safe to share: Dynamo traces one frame at a time (under its compile lock), the callback and
#: the constant run back to back within one trace, and the constant removes the entry, so no
#: later read sees a stale answer (a missing one is a KeyError, never a wrong constant).
_handing_over: dict[str, Any] = {}


@trace_constant
def _handed_over(name: str) -> Any:
    """At trace time: the answer ``name``'s ``comptime`` callback has just recorded."""
    return _handing_over.pop(name)


def traced_size_sources(tensor: torch.Tensor) -> tuple[tuple[str, ...], ...]:
    """Per dim of a tensor Dynamo traces, the frame's input sizes its size is computed from,
    as Dynamo names them (``L['x'].size()[0]``; empty for a static size): the sources of the
    size's free symbols in the shape env (Dynamo's ``comptime`` reads the traced tensor's fake
    value). Outside a Dynamo trace every size is static: empty ones."""
    if not torch.compiler.is_dynamo_compiling():
        return tuple(() for _ in tensor.shape)
    from torch._dynamo.comptime import comptime

    comptime(_record_size_sources)
    return _handed_over("traced_size_sources")


def _record_size_sources(ctx: Any) -> None:
    """At trace time: the sources of the sizes of ``traced_size_sources``'s ``tensor``."""
    fake = ctx.get_local("tensor").as_fake()
    _handing_over["traced_size_sources"] = tuple(_sources_of_size(n) for n in fake.shape)


def _sources_of_size(size: Any) -> tuple[str, ...]:
    if not isinstance(size, torch.SymInt):
        return ()
    node = size.node
    sources = node.shape_env.var_to_sources
    found = [s.name for sym in node.expr.free_symbols for s in sources.get(sym, ())]
    return tuple(dict.fromkeys(found))


def decided(condition: Any) -> bool | None:
    """A condition on sizes, where it is decided; None where it depends on a size Dynamo knows
    only when the program runs (an unbacked size, unless ``torch._check`` stated enough), which
    ``bool()`` cannot guard on. Dynamo answers both questions with constants."""
    from torch.fx.experimental.symbolic_shapes import guard_or_false, guard_or_true

    if guard_or_false(condition):
        return True
    if not guard_or_true(condition):
        return False
    return None
