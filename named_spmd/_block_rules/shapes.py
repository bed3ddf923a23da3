"""The rules of ops that keep or move dims: elementwise ops, casts, transposes and permutations,
reshapes, (un)squeezes, broadcasts, indexing and splits."""

from __future__ import annotations

import torch

from .layout import (
    NONE,
    Layout,
    Rule,
    _broadcast,
    _cut,
    _dropped,
    _first,
    _norm,
    _permuted,
    is_plain,
)


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


def _same(args, kwargs, layouts, out):  # clone, contiguous, detach, casts
    return _first(args, layouts)[1], NONE


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
