"""The implicit pvary on a real mesh, its common case with the layers between the cast and the
communication left out.

Every replicated parameter of a data-parallel step is cast once per call (``implicit_pvary``) and
its gradient summed once per backward pass (``_dist_overlap.psum_in_backward``). In the common
case (the operand invariant or varying, not reduced, over axes of more than one instance; grad
mode on; no ``torch.func`` transform, no forward-mode AD) the generic path only runs the
bridge's Function (``_autodiff.CollectiveFn``) and stamps the result, through the collective's
checks, its accounting, the context's ``apply``, the bridge's dispatch and the record's
transpose: about twenty Python calls per parameter and call, and six per gradient.
:class:`Pvary` is the bridge's Function for that case: the same node, with the same saved
state, whose forward is the pvary's (a new tensor object on the same data) and whose backward
goes straight to the overlapped, bucketed psum; a backward that is itself differentiated takes
the bridge's own transpose. Everything else takes the generic path, as does a cast made while a
``CommMode`` records (which records its backward psum), so values, gradients, types and
``CommMode`` events are those of the generic path.

Hoisted, in a replay (``_plan``): the inputs that the planned call pvary'd through this common
case (a parameter, or the source of a parameter's view) are pvary'd at the replay's entry, all
of one group, dtype and device by one :class:`PvaryAll` node, as DDP reduces its parameters'
gradients: one autograd node, one all-reduce of their concatenation when the last of their
gradients is in, instead of a node and a bucket entry per parameter. The cache of casts hands
each alias out at its first use (:func:`hoisted`), numbered then, as typing would; an alias no
op of the call uses gets no gradient, and its input none from it (as without the cast). The
group's all-reduce runs when its last gradient is in, and is waited for there (no overlap), so
only its inputs of at most :data:`MAX_HOISTED_BYTES` each are hoisted, and only where together
they fill less than a bucket (``set_grad_bucket_mb``); the others keep their buckets, started
as they fill. Values and gradients are the common case's; the all-reduces of a backward pass
are fewer.

The ranks' all-reduces of a backward pass must match element for element: a replay hoists only
where every rank's would hoist the same inputs (the start-of-call check, finished before: a rank
that types the call, having read a type in its planned call, makes none), and
a ``CommMode`` on one rank only still hoists, each alias then tagged at its use so that the
mode counts its backward psum (:func:`hoisted`). Once a replay of the plan hoisted, its check
agreed and it returned (:func:`note_agreed`), the plan's later replays hoist before the check is
finished, so that the check's round trip overlaps the body instead of stalling the call's entry:
every rank hoists the same there (a plan is never replaced, and every rank's first replay agreed
on the same one). The check still compares whether each rank hoisted early (:func:`digest`): a
rank that did not (its plan made after a call that failed on some ranks only) makes every rank
refuse the call where the others did (``_dist_agree._disagree``), and the next call checks first.
"""

from __future__ import annotations

from typing import Any

import torch

from .._accounting import _local as _modes
from .._accounting import cast_version, keep_cast, reusable_cast
from .._autodiff import _NONES, CollectiveFn, differentiable, differentiating
from .._collectives._record import PVARY_RECORD, implicit_pvary, record_implicit_psum
from .._stamps import _ATTR
from .._torch_private import (
    DisableTorchFunction,
    async_wait,
    forward_level,
    function_base_apply,
    transforms_active,
)
from .._types import Vma
from . import _dist_buckets as buckets
from . import _dist_overlap as overlap


class Pvary(CollectiveFn):
    """``CollectiveFn`` for the implicit pvary of the common case (module doc)."""

    @staticmethod
    def forward(x, rec, spmd, axes, params):
        return x.view_as(x)  # the pvary primitive: a new tensor object that gets its own stamp

    @staticmethod
    def backward(node, g):
        if differentiable(g):  # a differentiated backward: the bridge's transpose (a psum record)
            return CollectiveFn.backward(node, g)
        return overlap.psum_in_backward(g, node.spmd.mesh.comm(node.axes), node, "pvary"), *_NONES


_apply = function_base_apply.__get__(None, Pvary)


