"""Private torch names live in named_spmd/_torch_private/ only, and each still does what the
library relies on (a torch upgrade that changes one fails here, by name).
"""

from __future__ import annotations

import contextlib
import copy
import pathlib
import re
import subprocess
import sys
import uuid
import warnings

import pytest
import torch
from _autograd_functions import identity_function
from torch.autograd import forward_ad
from torch.fx.experimental.proxy_tensor import make_fx

from named_spmd import _torch_private as torch_private

PACKAGE = pathlib.Path(__file__).resolve().parents[1] / "named_spmd"
# What marks a private torch name (in code, strings and comments alike).
PRIVATE = re.compile(
    r"torch\._|torch\.ops\._|_functorch|_c10d_functional|_dtensor_spec|_local_tensor"
    r"|getrefcount|_use_count|_storage_Use_Count|_SingleLevelFunction|_execution_engine"
    # private attributes of tensors and autograd: forward AD's level, a view's base, ...
    r"|\b_current_level\b|\b_base\b|\._(?:version|grad_fn|cdata)\b"
    # ... AsyncCollectiveTensor's buffer and wait
    r"|\.elem\b|trigger_wait"
    # DTensor internals: its private modules, its spec (DTensorSpec and TensorMeta also name
    # DTensor's concepts in prose, so those two count where code reaches them: as an attribute,
    # called or imported), its private constructor DTensor(local, spec, ...), a DTensor's _spec
    r"|distributed\.tensor\._|c10d\._|compute_global_tensor_info"
    r"|\.(?:DTensorSpec|TensorMeta)\b|\b(?:DTensorSpec|TensorMeta)\s*\(|\bimport\b.*\bDTensorSpec\b"
    r"|\bimport\b.*\bTensorMeta\b|\bDTensor\(|[\w)\]]\._spec\b"
    # the torch-function mode stack and its device modes (the checkpoint marker's base)
    r"|\boverrides\._|\boverrides import _|\butils\._device\b"
)


def private_names_outside(package: pathlib.Path) -> list[str]:
    """``file:line: text`` for every line outside the package's ``_torch_private/`` naming a
    private torch name."""
    found = []
    for path in sorted(package.rglob("*.py")):
        if path.relative_to(package).parts[0] == "_torch_private":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PRIVATE.search(line):
                found.append(f"{path.relative_to(package.parent)}:{number}: {line.strip()}")
    return found


def test_no_module_but_torch_private_names_a_private_torch_api():
    assert private_names_outside(PACKAGE) == []


def test_the_scan_finds_a_private_name(tmp_path):
    """The scan is not vacuous: a module naming ``torch._C`` is reported, also one named like the
    one place but elsewhere; the modules of ``_torch_private/`` may."""
    (tmp_path / "named_spmd" / "_torch_private").mkdir(parents=True)
    (tmp_path / "named_spmd" / "backends").mkdir()
    (tmp_path / "named_spmd" / "_leaky.py").write_text(
        "import torch\nx = torch._C._get_tracing_state\n"
    )
    (tmp_path / "named_spmd" / "_torch_private" / "c10d.py").write_text("x = torch._C\n")
    (tmp_path / "named_spmd" / "backends" / "_torch_private.py").write_text("x = torch._C\n")
    found = private_names_outside(tmp_path / "named_spmd")
    assert found == [
        "named_spmd/_leaky.py:2: x = torch._C._get_tracing_state",
        "named_spmd/backends/_torch_private.py:1: x = torch._C",
    ]


LEAKS = [  # one line per private name the scan must report outside _torch_private/
    "on = forward_ad._current_level >= 0",
    "shared = x._base is not None",
    "v = x._version",
    "buf = pending.elem",
    "g = pending.trigger_wait()",
    "from torch.distributed.tensor._utils import compute_global_tensor_info",
    "shape, stride = compute_global_tensor_info(local, mesh, places)",
    "spec = d.DTensorSpec(mesh, places, tensor_meta=meta)",
    "meta = TensorMeta(shape, stride, dtype)",
    "from somewhere import DTensorSpec, TensorMeta",
    "out = DTensor(local, spec, requires_grad=False)",
    "spec = dtensor._spec",
    "local = dtensor._local_tensor",
    "n = x._use_count()",
    "store = c10d._get_default_store()",
    "from torch.overrides import _push_mode",
    "depth = torch.overrides._len_torch_function_stack()",
    "from torch.utils._device import DeviceContext",
]
PROSE = [  # what the scan leaves alone: the package's own names and DTensor's concepts in prose
    "from ._spec import PartitionSpec",
    "top = torch_private.maybe_current_level()",
    "specs: dict = {}  # (placements, shape, stride, dtype) -> DTensorSpec",
    "DTensor's ``from_local`` rebuilds a ``DTensorSpec`` for every tensor",
    "for elem in elements: is_base = isinstance(g, DTensor)",
]


def test_the_scan_finds_each_private_name_and_only_those(tmp_path):
    (tmp_path / "named_spmd").mkdir()
    (tmp_path / "named_spmd" / "_leaky.py").write_text("\n".join(LEAKS + PROSE) + "\n")
    found = private_names_outside(tmp_path / "named_spmd")
    assert found == [f"named_spmd/_leaky.py:{i}: {line}" for i, line in enumerate(LEAKS, 1)]


# --- pins: each private name still behaves as the library uses it -----------------------------


def test_vmap_levels_entered_directly_round_trip():
    level = torch_private.vmap_increment_nesting(3, "same")
    try:
        assert torch_private.maybe_current_level() == level
        x = torch_private.add_batch_dim(torch.arange(6.0).reshape(3, 2), 0, level)
        assert torch_private.maybe_get_level(x) == level and torch_private.is_batchedtensor(x)
        assert torch_private.maybe_get_bdim(x) == 0
        assert torch_private.get_unwrapped(x).shape == (3, 2)
        assert torch_private.is_transform_wrapped(x)
        back = torch_private.remove_batch_dim(x * 2, level, 3, 0)
    finally:
        torch_private.vmap_decrement_nesting()
    assert torch.equal(back, torch.arange(6.0).reshape(3, 2) * 2)
    assert torch_private.maybe_get_level(torch.ones(1)) == -1
    assert [i.key() for i in torch_private.get_interpreter_stack() or []] == []


def test_printing_hooks_answer_first_for_wrapped_tensors_only(monkeypatch):
    """repr / str / format of a functorch-wrapped tensor reach the hooks; None hands back to
    torch; plain tensors never reach them (the simulated backend's per-instance printing)."""
    seen: list[str] = []
    monkeypatch.setitem(
        torch_private._PRINT_HOOKS, "text", lambda t: seen.append("text") or "shown"
    )
    monkeypatch.setitem(
        torch_private._PRINT_HOOKS, "formatted", lambda t, spec: f"formatted {spec}"
    )
    texts: list[str] = []

    def f(x):
        texts.extend([repr(x), str(x), f"{x}", f"{x.sum():.2f}"])
        return x

    torch.func.vmap(f)(torch.ones(2, 3))
    assert texts == ["shown", "shown", "formatted ", "formatted .2f"]
    assert repr(torch.ones(1)) == "tensor([1.])" and f"{torch.tensor(1.5):.2f}" == "1.50"
    assert seen == ["text", "text"]
    monkeypatch.setitem(torch_private._PRINT_HOOKS, "text", lambda t: None)
    monkeypatch.setitem(torch_private._PRINT_HOOKS, "formatted", lambda t, spec: None)
    texts.clear()
    torch.func.vmap(lambda x: texts.append(repr(x)) or x)(torch.ones(2, 3))
    assert texts[0].startswith("BatchedTensor(lvl=1, bdim=0, value=")


