"""spmd_map on real processes versus hand-written torch.distributed code doing the same work.

    python benchmarks/bench_distributed.py                  # 4 gloo processes on 127.0.0.1
    python benchmarks/bench_distributed.py --sizes 256 1024 4096 --rounds 15
    python benchmarks/bench_distributed.py --device cuda --backend nccl --nproc 4
    python benchmarks/bench_distributed.py --only ring

Six measurements, printed by rank 0:

1. A Megatron-style MLP forward + backward step on a (dp=2, tp=nproc/2) mesh: column-parallel
   ``w1``/``b1``, row-parallel ``w2``, replicated ``b2``, batch split over dp; parameters and the
   activation are DTensors (no gathering at the boundary). The hand-written baseline runs the same
   collectives the way Megatron-LM does: an identity/all-reduce autograd pair over tp, and an
   in-place all-reduce of each parameter's gradient over dp after backward. A second baseline,
   "overlapped", starts each dp all-reduce as soon as its gradient is accumulated (DDP's
   schedule, which spmd_map follows) and waits after backward. Reported: median step time of
   each (rounds interleaved, each step timed between barriers, slowest rank) and the ratios.
2. Latency of one collective: ``ns.psum`` inside spmd_map versus ``dist.all_reduce`` on a small
   and a 4 MB tensor (median per call); and collectives of a pytree (``--only tree``):
   ``ns.pmean`` of gradients (30 of [64, 64], 8 of [512, 512]) and ``ns.all_gather`` of 30
   parameter blocks versus one collective per leaf and one of their concatenation.
3. A ring of ppermutes (nproc - 1 hops, as ring attention passes its key blocks): ``ns.ppermute``
   inside spmd_map (one ``all_to_all_single`` with one non-empty split each way, so its waits
   can be polled) versus the same hops hand-written with ``dist.batch_isend_irecv`` and with
   ``dist.all_to_all_single`` (median per ring, ratio to the send/recv ring).
4. One ``ns.ragged_all_to_all`` of runs of rows of random lengths, the routing known to every
   rank, versus the same by hand: one ``all_to_all_single`` with split sizes, the rows placed
   at their offsets; and by hand with the sizes and offsets exchanged first (the program where
   only the senders know them), and an empty spmd_map call on the same inputs (the floor):
   median per call and the CPU time of the ranks together (``--only ragged``); here and in 5.,
   the process-group calls one call makes on rank 0, spmd_map's and the hand-written one's.
5. A stencil step (tutorial 12's heat equation, forward, ``--stencil-steps`` steps per call) on
   a grid whose rows do not divide by the ranks (and one that does), halos by two
   ``ns.ppermute`` per step, versus the same by hand with one ``dist.batch_isend_irecv`` per
   step (``--only stencil``).
6. vma tracking: a 200-op small-tensor function inside spmd_map versus the same ops on plain
   tensors. On a mesh of every rank (``--only replay``): the CPU time per op of a replayed and
   of a typed call, and each one's fixed cost. In a single process (mesh of one): extra
   microseconds per op, every call typed (``named_spmd._replay.ENABLED`` off: on a mesh of one
   instance calls are otherwise typed once per signature and replayed untyped, the second
   figure). For scale, the same ops under a bare ``TorchFunctionMode`` and on DTensors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import named_spmd as ns
from named_spmd import P, _replay

# --- launching ------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn(argv: list[str], nproc: int, timeout: float) -> str:
    """Run this script as ``nproc`` ranks on 127.0.0.1 (the store lives here, as with torchrun's
    agent); returns rank 0's output."""
    port = _free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    procs = []
    for rank in range(nproc):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            TORCHELASTIC_USE_AGENT_STORE="True",
            GLOO_SOCKET_IFNAME="lo",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, *argv],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        del store
    if any(p.returncode for p in procs):
        bad = next(i for i, p in enumerate(procs) if p.returncode)
        raise SystemExit(f"rank {bad} failed:\n{outs[bad][-4000:]}")
    return outs[0]


# --- process-group calls --------------------------------------------------------------------------
# Every collective costs the ranks a round of scheduling (on gloo over a shared machine, more than
# its bytes): each uneven row reports how many process-group calls one call makes on rank 0.

_PG_CALLS: dict[str, int] = {}
_PG_METHODS = (
    "allreduce",
    "all_to_all_single",
    "alltoall_base",
    "all_gather_single",
    "allgather",
    "reduce_scatter_single",
    "broadcast",
    "send",
    "recv",
)


def count_process_group_calls() -> None:
    """Count the calls of the process-group methods (installed before any mesh binds them)."""
    for name in _PG_METHODS:
        method = getattr(dist.ProcessGroup, name, None)
        if method is None:
            continue

        def counted(self, *args, _method=method, _name=name, **kwargs):
            _PG_CALLS[_name] = _PG_CALLS.get(_name, 0) + 1
            return _method(self, *args, **kwargs)

        setattr(dist.ProcessGroup, name, counted)


def process_group_calls(fn) -> str:
    """The process-group calls one call of ``fn`` makes on this rank, e.g. ``allreduce 1,
    all_to_all_single 2`` (the ranks in step after: a barrier)."""
    _PG_CALLS.clear()
    fn()
    got = ", ".join(f"{name} {n}" for name, n in sorted(_PG_CALLS.items()))
    dist.barrier()
    return got


