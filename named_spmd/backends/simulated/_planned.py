"""Plans on the simulated backend: the partial-sum typing of a call typed once per signature.

A call whose inputs hold blocks of mesh axes types every op (``_marks.PartialMode``: the
contractions that make unreduced values, ``_blocks``, and the partial-sum algebra on them). As on
a real mesh (``named_spmd._plan``, docs/design.md section 5.8), the first call of a signature
writes each op's decisions down as a ``Step`` (:class:`PlanningMode`): the mark set on its
results and the block record of each. A later call of the signature (:class:`ReplayMode`) applies
a step where the op and its guard key match, instead of deriving it, and types the call from the
first op that differs, every tensor so far carrying what typing gave it. Values are vmap's
either way; collectives, inputs and outputs are typed in every call.

The guard key is ``_plan``'s with one difference: a tensor no op of the call numbered (a
collective's unmarked result, a tensor from outside the call) is keyed by its type and block
record besides its shape and dtype, since here such a tensor may vary (it is batched), where on a
real mesh only a stamped tensor does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from ... import _blocks
from ... import _torch_private as torch_private
from ..._operands import METADATA, NOT_OPS, result_tensors
from ..._plan import (
    Plan,
    Step,
    _held,
    _numbered_alike,
    guard_key,
    matches,
    result_shapes,
    shaped_alike,
)
from ..._replay import Replay
from ..._stamps import _NUMBERS, _number
from ..._stamps import _SRC as SRC
from ._marks import PartialMode, set_mark, transform_inside, with_input_varied

Tensor = torch.Tensor
_BLOCKS = _blocks.ATTR
FORGET = object()  # a step's block record for a result whose record typing dropped
maybe_current_level = torch_private.maybe_current_level
maybe_get_level = torch_private.maybe_get_level


def _unnumbered(ctx: Any, a: Tensor) -> Any:
    """The guard key (``_plan.guard_key``) of a tensor no op numbered: an unbatched input's
    number (:func:`begin`), else its type and blocks too, since on a simulated mesh such a
    tensor may vary."""
    numbers = ctx.input_numbers
    if numbers:
        n = numbers.get(id(a))  # (the input is alive all call long: its id is its own)
        if n is not None:
            return n
    return (a.shape, a.dtype, ctx.vma(a), _held(a, _BLOCKS, ctx.token))


class PlanningMode(PartialMode):
    """The typed call of a signature, which writes each op's decisions down (``Step``)."""

    def __init__(self, ctx: Any) -> None:
        super().__init__(ctx)
        self.outside = functools.partial(_unnumbered, ctx)
        self.steps: list[Step] = []
        self.replayable = True
        self.hooks_seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.hooks_seen and torch_private.saved_tensors_hooks_active():
            self.hooks_seen = True
        if func in METADATA:  # nothing to type: no step (a replay runs them as they are too)
            return func(*args, **kwargs)
        if func in NOT_OPS or transform_inside(self.ctx):
            self.replayable = False  # differentiation inside the call: typed every call
        ctx = self.ctx
        if not self.replayable or ctx.in_collective:
            return self.typed(func, args, kwargs)[0]
        key = guard_key(ctx.token, args, kwargs, self.outside)
        out, vma, blocked, varied = self.typed(func, args, kwargs)
        results = result_tensors(out)
        token = ctx.token
        outputs = tuple(
            (vma, (_held(o, _BLOCKS, token) or FORGET) if blocked else None) for o in results
        )
        # casts: the axes its input was expanded over (``_marks.input_axes``)
        self.steps.append(Step(func, key, varied, outputs, result_shapes(func, results)))
        for o in results:
            ctx.number(o)
        ctx.note_handed_back(out, args, kwargs)  # (maybe the caller's: ``Call.unstamp``)
        return out

    def plan(self) -> Plan | None:
        """The call's plan; None where it cannot be replayed (differentiation or a transform
        inside it, saved-tensor hooks: a non-reentrant checkpoint, or it read a type)."""
        if not self.replayable or self.hooks_seen or self.ctx.types_read:
            return None
        return Plan(self.steps)


