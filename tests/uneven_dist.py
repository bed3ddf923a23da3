"""Blocks of unequal sizes on a real mesh (gloo), against the simulated per-instance execution and
dense single-device programs.

``python tests/uneven_dist.py`` under a 4-process job runs every case of :data:`CASES` on a real
mesh and on a simulated one of the same shape (in the same process), and prints one
``OUTCOME {json}`` line per case and rank with the problems found (tests/test_uneven.py reads
them). Each case compares the global outputs, the inputs' gradients (a fixed random cotangent)
and the communication counts of both backends, and the values and gradients with a dense
program computed on one device from the definitions.
"""

from __future__ import annotations

import collections
import copy
import json
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from _ragged import reference, routing
from torch.autograd import forward_ad as fwAD

import named_spmd as ns
from named_spmd import P
from named_spmd._plan import Plan
from named_spmd._replay import checked_signatures

F64 = torch.float64


def _randn(*shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)


@dataclass
class Case:
    name: str
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    fn: Callable[..., Any]
    in_specs: Any
    out_specs: Any
    args: Callable[[], tuple]
    dense: Callable[..., Any] | None  # the global outputs from the global inputs
    switch: bool = True  # run under ns.simulate_per_instance() (unequal blocks need none)
    # the simulated mesh alone runs per instance: a program vmap cannot run (a boolean mask),
    # an even call on the real mesh
    switch_simulated: bool = False
    dtensor: bool = False  # the real mesh gets the inputs as DTensors (their Shard blocks)
    # the real outputs' types: "D" DTensor, "T" plain (an error's case: what its message says)
    kinds: tuple[str, ...] = field(default=())
    note: str = ""  # an error's: in its notes on every rank (Python 3.11: add_note)
    # an error's case: the function whose error the simulated mesh must give (where ``fn``
    # cannot run there, reading a value under vmap)
    like: Callable[..., Any] | None = None
    check_vma: bool = True


# Per instance (its coordinates), the types (ns.typeof: per-device shape and vma) of the values
# a program taps: the backends must agree on each instance's, not only on the outputs.
TAPS: dict[tuple[int, ...], list[str]] = {}


def _tap(axes: tuple[str, ...], *values) -> None:
    where = tuple(int(ns.axis_index(a).item()) for a in axes)
    TAPS.setdefault(where, []).extend(repr(ns.typeof(v)) for v in values)


def _mlp(v, w):
    h, s = torch.tanh(v @ w), ns.psum(v.sum(0), "x")
    _tap(("x",), v, w, h, s)
    return h, s


def _two_axes(v):
    y, s = v * 2 + 1, ns.psum(v.sum(0), "a")
    _tap(("a", "b"), v, y, s)
    return y, s


def _gather_invariant(v):
    return ns.all_gather(v, "x", tiled=True, to="invariant")


def _gather_varying(v):
    return ns.all_gather(v * 1.5, "x", tiled=True)


def _gather_reduced(v):
    return ns.all_gather(v, "x", tiled=True, to="reduced")


def _scatter(v):
    return ns.psum_scatter(v[0], "x", tiled=True)


def _scatter_and_back(v):
    return ns.all_gather(
        ns.psum_scatter(v[0] * v[0], "x", tiled=True), "x", tiled=True, to="invariant"
    )


def _offsets(v):  # the blocks' global row numbers, from ns.block_offsets
    start = ns.block_offsets(10, "x")[ns.axis_index("x")]
    rows = torch.arange(v.shape[0], dtype=v.dtype) + start
    return v * rows[:, None]


# all_to_all split sizes by instance (member i sends row i): member j receives 7, 7, 7, 11 rows
SPLIT_COUNTS = ((0, 1, 2, 5), (5, 2, 1, 0), (1, 1, 1, 5), (1, 3, 3, 1))


def _split_by_index(v):
    sizes = list(SPLIT_COUNTS[int(ns.axis_index("x"))])
    return ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=sizes) * 2


def _split_dense(x, counts=SPLIT_COUNTS):
    chunks = [b.split(list(counts[i])) for i, b in enumerate(x.split(8))]
    return torch.cat([torch.cat([c[j] for c in chunks]) for j in range(4)]) * 2


def _split_sizes_of(pick: Callable[[], list[int]]):
    """An all_to_all over b of the split sizes ``pick()`` gives (one function whatever the
    sizes: its errors name one line)."""

    def split_by_pick(v):
        return ns.all_to_all(v, "b", 0, 0, tiled=True, split_sizes=pick())

    return split_by_pick


def _unequal_at_b0() -> list[int]:
    """Unequal sizes on the member b=0 of each group of b alone."""
    return [1, 3] if int(ns.axis_index("b")) == 0 else [2, 2]


def _rows_by_index(v):
    """Instance 1 sends 2 rows to each member, the others 1: equal sizes on each instance, and
    operands of different sizes."""
    k = 2 if int(ns.axis_index("x")) == 1 else 1
    return ns.all_to_all(v[: 4 * k], "x", 0, 0, tiled=True, split_sizes=[k] * 4)


def _five_outputs(name: str, kinds: tuple[str, ...]) -> Case:
    """Five outputs: more than one exchange of the outputs' shapes holds (a second one)."""
    return Case(
        name,
        (4,),
        ("x",),
        lambda v: tuple(v * k for k in range(1, 6)),
        P("x"),
        P("x"),
        lambda: (_randn(10, 2, seed=40),),
        lambda x: tuple(x * k for k in range(1, 6)),
        kinds=kinds,
    )


_ROUTING = routing(4, 1, seed=7)


def _ragged_rows(x, out):  # each instance's offsets and sizes from its index
    r, i = _ROUTING, ns.axis_index("x")
    tables = (r.input_offsets, r._send, r.output_offsets, r.recv_sizes)
    meta = [torch.tensor([f(j) for j in range(r.n)])[i] for f in tables]
    return ns.ragged_all_to_all(x, out, *meta, "x")


def _ragged_dense(x, out):
    r = _ROUTING
    return torch.cat(reference(r, list(x.split(r.rows)), list(out.split(r.m))))


def _masked(v):  # a result's shape from the values: 2, 2, 2, 1 positive of 4 (seed 63)
    return v[v > 0] * 2


def _masked_blocks(x, blocks):
    return torch.cat([b[b > 0] for b in (x.split(4)[i] for i in blocks)])


# Sizes read from values by ops that take a tensor as a size (t: the block's positive count,
# 2, 1, 2, 1 of BRANCH_X): each rank's output of its own shape, laid out as the per-instance
# execution lays them (not seen as reads, the ranks' shapes would differ unseen).
BRANCH_X = (1.0, 1.0, -1.0, 1.0, 2.0, 2.0, 3.0, -3.0)


def _branch_x():
    return (torch.tensor(BRANCH_X, dtype=F64),)


def _after_a_branch(
    name: str, fn: Callable[..., Any], kinds: tuple[str, ...], dense: Callable | None = None
) -> Case:
    """A case on (4,) whose ranks branch on their values (``_branch_x``), an even call the
    simulated mesh runs per instance: an error's (``kinds``: what its message says) or one
    whose outputs (``kinds``: their types) equal ``dense``'s."""
    return Case(
        name,
        (4,),
        ("x",),
        fn,
        P("x"),
        P("x"),
        _branch_x,
        dense,
        switch=False,
        switch_simulated=True,
        kinds=kinds,
    )


def _over_groups_of_b(
    name: str, fn: Callable[..., Any], values: tuple[float, ...], kinds: tuple[str, ...]
) -> Case:
    """An error case on (2, 2) whose ranks branch on ``values`` (split over ("a", "b")): the
    message says ``kinds``."""
    spec = P(("a", "b"))
    return Case(
        name,
        (2, 2),
        ("a", "b"),
        fn,
        spec,
        spec,
        lambda: (torch.tensor(values, dtype=F64),),
        None,
        switch=False,
        switch_simulated=True,
        kinds=kinds,
    )


def _per_block(make):  # the dense program of a function of each block and its count t
    return lambda x: torch.cat([make(b, int((b > 0).sum())) for b in x.split(2)])


def _sized_eye(v):
    return torch.eye((v > 0).sum(), dtype=v.dtype).sum(0) * v.sum()


def _sized_linspace(v):
    return torch.linspace(0, 1, steps=(v > 0).sum(), dtype=v.dtype) + v.sum()


def _sized_chunks(v):
    parts = torch.arange(6.0, dtype=v.dtype).chunk((v > 0).sum())
    return torch.stack([c.sum() for c in parts]) * v.sum()


def _sized_pad(v):
    t = (v > 0).sum()
    return torch.nn.functional.pad(v, (t, t))


def _sized_cases() -> list[Case]:
    made = [
        ("eye", _sized_eye, lambda b, t: torch.eye(t, dtype=F64).sum(0) * b.sum()),
        ("linspace", _sized_linspace, lambda b, t: torch.linspace(0, 1, t, dtype=F64) + b.sum()),
        (
            "chunk",
            _sized_chunks,
            lambda b, t: (
                torch.stack([c.sum() for c in torch.arange(6.0, dtype=F64).chunk(t)]) * b.sum()
            ),
        ),
        ("pad", _sized_pad, lambda b, t: torch.nn.functional.pad(b, (t, t))),
    ]
    return [
        _after_a_branch(f"{name}_sized_by_a_tensor_in_an_even_call", fn, ("T",), _per_block(dense))
        for name, fn, dense in made
    ]


