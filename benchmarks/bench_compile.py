"""torch.compile of the GPT training step (benchmarks/_gpt.py) on a real (2, 2) mesh, 4 gloo
processes: forward + backward + AdamW, the loss function compiled with Inductor, fullgraph.

Variants, timed interleaved in the same processes (bench_gpt.interleaved):
* ``named_spmd compiled``: ``ns.compile(spmd_map(loss))`` (backends/_dist_compile.py), every
  parameter a DTensor laid out by its spec;
* ``named_spmd compiled, replicated parameters plain``: the same, with the parameters no axis
  splits held as plain tensors (as ``parallelize_module`` leaves them): no DTensor conversion,
  guard or optimizer dispatch for them;
* ``named_spmd compiled, local blocks (.local)``: the mapped function's ``.local`` compiled
  (``ns.compile(f.local)``) on this rank's blocks as plain tensors, the parameters made by
  ``ns.shard(..., blocks=True)`` (no DTensor anywhere: what the hand-written step holds);
  ``..., loss unreduced over dp``: the same with the loss left a partial sum over dp, the
  hand-written program's collectives exactly (the step closest to the baseline);
* ``named_spmd compiled, loss unreduced over dp``: the loss left a partial sum over dp
  (``P(unreduced={"dp"})``), so that the forward runs the hand-written program's collectives;
* ``hand-written funcol compiled`` (the baseline): the same per-rank program written by hand with
  ``_c10d_functional`` collectives inside two autograd Functions (Megatron's f and g: identity
  forward / all-reduce backward, and all-reduce forward / identity backward), an f over tp at
  each column-parallel input (attention, MLP, LM head), the replicated parameters' dp all-reduce
  as an f over dp at their use, all compiled the same way;
* ``hand-written funcol compiled, DTensor parameters``: the same program on the DTensor
  parameters named_spmd trains (their local tensors taken in the graph, torch's ``to_local``):
  what DTensor parameters cost the hand-written step; the row "named_spmd compiled /
  hand-written, both on DTensor parameters" is ``named_spmd compiled`` over it (a target's row);
* ``named_spmd blocks compiled``: the eager mapped step with each transformer block compiled by
  ``ns.compile`` (Inductor, fullgraph), torchtitan's per-block compile;
* ``DTensor TP compiled``: torch's own tensor parallelism (bench_gpt's ``parallelize_module``
  plan, data parallel over dp by DDP's schedule) with the parallelized module compiled by
  Inductor (not fullgraph: torch's own choice of breaks; the vocab-parallel loss runs eagerly
  under ``loss_parallel``, as torch documents it);
* ``named_spmd eager``: for reference;
* ``hand-written funcol compiled, a second copy (A/A control)``: the baseline built again (its
  own parameters and optimizer, the same compiled code) and timed as a variant: its ratio is the
  machine's noise (timed only where ``--variants`` names it).
It also prints the seconds of the first call (trace + compile + run) of each compiled variant.

Every compiled variant runs with Inductor's all-reduce bucketing (``bucket_all_reduces_fx``)
and the pass that makes the gradients' waits adjacent before it, which ``ns.compile`` turns on
for named_spmd: the same compiler options for all.
``--inductor-defaults`` leaves the other variants with Inductor's defaults (no bucketing: one
all-reduce per gradient, each a millisecond of fixed cost on gloo).

    python benchmarks/bench_compile.py [--d 32] [--steps 5] [--rounds 5]
    python benchmarks/bench_compile.py --one-process   # where the compiled step's time goes
    python benchmarks/bench_compile.py --simulated     # the simulated mesh in a compiled step
    python benchmarks/bench_compile.py --mesh 1 1 --device cuda   # one GPU, NCCL (wall clock)
    python benchmarks/bench_compile.py --guards        # the guard check of one compiled call
    python benchmarks/bench_compile.py --code          # the generated code, hand-written vs mapped
    python benchmarks/bench_compile.py --variants "local blocks" --rounds 15   # some variants

``--one-process``: in this process, one gloo rank, a (1,1) mesh, the same model: the dense loss
compiled (the baseline) against named_spmd compiled with DTensor parameters and with plain
parameters (each compiled call a code object of its own), and the dense loss compiled on the
same DTensor parameters (their local tensors taken in the graph), CPU time per step, minimum
over rounds: what DTensor parameters cost a compiled step with and without named_spmd (their
runtime wrapping, AdamW and gradient accumulation on them).

``--simulated``: in this process, the dense step compiled (the baseline) and eager, against the
step calling named_spmd on a simulated (2,2) mesh compiled whole (Inductor, fullgraph:
backends/simulated/_traced.py) and eagerly; CPU time per step, minimum over rounds, and the
seconds of each first call.

``--code``: on the (2,2) mesh, the Inductor code of the hand-written step and of the mapped
step with the same collectives (``.local``, loss unreduced over dp), forward and backward,
counted: fused and extern kernel calls, aten fallbacks, all-reduces, waits, buffers allocated,
tensor reinterpretations, lines of ``call()``. CPU only.
What the compiled step runs besides the hand-written program's own work, without timing noise.

``--guards``: the guard check Dynamo runs before the graph on every compiled call, for the dense
step, the simulated (2,2) step and a real (1,1) step with DTensor parameters and with local
blocks (``.local``; also under plain ``torch.compile``, with every guard), timed directly (best of
20 x 200 checks in a tight loop) and in place (a compiled forward's CPU time with the guards
evaluated less with their evaluation skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _gpt as G  # noqa: E402
import _util  # noqa: E402
import bench_gpt as B  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402

BENCH = "bench_compile"
FUNCOL = torch.ops._c10d_functional


def _all_reduce(x, group_name):
    return FUNCOL.wait_tensor(FUNCOL.all_reduce(x, "sum", group_name))


class _F(torch.autograd.Function):
    """Identity forward, all-reduce backward (a replicated value used by varying work)."""

    @staticmethod
    def forward(x, group_name):
        return x.view_as(x)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.group_name = inputs[1]

    @staticmethod
    def backward(ctx, g):
        return _all_reduce(g, ctx.group_name), None


class _G(torch.autograd.Function):
    """All-reduce forward, identity backward (a partial sum made whole)."""

    @staticmethod
    def forward(x, group_name):
        return _all_reduce(x, group_name)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None


def hand_written_loss(cfg: G.Config, dp_name: str, tp_name: str, tp_rank: int, dp: int):
    """The per-rank loss written by hand: local blocks in, this rank's share of the mean out."""

    def row_linear(a, w, b):
        return _G.apply(F.linear(a, w), tp_name) + b

    def col_input(h):  # Megatron's f: a replicated activation entering tp-sharded work
        return _F.apply(h, tp_name)

    def loss(tokens, targets, p):
        # every parameter is replicated over dp: its gradient is all-reduced over dp. Over tp a
        # replicated parameter's gradient is whole once each column-parallel input's gradient
        # is summed over tp (col_input)
        q = {k: _F.apply(v, dp_name) for k, v in p.items()}
        x = col_input(G._trunk(tokens, q, cfg, row_linear, col_input=col_input))
        logits = F.linear(x, q["lm_head.weight"]).flatten(0, 1)
        t = targets.flatten()
        v_local = logits.shape[-1]
        local_t = t - tp_rank * v_local
        inside = (local_t >= 0) & (local_t < v_local)
        m = logits.detach().amax(-1)
        m = FUNCOL.wait_tensor(FUNCOL.all_reduce(m, "max", tp_name))
        sumexp = _G.apply((logits - m.unsqueeze(-1)).exp().sum(-1), tp_name)
        picked = logits.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
        target = _G.apply(torch.where(inside, picked, 0.0), tp_name)
        # the mean over the targets counted (Megatron's loss mask; F.cross_entropy's
        # ignore_index), as ns.parallel.vocab_cross_entropy computes it
        counted = t != -100
        per_token = torch.where(counted, sumexp.log() + m - target, 0.0)
        return per_token.sum() / counted.sum() / dp

    return loss


