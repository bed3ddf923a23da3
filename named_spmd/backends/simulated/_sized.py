"""Ops whose result's size, or the selection they write through, depends on their operands'
values, on the simulated mesh's compile path (``_traced.py``): which calls may be
(:func:`may_be_sized_by_values`), and the error for one on a batched operand
(:func:`sized_by_values_refusal`): vmap's refusal as the eager call explains it, or the limit of a
traced vmap. Dynamo would otherwise fail on the op inside its tracer, naming none of the user's
code. ``x.data``, which vmap refuses whatever its size, takes the same path."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from ... import _torch_private as torch_private
from ..._context import SpmdContext
from ..._masked_fill import (
    IN_PLACE_PUTS,
    NOT_MASKED,
    SETITEM,
    WRITES_THROUGH_MASKS,
    write_arguments,
)
from . import BACKEND, fallback_warning_hidden


def sized_by_values_refusal(ctx: SpmdContext, func, args, kwargs) -> str | None:
    """The error for ``func``, whose result's size depends on its operands' values, where an
    operand is batched (:func:`_refusal_of`); None where none is, which Dynamo traces (a
    size known at run time), or where an argument is no trace-time constant. An operand is
    batched where it varies over a mesh axis as given (not after an implicit pvary, whose
    view vmap does not batch)."""
    tensors: list[tuple[torch.dtype, int, bool]] = []
    symbolic: list[object] = []

    def described(a):
        if isinstance(a, torch.Tensor):
            tensors.append((a.dtype, a.dim(), bool(ctx.vma(a))))
            return _Operand
        if isinstance(a, (tuple, list)):
            return type(a)([described(b) for b in a])
        if isinstance(a, dict):
            return {k: described(v) for k, v in a.items()}
        if isinstance(a, slice):
            return slice(described(a.start), described(a.stop), described(a.step))
        if not (a is None or a is Ellipsis or isinstance(a, _CONSTANT_ARGUMENTS)):
            symbolic.append(a)  # a SymInt, an object: the probe would not be a constant
        return a

    given = described(args), described(kwargs or {})
    if symbolic or not any(batched for _, _, batched in tensors):
        return None  # unbatched: Dynamo traces it as a size known at run time
    if _traced_in_place(ctx, func, args, kwargs):
        return None  # an invariant mask: vmap batches the write, and Dynamo traces it
    varies = _what_varies(ctx, func, args, kwargs)
    return _refusal_of(func, *given, tuple(tensors), varies, f"spmd_map of {ctx.fn_label}")


def _what_varies(ctx: SpmdContext, func, args, kwargs) -> str:
    """What the refusal calls the argument that varies: a write through a selection (``x[mask]
    = v``, ``index_put``) its operand, index or value, the first that varies (an out-of-place
    write of a varying value into an invariant operand: the value); any other op its operand."""
    written = write_arguments(func, args, kwargs) if func in WRITES_THROUGH_MASKS else None
    for role, a in zip(("an operand", "an index", "a value"), written or ()):
        if any(isinstance(t, torch.Tensor) and ctx.vma(t) for t in _flat(a)):
            return role
    return "an operand"


def _flat(a) -> list:
    """``a``'s leaves through tuples and lists (an index: tensors, slices, None)."""
    return [b for c in a for b in _flat(c)] if isinstance(a, (tuple, list)) else [a]


# torch functions whose result's size depends on their operands' values (their aten ops carry
# the ``dynamic_output_shape`` tag): vmap refuses to batch some of them, which the eager call
# explains; Dynamo instead fails on the op while tracing it, with a TorchRuntimeError naming
# none of the user's code. Those sized by their values only in some calls (``torch.where``,
# indexing, ``repeat_interleave``, ``one_hot``) are decided by :func:`may_be_sized_by_values`,
# as are the aten ops called directly (``torch.ops.aten.nonzero``), by torch's tag.
_SIZED_BY_VALUES = frozenset(
    {
        torch.nonzero,
        torch.Tensor.nonzero,
        torch.argwhere,
        torch.Tensor.argwhere,
        torch.masked_select,
        torch.Tensor.masked_select,
        torch.unique,
        torch.Tensor.unique,
        torch.unique_consecutive,
        torch.Tensor.unique_consecutive,
        torch.bincount,
        torch.Tensor.bincount,
    }
)


