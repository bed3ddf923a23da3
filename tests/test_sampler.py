"""Random (function, mesh, in_specs, out_specs) cases checked against the per-instance reference.

A case is a small straight-line program over a pool of values: elementwise ops, matmuls with a
pool value or a closed-over constant, reductions, factories, reshapes, every collective with random
axes (single names and tuples in random order), tiled and untiled, and pytree collectives. The
generator tracks each value's local shape and its vma by DESIGN.md's rules (an independent model
of the type system), so it only emits valid programs, and the test asserts ``ns.vma`` of every
value equals the model's. Inputs are random pytrees with random specs (tuple entries, dict
prefixes, a Python float leaf).

Seeded and reproducible: case ``k`` uses ``random.Random(SEED + k)``. Set NAMED_SPMD_SAMPLER_CASES
or NAMED_SPMD_SAMPLER_SEED to run more cases or other seeds.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from _reference import REF, assert_trees_close, run_reference, tree_leaves, tree_map

import named_spmd as ns
from named_spmd import P

SEED = int(os.environ.get("NAMED_SPMD_SAMPLER_SEED", "20240601"))
N_CASES = int(os.environ.get("NAMED_SPMD_SAMPLER_CASES", "240"))
MESHES = [
    ((8,), ("i",)),
    ((2, 4), ("dp", "tp")),
    ((4, 2), ("x", "y")),
    ((2, 2, 2), ("a", "b", "c")),
]
MAX_NUMEL = 2048


@dataclass
class Val:
    """The generator's model of a pool value: local shape and vma (None shape: a Python float)."""

    shape: tuple[int, ...] | None
    vma: frozenset[str]


@dataclass(frozen=True)
class Out:
    """A leaf of the output tree: pool entry ``i``."""

    i: int


@dataclass
class Case:
    seed: int
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    args: tuple
    in_specs: Any
    out_specs: Any
    steps: list[dict] = field(default_factory=list)
    out_tree: Any = None
    model: list[Val] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"seed={self.seed} mesh={dict(zip(self.names, self.sizes))}"]
        lines.append(f"in_specs={self.in_specs!r}")
        for k, v in enumerate(self.model[: self.n_inputs]):
            lines.append(f"  %{k}: input {v.shape} {sorted(v.vma)}")
        for k, st in enumerate(self.steps):
            shown = {k2: v for k2, v in st.items() if not isinstance(v, torch.Tensor)}
            lines.append(f"  step {k}: {shown}")
        lines.append(f"out_tree={self.out_tree!r} out_specs={self.out_specs!r}")
        return "\n".join(lines)

    @property
    def n_inputs(self) -> int:
        return len(tree_leaves(self.args))


# --- running a case ---------------------------------------------------------------------------


def apply_step(o: Any, st: dict, pool: list) -> list:
    op, a = st["op"], pool[st["src"][0]]
    b = pool[st["src"][1]] if len(st["src"]) > 1 else None
    A = st.get("axes")
    if op in ("tanh", "sin"):
        return [getattr(torch, op)(a)]
    if op == "affine":
        return [a * st["c"] + st["d"]]
    if op == "scale":  # b is a Python float leaf
        return [a * b]
    if op == "add":
        return [a + b]
    if op == "mul":
        return [a * b]
    if op == "add_sum":
        return [a + b.sum()]
    if op == "matmul":
        return [a @ b]
    if op == "matmul_const":
        return [a @ st["w"]]
    if op == "times_const":
        return [a * st["w"]]
    if op == "sum":
        return [a.sum(st["dim"], keepdim=st["keepdim"])]
    if op == "ones_like":
        return [torch.ones_like(a) * st["c"]]
    if op == "full":
        return [torch.full(st["shape"], st["c"], dtype=torch.float64)]
    if op == "repeat":
        return [a.repeat(*st["reps"])]
    if op == "transpose":
        return [a.transpose(-1, -2)]
    if op == "flatten":
        return [a.reshape(-1)]
    if op == "axis_index":
        return [a + o.axis_index(A)]
    if op in ("psum", "pmean", "pmax", "pmin", "pvary"):
        return [getattr(o, op)(a, A)]
    if op == "all_gather":
        return [o.all_gather(a, A, axis=st["axis"], tiled=st["tiled"], to=st["to"])]
    if op == "psum_scatter":
        return [o.psum_scatter(a, A, scatter_dimension=st["dim"], tiled=st["tiled"])]
    if op == "all_to_all":
        return [o.all_to_all(a, A, st["split"], st["concat"], tiled=st["tiled"])]
    if op == "ppermute":
        return [o.ppermute(a, A, st["pairs"])]
    if op == "pshuffle":
        return [o.pshuffle(a, A, st["perm"])]
    if op == "tree":  # a collective on a pytree {'u': a, 'v': (b,)}
        out = getattr(o, st["coll"])({"u": a, "v": (b,)}, A)
        return [out["u"], out["v"][0]]
    raise AssertionError(op)


