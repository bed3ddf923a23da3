"""The one catalogue of test programs: each with its mesh, specs, arguments, and (where one can be
written) a dense single-device reference.

Every program is written once against a namespace ``o``: the collectives plus a few array helpers.
:data:`NS_OPS` is named_spmd's (``o.tap(v)`` records ``ns.typeof(v)`` on :data:`TAPE` so the
backends can compare per-device types of intermediate values), :data:`REF_OPS` the per-instance
reference's (tests/_reference.py), and tests/_jax.py's ``jax_ops()`` JAX's. Nothing here depends
on the backend that runs a program; tests/test_programs.py runs every program on the simulated,
the abstract (``check``) and the multi-process distributed backend with one test body.

The catalogue merges what were three: the gradient programs of test_gradients.py, the JAX oracle
programs of test_jax_oracle.py and the multi-process programs of programs_dist.py (for worlds of 4
and 8 processes), plus the programs of test_check.py.
"""

from __future__ import annotations

import functools
import itertools
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from _reference import REF

import named_spmd as ns
from named_spmd import P

F64 = torch.float64
TAPE: list[str] = []

COLLECTIVES = (
    "psum pmean pmax pmin all_gather psum_scatter all_to_all ppermute pshuffle pbroadcast "
    "axis_index axis_size pvary pcast"
).split()


def _sum(x, dim=None, keepdim=False):
    return x.sum() if dim is None else x.sum(dim, keepdim=keepdim)


def _mean(x, dim=None, keepdim=False):
    return x.mean() if dim is None else x.mean(dim, keepdim=keepdim)


def _tap(v):
    TAPE.append(repr(ns.typeof(v)))
    return v


def torch_ops(collectives, tap=lambda v: v) -> types.SimpleNamespace:
    """The namespace ``o`` over torch, with the collectives of ``collectives`` (ns or REF)."""
    return types.SimpleNamespace(
        **{name: getattr(collectives, name) for name in COLLECTIVES},
        tap=tap,
        relu=torch.relu,
        tanh=torch.tanh,
        exp=torch.exp,
        log=torch.log,
        rsqrt=torch.rsqrt,
        sum=_sum,
        mean=_mean,
        amax=lambda x, dim: x.amax(dim),
        amin=lambda x, dim: x.amin(dim),
        softmax=lambda x, dim: torch.softmax(x, dim),
        where=torch.where,
        clip=lambda x, lo, hi: x.clamp(lo, hi),
        rows=lambda x, idx: x[torch.tensor(idx)],
        pick=lambda x, idx: x.gather(-1, idx[..., None])[..., 0],
        onehot=lambda i, n, like: (torch.arange(n) == i).to(like.dtype),
        take=lambda x, i, dim=0: x.index_select(dim, i.reshape(1)).squeeze(dim),
        const=lambda v: torch.tensor(v),
        sg=lambda x: x,  # named_spmd's pmax is differentiable; no stop_gradient needed
    )


NS_OPS = torch_ops(ns, _tap)
REF_OPS = torch_ops(REF)


def randn(*shape, seed: int) -> torch.Tensor:
    return torch.randn(tuple(shape), generator=torch.Generator().manual_seed(seed), dtype=F64)


@dataclass(eq=False)  # hashed by identity: runs are cached per program
class Program:
    name: str
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    in_specs: Any
    out_specs: Any
    prog: Callable[..., Any]  # prog(o, *args)
    args: Callable[[], tuple]  # the global arguments (deterministic)
    dense: Callable[..., Any] | None = None  # the single-device reference of the output
    jax: bool = False  # also against jax.shard_map (values; gradients when jax_grad)
    jax_grad: bool = False
    jax_explicit: bool = False  # JAX needs Explicit mesh axes (unreduced / reduced specs)
    check_vma: bool = True
    no_grad: bool = False  # forward only, under torch.no_grad (reductions may work in place)
    pinned_backward: dict | None = None  # {(op, axes): count} of the backward collectives
    backward_comms: bool | None = None  # whether the backward communicates at all
    dtensor_inputs: bool = False  # on the distributed backend, also with DTensor inputs
    distributed: bool = True  # runs on the distributed backend (world = mesh size)
    all_grads_nonzero: bool = False  # every float input's gradient is exercised
    rtol: float = 1e-9
    atol: float = 1e-10

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def __repr__(self) -> str:
        return f"Program({self.name})"


# --- the gradient programs (were test_gradients.py; jax oracle for values and gradients) -------


def dp_step(o, w1, b1, w2, x, y):
    """Data parallel: replicated parameters, sharded batch; w1 is used by two ops."""
    h = o.tanh(x @ w1 + b1)
    pred = (h @ w2)[..., 0] + 0.1 * o.sum(x @ w1, -1)
    return o.tap(o.pmean(o.mean((pred - y) ** 2), "dp"))


def dp_logged_first(o, w1, b1, w2, x, y):
    """:func:`dp_step` after a use of ``w1`` under ``no_grad`` (a logged metric): the implicit
    casts made there (without grad) must not serve the differentiated uses."""
    with torch.no_grad():
        o.sum(x @ w1)
    return dp_step(o, w1, b1, w2, x, y)


def dp_dense(w1, b1, w2, x, y):
    pred = (torch.tanh(x @ w1 + b1) @ w2)[:, 0] + 0.1 * (x @ w1).sum(-1)
    return ((pred - y) ** 2).mean()


def megatron(o, x, w1, b1, w2, b2):
    """Column-parallel then row-parallel MLP with biases: one psum over tp."""
    return o.tap(o.psum(o.tanh(x @ w1 + b1) @ w2, "tp")) + b2


def megatron_dense(x, w1, b1, w2, b2):
    return torch.tanh(x @ w1 + b1) @ w2 + b2


def results_written_under_comm_mode(o, x, w):
    """Writes into the results of collectives (``add_``, ``mul_``, ``neg_``, ``[i] =``), which
    are fresh values, as in JAX, while a ``CommMode`` records (as every catalogue run does: its
    tags sit on the results); tests/dist_worker.py's ``collective_results_written`` without."""
    h = x @ w
    s = o.psum(h, "i")
    s.mul_(2.0)
    m = o.pmax(h, "i")
    m.add_(1.0)
    g = o.all_gather(h, "i", tiled=True, to="invariant")
    g[0] = 0.0
    p = o.ppermute(h, "i", [(k, (k + 1) % 4) for k in range(4)])
    p.neg_()
    return o.tap(o.tanh(s + m) * h + g[:2] + p)


