"""vma inference (docs/design.md section 2 and the table of section 3), the out_specs check,
check_vma.

Inside spmd_map the per-device function runs once per simulated call, so a closure can record
``ns.vma`` of intermediate values; each test compares those with the rule.
"""

from __future__ import annotations

import re

import pytest
import torch
from _reference import REF, run_reference

import named_spmd as ns
from named_spmd import P

MESH = ns.make_mesh((2, 4), ("dp", "tp"))
DP, TP, BOTH, NONE = frozenset({"dp"}), frozenset({"tp"}), frozenset({"dp", "tp"}), frozenset()


def _x(*shape):
    return torch.randn(*shape, dtype=torch.float64)


def record(body, in_specs, *args, out_specs=None, mesh=MESH):
    """Run ``body(seen, *args)`` per device; return the dict of vmas it recorded."""
    seen: dict[str, frozenset[str]] = {}

    def f(*local):
        values = body(*local)
        for k, v in values.items():
            seen[k] = ns.vma(v)
        return local[0]

    out = out_specs if out_specs is not None else in_specs[0]
    ns.spmd_map(f, mesh=mesh, in_specs=in_specs, out_specs=out)(*args)
    return seen


# --- sources -----------------------------------------------------------------------------------


def test_arguments_vary_over_the_axes_their_spec_names():
    tree = {"a": _x(4, 8), "b": (_x(8, 2), 3.0)}
    seen = record(
        lambda t, w: {"a": t["a"], "b0": t["b"][0], "float": t["b"][1], "w": w},
        ({"a": P("dp", "tp"), "b": (P(("tp", "dp")), P())}, P()),
        tree,
        _x(3),
    )
    assert seen == {"a": BOTH, "b0": BOTH, "float": NONE, "w": NONE}
    seen = record(lambda x: {"x": x}, (P(None, "tp"),), _x(2, 8))
    assert seen == {"x": TP}


CAPTURED = torch.ones(3, dtype=torch.float64)


def test_factories_and_captured_tensors_are_invariant_like_factories_inherit():
    def body(x):
        return {
            "zeros": torch.zeros(3),
            "tensor": torch.tensor(2.0),
            "arange": torch.arange(4),
            "captured": CAPTURED,
            "zeros_like": torch.zeros_like(x),
            "ones_like": torch.ones_like(x),
            "full_like": torch.full_like(x, 7.0),
            "empty_like": torch.empty_like(x),
            "captured_plus_x": CAPTURED[:1] + x[0, :1],
        }

    seen = record(body, (P("dp"),), _x(4, 3))
    assert seen == dict(
        zeros=NONE,
        tensor=NONE,
        arange=NONE,
        captured=NONE,
        zeros_like=DP,
        ones_like=DP,
        full_like=DP,
        empty_like=DP,
        captured_plus_x=DP,
    )


def test_axis_index_varies_over_its_axes_and_axis_size_is_a_python_int():
    sizes = {}

    def body(x):
        sizes["tp"], sizes["both"] = ns.axis_size("tp"), ns.axis_size(("tp", "dp"))
        return {"tp": ns.axis_index("tp"), "both": ns.axis_index(("tp", "dp"))}

    assert record(body, (P(),), _x(2)) == {"tp": TP, "both": BOTH}
    assert sizes == {"tp": 4, "both": 8} and all(type(v) is int for v in sizes.values())


def test_ordinary_ops_take_the_union():
    def body(x, y, w):  # x{dp}, y{tp}, w{}
        return {
            "add": x + y,
            "mul_invariant": x * w,
            "matmul": x @ w.reshape(4, 1).expand(4, 4),
            "cat": torch.cat([x, w.reshape(1, 4)]),
            "stack": torch.stack([y, w.reshape(1, 4).expand(4, 4)]),
            "where": torch.where(ns.axis_index("tp") > 1, w, w * 2),
            "sum": x.sum(0),
            "max": torch.amax(x, dim=-1),
            "view": x.T.reshape(-1)[1:],
            "index": x[0],
            "unary": torch.tanh(y),
            "invariant_only": w * 2 + torch.ones(4),
            "python_scalar": x * 3.0,
        }

    seen = record(body, (P("dp"), P(None, "tp"), P()), _x(8, 4), _x(4, 16), _x(4))
    assert seen == dict(
        add=BOTH,
        mul_invariant=DP,
        matmul=DP,
        cat=DP,
        stack=TP,
        where=TP,
        sum=DP,
        max=DP,
        view=DP,
        index=DP,
        unary=TP,
        invariant_only=NONE,
        python_scalar=DP,
    )