def _local_params(params: dict, cfg: G.Config, tp: int, tp_rank: int) -> dict:
    out = {}
    for k, v in params.items():
        spec = G.param_specs(cfg)[k]
        for d, name in enumerate(spec):
            if name == "tp":
                v = v.chunk(tp, d)[tp_rank]
        out[k] = v.detach().clone().requires_grad_()
    return out


LOCAL = "named_spmd compiled, local blocks (.local)"
LOCAL_UNREDUCED = "named_spmd compiled, local blocks, loss unreduced over dp"
BASELINE = "hand-written funcol compiled"
BASELINE_COPY = "hand-written funcol compiled, a second copy (A/A control)"
HAND_DTENSORS = "hand-written funcol compiled, DTensor parameters"
#: named_spmd compiled over the hand-written step, both on DTensor parameters (a target's row)
ON_DTENSORS = "named_spmd compiled / hand-written, both on DTensor parameters"


def _chosen(name: str, wanted: list[str] | None) -> bool:
    """Whether ``--variants`` (substrings of the names; none: all) picks variant ``name``."""
    return not wanted or any(w in name for w in wanted)


def worker(args) -> None:
    torch.set_num_threads(1)
    _util.use_device(args.device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    if args.code:
        if args.device != "cpu":
            raise SystemExit("--code counts the CPU wrapper's calls: run it with --device cpu")
        return code(args)
    cfg, mesh, dp_name, tp_name, tp_rank, dp_rank = _this_rank(args)
    dp, tp = args.mesh
    dm = mesh.device_mesh
    params = G.init_params(cfg, 0)

    def named_step(fn, replicated_plain: bool = False):
        """The training step of mapped ``fn`` on its own copy of the parameters."""
        p = B._distribute(params, G.param_specs(cfg), dm, replicated_plain)
        return B.trainer(lambda tok, tgt, q: ns.to_local(fn(tok, tgt, q)), p)

    def compiled(fn):
        return ns.compile(fn, backend="inductor", fullgraph=True)

    def named_local_step(fn):
        """The step of ``fn`` (a mapped function's ``.local``) on this rank's blocks: the
        parameters' blocks as plain tensors (``ns.shard(..., blocks=True)``), the batch's."""
        p = ns.shard(B._fresh(params), mesh, G.param_specs(cfg), blocks=True)
        return B.trainer(lambda tok, tgt, q: fn(*B._local_batch(tok, tgt, dp_rank, dp), q), p)

    hand_fn = hand_written_loss(cfg, dp_name, tp_name, tp_rank, dp)

    def local_batch(compiled):
        def loss(tok, tgt, q):
            return compiled(*B._local_batch(tok, tgt, dp_rank, dp), q)

        return loss

    def hand_step():
        hand = torch.compile(hand_fn, backend="inductor", fullgraph=True)
        return B.trainer(local_batch(hand), _local_params(params, cfg, tp, tp_rank))

    def hand_dt_step():
        hand = torch.compile(_on_dtensors(hand_fn), backend="inductor", fullgraph=True)
        return B.trainer(local_batch(hand), B._distribute(params, G.param_specs(cfg), dm))

    def blocks_step():
        block = compiled(G._block)
        loss = G.spmd_loss(cfg, block)
        return named_step(ns.spmd_map(loss, mesh=mesh, in_specs=G.in_specs(cfg), out_specs=P()))

    # name -> (the step's maker, whether its loss is each rank's share of the dp mean)
    variants = {
        "named_spmd compiled": (lambda: named_step(compiled(G.spmd_step_fn(cfg, mesh))), False),
        "named_spmd compiled, replicated parameters plain": (
            lambda: named_step(compiled(G.spmd_step_fn(cfg, mesh)), replicated_plain=True),
            False,
        ),
        "named_spmd compiled, loss unreduced over dp": (
            lambda: named_step(compiled(G.spmd_step_fn(cfg, mesh, reduced=False))),
            True,
        ),
        LOCAL: (lambda: named_local_step(compiled(G.spmd_step_fn(cfg, mesh).local)), False),
        LOCAL_UNREDUCED: (
            lambda: named_local_step(compiled(G.spmd_step_fn(cfg, mesh, reduced=False).local)),
            True,
        ),
        BASELINE: (hand_step, True),
        # an A/A control: the baseline built again, timed as a variant (the machine's noise)
        BASELINE_COPY: (hand_step, True),
        HAND_DTENSORS: (hand_dt_step, True),
        "named_spmd blocks compiled": (blocks_step, False),
        "DTensor TP compiled": (
            lambda: B.dtensor_tp_step(cfg, params, dm, {"backend": "inductor"})[0],
            True,
        ),
        "named_spmd eager": (lambda: named_step(G.spmd_step_fn(cfg, mesh)), False),
    }
    chosen = [
        n
        for n in variants
        if n == BASELINE or (_chosen(n, args.variants) and (n != BASELINE_COPY or args.variants))
    ]
    tok, tgt = G.batch(cfg, 0)
    steps, first = {}, {}
    for name in chosen:
        steps[name] = variants[name][0]()
        dist.barrier()
        t0 = time.perf_counter()
        steps[name](tok, tgt)
        first[name] = time.perf_counter() - t0
    # the same numbers: the losses of a few more steps agree (float32)
    losses = {}
    for name, step in steps.items():
        reduce = B.summed_over_ranks(tp) if variants[name][1] else B._global
        losses[name] = [float(reduce(step(*G.batch(cfg, s)))) for s in range(1, 3)]
    first.pop("named_spmd eager", None)  # not compiled
    fns = {name: B.timer_steps(step, cfg, args.steps) for name, step in steps.items()}
    medians = B.interleaved(fns, args.rounds, args.steps, baseline=BASELINE)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({"medians": medians, "first": first, "losses": losses}))
    dist.destroy_process_group()


