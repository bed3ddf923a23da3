"""``SpmdFunction.local``: this process's blocks in and out. On a real (2, 2) mesh by
tests/local_worker.py (4 gloo processes on 127.0.0.1, a hard timeout), against the same programs
on a simulated mesh; on a simulated mesh, where one process holds every instance, it is the
global call."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import named_spmd as ns
from named_spmd import P

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import launch  # noqa: E402
from local_worker import MLP_SHAPES, MLP_SPECS, mlp  # noqa: E402

CHECKS = ["mlp", "outputs", "reduced", "counts", "compiled", "dtensor", "specs", "uneven", "debug"]


@pytest.mark.distributed
def test_local_calls_on_a_real_mesh_match_the_simulated_mesh_blockwise():
    finished = launch([os.path.join("tests", "local_worker.py"), ",".join(CHECKS)], 4, 300)
    tail = "\n".join(f"--- rank {r}\n{o[-3000:]}" for r, o in enumerate(finished.outputs))
    assert not finished.timed_out and finished.returncodes == [0] * 4, tail
    outcomes = {(o["rank"], o["check"]): o for o in map(json.loads, finished.lines("OUTCOME"))}
    for rank in range(4):
        for check in CHECKS:
            o = outcomes.get((rank, check))
            assert o is not None and o.get("ok"), (rank, check, o, tail)


def test_on_a_simulated_mesh_a_local_call_is_the_global_call():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    f = ns.spmd_map(mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P())
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(*s, generator=g, dtype=torch.float64) for s in MLP_SHAPES]
    results = []
    for call in (f, f.local):
        leaves = [x.clone().requires_grad_() for x in xs]
        y = call(*leaves)
        y.sum().backward()
        results.append((y.detach(), [x.grad for x in leaves]))
    (y0, g0), (y1, g1) = results
    assert torch.equal(y0, y1)
    for a, b in zip(g0, g1):
        assert torch.equal(a, b)


def test_a_local_call_refuses_keyword_arguments_as_a_call_does():
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(lambda x: x, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(ns.SpmdError, match="keyword arguments"):
        f.local(x=torch.zeros(2))
