"""One gloo process, a real (1, 1) mesh: test_one_instance.py's programs on the real backend.

A real mesh of one rank replays calls whose signature it type-checked, as a simulated mesh of
one instance does (``named_spmd._replay``). Each check below runs three calls (the first one
checked, the others replayed) against the dense computation in this process, with DTensor and
with plain-tensor inputs, and prints ``OUTCOME {json}`` with the largest difference and what the
replays looked like.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist
from test_one_instance import SPECS, checkpointed_megatron, dense_megatron, inputs, megatron

import named_spmd as ns
from named_spmd import P
from named_spmd._replay import checked_signatures


def _difference(got, want) -> float:
    return max(float((g.detach().double() - w.detach()).abs().max()) for g, w in zip(got, want))


def _run(f, args, dtensors: bool, mesh) -> tuple[list, list]:
    if dtensors:
        leaves = ns.shard([a.detach() for a in args], mesh, list(SPECS))
        leaves = [t.requires_grad_() for t in leaves]
    else:
        leaves = [a.detach().clone().requires_grad_() for a in args]
    loss = ns.to_local(f(*leaves))
    grads = torch.autograd.grad(loss.sum(), leaves)
    return [loss], [ns.to_local(g) if hasattr(g, "placements") else g for g in grads]


def check(name: str, body, mesh, dtensors: bool) -> dict:
    worst, modes = 0.0, []

    def counted(*args):
        modes.append(torch.overrides._len_torch_function_stack())
        return body(*args)

    f = ns.spmd_map(counted, mesh=mesh, in_specs=SPECS, out_specs=P())
    for seed in range(3):
        args = inputs(seed)
        loss, grads = _run(f, args, dtensors, mesh)
        want_loss = dense_megatron(*args)
        want_grads = torch.autograd.grad(want_loss.sum(), args)
        worst = max(worst, _difference(loss, [want_loss]), _difference(grads, want_grads))
    return {
        "check": name,
        "dtensors": dtensors,
        "worst": worst,
        "modes": modes,
        "marks": list(checked_signatures(f).values()),
    }


def main() -> None:
    dist.init_process_group("gloo")
    mesh = ns.make_mesh((1, 1), ("dp", "tp"))
    for dtensors in (True, False):
        for name, body in (("plain", megatron), ("checkpointed", checkpointed_megatron)):
            print("OUTCOME " + json.dumps(check(name, body, mesh, dtensors)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