CASES = [
    Case(  # an even call: the ranks' outputs' shapes compared, torch.chunk's: a DTensor
        "boolean_mask_in_an_even_call",
        (4,),
        ("x",),
        _masked,
        P("x"),
        P("x"),
        lambda: (_randn(16, seed=63),),
        lambda x: x[x > 0] * 2,
        kinds=("D",),
        switch=False,
        switch_simulated=True,
    ),
    Case(  # check_vma=False, an even call: the blocks at b=0 (1 and 2 positive), not b=1's
        "boolean_mask_in_an_even_call_returned_over_a_unchecked",
        (2, 2),
        ("a", "b"),
        lambda v: v[v > 0],
        P(("a", "b")),
        P("a"),
        lambda: (_randn(16, seed=59),),
        lambda x: _masked_blocks(x, (0, 2)),
        kinds=("T",),
        switch=False,
        switch_simulated=True,
        check_vma=False,
    ),
    Case(  # a real mesh's per-instance call keeps the record's parameters (their fields)
        "ragged_all_to_all_per_instance",
        (4,),
        ("x",),
        _ragged_rows,
        P("x"),
        P("x"),
        lambda: (_randn(4 * _ROUTING.rows, 2, seed=50), _randn(4 * _ROUTING.m, 2, seed=51)),
        _ragged_dense,
        kinds=("D",),
    ),
    Case(  # check_vma=False: instance 0's block of 3 rows (the last rank's holds 1)
        "unchecked_rows10_over_4_returned_replicated",
        (4,),
        ("x",),
        lambda v: v * 2,
        P("x", None),
        P(),
        lambda: (_randn(10, 2, seed=48),),
        lambda x: x[:3] * 2,
        kinds=("D",),
        check_vma=False,
    ),
    Case(  # copy.deepcopy of a replicated input (a leaf that requires grad): a new leaf on
        # every rank and instance, as outside the call, so no gradient flows through the copy
        "deep_copy_of_a_replicated_leaf_in_an_uneven_call",
        (4,),
        ("x",),
        lambda v, w: ns.psum(v.sum(0), "x") + copy.deepcopy(w) * 2 + w,
        (P("x", None), P()),
        P(),
        lambda: (_randn(10, 2, seed=70), _randn(2, seed=71)),
        lambda x, w: x.sum(0) + w.detach() * 2 + w,
        kinds=("D",),
    ),
    Case(  # check_vma=False: the blocks at b=0 (2 rows each), not each rank's own (1 at a=b=1)
        "unchecked_rows7_over_ab_returned_over_a",
        (2, 2),
        ("a", "b"),
        lambda v: v * 2,
        P(("a", "b"), None),
        P("a", None),
        lambda: (_randn(7, 2, seed=49),),
        lambda x: x[[0, 1, 4, 5]] * 2,
        kinds=("D",),
        check_vma=False,
    ),
    Case(  # check_vma=False, the error's fix: varying of each block's length, instance 0's
        "unchecked_pvaried_sum_of_a_block_size",
        (4,),
        ("x",),
        lambda v: _pvaried_sum(v),
        P("x"),
        P(),
        lambda: (_randn(10, seed=57),),
        lambda x: torch.zeros(3, dtype=x.dtype) + x.sum(),
        kinds=("D",),
        check_vma=False,
    ),
    Case(
        "rows5_over_2_of_a_2d_mesh",
        (2, 2),
        ("a", "b"),
        lambda v, w: v.sin() * w,
        (P("a", None), P()),
        P("a", None),
        lambda: (_randn(5, 3, seed=1), _randn(3, seed=2)),
        lambda x, w: x.sin() * w,
        kinds=("D",),
    ),
    Case(
        "grid5x7_over_both_axes",
        (2, 2),
        ("a", "b"),
        _two_axes,
        P("a", "b"),
        (P("a", "b"), P("b")),
        lambda: (_randn(5, 7, seed=3),),
        lambda x: (x * 2 + 1, x.sum(0)),
        kinds=("D", "D"),
    ),
    Case(  # the factory's address, in the output tree's text, differs between processes
        "rows10_over_4_defaultdict",
        (4,),
        ("x",),
        lambda v: collections.defaultdict(lambda: None, {"y": 2 * v}),
        P("x", None),
        P("x", None),
        lambda: (_randn(10, 3, seed=43),),
        lambda x: {"y": 2 * x},
        kinds=("D",),
    ),
    Case(
        "rows10_over_4",
        (4,),
        ("x",),
        _mlp,
        (P("x", None), P()),
        (P("x", None), P()),
        lambda: (_randn(10, 3, seed=4), _randn(3, 2, seed=5)),
        lambda x, w: (torch.tanh(x @ w), x.sum(0)),
        kinds=("D", "D"),
    ),
    Case(
        "rows9_over_4_an_empty_block",
        (4,),
        ("x",),
        lambda v: v.exp() * 3,
        P("x", None),
        P("x", None),
        lambda: (_randn(9, 2, seed=6),),
        lambda x: x.exp() * 3,
        kinds=("D",),
    ),
    Case(
        "block_offsets",
        (4,),
        ("x",),
        _offsets,
        P("x", None),
        P("x", None),
        lambda: (_randn(10, 2, seed=7),),
        lambda x: x * torch.arange(10, dtype=F64)[:, None],
        kinds=("D",),
    ),
    Case(
        "given_sizes_in_and_out",
        (4,),
        ("x",),
        lambda v: (v * 2, v.cos()),
        P(ns.Blocks("x", (4, 3, 2, 1)), None),
        (P("x", None), P(ns.Blocks("x", (4, 3, 2, 1)), None)),
        lambda: (_randn(10, 2, seed=8),),
        lambda x: (x * 2, x.cos()),
        switch=False,
        kinds=("T", "T"),  # not torch.chunk's blocks: no DTensor holds them
    ),
    Case(  # a contraction over b: partial sums, unreduced over b (DTensor: Partial)
        "partial_sums_over_b_of_uneven_rows",
        (2, 2),
        ("a", "b"),
        lambda v, w: v @ w,
        (P("a", "b"), P("b", None)),
        P("a", None, unreduced={"b"}),
        lambda: (_randn(5, 4, seed=22), _randn(4, 3, seed=23)),
        lambda x, w: x @ w,
        kinds=("D",),
    ),
    Case(  # the same with given sizes: the global value, the parts summed
        "partial_sums_over_b_of_given_rows",
        (2, 2),
        ("a", "b"),
        lambda v, w: v @ w,
        (P(ns.Blocks("a", (1, 4)), "b"), P("b", None)),
        P(ns.Blocks("a", (1, 4)), None, unreduced={"b"}),
        lambda: (_randn(5, 4, seed=24), _randn(4, 3, seed=25)),
        lambda x, w: x @ w,
        switch=False,
        kinds=("T",),
    ),
    Case(
        "tiled_all_gather_to_invariant",
        (4,),
        ("x",),
        _gather_invariant,
        P("x", None),
        P(),
        lambda: (_randn(10, 3, seed=9),),
        lambda x: x * 1,
        kinds=("D",),
    ),
    Case(
        "tiled_all_gather_varying_of_given_sizes",
        (4,),
        ("x",),
        _gather_varying,
        P(ns.Blocks("x", (4, 3, 0, 3)), None),
        P("x", None),
        lambda: (_randn(10, 3, seed=10),),
        lambda x: torch.cat([x * 1.5] * 4),
        switch=False,
        kinds=("D",),
    ),
    Case(
        "tiled_all_gather_reduced",
        (4,),
        ("x",),
        _gather_reduced,
        P("x", None),
        P(reduced={"x"}),
        lambda: (_randn(10, 3, seed=11),),
        lambda x: x * 1,
        kinds=("D",),
    ),
    Case(
        "tiled_psum_scatter_to_chunks",
        (4,),
        ("x",),
        _scatter,
        P("x", None),
        P("x"),
        lambda: (_randn(4, 10, seed=12),),
        lambda y: y.sum(0),
        kinds=("D",),
    ),
    Case(
        "tiled_psum_scatter_and_gather_back",
        (4,),
        ("x",),
        _scatter_and_back,
        P("x", None),
        P(),
        lambda: (_randn(4, 9, seed=13),),
        lambda y: (y * y).sum(0),
        kinds=("D",),
    ),
    Case(
        "dtensor_rows10_over_4",
        (4,),
        ("x",),
        _mlp,
        (P("x", None), P()),
        (P("x", None), P()),
        lambda: (_randn(10, 3, seed=14), _randn(3, 3, seed=15)),  # square: fed back
        lambda x, w: (torch.tanh(x @ w), x.sum(0)),
        dtensor=True,
        kinds=("D", "D"),
    ),
    Case(
        "dtensor_grid5x7_over_both_axes",
        (2, 2),
        ("a", "b"),
        _two_axes,
        P("a", "b"),
        (P("a", "b"), P("b")),
        lambda: (_randn(5, 7, seed=16),),
        lambda x: (x * 2 + 1, x.sum(0)),
        dtensor=True,
        kinds=("D", "D"),
    ),
    Case(  # blocks of more dims than a row of the outputs' shape exchange holds: a wider one
        "rows5_of_17_dims",
        (2, 2),
        ("a", "b"),
        lambda v: v * 2,
        P("a"),
        P("a"),
        lambda: (_randn(5, *[1] * 15, 2, seed=35),),
        lambda x: x * 2,
        kinds=("D",),
    ),
    _five_outputs("five_outputs", ("D",) * 5),
    Case(  # without asking: a dim the axis does not divide is split as torch.chunk splits it
        "rows10_over_4_by_default",
        (4,),
        ("x",),
        lambda v: v.sin() * ns.psum((v * v).sum(), "x"),
        P("x", None),
        P("x", None),
        lambda: (_randn(10, 2, seed=17),),
        lambda x: x.sin() * (x * x).sum(),
        switch=False,
        kinds=("D",),
    ),
    Case(  # equal blocks in, the members' split sizes out: blocks of 7, 7, 7 and 11 rows
        "all_to_all_of_split_sizes_by_instance",
        (4,),
        ("x",),
        _split_by_index,
        P("x", None),
        P("x", None),
        lambda: (_randn(32, 2, seed=18),),
        _split_dense,
        kinds=("T",),
    ),
    Case(  # an even call (no switch): the sizes' exchange is bookkeeping, as vmap has none
        "all_to_all_of_equal_split_sizes_in_an_even_call",
        (4,),
        ("x",),
        lambda v: ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=[2] * 4) * 2,
        P("x", None),
        P("x", None),
        lambda: (_randn(32, 2, seed=44),),
        lambda x: _split_dense(x, [(2,) * 4] * 4),
        switch=False,
        kinds=("D",),
    ),
]

CASES += _sized_cases()
CASES += [
    Case(  # tiled all_gathers of sizes read from values in an even call (2, 2, 2, 1 positive):
        # the blocks concatenated as an uneven call's, the transpose scattering to their sizes
        f"tiled_all_gather_to_{to}_of_sizes_read_in_an_even_call",
        (4,),
        ("x",),
        lambda v, to=to: ns.all_gather(v[v > 0], "x", tiled=True, to=to) * 2,
        P("x"),
        spec,
        lambda: (_randn(16, seed=63),),
        dense,
        kinds=("D",),
        switch=False,
        switch_simulated=True,
    )
    for to, spec, dense in (
        ("varying", P("x"), lambda x: x[x > 0].repeat(4) * 2),
        ("invariant", P(), lambda x: x[x > 0] * 2),
    )
]


def _two_or_one(v):
    total = ns.psum(v.sum(0), "x")
    return (total, total) if v.shape[0] == 3 else (total,)


# (every rank calls the same collectives: a rank that skipped one would leave the others in it)
def _reduced_but_on_the_last_rank(v):
    total = ns.psum(v.sum(0), "x")
    return total if v.shape[0] == 3 else v.sum(0)


def _reduced_but_at_a1(v):
    total = ns.psum(v.sum(0), "a")
    return v, total if v.shape[0] == 3 else v.sum(0) * (ns.axis_index("b").to(v.dtype) + 1)


