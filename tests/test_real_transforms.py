"""The transform matrices on the real backend: torch.func grad / vjp / jvp / vmap / jacrev / jacfwd
/ hessian / functionalize, forward-mode AD and double backward, over and inside the mapped
function, on 2 and 4 gloo processes, each rank against the simulated run of the same program
(tests/real_transforms.py: the programs of test_func_transforms, test_levels_matrix,
transforms_over and transforms_inside, imported); and ns.CommMode's count of every collective a
call runs, boundary ones included, against the calls of the ProcessGroup's collective methods.
One launch per world size: 15-20 s (2 processes) and 50 s (4) on 2 busy cores. It also checks
that a torch error of the user's code is the simulated mesh's SpmdError class on a real mesh,
naming the function, the line and the rank. The sampled transform matrix
(tests/sampled_transforms.py) is one more launch per world size.
"""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import launch  # noqa: E402

pytestmark = pytest.mark.distributed


@pytest.mark.parametrize("world", [2, 4])
def test_transform_matrices_agree_with_simulated(world):
    finished = launch([os.path.join("tests", "real_transforms.py")], world, 480)
    tail = finished.outputs[0][-3000:]
    assert not finished.timed_out, tail
    assert finished.returncodes == [0] * world, tail
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    names = {o["name"] for o in outcomes}
    assert len(outcomes) == world * len(names), tail
    # every matrix is there: a program lost from the launch would pass silently otherwise
    prefixes = ["levels outside", "levels inside", "over", "inside", "comm count", "user error"]
    if world == 4:  # test_func_transforms's program is written for the (2, 2) mesh
        prefixes += ["func_transforms outside", "func_transforms inside"]
    for prefix in prefixes:
        assert any(n.startswith(prefix + ":") for n in names), prefix
    assert len(names) > 300, len(names)
    bad = [o for o in outcomes if o["problems"]]
    assert not bad, f"{len(bad)} failing; " + "\n".join(
        f"{o['name']} rank {o['rank']}: {o['problems'][0][:1500]}" for o in bad[:8]
    )


@pytest.mark.parametrize("world", [2, 4])
def test_sampled_transform_matrix_agrees_with_simulated(world):
    """tests/sampled_transforms.py: grad, vjp, jvp, linearize, jacrev, jacfwd, hessian and vmap
    over the call, and grad, vjp, jvp, vmap, jacrev, jacfwd and hessian inside it, on sampled
    programs: values, the vma of every value, CommMode counts, and the ProcessGroup's calls.
    Divergences not fixed yet are listed by kind (``KNOWN``) and printed, not failed."""
    import sampled_transforms as st

    finished = launch([os.path.join("tests", "sampled_transforms.py")], world, 300)
    tail = finished.outputs[0][-3000:]
    assert not finished.timed_out, tail
    assert finished.returncodes == [0] * world, tail
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    kinds = len(st.OVER) + len(st.INSIDE)
    assert len(outcomes) == world * st.CASES[world] * kinds, tail
    bad = [o for o in outcomes if o["problems"] and not o["known"]]
    assert not bad, f"{len(bad)} failing; " + "\n".join(
        f"{o['name']} rank {o['rank']}: {o['problems'][0][:1500]}" for o in bad[:8]
    )
    for o in outcomes:
        if o["problems"] and o["rank"] == 0:
            print(f"known divergence, {o['name']}: {o['known']}: {o['problems'][0][:300]}")
