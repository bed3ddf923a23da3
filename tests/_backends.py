"""Running a catalogue program (tests/_programs.py) on a backend, and the references to compare.

A :class:`Run` is what a backend tells about one program: the global output value (None for the
abstract backend), the gradients of ``sum_k <out_k, cot_k>`` for fixed random cotangents with
respect to every floating input leaf, the output shapes and dtypes, the tape of per-device types
(``o.tap``), and the communication counts ``{(direction, op, axes): n}``.

:func:`evaluate` runs a program on a mesh (simulated or real; tests/dist_worker.py calls it in
every process), :func:`abstract_run` through ``spmd_map(...).check``, :func:`reference_run` on the
per-instance reference and the dense program, and :func:`compare_runs` is the one test body.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import optree
import torch
from _programs import NS_OPS, REF_OPS, TAPE, Program, randn, torch_ops
from _reference import assert_trees_close, run_reference

import named_spmd as ns
from named_spmd._replay import checked_signatures

PLAIN_OPS = torch_ops(ns)  # NS_OPS without the type taps


@dataclass
class Run:
    value: Any  # the output tree (global tensors), or None
    shapes: list[tuple[int, ...]]
    dtypes: list[torch.dtype]
    grads: list[torch.Tensor] | None = None
    tape: list[str] | None = None
    comms: dict | None = None
    extra: dict = field(default_factory=dict)


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _global(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _loss(outs):
    terms = [
        (o * randn(*o.shape, seed=100 + k)).sum()
        for k, o in enumerate(outs)
        if o.is_floating_point() and o.requires_grad
    ]
    return sum(terms) if terms else None


def _grads(leaves):
    return [
        _global(t.grad).detach() if t.grad is not None else torch.zeros(t.shape, dtype=t.dtype)
        for t in leaves
    ]


def evaluate(program: Program, mesh, args=None, replayed: bool = False) -> Run:
    """Forward and backward of ``program`` on ``mesh``; ``args``: other global arguments (DTensor
    inputs, say). ``replayed``: the call is the mapped function's second (a replay of the
    first's plan where one is kept: the real backend's ``_plan``), with no type taps (a function
    that reads types is typed on every call); ``extra["replays"]`` counts the calls replayed
    whole."""
    args = optree.tree_map(lambda t: t.clone(), program.args() if args is None else args)
    leaves = [t for t in optree.tree_leaves(args) if _is_float(t)]
    grad = not program.no_grad
    for t in leaves:
        t.requires_grad_(grad)
    f = ns.spmd_map(
        functools.partial(program.prog, PLAIN_OPS if replayed else NS_OPS),
        mesh=mesh,
        in_specs=program.in_specs,
        out_specs=program.out_specs,
        check_vma=program.check_vma,
    )
    if replayed:
        _forward_backward(f, args, grad)
        for t in leaves:
            t.grad = None
    run = _forward_backward(f, args, grad, leaves)
    if replayed:
        run.tape = None
        plans = checked_signatures(f).values()
        run.extra["replays"] = sum(getattr(p, "replays", 0) for p in plans)
    return run


def _forward_backward(f, args, grad: bool, leaves=()) -> Run:
    TAPE.clear()
    with ns.CommMode() as comms, torch.set_grad_enabled(grad):
        out = f(*args)
        tape = list(TAPE)
        value = optree.tree_map(lambda o: _global(o) if isinstance(o, torch.Tensor) else o, out)
        outs = [o for o in optree.tree_leaves(value) if isinstance(o, torch.Tensor)]
        loss = _loss(outs) if grad else None
        if loss is not None:
            loss.backward()
    return Run(
        optree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, value),
        [tuple(o.shape) for o in outs],
        [o.dtype for o in outs],
        _grads(leaves) if grad else None,
        tape,
        comms.counts(),
    )


@functools.cache
def _simulated_mesh(sizes, names):
    return ns.make_mesh(sizes, names, simulated=True)


@functools.cache
def simulated_run(program: Program) -> Run:
    return evaluate(program, _simulated_mesh(program.sizes, program.names))


def abstract_run(program: Program) -> Run:
    f = ns.spmd_map(
        functools.partial(program.prog, NS_OPS),
        mesh=_simulated_mesh(program.sizes, program.names),
        in_specs=program.in_specs,
        out_specs=program.out_specs,
        check_vma=program.check_vma,
    )
    args = optree.tree_map(lambda t: t.clone(), program.args())
    for t in optree.tree_leaves(args):
        if _is_float(t):
            t.requires_grad_(not program.no_grad)
    TAPE.clear()
    report = f.check(*args, backward=not program.no_grad)
    tape = list(TAPE)
    counts: dict = {}
    for e in report.events:
        key = (e.direction, e.op, e.axes)
        counts[key] = counts.get(key, 0) + 1
    return Run(
        None,
        [tuple(o.global_shape) for o in report.outputs],
        [o.type.dtype for o in report.outputs],
        None,
        tape,
        counts,
    )


@functools.cache
def reference_run(program: Program) -> Run:
    """The per-instance reference (values, gradients through its threads) and, where the program
    has one, the dense single-device program (values and gradients), as ``extra['dense']``."""
    args = program.args()
    grad = not program.no_grad

    def run(fn):
        xs = optree.tree_map(lambda t: t.clone().requires_grad_(grad) if _is_float(t) else t, args)
        leaves = [t for t in optree.tree_leaves(xs) if _is_float(t)]
        with torch.set_grad_enabled(grad):
            out = fn(*xs)
        outs = [o for o in optree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        loss = _loss(outs) if grad else None
        if loss is not None:
            loss.backward()
        value = optree.tree_map(lambda o: o.detach() if isinstance(o, torch.Tensor) else o, out)
        return value, (_grads(leaves) if grad else None)

    value, grads = run(
        lambda *xs: run_reference(
            functools.partial(program.prog, REF_OPS),
            dict(zip(program.names, program.sizes)),
            program.in_specs,
            program.out_specs,
            *xs,
            check_invariant=program.check_vma,
        )
    )
    ref = Run(value, [], [], grads)
    if program.dense is not None:
        ref.extra["dense"] = run(program.dense)
    return ref


def compare_runs(got: Run, ref: Run, sim: Run, program: Program) -> None:
    """The one test body: what a backend produced against the references."""
    tol = dict(rtol=program.rtol, atol=program.atol)
    assert got.shapes == sim.shapes, f"output shapes {got.shapes} != simulated {sim.shapes}"
    assert got.dtypes == sim.dtypes, f"output dtypes {got.dtypes} != simulated {sim.dtypes}"
    if got.tape is not None:
        assert got.tape == sim.tape, f"per-device types {got.tape} != simulated {sim.tape}"
    if got.comms is not None:
        assert got.comms == sim.comms, f"communication {got.comms} != simulated {sim.comms}"
        backward = {(op, axes): n for (d, op, axes), n in got.comms.items() if d == "backward"}
        if program.pinned_backward is not None:
            assert backward == program.pinned_backward, backward
        if program.backward_comms is not None:
            assert bool(backward) == program.backward_comms, backward
    if got.value is not None:
        assert_trees_close(got.value, ref.value, **tol)
        if "dense" in ref.extra:
            assert_trees_close(_main(got.value), _main(ref.extra["dense"][0]), **tol)
    if got.grads is not None:
        assert ref.grads is not None
        assert_trees_close(got.grads, ref.grads, **tol)
        if "dense" in ref.extra:
            assert_trees_close(got.grads, ref.extra["dense"][1], **tol)
        if program.all_grads_nonzero:
            assert all(g.abs().max() > 0 for g in got.grads), "an input's gradient is all zero"


def _main(value):
    return value