def code(args) -> None:
    """``--code`` (a worker of its own): the Inductor code of the hand-written step and of the
    same program mapped (``.local``, the loss unreduced over dp), forward and backward, compared
    by what runs: kernel calls, collectives and their waits, buffers, tensor reinterpretations,
    lines of the generated ``call``. Deterministic, unlike the timings."""
    import re

    from torch._inductor.utils import run_and_get_code

    cfg, mesh, dp_name, tp_name, tp_rank, dp_rank = _this_rank(args)
    dp, tp = args.mesh
    params = G.init_params(cfg, 0)
    tok, tgt = B._local_batch(*G.batch(cfg, 0), dp_rank, dp)
    hand = torch.compile(
        hand_written_loss(cfg, dp_name, tp_name, tp_rank, dp), backend="inductor", fullgraph=True
    )
    mapped = ns.compile(
        G.spmd_step_fn(cfg, mesh, reduced=False).local, backend="inductor", fullgraph=True
    )
    programs = {
        BASELINE: (hand, _local_params(params, cfg, tp, tp_rank)),
        LOCAL_UNREDUCED: (
            mapped,
            ns.shard(B._fresh(params), mesh, G.param_specs(cfg), blocks=True),
        ),
    }
    patterns = {
        "fused kernels": r"\bcpp_fused_\w+\(",
        "extern kernels": r"\bextern_kernels\.\w+\(",
        "aten calls": r"\btorch\.ops\.aten\.\w+\.\w+\(",
        "all-reduces": r"_c10d_functional\.all_reduce_?\.default\(",
        "waits": r"_c10d_functional\.wait_tensor\.default\(",
        "buffers": r"\bempty_strided_cpu\(",
        "reinterpret_tensor": r"\breinterpret_tensor\(",
    }
    rows = []
    for name, (fn, p) in programs.items():
        _, codes = run_and_get_code(lambda: fn(tok, tgt, p).backward())  # noqa: B023
        assert len(codes) == 2, f"{name}: {len(codes)} compiled graphs, expected forward, backward"
        for graph, text in zip(("forward", "backward"), codes):
            # the wrapper's call(), without the benchmark harness Inductor appends after it
            call = text[text.index("def call(") :].split("\ndef get_args")[0]
            counts = {k: len(re.findall(v, call)) for k, v in patterns.items()}
            counts["lines"] = call.count("\n")
            rows.append((name, graph, counts))
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(rows))
    dist.destroy_process_group()


