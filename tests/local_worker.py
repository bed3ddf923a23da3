"""``SpmdFunction.local`` on a real (2, 2) mesh ("dp", "tp"), 4 gloo processes: run by
tests/test_local.py. Every rank prints one ``OUTCOME {json}`` per check (name, ``ok`` or the
error):

* ``mlp``: a Megatron MLP with biases under data parallel (x split over dp, w1/b1 columns and
  w2 rows over tp, b2 replicated), the loss a pmean over dp of a psum over tp;
* ``outputs``: outputs split over both axes, in non-mesh order (``P(("tp", "dp"))``), tiled
  (invariant over tp, named by the out_spec: its blocks' cotangents summed) and unreduced
  over tp;

  both against the same program on a simulated mesh in this process: each local output is
  this rank's block of the simulated output, each input block's gradient its block of the
  simulated gradient (the replicated bias: the whole of it);
* ``counts``: CommMode of the local call counts no boundary collective (the global call
  gathers the gradients of split plain inputs);
* ``reduced``: a reduced input (``P(reduced={"dp"})``): each rank's gradient is its part, the
  parts summing to the simulated gradient;
* ``compiled``: ``mlp`` and ``outputs`` again, ``.local`` called in a function compiled whole
  (``torch.compile(fullgraph=True)``, aot_eager), and ``mlp`` by ``ns.compile(f.local)``;
* ``dtensor``: a DTensor passed to ``.local`` is a SpecError that says what to pass;
* ``specs``: a block whose rank its spec does not fit is the SpecError of a global call;
* ``uneven``: rank 3 passes a larger block: every rank raises, listing the block shapes;
* ``debug``: in debug mode, replicated blocks that differ between ranks are an SpmdError;
  split blocks, which differ by design, are not checked.
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist

import named_spmd as ns
from named_spmd import P
from named_spmd._layout import block

MLP_SPECS = (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P())


def mlp(x, w1, b1, w2, b2):
    h = torch.relu(x @ w1 + b1)
    y = ns.psum(h @ w2, "tp") + b2
    return ns.pmean((y * y).sum().reshape(1), "dp")


def outputs(x, w):
    h = x @ w  # varies over dp and tp
    tiled = ns.psum(h, "tp")  # invariant over tp, its out_spec names tp
    part = ns.pcast(h.sum(-1), "tp", to="unreduced")
    return h, tiled, part


OUT_SPECS = (P(("tp", "dp"), None), P("dp", "tp"), P("dp", unreduced={"tp"}))
OUT_IN = (P(("tp", "dp"), None), P(None, "tp"))


def global_inputs(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True) for s in shapes]


def blocks(mesh, xs, specs):
    """This rank's blocks of ``xs``, as new leaves."""
    return [
        block(x.detach(), s, mesh._shape, mesh.my_coords).clone().requires_grad_()
        for x, s in zip(xs, specs)
    ]


def close(a, b):
    return torch.allclose(a, b, rtol=1e-10, atol=1e-12)


