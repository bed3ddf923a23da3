"""The spmd_map calls running on this thread: the stack of active calls, and how a call resumes.

Collectives look up the innermost active call here (:func:`current`); outside spmd_map there is
none and they raise a clear error instead of hanging or failing deep inside torch. A call also
marks torch's function-mode stack (:class:`CallMarker`), by which a checkpoint's recomputation in
backward resumes it. And whether calls made now take blocks of unequal sizes is a switch of this
thread's (:func:`request_uneven_blocks`). Every such per-thread state is here, in one module
(``_compile.LIVE_MODULES``: a compiled call keeps Dynamo's guards on it).
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.nn.functional import scaled_dot_product_attention as _SDPA

from . import _torch_private as torch_private
from ._accounting import begin_recompute, end_recompute, live_modes
from ._context import SpmdContext
from ._errors import CollectiveError
from ._masked_fill import NOT_MASKED, SETITEM, WRITES_THROUGH_MASKS, as_masked_fill

# --- whether calls take blocks of unequal sizes -------------------------------------------------


class _Uneven(threading.local):
    on = False  # (a class default: read at every call, never a caught AttributeError)


_uneven = _Uneven()


def uneven_blocks_requested() -> bool:
    """Whether calls made now take a dim the axes do not divide, in ``torch.chunk``'s blocks
    (``ns.simulate_per_instance()`` is active on this thread). Every backend that takes uneven
    blocks reads this one switch, so that they accept and refuse the same inputs."""
    return _uneven.on


@contextlib.contextmanager
def request_uneven_blocks() -> Iterator[None]:
    """Make :func:`uneven_blocks_requested` true inside the block (this thread)."""
    saved = uneven_blocks_requested()
    _uneven.on = True
    try:
        yield
    finally:
        _uneven.on = saved


# --- the active calls ---------------------------------------------------------------------------


class _Calls(threading.local):
    def __init__(self) -> None:
        self.stack: list[SpmdContext] = []


_local = _Calls()


def push(ctx: SpmdContext) -> None:
    """Make ``ctx`` the active call, and mark the torch-function mode stack with it so that a
    checkpoint recomputation inside the call can find it again (:class:`CallMarker`)."""
    _local.stack.append(ctx)
    if ctx.marks_calls:
        torch_private.push_function_mode(CallMarker(ctx))


def pop() -> None:
    ctx = _local.stack.pop()
    held = ctx.let_go()
    if ctx.marks_calls:
        marker = _remove_marker(ctx)
        if marker is not None:
            marker.held = held


# --- the attributes a call writes into tensors -------------------------------------------------

#: What a call keeps in its tensors' ``__dict__``: a type stamp (``_stamps``), a planned call's
#: number (``_plan``), a blocks record (``_blocks``), a partial mark (``simulated._marks``). Each
#: is read inside its call only; on the caller's tensors (inputs handed through, closed-over
#: tensors an op hands back, outputs) they are removed when the call returns (:func:`unstamp`):
#: torch.save (``weights_only`` loading), deepcopy and pickle then see plain tensors.
#: (Those modules read the names from here: one definition each.)
TENSOR_ATTRS = ("_named_spmd_vma", "_named_spmd_src", "_named_spmd_blocks", "_named_spmd_partial")
_VMA, _SRC, _BLOCKS, _PARTIAL = TENSOR_ATTRS
VMA_ATTR, SRC_ATTR, BLOCKS_ATTR, PARTIAL_ATTR = TENSOR_ATTRS


def unstamp(ctx: SpmdContext, tensors: Iterable[Any]) -> None:
    """Remove :data:`TENSOR_ATTRS` from ``tensors``, which call ``ctx`` handed back or typed and
    the caller holds; where a checkpoint may resume the call (it marks calls), what was removed
    is kept for the recomputation (:func:`_restamped`), by weak reference. (One loop: it runs
    over every leaf of every typed call.)"""
    if not ctx.marks_calls:  # (nothing to keep: four pops per tensor, no lookups first)
        for t in tensors:
            d = getattr(t, "__dict__", None)
            if d:
                pop = d.pop
                pop(_VMA, None), pop(_SRC, None), pop(_BLOCKS, None), pop(_PARTIAL, None)
        return
    kept: list = []
    for t in tensors:
        d = getattr(t, "__dict__", None)  # (a tensor's is made on first access: empty)
        if d:
            for k in TENSOR_ATTRS:
                if k in d:
                    kept.append((weakref.ref(t), k, d.pop(k)))
    if kept:
        ctx.unstamped = kept if ctx.unstamped is None else ctx.unstamped + kept


def _restamped(kept: list) -> Callable[[], None]:
    """Put back what :func:`unstamp` removed, for a recomputation of the call (its ops see the
    types the forward's saw); returns the undo, which leaves each tensor's attributes as they
    were before (another call running meanwhile, whose backward recomputes this one, keeps
    its own types)."""
    before: dict[int, tuple[dict, dict]] = {}
    for ref, k, v in kept:
        t = ref()
        if t is not None:
            d = t.__dict__
            if id(d) not in before:
                before[id(d)] = (d, {a: d[a] for a in TENSOR_ATTRS if a in d})
            d[k] = v

    def undo() -> None:
        for d, was in before.values():
            for a in TENSOR_ATTRS:
                if a in was:
                    d[a] = was[a]
                else:
                    d.pop(a, None)

    return undo


def restoring_stacks(run: Callable[[], Any]) -> Any:
    """``run()``, a mapped call traced by Dynamo, which pushes its context and its modes and
    pops them: the stacks it restored marked unchanged in the trace, so that ``torch.export``
    (strict) sees no side effect of the library (``torch_private.forget_restored_state``)."""
    before = _traced_state()
    out = run()
    _forget_restored_state(before)
    return out


@torch_private.trace_constant
def _traced_state() -> tuple:
    return torch_private.traced_state_of(_local.stack)


@torch_private.trace_constant
def _forget_restored_state(before: tuple) -> None:
    torch_private.forget_restored_state(_local.stack, before)


def active() -> SpmdContext | None:
    stack = _local.stack
    return stack[-1] if stack else None


def current(op: str) -> SpmdContext:
    stack = _local.stack
    if not stack:
        if (
            torch_private.current_graph_task_id() != -1
        ):  # in a backward pass: a recomputation, most likely
            raise CollectiveError(
                f"{op} was called in a backward pass, outside the spmd_map call it belongs to: "
                "a recomputation that does not restore the call (torch.utils.checkpoint with "
                "use_reentrant=True, or a non-reentrant checkpoint entered inside a "
                "`with torch.device(...)` block of the per-device function). Fix: use "
                "torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False), outside "
                "device blocks."
            )
        raise CollectiveError(
            f"{op} was called outside spmd_map. Collectives talk to the other instances of a "
            "mesh, so they only exist inside a per-device function. Fix: call it inside a "
            "function decorated with @named_spmd.spmd_map(mesh=..., in_specs=..., out_specs=...)."
        )
    return stack[-1]


# --- activation checkpointing: a call resumed in backward ---------------------------------------
#
# torch.utils.checkpoint (non-reentrant) runs the checkpointed piece again in backward, after the
# call returned: its collectives need the call's context, its ops the call's vma tracking, and on
# the simulated mesh its tensors the call's vmap levels. torch re-enters, around that recompute,
# the innermost DeviceContext mode of the forward (_torch_private); the marker below is one, and
# entering it again resumes the call (docs/design.md section 8).


class CallMarker(torch_private.DeviceContext):
    """A torch-function mode that marks a running call; entered by a checkpoint's recomputation,
    it resumes the call: the backend's state (:meth:`SpmdContext.resume`), the call's own modes
    (vma tracking), the active call, and the accounting of recomputed collectives as backward
    communication. Passes every op through unchanged, or to the call's ``marker_typing``,
    attention under the context's ``attention`` mode."""

    def __init__(self, ctx: SpmdContext) -> None:  # not DeviceContext's: no device is set
        self.ctx = ctx
        stack = _mode_stack()
        # the call's own modes (VmaMode & co), to push again
        self.modes = [m for m in stack if _of_call(m, ctx)]
        # the device context the call ran under: torch's checkpoint would have re-entered it
        self.outer_device = next(
            (
                m for m in reversed(stack) if isinstance(m, torch_private.DeviceContext)
            ),  # no marker yet
            None,
        )
        self.comm_modes = live_modes()  # for a recomputation on autograd's device thread
        # what the call lets go of as it stops (``SpmdContext.let_go``) and a recomputation
        # needs back: held here, where a checkpoint keeps the marker as long as the graph
        self.held: Any = None
        self.undo: list[Callable[[], None] | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func in WRITES_THROUGH_MASKS and self.ctx.fills_masks:
            out = as_masked_fill(
                func, args, kwargs, lambda f, a: self.__torch_function__(f, types, a)
            )
            if out is not NOT_MASKED:  # (``_masked_fill``)
                return None if func is SETITEM else out
        typing = self.ctx.marker_typing
        if func is _SDPA and self.ctx.attention is not None:
            with self.ctx.attention:
                if typing is not None:
                    return typing.__torch_function__(func, types, args, kwargs)
                return func(*args, **(kwargs or {}))
        if typing is not None:
            return typing.__torch_function__(func, types, args, kwargs)
        return func(*args, **(kwargs or {}))

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """What ``torch.get_default_device()`` says without the marker (it reads the innermost
        DeviceContext mode's ``device``): the call's outer device context's, else the CPU."""
        outer = self.outer_device
        return torch.device("cpu") if outer is None else outer.device

    def __enter__(self) -> CallMarker:
        undo = None if active() is self.ctx else self._resume()
        torch_private.push_function_mode(self)
        self.undo.append(undo)
        return self

    def __exit__(self, *exc: object) -> None:
        _remove_marker(self.ctx)
        undo = self.undo.pop()
        if undo is not None:
            undo()

    def _stop_resumed(self) -> None:
        _local.stack.pop()
        self.held = self.ctx.let_go()

    def _resume(self) -> Callable[[], None]:
        undo = contextlib.ExitStack()  # its callbacks run last to first
        try:
            undo.callback(self.ctx.resume())
            if self.ctx.unstamped:  # (the caller's tensors, typed again while it runs)
                undo.callback(_restamped(self.ctx.unstamped))
            outer = self.outer_device
            if outer is not None and not _on_mode_stack(outer):
                undo.enter_context(outer)
            for mode in self.modes:
                torch_private.push_function_mode(mode)
                undo.callback(torch_private.pop_function_mode)
            self.ctx.take_back(self.held)
            _local.stack.append(self.ctx)
            undo.callback(self._stop_resumed)
            undo.callback(end_recompute, begin_recompute(self.comm_modes))
        except BaseException:
            undo.close()
            raise
        return undo.close


def _mode_stack() -> list[Any]:
    """The torch function modes on the stack, bottom first."""
    return [torch_private.function_mode_at(i) for i in range(torch_private.function_mode_depth())]


def _of_call(mode: Any, ctx: SpmdContext) -> bool:
    """Whether ``mode`` is one of call ``ctx``'s own modes (they keep the call as ``.ctx``)."""
    return getattr(mode, "ctx", None) is ctx


def _on_mode_stack(mode: Any) -> bool:
    return any(m is mode for m in _mode_stack())


@contextlib.contextmanager
def without_call_modes(ctx: SpmdContext) -> Iterator[None]:
    """Call ``ctx``'s own torch function modes (its VmaMode, its marker) off the stack; the
    others stay, in their order (a piece compiled inside the call runs under none of them)."""
    stack = _mode_stack()
    ours = [i for i, m in enumerate(stack) if _of_call(m, ctx)]
    lifted = stack[ours[0] :] if ours else []
    kept = [m for m in lifted if not _of_call(m, ctx)]
    for _ in lifted:
        torch_private.pop_function_mode()
    for m in kept:
        torch_private.push_function_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            torch_private.pop_function_mode()
        for m in lifted:
            torch_private.push_function_mode(m)


def _remove_marker(ctx: SpmdContext) -> CallMarker | None:
    """Pop the topmost marker of ``ctx``, wherever it sits (a ``torch.device`` block entered
    inside the call moves DeviceContext modes to the bottom of the stack); return it."""
    return torch_private.remove_function_mode(lambda m: isinstance(m, CallMarker) and m.ctx is ctx)
