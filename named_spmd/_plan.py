"""Plans: a call on a mesh of several instances is typed per op once per signature, then replayed.

The first call of a signature runs under :class:`PlanningMode`: typed as every call was (every
check, every error), and each op's *decisions* are written down as a :class:`Step`: the
operands' implicit casts (which operand, over which axes), the type stamped on each result and
the blocks it holds (``_blocks``). A later call with the signature runs under
:class:`ReplayMode`, which takes each op's decisions from its step instead of deriving them: no
union of types, no partial-sum algebra, no inference of blocks.

The guard. A step is replayed only if the op is the one recorded and its arguments are: each
tensor operand made by the same earlier op of the call (or the same input, collective or cast:
every tensor the call types gets a number, in order; an input's or a collective's with its
type and shape, which may change between calls), a tensor from outside the call of the same shape and
dtype, a slice by its bounds' keys (a tensor bound by its number and type, not its value), and
every other argument equal and of the same type (``1 == 1.0 == True``); and, once it ran, its
results as many and of the shapes the step recorded. Typing is a function of exactly that (and of
the signature): a result's shape may depend on values (a mask's selection, a size passed as a
tensor), and blocks, and so types, depend on shapes. So a replayed step decides what typing would
have; an op whose results differ runs again, typed (ops whose shapes depend on values write
nothing, so the rerun repeats no effect). At the first op that differs (a flag read in the
function, a branch on a value, a step number), the call goes on typed from that op: every tensor
made so far carries the type and blocks typing gave it, so the rest is typed as if the whole
call had been. Collectives, inputs and outputs are typed in every call (they read the stamps the
steps wrote); only per-op typing is replayed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from . import _blocks
from . import _torch_private as torch_private
from ._operands import (
    NOT_OPS,
    SHAPES_FROM_SHAPES,
    reads_any,
    result_tensors,
    swap_operands,
    tensor_operands,
)
from ._stamps import _ATTR, _NUMBERS, TrackedContext, _number
from ._stamps import _SRC as SRC
from ._tracking import VmaMode

Tensor = torch.Tensor
_BLOCKS = _blocks.ATTR


@dataclass(frozen=True, slots=True)
class Step:
    """One op of a typed call: what it was called with, and what typing decided."""

    func: Any
    key: tuple  # guard_key of its arguments
    # the implicit casts: ((operand position, ((kind, axes, ...), ...)), ...); on a simulated
    # mesh the axes its input is expanded over (``simulated._marks.input_axes``)
    casts: tuple
    outputs: tuple  # per tensor result: (its stamp or None, its blocks record or None)
    # per tensor result, its shape (a replay's results must have them); None: the op's follow
    # from its operands' (``SHAPES_FROM_SHAPES``), which the guard matched
    shapes: tuple | None
    # per cast, its operand's place: a position among the positional arguments or a keyword's
    # name, where every tensor operand has one, none in a list (the usual op, F.layer_norm's
    # weight=: the replay then swaps them in place); else None
    places: tuple | None = None


class Plan:
    """The steps of one signature's typed call."""

    __slots__ = ("steps", "hoistable", "first_read", "replays", "divergences")

    def __init__(self, steps: list[Step], hoistable: tuple = (), first_read: int | None = None):
        self.steps = steps
        #: the implicit casts of inputs that a replay makes at its entry, all at once, before
        #: the first op (``TrackedContext.hoist_casts``); a backend's own entries
        self.hoistable = hoistable
        #: the step of the typed call's first read of a varying value (``SpmdContext.values_read``),
        #: or None: a replay notes the read at that step (its steps are not typed), where a rank
        #: that types the call notes it, so that their collectives match (design: docs/uneven.md)
        self.first_read = first_read
        # for tests and diagnostics: calls replayed whole, and calls whose ops differed
        self.replays = 0
        self.divergences = 0

    def count(self, replayed: int, diverged: bool) -> None:
        """Count a call replayed from this plan, which applied ``replayed`` steps (a call that
        stopped short differed too)."""
        if diverged or replayed != len(self.steps):
            self.divergences += 1
        else:
            self.replays += 1


def outside_key(a: Tensor) -> tuple:
    """The key of a tensor no op of the call numbered: from outside the call, invariant."""
    return (a.shape, a.dtype)


def guard_key(token: object, args: Any, kwargs: dict | None, outside=outside_key) -> tuple:
    """What a step's typing depends on besides the op: see the module docstring. Each argument's
    key (:func:`_key_of`), the keyword arguments' after the positional ones and then their names.
    ``outside`` keys a tensor the call did not number (a backend where such a tensor may vary
    passes its own)."""
    values = (*args, *kwargs.values()) if kwargs else args
    key = [_key_of(token, a, outside) for a in values]
    if kwargs:
        key.append(tuple(kwargs))
    return tuple(key)


