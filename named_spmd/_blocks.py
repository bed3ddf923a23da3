"""Which tensor dims hold blocks of which mesh axes: the inference of unreduced values from the
specs (docs/design.md section 2.3, "Inference from the specs").

An input split by ``P("dp", "tp")`` holds, on each instance, one block of a global tensor: its dim
0 holds blocks of ``dp``, its dim 1 blocks of ``tp``. Summing the local block over a dim holding
blocks of A gives one partial sum of the global sum per instance: the value is *unreduced* over A.
That is what a row-parallel matmul computes (``h[b, f/tp] @ w2[f/tp, d]``), and what a loss
summed over a vocabulary-parallel dim computes; adding a bias to it, or applying a nonlinear op,
before the ``psum`` is the bug the partial-sum algebra (``_partial``) then catches.

The record of a tensor is a :class:`Layout`: per dim, the axes whose blocks it holds, and the axes
over which the value varies for some other reason (``opaque``: a collective's result, an op whose
effect on dims is not known here, a slice of a block). A contraction (a sum, a matmul, a linear,
an einsum) over dims holding blocks of A on every contracted operand makes the result unreduced
over A only if A is opaque in no operand and no dim of the result still holds blocks of A (ring
attention's ``p @ v`` keeps its query dim split over the ring: it stays varying). Every op not
known here drops the record: its result is opaque over every axis it varies over, as a tensor
without a record is. So the inference is silent unless it can see the contraction; it never
guesses.

Records are ``(call token, Layout)``, an attribute of the tensor, set on the inputs (``mark``) and
on each op's results by :func:`after_op`, which both the tracked backends' ``VmaMode`` and the
simulated backend's ``PartialMode`` call for ops with a recorded operand. The rules themselves,
one per family of ops, are ``_block_rules``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import _torch_private as torch_private
from ._block_rules import NONE, PLAIN, RULES, WITH_BIAS, Layout, Rule, bias
from ._block_rules.shapes import _elementwise
from ._calls import BLOCKS_ATTR
from ._errors import VmaError
from ._partial import op_name, user_line
from ._torch_private import DisableTorchFunction
from ._types import Vma, shape_shown, type_text

ATTR = BLOCKS_ATTR


def mark(x: torch.Tensor, spec: Any, token: object) -> bool:
    """Record the blocks an input under ``spec`` holds (nothing if the spec splits no dim);
    whether it holds any."""
    lay = input_layout(spec, x.dim())
    if lay is not None:
        _write(x, (token, lay))
        return True
    return False


def holds_blocks(spec: Any, ndim: int) -> bool:
    """Whether an input of ``ndim`` dims under ``spec`` holds blocks (:func:`mark` records it)."""
    return input_layout(spec, ndim) is not None


def input_layout(spec: Any, ndim: int) -> Layout | None:
    """The blocks an input of ``ndim`` dims under ``spec`` holds, or None if it holds none:
    one layout per (spec, ndim), kept on the spec (layouts are immutable), as every call marks
    every input leaf."""
    if torch_private.memo_would_be_guarded():
        return _make_input_layout(spec, ndim)
    memo = spec.__dict__.setdefault("_input_layouts", {})
    if ndim not in memo:
        memo[ndim] = _make_input_layout(spec, ndim)
    return memo[ndim]


def _make_input_layout(spec: Any, ndim: int) -> Layout | None:
    dims = tuple(frozenset(spec.entry_axes(i)) for i in range(ndim))
    return Layout(dims, NONE) if any(dims) else None


def unreduced_over(vma: Vma, axes: frozenset[str]) -> Vma:
    """``vma`` made unreduced over those of ``axes`` it varies over (what :func:`after_op`
    returned for the op whose result has type ``vma``)."""
    axes = axes & vma.varying
    return vma.to_state(axes, "unreduced") if axes else vma


def recorded(operands: Sequence[torch.Tensor], token: object) -> bool:
    """Whether some operand carries a record of this call."""
    for t in operands:
        rec = _read(t)
        if rec is not None and rec[0] is token:
            return True
    return False


def forget(x: Any) -> None:
    """Drop ``x``'s record (a collective's result: its blocks are not its operand's)."""
    if isinstance(x, torch.Tensor):
        _write(x, None)


def after_op(
    ctx: Any,
    token: object,
    func: Any,
    args: tuple,
    kwargs: dict | None,
    operands: list[torch.Tensor],
    out: Any,
    vma_of: Callable[[torch.Tensor], Vma],
) -> frozenset[str]:
    """Record the layouts of ``out`` (the result of ``func`` on ``args``) and return the axes over
    which the op's contraction makes it unreduced (usually none). Raises a :class:`VmaError`
    where a bias is added to a contraction that is unreduced (``F.linear``, ``addmm``)."""
    with DisableTorchFunction():  # shapes and dims read below are no ops of the program
        rule = _RULE_LIST[rule_index(func)]
        if rule is _elementwise and isinstance(out, torch.Tensor):
            rec = _elementwise_record(operands, out, token, vma_of)
            if rec is not None:  # the usual case, without the general rule's work
                _write(out, rec)
                return NONE

        def layouts(t: torch.Tensor) -> Layout:  # not a dict by id(): Dynamo guards on an id
            return _layout_of(t, token, vma_of)

        result = None
        if rule is not None:
            try:
                result = rule(args, kwargs or {}, layouts, out)
            except (TypeError, ValueError, IndexError, KeyError):
                result = None  # an argument form not understood here: no record
    outs = out if isinstance(out, (list, tuple)) else (out,)
    if result is None:
        for o in outs:
            forget(o)
        return NONE
    new, unreduced = result
    for o, lay in zip(outs, new if isinstance(new, list) else [new] * len(outs)):
        if isinstance(o, torch.Tensor):
            _record(o, token, lay)
    if unreduced:
        name = op_name(func)
        if name in WITH_BIAS and bias(name, args, kwargs or {}) is not None:
            vmas = [vma_of(t) for t in operands]
            raise _bias_error(ctx, name, sorted(unreduced), operands, vmas)
    return unreduced


