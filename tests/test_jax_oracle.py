"""JAX's shard_map as an oracle: the same programs, value for value, in float64.

Each program is written once against a namespace ``o`` (collectives plus the few array helpers the
programs need), and runs three ways: named_spmd, the per-instance reference of tests/_reference.py,
and ``jax.shard_map`` on 8 fake CPU devices. Programs avoid psum of an invariant operand, where
JAX multiplies by the axis size and named_spmd deliberately raises.
"""

from __future__ import annotations

import functools
import math
import types

import numpy as np
import pytest
import torch

# conftest.py asks for 8 fake CPU devices before jax is first imported.
jax = pytest.importorskip("jax")
import jax.numpy as jnp  # noqa: E402
from _reference import REF, assert_trees_close, run_reference  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402

jax.config.update("jax_enable_x64", True)
JP = jax.sharding.PartitionSpec

COLLECTIVES = (
    "psum pmean pmax pmin all_gather psum_scatter all_to_all ppermute pshuffle pbroadcast "
    "axis_index axis_size pvary"
).split()


# --- namespaces: collectives + array helpers -----------------------------------------------------


def _torch_ops(collectives) -> types.SimpleNamespace:
    return types.SimpleNamespace(
        **{name: getattr(collectives, name) for name in COLLECTIVES},
        relu=torch.relu,
        tanh=torch.tanh,
        sum=lambda x, dim, keepdim=False: x.sum(dim, keepdim=keepdim),
        onehot=lambda i, n, like: (torch.arange(n) == i).to(like.dtype),
        take=lambda x, i, dim: x.index_select(dim, i.reshape(1)).squeeze(dim),
    )


NS_OPS = _torch_ops(ns)
REF_OPS = _torch_ops(REF)
_JAX_TO = {"varying": "varying", "invariant": "invarying"}  # JAX spells it "invarying"
JAX_OPS = types.SimpleNamespace(
    psum=jax.lax.psum,
    pmean=jax.lax.pmean,
    pmax=jax.lax.pmax,
    pmin=jax.lax.pmin,
    all_gather=lambda x, a, *, axis=0, tiled=False, to="varying": jax.lax.all_gather(
        x, a, axis=axis, tiled=tiled, to=_JAX_TO[to]
    ),
    psum_scatter=lambda x, a, *, scatter_dimension=0, tiled=False: jax.lax.psum_scatter(
        x, a, scatter_dimension=scatter_dimension, tiled=tiled
    ),
    all_to_all=lambda x, a, s, c, *, tiled=False: jax.lax.all_to_all(x, a, s, c, tiled=tiled),
    ppermute=jax.lax.ppermute,
    pshuffle=jax.lax.pshuffle,
    # jax.lax.pbroadcast has no CPU lowering in jax 0.10.2; its docstring defines it as this:
    pbroadcast=lambda x, a, source: jax.lax.psum(
        jnp.where(jax.lax.axis_index(a) == source, x, jnp.zeros_like(x)), a
    ),
    axis_index=jax.lax.axis_index,
    axis_size=jax.lax.axis_size,
    pvary=lambda x, a: jax.lax.pcast(x, a, to="varying"),
    relu=jax.nn.relu,
    tanh=jnp.tanh,
    sum=lambda x, dim, keepdim=False: jnp.sum(x, axis=dim, keepdims=keepdim),
    onehot=lambda i, n, like: (jnp.arange(n) == i).astype(like.dtype),
    take=lambda x, i, dim: jnp.take(x, i, axis=dim),
)


# --- running a program three ways --------------------------------------------------------------


def _to_jax_specs(tree):
    if isinstance(tree, ns.PartitionSpec):
        return JP(*tree)
    if tree is None:
        return JP()
    if isinstance(tree, dict):
        return {k: _to_jax_specs(v) for k, v in tree.items()}
    return type(tree)(_to_jax_specs(t) for t in tree)


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_tree_map(fn, t) for t in tree)
    return fn(tree)


