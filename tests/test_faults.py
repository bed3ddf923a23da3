"""Faults on a real mesh (4 gloo processes, tests/faults_worker.py): every surviving rank stops
within a bound, with an error that names the failing or missing rank, or recovers.

What each launch provokes is in faults_worker.py's docstring. Related launches elsewhere:
a rank raising inside the function and mismatched collectives in debug mode
(test_distributed.py, dist_worker.py), calls after a caught error (recovery.py), a rank hanging
past NAMED_SPMD_TIMEOUT (hanging_rank.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import launch  # noqa: E402

pytestmark = pytest.mark.distributed

WORLD = 4
COORDS = {0: "dp=0, tp=0", 1: "dp=0, tp=1", 2: "dp=1, tp=0", 3: "dp=1, tp=1"}


def run_lines(scenario: str, timeout: float = 120) -> tuple[list[dict], str]:
    finished = launch(
        [os.path.join("tests", "faults_worker.py"), scenario],
        WORLD,
        timeout,
        NAMED_SPMD_TIMEOUT="30",
    )
    tail = "\n".join(f"--- rank {r}\n{o[-1500:]}" for r, o in enumerate(finished.outputs))
    assert not finished.timed_out, tail
    return [json.loads(line) for line in finished.lines("OUTCOME")], tail


@contextlib.contextmanager
def busy(n: int):
    """``n`` processes spinning on the CPU while the block runs: the ranks wait for one another
    in slices and race on the store under contention, where the timing-dependent faults show."""
    spin = [
        sys.executable,
        "-c",
        "import time\nt = time.monotonic() + 300\nwhile time.monotonic() < t: pass",
    ]
    procs = [subprocess.Popen(spin) for _ in range(n)]
    try:
        yield
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.fixture(scope="module")
def loaded():
    """One launch, under load, for the scenarios of the tests below that share it (each part on
    a mesh of its own): the dtype matrix, meshes made again, ranks that never needed the failing
    one, and debug mode's mismatches caught again and again."""
    with busy(1):
        scenarios = "dtypes+mesh_again+bystanders+bystanders_nccl_path+debug_mismatch"
        scenarios += "+written_after_use"  # (last: it leaves its mesh out of step)
        lines, tail = run_lines(scenarios, timeout=300)
    return lines, {(o["rank"], o["phase"]): o for o in lines}, tail


def run(scenario: str) -> tuple[dict[tuple[int, str], dict], str]:
    lines, tail = run_lines(scenario)
    return {(o["rank"], o["phase"]): o for o in lines}, tail


def named(rank: int) -> str:
    return f"rank {rank} (mesh coordinates {COORDS[rank]})"


