"""What every backend's compile path shares: a call traced by ``torch.compile`` (docs/design.md section 7).

When Dynamo traces a mapped call, its backend's compile path (``backends/_dist_compile.py`` on a
real mesh, ``backends/simulated/_traced.py`` on the simulated one) types the call with the
classes here, so that type inference, the out_specs check and every ``SpmdError`` run once, at
trace time, and nothing of them runs per step:

* :class:`TracedContext`: types as stamps set with ``setattr`` (Dynamo traces attribute writes
  on tensors, not ``__dict__``), implicit pvary aliases cached in a dict keyed by the tensor
  (Dynamo hashes tensors by identity, not ``id()``), the call token an instance of a small class
  (Dynamo cannot trace ``object()``);
* :class:`CompiledVmaMode`: every op takes ``VmaMode``'s general path;
* :func:`warm_types`: the type algebra's memos filled before any trace reads them (Dynamo guards
  on the length of every dict a trace reads);
* what must run eagerly at trace time is marked ``torch_private.trace_constant`` where it is
  defined (the error texts' types, the user's line, the block rule's index, the in_specs'
  indices, the dtype probes, here the function's label and the trace's frames).

Importing this module does not import Dynamo (a real mesh's backend imports it).
"""

from __future__ import annotations

import itertools
import types
from collections.abc import Callable
from typing import Any

import torch

from . import _blocks
from . import _torch_private as torch_private
from ._collectives._record import implicit_pvary
from ._context import SpmdContext
from ._errors import SpmdError, fn_label
from ._operands import is_inplace, result_tensors
from ._stamps import STAMP_ATTR, TrackedContext
from ._tracking import VmaMode
from ._types import INVARIANT, Vma

WARM_ALL_STATES = 4
_WARMED: set[tuple[str, ...]] = set()


def warm_types(names: tuple[str, ...]) -> bool:
    """Intern every type over the axes ``names`` and fill every memo of the type algebra
    (``Vma``'s union / add / remove), once per set of axis names, before any trace. Dynamo
    guards on the dicts a trace reads (their length, the keys it looked up): a type or memo
    entry made later (by the trace itself, or by an eager call between two steps) would
    recompile the graph. Every state of every axis (partial sums are inferred in ordinary
    programs) up to :data:`WARM_ALL_STATES` axes (4: 256 types, about 0.13 s); beyond, the
    varying-only types."""
    if names in _WARMED:
        return True
    if len(names) <= WARM_ALL_STATES:
        states = itertools.product(range(4), repeat=len(names))  # invariant, V, U, R per axis
        vmas = [
            Vma.make(*(frozenset(a for a, s in zip(names, pick) if s == k) for k in (1, 2, 3)))
            for pick in states
        ]
    else:
        vmas = [Vma.of(c) for k in range(len(names) + 1) for c in itertools.combinations(names, k)]
    tuples = [p for k in range(len(names) + 1) for p in itertools.permutations(names, k)]
    for v in vmas:
        for w in vmas:
            v.union(w)
        for t in tuples:
            v.add(t)
            v.remove(t)
    _WARMED.add(names)
    return True


#: :func:`warm_types` run eagerly when a trace calls it (a compile path's first step).
warm_types_eagerly = torch_private.trace_constant(warm_types)


@torch_private.trace_constant
def _label(fn: Any) -> str:
    """The function's label for messages, computed eagerly at trace time."""
    return fn_label(fn)


@torch_private.trace_constant
def route_view_attributes() -> bool:
    """Run eagerly when the first call is traced: ``x.T`` & co. and ``torch.index_put_`` reach
    the VmaMode, as in eager (``_torch_private.route_view_attributes_to_modes``,
    ``route_functions_to_modes``)."""
    return (
        torch_private.route_view_attributes_to_modes() and torch_private.route_functions_to_modes()
    )


@torch_private.trace_constant
def root_frame() -> tuple[str, str]:
    """(file, function) of the frame Dynamo compiles, run eagerly at trace time."""
    return torch_private.traced_root_frame() or ("", "")


@torch_private.trace_constant
def _in_subgraph() -> bool:
    """``traced_in_subgraph`` run eagerly at trace time."""
    return torch_private.traced_in_subgraph()


# Dynamo traces a higher-order op's body (checkpoint, cond, ...) into a subgraph whose tensors
# are new variables, without the attributes our types live in: every value there would read
# invariant (no implicit pvary, so on a real mesh no gradient psum: silently wrong gradients).
_SUBGRAPH = (
    "spmd_map of {fn}: torch.compile traces part of the per-device function into a "
    "higher-order op's subgraph (torch.utils.checkpoint, torch.cond, ...), where named_spmd "
    "cannot see the values' types (Dynamo does not carry them into the subgraph), so the call "
    "would run with wrong types and gradients. Fix: when compiling, call the function without "
    "the checkpoint (torch.compile's partitioner recomputes cheap activations itself, and its "
    "activation memory budget setting trades memory for more recomputation), "
    "or run the mapped call eagerly, where activation checkpointing works, collectives "
    "included."
)


class _Token:
    """Identifies one traced call in its stamps (Dynamo cannot trace ``object()``)."""


