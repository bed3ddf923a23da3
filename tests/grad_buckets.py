"""Bucketed gradient psums on a real mesh (2 gloo processes), for tests/test_distributed.py.

``python tests/grad_buckets.py [--late]`` under a 2-process job prints ``OUTCOME {json}`` lines:

* ``uniform``: 30 float64 weights [4, 4] and 6 float32 weights [4, 4] of a data-parallel chain,
  for each bucket size (0, room for 3 float64 weights, room for 7, the default): the gradients,
  whether they are bitwise equal to the unbucketed run (size 0) on this rank, the all-reduces
  torch counted in the backward pass (CommDebugMode), the backward psums ``ns.CommMode`` recorded, works
  left in torch's registry, and whether every ``.grad`` is a plain tensor.
* ``accumulated``: the same chain's gradients after two backward passes accumulated into
  ``.grad``, and the all-reduces of the second one (its gradients add into existing ``.grad``
  tensors: the addition waits for the bucket's end, not for each gradient's sum).
* ``views``: a chain that uses each weight through a view (``h @ w.T``, ``h @ w[:4]``), as plain
  tensors and as DTensors: gradients, all-reduces and recorded psums, as for ``uniform`` (the
  views' gradient psums share the buckets of weights used directly), and the calls' contexts
  still alive once the gradients are in (none: the casts' caches hold their context); the same
  with the second use inside a checkpoint (its recomputation takes the caches back).
* ``shared``: weights that receive one gradient tensor (both operands of ``x * (a + b)``), as
  DTensors sharded and replicated (the latter through the bucketed psum) and as plain tensors,
  two backward passes accumulated: whether every ``.grad`` is a plain tensor on its own storage,
  and the gradients after the first one's is doubled in place.
* ``dtensor_inputs``: DTensor arguments converted to their local blocks: the backward psums
  ``ns.CommMode`` records for a gradient asked for an activation alone (none: the parameters'
  backward does not run) and whether that gradient is dense torch's; whether a DTensor argument
  that gets no gradient (its op's backward returns None) keeps ``.grad`` None, as dense torch,
  alone or beside another DTensor argument; the error for two DTensors against their in_specs
  (the first requiring grad, the second not): it names the first.
* ``large``: a chain through a 2 MiB weight between small ones: gradients, all-reduces (the
  large weight's alone) and recorded psums.
* ``mixed``: weights of odd sizes (padding between slots), a weight also used outside the call
  and one used by two calls (their second contribution reads a pending gradient before its
  bucket filled), two backward passes accumulated: gradients and the bitwise check.

``--late`` delays every reduction and bucket start to its wait and poisons pending gradients
with NaN until then (tests/dist_worker.py's late-reduction mode).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402

N64, N32, SIDE = 30, 6, 4
ITEM_BYTES = SIDE * SIDE * 8  # one float64 weight
SIZES_MB = {"0": 0.0, "3": 3 * ITEM_BYTES / 2**20, "7": 7 * ITEM_BYTES / 2**20, "default": None}


def _chain(x, w64, w32):
    y = x
    for w in w64:
        y = torch.tanh(y @ w)
    z = y.float()
    for w in w32:
        z = torch.tanh(z @ w)
    return ns.psum((y**2).sum() + z.double().sum(), "dp")


def uniform_params():
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2 * 3, SIDE, generator=gen, dtype=torch.float64)
    w64 = [torch.randn(SIDE, SIDE, generator=gen, dtype=torch.float64) / 2 for _ in range(N64)]
    w32 = [torch.randn(SIDE, SIDE, generator=gen, dtype=torch.float32) / 2 for _ in range(N32)]
    return x, w64, w32


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def uniform_grads(mesh, around_backward=contextlib.nullcontext) -> tuple[list, int]:
    """The weights' gradients and the backward psums CommMode recorded (any backend)."""
    x, w64, w32 = uniform_params()
    ws = [w.requires_grad_() for w in w64 + w32]
    f = ns.spmd_map(_chain, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P())
    psums = _backward_psums(lambda: f(x, ws[:N64], ws[N64:]), around_backward)
    return [w.grad for w in ws], psums


