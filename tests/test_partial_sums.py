"""Partial sums: unreduced (U) and reduced (R) values (docs/design.md section 2.2).

The programs with values and gradients are in the catalogue (tests/_programs.py, section "partial
sums"; tests/test_programs.py runs them on the simulated and abstract backends against the
per-instance reference, the dense program and JAX); here: the states and their display, specs,
the algebra's errors with pinned messages on every backend, gradcheck of each transpose pair,
deferred gradient reduction, and one launch of tests/partial_dist.py on 2 real processes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os

import _jax
import pytest
import torch
from _dist_launch import launch
from _partial_cases import (
    BOUNDARY,
    BOUNDARY_COT,
    BOUNDARY_X,
    ERRORS,
    deferred_grads,
    dense_grads,
    run_error,
)
from _partial_sampler import REAL_CASES
from _programs import PARTIAL_PROGRAMS

import named_spmd as ns
from named_spmd import P, Vma

F64 = torch.float64


# --- states, display, specs ----------------------------------------------------------------------


def test_vma_states_algebra_and_text():
    u = Vma.make(("dp",), ("tp",))
    assert u.text(("dp", "tp")) == "{dp, U:tp}"
    assert Vma.make((), ("tp",), ("ep",)).text() == "{U:tp, R:ep}"
    assert u is Vma.make({"dp"}, {"tp"})  # interned
    assert u.remove(("tp",)) is Vma.of(("dp",))  # psum of U: invariant there
    assert u.add(("tp",)) is Vma.of(("dp", "tp"))  # psum_scatter of U: varying
    assert Vma.make((), (), ("dp",)).add(("dp",)) is Vma.of(("dp",))  # R -> V
    assert u != frozenset({"dp"}) and Vma.of(("dp",)) == frozenset({"dp"})
    assert Vma.make((), (), ("dp",))  # reduced only: not "invariant everywhere"
    with pytest.raises(ValueError):
        Vma.make(("tp",), ("tp",))


@pytest.mark.parametrize("name", ["varying", "unreduced", "reduced", "partial", "_hash", "_union"])
def test_interned_vma_refuses_assignment_and_deletion(name):
    """Interned: one object per type, so a change to one would change every later value of
    that type (its hash, its memos)."""
    u = Vma.make(("dp",), ("tp",))
    before = (u.varying, u.unreduced, u.reduced, u.partial, hash(u))
    with pytest.raises(AttributeError, match="immutable"):
        delattr(u, name)
    with pytest.raises(AttributeError, match="immutable"):
        setattr(u, name, frozenset())
    again = Vma.make(("dp",), ("tp",))
    assert again is u
    assert (again.varying, again.unreduced, again.reduced, again.partial, hash(again)) == before


def test_typeof_shows_unreduced_and_reduced():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    seen = []

    @ns.spmd_map(mesh=mesh, in_specs=(P("dp", "tp"), P(reduced={"dp"})), out_specs=P("dp"))
    def f(x, w):
        u = ns.pcast(x, "tp", to="unreduced")
        seen.extend([ns.typeof(u), ns.typeof(w), ns.typeof(u * 2.0), ns.vma(u)])
        return ns.psum(u, "tp")

    x = torch.arange(32.0).reshape(4, 8)
    torch.testing.assert_close(f(x, torch.ones(3)), x[:, :4] + x[:, 4:])
    assert [repr(t) for t in seen[:3]] == [
        "f32[2,4]{dp, U:tp}",
        "f32[3]{R:dp}",
        "f32[2,4]{dp, U:tp}",
    ]
    assert seen[3] == frozenset({"dp"})  # ns.vma: the varying axes
    assert repr(f.check(x, torch.ones(3)).types) == "[f32[2,4]{dp}]"


def test_partition_spec_states():
    a = P("dp", unreduced={"tp"})
    assert a == P("dp", unreduced="tp") and a != P("dp") and hash(a) != hash(P("dp"))
    assert repr(a) == "P('dp', unreduced={'tp'})"
    assert P("dp") == ("dp",) and a.vma() is Vma.make(("dp",), ("tp",))
    import pickle

    assert pickle.loads(pickle.dumps(a)) == a
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    f = ns.spmd_map(lambda x: x, mesh=mesh, in_specs=P("dp", reduced={"dp", "ep"}), out_specs=P())
    with pytest.raises(ns.SpecError) as e:
        f(torch.ones(4))
    assert "unknown mesh axis 'ep' in reduced=" in str(e.value)
    assert "axes ('dp',) are given two states" in str(e.value)
    with pytest.raises(ns.SpecError, match="takes an axis name or a set of names"):
        P(unreduced=3)


def test_unreduced_input_and_output_on_the_simulated_mesh():
    """An unreduced input: parts summing to the global value (the first member holds it); an
    unreduced output: the sum of the parts."""
    mesh = ns.make_mesh((2,), ("i",))
    f = ns.spmd_map(
        lambda u: 3.0 * u, mesh=mesh, in_specs=P(unreduced={"i"}), out_specs=P(unreduced={"i"})
    )
    x = torch.arange(4.0, dtype=F64, requires_grad=True)
    y = f(x)
    torch.testing.assert_close(y, 3 * x.detach())
    (g,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(g, torch.full((4,), 3.0, dtype=F64))
    g = ns.spmd_map(lambda u: u, mesh=mesh, in_specs=P(unreduced={"i"}), out_specs=P())
    with pytest.raises(ns.VmaError, match=r"unreduced over \('i',\)"):
        g(x)


def test_an_unreduced_output_of_negative_zeros_sums_to_negative_zero():
    """An unreduced output is the sum of its parts, added as a mesh adds them: parts that are
    all -0.0 sum to -0.0 (IEEE), on both simulations, as the sum of the per-instance blocks."""
    mesh = ns.make_mesh((2, 2), ("x", "y"))
    x = torch.tensor([[-0.0, -0.0], [-0.0, 0.0], [-0.0, -0.0], [-0.0, -0.0]], dtype=F64)
    blocks = x.chunk(4)
    want = blocks[0] + blocks[1] + blocks[2] + blocks[3]
    f = ns.spmd_map(
        lambda v: v,
        mesh=mesh,
        in_specs=P(("x", "y")),
        out_specs=P(unreduced={"x", "y"}),
        check_vma=False,
    )
    for per_instance in (False, True):
        with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
            got = f(x)
        assert torch.equal(got, want)
        assert torch.equal(torch.signbit(got), torch.signbit(want)), (per_instance, got)


# --- the algebra's errors: simulated and abstract (real processes: test_real_processes) ---------


@pytest.mark.parametrize("name", sorted(ERRORS))
def test_error(name):
    case = ERRORS[name]
    got = run_error(name, simulated=True)
    assert got["error"] == case.error.__name__, got
    for pinned in case.pinned:
        assert pinned in got["message"], (pinned, got["message"])
    assert run_error(name, check=True) == got  # the abstract backend: the same error


def test_error_names_the_users_line():
    got = run_error("bias_before_psum", simulated=True)
    assert "at _partial_cases.py:" in got["message"]
    assert "ns.psum(_partial(x, w) + b" in got["message"]


def test_linear_ops_keep_unreduced_and_metadata_is_fine():
    mesh = ns.make_mesh((2,), ("i",))
    types = []

    @ns.spmd_map(mesh=mesh, in_specs=(P("i"), P()), out_specs=P())
    def f(x, w):
        u = ns.pcast(x, "i", to="unreduced")
        r = ns.pcast(w, "i", to="reduced")
        parts = [-u, u - u, u * 2.0, 2.0 * u, u @ r, r @ u.reshape(2, 2), u.T, u[1:], u.sum()]
        parts += [u.reshape(4), torch.stack([u, u]), torch.cat([u, u]), sum([u, u]), u / 2.0]
        types.extend(repr(ns.typeof(p)) for p in parts)
        assert u.shape == (2, 2) and u.dtype == torch.float32 and u.dim() == 2  # metadata
        return ns.psum(u @ r, "i")

    x = torch.arange(8.0).reshape(4, 2)
    w = torch.tensor([[1.0, 2.0], [3.0, 4.0]])
    torch.testing.assert_close(f(x, w), (x[:2] + x[2:]) @ w)
    assert all("U:i" in t for t in types), types


# --- gradcheck of each transpose pair (float64, simulated and real backends agree in the
# catalogue; here torch.autograd.gradcheck against finite differences) ----------------------------


def _gradcheck(fn, in_specs, out_specs, *shapes, sizes=(2,), names=("i",)):
    mesh = ns.make_mesh(sizes, names)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    gen = torch.Generator().manual_seed(3)
    args = [torch.randn(s, generator=gen, dtype=F64, requires_grad=True) for s in shapes]
    assert torch.autograd.gradcheck(f, args)
    assert torch.autograd.gradgradcheck(f, args)


TRANSPOSE_PAIRS = {
    # psum of unreduced (U -> I) <-> cast I -> R
    "psum_of_unreduced": (lambda x: ns.psum(ns.pcast(x, "i", to="unreduced") * 3.0, "i"), P("i"), P(), (4, 3)),
    "cast_to_reduced": (lambda w, x: ns.psum((x @ ns.pcast(w, "i", to="reduced")).sum(0), "i"), (P(), P("i")), P(), (3, 2), (4, 3)),
    # cast V -> U <-> cast R -> V
    "cast_to_unreduced": (lambda x: ns.pcast(x, "i", to="unreduced"), P("i"), P(unreduced={"i"}), (4, 3)),
    "reduced_input_to_varying": (lambda w, x: (x * w).sum(0), (P(reduced={"i"}), P("i")), P("i"), (3,), (4, 3)),
    # psum_scatter of unreduced (U -> V) <-> all_gather to reduced (V -> R)
    "psum_scatter_of_unreduced": (lambda x: ns.psum_scatter(ns.pcast(x, "i", to="unreduced"), "i", tiled=True), P("i"), P("i"), (8, 3)),
    "all_gather_to_reduced": (lambda x: torch.tanh(ns.all_gather(x, "i", tiled=True, to="reduced")), P("i"), P(), (4, 3)),
    # U -> V: the partial sum as a local value
    "unreduced_to_varying": (lambda x: torch.relu(ns.pcast(ns.pcast(x, "i", to="unreduced"), "i", to="varying")), P("i"), P("i"), (4, 3)),
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TRANSPOSE_PAIRS))
def test_gradcheck_transpose_pairs(name):
    fn, in_specs, out_specs, *shapes = TRANSPOSE_PAIRS[name]
    _gradcheck(fn, in_specs, out_specs, *shapes)


# --- deferred gradient reduction -----------------------------------------------------------------


def test_deferred_gradient_reduction_simulated():
    """Reduced parameters, 4 microbatches: no backward communication; then one psum per
    parameter; the gradients equal the dense ones."""
    grads, _, comms = deferred_grads(ns.make_mesh((2,), ("dp",)))
    want = dense_grads()
    for g, k in zip(grads, sorted(want)):
        torch.testing.assert_close(g, want[k], rtol=1e-12, atol=1e-12)
    # 4 loss psums and one psum per parameter (3), all forward; none in backward
    assert comms == {"forward psum ('dp',)": 7}


# --- the call boundary: partial-sum specs of inputs and outputs (tests/_partial_cases.BOUNDARY) ---


def _dense_boundary(name: str) -> dict:
    """Each case's global function written densely, and its gradient by autograd."""
    x, cot = BOUNDARY_X.clone().requires_grad_(), BOUNDARY_COT
    if name == "unreduced_roundtrip":
        parts = torch.tanh(x[:2]) + torch.tanh(x[2:])
        out = parts**2
        (grad,) = torch.autograd.grad((out * cot[:2]).sum(), x)
        return dict(parts=parts, out=out, grad=grad, leaf_grad=2 * parts * cot[:2])
    dense = {
        # every instance holds v * v, a part of the output: their sum, n copies
        "unchecked_invariant_to_unreduced": lambda v: 2 * v * v,
        "unchecked_varying_to_unreduced": lambda v: v[:2] ** 2 + v[2:] ** 2,
        # instance 0 holds the whole input (the others zeros): its value
        "unchecked_unreduced_to_invariant": lambda v: v + v,
        "passed_twice_reduced_first": lambda v: 2 * v * torch.sin(v) + v,
        "passed_twice_invariant_first": lambda v: 2 * v * torch.sin(v) + v,
    }[name]
    out = dense(x)
    (grad,) = torch.autograd.grad((out * cot[: out.shape[0]]).sum(), x)
    if name.startswith("passed_twice"):
        return dict(out=out, plain=out, grad=grad)
    return dict(out=out, grad=grad)


