"""The library's error family and the helpers that build its messages.

Every error raised for bad user input is a :class:`SpmdError` (a ``RuntimeError``: a ``TypeError``
raised inside ``__torch_function__`` would be swallowed by Python's operator dispatch). Messages say
which call and which user function, where (a key path), expected versus got, and the fix.
"""

from __future__ import annotations

import difflib
import dis
import functools
import inspect
import linecache
import os
import sys
import types
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import optree

from ._torch_private import TORCH_DIR

if TYPE_CHECKING:
    import torch


def _dir_of(module: types.ModuleType) -> tuple[str, ...]:
    path = module.__file__
    return () if path is None else (os.path.dirname(os.path.abspath(path)) + os.sep,)


#: This package's directory (a tuple, for ``str.startswith``).
PACKAGE_DIR = _dir_of(sys.modules[__name__])

#: Directories of the code that runs torch's ops: torch's and this package's (its modes and
#: simulated collectives run them), where a torch op's rejection of its operands is raised.
TORCH_DIRS = (TORCH_DIR,) + PACKAGE_DIR

#: Directories whose frames are not the user's (torch, optree, the standard library, this
#: package): a message's "user line" is the innermost frame outside them.
NOT_USER_DIRS = TORCH_DIRS + _dir_of(optree) + _dir_of(os)


class SpmdError(RuntimeError):
    """Root of every error named_spmd raises on bad input."""


class SpecError(SpmdError):
    """A PartitionSpec or a specs pytree does not fit the mesh or the arguments."""


class VmaError(SpmdError):
    """A value's varying/invariant type contradicts what the program claims."""


class CollectiveError(SpmdError):
    """A collective was called with bad arguments or outside ``spmd_map``."""


class RankFailedError(SpmdError):
    """Another rank of a real mesh failed while this rank waited for it."""


def fn_label(fn: object) -> str:
    """A short, recognisable name for a user function: ``mlp (model.py:12)``."""
    while isinstance(fn, functools.partial):  # name the function the partial wraps
        fn = fn.func
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    # the line of the function a decorator (functools.wraps: torch.compile's) wraps
    code = getattr(inspect.unwrap(fn) if callable(fn) else fn, "__code__", None)
    if code is None:
        return f"`{name}`"
    filename = code.co_filename.rsplit("/", 1)[-1]
    return f"`{name}` ({filename}:{code.co_firstlineno})"


def suggest(name: object, choices: Iterable[str]) -> str:
    """' Did you mean 'tp'?' when a close match exists, else ''."""
    if not isinstance(name, str):
        return ""
    # difflib.get_close_matches(n=1) without its heapq (Dynamo cannot trace heapq's
    # ``object()`` sentinel, and an out_spec's axis is checked while Dynamo traces)
    scored = [(difflib.SequenceMatcher(None, c, name).ratio(), c) for c in choices]
    score, close = max(scored, default=(0.0, ""))
    return f" Did you mean {close!r}?" if score >= 0.5 else ""  # 'tq' -> 'tp'


def bullet_list(problems: Sequence[str]) -> str:
    return "\n".join(f"  - {p}" for p in problems)


# --- errors of the user's own torch code, told per instance (or per rank) ----------------


def shared_input_written(where: str, shape: tuple[int, ...], spec: object) -> SpmdError:
    """The per-instance execution saw the function write in place into an input whose blocks
    several instances share: each of them wrote it, where vmap and a real mesh write once."""
    return SpmdError(
        f"{where}: the function wrote in place into an input (shape {list(shape)}, in_spec "
        f"{spec!r}) whose blocks several instances share in the per-instance execution (asked "
        "for, or taken for uneven blocks), so each of them wrote it: the input now holds the "
        "write repeated. Fix: clone the input inside the function before writing to it "
        "(x = x.clone()), and make the input again."
    )


def operand_shapes_differ(
    op: str, label: str, shapes: Sequence[tuple[int, ...]], but: int | None = None
) -> SpmdError:
    """A collective that takes one shape on every member (``but`` along that dim, where a tiled
    all_gather concatenates) got the members' ``shapes`` (blocks of unequal sizes): the same
    error on the simulated and the real mesh."""
    along = "" if but is None else f" but along dim {but}, where it concatenates"
    return SpmdError(
        f"{op} in {label}: the members' operands have different shapes {list(shapes)} (uneven "
        f"blocks, or an empty one), but {op} takes one shape on every member{along}. Fix: pad the "
        "blocks to one shape first (ns.block_sizes gives every member's size), or split the dim "
        "so that no block is empty."
    )