def _key_of(token: object, a: Any, outside) -> Any:
    """One argument's key in :func:`guard_key`; a list or tuple keyed with its type and its
    items' keys."""
    if isinstance(a, Tensor):
        src = a.__dict__.get(SRC)
        return src[1] if src is not None and src[0] is token else outside(a)
    if type(a) in _AS_THEMSELVES or a is None:
        return a
    if type(a) is slice:  # (its == compares a tensor bound by value; its type decides, too)
        return (slice, guard_key(token, (a.start, a.stop, a.step), None, outside))
    if isinstance(a, (list, tuple)):  # (a torch.return_types tuple too)
        return (type(a), guard_key(token, a, None, outside))
    # with its type: ``1 == 1.0 == True``, yet ``torch.full((), 1)`` is an integer tensor and
    # ``torch.full((), 1.0)`` a float one (a cast to it of a partial sum is an error, 2.2)
    return (type(a), a)


def matches(token: object, key: tuple, args: Any, kwargs: dict | None, outside=outside_key) -> bool:
    """Whether ``guard_key(token, args, kwargs, outside) == key`` (a step's recorded key), the
    key not built: each argument compared with its item as a tuple's ``==`` would (identity
    first), the first that differs ending it. (This runs for every op of a replay.)"""
    if kwargs:
        values = (*args, *kwargs.values())
        if len(key) != len(values) + 1 or not _equal(key[-1], tuple(kwargs)):
            return False
    elif len(key) != len(args):
        return False
    else:
        values = args
    for a, k in zip(values, key):
        if a is k:  # (keyed as itself: an int, a dtype, None)
            continue
        if isinstance(a, Tensor):
            src = a.__dict__.get(SRC)
            if src is not None and src[0] is token:  # (its key, :func:`_key_of`: src[1])
                item = src[1]  # a number (interned), or (number, type, shape): compared in C
                if item is k or (type(k) is tuple and type(item) is tuple and k == item):
                    continue
                if _equal(k, item):
                    continue
                return False
        elif isinstance(a, (list, tuple)) and type(k) is tuple and len(k) == 2 and k[0] is type(a):
            if matches(token, k[1], a, None, outside):  # (its key (type(a), guard_key(a)))
                continue
            return False
        if not _equal(k, _key_of(token, a, outside)):
            return False
    return True


def _numbered_alike(token: object, key: tuple, args: Any, kwargs: dict | None) -> bool:
    """:func:`matches` in its usual cases, decided without its calls: each argument (keyword
    arguments after the positional ones, their names last, as :func:`guard_key` keys them) a
    tensor this call numbered as the step's (numbers and types are interned: identity is
    equality), an int or a str equal to its key, a tuple of ints equal to its key's items (a
    shape: ``F.layer_norm``'s ``normalized_shape``), or the very object its key holds (the
    constant on the user's line, ``x * 0.5``, or a keyword's default, ``eps=1e-5``: its key
    ``(float, 0.5)`` holds the typed call's object, which a later call passes again). False
    only means "not decided here" (:func:`matches` decides)."""
    if kwargs:
        if len(key) != len(args) + len(kwargs) + 1 or key[-1] != tuple(kwargs):
            return False
        values = (*args, *kwargs.values())
    elif len(key) != len(args):
        return False
    else:
        values = args
    for a, k in zip(values, key):
        if a is k:
            continue
        if isinstance(a, Tensor):
            src = a.__dict__.get(SRC)
            if src is None or src[0] is not token:
                return False
            item = src[1]  # (an input's or a collective's: (number, type, shape), the first two
            # interned)
            if item is not k and not (
                type(item) is tuple
                and type(k) is tuple
                and item[0] is k[0]
                and item[1] is k[1]
                and item[2] == k[2]
            ):
                return False
        elif type(a) is int or type(a) is str:  # (keyed as themselves; no other type's key)
            if type(k) is not type(a) or a != k:
                return False
        elif type(a) is tuple:  # keyed (tuple, its items' keys): an int's is itself
            if type(k) is not tuple or len(k) != 2 or k[0] is not tuple:
                return False
            for v in a:  # (ints first: == on a tensor is not a bool)
                if type(v) is not int:
                    return False
            if k[1] != a:
                return False
        elif type(k) is not tuple or len(k) != 2 or k[1] is not a or k[0] is not type(a):
            return False
    return True


def _equal(recorded: Any, item: Any) -> bool:
    """``recorded == item`` as a tuple's ``==`` compares items (identity first)."""
    if recorded is item:
        return True
    try:
        return bool(recorded == item)
    except Exception:  # an argument whose == is not a bool (an array): not the same
        return False


