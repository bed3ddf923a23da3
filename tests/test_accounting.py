"""Communication accounting: CommMode pins the logical collectives, forward, backward and tangent.

On the simulated backend nothing is sent, so these counts are what a real mesh runs: each
collective's transpose (docs/design.md section 3), the backward psum of every implicit pvary,
once per (tensor, axes) per call however many ops use the tensor (section 2.1), and the collectives
that a forward-mode tangent runs (each collective's jvp). tests/real_transforms.py checks the same
events on a real mesh against the ProcessGroup's calls.
"""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad
from torch.func import grad, jacfwd, jacrev, jvp, vmap

import named_spmd as ns
from named_spmd import P

F64 = torch.float64


def _randn(*shape, seed=0, grad=False):
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=F64)
    return t.requires_grad_(grad)


def backward_counts(comms: ns.CommMode) -> dict:
    return {(op, axes): n for (d, op, axes), n in comms.counts().items() if d == "backward"}


def forward_counts(comms: ns.CommMode) -> dict:
    return {(op, axes): n for (d, op, axes), n in comms.counts().items() if d == "forward"}


def tangent_counts(comms: ns.CommMode) -> dict:
    return {(op, axes): n for (d, op, axes), n in comms.counts().items() if d == "tangent"}


# --- nothing where the types need nothing --------------------------------------------------------


def test_identity_on_replicated_runs_no_collective_forward_or_backward():
    f = ns.spmd_map(lambda x: x, mesh=ns.make_mesh((4,), ("dp",)), in_specs=P(), out_specs=P())
    x = _randn(3, grad=True)
    with ns.CommMode() as comms:
        f(x).sum().backward()
    assert comms.events == []
    assert torch.equal(x.grad, torch.ones(3, dtype=F64))


def test_psum_to_replicated_runs_nothing_in_backward():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    f = ns.spmd_map(
        lambda x: ns.psum(x, ("dp", "tp")), mesh=mesh, in_specs=P(("dp", "tp")), out_specs=P()
    )
    x = _randn(8, grad=True)
    with ns.CommMode() as comms:
        f(x).pow(2).sum().backward()
    assert forward_counts(comms) == {("psum", ("dp", "tp")): 1}
    assert backward_counts(comms) == {}


# --- data parallel: one all-reduce per parameter -------------------------------------------------


def dp_step(w1, b1, w2, x, y, reduce):
    h = torch.tanh(x @ w1 + b1)
    pred = (h @ w2)[:, 0] + 0.1 * (x @ w1).sum(-1) + ((x * x) @ w1).mean(-1)  # w1: three ops
    loss = ((pred - y) ** 2).mean()
    return ns.pmean(loss, "dp") if reduce == "pmean" else ns.psum(loss, "dp") / 4


def _dp_inputs():
    params = [_randn(5, 6, seed=1, grad=True), _randn(6, seed=2, grad=True)]
    params.append(_randn(6, 1, seed=3, grad=True))
    return params, _randn(8, 5, seed=4), _randn(8, seed=5)


@pytest.mark.parametrize("reduce", ["pmean", "psum"])
@pytest.mark.parametrize("how", ["backward", "func.grad"])
def test_data_parallel_runs_one_all_reduce_per_parameter(reduce, how):
    mesh = ns.make_mesh((4,), ("dp",))
    f = ns.spmd_map(
        lambda *a: dp_step(*a, reduce=reduce),
        mesh=mesh,
        in_specs=(P(), P(), P(), P("dp"), P("dp")),
        out_specs=P(),
    )
    params, x, y = _dp_inputs()
    with ns.CommMode() as comms:
        if how == "backward":
            f(*params, x, y).backward()
        else:
            grad(lambda *p: f(*p, x, y), argnums=(0, 1, 2))(*(p.detach() for p in params))
    assert backward_counts(comms) == {("psum", ("dp",)): 3}
    shapes = sorted(e.shape for e in comms.events if e.direction == "backward")
    assert shapes == sorted(tuple(p.shape) for p in params)  # one per parameter, its gradient
    assert all(e.implicit for e in comms.events if e.direction == "backward")
    assert forward_counts(comms) == {(reduce, ("dp",)): 1}


