"""The meshes of the distributed backend: a :class:`DistributedMesh` per DeviceMesh.

``make_mesh`` makes one over all ranks of an initialized process group
(:func:`make_distributed_mesh`); a user's own ``DeviceMesh`` with ``mesh_dim_names`` becomes one
once (:func:`mesh_from_device_mesh`). Each mesh creates its process groups up front, one per set
of axes, and joins the failure board of its ranks (``_dist_failures``). One registry maps a
DeviceMesh to its mesh: it makes a user's DeviceMesh one mesh however often it is passed, gives
``to_local`` its fast path, and lets the groups be released at exit.
"""

from __future__ import annotations

import atexit
import ctypes
import gc
import inspect
import itertools
import math
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from .. import _torch_private as torch_private
from .._errors import SpmdError
from .._layout import group_coords, index_of
from .._mesh import Mesh
from .._traced import warm_types
from ._dist_comm import Comm
from ._dist_failures import FailureBoard, generation
from ._dist_processes import mark_exited, register_process, registered

if TYPE_CHECKING:
    from ._dist_carried import Carried

#: id(DeviceMesh) -> its DistributedMesh (whose ``device_mesh`` it is: the entry keeps the id's
#: object alive, so an id is never reused while registered).
_MESHES: dict[int, DistributedMesh] = {}


def registered_mesh(device_mesh: Any) -> DistributedMesh | None:
    """The DistributedMesh made on ``device_mesh``, if any."""
    mesh = _MESHES.get(id(device_mesh))
    return mesh if mesh is not None and mesh.device_mesh is device_mesh else None


@atexit.register
def _release_process_groups() -> None:
    """Drop the meshes' process groups before the interpreter finalizes. A gloo group still
    referenced then is freed during finalization, when its worker threads can no longer take
    the GIL, and the process aborts (docs/design.md, "Known torch limits"); freed here, at exit
    but before finalization, it shuts down cleanly. First it records in the store that this
    process exits, and after which calls, so that peers still waiting for it can say why."""
    boards = [mesh.board for mesh in _MESHES.values()]
    where = registered()
    if where is not None:
        try:
            mark_exited(*where, boards)
        except Exception:  # noqa: BLE001 - the store's host is gone: nobody left to tell
            pass
    for mesh in _MESHES.values():
        mesh.release_groups()
    _MESHES.clear()
    gc.collect()


