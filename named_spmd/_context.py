"""The backend interface (:class:`SpmdContext`) and the active spmd_map call.

A backend runs the per-device function and gives the collectives a context: the object that
knows the running call's mesh, each value's :class:`~._types.Vma`, and how to move data between
the instances. The collectives (``_collectives``) are written once, in terms of the small set of
primitives declared here; a backend implements exactly these methods (docs/design.md, "Adding a
backend"). Collectives look up the innermost active call here; outside spmd_map there is none
and they raise a clear error instead of hanging or failing deep inside torch.
"""

from __future__ import annotations

import contextlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch.nn.attention import sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as _SDPA

from . import _torch_private as torch_private
from ._accounting import begin_recompute, end_recompute, live_modes
from ._errors import CollectiveError, fn_label, suggest
from ._layout import ragged_pack, ragged_place
from ._mesh import Mesh
from ._types import Vma

if TYPE_CHECKING:
    from ._collectives._record import Collective

Axes = tuple[str, ...]
ReduceOp = Literal["sum", "max", "min"]


# --- whether calls take blocks of unequal sizes -------------------------------------------------

_uneven = threading.local()


def uneven_blocks_requested() -> bool:
    """Whether calls made now take a dim the axes do not divide, in ``torch.chunk``'s blocks
    (``ns.simulate_per_instance()`` is active on this thread). Every backend that takes uneven
    blocks reads this one switch, so that they accept and refuse the same inputs."""
    return getattr(_uneven, "on", False)


@contextlib.contextmanager
def request_uneven_blocks() -> Iterator[None]:
    """Make :func:`uneven_blocks_requested` true inside the block (this thread)."""
    saved = uneven_blocks_requested()
    _uneven.on = True
    try:
        yield
    finally:
        _uneven.on = saved


