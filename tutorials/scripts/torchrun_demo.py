"""The same spmd_map training step, simulated in one process or on real processes.

    python tutorials/scripts/torchrun_demo.py                          # simulated mesh
    torchrun --nproc-per-node 4 tutorials/scripts/torchrun_demo.py     # 4 processes, gloo
    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT tutorials/scripts/torchrun_demo.py   # on each of 2 machines

Options: ``--device cuda`` (NCCL, one GPU per process), ``--steps N``, ``--fail-rank R`` (rank R
raises inside the mapped function: the other ranks stop with RankFailedError naming it).

A Megatron-style MLP (column-parallel then row-parallel over ``tp``, batch split over ``dp``) is
trained for a few SGD steps on a ``(dp, tp)`` mesh of all the processes. Every rank checks its
result against a dense single-device computation of the same steps and prints one ``RANK`` line.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

import torch
import torch.distributed as dist

import named_spmd as ns
from named_spmd import P


def build(mesh, fail_rank: int | None):
    @ns.spmd_map(
        mesh=mesh,
        in_specs=(P("dp", None), P("dp", None), P(None, "tp"), P("tp"), P("tp", None)),
        out_specs=P(),
    )
    def loss_fn(x, y, w1, b1, w2):
        if fail_rank is not None and dist.is_initialized() and dist.get_rank() == fail_rank:
            raise RuntimeError(f"deliberate failure on rank {fail_rank}")
        h = torch.tanh(x @ w1 + b1)  # column parallel: this rank's slice of the hidden units
        pred = ns.psum(h @ w2, "tp")  # row parallel: partial sums added over tp
        return ns.pmean(((pred - y) ** 2).mean().reshape(1), "dp")

    return loss_fn


def dense_loss(x, y, w1, b1, w2):
    return ((torch.tanh(x @ w1 + b1) @ w2 - y) ** 2).mean().reshape(1)


def data(device):
    g = torch.Generator().manual_seed(0)  # the same global values on every rank

    def r(*s):
        return torch.randn(*s, generator=g, dtype=torch.float64).to(device)

    return r(16, 8), r(16, 4), r(8, 32) / 3, r(32) / 3, r(32, 4) / 3


def train(step_loss, params, x, y, steps: int, lr: float = 0.1):
    params = [p.clone().requires_grad_() for p in params]
    losses = []
    for _ in range(steps):
        loss = step_loss(x, y, *params)
        loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
        for p in params:
            p.grad = None
        loss.sum().backward()
        with torch.no_grad():
            for p in params:
                p -= lr * p.grad
        losses.append(loss.item())
    return losses, params


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--fail-rank", type=int, default=None)
    args = parser.parse_args()
    if "RANK" in os.environ:  # under torchrun
        if args.device == "cuda":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world = dist.get_world_size() if dist.is_initialized() else 4
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = ns.make_mesh((2, world // 2), ("dp", "tp"))  # real under torchrun, else simulated
    device = (
        torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        if (args.device == "cuda")
        else torch.device("cpu")
    )
    x, y, *params = data(device)
    losses, trained = train(build(mesh, args.fail_rank), params, x, y, args.steps)
    _, dense = train(dense_loss, params, x, y, args.steps)
    err = max((a - b).abs().max().item() for a, b in zip(trained, dense))
    checksum = sum(p.sum().item() for p in trained)
    coords = getattr(mesh, "my_coords", "all (simulated)")
    line = (
        f"RANK {rank}/{world} host={socket.gethostname()} mesh={mesh!r} coords={coords} "
        f"losses={[round(v, 6) for v in losses]} checksum={checksum:.12f} "
        f"max_err_vs_dense={err:.2e}\n"
    )
    sys.stdout.write(line)  # one write: lines of processes sharing a terminal do not interleave
    sys.stdout.flush()
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
