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
# # 04 · Varying and invariant values, and reading their errors
#
# Inside `spmd_map` every tensor has a type such as `f32[4,8]{dp}`: its dtype, its
# *per-instance* shape, and its **vma**, the set of mesh axes over which its value *may differ*
# between instances. An axis outside the vma is a promise: the value is identical on every
# instance along it (*invariant*). The library infers these types and uses them to reject
# programs that would silently return wrong results.

# %%
import torch

import named_spmd as ns
from named_spmd import P

mesh = ns.make_mesh((2, 4), ("dp", "tp"))
x = torch.randn(8, 16)
w = torch.randn(16, 32)
lookup = torch.randn(16)  # a tensor the function closes over

# %% [markdown]
# ## Where types come from
#
# * an argument varies over the axes its in_spec names;
# * factories (`torch.ones`, `torch.randn`, ...) and closed-over tensors are invariant;
# * `axis_index(a)` varies over `a`;
# * ordinary ops take the **union** of their operands' vma (mixing an invariant value into a
#   varying one is an implicit `pvary`, which matters for gradients: tutorial 05);
# * collectives change the vma by their rule.

# %%
types = {}


@ns.spmd_map(mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp", "tp"))
def show(x, w):
    ones = torch.ones(4)
    h = x @ w
    s = ns.psum(h, "tp")
    g = ns.all_gather(x, "dp", tiled=True, to="invariant")
    types.update(
        {
            "x  (P('dp', None))": x,
            "w  (P(None, 'tp'))": w,
            "torch.ones(4)": ones,
            "closed-over lookup": lookup * 1,
            "axis_index('tp')": ns.axis_index("tp"),
            "x @ w": h,
            "x + lookup": x + lookup,
            "psum(x @ w, 'tp')": s,
            "all_gather(x, 'dp', to='invariant')": g,
            "pvary(ones, 'tp')": ns.pvary(ones, "tp"),
        }
    )
    types.update({k: ns.typeof(v) for k, v in types.items()})
    return h


show(x, w)
for k, t in types.items():
    print(f"{k:38} {t}")
assert {k: repr(t) for k, t in types.items()} == {
    "x  (P('dp', None))": "f32[4,16]{dp}",
    "w  (P(None, 'tp'))": "f32[16,8]{tp}",
    "torch.ones(4)": "f32[4]{}",
    "closed-over lookup": "f32[16]{}",
    "axis_index('tp')": "i64[]{tp}",
    "x @ w": "f32[4,8]{dp,tp}",
    "x + lookup": "f32[4,16]{dp}",
    "psum(x @ w, 'tp')": "f32[4,8]{dp}",
    "all_gather(x, 'dp', to='invariant')": "f32[8,16]{}",
    "pvary(ones, 'tp')": "f32[4]{tp}",
}

# %% [markdown]
# ## Error 1: `out_specs` promise a copy that is not one
#
# An output may leave an axis out of its out_spec only if it is invariant over it: one copy is
# returned, and that copy must stand for all. Here each `tp` instance holds a different partial
# sum. The message names the function, the output, the type, and two fixes.


# %%
def partial_sums(x, w):
    return (x @ w).sum(-1, keepdim=True)


try:
    ns.spmd_map(partial_sums, mesh=mesh, in_specs=(P("dp"), P(None, "tp")), out_specs=P("dp"))(x, w)
    raise AssertionError("expected an error")
except ns.SpmdError as e:
    print(f"{type(e).__name__}: {e}")
    assert isinstance(e, ns.VmaError) and "varies over ('tp',)" in str(e)

# %% [markdown]
# Both fixes work, and mean different things. Fix 1 reduces: the *total* over `tp`. Fix 2 keeps
# every instance's partial sum, concatenated.

# %%
fix1 = ns.spmd_map(
    lambda x, w: ns.psum(partial_sums(x, w), "tp"),
    mesh=mesh,
    in_specs=(P("dp"), P(None, "tp")),
    out_specs=P("dp"),
)(x, w)
fix2 = ns.spmd_map(
    partial_sums, mesh=mesh, in_specs=(P("dp"), P(None, "tp")), out_specs=P("dp", "tp")
)(x, w)
torch.testing.assert_close(fix1, (x @ w).sum(-1, keepdim=True))
torch.testing.assert_close(fix2, (x @ w).reshape(8, 4, 8).sum(-1))
print(
    "fix 1:",
    tuple(fix1.shape),
    "(the sum)   fix 2:",
    tuple(fix2.shape),
    "(one partial sum per tp instance)",
)

# %% [markdown]
# ## Error 2: `psum` of a value that is already the same everywhere
#
# `psum` adds the group's values. If the value is invariant, that multiplies it by the group
# size. JAX's `shard_map` does that silently; it is almost always a bug (a bias added twice, a
# loss scaled by the data-parallel degree), so named_spmd refuses and shows how to say it if you
# mean it.

# %%
bias = torch.randn(4)
try:
    ns.spmd_map(lambda b: ns.psum(b, "tp"), mesh=mesh, in_specs=P(), out_specs=P())(bias)
    raise AssertionError("expected an error")
except ns.SpmdError as e:
    print(f"{type(e).__name__}: {e}")
    assert "invariant over ('tp',)" in str(e) and "axis_size('tp')" in str(e)

meant = ns.spmd_map(lambda b: b * ns.axis_size("tp"), mesh=mesh, in_specs=P(), out_specs=P())(bias)
torch.testing.assert_close(meant, bias * 4)

# %% [markdown]
# ## More messages
#
# Every bad input raises an `ns.SpmdError` (a `RuntimeError`) that says where and how to fix it.


# %%
def expect_error(fn, *args, contains=""):
    try:
        ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))(*args)
    except ns.SpmdError as e:
        print(f"{type(e).__name__}: {e}\n")
        assert contains in str(e), (contains, str(e))
        return
    raise AssertionError("expected an error")


