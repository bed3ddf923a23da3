"""The one sampler of random spmd programs, shared by every test that runs sampled cases:

* tests/test_sampler.py: values, and the vma of every intermediate value, against the per-instance
  reference (tests/_reference.py);
* tests/test_gradients.py: gradients and forward tangents against the same reference;
* tests/programs_dist.py: cases that tests/dist_worker.py runs on 4 and 8 gloo processes and on the
  simulated mesh (values, gradients, per-device types and communication must agree).

A case is a mesh, random pytree arguments with random in_specs (several axes per dim in any order,
dict prefixes, Python float leaves), a straight-line program of steps over a pool of values, and
an output tree with random out_specs. Steps are elementwise ops, matmuls with a pool value or a
closed-over constant, reductions, factories, reshapes, and every collective with random axes
(tiled and untiled, both ``to=`` modes, negative dims, partial permutations, pytrees). The sampler
tracks each value's local shape and vma by the typing rules of docs/design.md, an independent
model of the type system, so it draws only valid programs; :func:`check_model` asserts that
``ns.vma`` of every value equals the model's.

A case is plain data drawn from ``random.Random(seed)`` alone (never a set's iteration order, which
differs between processes), so every worker process rebuilds the same case from its seed.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass
from typing import Any

import torch
from _reference import tree_leaves, tree_map

import named_spmd as ns
from named_spmd import P

# case k of test_sampler.py is make_case(SEED + k); test_gradients.py's come after those
SEED = int(os.environ.get("NAMED_SPMD_SAMPLER_SEED", "20240601"))
N_CASES = int(os.environ.get("NAMED_SPMD_SAMPLER_CASES", "240"))
N_GRADIENT_CASES = int(os.environ.get("NAMED_SPMD_GRADIENT_CASES", "120"))

# every (sizes, names) a case may run on: 1 to 3 axes, sizes 1 to 8, mesh-order and other names
MESHES = [
    *(((2,), ("a",)), ((4,), ("a",)), ((8,), ("i",))),
    *(((2, 1), ("a", "b")), ((2, 2), ("a", "b")), ((3, 2), ("a", "b"))),
    *(((2, 4), ("dp", "tp")), ((4, 2), ("x", "y")), ((2, 2, 2), ("a", "b", "c"))),
]
MAX_NUMEL = 2048  # per instance: programs stay fast
COLLECTIVES = (
    "psum pmean pmax pmin all_gather psum_scatter all_to_all ppermute pshuffle pbroadcast pvary "
    "axis_index"
).split()


@dataclass
class Val:
    """The model of a pool value: local shape (None: a Python float), vma, and which input leaves
    it is computed from (so that every input can be made to reach the output)."""

    shape: tuple[int, ...] | None
    vma: frozenset[str]
    deps: frozenset[int] = frozenset()


@dataclass(frozen=True)
class Out:
    """A leaf of the output tree: pool entry ``i``."""

    i: int


@dataclass
class Case:
    seed: int
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    args: tuple  # global arguments: a pytree of float64 tensors and Python floats
    in_specs: Any
    out_specs: Any
    steps: list[dict]
    out_tree: Any  # the output pytree, with Out leaves
    model: list[Val]

    @property
    def n_inputs(self) -> int:
        return len(tree_leaves(self.args))

    def describe(self) -> str:
        lines = [f"seed={self.seed} mesh={dict(zip(self.names, self.sizes))}"]
        lines.append(f"in_specs={self.in_specs!r}")
        for k, v in enumerate(self.model[: self.n_inputs]):
            lines.append(f"  %{k}: input {v.shape} {sorted(v.vma)}")
        for k, st in enumerate(self.steps):
            shown = {key: v for key, v in st.items() if not isinstance(v, torch.Tensor)}
            lines.append(f"  step {k}: {shown}")
        lines.append(f"out_tree={self.out_tree!r} out_specs={self.out_specs!r}")
        return "\n".join(lines)


# --- running a case -------------------------------------------------------------------------------


def _t(axes) -> tuple[str, ...]:
    return (axes,) if isinstance(axes, str) else tuple(axes)


def local(x: Any) -> Any:
    """``x`` taken as each instance's local value where it is a partial sum.

    The sampler's programs, as JAX's, apply nonlinear ops to local products over split dims (a
    matmul of two values split alike over the contracted dim), which named_spmd infers to be
    unreduced (docs/design.md section 2.3) and would refuse. This is the one annotation the inference asks of
    them: ``ns.pcast(..., to="varying")``, the fix its error names. Outside a call (the reference
    runs the same steps on plain tensors) it is the identity."""
    if not isinstance(x, torch.Tensor):
        return x
    try:
        u = ns.typeof(x).vma.unreduced
    except ns.SpmdError:  # not inside spmd_map
        return x
    return ns.pcast(x, tuple(sorted(u)), to="varying") if u else x


# the steps without communication: (a, b, step) -> value, for sources a and (maybe) b
LOCAL_STEPS = {
    "tanh": lambda a, b, st: torch.tanh(a),
    "sin": lambda a, b, st: torch.sin(a),
    "affine": lambda a, b, st: a * st["c"] + st["d"],
    "square": lambda a, b, st: a * a * 0.5,
    "scale": lambda a, b, st: a * b,  # b is a Python float leaf
    "add": lambda a, b, st: a + b,
    "mul": lambda a, b, st: a * b,
    "add_sum": lambda a, b, st: a + b.sum(),
    "mix": lambda a, b, st: a * (1 + 0.3 * torch.tanh(b).sum()),
    "mul_prefix": lambda a, b, st: a * b.reshape(-1)[: a.shape[-1]],  # broadcast over a's last dim
    "matmul": lambda a, b, st: a @ b,
    "matmul_const": lambda a, b, st: a @ st["w"],
    "times_const": lambda a, b, st: a * st["w"],
    "sum": lambda a, b, st: a.sum(st["dim"], keepdim=st["keepdim"]),
    "ones_like": lambda a, b, st: torch.ones_like(a) * st["c"],
    "full": lambda a, b, st: torch.full(st["shape"], st["c"], dtype=torch.float64),
    "repeat": lambda a, b, st: a.repeat(*st["reps"]),
    "transpose": lambda a, b, st: a.transpose(-1, -2),
    "flatten": lambda a, b, st: a.reshape(-1),
    "reshape": lambda a, b, st: a.reshape(st["shape"]),
}


def apply_step(o: Any, st: dict, pool: list) -> list:
    """The values step ``st`` adds to the pool; ``o`` is the namespace of the collectives
    (named_spmd, or the reference's REF), which a step calls as
    ``o.<op>(a, axes, *st["args"], **st["kw"])``."""
    op, a = st["op"], pool[st["src"][0]]
    b = pool[st["src"][1]] if len(st["src"]) > 1 else None
    if op in LOCAL_STEPS:
        return [local(LOCAL_STEPS[op](a, b, st))]
    A, args, kw = st["axes"], st.get("args", ()), st.get("kw", {})
    if op == "axis_index":  # an integer tensor added to a float one: type promotion
        return [a + o.axis_index(A)]
    if op == "axis_index_scale":
        return [a * (1 + 0.5 * o.axis_index(A).to(a.dtype) / o.axis_size(A))]
    if op == "tree":  # a collective on the pytree {'u': a, 'v': (b,)}
        out = getattr(o, st["coll"])({"u": a, "v": (b,)}, A, *args, **kw)
        return [out["u"], out["v"][0]]
    return [getattr(o, op)(a, A, *args, **kw)]


def run(o: Any, case: Case, *args: Any, on_values=None) -> Any:
    """The case's program on the local arguments ``args``: its output tree. ``on_values(pool)``
    sees every value (inputs first, then each step's) before the output is built."""
    pool = list(tree_leaves(args))
    for st in case.steps:
        pool.extend(apply_step(o, st, pool))
    if on_values is not None:
        on_values(pool)
    return tree_map(lambda r: pool[r.i], case.out_tree)


def check_model(case: Case, pool: list) -> None:
    """named_spmd's shapes and vma inference agree with the model on every value."""
    for k, (v, m) in enumerate(zip(pool, case.model)):
        if isinstance(v, torch.Tensor):
            assert tuple(v.shape) == m.shape, f"%{k}: shape {tuple(v.shape)} != {m.shape}"
            assert ns.vma(v) == m.vma, f"%{k}: ns.vma {set(ns.vma(v))} != model {set(m.vma)}"


# --- drawing a case -------------------------------------------------------------------------------


class _Draw:
    """The state of one case being drawn: the rng, the mesh, the model of the pool, the steps."""

    def __init__(self, seed: int, world: int | None):
        self.rng = random.Random(seed)
        self.torch_gen = torch.Generator().manual_seed(seed)
        meshes = [m for m in MESHES if world is None or math.prod(m[0]) == world]
        self.sizes, self.names = self.rng.choice(meshes)
        self.size = dict(zip(self.names, self.sizes))
        self.model: list[Val] = []
        self.steps: list[dict] = []
        self.n_inputs = 0  # the first n_inputs pool entries are the argument leaves

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(tuple(shape), generator=self.torch_gen, dtype=torch.float64)

    def axes(self, pool) -> tuple[str, ...] | str:
        """A random non-empty subset of ``pool`` in random order; a single name is sometimes a
        bare name, sometimes a 1-tuple."""
        pool = [a for a in self.names if a in pool]  # mesh order: sets iterate per process
        chosen = self.rng.sample(pool, self.rng.randint(1, len(pool)))
        if len(chosen) == 1 and self.rng.random() < 0.6:
            return chosen[0]
        return tuple(chosen)

    def n(self, A) -> int:
        return math.prod(self.size[a] for a in _t(A))

    def place(self, rank: int, axes, keep_trailing: float) -> P:
        """A spec naming ``axes`` (in random order), each on a random dim of ``rank``; trailing
        unnamed dims are kept with probability ``keep_trailing``."""
        entries: list[list[str]] = [[] for _ in range(rank)]
        for a in self.rng.sample(axes, len(axes)):
            entries[self.rng.randrange(rank)].append(a)
        spec = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in entries]
        while spec and spec[-1] is None and self.rng.random() >= keep_trailing:
            spec.pop()
        return P(*spec)

    # --- inputs
    def spec(self, rank: int) -> P:
        """Each mesh axis names a random dim or none; a dim may take several, in any order."""
        return self.place(rank, [a for a in self.names if self.rng.random() < 0.55], 0.5)

    def tensor_input(self, spec: P | None = None) -> tuple[torch.Tensor, P]:
        rank = self.rng.randint(1, 3)
        local = tuple(self.rng.choice([1, 2, 3, 4, 6]) for _ in range(rank))
        spec = self.spec(rank) if spec is None or len(spec) > rank else spec
        shape = [d * self.n(spec.entry_axes(i)) for i, d in enumerate(local)]
        k = len(self.model)
        self.model.append(Val(local, frozenset(spec.axes), frozenset([k])))
        return self.randn(*shape), spec

    def inputs(self) -> tuple[tuple, tuple]:
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
        self.n_inputs = len(self.model)
        return tuple(args), tuple(specs)

    # --- the program
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
        """Add step ``st`` whose results the model says are ``vals`` (dropped if too large)."""
        if any(math.prod(v.shape) > MAX_NUMEL for v in vals):
            return
        deps = frozenset().union(*(self.model[k].deps for k in st["src"]))
        if st["op"] in ("full", "ones_like"):  # only the shape of the source is used
            deps = frozenset()
        self.steps.append(st)
        self.model.extend(Val(v.shape, v.vma, deps) for v in vals)

    def like(self, k: int, add=(), remove=()) -> Val:
        """A value of pool entry k's shape whose vma gains ``add`` and loses ``remove``."""
        v = self.model[k]
        return Val(v.shape, (v.vma | set(_t(add))) - set(_t(remove)))

    def step(self) -> None:
        getattr(self, "op_" + self.rng.choice(OPS))()

    # --- ops: each emits a step with its modelled result, or nothing when it does not apply
    def op_unary(self):
        a = self.pick()
        op = self.rng.choice(["tanh", "sin", "affine", "square"])
        self.emit({"op": op, "src": [a], "c": 0.5, "d": 0.25}, self.like(a))

    def op_scale(self):
        floats = [k for k, v in enumerate(self.model) if v.shape is None]
        a = self.pick()
        if floats:
            self.emit({"op": "scale", "src": [a, self.rng.choice(floats)]}, self.like(a))

    def op_binary(self):
        a = self.pick()
        va = self.model[a]
        same = self.pick(lambda v: v.shape == va.shape, recent=False)
        if same is not None and self.rng.random() < 0.6:
            op = self.rng.choice(["add", "mul"])
            self.emit({"op": op, "src": [a, same]}, self.like(a, add=self.model[same].vma))
            return
        b = self.pick(recent=False)
        vb = self.model[b]
        ops = ["add_sum", "mix"]
        if va.shape and math.prod(vb.shape) >= va.shape[-1]:
            ops.append("mul_prefix")
        self.emit({"op": self.rng.choice(ops), "src": [a, b]}, self.like(a, add=vb.vma))

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
        st = {"op": "times_const", "src": [a], "w": self.randn(*self.model[a].shape)}
        self.emit(st, self.like(a))

    def op_sum(self):
        a = self.pick(lambda v: len(v.shape) >= 1)
        if a is None:
            return
        v = self.model[a]
        dim, keep = self.rng.randrange(-len(v.shape), len(v.shape)), self.rng.random() < 0.5
        shape, d = list(v.shape), dim % len(v.shape)
        shape[d : d + 1] = [1] if keep else []
        self.emit({"op": "sum", "src": [a], "dim": dim, "keepdim": keep}, Val(tuple(shape), v.vma))

    def op_factory(self):
        a = self.pick()
        v = self.model[a]
        if self.rng.random() < 0.5:  # *_like inherits the vma
            self.emit({"op": "ones_like", "src": [a], "c": 1.5}, self.like(a))
        else:  # a fresh factory is invariant
            st = {"op": "full", "src": [a], "shape": v.shape, "c": -0.75}
            self.emit(st, Val(v.shape, frozenset()))

    def op_reshape(self):
        a = self.pick()
        v = self.model[a]
        r = self.rng.random()
        if len(v.shape) >= 2 and r < 0.3:
            shape = v.shape[:-2] + (v.shape[-1], v.shape[-2])
            self.emit({"op": "transpose", "src": [a]}, Val(shape, v.vma))
        elif len(v.shape) != 1 and r < 0.5:
            self.emit({"op": "flatten", "src": [a]}, Val((math.prod(v.shape),), v.vma))
        elif len(v.shape) >= 1 and r < 0.75:
            numel = math.prod(v.shape)
            shape = self.rng.choice([(k, numel // k) for k in (1, 2, 3, 4) if numel % k == 0])
            self.emit({"op": "reshape", "src": [a], "shape": shape}, Val(shape, v.vma))
        elif len(v.shape) >= 1:
            reps = [1] * len(v.shape)
            reps[self.rng.randrange(len(v.shape))] = self.rng.choice([2, 4])
            shape = tuple(s * r for s, r in zip(v.shape, reps))
            self.emit({"op": "repeat", "src": [a], "reps": reps}, Val(shape, v.vma))

    def op_axis_index(self):
        a = self.pick()
        A = self.axes(self.names)
        op = self.rng.choice(["axis_index", "axis_index_scale"])
        self.emit({"op": op, "src": [a], "axes": A}, self.like(a, add=A))

    def op_reduce(self):
        op = self.rng.choice(["psum", "pmean", "pmax", "pmin"])
        if op == "psum":  # only over axes the operand varies over (else it is an error)
            a = self.pick(lambda v: bool(v.vma))
            if a is None:
                return
            A = self.axes(self.model[a].vma)
        else:  # over any axes: invariant ones are their own mean, max and min
            a = self.pick()
            A = self.axes(self.names)
        self.emit({"op": op, "src": [a], "axes": A}, self.like(a, remove=A))

    def op_pvary(self):
        a = self.pick(lambda v: len(v.vma) < len(self.names))
        if a is None:
            return
        A = self.axes([x for x in self.names if x not in self.model[a].vma])
        self.emit({"op": "pvary", "src": [a], "axes": A}, self.like(a, add=A))

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
        kw = {"axis": axis, "tiled": tiled, "to": to}
        self.emit({"op": "all_gather", "src": [a], "axes": A, "kw": kw}, Val(tuple(shape), vma))

    def split(self, shape, n: int) -> tuple[bool, int, list[int]] | None:
        """(tiled, dim, shape without the dim's split) for a random tiled (dim divisible by n)
        or untiled (dim of size n, removed) split of ``shape``, or None if none fits."""
        tiled = self.rng.random() < 0.5
        dims = [d for d, s in enumerate(shape) if (s % n == 0 if tiled else s == n)]
        if not dims:
            return None
        d, rest = self.rng.choice(dims), list(shape)
        if tiled:
            rest[d] //= n
        else:
            rest.pop(d)
        return tiled, d, rest

    def maybe_negative(self, d: int, rank: int) -> int:
        return d - rank * self.rng.randint(0, 1)

    def op_psum_scatter(self):
        a = self.pick(lambda v: bool(v.vma) and len(v.shape) >= 1)
        if a is None:
            return
        v = self.model[a]
        A = self.axes(v.vma)
        if (split := self.split(v.shape, self.n(A))) is None:
            return
        tiled, d, shape = split
        kw = {"scatter_dimension": self.maybe_negative(d, len(v.shape)), "tiled": tiled}
        self.emit({"op": "psum_scatter", "src": [a], "axes": A, "kw": kw}, Val(tuple(shape), v.vma))

    def op_all_to_all(self):
        a = self.pick(lambda v: len(v.shape) >= 1)
        if a is None:
            return
        v = self.model[a]
        A = self.axes(self.names)
        if (split := self.split(v.shape, self.n(A))) is None:
            return
        tiled, s, shape = split
        c = self.rng.randrange(len(v.shape))
        if tiled:  # the chunks received from the n members are concatenated along c
            shape[c] *= self.n(A)
        else:  # or stacked on a new dim at c
            shape.insert(c, self.n(A))
        split_concat = [self.maybe_negative(d, len(v.shape)) for d in (s, c)]
        st = {"op": "all_to_all", "src": [a], "axes": A, "args": split_concat}
        st["kw"] = {"tiled": tiled}
        self.emit(st, Val(tuple(shape), v.vma | set(_t(A))))

    def op_permute(self):
        a = self.pick()
        A = self.axes(self.names)
        n = self.n(A)
        perm = self.rng.sample(range(n), n)
        if self.rng.random() < 0.5:
            st = {"op": "pshuffle", "src": [a], "axes": A, "args": [perm]}
        else:  # some instances may receive nothing (zeros), or all of them
            dsts = perm[: self.rng.randint(0, n)]
            srcs = self.rng.sample(range(n), len(dsts))
            st = {"op": "ppermute", "src": [a], "axes": A, "args": [list(zip(srcs, dsts))]}
        self.emit(st, self.like(a, add=A))

    def op_pbroadcast(self):
        a = self.pick()
        A = self.axes(self.names)
        st = {"op": "pbroadcast", "src": [a], "axes": A, "args": [self.rng.randrange(self.n(A))]}
        self.emit(st, self.like(a, remove=A))

    def op_tree(self):
        a, b = self.pick(), self.pick(recent=False)
        coll = self.rng.choice(["pmean", "pmax", "pvary", "psum", "pbroadcast"])
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
        args = [self.rng.randrange(self.n(A))] if coll == "pbroadcast" else []
        change = {"add": A} if coll == "pvary" else {"remove": A}
        st = {"op": "tree", "coll": coll, "src": [a, b], "axes": A, "args": args}
        self.emit(st, self.like(a, **change), self.like(b, **change))

    # --- outputs
    def reach_every_input(self) -> int:
        """Mix every tensor input the last value does not depend on into it (so that every
        input has a gradient to check); returns the last value."""
        last = self.tensors()[-1]
        for k in [k for k in self.tensors() if k < self.n_inputs]:
            if k not in self.model[last].deps:
                self.steps.append({"op": "mix", "src": [last, k]})
                v, w = self.model[last], self.model[k]
                self.model.append(Val(v.shape, v.vma | w.vma, v.deps | w.deps))
                last = len(self.model) - 1
        return last

    def out_leaf(self, k: int) -> tuple[Out, P | None]:
        """Pool entry k as an output, with a random out_spec naming every axis of its vma."""
        v = self.model[k]
        if v.shape is None:
            return Out(k), self.rng.choice([None, P()])
        if not v.shape and (v.vma or self.rng.random() < 0.3):  # a varying scalar needs a dim
            self.steps.append({"op": "flatten", "src": [k]})
            self.model.append(Val((1,), v.vma, v.deps))
            k, v = len(self.model) - 1, self.model[-1]
        if not v.shape:
            return Out(k), P()
        named = [a for a in self.names if a in v.vma or self.rng.random() < 0.3]
        return Out(k), self.place(len(v.shape), named, 0.0)

    def outputs(self) -> tuple[Any, Any]:
        last = self.reach_every_input()
        ks = sorted({last} | {self.rng.choice(self.tensors()[-3:]) for _ in range(2)})
        ks = ks[-self.rng.randint(1, len(ks)) :]  # the last value is always among them
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


# how often each op is drawn: the collectives with many arguments more often
OPS = [
    *("unary", "scale", "binary", "matmul", "const", "sum", "factory", "reshape"),
    *("axis_index", "reduce", "reduce", "pvary", "pbroadcast", "tree"),
    *("all_gather", "all_gather", "psum_scatter", "psum_scatter", "all_to_all", "all_to_all"),
    *("permute", "permute"),
]


def make_case(seed: int, world: int | None = None) -> Case:
    """Case ``seed``: on any mesh of :data:`MESHES`, or (``world``) one of that many instances."""
    d = _Draw(seed, world)
    args, in_specs = d.inputs()
    for _ in range(d.rng.randint(3, 10)):
        d.step()
    out_tree, out_specs = d.outputs()
    return Case(seed, d.sizes, d.names, args, in_specs, out_specs, d.steps, out_tree, d.model)


# --- what a set of cases covers -------------------------------------------------------------------


def features(case: Case) -> set[str]:
    """Tags for what ``case`` exercises: ops, collective arguments, meshes, inputs, outputs."""
    tags = {f"mesh:{len(case.sizes)}-axis"} | {f"mesh:size-{s}-axis" for s in case.sizes}
    for st in case.steps:
        op = st["op"] if st["op"] != "tree" else f"tree:{st['coll']}"
        tags.add(op)
        if "axes" in st:
            A = st["axes"]
            tags.add("axes:name" if isinstance(A, str) else f"axes:{min(len(A), 2)}-tuple")
            if list(_t(A)) != [a for a in case.names if a in _t(A)]:
                tags.add("axes:not-in-mesh-order")
        kw, args = st.get("kw", {}), st.get("args", [])
        if "tiled" in kw:
            tags.add(f"{op}:{'tiled' if kw['tiled'] else 'untiled'}")
        if "to" in kw:
            tags.add(f"{op}:to={kw['to']}")
        dims = [kw.get("axis", 0), kw.get("scatter_dimension", 0)]
        if min(dims + (args if op == "all_to_all" else [])) < 0:
            tags.add(f"{op}:negative-dim")
        if op == "ppermute":
            n = math.prod(case.sizes[case.names.index(a)] for a in _t(st["axes"]))
            sent = len(args[0])
            tags.add("ppermute:" + ("empty" if not sent else "partial" if sent < n else "full"))
    for arg, spec in zip(case.args, case.in_specs):
        if isinstance(arg, dict):
            tags.add("input:dict" + (":shared-spec" if isinstance(spec, P) else ""))
        elif not isinstance(arg, torch.Tensor):
            tags.add("input:float")
    for spec in tree_leaves(case.in_specs) + tree_leaves(case.out_specs):
        for entry in spec or ():
            if isinstance(entry, tuple):  # P makes a 1-tuple entry a bare name
                tags.add("spec:several-axes-in-one-dim")
    if isinstance(case.out_tree, (tuple, dict)):
        tags.add(f"output:{type(case.out_tree).__name__}")
    if any(case.model[o.i].shape is None for o in tree_leaves(case.out_tree)):
        tags.add("output:float")
    return tags
