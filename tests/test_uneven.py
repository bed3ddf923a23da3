"""Blocks of unequal sizes on the simulated mesh: a dim the axes do not divide is split as
torch.chunk (DTensor's Shard) splits it, or as an ``ns.Blocks`` entry says; such calls run per
instance (``backends/simulated/_per_instance``). Values and gradients against dense
single-device programs and per-instance loops written here."""

from __future__ import annotations

import collections
import re

import optree
import pytest
import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

F64 = torch.float64


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


def _grads(fn, *args):
    args = [a.clone().requires_grad_() for a in args]
    out = fn(*args)
    cot = _randn(*out.shape, seed=99)
    return out.detach(), torch.autograd.grad((out * cot).sum(), args)


def _same_values_and_grads(mapped, dense, *args):
    got, got_grads = _grads(mapped, *args)
    want, want_grads = _grads(dense, *args)
    torch.testing.assert_close(got, want)
    for g, w in zip(got_grads, want_grads):
        torch.testing.assert_close(g, w)


def test_each_instance_sees_its_chunk_and_outputs_concatenate():
    """A per-instance loop: every instance's block is torch.chunk's piece (empty ones included),
    and the blocks concatenate back to the global value."""
    mesh = ns.make_mesh((4,), ("x",))
    seen = {}

    def f(v):
        seen[int(ns.axis_index("x").item())] = v.detach().clone()
        return v * 2

    g = ns.spmd_map(f, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    for n in (10, 5, 3):
        x = torch.arange(float(n))
        seen.clear()
        with ns.simulate_per_instance():
            torch.testing.assert_close(g(x), x * 2)
        pieces = list(x.chunk(4)) + [x[:0]] * (4 - len(x.chunk(4)))
        for i in range(4):
            torch.testing.assert_close(seen[i], pieces[i])


def test_two_axes_reduction_values_and_gradients():
    mesh = ns.make_mesh((2, 3), ("a", "b"))
    mapped = ns.spmd_map(
        lambda x: ns.psum((x * x).sum(1), "b"), mesh=mesh, in_specs=P("a", "b"), out_specs=P("a")
    )
    with ns.simulate_per_instance():
        _same_values_and_grads(mapped, lambda x: (x * x).sum(1), _randn(5, 7, seed=1))


def test_megatron_mlp_with_a_hidden_dim_that_does_not_divide():
    """Column- then row-parallel: the second matmul contracts the uneven tp blocks (a partial
    sum over tp, psum'd), rows split unevenly over dp; gradients of every input."""
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))

    def mlp(x, w1, w2):
        return ns.psum(F.gelu(x @ w1) @ w2, "tp")

    mapped = ns.spmd_map(
        mlp,
        mesh=mesh,
        in_specs=(P("dp", None), P(None, "tp"), P("tp", None)),
        out_specs=P("dp", None),
    )
    args = (_randn(5, 4, seed=2), _randn(4, 10, seed=3), _randn(10, 4, seed=4))
    with ns.simulate_per_instance():
        _same_values_and_grads(mapped, lambda x, w1, w2: F.gelu(x @ w1) @ w2, *args)


def _stencil(v):
    """y[i] = v[i-1] - 2 v[i] + v[i+1], zero outside: the halo from each neighbour by ppermute."""
    n = ns.axis_size("x")
    left = ns.ppermute(v[-1:], "x", [(i, i + 1) for i in range(n - 1)])
    right = ns.ppermute(v[:1], "x", [(i + 1, i) for i in range(n - 1)])
    padded = torch.cat([left, v, right])
    return padded[:-2] - 2 * padded[1:-1] + padded[2:]


def _stencil_dense(v):
    padded = F.pad(v, (1, 1))
    return padded[:-2] - 2 * padded[1:-1] + padded[2:]


