"""An independent per-instance reference for spmd programs, shared by the test files.

Every instance of the mesh runs the per-device function in its own Python thread, on its own
block of the global inputs, exactly as a device would. Collectives exchange whole values through a
barrier and compute their result from the group's values with plain torch ops written from the
definitions in docs/design.md section 3 (and JAX's documentation for the untiled conventions).
Nothing here uses named_spmd's slicing, vmap levels or collective code: only ``P`` as a container
type and the mesh's ``{name: size}`` dict. The run is differentiable (autograd follows the values
through the threads; :func:`reference_jvp` gives forward tangents), so gradient tests use it too.

Programs are written against a *namespace* ``o`` that has the collectives as attributes, so the
same program runs on ``named_spmd`` itself and on :data:`REF` (and, in the JAX oracle, on
``jax.lax``)::

    def prog(o, x):
        return o.psum(x, "i")

    check_against_reference(prog, mesh, P("i"), P(), x)
"""

from __future__ import annotations

import functools
import itertools
import math
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

import named_spmd as ns

MeshShape = Mapping[str, int]

# --- pytrees (tuple / list / dict containers; everything else is a leaf) ----------------------


def _is_container(x: Any) -> bool:
    return isinstance(x, (tuple, list, dict)) and not isinstance(x, ns.PartitionSpec)


def tree_leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for k in sorted(tree) for leaf in tree_leaves(tree[k])]
    if _is_container(tree):
        return [leaf for t in tree for leaf in tree_leaves(t)]
    return [tree]


def tree_map(fn: Callable[..., Any], tree: Any, *rest: Any) -> Any:
    """Map over the leaves of ``tree`` (and the same-structured ``rest``)."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, tree[k], *(r[k] for r in rest)) for k in tree}
    if _is_container(tree):
        return type(tree)(tree_map(fn, t, *(r[i] for r in rest)) for i, t in enumerate(tree))
    return fn(tree, *rest)


def broadcast_specs(specs: Any, tree: Any) -> Any:
    """A tree shaped like ``tree`` with the spec that applies to each leaf (None means P())."""
    if specs is None or isinstance(specs, ns.PartitionSpec):
        spec = specs if specs is not None else ns.P()
        return tree_map(lambda _: spec, tree)
    if isinstance(specs, dict) and isinstance(tree, dict) and set(specs) == set(tree):
        return {k: broadcast_specs(specs[k], tree[k]) for k in tree}
    if (
        isinstance(specs, (tuple, list))
        and isinstance(tree, (tuple, list))
        and len(specs) == len(tree)
    ):
        return type(tree)(broadcast_specs(s, t) for s, t in zip(specs, tree))
    raise ValueError(f"reference: specs {specs!r} are not a prefix of {tree!r}")


# --- mesh coordinates and blocks ----------------------------------------------------------------


def all_coords(mesh_shape: MeshShape) -> list[dict[str, int]]:
    """Every instance's coordinates, row-major (first axis major)."""
    names = list(mesh_shape)
    ranges = [range(mesh_shape[a]) for a in names]
    return [dict(zip(names, c)) for c in itertools.product(*ranges)]


def entry_axes(spec: Sequence[Any], dim: int) -> tuple[str, ...]:
    if dim >= len(spec) or spec[dim] is None:
        return ()
    entry = spec[dim]
    return (entry,) if isinstance(entry, str) else tuple(entry)


def linear_index(coord: Mapping[str, int], axes: Sequence[str], mesh_shape: MeshShape) -> int:
    """Row-major index of ``coord`` over ``axes`` (first name major)."""
    index = 0
    for a in axes:
        index = index * mesh_shape[a] + coord[a]
    return index


def _group_count(spec: Sequence[Any], d: int, mesh_shape: MeshShape) -> int:
    return math.prod(mesh_shape[a] for a in entry_axes(spec, d))


