# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 12 · A stencil on a grid that does not divide: uneven blocks and halo exchange
#
# Domain-parallel scientific codes split a grid over devices, and the grid rarely divides by the
# number of devices. Here a heat equation runs on a `10 x 6` plate whose rows are split over 4
# instances: blocks of 3, 3, 3 and 1 rows, as `torch.chunk` (and DTensor's `Shard`) split them.
# Each step, every instance needs one row of each neighbour (its *halo*) to apply the 5-point
# Laplacian at its block's edges; the halos travel with `ns.ppermute`, which sends one row to
# every receiver, whatever the size of the blocks it came from. We compare values and gradients
# with the same computation on the whole grid.

# %%
import itertools
import time

import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

H, W, STEPS, DT = 10, 6, 4, 0.2  # grid rows and columns, time steps, step size (stable: <= 0.25)
n = 4
mesh = ns.make_mesh((n,), ("rows",))
f64 = torch.float64
print("rows per instance:", ns.block_sizes(H, "rows", mesh=mesh))
print("first global row: ", ns.block_offsets(H, "rows", mesh=mesh))
assert ns.block_sizes(H, "rows", mesh=mesh) == (3, 3, 3, 1)

# %% [markdown]
# ## The physics, on the whole grid
#
# `u` is the temperature. The top edge is held at a temperature `hot` (a fixed value above row
# 0), the bottom edge is insulated (the row below the last one mirrors it), the side edges are
# held at 0, and a heater warms rows 6-7, columns 2-3. A step adds `DT * (laplacian + kappa *
# heater)`. `kappa` and `hot` are parameters that we will differentiate.

# %%
HEATER_ROWS, HEATER_COLS = (6, 8), (2, 4)


def laplacian(u, top, bottom):
    """The 5-point Laplacian of the rows ``u``, given the row above and the row below them."""
    padded = F.pad(torch.cat([top, u, bottom]), (1, 1))  # the side edges: 0
    return padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:] - 4 * u


def heater(rows):
    """The heater's strength at the global ``rows`` (a mask over columns too)."""
    on_rows = (rows >= HEATER_ROWS[0]) & (rows < HEATER_ROWS[1])
    on_cols = torch.zeros(W, dtype=f64)
    on_cols[HEATER_COLS[0] : HEATER_COLS[1]] = 1.0
    return on_rows.to(f64)[:, None] * on_cols


def dense_steps(u, kappa, hot):
    source = heater(torch.arange(H))
    for _ in range(STEPS):
        top = hot * torch.ones(1, W, dtype=f64)
        u = u + DT * (laplacian(u, top, u[-1:]) + kappa * source)
    return u


# %% [markdown]
# ## The same steps, per instance
#
# Each instance holds its block `u` of rows. Its halo rows come from its neighbours: the row
# above is the previous instance's last row (a ppermute from `i` to `i + 1`), the row below the
# next instance's first row (from `i + 1` to `i`). The instances at the ends receive nothing
# (ppermute gives them zeros) and apply the boundary conditions instead, found by their axis
# index. The heater is placed by global row numbers: this block's first row, `block_offsets`,
# plus its local row numbers. Nothing else knows that the blocks differ in size.


