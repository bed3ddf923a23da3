"""ns.shard / ns.unshard on a real (2, 2) mesh (run by tests/test_shard.py on 4 gloo processes).

Every check compares with the global tensors each rank builds from one seed, and with blocks cut
by ``_layout.block`` (independent of DTensor). One ``OUTCOME {json}`` line per check and rank:
``problems`` lists what failed (empty: passed).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.tensor import DTensor

import named_spmd as ns
from named_spmd import P
from named_spmd._layout import block

SPECS = {
    "w": P(None, "tp"),
    "dp_tp": P(("dp", "tp")),  # mesh order: DTensor's own [Shard(0), Shard(0)]
    "tp_dp": P(None, ("tp", "dp")),  # not mesh order
    "grid": P("dp", "tp"),
    "rep": P(),
    "param": P("tp"),
    "step": None,  # a non-tensor leaf
}


def global_tree() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "w": torch.randn(4, 8, generator=g, dtype=torch.float64),
        "dp_tp": torch.randn(8, 3, generator=g, dtype=torch.float64),
        "tp_dp": torch.randn(2, 12, generator=g),
        "grid": torch.arange(24).reshape(4, 6),
        "rep": torch.randn(6, generator=g, dtype=torch.float64),
        "param": torch.nn.Parameter(torch.randn(6, 2, generator=g, dtype=torch.float64)),
        "step": 3,
    }


def check_layout(mesh, rank) -> list[str]:
    tree = global_tree()
    sharded = ns.shard(tree, mesh, SPECS)
    problems = []
    back = ns.unshard(sharded)
    for k, x in tree.items():
        if not isinstance(x, torch.Tensor):
            if sharded[k] != x:
                problems.append(f"{k}: non-tensor leaf changed")
            continue
        d = sharded[k]
        if not isinstance(d, ns_dtensor()):
            problems.append(f"{k}: {type(d).__name__}, not a DTensor")
            continue
        if not (d.is_leaf and d.requires_grad == x.requires_grad and d.dtype == x.dtype):
            problems.append(f"{k}: leaf {d.is_leaf}, requires_grad {d.requires_grad}, {d.dtype}")
        if isinstance(x, torch.nn.Parameter) != isinstance(d, torch.nn.Parameter):
            problems.append(f"{k}: Parameter-ness not kept")
        if type(back[k]) is not torch.Tensor or not torch.equal(back[k], x.detach()):
            problems.append(f"{k}: unshard is not the global tensor")
        spec = SPECS[k]
        in_mesh_order = all(list(e) == sorted(e, key=mesh.axis_names.index) for e in _tuples(spec))
        if in_mesh_order:  # the local shard is the spec's block for this rank
            want = block(x.detach(), spec, mesh.shape, mesh.my_coords)
            if not torch.equal(d.to_local(), want):
                problems.append(f"{k}: local shard is not the spec's block")
    return problems


def _tuples(spec):
    return [e for e in spec if isinstance(e, tuple)]


def ns_dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def check_spmd_map_inputs(mesh, rank) -> list[str]:
    """A call takes the DTensors as inputs with the same specs: each instance sees the block the
    plain global tensor gives it, and identity outputs are the same DTensors."""
    tree = {k: v for k, v in global_tree().items() if isinstance(v, torch.Tensor)}
    specs = {k: SPECS[k] for k in tree}
    sharded = ns.shard(tree, mesh, specs)

    def diff(a, b):
        return ns.pmax(torch.stack([(a[k] - b[k]).abs().double().amax() for k in a]), ("dp", "tp"))

    f = ns.spmd_map(diff, mesh=mesh, in_specs=(specs, specs), out_specs=P())
    problems = []
    gap = f(sharded, tree).full_tensor()
    if gap.abs().max() != 0:
        problems.append(f"blocks differ from the plain input's: {gap.tolist()}")
    same = ns.spmd_map(lambda t: t, mesh=mesh, in_specs=(specs,), out_specs=specs)(sharded)
    for k in tree:
        if tuple(same[k].placements) != tuple(sharded[k].placements):
            problems.append(
                f"{k}: output placements {same[k].placements} vs {sharded[k].placements}"
            )
        elif not torch.equal(same[k].to_local(), sharded[k].to_local()):
            problems.append(f"{k}: identity call output differs")
    return problems


def check_gradient(mesh, rank) -> list[str]:
    """A sharded parameter trains: its .grad is a DTensor whose global value is the dense one."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(8, 8, generator=g, dtype=torch.float64)
    x = torch.randn(4, 8, generator=g, dtype=torch.float64)
    p = ns.shard(torch.nn.Parameter(w.clone()), mesh, P(None, ("tp", "dp")))
    f = ns.spmd_map(
        lambda x, w: ns.psum((x @ w).square().sum().reshape(1), ("dp", "tp")),
        mesh=mesh,
        in_specs=(P(), P(None, ("tp", "dp"))),
        out_specs=P(),
    )
    f(x, p).full_tensor().sum().backward()
    wd = w.clone().requires_grad_()
    (x @ wd).square().sum().backward()
    problems = []
    if not isinstance(p.grad, ns_dtensor()):
        return [f"grad is a {type(p.grad).__name__}"]
    if tuple(p.grad.placements) != tuple(p.placements):
        problems.append(f"grad placements {p.grad.placements} vs {p.placements}")
    if not torch.allclose(p.grad.full_tensor(), wd.grad, rtol=1e-12, atol=1e-12):
        problems.append("grad differs from the dense gradient")
    return problems