def pvary(ctx: Any, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """``implicit_pvary(ctx, t, axes)``: through :class:`Pvary` where the generic path would only
    apply the bridge and stamp (``ctx``: a plain ``DistributedContext``)."""
    vma = _common(ctx, t, axes)
    if vma is None:
        return implicit_pvary(ctx, t, axes)
    if ctx.recipes is not None:  # a planned call: its replays may make this cast at their entry
        _note(ctx, t, axes)
    if _modes.stack:  # a CommMode records the cast's backward psum (the generic path)
        return implicit_pvary(ctx, t, axes)
    with DisableTorchFunction():
        out = _apply(t, PVARY_RECORD, ctx, axes, ())
    # ctx.stamp (no transform: no wrapped tensor, no storage to own)
    out.__dict__[_ATTR] = ctx.stamp_of(vma.add(axes))
    if ctx.numbering:
        ctx.number(out)
    return out


def source_pvary(ctx: Any, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor:
    """The pvary of ``t``, the source of a view that is pvary'd (``DistributedContext.
    implicit_pvary``), its backward psum left out of a ``CommMode`` (the view's is recorded)."""
    tag = (*axes, VIEWS)
    alias = hoisted(ctx, t, tag) if ctx.hoisted_aliases else None
    if alias is not None:
        return alias
    if ctx.recipes is not None and _common(ctx, t, axes) is not None:
        _note(ctx, t, tag)
    return implicit_pvary(ctx, t, axes, False)


VIEWS = "<views>"

#: The largest input hoisted: a group's all-reduce is waited for in backward, not overlapped,
#: and its sums are copied out into new tensors, which costs more than the Python per parameter
#: it saves once the gradients are large (the Megatron MLP step of
#: benchmarks/bench_distributed.py at H=1024 is slower with its two 8 MB weights hoisted than
#: with their buckets); many small ones gain, however many
#: bytes they make together (the GPT step of benchmarks/bench_gpt.py at d=256, 4 layers: 12 MB
#: in 1 MB and smaller parameters).
MAX_HOISTED_BYTES = 1 << 20


def _common(ctx: Any, t: torch.Tensor, axes: tuple[str, ...]) -> Vma | None:
    """``t``'s type where its pvary over ``axes`` is the common case (module doc), else None."""
    vma = _vma(ctx, t)
    if vma.reduced or not t.requires_grad or not _common_now() or ctx.single_axes.issuperset(axes):
        return None
    return vma


def _vma(ctx: Any, t: torch.Tensor) -> Vma:
    held = t.__dict__.get(_ATTR)  # (ctx.vma, its usual case inlined)
    return held[1] if held is not None and held[0] is ctx.call_token else ctx.vma(t)


def _common_now() -> bool:
    """Whether a pvary made now may be the common case (module doc), whatever its operand."""
    return torch.is_grad_enabled() and not transforms_active() and forward_level() < 0


# --- hoisted in a replay ------------------------------------------------------------------------


def _note(ctx: Any, t: torch.Tensor, tag: tuple) -> None:
    """In a planned call: the cast of ``t`` by ``tag`` (its axes, then ``VIEWS`` for a view's
    source) is one a replay may hoist, if ``t`` is an input and the cast is cached."""
    if not reusable_cast(t):
        return
    at = next((i for i, x in enumerate(ctx.inputs) if x is t), None)
    if at is not None:
        if ctx.hoistable is None:
            ctx.hoistable = {}
        ctx.hoistable[(at, tag)] = None


def planned(ctx: Any) -> Hoistable:
    """``ctx.planned_hoistable()``: ((input position, tag), ...) in the order first cast. A
    plan's first replay that hoists waits for the start check at its entry, so nothing rides
    behind the check where a plan hoists (``_dist_carried``)."""
    hoisted = ctx.hoistable or ()
    if hoisted:
        return Hoistable(hoisted)
    return Hoistable(hoisted, ctx.carried_slots, ctx.carried_kind)


class Hoistable(tuple):
    """A plan's hoistable casts, ((input position, tag), ...), with what its replays derive
    from them alone, once: the positions' hash (:func:`digest`) and the groups :func:`hoist`
    makes (:meth:`groups`). Every input a group reads of (its type, requires_grad, dtype,
    device and size) is fixed by the plan's signature, which holds each leaf's spec, shape,
    dtype, device and requires_grad and the grad mode."""

    def __new__(cls, entries: Any = (), carried: int = 0, kind: tuple | None = None) -> Hoistable:
        return super().__new__(cls, entries)

    def __init__(self, entries: Any = (), carried: int = 0, kind: tuple | None = None) -> None:
        #: the slots of the exchange its replays carry behind the check (``_dist_carried``),
        #: and the (shape, dtype code) of the ppermute it carries where the plan noted them
        self.carried, self.carried_kind = carried, kind
        # (of ints only: hash(None) before Python 3.12 differs by process)
        self.digest = hash((tuple(at for at, _ in self), carried, kind or ()))
        self._groups: dict[int, tuple] = {}  # bucket cap -> groups
        #: a replay hoisted, agreed and returned: the later ones hoist before the check (module doc)
        self.agreed = False

    def groups(self, ctx: Any, cap: int) -> tuple:
        """((axes, ((input position, tag, the alias's type), ...)), ...): the groups of inputs
        of the common case, by axes, dtype and device, that :func:`hoist` pvarys together
        under a bucket cap of ``cap`` bytes (read off ``ctx``'s inputs, in the first replay)."""
        made = self._groups.get(cap)
        if made is None:
            made = self._groups[cap] = _groups(ctx, self, cap)
        return made


def digest(hoistable: tuple) -> int:
    """A hash of the input positions of ``hoistable`` (``Replay.hoistable``) and of the slots
    its replays carry, the same in every process, its low bit flipped where this replay hoists
    before the check (``agreed``): what the start-of-call check compares of it."""
    if isinstance(hoistable, Hoistable):
        return hoistable.digest ^ hoistable.agreed
    return hash((tuple(at for at, _ in hoistable), 0))


def hoists_early(hoistable: tuple) -> bool:
    """Whether a replay of ``hoistable`` hoists before the start-of-call check is finished."""
    return isinstance(hoistable, Hoistable) and hoistable.agreed


def _groups(ctx: Any, hoistable: Hoistable, cap: int) -> tuple:
    """:meth:`Hoistable.groups`, made."""
    groups: dict[tuple, list] = {}
    for at, tag in hoistable:
        t = ctx.inputs[at]
        vma = _vma(ctx, t)
        if t.requires_grad and not vma.reduced:
            axes = tag[:-1] if tag[-1] == VIEWS else tag
            groups.setdefault((axes, t.dtype, t.device), []).append((at, tag, vma.add(axes)))
    made = []
    for (axes, _, _), members in groups.items():
        if ctx.single_axes.issuperset(axes):
            continue  # (over a group of one a pvary is no node)
        small, total = [], 0  # the members of at most MAX_HOISTED_BYTES, and their bytes
        for member in members:
            n = _nbytes(ctx.inputs[member[0]])
            if n <= MAX_HOISTED_BYTES:
                small.append(member)
                total += n
        if len(small) < 2 or total >= cap:
            continue  # (one alone gains nothing; more than a bucket: its buckets overlap)
        made.append((axes, tuple(small)))
    return tuple(made)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def hoist(ctx: Any, hoistable: tuple) -> None:
    """``ctx.hoist_casts(hoistable)``: one :class:`PvaryAll` per group of axes, dtype and
    device whose inputs are each the common case and whose gradients fit one bucket. Only where
    every rank would (the start-of-call check, finished first: a rank that typed the call, or
    hoists other inputs, all-reduces other buffers in backward), or would as in an earlier call
    that agreed (:func:`hoists_early`: module doc)."""
    if not hoists_early(hoistable):
        ctx.mesh.finish_pending_check()
    if not _common_now() or ctx.hoist_refused:
        return
    if not isinstance(hoistable, Hoistable):  # (a plan's is one)
        hoistable = Hoistable(hoistable)
    cap = buckets.bucket_bytes()
    inputs, stamp_of = ctx.inputs, ctx.stamp_of
    ctx.hoisted_aliases = aliased = {}
    for axes, members in hoistable.groups(ctx, cap):
        ts = [inputs[at] for at, _, _ in members]
        with DisableTorchFunction():
            aliases = _apply_all(ctx, axes, *ts)
        for (_, tag, vma), t, alias in zip(members, ts, aliases):
            alias.__dict__[_ATTR] = stamp_of(vma)
            aliased[(id(t), tag)] = (t, alias)
    ctx.hoisted = bool(aliased)


def note_agreed(ctx: Any, hoistable: tuple) -> None:
    """At the end of a call that returned: where it hoisted ``hoistable`` (its plan's) and its
    check agreed, the plan's later replays hoist before their check is finished (module doc)."""
    if ctx.hoisted and not ctx.hoist_refused and isinstance(hoistable, Hoistable):
        hoistable.agreed = True


def hoisted(ctx: Any, t: torch.Tensor, tag: tuple) -> torch.Tensor | None:
    """The alias :func:`hoist` made of ``t`` for ``tag``, handed out once (the cache of casts
    keeps it from then on), with the number the cast it stands for gets in a typed call. While
    a ``CommMode`` records, a parameter's alias (not a view's source: the view's psum is
    recorded) is tagged so that its backward psum is counted."""
    hit = ctx.hoisted_aliases.pop((id(t), tag), None)
    if hit is None:
        return None
    alias = hit[1]
    if _modes.stack and tag[-1] != VIEWS:
        stamp = alias.__dict__[_ATTR]
        alias = record_implicit_psum(alias, tag)
        alias.__dict__[_ATTR] = stamp
    if ctx.numbering:
        ctx.number(alias)
    return alias


def first_use(ctx: Any, t: torch.Tensor, axes: tuple[str, ...]) -> torch.Tensor | None:
    """``ctx.cached_pvary(t, axes)`` where :func:`hoist` made the alias and no ``CommMode``
    records: what the generic path (``memo_cast``, ``implicit_pvary``, :func:`hoisted`) gives
    at the first use, without its calls (a replay's every parameter passes here); else None."""
    if _modes.stack:
        return None
    hit = ctx.hoisted_aliases.pop((id(t), axes), None)
    if hit is None:
        return None
    alias = hit[1]
    if ctx.numbering:
        ctx.number(alias)
    return keep_cast(ctx.pvary_cache, (id(t), axes), t, alias, cast_version(t))


def release(ctx: Any, hoistable: tuple) -> None:
    """``ctx.release_hoisted(hoistable)``, at the replay's end: the context lets go of the
    aliases made at its entry that no op used (those used went to the caches of casts, emptied
    as the call stops: ``TrackedContext.let_go``). Each one's node holds the context (for its
    backward), and the garbage collector does not follow a multi-output node from its outputs,
    so that cycle would keep every replayed call's context and inputs alive."""
    ctx.hoisted_aliases = None


class PvaryAll(torch.autograd.Function):
    """The pvary over ``axes`` of each of ``ts`` (one group, dtype and device): one node whose
    backward sums their gradients by one all-reduce (module doc)."""

    @staticmethod
    def forward(spmd, axes, *ts):
        # not views of the inputs for autograd (as view_as would make them): an input written
        # in place (under no_grad) before its alias's first use leaves the alias valid, as it
        # leaves a cast made at that use; the version counter is shared, so a write after a
        # use that saved the alias is still caught
        return tuple(t.detach() for t in ts)

    @staticmethod
    def setup_context(node, inputs, output):
        node.spmd, node.axes = inputs[0], inputs[1]
        node.set_materialize_grads(False)  # an alias no op used: no gradient, not zeros

    @staticmethod
    def backward(node, *gs):
        return None, None, *psum_all(node.spmd, node.axes, gs)


_apply_all = function_base_apply.__get__(None, PvaryAll)
_contiguous = torch.contiguous_format


def psum_all(spmd: Any, axes: tuple[str, ...], gs: tuple) -> list:
    """Each gradient of ``gs`` (None: none) summed over ``axes``: a differentiated one by the
    pvary's transpose through the bridge (as :class:`Pvary`), the others by one all-reduce of
    their concatenation, waited for here (it is the last gradient of the group), copied out
    into tensors of their own (as a bucket's members: no view pins the buffer)."""
    out = list(gs)
    flat: list[int] = []
    maybe = differentiating()  # (once: a backward pass that is not differentiated has none)
    for i, g in enumerate(gs):
        if g is None:
            continue
        if maybe and differentiable(g):
            out[i] = PVARY_RECORD.backward(spmd, g, axes, (), None)
        else:
            # chained pvary: the sum of the one below first (a plain tensor is no wrapper)
            if type(g) is not torch.Tensor and overlap.is_pending_wrapper(g):
                out[i] = async_wait(g)
            flat.append(i)
    if not flat:
        return out
    parts = [out[i] for i in flat]
    with DisableTorchFunction():
        buf = torch.cat([p.reshape(-1) for p in parts])
        comm = spmd.mesh.comm(axes)
        work = comm.start_all_reduce_(buf)
        try:  # the copies' memory is made while the sum travels (a group's gradients have its
            # one dtype and device: autograd checks each against its input's)
            sums = [torch.empty_like(p, memory_format=_contiguous) for p in parts]
        finally:
            comm.finish(work)  # (also where the allocation raised: no collective left waiting)
        torch.split_with_sizes_copy(buf, [p.numel() for p in parts], out=[s.view(-1) for s in sums])
    for i, s in zip(flat, sums):
        out[i] = s
    return out


def probe(ctx: Any) -> None:
    """One gradient through :class:`Pvary` on the donation calibration's probe context, whose
    mesh communicates nothing (``_dist_donation.calibrate``: the chain's reference counts)."""
    x = torch.zeros(2, requires_grad=True)
    with torch.enable_grad():
        y = _apply(x, PVARY_RECORD, ctx, ("i",), ())
        (y * 2.0).sum().backward()