def _two_kinds_of_errors(v):
    total = ns.psum(v.sum(0), "x")
    at_x1 = int(ns.axis_index("x").item()) == 1
    return v if v.shape[0] == 3 else v.sum(0), v.sum(0) if at_x1 else total


# Programs that must fail with the same error on both backends (and on every rank alike).
def _ragged_one_row_each(x, out, recv_at_2=(1, 1, 1, 1), offsets_at_3=(0, 1, 2, 3)):
    """Each member sends row j of its block to member j (row i there); member 2 expects
    ``recv_at_2`` rows, member 3 reads its slices at ``offsets_at_3``."""
    i = ns.axis_index("x")
    ones = torch.ones(4, dtype=torch.int64)
    recv = torch.where(i == 2, torch.tensor(recv_at_2), ones)
    offsets = torch.where(i == 3, torch.tensor(offsets_at_3), torch.arange(4))
    return ns.ragged_all_to_all(x, out, offsets, ones, i + 0 * ones, recv, "x")


def _ragged_sizes_disagree(x, out):  # member 2 expects 2 rows from member 1, which sends 1
    return _ragged_one_row_each(x, out, recv_at_2=(1, 2, 1, 1))


def _ragged_slice_outside(x, out):  # member 3's last slice lies past its block of 4 rows
    return _ragged_one_row_each(x, out, offsets_at_3=(0, 1, 2, 7))


def _ragged_sizes_far_outside(x, out):  # agreed by both ends: 2**40 rows from member 0 to 1
    i = ns.axis_index("x")
    ones = torch.ones(4, dtype=torch.int64)
    send = torch.where(i == 0, torch.tensor([1, 2**40, 1, 1]), ones)
    recv = torch.where(i == 1, torch.tensor([2**40, 1, 1, 1]), ones)
    return ns.ragged_all_to_all(x, out, torch.arange(4), send, i + 0 * ones, recv, "x")


def _ragged_case(name: str, fn: Callable[..., Any], says: str) -> Case:
    """A ragged_all_to_all whose metadata some members get wrong: the first member's error on
    every rank alike, the mesh in step after (gloo would pair sizes that differ)."""
    kinds = ("CollectiveError: ", says)
    return Case(name, (4,), ("x",), fn, P("x"), P("x"), _ragged_args, None, kinds=kinds)


def _ragged_args() -> tuple:
    return _randn(16, 2, seed=66), torch.zeros(16, 2, dtype=F64)


def _invariant_then_other_dtype(v):
    sizes = torch.zeros(v.shape[0], dtype=v.dtype) + ns.psum(v.sum(), "x")
    return sizes, v if v.shape[0] == 3 else v.float()


def _psum_where_positive(v):  # the ranks whose block sums above 0 alone
    return ns.psum(v, "x") if v.sum() > 0 else v


def _psum_or_pmax(v):
    return ns.psum(v, "x") if v.sum() > 0 else ns.pmax(v, "x")


def _ppermute_by_branch(v, other):  # the pairs by the branch: a ring, or ``other``
    ring = [(i, (i + 1) % 4) for i in range(4)]
    return ns.ppermute(v, "x", ring if v.sum() > 0 else other)


def _ppermute_ring_or_back(v):
    return _ppermute_by_branch(v, [(i, (i - 1) % 4) for i in range(4)])


def _ppermute_ring_or_in_place(v):  # in place: nothing moves on the ranks of that branch
    return _ppermute_by_branch(v, [(i, i) for i in range(4)])


def _ppermute_of_dtypes_by_block(v):  # the 1-row block's halo int64 (float64's element size)
    h = v[-1:] if v.shape[0] > 1 else v[-1:].to(torch.int64)
    return ns.ppermute(h, "x", [(i, (i + 1) % 4) for i in range(4)]).double()


def _psum_of_dtypes_by_branch(v):  # int32 where the block sums to 0: float32's element size
    return ns.psum(v.float() if v.sum() > 0 else v.to(torch.int32), "x").double()


def _pmax_of_varying_or_invariant(v):  # invariant where the sum is 0: a pmax of nothing there
    return ns.pmax(v if v.sum() > 0 else torch.zeros(2, dtype=v.dtype), "x")


def _ppermute_of_pairs_by_group(v):  # a=0's group sums above 0, a=1's below: pairs per group
    return ns.ppermute(v, "b", [(0, 1), (1, 0)] if v.sum() > 0 else [(0, 1)])


def _psum_over_b_where_positive(v):  # at b=0 and b=1 of a group: other signs
    return ns.psum(v, "b") * 2 if v.sum() > 0 else v * 2


def _pvary_of_a_varying_block(v):
    return ns.pvary(v, "x")


def _psum_of_an_invariant_shaped_by_the_block(v):  # a factory's zeros: invariant, a block's rows
    return ns.psum(torch.zeros(v.shape[0], 3, dtype=v.dtype), "x")


def _type_error(name: str, fn, out_specs, told: str) -> Case:
    """A type error over blocks of unequal sizes (10 rows over 4: 3, 3, 2, 2), every rank's at
    the same collective: its text names the first instance's block, as the simulated mesh's."""
    args = lambda: (_randn(10, 3, seed=34),)  # noqa: E731
    return Case(name, (4,), ("x",), fn, P("x"), out_specs, args, None, switch=False, kinds=told)


