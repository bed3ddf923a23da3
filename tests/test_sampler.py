"""Sampled (function, mesh, in_specs, out_specs) cases against the per-instance reference.

The cases come from the one sampler, tests/_sampler.py: random pytree arguments and specs, a
straight-line program of ops and collectives, random out_specs. Each case asserts that
named_spmd's values equal the reference's (tests/_reference.py) and that ``ns.vma`` of every
intermediate value equals the sampler's model of the type system.

Seeded and reproducible: case ``k`` is ``make_case(SEED + k)``. Set NAMED_SPMD_SAMPLER_CASES or
NAMED_SPMD_SAMPLER_SEED to run more cases or other seeds (test_gradients.py draws the cases after
these).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import os
import subprocess
import sys

import pytest
import torch
from _reference import REF, assert_trees_close, run_reference, tree_leaves, tree_map
from _sampler import (
    COLLECTIVES,
    MESHES,
    N_CASES,
    SEED,
    Out,
    Val,
    check_model,
    features,
    make_case,
    run,
)

import named_spmd as ns

# what the value cases must exercise between them, beyond every collective
FEATURES = {
    *("mesh:1-axis", "mesh:2-axis", "mesh:3-axis", "mesh:size-1-axis", "mesh:size-3-axis"),
    *("axes:name", "axes:1-tuple", "axes:2-tuple", "axes:not-in-mesh-order"),
    *("all_gather:tiled", "all_gather:untiled", "all_gather:to=invariant"),
    *("all_gather:to=varying", "all_gather:negative-dim"),
    *("psum_scatter:tiled", "psum_scatter:untiled", "psum_scatter:negative-dim"),
    *("all_to_all:tiled", "all_to_all:untiled", "all_to_all:negative-dim"),
    *("ppermute:empty", "ppermute:partial", "ppermute:full", "axis_index_scale", "mul_prefix"),
    *("tree:psum", "tree:pmean", "tree:pmax", "tree:pvary", "tree:pbroadcast"),
    *("input:dict", "input:dict:shared-spec", "input:float", "spec:several-axes-in-one-dim"),
    *("output:tuple", "output:dict", "output:float"),
}


def check_case(case, reference_case=None) -> None:
    """named_spmd against the reference on ``case``: values, and the model on every value
    (``reference_case``: another program for the reference, to show that a difference fails)."""
    mesh = ns.make_mesh(case.sizes, case.names)
    body = functools.partial(run, ns, case, on_values=functools.partial(check_model, case))
    per_instance = functools.partial(run, REF, reference_case or case)
    try:
        got = ns.spmd_map(body, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs)(
            *case.args
        )
        want = run_reference(per_instance, mesh, case.in_specs, case.out_specs, *case.args)
        assert_trees_close(got, want, rtol=1e-9, atol=1e-9)
    except BaseException as e:
        raise AssertionError(f"case failed:\n{case.describe()}\n{type(e).__name__}: {e}") from e


def test_sampler_is_reproducible_and_varied():
    a, b = make_case(SEED), make_case(SEED)
    assert a.describe() == b.describe()
    assert all(torch.equal(x, y) for x, y in zip(a.args, b.args) if isinstance(x, torch.Tensor))
    cases = [make_case(SEED + k) for k in range(N_CASES)]
    assert len({c.describe() for c in cases}) == N_CASES
    assert {(c.sizes, c.names) for c in cases} == set(MESHES)
    seen = set().union(*(features(c) for c in cases))
    assert set(COLLECTIVES) <= seen, f"never sampled: {set(COLLECTIVES) - seen}"
    assert FEATURES <= seen, f"never sampled: {FEATURES - seen}"
    for world in (4, 8):  # the distributed cases: only meshes of that many instances
        meshes = {make_case(SEED + k, world=world).sizes for k in range(20)}
        assert {math.prod(s) for s in meshes} == {world} and len(meshes) > 1, meshes


def test_cases_are_the_same_in_another_process():
    """Worker processes rebuild the cases from their seeds: nothing may depend on the process
    (a set's iteration order changes with PYTHONHASHSEED, say)."""
    seeds = [(SEED + k, world) for k in range(8) for world in (None, 4, 8)]
    code = (
        "import sys; sys.path.insert(0, 'tests'); from _sampler import make_case\n"
        f"for seed, world in {seeds!r}:\n"
        "    c = make_case(seed, world)\n"
        "    print(c.describe(), [float(x.sum()) for x in c.args if hasattr(x, 'sum')])\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-3000:]
    here = [make_case(seed, world) for seed, world in seeds]
    want = [f"{c.describe()} {[float(x.sum()) for x in c.args if hasattr(x, 'sum')]}" for c in here]
    assert done.stdout.splitlines() == "\n".join(want).splitlines()


def test_check_case_fails_on_a_wrong_model_or_value():
    """The test body can fail: on a model that disagrees with ns.vma, and on a reference whose
    outputs differ from named_spmd's."""
    case = make_case(SEED)
    k = max(j for j, v in enumerate(case.model) if v.shape is not None)
    wrong = Val(case.model[k].shape, case.model[k].vma ^ {case.names[0]})
    model = [*case.model[:k], wrong, *case.model[k + 1 :]]
    with pytest.raises(AssertionError, match="ns.vma"):
        check_case(dataclasses.replace(case, model=model))
    # the reference's program adds 1 to every tensor output
    steps, out_tree, pool_size = list(case.steps), case.out_tree, len(case.model)
    for out in tree_leaves(case.out_tree):
        if case.model[out.i].shape is not None:
            steps.append({"op": "affine", "src": [out.i], "c": 1.0, "d": 1.0})
            moved, pool_size = Out(pool_size), pool_size + 1
            out_tree = tree_map(lambda o, out=out, moved=moved: moved if o == out else o, out_tree)
    with pytest.raises(AssertionError, match="leaf"):
        check_case(case, dataclasses.replace(case, steps=steps, out_tree=out_tree))


@pytest.mark.parametrize("k", range(N_CASES), ids=lambda k: f"seed{SEED + k}")
def test_random_case_matches_reference(k):
    check_case(make_case(SEED + k))
