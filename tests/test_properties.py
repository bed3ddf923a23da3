"""Property-based test (hypothesis) of bad and unusual inputs.

Hypothesis draws whole calls of ``spmd_map``, valid and invalid:

* a simulated mesh of 1 to 3 axes of sizes 1 to 3;
* a dtype (f32, f64, f16, bf16, i64, i32, i8, u8, bool, c64) and a layout of every global input
  (contiguous, transposed, expanded, a strided slice, permuted), sometimes with empty dims;
* the arguments' pytree form (a tensor, two positional arguments, a tuple, a dict, a list, nested
  containers, with None leaves and Python scalars);
* in_specs as pytree prefixes of the arguments: valid (entries None / an axis / a tuple or list of
  axes; a quarter of the split tensors with a dim the axes do not divide, split as torch.chunk
  splits it: the call runs per instance, docs/uneven.md) or not (unknown axis, repeated axis, too
  many entries, an entry of a wrong type, a string / tuple of names / set / int instead of ``P``, a
  prefix of the wrong structure);
* one collective applied inside the mapped function to an argument (a tensor, its parent
  container, or all the arguments), with valid or invalid axis names (unknown, repeated, empty, a
  set, None, an int) and arguments (dims out of range or of wrong types, bad tiling sizes, bad
  ppermute pairs, non-permutations, sources out of range, unknown ``to=``);
* an output tree (the result, or it with a passed-through scalar, None or argument) and its
  out_specs, drawn to fit the result's type or not (an axis it varies over left out, unknown or
  repeated axes, too many entries, wrong types, wrong structure).

An independent model of the rules of docs/design.md sections 1-3 and docs/uneven.md (written here
from the text, not from the library's code; on unequal blocks every instance's shape, each
collective's rule per group, the outputs' blocks laid back) decides what each drawn call must do: return the value the per-instance
reference of tests/_reference.py computes (one thread per instance, collectives written from the
definitions), with the same dtype, shape and structure; or raise an ``ns.SpmdError`` whose message
names the user's function (``drawn_program``) and says how to fix it ("Fix"). Where the design
leaves the outcome open (a None leaf inside a collective's operand, a list where the arguments
have a tuple, a bool ``source``) either is accepted, but never a bare error or a wrong value.
Anything else fails: a bare torch or Python error, a value where an error was due, an error where
a value was due, a value different from the reference, a changed input, or a hang (a watchdog
fails the case with every thread's stack after ``WATCHDOG_S`` seconds).

A second property checks that ``.check(*args)`` (the abstract backend) agrees with the call: it
raises an ``SpmdError`` of the same class exactly when the call does, else it reports the same
global shapes and dtypes.

The reference computes in the inputs' dtype; f16 / bf16 cases are also computed on inputs cast to
f64, and the library's values are compared with those (see :func:`reference`). pmean of integers
or bools must raise (as torch.mean does). The five bugs this test found on its first runs (pmean
of integers and bools, ``.check()``'s pmean dtype, an out_spec error without its fix) are fixed.

Seeded and deterministic (``derandomize=True``, no example database). The number of cases per
test function is ``NAMED_SPMD_PROPERTY_CASES`` (default below); a long run is e.g.
``NAMED_SPMD_PROPERTY_CASES=11000 python -m pytest -q tests/test_properties.py``, with
``NAMED_SPMD_PROPERTY_SEED=<int>`` for cases other than CI's (random from that seed), and
``--hypothesis-show-statistics`` shows how the outcomes, collectives and dtypes were distributed.
tests/test_properties_dist.py runs the strategy's 4-instance cases on 4 gloo processes against
the simulated mesh.
"""

from __future__ import annotations

import faulthandler
import functools
import itertools
import math
import os
import signal
import sys
import threading
import traceback
from dataclasses import dataclass
from typing import Any

import hypothesis
import pytest
import torch
from _reference import REF, _structure, chunk_bounds, run_reference, tree_leaves, tree_map
from hypothesis import HealthCheck, event, given, note, settings
from hypothesis import strategies as st

import named_spmd as ns
from named_spmd import P
from named_spmd._replay import checked_signatures

# Cases per test function (two test functions draw from the same strategy): the default, 2 x 1100
# cases, runs the file in 16-25 s on a shared 2-core machine (11000 each: about 2 minutes).
CASES = int(os.environ.get("NAMED_SPMD_PROPERTY_CASES", "1100"))
# Unset: derandomized (the same cases every run, as CI needs). Set: random cases from this seed,
# for long runs that explore beyond CI's sequence.
SEED = os.environ.get("NAMED_SPMD_PROPERTY_SEED")
WATCHDOG_S = 60  # a case runs in milliseconds: one that runs this long is a hang

SETTINGS = settings(
    max_examples=CASES,
    deadline=None,
    derandomize=SEED is None,
    database=None,
    # A case draws about fifty choices: hypothesis' generation-speed check can trip on a slow,
    # shared CI machine, which says nothing about the library.
    suppress_health_check=[HealthCheck.too_slow],
)


def seeded(test):
    return test if SEED is None else hypothesis.seed(int(SEED))(test)


DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
]
LOW_PRECISION = (torch.float16, torch.bfloat16)
NAME_POOL = ("a", "b", "c", "dp", "tp", "sp")
OPS = (
    "psum pmean pmax pmin all_gather psum_scatter all_to_all ppermute pshuffle pbroadcast pvary "
    "axis_index"
).split()
LAYOUTS = ("contiguous", "transposed", "expanded", "sliced", "permuted")


# --- what a drawn call is made of ------------------------------------------------------------------


@dataclass(frozen=True)
class Spec:
    """A ``P(*entries)`` that the test builds (entries of a wrong type make ``P`` raise)."""

    entries: tuple

    def build(self) -> P:
        return P(*self.entries)

    def __repr__(self) -> str:
        return "Spec" + repr(self.entries)


@dataclass(frozen=True)
class TensorDraw:
    """A global input tensor: shape, layout and the seed of its values."""

    name: str  # "x" (the collective's operand) or "y" (another argument)
    shape: tuple[int, ...]
    layout: str
    seed: int


@dataclass(frozen=True)
class TInfo:
    """The model of a tensor inside the function: per-instance shape, vma, and its name."""

    shape: tuple[int, ...]  # (instance 0's, in a call of unequal blocks)
    vma: frozenset
    name: str = "?"
    # in a call whose inputs split into blocks of unequal sizes (torch.chunk's, where the axes
    # do not divide a dim): every instance's shape, row-major over the mesh; else None
    blocks: tuple[tuple[int, ...], ...] | None = None


