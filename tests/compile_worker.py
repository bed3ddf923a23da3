"""torch.compile of whole mapped calls on a real mesh (one process per instance; launched by
tests/test_compile.py).

For each program of the catalogue named on the command line and each compile backend
(``eager``, ``aot_eager``, ``inductor``), every rank checks, against the eager call in the same
process: outputs and gradients of the global inputs (float64: 1e-10), two steps with different
values and no recompilation, ``fullgraph=True``; and, with an aot_autograd backend that inspects
the forward and backward FX graphs, that the graphs hold one ``_c10d_functional`` collective per
collective ``ns.CommMode`` counts in the eager call (backward: the implicit pvarys' psums and the
gradient all_gathers of plain-tensor inputs too). Errors: the compiled call raises the eager
call's error class and message. With aot_eager also user code (``CASES``: ``ns.random`` draws, int
and dict arguments, a graph break inside the call) and a whole training step, each with the
number of graphs it compiles into. Prints ``COMPILE {json}`` per (program, backend) on rank 0.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time
import traceback
from collections.abc import Callable

import optree
import torch
import torch.distributed as dist
from _faults_dtypes import DTYPE_CASES, DTYPES, case_input, described, dtype_call, program
from _programs import (
    BLOCK_SPECS,
    BY_NAME,
    Program,
    _seeded,
    block_shapes,
    torch_ops,
    tp_sp_block,
)
from torch._dynamo.backends.common import aot_autograd
from torch._dynamo.testing import CompileCounterWithBackend
from torch._functorch.aot_autograd import make_boxed_func
from torch._functorch.partitioners import min_cut_rematerialization_partition
from torch.distributed.tensor import DTensor

import named_spmd as ns
from named_spmd import P
from named_spmd._compile import BUCKET_OPTION, PRE_PASS_OPTION

OPS = torch_ops(ns)  # no taps: ns.typeof is checked by the eager tests
FUNCOL = torch.ops._c10d_functional
COLLECTIVE_OPS = {
    FUNCOL.all_reduce.default: "all_reduce",
    FUNCOL.all_gather_into_tensor.default: "all_gather",
    FUNCOL.reduce_scatter_tensor.default: "reduce_scatter",
    FUNCOL.all_to_all_single.default: "all_to_all",
    FUNCOL.broadcast.default: "broadcast",
}


def graph_collectives(gm) -> int:
    return sum(1 for n in gm.graph.nodes if n.op == "call_function" and n.target in COLLECTIVE_OPS)


def counting_backend():
    """An aot_autograd backend recording the collectives of each forward and backward graph,
    partitioned as Inductor partitions (min-cut: a collective is never recomputed in backward;
    aot_autograd's default partition re-runs a forward collective in the backward graph when
    its inputs are saved anyway, docs/design.md section 11)."""
    seen: dict[str, list[int]] = {"forward": [], "backward": []}

    def compiler(direction):
        def compile_graph(gm, example_inputs):
            seen[direction].append(graph_collectives(gm))
            return make_boxed_func(gm.forward)

        return compile_graph

    backend = aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        partition_fn=min_cut_rematerialization_partition,
    )
    return backend, seen


def _float(x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point()


def evaluate(fn, args, scale: float):
    """Outputs (global values) and gradients of a weighted sum of them w.r.t. the float inputs."""
    leaves, tree = optree.tree_flatten(args, none_is_leaf=True)
    leaves = [x.detach().mul(scale).requires_grad_() if _float(x) else x for x in leaves]
    out = fn(*optree.tree_unflatten(tree, leaves))
    outs = [
        o.full_tensor() if isinstance(o, DTensor) else o
        for o in optree.tree_leaves(out, none_is_leaf=True)
    ]
    gen = torch.Generator().manual_seed(7)
    loss = sum(
        (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() for o in outs if _float(o)
    )
    wrt = [x for x in leaves if _float(x)]
    grads = torch.autograd.grad(loss, wrt, allow_unused=True)
    return [o.detach() for o in outs], [g for g in grads]


def close(a, b, rtol, atol) -> bool:
    if a is None or b is None:
        return (a is None or not a.any()) and (b is None or not b.any())
    return a.shape == b.shape and a.dtype == b.dtype and torch.allclose(a, b, rtol=rtol, atol=atol)


def differences(got, want) -> list[str]:
    """The outputs and gradients of ``evaluate`` that differ from ``want``'s (float64: 1e-10;
    a DTensor gradient compared as its global value)."""
    return [
        f"{what} {k} differs"
        for what, pairs in (("output", zip(got[0], want[0])), ("gradient", zip(got[1], want[1])))
        for k, (a, b) in enumerate(pairs)
        if not close(_whole(a), _whole(b), rtol=1e-10, atol=1e-10)
    ]


def _whole(x):
    return x.full_tensor() if isinstance(x, DTensor) else x


def eager_counts(f, args) -> tuple[int, int]:
    """The eager call's collectives (forward, backward), boundary ones included but for the
    start-of-call check, which a compiled call does not run."""
    with ns.CommMode() as comm:
        evaluate(f, args, 1.0)
    events = [
        e
        for e in comm.events
        if not (e.boundary and e.op == "pmax" and e.dtype == torch.int64 and e.shape == (2,))
    ]
    # the full_tensor() of the outputs runs outside the call: not an event of named_spmd
    return (
        sum(1 for e in events if e.direction == "forward"),
        sum(1 for e in events if e.direction == "backward"),
    )


# Collectives of the eager backward that the min-cut partition computes in the forward graph,
# because their inputs are forward values: pmax's transpose counts the ties of its operand with
# the maximum (a psum of the tie mask) before any gradient exists.
MOVED_TO_FORWARD = {"vocab_parallel_ce": 1}

# A non-mesh-order tuple entry in out_specs: the boundary relayout is a ppermute.
RELAYOUT = Program(
    "relayout_out_tpdp@4",
    (2, 2),
    ("dp", "tp"),
    P(("dp", "tp")),
    P(("tp", "dp")),
    lambda o, x: x * 2,
    lambda: (torch.arange(16, dtype=torch.float64).reshape(8, 2),),
)
# A transformer block (test_check.py's, on 4 instances): its packed qkv is split by chunk, a
# multi-output op, whose tensors Dynamo will not let us stamp with setattr (CompiledVmaMode._run).
BLOCK = Program(
    "block@4",
    (2, 2),
    ("dp", "tp"),
    BLOCK_SPECS,
    P("dp", "tp"),
    tp_sp_block,
    _seeded(*block_shapes(2, 8, 8, 16)),
)
PROGRAMS = {**BY_NAME, RELAYOUT.name: RELAYOUT, BLOCK.name: BLOCK}


def mapped(name: str):
    prog = PROGRAMS[name]
    mesh = ns.make_mesh(prog.sizes, prog.names)
    f = ns.spmd_map(
        functools.partial(prog.prog, OPS),
        mesh=mesh,
        in_specs=prog.in_specs,
        out_specs=prog.out_specs,
        check_vma=prog.check_vma,
    )
    return prog, f


def check_program(name: str, backend: str, compile: Callable = torch.compile) -> dict:
    """``compile(f)`` of the catalogue's program ``name`` against its eager call (values and
    gradients over three steps, one compiled frame; with backend "count", its collectives)."""
    prog, f = mapped(name)
    args = prog.args()
    problems = []
    tol = dict(rtol=1e-10, atol=1e-10)
    torch._dynamo.reset()
    counted, seen = counting_backend()
    compiler = CompileCounterWithBackend(counted if backend == "count" else backend)
    compiled = compile(f, backend=compiler, fullgraph=True)
    for step, scale in enumerate((1.0, 1.25, 0.5)):
        want_out, want_grads = evaluate(f, args, scale)
        got_out, got_grads = evaluate(compiled, args, scale)
        for k, (a, b) in enumerate(zip(got_out, want_out)):
            if not close(a, b, **tol):
                problems.append(f"step {step}: output {k} differs")
        for k, (a, b) in enumerate(zip(got_grads, want_grads)):
            if not close(a, b, **tol):
                problems.append(f"step {step}: gradient {k} differs")
    if compiler.frame_count != 1:
        problems.append(f"{compiler.frame_count} frames compiled for 3 steps (recompiled)")
    result = {"frames": compiler.frame_count}
    if backend == "count":
        fwd, bwd = eager_counts(f, args)
        moved = MOVED_TO_FORWARD.get(name, 0)
        fwd, bwd = fwd + moved, bwd - moved
        got = (sum(seen["forward"]), sum(seen["backward"]))
        result.update(eager=(fwd, bwd), graphs=got)
        if got != (fwd, bwd):
            problems.append(
                f"collectives in the graphs (fw, bw) {got} != eager CommMode {(fwd, bwd)}"
            )
    result["problems"] = problems
    return result


def check_compiled_first(name: str, backend: str) -> dict:
    """A compiled call made before any eager call on its mesh, then the eager call, then the
    compiled call again: the same values and gradients (the trace once left fake DTensor
    placements in the mesh's cache, and the eager call then failed), and no recompile (a memo
    the trace read, and the eager call filled, once failed its guard)."""
    prog, f = mapped(name)
    args = prog.args()
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    got = evaluate(compiled, args, 1.0)
    want = evaluate(f, args, 1.0)
    frames = counter.frame_count
    again = evaluate(compiled, args, 1.0)
    problems = [p for run in (got, again) for p in differences(run, want)]
    if counter.frame_count != frames:
        problems.append(f"recompiled after the eager call ({frames} -> {counter.frame_count})")
    return {"compiled_first": True, "problems": problems}


def check_comm_mode(name: str, backend: str) -> dict:
    """A compiled call under ``ns.CommMode`` runs eagerly and is counted as the eager call is:
    ``ns.compile(f, fullgraph=True)`` (decided before Dynamo) and ``torch.compile(f)`` (a graph
    break around the call); both give the eager call's values there and after."""
    prog, f = mapped(name)
    args = prog.args()
    torch._dynamo.reset()
    want, want_counts = evaluate(f, args, 1.0), eager_counts(f, args)
    problems = []
    for label, compiled in (
        ("ns.compile", ns.compile(f, backend=backend, fullgraph=True)),
        ("torch.compile", torch.compile(f, backend=backend)),
    ):
        evaluate(compiled, args, 1.0)  # compiles, outside CommMode
        counts = eager_counts(compiled, args)
        if counts != want_counts:
            problems.append(f"{label}: CommMode counts {counts}, eager {want_counts}")
        problems += [
            f"{label}, after CommMode: {p}"
            for p in differences(evaluate(compiled, args, 1.0), want)
        ]
    return {"comm_mode": True, "problems": problems}


