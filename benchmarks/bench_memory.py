"""Simulated backend: peak memory of a run versus the per-instance programs' tensors.

Run: ``python benchmarks/bench_memory.py [--quick] [--sizes 256 1024 4096] [--markdown FILE]``

Program: the Megatron MLP ``y = psum(gelu(x @ W1) @ W2, "tp")`` forward + backward (gradients of
W1 and W2) with x [64, H], W1 [H, 4H], W2 [4H, H], fp32, on mesh ("dp", "tp") = (2, 4): x split
over dp, W1 / W2 split over tp, as in bench_simulated.py.

What is measured, and how. The figure is the peak, during one step, of the bytes held in blocks
that the step itself allocated: activations, saved tensors, temporaries, the output and the
gradients count; the inputs and parameters, and caches filled by a warm-up call, do not. It
comes from ``torch.profiler`` with ``profile_memory=True``: c10's CPU allocator then reports
every allocation and free with its address and size, so the peak is exact for tensor storage,
whoever allocates it (our code, vmap's batching rules, autograd, kernels), and it does not
depend on the process's earlier history the way an RSS high-water mark does. ``tracemalloc``
sees none of it (torch allocates outside Python's allocator). Not counted, on every side alike:
scratch buffers that BLAS/oneDNN allocate with their own malloc. A sanity check fails the run
if the unsharded step's peak is below the size of its two gradients. (c10 prints one warning
about a block allocated before profiling started: that is a free the accounting ignores.)

Variants (each measured the same way, in this process):

* ``unsharded single-device step``: the same MLP on the global tensors, for scale.
* ``per-instance program, one instance``: the hand-written per-rank program of instance (0, 0)
  on its own shards (x [32, H], W1 [H, H], W2 [H, H]); the tp all-reduce is stood in for by an
  out-of-place copy (the buffer a functional all-reduce returns) with an identity backward, and
  the dp gradient all-reduce is in place (no allocation).
* ``sum of the 8 per-instance peaks``: that program run for each of the 8 instances, peaks
  added: what a per-instance loop would need if every instance's tensors were live at once.
  This is the baseline of the target (simulated peak <= 1.25x this sum).
* ``spmd_map (2,4) default order`` and ``dp outermost``: ours, with the default nesting order
  (the weight-replicated axis innermost) and with dp forced outermost.
* ``LocalTensorMode per-rank program``: torch's own simulation of the 8 ranks (fake process
  group), which does hold all instances' tensors at once.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch._C._profiler import _EventType
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_simulated  # noqa: E402  (the LocalTensorMode step and the MLP steps)

import named_spmd as ns  # noqa: E402

MESH = (2, 4)
BATCH = 64


# --- measuring ---------------------------------------------------------------------------------


def _allocation_events(prof) -> list:
    """The allocator's events in the order they happened. Timestamps can tie; the allocator's
    running total (exact, kept under its lock) then decides: each event moves it by its size."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    found = []
    while stack:
        event = stack.pop()
        stack.extend(event.children)
        if event.tag == _EventType.Allocation:
            found.append((event.start_time_ns, event.extra_fields))
    found.sort(key=lambda te: te[0])
    ordered: list = []
    i = 0
    while i < len(found):
        j = i
        while j < len(found) and found[j][0] == found[i][0]:
            j += 1
        ordered += _chain([e for _, e in found[i:j]], ordered[-1] if ordered else None)
        i = j
    return ordered


def _chain(group: list, before) -> list:
    """Order events that share a timestamp so that the running totals follow one another."""
    out = []
    while group:
        prev = before.total_allocated if before is not None else None
        nxt = next((e for e in group if prev == e.total_allocated - e.alloc_size), group[0])
        group.remove(nxt)
        out.append(nxt)
        before = nxt
    return out