ERRORS = [
    _type_error(
        "pvary_of_a_varying_block",
        _pvary_of_a_varying_block,
        P("x"),
        ("VmaError: ", "already varies over ('x',) (type f64[3,3]{x})"),
    ),
    _type_error(
        "psum_of_an_invariant_value_shaped_by_the_block",
        _psum_of_an_invariant_shaped_by_the_block,
        P(),
        ("VmaError: ", "invariant over ('x',) (its type is f64[3,3]{})"),
    ),
    _ragged_case(
        "ragged_all_to_all_sizes_that_disagree",
        _ragged_sizes_disagree,
        "member 1 of ('x',) sends 1 rows in slot 2 and expects 1, but member 2 expects 2",
    ),
    _ragged_case(
        "ragged_all_to_all_slice_outside_the_operand",
        _ragged_slice_outside,
        "member 3 of ('x',), slot 3: rows 7:8 do not lie within the operand's 4 rows",
    ),
    _ragged_case(  # (no rank allocates the 2**40 rows: both ends of the slot send none)
        "ragged_all_to_all_sizes_far_outside_both_buffers",
        _ragged_sizes_far_outside,
        f"member 0 of ('x',), slot 1: rows 1:{1 + 2**40} do not lie within the operand's 4 rows",
    ),
    _after_a_branch(  # a psum some ranks skip after a branch on values: told alike, not paired
        "psum_skipped_on_some_ranks_after_a_branch",
        _psum_where_positive,  # (x=1 and x=3 sum to 0: they skip it)
        ("SpmdError: ", "instances (x=1), (x=3) returned while", "wait at psum over"),
    ),
    _after_a_branch(
        "psum_or_pmax_after_a_branch",
        _psum_or_pmax,
        ("SpmdError: ", "called different collectives at one point", "pmax over"),
    ),
    _after_a_branch(  # ppermutes of other pairs after a branch: gloo would pair sizes that differ
        "ppermutes_of_other_pairs_after_a_branch",
        _ppermute_ring_or_back,
        ("SpmdError: ", "called different collectives at one point", "ppermute over"),
    ),
    _after_a_branch(  # ppermutes of other pairs after a branch: gloo would pair sizes that differ
        "a_ppermute_in_place_after_a_branch",
        _ppermute_ring_or_in_place,
        ("SpmdError: ", "called different collectives at one point", "ppermute over"),
    ),
    _after_a_branch(  # the ranks whose operand is invariant skip the pmax (the identity there)
        "pmax_of_an_operand_invariant_on_some_ranks",
        _pmax_of_varying_or_invariant,
        ("SpmdError: ", "instances (x=1), (x=3) returned while", "wait at pmax over"),
    ),
    _over_groups_of_b(  # the members of one group of b apart
        "psum_over_b_skipped_on_some_members",
        _psum_over_b_where_positive,
        (1.0, 1.0, -1.0, -1.0, 2.0, 2.0, -3.0, -3.0),
        ("SpmdError: ", "returned while instances", "wait at psum over ('b',)"),
    ),
    _over_groups_of_b(  # every group's members agree, the groups do not: JAX's one perm
        "ppermute_of_other_pairs_per_group",
        _ppermute_of_pairs_by_group,
        (1.0, 1.0, 2.0, 2.0, -1.0, -1.0, -3.0, -3.0),
        ("SpmdError: ", "called different collectives", "ppermute over ('b',) with other"),
    ),
    Case(  # operands of one shape, of dtypes that differ by block (no value read): gloo would
        # move the int64 bytes into float64 buffers
        "ppermute_of_blocks_of_different_dtypes",
        (4,),
        ("x",),
        _ppermute_of_dtypes_by_block,
        P("x"),
        P("x"),
        lambda: (_randn(10, 3, seed=33),),
        None,
        switch=False,
        kinds=("SpmdError: ", "different dtypes ['float64', 'float64', 'float64', 'int64']"),
    ),
    _after_a_branch(  # the dtypes differ after a branch on values: met, and compared there
        "psum_of_dtypes_differing_after_a_branch",
        _psum_of_dtypes_by_branch,
        ("SpmdError: ", "different dtypes ['float32', 'int32', 'float32', 'int32']"),
    ),
    Case(  # an even call whose ranks branch on their values (sums of either sign, seed 59)
        "output_trees_differing_after_a_branch_on_values",
        (4,),
        ("x",),
        lambda v: (v,) if v.sum() > 0 else (v, v),
        P("x"),
        P("x"),
        lambda: (_randn(16, seed=59),),
        None,
        switch=False,
        switch_simulated=True,
        kinds=("SpmdError: ", "returned different output trees"),
    ),
    Case(  # the out_specs check fails where the sum is positive: told alike, as uneven calls
        "out_specs_failing_after_a_branch_on_values",
        (4,),
        ("x",),
        lambda v: v if v.sum() > 0 else torch.zeros(4, dtype=v.dtype),
        P("x"),
        P(),
        lambda: (_randn(16, seed=59),),
        None,
        switch=False,
        switch_simulated=True,
        kinds=("VmaError: ", "claim replication"),
        note="the out_specs check failed on rank",
    ),
    Case(  # a collective after a read, of operands sized by it: compared on every rank alike
        "psum_of_operands_sized_by_values_read",
        (4,),
        ("x",),
        lambda v: ns.psum(v[v > 0], "x"),
        P("x"),
        P(),
        lambda: (_randn(16, seed=63),),  # (2, 2, 2, 1 positive)
        None,
        switch=False,
        switch_simulated=True,
        kinds=("SpmdError: ", "psum in ", "different shapes [(2,), (2,), (2,), (1,)]"),
    ),
    Case(  # typed invariant, of each block's length: 3 rows at x=0, 1 at x=3
        "invariant_output_of_a_block_size",
        (4,),
        ("x",),
        lambda v: torch.zeros(v.shape[0], dtype=v.dtype),
        P("x"),
        P(),
        lambda: (_randn(10, seed=50),),
        None,
        kinds=("VmaError: ", "typed invariant over x", "instances at x=0 and x=3"),
    ),
    Case(  # output 0 typed invariant of a block size, output 1 of another dtype at x=3: the
        # simulated mesh's order, per output (output 0's error first)
        "invariant_output_before_a_later_outputs_layout",
        (4,),
        ("x",),
        _invariant_then_other_dtype,
        P("x"),
        (P(), P("x")),
        lambda: (_randn(10, seed=55),),
        None,
        kinds=("VmaError: ", "output[0]"),
    ),
    Case(  # typed invariant, of another dtype at x=3 (1 row) than elsewhere
        "invariant_output_of_another_dtype_at_x3",
        (4,),
        ("x",),
        lambda v: ns.psum(v.sum(), "x").float() if v.shape[0] == 1 else ns.psum(v.sum(), "x"),
        P("x"),
        P(),
        lambda: (_randn(10, seed=56),),
        None,
        kinds=("VmaError: ", "typed invariant over x", "instances at x=0 and x=3"),
    ),
    Case(  # an even call on a real mesh refuses them on every rank, as vmap does
        "unequal_split_sizes_in_an_even_call",
        (4,),
        ("x",),
        lambda v: ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=[1, 2, 2, 3]),
        P("x"),
        P("x"),
        lambda: (_randn(32, seed=42),),
        None,
        switch=False,
        kinds=("CollectiveError: ", "split_sizes [1, 2, 2, 3] are not equal"),
    ),
    Case(  # of one member of each group (b=0): its group's other member raises too
        "split_sizes_unequal_on_one_member_of_an_even_call",
        (2, 2),
        ("a", "b"),
        _split_sizes_of(_unequal_at_b0),
        P(("a", "b")),
        P(("a", "b")),
        lambda: (_randn(16, seed=43),),
        None,
        switch=False,
        kinds=("CollectiveError: ", "split_sizes [1, 3] are not equal"),
        like=_split_sizes_of(lambda: [1, 3]),
        note="the other ranks stop with RankFailedError",  # (the other group's, told so)
    ),
    Case(
        "output_blocks_not_the_given_sizes",
        (4,),
        ("x",),
        lambda v: v * 2,
        P(ns.Blocks("x", (4, 3, 2, 1))),
        P(ns.Blocks("x", (3, 3, 3, 1))),
        lambda: (_randn(10, seed=18),),
        None,
        switch=False,
    ),
    Case(  # the blocks differ along dim 0 (3, 2), the gather concatenates along dim 1
        "tiled_all_gather_of_blocks_differing_elsewhere",
        (2, 2),
        ("a", "b"),
        lambda v: ns.all_gather(v, "a", axis=1, tiled=True),
        P("a", None),
        P("a", None),
        lambda: (_randn(5, 2, seed=26),),
        None,
        switch=False,
    ),
    Case(  # rows 3, 2 over a, laid back along dim 1: the blocks of a row differ in height
        "output_blocks_that_do_not_lay_back",
        (2, 2),
        ("a", "b"),
        lambda v: ns.pvary(v, "b"),
        P("a", None),
        P("b", "a"),
        lambda: (_randn(5, 2, seed=28),),
        None,
        switch=False,
    ),
    Case(  # columns 3, 2 over b: the untiled scatter's size check fails at b=0 only
        "argument_check_failing_on_some_ranks",
        (2, 2),
        ("a", "b"),
        lambda v: ns.psum_scatter(v, "b", scatter_dimension=1, tiled=False),
        P(None, "b"),
        P(None, "b"),
        lambda: (_randn(1, 5, seed=30),),
        None,
        switch=False,
    ),
    Case(  # 3 over a * b: 1, 1, 1, 0: the group at a=0 has one shape, the group at a=1 two
        "psum_of_different_shapes_in_one_group",
        (2, 2),
        ("a", "b"),
        lambda v: ns.psum(v, "b"),
        P(("a", "b")),
        P("a"),
        lambda: (_randn(3, seed=31),),
        None,
        switch=False,
    ),
    Case(  # rows 3, 3, 3, 1: a branch on the block's size sums the last block to one dim
        "output_blocks_of_different_ranks",
        (4,),
        ("x",),
        lambda v: v if v.shape[0] == 3 else v.sum(0),
        P("x", None),
        P("x"),
        lambda: (_randn(10, 3, seed=33),),
        None,
        switch=False,
        kinds=("the instance at {'x': 3} a torch.float64 block of rank 1",),
    ),
    Case(  # the instance at a=0, b=1 (its block is the one at b=0) returns another dtype
        "output_blocks_of_different_dtypes",
        (2, 2),
        ("a", "b"),
        lambda v: v.float() if int(ns.axis_index("b").item()) == 1 else v * 1,
        P("a", None),
        P("a", None),
        lambda: (_randn(5, 2, seed=34),),
        None,
        switch=False,
        kinds=("the instance at {'a': 0, 'b': 1} a torch.float32 block of rank 2",),
    ),
    Case(  # rows 3, 3, 3, 1: the last rank's block loses the dim its out_spec splits
        "out_spec_failing_on_one_rank",
        (4,),
        ("x",),
        lambda v: v if v.shape[0] == 3 else v.sum(0),
        P("x", None),
        P("x", None),
        lambda: (_randn(10, 3, seed=37),),
        None,
        switch=False,
        kinds=("the instance at {'x': 3} do not fit out_specs", "rank 1 (shape [3])"),
    ),
    Case(  # rows 3, 3, 3, 1: the last rank returns one output, the others two
        "different_numbers_of_outputs",
        (4,),
        ("x",),
        lambda v: (v, v) if v.shape[0] == 3 else (v,),
        P("x", None),
        P("x", None),
        lambda: (_randn(10, 3, seed=38),),
        None,
        switch=False,
        kinds=("different output trees: the instance at {'x': 0} returned 2 tensors",),
    ),
    Case(  # the last rank returns no tensor at all (none to exchange), in a dict
        "no_output_on_one_rank",
        (2, 2),
        ("a", "b"),
        lambda v: {"y": v} if v.shape[0] == 3 else {},
        P("a", None),
        P("a", None),
        lambda: (_randn(5, 2, seed=39),),
        None,
        switch=False,
        kinds=("the instance at {'a': 0, 'b': 0} returned 1 tensor, the instance at",),
    ),
    Case(  # rows 3, 3, 3, 1 summed under P() alone: the ranks' trees compared all the same
        "different_trees_of_replicated_outputs",
        (4,),
        ("x",),
        _two_or_one,
        P("x", None),
        P(),
        lambda: (_randn(10, 3, seed=42),),
        None,
        switch=False,
        kinds=("different output trees: the instance at {'x': 0} returned 2 tensors",),
    ),
    Case(  # parts of 2, 2, 2, 1 rows (the blocks' columns): summed, they must have one shape
        "partial_sums_of_different_shapes",
        (4,),
        ("x",),
        lambda v, w: (v @ w)[: v.shape[1]],
        (P(None, "x"), P("x", None)),
        P(unreduced={"x"}),
        lambda: (_randn(2, 10, seed=43), _randn(10, 2, seed=44)),
        None,
        switch=False,
        kinds=("summed over ('x',) have different shapes ([1, 2] at {'x': 3}",),
    ),
    Case(  # the last rank alone returns a sum it did not reduce (a VmaError there only)
        "out_spec_claiming_replication_on_one_rank",
        (4,),
        ("x",),
        _reduced_but_on_the_last_rank,
        P("x", None),
        P(),
        lambda: (_randn(10, 3, seed=45),),
        None,
        switch=False,
        kinds=("VmaError: ", "output has type f64[3]{x}: it varies over ('x',)"),
        note="the out_specs check failed on rank 3 (mesh coordinates x=3), the first instance",
    ),
    Case(  # at a=1 (ranks 2, 3): the second output varies over a and b; the first is split
        "out_spec_claiming_replication_on_two_ranks",
        (2, 2),
        ("a", "b"),
        _reduced_but_at_a1,
        P("a", None),
        (P("a", None), P()),
        lambda: (_randn(5, 3, seed=46),),
        None,
        switch=False,
        kinds=("VmaError: ", "output[1] has type f64[3]{a,b}"),
        note="the out_specs check failed on rank 2 (mesh coordinates a=1, b=0), the first instance",
    ),
    Case(  # the VmaError at x=1 comes before the rank problem at x=3, as the instances' order
        "out_spec_errors_of_two_kinds",
        (4,),
        ("x",),
        _two_kinds_of_errors,
        P("x", None),
        (P("x", None), P()),
        lambda: (_randn(10, 3, seed=47),),
        None,
        switch=False,
        kinds=("VmaError: ", "output[1] has type f64[3]{x}"),
        note="the out_specs check failed on rank 1 (mesh coordinates x=1), the first instance",
    ),
    Case(  # the last rank returns a number where its out_spec splits a tensor
        "number_for_a_split_output_on_one_rank",
        (4,),
        ("x",),
        lambda v: v if v.shape[0] == 3 else 1,
        P("x", None),
        P("x"),
        lambda: (_randn(10, 3, seed=48),),
        None,
        switch=False,
        kinds=("SpecError: ", "output is a int; only tensors can be split by P('x')"),
        note="the out_specs check failed on rank 3 (mesh coordinates x=3), the first instance",
    ),
    Case(
        "psum_of_uneven_blocks",
        (2, 2),
        ("a", "b"),
        lambda v: ns.psum(v, "a"),
        P("a"),
        P(),
        lambda: (_randn(5, seed=19),),
        None,
    ),
]


# --- running a case -------------------------------------------------------------------------------


def _leaves(out) -> list:
    return (
        list(out.values() if isinstance(out, dict) else out)
        if isinstance(out, (tuple, dict))
        else [out]
    )


