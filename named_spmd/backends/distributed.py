"""torch.distributed backend: one instance of the mesh per process, on a DeviceMesh.

``make_mesh`` returns a :class:`DistributedMesh` when a process group is initialized (under
``torchrun``, or after ``init_process_group``) and its world size equals the mesh size; a user's
own ``DeviceMesh`` with ``mesh_dim_names`` works as ``mesh=`` too (the meshes: ``_dist_mesh``).
This module runs a call on one: the per-device function runs once per process, on local blocks:

* Inputs: a ``DTensor`` on the same DeviceMesh gives its local shard (its placements the
  in_spec's); a plain tensor is the global value, present on every rank, and this rank takes its
  block (its gradient, the global one on every rank, gathers the blocks: pass DTensors).
* Outputs: DTensors with placements from out_specs, so ``out.full_tensor()`` is the simulated
  backend's result (:func:`to_local`: this rank's blocks). A tuple entry in non-mesh order
  (``P(('tp', 'dp'))`` on a ``('dp', 'tp')`` mesh) has no placement: one ppermute relays the
  blocks, and DTensor inputs get the inverse. With ``check_vma=False``, an unnamed axis over
  which the value varies gets member 0's value (one broadcast), as in the simulated backend.
* vma is stamped per tensor (``_tracking.VmaMode``): the rules are the simulated backend's.
* The backward psum of a pvary (a replicated weight's gradient) overlaps with the rest of the
  backward pass (``_dist_overlap``), in bucketed all-reduces (``_dist_buckets``).

Failures: see ``_dist_failures`` (a rank that raises makes the others raise RankFailedError
naming it; ``NAMED_SPMD_DEBUG=1`` checks that all ranks call the same collectives).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from .. import _torch_private as torch_private
from .._autodiff import apply as bridge_apply
from .._autodiff import differentiable
from .._calls import uneven_blocks_requested
from .._capabilities import Capabilities
from .._collectives._record import implicit_pvary, record_implicit_psum
from .._context import SpmdContext
from .._debug import debug_enabled, set_debug
from .._errors import PACKAGE_DIR, RankFailedError, SpmdError, told_per_instance
from .._layout import coords_text
from .._mesh import Mesh
from .._replay import Replay
from .._stamps import MemberContext, TrackedContext
from .._tracking import VmaMode
from . import (
    _dist_agree,
    _dist_carried,
    _dist_compile,
    _dist_donation,
    _dist_exchange,
    _dist_overlap,
    _dist_piece,
    _dist_pvary,
    _dist_uneven,
)
from ._dist_buckets import ALONE_BYTES
from ._dist_comm import MAX, MIN, SUM
from ._dist_dtensor import to_local
from ._dist_failures import timeout_s
from ._dist_io import global_output, inputs, local_output, refuse_traced_dtensors
from ._dist_mesh import DistributedMesh, make_distributed_mesh, mesh_from_device_mesh
from ._dist_ragged import ragged_rows
from ._dist_steps import exchange
from ._dist_uneven_primitives import OperandShapes, UnevenPrimitives, remember

if TYPE_CHECKING:
    from .._call import Call

__all__ = [
    "DistributedMesh",
    "make_distributed_mesh",
    "mesh_from_device_mesh",
    "set_debug",
    "to_local",
    "timeout_s",
]


_OPS = {"sum": (SUM, "psum"), "max": (MAX, "pmax"), "min": (MIN, "pmin")}
_contiguous = torch.contiguous_format


class DistributedContext(OperandShapes, MemberContext):
    """A call on a real mesh: the primitives are this rank's communication on the process
    groups of ``mesh``; autodiff comes from the generic bridge (``_autodiff``)."""

    mesh: DistributedMesh
    #: the operand that a donating record's forward, running now, reduces in place (``apply``)
    donated: torch.Tensor | None = None
    own_values = True  # each rank's tensors are its own: sizes are read on the host
    tells_ragged_problems = True  # (a rank that raised alone would leave the others waiting)
    inputs: list[Any] = []  # this call's local inputs (the views' sources besides leaves)
    #: (id(grad_fn), output_nr) -> input, made on demand
    input_nodes: dict[tuple[int, int], torch.Tensor] | None = None
    hoistable: dict[tuple, None] | None = None  # a planned call's casts a replay may hoist
    hoisted_aliases: dict[tuple, tuple] | None = None  # a replay's casts made at its entry
    hoist_refused = False  # some rank would not make them (the start-of-call check)
    hoisted = False  # this replay made some (``_dist_pvary.note_agreed``)
    carried_slots = 0  # a planned call's first exchange, for its replays to carry
    carried_kind: tuple | None = None  # (shape, dtype code) of that exchange, a ppermute
    carries_first_exchange = True  # (_dist_carried; not where collectives size their operands)
    fuses_leaves = True  # a pytree's leaves reduced by one collective (``fused_below``)

    def member(self, axes: tuple[str, ...]) -> int:
        return self.mesh.comm(axes).index

    def member_device(self) -> torch.device:
        return self.mesh.device

    def run_compiled(self, piece, args, kwargs):
        return _dist_piece.run_piece(self, piece, args, kwargs)

    # Collectives run with torch function modes off: their internal ops need no vma (the
    # dispatch stamps the result) and would only pay the mode's per-op cost.
    def apply(self, rec, x, axes, params, user_operand=False):
        # first, before this frame refers to x again: the count _dist_donation calibrated
        refs = torch_private.refcount(x) if user_operand and rec.donates else 0
        with torch_private.DisableTorchFunction():
            params = self.sized(rec, x, axes, params)
            if differentiable(x):
                return bridge_apply(rec, self, x, axes, params)
            if refs and _dist_donation.exclusive(x, refs, "forward"):
                return self._in_place(rec, x, axes, params)
            return rec.forward(self, x, axes, params)

    def _in_place(self, rec, x, axes, params):
        """``rec``'s forward with ``x``, a temporary, reduced in place by ``all_reduce``."""
        self.donated = x
        try:
            return rec.forward(self, x, axes, params)
        finally:
            self.donated = None

    def fused_below(self):  # (debug mode compares each collective across the ranks as made)
        plain = self.fuses_leaves and not (self.mesh.debug or self.values_read)
        return ALONE_BYTES if plain and self.mesh.size > 1 else 0  # (2 copies beat a round trip)

    def check_operand(self, rec, x, axes, params):
        """``rec.check``; after a read of a varying value, on every instance's shape (``OperandShapes``)."""
        if self.values_read and self.mesh.size > 1:
            return self.checked_after_read(rec, x, axes, params)
        return super().check_operand(rec, x, axes, params)

    _signature = 0  # the start-of-call check's checksum: what the records are kept under
    _rows: tuple | None = None  # the outputs' rows of the signature's last compared call

    def recall_shapes(self, signature: int) -> int:
        """A digest of what this call assumes from the last call of its ``signature`` (the
        start-of-call check compares it across ranks): the outputs' rows of its last call whose
        outputs were compared (``_dist_uneven.agree``; an uneven call adds its ppermutes'
        shapes); 0: nothing. (Of ints only: ``hash`` of a str differs by process.)"""
        self._signature = signature
        self._rows = self.mesh.row_records.get(signature)
        return 0 if self._rows is None else hash(self._rows)

    def forget_shapes(self) -> None:
        """The ranks recall its last call differently: assume nothing (``_dist_pvary.hoist``)."""
        self.hoist_refused = True
        self._rows = None

    def recalled_rows(self) -> tuple | None:  # the signature's last compared call's, or None
        return self._rows

    def record_rows(self, rows: tuple) -> None:  # the outputs' rows, for the signature's next
        remember(self.mesh.row_records, self._signature, rows)

    def record_shapes(self) -> None:  # (no ppermute's shapes to keep: an uneven call's do)
        pass

    def compares_outputs(self) -> bool:
        """Whether the ranks' outputs are compared (``_dist_uneven.agree``): blocks of unequal
        sizes, or a read of a varying value (``values_read``: the ranks may return other shapes,
        trees or out_specs errors; every rank decides alike, as all ran alike until the read)."""
        return self.uneven or (self.values_read and self.mesh.size > 1)

    def psum_in_backward(self, g, axes, node):
        return _dist_overlap.psum_in_backward(g, self.mesh.comm(axes), node)

    def cached_pvary(self, t, axes):
        if self.hoisted_aliases and (alias := _dist_pvary.first_use(self, t, axes)) is not None:
            return alias  # (made at a replay's entry)
        return super().cached_pvary(t, axes)

    def implicit_pvary(self, t, axes):
        """A view of a parameter (``x @ w.T``, ``wpe[:T]``) is pvary'd at the parameter and the
        view made again from that alias: its gradient's psum reaches the parameter's gradient
        node unread and joins a bucket (pvary'd as the view, its backward would wait for the sum
        at once); a CommMode still records the view's psum, as the simulated mesh does. Only a
        view by one built-in view op of a leaf or input of the call, of the view's own type, with
        no forward-mode AD active (a dual tensor that ``make_dual`` made of a leaf is such a view,
        and its tangent is its own: the view made again from the alias would have none)."""
        if self.hoisted_aliases and (alias := _dist_pvary.hoisted(self, t, axes)) is not None:
            return alias  # (made at a replay's entry)
        # (a leaf, as a parameter, is no view: the common case, decided without the lookup)
        source = None if t.grad_fn is None else self._view_source(t, axes)
        if source is None:
            # (a plain context: the subclasses communicate, or size operands, their own way)
            if type(self) is DistributedContext:
                return _dist_pvary.pvary(self, t, axes)
            return implicit_pvary(self, t, axes)
        # apart from the source's own alias (cached_pvary), which records its psum
        alias = self.memo_alias(
            source, (*axes, _dist_pvary.VIEWS), lambda: _dist_pvary.source_pvary(self, source, axes)
        )
        with torch_private.DisableTorchFunction():
            view = alias.as_strided(t.size(), t.stride(), t.storage_offset())
        return self.stamp(record_implicit_psum(view, axes), self.vma(alias))

    planned_hoistable, hoist_casts = _dist_pvary.planned, _dist_pvary.hoist  # (a replay's)
    release_hoisted = _dist_pvary.release

    def _view_source(self, t, axes):
        if (
            torch_private.is_transform_wrapped(t)
            or self.single_axes.issuperset(axes)  # (there the pvary is the identity)
            or torch_private.forward_level() >= 0  # (a view's tangent is not its source's)
        ):
            return None
        if self.input_nodes is None:
            self.input_nodes = {
                (id(x.grad_fn), x.output_nr): x
                for x in self.inputs
                if isinstance(x, torch.Tensor) and x.grad_fn
            }
        source = torch_private.view_source(t, self.input_nodes)
        vma = self.vma(t)
        if source is None or self.vma(source) is not vma or vma.partial:
            return None
        return source

    # --- primitives (plain communication, no autograd) ------------------------------------------
    def pvary(self, x, axes):
        return x.view_as(x)  # a new tensor object: it gets its own (varying) stamp

    def all_reduce(self, x, axes, op):
        reduce_op, name = _OPS[op]
        in_place = x is self.donated  # a donating record's temporary operand (apply)
        buf = x if in_place else x.clone(memory_format=_contiguous)
        return self.mesh.comm(axes).all_reduce_(buf, reduce_op, name)

    def all_gather(self, x, axes):
        return self.mesh.comm(axes).all_gather(x)

    def reduce_scatter(self, x, axes, dim):
        return self.mesh.comm(axes).reduce_scatter(x.movedim(dim, 0) if dim != 0 else x)

    def all_to_all(self, x, axes, dim):
        received = self.mesh.comm(axes).all_to_all(x.movedim(dim, 0) if dim != 0 else x)
        return received.movedim(0, dim) if dim != 0 else received

    def permute(self, x, axes, pairs):
        carried = _dist_carried.first_permute(self, x, axes, pairs)  # (behind the check)
        return self.mesh.comm(axes).permute(x, pairs) if carried is None else carried

    def every_member(self, axes, values):
        comm = self.mesh.comm(axes)  # (a few integers: not counted by CommMode)
        with torch_private.DisableTorchFunction():
            rows = exchange(comm, list(values))
        return [(self.mesh.coords_of(r), tuple(v)) for r, v in zip(comm.tuple_ranks, rows)]

    def all_to_all_sizes(self, x, axes, dim, sent, received):
        received_rows = self.mesh.comm(axes).all_to_all_rows(x.movedim(dim, 0), sent, received)
        return received_rows.movedim(0, dim)

    def ragged_all_to_all(self, x, axes, m, offsets, sizes, placed_at, received, told=None):
        return ragged_rows(self, axes, x, m, (offsets, sizes, placed_at, received), told)

    def carried_metadata(self, meta, axes):
        return _dist_carried.peers(self, meta, axes)

    make_deferred = _dist_carried.make_deferred  # (a replay's first ppermutes, made when read)

    def broadcast(self, x, axes, root):
        return self.mesh.comm(axes).broadcast(x, root)

    def own_block(self, x, axes, dim):
        return x.select(dim, self.mesh.comm(axes).index)


