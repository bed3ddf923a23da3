"""psum, pmean, pmax, pmin, all_gather and psum_scatter of pytrees on a real mesh (2 gloo
processes), for tests/test_distributed.py.

A real mesh applies them to the leaves of one type, dtype, device and requires_grad by one
collective of their concatenation (``named_spmd/_collectives/_fused.py``); a simulated mesh, leaf
by leaf. ``python tests/tree_reductions.py`` under a 2-process job runs each case of :data:`CASES`
three times (the first call typed, the others replayed) on the real mesh and on a simulated one in
the same process (:func:`run_case`), and prints one ``OUTCOME {json}`` line per case and rank: the
largest difference between their outputs and between their inputs' gradients (and whether the same
inputs got none), whether the types of the output leaves inside the function and the events
``ns.CommMode`` recorded are equal, the process-group calls torch counted on the real mesh in the
calls and in their backward (``grad_buckets.Collectives``) and its plan's replays.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from grad_buckets import Collectives  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402
from named_spmd._replay import checked_signatures  # noqa: E402

F64, F32 = torch.float64, torch.float32


def _leaves(gen, shapes_dtypes, requires_grad):
    return [
        torch.randn(shape, generator=gen, dtype=dtype).requires_grad_(grad)
        if dtype.is_floating_point or dtype.is_complex
        else torch.randint(-9, 9, shape, generator=gen, dtype=dtype)
        for (shape, dtype), grad in zip(shapes_dtypes, requires_grad)
    ]


def _mixed_tree(gen, grad=False):
    """12 small float64 leaves, 3 float32 ones, an int64 one and a float64 one of 4 MiB per rank
    (reduced alone), in a dict, a tuple and a list; each split over dp along its first dim."""
    small = [((2 * (1 + k % 3), 3), F64) for k in range(12)]
    rest = [((2, 4), F32), ((4, 2), F32), ((2,), F32), ((6,), torch.int64), ((2 * 512, 1024), F64)]
    flat = _leaves(gen, small + rest, [grad and d.is_floating_point for _, d in small + rest])
    return {"w": flat[:12], "b": tuple(flat[12:15]), "n": flat[15], "big": flat[16]}


def _grad_tree(gen):
    """Leaves that require grad and leaves that do not (two groups of one dtype)."""
    shapes = [((2, 3), F64)] * 4 + [((4,), F64)] * 3
    flat = _leaves(gen, shapes, [True] * 4 + [False] * 3)
    return {"p": flat[:4], "q": flat[4:]}


def _invariant_leaf(gen):
    """A tree whose "r" leaf is replicated (in_spec P()): pmean drops dp for it, so the tree is
    reduced leaf by leaf."""
    r = torch.randn(3, generator=gen, dtype=F64)
    return {"v": _leaves(gen, [((2, 3), F64)] * 3, [True] * 3), "r": r}


def _wire_dtypes(gen):
    """Leaves of dtypes that travel as another (complex as real pairs, bfloat16 widened)."""
    shapes = [((2, 3), torch.complex128)] * 2 + [((4,), torch.bfloat16)] * 3
    return _leaves(gen, shapes, [True] * 5)


def _unused_leaves(tree, axes):
    """psum of a pytree of which only some results are used: the others' operands get no
    gradient, as leaf by leaf (not a zero, which sqrt's backward at 0 would make NaN)."""
    p = tree["p"]
    dropped = (torch.sqrt(p[0] * 0.0), p[1] * 2.0)
    return ns.psum((dropped, list(p[2:])), axes)[1]


def _unused_gathered(tree, axes):
    """all_gather of a pytree of which only some results are used, as :func:`_unused_leaves`:
    its transpose communicates, yet each leaf keeps a node of its own (one node for the group
    would be reached through the used results, and hand the unused operands zeros)."""
    p = tree["p"]
    dropped = (torch.sqrt(p[0] * 0.0), p[1] * 2.0)
    return ns.all_gather((dropped, list(p[2:])), axes, tiled=True)[1]


def _written_pmax(tree, axes):
    """pmax of a pytree whose results are then written in place: its backward reads the saved
    results, which the writes must leave as they were (each a copy, as leaf by leaf)."""
    out = ns.pmax(tree, axes)
    for o in _flat(out):  # (the first call's while a CommMode records too)
        o.mul_(2.0)
    return out


def _unreduced(op):
    """``op`` of a tree whose leaves are partial sums (a ZeRO step's gradients, typed
    unreduced): fused as varying leaves are."""
    return lambda tree, axes: op(ns.pcast(tree, axes, to="unreduced"), axes)


def _partly_unreduced(tree, axes):
    """pmean of partial sums and varying values together: one group (a reduction takes a
    partial sum as varying), whose results are all invariant."""
    p = tree["p"]
    parts = [ns.pcast(t, axes, to="unreduced") for t in p[:2]] + list(p[2:])
    return ns.pmean({"p": parts, "q": tree["q"]}, axes)


def _gather(to, axis, tiled=True):
    return lambda tree, axes: ns.all_gather(tree, axes, axis=axis, tiled=tiled, to=to)


def _scatter_tree(gen):
    """Leaves whose last dim has size 2 (the members' blocks of it, tiled, or one each): three
    that require grad, two of another rank that do not."""
    shapes = [((4, 2), F64)] * 3 + [((2, 3, 2), F64)] * 2
    return _leaves(gen, shapes, [True] * 3 + [False] * 2)


def _scatter(tiled):
    return lambda tree, axes: ns.psum_scatter(tree, axes, scatter_dimension=-1, tiled=tiled)


#: name -> (collective, tree maker, in_spec of each leaf, out_specs, the forward's process-group
#: calls per call, by kind, beside the start-of-call check's all-reduce)
CASES = {
    # float64 small, float32, int64, the big one
    "psum_mixed": (ns.psum, _mixed_tree, None, P(), {"allreduce": 4}),
    "pmean_grads": (ns.pmean, _grad_tree, None, P(), {"allreduce": 2}),  # requires_grad or not
    "pmean_invariant_leaf": (ns.pmean, _invariant_leaf, {"r": P()}, P(), {"allreduce": 3}),
    "psum_wire_dtypes": (ns.psum, _wire_dtypes, None, P(), {"allreduce": 2}),
    "psum_unused_leaves": (_unused_leaves, _grad_tree, None, P(), {"allreduce": 1}),
    "pmax_grads": (ns.pmax, _grad_tree, None, P(), {"allreduce": 2}),  # (backward: the tie mask's)
    "pmin_grads": (ns.pmin, _grad_tree, None, P(), {"allreduce": 2}),
    "pmax_written": (_written_pmax, _grad_tree, None, P(), {"allreduce": 2}),
    # FSDP's gathering of parameters, tiled along their first dim, untiled along the last
    "all_gather_invariant": (_gather("invariant", 0), _grad_tree, None, P(), {"gather": 2}),
    "all_gather_varying": (_gather("varying", -1, False), _grad_tree, None, P("dp"), {"gather": 2}),
    "all_gather_unused_leaves": (_unused_gathered, _grad_tree, None, P("dp"), {"gather": 1}),
    # ZeRO's reduce-scatter of gradients, along their last dim
    "psum_scatter_tiled": (_scatter(True), _scatter_tree, None, P("dp"), {"reduce_scatter": 2}),
    "psum_scatter": (_scatter(False), _scatter_tree, None, P("dp"), {"reduce_scatter": 2}),
    # partial sums (unreduced over dp): reduced and scattered as varying leaves are
    "psum_unreduced": (_unreduced(ns.psum), _grad_tree, None, P(), {"allreduce": 2}),
    "pmean_partly_unreduced": (_partly_unreduced, _grad_tree, None, P(), {"allreduce": 2}),
    "psum_scatter_unreduced": (
        _unreduced(_scatter(True)),
        _scatter_tree,
        None,
        P("dp"),
        {"reduce_scatter": 2},
    ),
}


#: name -> the backward's process-group calls per call, by kind, beside the input boundary's
#: gather of each input gradient (the inputs are global tensors): a transpose that communicates
#: runs once per leaf that gets a gradient (each leaf's node: ``_autodiff.ComputedFn``)
BACKWARD = {
    "pmax_grads": {"allreduce": 4},  # (the tie count)
    "pmin_grads": {"allreduce": 4},
    "pmax_written": {"allreduce": 4},
    "all_gather_varying": {"reduce_scatter": 4},
    "all_gather_unused_leaves": {"reduce_scatter": 2},
    "psum_scatter_tiled": {"gather": 3},
    "psum_scatter": {"gather": 3},
    "psum_scatter_unreduced": {"gather": 3},
}


def _specs(tree, override):
    specs = ns.P("dp")
    if override is None:
        return specs
    return {k: override.get(k, specs) for k in tree}


def run_case(mesh, name: str) -> dict:
    """Three calls of case ``name`` on ``mesh``: the outputs and gradients (global tensors),
    types, events, process-group calls and replays (see the module doc)."""
    op, make, override, out_specs, _ = CASES[name]
    types: list = []

    def body(tree):
        out = op(tree, "dp")
        if not types:  # (the first call: a call that reads a type is not replayed)
            types.append([str(ns.typeof(o)) for o in _flat(out)])
        return out

    specs = (_specs(make(_gen()), override),)
    f = ns.spmd_map(body, mesh=mesh, in_specs=specs, out_specs=out_specs)
    counted, back, mode = Collectives(), Collectives(), ns.CommMode()
    outs, grads, nones = [], [], []
    for call in range(3):
        tree = make(_gen(call))
        with mode if call == 0 else contextlib.nullcontext(), counted():  # (a CommMode: typed)
            out = f(tree)
        got = [_full(o) for o in _flat(out)]
        outs += [g.detach() for g in got]
        wanted = [t for t in _flat(tree) if t.requires_grad]
        if wanted:
            weights = [torch.arange(g.numel()).reshape(g.shape) for g in got]
            pairs = [(g.abs() if g.is_complex() else g, w) for g, w in zip(got, weights)]
            loss = sum((g * w).sum() for g, w in pairs if g.requires_grad)
            with back():
                got_grads = torch.autograd.grad(loss, wanted, allow_unused=True)
            grads += [_full(g) for g in got_grads if g is not None]
            nones += [g is None for g in got_grads]
    plans = [p for p in checked_signatures(f).values() if hasattr(p, "replays")]
    return {
        "outs": outs,
        "grads": grads,
        "nones": nones,
        "types": types,
        "events": [
            (e.op, e.direction, list(e.shape), str(e.dtype)) for e in mode.events if not e.boundary
        ],
        "collectives": counted.counts,
        "backward": back.counts,
        "replays": sum(p.replays for p in plans),
    }


def compared(real: dict, simulated: dict) -> dict:
    """What the test asserts of a case's :func:`run_case` on the real and the simulated mesh."""

    def worst(a: list, b: list) -> float:
        assert [x.shape for x in a] == [y.shape for y in b]
        return max((float((x.double() - y.double()).abs().max()) for x, y in zip(a, b)), default=0)

    return {
        "outs": worst(real["outs"], simulated["outs"]),
        "grads": worst(real["grads"], simulated["grads"]),
        "had_grads": len(real["grads"]),
        "nones_equal": real["nones"] == simulated["nones"],
        "nones": sum(real["nones"]),
        "types_equal": real["types"] == simulated["types"],
        "events_equal": real["events"] == simulated["events"],
        "events": len(real["events"]),
        "collectives": real["collectives"],
        "backward": real["backward"],
        "replays": real["replays"],
    }


def _gen(call: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(1234 + call)


def _flat(tree) -> list:
    import optree

    return optree.tree_leaves(tree)


def _full(t) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    mesh = ns.make_mesh((2,), ("dp",))
    simulated = ns.make_mesh((2,), ("dp",), simulated=True)
    for name in CASES:
        try:
            outcome = {"name": name, **compared(run_case(mesh, name), run_case(simulated, name))}
        except Exception as e:  # noqa: BLE001 - reported to the test
            import traceback

            outcome = {"name": name, "error": type(e).__name__, "message": traceback.format_exc()}
        print("OUTCOME " + json.dumps({"rank": dist.get_rank(), **outcome}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
