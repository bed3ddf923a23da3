"""DTensors on a named_spmd mesh: the placements of a spec, and the conversions between a DTensor
and its local tensor that the call boundary makes for every input, output and gradient.

DTensor's own ``to_local`` / ``from_local`` rebuild a ``DTensorSpec`` (a dataclass with checks)
for every tensor, forward and backward, which costs tens of microseconds per tensor: a sizeable
part of a small training step. :class:`_LocalOf` and :class:`_DTensorOf` do the same conversions
with one spec per (placements, shape, stride, dtype) per mesh, made once, and fall back to the
public methods wherever the fast path does not apply. Every conversion is differentiable as many
times as asked: with ``create_graph=True`` (or under a transform) the backwards go through the
same Functions instead of the DTensors' internals.
"""

from __future__ import annotations

import functools
from typing import Any

import optree
import torch
from torch.distributed.tensor import DTensor, Partial, Placement, Replicate, Shard

from .. import _torch_private as torch_private
from .._autodiff import differentiable, unshared
from .._spec import PartitionSpec
from . import _dist_overlap as overlap
from ._dist_mesh import registered_mesh
from ._dist_plain import _fast, _transformed, first_holds

_new_dtensor = torch_private.dist().new_dtensor  # DTensor's constructor, with a cached spec


def placements(mesh, spec: PartitionSpec, rank: int) -> tuple:
    """DTensor placements of ``spec`` on ``mesh`` (cached per mesh, but not while Dynamo traces:
    the trace's placements are fake objects, which its replay of the store would leave in the
    cache for eager calls, and a cache the trace fills fails Dynamo's guard on it next call)."""
    if torch_private.memo_would_be_guarded():
        return _placements_of(mesh, spec, rank)
    # read for every DTensor input and output of every call: keyed by the spec's id, hashed in
    # C (a spec hashes and compares in Python), the spec kept in the entry (so no other object
    # gets its id while the entry lives)
    cache = mesh.placements_cache
    hit = cache.get((id(spec), rank))
    if hit is None or hit[0] is not spec:
        if len(cache) >= 4096:  # (specs made anew for every call: start again)
            cache.clear()
        hit = cache[id(spec), rank] = (spec, _placements_of(mesh, spec, rank))
    return hit[1]


def _placements_of(mesh, spec: PartitionSpec, rank: int) -> tuple:
    out: list[Placement] = [Replicate() for _ in mesh.axis_names]
    for d in range(rank):
        for a in spec.entry_axes(d):
            out[mesh.axis_names.index(a)] = Shard(d)
    for a in spec.unreduced:  # partial sums: DTensor's pending sum
        out[mesh.axis_names.index(a)] = Partial()
    return tuple(out)


def grad_placements(mesh, spec: PartitionSpec, rank: int) -> tuple:
    """The placements of the gradient of an input under ``spec``: those of the input, except
    that the states swap (section 2.2): a reduced axis leaves the gradient a partial sum there
    (``Partial``), and an unreduced one's cotangent is reduced, the same whole value on every
    part (``Replicate``; as ``Partial`` it would be counted once per part)."""
    places = placements(mesh, spec, rank)
    if not spec.reduced and not spec.unreduced:
        return places
    return tuple(
        Partial() if a in spec.reduced else Replicate() if a in spec.unreduced else p
        for a, p in zip(mesh.axis_names, places)
    )


# --- fast DTensor conversions --------------------------------------------------------------------


def _spec_for(mesh, local: torch.Tensor, places: tuple) -> Any:
    """The ``DTensorSpec`` of ``local`` with ``places``: one per layout per mesh, made once (not
    while Dynamo traces: it would guard the memo, and a traced shape may be symbolic)."""
    if torch_private.memo_would_be_guarded():
        return torch_private.dtensor_spec(mesh.device_mesh, local, places)
    key = (places, tuple(local.shape), local.stride(), local.dtype)
    spec = mesh.dtensor_specs.get(key)
    if spec is None:
        spec = mesh.dtensor_specs[key] = torch_private.dtensor_spec(mesh.device_mesh, local, places)
        hash(spec)  # kept on the spec (DTensor hashes it lazily), so every copy has it
    return _fresh(spec)


