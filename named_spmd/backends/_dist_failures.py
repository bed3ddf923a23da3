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

A rank that reports nothing is named where its fate is knowable: every process registers its
host and pid, and an exiting process records that it exited (with the uncaught error, if any) and
how many calls it made (``_dist_processes``). A peer whose
communication fails, or whose wait runs long, looks these up: a process of this host that no
longer exists was killed (SIGKILL, the out-of-memory killer); one that exited after finishing the
call this rank waits in called other collectives. The board's jobs are split by module: this one posts, reads and translates failures (and waits
for the mesh's process groups at ``make_mesh``); ``_dist_waiting`` waits for a collective in
slices; ``_dist_exchange`` exchanges values through the store (the start-of-call check and debug
mode).
"""

from __future__ import annotations

import os
import time
from typing import Any

from .._errors import RankFailedError, SpmdError
from .._layout import coords_text
from ._dist_processes import _fate

POLL_S = 0.2  # how often a rank blocked in a collective looks for a posted failure
ACK_S = 5.0  # how long a failing rank waits for its peers to learn of the failure


def timeout_s() -> float:
    """Seconds a rank waits for a peer that neither arrives nor fails (NAMED_SPMD_TIMEOUT)."""
    return float(os.environ.get("NAMED_SPMD_TIMEOUT", "1800"))


class FailureBoard:
    """One mesh's failure record in the store, and the rank's view of the current call."""

    def __init__(self, store: Any, rank: int, ranks: list[int], mesh_key: str, coords_of):
        self.store = store
        self.rank = rank
        self.ranks = ranks  # the mesh's ranks
        self.size = len(ranks)
        self.key = f"named_spmd/{mesh_key}/failure"
        self.coords_of = coords_of  # global rank -> {axis: coordinate}
        self.seq = 0  # spmd_map calls on this mesh so far (identical on every rank)
        self.finished = 0  # the last call that returned normally on this rank
        self.call_log: list[str] = []  # debug mode: this call's collectives on this rank
        self.in_body = False
        self.ahead_seq: int | None = None  # post the next failure for this (later) call
        self.debug_counts: dict[str, int] = {}
        self._acknowledged: set[int] = set()  # calls whose failure this rank has counted
        self.failed_seq: int | None = None  # the last call that failed on this rank, if any
        self.out_of_step: str | None = None  # why the mesh cannot run another call

    def begin_call(self) -> None:
        """A new spmd_map call on this mesh (every rank counts calls alike)."""
        self.seq += 1
        self.debug_counts = {}
        self.call_log = []
        self.in_body = True  # debug mode: until the comparison of the lists (finish_call)

    # --- after a failed call ------------------------------------------------------------------
    def check_in_step(self) -> None:
        """At the start of a call: raise if an earlier failed call left collectives in flight.

        When every rank raised on its own (a user error all ranks make), nothing is left
        pending and the next call runs. When some rank stopped inside a collective because a
        peer failed (:meth:`error`), that collective can never complete (torch.distributed
        cannot cancel it) and the next one would pair with it: every later call raises."""
        if self.out_of_step is None and self.failed_seq is not None:
            seq, self.failed_seq = self.failed_seq, None
            if self.store.add(self.stuck_key(seq), 0) > 0:
                self.out_of_step = (
                    f"spmd_map call #{seq} on this mesh failed while ranks were inside "
                    "collectives with the failing rank. torch.distributed cannot cancel a "
                    "collective in flight, so the mesh's process groups are out of step and no "
                    "later call can run on them. Fix: restart the job; to go on after an error "
                    "inside a mapped function, make the error happen on every rank alike (for "
                    "example check inputs before the call), or use a simulated mesh."
                )
        if self.out_of_step is not None:
            self._repost()
            raise SpmdError(self.out_of_step)

    def _repost(self) -> None:
        """Post the failure that put the mesh out of step again, for this call: ranks that
        finished the failed call without needing the failing rank wait in this call for the
        ranks that raise here (they would otherwise read only a failure of an earlier call,
        or this rank's consequence of it, and name the wrong rank)."""
        failure = self.read()
        if failure is None:  # nothing to quote: this rank's own error stops them
            self.post_for(self.rank, f"failed inside spmd_map: SpmdError: {self.out_of_step}")
            return
        if failure[0] >= self.seq:
            return
        seq, rank, text = failure
        where = f"(in spmd_map call #{seq}; "
        if where not in text:  # reposted once: it names its call already
            text += (
                f"\n{where}ranks that were inside collectives with it then cannot run another "
                "call on this mesh.)"
            )
        self.post_for(rank, text)

    def known_failure(self) -> int:
        """The latest call on this mesh whose failure this rank knows of (0: none). The ranks
        compare it at the start of every call (``_dist_agree``): a rank that finished a call in
        which another rank failed, without needing that rank, learns of the failure there."""
        return max(self._acknowledged, default=0)

    def learned(self, latest: int) -> None:
        """Call ``latest``'s failure is known to this rank now (the next comparison agrees)."""
        if latest:
            self._acknowledged.add(latest)

    def missed_failure(self, latest: int, missed: list[int]) -> RankFailedError:
        """The error every rank raises at the start of a call when ``missed`` ranks finished
        call ``latest`` without learning that a rank failed in it; nothing is in flight, so the
        next call runs."""
        failure = self.read()
        self.learned(latest)
        if failure is None or failure[0] != latest:
            what = f"a rank failed inside spmd_map call #{latest} on this mesh"
        else:
            what = f"{self.where(failure[1])} {failure[2]}"
        return RankFailedError(
            f"{what}\nRanks {missed} finished that call (spmd_map call #{latest}) without "
            f"needing the failing rank, so they learn of it only now, at the start of call "
            f"#{self.seq}; every rank stops here with this error and call #{self.seq} runs on "
            "none. The next call runs."
        )

    def stuck_key(self, seq: int) -> str:
        return f"{self.key}/stuck/{seq}"

    # --- posting and reading ------------------------------------------------------------------
    def post(self, exc: BaseException) -> None:
        """Post this rank's error, then wait (at most ``ACK_S``) until every rank knows of it."""
        text = f"failed inside spmd_map: {type(exc).__name__}: {exc}".strip()
        self.failed_seq = self.seq
        seq, self.ahead_seq = self.ahead_seq or self.seq, None  # peers ahead read it there
        try:
            self.store.set(self.key, f"{seq}\n{self.rank}\n{text[:4000]}")
            self._acknowledge(seq)
            deadline = time.monotonic() + ACK_S
            while self._acknowledgements(seq) < self.size and time.monotonic() < deadline:
                time.sleep(0.01)
        except Exception:  # noqa: BLE001 - the store may be gone already; the error still raises
            pass

    def post_for(self, rank: int, text: str) -> None:
        """Post what is known of a rank that cannot post itself (its process ended, or it
        failed in an earlier call), or this rank's own finding; known to this rank."""
        try:
            self.store.set(self.key, f"{self.seq}\n{rank}\n{text[:4000]}")
            self._acknowledge(self.seq)
        except Exception:  # noqa: BLE001 - a dead store: the caller raises anyway
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

    def where(self, rank: int) -> str:
        coords = coords_text(self.coords_of(rank))
        return f"rank {rank} (mesh coordinates {coords})" if coords else f"rank {rank}"

    def error(
        self, failure: tuple[int, int, str], while_doing: str, in_collective: bool = True
    ) -> RankFailedError:
        seq, rank, text = failure
        self.failed_seq = self.seq
        try:
            if in_collective and seq not in self._acknowledged:  # it can never complete
                self.store.add(self.stuck_key(self.seq), 1)
            self._acknowledge(seq)  # the failing rank waits for this before it exits
        except Exception:  # noqa: BLE001 - the store's host exited; the error is raised anyway
            pass
        fix = (
            " Fix the error on that rank; its own traceback has the details."
            if text.startswith("failed inside spmd_map")
            else ""
        )
        return RankFailedError(
            f"{self.where(rank)} {text}\nThis rank (rank {self.rank}) stopped {while_doing}, "
            f"which needed rank {rank}.{fix}"
        )

    def check(self, while_doing: str, in_collective: bool = True) -> None:
        """Raise if a failure was posted for this call or a later one."""
        failure = self.read()
        if failure is not None and failure[0] >= self.seq:
            raise self.error(failure, while_doing, in_collective)

    # --- ranks that ended without posting -------------------------------------------------------
    def gone(self, ranks: list[int]) -> tuple[int, str] | None:
        """The first of ``ranks`` whose process is known to have ended, with what is known."""
        try:
            fates = [(r, _fate(self.store, r)) for r in ranks if r != self.rank]
        except Exception:  # noqa: BLE001 - no store, nothing knowable
            return None
        # a killed process is the cause; peers that exited after it are its casualties
        known = [(r, f) for r, f in fates if f is not None]
        known.sort(key=lambda rf: ("killed" not in rf[1], rf[1].get("error") is None))
        return None if not known else (known[0][0], self._describe(known[0][1]))

    def gone_before(self, prefix: str, missing: list[int]) -> tuple[int, str] | None:
        """The first of ``missing`` (ranks whose ``prefix`` key was absent) that ended before
        setting it. One that set it after ``missing`` was read and ended later (killed in the
        next step) is not missing here: that step reports its end."""
        gone = self.gone(missing)
        if gone is not None and self.store.check([prefix + str(gone[0])]):
            return None
        return gone

    def _describe(self, fate: dict) -> str:
        if "killed" in fate:
            return (
                "died without reporting an error: its process (pid "
                f"{fate['killed']} on this host) no longer exists. It was killed (by a signal "
                "such as SIGKILL, or by the out-of-memory killer)."
            )
        how = (
            "exited normally" if fate["error"] is None else f"exited on an uncaught {fate['error']}"
        )
        entered, finished = fate["calls"].get(self.key, [0, 0])
        n = self.seq
        if n == 0:
            return f"{how} (outside spmd_map)."
        if finished >= n:
            return (
                f"{how} after finishing spmd_map call #{n} on this mesh without joining this "
                "rank's collective in it: the ranks called different collectives in that call "
                "(rank-dependent control flow, axes or shapes). Fix: make the collectives the "
                "same on every rank; run with NAMED_SPMD_DEBUG=1 to list what each rank called."
            )
        if entered >= n:
            return f"{how} after spmd_map call #{n} raised on it (its own output has the error)."
        if fate["error"] is not None:
            return (
                f"{how}, raised outside spmd_map after {entered} spmd_map calls on this mesh, so "
                f"it never made call #{n}. Fix that error; its own traceback has the details."
            )
        return (
            f"{how} after {entered} spmd_map calls on this mesh, without making call #{n}: the "
            "ranks make different numbers of spmd_map calls. Fix: make every rank call the "
            "mapped functions the same number of times, in the same order."
        )

    def gone_error(
        self, ranks: list[int], while_doing: str, in_collective: bool = True, prefix: str = ""
    ) -> RankFailedError | None:
        """The error for the first of ``ranks`` that ended (before setting its ``prefix`` key,
        when the wait is for keys), posted for the peers; ``None`` while none did."""
        gone = self.gone_before(prefix, ranks) if prefix else self.gone(ranks)
        if gone is None:
            return None
        # What a rank posted before it exited says more than its exit does (a rank that gave up
        # waiting names the rank it waited for): read it, and never overwrite it with the exit.
        failure = self.read()
        if failure is not None and failure[0] >= self.seq:
            return self.error(failure, while_doing, in_collective)
        self.post_for(*gone)  # peers waiting elsewhere stop too
        return self.error((self.seq, *gone), while_doing, in_collective)

    def translate(self, exc: BaseException, while_doing: str) -> BaseException:
        """The error to raise for a communication failure: the posted one when there is one,
        else the peer known to have ended."""
        deadline = time.monotonic() + 2.0  # the failing rank posts before its sockets close
        while True:
            failure = self.read()
            if failure is not None and failure[0] >= self.seq:  # not an earlier call's
                return self.error(failure, while_doing)
            gone = self.gone_error(self.ranks, while_doing)
            if gone is not None:
                return gone
            if time.monotonic() > deadline:
                return RankFailedError(
                    f"rank {self.rank}: communication failed {while_doing}: {exc}\n"
                    "No rank reported an error inside spmd_map and no process of this host is "
                    "known to have ended: a peer process on another host probably died (out of "
                    "memory, killed) or its process group was destroyed."
                )
            time.sleep(0.05)

    # --- make_mesh ------------------------------------------------------------------------------
    def made(self) -> None:
        """Wait until every rank of the mesh has created its process groups. A rank leaving
        make_mesh earlier could exit (an error right after) while a peer still connects to it,
        which kills that peer with a bare gloo error."""
        prefix = f"{self.key}/made/"
        try:
            self._wait_made(prefix)
        except RankFailedError:
            raise
        except Exception as e:  # noqa: BLE001 - the store's host (rank 0 or the launcher) ended
            raise RankFailedError(
                f"make_mesh: rank {self.rank} lost the rendezvous store while waiting for the "
                f"other ranks to create the mesh's process groups ({type(e).__name__}: {e}). "
                "The process hosting it (the launcher, or rank 0) has probably ended; its output "
                "says why."
            ) from None

    def _wait_made(self, prefix: str) -> None:
        self.store.set(prefix + str(self.rank), "")
        keys = [prefix + str(r) for r in self.ranks]
        deadline = time.monotonic() + timeout_s()
        while not self.store.check(keys):
            missing = [r for r in self.ranks if not self.store.check([prefix + str(r)])]
            gone = self.gone_before(prefix, missing)
            if gone is not None or time.monotonic() > deadline:
                raise RankFailedError(
                    f"make_mesh: rank {self.rank} waited for "
                    f"{self.where(gone[0] if gone else missing[0])} to "
                    "create the mesh's process groups, but "
                    + (f"it {gone[1]}" if gone else f"it did not within {timeout_s():.0f} s.")
                    + " Fix: every rank must call make_mesh with the same arguments."
                )
            time.sleep(0.01)

    def setup_failed(self, exc: BaseException) -> RankFailedError:
        """The error for a failure while creating the process groups: a peer's end, if known."""
        deadline = time.monotonic() + 2.0  # an exiting peer records that before its sockets close
        while (gone := self.gone(self.ranks)) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        why = (
            f"{self.where(gone[0])} {gone[1]}" if gone else f"no peer is known to have ended: {exc}"
        )
        return RankFailedError(
            f"make_mesh: creating the mesh's process groups failed on rank {self.rank}: {why} "
            "Fix: every rank must call make_mesh with the same arguments and stay alive until "
            "all have returned from it."
        )


_MADE: dict[str, int] = {}  # mesh key -> how many times this process made that mesh


def generation(mesh_key: str) -> str:
    """``mesh_key`` with how many times this process made that mesh (every rank makes its meshes
    in one order: creating process groups is collective). A mesh made again with the same axes
    and grid gets a failure record of its own: its calls count from 1 again, and an earlier
    mesh's failure posted for a later call number must not stop them."""
    _MADE[mesh_key] = made = _MADE.get(mesh_key, 0) + 1
    return f"{mesh_key}/{made}"
