"""A small GPT trained with AdamW: named_spmd's step against plain torch, DDP and DTensor TP.

    python benchmarks/bench_gpt.py                 # every case (about 1-2 min on 2 cores)
    python benchmarks/bench_gpt.py --quick         # fewer rounds
    python benchmarks/bench_gpt.py --only sim real1 dp2 tp4 --markdown FILE
    python benchmarks/bench_gpt.py --only sim real1 --device cuda   # one GPU, NCCL

The model is ``_gpt.py``'s (d=64, 2 blocks, 4 heads, vocab 256, 8 x 32 tokens by default). One
step is forward + backward + ``torch.optim.AdamW.step()``, eager, one torch thread per process.
Cases (baseline first, both in the same process, rounds interleaved):

* ``sim``: in this process, the dense single-device step; named_spmd on a simulated (1,1) mesh
  and on a simulated (2,2) mesh (the same global batch and parameters); and what plain nested
  vmap costs: the (2,2) per-instance program under two plain ``torch.func.vmap``s (tp
  outermost, as the simulated mesh nests them here, and dp outermost) with its collectives left
  out and no types (``vmap_floor_step``; timed only: without its collectives it computes other
  numbers). The row "named_spmd (2, 2) / nested vmap tp outermost" is the (2, 2) step over the
  tp-outermost floor, the median of the two timings' ratio in each round (the target's row).
* ``real1``: 1 gloo process, mesh (1,1): the dense step; named_spmd with DTensor parameters;
  named_spmd with plain parameters (global tensors, as a simulated mesh takes them: a target's
  row, against the dense step); the dense step on the same DTensor parameters without named_spmd
  (``ns.to_local`` and AdamW on DTensors: what DTensor parameters cost by themselves), and the
  row ``ON_DTENSORS``: named_spmd's step over that one, both on DTensor parameters (the other
  target); the dense step running the per-device program's ops (each output projection's
  product, then its bias, as the row-parallel linear computes them: ``_gpt.unfused_linear``),
  and the row ``ON_PROGRAM``: named_spmd's step (plain parameters) over that one, what
  named_spmd costs beside the program it runs.
* ``dp2``: 2 gloo processes, mesh (dp=2, tp=1): ``DistributedDataParallel`` on the nn.Module;
  named_spmd with DTensor parameters (the target's row) and with plain parameters; and with the
  loss left unreduced over dp (each rank's share, ``out_specs=P(unreduced={"dp"})``): DDP's
  program, which runs no collective in the forward, where the target's step takes the
  global mean there (``ns.pmean``, one more round of the ranks per step).
* ``tp4``: 4 gloo processes, mesh (dp=2, tp=2): torch's DTensor tensor parallelism
  (``parallelize_module`` with ColwiseParallel / RowwiseParallel, a vocab-parallel LM head with
  ``loss_parallel``) plus data parallelism by DDP's schedule (each gradient's all-reduce over dp
  started from a post-accumulate-grad hook, waited after backward); named_spmd.

Every real case also runs named_spmd's ``.local`` on this rank's blocks (the parameters' as
plain tensors from ``ns.shard(..., blocks=True)``, the batch's): no DTensor anywhere.

Before timing, every variant (but the nested-vmap references) trains ``--check-steps`` steps in
float64 from the same parameters and batches as the dense model: the losses and the final parameters must equal the dense run's
(to 1e-9), or the script exits with an error. Timings are the median over rounds (of the slowest
rank, each round timing ``--steps`` steps between barriers), as wall clock (the targets) and as
CPU time of the process (rows "..., CPU time": steadier on a shared machine, but blind to time
spent waiting for peers).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import statistics
import sys
import time
import warnings
from typing import Any

import _gpt as G
import _util
import torch
import torch.distributed as dist
import torch.nn.functional as F

import named_spmd as ns

BENCH = "bench_gpt"
VMAP_FLOOR = "nested vmap (2, 2), tp outermost, no collectives, untyped"
VMAP_FLOOR_DP_OUTER = "nested vmap (2, 2), dp outermost, no collectives, untyped"
VMAP_ONE_LEVEL = "one vmap over the 4 instances, no collectives, untyped"
TOL = 1e-9  # float64: the sharded programs differ from the dense one by summation order only


# --- one training step per variant -----------------------------------------------------------------


def _fresh(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone().requires_grad_() for k, v in params.items()}


def trainer(loss_of, params: dict, *, wait=None, context=contextlib.nullcontext):
    """``step(tokens, targets) -> loss`` (detached): forward and backward under ``context()``,
    then ``wait()`` (a data-parallel reduction still in flight), then the AdamW step."""
    # foreach: one call per update op over all parameters. On CPU torch defaults to one call
    # per parameter, which costs DTensor parameters (named_spmd's and DTensor TP's) about 3x
    # the whole update in DTensor dispatch; plain tensors take either at about the same speed.
    # One group per kind: foreach refuses to mix DTensors (DTensor TP's sharded weights) with
    # plain tensors (its replicated ones) in one call.
    kinds: dict[bool, list] = {}
    for p in params.values():
        kinds.setdefault(hasattr(p, "placements"), []).append(p)
    opt = torch.optim.AdamW([{"params": ps} for ps in kinds.values()], lr=1e-2, foreach=True)

    def step(tokens, targets):
        with context():
            loss = loss_of(tokens, targets, params)
            loss.backward()
        if wait is not None:
            wait()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def dense_step(cfg: G.Config, params: dict, row_linear=F.linear):
    p = _fresh(params)
    return trainer(G.dense_loss(cfg, row_linear), p), p


def spmd_step(cfg: G.Config, mesh, params: dict, dtensors: bool = True, reduced: bool = True):
    """named_spmd's step; on a real mesh the parameters are DTensors laid out by their specs
    (``dtensors=False``: plain tensors, the global value on every rank, as a simulated mesh
    takes them; their gradients are then gathered, free where every axis has size 1).
    ``reduced=False``: the loss left unreduced over dp (``_gpt.spmd_loss``), as DDP's is."""
    f = G.spmd_step_fn(cfg, mesh, reduced=reduced)
    if getattr(mesh, "device_mesh", None) is not None:
        if dtensors:
            p = _distribute(params, G.param_specs(cfg), mesh.device_mesh)
        else:
            p = _fresh(params)
        return trainer(lambda tok, tgt, q: ns.to_local(f(tok, tgt, q)), p), p
    p = _fresh(params)
    return trainer(f, p), p


