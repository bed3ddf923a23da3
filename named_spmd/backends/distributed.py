"""torch.distributed backend: one instance of the mesh per process, on a DeviceMesh.

``make_mesh`` returns a :class:`DistributedMesh` when a process group is initialized (under
``torchrun``, or after ``init_process_group``) and its world size equals the mesh size; a user's
own ``DeviceMesh`` with ``mesh_dim_names`` works as ``mesh=`` too. The per-device function runs
once per process, on local blocks:

* Inputs: a ``DTensor`` on the same DeviceMesh gives its local shard (its placements must be the
  ones the in_spec describes: ``Shard(d)`` on every mesh dim that splits tensor dim ``d``,
  ``Replicate()`` elsewhere); a plain tensor is the global value, present on every rank, and this
  rank takes its block. A plain tensor's gradient is the global gradient on every rank (its
  backward gathers the blocks: pass DTensors to avoid that communication when training).
* Outputs: DTensors with placements from out_specs, so ``out.full_tensor()`` is the simulated
  backend's result. ``out.to_local()`` (or :func:`to_local` for a pytree) gives this rank's
  block as a plain tensor. A tuple entry in non-mesh order, e.g. ``P(('tp', 'dp'))`` on a
  ``('dp', 'tp')`` mesh, has no DTensor placement: the blocks are exchanged (one ppermute) so the
  DTensor, in mesh order, holds the same global value; DTensor inputs get the inverse exchange.
  With ``check_vma=False``, an unnamed axis over which the value varies gets member 0's value
  (one broadcast), as in the simulated backend.
* vma is stamped per tensor (``_tracking.VmaMode``), so implicit pvary, the out_specs check and
  the collectives' rules behave exactly as in the simulated backend.

Failures: see ``_dist_failures`` (a rank that raises makes the others raise RankFailedError
naming it; ``NAMED_SPMD_DEBUG=1`` checks that all ranks call the same collectives).
"""

from __future__ import annotations

import inspect
import itertools
import math
import sys
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import optree
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from .._errors import RankFailedError, SpecError, SpmdError
from .._mesh import Mesh
from .._spec import PartitionSpec
from . import _dist_autograd as ops
from ._dist_comm import Comm
from ._dist_failures import FailureBoard, debug_enabled, set_debug, timeout_s
from ._tracking import TrackedContext, VmaMode

__all__ = [
    "DistributedMesh",
    "make_distributed_mesh",
    "mesh_from_device_mesh",
    "set_debug",
    "to_local",
    "timeout_s",
]

_no_torch_function = torch._C.DisableTorchFunction


# --- the mesh ----------------------------------------------------------------------------------


class DistributedMesh(Mesh):
    """A Mesh backed by a DeviceMesh: this rank's coordinates and a process group per set of
    axes (created up front on every rank, since creating a group is itself collective)."""

    def __init__(self, device_mesh: DeviceMesh, device_type: str):
        names = tuple(device_mesh.mesh_dim_names)
        super().__init__(
            tuple(device_mesh.mesh.shape), names, device_mesh=device_mesh, device_type=device_type
        )
        self.rank = dist.get_rank()
        self.grid = device_mesh.mesh.cpu()
        coords = device_mesh.get_coordinate()
        if coords is None:
            raise SpmdError(
                f"rank {self.rank} is not part of the DeviceMesh {self.grid.tolist()}; only its "
                "ranks may call spmd_map on it."
            )
        self.my_coords = dict(zip(names, coords))
        self.device = _device(device_type)
        self.poll = device_type == "cpu"  # gloo: wait in slices, watching for failed peers
        self.debug = False
        self._groups = _create_groups(device_mesh, names)
        self._comms: dict[tuple[str, ...], Comm] = {}
        key = f"{'x'.join(names)}-{zlib.crc32(str(self.grid.tolist()).encode()):08x}"
        store = dist.distributed_c10d._get_default_store()
        self.board = FailureBoard(store, self.rank, key, self.coords_of)

    def coords_of(self, rank: int) -> dict[str, int]:
        where = (self.grid == rank).nonzero()
        if len(where) == 0:
            return {}
        return dict(zip(self.axis_names, where[0].tolist()))

    def index_of(self, axes: tuple[str, ...], coords: dict[str, int]) -> int:
        """Row-major index of ``coords`` over ``axes`` (first name major)."""
        index = 0
        for a in axes:
            index = index * self.shape[a] + coords[a]
        return index

    def comm(self, axes: tuple[str, ...]) -> Comm:
        comm = self._comms.get(axes)
        if comm is None:
            comm = self._comms[axes] = Comm(
                self, axes, self._groups[frozenset(axes)], self._tuple_ranks(axes)
            )
        return comm

    def _tuple_ranks(self, axes: tuple[str, ...]) -> list[int]:
        ranks = []
        sizes = [self.shape[a] for a in axes]
        for combo in itertools.product(*(range(s) for s in sizes)):  # row-major over axes
            coords = {**self.my_coords, **dict(zip(axes, combo))}
            ranks.append(int(self.grid[tuple(coords[a] for a in self.axis_names)]))
        return ranks