class SpmdContext(ABC):
    """What a collective needs from the running call: the declared backend interface.

    Tensors are the per-instance values the user's function sees. ``axes`` is always a
    validated, non-empty tuple of mesh axis names; the group of ``axes`` is the instances that
    share this instance's coordinates on every other axis, numbered row-major over ``axes``
    (``n`` members; this instance is member ``axis_index(axes)``).
    """

    #: Whether the backend keeps each tensor's type in a stamp (:meth:`stamp`); the simulated
    #: backend reads types off its vmap levels instead, so results need no stamping there.
    stamps: bool = True
    #: Whether a call marks the torch-function mode stack (:class:`CallMarker`, for a
    #: checkpoint's recomputation); a call traced by torch.compile does not (Dynamo traces the
    #: recomputation itself, and cannot trace the mode-stack calls).
    marks_calls: bool = True
    #: the kernels ``scaled_dot_product_attention`` may pick inside the call (``sdpa_kernel``'s
    #: argument; None: torch's choice). The call's marker applies it, also in a checkpoint's
    #: recomputation (:class:`CallMarker`).
    sdpa_backends: Any = None
    #: A replay: a call whose signature an earlier call type-checked, on a mesh of one instance,
    #: where no value depends on a type (``_replay``). Collectives and casts run their forward
    #: on the one member without their type rules.
    replaying: bool = False
    #: Whether the out_specs check runs (``check_vma``): where it does not, a partial-sum
    #: input's cotangent may differ between the instances its type says hold one.
    checked: bool = True
    #: Set when the user's function asks for a type (``ns.vma``, ``ns.typeof``): a replay could
    #: not answer, so such a function is type-checked on every call.
    types_read: bool = False
    #: Inside a collective's own code (``Collective.bind``): the ops it runs under the call's
    #: mode (reading a property, a first call's probe) are not the user's program (``_plan``).
    in_collective: int = 0

    def __init__(self, mesh: Mesh, fn: Any) -> None:
        self.mesh = mesh
        self.fn = fn
        self.fn_label = fn_label(fn)
        self.single_axes = mesh.single_axes  # read on every collective: one attribute away

    def run_compiled(self, piece: Any, args: tuple, kwargs: dict) -> Any:
        """A piece given to ``ns.compile``, called in this call (``_compile``): uncompiled
        here; a backend that can compile it inside a call overrides this."""
        return piece.fn(*args, **kwargs)

    # --- types --------------------------------------------------------------------------------
    @abstractmethod
    def vma(self, x: torch.Tensor) -> Vma:
        """The type of ``x`` in this call (invariant for tensors from outside the call)."""

    def stamp(self, x: torch.Tensor, vma: Vma) -> torch.Tensor:
        """Record ``x``'s type where the backend tracks it per tensor; returns ``x``."""
        return x

    def check_operand(self, rec: Any, x: torch.Tensor, axes: Axes, params: tuple) -> tuple:
        """The collective ``rec``'s argument checks of ``x`` (``rec.check``); a backend whose
        members check operands of different shapes in processes of their own overrides it, so
        that every member raises the same error."""
        return rec.check(self, x, axes, params)

    def held_blocks(self, x: torch.Tensor) -> Any:
        """Where this call recorded it (``_blocks``): per dim of ``x``, the axes whose blocks
        it holds, and the axes it varies over for other reasons (a ``Layout``); None where the
        backend records none or ``x`` has no record."""
        return None

    @abstractmethod
    def axis_index(self, axes: Axes) -> torch.Tensor:
        """This instance's member index in the group of ``axes``: an i64 0-d tensor, varying
        over ``axes`` (stamped)."""

    @abstractmethod
    def per_member(self, axes: Axes, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        """``make(i)`` for this instance's member index ``i`` in the group of ``axes``, varying
        over ``axes`` (stamped). ``make`` builds a plain tensor from the index alone, of one
        shape and dtype for every ``i``; each backend calls it for the members it holds (the
        per-axis random draws of ``named_spmd.random`` are built on it)."""

    # --- data movement primitives ---------------------------------------------------------------
    @abstractmethod
    def pvary(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        """``x`` (invariant over ``axes``) as a value varying over them: the same data."""

    @abstractmethod
    def all_reduce(self, x: torch.Tensor, axes: Axes, op: ReduceOp) -> torch.Tensor:
        """Elementwise ``op`` over the group (``x`` varies over ``axes``); invariant result."""

    @abstractmethod
    def all_gather(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        """``[n, *x.shape]``: every member's ``x``, in member order; invariant over ``axes``."""

    #: Whether the members' blocks may differ in size (the per-instance simulation): a tiled
    #: all_gather then concatenates blocks of any sizes, and a tiled psum_scatter of a dim the
    #: group does not divide keeps torch.chunk's blocks.
    uneven: bool = False

    def all_gather_tiled(
        self, x: torch.Tensor, axes: Axes, dim: int, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """The members' ``x`` concatenated along ``dim``, in member order; invariant over
        ``axes``. ``sizes``: the members' sizes along ``dim``, where the caller knows them. A
        backend whose members' blocks may differ in size (:attr:`uneven`) overrides it."""
        stacked = self.all_gather(x, axes)
        return stacked.movedim(0, dim).flatten(dim, dim + 1) if dim else stacked.flatten(0, 1)

    def reduce_scatter_tiled(
        self, x: torch.Tensor, axes: Axes, dim: int, sizes: Sequence[int] | None = None
    ) -> torch.Tensor:
        """Sum over the group, keep this member's block of ``dim``: ``sizes`` (one per member,
        adding up to the dim) where given, else n equal blocks; varying. A backend with
        :attr:`uneven` overrides it (torch.chunk's blocks of a dim the group does not divide)."""
        n = self.mesh.axis_size(axes)
        return self.reduce_scatter(x.unflatten(dim, (n, -1)), axes, dim)

    def own_block_tiled(
        self, x: torch.Tensor, axes: Axes, dim: int, sizes: Sequence[int]
    ) -> torch.Tensor:
        """``x`` is invariant over ``axes``, its ``dim`` the members' blocks of ``sizes``
        concatenated: this member's block (varying). Only a backend whose collectives pass the
        block sizes to their transposes (a real mesh's uneven call) needs it."""
        raise NotImplementedError(f"{type(self).__name__} passes no block sizes to transposes")

    @abstractmethod
    def reduce_scatter(self, x: torch.Tensor, axes: Axes, dim: int) -> torch.Tensor:
        """``x`` has a dim ``dim`` of size n: sum over the group, keep slice ``axis_index`` of
        ``dim`` (the dim goes away); varying result."""

    @abstractmethod
    def all_to_all(self, x: torch.Tensor, axes: Axes, dim: int) -> torch.Tensor:
        """``x`` has a dim ``dim`` of size n: slice j goes to member j; the result has the same
        shape, its slice i along ``dim`` being what member i sent here."""

    #: Whether each instance's values are its own concrete tensors (the per-instance
    #: simulation, the eager real mesh): a collective may read sizes and offsets on the host,
    #: and the members' results may differ in shape. Not under vmap, on meta tensors or traced.
    own_values: bool = False

    def all_to_all_sizes(
        self,
        x: torch.Tensor,
        axes: Axes,
        dim: int,
        sent: tuple[int, ...],
        received: tuple[int, ...],
    ) -> torch.Tensor:
        """``x``'s dim ``dim`` cut into chunks of ``sent[j]`` (member order): chunk j goes to
        member j; the result is the chunks received (``received[i]`` from member i)
        concatenated along ``dim`` in source order. This default takes equal sizes only (the
        caller's check); a backend with :attr:`own_values` overrides it."""
        n = self.mesh.axis_size(axes)
        return self.all_to_all(x.unflatten(dim, (n, -1)), axes, dim).flatten(dim, dim + 1)

    def ragged_all_to_all(
        self,
        x: torch.Tensor,
        axes: Axes,
        m: int,
        offsets: torch.Tensor,
        sizes: torch.Tensor,
        placed_at: torch.Tensor,
        received: torch.Tensor,
    ) -> torch.Tensor:
        """Slot k (of K, a multiple of n; slot k goes to member ``k // (K // n)``) of ``x``'s
        rows ``offsets[k] : offsets[k] + sizes[k]`` is sent to its member. The result (``[m,
        *x.shape[1:]]``) holds received slot k (from member ``k // (K // n)``, ``received[k]``
        rows) at rows ``placed_at[k]...``, zeros elsewhere; all four are ``[K]`` int tensors,
        ``placed_at`` in this member's frame. This default pads every slot to ``x.shape[0]``
        rows for one even all_to_all (static shapes, as vmap needs; n times the data on the
        wire); a backend with :attr:`own_values` sends the rows alone."""
        n = self.mesh.axis_size(axes)
        packed = ragged_pack(x, offsets, sizes)
        got = self.all_to_all(packed.unflatten(0, (n, -1)), axes, 0).flatten(0, 1)
        return ragged_place(got, m, placed_at, received)

    @abstractmethod
    def permute(
        self, x: torch.Tensor, axes: Axes, pairs: tuple[tuple[int, int], ...]
    ) -> torch.Tensor:
        """Member ``dst`` receives member ``src``'s ``x`` for each pair; zeros elsewhere."""

    @abstractmethod
    def broadcast(self, x: torch.Tensor, axes: Axes, root: int) -> torch.Tensor:
        """Member ``root``'s ``x`` on every member: invariant over ``axes``."""

    @abstractmethod
    def own_block(self, x: torch.Tensor, axes: Axes, dim: int) -> torch.Tensor:
        """``x`` is invariant over ``axes`` with a dim ``dim`` of size n: this member's slice of
        it (the dim goes away); varying over ``axes``."""

    # --- how a collective runs ------------------------------------------------------------------
    def apply(
        self,
        rec: Collective,
        x: torch.Tensor,
        axes: Axes,
        params: tuple[Any, ...],
        user_operand: bool = False,
    ) -> torch.Tensor:
        """Run collective ``rec`` on ``x``. By default its forward on the primitives, which
        must then be differentiable themselves (the simulated backend's are); backends whose
        primitives are plain communication apply the generic autograd bridge
        (``_autodiff.apply``), whose backward is ``rec``'s declared transpose. ``user_operand``:
        ``x`` is what the user's code passed to the collective, which a backend may reduce in
        place where nothing else holds it and ``rec.donates`` (the real mesh:
        ``backends/_dist_donation``); other callers' operands are never overwritten."""
        return self.forward(rec, x, axes, params)

    def forward(
        self, rec: Collective, x: torch.Tensor, axes: Axes, params: tuple[Any, ...]
    ) -> torch.Tensor:
        """``rec``'s forward: written with the primitives (the abstract backend uses the
        record's shape rule instead)."""
        return rec.forward(self, x, axes, params)

    def resume(self) -> Callable[[], None]:
        """Re-establish this call's backend state for code torch runs after the call returned
        (a checkpoint's recomputation in backward, :class:`CallMarker`); returns its undo. The
        simulated backend re-enters its vmap levels; by default there is nothing to do."""
        return _nothing

    def psum_in_backward(self, g: torch.Tensor, axes: Axes, node: Any) -> torch.Tensor:
        """The transpose of a pvary outside any transform: the gradient summed over the group.
        ``node`` is the autograd context of the pvary (a backend may overlap the sum with the
        rest of the backward pass)."""
        return self.all_reduce(g, axes, "sum")

    # --- shared helpers -------------------------------------------------------------------------
    def check_axes(self, axis_name: str | Sequence[str], op: str) -> Axes:
        """Normalise an axis name or tuple of names; unknown or repeated names raise."""
        if isinstance(axis_name, str) and axis_name in self.mesh._shape:  # the common case
            return (axis_name,)
        names = self.mesh.axis_names
        # Only ordered sequences: a set's order follows string hashing, which differs between
        # the processes of one job, so ranks would number the group differently (JAX refuses too).
        ordered = isinstance(axis_name, (str, tuple, list))
        axes = ((axis_name,) if isinstance(axis_name, str) else tuple(axis_name)) if ordered else ()
        if not axes or not all(isinstance(a, str) for a in axes):
            unordered = isinstance(axis_name, (set, frozenset))
            raise CollectiveError(
                f"{op} in {self.fn_label}: axis_name must be a mesh axis name or a tuple of "
                f"them, got {axis_name!r}. The mesh has axes {names}. Fix: "
                + (
                    f"pass a tuple, e.g. {tuple(sorted(axis_name, key=str))!r}: a set has no "
                    "order, and the order numbers the group's members."
                    if unordered
                    else f"pass one of {names}, or a tuple of them, e.g. {names!r}."
                )
            )
        for a in axes:
            if a not in self.mesh.shape:
                raise CollectiveError(
                    f"{op} in {self.fn_label}: unknown mesh axis {a!r}; the mesh has axes "
                    f"{names}.{suggest(a, names)} Fix: name axes of the mesh the function is "
                    "mapped over (spmd_map(mesh=...))."
                )
        if len(set(axes)) != len(axes):
            raise CollectiveError(
                f"{op} in {self.fn_label}: axis_name {axes} repeats an axis. Fix: name each once."
            )
        return axes


def _nothing() -> None:
    pass


class OneMemberPrimitives:
    """The data-movement primitives over a group of one instance (every axis of the group has
    size 1): plain torch ops with the results the communication would give, differentiated by
    torch's own autograd. Mixed into :class:`GroupOfOne` and into the context of a simulated
    mesh of one instance (``backends/simulated/_one_instance``)."""

    def pvary(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        return x.view_as(x)

    def all_reduce(self, x: torch.Tensor, axes: Axes, op: ReduceOp) -> torch.Tensor:
        return x.clone()

    def all_gather(self, x: torch.Tensor, axes: Axes) -> torch.Tensor:
        return x.unsqueeze(0).clone()

    def reduce_scatter(self, x: torch.Tensor, axes: Axes, dim: int) -> torch.Tensor:
        return x.select(dim, 0).clone()

    def all_to_all(self, x: torch.Tensor, axes: Axes, dim: int) -> torch.Tensor:
        return x.clone()

    def permute(
        self, x: torch.Tensor, axes: Axes, pairs: tuple[tuple[int, int], ...]
    ) -> torch.Tensor:
        return x.clone() if pairs else torch.zeros_like(x)

    def broadcast(self, x: torch.Tensor, axes: Axes, root: int) -> torch.Tensor:
        return x.clone()

    def own_block(self, x: torch.Tensor, axes: Axes, dim: int) -> torch.Tensor:
        return x.select(dim, 0)


class GroupOfOne(OneMemberPrimitives, SpmdContext):
    """A call's collectives over a group of one instance. Backends that type tensors by stamps
    run such collectives through it, so a size-1 axis costs no communication (the types still
    change as declared)."""

    def __init__(self, ctx: SpmdContext) -> None:
        self.ctx, self.mesh, self.fn, self.fn_label = ctx, ctx.mesh, ctx.fn, ctx.fn_label
        self.single_axes = ctx.single_axes

    def vma(self, x: torch.Tensor) -> Vma:
        return self.ctx.vma(x)

    def axis_index(self, axes: Axes) -> torch.Tensor:
        return self.ctx.axis_index(axes)

    def per_member(self, axes: Axes, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return self.ctx.per_member(axes, make)


class _Calls(threading.local):
    def __init__(self) -> None:
        self.stack: list[SpmdContext] = []


_local = _Calls()


def push(ctx: SpmdContext) -> None:
    """Make ``ctx`` the active call, and mark the torch-function mode stack with it so that a
    checkpoint recomputation inside the call can find it again (:class:`CallMarker`)."""
    _local.stack.append(ctx)
    if ctx.marks_calls:
        torch_private.push_function_mode(CallMarker(ctx))


def pop() -> None:
    ctx = _local.stack.pop()
    if ctx.marks_calls:
        _remove_marker(ctx)


def active() -> SpmdContext | None:
    stack = _local.stack
    return stack[-1] if stack else None


def current(op: str) -> SpmdContext:
    stack = _local.stack
    if not stack:
        if (
            torch_private.current_graph_task_id() != -1
        ):  # in a backward pass: a recomputation, most likely
            raise CollectiveError(
                f"{op} was called in a backward pass, outside the spmd_map call it belongs to: "
                "a recomputation that does not restore the call (torch.utils.checkpoint with "
                "use_reentrant=True, or a non-reentrant checkpoint entered inside a "
                "`with torch.device(...)` block of the per-device function). Fix: use "
                "torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False), outside "
                "device blocks."
            )
        raise CollectiveError(
            f"{op} was called outside spmd_map. Collectives talk to the other instances of a "
            "mesh, so they only exist inside a per-device function. Fix: call it inside a "
            "function decorated with @named_spmd.spmd_map(mesh=..., in_specs=..., out_specs=...)."
        )
    return stack[-1]


# --- activation checkpointing: a call resumed in backward ---------------------------------------
#
# torch.utils.checkpoint (non-reentrant) runs the checkpointed piece again in backward, after the
# call returned: its collectives need the call's context, its ops the call's vma tracking, and on
# the simulated mesh its tensors the call's vmap levels. torch re-enters, around that recompute,
# the innermost DeviceContext mode of the forward (_torch_private); the marker below is one, and
# entering it again resumes the call (docs/design.md section 8).


class CallMarker(torch_private.DeviceContext):
    """A torch-function mode that marks a running call; entered by a checkpoint's recomputation,
    it resumes the call: the backend's state (:meth:`SpmdContext.resume`), the call's own modes
    (vma tracking), the active call, and the accounting of recomputed collectives as backward
    communication. Passes every op through unchanged, attention under the context's
    ``sdpa_backends``."""

    def __init__(self, ctx: SpmdContext) -> None:  # not DeviceContext's: no device is set
        self.ctx = ctx
        stack = _mode_stack()
        # the call's own modes (VmaMode & co), to push again
        self.modes = [m for m in stack if _of_call(m, ctx)]
        # the device context the call ran under: torch's checkpoint would have re-entered it
        self.outer_device = next(
            (
                m for m in reversed(stack) if isinstance(m, torch_private.DeviceContext)
            ),  # no marker yet
            None,
        )
        self.comm_modes = live_modes()  # for a recomputation on autograd's device thread
        self.undo: list[Callable[[], None] | None] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is _SDPA and self.ctx.sdpa_backends is not None:
            with sdpa_kernel(self.ctx.sdpa_backends):
                return func(*args, **(kwargs or {}))
        return func(*args, **(kwargs or {}))

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        """What ``torch.get_default_device()`` says without the marker (it reads the innermost
        DeviceContext mode's ``device``): the call's outer device context's, else the CPU."""
        outer = self.outer_device
        return torch.device("cpu") if outer is None else outer.device

    def __enter__(self) -> CallMarker:
        undo = None if active() is self.ctx else self._resume()
        torch_private.push_function_mode(self)
        self.undo.append(undo)
        return self

    def __exit__(self, *exc: object) -> None:
        _remove_marker(self.ctx)
        undo = self.undo.pop()
        if undo is not None:
            undo()

    def _resume(self) -> Callable[[], None]:
        undo = contextlib.ExitStack()  # its callbacks run last to first
        try:
            undo.callback(self.ctx.resume())
            outer = self.outer_device
            if outer is not None and not _on_mode_stack(outer):
                undo.enter_context(outer)
            for mode in self.modes:
                torch_private.push_function_mode(mode)
                undo.callback(torch_private.pop_function_mode)
            _local.stack.append(self.ctx)
            undo.callback(_local.stack.pop)
            undo.callback(end_recompute, begin_recompute(self.comm_modes))
        except BaseException:
            undo.close()
            raise
        return undo.close


def _mode_stack() -> list[Any]:
    """The torch function modes on the stack, bottom first."""
    return [torch_private.function_mode_at(i) for i in range(torch_private.function_mode_depth())]


def _of_call(mode: Any, ctx: SpmdContext) -> bool:
    """Whether ``mode`` is one of call ``ctx``'s own modes (they keep the call as ``.ctx``)."""
    return getattr(mode, "ctx", None) is ctx


def _on_mode_stack(mode: Any) -> bool:
    return any(m is mode for m in _mode_stack())


@contextlib.contextmanager
def without_call_modes(ctx: SpmdContext) -> Iterator[None]:
    """Call ``ctx``'s own torch function modes (its VmaMode, its marker) off the stack; the
    others stay, in their order (a piece compiled inside the call runs under none of them)."""
    stack = _mode_stack()
    ours = [i for i, m in enumerate(stack) if _of_call(m, ctx)]
    lifted = stack[ours[0] :] if ours else []
    kept = [m for m in lifted if not _of_call(m, ctx)]
    for _ in lifted:
        torch_private.pop_function_mode()
    for m in kept:
        torch_private.push_function_mode(m)
    try:
        yield
    finally:
        for _ in kept:
            torch_private.pop_function_mode()
        for m in lifted:
            torch_private.push_function_mode(m)


def _remove_marker(ctx: SpmdContext) -> None:
    """Pop the topmost marker of ``ctx``, wherever it sits (a ``torch.device`` block entered
    inside the call moves DeviceContext modes to the bottom of the stack)."""
    above = []
    while torch_private.function_mode_depth():
        mode = torch_private.pop_function_mode()
        if isinstance(mode, CallMarker) and mode.ctx is ctx:
            break
        above.append(mode)
    for mode in reversed(above):
        torch_private.push_function_mode(mode)