def vmap_floor_step(
    cfg: G.Config, params: dict, dp: int, tp: int, tp_outermost: bool | None = True
):
    """A reference for any simulation by nested ``torch.func.vmap``: the per-instance program of
    the (dp, tp) step (the blocks of the tensor-parallel parameters, the dp shard of the batch)
    under two plain vmaps, with every collective left out (a psum or pmax taken as the identity)
    and no types. What vmap alone costs this program. ``tp_outermost``: the nesting the
    simulated mesh picks for this model (the axis with the most replicated bytes innermost).
    Not a strict floor: the simulated mesh runs what follows a psum over tp unbatched over tp,
    while here the residual stream stays batched over both axes. ``tp_outermost=None``: one vmap
    over the dp x tp instances (each instance's inputs gathered onto one dim), what a simulation
    with one vmap level for the whole mesh would start from."""
    from torch.func import vmap

    specs = G.param_specs(cfg)

    def row_linear(a, w, b):
        return F.linear(a, w) + b  # the psum over tp left out

    def instance_loss(tokens, targets, q, tp_index):
        logits = F.linear(G._trunk(tokens, q, cfg, row_linear), q["lm_head.weight"])
        return _vocab_cross_entropy_ops(logits, targets, tp_index)

    def split(v, spec):
        """``v`` with its tp blocks stacked on a new dim 0 (for vmap), or ``v`` if not split."""
        for d, name in enumerate(spec):
            if name == "tp":
                return v.unflatten(d, (tp, -1)).movedim(d, 0), 0
        return v, None

    def loss(tokens, targets, p):
        q, dims = {}, {}
        for k, v in p.items():
            q[k], dims[k] = split(v, specs[k])
        batch = (tokens.unflatten(0, (dp, -1)), targets.unflatten(0, (dp, -1)))
        over_tp, over_dp = (None, None, dims, 0), (0, 0, None, None)
        if tp_outermost is None:  # instance i = (i // tp, i % tp): a gather onto one dim
            on_dp, on_tp = torch.arange(dp * tp) // tp, torch.arange(dp * tp) % tp
            flat = {k: v if dims[k] is None else v.index_select(0, on_tp) for k, v in q.items()}
            per_instance = vmap(instance_loss, in_dims=(0, 0, dims, 0))
            return per_instance(*(b.index_select(0, on_dp) for b in batch), flat, on_tp).mean()
        if tp_outermost:
            per_instance = vmap(vmap(instance_loss, in_dims=over_dp), in_dims=over_tp)
        else:
            per_instance = vmap(vmap(instance_loss, in_dims=over_tp), in_dims=over_dp)
        return per_instance(*batch, q, torch.arange(tp)).mean()

    p = _fresh(params)
    return trainer(loss, p), p