def test_grad_level_hooks_see_every_grad_like_transform_enter_and_leave(monkeypatch):
    """torch.func grad, grad_and_value, vjp, jacrev and hessian reach the hooks with their grad
    level (jvp and vmap do not enter one); leaving is reported at that level, also when the
    function raises (the simulated backend's implicit pvary under a grad inside a call)."""
    import named_spmd.backends.simulated  # noqa: F401 - installs the hooks

    seen: list[tuple[str, int | None]] = []
    monkeypatch.setitem(
        torch_private._GRAD_HOOKS, "entered", lambda level: seen.append(("in", level))
    )
    monkeypatch.setitem(
        torch_private._GRAD_HOOKS, "leaving", lambda level: seen.append(("out", level))
    )
    x = torch.ones(3)
    f = lambda u: (u * u).sum()  # noqa: E731
    for transform in (
        lambda: torch.func.grad(f)(x),
        lambda: torch.func.grad_and_value(f)(x),
        lambda: torch.func.vjp(f, x),
        lambda: torch.func.jacrev(torch.sin)(x),
    ):
        seen.clear()
        transform()
        assert seen == [("in", 1), ("out", 1)]
    seen.clear()
    torch.func.hessian(f)(x)  # jacfwd (a jvp level, then vmap) of jacrev
    assert seen == [("in", 3), ("out", 3)]
    seen.clear()
    torch.func.jvp(torch.sin, (x,), (x,))
    torch.func.vmap(torch.sin)(x)
    assert seen == []
    with pytest.raises(ValueError):
        torch.func.grad(lambda u: (_ for _ in ()).throw(ValueError()))(x)
    assert seen == [("in", 1), ("out", 1)]


def test_grad_tracking_tensors_are_recognised():
    kinds = []

    def f(x):
        kinds.append((torch_private.is_gradtrackingtensor(x), torch_private.is_batchedtensor(x)))
        return x.sum()

    torch.func.grad(f)(torch.ones(2))
    assert kinds == [(True, False)] and not torch_private.is_gradtrackingtensor(torch.ones(1))


def test_transforms_active_and_the_current_interpreter():
    seen = []

    def f(x):
        seen.append((torch_private.transforms_active(), torch_private.current_interpreter().key()))
        return (x * x).sum()

    assert not torch_private.transforms_active()
    torch.func.grad(f)(torch.ones(2))
    assert seen == [(True, torch_private.TransformType.Grad)]


class _Double(torch.autograd.Function):
    """``2 x``, an autograd Function of the current form (no ``ctx`` in forward)."""

    @staticmethod
    def forward(x):
        return x * 2

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return g * 2


def test_function_base_apply_runs_a_function_without_python_binding():
    fast = torch_private.function_base_apply.__get__(None, _Double)
    x = torch.ones(3, requires_grad=True)
    fast(x).sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))


def test_single_level_function_applies_at_a_grad_level():
    Identity = identity_function(lambda g: g * 3, torch_private.SingleLevelFunction)

    def f(x):
        with torch_private.single_level_functions():
            return Identity.apply(x).sum()

    assert torch.equal(torch.func.grad(f)(torch.ones(2)), torch.full((2,), 3.0))


def test_reference_and_use_counts_see_every_holder():
    x = torch.ones(2)
    refs = torch_private.refcount(x)
    also = x
    assert torch_private.refcount(x) == refs + 1
    del also
    uses, storage_uses, storage_refs = torch_private.use_counts(x)
    view = x.view(2)
    assert (
        torch_private.use_counts(x)[1] == storage_uses + 1
    )  # a view is one more use of the storage
    held = x.untyped_storage()
    assert (
        torch_private.use_counts(x)[2] == storage_refs + 1
    )  # a held storage object: one more reference
    del view, held
    assert isinstance(uses, int)


def test_version_counts_in_place_writes_through_views():
    x = torch.ones(4)
    before = torch_private.version(x)
    x[:2].mul_(2)  # through a view: the counter is the storage's
    after = torch_private.version(x)
    _ = x * 2  # an out-of-place op leaves it
    assert after > before and torch_private.version(x) == after


def test_queue_callback_refuses_outside_a_backward_pass():
    with pytest.raises(RuntimeError):
        torch_private.queue_callback(lambda: None)
    ran = []
    Hook = identity_function(lambda g: torch_private.queue_callback(lambda: ran.append(True)) or g)
    Hook.apply(torch.ones(1, requires_grad=True)).sum().backward()
    assert ran == [True]


def test_graph_task_id_and_below_autograd():
    assert torch_private.current_graph_task_id() == -1
    seen = []
    x = torch.ones(1, requires_grad=True)
    x.register_hook(lambda g: seen.append(torch_private.current_graph_task_id()) or g)
    (x * 2).sum().backward()
    assert seen and seen[0] != -1
    with torch_private.below_autograd():
        assert not (x * 2).requires_grad


def test_disable_torch_function_and_functorch():
    class Seen(torch.overrides.TorchFunctionMode):
        calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            Seen.calls += 1
            return func(*args, **(kwargs or {}))

    with Seen():
        torch.ones(1) + 1
        with torch_private.DisableTorchFunction():
            torch.ones(1) + 1
    assert Seen.calls == 2  # ones and add, outside the disabled block only
    torch_private.vmap_increment_nesting(2, "same")
    try:
        with torch_private.DisableFuncTorch():
            assert torch_private.maybe_get_level(torch.arange(2)) == -1
    finally:
        torch_private.vmap_decrement_nesting()


