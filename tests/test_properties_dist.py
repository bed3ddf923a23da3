"""The property test's drawn calls on 4 gloo processes against the simulated mesh
(tests/properties_dist.py): every drawn case, of every dtype and layout, must have the same outcome
on both backends, the same error (class and message) or the same values, dtypes and shapes, with
the ranks' copies of a replicated output equal. The batch is ``NAMED_SPMD_DIST_PROPERTY_CASES``
cases (default 300: 40-50 s on 2 busy cores); a long run is e.g.
``NAMED_SPMD_DIST_PROPERTY_CASES=3000 python -m pytest -q tests/test_properties_dist.py``.
"""

from __future__ import annotations

import collections
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import test_properties as tp  # noqa: E402
from _dist_launch import launch  # noqa: E402
from properties_dist import CASES, WORLD  # noqa: E402

pytestmark = pytest.mark.distributed

# A hang's bound, not the expected time: a case runs in milliseconds, the default batch in under
# a minute; 20 ms per case per rank of slack on top of the start-up.
TIMEOUT_S = 240 + CASES * 0.2


def test_drawn_calls_agree_with_simulated_on_4_processes():
    finished = launch([os.path.join("tests", "properties_dist.py")], WORLD, TIMEOUT_S)
    tail = finished.outputs[0][-3000:]
    assert not finished.timed_out, tail
    assert finished.returncodes == [0] * WORLD, tail
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    per_case = collections.Counter(o["case"] for o in outcomes)
    assert sorted(per_case) == list(range(CASES)), tail  # no case lost
    assert set(per_case.values()) == {WORLD}, tail  # every rank ran every case
    # the batch exercises what it claims to: every dtype and layout, values and errors
    assert {o["dtype"] for o in outcomes} == {str(d) for d in tp.DTYPES}
    assert {la for o in outcomes for la in o["layouts"]} == set(tp.LAYOUTS)
    assert {o["outcome"] for o in outcomes} == {"raised", "value"}
    bad = [o for o in outcomes if o["problems"]]
    assert not bad, f"{len(bad)} of {len(outcomes)} disagree:\n" + "\n".join(
        f"case {o['case']} rank {o['rank']}: {o['problems'][0][:1500]}\n{o['case_text']}"
        for o in bad[:6]
    )