def check_rank_zero_wins(mesh, rank) -> list[str]:
    """Ranks that initialised differently (torch.manual_seed(rank)) get rank 0's values, and the
    caller's tensor is never overwritten."""
    mine = torch.full((4, 2), float(rank))
    kept = mine.clone()
    problems = []
    for spec in (P(), P("tp"), P(("dp", "tp"))):
        d = ns.shard(mine, mesh, spec)
        if not torch.equal(ns.unshard(d), torch.zeros(4, 2)):
            problems.append(f"{spec}: not rank 0's value")
        if not torch.equal(mine, kept):
            problems.append(f"{spec}: the caller's tensor was overwritten")
    return problems


def check_blocks(mesh, rank) -> list[str]:
    """blocks=True: this rank's blocks under the specs (tuple entries in either order included)
    as new plain leaves, requires_grad and nn.Parameter kept, rank 0's values where the ranks
    differ; the caller's tensors are left alone."""
    want_of = global_tree()
    tree = {**want_of, "rep": want_of["rep"] + rank}  # rank 0's value must win
    kept = {k: v.clone() for k, v in tree.items() if isinstance(v, torch.Tensor)}
    blocks = ns.shard(tree, mesh, SPECS, blocks=True)
    problems = []
    for name, spec in SPECS.items():
        got, x = blocks[name], tree[name]
        if not isinstance(x, torch.Tensor):
            if got != x:
                problems.append(f"{name}: {got!r} instead of {x!r}")
            continue
        want = block(want_of[name].detach(), spec, mesh._shape, mesh.my_coords)
        if type(got) not in (torch.Tensor, torch.nn.Parameter) or not torch.equal(got, want):
            problems.append(f"{name} {spec}: {type(got).__name__} {got} instead of {want}")
        if isinstance(x, torch.nn.Parameter) != isinstance(got, torch.nn.Parameter):
            problems.append(f"{name}: nn.Parameter not kept")
        if got.requires_grad != x.requires_grad or not got.is_leaf:
            problems.append(f"{name}: not a new leaf with requires_grad {x.requires_grad}")
        if not torch.equal(x, kept[name]):
            problems.append(f"{name}: the caller's tensor was changed")
    return problems


