"""Activation checkpointing inside the per-device function: the programs, and their real-mesh run.

Each program is a transformer-style piece with collectives, ``axis_size`` and ``axis_index``
inside the checkpointed part, written with torch's own ``torch.utils.checkpoint.checkpoint(...,
use_reentrant=False)``, in three modes: ``none`` (no checkpoint: the reference), ``full`` and
``selective`` (``create_selective_checkpoint_contexts`` saving the matmuls).
:func:`run_program` returns the loss, the gradients of every input and the ``CommMode`` counts.
tests/test_checkpointing.py runs them on simulated meshes; ``python
tests/checkpointing_worker.py`` under a 4-process gloo job prints ``OUTCOME {json}`` per program
and mode, which the test compares with the simulated result.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

import named_spmd as ns
from named_spmd import P

MODES = ("none", "full", "selective")


def _save_matmuls(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> CheckpointPolicy:
    """Selective policy: keep matmul results, recompute everything else (collectives included)."""
    if op in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default):
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def checkpointed(mode: str, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)`` under torch's own checkpoint as ``mode`` says."""
    if mode == "none":
        return fn(*args)
    if mode == "full":
        return checkpoint(fn, *args, use_reentrant=False)
    context = functools.partial(create_selective_checkpoint_contexts, _save_matmuls)
    return checkpoint(fn, *args, use_reentrant=False, context_fn=context)


# --- the programs: (per-device function builder, in_specs, out_specs, global input shapes) ------


def megatron_mlp(mode: str) -> tuple[Callable[..., Any], tuple, Any, list[tuple[int, ...]]]:
    """Two Megatron MLP blocks (column- then row-parallel, psum over tp), each checkpointed."""

    def block(x, w1, w2, b):
        h = F.gelu(x @ w1)  # [b, 4d/tp]
        # the norm saves the psum's result: a full recomputation runs the psum again
        return F.layer_norm(x + ns.psum(h @ w2, "tp") + b, b.shape)

    def f(x, w1, w2, b):
        for _ in range(2):
            x = checkpointed(mode, block, x, w1, w2, b)
        return x

    specs = (P("dp"), P(None, "tp"), P("tp"), P())
    return f, specs, P("dp"), [(8, 6), (6, 16), (16, 6), (6,)]


def gather_scatter(mode: str) -> tuple[Callable[..., Any], tuple, Any, list[tuple[int, ...]]]:
    """A sequence-parallel block: all_gather of the sequence over tp, a tp-sharded MLP, then
    psum_scatter back; axis_index and axis_size inside the checkpointed piece."""

    def block(x, w1, w2):  # x: [batch/dp, seq/tp, d]
        full = ns.all_gather(x, "tp", axis=1, tiled=True)  # [b, seq, d]
        h = torch.tanh(full @ w1) * (1.0 + ns.axis_index("tp"))
        y = ns.psum_scatter(h @ w2, "tp", scatter_dimension=1, tiled=True)
        return x + torch.tanh(y) / ns.axis_size("tp")  # tanh saves y: recomputed in full

    def f(x, w1, w2):
        y = checkpointed(mode, block, x, w1, w2)
        return ns.pmean(torch.sin(y), "dp")

    specs = (P("dp", "tp"), P(None, "tp"), P("tp"))
    return f, specs, P(None, "tp"), [(4, 8, 6), (6, 8), (8, 6)]


PROGRAMS = {"megatron_mlp": megatron_mlp, "gather_scatter": gather_scatter}


def inputs(shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True) for s in shapes]


def global_value(y: Any) -> torch.Tensor:
    return y.full_tensor() if hasattr(y, "full_tensor") else y


def run_program(name: str, mode: str, mesh: Any) -> dict[str, Any]:
    """The loss, the input gradients and the CommMode counts of one forward + backward."""
    f, in_specs, out_specs, shapes = PROGRAMS[name](mode)
    mapped = ns.spmd_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    args = inputs(shapes)
    with ns.CommMode() as comms:
        y = global_value(mapped(*args))
        loss = (y**2).sum()
        grads = torch.autograd.grad(loss, args)
    counts = {"|".join((d, op, ",".join(axes))): n for (d, op, axes), n in comms.counts().items()}
    return {
        "loss": loss.item(),
        "grads": [g.tolist() for g in grads],
        "counts": counts,
    }


MESH_SHAPE = ((2, 2), ("dp", "tp"))


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    mesh = ns.make_mesh(*MESH_SHAPE)
    for name in PROGRAMS:
        for mode in MODES:
            try:
                outcome = run_program(name, mode, mesh)
            except Exception as e:  # noqa: BLE001 - reported to the test
                outcome = {"error": type(e).__name__, "message": str(e)[:2000]}
            record = {"rank": dist.get_rank(), "program": name, "mode": mode, **outcome}
            print("OUTCOME " + json.dumps(record), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