def _jax_boundary(name: str) -> dict:
    """The case under ``jax.shard_map`` (Explicit axes, which its partial-sum specs need): the
    values, and the gradients where JAX's transposes are the global function's (under
    ``check_vma=False`` JAX keeps its old heuristics, which scale a cotangent by the axis size
    for an unmapped output; named_spmd differentiates the function it ran)."""
    jax = _jax.jax_module()
    jnp, lax, np = jax.numpy, jax.lax, __import__("numpy")
    JP = jax.sharding.PartitionSpec
    mesh = jax.sharding.Mesh(
        np.array(jax.devices()[:2]), ("x",), axis_types=(jax.sharding.AxisType.Explicit,)
    )

    def put(t, spec):
        return jax.device_put(jnp.asarray(t.numpy()), jax.sharding.NamedSharding(mesh, spec))

    def glob(a):  # the global value (an unreduced one: summed)
        return torch.from_numpy(np.array(jax.reshard(a, JP())))

    def smap(fn, in_specs, out_specs, check_vma=True):
        return jax.shard_map(
            fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )

    U, R = JP(unreduced={"x"}), JP(reduced={"x"})
    x, cot = BOUNDARY_X, BOUNDARY_COT
    with jax.set_mesh(mesh):
        if name == "unreduced_roundtrip":
            mk = smap(lambda v: lax.pcast(jnp.tanh(v), "x", to="unreduced"), JP("x"), U)
            ar = smap(lambda u: lax.psum(u, "x") ** 2, U, JP())
            parts, pull_mk = jax.vjp(mk, put(x, JP("x")))
            out, pull_ar = jax.vjp(ar, parts)
            (leaf_grad,) = pull_ar(put(cot[:2], JP()))
            (grad,) = pull_mk(leaf_grad)
            return dict(
                parts=glob(parts), out=glob(out), grad=glob(grad), leaf_grad=glob(leaf_grad)
            )
        if name.startswith("unchecked_"):
            in_spec, out_spec = {
                "unchecked_invariant_to_unreduced": (JP(), U),
                "unchecked_varying_to_unreduced": (JP("x"), U),
                "unchecked_unreduced_to_invariant": (U, JP()),
            }[name]
            fn = (lambda v: v + v) if in_spec == U else (lambda v: v * v)
            out = smap(fn, in_spec, out_spec, check_vma=False)(put(x, in_spec))
            return dict(out=glob(out))
        specs = (R, JP()) if name == "passed_twice_reduced_first" else (JP(), R)

        def body(u, v):
            r, i = (u, v) if specs[0] == R else (v, u)
            return lax.psum(lax.pcast(r, "x", to="varying") * jnp.sin(i), "x") + i

        out, pull = jax.vjp(smap(body, specs, JP()), *(put(x, s) for s in specs))
        grads = pull(put(cot, JP()))  # one tensor at both positions: the sum of both
        return dict(out=glob(out), grad=glob(grads[0]) + glob(grads[1]))


