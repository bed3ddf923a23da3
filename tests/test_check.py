"""Check-only mode: ``spmd_map(...).check(*args)`` on meta tensors.

The reference is the simulated backend itself: a real call on a small mesh gives the output
shapes, the per-instance types (``ns.typeof`` inside the function) and the communication
(``ns.CommMode``) that the abstract run must report, and the errors it must raise, word for word.
"""

from __future__ import annotations

import contextlib
import functools
import re
import resource
import time
from collections import Counter

import optree
import pytest
import torch
import torch.nn.functional as F
from _programs import BY_NAME, NS_OPS

import named_spmd as ns
from named_spmd import P

# --- programs ------------------------------------------------------------------------------------


tp_sp_block = functools.partial(BY_NAME["block"].prog, NS_OPS)  # the catalogue's (_programs.py)


BLOCK_SPECS = (P("dp", "tp"), P(None, "tp"), P("tp", None), P(None, "tp"), P("tp", None))


def block_shapes(b, s, d, hidden):
    return [(b, s, d), (d, 3 * d), (d, d), (d, hidden), (hidden, d)]


def block_fn(mesh):
    return ns.spmd_map(tp_sp_block, mesh=mesh, in_specs=BLOCK_SPECS, out_specs=P("dp", "tp"))


def _events(events):
    return Counter((e.op, e.axes, e.direction, e.shape, e.dtype, e.implicit) for e in events)


def simulated_reference(fn, args):
    """Run for real (simulated), recording output types and communication, forward and back."""
    types = []
    inner = fn.fn

    def spy(*a):
        out = inner(*a)
        types.extend(ns.typeof(t) for t in optree.tree_leaves(out))
        return out

    real = ns.spmd_map(spy, mesh=fn.mesh, in_specs=fn.in_specs, out_specs=fn.out_specs)
    args = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    with ns.CommMode() as comms:
        out = real(*args)
        leaves = [t for t in optree.tree_leaves(out) if t.requires_grad]
        if leaves:
            torch.autograd.backward(leaves, [torch.ones_like(t) for t in leaves])
    return out, types, comms.events


PROGRAMS = {"block": (block_fn(ns.make_mesh((2, 4), ("dp", "tp"))), block_shapes(2, 8, 8, 16))}
# The agreement of check() with a real run, for every program of the catalogue, is
# test_programs.py::test_program[abstract-*].


def test_meta_tensors_shape_structs_and_real_tensors_give_one_report():
    fn, shapes = PROGRAMS["block"]
    real = fn.check(*[torch.randn(s) for s in shapes])
    meta = fn.check(*[torch.empty(s, device="meta") for s in shapes])
    struct = fn.check(*[ns.ShapeDtype(s) for s in shapes])
    for other in (meta, struct):
        assert other.outputs == real.outputs
        assert _events(other.events) == _events(real.events)
    assert struct.out == ns.ShapeDtype((2, 8, 8))


def test_backward_is_optional_and_follows_requires_grad():
    fn, shapes = PROGRAMS["block"]
    assert not fn.check(*[ns.ShapeDtype(s) for s in shapes], backward=False).backward
    # No parameter gradient: the implicit-pvary psums of the weights' gradients disappear.
    frozen = [ns.ShapeDtype(shapes[0])] + [
        ns.ShapeDtype(s, requires_grad=False) for s in shapes[1:]
    ]
    report = fn.check(*frozen)
    assert report.comms.count("psum", direction="backward") == 0
    assert report.comms.count("psum_scatter", direction="backward") == 2  # dx still flows back
    everything = fn.check(*[ns.ShapeDtype(s) for s in shapes])
    assert everything.comms.count("psum", "dp", "backward") == 4  # one per weight, over dp


def _mixed(x, w, b, g):
    """Operands of different types side by side, positional and keyword: x{dp} with w{tp}, a
    bias b{tp}, LayerNorm's weight and bias as keywords (g{}, b{tp}), and a value used twice."""
    h = F.linear(x, w, b)  # x{dp}, w{tp}, b{tp}: each pvary'd over the axes it lacks
    n = F.layer_norm(h, (h.shape[-1],), weight=g, bias=b)  # keyword operands
    return torch.add(n, h, alpha=0.5) * x.sum()


