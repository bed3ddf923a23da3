"""What every fault scenario of tests/faults_worker.py shares: the input, its dense psum, the
``OUTCOME`` line each phase prints, and the good call that must run after a failure."""

from __future__ import annotations

import json
import time

import torch

import named_spmd as ns
from named_spmd import P

X = torch.arange(8.0)
DENSE = X.reshape(4, 2).sum(0)  # psum over both axes of P(("dp", "tp")) blocks


def report(rank: int, phase: str, call) -> bool:
    t0 = time.monotonic()
    try:
        call()
        out: dict = {"ok": True}
    except (ns.SpmdError, ValueError) as e:  # (ValueError: the failing rank's own error)
        out = {"error": type(e).__name__, "message": str(e)}
    out.update(rank=rank, phase=phase, seconds=time.monotonic() - t0)
    print("OUTCOME " + json.dumps(out), flush=True)
    return "ok" in out


def psum_all(mesh):
    return ns.spmd_map(
        lambda x: ns.psum(x, ("dp", "tp")), mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P()
    )


def good_call(mesh):
    y = psum_all(mesh)(X).full_tensor()
    if not torch.equal(y, DENSE):
        raise ns.SpmdError(f"wrong sum after recovery: {y.tolist()} instead of {DENSE.tolist()}")