def check_bucketed(name: str, backend: str) -> dict:
    """``ns.compile`` with Inductor buckets the graph's independent all-reduces: fewer run per
    step than without the pass that makes the gradients' waits adjacent first, and fewer still
    than with the bucketing turned off, with eager's values. ``name`` is ``two_tp_layers``: two
    Megatron layers on DTensor parameters, whose backward puts an activation's psum over tp
    between the gradients' psums over dp."""
    f, args = two_tp_layers()
    torch._dynamo.reset()
    want = evaluate(f, args, 1.0)
    configs = {
        "default": {},
        "no adjacent waits": {BUCKET_OPTION: "all", PRE_PASS_OPTION: None},
        "unbucketed": {BUCKET_OPTION: "none"},
    }
    problems, counts = [], {}
    for label, options in configs.items():
        compiled = ns.compile(f, fullgraph=True, options=options) if options else ns.compile(f)
        evaluate(compiled, args, 1.0)  # traced and compiled
        with torch.profiler.profile() as prof:
            got = evaluate(compiled, args, 1.0)
        counts[label] = sum(e.name == "c10d::allreduce_" for e in prof.events())
        problems += [f"{label}: {p}" for p in differences(got, want)]
    if not 0 < counts["default"] < counts["no adjacent waits"]:
        problems.append(f"all-reduces per step {counts}: the default should run fewer")
    return {"bucketed": counts, "problems": problems}


