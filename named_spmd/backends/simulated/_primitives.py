"""The context of a simulated call: a value's type read off its vmap levels, and the primitives
(all_reduce, all_gather, permute, ...): the members' values stacked off the levels (``_levels``),
the collective's math on the stack (``_stacked``, as the compiled path's), the result made
varying again where it is (:meth:`SimulatedContext._members`)."""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch

from ... import _blocks
from ... import _torch_private as torch_private
from ..._accounting import needs_grad
from ..._context import SpmdContext
from ..._errors import SpmdError
from ..._mesh import Mesh
from ..._stamps import _SRC as SRC
from ..._stamps import _number as number
from ..._types import INVARIANT, Vma
from . import _instances as _instances  # installs the per-instance printing of values
from . import _levels
from . import _stacked as stacked
from ._attention import AttentionMode
from ._marks import (
    PartialMode,
    mark_of,
    marked_within,
    set_mark,
    set_mark_within,
    transform_inside,
)


class SimulatedContext(SpmdContext):
    """A running simulated call: one token per axis, batched at that axis' level only."""

    stamps = False  # a tensor's type is the set of our levels it is batched at
    fills_masks = True  # vmap cannot batch a boolean-mask write (``_masked_fill``)

    def __init__(self, mesh: Mesh, fn: Any, tokens: dict[str, torch.Tensor]):
        super().__init__(mesh, fn)
        self.tokens = tokens
        self.level_axis = {torch_private.maybe_get_level(t): a for a, t in tokens.items()}
        self.axis_level = {a: lv for lv, a in self.level_axis.items()}
        self.inner_level = max(self.level_axis, default=0)
        self.outer_level = min(self.level_axis, default=0)
        self.sizes = mesh.shape  # a copy; Mesh.shape builds a new dict per access
        self.device = next(iter(tokens.values())).device if tokens else torch.device("cpu")
        self.recorder: Any = None  # the ImplicitPvaryRecorder while a CommMode records
        self._vma_of: torch.Tensor | None = None
        self._vma: Vma = INVARIANT
        self.token = object()  # identifies this call's marks (unreduced / reduced values)
        # attention of every instance in one call of torch's kernel (``_attention``)
        self.attention = AttentionMode(self)
        self.partial_mode: PartialMode | None = None  # pushed with the first marked value
        # id -> (weak reference, type) of the partial sums a torch.func transform inside the call
        # made (``_marks.set_mark_within``)
        self.transform_marks: dict[int, tuple[weakref.ref[torch.Tensor], Vma]] = {}
        # a planned or replayed call (``_planned``): each tensor it types gets the next number
        self.numbering = False
        self.numbered = 0
        self.input_numbers: dict[int, Any] | None = None  # (``_planned.begin``)
        # (id(input), axes) -> (input, its expand over the axes' levels): ``_marks.input_axes``;
        # emptied when the body (or a checkpoint's recomputation) ends: the aliases hold
        # activations, and a context lives on until the garbage collector breaks its cycles
        self.varied: dict[tuple[int, tuple[str, ...]], tuple[torch.Tensor, torch.Tensor]] = {}

    def vma(self, x: torch.Tensor) -> Vma:
        # Collectives ask about the same operand several times in a row: remember the last one
        # (by identity; the reference keeps its id from being reused meanwhile).
        if x is self._vma_of:
            return self._vma
        if self.partial_mode is not None:  # unreduced / reduced values carry a mark
            marked = mark_of(x, self.token)
            if marked is None and (
                self.transform_marks or torch_private.maybe_get_level(x) > self.inner_level
            ):
                marked = marked_within(self, x)
            if marked is not None:
                return marked
        axes = self._batched_axes(x)
        vma = _VMA_OF.get(axes)
        if vma is None:
            vma = _VMA_OF[axes] = Vma.of(axes)
        self._vma_of, self._vma = x, vma
        return vma

    def let_go(self) -> Any:
        # the last tensor typed: its graph may reach a checkpoint's hooks, whose frame holds
        # the call's marker and so this context (a cycle through autograd nodes, not collected)
        self._vma_of = None
        return super().let_go()

    def varied_input(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """``x`` expanded over ``axes``' levels, made once per call (the tensor is kept, so its
        id is not reused meanwhile): the physical form of an implicit pvary, same values. Made
        afresh without grad, and under saved-tensor hooks (a checkpoint's forward, whose
        activations the cache would keep until the body ends)."""
        key = (id(x), axes)
        hit = self.varied.get(key)
        if hit is not None:
            return hit[1]
        with torch_private.DisableTorchFunction():
            alias = self.pvary(x, axes)
        # kept where it is differentiated (an alias made without grad would leave a later use
        # under grad no gradient; without grad, keeping the aliases would only hold activations)
        if (
            torch.is_grad_enabled()
            and needs_grad(x)
            and not torch_private.saved_tensors_hooks_active()
        ):
            self.varied[key] = (x, alias)
        return alias

    def held_blocks(self, x: torch.Tensor) -> Any:
        return _blocks.recorded_layout(x, self.token)

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
            self._mark(x, vma)
        elif self.partial_mode is not None:
            self._mark(x, vma)
        if self.numbering:  # a type a replay's guard must tell from the tensor's earlier one
            self.number(x, vma)
        return x

    def _mark(self, x: torch.Tensor, vma: Vma) -> None:
        if self.transform_marks or transform_inside(self):
            set_mark_within(self, x, vma)  # (a transform inside the call, now or before)
        else:
            set_mark(x, self.token, vma)

    def number(self, x: torch.Tensor, vma: Vma | None = None) -> None:
        """Give ``x`` the call's next number (the key a replay's guard compares, ``_planned``),
        with its type and shape where typed outside the plan's steps (``TrackedContext.number``)."""
        n = number(self.numbered)
        x.__dict__[SRC] = (self.token, n if vma is None else (n, vma, x.shape))
        self.numbered += 1

    def end_partial(self) -> None:
        """Pop the PartialMode at the end of the body (the marks stay, for the outputs); one
        the call's marker runs (``marker_typing``, also in a checkpoint's recomputation) was
        never pushed."""
        if self.partial_mode is not None and self.partial_mode is not self.marker_typing:
            self.partial_mode.__exit__(None, None, None)

    def _batched_axes(self, x: torch.Tensor) -> tuple[str, ...]:
        # Walk the wrappers from the outside in; ours are consecutive levels and any wrapper at
        # one of them is our vmap's (levels are stack depths), so stop below the outermost.
        found: tuple[str, ...] = ()
        while True:
            level = torch_private.maybe_get_level(x)
            if level < self.outer_level:  # also -1: a plain tensor
                return found
            axis = self.level_axis.get(level)
            if axis is not None:
                found += (axis,)
            x = torch_private.get_unwrapped(x)

    def axis_index(self, axes: tuple[str, ...]) -> torch.Tensor:
        # A copy: the tokens are shared between calls, and user code may write into the result.
        index = self._index(axes)
        return index.clone() if len(axes) == 1 else index

    def per_member(self, axes, make):
        # Every member's value, stacked as an invariant plain tensor; own_block makes the stack
        # dim the levels' batch dims (no copy on the fast path), as the inputs enter.
        n = self.mesh.axis_size(axes)
        with torch_private.DisableFuncTorch():
            stacked = torch.stack([make(i) for i in range(n)])
        return self.own_block(stacked, axes, 0)

    def _index(self, axes: tuple[str, ...]) -> torch.Tensor:
        index = self.tokens[axes[0]]
        for a in axes[1:]:
            index = index * self.sizes[a] + self.tokens[a]
        return index

    def resume(self):
        """Re-enter this call's vmap levels, for a checkpoint's recomputation in backward (see
        ``_calls.CallMarker``): the recomputed piece gets the call's own batched tensors back,
        whose levels must then be live again, at the same numbers (levels are stack depths)."""
        want = sorted(self.level_axis)
        got = [
            torch_private.vmap_increment_nesting(self.sizes[self.level_axis[lv]], "same")
            for lv in want
        ]
        if got != want:
            _leave_levels(len(got))
            raise SpmdError(
                f"spmd_map of {self.fn_label}: torch.utils.checkpoint recomputes a piece of it in "
                f"backward, but that backward runs under {got[0] - 1} functorch transform(s) and "
                f"the call ran under {want[0] - 1}, so the call's vmap levels cannot be resumed. "
                "Fix: run the backward pass under the same torch.func transforms as the call, or "
                "checkpoint around the call instead of inside it."
            )
        return functools.partial(self._leave, len(got))

    def _leave(self, n: int) -> None:
        _leave_levels(n)
        self.varied.clear()

    def apply(self, rec, x, axes, params, user_operand=False):
        # The primitives' own ops mix the level tokens with stacked values: no user-level mixing
        # for the implicit-pvary accounting (or the partial-sum algebra) to see, and no op of
        # the program for any torch function mode (as on the real mesh); each mode would cost
        # every op of the primitive a Python call (about 40% of a one-psum call).
        with torch_private.DisableTorchFunction():
            return rec.forward(self, x, axes, params)

    # --- primitives -----------------------------------------------------------------------
    def all_gather(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """Invariant stack ``[n, *local]`` of the group's values, row-major over ``axes``: a
        tensor of its own, as a real mesh's (the stack views the operand's storage, so a write
        into it would reach the operand, and through it the caller's tensor)."""
        return self._stack(x, axes).clone()

    def _stack(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """The members' values stacked, ``[n, *local]`` (invariant, a view of ``x``): the
        ``z`` of ``_stacked``'s math."""
        for a in reversed(axes):  # minor axis first, so the major one ends up outermost
            x = _levels.gather(
                x, self.tokens[a], self.sizes[a], self.axis_level[a], self.inner_level
            )
        return x.flatten(0, len(axes) - 1) if len(axes) > 1 else x

    def pvary(self, x: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        for a in axes:
            x = _levels.vary(x, self.tokens[a], self.sizes[a], self.axis_level[a], self.inner_level)
        return x

    def own_block(self, stack: torch.Tensor, axes: tuple[str, ...], dim: int) -> torch.Tensor:
        """Slice ``axis_index(axes)`` of dim ``dim`` (size n) of an invariant tensor: varying.

        On the fast path the dim just becomes the levels' batch dim (no op). Otherwise (a grad
        or jvp *inside* the per-device function) the stack is pvary'd and indexed: the transpose
        of that pvary (a psum) brings every instance's cotangent of its slice back to the stack."""
        if len(axes) > 1:  # row-major: the first axis is the major part of the dim
            stack = stack.unflatten(dim, [self.sizes[a] for a in axes])
        for a in axes:
            out = _levels.scatter(stack, dim, self.axis_level[a], self.inner_level)
            if out is None:
                break
            stack = out
        else:
            return stack
        axes = axes[axes.index(a) :]  # the axes left to scatter, on the fallback path
        stack = self.pvary(stack.flatten(dim, dim + len(axes) - 1), axes)
        return stacked.member_slice(stack, dim, self._index(axes))

    def _members(self, z: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """A varying result of ``_stacked``'s math (``[n, *local]``, member i's value at i) as
        the value of each instance."""
        return self.own_block(z, axes, 0)

    def all_reduce(self, x, axes, op):
        op = stacked.reduction(op, x.dtype)
        if op != "sum" and len(axes) > 1:
            # One reduction over the whole group, so that ties share the gradient evenly
            # (level by level, amax would halve it at each level).
            return stacked.reduce(self._stack(x, axes), op)
        for a in axes:  # a sum reduces one axis after another
            level = self.axis_level[a]
            y = _levels.reduce_varying(x, level, self.inner_level, op)  # the common case
            if y is None:
                y = _levels.gather_reduce(
                    x, self.tokens[a], self.sizes[a], level, self.inner_level, op
                )
            x = y
        return x

    def reduce_scatter(self, x, axes, dim):
        # ``stacked.reduce_scatter``'s two steps, at the levels: summed level by level, then the
        # summed dim made the levels' batch dim (no op); summing a stack would batch the sum
        return self.own_block(self.all_reduce(x, axes, "sum"), axes, dim)

    def all_to_all(self, x, axes, dim):
        # a tensor of its own, as all_gather's result (the stack views the operand)
        return self._members(stacked.all_to_all(self._stack(x, axes), dim).clone(), axes)

    def broadcast(self, x, axes, root):
        return stacked.broadcast(
            self._stack(x, axes), root
        ).clone()  # (its own memory, as all_gather's)

    def permute(self, x, axes, pairs):
        n = self.mesh.axis_size(axes)
        source, receives = _permutation(n, pairs, self.device)
        if len(axes) == 1:
            out = _levels.permute(x, self.axis_level[axes[0]], self.inner_level, source, receives)
            if out is not None:
                return out
        return self._members(stacked.permute(self._stack(x, axes), source, receives), axes)


def _leave_levels(n: int) -> None:
    for _ in range(n):
        torch_private.vmap_decrement_nesting()


# The type of each tuple of batched axes, as _batched_axes finds them (types are interned).
_VMA_OF: dict[tuple[str, ...], Vma] = {}


@functools.lru_cache(maxsize=256)  # programs use a handful of permutations
def _permutation(n: int, pairs, device: torch.device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(source index of every destination, receives mask or None if all receive), cached:
    making small tensors costs more than the permutation itself on tiny operands."""
    source, receives = stacked.permutation(n, pairs)
    with torch_private.DisableFuncTorch():  # plain tensors, even under functionalize & co
        mask = None if all(receives) else torch.tensor(receives, device=device)
        return torch.tensor(source, device=device), mask