def _writes_each_position(func, args, kwargs) -> bool:
    """Whether ``func`` writes a value into each selected position: ``x[mask] = v``,
    ``index_put`` without ``accumulate`` (which adds each position's values: kept refused)."""
    if func is SETITEM:
        return True
    accumulate = args[3] if len(args) > 3 else (kwargs or {}).get("accumulate", False)
    return writes_through_masks(func) and not accumulate


def _traced_in_place(ctx: SpmdContext, func, args, kwargs) -> bool:
    """Whether Dynamo traces this write under vmap (``x[mask] = v``, ``index_put_``): in place,
    each position written, through masks invariant over the mesh."""
    masks = _masks(_index_of(args, kwargs))
    in_place = func is SETITEM or func in IN_PLACE_PUTS
    return in_place and _writes_each_position(func, args, kwargs) and not _vary(ctx, masks)


def index_put_as_setitem(ctx: SpmdContext, func, args, kwargs, op) -> Any:
    """``index_put`` (``_``, not accumulating) through masks invariant over the mesh as the
    ``x[indices] = values`` it equals, each op run by ``op(function, arguments)``: Dynamo traces
    that write under vmap, where it fails inside its tracer on ``index_put`` of a batched
    operand (torch 2.13 leaves the selection's size unbound). Out of place, where the values
    vary only where the operand does (its clone takes them in place). ``NOT_MASKED`` for other
    calls."""
    if func is SETITEM or not _writes_each_position(func, args, kwargs):
        return NOT_MASKED
    target, indices = args[0] if args else (kwargs or {}).get("input"), _index_of(args, kwargs)
    values = args[2] if len(args) > 2 else (kwargs or {}).get("values")
    if not (
        isinstance(target, torch.Tensor)
        and isinstance(values, torch.Tensor)
        and isinstance(indices, (tuple, list))
        and all(isinstance(i, torch.Tensor) for i in indices)
    ):
        return NOT_MASKED  # (a None of index_put's indices is a full slice, x[None] a new dim)
    if not _masks(indices) or _vary(ctx, _masks(indices)):
        return NOT_MASKED
    in_place = func in IN_PLACE_PUTS
    if not in_place and ctx.vma(values).varying - ctx.vma(target).varying:
        return NOT_MASKED
    if not in_place:
        target = op(torch.Tensor.clone, (target,))
    op(SETITEM, (target, tuple(indices), values))
    return target


def _vary(ctx: SpmdContext, tensors: list[torch.Tensor]) -> bool:
    return any(ctx.vma(t) for t in tensors)


@torch_private.trace_constant
def writes_through_masks(func) -> bool:
    """Whether ``func`` is a write through an index (``_masked_fill.WRITES_THROUGH_MASKS``)."""
    return func in WRITES_THROUGH_MASKS


# the arguments besides tensors a probe takes as they are: Dynamo holds them as constants
_CONSTANT_ARGUMENTS = (bool, int, float, str, torch.dtype, torch.device)


class _Operand:
    """Where a tensor stood in the arguments of a probed op (:func:`_refusal_of`)."""


def _index_of(args, kwargs):
    """The index of ``x[index]`` (``= v``), the indices of ``index_put``."""
    return args[1] if len(args) > 1 else (kwargs or {}).get("indices")


def _masks(index) -> list[torch.Tensor]:
    """The boolean tensors of an index (``x[index]``, index_put's indices)."""
    entries = index if isinstance(index, (tuple, list)) else (index,)
    return [t for t in entries if isinstance(t, torch.Tensor) and t.dtype == torch.bool]


def may_be_sized_by_values(func, args, kwargs) -> bool:
    """Whether ``func``'s result, or the selection it writes through, may have a size that
    depends on its operands' values."""
    form = _form(func)
    if form == "index":  # x[mask] (= v), aten.index(x, [mask])
        return bool(_masks(_index_of(args, kwargs)))
    if form == "where":  # where(condition), not where(condition, x, y)
        return len(args) + len(kwargs or {}) == 1
    if form == "one_hot":  # sized by the largest value where num_classes is not given
        return (args[1] if len(args) > 1 else (kwargs or {}).get("num_classes", -1)) == -1
    if form == "repeat_interleave":
        # sized by the repeats' values where they are a tensor (or the one-argument form's
        # operand) and no output_size is given; an int's repeats size it alone
        kwargs = kwargs or {}
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats", args[0] if args else None)
        return isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
    return form == "always"


