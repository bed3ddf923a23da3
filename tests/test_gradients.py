"""Gradients of spmd_map programs: dense float64 references, JAX's shard_map, a sampler.

Each named program is written once against a namespace ``o`` (collectives plus the few array
helpers it needs) and runs on named_spmd and, where jax is installed, under ``jax.shard_map``; a
dense single-device program written independently is the reference. Gradients are taken with
respect to every floating global input for a random output cotangent; max abs error < 1e-10.

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
import types

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


TORCH_OPS = types.SimpleNamespace(
    **{k: getattr(ns, k) for k in "psum pmean pmax pmin all_gather psum_scatter".split()},
    **{k: getattr(ns, k) for k in "all_to_all ppermute axis_index axis_size pvary".split()},
    pbroadcast=ns.pbroadcast,
    tanh=torch.tanh,
    exp=torch.exp,
    log=torch.log,
    rsqrt=torch.rsqrt,
    sum=_sum,
    mean=_mean,
    amax=lambda x, dim: x.amax(dim),
    amin=lambda x, dim: x.amin(dim),
    softmax=lambda x, dim: torch.softmax(x, dim),
    where=torch.where,
    clip=lambda x, lo, hi: x.clamp(lo, hi),
    rows=lambda x, idx: x[torch.tensor(idx)],
    pick=lambda x, idx: x.gather(-1, idx[..., None])[..., 0],
    onehot=lambda i, n, like: (torch.arange(n) == i).to(like.dtype),
    take=lambda x, i: x.index_select(0, i.reshape(1))[0],
    const=lambda v: torch.tensor(v),
    sg=lambda x: x,  # named_spmd's pmax is differentiable; no stop_gradient needed
)


# --- the programs ------------------------------------------------------------------------------


def dp_step(o, w1, b1, w2, x, y):
    """Data parallel: replicated parameters, sharded batch; w1 is used by two ops."""
    h = o.tanh(x @ w1 + b1)
    pred = (h @ w2)[..., 0] + 0.1 * o.sum(x @ w1, -1)
    return o.pmean(o.mean((pred - y) ** 2), "dp")


def dp_dense(w1, b1, w2, x, y):
    pred = (torch.tanh(x @ w1 + b1) @ w2)[:, 0] + 0.1 * (x @ w1).sum(-1)
    return ((pred - y) ** 2).mean()


def megatron(o, x, w1, b1, w2, b2):
    """Column-parallel then row-parallel MLP with biases: one psum over tp."""
    return o.psum(o.tanh(x @ w1 + b1) @ w2, "tp") + b2


def megatron_dense(x, w1, b1, w2, b2):
    return torch.tanh(x @ w1 + b1) @ w2 + b2


def seq_parallel(o, x, g, w1, w2):
    """Sequence-parallel block: RMSNorm on the sequence shard, gather it, column/row matmuls,
    reduce-scatter the partial sums back to the sequence shard, residual."""
    normed = x * o.rsqrt(o.mean(x * x, -1, keepdim=True) + 1e-6) * g
    full = o.all_gather(normed, "tp", axis=1, tiled=True)
    partial = o.tanh(full @ w1) @ w2
    return x + o.psum_scatter(partial, "tp", scatter_dimension=1, tiled=True)


def seq_parallel_dense(x, g, w1, w2):
    normed = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * g
    return x + torch.tanh(normed @ w1) @ w2


MOE_PERM = [5, 2, 7, 0, 3, 6, 1, 4]  # local token order after routing (8 tokens per instance)


def moe(o, x, wg, we, tiled):
    """Expert parallel: route each token to an expert, all_to_all there and back, gate."""
    n = o.axis_size("ep")
    t, d = x.shape
    inv = [MOE_PERM.index(i) for i in range(t)]
    dest = o.const([inv[i] // (t // n) for i in range(t)])  # the expert of each token
    routed = o.rows(x, MOE_PERM)  # chunk j of the rows goes to expert j
    if tiled:
        received = o.all_to_all(routed, "ep", 0, 0, tiled=True)  # chunk s from source s
        back = o.all_to_all(o.tanh(received @ we[0]), "ep", 0, 0, tiled=True)
    else:
        received = o.all_to_all(routed.reshape(n, t // n, d), "ep", 0, 0)
        back = o.all_to_all(o.tanh(received @ we[0]), "ep", 0, 0).reshape(t, d)
    gate = o.pick(o.softmax(x @ wg, -1), dest)
    return o.rows(back, inv) * gate[:, None]


def moe_dense(x, wg, we):
    t, n = len(MOE_PERM), we.shape[0]
    inv = [MOE_PERM.index(i) for i in range(t)]
    dest = torch.tensor([inv[i] // (t // n) for i in range(t)]).repeat(x.shape[0] // t)
    gate = torch.softmax(x @ wg, -1).gather(-1, dest[:, None])
    return torch.tanh(torch.einsum("td,tde->te", x, we[dest])) * gate


def ring_allreduce(o, x):
    """Chunked ring all-reduce from ppermute: reduce-scatter, then all-gather, n-1 steps each."""
    n, i = o.axis_size("r"), o.axis_index("r")
    ring = [(j, (j + 1) % n) for j in range(n)]
    chunks = x.reshape(n, -1)
    acc = o.take(chunks, i)
    for k in range(n - 1):
        acc = o.ppermute(acc, "r", ring) + o.take(chunks, (i - 1 - k) % n)
    idx = (i + 1) % n  # acc is now the full sum of chunk i + 1
    out = o.onehot(idx, n, x)[:, None] * acc[None]
    for _ in range(n - 1):
        acc, idx = o.ppermute(acc, "r", ring), (idx - 1) % n
        out = out + o.onehot(idx, n, x)[:, None] * acc[None]
    return out.reshape(-1)


def ring_allreduce_dense(x, n=4):
    return x.reshape(n, -1).sum(0).repeat(n)


def ring_pass(o, q, k, v):
    """Ring pass (ring attention without the softmax): k, v blocks travel around the ring."""
    n = o.axis_size("r")
    ring = [(j, (j + 1) % n) for j in range(n)]
    out = o.tanh(q @ k.T) @ v
    for _ in range(n - 1):
        k, v = o.ppermute(k, "r", ring), o.ppermute(v, "r", ring)
        out = out + o.tanh(q @ k.T) @ v
    return out


def ring_pass_dense(q, k, v):
    return torch.tanh(q @ k.T) @ v


def vocab_ce(o, logits, labels, reg):
    """Vocab-parallel cross entropy: pmax for stability, psum of exp-sums and target logits.
    With ``reg``, terms whose gradient flows through pmax and pmin (JAX cannot differentiate)."""
    vloc = logits.shape[-1]
    m = o.pmax(o.sg(o.amax(logits, -1)), "tp")
    sumexp = o.psum(o.sum(o.exp(logits - m[:, None]), -1), "tp")
    local = labels - o.axis_index("tp") * vloc
    inside = (local >= 0) & (local < vloc)
    picked = o.where(inside, o.pick(logits, o.clip(local, 0, vloc - 1)), 0.0)
    loss = o.mean(o.log(sumexp) + m - o.psum(picked, "tp"))
    if reg:
        top = o.pmax(o.amax(logits, -1), "tp")
        bottom = o.pmin(o.amin(logits, -1), "tp")
        loss = loss + 0.1 * o.mean(top * top) - 0.2 * o.mean(bottom)
    return o.pmean(loss, "dp")


def broadcast_leader(o, x, w):
    """Instance 1's block along dp, on every instance (pbroadcast), then a column-parallel layer."""
    lead = o.pbroadcast(x, "dp", 1)
    return o.tanh(lead @ w) * lead.sum()


