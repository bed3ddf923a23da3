"""Regressions from a code review: bad inputs that escaped as bare Python errors or were
silently accepted (and so gave wrong results)."""

from __future__ import annotations

import collections
import contextlib
import functools
import inspect
import os
import pickle

import pytest
import torch

import named_spmd as ns
from named_spmd import P

MESH = ns.make_mesh((4,), ("i",))
SPLIT = P("i")


def _call(fn, out_specs=SPLIT):
    return ns.spmd_map(fn, mesh=MESH, in_specs=SPLIT, out_specs=out_specs)(torch.arange(8.0))


@pytest.mark.parametrize("bad", [0, None, 1.5])
def test_axis_name_not_a_name_raises_collective_error(bad):
    def f(x):
        return ns.psum(x, bad)

    with pytest.raises(ns.CollectiveError, match=r"psum in `.*f`.*axis_name must be"):
        _call(f, out_specs=P())


def test_pshuffle_rejects_non_integer_perm():
    # int(0.5) == 0 etc.: a float perm must not be truncated into a valid one silently
    def f(x):
        return ns.pshuffle(x, "i", [0.5, 1.2, 2.9, 3.0])

    with pytest.raises(ns.CollectiveError, match="permutation of range"):
        _call(f)


def test_ppermute_float_pairs_rejected_even_after_the_int_pairs_were_cached():
    # the validated-pairs cache hashed (0.0, 1.0) equal to (0, 1) and skipped the type check
    def ints(x):
        return ns.ppermute(x, "i", [(0, 1), (1, 0)])

    def floats(x):
        return ns.ppermute(x, "i", [(0.0, 1.0), (1.0, 0.0)])

    _call(ints)
    with pytest.raises(ns.CollectiveError, match="integer pairs"):
        _call(floats)


@pytest.mark.parametrize("shape", [(2.5,), ("x",), (True,)])
def test_make_mesh_non_integer_size_raises(shape):
    with pytest.raises(ns.SpmdError, match="make_mesh: axis sizes must be"):
        ns.make_mesh(shape, ("a",))


def test_mesh_coords_out_of_range_raises():
    mesh = ns.make_mesh((2, 3), ("a", "b"))
    assert mesh.coords(5) == {"a": 1, "b": 2}  # row-major, last instance
    for bad in (6, -1):
        with pytest.raises(ns.SpmdError, match=r"coords: linear index .* out of range"):
            mesh.coords(bad)


def _add_index_inplace(x):
    x.add_(ns.axis_index("i").to(x.dtype))
    return x


def _setitem_index(x):
    x[0] = ns.axis_index("i").to(x.dtype)
    return x


def _add_index_out(x):
    torch.add(x, ns.axis_index("i").to(x.dtype), out=x)
    return x


@pytest.mark.parametrize("fn", [_add_index_inplace, _setitem_index, _add_index_out])
def test_inplace_write_of_varying_into_invariant_raises_on_tracked_backends(fn):
    # the tracked backends' implicit pvary is a view: the write went into the invariant tensor,
    # which kept its invariant type, so out_specs=P() passed with rank-dependent values
    f = ns.spmd_map(fn, mesh=MESH, in_specs=P(), out_specs=P())
    with pytest.raises(
        ns.VmaError, match=r"in `_\w+` \(.*\): writes a value varying over \('i',\)"
    ):
        f.check(ns.ShapeDtype((3,)), backward=False)


@pytest.mark.parametrize("fn", [_add_index_inplace, _setitem_index, _add_index_out])
def test_inplace_write_of_varying_into_invariant_raises_vma_error_on_simulated_mesh(fn):
    # vmap refuses the write; its message (a bare broadcast error for add_) now comes wrapped
    f = ns.spmd_map(fn, mesh=MESH, in_specs=P(), out_specs=P())
    with pytest.raises(ns.VmaError, match=r"`_\w+` .*in-place write failed(.|\n)*out of place"):
        f(torch.zeros(3))


