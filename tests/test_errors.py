"""The catalogue of bad inputs: each raises an SpmdError that says where and how to fix it.

Every case pins the error class, the user function's name (where there is one), and the
substrings that carry the diagnosis and the fix.
"""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest
import torch

import named_spmd as ns
from named_spmd import P

MESH = ns.make_mesh((2, 4), ("dp", "tp"))


def _run(fn, in_specs, out_specs, *args, **kwargs):
    return ns.spmd_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_specs)(*args, **kwargs)


def identity(x):
    return x


def pair(x):
    return x, x


def two_args(x, y):
    return x


def first_five(x):
    return x[:5]


def psum_unknown(x):
    return ns.psum(x, "tq")


def perm_dup_src(x):
    return ns.ppermute(x, "tp", [(0, 1), (0, 2)])


def perm_dup_dst(x):
    return ns.ppermute(x, "tp", [(0, 1), (2, 1)])


def perm_out_of_range(x):
    return ns.ppermute(x, "tp", [(0, 4)])


def perm_not_pairs(x):
    return ns.ppermute(x, "tp", [0, 1, 2, 3])


def shuffle_not_permutation(x):
    return ns.pshuffle(x, "tp", [0, 0, 1, 2])


def psum_over_a_set(x):
    return ns.psum(x, {"dp", "tp"})


def pmax_of_complex(x):
    return ns.pmax(x, "tp")


@dataclasses.dataclass
class Pair:
    first: torch.Tensor
    second: torch.Tensor


def returns_dataclass(x):
    return Pair(x, x * 2)


def gather_axis_text(x):
    return ns.all_gather(x, "tp", axis="0")


def _weights(n):
    return {f"w{k}": torch.randn(2) for k in range(n)}


def a2a_untiled_size(x):
    return ns.all_to_all(x, "tp", 0, 0)


def a2a_tiled_size(x):
    return ns.all_to_all(x, "tp", 0, 0, tiled=True)


def scatter_untiled_size(x):
    return ns.psum_scatter(x, "tp")


def scatter_tiled_size(x):
    return ns.psum_scatter(x, "tp", tiled=True)


def psum_of_invariant(x):
    return ns.psum(x, ("dp", "tp"))


def psum_of_invariant_over_later_axis(x):
    # the simulated fast path reduces over tp before it finds x invariant over dp
    return ns.psum(x, ("tp", "dp"))


def scatter_of_invariant(w):
    return ns.psum_scatter(w, "tp", tiled=True)


def scalar_out(x):
    return x.sum()


def pvary_again(x):
    return ns.pvary(x, ("dp", "tp"))


INNER = ns.spmd_map(identity, mesh=MESH, in_specs=P(), out_specs=P())


def calls_spmd_inside(x):
    return INNER(x)


def gather_bad_to(x):
    return ns.all_gather(x, "tp", to="replicated")


def gather_bad_axis(x):
    return ns.all_gather(x, "tp", axis=3)


def scatter_bad_dim(x):
    return ns.psum_scatter(x, "tp", scatter_dimension=2)


def a2a_bad_concat(x):
    return ns.all_to_all(x, "tp", 0, 1, tiled=True)


def repeated_axes(x):
    return ns.psum(x, ("tp", "tp"))


def no_axes(x):
    return ns.psum(x, ())


def non_tensor_operand(x):
    return ns.psum(3.0, "tp")


def branches_on_values(x):
    if x.sum() > 0:
        return x
    return -x


def gather_scalar_tiled(x):
    return ns.all_gather(x.sum(), "tp", tiled=True)


v8, v6, v24, m88 = torch.randn(8), torch.randn(6), torch.randn(24), torch.randn(8, 8)