def test_operands_of_different_types_and_keyword_operands_as_on_the_simulated_mesh():
    """The tracked backends' fast path (``_tracking.VmaMode``) types ops whose operands carry
    different stamps, or sit in keywords, as the simulated mesh does (its types come from vmap
    levels); here .check()'s abstract backend against a simulated run, types and every implicit
    pvary's psum in backward."""
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    fn = ns.spmd_map(
        _mixed,
        mesh=mesh,
        in_specs=(P("dp"), P("tp"), P("tp"), P()),
        out_specs=P("dp", "tp"),
    )
    args = [torch.randn(s) for s in ((4, 8), (8, 8), (8,), (2,))]
    _, types, events = simulated_reference(fn, args)
    report = fn.check(*args)
    assert report.types == types
    assert _events(report.events) == _events(events)
    # w and b over dp (the linear), g over dp and tp (the LayerNorm), x and x.sum() over tp
    assert report.comms.count("psum", direction="backward") == 5


# --- scale -----------------------------------------------------------------------------------------


def test_4096_instances_checked_as_fast_as_4_without_global_memory():
    mesh = ns.make_mesh((64, 64), ("dp", "tp"))
    fn, small = block_fn(mesh), block_fn(ns.make_mesh((2, 2), ("dp", "tp")))
    # 2**40 elements in the activation alone: allocating anything of global size would fail.
    args = [ns.ShapeDtype(s) for s in block_shapes(512, 2**20, 2048, 8192)]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    fn.check(*args)  # the first call pays for imports and warm-up
    small.check(*args)
    times, small_times = [], []
    for _ in range(5):  # interleaved: a machine busy with other work slows both alike
        start = time.perf_counter()
        report = fn.check(*args)
        times.append(time.perf_counter() - start)
        start = time.perf_counter()
        small.check(*args)
        small_times.append(time.perf_counter() - start)
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss_before) / 1024
    assert sorted(times)[2] < 3 * sorted(small_times)[2] + 0.01, (times, small_times)
    assert grown_mib < 200, grown_mib
    assert report.types == [
        ns.VType(torch.float32, (8, 16384, 2048), frozenset({"dp", "tp"}), mesh.axis_names)
    ]
    assert report.outputs[0].global_shape == (512, 2**20, 2048)
    gathered = (8, 16384, 2048)
    assert _events(report.forward) == Counter(
        {
            ("all_gather", ("tp",), "forward", gathered, torch.float32, False): 2,
            ("psum_scatter", ("tp",), "forward", (8, 2**20, 2048), torch.float32, False): 2,
        }
    )


def test_cost_does_not_grow_with_instance_count():
    shapes = block_shapes(64, 1024, 512, 1024)
    args = [ns.ShapeDtype(s) for s in shapes]

    def median_time(mesh):
        fn = block_fn(mesh)
        fn.check(*args)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            fn.check(*args)
            times.append(time.perf_counter() - start)
        return sorted(times)[2]

    small = median_time(ns.make_mesh((2, 2), ("dp", "tp")))
    large = median_time(ns.make_mesh((64, 128), ("dp", "tp")))  # 8192 instances
    assert large < 3 * small + 0.01, (small, large)


# --- errors: the same as a real run ------------------------------------------------------------

M24 = ((2, 4), ("dp", "tp"))
M4 = ((4,), ("i",))