def test_recording_does_not_change_gradients():
    mesh = ns.make_mesh((4,), ("dp",))
    specs = (P(), P(), P(), P("dp"), P("dp"))
    f = ns.spmd_map(lambda *a: dp_step(*a, "pmean"), mesh=mesh, in_specs=specs, out_specs=P())
    params, x, y = _dp_inputs()
    plain = torch.autograd.grad(f(*params, x, y), params)
    with ns.CommMode():
        recorded = torch.autograd.grad(f(*params, x, y), params)
    for a, b in zip(plain, recorded):
        assert torch.equal(a, b)


def test_frozen_parameter_costs_no_backward_collective():
    mesh = ns.make_mesh((4,), ("dp",))
    f = ns.spmd_map(
        lambda w, x: ns.pmean((x @ w).sum(), "dp"),
        mesh=mesh,
        in_specs=(P(), P("dp")),
        out_specs=P(),
    )
    x = _randn(8, 5, seed=1, grad=True)
    with ns.CommMode() as comms:
        f(_randn(5, 3), x).backward()  # w does not require grad; x is varying
    assert backward_counts(comms) == {}


def test_explicit_and_implicit_pvary_count_the_same():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    specs = (P(), P(), P(("dp", "tp")))

    def implicit(w, b, x):  # w and b each used by two ops
        h = torch.tanh(x @ w + b)
        return ns.psum((x @ w).sum() + (h * b).sum(), ("dp", "tp"))

    def explicit(w, b, x):
        w, b = ns.pvary(w, ("dp", "tp")), ns.pvary(b, ("dp", "tp"))
        return implicit(w, b, x)

    counts = []
    for fn in (implicit, explicit):
        f = ns.spmd_map(fn, mesh=mesh, in_specs=specs, out_specs=P())
        w, b, x = _randn(3, 4, seed=1, grad=True), _randn(4, seed=2, grad=True), _randn(8, 3)
        with ns.CommMode() as comms:
            f(w, b, x).backward()
        counts.append(comms.counts())
    assert (
        counts[0]
        == counts[1]
        == {
            ("forward", "psum", ("dp", "tp")): 1,
            ("backward", "psum", ("dp", "tp")): 2,
        }
    )