def two_tp_layers():
    """Two Megatron MLP layers (replicated biases after the psum), data parallel over dp, the
    parameters DTensors (their gradients are graph outputs), float64."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))

    def layers(x, p):
        for i in (1, 3):
            h = torch.tanh(x @ p[f"w{i}"] + p[f"b{i}"]) @ p[f"w{i + 1}"]
            x = ns.psum(h, "tp") + p[f"b{i + 1}"]
        return ns.pmean((x**2).mean().reshape(1), "dp")

    col, row = P(None, "tp"), P("tp", None)
    specs = {"w1": col, "b1": P("tp"), "w2": row, "b2": P(), "w3": col, "b3": P("tp")}
    specs |= {"w4": row, "b4": P()}
    gen = torch.Generator().manual_seed(3)
    shapes = {"w1": (6, 4), "b1": (4,), "w2": (4, 6), "b2": (6,)}
    shapes |= {k[0] + str(int(k[1]) + 2): v for k, v in shapes.items()}
    params = {k: torch.randn(shapes[k], generator=gen, dtype=torch.float64) for k in specs}
    x = torch.randn(8, 6, generator=gen, dtype=torch.float64)
    f = ns.spmd_map(layers, mesh=mesh, in_specs=(P("dp"), specs), out_specs=P())
    return f, (x, ns.shard(params, mesh, specs))


# --- user code: draws, int and dict arguments, graph breaks, a training step -------------------
#
# Each case compiles with aot_eager and counts the graphs Dynamo hands the backend
# (CompileCounterWithBackend.frame_count) over STEPS calls, against the eager call's values.

STEPS = 3


def _world() -> int:
    return dist.get_world_size() if dist.is_initialized() else 4


def _mesh():
    return ns.make_mesh((_world(),), ("dp",))


def _drawn(x, cfg):
    """Draws seeded by a step counter and by constants; the settings in a dict holding no
    tensor (torch's stand-in for optree's dict flatten fails on one while Dynamo traces), and
    the dropout's seed reads its keys in the caller's order; an explicit pvary (a view of its
    operand on a real mesh)."""
    step = cfg["step"]
    h = ns.random.dropout(x, cfg["p"], over="dp", seed=(step, ",".join(cfg)))
    noise = ns.pvary(ns.random.randn(*x.shape[1:], over=(), seed=("noise", 2), dtype=x.dtype), "dp")
    ints = ns.random.randint(0, 7, x.shape, over="dp", seed=(step, 3))
    return h + noise + ints.to(x.dtype) * ns.random.rand(1, over="dp", seed=step, dtype=x.dtype)


def _settings(step: int) -> dict:
    return {"step": step, "p": 0.5, "name": "drop"}  # not in sorted order


def _scaled(x, k):
    return ns.psum(x * k, "dp") + k


def _with_settings(x, k):
    """The int argument also returned, in a dict holding no tensor (as for an argument, torch's
    stand-in for optree's dict flatten fails on one while Dynamo traces)."""
    return {"y": _scaled(x, k), "settings": {"k": k, "name": "scaled"}}


def _breaks(p):
    y = p["a"].sin() * p["b"]
    torch._dynamo.graph_break()  # anything Dynamo cannot trace: a print, a .item(), ...
    return ns.psum(y, "dp") + p["b"]


def _times_reduced(w, r):
    """An invariant operand beside a reduced one: cast to reduced (I -> R), once per call for
    both of its uses; its gradient is the sum of the per-instance partial gradients."""
    return w * r + w.sin() * r


def _leaves(*tensors) -> tuple:
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def _tanh_matmul(x, w):
    return torch.tanh(x @ w)


def _grown(step: int) -> tuple:
    """A split input and a replicated parameter whose shapes grow every step (rows of ``x``,
    columns of ``w``): DTensors on a real mesh, plain global tensors on a simulated one
    (``ns.shard``). Dynamo traces the second step's with symbolic dims (its automatic dynamic),
    which must not serve the third step's with the second's global shapes."""
    gen = torch.Generator().manual_seed(step)
    x = torch.randn((step + 2) * _world(), 3, generator=gen, dtype=torch.float64)
    w = torch.randn(3, step + 2, generator=gen, dtype=torch.float64)
    return tuple(ns.shard(_leaves(x, w), _mesh(), (P("dp"), P())))


CASES = {
    # name: (per-device function, in_specs, out_specs, arguments of a step, graphs expected)
    # a step counter changes every call: traced as a constant first, then, once it changed,
    # as a symbolic int (torch's automatic dynamic): two graphs, none per later step
    "random_draws": (_drawn, (P("dp"), None), P("dp"), lambda s, x: (x, _settings(s)), 2),
    "int_argument": (
        _with_settings,
        (P("dp"), None),
        {"y": P(), "settings": None},
        lambda s, x: (x, s + 1),
        2,
    ),
    # a graph break inside the call: the whole call runs eagerly, no graph of its own
    "graph_break_dict": (
        _breaks,
        ({"a": P("dp"), "b": P()},),
        P(),
        lambda s, x: ({"a": x * (s + 1), "b": x[0]},),
        0,
    ),
    "invariant_beside_reduced": (
        _times_reduced,
        (P(), P(reduced={"dp"})),
        P(),
        lambda s, x: _leaves(x[0] * (s + 1), x[1]),
        1,
    ),
    # inputs of another shape every step: traced with static shapes, one graph per shape
    "shapes_change": (_tanh_matmul, (P("dp"), P()), P("dp"), lambda s, x: _grown(s), STEPS),
}


def _same_tree(got, want) -> bool:
    """The same structure, tensors close (global values), other leaves equal."""
    (a, tree_a), (b, tree_b) = (optree.tree_flatten(t, none_is_leaf=True) for t in (got, want))
    return tree_a == tree_b and all(
        close(_whole(p), _whole(q), rtol=1e-12, atol=1e-12)
        if isinstance(p, torch.Tensor)
        else p == q
        for p, q in zip(a, b)
    )


def _with_gradients(f, args) -> tuple:
    """``f(*args)`` and the gradients of its tensor outputs' sum of squares with respect to
    the arguments that require them (none where none does)."""
    out = f(*args)
    leaves = [
        a for a in optree.tree_leaves(args) if isinstance(a, torch.Tensor) and a.requires_grad
    ]
    if not leaves:
        return out, ()
    loss = sum((t * t).sum() for t in optree.tree_leaves(out) if isinstance(t, torch.Tensor))
    return out, torch.autograd.grad(loss, leaves)


def check_case(name: str, backend: str) -> dict:
    """``CASES[name]`` compiled (fullgraph=True, but for a graph break, which runs the call
    eagerly) against its eager call, over STEPS steps: values, gradients (of the arguments
    that require them), and the graph count."""
    fn, in_specs, out_specs, args_of, graphs = CASES[name]
    f = ns.spmd_map(fn, mesh=_mesh(), in_specs=in_specs, out_specs=out_specs)
    x = torch.randn(
        2 * _world(), 3, generator=torch.Generator().manual_seed(4), dtype=torch.float64
    )
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(f, backend=counter, fullgraph=name != "graph_break_dict")
    problems = []
    for step in range(STEPS):
        (got, got_grads), (want, want_grads) = (
            _with_gradients(g, args_of(step, x)) for g in (compiled, f)
        )
        if not _same_tree(got, want):
            problems.append(f"step {step}: the compiled call differs from the eager call")
        if not _same_tree(got_grads, want_grads):
            problems.append(f"step {step}: the compiled call's gradients differ from the eager's")
    if counter.frame_count != graphs:
        problems.append(f"{counter.frame_count} graphs for {STEPS} steps, expected {graphs}")
    return {"graphs": counter.frame_count, "problems": problems}


def _dense_loss(x, p, step):
    return ((torch.tanh(x @ p["w1"] + p["b1"]) @ p["w2"]) ** 2).mean().reshape(1)


def _mapped_loss(x, p, step):
    """The dense loss, data parallel, with a dropout mask that changes every step."""
    h = torch.tanh(x @ p["w1"] + p["b1"])
    h = ns.random.dropout(h, 0.25, over="dp", seed=(step, 1))
    return ns.pmean(((h @ p["w2"]) ** 2).mean().reshape(1), "dp")


def _trainer(loss_fn, params):
    opt = torch.optim.SGD(params.values(), lr=0.1)

    def train(x, p, step):
        loss = loss_fn(x, p, step)
        loss = loss.to_local() if isinstance(loss, DTensor) else loss
        out = loss.detach()  # a leaf: Dynamo reads .grad of a non-leaf handed across a break
        loss.sum().backward()
        opt.step()
        opt.zero_grad()
        return out

    return train


def _params():
    gen = torch.Generator().manual_seed(6)
    shapes = {"w1": (3, 5), "b1": (5,), "w2": (5, 2)}
    return {
        k: torch.randn(v, generator=gen, dtype=torch.float64, requires_grad=True)
        for k, v in shapes.items()
    }


#: the step counter of ``train(x, p, step)`` traced as a symbolic int from the first call (torch's
#: ``dynamic_sources``; README, "torch.compile"), rather than as a constant and then, once it
#: changed, as a symbolic int: one trace fewer
STEP_DYNAMIC = "L['step']"


def _graphs_of_training(loss_fn, backend: str, x) -> tuple[int, list, dict]:
    torch._dynamo.reset()
    params, counter = _params(), CompileCounterWithBackend(backend)
    train = torch.compile(_trainer(loss_fn, params), backend=counter)
    with torch.compiler.config.patch(dynamic_sources=STEP_DYNAMIC):
        losses = [train(x, params, step) for step in range(STEPS)]
    return counter.frame_count, losses, params


def check_training_step(name: str, backend: str) -> dict:
    """A whole training step (the mapped loss with a dropout seeded by the step, backward,
    ``opt.step``, ``opt.zero_grad``) compiled, the step counter symbolic from the first call
    (:data:`STEP_DYNAMIC`): the graphs torch makes of the same step on the dense loss (torch
    breaks the graph at ``backward`` and around ``opt.step``), none more; the losses and
    parameters of the eager step."""
    mapped = ns.spmd_map(_mapped_loss, mesh=_mesh(), in_specs=(P("dp"), P(), None), out_specs=P())
    x = torch.randn(
        2 * _world(), 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64
    )
    dense, _, _ = _graphs_of_training(_dense_loss, backend, x)
    graphs, losses, params = _graphs_of_training(mapped, backend, x)
    want_params = _params()
    eager = _trainer(mapped, want_params)
    problems = []
    for step, got in enumerate(losses):
        if not close(got, eager(x, want_params, step), rtol=1e-12, atol=1e-12):
            problems.append(f"step {step}: the compiled loss differs from the eager one")
    if not all(close(_whole(params[k]), _whole(want_params[k]), 1e-12, 1e-12) for k in params):
        problems.append("the compiled steps' parameters differ from the eager steps'")
    if graphs != dense:
        problems.append(f"{graphs} graphs for {STEPS} steps; the dense step: {dense}")
    return {"graphs": graphs, "dense_graphs": dense, "problems": problems}


# --- dtypes: every dtype torch has through every collective, as the eager call ----------------


def _outcome(call) -> dict:
    try:
        return {"value": described(ns.to_local(call()))}
    except Exception as e:  # noqa: BLE001 - compared with the compiled call's
        return {"error": type(e).__name__, "message": str(e)}


def _together(mesh, names: list[str], check_vma: bool):
    """The dtype programs ``names`` as one mapped function of one input per program."""
    programs = [program(n) for n in names]

    def every(*xs):
        return tuple(fn(x) for (fn, *_), x in zip(programs, xs))

    in_specs, out_specs = tuple(p[1] for p in programs), tuple(p[2] for p in programs)
    return ns.spmd_map(
        every, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
    )


# One dtype per way the backend puts a dtype on the wire beyond a native one (float64, every
# other compiled program's): ``_dist_comm.on_wire`` and ``reduce_wire``, which the eager and the
# compiled collectives share (test_faults.py runs every dtype torch has eagerly, on both meshes):
# bool summed as int32 (int16's sums go through int32 alike, and its moves as bytes as uint64's
# do), uint64's bits, complex as pairs of reals, bytes (float8, its reductions refused).
COMPILED_DTYPES = [
    torch.bool,
    torch.uint64,
    torch.complex64,
    torch.float8_e4m3fn,
]
assert set(COMPILED_DTYPES) <= set(DTYPES)
# The dtype whose refused program is compiled too: a refusal is one dtype check made before any
# communication, the same code for every dtype (test_faults.py runs every refusal on both meshes).
REFUSED_COMPILED = torch.float8_e4m3fn


def check_dtypes(name: str, backend: str) -> dict:
    """faults_worker's dtype matrix compiled (fullgraph=True): ``COMPILED_DTYPES`` through every
    collective and the call boundary's communication (a complex one's on a conjugate view
    too), each rank's
    block bit for bit, or the error, as the eager call (which test_faults.py compares with the
    simulated mesh). The programs the eager call runs for a dtype are compiled as one call (one
    trace per dtype, not per program). A refused program raises at trace time: the first one
    the eager call refuses for ``REFUSED_COMPILED`` is compiled on its own."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    problems: list[str] = []
    refusals = 0
    for dtype in COMPILED_DTYPES:
        cases = [n for d, n in DTYPE_CASES if d is dtype]  # (a complex one's on x.conj() too)
        eager = {n: _outcome(lambda: dtype_call(mesh, dtype, n)) for n in cases}
        ran = [n for n, o in eager.items() if "value" in o]
        for check_vma in (True, False):
            names = [n for n in ran if program(n)[3] is check_vma]
            if names:
                f = _together(mesh, names, check_vma)
                got = _outcome_each(f, backend, [case_input(dtype, n) for n in names])
                problems += [
                    f"{dtype} {n}: compiled {o}, eager {eager[n]}"
                    for n, o in zip(names, got)
                    if o != eager[n]
                ]
        refused = [n for n in cases if n not in ran]
        for n in refused[:1] if dtype == REFUSED_COMPILED else []:
            fn, in_spec, out_spec, check_vma = program(n)
            f = ns.spmd_map(
                fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma
            )
            o = _outcome_each(f, backend, [case_input(dtype, n)])[0]
            refusals += 1
            want = eager[n]
            if "error" not in o or not (
                want["error"] in o["message"] and want["message"].split("\n")[0] in o["message"]
            ):
                problems.append(f"{dtype} {n}: compiled {o}, eager {want}")
    return {"dtypes": len(COMPILED_DTYPES), "refusals": refusals, "problems": problems}


def _outcome_each(f, backend: str, xs: list[torch.Tensor]) -> list[dict]:
    """``f`` compiled, called on ``xs``: each output described, or the error (raised while
    Dynamo traces: its cause, which quotes ours) for every output."""
    torch._dynamo.reset()
    try:
        outs = torch.compile(f, backend=backend, fullgraph=True)(*xs)
    except Exception as e:  # noqa: BLE001 - compared with the eager call's
        cause = e.__cause__ or e
        return [{"error": type(e).__name__, "message": _unquoted(str(cause))}] * len(xs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    return [{"value": described(ns.to_local(y))} for y in outs]


# --- errors: the compiled call raises the eager call's error ------------------------------------


def _unreduced(x):
    return x * 2  # varying over dp, but out_specs claim P()


def _invariant_scatter(x, w):
    return ns.psum_scatter(w, "dp", scatter_dimension=0, tiled=True)  # w is invariant over dp


def _shapes(x):
    return x


def _bias_inside_psum(x, w, b):
    return ns.psum(x @ w + b, "dp")  # x @ w is a partial sum over dp (inferred from the specs)


def _linear_bias_inside_psum(x, w, b):
    return ns.psum(torch.nn.functional.linear(x, w.T, b), "dp")


def _relu_of_partial(x, w, b):
    return ns.psum(torch.relu(x @ w), "dp") + b


def _tensor_seed(x, step):
    return ns.random.dropout(x, 0.5, over="dp", seed=(step, 1))  # a tensor: its value may vary


_ROW_PARALLEL = (
    (P(None, "dp"), P("dp", None), P()),
    P(),
    lambda: (torch.ones(3, 8), torch.ones(8, 2), torch.ones(2)),
)


def _doubled(x):
    return x * 2


ERRORS = {
    "tensor_seed": (
        _tensor_seed,
        (P("dp"), P()),
        P("dp"),
        lambda: (torch.ones(8, 2), torch.tensor(3)),
    ),
    "out_specs_claim_replication": (_unreduced, P("dp"), P(), lambda: (torch.ones(8, 2),)),
    # its message suggests the close axis name ('dp'), computed while Dynamo traces
    "unknown_out_axis": (_doubled, P("dp"), P("dq"), lambda: (torch.ones(8, 2),)),
    "invariant_operand": (
        _invariant_scatter,
        (P("dp"), P()),
        P("dp"),
        lambda: (torch.ones(8, 2), torch.ones(4, 2)),
    ),
    # the traced call broadcasts in_specs eagerly and falls back to the traced path to raise
    "in_specs_not_a_prefix": (
        _shapes,
        ({"w": P("dp"), "b": P()},),
        P("dp"),
        lambda: ({"w": torch.ones(8, 2)},),
    ),
    # partial sums inferred at trace time (docs/design.md section 2.3)
    "bias_inside_psum": (_bias_inside_psum, *_ROW_PARALLEL),
    "linear_bias_inside_psum": (_linear_bias_inside_psum, *_ROW_PARALLEL),
    "relu_of_partial": (_relu_of_partial, *_ROW_PARALLEL),
}


def _doubled(x):
    return x * 2


def check_marked_dynamic(name: str, backend: str) -> dict:
    """An input size marked by ``mark_dynamic`` (``name``: a ``plain`` tensor or a ``dtensor``):
    a compiled call is traced for static shapes, so with fullgraph a SpecError names the
    function, the input and the fix (never Dynamo's ConstraintViolationError); without it the
    call runs uncompiled, and ``maybe_mark_dynamic`` (the fix) compiles: both the dense x * 2."""
    mesh = ns.make_mesh((dist.get_world_size(),), ("dp",))
    f = ns.spmd_map(_doubled, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    x = torch.arange(6.0 * mesh.size).reshape(2 * mesh.size, 3)

    def given(mark):
        t = ns.shard(x, mesh, P("dp")) if name == "dtensor" else x.clone()
        mark(t, 0)
        return t

    problems = []
    torch._dynamo.reset()
    try:
        torch.compile(f, backend=backend, fullgraph=True)(given(torch._dynamo.mark_dynamic))
        problems.append("fullgraph: nothing raised")
    except Exception as e:  # noqa: BLE001 - compared below
        cause = _unquoted(str(e.__cause__))
        wanted = (
            "SpecError",
            "_doubled` (compile_worker.py:",
            "input [0] (dim 0) has a size marked",
        )
        if not all(w in cause for w in wanted):
            problems.append(f"fullgraph: {type(e).__name__}: {str(e)[:300]}; cause {cause[:300]}")
    for mark, fullgraph in (
        (torch._dynamo.mark_dynamic, False),
        (torch._dynamo.maybe_mark_dynamic, True),
    ):
        torch._dynamo.reset()
        try:
            got = ns.unshard(torch.compile(f, backend=backend, fullgraph=fullgraph)(given(mark)))
        except Exception as e:  # noqa: BLE001 - reported
            problems.append(f"{mark.__name__}, fullgraph={fullgraph}: raised {e!r}"[:600])
            continue
        if not torch.equal(got, x * 2):
            problems.append(f"{mark.__name__}, fullgraph={fullgraph}: {got} != {x * 2}")
    if name == "plain":
        problems += _computed_from_marked(f, x, backend)
        problems += _beside_an_unrelated_marked_input(f, x, backend)
    return {"problems": problems}


def _beside_an_unrelated_marked_input(f, x: torch.Tensor, backend: str) -> list[str]:
    """A compiled step (fullgraph) with a marked input the call does not read: the call's input
    whose size Dynamo made dynamic on its own (a shape change, then ``maybe_mark_dynamic``) is
    specialized, and each call equals the dense x * 2 + lengths.sum()."""

    def step(x, lengths):
        total = lengths.sum()
        return f(x) + total

    problems = []
    lengths = torch.arange(1.0, 7.0)
    torch._dynamo.mark_dynamic(lengths, 0)
    for mark in (None, torch._dynamo.maybe_mark_dynamic):
        torch._dynamo.reset()
        compiled = torch.compile(step, backend=backend, fullgraph=True)
        for rows in (x, torch.cat([x, x])):
            given = rows.clone()
            if mark is not None:
                mark(given, 0)
            try:
                got = ns.unshard(compiled(given, lengths))
            except Exception as e:  # noqa: BLE001 - reported
                problems.append(f"beside a marked input ({mark}): raised {e!r}"[:600])
                break
            if not torch.equal(got, rows * 2 + lengths.sum()):
                problems.append(f"beside a marked input ({mark}): {got} != {rows * 2 + 21}")
    return problems


def _computed_from_marked(f, x: torch.Tensor, backend: str) -> list[str]:
    """A compiled step of a marked input that maps ``x + 1`` (a size computed from the marked
    one): with fullgraph the SpecError, without it the dense (x + 1) * 2."""
    problems = []
    marked = x.clone()
    torch._dynamo.mark_dynamic(marked, 0)
    torch._dynamo.reset()
    try:
        torch.compile(lambda x: f(x + 1), backend=backend, fullgraph=True)(marked)
        problems.append("computed from a marked size, fullgraph: nothing raised")
    except Exception as e:  # noqa: BLE001 - compared below
        cause = _unquoted(str(e.__cause__))
        wanted = ("SpecError", "_doubled` (compile_worker.py:", "or computed from one")
        if not all(w in cause for w in wanted):
            problems.append(f"computed from a marked size: {type(e).__name__}: {str(e)[:300]}")
    torch._dynamo.reset()
    got = ns.unshard(torch.compile(lambda x: f(x + 1), backend=backend)(marked))
    if not torch.equal(got, (x + 1) * 2):
        problems.append(f"computed from a marked size: {got} != {(x + 1) * 2}")
    return problems


def _positives(x):
    return torch.masked_select(x, x > 0)


def check_data_dependent_output(name: str, backend: str) -> dict:
    """An output sized by its block's values (``masked_select``: blocks of 1, 2, ... positive
    elements, a size per rank), concatenated by its out_spec: a compiled layout cannot assemble
    it, so with fullgraph a SpecError names it and the fix (never a rank's garbage values or
    gloo's abort); without fullgraph the call runs uncompiled and equals the dense x[x > 0].
    An invariant one (one size on every rank) compiles."""
    mesh = ns.make_mesh((dist.get_world_size(),), ("dp",))
    f = ns.spmd_map(_positives, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    n = mesh.size
    x = (torch.arange(4.0) - 3).repeat(n) + torch.arange(n).repeat_interleave(4)
    problems = []
    torch._dynamo.reset()
    try:
        torch.compile(f, backend=backend, fullgraph=True)(x)
        problems.append("fullgraph: nothing raised")
    except Exception as e:  # noqa: BLE001 - compared below
        cause = _unquoted(str(e.__cause__))
        wanted = ("SpecError", "_positives` (compile_worker.py:", "has a data-dependent size")
        if not all(w in cause for w in wanted):
            problems.append(f"fullgraph: {type(e).__name__}: {str(e)[:300]}; cause {cause[:300]}")
    torch._dynamo.reset()
    got = ns.unshard(torch.compile(f, backend=backend)(x))
    if not torch.equal(got, x[x > 0]):
        problems.append(f"without fullgraph: {got} != {x[x > 0]}")
    # invariant (one size on every rank): compiled, the blocks of the dense x[x > 0]
    g = ns.spmd_map(_positives, mesh=mesh, in_specs=P(), out_specs=P("dp"))
    torch._dynamo.reset()
    got = ns.unshard(torch.compile(g, backend=backend, fullgraph=True)(x))
    if not torch.equal(got, x[x > 0].repeat(n)):
        problems.append(f"invariant, fullgraph: {got} != {x[x > 0].repeat(n)}")
    # a list of bools is a mask of a size known while compiling: compiled, each block's selection
    h = ns.spmd_map(_first_and_third, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    torch._dynamo.reset()
    got = ns.unshard(torch.compile(h, backend=backend, fullgraph=True)(x))
    if not torch.equal(got, x.reshape(n, 4)[:, [0, 2]].flatten()):
        problems.append(f"list of bools, fullgraph: {got} != {x.reshape(n, 4)[:, [0, 2]]}")
    return {"problems": problems}


def _first_and_third(x):
    return x[[True, False, True, False]]


def check_error(name: str, backend: str, size: int | None = None) -> dict:
    """The error is raised while Dynamo traces (``fullgraph=True``): Dynamo wraps it in its
    ``Unsupported`` ("Observed exception"), whose cause names our error's class and message.
    Without ``fullgraph`` Dynamo gives up on the call's frame and runs it eagerly (with Dynamo
    off: ``SpmdFunction.__call__``), which raises the eager error itself.
    ``size``: the mesh's (default: one instance per process)."""
    fn, in_specs, out_specs, make = ERRORS[name]
    mesh = ns.make_mesh((size or dist.get_world_size(),), ("dp",))
    f = ns.spmd_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    caught = []
    compiled = (torch.compile(f, backend=backend, fullgraph=fg) for fg in (True, False))
    for g in (f, *compiled):
        torch._dynamo.reset()
        try:
            g(*make())
            caught.append(None)
        except Exception as e:  # noqa: BLE001 - compared below
            caught.append((type(e).__name__, str(e), str(e.__cause__)))
    problems = []
    if caught[0] is None:
        problems.append("the eager call raised nothing")
    elif caught[1] is None or not (
        caught[0][0] in caught[1][2] and caught[0][1].split("\n")[0] in _unquoted(caught[1][2])
    ):
        problems.append(f"compiled call raised {caught[1]!r}, eager {caught[0][:2]!r}")
    elif caught[2] is None or caught[2][:2] != caught[0][:2]:
        # without fullgraph Dynamo gives up on the call's frame, which then runs eagerly
        problems.append(f"without fullgraph: raised {caught[2]!r}, eager {caught[0][:2]!r}")
    return {"error": caught[0] and caught[0][0], "problems": problems}


def _uneven_rows(x):
    return x.sin() * ns.psum((x * x).sum(), "dp")  # a psum of one scalar per (uneven) block


# Calls whose inputs split into blocks of unequal sizes: rows over the mesh's instances
# (7 over 4: 2, 2, 2, 1), the dense program, and an even input of the same function.
UNEVEN = {
    "indivisible_input": (
        _uneven_rows,
        lambda x: x.sin() * (x * x).sum(),
        lambda n: torch.randn(2 * n - 1, 3, generator=_generator(), dtype=torch.float64),
        lambda n: torch.randn(2 * n, 3, generator=_generator(), dtype=torch.float64),
    ),
}


def _generator() -> torch.Generator:
    return torch.Generator().manual_seed(11)


def check_uneven(name: str, backend: str, size: int | None = None) -> dict:
    """A compiled call whose inputs split into blocks of unequal sizes runs eagerly, by design:
    ``torch.compile`` of a step around it breaks the graph around the call (the ops after it
    compiled), ``fullgraph=True`` is Dynamo's refusal quoting why and the fix, and
    ``ns.compile(f, fullgraph=True)`` runs such calls eagerly before Dynamo sees them while its
    even calls run the one compiled frame. Values and gradients are the eager call's and the
    dense program's. ``size``: the mesh's (default: one instance per process)."""
    fn, dense, uneven_input, even_input = UNEVEN[name]
    n = size or dist.get_world_size()
    f = ns.spmd_map(fn, mesh=ns.make_mesh((n,), ("dp",)), in_specs=P("dp"), out_specs=P("dp"))
    uneven, even = uneven_input(n), even_input(n)
    problems = [
        f"eager vs dense: {p}"
        for p in differences(evaluate(f, (uneven,), 1.0), evaluate(dense, (uneven,), 1.0))
    ]

    def step(x):
        return f(x).cos()

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    for x in (uneven, uneven):
        got = evaluate(torch.compile(step, backend=counter), (x,), 1.0)
        problems += [f"torch.compile: {p}" for p in differences(got, evaluate(step, (x,), 1.0))]
    if counter.frame_count != 1:  # the cos after the break; the call itself compiled nothing
        problems.append(f"torch.compile: {counter.frame_count} frames, not 1 (after the break)")
    torch._dynamo.reset()
    try:
        torch.compile(step, backend=backend, fullgraph=True)(uneven)
        problems.append("fullgraph=True: no error")
    except Exception as e:  # noqa: BLE001 - Dynamo's Unsupported, checked below
        if "blocks of unequal sizes" not in str(e) or "Fix: pad that dim" not in str(e):
            problems.append(f"fullgraph=True raised {type(e).__name__}: {str(e)[:600]}")
    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    whole = ns.compile(f, backend=counter, fullgraph=True)
    for x in (uneven, even, uneven, even):
        problems += [
            f"ns.compile: {p}"
            for p in differences(evaluate(whole, (x,), 1.0), evaluate(f, (x,), 1.0))
        ]
    if counter.frame_count != 1:
        problems.append(f"ns.compile: {counter.frame_count} frames, not 1 (the even call)")
    return {"problems": problems}


def _ragged(x, out, *meta):
    return ns.ragged_all_to_all(x, out, *meta, "dp")


def _misfits(r, rows: int) -> list[list[torch.Tensor]]:
    """Routing ``r``'s metadata with sizes that do not fit: member 0 sends a row more to
    member 1 than member 1 expects; member 0's first non-empty slice starts past its operand."""
    mismatched, outside = r.metadata(), r.metadata()
    mismatched[1][r.per] += 1
    outside[0][next(k for k, c in enumerate(r.counts[0]) if c)] = rows
    return [mismatched, outside]


def _raised(call) -> tuple[str, str] | None:
    try:
        call()
    except Exception as e:  # noqa: BLE001 - compared by the caller
        return type(e).__name__, str(e)
    return None


def check_ragged(name: str, backend: str) -> dict:
    """``ragged_all_to_all`` compiled with ``fullgraph=True`` against its eager call: values
    and gradients of two routings in one compiled frame (the graph reads the sizes when it
    runs), and sizes that do not fit raise the eager call's error on every rank, compiled and
    in a ``make_fx`` graph of the blocks' call traced with sizes that fit (no hang, no rows
    dropped unseen)."""
    from _ragged import routing
    from torch.fx.experimental.proxy_tensor import make_fx

    n, me = dist.get_world_size(), dist.get_rank()
    f = ns.spmd_map(_ragged, mesh=ns.make_mesh((n,), ("dp",)), in_specs=P("dp"), out_specs=P("dp"))
    routes = [routing(n, 2, seed=s) for s in (3, 5)]
    rows, m = max(r.rows for r in routes), max(r.m for r in routes)
    gen = torch.Generator().manual_seed(1)
    x, out = (torch.randn(n * k, 3, generator=gen, dtype=torch.float64) for k in (rows, m))

    def blocks(meta):  # this rank's blocks of the arguments
        return [t.chunk(n)[me] for t in (x, out, *meta)]

    torch._dynamo.reset()
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(f, backend=counter, fullgraph=True)
    traced = make_fx(f.local)(*blocks(routes[0].metadata()))
    problems = []
    for step, r in enumerate(routes):
        args = (x, out, *r.metadata())
        want = evaluate(f, args, 1.0)
        problems += [f"step {step}: {p}" for p in differences(evaluate(compiled, args, 1.0), want)]
        if not torch.equal(traced(*blocks(r.metadata())), f.local(*blocks(r.metadata()))):
            problems.append(f"step {step}: the make_fx graph's output differs")
    xg, og = (t.clone().requires_grad_() for t in (x, out))  # (as the steps': no recompile)
    for kind, meta in zip(("mismatched sizes", "a slice outside"), _misfits(routes[0], rows)):
        want = _raised(lambda: f(x, out, *meta))
        for how, g, args in (
            ("compiled", compiled, (xg, og, *meta)),
            ("make_fx graph", traced, blocks(meta)),
        ):
            got = _raised(lambda: g(*args))
            if want is None or got != want:
                problems.append(f"{kind}: {how} raised {got}, eager {want}")
    if counter.frame_count != 1:
        problems.append(f"{counter.frame_count} frames compiled (recompiled)")
    if n == 4:
        problems += _ragged_in_one_group(routing(2, 1, seed=3), backend)
    return {"problems": problems}


def _ragged_then_psum(x, out, *meta):
    y = ns.ragged_all_to_all(x, out, *meta, "tp")
    return y * ns.psum(y.sum(), "dp")


def _ragged_in_one_group(r, backend: str) -> list[str]:
    """Sizes that do not fit in one group of "tp" (of a 2x2 mesh), then a psum over "dp":
    every rank raises the simulated mesh's error (the other group's ranks too, which would
    otherwise wait in the psum for ranks that raised)."""
    meta = [torch.cat([bad, good]) for bad, good in zip(_misfits(r, r.rows)[0], r.metadata())]
    args = (torch.ones(4 * r.rows, 2), torch.zeros(4 * r.m, 2), *meta)
    outcomes = []
    for simulated in (True, False):
        mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=simulated)
        spec = P(("dp", "tp"))
        f = ns.spmd_map(_ragged_then_psum, mesh=mesh, in_specs=spec, out_specs=spec)
        if simulated:  # (its per-instance execution reads the sizes, uncompiled)
            with ns.simulate_per_instance():
                outcomes.append(_raised(lambda: f(*args)))
        else:
            outcomes.append(
                _raised(lambda: torch.compile(f, backend=backend, fullgraph=True)(*args))
            )
    want, got = outcomes
    return [] if want is not None and got == want else [f"one group: {got}, simulated {want}"]


