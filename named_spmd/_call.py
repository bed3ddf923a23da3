"""``Call``: one call of a mapped function, the one object a backend's ``run`` is handed.

It holds what the backend lays out (the mesh, the user's function, the input leaves and their
specs, whether they are this process's blocks) and the per-instance body the backend runs; the
body records the call's outputs on it, so that the backend then reads their specs
(``out_specs()``) and the API reassembles the output tree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import torch

from . import _calls, _context
from . import _torch_private as torch_private
from ._accounting import recording
from ._call_checks import check_outputs, tiled_output_event
from ._errors import SpmdError
from ._spec import PartitionSpec
from ._tree import unflatten

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
    ``capabilities.local_blocks`` is true). After ``body`` ran: ``out_tree``, ``out_leaves``,
    ``out_leaf_specs`` and ``out_paths``, one entry per output leaf (a non-tensor one too)."""

    def __init__(
        self,
        mapped: SpmdFunction,
        backend: Backend,
        leaves: list[Any],
        specs: list[PartitionSpec],
        in_tree: Any,
        local: bool,
        leaves_key: tuple | None = None,
    ) -> None:
        self.mapped = mapped
        self.backend = backend
        self.mesh: Mesh = mapped.mesh
        self.fn = mapped.fn
        self.leaves = leaves
        self.specs = specs
        self.in_tree = in_tree
        self.local = local
        self.leaves_key = leaves_key  # ``_call_checks.leaves_key``, where it has one
        self.out_tree: Any = None
        self.out_leaves: list[Any] = []
        self.out_leaf_specs: list[PartitionSpec] = []
        self.out_paths: list[tuple] = []

    def body(self, local_leaves: list[Any], ctx: _context.SpmdContext) -> list[torch.Tensor]:
        """One instance: ``fn`` on its local leaves with ``ctx`` pushed, its outputs checked
        against out_specs and recorded here; returns the output tensors."""
        mapped = self.mapped
        _calls.push(ctx)
        try:
            local_args = cast(tuple, unflatten(self.in_tree, local_leaves))
            out = self._run_user(local_args)
            with torch_private.DisableTorchFunction():  # our bookkeeping: no op of the program
                paths, out_leaves, out_specs, out_tree = check_outputs(mapped, out, ctx)
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

    def out_specs(self) -> list[PartitionSpec]:
        """The out_spec of each output tensor, in the order ``body`` returns them (known once
        the body ran)."""
        return [
            s for x, s in zip(self.out_leaves, self.out_leaf_specs) if isinstance(x, torch.Tensor)
        ]

    def outputs(self, tensors: list[Any]) -> Any:
        """The output tree: the backend's assembled ``tensors`` in the tensor leaves' places."""
        it = iter(tensors)
        leaves = [next(it) if isinstance(x, torch.Tensor) else x for x in self.out_leaves]
        return unflatten(self.out_tree, leaves)

    def _run_user(self, args: tuple) -> Any:
        try:
            return self.fn(*args)
        except SpmdError:
            raise
        except RuntimeError as e:
            explained = self.backend.explain(e, self.mapped.where)
            if explained is not None:
                raise explained from e
            raise