def _backward_psums(loss_of, around_backward) -> int:
    """Forward ``loss_of()`` and its backward pass (inside ``around_backward()``): the backward
    psums CommMode recorded."""
    with ns.CommMode() as comms:
        loss = _full(loss_of())
        with around_backward():
            loss.backward()
    return comms.count("psum", direction="backward")


def accumulated_grads(mesh, around_second=contextlib.nullcontext, prepare=None) -> list:
    """The uniform chain's gradients after two backward passes accumulated into ``.grad`` (two
    micro-batches); ``around_second`` wraps the second pass, whose gradients add into existing
    ``.grad`` tensors; ``prepare(weights)`` runs first."""
    x, w64, w32 = uniform_params()
    ws = [w.requires_grad_() for w in w64 + w32]
    if prepare is not None:
        prepare(ws)
    f = ns.spmd_map(_chain, mesh=mesh, in_specs=(P("dp"), P(), P()), out_specs=P())
    _full(f(x, ws[:N64], ws[N64:])).backward()
    loss = _full(f(2 * x, ws[:N64], ws[N64:]))
    with around_second():
        loss.backward()
    return [w.grad for w in ws]


def hooked_accumulation_ok(mesh) -> bool:
    """With a post-accumulate-grad hook on a weight (which reads ``.grad`` right after each
    accumulation, as an optimizer run in backward does), the second pass's accumulation is not
    postponed: the hook sees the final gradient."""
    seen: list = []

    def hook(ws):
        ws[3].register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))

    grads = accumulated_grads(mesh, prepare=hook)
    return len(seen) == 2 and torch.equal(seen[1], grads[3])


N_VIEWS = 8


def _views_fn(x, ws):
    h = x
    for k, w in enumerate(ws):  # a transpose, then a slice of a taller weight, in turn
        h = torch.tanh(h @ (w.T if k % 2 == 0 else w[:SIDE]))
    return ns.psum((h**2).sum(), "dp")


def view_params():
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(2 * 3, SIDE, generator=gen, dtype=torch.float64)
    shapes = [(SIDE, SIDE) if k % 2 == 0 else (SIDE + 3, SIDE) for k in range(N_VIEWS)]
    return x, [torch.randn(*s, generator=gen, dtype=torch.float64) / 2 for s in shapes]