def test_user_vmap_inside_keeps_vma_and_collectives_work_per_row():
    def body(x):
        return {
            "vmapped": torch.func.vmap(lambda r: r * 2)(x),
            "psum_rows": torch.func.vmap(lambda r: ns.psum(r, "tp"))(x),
        }

    assert record(body, (P("dp", "tp"),), _x(4, 8)) == {"vmapped": BOTH, "psum_rows": DP}
    x = _x(4, 8)

    def rows(x):
        return torch.func.vmap(lambda r: ns.psum(r, "tp"))(x)

    got = ns.spmd_map(rows, mesh=MESH, in_specs=P("dp", "tp"), out_specs=P("dp"))(x)
    torch.testing.assert_close(got, x.reshape(4, 4, 2).sum(1))


# --- collectives -------------------------------------------------------------------------------

# (id, per-device function of x{dp,tp}, w{} and v{dp}, expected vma)
COLLECTIVE_RULES = [
    ("psum-tp", lambda x, w, v: ns.psum(x, "tp"), DP),
    ("psum-both", lambda x, w, v: ns.psum(x, ("tp", "dp")), NONE),
    ("psum-of-dp-only", lambda x, w, v: ns.psum(v, "dp"), NONE),
    ("pmean-tp", lambda x, w, v: ns.pmean(x, "tp"), DP),
    ("pmax-both", lambda x, w, v: ns.pmax(x, ("dp", "tp")), NONE),
    ("pmin-dp", lambda x, w, v: ns.pmin(x, "dp"), TP),
    ("pmean-of-invariant", lambda x, w, v: ns.pmean(w, "tp"), NONE),
    ("pmax-of-partly-invariant", lambda x, w, v: ns.pmax(v, ("dp", "tp")), NONE),
    ("pmin-of-invariant", lambda x, w, v: ns.pmin(w, ("tp",)), NONE),
    ("all_gather-keeps", lambda x, w, v: ns.all_gather(x, "tp"), BOTH),
    ("all_gather-adds", lambda x, w, v: ns.all_gather(v, "tp", tiled=True), BOTH),
    ("all_gather-of-invariant", lambda x, w, v: ns.all_gather(w, "dp"), DP),
    ("all_gather-to-invariant", lambda x, w, v: ns.all_gather(x, "tp", to="invariant"), DP),
    (
        "all_gather-to-invariant-both",
        lambda x, w, v: ns.all_gather(v, ("tp", "dp"), tiled=True, to="invariant"),
        NONE,
    ),
    ("psum_scatter", lambda x, w, v: ns.psum_scatter(x, "tp", tiled=True), BOTH),
    ("psum_scatter-dp", lambda x, w, v: ns.psum_scatter(v, "dp", tiled=True), DP),
    ("all_to_all-keeps", lambda x, w, v: ns.all_to_all(x, "tp", 0, 0, tiled=True), BOTH),
    ("all_to_all-adds", lambda x, w, v: ns.all_to_all(v, "tp", 0, 0, tiled=True), BOTH),
    ("ppermute-adds", lambda x, w, v: ns.ppermute(w, "tp", [(0, 1), (1, 0)]), TP),
    ("ppermute-keeps", lambda x, w, v: ns.ppermute(x, ("dp", "tp"), [(0, 7)]), BOTH),
    ("pshuffle-adds", lambda x, w, v: ns.pshuffle(v, "tp", [1, 2, 3, 0]), BOTH),
    ("pvary", lambda x, w, v: ns.pvary(w, ("tp", "dp")), BOTH),
    ("pvary-rest", lambda x, w, v: ns.pvary(v, "tp"), BOTH),
    ("axis_index-mixed", lambda x, w, v: w + ns.axis_index("tp"), TP),
]


@pytest.mark.parametrize("rule", COLLECTIVE_RULES, ids=[r[0] for r in COLLECTIVE_RULES])
def test_collective_vma_rule(rule):
    _, fn, want = rule
    seen = record(
        lambda x, w, v: {"out": fn(x, w, v)},
        (P("dp", "tp"), P(), P("dp")),
        _x(8, 16),
        _x(8, 8),
        _x(16, 8),
    )
    assert seen["out"] == want


def test_pytree_collectives_apply_the_rule_per_leaf():
    def body(x, w):
        s = ns.psum({"a": x, "b": (x * 2,)}, "tp")
        g = ns.all_gather([w, x], "dp")
        return {"sa": s["a"], "sb": s["b"][0], "g0": g[0], "g1": g[1]}

    seen = record(body, (P("dp", "tp"), P()), _x(4, 8), _x(3))
    assert seen == {"sa": DP, "sb": DP, "g0": DP, "g1": BOTH}


