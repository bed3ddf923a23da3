"""Writes through a boolean mask (``y[y > 0] = 0``, ``index_put_``) on the simulated mesh: a value
that every True position takes whole runs as ``masked_fill_`` (vmap refuses the write itself),
with the values and gradients of each instance's plain torch; other values keep the SpmdError."""

from __future__ import annotations

import contextlib

import pytest
import torch

import named_spmd as ns
from named_spmd import P


def clamp_positive(x, w):
    y = x * w
    y[y > 0] = 0
    return y


def raise_negative(x, w):
    y = x * w
    y[y < 0] = 0.5
    return y


def fill_with_a_0d_tensor(x, w):
    y = x * 1
    y[x > 0] = (w * x).sum()  # varies over the axis, and carries both inputs' gradients
    return y


def fill_rows(x, w):
    y = x * w
    y[x[:, 0] > 0] = w[0] * 3  # a whole row per True position; a 1-element value
    return y


def fill_rows_with_a_row(x, w):
    y = x * 1
    y[x[:, 0] > 0] = w  # broadcast over the positions, not sized by them
    return y


def write_through_a_view(x, w):
    y = x * w
    v = y[:, 1:]  # the write reaches y, as torch's
    v[v > 0] = w[0]
    v.T[v.T < -0.5] = -1.0
    return y


def index_put_in_place(x, w):
    y = x * w
    y.index_put_((y > 0,), w.sum())
    return y + torch.index_put(x, (x < 0,), w[1:].sum() * 2)


def index_put_by_keywords(x, w):
    y = x * w
    y.index_put_(values=w.sum(), indices=(y > 0,))
    z = torch.index_put(input=x, indices=(x < 0,), values=w[1:].sum() * 2, accumulate=False)
    return y + z


def torch_index_put_in_place(x, w):
    y = x * w
    torch.index_put_(y, (y > 0,), w.sum())  # the function form, besides the method
    return y


def a_mask_invariant_over_the_axis(x, w):
    y = x * 1
    y[w.expand(y.shape) > 0.5] = w.sum()  # w: P(), its mask the same in every instance
    return y


PROGRAMS = [
    clamp_positive,
    raise_negative,
    fill_with_a_0d_tensor,
    fill_rows,
    fill_rows_with_a_row,
    write_through_a_view,
    index_put_in_place,
    index_put_by_keywords,
    torch_index_put_in_place,
    a_mask_invariant_over_the_axis,
]


def _inputs():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 3, generator=g)
    w = torch.rand(3, generator=g) + 0.2
    return x, w


def _reference(fn, x, w, instances):
    """Each instance's plain torch on its block, the blocks concatenated."""
    return torch.cat([fn(b, w) for b in x.chunk(instances)])


@pytest.mark.parametrize("per_instance", [False, True], ids=["vmap", "per-instance"])
@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_values_and_gradients_are_each_instances_plain_torchs(fn, per_instance):
    mesh = ns.make_mesh((4,), ("dp",), simulated=True)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x0, w0 = _inputs()
    cot = torch.linspace(-1.0, 1.0, x0.numel()).reshape(x0.shape)
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    with ns.simulate_per_instance() if per_instance else contextlib.nullcontext():
        got = f(x, w)
    (got * cot).sum().backward()
    xr, wr = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    want = _reference(fn, xr, wr, 4)
    (want * cot).sum().backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(x.grad, xr.grad)
    torch.testing.assert_close(w.grad, wr.grad)


