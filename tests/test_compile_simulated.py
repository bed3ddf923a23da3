"""torch.compile and the simulated mesh.

* A compiled mapped call (``torch.compile(spmd_map(f))``, or a compiled step calling one) is traced
  whole (backends/simulated/_traced.py): ``fullgraph=True`` on aot_eager and inductor for the
  catalogue's programs (eager for one per kind of collective), values and gradients equal to the
  eager call over three steps with one compiled frame, and the eager call's errors, raised at
  trace time (tests/compile_worker.py's checks, run here in one process).
* A compiled function called inside the per-device function of an eager call runs uncompiled
  there (Dynamo cannot trace under the eager simulation's vmap levels), with the numbers of the
  uncompiled piece (backends/simulated/_compiled.py); inside a compiled call it is traced with it.
* A backend Dynamo cannot trace (``capabilities.traceable`` false) runs its calls eagerly inside
  a compiled program, with a graph break around each (SpmdFunction.__call__).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
from types import SimpleNamespace

import optree
import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func

import named_spmd as ns
from named_spmd import P
from named_spmd._compile import LIVE_MODULES, library_guard_filter, without_library_guards
from named_spmd.backends.simulated import BACKEND as SIMULATED

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import compile_worker  # noqa: E402
from test_compile import EACH_KIND, ERRORS, PROGRAMS  # noqa: E402

# Inductor in float32 (1e-5): these programs; in float64 (1e-10): the others.
FLOAT32_INDUCTOR = ["megatron_biases@4", "ring_pass@4", "vocab_parallel_ce"]


def _passes(check, name: str, backend: str) -> None:
    result = compile_worker._guarded(check, name, backend)
    assert not result["problems"], f"{result['problems']}\n{result.get('traceback', '')}"


@pytest.mark.parametrize(
    "name, backend",
    [(n, "aot_eager") for n in PROGRAMS] + [(n, "eager") for n in EACH_KIND],
)
def test_a_compiled_call_equals_the_eager_call(name, backend):
    """Every program through aot_autograd; Dynamo's graph alone (``eager``) for one program per
    kind of collective."""
    _passes(compile_worker.check_program, name, backend)


@pytest.mark.parametrize("name", [n for n in PROGRAMS if n not in FLOAT32_INDUCTOR])
def test_a_compiled_call_equals_the_eager_call_with_inductor(name):
    _passes(compile_worker.check_program, name, "inductor")


# One program per kind of traced boundary: a psum, a ppermute, attention (ns.compile differs from
# torch.compile in its guards only; every program runs through torch.compile above).
@pytest.mark.parametrize("name", ["megatron_biases@4", "ring_pass@4", "block@4"])
def test_ns_compile_of_a_call_equals_the_eager_call(name):
    """``ns.compile`` (which leaves out the guards on the package's constants) gives the eager
    call's values and gradients, with one compiled frame over three steps."""
    check = functools.partial(compile_worker.check_program, compile=ns.compile)
    _passes(check, name, "aot_eager")


def test_ns_compile_drops_the_guards_on_the_package_constants_only():
    """The trace of a mapped call reads the package's constants and memo tables (guards that
    ``library_guard_filter`` drops) and its live state: the call stack and CommMode's recorders,
    whose guards it keeps. Read off the guards Dynamo offers the filter, so that a change in
    how Dynamo names a module's globals shows here rather than as a silently unfiltered call."""
    offered: list[str] = []

    def record(entries):
        offered.extend(e.name for e in entries)
        return [True] * len(entries)

    _prog, f = compile_worker.mapped("megatron_biases@4")
    compiled = ns.compile(f, backend="eager", fullgraph=True, options={"guard_filter_fn": record})
    compiled(*_prog.args())
    dropped = [n for n in offered if not library_guard_filter([SimpleNamespace(name=n)])[0]]
    kept_live = [n for n in offered if "named_spmd_dot__calls" in n]
    kept_live += [n for n in offered if "named_spmd_dot__accounting" in n]
    assert len(dropped) > 100, len(dropped)  # the type algebra's memos, the rule tables, ...
    assert all("__import_named_spmd" in n and "L['" not in n for n in dropped), dropped
    assert not any(m.replace(".", "_dot_") in n for n in dropped for m in LIVE_MODULES)
    assert kept_live and library_guard_filter([SimpleNamespace(name=n) for n in kept_live]) == [
        True
    ] * len(kept_live)
    for module in LIVE_MODULES:  # a renamed module would lose its guards silently
        importlib.import_module(module)


def test_ns_compile_keeps_the_callers_own_guard_filter():
    """A caller's ``guard_filter_fn`` and the package's both decide: a guard stays where both
    keep it; with ``mode=`` torch takes no options, and none are added."""
    names = ["L['x']", "G['torch']", "G['__import_named_spmd_dot__spec'].Vma", "L['y']"]
    given = {"backend": "eager", "options": {"guard_filter_fn": _keep_all_but_y}}
    options = without_library_guards(given)
    both = options["options"]["guard_filter_fn"]
    assert both([SimpleNamespace(name=n) for n in names]) == [True, True, False, False]
    assert given["options"]["guard_filter_fn"] is _keep_all_but_y  # the caller's dict untouched
    assert without_library_guards({"mode": "max-autotune"}) == {"mode": "max-autotune"}


def _keep_all_but_y(entries):
    return [e.name != "L['y']" for e in entries]


@pytest.mark.parametrize("name", FLOAT32_INDUCTOR)
def test_float32_inductor_equals_eager_to_1e_5(name):
    """Inductor fuses and reorders float32 arithmetic: outputs and gradients within 1e-5
    (relative) of the eager call."""
    prog, f = compile_worker.mapped(name)
    args = optree.tree_map(lambda a: a.float() if a.is_floating_point() else a, prog.args())
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="inductor", fullgraph=True)
    (want, want_g), (got, got_g) = (compile_worker.evaluate(g, args, 1.0) for g in (f, compiled))
    for a, b in zip([*got, *got_g], [*want, *want_g]):
        scale = float(b.abs().max()) if b is not None and b.numel() else 1.0
        assert compile_worker.close(a, b, rtol=1e-5, atol=1e-5 * scale)


def test_a_call_compiled_before_any_eager_call_does_not_recompile_after_one():
    _passes(compile_worker.check_compiled_first, "megatron_biases@4", "aot_eager")


@pytest.mark.parametrize("name", ERRORS)
def test_a_compiled_call_raises_the_eager_calls_error(name):
    _passes(functools.partial(compile_worker.check_error, size=4), name, "eager")


# Dynamo reads `.grad` of the call's (non-leaf) output it hands across the graph break (as in
# test_a_backend_dynamo_cannot_trace_runs_its_calls_eagerly)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_a_compiled_call_of_uneven_blocks_runs_eagerly(backend):
    _passes(functools.partial(compile_worker.check_uneven, size=4), "indivisible_input", backend)


def _mlp(piece):
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def f(x, w1, b1, w2):
        return ns.psum(piece(x @ w1 + b1) @ w2, "tp")

    specs = (P("dp", None), P(None, "tp"), P("tp"), P("tp", None))
    return ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=P("dp", None))


