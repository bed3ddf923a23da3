"""The torch.func transform matrix over random programs: each rank runs every transform of
``OVER`` (over the mapped call) and of ``INSIDE`` (inside the per-device function) on sampled cases
of tests/_sampler.py, on a real (gloo) mesh and on a simulated mesh of the same shape, and compares
the two: values and gradients (dtypes, shapes), the ``ns.vma`` of every value of the program
(tapped inside the call, under the transform), the CommMode counts of the program's collectives,
and, on the real mesh, CommMode's events (boundary ones included) against the calls of the
ProcessGroup's collective methods (tests/real_transforms.py counts them).

``python tests/sampled_transforms.py`` under a job of 2 or 4 processes prints one
``OUTCOME {json}`` line per program and rank (tests/test_real_transforms.py).
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

import real_transforms as rt
import torch
from _reference import broadcast_specs, tree_leaves, tree_map
from _sampler import SEED, make_case
from _sampler import run as run_case
from torch.func import grad, hessian, jacfwd, jacrev, jvp, linearize, vjp, vmap

import named_spmd as ns
from named_spmd import P

#: sampled cases per world size (the first seeds from ``SEED`` whose case has tensor outputs)
CASES = {2: 3, 4: 1}
#: the ProcessGroup method each logical collective runs on the real mesh
PG_METHOD = {**rt.PG_METHOD, "ppermute": "all_to_all_single", "pshuffle": "all_to_all_single"}
TAPE: list[list[str]] = []  # ns.vma of the values of each run of a program, in order


def cases(world: int) -> list:
    found, seed = [], SEED
    while len(found) < CASES[world]:
        case = make_case(seed, world=world)
        if any(case.model[o.i].shape is not None for o in tree_leaves(case.out_tree)):
            found.append(case)
        seed += 1
    return found


def _tap(pool: list) -> None:
    TAPE.append([",".join(sorted(ns.vma(v))) for v in pool if isinstance(v, torch.Tensor)])


def _fixed(shape, k: int) -> torch.Tensor:
    """A deterministic tensor (the same on every rank and backend): cotangents, directions."""
    gen = torch.Generator().manual_seed(1000 + k)
    return torch.randn(shape, generator=gen, dtype=torch.float64)


class Program:
    """A case's program with its tensor argument leaves as the transforms' inputs (the Python
    float leaves closed over) and its tensor output leaves as their outputs."""

    def __init__(self, case, mesh):
        self.case = case
        self.leaves = tree_leaves(case.args)
        self.is_tensor = [isinstance(v, torch.Tensor) for v in self.leaves]
        self.tensors = [v for v in self.leaves if isinstance(v, torch.Tensor)]
        specs = tree_leaves(broadcast_specs(case.in_specs, case.args))
        self.tensor_specs = tuple(s for s, t in zip(specs, self.is_tensor) if t)
        outs = tree_leaves(case.out_tree)
        self.out_is_tensor = [case.model[o.i].shape is not None for o in outs]
        out_specs = tree_leaves(broadcast_specs(case.out_specs, case.out_tree))
        self.out_specs = tuple(s for s, t in zip(out_specs, self.out_is_tensor) if t)
        self.body = functools.partial(run_case, ns, case, on_values=_tap)
        self.mapped = ns.spmd_map(
            self.body, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs
        )
        self.names = mesh.axis_names
        self.mesh = mesh

    def args_with(self, tensors) -> list:
        """The argument leaves with ``tensors`` in the tensor leaves' places, unflattened."""
        it = iter(tensors)
        flat = iter([next(it) if t else v for v, t in zip(self.leaves, self.is_tensor)])
        return tree_map(lambda _: next(flat), list(self.case.args))

    def tensor_outs(self, out) -> tuple:
        return tuple(o for o, t in zip(tree_leaves(out), self.out_is_tensor) if t)

    def call(self, *tensors) -> tuple:
        """The mapped call: global tensor leaves in, global tensor output leaves out."""
        return tuple(rt._plain(o) for o in self.tensor_outs(self.mapped(*self.args_with(tensors))))

    def local(self, *tensors) -> tuple:
        """The per-device function on local tensor leaves: its tensor output leaves."""
        return self.tensor_outs(self.body(*self.args_with(tensors)))


# --- over the mapped call ------------------------------------------------------------------------


def _loss(outs, k: int = 0) -> torch.Tensor:
    return sum((o * _fixed(o.shape, 10 * k + j)).sum() for j, o in enumerate(outs))


def _directed(p: Program):
    """``t`` [2] -> two losses of the call at the inputs moved along two fixed directions."""

    def h(t):
        moved = [
            x + t[0] * _fixed(x.shape, 100 + j) + t[1] * _fixed(x.shape, 200 + j)
            for j, x in enumerate(p.tensors)
        ]
        outs = p.call(*moved)
        return torch.stack([_loss(outs, 0), _loss(outs, 1)])

    return h