def _vocab_cross_entropy_ops(logits, targets, tp_index):
    """``ns.parallel.vocab_cross_entropy``'s ops on this instance's classes, without its pmax
    and psums over tp."""
    classes = logits.shape[-1]
    shifted = logits - logits.detach().amax(-1).unsqueeze(-1)
    log_sum_exp = shifted.exp().sum(-1).log()
    local = targets - tp_index * classes
    mine = (local >= 0) & (local < classes)
    picked = shifted.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)
    counted = targets != -100
    per_token = torch.where(counted, log_sum_exp - torch.where(mine, picked, 0), 0)
    return per_token.sum() / counted.sum()


def spmd_local_step(cfg: G.Config, mesh, params: dict):
    """named_spmd's step called with this rank's blocks (``.local``): the parameters' blocks as
    plain tensors (``ns.shard(..., blocks=True)``), the batch's. Returned with the parameters
    viewed as DTensors sharing the blocks' storage (for ``check``'s global comparison only)."""
    from torch.distributed.tensor import DTensor

    f = G.spmd_step_fn(cfg, mesh)
    specs = G.param_specs(cfg)
    p = ns.shard(_fresh(params), mesh, specs, blocks=True)
    dp, rank = mesh.shape["dp"], mesh.my_coords["dp"]
    step = trainer(lambda tok, tgt, q: f.local(*_local_batch(tok, tgt, rank, dp), q), p)
    dm, names = mesh.device_mesh, mesh.axis_names
    views = {
        k: DTensor.from_local(v.detach(), dm, _placements(specs[k], names), run_check=False)
        for k, v in p.items()
    }
    return step, views


def dense_dtensor_step(cfg: G.Config, mesh, params: dict):
    """The dense step on the DTensor parameters of a mesh whose axes all have size 1 (each
    local tensor is the whole parameter): what DTensor parameters cost without named_spmd, the
    conversion to local tensors (``ns.to_local``, the call's own) and AdamW on DTensors."""
    p = _distribute(params, G.param_specs(cfg), mesh.device_mesh)
    loss = G.dense_loss(cfg)
    return trainer(lambda tok, tgt, q: loss(tok, tgt, ns.to_local(q)), p), p


def _placements(spec, axis_names):
    from torch.distributed.tensor import Replicate, Shard

    dims = {name: i for i, name in enumerate(spec) if name is not None}
    return [Shard(dims[a]) if a in dims else Replicate() for a in axis_names]