def _global(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _cotangents(outs) -> list[torch.Tensor]:
    return [_randn(*o.shape, seed=90 + k) for k, o in enumerate(outs)]


def _specs_list(specs, n: int) -> list:
    return [specs] * n if isinstance(specs, ns.PartitionSpec) else list(specs)


def _dtensors(case: Case, mesh, args: tuple) -> list:
    from torch.distributed.tensor import distribute_tensor

    from named_spmd.backends._dist_dtensor import placements

    specs = _specs_list(case.in_specs, len(args))
    return [
        distribute_tensor(a.detach(), mesh.device_mesh, placements(mesh, s, a.dim()))
        .detach()
        .requires_grad_()
        for a, s in zip(args, specs)
    ]


def run_case(case: Case, mesh, real: bool) -> dict:
    """Values, gradients, output types and counts of ``case`` on ``mesh``."""
    specs = {"in_specs": case.in_specs, "out_specs": case.out_specs}
    f = ns.spmd_map(case.fn, mesh=mesh, **specs, check_vma=case.check_vma)
    args = [a.clone().requires_grad_() for a in case.args()]
    inputs = _dtensors(case, mesh, args) if real and case.dtensor else args
    switch = ns.simulate_per_instance() if _per_instance(case, mesh) else _nothing()
    back = None
    with switch:
        with ns.CommMode() as comms:  # forward and backward
            outs = _leaves(f(*inputs))
            values = [_global(o) for o in outs]
            loss = sum((v * c).sum() for v, c in zip(values, _cotangents(values)))
            grads = torch.autograd.grad(loss, inputs)
        if real and case.dtensor:  # a DTensor output goes back in: the same blocks
            back = [_global(b) for b in _leaves(f(*[o.detach() for o in outs[:1]], *inputs[1:]))]
    kinds = ["D" if hasattr(o, "full_tensor") else "T" for o in outs]
    return {
        "values": [v.detach() for v in values],
        "grads": [_global(g) for g in grads],
        "grad_shapes": [tuple(g.shape) for g in grads],
        "kinds": kinds,
        "counts": comms.counts(),
        "back": back,
    }


def _per_instance(case: Case, mesh) -> bool:
    return case.switch or (case.switch_simulated and mesh.kind == "simulated")


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def _close(a, b, what: str, problems: list[str]) -> None:
    try:
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)
    except AssertionError as e:
        problems.append(f"{what}: {str(e)[:300]}")


def _dense(case: Case) -> dict:
    args = [a.clone().requires_grad_() for a in case.args()]
    values = _leaves(case.dense(*args))
    loss = sum((v * c).sum() for v, c in zip(values, _cotangents(values)))
    return {"values": values, "grads": torch.autograd.grad(loss, args)}


def check(case: Case, real_mesh, sim_mesh) -> list[str]:
    problems: list[str] = []
    TAPS.clear()
    real = run_case(case, real_mesh, True)
    real_taps = dict(TAPS)
    TAPS.clear()
    sim = run_case(case, sim_mesh, False)
    for where, types in real_taps.items():  # this rank's instance (and a DTensor fed back)
        if types[: len(TAPS.get(where, []))] != TAPS.get(where):
            problems.append(f"types at {where}: {types} vs simulated {TAPS.get(where)}")
    dense = _dense(case)
    for name, want in (("simulated", sim), ("dense", dense)):
        for k, (a, b) in enumerate(zip(real["values"], want["values"])):
            _close(a, b.detach(), f"output {k} vs {name}", problems)
        for k, (a, b) in enumerate(zip(real["grads"], want["grads"])):
            _close(a, b, f"gradient {k} vs {name}", problems)
    if real["grad_shapes"] != [tuple(a.shape) for a in case.args()]:
        problems.append(f"gradient shapes {real['grad_shapes']}")
    if tuple(real["kinds"]) != case.kinds:
        problems.append(f"output types {real['kinds']}, expected {case.kinds}")
    if real["counts"] != sim["counts"]:
        problems.append(f"counts {real['counts']} vs simulated {sim['counts']}")
    if real["back"] is not None:  # f(f(x)[0], ...)[0] == f applied twice, densely
        x, *rest = case.args()
        twice = _leaves(case.dense(_leaves(case.dense(x, *rest))[0], *rest))
        _close(real["back"][0], twice[0].detach(), "DTensor output fed back", problems)
    return problems


def check_error(case: Case, real_mesh, sim_mesh) -> list[str]:
    def message(mesh, case) -> tuple[str, str]:
        try:
            run_case(case, mesh, False)
        except ns.SpmdError as e:
            return f"{type(e).__name__}: {e}", "".join(getattr(e, "__notes__", []))
        return "no error", ""

    real, notes = message(real_mesh, case)
    sim, _ = message(sim_mesh, case if case.like is None else replace(case, fn=case.like))
    if real != sim or real == "no error" or not all(k in real for k in case.kinds):
        return [f"real {real!r} vs simulated {sim!r}"]
    # raised on every rank alike: no note may say that the others stop with RankFailedError,
    # unless the error is a group's (the case's note says so)
    alone = "RankFailedError" in notes and "RankFailedError" not in case.note
    if sys.version_info >= (3, 11) and (case.note not in notes or alone):
        return [f"notes {notes!r}, not {case.note!r}"]
    return _still_in_step(real_mesh)


def _still_in_step(mesh) -> list[str]:
    """An uneven call after an error raised on every rank: the mesh runs it (its ranks are in
    step)."""
    axis = mesh.axis_names[0]
    f = ns.spmd_map(
        lambda v: ns.psum(v.sum(0), axis) + v, mesh=mesh, in_specs=P(axis), out_specs=P(axis)
    )
    x = _randn(5, 2, seed=41)
    try:
        got = _global(f(x))
    except Exception as e:  # noqa: BLE001 - reported
        return [f"the call after the error raised {type(e).__name__}: {str(e)[:500]}"]
    problems: list[str] = []
    _close(got, x.sum(0) + x, "the call after", problems)
    return problems


# Refused on the real mesh, on every rank alike, naming the fix, where the simulated mesh has no
# such program: DTensors whose Shard blocks are not the spec's (it takes no DTensor), split
# sizes that differ between the instances of an even call (one size for all under vmap).
REFUSED = [
    Case(
        "dtensor_split_unevenly_over_two_axes",
        (2, 2),
        ("a", "b"),
        lambda v: v * 2,
        P(("a", "b")),
        P(("a", "b")),
        lambda: (_randn(5, seed=20),),
        None,
        dtensor=True,
        kinds=(
            "SpecError: ",
            "over ('a', 'b'): DTensor splits it over one mesh dim after the other",
        ),
    ),
    Case(
        "dtensor_with_other_given_sizes",
        (4,),
        ("x",),
        lambda v: v * 2,
        P(ns.Blocks("x", (4, 3, 2, 1))),
        P("x"),
        lambda: (_randn(10, seed=21),),
        None,
        switch=False,
        dtensor=True,
        kinds=("SpecError: ", "whose Shard blocks are torch.chunk's (3, 3, 3, 1) along dim 0"),
    ),
    Case(
        "split_sizes_differing_between_instances_of_an_even_call",
        (4,),
        ("x",),
        _rows_by_index,
        P("x"),
        P("x"),
        lambda: (_randn(32, seed=45),),
        None,
        switch=False,
        kinds=(
            "CollectiveError: ",
            "split_sizes differ (the instance at x=0 gives [1, 1, 1, 1], the one at x=1 "
            "[2, 2, 2, 2])",
        ),
    ),
]


def _branched(v):
    """An all_to_all of split sizes over b that the ranks at a=0 alone call."""
    if int(ns.axis_index("a")) == 0:
        v = ns.all_to_all(v, "b", 0, 0, tiled=True, split_sizes=[2, 2])
    return v * 2


def _branched_dense(x, rank: int):
    b0, b1, *others = x.split(4)
    moved = [torch.cat([b0[2 * j : 2 * j + 2], b1[2 * j : 2 * j + 2]]) for j in range(2)]
    return torch.cat([*moved, *others]) * 2


# the local call's split sizes by rank: rank 3's unequal
LOCAL_SIZES = ((2, 2, 2, 2),) * 3 + ((1, 3, 2, 2),)


def _local_split(v):
    return ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=list(LOCAL_SIZES[RANK[0]])) * 2


def _local_split_dense(x, rank: int):
    return torch.cat([b.split(LOCAL_SIZES[i])[rank] for i, b in enumerate(x.split(8))]) * 2


RANK = [0]  # this process's rank (main sets it)

# Even calls of programs the real mesh alone runs (the simulated mesh's vmap reads no value):
# ``dense(x, rank)``: this rank's output (the global one, or the local block of a .local call;
# ``kinds``: ("local",)), its gradient from autograd of it, and CommMode's counts: the
# collective's (and, in a .local call, the sizes' exchange, as the per-instance execution's;
# an even call's is bookkeeping, not counted).
OWN_PROGRAMS = [
    Case(  # the ranks at a=1 call no all_to_all: the sizes' exchange is the group's alone
        "split_sizes_of_a_collective_some_ranks_call",
        (2, 2),
        ("a", "b"),
        _branched,
        P(("a", "b")),
        P(("a", "b")),
        lambda: (_randn(16, seed=46),),
        _branched_dense,
        switch=False,
    ),
    Case(  # the blocks in and out are the caller's: unequal split sizes are taken
        "unequal_split_sizes_of_a_local_call",
        (4,),
        ("x",),
        _local_split,
        P("x"),
        P("x"),
        lambda: (_randn(32, seed=47),),
        _local_split_dense,
        switch=False,
        kinds=("local",),
    ),
]


def check_own_program(case: Case, real_mesh, sim_mesh) -> list[str]:
    problems: list[str] = []
    f = ns.spmd_map(case.fn, mesh=real_mesh, in_specs=case.in_specs, out_specs=case.out_specs)
    (x,) = (a.clone().requires_grad_() for a in case.args())
    local = case.kinds == ("local",)
    with ns.CommMode() as comms:
        out = _global(f.local(x.split(8)[RANK[0]]) if local else f(x))
        (grad,) = torch.autograd.grad((out * _cotangents([out])[0]).sum(), x)
    # every rank's loss in the program's (one global output, or a local block per rank)
    wants = [case.dense(x, r) for r in (range(4) if local else [RANK[0]])]
    loss = sum((w * _cotangents([w])[0]).sum() for w in wants)
    (want_grad,) = torch.autograd.grad(loss, x)
    _close(out, case.dense(x, RANK[0]), "values", problems)
    if local:  # (a local call's input is this rank's block: its gradient, that block's)
        grad, want_grad = grad.split(8)[RANK[0]], want_grad.split(8)[RANK[0]]
    _close(grad, want_grad, "gradients", problems)
    called = local or RANK[0] < 2
    axes = case.names[-1:]
    counted = {("forward", "all_to_all", axes): 1 + local, ("backward", "all_to_all", axes): 1}
    got = {k: v for k, v in comms.counts().items() if k[1] == "all_to_all"}
    if got != (counted if called else {}):
        problems.append(f"counts {comms.counts()}")
    return problems + _still_in_step(real_mesh)


