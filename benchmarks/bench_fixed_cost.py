"""Fixed cost of one spmd_map call on tiny tensors, and what the per-call caches buy.

Run: ``python benchmarks/bench_fixed_cost.py [--quick] [--markdown FILE]``

Simulated backend (this process): for a few meshes and programs on tiny tensors,

* ``plain call``: the per-device function called once on the global tensor (no mapping at all);
* ``torch.func.vmap nested``: the same function under one hand-written ``vmap`` per mesh axis,
  the floor of a vmap-based simulation;
* ``spmd_map``: ours, warm (the plans, tokens, spec checks cached after the first call);
* ``spmd_map, caches cleared``: ours with every per-call cache emptied before each call, which
  shows what the caching buys.

The real (torch.distributed) backend's fixed cost is measured by bench_distributed.py (it needs
several processes).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from torch.func import vmap

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _util  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P, _collectives, _spec, _tree  # noqa: E402
from named_spmd.backends import simulated  # noqa: E402

try:  # where the plans live in this version (the script also runs against older checkouts)
    from named_spmd.backends.simulated import _plan as simulated_plan  # noqa: E402
except ImportError:
    simulated_plan = simulated
try:
    from named_spmd._collectives import _checks as collective_checks  # noqa: E402
except ImportError:
    collective_checks = _collectives
try:  # where the simulated primitives live in this version
    from named_spmd.backends.simulated import _primitives as simulated_primitives  # noqa: E402
except ImportError:
    simulated_primitives = simulated


def clear_caches() -> None:
    """Empty every per-call cache of the simulated path (those this version has: the script
    also runs against older checkouts, for before/after numbers)."""
    for module, name in [
        (simulated_plan, "_input_plan"),
        (simulated_plan, "_output_plan"),
        (simulated, "_tokens"),
        (simulated, "_token"),
        (simulated, "_permutations"),
        (simulated_primitives, "_permutation"),
        (_spec, "_fits"),
        (_tree, "_broadcast_cache"),
        (_collectives, "_valid_pairs"),
        (collective_checks, "_valid_int_pairs"),
    ]:
        cache = getattr(module, name, None)
        if cache is not None:
            getattr(cache, "cache_clear", getattr(cache, "clear", None))()


def _nested_vmap(fn, n_axes: int):
    for _ in range(n_axes):
        fn = vmap(fn)
    return fn


CASES = {
    # name: (mesh shape, axis names, per-device fn, in_spec, out_spec, global shape)
    "identity, mesh (8,)": ((8,), ("i",), lambda x: x, P("i"), P("i"), (8, 4)),
    "identity, mesh (2,4)": (
        (2, 4),
        ("dp", "tp"),
        lambda x: x,
        P("dp", "tp"),
        P("dp", "tp"),
        (8, 8),
    ),
    "identity, mesh (2,2,2)": (
        (2, 2, 2),
        ("a", "b", "c"),
        lambda x: x,
        P(("a", "b"), "c"),
        P(("a", "b"), "c"),
        (8, 4),
    ),
    "one psum, mesh (2,4)": (
        (2, 4),
        ("dp", "tp"),
        lambda x: ns.psum(x, "tp"),
        P("dp", "tp"),
        P("dp"),
        (8, 8),
    ),
}


def bench_simulated(rounds: int) -> list[_util.Row]:
    rows = []
    for name, (shape, names, fn, in_spec, out_spec, global_shape) in CASES.items():
        mesh = ns.make_mesh(shape, names)
        x = torch.randn(global_shape)
        mapped = ns.spmd_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec)
        local_fn = (lambda x: x.sum(0)) if "psum" in name else fn  # the psum's local analogue
        physical = x.reshape(*shape, -1)
        nested = _nested_vmap(local_fn, len(shape))

        def cold(mapped=mapped, x=x):
            clear_caches()
            return mapped(x)

        med = _util.compare(
            {
                "plain call": lambda fn=local_fn, x=x: fn(x),
                "torch.func.vmap nested": lambda f=nested, p=physical: f(p),
                "spmd_map": lambda f=mapped, x=x: f(x),
                "spmd_map, caches cleared": cold,
            },
            rounds=rounds,
            target_s=0.03,
        )
        rows += _util.rows_with_ratios(
            "simulated fixed cost", name, med, "torch.func.vmap nested", {}
        )
    return rows


def main(argv: list[str] | None = None) -> list[_util.Row]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds")
    parser.add_argument("--markdown", help="also write the rows as a markdown table here")
    args = parser.parse_args(argv)
    rows = bench_simulated(7 if args.quick else 15)
    _util.print_rows(rows)
    _util.write_markdown(args.markdown, rows)
    return rows


if __name__ == "__main__":
    main()
