"""The simulated transform matrices, run on a real mesh: one launch per world size (2 or 4).

Every rank runs each program twice, on a real (gloo) mesh and on a simulated mesh of the same
shape, and compares the two: values, gradients, dtypes and shapes, or the same error. The programs
are imported, not copied:

* ``test_func_transforms``: its program ``spmd_f`` under every transform of ``OUTSIDE`` (plain
  and while a CommMode records), and every transform of ``INSIDE`` (its mapped functions are
  re-mapped onto each mesh, the lambdas look them up by module name at call time);
* ``test_levels_matrix``: every collective of ``CASES`` through every transform of ``OUTSIDE`` and
  of ``INSIDE``, each case moved to a mesh of this world (local blocks [2, 2]); its dense twin is
  replaced by the simulated run of the collective, which ``_inside`` then differentiates;
* ``transforms_over`` and ``transforms_inside`` (the mesh of "x", plus an unused axis "y" on 4).

The real mesh shapes: world 2 puts the size-2 axis where the programs communicate ("b", "c" and
"x"; "a" is size 1 there); world 4 is (2, 2) and (2, 1, 2). ``python tests/real_transforms.py``
under a job prints one ``OUTCOME {json}`` line per program and rank: ``{"rank", "name",
"problems"}`` (tests/test_real_transforms.py).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import sys
import time
import traceback

# the test modules create simulated meshes at import: before torch.distributed is up
import test_func_transforms as ft
import test_levels_matrix as lm
import torch
import transforms_inside as ti
import transforms_over as to
from _ragged import routing

import named_spmd as ns
from named_spmd import P

RTOL = ATOL = 1e-10

#: programs of transforms_over that need a one-axis mesh (they build DTensors with [Shard(0)])
ONE_AXIS_ONLY = {
    "grad_closed_over_dtensor",
    "vmap_closed_over_dtensor",
    "grad_of_transformed_dtensor",
    "compiled_dtensor_on_an_equal_mesh",
    "make_fx_of_dtensor",
    "exported_dtensor",
}

#: ppermute on an axis of size 2 (the matrix's own pairs need size 3)
LEVEL_CASES = {
    **lm.CASES,
    "ppermute size 2": dataclasses.replace(
        lm.CASES["ppermute"], collective=lambda o, x: o.ppermute(x, "b", [(0, 1)])
    ),
}


def shapes(world: int) -> dict[str, tuple[tuple[int, ...], tuple[str, ...]]]:
    """(mesh shape, axis names) of each matrix on ``world`` instances."""
    # test_func_transforms's program is written for (2, 2) (its c matches the output's shape);
    # the levels cases act on "b" and "c", so those get the size-2 axes of world 2
    if world == 2:
        return {
            "levels": ((1, 2), ("a", "b")),
            "levels3": ((1, 1, 2), ("a", "b", "c")),
            "x": ((2,), ("x",)),
        }
    return {
        "func": ((2, 2), ("a", "b")),
        "levels": ((2, 2), ("a", "b")),
        "levels3": ((2, 1, 2), ("a", "b", "c")),
        "x": ((2, 2), ("x", "y")),
    }


# --- outcomes ------------------------------------------------------------------------------------


def _flat(out) -> list:
    if isinstance(out, (tuple, list)):
        return [t for o in out for t in _flat(o)]
    return [out]


def _plain(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def outcome(thunk) -> dict:
    """``{"values": [tensor, ...]}`` or ``{"error": class, "message": text}``."""
    try:
        out = thunk()
    except Exception as e:  # noqa: BLE001 - compared with the other backend's outcome
        return {"error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    return {
        "values": [_plain(t).detach() if isinstance(t, torch.Tensor) else t for t in _flat(out)]
    }


def differences(real: dict, sim: dict) -> list[str]:
    if "error" in real or "error" in sim:
        if real.get("error") == sim.get("error") and real.get("message") == sim.get("message"):
            return []
        return [f"real: {_said(real)}; simulated: {_said(sim)}"]
    a, b = real["values"], sim["values"]
    if len(a) != len(b):
        return [f"{len(a)} results real, {len(b)} simulated"]
    problems = []
    for k, (x, y) in enumerate(zip(a, b)):
        if not isinstance(x, torch.Tensor) or not isinstance(y, torch.Tensor):
            if x != y:
                problems.append(f"result {k}: {x!r} vs {y!r}")
        elif (x.dtype, x.shape) != (y.dtype, y.shape):
            problems.append(f"result {k}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}")
        elif not torch.allclose(x, y, rtol=RTOL, atol=ATOL, equal_nan=True):
            problems.append(f"result {k}: max abs difference {(x - y).abs().max().item():.3g}")
    return problems


def refusal(real: dict, error: str) -> list[str]:
    """A program the real mesh refuses (the simulated mesh has no DTensor to refuse)."""
    if real.get("error") == error and "Fix:" in real["message"]:
        return []
    return [f"expected {error} with a fix; real: {_said(real)}"]


def _said(o: dict) -> str:
    if "error" not in o:
        return "values"
    return f"{o['error']}: {o['message'][:400]} {o.get('trace', '')[-1200:]}"


# --- test_func_transforms ------------------------------------------------------------------------


def _remapped(module, mesh) -> dict:
    """Every mapped function of ``module``, re-mapped onto ``mesh``."""
    return {
        k: ns.spmd_map(v.fn, mesh=mesh, in_specs=v.in_specs, out_specs=v.out_specs)
        for k, v in vars(module).items()
        if isinstance(v, type(ft.spmd_f))
    }


def _global(f):
    """``f`` with global plain outputs: the matrices compute with them (a real mesh returns
    DTensors outside a transform; ``full_tensor`` is differentiable, twice)."""
    return lambda *args: _plain(f(*args))


@contextlib.contextmanager
def _on(module, mapped: dict):
    saved = {k: getattr(module, k) for k in mapped}
    for k, v in mapped.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(module, k, v)


def func_transforms(mesh) -> dict:
    mapped = _remapped(ft, mesh)
    f = _global(mapped["spmd_f"])
    programs = {}
    for name, transform in ft.OUTSIDE.items():
        programs[f"func_transforms outside: {name}"] = functools.partial(transform, f)
        programs[f"func_transforms outside, recording: {name}"] = functools.partial(
            _recording, transform, f
        )
    for name, (run, _) in ft.INSIDE.items():
        programs[f"func_transforms inside: {name}"] = functools.partial(_inside_ft, run, mapped)
    return programs


def _recording(transform, f):
    with ns.CommMode():
        return transform(f)


def _inside_ft(run, mapped):
    with _on(ft, mapped):
        return run()


# --- test_levels_matrix --------------------------------------------------------------------------


def _moved(case: lm.Case, mesh, sim_mesh) -> lm.Case:
    """``case`` on ``mesh`` (local blocks [2, 2]); its dense twin is the simulated collective."""
    sizes = mesh.shape
    shape = tuple(2 * math.prod(sizes[a] for a in case.in_spec.entry_axes(d)) for d in range(2))
    col = functools.partial(case.collective, ns)
    twin = ns.spmd_map(col, mesh=sim_mesh, in_specs=case.in_spec, out_specs=case.out_spec)
    return dataclasses.replace(case, mesh=mesh, shape=shape, dense=twin)


def levels_matrix(mesh_of) -> dict:
    programs = {}
    for case_name, case in LEVEL_CASES.items():
        key = "levels3" if len(case.mesh.axis_names) == 3 else "levels"
        moved = _moved(case, mesh_of(key), mesh_of(key, simulated=True))
        for name, transform in lm.OUTSIDE.items():
            programs[f"levels outside: {case_name}: {name}"] = functools.partial(
                _outside_lm, moved, transform
            )
        for name in lm.INSIDE:
            programs[f"levels inside: {case_name}: {name}"] = functools.partial(
                _inside_lm, moved, name
            )
    return programs


_MAPPED = lm.mapped


def _global_mapped(*args, **kwargs):
    return _global(_MAPPED(*args, **kwargs))


def _outside_lm(case, transform):
    with _on(lm, {"mapped": _global_mapped}):
        spmd, _ = lm.programs(case)
        return transform(spmd, *lm.inputs(case))


def _inside_lm(case, name):
    # (this mesh's run, the simulated twin's): both are compared
    with _on(lm, {"mapped": _global_mapped}):
        return lm._inside(case, name)


# --- transforms_over / transforms_inside ----------------------------------------------------------


def over_and_inside(mesh) -> dict:
    programs = {}
    for name in to.PROGRAMS:
        if len(mesh.axis_names) == 1 or name not in ONE_AXIS_ONLY:
            programs[f"over: {name}"] = functools.partial(_over, name, mesh)
    for name, (fn, out_spec) in ti.PROGRAMS.items():
        f = ns.spmd_map(fn, mesh=mesh, in_specs=(P("x"), P()), out_specs=out_spec)
        programs[f"inside: {name}"] = functools.partial(f, *ti.arguments())
    programs["inside: backward of a jvp tangent"] = functools.partial(_backward_of_tangent, mesh)
    programs["over: forward_ad of a dual that requires grad"] = functools.partial(_dual_leaf, mesh)
    return programs


def _dual_leaf(mesh):
    """Forward-mode AD over the call of a tangent on a leaf that requires grad: ``make_dual``
    makes a view of the leaf whose tangent is the view's own, and the view's implicit pvary
    must keep it."""
    f = ns.spmd_map(
        lambda x, w: x[:, None] * w, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x")
    )
    with torch.autograd.forward_ad.dual_level():
        dual = torch.autograd.forward_ad.make_dual(to.W.clone().requires_grad_(), to.TW)
        primal, tangent = torch.autograd.forward_ad.unpack_dual(_plain(f(to.X, dual)))
        return primal.detach(), tangent


def _backward_of_tangent(mesh):
    """Reverse mode through a tangent that torch.func.jvp takes inside the call: the gradient
    psum of a pvary recorded under the jvp (``psum(...) * x.sum()``) runs in backward, where
    functorch's wrapper of the autograd.Function still holds the incoming gradient."""
    tangent = ns.spmd_map(
        lambda x, w: torch.func.jvp(
            lambda w: ns.psum(torch.sin(x * w), "x") * x.sum(), (w,), (w.cos(),)
        )[1],
        mesh=mesh,
        in_specs=(P("x"), P()),
        out_specs=P("x"),
    )
    x, w = to.X.clone().requires_grad_(), to.W.clone().requires_grad_()
    grads = []
    for _ in range(2):  # the typed call and its replay
        grads += torch.autograd.grad((_plain(tangent(x, w)) * to.W8).sum(), (x, w))
    return grads