#: arguments keyed as themselves: none equals a value of another kind that a step would type
#: otherwise (a float or a bool, equal to the int of its value, is keyed with its type)
_AS_THEMSELVES = frozenset({int, str, torch.Size, torch.dtype, torch.device, torch.layout})


class PlanningMode(VmaMode):
    """The typed call of a signature, which writes each op's decisions down (:class:`Step`)."""

    hooks_seen = False
    first_read: int | None = None

    def __init__(self, ctx: TrackedContext) -> None:
        super().__init__(ctx)
        self.steps: list[Step] = []
        self.replayable = True
        self._casts: list = []
        ctx.recipes = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.hooks_seen and torch_private.saved_tensors_hooks_active():
            self.hooks_seen = True
        if func in NOT_OPS or torch_private.transforms_active():
            self.replayable = False  # differentiation inside the call: typed every call
        if not self.replayable or self.ctx.in_collective:
            return super().__torch_function__(func, types, args, kwargs)
        token = self.token
        key = guard_key(token, args, kwargs)
        self._casts = []
        out = super().__torch_function__(func, types, args, kwargs)
        results = result_tensors(out)
        outputs = tuple((_held(o, _ATTR, token), _held(o, _BLOCKS, token)) for o in results)
        casts = tuple(self._casts)
        shapes = result_shapes(func, results)
        self.steps.append(Step(func, key, casts, outputs, shapes, _places(args, kwargs, casts)))
        for o in results:
            self.ctx.number(o)
        self.ctx.note_handed_back(out, args, kwargs)  # (maybe the caller's: ``Call.unstamp``)
        return out

    def _vary_below(self, args, kwargs, common):
        varied = super()._vary_below(args, kwargs, common)
        self._note_casts((args, kwargs), varied)
        return varied

    def _vary_operands(self, operands, vmas, union, args, kwargs):
        varied = super()._vary_operands(operands, vmas, union, args, kwargs)
        self._note_casts((args, kwargs), varied)
        return varied

    def _note_casts(self, given, varied) -> None:
        if varied is given or not self.replayable:
            return
        recipes = self.ctx.recipes or {}
        for i, (t, alias) in enumerate(zip(tensor_operands(*given), tensor_operands(*varied))):
            if alias is t:
                continue
            recipe: list = []
            while alias is not t:
                made = recipes.get(id(alias))
                if made is None:  # an alias this plan cannot make again
                    self.replayable = False
                    return
                alias, cast = made
                recipe.append(cast)
            self._casts.append((i, tuple(reversed(recipe))))

    def plan(self) -> Plan | None:
        """The call's plan; None where it cannot be replayed (differentiation or a transform
        inside it, a non-reentrant checkpoint, an implicit cast not made by the call's
        caches, or the function read a type)."""
        ctx = self.ctx
        if not self.replayable or self.hooks_seen or ctx.types_read or ctx.transform_results:
            return None
        return Plan(self.steps, ctx.planned_hoistable(), self.first_read)

    def _note_values(self, func, args, kwargs) -> None:
        super()._note_values(func, args, kwargs)
        if self.first_read is None and self.ctx.values_read:
            self.first_read = len(self.steps)  # (this op's step, written down after it runs)


def result_shapes(func: Any, results: tuple) -> tuple | None:
    """:attr:`Step.shapes` of op ``func``'s ``results``."""
    return None if func in SHAPES_FROM_SHAPES else tuple(o.shape for o in results)


def shaped_alike(results: Any, shapes: tuple | None) -> bool:
    """Whether an op's tensor ``results`` are as many as a step's and of its ``shapes``."""
    if shapes is None:
        return True
    return len(results) == len(shapes) and all(o.shape == s for o, s in zip(results, shapes))


def _places(args: Any, kwargs: dict | None, casts: tuple) -> tuple | None:
    """:attr:`Step.places` of an op called with ``args`` and ``kwargs``. (A replay's key,
    matched, has its tensors at the same places: no tensor's key equals another argument's.)"""
    if not casts:
        return None
    kwargs = kwargs or {}
    for a in (*args, *kwargs.values()):
        if isinstance(a, (list, tuple)) and any(isinstance(b, Tensor) for b in a):
            return None  # (operands in a list: ``tensor_operands``)
    places = [at for at, a in enumerate(args) if isinstance(a, Tensor)]
    places += [name for name, a in kwargs.items() if isinstance(a, Tensor)]
    return tuple(places[i] for i, _ in casts)