def _distribute(params: dict, specs: dict, device_mesh, replicated_plain: bool = False) -> dict:
    """DTensors laid out by ``specs``; ``replicated_plain``: a parameter that no axis splits
    stays a plain tensor (as ``parallelize_module`` leaves the replicated ones), which
    named_spmd takes as the whole value on every rank, with no DTensor conversion."""
    from torch.distributed.tensor import distribute_tensor

    names = device_mesh.mesh_dim_names
    out = {}
    for k, v in params.items():
        if replicated_plain and not specs[k].axes:
            out[k] = v.detach().clone().requires_grad_()
        else:
            places = _placements(specs[k], names)
            out[k] = distribute_tensor(v.detach().clone(), device_mesh, places).requires_grad_()
    return out


def _local_batch(tokens, targets, rank: int, dp: int):
    b = tokens.shape[0] // dp
    return tokens[rank * b : (rank + 1) * b], targets[rank * b : (rank + 1) * b]


def ddp_step(cfg: G.Config, params: dict, rank: int, dp: int):
    """DistributedDataParallel on the nn.Module; the full global batch in, this rank's half used."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(G.module(cfg, params))

    def loss_of(tokens, targets, _):
        tok, tgt = _local_batch(tokens, targets, rank, dp)
        return F.cross_entropy(model(tok).flatten(0, 1), tgt.flatten())

    return trainer(loss_of, dict(model.module.named_parameters())), model.module


def dtensor_tp_step(cfg: G.Config, params: dict, device_mesh, compile_options=None):
    """torch's own tensor parallelism on the nn.Module over tp, data parallel over dp by hooks;
    ``compile_options``: the parallelized module run through ``torch.compile(**options)``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    model = G.module(cfg, params)
    plan: dict = {"lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)}
    for i in range(cfg.layers):
        plan |= {f"blocks.{i}.{n}": ColwiseParallel() for n in ("q", "k", "v", "fc1")}
        plan |= {f"blocks.{i}.{n}": RowwiseParallel() for n in ("o", "fc2")}
    parallelize_module(model, device_mesh["tp"], plan)
    dp_group, dp = device_mesh.get_group("dp"), device_mesh.size(0)
    rank = device_mesh.get_local_rank("dp")
    works: list = []

    def reduce_when_ready(p):  # DDP's schedule: all-reduce each gradient as soon as it is whole
        g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
        works.append(dist.all_reduce(g, group=dp_group, async_op=True))

    named = dict(model.named_parameters())
    for p in named.values():
        p.register_post_accumulate_grad_hook(reduce_when_ready)
    run = model if compile_options is None else torch.compile(model, **compile_options)

    def loss_of(tokens, targets, _):  # this rank's share of the global mean
        tok, tgt = _local_batch(tokens, targets, rank, dp)
        return F.cross_entropy(run(tok).flatten(0, 1), tgt.flatten()) / dp

    def wait():
        for w in works:
            w.wait()
        works.clear()

    # loss_parallel: the cross entropy of vocab-sharded logits, backward included
    return trainer(loss_of, named, wait=wait, context=loss_parallel), model


# --- correctness, then timing --------------------------------------------------------------------------


def _global(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def summed_over_ranks(copies: int):
    """The global loss from per-rank losses: their sum over every rank, divided by ``copies``
    (how many times the sum counts the global mean)."""

    def reduce(loss):
        total = _global(loss).clone()
        dist.all_reduce(total)
        return total / copies

    return reduce


def check(cfg: G.Config, make, steps: int, name: str, reduce_loss=_global) -> float:
    """Train ``steps`` float64 steps with the dense model and with ``make(params)`` -> (step,
    params); the largest difference of the (global) losses and the final parameters. Exits if
    it is above TOL."""
    params = G.init_params(cfg, 0, torch.float64)
    ref_step, ref_p = dense_step(cfg, params)
    step, p = make(params)
    p = dict(p.named_parameters()) if isinstance(p, torch.nn.Module) else p
    err = 0.0
    for s in range(steps):
        tok, tgt = G.batch(cfg, s)
        err = max(err, (reduce_loss(step(tok, tgt)) - ref_step(tok, tgt)).abs().item())
    for k, v in ref_p.items():
        err = max(err, (_global(p[k].detach()) - v.detach()).abs().max().item())
    if not err <= TOL:
        raise SystemExit(f"{name}: differs from the dense model by {err:.2e} after {steps} steps")
    return err


def timer_steps(step, cfg: G.Config, number: int):
    tok, tgt = G.batch(cfg, 0)

    def run():
        for _ in range(number):
            step(tok, tgt)

    return run


def interleaved(
    fns: dict, rounds: int, steps: int, baseline: str | None = None
) -> dict[str, dict[str, Any]]:
    """Seconds per step, wall clock and this process's CPU time: the median over rounds of the
    slowest rank, each round timing ``steps`` steps (between barriers on a real mesh), in a
    shuffled order (the same on every rank). CPU time moves less than the wall clock when
    other work shares the machine, but leaves out time spent waiting for peers. With a
    ``baseline``, also ``"paired wall"`` and ``"paired cpu"``: each variant's median ratio to it
    within a round, with a 95% interval (``_util.paired_ratio``)."""
    distributed = dist.is_initialized()
    for fn in fns.values():
        fn()  # warm up
    samples: dict[str, list[tuple[float, float]]] = {name: [] for name in fns}
    gc.disable()  # collections land at random points and blur the medians
    try:
        for r in range(rounds):
            order = list(fns)
            random.Random(r).shuffle(order)
            for name in order:
                if distributed:
                    dist.barrier()
                t0, c0 = time.perf_counter(), time.process_time()
                fns[name]()
                if torch.cuda.is_initialized():
                    torch.cuda.synchronize()  # the step's kernels, not only their launches
                samples[name].append((time.perf_counter() - t0, time.process_time() - c0))
            gc.collect()
    finally:
        gc.enable()
    out: dict[str, dict[str, Any]] = {"wall": {}, "cpu": {}}
    rounds_of: dict[str, dict[str, list[float]]] = {"wall": {}, "cpu": {}}
    for name, s in samples.items():
        t = torch.tensor(s, dtype=torch.float64)
        if distributed:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        for column, clock in enumerate(("wall", "cpu")):
            rounds_of[clock][name] = t[:, column].tolist()
            out[clock][name] = statistics.median(rounds_of[clock][name]) / steps
    if baseline is not None:
        for clock, times in rounds_of.items():
            out["paired " + clock] = {
                name: _util.paired_ratio(t, times[baseline])
                for name, t in times.items()
                if name != baseline
            }
    return out


def rows(
    case: str,
    medians: dict,
    baseline: str,
    targets: dict[str, str],
    versus: tuple = (),
    bench: str = BENCH,
) -> list[_util.Row]:
    """The wall-clock rows (with the targets), then the CPU-time rows of the same runs. Each
    ``(row, variant, against, target)`` of ``versus`` adds a row ``variant``'s time over
    ``against``'s (with ``target`` among the wall-clock rows), where both were timed."""
    wall = _util.rows_with_ratios(bench, case, medians["wall"], baseline, targets)
    cpu = _util.rows_with_ratios(bench, case + ", CPU time", medians["cpu"], baseline, {})
    for name, times, table, with_target in (
        (case, medians["wall"], wall, True),
        (case + ", CPU time", medians["cpu"], cpu, False),
    ):
        for row, variant, against, target in versus:
            if variant in times and against in times:
                ratio = times[variant] / times[against]
                text = target if with_target else ""
                table.append(_util.Row(bench, name, row, times[variant], against, ratio, text))
    return wall + cpu


# --- the cases --------------------------------------------------------------------------------------


def simulated(cfg: G.Config, args) -> list[_util.Row]:
    meshes = {s: ns.make_mesh(s, ("dp", "tp"), simulated=True) for s in ((1, 1), (2, 2))}
    for s, mesh in meshes.items():
        err = check(cfg, lambda p, m=mesh: spmd_step(cfg, m, p), args.check_steps, f"sim {s}")
        print(f"simulated {s}: equal to the dense model to {err:.1e} (float64)", flush=True)
    params = G.init_params(cfg, 0)
    fns = {"dense single device": dense_step(cfg, params)[0]}
    for s, mesh in meshes.items():
        fns[f"named_spmd simulated {s}"] = spmd_step(cfg, mesh, params)[0]
    with warnings.catch_warnings():
        # torch 2.13 has no vmap rule for CPU flash attention: a per-instance loop, for the floor
        # as for the simulated mesh; said once per process, it is no error of this benchmark
        warnings.filterwarnings("ignore", "There is a performance drop because we have not yet")
        for name, tp_outermost in (
            (VMAP_FLOOR, True),
            (VMAP_FLOOR_DP_OUTER, False),
            (VMAP_ONE_LEVEL, None),
        ):
            fns[name] = vmap_floor_step(cfg, params, 2, 2, tp_outermost)[0]
            fns[name](*G.batch(cfg, 0))
    medians = interleaved(
        {k: timer_steps(f, cfg, args.steps) for k, f in fns.items()},
        args.rounds,
        args.steps,
        baseline=VMAP_FLOOR,
    )
    targets = {"named_spmd simulated (1, 1)": "<= 1.15x", "named_spmd simulated (2, 2)": "<= 1.5x"}
    out = rows("simulated, 1 process", medians, "dense single device", targets)
    # the (2, 2) target against the floor: the ratio of the two timings of each round, paired
    spmd = "named_spmd simulated (2, 2)"
    ratio = medians["paired wall"][spmd][0]
    floor = _util.Row(
        BENCH,
        "simulated, 1 process",
        FLOOR_ROW,
        medians["wall"][spmd],
        VMAP_FLOOR,
        ratio,
        "<= 1.10x",
    )
    out.insert(len(fns), floor)  # after the wall-clock rows
    return out


FLOOR_ROW = "named_spmd (2, 2) / nested vmap tp outermost"


def worker(args) -> None:
    torch.set_num_threads(1)
    _util.use_device(args.device)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    cfg = _config(args)
    shape = {1: (1, 1), 2: (2, 1), 4: (2, 2)}[world]
    mesh = ns.make_mesh(shape, ("dp", "tp"))
    baseline, make_base, reduce_loss = {
        1: ("dense single device", lambda p: dense_step(cfg, p), _global),
        2: ("DistributedDataParallel", lambda p: ddp_step(cfg, p, rank, 2), summed_over_ranks(2)),
        4: (
            "DTensor TP + DDP-style dp",
            lambda p: dtensor_tp_step(cfg, p, mesh.device_mesh),
            summed_over_ranks(2),  # each rank holds its dp share; the 2 tp ranks count it twice
        ),
    }[world]
    makers = {
        baseline: make_base,
        "named_spmd": lambda p: spmd_step(cfg, mesh, p),
        LOCAL_BLOCKS: lambda p: spmd_local_step(cfg, mesh, p),
    }
    # where the time goes: named_spmd without DTensor parameters (every parameter's blocks are
    # whole where tp has size 1), and DTensor parameters without named_spmd
    if world <= 2:
        makers[PLAIN_PARAMS] = lambda p: spmd_step(cfg, mesh, p, dtensors=False)
    if world == 1:
        makers[DENSE_ON_DTENSORS] = lambda p: dense_dtensor_step(cfg, mesh, p)
        # the dense step running the per-device program's ops (the output projections'
        # product, then their bias): what the program costs, named_spmd aside
        makers[DENSE_PROGRAM] = lambda p: dense_step(cfg, p, G.unfused_linear)
    # the program DDP runs: no collective for the loss in the forward
    reduces = {baseline: reduce_loss}
    if world == 2:
        makers[UNREDUCED] = lambda p: spmd_step(cfg, mesh, p, reduced=False)
        reduces[UNREDUCED] = summed_over_ranks(1)
    errs = {
        name: check(cfg, make, args.check_steps, name, reduces.get(name, _global))
        for name, make in makers.items()
    }
    params = G.init_params(cfg, 0)
    fns = {name: timer_steps(make(params)[0], cfg, args.steps) for name, make in makers.items()}
    medians = interleaved(fns, args.rounds, args.steps)
    if rank == 0:
        print("RESULT " + json.dumps({"medians": medians, "errors": errs}), flush=True)
    dist.destroy_process_group()


PLAIN_PARAMS = "named_spmd, plain parameters"
UNREDUCED = "named_spmd, loss unreduced over dp"
LOCAL_BLOCKS = "named_spmd, local blocks (.local)"
DENSE_ON_DTENSORS = "dense step on DTensor parameters"
#: named_spmd's step against the dense step, both on DTensor parameters (``real1``)
ON_DTENSORS = "named_spmd / dense, both on DTensors"
DENSE_PROGRAM = "dense step, the program's ops"
#: named_spmd's step (plain parameters) over the dense step running the same ops (``real1``)
ON_PROGRAM = "named_spmd, plain parameters / dense, the program's ops"

# case -> (processes, the case's name, {variant: target against the baseline}, rows of one
# variant against another: (row, variant, against, target))
_REAL: dict[str, tuple[int, str, dict[str, str], tuple]] = {
    "real1": (
        1,
        "(1,1), 1 gloo process",
        {PLAIN_PARAMS: "<= 1.05x"},
        (
            (ON_DTENSORS, "named_spmd", DENSE_ON_DTENSORS, "<= 1.05x"),
            (ON_PROGRAM, PLAIN_PARAMS, DENSE_PROGRAM, ""),
        ),
    ),
    "dp2": (2, "dp=2, 2 gloo processes", {"named_spmd": "<= 1.05x"}, ()),
    "tp4": (4, "(2,2), 4 gloo processes", {"named_spmd": "<= 0.5x"}, ()),
}


def real(name: str, args) -> list[_util.Row]:
    nproc, case, targets, versus = _REAL[name]
    if args.device == "cuda":
        case = case.replace("gloo", "NCCL")
    out = _util.spawn(__file__, nproc, sys.argv[1:], args.timeout)
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(out[-4000:])
    result = json.loads(line[len("RESULT ") :])
    for variant, err in result["errors"].items():
        print(f"{case}: {variant} equal to the dense model to {err:.1e} (float64)", flush=True)
    medians = result["medians"]
    baseline = next(iter(medians["wall"]))  # the worker's first variant
    return rows(case, medians, baseline, targets, versus)


def _config(args) -> G.Config:
    return G.Config(d=args.d, layers=args.layers, heads=args.heads, batch=args.batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--only", nargs="+", default=["sim", *_REAL])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=5, help="steps per timed round")
    parser.add_argument("--check-steps", type=int, default=3)
    parser.add_argument("--d", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per process"
    )
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args()
    if args.rounds is None:
        args.rounds = 5 if args.quick else 15
    if "RANK" in os.environ:
        worker(args)
        return
    torch.set_num_threads(1)
    _util.use_device(args.device)
    cfg = _config(args)
    print(f"GPT {cfg} on {args.device}: forward + backward + AdamW, eager, 1 thread per process")
    rows: list[_util.Row] = []
    if "sim" in args.only:
        rows += simulated(cfg, args)
    for name in _REAL:
        if name in args.only:
            rows += real(name, args)
    _util.print_rows(rows)
    _util.write_markdown(args.markdown, rows)


if __name__ == "__main__":
    main()
