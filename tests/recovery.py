"""Calls after a caught error on a real mesh (run by tests/test_distributed.py on 4 processes).

Phase "symmetric": every rank raises the same SpmdError and catches it, ten times; each next
call must run and give the right sum (a rank once read a peer's stale failure and the ranks
fell out of step). Phase "asymmetric": rank 0 raises before a psum its peers are already in;
the peers stop with RankFailedError, and the next call must raise one clear SpmdError on every
rank (the peers' psum can never complete), within a bound. One ``OUTCOME {json}`` per phase.
"""

from __future__ import annotations

import json
import time

import torch
import torch.distributed as dist

import named_spmd as ns
from named_spmd import P


def symmetric(mesh, rank: int) -> dict:
    bad = ns.spmd_map(lambda x: x * 2, mesh=mesh, in_specs=P("i"), out_specs=P())
    good = ns.spmd_map(lambda x: ns.psum(x, "i"), mesh=mesh, in_specs=P("i"), out_specs=P())
    x = torch.arange(8.0)
    for _ in range(10):
        try:
            bad(x)
            return {"problem": "the bad call did not raise"}
        except ns.VmaError:
            pass
        y = good(x).full_tensor()
        if not torch.equal(y, x.reshape(4, 2).sum(0)):
            return {"problem": f"wrong sum {y.tolist()}"}
    return {"ok": True}


def asymmetric(mesh, rank: int) -> dict:
    def f(x, fail):
        if fail and rank == 0:
            raise ValueError("rank 0 fails before the psum")
        return ns.psum(x, "i")

    x = torch.arange(8.0)
    first = ns.spmd_map(lambda x: f(x, True), mesh=mesh, in_specs=P("i"), out_specs=P())
    again = ns.spmd_map(lambda x: f(x, False), mesh=mesh, in_specs=P("i"), out_specs=P())
    try:
        first(x)
        return {"problem": "the failing call returned"}
    except (ValueError, ns.RankFailedError) as e:
        failed = type(e).__name__
    t0 = time.monotonic()
    try:
        again(x)
        return {"problem": "the next call ran on out-of-step process groups"}
    except ns.SpmdError as e:
        return {
            "first": failed,
            "next": type(e).__name__,
            "message": str(e)[:600],
            "seconds": time.monotonic() - t0,
        }


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ns.make_mesh((dist.get_world_size(),), ("i",))
    for phase in (symmetric, asymmetric):
        outcome = {"rank": rank, "phase": phase.__name__, **phase(mesh, rank)}
        print("OUTCOME " + json.dumps(outcome), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
