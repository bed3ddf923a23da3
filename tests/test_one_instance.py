"""A simulated mesh of one instance (every axis of size 1): no vmap, and replays of checked calls.

``backends/simulated/_one_instance`` runs the per-device function once, on the global tensors,
typed by stamps; a call whose signature an earlier call type-checked runs untyped. Checked here
against the dense computation and against the same program on a mesh of several instances:
values and gradients on every call, the errors of a first call, what re-checks a call, and
checkpointing in replays.
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import gc
import inspect
import json
import os
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F
from _dist_launch import launch
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import named_spmd as ns
from named_spmd import P
from named_spmd._calls import active
from named_spmd._replay import checked_signatures

ONE = ((1, 1), ("dp", "tp"))


def megatron(x, w1, b1, w2):
    """A Megatron MLP with a tp-parallel loss: collectives, a bias, a partial sum."""
    h = F.gelu(x @ w1 + b1)  # column-parallel: varies over dp and tp
    y = ns.psum(h @ w2, "tp")  # row-parallel: a partial sum over tp, reduced
    return ns.pmean((y * y).mean().reshape(1), "dp")


def dense_megatron(x, w1, b1, w2):
    h = F.gelu(x @ w1 + b1)
    return ((h @ w2) ** 2).mean().reshape(1)


SPECS = (P("dp"), P(None, "tp"), P("tp"), P("tp"))


def inputs(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = [(8, 6), (6, 12), (12,), (12, 6)]
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def loss_and_grads(f, args):
    loss = f(*args)
    grads = torch.autograd.grad(loss.sum(), args)
    return loss.detach(), grads


def assert_same(got, want):
    """Equal losses and gradients (float64)."""
    torch.testing.assert_close(got[0], want[0], rtol=1e-12, atol=1e-12)
    for g, w in zip(got[1], want[1]):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


def assert_calls_equal_dense(f, calls: int = 3):
    """Each of ``calls`` calls of ``f`` (the first checked, the others replays) on new inputs
    gives the dense computation's loss and gradients."""
    for seed in range(calls):
        args = inputs(seed)
        assert_same(loss_and_grads(f, args), loss_and_grads(dense_megatron, args))


def test_every_call_equals_the_dense_computation():
    mesh = ns.make_mesh(*ONE)
    f = ns.spmd_map(megatron, mesh=mesh, in_specs=SPECS, out_specs=P())
    assert_calls_equal_dense(f)
    assert len(checked_signatures(f)) == 1  # one signature, checked once


def test_one_instance_equals_a_mesh_of_several():
    args = inputs(1)
    one = ns.spmd_map(megatron, mesh=ns.make_mesh(*ONE), in_specs=SPECS, out_specs=P())
    four = ns.spmd_map(
        megatron, mesh=ns.make_mesh((2, 2), ("dp", "tp")), in_specs=SPECS, out_specs=P()
    )
    want = loss_and_grads(four, args)
    for _ in range(2):  # checked, then replayed
        assert_same(loss_and_grads(one, args), want)


def test_a_replay_runs_without_the_typing_mode():
    mesh = ns.make_mesh(*ONE)
    modes = []

    def f(x):
        modes.append(torch.overrides._len_torch_function_stack())
        return ns.psum(x * 2, "dp")

    g = ns.spmd_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P())
    x = torch.arange(4.0)
    for _ in range(3):
        torch.testing.assert_close(g(x), x * 2)
    assert modes[0] == 2  # checked: the call's marker and its VmaMode
    assert modes[1:] == [0, 0]  # replayed: no mode at all (no checkpoint in the checked call)


@pytest.mark.parametrize("selective", [None, False, True])
def test_a_call_context_is_freed_without_the_garbage_collector(selective):
    """A call's context (holding its inputs), checked or replayed, is freed once the call and
    its graph are: no reference cycle leaves it to the garbage collector, with the collectives of
    a group of one and a checkpoint's marker.

    torch's own cycle is kept out: a process's first checkpoint imports ``torch._dynamo``
    (``torch._disable_dynamo``'s wrapper), whose import calls ``torch.fx.wrap``, which keeps its
    own frame in a local (``inspect.currentframe()``): that frame refers to itself, and through
    ``f_back`` to every frame below it, the call's with its context, until a collection. Imported
    here first, as any earlier checkpoint or compile of the process would have."""
    import torch._dynamo  # noqa: F401 - see the docstring

    mesh = ns.make_mesh(*ONE)
    contexts = []

    def body(*args):
        contexts.append(weakref.ref(active()))
        if selective is None:
            return megatron(*args)
        return checkpointed_megatron(*args, selective=selective)

    f = ns.spmd_map(body, mesh=mesh, in_specs=SPECS, out_specs=P())
    gc.disable()
    try:
        assert_calls_equal_dense(f)
        alive = [c() is not None for c in contexts]
    finally:
        gc.enable()
    assert alive == [False, False, False]


