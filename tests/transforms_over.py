"""torch.func transforms, forward-mode AD and double backward OVER a mapped function: programs run
on every backend.

Three mapped functions on a mesh of two instances ("x"), with collectives: ``psum(x * w, "x")``
(``x`` split, ``w`` replicated), ``all_gather(x, "x", tiled=True)`` into a split output, and a
Megatron-like ``psum(tanh(x @ w1) @ w2, "x")`` (``x`` replicated, ``w1`` / ``w2`` split). Inputs
are plain global float64 tensors (every rank passes the same value), except in the programs
named ``*_dtensor``, which pass a DTensor on the real mesh.

* Under a ``torch.func`` transform the call returns plain tensors holding the global value on
  every backend (functorch cannot carry DTensors), so those programs are the same code on the
  simulated and the real mesh. So does an output carrying a forward-mode tangent (``dual_level``:
  DTensor has no forward AD).
* Double backward needs no functorch: on the real mesh the outputs are DTensors, read with
  ``.full_tensor()`` (:func:`full`), as outside any transform.

``python tests/transforms_over.py`` under a 2-process job prints one ``OUTCOME {json}`` line per
program (tests/test_distributed.py compares them with the simulated mesh).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD
from torch.func import grad, hessian, jacfwd, jacrev, jvp, vjp, vmap
from torch.fx.experimental.proxy_tensor import make_fx

import named_spmd as ns
from named_spmd import P

F64 = torch.float64


def _randn(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


X, W = _randn(8, seed=0), _randn(4, seed=1)  # psum_prod: x split, w replicated
W8 = _randn(8, seed=2)  # gathered: replicated, the gathered length
XM, W1, W2 = _randn(3, 4, seed=3), _randn(4, 6, seed=4), _randn(6, 4, seed=5)  # megatron
TX, TW, TXM, TW1 = _randn(8, seed=6), _randn(4, seed=7), _randn(3, 4, seed=8), _randn(4, 6, seed=9)
CT4, CT16, CTM = _randn(4, seed=10), _randn(16, seed=11), _randn(3, 4, seed=12)
XB, XMB = _randn(3, 8, seed=13), _randn(2, 3, 4, seed=14)  # batches of global inputs
K8, KM = _randn(8, seed=15), _randn(4, 6, seed=16)


def full(y: torch.Tensor) -> torch.Tensor:
    """The global value of an output: ``full_tensor()`` of a DTensor (real mesh, no transform)."""
    return y.full_tensor() if hasattr(y, "full_tensor") else y


def sharded(mesh, x: torch.Tensor) -> torch.Tensor:
    """``x`` split over "x" as a DTensor on a real mesh; the plain global value when simulated."""
    if mesh.device_mesh is None:
        return x
    from torch.distributed.tensor import Shard, distribute_tensor

    return distribute_tensor(x, mesh.device_mesh, [Shard(0)])


def mapped(mesh) -> dict:
    return {
        "mesh": mesh,
        "psum_prod": ns.spmd_map(
            lambda x, w: ns.psum(x * w, "x"), mesh=mesh, in_specs=(P("x"), P()), out_specs=P()
        ),
        "gathered": ns.spmd_map(
            lambda x, w: (ns.all_gather(x, "x", tiled=True) * w).sin(),
            mesh=mesh,
            in_specs=(P("x"), P()),
            out_specs=P("x"),
        ),
        "megatron": ns.spmd_map(
            lambda x, w1, w2: ns.psum(torch.tanh(x @ w1) @ w2, "x"),
            mesh=mesh,
            in_specs=(P(), P(None, "x"), P("x", None)),
            out_specs=P(),
        ),
        "complex": ns.spmd_map(
            lambda z, w: (
                (z * ns.all_gather(z, "x", tiled=True, to="invariant")[:4] * w).sin()
                + ns.psum(z * w, "x")
            ),
            mesh=mesh,
            in_specs=(P("x"), P()),
            out_specs=P("x"),
        ),
        # a reduced result (all_gather to "reduced") and a reduced cast: their transposes'
        # cotangents are partial sums, which a second derivative must not sum again
        "gathered_reduced": ns.spmd_map(
            lambda x: torch.tanh(ns.all_gather(x, "x", tiled=True, to="reduced")),
            mesh=mesh,
            in_specs=P("x"),
            out_specs=P(),
        ),
        "cast_reduced": ns.spmd_map(
            lambda x, w: ns.psum(torch.tanh(x * ns.pcast(w, "x", to="reduced")), "x"),
            mesh=mesh,
            in_specs=(P("x"), P()),
            out_specs=P(),
        ),
        "unreduced": ns.spmd_map(  # a partial-sum output: its global value is the parts' sum
            lambda x, w: x @ w,
            mesh=mesh,
            in_specs=(P(None, "x"), P("x")),
            out_specs=P(unreduced={"x"}),
        ),
        # a partial-sum input (its global value split into parts, one per member) and a reduced
        # one (its gradient's parts summed): each instance's part at the boundary
        "unreduced_input": ns.spmd_map(
            lambda x, w: torch.tanh(ns.psum(x * 3.0, "x")).sum() * w,
            mesh=mesh,
            in_specs=(P(unreduced={"x"}), P(reduced={"x"})),
            out_specs=P(),
        ),
        "view_of_replicated": ns.spmd_map(  # w: cast (a view of it) and read through a view
            lambda x, w: (ns.psum(x * w, "x"), w.reshape(2, 2) * 3.0),
            mesh=mesh,
            in_specs=(P("x"), P()),
            out_specs=(P(), P()),
        ),
    }


# --- torch.func over the call: plain global outputs, the same code on every backend -------------


def grad_split(f):
    return grad(lambda x: f["psum_prod"](x, W).pow(2).sum())(X)


def grad_split_and_replicated(f):
    return grad(lambda x, w: f["psum_prod"](x, w).sin().sum(), argnums=(0, 1))(X, W)


def grad_megatron(f):
    loss = lambda x, w1, w2: (f["megatron"](x, w1, w2) * CTM).sum()  # noqa: E731
    return grad(loss, argnums=(0, 1, 2))(XM, W1, W2)


def vjp_gathered(f):
    out, pull = vjp(lambda x, w: f["gathered"](x, w), X, W8)
    return (out, *pull(CT16))


def vjp_megatron(f):
    out, pull = vjp(f["megatron"], XM, W1, W2)
    return (out, *pull(CTM))


def jvp_psum(f):
    return jvp(f["psum_prod"], (X, W), (TX, TW))


def jvp_gathered(f):
    return jvp(lambda x: f["gathered"](x, W8), (X,), (TX,))


def jvp_megatron(f):
    return jvp(lambda x, w1: f["megatron"](x, w1, W2), (XM, W1), (TXM, TW1))


def jvp_twice_view_of_replicated(f):
    """The same replicated input in two calls under jvp: the caller's tensor is the base of the
    input's view in each, and its type from the first call must not be read in the second (the
    storage of its varying cast would type its invariant view varying: out_specs refused)."""
    run = lambda w: f["view_of_replicated"](X, w)  # noqa: E731
    return jvp(run, (W,), (TW,)), jvp(run, (W,), (TX[:4],))


def jacrev_complex(f):
    """Complex values inside and out of the call (real in and out of jacrev, which refuses
    complex ones): complex collectives, a complex replicated input and split output."""

    def real_of(x, w):
        z = f["complex"](torch.complex(x, x.cos()), torch.complex(w, -w))
        return torch.view_as_real(z)

    return jacrev(real_of, argnums=(0, 1))(X, W)


def jacrev_psum(f):
    return jacrev(f["psum_prod"], argnums=(0, 1))(X, W)


def jacrev_gathered(f):
    return jacrev(lambda x: f["gathered"](x, W8))(X)


def jacfwd_psum(f):
    return jacfwd(f["psum_prod"], argnums=(0, 1))(X, W)


def jacfwd_megatron(f):
    return jacfwd(lambda w1: f["megatron"](XM, w1, W2))(W1)


def hessian_split(f):
    return hessian(lambda x: f["psum_prod"](x, W).sin().sum())(X)


def hessian_megatron(f):  # replicated x, then split w1
    loss = lambda x, w1: (f["megatron"](x, w1, W2) * CTM).sum()  # noqa: E731
    return hessian(loss, argnums=(0, 1))(XM, W1)


def vmap_psum(f):
    return vmap(lambda x: f["psum_prod"](x, W))(XB)


def vmap_gathered(f):
    return vmap(lambda x: f["gathered"](x, W8))(XB)


def vmap_megatron(f):
    return vmap(lambda x: f["megatron"](x, W1, W2))(XMB)


def vmap_of_grad(f):
    return vmap(grad(lambda x: f["psum_prod"](x, W).pow(2).sum()))(XB)


def jvp_of_grad(f):
    return jvp(grad(lambda x: f["gathered"](x, W8).sum()), (X,), (TX,))


def grad_closed_over_dtensor(f):  # a DTensor argument the transform does not wrap
    d = sharded(f["mesh"], X)
    return grad(lambda w: f["psum_prod"](d, w).pow(2).sum())(W)


def vmap_closed_over_dtensor(f):
    d = sharded(f["mesh"], X)
    return vmap(lambda w: f["psum_prod"](d, w))(XB[:, :4])


def compiled_dtensor_on_an_equal_mesh(f):
    """A DTensor on a DeviceMesh equal to the mapped mesh's but another object (a user's own
    ``init_device_mesh``), into a call compiled in one graph: the eager numbers."""
    d = X
    if f["mesh"].device_mesh is not None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        own = f["mesh"].device_mesh
        equal = init_device_mesh("cpu", tuple(own.shape), mesh_dim_names=own.mesh_dim_names)
        d = distribute_tensor(X, equal, [Shard(0)])
    return torch.compile(f["psum_prod"], backend="aot_eager", fullgraph=True)(d, W)


def grad_of_transformed_dtensor(f):  # refused with the fix on a real mesh
    return grad(lambda x: f["psum_prod"](x, W).sum())(sharded(f["mesh"], X))


# --- forward-mode AD and double backward: DTensor outputs on the real mesh -----------------------


def vmap_unreduced(f):
    return vmap(f["unreduced"], in_dims=(0, None))(torch.stack([XM, TXM]), W1)


def vmap_unreduced_input(f):
    return vmap(f["unreduced_input"], in_dims=(0, None))(torch.stack([X, TX]), W)


def grad_unreduced_input(f):
    return grad(lambda x, w: f["unreduced_input"](x, w).sum(), argnums=(0, 1))(X, W)


def jvp_unreduced(f):
    return jvp(lambda w: f["unreduced"](XM, w), (W1,), (TW1,))


def dual_level_unreduced(f):
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(f["unreduced"](XM, fwAD.make_dual(W1, TW1)))
        return full(primal), full(tangent)


def dual_level_split(f):
    with fwAD.dual_level():
        y = f["psum_prod"](fwAD.make_dual(X, TX), fwAD.make_dual(W, TW))
        primal, tangent = fwAD.unpack_dual(y)
        return full(primal), full(tangent)


def dual_level_megatron(f):
    with fwAD.dual_level():
        y = f["megatron"](fwAD.make_dual(XM, TXM), fwAD.make_dual(W1, TW1), W2)
        primal, tangent = fwAD.unpack_dual(y)
        return full(primal), full(tangent)


def dual_level_gathered(f):
    with fwAD.dual_level():
        primal, tangent = fwAD.unpack_dual(f["gathered"](fwAD.make_dual(X, TX), W8))
        return full(primal), full(tangent)


def double_backward_split(f):
    x = X.clone().requires_grad_()
    (gx,) = torch.autograd.grad(full(f["psum_prod"](x, W)).sin().sum(), x, create_graph=True)
    return gx, *torch.autograd.grad((gx * K8).sum(), x)


def double_backward_replicated(f):
    w = W.clone().requires_grad_()
    (gw,) = torch.autograd.grad(full(f["psum_prod"](X, w)).pow(3).sum(), w, create_graph=True)
    return gw, *torch.autograd.grad((gw * CT4).sum(), w)


def double_backward_gathered(f):
    x = X.clone().requires_grad_()
    (gx,) = torch.autograd.grad((full(f["gathered"](x, W8)) * CT16).sum(), x, create_graph=True)
    return gx, *torch.autograd.grad((gx * K8).sum(), x)


def double_backward_megatron(f):
    x, w1 = XM.clone().requires_grad_(), W1.clone().requires_grad_()
    loss = (full(f["megatron"](x, w1, W2)) * CTM).sum()
    gx, gw1 = torch.autograd.grad(loss, (x, w1), create_graph=True)
    return gx, gw1, *torch.autograd.grad((gx**2).sum() + (gw1 * KM).sum(), (x, w1))


def double_backward_gathered_reduced(f):
    x = X.clone().requires_grad_()
    (gx,) = torch.autograd.grad((full(f["gathered_reduced"](x)) * K8).sum(), x, create_graph=True)
    return gx, *torch.autograd.grad((gx * TX).sum(), x)


def compiled_grad_in_one_graph(f):
    """``torch.compile(torch.func.grad(call), fullgraph=True)``: the eager grad's numbers on the
    simulated mesh, which traces the call under the transform; a real mesh refuses to, naming
    the fix (``REAL_MESH_ERRORS``)."""
    loss = grad(lambda x, w: (f["gathered"](x, w) * CT16).sum(), argnums=(0, 1))
    return torch.compile(loss, backend="aot_eager", fullgraph=True)(X, W8)


def double_backward_cast_reduced(f):
    w = W.clone().requires_grad_()
    (gw,) = torch.autograd.grad((full(f["cast_reduced"](X, w)) * CT4).sum(), w, create_graph=True)
    return gw, *torch.autograd.grad((gw * TW).sum(), w)


# --- make_fx over the call: a graph that computes its outputs from its inputs --------------------


def make_fx_replayed(f):
    """``make_fx`` of calls with plain inputs, traced on one set of inputs and run on another:
    the second set's outputs (plain global tensors on every backend), not the traced ones."""
    psum_prod = make_fx(f["psum_prod"])(X, W)
    gathered = make_fx(f["gathered"])(X, W8)
    return psum_prod(TX, TW), gathered(TX, W8.flip(0))