def test_inplace_write_into_varying_target_still_allowed():
    def f(x):
        x = x * 1.0  # varying over i
        x.add_(torch.ones(()))  # an invariant operand into a varying target: fine
        return x

    g = ns.spmd_map(f, mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)
    g.check(ns.ShapeDtype((8,)), backward=False)
    torch.testing.assert_close(g(torch.arange(8.0)), torch.arange(8.0) + 1)


def test_a_function_wrapping_a_mapped_one_runs_its_own_body():
    # functools.wraps copies the wrapped SpmdFunction's attributes onto the wrapper; mapping
    # the wrapper must not take the wrapped function's mesh, specs and body from them
    import functools

    inner = ns.spmd_map(torch.ones_like, mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)

    @functools.wraps(inner)
    def outer(x):
        return x * 3

    x = torch.arange(8.0)
    assert torch.equal(_call(outer), x * 3)
    assert outer.__wrapped__ is inner


def test_output_checks_of_a_later_call_still_raise_for_a_new_shape():
    # the output checks are kept per output structure and leaf key: a new key is checked
    @ns.spmd_map(mesh=MESH, in_specs=SPLIT, out_specs=P(None, "i"), check_vma=False)
    def f(x):
        return x.reshape(1, -1) if x.shape[0] == 2 else x

    assert f(torch.arange(8.0)).shape == (1, 8)
    with pytest.raises(ns.SpecError, match="out_specs"):
        f(torch.arange(4.0))


@pytest.mark.parametrize(
    "specs_kind, args_kind",
    [(dict, collections.OrderedDict), (collections.OrderedDict, dict)]
    + [(collections.OrderedDict, collections.OrderedDict)],
    ids=["dict specs, OrderedDict args", "OrderedDict specs, dict", "both, other orders"],
)
def test_dict_specs_pair_with_the_leaves_of_their_keys(specs_kind, args_kind):
    # optree matches dict-like nodes by key but flattens each in its own order (a dict sorted)
    a, b = torch.arange(8.0), torch.arange(10.0, 13.0)
    specs = specs_kind([("b", P()), ("a", SPLIT)])
    args = args_kind([("a", a), ("b", b)] if specs_kind is args_kind else [("b", b), ("a", a)])

    def f(d):
        return d["a"] + d["b"].sum(), d["b"]

    y, z = ns.spmd_map(f, mesh=MESH, in_specs=(specs,), out_specs=(SPLIT, P()))(args)
    torch.testing.assert_close(y, a + b.sum())
    torch.testing.assert_close(z, b)


def test_dict_out_specs_pair_with_the_outputs_of_their_keys():
    x = torch.arange(4.0)
    g = ns.spmd_map(
        lambda x: collections.OrderedDict([("b", x * 1), ("a", x * 2)]),
        mesh=MESH,
        in_specs=P(),
        out_specs={"a": SPLIT, "b": P()},
    )
    out = g(x)
    torch.testing.assert_close(out["a"], (x * 2).repeat(4))  # P() value tiled over the 4 blocks
    torch.testing.assert_close(out["b"], x)


def test_dict_specs_inside_a_namedtuple_pair_with_the_leaves_of_their_keys():
    pair = collections.namedtuple("pair", "x y")
    a, b = torch.arange(8.0), torch.arange(10.0, 13.0)
    specs = pair({"a": SPLIT, "b": P()}, P())
    args = pair(collections.OrderedDict([("b", b), ("a", a)]), b)
    f = ns.spmd_map(
        lambda t: t.x["a"] + t.x["b"].sum(), mesh=MESH, in_specs=(specs,), out_specs=SPLIT
    )
    torch.testing.assert_close(f(args), a + b.sum())


