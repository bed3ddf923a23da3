"""A mapped call's boundary: its inputs checked against in_specs, its outputs against out_specs.

The input checks run once per tree structure, ``.local``, ``uneven_state()`` and
:func:`leaves_key` (``input_leaves``'s cache on the ``SpmdFunction``, which keeps each such set
of calls' ``Call.memo``); while Dynamo traces, the in_specs are broadcast over a skeleton of the
inputs instead (``in_spec_index``). The output checks other than the types' run once per output
tree structure and :func:`leaves_key` (``SpmdFunction._outputs_of_tree``). Whether a dim the
axes do not divide is taken is the backend's to say (its ``capabilities.uneven_blocks`` and
``uneven_state()``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from . import _context
from . import _torch_private as torch_private
from ._accounting import CommEvent, on_backward
from ._errors import SpecError, VmaError, bullet_list
from ._layout import block_global_shape, gives_unequal_blocks
from ._out_problems import unreduced_problem, varying_problem
from ._spec import (
    PartitionSpec,
    given_sizes_problems,
    output_settles,
    spec_problems,
)
from ._tree import (
    broadcast_specs,
    flatten,
    flatten_known,
    flatten_with_paths,
    in_spec_index,
    leaf_skeleton,
    opaque_leaf_problem,
    opaque_tensor_holder,
    path_text,
    paths_of,
)
from ._types import Vma, data_dependent, shape_shown

if TYPE_CHECKING:
    from ._api import SpmdFunction
    from .backends import Backend


def input_leaves(
    f: SpmdFunction, args: tuple, local: bool, backend: Backend
) -> tuple[list[Any], list[PartitionSpec], Any, dict]:
    """The call's leaves, their specs and tree structure, checked against in_specs; and the
    memo of the calls of ``f`` with this tree structure and these leaves (:func:`leaves_key`:
    ``Call.memo``, a new dict where there is none, as while Dynamo traces)."""
    if torch_private.memo_would_be_guarded():
        paths, leaves, treedef = flatten_with_paths(args)
        specs = _specs_in_trace(f, args)
        if specs is None:
            specs = broadcast_specs(f.in_specs, args, "in_specs", f.where)
        _check_inputs(f, paths, leaves, specs, local, backend)
        return leaves, specs, treedef, {}
    leaves, treedef = flatten_known(args, f._plain_trees)
    specs, fine = _per_structure(f._inputs_of_tree, treedef, f.in_specs, args, "in_specs", f, dict)
    key = leaves_key(leaves)
    checked = None if key is None else (local, backend.uneven_state(), key)
    memo = None if checked is None else fine.get(checked)
    if memo is None:
        _check_inputs(f, paths_of(args), leaves, specs, local, backend)
        memo = {}
        if checked is not None:
            # what the memo stands for, its key: hashed once (a replay's signature holds it)
            memo["inputs"] = HashedOnce((treedef, checked))
            if len(fine) < 256:
                fine[checked] = memo
    return leaves, list(specs), treedef, memo


def _check_inputs(
    f: SpmdFunction,
    paths: list[tuple],
    leaves: list[Any],
    specs: list[PartitionSpec],
    local: bool,
    backend: Backend,
) -> None:
    """Every input leaf fits its spec on the mesh, or one SpecError lists the problems
    (``local``: the leaves are blocks, checked as parts of their global shapes)."""
    problems = []
    # blocks of unequal sizes: a dim the axes do not divide, the sizes a Blocks entry gives
    uneven = not local and backend.capabilities.uneven_blocks
    for path, leaf, spec in zip(paths, leaves, specs):
        where = f"argument {path_text(path)}"
        if isinstance(leaf, torch.Tensor) and leaf.layout is not torch.strided:
            problems.append(
                f"{where} is a {str(leaf.layout).replace('torch.', '')} tensor; spmd_map "
                "splits and batches dense (strided) tensors only. Fix: pass x.to_dense()."
            )
        elif isinstance(leaf, torch.Tensor) and data_dependent(leaf):
            problems += _data_dependent_problems(f, leaf, spec, where)
        elif isinstance(leaf, torch.Tensor):
            shape = tuple(leaf.shape)
            if local:
                shape = block_global_shape(shape, spec, f.mesh.shape)
            problems += spec_problems(spec, shape, f.mesh.shape, where, uneven)
        elif opaque_tensor_holder(leaf):
            problems.append(opaque_leaf_problem(where, leaf))
        elif len(spec.axes) > 0:
            problems.append(
                f"{where} is a {type(leaf).__name__}, not a tensor, but its spec {spec!r} "
                "splits it. Fix: pass a tensor, or give it P()."
            )
    if problems:
        raise SpecError(
            f"{f.where}: the inputs do not fit in_specs on mesh {f.mesh.shape}:\n"
            + bullet_list(problems)
        )


def _data_dependent_problems(
    f: SpmdFunction, leaf: torch.Tensor, spec: PartitionSpec, where: str
) -> list[str]:
    """How ``spec`` fails a traced input of a data-dependent size: its rank and axis names are
    checked on a stand-in shape (as an output's); a split cannot be laid out (the blocks' sizes
    are not known while compiling) and is refused."""
    plain = spec.without_sizes()
    stand_in = (f.mesh.size,) * leaf.dim()
    found = spec_problems(plain, stand_in, f.mesh.shape, where, shown=("?",) * leaf.dim())
    if found or not spec.axes:
        return found
    return [
        f"{where} has a data-dependent size (known only when the program runs, as x[mask]'s "
        f"or one made from .item()), which {spec!r} splits: its blocks cannot be laid out "
        "while compiling. Fix: give it a size known when compiling (pad it to a fixed size), "
        "give it P(), or call the mapped function outside the compiled region."
    ]


def _refuse_marked_dynamic(f: SpmdFunction, args: tuple) -> None:
    """While Dynamo traces: an SpecError for an input with a size ``mark_dynamic`` marked, or
    computed from a marked size (``f(x + 1)`` of a marked ``x``: its size's symbols come from
    the marked one). A compiled call is traced for static shapes (its blocks, layouts and
    checks are decided while tracing: ``_spec.specialize``), which Dynamo refuses for such a
    size with a ConstraintViolationError naming none of the call. Any other symbolic size
    (one Dynamo made dynamic on its own, after a shape change or for ``maybe_mark_dynamic``)
    is specialized, even in a frame with marked sizes."""
    paths, leaves, _ = flatten_with_paths(args)  # (Dynamo tracks an input once it reads it)
    marked = _marked_dynamic()
    if not marked:  # (the common case: one trace-time constant)
        return
    found: list[str] = []
    sources: list[str] = []
    for path, x in zip(paths, leaves):
        if isinstance(x, torch.Tensor) and not data_dependent(x):
            dims, from_marked = _dims_from_marked(x, marked)
            if dims:
                found.append(f"{path_text(path)} (dim {', '.join(map(str, dims))})")
                sources += from_marked
    if found:
        raise SpecError(
            f"{f.where}: the compiled call's input {', '.join(found)} has a size marked "
            f"dynamic, or computed from one (mark_dynamic: {', '.join(dict.fromkeys(sources))}). "
            "A mapped call is "
            "compiled for static shapes: its blocks, their layout and the spec checks are "
            "fixed while tracing, so Dynamo would refuse the marked size "
            "(ConstraintViolationError). Fix: do not mark the inputs of a compiled mapped call "
            "(maybe_mark_dynamic leaves Dynamo free to specialize; a new size "
            "compiles the call again), or call it outside the compiled region."
        )


@torch_private.trace_constant
def _marked_dynamic() -> tuple[str, ...]:
    """``traced_marked_dynamic`` run eagerly at trace time."""
    return torch_private.traced_marked_dynamic()


def _dims_from_marked(
    x: torch.Tensor, marked: tuple[str, ...]
) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The dims of a traced input whose sizes are computed from the ``marked`` sizes of the
    frame (the input's own marked sizes among them), and those marked sizes. A dim marked but
    kept static by Dynamo (a size of 0 or 1, which it specializes without a symbol) is no
    constraint Dynamo refuses to see specialized: the call compiles."""
    dims: list[int] = []
    sources: list[str] = []
    for d, names in enumerate(torch_private.traced_size_sources(x)):
        from_marked = [n for n in names if n in marked]
        if from_marked:
            dims.append(d)
            sources += from_marked
    return tuple(dims), tuple(dict.fromkeys(sources))


