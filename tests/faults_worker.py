"""Fault scenarios on 4 gloo processes, a (2, 2) mesh ("dp", "tp"): run by tests/test_faults.py.

``python tests/faults_worker.py SCENARIO``; every rank prints one ``OUTCOME {json}`` per phase
(rank, phase, seconds, and ``ok`` or the error's type and message):

* ``mismatch``: phases that leave the mesh usable, each followed by a good call that must run and
  give the dense sum: rank 3 passes another global shape (without, then with debug mode); only
  rank 3's input requires grad (its backward psum would wait for the others for ever); the
  ranks psum over different axes with debug mode; then the same without debug mode, twice (the
  second call is where the ranks left behind see the others ahead). Between them, ``carried``:
  a replayed ragged_all_to_all whose offsets' exchange rides behind the start-of-call check,
  ``carried_permute``: an uneven call's first ppermute riding there (ranks apart in its axes or
  dtype alone too), and ``carried_even_permute``: an even call's; all in tests/_faults_carried.py.
* ``sigkill``: rank 2 kills itself (SIGKILL) inside the function, before a psum.
* ``axes_exit``: ranks 0, 1 psum over "dp", ranks 2, 3 over "tp"; 2 and 3 return and exit.
* ``once_more``: rank 0 calls the mapped function once more than the others, which exit.
* ``make_mesh``: rank 1 raises right after ``make_mesh`` (uncaught: its process exits).
* ``in_make_mesh``: rank 1 raises inside ``make_mesh``, once its groups exist (uncaught); the
  others then report whether Dynamo was imported (phase ``eager_without_dynamo``).
* ``late_rank``: rank 2 sleeps inside the function until its peers, which gave up waiting for it
  (a 3 s timeout) and returned, have ended, then calls the psum they left in flight; it reports
  phase ``waited``: the seconds until its peers ended (60 at most).
* ``dtypes``: every dtype torch has (but the quantized ones) through every collective and the
  call boundary's communication; one ``OUTCOME`` per case with this rank's block (bytes) or the
  error, compared by the test with the simulated mesh; then a float psum that must run
  (tests/_faults_dtypes.py).
* ``mesh_again``: rank 0 fails on a mesh, the mesh is made again with the same axes, and its
  first calls (rank 3 late past the board's grace) must give the right sums.
* ``bystanders``: rank 0 fails where no rank needs it, then before a psum over "tp" that ranks
  2 and 3 complete without it: every rank must stop at its next call naming rank 0.
* ``bystanders_nccl_path``: the first part of ``bystanders`` on a mesh forced onto NCCL's path
  (no polled waits; the start-of-call check on a gloo group of its own).
* ``debug_mismatch``: debug mode; a rank-dependent order of collectives, an extra collective
  on some ranks, and mismatched ops, shapes and ppermute pairs (over the whole mesh and within
  one "tp" group), again and again, each followed by a good call that must run.
* ``written_after_use``: rank 1 writes a parameter in place after an op of the function saved
  it for backward; then the backward pass on every rank (last: the mesh ends out of step).
  Before it, every rank writes an input that requires no grad after ``x * w`` saved it.
* ``slow_sender``: a ppermute where only rank 3 sends (to rank 0), called twice; rank 3 sleeps
  past the board's grace first, so ranks 1 and 2, which take no part in the exchange, wait in
  the next call while rank 0 still waits for rank 3: a lag, not a mismatch.

``A+B`` runs several scenarios in one launch, each on a mesh of its own.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

# the scenarios kept in modules of their own are dispatched by name (``main``) as the rest
from _faults_carried import (
    carried,
    carried_even_permute,
    carried_halos,
    carried_permute,
    carried_uneven_halos,
)
from _faults_common import DENSE, X, good_call, psum_all, report
from _faults_dtypes import dtypes  # noqa: F401 - a scenario, dispatched by name

import named_spmd as ns
from named_spmd import P


def by_axes(mesh, rank):
    # ranks 0, 1 (dp=0) sum over dp; ranks 2, 3 (dp=1) over tp: the dp groups never complete
    f = lambda x: ns.psum(x, "dp" if rank < 2 else "tp")  # noqa: E731
    return ns.spmd_map(f, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))


def mismatch(mesh, rank):
    shape = 16 if rank == 3 else 8
    bad_shapes = lambda: psum_all(mesh)(torch.arange(float(shape)))  # noqa: E731
    report(rank, "shapes", bad_shapes)
    report(rank, "shapes_then", lambda: good_call(mesh))
    x = X.clone().requires_grad_(rank == 3)
    report(rank, "grad", lambda: psum_all(mesh)(x).full_tensor().sum().backward())
    report(rank, "grad_then", lambda: good_call(mesh))
    carried(mesh, rank)
    carried_permute(mesh, rank)
    carried_even_permute(mesh, rank)
    carried_halos(mesh, rank)
    carried_uneven_halos(mesh, rank)
    ns.set_debug(True)
    report(rank, "shapes_debug", bad_shapes)
    report(rank, "shapes_debug_then", lambda: good_call(mesh))
    report(rank, "axes_debug", lambda: by_axes(mesh, rank)(X))
    report(rank, "axes_debug_then", lambda: good_call(mesh))
    ns.set_debug(None)
    f = by_axes(mesh, rank)
    report(rank, "axes", lambda: (f(X), f(X)))


def sigkill(mesh, rank):
    def f(x):
        if rank == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return ns.psum(x, ("dp", "tp"))

    report(
        rank,
        "sigkill",
        lambda: ns.spmd_map(f, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P())(X),
    )


def axes_exit(mesh, rank):
    report(rank, "axes_exit", lambda: by_axes(mesh, rank)(X))


def once_more(mesh, rank):
    report(rank, "first", lambda: good_call(mesh))
    if rank == 0:
        report(rank, "once_more", lambda: good_call(mesh))


def make_mesh(mesh, rank):
    if rank == 1:
        raise ValueError("rank 1 raises right after make_mesh")
    report(rank, "make_mesh", lambda: good_call(mesh))


def in_make_mesh(rank: int) -> None:
    # the real-mesh backend, which the first make_mesh imports: DTensor's imports (sympy) take
    # seconds per process under load, no part of the failure the peers are timed learning of
    import named_spmd.backends.distributed  # noqa: F401

    if rank == 1:  # fails once its groups exist, before make_mesh's barrier: an uncaught error
        from named_spmd.backends import _dist_mesh

        create = _dist_mesh._create_groups

        def failing(*args):
            create(*args)
            raise ValueError("rank 1 raises inside make_mesh")

        _dist_mesh._create_groups = failing
        ns.make_mesh((2, 2), ("dp", "tp"))
    report(rank, "in_make_mesh", lambda: ns.make_mesh((2, 2), ("dp", "tp")))
    report(rank, "eager_without_dynamo", _dynamo_not_imported)


def _dynamo_not_imported() -> None:
    """Making a real mesh and its failure path import no part of torch.compile (Dynamo's import
    takes seconds per process under load: an eager-only process never needs it)."""
    if "torch._dynamo" in sys.modules:
        raise ns.SpmdError("torch._dynamo was imported by an eager real-mesh process")


def late_rank(mesh, rank):
    os.environ["NAMED_SPMD_TIMEOUT"] = "3"  # after make_mesh, whose barrier waits as long
    store = dist.distributed_c10d._get_default_store()
    waited: list[float] = []

    def f(x):
        if rank == 2:
            t0 = time.monotonic()
            while not all(_ended(store, r) for r in (0, 1, 3)) and time.monotonic() - t0 < 60:
                time.sleep(0.05)
            waited.append(time.monotonic() - t0)
        return ns.psum(x, ("dp", "tp"))

    g = ns.spmd_map(f, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P())
    report(rank, "late_rank", lambda: g(X))
    if waited:  # as a phase of its own: how long rank 2 waited for its peers to end
        print("OUTCOME " + json.dumps({"rank": rank, "phase": "waited", "seconds": waited[0]}))


def _ended(store, rank: int) -> bool:
    """Whether ``rank``'s process (its pid as the library registered it) has ended."""
    from named_spmd.backends._dist_processes import _process_alive

    pid = store.get(f"named_spmd/process/{rank}").decode().split("\n")[1]
    return not _process_alive(int(pid))


