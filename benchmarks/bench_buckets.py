"""Bucketed gradient psums: a data-parallel GPT step, named_spmd against DistributedDataParallel.

    python benchmarks/bench_buckets.py                   # d = 32 and 128, 2 gloo processes
    python benchmarks/bench_buckets.py --d 64 --rounds 5 --markdown FILE

The model is ``_gpt.py``'s small GPT (2 blocks, 37 parameter tensors) on a dp=2 mesh: one
step is forward + backward + ``AdamW.step()`` (foreach), eager, one torch thread per process,
parameters as plain replicated tensors (the same tensors for every variant; no DTensor dispatch in
the optimizer). Variants, timed in the same process group, rounds interleaved in a shuffled
order, each round ``--steps`` steps between barriers, the median over rounds of the slowest rank,
in wall-clock time and in the process's CPU time (the second moves less on a loaded machine):

* ``DistributedDataParallel``: the nn.Module under DDP (25 MB buckets, 1 MB first bucket).
* ``named_spmd, per gradient``: ``ns.set_grad_bucket_mb(0)``, one all-reduce per parameter
  (what the library did before buckets).
* ``named_spmd, 25 MB buckets``: the default.
* ``named_spmd, 25 MB buckets, local loss``: each instance returns its share of the loss
  (out_specs ``P("dp")``) instead of the global mean by a pmean: no forward collective, as in
  DDP's step (the same gradients).
* ``named_spmd, 1 MB buckets`` (with ``--small-buckets``).

Before timing, each variant trains ``--check-steps`` float64 steps from the same parameters and
batches: its losses and final parameters must equal DDP's (to 1e-9), or the script exits.
"""

from __future__ import annotations

import argparse
import json
import os

import _gpt as G
import _util
import bench_gpt as B
import torch
import torch.distributed as dist
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

BENCH = "bench_buckets"
TOL = 1e-9
DDP_NAME = "DistributedDataParallel"
LOCAL = "named_spmd, 25 MB buckets, local loss"