def _over(name, mesh):
    return to.PROGRAMS[name](to.mapped(mesh))


# --- CommMode against torch's own count -------------------------------------------------------------

#: the ProcessGroup method that runs each logical collective here
PG_METHOD = {
    "psum": "allreduce",
    "pmean": "allreduce",
    "pmax": "allreduce",
    "pmin": "allreduce",
    "all_gather": "all_gather_single",
    "psum_scatter": "reduce_scatter_single",
    "all_to_all": "all_to_all_single",
    "pbroadcast": "broadcast",
    "ragged_all_to_all": "all_to_all_single",
}
PG_CALLS: dict[str, int] = {}


def count_process_group_calls() -> None:
    """Count every call of the ProcessGroup's collective methods (torch's own entry points, below
    anything of ours): patched before any mesh exists, since a Comm binds them when made."""
    from torch.distributed import ProcessGroup

    for name in set(PG_METHOD.values()):
        method = getattr(ProcessGroup, name)

        def counted(self, *args, _method=method, _name=name, **kwargs):
            PG_CALLS[_name] = PG_CALLS.get(_name, 0) + 1
            return _method(self, *args, **kwargs)

        setattr(ProcessGroup, name, counted)


def _comm_programs(mesh) -> dict:
    """Forward and backward of calls whose boundary communicates: plain-tensor inputs (the
    gradient all_gather of each split one), an output tiled over an axis it is invariant over,
    check_vma=False, a torch.func transform over the call (the output gathered forward), and
    DTensor inputs (nothing to gather), and a ragged_all_to_all (its metadata exchange's shape
    every backend's alike)."""
    f = to.mapped(mesh)
    loose = ns.spmd_map(lambda x: x * 2, mesh=mesh, in_specs=P("x"), out_specs=P(), check_vma=False)
    tiled = ns.spmd_map(lambda w: w * 2, mesh=mesh, in_specs=P(), out_specs=P("x"))
    x, w, xm, w1, w2 = (t.clone().requires_grad_() for t in (to.X, to.W, to.XM, to.W1, to.W2))
    programs = {
        "plain inputs": lambda: _loss(f["psum_prod"](x, w)),
        "plain inputs, megatron": lambda: _loss(f["megatron"](xm, w1, w2)),
        "tiled output": lambda: _loss(tiled(w)),
        "check_vma=False": lambda: _loss(loose(x)),
        "grad over the call": lambda: torch.func.grad(lambda x: f["gathered"](x, to.W8).sum())(x),
        "ragged_all_to_all": _ragged_program(mesh),
    }
    if len(mesh.axis_names) == 1 and mesh.device_mesh is not None:
        d = to.sharded(mesh, to.X).detach().requires_grad_()
        programs["DTensor input"] = lambda: _loss(f["psum_prod"](d, w))
    return programs | _derivative_programs(mesh)


