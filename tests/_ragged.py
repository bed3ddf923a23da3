"""Routing tables for ``ragged_all_to_all`` and ``all_to_all`` with split sizes, and their
per-instance Python loop (JAX's pseudocode in ``jax.lax.ragged_all_to_all``'s docstring; JAX's
CPU backend has no ragged-all-to-all to compare with). Shared by tests/test_ragged.py,
tests/test_transpose_rules.py and the gloo checks of tests/dist_worker.py."""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Routing:
    """Member i sends ``counts[i][k]`` rows in slot k (to member ``k // per``), ``per`` slots
    per member; the slices lie apart in the operand (one spare row between them) and in the
    receiver's output, placed in reverse slot order there with a spare row first."""

    counts: tuple[tuple[int, ...], ...]
    per: int

    @property
    def n(self) -> int:
        return len(self.counts)

    @property
    def k(self) -> int:
        return self.n * self.per

    def _slot_at(self, i: int, k: int) -> int:
        """The receiver's slot for member i's slot k."""
        return i * self.per + k % self.per

    def input_offsets(self, i: int) -> list[int]:
        return [sum(self.counts[i][:k]) + k for k in range(self.k)]

    def recv_sizes(self, j: int) -> list[int]:
        out = [0] * self.k
        for i in range(self.n):
            for k in range(j * self.per, (j + 1) * self.per):
                out[self._slot_at(i, k)] = self.counts[i][k]
        return out

    def placed_at(self, j: int) -> list[int]:
        """Where receiver j places each of its slots: reverse slot order, spare rows between."""
        recv, at, pos = self.recv_sizes(j), [0] * self.k, 1
        for s in reversed(range(self.k)):
            at[s] = pos
            pos += recv[s] + 1
        return at

    def output_offsets(self, i: int) -> list[int]:
        return [self.placed_at(k // self.per)[self._slot_at(i, k)] for k in range(self.k)]

    @property
    def rows(self) -> int:  # the operand's rows on every member
        return max(sum(c) + self.k for c in self.counts)

    @property
    def m(self) -> int:  # the output's rows on every member
        return max(sum(self.recv_sizes(j)) + self.k + 1 for j in range(self.n))

    def metadata(self) -> list[torch.Tensor]:
        """The four ``[n * K]`` int64 tensors, member i's block i (for ``P(axes)``)."""
        rows = [
            [f(i) for i in range(self.n)]
            for f in (self.input_offsets, self._send, self.output_offsets, self.recv_sizes)
        ]
        return [torch.tensor([v for block in r for v in block]) for r in rows]

    def _send(self, i: int) -> list[int]:
        return list(self.counts[i])

    def from_offsets(self, j: int) -> list[int]:
        """Where in its sender's operand each of receiver j's slots starts."""
        out = [0] * self.k
        for i in range(self.n):
            for k in range(j * self.per, (j + 1) * self.per):
                out[self._slot_at(i, k)] = self.input_offsets(i)[k]
        return out

    def params(self, j: int) -> tuple:
        """Member j's parameters of the ``ragged_all_to_all`` record."""
        from named_spmd._collectives.ragged import Ragged

        lists = (self.input_offsets, self._send, self.output_offsets, self.recv_sizes)
        lists += (self.placed_at, self.from_offsets)
        return Ragged(self.m, self.rows, *(torch.tensor(f(j)) for f in lists))


def routing(n: int, per: int = 1, seed: int = 0) -> Routing:
    gen = random.Random(seed)
    counts = tuple(tuple(gen.randint(0, 3) for _ in range(n * per)) for _ in range(n))
    return Routing(counts, per)


def reference(r: Routing, operands: list, outputs: list) -> list[torch.Tensor]:
    """Every member's result, slice by slice (differentiable: slice assignments)."""
    results = [o.clone() for o in outputs]
    for i in range(r.n):
        offsets, out_offsets = r.input_offsets(i), r.output_offsets(i)
        for k in range(r.k):
            size, j, at = r.counts[i][k], k // r.per, out_offsets[k]
            results[j][at : at + size] = operands[i][offsets[k] : offsets[k] + size]
    return results


def sized_reference(counts, blocks: list) -> list[torch.Tensor]:
    """``all_to_all`` with split sizes along dim 0: member i sends ``counts[i][j]`` rows to j."""
    chunks = [b.split(list(c)) for b, c in zip(blocks, counts)]
    return [torch.cat([c[j] for c in chunks]) for j in range(len(blocks))]


def split_counts(n: int) -> list[list[int]]:
    """``all_to_all`` split sizes: member i sends ``counts[i][j]`` rows to member j, 8 rows in
    all from every member; the members receive different totals."""
    table = {2: [[2, 6], [5, 3]], 3: [[1, 3, 4], [4, 3, 1]], 4: [[0, 1, 2, 5], [5, 2, 1, 0]]}
    return [table[n][i % 2] for i in range(n)]
