"""``ragged_all_to_all`` (JAX's semantics) and ``all_to_all`` with split sizes on the simulated
mesh, in the vmap execution, the per-instance one and compiled with fullgraph, against
per-instance Python loops (tests/_ragged.py): values, gradients of the operand and of the output buffer, types, the
communication counted and ``.check()``; bad sizes and offsets are clear errors. The real mesh:
tests/dist_worker.py's checks; the declared transposes: tests/test_transpose_rules.py."""

from __future__ import annotations

import contextlib
import re

import pytest
import torch
from _ragged import reference, routing, sized_reference, split_counts

import named_spmd as ns
from named_spmd import P

F64 = torch.float64
EXECUTIONS = {"vmap": contextlib.nullcontext, "per instance": ns.simulate_per_instance}
COMPILED = "compiled with fullgraph"  # torch.compile (aot_eager) of the vmap execution


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _ragged(axes):
    def f(x, out, in_off, send, out_off, recv):
        return ns.ragged_all_to_all(x, out, in_off, send, out_off, recv, axes)

    return f


# (mesh shape, names, the collective's axes, slots per member)
MESHES = [((3,), ("i",), "i", 1), ((2, 2), ("a", "b"), ("b", "a"), 2)]


@pytest.mark.parametrize("execution", [*EXECUTIONS, COMPILED])
@pytest.mark.parametrize("shape, names, axes, per", MESHES, ids=["3", "2x2-tuple-2-slots"])
def test_ragged_all_to_all_values_and_gradients(execution, shape, names, axes, per):
    mesh = ns.make_mesh(shape, names)
    n = mesh.axis_size(axes if isinstance(axes, tuple) else (axes,))
    r = routing(n, per, seed=n + per)
    spec = P(names if len(names) > 1 else names[0])
    # member order of a tuple group is row-major over its axes: ("b", "a") reorders the blocks
    order = list(range(n))  # member -> block
    if len(shape) == 2:
        order = [(m % 2) * 2 + m // 2 for m in range(n)]  # member b * 2 + a holds block a * 2 + b
    member_of_block = {blk: m for m, blk in enumerate(order)}
    x = [_randn(r.rows, 2, seed=i) for i in range(n)]
    out = [_randn(r.m, 2, seed=10 + i) for i in range(n)]
    cot = [_randn(r.m, 2, seed=20 + i) for i in range(n)]
    meta = r.metadata()

    def by_block(values):  # member-ordered values -> the global tensor (blocks in mesh order)
        return torch.cat([values[member_of_block[b]] for b in range(n)])

    def blocks_of(t, rows):  # the global tensor's blocks, member-ordered
        return [t[order[m] * rows : (order[m] + 1) * rows] for m in range(n)]

    metas = [by_block(list(m.split(r.k))) for m in meta]
    xs, outs = (by_block(v).requires_grad_() for v in (x, out))
    f = ns.spmd_map(_ragged(axes), mesh=mesh, in_specs=spec, out_specs=spec)
    if execution == COMPILED:
        torch._dynamo.reset()
        f = torch.compile(f, backend="aot_eager", fullgraph=True)
    with EXECUTIONS.get(execution, contextlib.nullcontext)():
        got = f(xs, outs, *metas)
    (got * by_block(cot)).sum().backward()

    xr, outr = ([v.clone().requires_grad_() for v in vs] for vs in (x, out))
    want = reference(r, xr, outr)
    sum((w * c).sum() for w, c in zip(want, cot)).backward()
    torch.testing.assert_close(blocks_of(got.detach(), r.m), [w.detach() for w in want])
    torch.testing.assert_close(blocks_of(xs.grad, r.rows), [v.grad for v in xr])
    torch.testing.assert_close(blocks_of(outs.grad, r.m), [v.grad for v in outr])


def test_ragged_types_counts_and_check_agree():
    """Varying over the axis (an invariant output buffer too), one all_to_all of the offsets
    and sizes and one ragged_all_to_all each way, in a run and in ``.check()``."""
    mesh = ns.make_mesh((2, 2), ("a", "b"))
    r = routing(2, 1, seed=3)
    meta = [torch.cat([m, m]) for m in r.metadata()]  # the same routing in both groups of "b"

    def f(x, out, *m):
        y = ns.ragged_all_to_all(x, out, *m, "b")
        assert ns.vma(y) == {"a", "b"}
        return y

    specs = (P(("a", "b")), P(), P(("a", "b")), P(("a", "b")), P(("a", "b")), P(("a", "b")))
    g = ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=P(("a", "b")))
    x = _randn(4 * r.rows, 3, seed=0).requires_grad_()
    out = torch.zeros(r.m, 3, dtype=F64, requires_grad=True)
    with ns.CommMode() as comms:
        g(x, out, *meta).sum().backward()
    assert comms.counts() == {
        ("forward", "all_to_all", ("b",)): 1,
        ("forward", "ragged_all_to_all", ("b",)): 1,
        ("backward", "ragged_all_to_all", ("b",)): 1,
        ("backward", "psum", ("a", "b")): 1,  # the invariant output buffer's implicit pvary
    }
    report = g.check(x, out, *meta)
    assert report.outputs[0].type.vma == ns.Vma.of(("a", "b")), report
    assert report.outputs[0].type.shape == (r.m, 3)
    assert report.comms.counts() == comms.counts()


