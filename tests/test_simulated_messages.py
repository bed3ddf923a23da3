"""What the user sees of the simulated mesh from inside the function: printed values and errors.

Printing: a value varying over mesh axes prints its type and one block per
coordinate of those axes; the blocks are checked against the global input's blocks, cut here
with plain slicing and printed by torch. Errors: a torch error from the user's code names
the user's function and line and is told with per-instance shapes; the reference is the error
torch raises for the same op on one instance's plain block (what that rank raises on a real
mesh), never vmap's internals (``BatchedTensor(lvl=2, bdim=0, value=...``) or a message
counting the mesh's batch dims (``(6x5 and 4x3)`` for a local ``[3,5] @ [4,3]`` on two
instances).
"""

from __future__ import annotations

import inspect
import itertools

import pytest
import torch

import named_spmd as ns
from named_spmd import P

MESH = ns.make_mesh((2, 3), ("dp", "tp"))


def _seen_inside(fn, x, spec, mesh=MESH):
    """What ``fn(local x)`` returns inside the function (a string), on every call."""
    seen: list[str] = []

    def body(x):
        seen.append(fn(x))
        return x

    ns.spmd_map(body, mesh=mesh, in_specs=spec, out_specs=spec)(x)
    return seen


def _blocks(x, mesh, axes_of_dim):
    """{coordinates: plain block} of global ``x``, dim d split over ``axes_of_dim[d]``."""
    sizes = mesh.shape
    varying = [a for a in mesh.axis_names if a in axes_of_dim]
    out = {}
    for values in itertools.product(*(range(sizes[a]) for a in varying)):
        coords = dict(zip(varying, values))
        block = x
        for d, axis in enumerate(axes_of_dim):
            if axis is not None:
                n = x.shape[d] // sizes[axis]
                block = block.narrow(d, coords[axis] * n, n)
        out[tuple(coords.items())] = block
    return out


def _expected_text(header, blocks):
    lines = [header]
    for coords, block in blocks.items():
        head = ", ".join(f"{a}={i}" for a, i in coords) + ": "
        first, *rest = repr(block).split("\n")
        lines.append(head + first)
        lines += [" " * len(head) + r if r else r for r in rest]
    return "\n".join(lines)


# --- printing ---------------------------------------------------------------------------------


def test_print_of_a_value_varying_over_every_axis_shows_each_instance_block():
    x = torch.randn(4, 6)
    want = _expected_text("f32[2,2]{dp,tp} per instance:", _blocks(x, MESH, ("dp", "tp")))
    assert _seen_inside(repr, x, P("dp", "tp")) == [want]
    assert "BatchedTensor" not in want


def test_a_value_invariant_over_an_axis_shows_one_block_per_coordinate_of_the_others():
    x = torch.randn(4, 3, 2, dtype=torch.float64)
    got = _seen_inside(repr, x, P(None, "tp"))
    want = _expected_text(
        "f64[4,1,2]{tp} per instance, the same along dp:", _blocks(x, MESH, (None, "tp"))
    )
    assert got == [want]


def test_str_print_and_fstrings_show_the_same_text(capsys):
    x = torch.arange(12.0).reshape(4, 3)
    texts = _seen_inside(lambda v: (print(v), str(v), f"{v}", repr(v))[1:], x, P("dp"))
    (printed_str, formatted, shown) = texts[0]
    assert printed_str == formatted == shown
    assert capsys.readouterr().out == shown + "\n"
    assert shown.startswith("f32[2,3]{dp} per instance, the same along tp:\ndp=0: ")


def test_an_invariant_value_prints_as_the_plain_tensor_it_is():
    x = torch.randn(3, 2)
    assert _seen_inside(repr, x, P()) == [repr(x)]


def test_a_0d_value_formats_every_instance_number_with_the_spec():
    x = torch.randn(4, 6)
    got = _seen_inside(lambda v: f"{v.sum():.3f}|{v.sum()}", x, P("dp", "tp"))
    blocks = _blocks(x, MESH, ("dp", "tp"))

    def numbers(spec):
        return "; ".join(
            ", ".join(f"{a}={i}" for a, i in coords) + f": {format(b.sum().item(), spec)}"
            for coords, b in blocks.items()
        )

    # the sums are per-instance sums of the same numbers: equal to rounding, so compare parsed
    left, right = got[0].split("|")
    assert left == numbers(".3f")
    parsed = [float(p.split(": ")[1]) for p in right.split("; ")]
    want = [b.sum().item() for b in blocks.values()]
    assert parsed == pytest.approx(want, rel=1e-6)