@pytest.mark.parametrize("n", [10, 13, 7])
def test_halo_exchange_stencil_on_a_grid_that_does_not_divide(n):
    mesh = ns.make_mesh((4,), ("x",))
    mapped = ns.spmd_map(_stencil, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with ns.simulate_per_instance():
        _same_values_and_grads(mapped, _stencil_dense, _randn(n, seed=n))


def test_halo_exchange_counts_as_under_vmap():
    """The first instance receives no top halo; its zeros still have a backward (as on a real
    mesh), so a CommMode counts the backward ppermutes of every call as vmap does."""
    mesh = ns.make_mesh((4,), ("x",))
    mapped = ns.spmd_map(_stencil, mesh=mesh, in_specs=P("x"), out_specs=P("x"))

    def counts(n):
        x = _randn(n, seed=n).requires_grad_()
        with ns.CommMode() as comms:
            mapped(x).sum().backward()
        return comms.counts()

    even = counts(8)
    assert even[("backward", "ppermute", ("x",))] == 2
    with ns.simulate_per_instance():
        assert counts(8) == counts(10) == even


def test_an_empty_block_where_the_collective_cannot_take_one_is_an_error():
    """9 over 4 is 3, 3, 3, 0: the last instance's halo is empty, which a ppermute of one
    element per member cannot send."""
    mesh = ns.make_mesh((4,), ("x",))
    mapped = ns.spmd_map(_stencil, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="or an empty one"):
        mapped(torch.ones(9))


def test_block_offsets_give_each_instance_its_global_positions():
    mesh = ns.make_mesh((4,), ("x",))

    def positions(v):
        offsets = torch.tensor(ns.block_offsets(10, "x"))
        start = offsets[ns.axis_index("x")]
        return start + torch.arange(v.shape[0])

    mapped = ns.spmd_map(positions, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with ns.simulate_per_instance():
        torch.testing.assert_close(mapped(torch.zeros(10)), torch.arange(10))


def test_explicit_block_sizes_run_per_instance_without_asking():
    mesh = ns.make_mesh((4,), ("x",))
    spec = P(ns.Blocks("x", (4, 3, 3, 0)))
    scale = ns.spmd_map(
        lambda v: v * (ns.axis_index("x") + 1).to(v.dtype), mesh=mesh, in_specs=spec, out_specs=spec
    )
    x = _randn(10, seed=5)
    by_row = torch.tensor([1.0] * 4 + [2.0] * 3 + [3.0] * 3, dtype=F64)  # instance i scales by i+1
    _same_values_and_grads(scale, lambda v: v * by_row, x)
    with pytest.raises(ns.SpecError, match="Fix: give 4 block sizes that add up to 10"):
        ns.spmd_map(
            lambda v: v, mesh=mesh, in_specs=P(ns.Blocks("x", (4, 3, 3))), out_specs=P("x")
        )(x)
    wrong = ns.spmd_map(
        lambda v: v, mesh=mesh, in_specs=spec, out_specs=P(ns.Blocks("x", (1, 3, 3, 3)))
    )
    with pytest.raises(ns.SpecError, match="returned a block of size 4"):
        wrong(x)


@pytest.mark.parametrize("run", ["vmap", "check"])
def test_output_block_sizes_that_the_blocks_do_not_have_are_an_error_on_even_blocks(run):
    """The sizes an out_spec's Blocks entry gives are checked on every execution, the even one
    (vmap, a real mesh, the check mode) included, not only where unequal blocks are joined."""
    mesh = ns.make_mesh((2,), ("x",))
    x = torch.arange(4.0)

    def mapped(sizes):
        return ns.spmd_map(
            lambda v: v, mesh=mesh, in_specs=P("x"), out_specs=P(ns.Blocks("x", sizes))
        )

    call = (lambda f: f(x)) if run == "vmap" else (lambda f: f.check(x))
    with pytest.raises(ns.SpecError, match=r"sizes \(1, 3\), but every block has size 2"):
        call(mapped((1, 3)))
    if run == "vmap":
        torch.testing.assert_close(call(mapped((2, 2))), x)


def test_blocks_sizes_on_one_dim_and_chunks_on_another():
    """A Blocks entry gives its dim's sizes; another dim that its axes do not divide is split as
    torch.chunk splits it (7 over 3: 3, 3, 1), without asking for the per-instance execution."""
    mesh = ns.make_mesh((2, 3), ("x", "y"))
    spec = P(ns.Blocks("x", (1, 3)), "y")
    seen = {}

    def f(v):
        seen[(int(ns.axis_index("x").item()), int(ns.axis_index("y").item()))] = v.detach()
        return v * 2

    mapped = ns.spmd_map(f, mesh=mesh, in_specs=spec, out_specs=spec)
    for cols in (6, 7):
        x = _randn(4, cols, seed=cols)
        seen.clear()
        torch.testing.assert_close(mapped(x), x * 2)
        for i, rows in enumerate(x.split([1, 3])):
            for j, block in enumerate(rows.chunk(3, dim=1)):
                torch.testing.assert_close(seen[(i, j)], block)


def test_uneven_errors_are_clear():
    mesh = ns.make_mesh((4,), ("x",))
    f = ns.spmd_map(lambda v: ns.psum(v, "x"), mesh=mesh, in_specs=P("x"), out_specs=P())
    x = torch.ones(10)
    for _ in range(2):  # a psum of blocks of 3 and 1 elements: asked for per instance or not
        with pytest.raises(ns.SpmdError, match="different shapes") as e:
            f(x)
        assert "Fix" in str(e.value)
        with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="different shapes"):
            f(x)


def test_an_all_to_all_of_blocks_of_different_shapes_names_the_operands_shapes():
    """Rows 3 over 2 (blocks of 2 and 1 rows) exchanged along the columns: the error names the
    members' operands' shapes as given, as a real mesh's does, not the blocks that the exchange
    splits them into (three dims each, which the simulated mesh named)."""
    mesh = ns.make_mesh((2,), ("a",))
    f = ns.spmd_map(
        lambda v: ns.all_to_all(v, "a", 1, 0, tiled=True),
        mesh=mesh,
        in_specs=P("a"),
        out_specs=P("a"),
    )
    x = torch.arange(6.0).reshape(3, 2)
    told = re.escape("different shapes [(2, 2), (1, 2)]")
    for call in (f, f.check):
        with pytest.raises(ns.SpmdError, match=told):
            call(x)
        with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match=told):
            call(x)


def test_tiled_all_gather_of_blocks_differing_off_its_axis_is_an_error():
    """Rows 5 over 2 (3, 2) gathered along the columns: the blocks differ where the gather does
    not concatenate, the SpmdError of a collective over operands of different shapes (a bare
    torch.cat error before); along the rows the blocks concatenate to the global value."""
    mesh = ns.make_mesh((2,), ("a",))
    x = _randn(5, 2, seed=27)
    across = ns.spmd_map(
        lambda v: ns.all_gather(v, "a", axis=1, tiled=True),
        mesh=mesh,
        in_specs=P("a"),
        out_specs=P("a"),
    )
    with pytest.raises(
        ns.SpmdError, match=r"different shapes \[\(3, 2\), \(2, 2\)\].*but along dim 1"
    ):
        across(x)
    with pytest.raises(ns.SpmdError, match="but along dim 1"):
        across.check(x)
    along = ns.spmd_map(
        lambda v: ns.all_gather(v, "a", axis=0, tiled=True, to="invariant"),
        mesh=mesh,
        in_specs=P("a"),
        out_specs=P(),
    )
    torch.testing.assert_close(along(x), x)


