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
# # 05 · Gradients, and what they communicate
#
# `spmd_map` is differentiable: `loss.backward()` outside it gives the gradient of the *global*
# function, the same as a single-device program. Every collective has a transpose (psum <->
# pvary, all_gather <-> psum_scatter, ...), and the types decide which communication backward
# needs. `ns.CommMode` shows it, and `.check()` predicts it without running.

# %%
import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

torch.manual_seed(0)
f64 = torch.float64


def leaf(*shape):
    return torch.randn(*shape, dtype=f64, requires_grad=True)


def grads_of(loss, params):
    return torch.autograd.grad(loss, params)


# %% [markdown]
# ## Data parallelism: replicated parameters, split batch
#
# The parameters have spec `P()`: every instance holds the whole of them, so they are
# **invariant** over `dp`. The batch is split over `dp`. Where an invariant parameter meets the
# varying batch, it is implicitly cast to varying (`pvary`: identity forward). The transpose of
# `pvary` is `psum`: that is the data-parallel gradient all-reduce, derived from the types rather
# than written by hand. `w1` is used twice, yet its gradient is reduced once.

# %%
mesh = ns.make_mesh((4,), ("dp",))
params = {"w1": leaf(8, 8), "b1": leaf(8), "w2": leaf(8, 2)}
x, y = torch.randn(32, 8, dtype=f64), torch.randn(32, 2, dtype=f64)


def model(p, x):
    h = torch.tanh(x @ p["w1"] + p["b1"])
    h = torch.tanh(h @ p["w1"] + p["b1"])  # the same weights again
    return h @ p["w2"]


@ns.spmd_map(mesh=mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P())
def dp_loss(p, x, y):
    local = ((model(p, x) - y) ** 2).mean()
    return ns.pmean(local.reshape(1), "dp")  # mean of the per-shard means: the global mean


with ns.CommMode() as comms:
    got = grads_of(dp_loss(params, x, y).sum(), list(params.values()))
print(comms.summary())

want = grads_of(((model(params, x) - y) ** 2).mean(), list(params.values()))
for g, w in zip(got, want):
    torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
assert comms.count("psum", "dp", "backward") == len(params)  # one all-reduce per parameter
assert comms.count(direction="backward") == len(params)

# %% [markdown]
# ## No communication that the types do not require
#
# A replicated value returned as replicated needs nothing in backward; neither does a `psum`
# whose result is replicated (its transpose, `pvary`, is free). JAX's `check_vma=False` mode
# would add defensive all-reduces here.

