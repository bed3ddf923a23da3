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
# # 11 · Partial sums: unreduced and reduced values
#
# After a row-parallel matmul every instance holds a *partial sum*: the true value is the sum of
# the instances' values. Classic bugs apply an op to such a value before its `psum`: adding
# a replicated bias (counted once per instance), a nonlinear op (the relu of a sum is not the
# sum of relus), a product of two partial sums; or forget the psum; or split a packed weight so
# that a product becomes a partial sum unnoticed. With only "varying" and "invariant" types they
# train to wrong numbers silently. named_spmd has two more per-axis states (as JAX 0.10), and
# infers the partial sums from the specs:
#
# * **unreduced** over A (`{U:tp}`): each instance holds a part of one value;
# * **reduced** over A (`{R:dp}`): one value on every instance, whose *gradient* is left as a
#   partial sum (so that accumulating gradients over microbatches costs one reduction per step).
#
# Linear ops keep a value unreduced (`U + U`, `-U`, `U * 2.0`, `U @ R`, sums, views, slicing);
# everything else raises a `VmaError` that names the op, your line, the axis and the fix.

# %%
import torch

import named_spmd as ns
from named_spmd import P

torch.manual_seed(0)
f64 = torch.float64
mesh = ns.make_mesh((2, 2), ("dp", "tp"))
x = torch.randn(8, 16, dtype=f64)
w1, b1 = torch.randn(16, 32, dtype=f64), torch.randn(32, dtype=f64)
w2, b2 = torch.randn(32, 4, dtype=f64), torch.randn(4, dtype=f64)
specs = (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P())


def dense(x, w1, b1, w2, b2):
    return torch.relu(x @ w1 + b1) @ w2 + b2


# %% [markdown]
# ## The row-parallel product is a partial sum
#
# `h @ w2` contracts the hidden dim, which is split over `tp` on both sides: each instance's
# product is its part of the total. named_spmd infers that from the specs, with no annotation:
# it tracks which dims hold blocks of which axis (from the in_specs, through views, transposes
# and elementwise ops), and a contraction over a dim split over `tp` on both operands is
# unreduced over `tp` (docs/design.md section 2.3). `ns.typeof` shows it.

# %%
types = []


@ns.spmd_map(mesh=mesh, in_specs=specs, out_specs=P("dp", None))
def mlp(x, w1, b1, w2, b2):
    h = torch.relu(x @ w1 + b1)  # column-parallel: varying over tp
    part = h @ w2  # row-parallel: a partial sum, inferred
    types.append(ns.typeof(part))
    return ns.psum(part, "tp") + b2  # the total, then the bias once


torch.testing.assert_close(mlp(x, w1, b1, w2, b2), dense(x, w1, b1, w2, b2))
print(types[0])
assert repr(types[0]) == "f64[4,4]{dp, U:tp}"

# %% [markdown]
# ## Bug 1: the bias added before the psum
#
# Written the ordinary way, the bias is added on every instance and the psum counts it twice
# (here `tp` has 2 instances). The error names the op, the line and the fix.


# %%
@ns.spmd_map(mesh=mesh, in_specs=specs, out_specs=P("dp", None))
def bias_inside(x, w1, b1, w2, b2):
    h = torch.relu(x @ w1 + b1)
    return ns.psum(h @ w2 + b2, "tp")


try:
    bias_inside(x, w1, b1, w2, b2)
    raise AssertionError("expected a VmaError")
except ns.VmaError as e:
    print(e)
    assert "adds a value invariant over 'tp' to a partial sum" in str(e)
    assert "Fix: reduce it first, e.g. y = ns.psum(y, 'tp')" in str(e)

# %% [markdown]
# The same check runs abstractly, without data (`.check()`), and on real processes.

# %%
try:
    bias_inside.check(x, w1, b1, w2, b2)
    raise AssertionError("expected a VmaError")
except ns.VmaError as e:
    assert "adds a value invariant over 'tp' to a partial sum" in str(e)