def simulated(fn, in_specs, out_specs, xs, cots):
    """The reference: the same program on a simulated (2, 2) mesh, global values in and out,
    differentiated with cotangents ``cots``: (outputs, gradients of ``xs``)."""
    sim = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    leaves = [x.detach().requires_grad_() for x in xs]
    outs = ns.spmd_map(fn, mesh=sim, in_specs=in_specs, out_specs=out_specs)(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((y * c).sum() for y, c in zip(outs, cots)).backward()
    return [y.detach() for y in outs], [x.grad for x in leaves]


def check_against_simulated(mesh, fn, in_specs, out_specs, shapes, out_shapes, compiled=""):
    """``f.local`` on this rank's blocks (``compiled``: "torch", in a function compiled whole;
    "ns", ``ns.compile(f.local)``): every
    output is its block of the simulated mesh's output (a partial sum: its part, the parts
    summing to that block), every input block's gradient its block of the simulated gradient."""
    xs = global_inputs(shapes, 1)
    cots = [c.detach() for c in global_inputs(out_shapes, 2)]
    outs, grads = simulated(fn, in_specs, out_specs, xs, cots)
    specs = (out_specs,) if isinstance(out_specs, ns.PartitionSpec) else out_specs
    locs = blocks(mesh, xs, in_specs)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    call = f.local
    if compiled == "torch":  # a function calling .local, compiled
        call = torch.compile(lambda *a: f.local(*a), fullgraph=True, backend="aot_eager")
    elif compiled == "ns":
        call = ns.compile(f.local, fullgraph=True, backend="aot_eager")
    mine = call(*locs)
    mine = mine if isinstance(mine, tuple) else (mine,)
    total = torch.zeros((), dtype=torch.float64)
    for y, got, c, s in zip(outs, mine, cots, specs):
        assert type(got) is torch.Tensor, type(got)
        whole = _summed(mesh, got, s.unreduced)  # this rank's part: the parts sum to the block
        want = block(y, s, mesh._shape, mesh.my_coords)
        assert close(whole, want), (s, whole, want)
        # the ranks' losses sum to the global one (a partial sum's cotangent: the global one)
        total = total + (got * block(c, s, mesh._shape, mesh.my_coords)).sum()
    total.backward()
    for g, b, s in zip(grads, locs, in_specs):
        assert b.grad is not None, s
        got = _summed(mesh, b.grad, s.reduced)  # a reduced input's gradient: this rank's part
        want = block(g, s, mesh._shape, mesh.my_coords)
        assert close(got, want), (s, got, want)


def _summed(mesh, part: torch.Tensor, axes) -> torch.Tensor:
    """The sum over ``axes`` of the ranks' ``part``s (a copy)."""
    whole = part.detach().clone()
    for axis in axes:
        dist.all_reduce(whole, group=mesh.device_mesh.get_group(axis))
    return whole


MLP_SHAPES = [(8, 6), (6, 12), (12,), (12, 6), (6,)]
OUT_SHAPES = ([(8, 6), (6, 4)], [(8, 2), (4, 4), (4,)])


def reduced_in(x, r):
    return ns.psum((x * r).sum().reshape(1), ("dp", "tp"))


def check_reduced(mesh):
    specs = (P(("dp", "tp")), P(reduced={"dp"}))
    check_against_simulated(mesh, reduced_in, specs, P(), [(8,), (2,)], [(1,)])


def check_mlp(mesh):
    check_against_simulated(mesh, mlp, MLP_SPECS, P(), MLP_SHAPES, [(1,)])


def check_outputs(mesh):
    check_against_simulated(
        mesh, outputs, OUT_IN, OUT_SPECS, [(8, 6), (6, 4)], [(8, 2), (4, 4), (4,)]
    )


def check_counts(mesh):
    f = ns.spmd_map(mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P())
    xs = global_inputs(MLP_SHAPES, 0)
    with ns.CommMode() as glob:
        f(*xs).full_tensor().sum().backward()
    with ns.CommMode() as loc:
        f.local(*blocks(mesh, xs, MLP_SPECS)).sum().backward()
    boundary = [e for e in loc.events if e.boundary and e.op != "pmax"]  # (the start check)
    assert not boundary, boundary
    gathers = [e for e in glob.events if e.boundary and e.op == "all_gather"]
    assert gathers, glob.events  # the global call does gather: the count can tell them apart
    inner = [e for e in loc.events if not e.boundary]
    assert inner == [e for e in glob.events if not e.boundary], (inner, glob.events)


def check_compiled(mesh):
    check_against_simulated(mesh, mlp, MLP_SPECS, P(), MLP_SHAPES, [(1,)], compiled="torch")
    check_against_simulated(mesh, outputs, OUT_IN, OUT_SPECS, *OUT_SHAPES, compiled="torch")
    check_against_simulated(mesh, mlp, MLP_SPECS, P(), MLP_SHAPES, [(1,)], compiled="ns")


def raises(error: type, call, *needles: str) -> None:
    """``call()`` raises ``error`` with every one of ``needles`` in its message."""
    try:
        call()
    except error as e:
        assert all(n in str(e) for n in needles), (needles, e)
        return
    raise AssertionError(f"no {error.__name__} raised (expected {needles})")


def check_dtensor(mesh):
    f = ns.spmd_map(mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P())
    dtensors = ns.shard([x.detach() for x in global_inputs(MLP_SHAPES, 0)], mesh, list(MLP_SPECS))
    needles = ("is a DTensor, but a local call takes this rank's blocks", "blocks=True")
    raises(ns.SpecError, lambda: f.local(*dtensors), *needles)


def check_specs(mesh):
    f = ns.spmd_map(mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P())
    locs = blocks(mesh, global_inputs(MLP_SHAPES, 0), MLP_SPECS)
    locs[1] = locs[1][0]  # w1's block as a vector: its spec P(None, "tp") has two entries
    raises(ns.SpecError, lambda: f.local(*locs), "argument [1]", "P(None, 'tp')")


def check_uneven(mesh):
    f = ns.spmd_map(mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P())
    locs = blocks(mesh, global_inputs(MLP_SHAPES, 0), MLP_SPECS)
    if dist.get_rank() == 3:  # a larger block of x than the others
        locs[0] = torch.cat([locs[0], locs[0]])
    needles = ("different block shapes", ".local([8, 6] float64", ".local([4, 6] float64")
    raises(ns.SpmdError, lambda: f.local(*locs), *needles)


def check_debug(mesh):
    f = ns.spmd_map(mlp, mesh=mesh, in_specs=MLP_SPECS, out_specs=P())
    locs = blocks(mesh, global_inputs(MLP_SHAPES, 0), MLP_SPECS)
    ns.set_debug(True)
    try:
        f.local(*locs)  # split blocks differ between ranks: not an error
        locs[4] = locs[4] + dist.get_rank()  # the replicated b2 now differs
        needles = ("leaves [4]", "replicated blocks of a local call")
        raises(ns.SpmdError, lambda: f.local(*locs), *needles)
    finally:
        ns.set_debug(None)


def main() -> None:
    dist.init_process_group("gloo")
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    for name in sys.argv[1].split(","):
        try:
            globals()[f"check_{name}"](mesh)
            out = {"ok": True}
        except Exception as e:  # noqa: BLE001 - reported, the test names it
            out = {"error": f"{type(e).__name__}: {e}"[:3000]}
        print("OUTCOME " + json.dumps({"rank": dist.get_rank(), "check": name, **out}), flush=True)


if __name__ == "__main__":
    main()
