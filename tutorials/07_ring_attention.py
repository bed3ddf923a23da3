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
# # 07 · Ring attention with `ppermute`
#
# Long sequences do not fit on one device. Ring attention splits the sequence over an axis
# `sp`: each instance keeps its block of queries and passes the key/value blocks around a ring
# with `ppermute`, one hop per step, so that after `n` steps every query block has seen every key
# block, while no instance ever holds more than `S/n` keys. The softmax is computed
# *online* (running max and running sum, as in FlashAttention), so the partial results combine
# exactly. We compare with dense causal attention, values and gradients.

# %%
import math

import torch

import named_spmd as ns
from named_spmd import P

torch.manual_seed(0)
B, H, S, Dh = 2, 3, 32, 8
n = 4
mesh = ns.make_mesh((n,), ("sp",))
f64 = torch.float64

# %% [markdown]
# ## The ring, step by step
#
# At step `t`, instance `i` holds the key/value block that started on instance `(i - t) mod n`.
# Let each instance report the block it holds at each step:

# %%
ring = [(i, (i + 1) % n) for i in range(n)]


@ns.spmd_map(mesh=mesh, in_specs=P("sp"), out_specs=P("sp"))
def who_do_i_hold(block_ids):
    held = [block_ids]
    for _ in range(n - 1):
        held.append(ns.ppermute(held[-1], "sp", ring))
    return torch.stack(held, dim=1)  # [1, steps]


schedule = who_do_i_hold(torch.arange(n))
print("         " + "  ".join(f"step {t}" for t in range(n)))
for i, row in enumerate(schedule.tolist()):
    print(f"inst {i}   " + "  ".join(f"kv {b}  " for b in row))
assert schedule.tolist() == [[(i - t) % n for t in range(n)] for i in range(n)]

# %% [markdown]
# ## Ring attention
#
# The causal mask needs global positions: the queries of instance `i` sit at
# `i * S/n + arange(S/n)`, the keys of the block that came from `src` at `src * S/n + ...`.
# `axis_index` gives `i`, and `src` follows from the step. Step 0 (the diagonal block) always
# leaves each query at least one visible key, so the running max is finite from then on.


# %%
def ring_attention(q, k, v):
    """q, k, v: this instance's [B, H, S/n, Dh] blocks of the sequence."""
    n = ns.axis_size("sp")
    me = ns.axis_index("sp")
    s_local = q.shape[-2]
    q_pos = me * s_local + torch.arange(s_local)
    scale = 1 / math.sqrt(q.shape[-1])
    m = torch.full(q.shape[:-1], float("-inf"), dtype=q.dtype)  # running max
    denom = torch.zeros(q.shape[:-1], dtype=q.dtype)  # running sum of exp
    o = torch.zeros_like(q)  # running numerator
    for step in range(n):
        src = (me - step) % n
        k_pos = src * s_local + torch.arange(s_local)
        scores = (q @ k.transpose(-1, -2)) * scale
        scores = scores.masked_fill(k_pos[None, :] > q_pos[:, None], float("-inf"))
        m_new = torch.maximum(m, scores.amax(-1))
        p = torch.exp(scores - m_new[..., None])
        correction = torch.exp(m - m_new)
        denom = denom * correction + p.sum(-1)
        o = o * correction[..., None] + p @ v
        m = m_new
        if step < n - 1:  # pass the key/value block to the next instance
            k, v = ns.ppermute((k, v), "sp", ring)
    return o / denom[..., None]


attend = ns.spmd_map(
    ring_attention, mesh=mesh, in_specs=P(None, None, "sp"), out_specs=P(None, None, "sp")
)


def dense_attention(q, k, v):
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(S, S, dtype=torch.bool).tril()
    return torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1) @ v


# %% [markdown]
# ## Same result as dense attention, values and gradients

# %%
q, k, v = (torch.randn(B, H, S, Dh, dtype=f64, requires_grad=True) for _ in range(3))
with ns.CommMode() as comms:
    out = attend(q, k, v)
    grads = torch.autograd.grad((out * torch.cos(out)).sum(), (q, k, v))
ref = dense_attention(q, k, v)
grads_ref = torch.autograd.grad((ref * torch.cos(ref)).sum(), (q, k, v))
torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
for g, g_ref in zip(grads, grads_ref):
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-12)
print("ring attention == dense causal attention; max |diff| =", (out - ref).abs().max().item())

# %% [markdown]
# ## Communication
#
# Forward: `n-1` hops, each sending a key block and a value block. Backward: the transpose of a
# ring shift is the shift the other way, once per forward hop.

# %%
print(comms.summary())
assert comms.count("ppermute", "sp", "forward") == 2 * (n - 1)
assert comms.count("ppermute", "sp", "backward") == 2 * (n - 1)
assert comms.count(direction="forward") == 2 * (n - 1)  # nothing else

# %% [markdown]
# ## Memory per instance
#
# The score matrix on one instance is `[B, H, S/n, S/n]`, `n**2` times smaller than the dense
# `[B, H, S, S]`. On a long sequence the check-only mode shows the types without allocating
# anything: 256K tokens over 64 instances. (The ring loop runs once per hop, so checking takes
# time proportional to `n`, like tracing it in JAX would.)

# %%
big = ns.spmd_map(
    ring_attention,
    mesh=ns.make_mesh((64,), ("sp",)),
    in_specs=P(None, None, "sp"),
    out_specs=P(None, None, "sp"),
)
long = ns.ShapeDtype((1, 16, 2**18, 128), torch.bfloat16)
report = big.check(long, long, long)
print(report.types[0], "per instance; global output:", report.out)
assert repr(report.types[0]) == "bf16[1,16,4096,128]{sp}"
assert report.comms.count("ppermute", "sp", "forward") == 2 * 63
