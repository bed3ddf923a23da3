"""``ns.compile``: ``torch.compile`` for a piece of a per-device function (docs/design.md section 7).

``torch.compile(piece)`` called inside a call on a real mesh cannot work by itself: Dynamo would
trace the call's eager ``VmaMode``, and the compiled code would then *run* under that mode again
(torch runs compiled code under the torch function modes active around it), typing the graph's
own buffers. ``ns.compile(piece)`` lifts the call's modes off the stack around the compiled
function and types the piece inside it, on the compile path of the backend: on a real mesh the
piece is traced with the call's types (its collectives and implicit pvarys as functional
collectives in the graph) and compiled once per input types and block layouts, not per call.
Elsewhere:

* outside any ``spmd_map`` call: ``torch.compile(piece)``;
* inside a call that is itself being compiled (``torch.compile`` of the mapped function): the
  piece is traced with the call;
* on the simulated mesh and in ``.check()``: the piece runs uncompiled, with the same numbers
  and types (torch cannot compile under the simulation's vmap levels).
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch

from . import _calls
from . import _torch_private as torch_private
from ._accounting import recording
from ._api import BoundSpmdFunction, SpmdFunction


class CompiledPiece:
    """``fn`` compiled where the active call allows it (see the module docstring)."""

    def __init__(self, fn: Callable[..., Any], options: dict[str, Any]):
        self.fn = fn
        self.options = options
        self.plain: Callable[..., Any] | None = None  # torch.compile(fn), outside any call
        self.in_call: Callable[..., Any] | None = None  # the backend's compiled body
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():  # traced with the enclosing compiled region
            return self.fn(*args, **kwargs)
        ctx = _calls.active()
        if ctx is None:
            if self.plain is None:
                self.plain = torch.compile(self.fn, **self.options)
            return self.plain(*args, **kwargs)
        return ctx.run_compiled(self, args, kwargs)


def compile(fn: Callable[..., Any] | None = None, **options: Any) -> Any:
    """``torch.compile`` for a mapped function or for a piece of a per-device function;
    ``options`` are ``torch.compile``'s (``backend``, ``fullgraph``, ``mode``, ...). Use as
    ``ns.compile(fn)`` or ``@ns.compile(fullgraph=True)``.

    A mapped function (``ns.compile(ns.spmd_map(...))``, a mapped method ``ns.compile(m.step)``,
    or their ``.local``) compiles whole, as ``torch.compile`` would, with a compile cache of its
    own. ``torch.compile`` of the mapped function itself shares one cache (that of torch's
    wrapper for callable objects) with every other callable object compiled so, and the ninth
    one in a process hits Dynamo's recompile limit. Its calls
    check fewer guards: none on this package's constants and memo tables, which the trace reads
    while it infers types (:func:`library_guard_filter`; about 0.1 ms per call on a small GPT
    step). Under an active ``ns.CommMode`` its calls run eagerly, and are counted; so do calls
    whose inputs split into blocks of unequal sizes (docs/uneven.md).

    On a real mesh the piece compiles once and runs with the call's types: its collectives and
    the psums of its implicit pvarys are functional collectives in the graph, so Inductor may
    overlap them. On the simulated mesh and in ``.check()`` it runs uncompiled, with the same
    numbers. Under an active ``ns.CommMode`` it runs uncompiled, so that every collective it
    runs is counted.

    With Inductor (the default backend), independent all-reduces of a graph are merged into
    buckets (Inductor's ``bucket_all_reduces_fx``, as DDP buckets gradients), after a pass that
    moves the gradients' waits next to each other: a training step's gradient psums become a
    few all-reduces. ``options={"bucket_all_reduces_fx": "none"}`` turns it off; with
    ``mode=`` it stays off (torch takes a mode or options, not both).

    Example::

        >>> import torch, named_spmd as ns
        >>> block = ns.compile(lambda x, w: torch.tanh(x @ w), backend="eager")
        >>> mesh = ns.make_mesh((2,), ("dp",))
        >>> f = ns.spmd_map(lambda x, w: block(x, w), mesh=mesh,
        ...                 in_specs=(ns.P("dp"), ns.P()), out_specs=ns.P("dp"))
        >>> f(torch.ones(4, 3), torch.zeros(3, 2)).shape
        torch.Size([4, 2])
    """
    if fn is None:
        return functools.partial(compile, **options)
    if isinstance(fn, BoundSpmdFunction):  # a mapped method: its method's, the instance bound
        return functools.partial(compile(fn.__func__, **options), fn.__self__)
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, BoundSpmdFunction) and fn.__name__ == "local":
        return functools.partial(compile(owner.__func__.local, **options), owner.__self__)
    options = with_bucketed_all_reduces(options)
    if isinstance(fn, SpmdFunction):
        # Its own ``__call__`` (a code object per mapped function) rather than the object:
        # torch.compile runs any other callable object through one wrapper function of torch's,
        # whose cache every such object shares, so the ninth mapped function compiled that way
        # in a process hits Dynamo's recompile limit (fullgraph: an error; else eager)
        return _counted_eagerly(fn, torch.compile(fn.__call__, **without_library_guards(options)))
    if isinstance(getattr(fn, "__self__", None), SpmdFunction) and fn.__name__ == "local":
        return _counted_eagerly(fn, torch.compile(fn, **without_library_guards(options)))
    return CompiledPiece(fn, options)


def _counted_eagerly(fn: Callable[..., Any], compiled: Callable[..., Any]) -> Callable[..., Any]:
    """``compiled``, but ``fn`` itself while an ``ns.CommMode`` records (CommMode counts what a
    call runs, and a compiled graph runs no Python to count with) or where the call's inputs
    split into blocks of unequal sizes (their instances' shapes differ, which no graph holds).
    Deciding here, before Dynamo sees the call, leaves the compiled code as it was (no trace
    of such a call, no recompile after it), and ``fullgraph=True`` holds."""
    mapped = fn if isinstance(fn, SpmdFunction) else fn.__self__  # type: ignore[attr-defined]
    local = fn is not mapped and mapped.backend.capabilities.local_blocks

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        if recording() or mapped.unequal_blocks(args, local):
            return fn(*args, **kwargs)
        return compiled(*args, **kwargs)

    return call


#: Inductor's pass that merges independent all-reduces of a graph into bucketed ones. A mapped
#: training step's backward holds one all-reduce per replicated parameter (the implicit pvarys'
#: psums); on gloo each costs about a millisecond of fixed cost, so unbucketed they dominate the
#: compiled step (docs/design.md section 7, "Bucketed all-reduces").
BUCKET_OPTION = "bucket_all_reduces_fx"
#: Inductor's option for a graph pass run before its own, bucketing included
PRE_PASS_OPTION = "post_grad_custom_pre_pass"


def _sink_output_waits(graph: Any) -> None:
    """Move the wait of every all-reduce whose result is only a graph output (a gradient) to
    just after the last wait of an all-reduce it could share a bucket with (same reduce op,
    group and dtype). Inductor buckets only all-reduces whose waits follow each other with no
    other bucket's wait between, and in a mapped step's backward the gradients' psums (the
    implicit pvarys', each at its parameter's first use) alternate with the activations' psums
    over other axes. A later wait only delays when the result is read: the order in which every
    rank issues its collectives is the same."""
    wait, all_reduce = torch_private.funcol().wait, torch_private.funcol().all_reduce
    output = next(iter(graph.find_nodes(op="output")))
    last: dict[tuple, Any] = {}  # bucket key -> its last wait in graph order
    movable: dict[tuple, list[Any]] = {}  # bucket key -> its waits read only by the output
    for node in graph.nodes:
        if node.target is wait and node.args[0].target is all_reduce:
            reduce = node.args[0]
            key = (*reduce.args[1:3], getattr(reduce.meta.get("val"), "dtype", None))
            last[key] = node
            if node.users and all(user is output for user in node.users):
                movable.setdefault(key, []).append(node)
    for key, nodes in movable.items():
        anchor = last[key]
        for node in nodes:
            if node is not anchor:
                anchor.append(node)  # right after the anchor: the run keeps graph order
                anchor = node


@functools.cache
def sink_output_waits_pass() -> Any:
    """:func:`_sink_output_waits` as an Inductor pass (made on first use: it imports Inductor),
    keyed by its source, so that Inductor's cache never serves a graph of an older version."""
    try:
        source = inspect.getsource(_sink_output_waits).encode()
    except OSError:  # installed without its sources: the bytecode
        source = _sink_output_waits.__code__.co_code
    key = hashlib.sha256(source).hexdigest()[:16]
    return torch_private.inductor_graph_pass(
        _sink_output_waits, f"named_spmd.sink_output_waits.{key}"
    )


def with_bucketed_all_reduces(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``torch.compile`` with Inductor's all-reduce bucketing on, the waits of
    the gradients' all-reduces made adjacent first (:func:`_sink_output_waits`), unless the
    compile is not Inductor's, the caller chose (``options={BUCKET_OPTION: "none"}``, or their
    own pre-pass), or a ``mode`` is given (torch takes a mode or options, not both)."""
    if options.get("backend", "inductor") != "inductor" or "mode" in options:
        return options
    inductor = dict(options.get("options") or {})
    inductor.setdefault(BUCKET_OPTION, "all")
    if inductor[BUCKET_OPTION] != "none":
        inductor.setdefault(PRE_PASS_OPTION, sink_output_waits_pass())
    return {**options, "options": inductor}


#: This package's modules whose state decides what a trace does and may change between calls:
#: the stack of active calls, CommMode's recorders, debug mode, the replay switch, the simulated
#: backend's fast-path switch. A compiled call keeps Dynamo's guards on them.
LIVE_MODULES = frozenset(
    {
        "named_spmd._calls",
        "named_spmd._accounting",
        "named_spmd._debug",
        "named_spmd._replay",
        "named_spmd.backends.simulated._levels",
    }
)
_LIBRARY_GLOBAL = re.compile(r"G\['__import_(named_spmd(?:_dot_\w+?)?)'\]")


def _is_library_constant(name: str) -> bool:
    """Whether a guard's source ``name`` reads only this package's module state outside
    :data:`LIVE_MODULES` (Dynamo names an imported module ``__import_<path, dots as _dot_>``)."""
    if "L['" in name:
        return False
    roots = _LIBRARY_GLOBAL.findall(name)
    return bool(roots) and all(r.replace("_dot_", ".") not in LIVE_MODULES for r in roots)


def library_guard_filter(entries: Any) -> list[bool]:
    """A ``guard_filter_fn`` for ``torch.compile``: keep every guard but those on this package's
    constant state. A trace of a mapped call reads the package's constants, rule tables and the
    type algebra's interned types and memos (pure functions of their keys) while it infers types;
    Dynamo guards each read, about 800 guards for a small GPT step, and checks them all before
    every call: about 0.1 ms per call, the guards' objects out of cache after the step's kernels
    (docs/design.md section 7, "Guards")."""
    return [not _is_library_constant(e.name) for e in entries]


def without_library_guards(options: dict[str, Any]) -> dict[str, Any]:
    """``options`` for ``torch.compile`` with :func:`library_guard_filter` added to the caller's
    own ``guard_filter_fn`` (both must keep a guard), unless a ``mode`` is given (torch takes a
    mode or options, not both)."""
    if "mode" in options:
        return options
    inner = dict(options.get("options") or {})
    own = inner.get("guard_filter_fn")
    if own is None:
        inner["guard_filter_fn"] = library_guard_filter
    else:
        inner["guard_filter_fn"] = lambda entries: [
            a and b for a, b in zip(own(entries), library_guard_filter(entries))
        ]
    return {**options, "options": inner}
