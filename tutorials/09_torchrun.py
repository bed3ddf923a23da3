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
# # 09 · The same code on real processes, with `torchrun`
#
# Everything so far ran on a *simulated* mesh inside one process. Under `torchrun` (or after
# any `torch.distributed.init_process_group` whose world size equals the mesh size) the very same
# `ns.make_mesh(...)` call returns a real mesh backed by a `DeviceMesh`: one instance per
# process, collectives over gloo (CPU) or NCCL (GPUs). The per-device function does not change.
#
# What does change, at the boundary:
#
# * **inputs** may be plain tensors (the global value, present on every rank: each rank takes
#   its block) or `DTensor`s whose placements match the in_specs;
# * **outputs** are `DTensor`s with placements from the out_specs: `out.full_tensor()` is the
#   global value the simulated mesh returns, `out.to_local()` this rank's block.
#
# We write one script, run it here on a simulated mesh, launch it on 4 real processes, and
# check that both give the same values, the same gradients and the same communication.

# %%
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

import named_spmd as ns

# %% [markdown]
# ## The script
#
# `build(mesh)` is the model: a Megatron MLP on a `dp x tp` mesh. `main()` is what each process
# runs under torchrun: it joins the process group, makes the (now real) mesh, runs a forward and
# backward step on inputs that every rank generates from the same seed, and rank 0 saves what it
# saw.

# %%
SCRIPT = """
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P


def build(mesh):
    def megatron_mlp(x, w1, w2):
        h = F.gelu(x @ w1)  # column parallel over tp
        if not dist.is_initialized() or dist.get_rank() == 0:
            print("  local types:", ns.typeof(x), ns.typeof(w1), ns.typeof(h), flush=True)
        return ns.psum(h @ w2, "tp")  # row parallel, summed over tp

    return ns.spmd_map(
        megatron_mlp, mesh=mesh, in_specs=(P("dp"), P(None, "tp"), P("tp")), out_specs=P("dp")
    )


def inputs():
    g = torch.Generator().manual_seed(0)  # the same global values on every rank
    shapes = [(8, 16), (16, 32), (32, 16)]
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def main(out_path):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))  # real: DeviceMesh-backed, one instance per rank
    print(f"rank {rank}: {mesh!r}", flush=True)
    step = build(mesh)
    args = inputs()
    with ns.CommMode() as comms:
        y = step(*args)  # a DTensor
        full = y.full_tensor()  # a collective itself: every rank calls it
        (full ** 2).sum().backward()
    print(f"rank {rank}: y is a {type(y).__name__} with placements {y.placements}, "
          f"local block {tuple(y.to_local().shape)}", flush=True)
    if rank == 0:
        torch.save(
            {"y": full.detach(), "grads": [a.grad for a in args],
             "events": [repr(e) for e in comms.events if not e.boundary],
             "boundary": [repr(e) for e in comms.events if e.boundary]},
            out_path,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
"""
work = Path(tempfile.mkdtemp(prefix="named_spmd_torchrun_"))
script = work / "megatron_demo.py"
script.write_text(SCRIPT)
print(f"wrote {script}")

# %% [markdown]
# ## Simulated, in this notebook
#
# Import the script as a module and build the model on a simulated mesh: same code, all four
# instances in this process (the function runs once, batched over the instances, so it prints its
# local types once).

# %%
spec = importlib.util.spec_from_file_location("megatron_demo", script)
demo = importlib.util.module_from_spec(spec)
spec.loader.exec_module(demo)

mesh = ns.make_mesh((2, 2), ("dp", "tp"))
print(repr(mesh))
args = demo.inputs()
with ns.CommMode() as sim_comms:
    y_sim = demo.build(mesh)(*args)
    (y_sim**2).sum().backward()
grads_sim = [a.grad for a in args]
print(sim_comms.summary())

# %% [markdown]
# ## On four real processes
#
# `torchrun` starts 4 processes, each running `main()`. On one machine a free port on the
# loopback interface is all the rendezvous needs; the launch has a timeout so that a problem
# fails fast instead of hanging. (On several machines: `torchrun --nnodes 2 --nproc-per-node 8
# --rdzv-backend c10d --rdzv-endpoint HOST:PORT script.py` on each of them, with a mesh of 16.)


# %%
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


results = work / "rank0.pt"
command = [
    sys.executable, "-m", "torch.distributed.run",
    "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
    str(script), str(results),
]  # fmt: skip
env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
print("$", " ".join(command[1:]))
done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=180)
print(done.stdout)
if done.returncode != 0:
    print(done.stderr[-3000:])
assert done.returncode == 0, "torchrun failed"

# %% [markdown]
# ## The same values, gradients and communication
#
# Rank 0 saved the global output (`y.full_tensor()`), the gradients of the inputs and the
# collectives its `CommMode` recorded. They match the simulated run. The real mesh records one
# more kind: its *boundary* collectives (`boundary=True`), which run outside the program, between
# the global values and the processes (the start-of-call check; in backward, the all_gather that
# assembles the gradient of a plain-tensor input split over an axis). A simulated mesh has none.

# %%
real = torch.load(results)
torch.testing.assert_close(real["y"], y_sim.detach(), rtol=0, atol=1e-12)
for g_real, g_sim in zip(real["grads"], grads_sim):
    torch.testing.assert_close(g_real, g_sim, rtol=1e-12, atol=1e-12)
assert sorted(real["events"]) == sorted(repr(e) for e in sim_comms.events)
print("real == simulated: output, 3 gradients, and", len(real["events"]), "collectives")
for line in sorted(real["events"]):
    print("  ", line)
print("and at the call's boundary, on the real mesh only:")
for line in real["boundary"]:
    print("  ", line)

# %% [markdown]
# ## And without either
#
# The check-only mode predicts the same communication from shapes alone:

# %%
report = demo.build(mesh).check(*demo.inputs())
assert sorted(map(repr, report.events)) == sorted(real["events"])
print(report)