_MOVED = {  # a collective of each kind over blocks cut to one shape
    "ppermute": lambda y: ns.ppermute(y, "a", [(0, 1), (1, 2), (2, 0)]),
    "psum": lambda y: ns.psum(y, "a"),
    "all_gather": lambda y: ns.all_gather(y, "a", tiled=True),
    "all_to_all": lambda y: ns.all_to_all(y, "a", 0, 0, tiled=True),
    "pbroadcast": lambda y: ns.pbroadcast(y, "a", 0),
}


@pytest.mark.parametrize("op", sorted(_MOVED))
def test_a_collective_of_blocks_of_different_dtypes_is_an_error(op):
    """Rows 8 over 3 (3, 3, 2): the short block's operand cast to int32 (float32's element
    size: a real mesh would read its bytes as float32), a branch on the block's shape, no value
    read. Every collective raises naming the members' dtypes, in the call and its check (a
    ppermute gave the sender's dtype before, the others a promoted one); one dtype runs."""
    mesh = ns.make_mesh((3,), ("a",))
    x = torch.arange(8.0)

    def mapped(short_dtype):
        def f(v):
            y = v[:3].float() if v.shape[0] == 3 else v.to(short_dtype)[:3]
            return _MOVED[op](torch.cat([y, y])[:3]).sum(0, keepdim=True).double()

        return ns.spmd_map(f, mesh=mesh, in_specs=P("a"), out_specs=P("a"))

    told = re.escape("different dtypes ['float32', 'float32', 'int32'], but ")
    for call in (mapped(torch.int32), mapped(torch.int32).check):
        with pytest.raises(
            ns.SpmdError, match=f"{op} in `\\S*f` \\(test_uneven.py:\\d+\\): .*{told}"
        ):
            call(x)
    assert mapped(torch.float32)(x).dtype == torch.float64  # (the one dtype: no error)


def test_output_blocks_that_cannot_be_laid_back_are_an_error():
    """Rows 5 over a (3, 2) returned under P("b", "a"): the blocks side by side along dim 1 differ
    in height, a SpecError naming both blocks (a bare torch.cat error before); under
    P("a", "b") they lay back to the dense value."""
    mesh = ns.make_mesh((2, 2), ("a", "b"))
    x = _randn(5, 2, seed=29)

    def mapped(out_spec):
        return ns.spmd_map(
            lambda v: ns.pvary(v, "b"), mesh=mesh, in_specs=P("a", None), out_specs=out_spec
        )

    crossed = mapped(P("b", "a"))
    for call in (crossed, crossed.check):
        with pytest.raises(ns.SpecError, match="cannot be laid back under P\\('b', 'a'\\)"):
            call(x)
    torch.testing.assert_close(mapped(P("a", "b"))(x), torch.cat([x, x], 1))


def test_output_blocks_of_different_ranks_or_dtypes_are_an_error():
    """Blocks are concatenated whatever their sizes, not whatever their ranks or dtypes: a
    branch on the block's size that drops a dim or casts on one instance (rows 3, 3, 3, 1) is a
    SpecError naming the output, both instances and the fix, in the call and in .check(); so is
    another dtype at b=1, whose block P("a", None) does not take (a real mesh lays out each
    rank's own; tests/uneven_dist.py has the same errors there)."""
    mesh = ns.make_mesh((4,), ("x",))
    x = _randn(10, 3, seed=35)

    def mapped(last, out_spec=None):
        return ns.spmd_map(
            lambda v: (v * 2, v if v.shape[0] == 3 else last(v)),
            mesh=mesh,
            in_specs=P("x", None),
            out_specs=(P("x", None), out_spec or P("x")),
        )

    blocks = "the instance at {'x': 0} returned a torch.float64 block of rank 2, the instance at"
    for last, wrong in ((lambda v: v.sum(0), "ranks"), (lambda v: v.float(), "dtypes")):
        for call in (mapped(last), mapped(last).check):
            with pytest.raises(ns.SpecError) as raised:
                call(x)
            message = str(raised.value)
            assert f"output[1]: the instances' blocks have different {wrong}: {blocks}" in message
            assert "Fix: return a block of the same rank and dtype on every instance" in message
    kept = mapped(lambda v: v.sum(0, keepdim=True), out_spec=P("x", None))(x)[1]
    torch.testing.assert_close(kept, torch.cat([x[:9], x[9:].sum(0, keepdim=True)]))

    grid = ns.make_mesh((2, 2), ("a", "b"))
    cast_at_b1 = ns.spmd_map(
        lambda v: v.float() if int(ns.axis_index("b").item()) == 1 else v * 1,
        mesh=grid,
        in_specs=P("a", None),
        out_specs=P("a", None),
    )
    at_b1 = "the instance at {'a': 0, 'b': 1} a torch.float32 block of rank 2"
    with pytest.raises(ns.SpecError, match=f"different dtypes: .*{re.escape(at_b1)}"):
        cast_at_b1(_randn(5, 2, seed=36))