def _types_read_on_some_ranks(v):
    """A collective, a read of a varying value, a type read on the ranks whose block sums
    above 0 (they keep no plan of the call: their next calls are typed, the others' replayed),
    another collective."""
    s = ns.psum(v, "x")
    if v.sum().item() > 0:
        ns.vma(v)
    return ns.psum(s * v, "x")


def _types_read_on_some_ranks_dense(x, rank: int):
    s = x.reshape(4, 2).sum(0)
    return s * s


# Calls replayed on some ranks and typed on others: each notes the read at the same op
PLANS_APART = [
    Case(
        "a_read_in_calls_replayed_on_some_ranks_only",
        (4,),
        ("x",),
        _types_read_on_some_ranks,
        P("x"),
        P(),
        lambda: (torch.tensor([1.0, 1.0, -1.0, -1.0, 2.0, 2.0, -3.0, -3.0]),),
        _types_read_on_some_ranks_dense,
        switch=False,
    ),
]


def check_plans_apart(case: Case, real_mesh, sim_mesh) -> list[str]:
    problems: list[str] = []
    f = ns.spmd_map(case.fn, mesh=real_mesh, in_specs=case.in_specs, out_specs=case.out_specs)
    (x,) = case.args()
    for k in range(3):
        _close(_global(f(x)), case.dense(x, RANK[0]), f"call {k}", problems)
    return problems + _still_in_step(real_mesh)


def _varying_where_positive(v):
    s = ns.psum(v, "x")
    return s * v if v.sum() > 0 else s  # (varying on some ranks, invariant on the others)


# check_vma=False, ranks that branch on values return outputs of other types (varying on some,
# invariant on others) under P(): coordinate 0's value on every rank, by one broadcast that
# every rank joins (values only: where the output requires grad, TYPES_APART_GRAD's error).
TYPES_APART = [
    Case(  # coordinate 0's output varying, two others' invariant
        "varying_at_coordinate_0_invariant_elsewhere",
        (4,),
        ("x",),
        _varying_where_positive,
        P("x"),
        P(),
        lambda: (torch.tensor((2.0, 2.0, -1.0, -1.0, 2.0, 2.0, -3.0, -3.0), dtype=F64),),
        lambda x: x.reshape(4, 2).sum(0) * x[:2],
        check_vma=False,
    ),
    Case(  # coordinate 0's output invariant, the others' varying
        "invariant_at_coordinate_0_varying_elsewhere",
        (4,),
        ("x",),
        _varying_where_positive,
        P("x"),
        P(),
        lambda: (torch.tensor((-2.0, -2.0, 1.0, 1.0, 2.0, 2.0, 3.0, 3.0), dtype=F64),),
        lambda x: x.reshape(4, 2).sum(0),
        check_vma=False,
    ),
]


def _types_apart_by_branch(v):
    y = ns.psum(v.sum(), "x")
    return y * 2 if v.sum() > 0 else v.sum() + y  # (invariant on some ranks, varying elsewhere)


def _halo_of_zeros_on_a_short_block(v):  # 10 rows over 4: the 1-row block's halo is zeros
    piece = v[:2] if v.shape[0] >= 2 else torch.zeros(2, *v.shape[1:], dtype=v.dtype)
    return ns.ppermute(piece, "x", [(i, (i + 1) % 4) for i in range(4)])


# An output that requires grad whose type differs between ranks (they branched on a value), or
# that requires grad on some ranks only (made of constants on a short block): its backward
# passes would run other collectives on the ranks (each waiting on the others), so the call
# raises on every rank before it returns (check_refused: every rank, then the next call).
TYPES_APART_GRAD = [
    Case(
        "grad_on_some_ranks_only",
        (4,),
        ("x",),
        _halo_of_zeros_on_a_short_block,
        P("x"),
        P("x"),
        lambda: (_randn(10, 2, seed=53),),
        None,
        kinds=("SpmdError: ", "requires grad on some instances but not at (x=3)", "x.sum() * 0"),
    ),
    Case(
        "types_apart_requiring_grad",
        (4,),
        ("x",),
        _types_apart_by_branch,
        P("x"),
        P(),
        lambda: (torch.tensor((1.0, 1.0, -1.0, -2.0, 1.0, 1.0, -1.0, -1.0), dtype=F64),),
        None,
        switch=False,
        kinds=("SpmdError: ", "requires grad", "invariant at (x=0), (x=2)", "ns.pvary"),
        check_vma=False,
    ),
]


def check_types_apart(case: Case, real_mesh, sim_mesh) -> list[str]:
    problems: list[str] = []
    got = {}
    for m in (real_mesh, sim_mesh):
        f = ns.spmd_map(
            case.fn, mesh=m, in_specs=case.in_specs, out_specs=case.out_specs, check_vma=False
        )
        with ns.simulate_per_instance() if m is sim_mesh else _nothing():
            got[m.kind] = _global(f(*case.args()))
    _close(got[real_mesh.kind], got[sim_mesh.kind], "vs simulated", problems)
    _close(got[real_mesh.kind], case.dense(*case.args()), "vs dense", problems)
    return problems + _still_in_step(real_mesh)


def check_refused(case: Case, real_mesh, sim_mesh) -> list[str]:
    try:
        run_case(case, real_mesh, True)
    except ns.SpmdError as e:
        if not all(k in f"{type(e).__name__}: {e}" for k in case.kinds):
            return [f"message: {e}"]
        return _still_in_step(real_mesh)
    return ["no error"]


def _pvaried_sum(v):  # the fix the error gives: the sum varying where it meets the size
    return torch.zeros(v.shape[0], dtype=v.dtype) + ns.pvary(ns.psum(v.sum(), "x"), "x")


# check_vma=False, an output typed invariant over an axis where its blocks differ: its value
# is the instance's at coordinate 0 there (against the simulated mesh and the dense value), but
# its backward raises on every rank (a real mesh cannot give the other ranks' invariant values
# their cotangents: the gradients would be wrong). ``kinds``: what the error says.
UNDIFFERENTIABLE = [
    Case(  # check_vma=False, typed invariant, of each block's length: instance 0's (3 rows)
        "unchecked_invariant_of_a_block_size",
        (4,),
        ("x",),
        lambda v: torch.zeros(v.shape[0], dtype=v.dtype) + ns.psum(v.sum(), "x"),
        P("x"),
        P(),
        lambda: (_randn(10, seed=52),),
        lambda x: torch.zeros(3, dtype=x.dtype) + x.sum(),
        kinds=("SpmdError: ", "cannot differentiate"),
        check_vma=False,
    ),
    Case(  # check_vma=False: varying over a, invariant over b, whose blocks differ over b
        "unchecked_varying_over_a_invariant_over_b",
        (2, 2),
        ("a", "b"),
        lambda v, w: w.sum() * torch.ones(v.shape[0], dtype=v.dtype) + ns.psum(v.sum(), "b"),
        (P("b"), P("a")),
        P(),
        lambda: (_randn(3, seed=53), _randn(4, seed=54)),
        lambda x, y: y[:2].sum() * torch.ones(2, dtype=x.dtype) + x.sum(),
        kinds=("SpmdError: ", "cannot differentiate"),
        check_vma=False,
    ),
]


def check_undifferentiable(case: Case, real_mesh, sim_mesh) -> list[str]:
    problems: list[str] = []
    plain = replace(case, args=lambda: tuple(a.detach() for a in case.args()))
    f = {
        m: ns.spmd_map(
            case.fn, mesh=m, in_specs=case.in_specs, out_specs=case.out_specs, check_vma=False
        )
        for m in (real_mesh, sim_mesh)
    }
    with ns.simulate_per_instance():
        values, counts = [], []
        for m in (real_mesh, sim_mesh):
            with ns.CommMode() as comms:
                values.append(_global(f[m](*plain.args())))
            counts.append(comms.counts())
        real, sim = values
        _close(real, sim, "output vs simulated", problems)
        if counts[0] != counts[1]:
            problems.append(f"counts {counts[0]} vs simulated {counts[1]}")
        _close(real, case.dense(*plain.args()), "output vs dense", problems)
        tangents = []
        for m in (real_mesh, sim_mesh):  # forward mode: coordinate 0's tangent, as its value
            with fwAD.dual_level():
                duals = [fwAD.make_dual(a, torch.ones_like(a)) for a in plain.args()]
                tangents.append(fwAD.unpack_dual(_global(f[m](*duals))).tangent)
        _close(tangents[0], tangents[1], "tangent vs simulated", problems)
        args = [a.requires_grad_() for a in plain.args()]
        try:
            torch.autograd.grad(_global(f[real_mesh](*args)).sum(), args)
            problems.append("no error in backward")
        except ns.SpmdError as e:
            if not all(k in f"{type(e).__name__}: {e}" for k in case.kinds):
                problems.append(f"message: {e}")
    return problems + _still_in_step(real_mesh)


# The process-group calls of an uneven call, counted per call: the start-of-call check, each
# collective, and the exchanges of every instance's operand shapes (each made once per
# collective) and output shapes (a later call of the signature whose outputs' shapes are the
# last call's: one all-reduce of a flag instead). ``kinds``: the process-group methods of
# successive calls, in order (a later call of one signature may need fewer), from ``calls`` of
# the case's inputs. The exchanges of a few integers are all_to_alls: gloo's all_gather would
# take n - 1 transfers one after another.
COUNTED = [
    Case(  # the start-of-call check, one exchange of the operands' shapes, the psum, the outputs'
        "psum_exchanges_the_shapes_once",
        (4,),
        ("x",),
        lambda v: ns.psum(v.sum(0), "x"),
        P("x"),
        P(),
        lambda: (_randn(10, 3, seed=30),),
        lambda x: x.sum(0),
        kinds=(
            "allreduce all_to_all_single allreduce all_to_all_single",
            "allreduce all_to_all_single allreduce allreduce",
        ),
    ),
    Case(  # the start-of-call check, one exchange of the operands' shapes, the gather, outputs'
        "tiled_all_gather_exchanges_the_shapes_once",
        (4,),
        ("x",),
        _gather_invariant,
        P("x"),
        P(),
        lambda: (_randn(10, 3, seed=31),),
        lambda x: x,
        kinds=(
            "allreduce all_to_all_single all_gather_single all_to_all_single",
            "allreduce all_to_all_single all_gather_single allreduce",
        ),
    ),
    Case(  # an even call that read a varying value: the start-of-call check, outputs' shapes
        # (then a flag: they are the last call's)
        "even_call_reading_values_exchanges_its_outputs_shapes",
        (4,),
        ("x",),
        lambda v: v[: int((v > 0).sum())],
        P("x"),
        P("x"),
        lambda: (_randn(16, seed=63),),
        lambda x: torch.cat([b[: int((b > 0).sum())] for b in x.split(4)]),
        # (the ranks meet at the end with their rows: no flag, as they may have branched)
        kinds=("allreduce all_to_all_single", "allreduce all_to_all_single"),
        switch=False,
        switch_simulated=True,
    ),
    Case(  # an even call that read an invariant value: the start-of-call check alone
        "even_call_reading_invariant_values_exchanges_nothing",
        (4,),
        ("x",),
        lambda v, k: v[: int(k)] * 2,
        (P("x"), P()),
        P("x"),
        lambda: (_randn(16, seed=63), torch.tensor(2)),
        lambda x, k: torch.cat([b[:2] * 2 for b in x.split(4)]),
        kinds=("allreduce", "allreduce"),
        switch=False,
    ),
    # the start-of-call check and two exchanges of the outputs' shapes (then one flag)
    _five_outputs(
        "five_outputs_exchange_their_shapes_twice",
        ("allreduce all_to_all_single all_to_all_single", "allreduce allreduce"),
    ),
]