@dataclass
class Case:
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    dtype: torch.dtype
    form: str  # the arguments' pytree form, see build_form
    x: TensorDraw
    y: TensorDraw
    scalar: Any  # a Python scalar argument (or None)
    in_specs: Any  # a tree of Spec / None / containers / wrong objects
    op: str
    axis_name: Any
    args: tuple  # the collective's positional arguments after the axis name
    kw: dict
    operand: str  # "x", "parent" (the container holding x) or "all" (the argument tuple)
    out_form: str  # "y", "tuple" (y, aux) or "dict" {"out": y, "aux": aux}
    aux: str  # what the output passes through: "scalar", "none", "x" or "y"
    out_specs: Any

    @property
    def mesh_shape(self) -> dict[str, int]:
        return dict(zip(self.names, self.sizes))

    def describe(self) -> str:
        call = ", ".join(
            [
                repr(self.axis_name),
                *map(repr, self.args),
                *(f"{k}={v!r}" for k, v in self.kw.items()),
            ]
        )
        return (
            f"mesh={self.mesh_shape} dtype={self.dtype} form={self.form} scalar={self.scalar!r}\n"
            f"  x={self.x}\n  y={self.y}\n  in_specs={self.in_specs!r}\n"
            f"  ns.{self.op}(<{self.operand}>, {call})\n"
            f"  out_form={self.out_form} aux={self.aux} out_specs={self.out_specs!r}"
        )


def build_form(form: str, x: Any, y: Any, s: Any) -> tuple:
    """The positional arguments of the call in pytree form ``form``, with leaves x, y, s."""
    if form == "x":
        return (x,)
    if form == "x_y":
        return (x, y)
    if form == "x_s":
        return (x, s)
    if form == "tuple":
        return ((x, s),)
    if form == "dict":
        return ({"x": x, "s": s, "n": None},)
    if form == "list":
        return ([x, y],)
    if form == "nested":
        return ({"p": (x, None), "q": {"y": y}}, s)
    raise AssertionError(form)


FORMS = ("x", "x_y", "x_s", "tuple", "dict", "list", "nested")


def _is_container(t: Any) -> bool:
    return isinstance(t, (tuple, list, dict))


def _children(t: Any) -> list[tuple[Any, Any]]:
    return list(t.items()) if isinstance(t, dict) else list(enumerate(t))


def path_of(tree: Any, pred, path: tuple = ()) -> tuple | None:
    """The path of the first leaf satisfying ``pred`` (None leaves are leaves)."""
    if _is_container(tree):
        for k, c in _children(tree):
            found = path_of(c, pred, (*path, k))
            if found is not None:
                return found
        return None
    return path if pred(tree) else None


def get(tree: Any, path: tuple) -> Any:
    for k in path:
        tree = tree[k]
    return tree


def x_path(case: Case) -> tuple:
    args = build_form(case.form, "X", "Y", case.scalar)
    return path_of(args, lambda leaf: isinstance(leaf, str) and leaf == "X")


def select_operand(case: Case, args: tuple) -> Any:
    path = x_path(case)
    if case.operand == "x":
        return get(args, path)
    if case.operand == "parent":
        return get(args, path[:-1])
    return args


def pack_output(case: Case, y: Any, aux: Any) -> Any:
    """The drawn program's output form around the collective's result ``y``."""
    if case.out_form == "y":
        return y
    if case.out_form == "tuple":
        return (y, aux)
    return {"out": y, "aux": aux}


def select_aux(case: Case, args: tuple) -> Any:
    if case.aux == "scalar":
        return 2.5
    if case.aux == "none":
        return None
    leaves = [leaf for leaf in tree_leaves(args) if isinstance(leaf, (torch.Tensor, TInfo))]
    # "y" when the form has a second tensor, else x
    return leaves[-1] if case.aux == "y" else get(args, x_path(case))


# --- the program -------------------------------------------------------------------------------


def drawn_program(case: Case, o: Any, *args: Any) -> Any:
    """The per-device function: one collective on the chosen operand, then the output tree.

    ``o`` is ``named_spmd`` or the reference's namespace (_RefNamespace); the library sees this
    function through functools.partial, so its errors name `drawn_program`."""
    operand = select_operand(case, args)
    if case.op == "axis_index":
        y = operand + o.axis_index(case.axis_name)
    else:
        y = getattr(o, case.op)(operand, case.axis_name, *case.args, **case.kw)
    return pack_output(case, y, select_aux(case, args))


class _RefNamespace:
    """The reference's collectives applied leaf by leaf to tensors, None leaves kept (what a
    collective of a pytree does: docs/design.md section 3). REF's own pytree mapping treats None
    as a leaf it cannot reduce; the instances call per leaf in the same order, as REF does."""

    def __getattr__(self, name: str) -> Any:
        fn = getattr(REF, name)
        if name in ("axis_index", "axis_size"):
            return fn

        def per_leaf(x, axis_name, *args, **kw):
            return tree_map(lambda t: t if t is None else fn(t, axis_name, *args, **kw), x)

        return per_leaf


REF_NS = _RefNamespace()


# --- the independent model: what a drawn call must do ------------------------------------------


class Invalid(Exception):
    """The model's verdict: the call must raise an SpmdError (the message says why)."""


class BadEntry(Exception):
    """The model's verdict: building a P(...) of the drawn entries must raise."""


def _entry_axes(entry: Any) -> tuple[str, ...]:
    """The axes of a P entry (design section 1), or BadEntry for a wrong type."""
    if entry is None:
        return ()
    if isinstance(entry, str):
        return (entry,)
    if isinstance(entry, (tuple, list)) and all(isinstance(a, str) for a in entry):
        return tuple(entry)
    raise BadEntry(f"P entry {entry!r}")


def _spec_dims(spec: Any) -> list[tuple[str, ...]]:
    """Per-dim axes of a spec leaf (None means P())."""
    return [] if spec is None else [_entry_axes(e) for e in spec.entries]


def _check_entries(tree: Any) -> None:
    if isinstance(tree, Spec):
        _spec_dims(tree)
    elif _is_container(tree):
        for _, c in _children(tree):
            _check_entries(c)


def _check_spec_types(tree: Any, what: str) -> None:
    """Every leaf of a specs tree is a P or None."""
    if _is_container(tree):
        for _, c in _children(tree):
            _check_spec_types(c, what)
    elif not (tree is None or isinstance(tree, Spec)):
        raise Invalid(f"{what} has a leaf {tree!r} that is not a P")


def pair_specs(spec: Any, tree: Any, either: list, what: str) -> list[tuple[Any, Any]]:
    """(spec, leaf) for every leaf of ``tree`` under the prefix ``spec`` (a P or None applies to
    every leaf below it; containers must match: same length, same dict keys)."""
    if spec is None or isinstance(spec, Spec):
        leaves = tree_leaves(tree) if _is_container(tree) else [tree]
        return [(spec, leaf) for leaf in leaves]
    if isinstance(spec, (tuple, list)):
        if not isinstance(tree, (tuple, list)) or len(spec) != len(tree):
            raise Invalid(f"{what}: {spec!r} is not a prefix of {tree!r}")
        if type(spec) is not type(tree):
            either.append(
                f"{what}: a {type(spec).__name__} where the tree has a {type(tree).__name__}"
            )
        return [p for s, t in zip(spec, tree) for p in pair_specs(s, t, either, what)]
    if isinstance(spec, dict):
        if not isinstance(tree, dict) or set(spec) != set(tree):
            raise Invalid(f"{what}: {spec!r} is not a prefix of {tree!r}")
        return [p for k in sorted(tree) for p in pair_specs(spec[k], tree[k], either, what)]
    raise AssertionError(spec)  # _check_spec_types ran first


