"""Replays: on a mesh of one instance, a call is type-checked once per signature.

On one instance no value depends on a type: every collective and cast is the identity on the
data (or a fixed reshaping of it), and no implicit pvary exists over axes of size 1. Types only
decide whether the program is accepted. So, like a compiled call (whose types are checked when it
is traced), a call on such a mesh is type-checked once per *signature*: the mapped function (its
mesh and specs), the arguments' tree structure (which, with the function, gives each leaf's
spec), each argument's type, shape, dtype, device and requires_grad (a non-tensor argument's
value), and whether grad mode is on. Later calls with that signature run the function untyped: no
torch function mode, no stamps, collectives and casts straight to their forward on the one member
(``SpmdContext.replaying``), and the boundary converts only the leaves the checked call converted
(:class:`Checked`). Such a call then costs about what the plain program does (docs/design.md
section 5.8).

Not replayed: a function that asked for a type (``ns.vma``, ``ns.typeof``: a replay has none to
give), calls under a ``torch.func`` transform or with forward-mode AD, calls while a ``CommMode``
records, and every call in debug mode (``ns.set_debug``, ``NAMED_SPMD_DEBUG=1``). A replay marks
the mode stack for a checkpoint's recomputation (``_calls.CallMarker``, one Python call per op)
only if its checked call ran an op under saved-tensor hooks (a non-reentrant checkpoint).

A replay's error that an op of the user's line raised ends in the user's frame (no mode runs
below it): it is told from its traceback (``_errors.told_per_instance``), not by running the call
again, whose side effects (input writes, a module's counters, the user's own communication) would
repeat.

A replay's reduction (psum, pmean, pmax, pmin) over its group of one hands back the operand
itself where nothing else holds it (a temporary, ``ns.psum(h @ w, "tp")``): no copy and no copy
node in the backward pass, and no one to see the two share memory (``_donation.hands_back``, calibrated here: :func:`_calibrate`).

Used by the simulated backend's one-instance path and by a real mesh of one rank.
"""

from __future__ import annotations

import contextlib
import functools
import io
import warnings
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from . import _donation as donation
from . import _torch_private as torch_private
from ._accounting import recording
from ._calls import pop, push
from ._collectives.reductions import pmax, pmean, pmin, psum
from ._context import OneMemberPrimitives
from ._debug import debug_enabled
from ._mesh import Mesh
from ._plan import Plan, PlanningMode, ReplayMode
from ._stamps import MemberContext, TrackedContext
from ._tracking import VmaMode

if TYPE_CHECKING:
    from ._call import Call

#: Off: every call is type-checked (a benchmark's switch, to time the typing itself on a mesh
#: of one process; users turn replays off with debug mode).
ENABLED = True

_MAX_SIGNATURES = 64  # per function: beyond that the table starts again (no unbounded growth)


class CheckedMode(VmaMode):
    """The typing of a checked call, which also notes whether any op ran under saved-tensor
    hooks (a non-reentrant checkpoint's forward)."""

    hooks_seen = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if not self.hooks_seen and torch_private.saved_tensors_hooks_active():
            self.hooks_seen = True
        return super().__torch_function__(func, types, args, kwargs)


class Checked(NamedTuple):
    """What the checked call of a signature on a mesh of one instance leaves its replays."""

    marks: bool  # whether the replays mark calls (the checked call ran a checkpoint)
    #: the positions of the input leaves the backend's boundary converted (the others it handed
    #: through as they are, and so will every call of the signature); None: every leaf's
    converted: tuple[int, ...] | None


class Replay:
    """One call's entry in its mapped function's table of checked signatures. On a mesh of one
    instance the entry is the signature's :class:`Checked`; on a mesh of several, its
    :class:`~._plan.Plan` (a real mesh: ``planned``)."""

    def __init__(self, call: Call, planned: bool = False):
        self.planned = planned
        self.checked = _checked_signatures(call.mapped, planned)
        self.signature: tuple | None = None
        self.entry: Any = None  # the checked call's entry (see the class doc); None: not yet
        #: the leaves this call's boundary converts, given by the backend (:class:`Checked`)
        self.converted: tuple[int, ...] | None = None
        if self.checked is not None:
            self.signature = _signature(call)
            try:
                self.entry = self.checked.get(self.signature)
            except TypeError:  # an unhashable argument: no signature to compare
                self.signature = None

    def uneven(self) -> None:
        """This call takes blocks of unequal sizes (a real mesh): its plan is kept apart from
        an even call's of the same signature, so that a plan under the signature alone still
        says its blocks are even (``distributed._takes_uneven_blocks``)."""
        if self.checked is not None and self.signature is not None:
            self.signature = (*self.signature, "uneven")
            self.entry = self.checked.get(self.signature)

    def has_plan(self) -> bool:
        """Whether an earlier call of this signature made a plan (typed it, on several
        instances)."""
        return isinstance(self.entry, Plan)

    def hoistable(self) -> tuple:
        """The casts this call, a replay of a plan, makes at its entry (``Plan.hoistable``)."""
        return self.entry.hoistable if isinstance(self.entry, Plan) else ()

    def begin(self, ctx: TrackedContext) -> bool:
        """Make ``ctx`` (not yet pushed) a replay where an earlier call type-checked this call's
        signature; whether it is one (its inputs then need no types). A planned call numbers
        its typed tensors from its inputs on (``_plan``), and is no untyped replay."""
        if self.planned:
            ctx.numbering = self.checked is not None and self.signature is not None
            if isinstance(self.entry, Plan) and ctx.attention is None:
                ctx.marks_calls = False  # its typed call ran no checkpoint (``plan``)
            return False
        if self.entry is not None:
            ctx.replaying = True
            ctx.marks_calls = self.entry.marks
        return ctx.replaying

    def replayed_conversions(self) -> tuple[int, ...] | None:
        """In a replay, the positions of the input leaves to convert (the others are handed
        through as they are); None: every leaf."""
        return self.entry.converted if isinstance(self.entry, Checked) else None

    def run(self, ctx: TrackedContext, body: Any, local: list[Any]) -> list[Any]:
        """``body(local, ctx)``: untyped in a replay, else typed under a :class:`CheckedMode`
        and, if it asked for no type, remembered as checked."""
        if self.planned:
            return self._run_planned(ctx, body, local)
        if ctx.replaying:
            return body(local, ctx)
        with CheckedMode(ctx) as mode:
            outs = body(local, ctx)
        if not ctx.types_read:
            self.keep(Checked(mode.hooks_seen, self.converted))
        return outs

    def keep(self, answer: Any) -> None:
        """Remember ``answer`` (see the class doc) for this signature, where it has one (past
        ``_MAX_SIGNATURES`` the table starts again)."""
        if self.checked is None or self.signature is None:
            return
        if len(self.checked) >= _MAX_SIGNATURES:
            self.checked.clear()
        self.checked[self.signature] = answer

    def _run_planned(self, ctx: TrackedContext, body: Any, local: list[Any]) -> list[Any]:
        """``body(local, ctx)`` replayed from the signature's plan, or typed (and its plan
        kept, if it can be replayed)."""
        plan = self.entry
        if isinstance(plan, Plan):
            if plan.hoistable:
                ctx.hoist_casts(plan.hoistable)
            try:
                with ReplayMode(ctx, plan) as replay:
                    outs = body(local, ctx)
            finally:
                if plan.hoistable:
                    ctx.release_hoisted(plan.hoistable)
            plan.count(replay.i, replay.diverged)
            return outs
        if not ctx.numbering:
            with VmaMode(ctx):
                return body(local, ctx)
        with PlanningMode(ctx) as mode:
            outs = body(local, ctx)
        plan = mode.plan()
        if plan is not None:
            self.keep(plan)
        return outs


