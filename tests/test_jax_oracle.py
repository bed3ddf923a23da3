"""JAX's shard_map as an oracle for the conventions of every collective, value for value, in float64.

The named programs (Megatron MLP, sequence parallel, ring all-reduce, experts, nested pytrees,
layouts, reductions over tuples) are in the catalogue tests/_programs.py and run against JAX by
tests/test_programs.py; the runner is tests/_jax.py. Here: one program per axis choice that
holds every form of every collective, run three ways (named_spmd, the per-instance reference,
``jax.shard_map``). Programs avoid psum of an invariant operand, where
JAX multiplies by the axis size and named_spmd deliberately raises.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch

# conftest.py asks for 8 fake CPU devices before jax is first imported.
jax = pytest.importorskip("jax")
import _jax  # noqa: E402
import _programs  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from _reference import assert_trees_close, run_reference  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402

jax.config.update("jax_enable_x64", True)
JP = jax.sharding.PartitionSpec

NS_OPS, REF_OPS = _programs.NS_OPS, _programs.REF_OPS


def run_jax(prog, sizes, names, in_specs, out_specs, *args):
    return _jax.run_jax(prog, sizes, names, in_specs, out_specs, *args)


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_jax_sees_eight_devices():
    assert len(jax.devices()) >= 8, "set XLA_FLAGS before jax is imported (tests/conftest.py)"
    assert jnp.asarray(1.0).dtype == jnp.float64


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