class ProxyTracedContext(_dist_compile.FuncolPrimitives, DistributedContext):
    """A call traced by ``make_fx`` (``torch.func.linearize``, ``torch.export``): the same
    call, its communication the functional collective ops, which the graph records and runs
    again (a ``ProcessGroup`` method would run once, at trace time, and leave its result a
    constant of the graph: a replay would return stale values), each run as one op with its
    wait (``_dist_compile.one_op``)."""

    own_values = False  # traced: values are not read on the host (the padded default runs)
    # no problem row travels in the rows' exchange: sizes are never read on the host here, so
    # ragged_all_to_all has no problem to tell (its ``told`` is dropped with the padded default)
    tells_ragged_problems = False
    carries_first_exchange = False
    fuses_leaves = False  # (each collective is one op of the traced graph)

    def all_to_all_sizes(self, x, axes, dim, sent, received):
        return SpmdContext.all_to_all_sizes(self, x, axes, dim, sent, received)

    def ragged_all_to_all(self, x, axes, m, offsets, sizes, placed_at, received, told=None):
        return SpmdContext.ragged_all_to_all(self, x, axes, m, offsets, sizes, placed_at, received)

    def psum_in_backward(self, g, axes, node):
        return self.all_reduce(g, axes, "sum")

    def all_reduce(self, x, axes, op):
        return _dist_compile.one_op(self.mesh, "all_reduce", x, axes, op)

    def all_gather(self, x, axes):
        return _dist_compile.one_op(self.mesh, "all_gather", x, axes)

    def reduce_scatter(self, x, axes, dim):
        return _dist_compile.one_op(self.mesh, "reduce_scatter", x, axes, dim)

    def all_to_all(self, x, axes, dim):
        return _dist_compile.one_op(self.mesh, "all_to_all", x, axes, dim)

    def permute(self, x, axes, pairs):
        return _dist_compile.one_op(self.mesh, "permute", x, axes, pairs)

    def broadcast(self, x, axes, root):
        return _dist_compile.one_op(self.mesh, "broadcast", x, axes, root)