class _Scaled(torch.nn.Module):
    """A module whose per-device function is a mapped method: ``self`` is closed over."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w)

    @ns.spmd_map(mesh=MESH, in_specs=(SPLIT,), out_specs=SPLIT)
    def scaled(self, x):
        return x * self.w

    def forward(self, x):
        return self.scaled(x)


def test_a_mapped_method_gets_its_instance_outside_in_specs():
    """``m.scaled(x)``: the instance is ``self``, in_specs pair with ``x`` alone, and its
    parameter is closed over (invariant: its gradient the sum over the instances)."""
    x = torch.randn(8, 3)
    for w in (torch.randn(3), torch.randn(3)):  # two instances: each its own parameter
        m = _Scaled(w.clone())
        y = m(x)
        torch.testing.assert_close(y, x * w)
        (grad,) = torch.autograd.grad(y.sum(), [m.w])
        torch.testing.assert_close(grad, x.sum(0))
        torch.testing.assert_close(m.scaled.local(x), x * w)
        assert str(m.scaled.check(x).types[0]) == "f32[2,3]{i}"
    assert isinstance(_Scaled.scaled, ns.SpmdFunction)  # read from the class: itself
    again = pickle.loads(pickle.dumps(m.scaled))  # a bound method: bound again
    torch.testing.assert_close(again(x), x * again.__self__.w.detach())


def test_a_bound_mapped_method_shows_what_describes_the_mapped_function():
    """``m.scaled``: the mapped function's mesh and specs, its signature without ``self``; not
    the mapped function's methods that take the arguments without the instance."""
    m = _Scaled(torch.ones(3))
    assert m.scaled.mesh is MESH and m.scaled.in_specs == (SPLIT,)
    assert m.scaled.__name__ == "scaled" and str(inspect.signature(m.scaled)) == "(x)"
    for internal in ("unequal_blocks", "_split_self", "binds_self"):
        with pytest.raises(AttributeError):
            getattr(m.scaled, internal)


def _times_w(self, x):
    return x * self.w


