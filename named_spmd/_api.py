"""spmd_map: argument checks, spec broadcasting, the out_specs check and hand-off to a backend."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import optree
import torch

from . import _context
from ._errors import SpecError, SpmdError, VmaError, bullet_list, fn_label
from ._mesh import Mesh, as_mesh
from ._spec import PartitionSpec, spec_problems
from ._tree import broadcast_specs, check_spec_types, flatten_with_paths, path_text
from ._types import VType

# Messages of functorch errors that mean "this code cannot run per instance under vmap".
_VMAP_LIMITS = (
    "vmap",
    "Batching rule",
    "batched tensor",
    ".item()",
    "data-dependent",
    "Cannot access data pointer",  # .tolist() / .numpy() of a batched tensor
)
# ... and those of an in-place write whose operand has instances the target lacks.
_INPLACE_UNDER_VMAP = ("inplace arithmetic", "doesn't match the broadcast shape")


class SpmdFunction:
    """A per-device function mapped over a mesh; call it with global values."""

    def __init__(self, fn, mesh, in_specs, out_specs, check_vma):
        self.fn = fn
        self.label = fn_label(fn)
        self.where = f"spmd_map of {self.label}"
        self.mesh: Mesh = as_mesh(mesh, self.where)
        check_spec_types(in_specs, "in_specs", self.where)
        check_spec_types(out_specs, "out_specs", self.where)
        self.in_specs = in_specs
        self.out_specs = out_specs
        self.check_vma = check_vma
        functools.update_wrapper(self, fn)

    def __repr__(self) -> str:
        return (
            f"spmd_map({self.label}, mesh={self.mesh!r}, in_specs={self.in_specs!r}, "
            f"out_specs={self.out_specs!r})"
        )

    # --- inputs -----------------------------------------------------------------------------
    def _input_leaves(self, args: tuple) -> tuple[list[Any], list[PartitionSpec], Any]:
        paths, leaves, treedef = flatten_with_paths(args)
        specs = broadcast_specs(self.in_specs, args, "in_specs", self.where)
        problems = []
        for path, leaf, spec in zip(paths, leaves, specs):
            where = f"argument {path_text(path)}"
            if isinstance(leaf, torch.Tensor):
                problems += spec_problems(spec, tuple(leaf.shape), self.mesh.shape, where)
            elif len(spec.axes) > 0:
                problems.append(
                    f"{where} is a {type(leaf).__name__}, not a tensor, but its spec {spec!r} "
                    "splits it. Fix: pass a tensor, or give it P()."
                )
        if problems:
            raise SpecError(
                f"{self.where}: the inputs do not fit in_specs on mesh {self.mesh.shape}:\n"
                + bullet_list(problems)
            )
        return leaves, specs, treedef

    # --- outputs ----------------------------------------------------------------------------
    def _check_outputs(self, out: Any, ctx: _context.SpmdContext):
        paths, leaves, treedef = flatten_with_paths(out)
        specs = broadcast_specs(self.out_specs, out, "out_specs", self.where)
        problems, vma_problems = [], []
        for path, leaf, spec in zip(paths, leaves, specs):
            where = "output" + path_text(path)
            if not isinstance(leaf, torch.Tensor):
                if spec.axes:
                    problems.append(
                        f"{where} is a {type(leaf).__name__}; only tensors can be split by {spec!r}."
                    )
                continue
            # outputs are concatenated, never split: a dim size every axis product divides
            # (mesh.size) checks rank and axis names without a divisibility condition
            problems += spec_problems(spec, (self.mesh.size,) * leaf.dim(), self.mesh.shape, where)
            extra = ctx.vma(leaf) - set(spec.axes)
            if self.check_vma and extra:
                vma_problems.append(self._vma_problem(where, leaf, spec, extra, ctx))
        if problems:
            raise SpecError(
                f"{self.where}: the outputs do not fit out_specs:\n" + bullet_list(problems)
            )
        if vma_problems:
            raise VmaError(
                f"{self.where}: out_specs claim replication that the program does not guarantee:\n"
                + "\n".join(vma_problems)
            )
        return paths, leaves, specs, treedef

    def _vma_problem(self, where, leaf, spec, extra, ctx) -> str:
        order = self.mesh.axis_names
        axes = tuple(a for a in order if a in extra)
        vtype = VType(leaf.dtype, tuple(leaf.shape), ctx.vma(leaf), order)
        named = f"ns.psum(y, {axes[0] if len(axes) == 1 else axes!r})"
        suggestion = _spec_naming(spec, axes, leaf.dim())
        return (
            f"  - {where} has type {vtype}: it varies over {axes}, but its out_spec {spec!r} does "
            f"not name {'them' if len(axes) > 1 else repr(axes[0])}, which claims one replicated copy.\n"
            f"    Fix 1: reduce inside the function, e.g. {named} (or pmean / pmax / "
            f"all_gather(..., to='invariant')) if the instances hold parts of one value.\n"
            f"    Fix 2: name the axis in out_specs{suggestion} to get every instance's block "
            "concatenated."
        )

    # --- call -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise SpmdError(
                f"{self.where}: keyword arguments {sorted(kwargs)} are not supported; in_specs "
                "matches positional arguments. Fix: pass them positionally, or bind constants "
                "with functools.partial before spmd_map."
            )
        if _context.active() is not None:
            raise SpmdError(
                f"{self.where} was called inside another spmd_map (of "
                f"{_context.active().fn_label}); nesting is not supported. "
                "Fix: call the inner per-device function directly, it already runs per instance."
            )
        leaves, specs, in_tree = self._input_leaves(args)
        backend = _backend(self.mesh)
        result: dict[str, Any] = {}

        def body(local_leaves, ctx):
            _context.push(ctx)
            try:
                out = self._call_user(optree.tree_unflatten(in_tree, local_leaves))
                paths, out_leaves, out_specs, out_tree = self._check_outputs(out, ctx)
            finally:
                _context.pop()
            result.update(tree=out_tree, leaves=out_leaves, specs=out_specs)
            return [x for x in out_leaves if isinstance(x, torch.Tensor)]

        def out_specs_of():
            return [
                s for x, s in zip(result["leaves"], result["specs"]) if isinstance(x, torch.Tensor)
            ]

        tensors = iter(backend.run(self.mesh, self.fn, leaves, specs, body, out_specs_of))
        out_leaves = [next(tensors) if isinstance(x, torch.Tensor) else x for x in result["leaves"]]
        return optree.tree_unflatten(result["tree"], out_leaves)

    def check(self, *args: Any, backward: bool = True) -> Any:
        """Type-check a call without running it: shapes, dtypes, vma and communication.

        Runs the per-device function once, abstractly, on meta tensors of the per-instance
        shapes: no data, no communication, no per-instance work, so a mesh of thousands of
        instances is checked on a laptop. Raises the same :class:`SpmdError` a real call would.

        Args:
            *args: the global arguments, as tensors (real or ``device="meta"``) or
                :class:`named_spmd.ShapeDtype` stand-ins; nothing of their size is allocated.
            backward: also run autograd on the meta outputs, with respect to every floating-point
                input, to report the backward communication.

        Returns:
            A :class:`named_spmd.CheckReport`: ``.outputs`` (per-instance ``VType`` and global
            shape per output leaf), ``.out`` (the output pytree of ``ShapeDtype``), ``.forward``
            and ``.backward`` (the logical collectives one instance runs), ``.comms.summary()``.

        Example:
            >>> import torch, named_spmd as ns
            >>> mesh = ns.make_mesh((64, 64), ("dp", "tp"))
            >>> f = ns.spmd_map(lambda x: ns.psum(x, "tp"), mesh=mesh,
            ...                 in_specs=ns.P("dp", "tp"), out_specs=ns.P("dp"))
            >>> f.check(ns.ShapeDtype((4096, 4096))).types
            [f32[64,64]{dp}]
        """
        from .backends import abstract

        return abstract.check(self, args, backward=backward)

    def _call_user(self, args: tuple) -> Any:
        try:
            return self.fn(*args)
        except SpmdError:
            raise
        except RuntimeError as e:
            if self.mesh.kind == "simulated" and any(s in str(e) for s in _INPLACE_UNDER_VMAP):
                raise VmaError(
                    f"{self.where}: an in-place write failed under the simulated mesh:\n  {e}\n"
                    "If it writes a value that varies over mesh axes into a tensor invariant over "
                    "them (an in_spec P() input or a closed-over tensor), every instance would "
                    "hold different values in what is typed replicated. Fix: compute out of "
                    "place (y = x + v instead of x += v)."
                ) from e
            if any(s in str(e) for s in _VMAP_LIMITS):
                raise SpmdError(
                    f"{self.where}: the per-device function failed under the simulated mesh, "
                    f"which runs every instance at once with torch.func.vmap:\n  {e}\n"
                    "Per-instance code cannot use .item(), data-dependent Python control flow "
                    "(if on tensor values), nonzero(), or in-place writes into captured tensors. "
                    "Fix: use torch.where / masks instead of branching on values."
                ) from e
            raise


def _spec_naming(spec: PartitionSpec, axes: tuple[str, ...], rank: int) -> str:
    if rank == 0:
        return " (a rank-0 output needs a singleton dim first: return y.reshape(1))"
    entries = list(spec) + [None] * (rank - len(spec))
    first = entries[0]
    merged = ((first,) if isinstance(first, str) else tuple(first or ())) + axes
    entries[0] = merged[0] if len(merged) == 1 else merged
    return f", e.g. {PartitionSpec(*entries)!r}"


def _backend(mesh: Mesh):
    if mesh.kind == "simulated":
        from .backends import simulated

        return simulated
    from .backends import distributed

    return distributed


def spmd_map(
    f: Callable[..., Any] | None = None,
    /,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
) -> Any:
    """Map a per-device function over a mesh: global values in, global values out.

    Args:
        f: the per-device function. It receives, for every tensor argument, the local block that
            its in_spec selects for this instance, and may call collectives by axis name.
        mesh: a :class:`Mesh` (simulated or real) or a ``DeviceMesh`` with ``mesh_dim_names``.
        in_specs: a pytree prefix of the positional-argument tuple; each ``P`` applies to every
            tensor leaf below it (``None`` means ``P()``).
        out_specs: a pytree prefix of the output. An axis the out_spec names concatenates the
            instances' blocks along that dim; an axis it does not name must be invariant.
        check_vma: check that out_specs only claim replication the program guarantees. With
            ``False`` an unnamed axis returns the value of the instance at coordinate 0 there.

    Autodiff: the mapped function is differentiable with respect to its global inputs
    (``Tensor.backward``, ``torch.autograd.grad``, ``torch.func`` grad / vjp / jvp / jacrev /
    hessian / vmap, double backward); the result is the gradient of the global function, with
    each collective transposed as DESIGN.md section 3 says. ``torch.func.grad`` (or vjp / jvp)
    *inside* ``f`` differentiates the per-instance function, as ``jax.grad`` inside
    ``shard_map`` does: collectives transpose per instance (psum -> pvary, all_gather ->
    psum_scatter, all_to_all -> swapped all_to_all, ppermute -> reversed pairs, explicit
    ``pvary`` -> psum), so the gradient of a psum'd loss w.r.t. a varying input is this
    instance's block of the global gradient. One difference from JAX on the simulated mesh: an
    invariant value mixed *implicitly* with varying ones is not summed over those axes (the inner
    gradient is this instance's contribution, typed varying); call ``ns.pvary(w, axes)`` on it
    first to get JAX's invariant total. ``Tensor.backward`` / ``torch.autograd.grad`` cannot run
    inside ``f`` on the simulated mesh (functorch refuses them under vmap).

    Example:
        >>> import torch, named_spmd as ns
        >>> from named_spmd import P
        >>> mesh = ns.make_mesh((2, 4), ("dp", "tp"))
        >>> @ns.spmd_map(mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp", None))
        ... def mlp(x, w):
        ...     return ns.psum(torch.relu(x @ w).sum(-1, keepdim=True), "tp")
        >>> mlp(torch.randn(8, 16), torch.randn(16, 32)).shape
        torch.Size([8, 1])
    """
    if f is None:
        return functools.partial(
            spmd_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
    if not callable(f):
        raise SpmdError(f"spmd_map: expected a function, got {type(f).__name__}.")
    return SpmdFunction(f, mesh, in_specs, out_specs, check_vma)