def _fresh(spec: Any) -> Any:
    """DTensor ops may annotate their spec: never share one. A shallow copy as copy.copy makes
    it (no __init__ or __setattr__, the same __dict__), without its generic protocol (2.6 vs
    0.4 us)."""
    fresh = object.__new__(type(spec))
    fresh.__dict__.update(spec.__dict__)
    return fresh


def _wrap(mesh, local: torch.Tensor, places: tuple, requires_grad: bool = False) -> DTensor:
    return _new_dtensor(local, _spec_for(mesh, local, places), requires_grad=requires_grad)


class _LocalOf(torch.autograd.Function):
    """``dtensor.to_local()``; backward wraps the gradient with a cached spec."""

    @staticmethod
    def forward(d, mesh, grad_places=None):
        local = torch_private.local_tensor(d)
        return local.view_as(local)  # a fresh tensor object: autograd metadata goes on it

    @staticmethod
    def setup_context(ctx, inputs, output):
        d = inputs[0]
        ctx.mesh, ctx.leaf, ctx.below = inputs[1], *_leaf_or_node(d)
        while not isinstance(d, DTensor):  # a transform's wrapper of a DTensor it closes over
            d = torch_private.get_unwrapped(d)
        # a reduced input's gradient is a partial sum (Partial) where the input is replicated
        given = inputs[2] if len(inputs) > 2 else None
        ctx.places = given or grad_places_of(d)
        ctx.held = d.placements if given else None  # (a call's input: :func:`input_parts`)
        ctx.set_materialize_grads(False)  # no gradient in: none out, as dense torch gives

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None
        return _local_grad(ctx.mesh, g, ctx.places, ctx.leaf, ctx.below, ctx.held), None, None

    @staticmethod
    def vmap(info, in_dims, d, mesh, grad_places=None):
        """functorch refuses a Function without one under ``torch.func.vmap``, even for a
        DTensor the vmap only closes over (unbatched); a batched DTensor never gets here
        (``local_input`` refuses it)."""
        return _LocalOf.apply(d, mesh, grad_places), None


def grad_places_of(d: DTensor) -> tuple:
    """The placements of the gradient of ``d.to_local()`` where none are given: ``d``'s, with
    ``Partial`` made ``Replicate`` (as torch's ``to_local`` makes them). The local tensor of a
    partial sum is one of its parts, and each part's gradient is the whole cotangent (the
    seeds of ``to_local(loss).backward()`` on every rank are that one cotangent, not parts
    that sum to it: n times the gradient)."""
    return tuple(Replicate() if p.is_partial() else p for p in d.placements)


def _leaf_or_node(d: Any) -> tuple[Any, Any]:
    """``(d, None)`` for a leaf DTensor, ``(None, its autograd node)`` for another (a view of a
    parameter made outside the call: the parameter's ``.grad`` may get the pending wrapper)."""
    return (d, None) if d.is_leaf else (None, d.grad_fn)


def input_parts(mesh, held: tuple | None, grad_places: tuple) -> tuple[str, ...]:
    """The axes over which a call's input, of placements ``held`` (None: not a call's input,
    a user's ``to_local``), is a partial sum whose gradient (``grad_places``) is whole:
    ``Partial`` there, its gradient ``Replicate`` (an unreduced in_spec); in mesh order."""
    if held is None:
        return ()
    names = mesh.axis_names
    return tuple(
        names[i]
        for i, (p, g) in enumerate(zip(held, grad_places))
        if p.is_partial() and not g.is_partial() and names[i] not in mesh.single_axes
    )


def _cotangent_parts(g: torch.Tensor, mesh, held: tuple | None, places: tuple) -> torch.Tensor:
    """``g``, a call input's gradient differentiated again, whose cotangent, the same on every
    member of the input's :func:`input_parts`, enters the call's backward as parts of it (the
    first member's the whole, the others' zeros), as the input's own value did: else each
    transpose behind it would count one copy per member."""
    parts = input_parts(mesh, held, places)
    return first_holds(g, mesh, parts, False, True) if parts else g


