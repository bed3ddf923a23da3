"""``Call``: one call of a mapped function, the one object a backend's ``run`` is handed.

It holds what the backend lays out (the mesh, the user's function, the input leaves and their
specs, whether they are this process's blocks) and the per-instance body the backend runs; the
body records the call's outputs on it, so that the backend then reads their specs
(``out_specs()``) and the API reassembles the output tree.
"""

from __future__ import annotations

import inspect
import operator
import zlib
from typing import TYPE_CHECKING, Any, cast

import torch

from . import _calls, _context
from . import _torch_private as torch_private
from ._accounting import recording
from ._call_checks import check_outputs, tiled_output_event
from ._errors import SpmdError, SpmdTypeError, error_class, write_refused
from ._layout import gives_unequal_blocks
from ._spec import PartitionSpec
from ._tree import path_text, unflatten, without_addresses

# read for every input of every call: bound once; an attrgetter mapped runs no Python frame
_Tensor, _GRAD_FN, _VERSION = torch.Tensor, operator.attrgetter("grad_fn"), torch_private.version

if TYPE_CHECKING:
    from ._api import SpmdFunction
    from ._mesh import Mesh
    from .backends import Backend


class Call:
    """One call of ``mapped`` on ``backend``: its inputs, its body and, once the body ran, its
    outputs.

    ``mapped`` is the running ``SpmdFunction`` (its specs and ``check_vma``: what a backend's
    caches per mapped function key on); ``local`` says that ``leaves`` are this process's
    blocks and the outputs must be too (``SpmdFunction.local``, only on a backend whose
    ``capabilities.local_blocks`` is true); ``memo``: see the attribute. After ``body`` ran:
    ``out_tree``, ``out_leaves``, ``out_leaf_specs`` and ``out_paths``, one entry per output
    leaf (a non-tensor one too), or ``out_error`` where the out_specs check raised."""

    def __init__(
        self,
        mapped: SpmdFunction,
        backend: Backend,
        leaves: list[Any],
        specs: list[PartitionSpec],
        in_tree: Any,
        local: bool,
        memo: dict | None = None,
        bound: tuple = (),
    ) -> None:
        self.mapped = mapped
        self.bound = bound  # a method's instance, passed to ``fn`` before the arguments
        self.backend = backend
        self.mesh: Mesh = mapped.mesh
        self.fn = mapped.fn
        self.leaves = leaves
        self.specs = specs
        self.in_tree = in_tree
        self.local = local
        # what a backend derives from the leaves alone (their shapes, dtypes and specs), shared
        # by the calls of ``mapped`` with this tree structure and these leaves
        # (``_call_checks.input_leaves``; its "inputs": that key, where there is one); keyed by
        # each user's own names
        self.memo: dict = {} if memo is None else memo
        self.out_tree: Any = None
        self.out_leaves: list[Any] = []
        self.out_leaf_specs: list[PartitionSpec] = []
        self.out_paths: list[tuple] = []
        self.out_error: SpmdError | None = None  # the out_specs check's, where it failed
        self.ctx: _context.SpmdContext | None = None  # the context the body last ran with

    def body(self, local_leaves: list[Any], ctx: _context.SpmdContext) -> list[torch.Tensor]:
        """One instance: ``fn`` on its local leaves with ``ctx`` pushed, its outputs checked
        against out_specs and recorded here; returns the output tensors."""
        mapped = self.mapped
        self.ctx = ctx
        _calls.push(ctx)
        try:
            local_args = cast(tuple, unflatten(self.in_tree, local_leaves))
            out = self._run_user(local_args)
            with torch_private.DisableTorchFunction():  # our bookkeeping: no op of the program
                try:
                    paths, out_leaves, out_specs, out_tree = check_outputs(mapped, out, ctx)
                except SpmdError as e:
                    # (a real mesh's uneven call tells it on every rank: ``_dist_uneven.agree``)
                    self.out_error = e
                    raise
        finally:
            _calls.pop()
        if recording():
            out_leaves = [
                tiled_output_event(ctx, x, s) if isinstance(x, torch.Tensor) else x
                for x, s in zip(out_leaves, out_specs)
            ]
        self.out_tree, self.out_leaves = out_tree, out_leaves
        self.out_leaf_specs, self.out_paths = out_specs, paths
        return [x for x in out_leaves if isinstance(x, torch.Tensor)]

    def run(self) -> Any:
        """The output tree: the backend runs the call; then what the call wrote into the
        caller's tensors is removed (:meth:`unstamp`), whether it returned or raised."""
        try:
            return self.outputs(self.backend.run(self))
        finally:
            self.unstamp()

    def unstamp(self) -> None:
        """Remove what the call wrote into the tensors its caller holds (``_calls.unstamp``):
        its input leaves, output tensors (the bodies' own, which a backend may hand back or
        wrap) and the operands its ops handed back (``SpmdContext.handed_back``), where it typed
        them (a replay on one instance writes nothing)."""
        ctx = self.ctx
        if ctx is None or ctx.replaying or torch.compiler.is_compiling():
            return
        if ctx.stamps:  # (the simulated mesh's several instances write none there)
            _calls.unstamp(ctx, (*self.leaves, *self.out_leaves))
        if ctx.returned is not None:
            _calls.unstamp(ctx, ctx.returned)
            ctx.returned = None

    def unequal_blocks(self) -> bool:
        """Whether some tensor leaf's blocks differ in size (``_layout.gives_unequal_blocks``),
        read once per :attr:`memo`."""
        known = self.memo.get("unequal blocks")
        if known is None:
            known = gives_unequal_blocks(self.leaves, self.specs, self.mesh._shape)
            self.memo["unequal blocks"] = known
        return known

    def out_specs(self) -> list[PartitionSpec]:
        """The out_spec of each output tensor, in the order ``body`` returns them (known once
        the body ran)."""
        return [
            s for x, s in zip(self.out_leaves, self.out_leaf_specs) if isinstance(x, torch.Tensor)
        ]

    def out_wheres(self) -> list[str]:
        """Each output tensor's place in the output tree (``output[1]``), in the order of
        ``out_specs()``: what an error about one output names."""
        return [
            "output" + path_text(p)
            for x, p in zip(self.out_leaves, self.out_paths)
            if isinstance(x, torch.Tensor)
        ]

    def structure(self) -> tuple[int, int]:
        """The output tree as instances compare it (``_layout.instances_problem``): its
        number of tensor leaves and a digest of its containers, keys and which leaves are
        tensors (crc32: the same in every process, unlike ``hash`` of a string). Addresses in
        the tree's text (a custom node's metadata of a default ``repr``) differ between
        processes and instances: they are left out."""
        tensors = [isinstance(x, torch.Tensor) for x in self.out_leaves]
        mask = "".join("T" if t else "-" for t in tensors)
        text = without_addresses(str(self.out_tree))
        return sum(tensors), zlib.crc32(f"{text}|{mask}".encode())

    def take_outputs(self, other: Call) -> None:
        """The outputs ``other`` recorded: a copy of this call that one instance's body ran
        (``_per_instance``: each instance records its own tree)."""
        self.out_tree, self.out_leaves = other.out_tree, other.out_leaves
        self.out_leaf_specs, self.out_paths = other.out_leaf_specs, other.out_paths

    def empty_block(self, blocks: list[Any]) -> tuple[str, list[int]] | None:
        """The first argument whose block in ``blocks`` (one instance's, one per leaf) is empty
        where its global value is not, with that block's shape (``_errors.empty_block_error``);
        None where no block is."""
        for path, leaf, x in zip(self.in_tree.paths(), self.leaves, blocks):
            if isinstance(x, torch.Tensor) and x.numel() == 0 and leaf.numel() > 0:
                return "argument " + path_text(path), list(x.shape)
        return None

    def outputs(self, tensors: list[Any]) -> Any:
        """The output tree: the backend's assembled ``tensors`` in the tensor leaves' places."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self.out_leaves]
        return unflatten(self.out_tree, leaves)

    def _not_callable_with(self, args: tuple, e: TypeError) -> SpmdTypeError:
        """``fn`` refused the call's arguments (their number, as Python binds them)."""
        method = " after the method's instance" if self.bound else ""
        return SpmdTypeError(
            f"{self.mapped.where}: the function cannot be called with the call's {len(args)} "
            f"positional argument(s){method}:\n  TypeError: {e}\nin_specs pair with the "
            "positional arguments (a single P with every one). Fix: pass the arguments the "
            "function takes; bind others with functools.partial before spmd_map."
        )

    def _refused_arguments(self, args: tuple, e: TypeError) -> bool:
        """Whether ``e`` is Python refusing to bind ``args`` to ``fn``: raised by the call itself
        (no frame of the callee), or by torch's wrappers around it (``nn.Module.__call__``
        passing them to ``forward``, a decorator such as ``torch.no_grad()``, ``torch.compile``:
        their frames alone below the call), where the signature of what they wrap (``forward``,
        the compiled function) does not bind them. A TypeError from any frame of the user's code
        (a hook, ``forward``, a wrapper of theirs) is theirs."""
        tb = e.__traceback__
        if tb is None or tb.tb_next is None:
            return True
        while tb.tb_next is not None:
            tb = tb.tb_next
            if not torch_private.torch_file(tb.tb_frame.f_code.co_filename):
                return False
        fn = torch_private.compiled_original(self.fn)
        try:  # (through functools.wraps: torch's decorators and compile keep the signature)
            signature = inspect.signature(fn.forward if isinstance(fn, torch.nn.Module) else fn)
        except (TypeError, ValueError):  # no signature to read (a builtin): the error is its own
            return False
        try:
            signature.bind(*self.bound, *args)
        except TypeError:
            return True
        return False

    def input_versions(self, inputs: list[Any]) -> tuple[list[int], list[int], list]:
        """The positions in ``inputs`` (the call's leaves, as its backend runs the body on
        them) of the tensors that an op of the call may save for the backward pass (under grad
        mode, any but an inference tensor: one that requires no grad is saved where it meets
        one that does, ``x * w``), their versions and their autograd nodes (where the call's
        graph begins): what :meth:`check_writes` compares."""
        if not torch.is_grad_enabled():
            return [], [], []
        # which leaves are tensors: fixed by the memo's key (each leaf's type), found once
        at = self.memo.get("tensor positions")
        if at is None:
            at = self.memo["tensor positions"] = [
                i for i, x in enumerate(inputs) if isinstance(x, _Tensor)
            ]
        return torch_private.unseen_reads(_versions_and_nodes, inputs, at)

    def check_writes(
        self, inputs: list[Any], before: tuple[list[int], list[int], list], outs: list
    ) -> None:
        """Raise where the body wrote in place into one of ``inputs`` (``before``:
        :meth:`input_versions`) after an op saved it for the backward pass: the backward pass
        would fail there, and on a real mesh on the writing ranks only (its peers would wait for
        them in their gradient sums). Raised now, an error of the call (posted to the peers)."""
        at, versions, nodes = before
        now = torch_private.unseen_reads(_versions, inputs, at)
        if now == versions:  # (the common case: no write)
            return
        stale = torch_private.stale_saved(outs, nodes)
        if stale is None:
            return
        # every input written: autograd's error does not tell which one's save it refused
        paths = list(self.in_tree.paths())
        written = [path_text(paths[i]) for i, v, n in zip(at, versions, now) if v != n]
        which = "argument " if len(written) == 1 else "one of arguments "
        raise error_class(RuntimeError)(
            f"{self.mapped.where}: the function wrote in place into an input ({which}"
            f"{', '.join(written)}), or a view of it, after an op saved it for the backward "
            "pass:\n"
            f"  RuntimeError: {stale}\nThe backward pass would fail at that op "
            "(on a real mesh on the ranks that wrote only, while the others waited for them). "
            "Fix: write before the first use, into a copy (w = w.clone() first), or compute out "
            "of place (w + 1 rather than w.add_(1))."
        ) from stale

    def _run_user(self, args: tuple) -> Any:
        try:
            return self.fn(*self.bound, *args) if self.bound else self.fn(*args)
        except SpmdError:
            raise
        except TypeError as e:
            if not self._refused_arguments(args, e):
                raise  # raised inside the function: the user's own
            raise self._not_callable_with(args, e) from e
        except RuntimeError as e:
            # autograd's refusal of a write, alike everywhere; else what the backend knows
            where = self.mapped.where
            explained = write_refused(e, where) or self.backend.explain(e, where)
            if explained is not None:
                raise explained from e
            raise


def _versions_and_nodes(inputs: list[Any], at: list[int]) -> tuple[list[int], list[int], list]:
    """:meth:`Call.input_versions`' reads of the tensors at ``at``."""
    tensors = inputs if len(at) == len(inputs) else [inputs[i] for i in at]
    try:
        versions = list(map(_VERSION, tensors))
    except RuntimeError:  # an inference tensor has no version (and no op saves one)
        at = [i for i in at if not inputs[i].is_inference()]
        tensors = [inputs[i] for i in at]
        versions = list(map(_VERSION, tensors))
    return at, versions, list(map(_GRAD_FN, tensors))


def _versions(inputs: list[Any], at: list[int]) -> list[int]:
    """The versions of the tensors at ``at`` of ``inputs`` (:meth:`Call.check_writes`)."""
    return list(map(_VERSION, inputs if len(at) == len(inputs) else map(inputs.__getitem__, at)))