class DistributedMesh(Mesh):
    """A Mesh backed by a DeviceMesh: this rank's coordinates and a process group per set of
    axes (created up front on every rank, since creating a group is itself collective)."""

    def __init__(self, device_mesh: DeviceMesh, device_type: str):
        names = tuple(device_mesh.mesh_dim_names or ())  # callers check it has names
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
        self.poll = device_type in _POLLED  # gloo: wait in slices, watching for failed peers
        self.debug = False
        self.pending_check: Callable[[], None] | None = None  # see _dist_agree.check_call_agrees
        self.carried: Carried | None = None  # a replay's promised exchange (_dist_carried)
        # per signature (the start-of-call checksum): the operand shapes of its last uneven call's
        # ppermutes, which the next call assumes (_dist_uneven_primitives.UnevenPrimitives)
        self.shape_records: dict[int, tuple] = {}
        # and its outputs' rows (every rank's block shapes), which the next call checks first
        self.row_records: dict[int, tuple] = {}
        self.gave_up = False  # this rank stopped waiting for a collective: see release_groups
        key = f"{'x'.join(names)}-{zlib.crc32(str(self.grid.tolist()).encode()):08x}"
        store = torch_private.dist().default_store()
        ranks = self.grid.reshape(-1).tolist()
        self.board = FailureBoard(store, self.rank, ranks, generation(key), self.coords_of)
        register_process(store, self.rank)
        try:
            self._groups = _create_groups(device_mesh, names)
            # the start-of-call check's group: the mesh's own where they are polled (gloo),
            # else one gloo group of the mesh's ranks (the check's buffer is on the host)
            self._check_group = None if self.poll else _host_group(ranks)
        except RuntimeError as e:  # a peer's sockets closed while the groups connect
            raise self.board.setup_failed(e) from None
        self.board.made()  # no rank leaves (and exits) while a peer still connects to it
        self._comms: dict[tuple[str, ...], Comm] = {}
        self._check_comm: Comm | None = None
        warm_types(names)  # before any torch.compile trace of a call on it
        _MESHES[id(device_mesh)] = self
        self.placements_cache: dict = {}  # (id(spec), rank) -> (spec, DTensor placements)
        # (placements, shape, stride, dtype); uneven blocks: (placements, global shape, dtype)
        self.dtensor_specs: dict = {}  # -> DTensorSpec
        # an uneven call's output: (every rank's shapes, spec, rank) -> its blocks' sizes per dim
        self.uneven_outputs: dict = {}

    def finish_pending_check(self) -> None:
        """Finish the start-of-call check if it is still in flight (``_dist_agree.
        check_call_agrees``): before the call's first collective, at the end of its body, and
        before anything the ranks must agree on first."""
        if self.pending_check is not None:
            self.pending_check()

    def release_groups(self) -> None:
        """Forget this mesh's process groups (at exit; the mesh cannot communicate after).

        Once this rank gave up on a collective (a peer died or never came), every group of the
        mesh is kept alive to the end of the process instead (others may hold collectives never
        waited for, such as a failed backward's gradient buckets). Destroying a gloo group joins
        its worker thread, which stays inside such a collective until the peers complete it or
        gloo's own timeout (30 minutes) passes: the process would hang at exit, in interpreter
        finalization, or pair with a late peer. Kept, the thread ends with the process."""
        groups = [*self._groups.values(), *filter(None, [self._check_group])]
        for group in groups if self.gave_up else ():
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))  # never freed, never joined
        self._groups.clear()
        self._check_group = None
        self._check_comm = None
        self._comms.clear()

    def coords_of(self, rank: int) -> dict[str, int]:
        where = (self.grid == rank).nonzero()
        if len(where) == 0:
            return {}
        return dict(zip(self.axis_names, where[0].tolist()))

    def index_of(self, axes: tuple[str, ...], coords: dict[str, int]) -> int:
        """Row-major index of ``coords`` over ``axes`` (first name major)."""
        return index_of(axes, coords, self._shape)

    def comm(self, axes: tuple[str, ...]) -> Comm:
        comm = self._comms.get(axes)
        if comm is None:
            with (
                torch_private.no_dispatch_modes()
            ):  # made once, perhaps while make_fx traces: not traced
                comm = self._comms[axes] = Comm(
                    self, axes, self._groups[frozenset(axes)], self._tuple_ranks(axes)
                )
        return comm

    def check_comm(self) -> Comm:
        """The group of every rank of the mesh for the start-of-call check (``_dist_agree``):
        polled, so a rank that waits there for a failed peer names it on every device type."""
        if self._check_group is None:
            return self.comm(self.axis_names)
        if self._check_comm is None:
            with torch_private.no_dispatch_modes():
                ranks = self._tuple_ranks(self.axis_names)
                self._check_comm = Comm(self, self.axis_names, self._check_group, ranks, poll=True)
        return self._check_comm

    def _tuple_ranks(self, axes: tuple[str, ...]) -> list[int]:
        members = group_coords(axes, self.my_coords, self._shape)  # row-major over axes
        return [int(self.grid[tuple(c[a] for a in self.axis_names)]) for c in members]


# Device types whose process groups (gloo) are waited for in slices, reading the failure board
# between slices. NCCL's are waited for without: its waits do not block the host.
_POLLED = frozenset({"cpu"})


def _host_group(ranks: list[int]) -> Any:
    """A gloo group of ``ranks`` (in that order), created by every rank of the world alike."""
    spans_world = len(ranks) == dist.get_world_size()
    return dist.new_group(
        ranks, backend="gloo", use_local_synchronization=not spans_world, **_UNSORTED
    )


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
_UNSORTED: dict[str, Any] = (
    {"sort_ranks": False} if "sort_ranks" in inspect.signature(dist.new_group).parameters else {}
)


def mesh_from_device_mesh(device_mesh: DeviceMesh) -> DistributedMesh:
    """The named_spmd mesh of a user's DeviceMesh (made once per DeviceMesh, on every rank)."""
    names = device_mesh.mesh_dim_names
    if not names:
        raise SpmdError(
            "spmd_map: a DeviceMesh needs mesh_dim_names to be used as mesh=, got none. Fix: "
            "init_device_mesh('cpu', (2, 2), mesh_dim_names=('dp', 'tp'))."
        )
    return registered_mesh(device_mesh) or DistributedMesh(device_mesh, device_mesh.device_type)


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
    store, rank = torch_private.dist().default_store(), dist.get_rank()
    register_process(store, rank)
    try:
        device_mesh = init_device_mesh(device_type, shape, mesh_dim_names=names)
    except RuntimeError as e:  # a peer's sockets closed while the DeviceMesh's groups connect
        ranks = list(range(world))
        raise FailureBoard(store, rank, ranks, "make_mesh", lambda r: {}).setup_failed(e) from None
    return DistributedMesh(device_mesh, device_type)