def _this_rank(args):
    """With the compiler options every variant shares: the model's config, the (dp, tp) mesh,
    the names of its groups and this rank's coordinates."""
    _use_bucketing(args)
    cfg = _config(args)
    mesh = ns.make_mesh(tuple(args.mesh), ("dp", "tp"))
    dm = mesh.device_mesh
    dp_name, tp_name = dm.get_group("dp").group_name, dm.get_group("tp").group_name
    return cfg, mesh, dp_name, tp_name, dm.get_local_rank("tp"), dm.get_local_rank("dp")


def _use_bucketing(args) -> None:
    """Inductor's all-reduce bucketing and the pass before it, as ``ns.compile`` sets them, for
    every variant (unless ``--inductor-defaults``)."""
    if args.inductor_defaults:
        return
    import torch._inductor.config as inductor_config

    from named_spmd._compile import sink_output_waits_pass

    inductor_config.bucket_all_reduces_fx = "all"
    inductor_config.post_grad_custom_pre_pass = sink_output_waits_pass()


def one_process(args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    torch.set_num_threads(1)
    cfg = _config(args)
    mesh = ns.make_mesh((1, 1), ("dp", "tp"))
    params = G.init_params(cfg, 0)
    fd, fp = (_inductor(G.spmd_step_fn(cfg, mesh), tag) for tag in ("dtensor", "plain"))
    dtensors = B._distribute(params, G.param_specs(cfg), mesh.device_mesh)
    steps = {
        "dense compiled": B.trainer(_inductor(G.dense_loss(cfg), "dense"), B._fresh(params)),
        "named_spmd compiled, DTensor parameters": B.trainer(
            lambda t, g, q: ns.to_local(fd(t, g, q)), dtensors
        ),
        "named_spmd compiled, plain parameters": B.trainer(
            lambda t, g, q: ns.to_local(fp(t, g, q)), B._fresh(params)
        ),
        "dense compiled, DTensor parameters": B.trainer(
            _inductor(_on_dtensors(G.dense_loss(cfg)), "dense-dtensor"),
            B._distribute(params, G.param_specs(cfg), mesh.device_mesh),
        ),
        "named_spmd compiled, local blocks (.local)": B.trainer(
            _inductor(G.spmd_step_fn(cfg, mesh).local, "local"), B._fresh(params)
        ),
    }
    best, _ = _cpu_times(steps, cfg, args)
    dist.destroy_process_group()
    rows = _util.rows_with_ratios(
        BENCH, "GPT step, (1,1), 1 gloo process, CPU time", best, "dense compiled", {}
    )
    _util.print_rows(rows)
    _util.write_markdown(args.markdown, rows)


def _on_dtensors(loss_of_locals):
    """``loss_of_locals(tokens, targets, local params)`` taking DTensor parameters, their local
    tensors taken in the graph (torch's ``to_local``): what DTensor parameters cost a compiled
    step without named_spmd."""

    def loss(tokens, targets, params):
        return loss_of_locals(tokens, targets, {k: v.to_local() for k, v in params.items()})

    return loss


def simulated(args) -> None:
    """The simulated (2,2) step compiled whole against the dense step compiled, in this
    process."""
    torch.set_num_threads(1)
    cfg = _config(args)
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    params = G.init_params(cfg, 0)
    dense = G.dense_loss(cfg)
    steps = {
        "dense compiled": B.trainer(_inductor(dense, "dense"), B._fresh(params)),
        "dense eager": B.trainer(dense, B._fresh(params)),
        "named_spmd simulated (2,2) compiled": B.trainer(
            _inductor(G.spmd_step_fn(cfg, mesh), "sim"), B._fresh(params)
        ),
        "named_spmd simulated (2,2) eager": B.trainer(G.spmd_step_fn(cfg, mesh), B._fresh(params)),
    }
    best, first = _cpu_times(steps, cfg, args)
    _print_first_calls(first)
    rows = _util.rows_with_ratios(
        BENCH,
        "GPT step, simulated (2,2), 1 process, CPU time",
        best,
        "dense compiled",
        {"named_spmd simulated (2,2) compiled": "<= 1.3x"},
    )
    _util.print_rows(rows)
    _util.write_markdown(args.markdown, rows)


def guards(args) -> None:
    """Dynamo's guard check of one compiled call (run before the graph on every call): the dense
    step, the simulated (2,2) mapped step and a real (1,1) one with DTensor parameters and with
    local blocks (one gloo process), the mapped ones compiled by ``ns.compile`` (which leaves out
    the guards on the package's constants) and, for the local call, by ``torch.compile`` (every
    guard). Timed twice: directly on the call's frame locals in a tight loop (the guards' objects
    in cache), and in place, as the compiled forward's CPU time per call (``no_grad``) with the
    guards evaluated less that with their evaluation skipped (``skip_guard_eval_unsafe``):
    between two calls the step's kernels evict the guards' objects from cache."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.set_num_threads(1)
    cfg = _config(args)
    tok, tgt = G.batch(cfg, 0)
    dense = G.dense_loss(cfg)
    real = ns.make_mesh((1, 1), ("dp", "tp"))
    sim = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    plain_params = B._fresh(G.init_params(cfg, 0))
    dtensors = B._distribute(G.init_params(cfg, 0), G.param_specs(cfg), real.device_mesh)
    inductor = dict(backend="inductor", fullgraph=True)
    # name -> (the function whose frame is compiled, its compiled form, its parameters)
    on_dtensors = _on_dtensors(dense)
    cases = {
        "dense compiled": (dense, torch.compile(dense, **inductor), plain_params),
        "dense compiled, DTensor parameters": (
            on_dtensors,
            torch.compile(on_dtensors, **inductor),
            dtensors,
        ),
    }
    for name, fn, params, compile in (
        ("named_spmd simulated (2,2)", G.spmd_step_fn(cfg, sim), G.init_params(cfg, 0), ns.compile),
        ("named_spmd (1,1), DTensor parameters", G.spmd_step_fn(cfg, real), dtensors, ns.compile),
        ("named_spmd (1,1), .local", G.spmd_step_fn(cfg, real).local, plain_params, ns.compile),
        (
            "named_spmd (1,1), .local, torch.compile",
            G.spmd_step_fn(cfg, real).local,
            plain_params,
            torch.compile,
        ),
    ):
        frame_fn = fn if hasattr(fn, "__self__") else fn.__call__
        cases[f"{name} compiled"] = (frame_fn, compile(fn, **inductor), params)
    direct = {}
    with torch.no_grad():
        for name, (fn, compiled, params) in cases.items():
            compiled(tok, tgt, params)
            frame = _frame_locals(fn, (tok, tgt, params))
            check = _guard_check(fn, frame, _debug_get_cache_entry_list)
            direct[name] = min(_timed(check, frame) for _ in range(20))
        in_place = _in_place_guard_cost(cases, tok, tgt, args.rounds)
    dist.destroy_process_group()
    for name in cases:
        print(
            f"guard check of one call, {name}: {direct[name] * 1e6:.1f} us in a tight loop, "
            f"{in_place[name] * 1e6:.1f} us in place"
        )


def _frame_locals(fn, call_args: tuple) -> dict:
    """The locals of ``fn``'s frame when called with ``call_args`` (a bound method of ours takes
    ``*args, **kwargs``)."""
    if hasattr(fn, "__self__"):
        return {"self": fn.__self__, "args": call_args, "kwargs": {}}
    code = fn.__code__
    frame = dict(zip(code.co_varnames, call_args))
    frame.update(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__ or ())))
    return frame


def _guard_check(fn, frame: dict, entries):
    """The guard check of the compiled entry of ``fn``'s code that accepts the frame locals
    ``frame``."""
    code = (fn.__func__ if hasattr(fn, "__self__") else fn).__code__
    return next(e.guard_manager.check for e in entries(code) if e.guard_manager.check(frame))


def _in_place_guard_cost(cases: dict, tok, tgt, rounds: int) -> dict[str, float]:
    """CPU seconds per compiled call with the guards evaluated less with their evaluation
    skipped, minimum over interleaved rounds of 100 calls each."""
    best = {(name, skip): float("inf") for name in cases for skip in (False, True)}
    for _ in range(max(rounds, 5)):
        for skip in (False, True):
            with torch.compiler.set_stance(skip_guard_eval_unsafe=skip):
                for name, (_, compiled, params) in cases.items():
                    t = time.process_time()
                    for _ in range(100):
                        compiled(tok, tgt, params)
                    per_call = (time.process_time() - t) / 100
                    best[name, skip] = min(best[name, skip], per_call)
    return {name: best[name, False] - best[name, True] for name in cases}


def _timed(check, frame: dict, number: int = 200) -> float:
    t = time.perf_counter()
    for _ in range(number):
        check(frame)
    return (time.perf_counter() - t) / number


def _config(args) -> G.Config:
    return G.Config(d=args.d, layers=args.layers, seq=args.seq, batch=args.batch, vocab=args.vocab)


def _inductor(fn, tag: str, fullgraph: bool = True):
    return _util.compiled_copy(fn, tag, backend="inductor", fullgraph=fullgraph)


def _print_first_calls(first: dict) -> None:
    """The seconds of each variant's first call (trace + compile + run), on one line."""
    print(
        "first call (trace + compile + run), s: "
        + "; ".join(f"{k} {v:.1f}" for k, v in first.items())
    )