def test_many_instances_print_the_first_and_last_around_an_elision():
    mesh = ns.make_mesh((20,), ("dp",))
    x = torch.arange(40.0).reshape(20, 2)
    blocks = _blocks(x, mesh, ("dp",))
    keep = dict(list(blocks.items())[:8])
    tail = dict(list(blocks.items())[-8:])
    head_text = _expected_text("f32[1,2]{dp} per instance:", keep)
    tail_text = _expected_text("", tail)
    assert _seen_inside(repr, x, P("dp"), mesh) == [
        head_text + "\n... 4 more instances ..." + tail_text
    ]


def test_printing_under_a_transform_around_the_call_shows_the_values():
    x = torch.randn(4, 3)
    seen: list[str] = []

    def f(v):
        seen.append(repr(v))
        return ns.psum((v * v).sum(), "dp")

    grad = torch.func.grad(ns.spmd_map(f, mesh=MESH, in_specs=P("dp"), out_specs=P()))(x)
    torch.testing.assert_close(grad, 2 * x)
    want = _expected_text(
        "f32[2,3]{dp} per instance, the same along tp:", _blocks(x, MESH, ("dp",))
    )
    assert seen == [want]


def test_a_user_vmap_inside_keeps_torch_wrapper_around_the_per_instance_view():
    x = torch.randn(4, 3)
    seen: list[str] = []

    def f(v):
        torch.func.vmap(lambda row: seen.append(repr(row)) or row)(v)
        return v

    ns.spmd_map(f, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))(x)
    (text,) = seen
    assert text.startswith("BatchedTensor(lvl=")  # the user's own vmap level, as torch shows it
    inner = _expected_text(
        "f32[2,3]{dp} per instance, the same along tp:", _blocks(x, MESH, ("dp",))
    )
    assert "\n".join(line.strip() for line in inner.split("\n")) in "\n".join(
        line.strip() for line in text.split("\n")
    )


def test_printing_outside_a_call_is_torch_own():
    x = torch.randn(2, 3)
    texts: list[str] = []
    torch.func.vmap(lambda r: texts.append(repr(r)) or r)(x)
    assert texts[0].startswith("BatchedTensor(lvl=1, bdim=0, value=")
    assert f"{torch.tensor(1.5):.2f}" == "1.50"


# --- errors -------------------------------------------------------------------------------------


def _fails(op):
    """A per-device function applying ``op``: the innermost user line is ``op``'s."""

    def user_fn(x, w):
        return op(x, w)

    return user_fn


def _where(op):
    """``file:line (`source`)`` of a one-line lambda ``op``."""
    lines, first = inspect.getsourcelines(op)
    return f"test_simulated_messages.py:{first} (`{lines[0].strip()}`)"


# transpose raises an IndexError, index_select one that only the data shows
OPS = {
    "matmul": lambda x, w: x @ w,
    "view": lambda x, w: x.view(7, -1),
    "cat": lambda x, w: torch.cat([x, w]),
    "transpose": lambda x, w: x.transpose(0, 3),
    "expand": lambda x, w: x.expand(3, 4, 5),
    "broadcast": lambda x, w: x + w,
    "linear": lambda x, w: torch.nn.functional.linear(x, w),
    "index_select": lambda x, w: x.index_select(0, torch.tensor([7])),
}


def _error_of(call):
    try:
        call()
    except Exception as e:
        return e
    raise AssertionError("no error")