def interpret(o: Any, case: Case, *args: Any) -> Any:
    pool = list(tree_leaves(args))
    for st in case.steps:
        pool.extend(apply_step(o, st, pool))
    if o is ns:  # named_spmd's vma inference must agree with the model on every value
        for k, (v, m) in enumerate(zip(pool, case.model)):
            if isinstance(v, torch.Tensor):
                assert tuple(v.shape) == m.shape, f"%{k}: shape {tuple(v.shape)} != {m.shape}"
                assert ns.vma(v) == m.vma, f"%{k}: ns.vma {set(ns.vma(v))} != model {set(m.vma)}"
    return tree_map(lambda r: pool[r.i], case.out_tree)


# --- generating a case ------------------------------------------------------------------------


class Gen:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.torch_gen = torch.Generator().manual_seed(seed)
        self.seed = seed
        self.sizes, self.names = self.rng.choice(MESHES)
        self.size = dict(zip(self.names, self.sizes))
        self.model: list[Val] = []
        self.steps: list[dict] = []

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self.torch_gen, dtype=torch.float64)

    def axes(self, pool: list[str] | tuple[str, ...] | frozenset[str]) -> tuple[str, ...] | str:
        """A random non-empty ordered subset; sometimes a bare name, sometimes a 1-tuple."""
        pool = [a for a in self.names if a in pool]
        chosen = self.rng.sample(pool, self.rng.randint(1, len(pool)))
        if len(chosen) == 1 and self.rng.random() < 0.6:
            return chosen[0]
        return tuple(chosen)

    def n(self, A) -> int:
        return math.prod(self.size[a] for a in ((A,) if isinstance(A, str) else A))

    # inputs
    def spec(self, rank: int) -> P:
        free = list(self.names)
        self.rng.shuffle(free)
        entries: list[Any] = []
        for _ in range(rank):
            if free and self.rng.random() < 0.5:
                k = self.rng.randint(1, min(2, len(free)))
                take, free = free[:k], free[k:]
                entries.append(take[0] if k == 1 else tuple(take))
            else:
                entries.append(None)
        while entries and entries[-1] is None and self.rng.random() < 0.5:
            entries.pop()
        return P(*entries)

    def tensor_input(self, spec: P | None = None) -> tuple[torch.Tensor, P]:
        rank = self.rng.randint(1, 3)
        local = tuple(self.rng.choice([1, 2, 3, 4]) for _ in range(rank))
        spec = self.spec(rank) if spec is None or len(spec) > rank else spec
        shape = [
            d * math.prod(self.size[a] for a in spec.entry_axes(i)) for i, d in enumerate(local)
        ]
        self.model.append(Val(local, frozenset(spec.axes)))
        return self.randn(*shape), spec

    def inputs(self) -> tuple[tuple, Any]:
        """Random pytree arguments and a matching in_specs prefix, model in leaf order."""
        args, specs = [], []
        for _ in range(self.rng.randint(1, 3)):
            kind = self.rng.random()
            if kind < 0.6:
                x, s = self.tensor_input()
                args.append(x)
                specs.append(s)
            elif kind < 0.85:  # a dict; sometimes one spec for the whole subtree
                shared = self.spec(1) if self.rng.random() < 0.5 else None
                d, ds = {}, {}
                for key in ("b", "w"):  # in leaf order: a dict's leaves come in sorted key order
                    d[key], ds[key] = self.tensor_input(shared)
                args.append(d)
                specs.append(shared if all(s == shared for s in ds.values()) else ds)
            else:
                args.append(self.rng.choice([0.5, -1.25, 2.0]))
                specs.append(self.rng.choice([None, P()]))
                self.model.append(Val(None, frozenset()))
        if not self.tensors():  # every program needs a tensor to start from
            x, s = self.tensor_input()
            args.append(x)
            specs.append(s)
        return tuple(args), tuple(specs)

    # program
    def tensors(self) -> list[int]:
        return [k for k, v in enumerate(self.model) if v.shape is not None]

    def pick(self, cond=lambda v: True, recent: bool = True) -> int | None:
        cands = [k for k in self.tensors() if cond(self.model[k])]
        if not cands:
            return None
        if recent and self.rng.random() < 0.6:
            return max(cands)
        return self.rng.choice(cands)

    def emit(self, st: dict, *vals: Val) -> None:
        if any(math.prod(v.shape) > MAX_NUMEL for v in vals):
            return
        self.steps.append(st)
        self.model.extend(vals)

    def step(self) -> None:
        op = self.rng.choice(OPS)
        getattr(self, "op_" + op)()

    # --- ops: each emits a step with its modelled result, or nothing when it does not apply
    def op_unary(self):
        a = self.pick()
        op = self.rng.choice(["tanh", "sin", "affine"])
        v = self.model[a]
        self.emit({"op": op, "src": [a], "c": 0.5, "d": 0.25}, Val(v.shape, v.vma))

    def op_scale(self):
        floats = [k for k, v in enumerate(self.model) if v.shape is None]
        a = self.pick()
        if floats:
            v = self.model[a]
            self.emit({"op": "scale", "src": [a, self.rng.choice(floats)]}, Val(v.shape, v.vma))

    def op_binary(self):
        a = self.pick()
        va = self.model[a]
        same = self.pick(lambda v: v.shape == va.shape, recent=False)
        if same is not None and self.rng.random() < 0.7:
            op = self.rng.choice(["add", "mul"])
            self.emit({"op": op, "src": [a, same]}, Val(va.shape, va.vma | self.model[same].vma))
        else:
            b = self.pick(recent=False)
            self.emit({"op": "add_sum", "src": [a, b]}, Val(va.shape, va.vma | self.model[b].vma))

    def op_matmul(self):
        a = self.pick(lambda v: len(v.shape) >= 1)
        if a is None:
            return
        va = self.model[a]
        k = va.shape[-1]
        b = self.pick(lambda v: len(v.shape) == 2 and v.shape[0] == k, recent=False)
        if b is not None and self.rng.random() < 0.5:
            shape = va.shape[:-1] + self.model[b].shape[1:]
            self.emit({"op": "matmul", "src": [a, b]}, Val(shape, va.vma | self.model[b].vma))
        else:  # a closed-over constant: invariant, so the result keeps a's vma
            q = self.rng.randint(1, 4)
            st = {"op": "matmul_const", "src": [a], "w": self.randn(k, q)}
            self.emit(st, Val(va.shape[:-1] + (q,), va.vma))

    def op_const(self):
        a = self.pick()
        v = self.model[a]
        self.emit({"op": "times_const", "src": [a], "w": self.randn(*v.shape)}, Val(v.shape, v.vma))

    def op_sum(self):
        a = self.pick(lambda v: len(v.shape) >= 1)
        if a is None:
            return
        v = self.model[a]
        dim = self.rng.randrange(-len(v.shape), len(v.shape))
        keep = self.rng.random() < 0.5
        shape = list(v.shape)
        if keep:
            shape[dim] = 1
        else:
            shape.pop(dim)
        self.emit({"op": "sum", "src": [a], "dim": dim, "keepdim": keep}, Val(tuple(shape), v.vma))

    def op_factory(self):
        a = self.pick()
        v = self.model[a]
        if self.rng.random() < 0.5:  # *_like inherits the vma
            self.emit({"op": "ones_like", "src": [a], "c": 1.5}, Val(v.shape, v.vma))
        else:  # a fresh factory is invariant
            self.emit(
                {"op": "full", "src": [a], "shape": v.shape, "c": -0.75}, Val(v.shape, frozenset())
            )

    def op_reshape(self):
        a = self.pick()
        v = self.model[a]
        r = self.rng.random()
        if len(v.shape) >= 2 and r < 0.35:
            shape = v.shape[:-2] + (v.shape[-1], v.shape[-2])
            self.emit({"op": "transpose", "src": [a]}, Val(shape, v.vma))
        elif len(v.shape) != 1 and r < 0.6:
            self.emit({"op": "flatten", "src": [a]}, Val((math.prod(v.shape),), v.vma))
        elif len(v.shape) >= 1:
            reps = [1] * len(v.shape)
            reps[self.rng.randrange(len(v.shape))] = self.rng.choice([2, 4])
            shape = tuple(s * r for s, r in zip(v.shape, reps))
            self.emit({"op": "repeat", "src": [a], "reps": reps}, Val(shape, v.vma))

    def op_axis_index(self):
        a = self.pick()
        A = self.axes(self.names)
        v = self.model[a]
        self.emit({"op": "axis_index", "src": [a], "axes": A}, Val(v.shape, v.vma | set(_t(A))))

    def op_reduce(self):
        op = self.rng.choice(["psum", "pmean", "pmax", "pmin"])
        if op == "psum":  # only over axes the operand varies over (else it is an error)
            a = self.pick(lambda v: bool(v.vma))
            if a is None:
                return
            A = self.axes(self.model[a].vma)
        else:
            a = self.pick()
            A = self.axes(self.names)
        v = self.model[a]
        self.emit({"op": op, "src": [a], "axes": A}, Val(v.shape, v.vma - set(_t(A))))

    def op_pvary(self):
        a = self.pick(lambda v: len(v.vma) < len(self.names))
        if a is None:
            return
        v = self.model[a]
        A = self.axes([x for x in self.names if x not in v.vma])
        self.emit({"op": "pvary", "src": [a], "axes": A}, Val(v.shape, v.vma | set(_t(A))))

    def op_all_gather(self):
        a = self.pick()
        v = self.model[a]
        A = self.axes(self.names)
        n = self.n(A)
        tiled = len(v.shape) >= 1 and self.rng.random() < 0.5
        rank = len(v.shape) if tiled else len(v.shape) + 1
        axis = self.rng.randrange(-rank, rank)
        shape = list(v.shape)
        if tiled:
            shape[axis] *= n
        else:
            shape.insert(axis % rank, n)
        to = self.rng.choice(["varying", "invariant"])
        vma = v.vma - set(_t(A)) if to == "invariant" else v.vma | set(_t(A))
        st = {"op": "all_gather", "src": [a], "axes": A, "axis": axis, "tiled": tiled, "to": to}
        self.emit(st, Val(tuple(shape), vma))

    def op_psum_scatter(self):
        a = self.pick(lambda v: bool(v.vma) and len(v.shape) >= 1)
        if a is None:
            return
        v = self.model[a]
        A = self.axes(v.vma)
        n = self.n(A)
        tiled = self.rng.random() < 0.5
        dims = [d for d, s in enumerate(v.shape) if (s % n == 0 if tiled else s == n)]
        if not dims:
            return
        d = self.rng.choice(dims)
        shape = list(v.shape)
        if tiled:
            shape[d] //= n
        else:
            shape.pop(d)
        st = {
            "op": "psum_scatter",
            "src": [a],
            "axes": A,
            "dim": d - len(v.shape) * self.rng.randint(0, 1),
            "tiled": tiled,
        }
        self.emit(st, Val(tuple(shape), v.vma))

    def op_all_to_all(self):
        a = self.pick(lambda v: len(v.shape) >= 1)
        if a is None:
            return
        v = self.model[a]
        A = self.axes(self.names)
        n = self.n(A)
        tiled = self.rng.random() < 0.5
        dims = [d for d, s in enumerate(v.shape) if (s % n == 0 if tiled else s == n)]
        if not dims:
            return
        s = self.rng.choice(dims)
        c = self.rng.randrange(len(v.shape))
        shape = list(v.shape)
        if tiled:
            shape[s] //= n
            shape[c] *= n
        else:
            shape.pop(s)
            shape.insert(c, n)
        st = {"op": "all_to_all", "src": [a], "axes": A, "split": s, "concat": c, "tiled": tiled}
        self.emit(st, Val(tuple(shape), v.vma | set(_t(A))))

    def op_permute(self):
        a = self.pick()
        v = self.model[a]
        A = self.axes(self.names)
        n = self.n(A)
        perm = list(range(n))
        self.rng.shuffle(perm)
        if self.rng.random() < 0.5:
            st = {"op": "pshuffle", "src": [a], "axes": A, "perm": perm}
        else:
            dsts = perm[: self.rng.randint(1, n)]
            srcs = self.rng.sample(range(n), len(dsts))
            st = {"op": "ppermute", "src": [a], "axes": A, "pairs": list(zip(srcs, dsts))}
        self.emit(st, Val(v.shape, v.vma | set(_t(A))))

    def op_tree(self):
        a, b = self.pick(), self.pick(recent=False)
        coll = self.rng.choice(["pmean", "pmax", "pvary", "psum"])
        va, vb = self.model[a], self.model[b]
        if coll == "psum":
            pool = va.vma & vb.vma
        elif coll == "pvary":
            pool = frozenset(self.names) - va.vma - vb.vma
        else:
            pool = frozenset(self.names)
        if not pool:
            return
        A = self.axes(pool)
        if coll == "pvary":
            outs = (Val(va.shape, va.vma | set(_t(A))), Val(vb.shape, vb.vma | set(_t(A))))
        else:
            outs = (Val(va.shape, va.vma - set(_t(A))), Val(vb.shape, vb.vma - set(_t(A))))
        self.emit({"op": "tree", "coll": coll, "src": [a, b], "axes": A}, *outs)

    # outputs
    def out_leaf(self, k: int) -> tuple[Out, P]:
        v = self.model[k]
        if v.shape is None:
            return Out(k), self.rng.choice([None, P()])
        if not v.shape and (v.vma or self.rng.random() < 0.3):  # a varying scalar needs a dim
            self.steps.append({"op": "flatten", "src": [k]})
            self.model.append(Val((1,), v.vma))
            k, v = len(self.model) - 1, self.model[-1]
        if not v.shape:
            return Out(k), P()
        extra = [a for a in self.names if a not in v.vma and self.rng.random() < 0.3]
        named = [a for a in self.names if a in v.vma] + extra
        self.rng.shuffle(named)
        entries: list[list[str]] = [[] for _ in v.shape]
        for a in named:
            entries[self.rng.randrange(len(v.shape))].append(a)
        spec = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries]
        while spec and spec[-1] is None:
            spec.pop()
        return Out(k), P(*spec)

    def outputs(self) -> tuple[Any, Any]:
        last = self.tensors()[-3:]
        ks = sorted({self.rng.choice(last) for _ in range(self.rng.randint(1, 3))})
        if self.rng.random() < 0.2:
            ks.append(self.rng.randrange(len(self.model)))  # anything, floats included
        leaves = [self.out_leaf(k) for k in ks]
        shape = self.rng.random()
        if len(leaves) == 1 and shape < 0.5:
            return leaves[0]
        if shape < 0.75:
            return tuple(o for o, _ in leaves), tuple(s for _, s in leaves)
        keys = [f"y{j}" for j in range(len(leaves))]
        return (
            {"main": {k: o for k, (o, _) in zip(keys, leaves)}},
            {"main": {k: s for k, (_, s) in zip(keys, leaves)}},
        )


