"""ns.parallel's layers on simulated meshes against the dense torch.nn.functional layers: values
and the gradients of every global input (float64), on tp = 1, 2, 4 and a (dp, tp) = (2, 2) mesh."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P
from named_spmd import parallel as pl

f64 = torch.float64
MESHES = {
    "tp1": ((1,), ("tp",)),
    "tp2": ((2,), ("tp",)),
    "tp4": ((4,), ("tp",)),
    "dp2xtp2": ((2, 2), ("dp", "tp")),
}


@pytest.fixture(params=list(MESHES), ids=list(MESHES))
def mesh(request):
    shape, names = MESHES[request.param]
    return ns.make_mesh(shape, names, simulated=True)


def dp(mesh):
    """The batch axis: 'dp' where the mesh has it (P(None) otherwise)."""
    return "dp" if "dp" in mesh.axis_names else None


def leaves(*xs):
    return [
        x.detach().clone().requires_grad_(x.is_floating_point()) if x is not None else None
        for x in xs
    ]


def assert_same(mapped, dense, args, seed=0):
    """``mapped(*args)`` equals ``dense(*args)``, and so do the gradients of a random linear
    functional of it with respect to every floating-point argument: to float64's rounding of
    sums taken in another order, relative to the largest entry (a gradient of entries near
    800 is off by 2e-11 at its entries near 0 where the split layers sum their parts apart)."""
    a, b = leaves(*args), leaves(*args)
    y, y_ref = mapped(*a), dense(*b)
    torch.testing.assert_close(y, y_ref, rtol=1e-12, atol=_atol(y_ref))
    probe = torch.randn(y_ref.shape, dtype=f64, generator=torch.Generator().manual_seed(seed))
    wrt = [i for i, x in enumerate(a) if x is not None and x.requires_grad]
    g = torch.autograd.grad((y * probe).sum(), [a[i] for i in wrt])
    g_ref = torch.autograd.grad((y_ref * probe).sum(), [b[i] for i in wrt])
    for i, gi, gi_ref in zip(wrt, g, g_ref):
        torch.testing.assert_close(
            gi, gi_ref, rtol=1e-12, atol=_atol(gi_ref), msg=f"gradient of arg {i}"
        )


def _atol(ref: torch.Tensor) -> float:
    return 1e-12 * max(1.0, float(ref.detach().abs().max()))


def randn(*shape):
    return torch.randn(*shape, dtype=f64)


# --- linear --------------------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_column_linear(mesh, bias):
    x, w, b = randn(4, 8, 6), randn(12, 6), randn(12) if bias else None
    d = dp(mesh)
    f = ns.spmd_map(
        lambda x, w, b: pl.column_linear(x, w, b, axis_name="tp"),
        mesh=mesh,
        in_specs=(P(d), P("tp"), P("tp") if bias else None),
        out_specs=P(d, None, "tp"),
    )
    assert_same(f, F.linear, (x, w, b))


def test_column_linear_gathers_output_and_sequence(mesh):
    x, w, b = randn(4, 8, 6), randn(12, 6), randn(12)
    d = dp(mesh)
    f = ns.spmd_map(
        lambda x, w, b: pl.column_linear(x, w, b, axis_name="tp", gather_dim=1, gather_output=True),
        mesh=mesh,
        in_specs=(P(d, "tp"), P("tp"), P("tp")),  # the sequence split over tp on the way in
        out_specs=P(d),
    )
    assert_same(f, F.linear, (x, w, b))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_row_linear_adds_the_bias_once(mesh, bias):
    x, w, b = randn(4, 8, 12), randn(6, 12), randn(6) if bias else None
    d = dp(mesh)
    f = ns.spmd_map(
        lambda x, w, b: pl.row_linear(x, w, b, axis_name="tp"),
        mesh=mesh,
        in_specs=(P(d, None, "tp"), P(None, "tp"), P()),
        out_specs=P(d),
    )
    assert_same(f, F.linear, (x, w, b))


def test_row_linear_scatters_the_sequence(mesh):
    x, w, b = randn(4, 8, 12), randn(6, 12), randn(6)
    d = dp(mesh)
    f = ns.spmd_map(
        lambda x, w, b: pl.row_linear(x, w, b, axis_name="tp", scatter_dim=1),
        mesh=mesh,
        in_specs=(P(d, None, "tp"), P(None, "tp"), P()),
        out_specs=P(d, "tp"),
    )
    assert_same(f, F.linear, (x, w, b))


def test_sequence_entry_and_exit_are_gather_and_sum(mesh):
    n = mesh.shape["tp"]
    x, parts = randn(4, 8, 3), randn(4, n, 8, 3)  # parts[:, i]: instance i's partial result
    d = dp(mesh)
    gather = ns.spmd_map(  # every instance holds the whole sequence: n copies side by side
        lambda x: pl.gather_sequence(x, "tp"),
        mesh=mesh,
        in_specs=P(d, "tp"),
        out_specs=P(d, "tp"),
    )
    assert_same(gather, lambda x: x.repeat(1, n, 1), (x,))
    scatter = ns.spmd_map(
        lambda p: pl.reduce_scatter_sequence(p.squeeze(1), "tp", dim=1),
        mesh=mesh,
        in_specs=P(d, "tp"),
        out_specs=P(d, "tp"),
    )
    assert_same(scatter, lambda p: p.sum(1), (parts,))


# --- vocabulary ---------------------------------------------------------------------------------


def _mapped_embedding(mesh, scatter: bool):
    """``pl.vocab_embedding`` over tp (the ids split over dp where the mesh has it)."""
    d = dp(mesh)
    return ns.spmd_map(
        lambda ids, w: pl.vocab_embedding(
            ids, w, axis_name="tp", scatter_dim=1 if scatter else None
        ),
        mesh=mesh,
        in_specs=(P(d), P("tp")),
        out_specs=P(d, "tp") if scatter else P(d),
    )


@pytest.mark.parametrize("scatter", [False, True], ids=["psum", "sequence"])
def test_vocab_embedding(mesh, scatter):
    vocab, dim = 16, 5
    ids = torch.randint(0, vocab, (4, 8), generator=torch.Generator().manual_seed(1))
    ids[0, : vocab // 2] = torch.arange(0, vocab, 2)  # every block of the table is hit
    w = randn(vocab, dim)
    assert_same(_mapped_embedding(mesh, scatter), F.embedding, (ids, w))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_vocab_embedding_keeps_the_tables_dtype(mesh, dtype):
    vocab, dim = 8, 3
    ids = torch.tensor([[1, vocab, 5, vocab - 1]] * 2)
    w = randn(vocab, dim).to(dtype)
    y = _mapped_embedding(mesh, False)(ids, w)
    assert y.dtype == dtype
    good = torch.tensor([0, 2, 3])
    torch.testing.assert_close(y[:, good], F.embedding(ids[:, good], w))


@pytest.mark.parametrize("scatter", [False, True], ids=["psum", "sequence"])
def test_vocab_embedding_of_an_id_outside_the_vocabulary_is_nan(mesh, scatter):
    """No instance holds such an id's row: NaN, not a zero embedding (F.embedding raises);
    the other ids' embeddings and the table's gradient are the dense ones."""
    vocab, dim = 8, 3
    ids = torch.tensor([[1, vocab, -1, vocab - 1]] * 2)
    w = randn(vocab, dim).requires_grad_()
    y = _mapped_embedding(mesh, scatter)(ids, w)
    assert torch.isnan(y).any(-1).tolist() == [[False, True, True, False]] * 2, y
    good = torch.tensor([0, 3])
    dense = F.embedding(ids[:, good], w)
    torch.testing.assert_close(y[:, good], dense)
    (y.nan_to_num(0.0) * 2).sum().backward()
    want = torch.autograd.grad((dense * 2).sum(), w)[0]
    torch.testing.assert_close(w.grad, want)


def targets(shape, vocab, seed=2):
    t = torch.randint(0, vocab, shape, generator=torch.Generator().manual_seed(seed))
    t.view(-1)[::5] = -100  # ignored
    t.view(-1)[1] = vocab - 1  # the last block's last class
    return t


@pytest.mark.parametrize("scale", [1.0, 1e4], ids=["plain", "huge_logits"])
def test_vocab_cross_entropy_per_token(mesh, scale):
    vocab = 16
    logits, t = randn(4, 6, vocab) * scale, targets((4, 6), vocab)
    d = dp(mesh)
    f = ns.spmd_map(
        lambda z, t: pl.vocab_cross_entropy(z, t, axis_name="tp", reduction="none"),
        mesh=mesh,
        in_specs=(P(d, None, "tp"), P(d)),
        out_specs=P(d),
    )

    def dense(z, t):
        return F.cross_entropy(z.reshape(-1, vocab), t.reshape(-1), reduction="none").view(t.shape)

    assert_same(f, dense, (logits, t))


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_vocab_cross_entropy_reduced(mesh, reduction):
    vocab = 16
    logits, t = randn(12, vocab), targets((12,), vocab)

    def per_device(z, t):
        if "dp" not in mesh.axis_names:
            return pl.vocab_cross_entropy(z, t, axis_name="tp", reduction=reduction)
        # over a dp-split batch: the sum over dp, divided by the global count for the mean
        total = ns.psum(pl.vocab_cross_entropy(z, t, axis_name="tp", reduction="sum"), "dp")
        return total / ns.psum((t != -100).sum(), "dp") if reduction == "mean" else total

    f = ns.spmd_map(per_device, mesh=mesh, in_specs=(P(dp(mesh), "tp"), P(dp(mesh))), out_specs=P())
    assert_same(f, lambda z, t: F.cross_entropy(z, t, reduction=reduction), (logits, t))


def test_vocab_cross_entropy_of_a_class_outside_the_vocabulary_is_nan(mesh):
    """No instance holds such a class: the split loss would be the log-sum-exp alone, a
    plausible number; it is NaN there (torch's fused loss, on a tp of size 1, raises)."""
    vocab = 16
    logits, t = randn(4, vocab), torch.tensor([3, vocab, -100, -1])
    d = dp(mesh)
    f = ns.spmd_map(
        lambda z, t: pl.vocab_cross_entropy(z, t, axis_name="tp", reduction="none"),
        mesh=mesh,
        in_specs=(P(d, "tp"), P(d)),
        out_specs=P(d),
    )
    if mesh.shape["tp"] == 1:
        with pytest.raises(IndexError):
            f(logits, t)
        return
    loss = f(logits, t)
    assert torch.isnan(loss).tolist() == [False, True, False, True], loss
    want = F.cross_entropy(logits[:1], t[:1], reduction="none")
    torch.testing.assert_close(loss[:1], want)
    assert loss[2] == 0


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_vocab_cross_entropy_on_a_size_one_axis_is_typed_as_when_split(reduction):
    """Where tp has size 1 the loss is torch's fused one (its values and gradients: the tests
    above on the tp1 mesh): its type, dtype and shape are those of the split computation on a
    mesh where tp has size 2; int32 targets work on both paths."""
    vocab = 16
    logits, t = randn(8, vocab), targets((8,), vocab).to(torch.int32)
    seen = {}
    for tp in (1, 2):
        mesh = ns.make_mesh((2, tp), ("dp", "tp"), simulated=True)

        def per_device(z, t, tp=tp):
            loss = pl.vocab_cross_entropy(z, t, axis_name="tp", reduction=reduction)
            seen[tp] = ns.typeof(loss)
            return loss if reduction == "none" else ns.psum(loss, "dp")

        out = P("dp") if reduction == "none" else P()
        f = ns.spmd_map(per_device, mesh=mesh, in_specs=(P("dp", "tp"), P("dp")), out_specs=out)
        if reduction == "none":
            dense = F.cross_entropy(logits, t.long(), reduction="none")
            torch.testing.assert_close(f(logits, t), dense, rtol=1e-12, atol=1e-12)
        else:
            f(logits, t)
    assert seen[1] == seen[2], seen


def test_vocab_layers_refuse_ids_split_over_the_vocabulary_axis():
    mesh = ns.make_mesh((2,), ("tp",), simulated=True)
    ids = torch.randint(0, 8, (2, 4))
    emb = ns.spmd_map(
        lambda ids, w: pl.vocab_embedding(ids, w, axis_name="tp"),
        mesh=mesh,
        in_specs=(P(None, "tp"), P("tp")),  # a sequence-split ids: wrong
        out_specs=P(None, "tp"),
    )
    with pytest.raises(ns.SpmdError) as e:
        emb(ids, randn(8, 3))
    assert "vocab_embedding: ids vary over ('tp',), the axis the vocabulary is split" in str(
        e.value
    )
    assert "Fix: all_gather them first" in str(e.value)
    ce = ns.spmd_map(
        lambda z, t: pl.vocab_cross_entropy(z, t, axis_name="tp", reduction="none"),
        mesh=mesh,
        in_specs=(P(None, None, "tp"), P(None, "tp")),
        out_specs=P(None, "tp"),
    )
    with pytest.raises(ns.SpmdError, match="vocab_cross_entropy: target varies over"):
        ce(randn(2, 4, 8), ids)


def test_vocab_cross_entropy_refuses_an_unknown_reduction():
    mesh = ns.make_mesh((2,), ("tp",), simulated=True)
    f = ns.spmd_map(
        lambda z, t: pl.vocab_cross_entropy(z, t, axis_name="tp", reduction="avg"),
        mesh=mesh,
        in_specs=(P(None, "tp"), P()),
        out_specs=P(),
    )
    with pytest.raises(ns.SpmdError, match="reduction='avg'; expected 'mean', 'sum' or 'none'"):
        f(randn(3, 4), torch.zeros(3, dtype=torch.long))


# --- packed qkv ---------------------------------------------------------------------------------


def attention(x, wqkv, bqkv, wo, bo, heads, sizes):
    """Causal multi-head attention with grouped kv heads; ``heads`` = (q heads, kv heads)."""
    b, s, _ = x.shape
    q, k, v = F.linear(x, wqkv, bqkv).split(sizes, -1)
    return _attend(q, k, v, heads, b, s) @ wo.T + bo


def _attend(q, k, v, heads, b, s):
    hq, hkv = heads
    hd = q.shape[-1] // hq
    q = q.reshape(b, s, hq, hd).transpose(1, 2)
    k, v = (
        t.reshape(b, s, hkv, hd).transpose(1, 2).repeat_interleave(hq // hkv, 1) for t in (k, v)
    )
    scores = q @ k.transpose(-1, -2) / math.sqrt(hd)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1)
    return (probs @ v).transpose(1, 2).reshape(b, s, hq * hd)


@pytest.mark.parametrize("heads", [(4, 4), (8, 4)], ids=["mha", "gqa"])
def test_packed_qkv_split_by_head_group(mesh, heads):
    n = mesh.shape["tp"]
    hd, (hq, hkv) = 3, heads
    dim = hq * hd
    sizes = (hq * hd, hkv * hd, hkv * hd)
    x, wqkv, bqkv = randn(2, 5, dim), randn(sum(sizes), dim), randn(sum(sizes))
    wo, bo = randn(dim, dim), randn(dim)
    d = dp(mesh)

    def per_device(x, wqkv, bqkv, wo, bo):
        qkv = pl.column_linear(x, wqkv, bqkv, axis_name="tp")
        q, k, v = pl.split_packed(qkv, sizes, "tp")
        o = _attend(q, k, v, (hq // n, hkv // n), x.shape[0], x.shape[1])
        return pl.row_linear(o, wo, bo, axis_name="tp")

    f = ns.spmd_map(
        per_device,
        mesh=mesh,
        in_specs=(P(d), P("tp"), P("tp"), P(None, "tp"), P()),
        out_specs=P(d),
    )

    def mapped(x, wqkv, bqkv, wo, bo):  # the gradients reach the packed weights' own layout
        pack = [pl.interleave_packed(t, sizes, n, dim=0, unit=hd) for t in (wqkv, bqkv)]
        return f(x, *pack, wo, bo)

    args = (x, wqkv, bqkv, wo, bo)
    assert_same(mapped, lambda *a: attention(*a, heads, sizes), args)
    if n > 1:  # the trap: split as it is, instance 0 gets q only and the result is wrong
        wrong = f(x, wqkv, bqkv, wo, bo)
        assert not torch.allclose(wrong, attention(*args, heads, sizes))


def test_interleave_round_trips_and_checks_whole_heads():
    w = randn(24, 4)
    for dim, t in ((0, w), (1, w.T)):
        packed = pl.interleave_packed(t, (12, 6, 6), 3, dim=dim, unit=2)
        assert torch.equal(pl.deinterleave_packed(packed, (12, 6, 6), 3, dim=dim, unit=2), t)
        # block i along dim holds the i-th third of every part
        blocks = packed.chunk(3, dim)
        parts = t.split((12, 6, 6), dim)
        for i, blk in enumerate(blocks):
            want = torch.cat([p.chunk(3, dim)[i] for p in parts], dim)
            assert torch.equal(blk, want)
    with pytest.raises(ns.SpmdError) as e:
        pl.interleave_packed(w, (12, 6, 6), 2, unit=6)
    assert "part sizes [6, 6] are not divisible by n * unit = 2 * 6" in str(e.value)
    assert "whole heads" in str(e.value) and "Fix:" in str(e.value)
    with pytest.raises(ns.SpmdError, match="add up to 20, but dim 0 of the weight has size 24"):
        pl.deinterleave_packed(w, (10, 5, 5), 5)


# --- a small GPT, every layer together ------------------------------------------------------------

GPT = dict(vocab=16, dim=8, hidden=16, heads=(4, 4), hd=2, batch=4, seq=8)
GPT_NAMES = ("emb", "wqkv", "wo", "w1", "b1", "w2", "b2", "head_w")


def gpt_inputs():
    """(ids, target, params): the same on every process (one seeded generator)."""
    vocab, dim, hidden = GPT["vocab"], GPT["dim"], GPT["hidden"]
    g = torch.Generator().manual_seed(5)

    def r(*shape, scale=1.0):
        return torch.randn(*shape, dtype=f64, generator=g) * scale

    ids = torch.randint(0, vocab, (GPT["batch"], GPT["seq"]), generator=g)
    params = dict(
        emb=r(vocab, dim),
        wqkv=r(3 * dim, dim, scale=dim**-0.5),
        wo=r(dim, dim, scale=dim**-0.5),
        w1=r(hidden, dim, scale=dim**-0.5),
        b1=r(hidden, scale=0.1),
        w2=r(dim, hidden, scale=hidden**-0.5),
        b2=r(dim, scale=0.1),
        head_w=r(vocab, dim, scale=dim**-0.5),
    )
    return ids, targets((GPT["batch"], GPT["seq"]), vocab), params


def gpt_dense(ids, target, emb, wqkv, wo, w1, b1, w2, b2, head_w):
    x = F.embedding(ids, emb)
    sizes = (x.shape[-1],) * 3
    h = F.layer_norm(x, x.shape[-1:])
    zero = torch.zeros(wqkv.shape[0], dtype=f64)
    x = x + attention(h, wqkv, zero, wo, 0.0, GPT["heads"], sizes)
    h = F.layer_norm(x, x.shape[-1:])
    x = x + F.linear(F.gelu(F.linear(h, w1, b1)), w2, b2)
    logits = F.linear(F.layer_norm(x, x.shape[-1:]), head_w)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="sum"
    )


#: specs of the parameters (wqkv interleaved by gpt_packed first)
GPT_SPECS = dict(
    emb=P("tp"),  # vocabulary parallel
    wqkv=P("tp"),  # column parallel, by head group
    wo=P(None, "tp"),  # row parallel
    w1=P("tp"),
    b1=P("tp"),
    w2=P(None, "tp"),
    b2=P(),
    head_w=P("tp"),  # column parallel LM head: logits split over the vocabulary
)


def gpt_packed(params: dict, n: int) -> dict:
    """The parameters with wqkv interleaved for a tp axis of size n (differentiable)."""
    dim = params["wqkv"].shape[1]
    wqkv = pl.interleave_packed(params["wqkv"], (dim,) * 3, n, unit=GPT["hd"])
    return dict(params, wqkv=wqkv)


def gpt_step(mesh):
    """The GPT's loss on ``mesh`` in the sequence-parallel layout of tutorial 06 (activations
    split over the sequence between layers): ``f(ids, target, packed params) -> summed loss``."""
    n, d = mesh.shape["tp"], dp(mesh)
    heads = (GPT["heads"][0] // n, GPT["heads"][1] // n)

    def per_device(ids, target, p):
        x = pl.vocab_embedding(ids, p["emb"], axis_name="tp", scatter_dim=1)  # [b, s/tp, d]
        h = F.layer_norm(x, x.shape[-1:])
        qkv = pl.column_linear(h, p["wqkv"], axis_name="tp", gather_dim=1)
        q, k, v = pl.split_packed(qkv, (GPT["dim"],) * 3, "tp")
        o = _attend(q, k, v, heads, q.shape[0], q.shape[1])
        x = x + pl.row_linear(o, p["wo"], axis_name="tp", scatter_dim=1)
        h = F.layer_norm(x, x.shape[-1:])
        u = F.gelu(pl.column_linear(h, p["w1"], p["b1"], axis_name="tp", gather_dim=1))
        x = x + pl.row_linear(u, p["w2"], p["b2"], axis_name="tp", scatter_dim=1)
        h = pl.gather_sequence(F.layer_norm(x, x.shape[-1:]), "tp")
        logits = pl.column_linear(h, p["head_w"], axis_name="tp")
        loss = pl.vocab_cross_entropy(logits, target, axis_name="tp", reduction="sum")
        return ns.psum(loss, "dp") if d else loss

    return ns.spmd_map(per_device, mesh=mesh, in_specs=(P(d), P(d), GPT_SPECS), out_specs=P())


def test_gpt_with_tensor_and_sequence_parallel_layers_matches_dense(mesh):
    """Embedding -> attention -> MLP -> LM head -> loss with every ns.parallel layer."""
    ids, target, params = gpt_inputs()
    step, n = gpt_step(mesh), mesh.shape["tp"]

    def mapped(ids, target, *ps):
        return step(ids, target, gpt_packed(dict(zip(GPT_NAMES, ps)), n))

    assert_same(mapped, gpt_dense, (ids, target, *params.values()))


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(pl, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_each_layer_communicates_what_megatron_does():
    """Forward and backward collectives over tp per call (CommMode), from the types alone: the
    cross entropy's max shift needs no backward communication, the row-parallel bias none."""
    mesh = ns.make_mesh((2,), ("tp",), simulated=True)
    x, z, ids = randn(2, 4, 8), randn(2, 4, 8), torch.randint(0, 8, (2, 4))
    w, b = randn(8, 8), randn(8)
    cases = {
        "column": (
            lambda x, w, b: pl.column_linear(x, w, b, axis_name="tp"),
            (P(), P("tp"), P("tp")),
            P(None, None, "tp"),
            (x, w, b),
            {"backward psum": 1},  # the replicated input's gradient (Megatron's f)
        ),
        "row": (
            lambda x, w, b: pl.row_linear(x, w, b, axis_name="tp"),
            (P(None, None, "tp"), P(None, "tp"), P()),
            P(),
            (x, w, b),
            {"forward psum": 1},  # Megatron's g; the bias adds nothing
        ),
        "embedding": (
            lambda ids, w: pl.vocab_embedding(ids, w, axis_name="tp"),
            (P(), P("tp")),
            P(),
            (ids, w),
            {"forward psum": 1},
        ),
        "cross_entropy": (
            lambda z, t: pl.vocab_cross_entropy(z, t, axis_name="tp"),
            (P(None, None, "tp"), P()),
            P(),
            (z, ids),
            {"forward pmax": 1, "forward psum": 2},
        ),
    }
    for name, (fn, in_specs, out_specs, args, want) in cases.items():
        f = ns.spmd_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        args = leaves(*args)
        with ns.CommMode() as comms:
            f(*args).sum().backward()
        got = {f"{e.direction} {e.op}": comms.count(e.op, "tp", e.direction) for e in comms.events}
        assert got == want, (name, comms.summary())
