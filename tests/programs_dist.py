"""Programs that the multi-process tests run on both backends (simulated and torch.distributed).

The "Core" and "Gradients" acceptance programs, written once against ``named_spmd``, plus a
seeded sampler of random (function, mesh, in_specs, out_specs) cases. Each program calls
``tap(v)`` on values whose type (``ns.typeof``: per-device shape and vma) must agree between the
backends. Nothing here depends on which backend runs it; :mod:`dist_worker` runs each case on a
simulated mesh and on the real one in the same process and compares values, gradients, taps and
communication counts.
"""

from __future__ import annotations

import functools
import itertools
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


# --- Core programs -------------------------------------------------------------------------------


def mlp_column_row(x, w1, w2):
    h = tap(torch.relu(x @ w1))
    return tap(ns.psum(h @ w2, "tp"))


def seq_parallel(x, w1, w2):
    full = tap(ns.all_gather(x, "tp", axis=0, tiled=True))
    partial = torch.tanh(full @ w1) @ w2
    return tap(ns.psum_scatter(partial, "tp", scatter_dimension=0, tiled=True)) + x


def ring_allreduce(x):
    n = ns.axis_size("r")
    ring = [(j, (j + 1) % n) for j in range(n)]
    acc, buf = x, x
    for _ in range(n - 1):
        buf = ns.ppermute(buf, "r", ring)
        acc = acc + buf
    return tap(acc)


