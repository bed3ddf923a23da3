"""Tensor- and sequence-parallel layers as plain per-device functions (Megatron-LM's layouts).

Call them inside ``spmd_map``; each takes the name of the tensor-parallel axis (``axis_name``, a
name or a tuple of names) and this instance's blocks of the weights, cut by the specs below from
weights in ``torch.nn.functional``'s layout (``linear``: ``[out, in]``; ``embedding``:
``[vocab, dim]``). They are the dense layers on the global values, forward and backward; the
varying / invariant types put the gradient reductions where they belong (an input replicated
over the axis gets its gradient summed by its implicit pvary).

=========================== ===================== ======================== ======================
layer                       weight spec           input (per instance)     output (per instance)
=========================== ===================== ======================== ======================
``column_linear``           ``P(A)``, bias P(A)   whole features           features split over A
``row_linear``              ``P(None, A)``, P()   features split over A    whole features
``vocab_embedding``         ``P(A)``              token ids                embeddings
``vocab_cross_entropy``     (logits split over A  on the last dim)         the loss
=========================== ===================== ======================== ======================

Sequence parallelism: ``gather_sequence`` (entry: all_gather of the sequence dim) and
``reduce_scatter_sequence`` (exit: psum_scatter of partial sums back to sequence blocks), also
built into ``column_linear(gather_dim=...)``, ``row_linear(scatter_dim=...)`` and
``vocab_embedding(scatter_dim=...)``.

A packed weight (q, k and v side by side) split over A as it is hands instance 0 all of q and
none of v: ``interleave_packed`` reorders it so that each block holds its slice of every part
(whole heads, with ``unit=head_dim``), ``split_packed`` splits the activations inside, and
``deinterleave_packed`` is the inverse (for checkpoints).

Example:
    >>> import torch, named_spmd as ns
    >>> from named_spmd import P, parallel as pl
    >>> mesh = ns.make_mesh((2,), ("tp",))
    >>> def mlp(x, w1, b1, w2, b2):
    ...     h = torch.relu(pl.column_linear(x, w1, b1, axis_name="tp"))
    ...     return pl.row_linear(h, w2, b2, axis_name="tp")
    >>> f = ns.spmd_map(mlp, mesh=mesh, in_specs=(P(), P("tp"), P("tp"), P(None, "tp"), P()),
    ...                 out_specs=P())
    >>> x, w1, b1, w2, b2 = torch.randn(3, 4), torch.randn(8, 4), torch.randn(8), torch.randn(4, 8), torch.randn(4)
    >>> dense = torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w1, b1)), w2, b2)
    >>> torch.allclose(f(x, w1, b1, w2, b2), dense, atol=1e-5)
    True
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

from ._calls import current
from ._collectives import all_gather, axis_index, axis_size, pmax, psum, psum_scatter
from ._errors import SpmdError

AxisName = str | tuple[str, ...]


# --- linear layers -------------------------------------------------------------------------------


def column_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    axis_name: AxisName,
    gather_dim: int | None = None,
    gather_output: bool = False,
) -> torch.Tensor:
    """``F.linear`` with the output features split over ``axis_name`` (Megatron's column-parallel
    linear).

    Args:
        x: ``[..., in]``, usually the same on every instance of the axis (its gradient is then
            summed over the axis by the implicit pvary: Megatron's ``f``).
        weight: this instance's rows of the ``[out, in]`` weight (spec ``P(A)``).
        bias: this instance's block of the ``[out]`` bias (spec ``P(A)``), or None.
        gather_dim: sequence-parallel entry: ``x`` holds blocks of dim ``gather_dim`` over the
            axis, all_gathered first (backward: psum_scatter).
        gather_output: all_gather the output features (``[..., out]``, invariant over the axis)
            instead of returning this instance's ``[..., out / n]``.
    """
    if gather_dim is not None:
        x = gather_sequence(x, axis_name, dim=gather_dim)
    y = F.linear(x, weight, bias)
    if gather_output:
        y = all_gather(y, axis_name, axis=y.dim() - 1, tiled=True, to="invariant")
    return y


def row_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    axis_name: AxisName,
    scatter_dim: int | None = None,
) -> torch.Tensor:
    """``F.linear`` whose input features are split over ``axis_name`` (Megatron's row-parallel
    linear): this instance's partial product, summed over the axis, then the bias, added once.

    Args:
        x: ``[..., in / n]``, this instance's features (varying over the axis, as a
            ``column_linear`` output is).
        weight: this instance's columns of the ``[out, in]`` weight (spec ``P(None, A)``).
        bias: the whole ``[out]`` bias (spec ``P()``), added after the sum: added before it,
            it would be counted n times.
        scatter_dim: sequence-parallel exit: psum_scatter the partial sums over dim
            ``scatter_dim`` (each instance keeps its block of it) instead of a psum.
    """
    partial = F.linear(x, weight)
    if scatter_dim is None:
        y = psum(partial, axis_name)
    else:
        y = reduce_scatter_sequence(partial, axis_name, dim=scatter_dim)
    return y if bias is None else y + bias


# --- sequence parallelism ------------------------------------------------------------------------


def gather_sequence(x: torch.Tensor, axis_name: AxisName, *, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel entry: the whole of dim ``dim`` from the axis' blocks of it (a tiled
    all_gather; varying over the axis, as what follows computes per instance). Backward: the
    psum_scatter of the gradient."""
    return all_gather(x, axis_name, axis=_dim(x, dim), tiled=True)


