"""Values exchanged through the rendezvous store: the start-of-call check and debug mode.

Debug mode (``NAMED_SPMD_DEBUG=1`` or :func:`set_debug`) additionally exchanges a signature of
every collective (op, axes, shape, dtype, arguments) through the store before running it, so that
ranks that call different collectives, or the same one with different shapes, get a
:class:`SpmdError` that lists what every rank called instead of a hang or garbage; at the end of
a call it compares every rank's list of collectives, so a rank that skipped one is reported by
every rank, not only by the ones left waiting for it.

An exchange is decided once for the whole group (:func:`_decide`), so that no member goes on into
a collective that another member has left.
"""

from __future__ import annotations

import time

from .._errors import RankFailedError, SpmdError
from ._dist_failures import POLL_S, FailureBoard, timeout_s


def check_same_call(
    board: FailureBoard, group_key: str, members: list[int], signature: str, label: str
):
    """Exchange ``signature`` with the group's members; raise SpmdError on any difference."""
    board.call_log.append(signature)
    try:
        board.store.set(_log_key(board, board.seq, board.rank), _log(board, " <- waits here"))
        _check_same_call(board, group_key, members, signature, label)
    except (SpmdError, RankFailedError):
        raise
    except Exception as e:  # noqa: BLE001 - the store itself failed (its host exited)
        raise board.translate(e, f"in the debug check of {signature}") from None


def _log_key(board: FailureBoard, seq: int, rank: int, done: bool = False) -> str:
    return f"{board.key}/log/{seq}/{'done/' if done else ''}{rank}"


def _log(board: FailureBoard, last: str) -> str:
    return "; ".join(board.call_log) + last if board.call_log else "(no collective)" + last


def _check_same_call(board: FailureBoard, group_key, members, signature, label):
    count = board.debug_counts.get(group_key, 0)
    got = _exchange(
        board, group_key, members, signature, label, f"collective #{count} of group {group_key}"
    )
    if len(set(got.values())) > 1:
        lines = "\n".join(f"    rank {r}: {s}" for r, s in got.items())
        raise SpmdError(
            f"{label}: debug check: the ranks of one group called different collectives as "
            f"their collective #{count} on group {group_key}:\n{lines}\nEvery rank of a group "
            "must call the same collectives, with the same shapes, in the same order. Fix: "
            "make shapes and control flow independent of the rank."
        )


def finish_call(board: FailureBoard, label: str) -> None:
    """Debug mode, at the end of the body: compare every rank's list of collectives (before
    the checks of values: a rank-dependent order is named as such, not as differing
    values)."""
    mine = _log(board, "")
    board.in_body = False
    try:
        board.store.set(_log_key(board, board.seq, board.rank, done=True), mine)
        got = _exchange(board, "calls", board.ranks, mine, label, "the end of the call")
    except (SpmdError, RankFailedError):
        raise
    except Exception as e:  # noqa: BLE001 - the store itself failed (its host exited)
        raise board.translate(e, "in the debug check at the end of the call") from None
    if len(set(got.values())) > 1:
        raise _listing(board, label, f"spmd_map call #{board.seq} ran different collectives")


def _listing(board: FailureBoard, label: str, what: str) -> SpmdError:
    """What every rank of the mesh called in this call, as far as the store knows."""
    lines = []
    for r in board.ranks:
        log = "(unknown: it reported no collective yet)"
        for key in (_log_key(board, board.seq, r, done=True), _log_key(board, board.seq, r)):
            if board.store.check([key]):
                log = board.store.get(key).decode()
                log += " (finished the call)" if "/done/" in key else ""
                break
        lines.append(f"    {board.where(r)}: {log}")
    return SpmdError(
        f"{label}: debug check: {what} on the ranks:\n" + "\n".join(lines) + "\nEvery rank "
        "must call the same collectives, with the same shapes, in the same order. Fix: make "
        "shapes, axes and control flow independent of the rank."
    )


def exchange(board: FailureBoard, key: str, members: list[int], value: str, label: str, step: str):
    """Every member's ``value`` for ``step`` (the store is the channel): debug mode only."""
    try:
        return _exchange(board, key, members, value, label, step)
    except (SpmdError, RankFailedError):
        raise
    except Exception as e:  # noqa: BLE001 - the store itself failed (its host exited)
        raise board.translate(e, f"in the debug check of {step}") from None


def _exchange(board: FailureBoard, key, members, value, label, step) -> dict[int, str]:
    count = board.debug_counts.get(key, 0)
    board.debug_counts[key] = count + 1
    prefix = f"{board.key}/debug/{board.seq}/{key}/{count}/"  # per call: a failed call
    # leaves no count behind that the next call would disagree on
    board.store.set(prefix + str(board.rank), value)
    keys = [prefix + str(r) for r in members]
    limit = min(timeout_s(), 60.0)
    deadline = time.monotonic() + limit
    next_probe = time.monotonic() + POLL_S
    while not board.store.check(keys):
        try:
            board.check(f"checking {step}", in_collective=False)  # a store exchange
            missing = [r for r in members if not board.store.check([prefix + str(r)])]
            if time.monotonic() > next_probe:  # the slow path: who will never come
                next_probe = time.monotonic() + POLL_S
                _never_coming(board, prefix, missing, label, step)
            if time.monotonic() > deadline:
                raise _listing(
                    board,
                    label,
                    f"ranks {missing} did not reach {step} ({value}) within {limit:.0f} s "
                    "(stuck, or they skipped it: a rank-dependent branch?)",
                )
        except (SpmdError, RankFailedError):
            if _decide(board, prefix, "abort") == "abort":
                raise
            break  # a member saw every value first: decide on them, as it does
        time.sleep(0.005)
    if _decide(board, prefix, "go") == "abort":  # a member gave up first: stop, as it does
        board.check(f"checking {step}", in_collective=False)
        raise _listing(board, label, f"a rank gave up waiting for {step}")
    return {r: board.store.get(prefix + str(r)).decode() for r in members}


def _decide(board: FailureBoard, prefix: str, want: str) -> str:
    """The group's one decision on an exchange: "go" (a member saw every value) or "abort"
    (a member saw a failure, or a member that will never come, first), whichever is set
    first. Decided alone, a member that saw every value would go on into the collective while
    another, which saw a failure elsewhere first, leaves the call: the collective would never
    complete and the mesh would fall out of step."""
    return board.store.compare_set(prefix + "decision", "", want).decode()


def _never_coming(
    board: FailureBoard, prefix: str, missing: list[int], label: str, step: str
) -> None:
    """Raise if a missing member finished the body (it skipped ``step``) or ended. Only while
    this rank is in the body: after the comparison of the lists, a member's mark says nothing
    of the output's collectives."""
    if board.in_body and any(
        board.store.check([_log_key(board, board.seq, r, done=True)])
        and not board.store.check([prefix + str(r)])  # it may have come since `missing`
        for r in missing
    ):
        raise _listing(board, label, f"ranks {missing} finished the call without {step}")
    gone = board.gone_error(missing, f"checking {step}", in_collective=False, prefix=prefix)
    if gone is not None:
        raise gone