def _tangents(p: Program) -> list[torch.Tensor]:
    return [_fixed(x.shape, 300 + j) for j, x in enumerate(p.tensors)]


def over_none(p):
    return p.call(*p.tensors)


def over_grad(p):
    return grad(lambda *xs: _loss(p.call(*xs)), argnums=tuple(range(len(p.tensors))))(*p.tensors)


def over_vjp(p):
    outs, pull = vjp(p.call, *p.tensors)
    return (*outs, *pull(tuple(_fixed(o.shape, 400 + j) for j, o in enumerate(outs))))


def over_jvp(p):
    outs, touts = jvp(p.call, tuple(p.tensors), tuple(_tangents(p)))
    return (*outs, *touts)


def over_linearize(p):
    outs, push = linearize(p.call, *p.tensors)
    return (*outs, *push(*_tangents(p)))


def over_jacrev(p):
    return jacrev(_directed(p))(torch.zeros(2, dtype=torch.float64))


def over_jacfwd(p):
    return jacfwd(_directed(p))(torch.zeros(2, dtype=torch.float64))


def over_hessian(p):
    return hessian(lambda t: _directed(p)(t).sum())(torch.zeros(2, dtype=torch.float64))


def over_vmap(p):
    batched = [torch.stack([x, x.sin()]) for x in p.tensors]
    return vmap(p.call)(*batched)


OVER = {f.__name__.removeprefix("over_"): f for f in (over_none, over_grad, over_vjp, over_jvp)}
OVER |= {f.__name__.removeprefix("over_"): f for f in (over_linearize, over_jacrev, over_jacfwd)}
OVER |= {f.__name__.removeprefix("over_"): f for f in (over_hessian, over_vmap)}


# --- inside the per-device function --------------------------------------------------------------
# Each returns, per instance, values whose types the out_specs of ``inside_specs`` name; the vma
# of each transform's result is tapped.


def _typed(*values) -> None:
    TAPE.append(["result " + ",".join(sorted(ns.vma(v))) for v in values])


def _local_loss(outs, k: int = 0) -> torch.Tensor:
    """A scalar of the outputs, summed over the axes it varies over: invariant, so that its
    gradient is the whole program's."""
    loss = sum((o * o.cos()).sum() * (k + 1) + o.sin().sum() * k for o in outs)
    varying = tuple(ns.vma(loss))
    return ns.psum(loss, varying) if varying else loss


def inside_grad(p, *xs):
    gs = grad(lambda *v: _local_loss(p.local(*v)), argnums=tuple(range(len(xs))))(*xs)
    _typed(*gs)
    return gs


def inside_vjp(p, *xs):
    outs, pull = vjp(p.local, *xs)
    gs = pull(tuple(o.cos() for o in outs))
    _typed(*gs)
    return gs


def inside_jvp(p, *xs):
    outs, touts = jvp(p.local, xs, tuple(x.sin() * 0.5 for x in xs))
    _typed(*touts)
    return touts


def inside_vmap(p, *xs):
    outs = vmap(p.local)(*(torch.stack([x, x.sin()]) for x in xs))
    _typed(*outs)
    return tuple(o[0] + o[1] for o in outs)


def _local_directed(p, xs):
    def h(t):
        moved = [x + t[0] * x.sin() + t[1] * x.cos() for x in xs]
        outs = p.local(*moved)
        return torch.stack([_local_loss(outs, 0), _local_loss(outs, 1)])

    return h


def _every_instance(p, r):
    """``r`` made varying over every axis (its type is tapped first): one block per instance."""
    _typed(r)
    missing = tuple(a for a in p.names if a not in ns.vma(r))
    return (ns.pvary(r, missing) if missing else r).unsqueeze(0)


def inside_jacrev(p, *xs):
    t = torch.zeros(2, dtype=torch.float64)
    return (_every_instance(p, jacrev(_local_directed(p, xs))(t)),)


def inside_jacfwd(p, *xs):
    t = torch.zeros(2, dtype=torch.float64)
    return (_every_instance(p, jacfwd(_local_directed(p, xs))(t)),)


def inside_hessian(p, *xs):
    t = torch.zeros(2, dtype=torch.float64)
    return (_every_instance(p, hessian(lambda t: _local_directed(p, xs)(t).sum())(t)),)


INSIDE = {f.__name__.removeprefix("inside_"): f for f in (inside_grad, inside_vjp, inside_jvp)}
INSIDE |= {f.__name__.removeprefix("inside_"): f for f in (inside_vmap, inside_jacrev)}
INSIDE |= {f.__name__.removeprefix("inside_"): f for f in (inside_jacfwd, inside_hessian)}