def _device(device_type: str) -> torch.device:
    if device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(device_type)


def _create_groups(device_mesh: DeviceMesh, names: tuple[str, ...]) -> dict[frozenset, Any]:
    """One process group per non-empty set of axes: the DeviceMesh's own for single axes, new
    ones (ranks in mesh order, row-major) for several. Every rank creates them in one order."""
    groups: dict[frozenset, Any] = {frozenset([a]): device_mesh.get_group(a) for a in names}
    grid = device_mesh.mesh.cpu()
    spans_world = grid.numel() == dist.get_world_size()
    me = dist.get_rank()
    for r in range(2, len(names) + 1):
        for dims in itertools.combinations(range(len(names)), r):
            others = [d for d in range(len(names)) if d not in dims]
            rows = grid.permute(*others, *dims).reshape(-1, math.prod(grid.shape[d] for d in dims))
            for row in rows.tolist():
                if not spans_world and me not in row:
                    continue  # local synchronization: only members create it
                group = dist.new_group(row, use_local_synchronization=not spans_world, **_UNSORTED)
                if me in row:
                    groups[frozenset(names[d] for d in dims)] = group
    return groups


# Group ranks in mesh order where torch allows it (2.13+); otherwise Comm reorders blocks.
_UNSORTED = (
    {"sort_ranks": False} if "sort_ranks" in inspect.signature(dist.new_group).parameters else {}
)

_from_device_mesh: dict[int, tuple[DeviceMesh, DistributedMesh]] = {}


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> DistributedMesh:
    """The named_spmd mesh of a user's DeviceMesh (made once per DeviceMesh, on every rank)."""
    names = device_mesh.mesh_dim_names
    if not names:
        raise SpmdError(
            "spmd_map: a DeviceMesh needs mesh_dim_names to be used as mesh=, got none. Fix: "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))."
        )
    hit = _from_device_mesh.get(id(device_mesh))
    if hit is not None and hit[0] is device_mesh:
        return hit[1]
    mesh = DistributedMesh(device_mesh, device_mesh.device_type)
    _from_device_mesh[id(device_mesh)] = (device_mesh, mesh)
    return mesh


def make_distributed_mesh(
    shape: tuple[int, ...], names: tuple[str, ...], device_type: str | None
) -> DistributedMesh:
    """``make_mesh`` on an initialized process group: a DeviceMesh over all ranks, row-major."""
    if not dist.is_initialized():
        raise SpmdError(
            "make_mesh(simulated=False) needs an initialized torch.distributed process group. "
            "Fix: launch with torchrun (and call dist.init_process_group()), or drop "
            "simulated=False to simulate the mesh in this process."
        )
    Mesh(shape, names)  # validates names and sizes with the usual messages
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise SpmdError(
            f"make_mesh({shape}, {names}): the mesh has {math.prod(shape)} instances but the "
            f"process group has {world} ranks; a real mesh needs one rank per instance. Fix: "
            f"launch {math.prod(shape)} processes (torchrun --nproc-per-node "
            f"{math.prod(shape)}), or pick a shape whose product is {world}, or pass "
            "simulated=True to simulate it in one process."
        )
    if device_type is None:
        backend = str(dist.get_backend()).lower()
        device_type = "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"
    device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    return DistributedMesh(device_mesh, device_type)


# --- the running call --------------------------------------------------------------------------


