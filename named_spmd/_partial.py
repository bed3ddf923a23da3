"""The algebra of unreduced (U) and reduced (R) values: which torch ops keep a partial sum a
partial sum, and which are errors (docs/design.md section 2.2).

A value unreduced over axis A is held as one partial sum per instance; the true value is their
sum. An op on it is right only if it is *linear* in that value: the sum of the op's results is
then the op of the sum. So U+U, U-U, -U, U*scalar, U*R, U@R, R@U, sums, views, slicing, cat,
stack, ``where(c, U, U)`` with an invariant condition and ``u[i] = U`` stay U; U+I (the bias
added before the psum: counted once per instance), ``u[i] = I``, U*I (the invariant factor's
gradient would be a partial sum), U*U, U@U, casts to integer or bool dtypes and every nonlinear
op are errors. Reduced values are ordinary values whose gradient is left as a partial sum: they
mix with anything, an invariant operand beside them is cast to reduced (its gradient summed
once), a varying one wins.

:func:`combine` is the one rule, used per op by the tracked backends' ``VmaMode`` and by the
simulated backend's ``PartialMode``; it is reached only when some operand has U or R axes, so
programs without them pay one flag test per op.
"""

from __future__ import annotations

import functools
import os
import traceback
from collections.abc import Sequence
from numbers import Number
from typing import Any

import torch

from . import _torch_private as torch_private
from ._errors import NOT_USER_DIRS, VmaError
from ._operands import READS_VALUES, is_inplace, result_tensors, value_operands_read
from ._types import Vma, shape_shown, type_text

# Ops whose result is linear in their first tensor operand alone (views, slicing, reductions
# over tensor dims, casts); further tensor operands are indices or shapes, which must not vary
# over or be unreduced over the value's U axes.
_LINEAR_UNARY = frozenset(
    "neg neg_ negative negative_ __neg__ positive __pos__ zero_ clone contiguous detach detach_ view view_as reshape "
    "reshape_as flatten unflatten squeeze unsqueeze transpose t T mT H mH permute movedim "
    "moveaxis swapaxes swapdims narrow select __getitem__ expand expand_as broadcast_to repeat "
    "tile split chunk unbind tensor_split sum mean cumsum diagonal diag trace flip roll real "
    "imag conj to type type_as float double half bfloat16 cpu cuda unfold triu tril index_select "
    "gather take_along_dim as_strided __len__ size dim numel".split()
)
# Unary ops whose further tensor operand gives only a shape or a dtype (``x.view_as(y)``,
# ``x.to(y)``): it contributes no values, so the result has the first operand's type alone.
SHAPE_ONLY = frozenset(
    getattr(torch.Tensor, name) for name in "view_as reshape_as expand_as type_as to".split()
)
# Sums of their tensor operands: every operand must be unreduced over the same axes (a Python
# 0 is fine: ``sum(parts)`` starts from it).
_ADDITIVE = frozenset(
    "add __add__ __radd__ add_ __iadd__ sub __sub__ __rsub__ sub_ __isub__ cat concat "
    "concatenate stack hstack vstack".split()
)
# Additive ops that join their operands (a positional int is the dim, not an added constant).
_JOINS = frozenset("cat concat concatenate stack hstack vstack".split())
# Writes of a value into the first operand (``u[i] = v``, ``u.fill_(v)``, ``u.copy_(v)``):
# errors are raised, not made lazily (``__setitem__`` returns None, which would drop them).
_WRITES = frozenset({"__setitem__", "fill_", "copy_"})
# Products: linear in each operand, so exactly one operand may be unreduced over an axis, every
# other tensor operand must be reduced over it (Python scalars are fine).
_PRODUCT = frozenset(
    "mul __mul__ __rmul__ mul_ __imul__ multiply matmul __matmul__ __rmatmul__ mm bmm einsum "
    "tensordot outer dot vdot inner kron".split()
)
# ``u.masked_fill(mask, v)``: ``where(mask, v, u)``, a select (``u[mask] = 0`` on a simulated mesh).
_MASKED_FILLS = frozenset({"masked_fill", "masked_fill_"})
# Division: linear in the numerator only.
_DIVISION = frozenset("div __truediv__ div_ __itruediv__ true_divide divide".split())


