"""After a mapped call (and its backward) the caller's tensors carry no named_spmd attribute:
inputs, parameters, closed-over tensors, outputs and gradients round-trip through torch.save and
torch.load(weights_only=True), and a module deep-copies plainly, on every backend, eager and
compiled (docs/design.md section 5.7). The program and checks: tests/saving_worker.py."""

from __future__ import annotations

import json
import os

import pytest
import torch
from _dist_launch import launch
from saving_worker import left_on, operands_among_results, program, round_trip

import named_spmd as ns
from named_spmd import P


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("shape", [(1, 1), (2, 2)], ids=["1x1", "2x2"])
def test_nothing_is_left_on_the_callers_tensors_of_a_simulated_mesh(shape, compiled):
    out = program(ns.make_mesh(shape, ("dp", "tp")), compiled)
    assert out["left"] == {}
    assert out["state"] and out["tensors"] and out["copy"], out


def test_tensors_saved_after_calls_load_with_their_values():
    """The repro: a state_dict holding a parameter passed to a mapped call, and the call's
    input, saved after the calls and loaded with ``weights_only=True``."""
    for shape in [(1, 1), (2, 2)]:
        mesh = ns.make_mesh(shape, ("dp", "tp"))
        w = torch.nn.Parameter(torch.randn(4, 4))
        x = torch.randn(4, 4)
        f = ns.spmd_map(
            lambda x, w: (x @ w, w * 2),
            mesh=mesh,
            in_specs=(P("dp"), P()),
            out_specs=(P("dp"), P()),
        )
        for _ in range(3):
            y, z = f(x, w)
            (y.sum() + z.sum()).backward()
        state = {"w": w, "x": x, "y": y.detach(), "z": z.detach(), "grad": w.grad}
        loaded = round_trip(state)
        for k, v in state.items():
            assert not left_on(v), (shape, k, left_on(v))
            assert torch.equal(loaded[k], v.detach()), (shape, k)
        torch.testing.assert_close(y, x @ w)


def test_an_input_passed_into_a_checkpoint_keeps_its_type_in_the_recomputation():
    """On a mesh of one instance: the input's stamp, removed when the call returned, is back
    while a checkpoint recomputes (the recomputed piece reads the forward's types), and gone
    again after. (On two ranks, where a wrong type changes a psum: tests/saving_worker.py.)"""
    from torch.utils.checkpoint import checkpoint

    mesh = ns.make_mesh((1, 1), ("dp", "tp"))
    seen = []

    def piece(a, w):
        seen.append(ns.typeof(a))
        return torch.sin(a @ w)

    f = ns.spmd_map(
        lambda x, w: checkpoint(piece, x, w, use_reentrant=False),
        mesh=mesh,
        in_specs=(P("dp"), P()),
        out_specs=P("dp"),
    )
    x, w = torch.randn(3, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    f(x, w).sum().backward()
    assert len(seen) == 2 and seen[0] == seen[1], seen
    assert not left_on(x) and not left_on(w)
    torch.testing.assert_close(x.grad, torch.cos(x @ w).detach() @ w.detach().T)


@pytest.mark.distributed
@pytest.mark.parametrize("nproc", [1, 2])
def test_nothing_is_left_on_the_callers_tensors_of_a_real_mesh(nproc):
    finished = launch([os.path.join("tests", "saving_worker.py")], nproc, 300)
    assert not finished.timed_out and finished.returncodes == [0] * nproc, finished.outputs[0][
        -3000:
    ]
    outcomes = [json.loads(line) for line in finished.lines("SAVING")]
    assert len(outcomes) == 9 * nproc, finished.outputs[0][-3000:]
    for o in outcomes:
        if "among" in o:  # returned by ops among several results, or written through out=
            assert o["among"] == {}, o
            continue
        if "checkpointed" in o:  # typed as in the forward while recomputed: the same gradient
            assert o["checkpointed"] == pytest.approx(o["plain"], abs=1e-12), o
            continue
        # (a DTensor output keeps the local tensor it was made from: a tensor, which loads)
        left = {k: v for k, v in o["left"].items() if v != ["_named_spmd_made_from"]}
        assert left == {}, o
        assert o["state"] and o["tensors"] and o["copy"], o
        if not o["compiled"]:
            assert o["steps"] == 3.0, o


@pytest.mark.parametrize("shape", [(1, 1), (2, 2)], ids=["1x1", "2x2"])
def test_closed_over_tensors_an_op_returns_among_its_results_or_writes_through_out(shape):
    """Closed-over tensors that an op returns among several results (``torch.atleast_1d``,
    ``torch.broadcast_tensors``) or writes through ``out=``, in typed and replayed calls:
    nothing left on them, and the call's values those of plain torch."""
    body, held, plain_torch = operands_among_results()
    f = ns.spmd_map(
        body, mesh=ns.make_mesh(shape, ("dp", "tp")), in_specs=P("dp"), out_specs=P("dp")
    )
    for seed in range(3):  # typed, then replayed where the mesh replays
        x = torch.randn(4, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        torch.testing.assert_close(f(x), plain_torch(x), rtol=0, atol=1e-12)
        for name, t in held.items():
            assert not left_on(t), (name, left_on(t))
        loaded = round_trip(held)
        assert all(torch.equal(loaded[k], v) for k, v in held.items())