def test_ragged_result_varies_where_the_offsets_do():
    """An operand the same on every instance, sent by offsets that differ along another axis
    ("a"): the result varies over "a" too, and the operand's gradient sums over both axes."""
    mesh = ns.make_mesh((2, 2), ("a", "b"))
    routes = [routing(2, 1, seed=s) for s in (5, 6)]
    rows, m = max(r.rows for r in routes), max(r.m for r in routes)
    metas = [
        torch.cat([routes[a].metadata()[i].reshape(2, -1) for a in (0, 1)]).flatten()
        for i in range(4)
    ]
    seen = []

    def f(x, out, *meta):
        y = ns.ragged_all_to_all(x, out, *meta, "b")
        seen.append(ns.vma(y))
        return y

    specs = (P(), P(), *(P(("a", "b")),) * 4)
    g = ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=P(("a", "b")))
    x = _randn(rows, 2, seed=1).requires_grad_()
    out = torch.zeros(m, 2, dtype=F64)
    report = g.check(x, out, *metas)
    assert report.outputs[0].type.vma == ns.Vma.of(("a", "b")), report
    # the operand's and the output buffer's gradients are summed over both axes (one copy of
    # each fed every instance)
    assert report.comms.counts()[("backward", "psum", ("a", "b"))] == 2, report
    assert ("backward", "psum", ("b",)) not in report.comms.counts(), report
    got = g(x, out, *metas)
    (gx,) = torch.autograd.grad((got * got).sum(), x)
    want, want_gx = torch.zeros(4 * m, 2, dtype=F64), torch.zeros_like(x)
    for a, r in enumerate(routes):
        xr = [x.detach().clone().requires_grad_() for _ in range(2)]
        ys = reference(r, xr, [out.clone(), out.clone()])
        want[2 * a * m : (2 * a + 2) * m] = torch.cat(ys).detach()
        want_gx += sum(torch.autograd.grad(sum((y * y).sum() for y in ys), xr))
    torch.testing.assert_close(got.detach(), want)
    torch.testing.assert_close(gx, want_gx)
    assert seen[-1] == {"a", "b"}