# %%
def heat_steps(mesh, sizes=None, height=H):
    """The mapped steps on a grid of ``height`` rows; ``sizes``: the rows of each block
    (``ns.Blocks``), or None for ``torch.chunk``'s blocks (``ns.block_sizes``)."""
    if sizes is None:
        entry, offsets = "rows", ns.block_offsets(height, "rows", mesh=mesh)
    else:
        entry, offsets = ns.Blocks("rows", sizes), tuple(itertools.accumulate((0, *sizes[:-1])))

    def steps(u, kappa, hot):
        i = ns.axis_index("rows")
        last = ns.axis_size("rows") - 1
        down = [(j, j + 1) for j in range(last)]  # my last row: the next instance's top halo
        up = [(j + 1, j) for j in range(last)]  # my first row: the previous one's bottom halo
        # my global row numbers (index_select, not offsets[i]: a Python index of a tensor reads
        # its value, which a check, running on shapes only, does not have)
        start = torch.tensor(offsets).index_select(0, i.reshape(1))
        rows = start + torch.arange(u.shape[0])
        source = heater(rows)
        for _ in range(STEPS):
            top = ns.ppermute(u[-1:], "rows", down)
            bottom = ns.ppermute(u[:1], "rows", up)
            top = torch.where(i == 0, hot * torch.ones(1, W, dtype=f64), top)  # the hot edge
            bottom = torch.where(i == last, u[-1:], bottom)  # the insulated edge
            u = u + DT * (laplacian(u, top, bottom) + kappa * source)
        return u, ns.psum(u.sum(), "rows")  # the grid, and its total heat

    spec = P(entry, None)
    return ns.spmd_map(steps, mesh=mesh, in_specs=(spec, P(), P()), out_specs=(spec, P()))


# %% [markdown]
# ## Equal to the whole grid, values and gradients
#
# vmap runs every instance at once on blocks of one shape; blocks of 3 and 1 rows need each
# instance to run on its own. `ns.simulate_per_instance()` asks for that execution (one thread
# per instance, meeting the others at each collective). The loss weighs the final grid; its
# backward runs through every halo exchange (the transpose of a ppermute is the ppermute the
# other way). `kappa` and `hot` are replicated (`P()`), so their gradients are summed over the
# instances that use them.

# %%
g = torch.Generator().manual_seed(0)
u0 = torch.rand(H, W, generator=g, dtype=f64)
kappa, hot = torch.tensor(0.5, dtype=f64), torch.tensor(1.0, dtype=f64)
target = torch.rand(H, W, generator=g, dtype=f64)


def loss_and_grads(run, *args):
    args = [a.clone().requires_grad_() for a in args]
    out = run(*args)
    u = out[0] if isinstance(out, tuple) else out
    loss = (u * target).sum()
    loss.backward()
    return u.detach(), [a.grad for a in args], out


u_dense, grads_dense, _ = loss_and_grads(dense_steps, u0, kappa, hot)
step = heat_steps(mesh)
with ns.simulate_per_instance():
    u_mesh, grads_mesh, (_, total) = loss_and_grads(step, u0, kappa, hot)
torch.testing.assert_close(u_mesh, u_dense)
torch.testing.assert_close(total.detach(), u_dense.sum())
for name, a, b in zip(("u0", "kappa", "hot"), grads_mesh, grads_dense):
    torch.testing.assert_close(a, b)
    print(f"d loss / d {name}: equal to the whole grid's, max |grad| {a.abs().max().item():.4f}")
print("total heat after", STEPS, "steps:", round(total.item(), 6))

# %% [markdown]
# `torch.chunk`'s split leaves the last instance 1 row while the others have 3. A domain
# decomposition may prefer other sizes: `ns.Blocks` gives them (they must add up to the dim),
# and a call with blocks of unequal given sizes runs per instance without asking.

# %%
balanced = heat_steps(mesh, sizes=(3, 3, 2, 2))
u_bal, grads_bal, _ = loss_and_grads(balanced, u0, kappa, hot)
torch.testing.assert_close(u_bal, u_dense)
for a, b in zip(grads_bal, grads_dense):
    torch.testing.assert_close(a, b)
print("blocks of 3, 3, 2, 2 rows: equal to the whole grid, values and gradients")

# %% [markdown]
# ## Types, and the check mode
#
# The types are a real mesh's: a block is `f64[3,6]{rows}` on the first instances and
# `f64[1,6]{rows}` on the last. `.check()` runs an uneven call per instance too, on shapes only
# (meta tensors), and reports instance 0's types, the global output shapes and the collectives:
# two ppermutes per step forward, and their transposes backward.

# %%
with ns.simulate_per_instance():
    report = step.check(ns.ShapeDtype((H, W), f64), ns.ShapeDtype((), f64), ns.ShapeDtype((), f64))
