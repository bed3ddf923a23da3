"""Fault scenarios on 4 gloo processes, a (2, 2) mesh ("dp", "tp"): run by tests/test_faults.py.

``python tests/faults_worker.py SCENARIO``; every rank prints one ``OUTCOME {json}`` per phase
(rank, phase, seconds, and ``ok`` or the error's type and message):

* ``mismatch``: phases that leave the mesh usable, each followed by a good call that must run and
  give the dense sum: rank 3 passes another global shape (without, then with debug mode); the
  ranks psum over different axes with debug mode; then the same without debug mode, twice (the
  second call is where the ranks left behind see the others ahead).
* ``sigkill``: rank 2 kills itself (SIGKILL) inside the function, before a psum.
* ``axes_exit``: ranks 0, 1 psum over "dp", ranks 2, 3 over "tp"; 2 and 3 return and exit.
* ``once_more``: rank 0 calls the mapped function once more than the others, which exit.
* ``make_mesh``: rank 1 raises right after ``make_mesh`` (uncaught: its process exits).
* ``in_make_mesh``: rank 1 raises inside ``make_mesh``, once its groups exist (uncaught).
* ``late_rank``: rank 2 sleeps inside the function until its peers, which gave up waiting for it
  (a 3 s timeout) and returned, have ended, then calls the psum they left in flight; it reports
  phase ``waited``: the seconds until its peers ended (60 at most).
* ``slow_sender``: a ppermute where only rank 3 sends (to rank 0), called twice; rank 3 sleeps
  past the board's grace first, so ranks 1 and 2, which take no part in the exchange, wait in
  the next call while rank 0 still waits for rank 3: a lag, not a mismatch.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import warnings

import torch
import torch.distributed as dist

import named_spmd as ns
from named_spmd import P

X = torch.arange(8.0)
DENSE = X.reshape(4, 2).sum(0)  # psum over both axes of P(("dp", "tp")) blocks


def report(rank: int, phase: str, call) -> bool:
    t0 = time.monotonic()
    try:
        call()
        out: dict = {"ok": True}
    except ns.SpmdError as e:
        out = {"error": type(e).__name__, "message": str(e)}
    out.update(rank=rank, phase=phase, seconds=time.monotonic() - t0)
    print("OUTCOME " + json.dumps(out), flush=True)
    return "ok" in out


def psum_all(mesh):
    return ns.spmd_map(
        lambda x: ns.psum(x, ("dp", "tp")), mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P()
    )


def good_call(mesh):
    y = psum_all(mesh)(X).full_tensor()
    if not torch.equal(y, DENSE):
        raise ns.SpmdError(f"wrong sum after recovery: {y.tolist()} instead of {DENSE.tolist()}")


def by_axes(mesh, rank):
    # ranks 0, 1 (dp=0) sum over dp; ranks 2, 3 (dp=1) over tp: the dp groups never complete
    f = lambda x: ns.psum(x, "dp" if rank < 2 else "tp")  # noqa: E731
    return ns.spmd_map(f, mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P(("dp", "tp")))


def mismatch(mesh, rank):
    shape = 16 if rank == 3 else 8
    bad_shapes = lambda: psum_all(mesh)(torch.arange(float(shape)))  # noqa: E731
    report(rank, "shapes", bad_shapes)
    report(rank, "shapes_then", lambda: good_call(mesh))
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
    if rank == 1:  # fails once its groups exist, before make_mesh's barrier: an uncaught error
        from named_spmd.backends import distributed

        create = distributed._create_groups

        def failing(*args):
            create(*args)
            raise ValueError("rank 1 raises inside make_mesh")

        distributed._create_groups = failing
        ns.make_mesh((2, 2), ("dp", "tp"))
    report(rank, "in_make_mesh", lambda: ns.make_mesh((2, 2), ("dp", "tp")))


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
    from named_spmd.backends._dist_failures import AHEAD_GRACE_S

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


# --- dtypes: every dtype torch has through every collective ----------------------------------------

A = ("dp", "tp")
# quantized dtypes need a quantizer (a view of bytes is no valid quantized tensor) and their
# creation functions are deprecated: the one group of torch dtypes left out
QUANTIZED = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and str(d)[6:7] == "q"
)
DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)} - QUANTIZED, key=str
)
# name -> (function, in_specs, out_specs, check_vma): each collective, a single-axis group, and
# the call boundary's own communication (a broadcast without check_vma, a non-mesh-order spec)
DTYPE_PROGRAMS = {
    "psum": (lambda x: ns.psum(x, A), P(A), P(), True),
    "psum_tp": (lambda x: ns.psum(x, "tp"), P(A), P("dp"), True),
    "pmean": (lambda x: ns.pmean(x, A), P(A), P(), True),
    "pmax": (lambda x: ns.pmax(x, A), P(A), P(), True),
    "pmin": (lambda x: ns.pmin(x, A), P(A), P(), True),
    "psum_scatter": (lambda x: ns.psum_scatter(x, A, tiled=True), P(A), P(A), True),
    "all_gather": (lambda x: ns.all_gather(x, A, tiled=True, to="invariant"), P(A), P(), True),
    "all_to_all": (lambda x: ns.all_to_all(x, A, 0, 0, tiled=True), P(A), P(A), True),
    "ppermute": (
        lambda x: ns.ppermute(x, A, [(i, (i + 1) % 4) for i in range(3)]),
        P(A),
        P(A),
        True,
    ),
    "pshuffle": (lambda x: ns.pshuffle(x, A, [2, 0, 3, 1]), P(A), P(A), True),
    "pbroadcast": (lambda x: ns.pbroadcast(x, A, 2), P(A), P(), True),
    "unchecked_broadcast": (lambda x: x, P(A), P(), False),
    "reordered": (lambda x: x, P(("tp", "dp")), P(("tp", "dp")), True),
}


def dtype_input(dtype: torch.dtype) -> torch.Tensor:
    """16 elements of ``dtype``: small integers (exact sums in every float dtype, int8 sums
    that wrap), a pattern of truth values, or bytes viewed as a dtype that has no conversion."""
    base = (torch.arange(16) * 5 + 3) % 64
    if dtype is torch.bool:
        return base % 3 == 0
    try:
        with warnings.catch_warnings():  # torch's own note on complex32
            warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
            return base.to(dtype)
    except (RuntimeError, TypeError):
        size = torch.empty(0, dtype=dtype).element_size()
        return torch.arange(16 * size, dtype=torch.uint8).mul(37).view(dtype)


def dtype_call(mesh, dtype: torch.dtype, name: str):
    fn, in_spec, out_spec, check_vma = DTYPE_PROGRAMS[name]
    f = ns.spmd_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma)
    return f(dtype_input(dtype))


def described(t: torch.Tensor) -> dict:
    """A tensor as JSON: dtype, shape and its bytes (exact for every dtype, NaN payloads too)."""
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    return {"dtype": str(t.dtype), "shape": list(t.shape), "bytes": raw.numpy().tobytes().hex()}


def dtypes(mesh, rank):
    """Every case on the real mesh: this rank's block, or the error (compared by the test with
    the simulated mesh's result); then a float psum, which must run (the mesh stays in step)."""
    for dtype in DTYPES:
        for name in DTYPE_PROGRAMS:
            try:
                out = {"value": described(ns.to_local(dtype_call(mesh, dtype, name)))}
            except Exception as e:  # noqa: BLE001 - a bare torch error is a finding too
                out = {"error": type(e).__name__, "message": str(e)}
            line = {"rank": rank, "phase": "dtype", "dtype": str(dtype), "op": name, **out}
            print("OUTCOME " + json.dumps(line), flush=True)
    report(rank, "dtypes_then", lambda: good_call(mesh))


def main() -> None:
    scenario = sys.argv[1]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if scenario == "in_make_mesh":
        return in_make_mesh(rank)
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    globals()[scenario](mesh, rank)


if __name__ == "__main__":
    main()