class _Renamed(torch.nn.Module):
    """A mapped method whose attribute's name is not its function's, which names another
    method of the class."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(w)

    step = ns.spmd_map(_times_w, mesh=MESH, in_specs=(SPLIT,), out_specs=SPLIT)

    def _times_w(self, x):  # after ``step``: the module's function is the one mapped
        return x * 0


def test_a_mapped_method_pickles_as_the_attribute_it_is():
    """A bound mapped method unpickles as the attribute of its instance that it was (not a
    method named as its function); one assigned outside a class body has no known name, and
    pickling it is an SpmdError saying so."""
    x, w = torch.randn(8, 3), torch.randn(3)
    again = pickle.loads(pickle.dumps(_Renamed(w.clone()).step))
    assert type(again) is type(_Renamed(w).step)
    torch.testing.assert_close(again(x), x * w)

    class Later:
        def __init__(self) -> None:
            self.w = w

    Later.step = ns.spmd_map(_times_w, mesh=MESH, in_specs=(SPLIT,), out_specs=SPLIT)
    torch.testing.assert_close(Later().step(x), x * w)
    with pytest.raises(ns.SpmdError, match="not assigned in a class body"):
        pickle.dumps(Later().step)


def _plus_w(self, x):
    return x + self.w


def test_a_mapped_method_under_two_names_does_not_pickle_as_the_other():
    """One mapped function assigned in two class bodies: its recorded name is the last one, an
    attribute of another class that names another mapped method. Pickling is refused rather
    than unpickled as that other method."""
    shared = ns.spmd_map(_times_w, mesh=MESH, in_specs=(SPLIT,), out_specs=SPLIT)

    class A:
        step = shared
        other = ns.spmd_map(_plus_w, mesh=MESH, in_specs=(SPLIT,), out_specs=SPLIT)

        def __init__(self) -> None:
            self.w = torch.full((3,), 2.0)

    class B:
        other = shared

    x = torch.ones(8, 3)
    torch.testing.assert_close(A().step(x), 2 * x)
    with pytest.raises(ns.SpmdError, match="assigned under several names"):
        pickle.dumps(A().step)
    assert B.other is shared


@pytest.mark.parametrize("count", [1, 3])
def test_a_call_with_arguments_the_function_does_not_take_names_it(count):
    """A single P pairs with any number of arguments: the function's refusal of their number
    is an SpmdError naming it (still a TypeError); a TypeError the function raises is its own."""

    def add(x, y):
        return x + y

    f = ns.spmd_map(add, mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)
    with pytest.raises(ns.SpmdError) as raised:
        f(*[torch.ones(8)] * count)
    message = str(raised.value)
    assert isinstance(raised.value, TypeError)
    assert "spmd_map of `" in message and "add` (test_review_regressions.py:" in message
    assert f"with the call's {count} positional argument(s)" in message
    with pytest.raises(ns.SpecError, match=r"in_specs has a tuple of 2 where the arguments have"):
        ns.spmd_map(add, mesh=MESH, in_specs=(SPLIT, SPLIT), out_specs=SPLIT)(torch.ones(8))

    def own(x):
        raise TypeError("the function's own")

    with pytest.raises(TypeError, match="the function's own") as raised:
        ns.spmd_map(own, mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)(torch.ones(8))
    assert not isinstance(raised.value, ns.SpmdError)

    @functools.wraps(own)  # a wrapper taking other arguments than the function it wraps
    def wrapper(x, y):
        raise TypeError("the wrapper's own")

    with pytest.raises(TypeError, match="the wrapper's own") as raised:
        ns.spmd_map(wrapper, mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)(
            torch.ones(8), torch.ones(8)
        )
    assert not isinstance(raised.value, ns.SpmdError)


@pytest.mark.parametrize("mesh", [MESH, ns.make_mesh((1,), ("i",))], ids=["4", "1"])
def test_a_module_called_with_arguments_its_forward_does_not_take_names_it(mesh):
    """``nn.Module.__call__`` passes the arguments on to ``forward``: its refusal of their
    number is the same SpmdError as a function's; a TypeError ``forward`` raises is its own."""
    lin = torch.nn.Linear(3, 3)
    f = ns.spmd_map(lin, mesh=mesh, in_specs=SPLIT, out_specs=SPLIT)
    with pytest.raises(ns.SpmdError) as raised:
        f(torch.ones(8, 3), torch.ones(8, 3))
    assert isinstance(raised.value, TypeError)
    message = str(raised.value)
    assert "spmd_map of `Linear(" in message and "call's 2 positional argument(s)" in message

    class Own(torch.nn.Module):
        def forward(self, x):
            raise TypeError("the module's own")

    g = ns.spmd_map(Own(), mesh=mesh, in_specs=SPLIT, out_specs=SPLIT)
    with pytest.raises(TypeError, match="the module's own") as raised:
        g(torch.ones(8))
    assert not isinstance(raised.value, ns.SpmdError)
    # a pre-hook that drops the second argument: forward runs, and its error is its own
    hooked = Own()
    hooked.register_forward_pre_hook(lambda module, args: args[:1])
    g = ns.spmd_map(hooked, mesh=mesh, in_specs=SPLIT, out_specs=SPLIT)
    with pytest.raises(TypeError, match="the module's own") as raised:
        g(torch.ones(8), torch.ones(8))
    assert not isinstance(raised.value, ns.SpmdError)

    class Calls(torch.nn.Module):  # forward calls a submodule with arguments it does not take
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(3, 3)

        def forward(self, x):
            return self.lin(x, x)

    g = ns.spmd_map(Calls(), mesh=mesh, in_specs=SPLIT, out_specs=SPLIT)
    with pytest.raises(TypeError, match="positional argument") as raised:
        g(torch.ones(8, 3))
    assert "the call's 1 positional argument(s)" not in str(raised.value)  # not the call's