def view_grads(mesh, around_backward=contextlib.nullcontext, sharded=False) -> tuple[list, int]:
    """The view chain's gradients (global values) and the backward psums CommMode recorded;
    ``sharded``: the weights as DTensors (``ns.shard``, a real mesh)."""
    x, ws = view_params()
    ws = [w.requires_grad_() for w in ws]
    params = ns.shard(ws, mesh, P()) if sharded else ws
    f = ns.spmd_map(_views_fn, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    psums = _backward_psums(lambda: f(x, params), around_backward)
    return [_full(p.grad) for p in params], psums


def _mixed_fn(x, ws):
    h = x
    for w in ws:
        h = torch.tanh(h @ w) if w.dim() == 2 else h * w[0] + w[1:].sum()
    return ns.psum((h**2).sum(), "dp")


def mixed_params():
    gen = torch.Generator().manual_seed(12)
    shapes = [(3, 5), (3,), (5, 7), (5,), (7, 3), (1,), (3, 3), (2,)]  # odd sizes: padding
    x = torch.randn(4, 3, generator=gen, dtype=torch.float64)
    ws = [torch.randn(*s, generator=gen, dtype=torch.float64) / 2 for s in shapes]
    return x, [w.requires_grad_() for w in ws]


def mixed_grads(mesh) -> list[torch.Tensor]:
    """Odd sizes, a weight also used outside the call and one used by two calls; two backward
    passes accumulated into ``.grad``."""
    x, ws = mixed_params()
    f = ns.spmd_map(_mixed_fn, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    g = ns.spmd_map(
        lambda x, w: ns.psum((x * w.sum()).sum(), "dp"),
        mesh=mesh,
        in_specs=(P("dp"), P()),
        out_specs=P(),
    )
    for step in range(2):
        loss = _full(f(x * (step + 1), ws)) + (ws[2] ** 2).sum() + _full(g(x, ws[4]))
        loss.backward()
    return [w.grad for w in ws]


LARGE_SIDE = 512  # a float64 [LARGE_SIDE, LARGE_SIDE] weight: 2 MiB, reduced alone (ALONE_BYTES)
LARGE_SHAPES = [(SIDE, LARGE_SIDE), (LARGE_SIDE, LARGE_SIDE), (LARGE_SIDE, SIDE), (SIDE, SIDE)]


def large_grads(mesh, around_backward=contextlib.nullcontext) -> tuple[list, int]:
    """A chain through a 2 MiB weight between small ones: the gradients and the backward psums
    CommMode recorded (the large one is reduced alone, in place, whatever the bucket size)."""
    gen = torch.Generator().manual_seed(15)
    x = torch.randn(2 * 2, SIDE, generator=gen, dtype=torch.float64)
    ws = [
        (torch.randn(*s, generator=gen, dtype=torch.float64) / s[0] ** 0.5).requires_grad_()
        for s in LARGE_SHAPES
    ]
    f = ns.spmd_map(_large_fn, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    psums = _backward_psums(lambda: f(x, ws), around_backward)
    return [w.grad for w in ws], psums


def _large_fn(x, ws):
    h = x
    for w in ws:
        h = torch.tanh(h @ w)
    return ns.psum((h**2).sum(), "dp")


# name -> (as DTensors, the weights' sharded axis)
SHARED_KINDS = {
    "dtensor_sharded": (True, "dp"),
    "dtensor_replicated": (True, None),
    "plain_replicated": (False, None),
}


def shared_params(axis: str | None):
    """``x`` (split over ``dp``), weights ``a`` and ``b`` (split over ``axis``, or the shape of
    one block of ``x`` where replicated) and the loss's weighting ``w`` (of ``x``'s shape)."""
    gen = torch.Generator().manual_seed(14)
    x, w = (torch.randn(2 * 3, SIDE, generator=gen, dtype=torch.float64) for _ in range(2))
    rows = 2 * 3 if axis else 3
    a, b = (torch.randn(rows, SIDE, generator=gen, dtype=torch.float64) for _ in range(2))
    return x, a, b, w


def shared_grads(mesh, dtensors: bool, axis: str | None) -> dict:
    """``x * (a + b)`` weighted by ``w`` summed, two backward passes (the second with ``2 *
    x``), then ``a.grad`` doubled in place (as gradient clipping scales each ``.grad``): the
    global gradients of ``a`` and ``b``, whether their ``.grad`` (local) tensors are plain, and
    whether their storages differ."""
    x, a, b, w = shared_params(axis)
    spec = P(axis)
    params = ns.shard([a, b], mesh, spec) if dtensors else [a.clone(), b.clone()]
    a, b = [t.requires_grad_() for t in params]
    f = ns.spmd_map(
        lambda x, a, b: x * (a + b), mesh=mesh, in_specs=(P("dp"), spec, spec), out_specs=P("dp")
    )
    for step in range(2):
        (_full(f((step + 1) * x, a, b)) * w).sum().backward()

    local = [g.to_local() if hasattr(g, "placements") else g for g in (a.grad, b.grad)]
    plain = all(type(t) is torch.Tensor for t in local)  # no pending gradient kept
    own = plain and local[0].untyped_storage().data_ptr() != local[1].untyped_storage().data_ptr()
    a.grad.mul_(2)
    return {"own": own, "plain": plain, "grads": [_full(a.grad).tolist(), _full(b.grad).tolist()]}


class Collectives:
    """torch's own count of the process-group calls issued inside, by kind ("allreduce",
    "reduce_scatter", "gather"; CommDebugMode sees c10d ops); :attr:`count`: the all-reduces."""

    def __init__(self):
        self.counts: dict[str, int] = {}

    @property
    def count(self) -> int:
        return self.counts.get("allreduce", 0)

    @contextlib.contextmanager
    def __call__(self):
        from torch.distributed.tensor.debug import CommDebugMode

        with CommDebugMode() as counted:
            yield
        for op, n in counted.get_comm_counts().items():
            kinds = ("allreduce", "reduce_scatter", "gather")
            kind = next((k for k in kinds if k in str(op)), str(op))
            self.counts[kind] = self.counts.get(kind, 0) + n


def _activation_only(mesh) -> dict:
    """``torch.autograd.grad(loss, [h])`` for an activation ``h`` (a DTensor made by an op)
    passed with four parameters (DTensors)."""
    gen = torch.Generator().manual_seed(17)
    ws = [torch.randn(SIDE, SIDE, generator=gen, dtype=torch.float64) for _ in range(4)]
    x = torch.randn(2 * 2, SIDE, generator=gen, dtype=torch.float64)

    def loss_of(h, *ws):
        return sum(torch.tanh(h @ w).sum() for w in ws)

    f = ns.spmd_map(
        lambda h, *ws: ns.psum(loss_of(h, *ws), "dp"),
        mesh=mesh,
        in_specs=(P("dp"),) + (P(),) * len(ws),
        out_specs=P(),
    )
    h = ns.shard(x.clone().requires_grad_(), mesh, P("dp")) * 2
    params = ns.shard([w.clone().requires_grad_() for w in ws], mesh, P())
    with ns.CommMode() as comms:
        (got,) = torch.autograd.grad(_full(f(h, *params)), [h])
    dense_h = (x * 2).requires_grad_()
    (want,) = torch.autograd.grad(loss_of(dense_h, *ws), [dense_h])
    return {
        "psums": comms.count("psum", direction="backward"),
        "grad_ok": torch.allclose(_full(got), want, rtol=1e-12, atol=1e-12),
    }


class _NoGradientForB(torch.autograd.Function):
    """``a + b.sum()`` whose backward gives ``b`` no gradient (None)."""

    @staticmethod
    def forward(a, b):
        return a + b.detach().sum()

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g, None


def _no_gradient_stays_none(mesh) -> list[bool]:
    """Whether the DTensor ``b`` that gets no gradient still has ``.grad`` None after backward:
    ``a`` a plain tensor, then a DTensor (one DTensor input, then two); then ``b`` split in
    blocks of unequal sizes (an uneven call)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    nones = []
    for a_dtensor, uneven in ((False, False), (True, False), (False, True)):
        f = ns.spmd_map(
            lambda x, a, b: ns.psum((x * _NoGradientForB.apply(a, b)).sum(), "dp"),
            mesh=mesh,
            in_specs=(P("dp"), P(), P("dp" if uneven else None)),
            out_specs=P(),
        )
        a = torch.ones(SIDE, dtype=torch.float64, requires_grad=True)
        b = torch.ones(2 * 2 + uneven, dtype=torch.float64)
        if uneven:
            b = distribute_tensor(b, mesh.device_mesh, [Shard(0)]).requires_grad_()
        else:
            b = ns.shard(b.requires_grad_(), mesh, P())
        x = torch.ones(2 * 2, SIDE, dtype=torch.float64)
        _full(f(x, ns.shard(a, mesh, P()) if a_dtensor else a, b)).backward()
        nones.append(b.grad is None)
    return nones


def _first_bad_argument(mesh) -> str:
    """The error of a call whose two DTensor arguments are both laid out against their specs."""
    a = ns.shard(torch.ones(2 * 2, SIDE, dtype=torch.float64, requires_grad=True), mesh, P("dp"))
    b = ns.shard(torch.ones(2 * 2, SIDE, dtype=torch.float64), mesh, P("dp"))
    f = ns.spmd_map(
        lambda a, b: ns.psum((a * b).sum(), "dp"), mesh=mesh, in_specs=(P(), P()), out_specs=P()
    )
    try:
        f(a, b)
    except ns.SpecError as e:
        return str(e)
    return "no error"


def dtensor_input_checks(mesh) -> dict:
    return {
        "activation_only": _activation_only(mesh),
        "none_stays_none": _no_gradient_stays_none(mesh),
        "first_bad": _first_bad_argument(mesh),
    }


def checkpointed_view(mesh) -> dict:
    """``w.T`` used before and inside a (selective) checkpoint, three steps: whether the
    gradient is dense torch's, and the contexts alive after them."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    def save_none(ctx, op, *args, **kwargs):
        return CheckpointPolicy.PREFER_RECOMPUTE

    def body(x, w):
        h = torch.tanh(x @ w.T)
        h = checkpoint(
            lambda h: torch.tanh(h @ w.T),
            h,
            use_reentrant=False,
            context_fn=lambda: create_selective_checkpoint_contexts(save_none),
        )
        return ns.psum((h**2).sum(), "dp")

    x, ws = view_params()
    w = ws[0].requires_grad_()
    f = ns.spmd_map(body, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    for _ in range(3):
        _full(f(x, w)).backward()
    dense = ws[0].detach().requires_grad_()
    (torch.tanh(torch.tanh(x @ dense.T) @ dense.T) ** 2).sum().backward()
    ok = torch.allclose(w.grad, 3 * dense.grad, rtol=1e-12, atol=1e-12)
    return {"grad_ok": ok, "contexts": _live_contexts()}


def _live_contexts() -> int:
    from named_spmd._context import SpmdContext

    gc.collect()
    return sum(isinstance(o, SpmdContext) for o in gc.get_objects())


def _registry() -> int:
    return torch._C._distributed_c10d._get_work_registry_size()


def run(mesh) -> list[dict]:
    from named_spmd.backends._dist_buckets import set_grad_bucket_mb

    outcomes = []
    set_grad_bucket_mb(0)
    plain_uniform, plain_mixed = uniform_grads(mesh)[0], mixed_grads(mesh)
    plain_accumulated = accumulated_grads(mesh)
    dtensor_inputs = dtensor_input_checks(mesh)
    checkpointed = checkpointed_view(mesh)
    for name, mb in SIZES_MB.items():
        set_grad_bucket_mb(mb)
        before = _registry()
        reduces, second = Collectives(), Collectives()
        grads, psums = uniform_grads(mesh, reduces)
        views = {}
        for sharded in (False, True):
            view_reduces = Collectives()
            got, view_psums = view_grads(mesh, view_reduces, sharded)
            views["dtensor" if sharded else "plain"] = {
                "grads": [g.tolist() for g in got],
                "all_reduces": view_reduces.count,
                "psums": view_psums,
                "contexts": _live_contexts(),
            }
        mixed = mixed_grads(mesh)
        shared = {k: shared_grads(mesh, *how) for k, how in SHARED_KINDS.items()}
        accumulated = accumulated_grads(mesh, second)
        large_reduces = Collectives()
        large, large_psums = large_grads(mesh, large_reduces)
        outcomes.append(
            {
                "size": name,
                "grads": [g.tolist() for g in grads],
                "mixed": [g.tolist() for g in mixed],
                "accumulated": [g.tolist() for g in accumulated],
                "bitwise": all(map(torch.equal, grads, plain_uniform)),
                "mixed_bitwise": all(map(torch.equal, mixed, plain_mixed)),
                "accumulated_bitwise": all(map(torch.equal, accumulated, plain_accumulated)),
                "all_reduces": reduces.count,
                "accumulating_all_reduces": second.count,
                "hooked_ok": hooked_accumulation_ok(mesh),
                "views": views,
                "large": {
                    "grads": [g.tolist() for g in large],
                    "all_reduces": large_reduces.count,
                    "psums": large_psums,
                },
                "shared": shared,
                "dtensor_inputs": dtensor_inputs,
                "checkpointed_view": checkpointed,
                "psums": psums,
                "left": _registry() - before,
                "plain": all(type(g) is torch.Tensor for g in grads + mixed + accumulated),
            }
        )
    set_grad_bucket_mb(None)
    return outcomes


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    if "--late" in sys.argv:
        from dist_worker import delay_overlapped_reductions

        delay_overlapped_reductions()
    mesh = ns.make_mesh((2,), ("dp",))
    try:
        outcomes = run(mesh)
    except Exception as e:  # noqa: BLE001 - reported to the test
        import traceback

        outcomes = [{"error": type(e).__name__, "message": traceback.format_exc()[-3000:]}]
    for o in outcomes:
        print("OUTCOME " + json.dumps({"rank": dist.get_rank(), **o}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
