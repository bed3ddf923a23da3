"""Random partial-sum programs (docs/design.md section 2.2), shared by tests/test_partial_random.py
(simulated mesh) and tests/partial_dist.py (2 gloo processes).

A case is a mesh, inputs of random states (varying, invariant, reduced per axis), and a
straight-line program over a pool of values: casts (``ns.pcast``), the collectives that take or
make partial sums (psum, psum_scatter, all_gather to each state), linear ops (scaling, sums
broadcast back with ``expand_as``, ``view_as`` / ``reshape_as`` of a value of any state, a cast
through complex, cumsum, roll, add, sub, cat and stack along positional dims, where with an
invariant mask or a pool value's sign, products, writes of a partial sum, of zero and of a
constant) and nonlinear ones (tanh, a constant added, an integer cast). A model of the states
(:func:`rule`, written from the section's algebra, independent of ``named_spmd._partial``) types
every value and says which steps the library must refuse.

An *accepted* case draws only steps the model accepts; a *refused* case ends with one step the
model refuses. The checks (:func:`check_accepted`, :func:`check_refused`) use the per-instance
reference (tests/_reference.py), which runs any program (a cast is the identity there), with each
step's operands kept per instance:

* every accepted step with an unreduced operand is linear: the sum over each group of instances of
  the step's per-instance results equals the step applied to the true values (the parts summed);
* every refused step is really wrong: typed as the library would type it if it accepted it, the
  per-instance results differ from the step on the true values, or (a product of a partial sum
  with an invariant value: the right values) the invariant operand's per-instance gradient is a
  part of its true gradient. The refused step is drawn away from values it may happen to be
  right on: operands that are one value (``x - x.view_as(x)``, or an op made twice), whole
  numbers (an integer cast of an integer cast), zero rows written or multiplied (a write's
  difference from its operand is zero outside the written row), a square as a condition
  (``_Draw._note_values``);
* an accepted case's outputs and float64 gradients equal the reference's, and every value's type
  (``ns.typeof``) equals the model's; a refused case raises a ``VmaError`` naming the op and fix.

Cases are plain data drawn from ``random.Random(seed)``: every process rebuilds the same case.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

import torch
from _reference import REF, all_coords, instance_index, run_reference

import named_spmd as ns
from named_spmd import P

F64 = torch.float64
ROWS, WIDTH, MAX_WIDTH = 4, 6, 24
ACCEPTED_MESHES = [((2,), ("i",)), ((3,), ("i",)), ((2, 2), ("a", "b"))]
REFUSED_MESHES = ACCEPTED_MESHES
# (seed, refused) of the cases tests/partial_dist.py runs on 2 real processes (a few seconds)
PAIR = ((2,), ("i",))
REAL_CASES = [(20261128 + 200_000 + k, k % 2 == 1) for k in range(12)]
MASK = torch.rand(ROWS, MAX_WIDTH, generator=torch.Generator().manual_seed(9)) > 0.5

# ops of one operand that keep its state; of two (same shapes) that add; those not linear
UNARY = ("neg_scale", "colsum", "view_as", "complex", "cumsum", "roll", "write_zero")
ADDITIVE = ("add", "sub", "cat", "cat_neg", "stack", "where")
NONLINEAR = ("tanh", "add_const", "int_cast", "write_const")
LOCAL = (*UNARY, *ADDITIVE, *NONLINEAR, "reshape_as", "where_by", "mul", "write")
CASTS = {"I": ("varying", "reduced"), "V": ("unreduced",), "R": ("varying",), "U": ("varying",)}
COLLECTIVE_OPS = ("pcast", "psum", "psum_scatter", "all_gather")
# ops whose result holds the values of their first operand (pcast: the identity on the data)
SAME_VALUES = ("view_as", "reshape_as", "complex", "pcast")
# ops whose result is a whole number wherever their operands are (int_cast: everywhere)
WHOLE = (
    *(op for op in UNARY if op != "neg_scale"),  # (times 2.5)
    *ADDITIVE,
    *("add_const", "reshape_as", "where_by", "mul", "write"),
    *COLLECTIVE_OPS,
)
# the torch op a refused step's error names
TORCH_OP = {"cat_neg": "cat", "where_by": "where", "write": "__setitem__", "int_cast": "to"}
TORCH_OP |= {"write_const": "__setitem__", "add_const": "add"}
STATE_OF = {"varying": "V", "invariant": "I", "unreduced": "U", "reduced": "R"}


@dataclass
class Step:
    op: str
    ins: tuple[int, ...]
    arg: Any = None


@dataclass
class Case:
    seed: int
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    args: tuple[torch.Tensor, ...]  # global float64 inputs
    in_specs: tuple
    out_specs: tuple
    steps: list[Step]
    types: list[tuple[str, ...]]  # the model's state per axis of every value (inputs first)
    shapes: list[tuple[int, int]]
    outs: tuple[int, ...]
    refused: bool  # whether the last step is one the library must refuse

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))


# --- the model ---------------------------------------------------------------------------------


def _union(states) -> str:
    states = set(states)
    for s in ("V", "U", "R"):
        if s in states:
            return s
    return "I"


def rule(op: str, ts: list[tuple[str, ...]]) -> tuple[str, ...] | None:
    """The type of local op ``op`` on operands of types ``ts``, or None where the library must
    refuse it (the algebra of docs/design.md section 2.2, axis by axis)."""
    n = len(ts[0])
    if op in UNARY:
        return ts[0]
    if op == "reshape_as":  # the second operand gives only a shape: no values
        return ts[0]
    out = []
    for a in range(n):
        s = [t[a] for t in ts]
        if op in NONLINEAR:
            if s[0] == "U":
                return None
            out.append(s[0])
        elif op in ADDITIVE:  # where's mask is invariant
            if "U" in s and set(s) != {"U"}:
                return None
            out.append(_union(s))
        elif op == "where_by":  # where(sign of s[2], s[0], s[1])
            if "U" in s[:2] and (set(s[:2]) != {"U"} or s[2] not in "IR"):
                return None
            out.append(_union(s))
        elif op == "mul":
            if "U" in s and sorted(s) != ["R", "U"]:
                return None
            out.append(_union(s))
        elif op == "write":  # target[row] = value[row]
            if "U" in s and set(s) != {"U"}:
                return None
            out.append(s[0])
    return tuple(out)


def accepted_type(op: str, ts: list[tuple[str, ...]]) -> tuple[str, ...]:
    """The type the library would give a step it refuses, were it accepted: the target's for a
    write (written in place), else the union of the operands'."""
    if op == "write":
        return ts[0]
    return tuple(_union(c) for c in zip(*ts))


