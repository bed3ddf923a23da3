"""Errors from the user's own torch code on the simulated mesh, told in per-instance terms.

Under the simulation every instance runs at once, batched at one vmap level per mesh axis, so a
torch op that rejects its operands reports the *physical* tensors: a 3-d local block is 4-d
("dimension 3"), a matmul's rows count every instance ("12x5" for a local ``[3,5]``). When a run
fails with such an error (``RuntimeError``, ``IndexError``, ``ValueError``, ``TypeError``; not an
``SpmdError``), :func:`explained` runs the call once more under :class:`_Locator`, a
``TorchFunctionMode`` that notes the innermost torch function that raised, its operands' local
types, and what each instance raises when that op is replayed on its own blocks (plain tensors:
what that instance's rank raises on a real mesh). The error becomes an ``SpmdError`` of the same
class family (``SpmdIndexError`` for an ``IndexError``, ...) naming the user's function and line,
the op with per-instance types, and the per-instance message; torch's message is its
``__cause__``. Autograd's entry points (``_AUTOGRAD``) are not replayed: their error is the
simulation's limit, told with its fixes.

The second run is quiet (its prints, warnings and random draws are discarded: the first run made
them) and records no communication; only Python side effects of the user's code repeat. Nothing is
hidden: an error that the second run does not reproduce identically, or that no torch function
raised (the user's own ``raise``), or of a subclass the user's code may catch (``LinAlgError``:
``_errors.told_in_family``) propagates unchanged. The fast path pays one ``try``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from ... import _torch_private as torch_private
from ..._accounting import resume, suspend
from ..._errors import (
    TORCH_ERRORS,
    SpmdError,
    VmaError,
    error_class,
    fn_label,
    told_in_family,
    user_line,
)
from ..._operands import is_inplace, swap_operands, tensor_operands
from ..._replay import quietly
from ..._tracking import CAST_WRITE
from ..._types import VType
from ._instances import Instances, coordinates, instances, label, simulated_call

# torch's message for a write into memory that several elements share (an expanded tensor)
_OVERLAP = "more than one element of the written-to tensor refers to a single memory location"


def explained(run: Callable[..., list[torch.Tensor]]) -> Callable[..., list[torch.Tensor]]:
    """``run`` whose torch errors from the user's code come out per instance (module doc)."""

    @functools.wraps(run)
    def run_explained(call):
        try:
            return run(call)
        except TORCH_ERRORS as error:
            if not told_in_family(error):  # an SpmdError, or a subclass the user may catch
                raise
            if call.mesh.size == 1:  # no instances to tell apart: ``_one_instance`` tells it
                raise
            better = _diagnose(error, functools.partial(run, call), call.fn, call.leaves)
            if better is None:
                raise
            raise better from error

    return run_explained


def _diagnose(
    error: BaseException, again: Callable[[], Any], fn: Any, leaves: list[Any]
) -> SpmdError | None:
    locator = _Locator()
    saved = suspend()  # the second run records no communication
    try:
        with quietly(leaves), locator:
            again()
    except Exception as e:  # the same error, normally
        repeated: Exception | None = e
    else:
        repeated = None
    finally:
        resume(saved)
    failure = locator.failures.get(id(repeated))
    if failure is None or failure[1] is None:
        return None
    if type(repeated) is not type(error) or str(repeated) != str(error):
        return None  # not reproduced identically: the original is what happened
    return failure[1].error(fn, error, any(_expanded(x) for x in leaves))


def _expanded(x: Any) -> bool:
    """Whether argument ``x`` is a tensor whose elements share memory (an expanded tensor)."""
    return isinstance(x, torch.Tensor) and any(
        n > 1 and st == 0 for n, st in zip(x.shape, x.stride())
    )