def run_jax(prog, sizes, names, in_specs, out_specs, *args):
    devices = np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes)
    mesh = jax.sharding.Mesh(devices, names)
    f = jax.jit(  # one compile; eager shard_map would compile every op on its own
        jax.shard_map(
            functools.partial(prog, JAX_OPS),
            mesh=mesh,
            in_specs=_to_jax_specs(in_specs),
            out_specs=_to_jax_specs(out_specs),
        )
    )
    out = f(*_tree_map(lambda t: jnp.asarray(t.numpy()), args))
    return _tree_map(lambda a: torch.from_numpy(np.array(a)), out)


def run_three(prog, sizes, names, in_specs, out_specs, *args):
    """named_spmd, the reference and JAX agree; returns named_spmd's result."""
    mesh = ns.make_mesh(sizes, names)
    spmd = functools.partial(prog, NS_OPS)
    got = ns.spmd_map(spmd, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(*args)
    ref = run_reference(functools.partial(prog, REF_OPS), mesh, in_specs, out_specs, *args)
    want = run_jax(prog, sizes, names, in_specs, out_specs, *args)
    assert_trees_close(ref, want)  # the reference agrees with JAX ...
    assert_trees_close(got, want)  # ... and so does named_spmd
    return got


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_jax_sees_eight_devices():
    assert len(jax.devices()) >= 8, "set XLA_FLAGS before jax is imported (tests/conftest.py)"
    assert jnp.asarray(1.0).dtype == jnp.float64


# --- the programs ------------------------------------------------------------------------------


def mlp(o, x, w1, w2):
    """Column-parallel then row-parallel: one psum over tp."""
    return o.psum(o.relu(x @ w1) @ w2, "tp")


def test_megatron_mlp():
    x, w1, w2 = _randn(8, 6, seed=1), _randn(6, 16, seed=2), _randn(16, 5, seed=3)
    specs = (P("dp", None), P(None, "tp"), P("tp", None))
    y = run_three(mlp, (2, 4), ("dp", "tp"), specs, P("dp", None), x, w1, w2)
    torch.testing.assert_close(y, torch.relu(x @ w1) @ w2)


def seq_parallel(o, x, w1, w2, tiled):
    """Sequence parallel: gather the sequence, column/row matmuls, reduce-scatter it back."""
    if tiled:
        full = o.all_gather(x, "tp", axis=1, tiled=True)  # [B, S, D]
        return o.psum_scatter(o.tanh(full @ w1) @ w2, "tp", scatter_dimension=1, tiled=True)
    full = o.all_gather(x, "tp", axis=1)  # [B, tp, S/tp, D]: untiled, a new dim
    return o.psum_scatter(o.tanh(full @ w1) @ w2, "tp", scatter_dimension=1)


@pytest.mark.parametrize("tiled", [True, False])
def test_sequence_parallel_pair(tiled):
    x, w1, w2 = _randn(4, 8, 6, seed=4), _randn(6, 12, seed=5), _randn(12, 6, seed=6)
    prog = functools.partial(seq_parallel, tiled=tiled)
    prog = _positional(prog)
    specs = (P("dp", "tp", None), P(None, "tp"), P("tp", None))
    y = run_three(prog, (2, 4), ("dp", "tp"), specs, P("dp", "tp", None), x, w1, w2)
    torch.testing.assert_close(y, torch.tanh(x @ w1) @ w2)


def _positional(partial_prog):
    """functools.partial(prog, tiled=...) as a plain function (o, *args)."""
    return lambda o, *args: partial_prog(o, *args)


def ring_allreduce(o, x, axes):
    """Chunked ring all-reduce from ppermute: reduce-scatter, then all-gather, n-1 steps each."""
    n = o.axis_size(axes)
    i = o.axis_index(axes)
    ring = [(j, (j + 1) % n) for j in range(n)]
    acc = o.take(x, i, 0)
    for k in range(n - 1):  # receive i-1's partial sum of chunk (i-1-k) and add my own
        acc = o.ppermute(acc, axes, ring) + o.take(x, (i - 1 - k) % n, 0)
    idx = (i + 1) % n  # now acc is the full sum of chunk i+1
    out = o.onehot(idx, n, x)[:, None] * acc[None]
    for _ in range(n - 1):
        acc = o.ppermute(acc, axes, ring)
        idx = (idx - 1) % n
        out = out + o.onehot(idx, n, x)[:, None] * acc[None]
    return out


@pytest.mark.parametrize(
    "sizes, names, axes",
    [
        ((8,), ("i",), "i"),
        ((2, 4), ("dp", "tp"), ("dp", "tp")),
        ((2, 4), ("dp", "tp"), ("tp", "dp")),
        ((2, 4), ("dp", "tp"), "tp"),
    ],
)
def test_ring_allreduce(sizes, names, axes):
    n = math.prod(sizes[names.index(a)] for a in ((axes,) if isinstance(axes, str) else axes))
    x = _randn(8 * n, 3, seed=7)
    prog = lambda o, x: ring_allreduce(o, x, axes)  # noqa: E731
    if axes == ("tp", "dp"):  # JAX numbers ppermute groups differently: see the last test
        mesh = ns.make_mesh(sizes, names)
        y = ns.spmd_map(
            functools.partial(prog, NS_OPS), mesh=mesh, in_specs=P(names), out_specs=P(names)
        )(x)
        ref = run_reference(functools.partial(prog, REF_OPS), mesh, P(names), P(names), x)
        assert_trees_close(y, ref)
    else:
        y = run_three(prog, sizes, names, P(names), P(names), x)
    # every instance holds the sum over its group: check against psum of the blocks
    mesh = ns.make_mesh(sizes, names)
    want = ns.spmd_map(
        lambda x: ns.psum(x, axes), mesh=mesh, in_specs=P(names), out_specs=P(names)
    )(x)
    torch.testing.assert_close(y, want)


def moe(o, x, w, tiled):
    """Expert parallel: token chunk j goes to expert j over ep, and comes back."""
    n = o.axis_size("ep")
    if tiled:
        received = o.all_to_all(x, "ep", 0, 0, tiled=True)  # [t, D]: chunk j from member j
        return o.all_to_all(o.relu(received @ w[0]), "ep", 0, 0, tiled=True)
    t, d = x.shape
    received = o.all_to_all(x.reshape(n, t // n, d), "ep", 0, 0)  # [n_src, t/n, D]
    back = o.all_to_all(o.relu(received @ w[0]), "ep", 0, 0)  # [n_expert, t/n, H]
    return back.reshape(t, -1)


@pytest.mark.parametrize("tiled", [True, False])
def test_all_to_all_expert_dispatch_and_return(tiled):
    x, w = _randn(32, 6, seed=8), _randn(4, 6, 5, seed=9)  # 8 instances x 4 tokens; 4 experts
    prog = lambda o, x, w: moe(o, x, w, tiled)  # noqa: E731
    y = run_three(prog, (2, 4), ("dp", "ep"), (P(("dp", "ep")), P("ep")), P(("dp", "ep")), x, w)
    # dense: token r of an instance's 4 tokens went to expert r
    expert = torch.arange(32) % 4
    torch.testing.assert_close(y, torch.relu(torch.einsum("td,tdh->th", x, w[expert])))


def nested(o, tree, w):
    a, (b, c) = tree["a"], tree["b"]
    return (
        {
            "sum": o.psum(a * w, ("dp", "tp")),
            "gathered": o.all_gather(b, ("tp", "dp"), tiled=True, to="invariant"),
            "indexed": b + o.axis_index(("tp", "dp")),
            "mixed": c * o.sum(a, (0, 1)),
        },
        o.pmax(o.sum(c, 1, keepdim=True), "tp"),
    )


def test_nested_pytree_specs_with_tuple_entries_in_both_orders():
    tree = {"a": _randn(8, 3, seed=10), "b": (_randn(16, 2, seed=11), _randn(4, 8, seed=12))}
    w = _randn(3, seed=13)
    in_specs = ({"a": P(("dp", "tp")), "b": (P(("tp", "dp"), None), P(None, "tp"))}, P())
    out_specs = (
        {"sum": P(), "gathered": P(), "indexed": P(("tp", "dp")), "mixed": P("dp", "tp")},
        P("dp"),
    )
    out = run_three(nested, (2, 4), ("dp", "tp"), in_specs, out_specs, tree, w)
    torch.testing.assert_close(out[0]["gathered"], tree["b"][0])  # to='invariant' restores b
    a_blocks = tree["a"].reshape(8, 1, 3)
    torch.testing.assert_close(out[0]["sum"], (a_blocks * w).sum(0))


@pytest.mark.parametrize("src, dst", [(("dp", "tp"), ("tp", "dp")), (("tp", "dp"), ("dp", "tp"))])
def test_tuple_entry_orders_are_different_layouts(src, dst):
    x = torch.arange(16, dtype=torch.float64).reshape(8, 2)
    y = run_three(lambda o, x: x, (2, 4), ("dp", "tp"), P(src), P(dst), x)
    assert not torch.equal(y, x)  # a real permutation of the blocks, agreed by all three


@pytest.mark.parametrize("axes", [("a", "c"), ("c", "a"), ("a", "b", "c"), ("c", "b"), "b"])
def test_pmean_pmax_pmin_over_tuples(axes):
    x = _randn(4, 6, seed=14)

    def prog(o, x):
        return o.pmean(x, axes), o.pmax(x, axes), o.pmin(x, axes)

    names = ("a", "b", "c")
    rest = tuple(a for a in names if a not in axes)
    out_spec = P(rest) if rest else P()
    out = run_three(prog, (2, 2, 2), names, P(("a", "b"), "c"), out_spec, x)
    assert all(t.dtype == torch.float64 for t in out)


# --- conventions of the untiled (and tiled) forms, one collective at a time ---------------------

CONVENTION_AXES = [("b", (2, 4), ("a", "b")), (("b", "a"), (2, 4), ("a", "b")), ("i", (8,), ("i",))]


def _conventions():
    # non-negative split/concat only: jax 0.10.2 mis-sizes negative ones (and segfaults on
    # split_axis=-1); negative axes are covered against the reference in test_collectives.py
    for s in (0, 1, 2):
        for c in (0, 1, 2):
            yield f"all_to_all-{s}-{c}", lambda o, x, A, s=s, c=c: o.all_to_all(x, A, s, c)
    for s, c in ((0, 1), (2, 0), (1, 1), (1, 2)):
        yield (
            f"all_to_all-tiled-{s}-{c}",
            lambda o, x, A, s=s, c=c: o.all_to_all(x, A, s, c, tiled=True),
        )
    for axis in (0, 1, 2, 3, -1, -4):
        yield f"all_gather-{axis}", lambda o, x, A, axis=axis: o.all_gather(x, A, axis=axis)
    for axis in (0, 2, -1):
        yield (
            f"all_gather-tiled-{axis}",
            lambda o, x, A, axis=axis: o.all_gather(x, A, axis=axis, tiled=True),
        )
    for d in (0, 1, 2):  # jax 0.10.2 rejects a negative scatter_dimension
        yield (
            f"psum_scatter-{d}",
            lambda o, x, A, d=d: o.psum_scatter(x, A, scatter_dimension=d),
        )
        yield (
            f"psum_scatter-tiled-{d}",
            lambda o, x, A, d=d: o.psum_scatter(x, A, scatter_dimension=d, tiled=True),
        )
    yield "axis_index", lambda o, x, A: x + o.axis_index(A)
    yield "pbroadcast", lambda o, x, A: o.pbroadcast(x, A, 1)


def _permutes():
    yield "ppermute", lambda o, x, A: o.ppermute(x, A, [(0, 2), (2, 3), (3, 0), (1, 1)])
    yield "pshuffle", lambda o, x, A: o.pshuffle(x, A, _shuffle(o.axis_size(A)))


def _shuffle(n):
    return [(5 * i + 3) % n for i in range(n)] if n % 5 else list(range(n))[::-1]


CONVENTIONS = list(_conventions()) + list(_permutes())
PERMUTES = dict(_permutes())


@pytest.mark.parametrize("axes, sizes, names", CONVENTION_AXES, ids=lambda v: str(v))
def test_conventions_match_jax(axes, sizes, names):
    """Every form of every collective in one program per axis choice (one JAX compile)."""
    cases = dict(CONVENTIONS)
    if axes == ("b", "a"):  # JAX numbers ppermute groups by mesh order: see the next test
        cases = {k: v for k, v in cases.items() if k not in PERMUTES}
    n = math.prod(dict(zip(names, sizes))[a] for a in ((axes,) if isinstance(axes, str) else axes))
    x = _randn(n, n, n * math.prod(sizes), seed=15)  # local block [n, n, n]: fits any split
    spec = P(None, None, names)  # varies over every axis

    def prog(o, x):
        return {k: f(o, x, axes) for k, f in cases.items()}

    mesh = ns.make_mesh(sizes, names)
    got = ns.spmd_map(
        functools.partial(prog, NS_OPS), mesh=mesh, in_specs=spec, out_specs=P(names)
    )(x)
    ref = run_reference(functools.partial(prog, REF_OPS), mesh, spec, P(names), x)
    want = run_jax(prog, sizes, names, spec, P(names), x)
    for k in cases:
        assert_trees_close(ref[k], want[k]), k
        torch.testing.assert_close(
            got[k], want[k], rtol=1e-10, atol=1e-10, msg=lambda m: f"{k}: {m}"
        )


@pytest.mark.parametrize("case", list(_permutes()), ids=[c[0] for c in _permutes()])
def test_ppermute_tuple_order_vs_jax(case):
    """ppermute / pshuffle over a tuple of axes that is not in mesh order.

    named_spmd numbers the group by axis_index(A), row-major over the tuple as written, like
    every other collective (and like JAX's own axis_index and all_gather). JAX 0.10.2's ppermute
    lowering sorts each group by device id instead, i.e. it numbers by mesh order and ignores
    the tuple order, so there JAX disagrees with its own axis_index (a ring all-reduce over
    ('tp', 'dp') built from axis_index and ppermute gives wrong sums in JAX). We keep the
    consistent convention; this test pins both behaviours.
    """
    _, prog = case
    sizes, names = (2, 4), ("a", "b")
    x = _randn(4, 4, 4 * 8, seed=16)
    spec = P(None, None, names)
    mesh = ns.make_mesh(sizes, names)
    ours = ns.spmd_map(
        lambda x: prog(NS_OPS, x, ("b", "a")), mesh=mesh, in_specs=spec, out_specs=P(names)
    )(x)
    ref = run_reference(lambda x: prog(REF_OPS, x, ("b", "a")), mesh, spec, P(names), x)
    assert_trees_close(ours, ref)
    jax_reversed = run_jax(lambda o, x: prog(o, x, ("b", "a")), sizes, names, spec, P(names), x)
    jax_mesh_order = run_jax(lambda o, x: prog(o, x, ("a", "b")), sizes, names, spec, P(names), x)
    assert_trees_close(jax_reversed, jax_mesh_order)  # JAX: the tuple order does not matter
    assert not torch.allclose(ours, jax_reversed)  # so it differs from the row-major numbering
