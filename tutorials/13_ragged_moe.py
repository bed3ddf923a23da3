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
# # 13 · A mixture of experts without capacity: `ragged_all_to_all`
#
# Tutorial 08 gives each expert a fixed capacity of `C` slots per source, so tokens past it are
# dropped and empty slots still travel. Here every token reaches its expert: each instance sorts
# its tokens by expert, and `ns.ragged_all_to_all` (JAX's `jax.lax.ragged_all_to_all`) sends
# each expert's run of rows, whatever its length, to the instance that holds the expert. The
# number of tokens per expert changes every step; the shapes do not (offsets and sizes are int
# tensors, the receive buffer has room for every token), so the same code runs under vmap on the
# simulated mesh and on real processes. We check the layer against a per-token loop, values and
# gradients, and train it a few steps against the same loop.

# %%
import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

torch.manual_seed(0)
n, E, T, D, HID = 4, 8, 8, 6, 12  # instances, experts, tokens per instance, dims
PER = E // n  # experts per instance: expert e lives on instance e // PER
M = n * T  # the receive buffer: room for every token of the mesh
mesh = ns.make_mesh((n,), ("ep",))
f64 = torch.float64

# %% [markdown]
# ## The layer, per instance
#
# One *slot* per expert (`K = E`, a multiple of `n`): slot `e` goes to instance `e // PER`.
# 1. Route top-1, sort the tokens by expert: expert `e`'s rows start at `input_offsets[e]`,
#    there are `send_sizes[e]` of them.
# 2. One `all_to_all` of the sizes tells each instance what it receives (`recv_sizes`, per
#    source and local expert). It lays its buffer out expert by expert (each expert's rows
#    contiguous, for one batched matmul), which gives the offsets *in its own rows*; JAX's
#    `output_offsets` are in the sender's frame, so a second `all_to_all` sends them back.
# 3. `ragged_all_to_all` there, the experts, `ragged_all_to_all` home (sizes and offsets
#    swapped), unsort, gate.


# %%
def exclusive_cumsum(t):
    return torch.cumsum(t, 0) - t


def dispatch_plan(expert):
    """Offsets and sizes of both trips, from each token's expert ([T] ints)."""
    send_sizes = F.one_hot(expert, E).sum(0)  # [E]: tokens for each expert
    input_offsets = exclusive_cumsum(send_sizes)  # the sorted tokens' runs
    recv_sizes = ns.all_to_all(send_sizes, "ep", 0, 0, tiled=True)  # slot s: source s // PER
    # my buffer: local expert p's rows from source 0, 1, ..., then expert p + 1's
    by_expert = recv_sizes.reshape(n, PER).T.reshape(-1)  # [PER * n], expert-major
    placed = exclusive_cumsum(by_expert).reshape(PER, n).T.reshape(-1)  # back to slot order
    output_offsets = ns.all_to_all(placed, "ep", 0, 0, tiled=True)  # the senders' frame
    return input_offsets, send_sizes, output_offsets, recv_sizes, placed


def moe(x, wr, w1, w2):
    probs = torch.softmax(x @ wr, dim=-1)
    gate, expert = probs.max(-1)
    order = torch.argsort(expert, stable=True)
    in_off, send, out_off, recv, placed = dispatch_plan(expert)
    buffer = x.new_zeros(M, D)
    rows = ns.ragged_all_to_all(x[order], buffer, in_off, send, out_off, recv, "ep")  # [M, D]
    # which local expert each received row belongs to (rows past the last are unused)
    ends = torch.cumsum(recv.reshape(n, PER).sum(0), 0)  # [PER]
    local = (torch.arange(M).unsqueeze(1) >= ends).sum(1).clamp(max=PER - 1)  # [M]
    h = F.gelu(torch.einsum("md,mdh->mh", rows, w1[local]))
    done = torch.einsum("mh,mhd->md", h, w2[local])
    # home: read where the rows were placed, write where they came from (in the sender's rows)
    from_offsets = ns.all_to_all(in_off, "ep", 0, 0, tiled=True)
    back = ns.ragged_all_to_all(done, x.new_zeros(T, D), placed, recv, from_offsets, send, "ep")
    y = torch.empty_like(back).index_copy(0, order, back)  # unsort
    return gate.unsqueeze(1) * y


layer = ns.spmd_map(moe, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep"))

# %% [markdown]
# ## Reference: one token at a time
#
# Every token goes to its expert; no masks, no sorting, no collectives.


# %%
def reference(x, wr, w1, w2):
    rows = []
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ wr, dim=-1)
        e = int(probs.argmax())
        rows.append(probs[e] * (F.gelu(x[t] @ w1[e]) @ w2[e]))
    return torch.stack(rows)


x = torch.randn(n * T, D, dtype=f64, requires_grad=True)
wr = torch.randn(D, E, dtype=f64, requires_grad=True)
w1 = torch.randn(E, D, HID, dtype=f64, requires_grad=True)
w2 = torch.randn(E, HID, D, dtype=f64, requires_grad=True)

