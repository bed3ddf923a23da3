"""Waiting for a collective on a real mesh, in slices, so that a failure ends the wait.

A rank blocked in a collective waits in slices of ``first_slice``; between slices it reads the
mesh's :class:`~._dist_failures.FailureBoard`: a failure posted for the current call, a member
whose process ended, or a member already waiting in the next call (it finished this call without
joining this collective) ends the wait with an error naming that rank, unless the collective
completes all the same (``_completes_anyway``). A member that neither
arrives nor fails is waited for at most ``NAMED_SPMD_TIMEOUT`` seconds; the error then says which
members never reached a collective of the call and where the others wait.
"""

from __future__ import annotations

import time
from typing import Any

from .._errors import RankFailedError, SpmdError
from .._layout import coords_text
from ._dist_failures import FailureBoard, timeout_s

AHEAD_GRACE_S = 1.0  # a member seen in the next call this long while this rank still waits: a
# mismatch, not the lag between one member finishing a collective and another; and how long a
# group may still complete a collective after a rank outside it failed


def _is_timeout(e: BaseException) -> bool:
    return "timed out" in str(e).lower() or "timeout" in type(e).__name__.lower()


def wait(board: FailureBoard, work: Any, while_doing: str, first_slice, members: list[int]) -> None:
    """Wait for ``work``; a posted failure or the timeout ends the wait with an error."""
    if not _waited(board, work, first_slice, while_doing):
        _slow_wait(board, work, while_doing, first_slice, members)


def _waited(board: FailureBoard, work: Any, slice_, while_doing: str) -> bool:
    """Wait one slice for ``work``: whether it completed (a communication failure other than
    the slice's timeout is raised as the board translates it)."""
    try:
        work.wait(slice_)
        return True
    except RuntimeError as e:
        if not _is_timeout(e):
            raise board.translate(e, while_doing) from None
    return False


def _slow_wait(
    board: FailureBoard, work: Any, while_doing: str, slice_, members: list[int]
) -> None:
    # A slow wait says where this rank waits: at the timeout, the members that never said
    # so are the ones that did not arrive (only slow waits pay for the store write).
    waiting = f"{board.key}/waiting/{board.seq}/"
    try:
        board.store.set(waiting + str(board.rank), while_doing)
    except Exception:  # noqa: BLE001 - a dead store: the check below reports the failure
        pass
    deadline = time.monotonic() + timeout_s()
    ahead_since: float | None = None
    while True:
        failure = board.read()
        if failure is not None and failure[0] >= board.seq:
            if _completes_anyway(board, work, slice_, while_doing, failure[1] in members):
                return
            raise board.error(failure, while_doing)
        if board.gone(members) is not None:
            # it may have done its part of this collective first (its exit can come between
            # this rank's slices): the work then completes, and nothing failed
            if _completes_anyway(board, work, slice_, while_doing, member=True):
                return
            gone = board.gone_error(members, while_doing)
            if gone is not None:
                raise gone
        ahead = _ahead(board, members)
        if ahead is None:
            ahead_since = None
        elif ahead_since is None:
            ahead_since = time.monotonic()
        elif time.monotonic() - ahead_since > AHEAD_GRACE_S:
            raise _left_behind(board, *ahead, while_doing)
        if time.monotonic() > deadline:
            err = RankFailedError(
                f"rank {board.rank}: waited {timeout_s():.0f} s {while_doing} without the "
                "other ranks arriving and without any of them reporting an error. "
                + _absent(board, waiting, members, while_doing)
                + "A rank may be stuck, or the ranks call different collectives (run with "
                "NAMED_SPMD_DEBUG=1 to check). Set NAMED_SPMD_TIMEOUT to change the limit."
            )
            # posted, so that a peer seeing this rank exit quotes what it found missing
            board.post_for(board.rank, f"gave up waiting: {err}")
            raise err
        if _waited(board, work, slice_, while_doing):
            return


def _completes_anyway(
    board: FailureBoard, work: Any, slice_, while_doing: str, member: bool
) -> bool:
    """Whether ``work`` completes all the same, though a failure was posted for the call or a
    member ended: that rank may have done its part first, or (``member`` False) be outside the
    group, whose members may all still arrive. Waited for one more slice, or for
    ``AHEAD_GRACE_S`` outside the group: a time limit, since a member that stopped for the
    failure gives no sign of it here."""
    until = time.monotonic() + (0.0 if member else AHEAD_GRACE_S)
    while not _waited(board, work, slice_, while_doing):
        if time.monotonic() >= until:
            return False
    return True


def _ahead(board: FailureBoard, members: list[int]) -> tuple[int, str] | None:
    """A member that waits in the next call: it finished this call without joining the
    collective this rank waits in (the start-of-call check keeps ranks within one call)."""
    later = f"{board.key}/waiting/{board.seq + 1}/"
    try:
        for r in members:
            if r != board.rank and board.store.check([later + str(r)]):
                return r, board.store.get(later + str(r)).decode()
    except Exception:  # noqa: BLE001 - a dead store: the other checks report it
        pass
    return None


def _left_behind(board: FailureBoard, rank: int, there: str, while_doing: str) -> SpmdError:
    """This rank's error when a member it waits for moved on to the next call; posted for that
    call, so that the ranks waiting there stop too."""
    board.ahead_seq = board.seq + 1
    try:
        board.store.add(board.stuck_key(board.seq), 1)  # this collective never completes
    except Exception:  # noqa: BLE001 - the error is raised anyway
        pass
    return SpmdError(
        f"the ranks called different collectives in spmd_map call #{board.seq}: "
        f"{board.where(board.rank)} waits {while_doing}, but {board.where(rank)} finished that "
        f"call without joining it (it waits {there} in call #{board.seq + 1}). Every rank of "
        "a group must call the same collectives in the same order. Fix: make control flow, "
        "axes and shapes independent of the rank; run with NAMED_SPMD_DEBUG=1 to list what "
        "each rank called."
    )


def _absent(board: FailureBoard, waiting: str, members: list[int], while_doing: str) -> str:
    """Which members of the group never waited in this call, and where the others wait."""
    try:
        where = {
            r: board.store.get(waiting + str(r)).decode()
            for r in members
            if r != board.rank and board.store.check([waiting + str(r)])
        }
    except Exception:  # noqa: BLE001 - no store, no names
        return ""
    absent = [r for r in members if r != board.rank and r not in where]
    text = "".join(
        f"Rank {r} (mesh coordinates "
        + coords_text(board.coords_of(r))
        + ") never reached a collective of this call. "
        for r in absent
    )
    elsewhere = {r: w for r, w in where.items() if w != while_doing}
    return text + "".join(f"Rank {r} waits {w}. " for r, w in elsewhere.items())