def op_name(func: Any) -> str:
    name = getattr(func, "__name__", "") or ""
    if name == "__get__":  # a property (x.T, x.mT): the descriptor's name
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _kind(name: str, operands: Sequence[Any], kwargs: dict | None) -> str:
    if name in _LINEAR_UNARY:
        return "unary"
    if name in _ADDITIVE:
        return "additive"
    if name in _PRODUCT or (name in _DIVISION and not _rounds(kwargs)):
        return "product"
    if name == "linear":
        return "linear"
    if name in _WRITES:
        return "write"
    if (name == "where" and len(operands) > 1) or name in _MASKED_FILLS:
        return "select"
    return "other"


def typed_call(
    ctx: Any, func: Any, args: tuple, kwargs: dict | None, operands: list, vmas: list[Vma]
) -> tuple[Any, Vma]:
    """``func(*args, **kwargs)`` and its type, for tensor operands ``operands`` of types ``vmas``
    (at least one with U or R axes); a :class:`VmaError` where the op may not take them. An op
    not known to be linear is run first: only a tensor result is an error (``x.shape``,
    ``x.dtype``, ``x.size()`` of an unreduced value are fine)."""
    vma = combine(ctx, func, args, kwargs, operands, vmas)
    out = func(*args, **(kwargs or {}))
    if not isinstance(vma, Vma) and has_tensor(out):
        raise vma()
    check_cast(ctx, func, operands, vmas, vma, out)
    return out, vma


def _refuse_reads(ctx: Any, func: Any, args: tuple, kwargs: dict | None, operands, vmas) -> None:
    """A :class:`VmaError` where op ``func`` reads on the host (``.item()``, ``bool()``,
    ``torch.equal``, a size or a mask) the values of a partial sum: each instance would read
    its own part, not the value."""
    for t in value_operands_read(func, args, kwargs):
        at = _position(t, operands)
        if at is not None and vmas[at].unreduced:
            axis = min(vmas[at].unreduced, key=_order(ctx))
            problem = (
                "it reads the partial sum's values on the host, where each instance holds its "
                "part, not the value"
            )
            raise _error(ctx, op_name(func), axis, problem, operands, vmas)


def check_cast(ctx: Any, func: Any, operands: list, vmas: list[Vma], vma: Any, out: Any) -> None:
    """A :class:`VmaError` where a result typed unreduced (``vma``) was cast to a dtype that is
    not linear: to bool, or from a floating (or complex) operand to an integer dtype, each
    instance's part is rounded before the sum (``u.to(torch.int32)``, ``u.sum(0,
    dtype=torch.int64)``, ``u.type_as(i)``). Read off the result, so every spelling of the
    cast is seen."""
    if not isinstance(vma, Vma) or not vma.unreduced:
        return
    for o in result_tensors(out):
        if op_name(func) == "view" and operands and o.dtype != operands[0].dtype:
            axis = min(vma.unreduced, key=_order(ctx))
            problem = (
                f"it views the partial sum's bits as {o.dtype}, which reads each instance's "
                "part as other numbers (a bit cast is not linear)"
            )
            raise _error(ctx, "view", axis, problem, operands, vmas)
        if o.dtype.is_floating_point or o.dtype.is_complex:
            continue
        inexact = any(t.dtype.is_floating_point or t.dtype.is_complex for t in operands)
        if o.dtype == torch.bool or inexact:
            axis = min(vma.unreduced, key=_order(ctx))
            does = "tests" if o.dtype == torch.bool else "rounds"
            problem = (
                f"it casts the partial sum to {o.dtype}, which {does} each instance's part "
                "before the sum (a cast to a non-floating dtype is not linear)"
            )
            raise _error(ctx, op_name(func), axis, problem, operands, vmas)


def has_tensor(out: Any) -> bool:
    """Whether an op's result holds a tensor (``x.shape``, ``x.dtype`` hold none)."""
    return bool(result_tensors(out))


