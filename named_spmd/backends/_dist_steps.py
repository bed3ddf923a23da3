"""The steps of a real mesh's call after it read a varying value (``SpmdContext.values_read``).

From such a read on, the ranks may take other branches: a collective called on some ranks only
would pair with another collective, or with the outputs' exchange, of another rank (gloo aborts
the process on sizes that differ, or waits), where the simulated mesh raises its error. So every
collective of such a call (in place of its exchange of operand shapes) and the call's end meet
over the whole mesh first (:func:`meet`): one exchange of a row per rank, what it is about to do
(the collective and its axes, or the end of the call) and its operand's shape. A rank goes on
where every member of its group is about to do the same; else it meets again, while the ranks
whose groups agree run their collective (a program of the real mesh alone, which calls a
collective on some groups only after a branch on ``axis_index``). Where no rank can go on, every
rank raises the simulated mesh's error alike (the instances called different collectives), and
the mesh stays in step.
"""

from __future__ import annotations

import zlib
from typing import Any

import torch

from .._collectives._record import RECORDS
from .._errors import SpmdError, collectives_apart, collectives_differ
from .._layout import coords_of, coords_text, groups
from ._dist_comm import dtype_code

_DIMS = 16  # the dims of an operand's shape in a row (more: its shape is not compared)
# The outputs' first row, met with at the end (``_dist_uneven._every_block``): HEAD integers
# (the output tree, the out_specs error), then SLOTS slots (the outputs; more: a wider exchange)
# of KIND integers (a block's rank, dtype, the axes its type differs over, whether it requires
# grad) and WIDTH dims (more: a wider exchange).
HEAD, SLOTS, KIND, WIDTH = 4, 4, 4, 16
PAYLOAD = HEAD + SLOTS * (KIND + WIDTH)  # a row's integers after its step: the widest payload
_END = 0  # a row's step: the end of the call (else its collective's :func:`_code`)
_STEP = 3  # a row's first integers: the step (its collective, axes and parameters)


def _code(name: str | None) -> int:
    """A collective's name as an integer, the same in every process (``hash`` of a str is not)."""
    return _END if name is None else 1 + zlib.crc32(name.encode())


def _name(code: int) -> str:
    return next((n for n in RECORDS if _code(n) == code), "a collective")


def _axes_code(names: tuple[str, ...], axes: tuple[str, ...]) -> int:
    """``axes``, in their order, as one integer (base ``len(names) + 1``)."""
    code = 0
    for a in axes:
        code = code * (len(names) + 1) + names.index(a) + 1
    return code


def _axes_of(names: tuple[str, ...], code: int) -> tuple[str, ...]:
    axes: list[str] = []
    while code:
        code, a = divmod(code, len(names) + 1)
        axes.insert(0, names[a - 1])
    return tuple(axes)


def params_code(params: Any) -> int:
    """A collective's parameters (ppermute's pairs, a dim) as one integer, the same in every
    process: their ``repr`` where they hold only ints, strs, bools and None in tuples, else 0
    (not compared: a value of another kind may print differently per process)."""

    def plain(p: Any) -> bool:
        if isinstance(p, (tuple, list)):
            return all(plain(q) for q in p)
        return p is None or type(p) in (int, str, bool)

    return zlib.crc32(repr(params).encode()) if plain(params) else 0


def shapes_met(ctx: Any, step: tuple, x: torch.Tensor) -> tuple[list, list[int]]:
    """Every instance's operand shape (row-major over the mesh; None past :data:`_DIMS` dims)
    and dtype (``_dist_comm.dtype_code``), once every member of this rank's group of the axes
    is about to run the collective ``step`` (its name, axes and, where known, parameters) over
    them (:func:`meet`)."""
    known = x.dim() <= _DIMS
    name, axes, *params = step
    shape = [x.dim(), *x.shape] if known else [-1]
    payload = [dtype_code(x.dtype), *shape]
    rows = meet(ctx, name, axes, payload, params_code(tuple(params)) if params else 0)
    shapes = [tuple(r[2 : 2 + r[1]]) if r[1] >= 0 else None for r in rows]
    return shapes, [r[0] for r in rows]


