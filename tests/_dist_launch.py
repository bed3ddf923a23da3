"""Launch N local processes of one script as a torch.distributed job on 127.0.0.1 (tests only).

Every process gets RANK / WORLD_SIZE / LOCAL_RANK / MASTER_ADDR / MASTER_PORT (env:// rendezvous
on loopback) and a hard timeout: a hung job is killed and reported, never waited on.

No port is picked, released and hoped for: the rendezvous store is created here, listening on
port 0 (the kernel assigns a free port atomically with the bind) and kept open for the whole job,
and the workers are told ``store.port``. Nothing else can take that port between the choice and
the bind, which is the race the old ``free_port()`` had.

The ranks are forked from a server process that has imported torch already (:func:`serve`, one
per test process, started on first use): a rank then starts without importing torch anew (about
2.5 s of CPU per rank, of about 6 for a rank that makes a mesh; tens of launches per suite). A
forked rank is otherwise what ``python script args`` is: its own environment, working directory,
``sys.argv`` and ``__main__``, stdout and stderr in its log, and it ends through the
interpreter's own exit (an uncaught exception printed, ``sys.last_value`` set and ``atexit``
handlers run, the interpreter finalized), with the exit status ``subprocess`` reports
(tests/test_dist_launch.py). ``ps`` shows a rank with the server's command line.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import json
import os
import select
import signal
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
    server = _server()
    logs: list = []
    pids: list[int] = []
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
        logs.append(tempfile.NamedTemporaryFile("w+"))
        pids.append(server.fork(args, e, logs[-1].name))
    try:
        return collect(server, pids, logs, timeout, t0)
    finally:
        del store
        for log in logs:
            log.close()


def collect(server: _Server, pids: list[int], logs: list, timeout: float, t0: float) -> Finished:
    codes = server.wait(pids, t0 + timeout)
    timed_out = len(codes) < len(pids)
    if timed_out:
        codes.update(server.wait(pids, time.monotonic()))  # those that ended meanwhile
        stuck = [pid for pid in pids if pid not in codes]
        for pid in stuck:  # each writes every thread's stack to its log (faulthandler)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGUSR1)
        codes.update(server.wait(pids, time.monotonic() + 2.0))
        for pid in stuck:
            if pid not in codes:
                with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                    os.kill(pid, signal.SIGKILL)
        codes.update(server.wait(pids, float("inf")))
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
    return Finished([codes[p] for p in pids], outputs, time.monotonic() - t0, timed_out)


# --- the fork server: ranks forked from a process that has imported torch ---------------------


class _Lines:
    """Lines of JSON read from a pipe's fd, without a buffer that ``select`` cannot see."""

    def __init__(self, fd: int) -> None:
        self.fd, self.buf, self.eof = fd, b"", False

    def next(self, timeout: float | None) -> dict | None:
        """The next message; None at end of file or when ``timeout`` (seconds) passes first."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while b"\n" not in self.buf:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([self.fd], [], [], left)[0]:
                return None
            chunk = os.read(self.fd, 65536)
            if not chunk:
                self.eof = True
                return None
            self.buf += chunk
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


def _send(fd: int, message: dict) -> None:
    data = (json.dumps(message) + "\n").encode()
    while data:
        data = data[os.write(fd, data) :]


class _Server:
    """The parent's end of :func:`serve`: a request per rank, answered by its pid; the exit
    statuses of the ranks it forked come back on the same pipe as they end."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--serve"],
            env=child_env(),
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            bufsize=0,
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.requests, self.replies = self.proc.stdin.fileno(), _Lines(self.proc.stdout.fileno())
        self.ended: dict[int, int] = {}  # pid -> returncode, as subprocess reports it
        atexit.register(self.close)

    def close(self) -> None:
        """End of the test process: the server exits when its stdin closes."""
        self.proc.stdin.close()  # type: ignore[union-attr]
        self.proc.wait(timeout=60)
        self.proc.stdout.close()  # type: ignore[union-attr]  # (left open: a ResourceWarning)

    def fork(self, args: list[str], env: dict[str, str], log: str) -> int:
        _send(self.requests, {"args": args, "env": env, "log": log})
        while True:
            reply = self._read(None)
            if reply is not None and "pid" in reply:
                return reply["pid"]

    def wait(self, pids: list[int], deadline: float) -> dict[int, int]:
        """The returncodes of those of ``pids`` that end before ``deadline``."""
        while not all(p in self.ended for p in pids):
            left = max(0.0, min(deadline - time.monotonic(), 3600))
            if self._read(left) is None and time.monotonic() >= deadline:
                break  # past the deadline and nothing more pending
        return {p: self.ended.pop(p) for p in pids if p in self.ended}

    def _read(self, timeout: float | None) -> dict | None:
        """The next reply (an exit status is recorded), or None when ``timeout`` passes first."""
        reply = self.replies.next(timeout)
        assert not self.replies.eof, f"the fork server ended ({self.proc.wait()})"
        if reply is None:
            return None
        if "ended" in reply:
            self.ended[reply["ended"]] = reply["returncode"]
        return reply


_SERVERS: dict[int, _Server] = {}  # this process's, by pid (a forked test process starts anew)


def _server() -> _Server:
    server = _SERVERS.get(os.getpid())
    if server is None or server.proc.poll() is not None:
        server = _SERVERS[os.getpid()] = _Server()
    return server


def serve() -> None:
    """The fork server: imports torch once, then forks a rank per request read from stdin and
    replies with its pid, and with its returncode when it ends; exits when stdin closes. Runs
    no thread of its own (a fork copies only the forking thread, and a lock another held)."""
    # The point: every rank forked from here has torch imported. Nothing more: Dynamo (which
    # make_mesh imports) imports torch.distributed.nn.functional, whose defaults capture the
    # default process group if it exists then, as it does in a rank (docs/design.md, "gloo
    # teardown abort"); imported here, before it exists, they would not.
    import torch  # noqa: F401

    requests = _Lines(0)
    while True:
        request = requests.next(0.05)
        _reap()
        if request is None:
            if requests.eof:  # the parent is gone
                return
            continue
        pid = os.fork()
        if pid == 0:
            _become(request)  # never returns: the rank exits through the interpreter
        _send(1, {"pid": pid})


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send(1, {"ended": pid, "returncode": os.waitstatus_to_exitcode(status)})


def _become(request: dict) -> None:
    """In the forked child: become ``python *args`` with the request's environment and log.
    The script's end (SystemExit or an uncaught exception) propagates out of :func:`serve` to
    the interpreter, which handles it as it does a script's."""
    os.chdir(ROOT)
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(null)
    os.close(log)
    # a rank still running at the launch's timeout is sent SIGUSR1 first (``collect``): where
    # each of its threads waits, in the log the test reports
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    args = request["args"]
    if args[0] == "-c":
        import types

        sys.argv = ["-c", *args[2:]]
        sys.path[0] = ""
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        exec(compile(args[1], "<string>", "exec"), main.__dict__)
    else:
        import runpy

        sys.argv = list(args)
        sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
        runpy.run_path(args[0], run_name="__main__")
    raise SystemExit(0)


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


if __name__ == "__main__" and sys.argv[1:] == ["--serve"]:
    serve()
