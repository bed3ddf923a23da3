"""The teardown abort's fix, checked where it matters: at exit, before the
interpreter finalizes. A gloo process group still referenced when finalization frees it aborts
the process (SIGABRT) in some launches (docs/repros/gloo_teardown_abort.py, torch only), and a
mesh caches its groups; named_spmd's atexit handler must drop every one of them.

``python tests/teardown_worker.py`` under a 2-process job: a (2, 1) mesh (groups for "a", "b"
and the pair) runs calls, the script ends as a user's would (destroy_process_group, then a
normal exit), and an atexit hook registered before named_spmd is imported (atexit runs hooks
last-in first-out, so this one runs after the library's) prints ``GROUPS_ALIVE_AT_EXIT <n>``:
how many of the mesh's process groups are still referenced then (weak references). It must be 0.
"""

from __future__ import annotations

import atexit
import gc
import weakref

GROUPS: list[weakref.ref] = []


@atexit.register
def _count_groups_left() -> None:
    gc.collect()
    print(f"GROUPS_ALIVE_AT_EXIT {sum(r() is not None for r in GROUPS)}", flush=True)


import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    mesh = ns.make_mesh((2, 1), ("a", "b"))
    axes = ("a", "b")
    for collective in (
        lambda x: ns.psum(x, axes),
        lambda x: ns.all_gather(x, axes, tiled=True, to="invariant"),
    ):
        f = ns.spmd_map(collective, mesh=mesh, in_specs=P(axes), out_specs=P())
        f(torch.arange(4.0))
    groups = {id(g): g for g in mesh._groups.values()}  # "a", "b" and the pair ("a", "b")
    # Not the default group (here "a", which spans the world): torch itself keeps it to the end
    # (the first DTensor imports torch._dynamo, which imports torch.distributed.nn.functional,
    # whose functions' defaults capture group.WORLD if the process group is up by then; see
    # docs/design.md, "Known torch limits").
    groups.pop(id(dist.group.WORLD), None)
    GROUPS.extend(weakref.ref(g) for g in groups.values())
    print(f"GROUPS_MADE {len(GROUPS)}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