def test_mismatched_shapes_and_axes_raise_on_every_rank_and_the_next_call_runs():
    outcomes, tail = run("mismatch")
    for rank in range(WORLD):
        for phase in ("shapes", "shapes_debug"):  # no C++ abort: one listing on every rank
            o = outcomes.get((rank, phase))
            assert o is not None and o["error"] == "SpmdError", (o, tail)
            assert f"{named(3)}: " in o["message"] and "([16] float32)" in o["message"], o
            assert f"{named(0)}: " in o["message"] and "([8] float32)" in o["message"], o
            assert "Fix:" in o["message"], o
        o = outcomes.get((rank, "grad"))  # raised in the forward pass, not hung in backward
        assert o is not None and o["error"] == "SpmdError", (o, tail)
        assert f"{named(3)}: " in o["message"] and "([8] float32 requires_grad)" in o["message"]
        assert f"{named(0)}: " in o["message"] and "([8] float32)" in o["message"], o
        o = outcomes[rank, "axes_debug"]  # every rank reports what every rank called
        assert o["error"] in ("SpmdError", "RankFailedError"), o
        for r in range(WORLD):
            axes = "('dp',)" if r < 2 else "('tp',)"
            assert f"{named(r)}: psum([2], torch.float32, axes={axes})" in o["message"], o
        o = outcomes[rank, "axes"]  # without debug mode: nobody returns from the second call
        assert o["error"] in ("SpmdError", "RankFailedError"), o
        assert "called different collectives in spmd_map call #" in o["message"], o
        assert "finished that call without joining it" in o["message"], o
        assert o["seconds"] < 25, o  # learned from its exit, not at the 30 s timeout
        for phase in ("carried_0", "carried_1", "carried_2", "carried_forgotten"):
            assert outcomes[rank, phase].get("ok"), outcomes[rank, phase]  # values and counts
        o = outcomes[rank, "apart"]  # rank 0 ran a psum first: one error on every rank
        assert o.get("error") == "SpmdError", (o, tail)
        assert "went apart before their first collective: members [1, 2, 3]" in o["message"], o
        assert "members [0] ran another collective first" in o["message"], o
        for phase in ("permute_odd", "permute_apart"):
            o = outcomes[rank, phase]  # one error on every rank, the next call right
            assert o.get("error") == "SpmdError", (o, tail)
        assert "different shapes" in outcomes[rank, "permute_odd"]["message"]
        o = outcomes[rank, "permute_apart"]  # rank 0 ran a psum first
        assert "went apart before their first collective: members [1, 2, 3]" in o["message"], o
        assert "ran a ppermute first" in o["message"], o
        assert "members [0] ran another collective first" in o["message"], o
        first = "ran a ppermute first (pairs or axes"
        o = outcomes[rank, "permute_axes"]  # one first ppermute, apart in its axes alone
        assert o.get("error") == "SpmdError", (o, tail)
        assert "went apart before their first collective" in o["message"], o
        assert f"members [0] of the mesh {first}" in o["message"], o
        assert f"members [1, 2, 3] {first}" in o["message"], o
        o = outcomes[rank, "permute_dtype"]  # rank 1's operand of another dtype: its flag set
        assert o.get("error") == "SpmdError", (o, tail)
        dtypes = "different dtypes ['float32', 'int32', 'float32', 'float32']"
        assert "ppermute in `permute_swapped.<locals>.swap` (_faults_carried.py:" in o["message"]
        assert dtypes in o["message"], o
        for phase in ("permute_axes", "permute_dtype"):
            assert outcomes[rank, phase]["seconds"] < 10, o  # at once, not at the 30 s timeout
        o = outcomes[rank, "even_permute_apart"]  # rank 0 ran a psum first: one error everywhere
        assert o.get("error") == "SpmdError", (o, tail)
        assert "went apart before their first collective: members [1, 2, 3]" in o["message"], o
        assert "members [0] ran another collective first" in o["message"], o
        o = outcomes[rank, "halos_apart"]  # rank 0 ran a psum between the two ppermutes
        assert o.get("error") == "SpmdError", (o, tail)
        assert "went apart before their first collective" in o["message"], o
        assert "members [0] of the mesh ran a ppermute first," in o["message"], o
        assert "members [1, 2, 3] ran 2 ppermutes first" in o["message"], o
        o = outcomes[rank, "halos_caught"]  # the same error caught, its unmade result returned
        assert o.get("error") == "SpmdError", (o, tail)
        assert "read or returned after the exchange that carried it failed" in o["message"], o
        halos = [f"halos_{n}_{v}" for n in ("halos", "write", "ring", "unread") for v in "12"]
        halos += ["halos_halos_plan", "halos_grad_plan", "halos_grad", "halos_apart_then"]
        halos += ["halos_read", "halos_raise_then_then", "halos_kinds_plan", "halos_kinds"]
        halos += ["halos_piece_plan", "halos_piece", "halos_caught_plan", "halos_caught_then"]
        halos += [f"halos_derivative{p}" for p in ("_plan", "", "_transform")]
        halos += ["halos_wide_0", "halos_wide_1"]  # two 4096-byte operands ride together
        halos += [f"halos_{n}_{v}" for n in ("nested", "pairs") for v in "012"]  # (read deep)
        for phase in halos:
            assert outcomes[rank, phase].get("ok"), outcomes[rank, phase]
        o = outcomes[rank, "halos_raise"]  # rank 0 raised before its ppermutes' exchange
        assert o.get("error" if rank == 0 else "ok") == ("ValueError" if rank == 0 else True), o
        assert outcomes[rank, "halos_raise_then"].get("error") == "RankFailedError"
        o = outcomes[rank, "uneven_halos_odd"]  # rank 1's halos of another row count
        assert o.get("error") == "SpmdError", (o, tail)
        assert "different shapes" in o["message"], o
        uneven = ("plan", "1", "2", "grad_plan", "grad", "rows", "rows_then", "after")
        uneven += ("after_then",)
        for phase in (f"uneven_halos_{p}" for p in uneven):
            assert outcomes[rank, phase].get("ok"), outcomes[rank, phase]
        even = ("plan", "1", "2", "rows", "forgotten", "apart_then", "after")
        phases = tuple(f"even_permute_{p}" for p in even)
        phases += ("shapes_then", "grad_then", "shapes_debug_then", "axes_debug_then")
        phases += tuple(f"permute_{p}" for p in ("0", "1", "2", "rows", "odd_then", "forgotten"))
        phases += ("permute_after", "permute_apart_then", "permute_swap_0", "permute_swap_1")
        phases += ("permute_axes_then", "permute_dtype_then")
        for phase in ("carried_after", "apart_plan", "apart_then", *phases):
            assert outcomes[rank, phase].get("ok"), outcomes[rank, phase]


