"""One-rank NCCL check of the distributed backend's cuda path (NCCL refuses two ranks on one
GPU, so with a single GPU this is what can run): every collective, forward and backward, on
cuda tensors, against the simulated backend on CPU: values, gradients, communication counts.

    python tests/dist_nccl_smoke.py      (tests/test_distributed.py runs it when CUDA exists)

One rank needs no rendezvous: an in-process HashStore, so no port is chosen at all.
"""

import os

import torch
import torch.distributed as dist

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
torch.cuda.set_device(0)
dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402

real = ns.make_mesh((1, 1), ("dp", "tp"))
sim = ns.make_mesh((1, 1), ("dp", "tp"), simulated=True)
print(real, real.device_type)


def prog(x, w):
    h = torch.tanh(x @ w)
    a = ns.psum(h, "tp")
    b = ns.all_gather(h, ("dp", "tp"), axis=1, tiled=True)
    c = ns.psum_scatter(b, "tp", scatter_dimension=0, tiled=True)
    d = ns.all_to_all(c, "dp", 0, 1, tiled=True)
    e = ns.ppermute(d, "tp", [(0, 0)])
    f = ns.pmax(e, ("tp", "dp")) + ns.pmin(a, "dp") + ns.axis_index("tp")
    return f, a


outs = {}
for name, mesh, dev in (("real", real, "cuda"), ("sim", sim, "cpu")):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4, 6, generator=g, dtype=torch.float64).to(dev).requires_grad_()
    w = torch.randn(6, 3, generator=g, dtype=torch.float64).to(dev).requires_grad_()
    fn = ns.spmd_map(
        prog,
        mesh=mesh,
        in_specs=(P("dp", None), P(None, "tp")),
        out_specs=(P(("dp", "tp"), None), P("dp", None)),
    )
    with ns.CommMode() as cm:
        f, a = fn(x, w)
        f = f.full_tensor() if hasattr(f, "full_tensor") else f
        a = a.full_tensor() if hasattr(a, "full_tensor") else a
        (f.sum() + (a * a).sum()).backward()
    outs[name] = [t.detach().cpu() for t in (f, a, x.grad, w.grad)], cm.counts()
for k, (r, s) in enumerate(zip(outs["real"][0], outs["sim"][0])):
    print("tensor", k, "max err", (r - s).abs().max().item())
    assert torch.allclose(r, s, atol=1e-12)
assert outs["real"][1] == outs["sim"][1], ("communication differs", outs["real"][1], outs["sim"][1])
print("NCCL one-rank smoke OK; comms", outs["real"][1])
dist.destroy_process_group()