# %% [markdown]
# ## Bug 2: a nonlinear op on a partial sum, and bug 3: a product of two partial sums


# %%
def check_raises(body, expect):
    f = ns.spmd_map(body, mesh=mesh, in_specs=specs, out_specs=P("dp", None))
    try:
        f(x, w1, b1, w2, b2)
    except ns.VmaError as e:
        print(str(e).splitlines()[0][:160], "...")
        assert expect in str(e), str(e)
        return
    raise AssertionError("expected a VmaError")


def nonlinear(x, w1, b1, w2, b2):
    part = torch.relu(x @ w1 + b1) @ w2
    return ns.psum(torch.tanh(part), "tp")  # tanh of a part: not the tanh of the total


def squared(x, w1, b1, w2, b2):
    part = torch.relu(x @ w1 + b1) @ w2
    return ns.psum(part * part, "tp")  # (a + b)^2 is not a^2 + b^2


check_raises(nonlinear, "tanh is not linear")
check_raises(squared, "multiplies two partial sums")

# %% [markdown]
# Each fix is the one the message names: `ns.psum` first (then `tanh`, or the square, of the
# total), or, when each instance's part really is meant as a local value (a hand-made
# accumulation, as in ring attention), `ns.pcast(part, "tp", to="varying")`.


# %%
@ns.spmd_map(mesh=mesh, in_specs=specs, out_specs=P("dp", None))
def fixed(x, w1, b1, w2, b2):
    part = torch.relu(x @ w1 + b1) @ w2
    total = ns.psum(part, "tp")
    return torch.tanh(total) + total * total


want = dense(x, w1, b1, w2, b2) - b2
torch.testing.assert_close(fixed(x, w1, b1, w2, b2), torch.tanh(want) + want * want)

# %% [markdown]
# ## Bug 4: forgetting the psum
#
# Returned as it is under `P("dp", None)`, the partial sum would come back as one instance's part.
# The out_specs check says so, with both fixes (`P(..., unreduced=...)` or a psum).

# %%
check_raises(lambda x, w1, b1, w2, b2: torch.relu(x @ w1 + b1) @ w2, "it is unreduced over ('tp',)")

# %% [markdown]
# ## Bug 5: a packed qkv weight split along the wrong dim
#
# Attention projects `x` with one packed weight `[d, 3 * d]` and chunks the result into q, k and
# v. Split along its *input* dim (`P("tp", None)`, where `P(None, "tp")` was meant) while `x`
# arrives split over its hidden dim, every instance's `x @ w_qkv` is a partial sum, and so are q
# and k: `q @ k.T` multiplies two of them.

# %%
d = 8
w_qkv = torch.randn(d, 3 * d, dtype=f64)


def scores(x, w_qkv):
    q, k, _ = (x @ w_qkv).chunk(3, dim=-1)
    return torch.softmax(q @ k.T, dim=-1)


wrong = ns.spmd_map(
    scores, mesh=mesh, in_specs=(P("dp", "tp"), P("tp", None)), out_specs=P("dp", None)
)
try:
    wrong(x[:, :d], w_qkv)
    raise AssertionError("expected a VmaError")
except ns.VmaError as e:
    print(str(e).splitlines()[0][:160], "...")
    assert "multiplies two partial sums" in str(e)

# %% [markdown]
# ## Returning the partial sums
#
# An output may stay unreduced: `P(..., unreduced={"tp"})`. The simulated mesh returns the total;
# a real one returns a DTensor with `Partial()` placement (what DTensor users know), reduced when
# someone asks for its value.

# %%
rows = ns.spmd_map(
    lambda x, w1, b1, w2, b2: torch.relu(x @ w1 + b1) @ w2,
    mesh=mesh,
    in_specs=specs,
    out_specs=P("dp", None, unreduced={"tp"}),
)
torch.testing.assert_close(rows(x, w1, b1, w2, b2), dense(x, w1, b1, w2, b2) - b2)