class UnevenContext(UnevenPrimitives, DistributedContext):
    """A call whose ranks' blocks may differ in size (``_dist_uneven``)."""

    hoist_casts = TrackedContext.hoist_casts  # (its pvary sizes its operands: none made ahead)
    carries_first_exchange = False
    fuses_leaves = False  # (its ranks' blocks may differ in size: so would concatenations)


def run(call: Call) -> list[Any]:
    """Run ``call.body`` on this rank's blocks; return the outputs as DTensors (module doc)."""
    if torch.compiler.is_compiling():  # traced by torch.compile: the graph's own path
        return _dist_compile.run(call)
    mesh = cast(DistributedMesh, call.mesh)  # (accepts)
    leaves, specs = call.leaves, call.specs
    if _dist_overlap._PENDING and torch_private.current_graph_task_id() == -1:
        _dist_overlap.finish_pending()  # left by a backward that raised
    traced = torch_private.proxy_tracing()
    if traced and not call.local:  # (before any collective: every rank raises alike)
        refuse_traced_dtensors(call.mapped.label, leaves)
    board = mesh.board
    board.begin_call()
    # a call typed once per signature: untyped replays on one rank, planned ones on several
    replay = None if traced else Replay(call, planned=mesh.size > 1)
    # debug mode (none in a trace: no values to compare) has no table: found one, it is off
    mesh.debug = replay is not None and replay.checked is None and debug_enabled()
    uneven = _takes_uneven_blocks(call, replay)
    if uneven and replay is not None:  # (each rank's plan types its own blocks)
        replay.uneven()
    local_call = call.local  # SpmdFunction.local: this rank's blocks in and out
    ctx = (UnevenContext if uneven else ProxyTracedContext if traced else DistributedContext)(
        mesh, call.fn
    )
    ctx.checked, ctx.caller_blocks = call.mapped.check_vma, local_call
    ctx.fn_label = call.mapped.label  # (the start-of-call check hashes it)
    board.check_in_step()  # (not posted: it reposts the failure it is a consequence of)
    try:
        if uneven:
            _dist_uneven.refuse_transforms(ctx, traced)
        hoistable = () if replay is None or mesh.size == 1 else replay.hoistable()
        if mesh.size > 1:
            _dist_agree.begin(ctx, call, hoistable, isinstance(ctx, ProxyTracedContext))
        converted = None
        if replay is not None and replay.begin(ctx):
            converted = replay.replayed_conversions()
        local = inputs(
            ctx, leaves, specs, local_call, converted, _dist_uneven.local_input, call.memo
        )
        if replay is not None and not (replay.planned or ctx.replaying):  # (``Checked``)
            replay.converted = tuple(i for i, x in enumerate(leaves) if local[i] is not x)
        ctx.inputs = local
        if mesh.debug:
            mesh.finish_pending_check()  # shapes first: the clearer message
            _dist_agree.check_inputs_agree(ctx, leaves, specs if local_call else None)
        versions = call.input_versions(local)
        outs = _body(ctx, call, replay, local)
        mesh.finish_pending_check()  # (where the body ran no collective; first: the clearer)
        _dist_carried.refuse_unmade(ctx)  # (results returned unread, their exchange failed)
        call.check_writes(local, versions, outs)
        if mesh.debug:  # the lists of collectives first: their difference explains the values'
            _dist_exchange.finish_call(board, f"spmd_map of {ctx.fn_label}")
        layouts = _dist_uneven.agree(ctx, outs, call) if ctx.compares_outputs() else None
        if mesh.debug:
            _dist_agree.check_replicas_agree(ctx, outs, call.out_specs())
        if layouts is not None:
            result = _dist_uneven.outputs(ctx, outs, call, layouts)
        else:
            output = local_output if local_call else global_output
            result = [output(ctx, y, s) for y, s in zip(outs, call.out_specs())]
        board.finished = board.seq
        _dist_pvary.note_agreed(ctx, hoistable)
        return result
    except RankFailedError:
        raise
    except torch_private.control_flow_exceptions():  # torch steering itself (checkpoint)
        raise
    except BaseException as raised:
        mesh.pending_check = None  # issued on every rank: it completes without this one
        e = _told_per_rank(ctx, raised, call)
        if e is not ctx.raised_alike:  # (else no peer waits for it)
            _dist_carried.abandon(mesh)  # (first: the peers waiting there complete it)
            board.post(e)
            if hasattr(e, "add_note"):
                coords = coords_text(mesh.my_coords)
                e.add_note(
                    f"[named_spmd] raised on rank {mesh.rank} (mesh coordinates {coords}); "
                    "the other ranks stop with RankFailedError naming this rank."
                )
        mesh.carried = None
        if e is raised:
            raise
        raise e from raised