# --- the program ---------------------------------------------------------------------------------


def apply(o: Any, st: Step, xs: list[torch.Tensor]) -> torch.Tensor:
    """Step ``st`` on operands ``xs``; ``o`` holds the collectives (named_spmd or REF)."""
    op, a, x = st.op, st.arg, xs[0]
    if op == "pcast":
        return o.pcast(x, a[0], to=a[1])
    if op == "psum":
        return o.psum(x, a)
    if op == "psum_scatter":
        return o.psum_scatter(x, a, scatter_dimension=1, tiled=True)
    if op == "all_gather":
        return o.all_gather(x, a[0], axis=1, tiled=True, to=a[1])
    return local_op(st, xs)


def local_op(st: Step, xs: list[torch.Tensor]) -> torch.Tensor:
    op, a, x = st.op, st.arg, xs[0]
    if op in ("write", "write_zero", "write_const"):
        w = x.clone()
        w[a[0]] = {"write": lambda: xs[1][a[1]], "write_zero": lambda: 0.0}.get(op, lambda: 1.5)()
        return w
    return {
        "neg_scale": lambda: -(x * 2.5),
        "colsum": lambda: x.sum(0, keepdim=True).expand_as(x),
        "view_as": lambda: x.reshape(-1).view_as(x),
        "reshape_as": lambda: x.reshape(-1).reshape_as(xs[1]),
        "complex": lambda: x.to(torch.complex128).real,
        "cumsum": lambda: x.cumsum(1),
        "roll": lambda: x.roll(1, 0),
        "add": lambda: x + xs[1],
        "sub": lambda: x - xs[1],
        "cat": lambda: torch.cat([x, xs[1]], 1)[:, ::2],
        "cat_neg": lambda: torch.cat([x, xs[1]], -1)[:, 1::2],
        "stack": lambda: torch.stack([x, xs[1]], a).sum(a),
        "where": lambda: torch.where(MASK[:, : x.shape[1]], x, xs[1]),
        "where_by": lambda: torch.where(xs[2] > 0, x, xs[1]),
        "mul": lambda: x * xs[1],
        "tanh": lambda: torch.tanh(x),
        "add_const": lambda: x + 1.0,
        "int_cast": lambda: (x * 3).to(torch.int32).to(F64),
    }[op]()