def _specs_in_trace(f: SpmdFunction, args: tuple) -> list[PartitionSpec] | None:
    """The inputs' specs while Dynamo traces, broadcast eagerly over a skeleton of the
    inputs (``in_spec_index`` runs at trace time), each an index into the distinct specs.
    Broadcast in the trace, the in_specs tree would be guarded spec by spec (about 200 guards
    on a model's parameters, checked on every compiled call); this way ``in_spec_index``'s
    argument ``f`` is guarded by identity and only the distinct specs by content. None where
    the inputs hold other containers than tuples, lists and dicts (the traced path
    broadcasts)."""
    skeleton = leaf_skeleton(args)
    if skeleton is None:
        return None
    index = in_spec_index(f, skeleton)
    if isinstance(index, str):
        raise SpecError(index)
    table = f._in_spec_table
    return [table[i] for i in index]


def check_outputs(
    f: SpmdFunction, out: Any, ctx: _context.SpmdContext
) -> tuple[list[tuple], list[Any], list[PartitionSpec], Any]:
    paths, leaves, treedef = flatten_with_paths(out)
    specs, fitting = _out_specs(f, out, treedef)
    check_vma = f.check_vma and not ctx.replaying  # a replay's types were checked
    # the checks other than the types' run once per structure and leaves_key, as the inputs'
    key = None if fitting is None or ctx.uneven else leaves_key(leaves)
    if fitting is not None and key is not None and key in fitting:
        if check_vma:
            _raise_vma_problems(f, ctx, paths, leaves, specs)
        return paths, leaves, specs, treedef
    problems: list[str] = []
    vma_problems: list[str] = []
    deferred = 0  # rank problems left to _layout.instances_problem
    for path, leaf, spec in zip(paths, leaves, specs):
        where = "output" + path_text(path)
        if not isinstance(leaf, torch.Tensor):
            if opaque_tensor_holder(leaf):
                problems.append(opaque_leaf_problem(where, leaf))
            elif spec.axes:
                problems.append(
                    f"{where} is a {type(leaf).__name__}; only tensors can be split by "
                    f"{spec!r}. Fix: give it P() in out_specs, or return a tensor there."
                )
            continue
        # outputs are concatenated, never split: a dim size every axis product divides
        # (mesh.size) checks rank and axis names without a divisibility condition; the messages
        # name the output's own shape
        plain = spec.without_sizes()
        stand_in = (f.mesh.size,) * leaf.dim()
        found = spec_problems(plain, stand_in, f.mesh.shape, where, shown=shape_shown(leaf))
        problems += found
        if found and ctx.uneven and len(plain) > leaf.dim():
            # an output's rank may be this instance's alone: told once every instance returned
            # (instances_problem), alike on every one, where it is this instance's only problem
            deferred += len(found)
            continue
        if spec.axes and data_dependent(leaf) and _varies(ctx.vma(leaf)):
            problems.append(_split_data_dependent_output(where, spec))
        elif spec.explicit and not ctx.uneven:  # (an uneven execution checks each block)
            problems += given_sizes_problems(spec, tuple(leaf.shape), where)
        if check_vma:
            vma_problems += _vma_problems(path, leaf, spec, ctx)
    if len(problems) > deferred:
        raise SpecError(f"{f.where}: the outputs do not fit out_specs:\n" + bullet_list(problems))
    if vma_problems and not deferred:  # (an instance's SpecError comes before its VmaError)
        _raise_vma_error(f, vma_problems)
    if fitting is not None and key is not None:
        if len(fitting) >= 256:  # (a number output that changes every call: start again)
            fitting.clear()
        fitting.add(key)
    return paths, leaves, specs, treedef