def test_vma_of_a_non_tensor_is_empty_and_typeof_is_compact():
    shown = {}

    def f(x):
        shown["float"] = ns.vma(2.0)
        shown["type"] = repr(ns.typeof(x))
        shown["psum"] = repr(ns.typeof(ns.psum(x, "tp")))
        return x

    ns.spmd_map(f, mesh=MESH, in_specs=P("dp", "tp"), out_specs=P("dp", "tp"))(_x(4, 8))
    assert shown == {"float": NONE, "type": "f64[2,2]{dp,tp}", "psum": "f64[2,2]{dp}"}


# --- the out_specs check -----------------------------------------------------------------------


def test_out_specs_violation_names_function_path_axes_and_both_fixes():
    def forgot_the_psum(x, w):
        return x.sum(0), {"y": x @ w, "ok": ns.psum(x @ w, ("dp", "tp"))}

    f = ns.spmd_map(
        forgot_the_psum,
        mesh=MESH,
        in_specs=(P("dp", "tp"), P("tp")),
        out_specs=(P(), {"y": P("dp"), "ok": P()}),
    )
    with pytest.raises(ns.VmaError) as info:
        f(_x(4, 8), _x(8, 3))
    msg = str(info.value)
    assert isinstance(info.value, ns.SpmdError)
    assert "forgot_the_psum" in msg
    assert "output[0]" in msg and "output[1]['y']" in msg  # every failing leaf, at once
    assert "output[1]['ok']" not in msg
    assert "varies over ('dp', 'tp')" in msg  # output[0]: both axes, in mesh order
    # output[1]['y']: the product contracts the dim split over tp on both sides: unreduced
    assert "output[1]['y'] has type f64[2,3]{dp, U:tp}: it is unreduced over ('tp',)" in msg
    assert "P(..., unreduced={'tp'})" in msg
    assert "Fix 1: reduce inside the function, e.g. ns.psum(y, 'tp')" in msg
    # output[0]: x.sum(0) reduced the dim of dp blocks (no dim holds dp) and kept tp's on dim 0
    assert (
        "Fix 2: name ('dp', 'tp') in out_specs to get every instance's block concatenated, "
        "e.g. P(('dp', 'tp')) (no dim of this value is known to hold blocks of 'dp'" in msg
    )
    assert "f64[2]{dp,tp}" in msg  # the value's type


def _fix2_spec(message: str) -> P:
    """The out_spec the error's Fix 2 suggests."""
    match = re.search(r"Fix 2: .*?e\.g\. (P\(.*?\))(?=, to get| \()", message)
    assert match, message
    return eval(match.group(1), {"P": P})


def _logits(x, w):
    return x @ w


def _logit_sums(x, w):  # summed over the vocabulary blocks: no dim holds them any more
    return (x @ w).sum(-1, keepdim=True)


@pytest.mark.parametrize(
    "fn, in_specs, out_spec",
    [
        (_logits, (P("dp"), P(None, "tp")), P("dp")),  # vocabulary-split logits [16, 16, 32]
        (_logits, (P(None, "dp"), P(None, "tp")), P()),  # tokens split over dp on dim 1
        (_logit_sums, (P("dp"), P(None, "tp")), P("dp")),
    ],
)
def test_out_specs_fix2_names_the_dim_that_holds_the_blocks(fn, in_specs, out_spec):
    """Fix 2's spec, run, returns the dense value where the layout says where the blocks are
    (named on another dim, they would come back concatenated where they do not belong); where
    no dim holds them, the message says so instead of passing a guess off as the layout."""
    x, w = _x(16, 16, 8), _x(8, 32)
    f = ns.spmd_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_spec)
    with pytest.raises(ns.VmaError) as info:
        f(x, w)
    msg = str(info.value)
    with pytest.raises(ns.VmaError) as checked:  # the abstract backend: the same message
        f.check(x, w)
    assert str(checked.value) == msg
    fixed = ns.spmd_map(fn, mesh=MESH, in_specs=in_specs, out_specs=_fix2_spec(msg))(x, w)
    if fn is _logits:
        assert re.search(r"on the (dim that holds its|dims that hold their) blocks", msg)
        torch.testing.assert_close(fixed, x @ w)
    else:  # every instance's partial sums, concatenated where the message says
        assert (
            "no dim of this value is known to hold blocks of 'tp', so this puts it on dim 0" in msg
        )
        want = (x @ w).unflatten(-1, (4, 8)).sum(-1).unflatten(0, (2, 8)).movedim(-1, 1)
        torch.testing.assert_close(fixed, want.reshape(64, 16, 1))


