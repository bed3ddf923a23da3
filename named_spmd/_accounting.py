"""Communication accounting: which logical collectives a program runs, forward and backward,
and for forward-mode tangents.

Events are recorded where collectives are *called* (the public layer), not inside a backend, so
every backend reports the same logical collectives; on a simulated mesh that is what a real mesh
would run, including the psum that an implicit pvary becomes in backward and the collectives that
a forward-mode tangent (``torch.func.jvp``, ``jacfwd``) runs: direction ``"tangent"``.
"""

from __future__ import annotations

import dataclasses
import math
import threading
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any

import torch

from ._torch_private import forward_level, get_unwrapped, maybe_get_level, version
from ._types import render


class _Modes(threading.local):
    """Per thread: the active CommModes, innermost last. An attribute that always exists:
    ``recording()`` runs on every collective, and a getattr default that misses costs ~1 us."""

    def __init__(self) -> None:
        self.stack: list[CommMode] = []
        self.recomputing = 0  # inside a checkpoint's recomputation (in backward)


_local = _Modes()


@dataclass(frozen=True)
class CommEvent:
    """One logical collective run by every instance of its group."""

    op: str
    axes: tuple[str, ...]
    # "forward", "backward", or "tangent": run to compute a forward-mode tangent (torch.func.jvp,
    # jacfwd, forward_ad), in the forward pass, beside the forward collective it differentiates
    direction: str
    shape: tuple[int, ...]  # per-instance shape of the message
    dtype: torch.dtype
    implicit: bool = False  # the backward psum of an implicit pvary
    # run at the call's boundary on a real mesh, between the global values and the instances
    # (the gradient all_gather of a plain-tensor input, ...): not part of the program's own
    # collectives, which every backend reports alike
    boundary: bool = False

    @property
    def nbytes(self) -> int:
        """Bytes of the per-instance message."""
        return math.prod(self.shape) * torch.empty((), dtype=self.dtype).element_size()


class CommMode:
    """Record the collectives run inside its ``with`` block (like DTensor's CommDebugMode).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("dp",))
        >>> f = ns.spmd_map(lambda x: ns.psum(x, "dp"), mesh=mesh, in_specs=ns.P("dp"), out_specs=ns.P())
        >>> with ns.CommMode() as comms:
        ...     _ = f(torch.ones(8))
        >>> comms.count("psum")
        1
    """

    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def __enter__(self) -> CommMode:
        _local.stack.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        _local.stack.remove(self)

    def count(
        self,
        op: str | None = None,
        axes: str | tuple[str, ...] | None = None,
        direction: str | None = None,
        boundary: bool | None = None,
    ) -> int:
        """How many events match (None matches anything): by default every collective run,
        the real mesh's boundary ones included."""
        if isinstance(axes, str):
            axes = (axes,)
        return sum(
            1
            for e in self.events
            if (op is None or e.op == op)
            and (axes is None or e.axes == tuple(axes))
            and (direction is None or e.direction == direction)
            and (boundary is None or e.boundary == boundary)
        )

    def counts(self, boundary: bool = False) -> dict[tuple[str, str, tuple[str, ...]], int]:
        """``{(direction, op, axes): count}`` of the program's collectives, the same on every
        backend; ``boundary=True`` adds the real mesh's boundary collectives."""
        return dict(
            Counter((e.direction, e.op, e.axes) for e in self.events if boundary or not e.boundary)
        )

    def summary(self) -> str:
        """A table: direction, collective, axes, count, bytes per instance."""
        return render("comm_text", self.events)

    def __repr__(self) -> str:
        return self.summary()

    def _repr_html_(self) -> str:
        return render("comm_html", self.events)


def recording() -> bool:
    return bool(_local.stack)


def suspend() -> list[CommMode]:
    """Stop every active CommMode of this thread from recording; returns them for ``resume``."""
    saved, _local.stack = _local.stack, []
    return saved


def resume(saved: list[CommMode]) -> None:
    _local.stack = saved


def begin_recompute(modes: list[CommMode]) -> tuple[int, list[CommMode]]:
    """A checkpoint's recomputation starts: its collectives run in backward, so they are
    recorded as backward communication until :func:`end_recompute`. ``modes``: the CommMode
    stack of the forward's thread (:func:`live_modes`), recorded into where this thread has none
    (autograd runs a CUDA backward on its own device thread)."""
    saved = (_local.recomputing, _local.stack)
    _local.recomputing += 1
    if not _local.stack:
        _local.stack = modes
    return saved


def end_recompute(saved: tuple[int, list[CommMode]]) -> None:
    _local.recomputing, _local.stack = saved


def live_modes() -> list[CommMode]:
    """This thread's CommMode stack itself (not a copy): it changes as modes enter and exit."""
    return _local.stack


def record(event: CommEvent) -> None:
    if _local.recomputing and event.direction == "forward":
        event = dataclasses.replace(event, direction="backward")
    for mode in _local.stack:
        mode.events.append(event)


def active() -> list[CommMode]:
    """This thread's live stack of CommModes (empty when none records)."""
    return _local.stack


def record_into(modes: list[CommMode], event: CommEvent) -> None:
    """Record ``event`` into ``modes``: a stack kept from the forward, for a backward that may
    run on another thread (see :class:`_Tag`)."""
    for mode in modes:
        mode.events.append(event)


@dataclass(frozen=True)
class _Derivatives:
    """The events of a tag: one argument of :class:`_Tag` that is no pytree (a tuple of
    events would flatten into leaves that functorch's generated vmap rule pairs with tangents).
    ``then``: the tag of the cotangent, for the collectives that the backward's own collectives
    run when the backward is differentiated in turn (double backward, forward over reverse).
    ``detached``: the tag hands back a detached alias (:meth:`_Tag.forward`), else a view."""

    backward: tuple[CommEvent, ...]
    tangent: tuple[CommEvent, ...]
    then: _Derivatives | None = None
    detached: bool = False


