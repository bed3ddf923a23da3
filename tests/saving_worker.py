"""What a mapped call leaves on the caller's tensors, on a real mesh of gloo processes
(launched by tests/test_saving.py with 1 or 2 ranks): inputs, parameters, closed-over tensors,
outputs and gradients after eager and compiled calls carry no named_spmd attribute, so
torch.save / torch.load(weights_only=True) round-trips them. Prints ``SAVING {json}`` per case.

Also the program (:func:`program`) and the checks (:func:`left_on`, :func:`round_trip`) that
tests/test_saving.py runs on simulated meshes.
"""

from __future__ import annotations

import copy
import io
import json

import torch
from torch.utils.checkpoint import checkpoint

import named_spmd as ns
from named_spmd import P


def left_on(t) -> list[str]:
    """The named_spmd attributes in ``t``'s ``__dict__`` (a DTensor's local tensor's too)."""
    names = [k for k in getattr(t, "__dict__", {}) if k.startswith("_named_spmd")]
    inner = getattr(t, "_local_tensor", None)
    return names + left_on(inner) if inner is not None else names


def round_trip(obj):
    """``obj`` saved with torch.save and loaded with ``weights_only=True``."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def plain(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value; a plain tensor as it is."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def program(mesh, compiled: bool, local: bool = False, checkpointed: bool = True) -> dict:
    """A layer whose parameter, input, closed-over tensors, outputs and gradient the caller
    holds after three calls (each with its backward), eager or compiled (``ns.compile``);
    ``local``: the call of ``f.local`` on this process's blocks; ``checkpointed``: part of the
    eager body under a checkpoint (typed every call; without it, later calls replay). Returns, per held tensor, the
    attributes left on it, and whether the state_dict, the tensors and a deepcopy of the module
    round-trip with their values."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(4, 4, bias=False, dtype=torch.float64)
    c = torch.randn(4, dtype=torch.float64)  # closed over
    # closed over, handed back unchanged by ``.to`` (a Parameter: not ``type(out) is Tensor``)
    other = torch.nn.Linear(4, 4, bias=False, dtype=torch.float64)
    steps = torch.zeros((), dtype=torch.float64)  # closed over, written in place

    def body(x, w):
        steps.add_(1)
        h = torch.tanh(x @ w)
        if checkpointed and not compiled:  # (a checkpoint in a compiled call is refused)
            h = checkpoint(lambda a, b: torch.tanh(a @ b), x, w, use_reentrant=False)
        return h @ other.weight.to(torch.float64) + c.contiguous(), w * 2

    f = ns.spmd_map(body, mesh=mesh, in_specs=(P("dp"), P()), out_specs=(P("dp"), P()))
    run = f.local if local else f
    run = ns.compile(run) if compiled else run
    x = torch.randn(4, 4, dtype=torch.float64)
    if local:  # (on a real mesh only: this rank's block)
        x = x.chunk(mesh.shape["dp"])[mesh.coords_of(torch.distributed.get_rank())["dp"]]
    for _ in range(3):
        y, z = run(x, layer.weight)
        (plain(y).sum() + plain(z).sum()).backward()
    held = {"x": x, "w": layer.weight, "other": other.weight, "c": c, "steps": steps}
    held |= {"y": y, "z": z}
    held["grad"] = layer.weight.grad
    left = {k: left_on(v) for k, v in held.items() if left_on(v)}
    loaded = round_trip(layer.state_dict())
    state_ok = torch.equal(loaded["weight"], layer.weight.detach())
    tensors = {k: plain(v).detach() if k in ("y", "z") else v for k, v in held.items()}
    back = round_trip({k: v for k, v in tensors.items() if k not in ("y", "z")})
    tensors_ok = all(torch.equal(back[k], v) for k, v in back.items())
    copied = copy.deepcopy(layer)
    copy_ok = not left_on(copied.weight) and torch.equal(copied.weight, layer.weight)
    return {
        "left": left,
        "state": state_ok,
        "tensors": tensors_ok,
        "copy": copy_ok,
        "steps": float(steps),
    }