def test_arguments_refused_through_torchs_wrappers_name_the_call():
    """A ``forward`` decorated by ``torch.no_grad()`` and a ``torch.compile``d function or
    module refuse the call's arguments inside torch's wrappers only: the same SpmdTypeError as
    a plain function's, naming the function; a TypeError raised inside them stays their own."""

    class Decorated(torch.nn.Module):
        @torch.no_grad()
        def forward(self, x):
            return x * 2

    def double(x):
        return x * 2

    class Plain(torch.nn.Module):
        def forward(self, x):
            return x * 2

    compiled = torch.compile(double, backend="eager")
    for fn in (Decorated(), compiled, torch.compile(Plain(), backend="eager")):
        f = ns.spmd_map(fn, mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)
        with pytest.raises(ns.SpmdError) as raised:
            f(torch.ones(8), torch.ones(8))
        assert isinstance(raised.value, TypeError), fn
        assert "call's 2 positional argument(s)" in str(raised.value), fn
        if fn is compiled:  # named by the function's own line, not the wrapper's
            assert "spmd_map of `test_arguments_refused" in str(raised.value)
            assert "double` (test_review_regressions.py:" in str(raised.value)
        torch.testing.assert_close(f(torch.ones(8)), torch.full((8,), 2.0))

    class Own(torch.nn.Module):
        @torch.no_grad()
        def forward(self, x):
            raise TypeError("the module's own")

    g = ns.spmd_map(Own(), mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)
    with pytest.raises(TypeError, match="the module's own") as raised:
        g(torch.ones(8))
    assert not isinstance(raised.value, ns.SpmdError)


def test_an_input_written_after_an_op_saved_it_is_the_calls_error():
    """A parameter written in place after ``sin`` saved it: the call's SpmdError (still a
    RuntimeError) quoting autograd's refusal, raised by the call, where the backward pass
    would fail (on a real mesh on the writing ranks only: tests/faults_worker.py
    ``written_after_use``). Written before its first use, the call runs and differentiates."""
    x = torch.arange(8.0, dtype=torch.float64)

    def after(x, w):
        y = ns.psum(x * torch.sin(w), "i")
        with torch.no_grad():
            w.add_(1)
        return y

    def before(x, w):
        with torch.no_grad():
            w.add_(1)
        return ns.psum(x * torch.sin(w), "i")

    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    f = ns.spmd_map(after, mesh=MESH, in_specs=(P("i"), P()), out_specs=P())
    with pytest.raises(ns.SpmdError) as raised:
        f(x, w)
    assert isinstance(raised.value, RuntimeError)
    message = str(raised.value)
    assert "spmd_map of `test_an_input_written_after_an_op_saved_it" in message
    assert "wrote in place into an input (argument [1])" in message
    assert "modified by an inplace operation" in message
    w = torch.nn.Parameter(torch.ones(2, dtype=torch.float64))
    g = ns.spmd_map(before, mesh=MESH, in_specs=(P("i"), P()), out_specs=P())
    g(x, w).sum().backward()
    torch.testing.assert_close(w.grad, x.reshape(4, 2).sum(0) * torch.cos(torch.full((2,), 2.0)))


def test_inputs_written_before_and_after_a_save_are_named_alike():
    """Two inputs written, one harmlessly before any use, the other after ``b * w`` saved it:
    autograd's error does not tell whose save it refused, so the call's SpmdError names both
    written arguments, not the first written one alone."""
    w = torch.ones(2, dtype=torch.float64, requires_grad=True)

    def both(a, b):
        a.add_(0)
        y = b * w
        b.add_(1)
        return ns.psum(y + a, "i")

    f = ns.spmd_map(both, mesh=MESH, in_specs=(P("i"), P("i")), out_specs=P())
    x = torch.arange(8.0, dtype=torch.float64)
    with pytest.raises(ns.SpmdError, match=r"into an input \(one of arguments \[0\], \[1\]\)"):
        f(x.clone(), x.clone())


def test_an_input_requiring_no_grad_written_after_an_op_saved_it_is_the_calls_error():
    """``x * w`` saves ``w`` (which requires no grad) for ``x``'s gradient: written after, the
    call's SpmdError, where the backward pass would fail (on a real mesh on the writing ranks
    only: tests/faults_worker.py ``written_unwatched``). Written with no graph to save it (no
    tensor requires grad), the call runs."""
    x = torch.arange(8.0, dtype=torch.float64)

    def after(x, w):
        y = ns.psum(x * w, "i")
        w.add_(1)
        return y

    f = ns.spmd_map(after, mesh=MESH, in_specs=(P("i"), P()), out_specs=P())
    w = torch.ones(2, dtype=torch.float64)
    with pytest.raises(ns.SpmdError, match=r"wrote in place into an input \(argument \[1\]\)"):
        f(x.clone().requires_grad_(), w)
    w = torch.ones(2, dtype=torch.float64)
    torch.testing.assert_close(f(x, w), x.reshape(4, 2).sum(0))
    torch.testing.assert_close(w, torch.full((2,), 2.0, dtype=torch.float64))