def operand_dtypes_differ(op: str, label: str, dtypes: Sequence[torch.dtype | None]) -> SpmdError:
    """A collective got members' operands of different dtypes (a branch on the block's shape,
    say): the same error on the simulated and the real mesh, where the bytes of one dtype would
    be read as another's."""
    names = [str(d).removeprefix("torch.") for d in dtypes]
    return SpmdError(
        f"{op} in {label}: the members' operands have different dtypes {names}, but {op} "
        "takes one dtype on every member. Fix: cast the operands to one dtype before the "
        "collective (e.g. x.to(torch.float32) on every member)."
    )


def collectives_apart(label: str, ended: str, waiting: str, op: str) -> SpmdError:
    """Instances (``ended``) returned while others (``waiting``) wait at the collective ``op``:
    the same error on the simulated and the real mesh."""
    return SpmdError(
        f"{label}: instances {ended} returned while instances {waiting} wait at {op}: the "
        "instances called different collectives (Python control flow on values that differ "
        "between instances). Fix: call every collective on every instance, in one order; "
        "select values with torch.where rather than skipping a collective."
    )


def collectives_differ(label: str, calls: str) -> SpmdError:
    """The instances called different collectives (``calls``: each instance's) at one point."""
    return SpmdError(
        f"{label}: the instances called different collectives at one point of the program "
        f"({calls}). Fix: call every collective on every instance, in one order, with the same "
        "axes and arguments."
    )


class SpmdIndexError(SpmdError, IndexError):
    """An ``IndexError`` of the user's code, told per instance (``except IndexError`` still
    catches it, as it catches the real mesh's plain ``IndexError``)."""


class SpmdValueError(SpmdError, ValueError):
    """A ``ValueError`` of the user's code, told per instance."""


class SpmdTypeError(SpmdError, TypeError):
    """A ``TypeError`` of the user's code, told per instance."""


class SpmdNotImplementedError(SpmdError, NotImplementedError):
    """A ``NotImplementedError`` of the user's code, told per instance."""


_FAMILY: dict[type[BaseException], type[SpmdError]] = {
    IndexError: SpmdIndexError,
    ValueError: SpmdValueError,
    TypeError: SpmdTypeError,
    NotImplementedError: SpmdNotImplementedError,
    RuntimeError: SpmdError,
}


def error_class(cls: type[BaseException]) -> type[SpmdError]:
    """The SpmdError class that keeps ``cls``'s family (SpmdError itself is a RuntimeError)."""
    return next((ours for base, ours in _FAMILY.items() if issubclass(cls, base)), SpmdError)


# The classes torch raises for operands it rejects.
TORCH_ERRORS = (RuntimeError, IndexError, ValueError, TypeError)


def told_in_family(error: BaseException) -> bool:
    """Whether ``error`` may be told as an SpmdError of its family (``error_class``): exactly
    a class of the family. A subclass (``torch.linalg.LinAlgError``, ``torch.OutOfMemoryError``,
    ``json.JSONDecodeError``) is a distinction the user's code may catch: it is left as raised,
    as outside spmd_map."""
    return type(error) in _FAMILY


def rejected_by_torch(error: BaseException) -> bool:
    """Whether ``error`` is a torch op's rejection of operands that the user's code passed:
    exactly of a class torch raises for that (``told_in_family``), raised in torch's code
    (``TORCH_DIRS``: not the standard library's) below a frame of the user's (not the user's
    own ``raise``, nor an error of named_spmd's)."""
    if not told_in_family(error):
        return False
    paths = []
    tb = error.__traceback__
    while tb is not None:
        paths.append(tb.tb_frame.f_code.co_filename)
        tb = tb.tb_next
    users = [not p.startswith(NOT_USER_DIRS) for p in paths]
    return bool(paths) and paths[-1].startswith(TORCH_DIRS) and any(users)


# autograd's refusals of an in-place write: into a leaf that requires grad (an input, a
# parameter) or a view of one, into a view that a multi-output op or a custom Function made,
# an op's out= where an operand requires grad (_REFUSED_OUT). Checks of the autograd graph,
# which every instance and rank makes alike.
_REFUSED_OUT = "functions with out=... arguments don't support automatic differentiation"
_REFUSED_WRITES = (
    "leaf Variable that requires grad is being used in an in-place operation",
    "is a view and is being modified inplace",
    _REFUSED_OUT,
)


def refused_write(error: BaseException | None) -> bool:
    """Whether ``error`` is autograd's refusal of an in-place write (``_REFUSED_WRITES``)."""
    return isinstance(error, RuntimeError) and any(s in str(error) for s in _REFUSED_WRITES)