def _body(ctx: DistributedContext, call: Call, replay: Replay | None, local: list[Any]) -> list:
    """``call.body`` on this rank's blocks. Where the outputs are compared (an uneven call, or
    one that read values: ``compares_outputs``), an out_specs error leaves this rank no output
    and is raised after the outputs' exchange (``_dist_uneven.agree``), on every rank alike:
    the per-rank programs differ, so the others may have passed the check."""
    try:
        if replay is not None:
            return replay.run(ctx, call.body, local)
        with VmaMode(ctx):
            return call.body(local, ctx)
    except SpmdError as e:
        if not ctx.compares_outputs() or e is not call.out_error:
            raise
        return []


def _told_per_rank(ctx: DistributedContext, e: BaseException, call: Call) -> BaseException:
    """A torch op of the user's function that rejected its operands (a shape error), as the
    simulated mesh tells it (``simulated/_diagnose``; an uneven call's op on an empty block:
    ``_errors.empty_block_error``): an ``SpmdError`` of the same class family naming the
    function, the user's line and this rank's mesh coordinates; torch's error is the
    ``__cause__``. Dynamo failing inside its tracer while it traces named_spmd's eager type
    tracking (a plain ``torch.compile``'d piece): an ``SpmdError`` naming ``ns.compile``; one
    of the user's own compiled code is left as it is. An error the user's own code raised, or
    one raised outside the user's code, is left as it is."""
    mesh = ctx.mesh
    coords = coords_text(mesh.my_coords)
    empty = call.empty_block(ctx.inputs) if ctx.uneven and ctx.inputs else None
    at = (
        f"the instance at {coords} (rank {mesh.rank})"
        if empty
        else f"rank {mesh.rank} (instance {coords})"
    )
    where = f"spmd_map of {ctx.fn_label}"
    if torch_private.is_dynamo_internal_error(e, PACKAGE_DIR):
        return SpmdError(
            f"{where}: a function compiled with plain torch.compile, called inside the call on "
            f"a real mesh, failed on {at} ({type(e).__name__}): Dynamo traces named_spmd's "
            "eager type tracking, which it cannot compile. Fix: compile the piece with "
            "ns.compile(fn, ...) (same options), or compile the whole mapped function "
            "(ns.compile(mapped))."
        )
    return told_per_instance(e, where, at, empty, ctx.replaying) or e


