"""The test launcher (tests/_dist_launch.py) itself."""

from __future__ import annotations

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import launch  # noqa: E402

pytestmark = pytest.mark.distributed

# Every rank prints 256 KiB, then meets the others in a collective. A rank writing into a pipe
# that nobody reads blocks at 64 KiB, so a launcher that reads the ranks' outputs one after the
# other deadlocks here (rank 0 waits in the barrier for rank 1, blocked in print): a long run of
# properties_dist.py (2000 cases) hung that way.
CHATTY = """
import torch.distributed as dist
dist.init_process_group("gloo")
for k in range(4096):
    print(f"LINE {dist.get_rank()} {k} " + "x" * 50)
dist.barrier()
print("DONE", dist.get_rank(), flush=True)
dist.destroy_process_group()
"""


def test_ranks_printing_more_than_a_pipe_holds_do_not_block_each_other():
    finished = launch(["-c", CHATTY], 2, 120)
    assert not finished.timed_out, finished.outputs[0][-500:]
    assert finished.returncodes == [0, 0], finished.outputs[0][-2000:]
    assert sorted(finished.lines("DONE")) == ["0", "1"]
    assert len(finished.lines("LINE")) == 2 * 4096


# Each rank ends as a script can (forked from the launcher's server, tests/_dist_launch.py, it
# must end as `python -c ...` would): rank 0 returns, rank 1 exits with 3, rank 2 raises (the
# interpreter prints it, sets sys.last_value, then runs atexit), rank 3 is killed by SIGKILL.
# Every rank first reports what a fresh `python -c` has: its argv, sys.path[0], working
# directory, the launch's environment, and none of the modules a rank imports itself.
ENDINGS = """
import atexit, json, os, signal, sys
rank = int(os.environ["RANK"])
late = ["named_spmd", "torch._dynamo", "torch.distributed.nn.functional"]
seen = [sys.argv, sys.path[0], os.getcwd(), os.environ.get("EXTRA"), __name__]
seen.append([m for m in late if m in sys.modules])  # imported by the rank, as it would be
print("SEEN " + json.dumps(seen), flush=True)
atexit.register(lambda: print("ATEXIT", type(getattr(sys, "last_value", None)).__name__))
if rank == 1:
    sys.exit(3)
if rank == 2:
    raise ValueError("rank 2 raises")
if rank == 3:
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_ranks_end_as_a_fresh_interpreter_would():
    from _dist_launch import ROOT

    finished = launch(["-c", ENDINGS, "arg"], 4, 120, EXTRA="x")
    assert not finished.timed_out, finished.outputs
    assert finished.returncodes == [0, 3, 1, -9], finished.outputs
    seen = [json.loads(line) for line in finished.lines("SEEN")]
    assert seen == [[["-c", "arg"], "", ROOT, "x", "__main__", []]] * 4, finished.outputs
    assert finished.lines("ATEXIT") == ["NoneType", "NoneType", "ValueError"], finished.outputs
    assert "ValueError: rank 2 raises" in finished.outputs[2], finished.outputs[2]


def test_a_rank_past_the_timeout_is_killed_after_writing_its_stack():
    finished = launch(["-c", "import time; print('UP', flush=True); time.sleep(600)"], 2, 5)
    assert finished.timed_out and finished.returncodes == [-9, -9], finished.outputs
    assert finished.lines("UP") == ["", ""] and finished.seconds < 60, finished
    # before the kill, each rank wrote where it waited: the user's line
    assert all('File "<string>", line 1' in out for out in finished.outputs), finished.outputs