def slow_sender(mesh, rank):
    from named_spmd.backends._dist_waiting import AHEAD_GRACE_S

    def f(x):
        if rank == 3:
            time.sleep(AHEAD_GRACE_S + 2)
        return ns.ppermute(x, ("dp", "tp"), [(3, 0)])

    g = ns.spmd_map(f, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))
    want = torch.tensor([6.0, 7.0, 0, 0, 0, 0, 0, 0])

    def twice():
        for _ in range(2):
            y = g(X).full_tensor()
            if not torch.equal(y, want):
                raise ns.SpmdError(f"wrong ppermute: {y.tolist()}")

    report(rank, "slow_sender", twice)


# --- meshes made again, and ranks that never needed the failing one ---------------------------------


def slow_psum(mesh, rank, fail: bool = False, sleep: float = 0.0):
    """The psum over both axes; rank 3 sleeps first (its peers wait in slices, writing where
    they wait to the store), rank 0 raises first if ``fail``."""

    def f(x):
        if fail and rank == 0:
            raise ValueError("rank 0 fails before the psum")
        if rank == 3:
            time.sleep(sleep)
        return ns.psum(x, ("dp", "tp"))

    return ns.spmd_map(f, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P())


def checked(y):
    if not torch.equal(y.full_tensor(), DENSE):
        raise ns.SpmdError(f"wrong sum {y.full_tensor().tolist()} instead of {DENSE.tolist()}")


