"""Where the instance threads of a per-instance simulated call meet (``_per_instance``).

Each instance runs the per-device function on its own thread. A collective primitive is a
meeting of every instance of the mesh: each thread leaves its operand and waits; the last one
to arrive computes every instance's result from the list of all operands with ordinary torch
ops (stack, sum, select), so autograd sees one graph joining the instances, and the backward
pass runs from the caller's thread with no meeting at all. Every instance must call the same
primitives in the same order (an SPMD program does); a difference is told, never a hang.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..._errors import SpmdError, collectives_apart, collectives_differ
from ..._layout import coords_of, coords_text

Compute = Callable[[list[Any]], list[torch.Tensor]]


class Aborted(BaseException):
    """Raised in an instance thread whose meeting cannot complete because another instance
    failed; a BaseException so that the user's ``except Exception`` does not swallow it."""


class Meeting:
    """The meeting point of ``n`` instance threads (instance ``i``: row-major over the mesh)."""

    def __init__(self, n: int, label: str, names: Sequence[str], sizes: dict[str, int]):
        self.n = n
        self.label = label
        self.names = tuple(names)
        self.sizes = sizes
        self.cond = threading.Condition()
        self.arrived: dict[int, tuple[Any, Any]] = {}
        self.results: list[torch.Tensor] = []
        self.round = 0
        self.finished: set[int] = set()
        self.failed = False
        self.stuck: SpmdError | None = None  # instances returned while others wait

    def exchange(self, i: int, key: Any, x: Any, compute: Compute) -> torch.Tensor:
        """Leave ``x`` (instance ``i``'s operand of the primitive ``key``: a tensor, or a tuple
        holding one and the sizes that differ between instances); return instance
        ``i``'s result once every instance has left its own."""
        with self.cond:
            if self.failed:
                raise Aborted
            self.arrived[i] = (key, x)
            if len(self.arrived) < self.n:
                self._check_stuck()
                mine = self.round
                while self.round == mine and not self.failed:
                    self.cond.wait()
                if self.round == mine:
                    raise Aborted
                return self.results[i]
            arrived, self.arrived = self.arrived, {}
            try:
                self._check_same(arrived)
                results = compute([arrived[j][1] for j in range(self.n)])
            except BaseException:
                self.failed = True
                self.cond.notify_all()
                raise
            self.results = results
            self.round += 1
            self.cond.notify_all()
            return results[i]

    def finish(self, i: int, failed: bool) -> None:
        """Instance ``i`` returned (or raised): the others must not wait for it."""
        with self.cond:
            self.finished.add(i)
            if failed:
                self.failed = True
                self.cond.notify_all()
            elif self.arrived:
                self._check_stuck()

    def _check_stuck(self) -> None:
        """Some instances returned while the others wait at a collective: the instances ran
        different collectives (value-dependent control flow). Told in every waiting thread."""
        if not self.finished or len(self.arrived) + len(self.finished) < self.n:
            return
        key = next(iter(self.arrived.values()))[0]
        self.failed = True
        self.cond.notify_all()
        self.stuck = collectives_apart(
            f"spmd_map of {self.label}",
            self._where(sorted(self.finished)),
            self._where(sorted(self.arrived)),
            _op(key),
        )

    def _check_same(self, arrived: dict[int, tuple[Any, Any]]) -> None:
        keys = {j: arrived[j][0] for j in range(self.n)}
        if len(set(keys.values())) > 1:
            calls = "; ".join(
                f"instance {self._where([j])}: {_op(k, keys.values())}"
                for j, k in sorted(keys.items())
            )
            raise collectives_differ(f"spmd_map of {self.label}", calls)

    def _where(self, instances: Sequence[int]) -> str:
        return ", ".join(
            "(" + coords_text(coords_of(j, self.names, self.sizes)) + ")" for j in instances
        )


def _op(key: Any, keys: Any = ()) -> str:
    """The collective of ``key`` as a real mesh names it, whose ranks know of another's
    parameters only whether they differ: "with other arguments" where one of ``keys`` (every
    instance's) is the same collective over the same axes with other parameters."""
    name, axes, params = key
    other = any(k[:2] == (name, axes) and k[2] != params for k in keys)
    return f"{name} over {axes}" + (" with other arguments" if other else "")
