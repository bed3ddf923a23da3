"""Unreduced values inferred from the specs (named_spmd/_blocks.py, docs/design.md section 2.3).

Each program records ``ns.typeof`` of one value inside the function, on the simulated mesh and in
``.check()`` (the abstract backend); both must give the expected type. The inferred cases contract
a dim split over an axis on both operands, through views, transposes, elementwise ops and the
several spellings of a product; the silent cases are where the inference must not guess (ring
attention's product keeps the ring axis in a dim, sums and means of one operand, slices of a
block, ops it does not follow). The bugs the inference catches, with pinned messages on all
three backends, are tests/_partial_cases.py's ``inferred_*`` errors (tests/test_partial_sums.py).
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P

F64 = torch.float64
MESH = ns.make_mesh((2, 2), ("dp", "tp"))


def _typeof(body, in_specs, *shapes) -> list[str]:
    """``repr(ns.typeof(...))`` of the value ``body`` returns, on the simulated and abstract
    backends (the function itself returns an invariant dummy, so any type is accepted)."""
    seen: list[str] = []

    def f(*args):
        seen.append(repr(ns.typeof(body(*args))))
        return torch.zeros(1, dtype=F64)

    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen, dtype=F64) for s in shapes]
    mapped = ns.spmd_map(f, mesh=MESH, in_specs=in_specs, out_specs=P())
    mapped(*args)
    mapped.check(*args)
    return seen


ROW = (P("dp", "tp"), P("tp", None))  # x[b/dp, h/tp] @ w[h/tp, d]
INFERRED = {
    "matmul": (lambda x, w: x @ w, ROW, (4, 8), (8, 3), "f64[2,3]{dp, U:tp}"),
    "through_relu_and_dropout": (
        lambda x, w: F.dropout(torch.relu(x * 2.0 + 1.0), 0.0) @ w,
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,3]{dp, U:tp}",
    ),
    "transposed_weight": (
        lambda x, w: x @ w.T,
        (P("dp", "tp"), P(None, "tp")),
        (4, 8),
        (3, 8),
        "f64[2,3]{dp, U:tp}",
    ),
    "linear_without_bias": (
        lambda x, w: F.linear(x, w),
        (P("dp", "tp"), P(None, "tp")),
        (4, 8),
        (3, 8),
        "f64[2,3]{dp, U:tp}",
    ),
    "mm": (lambda x, w: torch.mm(x, w), ROW, (4, 8), (8, 3), "f64[2,3]{dp, U:tp}"),
    "einsum": (
        lambda x, w: torch.einsum("bh,hd->bd", x, w),
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,3]{dp, U:tp}",
    ),
    "einsum_implicit_output": (
        lambda x, w: torch.einsum("bh,hd", x, w),
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,3]{dp, U:tp}",
    ),
    "einsum_implicit_output_in_letter_order": (  # the letters once given, sorted: "bz"
        lambda x, w: torch.einsum("zh,hb", x, w),
        ROW,
        (4, 8),
        (8, 3),
        "f64[3,2]{dp, U:tp}",
    ),
    "split_dim_viewed_then_transposed": (  # local [2, 4] viewed [2, 2, 2]: tp goes to the major
        lambda x, w: x.view(2, 2, 2).transpose(1, 2) @ w,  # factor, moved last, contracted
        (P("dp", "tp"), P("tp", None)),
        (4, 8),
        (4, 3),
        "f64[2,2,3]{dp, U:tp}",
    ),
    "bmm_batch_and_contraction": (
        lambda x, w: torch.bmm(x, w),
        (P(None, None, "tp"), P(None, "tp", None)),
        (2, 3, 8),
        (2, 8, 5),
        "f64[2,3,5]{U:tp}",
    ),
    "broadcast_matmul": (
        lambda x, w: x.unsqueeze(0) @ w.expand(2, -1, -1),
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,2,3]{dp, U:tp}",
    ),
    "two_axes_on_one_dim": (
        lambda x, w: x @ w,
        (P(None, ("dp", "tp")), P(("dp", "tp"), None)),
        (3, 8),
        (8, 2),
        "f64[3,2]{U:dp,tp}",
    ),
    "reshape_merging_split_dims": (
        lambda x, w: x.reshape(3, -1) @ w,
        (P(None, "tp", None), P("tp", None)),
        (3, 4, 2),
        (8, 5),
        "f64[3,5]{U:tp}",
    ),
}


def _attention_out(q, k, v, w_o):  # heads split over tp: the output projection is row-parallel
    a = F.scaled_dot_product_attention(q, k, v)  # [b, h, s, dh]
    return a.transpose(1, 2).reshape(a.shape[0], a.shape[2], -1) @ w_o


SILENT = {
    # ring attention: the query dim stays split over the ring axis
    "product_keeping_the_axis_in_a_dim": (
        lambda q, k: q @ k.T,
        (P("tp", None), P("tp", None)),
        (8, 3),
        (8, 3),
        "f64[4,4]{tp}",
    ),
    "sum_of_one_operand": (lambda x, w: x.sum(-1), ROW, (4, 8), (8, 3), "f64[2]{dp,tp}"),
    "mean_of_one_operand": (lambda x, w: x.mean(), ROW, (4, 8), (8, 3), "f64[]{dp,tp}"),
    "one_side_split": (
        lambda x, w: x @ w[:4],
        (P(None, "tp"), P()),
        (3, 8),
        (8, 2),
        "f64[3,2]{tp}",
    ),
    "slice_of_a_block": (lambda x, w: x[:, :2] @ w[:2], ROW, (4, 8), (8, 3), "f64[2,3]{dp,tp}"),
    "softmax_along_the_split_dim": (
        lambda x, w: torch.softmax(x, -1) @ w,
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,3]{dp,tp}",
    ),
    "unknown_op": (
        lambda x, w: torch.sort(x, -1).values @ w,
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,3]{dp,tp}",
    ),
    "after_a_collective": (
        lambda x, w: ns.ppermute(x, "tp", [(0, 1), (1, 0)]) @ w,
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,3]{dp,tp}",
    ),
    "blocks_of_different_axes": (
        lambda x, w: x @ w,
        (P(None, "dp"), P("tp", None)),
        (3, 8),
        (8, 2),
        "f64[3,2]{dp,tp}",
    ),
    "einsum_keeping_the_letter": (
        lambda x, w: torch.einsum("bh,hd->bhd", x, w),
        ROW,
        (4, 8),
        (8, 3),
        "f64[2,4,3]{dp,tp}",
    ),
}


@pytest.mark.parametrize("name", sorted(INFERRED))
def test_contraction_of_blocks_is_unreduced(name):
    body, specs, a, b, want = INFERRED[name]
    assert _typeof(body, specs, a, b) == [want, want]


def test_attention_heads_split_make_the_output_projection_unreduced():
    heads = P("dp", "tp")  # [b, h, s, dh]: batch over dp, heads over tp
    seen = _typeof(
        _attention_out,
        (heads, heads, heads, P("tp", None)),
        (2, 4, 3, 2),
        (2, 4, 3, 2),
        (2, 4, 3, 2),
        (8, 5),
    )
    assert seen == ["f64[1,3,5]{dp, U:tp}"] * 2
    # a block of keys over the ring axis: the attention of a block is no partial sum
    ring = P(None, None, "tp")
    seen = _typeof(
        _attention_out, (ring, ring, ring, P()), (2, 4, 4, 2), (2, 4, 4, 2), (2, 4, 4, 2), (8, 5)
    )
    assert seen == ["f64[2,2,5]{tp}"] * 2


@pytest.mark.parametrize("name", sorted(SILENT))
def test_inference_stays_silent(name):
    body, specs, a, b, want = SILENT[name]
    assert _typeof(body, specs, a, b) == [want, want]


def test_inferred_partial_sum_values_and_gradients():
    """The row-parallel MLP written the plain way: psum of the inferred partial sum, then the
    bias; values and gradients equal the dense program's."""
    gen = torch.Generator().manual_seed(3)
    x, w1, w2, b = (
        torch.randn(s, generator=gen, dtype=F64) for s in ((4, 6), (6, 8), (8, 3), (3,))
    )

    @ns.spmd_map(
        mesh=MESH, in_specs=(P("dp"), P(None, "tp"), P("tp", None), P()), out_specs=P("dp")
    )
    def mlp(x, w1, w2, b):
        return ns.psum(torch.relu(x @ w1) @ w2, "tp") + b

    params = [t.clone().requires_grad_() for t in (w1, w2, b)]
    dense = [t.clone().requires_grad_() for t in (w1, w2, b)]
    torch.testing.assert_close(mlp(x, *params), torch.relu(x @ dense[0]) @ dense[1] + dense[2])
    mlp(x, *params).pow(2).sum().backward()
    (torch.relu(x @ dense[0]) @ dense[1] + dense[2]).pow(2).sum().backward()
    for p, d in zip(params, dense):
        torch.testing.assert_close(p.grad, d.grad, rtol=1e-10, atol=1e-10)