# %%
w = leaf(4, 4)
with ns.CommMode() as comms:
    ns.spmd_map(lambda w: w, mesh=mesh, in_specs=P(), out_specs=P())(w).sum().backward()
    ns.spmd_map(lambda v: ns.psum(v, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())(
        w
    ).sum().backward()
print(comms.summary())
assert comms.count(direction="backward") == 0

# %% [markdown]
# ## Tensor parallelism: a Megatron MLP
#
# `w1` split by columns and `w2` by rows over `tp`, one `psum` at the end. Read the backward
# lines of the summary:
#
# * `psum over tp` (implicit pvary of `x`): `x` is replicated over `tp` and feeds every `tp`
#   shard, so its gradient is the sum of the shards' contributions (Megatron's "f" operator);
# * `psum over dp`, one per weight: the weights are replicated over `dp`.

# %%
mesh2 = ns.make_mesh((2, 4), ("dp", "tp"))
x = leaf(8, 16)
w1, b1, w2 = leaf(16, 32), leaf(32), leaf(32, 16)


@ns.spmd_map(mesh=mesh2, in_specs=(P("dp"), P(None, "tp"), P("tp"), P("tp")), out_specs=P("dp"))
def megatron_mlp(x, w1, b1, w2):
    return ns.psum(F.gelu(x @ w1 + b1) @ w2, "tp")


with ns.CommMode() as comms:
    out = megatron_mlp(x, w1, b1, w2)
    got = grads_of((out**2).sum(), [x, w1, b1, w2])
print(comms.summary())

ref = F.gelu(x @ w1 + b1) @ w2
torch.testing.assert_close(out, ref)
for g, w in zip(got, grads_of((ref**2).sum(), [x, w1, b1, w2])):
    torch.testing.assert_close(g, w, rtol=0, atol=1e-10)
assert comms.count("psum", "tp", "forward") == 1
assert comms.count("psum", "tp", "backward") == 1  # dx
assert comms.count("psum", "dp", "backward") == 3  # w1, b1, w2

# %% [markdown]
# ## Predict it without running
#
# `.check()` runs the program once on shapes only and reports the same collectives, forward and
# backward (with respect to every floating-point input). Here on 4096 instances with a model
# size nobody would run in a notebook:

# %%
report = megatron_mlp.check(x, w1, b1, w2)
assert sorted(map(repr, report.events)) == sorted(map(repr, comms.events))

big = ns.spmd_map(
    megatron_mlp.fn,
    mesh=ns.make_mesh((64, 64), ("dp", "tp")),
    in_specs=megatron_mlp.in_specs,
    out_specs=P("dp"),
)
report = big.check(
    ns.ShapeDtype((4096, 8192)),
    ns.ShapeDtype((8192, 32768)),
    ns.ShapeDtype((32768,)),
    ns.ShapeDtype((32768, 8192)),
)
print(report)
assert report.comms.count("psum", "dp", "backward") == 3

# %% [markdown]
# ## `pmax` is differentiable
#
# A vocabulary-parallel cross entropy: the logits' vocabulary dim is split over `tp`. A stable
# log-sum-exp needs the global maximum (`pmax`), then a `psum` of the exponentials. JAX cannot
# differentiate `pmax`; here the gradient flows to the instance that holds the maximum.

# %%
logits = leaf(8, 32)
labels = torch.randint(0, 32, (8,))
onehot = F.one_hot(labels, 32).to(f64)


@ns.spmd_map(mesh=mesh2, in_specs=(P("dp", "tp"), P("dp", "tp")), out_specs=P("dp"))
def vocab_parallel_xent(z, onehot):
    m = ns.pmax(z.amax(-1), "tp")
    lse = m + ns.psum(torch.exp(z - m[:, None]).sum(-1), "tp").log()
    picked = ns.psum((z * onehot).sum(-1), "tp")
    return lse - picked


loss = vocab_parallel_xent(logits, onehot)
ref = F.cross_entropy(logits, labels, reduction="none")
torch.testing.assert_close(loss, ref)
torch.testing.assert_close(grads_of(loss.sum(), logits)[0], grads_of(ref.sum(), logits)[0])
print("vocab-parallel cross entropy and its gradient match F.cross_entropy:", loss.detach()[:4])

# %% [markdown]
# ## `torch.compile`
#
# Compile the whole mapped step: `ns.compile(spmd_map(f, ...), fullgraph=True)` (or
# `torch.compile` of a function that calls it, such as a training step) traces it once (types, the out_specs check and every error at trace time) into one graph, forward and
# backward, on either mesh. On a real mesh its collectives are torch's functional collectives,
# so Inductor can fuse the compute around them and overlap them, and `ns.compile` has Inductor
# bucket the gradients' all-reduces into a few (as DDP does eagerly); on the simulated mesh the
# instances are `torch.func.vmap` levels and the collectives plain tensor ops across them, so
# Inductor compiles the whole simulation. The first call pays the compile (seconds for a small
# model; tens of seconds on a real mesh of a busy CPU); later steps run the graph, with no
# recompilation until shapes, dtypes, specs or the mesh change (README, "torch.compile").
# `ns.compile` of a mapped function is `torch.compile` of its own `__call__`: `torch.compile` of
# the mapped function object itself works too, but torch gives every callable object it compiles
# so one shared cache, and the ninth in a process hits Dynamo's recompile limit.


# %%
@ns.spmd_map(mesh=mesh2, in_specs=(P("dp", None), P(None, "tp"), P("tp", None)), out_specs=P())
def mlp_loss(x, w1, w2):
    return ns.pmean(ns.psum(torch.tanh(x @ w1) @ w2, "tp").pow(2).mean(), "dp")


compiled_loss = ns.compile(mlp_loss, backend="aot_eager", fullgraph=True)
x, w1, w2 = leaf(8, 16), leaf(16, 32), leaf(32, 16)
for _ in range(2):  # one trace: the second step runs the graph
    got, want = compiled_loss(x, w1, w2), mlp_loss(x, w1, w2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(grads_of(got, (w1, w2)), grads_of(want, (w1, w2)))
print("the compiled step: same loss and gradients as the eager step")

# %% [markdown]
# Under `ns.CommMode` a call of an `ns.compile`d function runs eagerly, so that it is counted
# (a compiled graph runs no Python to count with); the compiled graph serves the calls after it.

# %%
with ns.CommMode() as comm:
    grads_of(compiled_loss(x, w1, w2), (w1, w2))
with ns.CommMode() as eager_comm:
    grads_of(mlp_loss(x, w1, w2), (w1, w2))
assert comm.counts() == eager_comm.counts()
print(comm.summary())

# %% [markdown]
# To compile a *piece* of the per-device function (a transformer block, as torchtitan compiles
# per block), wrap it in `ns.compile` (`torch.compile`'s options): on a real mesh it compiles
# once with the call's types, its collectives in its graph. In an eager call on the simulated
# mesh torch cannot compile under the simulation's vmap levels, so the piece runs uncompiled
# there, with the same numbers (inside a compiled call it is traced with the call): the same
# per-device code runs on both meshes.

# %%
activation = ns.compile(lambda h: torch.tanh(h) * torch.sigmoid(h), fullgraph=True)


@ns.spmd_map(mesh=mesh2, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp"))
def compiled_piece(x, w):
    return ns.psum(activation(x @ w).sum(-1), "tp")


x, w = leaf(8, 16), leaf(16, 32)
got = compiled_piece(x, w)
want = (torch.tanh(x @ w) * torch.sigmoid(x @ w)).sum(-1)
torch.testing.assert_close(got, want)
torch.testing.assert_close(grads_of(got.sum(), (x, w)), grads_of(want.sum(), (x, w)))
print("a compiled piece inside the per-device function: same values and gradients")