def test_has_torch_function_tells_whether_a_read_reaches_a_mode_or_an_override():
    """dtype_and_device reads a plain tensor directly where this is False: then no mode and no
    subclass's __torch_function__ sees the read, as under DisableTorchFunction."""
    seen: list = []

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    class Overriding(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            seen.append(func)
            return super().__torch_function__(func, types, args, kwargs or {})

    t = torch.ones(1)
    sub = t.as_subclass(Overriding)
    seen.clear()
    assert not torch_private.has_torch_function(t)
    assert not torch_private.has_torch_function(torch.nn.Parameter(t))  # its override is off
    t.dtype
    assert seen == []
    assert torch_private.has_torch_function(sub)
    sub.dtype
    assert len(seen) == 1  # the read reached the subclass's override
    with Seen():
        assert torch_private.has_torch_function(t)
        t.dtype
        assert len(seen) == 2  # and the mode
        with torch_private.DisableTorchFunction():
            assert not torch_private.has_torch_function(t)
            assert not torch_private.has_torch_function(sub)


def test_unseen_reads_hides_a_walks_reads_from_the_modes_and_only_there():
    """leaves_key, input_versions, check_writes and hands_back read every leaf's metadata
    through unseen_reads: under a mode (torch.set_default_device's DeviceContext, a user's),
    no read reaches its __torch_function__, and the mode sees the ops after it again."""
    seen: list = []

    class Seen(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    t = torch.ones(2)

    def read(x, k):
        return (x.shape, x.dtype, x.requires_grad, x._version, k)

    want = (t.shape, t.dtype, False, t._version, 3)
    assert torch_private.unseen_reads(read, t, 3) == want
    with Seen():
        read(t, 3)
        assert len(seen) == 4  # each read reached the mode
        assert torch_private.unseen_reads(read, t, 3) == want
        assert len(seen) == 4  # none did here
        t + 1
        assert len(seen) == 5  # and the mode is on again
    with torch.device("meta"):  # DeviceContext, as torch.set_default_device pushes it
        assert torch_private.unseen_reads(read, t, 3) == want
        assert torch.ones(1).device.type == "meta"


def test_the_function_mode_stack_names():
    """The checkpoint marker (_calls.CallMarker) is a DeviceContext pushed and removed with
    these: depth, the mode at a depth (0 the bottom), push and pop of the top."""
    assert (
        torch_private.DeviceContext is __import__("torch.utils._device").utils._device.DeviceContext
    )
    base = torch_private.function_mode_depth()
    a, b = torch.overrides.TorchFunctionMode(), torch.overrides.TorchFunctionMode()
    torch_private.push_function_mode(a)
    torch_private.push_function_mode(b)
    try:
        assert torch_private.function_mode_depth() == base + 2
        assert (
            torch_private.function_mode_at(base) is a
            and torch_private.function_mode_at(base + 1) is b
        )
    finally:
        assert torch_private.pop_function_mode() is b
        assert torch_private.pop_function_mode() is a
    assert torch_private.function_mode_depth() == base


def test_remove_function_mode_takes_the_topmost_match_off_and_keeps_the_others_in_order():
    base = torch_private.function_mode_depth()
    a, b, c = (torch.overrides.TorchFunctionMode() for _ in range(3))
    for mode in (a, b, c):
        torch_private.push_function_mode(mode)
    try:
        assert torch_private.remove_function_mode(lambda m: m is a or m is b) is b
        assert torch_private.remove_function_mode(lambda m: m is b) is None
        assert torch_private.function_mode_depth() == base + 2
        assert torch_private.function_mode_at(base) is a
        assert torch_private.function_mode_at(base + 1) is c
    finally:
        while torch_private.function_mode_depth() > base:
            torch_private.pop_function_mode()


def _prints_ok_in_a_fresh_process(code: str) -> None:
    """Run ``code`` in a new interpreter (what it imports is then its own) and expect "ok"."""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_distributed_names_resolve_lazily():
    code = (
        "import sys, torch\n"
        "before = set(sys.modules)\n"
        "from named_spmd import _torch_private as torch_private\n"
        "assert 'torch.distributed.tensor' not in set(sys.modules) - before\n"
        "d = torch_private.dist()\n"
        "assert callable(d.register_work) and callable(d.default_store)\n"
        "assert d.AsyncCollectiveTensor.__name__ == 'AsyncCollectiveTensor'\n"
        "assert d.wait_tensor.name() == '_c10d_functional::wait_tensor'\n"
        "print('ok')\n"
    )
    _prints_ok_in_a_fresh_process(code)


def test_forward_level_reads_the_current_dual_level():
    assert torch_private.forward_level() == -1
    with forward_ad.dual_level():
        assert (
            torch_private.forward_level() >= 0
        )  # read at the call: torch reassigns the module global
    assert torch_private.forward_level() == -1


def test_saved_tensors_hooks_active_inside_a_checkpoint_and_user_hooks():
    seen = []

    def piece(x):
        seen.append(torch_private.saved_tensors_hooks_active())
        return x.sin()

    x = torch.ones(3, requires_grad=True)
    assert not torch_private.saved_tensors_hooks_active()
    torch.utils.checkpoint.checkpoint(piece, x, use_reentrant=False).sum().backward()
    assert seen == [True, True]  # the forward, then the recomputation
    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        assert torch_private.saved_tensors_hooks_active()
    assert not torch_private.saved_tensors_hooks_active()


def test_tensor_base_tells_a_view_from_its_own_buffer():
    x = torch.ones(4)
    assert torch_private.tensor_base(x) is None
    assert torch_private.tensor_base(x[1:]) is x
    assert torch_private.tensor_base(x.view(2, 2).view(4)) is x  # a view of a view: the root buffer
    assert torch_private.tensor_base(x.clone()) is None
    refs = torch_private.refcount(x)
    torch_private.tensor_base(x)
    assert torch_private.refcount(x) == refs  # keeps no reference (donation counts them)


class _Pair(torch.autograd.Function):
    """Two tensors in, views of them out, from one node."""

    @staticmethod
    def forward(a, b):
        return a.view_as(a), b.view_as(b)

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, ga, gb):
        return ga, gb


def test_view_source_finds_a_leaf_or_input_one_built_in_view_away():
    w = torch.randn(3, 5, requires_grad=True)
    assert torch_private.view_source(w.T, {}) is w and torch_private.view_source(w[:2], {}) is w
    b = identity_function(lambda g: g).apply(w)  # an input made by the call's boundary
    assert torch_private.view_source(b.T, {(id(b.grad_fn), b.output_nr): b}) is b
    assert torch_private.view_source(b.T, {}) is None  # not an input, not a leaf
    # inputs made by one node (the boundary's DTensor conversion): each view finds its own
    v = torch.randn(5, 3, requires_grad=True)
    pair = _Pair.apply(w, v)
    sources = {(id(x.grad_fn), x.output_nr): x for x in pair}
    assert [torch_private.view_source(x.T, sources) for x in pair] == list(pair)
    # not one built-in view op directly on the source, or not a view at all
    custom = identity_function(lambda g: g)
    for t in (w.T[0], (w * 2).T, custom.apply(w), w + 0, w.detach().T, w):
        assert torch_private.view_source(t, {}) is None
    assert torch_private.view_source(torch.randn(3, 5).T, {}) is None  # no grad


def test_node_class_is_the_class_of_a_functions_grad_fn():
    y = _Double.apply(torch.ones(2, requires_grad=True))
    assert type(y.grad_fn) is torch_private.node_class(_Double)
    assert type((y * 1).grad_fn) is not torch_private.node_class(_Double)


def test_accumulate_grad_and_add_backward_are_the_classes_of_a_leaf_and_a_sum_nodes():
    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    node = (a + b).grad_fn
    assert type(node) is torch_private.AddBackward
    assert type((a - b).grad_fn) is not torch_private.AddBackward
    leaves = [type(n) for n, _ in node.next_functions]
    assert leaves == [torch_private.AccumulateGrad] * 2
    assert node.next_functions[0][0].variable is a


def test_watched_sees_a_hook_and_retain_grad():
    x = torch.randn(3, requires_grad=True) * 2
    assert not torch_private.watched(x)
    handle = x.register_hook(lambda g: g)
    assert torch_private.watched(x)
    handle.remove()
    assert not torch_private.watched(x)
    x.retain_grad()
    assert torch_private.watched(x)


def test_async_buffer_and_async_wait_of_a_pending_reduction():
    import torch.distributed as dist

    d = torch_private.dist()
    group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1)
    buf = torch.ones(3)
    work = group.allreduce([buf])
    d.register_work(buf, work)  # what _dist_overlap does with its overlapped reductions
    pending = d.AsyncCollectiveTensor(buf)
    assert torch_private.async_buffer(pending) is buf
    out = torch_private.async_wait(pending)
    assert type(out) is torch.Tensor and out is buf and work.is_completed()
    assert torch_private.async_wait(pending) is buf  # waited once: returns the buffer again
    assert torch.equal(out, torch.ones(3))