# --- timing across ranks --------------------------------------------------------------------------


def _timed(fn, device) -> float:
    dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0


def interleaved(fns: dict, rounds: int, warmup: int, device, cpu: bool = False) -> dict[str, float]:
    """Median over rounds of each function's time (slowest rank), rounds interleaved
    in a shuffled order. ``cpu``: also, as ``"<name> cpu"``, the median of the CPU time the
    ranks spent in it together (all ranks share the machine's cores: on a loaded machine the
    wall clock is mostly waiting for a core, the CPU time less so)."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    samples: dict[str, list] = {name: [] for name in fns}
    cpu_samples: dict[str, list] = {name: [] for name in fns}
    for r in range(rounds):
        order = list(fns)
        random.Random(r).shuffle(order)  # no fixed position in the round; same on every rank
        for name in order:
            c0 = time.process_time()
            samples[name].append(_timed(fns[name], device))
            cpu_samples[name].append(time.process_time() - c0)
    out = {}
    for name, s in samples.items():
        t = torch.tensor(s, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step is as slow as its slowest rank
        out[name] = statistics.median(t.tolist())
        if cpu:
            c = torch.tensor(cpu_samples[name], dtype=torch.float64)
            dist.all_reduce(c)
            out[f"{name} cpu"] = statistics.median(c.tolist())
    return out


# --- 1. Megatron MLP step ---------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Megatron's f: identity forward, all-reduce of the gradient over tp backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        g = g.contiguous()
        dist.all_reduce(g, group=ctx.group)
        return g, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's g: all-reduce forward (in place on the fresh matmul output), identity back."""

    @staticmethod
    def forward(ctx, x, group):
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, g):
        return g, None