def meet(
    ctx: Any, name: str | None, axes: tuple[str, ...], payload: list[int], params: int = 0
) -> list:
    """Every instance's ``payload`` (row-major over the mesh; at most :data:`PAYLOAD` integers,
    zeros after), once every member of this rank's group of ``axes`` is about to run the
    collective ``name`` over them with the same parameters (``params``, :func:`params_code`;
    ``name`` None: every rank is at the end of the call, where the payload is its outputs' row,
    ``_dist_uneven.agree``: one exchange for both)."""
    mesh = ctx.mesh
    mesh.finish_pending_check()  # (the start-of-call check's collective comes first)
    comm = mesh.comm(mesh.axis_names)
    mine = [_code(name), _axes_code(mesh.axis_names, axes), params, *payload]
    mine += [0] * (_STEP + PAYLOAD - len(mine))
    step = "the end of the call" if name is None else f"before {name} over {axes}"
    while True:
        rows = exchange(comm, mine, "the meeting", f"the meeting ({step})")
        steps = [tuple(r[:_STEP]) for r in rows]
        if _other_arguments(steps):  # one collective, its groups' pairs differ: as simulated
            raise ctx.alike(_apart(ctx, steps))
        ready = _ready(mesh, steps)
        if comm.index in ready:
            return [r[_STEP:] for r in rows]
        if not ready:
            raise ctx.alike(_apart(ctx, steps))


def exchange(
    comm, values: list[int], name: str = "block sizes", doing: str | None = None
) -> list[list[int]]:
    """Every member's ``values`` (one length on every member), in member order: one
    ``all_to_all`` of a copy for each member, not an all_gather (gloo's passes the rows round
    the ring, n - 1 transfers one after the other; its all_to_all posts them all at once: on 4
    gloo processes about half the wall time for a row of integers). ``name``, ``doing``: what
    it is (the same on every member) and this member's step, for its errors."""
    mine = torch.tensor(values, dtype=torch.int64, device=comm.mesh.device)
    return comm.all_to_all(mine.expand(comm.n, -1), name, doing).tolist()


def _other_arguments(steps: list[tuple]) -> bool:
    """Whether ranks are about to run one collective over the same axes with other parameters
    (ppermute's pairs): JAX's ppermute takes one perm for every group, and the simulated
    mesh's instances meet at each collective with their arguments, so groups whose members
    agree among themselves but not with the other groups are refused alike, not run apart."""
    arguments: dict[tuple, int] = {}
    for code, axes, params in steps:
        if arguments.setdefault((code, axes), params) != params:
            return True
    return False


def _ready(mesh: Any, steps: list[tuple]) -> set[int]:
    """The instances whose group's members are all about to take the same step."""
    sizes = tuple(mesh._shape.items())
    ready: set[int] = set()
    for i, (code, axes, _) in enumerate(steps):
        if i in ready:
            continue
        members = (
            range(len(steps))
            if code == _END
            else next(g for g in groups(_axes_of(mesh.axis_names, axes), sizes) if i in g)
        )
        if all(steps[m] == steps[i] for m in members):
            ready.update(members)
    return ready


def _apart(ctx: Any, steps: list[tuple]) -> SpmdError:
    """No instance can take its step: the simulated mesh's error for instances that called
    different collectives."""
    mesh = ctx.mesh
    label = f"spmd_map of {ctx.fn_label}"

    def where(instances) -> str:
        return ", ".join(
            f"({coords_text(coords_of(i, mesh.axis_names, mesh._shape))})" for i in instances
        )

    def what(step: tuple) -> str:
        told = f"{_name(step[0])} over {_axes_of(mesh.axis_names, step[1])}"
        alike = [s for s in steps if s[:2] == step[:2]]
        # (the parameters themselves stay on their rank: only whether they differ is known)
        return told + (" with other arguments" if len(set(alike)) > 1 else "")

    ended = [i for i, s in enumerate(steps) if s[0] == _END]
    waiting = [i for i, s in enumerate(steps) if s[0] != _END]
    if ended:
        return collectives_apart(label, where(ended), where(waiting), what(steps[waiting[0]]))
    return collectives_differ(
        label, "; ".join(f"instance {where([i])}: {what(s)}" for i, s in enumerate(steps))
    )
