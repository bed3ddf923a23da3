"""Failure handling on a real mesh: no rank hangs because another one raised.

A rank whose per-device function raises posts its error to the process group's store (the
rendezvous store that every rank already shares) before re-raising it. A rank blocked in a
collective waits in short slices; between slices it reads the store, and a failure posted for the
current call (or a later one) ends the wait with :class:`RankFailedError` naming the failing rank
and its message. A failing rank that exits closes its sockets, so its peers get a gloo error at
once; that error is translated the same way. A rank that neither fails nor arrives is waited for
at most ``NAMED_SPMD_TIMEOUT`` seconds (default 1800).

Every rank that learns of a failure (by posting its own or by reading a peer's) counts itself in
the store, and a failing rank re-raises only once every rank of the mesh has counted itself, or
after ``ACK_S`` seconds. Without that wait the failing process exits at once and a launcher such
as torchrun terminates its peers before they print which rank failed (seen under load: 1 of the 3
peers killed first in a 4-process job).

Debug mode (``NAMED_SPMD_DEBUG=1`` or :func:`set_debug`) additionally exchanges a signature of
every collective (op, axes, shape, dtype, arguments) through the store before running it, so that
ranks that call different collectives, or the same one with different shapes, get a
:class:`SpmdError` that lists what every rank called instead of a hang or garbage.
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._errors import RankFailedError, SpmdError

POLL_S = 0.2  # how often a rank blocked in a collective looks for a posted failure
ACK_S = 5.0  # how long a failing rank waits for its peers to learn of the failure
_debug_override: bool | None = None


def timeout_s() -> float:
    """Seconds a rank waits for a peer that neither arrives nor fails (NAMED_SPMD_TIMEOUT)."""
    return float(os.environ.get("NAMED_SPMD_TIMEOUT", "1800"))


def set_debug(enabled: bool | None = True) -> None:
    """Check before every collective that all ranks of its group call the same one.

    ``None`` goes back to the ``NAMED_SPMD_DEBUG`` environment variable. Costs a store round trip
    per collective and rank: a debugging aid, not for training runs.
    """
    global _debug_override
    _debug_override = enabled


def debug_enabled() -> bool:
    if _debug_override is not None:
        return _debug_override
    return os.environ.get("NAMED_SPMD_DEBUG", "") not in ("", "0")


def _is_timeout(e: BaseException) -> bool:
    return "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()


class FailureBoard:
    """One mesh's failure record in the store, and the rank's view of the current call."""

    def __init__(self, store: Any, rank: int, size: int, mesh_key: str, coords_of):
        self.store = store
        self.rank = rank
        self.size = size  # ranks in the mesh
        self.key = f"named_spmd/{mesh_key}/failure"
        self.coords_of = coords_of  # global rank -> {axis: coordinate}
        self.seq = 0  # spmd_map calls on this mesh so far (identical on every rank)
        self.debug_counts: dict[str, int] = {}
        self._acknowledged: set[int] = set()  # calls whose failure this rank has counted
        self.failed_seq: int | None = None  # the last call that failed on this rank, if any
        self.out_of_step: str | None = None  # why the mesh cannot run another call

    # --- after a failed call ------------------------------------------------------------------
    def check_in_step(self) -> None:
        """At the start of a call: raise if an earlier failed call left collectives in flight.

        When every rank raised on its own (a user error all ranks make), nothing is left
        pending and the next call runs. When some rank stopped inside a collective because a
        peer failed (:meth:`error`), that collective can never complete (torch.distributed
        cannot cancel it) and the next one would pair with it: every later call raises."""
        if self.out_of_step is None and self.failed_seq is not None:
            seq, self.failed_seq = self.failed_seq, None
            if self.store.add(self._stuck_key(seq), 0) > 0:
                self.out_of_step = (
                    f"spmd_map call #{seq} on this mesh failed while ranks were inside "
                    "collectives with the failing rank. torch.distributed cannot cancel a "
                    "collective in flight, so the mesh's process groups are out of step and no "
                    "later call can run on them. Fix: restart the job; to go on after an error "
                    "inside a mapped function, make the error happen on every rank alike (for "
                    "example check inputs before the call), or use a simulated mesh."
                )
        if self.out_of_step is not None:
            raise SpmdError(self.out_of_step)

    def _stuck_key(self, seq: int) -> str:
        return f"{self.key}/stuck/{seq}"

    # --- posting and reading ------------------------------------------------------------------
    def post(self, exc: BaseException) -> None:
        """Post this rank's error, then wait (at most ``ACK_S``) until every rank knows of it."""
        text = f"{type(exc).__name__}: {exc}".strip()
        self.failed_seq = self.seq
        try:
            self.store.set(self.key, f"{self.seq}\n{self.rank}\n{text[:4000]}")
            self._acknowledge(self.seq)
            deadline = time.monotonic() + ACK_S
            while self._acknowledgements(self.seq) < self.size and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - the store may be gone already; the error still raises
            pass

    def _ack_key(self, seq: int) -> str:
        return f"{self.key}/known/{seq}"

    def _acknowledge(self, seq: int) -> None:
        if seq not in self._acknowledged:
            self._acknowledged.add(seq)
            self.store.add(self._ack_key(seq), 1)

    def _acknowledgements(self, seq: int) -> int:
        return self.store.add(self._ack_key(seq), 0)

    def read(self) -> tuple[int, int, str] | None:
        try:
            if not self.store.check([self.key]):
                return None
            seq, rank, text = self.store.get(self.key).decode().split("\n", 2)
        except Exception:  # noqa: BLE001 - a dead store means a dead job; the caller reports
            return None
        return int(seq), int(rank), text

    def error(
        self, failure: tuple[int, int, str], while_doing: str, in_collective: bool = True
    ) -> RankFailedError:
        seq, rank, text = failure
        self.failed_seq = self.seq
        try:
            if in_collective and seq not in self._acknowledged:  # it can never complete
                self.store.add(self._stuck_key(self.seq), 1)
            self._acknowledge(seq)  # the failing rank waits for this before it exits
        except Exception:  # noqa: BLE001 - the store's host exited; the error is raised anyway
            pass
        coords = self.coords_of(rank)
        where = ", ".join(f"{a}={c}" for a, c in coords.items())
        return RankFailedError(
            f"rank {rank} (mesh coordinates {where}) failed inside spmd_map: {text}\n"
            f"This rank (rank {self.rank}) stopped {while_doing}, which needed rank {rank}. "
            "Fix the error on that rank; its own traceback has the details."
        )

    def check(self, while_doing: str, in_collective: bool = True) -> None:
        """Raise if a failure was posted for this call or a later one."""
        failure = self.read()
        if failure is not None and failure[0] >= self.seq:
            raise self.error(failure, while_doing, in_collective)

    def translate(self, exc: BaseException, while_doing: str) -> BaseException:
        """The error to raise for a communication failure: the posted one when there is one."""
        deadline = time.monotonic() + 2.0  # the failing rank posts before its sockets close
        while True:
            failure = self.read()
            if failure is not None and failure[0] >= self.seq:  # not an earlier call's
                return self.error(failure, while_doing)
            if time.monotonic() > deadline:
                return RankFailedError(
                    f"rank {self.rank}: communication failed {while_doing}: {exc}\n"
                    "No rank reported an error inside spmd_map: a peer process probably died "
                    "(out of memory, killed) or its process group was destroyed."
                )
            time.sleep(0.05)

    # --- waiting ------------------------------------------------------------------------------
    def wait(self, work: Any, while_doing: str, first_slice, members: list[int]) -> None:
        """Wait for ``work``; a posted failure or the timeout ends the wait with an error."""
        try:
            work.wait(first_slice)
            return
        except RuntimeError as e:
            if not _is_timeout(e):
                raise self.translate(e, while_doing) from None
        self._slow_wait(work, while_doing, first_slice, members)

    def _slow_wait(self, work: Any, while_doing: str, slice_, members: list[int]) -> None:
        # A slow wait says where this rank waits: at the timeout, the members that never said
        # so are the ones that did not arrive (only slow waits pay for the store write).
        waiting = f"{self.key}/waiting/{self.seq}/"
        try:
            self.store.set(waiting + str(self.rank), while_doing)
        except Exception:  # noqa: BLE001 - a dead store: the check below reports the failure
            pass
        deadline = time.monotonic() + timeout_s()
        while True:
            self.check(while_doing)
            if time.monotonic() > deadline:
                raise RankFailedError(
                    f"rank {self.rank}: waited {timeout_s():.0f} s {while_doing} without the "
                    "other ranks arriving and without any of them reporting an error. "
                    + self._absent(waiting, members, while_doing)
                    + "A rank may be stuck, or the ranks call different collectives (run with "
                    "NAMED_SPMD_DEBUG=1 to check). Set NAMED_SPMD_TIMEOUT to change the limit."
                )
            try:
                work.wait(slice_)
                return
            except RuntimeError as e:
                if not _is_timeout(e):
                    raise self.translate(e, while_doing) from None

    def _absent(self, waiting: str, members: list[int], while_doing: str) -> str:
        """Which members of the group never waited in this call, and where the others wait."""
        try:
            where = {
                r: self.store.get(waiting + str(r)).decode()
                for r in members
                if r != self.rank and self.store.check([waiting + str(r)])
            }
        except Exception:  # noqa: BLE001 - no store, no names
            return ""
        absent = [r for r in members if r != self.rank and r not in where]
        text = "".join(
            f"Rank {r} (mesh coordinates "
            + ", ".join(f"{a}={c}" for a, c in self.coords_of(r).items())
            + ") never reached a collective of this call. "
            for r in absent
        )
        elsewhere = {r: w for r, w in where.items() if w != while_doing}
        return text + "".join(f"Rank {r} waits {w}. " for r, w in elsewhere.items())

    # --- debug mode ---------------------------------------------------------------------------
    def check_same_call(self, group_key: str, members: list[int], signature: str, label: str):
        """Exchange ``signature`` with the group's members; raise SpmdError on any difference."""
        try:
            self._check_same_call(group_key, members, signature, label)
        except (SpmdError, RankFailedError):
            raise
        except Exception as e:  # noqa: BLE001 - the store itself failed (its host exited)
            raise self.translate(e, f"in the debug check of {signature}") from None

    def _check_same_call(self, group_key, members, signature, label):
        count = self.debug_counts.get(group_key, 0)
        got = self._exchange(
            group_key, members, signature, label, f"collective #{count} of group {group_key}"
        )
        if len(set(got.values())) > 1:
            lines = "\n".join(f"    rank {r}: {s}" for r, s in got.items())
            raise SpmdError(
                f"{label}: debug check: the ranks of one group called different collectives as "
                f"their collective #{count} on group {group_key}:\n{lines}\nEvery rank of a group "
                "must call the same collectives, with the same shapes, in the same order. Fix: "
                "make shapes and control flow independent of the rank."
            )

    def exchange(self, key: str, members: list[int], value: str, label: str, step: str):
        """Every member's ``value`` for ``step`` (the store is the channel): debug mode only."""
        try:
            return self._exchange(key, members, value, label, step)
        except (SpmdError, RankFailedError):
            raise
        except Exception as e:  # noqa: BLE001 - the store itself failed (its host exited)
            raise self.translate(e, f"in the debug check of {step}") from None

    def _exchange(self, key, members, value, label, step) -> dict[int, str]:
        count = self.debug_counts.get(key, 0)
        self.debug_counts[key] = count + 1
        prefix = f"named_spmd/debug/{key}/{count}/"
        self.store.set(prefix + str(self.rank), value)
        keys = [prefix + str(r) for r in members]
        limit = min(timeout_s(), 60.0)
        deadline = time.monotonic() + limit
        while not self.store.check(keys):
            try:
                self.check(f"checking {step}", in_collective=False)  # a store exchange
            except RankFailedError:
                # A peer that finished this exchange may fail on what it read (a debug check's
                # verdict) before this rank sees the last value: read it and decide alike.
                if not self.store.check(keys):
                    raise
                break
            if time.monotonic() > deadline:
                missing = [r for r in members if not self.store.check([prefix + str(r)])]
                raise SpmdError(
                    f"{label}: debug check: ranks {missing} did not reach {step} ({value}) "
                    f"within {limit:.0f} s. They are stuck, or they skipped it (a rank-dependent "
                    "branch?)."
                )
            time.sleep(0.005)
        return {r: self.store.get(prefix + str(r)).decode() for r in members}
