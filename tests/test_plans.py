"""Plans on a mesh of several instances: a call typed once per signature and replayed after, with
every call equal to the same call typed, including calls whose program changed since the plan
was made (tests/plan_worker.py): on a real mesh (``named_spmd._plan``, 2 gloo processes) and on a
simulated one (``backends/simulated/_planned.py``: the typing of calls whose inputs hold
blocks, which every case's do)."""

from __future__ import annotations

import functools
import json

import pytest
from _dist_launch import launch
from plan_worker import CASES, LOCAL_THEN_GLOBAL, run

import named_spmd as ns

# case -> [calls replayed whole from a plan, calls whose program differed from the plan's] on
# each rank: such a call is replayed up to the first op that differs and typed from there (a
# call that raises is counted in neither); a new step number is a new signature
REPLAYS = {
    "flag_adds_a_use": [2, 1],
    "flag_swaps_an_operand": [1, 1],
    "megatron": [2, 0],
    "branch_on_invariant_value": [1, 0],
    "step_number": [0, 0],
    "flag_varies_a_collective_result": [2, 0],
}


@functools.cache
def _outcomes() -> dict:
    finished = launch(["tests/plan_worker.py"], 2, 600)
    assert not finished.timed_out and finished.returncodes == [0, 0], finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    return {(o["rank"], o["name"]): o for o in outcomes}


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_every_call_equals_the_same_call_typed(name):
    for rank in (0, 1):
        outcome = _outcomes()[rank, name]
        assert outcome["problems"] == [], outcome["problems"]
        assert outcome["replays"] == REPLAYS[name], outcome


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
def test_simulated_calls_equal_the_same_calls_typed(name):
    # (branch_on_invariant_value reads its input with float(), as the case means to)
    outcome = run(name, ns.make_mesh((2,), ("x",), simulated=True))
    assert outcome["problems"] == [], outcome["problems"]
    assert outcome["replays"] == REPLAYS[name], outcome


@pytest.mark.distributed
def test_a_local_calls_plan_is_not_a_global_calls():
    """The same shapes as blocks (``.local``) and as global values: the global call's blocks
    are unequal, its outputs and gradients the dense ones."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, LOCAL_THEN_GLOBAL]
        assert outcome["problems"] == [] and outcome["calls"] == 4, outcome
