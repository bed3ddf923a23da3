"""Random partial-sum programs on the simulated mesh (tests/_partial_sampler.py): every state
(varying, invariant, unreduced, reduced), the casts and collectives between them, linear and
nonlinear ops, writes and dtype casts.

An accepted program must give the per-instance reference's values and float64 gradients, type
every value as the model of section 2.2 does, and each of its steps on a partial sum must be linear
(the parts' results sum to the result on the whole value). A refused program must be refused at
its last step with a ``VmaError`` naming the op and the fix, and that step must really be wrong
(other values than on the whole values, or a gradient left a partial sum). The same cases run on
2 real processes in tests/partial_dist.py (tests/test_partial_sums.py launches it).
"""

from __future__ import annotations

import functools

import pytest
from _partial_sampler import make_case, run_case, step_kind, steps_seen

import named_spmd as ns

SEED = 20261128
N_CASES = 210  # of each kind (about 35 s in all): enough for the refused ones to cover the algebra


@functools.cache
def _mesh(sizes, names):
    return ns.make_mesh(sizes, names)


def _accepted(k):
    return make_case(SEED + k)


def _refused(k):
    return make_case(SEED + 100_000 + k, refused=True)


@pytest.mark.parametrize("k", range(N_CASES))
def test_accepted_program(k):
    case = _accepted(k)
    assert run_case(case, _mesh(case.sizes, case.names)) == "accepted"


@functools.cache
def _refusal(k) -> str:
    case = _refused(k)
    return run_case(case, _mesh(case.sizes, case.names))


@pytest.mark.parametrize("k", range(N_CASES))
def test_refused_program(k):
    assert _refusal(k) in ("value", "gradient")


def test_refusals_wrong_in_values_and_in_gradients():
    kinds = {_refusal(k) for k in range(N_CASES)}
    assert kinds == {"value", "gradient"}, kinds


def test_the_cases_cover_the_algebra():
    """The steps on partial sums that items of section 2.2 are about, accepted and refused, on
    every mesh."""
    accepted = steps_seen([_accepted(k) for k in range(N_CASES)])
    refused_cases = [_refused(k) for k in range(N_CASES)]
    last = {step_kind(c, c.steps[-1]) for c in refused_cases}
    for want in (
        "write:U,U", "write_zero:U", "complex:U", "view_as:U", "colsum:U", "reshape_as:U,V",
        "reshape_as:I,U", "cat:U,U", "cat_neg:U,U", "stack:U,U", "where:U,U", "where_by:U,U,I",
        "where_by:U,U,R", "mul:U,R", "pcast:U", "psum:U", "psum_scatter:U", "all_gather:U",
    ):  # fmt: skip
        assert want in accepted, want
    for want in (
        "write:U,R", "write:U,V", "write:V,U", "write_const:U", "int_cast:U", "where:U,R",
        "where_by:U,U,V", "mul:U,U", "mul:U,I", "add:U,I", "add:U,R", "cat:U,V", "tanh:U",
        "add_const:U",
    ):  # fmt: skip
        assert want in last, want
    meshes = {(c.sizes, c.names) for c in refused_cases}
    assert len(meshes) == 3, meshes