def _spec_fits(spec: Any, rank: int, mesh: dict, where: str) -> list[tuple[str, ...]]:
    """Design section 1: at most rank entries, known axes, each axis at most once."""
    dims = _spec_dims(spec)
    if len(dims) > rank:
        raise Invalid(f"{where}: {len(dims)} entries for rank {rank}")
    seen: list[str] = [a for axes in dims for a in axes]
    unknown = [a for a in seen if a not in mesh]
    if unknown:
        raise Invalid(f"{where}: unknown axes {unknown}")
    if len(set(seen)) != len(seen):
        raise Invalid(f"{where}: repeated axes in {seen}")
    return dims


def _instances(case: Case) -> list[dict[str, int]]:
    """Every instance's coordinates, row-major over the mesh (first name major)."""
    ranges = [range(s) for s in case.sizes]
    return [dict(zip(case.names, c)) for c in itertools.product(*ranges)]


def _index(coord: dict, axes: tuple, mesh: dict) -> int:
    """Row-major index of ``coord`` over ``axes`` (first name major)."""
    k = 0
    for a in axes:
        k = k * mesh[a] + coord[a]
    return k


def _chunk(size: int, n: int, b: int) -> int:
    """The size of block ``b`` of ``n`` (torch.chunk's: ceil(size / n) each, shorter or empty
    last ones; equal blocks where n divides size)."""
    start, stop = chunk_bounds(size, n, b)
    return stop - start


def model_inputs(case: Case, either: list) -> tuple:
    """The arguments as the function sees them: TInfo per tensor (local shape, vma; where some
    input's blocks differ in size, every instance's shape: the call runs per instance)."""
    mesh = case.mesh_shape
    _check_entries(case.in_specs)
    _check_entries(case.out_specs)
    _check_spec_types(case.in_specs, "in_specs")
    _check_spec_types(case.out_specs, "out_specs")
    args = build_form(case.form, case.x, case.y, case.scalar)
    local: dict[int, Any] = {}
    for spec, leaf in pair_specs(case.in_specs, args, either, "in_specs"):
        if not isinstance(leaf, TensorDraw):
            if _spec_dims(spec) and any(_spec_dims(spec)):
                raise Invalid(f"a spec splits the non-tensor argument {leaf!r}")
            continue
        dims = _spec_fits(spec, len(leaf.shape), mesh, f"argument {leaf.name}")
        dims = dims + [()] * (len(leaf.shape) - len(dims))
        blocks = tuple(
            tuple(
                _chunk(size, math.prod(mesh[a] for a in axes), _index(c, axes, mesh))
                for size, axes in zip(leaf.shape, dims)
            )
            for c in _instances(case)
        )
        vma = frozenset(a for ax in dims for a in ax)
        local[id(leaf)] = TInfo(blocks[0], vma, leaf.name, blocks)
    if all(len(set(t.blocks)) == 1 for t in local.values()):  # equal blocks: one shape
        local = {k: TInfo(t.shape, t.vma, t.name) for k, t in local.items()}
    return tree_map(lambda leaf: local.get(id(leaf), leaf), args)


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _dim(v: Any, rank: int, what: str, either: list) -> int:
    """A dim argument: an int in -rank..rank-1 (bools: either)."""
    if isinstance(v, bool):
        either.append(f"{what}={v!r} is a bool")
        v = int(v)
    if not _is_int(v):
        raise Invalid(f"{what}={v!r} is not an integer")
    if not -rank <= v < rank:
        raise Invalid(f"{what}={v} out of range for rank {rank}")
    return v % rank


def _size_fits(size: int, n: int, tiled: bool, what: str) -> None:
    if (tiled and size % n) or (not tiled and size != n):
        raise Invalid(f"{what} has size {size}, group size {n}, tiled={tiled}")


def _axes_of(axis_name: Any, mesh: dict) -> tuple[str, ...]:
    """Design section 3: an axis name or a tuple (ordered sequence) of unique names."""
    if isinstance(axis_name, str):
        axes: tuple = (axis_name,)
    elif isinstance(axis_name, (tuple, list)):
        axes = tuple(axis_name)
    else:
        raise Invalid(f"axis_name {axis_name!r} is not a name or a tuple of names")
    if not axes or not all(isinstance(a, str) for a in axes):
        raise Invalid(f"axis_name {axis_name!r}")
    if any(a not in mesh for a in axes):
        raise Invalid(f"unknown axis in {axis_name!r}")
    if len(set(axes)) != len(axes):
        raise Invalid(f"repeated axis in {axis_name!r}")
    return axes


def _prepare(case: Case, n: int, either: list) -> None:
    """The arguments checked once per call (design section 3's definitions)."""
    op, args, kw = case.op, case.args, case.kw
    if op == "all_gather" and kw["to"] not in ("varying", "invariant"):
        raise Invalid(f"to={kw['to']!r}")
    if op == "ppermute":
        perm = args[0]
        ok = isinstance(perm, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(_is_int(v) for v in p)
            for p in perm
        )
        if not ok:
            raise Invalid(f"perm {perm!r} is not a list of integer pairs")
        srcs, dsts = [p[0] for p in perm], [p[1] for p in perm]
        if not all(0 <= v < n for v in srcs + dsts):
            raise Invalid(f"perm {perm!r} out of range 0..{n - 1}")
        if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
            raise Invalid(f"perm {perm!r} repeats a source or a destination")
    if op == "pshuffle":
        perm = args[0]
        if not (
            isinstance(perm, (list, tuple))
            and all(_is_int(v) for v in perm)
            and sorted(perm) == list(range(n))
        ):
            raise Invalid(f"perm {perm!r} is not a permutation of range({n})")
    if op == "pbroadcast":
        source = args[0]
        if isinstance(source, bool):
            either.append(f"source={source!r} is a bool")
            source = int(source)
        if not _is_int(source) or not 0 <= source < n:
            raise Invalid(f"source {source!r} not in 0..{n - 1}")


