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
# # 01 · Quick start
#
# `named_spmd` lets you write the program **one device** runs and map it over a mesh of
# devices, JAX `shard_map` style. Here the mesh is *simulated*: all 8 "devices" run inside this
# process, so a laptop is enough. The same code runs on real processes under `torchrun`
# (tutorial 09).
#
# This file is a jupytext notebook: open it in Jupyter, or run it as `python
# tutorials/01_quickstart.py`.

# %%
import torch

import named_spmd as ns
from named_spmd import P

try:  # rich HTML in Jupyter, plain text in a terminal
    from IPython.display import display
except ImportError:  # pragma: no cover
    display = print

torch.manual_seed(0)

# %% [markdown]
# ## A mesh: named axes with sizes
#
# 2 x 4 = 8 instances. `dp` (data parallel) splits the batch, `tp` (tensor parallel) splits the
# weights.

# %%
mesh = ns.make_mesh((2, 4), ("dp", "tp"))
display(ns.visualize(mesh))
assert mesh.shape == {"dp": 2, "tp": 4} and mesh.size == 8

# %% [markdown]
# ## A per-device function
#
# `in_specs` say how each global argument is split: `P("dp", None)` cuts dim 0 of `x` into 2
# blocks along `dp`; `P(None, "tp")` cuts dim 1 of `w` into 4 blocks along `tp`. Each instance
# receives its own blocks, computes locally, and talks to the others with collectives **by axis
# name**. `ns.typeof(t)` shows a value's per-instance type: dtype, local shape, and the mesh axes
# it *varies* over.

# %%
seen = {}


@ns.spmd_map(mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp", None))
def mlp(x, w):  # x: local block [8/2, 16], w: local block [16, 32/4]
    h = torch.relu(x @ w)  # varies over dp (from x) and tp (from w)
    partial = h.sum(-1, keepdim=True)  # each tp instance summed only its 8 columns
    y = ns.psum(partial, "tp")  # sum over tp: now identical on every tp instance
    seen.update(x=ns.typeof(x), w=ns.typeof(w), partial=ns.typeof(partial), y=ns.typeof(y))
    return y


x, w = torch.randn(8, 16), torch.randn(16, 32)
y = mlp(x, w)  # global in, global out
for name, t in seen.items():
    print(f"{name:8} {t}")

# %% [markdown]
# The output is the global value: the `dp` blocks are concatenated (`out_specs=P("dp", None)`),
# and one copy is returned along `tp`, which the `psum` made invariant. Check it against the
# same computation on one device:

# %%
dense = torch.relu(x @ w).sum(-1, keepdim=True)
torch.testing.assert_close(y, dense)
assert repr(seen["partial"]) == "f32[4,1]{dp,tp}" and repr(seen["y"]) == "f32[4,1]{dp}"
print("y matches the single-device computation:", tuple(y.shape))

# %% [markdown]
# ## Types catch a wrong `out_specs`
#
# Forget the `psum` and each `tp` instance holds a different partial sum, yet `out_specs`
# promises one replicated copy along `tp`. named_spmd refuses, and says what to do:


# %%
@ns.spmd_map(mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp", None))
def broken(x, w):
    return torch.relu(x @ w).sum(-1, keepdim=True)


try:
    broken(x, w)
    raise AssertionError("expected an error")
except ns.SpmdError as e:
    print(f"{type(e).__name__}: {e}")
    assert "varies over ('tp',)" in str(e)

# %% [markdown]
# ## Gradients, and what they communicate
#
# `spmd_map` is differentiable: the gradient is the gradient of the global function.
# `ns.CommMode` records the collectives a real mesh would run, forward and backward.

# %%
xg, wg = x.double().requires_grad_(), w.double().requires_grad_()  # float64: exact comparison
with ns.CommMode() as comms:
    mlp(xg, wg).square().sum().backward()
print(comms.summary())

xd, wd = x.double().requires_grad_(), w.double().requires_grad_()
torch.relu(xd @ wd).sum(-1, keepdim=True).square().sum().backward()
torch.testing.assert_close(xg.grad, xd.grad)
torch.testing.assert_close(wg.grad, wd.grad)
assert comms.count("psum", "tp", "forward") == 1

# %% [markdown]
# ## Check a configuration you do not own
#
# `.check(...)` runs the function once on shape-only "meta" tensors: no data, no
# communication, no per-instance work. It reports output types and the communication of one
# step, or raises the error a real run would. Here: 4096 instances.

# %%
big_mesh = ns.make_mesh((64, 64), ("dp", "tp"))
big = ns.spmd_map(mlp.fn, mesh=big_mesh, in_specs=mlp.in_specs, out_specs=mlp.out_specs)
report = big.check(ns.ShapeDtype((4096, 8192)), ns.ShapeDtype((8192, 65536)))
display(report)
assert report.outputs[0].global_shape == (4096, 1)
assert repr(report.types[0]) == "f32[64,1]{dp}"