def test_explicit_cast_of_an_inferred_partial_sum_is_the_identity():
    seen = _typeof(lambda x, w: ns.pcast(x @ w, "tp", to="unreduced"), ROW, (4, 8), (8, 3))
    assert seen == ["f64[2,3]{dp, U:tp}"] * 2


def test_annotations_the_inference_asked_for():
    """The inference's cost in annotations (section 2.3): the catalogue's and the tutorials'
    programs need none; the random program sampler needs one (``_sampler.local``)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    varying_cast = re.compile(r"pcast\([^)]*to=[\"']varying")
    tutorials = [p for p in (root / "tutorials").glob("*.py")]
    assert tutorials
    for path in [*tutorials, root / "tests" / "_programs.py"]:
        code = "\n".join(
            line for line in path.read_text().splitlines() if not line.lstrip().startswith("#")
        )
        found = varying_cast.findall(code)
        # the catalogue's one U -> V program predates the inference (it tests the cast itself)
        assert len(found) == (1 if path.name == "_programs.py" else 0), (path, found)
    sampler = (root / "tests" / "_sampler.py").read_text()
    assert len(re.findall(r"return ns\.pcast\(", sampler)) == 1


def test_the_rules_broadcast_of_batch_shapes_is_torchs():
    import itertools

    from named_spmd._block_rules import _broadcast_shape

    shapes = [(), (1,), (3,), (2, 1), (1, 3), (2, 3), (4, 1, 3), (1, 1, 1), (5, 2, 1)]
    pairs = 0
    for a, b in itertools.product(shapes, repeat=2):
        try:
            want = tuple(torch.broadcast_shapes(a, b))
        except RuntimeError:
            continue  # the op itself refused these before any rule runs
        assert _broadcast_shape(a, b) == want, (a, b)
        pairs += 1
    assert pairs > 60


def test_the_linear_rule_is_the_matmul_rule_of_the_transposed_weight():
    """``F.linear``'s rule (a hot path) against the general rules it shortcuts: the matmul of x
    with w.T, then the broadcast of the bias, over every layout of small operands."""
    import itertools

    from named_spmd._block_rules import (
        NONE,
        RULES,
        Layout,
        _broadcast,
        _matmul_layout,
        _Shaped,
    )

    kinds = [NONE, frozenset({"dp"}), frozenset({"tp"}), frozenset({"dp", "tp"})]
    opaques = [NONE, frozenset({"tp"})]
    out = torch.zeros(2, 3, 5)
    x, w, b = torch.zeros(2, 3, 4), torch.zeros(5, 4), torch.zeros(5)
    cases = 0
    for xd in itertools.product(kinds[:3], kinds[:2], kinds):
        for wd, bd, xo, wo in itertools.product(
            itertools.product(kinds, kinds), [(k,) for k in kinds], opaques, opaques
        ):
            lay = {id(x): Layout(xd, xo), id(w): Layout(wd, wo), id(b): Layout(bd, NONE)}
            got = RULES["linear"]((x, w, b), {}, lambda t: lay[id(t)], out)
            lw = lay[id(w)]
            want_lay, want_unreduced = _matmul_layout(
                x, lay[id(x)], _Shaped(reversed(w.shape)), Layout(lw.dims[::-1], lw.opaque)
            )
            want_lay = _broadcast([(out, want_lay), (b, lay[id(b)])], tuple(out.shape))
            assert got == (want_lay, want_unreduced), (xd, wd, bd, xo, wo)
            cases += 1
    assert cases == 24 * 16 * 4 * 4


def _broadcast_by_definition(parts, shape):
    """The broadcast rule as written in design section 2.3, set by set (the oracle of the fast
    ``_broadcast``)."""
    from named_spmd._block_rules import NONE, Layout

    held = [set() for _ in shape]
    opaque = set()
    for t, lay in parts:
        opaque |= lay.opaque
        off = len(shape) - t.dim()
        for i, axes in enumerate(lay.dims):
            if axes:
                if off + i < 0 or (t.shape[i] == 1 and shape[off + i] != 1):
                    opaque |= axes
                else:
                    held[off + i].add(axes)
    dims = []
    for h in held:
        if len(h) > 1:
            opaque |= frozenset().union(*h)
        dims.append(next(iter(h)) if len(h) == 1 else NONE)
    return Layout(tuple(dims), frozenset(opaque))


def test_the_broadcast_rule_and_the_attention_rule_match_their_definition():
    import random

    from named_spmd._block_rules import NONE, RULES, Layout, _broadcast

    rng = random.Random(0)
    kinds = [NONE, NONE, frozenset({"dp"}), frozenset({"tp"}), frozenset({"dp", "tp"})]
    for _ in range(3000):
        shape = tuple(rng.choice([1, 2, 3]) for _ in range(rng.randint(0, 4)))
        parts = []
        for _ in range(rng.randint(1, 3)):
            k = rng.randint(0, len(shape))
            t = torch.zeros([rng.choice([1, s]) for s in shape[len(shape) - k :]])
            lay = Layout(tuple(rng.choice(kinds) for _ in range(k)), rng.choice(kinds))
            parts.append((t, lay))
        assert _broadcast(parts, shape) == _broadcast_by_definition(parts, shape), (parts, shape)
    q, k, v = torch.zeros(2, 3, 4, 5), torch.zeros(2, 3, 6, 5), torch.zeros(2, 3, 6, 7)
    out = torch.zeros(2, 3, 4, 7)
    for _ in range(500):
        lays = {
            id(t): Layout(tuple(rng.choice(kinds) for _ in range(4)), rng.choice(kinds))
            for t in (q, k, v)
        }
        if rng.random() < 0.5:  # the usual case: q, k and v split alike over batch and heads
            head = lays[id(q)].dims[:2]
            for t in (k, v):
                lays[id(t)] = Layout(head + lays[id(t)].dims[2:], lays[id(t)].opaque)
        got = RULES["scaled_dot_product_attention"]((q, k, v), {}, lambda t: lays[id(t)], out)
        lq, lk, lv = (lays[id(t)] for t in (q, k, v))
        batch = _broadcast_by_definition(
            [
                (torch.zeros(t.shape[:-2]), Layout(lay.dims[:-2], lay.opaque))
                for t, lay in ((q, lq), (k, lk), (v, lv))
            ],
            (2, 3),
        )
        contracted = lq.dims[-1] | lk.dims[-1] | lk.dims[-2] | lv.dims[-2]
        want = Layout((*batch.dims, lq.dims[-2], lv.dims[-1]), batch.opaque | contracted)
        assert got == (want, NONE)


def test_the_elementwise_shortcut_gives_the_elementwise_rules_layout():
    """``_blocks.after_op``'s shortcut for elementwise ops (a hot path: most ops of a call whose
    inputs hold blocks) against the rule it skips: wherever it answers, the layout is the rule's;
    it answers for the usual operands (one layout at the result's shape, the others plain), and
    leaves broadcasts, two layouts, stale records and varying operands without a record to the
    rule."""
    import itertools

    from named_spmd import _blocks
    from named_spmd._block_rules import NONE, RULES, Layout
    from named_spmd._types import INVARIANT, Vma

    token, other_call = object(), object()
    out = torch.zeros(2, 3)
    row, col = Layout((frozenset({"dp"}), NONE), NONE), Layout((NONE, frozenset({"tp"})), NONE)
    records = {
        "row": (token, row),
        "row again": (token, Layout(row.dims, row.opaque)),  # equal, but another object
        "col": (token, col),
        "other call": (other_call, row),
        "stale": (token, Layout((NONE,), NONE)),  # a record of another rank
        None: None,
    }
    vmas = {"invariant": INVARIANT, "dp": Vma.of(("dp",))}
    answered = 0
    for shapes in ((2, 3), (3,)), ((2, 3), (2, 3)), ((2, 3), (2, 3), (1, 3)):
        for recs in itertools.product(records, repeat=len(shapes)):
            for kinds in itertools.product(vmas, repeat=len(shapes)):
                tensors = [torch.zeros(s) for s in shapes]
                vma_of_id = {}
                for t, r, k in zip(tensors, recs, kinds):
                    if records[r] is not None:
                        t.__dict__[_blocks.ATTR] = records[r]
                    vma_of_id[id(t)] = vmas[k]
                vma_of = lambda t: vma_of_id[id(t)]  # noqa: E731
                got = _blocks._elementwise_record(tensors, out, token, vma_of)
                if got is None:
                    continue
                answered += 1
                layouts = lambda t: _blocks._layout_of(t, token, vma_of)  # noqa: E731
                want = RULES["add"](tuple(tensors), {}, layouts, out)
                assert want is not None and got == (token, want[0]), (shapes, recs, kinds)
                assert want[1] == NONE
    assert answered > 20
