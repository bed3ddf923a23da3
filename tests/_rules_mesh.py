"""A mesh of instances in one process, each in its own thread, whose collectives are
differentiated only by their records' declared transposes and jvps (tests/test_transpose_rules.py).

Each instance runs the same program with its own :class:`ThreadedInstance`. The primitives are
plain communication through a shared exchange (every instance posts its value, all wait, each
reads its group's values): their results do not require grad, as on a real mesh, so torch never
differentiates them. ``apply`` is the real backend's: a differentiated operand goes through the
autograd bridge (``_autodiff.CollectiveFn``), whose backward is the record's transpose
(``Collective.backward``) and whose forward-mode rule is its jvp. The local primitives
(``own_block``, ``axis_index``) are per-instance torch ops, as there.

Every instance calls the primitives in the same order (the program and its autograd graphs are
the same on every instance), which is what a real mesh requires too.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.autograd.forward_ad as fwAD

from named_spmd._autodiff import apply as bridge_apply
from named_spmd._autodiff import differentiable
from named_spmd._context import SpmdContext
from named_spmd._layout import coords_of, group_coords, index_of
from named_spmd._mesh import Mesh
from named_spmd._types import INVARIANT

_TIMEOUT_S = 60.0  # an exchange that waits longer is a program that diverged between instances


class _Exchange:
    """Every instance's value of one primitive call, for all instances. Two boards, used by
    turns: an instance posts call c + 2 only after the barrier of call c + 1, which every
    instance reaches only after reading call c."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=_TIMEOUT_S)
        self.boards: list[list[Any]] = [[None] * n, [None] * n]
        self.turn = [0] * n

    def all(self, k: int, value: torch.Tensor) -> list[torch.Tensor]:
        board = self.boards[self.turn[k]]
        self.turn[k] ^= 1
        board[k] = value.detach()  # plain communication: nothing to differentiate
        self.barrier.wait()
        return list(board)


class ThreadedInstance(SpmdContext):
    """The context of instance ``k`` (mesh coordinates ``coords``)."""

    def __init__(self, mesh: Mesh, k: int, coords: dict[str, int], exchange: _Exchange) -> None:
        super().__init__(mesh, instance_program)
        self.k, self.coords, self.exchange = k, coords, exchange
        self.sizes = mesh.shape

    def _group(self, axes: tuple[str, ...]) -> tuple[list[int], int]:
        """The instance numbers of this instance's group of ``axes``, in member order, and its
        own member index."""
        names = self.mesh.axis_names
        members = [
            index_of(names, c, self.sizes) for c in group_coords(axes, self.coords, self.sizes)
        ]
        return members, index_of(axes, self.coords, self.sizes)

    def _values(self, x: torch.Tensor, axes: tuple[str, ...]) -> tuple[list[torch.Tensor], int]:
        every = self.exchange.all(self.k, x)
        members, me = self._group(axes)
        return [every[j] for j in members], me

    def vma(self, x):
        return INVARIANT  # the rules under test never ask for a value's type

    def axis_index(self, axes):
        return torch.tensor(self._group(axes)[1])

    def per_member(self, axes, make):
        return make(self._group(axes)[1])

    def apply(self, rec, x, axes, params, user_operand=False):
        if differentiable(x):
            return bridge_apply(rec, self, x, axes, params)
        return rec.forward(self, x, axes, params)

    # --- the primitives: plain communication ---------------------------------------------------
    def pvary(self, x, axes):
        return x.detach().clone()

    def all_reduce(self, x, axes, op):
        values, _ = self._values(x, axes)
        stacked = torch.stack(values)
        return {"sum": stacked.sum, "max": stacked.amax, "min": stacked.amin}[op](0)

    def all_gather(self, x, axes):
        return torch.stack(self._values(x, axes)[0])

    def reduce_scatter(self, x, axes, dim):
        values, me = self._values(x, axes)
        return torch.stack(values).sum(0).select(dim, me).clone()

    def all_to_all(self, x, axes, dim):
        values, me = self._values(x, axes)
        return torch.stack([v.select(dim, me) for v in values], dim)

    def permute(self, x, axes, pairs):
        values, me = self._values(x, axes)
        sources = [src for src, dst in pairs if dst == me]
        return values[sources[0]].clone() if sources else torch.zeros_like(x.detach())

    def broadcast(self, x, axes, root):
        values, _ = self._values(x, axes)
        return values[root].clone()

    # --- local: differentiated by torch on the instance, as on a real mesh ---------------------
    def own_block(self, x, axes, dim):
        return x.select(dim, self._group(axes)[1])


@contextlib.contextmanager
def forward_ad(ctx: ThreadedInstance) -> Iterator[None]:
    """A forward-mode AD level around a phase of every instance's program. torch has one level
    for the whole process (not one per thread): instance 0 enters it while the others wait, and
    leaves it once every instance is done with its duals."""
    barrier = ctx.exchange.barrier
    level = fwAD.dual_level() if ctx.k == 0 else contextlib.nullcontext()
    barrier.wait()
    with level:
        barrier.wait()
        yield  # an error of any instance aborts the barrier: every instance then leaves
        barrier.wait()
    barrier.wait()


def instance_program() -> None:
    """The function label the contexts carry (errors name it)."""


def run_instances(mesh: Mesh, program: Callable[[ThreadedInstance], Any]) -> list[Any]:
    """``program(ctx)`` on every instance of ``mesh`` at once, one thread each; the results in
    instance order (row-major over the mesh axes). The first error of an instance is raised."""
    names, sizes = mesh.axis_names, mesh.shape
    n = math.prod(sizes.values())
    exchange = _Exchange(n)
    results: list[Any] = [None] * n
    errors: list[BaseException | None] = [None] * n

    def one(k: int) -> None:
        coords = coords_of(k, names, sizes)
        try:
            results[k] = program(ThreadedInstance(mesh, k, coords, exchange))
        except BaseException as e:  # noqa: BLE001 - handed to the main thread
            errors[k] = e
            exchange.barrier.abort()  # the others stop waiting for this instance

    threads = [threading.Thread(target=one, args=(k,)) for k in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    first = next((e for e in errors if e is not None and not _broken(e)), None)
    first = first or next((e for e in errors if e is not None), None)
    if first is not None:
        raise first
    return results


def _broken(e: BaseException) -> bool:
    return isinstance(e, threading.BrokenBarrierError)
