"""Types as stamps: :class:`TrackedContext`, for backends that run one instance per process.

The simulated backend reads vma off its vmap levels. The distributed and abstract backends run the
per-device function once, on local tensors, so they stamp every tensor with its vma instead:
inputs from their in_specs, collectives' outputs by their rule (``SpmdContext.stamp``), and every
other torch op by ``_tracking.VmaMode``. A stamp is ``(call token, Vma)`` kept in the tensor's
``__dict__``: a tensor that carries a stamp from another call (or none) is invariant here, like
any closed-over tensor. A planned call also numbers the tensors it types (``_plan``).
"""

from __future__ import annotations

from abc import abstractmethod
from typing import Any

import torch

from . import _blocks
from ._accounting import memo_cast
from ._calls import SRC_ATTR, VMA_ATTR
from ._collectives._record import implicit_cast, implicit_pvary
from ._context import SpmdContext
from ._torch_private import DisableTorchFunction, tensor_base
from ._torch_private import get_unwrapped as _unwrap
from ._torch_private import is_transform_wrapped as _is_wrapped
from ._torch_private import transforms_active as _transforms_active
from ._types import INVARIANT, Vma

_ATTR = VMA_ATTR
_SRC = SRC_ATTR  # a planned call's numbering of its typed tensors (``_plan``)
STAMP_ATTR = _ATTR  # the attribute holding a tensor's stamp (read with getattr where traced)


class Number:
    """The n-th tensor a planned call typed, as a replay's guard key (``_plan``): compared by
    identity, so that no argument value (an int) is ever mistaken for one."""

    __slots__ = ("n",)

    def __init__(self, n: int) -> None:
        self.n = n

    def __repr__(self) -> str:
        return f"#{self.n}"


_NUMBERS: list[Number] = []  # interned: the n-th of every call is one object


def _number(n: int) -> Number:
    while len(_NUMBERS) <= n:
        _NUMBERS.append(Number(len(_NUMBERS)))
    return _NUMBERS[n]