def _results_written_under_comm_mode_dense(x, w):
    hs = (x @ w).chunk(4)
    g = torch.cat(hs)
    g[0] = 0.0
    base = torch.tanh(2.0 * sum(hs) + torch.stack(hs).amax(0) + 1.0)
    return torch.cat([base * hs[k] + g[:2] - hs[k - 1] for k in range(4)])


def seq_parallel_rms(o, x, g, w1, w2):
    """Sequence-parallel block: RMSNorm on the sequence shard, gather it, column/row matmuls,
    reduce-scatter the partial sums back to the sequence shard, residual."""
    normed = x * o.rsqrt(o.mean(x * x, -1, keepdim=True) + 1e-6) * g
    full = o.tap(o.all_gather(normed, "tp", axis=1, tiled=True))
    partial = o.tanh(full @ w1) @ w2
    return x + o.psum_scatter(partial, "tp", scatter_dimension=1, tiled=True)


def seq_parallel_rms_dense(x, g, w1, w2):
    normed = x * torch.rsqrt((x * x).mean(-1, keepdim=True) + 1e-6) * g
    return x + torch.tanh(normed @ w1) @ w2


MOE_PERM = [5, 2, 7, 0, 3, 6, 1, 4]  # local token order after routing (8 tokens per instance)


def moe_routed(o, x, wg, we, tiled):
    """Expert parallel: route each token to an expert, all_to_all there and back, gate."""
    n = o.axis_size("ep")
    t, d = x.shape
    inv = [MOE_PERM.index(i) for i in range(t)]
    dest = o.const([inv[i] // (t // n) for i in range(t)])  # the expert of each token
    routed = o.rows(x, MOE_PERM)  # chunk j of the rows goes to expert j
    if tiled:
        received = o.all_to_all(routed, "ep", 0, 0, tiled=True)  # chunk s from source s
        back = o.all_to_all(o.tanh(received @ we[0]), "ep", 0, 0, tiled=True)
    else:
        received = o.all_to_all(routed.reshape(n, t // n, d), "ep", 0, 0)
        back = o.all_to_all(o.tanh(received @ we[0]), "ep", 0, 0).reshape(t, d)
    gate = o.pick(o.softmax(x @ wg, -1), dest)
    return o.tap(o.rows(back, inv) * gate[:, None])


def moe_routed_dense(x, wg, we):
    t, n = len(MOE_PERM), we.shape[0]
    inv = [MOE_PERM.index(i) for i in range(t)]
    dest = torch.tensor([inv[i] // (t // n) for i in range(t)]).repeat(x.shape[0] // t)
    gate = torch.softmax(x @ wg, -1).gather(-1, dest[:, None])
    return torch.tanh(torch.einsum("td,tde->te", x, we[dest])) * gate


def ring_allreduce_chunked(o, x, axes="r", n_dense=None):
    """Chunked ring all-reduce from ppermute: reduce-scatter, then all-gather, n-1 steps each
    (x is [n * k, ...]: chunk j is rows j*k..)."""
    n, i = o.axis_size(axes), o.axis_index(axes)
    ring = [(j, (j + 1) % n) for j in range(n)]
    chunks = x.reshape(n, -1, *x.shape[1:])
    acc = o.take(chunks, i)
    for k in range(n - 1):  # receive i-1's partial sum of chunk (i-1-k) and add my own
        acc = o.ppermute(acc, axes, ring) + o.take(chunks, (i - 1 - k) % n)
    idx = (i + 1) % n  # acc is now the full sum of chunk i + 1
    onehot = o.onehot(idx, n, x).reshape(n, *([1] * acc.ndim))
    out = onehot * acc[None]
    for _ in range(n - 1):
        acc, idx = o.ppermute(acc, axes, ring), (idx - 1) % n
        out = out + o.onehot(idx, n, x).reshape(n, *([1] * acc.ndim)) * acc[None]
    return o.tap(out.reshape(x.shape))


def ring_pass(o, q, k, v):
    """Ring pass (ring attention without the softmax): k, v blocks travel around the ring."""
    n = o.axis_size("r")
    ring = [(j, (j + 1) % n) for j in range(n)]
    out = o.tanh(q @ k.T) @ v
    for _ in range(n - 1):
        k, v = o.ppermute(k, "r", ring), o.ppermute(v, "r", ring)
        out = out + o.tanh(q @ k.T) @ v
    return o.tap(out)


def ring_pass_dense(q, k, v):
    return torch.tanh(q @ k.T) @ v


def vocab_ce(o, logits, labels, reg):
    """Vocab-parallel cross entropy: pmax for stability, psum of exp-sums and target logits.
    With ``reg``, terms whose gradient flows through pmax and pmin (JAX cannot differentiate)."""
    vloc = logits.shape[-1]
    m = o.pmax(o.sg(o.amax(logits, -1)), "tp")
    sumexp = o.psum(o.sum(o.exp(logits - m[:, None]), -1), "tp")
    local = labels - o.axis_index("tp") * vloc
    inside = (local >= 0) & (local < vloc)
    picked = o.where(inside, o.pick(logits, o.clip(local, 0, vloc - 1)), 0.0)
    loss = o.mean(o.log(sumexp) + m - o.psum(picked, "tp"))
    if reg:
        top = o.pmax(o.amax(logits, -1), "tp")
        bottom = o.pmin(o.amin(logits, -1), "tp")
        loss = loss + 0.1 * o.mean(top * top) - 0.2 * o.mean(bottom)
    return o.tap(o.pmean(loss, "dp"))


def vocab_ce_dense(logits, labels, reg):
    loss = F.cross_entropy(logits, labels)
    if reg:
        top, bottom = logits.amax(-1), logits.amin(-1)
        loss = loss + 0.1 * (top * top).mean() - 0.2 * bottom.mean()
    return loss


def broadcast_leader(o, x, w):
    """Instance 1's block along dp, on every instance (pbroadcast), then a column-parallel layer."""
    lead = o.tap(o.pbroadcast(x, "dp", 1))
    return o.tap(o.tanh(lead @ w) * o.sum(lead))


def broadcast_leader_dense(x, w):
    lead = x.chunk(2)[1]
    return torch.tanh(lead @ w) * lead.sum()


def _labels(b, v, seed):
    return torch.randint(0, v, (b,), generator=torch.Generator().manual_seed(seed))


def _gradient_programs():
    r = randn
    grad = dict(jax=True, jax_grad=True, all_grads_nonzero=True, rtol=1e-10, atol=1e-10)
    yield Program(
        "data_parallel",
        (4,),
        ("dp",),
        (P(), P(), P(), P("dp"), P("dp")),
        P(),
        dp_step,
        lambda: (r(5, 6, seed=1), r(6, seed=2), r(6, 1, seed=3), r(8, 5, seed=4), r(8, seed=5)),
        dp_dense,
        **grad,
    )
    yield Program(
        "data_parallel_used_without_grad_first",
        (4,),
        ("dp",),
        (P(), P(), P(), P("dp"), P("dp")),
        P(),
        dp_logged_first,
        lambda: (r(5, 6, seed=1), r(6, seed=2), r(6, 1, seed=3), r(8, 5, seed=4), r(8, seed=5)),
        dp_dense,
        all_grads_nonzero=True,
        rtol=1e-10,
        atol=1e-10,
    )
    yield Program(
        "results_written_under_comm_mode",
        (4,),
        ("i",),
        (P("i"), P()),
        P("i"),
        results_written_under_comm_mode,
        lambda: (r(8, 3, seed=71), r(3, 3, seed=72)),
        _results_written_under_comm_mode_dense,
        all_grads_nonzero=True,
        rtol=1e-10,
        atol=1e-10,
    )
    yield Program(
        "megatron_mlp",
        (2, 4),
        ("dp", "tp"),
        (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
        P("dp", None),
        megatron,
        lambda: (r(6, 5, seed=6), r(5, 8, seed=7), r(8, seed=8), r(8, 3, seed=9), r(3, seed=10)),
        megatron_dense,
        **grad,
    )
    yield Program(
        "sequence_parallel",
        (2, 2),
        ("dp", "tp"),
        (P("dp", "tp", None), P(), P(None, "tp"), P("tp", None)),
        P("dp", "tp", None),
        seq_parallel_rms,
        lambda: (r(4, 6, 5, seed=11), r(5, seed=12), r(5, 8, seed=13), r(8, 5, seed=14)),
        seq_parallel_rms_dense,
        **grad,
    )
    for tiled in (True, False):
        yield Program(
            f"all_to_all_experts_{'tiled' if tiled else 'untiled'}",
            (2, 4),
            ("dp", "ep"),
            (P(("dp", "ep")), P(), P("ep")),
            P(("dp", "ep")),
            functools.partial(moe_routed, tiled=tiled),
            lambda: (r(64, 3, seed=15), r(3, 4, seed=16), r(4, 3, 3, seed=17)),
            moe_routed_dense,
            **grad,
        )
    yield Program(
        "ring_allreduce",
        (4,),
        ("r",),
        P("r"),
        P("r"),
        ring_allreduce_chunked,
        lambda: (r(32, seed=18),),
        lambda x: x.reshape(4, -1).sum(0).repeat(4),
        **grad,
    )
    yield Program(
        "ring_pass",
        (4,),
        ("r",),
        P("r"),
        P("r"),
        ring_pass,
        lambda: (r(8, 3, seed=19), r(8, 3, seed=20), r(8, 2, seed=21)),
        ring_pass_dense,
        **grad,
    )
    yield Program(
        "pbroadcast_leader",
        (2, 2),
        ("dp", "tp"),
        (P("dp"), P(None, "tp")),
        P(None, "tp"),
        broadcast_leader,
        lambda: (r(6, 5, seed=24), r(5, 4, seed=25)),
        broadcast_leader_dense,
        pinned_backward={("psum", ("tp",)): 2},  # implicit pvarys over tp: lead, sum(lead)
        dtensor_inputs=True,
        **grad,
    )
    for reg in (False, True):
        yield Program(
            "vocab_parallel_ce" + ("_with_pmax_pmin_terms" if reg else ""),
            (2, 2),
            ("dp", "tp"),
            (P("dp", "tp"), P("dp")),
            P(),
            functools.partial(vocab_ce, reg=reg),
            lambda: (r(6, 8, seed=22) * 3, _labels(6, 8, seed=23)),
            functools.partial(vocab_ce_dense, reg=reg),
            **{**grad, "jax_grad": not reg, "jax": not reg},
        )


# --- the JAX oracle programs (were test_jax_oracle.py; values) -----------------------------------


def mlp_relu(o, x, w1, w2):
    """Column-parallel then row-parallel: one psum over tp."""
    return o.tap(o.psum(o.relu(x @ w1) @ w2, "tp"))


def seq_parallel_pair(o, x, w1, w2, tiled):
    """Sequence parallel: gather the sequence, column/row matmuls, reduce-scatter it back."""
    if tiled:
        full = o.all_gather(x, "tp", axis=1, tiled=True)  # [B, S, D]
        return o.psum_scatter(o.tanh(full @ w1) @ w2, "tp", scatter_dimension=1, tiled=True)
    full = o.tap(o.all_gather(x, "tp", axis=1))  # [B, tp, S/tp, D]: untiled, a new dim
    return o.psum_scatter(o.tanh(full @ w1) @ w2, "tp", scatter_dimension=1)


def moe_chunks(o, x, w, tiled):
    """Expert parallel: token chunk j goes to expert j over ep, and comes back."""
    n = o.axis_size("ep")
    if tiled:
        received = o.all_to_all(x, "ep", 0, 0, tiled=True)  # [t, D]: chunk j from member j
        return o.all_to_all(o.relu(received @ w[0]), "ep", 0, 0, tiled=True)
    t, d = x.shape
    received = o.all_to_all(x.reshape(n, t // n, d), "ep", 0, 0)  # [n_src, t/n, D]
    back = o.all_to_all(o.relu(received @ w[0]), "ep", 0, 0)  # [n_expert, t/n, H]
    return o.tap(back.reshape(t, -1))


def moe_chunks_dense(x, w):
    expert = torch.arange(x.shape[0]) % w.shape[0]  # token r of an instance's 4 went to expert r
    return torch.relu(torch.einsum("td,tdh->th", x, w[expert]))


def nested(o, tree, w):
    a, (b, c) = tree["a"], tree["b"]
    return (
        {
            "sum": o.psum(a * w, ("dp", "tp")),
            "gathered": o.all_gather(b, ("tp", "dp"), tiled=True, to="invariant"),
            "indexed": b + o.axis_index(("tp", "dp")),
            "mixed": c * o.sum(a, (0, 1)),
        },
        o.pmax(o.sum(c, 1, keepdim=True), "tp"),
    )


def _ring_dense(sizes, names, axes):
    """Every instance holds the sum over its group of the blocks (the program's contract)."""
    group = (axes,) if isinstance(axes, str) else tuple(axes)

    def dense(x):
        # the instances in mesh order (first axis major): block k of x
        blocks = x.reshape(math.prod(sizes), -1, *x.shape[1:])
        coords = [dict(zip(names, c)) for c in itertools.product(*map(range, sizes))]
        out = []
        for c in coords:
            same = [
                k
                for k, d in enumerate(coords)
                if all(d[a] == c[a] for a in names if a not in group)
            ]
            out.append(sum(blocks[k] for k in same))
        return torch.cat(out)

    return dense


def _jax_programs():
    r = randn
    yield Program(
        "megatron_mlp_relu",
        (2, 4),
        ("dp", "tp"),
        (P("dp", None), P(None, "tp"), P("tp", None)),
        P("dp", None),
        mlp_relu,
        lambda: (r(8, 6, seed=1), r(6, 16, seed=2), r(16, 5, seed=3)),
        lambda x, w1, w2: torch.relu(x @ w1) @ w2,
        jax=True,
    )
    for tiled in (True, False):
        yield Program(
            f"sequence_parallel_pair_{'tiled' if tiled else 'untiled'}",
            (2, 4),
            ("dp", "tp"),
            (P("dp", "tp", None), P(None, "tp"), P("tp", None)),
            P("dp", "tp", None),
            functools.partial(seq_parallel_pair, tiled=tiled),
            lambda: (r(4, 8, 6, seed=4), r(6, 12, seed=5), r(12, 6, seed=6)),
            lambda x, w1, w2: torch.tanh(x @ w1) @ w2,
            jax=True,
        )
    for sizes, names, axes in [
        ((8,), ("i",), "i"),
        ((2, 4), ("dp", "tp"), ("dp", "tp")),
        ((2, 4), ("dp", "tp"), ("tp", "dp")),  # JAX numbers ppermute groups differently
        ((2, 4), ("dp", "tp"), "tp"),
    ]:
        n = math.prod(sizes[names.index(a)] for a in ((axes,) if isinstance(axes, str) else axes))
        yield Program(
            f"ring_allreduce_{'_'.join((axes,) if isinstance(axes, str) else axes)}_of_{len(sizes)}d",
            sizes,
            names,
            P(names),
            P(names),
            functools.partial(ring_allreduce_chunked, axes=axes),
            lambda n=n: (r(8 * n, 3, seed=7),),
            _ring_dense(sizes, names, axes),
            jax=axes != ("tp", "dp"),
        )
    for tiled in (True, False):
        yield Program(
            f"all_to_all_expert_dispatch_{'tiled' if tiled else 'untiled'}",
            (2, 4),
            ("dp", "ep"),
            (P(("dp", "ep")), P("ep")),
            P(("dp", "ep")),
            functools.partial(moe_chunks, tiled=tiled),
            lambda: (r(32, 6, seed=8), r(4, 6, 5, seed=9)),
            moe_chunks_dense,
            jax=True,
        )
    yield Program(
        "nested_pytree_tuple_entries",
        (2, 4),
        ("dp", "tp"),
        ({"a": P(("dp", "tp")), "b": (P(("tp", "dp"), None), P(None, "tp"))}, P()),
        (
            {"sum": P(), "gathered": P(), "indexed": P(("tp", "dp")), "mixed": P("dp", "tp")},
            P("dp"),
        ),
        nested,
        lambda: (
            {"a": r(8, 3, seed=10), "b": (r(16, 2, seed=11), r(4, 8, seed=12))},
            r(3, seed=13),
        ),
        jax=True,
    )
    for src, dst in ((("dp", "tp"), ("tp", "dp")), (("tp", "dp"), ("dp", "tp"))):
        yield Program(
            f"relayout_{''.join(src)}_to_{''.join(dst)}",
            (2, 4),
            ("dp", "tp"),
            P(src),
            P(dst),
            lambda o, x: x,
            lambda: (torch.arange(16, dtype=F64).reshape(8, 2),),
            jax=True,
        )
    for axes in (("a", "c"), ("c", "a"), ("a", "b", "c"), ("c", "b"), "b"):
        names = ("a", "b", "c")
        rest = tuple(a for a in names if a not in axes)
        yield Program(
            f"pmean_pmax_pmin_over_{''.join(axes)}",
            (2, 2, 2),
            names,
            P(("a", "b"), "c"),
            P(rest) if rest else P(),
            lambda o, x, axes=axes: (o.pmean(x, axes), o.pmax(x, axes), o.pmin(x, axes)),
            lambda: (r(4, 6, seed=14),),
            jax=True,
        )


# --- the multi-process programs (were programs_dist.py; worlds of 4 and 8) -----------------------


def mlp_column_row(o, x, w1, w2):
    h = o.tap(o.relu(x @ w1))
    return o.tap(o.psum(h @ w2, "tp"))


def seq_parallel(o, x, w1, w2):
    full = o.tap(o.all_gather(x, "tp", axis=0, tiled=True))
    partial = o.tanh(full @ w1) @ w2
    return o.tap(o.psum_scatter(partial, "tp", scatter_dimension=0, tiled=True)) + x


def ring_allreduce(o, x):
    n = o.axis_size("r")
    ring = [(j, (j + 1) % n) for j in range(n)]
    acc, buf = x, x
    for _ in range(n - 1):
        buf = o.ppermute(buf, "r", ring)
        acc = acc + buf
    return o.tap(acc)


def experts(o, x, we, tiled):
    n = o.axis_size("ep")
    t, d = x.shape
    if tiled:
        received = o.tap(o.all_to_all(x, "ep", 0, 0, tiled=True))
        back = o.all_to_all(o.tanh(received @ we[0]), "ep", 0, 0, tiled=True)
    else:
        received = o.tap(o.all_to_all(x.reshape(n, t // n, d), "ep", 0, 0))
        back = o.all_to_all(o.tanh(received @ we[0]), "ep", 0, 0).reshape(t, d)
    return o.tap(back)


def nested_tuples(o, tree):
    a, (b, c) = tree["a"], tree["bc"]
    ia = o.axis_index(("dp", "tp")).to(a.dtype)
    ib = o.axis_index(("tp", "dp")).to(a.dtype)
    gathered = o.tap(o.all_gather(b, ("tp", "dp"), tiled=True, to="invariant"))
    return {
        "a": o.tap(a * 2 + ia),
        "b": o.tap(b + ib),
        "g": gathered,
        "c": c * o.psum(b.sum(), ("tp", "dp")),
    }


def reductions_over_tuples(o, x):
    return (
        o.tap(o.pmean(x, ("dp", "tp"))),
        o.tap(o.pmax(x, ("tp", "dp"))),
        o.tap(o.pmin(x, ("dp", "tp"))),
        o.tap(o.psum(x, ("tp", "dp"))),
    )


def data_parallel(o, w1, b1, w2, x, y):
    h = torch.tanh(x @ w1 + b1)
    pred = (h @ w2)[:, 0] + 0.1 * (x @ w1).sum(-1)
    return o.tap(o.pmean(((pred - y) ** 2).mean().reshape(1), "dp"))


def vocab_ce_onehot(o, logits, onehot):
    m = o.pmax(logits.amax(-1), "tp")
    sumexp = o.psum(torch.exp(logits - m[:, None]).sum(-1), "tp")
    target = o.psum((logits * onehot).sum(-1), "tp")
    loss = (torch.log(sumexp) + m - target).mean()
    loss = loss + 0.1 * o.pmin(logits.amin(-1), "tp").mean()
    return o.tap(o.pmean(loss.reshape(1), "dp"))


def vocab_ce_onehot_dense(logits, onehot):
    loss = torch.logsumexp(logits, -1) - (logits * onehot).sum(-1)
    return (loss.mean() + 0.1 * logits.amin(-1).mean()).reshape(1)


def reuse_after_psum(o, x):
    """Operands the user still holds after a reduction must not be overwritten by it."""
    named = x * 2
    kept = [x + 1]
    base = x * 3
    view = base[0]
    s = o.psum(named, "i") + o.pmax(kept[0], "i") + o.pmin(base, "i") + o.psum(x * 5, "i")
    m = o.pmean(view, "i")
    return named + kept[0] + base + s + m + x


def _world_programs(world: int):
    r = randn
    tp = 2 if world == 4 else 4
    dp = world // tp
    mesh2 = ((dp, tp), ("dp", "tp"))
    w = f"@{world}"
    yield Program(
        "mlp_column_row" + w,
        *mesh2,
        (P("dp", None), P(None, "tp"), P("tp", None)),
        P("dp", None),
        mlp_column_row,
        lambda: (r(4, 6, seed=1), r(6, 8, seed=2), r(8, 5, seed=3)),
        lambda x, w1, w2: torch.relu(x @ w1) @ w2,
        pinned_backward={("psum", ("dp",)): 2, ("psum", ("tp",)): 1},
        dtensor_inputs=True,
    )
    yield Program(
        "seq_parallel" + w,
        *mesh2,
        (P("tp", None), P(None, "tp"), P("tp", None)),
        P("tp", None),
        seq_parallel,
        lambda: (r(2 * tp, 6, seed=4), r(6, 2 * tp, seed=5), r(2 * tp, 6, seed=6)),
        lambda x, w1, w2: torch.tanh(x @ w1) @ w2 + x,
    )
    yield Program(
        "ring_allreduce" + w,
        (world,),
        ("r",),
        P("r"),
        P("r"),
        ring_allreduce,
        lambda: (r(3 * world, seed=7),),
        lambda x: x.reshape(world, 3).sum(0).repeat(world),
        pinned_backward={("ppermute", ("r",)): world - 1},
    )
    yield Program(
        "nested_tuples" + w,
        *mesh2,
        ({"a": P(("dp", "tp")), "bc": (P(("tp", "dp")), P())},),
        {"a": P(("dp", "tp")), "b": P(("tp", "dp")), "g": P(), "c": P()},
        nested_tuples,
        lambda: ({"a": r(2 * world, 3, seed=8), "bc": (r(world, 3, seed=9), r(5, seed=10))},),
        dtensor_inputs=True,
    )
    yield Program(
        "reductions_over_tuples" + w,
        *mesh2,
        P(("dp", "tp")),
        P(),
        reductions_over_tuples,
        lambda: (torch.round(r(world, 5, seed=11) * 2),),  # rounded: ties in pmax/pmin
        lambda x: (x.mean(0, True), x.amax(0, True), x.amin(0, True), x.sum(0, True)),
    )
    yield Program(
        "data_parallel" + w,
        (world,),
        ("dp",),
        (P(), P(), P(), P("dp"), P("dp")),
        P(),
        data_parallel,
        lambda: (
            r(5, 6, seed=12),
            r(6, seed=13),
            r(6, 1, seed=14),
            r(2 * world, 5, seed=15),
            r(2 * world, seed=16),
        ),
        lambda *a: dp_dense(*a).reshape(1),
        pinned_backward={("psum", ("dp",)): 3},
    )
    yield Program(
        "megatron_biases" + w,
        *mesh2,
        (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
        P("dp", None),
        megatron,
        lambda: (
            r(2 * dp, 5, seed=17),
            r(5, 2 * tp, seed=18),
            r(2 * tp, seed=19),
            r(2 * tp, 3, seed=20),
            r(3, seed=21),
        ),
        megatron_dense,
        dtensor_inputs=True,
    )
    yield Program(
        "vocab_parallel_ce_onehot" + w,
        *mesh2,
        (P("dp", "tp"), P("dp", "tp")),
        P(),
        vocab_ce_onehot,
        lambda: (
            r(2 * dp, 2 * tp, seed=22) * 3,
            F.one_hot(torch.arange(2 * dp) % (2 * tp), 2 * tp).to(F64),
        ),
        vocab_ce_onehot_dense,
    )
    yield Program(
        "ring_pass" + w,
        (world,),
        ("r",),
        P("r"),
        P("r"),
        ring_pass,
        lambda: (r(2 * world, 3, seed=23), r(2 * world, 3, seed=24), r(2 * world, 2, seed=25)),
        ring_pass_dense,
    )
    yield Program(
        "identity_no_backward_comm" + w,
        (world,),
        ("i",),
        P(),
        P(),
        lambda o, x: x,
        lambda: (r(3, seed=26),),
        lambda x: x,
        pinned_backward={},
    )
    yield Program(
        "psum_no_backward_comm" + w,
        (world,),
        ("i",),
        P("i"),
        P(),
        lambda o, x: o.psum(x, "i"),
        lambda: (r(world, 2, seed=27),),
        lambda x: x.reshape(world, 1, 2).sum(0),
        pinned_backward={},
    )
    yield Program(
        "reuse_after_psum_no_grad" + w,
        (world,),
        ("i",),
        P("i"),
        P("i"),
        reuse_after_psum,
        lambda: (r(world, 3, seed=32),),
        no_grad=True,
    )
    yield Program(
        "unchecked_varying_output" + w,
        (world,),
        ("i",),
        P("i"),
        P(),
        lambda o, x: x * 3,
        lambda: (r(world, 2, seed=28),),
        lambda x: x[:1] * 3,  # P() takes instance 0's block
        check_vma=False,
    )
    for tiled in (True, False):
        yield Program(
            f"experts_{'tiled' if tiled else 'untiled'}" + w,
            (dp, tp),
            ("dp", "ep"),
            (P(("dp", "ep")), P("ep")),
            P(("dp", "ep")),
            functools.partial(experts, tiled=tiled),
            lambda: (r(world * tp * 2, 3, seed=29), r(tp, 3, 3, seed=30)),
            pinned_backward={("all_to_all", ("ep",)): 2, ("psum", ("dp",)): 1},
        )
    if world == 8:
        yield Program(
            "reductions_3d" + w,
            (2, 2, 2),
            ("a", "b", "c"),
            P(("c", "a"), "b"),
            P(None, "b"),
            lambda o, x: o.tap(o.pmax(o.psum(x, ("c", "a")) * x, ("a", "c"))),
            lambda: (r(4, 4, seed=31),),
        )


# --- the programs of test_check.py (abstract evaluation against a real run) --------------------


def tp_sp_block(o, x, wqkv, wo, w1, w2):
    """Transformer block, tensor parallel over tp with sequence parallelism (Megatron-SP style).

    x: [b, s/tp, d] (sequence split over tp, batch over dp); attention heads and the MLP hidden
    dim split over tp; all_gather of the sequence before each matmul pair, psum_scatter after."""
    heads = 2
    h = o.all_gather(F.layer_norm(x, x.shape[-1:]), "tp", axis=1, tiled=True)
    q, k, v = (h @ wqkv).chunk(3, dim=-1)
    b, s, _ = q.shape
    q, k, v = (t.reshape(b, s, heads, -1).transpose(1, 2) for t in (q, k, v))
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1)
    x = x + o.psum_scatter(a @ wo, "tp", scatter_dimension=1, tiled=True)
    h = o.all_gather(F.layer_norm(x, x.shape[-1:]), "tp", axis=1, tiled=True)
    return x + o.psum_scatter(F.gelu(h @ w1) @ w2, "tp", scatter_dimension=1, tiled=True)


BLOCK_SPECS = (P("dp", "tp"), P(None, "tp"), P("tp", None), P(None, "tp"), P("tp", None))


def block_shapes(b, s, d, hidden):
    return [(b, s, d), (d, 3 * d), (d, d), (d, hidden), (hidden, d)]


def _seeded(*shapes):
    def args():
        torch.manual_seed(0)
        return tuple(torch.randn(s, dtype=F64) for s in shapes)

    return args


def _check_programs():
    ring = [(i, (i + 1) % 4) for i in range(4)]
    yield Program(
        "block",
        (2, 4),
        ("dp", "tp"),
        BLOCK_SPECS,
        P("dp", "tp"),
        tp_sp_block,
        _seeded(*block_shapes(2, 8, 8, 16)),
        backward_comms=True,
        rtol=1e-8,
        atol=1e-9,
    )
    yield Program(
        "psum_pytree",
        (2, 4),
        ("dp", "tp"),
        (P("dp", "tp"), P("tp")),
        {"y": P("dp"), "n": P("dp")},
        lambda o, x, w: {"y": o.psum(x @ w, "tp"), "n": o.axis_index("dp").reshape(1)},
        _seeded((4, 8), (8, 3)),
        lambda x, w: {"y": x @ w, "n": torch.arange(2)},
        backward_comms=True,  # w (P("tp")) meets x (P("dp", "tp")): its gradient is psummed over dp
    )
    yield Program(
        "all_to_all_moe",
        (4,),
        ("ep",),
        P("ep"),
        P("ep"),
        lambda o, x: o.all_to_all(o.tanh(x), "ep", 0, 1, tiled=True) * 2,
        _seeded((16, 8, 2)),
        backward_comms=True,
    )
    yield Program(
        "untiled_collectives",
        (2, 2),
        ("a", "b"),
        P(("a", "b")),
        P(("a", "b")),
        lambda o, x: o.psum_scatter(o.all_gather(x, ("a", "b")), ("a", "b")).sum(0),
        _seeded((8, 3)),
        lambda x: x.reshape(4, 2, 3).sum(1).reshape(-1) * 4,
        backward_comms=True,
    )
    yield Program(
        "ppermute_pmax_pmean",
        (4,),
        ("i",),
        (P("i"), P()),
        (P(), P()),
        lambda o, x, w: (
            o.pmax(o.ppermute(x * w, "i", ring), "i"),
            o.pmean(o.pshuffle(x, "i", [3, 2, 1, 0]), "i"),
        ),
        _seeded((8, 5), (5,)),
        lambda x, w: ((x * w).reshape(4, 2, 5).amax(0), x.reshape(4, 2, 5).mean(0)),
        backward_comms=True,
    )
    yield Program(
        "all_gather_invariant",
        (4,),
        ("i",),
        (P("i"), P()),
        P(),
        lambda o, x, w: o.all_gather(x, "i", tiled=True, to="invariant") @ w,
        _seeded((8, 5), (5, 2)),
        lambda x, w: x @ w,
        backward_comms=False,
    )


# --- dtypes, ties and accounting the backends once disagreed on -------------------------------


def integer_reductions(o, i8, u8, i32, flags):
    """Reductions keep the operand's dtype; a psum of truth values is their "or"."""
    return (
        o.tap(o.psum(i8, "i")),
        o.tap(o.psum(u8, "i")),
        o.tap(o.psum_scatter(i32, "i", tiled=True)),
        o.tap(o.psum(flags, "i")),
        o.tap(o.pmax(i32, "i")),
    )


def _integer_args():
    gen = torch.Generator().manual_seed(11)
    ints = [torch.randint(0, 30, (8,), generator=gen, dtype=d) for d in (torch.int8, torch.uint8)]
    i32 = torch.randint(-1000, 1000, (16,), generator=gen, dtype=torch.int32)
    return (*ints, i32, torch.tensor([True, False, False, False, False, False, True, False]))


def _integer_dense(i8, u8, i32, flags):
    n = 4
    return (
        i8.reshape(n, 2).sum(0, dtype=torch.int8),
        u8.reshape(n, 2).sum(0, dtype=torch.uint8),
        i32.reshape(n, 4).sum(0, dtype=torch.int32),
        flags.reshape(n, 2).any(0),
        i32.reshape(n, 4).amax(0),
    )


def tied_extrema(o, x):
    """Three of four instances tie: each gets a third of the gradient, over a tuple of axes."""
    return o.tap(o.pmax(x, ("dp", "tp"))), o.tap(o.pmin(-x, ("tp", "dp")))


def tiled_invariant(o, w, x):
    """An output invariant over an axis its out_spec names: the backward sums its blocks'
    cotangents over that axis (one psum, which CommMode reports)."""
    return o.tap(w * 2), o.tap(x + w)


def megatron_dp_mean(o, x, w1, b1, w2, b2, y):
    """Megatron with a data-parallel loss: on a (1, 2) mesh every dp collective is a no-op."""
    err = megatron(o, x, w1, b1, w2, b2) - y
    return o.tap(o.pmean(o.mean(err**2).reshape(1), "dp"))


def _consistency_programs():
    yield Program(
        "integer_reductions",
        (4,),
        ("i",),
        (P("i"), P("i"), P("i"), P("i")),
        (P(), P(), P("i"), P(), P()),
        integer_reductions,
        _integer_args,
        _integer_dense,
        no_grad=True,
    )
    r = randn
    yield Program(
        "size_one_dp",
        (1, 2),
        ("dp", "tp"),
        (P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P(), P("dp", None)),
        P(),
        megatron_dp_mean,
        lambda: (
            (r(6, 5, seed=6), r(5, 8, seed=7), r(8, seed=8), r(8, 3, seed=9), r(3, seed=10))
            + (r(6, 3, seed=11),)
        ),
        lambda x, w1, b1, w2, b2, y: ((megatron_dense(x, w1, b1, w2, b2) - y) ** 2).mean()[None],
        # x's implicit pvary over tp; nothing over dp, which has one instance
        pinned_backward={("psum", ("tp",)): 1},
        all_grads_nonzero=True,
    )
    yield Program(
        "tied_extrema",
        (2, 2),
        ("dp", "tp"),
        P(("dp", "tp")),
        P(),
        tied_extrema,
        lambda: (torch.tensor([[1.0, 2.0], [1.0, 0.0], [1.0, 2.0], [0.5, -1.0]], dtype=F64),),
        lambda x: (x.amax(0, keepdim=True), (-x).amin(0, keepdim=True)),
        all_grads_nonzero=True,
    )
    yield Program(
        "tiled_invariant",
        (4,),
        ("i",),
        (P(), P("i")),
        (P("i"), P("i")),
        tiled_invariant,
        _seeded((3,), (12,)),
        lambda w, x: (w.repeat(4) * 2, x + w.repeat(4)),
        pinned_backward={("psum", ("i",)): 2},
    )


# --- partial sums: unreduced and reduced values (docs/design.md section 2.2) ----------------------


def _blocks(x, n=2):
    return x.reshape(n, -1, *x.shape[1:])


def unreduced_psum(o, x):
    """Each instance's block is a part of one sum; U + U stays unreduced; psum (U -> I)."""
    u = o.tap(o.pcast(x, "i", to="unreduced"))
    v = o.tap(o.pcast(x * x, "i", to="unreduced"))
    return o.tap(o.psum(o.tap(u + v), "i"))


def unreduced_scatter(o, x):
    """psum_scatter of an unreduced value (U -> V; transpose: all_gather to reduced)."""
    return o.tap(o.psum_scatter(o.tap(o.pcast(x, "i", to="unreduced")), "i", tiled=True))


def all_gather_reduced(o, x):
    """all_gather to reduced (V -> R; transpose: psum_scatter of the unreduced cotangent)."""
    return o.tap(o.all_gather(x, "i", tiled=True, to="reduced"))


def unreduced_linear_algebra(o, x, w):
    """-U, U - U, U * scalar, U @ R, sums, views and slicing stay unreduced; the output is
    returned unreduced (summed on the simulated mesh, a Partial DTensor on a real one)."""
    u = o.tap(o.pcast(x, "i", to="unreduced"))
    r = o.tap(o.pcast(w, "i", to="reduced"))
    y = o.tap((-u + 3.0 * u - u * 0.5) @ r)
    z = o.tap(y.T.reshape(-1)[1:].sum(0, keepdim=True))
    return o.tap(z - y.sum().reshape(1)), o.tap(y)


def _unreduced_linear_dense(x, w):
    y = (1.5 * _blocks(x).sum(0)) @ w
    return y.T.reshape(-1)[1:].sum(0, keepdim=True) - y.sum().reshape(1), y


def reduced_weight(o, w, b, x):
    """Data parallel with reduced parameters: R meets V with no backward psum (the gradient
    stays a partial sum); an invariant bias beside a reduced weight is cast to reduced, whose
    backward psum is its one reduction."""
    h = o.tap(o.tap(x @ w) + b)
    return o.tap(o.psum(o.sum(o.tanh(h)).reshape(1), "dp"))


def explicit_preduced(o, w, x):
    """pcast I -> R: its backward is one psum, however many ops use the reduced value."""
    r = o.tap(o.pcast(w, "dp", to="reduced"))
    y = o.tanh(x @ r) + o.exp(x @ r * 0.1)
    return o.tap(o.psum(o.sum(y).reshape(1), "dp"))


def unreduced_as_local(o, x):
    """pcast U -> V: each instance's partial sum taken as its local value (the escape hatch
    for hand-combined partials): nonlinear ops are then allowed."""
    u = o.pcast(x, "i", to="unreduced")
    v = o.tap(o.pcast(u * 2.0, "i", to="varying"))
    return o.tap(o.relu(v))


def unreduced_writes_joins_selects(o, x, c):
    """Linear ops on partial sums that keep them unreduced: a write of a partial sum (and of a
    Python zero) into one (``[i] =``, ``copy_``, ``fill_``, ``zero_``), ``neg_``, a round trip through complex, view_as / expand_as / reshape_as (the
    second operand gives only a shape), cat and stack along a positional dim, and where with an
    invariant condition (JAX's select_n rule), its keyword form and a mask's write of zero. An
    invariant value expanded as a varying one stays invariant (the varying one gives only a
    shape)."""
    u = o.tap(o.pcast(x, "i", to="unreduced"))
    v = o.tap(o.pcast(x * 2.0, "i", to="unreduced"))
    w = u.clone()
    w[0] = v[1]
    w[1] = 0.0
    w.neg_()
    w[2:].copy_(u[:2] * 3.0)
    w[3].fill_(0.0)
    w[:, 0].zero_()
    w[(c > 1.0).expand_as(w)] = 0.0
    w = o.tap(torch.where(condition=c < -1.0, input=v, other=w))
    w = o.tap(w.to(torch.complex128).real)
    s = o.tap(u.sum(0, keepdim=True).expand_as(u))
    j = o.tap(torch.cat([w, s], 1))
    k = o.tap(torch.stack([u.view_as(u), v.reshape(-1).reshape_as(x)], -1))
    z = o.tap(o.where(c > 0, j[:, :3], v))
    c2 = o.tap(c.reshape(1, 3).expand_as(x))
    return o.tap(o.psum(j.sum(1) + k.sum((1, 2)) + z.sum(1), "i") + o.psum(x * c2, "i").sum(1))


def reduced_written(o, w, r):
    """A reduced value written into an invariant tensor, which keeps its type (``[i] =`` and
    ``add_``): the reduced operand is cast to invariant, its cotangent made parts of a sum, so
    the written rows' gradient reaches the reduced input once, the rest the invariant one."""
    t = w.clone()
    t[0] = r[1]
    t.add_(r * 0.5)
    return o.tap(o.tanh(t))


def _reduced_written_dense(w, r):
    return torch.tanh(torch.cat([r[1:2], w[1:]]) + r * 0.5)


def _writes_joins_selects_dense(x, c):
    u = _blocks(x).sum(0)
    v = 2.0 * u
    w = u.clone()
    w[0] = v[1]
    w[1] = 0.0
    w.neg_()
    w[2:].copy_(u[:2] * 3.0)
    w[3].fill_(0.0)
    w[:, 0].zero_()
    w[(c > 1.0).expand_as(w)] = 0.0
    w = torch.where(c < -1.0, v, w)
    j = torch.cat([w, u.sum(0, keepdim=True).expand_as(u)], 1)
    k = torch.stack([u, v], -1)
    z = torch.where(c > 0, j[:, :3], v)
    return j.sum(1) + k.sum((1, 2)) + z.sum(1) + (_blocks(x) * c).sum(0).sum(1)


def _partial_programs():
    r = randn
    # world 2, run on real processes by tests/partial_dist.py (one small launch of its own)
    grad = dict(jax=True, jax_grad=True, jax_explicit=True, all_grads_nonzero=True)
    alone = dict(distributed=False)
    yield Program(
        "unreduced_psum",
        (2,),
        ("i",),
        P("i"),
        P(),
        unreduced_psum,
        lambda: (r(8, 3, seed=61),),
        lambda x: _blocks(x).sum(0) + _blocks(x * x).sum(0),
        pinned_backward={},
        **grad,
        **alone,
    )
    yield Program(
        "unreduced_scatter",
        (2,),
        ("i",),
        P("i"),
        P("i"),
        unreduced_scatter,
        lambda: (r(16, 3, seed=62),),
        lambda x: _blocks(x).sum(0),
        pinned_backward={("all_gather", ("i",)): 1},
        **grad,
        **alone,
    )
    yield Program(
        "all_gather_reduced",
        (2,),
        ("i",),
        P("i"),
        P(reduced={"i"}),
        all_gather_reduced,
        lambda: (r(8, 3, seed=63),),
        lambda x: x,
        pinned_backward={("psum_scatter", ("i",)): 1},
        jax=True,
        jax_explicit=True,
        all_grads_nonzero=True,
        **alone,
    )
    yield Program(
        "unreduced_linear_algebra",
        (2,),
        ("i",),
        (P("i"), P()),
        (P(unreduced={"i"}), P(unreduced={"i"})),
        unreduced_linear_algebra,
        lambda: (r(8, 3, seed=64), r(3, 5, seed=65)),
        _unreduced_linear_dense,
        pinned_backward={("psum", ("i",)): 1},  # w's cast to reduced
        all_grads_nonzero=True,
        **alone,
    )
    yield Program(
        "reduced_weight",
        (2,),
        ("dp",),
        (P(reduced={"dp"}), P(), P("dp")),
        P(),
        reduced_weight,
        lambda: (r(5, 3, seed=66), r(3, seed=67), r(8, 5, seed=68)),
        lambda w, b, x: torch.tanh(x @ w + b).sum().reshape(1),
        pinned_backward={("psum", ("dp",)): 1},  # b's implicit cast to reduced; none for w
        all_grads_nonzero=True,
        **alone,
    )
    yield Program(
        "explicit_preduced",
        (2,),
        ("dp",),
        (P(), P("dp")),
        P(),
        explicit_preduced,
        lambda: (r(5, 3, seed=69), r(8, 5, seed=70)),
        lambda w, x: (torch.tanh(x @ w) + torch.exp(x @ w * 0.1)).sum().reshape(1),
        pinned_backward={("psum", ("dp",)): 1},
        all_grads_nonzero=True,
        **alone,
    )
    yield Program(
        "unreduced_writes_joins_selects",
        (2,),
        ("i",),
        (P("i"), P()),
        P(),
        unreduced_writes_joins_selects,
        lambda: (r(8, 3, seed=72), r(3, seed=73)),
        _writes_joins_selects_dense,
        pinned_backward={("psum", ("i",)): 1},  # c's implicit pvary in x * c2
        all_grads_nonzero=True,
        **alone,
    )
    yield Program(
        "reduced_written",
        (2,),
        ("i",),
        (P(), P(reduced={"i"})),
        P(),
        reduced_written,
        lambda: (r(4, 3, seed=74), r(4, 3, seed=75)),
        _reduced_written_dense,
        pinned_backward={},
        all_grads_nonzero=True,
        **alone,
    )
    yield Program(
        "unreduced_as_local",
        (2,),
        ("i",),
        P("i"),
        P("i"),
        unreduced_as_local,
        lambda: (r(8, 3, seed=71),),
        lambda x: torch.relu(2.0 * x),
        pinned_backward={},
        **alone,
    )


CATALOGUE: list[Program] = [
    *_gradient_programs(),
    *_jax_programs(),
    *_world_programs(4),
    *_world_programs(8),
    *_check_programs(),
    *_consistency_programs(),
    *_partial_programs(),
]
PARTIAL_PROGRAMS = [p.name for p in _partial_programs()]
BY_NAME = {p.name: p for p in CATALOGUE}
assert len(BY_NAME) == len(CATALOGUE), "program names must be unique"