@contextlib.contextmanager
def quietly(leaves: list[Any]) -> Iterator[None]:
    """Discard a second run's prints and warnings, and restore the random state after it."""
    cuda = {x.device.index or 0 for x in leaves if isinstance(x, torch.Tensor) and x.is_cuda}
    with (
        contextlib.redirect_stdout(io.StringIO()),
        contextlib.redirect_stderr(io.StringIO()),
        warnings.catch_warnings(),
        torch.random.fork_rng(devices=sorted(cuda)),
    ):
        warnings.simplefilter("ignore")
        yield


def _checked_signatures(mapped: Any, planned: bool) -> dict[tuple, Any] | None:
    """The table of the mapped function ``mapped`` (its ``SpmdFunction._signatures``), or None
    where this call is not replayable (a planned replay types its collectives, so a CommMode
    records them as in a typed call)."""
    if (
        not ENABLED
        or (recording() and not planned)
        or torch_private.transforms_active()
        or torch_private.forward_level() >= 0
        or debug_enabled()
    ):
        return None
    return mapped._signatures


def _signature(call: Call) -> tuple:
    """``call``'s signature. The table is the mapped function's, which fixes the mesh and, with
    the tree structure, every leaf's spec (``_call_checks.input_leaves``). The key of the call's
    memo (``Call.memo``: the tree structure, whether the leaves are this process's blocks, the
    backend's ``uneven_state()`` and per leaf :func:`~._call_checks.leaves_key`) stands for the
    leaves; where there is none, every leaf is read in full. ``call.local``: the leaves are this
    process's blocks (``SpmdFunction.local``), not the global values of the same shapes, whose
    blocks (and evenness) differ."""
    inputs = call.memo.get("inputs")
    if inputs is not None:
        return (inputs, torch.is_grad_enabled())
    leaves = tuple(
        (type(x), x.shape, x.dtype, x.device, x.requires_grad)
        if isinstance(x, torch.Tensor)
        else (type(x), x)
        for x in call.leaves
    )
    return (call.in_tree, torch.is_grad_enabled(), call.local, leaves)


def checked_signatures(mapped: Any) -> dict[tuple, Any]:
    """The signatures of ``mapped`` checked so far, each with whether its replays mark calls
    (a mesh of one instance) or its plan (several: ``_plan``); for tests and diagnostics."""
    table = getattr(mapped, "_signatures", {})  # (a plain function: none)
    return {s: e.marks if isinstance(e, Checked) else e for s, e in table.items()}


# --- reductions that hand back their operand ------------------------------------------------------


class _Probe(OneMemberPrimitives, MemberContext):
    """A replayed call on a mesh of one instance, for :func:`_calibrate`."""

    replaying = True

    def member(self, axes: tuple[str, ...]) -> int:
        return 0

    def member_device(self) -> torch.device:
        return torch.device("cpu")


def _calibrate() -> None:
    """Send a temporary and a named operand through each reduction of a replay: the chain
    ``"replayed"`` of ``_donation``."""
    with torch.enable_grad():
        temps = donation.probe(functools.partial(_probe_reductions, False))
        named = donation.probe(functools.partial(_probe_reductions, True))
    donation.LIMITS["replayed"] = donation.limits_of(temps, named)


def _probe_reductions(named: bool) -> None:
    push(_Probe(Mesh((1,), ("i",)), _calibrate))
    try:
        for op in (psum, pmean, pmax, pmin):
            if named:
                operand = torch.zeros(2, requires_grad=True) * 2.0
                op(operand, "i")
                del operand
            else:
                op(torch.zeros(2, requires_grad=True) * 2.0, "i")
    finally:
        pop()


_calibrate()