class DistributedContext(TrackedContext):
    """A call on a real mesh: collectives go to the process groups of ``mesh``."""

    mesh: DistributedMesh

    def axis_index(self, axes):
        index = torch.tensor(self.mesh.comm(axes).index, device=self.mesh.device)
        return self.stamp(index, axes)

    # Collectives run with torch function modes off: their internal ops need no vma (the
    # public layer stamps the result) and would only pay the mode's per-op cost.
    def pvary(self, x, axes):
        with _no_torch_function():
            return ops.pvary(x, self.mesh.comm(axes))

    # The reductions take the operand's reference count first thing (see _donatable).
    def psum(self, x, axes):
        refs = sys.getrefcount(x)
        with _no_torch_function():
            return ops.psum(x, self.mesh.comm(axes), _donatable(x, refs))

    def pmax(self, x, axes):
        refs = sys.getrefcount(x)
        with _no_torch_function():
            return ops.pmax(x, self.mesh.comm(axes), _donatable(x, refs))

    def pmin(self, x, axes):
        refs = sys.getrefcount(x)
        with _no_torch_function():
            return ops.pmin(x, self.mesh.comm(axes), _donatable(x, refs))

    def all_gather(self, x, axes, axis, tiled, invariant):
        with _no_torch_function():
            return ops.all_gather(x, self.mesh.comm(axes), axis, tiled, invariant)

    def psum_scatter(self, x, axes, dim, tiled):
        with _no_torch_function():
            return ops.psum_scatter(x, self.mesh.comm(axes), dim, tiled)

    def all_to_all(self, x, axes, split, concat, tiled):
        with _no_torch_function():
            return ops.all_to_all(x, self.mesh.comm(axes), split, concat, tiled)

    def ppermute(self, x, axes, pairs):
        with _no_torch_function():
            return ops.ppermute(x, self.mesh.comm(axes), pairs)


# --- reducing a temporary in place ----------------------------------------------------------------
#
# ``ns.psum(h @ w, "tp")`` without autograd: the operand is a temporary that only the call chain
# of the public collective references, so the all-reduce may overwrite it instead of a copy (a
# 4 MB copy is a quarter of a 4 MB gloo all-reduce). Whether a user still holds the operand is
# read off its reference counts, compared with those of a temporary sent through the very same
# chain at import (_calibrate_donation); a named variable, a list entry, a view, a tensor saved by
# autograd or shared storage all add a reference. If the interpreter does not count a named
# variable apart from a temporary, donation stays off.

_DONATE: dict[str, Any] = {}


class _Probe(TrackedContext):
    """Records, from the same frame depth as DistributedContext's reductions, the counts of
    the operand."""

    def _seen(self, x, refs):
        self.seen = (refs, x._use_count(), _storage_uses(x))
        return x.clone()

    def psum(self, x, axes):
        refs = sys.getrefcount(x)
        return self._seen(x, refs)

    def pmax(self, x, axes):
        refs = sys.getrefcount(x)
        return self._seen(x, refs)

    pmin = pmax


def _storage_uses(x: torch.Tensor) -> int:
    return torch._C._storage_Use_Count(x.untyped_storage()._cdata)


def _calibrate_donation() -> None:
    from .. import _accounting, _context
    from .. import _collectives as C

    saved = getattr(_accounting._local, "stack", None)
    _accounting._local.stack = []  # a CommMode around the first call must not see the probes
    try:
        _probe_chains(C, _context)
    finally:
        _accounting._local.stack = saved


def _probe_chains(C, _context) -> None:
    mesh = Mesh((2,), ("i",))
    temps, named = [], []
    for op in (C.psum, C.pmean, C.pmax, C.pmin):
        for case in ("temporary", "named"):
            ctx = _Probe(mesh, _calibrate_donation)
            _context.push(ctx)
            try:
                if case == "temporary":
                    op(ctx.stamp(torch.zeros(2), {"i"}), "i")
                else:
                    operand = ctx.stamp(torch.zeros(2), {"i"})
                    op(operand, "i")
            finally:
                _context.pop()
            (temps if case == "temporary" else named).append(ctx.seen)
    refs = min(t[0] for t in temps)
    _DONATE["ok"] = all(n[0] > refs for n in named)
    _DONATE["limits"] = (refs, min(t[1] for t in temps), min(t[2] for t in temps))


