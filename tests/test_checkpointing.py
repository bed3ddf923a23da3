"""Activation checkpointing inside the per-device function (docs/design.md section 8).

torch's own ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``, full and selective,
around pieces with collectives, ``axis_size`` and ``axis_index``: values and gradients equal the
uncheckpointed run (float64) on several simulated meshes and on 4 gloo processes, the
recomputed collectives are backward communication in ``CommMode``, and the saved activations
shrink.
"""

from __future__ import annotations

import collections
import json
import os
import warnings

import pytest
import torch
import torch.nn.functional as F
from _dist_launch import launch
from checkpointing_worker import MESH_SHAPE, MODES, PROGRAMS, checkpointed, inputs, run_program
from torch.utils.checkpoint import checkpoint

import named_spmd as ns
from named_spmd import P

MESHES = [
    ((2, 2), ("dp", "tp")),
    ((4, 2), ("dp", "tp")),
    ((1, 4), ("dp", "tp")),
    ((2, 1), ("dp", "tp")),
]


def assert_same_run(got: dict, want: dict) -> None:
    torch.testing.assert_close(got["loss"], want["loss"], rtol=1e-12, atol=1e-12)
    assert len(got["grads"]) == len(want["grads"])
    for i, (g, w) in enumerate(zip(got["grads"], want["grads"])):
        torch.testing.assert_close(
            torch.tensor(g, dtype=torch.float64),
            torch.tensor(w, dtype=torch.float64),
            rtol=1e-12,
            atol=1e-12,
            msg=f"gradient of input {i}",
        )


