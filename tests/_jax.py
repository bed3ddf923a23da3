"""The one JAX runner of the tests: ``jax.shard_map`` on 8 fake CPU devices, in float64.

Programs are written once against a namespace ``o`` (collectives plus a few array helpers, see
tests/_programs.py); :data:`JAX_OPS` is that namespace for JAX. :func:`run_jax` runs a program
under one ``jax.jit`` (op-by-op dispatch of shard_map is ~10x slower) and returns its value as
torch tensors and, with ``diff``, the gradients of ``<out, cot>`` with respect to those
arguments (``jax.vjp``, in the same compilation).

conftest.py asks for the 8 fake devices before jax is first imported.
"""

from __future__ import annotations

import functools
import math
import types

import pytest
import torch


@functools.cache
def jax_module():
    """jax with float64 and at least 8 devices, or skip the test where jax is not installed."""
    jax = pytest.importorskip("jax")
    jax.config.update("jax_enable_x64", True)
    assert len(jax.devices()) >= 8, "XLA_FLAGS must be set before jax is first imported"
    return jax


# JAX spells invariant "invarying"
_JAX_TO = {"varying": "varying", "invariant": "invarying", "reduced": "reduced"}


@functools.cache
def jax_ops() -> types.SimpleNamespace:
    jax = jax_module()
    jnp, lax = jax.numpy, jax.lax
    return types.SimpleNamespace(
        psum=lax.psum,
        pmean=lax.pmean,
        pmax=lax.pmax,
        pmin=lax.pmin,
        all_gather=lambda x, a, *, axis=0, tiled=False, to="varying": lax.all_gather(
            x, a, axis=axis, tiled=tiled, to=_JAX_TO[to]
        ),
        psum_scatter=lambda x, a, *, scatter_dimension=0, tiled=False: lax.psum_scatter(
            x, a, scatter_dimension=scatter_dimension, tiled=tiled
        ),
        all_to_all=lambda x, a, s, c, *, tiled=False: lax.all_to_all(x, a, s, c, tiled=tiled),
        ppermute=lax.ppermute,
        pshuffle=lax.pshuffle,
        # lax.pbroadcast has no CPU lowering in jax 0.10.2; its docstring defines it as this:
        pbroadcast=lambda x, a, src: lax.psum(jnp.where(lax.axis_index(a) == src, x, 0.0), a),
        axis_index=lax.axis_index,
        axis_size=lax.axis_size,
        pvary=lambda x, a: lax.pcast(x, a, to="varying"),
        pcast=lambda x, a, *, to: lax.pcast(x, a, to=to),
        tap=lambda x: x,
        relu=jax.nn.relu,
        tanh=jnp.tanh,
        exp=jnp.exp,
        log=jnp.log,
        rsqrt=lax.rsqrt,
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
        take=lambda x, i, dim=0: jnp.take(x, i, axis=dim),
        const=jnp.array,
        sg=lax.stop_gradient,
    )


def _tree_map(fn, tree):
    if isinstance(tree, dict):
        return {k: _tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(_tree_map(fn, t) for t in tree)
    return fn(tree)


def _to_jax_specs(tree):
    import named_spmd as ns

    jax = jax_module()
    if isinstance(tree, ns.PartitionSpec):
        return jax.sharding.PartitionSpec(*tree, unreduced=tree.unreduced, reduced=tree.reduced)
    if tree is None:
        return jax.sharding.PartitionSpec()
    if isinstance(tree, dict):
        return {k: _to_jax_specs(v) for k, v in tree.items()}
    return type(tree)(_to_jax_specs(t) for t in tree)


def run_jax(prog, sizes, names, in_specs, out_specs, *args, diff=None, cot=None, explicit=False):
    """``jax.shard_map(functools.partial(prog, JAX_OPS), ...)(*args)`` as torch tensors.

    With ``diff`` (indices of tensor arguments) and ``cot`` (a torch tensor shaped like the
    single-tensor output): returns ``(out, [gradient of <out, cot> w.r.t. args[i] for i in
    diff])``. ``explicit``: Explicit mesh axes, which JAX's unreduced and reduced specs need (the
    arguments are placed by their in_specs first)."""
    if explicit:
        return _run_explicit(prog, sizes, names, in_specs, out_specs, *args, diff=diff, cot=cot)
    import numpy as np

    jax = jax_module()
    jnp = jax.numpy
    mesh = jax.sharding.Mesh(np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes), names)
    f = jax.shard_map(
        functools.partial(prog, jax_ops()),
        mesh=mesh,
        in_specs=_to_jax_specs(in_specs),
        out_specs=_to_jax_specs(out_specs),
    )
    jargs = _tree_map(lambda t: jnp.asarray(t.numpy()) if isinstance(t, torch.Tensor) else t, args)
    to_torch = lambda a: torch.from_numpy(np.array(a))  # noqa: E731
    if diff is None:
        return _tree_map(to_torch, jax.jit(f)(*jargs))
    jcot = jnp.asarray(cot.numpy())

    def value_and_pullback(*diffed):
        def g(*d):
            full = list(jargs)
            for i, a in zip(diff, d):
                full[i] = a
            return f(*full)

        out, pull = jax.vjp(g, *diffed)
        return out, pull(jcot)

    out, got = jax.jit(value_and_pullback)(*[jargs[i] for i in diff])
    return to_torch(out), [to_torch(g) for g in got]


def _run_explicit(prog, sizes, names, in_specs, out_specs, *args, diff=None, cot=None):
    import numpy as np

    import named_spmd as ns

    jax = jax_module()
    jnp = jax.numpy
    explicit = (jax.sharding.AxisType.Explicit,) * len(sizes)
    devices = np.array(jax.devices()[: math.prod(sizes)]).reshape(sizes)
    mesh = jax.sharding.Mesh(devices, names, axis_types=explicit)
    one = isinstance(in_specs, ns.PartitionSpec)
    specs = (in_specs,) * len(args) if one else in_specs
    with jax.set_mesh(mesh):
        f = jax.shard_map(
            functools.partial(prog, jax_ops()),
            mesh=mesh,
            in_specs=_to_jax_specs(in_specs),
            out_specs=_to_jax_specs(out_specs),
        )
        put = lambda t, s: jax.device_put(  # noqa: E731
            jnp.asarray(t.numpy()), jax.sharding.NamedSharding(mesh, _to_jax_specs(s))
        )
        jargs = [put(t, s) for t, s in zip(args, specs)]

        def to_torch(a):  # the global value (an unreduced one: summed)
            return torch.from_numpy(np.array(jax.reshard(a, jax.sharding.PartitionSpec())))

        if diff is None:
            return _tree_map(to_torch, jax.jit(f)(*jargs))

        def g(*diffed):
            full = list(jargs)
            for i, a in zip(diff, diffed):
                full[i] = a
            return f(*full)

        out, pull = jax.vjp(g, *[jargs[i] for i in diff])
        got = pull(jax.device_put(jnp.asarray(cot.numpy()), out.sharding))
        return to_torch(out), [to_torch(g) for g in got]