def test_a_killed_rank_is_named_by_every_peer():
    outcomes, tail = run("sigkill")
    assert sorted(r for r, _ in outcomes) == [0, 1, 3], tail
    for o in outcomes.values():
        assert o["error"] == "RankFailedError", o
        assert f"{named(2)} died without reporting an error" in o["message"], o
        assert "SIGKILL" in o["message"], o
        assert o["seconds"] < 25, o  # learned from its exit, not at the 30 s timeout


def test_ranks_left_waiting_name_the_rank_that_finished_the_call_and_exited():
    outcomes, tail = run("axes_exit")
    for rank in (2, 3):  # their own groups completed: nothing tells them, they return
        assert outcomes[rank, "axes_exit"].get("ok"), (outcomes, tail)
    for rank in (0, 1):
        o = outcomes[rank, "axes_exit"]
        assert o["error"] == "RankFailedError", o
        assert f"{named(2)} exited normally" in o["message"] or (
            f"{named(3)} exited normally" in o["message"]
        ), o
        assert "after finishing spmd_map call #1" in o["message"], o
        assert "called different collectives" in o["message"], o
        assert o["seconds"] < 25, o  # learned from its exit, not at the 30 s timeout


def test_ranks_that_gave_up_exit_and_the_late_rank_does_not_pair_with_their_collective():
    """A rank that stops waiting leaves its collective in flight. Destroying that gloo group at
    exit joins its worker thread, which waits until a peer completes the collective: the ranks
    that gave up hung at exit until the late rank arrived and paired with them (it returned a
    sum), and under load the same wait made a survivor of a killed rank hang at exit."""
    outcomes, tail = run("late_rank")
    for rank in (0, 1, 3):
        o = outcomes[rank, "late_rank"]
        assert o["error"] == "RankFailedError", o
        assert "Rank 2 (mesh coordinates dp=1, tp=0) never reached a collective" in o["message"]
    assert outcomes[2, "late_rank"]["error"] == "RankFailedError", tail  # not a sum
    assert outcomes[2, "waited"]["seconds"] < 20, tail


def test_a_rank_calling_once_more_names_the_ranks_that_did_not():
    outcomes, tail = run("once_more")
    for rank in range(WORLD):
        assert outcomes[rank, "first"].get("ok"), (outcomes, tail)
    o = outcomes[0, "once_more"]
    assert o["error"] == "RankFailedError", o
    assert (
        "exited normally after 1 spmd_map calls on this mesh, without making call #2"
        in (o["message"])
    ), o
    assert o["seconds"] < 15, o


def test_a_rank_failing_right_after_make_mesh_is_named_by_its_peers():
    outcomes, tail = run("make_mesh")
    assert sorted(r for r, _ in outcomes) == [0, 2, 3], tail  # nobody died inside make_mesh
    for o in outcomes.values():
        assert o["error"] == "RankFailedError", o
        assert (
            f"{named(1)} exited on an uncaught ValueError: rank 1 raises right after"
            in (o["message"])
        ), o
        assert o["seconds"] < 25, o  # learned from its exit, not at the 30 s timeout


def test_a_mesh_drops_its_process_groups_before_the_interpreter_finalizes():
    """A gloo group still referenced when finalization frees it can abort the process after a
    successful run (docs/repros/gloo_teardown_abort.py). The library's atexit handler must leave
    none of a mesh's groups alive for finalization (without it, both of the worker's groups are
    still referenced at exit)."""
    finished = launch([os.path.join("tests", "teardown_worker.py")], 2, 120)
    tail = finished.outputs[0][-3000:]
    assert not finished.timed_out and finished.returncodes == [0, 0], tail
    assert finished.lines("GROUPS_MADE") == ["2", "2"], tail
    assert finished.lines("GROUPS_ALIVE_AT_EXIT") == ["0", "0"], tail