def _collective(case: Case, t: TInfo, axes: tuple, n: int, either: list) -> TInfo:
    """The type and shape rules of design section 3 for one tensor operand."""
    if t.blocks is not None:
        return _collective_per_instance(case, t, axes, n, either)
    op, shape, vma, r = case.op, list(t.shape), t.vma, len(t.shape)
    a = frozenset(axes)
    if op == "psum":
        if not a <= vma:
            raise Invalid(f"psum of an operand invariant over {sorted(a - vma)}")
        return TInfo(t.shape, vma - a)
    if op in ("pmean", "pmax", "pmin"):
        if op != "pmean" and case.dtype.is_complex:
            raise Invalid(f"{op} of a complex operand")
        if op == "pmean" and not (case.dtype.is_floating_point or case.dtype.is_complex):
            raise Invalid("pmean of an integer or bool operand (as torch.mean)")
        return TInfo(t.shape, vma - a)
    if op == "all_gather":
        tiled, to = case.kw["tiled"], case.kw["to"]
        if tiled:
            if r == 0:
                raise Invalid("tiled all_gather of a scalar")
            d = _dim(case.kw["axis"], r, "axis", either)
            shape[d] *= n
        else:
            d = _dim(case.kw["axis"], r + 1, "axis", either)
            shape.insert(d, n)
        return TInfo(tuple(shape), (vma | a) - a if to == "invariant" else vma | a)
    if op == "psum_scatter":
        tiled = case.kw["tiled"]
        d = _dim(case.kw["scatter_dimension"], r, "scatter_dimension", either)
        _size_fits(shape[d], n, tiled, "scatter_dimension")
        if not a <= vma:
            raise Invalid(f"psum_scatter of an operand invariant over {sorted(a - vma)}")
        if tiled:
            shape[d] //= n
        else:
            del shape[d]
        return TInfo(tuple(shape), vma)
    if op == "all_to_all":
        tiled = case.kw["tiled"]
        s = _dim(case.args[0], r, "split_axis", either)
        c = _dim(case.args[1], r, "concat_axis", either)
        _size_fits(shape[s], n, tiled, "split_axis")
        if tiled:
            shape[s] //= n
            shape[c] *= n
        else:
            shape.insert(c, shape.pop(s))
        return TInfo(tuple(shape), vma | a)
    if op in ("ppermute", "pshuffle"):
        return TInfo(t.shape, vma | a)
    if op == "pbroadcast":
        return TInfo(t.shape, vma - a)
    if op == "pvary":
        if vma & a:
            raise Invalid(f"pvary of an operand already varying over {sorted(vma & a)}")
        return TInfo(t.shape, vma | a)
    if op == "axis_index":
        return TInfo(t.shape, vma | a)
    raise AssertionError(op)


def _groups(case: Case, axes: tuple) -> list[list[int]]:
    """The groups of ``axes``: instance indices (row-major over the mesh) in member order."""
    mesh, coords = case.mesh_shape, _instances(case)
    groups: dict[tuple, list[int]] = {}
    for i, c in enumerate(coords):
        groups.setdefault(tuple(c[a] for a in case.names if a not in axes), []).append(i)
    return [sorted(g, key=lambda i: _index(coords[i], axes, mesh)) for g in groups.values()]


def _collective_per_instance(case: Case, t: TInfo, axes: tuple, n: int, either: list) -> TInfo:
    """docs/uneven.md: in a call of unequal blocks each instance has its own shape. A tiled
    all_gather concatenates its members' blocks along its axis (their other dims must agree); a
    tiled psum_scatter sums operands of one shape and keeps torch.chunk's block of the sum (any
    size); every other collective takes one shape on every member of a group; pvary and
    axis_index take any shapes. The type rules are the even ones, per instance."""
    op, tiled, a = case.op, case.kw.get("tiled"), frozenset(axes)
    if op == "psum_scatter" and tiled:  # (the even rule would ask n to divide the dim)
        d = _dim(case.kw["scatter_dimension"], len(t.shape), "scatter_dimension", either)
        if not a <= t.vma:
            raise Invalid(f"psum_scatter of an operand invariant over {sorted(a - t.vma)}")
        typed = TInfo(t.shape, t.vma)
    else:
        typed = _collective(case, TInfo(t.shape, t.vma), axes, n, either)  # its type rules
    if op in ("pvary", "axis_index"):
        return TInfo(typed.shape, typed.vma, blocks=t.blocks)
    new = list(t.blocks)
    if op == "all_gather" and tiled:
        d = _dim(case.kw["axis"], len(t.shape), "axis", [])
        for group in _groups(case, axes):
            shapes = [t.blocks[m] for m in group]
            if len({s[:d] + s[d + 1 :] for s in shapes}) > 1:
                raise Invalid(f"tiled all_gather of blocks {shapes} differing off dim {d}")
            for m in group:
                new[m] = (*t.blocks[m][:d], sum(s[d] for s in shapes), *t.blocks[m][d + 1 :])
        return TInfo(new[0], typed.vma, blocks=tuple(new))
    for group in _groups(case, axes):
        if len({t.blocks[m] for m in group}) > 1:
            raise Invalid(f"{op} of operands of shapes {[t.blocks[m] for m in group]}")
    if op == "psum_scatter" and tiled:
        for group in _groups(case, axes):
            for j, m in enumerate(group):
                s = t.blocks[m]
                new[m] = (*s[:d], _chunk(s[d], n, j), *s[d + 1 :])
        return TInfo(new[0], t.vma, blocks=tuple(new))
    each = [_collective(case, TInfo(s, t.vma), axes, n, either) for s in t.blocks]
    return TInfo(each[0].shape, each[0].vma, blocks=tuple(e.shape for e in each))


def _lays_back(case: Case, t: TInfo, dims: list[tuple[str, ...]]) -> None:
    """An output of unequal blocks is laid back by concatenation: along each dim a block's size
    depends only on the axes its out_spec names there (design: docs/uneven.md)."""
    if t.blocks is None:
        return
    coords = _instances(case)
    named = {a for axes in dims for a in axes}
    for c, shape in zip(coords, t.blocks):
        if any(c[a] for a in case.names if a not in named):
            continue  # (coordinate 0 of an axis the out_spec does not name is the value)
        for d, axes in enumerate(dims + [()] * (len(shape) - len(dims))):
            home = {a: (c[a] if a in axes else 0) for a in case.names}
            if t.blocks[coords.index(home)][d] != shape[d]:
                raise Invalid(f"output blocks {t.blocks} do not lay back along dim {d}")


def model_output(case: Case, either: list) -> Any:
    """The output tree as the model sees it (TInfo per tensor), or Invalid / BadEntry."""
    mesh = case.mesh_shape
    args = model_inputs(case, either)
    axes = _axes_of(case.axis_name, mesh)
    n = math.prod(mesh[a] for a in axes)
    _prepare(case, n, either)
    operand = select_operand(case, args)
    if case.op == "axis_index" and not isinstance(operand, TInfo):
        raise AssertionError("axis_index is drawn with a tensor operand only")

    def leaf(t: Any) -> Any:
        if t is None:  # optree's default: None is an empty node, not a leaf
            either.append("a None leaf in a collective's operand")
            return None
        if not isinstance(t, TInfo):
            raise Invalid(f"a collective's operand has a non-tensor leaf {t!r}")
        return _collective(case, t, axes, n, either)

    y = tree_map(leaf, operand)
    return pack_output(case, y, select_aux(case, args))


def check_out_specs(case: Case, out: Any, either: list) -> None:
    """Design sections 1-2: out_specs a prefix; per tensor leaf at most rank entries, known and
    unique axes, and every axis the value varies over named; non-tensors not split."""
    mesh = case.mesh_shape
    for spec, leaf in pair_specs(case.out_specs, out, either, "out_specs"):
        if not isinstance(leaf, TInfo):
            if any(_spec_dims(spec)):
                raise Invalid(f"out_spec {spec!r} splits the non-tensor output {leaf!r}")
            continue
        dims = _spec_fits(spec, len(leaf.shape), mesh, "output")
        named = {ax for axes in dims for ax in axes}
        if not leaf.vma <= named:
            raise Invalid(f"output varies over {sorted(leaf.vma - named)} not in {spec!r}")
        _lays_back(case, leaf, dims)