def combine(
    ctx: Any, func: Any, args: tuple, kwargs: dict | None, operands: list, vmas: list[Vma]
) -> Any:
    """The type of ``func(*args, **kwargs)`` whose tensor operands ``operands`` have types
    ``vmas`` (at least one with U or R axes); raises a :class:`VmaError` naming the op, the
    user's line, the axis and the fix, or, for an op not known to be linear, returns a function
    that makes that error (raised only if the op returns a tensor: ``x.shape`` is fine)."""
    if func in READS_VALUES:
        _refuse_reads(ctx, func, args, kwargs, operands, vmas)
    if torch_private.memo_would_be_guarded():
        return _combine(ctx, func, args, kwargs, operands, vmas)
    # memo of the accepted ops: what decides is the op, the operands' types, which operand is
    # first, and whether a non-zero constant or a bias is added (a hot path: most programs
    # repeat a few ops on a few types)
    if kwargs and _rounds(kwargs):  # (the key does not hold the rounding mode)
        return _combine(ctx, func, args, kwargs, operands, vmas)
    key = (func, _first_operand(args, kwargs, operands), _nonzero_scalar(args, kwargs), *vmas)
    hit = _ACCEPTED.get(key)
    if hit is not None:
        return hit
    result = _combine(ctx, func, args, kwargs, operands, vmas)
    # not memoized: linear's bias and a write's value are operands the key cannot tell apart
    if isinstance(result, Vma) and op_name(func) not in _UNKEYED:
        if len(_ACCEPTED) > 4096:
            _ACCEPTED.clear()
        _ACCEPTED[key] = result
    return result


_ACCEPTED: dict[tuple, Vma] = {}
_UNKEYED = frozenset({"linear"}) | _WRITES


def _combine(
    ctx: Any, func: Any, args: tuple, kwargs: dict | None, operands: list, vmas: list[Vma]
) -> Any:
    name = op_name(func)
    operands, vmas = value_operands(func, args, kwargs, operands, vmas)
    union = vmas[0]
    for v in vmas[1:]:
        union = union.union(v)
    unreduced = frozenset().union(*(v.unreduced for v in vmas))
    if not unreduced:
        return union  # reduced values mix like invariant ones; varying wins
    kind = _kind(name, operands, kwargs)
    into = _written(func, name, args, kwargs, operands)
    for axis in sorted(unreduced, key=_order(ctx)):
        problem = _problem(kind, name, axis, args, kwargs, operands, vmas)
        if problem is None and into is not None:
            problem = _into_problem(kwargs, vmas[into].state(axis), axis)
        if problem is not None:
            if kind == "other":  # the message (with the user's line) is built if raised
                return functools.partial(_error, ctx, name, axis, problem, operands, vmas)
            raise _error(ctx, name, axis, problem, operands, vmas)
    return union


def value_operands(
    func: Any, args: tuple, kwargs: dict | None, operands: list, vmas: list[Vma]
) -> tuple[list, list[Vma]]:
    """The operands whose values the op's result holds, and their types: all, but for
    ``x.view_as(y)``, ``x.expand_as(y)``, ``x.to(y)``, ... whose ``y`` gives only a shape or a
    dtype (the result then has ``x``'s type, and ``y`` gets no gradient nor cast)."""
    if len(operands) > 1 and func in SHAPE_ONLY:
        first = _first_operand(args, kwargs, operands)
        if first is not None:
            return [operands[first]], [vmas[first]]
    return operands, vmas


def _written(func: Any, name: str, args: tuple, kwargs: dict | None, operands: list) -> int | None:
    """The operand an op writes its result into: ``out=`` (``u.cumsum(0, out=buf)``), or the
    first in place (``r.mul_(u)``; ``__setitem__`` has its own rule); None for other ops."""
    out = (kwargs or {}).get("out")
    if out is not None:
        return _position(out, operands)
    if name not in _WRITES and is_inplace(func):
        return _first_operand(args, kwargs, operands)
    return None


def _into_problem(kwargs: dict | None, state: str, axis: str) -> str | None:
    """What is wrong with writing a partial sum over ``axis`` into a tensor ``state`` there."""
    if state == "unreduced":
        return None
    where = "out=" if kwargs and "out" in kwargs else "its operand (in place)"
    return (
        f"it writes the result into {where}, a tensor {state} over {axis!r}, which would then "
        "hold one instance's part where the whole value belongs"
    )


def _order(ctx: Any):
    names = ctx.mesh.axis_names
    return lambda a: names.index(a) if a in names else len(names)


