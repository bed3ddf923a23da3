"""The primitives of a real mesh's call whose ranks' blocks may differ in size (mixed into its
context: ``distributed.UnevenContext``; the call's inputs and outputs: ``_dist_uneven``).

* Collectives: a tiled all_gather concatenates blocks of any sizes (a size exchange, then the
  padded gather); a tiled psum_scatter keeps torch.chunk's blocks; both pass the block sizes to
  their transposes as an extra parameter (:meth:`UnevenPrimitives.sized`), so the transpose of
  a gather of ``Blocks`` sizes scatters to those sizes.
* Operand shapes: exchanged once per collective that takes one shape on every member; a
  ppermute of a signature called again assumes its last call's and checks them in its own
  collective (:meth:`UnevenPrimitives.recall_shapes` and the section after it).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import _torch_private as torch_private
from .._collectives._record import DROP_INVARIANT
from .._errors import SpmdError, operand_dtypes_differ, operand_shapes_differ
from .._layout import chunk_sizes, groups, index_of
from .._types import data_dependent, shape_shown
from . import _dist_carried, _dist_steps
from ._dist_comm import dtype_code, dtype_of
from ._dist_steps import exchange

Sizes = tuple[int, ...]

# The collectives whose tiled form passes block sizes to its transpose: their own parameter
# count (the sizes come after it).
_SIZED = {"all_gather": 3, "psum_scatter": 2}
_WIDTH = 17  # the shape exchange's row: the rank, then up to 16 sizes (more: not compared)


_RECORDS = 64  # the signatures whose ppermutes' shapes (and outputs' rows) a mesh keeps


def _common(shapes: list[tuple[int, ...]] | None) -> tuple[int, ...] | None:
    """The one shape of every instance, or None (different shapes, or past the width)."""
    if shapes is None or any(s != shapes[0] for s in shapes):
        return None
    return shapes[0]


_UNKNOWN: Any = object()  # every instance's operand shapes: not exchanged yet


class _Checked(tuple):
    """The parameters :meth:`OperandShapes.check_every_operand` returns, carrying every
    instance's operand shapes from its exchange (None past :data:`_WIDTH` dims), so that
    :meth:`UnevenPrimitives.sized` of the same operand exchanges them once. Only the
    collective's own path (``_record._apply``) passes them on, to the ``apply`` of that
    operand, on every rank alike; ``sized`` returns a plain tuple, so a transpose never sees
    them."""

    shapes: list[tuple[int, ...]] | None
    params: tuple  # the record's own (a NamedTuple keeps its fields: ragged_all_to_all's)

    def __new__(cls, params: tuple, shapes: list[tuple[int, ...]] | None) -> _Checked:
        made = super().__new__(cls, params)
        made.shapes, made.params = shapes, params
        return made


def pad(x: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    """``x`` with zeros appended along ``dim`` up to ``size`` (gloo gathers equal shapes)."""
    short = size - x.shape[dim]
    if short == 0:
        return x
    shape = list(x.shape)
    shape[dim] = short
    return torch.cat([x, x.new_zeros(shape)], dim)


def _own_sizes(rec, params: tuple) -> bool:
    """Whether the collective is an ``all_to_all`` of split sizes: each instance's own, so its
    operand's size along the dim is its own too (checked against its sizes on its rank alone,
    where an error leaves the other ranks waiting in the collective, as a user's error does)."""
    return rec.name == "all_to_all" and params[3] is not None


def remember(records: dict, signature: int, record: tuple) -> None:
    """``record`` kept as ``signature``'s, the oldest signature's forgotten past
    :data:`_RECORDS` (every rank keeps and forgets alike: the start-of-call check compares)."""
    records.pop(signature, None)
    records[signature] = record
    if len(records) > _RECORDS:
        del records[next(iter(records))]


def all_true(comm, flag: bool, name: str) -> bool:
    """Whether every member's ``flag`` is set: one all-reduce of two int64 (cheaper than an
    exchange of rows), every member deciding alike."""
    return comm.agreed(comm.start_agree(int(flag), name), name) and flag


