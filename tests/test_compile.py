"""torch.compile of whole mapped calls on a real mesh (4 gloo processes, tests/compile_worker.py).

One launch runs every compile backend (``PLAN``); one test per backend reads its results.
``count`` is an aot_autograd backend that inspects the forward and backward FX graphs: one
``_c10d_functional`` collective per collective the eager call's ``ns.CommMode`` counts. Every
program checks values and gradients against the eager call (float64, 1e-10), ``fullgraph=True``,
three steps and one compiled frame (no recompilation); ``eager`` checks that a compiled call
raises the eager call's error. aot_eager also runs the dtype matrix
(one dtype per way of putting a dtype on the wire). Each result carries the seconds its check took.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import launch  # noqa: E402
from compile_worker import CASES, COMPILED_DTYPES  # noqa: E402

pytestmark = pytest.mark.distributed

# The catalogue's programs on a mesh of 4 (tests/_programs.py): DP, Megatron MLP with biases,
# sequence parallel (all_gather + psum_scatter), all_to_all MoE (tiled and stacked), the ring
# pass (ppermute; its `q @ k.T` reads a view attribute, which Dynamo hid from the VmaMode until
# `_torch_private.route_view_attributes_to_modes`), vocab-parallel cross entropy, and a
# non-mesh-order tuple entry in out_specs (its boundary relayout is a ppermute), and a transformer
# block with sequence parallelism (chunk of a packed qkv: a multi-output op; sdpa).
PROGRAMS = [
    "data_parallel@4",
    "megatron_biases@4",
    "sequence_parallel",
    "experts_tiled@4",
    "experts_untiled@4",
    "ring_pass@4",
    "vocab_parallel_ce",
    "relayout_out_tpdp@4",
    "block@4",
]
# One error per check that raises while Dynamo traces the real mesh's call: out_specs, a
# collective's operand, in_specs, the partial-sum inference (its other cases:
# tests/test_compile_simulated.py), a random seed, an out_spec's unknown axis.
ERRORS = [
    "out_specs_claim_replication",
    "unknown_out_axis",
    "invariant_operand",
    "in_specs_not_a_prefix",
    "bias_inside_psum",
    "tensor_seed",
]


# One program per kind of collective (psum, all_gather with psum_scatter, all_to_all, ppermute):
# what Dynamo's graph runs without aot_autograd (``eager``; on the simulated mesh:
# test_compile_simulated.py).
EACH_KIND = ["megatron_biases@4", "sequence_parallel", "experts_tiled@4", "ring_pass@4"]
# ``count`` (an aot_autograd backend that also checks values and gradients, as aot_eager would)
# traces every program but two: the untiled all_to_all, whose collective is the tiled one's
# all_to_all_single, and data parallelism, which the compiled training step (``aot_eager``'s
# ``training_step``: a data-parallel loss) traces and checks against the dense step
# (test_compile_simulated.py compiles both on the simulated mesh). The eager backend runs the checks
# that raise or break the graph. Inductor lowers each functional collective kind: all_reduce (the
# bucketed program), all_gather and reduce_scatter (sequence_parallel), all_to_all_single
# (experts_tiled; ring_pass's ppermute is one too).
PLAN = {
    "count": {
        "programs": [n for n in PROGRAMS if n not in ("experts_untiled@4", "data_parallel@4")]
    },
    "eager": {
        "comm_mode": ["experts_tiled@4"],  # (a small program: the decision is the backend's)
        "errors": ERRORS,
        "marked_dynamic": ["plain", "dtensor"],  # (mark_dynamic: test_compile_simulated.py too)
        "data_dependent_output": ["masked_select"],
        "uneven": ["indivisible_input"],
    },
    "aot_eager": {
        "compiled_first": ["megatron_biases@4"],
        "cases": list(CASES),
        "training": ["training_step"],
        "dtypes": ["dtypes"],
        "ragged": ["ragged_all_to_all"],  # (sizes read when the graph runs; bad ones raise)
    },
    "inductor": {  # psum's all-reduce: the bucketed program, checked against eager too
        "programs": ["sequence_parallel", "experts_tiled@4"],
        "bucketed": ["two_tp_layers"],
    },
}


@pytest.fixture(scope="module")
def launched():
    """One launch for every backend (each check of compile_worker.py reports on its own, so a
    failure still names its program and backend): the ranks start, and Dynamo warms up, once."""
    finished = launch([os.path.join("tests", "compile_worker.py"), json.dumps(PLAN)], 4, 3000)
    return finished, [json.loads(line) for line in finished.lines("COMPILE ")]


def _run(launched, backend: str) -> list[dict]:
    finished, every = launched
    results = [r for r in every if r["backend"] == backend]
    bad = [r for r in results if r["problems"]]
    detail = "\n".join(
        f"{r['program']} rank {r['rank']}: {r['problems']}\n{r.get('traceback', '')[-1500:]}"
        for r in bad[:4]
    )
    elsewhere = sorted({f"{r['program']} ({r['backend']})" for r in every if r["problems"]})
    assert not finished.timed_out, "timed out:\n" + finished.outputs[0][-3000:]
    assert not bad, detail
    assert finished.returncodes == [0] * 4, (elsewhere, finished.outputs[0][-3000:])
    planned = {name for names in PLAN[backend].values() for name in names}
    assert {r["program"] for r in results} == planned
    return results


def test_graphs_carry_the_eager_calls_collectives(launched):
    results = _run(launched, "count")  # the errors: test_compiled_calls_equal_eager
    counted = {r["program"]: r for r in results if "graphs" in r}
    assert set(counted) == set(PLAN["count"]["programs"])
    # the graphs hold communication at all (the Megatron MLP: one psum forward; backward the
    # implicit pvarys' psums over dp and the plain inputs' gradient all_gathers)
    assert counted["megatron_biases@4"]["graphs"][0] == 1
    assert counted["megatron_biases@4"]["graphs"][1] > 0


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_compiled_calls_equal_eager(launched, backend):
    # aot_eager also runs the user-code cases (compile_worker.CASES: ns.random draws, int and
    # dict arguments, a graph break inside the call, an invariant operand beside a reduced
    # one, DTensor inputs whose shapes change every step, gradients included) and a whole
    # training step, with their graph counts (tests/test_compile_simulated.py runs them on
    # the simulated mesh), and the dtype matrix (compile_worker.check_dtypes: the eager call's
    # bits or error per dtype and collective; test_faults.py compares the eager call with the
    # simulated mesh)
    results = _run(launched, backend)
    if backend == "aot_eager":  # the eager call after a compiled call made first on its mesh
        assert any(r.get("compiled_first") for r in results)
        cases = {*CASES, "training_step"}
        graphs = {r["program"]: r["graphs"] for r in results if r["program"] in cases}
        assert graphs["random_draws"] == graphs["int_argument"] == 2, graphs
        assert graphs["graph_break_dict"] == 0, graphs
        # every dtype torch has through every collective, as the eager call (check_dtypes)
        dtypes = [(r["dtypes"], r["refusals"]) for r in results if r["program"] == "dtypes"]
        assert dtypes == [(len(COMPILED_DTYPES), 1)]
    else:  # compiled calls under CommMode (compile_worker.check_comm_mode)
        assert any(r.get("comm_mode") for r in results)


def test_compiled_calls_equal_eager_with_inductor(launched):
    results = _run(launched, "inductor")
    # ns.compile buckets the gradient psums (compile_worker.check_bucketed)
    bucketed = {r["program"]: r["bucketed"] for r in results if "bucketed" in r}
    assert set(bucketed) == {"two_tp_layers"}, results
    two = bucketed["two_tp_layers"]
    assert two["default"] < two["no adjacent waits"] < two["unbucketed"], two