def _args():
    g = torch.Generator().manual_seed(0)
    shapes = ((6, 5), (5, 8), (8,), (8, 3))
    return [torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def _raw(h):
    return torch.tanh(h) * torch.sigmoid(h)


def _assert_same(got, want, wrt, loss=lambda y: (y * y).sum()) -> None:
    """Equal values, and equal gradients of ``loss`` of each with respect to ``wrt``."""
    assert torch.allclose(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(torch.autograd.grad(loss(got), wrt), torch.autograd.grad(loss(want), wrt)):
        assert torch.allclose(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_compiled_piece_inside_runs_uncompiled_with_the_same_numbers(backend):
    counter = CompileCounterWithBackend(backend)
    piece = torch.compile(_raw, backend=counter, fullgraph=True)
    compiled, plain = _mlp(piece), _mlp(_raw)
    args = _args()
    for _ in range(2):  # the first call meets the refusal and runs again; the second runs at once
        _assert_same(compiled(*args), plain(*args), args)
    assert counter.frame_count == 0  # nothing was compiled: the piece ran its original code
    # outside the mapped function the piece still compiles
    x = torch.randn(3, 4, dtype=torch.float64)
    assert torch.allclose(piece(x), _raw(x))
    assert counter.frame_count == 1


def _dict_mlp():
    """Parameters in a dict (what pytree-prefix in_specs invite)."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def f(x, p):
        return ns.psum(_raw(x @ p["w1"] + p["b1"]) @ p["w2"], "tp")

    specs = (P("dp", None), {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)})
    return ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=P("dp", None))


def _step(f):
    def step(x, p):
        return (f(torch.sin(x), p) ** 2).sum() * 0.5

    return step


def _equal_steps(compiled, step, x, params) -> None:
    for _ in range(2):
        _assert_same(compiled(x, params), step(x, params), [x, *params.values()], lambda y: y)


@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_compiled_step_traces_a_simulated_call_whole(backend):
    """The call inside a compiled step, its arguments a dict: one graph (``fullgraph=True``)
    with the ops around it, the eager step's values and gradients, no recompile on step 2."""
    f = _dict_mlp()
    x, w1, b1, w2 = _args()
    step = _step(f)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    _equal_steps(compiled, step, x, {"w1": w1, "b1": b1, "w2": w2})
    assert counter.frame_count == 1


@pytest.mark.parametrize("wrap", ["torch.compile", "ns.compile"])
def test_a_compiled_piece_inside_a_compiled_call_is_traced_with_it(wrap):
    make = torch.compile if wrap == "torch.compile" else ns.compile
    piece = make(_raw, backend="eager", fullgraph=True)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(_mlp(piece), backend=counter, fullgraph=True)
    plain = _mlp(_raw)
    args = _args()
    _assert_same(compiled(*args), plain(*args), args)
    assert counter.frame_count == 1


def _untraceable(monkeypatch) -> None:
    """The simulated backend as one whose calls Dynamo cannot trace."""
    untraced = dataclasses.replace(SIMULATED.capabilities, traceable=False)
    monkeypatch.setattr(SIMULATED, "capabilities", untraced)


# Dynamo itself (torch 2.13, variables/builder.py wrap_tensor) reads `.grad` of the non-leaf
# tensor it hands across the graph break; under the default warning filters nothing is shown
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
@pytest.mark.parametrize("backend", ["eager", "aot_eager", "inductor"])
def test_a_backend_dynamo_cannot_trace_runs_its_calls_eagerly(backend, monkeypatch):
    """A call on a backend whose calls Dynamo cannot trace inside a compiled step: a graph break
    around it, the ops around it compiled; values and gradients are the eager step's, whatever
    the arguments' pytree (a call resumed after a break inside it once got Dynamo's stand-in for
    the dict's treespec, and failed)."""
    _untraceable(monkeypatch)
    f = _dict_mlp()
    x, w1, b1, w2 = _args()
    step = _step(f)
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(step, backend=counter)
    _equal_steps(compiled, step, x, {"w1": w1, "b1": b1, "w2": w2})
    # sin before the call and the loss after it compiled, once each: no recompile on step 2
    assert counter.frame_count == 2


def _counted(call, x, params) -> dict:
    with ns.CommMode() as comm:
        call(x, params).sum().backward()
    return comm.counts()


@pytest.mark.parametrize("fullgraph", [False, True])
def test_an_ns_compiled_call_under_comm_mode_runs_eagerly_and_is_counted(fullgraph):
    """Under ``ns.CommMode`` a call of ``ns.compile(f)`` runs ``f`` eagerly, so that CommMode
    counts what it runs (the eager call's counts), and compiles nothing; outside CommMode the
    compiled frame again, with the eager call's values, no recompile."""
    f = _dict_mlp()
    x, w1, b1, w2 = _args()
    params = {"w1": w1, "b1": b1, "w2": w2}
    counter = CompileCounterWithBackend("eager")
    compiled = ns.compile(f, backend=counter, fullgraph=fullgraph)
    compiled(x, params)
    counts = _counted(compiled, x, params)
    assert counts == _counted(f, x, params) and sum(counts.values()) > 0, counts
    _assert_same(compiled(x, params), f(x, params), (x, w1, b1, w2))
    assert counter.frame_count == 1


def test_a_torch_compiled_call_under_comm_mode_breaks_the_graph_and_is_counted():
    """``torch.compile(f)`` under ``ns.CommMode``: Dynamo retraces (CommMode's state is
    guarded) and the call runs eagerly behind a graph break, counted as the eager call is; with
    ``fullgraph=True`` Dynamo refuses, quoting why and the fix (ns.compile)."""
    f = _dict_mlp()
    x, w1, b1, w2 = _args()
    params = {"w1": w1, "b1": b1, "w2": w2}
    compiled = torch.compile(f, backend="eager")
    compiled(x, params)
    counts = _counted(compiled, x, params)
    assert counts == _counted(f, x, params) and sum(counts.values()) > 0, counts
    _assert_same(compiled(x, params), f(x, params), (x, w1, b1, w2))

    strict = torch.compile(_dict_mlp(), backend="eager", fullgraph=True)
    strict(x, params)
    with ns.CommMode(), pytest.raises(Exception, match="so that CommMode counts") as info:
        strict(x, params)
    assert "ns.compile(f, fullgraph=True)" in str(info.value)  # the fix


def test_fullgraph_names_why_a_call_cannot_be_traced(monkeypatch):
    _untraceable(monkeypatch)
    f = _dict_mlp()
    x, w1, b1, w2 = _args()
    compiled = torch.compile(lambda x, p: f(x, p).sum(), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="runs eagerly inside a compiled program") as info:
        compiled(x, {"w1": w1, "b1": b1, "w2": w2})
    assert "fullgraph=True" in str(info.value)  # the fix


def _multi_output(x, w):
    # explicit casts to varying (a view of w on a tracked call): traced like the implicit one
    h = x @ ns.pvary(w, "tp") + ns.pcast(w, "tp", to="varying").sum(0)
    a, b = h.split([4, 8], dim=-1)
    top = h.max(dim=-1)  # torch.return_types
    rows = h.unbind(0)
    return ns.psum(a.sum(-1) * b.mean(-1) + top.values + rows[0].sum() + top.indices, "tp")


@pytest.mark.parametrize("backend", ["eager", "aot_eager"])
def test_multi_output_ops_compile(backend):
    """split, unbind and max(dim): Dynamo refuses setattr on a multi-output op's tensors, so
    the compile path types a view of each (CompiledVmaMode._run); explicit casts to varying."""
    mesh = ns.make_mesh((2,), ("tp",), simulated=True)
    f = ns.spmd_map(_multi_output, mesh=mesh, in_specs=(P("tp"), P()), out_specs=P())
    g = torch.Generator().manual_seed(1)
    x = torch.randn(4, 5, generator=g, dtype=torch.float64)
    w = torch.randn(5, 12, generator=g, dtype=torch.float64, requires_grad=True)
    counter = CompileCounterWithBackend(backend)
    _assert_same(torch.compile(f, backend=counter, fullgraph=True)(x, w), f(x, w), (w,))
    assert counter.frame_count == 1


def _checkpointed(x, w1, w2):
    def block(x):
        return ns.psum(torch.tanh(x @ w1) @ w2, "tp")

    return torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).pow(2).mean(-1)


def test_a_checkpoint_inside_a_compiled_call_is_refused_with_fullgraph_and_breaks_without():
    """Dynamo traces a checkpointed body into a subgraph where the values' types are lost (on a
    real mesh: no gradient psum of an implicit pvary). fullgraph=True: our error, with the fix;
    without: Dynamo breaks the graph there, and values and gradients are the eager call's."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    specs = (P("dp"), P(None, "tp"), P("tp"))
    f = ns.spmd_map(_checkpointed, mesh=mesh, in_specs=specs, out_specs=P("dp"))
    x, w1, b1, w2 = _args()
    with pytest.raises(Exception) as info:
        torch.compile(f, backend="eager", fullgraph=True)(x, w1, w2)
    cause = str(info.value.__cause__)  # Dynamo's "Observed exception" quotes ours
    assert "SpmdError" in cause and "higher-order op's subgraph" in cause and "Fix: " in cause
    torch._dynamo.reset()
    _assert_same(torch.compile(f, backend="aot_eager")(x, w1, w2), f(x, w1, w2), (w1, w2))


def _inner_grad(x, w):
    return torch.func.grad(lambda w: ns.psum((x @ w).pow(2).sum(), "dp"))(w)


def test_a_collective_under_torch_func_grad_inside_a_compiled_call_is_refused_clearly():
    """The compiled simulated collectives have no rule at a grad level inside the instances:
    fullgraph=True raises our error, with the fix; without, the call runs eagerly, where
    torch.func transforms inside work, with the eager values."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(_inner_grad, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x, w = _args()[:2]
    with pytest.raises(Exception) as info:
        torch.compile(f, backend="eager", fullgraph=True)(x, w)
    cause = str(info.value.__cause__)
    assert "SpmdError" in cause and "torch.func.grad" in cause and "Fix: " in cause
    torch._dynamo.reset()
    got = torch.compile(f, backend="aot_eager")(x, w)
    assert torch.allclose(got, f(x, w), rtol=1e-12, atol=1e-12)


def test_eager_calls_of_other_mapped_functions_do_not_recompile_a_compiled_call():
    """The compiled call's trace reads no memo shared with other calls: eager calls of another
    mapped function with new shapes (which add to the memo of what fitted) recompile nothing.
    A shared memo read while tracing once recompiled it on each such call."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(
        lambda x: ns.psum(x.sin().sum(0), "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P()
    )
    g = ns.spmd_map(lambda x: x * 2, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    counter = CompileCounterWithBackend("eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    x = torch.randn(4, 3, dtype=torch.float64)
    for n in (6, 8, 10):
        assert torch.allclose(compiled(x), f(x))
        g(torch.ones(n, 5))
    assert counter.frame_count == 1


def _guards(f, *args) -> set[tuple[str, str]]:
    """(source, kind) of every guard Dynamo installs for a compiled call of ``f``."""
    found: set[tuple[str, str]] = set()

    def record(entries):
        found.update((e.name, e.guard_type) for e in entries)
        return [True] * len(entries)

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True, options={"guard_filter_fn": record})(*args)
    return found


def test_a_compiled_call_guards_neither_each_spec_nor_the_rule_table():
    """Guards run on every compiled call: the in_specs tree (a group of guards per parameter)
    and the block-rule table (one per rule) are read eagerly at trace time, so a model's guards
    on specs grow with its distinct specs, not with its parameters."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def loss(x, p):
        return ns.psum(sum((x @ w).tanh().sum() for w in p.values()), "dp")

    def spec_guards(n: int) -> set[tuple[str, str]]:
        p = {f"w{i}": torch.randn(3, 3, dtype=torch.float64) for i in range(n)}
        specs = (P("dp"), dict.fromkeys(p, P()))
        f = ns.spmd_map(loss, mesh=mesh, in_specs=specs, out_specs=P())
        guards = _guards(f, torch.randn(4, 3, dtype=torch.float64), p)
        assert not [g for g in guards if "in_specs" in g[0] or "RULES" in g[0]]
        return {g for g in guards if "_in_spec_table" in g[0]}

    few = spec_guards(2)
    assert few and spec_guards(5) == few


def _attention(q, kv, mask):
    k, v = kv.chunk(2, dim=-1)
    a = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    b = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
    return ns.psum((a * b).sum(), ("dp", "tp"))


def test_attention_in_a_compiled_call_is_batched_over_the_instances():
    """``scaled_dot_product_attention`` on CPU picks a flash kernel that has no vmap batching
    rule in torch 2.13 (vmap would run it once per instance); a compiled simulated call runs
    its math decomposition instead, which batches: no flash kernel in the compiled graph, and
    the values and gradients of the eager call (its causal attention one flash call for all)."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    specs = (P("dp", "tp"), P("dp", "tp"), P())
    f = ns.spmd_map(_attention, mesh=mesh, in_specs=specs, out_specs=P())
    g = torch.Generator().manual_seed(2)
    q = torch.randn(4, 4, 5, 3, generator=g, dtype=torch.float64, requires_grad=True)
    kv = torch.randn(4, 4, 5, 6, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.randn(5, 5, generator=g, dtype=torch.float64)
    ops: list[str] = []

    def record(gm, example_inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm)

    backend = torch._dynamo.backends.common.aot_autograd(fw_compiler=record, bw_compiler=record)
    torch._dynamo.reset()
    _assert_same(
        torch.compile(f, backend=backend, fullgraph=True)(q, kv, mask), f(q, kv, mask), (q, kv)
    )
    assert ops and not [op for op in ops if "flash" in op]


def _many_mapped(n: int):
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    return [
        ns.spmd_map(lambda x, i=i: ns.psum(x * i, "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P())
        for i in range(n)
    ]


# Dynamo's recompile limit (8 frames per code object) lowered to 2: three mapped functions then
# show what nine would with the default, each compile costing seconds.
_LOW_RECOMPILE_LIMIT = torch._dynamo.config.patch(recompile_limit=2)


@_LOW_RECOMPILE_LIMIT
def test_ns_compile_gives_each_mapped_function_a_cache_of_its_own():
    """``ns.compile(spmd_map(...))`` compiles the mapped function's own ``__call__``: more of
    them than the recompile limit compile, one frame each, with fullgraph and the eager
    values."""
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("eager")
    x = torch.randn(4, 3, dtype=torch.float64)
    for f in _many_mapped(3):
        assert torch.allclose(ns.compile(f, backend=counter, fullgraph=True)(x), f(x))
    assert counter.frame_count == 3


@_LOW_RECOMPILE_LIMIT
def test_torch_compile_of_callable_objects_shares_one_cache():
    """Why ``ns.compile`` exists for mapped functions (torch 2.13): ``torch.compile`` of a
    callable object runs it through one wrapper function of torch's, whose cache all such
    objects share, so the one past the recompile limit fails under fullgraph."""
    torch._dynamo.reset()
    x = torch.randn(4, 3, dtype=torch.float64)
    mapped = _many_mapped(3)
    for f in mapped[:2]:
        torch.compile(f, backend="eager", fullgraph=True)(x)
    with pytest.raises(torch._dynamo.exc.FailOnRecompileLimitHit):
        torch.compile(mapped[2], backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()


def test_ns_compile_turns_inductors_all_reduce_bucketing_on_unless_told_otherwise():
    """The options ``ns.compile`` hands ``torch.compile``: bucketing with Inductor (its default
    backend) after the pass that makes the gradients' waits adjacent, the user's own Inductor
    options kept and winning, nothing added for other backends or with a ``mode`` (torch
    refuses a mode and options together). The effect on a real mesh (fewer all-reduces, the
    same values) is checked by tests/test_compile.py."""
    from named_spmd._compile import sink_output_waits_pass
    from named_spmd._compile import with_bucketed_all_reduces as options_of

    sink = sink_output_waits_pass()
    on = {"bucket_all_reduces_fx": "all", "post_grad_custom_pre_pass": sink}
    assert options_of({}) == {"options": on}
    mine = {"backend": "inductor", "fullgraph": True, "options": {"trace.enabled": 1}}
    assert options_of(mine) == {**mine, "options": {"trace.enabled": 1, **on}}
    for kept in (
        {"options": {"bucket_all_reduces_fx": "none"}},
        {"options": {"bucket_all_reduces_fx": "all", "post_grad_custom_pre_pass": None}},
        {"backend": "aot_eager"},
        {"mode": "max-autotune"},
    ):
        assert options_of(kept) == kept
    assert sink.uuid()  # Inductor caches graphs compiled with it


def test_the_gradient_waits_pass_moves_only_waits_whose_results_are_only_outputs():
    """``_sink_output_waits`` on a backward-like graph: the waits of the dp all-reduces that
    are gradient outputs move after the last dp wait, past the tp all-reduce's wait between
    them, so that the dp waits follow each other (what Inductor's bucketing needs). Waits that
    an op reads stay, and so does every all-reduce (the issue order)."""
    from named_spmd._compile import _sink_output_waits

    f = torch.ops._c10d_functional

    def backward(g1, x, g2, y):
        wait, all_reduce = f.wait_tensor.default, f.all_reduce.default  # as Inductor's graphs
        a = wait(all_reduce(g1, "sum", "dp"))  # a gradient: read by the output only
        b = wait(all_reduce(x, "sum", "tp"))
        c = wait(all_reduce(g2 * b, "sum", "dp"))  # a gradient
        d = wait(all_reduce(y * b, "sum", "dp"))  # read by an op
        return a, b * 2, c, d * 3

    graph = torch.fx.symbolic_trace(backward).graph
    before = [n.name for n in graph.nodes]
    _sink_output_waits(graph)
    after = [n.name for n in graph.nodes]
    assert sorted(after) == sorted(before)
    assert [n for n in after if n.startswith("all_reduce")] == [
        n for n in before if n.startswith("all_reduce")
    ]
    groups = [n.args[0].args[2] for n in graph.nodes if n.name.startswith("wait_tensor")]
    assert groups == ["tp", "dp", "dp", "dp"]  # before: dp, tp, dp, dp (two dp runs)
    graph.lint()  # every node still after what it reads


def test_ns_compile_with_inductor_on_the_simulated_mesh_equals_the_eager_call():
    """``ns.compile`` of a mapped function with Inductor (its default backend, so with the
    all-reduce bucketing options and the waits pass, which find no collective in a simulated
    graph): values and gradients of the eager call (float64), on two calls. The
    real mesh's counterpart is tests/test_compile.py's inductor launch."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def loss(x, w):
        return ns.pmean(ns.psum(torch.tanh(x @ w).sum(), "tp").reshape(1), "dp")

    f = ns.spmd_map(loss, mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P())
    g = torch.Generator().manual_seed(5)
    x = torch.randn(4, 4, generator=g, dtype=torch.float64)
    w = torch.randn(4, 6, generator=g, dtype=torch.float64, requires_grad=True)
    want = f(x, w)
    (want_grad,) = torch.autograd.grad(want.sum(), w)
    torch._dynamo.reset()
    compiled = ns.compile(f, fullgraph=True)
    for _ in range(2):
        got = compiled(x, w)
        (grad,) = torch.autograd.grad(got.sum(), w)
        assert torch.allclose(got, want, rtol=1e-10, atol=1e-10)
        assert torch.allclose(grad, want_grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", list(compile_worker.CASES))
def test_user_code_compiles_in_the_expected_graphs(name):
    """ns.random draws seeded by a step counter and by constants, the settings in a dict
    holding no tensor, an int argument (both ``fullgraph=True``: two graphs over the steps,
    the step traced as a constant and then as a symbolic int), and a graph break in a function
    taking a dict (the call runs eagerly: no graph), an invariant operand beside a reduced one
    (its implicit cast to reduced), inputs whose shapes change every step (one graph per
    shape; DTensors on the real mesh), each equal to the eager call, gradients included
    (compile_worker.check_case; the real mesh's in the aot_eager launch of
    tests/test_compile.py)."""
    _passes(compile_worker.check_case, name, "aot_eager")


def test_a_training_step_compiles_in_the_graphs_of_the_dense_step():
    """loss, backward, opt.step and zero_grad in one compiled function, its step counter
    symbolic from the first call: the graphs torch makes of the dense step, none more, and the
    eager step's losses and parameters (compile_worker.check_training_step)."""
    _passes(compile_worker.check_training_step, "training_step", "aot_eager")


# Dynamo itself reads `.grad` of the non-leaf tensor it hands across the graph break (as in
# test_a_backend_dynamo_cannot_trace_runs_its_calls_eagerly)
@pytest.mark.filterwarnings("ignore:The .grad attribute of a Tensor that is not a leaf")
def test_a_graph_break_inside_a_call_in_a_compiled_step_runs_the_call_eagerly():
    """A step around a mapped call whose function breaks the graph: the ops before and after
    the call compiled (two graphs, none more on later steps), the call itself eagerly, with the
    eager step's values and gradients. Dynamo once resumed the library's frames one by one
    inside the call and failed on the dict argument ("unhashable type: 'list'")."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)

    def f(x, p):
        torch._dynamo.graph_break()
        return ns.psum(_raw(x @ p["w1"] + p["b1"]) @ p["w2"], "tp")

    specs = (P("dp", None), {"w1": P(None, "tp"), "b1": P("tp"), "w2": P("tp", None)})
    step = _step(ns.spmd_map(f, mesh=mesh, in_specs=specs, out_specs=P("dp", None)))
    x, w1, b1, w2 = _args()
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    _equal_steps(torch.compile(step, backend=counter), step, x, {"w1": w1, "b1": b1, "w2": w2})
    assert counter.frame_count == 2


_UNFLATTEN = {
    "Tensor.unflatten": lambda x: x.unflatten(-1, (2, 4)),
    "torch.unflatten": lambda x: torch.unflatten(x, -1, (2, 4)),
    "view": lambda x: x.view(*x.shape[:-1], 2, 4),
    "reshape": lambda x: x.reshape(*x.shape[:-1], 2, 4),
}


def _unflattened(spelling: str):
    split = _UNFLATTEN[spelling]
    return ns.spmd_map(
        lambda x: split(x).sum(-1) * 2,
        mesh=ns.make_mesh((2,), ("i",), simulated=True),
        in_specs=P("i"),
        out_specs=P("i"),
    )


@pytest.mark.parametrize("spelling", ["torch.unflatten", "view", "reshape"])
def test_the_unflatten_workarounds_compile_whole(spelling):
    """The README's (and docs/design.md section 11's) workaround for ``Tensor.unflatten``: these
    spellings compile into one graph with ``fullgraph=True``, with the dense values."""
    x = torch.randn(4, 8, dtype=torch.float64)
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    out = ns.compile(_unflattened(spelling), backend=counter, fullgraph=True)(x)
    torch.testing.assert_close(out, x.unflatten(-1, (2, 4)).sum(-1) * 2)
    assert counter.frame_count == 1


def test_tensor_unflatten_does_not_compile_under_a_torch_function_mode():
    """A torch 2.13 limit, not the library's: under any torch function mode Dynamo cannot trace
    the ``super().unflatten`` of torch's Python method; a compiled mapped call (typed by a mode)
    raises with ``fullgraph=True`` and, without it, runs eagerly with the right values."""
    x = torch.randn(4, 8, dtype=torch.float64)
    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"super\(\) attribute"):
        ns.compile(_unflattened("Tensor.unflatten"), backend="eager", fullgraph=True)(x)
    torch._dynamo.reset()
    out = ns.compile(_unflattened("Tensor.unflatten"), backend="eager")(x)
    torch.testing.assert_close(out, x.unflatten(-1, (2, 4)).sum(-1) * 2)

    class Passthrough(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def plain(t):
        with Passthrough():
            return t.unflatten(-1, (2, 4))

    torch._dynamo.reset()
    with pytest.raises(torch._dynamo.exc.Unsupported, match=r"super\(\) attribute"):
        torch.compile(plain, backend="eager", fullgraph=True)(x)


def test_a_step_counter_named_in_dynamic_sources_is_traced_once():
    """The README's way to trace an int argument once: named in torch's ``dynamic_sources``
    (``ns.compile(mapped)`` compiles ``__call__(self, *args)``: the second argument is
    ``L['args'][1]``), it is symbolic from the first call: one graph over the steps, ``fullgraph``,
    the eager values; unnamed, the int_argument case of compile_worker.CASES traces twice."""
    mesh = ns.make_mesh((4,), ("dp",), simulated=True)
    f = ns.spmd_map(compile_worker._scaled, mesh=mesh, in_specs=(P("dp"), None), out_specs=P())
    x = torch.randn(8, 3, dtype=torch.float64)
    counter = CompileCounterWithBackend("eager")
    torch._dynamo.reset()
    compiled = ns.compile(f, backend=counter, fullgraph=True)
    with torch.compiler.config.patch(dynamic_sources="L['args'][1]"):
        for step in range(3):
            torch.testing.assert_close(compiled(x, step), f(x, step), rtol=0, atol=1e-12)
    assert counter.frame_count == 1


def _scaled_module(mesh):
    """A module class of its own (its mapped method never used before the test's trace)."""

    class Scaled(torch.nn.Module):
        def __init__(self, w: torch.Tensor) -> None:
            super().__init__()
            self.w = torch.nn.Parameter(w)

        @ns.spmd_map(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def step(self, x):
            return x * self.w

        def forward(self, x):
            return self.step(x)

    return Scaled


def test_a_module_whose_mapped_method_is_first_used_in_the_trace_compiles_whole():
    """``torch.compile(module, fullgraph=True)`` where the trace makes the first use of a
    mapped method: one graph with the eager values and gradients."""
    mesh = ns.make_mesh((4,), ("dp",), simulated=True)
    x, w = torch.randn(8, 3), torch.randn(3)
    m = _scaled_module(mesh)(w.clone())
    torch._dynamo.reset()
    y = torch.compile(m, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(y, x * w)
    (grad,) = torch.autograd.grad(y.sum(), [m.w])
    torch.testing.assert_close(grad, x.sum(0))


def test_a_bound_mapped_method_compiles_as_its_mapped_function():
    """``ns.compile(m.step)`` and ``torch.compile(m.step)`` (``fullgraph=True``), and
    ``ns.compile(m.step.local)``: the eager values and gradients, one compiled frame; a call of
    unequal blocks runs eagerly, as a mapped function's does."""
    mesh = ns.make_mesh((4,), ("dp",), simulated=True)
    x, w = torch.randn(8, 3), torch.randn(3)
    m = _scaled_module(mesh)(w.clone())
    torch._dynamo.reset()
    for compile in (ns.compile, torch.compile):
        counter = CompileCounterWithBackend("eager")
        step = compile(m.step, backend=counter, fullgraph=True)
        for _ in range(2):
            y = step(x)
            torch.testing.assert_close(y, x * w)
            (grad,) = torch.autograd.grad(y.sum(), [m.w])
            torch.testing.assert_close(grad, x.sum(0))
        assert counter.frame_count == 1, compile
    uneven = torch.randn(7, 3)
    torch.testing.assert_close(ns.compile(m.step, fullgraph=True)(uneven), uneven * w)
    local = ns.compile(m.step.local, backend="eager", fullgraph=True)
    torch.testing.assert_close(local(x), m.step.local(x))


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_a_compiled_output_of_a_data_dependent_size_names_no_made_up_shape():
    """An output too small for its out_spec: the eager message names its shape, the compiled
    one (whose size Dynamo knows only when the program runs) ``?``, never a stand-in shape."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(lambda x: x[x > 0], mesh=mesh, in_specs=P(), out_specs=P("dp", None))
    x = torch.arange(8.0) - 2.5  # five positive
    with pytest.raises(ns.SpecError, match=r"has rank 1 \(shape \[5\]\)\. Fix"):
        f(x)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(f, backend="eager", fullgraph=True)(x)
    assert "SpecError" in str(info.value.__cause__)
    assert "has rank 1 (shape [?]). Fix" in str(info.value.__cause__)


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_a_compiled_invariant_output_of_a_data_dependent_size_is_assembled():
    """An output sized by its values but invariant over the mesh (one size on every instance)
    under a split out_spec: compiled with fullgraph, equal to the eager call (a varying one is
    refused while tracing: compile_worker's ``data_dependent_output`` on a real mesh; on this
    one vmap refuses the op first)."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def positives(x):
        return x[x > 0]

    f = ns.spmd_map(positives, mesh=mesh, in_specs=P(), out_specs=P("dp"))
    x = torch.arange(8.0) - 2.5  # five positive, one block per instance: two concatenated
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, x[x > 0].repeat(2))
    torch.testing.assert_close(got, f(x))


def _data_dependent_error(g, x) -> str:
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(g, backend="eager", fullgraph=True)(x)
    return str(info.value.__cause__)


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_a_compiled_input_of_a_data_dependent_size_takes_p_and_refuses_a_split():
    """An input sized by its data (``x[x > 0]``) inside a compiled program: with P() the call
    equals the eager one; a split (whose blocks cannot be laid out while compiling) raises a
    SpecError naming the function and the fix, never torch's data-dependent guard error."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    x = torch.arange(8.0) - 2.5  # five positive

    def doubled(v):
        return v * 2

    def outer(spec):
        f = ns.spmd_map(doubled, mesh=mesh, in_specs=spec, out_specs=P())
        return lambda x: f(x[x > 0])

    torch._dynamo.reset()
    got = torch.compile(outer(P()), backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, x[x > 0] * 2)
    message = _data_dependent_error(outer(P("dp")), x)
    assert 'SpecError("spmd_map of `' in message  # (Dynamo's cause names our error)
    assert "doubled` (test_compile_simulated.py:" in message
    assert "argument [0] has a data-dependent size" in message and "Fix: " in message
    message = _data_dependent_error(outer(P("dp", None)), x)
    assert "has rank 1 (shape [?]). Fix" in message


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_a_data_dependent_input_leaves_another_inputs_uneven_split_to_the_eager_call():
    """Beside an input of a data-dependent size (under P()), another input split unevenly still
    makes the call run on blocks of their own sizes (eagerly): the compiled program equals the
    dense computation."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(
        lambda a, b: (a * 2, b + 1),
        mesh=mesh,
        in_specs=(P(), P("dp")),
        out_specs=(P(), P("dp")),
    )
    x = torch.arange(8.0) - 2.5
    torch._dynamo.reset()
    compiled = torch.compile(lambda x, y: f(x[x > 0], y), backend="eager")
    for n in (8, 7):  # 7 rows over 2 instances: blocks of 4 and 3
        y = torch.arange(float(n))
        a, b = compiled(x, y)
        torch.testing.assert_close(a, x[x > 0] * 2)
        torch.testing.assert_close(b, y + 1)


@pytest.mark.parametrize("tiled", [True, False])
@torch._dynamo.config.patch(capture_scalar_outputs=True)
def test_a_compiled_collective_of_a_data_dependent_size_raises_a_collective_error(tiled):
    """psum_scatter of an operand sized by ``.item()``: whether the group divides it cannot be
    checked while compiling; a CollectiveError names the function and the fix."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def scattered(x):
        n = int(ns.psum((x > 0).sum(), "dp").item())
        return ns.psum_scatter(ns.pvary(torch.ones(n), "dp"), "dp", tiled=tiled)

    f = ns.spmd_map(scattered, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    message = _data_dependent_error(f, torch.arange(8.0) - 2.5)
    assert 'CollectiveError("psum_scatter in `' in message
    assert "scattered` (test_compile_simulated.py:" in message
    assert "scatter_dimension=0 has a data-dependent size" in message and "Fix: " in message


@pytest.mark.parametrize(
    "op",
    [
        lambda x: torch.nonzero(x).float(),
        lambda x: x.nonzero().float(),
        lambda x: torch.masked_select(x, x > 0),
        lambda x: torch.unique(x),
        lambda x: torch.unique_consecutive(x),
        lambda x: torch.where(x > 0)[0].float(),
        lambda x: torch.nn.functional.one_hot((x > 0).long()).float(),
        lambda x: x[x > 0],
        lambda x: x.index_put((x > 0,), torch.tensor(1.0), accumulate=True),
        lambda x: torch.ops.aten.nonzero(x).float(),
        lambda x: torch.ops.aten.nonzero.default(x).float(),
        lambda x: torch.ops.aten.masked_select(x, x > 0),
        lambda x: torch.ops.aten.index(x, [x > 0]),
        lambda x: torch.ops.aten._unique2(x)[0],
        lambda x: torch.ops.aten.where(x > 0)[0].float(),
        lambda x: torch.ops.aten.where.default(x > 0)[0].float(),
        lambda x: (x * 2).data,
    ],
    ids=[
        "nonzero",
        "Tensor.nonzero",
        "masked_select",
        "unique",
        "unique_consecutive",
        "where",
        "one_hot",
        "boolean mask",
        "Tensor.index_put",
        "aten.nonzero",
        "aten.nonzero.default",
        "aten.masked_select",
        "aten.index",
        "aten._unique2",
        "aten.where",
        "aten.where.default",
        "Tensor.data",
    ],
)
def test_a_compiled_op_sized_by_a_varying_operands_values_raises_the_eager_calls_error(op):
    """An op whose result's size, or the selection it writes through, depends on a varying
    operand's values (vmap cannot batch it): the compiled call raises the eager call's SpmdError
    (fullgraph: Dynamo's cause), never Dynamo's TorchRuntimeError."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def sized_by_values(x):
        return op(x)

    f = ns.spmd_map(sized_by_values, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.arange(8.0) - 2.5
    with pytest.raises(ns.SpmdError) as eager:
        f(x)
    assert "sized_by_values` (test_compile_simulated.py:" in str(eager.value)
    message = _data_dependent_error(f, x)
    assert "SpmdError('spmd_map of `" in message  # (Dynamo's cause names our error)
    assert str(eager.value).replace("\n", "\\n") in compile_worker._unquoted(message)
    torch._dynamo.reset()
    with pytest.raises(ns.SpmdError) as compiled:
        torch.compile(f, backend="eager")(x)
    assert str(compiled.value) == str(eager.value)


@pytest.mark.parametrize(
    "op",
    [
        lambda x: x.repeat_interleave(2),
        lambda x: torch.repeat_interleave(x, 2),
        lambda x: torch.repeat_interleave(x, torch.tensor([1, 2, 0, 1]), output_size=4),
        lambda x: torch.nn.functional.one_hot((x > 0).long(), 3).float(),
        lambda x: torch.where(x > 0, x, -x),
        lambda x: torch.ops.aten.index(x, [torch.tensor([0, 2])]),
        lambda x: torch.ops.aten.one_hot((x > 0).long(), 3).float(),
        lambda x: torch.ops.aten.where(x > 0, x, -x),
    ],
    ids=[
        "Tensor.repeat_interleave",
        "repeat_interleave",
        "output_size",
        "one_hot",
        "where",
        "aten.index of positions",
        "aten.one_hot",
        "aten.where of three",
    ],
)
def test_a_compiled_op_of_a_static_size_on_a_varying_operand_compiles(op):
    """Forms of the ops above whose result's size is known when compiling (int repeats, an
    output_size, num_classes, the three-argument where): compiled with fullgraph, equal to the
    eager call."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(op, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.arange(8.0) - 2.5
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="eager", fullgraph=True)(x), f(x))


def test_a_compiled_data_of_an_invariant_value_compiles():
    """``w.data`` of a value invariant over the mesh (vmap does not batch it; of a varying one,
    the eager call's error: the test above) compiles with fullgraph, equal to the eager call,
    no gradient flowing through it."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def scaled(x, w):
        return x * w.data.sum() + w.data[0]

    f = ns.spmd_map(scaled, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    results = []
    torch._dynamo.reset()
    for run in (f, torch.compile(f, backend="aot_eager", fullgraph=True)):
        x, w = torch.arange(4.0, requires_grad=True), torch.tensor([2.0, 3.0], requires_grad=True)
        y = run(x, w)
        y.sum().backward()
        assert w.grad is None
        results.append((y.detach(), x.grad))
    torch.testing.assert_close(results[1], results[0])
    torch.testing.assert_close(results[0][0], torch.arange(4.0) * 5 + 2)


def test_a_compiled_op_sized_by_values_with_an_unbatched_mask_compiles_or_runs_uncompiled():
    """A mask invariant over the mesh: ``nonzero`` of it alone is traced (one size on every
    instance); selecting a varying operand with it (vmap batches the result) cannot be traced:
    with fullgraph a SpmdError names the function and the fix, without it the call runs
    uncompiled. Both equal the dense computation per block."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def counted(x, m):
        return x + torch.nonzero(m).float().sum()

    def selected(x, m):
        return x[m] * 2, torch.masked_select(x, m)

    x = torch.arange(8.0)
    m = torch.tensor([True, False, True, True])
    blocks = x.reshape(2, 4)
    f = ns.spmd_map(counted, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(x, m)
    torch.testing.assert_close(got, x + 5)  # the indices 0, 2, 3
    g = ns.spmd_map(selected, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    torch._dynamo.reset()
    a, b = torch.compile(g, backend="eager")(x, m)
    torch.testing.assert_close(a, blocks[:, m].flatten() * 2)
    torch.testing.assert_close(b, blocks[:, m].flatten())
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(g, backend="eager", fullgraph=True)(x, m)
    message = str(info.value.__cause__)
    assert "SpmdError('spmd_map of `" in message and "selected` (test_compile_simulated" in message
    assert "`x[mask]` of an operand that varies" in message
    assert "Fix: compile without fullgraph=True" in message


def _zeroed_by(x, m):
    y = x.clone()
    y[m] = 0
    return y


def test_a_compiled_write_through_an_unbatched_mask_compiles():
    """A mask invariant over the mesh: ``y[m] = 0`` and ``index_put`` (run as the ``where`` it
    equals, as a varying mask's) compile with fullgraph and equal the dense write."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def put(x, m):
        return torch.index_put(x, (m,), torch.tensor(0.0))

    x = torch.arange(8.0) + 1
    m = torch.tensor([True, False, True, True])
    dense = torch.where(m.repeat(2), 0.0, x)
    specs = {"mesh": mesh, "in_specs": (P("dp"), P()), "out_specs": P("dp")}
    for fn in (_zeroed_by, put):
        torch._dynamo.reset()
        got = torch.compile(ns.spmd_map(fn, **specs), backend="eager", fullgraph=True)(x, m)
        torch.testing.assert_close(got, dense)


def _set_in_place(x, m, v):
    y = x * 1
    y[m] = v
    return y


def _put_in_place(x, m, v):
    y = x * 1
    y.index_put_((m,), v)
    return y


def _torch_put_in_place(x, m, v):
    y = x * 1
    torch.index_put_(y, (m,), v)
    return y


def _put(x, m, v):
    return x.index_put((m,), v)


def _torch_put(x, m, v):
    return torch.index_put(x, (m,), v)


def _accumulated(x, m, v):
    return x.index_put((m,), v, accumulate=True)


@pytest.mark.parametrize(
    "fn",
    [_set_in_place, _put_in_place, _torch_put_in_place, _put, _torch_put],
    ids=lambda f: f.__name__,
)
def test_a_compiled_write_of_a_value_per_position_through_an_unbatched_mask_compiles(fn):
    """A mask invariant over the mesh and a value of one element per True position: every form
    of the write (``y[m] = v``, ``index_put(_)``, run as ``y[m] = v``) compiles with fullgraph,
    equal to the write per block, values and gradients (``v``'s summed over the blocks)."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    m = torch.tensor([True, False, True, True])
    x0, v0 = torch.arange(8.0) - 3, torch.tensor([10.0, 20.0, 30.0])
    cot = torch.linspace(-1.0, 1.0, 8)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P("dp"))
    torch._dynamo.reset()
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    results = []
    for run in (lambda x, m, v: torch.cat([fn(b, m, v) for b in x.chunk(2)]), compiled):
        x, v = x0.clone().requires_grad_(), v0.clone().requires_grad_()
        y = run(x, m, v)
        (y * cot).sum().backward()
        results.append((y.detach(), x.grad, v.grad))
    torch.testing.assert_close(results[1], results[0])


def test_a_compiled_index_put_that_accumulates_or_widens_keeps_a_clear_error():
    """Through a mask invariant over the mesh, ``index_put(..., accumulate=True)`` (each
    position adds its values) and an out-of-place ``index_put`` of a varying value into an
    invariant operand cannot be traced: with fullgraph a SpmdError names the function, the
    argument that varies (the operand; the value written into an invariant one) and the fix;
    without it the call runs uncompiled, equal to the write per block."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    m = torch.tensor([True, False, True, True])
    v = torch.tensor([10.0, 20.0, 30.0])
    x8, x4, both = torch.arange(8.0), torch.arange(4.0), torch.cat([v, -v])
    cases = [  # fn, in_specs, x, values, each block's x and values, the argument that varies
        (_accumulated, (P("dp"), P(), P()), x8, v, zip(x8.chunk(2), [v, v]), "an operand"),
        (_put, (P(), P(), P("dp")), x4, both, zip([x4, x4], both.chunk(2)), "a value"),
    ]
    for fn, specs, x, values, per_block, varying in cases:
        f = ns.spmd_map(fn, mesh=mesh, in_specs=specs, out_specs=P("dp"))
        torch._dynamo.reset()
        with pytest.raises(Exception) as info:
            torch.compile(f, backend="eager", fullgraph=True)(x, m, values)
        message = str(info.value.__cause__)
        assert f"{fn.__name__}` (test_compile_simulated.py:" in message
        assert f"`index_put` of {varying} that varies over the mesh" in message
        assert "Fix: compile without fullgraph=True" in message
        torch._dynamo.reset()
        got = torch.compile(f, backend="eager")(x, m, values)
        torch.testing.assert_close(got, torch.cat([fn(b, m, w) for b, w in per_block]))


def _first_and_third(x):
    return x[[True, False, True, False]]


def _first_and_third_summed(x):
    return x[[True, False, True, False]].sum(0, keepdim=True)


def _columns_zeroed(x):
    y = x.clone()
    y[:, [True, False, True]] = 0
    return y[:, None, [False, True, True]]


@pytest.mark.parametrize(
    "fn, shape, dense",
    [
        (_first_and_third, (8,), lambda b: b[:, [0, 2]]),
        (_first_and_third_summed, (8, 3), lambda b: b[:, [0, 2]].sum(1, keepdim=True)),
        (
            _columns_zeroed,
            (4, 3),
            lambda b: b.index_fill(2, torch.tensor([0, 2]), 0)[:, :, None, [1, 2]],
        ),
    ],
    ids=["select", "select then reduce", "write and select"],
)
def test_a_compiled_index_of_a_list_of_bools_compiles_with_static_sizes(fn, shape, dense):
    """``x[[True, False, True, False]]`` on a varying operand: the list is a mask of a size known
    while compiling, so the call compiles with fullgraph (never Dynamo's internal error or a
    data-dependent size), equal to the eager call and to the dense selection per block."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.arange(float(torch.Size(shape).numel())).reshape(shape) - 5
    blocks = x.reshape(2, shape[0] // 2, *shape[1:])
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(x)
    torch.testing.assert_close(got, dense(blocks).flatten(0, 1))
    torch.testing.assert_close(got, f(x))


def test_a_compiled_call_on_a_size_computed_from_a_marked_one_raises_a_spec_error():
    """A compiled step whose input is marked by ``mark_dynamic`` and that maps ``x + 1``: the
    call's input has a size computed from the marked one, which Dynamo refuses to see
    specialized: with fullgraph a SpecError names the function and the fix (never Dynamo's
    ConstraintViolationError); without, the call runs uncompiled, equal to the dense value."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def doubled(x):
        return x * 2

    f = ns.spmd_map(doubled, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.arange(24.0).reshape(4, 6)
    marked = x.clone()
    torch._dynamo.mark_dynamic(marked, 0)
    torch._dynamo.reset()
    with pytest.raises(Exception) as info:
        torch.compile(lambda x: f(x + 1), backend="eager", fullgraph=True)(marked)
    message = str(info.value.__cause__)
    assert 'SpecError("spmd_map of `' in message and "doubled` (test_compile_simulated" in message
    assert "input [0] (dim 0) has a size marked dynamic, or computed from one" in message
    assert "L['x'].size()[0]" in message and "Fix: do not mark" in message
    torch._dynamo.reset()
    got = torch.compile(lambda x: f(x + 1), backend="eager")(marked)
    torch.testing.assert_close(got, (x + 1) * 2)


def _marked(t: torch.Tensor, maybe: bool = False) -> torch.Tensor:
    """A copy of ``t`` with dim 0 marked dynamic (``maybe_mark_dynamic`` where ``maybe``)."""
    t = t.clone()
    mark = torch._dynamo.maybe_mark_dynamic if maybe else torch._dynamo.mark_dynamic
    mark(t, 0)
    return t


@pytest.mark.parametrize("fullgraph", [True, False])
@pytest.mark.parametrize(
    "case", ["shape change", "x + 1 after a shape change", "maybe_mark_dynamic"]
)
def test_a_compiled_call_beside_an_unrelated_marked_input_compiles(case, fullgraph):
    """A frame with a marked input the call does not read (``lengths``, summed first): the call's
    input sizes Dynamo made dynamic on its own (a shape change, ``maybe_mark_dynamic``) come
    from no marked size, so they are specialized and the step compiles (fullgraph), equal to
    the dense computation each call."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(lambda x: x * 2, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    plus = 1.0 if case.startswith("x + 1") else 0.0

    def step(x, lengths):
        s = lengths.sum()
        return f(x + plus) + s

    torch._dynamo.reset()
    compiled = torch.compile(step, backend="eager", fullgraph=fullgraph)
    rows = [4] if case == "maybe_mark_dynamic" else [4, 8, 6]
    for n in rows:
        x = torch.arange(n * 3.0).reshape(n, 3)
        lengths = _marked(torch.arange(1.0, 7.0))
        got = compiled(_marked(x, maybe=True) if case == "maybe_mark_dynamic" else x, lengths)
        torch.testing.assert_close(got, (x + plus) * 2 + lengths.sum())


@pytest.mark.parametrize("rows", [1, 0])
def test_a_compiled_calls_input_marked_dynamic_on_a_size_dynamo_keeps_static_compiles(rows):
    """``mark_dynamic`` on a dim of size 0 or 1, which Dynamo specializes without a symbol and
    without a constraint it refuses: the call compiles with fullgraph (no SpecError) and equals
    the dense computation."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(lambda x: x * 2, mesh=mesh, in_specs=P(None, "dp"), out_specs=P(None, "dp"))
    x = torch.arange(rows * 4.0).reshape(rows, 4)
    marked = x.clone()
    torch._dynamo.mark_dynamic(marked, 0)
    torch._dynamo.reset()
    got = torch.compile(f, backend="eager", fullgraph=True)(marked)
    torch.testing.assert_close(got, x * 2)


@pytest.mark.parametrize("size", [2, 1])
@pytest.mark.parametrize("spec, dim", [(P("dp"), 0), (P("dp"), 1), (P(), 0)])
def test_a_compiled_calls_input_marked_dynamic_raises_a_spec_error_or_runs_uncompiled(
    spec, dim, size
):
    """A size marked by ``torch._dynamo.mark_dynamic`` (split or not): a compiled call is traced
    for static shapes, so with fullgraph a SpecError names the function, the input, the dim and
    the fix (never Dynamo's ConstraintViolationError); without it the call runs uncompiled, and
    ``maybe_mark_dynamic`` (the fix) compiles. Both equal the dense computation."""
    mesh = ns.make_mesh((size,), ("dp",), simulated=True)

    def doubled(x):
        return x * 2

    f = ns.spmd_map(doubled, mesh=mesh, in_specs=spec, out_specs=spec)
    x = torch.arange(24.0).reshape(4, 6)
    torch._dynamo.reset()
    marked = x.clone()
    torch._dynamo.mark_dynamic(marked, dim)
    with pytest.raises(Exception) as info:
        torch.compile(f, backend="eager", fullgraph=True)(marked)
    message = str(info.value.__cause__)
    assert 'SpecError("spmd_map of `' in message and "doubled` (test_compile_simulated" in message
    assert f"input [0] (dim {dim}) has a size marked dynamic" in message
    assert f"L['args'][0].size()[{dim}]" in message and "Fix: do not mark" in message
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(f, backend="eager")(marked), x * 2)
    torch._dynamo.reset()
    maybe = x.clone()
    torch._dynamo.maybe_mark_dynamic(maybe, dim)
    got = torch.compile(f, backend="eager", fullgraph=True)(maybe)
    torch.testing.assert_close(got, x * 2)


def test_ragged_all_to_all_compiles_whole_and_equals_the_per_instance_loop():
    """fullgraph=True (a compiled call reads no transform levels), two routings in one frame:
    values and gradients of the operand and the output buffer as the per-instance loop's."""
    from _ragged import reference, routing

    routes = [routing(2, 2, seed=s) for s in (3, 5)]
    rows, m = max(r.rows for r in routes), max(r.m for r in routes)
    mesh = ns.make_mesh((2,), ("dp",))
    f = ns.spmd_map(compile_worker._ragged, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    gen = torch.Generator().manual_seed(2)
    for r in routes:
        x, out, cot = (
            torch.randn(2 * k, 3, generator=gen, dtype=torch.float64) for k in (rows, m, m)
        )
        xs, outs = x.clone().requires_grad_(), out.clone().requires_grad_()
        got = compiled(xs, outs, *r.metadata())
        (got * cot).sum().backward()
        xr, outr = ([t.clone().requires_grad_() for t in v.chunk(2)] for v in (x, out))
        want = reference(r, xr, outr)
        sum((w * c).sum() for w, c in zip(want, cot.chunk(2))).backward()
        torch.testing.assert_close(got.detach(), torch.cat(want).detach())
        torch.testing.assert_close(xs.grad, torch.cat([t.grad for t in xr]))
        torch.testing.assert_close(outs.grad, torch.cat([t.grad for t in outr]))
    assert counter.frame_count == 1
