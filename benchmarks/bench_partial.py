"""Per-op cost of the type tracking with and without unreduced values (docs/design.md section 2.2).

Run: ``python benchmarks/bench_partial.py [--rounds N]``

200 small ops inside ``spmd_map`` minus the same call with none, per op, in microseconds of
process CPU time (one thread); the minimum over rounds (robust to a loaded machine), on the
simulated backend (a (2,) mesh) and on the real one (one gloo process, a (1,) mesh):

* ``varying``: ``x * w``, ``x + 0.5``, ``tanh``, ``neg`` on a varying value whose dim 0 is split
  (every program's path: the ops follow the blocks the dims hold, ``_blocks``; the simulated
  backend's ``PartialMode`` and the real one's ``VmaMode`` fast path);
* ``unreduced``: the linear ops ``x * 0.5``, ``x + x``, ``neg``, ``reshape`` on an unreduced value
  (the partial-sum algebra types each op: ``_partial.combine``, memoized);
* ``plain``: the varying ops on plain tensors, outside spmd_map.

The ratio ``unreduced / varying`` is what a program pays per op for values with U or R axes.

``--compiled``: what the inference costs a compiled call at run time (it runs while Dynamo
traces, so the goal is nothing). The GPT step of ``_gpt.py`` (forward and backward) on a (1,1)
mesh of one gloo process, ``torch.compile(fullgraph=True)`` with ``aot_eager``, traced as built
and traced with the inference switched off (``_blocks.recorded`` answering no); CPU time per
step, minimum over interleaved rounds. Each variant is compiled twice, in the order A B B A,
each copy with a code object of its own: the copy compiled later runs a few percent slower
whatever it holds, and the order cancels that out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _gpt

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402


def varying_ops(x, w, n):
    for k in range(n // 4):
        x = x * w
        x = x + 0.5
        x = torch.tanh(x)
        x = x - w if k % 2 else x.neg()
    return x


def unreduced_ops(x, w, n):  # linear ops only: valid on a partial sum
    for _ in range(n // 4):
        x = x * 0.5
        x = x + x
        x = x.neg()
        x = x.reshape(-1).reshape(x.shape)
    return x


def _best(fn, x, w, rounds, calls=10):
    fn(x, w)
    best = float("inf")
    for _ in range(rounds):
        t = time.process_time()
        for _ in range(calls):
            fn(x, w)
        best = min(best, (time.process_time() - t) / calls)
    return best


def per_op(make, rounds, n=200):
    x, w = torch.randn(16, 8), torch.randn(8)
    return (_best(make(n), x, w, rounds) - _best(make(0), x, w, rounds)) / n * 1e6


def calls(mesh, kind):
    def make(n):
        if kind == "varying":
            body = lambda a, b: varying_ops(a, b, n)  # noqa: E731
            out = P("i")
        else:
            body = lambda a, b: unreduced_ops(ns.pcast(a, "i", to="unreduced"), b, n)  # noqa: E731
            out = P(unreduced={"i"})
        return ns.spmd_map(body, mesh=mesh, in_specs=(P("i"), P()), out_specs=out)

    return make


def compiled_steps(rounds: int) -> dict[str, float]:
    """ms of CPU per compiled GPT step, with the inference and without (see the docstring)."""
    import _gpt as G
    import _util

    from named_spmd import _blocks

    cfg, mesh = G.Config(), ns.make_mesh((1, 1), ("dp", "tp"))
    params = {k: v.requires_grad_() for k, v in G.init_params(cfg, 0).items()}
    tokens, targets = G.batch(cfg, 0)
    recorded = _blocks.recorded

    def make(infer: bool, copy: int):
        mapped = G.spmd_step_fn(cfg, mesh)
        f = _util.compiled_copy(mapped, f"{infer}{copy}", backend="aot_eager", fullgraph=True)

        def step():
            _blocks.recorded = recorded if infer else (lambda operands, token: False)
            try:
                ns.to_local(f(tokens, targets, params)).backward()
            finally:
                _blocks.recorded = recorded

        step()  # traced here
        return step

    order = [(True, 0), (False, 0), (False, 1), (True, 1)]
    steps = {key: make(*key) for key in order}
    best = dict.fromkeys(steps, float("inf"))
    for _ in range(rounds):
        for key, step in steps.items():
            t = time.process_time()
            for _ in range(5):
                step()
            best[key] = min(best[key], (time.process_time() - t) / 5 * 1e3)
    return {
        name: sum(v for (infer, _), v in best.items() if infer == want) / 2
        for name, want in (("compiled, inference", True), ("compiled, no inference", False))
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=25)
    parser.add_argument("--compiled", action="store_true", help="the compiled GPT step only")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.compiled:
        return compiled(args.rounds)
    out = {"plain": per_op(lambda n: lambda a, b: varying_ops(a, b, n), args.rounds)}
    sim = ns.make_mesh((2,), ("i",))
    for kind in ("varying", "unreduced"):
        out[f"simulated {kind}"] = per_op(calls(sim, kind), args.rounds)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    real = ns.make_mesh((1,), ("i",))
    for kind in ("varying", "unreduced"):
        out[f"real {kind}"] = per_op(calls(real, kind), args.rounds)
    dist.destroy_process_group()
    print("us per op (min over rounds):")
    for k, v in out.items():
        print(f"  {k:22s} {v:8.2f}")
    for backend in ("simulated", "real"):
        ratio = out[f"{backend} unreduced"] / out[f"{backend} varying"]
        print(f"  {backend}: unreduced / varying = {ratio:.2f}")
    print(json.dumps({k: round(v, 2) for k, v in out.items()}))


def compiled(rounds: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="0", RANK="0", WORLD_SIZE="1")
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    out = compiled_steps(rounds)
    dist.destroy_process_group()
    print("ms per compiled GPT step (CPU, min over rounds, mean of two copies):")
    for k, v in out.items():
        print(f"  {k:24s} {v:8.3f}")
    ratio = out["compiled, inference"] / out["compiled, no inference"]
    print(f"  inference / no inference = {ratio:.3f}")
    print(json.dumps({k: round(v, 3) for k, v in out.items()}))


if __name__ == "__main__":
    main()
