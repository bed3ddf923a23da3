"""The property test's drawn calls on 4 gloo processes, against the simulated mesh.

Rank 0 draws a seeded batch of cases from tests/test_properties.py's strategy restricted to
meshes of 4 instances (its dtypes f32/f64/f16/bf16/i64/i32/i8/u8/bool/c64, its contiguous /
transposed / expanded / sliced / permuted layouts, valid and invalid specs and collective
arguments) and broadcasts it. Every rank renames the mesh's axes to "a", "b", "c" (a bijection
of the name pool applied to the whole case, so at most 4 real meshes are made) and runs each
call on the real mesh and on a simulated mesh of the same shape in the same process. Both must
give the same outcome: the same error (class and message), or values with the same structure,
dtypes and shapes, equal to the dtype's tolerance (integers and bools exactly), and the ranks'
copies of a replicated output equal (NaN to NaN). ``python tests/properties_dist.py`` under a
4-process job prints one ``OUTCOME {json}`` line per case and rank; test_properties_dist.py
asserts that none has problems.

The batch: ``NAMED_SPMD_DIST_PROPERTY_CASES`` (default 300) cases of a derandomized hypothesis
run (no shrinking: nothing fails while drawing).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import sys
import traceback
from typing import Any

import test_properties as tp
import torch
from _reference import _structure, tree_leaves
from hypothesis import HealthCheck, Phase, given, settings

import named_spmd as ns

CASES = int(os.environ.get("NAMED_SPMD_DIST_PROPERTY_CASES", "300"))
WORLD = 4
CANONICAL = ("a", "b", "c", "dp", "tp", "sp")
assert set(CANONICAL) == set(tp.NAME_POOL)


def draw_cases(wanted: int) -> list[tp.Case]:
    """The first ``wanted`` drawn cases of a 4-instance mesh (derandomized: the same every run)."""
    found: list[tp.Case] = []

    @settings(
        max_examples=wanted,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(case=tp.cases(instances=WORLD))
    def collect(case: tp.Case) -> None:
        if len(found) < wanted:
            found.append(case)

    collect()
    return found


def renamed(case: tp.Case) -> tp.Case:
    """``case`` with its mesh axes called "a", "b", "c" in order: every name of the pool is
    mapped (a bijection), wherever it appears as a value (specs, axis names)."""
    order = list(case.names) + [n for n in CANONICAL if n not in case.names]
    mapping = dict(zip(order, CANONICAL))

    def rename(v: Any) -> Any:
        if isinstance(v, str):
            return mapping.get(v, v)
        if isinstance(v, tp.Spec):
            return tp.Spec(rename(v.entries))
        if isinstance(v, dict):
            return {k: rename(x) for k, x in v.items()}
        if isinstance(v, (tuple, list, set, frozenset)):
            return type(v)(rename(x) for x in v)
        return v

    return dataclasses.replace(
        case,
        names=tuple(mapping[n] for n in case.names),
        in_specs=rename(case.in_specs),
        axis_name=rename(case.axis_name),
        out_specs=rename(case.out_specs),
    )


# --- one call, and the comparison --------------------------------------------------------------


def call(case: tp.Case, mesh) -> dict:
    """``{"out": tree}`` (global values) or ``{"error": class, "message": text}``."""
    try:
        in_specs, out_specs = tp.build_specs(case.in_specs), tp.build_specs(case.out_specs)
        fn = functools.partial(tp.drawn_program, case, ns)
        out = ns.spmd_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)(
            *tp.build_args(case)
        )
    except Exception as e:  # noqa: BLE001 - compared with the other backend's outcome
        return {"error": type(e).__name__, "message": str(e), "trace": traceback.format_exc()}
    try:
        return {"out": tp.tree_map(_global, out)}
    except ReplicasDiffer as e:
        return {"replicas": str(e)}


class ReplicasDiffer(Exception):
    """The ranks hold different blocks where the output's placement says they hold copies."""


