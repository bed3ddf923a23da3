"""Every program of the catalogue (tests/_programs.py), one test body, every backend.

The ``backend`` fixture (conftest.py) runs a program on the simulated mesh, abstractly
(``spmd_map(...).check``: types, shapes, communication, no values), or on real processes
(torch.distributed on gloo, one launch per world size for all programs; tests/dist_worker.py).
The body compares what the backend produced with references that do not depend on it: the dense
single-device program, the per-instance reference (tests/_reference.py, values and gradients) and,
for types and communication counts, the simulated run.
"""

from __future__ import annotations

import pytest
import torch
from _backends import compare_runs, reference_run, simulated_run
from _jax import run_jax
from _programs import CATALOGUE, NS_OPS, randn
from _reference import assert_trees_close

import named_spmd as ns


def _backends_of(program):
    yield "simulated"
    yield "abstract"
    if program.distributed:
        yield "distributed"
        if program.world == 4:  # the late-reductions launch has 4 processes
            yield "distributed_late"


RUNS = [
    # marked here, not only by the backend fixture: ``-m distributed`` selects at collection
    pytest.param(
        program,
        name,
        id=f"{name}-{program.name}",
        marks=[pytest.mark.distributed] if name.startswith("distributed") else [],
    )
    for program in CATALOGUE
    for name in _backends_of(program)
]


@pytest.mark.parametrize("program, backend", RUNS, indirect=["backend"])
def test_program(program, backend):
    got = backend.run(program)
    compare_runs(got, reference_run(program), simulated_run(program), program)


JAX_PROGRAMS = [p for p in CATALOGUE if p.jax]


@pytest.mark.parametrize("program", JAX_PROGRAMS, ids=lambda p: p.name)
def test_program_matches_jax_shard_map(program):
    """Values (and, with ``jax_grad``, gradients for a random cotangent) against JAX."""
    args = program.args()
    sim = simulated_run(program)
    if program.jax_grad:
        diff = tuple(i for i, a in enumerate(args) if a.is_floating_point())
        cot = randn(*sim.value.shape, seed=99)
        want_out, want = run_jax(
            program.prog, program.sizes, program.names, program.in_specs, program.out_specs,
            *args, diff=diff, cot=cot, explicit=program.jax_explicit,
        )  # fmt: skip
        mesh = ns.make_mesh(program.sizes, program.names)
        f = ns.spmd_map(
            lambda *a: program.prog(NS_OPS, *a),
            mesh=mesh,
            in_specs=program.in_specs,
            out_specs=program.out_specs,
        )
        xs = [a.detach().requires_grad_(i in diff) for i, a in enumerate(args)]
        out = f(*xs)
        got = torch.autograd.grad((out * cot).sum(), [xs[i] for i in diff])
        assert_trees_close(out.detach(), want_out, rtol=program.rtol, atol=program.atol)
        assert_trees_close(list(got), want, rtol=program.rtol, atol=program.atol)
    else:
        want = run_jax(
            program.prog, program.sizes, program.names, program.in_specs, program.out_specs,
            *args, explicit=program.jax_explicit,
        )  # fmt: skip
        assert_trees_close(sim.value, want, rtol=program.rtol, atol=program.atol)