def _vma_problems(
    path: tuple, leaf: torch.Tensor, spec: PartitionSpec, ctx: _context.SpmdContext
) -> list[str]:
    """How the type of ``leaf``, the output at ``path``, breaks rule 4 under ``spec`` (empty:
    it fits)."""
    found = []
    vma = ctx.vma(leaf)
    if not vma <= spec.axes:  # rule 4: a subset of the named axes
        # (an axis the spec says is unreduced is the next bullet's, which says to pcast)
        extra = vma.remove(spec.axes + tuple(spec.unreduced))
        if extra.varying:
            found.append(varying_problem("output" + path_text(path), leaf, spec, extra, ctx))
    if vma.unreduced != spec.unreduced:
        found.append(unreduced_problem("output" + path_text(path), leaf, spec, ctx))
    return found


def _raise_vma_problems(
    f: SpmdFunction,
    ctx: _context.SpmdContext,
    paths: list[tuple],
    leaves: list[Any],
    specs: list[PartitionSpec],
) -> None:
    """The type check alone, of outputs whose other checks passed (their structure and
    :func:`leaves_key` are known)."""
    found = [
        problem
        for path, leaf, spec in zip(paths, leaves, specs)
        if isinstance(leaf, torch.Tensor)
        for problem in _vma_problems(path, leaf, spec, ctx)
    ]
    if found:
        _raise_vma_error(f, found)


