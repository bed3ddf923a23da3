"""Per-axis randomness (``ns.random``): draws differ over exactly the axes named by ``over``,
are typed so, follow the recipe stated in ``named_spmd/random.py`` (rebuilt here independently,
per instance), and agree between the simulated and the real backend (4 gloo processes)."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os

import pytest
import torch
from _dist_launch import launch

import named_spmd as ns
from named_spmd import P

MESH = ((2, 3), ("dp", "tp"))


def reference_generator(seed: tuple, coords: dict[str, int]) -> torch.Generator:
    """The documented recipe, written from its text: blake2b over the seed and the sorted
    ``axis=coordinate`` pairs of ``over``."""
    text = "named_spmd.random|" + repr(seed) + "|"
    text += ",".join(f"{a}={coords[a]}" for a in sorted(coords))
    k = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
    return torch.Generator().manual_seed(k)


def reference_blocks(over: tuple[str, ...], sizes: dict[str, int], seed: tuple, draw):
    """Every instance's draw along ``over`` (row-major, first name major), concatenated: what an
    out_spec ``P(over)`` assembles."""
    blocks = []
    for coords in itertools.product(*(range(sizes[a]) for a in over)):
        blocks.append(draw(reference_generator(seed, dict(zip(over, coords)))))
    return torch.cat(blocks) if blocks else None


DRAWS = {
    "rand": (
        lambda over, seed: ns.random.rand(2, 3, over=over, seed=seed),
        lambda g: torch.rand(2, 3, generator=g),
    ),
    "randn": (
        lambda over, seed: ns.random.randn((2, 3), over=over, seed=seed, dtype=torch.float64),
        lambda g: torch.randn(2, 3, generator=g, dtype=torch.float64),
    ),
    "randint": (
        lambda over, seed: ns.random.randint(-5, 50, (2, 3), over=over, seed=seed),
        lambda g: torch.randint(-5, 50, (2, 3), generator=g),
    ),
}
OVERS = [(), ("dp",), ("tp",), ("dp", "tp"), ("tp", "dp")]


@pytest.mark.parametrize("over", OVERS, ids=lambda o: "-".join(o) or "none")
@pytest.mark.parametrize("name", sorted(DRAWS))
def test_draws_vary_over_exactly_the_named_axes(name, over):
    mesh = ns.make_mesh(*MESH)
    ours, theirs = DRAWS[name]
    seen = {}

    def f():
        r = ours(over, (11, "layer"))
        seen["vma"], seen["type"] = ns.vma(r), ns.typeof(r)
        return r

    # out_specs leave every other axis out: the check passes only if the draw is invariant there
    got = ns.spmd_map(f, mesh=mesh, in_specs=(), out_specs=P(over or None))()
    sizes = dict(zip(*reversed(MESH)))
    expected = reference_blocks(over, sizes, (11, "layer"), theirs)
    if not over:
        expected = theirs(reference_generator((11, "layer"), {}))
    assert torch.equal(got, expected)
    assert seen["vma"] == frozenset(over)
    assert seen["type"].dtype == expected.dtype
    report = ns.spmd_map(f, mesh=mesh, in_specs=(), out_specs=P(over or None)).check()
    assert report.outputs[0].type.vma == frozenset(over)  # the abstract backend types it alike
    if over:  # leaving a varying axis out of out_specs is the usual VmaError
        with pytest.raises(ns.VmaError, match="varies over"):
            ns.spmd_map(f, mesh=mesh, in_specs=(), out_specs=P())()


def test_a_draw_depends_only_on_seed_and_coordinates():
    """Not on the mesh's sizes, nor on axes outside over, nor on torch's global generator, which
    it leaves as it was."""

    def draw():
        return ns.random.rand(4, over="dp", seed=3)

    def run(shape, names):
        mesh = ns.make_mesh(shape, names)
        return ns.spmd_map(draw, mesh=mesh, in_specs=(), out_specs=P("dp"))()

    torch.manual_seed(0)
    state = torch.get_rng_state()
    wide = run((4, 2), ("dp", "tp"))
    assert torch.equal(torch.get_rng_state(), state)  # torch's stream is neither read nor moved
    torch.manual_seed(1)
    narrow = run((2,), ("dp",))
    single = run((1, 3), ("tp", "dp"))[:4]  # a size-1 "dp" axis: coordinate 0's draw
    assert torch.equal(narrow, wide[:8]) and torch.equal(single, wide[:4])
    assert not torch.equal(wide[:4], wide[4:8])  # the instances along dp differ


def _dropout_program(over, p, dtype=torch.float64):
    mesh = ns.make_mesh(*MESH)
    x = torch.randn(6, 5, dtype=dtype, requires_grad=True)  # dp splits rows, tp replicates
    f = ns.spmd_map(
        lambda x: ns.random.dropout(x, p, over=over, seed=("drop", 1)),
        mesh=mesh,
        in_specs=P("dp"),
        out_specs=P("dp"),
    )
    return mesh, x, f


def _dropout_mask(over, p, shape) -> torch.Tensor:
    """The reference mask of every dp block, from the recipe: float32 uniforms kept where >= p."""
    sizes = dict(zip(*reversed(MESH)))
    blocks = []
    for d in range(sizes["dp"]):
        coords = {a: {"dp": d, "tp": 0}[a] for a in over}
        u = torch.rand(shape, generator=reference_generator(("drop", 1), coords))
        blocks.append(u >= p)
    return torch.cat(blocks)


@pytest.mark.parametrize("over", [(), ("dp",)], ids=["none", "dp"])
def test_dropout_values_and_gradient_follow_the_mask(over):
    p = 0.3
    _, x, f = _dropout_program(over, p)
    y = f(x)
    mask = _dropout_mask(over, p, (3, 5)).to(x.dtype)
    torch.testing.assert_close(y, x * mask / (1 - p), rtol=1e-15, atol=0)
    cotangent = torch.randn_like(y)
    (grad,) = torch.autograd.grad(y, x, cotangent)
    torch.testing.assert_close(grad, mask * cotangent / (1 - p), rtol=1e-15, atol=0)
    if not over:  # one mask on every instance
        assert torch.equal(mask[:3], mask[3:])
    else:
        assert not torch.equal(mask[:3], mask[3:])


def test_dropout_of_an_invariant_value_varies_and_sums_its_gradient():
    """A replicated x under a dp-varying mask varies over dp; its gradient is the sum over dp
    of the instances' masked cotangents (the implicit pvary's psum)."""
    p = 0.5
    mesh = ns.make_mesh(*MESH)
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    seen = {}

    def f(x):
        y = ns.random.dropout(x, p, over="dp", seed=("drop", 1))
        seen["vma"] = ns.vma(y)
        return y

    y = ns.spmd_map(f, mesh=mesh, in_specs=P(), out_specs=P("dp"))(x)
    assert seen["vma"] == {"dp"}
    mask = _dropout_mask(("dp",), p, (3, 5)).to(x.dtype)
    torch.testing.assert_close(y, x.repeat(2, 1) * mask / (1 - p), rtol=1e-15, atol=0)
    (grad,) = torch.autograd.grad(y.sum(), x)
    torch.testing.assert_close(grad, (mask[:3] + mask[3:]) / (1 - p), rtol=1e-15, atol=0)


def test_communication_of_a_dropout_is_the_same_run_and_checked():
    """The one collective a dp-varying mask implies for a replicated x: its gradient's psum over
    dp in backward, on the simulated run and in the abstract check alike."""
    mesh = ns.make_mesh(*MESH)
    f = ns.spmd_map(
        lambda x: ns.random.dropout(x, 0.5, over="dp", seed=0),
        mesh=mesh,
        in_specs=P(),
        out_specs=P("dp"),
    )
    x = torch.randn(3, 5, requires_grad=True)
    with ns.CommMode() as comms:
        f(x).sum().backward()
    assert comms.events == f.check(x).events
    assert comms.counts() == {("backward", "psum", ("dp",)): 1}


def test_dropout_mask_is_the_same_for_every_dtype_and_off_outside_training():
    _, x, f64 = _dropout_program(("dp",), 0.25)
    _, _, f32 = _dropout_program(("dp",), 0.25, torch.float32)
    assert torch.equal(f64(x) != 0, f32(x.float()) != 0)
    mesh = ns.make_mesh(*MESH)
    for kwargs in ({"training": False}, {"p": 0.0}):
        args = {"p": 0.5, **kwargs}
        g = ns.spmd_map(
            lambda x, a=args: ns.random.dropout(x, over="dp", seed=0, **a),
            mesh=mesh,
            in_specs=P("dp"),
            out_specs=P("dp"),
        )
        assert torch.equal(g(x), x)
    everything = ns.spmd_map(
        lambda x: ns.random.dropout(x, 1.0, over="dp", seed=0),
        mesh=mesh,
        in_specs=P("dp"),
        out_specs=P("dp"),
    )
    assert torch.equal(everything(x), torch.zeros_like(x))


def test_dropout_under_torch_func_grad_inside_the_function():
    """The per-member draw under a transform inside the function (the fallback own_block path)."""
    p = 0.5
    mesh = ns.make_mesh(*MESH)

    def f(x):
        return torch.func.grad(lambda v: ns.random.dropout(v, p, over="dp", seed=9).sum())(x)

    x = torch.randn(6, 5, dtype=torch.float64)
    got = ns.spmd_map(f, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))(x)
    sizes = dict(zip(*reversed(MESH)))
    masks = [
        torch.rand(3, 5, generator=reference_generator((9,), {"dp": d})) >= p
        for d in range(sizes["dp"])
    ]
    torch.testing.assert_close(got, torch.cat(masks).to(x.dtype) / (1 - p), rtol=1e-15, atol=0)


def _error(body, in_specs=(), args=()):
    mesh = ns.make_mesh(*MESH)

    def user_fn(*a):
        return body(*a)

    with pytest.raises(ns.SpmdError) as err:
        ns.spmd_map(user_fn, mesh=mesh, in_specs=in_specs, out_specs=P(("dp", "tp")))(*args)
    message = str(err.value)
    assert "user_fn" in message and "Fix:" in message, message
    return message


def test_bad_arguments_are_spmd_errors_with_the_fix():
    x = torch.ones(6, 2)
    assert "unknown mesh axis 'pd'" in _error(lambda: ns.random.rand(2, over="pd", seed=0))
    assert "seed must be" in _error(lambda: ns.random.rand(2, over="dp", seed=0.5))
    message = _error(lambda: ns.random.rand(2, over="dp", seed=torch.tensor(1)))
    assert "a tensor's value may differ between instances" in message
    for p in (-0.1, 1.5, True, "0.1"):
        message = _error(
            lambda x, p=p: ns.random.dropout(x, p, over="dp", seed=0), P(("dp", "tp")), (x,)
        )
        assert "p must be a probability in [0, 1]" in message
    message = _error(
        lambda x: ns.random.dropout(x.long(), 0.1, over="dp", seed=0), P(("dp", "tp")), (x,)
    )
    assert "expected a floating-point tensor, got a torch.int64 tensor" in message
    assert "size must be non-negative ints" in _error(lambda: ns.random.rand(-1, over=(), seed=0))
    message = _error(lambda: ns.random.rand(2, over=(), seed=0, dtype=torch.int32))
    assert "dtype must be a floating-point" in message
    assert "expected ints low < high" in _error(lambda: ns.random.randint(3, 3, 2, over=(), seed=0))


def test_one_seed_for_two_draws_of_a_call_is_an_error():
    def twice():
        a = ns.random.rand(2, over="dp", seed=(4, 1))
        return a + ns.random.randn(2, over=("dp", "tp"), seed=(4, 1))

    message = _error(twice)
    assert "seed (4, 1) was already used by another draw in this call" in message
    assert "seed=(step, layer)" in message
    mesh = ns.make_mesh(*MESH)
    again = ns.spmd_map(
        lambda: ns.random.rand(2, over="dp", seed=(4, 1)), mesh=mesh, in_specs=(), out_specs=P("dp")
    )
    assert torch.equal(again(), again())  # a new call may reuse it: the same draw


def test_outside_spmd_map_is_a_clear_error():
    with pytest.raises(ns.CollectiveError, match="ns.random.rand was called outside spmd_map"):
        ns.random.rand(2, over="dp", seed=0)


@pytest.mark.distributed
def test_real_backend_draws_what_the_simulated_backend_draws():
    """4 gloo processes under torch.manual_seed(rank) and debug mode (invariant outputs are
    compared across ranks): every draw and gradient equals the simulated run's, bit for bit."""
    world = 4
    worker = os.path.join("tests", "random_axes_worker.py")
    finished = launch([worker], world, 180, NAMED_SPMD_DEBUG="1")
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == world, [out[-3000:] for out in finished.outputs]
    for o in outcomes:
        assert o["checked"] >= 10, o
        assert o["mismatches"] == [], o
        assert math.isfinite(o["max_abs"]) and o["max_abs"] == 0.0, o