def _donatable(x: torch.Tensor, refs: int) -> bool:
    """Whether nothing but the collective's own call chain references ``x`` (see above)."""
    if x.requires_grad or x._base is not None or not x.is_contiguous():
        return False
    if "ok" not in _DONATE:  # first use (the public collectives are importable by now)
        _calibrate_donation()
    if not _DONATE["ok"]:
        return False
    max_refs, max_uses, max_storage = _DONATE["limits"]
    try:
        return refs <= max_refs and x._use_count() <= max_uses and _storage_uses(x) <= max_storage
    except (RuntimeError, NotImplementedError):  # tensors without storage (wrappers)
        return False


def run(
    mesh: DistributedMesh,
    fn: Callable[..., Any],
    leaves: list[Any],
    specs: list[PartitionSpec],
    body: Callable[[list[Any], DistributedContext], list[torch.Tensor]],
    out_specs_of: Callable[[], list[PartitionSpec]],
) -> list[Any]:
    """Run ``body`` on this rank's blocks; return the outputs as DTensors (see module doc)."""
    board = mesh.board
    board.seq += 1
    mesh.debug = debug_enabled()
    ctx = DistributedContext(mesh, fn)
    try:
        local = [
            _local_input(mesh, leaf, spec, ctx, i) if isinstance(leaf, torch.Tensor) else leaf
            for i, (leaf, spec) in enumerate(zip(leaves, specs))
        ]
        with VmaMode(ctx):
            outs = body(local, ctx)
        return [_global_output(mesh, y, s, ctx.vma(y)) for y, s in zip(outs, out_specs_of())]
    except RankFailedError:
        raise
    except BaseException as e:
        board.post(e)
        if hasattr(e, "add_note"):
            coords = ", ".join(f"{a}={c}" for a, c in mesh.my_coords.items())
            e.add_note(
                f"[named_spmd] raised on rank {mesh.rank} (mesh coordinates {coords}); "
                "the other ranks stop with RankFailedError naming this rank."
            )
        raise


def to_local(tree: Any) -> Any:
    """Replace every DTensor in ``tree`` by this rank's local block (a plain tensor)."""
    return optree.tree_map(
        lambda t: t.to_local() if isinstance(t, DTensor) else t, tree, none_is_leaf=True
    )


# --- inputs --------------------------------------------------------------------------------------


def _placements(mesh: DistributedMesh, spec: PartitionSpec, rank: int) -> tuple:
    out = [Replicate() for _ in mesh.axis_names]
    for d in range(rank):
        for a in spec.entry_axes(d):
            out[mesh.axis_names.index(a)] = Shard(d)
    return tuple(out)


def _local_input(mesh, leaf, spec, ctx, i) -> torch.Tensor:
    if isinstance(leaf, DTensor):
        local = _from_dtensor(mesh, leaf, spec, ctx, i)
    else:
        if leaf.device.type != mesh.device.type:
            leaf = leaf.to(mesh.device)
        if not spec.axes:
            local = leaf
        elif ops._differentiable(leaf):
            local = ops._apply(_ScatterInput, leaf, mesh, spec)
        else:
            local = _block(leaf, spec, mesh)
    return ctx.stamp(local, spec.axes)


def _from_dtensor(mesh, leaf, spec, ctx, i) -> torch.Tensor:
    where = f"spmd_map of {ctx.fn_label}: argument leaf {i}"
    theirs = leaf.device_mesh
    if theirs is not mesh.device_mesh and (
        tuple(theirs.mesh_dim_names or ()) != mesh.axis_names
        or not torch.equal(theirs.mesh.cpu(), mesh.grid)
    ):
        raise SpecError(
            f"{where} is a DTensor on DeviceMesh {theirs.mesh.tolist()} with dims "
            f"{theirs.mesh_dim_names}, not on the mapped mesh {mesh.grid.tolist()} "
            f"{mesh.axis_names}. Fix: create it on the same mesh (mesh.device_mesh), or pass "
            "a plain tensor holding the global value."
        )
    want = _placements(mesh, spec, leaf.dim())
    if tuple(leaf.placements) != want:
        raise SpecError(
            f"{where} is a DTensor with placements {tuple(leaf.placements)}, but its in_spec "
            f"{spec!r} on mesh axes {mesh.axis_names} means placements {want}. Fix: "
            f"x.redistribute(mesh.device_mesh, {list(want)}), or change the in_spec."
        )
    local = leaf.to_local()
    for axes in _non_mesh_order_entries(mesh, spec):
        local = ops.ppermute(
            local, mesh.comm(_in_mesh_order(mesh, axes)), _relayout_pairs(mesh, axes)
        )
    return local


