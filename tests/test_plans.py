"""Plans on a mesh of several instances: a call typed once per signature and replayed after, with
every call equal to the same call typed, including calls whose program changed since the plan
was made (tests/plan_worker.py): on a real mesh (``named_spmd._plan``, 2 gloo processes) and on a
simulated one (``backends/simulated/_planned.py``: the typing of calls whose inputs hold
blocks, which every case's do)."""

from __future__ import annotations

import contextlib
import functools
import gc
import json
import weakref

import pytest
import torch
from _dist_launch import launch
from plan_worker import CASES, LOCAL_THEN_GLOBAL, run

import named_spmd as ns
from named_spmd import _torch_private
from named_spmd._replay import checked_signatures

# case -> [calls replayed whole from a plan, calls whose program differed from the plan's] on
# each rank: such a call is replayed up to the first op that differs and typed from there (a
# call that raises is counted in neither); a new step number is a new signature
REPLAYS = {
    "flag_adds_a_use": [2, 1],
    "flag_drops_a_use": [2, 1],
    "flag_swaps_an_operand": [1, 1],
    "flag_drops_a_keyword_operand": [2, 1],
    "megatron": [2, 0],
    "branch_on_invariant_value": [1, 0],
    "step_number": [0, 0],
    "flag_checkpoints": [1, 2],
    "flag_varies_a_collective_result": [2, 0],
    "flag_fills_an_integer": [2, 0],
    "flag_gathers_varying": [2, 0],
    "reshapes_by_a_value": [1, 0],
    "flag_slices_by_a_varying_bound": [2, 1],
}
# A simulated call always marks itself (its marker types its ops), so a checkpoint's
# recomputation finds a replayed call; a real mesh's replay of a plan made without a checkpoint
# runs unmarked, and a checkpoint in it (saved-tensor hooks) is a divergence: typed.
# A varying slice bound is refused by vmap: that call raises (it is typed).
SIMULATED_REPLAYS = {"flag_checkpoints": [3, 0], "flag_slices_by_a_varying_bound": [2, 0]}


@functools.cache
def _outcomes() -> dict:
    finished = launch(["tests/plan_worker.py"], 2, 600)
    assert not finished.timed_out and finished.returncodes == [0, 0], finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    return {(o["rank"], o["name"]): o for o in outcomes}


@pytest.mark.distributed
def test_replays_follow_the_bucket_size_and_requires_grad_changed_between_calls():
    """The gradient bucket size changed on every rank between replays of one plan (its groups
    pvary'd at the entry are kept per size: at 100 bytes a group is left to its buckets), and
    an input's requires_grad toggled (another signature, typed): the typed calls' values and
    gradients; only the replays at the default size pvary at their entry."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, "settings_change"]
        assert outcome["problems"] == [] and outcome["calls"] == 6, outcome
        assert outcome["hoisted"] == [False, True, False, False, False, True], outcome


@pytest.mark.distributed
@pytest.mark.parametrize("name", list(CASES))
def test_every_call_equals_the_same_call_typed(name):
    for rank in (0, 1):
        outcome = _outcomes()[rank, name]
        assert outcome["problems"] == [], outcome["problems"]
        assert outcome["replays"] == REPLAYS[name], outcome


@pytest.mark.distributed
def test_a_replay_pvarys_the_parameters_at_its_entry():
    """The planned call pvarys each replicated parameter at its use; its replays pvary them all
    at their entry, by one node (``_dist_pvary.PvaryAll``), the call that drops a use too (its
    values and gradients, b1's None, are the typed call's: above)."""
    for rank in (0, 1):
        assert _outcomes()[rank, "flag_drops_a_use"]["hoisted"] == [False, True, True, True]


@pytest.mark.distributed
def test_a_second_derivative_through_a_replay_equals_the_typed_calls():
    """``create_graph`` through the node that pvarys a replay's parameters at its entry: each
    gradient's psum is then the bridge's, differentiable; equal to the calls typed."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, "second_order"]
        assert outcome["problems"] == [] and outcome["hoisted"] == [False, True, True], outcome