@pytest.mark.parametrize("name", list(OPS))
def test_a_torch_error_of_the_user_code_is_told_with_local_shapes(name):
    x, w = torch.randn(4, 3, 5), torch.randn(4, 3)
    fn = _fails(OPS[name])
    err = _error_of(
        lambda: ns.spmd_map(fn, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))(x, w)
    )
    # the reference: the same op on instance dp=0's plain block, as its rank runs it
    ref = _error_of(lambda: OPS[name](x[:2], w))
    assert isinstance(err, ns.SpmdError) and isinstance(err, type(ref))
    message = str(err)
    assert f"{type(ref).__name__}: {ref}" in message
    assert "spmd_map of `_fails.<locals>.user_fn`" in message
    assert f"failed at {_where(OPS[name])}" in message  # the innermost line of the user's code
    assert "f32[2,3,5]{dp}" in message  # the operands, per instance
    assert ("f32[4,3]{}" in message) == (name in ("matmul", "cat", "broadcast", "linear"))
    assert "instance dp=0 raises on its own" in message  # tp: every block the same
    cause = err.__cause__
    # torch's own error under vmap; its class too is kept (vmap's index_select raises a
    # RuntimeError where one instance raises an IndexError)
    assert not isinstance(cause, ns.SpmdError) and isinstance(err, type(cause))
    if name in ("matmul", "view", "cat", "expand", "linear", "index_select"):
        assert str(cause) != str(ref)  # the vmap message: what this change fixes


def test_an_error_raised_by_some_instances_only_names_the_first_of_them():
    x = torch.randn(4, 3)
    index = torch.tensor([0, 0, 0, 5])  # dp=1 gets [0, 5]: 5 is out of range of its 2 rows

    def pick(x, i):
        return x.index_select(0, i)

    f = ns.spmd_map(pick, mesh=MESH, in_specs=(P("dp"), P("dp")), out_specs=P("dp"))
    err = _error_of(lambda: f(x, index))
    ref = _error_of(lambda: x[2:].index_select(0, index[2:]))
    assert isinstance(err, ns.SpmdError) and isinstance(err, type(ref))
    assert f"{type(ref).__name__}: {ref}" in str(err)
    assert "instance dp=1 raises on its own" in str(err)


def test_an_error_that_is_not_about_shapes_keeps_its_class_and_message():
    x = torch.randn(4, 3)
    w = torch.randn(3, 2, dtype=torch.float64)
    op = lambda x, w: x @ w  # noqa: E731
    fn = _fails(op)
    err = _error_of(
        lambda: ns.spmd_map(fn, mesh=MESH, in_specs=(P("dp"), P()), out_specs=P("dp"))(x, w)
    )
    ref = _error_of(lambda: x[:2] @ w)
    assert isinstance(err, ns.SpmdError) and isinstance(err, type(ref))
    assert f"{type(ref).__name__}: {ref}" in str(err) and str(err.__cause__) == str(ref)
    assert f"failed at {_where(op)}" in str(err)


def test_the_user_own_exception_passes_through_unchanged():
    def mine(x):
        raise ValueError("not a torch error")

    f = ns.spmd_map(mine, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    err = _error_of(lambda: f(torch.randn(4, 3)))
    assert type(err) is ValueError and str(err) == "not a torch error"


def test_an_error_the_second_run_does_not_repeat_is_raised_as_it_was():
    calls = []

    def flaky(x):
        calls.append(1)
        return x.view(7, -1) if len(calls) == 1 else x

    f = ns.spmd_map(flaky, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    err = _error_of(lambda: f(torch.randn(4, 3, 5)))
    assert type(err) is RuntimeError and "[2, 7, -1]" in str(err)  # vmap's shape, unexplained
    assert len(calls) == 2


def test_the_second_run_is_quiet_and_leaves_random_state_and_communication_alone(capsys):
    def noisy(x):
        print("before")
        noise = torch.randn(3)
        x = ns.psum(x, "tp") + noise.sum()
        return x.view(7, -1)

    f = ns.spmd_map(noisy, mesh=MESH, in_specs=P("dp", "tp"), out_specs=P("dp"))
    torch.manual_seed(0)
    with ns.CommMode() as comms:
        err = _error_of(lambda: f(torch.randn(4, 6)))
    state = torch.get_rng_state()
    torch.manual_seed(0)
    torch.randn(4, 6), torch.randn(3)  # what one run draws
    assert torch.equal(state, torch.get_rng_state())
    assert isinstance(err, ns.SpmdError) and "Tensor.view" in str(err)
    assert capsys.readouterr().out == "before\n"
    assert comms.count("psum", direction="forward") == 1


def test_an_error_under_a_user_transform_inside_keeps_torch_message():
    def f(x):
        return torch.func.vmap(lambda r: r @ torch.ones(3))(x)

    err = _error_of(
        lambda: ns.spmd_map(f, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))(torch.randn(4, 2))
    )
    assert isinstance(err, ns.SpmdError) and isinstance(err.__cause__, RuntimeError)
    assert f"RuntimeError: {err.__cause__}" in str(err)
    assert "types above are per instance" in str(err) and "`Tensor.matmul`(f32[2]{dp}" in str(err)


def test_the_user_line_is_the_innermost_one_outside_torch():
    """The op fails inside torch's own Python (nn.Linear.forward): the line named is the
    user's call of the module."""
    lin = torch.nn.Linear(4, 2)

    def model(x):
        return torch.relu(lin(x))

    x = torch.randn(4, 3)
    err = _error_of(lambda: ns.spmd_map(model, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))(x))
    ref = _error_of(lambda: lin(x[:2]))
    line = inspect.getsourcelines(model)[1] + 1
    assert isinstance(err, ns.SpmdError) and f"{type(ref).__name__}: {ref}" in str(err)
    assert f"failed at test_simulated_messages.py:{line} (`return torch.relu(lin(x))`)" in str(err)
    assert "`linear`(f32[2,3]{dp}, f32[2,4]{}, f32[2]{})" in str(err)