def _held(t: Tensor, attr: str, token: object) -> Any:
    rec = t.__dict__.get(attr)
    return rec[1] if rec is not None and rec[0] is token else None


class ReplayMode(VmaMode):
    """A call replayed from a :class:`Plan`; typed from the first op its steps do not match."""

    def __init__(self, ctx: TrackedContext, plan: Plan) -> None:
        super().__init__(ctx)
        self.steps = plan.steps
        self.first_read = plan.first_read
        self.i = 0
        self.diverged = False
        self.stamps = ctx.stamp_table  # id(type) -> the call's stamp (``stamp_of``'s)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        # (the guard's usual case, the result's stamp and number inlined: this runs for every
        # op of a replay, where a Python frame costs about what the rest of it does)
        ctx = self.ctx
        if ctx.deferred and not ctx.in_collective and reads_any(ctx.deferred, args, kwargs):
            ctx.make_deferred()
        if not self.diverged and not ctx.in_collective:
            i = self.i
            if i < len(self.steps):
                step = self.steps[i]
                # (a property's getter is a new method-wrapper at each access: equal, not same)
                if (step.func is func or step.func == func) and (
                    _numbered_alike(self.token, step.key, args, kwargs)
                    or matches(self.token, step.key, args, kwargs)
                ):
                    if i == self.first_read:  # the read, where typing notes it
                        ctx.values_read = True
                    self.i = i + 1
                    called = args, kwargs
                    if step.casts:
                        args, kwargs = self._casts(step, args, kwargs)
                    out = func(*args, **kwargs) if kwargs else func(*args)
                    if type(out) is not Tensor:  # (also a Parameter an op hands back)
                        results = result_tensors(out)
                        if not shaped_alike(results, step.shapes):
                            return self._typed_again(func, types, *called)
                        for o, given in zip(results, step.outputs):
                            self._give(o, given)
                    else:  # the usual result: one tensor
                        if step.shapes is not None and step.shapes != (out.shape,):
                            return self._typed_again(func, types, *called)
                        self._give(out, step.outputs[0])
                        if not kwargs and (not args or out is not args[0]):
                            return out  # (``note_handed_back``'s usual case: a new tensor)
                    ctx.note_handed_back(out, args, kwargs)  # (``Call.unstamp``)
                    return out
            self.diverged = True  # typed from here on: every tensor so far is typed
        return super().__torch_function__(func, types, args, kwargs)

    def _typed_again(self, func, types, args, kwargs):
        """An op whose results differ from its step's (module doc): run again, typed, and the
        call typed from it on."""
        self.diverged = True
        return super().__torch_function__(func, types, args, kwargs)

    def _casts(self, step: Step, args: Any, kwargs: Any) -> tuple[Any, Any]:
        """``args`` and ``kwargs`` with the step's implicit casts of their operands made."""
        if step.places is not None:  # each cast's operand at a known place
            args, kwargs = list(args), dict(kwargs) if kwargs else kwargs
            for (_, recipe), at in zip(step.casts, step.places):
                if type(at) is int:
                    args[at] = self._cast(args[at], recipe)
                else:
                    kwargs[at] = self._cast(kwargs[at], recipe)
            return args, kwargs
        operands = tensor_operands(args, kwargs)
        swap = {}
        for i, recipe in step.casts:
            t = operands[i]
            swap[id(t)] = self._cast(t, recipe)  # (never under Dynamo: not planned)
        return swap_operands(args, kwargs, swap)

    def _cast(self, t: Tensor, recipe: tuple) -> Tensor:
        """``t`` with a step's implicit casts of it applied (the call's caches: one alias per
        tensor, axes and state, as typing made)."""
        for kind, axes, *to in recipe:
            if kind == "pvary":
                t = self.ctx.cached_pvary(t, axes)
            else:
                t = self.ctx.cached_cast(t, axes, to[0])
        return t

    def _give(self, o: Tensor, given: tuple) -> None:
        """What typing gave result ``o`` (``given``: its :attr:`Step.outputs` entry): its stamp,
        its blocks record, the call's next number (``TrackedContext.stamp_of`` and ``number``,
        inlined: this runs for every result)."""
        vma, lay = given
        ctx, d = self.ctx, o.__dict__
        if vma is not None:
            stamp = self.stamps.get(id(vma))  # (types are interned: identity is equality)
            d[_ATTR] = stamp if stamp is not None else ctx.stamp_of(vma)
        if lay is not None:
            d[_BLOCKS] = (self.token, lay)
        elif _BLOCKS in d:
            del d[_BLOCKS]
        n = ctx.numbered
        d[SRC] = (self.token, _NUMBERS[n] if n < len(_NUMBERS) else _number(n))
        ctx.numbered = n + 1
