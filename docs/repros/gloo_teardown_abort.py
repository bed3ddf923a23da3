"""torch-only repro (no named_spmd) of 'terminate called without an active exception' / SIGABRT in
interpreter teardown with gloo (torch 2.13 CPU, Python 3.11).

    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port $PORT repro.py           # aborts
    KEEP=0 torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port $PORT repro.py    # clean
    FIX=1 torchrun --nproc-per-node 4 --master-addr 127.0.0.1 --master-port $PORT repro.py     # clean

Measured here (4 processes, 2 cores): 10 of 16 launches aborted as is, 0 of 16 with FIX=1, which
drops the held groups in an atexit handler (before finalization). named_spmd's distributed
backend does the same for the groups its meshes hold (backends/distributed.py,
_release_process_groups).

Process groups still referenced from Python after destroy_process_group() (here a module-level list,
as any library/user caching its groups does) keep their ProcessGroupGloo, and its "pt_gloo_runloop"
worker threads, alive into Py_FinalizeEx (destroy_process_group's pg.shutdown() does not stop them).
When the group is freed during finalization, a worker drops its last finished work; releasing that
work's tensors (refcount 2 -> 1) calls TensorImpl::decref_pyobject -> gil_scoped_acquire -> take_gil,
which during finalization calls pthread_exit; the forced unwind hits a noexcept frame -> std::terminate.
"""

import atexit
import gc
import os

import torch
import torch.distributed as dist

HELD = []  # a cache of groups that outlives destroy_process_group (KEEP=1)
if os.environ.get("FIX") == "1":  # drop the cache at exit, before finalization

    def _release():
        HELD.clear()
        gc.collect()

    atexit.register(_release)


def main():
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = [dist.new_group([r for r in range(world) if r % 2 == k]) for k in range(2)]
    mine = groups[rank % 2]
    if os.environ.get("KEEP", "1") == "1":
        HELD.extend([dist.group.WORLD, mine])
    x = torch.randn(64)
    for _ in range(5):
        for pg in (dist.group.WORLD, mine):
            out = torch.empty(dist.get_world_size(pg), 64)
            dist.all_gather_into_tensor(out, x.unsqueeze(0), group=pg, async_op=True).wait()
            t = x.clone()
            dist.all_reduce(t, group=pg, async_op=True).wait()
    print(f"RANK {rank} done", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
