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
# # 06 · A transformer block with tensor and sequence parallelism
#
# The layout of Megatron-LM's sequence parallelism, on a `dp x tp` mesh:
#
# * between blocks the activations are split over the **sequence** on `tp` (and the batch on
#   `dp`), so layer norms and residuals run on `1/tp` of the tokens;
# * before attention and the MLP, `all_gather` the sequence over `tp`; the attention heads and
#   the MLP's hidden units are split over `tp` (column-parallel, then row-parallel matmuls);
# * after them, `psum_scatter` over `tp` sums the row-parallel partial results *and* splits the
#   sequence again, in one collective.
#
# We check the forward and every gradient against the same block on one device, look at the
# communication, and type-check the block on 4096 instances.

# %%
import math
import time

import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

try:
    from IPython.display import display
except ImportError:  # pragma: no cover
    display = print

torch.manual_seed(0)
B, S, D, HEADS, HIDDEN = 4, 16, 32, 8, 64
mesh = ns.make_mesh((2, 4), ("dp", "tp"))

# %% [markdown]
# ## The block, written once for one device
#
# `block` takes whatever slices its instance holds. Written with the local shapes in mind it
# reads like the single-device block, except for the four collectives. `heads` is the number of
# heads *per instance*.


# %%
def attention(x, wqkv, wo, heads):
    b, s, _ = x.shape
    q, k, v = (x @ wqkv).chunk(3, dim=-1)
    q, k, v = (t.reshape(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, -1) @ wo


def mlp(x, w1, b1, w2):
    return F.gelu(x @ w1 + b1) @ w2


def block(x, wqkv, wo, w1, b1, w2, heads):
    """x: [b, s, d] on one device; on the mesh: [b/dp, s/tp, d]."""
    h = F.layer_norm(x, x.shape[-1:])
    x = x + attention(h, wqkv, wo, heads)
    h = F.layer_norm(x, x.shape[-1:])
    return x + mlp(h, w1, b1, w2)


def make_sp_block(heads):
    """The per-device block for a model with ``heads`` attention heads in all."""

    def sp_block(x, wqkv, wo, w1, b1, w2):
        tp = ns.axis_size("tp")
        h = ns.all_gather(F.layer_norm(x, x.shape[-1:]), "tp", axis=1, tiled=True)  # [b, s, d]
        a = attention(h, wqkv, wo, heads // tp)  # this instance's heads; partial sum over tp
        x = x + ns.psum_scatter(a, "tp", scatter_dimension=1, tiled=True)
        h = ns.all_gather(F.layer_norm(x, x.shape[-1:]), "tp", axis=1, tiled=True)
        return x + ns.psum_scatter(mlp(h, w1, b1, w2), "tp", scatter_dimension=1, tiled=True)

    return sp_block


# %% [markdown]
# `wqkv` holds q, k and v side by side; to split the *heads* over `tp`, each instance needs its
# columns of all three. We lay the weight out as `[d, tp, 3, d/tp]` before splitting, so that
# `P(None, "tp")` hands instance `t` the q, k and v columns of its heads.


# %%
def heads_major(wqkv, tp):
    d = wqkv.shape[0]
    return wqkv.reshape(d, 3, tp, d // tp).transpose(1, 2).reshape(d, 3 * d)


specs = dict(
    x=P("dp", "tp"),  # batch over dp, sequence over tp
    wqkv=P(None, "tp"),  # column parallel: heads over tp
    wo=P("tp"),  # row parallel
    w1=P(None, "tp"),  # column parallel
    b1=P("tp"),
    w2=P("tp"),  # row parallel
)
step = ns.spmd_map(
    make_sp_block(HEADS), mesh=mesh, in_specs=tuple(specs.values()), out_specs=P("dp", "tp")
)

f64 = torch.float64
params = dict(
    wqkv=torch.randn(D, 3 * D, dtype=f64) / D**0.5,
    wo=torch.randn(D, D, dtype=f64) / D**0.5,
    w1=torch.randn(D, HIDDEN, dtype=f64) / D**0.5,
    b1=torch.randn(HIDDEN, dtype=f64) * 0.1,
    w2=torch.randn(HIDDEN, D, dtype=f64) / HIDDEN**0.5,
)
x = torch.randn(B, S, D, dtype=f64)
display(ns.visualize(x, mesh, specs["x"]))
display(ns.visualize(params["wqkv"], mesh, specs["wqkv"]))

# %% [markdown]
# ## Same numbers as one device, forward and backward

# %%
leaves = {k: v.clone().requires_grad_() for k, v in dict(x=x, **params).items()}
sharded_args = dict(leaves, wqkv=heads_major(leaves["wqkv"], mesh.shape["tp"]))
with ns.CommMode() as comms:
    y = step(*sharded_args.values())
    grads = torch.autograd.grad((y**2).sum(), list(leaves.values()))

dense_leaves = {k: v.clone().requires_grad_() for k, v in dict(x=x, **params).items()}
y_ref = block(*dense_leaves.values(), heads=HEADS)
grads_ref = torch.autograd.grad((y_ref**2).sum(), list(dense_leaves.values()))

torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-12)
for name, g, g_ref in zip(leaves, grads, grads_ref):
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-10, msg=name)
print("forward and all", len(grads), "gradients match the single-device block (float64)")

# %% [markdown]
# ## What one training step communicates, per instance
#
# Forward: 2 all_gathers and 2 psum_scatters over `tp` (no all-reduce at all: that is the point
# of sequence parallelism). Backward: their transposes (psum_scatter <-> all_gather), plus one
# all-reduce over `dp` per weight (the weights are replicated over `dp`).

# %%
print(comms.summary())
assert (
    comms.count("all_gather", "tp", "forward") == comms.count("psum_scatter", "tp", "forward") == 2
)
assert (
    comms.count("all_gather", "tp", "backward")
    == comms.count("psum_scatter", "tp", "backward")
    == 2
)
assert comms.count("psum", "dp", "backward") == len(params)
assert comms.count("psum", "tp") == 0

# %% [markdown]
# ## The same block on 4096 instances, checked on a laptop
#
# `dp=64, tp=64`, a GPT-3-sized layer (d=12288), 2048 x 2048 tokens. `.check()` runs the block once
# on shape-only tensors: it confirms the types (the output varies over `dp` and `tp`, as its
# out_spec says), and reports what one step would send.

# %%
big_mesh = ns.make_mesh((64, 64), ("dp", "tp"))
big_d, big_hidden, big_heads = 12288, 4 * 12288, 128
big = ns.spmd_map(
    make_sp_block(big_heads), mesh=big_mesh, in_specs=tuple(specs.values()), out_specs=P("dp", "tp")
)
shapes = [
    (2048, 2048, big_d),
    (big_d, 3 * big_d),
    (big_d, big_d),
    (big_d, big_hidden),
    (big_hidden,),
    (big_hidden, big_d),
]
args = [ns.ShapeDtype(s, torch.bfloat16) for s in shapes]
big.check(*args)  # the first call warms up
times = []
for _ in range(5):
    start = time.perf_counter()
    report = big.check(*args)
    times.append(time.perf_counter() - start)
display(report)
print(f"checked {big_mesh.size} instances in {1e3 * sorted(times)[2]:.1f} ms (median of 5)")
assert repr(report.types[0]) == "bf16[32,32,12288]{dp,tp}"
assert report.outputs[0].global_shape == (2048, 2048, 12288)
assert report.comms.count("psum", "dp", "backward") == len(params)