def test_out_specs_violation_for_a_rank0_output_suggests_a_singleton_dim():
    def scalar(x):
        return x.sum()

    f = ns.spmd_map(scalar, mesh=MESH, in_specs=P("dp"), out_specs=P())
    with pytest.raises(ns.VmaError, match=r"reshape\(1\)") as info:
        f(_x(4))
    assert "scalar" in str(info.value) and "ns.psum(y, 'dp')" in str(info.value)


def _row_sums(x):
    return x.sum(0)


@pytest.mark.parametrize(
    "out_spec, bullets, fixed_spec",
    [
        # varying over tp, declared unreduced there: only the unreduced bullet (pcast)
        (P("dp", unreduced={"tp"}), 1, None),
        # varying over tp, declared reduced there: Fix 2 names tp and drops it from reduced=
        (P("dp", reduced={"tp"}), 1, P(("dp", "tp"))),
    ],
)
def test_out_specs_fix_for_a_partial_spec_is_a_valid_spec(out_spec, bullets, fixed_spec):
    """An axis has one state in a spec: the message neither says that an out_spec naming an
    axis as unreduced does not name it, nor suggests a spec giving an axis two states (which
    raises a SpecError of its own)."""
    x = _x(16, 4)
    f = ns.spmd_map(_row_sums, mesh=MESH, in_specs=P(None, ("dp", "tp")), out_specs=out_spec)
    with pytest.raises(ns.VmaError) as info:
        f(x)
    msg = str(info.value)
    assert msg.count("\n  - ") == bullets, msg
    if fixed_spec is None:
        assert "does not name" not in msg and "to='unreduced'" in msg
        return
    assert _fix2_spec(msg) == fixed_spec
    fixed = ns.spmd_map(_row_sums, mesh=MESH, in_specs=P(None, ("dp", "tp")), out_specs=fixed_spec)
    torch.testing.assert_close(fixed(x), x.sum(0))


def test_named_but_invariant_axis_is_fine_and_concatenates_copies():
    w = _x(3)
    out = ns.spmd_map(lambda w: w * 2, mesh=MESH, in_specs=P(), out_specs=P(("dp", "tp")))(w)
    torch.testing.assert_close(out, (w * 2).repeat(8))


@pytest.mark.parametrize("out_spec", [P(), P("dp")])
def test_check_vma_false_returns_the_coordinate_zero_copy(out_spec):
    x = _x(8, 2)
    ring = [(i, (i + 1) % 4) for i in range(4)]

    def shifted(o, x):  # varies over tp: out_specs that do not name tp are not replicated
        return o.ppermute(x, "tp", ring) + o.axis_index("tp")

    def per_device(x):
        return shifted(ns, x)

    with pytest.raises(ns.VmaError, match="(?s)per_device.*varies over"):
        ns.spmd_map(per_device, mesh=MESH, in_specs=P("dp"), out_specs=out_spec)(x)
    got = ns.spmd_map(per_device, mesh=MESH, in_specs=P("dp"), out_specs=out_spec, check_vma=False)(
        x
    )
    want = run_reference(
        lambda x: shifted(REF, x), MESH, P("dp"), out_spec, x, check_invariant=False
    )
    torch.testing.assert_close(got, want)
    # instance tp=0 received from tp=3 (ring) and added axis_index 0: its own block again
    block = x if out_spec == P("dp") else x[:4]
    torch.testing.assert_close(got, block)


def test_check_vma_false_still_checks_specs():
    f = ns.spmd_map(lambda x: x, mesh=MESH, in_specs=P("dp"), out_specs=P("tq"), check_vma=False)
    with pytest.raises(ns.SpecError, match="unknown mesh axis 'tq'"):
        f(_x(4))


def test_out_specs_are_checked_again_when_an_output_of_the_same_shape_changes_type():
    """A call whose output has the tree, shapes and dtypes of an earlier call's, but another
    type (here chosen by an argument), still fails the out_specs check, and an accepted one
    after it returns the right value: what a call caches of its outputs' checks (per tree
    structure and leaves) never includes their types."""

    @ns.spmd_map(mesh=ns.make_mesh((2,), ("dp",)), in_specs=(P("dp"), P()), out_specs=P())
    def total_or_block(x, keep_block):
        return x if keep_block else ns.psum(x, "dp")

    x = torch.arange(4.0, dtype=torch.float64)
    want = x[:2] + x[2:]
    for _ in range(2):
        torch.testing.assert_close(total_or_block(x, False), want)
    with pytest.raises(ns.VmaError, match=r"varies over \('dp',\)"):
        total_or_block(x, True)
    torch.testing.assert_close(total_or_block(x, False), want)