def test_an_op_that_fails_only_under_vmap_says_so():
    """Each instance alone runs it (as a real mesh does); only the batched run fails."""

    def f(x):
        x.untyped_storage()
        return x

    x = torch.randn(4, 3)
    x[:2].untyped_storage()  # the reference: one instance's block has a storage
    err = _error_of(lambda: ns.spmd_map(f, mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))(x))
    cause = err.__cause__
    assert isinstance(err, ns.SpmdError) and isinstance(err, type(cause))
    assert "no instance raises it on its own" in str(err)
    assert f"{type(cause).__name__}: {cause}" in str(err)
    assert "`Tensor.untyped_storage`(f32[2,3]{dp})" in str(err)


def _autograd_grad(y):
    (g,) = torch.autograd.grad(ns.psum((y * y).sum(), "dp"), y)
    return g


def _func_grad(y):
    return torch.func.grad(lambda v: ns.psum((v * v).sum(), "dp"))(y)


def test_autograd_inside_the_function_is_told_a_limit_of_the_simulation():
    """torch.autograd.grad inside the function meets vmap's batched tensors, which autograd does
    not track (a real rank runs it): no instance's replay is blamed, the message names the fixes,
    and both give the dense gradient of sum(y * y), 2 y."""

    def f(x, grad):
        return grad(x * 3.0)

    x = torch.randn(4, 3, requires_grad=True)
    mapped = ns.spmd_map(f, mesh=MESH, in_specs=(P("dp"), None), out_specs=P("dp"))
    err = _error_of(lambda: mapped(x, _autograd_grad))
    assert isinstance(err, ns.SpmdError) and isinstance(err.__cause__, RuntimeError)
    assert "limit of the simulated mesh" in str(err) and "on its own," not in str(err)
    assert "torch.func.grad" in str(err) and "ns.simulate_per_instance()" in str(err)
    want = 6.0 * x.detach()
    torch.testing.assert_close(mapped(x, _func_grad), want)
    with ns.simulate_per_instance():
        torch.testing.assert_close(mapped(x, _autograd_grad), want)


def test_an_error_under_a_vmap_around_the_call_is_not_replayed_per_instance():
    f = ns.spmd_map(lambda x: x.view(7, -1), mesh=MESH, in_specs=P("dp"), out_specs=P("dp"))
    err = _error_of(lambda: torch.func.vmap(f)(torch.randn(3, 4, 5)))
    assert isinstance(err, ns.SpmdError) and isinstance(err.__cause__, RuntimeError)
    assert f"RuntimeError: {err.__cause__}" in str(err) and "types above are per instance" in str(
        err
    )
    assert "`Tensor.view`(f32[2,5]{dp}, 7, -1)" in str(err)


def _expanded():
    return torch.arange(4.0).expand(2, 4)  # two rows, one memory