expect_error(lambda x: ns.pvary(x, "dp"), x, contains="already varies over ('dp',)")
expect_error(lambda x: ns.psum(x, "db"), x, contains="unknown mesh axis 'db'")
expect_error(lambda x: ns.ppermute(x, "tp", [(0, 1), (2, 1)]), x, contains="destinations [1]")
expect_error(
    lambda x: ns.all_to_all(x, "dp", 1, 0, tiled=True), torch.randn(8, 3), contains="not divisible"
)
try:
    ns.psum(x, "dp")
except ns.SpmdError as e:
    print(f"{type(e).__name__}: {e}")
    assert "outside spmd_map" in str(e)

# %% [markdown]
# ## Turning the check off
#
# `check_vma=False` trusts the out_specs. For an axis the out_spec does not name, the value of
# the instance at coordinate 0 along that axis is returned: here the first `tp` instance's partial
# sum, which is rarely what you want.

# %%
unchecked = ns.spmd_map(
    partial_sums, mesh=mesh, in_specs=(P("dp"), P(None, "tp")), out_specs=P("dp"), check_vma=False
)(x, w)
torch.testing.assert_close(unchecked, (x @ w[:, :8]).sum(-1, keepdim=True))
print("check_vma=False returned tp instance 0's partial sum")

# %% [markdown]
# ## The same errors without running anything
#
# `.check()` runs the program on shapes only, so a configuration for thousands of devices can be
# checked here. It raises exactly the message a real run raises:

# %%
huge = ns.make_mesh((64, 64), ("dp", "tp"))
bad = ns.spmd_map(partial_sums, mesh=huge, in_specs=(P("dp"), P(None, "tp")), out_specs=P("dp"))
try:
    bad.check(ns.ShapeDtype((4096, 8192)), ns.ShapeDtype((8192, 65536)))
    raise AssertionError("expected an error")
except ns.VmaError as e:
    print(e)
    assert "f32[64,1]{dp,tp}" in str(e)
