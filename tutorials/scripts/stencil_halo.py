"""Tutorial 12's heat-equation stencil on a grid whose rows do not divide by the mesh.

    python tutorials/scripts/stencil_halo.py                          # simulated mesh of 4
    torchrun --nproc-per-node 4 tutorials/scripts/stencil_halo.py     # 4 processes, gloo

A 10 x 6 plate, its rows split over the 4 instances as torch.chunk splits them (3, 3, 3, 1),
runs a few explicit steps of the heat equation with a 5-point Laplacian: the halo rows travel
between neighbours with ``ns.ppermute``, the instances at the ends apply the boundary conditions
(a hot top edge, an insulated bottom edge), and a heater is placed by global row numbers
(``ns.block_offsets``). Every rank checks the final grid and the gradients of a loss with respect
to the initial grid and the two parameters against the same steps on the whole grid, and prints
one ``RANK`` line. On a real mesh each rank holds its own block (3, 3, 3 and 1 rows).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

H, W, STEPS, DT = 10, 6, 4, 0.2
HEATER_ROWS, HEATER_COLS = (6, 8), (2, 4)
F64 = torch.float64


def laplacian(u, top, bottom):
    """The 5-point Laplacian of the rows ``u``, given the row above and the row below them."""
    padded = F.pad(torch.cat([top, u, bottom]), (1, 1))  # the side edges: 0
    return padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:] - 4 * u


def heater(rows):
    on_rows = (rows >= HEATER_ROWS[0]) & (rows < HEATER_ROWS[1])
    on_cols = torch.zeros(W, dtype=F64)
    on_cols[HEATER_COLS[0] : HEATER_COLS[1]] = 1.0
    return on_rows.to(F64)[:, None] * on_cols


def dense_steps(u, kappa, hot):
    source = heater(torch.arange(H))
    for _ in range(STEPS):
        u = u + DT * (laplacian(u, hot * torch.ones(1, W, dtype=F64), u[-1:]) + kappa * source)
    return u


def build(mesh):
    offsets = ns.block_offsets(H, "rows", mesh=mesh)

    def steps(u, kappa, hot):
        i = ns.axis_index("rows")
        last = ns.axis_size("rows") - 1
        down = [(j, j + 1) for j in range(last)]
        up = [(j + 1, j) for j in range(last)]
        start = torch.tensor(offsets).index_select(0, i.reshape(1))  # my first global row
        source = heater(start + torch.arange(u.shape[0]))
        for _ in range(STEPS):
            top = ns.ppermute(u[-1:], "rows", down)
            bottom = ns.ppermute(u[:1], "rows", up)
            top = torch.where(i == 0, hot * torch.ones(1, W, dtype=F64), top)
            bottom = torch.where(i == last, u[-1:], bottom)
            u = u + DT * (laplacian(u, top, bottom) + kappa * source)
        return u

    return ns.spmd_map(steps, mesh=mesh, in_specs=(P("rows"), P(), P()), out_specs=P("rows"))


def data():
    g = torch.Generator().manual_seed(0)  # the same global values on every rank
    u0 = torch.rand(H, W, generator=g, dtype=F64)
    target = torch.rand(H, W, generator=g, dtype=F64)
    return u0, torch.tensor(0.5, dtype=F64), torch.tensor(1.0, dtype=F64), target


def run(mesh):
    """The final grid and the gradients of ``(u * target).sum()`` (global values)."""
    u0, kappa, hot, target = data()
    args = [a.clone().requires_grad_() for a in (u0, kappa, hot)]
    with ns.simulate_per_instance():  # the simulated mesh's execution for unequal blocks
        u = build(mesh)(*args)
    u = u.full_tensor() if hasattr(u, "full_tensor") else u  # a DTensor on a real mesh
    (u * target).sum().backward()
    return u.detach(), [a.grad for a in args]


def main() -> None:
    if "RANK" in os.environ:  # under torchrun
        dist.init_process_group("gloo")
    world = dist.get_world_size() if dist.is_initialized() else 4
    rank = dist.get_rank() if dist.is_initialized() else 0
    mesh = ns.make_mesh((world,), ("rows",))  # real under torchrun, else simulated
    u, grads = run(mesh)
    u0, kappa, hot, target = data()
    args = [a.clone().requires_grad_() for a in (u0, kappa, hot)]
    dense = dense_steps(*args)
    (dense * target).sum().backward()
    err = max(
        (u - dense.detach()).abs().max().item(),
        *((g - a.grad).abs().max().item() for g, a in zip(grads, args)),
    )
    sizes = ns.block_sizes(H, "rows", mesh=mesh)
    sys.stdout.write(f"RANK {rank}/{world} blocks={sizes} max_err_vs_dense={err:.2e}\n")
    sys.stdout.flush()
    assert err < 1e-12, err
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
