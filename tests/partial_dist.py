"""Partial sums (unreduced and reduced values) on real processes: ``python tests/partial_dist.py``
under a 2-process job (tests/test_partial_sums.py launches it) prints one ``OUTCOME {json}`` line
per check and rank:

* every partial-sum program of the catalogue (tests/_programs.py ``PARTIAL_PROGRAMS``): values,
  gradients, per-device types and communication against the per-instance reference, the dense
  program and the simulated run (``_backends.compare_runs``, the catalogue's one test body);
* every program of :data:`ERRORS` (tests/_partial_cases.py): the error class and message, which
  the test compares with the simulated run's;
* every case of :data:`BOUNDARY` (partial-sum specs at the call boundary): its global values,
  gradients and types, which the test compares with the dense function, JAX and the simulated run;
* deferred reduction with DTensor parameters: their gradients are ``Partial()`` DTensors, summed
  once after accumulating microbatches;
* random partial-sum programs of tests/_partial_sampler.py on the (2,) mesh (``REAL_CASES``):
  accepted ones checked against the per-instance reference (values, gradients, types, linearity)
  and the simulated run, refused ones with the simulated run's error and message.
"""

from __future__ import annotations

import itertools
import json
import os
import sys
import traceback

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _backends  # noqa: E402
from _partial_cases import BOUNDARY, ERRORS, deferred_grads, run_error  # noqa: E402
from _partial_sampler import PAIR, REAL_CASES, make_case, run_case, run_named_spmd  # noqa: E402
from _programs import BY_NAME, PARTIAL_PROGRAMS  # noqa: E402

import named_spmd as ns  # noqa: E402


def _random_case(seed: int, refused: bool, mesh) -> dict:
    """One random case on the real mesh: checked as on the simulated one, and the same outcome
    (outputs, gradients and types; or error and message) as the simulated run."""
    case = make_case(seed, refused, mesh=PAIR)
    outcome = run_case(case, mesh)
    got = run_named_spmd(case, mesh)
    sim = run_named_spmd(case, ns.make_mesh(*PAIR, simulated=True))
    for key in ("error", "message", "types"):
        assert got.get(key) == sim.get(key), (key, got.get(key), sim.get(key))
    for key in ("outs", "grads"):
        for g, w in zip(got.get(key, ()), sim.get(key, ())):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9)
    return {"outcome": outcome}


def _say(**entry) -> None:
    print("OUTCOME " + json.dumps(entry), flush=True)


def main() -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        for name in PARTIAL_PROGRAMS:
            program = BY_NAME[name]
            mesh = ns.make_mesh(program.sizes, program.names)
            try:
                got = _backends.evaluate(program, mesh)
                ref = _backends.reference_run(program)
                sim = _backends.simulated_run(program)
                _backends.compare_runs(got, ref, sim, program)
                _say(kind="program", name=name, rank=rank, ok=True)
            except Exception:  # noqa: BLE001 - reported to the test
                _say(kind="program", name=name, rank=rank, ok=False, why=traceback.format_exc())
        for name in ERRORS:
            _say(kind="error", name=name, rank=rank, **run_error(name, simulated=False))
        mesh = ns.make_mesh(*PAIR)
        for seed, refused in REAL_CASES:
            try:
                _say(
                    kind="random",
                    seed=seed,
                    rank=rank,
                    ok=True,
                    **_random_case(seed, refused, mesh),
                )
            except Exception:  # noqa: BLE001 - reported to the test
                _say(kind="random", seed=seed, rank=rank, ok=False, why=traceback.format_exc())
        for (name, case), compiled in itertools.product(BOUNDARY.items(), (False, True)):
            said = dict(kind="boundary", name=name, compiled=compiled, rank=rank)
            try:
                result = case(ns.make_mesh((2,), ("x",)), compiled)
                _say(**said, ok=True, result=result)
            except Exception:  # noqa: BLE001 - reported to the test
                _say(**said, ok=False, why=traceback.format_exc())
        mesh = ns.make_mesh((2,), ("dp",))
        grads, placements, comms = deferred_grads(mesh)
        _say(
            kind="deferred",
            rank=rank,
            grads=[g.tolist() for g in grads],
            placements=placements,
            comms=comms,
        )
    finally:
        sys.stdout.flush()
        dist.destroy_process_group()
    os._exit(0)


if __name__ == "__main__":
    main()