def refused_grad(error: BaseException | None) -> bool:
    """Whether ``error`` is autograd's refusal of an argument that requires grad where the op
    takes none (a BatchNorm's running statistics)."""
    return isinstance(error, RuntimeError) and _REFUSED_GRAD in str(error)


_REFUSED_GRAD = "is not differentiable with respect to argument"


def write_refused(error: BaseException, where: str) -> SpmdError | None:
    """Autograd's refusal of an in-place write in the user's function (``_REFUSED_WRITES``), as
    an SpmdError with its fix, the same on every backend and instance; None for another error."""
    if not refused_write(error) or not rejected_by_torch(error):
        return None
    if _REFUSED_OUT in str(error):
        return error_class(type(error))(
            f"{where}: autograd refused an op's out= argument at {user_line(error)}:\n"
            f"  {type(error).__name__}: {error}\n"
            "An op that writes its result into out= cannot be differentiated, and an operand "
            "requires grad; torch refuses it as it does outside spmd_map. Fix: compute out of "
            "place (y = torch.mul(x, w) rather than torch.mul(x, w, out=y))."
        )
    return error_class(type(error))(
        f"{where}: autograd refused an in-place write at {user_line(error)}:\n"
        f"  {type(error).__name__}: {error}\n"
        "The tensor written requires grad and autograd cannot follow the write: a leaf (an "
        "input of the call, a closed-over parameter), a view of one, or a view of a multi-output "
        "op (split, unbind); it refuses it as it does outside spmd_map. Fix: write into a copy "
        "(x = x.clone() first), or compute out of place (y = x + 1 rather than x.add_(1))."
    )


def reentrant_checkpoint(where: str) -> SpmdError:
    """``torch.utils.checkpoint(..., use_reentrant=True)`` inside the per-device function: the
    same error on every backend (docs/design.md section 8)."""
    return SpmdError(
        f"{where}: torch.utils.checkpoint(..., use_reentrant=True) cannot run inside spmd_map: "
        "its recomputation in backward runs outside the call, without the collectives and the "
        "gradient sums of the implicit casts (on the simulated mesh its autograd.Function does "
        "not support torch.func).\nFix: pass use_reentrant=False (torch's recommended mode), "
        "which works inside the per-device function on every backend, collectives included."
    )


def torch_op_failed(error: BaseException, where: str, at: str) -> SpmdError:
    """A torch op of the user's function that rejected its operands (``rejected_by_torch``) on
    ``at`` (the instance, or the rank that holds it): an SpmdError of the same class family
    naming the user's line, the same on every backend; torch's error is its ``__cause__``."""
    return error_class(type(error))(
        f"{where}: a torch op failed at {user_line(error)} on {at}:\n"
        f"  {type(error).__name__}: {error}\nInside the function, shapes are the local blocks "
        "that in_specs select: a dim split over an axis of size n holds 1/n of the global dim."
    )


def told_per_instance(
    error: BaseException,
    where: str,
    at: str,
    empty: tuple[str, Sequence[int]] | None = None,
    replaying: bool = False,
) -> SpmdError | None:
    """``error``, raised by the user's function on one instance or rank ``at``, as every
    backend tells it: a torch op's rejection of its operands (``rejected_by_torch``) on an
    empty block (``empty``: the argument, its shape) or not; in an untyped replay
    (``replaying``), an op's error in the user's line (``_op_failed_untyped``); None for
    another error, which is left as raised."""
    if not rejected_by_torch(error):
        return _op_failed_untyped(error, where, at) if replaying else None
    if empty is not None:
        return empty_block_error(error, where, at, empty)
    return torch_op_failed(error, where, at)


def empty_block_error(
    error: BaseException, where: str, at: str, block: tuple[str, Sequence[int]]
) -> SpmdError:
    """A torch op that failed (``rejected_by_torch``) on an instance whose ``block`` (the
    argument, its shape) is empty: the same error on the simulated and the real mesh (``at``:
    the instance, and the rank that holds it); torch's error is its ``__cause__``."""
    argument, shape = block
    return error_class(type(error))(
        f"{where}: a torch op failed at {user_line(error)} on {at}, whose block of {argument} "
        f"is empty (shape {list(shape)}):\n  {type(error).__name__}: {error}\n"
        "A dim split into more blocks than it has elements leaves some empty (torch.chunk's "
        "blocks: 3 over 4 are 1, 1, 1 and 0), and this op cannot take an empty one. Fix: guard "
        "the op where the block is empty (`if v.shape[0] > 0`, or a mask built from "
        "ns.block_sizes), or give the dim at least one element per block and choose sizes "
        "with no empty block (ns.Blocks)."
    )