with ns.CommMode() as comms:
    y = layer(x, wr, w1, w2)
    grads = torch.autograd.grad((y * y.sin()).sum(), (x, wr, w1, w2))
y_ref = reference(x, wr, w1, w2)
grads_ref = torch.autograd.grad((y_ref * y_ref.sin()).sum(), (x, wr, w1, w2))
torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
for name, g, g_ref in zip(["x", "wr", "w1", "w2"], grads, grads_ref):
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12, msg=name)
print("ragged MoE layer == per-token reference, values and gradients")

# %% [markdown]
# The same call, each instance run on its own thread (`ns.simulate_per_instance()`, as on a
# real mesh: there the sizes are read on the host and only the rows travel):

# %%
with ns.simulate_per_instance():
    y_threads = layer(x, wr, w1, w2)
torch.testing.assert_close(y_threads, y_ref, rtol=0, atol=1e-12)
print("per-instance execution: equal")

# %% [markdown]
# ## Communication
#
# Forward: three small `all_to_all`s of sizes and offsets written above, one more inside each
# `ragged_all_to_all` (each slot's offsets seen from the peer), and the two ragged transfers.
# Backward: each ragged transfer's transpose is a ragged transfer back, and the replicated
# router's gradient is summed over `ep`.

# %%
print(comms.summary())
assert comms.count("ragged_all_to_all", "ep", "forward") == 2
assert comms.count("ragged_all_to_all", "ep", "backward") == 2
assert comms.count("all_to_all", "ep", "forward") == 5
assert comms.count("psum", "ep", "backward") == 1

# %% [markdown]
# ## Training: the load changes every step
#
# A few steps of SGD on a regression target, the mapped layer and the per-token loop side by
# side from the same weights. The tokens each expert receives change with the batch and with
# the router's weights; no token is dropped, and the two models stay equal.

# %%
params = [t.detach().clone().requires_grad_() for t in (wr, w1, w2)]
params_ref = [t.detach().clone().requires_grad_() for t in (wr, w1, w2)]
gen = torch.Generator().manual_seed(1)
loads = []
for step in range(4):
    xb = torch.randn(n * T, D, dtype=f64, generator=gen)
    target = torch.randn(n * T, D, dtype=f64, generator=gen)
    loss = ((layer(xb, *params) - target) ** 2).mean()
    loss_ref = ((reference(xb, *params_ref) - target) ** 2).mean()
    torch.testing.assert_close(loss, loss_ref, rtol=0, atol=1e-12)
    for group in (params, params_ref):
        grads = torch.autograd.grad(loss if group is params else loss_ref, group)
        with torch.no_grad():
            for p, g in zip(group, grads):
                p -= 0.5 * g
    loads.append(torch.bincount((xb @ params_ref[0].detach()).argmax(-1), minlength=E).tolist())
    print(f"step {step}: loss {loss.item():.4f}; tokens per expert {loads[-1]}")
for p, p_ref in zip(params, params_ref):
    torch.testing.assert_close(p, p_ref, rtol=0, atol=1e-10)
assert len({tuple(load) for load in loads}) > 1  # the load did change between steps
print("trained 4 steps: equal to the per-token model")

# %% [markdown]
# ## At scale, without running it
#
# 128 experts on 64 instances, 4096 tokens each: `.check()` runs one abstract instance (the
# shapes are static, so one stands for all) and gives the types and the communication.

# %%
n, E, T, D = 64, 128, 4096, 256
PER, M = E // n, n * T
big = ns.spmd_map(moe, mesh=ns.make_mesh((n,), ("ep",)), in_specs=layer.in_specs, out_specs=P("ep"))
report = big.check(
    ns.ShapeDtype((n * T, 256)),
    ns.ShapeDtype((256, E)),
    ns.ShapeDtype((E, 256, 1024)),
    ns.ShapeDtype((E, 1024, 256)),
)
print(report)
assert report.outputs[0].type.shape == (T, 256)

# %% [markdown]
# ## The same program on real processes
#
# `scripts/ragged_moe.py` is this layer and its training as a script: on a simulated mesh with
# `python`, on one process per instance under `torchrun --nproc-per-node 4` (the test suite
# launches it on 4 gloo processes: every rank's losses and trained weights equal the per-token
# model's). Run here as a module, on a simulated mesh:

# %%
import importlib.util  # noqa: E402

spec = importlib.util.spec_from_file_location("ragged_moe", "scripts/ragged_moe.py")
script = importlib.util.module_from_spec(spec)
spec.loader.exec_module(script)
err, script_loads = script.train(ns.make_mesh((4,), ("ep",)), 4)
assert err < 1e-10, err
print(f"scripts/ragged_moe.py on the simulated mesh: equal to the per-token model ({err:.1e})")
print("tokens per expert, per step:", script_loads)
