"""Gradients of sampled spmd_map programs (the named programs, with their dense references and
JAX's gradients, are in the catalogue tests/_programs.py and run by tests/test_programs.py).

The sampler draws random compositions of collectives and ops with random meshes and specs and
checks values, gradients and forward tangents against a per-instance reference in this file: a
Python loop over instances, collectives written from DESIGN.md section 3 with torch ops, and
torch autograd through the loops.
"""

from __future__ import annotations

import functools
import itertools
import math
import random

import pytest
import torch

import named_spmd as ns
from named_spmd import P

TOL = 1e-10
F64 = torch.float64


def _randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=F64)


def assert_close(got, want, what: str = "") -> None:
    if isinstance(got, (tuple, list)):
        assert len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close(g, w, f"{what}[{i}]")
        return
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err < TOL, f"{what}: max abs error {err:.3e}"


def grads(fn, args, diff: tuple[int, ...], cot_seed: int = 99):
    """Output and gradients of <fn(*args), cot> w.r.t. ``args[i]`` for i in diff."""
    args = [a.detach().requires_grad_(i in diff) for i, a in enumerate(args)]
    out = fn(*args)
    cot = _randn(*out.shape, seed=cot_seed)
    inputs = [args[i] for i in diff]
    # zeros for an input the output does not depend on (a ppermute with no pairs, say)
    return out.detach(), torch.autograd.grad((out * cot).sum(), inputs, materialize_grads=True)


def _sum(x, dim=None, keepdim=False):
    return x.sum() if dim is None else x.sum(dim, keepdim=keepdim)


def _mean(x, dim=None, keepdim=False):
    return x.mean() if dim is None else x.mean(dim, keepdim=keepdim)


# --- sampler: random programs against a per-instance reference -----------------------------------

MESHES = [
    ((2,), ("a",)),
    ((4,), ("a",)),
    ((2, 2), ("a", "b")),
    ((3, 2), ("a", "b")),
    ((2, 1), ("a", "b")),
    ((2, 2, 2), ("a", "b", "c")),
]


class Ref:
    """Per-instance reference: a state is {coord tuple: local tensor}; collectives loop."""

    def __init__(self, sizes, names):
        self.sizes, self.names = dict(zip(names, sizes)), names
        self.coords = list(itertools.product(*(range(s) for s in sizes)))

    def _pos(self, axes):
        return [self.names.index(a) for a in axes]

    def group(self, c, axes):
        """The coords of c's group over ``axes``, row-major (first axis major)."""
        pos = self._pos(axes)
        out = []
        for values in itertools.product(*(range(self.sizes[a]) for a in axes)):
            g = list(c)
            for p, v in zip(pos, values):
                g[p] = v
            out.append(tuple(g))
        return out

    def index(self, c, axes):
        i = 0
        for a, p in zip(axes, self._pos(axes)):
            i = i * self.sizes[a] + c[p]
        return i

    # global <-> local
    def blocks(self, x, spec, c):
        for d in range(x.dim()):
            axes = spec.entry_axes(d)
            if axes:
                n = math.prod(self.sizes[a] for a in axes)
                x = x.chunk(n, d)[self.index(c, axes)]
        return x

    def assemble(self, state, spec):
        first = next(iter(state.values()))

        def build(d, c):
            if d == first.dim():
                return state[tuple(c)]
            axes = spec.entry_axes(d)
            parts = []
            for values in itertools.product(*(range(self.sizes[a]) for a in axes)):
                cc = list(c)
                for a, v in zip(axes, values):
                    cc[self.names.index(a)] = v
                parts.append(build(d + 1, cc))
            return torch.cat(parts, d)

        base = [0] * len(self.names)  # unnamed axes: the copy at coordinate 0
        return build(0, base)

    # collectives, each from its definition
    def each(self, state, fn):
        return {c: fn(c, state) for c in self.coords}

    def psum(self, s, axes):
        return self.each(s, lambda c, s: sum(s[g] for g in self.group(c, axes)))

    def pmean(self, s, axes):
        n = math.prod(self.sizes[a] for a in axes)
        return {c: v / n for c, v in self.psum(s, axes).items()}

    def pmax(self, s, axes):
        return self.each(s, lambda c, s: torch.stack([s[g] for g in self.group(c, axes)]).amax(0))

    def pmin(self, s, axes):
        return self.each(s, lambda c, s: torch.stack([s[g] for g in self.group(c, axes)]).amin(0))

    def all_gather(self, s, axes, axis, tiled):
        join = torch.cat if tiled else torch.stack
        return self.each(s, lambda c, s: join([s[g] for g in self.group(c, axes)], axis))

    def psum_scatter(self, s, axes, dim, tiled):
        n = math.prod(self.sizes[a] for a in axes)

        def one(c, s):
            total = sum(s[g] for g in self.group(c, axes))
            i = self.index(c, axes)
            return total.chunk(n, dim)[i] if tiled else total.select(dim, i)

        return self.each(s, one)

    def all_to_all(self, s, axes, split, concat, tiled):
        n = math.prod(self.sizes[a] for a in axes)

        def one(c, s):
            j = self.index(c, axes)
            if tiled:
                return torch.cat([s[g].chunk(n, split)[j] for g in self.group(c, axes)], concat)
            return torch.stack([s[g].select(split, j) for g in self.group(c, axes)], concat)

        return self.each(s, one)

    def ppermute(self, s, axes, pairs):
        source = {dst: src for src, dst in pairs}

        def one(c, s):
            i = self.index(c, axes)
            if i not in source:
                return torch.zeros_like(s[c])
            return s[self.group(c, axes)[source[i]]]

        return self.each(s, one)