# --- drawing a case ------------------------------------------------------------------------------


def _spec(t: tuple[str, ...], names) -> P:
    varying = tuple(a for a, s in zip(names, t) if s == "V")
    reduced = {a for a, s in zip(names, t) if s == "R"}
    unreduced = {a for a, s in zip(names, t) if s == "U"}
    return P(varying or None, unreduced=unreduced, reduced=reduced)


class _Draw:
    def __init__(self, rng: random.Random, sizes, names):
        self.rng, self.sizes, self.names = rng, sizes, names
        self.size = dict(zip(names, sizes))
        self.types: list[tuple[str, ...]] = []
        self.shapes: list[tuple[int, int]] = []
        self.steps: list[Step] = []
        # per value: the earliest one whose values it holds (an alias's, a pcast's), and
        # whether it holds whole numbers only: what a refused step is drawn away from
        self.roots: list[int] = []
        self.whole: list[bool] = []
        self.zero_rows: list[frozenset[int]] = []  # rows known to be zero (write_zero's)
        self.nonnegative: list[bool] = []  # (a square's, x * x: as a where_by's condition)
        self._made: dict[tuple, int] = {}  # (op, its operands' roots, arg) -> the value it made
        # per value: a root it equals outside some rows (a write's operand's, but the written)
        self.apart: list[tuple[int, frozenset[int]]] = []

    def add_input(self, t: tuple[str, ...], shape: tuple[int, int]) -> None:
        self.roots.append(len(self.types))
        self.apart.append((len(self.types), frozenset()))
        self.whole.append(False)
        self.zero_rows.append(frozenset())
        self.nonnegative.append(False)
        self.types.append(t)
        self.shapes.append(shape)

    def add(self, st: Step, t: tuple[str, ...], shape: tuple[int, int]) -> None:
        self._note_values(st)
        self.steps.append(st)
        self.types.append(t)
        self.shapes.append(shape)

    def _note_values(self, st: Step) -> None:
        """What is known of the values of ``st``'s result (see ``__init__``)."""
        ins = st.ins
        same = st.op in SAME_VALUES or (st.op.startswith("where") and self._alike(ins))
        # (every op is a function of its operands' values: one made again holds the same)
        made = (st.op, tuple(self.roots[j] for j in ins), st.arg)
        self.roots.append(
            self.roots[ins[0]] if same else self._made.setdefault(made, len(self.types))
        )
        whole = st.op in WHOLE and all(self.whole[j] for j in ins)
        self.whole.append(st.op == "int_cast" or whole)
        self.zero_rows.append(self._zero_rows(st, same))
        root, rows = self.apart[ins[0]]
        if st.op.startswith("write"):
            self.apart.append((root, rows | {st.arg[0]}))
        else:
            self.apart.append((root, rows) if same else (self.roots[-1], frozenset()))
        signs = [self.nonnegative[j] for j in ins]
        square = st.op == "mul" and self._alike(ins)
        kept = same or st.op in (*COLLECTIVE_OPS, *ADDITIVE, "mul", "colsum", "cumsum", "roll")
        self.nonnegative.append(square or (kept and st.op != "sub" and all(signs)))

    def _zero_rows(self, st: Step, same: bool) -> frozenset[int]:
        """The rows of ``st``'s result known to be zero: a row-wise op keeps its operand's, an
        additive one those of both, a write changes its row."""
        zero = [self.zero_rows[j] for j in st.ins]
        if st.op.startswith("write"):
            row = st.arg[0]
            written = st.op == "write_zero" or (st.op == "write" and st.arg[1] in zero[1])
            return zero[0] - {row} | ({row} if written else set())
        if same or st.op in ("neg_scale", "tanh", "int_cast", "cumsum", *COLLECTIVE_OPS):
            return zero[0]
        if st.op == "roll":  # (by one row)
            return frozenset((r + 1) % ROWS for r in zero[0])
        if st.op == "mul":
            return zero[0] | zero[1]
        if st.op == "sub" and self.apart[st.ins[0]][0] == self.apart[st.ins[1]][0]:
            # one value but for some written rows: its difference is zero outside them
            written = self.apart[st.ins[0]][1] | self.apart[st.ins[1]][1]
            return zero[0] & zero[1] | frozenset(range(ROWS)) - written
        if st.op in ADDITIVE:
            return zero[0] & zero[1]
        return frozenset()

    def _alike(self, ins: tuple[int, ...]) -> bool:
        """Whether the values ``ins`` name are one value (an op of them may then be right where
        its types say it is wrong: ``x - x`` is zero, whatever the parts)."""
        return len(ins) > 1 and self.roots[ins[0]] == self.roots[ins[1]]

    def collective(self) -> tuple[Step, tuple[str, ...], tuple[int, int]] | None:
        rng, k = self.rng, self.rng.randrange(len(self.types))
        t, (rows, width) = self.types[k], self.shapes[k]
        a = rng.randrange(len(self.names))
        axis, s = self.names[a], t[a]
        op = rng.choice(("pcast", "psum", "psum_scatter", "all_gather"))
        if op == "pcast":
            to = rng.choice(CASTS[s])
            return Step("pcast", (k,), (axis, to)), _set(t, a, STATE_OF[to]), (rows, width)
        if op == "psum" and s in "VU":
            return Step("psum", (k,), axis), _set(t, a, "I"), (rows, width)
        if op == "psum_scatter" and s in "VU" and width % self.size[axis] == 0:
            shape = (rows, width // self.size[axis])
            return Step("psum_scatter", (k,), axis), _set(t, a, "V"), shape
        if op == "all_gather" and s == "V" and width * self.size[axis] <= MAX_WIDTH:
            to = rng.choice(("varying", "invariant", "reduced"))
            shape = (rows, width * self.size[axis])
            return Step("all_gather", (k,), (axis, to)), _set(t, a, STATE_OF[to]), shape
        return None

    def local(self, want_refused: bool) -> tuple[Step, tuple[str, ...], tuple[int, int]] | None:
        rng = self.rng
        op = rng.choice(LOCAL)
        partial = [j for j, t in enumerate(self.types) if "U" in t]
        k = rng.choice(partial) if rng.random() < 0.5 else rng.randrange(len(self.types))
        shape, t = self.shapes[k], self.types[k]
        alike = [j for j, s in enumerate(self.shapes) if s == shape]
        # partners of the same type (U + U) and reduced where k is unreduced (U * R), more often
        same = [j for j in alike if self.types[j] == t]
        reducing = [j for j in alike if all(x == "R" for x, y in zip(self.types[j], t) if y == "U")]
        ins: tuple[int, ...] = (k,)
        if op in (*ADDITIVE, "mul", "write", "where_by", "reshape_as"):
            ins += (rng.choice(alike + 2 * same + 2 * reducing),)
        if self._alike(ins) and (op == "sub" or want_refused):
            return None  # x - x: zero parts, whose sum no op can get wrong; x op x may be right
        if op == "where_by":
            signs = [j for j in alike if "U" not in self.types[j]]  # ``>`` of a partial sum
            if not signs:
                return None
            ins += (rng.choice(signs),)
        ts = [self.types[j] for j in ins]
        if op == "write" and any(v == "V" and t in "IR" for t, v in zip(*ts)):
            return None  # a varying value into an invariant tensor: the in-place rule's error
        arg: Any = None
        if op.startswith("write"):
            arg = (rng.randrange(ROWS), rng.randrange(ROWS))
        elif op == "stack":
            arg = rng.choice((1, -1))
        t = rule(op, ts)
        if (t is None) != want_refused:
            return None
        if want_refused and op == "int_cast" and self.whole[k]:
            return None  # the cast of parts that are whole numbers is their sum's
        zero = [self.zero_rows[j] for j in ins]
        if want_refused and (
            len(zero[0]) == ROWS
            or op == "write"
            and arg[1] in zero[1]
            or op == "mul"
            and len(zero[0] | zero[1]) == ROWS
        ):
            return None  # zeros, whatever the parts: right where the types say wrong
        if want_refused and op == "where_by" and self.nonnegative[ins[2]]:
            return None  # a condition that selects its first operand nearly everywhere
        return Step(op, ins, arg), (t if t is not None else accepted_type(op, ts)), shape


def _set(t: tuple[str, ...], a: int, s: str) -> tuple[str, ...]:
    return (*t[:a], s, *t[a + 1 :])


def make_case(seed: int, refused: bool = False, mesh: tuple | None = None) -> Case:
    rng = random.Random(seed)
    sizes, names = mesh or rng.choice(REFUSED_MESHES if refused else ACCEPTED_MESHES)
    draw = _Draw(rng, sizes, names)
    gen = torch.Generator().manual_seed(seed)
    args, in_specs = [], []
    for j in range(3):  # the first input varies over every axis: the casts to unreduced start there
        t = tuple("V" if j == 0 else rng.choice("VIIRR") for _ in names)
        rows = ROWS * math.prod(n for n, s in zip(sizes, t) if s == "V")
        args.append(torch.randn(rows, WIDTH, generator=gen, dtype=F64))
        in_specs.append(_spec(t, names))
        draw.add_input(t, (ROWS, WIDTH))
    # the first input cast to unreduced over its first axis: every case holds a partial sum
    first = Step("pcast", (0,), (names[0], "unreduced"))
    draw.add(first, _set(draw.types[0], 0, "U"), (ROWS, WIDTH))
    n_steps = rng.randint(5, 10)
    while len(draw.steps) < n_steps:
        made = draw.collective() if rng.random() < 0.35 else draw.local(False)
        if made is not None:
            draw.add(*made)
    if refused:
        made = None
        while made is None:
            made = draw.local(True)
        draw.add(*made)
    n = len(draw.types)
    outs = (n - 1,) if refused else tuple(sorted({n - 1, rng.randrange(3, n)}))
    return Case(
        seed=seed,
        sizes=sizes,
        names=names,
        args=tuple(args),
        in_specs=tuple(in_specs),
        out_specs=tuple(_spec(draw.types[k], names) for k in outs),
        steps=draw.steps,
        types=draw.types,
        shapes=draw.shapes,
        outs=outs,
        refused=refused,
    )


# --- running it ----------------------------------------------------------------------------------


def _body(o: Any, case: Case, before=lambda s, operands: None, after=lambda out: None):
    """The case's program: ``before(step, operands)`` and ``after(value)`` see each step."""

    def body(*xs):
        pool = list(xs)
        for s, st in enumerate(case.steps):
            operands = [pool[i] for i in st.ins]
            before(s, operands)
            pool.append(apply(o, st, operands))
            after(pool[-1])
        return tuple(pool[k] for k in case.outs)

    return body


def _weights(outs) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    return [torch.randn(o.shape, generator=gen, dtype=F64) for o in outs]


def _value_and_grads(case: Case, run) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    args = [a.clone().requires_grad_() for a in case.args]
    outs = [_global(o) for o in run(args)]
    terms = [(o * w).sum() for o, w in zip(outs, _weights(outs)) if o.requires_grad]
    grads = torch.autograd.grad(sum(terms), args, allow_unused=True) if terms else [None] * 3
    grads = [torch.zeros_like(a) if g is None else _global(g) for a, g in zip(args, grads)]
    return [o.detach() for o in outs], [g.detach() for g in grads]


def _global(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state_text(t: tuple[str, ...]) -> str:
    return "".join(t)


def run_named_spmd(case: Case, mesh) -> dict:
    """The case on ``mesh`` (simulated or real): outputs, gradients and every value's states;
    or the error the library raised."""
    seen: list[str] = []

    def after(out):
        vma = ns.typeof(out).vma
        seen.append("".join(STATE_OF[vma.state(a)] for a in case.names))

    def run(args):
        f = ns.spmd_map(
            _body(ns, case, after=after),
            mesh=mesh,
            in_specs=case.in_specs,
            out_specs=case.out_specs,
        )
        return f(*args)

    try:
        outs, grads = _value_and_grads(case, run)
    except ns.SpmdError as e:
        return {"error": type(e).__name__, "message": str(e), "types": seen}
    return {"error": None, "outs": outs, "grads": grads, "types": seen}


def run_reference_kept(case: Case) -> tuple[list, list, dict]:
    """The per-instance reference of the case's program, through its last step: outputs and
    gradients (None for a refused case) and ``{(step, instance): operands}``."""
    kept: dict[tuple[int, int], list[torch.Tensor]] = {}

    def before(s, operands):
        kept[(s, instance_index())] = [x.detach().clone() for x in operands]

    body = _body(REF, case, before=before)

    def run(args):
        return run_reference(body, case.mesh_shape, case.in_specs, case.out_specs, *args)

    if case.refused:  # the outputs of a refused case mean nothing: only its steps' operands
        with torch.no_grad():
            run_reference(
                body,
                case.mesh_shape,
                case.in_specs,
                case.out_specs,
                *case.args,
                check_invariant=False,
            )
        return [], [], kept
    outs, grads = _value_and_grads(case, run)
    return outs, grads, kept


# --- the checks ----------------------------------------------------------------------------------


def _instances(case: Case) -> list[dict[str, int]]:
    return all_coords(case.mesh_shape)


def _group(case: Case, k: int, axes) -> list[int]:
    """The instances that differ from instance ``k`` only along ``axes``."""
    coords = _instances(case)
    return [
        m
        for m, c in enumerate(coords)
        if all(c[a] == coords[k][a] for a in case.names if a not in axes)
    ]


def _true(case: Case, s: int, j: int, k: int, kept) -> torch.Tensor:
    """Operand ``j`` of step ``s`` as a whole value at instance ``k``: its parts summed over the
    axes it is unreduced over."""
    t = case.types[case.steps[s].ins[j]]
    axes = [a for a, st in zip(case.names, t) if st == "U"]
    return sum(kept[(s, m)][j] for m in _group(case, k, axes))


def _mismatch(case: Case, s: int, kept, typed: tuple[str, ...]) -> bool:
    """Whether step ``s``, its result typed ``typed``, computes other values than the step on the
    whole values: per group of instances over ``typed``'s unreduced axes, the sum of the
    per-instance results against the step on the summed operands."""
    st = case.steps[s]
    axes = [a for a, x in zip(case.names, typed) if x == "U"]
    done: set[int] = set()
    for k in range(len(_instances(case))):
        group = _group(case, k, axes)
        if group[0] in done:
            continue
        done.add(group[0])
        got = sum(local_op(st, kept[(s, m)]) for m in group)
        want = local_op(st, [_true(case, s, j, k, kept) for j in range(len(st.ins))])
        if not torch.allclose(got, want, rtol=1e-9, atol=1e-9):
            return True
    return False


def _gradient_is_partial(case: Case, s: int, kept, typed: tuple[str, ...]) -> bool:
    """Whether an operand of step ``s`` that is one value over the result's unreduced axes
    (invariant or reduced) gets, from one instance, only a part of its true gradient."""
    st = case.steps[s]
    axes = [a for a, x in zip(case.names, typed) if x == "U"]
    if not axes:
        return False
    for j in range(len(st.ins)):
        t = case.types[st.ins[j]]
        if any(t[case.names.index(a)] not in "IR" for a in axes):
            continue
        local = _vjp(st, kept[(s, 0)], j)
        whole = _vjp(st, [_true(case, s, i, 0, kept) for i in range(len(st.ins))], j)
        if not torch.allclose(local, whole, rtol=1e-9, atol=1e-9):
            return True
    return False


def _vjp(st: Step, operands: list[torch.Tensor], j: int) -> torch.Tensor:
    xs = [x.clone().requires_grad_(i == j) for i, x in enumerate(operands)]
    out = local_op(st, xs)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(13), dtype=F64)
    (g,) = torch.autograd.grad((out * cot).sum(), xs[j], allow_unused=True)
    return torch.zeros_like(xs[j]) if g is None else g


def check_accepted(case: Case, got: dict, ref: tuple) -> None:
    """An accepted case: no error, the model's types, the reference's outputs and gradients, and
    every local step with an unreduced operand linear."""
    assert got["error"] is None, (case.seed, got.get("message"))
    n_in = len(case.args)
    want_types = [_state_text(t) for t in case.types[n_in:]]
    assert got["types"] == want_types, (case.seed, got["types"], want_types)
    outs, grads, kept = ref
    for g, w in zip(got["outs"], outs):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{case.seed}: {m}")
    for g, w in zip(got["grads"], grads):
        torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-9, msg=lambda m: f"{case.seed}: {m}")
    for s, st in enumerate(case.steps):
        ts = [case.types[i] for i in st.ins]
        if st.op in LOCAL and any("U" in t for t in ts):
            assert not _mismatch(case, s, kept, case.types[n_in + s]), (case.seed, s, st)


