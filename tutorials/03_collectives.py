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
# # 03 · A tour of the collectives
#
# Collectives are how instances talk. Each one names the mesh axes whose instances take part
# (the *group*). For each collective below we draw every instance's value before and after, and
# check the result against a plain-Python definition written per instance.

# %%
import torch

import named_spmd as ns
from named_spmd import P

mesh = ns.make_mesh((4,), ("i",))
n = mesh.size


def per_instance(f, x):
    """Run ``f`` on every instance of ``mesh``; return the list of per-instance results."""
    stacked = ns.spmd_map(lambda b: f(b).unsqueeze(0), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    return list(stacked(x))


def fmt(t):
    """Whole numbers without the trailing .0, for readable pictures."""

    def clean(v):
        return [clean(u) for u in v] if isinstance(v, list) else int(v) if v == int(v) else v

    return str(clean(t.tolist()))


def picture(title, before, after):
    """One column per instance, a row for before and after."""
    cols = [f"instance {k}" for k in range(len(before))]
    cells = [[fmt(t) for t in before], [fmt(t) for t in after]]
    width = max(len(c) for row in [cols, *cells] for c in row)
    print(title)
    for head, row in zip(["", "before", "after"], [cols, *cells]):
        print((f"  {head:7}" + "  ".join(c.ljust(width) for c in row)).rstrip())
    print()


def check(after, expected):
    for got, want in zip(after, expected, strict=True):
        torch.testing.assert_close(got, torch.as_tensor(want, dtype=got.dtype))


x = torch.arange(8.0)  # instance k holds [2k, 2k+1]
before = list(x.reshape(n, 2))

# %% [markdown]
# ## Reductions: `psum`, `pmean`, `pmax`, `pmin`
#
# Every instance ends up with the elementwise sum (mean, max, min) over the group. The result is
# **invariant** over `i`: identical on every instance.

# %%
total = sum(before)
for name, op, ref in [
    ("psum", ns.psum, total),
    ("pmean", ns.pmean, total / n),
    ("pmax", ns.pmax, torch.stack(before).amax(0)),
    ("pmin", ns.pmin, torch.stack(before).amin(0)),
]:
    after = per_instance(lambda b, op=op: op(b, "i"), x)
    picture(f'{name}(x, "i")', before, after)
    check(after, [ref] * n)

# %% [markdown]
# ## `all_gather`: everyone gets everyone's block
#
# Untiled, the blocks are stacked in a new dim; `tiled=True` concatenates them.

# %%
after = per_instance(lambda b: ns.all_gather(b, "i"), x)
picture('all_gather(x, "i")', before, after)
check(after, [torch.stack(before)] * n)

after = per_instance(lambda b: ns.all_gather(b, "i", tiled=True), x)
picture('all_gather(x, "i", tiled=True)', before, after)
check(after, [x] * n)

# %% [markdown]
# By default (as in JAX) the gathered value keeps its type *varying* over `i`, although every
# instance holds the same data. `to="invariant"` records that it is identical, so it can be
# returned with an out_spec that does not name `i`, and its backward needs no communication.

# %%
types = []


def gathered_types(b):
    types.extend(
        ns.typeof(ns.all_gather(b, "i", tiled=True, to=to)) for to in ("varying", "invariant")
    )
    return ns.all_gather(b, "i", tiled=True, to="invariant")


whole = ns.spmd_map(gathered_types, mesh=mesh, in_specs=P("i"), out_specs=P())(x)
print("to='varying':", types[0], "  to='invariant':", types[1])
assert [repr(t) for t in types] == ["f32[8]{i}", "f32[8]{}"]
torch.testing.assert_close(whole, x)

# %% [markdown]
# ## `psum_scatter`: sum, then instance k keeps block k
#
# The reverse of all_gather (and its transpose: one's gradient is the other). Each instance
# starts with a full-length vector here.

# %%
y = torch.tensor([1.0, 10.0, 100.0, 1000.0]).outer(torch.arange(1.0, 5.0))  # row k: 10**k * [1..4]
rows = list(y)
after = per_instance(lambda b: ns.psum_scatter(b.reshape(-1), "i", tiled=True), y)
picture('psum_scatter(y, "i", tiled=True)', rows, after)
check(after, [sum(rows)[k : k + 1] for k in range(n)])

# %% [markdown]
# ## `all_to_all`: block j goes to instance j
#
# Every instance cuts its value into n chunks and sends chunk j to instance j, which
# concatenates what it receives in source order: a transpose of (instance, chunk). This is the
# communication of expert parallelism (tutorial 08).

# %%
z = torch.arange(16.0)  # instance k holds [4k, 4k+1, 4k+2, 4k+3]
rows = list(z.reshape(n, 4))
after = per_instance(lambda b: ns.all_to_all(b, "i", 0, 0, tiled=True), z)
picture('all_to_all(z, "i", split_axis=0, concat_axis=0, tiled=True)', rows, after)
check(after, [[rows[src][dst] for src in range(n)] for dst in range(n)])

# %% [markdown]
# ## `ppermute` and `pshuffle`: point to point
#
# `ppermute` sends along explicit `(src, dst)` pairs; an instance that receives nothing gets
# zeros. A ring shift is the building block of ring attention (tutorial 07).
# `pshuffle(x, A, perm)` gives instance k the value of instance `perm[k]`.

# %%
ring = [(k, (k + 1) % n) for k in range(n)]
after = per_instance(lambda b: ns.ppermute(b, "i", ring), x)
picture(f'ppermute(x, "i", {ring})', before, after)
check(after, [before[(k - 1) % n] for k in range(n)])

after = per_instance(lambda b: ns.ppermute(b, "i", [(0, 3)]), x)
picture('ppermute(x, "i", [(0, 3)])', before, after)
check(after, [[0, 0], [0, 0], [0, 0], before[0]])

perm = [2, 0, 3, 1]
after = per_instance(lambda b: ns.pshuffle(b, "i", perm), x)
picture(f'pshuffle(x, "i", {perm})', before, after)
check(after, [before[perm[k]] for k in range(n)])

# %% [markdown]
# ## `axis_index` and `axis_size`
#
# Which instance am I, and how many are there? `axis_size` is a plain Python int (no
# communication); `axis_index` is a 0-d tensor that varies over the axis.

# %%
after = per_instance(lambda b: ns.axis_index("i") * 100 + ns.axis_size("i") + b[:1] * 0, x)
picture('axis_index("i") * 100 + axis_size("i")', before, after)
check(after, [[100 * k + n] for k in range(n)])

# %% [markdown]
# ## Several axes at once
#
# On a 2 x 2 mesh, a collective over `"a"` involves the 2 instances that share a `b`
# coordinate; over `("a", "b")` it involves all 4, indexed row-major (`a` major).

# %%
mesh2 = ns.make_mesh((2, 2), ("a", "b"))
w = torch.tensor([1.0, 10.0, 100.0, 1000.0])  # instance (a, b) holds w[2a + b]


def grid(f):
    g = ns.spmd_map(
        lambda b: f(b).reshape(1), mesh=mesh2, in_specs=P(("a", "b")), out_specs=P(("a", "b"))
    )
    return g(w).tolist()


over_a, over_b, over_ab = (
    grid(lambda v: ns.psum(v, "a")),
    grid(lambda v: ns.psum(v, "b")),
    grid(lambda v: ns.psum(v, ("a", "b"))),
)
index_ab = grid(lambda v: ns.axis_index(("a", "b")).to(v.dtype))
print("instance (a,b):      (0,0)  (0,1)  (1,0)  (1,1)")
print("holds              ", w.tolist())
print('psum over "a"      ', over_a)
print('psum over "b"      ', over_b)
print('psum over ("a","b")', over_ab)
print('axis_index(("a","b"))', index_ab)
assert over_a == [101.0, 1010.0, 101.0, 1010.0]
assert over_b == [11.0, 11.0, 1100.0, 1100.0]
assert over_ab == [1111.0] * 4 and index_ab == [0.0, 1.0, 2.0, 3.0]

# %% [markdown]
# ## What the tour communicated
#
# `ns.CommMode` records every logical collective; this is what a real mesh would send.

# %%
with ns.CommMode() as comms:
    per_instance(lambda b: ns.all_gather(ns.psum(b, "i"), "i", tiled=True), x)
    per_instance(lambda b: ns.ppermute(b, "i", ring), x)
print(comms.summary())
assert comms.count("psum") == comms.count("all_gather") == comms.count("ppermute") == 1