class ReplayMode(PartialMode):
    """A call replayed from a ``Plan``; typed from the first op its steps do not match."""

    def __init__(self, ctx: Any, plan: Plan) -> None:
        super().__init__(ctx)
        self.outside = functools.partial(_unnumbered, ctx)
        self.steps = plan.steps
        self.n = len(plan.steps)
        self.i = 0
        self.diverged = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (the step's application and ``ctx.number`` inlined: this runs for
        # every op of the call, and a Python frame costs about what the rest of it does)
        if func in METADATA:
            return func(*args, **kwargs) if kwargs else func(*args)
        ctx = self.ctx
        i = self.i
        if not self.diverged and not ctx.in_collective:
            # (transform_inside, inlined)
            if i < self.n and maybe_current_level() == ctx.inner_level:
                step = self.steps[i]
                # (a property's getter is a new method-wrapper at each access: equal, not same)
                if step.func is func or step.func == func:
                    token = ctx.token
                    if _numbered_alike(token, step.key, args, kwargs) or matches(
                        token, step.key, args, kwargs, self.outside
                    ):
                        self.i = i + 1
                        called = args
                        if step.casts:
                            args = with_input_varied(ctx, args, step.casts)
                        out = func(*args, **kwargs) if kwargs else func(*args)
                        results = (out,) if type(out) is Tensor else result_tensors(out)
                        if not shaped_alike(results, step.shapes):  # (``_plan``'s module doc)
                            self.diverged = True
                            return self.typed(func, called, kwargs or {})[0]
                        for o, (vma, lay) in zip(results, step.outputs):
                            d = o.__dict__
                            if vma is not None:
                                set_mark(o, token, vma)
                                ctx.forget_last_vma()
                            if lay is FORGET:
                                d.pop(_BLOCKS, None)
                            elif lay is not None:
                                d[_BLOCKS] = (token, lay)
                            n = ctx.numbered
                            d[SRC] = (token, _NUMBERS[n] if n < len(_NUMBERS) else _number(n))
                            ctx.numbered = n + 1
                        ctx.note_handed_back(out, args, kwargs)  # (``Call.unstamp``)
                        return out
            self.diverged = True  # typed from here on: every tensor so far is typed
        return self.typed(func, args, kwargs or {})[0]


def lookup(call: Any) -> Replay | None:
    """``call``'s entry in its mapped function's table of plans, or None where it cannot be
    planned (``_replay``: debug mode, a transform around the call, ...). Made before the call
    enters its vmap levels, which are transforms too."""
    table = Replay(call, planned=True)
    return None if table.checked is None or table.signature is None else table


def begin(ctx: Any, local: list[Any], table: Replay | None) -> PartialMode:
    """The mode that types the ops of a call whose inputs (``local``, entered) hold blocks: a
    replay of its signature's plan, the planning of one, or, where the call cannot be planned
    (``table`` None), a plain :class:`PartialMode`. Numbers the inputs of a planned call."""
    if table is None:
        return PartialMode(ctx)
    ctx.numbering = True
    numbers = ctx.input_numbers = {}
    for x in local:
        if isinstance(x, Tensor):
            if maybe_get_level(x) == -1:  # unbatched: maybe the caller's own, numbered
                numbers[id(x)] = _number(ctx.numbered)  # aside (nothing to remove after)
                ctx.numbered += 1
            else:
                ctx.number(x)
    if isinstance(table.entry, Plan):
        return ReplayMode(ctx, table.entry)
    return PlanningMode(ctx)


def finish(mode: PartialMode, table: Replay | None) -> None:
    """After a call's body returned: keep its plan, or count its replay."""
    if table is None:
        return
    if isinstance(mode, ReplayMode) and isinstance(table.entry, Plan):
        table.entry.count(mode.i, mode.diverged)
    elif isinstance(mode, PlanningMode):
        plan = mode.plan()
        if plan is not None:
            table.keep(plan)
