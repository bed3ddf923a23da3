"""An op's tensor operands, as the per-op typing sees them: found, swapped, classified.

Every mode that types torch ops (``_tracking.VmaMode``, the plans of ``_plan``, the simulated
backend's recording and diagnosis) reads an op's operands and decides whether it is an op at
all, and whether it writes into its first argument, the same way: here.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


def tensor_operands(args: Any, kwargs: dict | None) -> list[torch.Tensor]:
    """The tensors among an op's arguments (top level and one list/tuple level down)."""
    found: list[torch.Tensor] = []
    for a in (*args, *(kwargs or {}).values()):
        if isinstance(a, torch.Tensor):
            found.append(a)
        elif isinstance(a, (list, tuple)):
            found.extend(b for b in a if isinstance(b, torch.Tensor))
    return found


def reads_any(tensors: tuple, args: Any, kwargs: dict | None) -> bool:
    """Whether an op's arguments hold one of ``tensors`` or an alias of its whole memory (a
    detached alias that ``CommMode``'s tagging hands out), at any depth (``torch.tensor([[y]])``,
    an index ``w[:, [k]]``, a slice's bound); a view is made by an op that reads. A tensor whose
    memory cannot be told (a ``torch.func`` transform's wrapper, a sparse one) may hold one: it
    counts as one."""
    for a in _every_tensor((args, kwargs)):
        for t in tensors:
            if a is t or _data_ptr(a) in (None, t.data_ptr()):
                return True
    return False


def _every_tensor(a: Any) -> Iterator[torch.Tensor]:
    """The tensors in ``a``, at any depth of its lists, tuples, dicts and slices."""
    if isinstance(a, torch.Tensor):
        yield a
    elif isinstance(a, (list, tuple)):
        for b in a:
            yield from _every_tensor(b)
    elif isinstance(a, dict):
        for b in a.values():
            yield from _every_tensor(b)
    elif isinstance(a, slice):
        yield from _every_tensor((a.start, a.stop, a.step))


def _data_ptr(a: torch.Tensor) -> int | None:
    if a.layout is not torch.strided:
        return None
    try:
        return a.data_ptr()
    except RuntimeError:  # (a wrapper without storage)
        return None


def result_tensors(out: Any) -> tuple[torch.Tensor, ...]:
    """The tensors an op returned: itself, or those in its list or tuple at any depth
    (``torch.histogramdd``'s bin edges are a tuple inside its result), each of which a typed
    call must type."""
    if isinstance(out, torch.Tensor):
        return (out,)
    if not isinstance(out, (list, tuple)):
        return ()
    found: list[torch.Tensor] = []
    for o in out:
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, (list, tuple)):
            found.extend(result_tensors(o))
    return tuple(found)


def swap_operands(args: Any, kwargs: dict | None, swap: dict, key: Any = id):
    """``args`` and ``kwargs`` with each tensor whose ``key`` is in ``swap`` replaced (keyed by
    the tensor itself where Dynamo may trace: ``id`` of a traced input is a guard)."""
    if type(args) is tuple:  # (the usual case, one level inlined: this runs for every cast)
        args = tuple(
            [
                swap.get(key(a), a)
                if isinstance(a, torch.Tensor)
                else _replace(a, swap, key)
                if isinstance(a, (list, tuple))
                else a
                for a in args
            ]
        )
    else:
        args = _replace(args, swap, key)
    if kwargs:
        kwargs = {k: _replace(v, swap, key) for k, v in kwargs.items()}
    return args, kwargs


def _replace(obj: Any, swap: dict, key: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return swap.get(key(obj), obj)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_replace(o, swap, key) for o in obj)
    return obj


# Calls that take tensors but compute no value from them: differentiation itself (which
# torch.func.grad / vjp inside the function call too). Treated as ops, they would mix the
# invariant loss with the varying inputs and pvary the loss, doubling gradients per axis size.
NOT_OPS = frozenset({torch.autograd.grad, torch.autograd.backward, torch.Tensor.backward})
# Reads of a tensor's metadata (a collective's own checks read dtype and device): no tensor
# results, nothing to type.
METADATA = frozenset(
    {
        torch.Tensor.dtype.__get__,  # type: ignore[attr-defined]
        torch.Tensor.device.__get__,
        torch.Tensor.shape.__get__,  # type: ignore[attr-defined]
        torch.Tensor.is_floating_point,
        torch.Tensor.is_complex,
        torch.Tensor.dim,
    }
)

