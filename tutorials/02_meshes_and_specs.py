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
# # 02 · Meshes and partition specs
#
# A **mesh** names the axes of your devices; a **partition spec** `P(...)` says, dim by dim, how
# a global tensor is cut into blocks over those axes. `ns.visualize` draws which instance holds
# which block. In this notebook we also *verify* every picture against where the data really
# goes.

# %%
import torch

import named_spmd as ns
from named_spmd import P

try:
    from IPython.display import display
except ImportError:  # pragma: no cover
    display = print

# %% [markdown]
# ## Meshes
#
# Instances are numbered row-major: the last axis varies fastest. `mesh.coords(i)` gives the
# coordinates of instance `i`.

# %%
mesh = ns.make_mesh((2, 4), ("dp", "tp"))
print(mesh, mesh.shape, mesh.axis_names, mesh.size)
display(ns.visualize(mesh))
assert mesh.coords(6) == {"dp": 1, "tp": 2}
assert [mesh.coords(i)["tp"] for i in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]

# %% [markdown]
# ## Partition specs, one picture each
#
# An entry per leading dim: `None` (whole), an axis name (split into that axis' size), or a
# tuple of names (split into the product, first name major). Axes a spec does not name hold
# **copies**: every instance along them holds the same block.

# %%
specs = [P("dp", "tp"), P("tp", "dp"), P(None, "tp"), P(("dp", "tp")), P(("tp", "dp")), P()]
for spec in specs:
    print(ns.visualize(torch.empty(8, 16), mesh, spec), end="\n\n")

# %% [markdown]
# In Jupyter the same view renders as a coloured table (hover a cell for the instances holding
# it):

# %%
display(ns.visualize(torch.empty(8, 16), mesh, P(("tp", "dp"))))

# %% [markdown]
# ## What each instance actually receives
#
# Let every instance report the first element of its block and its coordinates, and compare with
# what the picture says. `x` holds each element's own flat index, so the first element of a block
# is its position in the global tensor. (Stacking the instances' reports along a new dim is itself
# an out_spec: `P(("dp", "tp"))` concatenates the 8 blocks, `dp` major.)

# %%
x = torch.arange(8 * 16, dtype=torch.float64).reshape(8, 16)


def whereabouts(block):
    me = [ns.axis_index(a).reshape(1).double() for a in ("dp", "tp")]
    shape = torch.tensor(block.shape, dtype=torch.float64)
    return torch.cat([block.reshape(-1)[:1], *me, shape]).reshape(1, -1)


for spec in specs:
    rows = ns.spmd_map(whereabouts, mesh=mesh, in_specs=spec, out_specs=P(("dp", "tp")))(x)
    view = ns.visualize(x, mesh, spec)
    for first, dp, tp, *shape in rows.tolist():
        slices = view.block_of({"dp": int(dp), "tp": int(tp)})
        assert x[slices].shape == tuple(int(s) for s in shape) == view.local_shape
        assert x[slices].reshape(-1)[0] == first
print("every picture matches where the data goes")

# %% [markdown]
# ## Outputs: the same specs, read backwards
#
# An out_spec concatenates the instances' blocks along the dims it names. An axis it does not
# name must hold identical values (see tutorial 04); one copy comes back. Naming an axis over
# which the value is identical simply tiles the copies.

# %%
identity = ns.spmd_map(lambda b: b, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))
torch.testing.assert_close(identity(x), x)

tiled = ns.spmd_map(lambda b: b, mesh=mesh, in_specs=P(), out_specs=P("tp"))
torch.testing.assert_close(tiled(x), torch.cat([x] * 4))
print("identity round trip ok; a replicated value named in out_specs is tiled:", tiled(x).shape)

# %% [markdown]
# ## Specs for pytrees
#
# `in_specs` is a pytree *prefix* of the arguments: one `P` applies to every tensor below it.
# Here every parameter is replicated with one `P()`, and the batch is split over `dp`.

# %%
params = {"w1": torch.randn(16, 32), "w2": torch.randn(32, 4)}
batch = torch.randn(8, 16)


@ns.spmd_map(mesh=mesh, in_specs=(P(), P("dp")), out_specs=P("dp"))
def forward(params, x):
    return torch.tanh(x @ params["w1"]) @ params["w2"]


torch.testing.assert_close(forward(params, batch), torch.tanh(batch @ params["w1"]) @ params["w2"])

# %% [markdown]
# ## When a spec does not fit
#
# Every problem is reported at once, with where and how to fix it:

# %%
try:
    ns.spmd_map(lambda a, b: a, mesh=mesh, in_specs=(P("tp", "tp"), P("tpp")), out_specs=P())(
        torch.randn(6, 4), torch.randn(4)
    )
    raise AssertionError("expected an error")
except ns.SpecError as e:
    print(e)
    assert "appears more than once" in str(e) and "unknown mesh axis 'tpp'" in str(e)