def _unquoted(cause: str) -> str:
    """Dynamo quotes our error as ``VmaError('...')``: quotes inside the message come escaped."""
    return cause.replace("\\'", "'")


def report(result: dict) -> None:
    """One ``COMPILE {json}`` line (rank 0, and any rank with problems); also appended at once to
    the file ``$COMPILE_RESULTS`` names, if set, so a long run shows its progress."""
    if dist.get_rank() != 0 and not result["problems"]:
        return
    line = "COMPILE " + json.dumps({"rank": dist.get_rank(), **result})
    print(line, flush=True)
    path = os.environ.get("COMPILE_RESULTS")
    if path:
        with open(path, "a") as fh:
            fh.write(line[:2000] + "\n")


def _guarded(check, name: str, backend: str) -> dict:
    try:
        result = check(name, backend)
    except Exception as e:  # noqa: BLE001 - reported, and the test fails
        result = {
            "problems": [f"raised {type(e).__name__}: {str(e)[:1500]}"],
            "traceback": traceback.format_exc()[-3000:],
        }
    return {"program": name, "backend": backend, **result}


def main() -> None:
    """``argv[1]``: a JSON object, backend -> the checks to run with it and their names."""
    dist.init_process_group("gloo")
    plan = json.loads(sys.argv[1])
    checks = {
        "programs": check_program,
        "compiled_first": check_compiled_first,
        "comm_mode": check_comm_mode,
        "bucketed": check_bucketed,
        "errors": check_error,
        "marked_dynamic": check_marked_dynamic,
        "data_dependent_output": check_data_dependent_output,
        "uneven": check_uneven,
        "cases": check_case,
        "training": check_training_step,
        "dtypes": check_dtypes,
        "ragged": check_ragged,
    }
    failed = False
    for backend, todo in plan.items():
        for kind, names in todo.items():
            for name in names:
                started = time.perf_counter()
                result = _guarded(checks[kind], name, backend)
                result["seconds"] = round(time.perf_counter() - started, 1)
                failed |= bool(result["problems"])
                report(result)
    sys.stdout.flush()
    dist.destroy_process_group()
    os._exit(1 if failed else 0)


if __name__ == "__main__":
    main()
