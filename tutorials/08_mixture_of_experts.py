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
# # 08 · Mixture of experts with `all_to_all`
#
# Expert parallelism: the experts' weights are split over an axis `ep`, and so are the tokens.
# Each instance routes its own tokens (top-1, with a capacity of `C` slots per expert), packs
# them into a `[experts, C, d]` buffer, and one `all_to_all` delivers each expert's slots to
# the instance that holds that expert. After the experts run, a second `all_to_all` brings the
# results home. We compare with a plain per-token loop, values and gradients.

# %%
import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

torch.manual_seed(0)
n, E, T, D, HID, C = 4, 8, 8, 6, 12, 2  # instances, experts, tokens per instance, dims, capacity
mesh = ns.make_mesh((n,), ("ep",))
f64 = torch.float64

# %% [markdown]
# ## The layer, per instance
#
# Shapes on one instance: `x [T, D]`, the router `wr [D, E]` (replicated), this instance's
# experts `w1 [E/n, D, HID]`, `w2 [E/n, HID, D]`. No data-dependent shapes: routing is
# expressed with one-hot masks, so the same code runs simulated (under vmap) and on real devices.


# %%
def route(x, wr, capacity):
    """Top-1 routing: dispatch mask [T, E, C] and gate [T]."""
    probs = torch.softmax(x @ wr, dim=-1)
    gate, expert = probs.max(-1)
    onehot = (expert[:, None] == torch.arange(wr.shape[-1])).to(x.dtype)  # [T, E]
    position = (torch.cumsum(onehot, 0) - 1) * onehot  # slot in the expert's queue
    slots = (position[..., None] == torch.arange(capacity)).to(x.dtype)  # [T, E, C]
    return slots * onehot[..., None], gate  # tokens past the capacity are dropped


def moe(x, wr, w1, w2):
    dispatch, gate = route(x, wr, C)
    packed = torch.einsum("tec,td->ecd", dispatch, x)  # [E, C, D]: slots per expert
    # expert e lives on instance e // (E/n): send it its slots; receive mine from everyone
    received = ns.all_to_all(packed, "ep", split_axis=0, concat_axis=1, tiled=True)  # [E/n, n*C, D]
    h = F.gelu(torch.einsum("esd,edh->esh", received, w1))
    done = torch.einsum("esh,ehd->esd", h, w2)
    returned = ns.all_to_all(done, "ep", split_axis=1, concat_axis=0, tiled=True)  # [E, C, D]
    return torch.einsum("tec,ecd->td", dispatch * gate[:, None, None], returned)


layer = ns.spmd_map(moe, mesh=mesh, in_specs=(P("ep"), P(), P("ep"), P("ep")), out_specs=P("ep"))

# %% [markdown]
# ## Reference: one token at a time
#
# Each instance's tokens queue for their expert in order; the first `C` of each queue are
# processed, the rest pass through as zeros. No masks, no collectives.


# %%
def reference(x, wr, w1, w2):
    out = torch.zeros_like(x)
    for group in range(n):
        queue = [0] * E
        for t in range(group * T, (group + 1) * T):
            probs = torch.softmax(x[t] @ wr, dim=-1)
            e = int(probs.argmax())
            if queue[e] < C:
                out[t] = probs[e] * (F.gelu(x[t] @ w1[e]) @ w2[e])
            queue[e] += 1
    return out


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
print("MoE layer == per-token reference, values and gradients")

# %% [markdown]
# ## Who got how many tokens
#
# Routing happens per instance, so the load of each expert comes from every instance. Count
# the tokens each expert received and how many its capacity (`n * C` slots) dropped:


# %%
@ns.spmd_map(mesh=mesh, in_specs=(P("ep"), P()), out_specs=P())
def load(x, wr):
    onehot = route(x, wr, T)[0].sum(-1)  # capacity T: nothing dropped, count everything
    wanted = ns.psum(onehot.sum(0), "ep")  # [E]
    kept = ns.psum(route(x, wr, C)[0].sum((0, 2)), "ep")
    return torch.stack([wanted, kept])


wanted, kept = load(x.detach(), wr.detach()).tolist()
print("expert   " + " ".join(f"{e:>3}" for e in range(E)))
print("wanted   " + " ".join(f"{int(v):>3}" for v in wanted))
print("kept     " + " ".join(f"{int(v):>3}" for v in kept))
print(f"dropped {int(sum(wanted) - sum(kept))} of {n * T} tokens")
ref_wanted = torch.bincount((x.detach() @ wr.detach()).argmax(-1), minlength=E)
assert wanted == ref_wanted.double().tolist() and sum(wanted) == n * T
assert all(k <= min(w, n * C) for k, w in zip(kept, wanted))

# %% [markdown]
# ## Communication
#
# Forward: the two all_to_alls. Backward: their transposes (all_to_all with split and concat
# swapped), and one psum over `ep` for the router's gradient, which is replicated.

# %%
print(comms.summary())
assert comms.count("all_to_all", "ep", "forward") == 2
assert comms.count("all_to_all", "ep", "backward") == 2
assert comms.count("psum", "ep", "backward") == 1

# %% [markdown]
# ## At scale, without running it
#
# 128 experts on 64 instances, a million tokens (the capacity stays `C` slots per expert and
# source instance):

# %%
big = ns.spmd_map(
    moe, mesh=ns.make_mesh((64,), ("ep",)), in_specs=layer.in_specs, out_specs=P("ep")
)
report = big.check(
    ns.ShapeDtype((2**20, 1024)),
    ns.ShapeDtype((1024, 128)),
    ns.ShapeDtype((128, 1024, 4096)),
    ns.ShapeDtype((128, 4096, 1024)),
)
print(report)
assert report.outputs[0].global_shape == (2**20, 1024)
assert repr(report.types[0]) == "f32[16384,1024]{ep}"
