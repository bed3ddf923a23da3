"""torch.distributed, resolved on first use (``import named_spmd`` does not import it): the store,
the functional collectives, AsyncCollectiveTensor and DTensor's internals."""

from __future__ import annotations

import functools
import operator
from types import SimpleNamespace
from typing import Any

import torch

# --- torch.distributed (resolved on first use) ---------------------------------------------------


@functools.cache
def dist() -> SimpleNamespace:
    """The private torch.distributed names of the real backend."""
    import torch.distributed as td
    from torch.distributed._functional_collectives import AsyncCollectiveTensor
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta
    from torch.distributed.tensor._utils import compute_global_tensor_info

    return SimpleNamespace(
        # torch's registry of in-flight works: wait_tensor finds the work of a buffer there
        register_work=torch._C._distributed_c10d._register_work,
        wait_tensor=torch.ops._c10d_functional.wait_tensor.default,
        AsyncCollectiveTensor=AsyncCollectiveTensor,
        PendingGradient=_pending_gradient_class(AsyncCollectiveTensor),
        # DTensor's constructor DTensor(local, spec, requires_grad=): from_local without its
        # checks and the spec it rebuilds on every call (specs come from dtensor_spec, cached)
        new_dtensor=functools.partial(_new_dtensor, DTensor),
        DTensorSpec=DTensorSpec,
        TensorMeta=TensorMeta,
        compute_global_tensor_info=compute_global_tensor_info,
        default_store=td.distributed_c10d._get_default_store,
    )


def _new_dtensor(cls: type, local: torch.Tensor, spec: Any, requires_grad: bool = False) -> Any:
    """``DTensor(local, spec, requires_grad=)``. ``DTensor.__new__`` is the C constructor
    ``Tensor._dtensor__new__`` (it sets the spec and the local tensor); ``DTensor.__init__`` only
    marks the construction for ``torch.export``, behind two decorators that cost most of the
    construction (about 20 of 25 us). Eager calls skip it; traced ones keep the whole constructor."""
    if torch.compiler.is_compiling():
        return cls(local, spec, requires_grad=requires_grad)
    return torch.Tensor._dtensor__new__(cls, local, spec, requires_grad=requires_grad)


def _pending_gradient_class(act: type) -> type:
    """``AsyncCollectiveTensor`` with a fast path for ``detach``, which ``AccumulateGrad``
    applies once to every gradient it stores: torch's class walks the arguments with pytree
    maps for every op but ``view`` (about a third of a data-parallel GPT backward, measured).
    ``AccumulateGrad``'s ``grad += pending`` into a ``.grad`` that exists (gradient accumulation)
    may be postponed to the end of the backward pass instead of waiting for the sum now: the
    backend's ``defer_accumulation(target, pending)`` says whether it took it. A view of one
    (torch's class rewraps it) is made one again by the backend's ``view_of(pending, view)``."""
    detach = torch.ops.aten.detach.default
    add_ = torch.ops.aten.add_.Tensor

    class PendingGradient(act):
        defer_accumulation: Any = None  # set by the backend
        view_of: Any = None  # set by the backend

        @classmethod
        def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
            if func is detach and not kwargs:
                return cls(func(args[0].elem))  # a view: nothing to wait for, as torch's
            if (
                func is add_
                and not kwargs
                and type(args[0]) is torch.Tensor
                and type(args[1]) is cls
                and cls.defer_accumulation is not None
                and cls.defer_accumulation(args[0], args[1])
            ):
                return args[0]
            out = super().__torch_dispatch__(func, types, args, kwargs)
            if type(out) is act and type(args[0]) is cls and cls.view_of is not None:
                return cls.view_of(args[0], out)  # (only a view op's result is still pending)
            return out

        # pickle and deepcopy as the summed plain tensor: pickle cannot name a class made in a
        # function, and a copy need not wait for the work again
        def __reduce_ex__(self, protocol):
            return self.trigger_wait().__reduce_ex__(protocol)

        def __deepcopy__(self, memo):
            return self.trigger_wait().clone()

    return PendingGradient


def local_tensor(d: Any) -> torch.Tensor:
    """A DTensor's local tensor without the autograd-recording ``to_local``."""
    return d._local_tensor


def dtensor_spec(device_mesh: Any, local: torch.Tensor, placements: tuple) -> Any:
    """The ``DTensorSpec`` of the DTensor whose local tensor on this rank is ``local``: what
    ``DTensor.from_local`` builds on every call (the caller caches it per layout)."""
    d = dist()
    shape, stride = d.compute_global_tensor_info(local, device_mesh, list(placements))
    meta = d.TensorMeta(torch.Size(shape), tuple(stride), local.dtype)
    return d.DTensorSpec(device_mesh, placements, tensor_meta=meta)


def dtensor_spec_shaped(
    device_mesh: Any, placements: tuple, shape: tuple[int, ...], dtype: torch.dtype
) -> Any:
    """The ``DTensorSpec`` of a contiguous DTensor of global ``shape``: what
    ``DTensor.from_local(..., shape=, stride=)`` builds, for local blocks of unequal sizes
    (whose global shape no one rank's block gives)."""
    d = dist()
    stride, step = [], 1
    for size in reversed(shape):  # contiguous, as torch computes it (a size 0 counts 1)
        stride.append(step)
        step *= max(size, 1)
    meta = d.TensorMeta(torch.Size(shape), tuple(reversed(stride)), dtype)
    return d.DTensorSpec(device_mesh, placements, tensor_meta=meta)


# AsyncCollectiveTensor (the wait-on-first-use result of torch's functional collectives, which the
# overlapped gradient psum returns): its plain buffer (``.elem``), and the wait that returns the
# buffer once its reduction is done (``.trigger_wait()``). C calls: no Python frame per gradient.
async_buffer = operator.attrgetter("elem")
async_wait = operator.methodcaller("trigger_wait")


# --- the functional collectives (the compile paths: backends/_dist_compile.py) -----------------


@functools.cache
def funcol() -> SimpleNamespace:
    """The functional collective ops (``torch.ops._c10d_functional``) that a compiled call traces
    into its graph: Inductor reorders and overlaps them, as it does for torch's own SimpleFSDP
    and async TP. Each returns a new tensor that ``wait_tensor`` completes."""
    ops = torch.ops._c10d_functional
    return SimpleNamespace(
        all_reduce=ops.all_reduce.default,
        all_gather=ops.all_gather_into_tensor.default,
        reduce_scatter=ops.reduce_scatter_tensor.default,
        all_to_all=ops.all_to_all_single.default,
        broadcast=ops.broadcast.default,
        wait=ops.wait_tensor.default,
    )
