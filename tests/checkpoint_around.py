"""Non-reentrant ``torch.utils.checkpoint`` around a mapped call, differentiated twice.

The recomputation in the second backward stops early by raising torch's own control-flow
exception through the mapped function; the real backend must let it pass (it once reported it
as a rank failure). ``python tests/checkpoint_around.py`` under a 2-process job prints
``OUTCOME {json}`` (tests/test_distributed.py compares it with the simulated mesh).
"""

from __future__ import annotations

import json

import torch
from torch.utils.checkpoint import checkpoint

import named_spmd as ns
from named_spmd import P


def gradients(mesh) -> dict:
    f = ns.spmd_map(
        lambda x, w: ns.psum(torch.tanh(x * w), "x"),
        mesh=mesh,
        in_specs=(P("x"), P()),
        out_specs=P(),
    )
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(8, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)

    def loss(x, w):
        y = f(x, w)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y
        return (y**2).sum()

    value = checkpoint(loss, x, w, use_reentrant=False)
    (gx, gw) = torch.autograd.grad(value, (x, w), create_graph=True)
    (hw,) = torch.autograd.grad((gx**2).sum() + gw.sum(), (w,))
    return {"value": value.item(), "gx": gx.tolist(), "gw": gw.tolist(), "hw": hw.tolist()}


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        outcome = gradients(ns.make_mesh((2,), ("x",)))
    except Exception as e:  # noqa: BLE001 - reported to the test
        outcome = {"error": type(e).__name__, "message": str(e)[:2000]}
    print("OUTCOME " + json.dumps({"rank": dist.get_rank(), **outcome}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