def megatron(args, mesh, device) -> list[dict]:
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from named_spmd.backends.distributed import to_local

    dm = mesh.device_mesh
    dp_group, tp_group = dm.get_group("dp"), dm.get_group("tp")
    rows = []
    for hidden in args.sizes:
        ffn = hidden * args.ffn_mult
        g = torch.Generator().manual_seed(hidden)

        def r(*shape, g=g):
            return (torch.randn(*shape, generator=g) / shape[0] ** 0.5).to(device)

        x, w1, b1, w2, b2 = (
            r(args.tokens, hidden),
            r(hidden, ffn),
            r(ffn),
            r(ffn, hidden),
            r(hidden),
        )
        placements = {
            "x": [Shard(0), Replicate()],
            "w1": [Replicate(), Shard(1)],
            "b1": [Replicate(), Shard(0)],
            "w2": [Replicate(), Shard(0)],
            "b2": [Replicate(), Replicate()],
        }
        glob = dict(x=x, w1=w1, b1=b1, w2=w2, b2=b2)
        dts = {k: distribute_tensor(v, dm, placements[k]).requires_grad_() for k, v in glob.items()}
        local = {k: v.to_local().detach().clone().requires_grad_() for k, v in dts.items()}

        @ns.spmd_map(
            mesh=mesh,
            in_specs=(P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
            out_specs=P("dp", None),
        )
        def mlp(x, w1, b1, w2, b2):
            return ns.psum(F.gelu(x @ w1 + b1) @ w2, "tp") + b2

        def spmd_step():
            for t in dts.values():
                t.grad = None
            y = mlp(dts["x"], dts["w1"], dts["b1"], dts["w2"], dts["b2"])
            to_local(y).pow(2).sum().backward()  # this rank's block, as a plain tensor

        def hand_step(reduce_after=True):
            for t in local.values():
                t.grad = None
            xx = _CopyToTP.apply(local["x"], tp_group)
            h = F.gelu(xx @ local["w1"] + local["b1"])
            y = _ReduceFromTP.apply(h @ local["w2"], tp_group) + local["b2"]
            y.pow(2).sum().backward()
            for k in ("w1", "b1", "w2", "b2") if reduce_after else ():
                dist.all_reduce(local[k].grad, group=dp_group)

        pending: list | None = None  # a list while overlapped_step runs

        def reduce_when_ready(p):  # DDP's schedule: each gradient's all-reduce starts when ready
            if pending is not None:
                pending.append(dist.all_reduce(p.grad, group=dp_group, async_op=True))

        for k in ("w1", "b1", "w2", "b2"):
            local[k].register_post_accumulate_grad_hook(reduce_when_ready)

        def overlapped_step():
            nonlocal pending
            pending = []
            hand_step(reduce_after=False)
            for work in pending:
                work.wait()
            pending = None

        spmd_step()
        hand_step()
        err = max((dts[k].grad.to_local() - local[k].grad).abs().max().item() for k in local)
        overlapped_step()
        err = max(
            err, *((dts[k].grad.to_local() - local[k].grad).abs().max().item() for k in local)
        )
        rounds = max(5, args.rounds // 3) if hidden >= 4096 else args.rounds
        steps = {"spmd_map": spmd_step, "hand-written": hand_step, "overlapped": overlapped_step}
        t = interleaved(steps, rounds, 2, device)
        rows.append(
            {
                "hidden": hidden,
                "ffn": ffn,
                "tokens": args.tokens,
                "spmd_ms": t["spmd_map"] * 1e3,
                "hand_ms": t["hand-written"] * 1e3,
                "ratio": t["spmd_map"] / t["hand-written"],
                "overlapped_ms": t["overlapped"] * 1e3,
                "ratio_overlapped": t["spmd_map"] / t["overlapped"],
                "max_grad_diff": err,
                "rounds": rounds,
            }
        )
    return rows


# --- 2. latency of one collective ---------------------------------------------------------------------


def latency(args, mesh, device) -> list[dict]:
    """Per-call time of one all-reduce. "fresh": the operand is computed right before (as a
    matmul output is), so ns.psum may reduce it in place like dist.all_reduce; "reused": the
    same operand every call, which ns.psum must copy (its result is a new tensor)."""
    group = mesh.device_mesh.get_group("all")
    rows = []
    for numel, calls in ((1, 200), (1 << 20, 10)):
        x = torch.ones(numel, device=device)

        def spmd_calls(fresh: bool):
            @ns.spmd_map(mesh=mesh, in_specs=P(), out_specs=P())
            def psums(v):
                v = ns.pvary(v, "all")
                for _ in range(calls):
                    out = ns.psum(v * 1.0, "all") if fresh else ns.psum(v, "all")
                return out

            return lambda: psums(x)

        def raw_fresh():
            for _ in range(calls):
                t = x * 1.0
                dist.all_reduce(t, group=group)

        buf = x.clone()

        def raw_reused():
            for _ in range(calls):
                dist.all_reduce(buf, group=group)

        def funcol():
            from torch.distributed import _functional_collectives as fc

            for _ in range(calls):
                fc.all_reduce(x * 1.0, "sum", group).wait()

        fns = {
            "ns.psum fresh": spmd_calls(True),
            "dist.all_reduce fresh": raw_fresh,
            "ns.psum reused": spmd_calls(False),
            "dist.all_reduce reused": raw_reused,
        }
        if args.funcol:
            fns["funcol fresh"] = funcol
        t = interleaved(fns, 2 * args.rounds, 2, device)  # small and noisy: more rounds
        row = {"bytes": numel * 4, **{k: v / calls * 1e6 for k, v in t.items()}}
        row["ratio fresh"] = row["ns.psum fresh"] / row["dist.all_reduce fresh"]
        row["ratio reused"] = row["ns.psum reused"] / row["dist.all_reduce reused"]
        rows.append(row)
    return rows


def tree(args, mesh, device) -> list[dict]:
    """Collectives of a pytree, the blocks passed as they are (``.local``), against the same by
    hand: one collective per leaf (the loop a user writes) and one of their concatenation (the
    floor). ``ns.pmean`` of gradients (the data-parallel step written as in JAX),
    ``ns.all_gather(..., tiled=True, to="invariant")`` of parameter blocks (FSDP's gathering) and
    ``ns.psum_scatter(..., tiled=True)`` of gradients (ZeRO's reduce-scatter)."""
    group = mesh.device_mesh.get_group("all")
    n = dist.get_world_size()
    pmean = ns.spmd_map(lambda g: ns.pmean(g, "all"), mesh=mesh, in_specs=P("all"), out_specs=P())
    gather = ns.spmd_map(
        lambda g: ns.all_gather(g, "all", tiled=True, to="invariant"),
        mesh=mesh,
        in_specs=P("all"),
        out_specs=P(),
    )
    scatter = ns.spmd_map(
        lambda g: ns.psum_scatter(g, "all", tiled=True),
        mesh=mesh,
        in_specs=P("all"),
        out_specs=P("all"),
    )
    hand = {"pmean": _hand_pmean, "all_gather": _hand_gather, "psum_scatter": _hand_scatter}
    mapped = {"pmean": pmean, "all_gather": gather, "psum_scatter": scatter}
    rows = []
    cases = (("pmean", 30, 64), ("pmean", 8, 512), ("all_gather", 30, 64), ("psum_scatter", 30, 64))
    for op, count, side in cases:
        leaves = {f"w{i}": torch.randn(side, side, device=device) for i in range(count)}
        f = mapped[op]
        fns = {"ns": lambda f=f, leaves=leaves: f.local(leaves), **hand[op](leaves, group, n)}
        t = {k: v * 1e6 for k, v in interleaved(fns, args.rounds, 2, device).items()}
        row = {"op": op, "leaves": f"{count} x [{side}, {side}]", **t}
        row["ratio per leaf"] = t["ns"] / t["per leaf"]
        row["ratio concatenated"] = t["ns"] / t["concatenated"]
        rows.append(row)
    return rows


def _hand_pmean(leaves: dict, group, n: int) -> dict:
    def per_leaf():
        for v in leaves.values():
            t = v.clone()
            dist.all_reduce(t, group=group)
            t /= n

    def concatenated():
        flat = torch.cat([v.reshape(-1) for v in leaves.values()])
        dist.all_reduce(flat, group=group)
        (flat / n).split([v.numel() for v in leaves.values()])

    return {"per leaf": per_leaf, "concatenated": concatenated}


def _hand_gather(leaves: dict, group, n: int) -> dict:
    def per_leaf():
        for v in leaves.values():
            out = v.new_empty((n * v.shape[0], *v.shape[1:]))
            dist.all_gather_into_tensor(out, v, group=group)

    def concatenated():
        flat = torch.cat([v.reshape(-1) for v in leaves.values()])
        out = flat.new_empty(n * flat.numel())
        dist.all_gather_into_tensor(out, flat, group=group)
        parts = out.view(n, -1).split([v.numel() for v in leaves.values()], dim=1)
        [p.reshape(n * v.shape[0], *v.shape[1:]) for p, v in zip(parts, leaves.values())]

    return {"per leaf": per_leaf, "concatenated": concatenated}


def _hand_scatter(leaves: dict, group, n: int) -> dict:
    """Each leaf's first dim as n blocks (``psum_scatter(..., tiled=True)``, gloo's
    ``reduce_scatter_tensor``): by leaf, or all leaves' blocks side by side in one."""

    def per_leaf():
        for v in leaves.values():
            out = v.new_empty((v.shape[0] // n, *v.shape[1:]))
            dist.reduce_scatter_tensor(out, v, group=group)

    def concatenated():
        rows = torch.cat([v.reshape(n, -1) for v in leaves.values()], 1)
        out = rows.new_empty(rows.shape[1])
        dist.reduce_scatter_tensor(out, rows.reshape(-1), group=group)
        parts = out.split([v.numel() // n for v in leaves.values()])
        [p.view(v.shape[0] // n, *v.shape[1:]) for p, v in zip(parts, leaves.values())]

    return {"per leaf": per_leaf, "concatenated": concatenated}


def ring(args, mesh, device) -> list[dict]:
    """One pass around the ring (world - 1 ppermute hops) of a block of ``numel`` floats."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    group = mesh.device_mesh.get_group("all")
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    pairs = [(i, (i + 1) % world) for i in range(world)]

    @ns.spmd_map(mesh=mesh, in_specs=P("all"), out_specs=P("all"))
    def spmd_ring(v):
        for _ in range(world - 1):
            v = ns.ppermute(v, "all", pairs)
        return v

    rows = []
    for numel in (256, 1 << 16, 1 << 20):
        local = torch.randn(numel, device=device)
        x = DTensor.from_local(local, mesh.device_mesh, [Shard(0)], run_check=False)

        def send_recv():
            v = local
            for _ in range(world - 1):
                out = torch.empty_like(v)
                ops = [
                    dist.P2POp(dist.isend, v, nxt, group),
                    dist.P2POp(dist.irecv, out, prev, group),
                ]
                for w in dist.batch_isend_irecv(ops):
                    w.wait()
                v = out
            return v

        def all_to_all():
            v = local
            sent, received = [0] * world, [0] * world
            sent[nxt], received[prev] = numel, numel
            for _ in range(world - 1):
                out = torch.empty_like(v)
                dist.all_to_all_single(out, v, received, sent, group=group)
                v = out
            return v

        want = send_recv()
        for name, got in (("ns", spmd_ring(x).to_local()), ("a2a", all_to_all())):
            if not torch.equal(got, want):
                raise SystemExit(f"ring of {numel}: {name} differs from send/recv")
        fns = {"ns.ppermute": lambda: spmd_ring(x), "send/recv": send_recv, "a2a": all_to_all}
        t = interleaved(fns, args.rounds, 2, device)
        row = {"bytes": numel * 4, **{k: v * 1e6 for k, v in t.items()}}
        row["ratio"] = row["ns.ppermute"] / row["send/recv"]
        row["ratio a2a"] = row["a2a"] / row["send/recv"]
        rows.append(row)
    return rows


def ragged(args, mesh, device) -> list[dict]:
    """One ``ns.ragged_all_to_all`` (every rank sends a run of rows of its own length to each
    peer, written at the receiver's offsets) versus the same by hand.

    The routing (every rank's sizes to every peer) is drawn from a seed every rank shares, so the
    user's program knows all of it: named_spmd's program is given the four metadata (the output
    offsets in the senders' frame, as JAX's are), and the hand-written one ("hand, routing
    known") needs one ``all_to_all_single`` with split sizes, its rows placed at offsets it
    computes itself. "hand, sizes exchanged" is the program where only the senders know their
    sizes and offsets: an ``all_to_all_single`` of those first (what the op itself does to learn
    its peers' offsets and to check the sizes agree before the rows move). "ns, empty call" is
    the floor of any spmd_map call with these inputs (the start-of-call check, the blocks in and
    out), its body returning the output buffer."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    group = mesh.device_mesh.get_group("all")
    gen = random.Random(0)  # the same routing on every rank
    rows = []
    for per_peer, features in ((64, 64), (512, 256)):
        counts = [[gen.randint(0, per_peer) for _ in range(world)] for _ in range(world)]
        n_rows, m_rows = world * per_peer, world * per_peer
        send = torch.tensor(counts[rank])
        in_off = torch.cumsum(send, 0) - send
        recv = torch.tensor([counts[i][rank] for i in range(world)])
        at = torch.cumsum(recv, 0) - recv  # placed in source order
        # the senders' frame, from the shared routing: where each receiver places this rank's rows
        out_off = torch.tensor(
            [sum(counts[i][j] for i in range(rank)) for j in range(world)], dtype=torch.int64
        )
        x = torch.randn(n_rows, features, device=device)

        @ns.spmd_map(mesh=mesh, in_specs=P("all"), out_specs=P("all"))
        def spmd(v, o, i, s, oo, r):
            return ns.ragged_all_to_all(v, o, i, s, oo, r, "all")

        @ns.spmd_map(mesh=mesh, in_specs=P("all"), out_specs=P("all"))
        def empty(v, o, i, s, oo, r):
            return o

        def dt(t):
            return DTensor.from_local(t, mesh.device_mesh, [Shard(0)], run_check=False)

        dargs = [dt(x), dt(torch.zeros(m_rows, features, device=device))]
        dargs += [dt(t) for t in (in_off, send, out_off, recv)]

        def place(got, sizes, offsets):
            out = x.new_zeros(m_rows, features)
            for o, piece in zip(offsets, got.split(sizes)):
                out[o : o + piece.shape[0]] = piece
            return out

        def known():
            sent, sizes = send.tolist(), recv.tolist()
            packed = torch.cat([x[o : o + c] for o, c in zip(in_off.tolist(), sent)])
            got = x.new_empty(sum(sizes), features)
            dist.all_to_all_single(got, packed, sizes, sent, group=group)
            return place(got, sizes, at.tolist())

        def exchanged():
            peer = torch.empty(2 * world, dtype=torch.int64)
            mine = torch.stack([send, out_off], 1).reshape(-1)  # per peer: size, offset
            dist.all_to_all_single(peer, mine, group=group)
            sizes, offsets = peer.reshape(world, 2).T.tolist()
            sent = send.tolist()
            packed = torch.cat([x[o : o + c] for o, c in zip(in_off.tolist(), sent)])
            got = x.new_empty(sum(sizes), features)
            dist.all_to_all_single(got, packed, sizes, sent, group=group)
            return place(got, sizes, offsets)

        want = known()
        for name, got in (("ns", spmd(*dargs).to_local()), ("exchanged", exchanged())):
            if not torch.equal(got, want):
                raise SystemExit(f"ragged_all_to_all of {per_peer}x{features}: {name} differs")
        fns = {
            "ns": lambda: spmd(*dargs),
            "hand, routing known": known,
            "hand, sizes exchanged": exchanged,
            "ns, empty call": lambda: empty(*dargs),
        }
        t = interleaved(fns, args.rounds, 2, device, cpu=True)
        row = {"rows": sum(counts[rank]), "features": features}
        row |= {k: v * 1e6 for k, v in t.items()}
        row["ns process-group calls"] = process_group_calls(fns["ns"])
        row["hand process-group calls"] = process_group_calls(known)
        row["ratio"] = row["ns"] / row["hand, routing known"]
        row["ratio vs sizes exchanged"] = row["ns"] / row["hand, sizes exchanged"]
        row["cpu ratio"] = row["ns cpu"] / row["hand, routing known cpu"]
        rows.append(row)
    return rows


# --- 5. a stencil step on a grid whose rows do not divide ---------------------------------------------


def _laplacian(u, top, bottom):
    """The 5-point Laplacian of the rows ``u``, given the row above and the row below them."""
    padded = F.pad(torch.cat([top, u, bottom]), (1, 1))  # the side edges: 0
    return padded[:-2, 1:-1] + padded[2:, 1:-1] + padded[1:-1, :-2] + padded[1:-1, 2:] - 4 * u


def stencil(args, mesh, device) -> list[dict]:
    """Explicit heat-equation steps (tutorial 12) on a grid of ``H = 4k + 2`` rows split over the
    ranks as torch.chunk splits them (uneven blocks): each step passes a halo row down and one
    up with ``ns.ppermute`` (two exchanges per step), the end ranks apply the boundaries (a hot
    top edge, an insulated bottom edge). Forward only, ``steps`` steps per call, the grid a
    DTensor of uneven ``Shard(0)`` blocks in and out; one grid of ``4k`` rows (even blocks) for
    comparison, which takes the even path (no shape exchanges). Hand-written: the same steps on this
    rank's block with one ``dist.batch_isend_irecv`` per step (both halos; every transfer
    posted at once)."""
    from torch.distributed.tensor import DTensor, Shard

    world, rank = dist.get_world_size(), dist.get_rank()
    group = mesh.device_mesh.get_group("all")
    last = world - 1
    dt_, steps = 0.2, args.stencil_steps
    rows = []
    for height, width in ((4 * 64 + 2, 256), (4 * 64, 256), (4 * 256 + 2, 1024)):
        g = torch.Generator().manual_seed(height)
        u0 = torch.rand(height, width, generator=g).to(device)
        sizes = [b.shape[0] for b in u0.chunk(world)]
        start = sum(sizes[:rank])
        local = u0[start : start + sizes[rank]].clone()
        kappa, hot = torch.tensor(0.5, device=device), torch.tensor(1.0, device=device)
        heater_cols = torch.zeros(width, device=device)
        heater_cols[width // 4 : width // 2] = 1.0

        def source_of(first_row, n):
            r = first_row + torch.arange(n, device=device)
            on = (r >= height // 2) & (r < height // 2 + height // 8)
            return on.to(u0.dtype)[:, None] * heater_cols

        down = [(j, j + 1) for j in range(last)]
        up = [(j + 1, j) for j in range(last)]
        offsets = ns.block_offsets(height, "all", mesh=mesh)

        @ns.spmd_map(mesh=mesh, in_specs=(P("all"), P(), P()), out_specs=P("all"))
        def spmd_steps(u, kappa, hot):
            i = ns.axis_index("all")
            first = torch.tensor(offsets, device=device).index_select(0, i.reshape(1))
            source = source_of(first, u.shape[0])
            for _ in range(steps):
                top = ns.ppermute(u[-1:], "all", down)
                bottom = ns.ppermute(u[:1], "all", up)
                top = torch.where(i == 0, hot * torch.ones(1, width, device=device), top)
                bottom = torch.where(i == last, u[-1:], bottom)
                u = u + dt_ * (_laplacian(u, top, bottom) + kappa * source)
            return u

        def by_hand():
            u = local
            source = source_of(torch.tensor([start], device=device), u.shape[0])
            for _ in range(steps):
                top, bottom = torch.empty_like(u[:1]), torch.empty_like(u[:1])
                ops = []
                if rank > 0:
                    ops += [
                        dist.P2POp(dist.isend, u[:1].contiguous(), rank - 1, group),
                        dist.P2POp(dist.irecv, top, rank - 1, group),
                    ]
                if rank < last:
                    ops += [
                        dist.P2POp(dist.isend, u[-1:].contiguous(), rank + 1, group),
                        dist.P2POp(dist.irecv, bottom, rank + 1, group),
                    ]
                for w in dist.batch_isend_irecv(ops) if ops else ():
                    w.wait()
                if rank == 0:
                    top = hot * torch.ones(1, width, device=device)
                if rank == last:
                    bottom = u[-1:]
                u = u + dt_ * (_laplacian(u, top, bottom) + kappa * source)
            return u

        ux = DTensor.from_local(  # uneven blocks: the global shape given
            local, mesh.device_mesh, [Shard(0)], run_check=False, shape=u0.shape, stride=u0.stride()
        )

        uneven = height % world != 0
        per_instance = ns.simulate_per_instance if uneven else contextlib.nullcontext

        def spmd_call():
            with torch.no_grad(), per_instance():  # uneven blocks: one per rank, any size
                return spmd_steps(ux, kappa, hot)

        def hand_call():
            with torch.no_grad():
                return by_hand()

        got, want = spmd_call(), hand_call()
        if tuple(got.shape) != tuple(u0.shape) or not torch.allclose(
            got.to_local(), want, rtol=1e-5, atol=1e-5
        ):
            raise SystemExit(f"stencil on {height}x{width}: spmd_map differs from by hand")
        t = interleaved({"ns": spmd_call, "hand": hand_call}, args.rounds, 2, device, cpu=True)
        row = {"grid": f"{height}x{width}", "blocks": "/".join(map(str, sizes)), "steps": steps}
        row |= {k: v * 1e6 for k, v in t.items()}
        row["ns process-group calls"] = process_group_calls(spmd_call)
        row["hand process-group calls"] = process_group_calls(hand_call)
        row["ratio"] = row["ns"] / row["hand"]
        row["cpu ratio"] = row["ns cpu"] / row["hand cpu"]
        rows.append(row)
    return rows


# --- 6. vma tracking overhead (one process) ------------------------------------------------------------


def _ops(x, w, n_ops: int):
    for k in range(n_ops // 4):
        x = x * w
        x = x + 0.5
        x = torch.tanh(x)
        x = x - w if k % 2 else x.neg()
    return x


class _Bare(TorchFunctionMode):
    """A torch function mode that only calls the op: what a mode's dispatch costs by itself."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _bare(x, w, n_ops: int) -> None:
    with _Bare():
        _ops(x, w, n_ops)


def _op_calls(mesh, axis: str, n_ops: int) -> dict:
    """:func:`_ops` mapped over ``axis`` (``x`` split, ``w`` replicated), with 0 and ``n_ops``
    ops (the fixed cost, and the ops' on top of it)."""
    return {
        k: ns.spmd_map(
            lambda a, b, k=k: _ops(a, b, k), mesh=mesh, in_specs=(P(axis), P()), out_specs=P(axis)
        )
        for k in (0, n_ops)
    }


def _typed(call, *args) -> None:
    """``call(*args)`` typed op by op: its signature's plan (or untyped replay) set aside."""
    _replay.ENABLED = False
    try:
        call(*args)
    finally:
        _replay.ENABLED = True


def vma_overhead(n_ops: int = 200, rounds: int = 15) -> dict:
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = ns.make_mesh((1,), ("i",))
    x, w = torch.randn(8, 8), torch.randn(8, 8)
    calls = _op_calls(mesh, "i", n_ops)
    dx, dw = (distribute_tensor(t, mesh.device_mesh, [Replicate()]) for t in (x, w))
    fns = {
        "plain": lambda: _ops(x, w, n_ops),
        "plain0": lambda: _ops(x, w, 0),
        "spmd": lambda: _typed(calls[n_ops], x, w),
        "spmd0": lambda: _typed(calls[0], x, w),
        "replayed": lambda: calls[n_ops](x, w),
        "replayed0": lambda: calls[0](x, w),
        "bare_mode": lambda: _bare(x, w, n_ops),
        "dtensor": lambda: _ops(dx, dw, n_ops),
    }
    samples = {k: [] for k in fns}
    for fn in fns.values():
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            samples[k].append((time.perf_counter() - t0) / 20)
    med = {k: statistics.median(v) for k, v in samples.items()}
    per_op = lambda a, b: (a - b) / n_ops * 1e6  # noqa: E731
    return {
        "plain_us_per_op": per_op(med["plain"], med["plain0"]),
        "spmd_us_per_op": per_op(med["spmd"], med["spmd0"]),
        "vma_overhead_us_per_op": per_op(med["spmd"] - med["spmd0"], med["plain"] - med["plain0"]),
        "replayed_overhead_us_per_op": per_op(
            med["replayed"] - med["replayed0"], med["plain"] - med["plain0"]
        ),
        "bare_mode_overhead_us_per_op": per_op(med["bare_mode"], med["plain"]),
        "dtensor_overhead_us_per_op": per_op(med["dtensor"], med["plain"]),
        "spmd_call_fixed_us": med["spmd0"] * 1e6,
    }


def replay_overhead(mesh, n_ops: int = 200, rounds: int = 15) -> list[dict]:
    """The same 200 ops (:func:`_ops`) inside spmd_map on a mesh of every rank (``x`` split,
    ``w`` replicated): the extra CPU microseconds per op of a planned call's replay (its
    signature typed once before) and of a typed call, over the ops on plain tensors; for scale,
    a bare ``TorchFunctionMode``; and the fixed cost of a call (``n_ops = 0``). CPU time of
    this rank, medians over interleaved rounds. Two operand sizes: 8x8, where the ops cost
    least, and 256x256 (float32, 256 KiB), where each op's memory traffic evicts from the
    caches the Python state that the next op's dispatch reads (its cost grows with it)."""
    return [_replay_row(mesh, side, n_ops, rounds) for side in (8, 256)]


def _replay_row(mesh, side: int, n_ops: int, rounds: int) -> dict:
    n = mesh.size
    x, w = torch.randn(side * n, side), torch.randn(side, side)
    block = x[:side].clone()
    calls = _op_calls(mesh, "all", n_ops)
    fns = {
        "plain": lambda: _ops(block, w, n_ops),
        "plain0": lambda: _ops(block, w, 0),
        "typed": lambda: _typed(calls[n_ops], x, w),
        "typed0": lambda: _typed(calls[0], x, w),
        "replayed": lambda: calls[n_ops](x, w),
        "replayed0": lambda: calls[0](x, w),
        "bare": lambda: _bare(block, w, n_ops),
    }
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():
        fn()
        fn()
    for _ in range(rounds):
        for k, fn in fns.items():
            dist.barrier()
            t0 = time.thread_time()
            for _ in range(10):
                fn()
            samples[k].append((time.thread_time() - t0) / 10)
    med = {k: statistics.median(v) for k, v in samples.items()}
    plain = med["plain"] - med["plain0"]
    per_op = lambda a, b: (med[a] - med[b] - plain) / n_ops * 1e6  # noqa: E731
    return {
        "ranks": n,
        "operands": f"{side}x{side}",
        "plain us/op": round(plain / n_ops * 1e6, 2),
        "replayed overhead us/op": round(per_op("replayed", "replayed0"), 2),
        "typed overhead us/op": round(per_op("typed", "typed0"), 2),
        "bare TorchFunctionMode overhead us/op": round(
            (med["bare"] - med["plain"]) / n_ops * 1e6, 2
        ),
        "replayed call fixed us": round(med["replayed0"] * 1e6),
        "typed call fixed us": round(med["typed0"] * 1e6),
    }


# --- main ---------------------------------------------------------------------------------------------


def worker(args) -> None:
    count_process_group_calls()
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    torch.set_num_threads(args.threads)
    dist.init_process_group(backend)
    world = dist.get_world_size()
    device = (
        torch.device(args.device, torch.cuda.current_device())
        if args.device == "cuda"
        else torch.device("cpu")
    )
    result = {"world": world, "device": args.device, "backend": backend}
    if "megatron" in args.only:
        mesh = ns.make_mesh((2, world // 2), ("dp", "tp"), device_type=args.device)
        result["megatron"] = megatron(args, mesh, device)
    if {"latency", "tree", "ring", "ragged", "stencil", "replay"} & set(args.only):
        mesh = ns.make_mesh((world,), ("all",), device_type=args.device)
    if "latency" in args.only:
        result["latency"] = latency(args, mesh, device)
    if "tree" in args.only:
        result["tree"] = tree(args, mesh, device)
    if "ring" in args.only:
        result["ring"] = ring(args, mesh, device)
    if "ragged" in args.only:
        result["ragged"] = ragged(args, mesh, device)
    if "stencil" in args.only:
        result["stencil"] = stencil(args, mesh, device)
    if "replay" in args.only:
        result["replay"] = replay_overhead(mesh, rounds=args.rounds)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps(result), flush=True)
    dist.destroy_process_group()


def single(args) -> dict:
    port = _free_port()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo")
    try:
        return vma_overhead()
    finally:
        dist.destroy_process_group()


def report(result: dict, vma: dict | None) -> None:
    print(f"{result['world']} processes, {result['device']} / {result['backend']}")
    for row in result.get("megatron", []):
        print(
            f"  Megatron MLP step  H={row['hidden']:<5} ffn={row['ffn']:<6} "
            f"tokens={row['tokens']}: spmd_map {row['spmd_ms']:8.2f} ms   hand-written "
            f"{row['hand_ms']:8.2f} ms   ratio {row['ratio']:.3f}   overlapped hand-written "
            f"{row['overlapped_ms']:8.2f} ms   ratio {row['ratio_overlapped']:.3f}   "
            f"(grads equal to {row['max_grad_diff']:.1e}, {row['rounds']} rounds)"
        )
    for row in result.get("latency", []):
        funcol = f"   funcol {row['funcol fresh']:7.1f} us" if "funcol fresh" in row else ""
        print(
            f"  all-reduce of {row['bytes']:>8} B, fresh operand: ns.psum "
            f"{row['ns.psum fresh']:7.1f} us   dist.all_reduce {row['dist.all_reduce fresh']:7.1f}"
            f" us   ratio {row['ratio fresh']:.3f}{funcol}"
        )
        print(
            f"  all-reduce of {row['bytes']:>8} B, reused operand: ns.psum "
            f"{row['ns.psum reused']:7.1f} us   dist.all_reduce (in place) "
            f"{row['dist.all_reduce reused']:7.1f} us   ratio {row['ratio reused']:.3f}"
        )
    for row in result.get("tree", []):
        print(
            f"  {row['op']} of a pytree of {row['leaves']} float32: ns {row['ns']:8.1f} us   "
            f"one per leaf {row['per leaf']:8.1f} us   ratio {row['ratio per leaf']:.3f}   one of "
            f"their concatenation {row['concatenated']:8.1f} us   ratio "
            f"{row['ratio concatenated']:.3f}"
        )
    for row in result.get("ring", []):
        print(
            f"  ring of ppermutes, {row['bytes']:>8} B blocks: ns.ppermute "
            f"{row['ns.ppermute']:8.1f} us   send/recv {row['send/recv']:8.1f} us   ratio "
            f"{row['ratio']:.3f}   hand-written all_to_all {row['a2a']:8.1f} us   ratio "
            f"{row['ratio a2a']:.3f}"
        )
    for row in result.get("ragged", []):
        print(
            f"  ragged_all_to_all of {row['rows']:>5} rows x {row['features']}: ns "
            f"{row['ns']:8.1f} us   hand-written, routing known (one all_to_all_single with "
            f"split sizes) {row['hand, routing known']:8.1f} us   ratio {row['ratio']:.3f}   "
            f"hand-written, sizes exchanged first {row['hand, sizes exchanged']:8.1f} us   ratio "
            f"{row['ratio vs sizes exchanged']:.3f}   (an empty spmd_map call with these inputs "
            f"{row['ns, empty call']:8.1f} us)   CPU time of the 4 ranks: ratio "
            f"{row['cpu ratio']:.3f}   process-group calls: ns {row['ns process-group calls']}; "
            f"hand-written {row['hand process-group calls']}"
        )
    for row in result.get("stencil", []):
        print(
            f"  stencil, grid {row['grid']} (blocks {row['blocks']}), {row['steps']} step(s) per "
            f"call: ns {row['ns']:8.1f} us   hand-written (batch_isend_irecv halos) "
            f"{row['hand']:8.1f} us   ratio {row['ratio']:.3f}   CPU time of the 4 ranks: "
            f"ratio {row['cpu ratio']:.3f}   process-group calls: ns "
            f"{row['ns process-group calls']}; hand-written {row['hand process-group calls']}"
        )
    for row in result.get("replay", []):
        print(
            f"  vma tracking on {row['ranks']} ranks (200 ops on {row['operands']} operands, CPU "
            "time): a replay "
            f"+{row['replayed overhead us/op']:.2f} us/op, a typed call "
            f"+{row['typed overhead us/op']:.2f} us/op over plain torch "
            f"({row['plain us/op']:.2f} us/op); a bare TorchFunctionMode "
            f"+{row['bare TorchFunctionMode overhead us/op']:.2f} us/op; fixed cost of a call "
            f"{row['replayed call fixed us']} us replayed, {row['typed call fixed us']} us typed"
        )
    if vma:
        print(
            f"  vma tracking (1 process, 200 small ops): +{vma['vma_overhead_us_per_op']:.2f} "
            f"us/op over plain torch ({vma['plain_us_per_op']:.2f} us/op); a bare "
            f"TorchFunctionMode costs +{vma['bare_mode_overhead_us_per_op']:.2f} us/op, DTensor "
            f"+{vma['dtensor_overhead_us_per_op']:.2f} us/op; replayed (one instance, a signature "
            f"typed before) +{vma['replayed_overhead_us_per_op']:.2f} us/op; fixed cost of a "
            "typed spmd_map call "
            f"{vma['spmd_call_fixed_us']:.0f} us"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nproc", type=int, default=4)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 1024, 4096])
    parser.add_argument("--ffn-mult", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="global batch (split over dp)")
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--backend", default=None)
    parser.add_argument("--stencil-steps", type=int, default=1, help="stencil steps per call")
    parser.add_argument("--funcol", action="store_true", help="also time funcol all_reduce")
    parser.add_argument(
        "--only",
        nargs="+",
        default=["megatron", "latency", "tree", "ring", "ragged", "stencil", "replay", "vma"],
    )
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--timeout", type=float, default=1800)
    args = parser.parse_args()
    if "RANK" in os.environ and os.environ.get("WORLD_SIZE", "1") != "1":
        worker(args)
        return
    argv = [a for a in sys.argv[1:]]
    result = {"world": args.nproc, "device": args.device, "backend": args.backend or "gloo"}
    if {"megatron", "latency", "tree", "ring", "ragged", "stencil", "replay"} & set(args.only):
        out = spawn(argv, args.nproc, args.timeout)
        line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(out[-4000:])
        result = json.loads(line[len("RESULT ") :])
    vma = single(args) if "vma" in args.only else None
    report(result, vma)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"distributed": result, "vma": vma}, f, indent=1)


if __name__ == "__main__":
    main()
