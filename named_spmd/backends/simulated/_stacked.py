"""The simulated mesh's collectives as math on the tensor stacked over the group's members.

Both simulated paths reach a tensor ``z`` that holds every member's value at once, the members
along one dim (row-major over the group's axes), and compute a collective's result from it here:

* the eager levels (``_levels``, ``_primitives``): the tensor as seen at an axis' vmap level (the
  members along the level's batch dim: ``members=``), or the invariant stack ``gather`` makes;
* the compiled path (``_traced``): the custom op's vmap rule, once every axis of the group is an
  explicit dim.

The paths differ only in how they reach ``z`` and how the result becomes batched again. ``z``
is ``[G, *batch, *local]``: the G members, ``k`` dims of vmap levels not the group's (peeled in
front of the local value), the local value; ``dim`` is a dim of the local value. An invariant
result has no member dim (``[*batch, *local']``); a varying one has it in front (``[G, *batch,
*local']``: member i's value at index i). Autograd and torch.func differentiate and batch these
ordinary ops as any others: no collective here has a rule of its own.
"""

from __future__ import annotations

import functools

import torch

REDUCTIONS = {"sum": "sum", "max": "amax", "min": "amin"}  # a reduce op -> the torch method


def reduction(op: str, dtype: torch.dtype) -> str:
    """The reduce op a mesh applies for ``op`` on ``dtype``: a sum of truth values is their
    "or" (a max), as on a real mesh."""
    return "max" if dtype is torch.bool and op == "sum" else op


def reduce(z: torch.Tensor | list[torch.Tensor], op: str, members: int = 0) -> torch.Tensor:
    """all_reduce: elementwise ``op`` over the members (dim ``members`` of ``z``, or ``z`` a list
    of them), in their dtype (torch sums small integer types in int64; a mesh reduction keeps
    the operand's dtype)."""
    xs = z if isinstance(z, list) else z.unbind(members)
    dtype = xs[0].dtype
    if op == "sum" and (dtype.is_floating_point or dtype.is_complex):
        # member by member: a sum is -0.0 exactly when every member is -0.0, as on a real mesh
        # (-0.0 is the identity of IEEE addition); torch.sum starts from +0.0
        return functools.reduce(torch.add, xs)
    stacked, dim = (torch.stack(z), 0) if isinstance(z, list) else (z, members)
    out = getattr(stacked, REDUCTIONS[op])(dim)
    return out if out.dtype is dtype else out.to(dtype)


def copies(x: torch.Tensor, n: int) -> torch.Tensor:
    """``x`` (invariant) stacked as n members' identical values: ``[n, *x.shape]``, a view."""
    return x.expand(n, *x.shape)


def gather(z: torch.Tensor, k: int = 0) -> torch.Tensor:
    """all_gather: the members' values stacked, after the ``k`` batch dims; invariant."""
    return z.movedim(0, k) if k else z


def broadcast(z: torch.Tensor, root: int) -> torch.Tensor:
    """broadcast: member ``root``'s value; invariant."""
    return z.select(0, root)


def scatter(y: torch.Tensor, dim: int, k: int = 0) -> torch.Tensor:
    """An invariant ``y`` whose ``dim`` has the group's size -> member i gets slice i of it: the
    inverse of :func:`gather`. (On the eager levels the dim simply becomes the levels' batch
    dim: ``_levels.scatter``, no op.)"""
    return y.movedim(k + dim, 0)


def reduce_scatter(z: torch.Tensor, dim: int, k: int = 0) -> torch.Tensor:
    """reduce_scatter: the sum over the members, member i keeping slice i of ``dim``. (The eager
    context takes the two steps at the levels: :func:`reduce` there, ``_levels.scatter``.)"""
    return scatter(reduce(z, "sum"), dim, k)


def all_to_all(z: torch.Tensor, dim: int, k: int = 0) -> torch.Tensor:
    """all_to_all: member j's slice i of ``dim`` goes to member i, at slice j."""
    return z.transpose(0, 1 + k + dim)


def own(z: torch.Tensor, dim: int, k: int = 0) -> torch.Tensor:
    """own_block of ``z``, the members' copies of an invariant value: member i keeps slice i of
    ``dim`` of its copy (on the eager levels: ``_levels.scatter``, which needs no copies)."""
    return z.diagonal(0, 0, 1 + k + dim).movedim(-1, 0)


def member_slice(x: torch.Tensor, dim: int, index: torch.Tensor) -> torch.Tensor:
    """own_block as one instance sees it: slice ``index`` (its member index, one element) of
    ``x``'s ``dim``, where no stacked form is at hand (the eager levels under a transform inside
    the per-device function, and the transposes of gather)."""
    return x.index_select(dim, index.reshape(1)).squeeze(dim)


def permutation(n: int, pairs) -> tuple[list[int], list[bool]]:
    """For each of the n members: the member it receives from (``(src, dst)`` pairs), and
    whether it receives at all."""
    source = [0] * n
    receives = [False] * n
    for src, dst in pairs:
        source[dst], receives[dst] = src, True
    return source, receives


def permute(
    z: torch.Tensor, source: torch.Tensor, receives: torch.Tensor | None, members: int = 0
) -> torch.Tensor:
    """ppermute: member i gets member ``source[i]``'s value, or zeros where ``receives[i]`` is
    False (``receives`` None: every member receives)."""
    got = z.index_select(members, source)
    if receives is None:
        return got
    mask = receives.view([-1] + [1] * (z.dim() - members - 1))
    return torch.where(mask, got, got.new_zeros(()))
