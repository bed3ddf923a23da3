"""Argument checks of the collectives: each raises a CollectiveError or VmaError that names the
call, the user's function, expected versus got, and the fix."""

from __future__ import annotations

import functools
import operator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from .. import _torch_private as torch_private
from .._context import Axes, SpmdContext
from .._errors import CollectiveError, VmaError
from .._types import type_text

if TYPE_CHECKING:
    from ._record import Collective

Pairs = tuple[tuple[int, int], ...]


def checked_dim(
    ctx: SpmdContext, t: torch.Tensor, dim: int, op: str, what: str, extra: int = 0
) -> int:
    rank = t.dim() + extra
    try:
        index = operator.index(dim)  # ints, and integer scalars such as numpy's int64
    except TypeError:
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: {what}={dim!r} is not an integer. Fix: pass an int dim in "
            f"{-rank}..{rank - 1} (the operand has shape {list(t.shape)})."
        ) from None
    if not -rank <= index < rank:
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: {what}={dim!r} is out of range for an operand of shape "
            f"{list(t.shape)} (valid: {-rank}..{rank - 1}). Fix: pass a dim in that range."
        )
    return index % rank


def check_divisible(
    ctx: SpmdContext,
    t: torch.Tensor,
    dim: int,
    n: int,
    axes: Axes,
    op: str,
    what: str,
    tiled: bool,
) -> None:
    size = t.shape[dim]
    if torch_private.memo_would_be_guarded():
        fits = size % n == 0 if tiled else size == n
        if torch_private.decided(fits) is None:
            raise CollectiveError(_data_dependent_size(ctx, dim, n, axes, op, what, tiled))
    if tiled and size % n != 0:
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: {what}={dim} has size {size}, not divisible by the group "
            f"size {n} of {axes}. Fix: pad dim {dim} to a multiple of {n}."
        )
    if not tiled and size != n:
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: with tiled=False, {what}={dim} must have size {n} (the "
            f"group size of {axes}) but has size {size} (shape {list(t.shape)}). Fix: reshape it "
            f"to {n} x {size // n if size % n == 0 else '...'} first, or pass tiled=True."
        )


def _data_dependent_size(
    ctx: SpmdContext, dim: int, n: int, axes: Axes, op: str, what: str, tiled: bool
) -> str:
    """The message for an operand dim whose size Dynamo knows only when the program runs."""
    wanted = f"a multiple of {n}" if tiled else str(n)
    return (
        f"{op} in {ctx.fn_label}: {what}={dim} has a data-dependent size (known only when the "
        f"program runs, as x[mask]'s or one made from .item()), so whether it is {wanted} (the "
        f"group size of {axes}) cannot be checked while compiling. Fix: pad dim {dim} to a "
        f"size known when compiling ({wanted}), or call the mapped function outside the "
        "compiled region."
    )


def check_pairs(ctx: SpmdContext, op: str, perm: Any, n: int, axes: Axes) -> Pairs:
    """Validated pairs. Perms of int tuples are remembered: validating costs more than the
    simulated permutation of a small operand."""
    # only int tuples are looked up: (0.0, 1.0) hashes and compares equal to (0, 1), but is
    # not a valid pair; none while Dynamo traces (it also warns about the lru_cache)
    if (
        not torch_private.memo_would_be_guarded()
        and isinstance(perm, (list, tuple))
        and all(type(p) is tuple and all(type(v) is int for v in p) for p in perm)
    ):
        pairs = _valid_int_pairs(n, tuple(perm))
        if pairs is not None:
            return pairs
    pairs, problems = _pair_problems(perm, n, axes)
    if problems:
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: bad perm: {'; '.join(problems)}. Fix: each instance may "
            f"send once and receive once, e.g. a ring [(i, (i + 1) % {n}) for i in range({n})]."
        )
    return pairs


@functools.lru_cache(maxsize=1024)
def _valid_int_pairs(n: int, perm: Pairs) -> Pairs | None:
    pairs, problems = _pair_problems(perm, n, ())
    return None if problems else pairs


def _pair_problems(perm: Any, n: int, axes: Axes) -> tuple[Pairs, list[str]]:
    try:
        pairs = tuple((int(s), int(d)) for s, d in perm)
        ok_types = all(
            isinstance(v, int) or (isinstance(v, torch.Tensor) and v.dim() == 0)
            for p in perm
            for v in p
        )
    except (TypeError, ValueError):
        pairs, ok_types = (), False
    problems = []
    if not ok_types:
        problems.append(f"perm must be a list of (src, dst) integer pairs, got {perm!r}")
    else:
        bad = [p for p in pairs if not (0 <= p[0] < n and 0 <= p[1] < n)]
        if bad:
            problems.append(f"pairs {bad} are out of range 0..{n - 1} (group size of {axes})")
        for side, k in (("source", 0), ("destination", 1)):
            seen = [p[k] for p in pairs]
            dup = sorted({v for v in seen if seen.count(v) > 1})
            if dup:
                problems.append(f"{side}s {dup} appear more than once")
    return pairs, problems


_REDUCE: dict[str, Any] = {"sum": torch.sum, "max": torch.amax, "min": torch.amin}


def _reduces(dtype: torch.dtype, device_type: str, reduction: str) -> bool:
    try:
        _REDUCE[reduction](torch.zeros(2, dtype=dtype, device=device_type), 0)
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def _copies(dtype: torch.dtype) -> bool:
    try:
        torch.empty(1, dtype=dtype).clone()
    except (RuntimeError, NotImplementedError):
        return False
    return True


