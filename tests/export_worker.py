"""Strict ``torch.export`` of mapped calls on a real mesh of one gloo process (launched by
tests/test_export.py): with warnings as errors, the exported module's outputs on other inputs
equal the eager call's and the dense computation's. Prints ``EXPORT {json}``.

Also the programs (``megatron``, ``dense``, ``Model``) tests/test_export.py exports on the
simulated mesh.
"""

from __future__ import annotations

import json
import warnings

import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

SPECS = (P("dp"), P(None, "tp"), P(None, "tp"), P("tp"))


def megatron(x, w1, b1, w2):
    """A Megatron MLP: a column-parallel matmul, a row-parallel one reduced over tp."""
    return ns.psum(F.gelu(x @ w1 + b1) @ w2, "tp")


def dense(x, w1, b1, w2):
    return F.gelu(x @ w1 + b1) @ w2


def inputs(seed: int) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(4, 6), (6, 8), (1, 8), (8, 6)]
    return tuple(torch.randn(s, generator=g, dtype=torch.float64) for s in shapes)


class Model(torch.nn.Module):
    def __init__(self, f) -> None:
        super().__init__()
        self.f = f

    def forward(self, *args):
        return self.f(*args) * 2


def exported(f) -> torch.nn.Module:
    """``Model(f)`` exported strict (Dynamo), every warning an error, traced on inputs(0)."""
    return exported_module(Model(f), inputs(0))


def exported_module(module: torch.nn.Module, args: tuple) -> torch.nn.Module:
    """``module`` exported strict (Dynamo), every warning an error, traced on ``args``."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        return torch.export.export(module, args, strict=True).module()


def method_model(mesh, local: bool = False) -> torch.nn.Module:
    """The MLP as a module whose mapped method reads its parameters (``self.w1``...: the
    instance closed over, its tensors invariant), not arguments: Dynamo meets them first inside
    the call. ``local``: the method's ``.local`` call (a real mesh's blocks)."""

    class MethodModel(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            _, w1, b1, w2 = inputs(2)
            self.w1, self.b1, self.w2 = (torch.nn.Parameter(w) for w in (w1, b1, w2))

        @ns.spmd_map(mesh=mesh, in_specs=(P("dp"),), out_specs=P("dp"))
        def mlp(self, x):
            return F.gelu(x @ self.w1 + self.b1) @ self.w2

        def forward(self, x):
            return (self.mlp.local(x) if local else self.mlp(x)) * 2

    return MethodModel()


def method_dense(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return dense(x, model.w1, model.b1, model.w2) * 2


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    try:
        mesh = ns.make_mesh((1, 1), ("dp", "tp"))
        f = ns.spmd_map(megatron, mesh=mesh, in_specs=SPECS, out_specs=P("dp")).local
        module = exported(f)
        args = inputs(1)
        got, eager, want = module(*args), Model(f)(*args), dense(*args) * 2
        worst = max(float((got - eager).abs().max()), float((got - want).abs().max()))
        model = method_model(mesh, local=True)
        module = exported_module(model, inputs(0)[:1])
        x = inputs(1)[0]
        got, eager, want = module(x), model(x), method_dense(model, x)
        method = max(float((got - eager).abs().max()), float((got - want).abs().max()))
        print("EXPORT " + json.dumps({"worst": worst, "method": method}), flush=True)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
