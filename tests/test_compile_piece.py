"""``ns.compile``: a piece of the per-device function compiled on a real mesh (4 gloo processes,
tests/compile_piece_worker.py, with aot_eager: Inductor's lowering of the same functional
collectives on a real mesh is tests/test_compile.py's), and run uncompiled, with the same
numbers, on the simulated mesh, in ``.check()`` and outside any call."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

import named_spmd as ns

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import launch  # noqa: E402
from compile_piece_worker import block, loss_and_grads, mapped  # noqa: E402

BACKENDS = ["aot_eager"]


@pytest.fixture(scope="module")
def launched():
    """One launch checks every backend (the ranks start once); each reports on its own."""
    worker = [os.path.join("tests", "compile_piece_worker.py"), ",".join(BACKENDS)]
    finished = launch(worker, 4, 900 * len(BACKENDS))  # the budget of a launch per backend
    return finished, [json.loads(line) for line in finished.lines("PIECE ")]


@pytest.mark.distributed
@pytest.mark.parametrize("backend", BACKENDS)
def test_a_compiled_piece_equals_the_uncompiled_one_on_a_real_mesh(launched, backend):
    finished, every = launched
    results = [r for r in every if r["backend"] == backend]
    assert not finished.timed_out, finished.outputs[0][-3000:]
    assert len(results) == 4 and all(not r["problems"] for r in results), results
    assert {r["frames"] for r in results} == {2}  # one per input layout, none per step
    elsewhere = [r for r in every if r["problems"]]
    assert finished.returncodes == [0] * 4, (elsewhere, finished.outputs[0][-3000:])


def _args():
    gen = torch.Generator().manual_seed(3)
    return [
        torch.randn(s, generator=gen, dtype=torch.float64) for s in ((8, 6), (6, 8), (8,), (8, 6))
    ]


def test_a_compiled_piece_runs_uncompiled_on_the_simulated_mesh():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    piece = ns.compile(block, backend="inductor", fullgraph=True)
    (want, want_g), (got, got_g) = (
        loss_and_grads(mapped(mesh, f), _args()) for f in (block, piece)
    )
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(got_g, want_g))
    assert piece.in_call is None and piece.plain is None  # nothing was compiled


def test_a_compiled_piece_is_checked_and_compiles_outside_any_call():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    report = mapped(mesh, ns.compile(block)).check(*_args())
    assert str(report.outputs[0].type) == str(mapped(mesh, block).check(*_args()).outputs[0].type)
    tanh = ns.compile(torch.tanh, backend="eager", fullgraph=True)
    x = torch.randn(5)
    assert torch.equal(tanh(x), torch.tanh(x)) and tanh.plain is not None
