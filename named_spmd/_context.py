"""The backend interface: :class:`SpmdContext`, and the primitives over a group of one.

A backend runs the per-device function and gives the collectives a context: the object that
knows the running call's mesh, each value's :class:`~._types.Vma`, and how to move data between
the instances. The collectives (``_collectives``) are written once, in terms of the small set of
primitives declared here; a backend implements exactly these methods (docs/design.md, "Adding a
backend"). The running calls themselves are ``_calls``'s.
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch

from ._errors import CollectiveError, suggest
from ._errors import fn_label as label_of
from ._layout import ragged_pack, ragged_place
from ._mesh import Mesh
from ._types import Vma, shape_shown

if TYPE_CHECKING:
    from ._collectives._record import Collective

Axes = tuple[str, ...]
ReduceOp = Literal["sum", "max", "min"]


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
    #: The innermost functorch level the backend entered itself (the simulated mesh's axes;
    #: 0: none): a wrapper above it is a torch.func transform of the user's, inside the call.
    inner_level: int = 0
    #: Whether a call marks the torch-function mode stack (``_calls.CallMarker``, for a
    #: checkpoint's recomputation); a call traced by torch.compile does not (Dynamo traces the
    #: recomputation itself, and cannot trace the mode-stack calls).
    marks_calls: bool = True
    #: Whether the call's marker runs a write through a boolean mask of a one-element value as
    #: the ``masked_fill_`` it equals (``_masked_fill``): the simulated mesh's vmap refuses it.
    fills_masks: bool = False
    #: A torch-function mode that runs ``scaled_dot_product_attention`` inside the call (None:
    #: torch's choice of kernel). The call's marker pushes it around each attention op, also in
    #: a checkpoint's recomputation (``_calls.CallMarker``).
    attention: Any = None
    #: A torch-function mode of the call's own that its marker runs on each op instead of its
    #: being pushed (``_calls.CallMarker``): one Python dispatch per op, not two (the
    #: simulated mesh's typing of a call whose inputs hold blocks, ``_planned``).
    marker_typing: Any = None
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
    #: Set where the function read a value that may differ between instances on the host, or
    #: sized a tensor by one (``_operands.value_operands_read``): from there on, the instances
    #: may run other Python and make other shapes, so a real mesh compares its outputs'.
    values_read: bool = False
    #: Inside a collective's own code (``Collective.bind``): the ops it runs under the call's
    #: mode (reading a property, a first call's probe) are not the user's program (``_plan``).
    in_collective: int = 0
    deferred: tuple = ()  #: a real mesh's replay's ppermute results not made yet
    #: What ``_calls.unstamp`` removed from the caller's tensors as the call returned, for a
    #: checkpoint's recomputation to put back while it resumes the call (weak references)
    unstamped: list | None = None
    #: Tensors an op of the call handed back as its result, which may be the caller's (a
    #: closed-over tensor written in place, ``w.contiguous()``): :meth:`handed_back`
    returned: list | None = None

    def __init__(self, mesh: Mesh, fn: Any) -> None:
        self.mesh = mesh
        self.fn = fn
        self.single_axes = mesh.single_axes  # read on every collective: one attribute away

    def make_deferred(self, rec: Any = None, given: Any = None) -> None:
        """Make :attr:`deferred` (before collective ``rec`` of ``given``, or an op reading one)."""
        return None  # (only a real mesh defers)

    def handed_back(self, t: torch.Tensor) -> None:
        """Note ``t``, an op's operand that the op returned and the call typed or numbered
        (``Call.unstamp`` clears what the call wrote there: it may be the caller's tensor)."""
        if self.returned is None:
            self.returned = [t]
        else:
            self.returned.append(t)

    def note_handed_back(self, out: Any, args: Sequence[Any], kwargs: dict | None) -> None:
        """Note (:meth:`handed_back`) each operand that an op returned (``x.add_(1)``,
        ``w.contiguous()``, ``torch.atleast_1d(a, b)``) or wrote through ``out=``: the call
        stamps or numbers the op's results, which may be the caller's tensors. (Called for every
        op a planned call types or replays: the usual case, one tensor, costs one comparison.)"""
        if args and out is args[0]:
            self.handed_back(out)
        elif type(out) is not torch.Tensor or (kwargs and "out" in kwargs):
            _note_operands_among(self, out, args, kwargs)

    @functools.cached_property
    def fn_label(self) -> str:
        """The user's function, named for messages: built on first use (an error's; a backend
        that reads it on every call sets the mapped function's own, built once)."""
        return label_of(self.fn)

    def alone(self) -> GroupOfOne:
        """This call's collectives over a group of one instance. Made per collective, not kept
        on the context: the group holds the context, so a kept one would make a reference
        cycle, and every call's context (with its inputs) would wait for the garbage collector."""
        return GroupOfOne(self)

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

    def fused_below(self) -> int:
        """The leaves of one collective's pytree smaller than this many bytes may be reduced by
        one collective of their concatenation (``_collectives/_fused.py``); 0: each by its own
        (a backend whose collectives cost a round trip each says otherwise)."""
        return 0

    def check_operand(self, rec: Any, x: torch.Tensor, axes: Axes, params: tuple) -> tuple:
        """The collective ``rec``'s argument checks of ``x`` (``rec.check``); a backend whose
        members check operands of different shapes in processes of their own overrides it, so
        that every member raises the same error (and, after a read of a varying value, checks
        that every member calls it: ``_record._apply`` calls this then for any collective)."""
        return params if rec.check is None else rec.check(self, x, axes, params)

    def type_error(self, x: torch.Tensor, make: Callable[[tuple], Exception]) -> Exception:
        """``make(shape)``: the error of an operand ``x`` whose type a collective refuses,
        naming its shape (``shape_shown``); a backend whose members hold blocks of other sizes
        in processes of their own names the first instance's, as the simulated mesh does."""
        return make(shape_shown(x))

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

    #: Whether an instance's ``ragged_all_to_all`` problem (sizes that disagree with a peer's,
    #: slices outside a buffer) travels in its data exchange, for every member to raise the
    #: first member's alike (a real mesh, where a member that raised alone would leave the
    #: others inside the exchange); else each instance raises its own.
    tells_ragged_problems: bool = False

    #: Whether the call's blocks in and out are the caller's own (a real mesh's ``.local``
    #: call): its members' blocks, and so their split sizes, may differ as the caller's do.
    caller_blocks: bool = False

    def every_member(
        self, axes: Axes, values: tuple[int, ...]
    ) -> list[tuple[dict[str, int], tuple[int, ...]]]:
        """Every member's mesh coordinates and ``values`` (one length on every member) in the
        group of ``axes``, in member order, on every member alike. Only a real mesh's even call
        asks (its ranks know their own values alone, and must raise an error on every member
        alike)."""
        raise NotImplementedError(f"{type(self).__name__} exchanges no host values")

    #: The error every instance raises alike, each having every instance's values (an exchange
    #: such as :meth:`every_member`'s): a real mesh posts it to no failure board (no peer
    #: waits for it) and adds no note saying that one rank failed.
    raised_alike: BaseException | None = None

    def alike(self, error: BaseException) -> BaseException:
        """``error``, marked as raised on every instance alike (:attr:`raised_alike`)."""
        self.raised_alike = error
        return error

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
        told: tuple[int, ...] | None = None,
    ) -> torch.Tensor:
        """Slot k (of K, a multiple of n; slot k goes to member ``k // (K // n)``) of ``x``'s
        rows ``offsets[k] : offsets[k] + sizes[k]`` is sent to its member. The result (``[m,
        *x.shape[1:]]``) holds received slot k (from member ``k // (K // n)``, ``received[k]``
        rows) at rows ``placed_at[k]...``, zeros elsewhere; all four are ``[K]`` int tensors,
        ``placed_at`` in this member's frame. This default pads every slot to ``x.shape[0]``
        rows for one even all_to_all (static shapes, as vmap needs; n times the data on the
        wire); a backend with :attr:`own_values` sends the rows alone. ``told``: this member's
        problem row, for a backend that :attr:`tells_ragged_problems` (given in the forward
        only, whose result is read at the rows written alone: such a backend may leave the
        others unset)."""
        n = self.mesh.axis_size(axes)
        packed = ragged_pack(x, offsets, sizes)
        got = self.all_to_all(packed.unflatten(0, (n, -1)), axes, 0).flatten(0, 1)
        return ragged_place(got, m, placed_at, received)

    def checked_ragged(
        self, axes: Axes, meta: torch.Tensor, peer: torch.Tensor, rows: int, m: int
    ) -> torch.Tensor:
        """``ragged_all_to_all``'s ``[4, K]`` metadata ``meta``, checked against the peers'
        ``peer`` (``[6, K]``, with their buffers' rows) where the values cannot be read now
        (without :attr:`own_values`): a backend whose traced graph runs on a real mesh checks
        them when the graph runs; this default (vmap, ``.check()``) drops the rows outside."""
        return meta

    def carried_metadata(self, meta: torch.Tensor, axes: Axes) -> torch.Tensor | None:
        """``ragged_all_to_all``'s exchange of its ``[6, K]`` metadata (the offsets and sizes,
        then the operand's and output's rows in every slot), typed and counted as its tiled
        all_to_all, where the backend made it already (a real mesh's replay carries it behind
        the start-of-call check); None: the caller exchanges them."""
        return None

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
        (a checkpoint's recomputation in backward, ``_calls.CallMarker``); returns its undo. The
        simulated backend re-enters its vmap levels; by default there is nothing to do."""
        return _nothing

    def let_go(self) -> Any:
        """The call stops running (it returned, raised, or a resumption of it ended): what it
        holds only while it runs, handed over to its marker (``_calls.CallMarker``), which a
        checkpoint keeps for its recomputation (:meth:`take_back`); by default nothing."""
        return None

    def take_back(self, held: Any) -> None:
        """A checkpoint's recomputation resumes the call: what :meth:`let_go` handed over."""
        return None

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

    #: the operand a replay's reduction hands back itself (``_donation.hands_back``)
    donated: torch.Tensor | None = None

    def all_reduce(self, x: torch.Tensor, axes: Axes, op: ReduceOp) -> torch.Tensor:
        return x if x is self.donated else x.clone()

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


def _note_operands_among(
    ctx: SpmdContext, out: Any, args: Sequence[Any], kwargs: dict | None
) -> None:
    """:meth:`SpmdContext.note_handed_back` beyond its usual case: the ``out=`` tensors, and
    every result that is one of the operands (a list's items included)."""
    written = (kwargs or {}).get("out")
    for t in written if isinstance(written, (tuple, list)) else (written,):
        if isinstance(t, torch.Tensor):
            ctx.handed_back(t)
    results = out if isinstance(out, (tuple, list)) else (out,)
    if not any(isinstance(o, torch.Tensor) for o in results):
        return
    operands = [b for a in args for b in (a if isinstance(a, (tuple, list)) else (a,))]
    operands += [v for v in (kwargs or {}).values() if isinstance(v, torch.Tensor)]
    for o in results:
        if isinstance(o, torch.Tensor) and any(o is a for a in operands):
            ctx.handed_back(o)


class GroupOfOne(OneMemberPrimitives, SpmdContext):
    """A call's collectives over a group of one instance. Backends that type tensors by stamps
    run such collectives through it, so a size-1 axis costs no communication (the types still
    change as declared)."""

    def __init__(self, ctx: SpmdContext) -> None:
        self.ctx, self.mesh, self.fn = ctx, ctx.mesh, ctx.fn
        self.single_axes = ctx.single_axes

    @property
    def fn_label(self) -> str:
        """The call's label: a traced call's is computed eagerly, not read off ``fn`` here."""
        return self.ctx.fn_label

    def vma(self, x: torch.Tensor) -> Vma:
        return self.ctx.vma(x)

    def axis_index(self, axes: Axes) -> torch.Tensor:
        return self.ctx.axis_index(axes)

    def per_member(self, axes: Axes, make: Callable[[int], torch.Tensor]) -> torch.Tensor:
        return self.ctx.per_member(axes, make)