def experts(x, we, tiled):
    n = ns.axis_size("ep")
    t, d = x.shape
    if tiled:
        received = tap(ns.all_to_all(x, "ep", 0, 0, tiled=True))
        back = ns.all_to_all(torch.tanh(received @ we[0]), "ep", 0, 0, tiled=True)
    else:
        received = tap(ns.all_to_all(x.reshape(n, t // n, d), "ep", 0, 0))
        back = ns.all_to_all(torch.tanh(received @ we[0]), "ep", 0, 0).reshape(t, d)
    return tap(back)


def nested_tuples(tree):
    a, (b, c) = tree["a"], tree["bc"]
    ia = ns.axis_index(("dp", "tp")).to(a.dtype)
    ib = ns.axis_index(("tp", "dp")).to(a.dtype)
    gathered = tap(ns.all_gather(b, ("tp", "dp"), tiled=True, to="invariant"))
    return {
        "a": tap(a * 2 + ia),
        "b": tap(b + ib),
        "g": gathered,
        "c": c * ns.psum(b.sum(), ("tp", "dp")),
    }


def broadcast_leader(x, w):
    lead = tap(ns.pbroadcast(x, ("tp", "dp"), 1))
    return tap(torch.tanh(lead @ w) + ns.pbroadcast(x, "dp", 0).sum())


def reductions_over_tuples(x):
    return (
        tap(ns.pmean(x, ("dp", "tp"))),
        tap(ns.pmax(x, ("tp", "dp"))),
        tap(ns.pmin(x, ("dp", "tp"))),
        tap(ns.psum(x, ("tp", "dp"))),
    )


# --- Gradients programs --------------------------------------------------------------------------


def data_parallel(w1, b1, w2, x, y):
    h = torch.tanh(x @ w1 + b1)
    pred = (h @ w2)[:, 0] + 0.1 * (x @ w1).sum(-1)
    return tap(ns.pmean(((pred - y) ** 2).mean().reshape(1), "dp"))


def megatron_biases(x, w1, b1, w2, b2):
    return tap(ns.psum(torch.tanh(x @ w1 + b1) @ w2, "tp") + b2)


def vocab_ce(logits, onehot):
    m = ns.pmax(logits.amax(-1), "tp")
    sumexp = ns.psum(torch.exp(logits - m[:, None]).sum(-1), "tp")
    target = ns.psum((logits * onehot).sum(-1), "tp")
    loss = (torch.log(sumexp) + m - target).mean()
    loss = loss + 0.1 * ns.pmin(logits.amin(-1), "tp").mean()
    return tap(ns.pmean(loss.reshape(1), "dp"))


def ring_pass(q, k, v):
    n = ns.axis_size("r")
    ring = [(j, (j + 1) % n) for j in range(n)]
    out = torch.tanh(q @ k.T) @ v
    for _ in range(n - 1):
        k, v = ns.ppermute(k, "r", ring), ns.ppermute(v, "r", ring)
        out = out + torch.tanh(q @ k.T) @ v
    return tap(out)


def identity(x):
    return x


def psum_replicated(x):
    return ns.psum(x, "i")


def reuse_after_psum(x):
    """Operands the user still holds after a reduction must not be overwritten by it."""
    named = x * 2
    kept = [x + 1]
    base = x * 3
    view = base[0]
    s = ns.psum(named, "i") + ns.pmax(kept[0], "i") + ns.pmin(base, "i") + ns.psum(x * 5, "i")
    m = ns.pmean(view, "i")
    return named + kept[0] + base + s + m + x


def program_cases(world: int) -> list[Case]:
    """The fixed programs for a world of 4 or 8 processes."""
    r = _rand
    tp = 2 if world == 4 else 4
    dp = world // tp
    mesh2 = ((dp, tp), ("dp", "tp"))
    cases = [
        Case(
            "mlp_column_row",
            *mesh2,
            (P("dp", None), P(None, "tp"), P("tp", None)),
            P("dp", None),
            mlp_column_row,
            lambda: (r(4, 6, seed=1), r(6, 8, seed=2), r(8, 5, seed=3)),
            pinned_backward={("psum", ("dp",)): 2, ("psum", ("tp",)): 1},
            dtensor_inputs=True,
        ),
        Case(
            "seq_parallel",
            *mesh2,
            (P("tp", None), P(None, "tp"), P("tp", None)),
            P("tp", None),
            seq_parallel,
            lambda: (r(2 * tp, 6, seed=4), r(6, 2 * tp, seed=5), r(2 * tp, 6, seed=6)),
        ),
        Case(
            "ring_allreduce",
            (world,),
            ("r",),
            P("r"),
            P("r"),
            ring_allreduce,
            lambda: (r(3 * world, seed=7),),
            pinned_backward={("ppermute", ("r",)): world - 1},
        ),
        Case(
            "nested_tuples",
            *mesh2,
            ({"a": P(("dp", "tp")), "bc": (P(("tp", "dp")), P())},),
            {"a": P(("dp", "tp")), "b": P(("tp", "dp")), "g": P(), "c": P()},
            nested_tuples,
            lambda: ({"a": r(2 * world, 3, seed=8), "bc": (r(world, 3, seed=9), r(5, seed=10))},),
            dtensor_inputs=True,
        ),
        Case(
            "pbroadcast",
            *mesh2,
            (P(("dp", "tp")), P(None, "tp")),
            P(None, "tp"),
            broadcast_leader,
            lambda: (r(2 * world, 3, seed=12), r(3, 4 * tp, seed=13)),
            pinned_backward={("psum", ("tp",)): 1},  # the implicit pvary of lead over tp
            dtensor_inputs=True,
        ),
        Case(
            "reductions_over_tuples",
            *mesh2,
            P(("dp", "tp")),
            P(),
            reductions_over_tuples,
            lambda: (torch.round(r(world, 5, seed=11) * 2),),
        ),  # rounded: ties in pmax/pmin
        Case(
            "data_parallel",
            (world,),
            ("dp",),
            (P(), P(), P(), P("dp"), P("dp")),
            P(),
            data_parallel,
            lambda: (
                r(5, 6, seed=12),
                r(6, seed=13),
                r(6, 1, seed=14),
                r(2 * world, 5, seed=15),
                r(2 * world, seed=16),
            ),
            pinned_backward={("psum", ("dp",)): 3},
        ),
        Case(
            "megatron_biases",
            *mesh2,
            (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
            P("dp", None),
            megatron_biases,
            lambda: (
                r(2 * dp, 5, seed=17),
                r(5, 2 * tp, seed=18),
                r(2 * tp, seed=19),
                r(2 * tp, 3, seed=20),
                r(3, seed=21),
            ),
            dtensor_inputs=True,
        ),
        Case(
            "vocab_parallel_ce",
            *mesh2,
            (P("dp", "tp"), P("dp", "tp")),
            P(),
            vocab_ce,
            lambda: (
                r(2 * dp, 2 * tp, seed=22) * 3,
                torch.nn.functional.one_hot(torch.arange(2 * dp) % (2 * tp), 2 * tp).to(
                    torch.float64
                ),
            ),
        ),
        Case(
            "ring_pass",
            (world,),
            ("r",),
            P("r"),
            P("r"),
            ring_pass,
            lambda: (r(2 * world, 3, seed=23), r(2 * world, 3, seed=24), r(2 * world, 2, seed=25)),
        ),
        Case(
            "identity_no_backward_comm",
            (world,),
            ("i",),
            P(),
            P(),
            identity,
            lambda: (r(3, seed=26),),
            pinned_backward={},
        ),
        Case(
            "psum_no_backward_comm",
            (world,),
            ("i",),
            P("i"),
            P(),
            psum_replicated,
            lambda: (r(world, 2, seed=27),),
            pinned_backward={},
        ),
        Case(
            "reuse_after_psum_no_grad",
            (world,),
            ("i",),
            P("i"),
            P("i"),
            reuse_after_psum,
            lambda: (r(world, 3, seed=32),),
            no_grad=True,
        ),
        Case(
            "unchecked_varying_output",
            (world,),
            ("i",),
            P("i"),
            P(),
            lambda x: x * 3,
            lambda: (r(world, 2, seed=28),),
            check_vma=False,
        ),
    ]
    for tiled in (True, False):
        cases.append(
            Case(
                f"experts_{'tiled' if tiled else 'untiled'}",
                (dp, tp),
                ("dp", "ep"),
                (P(("dp", "ep")), P("ep")),
                P(("dp", "ep")),
                functools.partial(experts, tiled=tiled),
                lambda: (r(world * tp * 2, 3, seed=29), r(tp, 3, 3, seed=30)),
                pinned_backward={("all_to_all", ("ep",)): 2, ("psum", ("dp",)): 1},
            )
        )
    if world == 8:
        cases.append(
            Case(
                "reductions_3d",
                (2, 2, 2),
                ("a", "b", "c"),
                P(("c", "a"), "b"),
                P(None, "b"),
                lambda x: tap(ns.pmax(ns.psum(x, ("c", "a")) * x, ("a", "c"))),
                lambda: (r(4, 4, seed=31),),
            )
        )
    return cases


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


def all_cases(world: int, samples: int = 50, seed: int = 1234) -> list[Case]:
    return program_cases(world) + sampled_cases(world, samples, seed)


__all__ = ["Case", "TAPE", "all_cases", "choose_out_spec", "itertools", "tap"]