def _block(x: torch.Tensor, spec: PartitionSpec, mesh: DistributedMesh) -> torch.Tensor:
    """This rank's block of the global ``x``."""
    for d in range(x.dim()):
        axes = spec.entry_axes(d)
        if axes:
            size = x.shape[d] // mesh.axis_size(axes)
            x = x.narrow(d, mesh.index_of(axes, mesh.my_coords) * size, size)
    return x


def _assemble(stacked: torch.Tensor, spec: PartitionSpec, mesh: DistributedMesh) -> torch.Tensor:
    """[n, *block] (blocks row-major over spec.axes) -> the global tensor."""
    local = stacked.shape[1:]
    split = [d for d in range(len(local)) if spec.entry_axes(d)]
    counts = [mesh.axis_size(spec.entry_axes(d)) for d in split]
    x = stacked.reshape(*counts, *local)
    perm, sizes = [], []
    for d in range(len(local)):
        if d in split:
            perm.append(split.index(d))
            sizes.append(counts[split.index(d)] * local[d])
        else:
            sizes.append(local[d])
        perm.append(len(split) + d)
    return x.permute(*perm).reshape(sizes)


class _ScatterInput(torch.autograd.Function):
    """Global value -> this rank's block; backward gathers the blocks of the gradient, so every
    rank holds the global gradient of the global input (as the simulated backend returns)."""

    @staticmethod
    def forward(x, mesh, spec):
        return _block(x, spec, mesh)

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.mesh, ctx.spec = inputs[1], inputs[2]

    @staticmethod
    def backward(ctx, g):
        stacked = ctx.mesh.comm(ctx.spec.axes).all_gather(g, "gradient of a plain input")
        return _assemble(stacked, ctx.spec, ctx.mesh), None, None

    @staticmethod
    def jvp(ctx, t, *_):
        return _block(t, ctx.spec, ctx.mesh)


ops._fast_apply(_ScatterInput)


# --- outputs -------------------------------------------------------------------------------------


def _in_mesh_order(mesh, axes: Sequence[str]) -> tuple[str, ...]:
    return tuple(a for a in mesh.axis_names if a in axes)


def _non_mesh_order_entries(mesh, spec: PartitionSpec) -> list[tuple[str, ...]]:
    entries = [spec.entry_axes(d) for d in range(len(spec))]
    return [e for e in entries if len(e) > 1 and e != _in_mesh_order(mesh, e)]


def _relayout_pairs(mesh, axes: tuple[str, ...]) -> tuple[tuple[int, int], ...]:
    """Pairs (in the mesh-order group of ``axes``) that move block ``b`` from the rank whose
    mesh-order index is ``b`` (DTensor's layout) to the rank whose ``axes``-order index is ``b``."""
    ordered = _in_mesh_order(mesh, axes)
    pairs = []
    for combo in itertools.product(*(range(mesh.shape[a]) for a in ordered)):
        coords = dict(zip(ordered, combo))
        pairs.append((mesh.index_of(axes, coords), mesh.index_of(ordered, coords)))
    return tuple(pairs)


def _global_output(mesh, y: torch.Tensor, spec: PartitionSpec, vma) -> DTensor:
    unnamed_varying = tuple(a for a in mesh.axis_names if a in vma and a not in spec.axes)
    named_invariant = tuple(a for a in mesh.axis_names if a in spec.axes and a not in vma)
    with _no_torch_function():
        if unnamed_varying:  # check_vma=False: member 0's value, as the simulated backend
            y = ops.broadcast(y, mesh.comm(unnamed_varying))
        if named_invariant:  # identical blocks tiled: their cotangents differ and must be summed
            y = ops.pvary(y, mesh.comm(named_invariant))
        for axes in _non_mesh_order_entries(mesh, spec):
            pairs = tuple((d, s) for s, d in _relayout_pairs(mesh, axes))
            y = ops.ppermute(y, mesh.comm(_in_mesh_order(mesh, axes)), pairs)
    return DTensor.from_local(
        y, mesh.device_mesh, _placements(mesh, spec, y.dim()), run_check=False
    )