def _local_shape_ok(shape):
    return len(shape) <= 4 and math.prod(shape) <= 96


class Sampler:
    """Draws one random program: ops with their named_spmd and reference implementations."""

    def __init__(self, seed):
        self.rng = random.Random(seed)
        self.sizes, self.names = self.rng.choice(MESHES)
        self.mesh = dict(zip(self.names, self.sizes))

    def n(self, axes):
        return math.prod(self.mesh[a] for a in axes)

    def axes(self, pool, allow_empty=False):
        pool = sorted(pool)  # sets iterate in a per-process order: sort for reproducible seeds
        self.rng.shuffle(pool)
        k = self.rng.randint(0 if allow_empty else 1, len(pool)) if pool else 0
        return tuple(pool[:k])

    def spec(self, rank):
        entries = [[] for _ in range(rank)]
        for a in self.names:
            d = self.rng.randrange(rank + 1)  # rank means "not named"
            if d < rank:
                entries[d].append(a)
        return P(*[None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries])

    def inputs(self):
        rank = self.rng.randint(1, 3)
        local = [self.rng.choice((2, 3, 4, 6)) for _ in range(rank)]
        xspec = self.spec(rank)
        xshape = [s * self.n(xspec.entry_axes(d)) for d, s in enumerate(local)]
        wspec = self.spec(1) if self.rng.random() < 0.5 else P()
        wlocal = self.rng.choice((2, 3))
        wshape = [wlocal * self.n(wspec.entry_axes(0))]
        seed = self.rng.randrange(1 << 30)
        x, w = _randn(*xshape, seed=seed), _randn(*wshape, seed=seed + 1)
        return (x, xspec, local, set(xspec.axes)), (w, wspec, set(wspec.axes))

    def program(self, n_ops):
        (x, xspec, shape, vma), (w, wspec, wvma) = self.inputs()
        ops = []
        for _ in range(n_ops):
            op = self.op(shape, vma, wvma)
            if op is None:
                continue
            name, fn, ref, shape, vma = op
            ops.append((name, fn, ref))
        if not any(name == "mix_w" for name, _, _ in ops):  # every input gets a gradient
            name, fn, ref, shape, vma = self.op(shape, vma, wvma, kind="mix_w")
            ops.append((name, fn, ref))
        if not shape:
            ops.append(("reshape1", lambda t, w: t.reshape(1), _local(lambda t: t.reshape(1))))
            shape = [1]
        extra = tuple(a for a in self.names if a not in vma and self.rng.random() < 0.3)
        named = [a for a in self.names if a in vma or a in extra]
        self.rng.shuffle(named)
        out_spec = P(tuple(named)) if named else P()
        return (x, w), (xspec, wspec), out_spec, ops

    def op(self, shape, vma, wvma, kind=None):
        r, names = self.rng, self.names
        kind = kind or r.choice(
            "unary mix_w axis_index psum pmean pmax pmin all_gather psum_scatter all_to_all "
            "ppermute pshuffle pvary reshape sum_dim".split()
        )
        rank = len(shape)
        if kind == "unary":
            f = r.choice((torch.tanh, torch.sin, lambda t: t * t * 0.5))
            return "unary", lambda t, w: f(t), _local(f), shape, vma
        if kind == "mix_w":
            f = lambda t, w: t * (1 + 0.3 * torch.tanh(w).sum())  # noqa: E731
            return "mix_w", f, _with_w(f), shape, vma | wvma
        if kind == "axis_index":
            axes = self.axes(names)
            f = lambda t, i: t * (1 + 0.5 * i.to(t.dtype))  # noqa: E731
            return (
                f"axis_index{axes}",
                lambda t, w: f(t, ns.axis_index(axes)),
                lambda ref, s, w: {c: f(s[c], torch.tensor(ref.index(c, axes))) for c in s},
                shape,
                vma | set(axes),
            )
        if kind == "psum" and vma:
            axes = self.axes(vma)
            return (
                f"psum{axes}",
                lambda t, w: ns.psum(t, axes),
                lambda ref, s, w: ref.psum(s, axes),
                shape,
                vma - set(axes),
            )
        if kind in ("pmean", "pmax", "pmin"):
            axes = self.axes(names)
            varying = tuple(a for a in axes if a in vma)
            spmd = getattr(ns, kind)
            return (
                f"{kind}{axes}",
                lambda t, w: spmd(t, axes),
                lambda ref, s, w: getattr(ref, kind)(s, varying) if varying else s,
                shape,
                vma - set(axes),
            )
        if kind == "all_gather":
            axes = self.axes(names)
            tiled = rank > 0 and r.random() < 0.5
            axis = r.randrange(rank if tiled else rank + 1)
            to = r.choice(("varying", "invariant"))
            new = list(shape)
            if tiled:
                new[axis] *= self.n(axes)
            else:
                new.insert(axis, self.n(axes))
            if not _local_shape_ok(new):
                return None
            new_vma = (vma | set(axes)) if to == "varying" else (vma - set(axes))
            return (
                f"all_gather{axes},axis={axis},tiled={tiled},to={to}",
                lambda t, w: ns.all_gather(t, axes, axis=axis, tiled=tiled, to=to),
                lambda ref, s, w: ref.all_gather(s, axes, axis, tiled),
                new,
                new_vma,
            )
        if kind == "psum_scatter" and vma:
            axes = self.axes(vma)
            n = self.n(axes)
            tiled = r.random() < 0.5
            dims = [d for d in range(rank) if (shape[d] % n == 0 if tiled else shape[d] == n)]
            if not dims:
                return None
            d = r.choice(dims)
            new = list(shape)
            if tiled:
                new[d] //= n
            else:
                del new[d]
            return (
                f"psum_scatter{axes},dim={d},tiled={tiled}",
                lambda t, w: ns.psum_scatter(t, axes, scatter_dimension=d, tiled=tiled),
                lambda ref, s, w: ref.psum_scatter(s, axes, d, tiled),
                new,
                vma | set(axes),
            )
        if kind == "all_to_all" and rank > 0:
            axes = self.axes(names)
            n = self.n(axes)
            tiled = r.random() < 0.5
            dims = [d for d in range(rank) if (shape[d] % n == 0 if tiled else shape[d] == n)]
            if not dims:
                return None
            split, concat = r.choice(dims), r.randrange(rank)
            new = list(shape)
            if tiled:
                new[split] //= n
                new[concat] *= n
            else:
                del new[split]
                new.insert(concat, n)
            return (
                f"all_to_all{axes},{split},{concat},tiled={tiled}",
                lambda t, w: ns.all_to_all(t, axes, split, concat, tiled=tiled),
                lambda ref, s, w: ref.all_to_all(s, axes, split, concat, tiled),
                new,
                vma | set(axes),
            )
        if kind in ("ppermute", "pshuffle"):
            axes = self.axes(names)
            n = self.n(axes)
            dst = list(range(n))
            r.shuffle(dst)
            if kind == "pshuffle":
                return (
                    f"pshuffle{axes},{dst}",
                    lambda t, w: ns.pshuffle(t, axes, dst),
                    lambda ref, s, w: ref.ppermute(
                        s, axes, [(src, i) for i, src in enumerate(dst)]
                    ),
                    shape,
                    vma | set(axes),
                )
            pairs = [(i, dst[i]) for i in range(n) if r.random() < 0.8]
            return (
                f"ppermute{axes},{pairs}",
                lambda t, w: ns.ppermute(t, axes, pairs),
                lambda ref, s, w: ref.ppermute(s, axes, pairs),
                shape,
                vma | set(axes),
            )
        if kind == "pvary" and set(names) - vma:
            axes = self.axes(set(names) - vma)
            return (
                f"pvary{axes}",
                lambda t, w: ns.pvary(t, axes),
                lambda ref, s, w: s,
                shape,
                vma | set(axes),
            )
        if kind == "reshape" and rank > 0:
            numel = math.prod(shape)
            options = [(numel,)] + [(k, numel // k) for k in (2, 3, 4) if numel % k == 0]
            new = list(r.choice(options))
            f = lambda t: t.reshape(new)  # noqa: E731
            return f"reshape{new}", lambda t, w: f(t), _local(f), new, vma
        if kind == "sum_dim" and rank > 1:
            d = r.randrange(rank)
            f = lambda t: t.sum(d)  # noqa: E731
            return f"sum{d}", lambda t, w: f(t), _local(f), shape[:d] + shape[d + 1 :], vma
        return None


def _local(f):
    return lambda ref, s, w: {c: f(t) for c, t in s.items()}


def _with_w(f):
    return lambda ref, s, w: {c: f(t, w[c]) for c, t in s.items()}


def run_sampled(ops, sizes, names, specs, out_spec, x, w):
    mesh = ns.make_mesh(sizes, names)

    def body(t, w):
        for _, fn, _ in ops:
            t = fn(t, w)
        return t

    return ns.spmd_map(body, mesh=mesh, in_specs=specs, out_specs=out_spec)(x, w)


def run_reference(ops, sizes, names, specs, out_spec, x, w):
    ref = Ref(sizes, names)
    s = {c: ref.blocks(x, specs[0], c) for c in ref.coords}
    ws = {c: ref.blocks(w, specs[1], c) for c in ref.coords}
    for _, _, fn in ops:
        s = fn(ref, s, ws)
    return ref.assemble(s, out_spec)


N_SAMPLED = 120


@pytest.mark.parametrize("seed", range(N_SAMPLED))
def test_sampled_program_gradients_equal_per_instance_reference(seed):
    sampler = Sampler(seed)
    (x, w), specs, out_spec, ops = sampler.program(sampler.rng.randint(2, 6))
    where = (
        f"seed {seed}: mesh {sampler.mesh}, specs {specs} -> {out_spec}, ops {[o[0] for o in ops]}"
    )
    args = (sampler.sizes, sampler.names, specs, out_spec)
    spmd = functools.partial(run_sampled, ops, *args)
    ref = functools.partial(run_reference, ops, *args)
    out, got = grads(spmd, (x, w), (0, 1), cot_seed=seed)
    want_out, want = grads(ref, (x, w), (0, 1), cot_seed=seed)
    assert_close(out, want_out, "value " + where)
    assert_close(got, want, "gradients " + where)
    # forward-mode agrees too (torch.func.jvp through the simulation)
    tangents = (_randn(*x.shape, seed=seed + 7), _randn(*w.shape, seed=seed + 8))
    _, jvp_got = torch.func.jvp(spmd, (x, w), tangents)
    _, jvp_want = torch.func.jvp(ref, (x, w), tangents)
    assert_close(jvp_got, jvp_want, "jvp " + where)


def test_sampler_covers_every_collective():
    seen = set()
    for seed in range(N_SAMPLED):
        sampler = Sampler(seed)
        _, _, _, ops = sampler.program(sampler.rng.randint(2, 6))
        seen |= {name.split("(")[0].split("[")[0] for name, _, _ in ops}
    expected = "psum pmean pmax pmin all_gather psum_scatter all_to_all ppermute pshuffle pvary"
    expected += " axis_index"
    assert set(expected.split()) <= seen, sorted(seen)
