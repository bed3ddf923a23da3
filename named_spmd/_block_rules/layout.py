"""A layout (which tensor dims hold blocks of which mesh axes) and the helpers the rules share:
the broadcast of layouts, permutations, dropped and cut dims."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .. import _torch_private as torch_private

NONE: frozenset[str] = frozenset()


class Layout(NamedTuple):
    dims: tuple[frozenset[str], ...]  # per dim: the axes whose blocks it holds
    opaque: frozenset[str]  # axes the value varies over for reasons the dims do not say


# ids of the layouts of tensors without a record that are plain (invariant: no blocks, nothing
# opaque); ``_blocks`` fills it, the elementwise rule's fast path reads it
PLAIN: set[int] = set()


def is_plain(lay: Layout) -> bool:
    """Whether ``lay`` holds no blocks and nothing opaque (eagerly: by identity, a hot path)."""
    if torch_private.memo_would_be_guarded():
        return not lay.opaque and not any(lay.dims)
    return id(lay) in PLAIN


# --- the rules: (args, kwargs, layout of an operand, out) -> (layout(s), unreduced axes) or None


Rule = Callable[[tuple, dict, Callable[[torch.Tensor], "Layout"], Any], Any]


def _first(args, layouts) -> tuple[torch.Tensor, Layout]:
    t = args[0]
    return t, layouts(t)


def _norm(d: int, n: int) -> int:
    if not -max(n, 1) <= d < max(n, 1):
        raise IndexError(d)
    return d % n if n else 0


def _permuted(lay: Layout, perm: Sequence[int]) -> Layout:
    return Layout(tuple(lay.dims[p] for p in perm), lay.opaque)


def _dropped(lay: Layout, gone: set[int]) -> Layout:
    """``lay`` without dims ``gone`` (an index, a squeeze): what they held becomes opaque."""
    lost = frozenset().union(*(lay.dims[d] for d in gone))
    dims = tuple(a for d, a in enumerate(lay.dims) if d not in gone)
    return Layout(dims, lay.opaque | lost)


def _cut(lay: Layout, dims: set[int]) -> Layout:
    """``lay`` with dims ``dims`` sliced: a part of a block is no block (opaque)."""
    lost = frozenset().union(*(lay.dims[d] for d in dims))
    kept = tuple(NONE if d in dims else a for d, a in enumerate(lay.dims))
    return Layout(kept, lay.opaque | lost)


def _broadcast(parts: list[tuple[Any, Layout]], shape: tuple[int, ...]) -> Layout:
    """The layout of the broadcast of ``parts`` to ``shape`` (aligned from the right): a dim
    holds what its operands hold there; operands holding different axes on one dim, or a dim of
    blocks broadcast (size 1 against more), make those axes opaque."""
    n = len(shape)
    dims = [NONE] * n
    opaque: set[str] = set()
    clashes: dict[int, set[str]] = {}  # dim -> the axes of operands holding different blocks
    for t, lay in parts:
        opaque.update(lay.opaque)
        off = n - len(lay.dims)
        for i, axes in enumerate(lay.dims):
            if not axes:
                continue
            j = off + i
            if j < 0 or (t.shape[i] == 1 and shape[j] != 1):
                opaque.update(axes)
            elif not dims[j]:
                dims[j] = axes
            elif dims[j] != axes:
                clashes.setdefault(j, set(dims[j])).update(axes)
    for j, clash in clashes.items():
        opaque.update(clash)
        dims[j] = NONE
    return Layout(tuple(dims), frozenset(opaque))


def _broadcast_shape(a: Sequence[int], b: Sequence[int]) -> tuple[int, ...]:
    """``torch.broadcast_shapes(a, b)`` of two shapes the op already accepted (a tenth of its
    cost: the rule runs on every matmul of a call with split inputs)."""
    n = max(len(a), len(b))
    a, b = [1] * (n - len(a)) + list(a), [1] * (n - len(b)) + list(b)
    return tuple(x if y == 1 else y for x, y in zip(a, b))


class _Shaped:
    """A shape standing for a tensor in :func:`_broadcast` (the batch dims of a matmul)."""

    def __init__(self, shape: Sequence[int]):
        self.shape = tuple(shape)

    def dim(self) -> int:
        return len(self.shape)