def _boundary_types(name: str, compiled: bool) -> list[str] | None:
    """The argument types a case's eager calls saw (two calls: without and with autograd)."""
    if name == "passed_twice_reduced_first" and not compiled:
        return ["f64[4]{R:x}", "f64[4]{}"] * 2
    if name == "passed_twice_invariant_first" and not compiled:
        return ["f64[4]{}", "f64[4]{R:x}"] * 2
    return None


def _assert_boundary(got: dict, name: str, compiled: bool) -> None:
    tight = dict(rtol=1e-12, atol=1e-12)
    for want in (_dense_boundary(name), _jax_boundary(name)):
        for k, v in want.items():
            torch.testing.assert_close(torch.tensor(got[k], dtype=F64), v, **tight, msg=k)
    assert got.get("types") == _boundary_types(name, compiled)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(BOUNDARY))
def test_boundary_simulated(name, compiled):
    got = BOUNDARY[name](ns.make_mesh((2,), ("x",)), compiled)
    _assert_boundary(got, name, compiled)


# --- real processes -------------------------------------------------------------------------------


@functools.cache
def _real_outcomes():
    finished = launch([os.path.join("tests", "partial_dist.py")], 2, 300)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    return [json.loads(line) for line in finished.lines("OUTCOME")], finished.outputs[0][-3000:]