def _bad_cases():
    """(name, per-device fn, mesh, in_specs, out_specs, global arg shapes or values)."""
    ring_dup = [(0, 1), (1, 1)]
    return [
        ("spec_longer_than_rank", lambda x: x, M4, P("i", None, None), P("i"), [(8, 2)]),
        (
            "block_sizes_not_adding_up",
            lambda x: x,
            M24,
            P(ns.Blocks("tp", (2,) * 4)),
            P("tp"),
            [(6, 2)],
        ),
        ("psum_of_uneven_blocks", lambda x: ns.psum(x, "tp"), M24, P("tp"), P(), [(6, 2)]),
        ("axis_repeated_in_spec", lambda x: x, M24, P("dp", "dp"), P("dp"), [(4, 4)]),
        ("unknown_axis_in_spec", lambda x: x, M24, P("pd"), P(), [(4, 4)]),
        ("unknown_axis_in_collective", lambda x: ns.psum(x, "pt"), M24, P("tp"), P(), [(8,)]),
        ("in_specs_not_a_prefix", lambda x, y: x, M4, (P("i"), P(), P()), P("i"), [(4,), (4,)]),
        ("out_specs_not_a_prefix", lambda x: (x, x), M4, P("i"), (P("i"),) * 3, [(4,)]),
        (
            "ppermute_duplicate_dst",
            lambda x: ns.ppermute(x, "i", ring_dup),
            M4,
            P("i"),
            P("i"),
            [(4,)],
        ),
        (
            "ppermute_out_of_range",
            lambda x: ns.ppermute(x, "i", [(0, 4)]),
            M4,
            P("i"),
            P("i"),
            [(4,)],
        ),
        (
            "pshuffle_not_permutation",
            lambda x: ns.pshuffle(x, "i", [0, 0, 1, 2]),
            M4,
            P("i"),
            P("i"),
            [(4,)],
        ),
        ("psum_of_invariant", lambda x: ns.psum(x, "i"), M4, P(), P(), [(4,)]),
        (
            "psum_scatter_of_invariant",
            lambda x: ns.psum_scatter(x, "tp", tiled=True),
            M24,
            P("dp"),
            P("dp"),
            [(8, 4)],
        ),
        (
            "psum_scatter_untiled_size",
            lambda x: ns.psum_scatter(x, "i"),
            M4,
            P("i"),
            P("i"),
            [(12, 2)],
        ),
        (
            "all_to_all_not_divisible",
            lambda x: ns.all_to_all(x, "i", 1, 0, tiled=True),
            M4,
            P("i"),
            P("i"),
            [(4, 6)],
        ),
        (
            "all_gather_axis_out_of_range",
            lambda x: ns.all_gather(x, "i", axis=3),
            M4,
            P("i"),
            P("i"),
            [(4, 2)],
        ),
        (
            "all_gather_bad_to",
            lambda x: ns.all_gather(x, "i", to="replicated"),
            M4,
            P("i"),
            P(),
            [(4,)],
        ),
        (
            "out_specs_claim_replication",
            lambda x, w: torch.relu(x @ w).sum(-1, keepdim=True),
            M24,
            (P("dp", None), P(None, "tp")),
            P("dp", None),
            [(8, 16), (16, 32)],
        ),
        ("rank0_output_split", lambda x: ns.psum(x.sum(), "i"), M4, P("i"), P("i"), [(4,)]),
        ("pvary_of_varying", lambda x: ns.pvary(x, "i"), M4, P("i"), P("i"), [(4,)]),
        (
            "repeated_axis_in_collective",
            lambda x: ns.psum(x, ("tp", "tp")),
            M24,
            P("tp"),
            P(),
            [(4,)],
        ),
        ("collective_on_non_tensor", lambda x: ns.psum([x, 3], "i"), M4, P("i"), P(), [(4,)]),
        ("non_tensor_with_split_spec", lambda x, n: x, M4, (P("i"), P("i")), P("i"), [(4,), 3]),
        (
            "untiled_all_to_all_size",
            lambda x: ns.all_to_all(x, "i", 0, 1),
            M4,
            P("i"),
            P("i"),
            [(8, 2)],
        ),
    ]


BAD = {c[0]: c[1:] for c in _bad_cases()}


def _same_text(err: Exception) -> str:
    """The message, with the one part that may differ elided: the pytree-mismatch detail quotes
    the values themselves (real tensors versus meta ones or vmap-batched ones)."""
    return re.sub(r"\n  \(.*?\)\n(?=Fix:)", "\n  (...)\n", str(err), flags=re.S)


def _arg(s):
    return torch.randn(s) if isinstance(s, tuple) else s


@pytest.mark.parametrize("name", sorted(BAD))
def test_check_raises_the_error_a_real_run_raises(name):
    fn, (shape, names), in_specs, out_specs, args = BAD[name]
    smap = ns.spmd_map(fn, mesh=ns.make_mesh(shape, names), in_specs=in_specs, out_specs=out_specs)
    values = [_arg(a) for a in args]
    with pytest.raises(ns.SpmdError) as real:
        smap(*values)
    with pytest.raises(ns.SpmdError) as checked:
        smap.check(*values)
    assert type(checked.value) is type(real.value)
    assert _same_text(checked.value) == _same_text(real.value)
    structs = [ns.ShapeDtype(a) if isinstance(a, tuple) else a for a in args]
    with pytest.raises(type(real.value)) as from_structs:
        smap.check(*structs)
    assert _same_text(from_structs.value) == _same_text(real.value)