def test_an_out_spec_that_fails_on_some_instances_only_names_the_first():
    """Rows 3, 3, 3, 1: the last instance's block loses the dim its out_spec splits. The out_spec
    check of a call run per instance compares every instance's output ranks once all returned
    (a real mesh: after its exchange, so that every rank raises it), naming that instance and
    its block's shape; in the call and in .check(). Where the branch keeps the dim, the call
    returns the blocks concatenated."""
    mesh = ns.make_mesh((4,), ("x",))
    x = _randn(10, 3, seed=37)

    def mapped(last):
        return ns.spmd_map(
            lambda v: v if v.shape[0] == 3 else last(v),
            mesh=mesh,
            in_specs=P("x", None),
            out_specs=P("x", None),
        )

    for call in (mapped(lambda v: v.sum(0)), mapped(lambda v: v.sum(0)).check):
        with pytest.raises(ns.SpecError) as raised:
            call(x)
        message = str(raised.value)
        assert re.match(r"spmd_map of `\S*<lambda>` \(test_uneven.py:\d+\): ", message), message
        assert message.endswith(
            "the outputs of the instance at {'x': 3} do not fit out_specs:\n  - output: "
            "P('x', None) has 2 entries but the tensor has rank 1 (shape [3]). Fix: give at "
            "most 1 entries."
        )
    kept = mapped(lambda v: v.sum(0, keepdim=True))(x)
    torch.testing.assert_close(kept, torch.cat([x[:9], x[9:].sum(0, keepdim=True)]))


@pytest.mark.parametrize(
    "trees, wanted",
    [
        ((lambda v: (v, v), lambda v: (v,)), "returned 2 tensors, the instance at {'x': 3} 1"),
        ((lambda v: (v,), lambda v: ()), "returned 1 tensor, the instance at {'x': 3} 0"),
        ((lambda v: {"a": v}, lambda v: {"b": v}), "returned 1 tensor, the instance at {'x': 3} 1"),
        (  # keys that look like addresses are keys
            (lambda v: {"0x1": v}, lambda v: {"0x2": v}),
            "returned 1 tensor, the instance at {'x': 3} 1",
        ),
    ],
)
def test_instances_returning_different_output_trees_are_an_error(trees, wanted):
    """Rows 3, 3, 3, 1: the last instance returns another output tree (fewer outputs, none, or
    other keys). One SpmdError naming the function, instance 0 and the first instance that
    differs, and the fix, in the call and in .check(), whichever instance finishes last (the
    call is repeated)."""
    mesh = ns.make_mesh((4,), ("x",))
    full, last = trees
    mapped = ns.spmd_map(
        lambda v: full(v) if v.shape[0] == 3 else last(v),
        mesh=mesh,
        in_specs=P("x", None),
        out_specs=P("x", None),
    )
    for call in (mapped, mapped, mapped.check):
        with pytest.raises(ns.SpmdError) as raised:
            call(_randn(10, 3, seed=38))
        message = str(raised.value)
        assert re.match(r"spmd_map of `\S*<lambda>` \(test_uneven.py:\d+\): ", message), message
        assert f"different output trees: the instance at {{'x': 0}} {wanted}" in message
        assert "Fix: return the same tree on every instance" in message


def test_output_trees_equal_but_for_addresses_in_their_metadata_are_one_tree():
    """Each instance returns a defaultdict whose factory is a function of its own (the tree's
    text names its address, as it would differ between processes): the trees are the same,
    and the blocks are laid back as for a plain output (rows 3, 3, 3, 1)."""
    mesh = ns.make_mesh((4,), ("x",))
    x = _randn(10, 3, seed=41)
    mapped = ns.spmd_map(
        lambda v: collections.defaultdict(lambda: None, {"y": 2 * v}),
        mesh=mesh,
        in_specs=P("x", None),
        out_specs=P("x", None),
    )
    out = mapped(x)
    assert isinstance(out, collections.defaultdict)
    torch.testing.assert_close(out["y"], 2 * x)


def test_an_op_on_an_empty_block_is_an_error_naming_the_block():
    """3 rows over 4 are blocks of 1, 1, 1, 0: a max over the rows fails on the empty block. An
    SpmdError of torch's error's family naming the function, the line, the instance, its empty
    block and the fix (torch's error its cause); guarded, the same program runs. .check()
    raises the same error, though meta kernels let a max over an empty dim through (the CPU
    kernel's verdict on the empty operand, ``abstract.as_the_kernel_would``)."""
    mesh = ns.make_mesh((4,), ("x",))
    x = _randn(3, 2, seed=39)

    def rows_max(v):
        return v.max(0, keepdim=True).values

    def guarded(v):
        return rows_max(v) if v.shape[0] > 0 else v

    failing = ns.spmd_map(rows_max, mesh=mesh, in_specs=P("x", None), out_specs=P("x", None))
    with pytest.raises(ns.SpmdError) as raised:
        failing(x)
    assert isinstance(raised.value, IndexError)
    assert isinstance(raised.value.__cause__, IndexError)
    message = str(raised.value)
    assert re.match(r"spmd_map of `\S*rows_max` \(test_uneven.py:\d+\): ", message), message
    assert "a torch op failed at test_uneven.py:" in message
    assert "the instance at x=3, whose block of argument [0] is empty (shape [0, 2])" in message
    assert "Fix: guard the op where the block is empty" in message
    with pytest.raises(ns.SpmdError) as checked:
        failing.check(x)
    assert type(checked.value) is type(raised.value) and str(checked.value) == message
    ok = ns.spmd_map(guarded, mesh=mesh, in_specs=P("x", None), out_specs=P("x", None))
    torch.testing.assert_close(ok(x), x)
    assert ok.check(x).out.shape == (3, 2)


