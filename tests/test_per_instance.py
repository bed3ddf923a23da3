"""The per-instance simulated execution (``backends/simulated/_per_instance``): one thread per
instance, meeting at each collective. On even programs it must give what the vmap execution
gives (values, gradients, per-device types, communication counts), against the same
independent references (the per-instance reference loop and the dense program)."""

from __future__ import annotations

import collections
import contextlib
import copy
import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from _backends import _simulated_mesh, compare_runs, evaluate, reference_run, simulated_run
from _programs import CATALOGUE

import named_spmd as ns
from named_spmd import P


@pytest.mark.parametrize("program", CATALOGUE, ids=lambda p: p.name)
def test_per_instance_equals_vmap_on_the_catalogue(program):
    sim = simulated_run(program)
    with ns.simulate_per_instance():
        got = evaluate(program, _simulated_mesh(program.sizes, program.names))
    # every instance taps the types of its own values: each type once per instance
    n = math.prod(program.sizes)
    assert collections.Counter(got.tape) == collections.Counter(sim.tape * n)
    got.tape = None
    compare_runs(got, reference_run(program), sim, program)


MESH = ns.make_mesh((2, 2), ("dp", "tp"))


def test_instances_read_values_print_and_branch():
    """Per instance, values can be read (.item(), print, a Python if), as on a real mesh;
    checked against a per-instance loop written by hand."""
    printed = []

    def f(x):
        total = x.sum().item()
        printed.append(round(total, 6))
        y = x * 2 if total > 10 else x - 1  # each instance takes its own branch
        return ns.psum(y, "tp")

    g = ns.spmd_map(f, mesh=MESH, in_specs=P("dp", "tp"), out_specs=P("dp", None))
    x = torch.arange(16.0).reshape(4, 4)
    with ns.simulate_per_instance():
        got = g(x)
    want = torch.zeros(4, 2)
    for d in range(2):
        for t in range(2):
            b = x[2 * d : 2 * d + 2, 2 * t : 2 * t + 2]
            want[2 * d : 2 * d + 2] += b * 2 if b.sum() > 10 else b - 1
    torch.testing.assert_close(got, want)
    assert sorted(printed) == sorted(
        round(x[2 * d : 2 * d + 2, 2 * t : 2 * t + 2].sum().item(), 6)
        for d in range(2)
        for t in range(2)
    )


def test_instances_that_skip_a_collective_are_told_not_hung():
    def f(x):
        if x.sum().item() > 10:  # only some instances reach the psum
            return ns.psum(x, "tp")
        return x * 0

    g = ns.spmd_map(f, mesh=MESH, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"), check_vma=False)
    with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="returned while"):
        g(torch.arange(16.0).reshape(4, 4))

    def h(x):
        if x.sum().item() > 10:
            return ns.psum(x, "tp")
        return ns.pmax(x, "tp")

    g = ns.spmd_map(h, mesh=MESH, in_specs=P("dp", "tp"), out_specs=P("dp"))
    with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="different collectives"):
        g(torch.arange(16.0).reshape(4, 4))


def test_an_instance_error_is_raised_once_naming_the_instance():
    def f(x):
        if ns.axis_index("tp").item() == 1:
            raise ValueError("boom")
        return ns.psum(x, "tp")

    g = ns.spmd_map(f, mesh=MESH, in_specs=P("dp", "tp"), out_specs=P("dp"))
    with ns.simulate_per_instance(), pytest.raises(ValueError, match="boom") as e:
        g(torch.ones(4, 4))
    assert "instance at dp=0, tp=1" in "".join(getattr(e.value, "__notes__", []))


def test_random_ops_and_outer_transforms_are_refused():
    g = ns.spmd_map(
        lambda x: x + torch.randn(x.shape), mesh=MESH, in_specs=P("dp"), out_specs=P("dp")
    )
    with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="random ops"):
        g(torch.ones(4))
    g = ns.spmd_map(lambda x: ns.psum(x, "dp"), mesh=MESH, in_specs=P("dp"), out_specs=P())
    with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="torch.func transform"):
        torch.func.grad(lambda x: g(x).sum())(torch.ones(4))


