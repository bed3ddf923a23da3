"""Tutorial 13's mixture of experts without capacity, as a script for torchrun.

    python tutorials/scripts/ragged_moe.py                          # simulated mesh of 4
    torchrun --nproc-per-node 4 tutorials/scripts/ragged_moe.py     # 4 processes, gloo

Each instance routes its tokens top-1, sorts them by expert and sends each expert's run of rows,
whatever its length, with ``ns.ragged_all_to_all`` (on a real mesh the sizes are read on the
host and only the rows travel). A few SGD steps train the mapped layer and a per-token loop
from the same weights; every rank checks that the losses and the trained weights are equal and
prints one ``RANK`` line with the tokens each expert received per step (they change every step).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

E, T, D, HID, STEPS = 8, 8, 6, 12, 3  # experts, tokens per instance, dims, training steps
F64 = torch.float64


def exclusive_cumsum(t):
    return torch.cumsum(t, 0) - t


def dispatch_plan(expert, n):
    """Offsets and sizes of both trips, from each token's expert (see tutorial 13)."""
    per = E // n
    send_sizes = F.one_hot(expert, E).sum(0)  # [E]: tokens for each expert
    input_offsets = exclusive_cumsum(send_sizes)
    recv_sizes = ns.all_to_all(send_sizes, "ep", 0, 0, tiled=True)  # slot s: source s // per
    by_expert = recv_sizes.reshape(n, per).T.reshape(-1)  # this buffer's layout: expert-major
    placed = exclusive_cumsum(by_expert).reshape(per, n).T.reshape(-1)  # back to slot order
    output_offsets = ns.all_to_all(placed, "ep", 0, 0, tiled=True)  # the senders' frame
    return input_offsets, send_sizes, output_offsets, recv_sizes, placed


def moe(x, wr, w1, w2):
    n = ns.axis_size("ep")
    per, rows_here = E // n, n * T
    probs = torch.softmax(x @ wr, dim=-1)
    gate, expert = probs.max(-1)
    order = torch.argsort(expert, stable=True)
    in_off, send, out_off, recv, placed = dispatch_plan(expert, n)
    rows = ns.ragged_all_to_all(
        x[order], x.new_zeros(rows_here, D), in_off, send, out_off, recv, "ep"
    )
    ends = torch.cumsum(recv.reshape(n, per).sum(0), 0)
    local = (torch.arange(rows_here).unsqueeze(1) >= ends).sum(1).clamp(max=per - 1)
    done = torch.einsum(
        "mh,mhd->md", F.gelu(torch.einsum("md,mdh->mh", rows, w1[local])), w2[local]
    )
    from_offsets = ns.all_to_all(in_off, "ep", 0, 0, tiled=True)
    back = ns.ragged_all_to_all(done, x.new_zeros(T, D), placed, recv, from_offsets, send, "ep")
    return gate.unsqueeze(1) * torch.empty_like(back).index_copy(0, order, back)


def reference(x, wr, w1, w2):
    """Every token through its expert, one at a time."""
    rows = []
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ wr, dim=-1)
        e = int(probs.argmax())
        rows.append(probs[e] * (F.gelu(x[t] @ w1[e]) @ w2[e]))
    return torch.stack(rows)


def train(mesh, n):
    """STEPS of SGD on the mapped layer and on the reference; the largest difference of losses
    and trained weights, and the tokens per expert of each step."""
    gen = torch.Generator().manual_seed(0)
    init = [torch.randn(*s, dtype=F64, generator=gen) for s in ((D, E), (E, D, HID), (E, HID, D))]
    params = [t.clone().requires_grad_() for t in init]
    params_ref = [t.clone().requires_grad_() for t in init]
    layer = ns.spmd_map(
        moe, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep")
    )
    err, loads = 0.0, []
    for _ in range(STEPS):
        xb = torch.randn(n * T, D, dtype=F64, generator=gen)
        target = torch.randn(n * T, D, dtype=F64, generator=gen)
        y = layer(xb, *params)
        y = y.full_tensor() if hasattr(y, "full_tensor") else y  # a DTensor on a real mesh
        loss = ((y - target) ** 2).mean()
        loss_ref = ((reference(xb, *params_ref) - target) ** 2).mean()
        err = max(err, (loss - loss_ref).abs().item())
        for group, value in ((params, loss), (params_ref, loss_ref)):
            grads = torch.autograd.grad(value, group)
            with torch.no_grad():
                for p, g in zip(group, grads):
                    p -= 0.5 * g
        loads.append(torch.bincount((xb @ params_ref[0].detach()).argmax(-1), minlength=E).tolist())
    err = max(err, *((p - q).abs().max().item() for p, q in zip(params, params_ref)))
    return err, loads


def main() -> None:
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    n = dist.get_world_size() if dist.is_initialized() else 4
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = ns.make_mesh((n,), ("ep",))  # real under torchrun, else simulated
    err, loads = train(mesh, n)
    sys.stdout.write(f"RANK {rank}/{n} loads={loads} max_err_vs_reference={err:.2e}\n")
    sys.stdout.flush()
    assert err < 1e-10, err
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