def _cpu_times(steps: dict, cfg: G.Config, args) -> tuple[dict[str, float], dict[str, float]]:
    """CPU seconds per step of each step function, the minimum over interleaved rounds, and the
    wall seconds of each one's first call (where a compiled step traces and compiles)."""
    tok, tgt = G.batch(cfg, 0)
    first = {}
    for name, step in steps.items():
        start = time.perf_counter()
        step(tok, tgt)
        first[name] = time.perf_counter() - start
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(args.rounds * 3):
        for name, step in steps.items():
            t = time.process_time()
            for _ in range(args.steps * 2):
                step(tok, tgt)
            best[name] = min(best[name], (time.process_time() - t) / (args.steps * 2))
    return best, first


def _print_code_counts(rows: list) -> None:
    keys = list(rows[0][2])
    print(f"{'program':58} {'graph':9} " + " ".join(f"{k:>18}" for k in keys))
    for name, graph, counts in rows:
        print(f"{name:58} {graph:9} " + " ".join(f"{counts[k]:>18}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", action="store_true")
    ap.add_argument("--d", type=int, default=32)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq", type=int, default=16)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--timeout", type=float, default=1200)
    ap.add_argument("--markdown")
    ap.add_argument("--mesh", type=int, nargs=2, default=(2, 2), metavar=("DP", "TP"))
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL")
    ap.add_argument("--one-process", action="store_true", help="see the module docstring")
    ap.add_argument("--simulated", action="store_true", help="see the module docstring")
    ap.add_argument("--guards", action="store_true", help="see the module docstring")
    ap.add_argument("--code", action="store_true", help="see the module docstring")
    ap.add_argument(
        "--variants",
        nargs="+",
        metavar="TEXT",
        help="time only the variants whose names contain one of these (and the baseline)",
    )
    ap.add_argument(
        "--inductor-defaults",
        action="store_true",
        help="the other variants without the all-reduce bucketing ns.compile turns on",
    )
    args = ap.parse_args()
    if args.worker:
        return worker(args)
    if args.one_process:
        return one_process(args)
    if args.simulated:
        return simulated(args)
    if args.guards:
        return guards(args)
    nproc = args.mesh[0] * args.mesh[1]
    out = _util.spawn(__file__, nproc, [*sys.argv[1:], "--worker"], args.timeout)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(out[-4000:])
    result = json.loads(line[len("RESULT ") :])
    if args.code:
        return _print_code_counts(result)
    _print_first_calls(result["first"])
    print("losses of steps 1-2:", result["losses"])
    medians = result["medians"]
    backend = "NCCL" if args.device == "cuda" else "gloo"
    case = f"GPT step, {tuple(args.mesh)}, {nproc} {backend} process{'es' * (nproc > 1)}"
    rows = B.rows(
        case,
        medians,
        BASELINE,
        {"named_spmd compiled": "<= 1.02x", LOCAL: "<= 1.02x", LOCAL_UNREDUCED: "<= 1.02x"},
        ((ON_DTENSORS, "named_spmd compiled", HAND_DTENSORS, "<= 1.05x"),),
        bench=BENCH,
    )
    _util.print_rows(rows)
    _util.write_markdown(args.markdown, rows)
    print("\npaired: each variant's time over the baseline's in the same round, median over")
    print(f"{args.rounds} rounds [95% bootstrap interval], wall clock and CPU time:")
    for name, (ratio, low, high) in medians["paired wall"].items():
        c_ratio, c_low, c_high = medians["paired cpu"][name]
        print(
            f"  {name:<62} {ratio:.3f}x [{low:.3f}, {high:.3f}]"
            f"   CPU {c_ratio:.3f}x [{c_low:.3f}, {c_high:.3f}]"
        )


if __name__ == "__main__":
    main()