@pytest.mark.distributed
@pytest.mark.parametrize("name", PARTIAL_PROGRAMS)
def test_real_processes_program(name):
    outcomes, tail = _real_outcomes()
    got = [o for o in outcomes if o["kind"] == "program" and o["name"] == name]
    assert len(got) == 2, tail
    for o in got:
        assert o["ok"], o.get("why")


@pytest.mark.distributed
@pytest.mark.parametrize("name", sorted(ERRORS))
def test_real_processes_error(name):
    outcomes, tail = _real_outcomes()
    got = [o for o in outcomes if o["kind"] == "error" and o["name"] == name]
    assert len(got) == 2, tail
    want = run_error(name, simulated=True)
    for o in got:
        assert o["error"] == want["error"], o
        assert o["message"] == want["message"], (o["message"], want["message"])


@pytest.mark.distributed
def test_real_processes_deferred_reduction():
    """DTensor parameters with reduced specs: the accumulated gradients are Partial() DTensors;
    one psum per parameter gives the dense gradients; no backward communication."""
    outcomes, tail = _real_outcomes()
    got = [o for o in outcomes if o["kind"] == "deferred"]
    assert len(got) == 2, tail
    want = dense_grads()
    for o in got:
        assert set(o["placements"].values()) == {"(Partial(sum),)"}, o["placements"]
        assert o["comms"] == {"forward psum ('dp',)": 7}, o["comms"]
        for g, k in zip(o["grads"], sorted(want)):
            torch.testing.assert_close(torch.tensor(g, dtype=F64), want[k], rtol=1e-12, atol=1e-12)