def _global(y: Any) -> Any:
    """The global value of an output leaf: a DTensor's blocks gathered as Python objects (gloo has
    no collective for some dtypes, bool and complex among them) and assembled from placements."""
    if not hasattr(y, "to_local"):
        return y
    import torch.distributed as dist
    from torch.distributed.tensor import Replicate, Shard

    mine = (tuple(y.device_mesh.get_coordinate()), y.to_local().detach().clone())
    blocks: list = [None] * dist.get_world_size()
    dist.all_gather_object(blocks, mine)
    parts = dict(blocks)
    for m in reversed(range(y.device_mesh.ndim)):  # the minor mesh dim first: row-major blocks
        place, merged = y.placements[m], {}
        assert isinstance(place, (Shard, Replicate)), y.placements
        for coords in sorted(parts):
            merged.setdefault(coords[:m] + coords[m + 1 :], []).append(parts[coords])
        parts = {k: _merge(v, place, m) for k, v in merged.items()}
    (value,) = parts.values()
    return value


def _merge(blocks: list[torch.Tensor], place: Any, m: int) -> torch.Tensor:
    """The blocks along mesh dim ``m`` (in coordinate order) merged by its placement."""
    if hasattr(place, "dim"):  # Shard
        return torch.cat(blocks, place.dim)
    # Replicate: every rank along the dim must hold the same block (a wrongly "replicated"
    # output, e.g. of a lost vma, shows here and nowhere else: the simulated mesh has one)
    if any(not _same(b, blocks[0]) for b in blocks[1:]):
        raise ReplicasDiffer(f"mesh dim {m} is {place} but its blocks differ: {blocks}")
    return blocks[0]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN equal to NaN (copies of one computation)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


def differences(real: dict, sim: dict) -> list[str]:
    if "replicas" in real:
        return [f"real: {real['replicas']}"]
    if "error" in real or "error" in sim:
        if (real.get("error"), real.get("message")) == (sim.get("error"), sim.get("message")):
            return []
        return [f"real: {_said(real)}\nsimulated: {_said(sim)}"]
    got, want = real["out"], sim["out"]
    if _structure(got) != _structure(want):
        return [f"structure {_structure(got)} != {_structure(want)}"]
    problems = []
    for j, (g, w) in enumerate(zip(tree_leaves(got), tree_leaves(want))):
        if not isinstance(w, torch.Tensor):
            if isinstance(g, torch.Tensor) or g != w or type(g) is not type(w):
                problems.append(f"leaf {j}: {g!r} vs {w!r}")
        elif (g.dtype, g.shape) != (w.dtype, w.shape):
            problems.append(f"leaf {j}: {g.dtype}{list(g.shape)} vs {w.dtype}{list(w.shape)}")
        else:
            rtol, atol = tp._tolerance(w.dtype)
            if not torch.allclose(g, w, rtol=rtol, atol=atol, equal_nan=True):
                problems.append(f"leaf {j}: values differ\n{g}\n{w}")
    return problems


def _said(o: dict) -> str:
    if "error" not in o:
        return "values"
    return f"{o['error']}: {o['message'][:600]} {o.get('trace', '')[-800:]}"


def main() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    # rank 0 draws (hypothesis is slow: four processes drawing on two cores would quadruple it)
    shared = [[renamed(c) for c in draw_cases(CASES)] if rank == 0 else None]
    dist.broadcast_object_list(shared, src=0)
    batch: list[tp.Case] = shared[0]
    real_meshes: dict = {}
    for k, case in enumerate(batch):
        key = (case.sizes, case.names)
        if key not in real_meshes:  # creating a real mesh is collective: same order everywhere
            real_meshes[key] = ns.make_mesh(case.sizes, case.names)
        real = call(case, real_meshes[key])
        sim = call(case, tp.mesh_of(case))
        line = {
            "rank": rank,
            "case": k,
            "dtype": str(case.dtype),
            "layouts": [case.x.layout, case.y.layout],
            "outcome": "raised" if "error" in sim else "value",
            "problems": differences(real, sim),
        }
        if line["problems"]:
            line["case_text"] = case.describe()
        print("OUTCOME " + json.dumps(line), flush=True)
    sys.stdout.flush()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