def test_a_rank_failing_inside_make_mesh_is_named_with_its_error():
    """Its process registered but made no mesh: its exit must still be recorded, or its peers
    call it killed (under load a make_mesh that times out would be reported as a SIGKILL).
    Timed: make_mesh once the backend is imported (its imports are no part of the failure)."""
    outcomes, tail = run("in_make_mesh")
    assert sorted(r for r, p in outcomes if p == "in_make_mesh") == [0, 2, 3], tail
    for rank in (0, 2, 3):  # the real mesh's eager path, its failure's too, imports no Dynamo
        assert outcomes[rank, "eager_without_dynamo"].get("ok"), outcomes[
            rank, "eager_without_dynamo"
        ]
        o = outcomes[rank, "in_make_mesh"]
        assert o["error"] == "RankFailedError", o
        assert (
            f"{named(1)} to create the mesh's process groups, but it exited on an uncaught "
            "ValueError: rank 1 raises inside make_mesh" in o["message"]
        ), o
        assert o["seconds"] < 25, o  # learned from its exit, not at the 30 s timeout


def _board(store, rank: int):
    """Rank ``rank``'s failure board of a 4-rank mesh "m" on ``store``, in its first call."""
    from named_spmd.backends import _dist_failures as failures

    b = failures.FailureBoard(store, rank, [0, 1, 2, 3], "m", lambda r: {"i": r})
    b.begin_call()
    return b


def test_a_peer_that_gave_up_waiting_is_quoted_not_described_by_its_exit():
    """Rank 3 gives up waiting for a hanging rank 2, posts what it found and exits; rank 1,
    seeing rank 3's exit before reading the post, must quote the post, not describe the exit
    ("exited normally after call #1 raised on it") and overwrite it, or rank 0 never learns
    that rank 2 was the one missing. In one process, with an in-memory store."""
    import torch.distributed as dist

    from named_spmd.backends import _dist_processes as processes

    store = dist.HashStore()
    ranks = [0, 1, 2, 3]

    gave_up = _board(store, 3)
    gave_up.post_for(3, "gave up waiting: Rank 2 (mesh coordinates i=2) never reached a collective")
    processes.mark_exited(store, 3, [gave_up])
    for rank in (1, 0):  # rank 1 first: it must leave the post as it found it
        err = _board(store, rank).gone_error([r for r in ranks if r != rank], "in psum over ('i',)")
        assert "Rank 2 (mesh coordinates i=2) never reached a collective" in str(err), str(err)
        assert "exited normally" not in str(err)


def test_a_rank_that_made_the_mesh_and_died_later_does_not_fail_the_make_mesh_barrier():
    """Rank 1 reads rank 2's "made" key as missing; before it asks whether rank 2 has ended,
    rank 2 sets its key, enters the call and is killed there: rank 1 must not blame make_mesh
    for it (the call reports it). Forced in one process: a store whose first read of rank 2's
    key comes just before rank 2 makes the mesh and dies."""
    import socket
    import subprocess

    import torch.distributed as dist

    from named_spmd.backends import _dist_failures as failures
    from named_spmd.backends import _dist_processes as processes

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    ranks = [0, 1, 2, 3]

    class RankTwoMakesThenDies:
        def __init__(self):
            self.inner = dist.HashStore()
            self.raced = False

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def check(self, keys):
            seen = self.inner.check(keys)
            if not self.raced and keys[0].endswith("/made/2") and len(keys) == 1:
                self.raced = True  # the read said "missing"; now rank 2 makes the mesh and dies
                self.inner.set(keys[0], "")
                self.inner.set(
                    f"{processes._PROCESS}/2", f"{socket.gethostname()}\n{dead.stdout.strip()}"
                )
            return seen

    store = RankTwoMakesThenDies()
    for rank in (0, 3):
        store.set(f"named_spmd/m/failure/made/{rank}", "")
    failures.FailureBoard(store, 1, ranks, "m", lambda r: {"i": r}).made()  # must not raise
    assert store.raced


