"""Per-axis randomness: random draws inside spmd_map that differ over named mesh axes.

Torch's own random ops draw one stream on every instance (docs/design.md, section 2.4,
"Randomness"), so a dropout mask drawn with them is the same everywhere. The functions here draw
from a stream of their own, chosen by ``seed`` and by this instance's coordinates along ``over``::

    mask = ns.random.dropout(h, 0.1, over="dp", seed=(step, 3))

differs between the instances of "dp" and is the same along every other axis; its type says so
(``ns.vma(mask) == {"dp"} | ns.vma(h)``). The simulated and the real backend draw the same values
for the same seed, on the same device type.

The recipe, a stable contract: for the coordinates ``c`` of this instance along ``over``, the
draw uses ``torch.Generator(device).manual_seed(k)`` with ``k`` the first 8 bytes (little-endian)
of ``blake2b(f"named_spmd.random|{seed!r}|{pairs}", digest_size=8)``, shifted right by one bit;
``seed`` is the tuple of the seed's parts (an int ``s`` is ``(s,)``) and ``pairs`` is
``"axis=coordinate"`` for every axis of ``over``, sorted by name and joined by ``","`` (empty for
``over=()``). So a draw does not depend on the mesh's sizes, on the axis order, on axes outside
``over``, nor on torch's global generator, which it neither reads nor advances: ``torch.manual_seed``
(per rank or not) changes nothing here.

Draws are functions of their arguments: there is no hidden counter, so a checkpointed region that
recomputes a draw in backward gets the same values. Giving two draws of one call the same seed
would correlate them (two dropout layers with one mask); it is an error outside backward, and the
fix is a seed per draw, e.g. ``seed=(step, layer)``.

Under ``torch.compile`` each instance's draw is one op of the graph (``named_spmd::random_draw``)
that seeds its generator by the same recipe when the graph runs: the same numbers, and an int
seed part that changes every step is a graph input rather than a retrace per step. The reuse
check above runs in eager calls and ``.check()``, not while tracing.
"""

from __future__ import annotations

import hashlib
import numbers
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

from . import _torch_private as torch_private
from ._calls import current
from ._context import SpmdContext
from ._errors import SpmdError
from ._layout import coords_of

SeedPart = int | str
Seed = SeedPart | tuple[SeedPart, ...]
Over = str | Sequence[str]
Size = int | Sequence[int]

_META = torch.device("meta")
# The seeds drawn so far in each running call (the reuse check); gone with the call's context.
_USED: weakref.WeakKeyDictionary[SpmdContext, set[tuple[SeedPart, ...]]] = (
    weakref.WeakKeyDictionary()
)

_SEED_FIX = (
    "Fix: pass a seed that is the same on every instance and different for every draw of a "
    "call, e.g. seed=(step, layer), with step passed into the function as a non-tensor argument."
)


def rand(
    *size: Size,
    over: Over,
    seed: Seed,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``rand(*size, over=A, seed=s) -> T{A}``: uniform on ``[0, 1)``, differing over the axes A.

    ``over`` is an axis name or a tuple of names (``()``: the same draw everywhere); ``seed`` an
    int, a string or a tuple of them, the same on every instance. ``dtype`` / ``device`` as in
    ``torch.rand`` (defaults: torch's default dtype and device).

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2, 2), ("dp", "tp"))
        >>> f = ns.spmd_map(lambda: ns.random.rand(1, over="dp", seed=0), mesh=mesh,
        ...                 in_specs=(), out_specs=ns.P("dp"))
        >>> u = f()
        >>> u.shape, bool(u[0] != u[1])
        (torch.Size([2]), True)

    Backward: none (a constant).
    """
    return _floating_draw("rand", size, over, seed, dtype, device)


def randn(
    *size: Size,
    over: Over,
    seed: Seed,
    dtype: torch.dtype | None = None,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``randn(*size, over=A, seed=s) -> T{A}``: standard normal, differing over the axes A.

    Arguments as in :func:`rand`.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("dp",))
        >>> f = ns.spmd_map(lambda: ns.random.randn(3, over=(), seed=7), mesh=mesh,
        ...                 in_specs=(), out_specs=ns.P())
        >>> f().shape  # over=(): one draw, invariant
        torch.Size([3])

    Backward: none (a constant).
    """
    return _floating_draw("randn", size, over, seed, dtype, device)