def broadcast_leader_dense(x, w):
    lead = x.chunk(2)[1]
    return torch.tanh(lead @ w) * lead.sum()


def vocab_ce_dense(logits, labels, reg):
    loss = torch.nn.functional.cross_entropy(logits, labels)
    if reg:
        top, bottom = logits.amax(-1), logits.amin(-1)
        loss = loss + 0.1 * (top * top).mean() - 0.2 * bottom.mean()
    return loss


def _case(name, prog, dense, sizes, names, in_specs, out_specs, args, diff, jax_ok=True):
    return pytest.param(
        (prog, dense, sizes, names, in_specs, out_specs, args, diff, jax_ok), id=name
    )


def _labels(b, v, seed):
    return torch.randint(0, v, (b,), generator=torch.Generator().manual_seed(seed))


def _cases():
    r = _randn
    yield _case(
        "data_parallel",
        dp_step,
        dp_dense,
        (4,),
        ("dp",),
        (P(), P(), P(), P("dp"), P("dp")),
        P(),
        (r(5, 6, seed=1), r(6, seed=2), r(6, 1, seed=3), r(8, 5, seed=4), r(8, seed=5)),
        (0, 1, 2, 3, 4),
    )
    yield _case(
        "megatron_mlp",
        megatron,
        megatron_dense,
        (2, 4),
        ("dp", "tp"),
        (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
        P("dp", None),
        (r(6, 5, seed=6), r(5, 8, seed=7), r(8, seed=8), r(8, 3, seed=9), r(3, seed=10)),
        (0, 1, 2, 3, 4),
    )
    yield _case(
        "sequence_parallel",
        seq_parallel,
        seq_parallel_dense,
        (2, 2),
        ("dp", "tp"),
        (P("dp", "tp", None), P(), P(None, "tp"), P("tp", None)),
        P("dp", "tp", None),
        (r(4, 6, 5, seed=11), r(5, seed=12), r(5, 8, seed=13), r(8, 5, seed=14)),
        (0, 1, 2, 3),
    )
    for tiled in (True, False):
        yield _case(
            f"all_to_all_experts_{'tiled' if tiled else 'untiled'}",
            functools.partial(moe, tiled=tiled),
            moe_dense,
            (2, 4),
            ("dp", "ep"),
            (P(("dp", "ep")), P(), P("ep")),
            P(("dp", "ep")),
            (r(64, 3, seed=15), r(3, 4, seed=16), r(4, 3, 3, seed=17)),
            (0, 1, 2),
        )
    yield _case(
        "ring_allreduce",
        ring_allreduce,
        ring_allreduce_dense,
        (4,),
        ("r",),
        P("r"),
        P("r"),
        (r(32, seed=18),),
        (0,),
    )
    yield _case(
        "ring_pass",
        ring_pass,
        ring_pass_dense,
        (4,),
        ("r",),
        P("r"),
        P("r"),
        (r(8, 3, seed=19), r(8, 3, seed=20), r(8, 2, seed=21)),
        (0, 1, 2),
    )
    yield _case(
        "pbroadcast_leader",
        broadcast_leader,
        broadcast_leader_dense,
        (2, 2),
        ("dp", "tp"),
        (P("dp"), P(None, "tp")),
        P(None, "tp"),
        (r(6, 5, seed=24), r(5, 4, seed=25)),
        (0, 1),
    )
    for reg in (False, True):
        yield _case(
            "vocab_parallel_ce" + ("_with_pmax_pmin_terms" if reg else ""),
            functools.partial(vocab_ce, reg=reg),
            functools.partial(vocab_ce_dense, reg=reg),
            (2, 2),
            ("dp", "tp"),
            (P("dp", "tp"), P("dp")),
            P(),
            (r(6, 8, seed=22) * 3, _labels(6, 8, seed=23)),
            (0,),
            jax_ok=not reg,
        )


CASES = list(_cases())


@pytest.mark.parametrize("case", CASES)
def test_program_gradients_equal_dense_reference(case):
    prog, dense, sizes, names, in_specs, out_specs, args, diff, _ = case
    mesh = ns.make_mesh(sizes, names)
    f = ns.spmd_map(
        functools.partial(prog, TORCH_OPS), mesh=mesh, in_specs=in_specs, out_specs=out_specs
    )
    out, got = grads(f, args, diff)
    want_out, want = grads(dense, args, diff)
    assert_close(out, want_out, "value")
    assert_close(got, want, "gradients")
    assert all(g.abs().max() > 0 for g in got)  # every input's gradient is exercised


# --- the same gradients through jax.shard_map --------------------------------------------------


def _jax():
    # conftest.py asks for 8 fake CPU devices before jax is first imported.
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    assert len(jax.devices()) >= 8, "XLA_FLAGS must be set before jax is first imported"
    return jax


@functools.cache
def _jax_ops():
    jax = _jax()
    jnp, lax = jax.numpy, jax.lax
    return types.SimpleNamespace(
        psum=lax.psum,
        pmean=lax.pmean,
        pmax=lax.pmax,
        pmin=lax.pmin,
        all_gather=lax.all_gather,
        psum_scatter=lax.psum_scatter,
        all_to_all=lambda x, a, s, c, tiled=False: lax.all_to_all(x, a, s, c, tiled=tiled),
        ppermute=lambda x, a, perm: lax.ppermute(x, a, perm),
        axis_index=lax.axis_index,
        axis_size=lax.axis_size,
        pvary=lambda x, a: lax.pcast(x, a, to="varying"),
        # lax.pbroadcast has no CPU lowering in jax 0.10.2; its docstring defines it as this:
        pbroadcast=lambda x, a, src: lax.psum(jnp.where(lax.axis_index(a) == src, x, 0.0), a),
        tanh=jnp.tanh,
        exp=jnp.exp,
        log=jnp.log,
        rsqrt=jax.lax.rsqrt,
        sum=lambda x, dim=None, keepdim=False: jnp.sum(x, axis=dim, keepdims=keepdim),
        mean=lambda x, dim=None, keepdim=False: jnp.mean(x, axis=dim, keepdims=keepdim),
        amax=lambda x, dim: jnp.max(x, axis=dim),
        amin=lambda x, dim: jnp.min(x, axis=dim),
        softmax=lambda x, dim: jax.nn.softmax(x, axis=dim),
        where=jnp.where,
        clip=jnp.clip,
        rows=lambda x, idx: x[jnp.array(idx)],
        pick=lambda x, idx: jnp.take_along_axis(x, idx[..., None], -1)[..., 0],
        onehot=lambda i, n, like: (jnp.arange(n) == i).astype(like.dtype),
        take=lambda x, i: x[i],
        const=jnp.array,
        sg=lax.stop_gradient,
    )


def jax_grads(prog, sizes, names, in_specs, out_specs, args, diff, cot_seed: int = 99):
    import numpy as np

    jax = _jax()
    jnp = jax.numpy
    spec = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes), names)
    to_jax = lambda s: spec(*s) if isinstance(s, ns.PartitionSpec) else tuple(map(to_jax, s))  # noqa: E731
    f = jax.shard_map(
        functools.partial(prog, _jax_ops()),
        mesh=mesh,
        in_specs=to_jax(in_specs),
        out_specs=to_jax(out_specs),
    )
    jargs = [jnp.asarray(a.numpy()) for a in args]
    cot = jnp.asarray(_randn(*jax.eval_shape(f, *jargs).shape, seed=cot_seed).numpy())

    def value_and_pullback(*diffed):
        def g(*d):
            full = list(jargs)
            for i, a in zip(diff, d):
                full[i] = a
            return f(*full)

        out, pull = jax.vjp(g, *diffed)
        return out, pull(cot)

    # One compilation for value and gradients (op-by-op dispatch is 10x slower here).
    out, got = jax.jit(value_and_pullback)(*[jargs[i] for i in diff])
    return torch.from_numpy(np.array(out)), [torch.from_numpy(np.array(g)) for g in got]


@pytest.mark.parametrize("case", [c for c in CASES if c.values[0][-1]])
def test_program_gradients_equal_jax_shard_map(case):
    prog, _, sizes, names, in_specs, out_specs, args, diff, _ = case
    want_out, want = jax_grads(prog, sizes, names, in_specs, out_specs, args, diff)
    mesh = ns.make_mesh(sizes, names)
    f = ns.spmd_map(
        functools.partial(prog, TORCH_OPS), mesh=mesh, in_specs=in_specs, out_specs=out_specs
    )
    out, got = grads(f, args, diff)
    assert_close(out, want_out, "value")
    assert_close(got, want, "gradients")


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