@pytest.mark.parametrize(
    "draw",
    [
        lambda x: F.dropout2d(x[None], 0.5, training=True)[0],
        lambda x: F.rrelu(x, training=True),
        lambda x: torch.nn.AlphaDropout(0.5)(x),
    ],
    ids=["dropout2d", "rrelu_training", "alpha_dropout_module"],
)
def test_every_op_that_draws_is_refused(draw):
    g = ns.spmd_map(draw, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="random ops"):
        g(torch.ones(4, 3))


def test_ops_that_draw_only_while_training_run_in_eval_mode():
    """Dropout in eval mode, rrelu by default: no draw, so nothing to refuse; the vmap values."""
    drop = torch.nn.Dropout(0.5).eval()

    def program(x):
        return F.rrelu(drop(x) - 0.5) + F.dropout(x, 0.3, training=False)

    g = ns.spmd_map(program, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.rand(4, 3)
    with ns.simulate_per_instance():
        got = g(x)
    torch.testing.assert_close(got, program(x))


@pytest.mark.parametrize("state", ["autocast", "inference_mode"])
def test_every_instance_computes_under_the_callers_thread_state(state):
    """The caller's autocast and inference mode hold on every instance's thread, not only on
    the caller's (instance 0)."""
    w = torch.randn(3, 3)
    g = ns.spmd_map(
        lambda x: torch.stack(
            [
                torch.tensor(float((x @ w).dtype == torch.bfloat16)),
                torch.tensor(float(torch.is_inference_mode_enabled())),
            ]
        )[None],
        mesh=MESH,
        in_specs=P(("dp", "tp")),
        out_specs=P(("dp", "tp")),
    )
    on = torch.autocast("cpu", torch.bfloat16) if state == "autocast" else torch.inference_mode()
    with ns.simulate_per_instance(), on:
        got = g(torch.randn(4, 3))
    column = 0 if state == "autocast" else 1
    torch.testing.assert_close(got[:, column], torch.ones(4))


def test_no_grad_and_gradient_of_an_invariant_input_summed_once_per_use():
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    g = ns.spmd_map(
        lambda x, w: ns.psum((x * w).sum(-1), "tp"),
        mesh=MESH,
        in_specs=(P(("dp", "tp")), P()),
        out_specs=P("dp"),
    )
    with ns.simulate_per_instance():
        out = g(x, w)
        (gw,) = torch.autograd.grad(out.sum(), w)
        with torch.no_grad():
            assert not g(x, w).requires_grad
    dense = (x * w).sum(-1).reshape(2, 2).sum(1)
    torch.testing.assert_close(out, dense)
    torch.testing.assert_close(gw, torch.autograd.grad(dense.sum(), w)[0])


def test_ns_random_draws_are_the_vmap_executions():
    h = torch.ones(4, 8)
    for draw in (
        lambda h: ns.random.dropout(h, 0.5, over="dp", seed=(1, 2)),
        lambda h: h * ns.random.randn(h.shape, over="dp", seed=3),
        # over=(): one draw for every instance, as deterministic as a per-instance one
        lambda h: ns.random.dropout(h, 0.5, over=(), seed=4) + ns.random.rand(8, over=(), seed=5),
        lambda h: h + ns.random.randint(0, 9, (8,), over=(), seed=6),
    ):
        f = ns.spmd_map(draw, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
        want = f(h)
        with ns.simulate_per_instance():
            assert torch.equal(f(h), want)


@pytest.mark.parametrize("spec", [P(), P("dp")], ids=["P()", "P('dp')"])
def test_a_write_into_an_input_that_instances_share_is_refused(spec):
    # each instance sharing the block would write it once: the vmap execution writes it once
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    g = ns.spmd_map(lambda x: x.mul_(2), mesh=mesh, in_specs=spec, out_specs=spec)
    with ns.simulate_per_instance(), pytest.raises(ns.SpmdError, match="clone the input"):
        g(torch.ones(4))


def test_a_write_into_a_pvary_of_an_input_is_refused_before_it_writes():
    """pvary's result is a view of its operand here as on a real mesh: each instance's write
    would change the replicated input; refused before any instance writes (the input intact)."""

    def bump(x, w):
        v = ns.pvary(w, "dp")
        v.add_(x)
        return v

    w = torch.zeros(2)
    g = ns.spmd_map(
        bump, mesh=ns.make_mesh((2,), ("dp",)), in_specs=(P("dp"), P()), out_specs=P("dp")
    )
    with (
        ns.simulate_per_instance(),
        pytest.raises(ns.VmaError, match="shares its operand's memory"),
    ):
        g(torch.arange(4.0), w)
    assert torch.equal(w, torch.zeros(2)), w
    with pytest.raises(ns.VmaError, match="shares its operand's memory"):  # as a real mesh's call
        g.check(torch.arange(4.0), w)

    def parts(h, w):  # an unreduced value's parts are each instance's own: a write is fine
        v = ns.pcast(ns.pcast(h @ w, "dp", to="unreduced"), "dp", to="varying")
        return ns.psum(v.mul_(2.0), "dp")

    h, w = torch.randn(3, 4), torch.randn(4, 2)
    p = ns.spmd_map(parts, mesh=g.mesh, in_specs=(P(None, "dp"), P("dp")), out_specs=P())
    for runs in (ns.simulate_per_instance, contextlib.nullcontext):
        with runs():
            torch.testing.assert_close(p(h, w), 2 * h @ w)


def test_a_write_into_an_input_each_instance_has_alone_is_the_vmap_executions():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    spec = P(("dp", "tp"))
    g = ns.spmd_map(lambda x: x.mul_(2), mesh=mesh, in_specs=spec, out_specs=spec)
    want_x = torch.arange(4.0)
    want = g(want_x)  # the vmap execution
    x = torch.arange(4.0)
    with ns.simulate_per_instance():
        got = g(x)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x, want_x)
    torch.testing.assert_close(x, torch.arange(4.0) * 2)


def test_a_write_into_an_input_on_the_storage_of_a_shared_one_is_not_blamed_on_it():
    # one storage's version counter: the write through the split input is not the shared one's
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    spec = P(("dp", "tp"))
    g = ns.spmd_map(
        lambda a, b: a.mul_(2) + b.sum(), mesh=mesh, in_specs=(spec, P()), out_specs=spec
    )
    want_y = torch.ones(8)
    want = g(want_y[:4], want_y[4:])  # the vmap execution
    y = torch.ones(8)
    with ns.simulate_per_instance():
        got = g(y[:4], y[4:])
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(y, want_y)


def test_tensors_nested_in_an_op_result_are_typed():
    """``torch.histogramdd`` returns its bin edges as a tuple inside its result tuple: each edge
    tensor varies with the block it was computed from (an out_spec P() is refused, as for any
    varying value); vmap has no batching rule for the op, so per instance is the way it runs."""
    mesh = ns.make_mesh((2,), ("x",))
    x = torch.tensor([1.0, 2.0, 3.0, 10.0])

    def edges(v):
        return torch.histogramdd(v.reshape(-1, 1), bins=2).bin_edges[0]

    f = ns.spmd_map(edges, mesh=mesh, in_specs=P("x"), out_specs=P())
    with ns.simulate_per_instance(), pytest.raises(ns.VmaError, match=r"varies over \('x',\)"):
        f(x)
    f = ns.spmd_map(edges, mesh=mesh, in_specs=P("x"), out_specs=P("x"))
    with ns.simulate_per_instance():
        got = f(x)
    torch.testing.assert_close(got, torch.cat([edges(x[:2]), edges(x[2:])]))


def test_tensors_in_a_return_types_argument_are_typed():
    """``torch.stack(torch.aminmax(v, dim=0))``: the operands are in a ``torch.return_types``
    tuple (not of type ``tuple``), typed as a list's are: the result varies over "x"."""
    mesh = ns.make_mesh((2,), ("x",))
    x = torch.tensor([[1.0, 2.0], [3.0, 10.0]])

    def extrema(v):
        return torch.stack(torch.aminmax(v, dim=0))

    f = ns.spmd_map(extrema, mesh=mesh, in_specs=P("x"), out_specs=P())
    with ns.simulate_per_instance(), pytest.raises(ns.VmaError, match=r"varies over \('x',\)"):
        f(x)
    f = ns.spmd_map(extrema, mesh=mesh, in_specs=P("x"), out_specs=P(None, "x"))
    with ns.simulate_per_instance():
        got = f(x)
    torch.testing.assert_close(got, torch.cat([extrema(x[:1]), extrema(x[1:])], 1))


def _scattered_and_written(x):
    y = ns.psum_scatter(x * 1, "dp", tiled=True)
    y.mul_(2)  # a write into the result: its own memory, as a plain op's result
    z = ns.psum_scatter(x.reshape(2, -1, 3) * 1, "dp")
    z[0].add_(1)
    return y, z


def test_the_results_of_a_scatter_take_writes_as_under_vmap():
    """Each instance's block of a psum_scatter (tiled or not) is a tensor of its own: a write
    into it runs, with vmap's values and gradients (tests/dist_worker.py checks a real mesh)."""
    f = ns.spmd_map(
        _scattered_and_written,
        mesh=ns.make_mesh((2,), ("dp",)),
        in_specs=P("dp"),
        out_specs=(P("dp"), P("dp")),
    )
    x = torch.arange(24.0).reshape(8, 3) / 5
    runs = []
    for per_instance in (False, True):
        xg = x.clone().requires_grad_()
        with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
            y, z = f(xg)
        (y.pow(2).sum() + z.pow(2).sum()).backward()
        runs.append((y, z, xg.grad))
    for got, want in zip(runs[1], runs[0]):
        torch.testing.assert_close(got, want)
    blocks = x.reshape(2, 4, 3).sum(0)  # the sum of the two instances' blocks
    torch.testing.assert_close(runs[0][0], blocks * 2)


def _extremum_written(op, write):
    def prog(x):
        y = getattr(ns, op)(x, "dp")
        if write:
            y.mul_(2)  # a write into the result: a fresh value, as a collective's in JAX
        else:
            y = y.clone() * 2
        return y

    return prog


@pytest.mark.parametrize("op", ["pmax", "pmin"])
def test_a_write_into_an_extremum_keeps_its_gradient(op):
    """pmax / pmin's backward reads its result to find the instance holding the extremum; a
    write into the result changes neither values nor gradients (tests/dist_worker.py checks a
    real mesh). Reference: a loop over the instances in plain torch, ties split evenly."""
    x = torch.tensor([[1.0, 5.0, 2.0, -1.0], [3.0, 5.0, 0.0, -1.0]])
    weight = torch.arange(1.0, 5.0)
    chosen = getattr(torch, {"pmax": "maximum", "pmin": "minimum"}[op])(x[0], x[1])
    holds = [(x[i] == chosen).double() for i in range(2)]
    want_grad = torch.stack([2 * weight * h / (holds[0] + holds[1]) for h in holds])
    mesh = ns.make_mesh((2,), ("dp",))
    for write in (True, False):
        f = ns.spmd_map(_extremum_written(op, write), mesh=mesh, in_specs=P("dp"), out_specs=P())
        for per_instance in (False, True):
            xg = x.clone().reshape(-1).requires_grad_()
            with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
                y = f(xg)
            (y * weight).sum().backward()
            torch.testing.assert_close(y, 2 * chosen)
            torch.testing.assert_close(xg.grad, want_grad.reshape(-1).float())


def cast_results_written(x):
    """Writes into the results of the casts between varying and unreduced: per instance the
    identity, a view of the operand (the write reaches it)."""
    c = x * 1
    u = ns.pcast(c, "dp", to="unreduced")
    u.mul_(2)
    v = ns.pcast(ns.pcast(x * 1, "dp", to="unreduced"), "dp", to="varying")
    v.add_(1)
    return ns.psum(u, "dp"), c, v


def test_a_write_into_a_varying_unreduced_cast_reaches_its_operand():
    """The cast's result is a view of its operand, as a plain op's view (tests/dist_worker.py
    checks a real mesh, where the cast ran as an autograd Function whose view autograd
    refused to write into). Reference: the dense program in plain torch, first and replayed
    calls, with and without gradients."""
    x = torch.arange(8.0) / 3
    blocks = (2 * x).reshape(2, 4)
    want = (blocks[0] + blocks[1], 2 * x, x + 1)
    weights = [torch.arange(1.0, 1.0 + w.numel()) for w in want]
    xd = x.clone().requires_grad_()
    dense = ((2 * xd).reshape(2, 4).sum(0), 2 * xd, xd + 1)
    sum((t * w).sum() for t, w in zip(dense, weights)).backward()
    mesh = ns.make_mesh((2,), ("dp",))
    specs = dict(in_specs=P("dp"), out_specs=(P(), P("dp"), P("dp")))
    f = ns.spmd_map(cast_results_written, mesh=mesh, **specs)
    for per_instance in (False, True):
        for grad in (False, True, True):  # (the second call with gradients: a replayed one)
            xg = x.clone().requires_grad_(grad)
            with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
                got = f(xg)
            for a, b in zip(got, want):
                torch.testing.assert_close(a, b)
            if grad:
                sum((t * w).sum() for t, w in zip(got, weights)).backward()
                torch.testing.assert_close(xg.grad, xd.grad)


def _deep_copies(x):
    y = copy.deepcopy(x)  # an instance's own copy: the write below leaves x as it was
    y.mul_(2)
    tree = copy.deepcopy({"x": x, "twice": [y]})
    return tree["x"] + tree["twice"][0] + copy.deepcopy(ns.psum(x, "dp"))


def test_deepcopy_inside_the_function_copies_each_instance_s_value():
    """``copy.deepcopy`` of a varying value (a batched tensor under the vmap simulation, which
    has no storage to copy: an SpmdNotImplementedError there, while a real mesh copies its rank's
    block), of a tree of them and of an invariant psum: the values of the dense program on both
    simulations (tests/dist_worker.py checks a real mesh); of a value that requires grad and is
    no leaf, torch's own refusal on both, as on a real mesh's ranks."""
    mesh = ns.make_mesh((2,), ("dp",))
    x = torch.arange(8.0).reshape(4, 2)
    want = x + 2 * x + x.reshape(2, 2, 2).sum(0).repeat(2, 1)
    f = ns.spmd_map(_deep_copies, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    for per_instance in (False, True):
        with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
            torch.testing.assert_close(f(x), want)
            with pytest.raises(RuntimeError, match="graph leaves"):
                f(x.clone().requires_grad_())


def _shallow_copies_of(x, w, total, write):
    y = x * 2
    c = copy.copy(y)  # y's storage, no gradient through it
    if write:  # (torch refuses a write into the copy of a value that requires grad)
        c.add_(1)  # reaches y
    return y * copy.copy(w).sum() + copy.copy(x) * c + copy.copy(total)


@pytest.mark.parametrize("write", [False, True], ids=["gradients", "a write through a copy"])
def test_copy_inside_the_function_is_each_instance_s_shallow_copy(write):
    """``copy.copy`` of a varying value (refused by ``Tensor.__reduce_ex__`` under the vmap
    simulation: an SpmdNotImplementedError, while a real mesh copies its rank's block), of a
    P() input and of an invariant psum: torch's shallow copy on each instance (its storage
    shared, no gradient through it), the values and gradients of a per-instance loop on both
    simulations."""
    mesh = ns.make_mesh((2,), ("dp",))
    x0, w0 = torch.arange(8.0).reshape(4, 2) - 3, torch.arange(2.0) + 1
    f = ns.spmd_map(
        lambda x, w: _shallow_copies_of(x, w, ns.psum(x, "dp"), write),
        mesh=mesh,
        in_specs=(P("dp"), P()),
        out_specs=P("dp"),
    )
    grad = not write
    x, w = x0.clone().requires_grad_(grad), w0.clone().requires_grad_(grad)
    total = x.reshape(2, 2, 2).sum(0)
    want = torch.cat([_shallow_copies_of(b, w, total, write) for b in x.chunk(2)])
    if grad:
        want.sum().backward()
    for per_instance in (False, True):
        xg, wg = x0.clone().requires_grad_(grad), w0.clone().requires_grad_(grad)
        with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
            got = f(xg, wg)
        torch.testing.assert_close(got, want)
        if grad:
            got.sum().backward()
            torch.testing.assert_close((xg.grad, wg.grad), (x.grad, w.grad))


def _deep_copied_parameter(x):
    p = torch.nn.Parameter(x * 2)
    q = copy.deepcopy(p)
    assert type(q) is torch.nn.Parameter and q is not p
    with torch.no_grad():
        q.add_(1)  # the copy's own values: p is left as it was
    return q * 3 + p


def test_deepcopy_of_a_parameter_of_a_varying_value_is_each_instance_s_copy():
    """``copy.deepcopy(torch.nn.Parameter(v))`` of a varying ``v`` (``Parameter.__deepcopy__``
    reads ``.data``, which the vmap simulation refuses: an SpmdError, while a real mesh copies
    its rank's Parameter): a Parameter of a copy of the instance's values, equal to a
    per-instance loop on both simulations."""
    mesh = ns.make_mesh((2,), ("dp",))
    x = torch.arange(8.0).reshape(4, 2) - 3
    f = ns.spmd_map(_deep_copied_parameter, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    want = torch.cat([_deep_copied_parameter(b) for b in x.chunk(2)]).detach()
    for per_instance in (False, True):
        with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
            torch.testing.assert_close(f(x).detach(), want)


def _leaves_below(t):
    """The leaves that requires grad whose gradients ``t``'s graph accumulates."""
    todo, found = [t.grad_fn], []
    while todo:
        node = todo.pop()
        if node is not None:
            found += [node.variable] if type(node).__name__ == "AccumulateGrad" else []
            todo += [below for below, _ in node.next_functions]
    return found


def _parameter_of_a_varying_value(x):
    p = torch.nn.Parameter(x * 2)
    assert type(p) is torch.nn.Parameter and p.requires_grad
    return p * x


def test_a_parameter_made_of_a_varying_value_is_each_instance_s_leaf():
    """``torch.nn.Parameter(v)`` of a varying ``v`` inside the function is, as torch makes it
    on a real mesh's rank, a leaf that requires grad: the call's output requires grad and its
    gradient reaches every instance's leaf (here ``x``, the factor beside it), as in a
    per-instance loop, on both simulations (vmap's wrapper alone reads ``requires_grad``, while
    autograd tracked nothing under it: an output that required no grad)."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    x = torch.arange(8.0).reshape(4, 2) - 3
    f = ns.spmd_map(
        _parameter_of_a_varying_value, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp")
    )
    blocks = [b for rows in x.chunk(2) for b in rows.chunk(2, dim=1)]
    per_instance = [_parameter_of_a_varying_value(b) for b in blocks]
    assert all(out.requires_grad for out in per_instance)
    reached = [torch.autograd.grad(out.sum(), _leaves_below(out)) for out in per_instance]
    want = torch.cat([g.flatten() for grads in reached for g in grads])
    for simulated_per_instance in (False, True):
        with ns.simulate_per_instance() if simulated_per_instance else contextlib.nullcontext():
            got = f(x)
        assert got.requires_grad
        torch.testing.assert_close(got.detach(), x * x * 2)
        grads = torch.autograd.grad(got.sum(), _leaves_below(got))
        torch.testing.assert_close(
            torch.cat([g.flatten() for g in grads]).sort()[0], want.sort()[0]
        )


def test_a_replicated_leaf_that_requires_grad_is_deep_copied_as_on_a_real_mesh():
    """``copy.deepcopy`` of a P() input that requires grad (a leaf: a rank of a real mesh holds
    the caller's tensor) is a new leaf, as torch copies it outside the call: values and
    gradients of the same program run densely, on both simulations (tests/dist_worker.py checks
    a real mesh)."""
    w = torch.arange(3.0) - 1

    def scaled_copy(v):
        return copy.deepcopy(v) * 2 + v  # gradient only through ``+ v``: the copy is a new leaf

    dense_w = w.clone().requires_grad_()
    want = scaled_copy(dense_w)
    want.sum().backward()
    for mesh in (ns.make_mesh((2,), ("x",)), ns.make_mesh((2, 2), ("x", "y"))):
        f = ns.spmd_map(scaled_copy, mesh=mesh, in_specs=P(), out_specs=P())
        for per_instance in (False, True):
            with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
                got_w = w.clone().requires_grad_()
                got = f(got_w)
            assert got.requires_grad == want.requires_grad
            torch.testing.assert_close(got, want)
            got.sum().backward()
            torch.testing.assert_close(got_w.grad, dense_w.grad)


def _per_instance_loop(fn, x, n):
    """``fn`` on each of the n row blocks of ``x``, concatenated: a real mesh's ranks."""
    return torch.cat([fn(block) for block in x.chunk(n)])


@pytest.mark.parametrize(
    "op",
    [
        lambda v: torch.argwhere(v),
        lambda v: v.repeat_interleave(v[:, 0].long() % 2 + 1, dim=0, output_size=3),
        lambda v: v.masked_scatter(v > 1, v * 10),
        lambda v: torch.nonzero_static(v, size=3),
    ],
    ids=["argwhere", "repeat_interleave", "masked_scatter", "nonzero_static"],
)
def test_vmap_s_fallback_warning_does_not_reach_the_user(op):
    """An op vmap runs through its per-instance fallback warns of a performance drop: vmap is
    the simulation's choice, not the user's, so no warning escapes the call (a real mesh's rank
    runs the op plainly), eager or traced by Dynamo, and the values are a per-instance loop's;
    no filter is left behind. (The compiled graph's own run is outside the call: the backend
    here runs it with warnings ignored.)"""
    x = torch.tensor([[1.0, 0.0], [0.0, 2.0], [3.0, 0.0], [0.0, 4.0]])
    want = _per_instance_loop(op, x, 2)
    f = ns.spmd_map(op, mesh=ns.make_mesh((2,), ("x",)), in_specs=P("x"), out_specs=P("x"))
    fallback_filters = _fallback_filters()

    def graph_run_quietly(gm, example_inputs):
        def run(*args):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                return gm.forward(*args)

        return run

    torch._dynamo.reset()
    for g in (f, torch.compile(f, backend=graph_run_quietly)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            got = g(x)
        assert got.dtype == want.dtype
        assert torch.equal(got, want)
        assert _fallback_filters() == fallback_filters


def _fallback_filters():
    return [w for w in warnings.filters if w[1] and "performance drop" in w[1].pattern]


def _signs(t):
    return torch.signbit(torch.view_as_real(t) if t.is_complex() else t)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.complex64])
def test_a_sum_of_negative_zeros_is_negative_zero_as_on_a_real_mesh(dtype):
    """IEEE addition of -0.0s is -0.0 (gloo adds the ranks' values so); torch.sum starts from
    +0.0. psum, pmean and psum_scatter of -0.0s on both simulations: -0.0, bit for bit the
    member-by-member sum of a per-instance loop (zeros of either sign, and non-zero values)."""
    x = torch.tensor([-0.0, -0.0, 0.0, 1.0, -0.0, 0.0, -0.0, -1.0]).to(dtype).reshape(4, 2)
    blocks = x.reshape(4, 1, 2).unbind(0)  # 4 instances over (x, y)
    total = blocks[0] + blocks[1] + blocks[2] + blocks[3]
    mesh = ns.make_mesh((2, 2), ("x", "y"))
    cases = [
        (lambda v: ns.psum(v, ("x", "y")), total),
        (lambda v: ns.pmean(v, ("x", "y")), total / 4),
    ]
    for fn, want in cases:
        f = ns.spmd_map(fn, mesh=mesh, in_specs=P(("x", "y")), out_specs=P())
        for per_instance in (False, True):
            with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
                got = f(x)
            assert torch.equal(got, want) and torch.equal(_signs(got), _signs(want))
    y = torch.tensor([-0.0, 0.0, -0.0, 1.0]).to(dtype)  # every instance holds y: sums of 4 y's
    g = ns.spmd_map(
        lambda v: ns.psum_scatter(ns.pvary(v, ("x", "y")), ("x", "y"), tiled=True),
        mesh=mesh,
        in_specs=P(),
        out_specs=P(("x", "y")),
    )
    want = y + y + y + y
    for per_instance in (False, True):
        with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
            got = g(y)
        assert torch.equal(got, want) and torch.equal(_signs(got), _signs(want))


def test_a_negative_view_runs_as_on_a_real_mesh():
    """``v.conj().imag`` of a complex block is a negative view (``is_neg()``), which vmap has
    no batching rule for: it runs on both simulations, read, reduced and written through, with
    the values of a per-instance loop (tests/dist_worker.py checks a real mesh)."""
    c = torch.tensor([[1 + 2j, 3 - 4j], [5 + 1j, 2 - 2j], [-1 + 0j, 0.5 - 3j], [2j, 1 + 1j]])

    def negative_view(v):
        imag = v.conj().imag
        assert imag.is_neg()
        total = ns.psum(imag * 2, "x")
        imag.add_(1)  # through the view: v's imaginary parts, less 1
        return torch.cat([total, v.imag])

    def per_rank(v):
        total = sum(b.conj().imag * 2 for b in c.chunk(2))  # every rank's, summed
        v.conj().imag.add_(1)
        return torch.cat([total, v.imag])

    want = _per_instance_loop(per_rank, c.clone(), 2)
    f = ns.spmd_map(
        negative_view, mesh=ns.make_mesh((2,), ("x",)), in_specs=P("x"), out_specs=P("x")
    )
    for per_instance in (False, True):
        with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
            got = f(c.clone())
        assert torch.equal(got, want)