def test_tiled_all_gather_of_uneven_blocks_is_the_global_value():
    mesh = ns.make_mesh((4,), ("x",))
    x = _randn(10, 3, seed=6)
    invariant = ns.spmd_map(
        lambda v: ns.all_gather(v, "x", tiled=True, to="invariant"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P(),
    )
    varying = ns.spmd_map(
        lambda v: ns.all_gather(v, "x", tiled=True), mesh=mesh, in_specs=P("x"), out_specs=P("x")
    )
    with ns.simulate_per_instance():
        _same_values_and_grads(invariant, lambda v: v * 1, x)
        # every instance holds the global value: its blocks, concatenated, are four copies
        _same_values_and_grads(varying, lambda v: torch.cat([v] * 4), x)


def test_tiled_psum_scatter_to_uneven_blocks_and_back():
    """Each instance holds one row; the sum of the rows is scattered in torch.chunk's blocks
    (10 over 4: 3, 3, 3, 1), and gathered back it is the psum."""
    mesh = ns.make_mesh((4,), ("x",))
    y = _randn(4, 10, seed=7)
    scatter = ns.spmd_map(
        lambda v: ns.psum_scatter(v[0], "x", tiled=True),
        mesh=mesh,
        in_specs=P("x", None),
        out_specs=P("x"),
    )
    seen = []

    def round_trip(v):
        block = ns.psum_scatter(v[0], "x", tiled=True)
        seen.append(block.shape[0])
        return ns.all_gather(block, "x", tiled=True, to="invariant")

    back = ns.spmd_map(round_trip, mesh=mesh, in_specs=P("x", None), out_specs=P())
    with ns.simulate_per_instance():
        _same_values_and_grads(scatter, lambda v: v.sum(0), y)
        _same_values_and_grads(back, lambda v: v.sum(0), y)
    assert sorted(seen) == [1, 3, 3, 3]


def _megatron(bias: bool):
    def mlp(x, w1, w2, b):
        h = F.gelu(x @ w1) @ w2
        return ns.psum(h + b if bias else h, "tp") + (0 if bias else b)

    return ns.spmd_map(
        mlp,
        mesh=ns.make_mesh((2, 4), ("dp", "tp")),
        in_specs=(P("dp", None), P(None, "tp"), P("tp", None), P()),
        out_specs=P("dp", None),
    )


def _megatron_args(hidden: int, rows: int):
    return (
        _randn(rows, 4, seed=2),
        _randn(4, hidden, seed=3),
        _randn(hidden, 4, seed=4),
        _randn(4, seed=8),
    )


def test_types_partial_sums_and_accounting_hold_for_uneven_blocks():
    """The partial-sum inference sees the contraction over uneven tp blocks (a bias added
    before the psum is the error it is with even blocks); the out_specs check holds; CommMode
    counts the collectives the even program's vmap execution counts."""
    with ns.simulate_per_instance(), pytest.raises(ns.VmaError, match="unreduced over 'tp'"):
        _megatron(bias=True)(*_megatron_args(10, 5))
    unchecked = ns.spmd_map(
        lambda x: x * 2, mesh=ns.make_mesh((4,), ("x",)), in_specs=P("x"), out_specs=P()
    )
    with ns.simulate_per_instance(), pytest.raises(ns.VmaError, match="varies over"):
        unchecked(torch.ones(10))

    def counts(hidden: int, rows: int):
        args = [a.requires_grad_() for a in _megatron_args(hidden, rows)]
        with ns.CommMode() as comms:
            _megatron(bias=False)(*args).sum().backward()
        return comms.counts()

    even = counts(8, 4)  # vmap
    with ns.simulate_per_instance():
        uneven = counts(10, 5)
    assert uneven == even and even


# --- .check() of uneven calls: per instance, agreeing with the per-instance call --------------


def _tile_psum_scatter(v):
    return ns.psum_scatter(v[0], "x", tiled=True)


def _typed(fn, names):
    """``fn``, recording the types of instance 0's outputs in a call (a check's meta tensors
    have no values to find instance 0 by)."""
    seen = []

    def typed(*args):
        out = fn(*args)
        if not args[0].is_meta and not any(ns.axis_index(a).item() for a in names):
            seen.append([ns.typeof(y) for y in (out if isinstance(out, tuple) else (out,))])
        return out

    return typed, seen


def _megatron_no_bias(x, w1, w2):
    return ns.psum(F.gelu(x @ w1) @ w2, "tp")


def _summed_but_on_the_last_instance(v):
    total = ns.psum(v.sum(0), "x")
    return total if v.shape[0] == 3 else v.sum(0)


def _to_member_0(v):
    """Every row to member 0: split sizes from the block's own size, so per instance."""
    sizes = [v.shape[0]] + [0] * (ns.axis_size("x") - 1)
    return ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=sizes)