def _ragged_program(mesh):
    """A ragged_all_to_all over ``"x"``, two slots per member, and its backward."""
    r = routing(mesh.axis_size("x"), 2, seed=3)
    rag = ns.spmd_map(
        lambda x, o, *meta: ns.ragged_all_to_all(x, o, *meta, "x"),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
    x = torch.arange(r.n * r.rows * 3, dtype=torch.float64).reshape(-1, 3).requires_grad_()
    out = torch.zeros(r.n * r.m, 3, dtype=torch.float64)
    return lambda: _loss(rag(x, out, *r.metadata()))


def _fans(x, w):
    """Fan-in and fan-out: one psum of an implicitly pvary'd ``w`` used twice, a pmax (its tie
    mask psum'd in backward and in forward mode), a gather to invariant, summed into one value."""
    s = ns.psum(x * w, "x")
    return s * ns.pmax(x.sin(), "x") + s.cos() + ns.all_gather(x * w, "x", to="invariant").sum(0)


def _derivative_programs(mesh) -> dict:
    """Forward-mode tangents (over and inside the call), double backward and forward over reverse
    of :func:`_fans`: CommMode's tangent and second-order events."""
    specs = dict(mesh=mesh, in_specs=(P("x"), P()), out_specs=P())
    fans = ns.spmd_map(_fans, **specs)
    inside = ns.spmd_map(
        lambda x, w: torch.func.jvp(lambda w: _fans(x, w), (w,), (w.cos(),))[1], **specs
    )
    jac = ns.spmd_map(lambda x, w: torch.func.jacfwd(lambda w: _fans(x, w).sum())(w), **specs)
    f = _global(fans)
    x, w, tx, tw = to.X, to.W, to.TX, to.TW

    def dual():
        with torch.autograd.forward_ad.dual_level():
            y = f(torch.autograd.forward_ad.make_dual(x, tx), w)
            return torch.autograd.forward_ad.unpack_dual(y).tangent

    def double():
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        gx, gw = torch.autograd.grad(f(xg, wg).pow(3).sum(), (xg, wg), create_graph=True)
        ns.set_grad_bucket_mb(0)  # one all-reduce per gradient psum: a ProcessGroup call each
        try:
            (gx.square().sum() + gw.square().sum()).backward()
        finally:
            ns.set_grad_bucket_mb(None)

    return {
        "jvp over the call": lambda: torch.func.jvp(f, (x, w), (tx, tw)),
        "forward_ad over the call": dual,
        "jvp inside": lambda: inside(x, w),
        "jacfwd inside": lambda: jac(x, w),
        "double backward": double,
        "hessian over the call": lambda: torch.func.hessian(lambda w: f(x, w).sum())(w),
    }


def _loss(y):
    """Backward from the local values: no DTensor communication of the test's own."""
    local = y.to_local() if hasattr(y, "to_local") else y
    local.sum().backward()


def comm_counts(mesh, sim_mesh) -> dict:
    """``{name: (CommMode's count, torch's, boundary events, the program's events, the
    simulated mesh's)}``: counts per ProcessGroup method, of the second run of each program
    (the first calibrates), and the program's own events (boundary ones left out) on both
    meshes."""
    out = {}
    simulated = _comm_programs(sim_mesh)
    for name, program in _comm_programs(mesh).items():
        program()
        PG_CALLS.clear()
        with ns.CommMode() as comms:
            program()
        ours: dict[str, int] = {}
        for e in comms.events:
            ours[PG_METHOD[e.op]] = ours.get(PG_METHOD[e.op], 0) + 1
        want = None
        if name in simulated:
            with ns.CommMode() as sim_comms:
                simulated[name]()
            want = _program_events(sim_comms)
        got = _program_events(comms) if want is not None else None
        out[name] = (ours, dict(PG_CALLS), comms.count(boundary=True), got, want)
    return out


def _program_events(comms) -> list:
    """The program's own CommMode events (no boundary ones), sorted: every backend's alike."""
    kept = [e for e in comms.events if not e.boundary]
    return sorted((e.direction, e.op, e.axes, e.shape, str(e.dtype), e.implicit) for e in kept)


def comm_problems(name: str, counts: tuple) -> list[str]:
    ours, theirs, boundary, events, simulated = counts
    problems = [] if ours == theirs else [f"{name}: CommMode {ours}, ProcessGroup {theirs}"]
    if events != simulated:
        problems.append(f"{name}: CommMode events, real {events}, simulated {simulated}")
    if name not in ("DTensor input", "tiled output") and boundary == 0:  # (the tiled output's
        # backward psum is a program event: every backend records it)
        problems.append(f"{name}: no boundary collective recorded")
    return problems


# --- an error of the user's own torch code -------------------------------------------------------


def _matmul_shapes(x, w):
    return x @ w  # [2, 3] @ [4, 2]: a shape error in the user's code


def _index_past_the_block(x, w):
    return x[3] * w  # the block has 2 rows (of 8 over 4 instances; 4 over 2)


USER_ERRORS = {
    "matmul shapes": (_matmul_shapes, (P("x"), P()), (torch.ones(8, 3), torch.ones(4, 2))),
    "index": (_index_past_the_block, (P("x"), P()), (torch.ones(8 // 2, 3), torch.ones(3))),
}


def user_error_problems(mesh_of, rank: int) -> dict[str, list[str]]:
    """Each program of ``USER_ERRORS`` raises the same SpmdError class on a real and a
    simulated mesh; the real one names the function, the user's line and this rank's mesh
    coordinates (the simulated one names the instances that raise)."""
    out = {}
    for name, (fn, in_specs, args) in USER_ERRORS.items():
        errors = []
        for mesh in (mesh_of("x"), mesh_of("x", simulated=True)):
            f = ns.spmd_map(fn, mesh=mesh, in_specs=in_specs, out_specs=P("x"))
            try:
                f(*args)
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - compared below
                errors.append(e)
        real, sim = errors
        line = fn.__code__.co_firstlineno + 1
        coords = ", ".join(f"{a}={c}" for a, c in mesh_of("x").my_coords.items())
        want = [
            f"`{fn.__name__}`",
            f"real_transforms.py:{line}",
            f"rank {rank} (instance {coords})",
        ]
        problems = []
        if type(real) is not type(sim) or not isinstance(real, ns.SpmdError):
            problems.append(f"real {type(real).__name__}: {real}; simulated {type(sim).__name__}")
        else:
            problems += [
                f"real error does not name {w}: {real}" for w in want if w not in str(real)
            ]
        out[name] = problems
    return out


# --- the launch ----------------------------------------------------------------------------------


def all_programs(mesh_of) -> dict:
    func = func_transforms(mesh_of("func")) if "func" in shapes(_world()) else {}
    return {
        **func,
        **levels_matrix(mesh_of),
        **over_and_inside(mesh_of("x")),
    }


def _world() -> int:
    return int(os.environ["WORLD_SIZE"])


def main() -> None:
    import torch.distributed as dist

    count_process_group_calls()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meshes = shapes(world)
    real_meshes = {key: ns.make_mesh(*meshes[key]) for key in sorted(meshes)}

    def real(key, simulated=False):
        return ns.make_mesh(*meshes[key], simulated=True) if simulated else real_meshes[key]

    def sim(key, simulated=True):
        return ns.make_mesh(*meshes[key], simulated=True)

    real_programs, sim_programs = all_programs(real), all_programs(sim)
    only = os.environ.get("REAL_TRANSFORMS_ONLY")
    for name, program in real_programs.items():
        if only and only not in name:
            continue
        t0 = time.perf_counter()
        torch.manual_seed(0)
        got = outcome(program)
        seconds = time.perf_counter() - t0
        torch.manual_seed(0)
        want = outcome(sim_programs[name])
        refused = to.REAL_MESH_ERRORS.get(name.removeprefix("over: "))
        problems = refusal(got, refused) if refused else differences(got, want)
        line = {"rank": rank, "name": name, "problems": problems, "s": seconds}
        print("OUTCOME " + json.dumps(line), flush=True)
    if not only or only in "comm count":
        for name, counts in comm_counts(real("x"), sim("x")).items():
            line = {
                "rank": rank,
                "name": f"comm count: {name}",
                "problems": comm_problems(name, counts),
            }
            print("OUTCOME " + json.dumps(line), flush=True)
    if not only or only in "user error":
        for name, problems in user_error_problems(real, rank).items():
            line = {"rank": rank, "name": f"user error: {name}", "problems": problems}
            print("OUTCOME " + json.dumps(line), flush=True)
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