@pytest.mark.distributed
def test_a_recorded_replay_counts_the_typed_calls_collectives():
    """A replay pvarys the parameters at its entry whether a ``CommMode`` records or not, on
    one rank or on all (the ranks' backward all-reduces must match); recorded, each parameter's
    alias counts its backward psum at its use, also where the body enters the mode: the same
    events, values and gradients as the calls typed."""
    # the typed calls' events: each parameter's psum (w1, b1, w2) and the loss's pmean
    events = [["backward", "psum", ["x"], 3], ["forward", "pmean", ["x"], 1]]
    for rank in (0, 1):
        outcome = _outcomes()[rank, "recorded"]
        assert outcome["problems"] == [], outcome
        assert outcome["hoisted"] == [False, True, True, True, True], outcome
        # recorded: on this rank alone (call 0 or 1), on both around the call, in the body
        want = {str(k): events for k in (rank, 3, 4)}
        assert outcome["counts"] == outcome["typed"]["counts"] == want, outcome


@pytest.mark.distributed
def test_a_replay_pvarys_small_parameters_at_its_entry_however_many_bytes_they_make():
    """Five parameters of 1 MB (5 MB together) and one of 2 MB: each replay pvarys the five at
    its entry, in one node, and leaves the large one to its bucket; values and gradients are the
    typed calls'."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, "large_inputs"]
        assert outcome["problems"] == [], outcome
        assert outcome["hoisted"] == [False, True, True], outcome
        assert outcome["taken"] == [0, 5, 5], outcome


@pytest.mark.distributed
def test_a_replays_context_is_freed_with_its_graph():
    """The node that pvarys a replay's parameters at its entry holds the call's context, which
    must not hold it back (nor the call's inputs) once the graph is gone."""
    for rank in (0, 1):
        for name in ("recorded", "in_place"):
            outcome = _outcomes()[rank, name]
            assert any(outcome["hoisted"]) and all(outcome["freed"]), outcome


@pytest.mark.distributed
def test_a_parameter_written_in_place_in_the_body_keeps_its_alias():
    """Written in place (without grad) before its first use, a parameter's alias made at the
    replay's entry serves its use: the typed calls' values and gradients."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, "in_place"]
        assert outcome["problems"] == [] and outcome["hoisted"] == [False, True, True], outcome


@pytest.mark.distributed
def test_ranks_that_would_reduce_gradients_differently_do_not_hoist_or_raise_alike():
    """One rank alone reads a type (so it plans a later call than the other) or writes a
    parameter in place: the calls equal the typed ones (no rank pvarys at its entry where
    another would not); debug mode, a bucket size or inputs of other shapes on one rank: both
    raise, the settings named only where the inputs are alike."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, "ranks_differ"]
        assert outcome["problems"] == [] and outcome["errors"] == [2, 3, 5], outcome
        assert outcome["settings named"] == [2, 3], outcome
        assert outcome["typed"] == {"errors": [2, 3, 5], "settings named": [2, 3]}, outcome


@pytest.mark.distributed
def test_replays_hoist_before_the_check_once_one_agreed_and_ranks_apart_refuse_alike():
    """Once a replay of a plan pvary'd the parameters at its entry, agreed and returned, the
    plan's replays do so before the start-of-call check is finished (the check overlaps the
    body); where one rank alone does not (rank 1 forgot the agreement before call 3), both ranks
    raise an SpmdError naming it, the next call checks first, and the one after hoists early
    again; every other call equals the typed one."""
    for rank, apart in ((0, True), (1, False)):
        outcome = _outcomes()[rank, "hoisted_apart"]
        assert outcome["early"] == [False, False, True, apart, False, True], outcome
        assert outcome["told"] == [3], outcome
        assert outcome["typed"]["told"] == [], outcome  # (typed calls hoist nothing)
        problems = outcome["problems"]
        assert len(problems) == 1 and problems[0].startswith("call 3:"), outcome


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.filterwarnings("ignore:Converting a tensor with requires_grad=True to a scalar")
def test_simulated_calls_equal_the_same_calls_typed(name):
    # (branch_on_invariant_value reads its input with float(), as the case means to)
    outcome = run(name, ns.make_mesh((2,), ("x",), simulated=True))
    assert outcome["problems"] == [], outcome["problems"]
    assert outcome["replays"] == SIMULATED_REPLAYS.get(name, REPLAYS[name]), outcome


@pytest.mark.distributed
def test_a_collectives_result_of_another_shape_is_typed_as_the_call_typed():
    """A collective's result whose shape follows a Python argument (``tiled=flag``), feeding
    ops whose shapes follow their operands': the call that gathers whole is the out_specs
    error of a bias added to a partial sum, as typed, not the stacked call's types replayed;
    the calls around it replay."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, "gather_tiled_by_a_flag"]
        assert outcome["problems"] == [] and outcome["replays"] == [2, 0], outcome
        assert outcome["typed"]["replays"] == [0, 0], outcome


def test_a_simulated_collectives_result_of_another_shape_is_typed_as_the_call_typed():
    """As above, on a simulated mesh."""
    outcome = run("gather_tiled_by_a_flag", ns.make_mesh((2,), ("x",), simulated=True))
    assert outcome["problems"] == [] and outcome["replays"] == [2, 0], outcome


@pytest.mark.distributed
def test_a_local_calls_plan_is_not_a_global_calls():
    """The same shapes as blocks (``.local``) and as global values: the global call's blocks
    are unequal, its outputs and gradients the dense ones."""
    for rank in (0, 1):
        outcome = _outcomes()[rank, LOCAL_THEN_GLOBAL]
        assert outcome["problems"] == [] and outcome["calls"] == 4, outcome


def test_a_simulated_call_holding_blocks_dispatches_each_op_through_one_mode():
    """Its typing (planned, then replayed) runs from the call's marker (``marker_typing``), not
    as a second torch-function mode: each op passes through Python once. Values and the
    gradient are the dense computation's, in the typed call and in the replay."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    depths = []

    def f(x, w):
        depths.append(_torch_private.function_mode_depth())
        return ns.psum(x @ w, "tp")

    g = ns.spmd_map(f, mesh=mesh, in_specs=(ns.P("dp", "tp"), ns.P("tp")), out_specs=ns.P("dp"))
    x, w = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    base = _torch_private.function_mode_depth()
    for _ in range(2):  # typed (the plan made), then replayed
        wg = w.clone().requires_grad_()
        out = g(x, wg)
        torch.testing.assert_close(out, x @ w)
        out.sum().backward()
        torch.testing.assert_close(wg.grad, x.sum(0)[:, None].expand(6, 3))
    assert depths == [base + 1, base + 1]
    plans = list(checked_signatures(g).values())
    assert len(plans) == 1 and plans[0].replays == 1


class _Scale:
    """A leaf the input checks cannot key by shape and dtype (no tensor, no plain value)."""

    def __init__(self, k: int) -> None:
        self.k = k

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Scale) and other.k == self.k

    def __hash__(self) -> int:
        return hash(self.k)