def make_fx_replayed_grad(f):
    """A traced gradient of a plain split input (its backward gathers in the graph)."""

    def loss_grad(x, w):
        return torch.autograd.grad((full(f["gathered"](x, w)) * CT16).sum(), x)[0]

    traced = make_fx(loss_grad)(X.clone().requires_grad_(), W8)
    return traced(TX.clone().requires_grad_(), W8.flip(0))


def exported_replayed(f):
    """Non-strict ``torch.export`` (make_fx pre-dispatch) of a call, run on other inputs."""

    class Module(torch.nn.Module):
        def forward(self, x, w):
            return f["psum_prod"](x, w)

    return torch.export.export(Module(), (X, W), strict=False).module()(TX, TW)


def exported_dtensor(f):
    """A split DTensor input under non-strict ``torch.export`` (its local block read by the
    graph, not kept as a constant, unlike make_fx's: make_fx_of_dtensor), run on another."""

    class Module(torch.nn.Module):
        def forward(self, x, w):
            return f["psum_prod"](x, w)

    exported = torch.export.export(Module(), (sharded(f["mesh"], X), W), strict=False)
    return exported.module()(sharded(f["mesh"], TX), TW)


def make_fx_of_dtensor(f):  # refused with the fix (make_fx(f.local)) on a real mesh
    traced = make_fx(f["psum_prod"])(sharded(f["mesh"], X), W)
    return traced(sharded(f["mesh"], TX), TW)