def _problem(kind, name, axis, args, kwargs, operands, vmas) -> str | None:
    states = [v.state(axis) for v in vmas]
    first = _first_operand(args, kwargs, operands)
    if kind == "unary":
        if first is None or states[first] != "unreduced":
            return "it is unreduced in an operand the op does not act on linearly"
        others = [s for i, s in enumerate(states) if i != first and s in ("unreduced", "varying")]
        return f"its index operand is {others[0]} there" if others else None
    if kind == "additive":
        if any(s != "unreduced" for s in states):
            other = next(s for s in states if s != "unreduced")
            if name in _JOINS:
                return (
                    f"it joins a value {other} over {axis!r} to a partial sum: the total would "
                    "count that part once per instance"
                )
            return (
                f"it adds a value {other} over {axis!r} to a partial sum: each instance "
                "would add it to its part, so the total would count it once per instance"
            )
        if name not in _JOINS and _nonzero_scalar(args, kwargs):  # cat's int is its dim
            return "it adds a constant to a partial sum, which the total counts once per instance"
        return None
    if kind == "write":
        return _write_problem(axis, name, args, kwargs, operands, states)
    if kind == "select":
        return _select_problem(axis, name, args, kwargs, operands, states)
    if kind == "product":
        if name in _DIVISION and first is not None and len(operands) > 1:
            if any(s == "unreduced" for i, s in enumerate(states) if i != first):
                return "it divides by a partial sum (the quotient of the sum is not the sum of quotients)"
        count = states.count("unreduced")
        if count > 1:
            return "it multiplies two partial sums (the product of sums is not the sum of products)"
        other = next((s for s in states if s not in ("unreduced", "reduced")), None)
        if other is not None:
            why = (
                "its gradient would be a partial sum"
                if other == "invariant"
                else "the instances' products would not sum to the product"
            )
            return f"it multiplies a partial sum by a value {other} over {axis!r} ({why})"
        return None
    if kind == "linear":
        bias = args[2] if len(args) > 2 else (kwargs or {}).get("bias")
        if isinstance(bias, torch.Tensor):
            return (
                "it adds the bias to the partial product: each instance adds it to its part, "
                "so the total counts it once per instance"
            )
        return _problem("product", "mul", axis, args[:2], None, operands[:2], vmas[:2])
    return (
        f"{name} is not linear (or not known to be), while a partial sum may only go through "
        "linear ops"
    )


def _write_problem(axis, name, args, kwargs, operands, states) -> str | None:
    """``target[index] = value`` (``target.fill_(value)``, ``target.copy_(value)``): linear where
    target and value are partial sums over ``axis`` (or the value is a Python zero, its own
    partial sum) at an index the instances share."""
    target = _position(args[0], operands)
    value = _written_value(name, args, kwargs)
    at = _position(value, operands)
    mine = states[target] if target is not None else "invariant"
    given = states[at] if at is not None else None
    if mine == "unreduced":
        if given is None and _nonzero(value):
            return (
                "it writes a constant into a partial sum, which the total counts once per instance"
            )
        if given is not None and given != "unreduced":
            return (
                f"it writes a value {given} over {axis!r} into a partial sum: each instance "
                "would write it into its part, so the total would count it once per instance"
            )
    elif given == "unreduced":
        return (
            f"it writes a partial sum into a tensor {mine} over {axis!r}, which would then hold "
            "one instance's part where the whole value belongs"
        )
    index = [s for i, s in enumerate(states) if i not in (target, at)]
    bad = next((s for s in index if s in ("unreduced", "varying")), None)
    return f"its index operand is {bad} there" if bad is not None else None


def _written_value(name: str, args: tuple, kwargs: dict | None) -> Any:
    """The value a write (``_WRITES``) puts into its first operand."""
    at = 2 if name == "__setitem__" else 1
    if len(args) > at:
        return args[at]
    return (kwargs or {}).get("value" if name == "fill_" else "other")