def reduce_scatter_sequence(x: torch.Tensor, axis_name: AxisName, *, dim: int = 1) -> torch.Tensor:
    """Sequence-parallel exit: the sum over the axis of the instances' partial results, each
    instance keeping its block of dim ``dim`` (a tiled psum_scatter). Backward: the all_gather of
    the gradient."""
    return psum_scatter(x, axis_name, scatter_dimension=_dim(x, dim), tiled=True)


def _dim(x: torch.Tensor, dim: int) -> int:
    return dim % x.dim() if x.dim() else dim


# --- vocabulary parallelism ----------------------------------------------------------------------


def vocab_embedding(
    ids: torch.Tensor,
    weight: torch.Tensor,
    *,
    axis_name: AxisName,
    scatter_dim: int | None = None,
) -> torch.Tensor:
    """``F.embedding`` with the vocabulary split over ``axis_name``: each instance looks up the
    ids its rows hold (zeros for the others) and a psum assembles the embeddings.

    Args:
        ids: integer token ids (global ids into the whole vocabulary); an id outside it gives
            a NaN embedding.
        weight: this instance's rows of the ``[vocab, dim]`` table (spec ``P(A)``).
        scatter_dim: sequence-parallel output: psum_scatter over this dim of the result (e.g. 1
            for ``[batch, seq]`` ids) instead of a psum.
    """
    _same_ids(ids, axis_name, "vocab_embedding", "ids")
    rows = weight.shape[0]
    local = ids - axis_index(axis_name) * rows
    mine = (local >= 0) & (local < rows)
    emb = F.embedding(torch.where(mine, local, 0), weight)
    # an id outside the vocabulary is in no instance's rows: NaN rather than a zero embedding
    # (F.embedding raises, which needs the ids' values, read on no backend here)
    outside = (ids < 0) | (ids >= rows * axis_size(axis_name))
    # (scalars, so that the embedding keeps the table's dtype)
    emb = torch.where(mine.unsqueeze(-1), emb, 0)
    emb = torch.where(outside.unsqueeze(-1), torch.nan, emb)
    if scatter_dim is None:
        return psum(emb, axis_name)
    return reduce_scatter_sequence(emb, axis_name, dim=scatter_dim)