class TrackedContext(SpmdContext):
    """A call whose tensors carry their vma as a stamp. Subclasses implement the primitives."""

    def __init__(self, mesh, fn):
        super().__init__(mesh, fn)
        self.call_token = object()
        self.stamp_table: dict[int, tuple[object, Vma]] = {}  # id(type) -> its stamp
        # the caches of implicit casts, entries of ``_accounting.memo_cast``:
        # id(invariant tensor) -> its varying alias, tagged with the stamp it reaches: VmaMode's
        # fast path; (id(tensor), axes) -> its alias by those axes (or tag: ``memo_alias``)
        self.alias_cache: dict[int, tuple] = {}
        self.pvary_cache: dict[tuple[int, tuple[str, ...]], tuple] = {}
        # storage address -> (tensor, stamp) of values computed inside a torch.func transform:
        # a transform may hand back a new view of them (vmap moving its batch dim), which has
        # no stamp of its own (only views are looked up: a tensor that owns its storage and has
        # no stamp is invariant, even where a varying view of it was recorded). Kept alive, so
        # that no other tensor gets the address meanwhile.
        self.transform_results: dict[int, tuple[torch.Tensor, tuple[object, Vma]]] = {}
        # id(tensor) -> (tensor, the operand's type): the memory of operands an explicit cast
        # to varying (pvary, reduced -> varying) handed back as a view, the identity on data: a
        # varying write into the view would change the operand on this rank only
        # (``_tracking.check_cast_alias``); with its storage's address, compared with every
        # write's (:meth:`note_cast_root`)
        self.cast_roots: dict[int, tuple[torch.Tensor, Vma, int]] = {}
        # a planned or replayed call (``_plan``): each typed tensor gets the next number, and
        # each implicit cast's alias is remembered with what it was made from
        self.numbering = False
        self.numbered = 0
        self.recipes: dict[int, tuple[torch.Tensor, tuple]] | None = None

    def note_cast_root(self, root: torch.Tensor, vma: Vma) -> None:
        """``root``, the memory an explicit cast to varying of a value of type ``vma`` handed
        back, in :attr:`cast_roots` with its storage's address (read once, not per write)."""
        self.cast_roots[id(root)] = (root, vma, storage_address(root))

    def vma(self, x: torch.Tensor) -> Vma:
        stamp = x.__dict__.get(_ATTR)
        if stamp is not None and stamp[0] is self.call_token:
            return stamp[1]
        if _is_wrapped(x):  # a torch.func transform inside the function wrapped a stamped tensor
            return self.vma(_unwrap(x))
        return self._view_vma(x)

    def _view_vma(self, x: torch.Tensor) -> Vma:
        """The type of an unstamped tensor: a view's (one that no op of the mode made: an alias
        functorch made of a wrapped tensor, a batch dim moved, the expanded copies a user vmap
        hands back of a result it did not batch) is its base's, else, inside a torch.func
        transform, that of the transform result it shares storage with; a tensor that is no
        view is invariant."""
        base = _view_base(x)
        if base is None or x.is_meta:
            return INVARIANT
        stamp = base.__dict__.get(_ATTR)
        if stamp is not None and stamp[0] is self.call_token:
            return stamp[1]
        if not self.transform_results:
            return INVARIANT
        hit = self.transform_results.get(x.untyped_storage().data_ptr())
        return INVARIANT if hit is None else hit[1][1]

    def stamp_of(self, vma: Vma) -> tuple[object, Vma]:
        """The stamp for ``vma``, one per call and type: equal types share one stamp object, so
        :class:`VmaMode` compares operands by identity."""
        key = id(vma)  # types are interned and never freed: identity is equality (an int key
        # hashes in C, on the hot path of every collective)
        stamp = self.stamp_table.get(key)
        if stamp is None:
            stamp = self.stamp_table[key] = (self.call_token, vma)
        return stamp

    def stamp(self, x: torch.Tensor, vma: Vma) -> torch.Tensor:
        # (an unstamped tensor reads invariant, but for a view, which reads its base's type: a
        # complex operand reduced in place gives a view of it, ``_dist_comm.reduce_wire``)
        if vma is not INVARIANT or _ATTR in x.__dict__ or _view_base(x) is not None:
            if vma is not INVARIANT and not _is_wrapped(x) and _transforms_active():
                x = _own_storage(x)
            x.__dict__[_ATTR] = stamp = self.stamp_of(vma)
            if _is_wrapped(x):  # a collective under a user vmap: the tensor vmap hands back
                stamp_inner(self, x, stamp)  # is the unwrapped one, which must keep the type
        if self.numbering:
            self.number(x, vma)
        return x

    def number(self, x: torch.Tensor, vma: Vma | None = None) -> None:
        """Give ``x`` the call's next number (``_plan``: the key a replay's guard compares).
        A tensor typed outside the plan's steps (an input, a collective's result, a draw) is
        keyed by its type ``vma`` and its shape too: one collective may type its result
        otherwise in a later call (``all_gather(..., to=flag)``), or give it another shape
        (``tiled=flag``, a draw's size), which the ops after it must then be typed for."""
        n = self.numbered  # (_number inlined where interned: every typed tensor passes here)
        number = _NUMBERS[n] if n < len(_NUMBERS) else _number(n)
        x.__dict__[_SRC] = (self.call_token, number if vma is None else (number, vma, x.shape))
        self.numbered = n + 1

    def held_blocks(self, x: torch.Tensor) -> Any:
        return _blocks.recorded_layout(x, self.call_token)

    def pin(self, x: torch.Tensor, vma: Vma) -> torch.Tensor:
        """:meth:`stamp`, invariant types included (which ``stamp`` leaves implicit)."""
        x.__dict__[_ATTR] = stamp = self.stamp_of(vma)
        if _is_wrapped(x):
            stamp_inner(self, x, stamp)
        if self.numbering:
            self.number(x, vma)
        return x

    def stamp_input(self, x: torch.Tensor, spec: Any) -> torch.Tensor:
        """An input leaf under ``spec``: its type, and the blocks its dims hold (one leaf of
        :meth:`stamp_inputs`, which says how)."""
        local = [x]
        self.stamp_inputs(local, [spec], None)
        return local[0]

    def stamp_inputs(self, local: list[Any], specs: list[Any], memo: dict | None) -> None:
        """Stamp every tensor leaf of ``local`` (in place) with the type of its spec in
        ``specs``, and record the blocks its dims hold. Stamped even where invariant: one tensor
        passed at two argument positions (a backend hands a replicated input through as is) gets
        a tensor object per position, each typed by its own spec; and an invariant input may be
        the caller's tensor, or a view of it, whose storage a varying alias made inside a
        torch.func transform also holds (see ``vma``). Each leaf's type and blocks are read
        once per ``memo`` (``Call.memo``: its key holds every leaf's type and shape, its tree
        structure each spec); the stamps are written inline, with no call per leaf (every
        parameter of every call passes here). An eager call's: ``TracedContext`` stamps each
        input with its own :meth:`stamp_input`, as Dynamo can trace."""
        typed = None if memo is None else memo.get("input types")
        if typed is None:
            typed = [
                (i, specs[i].vma(), _blocks.input_layout(specs[i], x.dim()))
                for i, x in enumerate(local)
                if isinstance(x, torch.Tensor)
            ]
            if memo is not None and not torch.compiler.is_compiling():
                memo["input types"] = typed
        token, numbering = self.call_token, self.numbering
        for i, vma, lay in typed:
            x = local[i]
            held = x.__dict__.get(_ATTR)
            if held is not None and held[0] is token:  # (a second position: its own object)
                with DisableTorchFunction():
                    x = local[i] = x.view_as(x)
            d = x.__dict__
            d[_ATTR] = stamp = self.stamp_of(vma)
            if _is_wrapped(x):
                stamp_inner(self, x, stamp)
            if numbering:
                self.number(x, vma)
            if lay is not None:
                d[_blocks.ATTR] = (token, lay)

    def cached_cast(self, t: torch.Tensor, axes: tuple[str, ...], to: str) -> torch.Tensor:
        """``ns.pcast(t, axes, to=to)``, one per (tensor, axes, state) per call: the implicit
        cast of an invariant operand meeting reduced ones (its gradient summed once)."""
        alias = self.memo_alias(t, axes + (to,), lambda: implicit_cast(self, t, axes, to))
        if self.recipes is not None:
            self.recipes[id(alias)] = (t, ("cast", axes, to))
        return alias

    def cached_pvary(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """The implicit pvary of ``t`` over ``axes``: one alias per (tensor, axes) per call."""
        alias = memo_cast(self.pvary_cache, (id(t), axes), t, self.implicit_pvary, t, axes)
        if self.recipes is not None:
            self.recipes[id(alias)] = (t, ("pvary", axes))
        return alias

    def memo_alias(self, t: torch.Tensor, tag: tuple[str, ...], make) -> torch.Tensor:
        """``make()``, once per (``t``, ``tag``) per call (the caches of implicit casts)."""
        return memo_cast(self.pvary_cache, (id(t), tag), t, make)

    def let_go(self) -> tuple[dict, dict] | None:
        """The caches of implicit casts, handed over (``SpmdContext.let_go``): an alias's
        autograd node holds the context (for its backward) through nodes the garbage collector
        does not follow (a view's, as ``x @ w.T`` makes), so caches the context kept past the
        call would keep it, and its inputs, alive as long as the process. A recomputation takes
        them back: the forward's casts it met in the cache are hits again, not new ops (a
        selective checkpoint compares the two runs' ops)."""
        held = self.pvary_cache, self.alias_cache
        self.pvary_cache, self.alias_cache = {}, {}
        return held

    def take_back(self, held: tuple[dict, dict] | None) -> None:
        if held is not None:
            self.pvary_cache, self.alias_cache = held

    def implicit_pvary(self, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
        """The alias :meth:`cached_pvary` caches (a backend may place the pvary elsewhere)."""
        return implicit_pvary(self, t, axes)

    def planned_hoistable(self) -> tuple:
        """In a planned call, once it has run: the implicit casts of its inputs that a replay
        may make at its entry, all at once (:meth:`hoist_casts`); none unless a backend says."""
        return ()

    def hoist_casts(self, hoistable: tuple) -> None:
        """At a replay's entry, before its first op: make the casts ``hoistable`` (from
        :meth:`planned_hoistable`) ahead, for the call's caches to hand out at their first use."""

    def release_hoisted(self, hoistable: tuple) -> None:
        """At the replay's end (raised or not): let go of what :meth:`hoist_casts` made."""


def _own_storage(x: torch.Tensor) -> torch.Tensor:
    """``x``, copied where it is a view: a collective's varying result that a torch.func
    transform inside the function does not wrap (a user vmap's unbatched value), whose view
    the transform may hand back (vmap expands an unbatched result over its batch). That view
    is typed by its base (``TrackedContext.vma``), which must then be the typed result, not
    the collective's buffer or, for a pvary, its invariant operand."""
    if _view_base(x) is None:
        return x
    with DisableTorchFunction():
        return x.clone()


def _view_base(x: torch.Tensor) -> torch.Tensor | None:
    """A view's base (None for a non-view), read without the modes (a mode types the result of
    a property as it does an op's)."""
    with DisableTorchFunction():
        return tensor_base(x)


def stamp_inner(ctx: TrackedContext, x: torch.Tensor, stamp) -> None:
    """Stamp the tensors a torch.func transform wrapped ``x`` around, and remember the
    innermost one's storage: the transform returns the unwrapped tensor (or a view of it) to
    the per-device function, which must keep the type (an unstamped tensor reads as
    invariant, and a varying value typed invariant is silently wrong)."""
    while _is_wrapped(x):
        x = _unwrap(x)
        x.__dict__[_ATTR] = stamp
    if stamp[1] is not INVARIANT and not x.is_meta:
        base = _view_base(x)
        held = None if base is None else base.__dict__.get(_ATTR)
        if base is not None and (held is None or held[0] is not ctx.call_token):
            # x aliases a tensor typed otherwise (a pvary is a view of its operand): that one
            # keeps its own type, which the storage would no longer tell. A stamp of another
            # call (the caller's tensor, typed in an earlier call) is no type here: replaced.
            base.__dict__[_ATTR] = ctx.stamp_of(ctx.vma(base))
        ctx.transform_results[x.untyped_storage().data_ptr()] = (x, stamp)


def storage_address(t: torch.Tensor) -> int:
    """Where ``t``'s storage starts; 0 where it has none to compare (meta, sparse, a transform's
    wrapper, an empty storage)."""
    if t.is_meta or t.layout is not torch.strided or _is_wrapped(t):
        return 0
    return t.untyped_storage().data_ptr()


class MemberContext(TrackedContext):
    """A call whose instance is one member holding plain values (a rank, an instance's thread,
    a mesh of one): ``axis_index`` and ``per_member`` are built from its member index, stamped
    varying over the axes (only the stamp says where such a value varies)."""

    @abstractmethod
    def member(self, axes: tuple[str, ...]) -> int:
        """This instance's index in the group of ``axes``."""

    @abstractmethod
    def member_device(self) -> torch.device:
        """Where this instance's plain values live."""

    def axis_index(self, axes):
        with DisableTorchFunction():
            index = torch.tensor(self.member(axes), device=self.member_device())
        return self.stamp(index, Vma.of(axes))

    def per_member(self, axes, make):
        with DisableTorchFunction():
            value = make(self.member(axes))
        return self.stamp(value, Vma.of(axes))