def _local_grad(
    mesh, g: torch.Tensor, places: tuple, leaf: Any, below: Any, held: tuple | None
) -> DTensor:
    """The gradient of a DTensor from that of its local tensor ``g`` (``leaf``: the DTensor,
    where it is a leaf; else ``below``: its autograd node). ``held``: a call input's own
    placements (:func:`input_parts`), else None."""
    if differentiable(g):  # double backward: a recorded conversion
        return _from_local(mesh, _cotangent_parts(g, mesh, held, places), places)
    g = unshared(g)
    if type(g) is torch.Tensor:  # (the usual gradient: plain, no reduction behind it)
        return _wrap(mesh, g, places)
    g = overlap.settled(g)
    # a leaf's .grad may hold the pending wrapper: plain once reduced
    if leaf is not None:
        overlap.into_leaf(g, leaf, functools.partial(_plain_local_grad, leaf, mesh))
    elif below is not None:
        overlap.into_leaves_below(
            g, below, lambda leaf: functools.partial(_plain_local_grad, leaf, mesh)
        )
    return _wrap(mesh, g, places)


class _LocalsOf(torch.autograd.Function):
    """:class:`_LocalOf` of several DTensors in one node (a call's DTensor inputs): one
    Function call forward and one backward, instead of one per DTensor. The gradients are
    wrapped together, once all of them are in; an output no op used gets none, as its DTensor
    gets none from a node of its own."""

    @staticmethod
    def forward(mesh, places, *ds):
        return tuple(local.view_as(local) for local in map(torch_private.local_tensor, ds))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.places = inputs[0], inputs[1]
        ctx.sources = tuple(map(_leaf_or_node, inputs[2:]))
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, *gs):
        mesh = ctx.mesh
        return (
            None,
            None,
            *(
                # (each a parameter: a leaf, ``source[0]``)
                None
                if g is None
                else _local_grad(mesh, g, places, source[0], source[1], source[0].placements)
                for g, places, source in zip(gs, ctx.places, ctx.sources)
            ),
        )


def to_locals_fast(mesh, ds: list[DTensor], grad_places: list[tuple | None]) -> tuple:
    """``d.to_local()`` of each of ``ds``, differentiable DTensors, outside any torch.func
    transform, in one node (:class:`_LocalsOf`); ``grad_places``: each one's gradient
    placements (None: its own)."""
    places = tuple(p or grad_places_of(d) for d, p in zip(ds, grad_places))
    if len(ds) == 1:
        return (_local_of(ds[0], mesh, places[0]),)
    return _locals_of(mesh, places, *ds)


class _DTensorOf(torch.autograd.Function):
    """``DTensor.from_local(local, ..., run_check=False)`` with a cached spec; backward takes
    the gradient's local tensor (redistributed first if its placements differ)."""

    @staticmethod
    def forward(local, mesh, places):
        return _wrap(mesh, local.view_as(local), places, local.requires_grad)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.places = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        if isinstance(g, DTensor):
            # a Partial (unreduced) output's parts each get the whole cotangent: Replicate
            want = tuple(Replicate() if p.is_partial() else p for p in ctx.places)
            if tuple(g.placements) != want:
                g = g.redistribute(ctx.mesh.device_mesh, want)
            # double backward: the recorded to_local (the local tensor has no graph)
            g = g.to_local() if differentiable(g) else torch_private.local_tensor(g)
        return g, None, None


def _plain_local_grad(leaf: DTensor, mesh) -> None:
    """The DTensor form of :func:`_dist_autograd.plain_grad`."""
    grad = leaf.grad
    if isinstance(grad, DTensor):
        local = torch_private.local_tensor(grad)
        if overlap.is_pending_wrapper(local):
            leaf.grad = _wrap(mesh, torch_private.async_buffer(local), tuple(grad.placements))


_local_of = _fast(_LocalOf)
_locals_of = _fast(_LocalsOf)
_dtensor_of = _fast(_DTensorOf)


