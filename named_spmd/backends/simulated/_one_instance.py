"""A simulated mesh of one instance (every axis of size 1): the function runs once, without vmap.

A mesh of one instance needs no batching: each input's block is the whole input, and every
collective is over a group of one (``_context.OneMemberPrimitives``). So the per-device function
runs once, on the global tensors, typed per tensor by stamps (``_stamps``) and ``VmaMode``
exactly as on a real mesh of one rank: the types, the out_specs check, the partial-sum inference and
every error are the same as under vmap, and the numbers are the real backend's. What the vmap
levels cost (two levels of size 1 around a GPT step: 1.44x the dense step, measured with
benchmarks/bench_gpt.py) is not paid. The sweep a researcher runs over ``tp`` in {1, 2, 4} pays
for the simulation only where there is something to simulate.

Differences from a simulated mesh of several instances, all of them the real backend's behaviour
too: code that reads values (``.item()``, a Python ``if`` on a tensor) runs; ``print`` of a value
shows one plain tensor; ``scaled_dot_product_attention`` may pick torch's fused kernels. A torch
op that rejects its operands is an SpmdError of its class family (``_errors.told_per_instance``),
as under vmap and on a real mesh.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ... import _torch_private as torch_private
from ..._context import OneMemberPrimitives
from ..._errors import TORCH_ERRORS, told_per_instance
from ..._mesh import Mesh
from ..._replay import Replay
from ..._spec import PartitionSpec
from ..._stamps import MemberContext
from ._plan import from_physical

if TYPE_CHECKING:
    from ..._call import Call


class OneInstanceContext(OneMemberPrimitives, MemberContext):
    """A call on a simulated mesh of one instance: stamped types, primitives over one member."""

    def __init__(self, mesh: Mesh, fn: Any, device: torch.device) -> None:
        super().__init__(mesh, fn)
        self.device = device

    def member(self, axes: tuple[str, ...]) -> int:
        return 0

    def member_device(self) -> torch.device:
        return self.device


def _local(ctx: OneInstanceContext, leaf: Any, spec: PartitionSpec) -> Any:
    """Argument ``leaf``'s block: the leaf itself. A partial input (its one part is the value)
    gets a tensor object of the call's own, so that its stamp does not outlive the call on the
    user's tensor with a partial state."""
    if not isinstance(leaf, torch.Tensor):
        return leaf
    if spec.reduced or spec.unreduced:
        with torch_private.DisableTorchFunction():
            leaf = leaf.view_as(leaf)
    return ctx.stamp_input(leaf, spec)


def run(call: Call) -> list[torch.Tensor]:
    """``call.body`` once, on the global leaves; the outputs as the simulated backend returns
    them. A call whose signature an earlier call type-checked is replayed untyped
    (``_replay``)."""
    mesh, leaves, specs = call.mesh, call.leaves, call.specs
    device = next((x.device for x in leaves if isinstance(x, torch.Tensor)), torch.device("cpu"))
    ctx = OneInstanceContext(mesh, call.fn, device)
    replay = Replay(call)
    if replay.begin(ctx):
        local = leaves
    else:
        local = [_local(ctx, leaf, spec) for leaf, spec in zip(leaves, specs)]
    try:
        outs = replay.run(ctx, call.body, local)
    except TORCH_ERRORS as e:  # a torch op of the user's: told as a real mesh's one rank tells it
        where, at = f"spmd_map of {ctx.fn_label}", "the mesh's one instance"
        told = told_per_instance(e, where, at, replaying=ctx.replaying)
        if told is None:
            raise
        raise told from e
    # a view of each output: a tensor object of the caller's, without the call's stamps
    return [from_physical(y, (), s, mesh) for y, s in zip(outs, call.out_specs())]
