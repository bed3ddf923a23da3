"""One gloo process, a real (1, 1) mesh: test_one_instance.py's programs on the real backend.

A real mesh of one rank replays calls whose signature it type-checked, as a simulated mesh of
one instance does (``named_spmd._replay``). Each check below runs three calls (the first one
checked, the others replayed) against the dense computation in this process, with DTensor and
with plain-tensor inputs, and prints ``OUTCOME {json}`` with the largest difference and what the
replays looked like.
"""

from __future__ import annotations

import gc
import json
import weakref

import torch
import torch.distributed as dist
from test_one_instance import (
    RUNS,
    SPECS,
    bad_date,
    bad_json,
    bad_matmul,
    checkpointed_megatron,
    dense_megatron,
    gathered,
    inputs,
    megatron,
    not_positive_definite,
    reductions,
    under_a_mode,
    written_leaf,
)

import named_spmd as ns
from named_spmd import P
from named_spmd._calls import active
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
    worst, modes, contexts = 0.0, [], []

    def counted(*args):
        modes.append(torch.overrides._len_torch_function_stack())
        contexts.append(weakref.ref(active()))
        return body(*args)

    f = ns.spmd_map(counted, mesh=mesh, in_specs=SPECS, out_specs=P())
    gc.disable()  # a context left in a reference cycle stays alive until a collection
    try:
        for seed in range(3):
            args = inputs(seed)
            loss, grads = _run(f, args, dtensors, mesh)
            want_loss = dense_megatron(*args)
            want_grads = torch.autograd.grad(want_loss.sum(), args)
            worst = max(worst, _difference(loss, [want_loss]), _difference(grads, want_grads))
        alive = sum(c() is not None for c in contexts)
    finally:
        gc.enable()
    return {
        "check": name,
        "dtensors": dtensors,
        "worst": worst,
        "modes": modes,
        "marks": list(checked_signatures(f).values()),
        "alive": alive,
    }


def boundary(mesh) -> dict:
    """What a replay's boundary still does: a DTensor leaf is converted (and its placements
    checked) in every call, a plain one handed through; ``ns.to_local`` of an output gives the
    call's own local tensor (no conversion node), of a partial sum converts it."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    f = ns.spmd_map(lambda x, w: x * w, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x = torch.randn(4, 3, dtype=torch.float64)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    split = distribute_tensor(x, mesh.device_mesh, [Shard(0), Replicate()])
    whole = distribute_tensor(x, mesh.device_mesh, [Replicate(), Replicate()])
    worst = 0.0
    for _ in range(3):  # checked, then replayed
        out = ns.to_local(f(split, w))
        (grad,) = torch.autograd.grad(out.sum(), [w])
        worst = max(worst, _difference([out, grad], [x * w.detach(), x.sum(0)]))
    hooked = f(split, w)
    seen = []
    hooked.register_hook(lambda g: seen.append(g))  # waits for the DTensor's own gradient
    ns.to_local(hooked).sum().backward()
    try:
        f(whole, w)  # the signature's replay: the DTensor's placements are still checked
        refused = ""
    except ns.SpecError as e:
        refused = str(e)
    parts = ns.spmd_map(
        lambda x: ns.pcast(x, "dp", to="unreduced"),
        mesh=mesh,
        in_specs=P("dp"),
        out_specs=P(unreduced={"dp"}),
    )
    # an output dropped once a later op (one that saves no operand) used it: its memory goes,
    # though the graph it feeds lives on (ns.to_local's hand-through keeps none of it)
    dropped = f(split, w)
    alive = weakref.ref(ns.to_local(dropped))
    later = dropped * 2
    del dropped
    gc.collect()
    kept = alive() is not None
    del later
    plain = x.clone().requires_grad_()
    summed = ns.to_local(parts(plain))
    (grad,) = torch.autograd.grad(summed.sum(), [plain])
    worst = max(worst, _difference([summed, grad], [x, torch.ones_like(x)]))
    return {
        "worst": worst,
        "refused": refused,
        "output_node": type(out.grad_fn).__name__,
        "partial_node": type(summed.grad_fn).__name__,
        "hooked": [type(g).__name__ for g in seen],
        "kept": kept,
    }


def errors(mesh) -> dict:
    """A torch op's rejection of its operands and autograd's refusal of a write, as the
    simulated mesh tells them: each function's error class, message and cause's class."""
    told = {}
    for fn in (bad_matmul, written_leaf, not_positive_definite, bad_json, bad_date):
        f = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
        try:
            f(torch.ones(4, 4))
            told[fn.__name__] = ["no error", "", ""]
        except Exception as e:  # noqa: BLE001 - what it raised is the outcome
            told[fn.__name__] = [type(e).__name__, str(e), type(e.__cause__).__name__]
    pair = ns.spmd_map(lambda x, y: x + y, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    try:  # one argument where the function takes two
        pair(torch.ones(4))
        told["arguments"] = ["no error", "", ""]
    except Exception as e:  # noqa: BLE001 - what it raised is the outcome
        told["arguments"] = [type(e).__name__, str(e), type(e.__cause__).__name__]
    index = ns.spmd_map(gathered, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    index(torch.arange(4.0), torch.tensor([1]))  # checked: the next call is a replay
    RUNS.clear()
    try:
        index(torch.arange(4.0), torch.tensor([7]))
        told["replayed"] = ["no error", "", ""]
    except Exception as e:  # noqa: BLE001 - what it raised is the outcome
        told["replayed"] = [type(e).__name__, str(e), type(e.__cause__).__name__]
    told["replayed runs"] = len(RUNS)
    return told


def main() -> None:
    dist.init_process_group("gloo")
    mesh = ns.make_mesh((1, 1), ("dp", "tp"))
    for dtensors in (True, False):
        for name, body in (("plain", megatron), ("checkpointed", checkpointed_megatron)):
            print("OUTCOME " + json.dumps(check(name, body, mesh, dtensors)), flush=True)
    print("BOUNDARY " + json.dumps(boundary(mesh)), flush=True)
    print("REDUCTIONS " + json.dumps(reductions(mesh)), flush=True)
    print("UNDER_A_MODE " + json.dumps(under_a_mode(mesh)), flush=True)
    print("ERRORS " + json.dumps(errors(mesh)), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