def to_local_fast(
    mesh, d: DTensor, grad_places: tuple | None = None, transformed: bool | None = None
) -> torch.Tensor:
    """``d.to_local()``; ``transformed``: whether a torch.func transform is active, if known."""
    if torch.compiler.is_compiling():  # DTensor's own, which Dynamo traces
        return d.to_local(grad_placements=grad_places)
    if transformed is None:
        transformed = torch_private.transforms_active()
    if transformed:  # torch's own to_local has no setup_context, which functorch needs
        return _transformed(_LocalOf, d, mesh, grad_places)
    if not differentiable(d):
        local = torch_private.local_tensor(d)
        return local.view_as(local)
    return _local_of(d, mesh, grad_places)


def made_from(d: DTensor) -> torch.Tensor | None:
    """The local tensor that :class:`_DTensorOf` or :class:`_UnevenDTensorOf` made ``d``
    from (a call's output, as the call returned it), or None. Its ``to_local()`` then is that
    tensor: converting back and forth is the identity on the values and on the gradient
    (placements without ``Partial``, whose backward would sum the cotangent), so neither
    conversion need run, forward or backward; unless a hook or ``retain_grad`` waits for
    ``d``'s own gradient, or an in-place op made ``d`` another node's."""
    if type(d.grad_fn) not in _FROM_LOCAL_NODES or torch_private.watched(d):
        return None
    return d.__dict__.get(_MADE_FROM)


_MADE_FROM = "_named_spmd_made_from"


def _remember_source(d: DTensor, local: torch.Tensor, places: tuple) -> DTensor:
    """Keep ``local`` for :func:`made_from` where the round trip is the identity (no
    ``Partial``), on the DTensor (which holds its storage anyway), not on its node: a node
    would keep the storage for as long as the graph lives."""
    if not any(p.is_partial() for p in places):
        d.__dict__[_MADE_FROM] = local
    return d


def _from_local(mesh, local: torch.Tensor, places: tuple) -> DTensor:
    if torch.compiler.is_compiling():  # DTensor's own, which Dynamo traces
        return DTensor.from_local(local, mesh.device_mesh, places, run_check=False)
    if torch_private.transforms_active():
        return _transformed(_DTensorOf, local, mesh, places)
    if not differentiable(local):
        return _wrap(mesh, local.view_as(local), places)
    return _remember_source(_dtensor_of(local, mesh, places), local, places)


# --- DTensors whose Shard blocks differ in size (torch.chunk's) ----------------------------------


def _shaped(mesh, local: torch.Tensor, places: tuple, shape: tuple[int, ...]) -> DTensor:
    """The DTensor of global ``shape`` whose block on this rank is ``local``: the global shape
    is given, since no one rank's block says it when the blocks differ in size (its spec made
    once per layout, as :func:`_spec_for`'s)."""
    if torch_private.memo_would_be_guarded():
        spec = torch_private.dtensor_spec_shaped(mesh.device_mesh, places, shape, local.dtype)
        return _new_dtensor(local, spec, requires_grad=local.requires_grad)
    key = (places, shape, local.dtype)
    spec = mesh.dtensor_specs.get(key)
    if spec is None:
        spec = torch_private.dtensor_spec_shaped(mesh.device_mesh, places, shape, local.dtype)
        mesh.dtensor_specs[key] = spec
    return _new_dtensor(local, _fresh(spec), requires_grad=local.requires_grad)


class _UnevenDTensorOf(torch.autograd.Function):
    """:class:`_DTensorOf` of a block of an uneven split: the DTensor has the given shape."""

    @staticmethod
    def forward(local, mesh, places, shape):
        return _shaped(mesh, local.view_as(local), places, shape)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.places = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        return _DTensorOf.backward(ctx, g)[0], None, None, None


