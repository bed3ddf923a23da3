"""Argument checks of the collectives: each raises a CollectiveError or VmaError that names the
call, the user's function, expected versus got, and the fix."""

from __future__ import annotations

from typing import Any

import torch

from ._context import SpmdContext
from ._errors import CollectiveError, VmaError
from ._types import VType

_valid_pairs: dict[tuple, tuple[tuple[int, int], ...]] = {}


def require_varying(ctx: SpmdContext, t: torch.Tensor, axes: tuple[str, ...], op: str) -> None:
    invariant = [a for a in axes if a not in ctx.vma(t)]
    if invariant:
        fix = " * ".join(f"axis_size({a!r})" for a in invariant)
        raise VmaError(
            f"{op} in {ctx.fn_label}: the operand is invariant over {tuple(invariant)} (its type is "
            f"{VType(t.dtype, tuple(t.shape), ctx.vma(t), ctx.mesh.axis_names)}), so {op} over {axes} would add identical copies "
            f"and multiply it by {' * '.join(str(ctx.mesh.shape[a]) for a in invariant)}. JAX does "
            f"that silently; named_spmd refuses. Fix: drop {tuple(invariant)} from the "
            f"collective's axes if the value is already the total, or write x * {fix} if you "
            "really mean to multiply."
        )


def checked_dim(ctx, t: torch.Tensor, dim: int, op: str, what: str, extra: int = 0) -> int:
    rank = t.dim() + extra
    if not isinstance(dim, int) or not -rank <= dim < rank:
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: {what}={dim!r} is out of range for an operand of shape "
            f"{list(t.shape)} (valid: {-rank}..{rank - 1}). Fix: pass a dim in that range."
        )
    return dim % rank


def check_divisible(ctx, t, dim, n, axes, op, what, tiled):
    size = t.shape[dim]
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


def check_pairs(ctx, op: str, perm: Any, n: int, axes) -> tuple[tuple[int, int], ...]:
    """Validated pairs. Perms of int tuples are remembered: validating costs more than the
    simulated permutation of a small operand."""
    # only int tuples are looked up: (0.0, 1.0) hashes and compares equal to (0, 1), but is
    # not a valid pair
    cacheable = isinstance(perm, (list, tuple)) and all(
        type(p) is tuple and all(type(v) is int for v in p) for p in perm
    )
    key = (n, tuple(perm)) if cacheable else None
    if key is not None:
        hit = _valid_pairs.get(key)
        if hit is not None:
            return hit
    pairs = _validate_pairs(ctx, op, perm, n, axes)
    if key is not None:
        if len(_valid_pairs) > 1024:
            _valid_pairs.clear()
        _valid_pairs[key] = pairs
    return pairs


def _validate_pairs(ctx, op: str, perm: Any, n: int, axes) -> tuple[tuple[int, int], ...]:
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
    if problems:
        raise CollectiveError(
            f"{op} in {ctx.fn_label}: bad perm: {'; '.join(problems)}. Fix: each instance may "
            f"send once and receive once, e.g. a ring [(i, (i + 1) % {n}) for i in range({n})]."
        )
    return pairs