# the functions sized by their values only in some calls, by the arguments that decide it; an
# aten op called directly (``torch.ops.aten.index``) as the torch function of its arguments
_FORMS: dict[object, str] = {
    torch.Tensor.__getitem__: "index",
    **dict.fromkeys(WRITES_THROUGH_MASKS, "index"),  # x[mask] = v, index_put
    torch.where: "where",
    # (torch tags no overload of aten::where dynamic_output_shape, though its one-argument
    # overload is nonzero's: the packet and that overload by name)
    torch.ops.aten.where: "where",
    torch.ops.aten.where.default: "where",
    F.one_hot: "one_hot",
    torch.repeat_interleave: "repeat_interleave",
    torch.Tensor.repeat_interleave: "repeat_interleave",
}
_ATEN_FORMS = {
    "aten::index": "index",
    "aten::one_hot": "one_hot",
    "aten::repeat_interleave": "repeat_interleave",
}


@torch_private.trace_constant
def _form(func) -> str | None:
    """How ``func``'s arguments decide whether its size depends on values (:data:`_FORMS`):
    "always" for the ops of :data:`_SIZED_BY_VALUES` and the aten ops torch tags
    ``dynamic_output_shape``, None for an op of a static size."""
    aten = torch_private.aten_op_sized_by_values(func)
    if aten is not None:
        return _ATEN_FORMS.get(aten, "always")
    return "always" if func in _SIZED_BY_VALUES or func in _REFUSED else _FORMS.get(func)


# what vmap refuses on a batched operand whatever its size: ``x.data`` (the eager call's error)
_REFUSED = frozenset({torch.Tensor.data.__get__})  # type: ignore[attr-defined]


@torch_private.trace_constant
def _refusal_of(func, args, kwargs, tensors, varies: str, where: str) -> str:
    """The error for ``func`` at ``where`` on batched operands (run eagerly at trace time).
    Where vmap refuses to batch it: the eager call's error, vmap's refusal probed on small
    tensors of the operands' dtypes and ranks (``tensors``: each one's dtype, rank and whether
    it is batched, in the order of the ``_Operand`` marks standing for them in ``args`` and
    ``kwargs``), as the backend explains it; else ours, naming the argument that ``varies``. Where vmap batches it (an invariant mask, an op it
    runs per instance): the eager call runs it, but Dynamo cannot trace a batched result of a
    size known only at run time (torch 2.13 fails inside its tracer)."""
    probes = [torch.ones([1] * rank, dtype=dtype) for dtype, rank, _ in tensors]
    in_dims = [0 if batched else None for _, _, batched in tensors]
    probes = [torch.stack([p, p]) if d == 0 else p for p, d in zip(probes, in_dims)]

    def probed(operands):
        given = iter(operands)
        return func(*_filled(args, given), **_filled(kwargs, given))

    try:
        # vmap's performance warning for its fallback, hidden without ``catch_warnings``
        with fallback_warning_hidden(), torch_private.DisableTorchFunction():
            torch.func.vmap(probed, in_dims=(in_dims,))(probes)
    except RuntimeError as error:
        explained = BACKEND.explain(error, where)
        if explained is not None:
            return str(explained)
    except Exception:  # noqa: S110 (the probe's own shapes refused: no refusal of vmap's known)
        pass
    name = _NAMES.get(func) or getattr(func, "__name__", func)
    writes = func in WRITES_THROUGH_MASKS
    what = "writes through a selection" if writes else "gives each instance a result"
    fixed = (
        "write through the whole tensor (torch.where(mask, v, x), masked_fill)"
        if writes
        else "give the result a fixed size (torch.nonzero_static, torch.where with a mask)"
    )
    return (
        f"{where}: `{name}` of {varies} that varies over the mesh {what} of a size known only "
        "from its values, which a compiled call on the simulated mesh cannot trace (every "
        "instance runs in one traced torch.func.vmap). The uncompiled call runs it. Fix: "
        f"compile without fullgraph=True (this call then runs uncompiled), or {fixed}."
    )


_NAMES = {torch.Tensor.__getitem__: "x[mask]", torch.Tensor.__setitem__: "x[mask] = v"}


def _filled(a, operands):
    """``a`` with each ``_Operand`` mark replaced by the next of ``operands``."""
    if a is _Operand:
        return next(operands)
    if isinstance(a, (tuple, list)):
        return type(a)([_filled(b, operands) for b in a])
    if isinstance(a, dict):
        return {k: _filled(v, operands) for k, v in a.items()}
    return a