# A ppermute of one signature called again: every instance's operand shape is assumed from the
# last call and checked in the ppermute itself. Per call: the halo's rows, columns and the rows
# kept back (a block of fewer rows sends what it has), and the process-group calls it makes
# (None: not counted). The blocks have 3, 3, 3 and 1 rows; the ring sends each to the next.
HALO = {"rows": 1, "cols": 3, "trim": 0, "conj": False}
HALO_STEPS: list[tuple[int, int, int, Any]] = [
    (1, 3, 0, 4),  # the start-of-call check, the shapes exchanged, the ppermute, output shapes
    (1, 3, 0, 3),  # the shapes assumed: checked in the ppermute itself
    (1, 2, 0, 5),  # every instance's shape changed: flagged, exchanged, moved again
    (1, 2, 0, 3),  # the new shape assumed
    (2, 2, 0, None),  # three instances' shapes change, the last one's not: an error on all
    (1, 2, 0, None),  # (after an error: as the board has it)
    (1, 2, 0, 3),
    (1, 2, 1, None),  # the last instance's alone (0 rows), sent to rank 0: an error on all
    (1, 2, 0, None),
    (1, 2, 0, 3),
    # rank 0 forgets the last call's shapes: every rank exchanges them (5: the ppermute the
    # other ranks carried behind the check is drained first)
    (1, 2, 0, "forget"),
    (1, 2, 0, 3),
]


def _halo(v):
    rows = min(HALO["rows"], v.shape[0] - HALO["trim"])
    ring = [(j, (j + 1) % 4) for j in range(4)]
    halo = v[v.shape[0] - rows :, : HALO["cols"]]
    return v + ns.ppermute(halo.conj() if HALO["conj"] else halo, "x", ring).sum()


def _as_real(y):
    return torch.view_as_real(y).flatten(-2) if y.is_complex() else y.float()


def _halo_real(v):
    return _as_real(_halo(v))


def _halo_dense(x, rows: int, cols: int, conj: bool = False):
    halos = [b[-rows:, :cols].conj() if conj else b[-rows:, :cols] for b in x.chunk(4)]
    return torch.cat([b + halos[j - 1].sum() for j, b in enumerate(x.chunk(4))])


REPLAYED = [
    Case(
        "ppermute_of_a_replayed_signature",
        (4,),
        ("x",),
        _halo,
        P("x"),
        P("x"),
        lambda: (_randn(10, 3, seed=32),),
        None,
    )
]


# A replayed ragged_all_to_all (its offsets and sizes carried behind the start-of-call check)
# whose metadata some members get wrong in some calls: what they get wrong per call, and a piece
# of the error that says so (None: a call without one).
RAGGED_WRONG: dict[str, Any] = {}
RAGGED_STEPS: list[tuple[dict[str, Any], str | None]] = [
    ({}, None),
    ({}, None),
    ({"recv_at_2": (1, 2, 1, 1)}, "member 1 of ('x',) sends 1 rows in slot 2 and expects 1"),
    ({}, None),
    ({"offsets_at_3": (0, 1, 2, 7)}, "member 3 of ('x',), slot 3: rows 7:8 do not lie"),
    ({}, None),
]


def _ragged_replayed(x, out):
    return _ragged_one_row_each(x, out, **RAGGED_WRONG)


RAGGED_REPLAYED = [
    Case(
        "ragged_all_to_all_replayed",
        (4,),
        ("x",),
        _ragged_replayed,
        P("x"),
        P("x"),
        _ragged_args,
        None,
    )
]


def check_ragged_replayed(case: Case, real_mesh, sim_mesh) -> list[str]:
    """The calls of :data:`RAGGED_STEPS` on both meshes, of one function each: values as the
    simulated mesh's, its error on every rank alike where members get the metadata wrong (told
    in the rows' exchange: no process-group call more than a replayed call without one
    makes), and the calls after it right (the mesh in step)."""
    problems: list[str] = []
    args = case.args()
    real, sim = (
        ns.spmd_map(case.fn, mesh=m, in_specs=case.in_specs, out_specs=case.out_specs)
        for m in (real_mesh, sim_mesh)
    )
    counts = []
    for k, (wrong, says) in enumerate(RAGGED_STEPS):
        RAGGED_WRONG.clear()
        RAGGED_WRONG.update(wrong)
        (got, calls), (want, _) = _outcome(real, args), _outcome(sim, args)
        if says is not None:
            if got != want or says not in want:
                problems.append(f"call {k}: real {got!r} vs simulated {want!r}")
        elif isinstance(got, str) or isinstance(want, str):
            problems.append(f"call {k}: real {got!r} vs simulated {want!r}")
        else:
            _close(got[0], want[0], f"call {k} vs simulated", problems)
        counts.append(len(calls))
    RAGGED_WRONG.clear()
    if max(counts[1:]) != counts[1]:  # (the first call is no replay)
        problems.append(f"process-group calls per call {counts}")
    # the rows travel as bytes beside the heads: of every element size (1, 2, 16 bytes)
    for dtype in (torch.bool, torch.int8, torch.bfloat16, torch.complex128):
        x, out = (a.to(dtype) for a in args)
        x = x * (1 + 2j) if dtype.is_complex else x  # (imaginary parts too)
        (got, _), (want, _) = _outcome(real, (x, out)), _outcome(sim, (x, out))
        if isinstance(got, str) or isinstance(want, str) or not torch.equal(got[0], want[0]):
            problems.append(f"{dtype}: real {got!r} vs simulated {want!r}")
    return problems


# Calls of one signature whose outputs' block shapes change between calls (Python state), on
# some ranks only: each rank compares its outputs' row with the last call's, and one all-reduce
# of a flag tells whether every rank's matched; any rank's differing, every rank exchanges the
# rows. Per call: the instance whose block loses its last row (None: none), the instance whose
# block is cast to float32 (None: none; another dtype than the others': an error on every
# rank), and the process-group calls it makes (None: not counted). The blocks have 3, 3, 3 and 1
# rows; torch.chunk's blocks of the output are a DTensor, other blocks the global value (one
# padded all_gather).
TRIM: dict[str, Any] = {"at": None, "cast": None, "real": False}
TRIM_STEPS: list[tuple[Any, Any, Any]] = [
    (None, None, "allreduce all_to_all_single"),  # the start-of-call check, the rows exchanged
    (None, None, "allreduce allreduce"),  # every rank's row is the last call's: one flag
    (2, None, "allreduce allreduce all_to_all_single all_gather_single"),  # rank 2's differs
    (2, None, "allreduce allreduce all_gather_single"),  # the new rows recalled
    (None, None, "allreduce allreduce all_to_all_single"),  # rank 2's differs again
    (None, 1, None),  # rank 1's dtype differs: the simulated mesh's error on every rank
    (None, None, None),  # (after an error: the rows exchanged or recalled, as recorded)
    (None, None, "allreduce allreduce"),
    # rank 0 forgets the last call's rows: the start-of-call check finds the ranks recall
    # different things, and every rank exchanges the rows
    (None, None, "forget"),
    (None, None, "allreduce allreduce"),
]


def _trimmed(v):
    # the real mesh's rank from Python state, not read from a value (ranks that read one meet
    # at the end with their rows: no flag); each simulated instance reads its index
    i = RANK[0] if TRIM["real"] else int(ns.axis_index("x"))
    v = v[: v.shape[0] - 1] if i == TRIM["at"] else v
    return v.float() if i == TRIM["cast"] else v


def _trimmed_dense(x, at):
    return torch.cat([b[: len(b) - (j == at)] for j, b in enumerate(x.chunk(4))])


ROWS = [
    Case(
        "outputs_of_a_replayed_signature",
        (4,),
        ("x",),
        _trimmed,
        P("x"),
        P("x"),
        lambda: (_randn(10, 3, seed=33),),
        None,
    )
]


def check_rows(case: Case, real_mesh, sim_mesh) -> list[str]:
    """The calls of :data:`TRIM_STEPS` on both meshes: values against the simulated mesh and
    the dense program, the simulated mesh's error on every rank, the process-group calls."""
    problems: list[str] = []
    (x,) = case.args()
    real, sim = (
        ns.spmd_map(case.fn, mesh=m, in_specs=case.in_specs, out_specs=case.out_specs)
        for m in (real_mesh, sim_mesh)
    )
    for k, (at, cast, expected) in enumerate(TRIM_STEPS):
        TRIM.update(at=at, cast=cast)
        if expected == "forget":
            expected = "allreduce all_to_all_single"
            if real_mesh.rank == 0:
                real_mesh.row_records.clear()
        TRIM["real"] = True
        got, calls = _outcome(real, (x,))
        TRIM["real"] = False
        want, _ = _outcome(sim, (x,))
        if cast is not None:
            if got != want or "SpecError" not in want:
                problems.append(f"call {k}: real {got!r} vs simulated {want!r}")
        elif isinstance(got, str) or isinstance(want, str):
            problems.append(f"call {k}: real {got!r} vs simulated {want!r}")
        else:
            _close(got[0], want[0], f"call {k} vs simulated", problems)
            _close(got[0], _trimmed_dense(x, at), f"call {k} vs dense", problems)
        if expected is not None and " ".join(calls) != expected:
            problems.append(f"call {k}: process-group calls {calls}, not {expected}")
    return problems


def _outcome(f, args) -> tuple[Any, list[str]]:
    """``f(*args)``'s global outputs (or its error's text) and the process-group calls made."""
    _PG_CALLS.clear()
    try:
        with torch.no_grad(), ns.simulate_per_instance():
            got: Any = [_global(o) for o in _leaves(f(*args))]
    except ns.SpmdError as e:
        got = f"{type(e).__name__}: {e}"
    return got, list(_PG_CALLS)