def test_errors_of_a_first_call_are_the_ones_of_a_larger_mesh():
    def leaky(x):
        return x * 2  # varies over dp; out_specs P() claims replication

    for shape in [(1, 1), (2, 2)]:
        mesh = ns.make_mesh(shape, ("dp", "tp"))
        f = ns.spmd_map(leaky, mesh=mesh, in_specs=P("dp"), out_specs=P())
        with pytest.raises(ns.VmaError, match=r"varies over \('dp',\), but its out_spec P\(\)"):
            f(torch.ones(4))
        with pytest.raises(ns.VmaError):  # and again: a failed call is not a checked signature
            f(torch.ones(4))


def _error_of(thunk) -> BaseException:
    with pytest.raises(Exception) as raised:
        thunk()
    return raised.value


def bad_matmul(x):
    return x @ torch.ones(3, 5)  # x's rows hold 4 columns


def out_of_range(x):
    return x[10]


WEIGHT = torch.zeros(4, requires_grad=True)


def written_leaf(x):
    WEIGHT.add_(1)  # a closed-over leaf that requires grad
    return x + WEIGHT


@pytest.mark.parametrize("fn", [bad_matmul, out_of_range, written_leaf])
def test_a_torch_error_on_one_instance_is_the_family_as_on_several(fn):
    """A torch op that rejects its operands: an SpmdError of torch's class family naming the
    function and the user's line, on one instance as on two, under vmap or per instance
    (torch's error its cause). A write into a leaf that requires grad is autograd's refusal on
    every instance, told as such with its fix, not as a limit of the simulation."""
    line = inspect.getsourcelines(fn)[1] + 1
    whole = contextlib.nullcontext
    for shape, runs in [((1,), whole), ((2,), whole), ((2,), ns.simulate_per_instance)]:
        mesh = ns.make_mesh(shape, ("dp",))
        f = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        block = torch.ones(4 // shape[0], 4)
        ref = _error_of(lambda: fn(block))  # torch's error on one instance's block
        with runs():
            err = _error_of(lambda: f(torch.ones(4, 4)))
        assert isinstance(err, ns.SpmdError) and isinstance(err, type(ref)), (shape, err)
        assert isinstance(err.__cause__, type(ref))
        message = str(err)
        assert f"spmd_map of `{fn.__qualname__}` (test_one_instance.py:{line - 1})" in message
        assert f" at test_one_instance.py:{line} " in message
        assert f"{type(ref).__name__}: {ref}" in message
        written = fn is written_leaf
        assert ("x = x.clone()" in message) == written, message
        assert "fails only when" not in message
        if written:  # autograd's refusal: one message on every mesh
            assert message == _simulated_message(fn)


def not_positive_definite(x):
    return torch.linalg.cholesky(-torch.eye(4) + 0 * x[:1])  # torch's LinAlgError


def bad_json(x):
    json.loads("{bad")  # the standard library's JSONDecodeError
    return x


def bad_date(x):
    datetime.datetime.strptime("bad", "%Y")  # a ValueError the standard library raises
    return x


@pytest.mark.parametrize("fn", [not_positive_definite, bad_json, bad_date])
def test_an_error_the_user_may_catch_is_left_as_raised(fn):
    """Only a torch op's rejection of exactly a class of the family is told as an SpmdError: a
    subclass (torch.linalg.LinAlgError, json.JSONDecodeError, torch.OutOfMemoryError) and an
    error the standard library raises come out as raised, so that the user's ``except`` of
    them catches them on every mesh and execution, as outside spmd_map."""
    ref = _error_of(lambda: fn(torch.ones(4, 4)))
    whole = contextlib.nullcontext
    for shape, runs in [((1,), whole), ((2,), whole), ((2,), ns.simulate_per_instance)]:
        mesh = ns.make_mesh(shape, ("dp",))
        f = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        with runs():
            err = _error_of(lambda: f(torch.ones(4, 4)))
        assert type(err) is type(ref) and not isinstance(err, ns.SpmdError), (shape, err)


RUNS = []  # one entry per run of gathered's body: a replay's error runs it no more


def gathered(x, i):
    RUNS.append(1)
    if int(i.sum()) > 10:
        raise IndexError("the function's own")
    return x[i]  # a tensor index: which rows, a value the signature does not hold


def test_a_torch_error_in_a_replay_is_told_without_running_the_call_again():
    """A replay runs without the typing mode, so a torch op's error ends in the user's frame:
    told from its traceback (an SpmdIndexError naming the function, the line and the fix: debug
    mode, which types every call and tells it as the first call of a signature does), the
    function run once; the function's own error stays as raised."""
    mesh = ns.make_mesh((1,), ("dp",))
    f = ns.spmd_map(gathered, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    fresh = ns.spmd_map(gathered, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x = torch.arange(4.0)
    torch.testing.assert_close(f(x, torch.tensor([1])), x[1:2])  # the signature's checked call
    ref = _error_of(lambda: fresh(x, torch.tensor([7])))
    assert isinstance(ref, ns.SpmdError) and isinstance(ref, IndexError)
    for _ in range(2):
        RUNS.clear()
        err = _error_of(lambda: f(x, torch.tensor([7])))
        assert type(err) is type(ref) and isinstance(err.__cause__, IndexError), err
        assert "spmd_map of `gathered`" in str(err) and "(`return x[i]" in str(err), err
        assert "ns.set_debug(True)" in str(err) and len(RUNS) == 1, (err, RUNS)
    ns.set_debug(True)
    try:
        assert str(_error_of(lambda: f(x, torch.tensor([7])))) == str(ref)
    finally:
        ns.set_debug(False)
    torch.testing.assert_close(f(x, torch.tensor([2])), x[2:3])
    f(x, torch.tensor([0, 1]))  # (the signature of two rows, checked)
    RUNS.clear()
    err = _error_of(lambda: f(x, torch.tensor([5, 9])))
    assert type(err) is IndexError and str(err) == "the function's own" and len(RUNS) == 1


def _simulated_message(fn) -> str:
    mesh = ns.make_mesh((1,), ("dp",))
    f = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    return str(_error_of(lambda: f(torch.ones(4, 4))))


def test_a_write_into_an_input_that_requires_grad_is_refused_with_its_fix():
    """Autograd refuses a write into an input that requires grad on every backend (the
    instance's block is the leaf, or a view of it); the fix the message names runs."""

    def bump(x):
        x.add_(1)
        return x * 2

    def bump_copy(x):
        x = x.clone()
        x.add_(1)
        return x * 2

    whole = contextlib.nullcontext
    for shape, runs in [((1,), whole), ((2,), whole), ((2,), ns.simulate_per_instance)]:
        mesh = ns.make_mesh(shape, ("dp",))
        for spec in (P(), P("dp")):
            f = ns.spmd_map(bump, mesh=mesh, in_specs=spec, out_specs=spec)
            g = ns.spmd_map(bump_copy, mesh=mesh, in_specs=spec, out_specs=spec)
            x = torch.zeros(4, requires_grad=True)
            with runs():
                err = _error_of(lambda: f(x))
                (grad,) = torch.autograd.grad(g(x).sum(), [x])
            assert type(err) is ns.SpmdError, (shape, spec, err)
            assert "autograd refused an in-place write" in str(err) and "x.clone()" in str(err)
            torch.testing.assert_close(grad, torch.full((4,), 2.0))


def test_the_same_function_under_other_out_specs_is_checked_again():
    mesh = ns.make_mesh(*ONE)

    def body(x):
        return x * 2

    good = ns.spmd_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    bad = ns.spmd_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P())
    x = torch.ones(4)
    good(x)
    good(x)
    with pytest.raises(ns.VmaError):
        bad(x)


def test_a_new_signature_is_checked_again():
    mesh = ns.make_mesh(*ONE)

    def f(x, reduce):
        return ns.psum(x, "dp") if reduce else x * 1

    g = ns.spmd_map(f, mesh=mesh, in_specs=(P("dp"), None), out_specs=P())
    x = torch.ones(4)
    g(x, True)
    g(x, True)
    with pytest.raises(ns.VmaError, match="out_specs claim replication"):
        g(x, False)  # a non-tensor argument's value is part of the signature
    g(x.double(), True)  # another dtype, and another grad requirement: checked again
    g(x.requires_grad_(), True)
    assert len(checked_signatures(g)) == 3


def test_a_function_that_reads_types_is_checked_on_every_call():
    mesh = ns.make_mesh(*ONE)
    seen = []

    def f(x, w):
        seen.append((ns.vma(x), str(ns.typeof(w))))
        return ns.psum(x * w, "dp")

    g = ns.spmd_map(f, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    for _ in range(3):
        g(torch.ones(4), torch.ones(4))
    assert seen == [(frozenset({"dp"}), "f32[4]{}")] * 3
    assert checked_signatures(g) == {}


def test_a_replay_skips_the_type_checks_and_debug_mode_restores_them():
    """The documented trade-off: types are checked once per signature (as a compiled call's are
    when traced); a program whose types change between calls of one signature through Python
    state is checked again in debug mode. The values are right either way on one instance."""
    mesh = ns.make_mesh(*ONE)
    state = {"reduce": True}

    def f(x):
        return ns.psum(x, "dp") if state["reduce"] else x * 1

    g = ns.spmd_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P())
    x = torch.arange(4.0)
    torch.testing.assert_close(g(x), x)
    state["reduce"] = False
    torch.testing.assert_close(g(x), x)  # replayed: unchecked, and the same numbers
    ns.set_debug(True)
    try:
        with pytest.raises(ns.VmaError, match="out_specs claim replication"):
            g(x)
    finally:
        ns.set_debug(None)


def _keep_matmuls(ctx, op, *args, **kwargs):
    if op is torch.ops.aten.mm.default:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def _megatron_block(x, w1, b1, w2):
    return ns.psum(F.gelu(x @ w1 + b1) @ w2, "tp")


def checkpointed_megatron(x, w1, b1, w2, selective: bool = False):
    """megatron with its collective-holding block checkpointed (non-reentrant)."""
    context = {}
    if selective:
        context["context_fn"] = lambda: create_selective_checkpoint_contexts(_keep_matmuls)
    y = checkpoint(_megatron_block, x, w1, b1, w2, use_reentrant=False, **context)
    return ns.pmean((y * y).mean().reshape(1), "dp")


def test_a_type_asked_for_only_in_a_replay_is_a_clear_error():
    """A replay has no types: a function whose first call asked for none and a later call of
    the same signature asks (its control flow changed through Python state) gets an SpmdError
    with the fix, not an invariant answer."""
    mesh = ns.make_mesh(*ONE)
    state = {"ask": False}

    def f(x):
        if state["ask"]:
            assert ns.vma(x) == {"dp"}
        return x * 2

    g = ns.spmd_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    g(torch.ones(4))
    state["ask"] = True
    with pytest.raises(ns.SpmdError, match=r"vma in .*runs untyped.*ns.set_debug\(True\)"):
        g(torch.ones(4))
    ns.set_debug(True)
    try:
        torch.testing.assert_close(g(torch.ones(4)), torch.full((4,), 2.0))  # typed: answered
    finally:
        ns.set_debug(None)


@pytest.mark.parametrize("selective", [False, True], ids=["full", "selective"])
def test_checkpointed_collectives_in_replays(selective):
    mesh = ns.make_mesh(*ONE)
    body = functools.partial(checkpointed_megatron, selective=selective)
    f = ns.spmd_map(body, mesh=mesh, in_specs=SPECS, out_specs=P())
    assert_calls_equal_dense(f)
    assert list(checked_signatures(f).values()) == [True]  # its replays keep the marker


def reductions(mesh) -> dict:
    """A replay's psum over the group of one: a temporary operand is handed back itself (the
    result's node is the operand's own); a named one, and one its op saved for the backward
    pass, are copied: a write into the result leaves the named operand and the saved one as
    they were (the values and the gradient equal the dense computation's)."""
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)

    def temporary(a):
        return ns.psum(a * 2, "dp")

    def named(a):
        h = a * 2
        ns.psum(h, "dp").add_(1)  # a write into the sum only
        return h

    def saved(a):
        y = ns.psum(torch.tanh(a), "dp")  # (tanh saves its result for its gradient)
        return y.mul_(3)

    nodes, worst = [], 0.0
    cases = ((temporary, x * 2, P()), (named, x * 2, P("dp")), (saved, 3 * torch.tanh(x), P()))
    for fn, want, out_spec in cases:
        f = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=out_spec)
        for _ in range(3):  # checked, then replayed
            out = ns.to_local(f(x))
            if fn is temporary:  # (below the simulated mesh's view of its output)
                node = out.grad_fn
                while type(node).__name__ == "ViewBackward0":
                    node = node.next_functions[0][0]
                nodes.append(type(node).__name__)
            (grad,) = torch.autograd.grad(out.sum(), [x])
            (dense,) = torch.autograd.grad(want.sum(), [x], retain_graph=True)
            for got, expected in ((out, want), (grad, dense)):
                worst = max(worst, float((got - expected).detach().abs().max()))
    return {"worst": worst, "temporary_nodes": nodes}


