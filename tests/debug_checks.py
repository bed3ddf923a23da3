"""Debug mode's checks of values that must agree across ranks (4 processes, NAMED_SPMD_DEBUG=1).

``python tests/debug_checks.py`` prints one ``OUTCOME {json}`` per case and rank: plain-tensor
inputs that differ between ranks (each rank initialised its model with its own seed), an output
typed invariant whose copies differ (a random draw after ``torch.manual_seed(rank)``), a
ppermute whose pairs differ between the members of its group (its signature names them), and
the same programs done right (and with conjugate views, and under torch.func over the call),
which must pass.
"""

from __future__ import annotations

import json

import torch
import torch.distributed as dist

import named_spmd as ns
from named_spmd import P


def cases(mesh, rank: int):
    step = ns.spmd_map(
        lambda x, w: ns.psum(x @ w, "tp"),
        mesh=mesh,
        in_specs=(P("dp", "tp"), P("tp", None)),
        out_specs=P("dp", None),
    )
    noisy = ns.spmd_map(
        lambda x: x + torch.randn(x.shape[-1]), mesh=mesh, in_specs=P("dp"), out_specs=P("dp")
    )
    x = torch.ones(4, 4)
    torch.manual_seed(rank)
    yield "inputs_differ", lambda: step(x, torch.randn(4, 3))
    torch.manual_seed(0)
    yield "inputs_agree", lambda: step(x, torch.randn(4, 3))
    torch.manual_seed(rank)
    yield "replicas_differ", lambda: noisy(x)
    torch.manual_seed(0)
    yield "replicas_agree", lambda: noisy(x)

    def shift(pairs):
        return ns.spmd_map(
            lambda x: ns.ppermute(x, "tp", pairs), mesh=mesh, in_specs=P("tp"), out_specs=P("tp")
        )

    member = rank % 2  # its index along "tp" (the minor axis)
    yield "pairs_agree", lambda: shift([(0, 1), (1, 0)])(x)
    yield "pairs_differ", lambda: shift([(0, 1)] if member == 0 else [(1, 0)])(x)
    # a conjugate view (the conj bit set: no byte view of it) as a plain input and as an
    # invariant output, digested as its values
    flip = ns.spmd_map(lambda z: (z * 1).conj(), mesh=mesh, in_specs=P(), out_specs=P())
    yield "conjugates_agree", lambda: flip(torch.complex(x, -x).conj())
    # torch.func over the call: the inputs are the transforms' wrappers, digested as their values
    total = ns.spmd_map(
        lambda w: ns.psum(w.sin().sum(), "dp"), mesh=mesh, in_specs=P("dp"), out_specs=P()
    )
    w = torch.linspace(-1.0, 1.0, 8)
    yield "grad_over_the_call_agree", lambda: torch.func.grad(lambda w: _plain(total(w)))(w)
    yield "jvp_over_the_call_agree", lambda: torch.func.jvp(lambda w: _plain(total(w)), (w,), (w,))


def _plain(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    for name, call in cases(mesh, rank):
        try:
            call()
            outcome = {"ok": True}
        except ns.SpmdError as e:
            outcome = {"error": type(e).__name__, "message": str(e)}
        print("OUTCOME " + json.dumps({"rank": rank, "case": name, **outcome}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