def randint(
    low: int,
    high: int,
    size: Size,
    *,
    over: Over,
    seed: Seed,
    dtype: torch.dtype = torch.int64,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """``randint(low, high, size, over=A, seed=s) -> i64[size]{A}``: integers in
    ``[low, high)``, differing over the axes A. Other arguments as in :func:`rand`.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((4,), ("dp",))
        >>> f = ns.spmd_map(lambda: ns.random.randint(0, 10, (2,), over="dp", seed=1),
        ...                 mesh=mesh, in_specs=(), out_specs=ns.P("dp"))
        >>> f().shape
        torch.Size([8])
    """
    if not (_is_int(low) and _is_int(high)) or low >= high:
        ctx = current("ns.random.randint")
        raise SpmdError(
            f"ns.random.randint in {ctx.fn_label}: expected ints low < high, got low={low!r}, "
            f"high={high!r}. Fix: e.g. ns.random.randint(0, 10, size, over=..., seed=...)."
        )
    shape = _shape((size,), "randint")
    return _draw("randint", over, seed, shape, dtype, device, (int(low), int(high)))


def dropout(
    x: torch.Tensor, p: float, *, over: Over, seed: Seed, training: bool = True
) -> torch.Tensor:
    """``dropout(x: T{V}, p, over=A, seed=s) -> T{V ∪ A}``: zero each element with probability
    ``p`` and scale the rest by ``1 / (1 - p)``, with a mask that differs over the axes A.

    The mask is ``rand(x.shape, over=A, seed=s, dtype=float32, device=x.device) >= p``, the same
    for every dtype of ``x``. ``over=()`` keeps one mask on every instance (what a value that
    must stay invariant, such as the output of a row-parallel layer, needs); name the axes over
    which the data differs, e.g. ``over="dp"`` in data parallelism, ``("dp", "tp")`` for
    activations split over tp. ``training=False`` or ``p=0`` return ``x``.

    Example:
        >>> import torch, named_spmd as ns
        >>> mesh = ns.make_mesh((2,), ("dp",))
        >>> f = ns.spmd_map(lambda x: ns.random.dropout(x, 0.5, over="dp", seed=0), mesh=mesh,
        ...                 in_specs=ns.P(), out_specs=ns.P("dp"))
        >>> y = f(torch.ones(1000))
        >>> sorted(set(y.tolist()))  # dropped or scaled by 1 / (1 - p)
        [0.0, 2.0]

    Backward: the cotangent times the same mask, scaled by ``1 / (1 - p)``.
    """
    ctx = current("ns.random.dropout")
    if not isinstance(x, torch.Tensor) or not (x.dtype.is_floating_point or x.dtype.is_complex):
        got = f"a {x.dtype} tensor" if isinstance(x, torch.Tensor) else type(x).__name__
        raise SpmdError(
            f"ns.random.dropout in {ctx.fn_label}: expected a floating-point tensor, got {got}. "
            "Fix: pass the activation to drop out, e.g. ns.random.dropout(h, 0.1, over=..., "
            "seed=...)."
        )
    if isinstance(p, bool) or not isinstance(p, numbers.Real) or not 0.0 <= p <= 1.0:
        raise SpmdError(
            f"ns.random.dropout in {ctx.fn_label}: p must be a probability in [0, 1], got "
            f"{p!r}. Fix: pass the drop probability as a Python float, e.g. p=0.1."
        )
    if not training or p == 0:
        return x
    if p == 1:
        return x * 0  # every element dropped; x * 0 keeps the gradient (zeros), as torch does
    return x * _draw("dropout", over, seed, tuple(x.shape), x.dtype, x.device, (float(p),))


# --- one draw ------------------------------------------------------------------------------------


def _draw(
    op: str,
    over: Over,
    seed: Seed,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str | None,
    params: tuple[Any, ...] = (),
) -> torch.Tensor:
    """``op``'s sample (:func:`_sample`) with this instance's generator: per member of ``over``
    through the backend's ``per_member`` primitive (typed varying over ``over``), or once for
    ``over=()``. Traced by torch.compile, each member's draw is one op of the graph
    (:func:`_compiled_draw`)."""
    ctx = current(f"ns.random.{op}")
    empty = isinstance(over, (tuple, list)) and not over
    axes = () if empty else ctx.check_axes(over, f"ns.random.{op}")
    parts = _seed_parts(ctx, seed, op)
    dev = torch.device(device) if device is not None else _default_device()
    sizes = ctx.mesh.shape

    def make(index: int) -> torch.Tensor:
        if dev.type == "meta":  # a check: shapes only
            return torch.empty(shape, dtype=dtype, device=_META)
        coords = coords_of(index, axes, sizes)
        if torch.compiler.is_compiling():
            return _compiled_draw(op, parts, _pairs(coords), shape, dtype, dev, params)
        generator = torch.Generator(dev).manual_seed(generator_seed(parts, coords))
        # a plain tensor: a user's vmap (around the call or inside it) would batch the draw by
        # its randomness mode, where the recipe makes it a function of seed and coordinates only
        with torch_private.DisableFuncTorch():
            return _sample(op, generator, shape, dtype, dev, params)

    if axes:
        return ctx.per_member(axes, make)
    # one draw for every instance, a plain invariant value built as per_member builds each
    # member's: not a torch op of the user's (the per-instance simulation refuses those)
    with torch_private.DisableTorchFunction():
        return make(0)


def generator_seed(seed: tuple[SeedPart, ...], coords: dict[str, int]) -> int:
    """The generator seed of one draw: the recipe in the module's docstring."""
    return _seed_of(seed, _pairs(coords))


def _pairs(coords: dict[str, int]) -> str:
    return ",".join(f"{a}={c}" for a, c in sorted(coords.items()))


def _seed_of(seed: tuple[SeedPart, ...], pairs: str) -> int:
    digest = hashlib.blake2b(f"named_spmd.random|{seed!r}|{pairs}".encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little") >> 1


def _sample(
    op: str,
    g: torch.Generator,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    d: torch.device,
    params: tuple[Any, ...],
) -> torch.Tensor:
    """One member's draw of ``op`` from generator ``g`` (``params``: randint's bounds,
    dropout's p)."""
    if op == "rand":
        return torch.rand(shape, generator=g, dtype=dtype, device=d)
    if op == "randn":
        return torch.randn(shape, generator=g, dtype=dtype, device=d)
    if op == "randint":
        return torch.randint(params[0], params[1], shape, generator=g, dtype=dtype, device=d)
    # dropout's scaled mask, built whole on the plain per-member tensor (in place, no batching
    # on the simulated mesh): the call then costs one batched op, the product with x
    p = params[0]
    keep = torch.rand(shape, generator=g, device=d).ge_(p)
    return (keep if dtype is torch.float32 else keep.to(dtype)).mul_(1.0 / (1.0 - p))


def _compiled_draw(
    op: str,
    parts: tuple[Any, ...],
    pairs: str,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device,
    params: tuple[Any, ...],
) -> torch.Tensor:
    """One member's draw as one op of a compiled graph (:func:`_make_draw_op`), the same numbers
    as the eager draw. Dynamo cannot trace a ``torch.Generator``; the op makes it when the
    graph runs, from the seed's int parts as graph inputs: an int that changes every step (a
    step counter, which Dynamo makes symbolic after its first change) is read then, not
    specialized at trace time, so the step does not retrace."""
    kinds = "".join("s" if isinstance(p, str) else "i" for p in parts)
    ints = [p for p in parts if not isinstance(p, str)]
    strs = [p for p in parts if isinstance(p, str)]
    low, high = params if op == "randint" else (0, 0)
    p = params[0] if op == "dropout" else 0.0
    _draw_op_made()
    return _DRAW_OP[0](op, kinds, ints, strs, pairs, list(shape), dtype, device, low, high, p)


#: ``named_spmd::random_draw``, once the first compiled draw made it (:func:`_draw_op_made`)
_DRAW_OP: list[Any] = []


@torch_private.trace_constant  # made eagerly at trace time: an eager draw never needs it
def _draw_op_made() -> bool:
    """Make the draw op, once (registering it takes about 15 ms: not at import). Locked:
    non-strict ``torch.export`` reaches it outside Dynamo's compile lock, and two threads
    registering the op at once would destroy each other's library."""
    with _DRAW_OP_LOCK:
        if not _DRAW_OP:
            _DRAW_OP.append(_make_draw_op())
    return True


_DRAW_OP_LOCK = threading.Lock()


def _make_draw_op() -> Any:
    """The custom op of a compiled draw (:func:`_compiled_draw`)."""

    @torch.library.custom_op("named_spmd::random_draw", mutates_args=(), schema=_DRAW_SCHEMA)
    def draw(op, kinds, ints, strs, pairs, shape, dtype, device, low, high, p):
        it, st = iter(ints), iter(strs)
        parts = tuple(next(st) if k == "s" else int(next(it)) for k in kinds)
        g = torch.Generator(device).manual_seed(_seed_of(parts, pairs))
        params = (low, high) if op == "randint" else (p,)
        return _sample(op, g, tuple(shape), dtype, device, params)

    @draw.register_fake
    def _(op, kinds, ints, strs, pairs, shape, dtype, device, low, high, p):
        return torch.empty(shape, dtype=dtype, device=device)

    return draw


_DRAW_SCHEMA = (
    "(str op, str kinds, SymInt[] ints, str[] strs, str pairs, int[] shape, ScalarType dtype, "
    "Device device, int low, int high, float p) -> Tensor"
)


def _seed_parts(ctx: SpmdContext, seed: Seed, op: str) -> tuple[SeedPart, ...]:
    parts = seed if isinstance(seed, tuple) else (seed,)
    if not parts or not all(_is_int(s) or isinstance(s, str) for s in parts):
        raise SpmdError(
            f"ns.random.{op} in {ctx.fn_label}: seed must be an int, a string or a tuple of "
            f"them, got {_seed_text(seed)}"
            + (" (a tensor's value may differ between instances)" if _has_tensor(parts) else "")
            + f". {_SEED_FIX}"
        )
    if torch.compiler.is_compiling():
        # traced: an int part may be symbolic (a step counter), whose value int() would
        # specialize and the reuse check would read; its draws are checked eagerly and by
        # .check(), not here
        return parts
    parts = tuple(s if isinstance(s, str) else int(s) for s in parts)
    if (
        torch_private.current_graph_task_id() == -1
    ):  # a recomputation in backward draws again, rightly
        used = _USED.setdefault(ctx, set())
        if parts in used:
            raise SpmdError(
                f"ns.random.{op} in {ctx.fn_label}: seed {seed!r} was already used by another "
                "draw in this call; the two would draw the same numbers (e.g. one dropout mask "
                f"for two layers). {_SEED_FIX}"
            )
        used.add(parts)
    return parts


def _seed_text(seed: Any) -> str:
    """``seed`` for a message, a tensor as ``<a tensor>``: its repr would read its values, which
    a compiled call's trace does not have (Dynamo would refuse the repr, not name the error)."""
    if isinstance(seed, tuple):
        return "(" + ", ".join(_seed_text(s) for s in seed) + ("," if len(seed) == 1 else "") + ")"
    return "<a tensor>" if isinstance(seed, torch.Tensor) else repr(seed)


def _shape(size: tuple[Any, ...], op: str) -> tuple[int, ...]:
    """``rand(2, 3)``, ``rand((2, 3))`` and ``rand(torch.Size(...))`` alike, as torch."""
    dims: Any = size[0] if len(size) == 1 and not _is_int(size[0]) else size
    shape: tuple[Any, ...] = tuple(dims) if isinstance(dims, (tuple, list)) else (dims,)
    if not all(_is_int(d) and int(d) >= 0 for d in shape):
        ctx = current(f"ns.random.{op}")
        raise SpmdError(
            f"ns.random.{op} in {ctx.fn_label}: size must be non-negative ints, got {size!r}. "
            f"Fix: e.g. ns.random.{op}(4, 8, over=..., seed=...) or a torch.Size."
        )
    return tuple(int(d) for d in shape)


def _floating_draw(
    op: str, size: tuple[Any, ...], over: Over, seed: Seed, dtype: Any, device: Any
) -> torch.Tensor:
    """``rand``'s and ``randn``'s draw: their size and floating-point dtype checked alike."""
    dtype = _floating(dtype, op)
    return _draw(op, over, seed, _shape(size, op), dtype, device)


def _floating(dtype: torch.dtype | None, op: str) -> torch.dtype:
    dtype = torch.get_default_dtype() if dtype is None else dtype
    if not isinstance(dtype, torch.dtype) or not (dtype.is_floating_point or dtype.is_complex):
        ctx = current(f"ns.random.{op}")
        raise SpmdError(
            f"ns.random.{op} in {ctx.fn_label}: dtype must be a floating-point torch.dtype, got "
            f"{dtype!r}. Fix: e.g. dtype=torch.float32, or ns.random.randint for integers."
        )
    return dtype


def _default_device() -> torch.device:
    # Where a torch factory would put it (torch.set_default_device included). Not
    # torch.get_default_device(): it fails under a DeviceContext mode that sets no device.
    return torch.empty(0).device


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _has_tensor(parts: tuple[Any, ...]) -> bool:
    return any(isinstance(s, torch.Tensor) for s in parts)


__all__ = ["dropout", "generator_seed", "rand", "randint", "randn"]