def test_a_write_reads_its_own_storage_address_only(monkeypatch):
    """Inside a call that made explicit casts to varying, every write is compared with the
    casts' memory by storage (``_tracking.check_cast_alias``): each cast's address is read
    when the cast is noted, so a write reads its own target's address alone, however many
    casts the call made (here 3 casts, 4 writes on each of 2 instances)."""
    from named_spmd import _tracking

    real, reads = _tracking.storage_address, []
    monkeypatch.setattr(_tracking, "storage_address", lambda t: reads.append(1) or real(t))

    def f(x, w):
        a, b, c = (ns.pvary(w * k, "i") for k in (1.0, 2.0, 3.0))
        y = x.clone()
        for _ in range(4):
            y.add_(1.0)  # memory no cast shares: compared by storage with every cast's
        return y + a + b + c

    x, w = torch.arange(4.0), torch.tensor([1.0, -1.0])
    mesh = ns.make_mesh((2,), ("i",))
    with ns.simulate_per_instance():
        out = ns.spmd_map(f, mesh=mesh, in_specs=(P("i"), P()), out_specs=P("i"))(x, w)
    torch.testing.assert_close(out, x + 4.0 + 6.0 * w.repeat(2))
    assert len(reads) == 4 * 2


def test_a_call_does_not_rebuild_its_function_label(monkeypatch):
    """A call's context names the function only when a message needs it (``inspect.unwrap``
    follows every wrapper: a cost on every call otherwise); an error still names it."""
    unwrapped = []
    real_unwrap = inspect.unwrap

    def counting_unwrap(fn, **kw):
        unwrapped.append(fn)
        return real_unwrap(fn, **kw)

    def body(x):
        return ns.psum(x, "i")

    f = ns.spmd_map(body, mesh=MESH, in_specs=SPLIT, out_specs=P())
    monkeypatch.setattr(inspect, "unwrap", counting_unwrap)
    for _ in range(3):
        assert torch.equal(f(torch.arange(8.0)), torch.arange(8.0).reshape(4, 2).sum(0))
    assert [fn for fn in unwrapped if fn is body] == []

    def bad(x):
        return ns.psum(x, "j")

    with pytest.raises(ns.CollectiveError, match=r"psum in `.*bad` \(test_review_regressions"):
        _call(bad, out_specs=P())


def test_a_checkpointed_call_run_forward_only_leaves_no_context():
    """A checkpoint inside a call on the simulated mesh, run forward with grad on and no
    backward (an eval step without no_grad): the call's context is collected, not kept alive by
    the last tensor it typed, whose graph reaches the checkpoint's frame and the call's marker."""
    import gc

    from torch.utils.checkpoint import checkpoint

    from named_spmd._context import SpmdContext

    def body(x, w):
        h = torch.tanh(x @ w.T)
        h = checkpoint(lambda h: torch.tanh(h @ w.T), h, use_reentrant=False)
        return ns.psum(h.sum(), "i")

    def live() -> int:
        gc.collect()
        return sum(SpmdContext in type(o).__mro__ for o in gc.get_objects())

    f = ns.spmd_map(body, mesh=MESH, in_specs=(SPLIT, P()), out_specs=P())
    x, w = torch.randn(8, 3), torch.randn(3, 3, requires_grad=True)
    before = live()
    for _ in range(3):
        f(x, w)
    assert live() == before