VALUE_READERS = {
    "item": lambda x: x * x.sum().item(),
    "python_if": lambda x: x if x.sum() > 0 else -x,
    "nonzero": lambda x: x.nonzero().float().sum().reshape(1) * x,
    "tolist": lambda x: x * sum(x.tolist()),
}


@pytest.mark.parametrize("name", sorted(VALUE_READERS))
def test_code_that_reads_values_is_an_spmd_error_in_check(name):
    mesh = ns.make_mesh((4,), ("i",))
    smap = ns.spmd_map(VALUE_READERS[name], mesh=mesh, in_specs=P("i"), out_specs=P("i"))
    with pytest.raises(Exception):  # noqa: B017  the simulated run fails as well (vmap)
        smap(torch.randn(4))
    with pytest.raises(ns.SpmdError, match=r"\.item\(\)") as err:
        smap.check(torch.randn(4))
    assert "`<lambda>`" in str(err.value)


def test_closed_over_tensors_are_invariant_and_their_gradients_psummed_once():
    mesh = ns.make_mesh((4,), ("dp",))
    w = torch.randn(3, 3, requires_grad=True)
    bias = torch.randn(3)

    def f(x):
        h = x @ w + bias  # w and bias are invariant; mixing with x pvary's them implicitly
        return ns.psum((h @ w).sum(0, keepdim=True), "dp")

    smap = ns.spmd_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P())
    report = smap.check(ns.ShapeDtype((8, 3), requires_grad=False))
    assert report.types == [ns.VType(torch.float32, (1, 3), frozenset(), ("dp",))]
    with ns.CommMode() as comms:
        smap(torch.randn(8, 3)).sum().backward()
    assert _events(report.events) == _events(comms.events)
    assert report.comms.count("psum", "dp", "backward") == 1  # w's gradient, once


def test_report_text_and_html():
    fn, shapes = PROGRAMS["block"]
    report = fn.check(*[ns.ShapeDtype(s) for s in shapes])
    text = repr(report)
    assert "tp_sp_block" in text and "f32[1,2,8]{dp,tp}" in text and "-> f32[2,8,8]" in text
    assert "psum_scatter" in text and "backward" in text
    page = report._repr_html_()
    assert "tp_sp_block" in page and "psum_scatter" in page and "<table" in page


def _bump(x):
    x.add_(1)  # a write into the input's block
    return ns.pmean(x * ns.axis_index("dp"), "dp")  # (a replicated x: an implicit pvary)


def _outcome(run, x):
    """What ``run(x)`` gives that a check must match: the output's shape, or the error's class
    and its text up to torch's own (torch's words name the block's own kind of view)."""
    try:
        out = run(x)
    except ns.SpmdError as e:
        return type(e), str(e).split("\n")[0]
    return "ran", tuple(getattr(out, "shape", None) or out.out.shape)


def _bump_unbound(x):
    x.unbind(0)[0].add_(1)  # a write into a view of a multi-output op
    return ns.pmean(x * ns.axis_index("dp"), "dp")


ARGUMENTS = {  # an input that needs no gradient, a leaf that requires grad, and no leaf
    "plain": lambda: torch.zeros(4),
    "leaf": lambda: torch.zeros(4, requires_grad=True),
    "nonleaf": lambda: torch.zeros(4, requires_grad=True) * 1,
}