@pytest.mark.parametrize("fn", PROGRAMS, ids=lambda f: f.__name__)
def test_torch_func_grad_inside_and_around_the_call(fn):
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=True)
    x, w = _inputs()

    def inner(xb, wb):
        return torch.func.grad(lambda a, b: (fn(a, b) * a).sum(), argnums=(0, 1))(xb, wb)

    f = ns.spmd_map(
        inner, mesh=mesh, in_specs=(P(("dp", "tp")), P()), out_specs=(P(("dp", "tp")), P())
    )
    gx, gw = f(x, w)
    want = [inner(b, w) for b in x.chunk(4)]
    torch.testing.assert_close(gx, torch.cat([g[0] for g in want]))
    # w is invariant: its gradient inside the call is the instances' total, as on a real mesh
    torch.testing.assert_close(gw, sum(g[1] for g in want))

    g = ns.spmd_map(fn, mesh=mesh, in_specs=(P(("dp", "tp")), P()), out_specs=P(("dp", "tp")))
    around = torch.func.grad(lambda a, b: (g(a, b) * a).sum(), argnums=(0, 1))(x, w)
    dense = torch.func.grad(lambda a, b: (_reference(fn, a, b, 4) * a).sum(), argnums=(0, 1))(x, w)
    torch.testing.assert_close(around, dense)


def _sized_by_the_mask(x):
    y = x * 1
    y[y > 0] = torch.ones(2)  # one element per True position: its size is the mask's count
    return y


def _values_read_through_the_mask(x):
    y = x * 1
    y[y > 0] = y[y > 0] * 2
    return y


@pytest.mark.parametrize("fn", [_sized_by_the_mask, _values_read_through_the_mask])
def test_a_value_sized_by_the_mask_keeps_the_clear_error(fn):
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(ns.SpmdError, match=fn.__name__) as error:
        f(torch.arange(8.0) - 3.5)
    assert "boolean mask" in str(error.value)
    assert "torch.func.vmap" in str(error.value)


def _a_row_of_another_dtype(x):
    y = x * 1
    y[y[:, 0] > 0] = torch.tensor([7, 8])  # int64 into float32: index_put_ refuses it
    return y


def _a_number_tensor_of_another_dtype(x):
    y = x * 1
    y[y > 0] = torch.tensor(7)  # one element on the CPU: torch casts it (masked_fill's shortcut)
    return y


def test_a_value_of_another_dtype_is_written_or_refused_as_torch_does():
    """torch casts a one-element CPU value and refuses a row of another dtype; the simulated
    mesh does the same (values against each instance's plain torch; the refusal an error)."""
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)
    x = torch.arange(8.0).reshape(4, 2) - 3.5
    with pytest.raises(RuntimeError, match="dtypes match"):
        _a_row_of_another_dtype(x[:2].clone())
    refused = ns.spmd_map(_a_row_of_another_dtype, mesh=mesh, in_specs=P("dp"), out_specs=P("dp"))
    with pytest.raises(ns.SpmdError, match="_a_row_of_another_dtype"):
        refused(x)
    cast = ns.spmd_map(
        _a_number_tensor_of_another_dtype, mesh=mesh, in_specs=P("dp"), out_specs=P("dp")
    )
    want = torch.cat([_a_number_tensor_of_another_dtype(b) for b in x.chunk(2)])
    assert torch.equal(cast(x), want)


def test_a_varying_value_written_into_an_invariant_tensor_is_refused():
    mesh = ns.make_mesh((2,), ("dp",), simulated=True)

    def into_invariant(x, w):
        w[w > 0] = x.sum()
        return w

    f = ns.spmd_map(into_invariant, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P())
    with pytest.raises(ns.SpmdError):
        f(torch.arange(4.0), torch.ones(3))


@pytest.mark.parametrize(
    "fn",
    [
        clamp_positive,
        fill_rows_with_a_row,
        write_through_a_view,
        index_put_in_place,
        index_put_by_keywords,
        torch_index_put_in_place,
    ],
)
def test_a_compiled_call_agrees_with_the_eager_one(fn):
    mesh = ns.make_mesh((4,), ("dp",), simulated=True)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=(P("dp"), P()), out_specs=P("dp"))
    x0, w0 = _inputs()
    results = []
    for run in (f, torch.compile(f, backend="eager", fullgraph=True)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = run(x, w)
        (y * x0).sum().backward()
        results.append((y.detach(), x.grad, w.grad))
    torch.testing.assert_close(results[1], results[0])
    torch.testing.assert_close(results[0][0], _reference(fn, x0, w0, 4))
