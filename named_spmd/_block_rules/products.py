"""The rules of ops that reduce or contract dims: reductions, per-slice ops (softmax), matrix
products, einsum and attention. Only a product of two operands split alike over a contracted
dim makes a partial sum (unreduced)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .layout import (
    NONE,
    Layout,
    _broadcast,
    _broadcast_shape,
    _cut,
    _first,
    _norm,
    _Shaped,
    is_plain,
)
from .shapes import _elementwise


def _reduced_dims(args, kwargs, n: int) -> tuple[set[int], bool]:
    dim = args[1] if len(args) > 1 and not isinstance(args[1], torch.dtype) else kwargs.get("dim")
    keep = args[2] if len(args) > 2 and isinstance(args[2], bool) else kwargs.get("keepdim", False)
    if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0):
        return set(range(n)), bool(keep)
    dims = [dim] if isinstance(dim, int) else dim
    return {_norm(d, n) for d in dims}, bool(keep)


def _reduction(args, kwargs, layouts, out):
    """A reduction of one operand over tensor dims (sum, mean, amax, ...): what the reduced dims
    held becomes opaque. A sum over a dim of blocks is a partial sum only if the program means
    the global sum; as often it is a local statistic taken as a local value (a data-parallel
    loss over its batch block, a token count, JAX programs' local sums), so it is not inferred:
    only a product of two operands split alike is (:func:`_contract`)."""
    t, lay = _first(args, layouts)
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        return _elementwise(args, kwargs, layouts, out)  # torch.max(a, b): elementwise
    gone, keep = _reduced_dims(args, kwargs, t.dim())
    lost = frozenset().union(*(lay.dims[d] for d in gone))
    kept = tuple(NONE if d in gone else a for d, a in enumerate(lay.dims) if keep or d not in gone)
    new = Layout(kept, lay.opaque | lost)
    return (new if isinstance(out, torch.Tensor) else [new] * len(out)), NONE


def _along_dim(args, kwargs, layouts, out):  # softmax, log_softmax, cumsum: per slice of dim
    t, lay = _first(args, layouts)
    dim = args[1] if len(args) > 1 else kwargs["dim"]
    return _cut(lay, {_norm(dim, t.dim())}), NONE


def _contract(
    a_dims: Sequence[frozenset[str]],
    b_dims: Sequence[frozenset[str]],
    opaque: frozenset[str],
    out_dims: Sequence[frozenset[str]],
) -> tuple[Layout, frozenset[str]]:
    """The layout of a product contracting dim ``a_dims[i]`` with ``b_dims[i]`` for each i."""
    both = NONE
    one_sided: set[str] = set()
    for ka, kb in zip(a_dims, b_dims):
        both |= ka & kb
        one_sided |= ka ^ kb
    opaque = opaque | one_sided
    still = frozenset().union(*out_dims)
    unreduced = both - still - opaque
    return Layout(tuple(out_dims), opaque | (both - unreduced)), unreduced


def _matmul_layout(a: torch.Tensor, la: Layout, b: torch.Tensor, lb: Layout):
    ad, bd = list(la.dims), list(lb.dims)
    a_shape, b_shape = list(a.shape), list(b.shape)
    if a.dim() == 1:
        ad, a_shape = [NONE, *ad], [1, *a_shape]
    if b.dim() == 1:
        bd, b_shape = [*bd, NONE], [*b_shape, 1]
    batch_shape = _broadcast_shape(a_shape[:-2], b_shape[:-2])
    batch = _broadcast(
        [
            (_Shaped(a_shape[:-2]), Layout(tuple(ad[:-2]), NONE)),
            (_Shaped(b_shape[:-2]), Layout(tuple(bd[:-2]), NONE)),
        ],
        batch_shape,
    )
    out_dims = list(batch.dims)
    if a.dim() > 1:
        out_dims.append(ad[-2])
    if b.dim() > 1:
        out_dims.append(bd[-1])
    return _contract([ad[-1]], [bd[-2]], la.opaque | lb.opaque | batch.opaque, out_dims)


def _matmul(args, kwargs, layouts, out):
    a, b = args[0], args[1] if len(args) > 1 else kwargs["other"]
    return _matmul_layout(a, layouts(a), b, layouts(b))


def _rmatmul(args, kwargs, layouts, out):  # b.__rmatmul__(a) is a @ b
    return _matmul((args[1], args[0]), kwargs, layouts, out)


def _linear(args, kwargs, layouts, out):  # x @ w.T (+ bias); w is 2-d (or 1-d)
    x, w = args[0], args[1] if len(args) > 1 else kwargs["weight"]
    lx, lw = layouts(x), layouts(w)
    # the result's dims: x's leading ones, then w's output dim (none for a 1-d w)
    kept = lx.dims[:-1] + lw.dims[:-1]
    lay, unreduced = _contract([lx.dims[-1]], [lw.dims[-1]], lx.opaque | lw.opaque, kept)
    added = bias("linear", args, kwargs)
    if added is not None:
        lb = layouts(added)
        if not is_plain(lb):  # a plain bias changes nothing (a hot path: every F.linear)
            lay = _add_bias(lay, added, lb, tuple(out.shape))
    return lay, unreduced


def _add_bias(lay: Layout, bias: torch.Tensor, lb: Layout, shape: tuple[int, ...]) -> Layout:
    """``_broadcast`` of a product's layout and its bias's; for the usual 1-d bias over the
    last dim (a column-parallel one holds the blocks the product's last dim holds) without
    building the sets."""
    last, held = lay.dims[-1] if lay.dims else NONE, lb.dims[0] if lb.dims else NONE
    if bias.dim() == 1 and shape and bias.shape[0] == shape[-1] and held in (NONE, last):
        return Layout(lay.dims, lay.opaque | lb.opaque)
    return _broadcast([(_Shaped(shape), lay), (bias, lb)], shape)


def _addmm(args, kwargs, layouts, out):  # bias + a @ b (addmm, baddbmm, addmv, addbmm)
    added, a, b = args[0], args[1], args[2]
    lay, unreduced = _matmul_layout(a, layouts(a), b, layouts(b))
    return _add_bias(lay, added, layouts(added), tuple(out.shape)), unreduced


def _dot(args, kwargs, layouts, out):  # dot, vdot, inner of 1-d tensors
    a, b = args[0], args[1]
    if a.dim() != 1 or b.dim() != 1:
        return None
    la, lb = layouts(a), layouts(b)
    return _contract(la.dims, lb.dims, la.opaque | lb.opaque, ())


def _einsum(args, kwargs, layouts, out):
    equation, *ops = args
    if len(ops) == 1 and isinstance(ops[0], (list, tuple)):
        ops = list(ops[0])
    equation = equation.replace(" ", "")
    if "->" not in equation:  # implicit: the letters given once, in order (uppercase first)
        letters = equation.replace(",", "")
        equation += "->" + "".join(sorted(c for c in set(letters) if letters.count(c) == 1))
    if "." in equation:
        return None
    lhs, rhs = equation.split("->")
    terms = lhs.split(",")
    if len(terms) != len(ops) or any(len(set(s)) != len(s) for s in terms):
        return None  # a diagonal (a letter twice in one operand): not followed
    opaque = frozenset().union(*(layouts(t).opaque for t in ops))
    by_letter: dict[str, list[frozenset[str]]] = {}
    for term, t in zip(terms, ops):
        for letter, axes in zip(term, layouts(t).dims):
            by_letter.setdefault(letter, []).append(axes)
    out_dims: list[frozenset[str]] = []
    extra: set[str] = set()
    for letter in rhs:
        kinds = set(by_letter.get(letter, [])) - {NONE}
        if len(kinds) > 1:
            extra |= frozenset().union(*kinds)
        out_dims.append(next(iter(kinds)) if len(kinds) == 1 else NONE)
    both: frozenset[str] = NONE
    one_sided: set[str] = set()
    for letter, held in by_letter.items():
        if letter not in rhs:  # contracted; by one operand alone, a sum (not inferred)
            common = frozenset.intersection(*held) if len(held) > 1 else NONE
            both |= common
            one_sided |= frozenset().union(*held) - common
    opaque = opaque | frozenset(extra) | frozenset(one_sided)
    still = frozenset().union(*out_dims)
    unreduced = both - still - opaque
    return Layout(tuple(out_dims), opaque | (both - unreduced)), unreduced


def _attention(args, kwargs, layouts, out):
    """``F.scaled_dot_product_attention(q, k, v)``: per batch and head dims (broadcast), the
    query dim of q and the value dim of v; what the contracted dims held becomes opaque (a block
    of keys is no block of the attention)."""
    q, k, v = (
        args[i] if len(args) > i else kwargs[n] for i, n in enumerate(("query", "key", "value"))
    )
    mask = args[3] if len(args) > 3 else kwargs.get("attn_mask")
    lq, lk, lv = layouts(q), layouts(k), layouts(v)
    shape = tuple(out.shape[:-2])
    if (
        lq.dims[:-2] == lk.dims[:-2] == lv.dims[:-2]
        and q.shape[:-2] == k.shape[:-2] == v.shape[:-2] == shape
    ):
        # the usual case (no broadcast of the batch and head dims): what _broadcast gives
        batch = Layout(lq.dims[:-2], lq.opaque | lk.opaque | lv.opaque)
    else:
        parts = [
            (_Shaped(t.shape[:-2]), Layout(lay.dims[:-2], lay.opaque))
            for t, lay in ((q, lq), (k, lk), (v, lv))
        ]
        batch = _broadcast(parts, shape)
    contracted = lq.dims[-1] | lk.dims[-1] | lk.dims[-2] | lv.dims[-2]
    opaque = batch.opaque | contracted
    if isinstance(mask, torch.Tensor):
        lm = layouts(mask)
        opaque |= lm.opaque | frozenset().union(*lm.dims)
    return Layout((*batch.dims, lq.dims[-2], lv.dims[-1]), opaque), NONE


WITH_BIAS = frozenset({"linear", "addmm", "baddbmm", "addmv", "addbmm"})


def bias(name: str, args: tuple, kwargs: dict) -> torch.Tensor | None:
    if name == "linear":
        bias = args[2] if len(args) > 2 else kwargs.get("bias")
    else:
        bias = args[0] if args else kwargs.get("input")
    return bias if isinstance(bias, torch.Tensor) else None