OPS = [
    "unary",
    "scale",
    "binary",
    "matmul",
    "const",
    "sum",
    "factory",
    "reshape",
    "axis_index",
    "reduce",
    "reduce",
    "pvary",
    "all_gather",
    "all_gather",
    "psum_scatter",
    "psum_scatter",
    "all_to_all",
    "all_to_all",
    "permute",
    "tree",
]


def _t(A) -> tuple[str, ...]:
    return (A,) if isinstance(A, str) else tuple(A)


def make_case(seed: int) -> Case:
    g = Gen(seed)
    args, in_specs = g.inputs()
    for _ in range(g.rng.randint(3, 10)):
        g.step()
    out_tree, out_specs = g.outputs()
    case = Case(seed, g.sizes, g.names, args, in_specs, out_specs, g.steps, out_tree, g.model)
    return case


def _case_ids():
    return [f"seed{SEED + k}" for k in range(N_CASES)]


def test_generator_is_reproducible_and_varied():
    a, b = make_case(SEED), make_case(SEED)
    assert a.describe() == b.describe()
    cases = [make_case(SEED + k) for k in range(N_CASES)]
    ops = {st["op"] for c in cases for st in c.steps}
    collectives = {"psum", "pmean", "pmax", "pmin", "all_gather", "psum_scatter", "all_to_all"}
    collectives |= {"ppermute", "pshuffle", "pvary", "axis_index", "tree"}
    assert collectives <= ops, f"never sampled: {collectives - ops}"
    assert {len(c.sizes) for c in cases} == {1, 2, 3}
    tuple_axes = [st for c in cases for st in c.steps if isinstance(st.get("axes"), tuple)]
    assert any(len(st["axes"]) > 1 for st in tuple_axes)
    assert any(st.get("tiled") for c in cases for st in c.steps)
    assert any(st.get("tiled") is False for c in cases for st in c.steps)


@pytest.mark.parametrize("k", range(N_CASES), ids=_case_ids())
def test_random_case_matches_reference(k):
    case = make_case(SEED + k)
    mesh = ns.make_mesh(case.sizes, case.names)

    def per_device(*args):
        return interpret(ns, case, *args)

    def per_instance(*args):
        return interpret(REF, case, *args)

    try:
        got = ns.spmd_map(per_device, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs)(
            *case.args
        )
        want = run_reference(per_instance, mesh, case.in_specs, case.out_specs, *case.args)
        assert_trees_close(got, want, rtol=1e-9, atol=1e-9)
    except BaseException as e:
        raise AssertionError(f"case failed:\n{case.describe()}\n{type(e).__name__}: {e}") from e