# %% [markdown]
# ## Deferred gradient reduction
#
# In data parallelism a replicated weight's gradient is summed over `dp` in every backward pass
# (the transpose of its implicit pvary). With gradient accumulation over 4 microbatches that is
# 4 reductions per parameter where one would do. Declaring the parameters **reduced**
# (`P(reduced={"dp"})`) leaves their gradients unreduced: no backward communication; on a real
# mesh, parameters placed with `ns.shard` get `Partial()` DTensor gradients that accumulate
# locally. One psum per parameter (an input with `P(unreduced={"dp"})`) then gives the total.

# %%
dp_mesh = ns.make_mesh((2,), ("dp",))
reduced = P(reduced={"dp"})
params = {"w1": torch.randn(16, 32, dtype=f64), "w2": torch.randn(32, 4, dtype=f64)}
dense_params = {k: v.clone().requires_grad_() for k, v in params.items()}
params = ns.shard({k: v.requires_grad_() for k, v in params.items()}, dp_mesh, reduced)


def loss_fn(p, x, y):
    return ns.psum(((torch.tanh(x @ p["w1"]) @ p["w2"] - y) ** 2).sum().reshape(1), "dp")


step = ns.spmd_map(loss_fn, mesh=dp_mesh, in_specs=(reduced, P("dp"), P("dp")), out_specs=P())
total = ns.spmd_map(
    lambda g: ns.psum(g, "dp"), mesh=dp_mesh, in_specs=P(unreduced={"dp"}), out_specs=P()
)
batches = [(torch.randn(8, 16, dtype=f64), torch.randn(8, 4, dtype=f64)) for _ in range(4)]
with ns.CommMode() as comms:
    for xb, yb in batches:
        step(params, xb, yb).sum().backward()
    backward_psums = comms.count("psum", direction="backward")
    grads = {k: total(p.grad) for k, p in params.items()}
print(comms.summary())
assert backward_psums == 0  # nothing communicated for the gradients per microbatch
assert comms.count("psum") == 4 + len(params)  # 4 losses, then one psum per parameter

for xb, yb in batches:  # the dense reference
    ((torch.tanh(xb @ dense_params["w1"]) @ dense_params["w2"] - yb) ** 2).sum().backward()
for k in params:
    torch.testing.assert_close(grads[k], dense_params[k].grad)

# %% [markdown]
# Compare with the usual replicated parameters (`P()`): one backward psum per parameter per
# microbatch.

# %%
plain = ns.spmd_map(loss_fn, mesh=dp_mesh, in_specs=(P(), P("dp"), P("dp")), out_specs=P())
fresh = {k: v.detach().clone().requires_grad_() for k, v in dense_params.items()}
with ns.CommMode() as comms:
    for xb, yb in batches:
        plain(fresh, xb, yb).sum().backward()
assert comms.count("psum", direction="backward") == 4 * len(params)
for k in params:
    torch.testing.assert_close(fresh[k].grad, dense_params[k].grad)

# %% [markdown]
# ## Writing the reduced gradients back for the optimizer
#
# The optimizer reads `p.grad`. After the last microbatch, replace each parameter's partial
# gradient by its total (one psum per parameter, as above), then step and clear the gradients
# for the next accumulation. The total is exactly what a replicated parameter's gradient is: on
# a real mesh `p.grad` is a `Partial()` DTensor and `total(p.grad)` a `Replicate()` one, on the
# simulated mesh both are plain tensors, so the same lines run on both.

# %%
opt = torch.optim.SGD(params.values(), lr=0.1)
dense_opt = torch.optim.SGD(dense_params.values(), lr=0.1)
with torch.no_grad():
    for p in params.values():
        p.grad = total(p.grad)  # the partial sums, reduced: one psum per parameter
opt.step()
dense_opt.step()
opt.zero_grad()
dense_opt.zero_grad()
for k in params:
    torch.testing.assert_close(ns.unshard(params[k]), dense_params[k])