def verdict(case: Case) -> tuple[str, str]:
    """("P", why): building a P must raise; ("error", why): the call must raise an SpmdError;
    ("ok", ""): it must return the reference's value; ("either", why): one or the other."""
    either: list[str] = []
    try:
        out = model_output(case, either)
        check_out_specs(case, out, either)
    except BadEntry as e:
        return "P", str(e)
    except Invalid as e:
        return "error", str(e)
    return ("either", "; ".join(either)) if either else ("ok", "")


# --- building the inputs -------------------------------------------------------------------------


def _values(shape: tuple[int, ...], dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    """Values exact in every float dtype (multiples of 1/4), integers over their whole range
    (psum wraps around alike in the library and the reference), bools, complex numbers."""
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype == torch.uint8:
        return torch.randint(0, 256, shape, generator=g).to(dtype)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g).to(dtype)
    if dtype == torch.int32:
        return torch.randint(-(2**30), 2**30, shape, generator=g).to(dtype)
    if dtype == torch.int64:
        return torch.randint(-(2**40), 2**40, shape, generator=g) * 2**21
    if dtype.is_complex:
        re, im = (torch.randint(-8, 9, shape, generator=g) / 4 for _ in range(2))
        return torch.complex(re, im).to(dtype)
    return (torch.randint(-8, 9, shape, generator=g) / 4).to(dtype)


def make_tensor(t: TensorDraw, dtype: torch.dtype) -> torch.Tensor:
    """The global tensor of shape ``t.shape`` in layout ``t.layout`` (falls back to contiguous
    where the rank or sizes do not allow the layout)."""
    g = torch.Generator().manual_seed(t.seed)
    shape, r = t.shape, len(t.shape)
    if t.layout == "transposed" and r >= 2:
        base = _values((*shape[:-2], shape[-1], shape[-2]), dtype, g)
        return base.t() if r == 2 else base.transpose(-1, -2)
    if t.layout == "expanded" and r >= 1:
        if t.seed % 3 == 0:  # expanded from a lower-rank tensor: a new leading dim
            return _values(shape[1:], dtype, g).expand(shape)
        ones = tuple(1 if k % 2 == 0 else s for k, s in enumerate(shape))  # even dims: stride 0
        return _values(ones, dtype, g).expand(shape)
    if t.layout == "sliced" and r >= 1:
        d = t.seed % r
        big = list(shape)
        big[d] = 2 * shape[d] + 1
        base = _values(tuple(big), dtype, g)
        return base[(slice(None),) * d + (slice(1, 1 + 2 * shape[d], 2),)]  # every other row
    if t.layout == "permuted" and r >= 3:
        base = _values((shape[2], shape[0], shape[1]), dtype, g)
        return base.permute(1, 2, 0)
    return _values(shape, dtype, g)


def build_specs(tree: Any) -> Any:
    """Spec -> P (may raise SpecError); containers rebuilt; anything else unchanged."""
    if isinstance(tree, Spec):
        return tree.build()
    if isinstance(tree, dict):
        return {k: build_specs(v) for k, v in tree.items()}
    if isinstance(tree, (tuple, list)):
        return type(tree)(build_specs(v) for v in tree)
    return tree


def build_args(case: Case) -> tuple:
    x, y = (make_tensor(t, case.dtype) for t in (case.x, case.y))
    return build_form(case.form, x, y, case.scalar)


# --- strategies ------------------------------------------------------------------------------------


