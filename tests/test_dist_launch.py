"""The test launcher (tests/_dist_launch.py) itself."""

from __future__ import annotations

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