def vocab_cross_entropy(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    axis_name: AxisName,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """``F.cross_entropy`` of logits whose last (class) dim is split over ``axis_name`` (the
    output of a ``column_linear`` LM head), without gathering them.

    Numerically stable: the logits are shifted by their maximum over the whole vocabulary (a
    pmax, detached: the log-sum-exp's gradient does not depend on the shift), the exp-sums are
    psum'd, and the target's logit is picked by the instance whose block holds it (a psum of
    that pick and the others' zeros). Where the axis has size 1 (a tp = 1 run of a tensor
    parallel model) it is torch's fused ``F.cross_entropy``, with the same type.

    Args:
        logits: ``[..., vocab / n]``, this instance's classes.
        target: ``[...]`` global class ids; ``ignore_index`` entries count for nothing. An id
            outside the vocabulary gives a NaN loss (split over several instances; on one,
            torch's fused loss raises), whose gradient at that target is zero: check the loss.
        reduction: ``"mean"`` (over the targets not ignored, as ``F.cross_entropy``),
            ``"sum"`` or ``"none"``. The mean is over this instance's targets: with the batch
            split over a data-parallel axis, ``ns.pmean`` it over that axis (equal shards) or
            use ``"sum"`` and divide by the global count.
    """
    if reduction not in ("mean", "sum", "none"):
        raise SpmdError(
            f"vocab_cross_entropy: reduction={reduction!r}; expected 'mean', 'sum' or 'none' "
            "(as F.cross_entropy). Fix: pass one of those."
        )
    _same_ids(target, axis_name, "vocab_cross_entropy", "target")
    if axis_size(axis_name) == 1 and not target.is_floating_point():
        return psum(_whole_vocab_cross_entropy(logits, target, ignore_index, reduction), axis_name)
    classes = logits.shape[-1]
    shift = pmax(logits.detach().amax(-1), axis_name)
    shifted = logits - shift.unsqueeze(-1)
    log_sum_exp = psum(shifted.exp().sum(-1), axis_name).log()
    local = target - axis_index(axis_name) * classes
    mine = (local >= 0) & (local < classes)
    picked = shifted.gather(-1, torch.where(mine, local, 0).unsqueeze(-1)).squeeze(-1)
    target_logit = psum(torch.where(mine, picked, 0), axis_name)
    counted = target != ignore_index
    # a class outside the vocabulary is in no instance's block: its loss would be log_sum_exp
    # alone, a plausible number; NaN instead (torch's fused loss raises, which needs the
    # target's values, read on no backend here)
    outside = counted & ((target < 0) | (target >= classes * axis_size(axis_name)))
    loss = torch.where(counted, log_sum_exp - target_logit, 0)
    loss = torch.where(outside, torch.nan, loss)
    if reduction == "none":
        return loss
    if reduction == "sum":
        return loss.sum()
    return loss.sum() / counted.sum()


def _whole_vocab_cross_entropy(
    logits: torch.Tensor, target: torch.Tensor, ignore_index: int, reduction: str
) -> torch.Tensor:
    """The loss where one instance holds every class (the vocabulary axis has size 1): torch's
    fused ``F.cross_entropy``, a tenth of a small model's step cheaper than the split
    computation's dozen ops. The caller's psum over the axis (no communication at size 1) gives
    it the split computation's type: invariant over the axis, varying over the others."""
    classes = logits.shape[-1]
    target = target if target.dtype == torch.int64 else target.long()
    loss = F.cross_entropy(
        logits.reshape(-1, classes),
        target.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


def _same_ids(ids: torch.Tensor, axis_name: AxisName, layer: str, what: str) -> None:
    """The instances of the vocabulary axis split one lookup by rows: they must agree on the ids
    (ids split over that axis too would be summed across different tokens, silently)."""
    ctx = current(layer)
    if ctx.replaying:  # no types to read: the checked call of the signature ran this check
        return
    names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
    ids_vma = ctx.vma(ids)  # a check only: not a type the program reads (ns.vma)
    varying = [a for a in names if a in ids_vma]
    if varying:
        raise SpmdError(
            f"{layer}: {what} {'vary' if what == 'ids' else 'varies'} over {tuple(varying)}, the "
            "axis the vocabulary is split over; "
            f"every instance of it must see the same {what} (each holds other rows of the "
            f"table). Fix: all_gather them first, e.g. ns.all_gather({what}, {axis_name!r}, "
            "axis=1, tiled=True, to='invariant')"
            + (", and use scatter_dim=1 for a sequence-parallel output." if what == "ids" else ".")
        )


# --- packed weights ------------------------------------------------------------------------------


def interleave_packed(
    weight: torch.Tensor, sizes: Sequence[int], n: int, *, dim: int = 0, unit: int = 1
) -> torch.Tensor:
    """Reorder a packed weight (parts of ``sizes`` concatenated along ``dim``, e.g. q, k and v
    of a fused ``[3 * d, d]`` projection) so that ``n`` equal blocks of ``dim`` (a spec naming an
    axis of size ``n`` there) give block ``i`` the ``i``-th slice of every part, in part order.

    Split as it is, block 0 of a packed qkv weight would hold all of q and none of v: the
    instances would compute wrong heads, silently. ``unit`` (e.g. the head dim) checks that every
    slice holds whole heads. Outside ``spmd_map`` (a global weight); differentiable, so the
    gradient reaches the packed weight in its own layout. Inverse: :func:`deinterleave_packed`.

    Example:
        >>> import torch
        >>> from named_spmd.parallel import interleave_packed
        >>> interleave_packed(torch.arange(8), (4, 2, 2), 2)  # q=0..3, k=4,5, v=6,7
        tensor([0, 1, 4, 6, 2, 3, 5, 7])
    """
    parts = _parts(weight, sizes, n, dim, unit, "interleave_packed")
    return torch.cat([c for i in range(n) for c in (p.chunk(n, dim)[i] for p in parts)], dim)


def deinterleave_packed(
    weight: torch.Tensor, sizes: Sequence[int], n: int, *, dim: int = 0, unit: int = 1
) -> torch.Tensor:
    """The inverse of :func:`interleave_packed`: the parts of ``sizes`` side by side again."""
    _parts(weight, sizes, n, dim, unit, "deinterleave_packed")
    blocks = [b.split([s // n for s in sizes], dim) for b in weight.chunk(n, dim)]
    return torch.cat([b[j] for j in range(len(sizes)) for b in blocks], dim)


def split_packed(
    x: torch.Tensor, sizes: Sequence[int], axis_name: AxisName, *, dim: int = -1
) -> tuple[torch.Tensor, ...]:
    """Inside ``spmd_map``: this instance's block of an interleaved packed tensor (e.g. the
    output of ``column_linear`` with an :func:`interleave_packed` weight) split into its parts;
    ``sizes`` are the global part sizes."""
    n = axis_size(axis_name)
    return x.split([s // n for s in sizes], dim)


def _parts(
    weight: torch.Tensor, sizes: Sequence[int], n: int, dim: int, unit: int, name: str
) -> tuple[torch.Tensor, ...]:
    sizes = tuple(sizes)
    problems = []
    if sum(sizes) != weight.shape[dim]:
        problems.append(
            f"the sizes {sizes} add up to {sum(sizes)}, but dim {dim} of the weight has size "
            f"{weight.shape[dim]}"
        )
    bad = [s for s in sizes if s % (n * unit)]
    if bad:
        what = f"n * unit = {n} * {unit}" if unit != 1 else f"n = {n}"
        problems.append(
            f"part sizes {bad} are not divisible by {what}: the slices would not hold "
            + ("whole heads" if unit != 1 else "equal shares")
        )
    if problems:
        raise SpmdError(
            f"{name}: " + "; ".join(problems) + ". Fix: pass the packed dim's part sizes, e.g. "
            "(d, d, d) for q, k, v of a [3 * d, d] weight, with a head count divisible by n."
        )
    return weight.split(sizes, dim)