class Drawer:
    """The state of one case being drawn. Half the cases are drawn *faultless* (no fault is
    injected: the call is valid unless the drawn pieces clash, e.g. a psum of an operand that
    its spec leaves invariant); the others inject faults at every choice point at low rates.
    Shrinking goes towards faultless cases and the first option of every choice."""

    def __init__(self, draw, names: tuple[str, ...], mesh: dict[str, int], faulty: bool):
        self.draw, self.names, self.mesh, self.faulty = draw, names, mesh, faulty
        self.unknown = next(n for n in ("tq", "zz", *NAME_POOL) if n not in names)

    def pick(self, options: list, weights: list[int] | None = None) -> Any:
        """One of ``options`` (hypothesis shrinks towards the first)."""
        if weights is not None:
            options = [o for o, w in zip(options, weights) for _ in range(w)]
        return self.draw(st.sampled_from(options))

    def fault(self, faults: list[str], rate: int = 12) -> str:
        """Either "none" or (in a faulty case, about once in ``rate``) one of ``faults``."""
        if not self.faulty:
            return "none"
        return self.pick(["none", *faults], [rate * len(faults), *[1] * len(faults)])

    def integer(self, lo: int, hi: int) -> int:
        return self.draw(st.integers(lo, hi))

    def flag(self) -> bool:
        return self.draw(st.booleans())

    def order(self, items) -> list:
        return list(self.draw(st.permutations(list(items))))

    # --- collective
    def axis_name(self) -> Any:
        axes = self.order(self.names)[: self.integer(1, len(self.names))]
        kind = self.fault(["unknown", "repeated", "empty", "set", "null", "int"], rate=3)
        if kind == "none":
            if len(axes) == 1 and self.flag():
                return axes[0]
            return list(axes) if len(axes) > 1 and self.pick([False, True], [3, 1]) else tuple(axes)
        return {
            "unknown": self.unknown if self.flag() else (*axes, self.unknown),
            "repeated": (*axes, axes[0]),
            "empty": (),
            "set": set(axes),
            "null": None,
            "int": 0,
        }[kind]

    def dim_arg(self, rank: int, bad: bool) -> Any:
        """A dim in -rank..rank-1, or (bad) out of range or of a wrong type."""
        if not bad and rank > 0:
            return self.integer(-rank, rank - 1)
        kind = self.pick(["high", "low", "str", "float", "none"])
        return {"high": rank, "low": -rank - 1, "str": "0", "float": 1.0, "none": None}[kind]

    def collective(self, local: list[int]) -> tuple[str, Any, tuple, dict]:
        """(op, axis_name, args, kw); the operand's local shape ``local`` is adjusted in place
        so that the drawn dims mostly fit it."""
        op = self.pick(OPS)
        axis_name = self.axis_name()
        try:
            n = math.prod(self.mesh[a] for a in _axes_of(axis_name, self.mesh))
        except Invalid:
            n = self.integer(1, 3)  # the call fails anyway: any group size will do
        bad = self.fault(["args"], rate=2) == "args"
        args: tuple = ()
        kw: dict = {}
        if op == "all_gather":
            tiled = self.flag()
            if tiled and not bad:
                local[:] = local or [self.integer(1, 3)]
            bad_to = bad and self.flag()  # else the axis is bad
            to = self.pick(
                ["replicated", "invarying", None] if bad_to else ["varying", "invariant"]
            )
            axis = self.dim_arg(len(local) + (0 if tiled else 1), bad and not bad_to)
            kw = {"axis": axis, "tiled": tiled, "to": to}
        elif op in ("psum_scatter", "all_to_all"):
            tiled = self.flag()
            if not bad:
                local[:] = local or [self.integer(1, 3)]
            r = len(local)
            dims = [self.dim_arg(r, bad and self.flag()) for _ in range(2)]
            if isinstance(dims[0], int) and -r <= dims[0] < r and self.pick([True, False], [6, 1]):
                local[dims[0] % r] = n * (self.integer(1, 2) if tiled else 1)  # fits the group
            if op == "psum_scatter":
                kw = {"scatter_dimension": dims[0], "tiled": tiled}
            else:
                args, kw = (dims[0], dims[1]), {"tiled": tiled}
        elif op == "ppermute":
            dst = self.order(range(n))
            perm: list = [(s, dst[s]) for s in range(n) if self.flag()]
            if bad:
                kind = self.pick(
                    ["dup_src", "dup_dst", "range", "negative", "flat", "float", "triple"]
                )
                perm = {
                    "dup_src": [*perm, (0, 0), (0, n - 1)],
                    "dup_dst": [*perm, (0, 0), (n - 1, 0)],
                    "range": [*perm, (0, n)],
                    "negative": [(-1, 0)],
                    "flat": list(range(n)),
                    "float": [(0.0, float(n - 1))],
                    "triple": [(0, 0, 0)],
                }[kind]
            args = (perm,)
        elif op == "pshuffle":
            perm = self.order(range(n))
            if bad:
                kind = self.pick(["dup", "short", "long", "range", "float", "pairs"])
                perm = {
                    "dup": [0] * (n + (n == 1)),
                    "short": perm[:-1],
                    "long": [*perm, n],
                    "range": [p + 1 for p in perm],
                    "float": [float(p) for p in perm],
                    "pairs": [(p, p) for p in perm],
                }[kind]
            args = (perm,)
        elif op == "pbroadcast":
            source: Any = self.integer(0, n - 1)
            if bad:
                source = self.pick([n, -1, "0", 1.0, True, None])
            args = (source,)
        return op, axis_name, args, kw

    # --- specs
    def entries(self, rank: int, want: tuple[str, ...], avoid: tuple[str, ...]) -> tuple:
        """Valid P entries for a tensor of ``rank``: each dim None, an axis, or several axes in
        any order (a name, a 1-tuple, a list or a tuple); trailing Nones sometimes kept. The
        axes ``want`` are named where the rank allows, ``avoid`` never."""
        pool = [a for a in self.order(self.names) if a not in avoid]
        named = [a for a in pool if a in want] + [a for a in pool if a not in want]
        named = named[: max(len([a for a in pool if a in want]), self.integer(0, len(pool)))]
        dims: list[list[str]] = [[] for _ in range(rank)]
        for a in named if rank else ():
            dims[self.integer(0, rank - 1)].append(a)
        entries: list = []
        for axes in dims:
            if len(axes) == 1:
                kind = self.pick(["name", "tuple", "list"], [6, 1, 1])
                entries.append(
                    axes[0] if kind == "name" else (axes[0],) if kind == "tuple" else axes
                )
            else:
                entries.append(None if not axes else tuple(axes) if self.flag() else list(axes))
        while entries and entries[-1] is None and self.flag():
            entries.pop()
        return tuple(entries)

    def spec_leaf(self, entries: tuple) -> Any:
        """A Spec of ``entries``, or (faulty) a broken spec or a wrong object in its place."""
        fault = self.fault(
            ["unknown", "repeated", "long", "entry", "set_entry", "str", "names", "set", "int"]
        )
        if fault == "none":
            return Spec(entries)
        names = self.names
        return {
            "unknown": Spec((self.unknown, *entries[1:])),
            "repeated": Spec(((names[0], names[0]), *entries[1:])),
            "long": Spec((*entries, *[None] * self.integer(1, 2), names[0])),
            "entry": Spec((*entries, self.pick([1, 1.5, b"a"]))),
            "set_entry": Spec(({names[0]},)),
            "str": names[0],
            "names": tuple(names),
            "set": set(names),
            "int": 0,
        }[fault]

    def non_tensor_spec(self) -> Any:
        return self.pick([None, Spec(()), Spec((self.names[0],))], [4, 4, self.faulty])

    def prefix(self, tree: Any, leaf_spec) -> Any:
        """A specs prefix of ``tree``: at each container one spec for the whole subtree
        (``leaf_spec(subtree)``, which returns DESCEND where it has none to give) or a
        container of prefixes; faulty: a wrong structure."""
        spec = DESCEND
        if not _is_container(tree) or self.pick([False, True], [1, 3]) is False:
            spec = leaf_spec(tree)
        if spec is DESCEND:
            kids = [(k, self.prefix(c, leaf_spec)) for k, c in _children(tree)]
            out: Any = dict(kids) if isinstance(tree, dict) else type(tree)(v for _, v in kids)
            fault = self.fault(["short", "long", "key", "swap"])
            if fault == "short" and not isinstance(out, dict):
                return type(out)(out[:-1])
            if fault == "long" and not isinstance(out, dict):
                return type(out)((*out, Spec(())))
            if fault == "key" and isinstance(out, dict):
                return {f"k{k}": v for k, v in out.items()}
            if fault == "swap" and not isinstance(out, dict):  # a list for a tuple, and back
                return list(out) if isinstance(out, tuple) else tuple(out)
            return out
        return (spec,) if self.fault(["container"], rate=20) == "container" else spec


DESCEND = object()  # a spec leaf drawer's answer: no single spec for this subtree


def _mesh_sizes(instances: int) -> list[tuple[int, ...]]:
    """The mesh shapes the strategy draws (1 to 3 axes of sizes 1 to 3) with ``instances``."""
    shapes = [s for k in (1, 2, 3) for s in itertools.product((1, 2, 3), repeat=k)]
    return [s for s in shapes if math.prod(s) == instances]


def _non_tensors(subtree: Any) -> bool:
    leaves = tree_leaves(subtree) if _is_container(subtree) else [subtree]
    return any(not isinstance(t, (str, TInfo)) for t in leaves)