class _UnevenLocalOf(torch.autograd.Function):
    """:class:`_LocalOf` of a DTensor whose blocks differ in size: its gradient is a DTensor
    of the input's global shape (a gradient psum pending on the overlap is settled first)."""

    @staticmethod
    def forward(d, mesh, grad_places=None):
        local = torch_private.local_tensor(d)
        return local.view_as(local)

    @staticmethod
    def setup_context(ctx, inputs, output):
        d = inputs[0]
        ctx.mesh, ctx.shape = inputs[1], tuple(d.shape)
        ctx.places = inputs[2] if inputs[2] else grad_places_of(d)
        ctx.held = d.placements if inputs[2] else None  # (as :class:`_LocalOf`)
        ctx.set_materialize_grads(False)  # (as :class:`_LocalOf`)

    @staticmethod
    def backward(ctx, g):
        if g is None:
            return None, None, None
        if differentiable(g):  # double backward: a recorded conversion (as :func:`_local_grad`)
            g = _cotangent_parts(g, ctx.mesh, ctx.held, ctx.places)
            return _UnevenDTensorOf.apply(g, ctx.mesh, ctx.places, ctx.shape), None, None
        g = overlap.settled(unshared(g))
        if overlap.is_pending_wrapper(g):
            g = torch_private.async_wait(g)
        return _shaped(ctx.mesh, g, ctx.places, ctx.shape), None, None


# the nodes of the conversions that :func:`made_from` undoes
_FROM_LOCAL_NODES = frozenset(map(torch_private.node_class, (_DTensorOf, _UnevenDTensorOf)))


def uneven_to_local(mesh, d: DTensor, grad_places: tuple | None = None) -> torch.Tensor:
    """``d.to_local()`` of a DTensor whose Shard blocks differ in size."""
    if not differentiable(d):
        local = torch_private.local_tensor(d)
        return local.view_as(local)
    return _UnevenLocalOf.apply(d, mesh, grad_places)


def uneven_from_local(mesh, local: torch.Tensor, places: tuple, shape: tuple) -> DTensor:
    """``DTensor.from_local(local, ..., shape=shape, stride=contiguous)``, differentiable."""
    if not differentiable(local):
        return _shaped(mesh, local.view_as(local), places, shape)
    d = _UnevenDTensorOf.apply(local, mesh, places, shape)
    return _remember_source(d, local, places)


def blocks_equal(d: DTensor, sizes: tuple[int, ...]) -> bool:
    """Whether ``d``'s global shape is this rank's block's times the number of blocks along
    each dim: what :class:`_LocalOf` assumes, whose gradient's spec is keyed by the block.
    Else (``torch.chunk``'s blocks of a dim the group does not divide, or other sizes given to
    ``DTensor.from_local``) the gradient needs the global shape, which
    :class:`_UnevenLocalOf` keeps. ``sizes``: those of ``d``'s DeviceMesh (a registered
    mesh's, read without DeviceMesh's layout arithmetic)."""
    block = torch_private.local_tensor(d).shape
    splits = [1] * len(block)
    for size, p in zip(sizes, d.placements):
        if isinstance(p, Shard):
            splits[p.dim % len(block)] *= size
    return all(n == b * k for n, b, k in zip(d.shape, block, splits))


def to_local(tree: Any) -> Any:
    """Replace every DTensor in ``tree`` by this rank's local block (a plain tensor).

    Same as ``t.to_local()`` per DTensor (differentiable: the gradient flows back as a DTensor
    with the same placements, but ``Replicate`` for ``Partial``, as torch's), but cheaper for
    DTensors on a named_spmd mesh: the output of a call (not a partial sum) gives the local
    tensor the call made it from, with no conversion forward or backward."""
    if isinstance(tree, torch.Tensor):  # (one tensor, as a loss: no tree to map)
        return _leaf_to_local(tree)
    return optree.tree_map(_leaf_to_local, tree, none_is_leaf=True)


def _leaf_to_local(t: Any) -> Any:
    """:func:`to_local` of one leaf."""
    if not isinstance(t, DTensor):
        return t
    mesh = registered_mesh(t.device_mesh)
    if mesh is None:
        return t.to_local()
    # (not while Dynamo traces: it refuses to read a DTensor's grad_fn)
    untouched = torch_private.transforms_active() or torch.compiler.is_compiling()
    made = None if untouched else made_from(t)
    if made is not None:
        return made
    if not blocks_equal(t, mesh.axis_sizes):  # (torch's own where a transform or trace is)
        return t.to_local() if untouched else uneven_to_local(mesh, t)
    return to_local_fast(mesh, t)
