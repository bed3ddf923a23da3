"""Launch N local processes of one script as a torch.distributed job on 127.0.0.1 (tests only).

Every process gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (env:// rendezvous
on loopback) and a hard timeout: a hung job is killed and reported, never waited on.

No port is picked, released and hoped for: the rendezvous store is created here, listening on
port 0 (the kernel assigns a free port atomically with the bind) and kept open for the whole job,
and the workers are told ``store.port``. Nothing else can take that port between the choice and
the bind, which is the race the old ``free_port()`` had.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        OMP_NUM_THREADS="1",
        MKL_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        TORCH_CPP_LOG_LEVEL="ERROR",
        GLOO_SOCKET_IFNAME=env.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    env.update(extra)
    return env


@dataclass
class Finished:
    returncodes: list[int | None]
    outputs: list[str]
    seconds: float
    timed_out: bool

    def lines(self, prefix: str) -> list[str]:
        return [
            line[len(prefix) :].strip()
            for out in self.outputs
            for line in out.splitlines()
            if line.startswith(prefix)
        ]


def agent_store():
    """Host the rendezvous store in this process, as torchrun's agent does, so that it outlives
    the workers (a worker that exits early must not take the store of the others with it).

    It listens on 127.0.0.1, port 0: the port is the kernel's choice and stays bound from that
    moment; read it from ``store.port``. ``wait_for_workers=False``: the workers connect when
    they start (torchrun's agents use it as their c10d rendezvous store, see test_torchrun.py)."""
    from torch.distributed import TCPStore

    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, multi_tenant=True)


def launch(args: list[str], nproc: int, timeout: float, **env: str) -> Finished:
    """Run ``python *args`` as ranks 0..nproc-1 of one job; kill everything after ``timeout``."""
    store = agent_store()
    port = str(store.port)
    env = {"TORCHELASTIC_USE_AGENT_STORE": "True", **env}
    procs: list[subprocess.Popen] = []
    logs: list = []
    t0 = time.monotonic()
    for rank in range(nproc):
        e = child_env(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            **env,
        )
        # a file, not a pipe: a rank whose pipe nobody reads (collect waits for the ranks in
        # order) would block once it printed 64 KiB, and its peers with it in a collective
        logs.append(tempfile.TemporaryFile("w+"))
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                env=e,
                cwd=ROOT,
                stdout=logs[-1],
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    try:
        return collect(procs, logs, timeout, t0)
    finally:
        del store
        for log in logs:
            log.close()


def collect(procs: list[subprocess.Popen], logs: list, timeout: float, t0: float) -> Finished:
    timed_out = False
    for p in procs:
        left = max(0.1, timeout - (time.monotonic() - t0))
        try:
            p.wait(timeout=left)
        except subprocess.TimeoutExpired:
            timed_out = True
            p.kill()
            p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
    return Finished([p.returncode for p in procs], outputs, time.monotonic() - t0, timed_out)


def report_outcomes(names, run) -> None:
    """In a launched worker (2 processes): ``run(name, mesh)`` for every program on a real mesh
    of axis "x", printed as one ``OUTCOME {json}`` line each for :func:`Finished.lines`."""
    import json

    import torch.distributed as dist

    import named_spmd as ns

    dist.init_process_group("gloo")
    mesh = ns.make_mesh((2,), ("x",))
    for name in names:
        print("OUTCOME " + json.dumps({"rank": dist.get_rank(), "name": name, **run(name, mesh)}))
    sys.stdout.flush()
    dist.destroy_process_group()