CLOSED_OVER = _randn(3, 2, seed=11).requires_grad_()  # a real tensor, met by meta blocks in a check
CLOSED_OVER_ROWS = _randn(2, 3, seed=12)  # one a torch op meets inside a list argument
SOLVE_BY = torch.eye(3, dtype=F64) * 2  # regular; its CPU stand-in (zeros) is not
MLP_SPECS = ((P("dp", None), P(None, "tp"), P("tp", None)), P("dp", None))
X4 = ((4,), ("x",))
AGREE = {
    "psum of uneven blocks": (lambda v: ns.psum(v, "x"), X4, P("x"), P(), (10,)),
    "megatron mlp": (
        _megatron_no_bias,
        ((2, 4), ("dp", "tp")),
        *MLP_SPECS,
        (5, 4),
        (4, 10),
        (10, 4),
    ),
    "bias before the psum": (
        lambda x, w1, w2, b: ns.psum(F.gelu(x @ w1) @ w2 + b, "tp"),
        ((2, 4), ("dp", "tp")),
        (*MLP_SPECS[0], P()),
        MLP_SPECS[1],
        (5, 4),
        (4, 10),
        (10, 4),
        (4,),
    ),
    "halo stencil": (_stencil, X4, P("x"), P("x"), (10,)),
    "halo stencil, an empty block": (_stencil, X4, P("x"), P("x"), (9,)),
    "tiled all_gather": (
        lambda v: ns.all_gather(v, "x", tiled=True, to="invariant"),
        X4,
        P("x"),
        P(),
        (10, 3),
    ),
    "tiled psum_scatter of even inputs": (_tile_psum_scatter, X4, P("x", None), P("x"), (4, 10)),
    "unchecked replication": (lambda v: v * 2, X4, P("x"), P(), (10,)),
    "wrong out Blocks": (lambda v: v, X4, P("x"), P(ns.Blocks("x", (1, 3, 3, 3))), (10,)),
    "a closed-over weight": (lambda v: v @ CLOSED_OVER, X4, P("x"), P("x"), (10, 3)),
    "a closed-over tensor in a list": (
        lambda v: torch.cat([v, CLOSED_OVER_ROWS], 0),
        X4,
        P("x", None),
        P("x", None),
        (10, 3),
    ),
    # errors of some instances only (tests/uneven_dist.py: a real mesh raises them on every rank)
    "partial sums of different shapes": (
        lambda v, w: (v @ w)[: v.shape[1]],
        X4,
        (P(None, "x"), P("x", None)),
        P(unreduced={"x"}),
        (2, 10),
        (10, 2),
    ),
    "replication claimed on the last instance": (
        _summed_but_on_the_last_instance,
        X4,
        P("x", None),
        P(),
        (10, 3),
    ),
    "all_to_all of unequal split sizes": (
        lambda v: ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=[1, 2, 3, 4]),
        X4,
        P("x"),
        P("x"),
        (40,),
    ),
    "all_to_all of every row to member 0": (_to_member_0, X4, P("x", None), P("x"), (10, 3)),
    # ops that meta kernels let through on an empty block (9 rows over 4: 3, 3, 3, 0), or
    # refuse with another error than the CPU kernel's
    "a max over an empty block": (
        lambda v: v.max(0, keepdim=True).values,
        X4,
        P("x", None),
        P("x", None),
        (9, 2),
    ),
    "an amax over an empty block": (
        lambda v: v.amax(0, keepdim=True),
        X4,
        P("x", None),
        P("x", None),
        (9, 2),
    ),
    "a max of an empty block": (lambda v: v.max()[None], X4, P("x"), P("x"), (9,)),
    "an index into an empty block": (lambda v: v[torch.tensor([0])], X4, P("x"), P("x"), (9,)),
    # an op whose CPU stand-ins (zeros) raise of their values, not of the empty block: no error
    "a solve by a closed-over matrix, an empty block": (
        lambda v: torch.linalg.solve(SOLVE_BY, v.T).T,
        X4,
        P("x", None),
        P("x", None),
        (9, 3),
    ),
}


def _outcome(run):
    try:
        return run(), None
    except ns.SpmdError as e:
        return None, (type(e), str(e))


@pytest.mark.parametrize("name", list(AGREE))
def test_check_of_an_uneven_call_agrees_with_the_call(name):
    """Under the per-instance simulation: the same error (type and text), or instance 0's
    output types, the global output shapes and the collectives (forward and backward) that a
    CommMode counts around the call and its backward."""
    fn, (shape, names), in_specs, out_specs, *shapes = AGREE[name]
    typed, seen = _typed(fn, names)
    mapped = ns.spmd_map(
        typed, mesh=ns.make_mesh(shape, names), in_specs=in_specs, out_specs=out_specs
    )
    args = [_randn(*s, seed=i) for i, s in enumerate(shapes)]

    def call():
        grads = [a.clone().requires_grad_() for a in args]
        with ns.CommMode() as comms:
            out = mapped(*grads)
            out.backward(torch.ones_like(out))
        return [tuple(out.shape)], seen[-1], comms.counts()

    def check():
        report = mapped.check(*args)
        return (
            [s.shape for s in optree.tree_leaves(report.out)],
            report.types,
            report.comms.counts(),
        )

    with ns.simulate_per_instance():
        called, call_error = _outcome(call)
        checked, check_error = _outcome(check)
    assert check_error == call_error
    assert checked == called


def test_check_raises_the_error_of_an_op_on_an_empty_tensor_of_the_program():
    """An empty tensor that no input block is (every row sent to member 0: the others receive
    none): torch's error told as a real mesh's rank tells it, naming the instance, in the call
    and in its check."""
    mapped = ns.spmd_map(
        lambda v: _to_member_0(v).amax(0, keepdim=True),
        mesh=ns.make_mesh((4,), ("x",)),
        in_specs=P("x", None),
        out_specs=P("x", None),
    )
    x = _randn(10, 3, seed=13)
    raised = []
    for run in (mapped, mapped.check):
        with ns.simulate_per_instance(), pytest.raises(IndexError) as e:
            run(x)
        raised.append((type(e.value), str(e.value), type(e.value.__cause__)))
    assert raised[0] == raised[1]
    assert issubclass(raised[0][0], ns.SpmdError) and issubclass(raised[0][0], IndexError)
    assert raised[0][2] is IndexError
    assert "on the instance at x=1:\n  IndexError: " in raised[0][1]
    assert "reduction dim 0 to have non-zero size" in raised[0][1]