# (id, thunk, error class, user function name or None, substrings of the message)
CATALOGUE = [
    (
        "spec-longer-than-rank",
        lambda: _run(identity, P("dp", None, "tp"), P(), m88),
        ns.SpecError,
        "identity",
        ["argument [0]", "3 entries but the tensor has rank 2", "Fix: give at most 2 entries"],
    ),
    (  # a dim the axes do not divide is split as torch.chunk does; given sizes must add up
        "block-sizes-not-adding-up",
        lambda: _run(identity, P(ns.Blocks("tp", (2, 2, 1, 0))), P("tp"), v6),
        ns.SpecError,
        "identity",
        [
            "gives dim 0 4 blocks adding up to 5, but the dim has size 6",
            "Fix: give 4 block sizes that add up to 6",
        ],
    ),
    (
        "axis-repeated-in-spec",
        lambda: _run(identity, P("tp", "tp"), P("tp"), m88),
        ns.SpecError,
        "identity",
        ["axis 'tp' appears more than once in P('tp', 'tp')", "Fix: name it once"],
    ),
    (
        "unknown-axis-in-in_spec",
        lambda: _run(identity, P("tq"), P("tp"), v8),
        ns.SpecError,
        "identity",
        ["unknown mesh axis 'tq'", "the mesh has axes ('dp', 'tp')", "Did you mean 'tp'?", "Fix:"],
    ),
    (
        "unknown-axis-in-out_spec",
        lambda: _run(identity, P("tp"), P("model"), v8),
        ns.SpecError,
        "identity",
        ["output: unknown mesh axis 'model'", "Fix: name one of those axes"],
    ),
    (
        "unknown-axis-in-collective",
        lambda: _run(psum_unknown, P("tp"), P(), v8),
        ns.CollectiveError,
        "psum_unknown",
        ["psum in", "unknown mesh axis 'tq'", "Did you mean 'tp'?", "Fix: name axes of the mesh"],
    ),
    (
        "in_specs-not-a-prefix",
        lambda: _run(two_args, (P(), P(), P()), P(), v8, v8),
        ns.SpecError,
        "two_args",
        [
            "in_specs is not a pytree prefix of the arguments",
            "in_specs has a tuple of 3 where the arguments have a tuple of 2",
            "Fix: give one P(...) per argument",
        ],
    ),
    (
        "in_specs-not-a-prefix-nested",
        lambda: _run(two_args, ({"a": P(), "c": P()}, P()), P(), {"a": v8, "b": v8}, v8),
        ns.SpecError,
        "two_args",
        [
            "at in_specs[0]: in_specs has a dict with no entry for 'b' and an extra entry for "
            "'c' where the arguments have a dict of 2 keys"
        ],
    ),
    (
        "out_specs-not-a-prefix",
        lambda: _run(pair, P(), {"a": P()}, v8),
        ns.SpecError,
        "pair",
        [
            "out_specs is not a pytree prefix of the output",
            "out_specs has a dict with keys ['a'] where the output has a tuple of 2",
            "Fix: give one P(...) per output",
        ],
    ),
    (
        "collective-outside-spmd_map",
        lambda: ns.psum(v8, "tp"),
        ns.CollectiveError,
        None,
        ["psum was called outside spmd_map", "Fix: call it inside a function decorated"],
    ),
    (
        "vma-outside-spmd_map",
        lambda: ns.axis_index("tp"),
        ns.CollectiveError,
        None,
        ["axis_index was called outside spmd_map"],
    ),
    (
        "perm-duplicate-source",
        lambda: _run(perm_dup_src, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "perm_dup_src",
        ["bad perm: sources [0] appear more than once", "Fix: each instance may send once"],
    ),
    (
        "perm-duplicate-destination",
        lambda: _run(perm_dup_dst, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "perm_dup_dst",
        ["destinations [1] appear more than once", "[(i, (i + 1) % 4) for i in range(4)]"],
    ),
    (
        "perm-out-of-range",
        lambda: _run(perm_out_of_range, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "perm_out_of_range",
        ["pairs [(0, 4)] are out of range 0..3 (group size of ('tp',))", "Fix:"],
    ),
    (
        "perm-not-pairs",
        lambda: _run(perm_not_pairs, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "perm_not_pairs",
        ["perm must be a list of (src, dst) integer pairs, got [0, 1, 2, 3]", "Fix:"],
    ),
    (
        "pshuffle-not-a-permutation",
        lambda: _run(shuffle_not_permutation, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "shuffle_not_permutation",
        [
            "perm must be a permutation of range(4)",
            "got [0, 0, 1, 2]",
            "Fix: e.g. perm=[3, 2, 1, 0]",
        ],
    ),
    (
        "all_to_all-untiled-split-size",
        lambda: _run(a2a_untiled_size, P("tp"), P("tp"), v24),
        ns.CollectiveError,
        "a2a_untiled_size",
        ["with tiled=False, split_axis=0 must have size 4", "has size 6", "or pass tiled=True"],
    ),
    (
        "all_to_all-tiled-split-size",
        lambda: _run(a2a_tiled_size, P("tp"), P("tp"), v24),
        ns.CollectiveError,
        "a2a_tiled_size",
        ["split_axis=0 has size 6, not divisible by the group size 4", "Fix: pad dim 0"],
    ),
    (
        "psum_scatter-untiled-size",
        lambda: _run(scatter_untiled_size, P("tp"), P("tp"), v24),
        ns.CollectiveError,
        "scatter_untiled_size",
        ["with tiled=False, scatter_dimension=0 must have size 4", "or pass tiled=True"],
    ),
    (
        "psum_scatter-tiled-size",
        lambda: _run(scatter_tiled_size, P("tp"), P("tp"), v24),
        ns.CollectiveError,
        "scatter_tiled_size",
        ["scatter_dimension=0 has size 6, not divisible by the group size 4", "Fix: pad"],
    ),
    (
        "psum-of-invariant-operand",
        lambda: _run(psum_of_invariant, P("tp"), P(), v8),
        ns.VmaError,
        "psum_of_invariant",
        [
            "the operand is invariant over ('dp',)",
            "multiply it by 2",
            "Fix: drop ('dp',) from the collective's axes",
            "x * axis_size('dp')",
        ],
    ),
    (
        "psum-of-operand-invariant-over-a-later-axis",
        lambda: _run(psum_of_invariant_over_later_axis, P("tp"), P(), v8),
        ns.VmaError,
        "psum_of_invariant_over_later_axis",
        ["the operand is invariant over ('dp',)", "so psum over ('tp', 'dp') would add"],
    ),
    (
        "psum_scatter-of-invariant-operand",
        lambda: _run(scatter_of_invariant, P(), P("tp"), v8),
        ns.VmaError,
        "scatter_of_invariant",
        ["psum_scatter in", "invariant over ('tp',)", "each member would get 4 times its block"],
    ),
    (
        "rank0-output-with-spec",
        lambda: _run(scalar_out, P("tp"), P("tp"), v8),
        ns.SpecError,
        "scalar_out",
        ["output: P('tp') has 1 entries but the tensor has rank 0", "can only take P()"],
    ),
    (
        "output-rank-names-its-shape",
        lambda: _run(first_five, P(), P("tp", None), v8),
        ns.SpecError,
        "first_five",
        ["output: P('tp', None) has 2 entries but the tensor has rank 1 (shape [5])", "Fix:"],
    ),
    (
        "pvary-of-varying",
        lambda: _run(pvary_again, P("tp"), P(("dp", "tp")), v8),
        ns.VmaError,
        "pvary_again",
        ["already varies over ('tp',)", "Fix: pvary only over axes it is invariant over"],
    ),
    (
        "string-instead-of-P-in_specs",
        lambda: _run(identity, "tp", P("tp"), v8),
        ns.SpecError,
        "identity",
        ["in_specs must contain PartitionSpecs; found in_specs = 'tp'", "Fix: wrap axis names"],
    ),
    (
        "tuple-instead-of-P-out_specs",
        lambda: _run(identity, P("tp"), ("tp",), v8),
        ns.SpecError,
        "identity",
        ["found out_specs[0] = 'tp'", "P('dp') instead of 'dp'"],
    ),
    (
        "keyword-arguments",
        lambda: _run(identity, P("tp"), P("tp"), x=v8),
        ns.SpmdError,
        "identity",
        ["keyword arguments ['x'] are not supported", "Fix: pass them positionally"],
    ),
    (
        "nested-spmd_map",
        lambda: _run(calls_spmd_inside, P("tp"), P("tp"), v8),
        ns.SpmdError,
        "identity",
        [
            "was called inside another spmd_map (of `calls_spmd_inside`",
            "Fix: call the inner per-device function",
        ],
    ),
    (
        "mesh-sizes-and-names-disagree",
        lambda: ns.make_mesh((2, 4), ("dp",)),
        ns.SpmdError,
        None,
        ["make_mesh: 2 sizes (2, 4) but 1 names ('dp',)", "Fix: e.g. make_mesh((2, 4)"],
    ),
    (
        "mesh-duplicate-names-bad-size",
        lambda: ns.make_mesh((2, 0), ("dp", "dp")),
        ns.SpmdError,
        None,
        ["axis names must be unique", "axis sizes must be positive, got (2, 0)"],
    ),
    (
        "mesh-not-a-mesh",
        lambda: ns.spmd_map(identity, mesh=(2, 4), in_specs=P(), out_specs=P()),
        ns.SpmdError,
        "identity",
        ["mesh= must be a named_spmd Mesh", "got tuple", "Fix: mesh = named_spmd.make_mesh"],
    ),
    (
        # recognised by class, not by name: another library's class called DeviceMesh is no mesh
        "mesh-named-like-a-device-mesh",
        lambda: ns.spmd_map(
            identity, mesh=type("DeviceMesh", (), {})(), in_specs=P(), out_specs=P()
        ),
        ns.SpmdError,
        "identity",
        ["mesh= must be a named_spmd Mesh", "got DeviceMesh", "Fix: mesh = named_spmd.make_mesh"],
    ),
    (
        "all_gather-bad-to",
        lambda: _run(gather_bad_to, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "gather_bad_to",
        ["unknown to='replicated'", "Fix: use to='varying'", "to='invariant'"],
    ),
    (
        "all_gather-axis-out-of-range",
        lambda: _run(gather_bad_axis, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "gather_bad_axis",
        ["axis=3 is out of range for an operand of shape [2] (valid: -2..1)", "Fix:"],
    ),
    (
        "psum_scatter-dim-out-of-range",
        lambda: _run(scatter_bad_dim, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "scatter_bad_dim",
        ["scatter_dimension=2 is out of range", "(valid: -1..0)"],
    ),
    (
        "all_to_all-concat-out-of-range",
        lambda: _run(a2a_bad_concat, P("tp"), P("tp"), torch.randn(16)),
        ns.CollectiveError,
        "a2a_bad_concat",
        ["concat_axis=1 is out of range"],
    ),
    (
        "collective-axis-repeated",
        lambda: _run(repeated_axes, P("tp"), P(), v8),
        ns.CollectiveError,
        "repeated_axes",
        ["axis_name ('tp', 'tp') repeats an axis", "Fix: name each once"],
    ),
    (
        "collective-no-axes",
        lambda: _run(no_axes, P("tp"), P(), v8),
        ns.CollectiveError,
        "no_axes",
        ["axis_name must be a mesh axis name or a tuple of them, got ()"],
    ),
    (
        "collective-of-non-tensor",
        lambda: _run(non_tensor_operand, P("tp"), P(), v8),
        ns.CollectiveError,
        "non_tensor_operand",
        ["got a leaf of type float", "Fix: convert it with torch.as_tensor"],
    ),
    (
        "non-tensor-with-splitting-spec",
        lambda: _run(identity, P("tp"), P("tp"), 3.0),
        ns.SpecError,
        "identity",
        ["argument [0] is a float, not a tensor, but its spec P('tp') splits it", "Fix:"],
    ),
    (
        "bad-P-entry",
        lambda: P(1),
        ns.SpecError,
        None,
        ["P(...) entries must be None, an axis name or a tuple of axis names; got 1", "Fix:"],
    ),
    (
        "not-callable",
        lambda: ns.spmd_map(3, mesh=MESH, in_specs=P(), out_specs=P()),
        ns.SpmdError,
        None,
        ["spmd_map: expected a function, got int"],
    ),
    (
        "data-dependent-control-flow",
        lambda: _run(branches_on_values, P("tp"), P("tp"), v8),
        ns.SpmdError,
        "branches_on_values",
        ["torch.func.vmap", "data-dependent Python control flow", "Fix: use torch.where"],
    ),
    (
        "axis-names-as-a-set",  # a set's order follows string hashing: ranks would disagree
        lambda: _run(psum_over_a_set, P(("dp", "tp")), P(), v8),
        ns.CollectiveError,
        "psum_over_a_set",
        ["axis_name must be a mesh axis name or a tuple of them", "Fix: pass a tuple"],
    ),
    (
        "pmax-of-complex",
        lambda: _run(pmax_of_complex, P("tp"), P(), torch.randn(8, dtype=torch.complex64)),
        ns.CollectiveError,
        "pmax_of_complex",
        ["the operand is complex (torch.complex64), which has no order", "Fix: take pmax"],
    ),
    (
        "dataclass-output",  # optree sees one opaque leaf: its tensors would escape the check
        lambda: _run(returns_dataclass, P("tp"), P(), v8),
        ns.SpecError,
        "returns_dataclass",
        ["output is a Pair holding tensors", "dataclasses.asdict(value)"],
    ),
    (
        "dataclass-input",
        lambda: _run(identity, P(), P(), Pair(v8, v8)),
        ns.SpecError,
        "identity",
        ["argument [0] is a Pair holding tensors", "Fix: pass and return tensors in tuples"],
    ),
    (
        "sparse-input",
        lambda: _run(identity, P("tp"), P("tp"), torch.eye(8).to_sparse()),
        ns.SpecError,
        "identity",
        ["argument [0] is a sparse_coo tensor", "Fix: pass x.to_dense()"],
    ),
    (
        "dim-not-an-integer",
        lambda: _run(gather_axis_text, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "gather_axis_text",
        ["axis='0' is not an integer", "Fix: pass an int dim in -2..1"],
    ),
    (
        "spec-dict-missing-a-key",  # names the key, not both key lists
        lambda: _run(identity, ({f"w{k}": P() for k in range(28)},), P(), _weights(29)),
        ns.SpecError,
        "identity",
        ["in_specs has a dict with no entry for 'w28' where the arguments have a dict of 29"],
    ),
    (
        "all_gather-tiled-scalar",
        lambda: _run(gather_scalar_tiled, P("tp"), P("tp"), v8),
        ns.CollectiveError,
        "gather_scalar_tiled",
        ["tiled=True needs an operand of rank >= 1", "Fix: gather x.reshape(1)"],
    ),
]


@pytest.mark.parametrize("case", CATALOGUE, ids=[c[0] for c in CATALOGUE])
def test_bad_input_raises_a_clear_spmd_error(case):
    _, thunk, cls, fn_name, pieces = case
    with pytest.raises(cls, match=re.escape(pieces[0])) as info:
        thunk()
    assert isinstance(info.value, ns.SpmdError) and isinstance(info.value, RuntimeError)
    msg = str(info.value)
    for piece in pieces[1:]:
        assert piece in msg, f"missing {piece!r} in:\n{msg}"
    if fn_name is not None:
        assert f"`{fn_name}` (test_errors.py:" in msg, msg


def test_numpy_integer_dims_are_accepted():
    f = ns.spmd_map(
        lambda x: ns.all_gather(x, "tp", axis=np.int64(0), tiled=True, to="invariant"),
        mesh=MESH,
        in_specs=P("tp"),
        out_specs=P(),
    )
    x = torch.randn(8)
    torch.testing.assert_close(f(x), x)


def test_large_spec_dicts_do_not_print_whole_structures():
    with pytest.raises(ns.SpecError) as info:
        _run(identity, ({f"w{k}": P() for k in range(28)},), P(), _weights(29))
    assert "structure:" not in str(info.value) and len(str(info.value)) < 600, str(info.value)


def test_catalogue_is_large_and_distinct():
    assert len(CATALOGUE) >= 20
    assert len({c[0] for c in CATALOGUE}) == len(CATALOGUE)


def test_every_failing_input_leaf_is_reported_at_once():
    def two_bad(x, y):
        return x

    with pytest.raises(ns.SpecError) as info:
        _run(two_bad, (P(ns.Blocks("tp", (1,) * 4)), {"w": P("dp", "dp")}), P("tp"), v6, {"w": m88})
    msg = str(info.value)
    assert "argument [0]: Blocks('tp', (1, 1, 1, 1)) gives dim 0 4 blocks adding up to 4" in msg
    assert "argument [1]['w']: axis 'dp' appears more than once" in msg


def test_errors_inside_collectives_leave_no_active_call_behind():
    with pytest.raises(ns.SpmdError):
        _run(psum_unknown, P("tp"), P(), v8)
    with pytest.raises(ns.CollectiveError, match="outside spmd_map"):
        ns.psum(v8, "tp")


def test_inputs_checked_once_per_spec_and_shape_are_still_checked_when_new():
    """A mapped function remembers the (spec, shape) pairs of inputs that fit (a call of known
    inputs checks none): an input of a new shape, or a sparse one of a known shape, still gets
    its error, and a known good input still runs (a dim its axes do not divide too: torch.chunk's
    blocks, 6 over 4 as 2, 2, 2, 0)."""
    f = ns.spmd_map(lambda x: x * 2, mesh=MESH, in_specs=P("tp"), out_specs=P("tp"))
    for x in (v8, v8, v6, v6):
        torch.testing.assert_close(f(x), x * 2)
    with pytest.raises(ns.SpecError, match="1 entries but the tensor has rank 0"):
        f(torch.tensor(2.0))
    with pytest.raises(ns.SpecError, match="is a sparse_coo tensor"):
        f(torch.eye(8)[0].to_sparse())
    g = ns.spmd_map(lambda x: x, mesh=MESH, in_specs=({"a": P("tp")},), out_specs={"a": P("tp")})
    g({"a": v8})
    with pytest.raises(ns.SpecError, match="in_specs"):
        g({"b": v8})  # another structure: broadcast (and refused) anew
    torch.testing.assert_close(g({"a": v8})["a"], v8)


# --- an invariant operand: each refusing collective's own consequence and fix -------------------


def _scatter_of_partly_invariant(x):  # varies over dp, invariant over tp
    return ns.psum_scatter(x, ("dp", "tp"), scatter_dimension=1, tiled=True)


INVARIANT_OPERANDS = {
    # name: (function, in_spec, out_spec, the record's own pieces of the message)
    "psum": (
        psum_of_invariant,
        P("tp"),
        P(),
        ["so psum over ('dp', 'tp') would add 2 identical copies", "x * axis_size('dp')"],
    ),
    "psum_scatter": (
        scatter_of_invariant,
        P(),
        P("tp"),
        [
            "so psum_scatter over ('tp',) would add 4 identical copies before scattering",
            "take this member's block without communication: x.unflatten(0, (4, -1))"
            ".index_select(0, ns.axis_index('tp').reshape(1)).squeeze(0)",
            "ns.psum_scatter(ns.pvary(x, 'tp'), ...) if you really mean 4 times the block",
        ],
    ),
    "psum_scatter of a partly invariant operand": (
        _scatter_of_partly_invariant,
        P("dp"),
        P(None, ("dp", "tp")),
        [
            "so psum_scatter over ('dp', 'tp') would add 4 identical copies",
            "if x is already the total over ('tp',), scatter it as varying and divide: "
            "ns.psum_scatter(ns.pvary(x, 'tp'), ...) / (axis_size('tp'))",
        ],
    ),
}


@pytest.mark.parametrize("run", ["simulated", "check"])
@pytest.mark.parametrize("name", sorted(INVARIANT_OPERANDS))
def test_invariant_operand_gets_the_collectives_own_message(name, run):
    """The simulated mesh and check() (the real mesh takes the same path through the record)."""
    fn, in_spec, out_spec, pieces = INVARIANT_OPERANDS[name]
    f = ns.spmd_map(fn, mesh=MESH, in_specs=in_spec, out_specs=out_spec)
    x = torch.randn(8, 8)
    with pytest.raises(ns.VmaError) as info:
        f(x) if run == "simulated" else f.check(x)
    message = str(info.value)
    assert f"`{fn.__name__}` (test_errors.py:" in message, message
    for piece in pieces:
        assert piece in message, f"missing {piece!r} in:\n{message}"
    if name.startswith("psum_scatter"):
        assert "x * axis_size" not in message, message  # psum's fix is not psum_scatter's


def test_the_fixes_in_psum_scatters_message_compute_the_block():
    """What the messages offer instead: the member's block of a total (no communication), and
    the scatter of a value varying over some axes and already summed over the others."""
    total = torch.randn(8, 8)
    block = ns.spmd_map(
        lambda x: (
            x.unflatten(0, (4, -1)).index_select(0, ns.axis_index("tp").reshape(1)).squeeze(0)
        ),
        mesh=MESH,
        in_specs=P(),
        out_specs=P("tp"),
    )
    torch.testing.assert_close(block(total), total)
    assert block.check(total).types[0].vma == {"tp"}
    scattered = ns.spmd_map(
        lambda x: (
            ns.psum_scatter(ns.pvary(x, "tp"), ("dp", "tp"), scatter_dimension=1, tiled=True)
            / ns.axis_size("tp")
        ),
        mesh=MESH,
        in_specs=P("dp"),
        out_specs=P(None, ("dp", "tp")),
    )
    halves = total.unflatten(0, (2, -1))
    torch.testing.assert_close(scattered(total), halves[0] + halves[1])


def test_a_record_refusing_invariant_operands_needs_its_own_message():
    from named_spmd._collectives import RECORDS
    from named_spmd._collectives._record import REQUIRE_VARYING

    refusing = [r for r in RECORDS.values() if r.policy == REQUIRE_VARYING]
    assert {r.name for r in refusing} >= {"psum", "psum_scatter"}
    assert len({r.invariant_operand for r in refusing}) == len(refusing)  # one message each
    with pytest.raises(ns.CollectiveError, match="gives no invariant_operand message"):
        dataclasses.replace(RECORDS["psum"], name="psum_without_message", invariant_operand=None)
    assert "psum_without_message" not in RECORDS