class _Tag(torch.autograd.Function):
    """Identity whose backward records the collectives that a real mesh runs there, and whose
    forward-mode rule those that the tangent's computation runs."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x: torch.Tensor, events: _Derivatives) -> torch.Tensor:
        # detached: the same memory and version counter, but no view to autograd, so a write
        # into a tagged result is taken as without the tag (autograd refuses a write into a view
        # that a custom Function made); a write into a cast's memory is still found by its
        # storage (``_tracking.check_cast_alias``) and a saved tensor's by its version
        return x.detach() if events.detached else x.view_as(x)

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.events = inputs[1]
        # autograd runs a CUDA backward on its own device thread, which has no CommMode stack
        # of its own: keep the forward thread's live stack to record into there
        ctx.stack = _local.stack

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        stack = _local.stack or ctx.stack
        for mode in stack:
            mode.events.extend(ctx.events.backward)
        then = ctx.events.then
        if then is not None and stack:
            saved, _local.stack = _local.stack, stack
            try:
                grad = tag(grad, then.backward, then.tangent)
            finally:
                _local.stack = saved
        return grad, None

    @staticmethod
    def jvp(ctx: Any, x_t: torch.Tensor, _: Any) -> torch.Tensor:
        for mode in _local.stack or ctx.stack:
            mode.events.extend(ctx.events.tangent)
        return x_t if ctx.events.detached else x_t.view_as(x_t)  # (as the forward's result)


def needs_grad(t: torch.Tensor) -> bool:
    """Whether ``t`` takes part in autograd at some level.

    A functorch vmap wrapper reports ``requires_grad=False`` even when the tensor it wraps is
    tracked (by autograd outside, or by a torch.func.grad level), so look through the wrappers."""
    while True:
        if t.requires_grad:
            return True
        if maybe_get_level(t) == -1:
            return False
        t = get_unwrapped(t)


def reusable_cast(t: torch.Tensor) -> bool:
    """Whether an implicit cast of ``t`` made now may serve its later uses in the call (the
    casts' caches, one alias per tensor and axes): not where grad is off and ``t`` takes part
    in autograd, since the alias, made without grad, would give a later use under grad no
    gradient (a use under ``no_grad`` first, then the differentiated one)."""
    return torch.is_grad_enabled() or not needs_grad(t)


def cast_version(t: torch.Tensor) -> int:
    """The version of ``t`` that an implicit cast of it is made at: a cast cached serves its
    later uses while ``t`` is unwritten. A cast is a view of ``t`` that a custom Function made
    (a real mesh's pvary, a ``CommMode``'s tag), which autograd refuses to use once ``t`` is
    written; a write makes the next use cast ``t`` again. (-1: an inference tensor, which has
    no version and takes no part in autograd.)"""
    try:
        return version(t)
    except RuntimeError:
        return -1


def memo_cast(
    cache: dict,
    key: Hashable,
    t: torch.Tensor,
    make: Callable[..., Any],
    *args: Any,
    tag: object = None,
) -> Any:
    """``make(*args)``, an implicit cast of ``t``: the one place that caches the call's casts.
    One per ``key`` in ``cache`` (``tag``, compared by identity, where the key leaves the cast's
    target out) and version of ``t`` (:func:`cast_version`), where :func:`reusable_cast` allows.
    An entry keeps ``t``, so that its id (in ``key``) is not reused meanwhile."""
    at = cast_version(t)
    hit = cache.get(key)
    if hit is not None and hit[3] == at and hit[1] is tag:
        return hit[2]
    return keep_cast(cache, key, t, make(*args), at, tag)


def keep_cast(
    cache: dict, key: Hashable, t: torch.Tensor, made: Any, at: int, tag: object = None
) -> Any:
    """``made``, a cast of ``t`` at version ``at``, as :func:`memo_cast` keeps what it made."""
    if reusable_cast(t):
        cache[key] = (t, tag, made, at)
    return made


def on_backward(x: torch.Tensor, event: CommEvent) -> torch.Tensor:
    """Tag ``x`` so that its backward records ``event`` (only while recording, only with grad):
    a collective linear in the cotangent, which runs again on the cotangent's tangent (forward
    over reverse) and whose own transpose communicates nothing (a psum's, a gather's of a
    plain input's gradient)."""
    return tag(x, (event,), (), ((), (dataclasses.replace(event, direction="tangent"),)))


def tag(
    x: torch.Tensor,
    backward: tuple[CommEvent, ...],
    tangent: tuple[CommEvent, ...],
    then: tuple[tuple[CommEvent, ...], tuple[CommEvent, ...]] = ((), ()),
    detached: bool = False,
) -> torch.Tensor:
    """Tag ``x`` so that its backward records ``backward`` and the computation of its
    forward-mode tangent records ``tangent`` (only while recording; each only where it can
    happen: with grad, inside a forward-AD level). ``then``: the events of the cotangent (the
    ``backward`` and ``tangent`` of a tag on it), where the backward is differentiated.
    ``detached``: the tagged tensor is a detached alias of ``x`` (a collective's result, which
    the user may write into), not a view."""
    if not recording():
        return x
    if not needs_grad(x):
        backward, then = (), ((), ())
    if tangent and forward_level() < 0:
        tangent = ()
    if not (backward or tangent or then[0] or then[1]):
        return x
    after = _Derivatives(*then) if then[0] or then[1] else None
    return _Tag.apply(x, _Derivatives(backward, tangent, after, detached))