def under_a_mode(mesh) -> dict:
    """A replayed call of 20 parameters under a user's torch function mode (as
    ``torch.set_default_device`` pushes one): how many calls reach the mode, against the same
    body called plainly (the mode sees the user's ops, not the call's reads of each leaf's
    metadata), and the result's difference from the plain body's."""
    seen: list = []

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    def body(p):
        total = p["p0"].sum()
        for k in list(p)[1:]:
            total = total + p[k].sum()
        return total

    params = {f"p{i}": torch.randn(3, dtype=torch.float64, requires_grad=True) for i in range(20)}
    f = ns.spmd_map(body, mesh=mesh, in_specs=(P(),), out_specs=P())
    for _ in range(2):  # checked, then replayed
        f(params)
    with Seen():
        want = body(params)
        plain = len(seen)
        got = ns.to_local(f(params))
    return {
        "plain": plain,
        "mapped": len(seen) - plain,
        "worst": float((got - want).detach().abs()),
    }


def test_a_replay_under_a_users_mode_shows_it_the_users_ops():
    """The leaves' metadata reads of a call (its signature, the inputs' versions) run unseen
    by the user's modes: 20 leaves cost no 160 calls into one (``_torch_private.unseen_reads``)."""
    for shape in ((1,), (2,)):
        told = under_a_mode(ns.make_mesh(shape, ("x",), simulated=True))
        assert told["plain"] == 39 and told["mapped"] <= told["plain"] + 6, (shape, told)
        assert told["worst"] < 1e-12, (shape, told)


