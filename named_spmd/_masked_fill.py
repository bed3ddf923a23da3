"""A write through a boolean mask of a value every True position takes whole, without vmap.

``y[y > 0] = 0``, ``y[mask] = t`` (``t`` a 0-d tensor) and ``y.index_put_((mask,), t)`` (or
``torch.index_put_``, ``index_put``) size
nothing by the mask's values: each True position takes the one value. torch.func.vmap still
refuses them (it batches ``index_put_`` with a boolean index as a data-dependent size), so on the
simulated mesh, which runs every instance under vmap, the call's marker (and the compiled call's
mode) runs them as what they equal: ``masked_fill_`` of a number, ``copy_`` of a ``where`` for a
tensor value (one element, or one that broadcasts over what each position selects: a row of a row
mask); in place (views of the target see the write), with their gradients, a real mesh's values.
A tensor value torch would refuse (another dtype, not one CPU element) and a value of one element
per True position (sized by the mask) keep vmap's refusal (the simulated mesh explains it).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

SETITEM = Tensor.__setitem__
IN_PLACE_PUTS = frozenset({Tensor.index_put_, torch.index_put_})
_INDEX_PUT = frozenset({*IN_PLACE_PUTS, Tensor.index_put, torch.index_put})
WRITES_THROUGH_MASKS = frozenset({SETITEM, *_INDEX_PUT})
NOT_MASKED = object()  # what :func:`as_masked_fill` returns for any other write
Op = Callable[[Any, tuple], Any]


def as_masked_fill(func: Any, args: tuple, kwargs: dict | None, op: Op) -> Any:
    """``func(*args, **kwargs)``, one of :data:`WRITES_THROUGH_MASKS`, computed by ops whose
    sizes do not depend on the mask's values, each run by ``op(function, arguments)``; or
    :data:`NOT_MASKED` where it is not a boolean-mask write of a value that every True position
    takes whole."""
    if kwargs:
        ordered = _by_position(args, kwargs)
        if ordered is None:
            return NOT_MASKED
        args = ordered
    if func is SETITEM:
        if len(args) != 3:
            return NOT_MASKED
        target, index, value = args
        index = index if isinstance(index, tuple) else (index,)
        in_place = True
    else:
        if len(args) < 3 or (len(args) > 3 and args[3]):  # accumulate=True: added per position
            return NOT_MASKED
        target, index, value = args[:3]
        if not isinstance(value, Tensor) or not isinstance(index, (tuple, list)):
            return NOT_MASKED
        index, in_place = tuple(index), func in IN_PLACE_PUTS
    mask = _mask(target, index)
    if mask is None:
        return NOT_MASKED
    spread = op(Tensor.reshape, (mask, mask.shape + (1,) * (target.dim() - mask.dim())))
    if not isinstance(value, Tensor):
        if not isinstance(value, (bool, int, float, complex)):
            return NOT_MASKED
        return op(Tensor.masked_fill_ if in_place else Tensor.masked_fill, (target, spread, value))
    shape = _row_shape(value, target.shape[mask.dim() :], stripped=func is SETITEM)
    if shape is None or not _casts_alike(value, target):
        return NOT_MASKED
    # (``where``, not masked_fill_ of a 0-d tensor, which vmap runs by its slow fallback)
    row = op(Tensor.to, (op(Tensor.reshape, (value, shape)), target.dtype))
    written = op(torch.where, (spread, row, target))
    return op(Tensor.copy_, (target, written)) if in_place else written


#: index_put's parameters in order (``Tensor.index_put_``'s ``self`` is always positional)
_PARAMETERS = ("input", "indices", "values", "accumulate")


def _by_position(args: tuple, kwargs: dict) -> tuple | None:
    """index_put's arguments in order, those given by keyword read by name (any order); None
    where a keyword names no parameter after the positional ones, or one is left out before a
    later one."""
    rest = _PARAMETERS[len(args) :]
    if not set(kwargs) <= set(rest):
        return None
    given = [name for name in rest if name in kwargs]
    if tuple(given) != rest[: len(given)]:
        return None
    return (*args, *(kwargs[name] for name in given))


def write_arguments(func: Any, args: tuple, kwargs: dict | None) -> tuple | None:
    """A write's target, index and value (``x[index] = value``; index_put's, in order, those
    given by keyword read by name), or None where its keywords do not name them."""
    ordered = args if func is SETITEM else _by_position(args, kwargs or {})
    return None if ordered is None else tuple(ordered[:3])


def _casts_alike(value: Tensor, target: Tensor) -> bool:
    """Whether torch writes ``value`` into ``target`` cast to its dtype: one of the same dtype,
    or one element on the CPU (torch's masked_fill shortcut); index_put_ refuses any other."""
    return value.dtype == target.dtype or (value.numel() == 1 and value.device.type == "cpu")


def _row_shape(value: Tensor, rest: torch.Size, stripped: bool) -> tuple[int, ...] | None:
    """The shape of ``value`` as what each True position takes (``rest``: the shape of one),
    where it broadcasts to it: an index_put_ value may lead with one dim of size 1 (for the
    positions), a ``__setitem__`` value with any number of them (``stripped``); else None."""
    shape = list(value.shape)
    if stripped:
        while shape and shape[0] == 1:
            shape.pop(0)
    elif len(shape) == len(rest) + 1 and shape[0] == 1:
        shape.pop(0)
    if len(shape) > len(rest):
        return None
    try:
        if torch.broadcast_shapes(tuple(shape), rest) != rest:
            return None
    except RuntimeError:
        return None
    return tuple(shape)


def _mask(target: Any, index: tuple) -> Tensor | None:
    """``index``'s one boolean tensor where it selects positions of ``target``'s leading dims
    (the shapes match, as torch requires); else None."""
    if not isinstance(target, Tensor) or len(index) != 1:
        return None
    mask = index[0]
    if not isinstance(mask, Tensor) or mask.dtype is not torch.bool or mask.dim() == 0:
        return None
    if mask.shape != target.shape[: mask.dim()] or mask.device != target.device:
        return None
    return mask