@pytest.mark.parametrize("wrap", [int, _Scale], ids=["int", "object"])
def test_a_simulated_signature_is_keyed_by_the_leaves_dtypes_and_values(wrap):
    """A call's signature reads its tensors' shapes, dtypes and specs through the input checks'
    memo (``Call.memo``; a leaf they cannot key, an object, every leaf in full): a new dtype or
    a new value is a new plan, an equal one replays it; every call gives the dense values."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def f(x, w, s):
        return ns.psum(x @ w, "tp") * (s.k if isinstance(s, _Scale) else s)

    specs = (ns.P("dp", "tp"), ns.P("tp"), ns.P())
    g = ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=ns.P("dp"))
    for dtype in (torch.float64, torch.float32, torch.float64):
        x, w = torch.randn(4, 6, dtype=dtype), torch.randn(6, 3, dtype=dtype)
        for k in (2, 2, 3):
            torch.testing.assert_close(g(x, w, wrap(k)), (x @ w) * k)
    plans = checked_signatures(g).values()
    # float64 with 2: planned, then 3 replays; with 3: 1; float32 with 2: 1, with 3: none
    assert sorted(p.replays for p in plans) == [0, 1, 1, 3]
    assert all(p.divergences == 0 for p in plans)


@pytest.mark.parametrize("unused_first", [False, True], ids=["", "used-without-grad-first"])
def test_a_simulated_contractions_invariant_input_is_expanded_over_the_weights_axes(unused_first):
    """The input of ``F.linear`` invariant over tp (after a psum) against a weight split over
    tp is expanded over the tp level (``_marks.input_axes``), recorded in the plan's step and
    replayed: the values, gradients and out_specs' types are the dense model's either way, and
    a recording ``CommMode`` (which reads the implicit pvary off the levels) sees its psum. A
    use under ``no_grad`` first (a logging branch) leaves the later use its gradient."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def mlp(x, w1, w2):
        h = torch.nn.functional.layer_norm(ns.psum(x @ w2, "tp"), (4,))
        if unused_first:
            with torch.no_grad():
                torch.nn.functional.linear(h, w1)
        return ns.psum(torch.nn.functional.linear(h, w1).tanh() @ w2, "tp")

    def dense(x, w1, w2):
        return (
            torch.nn.functional.linear(torch.nn.functional.layer_norm(x @ w2, (4,)), w1).tanh() @ w2
        )

    specs = (ns.P("dp", "tp"), ns.P("tp"), ns.P("tp"))
    g = ns.spmd_map(mlp, mesh=mesh, in_specs=specs, out_specs=ns.P("dp"))
    x = torch.randn(6, 8, dtype=torch.float64)
    w1, w2 = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    ws = [w.requires_grad_() for w in (w1.clone(), w2.clone())]
    want = dense(x, *ws)
    want_grads = torch.autograd.grad(want.square().sum(), ws)
    for recording in (False, False, True):  # typed (the plan made), replayed, replayed recording
        ws = [w.detach().clone().requires_grad_() for w in (w1, w2)]
        with ns.CommMode() if recording else contextlib.nullcontext() as comm:
            out = g(x, *ws)
            grads = torch.autograd.grad(out.square().sum(), ws)
        torch.testing.assert_close(out, want)
        for got, expected in zip(grads, want_grads):
            torch.testing.assert_close(got, expected)
    assert comm.counts() == {  # forward: the psums; backward: the implicit pvarys (dp: w1, w2)
        ("forward", "psum", ("tp",)): 2,
        ("backward", "psum", ("tp",)): 1,
        ("backward", "psum", ("dp",)): 2,
    }
    (plan,) = checked_signatures(g).values()
    assert plan.replays == 2
    linear = [s for s in plan.steps if s.func is torch.nn.functional.linear]
    assert [s.casts for s in linear] == [("tp",)] * (1 + unused_first)


