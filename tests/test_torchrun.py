"""The launcher story: a tutorial-style script under ``torchrun``, on one node and on two.

tutorials/scripts/torchrun_demo.py trains a Megatron-style MLP for a few steps on a (dp, tp) mesh
of all processes and prints one ``RANK`` line per process (losses, a checksum of the trained
weights, the error against a dense single-device computation). Every launch runs on 127.0.0.1 with
a hard timeout. Budget: about 20 s per launch on a 2-core machine.

Ports: no port is chosen, released and then handed to torchrun (another socket could take it in
between). This process hosts the c10d rendezvous store on port 0 (``_dist_launch.agent_store``,
bound for the whole launch) and the agents join it as clients (``is_host=false``); the workers'
store is the agent's own, which torch creates on port 0 as well. No launch is retried: a failure
fails the test, with the output of every process.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import ROOT, agent_store, child_env  # noqa: E402

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


def _torchrun(
    nnodes: int, nproc: int, port: int, flags=(), script_args=(), script=SCRIPT
) -> list[str]:
    """One torchrun agent that joins the c10d rendezvous store at 127.0.0.1:``port``."""
    return [
        *TORCHRUN,
        "--nnodes",
        str(nnodes),
        "--nproc-per-node",
        str(nproc),
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        f"127.0.0.1:{port}",
        "--rdzv-id",
        "named-spmd-test",
        "--rdzv-conf",
        "is_host=false,join_timeout=60",
        "--local-addr",
        "127.0.0.1",
        "--max-restarts",
        "0",
        *flags,
        script,
        *script_args,
    ]


def _launch(nnodes: int, nproc: int, deadline_s: float, flags=(), script_args=(), script=SCRIPT):
    """``nnodes`` torchrun agents of ``nproc`` processes each, on 127.0.0.1; the rendezvous store
    is hosted here for the whole launch. Returns (returncode, stdout, stderr) per agent."""
    store = agent_store()
    cmd = _torchrun(nnodes, nproc, store.port, flags, script_args, script)
    procs = [
        subprocess.Popen(
            cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(nnodes)
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
        del store
    return outs


def test_torchrun_one_node_four_processes(simulated):
    ((rc, out, err),) = _launch(1, 4, 240)
    assert rc == 0, out[-2000:] + err[-3000:]
    _check_job(_ranks(out), simulated, 4)


def test_torchrun_two_nodes_cooperate_as_one_mesh(simulated):
    outs = _launch(2, 2, 150)
    for rc, out, err in outs:
        assert rc == 0, out[-2000:] + err[-3000:]
    per_node = [_ranks(out) for _, out, _ in outs]
    assert all(len(r) == 2 for r in per_node), per_node  # two processes on each "node"
    _check_job({**per_node[0], **per_node[1]}, simulated, 4)


def test_torchrun_stencil_on_a_grid_that_does_not_divide():
    """Tutorial 12's script: 10 rows over 4 processes, each holding its own block of torch.chunk's
    sizes (3, 3, 3, 1); every rank checks the grid and the gradients against the whole-grid
    computation and prints its largest error."""
    stencil = os.path.join("tutorials", "scripts", "stencil_halo.py")
    ((rc, out, err),) = _launch(1, 4, 240, script=stencil)
    assert rc == 0, out[-2000:] + err[-3000:]
    lines = re.findall(r"RANK (\d+)/4 blocks=\(3, 3, 3, 1\) max_err_vs_dense=(\S+)", out)
    assert sorted(int(r) for r, _ in lines) == [0, 1, 2, 3], out[-2000:]
    assert all(float(e) < 1e-12 for _, e in lines), lines


def test_torchrun_ragged_moe_trains_as_the_per_token_model():
    """Tutorial 13's script: a mixture of experts dispatched with ragged_all_to_all on 4 gloo
    processes (the sizes read on the host, only the rows sent), trained 3 steps; every rank's
    losses and trained weights equal a per-token loop's, and the loads changed between steps."""
    script = os.path.join("tutorials", "scripts", "ragged_moe.py")
    ((rc, out, err),) = _launch(1, 4, 240, script=script)
    assert rc == 0, out[-2000:] + err[-3000:]
    lines = re.findall(r"RANK (\d+)/4 loads=(\[.*\]) max_err_vs_reference=(\S+)", out)
    assert sorted(int(r) for r, _, _ in lines) == [0, 1, 2, 3], out[-2000:]
    assert all(float(e) < 1e-10 for _, _, e in lines), lines
    assert len({loads for _, loads, _ in lines}) == 1  # every rank saw the same routing
    assert len({str(load) for load in json.loads(lines[0][1])}) > 1  # the loads changed


def test_torchrun_failing_rank_is_named_by_every_rank():
    t0 = time.monotonic()
    ((rc, out, err),) = _launch(1, 4, 240, ("--monitor-interval", "1"), ("--fail-rank", "2"))
    assert rc != 0
    assert time.monotonic() - t0 < 200
    text = out + err
    assert "[rank2]: RuntimeError: deliberate failure on rank 2" in text, text[-4000:]
    for rank in (0, 1, 3):
        assert re.search(
            rf"\[rank{rank}\]: named_spmd\._errors\.RankFailedError: rank 2 \(mesh coordinates "
            r"dp=1, tp=0\) failed inside spmd_map: RuntimeError: deliberate failure on rank 2",
            text,
        ), text[-4000:]
