"""Who is alive, who exited, and after which call: the processes of a real mesh, in the store.

Every process records its host and pid (:func:`register_process`); at interpreter exit it records
that it ends, with its uncaught error and the calls it made on each mesh (:func:`mark_exited`).
A peer whose communication fails, or whose wait runs long, reads a rank's fate here
(:func:`_fate`): a process of this host that no longer exists was killed (SIGKILL, the
out-of-memory killer); one that exited says after which call.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ._dist_failures import FailureBoard

_PROCESS = "named_spmd/process"


_REGISTERED: list[tuple[Any, int]] = []  # (store, rank) of this process, once registered


def register_process(store: Any, rank: int) -> None:
    """Record this process's host and pid, so that peers on the same host can tell it died."""
    store.set(f"{_PROCESS}/{rank}", f"{socket.gethostname()}\n{os.getpid()}")
    _REGISTERED[:] = [(store, rank)]


def registered() -> tuple[Any, int] | None:
    """Where this process registered (its exit must be recorded there, even if it made no mesh:
    a peer would otherwise take a process that ended on an error inside make_mesh for killed)."""
    return _REGISTERED[0] if _REGISTERED else None


def mark_exited(store: Any, rank: int, boards: list[FailureBoard]) -> None:
    """At interpreter exit: record that this process ends, the uncaught error if there is one
    (``sys.last_value``, set before ``atexit`` handlers run), and the calls made on each mesh."""
    err = getattr(sys, "last_value", None)
    record = {
        "error": None if err is None else f"{type(err).__name__}: {err}"[:500],
        "calls": {b.key: [b.seq, b.finished] for b in boards},
    }
    store.set(f"{_PROCESS}/{rank}/exited", json.dumps(record))


def _process_alive(pid: int) -> bool:
    """Whether ``pid`` runs on this host; a zombie (killed, not yet reaped) counts as dead."""
    if not os.path.isdir("/proc/self"):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except OSError:
            pass
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def _fate(store: Any, rank: int) -> dict | None:
    """How ``rank``'s process ended, where that is knowable; ``None`` while it may be alive."""
    exited = f"{_PROCESS}/{rank}/exited"
    if store.check([exited]):
        return json.loads(store.get(exited).decode())
    me = f"{_PROCESS}/{rank}"
    if not store.check([me]):
        return None
    host, pid = store.get(me).decode().split("\n")
    if host == socket.gethostname() and not _process_alive(int(pid)):
        return {"killed": int(pid)}
    return None