def _elementwise_record(operands, out: torch.Tensor, token: object, vma_of) -> Any:
    """The record of an elementwise op's result where the operands holding blocks all hold the
    same layout at the result's shape and the others are plain (invariant, no record): that
    layout, as ``_elementwise`` finds it. None otherwise (the rule decides)."""
    found = None
    for t in operands:
        lay = _recorded_layout(t, token)
        if lay is not None:
            if t.shape != out.shape or (found is not None and lay is not found):
                return None
            found = lay
        else:
            vma = vma_of(t)
            if vma.varying or vma.unreduced:  # opaque over those axes: the rule's work
                return None
    return None if found is None else (token, found)


_RULE_LIST: tuple[Rule | None, ...] = (None, *RULES.values())
_RULE_INDEX = {name: i for i, name in enumerate(RULES, 1)}
_INDEX_OF: dict = {}  # func -> rule_index(func) (memo: every op of a call with blocks asks)


# run eagerly at trace time: Dynamo cannot trace ``str.endswith`` on an op's name, nor read the
# memo unguarded, and a traced lookup in a dict of 200 rules guards on every entry (checked on
# every compiled call), where an index into a tuple guards on the one
@torch_private.trace_constant
def rule_index(func: Any) -> int:
    """Where ``func``'s rule is in ``_RULE_LIST`` (0: none), by name: in-place ``add_`` is
    ``add``, ``__add__`` stays."""
    try:
        return _INDEX_OF[func]
    except KeyError:
        index = _INDEX_OF[func] = _index_by_name(func)
        return index
    except TypeError:  # an unhashable callable
        return _index_by_name(func)


def _index_by_name(func: Any) -> int:
    name = op_name(func)
    return _RULE_INDEX.get(name if name.endswith("__") else name.rstrip("_"), 0)


def recorded_layout(t: torch.Tensor, token: object) -> Layout | None:
    """``t``'s layout as recorded in the call of ``token``; None where it has none (what its
    dims hold is not known here)."""
    return _recorded_layout(t, token)


def _recorded_layout(t: torch.Tensor, token: object) -> Layout | None:
    """``t``'s layout as recorded in the call of ``token`` (None: no record of its rank)."""
    rec = _read(t)
    if rec is not None and rec[0] is token and len(rec[1].dims) == t.dim():
        return rec[1]
    return None


def _layout_of(t: torch.Tensor, token: object, vma_of) -> Layout:
    lay = _recorded_layout(t, token)
    if lay is not None:
        return lay
    n = t.dim()
    vma = vma_of(t)  # no record: whatever it varies over, it does for reasons not known here
    if torch_private.memo_would_be_guarded():
        return Layout((NONE,) * n, vma.varying | vma.unreduced)
    key = (n, vma)
    lay = _UNRECORDED.get(key)
    if lay is None:
        lay = _UNRECORDED[key] = Layout((NONE,) * n, vma.varying | vma.unreduced)
        if not lay.opaque:
            PLAIN.add(id(lay))
    return lay


# (ndim, type) -> the layout of a tensor without a record: one object each, so that the rules'
# fast path tells the plain ones (invariant: no blocks, nothing opaque) by identity
_UNRECORDED: dict[tuple[int, Vma], Layout] = {}


def _record(o: torch.Tensor, token: object, lay: Layout) -> None:
    if lay.opaque and any(d & lay.opaque for d in lay.dims):
        # an axis opaque somewhere is never inferred: drop it from the dims
        lay = Layout(tuple(d - lay.opaque for d in lay.dims), lay.opaque)
    _write(o, (token, lay))


# Records are read and written as attributes: Dynamo traces ``getattr`` and ``setattr`` on a
# tensor (not ``Tensor.__dict__``), and eagerly they cost what the ``__dict__`` lookup does.


def _read(t: torch.Tensor) -> Any:
    """``t``'s record, if any (None: none, or forgotten)."""
    return getattr(t, ATTR, None)


def _write(t: torch.Tensor, rec: Any) -> None:
    setattr(t, ATTR, rec)


def _bias_error(ctx, name, axes, operands, vmas) -> VmaError:
    types = ", ".join(
        type_text(t.dtype, shape_shown(t), v, ctx.mesh.axis_names) for t, v in zip(operands, vmas)
    )
    axis = axes[0] if len(axes) == 1 else tuple(axes)
    return VmaError(
        f"{name} in {ctx.fn_label}{user_line()}: its product contracts a dim split over "
        f"{axis!r} on both operands, so each instance computes a partial sum (unreduced over "
        f"{axis!r}; operand types: {types}), and it adds the bias to that partial sum: the total "
        "counts the bias once per instance.\n"
        f"  Fix: reduce the product first and add the bias after, e.g. "
        f"y = ns.psum(F.linear(x, w), {axis!r}) + b."
    )
