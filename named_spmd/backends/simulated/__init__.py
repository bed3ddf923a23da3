"""Simulated backend: every instance of the mesh runs in this process under nested vmap.

One functorch vmap level per mesh axis, entered directly by :func:`run` (the nesting order is a
performance choice: :func:`simulation_order`, ``_plan._default_order``). A tensor's vma is the set of *our* levels it is
batched at: "unbatched at this level" is exactly "invariant over this axis". Every collective is
built from the level primitives of ``_levels`` (gather / reduce / vary / scatter / permute over
one level) plus ordinary torch ops, so autograd outside the simulation yields the global gradient
with no extra machinery. Those primitives act on the levels directly (a few microseconds) and
fall back to autograd.Functions with per-instance transposes under a grad or jvp *inside* the
per-device function.

Modules: this one (the context and its primitives, :func:`run`, the backend object); ``_plan``
(nesting order, cached input / output plans); ``_levels`` (the per-level primitives and their
fallback Functions); ``_lowered`` (the primitives under a grad / jvp inside the per-device
function); ``_recording`` (implicit-pvary accounting while a ``CommMode`` records);
``_instances`` (a value's per-instance blocks: printing inside the function); ``_diagnose`` (torch
errors of the user's code told per instance).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from ... import _blocks
from ... import _torch_private as P
from ..._accounting import recording
from ..._context import SpmdContext
from ..._errors import SpmdError, VmaError, fn_label
from ..._mesh import Mesh
from ..._spec import PartitionSpec
from ..._types import INVARIANT, Vma
from . import _instances as _instances  # installs the per-instance printing of values
from . import _levels
from ._compiled import compiled_pieces_eagerly
from ._diagnose import explained
from ._marks import PartialMode, mark_of, set_mark
from ._plan import _input_plan, from_physical
from ._recording import ImplicitPvaryRecorder


class SimulatedContext(SpmdContext):
    """A running simulated call: one token per axis, batched at that axis' level only."""

    stamps = False  # a tensor's type is the set of our levels it is batched at

    def __init__(self, mesh: Mesh, fn: Any, tokens: dict[str, torch.Tensor]):
        super().__init__(mesh, fn)
        self.tokens = tokens
        self.level_axis = {P.maybe_get_level(t): a for a, t in tokens.items()}
        self.axis_level = {a: lv for lv, a in self.level_axis.items()}
        self.inner_level = max(self.level_axis, default=0)
        self.outer_level = min(self.level_axis, default=0)
        self.sizes = mesh.shape  # a copy; Mesh.shape builds a new dict per access
        self.device = next(iter(tokens.values())).device if tokens else torch.device("cpu")
        self.recorder: Any = None  # the ImplicitPvaryRecorder while a CommMode records
        self._vma_of: torch.Tensor | None = None
        self._vma: Vma = INVARIANT
        self.token = object()  # identifies this call's marks (unreduced / reduced values)
        self.partial_mode: PartialMode | None = None  # pushed with the first marked value

    def vma(self, x: torch.Tensor) -> Vma:
        # Collectives ask about the same operand several times in a row: remember the last one
        # (by identity; the reference keeps its id from being reused meanwhile).
        if x is self._vma_of:
            return self._vma
        if self.partial_mode is not None:  # unreduced / reduced values carry a mark
            marked = mark_of(x, self.token)
            if marked is not None:
                return marked
        axes = self._batched_axes(x)
        vma = _VMA_OF.get(axes)
        if vma is None:
            vma = _VMA_OF[axes] = Vma.of(axes)
        self._vma_of, self._vma = x, vma
        return vma

    def forget_last_vma(self) -> None:
        """Drop :meth:`vma`'s memo of the last tensor asked about (its type is changing)."""
        self._vma_of = None

    def stamp(self, x: torch.Tensor, vma: Vma) -> torch.Tensor:
        """Only unreduced and reduced types need recording here (the levels say the rest)."""
        if vma.partial:
            if self.partial_mode is None:
                self.partial_mode = PartialMode(self)
                self.partial_mode.__enter__()
            self._vma_of = None
            set_mark(x, self.token, vma)
        elif self.partial_mode is not None:
            set_mark(x, self.token, vma)
        return x

    def end_partial(self) -> None:
        """Pop the PartialMode at the end of the body (the marks stay, for the outputs)."""
        if self.partial_mode is not None:
            self.partial_mode.__exit__(None, None, None)

    def _batched_axes(self, x: torch.Tensor) -> tuple[str, ...]:
        # Walk the wrappers from the outside in; ours are consecutive levels and any wrapper at
        # one of them is our vmap's (levels are stack depths), so stop below the outermost.
        found: tuple[str, ...] = ()
        while True:
            level = P.maybe_get_level(x)
            if level < self.outer_level:  # also -1: a plain tensor
                return found
            axis = self.level_axis.get(level)
            if axis is not None:
                found += (axis,)
            x = P.get_unwrapped(x)

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        # A copy: the tokens are shared between calls, and user code may write into the result.
        index = self._index(axes)
        return index.clone() if len(axes) == 1 else index

    def per_member(self, axes, make):
        # Every member's value, stacked as an invariant plain tensor; own_block makes the stack
        # dim the levels' batch dims (no copy on the fast path), as the inputs enter.
        n = self.mesh.axis_size(axes)
        with P.DisableFuncTorch():
            stacked = torch.stack([make(i) for i in range(n)])
        return self.own_block(stacked, axes, 0)

    def _index(self, axes: tuple[str, ...]) -> torch.Tensor:
        index = self.tokens[axes[0]]
        for a in axes[1:]:
            index = index * self.sizes[a] + self.tokens[a]
        return index

    def resume(self):
        """Re-enter this call's vmap levels, for a checkpoint's recomputation in backward (see
        ``_context.CallMarker``): the recomputed piece gets the call's own batched tensors back,
        whose levels must then be live again, at the same numbers (levels are stack depths)."""
        want = sorted(self.level_axis)
        got = [P.vmap_increment_nesting(self.sizes[self.level_axis[lv]], "same") for lv in want]
        if got != want:
            _leave_levels(len(got))
            raise SpmdError(
                f"spmd_map of {self.fn_label}: torch.utils.checkpoint recomputes a piece of it in "
                f"backward, but that backward runs under {got[0] - 1} functorch transform(s) and "
                f"the call ran under {want[0] - 1}, so the call's vmap levels cannot be resumed. "
                "Fix: run the backward pass under the same torch.func transforms as the call, or "
                "checkpoint around the call instead of inside it."
            )
        return functools.partial(_leave_levels, len(got))

    def apply(self, rec, x, axes, params, donate=False):
        # The primitives' own ops mix the level tokens with stacked values: no user-level mixing
        # for the implicit-pvary accounting (or the partial-sum algebra) to see.
        if self.recorder is None and self.partial_mode is None:
            return rec.forward(self, x, axes, params, donate)
        with contextlib.ExitStack() as paused:
            for mode in (self.recorder, self.partial_mode):
                if mode is not None:
                    paused.enter_context(mode.paused())
            return rec.forward(self, x, axes, params, donate)

    # --- primitives -----------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Invariant stack ``[n, *local]`` of the group's values, row-major over ``axes``."""
        for a in reversed(axes):  # minor axis first, so the major one ends up outermost
            x = _levels.gather(
                x, self.tokens[a], self.sizes[a], self.axis_level[a], self.inner_level
            )
        return x.flatten(0, len(axes) - 1) if len(axes) > 1 else x

    def pvary(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        for a in axes:
            x = _levels.vary(x, self.tokens[a], self.sizes[a], self.axis_level[a], self.inner_level)
        return x

    def own_block(self, stacked: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        """Slice ``axis_index(axes)`` of dim ``dim`` (size n) of an invariant tensor: varying.

        On the fast path the dim just becomes the levels' batch dim (no op). Otherwise (a grad
        or jvp *inside* the per-device function) the stack is pvary'd and indexed: the transpose
        of that pvary (a psum) brings every instance's cotangent of its slice back to the stack."""
        if len(axes) > 1:  # row-major: the first axis is the major part of the dim
            stacked = stacked.unflatten(dim, [self.sizes[a] for a in axes])
        for a in axes:
            out = _levels.scatter(stacked, dim, self.axis_level[a], self.inner_level)
            if out is None:
                break
            stacked = out
        else:
            return stacked
        axes = axes[axes.index(a) :]  # the axes left to scatter, on the fallback path
        stacked = self.pvary(stacked.flatten(dim, dim + len(axes) - 1), axes)
        index = self._index(axes).reshape(1)
        return stacked.index_select(dim, index).squeeze(dim)

    def all_reduce(self, x, axes, op, donate=False):
        dtype = x.dtype
        if not dtype.is_floating_point:
            if dtype is torch.bool and op == "sum":
                op = "max"  # a sum of truth values is their "or", as on a real mesh
        if op != "sum" and len(axes) > 1:
            # One reduction over the whole group, so that ties share the gradient evenly
            # (level by level, amax would halve it at each level).
            return getattr(self.all_gather(x, axes), _REDUCE[op])(0)
        reduce = _REDUCE[op]
        for a in axes:  # a sum reduces one axis after another
            level = self.axis_level[a]
            y = _levels.reduce_varying(x, level, self.inner_level, reduce)  # the common case
            if y is None:
                y = _levels.gather_reduce(
                    x, self.tokens[a], self.sizes[a], level, self.inner_level, reduce
                )
            x = y
        # torch sums small integer types in int64; a mesh reduction keeps the operand's dtype
        return x if x.dtype is dtype else x.to(dtype)

    def reduce_scatter(self, x, axes, dim):
        return self.own_block(self.all_reduce(x, axes, "sum"), axes, dim)

    def all_to_all(self, x, axes, dim):
        received = self.own_block(self.all_gather(x, axes), axes, dim + 1)  # [n_src, ...]
        return received.movedim(0, dim) if dim != 0 else received

    def broadcast(self, x, axes, root):
        return self.all_gather(x, axes).select(0, root)

    def permute(self, x, axes, pairs):
        n = self.mesh.axis_size(axes)
        source, receives = _permutation(n, pairs, self.device)
        if len(axes) == 1:
            out = _levels.permute(x, self.axis_level[axes[0]], self.inner_level, source, receives)
            if out is not None:
                return out
        got = self.own_block(self.all_gather(x, axes).index_select(0, source), axes, 0)
        if receives is None:
            return got
        return torch.where(self.own_block(receives, axes, 0), got, got.new_zeros(()))


def _partial_input(ctx: SimulatedContext, x: torch.Tensor, spec: PartitionSpec) -> torch.Tensor:
    """An input unreduced over A: the member at coordinate 0 of A holds the global value, the
    others zeros (parts that sum to it). Reduced: unbatched as an invariant input; the mark
    says reduced."""
    x = x.view_as(x)  # a tensor object of the call's own, for the mark
    for a in spec.unreduced:
        x = ctx.pvary(x, (a,))
        x = torch.where(ctx.tokens[a] == 0, x, torch.zeros_like(x))
    return x


def _run_body(body, local, ctx: SimulatedContext, blocks: bool) -> list[torch.Tensor]:
    if blocks and ctx.partial_mode is None:
        # inputs hold blocks: every op is typed, for the contractions that make partial sums
        ctx.partial_mode = PartialMode(ctx)
        ctx.partial_mode.__enter__()
    try:
        return list(body(local, ctx))
    finally:
        ctx.end_partial()


def _leave_levels(n: int) -> None:
    for _ in range(n):
        P.vmap_decrement_nesting()


_REDUCE = {"sum": "sum", "max": "amax", "min": "amin"}
# The type of each tuple of batched axes, as _batched_axes finds them (types are interned).
_VMA_OF: dict[tuple[str, ...], Vma] = {}


@functools.lru_cache(maxsize=256)  # programs use a handful of permutations
def _permutation(n: int, pairs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(source index of every destination, receives mask or None if all receive), cached:
    making small tensors costs more than the permutation itself on tiny operands."""
    source = [0] * n
    receives = [False] * n
    for src, dst in pairs:
        source[dst], receives[dst] = src, True
    with P.DisableFuncTorch():  # plain tensors, even under functionalize & co
        mask = None if all(receives) else torch.tensor(receives, device=device)
        return torch.tensor(source, device=device), mask


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


@functools.cache
def _token(n: int, device: torch.device) -> torch.Tensor:
    """``arange(n)`` on ``device``, made once: two factory calls cost ~15% of a small call.
    Shared between calls, so never handed to user code (see SimulatedContext.axis_index)."""
    with P.DisableFuncTorch():  # a plain tensor, even under functionalize & co
        return torch.arange(n, device=device)


@functools.cache
def _load_decompositions() -> None:
    # torch.func.vmap registers some batching rules lazily on first use; we enter vmap levels
    # ourselves, so trigger it once.
    P.lazy_load_decompositions()


def run(
    mesh: Mesh,
    fn: Callable[..., Any],
    leaves: list[Any],
    specs: list[PartitionSpec],
    body: Callable[[list[Any], SimulatedContext], list[torch.Tensor]],
    out_specs_of: Callable[[], list[PartitionSpec]],
) -> list[torch.Tensor]:
    """Run ``body`` (per instance: local leaves -> local output tensors) on every instance.

    Returns the output tensors assembled to global values with ``out_specs_of()`` (known only
    once the body has run).

    The vmap levels are entered directly (what ``torch.func.vmap`` does inside, one level per
    axis, outermost first) rather than through nested ``vmap`` wrappers: that saves building the
    wrappers per call and, on the way out, lets an output stay free of the axes it is invariant
    over. ``vmap(out_dims=0)`` would expand it over them, and the instance-0 selection that
    followed cost a zero fill, a copy and a sum of the full expanded size in backward."""
    _load_decompositions()
    tensor_pos = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
    inputs = tuple((tuple(leaves[i].shape), leaves[i].element_size(), specs[i]) for i in tensor_pos)
    axes = tuple(mesh.shape.items())
    forced = getattr(_override, "order", None)
    if forced is not None and sorted(forced) != sorted(mesh.axis_names):
        raise SpmdError(
            f"spmd_map of {fn_label(fn)}: simulation_order{forced} does not list the mesh's axes "
            f"{mesh.axis_names} exactly once each. Fix: e.g. "
            f"ns.simulation_order{tuple(reversed(mesh.axis_names))}."
        )
    order, plans = _input_plan(axes, mesh, inputs, forced)
    local = list(leaves)
    for i, (split, perm, _) in zip(tensor_pos, plans):
        x = leaves[i].reshape(split)
        local[i] = x if perm is None else x.permute(perm)
    device = leaves[tensor_pos[0]].device if tensor_pos else torch.device("cpu")
    tokens = {a: _token(mesh.shape[a], device) for a in order}
    levels: list[int] = []
    try:
        for a in order:  # outermost first: each input's mesh dims lead in nesting order
            level = P.vmap_increment_nesting(mesh.shape[a], "same")
            levels.append(level)
            for i, (_, _, axes) in zip(tensor_pos, plans):
                if a in axes:
                    local[i] = P.add_batch_dim(local[i], 0, level)
            tokens[a] = P.add_batch_dim(tokens[a], 0, level)
        ctx = SimulatedContext(mesh, fn, tokens)
        blocks = False
        for i in tensor_pos:
            if specs[i].reduced or specs[i].unreduced:
                local[i] = ctx.stamp(_partial_input(ctx, local[i], specs[i]), specs[i].vma())
            blocks |= _blocks.mark(local[i], specs[i], ctx.token)
        if recording():  # report implicit pvary's backward psum; off the fast path
            ctx.recorder = ImplicitPvaryRecorder(ctx)
            with ctx.recorder:
                outs = _run_body(body, local, ctx, blocks)
        else:
            outs = _run_body(body, local, ctx, blocks)
        present: list[list[str]] = [[] for _ in outs]
        while levels:  # innermost first, each while its level is still the top one
            level, a = levels[-1], order[len(levels) - 1]
            for j, y in enumerate(outs):
                y = P.unwrap_if_dead(y)
                if P.maybe_get_level(y) == level:
                    y = P.remove_batch_dim(y, level, mesh.shape[a], 0)
                    present[j].insert(0, a)
                outs[j] = y
            P.vmap_decrement_nesting()
            levels.pop()
    finally:
        for _ in levels:
            P.vmap_decrement_nesting()
    return [from_physical(y, p, s, mesh) for y, p, s in zip(outs, present, out_specs_of())]


# Messages of functorch errors that mean "this code cannot run per instance under vmap".
_VMAP_LIMITS = (
    "vmap",
    "Batching rule",
    "batched tensor",
    ".item()",
    "data-dependent",
    "Cannot access data pointer",  # .tolist() / .numpy() of a batched tensor
)
# ... and those of an in-place write whose operand has instances the target lacks.
_INPLACE_UNDER_VMAP = ("inplace arithmetic", "doesn't match the broadcast shape")


def _raised_in_checkpoint(error: BaseException) -> bool:
    tb = error.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "torch.utils.checkpoint":
            return True
        tb = tb.tb_next
    return False


class SimulatedBackend:
    """Every instance in this process, under nested vmap (the default backend)."""

    name = "simulated"
    # the vmap levels are entered through functorch's private nesting calls, which Dynamo
    # refuses (docs/design.md section 9): a compiled program runs each call eagerly
    traceable = False

    def accepts(self, mesh: Mesh) -> bool:
        return mesh.device_mesh is None

    # torch errors of the user's code told per instance; compiled pieces of it run uncompiled
    run = staticmethod(compiled_pieces_eagerly(explained(run)))

    def explain(self, error: RuntimeError, where: str) -> SpmdError | None:
        text = str(error)
        if any(s in text for s in _INPLACE_UNDER_VMAP):
            return VmaError(
                f"{where}: an in-place write failed under the simulated mesh:\n  {error}\n"
                "If it writes a value that varies over mesh axes into a tensor invariant over "
                "them (an in_spec P() input or a closed-over tensor), every instance would "
                "hold different values in what is typed replicated. Fix: compute out of "
                "place (y = x + v instead of x += v)."
            )
        if "setup_context" in text and _raised_in_checkpoint(error):
            return SpmdError(
                f"{where}: torch.utils.checkpoint(..., use_reentrant=True) cannot run under the "
                f"simulated mesh (its autograd.Function does not support torch.func):\n  {error}\n"
                "Fix: pass use_reentrant=False (torch's recommended mode), which works inside "
                "the per-device function on every backend, collectives included."
            )
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