class _Locator(TorchFunctionMode):
    """Notes, per exception raised through a torch function of the call, what failed where.

    The innermost torch function that raises an exception notes it first; the functions it ran
    inside see the same exception object pass and leave the note. Keyed by the exception (kept
    alive, so its id stays unique), so an error torch raises and catches internally is ignored."""

    def __init__(self) -> None:
        super().__init__()
        self.failures: dict[int, tuple[BaseException, _Failure | None]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            return func(*args, **kwargs)
        except Exception as e:
            if id(e) not in self.failures:
                self.failures[id(e)] = (e, _describe(func, args, kwargs))
            raise


@dataclass
class _Failure:
    call: str  # the op with its operands' per-instance types
    alone: tuple[dict[str, int], Exception] | None  # an instance that raises it on its own
    replayed: bool  # whether the op was replayed per instance
    autograd: bool = False  # an autograd entry point (``_AUTOGRAD``): the simulation's limit

    def error(self, fn: Any, error: BaseException, expanded_input: bool) -> SpmdError:
        """The error to raise; ``expanded_input``: whether an argument of the call shares memory
        between its elements, where a write that overlaps itself may come from."""
        where = f"spmd_map of {fn_label(fn)}: {self.call} failed at {user_line(error)}"
        if self.autograd:
            return error_class(type(error))(
                f"{where} under the simulated mesh:\n  {type(error).__name__}: {error}\n"
                + _AUTOGRAD_LIMIT
            )
        if self.alone is not None:
            coords, own = self.alone
            who = f"instance {label(coords)}" if coords else "every instance"
            return error_class(type(own))(
                f"{where}:\n  {type(own).__name__}: {own}\n"
                f"That is what {who} raises on its own, with the per-instance types above (on a "
                "real mesh its rank raises it). Inside the function, shapes are the local blocks "
                "that in_specs select: a dim split over an axis of size n holds 1/n of the global "
                "dim. torch's message under the simulated mesh, which counts the mesh's batch "
                "dims, is the __cause__."
            )
        if self.replayed and _OVERLAP in str(error) and not expanded_input:
            return VmaError(f"{where}: {CAST_WRITE}")  # as a real mesh's (``_tracking``)
        if self.replayed and _OVERLAP in str(error):
            return error_class(type(error))(
                f"{where} under the simulated mesh, though no instance raises it on its own:\n"
                f"  {type(error).__name__}: {error}\n"
                "The instances' blocks of the tensor written share memory, and the simulated "
                "mesh writes every instance at once. " + _EXPANDED
            )
        if self.replayed:
            return error_class(type(error))(
                f"{where} under the simulated mesh, though no instance raises it on its own:\n"
                f"  {type(error).__name__}: {error}\n"
                "This op fails only when every instance runs at once under torch.func.vmap; a "
                "real mesh runs it. Fix: an equivalent that vmap batches (out of place rather "
                "than in place, no storage or data-pointer access)."
            )
        return error_class(type(error))(
            f"{where} (the types above are per instance; torch's message may count the "
            f"simulated mesh's batch dims):\n  {type(error).__name__}: {error}"
        )


# why the instances' blocks of a written tensor share memory where an argument is expanded (each
# rank's block has its own memory on a real mesh), and the fix; else it is a cast's (CAST_WRITE)
_EXPANDED = (
    "An argument is an expanded tensor (its copies along a mesh axis one memory); on a real mesh "
    "each rank writes its own block and runs it. Fix: pass the input materialized "
    "(x.contiguous() before the call), or compute out of place (y = x + 1 rather than x.add_(1))."
)


# Autograd's entry points inside the function: under the simulation they meet vmap's batched
# tensors, which autograd does not track (and functorch's refusals), not an instance's own tensors,
# so no replay on an instance's blocks tells what its rank does; a real rank runs them.
_AUTOGRAD = frozenset(
    {
        torch.autograd.grad,
        torch.autograd.backward,
        torch.Tensor.backward,
        torch.Tensor.requires_grad_,
    }
)
_AUTOGRAD_LIMIT = (
    "This is a limit of the simulated mesh, not of the program: it runs every instance at once "
    "under torch.func.vmap, whose batched tensors torch.autograd does not track (backward(), "
    "torch.autograd.grad and requires_grad_() inside the function); a real mesh runs it. Fix: "
    "torch.func.grad or torch.func.vjp inside the function (g = torch.func.grad(loss_of_y)(y)), "
    "or run the call under `with ns.simulate_per_instance():` (each instance on its own: "
    "torch.autograd.grad and requires_grad_() run there)."
)


def _describe(func: Any, args: tuple, kwargs: dict) -> _Failure | None:
    """What failed, if inside a simulated call; never raises (the user's error must get out)."""
    ctx = simulated_call()
    if ctx is None:
        return None  # outside the user's function: the simulation's own code
    try:
        call = _call_text(ctx, func, args, kwargs)
        views = _views(ctx, args, kwargs)
        if views is not None and func in _AUTOGRAD:
            return _Failure(call, None, False, autograd=True)
        alone = None if views is None else _alone(ctx, func, args, kwargs, views)
    except Exception:
        return None
    return _Failure(call, alone, views is not None)


def _views(ctx: Any, args: tuple, kwargs: dict) -> dict[int, Instances] | None:
    """Every tensor operand's blocks, or None where the op cannot be replayed per instance: a
    user's transform runs above the simulation's levels, or a vmap around the call batches an
    operand (torch's message would count that batch dim either way)."""
    if torch_private.maybe_current_level() != ctx.inner_level:
        return None
    views = {}
    for t in tensor_operands(args, kwargs):
        view = instances(t, ctx)
        if view is None or torch_private.is_batchedtensor(view.base):
            return None
        views[id(t)] = view
    return views


def _alone(
    ctx: Any, func: Any, args: tuple, kwargs: dict, views: dict[int, Instances]
) -> tuple[dict[str, int], Exception] | None:
    """The first instance (row-major) whose blocks make ``func`` raise, with what it raised."""
    found = {a for v in views.values() for a in v.axes}
    axes = tuple(a for a in ctx.mesh.axis_names if a in found)
    writes = is_inplace(func) or "out" in kwargs  # on copies: the replay never touches data
    for coords in coordinates(axes, ctx.sizes):
        swap = {}
        for key, view in views.items():
            block = view.block(coords)
            swap[key] = _copy_to_write(block) if writes else block
        own_args, own_kwargs = swap_operands(args, kwargs, swap)
        try:
            func(*own_args, **(own_kwargs or {}))
        except Exception as e:
            return coords, e
    return None


def _copy_to_write(block: torch.Tensor) -> torch.Tensor:
    """A copy of ``block`` with its memory layout where that decides whether a write succeeds:
    the dims an expand shares (stride 0) stay shared, so an in-place write into an expanded
    input fails on the copy as on that instance's own block (and its rank on a real mesh)."""
    shared = [s == 0 and n > 1 for n, s in zip(block.shape, block.stride())]
    if not any(shared):
        return block.clone()
    one = tuple(slice(0, 1) if d else slice(None) for d in shared)
    return block[one].clone().expand(block.shape)


def _call_text(ctx: Any, func: Any, args: tuple, kwargs: dict) -> str:
    """``Tensor.view(f32[3,5]{dp}, 7, -1)``: the op with its operands' per-instance types."""

    def show(a: Any) -> str:
        if isinstance(a, torch.Tensor):
            return repr(VType(a.dtype, tuple(a.shape), ctx.vma(a), ctx.mesh.axis_names))
        if isinstance(a, (list, tuple)) and any(isinstance(b, torch.Tensor) for b in a):
            inner = ", ".join(show(b) for b in a)
            return f"[{inner}]" if isinstance(a, list) else f"({inner})"
        text = repr(a)
        return text if len(text) <= 40 else text[:37] + "..."

    parts = [show(a) for a in args] + [f"{k}={show(v)}" for k, v in kwargs.items()]
    name = getattr(func, "__name__", repr(func))
    owner = "Tensor." if getattr(func, "__module__", None) is None else ""  # a method
    return f"`{owner}{name}`({', '.join(parts)})"