class OperandShapes:
    """Every instance's operand shapes of a collective, from one exchange, checked on every rank
    alike (a rank that raised alone would leave the others inside the collective): the checks
    of an uneven call's collectives (:class:`UnevenPrimitives`), and of an even call's after it
    read a varying value (:meth:`checked_after_read`; ``DistributedContext.check_operand``)."""

    mesh: Any  # (the context's: a DistributedMesh)
    alike: Any  # (the context's: ``SpmdContext.alike``)
    fn_label: str  # (the context's)
    values_read: bool  # (the context's: ``SpmdContext.values_read``)

    def checked_after_read(self, rec, x: torch.Tensor, axes, params: tuple) -> tuple:
        """:meth:`check_every_operand` over the collective's group (in an even call the ranks of
        some groups may call it, others not: a program of the real mesh alone), then its
        members' shapes compared where it takes one shape on every member (a tiled all_gather
        or an all_to_all of split sizes, each member's own, compares the other dims; a tiled
        all_gather of sizes that differ along its dim gathers them: :meth:`sized`). An error is raised alike where the group is the
        whole mesh; else on the group's ranks, posted (the others stop with RankFailedError)."""
        whole = self.mesh.comm(axes).n == self.mesh.size
        checked = self.check_every_operand(rec, x, axes, params, axes, whole)
        if not isinstance(checked, _Checked):
            return checked
        group, params = checked.shapes, checked.params
        error, label = None, self.fn_label
        gathers = rec.name == "all_gather" and params[1]
        if group is None:
            pass  # (past the exchange's width: not compared)
        elif _own_sizes(rec, params) or gathers:
            dim = params[0]
            if len({s[:dim] + s[dim + 1 :] for s in group}) > 1:
                error = operand_shapes_differ(rec.name, label, group, but=dim)
            elif gathers and len({s[dim] for s in group}) > 1:
                return _Checked(params, group)  # (``sized`` appends the blocks' sizes)
        elif any(s != group[0] for s in group):
            error = operand_shapes_differ(rec.name, label, group)
        if error is not None:
            raise self.alike(error) if whole else error
        return params

    def sized(self, rec, x: torch.Tensor, axes, params: tuple) -> tuple:
        """``params``, with the members' sizes along its dim appended for an even call's tiled
        all_gather of blocks whose sizes differ (sized by values read: :meth:`checked_after_read`
        found them), so that it gathers them and its transpose scatters to them, as an uneven
        call's (:class:`UnevenPrimitives` overrides it)."""
        if not isinstance(params, _Checked):
            return params
        return (*params.params, tuple(s[params.params[0]] for s in params.shapes or ()))

    def check_every_operand(
        self, rec, x: torch.Tensor, axes, params: tuple, over=None, alike: bool = True
    ) -> tuple:
        """Every instance's argument checks, in instance order, on its operand's shape (one
        exchange over the mesh, or over the axes ``over``): the error of the first instance
        whose operand fails them, raised on every rank alike (``alike``), as the simulated mesh
        raises it (a rank that raised alone would leave the others inside the collective)."""
        mine = tuple(x.shape)
        # the parameters every member gives alike, compared where the ranks meet (ppermute's
        # pairs; others, such as all_to_all's split sizes, are each member's own)
        step: tuple = (rec.name, axes, params) if rec.name == "ppermute" else (rec.name, axes)
        if rec.policy is DROP_INVARIANT:  # (the identity over the axes its operand is invariant
            # over: a rank whose operand is invariant over all of them meets no one, as on the
            # simulated mesh; after a branch on values, other ranks' types may differ)
            step = (rec.name, self.vma(x).present(axes))  # type: ignore[attr-defined]
        shapes = self._every_shape(x, over, step) if rec.forward_event else None
        checked, result = set(), None
        # every rank checks every shape, in one order: their errors are raised alike
        every = shapes is not None and not _own_sizes(rec, params)
        for shape in (shapes or [mine]) if every else [mine]:
            if shape not in checked:
                checked.add(shape)
                try:
                    out = params  # (no checks of its own: met after a read, ``check_operand``)
                    if rec.check is not None:
                        stand_in = x if shape == mine else self._stand_in(x, shape)
                        out = rec.check(self, stand_in, axes, params)
                except SpmdError as e:
                    if every and alike:  # (else this rank's alone: posted, so the others stop too)
                        self.alike(e)
                    raise
                result = out if shape == mine else result
        assert result is not None  # this rank's shape is among every instance's
        return _Checked(result, shapes) if rec.forward_event else result

    def _stand_in(self, x: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """A meta tensor of another instance's operand shape, of ``x``'s dtype and type."""
        with torch_private.DisableTorchFunction():
            meta = torch.empty(shape, dtype=x.dtype, device="meta")
        return self.stamp(meta, self.vma(x))  # type: ignore[attr-defined]

    def _every_shape(
        self, x: torch.Tensor, over=None, step: tuple | None = None
    ) -> list[tuple[int, ...]] | None:
        """Every instance's operand shape, row-major over the mesh (one exchange over the whole
        mesh, or over the axes ``over``: its group's members); None past :data:`_WIDTH` dims.
        After a read of a varying value, the exchange of the collective ``step`` (its name and
        axes) is its meeting (``_dist_steps``: the ranks may have taken other branches)."""
        if step is not None and self.values_read:
            if not step[1]:
                return None  # (no communication: nothing to meet on)
            shapes, codes = _dist_steps.shapes_met(self, step, x)
            group = self._my_group(step[1])  # (the others may be at other steps)
            self._same_dtypes(step, [[codes[m] for m in group]], len(group) == len(codes))
            if over is not None:
                shapes = [shapes[m] for m in self._my_group(over)]
            return None if None in shapes else shapes
        if x.dim() >= _WIDTH:
            return None
        mine = [x.dim(), *x.shape] + [0] * (_WIDTH - 1 - x.dim()) + [dtype_code(x.dtype)]
        rows = exchange(self.mesh.comm(self.mesh.axis_names if over is None else over), mine)
        if step is not None:  # (every rank is at this step: every group compared, alike)
            codes = [r[_WIDTH] for r in rows]
            by_group = [codes] if over is not None else self._groups_of(step[1], codes)
            self._same_dtypes(step, by_group, True)
        return [tuple(r[1 : 1 + r[0]]) for r in rows]

    def _same_dtypes(self, step: tuple, groups: list[list[int]], alike: bool) -> None:
        """The simulated mesh's error for members' operands of different dtypes (their
        :func:`dtype_code`), for the first group that has them: gloo moves bytes, which a
        member would read as its own operand's dtype."""
        for codes in groups:
            if len(set(codes)) > 1:
                error = operand_dtypes_differ(step[0], self.fn_label, [dtype_of(c) for c in codes])
                raise self.alike(error) if alike else error

    def _groups(self, axes) -> list[list[int]]:
        """The groups of ``axes`` (instance indices), in the simulated mesh's order."""
        return groups(tuple(axes), tuple(self.mesh._shape.items()))

    def _my_group(self, axes) -> list[int]:
        """The instances of this rank's group of ``axes``, in member order."""
        mesh = self.mesh
        me = index_of(mesh.axis_names, mesh.my_coords, mesh._shape)
        return next(g for g in self._groups(axes) if me in g)

    def _groups_of(self, axes, shapes: list) -> list[list]:
        """The members' shapes (or other rows) of every group of ``axes``, groups in the simulated mesh's order."""
        return [[shapes[m] for m in g] for g in self._groups(axes)]

    def _gathered_sizes(
        self, op: str, x: torch.Tensor, axes, dim: int, shapes: Any = _UNKNOWN
    ) -> tuple[int, ...]:
        """The members' sizes along ``dim`` of a tiled all_gather, from one exchange of every
        instance's shape (``shapes``, where given); in every group the other dims must agree
        (the simulated mesh's error, raised on every rank alike: gloo would fail or wait)."""
        if shapes is _UNKNOWN:
            shapes = self._every_shape(x, step=(op, axes))
        if shapes is None:
            return tuple(s for (s,) in exchange(self.mesh.comm(axes), [x.shape[dim]]))
        for group in self._groups_of(axes, shapes):
            if len({s[:dim] + s[dim + 1 :] for s in group}) > 1:
                raise self.alike(operand_shapes_differ(op, self.fn_label, group, but=dim))
        return tuple(shapes[m][dim] for m in self._my_group(axes))

    def _same_shapes(self, op: str, x: torch.Tensor, axes, shapes: Any = _UNKNOWN) -> None:
        """The simulated mesh's error for members' operands of different shapes, for the first
        group that has them, raised on every rank alike (the shapes of every instance are
        exchanged first, unless given: gloo would fail or wait)."""
        if shapes is _UNKNOWN:
            shapes = self._every_shape(x, step=(op, axes))
        for group in self._groups_of(axes, shapes or []) if shapes is not None else ():
            if any(s != group[0] for s in group):
                raise self.alike(operand_shapes_differ(op, self.fn_label, group))

    # --- gathers and scatters of blocks of unequal sizes (an uneven call's; an even call's
    # tiled all_gather of sizes read from values, :meth:`checked_after_read`) ---------------
    def all_gather_tiled(self, x, axes, dim, sizes=None):
        comm = self.mesh.comm(axes)
        if sizes is None:
            sizes = tuple(s for (s,) in exchange(comm, [x.shape[dim]]))
        if min(sizes) == max(sizes):
            return super().all_gather_tiled(x, axes, dim)  # type: ignore[misc]
        stacked = comm.all_gather(pad(x, dim, max(sizes)))
        return torch.cat([b.narrow(dim, 0, s) for b, s in zip(stacked.unbind(0), sizes)], dim)

    def reduce_scatter_tiled(self, x, axes, dim, sizes=None):
        comm = self.mesh.comm(axes)
        if sizes is None:
            sizes = chunk_sizes(x.shape[dim], comm.n)
        if min(sizes) == max(sizes):
            return super().reduce_scatter_tiled(x, axes, dim)  # type: ignore[misc]
        top = max(sizes)
        stacked = torch.stack([pad(b, dim, top) for b in x.split(list(sizes), dim)])
        return comm.reduce_scatter(stacked).narrow(dim, 0, sizes[comm.index])

    def own_block_tiled(self, x, axes, dim, sizes):
        i = self.mesh.comm(axes).index
        return x.narrow(dim, sum(sizes[:i]), sizes[i])


class UnevenPrimitives(OperandShapes):
    """The primitives of a call whose members' blocks may differ in size (mixed into the
    real mesh's context)."""

    uneven = True
    check_operand = OperandShapes.check_every_operand

    def type_error(self, x: torch.Tensor, make) -> Exception:
        """The error naming the first instance's shape of ``x``, raised on every rank alike: a
        type error (an invariant operand, a pvary over an axis it varies over) is every rank's
        at the same collective, types not depending on the blocks, so the shapes are exchanged
        there (not after a read of a varying value: the ranks may then be at other steps)."""
        if self.values_read or data_dependent(x):
            return make(shape_shown(x))
        shapes = self._every_shape(x)
        return self.alike(make(shapes[0] if shapes else shape_shown(x)))

    def sized(self, rec, x: torch.Tensor, axes, params: tuple) -> tuple:
        """``params``, with the blocks' sizes appended for a tiled all_gather / psum_scatter
        (their transposes need them); first, for a collective that takes one shape on every
        member, the shapes compared. Every instance's shapes come from one exchange: the one
        :meth:`check_operand` made for this operand where it made one (``_Checked``)."""
        shapes = params.shapes if isinstance(params, _Checked) else _UNKNOWN
        given = params.params if isinstance(params, _Checked) else params
        params = tuple(params)
        self._guess = None
        gathers = rec.name == "all_gather" and params[1]  # blocks of any sizes, concatenated
        if rec.name == "ppermute" and self._seen is not None:
            self._permuted_shapes(x, axes, params[0], shapes)
        elif _own_sizes(rec, params):  # chunks of any sizes: the other dims must agree
            self._gathered_sizes(rec.name, x, axes, params[0], shapes)
        elif rec.forward_event and not gathers:
            self._same_shapes(rec.name, x, axes, shapes)
        base = _SIZED.get(rec.name)
        if base is None or not params[1] or len(params) != base:
            return given
        comm = self.mesh.comm(axes)
        if gathers:
            return (*params, self._gathered_sizes(rec.name, x, axes, params[0], shapes))
        return (*params, chunk_sizes(x.shape[params[0]], comm.n))  # psum_scatter's blocks

    # --- the ppermutes of a signature called again ------------------------------------------
    # A ppermute's members must pass one shape, known before the data moves (gloo fails or waits
    # on different sizes): a call exchanges every instance's shape first. A call whose
    # signature (the function, the inputs' global shapes and dtypes: the start-of-call check's)
    # ran before instead assumes, at its k-th ppermute over the whole mesh, the one shape every
    # instance passed to the k-th of the last such call, and the ppermute itself carries one
    # more element to every member: whether this member's operand has another shape. Any flag
    # set, every member learns it in that collective, and all exchange the shapes then (the
    # simulated mesh's error where they differ) and move the data again. Every rank assumes
    # the same: the start-of-call check compares a digest of what each recalls (``_dist_agree``),
    # and a rank that recalls otherwise than another makes every rank forget it.

    _signature: int  # (the context's: ``DistributedContext.recall_shapes`` sets it)
    # the last call's (shape, dtype_code) of every member, by ppermute, or None
    _recalled: tuple | None = None
    _seen: list | None = None  # this call's, until its outputs are made (then recorded)
    _guess: tuple | None = None  # the (shape, dtype_code) the next permute assumes
    _carries = False  # whether the next permute is carried behind the check (_dist_carried)

    def recall_shapes(self, signature: int) -> int:
        # the outputs' rows (``DistributedContext``, after this mixin in the context's MRO)
        rows = super().recall_shapes(signature)  # type: ignore[misc]
        self._seen = []
        self._recalled = self.mesh.shape_records.get(signature)
        if self._recalled is None:
            return rows
        # (of ints only: hash() of a str, or of None before Python 3.12, differs by process)
        return hash((tuple((-1,) if s is None else s for s in self._recalled), rows))

    def forget_shapes(self) -> None:
        super().forget_shapes()  # type: ignore[misc]
        self._recalled = None

    @property
    def first_permute_shape(self) -> tuple[int, ...] | None:
        """The shape the call's first ppermute assumes (``_dist_carried.promise``), or None."""
        first = self._recalled[0] if self._recalled else None
        return None if first is None else first[0]

    def _permuted_shapes(self, x: torch.Tensor, axes, pairs, shapes: Any) -> None:
        """Before a ppermute's data moves: the shape it assumes (``_guess``; none after a read
        of a varying value, where the ranks meet first), or every instance's shape exchanged
        (unless given) and compared. A first ppermute that the check carries
        (``_dist_carried``) assumes the recalled shape before the check is finished, and so do
        the ppermutes that ride along with it (deferred: ``_dist_carried.defer``)."""
        mesh = self.mesh
        assert self._seen is not None
        first = not self._seen and not self.values_read
        moves = any(s != d for s, d in pairs)  # (else nothing moves: no flag either)
        whole = mesh.comm(axes).n == mesh.size
        self._carries = False
        if first:
            self._carries = _dist_carried.permute_promised(self)  # type: ignore[arg-type]
        elif moves and whole and not self.values_read:
            self._carries = _dist_carried.deferring(self)  # type: ignore[arg-type]
        k = len(self._seen)
        if self._carries and self._recalled is not None and k < len(self._recalled):
            self._guess = self._recalled[k]
            self._seen.append(self._guess)
            return
        self._carries = False
        if first:
            _dist_carried.permute_noted(self, x, axes, pairs)  # type: ignore[arg-type]
        mesh.finish_pending_check()  # first: whether every rank recalls the same
        recalled = self._recalled  # (forgotten where the ranks recall otherwise)
        guess = recalled[k] if recalled is not None and k < len(recalled) else None
        if guess is not None and moves and whole and not self.values_read:
            self._guess = guess
            self._seen.append(guess)
            return
        if shapes is _UNKNOWN:
            shapes = self._every_shape(x, step=("ppermute", axes, (pairs,)))
        self._same_shapes("ppermute", x, axes, shapes)
        self._seen.append(self._kind(shapes, x, whole))

    @staticmethod
    def _kind(shapes: list[tuple[int, ...]] | None, x: torch.Tensor, whole: bool) -> tuple | None:
        """What a ppermute's next call assumes: the one shape and dtype of every member (the
        dtypes compared already, in their exchange), or None."""
        shape = _common(shapes)
        return None if shape is None or not whole else (shape, dtype_code(x.dtype))

    def permute(self, x, axes, pairs):
        guess, self._guess = self._guess, None
        if guess is None:
            return super().permute(x, axes, pairs)  # type: ignore[misc]
        # another dtype, of one element size too, is flagged: its bytes would be read as another's
        differs = (tuple(x.shape), dtype_code(x.dtype)) != guess
        carries, self._carries = self._carries, False
        assert self._seen is not None
        k = len(self._seen) - 1
        pairs = tuple((int(s), int(d)) for s, d in pairs)
        if carries:  # deferred (``_dist_carried.defer``): moved again as the flags say
            out = _dist_carried.defer(
                self,  # type: ignore[arg-type]
                x,
                axes,
                pairs,
                guess,
                not differs,
                lambda t: self._moved_again(t, axes, pairs, k),
                lambda t: self._guessed(t, axes, pairs, guess, k),
            )
            if out is not None:
                return out
            self.mesh.finish_pending_check()  # (it could not ride along: those deferred first)
        if self._recalled is None:  # (the ranks recalled otherwise: forgotten)
            return self._moved_again(x, axes, pairs, k)
        return self._guessed(x, axes, pairs, guess, k)

    def _guessed(self, x: torch.Tensor, axes, pairs, guess: tuple, k: int) -> torch.Tensor:
        """``x``'s ppermute, every member's operand assumed of the ``guess``ed kind, this one's
        flag set where it is not; moved again where any member's is (:meth:`_moved_again`)."""
        differs = (tuple(x.shape), dtype_code(x.dtype)) != guess
        # (a flagged operand is sent as the recalled shape and dtype: the sizes every member
        # expects, whatever the element size of the operand that differs)
        zeros = x.new_zeros(guess[0], dtype=dtype_of(guess[1])) if differs else x
        out, flagged = self.mesh.comm(axes).permute_flagged(zeros, pairs, differs)
        if out is not None and not flagged:
            return out
        return self._moved_again(x, axes, pairs, k)

    def _moved_again(self, x: torch.Tensor, axes, pairs, k: int) -> torch.Tensor:
        """``x``'s ppermute (the call's ``k``-th), every member's shape and dtype exchanged and
        compared first (the flags went to all: each raises alike where they differ)."""
        shapes = self._every_shape(x, step=("ppermute", axes, (pairs,)))
        self._same_shapes("ppermute", x, axes, shapes)
        self._seen[k] = self._kind(shapes, x, True)  # type: ignore[index]
        return super().permute(x, axes, pairs)  # type: ignore[misc]

    def record_shapes(self) -> None:
        """The call's outputs are made: what its ppermutes' operands were, for the next call
        of its signature (the oldest signature's forgotten past :data:`_RECORDS`)."""
        if self._seen is None:
            return
        remember(self.mesh.shape_records, self._signature, tuple(self._seen))
        self._seen = None