def test_check_takes_what_the_call_takes():
    """Unequal blocks (``Blocks`` sizes, a dim the axes do not divide) are checked per instance
    without asking, as they run; reading values, which the call does per instance, is told as
    the check's limit."""
    mesh = ns.make_mesh((4,), ("x",))
    spec = P(ns.Blocks("x", (4, 3, 3, 0)))
    g = ns.spmd_map(lambda v: v * 2, mesh=mesh, in_specs=spec, out_specs=spec)
    report = g.check(torch.ones(10))
    assert [str(t) for t in report.types] == ["f32[4]{x}"]
    assert report.out.shape == (10,)
    f = ns.spmd_map(lambda v: v * v.sum().item(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = _randn(10, seed=12)
    want = torch.cat([block * block.sum() for block in x.chunk(4)])
    torch.testing.assert_close(f(x), want)
    with pytest.raises(ns.SpmdError, match="where reading values works, but a check has none"):
        f.check(x)
    report = ns.spmd_map(_stencil, mesh=mesh, in_specs=P("x"), out_specs=P("x")).check(x)
    assert [str(t) for t in report.types] == ["f64[3]{x}"] and report.out.shape == (10,)


def test_split_sizes_read_from_the_index_are_the_check_s_limit_naming_the_line():
    """Split sizes read from a value (here the instance's index) run per instance; a check has
    no values, so it says so, naming the line."""
    counts = (
        (0, 1, 2, 5),
        (5, 2, 1, 0),
        (1, 1, 1, 5),
        (1, 3, 3, 1),
    )  # member j receives 7, 7, 7, 11

    def by_index(v):
        sizes = list(counts[int(ns.axis_index("x"))])
        return ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=sizes)

    mapped = ns.spmd_map(
        by_index, mesh=ns.make_mesh((4,), ("x",)), in_specs=P("x"), out_specs=P("x")
    )
    x = _randn(32, seed=14)
    blocks = x.split([sum(c) for c in counts])
    want = torch.cat([torch.cat([b.split(c)[j] for b, c in zip(blocks, counts)]) for j in range(4)])
    with ns.simulate_per_instance():
        torch.testing.assert_close(mapped(x), want)
        with pytest.raises(ns.SpmdError) as raised:
            mapped.check(x)
    message = str(raised.value)
    assert "needs tensor values at test_uneven.py:" in message
    assert "sizes = list(counts[int(ns.axis_index(" in message
    assert "where reading values works, but a check has none" in message


def test_a_dim_the_axes_do_not_divide_runs_per_instance_by_default():
    """10 over 4 without asking: torch.chunk's blocks, run per instance, values and gradients the
    dense program's, as under ``simulate_per_instance()``; an even call still runs under vmap
    (its ``.item()`` is the vmap limit's error)."""
    mesh = ns.make_mesh((4,), ("x",))
    mapped = ns.spmd_map(_stencil, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    x = _randn(10, seed=10)
    _same_values_and_grads(mapped, _stencil_dense, x)
    with ns.simulate_per_instance():
        _same_values_and_grads(mapped, _stencil_dense, x)
    reads = ns.spmd_map(lambda v: v * v.sum().item(), mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with pytest.raises(ns.SpmdError, match="simulated mesh"):
        reads(_randn(8, seed=11))


_READS = {  # per program: whether it reads a varying value (or sizes a tensor by one)
    "item": (lambda v, k, m: v.sum().item(), True),
    "bool": (lambda v, k, m: bool(v.sum() > 0), True),
    "int": (lambda v, k, m: int(v[0]), True),
    "tolist": (lambda v, k, m: v.tolist(), True),
    "mask": (lambda v, k, m: v[v > 0], True),
    "mask in a tuple": (lambda v, k, m: v[None, v > 0], True),
    "nonzero": (lambda v, k, m: v.nonzero(), True),
    "unique": (lambda v, k, m: torch.unique(v), True),
    "where of one argument": (lambda v, k, m: torch.where(v > 0), True),
    "a size": (lambda v, k, m: torch.zeros((v > 0).sum()), True),
    "a slice's bound": (lambda v, k, m: v[: (v > 0).sum()], True),
    "a view's size": (lambda v, k, m: v.view((v > 0).sum() * 0 + 2, -1), True),
    "an invariant value": (lambda v, k, m: v[: int(k)], False),
    "an invariant mask": (lambda v, k, m: v[m], False),
    "an integer index": (lambda v, k, m: v[v.argsort()], False),
    "where of three": (lambda v, k, m: torch.where(v > 0, v, 0.0), False),
    "shapes": (lambda v, k, m: torch.zeros(v.shape[0]), False),
}


@pytest.mark.parametrize("name", sorted(_READS))
def test_reads_of_varying_values_are_noted(name):
    """A read of a varying value (or a shape made from one) marks the call
    (``SpmdContext.values_read``): from there its instances may make other shapes, so a real
    mesh compares its outputs' (tests/uneven_dist.py); reads of invariant values and shapes
    made from shapes do not."""
    from named_spmd import _calls

    read, noted = _READS[name]
    seen = []

    def f(v, k, m):
        read(v, k, m)
        seen.append(_calls.active().values_read)
        return v

    mesh = ns.make_mesh((2,), ("x",))
    mapped = ns.spmd_map(f, mesh=mesh, in_specs=(P("x"), P(), P()), out_specs=P("x"))
    with ns.simulate_per_instance():
        mapped(_randn(8, seed=5), torch.tensor(2), torch.tensor([True, False, True, True]))
    assert seen == [noted, noted]


@pytest.mark.distributed
def test_real_mesh_takes_uneven_blocks_as_the_simulated_one():
    """One 4-process launch (gloo) runs every case of tests/uneven_dist.py on real meshes (4,)
    and (2, 2) and, in the same processes, on simulated ones: uneven inputs and outputs (5 rows
    over 2, 10 over 4, 9 over 4 with an empty block, explicit Blocks sizes), tiled all_gather
    (of given sizes, to invariant, varying and reduced) and psum_scatter to torch.chunk's
    blocks, uneven DTensors in and out (fed back in); values, gradients and CommMode counts
    against the simulated per-instance execution and a dense program, output types (DTensor
    where Shard holds the blocks, else the global value), the same errors on every rank (out_specs
    errors of some ranks only, outputs all P() compared too, unequal split sizes of an even
    call's all_to_all, on one member only too) and the next call running after them, and
    the DTensors whose blocks are not the spec's refused; ragged_all_to_all metadata that some
    members get wrong (sizes that disagree, a slice outside), in a first and in replayed calls:
    the first member's error on every rank, no collective added; the process-group calls of uneven
    calls (one exchange of operand shapes per collective, of output shapes unless they are the
    last call's, on some ranks only too); even calls of split sizes the
    real mesh alone runs (a collective some ranks call, a .local call's unequal sizes); and
    even calls that read values (boolean masks, branches on values: the outputs' shapes,
    trees and out_specs errors compared, as the per-instance execution's; replayed on some
    ranks and typed on others)."""
    import json
    import os

    import uneven_dist
    from _dist_launch import launch

    finished = launch([os.path.join("tests", "uneven_dist.py")], 4, 300)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    rows = [json.loads(line) for line in finished.lines("OUTCOME")]
    cases = uneven_dist.CASES + uneven_dist.ERRORS + uneven_dist.REFUSED + uneven_dist.COUNTED
    cases += uneven_dist.REPLAYED + uneven_dist.ROWS + uneven_dist.OWN_PROGRAMS + uneven_dist.ALONE
    cases += uneven_dist.UNDIFFERENTIABLE + uneven_dist.PLANS_APART + uneven_dist.TYPES_APART
    cases += uneven_dist.TYPES_APART_GRAD + uneven_dist.RAGGED_REPLAYED
    cases = [c.name for c in cases]
    assert sorted((r["case"], r["rank"]) for r in rows) == sorted(
        (c, rank) for c in cases for rank in range(4)
    ), finished.outputs[0][-3000:]
    bad = [r for r in rows if r["problems"]]
    assert not bad, "\n".join(f"{r['case']} rank {r['rank']}: {r['problems']}" for r in bad[:4])
    assert finished.returncodes == [0] * 4


def _global_mean_by_block_count(v):
    return ns.psum(v.sum(), "x") / v.numel()  # v.numel(): a Python int, this block's


def _block_rows_as_a_factory(v):
    return torch.full((), float(v.shape[0]))


@pytest.mark.parametrize("f", [_global_mean_by_block_count, _block_rows_as_a_factory])
def test_an_invariant_output_made_of_a_block_size_is_refused(f):
    """Over blocks of 3, 3, 3 and 1 rows, a number taken from the block's size differs between
    instances though its tensor is typed invariant: the out_spec P() would return instance 0's
    value (a real mesh: each rank its own). The per-instance execution compares them."""
    mapped = ns.spmd_map(f, mesh=ns.make_mesh((4,), ("x",)), in_specs=P("x"), out_specs=P())
    with pytest.raises(ns.VmaError, match=r"output is typed invariant over x .* x=0 and x=3"):
        mapped(torch.arange(10.0))
    unchecked = ns.spmd_map(f, mesh=mapped.mesh, in_specs=P("x"), out_specs=P(), check_vma=False)
    first_block = 3.0 if f is _block_rows_as_a_factory else 45.0 / 3  # instance 0's 3 rows
    torch.testing.assert_close(unchecked(torch.arange(10.0)), torch.tensor(first_block))


def test_an_invariant_output_alike_on_every_instance_passes_over_uneven_blocks():
    """The global mean from every block's size (ns.block_sizes, alike on every instance), on a
    mesh whose other axis the output is invariant over too."""
    mesh = ns.make_mesh((4, 2), ("x", "y"))

    def mean(v):
        return ns.psum(v.sum(), "x") / sum(ns.block_sizes(10, "x"))

    f = ns.spmd_map(mean, mesh=mesh, in_specs=P("x"), out_specs=P())
    torch.testing.assert_close(f(torch.arange(10.0)), torch.tensor(4.5))


# torch warns on making any complex32 tensor: the dtype is what this test is about
@pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning")
@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.complex32]
)
def test_nan_outputs_alike_on_every_instance_pass_over_uneven_blocks(dtype):
    """NaN is one value on every instance, whatever the dtype (float8's compared in float32,
    complex32's in complex64: torch.equal has no kernel for it)."""
    f = ns.spmd_map(
        lambda v: torch.full((2,), float("nan")).to(dtype),
        mesh=ns.make_mesh((4,), ("x",)),
        in_specs=P("x"),
        out_specs=P(),
    )
    out = f(torch.arange(10.0))
    assert out.dtype == dtype and out.to(torch.complex64).isnan().all()