def test_a_parameter_on_the_left_of_a_matmul_is_not_expanded():
    """``w @ x.T`` with ``w`` a parameter invariant over dp and ``x`` split over dp: vmap folds
    the batch into the columns of one matmul, which an expanded ``w`` (a gradient per
    instance, summed) would not; the plan records no expand, and the values and gradient are
    the dense ones."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    g = ns.spmd_map(
        lambda w, x: (w @ x.T).T, mesh=mesh, in_specs=(ns.P(), ns.P("dp")), out_specs=ns.P("dp")
    )
    w, x = torch.randn(3, 5, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)
    for _ in range(2):  # typed, then replayed
        wg = w.clone().requires_grad_()
        out = g(wg, x)
        torch.testing.assert_close(out, x @ w.T)
        (grad,) = torch.autograd.grad(out.square().sum(), wg)
        torch.testing.assert_close(grad, 2 * (x @ w.T).T @ x)
    (plan,) = checked_signatures(g).values()
    assert [s.casts for s in plan.steps if s.func is torch.Tensor.matmul] == [()]


def test_a_simulated_calls_expanded_inputs_are_not_kept_past_the_call():
    """The call's cache of expanded inputs is emptied when its body ends: a context lives on
    until the garbage collector breaks its cycles, and the inputs are activations."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    kept = []

    def mlp(x, w1, w2):
        h = torch.nn.functional.layer_norm(ns.psum(x @ w2, "tp"), (4,))
        kept.append(weakref.ref(h))
        return ns.psum(torch.nn.functional.linear(h, w1).tanh() @ w2, "tp")

    specs = (ns.P("dp", "tp"), ns.P("tp"), ns.P("tp"))
    g = ns.spmd_map(mlp, mesh=mesh, in_specs=specs, out_specs=ns.P("dp"))
    x, w1, w2 = torch.randn(6, 8), torch.randn(8, 4), torch.randn(8, 4).requires_grad_()
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):  # typed, then replayed
            g(x, w1, w2).sum().backward()
            assert kept.pop()() is None
    finally:
        gc.enable()