def mesh_again(mesh, rank, iterations: int = 2):
    """A mesh made again with the same axes must not read the earlier one's failure (posted for
    its call #2) or where its ranks waited (in call #2) as its own: each new mesh's first calls
    have rank 3 late past the board's grace, so its peers wait in slices and read the store."""
    from named_spmd.backends._dist_waiting import AHEAD_GRACE_S

    for i in range(iterations):
        report(rank, f"again_{i}_first", lambda: checked(slow_psum(mesh, rank, sleep=0.5)(X)))
        report(rank, f"again_{i}_failed", lambda: slow_psum(mesh, rank, fail=True)(X))
        mesh = ns.make_mesh((2, 2), ("dp", "tp"))
        late = slow_psum(mesh, rank, sleep=AHEAD_GRACE_S + 0.5)
        report(rank, f"again_{i}_new", lambda: [checked(late(X)) for _ in range(2)])


def nccl_path_mesh():
    """A gloo mesh on NCCL's path, forced by a test-only knob (``_dist_mesh._POLLED``): its
    collectives waited for without polling the failure board, its start-of-call check on a gloo
    group of its own, as on a mesh of CUDA devices."""
    from named_spmd.backends import _dist_mesh

    polled, _dist_mesh._POLLED = _dist_mesh._POLLED, frozenset()
    try:
        mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    finally:
        _dist_mesh._POLLED = polled
    assert not mesh.poll and mesh._check_group is not None, "not on NCCL's path"
    return mesh


def bystanders_nccl_path(mesh, rank):
    """``bystanders``' first part on NCCL's path (phases ``nccl_alone_*``). Its second part, a
    rank waiting in a collective for the failed one, is not run: NCCL's waits are not polled,
    so that rank would wait for NCCL's own timeout."""
    bystanders(mesh, rank, label="nccl_", in_collective=False)


def bystanders(mesh, rank, iterations: int = 1, label: str = "", in_collective: bool = True):
    """Rank 0 raises where no rank needs it (no collective in the function): the others return,
    then every rank stops at the next call's start with the same RankFailedError, and the call
    after runs. Then (``in_collective``) rank 0 raises before a psum over "tp": rank 1 waits for
    it, ranks 2 and 3 return; at their next call they stop naming rank 0 (and ranks 0 and 1 are
    out of step). ``label`` prefixes the phases."""

    from named_spmd.backends import _dist_failures

    # the failing rank waits that long for peers to learn of its failure before it goes on:
    # these peers learn of it only at their next call
    _dist_failures.ACK_S = 1.0

    def alone(x):
        if rank == 0 and alone.fail:
            raise ValueError("rank 0 fails where nobody needs it")
        return x * 2

    f = ns.spmd_map(alone, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))
    for i in range(iterations):
        alone.fail = True
        report(rank, f"{label}alone_{i}", lambda: f(X))
        alone.fail = False
        report(rank, f"{label}alone_{i}_next", lambda: f(X))
        report(rank, f"{label}alone_{i}_then", lambda: checked(slow_psum(mesh, rank)(X)))
    if not in_collective:
        return

    def by_tp(x):
        if rank == 0:
            raise ValueError("rank 0 fails before the psum over tp")
        return ns.psum(x, "tp")

    g = ns.spmd_map(by_tp, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P("dp"))
    report(rank, "by_tp", lambda: g(X))
    report(rank, "by_tp_next", lambda: checked(slow_psum(mesh, rank)(X)))