def _trainer(loss_of, params: list[torch.Tensor], bucket_mb=None):
    opt = torch.optim.AdamW(params, lr=1e-2, foreach=True)

    def step(tokens, targets):
        ns.set_grad_bucket_mb(
            bucket_mb
        )  # a global setting: each variant sets its own before its step
        loss = loss_of(tokens, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def spmd_step(cfg: G.Config, mesh, params: dict, bucket_mb, local_loss: bool = False):
    """Data parallel: the dense model per instance on its half of the batch; every parameter
    replicated (P()), so its gradient psum is the implicit pvary's. The loss is the global mean
    (one pmean in forward), or with ``local_loss`` each instance's share of it, returned per
    instance (out_specs P("dp")): no forward collective, as DDP's step, same gradients."""
    dense = G.dense_loss(cfg)

    def per_device(tok, tgt, p):
        if local_loss:
            return (dense(tok, tgt, p) / ns.axis_size("dp")).reshape(1)
        return ns.pmean(dense(tok, tgt, p), "dp")

    out = P("dp") if local_loss else P()
    f = ns.spmd_map(per_device, mesh=mesh, in_specs=(P("dp"), P("dp"), P()), out_specs=out)
    p = {k: v.detach().clone().requires_grad_() for k, v in params.items()}

    def loss_of(tok, tgt):
        loss = ns.to_local(f(tok, tgt, p))
        return loss.sum() if local_loss else loss  # local: this rank's share of the mean

    return _trainer(loss_of, list(p.values()), bucket_mb), p


def ddp_step(cfg: G.Config, params: dict, rank: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(G.module(cfg, params))
    b = cfg.batch // 2

    def loss_of(tok, tgt):  # this rank's half of the global batch; DDP averages the gradients
        tok, tgt = tok[rank * b : (rank + 1) * b], tgt[rank * b : (rank + 1) * b]
        return F.cross_entropy(model(tok).flatten(0, 1), tgt.flatten())

    return _trainer(loss_of, list(model.module.parameters())), dict(model.module.named_parameters())


def _variants(cfg, mesh, rank, small: bool) -> dict:
    """name -> make(params) -> (step, params dict)."""
    out = {
        DDP_NAME: lambda p: ddp_step(cfg, p, rank),
        "named_spmd, per gradient": lambda p: spmd_step(cfg, mesh, p, 0),
        "named_spmd, 25 MB buckets": lambda p: spmd_step(cfg, mesh, p, 25),
        LOCAL: lambda p: spmd_step(cfg, mesh, p, 25, local_loss=True),
    }
    if small:
        out["named_spmd, 1 MB buckets"] = lambda p: spmd_step(cfg, mesh, p, 1)
    return out


def _global_loss(name: str, loss: torch.Tensor) -> float:
    """The global mean loss: DDP's and the local-loss variant's are per rank (DDP's this
    rank's mean, the other its share of the global mean)."""
    if name in (DDP_NAME, LOCAL):
        loss = loss.clone()
        dist.all_reduce(loss)
        loss = loss / 2 if name == DDP_NAME else loss
    return loss.item()


def check(cfg, variants: dict, steps: int) -> float:
    """float64: every variant's losses (summed over ranks: DDP's are per rank) and parameters
    against DDP's; exits above TOL."""
    params = G.init_params(cfg, 0, torch.float64)
    runs = {name: make(params) for name, make in variants.items()}
    losses: dict[str, list[float]] = {name: [] for name in runs}
    for s in range(steps):
        tok, tgt = G.batch(cfg, s)
        for name, (step, _) in runs.items():
            losses[name].append(_global_loss(name, step(tok, tgt)))
    ref_losses, ref_params = losses[DDP_NAME], runs[DDP_NAME][1]
    err = 0.0
    for name, (_, p) in runs.items():
        err = max(err, *(abs(a - b) for a, b in zip(losses[name], ref_losses)))
        for k, v in ref_params.items():
            err = max(err, (p[k].detach() - v.detach()).abs().max().item())
    if not err <= TOL:
        raise SystemExit(f"a variant differs from DDP by {err:.2e} after {steps} steps")
    return err


def worker(args) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = G.Config(d=args.d, heads=4, layers=2, batch=8)
    mesh = ns.make_mesh((2,), ("dp",))
    variants = _variants(cfg, mesh, rank, args.small_buckets)
    err = check(cfg, variants, args.check_steps)
    params = G.init_params(cfg, 0)
    tok, tgt = G.batch(cfg, 0)
    fns = {}
    for name, make in variants.items():
        step = make(params)[0]
        fns[name] = lambda step=step: [step(tok, tgt) for _ in range(args.steps)]
    timed = B.interleaved(fns, args.rounds, args.steps)
    medians, cpu = timed["wall"], timed["cpu"]
    ns.set_grad_bucket_mb(None)
    if rank == 0:
        print("RESULT " + json.dumps({"medians": medians, "cpu": cpu, "error": err}), flush=True)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--d", type=int, nargs="+", default=[32, 128], help="model widths")
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=5, help="steps per round")
    parser.add_argument("--check-steps", type=int, default=2)
    parser.add_argument("--small-buckets", action="store_true", help="also 1 MB buckets")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--markdown", default=None, help="also write the table here")
    args = parser.parse_args()
    if "RANK" in os.environ:
        args.d = args.d[0]
        worker(args)
        return
    rows: list[_util.Row] = []
    for d in args.d:
        argv = ["--d", str(d), "--rounds", str(args.rounds), "--steps", str(args.steps)]
        argv += ["--check-steps", str(args.check_steps)] + ["--small-buckets"] * args.small_buckets
        out = _util.spawn(__file__, 2, argv, args.timeout)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(out[-4000:])
        result = json.loads(line[len("RESULT ") :])
        case = f"GPT d={d}, dp=2, 2 gloo processes"
        print(f"{case}: every variant equal to DDP to {result['error']:.1e} (float64)")
        targets = {"named_spmd, 25 MB buckets": "<= 1.05x", LOCAL: "<= 1.05x"}
        rows += _util.rows_with_ratios(BENCH, case, result["medians"], DDP_NAME, targets)
        rows += _util.rows_with_ratios(BENCH, case + ", CPU time", result["cpu"], DDP_NAME, {})
    _util.print_rows(rows)
    _util.write_markdown(args.markdown, rows)


if __name__ == "__main__":
    main()
