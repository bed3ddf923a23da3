"""One rank of the multi-process tests: run as ``python tests/dist_worker.py MODE`` by every rank,
with RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT in the environment (tests/test_distributed.py
spawns the processes; ``torchrun`` works too).

Modes:
* ``programs``: every catalogue program of this world on the real mesh (saved for
  test_programs.py), then every sampled case of :mod:`programs_dist` on the simulated mesh and on
  the real one, in this process; values, gradients (every float input), taps (per-device types)
  and communication counts (``ns.CommMode``, forward and backward) must agree. Prints one
  ``RESULT {json}`` line per case.
* ``fail RANK``: rank RANK raises inside the mapped function; every other rank must raise
  RankFailedError naming it. Prints ``OUTCOME {json}``.
* ``mismatch``: with debug mode on, rank 0 calls psum with another shape than the others; every
  rank must raise SpmdError listing the calls. Prints ``OUTCOME {json}``.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import sys
import time
import traceback

import optree
import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import programs_dist as pd  # noqa: E402
from _dist_parity import parity_checks  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402

TOL = dict(rtol=1e-9, atol=1e-10)


def _is_float(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def _global(t):
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def _to_dtensors(mesh, args, in_specs):
    """The global arguments as DTensors on the real mesh, placed as their in_specs say."""
    from _reference import broadcast_specs, tree_leaves
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    leaves, tree = optree.tree_flatten(args, none_is_leaf=True)
    specs = tree_leaves(broadcast_specs(in_specs, args))
    out = []
    for x, spec in zip(leaves, specs):
        if not isinstance(x, torch.Tensor):  # a Python float argument stays one
            out.append(x)
            continue
        placements = [Replicate() for _ in mesh.axis_names]
        for d in range(x.dim()):
            for a in spec.entry_axes(d):
                placements[mesh.axis_names.index(a)] = Shard(d)
        out.append(distribute_tensor(x, mesh.device_mesh, placements))
    return optree.tree_unflatten(tree, out)


def _randn(shape, seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def evaluate(case, mesh, dtensor=False):
    """Forward and backward of ``case`` on ``mesh``: global outputs, input gradients, taps and
    communication counts."""
    args = optree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, case.args())
    if dtensor:
        args = _to_dtensors(mesh, args, case.in_specs)
    leaves = [t for t in optree.tree_leaves(args) if _is_float(t)]
    for t in leaves:
        t.requires_grad_()
    f = ns.spmd_map(case.prog, mesh=mesh, in_specs=case.in_specs, out_specs=case.out_specs)
    pd.TAPE.clear()
    with ns.CommMode() as comms:
        out = f(*args)
        tape = list(pd.TAPE)
        forward = comms.counts()
        outs = [_global(o) for o in optree.tree_leaves(out) if isinstance(o, torch.Tensor)]
        loss = sum(
            (o * _randn(o.shape, seed=100 + k)).sum()
            for k, o in enumerate(outs)
            if o.is_floating_point() and o.requires_grad
        )
        if isinstance(loss, torch.Tensor):
            loss.backward()
    grads = [
        _global(t.grad) if t.grad is not None else torch.zeros(t.shape, dtype=t.dtype)
        for t in leaves
    ]
    return {
        "out": [o.detach() for o in outs],
        "grads": grads,
        "tape": tape,
        "forward": forward,
        "all": comms.counts(),
    }


def compare(sim, real) -> list[str]:
    problems = []
    if len(sim["out"]) != len(real["out"]):
        return [f"{len(sim['out'])} outputs simulated, {len(real['out'])} real"]
    for what in ("out", "grads"):
        for k, (a, b) in enumerate(zip(sim[what], real[what])):
            if a.shape != b.shape or not torch.allclose(a.to(b.dtype), b, **TOL):
                err = (a - b).abs().max().item() if a.shape == b.shape else "shape"
                problems.append(
                    f"{what}[{k}] differs: {list(a.shape)} vs {list(b.shape)}, max err {err}"
                )
    if sim["tape"] != real["tape"]:
        problems.append(f"types differ: {sim['tape']} vs {real['tape']}")
    if sim["all"] != real["all"]:
        problems.append(f"communication differs: {sim['all']} vs {real['all']}")
    return problems


def run_catalogue(args, rank, world) -> None:
    """Every catalogue program of this world on the real mesh (and with DTensor inputs where the
    program asks): each rank saves its runs to ``args.out/rank{rank}.pt`` for the tests."""
    import _backends
    from _programs import CATALOGUE

    runs = {}
    meshes = {}
    for program in CATALOGUE:
        if program.world != world or not program.distributed:
            continue
        key = (program.sizes, program.names)
        if key not in meshes:  # creating a real mesh is collective: same order everywhere
            meshes[key] = ns.make_mesh(program.sizes, program.names, device_type=args.device)
        entry = {}
        try:
            entry["run"] = _backends.evaluate(program, meshes[key])
            entry["replayed"] = _backends.evaluate(program, meshes[key], replayed=True)
            if program.dtensor_inputs:
                dargs = _to_dtensors(meshes[key], program.args(), program.in_specs)
                entry["dtensor"] = _backends.evaluate(program, meshes[key], dargs)
        except Exception:  # noqa: BLE001 - reported by the test of this program
            entry["error"] = traceback.format_exc()[-3000:]
        runs[program.name] = entry
    if args.out:
        torch.save(runs, os.path.join(args.out, f"rank{rank}.pt"))


def run_programs(args, rank, world) -> None:
    run_catalogue(args, rank, world)
    cases = pd.sampled_cases(world, args.samples, args.seed)
    real_meshes, sim_meshes = {}, {}
    for case in cases:
        key = (case.sizes, case.names)
        if key not in real_meshes:  # creating a real mesh is collective: same order everywhere
            real_meshes[key] = ns.make_mesh(case.sizes, case.names, device_type=args.device)
            sim_meshes[key] = ns.make_mesh(case.sizes, case.names, simulated=True)
        t0 = time.perf_counter()
        result = {"case": case.name, "rank": rank}
        try:
            sim = evaluate(case, sim_meshes[key])
            real = evaluate(case, real_meshes[key])
            problems = compare(sim, real)
            if case.dtensor_inputs:
                problems += [
                    f"DTensor inputs: {p}"
                    for p in compare(sim, evaluate(case, real_meshes[key], True))
                ]
            result["problems"] = problems
            result["nonzero_grads"] = sum(bool(g.abs().max() > 0) for g in real["grads"])
        except Exception as e:  # noqa: BLE001 - reported per case; the next case goes on
            result["problems"] = [f"raised {type(e).__name__}: {e}"]
            result["traceback"] = traceback.format_exc()[-2000:]
        result["seconds"] = round(time.perf_counter() - t0, 3)
        print("RESULT " + json.dumps(result), flush=True)
    run_checks(args, rank, world)


def _expect_error(name: str, call, error: type, *fragments: str) -> dict:
    try:
        call()
    except error as e:
        missing = [f for f in fragments if f not in str(e)]
        return {"check": name, "problems": [f"message lacks {missing}: {e}"] if missing else []}
    except Exception as e:  # noqa: BLE001 - reported
        return {"check": name, "problems": [f"raised {type(e).__name__}: {e}"]}
    return {"check": name, "problems": [f"did not raise {error.__name__}"]}


def run_checks(args, rank, world) -> None:
    """User-facing behaviour beyond the programs: errors, a user's DeviceMesh, local outputs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from named_spmd.backends.distributed import to_local

    results = []
    results.append(
        _expect_error(
            "world size mismatch",
            lambda: ns.make_mesh((world + 1,), ("i",)),
            ns.SpmdError,
            f"process group has {world} ranks",
            "torchrun --nproc-per-node",
        )
    )
    mesh = ns.make_mesh((2, world // 2), ("dp", "tp"), device_type=args.device)
    wrong = distribute_tensor(torch.ones(4, world), mesh.device_mesh, [Replicate(), Shard(0)])
    f = ns.spmd_map(lambda x: ns.psum(x, "tp"), mesh=mesh, in_specs=P(None, "tp"), out_specs=P())
    results.append(
        _expect_error(
            "DTensor placements differ from in_spec",
            lambda: f(wrong),
            ns.SpecError,
            "placements (Replicate(), Shard(dim=0))",
            "means placements (Replicate(), Shard(dim=1))",
            "redistribute",
        )
    )
    dm = init_device_mesh(args.device, (2, world // 2), mesh_dim_names=("x", "y"))
    g = ns.spmd_map(
        lambda v: ns.psum(v, ("y", "x")), mesh=dm, in_specs=P(("x", "y")), out_specs=P()
    )
    got = g(torch.arange(float(world))).full_tensor()
    results.append(
        {
            "check": "user DeviceMesh as mesh=",
            "problems": [] if got.item() == world * (world - 1) / 2 else [f"got {got}"],
        }
    )
    # one mesh per DeviceMesh (one registry): passed again, or make_mesh's own, no new groups
    again = ns.spmd_map(lambda v: v, mesh=dm, in_specs=P(), out_specs=P()).mesh
    own = ns.spmd_map(lambda v: v, mesh=mesh.device_mesh, in_specs=P(), out_specs=P()).mesh
    results.append(
        {
            "check": "a DeviceMesh is one mesh",
            "problems": [
                f"{what} made a second mesh"
                for what, made, first in (("dm", again, g.mesh), ("mesh.device_mesh", own, mesh))
                if made is not first
            ],
        }
    )
    nameless = init_device_mesh(args.device, (world,))
    results.append(
        _expect_error(
            "DeviceMesh without names",
            lambda: ns.spmd_map(lambda v: v, mesh=nameless, in_specs=P(), out_specs=P()),
            ns.SpmdError,
            "mesh_dim_names",
        )
    )
    h = ns.spmd_map(lambda v: v * 2, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))
    out = to_local(h(torch.arange(4.0 * world).reshape(4, world)))
    coords = mesh.my_coords
    want = (
        torch.arange(4.0 * world).reshape(4, world)[
            2 * coords["dp"] : 2 * coords["dp"] + 2, 2 * coords["tp"] : 2 * coords["tp"] + 2
        ]
        * 2
    )
    results.append(
        {
            "check": "to_local gives this rank's block",
            "problems": []
            if type(out) is torch.Tensor and torch.equal(out, want)
            else [f"got {out!r}"],
        }
    )
    results += _overlapped_gradient_checks(mesh, world)
    results += _ragged_checks(mesh, world)
    results += _cast_alias_checks(mesh)
    results.append(_deep_copies(mesh, world))
    results += parity_checks(mesh, world)
    results.append(_masked_writes(mesh, world))
    results.append(_written_between_uses(mesh, world))
    results.append(_collective_results_written(mesh, world))
    results.append(_cast_results_written(mesh, world))
    results.append(_hooked_view_of_a_parameter(mesh, world))
    results.append(_gradients_through_outputs(mesh, world))
    results.append(_second_derivatives_at_the_boundary(mesh))
    reentrant = ns.spmd_map(
        lambda x, w: ns.psum(
            checkpoint(lambda a, w: torch.sin(a * w), x, w, use_reentrant=True), ("dp", "tp")
        ),
        mesh=mesh,
        in_specs=(P(("dp", "tp")), P()),
        out_specs=P(),
    )
    results.append(  # (its recomputation would miss w's gradient psum: a wrong gradient)
        _expect_error(
            "reentrant checkpoint",
            lambda: reentrant(torch.ones(world, requires_grad=True), torch.ones(1)),
            ns.SpmdError,
            "use_reentrant=True) cannot run inside spmd_map",
            "Fix: pass use_reentrant=False",
        )
    )
    for r in results:
        print("CHECK " + json.dumps({**r, "rank": rank}), flush=True)


def _hooked_view_of_a_parameter(mesh, world) -> dict:
    """A hook on a view of a parameter (made outside the call, used inside through a chain of
    views) sees the view's summed gradient: the view is pvary'd as itself, not at the parameter
    (which would leave the view's node, and its hook, out of the backward pass); a hook that
    returns nothing leaves the parameter a plain ``.grad`` all the same."""
    from named_spmd.backends.distributed import to_local

    axes = tuple(mesh.axis_names)
    w = torch.linspace(-1.0, 1.0, 6, dtype=torch.float64).reshape(2, 3).requires_grad_()
    dense = w.detach().clone().requires_grad_()
    x = torch.arange(6.0 * world, dtype=torch.float64).reshape(2 * world, 3)
    problems = []
    for hook in (lambda g: g * 3, lambda g: None):
        w.grad = dense.grad = None
        for param in (w, dense):
            view = param.t()
            view.register_hook(hook)
            if param is w:
                f = ns.spmd_map(
                    lambda x: ns.psum((x @ view.t().t()).sum(), axes),
                    mesh=mesh,
                    in_specs=P(axes),
                    out_specs=P(),
                )
                to_local(f(x)).backward()
            else:
                (x @ view).sum().backward()
        if not torch.allclose(w.grad, dense.grad) or type(w.grad) is not torch.Tensor:
            problems.append(f"{type(w.grad).__name__} {w.grad} != dense {dense.grad}")
    return {"check": "a hook on a view of a parameter", "problems": problems}


def written_between_uses(x, w, s):
    """``s`` (invariant) meets the varying ``x`` (an implicit cast to varying), is written in
    place, and meets it again."""
    h = x * s
    s.add_(1)
    return h + x * w * s


def _written_between_uses(mesh, world) -> dict:
    """``written_between_uses``, ``s`` requiring grad: its second use casts it again (the
    first cast, a view of ``s`` that a custom Function made, is refused by autograd once ``s``
    is written): the values and gradients of dense torch, with and without a ``CommMode``
    (test_review_regressions.py checks the simulated mesh)."""
    from named_spmd.backends.distributed import to_local

    f = ns.spmd_map(
        written_between_uses,
        mesh=mesh,
        in_specs=(P(("dp", "tp")), P(), P()),
        out_specs=P(("dp", "tp")),
    )
    x = torch.arange(2.0 * world).reshape(world, 2)
    problems = []
    for recorded in (False, True):
        w, s0 = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        w_ref, s0_ref = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
        want = written_between_uses(x, w_ref, s0_ref * 1)
        want.sum().backward()
        try:
            with ns.CommMode() if recorded else contextlib.nullcontext():
                y = f(x, w, s0 * 1)
                to_local(y).sum().backward()
            got = y.full_tensor()
        except Exception as e:  # noqa: BLE001 - what it raised is the outcome
            problems.append(f"CommMode {recorded}: raised {type(e).__name__}: {e}")
            continue
        for name, a, b in (
            ("value", got, want),
            ("w", w.grad, w_ref.grad),
            ("s", s0.grad, s0_ref.grad),
        ):
            if not torch.allclose(a, b):
                problems.append(f"CommMode {recorded}: {name} {a} != {b}")
    return {"check": "an input written between two uses", "problems": problems}


def collective_results_written(x):
    """Writes into the results of collectives (their own memory, as a plain op's result)."""
    y = ns.psum_scatter(x * 1, ("dp", "tp"), tiled=True)
    y.mul_(2)
    z = ns.all_to_all(x * 1, ("dp", "tp"), 0, 0, tiled=True)
    z[0].add_(1)
    g = ns.all_gather(x * 1, ("dp", "tp"), tiled=True, to="invariant")
    g.mul_(3)
    m = ns.pmax(x, ("dp", "tp"))  # (its backward reads its result: the write must not reach it)
    m.add_(1)
    n = ns.pmin(x.cos(), ("dp", "tp"))
    n.mul_(2)
    return y, z, g, m, n


def _collective_results_written(mesh, world) -> dict:
    """``collective_results_written``: the values and gradients of the simulated mesh (a real
    mesh's results of collectives are views of their receive buffers, which autograd refuses
    to write into as a custom Function's views: each is handed back as memory of its own;
    test_per_instance.py checks the simulated executions)."""
    from named_spmd.backends.distributed import to_local

    specs = dict(in_specs=P(("dp", "tp")), out_specs=(P(("dp", "tp")),) * 2 + (P(),) * 3)
    real = ns.spmd_map(collective_results_written, mesh=mesh, **specs)
    simulated = ns.make_mesh(tuple(mesh.shape.values()), mesh.axis_names, simulated=True)
    sim = ns.spmd_map(collective_results_written, mesh=simulated, **specs)
    x = torch.arange(4.0 * world * world).reshape(2 * world * world, 2) / 7
    problems = []
    xs, xr = x.clone().requires_grad_(), x.clone().requires_grad_()
    want = sim(xs)
    sum(t.pow(2).sum() for t in want).backward()
    try:
        got = real(xr)
        sum(to_local(t).pow(2).sum() for t in got).backward()
    except Exception as e:  # noqa: BLE001 - what it raised is the outcome
        return {"check": "writes into collectives' results", "problems": [f"raised {e}"]}
    for i, (a, b) in enumerate(zip(got, want)):
        if not torch.allclose(_global(a), b):
            problems.append(f"output {i}: {_global(a)} != {b}")
    if not torch.allclose(xr.grad, xs.grad):
        problems.append(f"gradient {xr.grad} != {xs.grad}")
    return {"check": "writes into collectives' results", "problems": problems}


def cast_results_written(x):
    """Writes into the results of the casts between varying and unreduced (views of their
    operands, as a plain op's view)."""
    c = x * 1
    u = ns.pcast(c, ("dp", "tp"), to="unreduced")
    u.mul_(2)
    v = ns.pcast(ns.pcast(x * 1, ("dp", "tp"), to="unreduced"), ("dp", "tp"), to="varying")
    v.add_(1)
    return ns.psum(u, ("dp", "tp")), c, v


def _cast_results_written(mesh, world) -> dict:
    """``cast_results_written``: the values and gradients of the simulated mesh, first and
    replayed calls (autograd refused a write into the cast's result when it was the view output
    of the bridge's Function; test_per_instance.py checks the simulated mesh against dense)."""
    from named_spmd.backends.distributed import to_local

    specs = dict(in_specs=P(("dp", "tp")), out_specs=(P(), P(("dp", "tp")), P(("dp", "tp"))))
    real = ns.spmd_map(cast_results_written, mesh=mesh, **specs)
    simulated = ns.make_mesh(tuple(mesh.shape.values()), mesh.axis_names, simulated=True)
    sim = ns.spmd_map(cast_results_written, mesh=simulated, **specs)
    x = torch.arange(2.0 * world * 3).reshape(2 * world, 3) / 7
    problems = []
    for grad in (False, True, True):  # (the second call with gradients: a replayed one)
        xs, xr = x.clone().requires_grad_(grad), x.clone().requires_grad_(grad)
        want = sim(xs)
        try:
            got = real(xr)
            if grad:
                sum(t.pow(2).sum() for t in want).backward()
                sum(to_local(t).pow(2).sum() for t in got).backward()
        except Exception as e:  # noqa: BLE001 - what it raised is the outcome
            problems.append(f"requires_grad={grad}: raised {type(e).__name__}: {e}"[:300])
            continue
        for i, (a, b) in enumerate(zip(got, want)):
            if not torch.allclose(_global(a), b):
                problems.append(f"requires_grad={grad}, output {i}: {_global(a)} != {b}")
        if grad and not torch.allclose(xr.grad, xs.grad):
            problems.append(f"gradient {xr.grad} != {xs.grad}")
    return {"check": "writes into casts' results", "problems": problems}


def deep_copies(x):
    y = copy.deepcopy(x)  # the rank's own copy: the write below leaves x as it was
    y.mul_(2)
    tree = copy.deepcopy({"x": x, "twice": [y]})
    return tree["x"] + tree["twice"][0] + copy.deepcopy(ns.psum(x, ("dp", "tp")))


def _deep_copies(mesh, world) -> dict:
    """``deep_copies`` (copy.deepcopy of blocks, of a tree of them, of a psum): the dense
    program's values and the simulated mesh's (its vmap's batched tensors had no storage for
    torch to copy)."""
    specs = dict(in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))
    simulated = ns.make_mesh(tuple(mesh.shape.values()), mesh.axis_names, simulated=True)
    x = torch.arange(2.0 * world * 3).reshape(2 * world, 3)
    want = 3 * x + x.reshape(world, 2, 3).sum(0).repeat(world, 1)
    problems = []
    for name, m in (("real", mesh), ("simulated", simulated)):
        try:
            got = _global(ns.spmd_map(deep_copies, mesh=m, **specs)(x))
        except Exception as e:  # noqa: BLE001 - what it raised is the outcome
            problems.append(f"{name} raised {type(e).__name__}: {e}")
            continue
        if not torch.equal(got, want):
            problems.append(f"{name}: {got} != {want}")
    return {"check": "copy.deepcopy inside the function", "problems": problems}


def masked_writes(x, w):
    y = x * w
    y[y > 0] = w.sum()  # a 0-d value: masked_fill_ on the simulated mesh, index_put_ here
    y[x[:, 0] < 0] = w  # a row per True position
    return y


def _masked_writes(mesh, world) -> dict:
    """``masked_writes``: the real mesh's values and w gradient are the simulated mesh's."""
    from named_spmd.backends.distributed import to_local

    specs = dict(in_specs=(P(("dp", "tp")), P()), out_specs=P(("dp", "tp")))
    simulated = ns.make_mesh(tuple(mesh.shape.values()), mesh.axis_names, simulated=True)
    x = torch.linspace(-1.0, 1.0, 2 * world * 3).reshape(2 * world, 3).sin()
    outcomes = []
    for m in (mesh, simulated):
        w = torch.tensor([0.5, -1.5, 2.0], requires_grad=True)
        y = ns.spmd_map(masked_writes, mesh=m, **specs)(x, w)
        (to_local(y) if m is mesh else y).sum().backward()  # each rank's blocks, or all
        outcomes.append((_global(y).detach(), w.grad))
    (got, got_grad), (want, want_grad) = outcomes
    problems = [] if torch.allclose(got, want) else [f"values {got} != {want}"]
    if not torch.allclose(got_grad, want_grad):
        problems.append(f"w.grad {got_grad} != {want_grad}")
    return {"check": "writes through boolean masks", "problems": problems}


def _cast_alias_checks(mesh) -> list[dict]:
    """A write into a pvary's result (the identity: a view of its operand's memory), or into a
    view of it, would change the replicated operand on one rank only: a VmaError, as the
    simulated mesh refuses it; the operand (an input, a closed-over tensor) is left unchanged.
    An all_gather to varying (one value over its axes) is refused alike, leaf by leaf or fused."""
    closed = torch.zeros(2)
    writes = {
        "add_": lambda x, w: ns.pvary(w, "dp").add_(x),
        "setitem": lambda x, w: ns.pcast(w, "dp", to="varying").__setitem__(0, x[0]),
        "closed-over view": lambda x, w: ns.pvary(closed, "dp")[1:].fill_(1.0),
        # no view's base: found by storage
        "detached": lambda x, w: ns.pvary(w, "dp").detach().add_(x),
        "data": lambda x, w: ns.pvary(w, "dp").data.add_(x),
        # one value over "dp", typed varying: refused as the simulated mesh's one memory is
        "all_gather": lambda x, w: ns.all_gather(x, "dp", tiled=True)[1:].add_(1.0),
        "all_gather of a pytree": lambda x, w: ns.all_gather((x, x * 2), "dp")[1].mul_(2.0),
    }
    results = []
    for name, write in writes.items():
        w = torch.zeros(2)
        f = ns.spmd_map(write, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
        r = _expect_error(
            f"write into a pvary's view: {name}",
            lambda f=f, w=w: f(torch.arange(4.0), w),
            ns.VmaError,
            "shares its operand's memory",
            ".clone()",
        )
        if w.any() or closed.any():
            r["problems"].append(f"the operand changed: {w}, {closed}")
        results.append(r)
    copy = ns.spmd_map(
        lambda x, w: ns.pvary(w, "dp").clone().add_(x),
        mesh=mesh,
        in_specs=(P("dp"), P()),
        out_specs=P("dp"),
    )
    got = copy(torch.arange(4.0), torch.ones(2)).full_tensor()
    want = torch.arange(4.0) + 1
    results.append(
        {"check": "a copy of a pvary's result takes the write", "problems": []}
        if torch.equal(got, want)
        else {"check": "a copy of a pvary's result takes the write", "problems": [f"{got}"]}
    )
    # a write into a tensor without a storage to compare (sparse) beside a cast: it runs
    sparse = ns.spmd_map(
        lambda x, w: (
            ns.pvary(w, "dp")
            + x
            + torch.eye(2, device=x.device).to_sparse().mul_(2.0).to_dense()[0]
        ),
        mesh=mesh,
        in_specs=(P("dp"), P()),
        out_specs=P("dp"),
    )
    try:
        got = sparse(torch.arange(4.0), torch.ones(2)).full_tensor()
        problems = (
            []
            if torch.equal(got, torch.arange(4.0) + 1 + torch.tensor([2.0, 0.0] * 2))
            else [f"{got}"]
        )
    except Exception as e:  # noqa: BLE001 - what it raised is the outcome
        problems = [f"raised {type(e).__name__}: {e}"]
    results.append({"check": "a sparse write beside a pvary runs", "problems": problems})
    return results


def _ragged_checks(mesh, world) -> list[dict]:
    """ragged_all_to_all over the whole mesh, members in ("tp", "dp") order (not the ranks':
    the rows are reordered around the all_to_all_single), offsets and sizes per member from
    tests/_ragged.py; and a round trip of all_to_all with split sizes over "tp" (blocks of
    different sizes in between: per instance on both meshes): values, gradients and
    communication equal to the simulated mesh's; the ragged call's too with torch filling the
    memory of new tensors (its forward leaves rows no peer wrote unset)."""
    from _ragged import routing, split_counts

    sim = ns.make_mesh((2, world // 2), ("dp", "tp"), simulated=True)
    r = routing(world, 1, seed=world)
    spec = P(("dp", "tp"))

    def ragged(x, out, *meta):
        return ns.ragged_all_to_all(x, out, *meta, ("tp", "dp"))

    half = world // 2
    member = [(b % half) * 2 + b // half for b in range(world)]  # of block b = dp * half + tp

    def ragged_args():
        meta = [torch.cat([m.split(r.k)[member[b]] for b in range(world)]) for m in r.metadata()]
        return (_randn((world * r.rows, 3), 1), _randn((world * r.m, 3), 2), *meta)

    counts, n = split_counts(world // 2), world // 2

    def round_trip(x):
        i = int(ns.axis_index("tp"))
        y = ns.all_to_all(x, "tp", 0, 0, tiled=True, split_sizes=counts[i])
        y = y * torch.arange(1.0, y.shape[0] + 1, dtype=y.dtype).unsqueeze(1)
        back = [counts[j][i] for j in range(n)]
        return ns.all_to_all(y, "tp", 0, 0, tiled=True, split_sizes=back)

    out = []
    for name, prog, make, per_instance in (
        ("ragged_all_to_all", ragged, ragged_args, False),
        ("all_to_all with split sizes", round_trip, lambda: (_randn((world * 8, 3), 3),), True),
    ):
        case = pd.Case(name, (2, world // 2), ("dp", "tp"), spec, spec, prog, make)
        try:
            with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
                problems = compare(evaluate(case, sim), evaluate(case, mesh))
        except Exception as e:  # noqa: BLE001 - reported
            problems = [f"raised {type(e).__name__}: {e}", traceback.format_exc()[-1500:]]
        out.append({"check": f"real {name} as simulated", "problems": problems})
    # the real mesh's forward leaves the result's unwritten rows unset (the mask keeps them
    # out): with torch filling such memory (NaN), values and gradients must not change
    case = pd.Case(
        "ragged_all_to_all", (2, world // 2), ("dp", "tp"), spec, spec, ragged, ragged_args
    )
    with _uninitialized_memory_filled():
        problems = compare(evaluate(case, sim), evaluate(case, mesh))
    out.append({"check": "real ragged_all_to_all with empty memory filled", "problems": problems})
    return out + [_ragged_batched_metadata(mesh, sim, r)]


@contextlib.contextmanager
def _uninitialized_memory_filled():
    """torch fills a new tensor's memory (floats with NaN, ints with their largest value) while
    deterministic algorithms are on and ``fill_uninitialized_memory`` is set: a result that
    reads memory no op wrote shows it."""
    flags = torch.utils.deterministic
    before = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        flags.fill_uninitialized_memory,
    )
    torch.use_deterministic_algorithms(True)
    flags.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])
        flags.fill_uninitialized_memory = before[2]


def ragged_of_batched_metadata(x, out, in_off, send, out_off, recv):
    """A torch.func.vmap inside the function that batches the sizes (the second element sends
    nothing): each element would send by its own sizes."""
    sends, recvs = torch.stack([send, send * 0]), torch.stack([recv, recv * 0])
    return torch.func.vmap(
        lambda v, s, r: ns.ragged_all_to_all(v, out, in_off, s, out_off, r, ("dp", "tp"))
    )(torch.stack([x, 2 * x]), sends, recvs)


def _ragged_batched_metadata(mesh, sim, r) -> dict:
    """``ragged_of_batched_metadata``: one CollectiveError on both meshes, before the real mesh
    reads the sizes (a bare "Cannot access data pointer" there; the simulated mesh sent it)."""
    world = mesh.size
    specs = dict(in_specs=P(("dp", "tp")), out_specs=P(None, ("dp", "tp")))
    args = (_randn((world * r.rows, 3), 1), _randn((world * r.m, 3), 2), *r.metadata())
    told = []
    for m in (mesh, sim):
        try:
            ns.spmd_map(ragged_of_batched_metadata, mesh=m, **specs)(*args)
            told.append("no error")
        except ns.SpmdError as e:
            told.append(f"{type(e).__name__}: {e}")
    problems = [] if told[0] == told[1] and "the vmap batches" in told[0] else [str(told)]
    return {"check": "ragged_all_to_all of sizes a vmap inside batches", "problems": problems}


def _overlapped_gradient_checks(mesh, world) -> list[dict]:
    """The gradient psum of a replicated weight runs overlapped with the rest of the backward:
    a second contribution to the same gradient (an op outside spmd_map, before or after the
    call) and accumulation over two backward passes must still see the finished sum."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from named_spmd.backends.distributed import to_local

    x = torch.arange(4.0 * world).reshape(world, 4)
    scale = ns.spmd_map(
        lambda v, w: v * w, mesh=mesh, in_specs=(P(("dp", "tp")), P()), out_specs=P(("dp", "tp"))
    )
    results = []
    for outside_first in (True, False):
        w = distribute_tensor(torch.linspace(-1.0, 1.0, 4), mesh.device_mesh, [Replicate()] * 2)
        w.requires_grad_()
        registered = torch._C._distributed_c10d._get_work_registry_size()  # DTensor's own
        nodes: set[str] = set()
        for _ in range(2):  # (the second call is a plan's replay)
            outside = (w.to_local() ** 2).sum() if outside_first else None
            inside = to_local(scale(x, w)).sum()
            nodes |= _node_names(inside)
            if outside is None:
                outside = (w.to_local() ** 2).sum()
            (inside + outside).backward()
        left = torch._C._distributed_c10d._get_work_registry_size() - registered
        want = 2 * (x.sum(0) + 2 * w.detach().full_tensor())
        got = w.grad.full_tensor()
        results.append(
            {
                "check": f"overlapped gradient psum, outside op {'before' if outside_first else 'after'}",
                "problems": ([] if torch.allclose(got, want) else [f"got {got}, want {want}"])
                + ([f"{left} works left registered after backward"] if left else [])
                # the weight's implicit pvary takes the real mesh's own node (_dist_pvary)
                + ([] if "PvaryBackward" in nodes else [f"no PvaryBackward in {sorted(nodes)}"]),
            }
        )
    results.append(_pending_gradient_into_a_collective(mesh, world))
    results.append(_gradients_are_plain_after_backward(mesh, scale, x))
    results.append(_packed_and_conjugated_parameters(mesh, x))
    results.append(_gradient_of_a_partial_sum(mesh, world))
    results.append(_backward_that_raises(mesh, world, scale, x))
    results.append(_only_temporaries_are_reduced_in_place(mesh, world))
    return results


def _node_names(t) -> set[str]:
    """The class names of the autograd nodes that ``t``'s backward runs."""
    names, todo, seen = set(), [t.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        names.add(type(node).__name__)
        todo.extend(next_node for next_node, _ in node.next_functions)
    return names


def _backward_that_raises(mesh, world, scale, x) -> dict:
    """A backward pass that raises after the gradient psum started runs no final callback (a
    training loop may catch it, e.g. an out-of-memory error, and go on): the reduction must
    still be finished and leave torch's work registry, at the latest by the next call."""

    class Raises(torch.autograd.Function):
        @staticmethod
        def forward(ctx, t):
            return t.view_as(t)

        @staticmethod
        def backward(ctx, g):
            raise ValueError("raised in backward on purpose")

    registry = torch._C._distributed_c10d._get_work_registry_size
    registered = registry()
    w = torch.linspace(-1.0, 1.0, 4, requires_grad=True)
    problems = []
    try:  # Raises.backward runs after the pvary's backward started the gradient psum
        scale(x, Raises.apply(w)).full_tensor().sum().backward()
        problems.append("the backward did not raise")
    except ValueError:
        pass
    got = scale(x, w).full_tensor().sum(0)  # the next call
    if not torch.allclose(got, x.sum(0) * w.detach()):
        problems.append(f"next call: {got}")
    left = registry() - registered
    return {
        "check": "a backward that raises leaves no reduction registered",
        "problems": problems + ([f"{left} works left registered"] if left else []),
    }


def _gradients_are_plain_after_backward(mesh, scale, x) -> dict:
    """Once backward returns, a replicated weight's gradient is a plain tensor (a DTensor over a
    plain local tensor), not the wrapper that stood for it while its psum was in flight: models
    holding such gradients deep-copy and pickle as usual; also where the call uses the weight
    through a chain of views of any length, a clone, a sum of views, a difference or a sum or
    difference with a number (the pending sum, or a view of it, would otherwise reach
    ``.grad``)."""
    import copy

    from torch.distributed.tensor import Replicate, distribute_tensor

    from named_spmd.backends.distributed import to_local

    model = torch.nn.Module()
    w = torch.linspace(-1.0, 1.0, 4)
    model.d = torch.nn.Parameter(distribute_tensor(w, mesh.device_mesh, [Replicate()] * 2))
    model.p = torch.nn.Parameter(w.clone())
    model.dv = torch.nn.Parameter(distribute_tensor(w, mesh.device_mesh, [Replicate()] * 2))
    model.pv = torch.nn.Parameter(w.clone())

    def scaled_by(used):  # v * used(*weights)
        return lambda *ws: ns.spmd_map(
            lambda v, *ws: v * used(*ws),
            mesh=mesh,
            in_specs=(P(("dp", "tp")),) + (P(),) * len(ws),
            out_specs=P(("dp", "tp")),
        )(x, *ws)

    def ten_views(w):
        for _ in range(5):
            w = w.unsqueeze(0).squeeze(0)
        return w

    views = scaled_by(lambda w: w.unsqueeze(0).squeeze(0))
    model.do = torch.nn.Parameter(distribute_tensor(w, mesh.device_mesh, [Replicate()] * 2))
    for name in ("pc", "p10", "pa", "pb", "ps", "pt", "pn"):
        model.register_parameter(name, torch.nn.Parameter(w.clone()))
    outs = (
        scale(x, model.d),
        scale(x, model.p),
        views(model.dv),
        views(model.pv),
        scale(x, model.do.unsqueeze(0).squeeze(0)),  # viewed outside the call
        scaled_by(torch.clone)(model.pc),
        scaled_by(ten_views)(model.p10),
        scaled_by(lambda a, b: a.unsqueeze(0).squeeze(0) + b.view(4))(model.pa, model.pb),
        scaled_by(lambda a, b: a - b)(model.ps, model.pt),  # pt's gradient: -want
        scaled_by(lambda a: a.sub(1.0) + 1.0)(model.pn),
    )
    sum(to_local(out).sum() for out in outs).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    problems = [
        f"{name}: {type(t).__name__}"
        for name, g in grads.items()
        if type(t := g._local_tensor if name[0] == "d" else g) is not torch.Tensor
    ]
    want = x.sum(0)
    full = {n: g.full_tensor() if n[0] == "d" else g for n, g in grads.items()}
    if not all(torch.allclose(g, -want if n == "pt" else want) for n, g in full.items()):
        problems.append(f"values {full}, want {want}")
    try:
        copy.deepcopy(model)
    except Exception as e:  # noqa: BLE001 - reported
        problems.append(f"deepcopy raised {type(e).__name__}: {e}")
    return {
        "check": "gradients are plain tensors after backward",
        "problems": problems + _pending_gradient_copies(scale, x, model.p),
    }


def _packed_and_conjugated_parameters(mesh, x) -> dict:
    """Parameters packed outside the call (``torch.cat``, a sum of ``torch.stack``) get plain
    ``.grad`` tensors once backward returns, as dense torch's values, plain and as DTensors; a
    parameter's conjugate view (``w.conj()``: the conj bit, which the implicit pvary made at
    the parameter would lose) gives dense torch's value and gradient."""
    from torch.distributed.tensor import Replicate, distribute_tensor

    from named_spmd.backends.distributed import to_local

    def summed_rows(v, w):
        return ns.psum((v * w).sum(0), ("dp", "tp"))

    packed = ns.spmd_map(summed_rows, mesh=mesh, in_specs=(P(("dp", "tp")), P()), out_specs=P())
    problems = []
    total = x.sum(0)
    want = {"a": total[:2], "b": total[2:], "c": total, "d": total}
    for dtensor in (False, True):
        ws = [torch.linspace(-1.0, 1.0, 2 if k < 2 else 4) + k for k in range(4)]
        if dtensor:
            ws = [distribute_tensor(w, mesh.device_mesh, [Replicate()] * 2) for w in ws]
        a, b, c, d = (torch.nn.Parameter(w) for w in ws)
        for pack in (torch.cat([a, b]), torch.stack([c, d]).sum(0)):
            to_local(packed(x, pack)).sum().backward()
        for name, p in zip("abcd", (a, b, c, d)):
            local = p.grad._local_tensor if dtensor else p.grad
            got = p.grad.full_tensor() if dtensor else p.grad
            if type(local) is not torch.Tensor or not torch.allclose(got, want[name]):
                problems.append(f"packed {name} (DTensor: {dtensor}): {type(local).__name__} {got}")
    z = torch.tensor([1.0 + 2.0j, -0.5 + 1.0j, 3.0 - 1.0j, 0.25j])
    xz = (x + 1j * x.flip(0)).to(torch.complex64)
    conjugated = ns.spmd_map(
        lambda v, w: ns.psum((v * w.conj()).imag.pow(2).sum(), ("dp", "tp")),
        mesh=mesh,
        in_specs=(P(("dp", "tp")), P()),
        out_specs=P(),
    )
    w, dense = torch.nn.Parameter(z.clone()), torch.nn.Parameter(z.clone())
    got = to_local(conjugated(xz, w))
    got.backward()
    want = (xz * dense.conj()).imag.pow(2).sum()
    want.backward()
    if not torch.allclose(got, want) or not torch.allclose(
        w.grad - dense.grad, torch.zeros(4, dtype=z.dtype)
    ):
        problems.append(
            f"conj view: {got.item()} (grad {w.grad}), dense {want.item()} ({dense.grad})"
        )
    return {"check": "packed and conjugated parameters", "problems": problems}


def _gradient_of_a_partial_sum(mesh, world) -> dict:
    """``torch.autograd.grad`` inside the function, of a loss with respect to a partial sum
    (unreduced over tp): the gradient is reduced over tp, each rank holding the whole cotangent
    (docs/design.md 2.2), not a part of it: a nonlinear op on it runs (dense torch's value), a
    psum of it is refused (it would count the cotangent once per part)."""

    def cotangent(v):
        u = ns.pcast(v * 1.0, "tp", to="unreduced")
        (g,) = torch.autograd.grad(ns.psum((u * 3.0).sum(), "tp"), u)
        return g

    x = torch.arange(4.0 * world).reshape(world, 4).requires_grad_()
    specs = {"in_specs": P(("dp", "tp")), "mesh": mesh}
    relu = ns.spmd_map(lambda v: torch.relu(cotangent(v)) * 2.0, out_specs=P("dp"), **specs)
    summed = ns.spmd_map(lambda v: ns.psum(cotangent(v), "tp"), out_specs=P("dp"), **specs)
    problems = []
    try:
        got = _global(relu(x))
        if not torch.equal(got, torch.full((mesh.axis_sizes[0], 4), 6.0)):
            problems.append(f"relu of the gradient: {got.tolist()}, want 6.0 everywhere")
    except ns.SpmdError as e:  # (every rank raises it alike: the mesh stays in step)
        problems.append(f"relu of the gradient raised {type(e).__name__}: {e}"[:300])
    problems += _expect_error(
        "psum of a partial sum's gradient", lambda: summed(x), ns.VmaError, "R:tp"
    )["problems"]
    return {"check": "gradient of a partial sum inside the function", "problems": problems}


def _gradients_through_outputs(mesh, world) -> dict:
    """Outputs of every state (varying, invariant, unreduced, reduced) differentiated on every
    rank through each way out of a DTensor (``ns.to_local``, torch's ``to_local``,
    ``full_tensor``, the DTensor itself): the gradient of the global value once, as the
    simulated mesh gives it (a partial sum's local part gets the whole cotangent: backward
    from every rank's part is not ``world`` times the gradient)."""
    from named_spmd.backends.distributed import to_local

    axes = ("dp", "tp")
    outputs = {
        "varying": (lambda x, w: x * w, P(axes)),
        "invariant": (lambda x, w: ns.psum((x * w).sum(), axes), P()),
        "unreduced": (
            lambda x, w: ns.pcast((x * w).sum(), axes, to="unreduced"),
            P(unreduced=set(axes)),
        ),
        "reduced": (
            lambda x, w: ns.pcast(ns.psum((x * w).sum(), axes), axes, to="reduced"),
            P(reduced=set(axes)),
        ),
    }
    ways = {
        "ns.to_local": lambda d: to_local(d).sum(),
        "DTensor.to_local": lambda d: d.to_local().sum(),
        "full_tensor": lambda d: d.full_tensor().sum(),
    }
    x = torch.arange(float(world)) + 1.0
    want = x.sum().item()  # d/dw of sum(x * w)
    problems = []
    for kind, (fn, out_spec) in outputs.items():
        f = ns.spmd_map(fn, mesh=mesh, in_specs=(P(axes), P()), out_specs=out_spec)
        for way, scalar in ways.items():
            w = torch.ones((), requires_grad=True)
            scalar(f(x, w)).backward()
            if w.grad is None or w.grad.item() != want:
                problems.append(f"{kind} output, {way}: gradient {w.grad}, want {want}")
    return {"check": "gradients through every kind of output", "problems": problems}


def _second_derivatives_at_the_boundary(mesh) -> dict:
    """Gradients differentiated again where a call's boundary makes parts of a value or of its
    cotangent (the first member holds it, the others zeros): an unreduced input (plain or a
    ``Partial`` DTensor, typed or under ``check_vma=False``) and a reduced output. Each equals
    dense torch's second derivatives, on every rank (the seeds of the second backward, the same
    on every rank, enter the call as parts: not summed once per member; and every rank runs
    the same backward, collectives included)."""
    g = torch.Generator().manual_seed(0)
    u0 = torch.randn(4, 3, generator=g, dtype=torch.float64)
    w0 = torch.randn(3, 2, generator=g, dtype=torch.float64)
    unreduced = P(unreduced={"tp"})

    def mapped(body, in_u, out, check=True):
        return ns.spmd_map(body, mesh=mesh, in_specs=(in_u, P()), out_specs=out, check_vma=check)

    def from_unreduced(u, w):
        return torch.tanh(ns.psum(u, "tp") @ w).sum(0)

    def to_reduced(u, w):
        return ns.pcast(ns.psum(torch.tanh(u @ w).sum(0), "tp"), "tp", to="reduced")

    cases = {
        "unreduced input": (mapped(from_unreduced, unreduced, P()), False),
        "unreduced input, DTensor": (mapped(from_unreduced, unreduced, P()), True),
        "unreduced input, check_vma=False": (
            mapped(from_unreduced, unreduced, P(), check=False),
            False,
        ),
        "reduced output": (mapped(to_reduced, P("tp"), P(reduced={"tp"})), False),
    }

    def second(fn, as_dtensor=False):
        u, w = u0.clone().requires_grad_(), w0.clone().requires_grad_()
        if as_dtensor:
            u = ns.shard(u0, mesh, unreduced).requires_grad_()
        y = _global(fn(u, w))
        gu, gw = torch.autograd.grad((y**2).sum(), (u, w), create_graph=True)
        gu = _global(gu)
        return [gu, gw, *map(_global, torch.autograd.grad((gw**2).sum() + (gu**3).sum(), (u, w)))]

    want = second(lambda u, w: torch.tanh(u @ w).sum(0))
    problems = []
    for name, (f, as_dtensor) in cases.items():
        try:
            got = second(f, as_dtensor)
        except Exception as e:  # noqa: BLE001 - reported (a rank that raised: the others too)
            problems.append(f"{name}: raised {type(e).__name__}: {e}"[:300])
            continue
        for what, a, b in zip(("du", "dw", "d2u", "d2w"), got, want):
            if not torch.allclose(a, b, rtol=1e-10, atol=1e-12):
                problems.append(
                    f"{name}: {what} {a.flatten()[:3].tolist()}, want {b.flatten()[:3].tolist()}"
                )
    return {"check": "second derivatives through parts at the boundary", "problems": problems}


def _pending_gradient_copies(scale, x, w) -> list[str]:
    """``torch.autograd.grad``'s result stays the pending wrapper (no leaf to fix): it pickles
    and deep-copies as the plain summed tensor."""
    import copy
    import io

    from named_spmd.backends.distributed import to_local

    (g,) = torch.autograd.grad(to_local(scale(x, w)).sum(), w)
    problems = []
    try:
        buf = io.BytesIO()
        torch.save(g, buf)
        buf.seek(0)
        copies = {"torch.save": torch.load(buf), "deepcopy": copy.deepcopy(g)}
    except Exception as e:  # noqa: BLE001 - reported
        return [f"copying torch.autograd.grad's result raised {type(e).__name__}: {e}"]
    for how, c in copies.items():
        if type(c) is not torch.Tensor or not torch.allclose(c, x.sum(0)):
            problems.append(f"{how}: {type(c).__name__} {c}")
    return problems


def _only_temporaries_are_reduced_in_place(mesh, world) -> dict:
    """A temporary operand whose storage object the user keeps (x.untyped_storage()) is not
    reduced in place: the storage object adds no storage use, only a Python reference. One that
    nothing holds is: the result is its buffer (the backend's decision, _dist_donation)."""
    kept, ptrs = [], []

    def keep_storage(t):
        kept.append(t.untyped_storage())
        return t

    def prog(v):
        return ns.psum(keep_storage(v * 1.0), ("dp", "tp"))

    f = ns.spmd_map(prog, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P())
    x = torch.arange(4.0 * world) + 1.0
    me = x.reshape(world, 4)[dist.get_rank()]
    problems = []
    for recording in (False, True):  # the fast chain of ns.psum, and the generic one
        kept.clear()
        with torch.no_grad():
            if recording:
                with ns.CommMode():
                    f(x)
            else:
                f(x)
        held = torch.tensor([]).set_(kept[0])
        if not torch.equal(held, me):
            problems.append(f"recording={recording}: the held storage became {held.tolist()}")

    def mark(t):
        ptrs.append(t.data_ptr())  # an int: no reference to t
        return t

    def fresh(v):
        out = ns.psum(mark(v * 1.0), ("dp", "tp"))
        ptrs.append(out.data_ptr())
        return out

    with torch.no_grad():
        got = ns.spmd_map(fresh, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P())(x)
    want = x.reshape(world, 4).sum(0)
    if not torch.equal(_global(got), want):
        problems.append(f"psum of a temporary gave {_global(got).tolist()}, want {want.tolist()}")
    if ptrs[0] != ptrs[1]:
        problems.append("psum copied a temporary operand that nothing else held")

    # a complex temporary is reduced in place as pairs of reals: the result, a view of the
    # operand, is typed invariant (not the operand's type): out_specs P() fit it
    with torch.no_grad():
        f = ns.spmd_map(
            lambda v: ns.psum(v * (1 + 1j), ("dp", "tp")),
            mesh=mesh,
            in_specs=P(("dp", "tp")),
            out_specs=P(),
        )
        try:
            got = _global(f(x))
            if not torch.equal(got, want * (1 + 1j)):
                problems.append(f"psum of a complex temporary gave {got.tolist()}")
        except ns.SpmdError as e:
            problems.append(f"psum of a complex temporary raised {e}"[:300])
    return {"check": "psum reduces temporaries in place, not held storage", "problems": problems}


def _pending_gradient_into_a_collective(mesh, world) -> dict:
    """A gathered value pvaried right away: the gradient psum's pending result is the operand of
    the all_gather's backward reduce-scatter, which hands memory to the process group itself."""
    sim = ns.make_mesh(mesh.axis_sizes, mesh.axis_names, simulated=True)

    def prog(x):
        y = ns.all_gather(x, "dp", tiled=True)
        return ns.psum(y * (ns.axis_index("tp") + 1.0), "tp")

    x = torch.linspace(-2.0, 3.0, 4 * world)
    grads = []
    for m in (sim, mesh):
        xg = x.clone().requires_grad_()
        out = ns.spmd_map(prog, mesh=m, in_specs=P("dp"), out_specs=P("dp"))(xg)
        (_global(out) * torch.arange(float(out.numel()))).sum().backward()
        grads.append(xg.grad)
    ok = torch.allclose(grads[0], grads[1])
    return {"check": "pending gradient into a collective", "problems": [] if ok else [f"{grads}"]}


def _report_outcome(mode: str, rank: int, call) -> None:
    """Run ``call`` and print one OUTCOME line: the error it raised (if any) and how long it took."""
    outcome = {"rank": rank, "mode": mode, "error": None}
    t0 = time.monotonic()
    try:
        call()
    except Exception as e:  # noqa: BLE001 - the test inspects it
        outcome["error"] = type(e).__name__
        outcome["message"] = str(e)
    outcome["seconds"] = round(time.monotonic() - t0, 2)
    print("OUTCOME " + json.dumps(outcome), flush=True)


def run_failure(args, rank, world) -> None:
    mesh = ns.make_mesh((2, world // 2), ("dp", "tp"), device_type=args.device)
    bad = args.bad_rank

    @ns.spmd_map(mesh=mesh, in_specs=P("dp", "tp"), out_specs=P())
    def step(x):
        if dist.get_rank() == bad:
            raise ValueError(f"injected failure on purpose (rank {bad})")
        y = ns.psum(x, "tp")
        return ns.psum(y, "dp")

    _report_outcome("fail", rank, lambda: step(torch.ones(2, world // 2)).full_tensor())


def run_mismatch(args, rank, world) -> None:
    from named_spmd.backends.distributed import set_debug

    set_debug(True)
    mesh = ns.make_mesh((world,), ("i",), device_type=args.device)

    @ns.spmd_map(mesh=mesh, in_specs=P("i"), out_specs=P())
    def f(x):
        if dist.get_rank() == 0:
            x = torch.cat([x, x])  # a different shape on rank 0 only
        return ns.psum(x, "i")

    _report_outcome("mismatch", rank, lambda: f(torch.ones(world * 2)))


def run_failures(args, rank, world) -> None:
    """The debug-mode mismatch first (it leaves the groups usable), then a failing rank."""
    run_mismatch(args, rank, world)
    from named_spmd.backends.distributed import set_debug

    set_debug(None)
    run_failure(args, rank, world)


def delay_overlapped_reductions() -> None:
    """Make every overlapped gradient psum (``_dist_overlap._reduce_during_backward``) happen
    only when it is waited for, and poison its buffer with NaN until then: any consumer that
    reads the gradient without waiting then gets NaN, deterministically, instead of a rarely
    lost race. The reduction itself runs at the wait, in the order every rank waits in."""
    from named_spmd.backends import _dist_comm

    class LateReduction(dist.Work):
        def __init__(self, comm, buf):
            super().__init__()
            self.comm, self.buf, self.saved, self.done = comm, buf, buf.clone(), False
            buf.fill_(float("nan"))

        def wait(self, timeout=None):
            if not self.done:
                self.done = True
                self.comm.all_reduce_(self.buf.copy_(self.saved))
            return True

        def is_completed(self):
            return self.done

    _dist_comm.Comm.start_all_reduce_ = lambda comm, buf, name="psum": LateReduction(comm, buf)
    _dist_comm.Comm.finish = lambda comm, work, name="psum": work.wait()
    _delay_buckets()


def _delay_buckets() -> None:
    """The same for gradient buckets (``_dist_buckets``): a gradient that joins a bucket reads
    NaN until the bucket starts (its value is kept aside and put back then), and a bucket
    starts only when it is waited for (the start then poisons its buffer until the reduction,
    as above), so a member read before its bucket's wait fails deterministically too."""
    from named_spmd.backends import _dist_buckets

    bucket = _dist_buckets.Bucket
    add, start, wait = bucket.add, bucket.start, bucket.wait
    kept: dict[int, list] = {}  # id(bucket) -> [(member, its value)]

    def late_add(self, buf):
        if not add(self, buf):
            return False
        kept.setdefault(id(self), []).append((buf, buf.clone()))
        buf.fill_(float("nan"))
        return True

    def close_only(self):  # full, no room for the next gradient, or backward's end: not started
        work = _dist_buckets.OPEN.get(self.key)
        if work is not None and work.bucket is self:
            del _dist_buckets.OPEN[self.key]

    def late_wait(self):
        close_only(self)
        if self.started is None:
            for buf, value in kept.pop(id(self), []):
                buf.copy_(value)
            start(self)
        wait(self)

    bucket.add, bucket.start, bucket.wait = late_add, close_only, late_wait


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["programs", "fail", "mismatch", "failures"])
    parser.add_argument("--late-reductions", action="store_true", help="see its function")
    parser.add_argument("--bad-rank", type=int, default=1)
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default=None, help="folder for the catalogue runs")
    parser.add_argument("--backend", default=None, help="gloo (cpu) or nccl (cuda)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    backend = args.backend or ("nccl" if args.device == "cuda" else "gloo")
    if args.device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.late_reductions:
        delay_overlapped_reductions()
    try:
        modes = {
            "programs": run_programs,
            "fail": run_failure,
            "mismatch": run_mismatch,
            "failures": run_failures,
        }
        modes[args.mode](args, rank, world)
    finally:
        if args.mode == "programs":
            dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # skip interpreter teardown: peers of a failed run may hold dead sockets


if __name__ == "__main__":
    main()