def user_line(error: BaseException) -> str:
    """``model.py:12 (y = x @ w)``: the innermost frame of the traceback in the user's code."""
    found = None
    tb = error.__traceback__
    while tb is not None:
        path = tb.tb_frame.f_code.co_filename
        if not path.startswith(NOT_USER_DIRS):
            found = (path, tb.tb_lineno)
        tb = tb.tb_next
    if found is None:
        return "a line outside the user's code"
    path, line = found
    source = linecache.getline(path, line).strip()
    if len(source) > 80:
        source = source[:77] + "..."
    return f"{os.path.basename(path)}:{line}" + (f" (`{source}`)" if source else "")


def _op_failed_untyped(error: BaseException, where: str, at: str) -> SpmdError | None:
    """An error of an untyped replay (``_replay``: no torch function mode, so a torch op's error
    ends in the user's frame) that an op of the user's line raised, not a ``raise`` of the
    user's: told without running the call again (its side effects would repeat); None for
    another error. Whether the op was torch's or Python's is not known without the types."""
    tb = error.__traceback__
    if tb is None or not told_in_family(error):
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    code = tb.tb_frame.f_code
    if code.co_filename.startswith(NOT_USER_DIRS) or _raises_at(code, tb.tb_lasti):
        return None
    return error_class(type(error))(
        f"{where}: an op failed at {user_line(error)} on {at}:\n"
        f"  {type(error).__name__}: {error}\nInside the function, shapes are the local blocks "
        "that in_specs select: a dim split over an axis of size n holds 1/n of the global dim. "
        "The call ran untyped (a later call of a checked signature on one instance), which "
        "tells no operand types; ns.set_debug(True) types every call."
    )


def _raises_at(code: types.CodeType, offset: int) -> bool:
    """Whether ``code``'s instruction at byte ``offset`` is a ``raise`` statement's."""
    return 0 <= offset < len(code.co_code) and dis.opname[code.co_code[offset]] in _RAISES


_RAISES = frozenset({"RAISE_VARARGS", "RERAISE"})


def invariant_differs(
    label: str, where: str, spec: Any, axes: Sequence[str], first: str, at: str
) -> VmaError:
    """The error of an output typed invariant over ``axes`` (its out_spec ``spec`` does not
    name them) whose instances at ``first`` and ``at`` (their coordinates' text) differ: in
    value (the per-instance simulation compares them) or in shape (a real mesh's rows)."""
    return VmaError(
        f"spmd_map of {label}: {where} is typed invariant over {', '.join(axes)} (its "
        f"out_spec {spec} does not name them), but its value differs between the "
        f"instances at {first} and {at}. A Python number "
        "that differs between instances (a block's size, where blocks are uneven; a "
        "value read with .item() or .tolist()) made it: the types see tensors only. "
        "Fix: make such a value varying where it is made (ns.pvary(torch.tensor(n), "
        f"{tuple(axes)!r})) and reduce it with a collective, or take every block's size "
        "from ns.block_sizes (alike on every instance); or name the axes in the out_spec."
    )


def types_apart_in_grad(label: str, where: str, types: str) -> SpmdError:
    """The error of an output that requires grad whose type differs between the ranks of a real
    mesh (``types``: each type and its instances), which took other branches after reading a
    value: their backward passes would run other collectives and wait on each other."""
    return SpmdError(
        f"spmd_map of {label}: {where} requires grad, but its type differs between the "
        f"instances ({types}): they took other branches after reading a value that differs "
        "between them, and on a real mesh their backward passes would run other collectives "
        "(each waiting on the others). Fix: make the branches' results the same type on every "
        "instance (ns.pvary the invariant one over the axes), compute the branch's condition "
        "from an invariant value (ns.psum / ns.pmax of it), or run the call under "
        "torch.no_grad()."
    )


def grad_apart(label: str, where: str, instances: str) -> SpmdError:
    """The error of an output that requires grad on some ranks of a real mesh and not on others
    (``instances``: those where it does not), made by a branch on the block: their backward
    passes would run other collectives and wait on each other."""
    return SpmdError(
        f"spmd_map of {label}: {where} requires grad on some instances but not at "
        f"{instances}: a branch (on a block's size or a value) made it from the inputs on some "
        "instances and from constants on others, and on a real mesh their backward passes "
        "would run other collectives (each waiting on the others). Fix: make every instance's "
        "result depend on the inputs alike (a constant branch as x.new_zeros(...) + x.sum() * 0), "
        "or run the call under torch.no_grad()."
    )