def chunk_bounds(size: int, n: int, b: int) -> tuple[int, int]:
    """Where block ``b`` of ``n`` of a dim of ``size`` starts and stops, as ``torch.chunk`` (and
    DTensor's ``Shard``) cut it: ``ceil(size / n)`` rows each, the last blocks shorter or empty."""
    c = -(-size // n)
    return min(b * c, size), min((b + 1) * c, size)


def block_slices(
    global_shape: Sequence[int], spec: Sequence[Any], mesh_shape: MeshShape, coord: Mapping
) -> tuple[slice, ...]:
    """Where the block of ``coord`` sits in a global tensor of ``global_shape``."""
    out = []
    for d, size in enumerate(global_shape):
        b = linear_index(coord, entry_axes(spec, d), mesh_shape)
        out.append(slice(*chunk_bounds(size, _group_count(spec, d, mesh_shape), b)))
    return tuple(out)


def local_block(x: Any, spec: Sequence[Any], mesh_shape: MeshShape, coord: Mapping) -> Any:
    """The block of global ``x`` that the instance at ``coord`` receives."""
    if not isinstance(x, torch.Tensor):
        return x
    out = x[block_slices(x.shape, spec, mesh_shape, coord)].clone()
    # unreduced over A (docs/design.md section 2.2): the member at coordinate 0 of A holds the
    # value, the others zeros: parts that sum to it
    if any(coord[a] != 0 for a in getattr(spec, "unreduced", ())):
        return out * 0
    return out


def _placed(values: Sequence[torch.Tensor], spec: Sequence[Any], mesh_shape: MeshShape) -> tuple:
    """(the global shape, each instance's slices in it) of blocks laid side by side: along a
    split dim, block b starts after blocks 0..b-1 of the instances that differ from it only in
    that dim's axes (coordinate 0 of every other axis the spec names), whatever their sizes."""
    coords = all_coords(mesh_shape)
    rank = values[0].dim()

    def at(coord: Mapping) -> torch.Tensor:
        return values[coords.index(dict(coord))]

    starts: list[dict] = []  # per instance, per dim: where its block starts
    for coord in coords:
        row = {}
        for d in range(rank):
            axes = entry_axes(spec, d)
            home = {a: (coord[a] if a in axes else 0) for a in mesh_shape}
            b = linear_index(coord, axes, mesh_shape)
            row[d] = sum(at({**home, **_coord_of(k, axes, mesh_shape)}).shape[d] for k in range(b))
        starts.append(row)
    origin = {a: 0 for a in mesh_shape}
    shape = []
    for d in range(rank):
        axes = entry_axes(spec, d)
        n = _group_count(spec, d, mesh_shape)
        shape.append(
            sum(at({**origin, **_coord_of(k, axes, mesh_shape)}).shape[d] for k in range(n))
        )
    slices = [
        tuple(slice(starts[j][d], starts[j][d] + v.shape[d]) for d in range(rank))
        for j, v in enumerate(values)
    ]
    return shape, slices


def _coord_of(k: int, axes: Sequence[str], mesh_shape: MeshShape) -> dict[str, int]:
    """The coordinates over ``axes`` of row-major index ``k`` (first name major)."""
    out = {}
    for a in reversed(axes):
        k, out[a] = divmod(k, mesh_shape[a])
    return out


def assemble(
    values: Sequence[Any],
    spec: Sequence[Any],
    mesh_shape: MeshShape,
    *,
    check_invariant: bool = True,
    where: str = "output",
) -> Any:
    """Global value from every instance's local value (instances in row-major order).

    Axes the spec names concatenate blocks, of any sizes; along an axis it does not name the
    instance at coordinate 0 provides the value, and (with ``check_invariant``) every other
    instance must hold the same value, else AssertionError."""
    coords = all_coords(mesh_shape)
    first = values[0]
    if not isinstance(first, torch.Tensor):
        if check_invariant:
            assert all(v == first for v in values), f"reference: {where} differs between instances"
        return first
    named = {a for d in range(len(spec)) for a in entry_axes(spec, d)}
    unreduced = getattr(spec, "unreduced", frozenset())
    if unreduced:  # partial sums over those axes: each instance's value is the sum of its group's
        values = [
            functools.reduce(
                torch.add,
                [
                    v
                    for c, v in zip(coords, values)
                    if all(c[a] == coord[a] for a in mesh_shape if a not in unreduced)
                ],
            )
            for coord in coords
        ]
    global_shape, slices = _placed(values, spec, mesh_shape)
    out = torch.zeros(global_shape, dtype=first.dtype)
    for coord, v, where_ in zip(coords, values, slices):
        if all(coord[a] == 0 for a in mesh_shape if a not in named):
            out[where_] = v
    if check_invariant:
        for coord, v, where_ in zip(coords, values, slices):
            block = out[where_]
            if block.shape != v.shape or not torch.allclose(block, v, rtol=1e-12, atol=1e-12):
                raise AssertionError(
                    f"reference: {where} at {coord} differs from the copy that out_spec "
                    f"{tuple(spec)!r} claims is replicated"
                )
    return out


# --- the instances: threads that exchange values through a barrier -----------------------------

_state = threading.local()


class _World:
    def __init__(self, mesh_shape: MeshShape):
        self.mesh_shape = dict(mesh_shape)
        self.coords = all_coords(mesh_shape)
        self.slots: list[Any] = [None] * len(self.coords)
        self.barrier = threading.Barrier(len(self.coords), timeout=120)

    def exchange(self, k: int, value: Any) -> list[Any]:
        """Every instance's ``value`` (all instances must call this in the same order)."""
        self.slots[k] = value
        self.barrier.wait()
        snapshot = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return snapshot


def _me() -> tuple[_World, int]:
    state = getattr(_state, "instance", None)
    if state is None:
        raise RuntimeError("reference collective called outside run_reference")
    return state


def instance_index() -> int:
    """The calling instance's index (in :func:`all_coords` order), inside :func:`run_reference`."""
    return _me()[1]


def _axes(axis_name: str | Sequence[str]) -> tuple[str, ...]:
    return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def _group(axis_name) -> tuple[list[int], int]:
    """(instance ids of my group in group-index order, my index in it)."""
    world, k = _me()
    axes = _axes(axis_name)
    mine = world.coords[k]
    members = [
        j
        for j, c in enumerate(world.coords)
        if all(c[a] == mine[a] for a in world.mesh_shape if a not in axes)
    ]
    members.sort(key=lambda j: linear_index(world.coords[j], axes, world.mesh_shape))
    return members, linear_index(mine, axes, world.mesh_shape)


def _collective(compute: Callable[[list[torch.Tensor], int], torch.Tensor]):
    """Turn ``compute(group_values, my_index)`` into a per-leaf collective on pytrees."""

    def call(x, axis_name, *args, **kwargs):
        def leaf(t):
            world, k = _me()
            everyone = world.exchange(k, t)
            members, i = _group(axis_name)
            return compute([everyone[j] for j in members], i, *args, **kwargs)

        return tree_map(leaf, x)

    return call


def _sum(vals: list[torch.Tensor]) -> torch.Tensor:
    return functools.reduce(torch.add, vals)


def _all_gather(vals, i, *, axis=0, tiled=False, to="varying"):
    return torch.cat(vals, dim=axis) if tiled else torch.stack(vals, dim=axis)


def _psum_scatter(vals, i, *, scatter_dimension=0, tiled=False):
    total = _sum(vals)
    if tiled:  # torch.chunk's block i (a dim the group does not divide: shorter or empty ones)
        start, stop = chunk_bounds(total.shape[scatter_dimension], len(vals), i)
        return total.narrow(scatter_dimension, start, stop - start).clone()
    return total.select(scatter_dimension, i).clone()


def _all_to_all(vals, i, split_axis, concat_axis, *, tiled=False):
    n = len(vals)
    if tiled:  # chunk i of every member, concatenated in member order
        return torch.cat([v.chunk(n, split_axis)[i] for v in vals], dim=concat_axis)
    # JAX: np.insert(np.delete(shape, split_axis), concat_axis, n)
    return torch.stack([v.select(split_axis, i) for v in vals], dim=concat_axis)


def _ppermute(vals, i, perm):
    for src, dst in perm:
        if dst == i:
            return vals[src].clone()
    return torch.zeros_like(vals[i])


class _ReferenceOps:
    """The collectives, per instance, with named_spmd's signatures."""

    psum = staticmethod(_collective(lambda vals, i: _sum(vals)))
    pmean = staticmethod(_collective(lambda vals, i: _sum(vals) / len(vals)))
    # (copies: amax's backward reads its result, and a collective's result is a fresh value)
    pmax = staticmethod(_collective(lambda vals, i: torch.stack(vals).amax(0).clone()))
    pmin = staticmethod(_collective(lambda vals, i: torch.stack(vals).amin(0).clone()))
    all_gather = staticmethod(_collective(_all_gather))
    psum_scatter = staticmethod(_collective(_psum_scatter))
    all_to_all = staticmethod(_collective(_all_to_all))
    ppermute = staticmethod(_collective(_ppermute))
    pshuffle = staticmethod(_collective(lambda vals, i, perm: vals[perm[i]].clone()))
    pbroadcast = staticmethod(_collective(lambda vals, i, source: vals[source].clone()))

    @staticmethod
    def pvary(x, axis_name):
        return x

    @staticmethod
    def pcast(x, axis_name, *, to):  # the identity on every instance's data (section 3)
        return x

    @staticmethod
    def axis_index(axis_name) -> torch.Tensor:
        return torch.tensor(_group(axis_name)[1])

    @staticmethod
    def axis_size(axis_name) -> int:
        world, _ = _me()
        return math.prod(world.mesh_shape[a] for a in _axes(axis_name))


REF = _ReferenceOps()


def run_reference(
    fn: Callable[..., Any],
    mesh_shape: MeshShape | ns.Mesh,
    in_specs: Any,
    out_specs: Any,
    *args: Any,
    check_invariant: bool = True,
) -> Any:
    """What ``spmd_map(fn, ...)(*args)`` must return, computed one instance per thread.

    Differentiable: the instances exchange the tensors themselves and every step is a torch op,
    so autograd's graph runs from the global arguments through every thread to the result, and
    ``torch.autograd.grad`` of the result gives the reference's gradients (forward mode: see
    :func:`reference_jvp`). The caller's grad mode holds in the instance threads."""
    if isinstance(mesh_shape, ns.Mesh):
        mesh_shape = mesh_shape.shape
    world = _World(mesh_shape)
    arg_specs = broadcast_specs(in_specs, args)
    results: list[Any] = [None] * len(world.coords)
    errors: list[BaseException] = []
    grad_enabled = torch.is_grad_enabled()  # thread-local: a new thread would record anyway

    def instance(k: int) -> None:
        _state.instance = (world, k)
        torch.set_grad_enabled(grad_enabled)
        local = tree_map(
            lambda x, s: local_block(x, s, mesh_shape, world.coords[k]), args, arg_specs
        )
        try:
            results[k] = fn(*local)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)
            world.barrier.abort()

    threads = [threading.Thread(target=instance, args=(k,)) for k in range(len(world.coords))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    real = [e for e in errors if not isinstance(e, threading.BrokenBarrierError)]
    if errors:
        raise (real or errors)[0]
    return _assemble_tree(results, out_specs, mesh_shape, check_invariant)


def _assemble_tree(results, out_specs, mesh_shape, check_invariant):
    specs = broadcast_specs(out_specs, results[0])
    per_instance = [tree_leaves(r) for r in results]
    spec_leaves = tree_leaves(specs)
    assembled = iter(
        [
            assemble(
                [leaves[j] for leaves in per_instance],
                spec,
                mesh_shape,
                check_invariant=check_invariant,
                where=f"output leaf {j}",
            )
            for j, spec in enumerate(spec_leaves)
        ]
    )
    return _rebuild(results[0], assembled)


def _rebuild(tree: Any, leaves) -> Any:
    if isinstance(tree, dict):
        return {k: _rebuild(tree[k], leaves) for k in sorted(tree)}
    if _is_container(tree):
        return type(tree)(_rebuild(t, leaves) for t in tree)
    return next(leaves)


def tree_replace(tree: Any, leaves: Sequence[Any]) -> Any:
    """``tree`` with its leaves (in :func:`tree_leaves` order) replaced by ``leaves``."""
    return _rebuild(tree, iter(leaves))


def reference_jvp(
    fn: Callable[..., tuple[torch.Tensor, ...]],
    primals: Sequence[torch.Tensor],
    tangents: Sequence[torch.Tensor],
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Outputs and forward tangents of ``fn(*primals)``, a function (of tensors, to a tuple of
    tensors) that runs :func:`run_reference`.

    torch.func's transforms are per thread: ``torch.func.jvp`` of a function that runs the
    instance threads returns zero tangents. Reverse mode follows the threads, so the tangent is
    the double vjp: ``J t`` is the gradient of ``<J^T u, t>`` with respect to ``u``
    (torch.autograd.functional.jvp), which owes nothing to the forward-mode rules that
    named_spmd's own jvp uses."""
    return torch.autograd.functional.jvp(fn, tuple(primals), tuple(tangents))


# --- comparing ----------------------------------------------------------------------------------


def assert_trees_close(got: Any, want: Any, *, rtol: float = 1e-10, atol: float = 1e-10) -> None:
    """Same structure, same shapes and dtypes, values equal to rounding."""
    got_leaves, want_leaves = tree_leaves(got), tree_leaves(want)
    assert _structure(got) == _structure(want), f"structure {_structure(got)} != {_structure(want)}"
    for j, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if isinstance(w, torch.Tensor):
            assert isinstance(g, torch.Tensor), f"leaf {j}: got {type(g).__name__}"
            assert g.shape == w.shape, f"leaf {j}: shape {tuple(g.shape)} != {tuple(w.shape)}"
            assert g.dtype == w.dtype, f"leaf {j}: dtype {g.dtype} != {w.dtype}"
            torch.testing.assert_close(g, w, rtol=rtol, atol=atol, msg=lambda m: f"leaf {j}: {m}")
        else:
            assert g == w, f"leaf {j}: {g!r} != {w!r}"


def _structure(tree: Any) -> Any:
    if isinstance(tree, dict):
        return ("dict", tuple((k, _structure(tree[k])) for k in sorted(tree)))
    if _is_container(tree):
        return (type(tree).__name__, tuple(_structure(t) for t in tree))
    return "leaf"


def check_against_reference(
    prog: Callable[..., Any],
    mesh: ns.Mesh,
    in_specs: Any,
    out_specs: Any,
    *args: Any,
    check_vma: bool = True,
) -> Any:
    """Run ``prog(o, *local_args)`` with ``o = named_spmd`` and ``o = REF``; assert they agree.

    Returns named_spmd's result."""
    got = ns.spmd_map(
        functools.partial(prog, ns),
        mesh=mesh,
        in_specs=in_specs,
        out_specs=out_specs,
        check_vma=check_vma,
    )(*args)
    want = run_reference(
        functools.partial(prog, REF),
        mesh,
        in_specs,
        out_specs,
        *args,
        check_invariant=check_vma,
    )
    assert_trees_close(got, want)
    return got


def assert_close_within(got: Any, want: Any, tol: float, what: str = "") -> None:
    """Tensors or (nested) lists/tuples of tensors: same shapes and dtypes, max abs error < tol."""
    if isinstance(want, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(want), what
        for i, (g, w) in enumerate(zip(got, want)):
            assert_close_within(g, w, tol, f"{what}[{i}]")
        return
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    assert got.dtype == want.dtype, what
    err = (got - want).abs().max().item() if got.numel() else 0.0
    assert err < tol, f"{what}: max abs error {err:.3e}"