PROGRAMS = {
    f.__name__: f
    for f in (
        grad_split,
        grad_split_and_replicated,
        grad_megatron,
        vjp_gathered,
        vjp_megatron,
        jvp_psum,
        jvp_gathered,
        jvp_megatron,
        jvp_twice_view_of_replicated,
        jacrev_complex,
        jacrev_psum,
        jacrev_gathered,
        jacfwd_psum,
        jacfwd_megatron,
        hessian_split,
        hessian_megatron,
        vmap_psum,
        vmap_gathered,
        vmap_megatron,
        vmap_of_grad,
        jvp_of_grad,
        grad_closed_over_dtensor,
        vmap_closed_over_dtensor,
        compiled_dtensor_on_an_equal_mesh,
        grad_of_transformed_dtensor,
        dual_level_split,
        dual_level_megatron,
        dual_level_gathered,
        vmap_unreduced,
        vmap_unreduced_input,
        grad_unreduced_input,
        jvp_unreduced,
        dual_level_unreduced,
        double_backward_split,
        double_backward_replicated,
        double_backward_gathered,
        double_backward_megatron,
        double_backward_gathered_reduced,
        double_backward_cast_reduced,
        compiled_grad_in_one_graph,
        make_fx_replayed,
        make_fx_replayed_grad,
        exported_replayed,
        exported_dtensor,
        make_fx_of_dtensor,
    )
}


#: Programs the real mesh refuses (with the fix in the message); the simulated mesh has no DTensor.
REAL_MESH_ERRORS = {
    "grad_of_transformed_dtensor": "SpecError",
    "make_fx_of_dtensor": "SpecError",
    # Dynamo's refusal, whose cause is named_spmd's SpmdError
    "compiled_grad_in_one_graph": "Unsupported",
}


def _flat(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [full(out).detach().tolist()]


def run(name: str, mesh) -> dict:
    """``{"value": [...]}`` (every result, global) or ``{"error": class, "message": text}``."""
    try:
        out = PROGRAMS[name](mapped(mesh))
    except Exception as e:  # noqa: BLE001 - the outcome is compared with the simulated mesh
        return {"error": type(e).__name__, "message": str(e)[:2000]}
    return {"value": _flat(out)}


if __name__ == "__main__":
    from _dist_launch import report_outcomes

    report_outcomes(PROGRAMS, run)