# What torch answered so far. Looked up before entering the modes below: the lookup is on every
# eager collective's path, the modes cost about 50 us.
_REDUCES: dict[tuple[torch.dtype, str, str], bool] = {}
_COPIES: dict[torch.dtype, bool] = {}


# The probes below ask torch itself, on real tensors, outside the library's modes. While
# torch.compile traces a call they run eagerly at trace time (a traced probe would ask fake
# tensors, and Dynamo would guard on their memos), so a compiled call is refused where an eager
# one is.
@torch_private.trace_constant
def torch_reduces(dtype: torch.dtype, device_type: str, reduction: str) -> bool:
    """Whether torch computes ``reduction`` of ``dtype`` tensors on ``device_type`` (float8,
    bit and sub-byte dtypes have no sum on CPU; unsigned 16- to 64-bit integers no amax)."""
    key = (dtype, device_type, reduction)
    known = _REDUCES.get(key)
    if known is None:
        with torch_private.DisableTorchFunction(), torch_private.no_dispatch_modes():
            known = _REDUCES[key] = _reduces(dtype, device_type, reduction)
    return known


@torch_private.trace_constant
def torch_copies(dtype: torch.dtype) -> bool:
    """Whether torch has a copy kernel for ``dtype`` (none for int1..int7, uint1..uint7)."""
    known = _COPIES.get(dtype)
    if known is None:
        with torch_private.DisableTorchFunction(), torch_private.no_dispatch_modes():
            known = _COPIES[dtype] = _copies(dtype)
    return known


def dtype_and_device(t: torch.Tensor) -> tuple[torch.dtype, str]:
    """``t``'s dtype and device type, read past the torch function modes: the collectives'
    checks read them on every call, where a mode's dispatch of the read costs several times
    the read (no op of the program: nothing for a mode to type)."""
    if not torch_private.has_torch_function(t):  # nothing to read past
        return t.dtype, t.device.type
    with torch_private.DisableTorchFunction():
        return t.dtype, t.device.type


def check_reducible(ctx: SpmdContext, t: torch.Tensor, op: str, reduction: str) -> None:
    """A reduction of a dtype torch cannot reduce is refused before any communication, alike on
    every backend (the simulated one reduces with torch's own ops; a real one could not either:
    gloo refuses most such dtypes mid-collective); a compiled call at trace time."""
    dtype, device_type = dtype_and_device(t)
    if not torch_reduces(dtype, device_type, reduction):
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: the operand is {t.dtype}, which torch cannot "
            f"{reduction} on {t.device.type} (torch.{_REDUCE[reduction].__name__} refuses it "
            f"too). Fix: {op} of x.to(torch.float32) (or another dtype torch reduces), then "
            "convert the result back."
        )


def check_copyable(ctx: SpmdContext, op: str, t: torch.Tensor) -> None:
    """Every communicating collective copies its operand somewhere; torch has no copy kernel for
    the sub-byte dtypes (int1..int7, uint1..uint7), so each backend would fail at a different
    point (a rank-dependent one on a real mesh): refused up front, alike (a compiled call at
    trace time)."""
    if not torch_copies(t.dtype):
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: the operand is {t.dtype}, which torch cannot copy (it has "
            f"no copy kernel for it), so no collective can move it. Fix: {op} of "
            "x.view(torch.uint8) and view the result back with .view(" + str(t.dtype) + ")."
        ) from None


# --- an operand invariant over some of the axes (REQUIRE_VARYING records) ---------------------


class Invariant(NamedTuple):
    """An operand invariant over some of a collective's axes, as its message describes it."""

    axes: Axes  # the collective's
    invariant: Axes  # those of ``axes`` the operand is invariant over
    copies: int  # how many identical copies a sum over ``axes`` adds: their group size
    size: int  # the group size of ``axes``
    params: tuple  # the collective's (after ``prepare`` and ``check``)


def raise_invariant_operand(
    ctx: SpmdContext, rec: Collective, t: torch.Tensor, axes: Axes, params: tuple
) -> None:
    """The VmaError of ``rec`` (a ``REQUIRE_VARYING`` record) for an operand invariant over
    some of ``axes``: the common start, then the record's own consequence and fix."""
    vma = ctx.vma(t)
    invariant = vma.missing(axes)
    assert rec.invariant_operand is not None  # checked when the record was made
    sizes = ctx.mesh.axis_size(invariant), ctx.mesh.axis_size(axes)
    rest = rec.invariant_operand(Invariant(axes, invariant, *sizes, params))
    raise ctx.type_error(
        t,
        lambda shape: VmaError(
            f"{rec.name} in {ctx.fn_label}: the operand is invariant over {invariant} (its type "
            f"is {type_text(t.dtype, shape, vma, ctx.mesh.axis_names)}), so {rest}"
        ),
    )


def axis_sizes(axes: Axes) -> str:
    """``axis_size('a') * axis_size('b')``: the factor written with the public API."""
    return " * ".join(f"axis_size({a!r})" for a in axes)


def axis_text(axes: Axes) -> str:
    """``axes`` as a user writes the axis_name argument: ``'a'`` or ``('a', 'b')``."""
    return repr(axes[0]) if len(axes) == 1 else repr(axes)