def written_after_use(mesh, rank):
    """Rank 1 alone writes a parameter in place after ``sin`` saved it: its backward pass would
    fail where the others' would not (they would wait for it in the gradient sum). Rank 1
    raises the call's error in the forward pass, posted; its peers stop in their backward
    pass's gradient sum quoting it."""
    from named_spmd.backends.distributed import to_local

    def unwatched(x, w):  # w requires no grad; x * w saves it for x's gradient
        y = ns.psum(x * w, ("dp", "tp"))
        w.add_(1)
        return y

    # first, every rank alike: the call's error on each, in the forward pass (the mesh in step)
    u = ns.spmd_map(unwatched, mesh=mesh, in_specs=(P(("dp", "tp")), P()), out_specs=P())
    report(rank, "written_unwatched", lambda: u(X.clone().requires_grad_(), torch.ones(2)))
    w = torch.nn.Parameter(torch.ones(2))

    def f(x, w):
        y = ns.psum(x * torch.sin(w), ("dp", "tp"))
        if rank == 1:
            with torch.no_grad():
                w.add_(1)
        return y

    g = ns.spmd_map(f, mesh=mesh, in_specs=(P(("dp", "tp")), P()), out_specs=P())
    report(rank, "written", lambda: to_local(g(X, w)).sum().backward())


# --- debug mode: mismatched collectives, caught, again and again -----------------------------------


def debug_programs(rank):
    """name -> function: each makes the ranks call different collectives (debug mode lists
    them); the values of the invariant output differ in "order" only."""
    A = ("dp", "tp")

    def order(x):  # rank-dependent order of two reductions that do not commute
        if rank < 2:
            return ns.psum(ns.pmax(x, "tp"), "dp")
        return ns.pmax(ns.psum(x, "dp"), "tp")

    def extra(x):  # ranks 0-2 call one psum more than rank 3 (the same values)
        y = ns.psum(x, A)
        if rank != 3:
            y = y + ns.psum(x * 0 + 1, A) - 4
        return y

    def op(x):  # rank 1 calls pmax where the others call psum
        return ns.pmax(x, A) if rank == 1 else ns.psum(x, A)

    def shape(x):  # rank 2 reduces a longer operand
        return ns.psum(torch.cat([x, x]) if rank == 2 else x, A)[:2]

    def pairs(x):  # rank 0 sends along other pairs
        perm = [(0, 1), (1, 0)] if rank == 0 else [(0, 2), (2, 0)]
        return ns.psum(ns.ppermute(x, A, perm), A)

    # mismatches within the "tp" group of ranks 0 and 1 only: ranks 2 and 3 agree and run
    # their collective (every rank must still stop, and the mesh stay usable)
    def tp_op(x):
        return ns.pmax(x, "tp") if rank == 1 else ns.psum(x, "tp")

    def tp_shape(x):
        return ns.psum(torch.cat([x, x]) if rank == 0 else x, "tp")[:2]

    def tp_pairs(x):
        return ns.psum(ns.ppermute(x, "tp", [(0, 1)] if rank == 0 else [(0, 1), (1, 0)]), "tp")

    return {
        **{"order": order, "extra": extra, "op": op, "shape": shape, "pairs": pairs},
        **{"tp_op": tp_op, "tp_shape": tp_shape, "tp_pairs": tp_pairs},
    }


def debug_mismatch(mesh, rank, iterations: int = 4):
    """Each mismatch (debug mode) must raise on every rank within seconds, listing what every
    rank called, and the good call after it must run, every time."""
    ns.set_debug(True)
    programs = debug_programs(rank)
    for i in range(iterations):
        for name, fn in programs.items():
            if i and name in ("order", "extra"):
                continue  # (deterministic: once is enough)
            out = P("dp") if name.startswith("tp_") else P()
            f = ns.spmd_map(fn, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=out)
            report(rank, f"debug_{name}_{i}", lambda: f(X))
            report(rank, f"debug_{name}_{i}_then", lambda: good_call(mesh))
    ns.set_debug(None)


def main() -> None:
    scenario = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario == "in_make_mesh":
        return in_make_mesh(rank)
    for part in scenario.split("+"):  # several in one launch, each on a mesh of its own
        nccl_path = part.endswith("_nccl_path")
        globals()[part](nccl_path_mesh() if nccl_path else ns.make_mesh((2, 2), ("dp", "tp")), rank)


if __name__ == "__main__":
    main()
