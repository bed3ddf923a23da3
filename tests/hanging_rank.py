"""A rank that hangs inside the mapped function (4 processes, a 4 s timeout).

Rank 2 hangs before its psum until every other rank has given up and exited (each leaves its
pid in ``HANG_DIR``; at most 90 s), so the peers always reach the timeout first, however the
machine schedules the processes (a fixed 12 s sleep raced their start under load). The peers must stop
at the timeout with a RankFailedError that names rank 2 (it never reached a collective of the
call), and rank 2 must end too, once its peers are gone. The timeout (``HANG_TIMEOUT``) is set
after make_mesh, whose barrier waits NAMED_SPMD_TIMEOUT as well: a starved peer can take over 4 s
to post that it made its groups. One ``OUTCOME {json}`` per rank (tests/test_distributed.py).
"""

from __future__ import annotations

import json
import os
import time

import torch
import torch.distributed as dist

import named_spmd as ns
from named_spmd import P


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ns.make_mesh((4,), ("i",))
    os.environ["NAMED_SPMD_TIMEOUT"] = os.environ["HANG_TIMEOUT"]
    gave_up = [os.path.join(os.environ["HANG_DIR"], str(r)) for r in (0, 1, 3)]
    woke: list[float] = []

    def f(x):
        deadline = time.monotonic() + 90
        while rank == 2 and not all(map(_ended, gave_up)) and time.monotonic() < deadline:
            time.sleep(0.05)  # hangs past the timeout: until every peer gave up and exited
        woke.append(time.monotonic())
        return ns.psum(x, "i")

    t0 = time.monotonic()
    try:
        ns.spmd_map(f, mesh=mesh, in_specs=P("i"), out_specs=P())(torch.arange(8.0))
        out = {"ok": True}
    except ns.SpmdError as e:
        out = {"error": type(e).__name__, "message": str(e)}
    end = time.monotonic()
    seconds = end - (woke[0] if woke else t0)  # rank 2: from the end of its hang
    print("OUTCOME " + json.dumps({"rank": rank, "seconds": seconds, **out}), flush=True)
    pid_file = os.path.join(os.environ["HANG_DIR"], str(rank))
    with open(pid_file + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_file + ".tmp", pid_file)  # atomic: rank 2 never reads a half-written pid


def _ended(pid_file: str) -> bool:
    """The peer wrote its pid (it gave up) and its process has ended (a zombie counts): a peer
    still alive holds the collectives it left in flight, which the late psum would pair with."""
    try:
        with open(pid_file) as f:
            pid = int(f.read())
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (FileNotFoundError, ValueError):
        return os.path.exists(pid_file)  # written, and no such process any more


if __name__ == "__main__":
    main()