def split_counts(counts: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(forward, backward) counts keyed by "op|axes"."""
    forward, backward = {}, {}
    for key, n in counts.items():
        direction, rest = key.split("|", 1)
        (forward if direction == "forward" else backward)[rest] = n
    return forward, backward


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s[0])))
@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_checkpointed_equals_uncheckpointed(program, mode, shape):
    mesh = ns.make_mesh(*shape)
    assert_same_run(run_program(program, mode, mesh), run_program(program, "none", mesh))


@pytest.mark.parametrize("mode", ["full", "selective"])
@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_recomputed_collectives_are_backward_communication(program, mode):
    """The forward is unchanged; the backward adds, for each collective inside a checkpointed
    piece whose result the backward needs, that collective once more (the recomputation)."""
    mesh = ns.make_mesh(*MESH_SHAPE)
    plain_fwd, plain_bwd = split_counts(run_program(program, "none", mesh)["counts"])
    ck_fwd, ck_bwd = split_counts(run_program(program, mode, mesh)["counts"])
    assert ck_fwd == plain_fwd
    extra = {k: ck_bwd.get(k, 0) - plain_bwd.get(k, 0) for k in set(ck_bwd) | set(plain_bwd)}
    recomputed = {k: n for k, n in extra.items() if n}
    assert recomputed, "nothing was recomputed"
    # every recomputed collective is a forward collective of the program, at most as often
    for key, n in recomputed.items():
        assert 0 < n <= plain_fwd.get(key, 0), (key, n, plain_fwd)
    # the programs end their pieces with an op that saves the last collective's result, so a
    # full recomputation runs every collective inside the pieces (pmean of gather_scatter is
    # outside its piece)
    if mode == "full":
        inside = {k: n for k, n in plain_fwd.items() if not k.startswith("pmean")}
        assert recomputed == inside


def test_a_backward_on_another_thread_resumes_the_call_and_records_into_the_forwards_modes():
    """Autograd runs a CUDA backward on its own device thread, with none of the forward thread's
    thread-locals (active calls, vmap levels, CommModes): a backward on a Python thread of its
    own stands for it here."""
    import threading

    mesh = ns.make_mesh(*MESH_SHAPE)
    runs = []
    for thread in (False, True):
        f, in_specs, out_specs, shapes = PROGRAMS["gather_scatter"]("full")
        mapped = ns.spmd_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
        args = inputs(shapes)
        with ns.CommMode() as comms:
            loss = (mapped(*args) ** 2).sum()
            if thread:
                worker = threading.Thread(target=loss.backward)
                worker.start()
                worker.join()
            else:
                loss.backward()
        runs.append(([a.grad for a in args], comms.counts()))
    torch.testing.assert_close(runs[1][0], runs[0][0], rtol=0, atol=0)
    assert runs[1][1] == runs[0][1]


def test_check_reports_the_recomputation_like_the_simulated_run():
    mesh = ns.make_mesh(*MESH_SHAPE)
    f, in_specs, out_specs, shapes = PROGRAMS["megatron_mlp"]("full")
    mapped = ns.spmd_map(f, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
    report = mapped.check(*inputs(shapes), backward=True)
    simulated = run_program("megatron_mlp", "full", mesh)["counts"]
    got = {"|".join((d, op, ",".join(a))): n for (d, op, a), n in report.comms.counts().items()}
    assert got == simulated


def test_nested_checkpoints():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))

    def inner(x):
        return ns.psum(torch.sin(x) * ns.axis_index("tp"), "tp")

    def nested(x):
        return checkpoint(
            lambda y: checkpoint(inner, torch.cos(y), use_reentrant=False) ** 2,
            x,
            use_reentrant=False,
        )

    def plain(x):
        return inner(torch.cos(x)) ** 2

    x = torch.randn(4, 6, dtype=torch.float64)
    grads = []
    for fn in (nested, plain):
        xi = x.clone().requires_grad_(True)
        y = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp", "tp"), out_specs=P("dp"))(xi)
        (g,) = torch.autograd.grad(y.sum(), xi)
        grads.append((y, g))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-12)


def test_calls_leave_the_mode_stack_as_they_found_it():
    """A call marks the torch-function mode stack while it runs (so that a recomputation finds
    it); the mark goes away after a call, a failing call, and a torch.device block inside."""
    mesh = ns.make_mesh((2,), ("x",))
    depth = torch.overrides._len_torch_function_stack()

    def with_device(x):
        with torch.device("cpu"):
            y = torch.ones(2) + x
        return ns.psum(y, "x")

    def failing(x):
        raise ValueError("boom")

    ns.spmd_map(with_device, mesh=mesh, in_specs=P("x"), out_specs=P())(torch.ones(4))
    assert torch.overrides._len_torch_function_stack() == depth
    with pytest.raises(ValueError, match="boom"):
        ns.spmd_map(failing, mesh=mesh, in_specs=P("x"), out_specs=P())(torch.ones(4))
    assert torch.overrides._len_torch_function_stack() == depth


def test_default_device_inside_a_call_is_the_one_outside():
    """torch.get_default_device() reads the innermost DeviceContext mode: the call's marker
    answers with the device that applies without it."""
    mesh = ns.make_mesh((2,), ("x",))
    seen = []
    f = ns.spmd_map(
        lambda x: seen.append(torch.get_default_device()) or x,
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P("x"),
    )
    f(torch.ones(4))
    with torch.device("meta"):
        f(torch.ones(4, device="cpu"))
    assert seen == [torch.device("cpu"), torch.device("meta")]


def test_recomputation_runs_under_the_calls_device_context():
    """As torch's checkpoint does without a call around it, the recomputation re-enters the
    device context the forward ran under, also when the backward runs outside it."""
    mesh = ns.make_mesh((2,), ("x",))
    seen = []

    def piece(x):
        seen.append(torch.get_default_device())
        return ns.psum(torch.sin(x), "x")

    f = ns.spmd_map(
        lambda x: checkpoint(piece, x, use_reentrant=False),
        mesh=mesh,
        in_specs=P("x"),
        out_specs=P(),
    )
    x = torch.randn(4, requires_grad=True)
    with torch.device("meta"):
        y = f(x)
    y.sum().backward()
    assert seen == [torch.device("meta")] * 2
    torch.testing.assert_close(x.grad, torch.cos(x.detach()))


def _reentrant_psum(x):
    return checkpoint(lambda y: ns.psum(torch.sin(y), "x"), x, use_reentrant=True)


def _reentrant_scaled(x, w):
    # no collective inside: its recomputation would run (outside the call) without the psum of
    # w's implicit pvary, a gradient of w per rank (the real mesh: tests/dist_worker.py)
    return ns.psum(checkpoint(lambda a, w: torch.sin(a * w), x, w, use_reentrant=True), "x")


@pytest.mark.parametrize("size", [1, 2])
@pytest.mark.parametrize("fn", [_reentrant_psum, _reentrant_scaled])
def test_reentrant_checkpoint_is_one_clear_error_on_every_mesh(fn, size):
    mesh = ns.make_mesh((size,), ("x",))
    specs = (P("x"), P())[: fn.__code__.co_argcount]
    f = ns.spmd_map(fn, mesh=mesh, in_specs=specs, out_specs=P())
    for _ in range(2):  # (a failed call is no checked signature: the same error again)
        with pytest.raises(ns.SpmdError) as raised:
            f(*[torch.ones(n, requires_grad=True) for n in (4, 1)[: len(specs)]])
        message = str(raised.value)
        assert f"spmd_map of `{fn.__name__}`" in message
        assert "use_reentrant=True) cannot run inside spmd_map" in message
        assert "Fix: pass use_reentrant=False" in message


def _no_grad_scaled(x):
    with torch.no_grad():
        s = x.abs().amax()
    return x * s


@pytest.mark.parametrize("size", [1, 2])
def test_checkpoint_sequential_without_reentrancy_is_no_reentrant_checkpoint(size):
    """Its segments' function is named ``forward`` in torch.utils.checkpoint too, and switches
    grad mode here: it runs, with the dense values and gradients."""
    from torch.utils.checkpoint import checkpoint_sequential

    def fn(x):
        y = checkpoint_sequential([_no_grad_scaled] * 2, 2, x, use_reentrant=False)
        return ns.psum(y.sum(), "x")

    mesh = ns.make_mesh((size,), ("x",))
    f = ns.spmd_map(fn, mesh=mesh, in_specs=P("x"), out_specs=P())
    x = torch.arange(1.0, 5.0, requires_grad=True)
    dense = x.detach().clone().requires_grad_()
    y = f(x)
    blocks = [_no_grad_scaled(_no_grad_scaled(b)).sum() for b in dense.chunk(size)]
    want = torch.stack(blocks).sum()
    torch.testing.assert_close(y, want)
    y.backward()
    want.backward()
    torch.testing.assert_close(x.grad, dense.grad)


def test_collective_in_a_backward_pass_outside_its_call_names_the_checkpoint_fix():
    class Late(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, g):
            return ns.psum(g, "x")

    x = torch.ones(3, requires_grad=True)
    with pytest.raises(ns.CollectiveError, match="backward pass.*use_reentrant=False"):
        Late.apply(x).sum().backward()


def test_torch_recomputes_under_the_forwards_device_context():
    """Pin of the torch behaviour the resumption rests on: non-reentrant checkpoint re-enters,
    around its recomputation, the innermost DeviceContext mode active in the forward."""
    from torch.utils._device import DeviceContext

    entered = []

    class Probe(DeviceContext):
        def __init__(self):
            super().__init__("cpu")

        def __enter__(self):
            entered.append("enter")
            return super().__enter__()

    x = torch.randn(3, requires_grad=True)
    with Probe():
        y = checkpoint(lambda t: torch.sin(t).exp(), x, use_reentrant=False)
    assert entered == ["enter"]
    y.sum().backward()
    assert entered == ["enter", "enter"]


# --- memory: the saved activations shrink ---------------------------------------------------


def _mlp_block(x, w1, w2):
    h = torch.nn.functional.gelu(x @ w1)
    return torch.nn.functional.layer_norm(x + ns.psum(h @ w2, "tp"), x.shape[-1:])


def _transformer_block(x, wq, wk, wv, wo, w1, w2):
    """Causal self-attention with heads split over tp (head dim 8), then the MLP block."""
    b, t, _ = x.shape
    y = torch.nn.functional.layer_norm(x, x.shape[-1:])
    q, k, v = ((y @ w).unflatten(-1, (-1, 8)).transpose(1, 2) for w in (wq, wk, wv))
    scores = (q @ k.transpose(-1, -2)) / 8**0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    att = torch.softmax(scores.masked_fill(~causal, float("-inf")), -1) @ v  # [b, h/tp, t, 8]
    x = x + ns.psum(att.transpose(1, 2).flatten(2) @ wo, "tp")
    return _mlp_block(x, w1, w2)


BLOCKS = {  # block, its weights' specs and shapes (x is [batch, seq, 32], split over dp)
    "mlp": (_mlp_block, [P(None, "tp"), P("tp")], [(32, 128), (128, 32)]),
    "transformer": (
        _transformer_block,
        [P(None, "tp")] * 3 + [P("tp"), P(None, "tp"), P("tp")],
        [(32, 32)] * 3 + [(32, 32), (32, 128), (128, 32)],
    ),
}


def saved_bytes(mode: str, mesh, kind: str) -> int:
    """Bytes of distinct storages autograd keeps for backward after one forward of 4 blocks
    (tensors saved inside a checkpointed piece are dropped: checkpoint's own hooks replace them;
    its inputs are kept)."""
    block, specs, shapes = BLOCKS[kind]

    def f(x, *ws):
        for _ in range(4):
            x = checkpointed(mode, block, x, *ws)
        return x

    mapped = ns.spmd_map(f, mesh=mesh, in_specs=(P("dp"), *specs), out_specs=P("dp"))
    gen = torch.Generator().manual_seed(0)
    args = [torch.randn(s, generator=gen, requires_grad=True) for s in [(4, 16, 32), *shapes]]
    storages: dict[int, int] = {}

    def pack(t):
        while torch._C._functorch.is_batchedtensor(t):  # checkpoint's inputs, as the call sees them
            t = torch._C._functorch.get_unwrapped(t)
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        mapped(*args)
    return sum(storages.values())


@pytest.mark.parametrize("kind", sorted(BLOCKS))
def test_checkpointing_saves_memory(kind):
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    none, full = saved_bytes("none", mesh, kind), saved_bytes("full", mesh, kind)
    print(f"saved activations, 4 {kind} blocks on (2, 2): none {none} B, full {full} B")
    assert full * 4 < none  # only the blocks' inputs stay, not their inner activations


def test_transformer_block_checkpointed_equals_uncheckpointed():
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    block, specs, shapes = BLOCKS["transformer"]
    gen = torch.Generator().manual_seed(1)
    args = [torch.randn(s, generator=gen, dtype=torch.float64) for s in [(4, 16, 32), *shapes]]
    runs = []
    for mode in MODES:
        mapped = ns.spmd_map(
            lambda x, *ws, mode=mode: checkpointed(mode, block, x, *ws),
            mesh=mesh,
            in_specs=(P("dp"), *specs),
            out_specs=P("dp"),
        )
        leaves = [a.clone().requires_grad_(True) for a in args]
        y = mapped(*leaves)
        runs.append((y, torch.autograd.grad((y**2).sum(), leaves)))
    for y, grads in runs[1:]:
        torch.testing.assert_close(y, runs[0][0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(grads, runs[0][1], rtol=1e-12, atol=1e-12)


class _CountMatmuls(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.bmm.default)
        return func(*args, **(kwargs or {}))


def backward_matmuls(mode: str) -> int:
    """Matmuls run by the backward of the megatron program: the selective policy saves the
    forward's matmuls, so its recomputation runs none of them again (a full one runs them)."""
    f, in_specs, out_specs, shapes = PROGRAMS["megatron_mlp"](mode)
    mapped = ns.spmd_map(f, mesh=ns.make_mesh(*MESH_SHAPE), in_specs=in_specs, out_specs=out_specs)
    args = inputs(shapes)
    loss = (mapped(*args) ** 2).sum()
    with _CountMatmuls() as count:
        torch.autograd.grad(loss, args)
    return count.n


def test_selective_policy_keeps_the_matmuls():
    counts = {m: backward_matmuls(m) for m in MODES}
    assert counts["selective"] == counts["none"] < counts["full"], counts


# --- the real backend ------------------------------------------------------------------------


@pytest.mark.distributed
def test_real_backend_matches_simulated():
    finished = launch([os.path.join("tests", "checkpointing_worker.py")], 4, 300)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    expected = len(PROGRAMS) * len(MODES) * 4
    assert len(outcomes) == expected, finished.outputs[0][-3000:]
    mesh = ns.make_mesh(*MESH_SHAPE)
    want = {(p, m): run_program(p, m, mesh) for p in PROGRAMS for m in MODES}
    for o in outcomes:
        assert "error" not in o, o
        w = want[o["program"], o["mode"]]
        assert_same_run(o, w)
        assert o["counts"] == w["counts"], (o["program"], o["mode"], o["rank"])


class _AtenOps(torch.utils._python_dispatch.TorchDispatchMode):
    """How often each aten op ran inside, by name (below vmap: per instance where vmap loops)."""

    def __init__(self):
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.__name__] += 1
        return func(*args, **(kwargs or {}))


