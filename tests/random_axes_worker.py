"""One rank of test_random_axes.py's real-backend test (4 gloo processes, a (2, 2) dp x tp mesh).

Runs one program of per-axis draws and dropouts (one inside activation checkpointing) on the
real mesh, after ``torch.manual_seed(rank)`` (the idiom that made torch's own draws diverge), and
the same program on a simulated mesh in this process. The draws must be equal bit for bit; values computed from
them (a matmul, its gradients) to rounding. Prints one ``OUTCOME {json}`` line.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

import named_spmd as ns
from named_spmd import P

NAMES = ("dp", "tp")
DRAWS = ("rand_dp", "randn_tp_dp", "randint_tp", "rand_none", "drop_x", "mask_h")
SPECS = (P("dp"), P(("tp", "dp")), P("tp"), P(), P("dp", "tp"), P("dp"))


def program(x, w, step):
    h = ns.psum(x @ w, "tp")  # invariant over tp: one mask over dp keeps it so
    drawn = (
        ns.random.rand(3, over="dp", seed=(step, 0)),
        ns.random.randn(2, 2, over=("tp", "dp"), seed=(step, 1), dtype=torch.float64),
        ns.random.randint(0, 1000, (4,), over="tp", seed=(step, 2)),
        ns.random.rand(5, over=(), seed=(step, 3), dtype=torch.float64),
        ns.random.dropout(x, 0.5, over=("dp", "tp"), seed=(step, 4)),
        ns.random.dropout(torch.ones_like(h), 0.4, over="dp", seed=(step, 5)),
    )
    # recomputed in backward by activation checkpointing: the same mask, the same gradients
    loss_part = checkpoint(_checkpointed, h, step, use_reentrant=False)
    return (*drawn, loss_part)


def _checkpointed(h, step):
    return torch.tanh(ns.random.dropout(h, 0.4, over="dp", seed=(step, 6)))


def run(mesh, x, w):
    f = ns.spmd_map(
        program, mesh=mesh, in_specs=(P("dp", "tp"), P("tp"), None), out_specs=(*SPECS, P("dp"))
    )
    x = x.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    outs = f(x, w, 7)
    outs = [o.full_tensor() if hasattr(o, "full_tensor") else o for o in outs]
    (outs[4].sum() + (outs[-1] ** 2).sum()).backward()
    return outs, x.grad, w.grad


def vmapped(mesh, randomness):
    """A call under a user's vmap: its draws are the seed's and coordinates' alone, not batched
    by the vmap's randomness mode (every row the same mask, "error" no error)."""
    over = ("dp", "tp")
    f = ns.spmd_map(
        lambda x: ns.random.dropout(x, 0.5, over=over, seed=9),
        mesh=mesh,
        in_specs=P(over),
        out_specs=P(over),
    )
    return torch.func.vmap(f, randomness=randomness)(torch.ones(3, 8, dtype=torch.float64))


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(123)  # the same global inputs on every rank
    x = torch.randn(4, 6, generator=g, dtype=torch.float64)
    w = torch.randn(6, 5, generator=g, dtype=torch.float64)
    torch.manual_seed(rank)  # per-rank torch streams must change nothing
    real = run(ns.make_mesh((2, 2), NAMES), x, w)
    simulated = run(ns.make_mesh((2, 2), NAMES, simulated=True), x, w)
    mismatches, max_abs, checked = [], 0.0, 0
    for name, a, b in zip(DRAWS, real[0], simulated[0]):  # the draws: bit for bit
        checked += 1
        if a.dtype != b.dtype or a.shape != b.shape or not torch.equal(a, b):
            mismatches.append(name)
        elif a.numel():
            max_abs = max(max_abs, (a.double() - b.double()).abs().max().item())
    rest = {"loss_part": (real[0][-1], simulated[0][-1]), "x.grad": (real[1], simulated[1])}
    rest["w.grad"] = (real[2], simulated[2])
    for name, (a, b) in rest.items():  # computed from the draws: to rounding
        checked += 1
        if not torch.allclose(a, b, rtol=1e-12, atol=1e-12):
            mismatches.append(name)
    for randomness in ("error", "different"):
        a, b = (
            vmapped(ns.make_mesh((2, 2), NAMES, simulated=s), randomness) for s in (False, True)
        )
        checked += 1
        if not (torch.equal(a, b) and torch.equal(a[0], a[1])):
            mismatches.append(f"vmapped, randomness={randomness}")
    print(
        "OUTCOME "
        + json.dumps(
            {"rank": rank, "checked": checked, "mismatches": mismatches, "max_abs": max_abs}
        ),
        flush=True,
    )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