def check_replayed(case: Case, real_mesh, sim_mesh) -> list[str]:
    """The calls of :data:`HALO_STEPS` on both meshes: values against the dense program, the
    simulated mesh's error on every rank where the shapes differ, and the calls counted."""
    problems: list[str] = []
    (x,) = case.args()
    real, sim = (
        ns.spmd_map(case.fn, mesh=m, in_specs=case.in_specs, out_specs=case.out_specs)
        for m in (real_mesh, sim_mesh)
    )
    for k, (rows, cols, trim, expected) in enumerate(HALO_STEPS):
        HALO.update(rows=rows, cols=cols, trim=trim)
        if expected == "forget":  # the start-of-call check finds the ranks recall different
            expected = 5  # shapes: none assumes any
            if real_mesh.rank == 0:
                real_mesh.shape_records.clear()
        (got, calls), (want, _) = _outcome(real, (x,)), _outcome(sim, (x,))
        if isinstance(want, str) or isinstance(got, str):
            if got != want or "different shapes" not in want:
                problems.append(f"call {k}: real {got!r} vs simulated {want!r}")
        else:
            _close(got[0], want[0], f"call {k} vs simulated", problems)
            _close(got[0], _halo_dense(x, rows, cols), f"call {k} vs dense", problems)
        if expected is not None and len(calls) != expected:
            problems.append(f"call {k}: {len(calls)} process-group calls {calls}, not {expected}")
    # typed per op once per signature, as an even call: replayed while the program is the
    # same, typed again from the op where it differs (a halo of another width)
    plans = [p for p in checked_signatures(real).values() if isinstance(p, Plan)]
    if len(plans) != 1 or not plans[0].replays or not plans[0].divergences:
        got = [(p.replays, p.divergences) for p in plans]
        problems.append(f"the real calls' plans (replays, divergences): {got}")
    return problems + _replayed_as_bytes(case, real_mesh, sim_mesh) + _replayed_dtypes(real_mesh)


# which of _two_halos' ppermutes casts the 1-row block's halo, and to which dtype
CAST: dict[str, Any] = {"at": "", "dtype": torch.int64}


def _two_halos(v):
    ring = [(j, (j + 1) % 4) for j in range(4)]
    halos = []
    for which in ("first", "second"):
        h = v[-1:] * len(halos) + v[-1:]
        halos.append(
            ns.ppermute(
                h.to(CAST["dtype"]) if CAST["at"] == which and v.shape[0] == 1 else h, "x", ring
            )
        )
    return v + halos[0].double() + halos[1].double()


def _replayed_dtypes(real_mesh) -> list[str]:
    """A replayed call of two ppermutes whose 1-row block's halo turns int64 (float64's element
    size) in one of them: its first (carried behind the start-of-call check), its second (the
    recalled shape assumed, flagged in the ppermute itself): the simulated mesh's error on
    every rank, not the int64 bytes read as float64; int32 (another element size) in either,
    which sends its flag without a block of other bytes (gloo aborts on sizes that differ);
    the calls before and after right."""
    problems: list[str] = []
    x = torch.arange(30.0, dtype=F64).reshape(10, 3)  # (integers: exact in int64)
    ends = [3, 6, 9, 10]
    dense = x + 3 * torch.cat(
        [
            x[ends[(j - 1) % 4] - 1 :][:1].expand(e - s, 3)
            for j, (s, e) in enumerate(zip([0, *ends], ends))
        ]
    )
    sim_mesh = ns.make_mesh((4,), ("x",), simulated=True)
    real, sim = (
        ns.spmd_map(_two_halos, mesh=m, in_specs=P("x"), out_specs=P("x"))
        for m in (real_mesh, sim_mesh)
    )
    steps = ["", "", "second", "", "first", "", "", "second:int32", "", "first:int32", ""]
    for k, step in enumerate(steps):
        at, _, name = step.partition(":")
        CAST["at"], CAST["dtype"] = at, getattr(torch, name or "int64")
        (got, _), (want, _) = _outcome(real, (x,)), _outcome(sim, (x,))
        if isinstance(want, str) or isinstance(got, str):
            wanted = f"different dtypes ['float64', 'float64', 'float64', '{name or 'int64'}']"
            if got != want or wanted not in want:
                problems.append(f"dtypes call {k}: real {got!r} vs simulated {want!r}")
        else:
            _close(got[0], dense, f"dtypes call {k} vs dense", problems)
    CAST["at"], CAST["dtype"] = "", torch.int64
    return problems


def _replayed_as_bytes(case: Case, real_mesh, sim_mesh) -> list[str]:
    """HALO_STEPS' first four calls on int16 blocks, which gloo moves as their bytes, and on
    complex ones, moved as pairs of reals (a conjugate view, which has no real view, as its
    values): the flags travel so too (assumed, then set where the halo's shape changes), each
    one value of the operand's dtype long, so that the block after it views back as that dtype;
    the result returned as real floats (DTensor's full_tensor over gloo gathers neither dtype)."""
    problems: list[str] = []
    (x,) = case.args()
    # (the conjugated halo in another dtype: a signature of its own, which recalls no shapes)
    for dtype, conj in ((torch.int16, False), (torch.complex128, False), (torch.complex64, True)):
        HALO["conj"] = conj
        v = (x * 100).to(dtype) if dtype is torch.int16 else torch.complex(x, -x).to(dtype)
        real, sim = (
            ns.spmd_map(_halo_real, mesh=m, in_specs=case.in_specs, out_specs=case.out_specs)
            for m in (real_mesh, sim_mesh)
        )
        for k, (rows, cols, trim, expected) in enumerate(HALO_STEPS[:4]):
            HALO.update(rows=rows, cols=cols, trim=trim)
            (got, calls), (want, _) = _outcome(real, (v,)), _outcome(sim, (v,))
            dense = _as_real(_halo_dense(v, rows, cols, conj))
            what = f"{dtype}{' of x.conj()' if conj else ''} call {k}"
            if isinstance(got, str) or isinstance(want, str) or not torch.equal(got[0], want[0]):
                problems.append(f"{what}: real {got!r} vs simulated {want!r}")
            elif not torch.equal(got[0], dense):
                problems.append(f"{what}: real {got[0]} vs dense {dense}")
            if len(calls) != expected:
                problems.append(f"{what}: {len(calls)} process-group calls {calls}")
    HALO["conj"] = False
    return problems


_PG_CALLS: list[str] = []
_PG_METHODS = (
    "allreduce",
    "all_gather_single",
    "reduce_scatter_single",
    "all_to_all_single",
    "broadcast",
)


def _count_process_group_calls() -> None:
    """Count every call of the process-group methods a real mesh uses (before any mesh binds
    them)."""
    import torch.distributed as dist

    for name in _PG_METHODS:
        method = getattr(dist.ProcessGroup, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            _PG_CALLS.append(_name)
            return _method(self, *args, **kwargs)

        setattr(dist.ProcessGroup, name, counted)


def check_calls(case: Case, real_mesh, sim_mesh) -> list[str]:
    """The process-group calls of successive calls of ``case`` on the real mesh (no gradient),
    and their values against the simulated mesh and the dense program."""
    problems: list[str] = []
    args = case.args()
    want = _leaves(case.dense(*args))
    for k, expected in enumerate(case.kinds):
        for mesh, real in ((sim_mesh, False), (real_mesh, True)):
            f = ns.spmd_map(case.fn, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs)
            _PG_CALLS.clear()
            switch = ns.simulate_per_instance() if _per_instance(case, mesh) else _nothing()
            with torch.no_grad(), switch:
                got = [_global(o) for o in _leaves(f(*args))]
            calls = list(_PG_CALLS)
            for j, (a, b) in enumerate(zip(got, want)):
                _close(a, b, f"call {k} output {j} ({'real' if real else 'simulated'})", problems)
        if " ".join(calls) != expected:
            problems.append(f"call {k}: process-group calls {calls}, not {expected}")
    return problems


def _sizes_not_adding_up_on_instance_2(v):
    sizes = [5] * 4 if int(ns.axis_index("x")) == 2 else [1] * 4
    return ns.all_to_all(v, "x", 0, 0, tiled=True, split_sizes=sizes)


# Errors of one rank alone, each checked last, on a mesh of its own (the mesh is out of step
# after): that rank raises its error, the others RankFailedError naming it, none waits.
ALONE = [
    Case(  # each rank checks its own split sizes against its own operand alone
        "split_sizes_not_adding_up_on_one_rank",
        (4,),
        ("x",),
        _sizes_not_adding_up_on_instance_2,
        P("x"),
        P("x"),
        lambda: (_randn(16, seed=44),),
        None,
        kinds=("CollectiveError: ", "split_sizes [5, 5, 5, 5] add up to 20"),
    ),
]


def check_alone(case: Case, real_mesh, sim_mesh) -> list[str]:
    own = ns.make_mesh(case.sizes, case.names)  # (left out of step)
    try:
        run_case(case, own, True)
    except ns.RankFailedError as e:
        if RANK[0] == 2 or "rank 2 (mesh coordinates x=2) failed inside spmd_map" not in str(e):
            return [f"RankFailedError: {e}"]
        return []
    except ns.SpmdError as e:
        if RANK[0] != 2 or not all(k in f"{type(e).__name__}: {e}" for k in case.kinds):
            return [f"{type(e).__name__}: {e}"]
        return []
    return ["no error"]


def main() -> None:
    import torch.distributed as dist

    _count_process_group_calls()
    dist.init_process_group("gloo")
    meshes = {
        shape: (ns.make_mesh(shape, names), ns.make_mesh(shape, names, simulated=True))
        for shape, names in (((4,), ("x",)), ((2, 2), ("a", "b")))
    }
    RANK[0] = dist.get_rank()
    checkers = ((check, CASES), (check_error, ERRORS), (check_refused, REFUSED))
    checkers += ((check_own_program, OWN_PROGRAMS), (check_plans_apart, PLANS_APART))
    checkers += ((check_calls, COUNTED), (check_replayed, REPLAYED), (check_rows, ROWS))
    checkers += ((check_ragged_replayed, RAGGED_REPLAYED),)
    checkers += ((check_undifferentiable, UNDIFFERENTIABLE), (check_types_apart, TYPES_APART))
    checkers += ((check_refused, TYPES_APART_GRAD),)
    checkers += ((check_alone, ALONE),)  # (last: the mesh is out of step after)
    for checker, cases in checkers:
        for case in cases:
            if sys.argv[1:] and case.name not in sys.argv[1:]:  # (names given: only those)
                continue
            try:
                problems = checker(case, *meshes[case.sizes])
            except Exception:  # noqa: BLE001 - reported, the other cases still run
                problems = ["raised:\n" + traceback.format_exc()[-2500:]]
            row = {"rank": dist.get_rank(), "case": case.name, "problems": problems}
            print("OUTCOME " + json.dumps(row), flush=True)
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