class TracedContext(TrackedContext):
    """A traced call: stamps as attributes, implicit pvary aliases keyed by the tensor.
    Subclasses implement the primitives."""

    marks_calls = False
    # not TrackedContext's caches, so none to hand over (no marker resumes a traced call)
    let_go, take_back = SpmdContext.let_go, SpmdContext.take_back

    def __init__(self, mesh: Any, fn: Callable[..., Any]):
        SpmdContext.__init__(self, mesh, fn)  # not TrackedContext's caches: Dynamo traces this
        if isinstance(fn, types.FunctionType):  # traced, its __qualname__ reads as a descriptor
            self.fn_label = _label(fn)  # (a partial cannot be a trace_constant argument)
        self.call_token = _Token()
        self.aliases: dict[torch.Tensor, dict[tuple[str, ...], torch.Tensor]] = {}
        self.recipes = None  # (only an eager call is planned)

    def vma(self, x: torch.Tensor) -> Vma:
        if _in_subgraph():  # a collective in a checkpointed piece: its operand lost its type
            raise SpmdError(_SUBGRAPH.format(fn=self.fn_label))
        stamp = getattr(x, STAMP_ATTR, None)
        if stamp is not None and stamp[0] is self.call_token:
            return stamp[1]
        return INVARIANT

    def stamp_of(self, vma: Vma) -> tuple[object, Vma]:
        return (self.call_token, vma)

    def stamp(self, x: torch.Tensor, vma: Vma) -> torch.Tensor:
        setattr(x, STAMP_ATTR, (self.call_token, vma))
        return x

    pin = stamp  # (invariant types are stamped here too)

    def stamp_input(self, x: torch.Tensor, spec: Any) -> torch.Tensor:
        """As the eager one, with attributes; the traced paths give every argument position a
        tensor object of its own (a view, or a block) before stamping it."""
        self.stamp(x, spec.vma())
        _blocks.mark(x, spec, self.call_token)
        return x

    def cached_pvary(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        return self.memo_alias(t, axes, lambda: implicit_pvary(self, t, axes))

    def memo_alias(self, t: torch.Tensor, tag: tuple[str, ...], make) -> torch.Tensor:
        """The traced call's cache of implicit casts (pvary, and I -> R beside reduced
        operands): keyed by the tensor, not its id (a traced input's id would be guarded)."""
        per = self.aliases.get(t)
        if per is None:
            per = self.aliases[t] = {}
        alias = per.get(tag)
        if alias is None:
            alias = per[tag] = make()
        return alias


@torch_private.trace_constant
def _writes_in_place(func: Any) -> bool:
    """``is_inplace`` run eagerly at trace time: its memo is a dict (Dynamo would guard on its
    length) and Dynamo cannot trace ``str.endswith`` on an op's name."""
    return is_inplace(func)


class CompiledVmaMode(VmaMode):
    """:class:`VmaMode` for a traced call: every op takes the general path (types are read with
    ``getattr``)."""

    inplace = staticmethod(_writes_in_place)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _PASS:
            return func(*args, **(kwargs or {}))
        if isinstance(
            func, torch_private.HigherOrderOperator
        ):  # its body was traced without the mode
            raise SpmdError(_SUBGRAPH.format(fn=self.ctx.fn_label))
        if func is torch.Tensor.__getitem__ or func is torch.Tensor.__setitem__:
            args = (args[0], bool_lists_as_positions(args[0], args[1]), *args[2:])
        return self._general(func, args, kwargs)

    def _run(self, func, args, kwargs):
        # Dynamo refuses setattr on the tensors of a multi-output op (chunk, split, max: no
        # attribute-mutation record): each becomes a view of its own, which takes the stamp
        out = func(*args, **(kwargs or {}))
        if isinstance(out, (tuple, list)):  # also torch.return_types (max, sort, ...)
            with torch_private.DisableTorchFunction():
                out = type(out)([o.view_as(o) if isinstance(o, torch.Tensor) else o for o in out])
        return out

    def _stamp_outputs(self, out, union):
        for o in result_tensors(out):
            self.ctx.stamp(o, union)
        return out


def bool_lists_as_positions(x: torch.Tensor, index: Any) -> Any:
    """``index`` with each list of Python bools (``x[[True, False, True]]``) that masks a dim of
    ``x`` of its length replaced by the list of its True positions: the same selection, of a
    size known while tracing. Dynamo turns such a list into a mask tensor, whose selection it
    sizes only when the program runs (a varying operand's then cannot be batched, nor its
    blocks assembled). Lists after an Ellipsis or a tensor, whose dim is not counted here, stay
    masks."""
    entries = index if isinstance(index, tuple) else (index,)
    dim, rewritten = 0, []
    for entry in entries:
        if isinstance(entry, torch.Tensor) or entry is Ellipsis:
            return index  # (the dims after it are not counted)
        if isinstance(entry, list) and entry and all(type(b) is bool for b in entry):
            if dim < x.dim() and x.shape[dim] == len(entry):
                entry = [i for i, b in enumerate(entry) if b]
        rewritten.append(entry)
        dim += entry is not None and type(entry) is not bool  # (None and True add a dim)
    return tuple(rewritten) if isinstance(index, tuple) else rewritten[0]


_PASS = frozenset(
    {
        torch.rand_like,
        torch.randn_like,
        torch.randint_like,
        torch.autograd.grad,
        torch.Tensor.backward,
    }
)