def test_a_pending_gradient_detaches_without_waiting_and_waits_on_other_ops():
    """``PendingGradient``'s fast ``detach`` (AccumulateGrad's) against torch's own class: the
    same result type and buffer, no wait; any other op still waits for the reduction."""
    import torch.distributed as dist

    d = torch_private.dist()

    class Slow(dist.Work):  # completes only when waited for
        def __init__(self, buf):
            super().__init__()
            self.buf, self.done = buf, False

        def wait(self, timeout=None):
            self.done = True
            self.buf.mul_(2)  # the "reduction": visible only after the wait
            return True

        def is_completed(self):
            return self.done

    buf = torch.ones(3)
    work = Slow(buf)
    d.register_work(buf, work)
    pending = d.PendingGradient(buf)
    assert isinstance(pending, d.AsyncCollectiveTensor)
    torch_detached = d.AsyncCollectiveTensor(buf).detach()
    detached = pending.detach()
    assert type(detached) is d.PendingGradient and not work.done
    ptrs = {torch_private.async_buffer(t).data_ptr() for t in (detached, torch_detached)}
    assert ptrs == {buf.data_ptr()}
    assert torch.equal(detached + 0, torch.full((3,), 2.0)) and work.done  # a read waits


def test_accumulating_a_pending_gradient_into_a_grad_offers_the_add_to_the_backend(
    monkeypatch,
):
    """``AccumulateGrad`` adds a new gradient into an existing ``.grad`` with
    ``aten.add_.Tensor(grad, new)``: with a pending one, ``PendingGradient`` offers that add to
    the backend's ``defer_accumulation`` (which postpones it to the end of the backward pass),
    and leaves ``.grad`` as it is when taken. ``has_post_accumulate_hooks`` sees torch's hooks."""
    d = torch_private.dist()
    offered = []

    def take(target, pending):
        offered.append((target, pending))
        return True

    monkeypatch.setattr(d.PendingGradient, "defer_accumulation", take)
    buf = torch.full((3,), 5.0)
    Feed = identity_function(lambda g: d.PendingGradient(buf))
    leaf = torch.zeros(3, requires_grad=True)
    leaf.grad = grad = torch.ones(3)
    Feed.apply(leaf).sum().backward()
    assert len(offered) == 1 and offered[0][0] is grad and leaf.grad is grad
    assert torch_private.async_buffer(offered[0][1]).data_ptr() == buf.data_ptr()
    assert torch.equal(grad, torch.ones(3))  # taken: not added now
    assert not torch_private.has_post_accumulate_hooks(leaf)
    leaf.register_post_accumulate_grad_hook(lambda p: None)
    assert torch_private.has_post_accumulate_hooks(leaf)


def test_not_traced_breaks_the_graph_names_its_reason_and_runs_without_dynamo():
    """``not_traced`` (torch's disable mark on a function of ours, and ``torch._disable_dynamo``'s
    lazy wrapper): made without importing Dynamo; a compiled program breaks its graph there, with
    the reason under ``fullgraph=True``; the function runs with Dynamo off."""
    code = (
        "import sys, torch\n"
        "from named_spmd import _torch_private as torch_private\n"
        "torch_private.not_traced(lambda x: x, 'r')\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "print('ok')\n"
    )
    _prints_ok_in_a_fresh_process(code)

    from torch._dynamo.testing import CompileCounter

    seen = []

    def eager_only(x):
        seen.append(torch.compiler.is_compiling())
        return x.sin()

    call = torch_private.not_traced(eager_only, "REASON and the fix")

    def step(x):
        return call(x * 2) + 1

    x = torch.arange(3.0)
    with pytest.raises(Exception, match="REASON and the fix"):
        torch.compile(step, backend="eager", fullgraph=True)(x)
    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter)
    for _ in range(2):
        assert torch.equal(compiled(x), step(x))
    assert seen and not any(seen)  # ran eagerly, never traced
    assert counter.frame_count == 2 and counter.op_count == 2  # x * 2 and + 1, compiled


def test_dtensor_spec_and_constructor_match_from_local():
    code = (
        "import torch, torch.distributed as dist\n"
        "from torch.distributed.tensor import DTensor, Replicate, Shard\n"
        "from torch.testing._internal.distributed.fake_pg import FakeStore\n"
        "from named_spmd import _torch_private as torch_private\n"
        "dist.init_process_group('fake', store=FakeStore(), rank=0, world_size=4)\n"
        "mesh = dist.device_mesh.init_device_mesh('cpu', (2, 2), mesh_dim_names=('a', 'b'))\n"
        "local = torch.arange(6.0).reshape(2, 3)\n"
        "places = (Shard(1), Replicate())\n"
        "spec = torch_private.dtensor_spec(mesh, local, places)\n"
        "ref = DTensor.from_local(local, mesh, places, run_check=False)\n"
        "assert spec == ref._spec and spec.shape == (2, 6), spec\n"
        "d = torch_private.dist().new_dtensor(local, spec, requires_grad=True)\n"
        "assert type(d) is DTensor and d.requires_grad and d.is_leaf and d.shape == (2, 6)\n"
        "assert torch_private.local_tensor(d) is local and tuple(d.placements) == places\n"
        # the eager constructor skips DTensor.__init__: __new__ must be the whole construction
        "assert DTensor.__new__ is torch.Tensor._dtensor__new__ and d._spec is spec\n"
        "full = DTensor(local, spec, requires_grad=True)\n"
        "assert (full.shape, full.stride(), full.dtype, full._spec) == (d.shape, d.stride(), d.dtype, spec)\n"
        "dist.destroy_process_group()\n"
        "print('ok')\n"
    )
    _prints_ok_in_a_fresh_process(code)