def _takes_uneven_blocks(call: Call, replay: Replay | None) -> bool:
    """Whether the call takes blocks of unequal sizes: where the simulated mesh runs per
    instance (an input's blocks differ in size, or ``ns.simulate_per_instance()`` asks), so
    that the backends accept and refuse the same inputs. A local call's blocks are the
    caller's. A signature with a plan has equal blocks: only an even call keeps one under the
    signature alone (an uneven call's is kept apart: ``Replay.uneven``), and the signature
    holds every leaf's shape and spec and the mesh's shape, all the test reads."""
    if call.local or call.mesh.size == 1:
        return False
    if uneven_blocks_requested():
        return True
    if replay is not None and replay.has_plan():
        return False
    return call.unequal_blocks()


class DistributedBackend:
    """One instance per process, on a DeviceMesh."""

    name = "distributed"
    # _dist_compile: the whole call traced into the graph; SpmdFunction.local: this rank's
    # blocks in and out; unequal blocks as on the simulated mesh (``_dist_uneven``)
    capabilities = Capabilities(traceable=True, local_blocks=True, uneven_blocks=True)

    def accepts(self, mesh: Mesh) -> bool:
        return isinstance(mesh, DistributedMesh)

    run = staticmethod(run)
    adopt = staticmethod(mesh_from_device_mesh)  # a user's DeviceMesh (``backends.adopt_mesh``)
    make_mesh = staticmethod(make_distributed_mesh)  # one rank per instance (backends.make_mesh)

    def uneven_state(self) -> bool:
        """Whether calls made now take dims the axes do not divide (as the simulated mesh)."""
        return uneven_blocks_requested()

    def explain(self, error: RuntimeError, where: str) -> SpmdError | None:
        return None


BACKEND = DistributedBackend()
_dist_donation.calibrate(DistributedContext)  # its apply's and gradient psum's chains
_dist_donation.calibrate_gradient("pvary", _dist_pvary.probe, DistributedContext)