def _select_problem(axis, name, args, kwargs, operands, states) -> str | None:
    """``torch.where(cond, a, b)`` (``a.where(cond, b)``, ``b.masked_fill(cond, a)``): linear, as
    JAX's select_n, where both cases are partial sums over ``axis`` (or a Python zero) and the
    condition is one value on every instance (invariant or reduced: every instance picks the
    same entries)."""
    kwargs = kwargs or {}
    if name in _MASKED_FILLS:
        cond = args[1] if len(args) > 1 else kwargs.get("mask")
        cases = [args[0], args[2] if len(args) > 2 else kwargs.get("value")]
    elif not args:  # torch.where(condition=..., input=..., other=...)
        cond, cases = kwargs.get("condition"), [kwargs.get("input"), kwargs.get("other")]
    elif isinstance(args[0], torch.Tensor) and args[0].dtype == torch.bool and len(args) > 1:
        cond, cases = args[0], [*args[1:3], *(kwargs.get(k) for k in ("input", "other"))]
    else:  # the method: self.where(condition, other)
        cond, cases = args[1] if len(args) > 1 else kwargs.get("condition"), [args[0]]
        cases.append(args[2] if len(args) > 2 else kwargs.get("other"))
    picked = _position(cond, operands)
    if picked is not None and states[picked] not in ("invariant", "reduced"):
        return (
            f"its condition is {states[picked]} over {axis!r}: the instances would pick "
            "different entries of their parts, which do not sum to a pick of the total"
        )
    for case in cases:
        at = _position(case, operands)
        if at is None and _nonzero(case):
            return (
                "it selects a constant beside a partial sum, which the total counts once per "
                "instance"
            )
        if at is not None and states[at] != "unreduced":
            return (
                f"it selects between a partial sum and a value {states[at]} over {axis!r}: the "
                "total would count that value once per instance"
            )
    return None


def _position(x, operands) -> int | None:
    for i, t in enumerate(operands):
        if t is x:
            return i
    return None


def _nonzero(x) -> bool:
    return _number(x) and x != 0  # (True too: it adds 1)


def _number(x) -> bool:
    """A Python or numpy scalar: torch takes numpy's as numbers too (``u + np.int64(1)``)."""
    return isinstance(x, Number) or (type(x).__module__ == "numpy" and getattr(x, "ndim", 1) == 0)


def _rounds(kwargs: dict | None) -> bool:
    """Whether a division rounds its quotient (``rounding_mode=``): not linear, each instance's
    part would be rounded before the sum."""
    return kwargs is not None and kwargs.get("rounding_mode") is not None


def _first_operand(args, kwargs, operands) -> int | None:
    """The position among ``operands`` of the op's first argument (``input=`` where given by
    keyword: ``torch.div(input=r, other=u)`` divides by ``u`` as ``torch.div(r, u)`` does)."""
    head = args[0] if args else (kwargs or {}).get("input")
    if isinstance(head, (list, tuple)):
        head = head[0] if head else None
    for i, t in enumerate(operands):
        if t is head:
            return i
    return None


def _nonzero_scalar(args, kwargs) -> bool:
    """Whether a non-zero Python number is among the arguments (``torch.add(u, other=1)``
    included; an ``alpha=`` scales an operand, adding nothing)."""
    for a in args:
        if _nonzero(a):
            return True
    if kwargs:
        return any(_nonzero(v) for k, v in kwargs.items() if k != "alpha")
    return False


def _error(ctx, name, axis, problem, operands, vmas) -> VmaError:
    types = ", ".join(
        type_text(t.dtype, shape_shown(t), v, ctx.mesh.axis_names) for t, v in zip(operands, vmas)
    )
    return VmaError(
        f"{name} in {ctx.fn_label}{user_line()}: an operand is unreduced over {axis!r} (each "
        f"instance holds a partial sum; operand types: {types}), and {problem}.\n"
        f"  Fix: reduce it first, e.g. y = ns.psum(y, {axis!r}) (or ns.psum_scatter), then apply "
        f"{name}; or, if each instance's partial value really is meant as a local value, "
        f"ns.pcast(y, {axis!r}, to='varying')."
    )


def user_line() -> str:
    """`` at file:line (code)`` of the innermost frame outside named_spmd, torch and the standard
    library: the user's line that ran the op."""
    if torch.compiler.is_compiling():  # the frames Dynamo traces are not on the real stack
        return _traced_user_line()
    return line_of(traceback.extract_stack())


@torch_private.trace_constant  # run eagerly at trace time: it reads Dynamo's stack
def _traced_user_line() -> str:
    """``user_line`` while torch.compile traces, from Dynamo's stack of the user's frames."""
    return line_of(torch_private.traced_user_stack())


def line_of(stack: Sequence[traceback.FrameSummary]) -> str:
    """:func:`user_line` of ``stack``."""
    for frame in reversed(stack):
        if not frame.filename.startswith(NOT_USER_DIRS):
            code = (frame.line or "").strip()
            return f" at {os.path.basename(frame.filename)}:{frame.lineno} ({code})"
    return ""