@pytest.mark.parametrize("fn", [_bump, _bump_unbound], ids=["block", "unbound"])
@pytest.mark.parametrize("argument", list(ARGUMENTS))
@pytest.mark.parametrize("per_instance", [False, True], ids=["vmap", "per_instance"])
@pytest.mark.parametrize("spec", [P("dp"), P()], ids=["split", "replicated"])
@pytest.mark.parametrize("size", [1, 2])
def test_check_takes_a_write_into_an_input_where_the_call_does(
    size, spec, per_instance, argument, fn
):
    """A write into an input: the call takes it where autograd does (an argument that needs no
    gradient; a view that no multi-output op made of one that is no leaf), and refuses it where
    autograd does (a leaf that requires grad, or a view of one; a multi-output op's view, the
    per-instance blocks of a split input among them) or where the per-instance execution
    shares the block (each instance would write it). check() runs where the call runs,
    reporting its communication, and raises its error."""
    f = ns.spmd_map(fn, mesh=ns.make_mesh((size,), ("dp",)), in_specs=spec, out_specs=P())
    runs = ns.simulate_per_instance if per_instance else contextlib.nullcontext
    with runs():
        called = _outcome(f, ARGUMENTS[argument]())
        checked = _outcome(f.check, ARGUMENTS[argument]())
    assert checked == called
    several = per_instance and size > 1
    multi_output = fn is _bump_unbound or (several and bool(spec.axes))
    refused = argument == "leaf" or (several and not spec.axes)
    refused = refused or (argument == "nonleaf" and multi_output)
    assert (called[0] != "ran") == refused, called
    if not refused and fn is _bump and argument == "plain":
        with runs():
            report = f.check(torch.zeros(4))
        assert [str(t) for t in report.types] == [f"f32[{4 // size if spec.axes else 4}]{{}}"]
        assert [e.op for e in report.forward] == (["pmean"] if size > 1 else [])
        backward = [(e.op, e.implicit) for e in report.backward]
        assert backward == ([("psum", True)] if size > 1 and not spec.axes else []), backward


def _doubled_into_out(x):
    out = torch.empty_like(x)
    torch.mul(x, 2.0, out=out)  # an out= op: autograd refuses it where an operand requires grad
    return out


@pytest.mark.parametrize("argument", list(ARGUMENTS))
@pytest.mark.parametrize("size", [1, 2])
def test_check_takes_an_out_argument_where_the_call_does(size, argument):
    """An op's out= with an input operand: the call runs it where the input needs no gradient
    and refuses it with an SpmdError naming out= where it does; check() (which differentiates
    with respect to every floating input) does the same."""
    f = ns.spmd_map(
        _doubled_into_out, mesh=ns.make_mesh((size,), ("dp",)), in_specs=P(), out_specs=P()
    )
    called = _outcome(f, ARGUMENTS[argument]())
    assert _outcome(f.check, ARGUMENTS[argument]()) == called
    if argument == "plain":
        assert called == ("ran", (4,))
    else:
        assert "autograd refused an op's out= argument at test_check.py:" in called[1], called