def test_ragged_errors_are_clear():
    mesh = ns.make_mesh((2,), ("i",))
    r = routing(2, 1, seed=1)
    x, out = torch.zeros(2 * r.rows, 2), torch.zeros(2 * r.m, 2)
    f = ns.spmd_map(_ragged("i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    in_off, send, out_off, recv = r.metadata()
    with pytest.raises(ns.CollectiveError, match="1-D integer tensors of one length"):
        f(x, out, in_off.double(), send, out_off, recv)
    with pytest.raises(ns.CollectiveError, match="row shape and dtype"):
        f(x, torch.zeros(2 * r.m, 3), in_off, send, out_off, recv)
    with ns.simulate_per_instance(), pytest.raises(ns.CollectiveError, match="send_sizes must"):
        f(x, out, in_off, send + 1, out_off, recv)
    with ns.simulate_per_instance(), pytest.raises(ns.CollectiveError, match="within the"):
        f(x, out, in_off + r.rows, send, out_off, recv)


def test_all_to_all_with_split_sizes_per_instance():
    mesh = ns.make_mesh((3,), ("i",))
    counts = split_counts(3)
    blocks = [_randn(8, 2, seed=i) for i in range(3)]

    def f(x):
        sizes = counts[int(ns.axis_index("i"))]
        return ns.all_to_all(x, "i", 0, 0, tiled=True, split_sizes=sizes)

    g = ns.spmd_map(f, mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x = torch.cat(blocks).requires_grad_()
    with ns.simulate_per_instance():
        got = g(x)
    cot = _randn(*got.shape, seed=5)
    (got * cot).sum().backward()
    xr = [b.clone().requires_grad_() for b in blocks]
    want = torch.cat(sized_reference(counts, xr))
    (want * cot).sum().backward()
    torch.testing.assert_close(got.detach(), want.detach())
    torch.testing.assert_close(x.grad, torch.cat([b.grad for b in xr]))


def test_all_to_all_split_sizes_under_vmap():
    """Equal sizes are the tiled all_to_all; unequal ones an error with the fix."""
    mesh = ns.make_mesh((2,), ("i",))
    x = torch.arange(8.0)

    def g(sizes):
        return ns.spmd_map(
            lambda v: ns.all_to_all(v, "i", 0, 0, tiled=True, split_sizes=sizes),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P("i"),
        )

    plain = ns.spmd_map(
        lambda v: ns.all_to_all(v, "i", 0, 0, tiled=True),
        mesh=mesh,
        in_specs=P("i"),
        out_specs=P("i"),
    )
    assert torch.equal(g([2, 2])(x), plain(x))
    both = {("forward", "all_to_all", ("i",)): 1, ("backward", "all_to_all", ("i",)): 1}
    assert g([2, 2]).check(x).comms.counts() == both
    with pytest.raises(ns.CollectiveError, match="simulate_per_instance"):
        g([1, 3])(x)
    with pytest.raises(ns.CollectiveError, match="simulate_per_instance"):
        g([1, 3]).check(x)
    with pytest.raises(ns.CollectiveError, match="add up to 2"):
        g([1, 1])(x)
    with pytest.raises(ns.CollectiveError, match="tiled=True"):
        ns.spmd_map(
            lambda v: ns.all_to_all(v, "i", 0, 0, split_sizes=[2, 2]),
            mesh=mesh,
            in_specs=P("i"),
            out_specs=P("i"),
        )(x)


def test_ragged_under_a_vmap_inside_the_function_through_the_bridge():
    """A torch.func.vmap inside the function over the operand, on a mesh whose collectives are
    differentiated by their records (as on a real mesh, tests/_rules_mesh.py): the batching
    rule sends each batch element's rows as the unbatched call would, forward and backward."""
    from _rules_mesh import run_instances

    from named_spmd._autodiff import apply as bridge_apply
    from named_spmd._collectives import RECORDS

    mesh, axes, rec = ns.make_mesh((3,), ("i",)), ("i",), RECORDS["ragged_all_to_all"]
    r = routing(3, 2, seed=4)
    xs = [_randn(2, r.rows, 3, seed=i) for i in range(3)]
    cots = [_randn(2, r.m, 3, seed=10 + i) for i in range(3)]

    def program(ctx):
        k, params = ctx.k, r.params(int(ctx.axis_index(axes)))
        x = xs[k].clone().requires_grad_()
        y = torch.func.vmap(lambda v: bridge_apply(rec, ctx, v, axes, params))(x)
        (gx,) = torch.autograd.grad(y, x, cots[k])
        rows = [xs[k][b].clone().requires_grad_() for b in range(2)]
        one = [bridge_apply(rec, ctx, v, axes, params) for v in rows]
        want = torch.autograd.grad(one, rows, list(cots[k]))
        return y.detach(), torch.stack([o.detach() for o in one]), gx, torch.stack(want)

    for y, want, gx, gwant in run_instances(mesh, program):
        torch.testing.assert_close(y, want)
        torch.testing.assert_close(gx, gwant)


def test_ragged_under_a_vmap_inside_the_function_simulated():
    """The same on the simulated mesh (vmap differentiates its primitives): each batch
    element's rows are sent as the unbatched call sends them, compiled with fullgraph too;
    ``.check()`` agrees on the type."""
    mesh = ns.make_mesh((2,), ("i",))
    r = routing(2, 1, seed=7)
    meta = r.metadata()

    def batched(x, out, *m):
        return torch.func.vmap(lambda v, o: ns.ragged_all_to_all(v, o, *m, "i"))(x, out)

    specs = (P(None, "i"), P(None, "i"), *(P("i"),) * 4)
    g = ns.spmd_map(batched, mesh=mesh, in_specs=specs, out_specs=P(None, "i"))
    one = ns.spmd_map(_ragged("i"), mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    x, out = _randn(3, 2 * r.rows, 2, seed=0), _randn(3, 2 * r.m, 2, seed=1)
    want = torch.stack([one(x[b], out[b], *meta) for b in range(3)])
    torch.testing.assert_close(g(x, out, *meta), want)
    torch._dynamo.reset()
    compiled = torch.compile(g, backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, out, *meta), want)
    assert g.check(x, out, *meta).outputs[0].type.shape == (3, r.m, 2)


def test_ragged_under_a_vmap_inside_the_function_that_batches_the_sizes_is_an_error():
    """Offsets and sizes that a torch.func.vmap inside the function batches (each element would
    send by its own): one CollectiveError, raised before a real mesh reads them (it raised
    torch's "Cannot access data pointer" there, while the simulated mesh sent each element's
    rows; tests/dist_worker.py checks a real mesh), in a compiled call too (with fullgraph:
    the cause of Dynamo's Unsupported); sizes it leaves alone run (the test above)."""
    mesh = ns.make_mesh((2,), ("i",))
    r = routing(2, 1, seed=7)
    meta = r.metadata()

    def sizes_batched(x, out, in_off, send, out_off, recv):
        sends, recvs = torch.stack([send, send * 0]), torch.stack([recv, recv * 0])
        return torch.func.vmap(
            lambda v, s, q: ns.ragged_all_to_all(v, out, in_off, s, out_off, q, "i")
        )(torch.stack([x, 2 * x]), sends, recvs)

    g = ns.spmd_map(sizes_batched, mesh=mesh, in_specs=P("i"), out_specs=P(None, "i"))
    x, out = _randn(2 * r.rows, 2, seed=0), _randn(2 * r.m, 2, seed=1)
    told = r"ragged_all_to_all in `\S*sizes_batched` \(test_ragged.py:\d+\): under torch.func.vmap"
    with pytest.raises(ns.CollectiveError, match=told + ".*that the vmap batches"):
        g(x, out, *meta)
    torch._dynamo.reset()
    with pytest.raises(ns.CollectiveError, match=told + ".*that the vmap batches"):
        torch.compile(g, backend="eager")(x, out, *meta)
    torch._dynamo.reset()
    with pytest.raises(Exception) as fullgraph:  # Dynamo's Unsupported, caused by our error
        torch.compile(g, backend="eager", fullgraph=True)(x, out, *meta)
    assert re.search(told + ".*that the vmap batches", str(fullgraph.value.__cause__))