@pytest.mark.distributed
@pytest.mark.parametrize("seed", [seed for seed, _ in REAL_CASES])
def test_real_processes_random_program(seed):
    """A random partial-sum program (tests/_partial_sampler.py) on 2 real processes: checked
    against the per-instance reference as on the simulated mesh, with the simulated run's
    outputs, gradients and types, or its error and message."""
    outcomes, tail = _real_outcomes()
    got = [o for o in outcomes if o["kind"] == "random" and o["seed"] == seed]
    assert len(got) == 2, tail
    refused = dict(REAL_CASES)[seed]
    for o in got:
        assert o["ok"], o.get("why")
        assert (o["outcome"] != "accepted") == refused, o


@pytest.mark.distributed
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("name", sorted(BOUNDARY))
def test_real_processes_boundary(name, compiled):
    """The same case on 2 real processes, eager and traced by torch.compile: the dense and JAX
    values and gradients, as on the simulated mesh (its types too)."""
    outcomes, tail = _real_outcomes()
    got = [
        o
        for o in outcomes
        if o["kind"] == "boundary" and o["name"] == name and o["compiled"] == compiled
    ]
    assert len(got) == 2, tail
    for o in got:
        assert o["ok"], o.get("why")
        _assert_boundary(o["result"], name, compiled)
