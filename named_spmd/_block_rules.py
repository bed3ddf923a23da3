"""The rules of ``_blocks``: how each torch op moves the blocks its operands' dims hold
(docs/design.md section 8, "Inference from the specs").

A rule takes the op's ``args``, ``kwargs``, a function giving an operand's layout and the op's
result, and returns the result's layout (a list, one per output, for ops returning several) and
the axes over which the op's contraction makes the result unreduced, or None where it does not
follow the op (the result then gets no record: opaque over what it varies over). One rule per
family of ops, looked up by the op's name in :data:`RULES`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

NONE: frozenset[str] = frozenset()


class Layout(NamedTuple):
    dims: tuple[frozenset[str], ...]  # per dim: the axes whose blocks it holds
    opaque: frozenset[str]  # axes the value varies over for reasons the dims do not say


# ids of the layouts of tensors without a record that are plain (invariant: no blocks, nothing
# opaque); ``_blocks`` fills it, the elementwise rule's fast path reads it
PLAIN: set[int] = set()


def is_plain(lay: Layout) -> bool:
    """Whether ``lay`` holds no blocks and nothing opaque (eagerly: by identity, a hot path)."""
    if torch.compiler.is_compiling():  # no global set: Dynamo would guard on its length
        return not lay.opaque and not any(lay.dims)
    return id(lay) in PLAIN


# --- the rules: (args, kwargs, layout of an operand, out) -> (layout(s), unreduced axes) or None

Rule = Callable[[tuple, dict, Callable[[torch.Tensor], "Layout"], Any], Any]


def _first(args, layouts) -> tuple[torch.Tensor, Layout]:
    t = args[0]
    return t, layouts(t)


def _elementwise(args, kwargs, layouts, out):
    if not isinstance(out, torch.Tensor):
        return None
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    shape = out.shape
    main = None  # the common case: one layout of the result's shape, the others plain
    for t in tensors:
        lay = layouts(t)
        if is_plain(lay) or (lay is main and t.shape == shape):
            continue
        if main is None and t.shape == shape:
            main = lay
            continue
        return _broadcast([(t, layouts(t)) for t in tensors], tuple(shape)), NONE
    if main is None:
        return None  # no operand holds blocks (nothing to record)
    return main, NONE


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


def _same(args, kwargs, layouts, out):  # clone, contiguous, detach, casts
    return _first(args, layouts)[1], NONE


def _permuted(lay: Layout, perm: Sequence[int]) -> Layout:
    return Layout(tuple(lay.dims[p] for p in perm), lay.opaque)


def _norm(d: int, n: int) -> int:
    if not -max(n, 1) <= d < max(n, 1):
        raise IndexError(d)
    return d % n if n else 0


def _transpose(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    n = t.dim()
    d0 = _norm(args[1] if len(args) > 1 else kwargs["dim0"], n)
    d1 = _norm(args[2] if len(args) > 2 else kwargs["dim1"], n)
    perm = list(range(n))
    perm[d0], perm[d1] = perm[d1], perm[d0]
    return _permuted(lay, perm), NONE


def _t(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    return (lay if t.dim() < 2 else _permuted(lay, [1, 0])), NONE


def _reverse(args, kwargs, layouts, out):  # x.T
    t, lay = _first(args, layouts)
    return _permuted(lay, list(reversed(range(t.dim())))), NONE


def _last_two(args, kwargs, layouts, out):  # x.mT, x.mH
    t, lay = _first(args, layouts)
    n = t.dim()
    return _permuted(lay, [*range(n - 2), n - 1, n - 2]), NONE


def _permute(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    dims = args[1:] if len(args) > 1 else kwargs["dims"]
    if len(dims) == 1 and isinstance(dims[0], (list, tuple)):
        dims = dims[0]
    return _permuted(lay, [_norm(d, t.dim()) for d in dims]), NONE


def _movedim(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    n = t.dim()
    src = args[1] if len(args) > 1 else kwargs["source"]
    dst = args[2] if len(args) > 2 else kwargs["destination"]
    src = [_norm(d, n) for d in ([src] if isinstance(src, int) else src)]
    dst = [_norm(d, n) for d in ([dst] if isinstance(dst, int) else dst)]
    rest = iter(d for d in range(n) if d not in src)
    perm: list[int | None] = [None] * n
    for s, d in zip(src, dst):
        perm[d] = s
    return _permuted(lay, [p if p is not None else next(rest) for p in perm]), NONE


def _reshaped(args, kwargs, layouts, out):
    """view / reshape / flatten / unflatten / view_as / reshape_as, from the shapes: dims that
    merge keep the axes their parts held; a dim that splits gives them to its major (first)
    factor, as the global tensor reshaped the same way would; regroupings of several dims
    into several others make them opaque."""
    t, lay = _first(args, layouts)
    if not isinstance(out, torch.Tensor):
        return None
    src, dst = tuple(t.shape), tuple(out.shape)
    dims: list[frozenset[str]] = [NONE] * len(dst)
    opaque = set(lay.opaque)
    i = j = 0
    while i < len(src) or j < len(dst):
        gi, gj, pi, pj = [], [], 1, 1
        if i < len(src):
            gi.append(i)
            pi, i = src[i], i + 1
        if j < len(dst):
            gj.append(j)
            pj, j = dst[j], j + 1
        while pi != pj:
            if pi < pj and i < len(src):
                gi.append(i)
                pi, i = pi * src[i], i + 1
            elif pj < pi and j < len(dst):
                gj.append(j)
                pj, j = pj * dst[j], j + 1
            else:
                return None
        held = frozenset().union(*(lay.dims[k] for k in gi))
        if not held:
            continue
        if not gj or (len(gi) > 1 and len(gj) > 1):
            opaque |= held
        else:
            dims[gj[0]] = held
    return Layout(tuple(dims), frozenset(opaque)), NONE


def _unsqueeze(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    d = _norm(args[1] if len(args) > 1 else kwargs["dim"], t.dim() + 1)
    return Layout(lay.dims[:d] + (NONE,) + lay.dims[d:], lay.opaque), NONE


def _squeeze(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    dim = args[1] if len(args) > 1 else kwargs.get("dim")
    n = t.dim()
    if dim is None:
        gone = {d for d in range(n) if t.shape[d] == 1}
    else:
        asked = [dim] if isinstance(dim, int) else dim
        gone = {_norm(d, n) for d in asked if t.shape[_norm(d, n)] == 1}
    return _dropped(lay, gone), NONE


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


def _expand(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    if not isinstance(out, torch.Tensor):
        return None
    return _broadcast([(t, lay)], tuple(out.shape)), NONE


def _repeat(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    reps = args[1:] if len(args) > 1 else kwargs["repeats"]
    if len(reps) == 1 and isinstance(reps[0], (list, tuple)):
        reps = reps[0]
    extra = len(reps) - t.dim()
    cut = {d for d in range(t.dim()) if reps[extra + d] != 1}
    lay = _cut(lay, cut)
    return Layout((NONE,) * extra + lay.dims, lay.opaque), NONE


def _getitem(args, kwargs, layouts, out):
    t, lay = _first(args, layouts)
    index = args[1] if isinstance(args[1], tuple) else (args[1],)
    if any(not isinstance(e, (int, slice, type(None), type(Ellipsis))) for e in index):
        return None  # tensor, list or bool indices: not followed
    if isinstance(index[0], bool):
        return None
    used = sum(1 for e in index if e is not None and e is not Ellipsis)
    dims: list[frozenset[str]] = []
    opaque = set(lay.opaque)
    d = 0
    for e in index:
        if e is Ellipsis:
            for _ in range(t.dim() - used):
                dims.append(lay.dims[d])
                d += 1
        elif e is None:
            dims.append(NONE)
        elif isinstance(e, int):
            opaque |= lay.dims[d]
            d += 1
        else:
            whole = (
                e.step in (None, 1)
                and e.start in (None, 0)
                and (e.stop is None or e.stop >= t.shape[d])
            )
            if whole:
                dims.append(lay.dims[d])
            else:
                opaque |= lay.dims[d]
                dims.append(NONE)
            d += 1
    dims.extend(lay.dims[d:])
    return Layout(tuple(dims), frozenset(opaque)), NONE


def _select(args, kwargs, layouts, out):  # select(dim, i), unbind(dim)
    t, lay = _first(args, layouts)
    dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
    new = _dropped(lay, {_norm(dim, t.dim())})
    return (new if isinstance(out, torch.Tensor) else [new] * len(out)), NONE


def _pieces(dim_pos: int, default: int = 0) -> Rule:
    """narrow / chunk / split / tensor_split along one dim: each piece is part of a block."""

    def rule(args, kwargs, layouts, out):
        t, lay = _first(args, layouts)
        dim = args[dim_pos] if len(args) > dim_pos else kwargs.get("dim", default)
        pieces = [out] if isinstance(out, torch.Tensor) else list(out)
        d = _norm(dim, t.dim())
        cut = any(p.shape[d] != t.shape[d] for p in pieces)
        new = _cut(lay, {d}) if cut else lay
        return (new if isinstance(out, torch.Tensor) else [new] * len(pieces)), NONE

    return rule


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
    lay = _broadcast([(_Shaped(out.shape), lay), (added, layouts(added))], tuple(out.shape))
    return lay, unreduced


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
    if "->" not in equation or "." in equation:
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


_ELEMENTWISE = (
    "add sub mul div true_divide divide multiply subtract rsub pow neg negative positive exp "
    "exp2 expm1 log log1p log2 log10 sin cos tan tanh sinh cosh asin acos atan atan2 sigmoid "
    "logsigmoid relu relu6 gelu silu mish elu selu celu leaky_relu hardtanh hardswish "
    "hardsigmoid softplus abs sqrt rsqrt square reciprocal sign where clamp clip clamp_min "
    "clamp_max maximum minimum fmax fmin lerp addcmul addcdiv erf erfc masked_fill dropout "
    "nan_to_num floor ceil round trunc frac hypot copysign remainder fmod floor_divide "
    "logical_not logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor "
    "bitwise_not eq ne lt le gt ge isnan isinf isfinite zeros_like ones_like full_like "
    "empty_like sinc logit xlogy __add__ __radd__ __iadd__ __sub__ __rsub__ __isub__ __mul__ "
    "__rmul__ __imul__ __truediv__ __rtruediv__ __itruediv__ __pow__ __rpow__ __ipow__ __neg__ "
    "__pos__ __abs__ __and__ __or__ __xor__ __invert__ __eq__ __ne__ __lt__ __le__ __gt__ "
    "__ge__ __mod__ __floordiv__ __rfloordiv__"
).split()
_SAME = (
    "clone contiguous detach to type float double half bfloat16 cpu cuda requires_grad real "
    "imag conj"
).split()

RULES: dict[str, Rule] = {
    **dict.fromkeys(_ELEMENTWISE, _elementwise),
    **dict.fromkeys(_SAME, _same),
    **dict.fromkeys(("transpose", "swapaxes", "swapdims"), _transpose),
    "t": _t,
    "T": _reverse,
    "H": _reverse,
    "mT": _last_two,
    "mH": _last_two,
    "permute": _permute,
    **dict.fromkeys(("movedim", "moveaxis"), _movedim),
    **dict.fromkeys(
        ("view", "reshape", "view_as", "reshape_as", "flatten", "unflatten"), _reshaped
    ),
    "unsqueeze": _unsqueeze,
    "squeeze": _squeeze,
    **dict.fromkeys(("expand", "expand_as", "broadcast_to"), _expand),
    "repeat": _repeat,
    "__getitem__": _getitem,
    **dict.fromkeys(("select", "unbind"), _select),
    "narrow": _pieces(1),
    **dict.fromkeys(("chunk", "split", "tensor_split"), _pieces(2)),
    **dict.fromkeys(
        "sum nansum mean nanmean amax amin max min prod logsumexp all any".split(), _reduction
    ),
    **dict.fromkeys(("softmax", "log_softmax", "cumsum", "cumprod"), _along_dim),
    **dict.fromkeys(("matmul", "__matmul__", "mm", "bmm", "mv"), _matmul),
    "__rmatmul__": _rmatmul,
    "linear": _linear,
    **dict.fromkeys(("addmm", "baddbmm", "addmv", "addbmm"), _addmm),
    **dict.fromkeys(("dot", "vdot", "inner"), _dot),
    "einsum": _einsum,
    "scaled_dot_product_attention": _attention,
}
