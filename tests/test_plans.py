"""Plans on a real mesh of several ranks (``named_spmd._plan``): a call typed once per signature
and replayed after, with every call equal to the same call typed (tests/plan_worker.py, on 2
gloo processes), including calls whose program changed since the plan was made."""

from __future__ import annotations

import functools
import json

import pytest
from _dist_launch import launch
from plan_worker import CASES, LOCAL_THEN_GLOBAL

# case -> [calls replayed whole from a plan, calls whose program differed from the plan's] on
# each rank: such a call is replayed up to the first op that differs and typed from there (a
# call that raises is counted in neither); a new step number is a new signature
REPLAYS = {
    "flag_adds_a_use": [2, 1],
    "flag_swaps_an_operand": [1, 1],
    "megatron": [2, 0],
    "branch_on_invariant_value": [1, 0],
    "step_number": [0, 0],
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


@pytest.mark.distributed
def test_a_local_calls_plan_is_not_a_global_calls():
    """The same shapes as blocks (``.local``) and as global values: the global call's blocks
    are unequal, its outputs and gradients the dense ones."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, LOCAL_THEN_GLOBAL]
        assert outcome["problems"] == [] and outcome["calls"] == 4, outcome