def _raise_vma_error(f: SpmdFunction, problems: list[str]) -> None:
    raise VmaError(
        f"{f.where}: out_specs claim replication that the program does not guarantee:\n"
        + "\n".join(problems)
    )


def _varies(vma: Vma) -> bool:
    return bool(vma.varying or vma.partial)


def _split_data_dependent_output(where: str, spec: PartitionSpec) -> str:
    """The problem of a traced output of a data-dependent size that ``spec`` assembles, where it
    varies: each instance's block may have its own size, which a compiled call's layout, fixed
    while tracing, cannot assemble (the eager call gathers the blocks' sizes first); an
    invariant one has one size on every instance."""
    return (
        f"{where} has a data-dependent size (known only when the program runs, as x[mask]'s "
        f"or one made from .item()), which {spec!r} assembles: its blocks, whose sizes may "
        "differ per instance, cannot be assembled by a compiled call. Fix: give it a size "
        "known when compiling (pad it to a fixed size), return it under P(), or call the "
        "mapped function outside the compiled region (without fullgraph=True it runs so)."
    )


def _out_specs(
    f: SpmdFunction, out: Any, treedef: Any
) -> tuple[list[PartitionSpec], set[tuple] | None]:
    """The out_specs broadcast over ``out`` (of structure ``treedef``), and the
    :func:`leaves_key` of the outputs of that structure that fit them; once per structure
    outside a trace (as the in_specs, ``input_leaves``; None: no such set, in a trace)."""
    if torch_private.memo_would_be_guarded():
        return broadcast_specs(f.out_specs, out, "out_specs", f.where), None
    specs, fitting = _per_structure(
        f._outputs_of_tree, treedef, f.out_specs, out, "out_specs", f, set
    )
    return list(specs), fitting


def _per_structure(
    table: dict, treedef: Any, specs: Any, tree: Any, what: str, f: SpmdFunction, memo: Any
) -> tuple[list[PartitionSpec], Any]:
    """``specs`` broadcast over ``tree`` and a ``memo()`` of the calls with its structure,
    kept in ``table`` (one of ``f``'s, per ``treedef``; started again past 256 structures)."""
    known = table.get(treedef)
    if known is None:
        if len(table) > 256:
            table.clear()
        known = table[treedef] = (broadcast_specs(specs, tree, what, f.where), memo())
    return known


