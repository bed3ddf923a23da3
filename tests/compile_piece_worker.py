"""``ns.compile`` of a piece inside the per-device function on a real mesh (4 gloo processes,
launched by tests/test_compile_piece.py).

A Megatron block (column-parallel ``w1``/``b1``, a row-parallel ``w2`` read as ``w2.T.T``, the
psum over tp inside the piece, a residual and a LayerNorm) is called twice per step by a
mapped function on a (2, 2) mesh. Against the same function with the piece uncompiled, in the
same process: the loss and the gradients of every input (float64, 1e-10), over three steps with
new values, one compiled frame (no recompilation per call or per step); and the mapped function
compiled whole around the piece (the piece is then traced with the call). Prints
``PIECE {json}`` on every rank.
"""

from __future__ import annotations

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch._dynamo.testing import CompileCounterWithBackend
from torch.distributed.tensor import DTensor

import named_spmd as ns
from named_spmd import P


def block(x, w1, b1, w2):
    h = torch.tanh(x @ w1 + b1)  # w1, b1 split over tp; x varying over dp: implicit pvarys
    y = ns.psum(h @ w2.T.T, "tp")  # a view attribute of a value varying over tp
    return F.layer_norm(y + x, (y.shape[-1],))


def mapped(mesh, piece):
    def step(x, w1, b1, w2):
        y = piece(piece(x, w1, b1, w2), w1, b1, w2)
        return ns.pmean(y.pow(2).mean(), "dp")

    specs = (P("dp"), P(None, "tp"), P("tp"), P("tp", None))
    return ns.spmd_map(step, mesh=mesh, in_specs=specs, out_specs=P())


def loss_and_grads(f, args):
    leaves = [a.clone().requires_grad_() for a in args]
    loss = f(*leaves)
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss  # a real mesh's output
    return loss.detach(), torch.autograd.grad(loss, leaves)


def check(backend: str) -> dict:
    torch._dynamo.reset()  # each backend's frames counted from none, as in a process of its own
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    counter = CompileCounterWithBackend(backend)
    eager, compiled = mapped(mesh, block), mapped(mesh, ns.compile(block, backend=counter))
    gen = torch.Generator().manual_seed(0)
    problems = []
    after_first_step = 0
    for step in range(3):
        shapes = ((8, 6), (6, 8), (8,), (8, 6))
        args = [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]
        (want, want_g), (got, got_g) = loss_and_grads(eager, args), loss_and_grads(compiled, args)
        if not torch.allclose(got, want, rtol=1e-10, atol=1e-10):
            problems.append(f"step {step}: loss {got.item()} != {want.item()}")
        for k, (a, b) in enumerate(zip(got_g, want_g)):
            if not torch.allclose(a, b, rtol=1e-10, atol=1e-10):
                problems.append(f"step {step}: gradient {k} differs by {(a - b).abs().max()}")
        after_first_step = after_first_step or counter.frame_count
    # One frame per layout of the inputs (docs/design.md section 7): the first call's x is an
    # input holding blocks of dp, the second call's x is the first call's result (no blocks
    # recorded); later steps compile nothing.
    if (after_first_step, counter.frame_count) != (2, 2):
        problems.append(
            f"{after_first_step} frames after one step (2 input layouts), "
            f"{counter.frame_count} after three (recompiled)"
        )
    with ns.CommMode() as counted:  # the piece runs uncompiled: every collective counted
        loss_and_grads(compiled, args)
    with ns.CommMode() as want_counted:
        loss_and_grads(eager, args)
    seen = [(e.op, e.axes, e.direction) for e in counted.events]
    if not seen or seen != [(e.op, e.axes, e.direction) for e in want_counted.events]:
        problems.append("CommMode counts a compiled piece's collectives differently")
    # the mapped function compiled whole: the piece is traced with the call
    whole = torch.compile(compiled, backend=backend, fullgraph=True)
    (want, want_g), (got, got_g) = loss_and_grads(eager, args), loss_and_grads(whole, args)
    if not torch.allclose(got, want, rtol=1e-10, atol=1e-10) or not all(
        torch.allclose(a, b, rtol=1e-10, atol=1e-10) for a, b in zip(got_g, want_g)
    ):
        problems.append("the whole call compiled around the piece differs")
    problems += _plain_compile_refused(mesh, backend, eager, args)
    return {"backend": backend, "frames": counter.frame_count, "problems": problems}


def _plain_compile_refused(mesh, backend: str, eager, args) -> list[str]:
    """A piece compiled with plain torch.compile inside an eager call: an SpmdError naming
    ns.compile on every rank (Dynamo fails inside its tracer there), and the next call runs."""
    want = loss_and_grads(eager, args)[0]
    try:
        loss_and_grads(mapped(mesh, torch.compile(block, backend=backend)), args)
        problems = ["a plain torch.compile'd piece was not refused"]
    except ns.SpmdError as e:
        problems = [] if "Fix: compile the piece with ns.compile(fn" in str(e) else [str(e)]
    except Exception as e:  # noqa: BLE001 - reported
        problems = [f"a plain torch.compile'd piece raised {type(e).__name__}: {str(e)[:300]}"]
    if not torch.equal(loss_and_grads(eager, args)[0], want):
        problems.append("the next call differs")
    return problems


def main() -> None:
    dist.init_process_group("gloo")
    failed = False
    for backend in sys.argv[1].split(","):
        result = {"rank": dist.get_rank(), **check(backend)}
        failed |= bool(result["problems"])
        print("PIECE " + json.dumps(result), flush=True)
    dist.destroy_process_group()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