_SEEN_MODE = """
import torch
from torch.overrides import TorchFunctionMode
from named_spmd import _torch_private as torch_private

class Seen(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.names = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.names.append(getattr(func, "__name__", ""))
        return func(*args, **(kwargs or {}))

def compiled_seen(f, *args):
    mode = Seen()
    def moded(*a):
        with mode:
            return f(*a)
    torch._dynamo.reset()
    return torch.compile(moded, backend="eager", fullgraph=True)(*args), mode.names
"""


def _before_and_after_routing(code: str) -> dict[str, str]:
    """What ``code`` (after :data:`_SEEN_MODE`, in a fresh process: a routing is process-wide)
    prints as ``before ...`` and ``after ...`` lines."""
    out = subprocess.run(
        [sys.executable, "-c", _SEEN_MODE + code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def test_dynamo_hands_view_attributes_to_the_modes_once_routed():
    """Dynamo traces ``x.T`` & co. into the graph without asking the torch function modes
    (eager asks them); ``route_view_attributes_to_modes`` makes it ask. Fails both when torch
    starts asking by itself (the routing can then go) and when the routing stops taking
    effect."""
    lines = _before_and_after_routing("""
def run():
    out, names = compiled_seen(lambda x: x.T + x.mT.real, torch.ones(2, 3))
    assert torch.equal(out, 2 * torch.ones(3, 2))
    return sorted(set(names) & {"T", "mT", "real", "__get__"})

print("before", run())
assert torch_private.route_view_attributes_to_modes()
print("after", run())
""")
    assert lines["before"] == "[]", lines  # torch hides them: the routing is still needed
    assert lines["after"] != "[]", lines


def test_dynamo_hands_torch_index_put__to_the_modes_once_routed():
    """Dynamo traces ``torch.index_put_`` into the graph without asking the torch function
    modes (eager asks them: torch's list of overridable functions lacks it, which Dynamo reads);
    ``route_functions_to_modes`` makes it ask. Fails when torch starts asking by itself (the
    routing can then go) or when the routing stops taking effect."""
    lines = _before_and_after_routing("""
def put(x):
    y = x * 1
    torch.index_put_(y, (x > 1,), torch.tensor(0.0))
    return y

def run():
    out, names = compiled_seen(put, torch.arange(4.0))
    assert torch.equal(out, torch.tensor([0.0, 1.0, 0.0, 0.0]))
    return "index_put_" in names

print("before", run())
assert torch_private.route_functions_to_modes()
print("after", run())
""")
    assert lines == {"before": "False", "after": "True"}, lines


def test_traced_user_stack_names_the_line_dynamo_traces():
    """Inside an ``assume_constant_result`` function run while Dynamo traces,
    ``traced_user_stack`` ends at the user's line being traced (the real stack holds Dynamo's
    frames only); outside a trace it is empty."""
    from named_spmd import _torch_private as torch_private

    seen: list[str] = []

    @torch.compiler.assume_constant_result
    def where() -> str:
        frame = torch_private.traced_user_stack()[-1]
        seen.append(f"{frame.name}:{frame.line}")
        return seen[-1]

    def traced(x):
        return x + len(where())  # the line quoted

    torch._dynamo.reset()
    torch.compile(traced, backend="eager", fullgraph=True)(torch.ones(2))
    assert seen == ["traced:return x + len(where())  # the line quoted"], seen
    assert torch_private.traced_user_stack() == []


def test_traced_in_subgraph_tells_a_higher_order_ops_body_from_the_root_graph():
    """``traced_in_subgraph`` (Dynamo's current instruction translator, and whether its output
    graph's tracer is the root one): False outside any trace and in the root graph, True while
    Dynamo traces a checkpointed body into the subgraph of its higher-order op."""
    assert torch_private.traced_in_subgraph() is False
    seen = []

    @torch.compiler.assume_constant_result
    def where(name: str) -> bool:
        seen.append((name, torch_private.traced_in_subgraph()))
        return True

    def body(x):
        where("body")
        return torch.tanh(x)

    def f(x):
        where("root")
        return torch.utils.checkpoint.checkpoint(body, x, use_reentrant=False).sum()

    torch._dynamo.reset()
    x = torch.randn(3, requires_grad=True)
    torch.compile(f, backend="eager", fullgraph=True)(x)
    assert seen == [("root", False), ("body", True)]


def test_dynamo_frame_callback_is_set_only_in_the_eager_rest_of_a_compiled_function():
    """``dynamo_frame_callback`` (Dynamo's C frame callback): None in plain eager code and in a
    function Dynamo does not trace; set in a frame Dynamo gave up on and runs eagerly, whose
    callees Dynamo would compile frame by frame. Called as a C function: no frame of its own."""
    assert torch_private.dynamo_frame_callback() is None
    seen = []

    def gives_up(x):
        seen.append(
            torch_private.dynamo_frame_callback() is not None
        )  # a builtin Dynamo cannot trace
        return x + 1

    @torch.compiler.disable
    def off(x):
        seen.append(torch_private.dynamo_frame_callback() is not None)
        return x * 2

    torch._dynamo.reset()
    with warnings.catch_warnings():  # Dynamo's note that it cannot trace the builtin
        warnings.simplefilter("ignore")
        torch.compile(lambda x: off(gives_up(x.sin())), backend="eager")(torch.ones(2))
    assert seen == [True, False]
    assert torch_private.dynamo_frame_callback() is None


def test_sdpa_math_equals_sdpa_and_batches_under_vmap():
    """``sdpa_math``: the value of ``scaled_dot_product_attention`` (causal, with a mask and a
    scale), and under vmap it batches, where sdpa on CPU runs its flash kernel once per instance
    (the reason the simulated compile path uses it)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(3, 2, 2, 5, 4, generator=g, dtype=torch.float64) for _ in range(3))
    mask = torch.randn(5, 5, generator=g, dtype=torch.float64)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    for kw in ({"is_causal": True}, {"attn_mask": mask, "scale": 0.3}):
        want = sdpa(q, k, v, **kw)
        got = torch_private.sdpa_math(
            q, k, v, kw.get("attn_mask"), 0.0, kw.get("is_causal", False), scale=kw.get("scale")
        )[0]
        assert torch.allclose(got, want, atol=1e-12)

    def flash_calls(f) -> int:
        with torch.profiler.profile() as prof:
            torch.func.vmap(f)(q, k, v)
        return sum(e.count for e in prof.key_averages() if "flash_attention" in e.key)

    # sdpa's flash kernel once per instance under vmap (torch's fallback loop), the math one never
    assert flash_calls(lambda a, b, c: sdpa(a.float(), b.float(), c.float(), is_causal=True)) >= 3
    assert flash_calls(lambda a, b, c: torch_private.sdpa_math(a, b, c, None, 0.0, True)[0]) == 0


def test_inductor_runs_an_inductor_graph_pass_on_the_post_grad_graph():
    """``inductor_graph_pass``: Inductor calls it (option ``post_grad_custom_pre_pass``) with
    the post-grad FX graph of each compiled graph, aten ops in it (what ``ns.compile``'s pass
    that makes the gradients' waits adjacent reads), and the pass has the uuid Inductor's
    cache keys on."""
    seen = []

    def record(graph):
        seen.append([n.target for n in graph.nodes if n.op == "call_function"])

    version = f"test.record.{uuid.uuid4()}"  # a new cache key: a cached graph runs no pass
    graph_pass = torch_private.inductor_graph_pass(record, version)
    assert graph_pass.uuid() == version
    torch._dynamo.reset()
    f = torch.compile(
        lambda x: torch.tanh(x) * 2, options={"post_grad_custom_pre_pass": graph_pass}
    )
    x = torch.randn(4)
    assert torch.allclose(f(x), torch.tanh(x) * 2)
    assert seen and torch.ops.aten.tanh.default in seen[0]


def test_dispatch_modes_active_sees_a_dispatch_mode():
    """``dispatch_modes_active``: torch's dispatch mode stack is non-empty exactly inside a
    dispatch mode (``torch._C._len_torch_dispatch_stack``)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passing(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    assert not torch_private.dispatch_modes_active()
    with Passing():
        assert torch_private.dispatch_modes_active()
    assert not torch_private.dispatch_modes_active()


def test_a_generated_nodes_saved_tensors_are_its_raw_saved_twins_and_tell_a_write():
    """The write check's names: a generated node's ``_saved_<name>`` with a
    ``_raw_saved_<name>`` twin (its saved tensors, not its ints), and autograd's error on
    unpacking one written since is one ``_STALE`` matches; ``stale_saved`` returns it."""
    from named_spmd._torch_private import autograd

    a, b = (torch.ones(3, requires_grad=True) * 1 for _ in range(2))
    y = a * b
    assert set(autograd._saved_tensor_names(type(y.grad_fn))) == {"_saved_self", "_saved_other"}
    z = a.sum(0, keepdim=True)  # saves only sizes and ints: nothing a write makes stale
    assert autograd._saved_tensor_names(type(z.grad_fn)) == ()
    assert autograd.stale_saved([y, z], []) is None
    with torch.no_grad():
        b.add_(1)
    with pytest.raises(RuntimeError) as raised:
        y.grad_fn._saved_other
    assert autograd.is_stale(raised.value)
    assert autograd.is_stale(autograd.stale_saved([y], []))


def test_a_custom_functions_view_written_through_its_base_is_stale():
    """A custom Function's view output whose base is written: autograd's error is the second
    form ``_STALE`` matches (an identity such as CommMode's tag returns such a view)."""
    from named_spmd._torch_private import autograd

    x = torch.ones(3, requires_grad=True) * 1
    y = identity_function(lambda g: g).apply(x)
    x.add_(1)
    with pytest.raises(RuntimeError) as raised:
        y * 2
    assert autograd.is_stale(raised.value)
    assert not autograd.is_stale(RuntimeError("an unrelated error"))


def test_saved_tensor_names_keeps_no_custom_function_alive():
    """A custom Function defined in a call's body: its node class's names are answered
    without a cache that would keep the class (and what it holds) alive."""
    import gc
    import weakref

    from named_spmd._torch_private import autograd

    def made() -> weakref.ref:
        class Twice(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                ctx.save_for_backward(x)
                return x * 2

            @staticmethod
            def backward(ctx, g):
                return g * 2

        y = Twice.apply(torch.ones(2, requires_grad=True))
        assert autograd._saved_tensor_names(type(y.grad_fn)) == ("saved_tensors",)
        return weakref.ref(Twice)

    ref = made()
    gc.collect()
    assert ref() is None


def test_torchs_directory_holds_its_files_and_no_users():
    """``TORCH_DIR`` (the one definition, which ``_errors.TORCH_DIRS`` extends) and
    ``torch_file``: a frame of torch's wrappers is torch's, this test's is not."""
    import inspect

    from named_spmd import _errors

    module_call = inspect.getsourcefile(torch.nn.Module)
    assert module_call is not None and torch_private.torch_file(module_call)
    assert not torch_private.torch_file(__file__)
    assert _errors.TORCH_DIRS[0] == torch_private.TORCH_DIR
    assert not __file__.startswith(_errors.TORCH_DIRS)


def test_trace_constant_is_assume_constant_results_mark_made_without_dynamo():
    """``trace_constant`` marks a function as ``torch.compiler.assume_constant_result`` does
    (the same attributes), without importing Dynamo; traced, the function runs eagerly at trace
    time (reading real state: not guarded), its result a constant of the graph."""
    code = (
        "import sys, torch\n"
        "from named_spmd import _torch_private as torch_private\n"
        "torch_private.trace_constant(lambda: 1)\n"
        "assert 'torch._dynamo' not in sys.modules\n"
        "print('ok')\n"
    )
    _prints_ok_in_a_fresh_process(code)

    def ours(n):
        return n

    def public(n):
        return n

    torch_private.trace_constant(ours)
    torch.compiler.assume_constant_result(public)
    assert vars(ours) == vars(public) and vars(ours)

    from torch._dynamo.testing import CompileCounter

    memo = {}

    @torch_private.trace_constant
    def looked_up(n):
        memo.setdefault(n, len(memo))  # a memo that grows: a traced read would be guarded
        return n + 1

    def step(x):
        return x * looked_up(2)

    counter = CompileCounter()
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    x = torch.arange(3.0)
    assert torch.equal(compiled(x), x * 3)
    memo[7] = 0  # grows between steps
    assert torch.equal(compiled(x), x * 3)
    assert counter.frame_count == 1 and counter.op_count == 1


@torch._dynamo.config.patch(capture_dynamic_output_shape_ops=True)
def test_has_data_dependent_size_tells_an_unbacked_size_while_dynamo_traces():
    """Dynamo answers ``has_data_dependent_size`` with a constant: True for a tensor sized by its
    data (``x[x > 0]``), False for one of a static shape and for a real tensor."""
    seen = []

    def f(x):
        seen.append((torch_private.has_data_dependent_size(x[x > 0]),))
        seen.append((torch_private.has_data_dependent_size(x * 2),))
        return x + 1

    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True)(torch.arange(6.0) - 2)
    assert seen == [(True,), (False,)]
    assert not torch_private.has_data_dependent_size(torch.arange(6.0))


def test_a_neg_view_batches_under_vmap_once_its_rule_is_installed():
    """``batch_neg_views``: ``x.conj().imag`` (aten::_neg_view, which torch's vmap has no rule
    for) under vmap gives each row's negative view, written through to its base."""
    torch_private.batch_neg_views()
    c = torch.complex(torch.arange(6.0), torch.arange(6.0) - 3).reshape(3, 2)
    want = c.clone()
    for row in want:
        row.conj().imag.add_(1)

    def write_through(t):
        imag = t.conj().imag
        assert imag.is_neg()
        imag.add_(1)
        return imag * 2

    got = torch.func.vmap(write_through)(c)
    assert torch.equal(c, want) and torch.equal(got, want.conj().imag * 2)


def test_deepcopy_of_a_leaf_that_requires_grad_inside_a_transform_is_a_new_leaf():
    """``copy_wrapped_deeply``: under a transform, a deep copy of a plain leaf that requires
    grad is a new leaf that requires grad, as outside (where torch's own ``requires_grad_``
    check refuses it); of its ``leaf_stand_in``, the same."""
    torch_private.copy_wrapped_deeply()
    w = torch.arange(3.0, requires_grad=True)
    stand_in = torch_private.leaf_stand_in(w)
    copies = []

    def copy_both(x):
        copies.extend([copy.deepcopy(w), copy.deepcopy(stand_in)])
        return x

    torch.func.vmap(copy_both)(torch.ones(2))
    for c in copies:
        assert c.is_leaf and c.requires_grad and torch.equal(c, w) and c is not w


def test_export_clones_allowed_lets_a_strict_export_meet_a_parameter_inside_vmap():
    """Strict ``torch.export`` clones each tensor Dynamo meets first and sets the clone's
    ``requires_grad`` in place, which functorch refuses inside ``vmap``: a parameter read only
    inside a vmapped function fails the export, unless under ``export_clones_allowed`` (which
    eagerly leaves functorch's refusal as it is)."""

    class Module(torch.nn.Module):
        def __init__(self, allowed: bool) -> None:
            super().__init__()
            self.w, self.allowed = torch.nn.Parameter(torch.arange(3.0)), allowed

        def forward(self, x):
            allowed = torch_private.export_clones_allowed
            with allowed() if self.allowed else contextlib.nullcontext():
                return torch.func.vmap(lambda row: row * self.w)(x)

    x = torch.arange(6.0).reshape(2, 3)
    with pytest.raises(RuntimeError, match="requires_grad_"):
        torch.export.export(Module(False), (x,), strict=True)
    module = Module(True)
    torch.testing.assert_close(
        torch.export.export(module, (x,), strict=True).module()(x), x * module.w
    )
    with torch_private.export_clones_allowed():
        assert not torch._C._functorch.get_inplace_requires_grad_allowed()


def test_traced_size_sources_names_the_input_sizes_a_traced_size_is_computed_from():
    """While Dynamo traces, ``traced_size_sources`` names per dim the input sizes a tensor's
    size is computed from: a marked size's own source and that of ``x + 1`` and of ``cat``'s
    (two inputs' sizes); none for a static size."""
    seen = []

    def f(x, y):
        z = torch.cat([x, y])
        seen.append(tuple(torch_private.traced_size_sources(t) for t in (x, x + 1, z)))
        return z

    x, y = torch.ones(4, 3), torch.ones(5, 3)
    torch._dynamo.mark_dynamic(x, 0)
    torch._dynamo.mark_dynamic(y, 0)
    torch._dynamo.reset()
    torch.compile(f, backend="eager", fullgraph=True)(x, y)
    xs, ys = "L['x'].size()[0]", "L['y'].size()[0]"
    ((own, plus_one, cat),) = seen
    assert own == plus_one == ((xs,), ())
    assert sorted(cat[0]) == [xs, ys] and cat[1] == ()


def test_aten_op_sized_by_values_reads_torchs_dynamic_output_shape_tag():
    """``aten_op_sized_by_values``: the qualified name of an aten op (packet or overload) torch
    tags ``dynamic_output_shape``; None for an op of a static size and for a torch function."""
    sized = torch_private.aten_op_sized_by_values
    assert sized(torch.ops.aten.nonzero) == sized(torch.ops.aten.nonzero.default) == "aten::nonzero"
    assert sized(torch.ops.aten.masked_select.default) == "aten::masked_select"
    assert sized(torch.ops.aten.index) == sized(torch.ops.aten.index.Tensor) == "aten::index"
    assert sized(torch.ops.aten._unique2) == "aten::_unique2"
    for static in (torch.ops.aten.add, torch.ops.aten.nonzero_static, torch.ops.aten.index_put):
        assert sized(static) is None
    assert sized(torch.nonzero) is None and sized(torch.Tensor.nonzero) is None


def test_batched_above_sees_a_vmap_level_above_eagerly_and_while_dynamo_traces():
    """``batched_above(t, level)``: whether a vmap level above ``level`` batches ``t`` (levels
    count from 1, the outermost transform), through a grad level's wrapper; the same answers
    while Dynamo traces the vmaps (read off the fake value at trace time: constants)."""
    seen = []

    def probe(inner, outer):
        above = torch_private.batched_above
        seen.append((above(inner, 1), above(outer, 1), above(outer, 0), above(inner, 2)))
        return inner * 2

    def program(x, y):
        return torch.func.vmap(lambda v: torch.func.vmap(lambda w: probe(w, v))(y + v))(x)

    x, y = torch.ones(2, 3), torch.ones(4, 3)
    want = program(x, y)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(program, backend="eager", fullgraph=True)(x, y), want)
    assert seen == [(True, False, True, False)] * 2
    assert not torch_private.batched_above(x, 0)
    wrapped = []

    def summed(w):  # a grad level (2) wraps the vmap's batched value (level 1)
        wrapped.append((torch_private.batched_above(w, 0), torch_private.batched_above(w, 1)))
        return w.sum()

    torch.func.vmap(torch.func.grad(summed))(y)
    assert wrapped == [(True, False)]


def test_batched_above_under_export_and_make_fx_reads_the_wrappers_they_run_on():
    """Non-strict ``torch.export`` and ``make_fx`` run the Python code on their own tensors
    (``torch.compiler.is_compiling()`` reads True, no Dynamo frame): ``batched_above`` reads
    those tensors' wrappers, before and after a Dynamo trace that answered otherwise."""

    def scaled(x):  # a batched value doubled, an unbatched one tripled
        return x * (2 if torch_private.batched_above(x, 0) else 3)

    def program(x):
        return torch.func.vmap(scaled)(x) + scaled(x)

    class Program(torch.nn.Module):
        def forward(self, x):
            return program(x)

    x = torch.ones(2, 3)
    want = torch.full((2, 3), 5.0)
    torch.testing.assert_close(program(x), want)
    for _ in range(2):  # (a Dynamo trace between: its answers are its own)
        exported = torch.export.export(Program(), (x,), strict=False)
        torch.testing.assert_close(exported.module()(x), want)
        torch.testing.assert_close(make_fx(program)(x)(x), want)
        torch._dynamo.reset()
        torch.testing.assert_close(torch.compile(program, backend="eager", fullgraph=True)(x), want)


def test_copy_of_a_vmap_tensor_is_its_detached_view_and_of_others_torchs_copy():
    """``copy_wrapped_shallowly``: under vmap, ``copy.copy`` of a batched tensor is a new tensor
    of its values and storage (a write through it reaches the original), with no gradient
    through it; outside, torch's own shallow copy (storage shared, a leaf keeping
    ``requires_grad``, a Parameter's class)."""
    torch_private.copy_wrapped_shallowly()
    x = torch.arange(6.0).reshape(2, 3)

    def written_through_a_copy(v):
        c = copy.copy(v)
        assert c is not v
        c.mul_(10)
        return v + 1 + c * 0

    assert torch.equal(
        torch.func.vmap(written_through_a_copy)(x), torch.arange(6.0).reshape(2, 3) * 10 + 1
    )
    y = torch.ones(3, requires_grad=True) * 2
    c = copy.copy(y)
    assert c.is_leaf and c.requires_grad and c.data_ptr() == y.data_ptr()
    p = torch.nn.Parameter(torch.ones(2))
    assert type(copy.copy(p)) is torch.nn.Parameter and copy.copy(p).data_ptr() == p.data_ptr()


def test_deepcopy_of_a_parameter_under_vmap_is_a_parameter_of_its_values():
    """``copy_wrapped_deeply``: under vmap, a deep copy of a Parameter of a batched value (torch's
    reads ``.data``, which vmap refuses) is a Parameter of a copy of its values; outside,
    torch's own (a new Parameter, its values copied)."""
    torch_private.copy_wrapped_deeply()
    x = torch.arange(6.0).reshape(2, 3)

    def copied(v):
        p = torch.nn.Parameter(v * 2)
        q = copy.deepcopy(p)
        assert type(q) is torch.nn.Parameter and q is not p
        with torch.no_grad():
            q.add_(1)
        return q + p * 10

    assert torch.equal(torch.func.vmap(copied)(x), x * 22 + 1)
    p = torch.nn.Parameter(torch.ones(2))
    q = copy.deepcopy(p)
    assert type(q) is torch.nn.Parameter and q.requires_grad and q.data_ptr() != p.data_ptr()


def _parameter_under_vmap(seen):
    def made(v):
        p = torch.nn.Parameter(v * 2)
        inner = torch_private.innermost(p)
        seen.append((type(p), p.requires_grad, inner.is_leaf, inner.requires_grad))
        return p * v

    return made


def test_a_parameter_under_vmap_is_torchs_unless_the_hook_names_its_leaf(monkeypatch):
    """``parameters_made_wrapped``: torch's Parameter of a batched value is a wrapper that reads
    ``requires_grad`` over a detached leaf autograd does not track (nothing made from it
    requires grad): the simulated backend's hook, which names no leaf outside its calls, leaves
    it so. A hook naming the wrapped value makes that leaf require grad: the gradient reaches it."""
    from named_spmd._torch_private import functorch

    x, seen = torch.arange(6.0).reshape(2, 3), []
    assert not torch.func.vmap(_parameter_under_vmap(seen))(x).requires_grad
    assert seen == [(torch.nn.Parameter, True, True, False)]
    monkeypatch.setattr(
        torch.nn.Parameter, "__new__", staticmethod(functorch._PARAMETER_NEW["torch"])
    )
    monkeypatch.delitem(functorch._PARAMETER_NEW, "torch")
    torch_private.parameters_made_wrapped(torch_private.innermost)
    seen.clear()
    out = torch.func.vmap(_parameter_under_vmap(seen))(x)
    assert seen == [(torch.nn.Parameter, True, True, True)] and out.requires_grad
    (leaf,) = [
        n.variable
        for n, _ in out.grad_fn.next_functions
        if n is not None and hasattr(n, "variable")
    ]
    torch.testing.assert_close(torch.autograd.grad(out.sum(), leaf)[0], x)
    assert torch.nn.Parameter(torch.ones(2)).requires_grad  # (no transform: torch's)


def test_graph_traced_is_true_where_make_fx_or_an_export_records_the_call():
    """``graph_traced``: false eagerly and under a transform; true under ``make_fx`` (its proxy
    mode on the dispatch stack) and under ``torch.export``, strict (Dynamo) and non-strict
    (make_fx pre-dispatch, whose mode the dispatch stack does not hold). Read by the traced
    function itself: its graph doubles where it was true, triples where not."""
    from torch.fx.experimental.proxy_tensor import make_fx

    def f(x):
        return x * (2.0 if torch_private.graph_traced() else 3.0)

    class Module(torch.nn.Module):
        def forward(self, x):
            return f(x)

    x = torch.ones(2)
    assert torch.equal(f(x), x * 3)
    assert torch.equal(torch.func.grad(lambda v: f(v).sum())(x), x * 3)
    assert torch.equal(make_fx(f)(x)(x), x * 2)
    for strict in (False, True):
        assert torch.equal(torch.export.export(Module(), (x,), strict=strict).module()(x), x * 2)


def test_unobserved_runs_with_no_tracer_and_no_mode_and_restores_them():
    """``unobserved(run)``: no trace function, no torch function or dispatch mode while ``run``
    runs (reference counts calibrated there are a bare interpreter's); all back after it."""
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    class Dispatched(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    def trace(frame, event, arg):
        return None

    def inside():
        return (
            sys.gettrace(),
            torch._C._len_torch_function_stack(),
            torch._C._len_torch_dispatch_stack(),
        )

    old = sys.gettrace()
    sys.settrace(trace)
    try:
        with Seen(), Dispatched():
            assert torch_private.unobserved(inside) == (None, 0, 0)
            assert inside() == (trace, 1, 1)
    finally:
        sys.settrace(old)


_STACK: list = []


class _PassMode(torch.overrides.TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


@torch_private.trace_constant
def _state_now():
    return torch_private.traced_state_of(_STACK)


@torch_private.trace_constant
def _forget(before):
    torch_private.forget_restored_state(_STACK, before)


@pytest.mark.parametrize("bracketed", [False, True])
@pytest.mark.parametrize("changed_before", [False, True])
def test_forget_restored_state_hides_from_export_only_what_was_pushed_and_popped_again(
    bracketed, changed_before
):
    """Strict ``torch.export`` warns of a global list appended to and popped and of a
    torch-function mode entered and left, restored as they are: Dynamo tracks any change as a
    side effect. Bracketed by ``traced_state_of`` and ``forget_restored_state`` they are marked
    unchanged, and nothing is warned of; a change made before the bracket (the caller's, which
    Dynamo must replay) still is. Outside a trace both do nothing."""
    assert torch_private.traced_state_of(_STACK) == ()
    torch_private.forget_restored_state(_STACK, ())

    class Module(torch.nn.Module):
        def forward(self, x):
            if changed_before:
                _STACK.append(1)
                _STACK.pop()
            before = _state_now() if bracketed else None
            _STACK.append(x)
            with _PassMode():
                y = x * 2
            _STACK.pop()
            if bracketed:
                _forget(before)
            return y

    x = torch.arange(3.0)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module = torch.export.export(Module(), (x,), strict=True).module()
    side_effects = [w for w in caught if "side effects happened" in str(w.message)]
    assert torch.equal(module(x + 1), (x + 1) * 2) and _STACK == []
    assert len(side_effects) == (0 if bracketed and not changed_before else 1), side_effects
    if side_effects:
        message = str(side_effects[0].message)
        assert "_STACK" in message and ("<unknown source>" in message) == (not bracketed)