def checkpointed_input(mesh, ckpt: bool) -> list[float]:
    """The gradient of an input block passed straight into a checkpointed function (a local
    call: the caller's own tensor is the call's input), whose psum depends on the block's type:
    typed invariant in the recomputation, the psum would be n times this rank's block."""
    f = ns.spmd_map(
        lambda x: (
            checkpoint(lambda a: torch.sin(ns.psum(a, "dp")), x, use_reentrant=False)
            if ckpt
            else torch.sin(ns.psum(x, "dp"))
        ),
        mesh=mesh,
        in_specs=P("dp"),
        out_specs=P(),
    )
    rank = torch.distributed.get_rank()
    x = torch.arange(4.0, dtype=torch.float64).add(1 + rank).requires_grad_()
    y = f.local(x)
    y.pow(2).sum().backward()
    assert not left_on(x), left_on(x)
    return x.grad.tolist()


def recomputed_inside_another_call(mesh) -> tuple[list[float], list[float]]:
    """A call whose backward runs inside another call taking the same tensor: the first call's
    checkpoint recomputes there, typing the tensor as it was in the first call, and leaves it
    typed as the second call typed it. Returns the second call's gradient and its reference
    (``x * x * 2`` per element: 4x)."""
    first = ns.spmd_map(
        lambda a: checkpoint(lambda t: torch.sin(ns.psum(t, "dp")), a, use_reentrant=False),
        mesh=mesh,
        in_specs=P("dp"),
        out_specs=P(),
    ).local
    rank = torch.distributed.get_rank()
    x = torch.arange(4.0, dtype=torch.float64).add(1 + rank).requires_grad_()
    y = first(x)

    def second_body(a):
        h = a * 2
        torch.autograd.grad(y.sum(), x, retain_graph=True)  # recomputes ``first``'s checkpoint
        return h * a

    second = ns.spmd_map(second_body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")).local
    second(x).sum().backward()
    return x.grad.tolist(), (4 * x).tolist()


def operands_among_results() -> tuple:
    """A per-device function whose ops return closed-over tensors among several results
    (``torch.atleast_1d``, ``torch.broadcast_tensors``) or write one through ``out=``; those
    tensors by name; and the function's value in plain torch."""
    a, b = torch.randn(4, dtype=torch.float64), torch.randn(4, dtype=torch.float64)
    o = torch.empty(4, dtype=torch.float64)

    def body(x):
        first, second = torch.atleast_1d(a, b)
        (c,) = torch.broadcast_tensors(a)
        return x + first * second + c + torch.add(a, 1.0, out=o)

    return body, {"a": a, "b": b, "o": o}, lambda x: x + a * b + a + (a + 1.0)


def returned_among_results(mesh) -> dict:
    """The attributes left on :func:`operands_among_results`' tensors after a typed call and
    two replayed ones (none expected)."""
    body, held, _ = operands_among_results()
    f = ns.spmd_map(body, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    for _ in range(3):
        f.local(torch.randn(4, 4, dtype=torch.float64))
    return {k: left_on(t) for k, t in held.items() if left_on(t)}


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        n = dist.get_world_size()
        mesh = ns.make_mesh((n, 1), ("dp", "tp"))
        for compiled in (False, True):
            for local in (False, True):
                out = program(mesh, compiled, local)
                print("SAVING " + json.dumps({"compiled": compiled, "local": local, **out}))
        for local in (False, True):  # replayed calls
            out = program(mesh, False, local, checkpointed=False)
            print("SAVING " + json.dumps({"compiled": False, "local": local, **out}))
        grads = {ckpt: checkpointed_input(mesh, ckpt) for ckpt in (False, True)}
        print("SAVING " + json.dumps({"checkpointed": grads[True], "plain": grads[False]}))
        print("SAVING " + json.dumps({"among": returned_among_results(mesh)}))
        got, want = recomputed_inside_another_call(mesh)
        print("SAVING " + json.dumps({"checkpointed": got, "plain": want}))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