def test_one_psum_per_tensor_and_missing_axes():
    """The cache is per (tensor, missing axes): a use that misses other axes is another psum."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))

    def fn(w, x, z):
        a = (x * w).sum() + (x * w * w).sum()  # w misses dp: once
        b = (z * w).sum() + (z + w).sum()  # w misses dp and tp: once more
        return ns.psum(a, "dp") + ns.psum(b, ("dp", "tp"))

    f = ns.spmd_map(fn, mesh=mesh, in_specs=(P(), P("dp"), P(("dp", "tp"))), out_specs=P())
    w = _randn(3, seed=1, grad=True)
    with ns.CommMode() as comms:
        f(w, _randn(6, 3, seed=2), _randn(12, seed=3)).backward()
    assert backward_counts(comms) == {("psum", ("dp",)): 1, ("psum", ("dp", "tp")): 1}


# --- Megatron ------------------------------------------------------------------------------------


def test_megatron_mlp_counts():
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))

    @ns.spmd_map(
        mesh=mesh,
        in_specs=(P("dp", None), P(None, "tp"), P("tp"), P("tp", None), P()),
        out_specs=P("dp", None),
    )
    def mlp(x, w1, b1, w2, b2):
        return ns.psum(torch.tanh(x @ w1 + b1) @ w2, "tp") + b2

    args = [_randn(6, 5, seed=1), _randn(5, 8, seed=2), _randn(8, seed=3)]
    args += [_randn(8, 3, seed=4), _randn(3, seed=5)]
    args = [a.requires_grad_() for a in args]
    with ns.CommMode() as comms:
        mlp(*args).pow(2).sum().backward()
    assert forward_counts(comms) == {("psum", ("tp",)): 1}  # Megatron's "g"
    # every parameter's gradient all-reduced over dp once; the input's over tp once ("f")
    assert backward_counts(comms) == {("psum", ("dp",)): 4, ("psum", ("tp",)): 1}
    by_shape = {e.shape: e.axes for e in comms.events if e.direction == "backward"}
    assert by_shape[(3, 5)] == ("tp",)  # x's local block
    assert by_shape[(5, 2)] == ("dp",)  # w1's local block


# --- each collective's transpose -----------------------------------------------------------------

MESH22 = ns.make_mesh((2, 2), ("a", "b"))
TRANSPOSES = {
    "psum": (lambda x: ns.psum(x, "a"), P(None, "b"), {}),
    "pmean": (lambda x: ns.pmean(x, "a"), P(None, "b"), {}),
    "pmax": (lambda x: ns.pmax(x, "a"), P(None, "b"), {("psum", ("a",)): 1}),
    "pmin": (lambda x: ns.pmin(x, "a"), P(None, "b"), {("psum", ("a",)): 1}),
    "all_gather": (
        lambda x: ns.all_gather(x, "a", tiled=True),
        P(("a", "b")),
        {("psum_scatter", ("a",)): 1},
    ),
    "all_gather invariant": (
        lambda x: ns.all_gather(x, "a", tiled=True, to="invariant"),
        P(None, "b"),
        {},
    ),
    "psum_scatter": (
        lambda x: ns.psum_scatter(x, "a", tiled=True),
        P(("a", "b")),
        {("all_gather", ("a",)): 1},
    ),
    "all_to_all": (
        lambda x: ns.all_to_all(x, "a", 0, 1, tiled=True),
        P(("a", "b")),
        {("all_to_all", ("a",)): 1},
    ),
    "ppermute": (
        lambda x: ns.ppermute(x, "a", [(0, 1), (1, 0)]),
        P(("a", "b")),
        {("ppermute", ("a",)): 1},
    ),
    "pshuffle": (lambda x: ns.pshuffle(x, "a", [1, 0]), P(("a", "b")), {("pshuffle", ("a",)): 1}),
    # the output stays invariant over "b", which its out_spec names: tiled, its cotangent is
    # summed over "b" too (the real backend runs that psum at the boundary)
    "pvary": (
        lambda x: ns.pvary(x, "a"),
        P(("a", "b")),
        {("psum", ("a",)): 1, ("psum", ("b",)): 1},
    ),
}


def _transpose_case(name):
    """The mapped function of ``TRANSPOSES[name]``, its input and the expected counts."""
    fn, out_spec, want = TRANSPOSES[name]
    in_spec = P() if name == "pvary" else P("a", "b")
    f = ns.spmd_map(fn, mesh=MESH22, in_specs=in_spec, out_specs=out_spec)
    return f, _randn(4, 4, seed=1, grad=True), want


@pytest.mark.parametrize("name", list(TRANSPOSES))
def test_each_collective_records_its_transpose(name):
    f, x, want = _transpose_case(name)
    with ns.CommMode() as comms:
        f(x).pow(2).sum().backward()
    assert backward_counts(comms) == want
    assert sum(forward_counts(comms).values()) == (0 if name == "pvary" else 1)


#: what each collective's jvp runs on the tangent: the collective itself where it is linear
#: (pvary, a cast, communicates nothing); pmax and pmin: one psum of the tie mask and one of the
#: tangent's share
TANGENTS = {name: {} if name == "pvary" else {(name.split()[0], ("a",)): 1} for name in TRANSPOSES}
TANGENTS["pmax"] = TANGENTS["pmin"] = {("psum", ("a",)): 2}


@pytest.mark.parametrize("how", ["jvp over", "jvp inside", "forward_ad"])
@pytest.mark.parametrize("name", list(TRANSPOSES))
def test_each_collective_records_its_tangent(name, how):
    fn, out_spec, _ = TRANSPOSES[name]
    in_spec = P() if name == "pvary" else P("a", "b")
    x, t = _randn(4, 4, seed=1), _randn(4, 4, seed=2)
    with ns.CommMode() as comms:
        if how == "jvp over":
            f = ns.spmd_map(fn, mesh=MESH22, in_specs=in_spec, out_specs=out_spec)
            jvp(f, (x,), (t,))
        elif how == "jvp inside":
            f = ns.spmd_map(
                lambda x, t: jvp(fn, (x,), (t,))[1],
                mesh=MESH22,
                in_specs=(in_spec, in_spec),
                out_specs=out_spec,
            )
            f(x, t)
        else:
            f = ns.spmd_map(fn, mesh=MESH22, in_specs=in_spec, out_specs=out_spec)
            with forward_ad.dual_level():
                forward_ad.unpack_dual(f(forward_ad.make_dual(x, t)))
    assert tangent_counts(comms) == TANGENTS[name]
    assert sum(forward_counts(comms).values()) == (0 if name == "pvary" else 1)
    assert backward_counts(comms) == {}
    assert all(e.shape == (2, 2) for e in comms.events if e.direction == "tangent")


def test_no_tangent_collective_without_a_tangent():
    """Inside a forward-AD level, a collective of a value with no tangent records none."""
    f = ns.spmd_map(
        lambda x: ns.psum(x, "a"), mesh=MESH22, in_specs=P("a", "b"), out_specs=P(None, "b")
    )
    with ns.CommMode() as comms, forward_ad.dual_level():
        f(_randn(4, 4))
    assert tangent_counts(comms) == {}
    assert forward_counts(comms) == {("psum", ("a",)): 1}


#: a double backward's collectives: the first backward's (TRANSPOSES), again in the second
#: (it differentiates the forward's graph too), and the second-order ones: the psum of the
#: pvary that starts the transpose of a result that dropped the axes, or a communicating
#: transpose's own transpose, the collective itself
TWICE = {
    "psum": {("psum", ("a",)): 1},
    "pmax": {("psum", ("a",)): 3},  # the tie mask's psum twice, the pvary's once
    "all_gather": {("psum_scatter", ("a",)): 2, ("all_gather", ("a",)): 1},
    "all_gather invariant": {("psum", ("a",)): 1},
    "ppermute": {("ppermute", ("a",)): 3},
    # the pvarys' psums, in each backward: a psum's transpose communicates nothing
    "pvary": {("psum", ("a",)): 2, ("psum", ("b",)): 2},
}


@pytest.mark.parametrize("name", list(TWICE))
def test_double_backward_records_the_transposes_of_transposes(name):
    f, x, _ = _transpose_case(name)
    with ns.CommMode() as comms:
        (g,) = torch.autograd.grad(f(x).pow(3).sum(), x, create_graph=True)
        g.pow(2).sum().backward()
    assert backward_counts(comms) == TWICE[name]


def test_bytes_and_summary():
    f = ns.spmd_map(
        lambda x: ns.psum(x, "a"), mesh=MESH22, in_specs=P("a", "b"), out_specs=P(None, "b")
    )
    with ns.CommMode() as comms:
        f(_randn(4, 8))
    (event,) = comms.events
    assert (event.op, event.axes, event.direction, event.shape) == (
        "psum",
        ("a",),
        "forward",
        (2, 4),
    )
    assert event.nbytes == 2 * 4 * 8
    line = [r for r in comms.summary().splitlines() if r.startswith("forward")][0]
    assert line.split() == ["forward", "psum", "a", "1", "64", "B"]


# --- exactly once per logical event, whatever the levels -----------------------------------------

MESH222 = ns.make_mesh((2, 2, 2), ("a", "b", "c"))


@ns.spmd_map(mesh=MESH222, in_specs=(P("a", "c"), P(), P("b")), out_specs=P())
def nested_program(x, w, z):
    g = ns.all_gather(x, "b", tiled=True)  # x invariant over b: implicit pvary, then gather
    h = torch.tanh(g * w) * z.sum()  # w misses a, b, c; z misses a, c
    return ns.psum(h.sum(), ("a", "b", "c")) + 0.5 * ns.pmax(h.sum(), ("a", "b", "c"))


NESTED_BACKWARD = {
    ("psum", ("b",)): 1,  # all_gather's implicit pvary of x
    ("psum_scatter", ("b",)): 1,  # all_gather's transpose
    ("psum", ("a", "b", "c")): 2,  # w's implicit pvary; pmax's tie-mask psum
    ("psum", ("a", "c")): 1,  # z's implicit pvary
}


def _nested_inputs():
    return _randn(4, 6, seed=1), _randn(3, seed=2), _randn(4, seed=3)


def _loss(x, w, z):
    return nested_program(x, w, z)


@pytest.mark.parametrize("how", ["backward", "func.grad", "vmap of grad", "jacrev", "grad of vmap"])
def test_backward_marker_records_once_per_logical_event(how):
    x, w, z = _nested_inputs()
    with ns.CommMode() as comms:
        if how == "backward":
            args = [t.requires_grad_() for t in (x, w, z)]
            _loss(*args).backward()
        elif how == "func.grad":
            grad(_loss, argnums=(0, 1, 2))(x, w, z)
        elif how == "vmap of grad":  # per-example gradients: one logical program, batched
            vmap(grad(_loss, argnums=(0, 1, 2)), in_dims=(0, None, None))(
                torch.stack([x, x + 1]), w, z
            )
        elif how == "jacrev":
            jacrev(lambda x, w, z: _loss(x, w, z).reshape(1), argnums=(0, 1, 2))(x, w, z)
        else:
            grad(lambda w: vmap(_loss, in_dims=(0, None, None))(torch.stack([x, x]), w, z).sum())(w)
    if how == "grad of vmap":  # only w is differentiated: x's and z's transposes are not needed
        assert backward_counts(comms) == {("psum", ("a", "b", "c")): 2}
    else:
        assert backward_counts(comms) == NESTED_BACKWARD


#: the tangents of nested_program's collectives: all_gather's, psum's, and pmax's two psums;
#: the implicit pvarys' tangents communicate nothing
NESTED_TANGENT = {("all_gather", ("b",)): 1, ("psum", ("a", "b", "c")): 3}


@pytest.mark.parametrize("how", ["jvp", "jacfwd", "vmap of jvp", "jvp of grad"])
def test_tangent_marker_records_once_per_logical_event(how):
    x, w, z = _nested_inputs()
    tx, tw, tz = _randn(4, 6, seed=4), _randn(3, seed=5), _randn(4, seed=6)
    with ns.CommMode() as comms:
        if how == "jvp":
            jvp(_loss, (x, w, z), (tx, tw, tz))
        elif how == "jacfwd":  # a batch of tangents: one logical program, batched
            jacfwd(_loss, argnums=1)(x, w, z)
        elif how == "vmap of jvp":
            vmap(lambda t: jvp(lambda w: _loss(x, w, z), (w,), (t,))[1])(torch.stack([tw, tw]))
        else:  # forward over reverse: the backward's collectives have tangents too
            jvp(lambda w: grad(_loss, argnums=1)(x, w, z), (w,), (tw,))
    if how == "jvp":
        assert tangent_counts(comms) == NESTED_TANGENT
    elif how == "jvp of grad":
        # forward: h's psum and pmax (two) have tangents (x has none: no gather's); backward
        # (w only): the psum of w's implicit pvary has one, pmax's tie mask none
        assert tangent_counts(comms) == {("psum", ("a", "b", "c")): 4}
    else:  # only w has a tangent: x's gather has none
        assert tangent_counts(comms) == {("psum", ("a", "b", "c")): 3}
    assert {k[1:]: n for k, n in comms.counts().items() if k[0] == "forward"} == {
        ("all_gather", ("b",)): 1,
        ("psum", ("a", "b", "c")): 1,
        ("pmax", ("a", "b", "c")): 1,
    }


def test_recording_mode_only_while_recording():
    depth = []
    f = ns.spmd_map(
        lambda x: depth.append(torch._C._len_torch_function_stack()) or x,
        mesh=MESH22,
        in_specs=P("a"),
        out_specs=P("a"),
    )
    f(_randn(4))
    with ns.CommMode():
        f(_randn(4))
    # one mode more while recording (the first is the call's marker, _calls.CallMarker, which
    # also types the ops of a call whose inputs hold blocks: SpmdContext.marker_typing)
    assert depth == [1, 2]


def test_the_cache_of_casts_makes_one_per_key_tag_and_version(monkeypatch):
    """``_accounting.memo_cast``, every cache of implicit casts: a hit hands back the cast made;
    a write to the operand or another tag makes another; one made with grad off (of an operand
    that needs grad) is not kept; each lookup reads the operand's version once, hit or miss."""
    from named_spmd import _accounting

    reads = []
    version = _accounting.cast_version
    monkeypatch.setattr(
        _accounting, "cast_version", lambda t: reads.append(t) or version(t), raising=True
    )
    cache: dict = {}
    w = torch.ones(3, requires_grad=True) * 1
    made: list = []

    def cast(tag: object = None) -> torch.Tensor:
        return _accounting.memo_cast(
            cache, id(w), w, lambda: made.append(1) or w.view_as(w), tag=tag
        )

    first = cast()
    assert cast() is first and len(made) == 1
    with torch.no_grad():
        w.add_(1)  # a write: the cached cast no longer serves
    second = cast()
    assert second is not first and cast() is second and len(made) == 2
    other = object()
    assert cast(other) is not second and cast(other) is cast(other) and len(made) == 3
    third = object()
    with torch.no_grad():
        assert cast(other) is cast(other)  # (made with grad: serves here too)
        assert cast(third) is not cast(third)  # (made without: per use, never cached)
    assert len(made) == 5 and cast(third) is cast(third) and len(made) == 6
    assert len(reads) == 13 and all(r is w for r in reads)