def peak_bytes(step: Callable[[], object]) -> int:
    """Peak, while ``step()`` runs, of the bytes held in blocks that the step itself allocated.

    Frees of blocks allocated before the step are left out: what the step needs does not depend
    on what its caller happened to drop at its start (old gradients), and c10 may report such a
    free with the size of a stale entry whose address was reused."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    live: dict[int, int] = {}
    held = peak = 0
    for event in _allocation_events(prof):
        if event.alloc_size > 0:
            live[event.ptr] = event.alloc_size
            held += event.alloc_size
            peak = max(peak, held)
        elif event.ptr in live:
            held -= live.pop(event.ptr)
    return peak


def measured(step: Callable[[], object]) -> int:
    step()  # warm-up: caches (plans, level tokens, autograd graph pieces) fill here, not counted
    return peak_bytes(step)


# --- the programs --------------------------------------------------------------------------------


class _AllReduceStandIn(torch.autograd.Function):
    """Megatron's "g" for one instance: the forward returns a fresh buffer (as an out-of-place
    all-reduce does), the backward is the identity."""

    @staticmethod
    def forward(ctx, t):
        return t.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad


def _instance_step(x, w1, w2, g, d: int, t: int):
    """The per-rank program of instance (dp=d, tp=t), on copies of its shards."""
    rows = BATCH // MESH[0]
    cols = w1.shape[1] // MESH[1]
    xl = x[rows * d : rows * (d + 1)].clone()
    gl = g[rows * d : rows * (d + 1)].clone()
    w1l = w1.detach()[:, cols * t : cols * (t + 1)].clone().requires_grad_()
    w2l = w2.detach()[cols * t : cols * (t + 1)].clone().requires_grad_()

    def step():
        w1l.grad = w2l.grad = None
        y = _AllReduceStandIn.apply(F.gelu(xl @ w1l) @ w2l)
        y.backward(gl)

    return step


def _ordered(step, order):
    def run():
        with ns.simulation_order(*order) if order else contextlib.nullcontext():
            step()

    return run


def bench(hidden: int, local_tensor: bool) -> dict[str, int]:
    torch.manual_seed(0)
    mesh = ns.make_mesh(MESH, ("dp", "tp"))
    x, g = torch.randn(BATCH, hidden), torch.randn(BATCH, hidden)
    w1 = (torch.randn(hidden, 4 * hidden) / hidden**0.5).requires_grad_()
    w2 = (torch.randn(4 * hidden, hidden) / (4 * hidden) ** 0.5).requires_grad_()
    out = {"unsharded single-device step": measured(bench_simulated._unsharded_step(x, w1, w2, g))}
    grads = (w1.numel() + w2.numel()) * w1.element_size()
    if out["unsharded single-device step"] < grads:  # the accounting must see at least these
        raise SystemExit(f"memory accounting missed the gradients ({grads} bytes): {out}")
    peaks = [
        measured(_instance_step(x, w1, w2, g, d, t)) for d in range(MESH[0]) for t in range(MESH[1])
    ]
    out["per-instance program, one instance"] = peaks[0]
    out["sum of the 8 per-instance peaks"] = sum(peaks)
    spmd = bench_simulated._spmd_step(x, w1, w2, g, mesh)
    out["spmd_map (2,4) default order"] = measured(spmd)
    out["spmd_map (2,4) dp outermost"] = measured(_ordered(spmd, ("dp", "tp")))
    w1.grad = w2.grad = None
    if local_tensor:
        try:
            out["LocalTensorMode per-rank program"] = measured(
                bench_simulated._local_tensor_step(x, w1, w2, g)
            )
        finally:
            bench_simulated._destroy_fake_process_group()
    return out


# --- reporting -----------------------------------------------------------------------------------

BASELINE = "sum of the 8 per-instance peaks"
TARGETS = {"spmd_map (2,4) default order": "<= 1.25x"}


def rows(hidden: int, peaks: dict[str, int]) -> list[tuple[str, str, float, str, str]]:
    """(case, variant, MiB, ratio to the baseline, target) per variant."""
    base = peaks[BASELINE]
    out = []
    for name, nbytes in peaks.items():
        ratio = "" if name == BASELINE else f"{nbytes / base:.2f}x"
        out.append((f"H={hidden}", name, nbytes / 2**20, ratio, TARGETS.get(name, "")))
    return out


def print_rows(table: list) -> None:
    print(f"{'case':<8} {'variant':<38} {'peak MiB':>10} {'ratio':>8}  target")
    for case, name, mib, ratio, target in table:
        print(f"{case:<8} {name:<38} {mib:>10.2f} {ratio or '-':>8}  {target}")


def markdown(table: list) -> str:
    lines = [
        f"| case | variant | peak (MiB) | ratio vs {BASELINE} | target |",
        "|---|---|---:|---:|---|",
    ]
    lines += [f"| {c} | {n} | {m:.2f} | {r} | {t} |" for c, n, m, r, t in table]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="H = 256 and 1024 only")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="hidden sizes")
    parser.add_argument("--no-local-tensor", action="store_true", help="skip LocalTensorMode")
    parser.add_argument("--markdown", help="also write the rows as a markdown table here")
    args = parser.parse_args(argv)
    sizes = args.sizes or ([256, 1024] if args.quick else [256, 1024, 4096])
    table = []
    for hidden in sizes:
        table += rows(hidden, bench(hidden, not args.no_local_tensor))
    print_rows(table)
    if args.markdown:
        with open(args.markdown, "w") as fh:
            fh.write(markdown(table) + "\n")
    return table


if __name__ == "__main__":
    main()