def inside_specs(p: Program, name: str):
    if name in ("grad", "vjp"):
        return p.tensor_specs
    if name in ("jvp", "vmap"):
        return p.out_specs
    return (P(p.names),)


def inside(p: Program, name: str):
    fn = functools.partial(INSIDE[name], p)
    f = ns.spmd_map(fn, mesh=p.mesh, in_specs=p.tensor_specs, out_specs=inside_specs(p, name))
    return tuple(rt._plain(o) for o in f(*p.tensors))


# --- the launch ----------------------------------------------------------------------------------


def programs(mesh_of, world: int) -> dict:
    """``{name: thunk}``: every transform of both matrices on every case."""
    out = {}
    for k, case in enumerate(cases(world)):
        mesh = mesh_of(case)
        p = Program(case, mesh)
        for name, transform in OVER.items():
            out[f"sampled {k} over: {name}"] = functools.partial(transform, p)
        for name in INSIDE:
            out[f"sampled {k} inside: {name}"] = functools.partial(inside, p, name)
    return out


def recorded(thunk) -> tuple[dict, list, dict, dict]:
    """The thunk's outcome, its vma tape, CommMode's counts of the program's collectives, and
    of every collective by ProcessGroup method."""
    TAPE.clear()
    rt.PG_CALLS.clear()
    with ns.CommMode() as comms:
        got = rt.outcome(thunk)
    by_method: dict[str, int] = {}
    for e in comms.events:
        by_method[PG_METHOD[e.op]] = by_method.get(PG_METHOD[e.op], 0) + 1
    counts = {" ".join(map(str, key)): n for key, n in comms.counts().items()}
    return got, [list(t) for t in TAPE], counts, by_method


def compare(real: tuple, sim: tuple, pg_calls: dict, funcol: bool):
    """The differences of the real run from the simulated one. ``funcol``: the real run
    communicated with functional collectives (make_fx: linearize), not ProcessGroup methods."""
    (got, tape, counts, by_method), (want, sim_tape, sim_counts, _) = real, sim
    problems = rt.differences(got, want)
    if tape != sim_tape:
        at = next((i for i, (a, b) in enumerate(zip(tape, sim_tape)) if a != b), len(tape))
        problems.append(
            f"ns.vma differs at run {at} of {len(tape)}/{len(sim_tape)}: "
            f"real {tape[at : at + 1]}, simulated {sim_tape[at : at + 1]}"
        )
    if counts != sim_counts:
        problems.append(f"CommMode counts: real {counts}, simulated {sim_counts}")
    if not funcol and not _same_calls(by_method, pg_calls):
        problems.append(f"real CommMode {by_method}, ProcessGroup calls {pg_calls}")
    return problems


def _same_calls(ours: dict, theirs: dict) -> bool:
    """CommMode's events are the ProcessGroup's calls, except that a ppermute whose pairs all
    stay home (or a relayout over axes of size 1) is recorded and communicates nothing."""
    a2a = "all_to_all_single"
    if theirs.get(a2a, 0) > ours.get(a2a, 0):
        return False
    rest = {k: v for k, v in ours.items() if k != a2a}
    return rest == {k: v for k, v in theirs.items() if k != a2a}


#: Divergences found by this matrix and not fixed yet, by program kind: reported, not failed.
KNOWN = {}


def known(name: str) -> str | None:
    return KNOWN.get(name.split(" ", 2)[2])


def main() -> None:
    import torch.distributed as dist

    rt.count_process_group_calls()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    real_meshes: dict = {}

    def real(case):
        key = (case.sizes, case.names)
        if key not in real_meshes:
            real_meshes[key] = ns.make_mesh(case.sizes, case.names)
        return real_meshes[key]

    def sim(case):
        return ns.make_mesh(case.sizes, case.names, simulated=True)

    real_programs, sim_programs = programs(real, world), programs(sim, world)
    only = os.environ.get("SAMPLED_TRANSFORMS_ONLY")
    for name, program in real_programs.items():
        if only and only not in name:
            continue
        t0 = time.perf_counter()
        torch.manual_seed(0)
        got = recorded(program)
        pg_calls = dict(rt.PG_CALLS)
        seconds = time.perf_counter() - t0
        torch.manual_seed(0)
        want = recorded(sim_programs[name])
        problems = compare(got, want, pg_calls, funcol=name.endswith("over: linearize"))
        line = {"rank": rank, "name": name, "problems": problems, "known": known(name)}
        line["s"] = round(seconds, 3)
        print("OUTCOME " + json.dumps(line), flush=True)
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