print(report)
assert [repr(t) for t in report.types] == ["f64[3,6]{rows}", "f64[]{}"]
assert report.out[0].shape == (H, W)
assert report.comms.count("ppermute", "rows", "forward") == 2 * STEPS
assert report.comms.count("ppermute", "rows", "backward") == 2 * STEPS

# %% [markdown]
# A collective that takes one shape on every member cannot take the blocks themselves: a
# `psum` of blocks of 3 and 1 rows is an error naming the fix, in the call and in its check
# alike. The total heat above sums a scalar per instance instead.

# %%
bad = ns.spmd_map(lambda u: ns.psum(u, "rows"), mesh=mesh, in_specs=P("rows"), out_specs=P())
for what, run in (("call", bad), ("check", bad.check)):
    with ns.simulate_per_instance():
        try:
            run(u0)
        except ns.SpmdError as e:
            print(f"{what}: {str(e).splitlines()[0][:160]}...")
            assert "different shapes" in str(e)
        else:
            raise AssertionError("a psum of uneven blocks ran")

# %% [markdown]
# ## What the per-instance execution offers, and what it costs
#
# Each instance runs the per-device function on its own thread, with its own block, so the
# function may do what a process of a real mesh does: read values (`.item()`, `print`, a Python
# `if` on a value), as long as every instance calls the same collectives in the same order (a
# mismatch is an error naming the instances, never a hang). Below, each instance reports its
# own rows with `.item()`, which vmap cannot run.
#
# The cost: vmap runs the instances as one batched program; the per-instance execution runs
# them one op at a time, and every collective is a hand-off between threads. On this tiny grid
# that is a fixed cost per collective; on large blocks the ops dominate and the two approach
# each other. Even blocks keep vmap by default.

# %%
seen = {}


def where_am_i(u):
    i = int(ns.axis_index("rows").item())  # a value, read per instance
    first = ns.block_offsets(H, "rows")[i]
    seen[i] = f"{u.shape[0]} rows, global rows {first}..{first + u.shape[0] - 1}"
    return u


with ns.simulate_per_instance():
    ns.spmd_map(where_am_i, mesh=mesh, in_specs=P("rows"), out_specs=P("rows"))(u0)
for i in sorted(seen):
    print(f"instance {i}: {seen[i]}")
assert seen[3] == "1 rows, global rows 9..9"

even = torch.rand(12, W, generator=g, dtype=f64)  # 12 rows: blocks of 3 on every instance


def seconds(run, repeat=5):
    run(even, kappa, hot)  # warm up
    start = time.perf_counter()
    for _ in range(repeat):
        run(even, kappa, hot)
    return (time.perf_counter() - start) / repeat


step12 = heat_steps(mesh, height=12)
vmap_s = seconds(step12)
with ns.simulate_per_instance():
    per_instance_s = seconds(step12)
print(
    f"12 rows, even blocks: vmap {vmap_s * 1e3:.1f} ms, per instance {per_instance_s * 1e3:.1f} ms"
)

# %% [markdown]
# ## The same program on real processes
#
# `scripts/stencil_halo.py` is this program as a script: on a simulated mesh with `python`, on
# one process per instance under `torchrun`, each rank holding its own block of rows (the test
# suite launches it on 4 gloo processes: every rank equal to the whole grid). Run here as a
# module on the simulated mesh, it gives this notebook's values and gradients.

# %%
import importlib.util  # noqa: E402

spec = importlib.util.spec_from_file_location("stencil_halo", "scripts/stencil_halo.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
u_script, grads_script = script.run(mesh)
torch.testing.assert_close(u_script, u_dense)
for a, b in zip(grads_script, grads_dense):
    torch.testing.assert_close(a, b)
print("scripts/stencil_halo.py on the simulated mesh: equal to the whole grid")
print("under torchrun: torchrun --nproc-per-node 4 tutorials/scripts/stencil_halo.py")
