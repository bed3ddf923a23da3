"""The launcher story: a tutorial-style script under ``torchrun``, on one node and on two.

tutorials/scripts/torchrun_demo.py trains a Megatron-style MLP for a few steps on a (dp, tp) mesh
of all processes and prints one ``RANK`` line per process (losses, a checksum of the trained
weights, the error against a dense single-device computation). Every launch runs on 127.0.0.1 with
free ports and a hard timeout. Budget: about 20 s per launch on a 2-core machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import ROOT, child_env, free_port  # noqa: E402

pytestmark = pytest.mark.distributed

SCRIPT = os.path.join("tutorials", "scripts", "torchrun_demo.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run"]
LINE = re.compile(
    r"RANK (\d+)/(\d+) host=\S+ mesh=(.*?) coords=(.*?) losses=(\[.*?\]) "
    r"checksum=(-?[0-9.]+) max_err_vs_dense=([0-9.e+-]+)"
)


def _env():
    env = child_env()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    return env


def _run(args, timeout):
    return subprocess.run(
        args, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=timeout
    )


def _ranks(text: str) -> dict[int, tuple]:
    return {int(m.group(1)): m.groups() for m in LINE.finditer(text)}


@pytest.fixture(scope="module")
def simulated():
    """The same script without torchrun: a simulated mesh of 4 in one process."""
    done = _run([sys.executable, SCRIPT], 120)
    assert done.returncode == 0, done.stderr[-3000:]
    (only,) = _ranks(done.stdout).values()
    assert "simulated" in only[2]
    return only


def _check_job(ranks: dict[int, tuple], simulated: tuple, world: int) -> None:
    assert sorted(ranks) == list(range(world)), ranks
    coords = set()
    for rank, (_, w, mesh, coord, losses, checksum, err) in ranks.items():
        assert int(w) == world and "distributed, cpu" in mesh, (rank, mesh)
        assert losses == simulated[4], (rank, losses, simulated[4])
        assert abs(float(checksum) - float(simulated[5])) < 1e-9, (rank, checksum)
        assert float(err) < 1e-12, (rank, err)
        coords.add(coord)
    assert len(coords) == world  # one mesh instance per process


def _one_node(*flags: str, script_args: tuple[str, ...] = ()):
    """``SCRIPT`` under torchrun, 4 processes on 127.0.0.1 (``flags``: more torchrun flags)."""
    return _run(
        [
            *TORCHRUN,
            "--nproc-per-node",
            "4",
            "--master-addr",
            "127.0.0.1",
            "--master-port",
            str(free_port()),
            *flags,
            SCRIPT,
            *script_args,
        ],
        240,
    )


def test_torchrun_one_node_four_processes(simulated):
    done = _one_node()
    if done.returncode != 0 and len(_ranks(done.stdout)) == 4 and "SIGABRT" in done.stderr:
        # Every rank finished and reported, then one aborted in interpreter teardown, after
        # destroy_process_group (torch/gloo's; seen once in ~40 launches, not reproduced):
        # one more launch, and the first failure stays in the message if that fails too.
        first = done.stderr[-1500:]
        done = _one_node()
        done.stderr += "\n[first attempt]\n" + first
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    _check_job(_ranks(done.stdout), simulated, 4)


def _two_nodes(deadline_s: float) -> list[tuple[int | None, str, str]]:
    """Two torchrun agents of two processes each, joined by a c10d rendezvous on 127.0.0.1."""
    node = [
        *TORCHRUN,
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{free_port()}",
        "--rdzv-id",
        "named-spmd-test",
        "--rdzv-conf",
        "join_timeout=60",
        "--max-restarts",
        "0",
        SCRIPT,
    ]
    procs = [
        subprocess.Popen(
            node, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    outs = []
    deadline = time.monotonic() + deadline_s
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                err += f"\n[test] killed after {deadline_s} s"
            outs.append((p.returncode, out, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outs


def test_torchrun_two_nodes_cooperate_as_one_mesh(simulated):
    # A second attempt on a fresh port only if the first one timed out: the free port can be
    # taken by another socket before the rendezvous binds it (rare, seen once under load).
    outs = _two_nodes(150)
    if any(rc is None or rc < 0 for rc, _, _ in outs):
        first = outs
        outs = _two_nodes(150)
        outs = [
            (rc, out, err + "\n[first attempt]\n" + e1[-1500:])
            for (rc, out, err), (_, _, e1) in zip(outs, first)
        ]
    for rc, out, err in outs:
        assert rc == 0, out[-2000:] + err[-3000:]
    per_node = [_ranks(out) for _, out, _ in outs]
    assert all(len(r) == 2 for r in per_node), per_node  # two processes on each "node"
    _check_job({**per_node[0], **per_node[1]}, simulated, 4)


def test_torchrun_failing_rank_is_named_by_every_rank():
    t0 = time.monotonic()
    done = _one_node("--monitor-interval", "1", script_args=("--fail-rank", "2"))
    assert done.returncode != 0
    assert time.monotonic() - t0 < 200
    text = done.stdout + done.stderr
    assert "[rank2]: RuntimeError: deliberate failure on rank 2" in text, text[-4000:]
    for rank in (0, 1, 3):
        assert re.search(
            rf"\[rank{rank}\]: named_spmd\._errors\.RankFailedError: rank 2 \(mesh coordinates "
            r"dp=1, tp=0\) failed inside spmd_map: RuntimeError: deliberate failure on rank 2",
            text,
        ), text[-4000:]