def test_an_inplace_write_into_an_expanded_input_every_instance_refuses_says_so():
    """Invariant (P()), each instance's block is the whole expanded tensor: its rank on a real
    mesh raises torch's error too, and the message says so (not that a real mesh runs it)."""

    def bump(x):
        x.add_(1)
        return x

    mesh = ns.make_mesh((2,), ("a",))
    err = _error_of(lambda: ns.spmd_map(bump, mesh=mesh, in_specs=P(), out_specs=P())(_expanded()))
    ref = _error_of(lambda: _expanded().add_(1))  # the block every rank holds
    assert isinstance(err, ns.SpmdError) and isinstance(err, type(ref))
    assert f"{type(ref).__name__}: {ref}" in str(err)
    assert "every instance raises on its own" in str(err) and "real mesh runs it" not in str(err)
    assert "spmd_map of `test_an_inplace_write" in str(err)


def test_an_inplace_write_into_an_expanded_input_only_the_batched_run_refuses_says_why():
    """Split over "a", each instance's block is one row: alone (as its rank on a real mesh) it
    takes the write; only the simulated mesh, writing both rows of one memory at once, refuses.
    The message says so and its fix (a materialized input) runs."""

    def bump(x):
        x.add_(1)
        return x

    mesh = ns.make_mesh((2,), ("a",))
    f = ns.spmd_map(bump, mesh=mesh, in_specs=P("a"), out_specs=P("a"))
    _expanded()[:1].add_(1)  # the reference: one instance's own block takes it
    err = _error_of(lambda: f(_expanded()))
    assert isinstance(err, ns.SpmdError) and isinstance(err.__cause__, RuntimeError)
    assert "no instance raises it on its own" in str(err) and "share memory" in str(err)
    assert "x.contiguous()" in str(err)
    torch.testing.assert_close(f(_expanded().contiguous()), _expanded() + 1)


@pytest.mark.parametrize(
    "cast",
    [
        lambda w: ns.pvary(w, "a"),
        lambda w: ns.pcast(w, "a", to="varying"),
        lambda w: ns.all_gather(w, "a"),
        lambda w: ns.pvary(w, "a").detach(),
    ],
    ids=["pvary", "pcast", "all_gather", "detached"],
)
def test_an_inplace_write_into_an_invariant_value_made_varying_names_the_cast(cast):
    """The instances' copies of a value made varying are one memory under the simulation: the
    message names the cast and the copy that fixes it, not the inputs (none is expanded); the
    real mesh's error (tests/dist_worker.py's cast alias checks): its class and text."""

    def bump(x, w):
        v = cast(w)
        v.add_(1)
        return v

    def fixed(x, w):
        return cast(w).clone().add_(1)

    mesh = ns.make_mesh((2,), ("a",))
    x, w = torch.zeros(4), torch.arange(2.0)
    err = _error_of(lambda: ns.spmd_map(bump, mesh=mesh, in_specs=P(), out_specs=P("a"))(x, w))
    assert isinstance(err, ns.VmaError) and "shares its operand's memory" in str(err)
    assert "invariant value made varying" in str(err) and ".clone()" in str(err)
    assert "x.contiguous()" not in str(err)
    out = ns.spmd_map(fixed, mesh=mesh, in_specs=P(), out_specs=P("a"))(x, w)
    # each instance's copy (all_gather: both members' w, stacked), concatenated over "a"
    torch.testing.assert_close(out, (w + 1).repeat(out.numel() // 2).reshape(out.shape))


def test_an_op_vmap_has_no_batching_rule_for_is_not_called_a_write():
    """torch.narrow with a tensor start has no batching rule (its .Tensor overload); a real mesh
    runs it. The message names the op and the fix (a Python int start), which runs."""
    mesh = ns.make_mesh((2,), ("a",))
    x = torch.arange(8.0)

    def window(x, start):
        return torch.narrow(x, 0, start, 2)

    f = ns.spmd_map(
        lambda x: window(x, torch.tensor(1)), mesh=mesh, in_specs=P("a"), out_specs=P("a")
    )
    err = _error_of(lambda: f(x))
    assert type(err) is ns.SpmdError and not isinstance(err, ns.VmaError)
    message = str(err)
    assert "no batching rule for `aten::narrow.Tensor`" in message
    assert "no write is involved" in message and "in-place" not in message
    assert "Python int" in message and "torch.narrow(x, 0, 1, 2)" in message
    g = ns.spmd_map(lambda x: window(x, 1), mesh=mesh, in_specs=P("a"), out_specs=P("a"))
    torch.testing.assert_close(g(x), torch.cat([window(b, 1) for b in x.chunk(2)]))