def test_a_rank_outside_a_ppermute_finishing_first_is_not_a_mismatch():
    """Only the ranks a ppermute exchanges with can leave a rank waiting (found by a load run:
    rank 0 waited for a slow sender and named rank 1, which had no part in the exchange)."""
    outcomes, tail = run("slow_sender")
    for rank in range(WORLD):
        assert outcomes[rank, "slow_sender"].get("ok"), (outcomes[rank, "slow_sender"], tail)


def _block(y, spec, coords: dict[str, int]):
    """Rank ``coords``'s block of the global ``y`` under ``spec``, as its DTensor holds it (the
    placements in mesh order: a non-mesh-order tuple entry is held in mesh order too)."""
    for d, entry in enumerate(spec):
        axes = [
            a for a in ("dp", "tp") if a in ((entry,) if isinstance(entry, str) else entry or ())
        ]
        index, n = 0, 1
        for a in axes:
            index, n = index * 2 + coords[a], n * 2
        y = y.chunk(n, d)[index] if axes else y
    return y


def _torch_can(run) -> bool:
    try:
        run()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


def test_every_dtype_through_every_collective_matches_the_simulated_mesh(loaded):
    """gloo lacks dtypes (int16, the unsigned 16- to 64-bit integers, float8, bit dtypes); sent
    as they are, a collective on them fails mid-call ("a peer process on another host probably
    died") and the ranks fall out of step. Every dtype torch has
    (but the quantized ones) through every collective and the call boundary's communication,
    on 4 gloo processes: each rank's block, byte for byte, or the same error, as the simulated
    mesh; reductions refused exactly where torch has no kernel; the mesh still runs after."""
    import _faults_dtypes as w
    import torch

    import named_spmd as ns

    lines, outcomes, tail = loaded
    got = {(o["rank"], o["dtype"], o["op"]): o for o in lines if o["phase"] == "dtype"}
    assert len(got) == WORLD * len(w.DTYPE_CASES), tail
    sim = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    mismatches = []
    for dtype, name in w.DTYPE_CASES:
        out_spec = w.program(name)[2]
        try:
            want_global = w.dtype_call(sim, dtype, name)
            want_error = None
        except Exception as e:  # noqa: BLE001 - compared with the real mesh's error
            want_error = {"error": type(e).__name__, "message": str(e)}
        for rank in range(WORLD):
            o = got[rank, str(dtype), name]
            if want_error is not None:
                if {k: o.get(k) for k in want_error} != want_error:
                    mismatches.append((str(dtype), name, rank, want_error, o))
                continue
            coords = {"dp": rank // 2, "tp": rank % 2}
            want = w.described(_block(want_global, out_spec, coords))
            if o.get("value") != want:
                mismatches.append((str(dtype), name, rank, want, o))
    assert not mismatches, (len(mismatches), mismatches[:4])
    for dtype, name in w.DTYPE_CASES:  # a conjugate view refused exactly where its values are
        if name.endswith(w.CONJUGATED):
            plain = got[0, str(dtype), name.removesuffix(w.CONJUGATED)]
            assert ("value" in got[0, str(dtype), name]) == ("value" in plain), (name, plain)
    # what is refused, as a CollectiveError with its fix: reductions torch cannot compute
    # itself, and every collective on a dtype torch cannot copy (the sub-byte ones); never the
    # call boundary's own communication
    reductions = {"psum": "sum", "psum_tp": "sum", "pmean": "sum", "psum_scatter": "sum"}
    reductions.update(pmax="amax", pmin="amin")
    boundary = ("unchecked_broadcast", "reordered")
    for dtype in w.DTYPES:
        copyable = _torch_can(lambda: torch.empty(2, dtype=dtype).clone())
        for name in w.DTYPE_PROGRAMS:
            o = got[0, str(dtype), name]
            if name in boundary or (copyable and name not in reductions):
                assert "value" in o, o
                continue
            reduces = name not in reductions or _torch_can(
                lambda: getattr(torch, reductions[name])(torch.zeros(2, dtype=dtype), 0)
            )
            mean_of_integers = name == "pmean" and not (dtype.is_floating_point or dtype.is_complex)
            complex_order = name in ("pmax", "pmin") and dtype.is_complex
            if copyable and reduces and not mean_of_integers and not complex_order:
                assert "value" in o, o
            else:
                assert o.get("error") == "CollectiveError" and "Fix:" in o["message"], o
    for rank in range(WORLD):  # the int16 psum of the report returns a sum on every rank
        assert "value" in got[rank, "torch.int16", "psum"], got[rank, "torch.int16", "psum"]
        assert outcomes[rank, "dtypes_then"].get("ok"), (outcomes[rank, "dtypes_then"], tail)


def test_a_mesh_made_again_with_the_same_axes_does_not_read_the_earlier_ones_failure(loaded):
    """A mesh made again with the same axes and grid counts its calls from 1 again: its slow
    waits must not read the earlier mesh's failure (posted for a later call number) or where
    its ranks waited, which would stop it with a RankFailedError or a "different collectives"
    error. Twice: fail on a mesh, make it again, run late."""
    _, outcomes, tail = loaded
    for i in range(2):
        for rank in range(WORLD):
            assert outcomes[rank, f"again_{i}_first"].get("ok"), (
                outcomes[rank, f"again_{i}_first"],
                tail,
            )
            o = outcomes[rank, f"again_{i}_failed"]
            if rank == 0:
                assert o["error"] == "ValueError", o
            else:
                assert (
                    o["error"] == "RankFailedError" and f"{named(0)} failed inside" in o["message"]
                )
            o = outcomes[rank, f"again_{i}_new"]  # two right sums, rank 3 late past the grace
            assert o.get("ok"), (o, tail)


def test_ranks_that_never_needed_the_failing_rank_stop_at_their_next_call_naming_it(loaded):
    """Ranks that never communicated with the failing rank return from the failed call; their
    next call must stop naming the failing rank and its error (not another rank's out-of-step
    error, which left the failing rank named nowhere)."""
    _, outcomes, tail = loaded
    _stopped_at_the_next_call(outcomes, tail, "")
    for rank in (2, 3):  # their tp group completed without rank 0
        assert outcomes[rank, "by_tp"].get("ok"), outcomes[rank, "by_tp"]
        o = outcomes[rank, "by_tp_next"]
        assert o["error"] == "RankFailedError", o
        assert (
            f"{named(0)} failed inside spmd_map: ValueError: rank 0 fails before the psum over tp"
            in o["message"]
        ), o
        assert o["seconds"] < 25, o  # learned from its exit, not at the 30 s timeout
    assert outcomes[1, "by_tp"]["error"] == "RankFailedError", outcomes[1, "by_tp"]
    for rank in (0, 1):  # left inside a collective with rank 0 (rank 1): out of step
        o = outcomes[rank, "by_tp_next"]
        assert o["error"] == "SpmdError" and "restart the job" in o["message"], o


def _stopped_at_the_next_call(outcomes: dict, tail: str, label: str) -> None:
    """Rank 0 failed where no rank needed it: every rank stops at its next call naming it, and
    the call after runs (faults_worker.bystanders)."""
    for rank in range(WORLD):
        o = outcomes[rank, f"{label}alone_0"]
        assert o.get("ok") if rank else o["error"] == "ValueError", (o, tail)
        o = outcomes[rank, f"{label}alone_0_next"]  # every rank alike, before any collective
        assert o["error"] == "RankFailedError", o
        assert (
            f"{named(0)} failed inside spmd_map: ValueError: rank 0 fails where nobody"
            in (o["message"])
        ), o
        assert "Ranks [1, 2, 3] finished that call (spmd_map call #1)" in o["message"], o
        then = outcomes[rank, f"{label}alone_0_then"]
        assert then.get("ok"), (then, tail)


def test_bystanders_stop_naming_the_failing_rank_on_nccls_path_too(loaded):
    """The start-of-call check runs on every device type (on a gloo group of its own where the
    mesh's groups are not polled, as NCCL's): a mesh forced onto NCCL's path on gloo stops the
    ranks that never needed the failing rank at their next call, naming it, as a gloo mesh."""
    _, outcomes, tail = loaded
    _stopped_at_the_next_call(outcomes, tail, "nccl_")


def test_a_parameter_written_after_its_use_on_one_rank_fails_every_rank_alike(loaded):
    """Autograd would refuse the write in rank 1's backward pass only, while its peers waited
    for it in the gradient sum: rank 1 raises the call's SpmdError in the forward pass, and
    its peers stop in their backward pass with RankFailedError quoting it, none at a timeout
    (faults_worker.written_after_use). Before it, an input that requires no grad written by
    every rank after ``x * w`` saved it: the call's SpmdError on every rank, in the forward
    pass, and the mesh stays in step (the parameter's phase runs)."""
    _, outcomes, tail = loaded
    said = "the function wrote in place into an input (argument [1])"
    for rank in range(WORLD):
        o = outcomes[rank, "written_unwatched"]
        assert o["error"] == "SpmdError" and said in o["message"], (o, tail)
    for rank in range(WORLD):
        o = outcomes[rank, "written"]
        assert o["error"] == ("SpmdError" if rank == 1 else "RankFailedError"), (o, tail)
        assert said in o["message"] and "after an op saved it for the backward" in o["message"]
        if rank != 1:
            assert f"{named(1)} failed inside spmd_map: SpmdError: " in o["message"], o
        assert o["seconds"] < 25, o  # told by rank 1, not at the 30 s timeout


def test_debug_mode_lists_mismatched_collectives_and_the_mesh_stays_usable(loaded):
    """Debug mode names a rank-dependent order of collectives as such (the lists are compared
    before the values: not blamed on per-rank random seeds); an extra collective on some ranks
    is listed without the full wait; and after a mismatch within one group, the members of
    another group decide alike whether to go on (one going into its collective while its
    partner leaves would put the mesh out of step for every later call). Each mismatch four times (the order and the extra collective once),
    each followed by a call that must give the right sum."""
    _, outcomes, tail = loaded
    phases = sorted({p for _, p in outcomes if p.startswith("debug_") and not p.endswith("_then")})
    assert len(phases) == 2 + 6 * 4, phases
    for rank in range(WORLD):
        for phase in phases:
            o = outcomes[rank, phase]
            assert o["error"] in ("SpmdError", "RankFailedError"), (o, tail)
            assert "Every rank" in o["message"] and "Fix:" in o["message"], o
            assert o["seconds"] < 15, o  # not the exchange's full wait
            then = outcomes[rank, phase + "_then"]
            assert then.get("ok"), (phase, then, tail)
        o = outcomes[rank, "debug_order_0"]  # the lists, not the values
        assert "ran different collectives" in o["message"] and "manual_seed" not in o["message"]
        assert "pmax([2], torch.float32, axes=('tp',)); psum([2]" in o["message"], o
        assert "psum([2], torch.float32, axes=('dp',)); pmax([2]" in o["message"], o
        o = outcomes[rank, "debug_extra_0"]  # listed: rank 3 finished without the second psum
        assert "ranks [3] finished the call without collective #1" in o["message"], o


def test_a_debug_exchange_decides_alike_for_every_member_of_the_group():
    """The race behind "restart the job" after caught debug mismatches, in one process: rank 2
    sees a failure posted by another group (rank 0) before its partner's value, and leaves; rank
    3 then finds both values present. Before the group's decision, rank 3 went on into the
    collective, which rank 2 never joins: the mesh fell out of step."""
    import torch.distributed as dist

    import named_spmd as ns
    from named_spmd.backends._dist_exchange import exchange

    store = dist.HashStore()

    _board(store, 0).post_for(0, "failed inside spmd_map: SpmdError: a mismatch within group 0+1")
    two, three = _board(store, 2), _board(store, 3)
    with pytest.raises(ns.RankFailedError, match="a mismatch within group 0"):
        exchange(two, "tp@2", [2, 3], "psum([2])", "rank 2", "collective #0 of group tp@2")
    with pytest.raises(ns.RankFailedError, match="a mismatch within group 0"):
        exchange(three, "tp@2", [2, 3], "psum([2])", "rank 3", "collective #0 of group tp@2")


class _Work:
    """A collective's work that completes ``after`` seconds from now (``math.inf``: never),
    waited for in slices as a gloo work is."""

    def __init__(self, after: float) -> None:
        import time

        self.done_at = time.monotonic() + after

    def wait(self, timeout) -> bool:
        import time

        left = self.done_at - time.monotonic()
        if left <= timeout.total_seconds():
            time.sleep(max(left, 0.0))
            return True
        time.sleep(timeout.total_seconds())
        raise RuntimeError("Timed out waiting for the work")


@pytest.mark.parametrize(
    "members, after, completes",
    [([2, 3], 0.6, True), ([2, 3], float("inf"), False), ([0, 2], float("inf"), False)],
    ids=["outside_completes", "outside_never", "member_never"],
)
def test_a_failure_posted_elsewhere_ends_a_wait_only_for_a_collective_that_cannot_complete(
    members, after, completes
):
    """Rank 0 failed while rank 2 waits in a collective of ``members``: one of its own group
    (rank 0 outside it) completes all the same, and rank 2 goes on, its collective not counted
    as stuck; one that cannot complete (rank 0 a member, or a member stopped) ends in a
    RankFailedError naming rank 0 and marks the call stuck. In one process, an in-memory store."""
    import datetime

    import torch.distributed as dist

    import named_spmd as ns
    from named_spmd.backends import _dist_waiting as waiting

    store = dist.HashStore()

    _board(store, 0).post_for(0, "failed inside spmd_map: ValueError: on rank 0")
    two, slice_ = _board(store, 2), datetime.timedelta(seconds=0.2)
    if completes:
        waiting.wait(two, _Work(after), "in psum over ('i',)", slice_, members)
    else:
        with pytest.raises(ns.RankFailedError, match="ValueError: on rank 0"):
            waiting.wait(two, _Work(after), "in psum over ('i',)", slice_, members)
    assert store.add(two.stuck_key(two.seq), 0) == (0 if completes else 1)


def test_dtypes_gloo_lacks_are_reduced_through_a_wider_dtype_exactly():
    """The wire forms of _dist_comm (both the eager and the compiled collectives use them), in
    one process: int16/uint16/uint32 sums wrap as in their own dtype after the cast back; uint64
    read as int64 bits sums modulo 2**64 and, XORed with the sign bit, keeps the order (max,
    min) of the unsigned values; a bool sum is an "or"; a complex value is reduced as pairs of
    reals; a dtype gloo cannot move travels as its bytes, bit for bit."""
    import torch

    from named_spmd.backends import _dist_comm as comm

    def summed(parts):  # what the backend does to the wires, then the way back
        wire, back = comm.reduce_wire(parts[0].clone(), True, "test")
        for p in parts[1:]:
            wire = wire + comm.reduce_wire(p.clone(), True, "test")[0]
        return back(wire)

    g = torch.Generator().manual_seed(0)
    for dtype, bits in ((torch.int16, 16), (torch.uint16, 16), (torch.uint32, 32)):
        lo, top = (-(2 ** (bits - 1)), 2 ** (bits - 1)) if dtype.is_signed else (0, 2**bits)
        parts = [torch.randint(lo, top, (64,), generator=g).to(dtype) for _ in range(4)]
        total = torch.stack([p.to(torch.int64) for p in parts]).sum(0)
        want = ((total - lo) % 2**bits + lo).to(dtype)  # the sum wrapped into the dtype
        assert torch.equal(summed(parts), want), dtype
    values = [0, 1, 2**63 - 1, 2**63, 2**64 - 1, 12345678901234567890]
    t = torch.tensor([v - 2**64 if v >= 2**63 else v for v in values]).view(torch.uint64)
    wire, back = comm.reduce_wire(t.clone(), False, "test")
    assert sorted(range(len(values)), key=lambda i: int(wire[i])) == sorted(
        range(len(values)), key=lambda i: values[i]
    )
    assert torch.equal(back(wire).view(torch.int64), t.view(torch.int64))  # the round trip
    flags = [torch.tensor([True, True, False, False]), torch.tensor([True, False, True, False])]
    assert summed(flags).tolist() == [True, True, True, False]
    z = [torch.randn(3, dtype=torch.complex64, generator=g) for _ in range(2)]
    assert torch.equal(summed(z), z[0] + z[1])
    # a conjugate view (the conj bit set) has no real view: reduced and moved as its values
    assert torch.equal(summed([z[0].conj(), z[1].conj()]), (z[0] + z[1]).conj())
    moved = comm.on_wire(z[0].conj(), lambda pairs: torch.stack([pairs, pairs]))
    assert torch.equal(moved, z[0].conj().resolve_conj().repeat(2, 1))
    f8 = torch.arange(16, dtype=torch.uint8).view(torch.float8_e4m3fn)
    moved = comm.on_wire(f8, lambda b: torch.stack([b, b]))  # an all_gather of 2, say
    assert moved.dtype == f8.dtype and moved.shape == (2, 16)
    assert torch.equal(moved.view(torch.uint8), torch.arange(16, dtype=torch.uint8).repeat(2, 1))
