"""Gradients and forward tangents of sampled spmd_map programs against the per-instance reference.

The cases come from the one sampler, tests/_sampler.py (the named programs, with dense references
and JAX's gradients, are in the catalogue tests/_programs.py, run by tests/test_programs.py). Each
case checks, against tests/_reference.py: the values; the gradients of ``sum_k <out_k, cot_k>``
for random cotangents with respect to every tensor input leaf (torch autograd through named_spmd,
and through the reference's instance threads); and the forward tangents for random input
tangents (torch.func.jvp through named_spmd, the reference's by double vjp). The vma of every
value against the sampler's model is checked too (in both the reverse and the forward run), as in
test_sampler.py.

Case k is ``make_case(SEED + N_CASES + k)``: after test_sampler.py's cases, so that the two files
never draw the same case. NAMED_SPMD_GRADIENT_CASES sets how many (and NAMED_SPMD_SAMPLER_SEED
the seed, as for test_sampler.py).
"""

from __future__ import annotations

import functools

import pytest
import torch
from _reference import (
    REF,
    assert_close_within,
    reference_jvp,
    run_reference,
    tree_leaves,
    tree_replace,
)
from _sampler import (
    COLLECTIVES,
    N_CASES,
    N_GRADIENT_CASES,
    SEED,
    check_model,
    features,
    make_case,
    run,
)

import named_spmd as ns

TOL = 1e-10
FIRST = SEED + N_CASES


def _randn(shape, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tuple(shape), generator=g, dtype=torch.float64)


def _on_tensors(case, call):
    """``f(*tensor input leaves) -> tuple of tensor outputs`` for ``call(args)`` (the arguments
    may hold Python floats, which stay fixed), and the tensor input leaves."""
    leaves = tree_leaves(case.args)
    where = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]

    def f(*xs):
        full = list(leaves)
        for i, x in zip(where, xs):
            full[i] = x
        out = call(tree_replace(case.args, full))
        return tuple(t for t in tree_leaves(out) if isinstance(t, torch.Tensor))

    return f, [leaves[i] for i in where]


def _value_and_grads(f, xs, cot_seed: int):
    """Outputs of ``f(*xs)`` and the gradients of ``sum_k <out_k, cot_k>`` for every x."""
    xs = [x.detach().requires_grad_() for x in xs]
    outs = f(*xs)
    loss = sum((o * _randn(o.shape, cot_seed + k)).sum() for k, o in enumerate(outs))
    if not isinstance(loss, torch.Tensor) or not loss.requires_grad:  # nothing depends on xs
        return [o.detach() for o in outs], [torch.zeros_like(x) for x in xs]
    # zeros for an input the output does not depend on (a ppermute with no pairs, say)
    grads = torch.autograd.grad(loss, xs, materialize_grads=True)
    return [o.detach() for o in outs], list(grads)


@pytest.mark.parametrize("k", range(N_GRADIENT_CASES), ids=lambda k: f"seed{FIRST + k}")
def test_sampled_program_gradients_equal_per_instance_reference(k):
    case = make_case(FIRST + k)
    mesh = ns.make_mesh(case.sizes, case.names)
    specs = (case.in_specs, case.out_specs)

    def on_named_spmd(args):  # the model is checked under autograd and under torch.func.jvp
        body = functools.partial(run, ns, case, on_values=functools.partial(check_model, case))
        return ns.spmd_map(body, mesh=mesh, in_specs=specs[0], out_specs=specs[1])(*args)

    def on_reference(args):
        return run_reference(functools.partial(run, REF, case), mesh, *specs, *args)

    spmd, xs = _on_tensors(case, on_named_spmd)
    ref, _ = _on_tensors(case, on_reference)
    tangents = [_randn(x.shape, FIRST + k + 1000 + j) for j, x in enumerate(xs)]
    try:
        out, got = _value_and_grads(spmd, xs, cot_seed=FIRST + k)
        want_out, want = _value_and_grads(ref, xs, cot_seed=FIRST + k)
        assert_close_within(out, want_out, TOL, "values")
        assert_close_within(got, want, TOL, "gradients")
        _, jvp_got = torch.func.jvp(spmd, tuple(xs), tuple(tangents))
        _, jvp_want = reference_jvp(ref, xs, tangents)
        assert_close_within(list(jvp_got), list(jvp_want), TOL, "jvp")
    except BaseException as e:
        raise AssertionError(f"case failed:\n{case.describe()}\n{type(e).__name__}: {e}") from e


def test_gradient_cases_cover_every_collective():
    seen = set().union(*(features(make_case(FIRST + k)) for k in range(N_GRADIENT_CASES)))
    assert set(COLLECTIVES) <= seen, f"never sampled: {set(COLLECTIVES) - seen}"
    arguments = {"all_gather:tiled", "all_gather:untiled", "all_gather:to=invariant"}
    arguments |= {"all_gather:to=varying", "psum_scatter:tiled", "psum_scatter:untiled"}
    arguments |= {"all_to_all:tiled", "all_to_all:untiled", "ppermute:partial", "input:float"}
    assert arguments <= seen, f"never sampled: {arguments - seen}"