def check_refused(case: Case, got: dict, kept: dict) -> str:
    """A refused case: a ``VmaError`` naming the op and the fix at its last step, which is
    really wrong; returns how ("value" or "gradient")."""
    s = len(case.steps) - 1
    st = case.steps[s]
    assert got["error"] == "VmaError", (case.seed, st, got.get("error"), got.get("message"))
    assert len(got["types"]) == s, (case.seed, "refused at another step", got["message"])
    name = TORCH_OP.get(st.op, st.op)
    assert got["message"].startswith(f"{name} in `_body.<locals>.body`"), got["message"]
    assert "Fix: reduce it first" in got["message"], got["message"]
    typed = case.types[len(case.args) + s]
    if _mismatch(case, s, kept, typed):
        return "value"
    assert _gradient_is_partial(case, s, kept, typed), (case.seed, st, "refused but right")
    return "gradient"


def run_case(case: Case, mesh) -> str:
    """Run and check ``case`` on ``mesh``: "accepted", or how its refused step is wrong."""
    got = run_named_spmd(case, mesh)
    if case.refused:
        return check_refused(case, got, run_reference_kept(case)[2])
    check_accepted(case, got, run_reference_kept(case))
    return "accepted"


def step_kind(case: Case, st: Step) -> str:
    """``op:S,S``: the op and the foremost state of each operand (U, else V, else R, else I)."""
    first = [next((s for s in "UVR" if s in case.types[i]), "I") for i in st.ins]
    return st.op + ":" + ",".join(first)


def steps_seen(cases: list[Case]) -> set[str]:
    """The :func:`step_kind` of every step of ``cases``."""
    return {step_kind(c, st) for c in cases for st in c.steps}