def test_a_group_of_one_names_the_function_as_its_call_does():
    """A call's collectives over one instance (``SpmdContext.alone``) name the function with
    the call's label (a traced call computes it eagerly; read off the function under tracing
    it would not be)."""
    from named_spmd._calls import active

    labels = []

    def body(x):
        ctx = active()
        ctx.fn_label = "`given`"
        labels.append(ctx.alone().fn_label)
        return x

    _call(body)
    assert labels == ["`given`"]


@pytest.mark.parametrize("named_spmd_traced", [True, False])
def test_only_dynamo_failing_on_named_spmds_code_is_told_as_a_plain_compile(named_spmd_traced):
    """Dynamo's internal error names ns.compile (``backends/distributed._told_per_rank``) only
    where the code it traced was named_spmd's (the user-code stack it kept on the error it
    rewrapped); one of the user's own compiled code is left as it is."""
    import traceback

    from torch._dynamo.exc import InternalTorchDynamoError

    from named_spmd._errors import PACKAGE_DIR
    from named_spmd._torch_private import is_dynamo_internal_error

    traced = os.path.join(PACKAGE_DIR[0], "_plan.py") if named_spmd_traced else __file__
    try:
        try:
            raise AttributeError("'dict' object has no attribute 'node'")
        except AttributeError as inner:  # as Dynamo raises it: the traced frames kept on it
            inner.real_stack = traceback.StackSummary.from_list([(traced, 91, "guard_key", "")])
            raise InternalTorchDynamoError(f"AttributeError: {inner}") from None
    except InternalTorchDynamoError as e:
        error = e
    assert is_dynamo_internal_error(error, PACKAGE_DIR) is named_spmd_traced


def test_the_write_check_reruns_no_checkpointed_region():
    """A call that writes into an input legitimately (no op saved it) checks the saved tensors
    of its own graph only, unpacking none through hooks: a checkpoint before the call is not
    recomputed in the forward pass (its unpack hook would rerun it, collectives included)."""
    from torch.utils.checkpoint import checkpoint

    runs = []

    def region(x):
        runs.append(1)
        return torch.sin(x) * x

    def body(h):
        h.add_(1.0)
        return h * 2

    f = ns.spmd_map(body, mesh=MESH, in_specs=SPLIT, out_specs=SPLIT)
    x = torch.randn(8, dtype=torch.float64, requires_grad=True)
    h = checkpoint(region, x, use_reentrant=False) * 1
    out = f(h)
    assert len(runs) == 1
    out.sum().backward()
    torch.testing.assert_close(x.grad, 2 * (torch.cos(x) * x + torch.sin(x)))
    assert len(runs) == 2  # the backward pass's recomputation


def _written_between_uses(x, w, s):
    h = x * s  # s meets a varying value: an implicit cast to varying, cached for the call
    s.add_(1)
    return h + x * w * s  # the cast again: the first, a view of s, autograd refuses after the write


@pytest.mark.parametrize("recorded", [False, True], ids=["plain", "CommMode"])
def test_an_input_written_between_two_uses_is_cast_again(recorded):
    """An invariant input that requires grad, written in place between two uses beside a
    varying value: the second use casts it again (a cast is a view of it that a custom
    Function made, a CommMode's tag or a real mesh's pvary, which autograd refuses to use once
    its base is written), and the call gives dense torch's values and gradients; check()
    takes it too (tests/dist_worker.py checks a real mesh; per instance, each instance would
    write the shared block: refused, test_check.py)."""
    x = torch.arange(8.0).reshape(4, 2)
    f = ns.spmd_map(_written_between_uses, mesh=MESH, in_specs=(P("i"), P(), P()), out_specs=P("i"))
    w, s0 = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    w_ref, s0_ref = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    want = _written_between_uses(x, w_ref, s0_ref * 1)
    want.sum().backward()
    with ns.CommMode() if recorded else contextlib.nullcontext():
        got = f(x, w, s0 * 1)
        got.sum().backward()
        report = f.check(x, w, s0 * 1)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(w.grad, w_ref.grad)
    torch.testing.assert_close(s0.grad, s0_ref.grad)
    assert [str(t) for t in report.types] == ["f32[1,2]{i}"]
