"""An op's tensor operands, as the per-op typing sees them: found, swapped, classified.

Every mode that types torch ops (``_tracking.VmaMode``, the plans of ``_plan``, the simulated
backend's recording and diagnosis) reads an op's operands and decides whether it is an op at
all, and whether it writes into its first argument, the same way: here.
"""

from __future__ import annotations

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


def is_inplace(func) -> bool:
    """Whether ``func`` writes into its first argument (``add_``, ``__iadd__``, ``__setitem__``)."""
    hit = _IS_INPLACE.get(func)
    if hit is None:
        name = getattr(func, "__name__", "")
        hit = (name.endswith("_") and not name.endswith("__")) or name in _INPLACE_DUNDERS
        _IS_INPLACE[func] = hit
    return hit