@pytest.mark.parametrize("shape", [(1, 1), (2, 2)])
@pytest.mark.parametrize("randomness", ["error", "same", "different"])
def test_a_draw_under_a_users_vmap_is_not_batched(shape, randomness):
    """A draw is a function of its seed and coordinates: under a user's vmap (around the call
    or inside it) every row gets the call's own mask, whatever the vmap's randomness mode, on
    one instance as on several (the real mesh: random_axes_worker.py)."""
    mesh = ns.make_mesh(shape, ("dp", "tp"))
    over = ("dp", "tp")

    def drop(x):
        return ns.random.dropout(x, 0.5, over=over, seed=9)

    f = ns.spmd_map(drop, mesh=mesh, in_specs=P(over), out_specs=P(over))
    direct = f(torch.ones(8))
    rows = torch.func.vmap(f, randomness=randomness)(torch.ones(3, 8))
    assert all(torch.equal(r, direct) for r in rows), rows
    inside = ns.spmd_map(
        lambda x: torch.func.vmap(drop, randomness=randomness)(x),
        mesh=mesh,
        in_specs=P(None, over),
        out_specs=P(None, over),
    )
    assert all(torch.equal(r, direct) for r in inside(torch.ones(3, 8)))


def test_docstring_examples_run():
    import doctest

    result = doctest.testmod(ns.random, optionflags=doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0 and result.attempted > 0


def test_a_checkpointed_dropout_recomputes_the_same_mask():
    """Non-reentrant activation checkpointing recomputes the draw in backward: the same mask (a
    draw is a function of its arguments; the reuse check does not apply in backward), so values
    and gradients equal the run without checkpointing."""
    from torch.utils.checkpoint import checkpoint

    mesh = ns.make_mesh(*MESH)

    def piece(x, w):
        return torch.tanh(ns.random.dropout(x @ w, 0.5, over="dp", seed=("ckpt", 0)))

    def plain(x, w):
        return ns.psum(piece(x, w), "tp")

    def checkpointed(x, w):
        return ns.psum(checkpoint(piece, x, w, use_reentrant=False), "tp")

    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    results = []
    for f in (plain, checkpointed):
        y = ns.spmd_map(f, mesh=mesh, in_specs=(P("dp"), P(None, "tp")), out_specs=P("dp"))(x, w)
        results.append((y, *torch.autograd.grad(y.sum(), (x, w))))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)