def check_uneven(mesh, rank) -> list[str]:
    """Dims the axes do not divide: DTensors whose local blocks are torch.chunk's (``block``,
    independent of DTensor) as ``distribute_tensor`` makes them, whose global value is the
    dense tensor; they feed a call with the same specs, whose outputs are those DTensors again
    (spmd_map's uneven convention), a tuple entry in mesh order included where DTensor's chunk
    of chunks is torch.chunk's (7 rows over 2 x 2); a DTensor is laid out anew; a tuple entry
    whose blocks DTensor does not hold (10 rows) is the simulated mesh's SpecError, and so is
    blocks=True (a local call takes equal blocks)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    g = torch.Generator().manual_seed(3)
    tree = {
        "rows": torch.randn(5, 3, generator=g, dtype=torch.float64),  # 3, 2 over tp
        "grid": torch.randn(3, 7, generator=g, dtype=torch.float64),  # 2, 1 x 4, 3
        # 2, 2, 2, 1 as torch.chunk's over the group and as DTensor's chunk of chunks
        "nested": torch.randn(7, 2, generator=g, dtype=torch.float64),
    }
    specs = {"rows": P("tp"), "grid": P("dp", "tp"), "nested": P(("dp", "tp"))}
    torch_places = {
        "rows": [Replicate(), Shard(0)],
        "grid": [Shard(0), Shard(1)],
        "nested": [Shard(0), Shard(0)],
    }
    sharded = ns.shard(tree, mesh, specs)
    problems = []
    for k, x in tree.items():
        d, want = sharded[k], block(x, specs[k], mesh._shape, mesh.my_coords)
        theirs = distribute_tensor(x, mesh.device_mesh, torch_places[k])
        if not isinstance(d, ns_dtensor()) or tuple(d.placements) != tuple(theirs.placements):
            problems.append(f"{k}: {type(d).__name__} {getattr(d, 'placements', None)}")
            continue
        if not (torch.equal(d.to_local(), want) and torch.equal(theirs.to_local(), want)):
            problems.append(f"{k}: local block {d.to_local().shape}, want {want.shape}")
        if not torch.equal(ns.unshard(d), x):
            problems.append(f"{k}: unshard differs from the dense tensor")
        again = ns.shard(ns.shard(x, mesh, P()), mesh, specs[k])  # laid out anew
        if not torch.equal(again.to_local(), want):
            problems.append(f"{k}: a resharded DTensor's block differs")
    same = ns.spmd_map(lambda t: t, mesh=mesh, in_specs=(specs,), out_specs=specs)(sharded)
    for k in tree:
        if tuple(same[k].placements) != tuple(sharded[k].placements) or not torch.equal(
            same[k].to_local(), sharded[k].to_local()
        ):
            problems.append(f"{k}: a call's output differs from ns.shard's DTensor")
    refused = (
        (lambda: ns.shard(torch.ones(10, 2), mesh, P(("dp", "tp"))), "no DTensor holds these"),
        (lambda: ns.shard(tree, mesh, specs, blocks=True), "a local call (f.local) takes"),
    )
    for call, fragment in refused:
        try:
            call()
            problems.append(f"not refused: {fragment}")
        except ns.SpecError as e:
            if fragment not in str(e):
                problems.append(f"refused with {e}")
    return problems


def check_reshard(mesh, rank) -> list[str]:
    """A DTensor passed to shard is laid out anew, as a new leaf."""
    x = global_tree()["w"]
    a = ns.shard(x, mesh, P("dp", "tp"))
    problems = []
    for spec in (P(None, ("dp", "tp")), P(None, ("tp", "dp")), P(), P("dp", "tp")):
        b = ns.shard(a, mesh, spec)
        want = ns.shard(x, mesh, spec)
        if tuple(b.placements) != tuple(want.placements) or not torch.equal(
            b.to_local(), want.to_local()
        ):
            problems.append(f"{spec}: resharded DTensor differs from shard of the global value")
        if b.to_local().data_ptr() == a.to_local().data_ptr():
            problems.append(f"{spec}: shares the input's data")
    return problems


def check_checkpoint(mesh, rank) -> list[str]:
    """dcp.save of a sharded tree, dcp.load into the same layout and into another one."""
    root = os.environ["SHARD_CKPT_DIR"]
    tree = {k: v for k, v in global_tree().items() if isinstance(v, torch.Tensor)}
    specs = {k: SPECS[k] for k in tree}
    dcp.save(ns.shard(tree, mesh, specs), checkpoint_id=root)
    problems = []
    other = {  # every leaf laid out differently from the saved one
        "w": P(("tp", "dp")),
        "dp_tp": P(),
        "tp_dp": P("dp", "tp"),
        "grid": P(("tp", "dp")),
        "rep": P("dp"),
        "param": P("dp"),
    }
    for name, layout in (("same", specs), ("other", other)):
        target = ns.shard({k: torch.zeros_like(v) for k, v in tree.items()}, mesh, layout)
        dcp.load(target, checkpoint_id=root)
        loaded = ns.unshard(target)
        for k, v in tree.items():
            if not torch.equal(loaded[k], v.detach()):
                problems.append(f"{name} layout: {k} differs after load")
    return problems


def check_from_local(mesh, rank) -> list[str]:
    """local=True: each rank passes only its block (cut by _layout.block); the DTensors equal
    those made from the global values, tuple entries in either order included."""
    tree = global_tree()
    blocks = {
        k: block(x.detach(), SPECS[k], mesh.shape, mesh.my_coords).clone()
        if isinstance(x, torch.Tensor)
        else x
        for k, x in tree.items()
    }
    blocks["param"] = torch.nn.Parameter(blocks["param"])
    mine, want = ns.shard(blocks, mesh, SPECS, local=True), ns.shard(tree, mesh, SPECS)
    problems = []
    for k, x in tree.items():
        if not isinstance(x, torch.Tensor):
            continue
        a, b = mine[k], want[k]
        if tuple(a.placements) != tuple(b.placements) or a.shape != b.shape:
            problems.append(
                f"{k}: {a.placements} {tuple(a.shape)} vs {b.placements} {tuple(b.shape)}"
            )
        elif not torch.equal(a.to_local(), b.to_local()):
            problems.append(f"{k}: local data differs from shard of the global value")
        elif not torch.equal(ns.unshard(a), x.detach()):
            problems.append(f"{k}: unshard is not the global value")
        if a.requires_grad != x.requires_grad or type(a) is not type(b):
            problems.append(f"{k}: requires_grad {a.requires_grad}, type {type(a).__name__}")
    try:  # blocks of different shapes per rank: refused on every rank, the mesh goes on
        ns.shard({"x": torch.ones(3 - rank % 2, 2)}, mesh, {"x": P("tp")}, local=True)
        problems.append("blocks of different shapes per rank were not refused")
    except ns.SpecError as e:
        if (
            "blocks of different shapes or dtypes (this rank's: {\"tree['x']\": 'float32["
            not in str(e)
        ):
            problems.append(f"refused with {e}")
    return problems + _local_spec_refusals(mesh, rank)


def _local_spec_refusals(mesh, rank) -> list[str]:
    """local=True blocks that fail the spec checks on some ranks only (a 1-D block under a 2-D
    spec on even ranks) or on every rank, or whose dtypes differ per rank, trees or specs that
    differ per rank (a tree the specs do not fit on odd ranks only, other specs for blocks of
    one shape), specs that fit no rank's tree: the same SpecError on every rank, and the next
    call runs (no rank left waiting in the blocks' agreement)."""
    problems = []
    odd = rank % 2 == 1
    spec = P(None, "tp")
    cases = (
        (torch.ones(3) if rank % 2 == 0 else torch.ones(3, 2), spec, "blocks of different shapes"),
        (torch.ones(3, 2, dtype=torch.float64 if rank else torch.float32), spec, "or dtypes"),
        (torch.ones(3), spec, "has 2 entries but the tensor has rank 1"),
        ({"x": torch.ones(3, 2), **({"y": torch.ones(2)} if odd else {})}, {"x": spec}, "trees"),
        (torch.ones(3, 2), P() if odd else spec, "trees or specs that differ"),
        ({"x": torch.ones(3, 2)}, {"y": spec}, "specs is not a pytree prefix of the tree"),
    )
    for x, specs, fragment in cases:
        try:
            ns.shard(x, mesh, specs, local=True)
            problems.append(f"not refused: {fragment}")
        except ns.SpecError as e:
            if fragment not in str(e):
                problems.append(f"refused with {e}")
    f = ns.spmd_map(lambda t: t * 2, mesh=mesh, in_specs=P("tp"), out_specs=P("tp"))
    got = f(torch.arange(4.0)).full_tensor()
    if not torch.equal(got, torch.arange(4.0) * 2):
        problems.append(f"the call after the refusals gave {got.tolist()}")
    return problems


def check_parallel_gpt(mesh, rank) -> list[str]:
    """ns.parallel's GPT (tests/test_parallel_layers.py) trains from ns.shard'ed parameters on
    the real mesh: its loss, every parameter's gradient and an AdamW step equal the dense
    model's."""
    import test_parallel_layers as t

    ids, target, params = t.gpt_inputs()
    n = mesh.shape["tp"]
    sharded = ns.shard(
        {k: torch.nn.Parameter(v) for k, v in t.gpt_packed(params, n).items()}, mesh, t.GPT_SPECS
    )
    loss = t.gpt_step(mesh)(ids, target, sharded)
    loss.full_tensor().backward()
    dense = {k: v.clone().requires_grad_() for k, v in params.items()}
    want = t.gpt_dense(ids, target, *dense.values())
    want.backward()
    problems = []
    if not torch.allclose(loss.full_tensor(), want, rtol=1e-12, atol=1e-12):
        problems.append(f"loss {loss.full_tensor().item()} vs dense {want.item()}")
    dim = params["wqkv"].shape[1]
    for k, p in sharded.items():
        g = p.grad.full_tensor()
        if k == "wqkv":  # back to q, k, v side by side
            g = t.pl.deinterleave_packed(g, (dim,) * 3, n, unit=t.GPT["hd"])
        if not torch.allclose(g, dense[k].grad, rtol=1e-10, atol=1e-12):
            problems.append(f"{k}: gradient differs from the dense one")
    # one AdamW step on the DTensors equals the dense step (wqkv in its packed layout)
    torch.optim.AdamW(sharded.values(), lr=0.1).step()
    torch.optim.AdamW(dense.values(), lr=0.1).step()
    after = ns.unshard({k: p.detach() for k, p in sharded.items()})
    after["wqkv"] = t.pl.deinterleave_packed(after["wqkv"], (dim,) * 3, n, unit=t.GPT["hd"])
    for k, p in dense.items():
        if not torch.allclose(after[k], p.detach(), rtol=1e-10, atol=1e-12):
            problems.append(f"{k}: AdamW step differs from the dense one")
    return problems


def check_uneven_to_local_backward(mesh, rank) -> list[str]:
    """``ns.to_local`` of a DTensor whose blocks differ in size (a call's output, one watched by
    ``retain_grad``, one from ``ns.shard``) is differentiable: each rank's loss of its block
    gives the dense gradient of that block, as torch's own ``to_local`` gives it."""
    g = torch.Generator().manual_seed(5)
    specs = {"rows": P("tp"), "grid": P("dp", "tp"), "nested": P(("dp", "tp"))}
    dense = {
        "rows": torch.randn(5, 3, generator=g, dtype=torch.float64),
        "grid": torch.randn(3, 7, generator=g, dtype=torch.float64),
        "nested": torch.randn(7, 2, generator=g, dtype=torch.float64),
    }
    problems = []
    for k, spec in specs.items():
        x = dense[k]
        want = block(torch.cos(x), spec, mesh._shape, mesh.my_coords)
        f = ns.spmd_map(torch.sin, mesh=mesh, in_specs=(spec,), out_specs=spec)
        for kind in ("dtensor", "watched", "shard"):
            d = ns.shard(x, mesh, spec).requires_grad_()
            if kind == "shard":  # a DTensor no call made: its local block's sine taken here
                ns.to_local(d).sin().sum().backward()
            else:
                out = f(d)
                if kind == "watched":
                    out.retain_grad()
                ns.to_local(out).sum().backward()
                if kind == "watched" and not torch.equal(
                    out.grad.to_local(), torch.ones_like(want)
                ):
                    problems.append(f"{k}: the output's retained gradient is not ones")
            if d.grad is None or tuple(d.grad.shape) != tuple(x.shape):
                problems.append(f"{k} {kind}: gradient {getattr(d.grad, 'shape', None)}")
            elif not torch.allclose(d.grad.to_local(), want, rtol=1e-12, atol=1e-12):
                problems.append(f"{k} {kind}: local gradient differs from the dense block's")
        plain = x.clone().requires_grad_()  # its gradient: every member's block, gathered
        ns.to_local(f(plain)).sum().backward()
        if not torch.allclose(plain.grad, torch.cos(x), rtol=1e-12, atol=1e-12):
            problems.append(f"{k} plain: gradient differs from the dense one")
    return problems


def check_partial_inputs_under_transforms(mesh, rank) -> list[str]:
    """A plain input split over dp and a partial sum over tp (unreduced, and reduced under
    ``check_vma=False``) under ``torch.func.grad``, ``vmap``, ``jvp`` and ``.backward()``: the simulated
    mesh's numbers (the real boundary's Functions under a transform)."""
    sim = ns.make_mesh(mesh.axis_sizes, mesh.axis_names, simulated=True)
    cases = {
        "unreduced": (lambda v: ns.psum(v, "tp").sin(), P("dp", unreduced={"tp"}), P("dp"), True),
        "reduced": (torch.sin, P("dp", reduced={"tp"}), P("dp", unreduced={"tp"}), False),
    }
    g = torch.Generator().manual_seed(7)
    x, t = (torch.randn(4, 3, generator=g, dtype=torch.float64) for _ in range(2))

    def run(on, case, how):
        fn, i, o, check = cases[case]
        f = ns.spmd_map(fn, mesh=on, in_specs=i, out_specs=o, check_vma=check)

        def plain(a):
            y = f(a)
            return y.full_tensor() if isinstance(y, DTensor) else y

        if how == "grad":
            return torch.func.grad(lambda a: plain(a).sum())(x)
        if how == "vmap":
            return torch.func.vmap(plain)(torch.stack([x, t]))
        if how == "jvp":
            return torch.stack(torch.func.jvp(plain, (x,), (t,)))
        a = x.clone().requires_grad_()
        plain(a).sum().backward()
        return a.grad

    problems = []
    for case in cases:
        for how in ("grad", "vmap", "jvp", "backward"):
            got, want = run(mesh, case, how), run(sim, case, how)
            if not torch.allclose(got, want, rtol=1e-12, atol=1e-12):
                problems.append(f"{case} under {how}: differs from the simulated mesh")
    return problems


CHECKS = [
    check_layout,
    check_spmd_map_inputs,
    check_gradient,
    check_rank_zero_wins,
    check_blocks,
    check_uneven,
    check_reshard,
    check_checkpoint,
    check_from_local,
    check_parallel_gpt,
    check_uneven_to_local_backward,
    check_partial_inputs_under_transforms,
]


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    for check in CHECKS:
        try:
            problems = check(mesh, rank)
        except Exception:
            problems = [traceback.format_exc()[-1500:]]
        print(
            "OUTCOME " + json.dumps({"rank": rank, "check": check.__name__, "problems": problems})
        )
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