def _in_a_fresh_process(expression: str):
    """``expression``'s value (JSON) in a new interpreter that imports this module: where a
    reduction hands back its operand depends on reference counts, and in a process where other
    programs ran (the suite's compiled ones) the replayed operand can count more references than
    the calibration's, so the reduction copies (correct, one copy more)."""
    script = f"import json, test_one_instance as t; print(json.dumps({expression}))"
    out = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        cwd=os.path.dirname(os.path.abspath(__file__)),
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_a_replays_reduction_of_a_temporary_is_no_copy():
    r = _in_a_fresh_process("t.reductions(t.ns.make_mesh(*t.ONE))")
    assert r["worst"] < 1e-12, r
    # the checked call copies; its replays hand the temporary operand back (no copy node)
    assert r["temporary_nodes"] == ["CloneBackward0", "MulBackward0", "MulBackward0"], r


def pmean_handed_back() -> list[str]:
    """pmean over a group of one of a handed-back operand is that operand (no division by 1:
    complex division turns inf + 0j into nan + nanj, where torch's value is inf + nanj); the
    replays' result nodes."""
    mesh = ns.make_mesh(*ONE)
    f = ns.spmd_map(lambda a: ns.pmean(a + a, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    x = torch.tensor([complex(float("inf"), 0.0), 1 + 2j])
    want = x + x
    for _ in range(3):  # checked, then replayed
        got = torch.view_as_real(ns.to_local(f(x)))  # (a nan in either part is a nan complex)
        torch.testing.assert_close(got, torch.view_as_real(want), equal_nan=True)
    y = torch.randn(3, requires_grad=True)
    g = ns.spmd_map(lambda a: ns.pmean(a * 2, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
    nodes = []
    for _ in range(3):
        node = ns.to_local(g(y)).grad_fn
        while type(node).__name__ == "ViewBackward0":
            node = node.next_functions[0][0]
        nodes.append(type(node).__name__)
    return nodes


def test_a_replayed_pmean_of_a_temporary_is_the_handed_back_sum():
    pmean_handed_back()  # (the values, in this process)
    nodes = _in_a_fresh_process("t.pmean_handed_back()")
    assert nodes == ["CloneBackward0", "MulBackward0", "MulBackward0"]


OBSERVED_IMPORT = """
import json, sys
import torch
from torch.overrides import TorchFunctionMode

class Keep(TorchFunctionMode):  # a logging mode that keeps every value it sees
    kept = []
    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.kept.append(out)
        return out

def trace(frame, event, arg):  # a tracer that reads every frame's locals
    frame.f_locals
    return trace

observed = sys.argv[1] == "observed"
if observed:
    sys.settrace(trace)
    with Keep():
        import named_spmd as ns
        from named_spmd.backends import distributed
    sys.settrace(None)
else:
    import named_spmd as ns
    from named_spmd.backends import distributed
from named_spmd import P, _donation

mesh = ns.make_mesh((1, 1), ("dp", "tp"))

def named(a):
    h = a * 2
    ns.psum(h, "dp").add_(100)  # a write into the sum only: h stays 2
    return h

f = ns.spmd_map(named, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
got = [ns.to_local(f(torch.ones(2))).tolist() for _ in range(3)]
print(json.dumps({"limits": _donation.LIMITS, "got": got}))
"""


def _import_report(how: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", OBSERVED_IMPORT, how],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    return json.loads(out.stdout.splitlines()[-1])


def test_reference_counts_are_calibrated_with_nothing_watching():
    """A tracer or a mode that holds values while named_spmd is imported does not raise the
    calibrated counts (where it did, an operand held elsewhere was handed back: a write into
    the psum's result wrote the user's tensor)."""
    clean, observed = _import_report("clean"), _import_report("observed")
    for report in (clean, observed):
        assert report["got"] == [[2.0, 2.0]] * 3, report
    assert set(clean["limits"]) == {"forward", "backward", "pvary", "replayed"}, clean
    assert None not in clean["limits"].values(), clean
    assert observed["limits"] == clean["limits"]


@pytest.mark.distributed
def test_real_mesh_of_one_rank_replays_too():
    """The same programs on one gloo process (tests/one_rank_worker.py), DTensor and plain
    inputs: every call equals the dense computation; replays run without the typing mode, and
    with the marker exactly where the checked call ran a checkpoint."""
    finished = launch([os.path.join("tests", "one_rank_worker.py")], 1, 300)
    assert not finished.timed_out and finished.returncodes == [0], finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 4, finished.outputs[0][-3000:]
    for o in outcomes:
        assert o["worst"] < 1e-12, o
        checkpointed = o["check"] == "checkpointed"
        assert o["modes"] == [2, 1 if checkpointed else 0, 1 if checkpointed else 0], o
        assert o["marks"] == [checkpointed], o
        assert o["alive"] == 0, o  # each call's context freed with its graph, no collection
    (b,) = [json.loads(line) for line in finished.lines("BOUNDARY")]
    assert b["worst"] < 1e-12, b
    assert "placements (Replicate(), Replicate())" in b["refused"], b
    assert b["output_node"] == "MulBackward0", b  # the call's own product: no conversion
    assert b["partial_node"] == "_LocalOfBackward", b
    assert b["hooked"] == ["DTensor"], b  # a hook on the output sees its gradient
    assert not b["kept"], b  # a dropped output's memory is freed while its graph lives
    (r,) = [json.loads(line) for line in finished.lines("REDUCTIONS")]
    assert r["worst"] < 1e-12, r
    # the checked call copies; its replays hand the temporary operand back (no copy node)
    assert r["temporary_nodes"] == ["CloneBackward0", "MulBackward0", "MulBackward0"], r
    (m,) = [json.loads(line) for line in finished.lines("UNDER_A_MODE")]
    assert m["plain"] == 39 and m["mapped"] <= m["plain"] + 6 and m["worst"] < 1e-12, m
    (told,) = [json.loads(line) for line in finished.lines("ERRORS")]
    for fn in (bad_matmul, written_leaf):  # told as on the simulated mesh
        kind, message, cause = told[fn.__name__]
        line = inspect.getsourcelines(fn)[1] + 1
        assert kind == "SpmdError" and cause == "RuntimeError", told
        assert f"spmd_map of `{fn.__qualname__}` (test_one_instance.py:{line - 1})" in message
        assert f" at test_one_instance.py:{line} " in message
        if fn is written_leaf:  # autograd's refusal: the simulated mesh's message
            assert message == _simulated_message(fn)
        else:
            assert "on rank 0" in message and "x = x.clone()" not in message
    for fn in (not_positive_definite, bad_json, bad_date):  # left as raised, as simulated
        assert told[fn.__name__][0] == type(_error_of(lambda: fn(torch.ones(4, 4)))).__name__
    kind, message, cause = told["arguments"]  # the function's refusal of their number
    assert kind == "SpmdTypeError" and cause == "TypeError", told
    assert "with the call's 1 positional argument(s)" in message, message
    kind, message, cause = told["replayed"]  # a torch error in a replay: as the simulated mesh's
    assert kind == "SpmdIndexError" and cause == "IndexError", told
    assert "spmd_map of `gathered`" in message and "on rank 0" in message, message
    assert "(`return x[i]" in message and "ns.set_debug(True)" in message, message
    assert told["replayed runs"] == 1, told


def test_every_collective_on_one_instance_in_replays():
    """Each collective's replayed forward against its checked one (and the identity it is on a
    group of one), values and gradients."""
    mesh = ns.make_mesh(*ONE)

    def f(x):
        a = ns.all_gather(x, "tp", axis=0, tiled=True)
        b = ns.psum_scatter(a, "tp", scatter_dimension=0, tiled=True)
        c = ns.all_to_all(b, "dp", 0, 0, tiled=True)
        d = ns.ppermute(c, "dp", [(0, 0)])
        e = ns.pmax(d, "tp") + ns.pmin(d, "tp") + ns.pmean(d, ("dp", "tp"))
        u = ns.pcast(e, "dp", to="unreduced")
        r = ns.psum(u, "dp") + ns.axis_index("dp")
        return ns.all_gather(r, ("dp", "tp"), axis=0, tiled=True, to="invariant")

    g = ns.spmd_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P())
    x = torch.randn(4, 3, dtype=torch.float64, requires_grad=True)
    results = [loss_and_grads(lambda t: g(t) * torch.arange(3.0), [x]) for _ in range(3)]
    want_value = 3 * x.detach()
    for value, (grad,) in results:
        torch.testing.assert_close(value, want_value * torch.arange(3.0))
        torch.testing.assert_close(grad, 3 * torch.arange(3.0).expand(4, 3).double())


def test_a_replay_names_the_input_written_after_a_save_among_non_tensor_leaves():
    """The positions of a signature's tensor leaves are found once (``Call.input_versions``):
    with a non-tensor leaf before them and an inference tensor among them, a replay tells the
    write after a save as the checked call did, naming the same argument, and a call that
    writes nothing returns the dense values."""
    mesh = ns.make_mesh((1,), ("i",))
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def fn(scale, c, x, b):
        y = b * w * x * scale + c
        if scale > 1:
            b.add_(1)
        return ns.psum(y.sum(0, keepdim=True), "i")

    f = ns.spmd_map(fn, mesh=mesh, in_specs=(P(), P(), P("i"), P()), out_specs=P())
    with torch.inference_mode():
        c = torch.full((2,), 3.0, dtype=torch.float64)
    x = torch.arange(8.0, dtype=torch.float64).reshape(4, 2)
    for _ in range(2):  # the checked call, then its replay
        b = torch.full((2,), 2.0, dtype=torch.float64)
        want = (x * b * w.detach() * 1 + c).sum(0, keepdim=True)
        torch.testing.assert_close(f(1, c, x, b), want)
    for _ in range(2):
        b = torch.full((2,), 2.0, dtype=torch.float64)
        with pytest.raises(ns.SpmdError, match=r"wrote in place into an input \(argument \[3\]\)"):
            f(2, c, x, b)