@pytest.mark.parametrize("rows", [4, 3], ids=["even", "uneven"])
def test_an_op_without_a_shape_rule_is_an_spmd_error_naming_it(rows):
    """``torch.histogramdd`` has no meta kernel: the check cannot run it on shapes (torch's
    NotImplementedError), and says so with the fix, in both of its executions."""
    mesh = ns.make_mesh((2,), ("x",))
    f = ns.spmd_map(
        lambda v: torch.histogramdd(v.reshape(-1, 1), bins=2).hist,
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
    with pytest.raises(ns.SpmdError, match=r"no shape rule for the op at .*histogramdd"):
        f.check(torch.arange(float(rows)))


def test_a_write_into_an_input_is_checked_as_the_call_runs_it():
    """The check differentiates every floating-point input: its block stays writable, as the
    call's block of an argument that needs no gradient is (a leaf requiring grad is not)."""
    mesh = ns.make_mesh((2,), ("x",))

    def double(x, w):
        x.mul_(2)
        return ns.psum(x @ w, "x")

    f = ns.spmd_map(double, mesh=mesh, in_specs=(P("x"), P("x")), out_specs=P())
    x, w = torch.arange(4.0), torch.ones(4)
    report = f.check(x, w)
    assert report.types == f.check(ns.ShapeDtype((4,)), ns.ShapeDtype((4,))).types
    torch.testing.assert_close(f(x.clone(), w), (2 * x) @ w)


_SCALE = torch.tensor(2.0, requires_grad=True)


def _written_after_use(x):
    y = x * _SCALE  # saves x for the gradient of _SCALE
    with torch.no_grad():
        x.add_(1)  # after: the backward pass would refuse y's node
    return ns.pmean(y, "dp")


# (per instance, a split input's blocks are views of one multi-output op: a write into one
# refuses the others' use, test_check_takes_a_write_into_an_input_where_the_call_does)
WRITTEN_RUNS = [(1, P("dp"), False), (2, P("dp"), False), (2, P(), False), (2, P(), True)]


@pytest.mark.parametrize("backward", [True, False])
@pytest.mark.parametrize("argument", list(ARGUMENTS))
@pytest.mark.parametrize("size, spec, per_instance", WRITTEN_RUNS)
def test_check_raises_the_calls_error_for_an_input_written_after_an_op_saved_it(
    size, spec, per_instance, argument, backward
):
    """An input written in place after an op saved it (``Call.check_writes``): check() raises
    the call's SpmdError in its forward run, with or without its backward pass."""
    f = ns.spmd_map(
        _written_after_use, mesh=ns.make_mesh((size,), ("dp",)), in_specs=spec, out_specs=P()
    )
    runs = ns.simulate_per_instance if per_instance else contextlib.nullcontext
    with runs():
        called = _outcome(f, ARGUMENTS[argument]())
        checked = _outcome(lambda x: f.check(x, backward=backward), ARGUMENTS[argument]())
    assert checked == called
    if not per_instance:  # (per instance, a replicated input's block: every instance writes it)
        assert "wrote in place into an input (argument [0])" in called[1], called


def _pvary_then_write(x, v):
    y = ns.pvary(x, "dp")  # (dense: y = x.view_as(x), which sees the write)
    x.add_(1)
    return y * v


def _group_norm_then_write(x, w):
    y = F.group_norm(x.reshape(2, 3, 1), 1, w).reshape(2, 3)  # vmap's rule saves no w here
    w.add_(1)
    return y


@pytest.mark.parametrize(
    "fn, specs, out_spec",
    [
        (_pvary_then_write, (P(), P("dp")), P("dp")),
        (_group_norm_then_write, (P("dp"), P()), P("dp")),
    ],
    ids=["pvary", "group_norm"],
)
def test_check_takes_a_write_into_an_input_after_its_cast_as_the_call_does(fn, specs, out_spec):
    """An input written in place after its cast to varying (explicit, or implicit in an op):
    check() runs where the call runs (its casts are memory of their own, no custom Function's
    view of the input, which autograd refuses once the input is written)."""
    f = ns.spmd_map(fn, mesh=ns.make_mesh((2,), ("dp",)), in_specs=specs, out_specs=out_spec)
    leaf = torch.ones(3, requires_grad=True)
    other = torch.arange(12.0).reshape(4, 3)
    args = (leaf * 1, other) if fn is _pvary_then_write else (other, leaf * 1)
    out = f(*args)
    out.sum().backward()
    if fn is _pvary_then_write:  # y sees the write: (x + 1) * v, and x's gradient is v's sum
        torch.testing.assert_close(out, 2 * other)
        torch.testing.assert_close(leaf.grad, other.sum(0))
    args = (leaf * 1, other) if fn is _pvary_then_write else (other, leaf * 1)
    report = f.check(*args)
    assert [tuple(o.global_shape) for o in report.outputs] == [tuple(out.shape)]


def _normalized(x, w, mean, var):
    return F.batch_norm(x, mean, var, w, None, training=True)  # updates mean and var in place


def test_check_takes_running_statistics_as_the_call_does():
    """A BatchNorm's running statistics passed as inputs: the op refuses to differentiate with
    respect to them, which check() does with every floating input; it checks again without
    them, as the call runs (which updates the statistics in place)."""
    f = ns.spmd_map(
        _normalized,
        mesh=ns.make_mesh((2,), ("dp",)),
        in_specs=(P("dp"), P(), P("dp"), P("dp")),
        out_specs=P("dp"),
    )
    x, w = torch.randn(8, 3), torch.randn(3, requires_grad=True)
    report = f.check(x, w, torch.zeros(6), torch.ones(6))
    mean = torch.zeros(6)
    y = f(x, w, mean, torch.ones(6))
    assert [str(t) for t in report.types] == ["f32[4,3]{dp}"]
    assert report.out.shape == y.shape
    blocks = x.reshape(2, 4, 3).mean(1).reshape(6)  # each instance's batch mean
    torch.testing.assert_close(mean, 0.1 * blocks)  # (momentum 0.1 from zeros)