@st.composite
def cases(draw, check: bool = False, instances: int | None = None) -> Case:
    """A drawn call (``check``: for the check() property; ``instances``: only meshes of that many
    instances, as tests/properties_dist.py needs, instead of drawing and discarding the others)."""
    faulty = draw(st.booleans())
    if instances is None:
        k = draw(st.integers(1, 3))
        names = tuple(draw(st.permutations(NAME_POOL))[:k])
        sizes = tuple(draw(st.integers(1, 3)) for _ in range(k))
    else:
        sizes = draw(st.sampled_from(_mesh_sizes(instances)))
        names = tuple(draw(st.permutations(NAME_POOL))[: len(sizes)])
    mesh = dict(zip(names, sizes))
    d = Drawer(draw, names, mesh, faulty)
    dtype = d.pick(DTYPES)

    def tensor_shape() -> list[int]:
        rank = d.pick([1, 2, 0, 3], [4, 4, 1, 2])
        return [d.pick([1, 2, 3, 4, 0], [6, 6, 4, 3, 1]) for _ in range(rank)]

    x_local = tensor_shape()
    op, axis_name, cargs, kw = d.collective(x_local)
    y_local = list(x_local) if d.flag() else tensor_shape()
    form = d.pick(list(FORMS))
    operand = "x" if op == "axis_index" else d.pick(["x", "parent", "all"], [6, 2, 1])
    scalar = d.pick([None, 0.5, 3, -1.25, True])

    # in_specs: a prefix of the arguments; each spec leaf is drawn for the first tensor it
    # covers, and each tensor's global shape is derived from the spec that covers it. Faultless
    # cases name the collective's axes in the operand's spec where its policy needs them varying
    # (psum, psum_scatter) and leave them out where it needs them invariant (pvary).
    try:
        axes = _axes_of(axis_name, mesh)
    except Invalid:
        axes = ()
    want = axes if op in ("psum", "psum_scatter") and not faulty else ()
    avoid = axes if op == "pvary" and not faulty else ()
    local = {"X": x_local, "Y": y_local}
    covering: dict[str, tuple[tuple, bool]] = {}

    def leaf_spec(subtree: Any) -> Any:
        leaves = tree_leaves(subtree) if _is_container(subtree) else [subtree]
        tensors = [t for t in leaves if t in ("X", "Y") and isinstance(t, str)]
        if not tensors:
            return d.non_tensor_spec()
        if _non_tensors(subtree) and not faulty:  # one P() for tensors and non-tensors alike
            for t in tensors:
                covering[t] = ((), True)
            return d.pick([Spec(()), None])
        entries = d.entries(len(local[tensors[0]]), want, avoid)
        divisible = d.pick([True, False], [3, 1])  # else torch.chunk's blocks of unequal sizes
        for t in tensors:
            covering[t] = (entries, divisible)
        return d.spec_leaf(entries)

    in_specs = d.prefix(build_form(form, "X", "Y", scalar), leaf_spec)
    shapes = {}
    for t in ("X", "Y"):
        entries, divisible = covering.get(t, ((), True))
        shape = list(local[t])
        splits = []
        for dim, entry in enumerate(entries[: len(shape)]):
            n = math.prod(mesh.get(a, 1) for a in _entry_axes(entry))
            shape[dim] *= n
            splits += [dim] if n > 1 else []
        if not divisible and splits:
            shape[d.pick(splits)] += 1
        shapes[t] = tuple(shape)
    x = TensorDraw("x", shapes["X"], d.pick(list(LAYOUTS)), d.integer(0, 2**16))
    y = TensorDraw("y", shapes["Y"], d.pick(list(LAYOUTS)), d.integer(0, 2**16))
    out_form = d.pick(["y", "tuple", "dict"], [3, 1, 1])
    aux = d.pick(["scalar", "none", "x", "y"])
    case = Case(
        sizes,
        names,
        dtype,
        form,
        x,
        y,
        scalar,
        in_specs,
        op,
        axis_name,
        cargs,
        kw,
        operand,
        out_form,
        aux,
        out_specs=None,
    )

    # out_specs: drawn to fit the modelled output (where the model gets that far): every axis
    # the value varies over named, sometimes others too (tiled copies); faulty: one left out
    try:
        out_info = model_output(case, [])
    except (Invalid, BadEntry):
        out_info = tree_map(lambda _: TInfo((1,), frozenset()), build_form(form, "X", "Y", scalar))

    def out_leaf_spec(subtree: Any) -> Any:
        leaves = tree_leaves(subtree) if _is_container(subtree) else [subtree]
        tensors = [t for t in leaves if isinstance(t, TInfo)]
        if not tensors:
            return d.non_tensor_spec()
        if _non_tensors(subtree) and not faulty:  # only P() fits a non-tensor
            return d.pick([Spec(()), None]) if not any(t.vma for t in tensors) else DESCEND
        t = tensors[0]
        r = len(t.shape)
        named = [a for a in names if a in t.vma]
        if named and d.fault(["drop"], rate=4) == "drop":
            named.remove(d.pick(named))
        named += [a for a in names if a not in t.vma and d.pick([False, True], [3, 1])]
        dims: list[list[str]] = [[] for _ in range(r)]
        for a in d.order(named) if r else ():
            dims[d.integer(0, r - 1)].append(a)
        entries = [None if not e else e[0] if len(e) == 1 else tuple(e) for e in dims]
        if r == 0 and named:
            entries = [tuple(named)]  # a rank-0 output cannot name axes: this must fail
        while entries and entries[-1] is None and d.flag():
            entries.pop()
        return d.spec_leaf(tuple(entries))

    case.out_specs = d.prefix(out_info, out_leaf_spec)
    return case


# --- running a case ------------------------------------------------------------------------------


def _tolerance(dtype: torch.dtype) -> tuple[float, float]:
    if dtype == torch.float16:
        return 2e-3, 2e-3
    if dtype == torch.bfloat16:
        return 1.6e-2, 1.6e-2
    if dtype in (torch.float32, torch.complex64):
        return 1e-6, 1e-6
    if dtype == torch.float64:
        return 1e-12, 1e-12
    return 0.0, 0.0  # integers and bools: exact


def in_f64(case: Case) -> bool:
    """Whether the reference computes the case's values in f64 too (see :func:`reference`)."""
    exact = case.dtype.is_floating_point or case.dtype.is_complex
    return case.dtype in LOW_PRECISION or (case.op == "pmean" and not exact)


def reference(case: Case, fn, in_specs, out_specs, args) -> tuple[Any, Any]:
    """(the per-instance reference's result, its values computed in f64, or None).

    The reference computes in the inputs' dtype, adding one instance's value at a time. For
    f16 / bf16 that rounds and overflows differently from a reduction, and for pmean of integers
    and bools it is not a mean (integers wrap around, bools add as a logical or); those cases
    run a second time on inputs cast to f64, whose values the library's must match to the result
    dtype's tolerance. The structure, shapes and dtypes the library must return are always the
    first run's."""
    want = run_reference(fn, case.mesh_shape, in_specs, out_specs, *args)
    if not in_f64(case):
        return want, None
    args = tree_map(lambda t: t.to(torch.float64) if isinstance(t, torch.Tensor) else t, args)
    return want, run_reference(fn, case.mesh_shape, in_specs, out_specs, *args)


def assert_matches_reference(got: Any, want: Any, want_f64: Any) -> None:
    """Same structure, non-tensor leaves, shapes and dtypes as ``want``; values equal to
    ``want_f64`` (where given, compared in f64) or ``want``, to the dtype's tolerance."""
    assert _structure(got) == _structure(want), f"structure {_structure(got)} != {_structure(want)}"
    values = tree_leaves(want if want_f64 is None else want_f64)
    for j, (g, w, v) in enumerate(zip(tree_leaves(got), tree_leaves(want), values)):
        if not isinstance(w, torch.Tensor):
            assert not isinstance(g, torch.Tensor) and g == w and type(g) is type(w), (j, g, w)
            continue
        assert isinstance(g, torch.Tensor), f"leaf {j}: got {type(g).__name__}"
        assert g.shape == w.shape, f"leaf {j}: shape {tuple(g.shape)} != {tuple(w.shape)}"
        assert g.dtype == w.dtype, f"leaf {j}: dtype {g.dtype} != {w.dtype}"
        rtol, atol = _tolerance(g.dtype)
        torch.testing.assert_close(
            g if want_f64 is None else g.to(v.dtype),
            v,
            rtol=rtol,
            atol=atol,
            msg=lambda m: f"leaf {j}: {m}",
        )


