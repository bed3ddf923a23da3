"""A rank that hangs inside the mapped function (4 processes, NAMED_SPMD_TIMEOUT=4).

Rank 2 sleeps past the timeout before its psum; the other ranks must stop at the timeout with a
RankFailedError that names rank 2 (it never reached a collective of the call), and rank 2 must
end too, once its peers are gone. One ``OUTCOME {json}`` per rank (tests/test_distributed.py).
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

import named_spmd as ns
from named_spmd import P


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ns.make_mesh((4,), ("i",))

    def f(x):
        if rank == 2:
            time.sleep(12)  # hangs past NAMED_SPMD_TIMEOUT
        return ns.psum(x, "i")

    t0 = time.monotonic()
    try:
        ns.spmd_map(f, mesh=mesh, in_specs=P("i"), out_specs=P())(torch.arange(8.0))
        out = {"ok": True}
    except ns.SpmdError as e:
        out = {"error": type(e).__name__, "message": str(e)}
    seconds = time.monotonic() - t0
    print("OUTCOME " + json.dumps({"rank": rank, "seconds": seconds, **out}), flush=True)


if __name__ == "__main__":
    main()