def unequal_blocks(f: SpmdFunction, args: tuple, local: bool = False) -> bool:
    """Whether a call of ``f`` on ``args`` splits an input into blocks of unequal sizes. False
    where the inputs do not fit in_specs (the call raises that), and for a local call (its
    blocks are the caller's). Outside a trace, known per tree structure and leaf shapes
    (``ns.compile`` asks at every call)."""
    tracing = torch_private.memo_would_be_guarded()
    if tracing:  # (every traced call asks here first, blocks even or not)
        _refuse_marked_dynamic(f, args)
    if local or f.mesh.size == 1 or not f.backend.capabilities.uneven_blocks:
        return False
    if tracing:
        # a data-dependent size is never split (the input check refuses that): the other
        # leaves decide
        leaves = [
            None if isinstance(x, torch.Tensor) and data_dependent(x) else x
            for x in flatten_with_paths(args)[1]
        ]
        return _splits_unevenly(f, args, leaves, _specs_in_trace(f, args))
    leaves, treedef = flatten(args)
    key = _shapes_key(leaves, treedef)
    known = f._unequal_of_inputs.get(key) if key is not None else None
    if known is None:
        specs = f._inputs_of_tree.get(treedef, (None,))[0]
        known = _splits_unevenly(f, args, leaves, specs)
        if key is not None and len(f._unequal_of_inputs) < 256:
            f._unequal_of_inputs[key] = known
    return known


def _splits_unevenly(
    f: SpmdFunction, args: tuple, leaves: list[Any], specs: list[PartitionSpec] | None
) -> bool:
    try:
        if specs is None:
            specs = broadcast_specs(f.in_specs, args, "in_specs", f.where)
    except SpecError:
        return False
    sizes = f.mesh._shape
    fit = [(x, s) for x, s in zip(leaves, specs) if all(a in sizes for a in s.axes)]
    return gives_unequal_blocks([x for x, _ in fit], [s for _, s in fit], sizes)


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str)


def _shapes_key(leaves: list[Any], treedef: Any) -> tuple | None:
    """What :func:`unequal_blocks` reads from the leaves of one tree structure: a strided
    tensor's shape, a plain Python value's type; None where a leaf is anything else."""
    key: list[Any] = [treedef]
    for x in leaves:
        if isinstance(x, torch.Tensor):
            if x.layout is not torch.strided:
                return None
            key.append(x.shape)
        elif type(x) in _PLAIN_LEAVES:
            key.append(type(x))
        else:
            return None
    return tuple(key)


def leaves_key(leaves: list[Any]) -> tuple | None:
    """Per leaf, what the input checks read and a replay's signature (``_replay``) adds up: a
    strided tensor's type, shape, dtype, device and requires_grad, a plain Python value's type
    and value; None where a leaf is anything else (a sparse tensor, an object that may hold
    tensors: checked every call). One pass over the leaves for both, no mode seeing it."""
    return torch_private.unseen_reads(_leaves_key, leaves)


def _leaves_key(leaves: list[Any]) -> tuple | None:
    key: list[Any] = []
    add = key.append  # (read on every call, for every leaf: names bound once, not looked up)
    for x in leaves:
        if isinstance(x, _Tensor):
            if x.layout is not _STRIDED:
                return None
            add((type(x), x.shape, x.dtype, x.device, x.requires_grad))
        elif type(x) in _PLAIN_LEAVES:
            add((type(x), x))
        else:
            return None
    return tuple(key)


_Tensor, _STRIDED = torch.Tensor, torch.strided


class HashedOnce(tuple):
    """A tuple that keeps its hash: a key looked up at every call (a memo's ``"inputs"``, which
    a replay's signature holds: a tuple per leaf), hashed when made, not at each lookup."""

    _hash: int

    def __new__(cls, items: tuple) -> HashedOnce:
        made = super().__new__(cls, items)
        made._hash = tuple.__hash__(made)
        return made

    def __hash__(self) -> int:
        return self._hash


def tiled_output_event(
    ctx: _context.SpmdContext, y: torch.Tensor, spec: PartitionSpec
) -> torch.Tensor:
    """An output invariant over an axis its out_spec names (or declares unreduced) is tiled (or
    summed): its copies' cotangents differ, so its backward sums them over that axis (a psum on
    a real mesh)."""
    _, tiled = output_settles(ctx.vma(y), spec, ctx.mesh.axis_names)
    if ctx.single_axes.issuperset(tiled):  # nothing tiled, or only copies of one instance
        return y
    return on_backward(
        y, CommEvent("psum", tiled, "backward", tuple(y.shape), y.dtype, implicit=True)
    )
