"""The seeded sampler of random (function, mesh, in_specs, out_specs) cases that the multi-process
tests run on both backends (simulated and torch.distributed). The fixed programs are in the one
catalogue, tests/_programs.py. Each program calls
``tap(v)`` on values whose type (``ns.typeof``: per-device shape and vma) must agree between the
backends. Nothing here depends on which backend runs it; :mod:`dist_worker` runs each case on a
simulated mesh and on the real one in the same process and compares values, gradients, taps and
communication counts.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

import named_spmd as ns
from named_spmd import P

TAPE: list[str] = []


def tap(v: torch.Tensor) -> torch.Tensor:
    """Record the type of ``v`` (per-device shape and vma) for comparison across backends."""
    TAPE.append(repr(ns.typeof(v)))
    return v


@dataclass
class Case:
    name: str
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    in_specs: Any
    out_specs: Any
    prog: Callable[..., Any]
    args: Callable[[], tuple]  # the global arguments (deterministic)
    check_vma: bool = True
    pinned_backward: dict[tuple[str, tuple[str, ...]], int] | None = None  # (op, axes) -> count
    dtensor_inputs: bool = False  # also run with DTensor inputs on the real mesh
    no_grad: bool = False  # forward only, under torch.no_grad (reductions may work in place)
    extra: dict = field(default_factory=dict)


def _rand(*shape: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64)


# --- the sampler ---------------------------------------------------------------------------------

_MESHES = {
    4: [((4,), ("i",)), ((2, 2), ("a", "b"))],
    8: [((8,), ("i",)), ((2, 4), ("a", "b")), ((2, 2, 2), ("a", "b", "c"))],
}
_OPS = (
    "psum",
    "pmean",
    "pmax",
    "all_gather",
    "psum_scatter",
    "all_to_all",
    "ppermute",
    "pshuffle",
    "mix",
    "axis_index",
    "pvary",
    "unary",
)


def _axes_tuple(rng: random.Random, names, pool=None) -> tuple[str, ...]:
    pool = list(names if pool is None else pool)
    k = rng.randint(1, len(pool))
    return tuple(rng.sample(pool, k))


def _random_spec(rng: random.Random, names, rank: int) -> P:
    free = list(names)
    rng.shuffle(free)
    entries: list[Any] = [None] * rank
    for a in free:
        if rng.random() < 0.6:
            d = rng.randrange(rank)
            entries[d] = (a,) if entries[d] is None else (*entries[d], a)
    return P(*entries)


class _Step:
    """One random op, applied at run time to whatever the value is then (same on both backends:
    the choices depend only on shapes and vma, which the backends must agree on)."""

    def __init__(self, rng: random.Random, names):
        self.op = rng.choice(_OPS)
        self.names = names
        self.r = [rng.random() for _ in range(6)]
        self.axes = _axes_tuple(rng, names)
        self.perm_seed = rng.randrange(1 << 30)

    def pick(self, k: int, seq):
        seq = list(seq)
        return seq[int(self.r[k] * len(seq)) % len(seq)]

    def __call__(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v = ns.vma(x)
        sizes = {a: ns.axis_size(a) for a in self.names}
        axes = self.axes
        n = ns.axis_size(axes)
        op = self.op
        if op == "psum":
            varying = tuple(a for a in axes if a in v)
            return ns.psum(x, varying) if varying else x
        if op == "pmean":
            return ns.pmean(x, axes)
        if op == "pmax":
            return ns.pmax(x, axes) if self.r[0] < 0.5 else ns.pmin(x, axes)
        if op == "all_gather":
            tiled = self.r[1] < 0.5
            d = int(self.r[0] * (x.dim() + (0 if tiled else 1)))
            to = "invariant" if self.r[2] < 0.4 else "varying"
            if x.dim() > 2 and not tiled:
                tiled = True
                d = min(d, x.dim() - 1)
            return ns.all_gather(x, axes, axis=d, tiled=tiled, to=to)
        if op == "psum_scatter":
            varying = tuple(a for a in axes if a in v)
            if not varying:
                return x
            m = ns.axis_size(varying)
            dims = [d for d in range(x.dim()) if x.shape[d] % m == 0]
            if not dims:
                return x
            return ns.psum_scatter(x, varying, scatter_dimension=self.pick(0, dims), tiled=True)
        if op == "all_to_all":
            dims = [d for d in range(x.dim()) if x.shape[d] % n == 0]
            if not dims:
                return x
            return ns.all_to_all(
                x, axes, self.pick(0, dims), self.pick(1, range(x.dim())), tiled=True
            )
        if op in ("ppermute", "pshuffle"):
            perm = list(range(n))
            random.Random(self.perm_seed).shuffle(perm)
            if op == "pshuffle":
                return ns.pshuffle(x, axes, perm)
            keep = max(1, int(self.r[0] * n))
            return ns.ppermute(x, axes, [(i, perm[i]) for i in range(keep)])
        if op == "mix":
            return x * w[: x.shape[-1]] if x.shape[-1] <= w.shape[0] else x + w.sum()
        if op == "axis_index":
            return x + ns.axis_index(axes).to(x.dtype)
        if op == "pvary":
            missing = tuple(a for a in axes if a not in v)
            return ns.pvary(x, missing) if missing else x
        del sizes
        return torch.sin(x) if self.r[0] < 0.5 else torch.tanh(x) * 2


def _sampled_prog(steps):
    def prog(x, w):
        for step in steps:
            x = step(x, w)
        if x.dim() == 0:
            x = x.reshape(1)
        return tap(x)

    return prog


def sampled_cases(world: int, count: int, seed: int) -> list[Case]:
    """``count`` random cases; out_specs are chosen by :func:`choose_out_spec` once the output's
    vma is known (from a simulated dry run), so that every case is valid."""
    rng = random.Random(seed)
    cases = []
    for k in range(count):
        sizes, names = rng.choice(_MESHES[world])
        rank = rng.randint(1, 3)
        spec = _random_spec(rng, names, rank)
        shape = []
        for d in range(rank):
            prod = 1
            for a in spec.entry_axes(d):
                prod *= sizes[names.index(a)]
            shape.append(prod * rng.choice([1, 2, 4]) * (2 if d == 0 else 1))
        steps = [_Step(rng, names) for _ in range(rng.randint(1, 3))]
        wlen = rng.randint(1, 6)
        gen_seed = rng.randrange(1 << 30)

        def args(shape=tuple(shape), wlen=wlen, gen_seed=gen_seed):
            return (_rand(*shape, seed=gen_seed), _rand(wlen, seed=gen_seed + 1))

        cases.append(
            Case(
                f"sampled_{k}",
                sizes,
                names,
                (spec, P()),
                None,
                _sampled_prog(steps),
                args,
                dtensor_inputs=k % 3 == 0,
                extra={"rng": random.Random(seed * 1000 + k)},
            )
        )
    return cases


def choose_out_spec(case: Case, rank: int, vma: frozenset[str]) -> P:
    """A random out_spec that names every axis in ``vma`` (and maybe some invariant ones)."""
    rng: random.Random = case.extra["rng"]
    named = [a for a in case.names if a in vma or rng.random() < 0.25]
    rng.shuffle(named)
    entries: list[Any] = [None] * rank
    for a in named:
        d = rng.randrange(rank)
        entries[d] = (a,) if entries[d] is None else (*entries[d], a)
    return P(*entries)


__all__ = ["Case", "TAPE", "choose_out_spec", "sampled_cases", "tap"]