def test_a_guard_key_tells_apart_what_typing_may_depend_on():
    """``_plan.guard_key``: equal for arguments a step's typing treats alike (a tensor from
    outside the call by its shape and dtype), and different for any that it may not: ``1``,
    ``1.0`` and ``True``, a value positional or keyword, keywords' names and order, a list or a
    tuple, and nested tensors' shapes."""
    from named_spmd._plan import guard_key, matches

    token = object()

    def key(*args, **kwargs):
        return guard_key(token, args, kwargs or None)

    x = torch.ones(2)
    assert key(x, 1, dim=[x, 2.0]) == key(torch.zeros(2), 1, dim=[torch.zeros(2), 2.0])
    calls = [
        ((x, 1), {}),
        ((x, 1.0), {}),
        ((x, True), {}),
        ((x,), {"dim": 1}),
        ((x,), {"keepdim": 1}),
        ((x, 1), {"keepdim": True}),
        ((x,), {"keepdim": True, "dim": 1}),
        ((x,), {"dim": 1, "keepdim": True}),
        ((x, (1,)), {}),
        ((x, [1]), {}),
        ((x, [torch.ones(3)]), {}),
        ((x, [x]), {}),
        ((x, x), {}),
        ((x, torch.ones(2, dtype=torch.float64)), {}),
        ((x, None), {}),
        ((x, "1"), {}),
        ((x, torch.Size([1])), {}),
        ((x, 1, 2), {}),
    ]
    keys = [key(*args, **kwargs) for args, kwargs in calls]
    assert len(set(keys)) == len(keys), keys
    # a replay compares a call's arguments with a key without building theirs: the same answer
    same = [key(torch.zeros(2), 1.0), key(torch.zeros(2), [torch.zeros(1)])]
    for args, kwargs in [*calls, ((x, 1.0), {}), ((x, [torch.ones(1)]), {})]:
        for recorded in [*keys, *same]:
            answer = matches(token, recorded, args, kwargs or None)
            assert answer == (recorded == key(*args, **kwargs)), (recorded, args, kwargs)


def test_the_guards_fast_path_answers_as_the_key_does():
    """``_plan._numbered_alike``, the guard's usual case (tensors the call numbered, ints, strs,
    tuples of ints, the very constants of the typed call, keyword arguments): True only where
    the key built of the arguments is the recorded one, and True there for those arguments."""
    from named_spmd._plan import SRC, _numbered_alike, guard_key

    token = object()
    x, y = torch.ones(2), torch.ones(2)
    x.__dict__[SRC], y.__dict__[SRC] = (token, 0), (token, 1)
    # a collective's results, numbered with their type and shape: one number, other shapes
    vma = ns.typeof  # (any interned object stands for the type here)
    row, column = torch.ones(2), torch.ones(2, 1)
    row.__dict__[SRC], column.__dict__[SRC] = (
        (token, (2, vma, row.shape)),
        (token, (2, vma, column.shape)),
    )
    eps, other_eps = 1e-5, 1e-3

    def key(*args, **kwargs):
        return guard_key(token, args, kwargs or None)

    calls = [
        ((x, (4,)), {"weight": y, "eps": eps}),
        ((x, (4,)), {"weight": y, "eps": other_eps}),
        ((x, (4,)), {"eps": eps, "weight": y}),
        ((x, (4,)), {"weight": x, "eps": eps}),
        ((x, (5,)), {"weight": y, "eps": eps}),
        ((x, (4, 1)), {"weight": y, "eps": eps}),
        ((x, [4]), {"weight": y, "eps": eps}),
        ((x, (4.0,)), {"weight": y, "eps": eps}),
        ((x, (True,)), {"weight": y, "eps": eps}),
        ((x, (y,)), {}),
        ((x, (x,)), {}),
        ((x, y), {"reduction": "mean"}),
        ((x, y), {"reduction": "sum"}),
        ((x, y), {"ignore_index": -100}),
        ((x, y), {"ignore_index": -100.0}),
        ((x, y), {"is_causal": True}),
        ((x, y), {"is_causal": 1}),
        ((x, y), {"is_causal": False}),
        ((x, y), {"dim": 1}),
        ((x, y), {"keepdim": 1}),
        ((x, y, None), {}),
        ((x, y), {}),
        ((x, row), {}),
        ((x, column), {}),
    ]
    keys = [key(*args, **kwargs) for args, kwargs in calls]
    assert len(set(keys)) == len(keys), keys
    for i, (args, kwargs) in enumerate(calls):
        for j, recorded in enumerate(keys):
            fast = _numbered_alike(token, recorded, args, kwargs or None)
            if fast:
                assert recorded == key(*args, **kwargs), (recorded, args, kwargs)
            if i == j and not any(_undecided(a) for a in args):
                assert fast, (args, kwargs)


def _undecided(a) -> bool:
    """An argument the guard's fast path leaves to ``matches``: a list, a tuple of anything but
    ints (a float not the key's own object, a tensor)."""
    return type(a) is list or (type(a) is tuple and any(type(v) is not int for v in a))