_INPLACE_DUNDERS = frozenset(
    f"__i{op}__"
    for op in ("add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "matmul")
    + ("and", "or", "xor", "lshift", "rshift")
) | {"__setitem__"}


_IS_INPLACE: dict = {}  # func -> whether it writes into its first argument (memo: hot path)


def write_target(func, args, kwargs, inplace=None) -> torch.Tensor | None:
    """The tensor an op writes into: an in-place op's first argument (``inplace``: the test of
    that, :func:`is_inplace` by default), or its ``out=``."""
    target = args[0] if args and (inplace or is_inplace)(func) else (kwargs or {}).get("out")
    return target if isinstance(target, torch.Tensor) else None


def is_inplace(func) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``, ``__setitem__``)."""
    hit = _IS_INPLACE.get(func)
    if hit is None:
        name = getattr(func, "__name__", "")
        hit = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
        _IS_INPLACE[func] = hit
    return hit


_T = torch.Tensor

_F = torch.nn.functional
_OPERAND_SHAPED: tuple[str, ...] = ("add", "sub", "mul", "div", "neg", "exp", "log", "tanh", "abs")
_OPERAND_SHAPED += ("sigmoid", "sqrt", "rsqrt", "relu", "pow", "matmul", "sin", "cos", "square")
_OPERAND_SHAPED += ("maximum", "minimum")
#: Ops whose results' shapes follow from their tensor operands' shapes alone, none of their other
#: arguments a size, dim or index that a tensor may stand for (and be read for): a replay need
#: not compare their results' shapes with its plan's (``_plan``'s guard; the comparison costs
#: about as much as the rest of a replayed op).
SHAPES_FROM_SHAPES = frozenset(
    {
        *(getattr(torch.Tensor, n) for n in _OPERAND_SHAPED),
        *(
            getattr(torch.Tensor, n + "_")
            for n in _OPERAND_SHAPED
            if hasattr(torch.Tensor, n + "_")
        ),
        *(getattr(torch, n) for n in (*_OPERAND_SHAPED, "mm", "bmm")),
        *(_T.__pow__, _T.__rpow__, _T.__rsub__, _T.__rtruediv__, _T.__rmatmul__, _T.float),
        *(_F.linear, _F.gelu, _F.silu, _F.relu, _F.dropout, _F.embedding, _F.cross_entropy),
        *(_F.layer_norm, _F.scaled_dot_product_attention, _F.softmax, _F.log_softmax),
    }
)
# Ops that read their operands' values on the host (a Python number or bool), or whose result's
# shape follows them: where an operand varies, each rank of a real mesh may go on with other
# Python values and shapes (:func:`value_operands_read`; ``SpmdContext.values_read``).
_READS = frozenset(
    {
        *(_T.item, _T.tolist, _T.numpy, _T.__array__, _T.__contains__),
        *(_T.__bool__, _T.__int__, _T.__float__, _T.__index__, _T.__complex__),
        *(torch.equal, _T.equal, torch.allclose, _T.allclose, torch.is_nonzero, _T.is_nonzero),
        *(torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere),
        *(torch.masked_select, _T.masked_select, torch.bincount, _T.bincount),
        *(torch.unique, _T.unique, torch.unique_consecutive, _T.unique_consecutive),
    }
)
# Factories and reshapes whose sizes may be given as tensors (read on the host by torch's
# argument parser, which no mode sees): a tensor among a factory's arguments, or after a
# reshape's first, is such a size.
_SIZED_FACTORIES = frozenset(
    {torch.arange, torch.zeros, torch.ones, torch.empty, torch.full, torch.rand, torch.randn}
    | {torch.randint, torch.randperm, torch.eye, torch.tril_indices, torch.triu_indices}
)
# Factories whose one size is their third argument, ``steps`` (their bounds are values).
_STEPS = frozenset({torch.linspace, torch.logspace})
_SIZED_RESHAPES = frozenset(
    {
        *(_T.view, _T.reshape, torch.reshape, _T.expand, _T.narrow, torch.narrow),
        *(_T.new_zeros, _T.new_ones, _T.new_empty, _T.new_full, _T.repeat, _T.tile, torch.tile),
        *(_T.split, torch.split, _T.tensor_split, torch.tensor_split, _T.unflatten),
        *(torch.unflatten, _T.repeat_interleave, torch.repeat_interleave),
        *(_T.chunk, torch.chunk, torch.nn.functional.pad, _T.unfold, torch.histc),
        *(_T.topk, torch.topk, _T.multinomial, torch.multinomial),
    }
)
#: Every op :func:`value_operands_read` may find operands of (the one test on the hot path).
READS_VALUES = _READS | _SIZED_FACTORIES | _STEPS | _SIZED_RESHAPES
READS_VALUES |= {_T.__getitem__, torch.where}


def value_operands_read(func, args: Any, kwargs: dict | None) -> list[torch.Tensor]:
    """The tensors whose values op ``func`` (one of :data:`READS_VALUES`) reads on the host or
    sizes its result by: a read's or a data-dependent shape's operands (``nonzero``, a
    boolean mask's index, ``torch.where(cond)``), a tensor given as a size, a tensor bound of
    a slice. Empty where the result's shape follows the operands' shapes alone."""
    if func in _READS or func in _SIZED_FACTORIES:
        return tensor_operands(args, kwargs)
    if func in _STEPS:
        steps = args[2] if len(args) > 2 else (kwargs or {}).get("steps")
        return [steps] if isinstance(steps, torch.Tensor) else []
    if func is torch.where:  # (its one-argument form: nonzero)
        return tensor_operands(args, kwargs) if len(args) + len(kwargs or {}) == 1 else []
    if func is _T.__getitem__:
        return _index_operands(args[1]) if len(args) > 1 else []
    if func is torch.repeat_interleave and len(args) == 1:  # (repeats alone: its values)
        return tensor_operands(args, kwargs)
    return tensor_operands(args[1:], kwargs)


def _index_operands(index: Any) -> list[torch.Tensor]:
    """The tensors of an index that size the result by their values: boolean masks, and a
    slice's tensor bounds (an integer tensor's index takes the tensor's shape)."""
    found: list[torch.Tensor] = []
    for i in index if isinstance(index, (tuple, list)) else (index,):
        if isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8):
            found.append(i)
        elif isinstance(i, slice):
            found.extend(b for b in (i.start, i.stop, i.step) if isinstance(b, torch.Tensor))
    return found