_FLASH = "_scaled_dot_product_flash_attention_for_cpu.default"


def test_attention_runs_once_for_every_instance_also_when_recomputed():
    """sdpa's fused kernels have no batching rule (vmap would run the CPU flash kernel once per
    instance, with a warning), so a simulated call runs attention once on every instance's
    operands together, and so does a checkpoint's recomputation of a piece of it (it must: the
    recomputation has to save what the forward saved), causal or with a mask. Values and
    gradients equal the dense attention's."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    gen = torch.Generator().manual_seed(5)
    mask = torch.rand(6, 6, generator=gen) > 0.3
    q, k, v = (
        torch.randn(4, 4, 6, 8, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(3)
    )
    for masked in (False, True):

        def attend(q, k, v, masked=masked):
            if masked:
                return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=0.3)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)

        f = ns.spmd_map(
            lambda q, k, v, attend=attend: checkpoint(attend, q, k, v, use_reentrant=False),
            mesh=mesh,
            in_specs=(P("dp", "tp"),) * 3,
            out_specs=P("dp", "tp"),
        )
        with warnings.catch_warnings(), _AtenOps() as ran:  # the per-instance fallback's warning
            warnings.filterwarnings("error", message="There is a performance drop")
            out = f(q, k, v)
            (out * out).sum().backward()
        # the forward and its recomputation, then the backward: one call each
        assert ran.names[_FLASH] == 2 and ran.names[_FLASH.replace(".", "_backward.")] == 1
        grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        with _AtenOps() as dense:
            want = attend(q, k, v)
            (want * want).sum().backward()
        assert dense.names[_FLASH] == 1  # torch's own choice outside a call
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        for got, ref in zip(grads, (q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, ref, rtol=1e-12, atol=1e-12)
        for t in (q, k, v):
            t.grad = None


def test_attention_at_once_of_operands_varying_over_different_axes():
    """Attention once for every instance where its operands vary over different axes (a query
    varying over both, a key invariant over dp, a value invariant over tp; 3-d operands
    invariant over dp): the values and gradients of each instance's attention on its own
    blocks, one flash call; under a vmap inside the function, the math form, batched."""
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))
    gen = torch.Generator().manual_seed(7)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64, requires_grad=True)

    def attend(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def per_instance(q, k, v):
        """Each instance's attention on its own blocks, placed as P("dp", "tp")."""
        rows = []
        for i in range(2):
            dp = slice(2 * i, 2 * i + 2)
            row = []
            for j in range(2):
                tp = slice(2 * j, 2 * j + 2)
                row.append(attend(q[dp, tp], k[:, tp], v[dp]))
            rows.append(torch.cat(row, 1))
        return torch.cat(rows, 0)

    q, k, v = rand(4, 4, 6, 8), rand(2, 4, 6, 8), rand(4, 2, 6, 8)
    specs = (P("dp", "tp"), P(None, "tp"), P("dp"))
    for body in (attend, torch.func.vmap(attend)):  # a vmap inside: per batch row, the same
        f = ns.spmd_map(body, mesh=mesh, in_specs=specs, out_specs=P("dp", "tp"))
        with warnings.catch_warnings(), _AtenOps() as ran:
            warnings.filterwarnings("error", message="There is a performance drop")
            out = f(q, k, v)
            (out * out).sum().backward()
        assert ran.names[_FLASH] == (1 if body is attend else 0), ran.names
        grads = [t.grad for t in (q, k, v)]
        for t in (q, k, v):
            t.grad = None
        want = per_instance(q, k, v)
        (want * want).sum().backward()
        torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
        for got, t in zip(grads, (q, k, v)):
            torch.testing.assert_close(got, t.grad, rtol=1e-12, atol=1e-12)
            t.grad = None

    # 3-d operands: q varies over tp (its heads), k and v are invariant; torch's own pick for
    # them is the math form (so too its errors), which the call keeps
    q3, k3, v3 = rand(4, 6, 8), rand(2, 6, 8), rand(2, 6, 8)
    f = ns.spmd_map(attend, mesh=mesh, in_specs=(P("tp"), P(), P()), out_specs=P("tp"))
    with _AtenOps() as ran:
        out = f(q3, k3, v3)
        (out * out).sum().backward()
    assert ran.names[_FLASH] == 0, ran.names
    grads = [t.grad for t in (q3, k3, v3)]
    for t in (q3, k3, v3):
        t.grad = None
    want = torch.cat([attend(q3[2 * j : 2 * j + 2], k3, v3) for j in range(2)])
    (want * want).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, t in zip(grads, (q3, k3, v3)):
        torch.testing.assert_close(got, t.grad, rtol=1e-12, atol=1e-12)

    # a mask varying over tp, with the 3-d operands
    for t in (q3, k3, v3):
        t.grad = None
    mask = torch.rand(4, 6, 6, generator=gen) > 0.3
    mask[..., 0] = True  # (no row masked whole)

    def masked(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m)

    f = ns.spmd_map(masked, mesh=mesh, in_specs=(P("tp"), P(), P(), P("tp")), out_specs=P("tp"))
    with _AtenOps() as ran:
        out = f(q3, k3, v3, mask)
        (out * out).sum().backward()
    assert ran.names[_FLASH] == 0, ran.names
    grads = [t.grad for t in (q3, k3, v3)]
    for t in (q3, k3, v3):
        t.grad = None
    parts = [masked(q3[2 * j : 2 * j + 2], k3, v3, mask[2 * j : 2 * j + 2]) for j in range(2)]
    want = torch.cat(parts)
    (want * want).sum().backward()
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    for got, t in zip(grads, (q3, k3, v3)):
        torch.testing.assert_close(got, t.grad, rtol=1e-12, atol=1e-12)


def test_attention_keeps_the_errors_of_each_instance():
    """A mask beside ``is_causal``: torch refuses it for 4-d operands and a 3-d mask (its math
    form runs, per instance, as on a real rank), so the simulated call refuses it too, although
    one call on the instances' operands flattened together would pick a kernel that takes it."""
    mesh = ns.make_mesh((2,), ("dp",))
    gen = torch.Generator().manual_seed(9)
    q, k, v = (torch.randn(4, 2, 6, 8, generator=gen) for _ in range(3))
    mask = torch.rand(2, 6, 6, generator=gen) > 0.3

    def attend(q, k, v, m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=True)

    with pytest.raises(RuntimeError, match="attn_mask should not be set"):
        attend(q[:2], k[:2], v[:2], mask)  # each instance's own call
    f = ns.spmd_map(attend, mesh=mesh, in_specs=(P("dp"),) * 3 + (P(),), out_specs=P("dp"))
    with pytest.raises(ns.SpmdError, match="attn_mask should not be set"):
        f(q, k, v, mask)