def assert_clear_error(e: ns.SpmdError, *, names_fn: bool = True) -> None:
    msg = str(e)
    assert "Fix" in msg, f"{type(e).__name__} without a fix:\n{msg}"
    if names_fn:
        assert "`drawn_program`" in msg, f"{type(e).__name__} does not name the function:\n{msg}"


def _snapshot(args: tuple) -> list:
    return [t.clone() if isinstance(t, torch.Tensor) else t for t in tree_leaves(args)]


def assert_unchanged(before: list, args: tuple) -> None:
    for j, (b, a) in enumerate(zip(before, tree_leaves(args))):
        if isinstance(b, torch.Tensor):
            assert torch.equal(a, b), f"argument leaf {j} was modified in place"


def run_case(case: Case) -> str:
    """Run one drawn call against the verdict; returns the outcome (for statistics)."""
    kind, why = verdict(case)
    note(case.describe())
    note(f"verdict: {kind} {why}")
    try:
        in_specs, out_specs = build_specs(case.in_specs), build_specs(case.out_specs)
    except ns.SpmdError as e:
        assert kind == "P", f"P(...) raised although the model found its entries valid: {e}"
        assert_clear_error(e, names_fn=False)
        return "P raised"
    assert kind != "P", f"P(...) accepted entries of a wrong type ({why})"
    args = build_args(case)
    before = _snapshot(args)
    fn = functools.partial(drawn_program, case, ns)
    mapped = None
    try:
        mapped = ns.spmd_map(fn, mesh=mesh_of(case), in_specs=in_specs, out_specs=out_specs)
        got = mapped(*args)
    except ns.SpmdError as e:
        note(f"raised: {type(e).__name__}: {e}")
        assert kind in ("error", "either"), f"a valid call raised {type(e).__name__}:\n{e}"
        assert_clear_error(e)
        assert_unchanged(before, args)
        if mapped is not None:  # a second call raises alike
            with pytest.raises(type(e)) as again:
                mapped(*args)
            assert str(again.value) == str(e), f"a second call raised another error:\n{again.value}"
        return "raised"
    assert_unchanged(before, args)
    assert kind in ("ok", "either"), f"expected an SpmdError ({why}), got a value"
    prog = functools.partial(drawn_program, case, REF_NS)
    want, want_f64 = reference(case, prog, in_specs, out_specs, args)
    assert_matches_reference(got, want, want_f64)
    # a second call replays the first: untyped on one instance, its plan on several
    assert_matches_reference(mapped(*args), want, want_f64)
    assert_unchanged(before, args)
    replayed = bool(checked_signatures(mapped))  # else typed again (it asked for types)
    return f"value, called again ({'replayed' if replayed else 'typed'})"


@functools.cache
def _mesh(sizes: tuple[int, ...], names: tuple[str, ...]) -> ns.Mesh:
    return ns.make_mesh(sizes, names, simulated=True)


def mesh_of(case: Case) -> ns.Mesh:
    return _mesh(case.sizes, case.names)


class _Watchdog:
    """A hang fails the case: after WATCHDOG_S seconds SIGALRM raises in the main thread (even
    inside a lock or a join) an AssertionError holding every thread's stack. A hang inside C code,
    where no Python signal handler runs, ends the process after twice as long with faulthandler's
    dump of the stacks instead of blocking CI."""

    def __enter__(self) -> None:
        self.alarm = (
            hasattr(signal, "SIGALRM") and threading.current_thread() is threading.main_thread()
        )
        if self.alarm:
            self.previous = signal.signal(signal.SIGALRM, self._hang)
            signal.alarm(WATCHDOG_S)
        faulthandler.dump_traceback_later(2 * WATCHDOG_S, exit=True)

    def __exit__(self, *exc: object) -> None:
        faulthandler.cancel_dump_traceback_later()
        if self.alarm:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, self.previous)

    @staticmethod
    def _hang(signum: int, frame: Any) -> None:
        stacks = "\n".join(
            f"thread {tid}:\n{''.join(traceback.format_stack(f))}"
            for tid, f in sys._current_frames().items()
        )
        raise AssertionError(f"hang: the case ran for over {WATCHDOG_S} s\n{stacks}")


@seeded
@SETTINGS
@given(case=cases())
def test_drawn_calls_return_the_reference_value_or_a_clear_error(case: Case) -> None:
    with _Watchdog():
        outcome = run_case(case)
    event(f"outcome: {outcome}")
    event(f"op: {case.op}")
    event(f"dtype: {case.dtype}")
    event(f"blocks: {'unequal' if unequal_blocks(case) else 'equal'} ({outcome.split(',')[0]})")


def unequal_blocks(case: Case) -> bool:
    """Whether the model splits some input into blocks of unequal sizes (for statistics)."""
    try:
        args = model_inputs(case, [])
    except (Invalid, BadEntry):
        return False
    return any(isinstance(t, TInfo) and t.blocks is not None for t in tree_leaves(args))


@seeded
@SETTINGS
@given(case=cases(check=True))
def test_check_agrees_with_the_call(case: Case) -> None:
    """``.check(*args)`` runs the program abstractly (meta tensors, backward too) and must raise
    an SpmdError of the same class exactly when the call does, else report the call's global
    shapes and dtypes."""
    try:
        in_specs, out_specs = build_specs(case.in_specs), build_specs(case.out_specs)
    except ns.SpmdError:
        event("check: P(...) raised")
        return
    note(case.describe())
    args = build_args(case)
    with _Watchdog():
        f = None
        try:
            f = ns.spmd_map(
                functools.partial(drawn_program, case, ns),
                mesh=mesh_of(case),
                in_specs=in_specs,
                out_specs=out_specs,
            )
            got = f(*args)
        except ns.SpmdError as e:
            note(f"call raised: {e}")
            if f is None:  # spmd_map itself refused the specs
                event("check: spmd_map raised")
                return
            try:
                f.check(*args)
            except ns.SpmdError as c:
                assert_clear_error(c)
                assert type(c) is type(e), f"check() raised {type(c).__name__}: {c}\nthe call: {e}"
                event("check: both raised")
                return
            raise AssertionError(f"the call raised, check() did not: {e}") from None
        report = f.check(*args)
    shapes = [tuple(t.shape) for t in tree_leaves(got) if isinstance(t, torch.Tensor)]
    dtypes = [t.dtype for t in tree_leaves(got) if isinstance(t, torch.Tensor)]
    assert [o.global_shape for o in report.outputs] == shapes, (report.outputs, shapes)
    assert [o.type.dtype for o in report.outputs] == dtypes, (report.outputs, dtypes)
    event("check: both returned")
