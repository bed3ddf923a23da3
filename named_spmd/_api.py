"""spmd_map and make_mesh: the one call path of a mapped function (a run on the mesh's backend,
or a check on the abstract backend); its inputs' and outputs' checks are ``_call_checks``'s."""

from __future__ import annotations

import functools
import inspect
import types
from collections.abc import Callable, Sequence
from typing import Any, cast, overload

import optree
import torch

from . import _calls, backends
from . import _torch_private as torch_private
from ._accounting import recording
from ._call import Call
from ._call_checks import input_leaves, unequal_blocks
from ._check import CheckReport
from ._errors import SpmdError, fn_label, refused_grad, refused_write
from ._mesh import Mesh
from ._spec import PartitionSpec
from ._tree import check_spec_types, spec_leaves
from .backends import Backend, adopt_mesh, backend_for
from .backends.abstract import AbstractBackend, to_meta, wants_grad
from .backends.simulated import _per_instance


def _call(f: SpmdFunction, args: tuple, backend: Backend, local: bool) -> Any:
    return f._call(args, backend, local)[0]


#: A call on a backend Dynamo cannot trace (none of ours), made while compiling: a graph break
#: around the whole call, which then runs with the real arguments (tracing up to the backend and
#: breaking there would hand the rest of the call Dynamo's stand-ins for the pytree specs). Also
#: a call in the eager rest of a compiled function whose frame Dynamo gave up on: with Dynamo
#: off, not compiled frame by frame.
_call_eagerly = torch_private.not_traced(
    _call,
    reason="named_spmd: a call on a backend that Dynamo cannot trace (capabilities.traceable "
    "is False) runs eagerly inside a compiled program (docs/design.md section 7). Fix: compile "
    "without fullgraph=True, or use a backend whose calls compile whole (the simulated and the "
    "distributed backends)",
)
#: A call made under ``ns.CommMode`` while compiling: CommMode counts what a call runs, and a
#: compiled graph runs no Python to count with, so the call runs eagerly (a graph break).
_call_counted = torch_private.not_traced(
    _call,
    reason="named_spmd: a mapped call made under ns.CommMode runs eagerly inside a compiled "
    "program, so that CommMode counts its collectives (docs/design.md section 7). Fix: compile "
    "the mapped function with ns.compile(f, fullgraph=True), whose calls under CommMode run "
    "eagerly before Dynamo sees them, or compile without fullgraph=True",
)
#: A call whose inputs split into blocks of unequal sizes, made while compiling: its instances'
#: shapes differ, which no graph holds, so it runs eagerly (a graph break around the call).
_call_uneven = torch_private.not_traced(
    _call,
    reason="named_spmd: a mapped call whose inputs split into blocks of unequal sizes (a dim "
    "its axes do not divide, or an ns.Blocks entry of unequal sizes) runs eagerly inside a "
    "compiled program (docs/uneven.md). Fix: pad that dim to a multiple of its axes' group size "
    "to compile the call; or compile without fullgraph=True (a graph break around the call); "
    "or compile the mapped function with ns.compile(f, fullgraph=True), whose uneven calls run "
    "eagerly before Dynamo sees them",
)


class SpmdFunction:
    """A per-device function mapped over a mesh; call it with global values."""

    def __new__(cls, *args: Any) -> SpmdFunction:
        # Each mapped function gets call methods of its own code: Dynamo marks a code object
        # whose frame it gave up on ("falling back to eager") as skipped until Dynamo is reset,
        # so one mapped call that cannot be traced would otherwise stop every other one from
        # compiling (they would run eagerly, silently).
        return super().__new__(_with_own_call(cls))

    def __reduce__(self) -> tuple[Any, ...]:  # pickling: rebuilt by the class, a new __call__
        args = (self.fn, self.mesh, self.in_specs, self.out_specs, self.check_vma)
        return (SpmdFunction, args)

    def __init__(
        self, fn: Callable[..., Any], mesh: Any, in_specs: Any, out_specs: Any, check_vma: bool
    ) -> None:
        self.fn = fn
        self.label = fn_label(fn)
        self.where = f"spmd_map of {self.label}"
        self.mesh: Mesh = as_mesh(mesh, self.where)
        check_spec_types(in_specs, "in_specs", self.where)
        check_spec_types(out_specs, "out_specs", self.where)
        self.in_specs = in_specs
        self.out_specs = out_specs
        # the distinct in_specs, which a traced call indexes (``_call_checks._specs_in_trace``)
        self._in_spec_table = tuple(dict.fromkeys(spec_leaves(in_specs)))
        # per input structure, outside a trace: the in_specs broadcast over it, and per leaf
        # keys (``_call_checks.leaves_key``) that fit them (a call of known inputs checks none):
        # each one's ``Call.memo``; and plain trees' structures (``_tree.flatten_known``)
        self._inputs_of_tree: dict[Any, tuple[list[PartitionSpec], dict[tuple, dict]]] = {}
        self._plain_trees: dict[Any, Any] = {}
        # per signature, the typing its first call left its later ones (``_replay``)
        self._signatures: dict[tuple, Any] = {}
        # per output structure, outside a trace: out_specs over it, leaf keys fitting them
        self._outputs_of_tree: dict[Any, tuple[list[PartitionSpec], set[tuple]]] = {}
        # per input structure and leaf shapes: whether the blocks differ in size
        # (``_call_checks.unequal_blocks``, asked at every call of ``ns.compile(f)``)
        self._unequal_of_inputs: dict[tuple, bool] = {}
        self.check_vma = check_vma
        # picked once: a mesh's kind never changes, and a compiled call would guard on the
        # registry's lookups (``sys.modules``), so any import between two steps would recompile
        self.backend = backend_for(self.mesh)
        # whether the first positional argument is the instance of a method (``__get__``),
        # passed to ``fn`` outside in_specs; and this function as such a method, made once
        self.binds_self = False
        self._method: SpmdFunction | None = None
        # the name of the class attribute it is (``__set_name__``): a bound method pickles as
        # that attribute of its instance
        self.attr_name: str | None = None
        # (not fn.__dict__: a function wrapping another SpmdFunction would lend this one its
        # mesh, specs and body)
        functools.update_wrapper(self, fn, updated=())

    def __get__(self, obj: Any, owner: type | None = None) -> Any:
        """Read from an instance of a class it is an attribute of, a mapped function is a
        method, as a Python function is: ``fn`` gets the instance as its first argument, outside
        in_specs (which pair with the other positional arguments). The instance is closed over,
        as a closure's variables are: a non-tensor, its tensors (a module's parameters)
        invariant. Read from the class, it is this mapped function."""
        if obj is None:
            return self
        if self._method is None:  # assigned outside a class body
            self._method = self._as_method()
        return BoundSpmdFunction(self._method, obj)

    def __set_name__(self, owner: type, name: str) -> None:
        """Assigned in a class body as attribute ``name`` (which may differ from ``fn``'s). Its
        method is made here, outside any trace: Dynamo cannot trace making one (its call
        methods' code objects are copied, ``_with_own_call``), and a compiled module's first
        use of the method may be inside the trace."""
        self.attr_name = name
        self._method = self._as_method()

    def _as_method(self) -> SpmdFunction:
        method = SpmdFunction(self.fn, self.mesh, self.in_specs, self.out_specs, self.check_vma)
        method.binds_self, method.attr_name = True, self.attr_name
        return method

    def _split_self(self, args: tuple) -> tuple[tuple, tuple]:
        """The instance a method binds (none for a plain mapped function), and the arguments
        in_specs pair with."""
        return (args[:1], args[1:]) if self.binds_self else ((), args)

    def __repr__(self) -> str:
        return (
            f"spmd_map({self.label}, mesh={self.mesh!r}, in_specs={self.in_specs!r}, "
            f"out_specs={self.out_specs!r})"
        )

    # --- call -------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._enter(args, kwargs, False)

    def local(self, *args: Any, **kwargs: Any) -> Any:
        """Call with this process's blocks of the inputs; get its blocks of the outputs.

        On a real mesh every tensor argument is this rank's block under its in_spec (a plain
        tensor: what a Megatron-style program holds; ``ns.shard(..., blocks=True)`` makes them),
        and every output is this rank's block under its out_spec, a plain tensor (a replicated
        output: the whole value, the same on every rank; an unreduced one: this rank's part).
        Gradients flow to the blocks as to a DTensor's local tensor: a block's gradient is its
        block of the global gradient, a replicated input's the whole gradient on every rank, a
        reduced input's this rank's partial sum of it. No DTensor is made, gathered or
        scattered; types, checks and errors are those of a global call. On a simulated mesh one
        process holds every instance, so its blocks are the global values and
        ``f.local(*args)`` is ``f(*args)``: one script runs on both. Where a value is a partial
        sum (an unreduced output, a reduced input's gradient) a rank holds its part and the
        simulated process the whole sum: pass such values on to calls that declare them so.
        A DTensor's ``to_local()`` is not always its block here: for a tuple entry in another
        order than the mesh's (``P(("tp", "dp"))`` on a ``("dp", "tp")`` mesh) it holds the
        mesh order's block; use ``ns.shard(..., blocks=True)``.

        Example (a real (2, 2) mesh, ``x`` split over "dp", ``w`` over "tp")::

            params = ns.shard(params, mesh, specs, blocks=True)  # this rank's blocks
            loss = step.local(tokens_block, targets_block, params)
            loss.backward()  # params' .grad: their blocks of the global gradient
        """
        return self._enter(args, kwargs, self.backend.capabilities.local_blocks)

    def _enter(self, args: tuple, kwargs: dict, local: bool) -> Any:
        if kwargs:
            raise SpmdError(
                f"{self.where}: keyword arguments {sorted(kwargs)} are not supported; in_specs "
                "matches positional arguments. Fix: pass them positionally, or bind constants "
                "with functools.partial before spmd_map."
            )
        backend = self.backend
        if torch.compiler.is_compiling():
            # the trace-time hooks of the compile paths, before the call's checks read them
            # (imported here, not with every eager call)
            from . import _traced

            if _traced.root_frame() == (__file__, "_enter"):
                # Dynamo compiles this frame on its own, so it gave up on its caller's trace: a
                # graph break inside the call (the user's code). Skipped, the frame runs
                # eagerly, and the whole call with Dynamo off (below), rather than Dynamo
                # resuming our internals frame by frame (skip_frame skips the frame calling it)
                torch_private.dynamo_skip_frame()("named_spmd: a graph break inside a mapped call")
            if not backend.capabilities.traceable:
                return _call_eagerly(self, args, backend, local)
            if recording():
                return _call_counted(self, args, backend, local)
            if self.unequal_blocks(args, local):
                return _call_uneven(self, args, backend, local)
            return _calls.restoring_stacks(functools.partial(_call, self, args, backend, local))
        elif (
            torch_private.dynamo_frame_callback() is not None
        ):  # Dynamo gave up on the frame around this
            # call: run it with Dynamo off, or it would compile our eager internals frame by frame
            return _call_eagerly(self, args, backend, local)
        return self._call(args, backend, local)[0]

    def unequal_blocks(self, args: tuple, local: bool = False) -> bool:
        """Whether a call of ``args`` splits an input into blocks of unequal sizes, which it
        runs eagerly when compiled (``_call_uneven``; ``ns.compile`` asks before Dynamo sees the
        call): ``_call_checks.unequal_blocks``."""
        return unequal_blocks(self, self._split_self(args)[1], local)

    def check(self, *args: Any, backward: bool = True) -> CheckReport:
        """Type-check a call without running it: shapes, dtypes, vma and communication.

        Runs the per-device function once, abstractly, on meta tensors of the per-instance
        shapes: no data, no communication, no per-instance work, so a mesh of thousands of
        instances is checked on a laptop. Raises the same :class:`SpmdError` a real call would.
        A call whose blocks differ in size (``ns.Blocks``, or ``ns.simulate_per_instance()``)
        is checked per instance, each on meta tensors of its own block shapes (the per-instance
        execution's threads and meetings, without data); its report types instance 0's outputs.

        Args:
            *args: the global arguments, as tensors (real or ``device="meta"``) or
                :class:`named_spmd.ShapeDtype` stand-ins; nothing of their size is allocated.
            backward: also run autograd on the meta outputs, with respect to every floating-point
                input, to report the backward communication (but an input that needs no
                gradient where the function writes into a view autograd refuses a write into
                for one that does: ``x.unbind(0)[0].add_(1)``, which the call takes).

        Returns:
            A :class:`named_spmd.CheckReport`: ``.outputs`` (per-instance ``VType`` and global
            shape per output leaf), ``.out`` (the output pytree of ``ShapeDtype``), ``.forward``
            and ``.backward`` (the logical collectives one instance runs), ``.comms.summary()``.

        Example:
            >>> import torch, named_spmd as ns
            >>> mesh = ns.make_mesh((64, 64), ("dp", "tp"))
            >>> f = ns.spmd_map(lambda x: ns.psum(x, "tp"), mesh=mesh,
            ...                 in_specs=ns.P("dp", "tp"), out_specs=ns.P("dp"))
            >>> f.check(ns.ShapeDtype((4096, 4096))).types
            [f32[64,64]{dp}]
        """
        bound, rest = self._split_self(args)
        tree: Any = rest  # optree's PyTree is a class to mypy: a tuple is not one
        leaves = optree.tree_leaves(tree, none_is_leaf=True)
        grads = [wants_grad(x) for x in leaves]
        try:
            return self._check(bound, tree, grads, backward)
        except RuntimeError as e:
            # What autograd refuses where the check differentiates with respect to an argument
            # that needs no gradient, which the call takes: a write (into a multi-output op's
            # view: unbind, split; out= where an operand requires grad; after an op saved a
            # tensor only for its gradient), or an op that takes no gradient for the argument (a
            # BatchNorm's running statistics): checked again without differentiating those
            needed = [
                g and getattr(x, "requires_grad", None) is True for g, x in zip(grads, leaves)
            ]
            cause = e.__cause__ if isinstance(e, SpmdError) else e
            refused = refused_write(cause) or torch_private.is_stale(cause) or refused_grad(cause)
            if needed == grads or not refused:
                raise
            return self._check(bound, tree, needed, backward)

    def _check(self, bound: tuple, tree: Any, grads: list[bool], backward: bool) -> CheckReport:
        # as the mesh's backend would run it: blocks of unequal sizes checked per instance
        backend = AbstractBackend(grads, backward, self.backend, _per_instance.run)
        meta = cast(tuple, optree.tree_map(to_meta, tree, none_is_leaf=True))
        out, call = self._call((*bound, *meta), backend)
        return backend.report(self.label, self.mesh, out, call.out_wheres(), call.out_specs())

    def _call(self, args: tuple, backend: Backend, local: bool = False) -> tuple[Any, Call]:
        """The one call path: inputs checked, ``backend`` runs the call's body on every
        instance, the outputs are checked against out_specs and assembled (``local``: this
        process's blocks in and out, on a backend whose processes hold blocks,
        ``Capabilities.local_blocks``)."""
        outer = _calls.active()
        if outer is not None:
            raise SpmdError(
                f"{self.where} was called inside another spmd_map (of "
                f"{outer.fn_label}); nesting is not supported. "
                "Fix: call the inner per-device function directly, it already runs per instance."
            )
        bound, args = self._split_self(args)
        leaves, specs, in_tree, memo = input_leaves(self, args, local, backend)
        call = Call(self, backend, leaves, specs, in_tree, local, memo, bound)
        return call.run(), call


class BoundSpmdFunction:
    """``obj.f``, where the mapped function ``f`` is an attribute of ``obj``'s class: ``f`` as a
    method of ``obj`` (``SpmdFunction.__get__``); calls, ``local`` and ``check`` pass ``obj``."""

    def __init__(self, method: SpmdFunction, obj: Any) -> None:
        self.__func__, self.__self__ = method, obj

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__(self.__self__, *args, **kwargs)

    def local(self, *args: Any, **kwargs: Any) -> Any:
        return self.__func__.local(self.__self__, *args, **kwargs)

    def check(self, *args: Any, backward: bool = True) -> CheckReport:
        return self.__func__.check(self.__self__, *args, backward=backward)

    # the mapped function's attributes that describe it: its methods take the arguments
    # without the instance (``unequal_blocks``), so they are not the bound method's
    _DESCRIBING = frozenset(
        ("fn", "label", "where", "mesh", "in_specs", "out_specs", "check_vma", "backend")
        + ("attr_name", "__name__", "__qualname__")
    )

    def __getattr__(self, name: str) -> Any:
        if name not in BoundSpmdFunction._DESCRIBING:  # (``__func__`` too, before it is set)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.__func__, name)

    @property
    def __signature__(self) -> inspect.Signature:
        """``fn``'s signature without the instance, as a bound method's."""
        signature = inspect.signature(self.__func__.fn)
        params = list(signature.parameters.values())
        if params and params[0].kind is not inspect.Parameter.VAR_POSITIONAL:
            params = params[1:]  # (``*args`` takes the instance and the arguments)
        return signature.replace(parameters=params)

    def __repr__(self) -> str:
        return f"<bound {self.__func__!r} of {self.__self__!r}>"

    def __reduce__(self) -> tuple[Any, ...]:  # pickled as a bound method: read again from obj
        name = self.__func__.attr_name
        if name is None:
            raise SpmdError(
                f"{self.__func__.where}: a mapped method pickles as the attribute of its "
                "instance that it is, and this one was not assigned in a class body, so its "
                "name is unknown. Fix: assign it in the class body (`step = ns.spmd_map(...)`, "
                "or @ns.spmd_map(...) above the def)."
            )
        attribute = inspect.getattr_static(type(self.__self__), name, None)
        if getattr(attribute, "_method", None) is not self.__func__:
            raise SpmdError(  # (one mapped function assigned under two names: which is it?)
                f"{self.__func__.where}: a mapped method pickles as the attribute of its "
                f"instance that it is, and the class's attribute {name!r} is another one (this "
                "mapped function is assigned under several names). Fix: give each class "
                "attribute a mapped function of its own."
            )
        return (getattr, (self.__self__, name))


def _with_own_call(cls: type) -> type:
    """A subclass of ``cls`` whose call methods (``__call__``, ``local`` and ``_enter``, which
    both go through) are copies with code objects of their own (Dynamo keeps its per-frame
    state, a skip mark included, on the code object)."""
    namespace: dict[str, Any] = {"__module__": cls.__module__, "__qualname__": cls.__qualname__}
    for name in ("__call__", "local", "_enter"):
        method = getattr(cls, name)
        own = types.FunctionType(
            method.__code__.replace(), method.__globals__, method.__name__, method.__defaults__
        )
        own.__qualname__, own.__doc__ = method.__qualname__, method.__doc__
        namespace[name] = own
    return type(cls.__name__, (cls,), namespace)


@overload
def spmd_map(
    f: Callable[..., Any],
    /,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
) -> SpmdFunction: ...


@overload
def spmd_map(
    f: None = None,
    /,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
) -> Callable[[Callable[..., Any]], SpmdFunction]: ...


def spmd_map(
    f: Callable[..., Any] | None = None,
    /,
    *,
    mesh: Any,
    in_specs: Any,
    out_specs: Any,
    check_vma: bool = True,
) -> SpmdFunction | Callable[[Callable[..., Any]], SpmdFunction]:
    """Map a per-device function over a mesh: global values in, global values out.

    Args:
        f: the per-device function. It receives, for every tensor argument, the local block that
            its in_spec selects for this instance, and may call collectives by axis name.
        mesh: a :class:`Mesh` (simulated or real) or a ``DeviceMesh`` with ``mesh_dim_names``.
        in_specs: a pytree prefix of the positional-argument tuple; each ``P`` applies to every
            tensor leaf below it (``None`` means ``P()``).
        out_specs: a pytree prefix of the output. An axis the out_spec names concatenates the
            instances' blocks along that dim; an axis it does not name must be invariant.
        check_vma: check that out_specs only claim replication the program guarantees. With
            ``False`` an unnamed axis returns the value of the instance at coordinate 0 there,
            and an axis declared ``unreduced`` the sum of the instances' values (as JAX).

    Autodiff: the mapped function is differentiable with respect to its global inputs
    (``Tensor.backward``, ``torch.autograd.grad``, ``torch.func`` grad / vjp / jvp / jacrev /
    hessian / vmap, forward-mode AD, double backward); the result is the gradient of the global
    function, with each collective transposed as docs/design.md section 3 says. On a real mesh a
    call under a ``torch.func`` transform (or with a forward-AD tangent) returns plain tensors
    holding the global value, since functorch cannot wrap a DTensor. ``torch.func.grad`` (or vjp / jvp)
    *inside* ``f`` differentiates the per-instance function, as ``jax.grad`` inside
    ``shard_map`` does: collectives transpose per instance (psum -> pvary, all_gather ->
    psum_scatter, all_to_all -> swapped all_to_all, ppermute -> reversed pairs, ``pvary`` ->
    psum, the implicit one included), so the gradient of a psum'd loss w.r.t. a varying input is
    this instance's block of the global gradient, and w.r.t. an invariant one the invariant
    total. ``Tensor.backward`` / ``torch.autograd.grad`` cannot run
    inside ``f`` on the simulated mesh (functorch refuses them under vmap).

    Example:
        >>> import torch, named_spmd as ns
        >>> from named_spmd import P
        >>> mesh = ns.make_mesh((2, 4), ("dp", "tp"))
        >>> @ns.spmd_map(mesh=mesh, in_specs=(P("dp", None), P(None, "tp")), out_specs=P("dp", None))
        ... def mlp(x, w):
        ...     return ns.psum(torch.relu(x @ w).sum(-1, keepdim=True), "tp")
        >>> mlp(torch.randn(8, 16), torch.randn(16, 32)).shape
        torch.Size([8, 1])
    """
    if f is None:
        return functools.partial(
            spmd_map, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=check_vma
        )
    if not callable(f):
        raise SpmdError(f"spmd_map: expected a function, got {type(f).__name__}.")
    return SpmdFunction(f, mesh, in_specs, out_specs, check_vma)


def make_mesh(
    shape: Sequence[int] | int,
    axis_names: Sequence[str] | str,
    *,
    device_type: str | None = None,
    simulated: bool | None = None,
) -> Mesh:
    """Make a mesh: simulated in this process unless ``torch.distributed`` is initialized.

    Args:
        shape: axis sizes, e.g. ``(2, 4)``.
        axis_names: one name per axis, e.g. ``("dp", "tp")``.
        device_type: for a real mesh, ``"cpu"`` (gloo) or ``"cuda"`` (NCCL); default: the
            process group's backend decides.
        simulated: force a simulated mesh (True) or a real one (False); default: real exactly
            when a process group is initialized.

    Example:
        >>> mesh = make_mesh((2, 4), ("dp", "tp"))
        >>> mesh.shape
        {'dp': 2, 'tp': 4}
    """
    if isinstance(shape, int):
        shape = (shape,)
    if isinstance(axis_names, str):
        axis_names = (axis_names,)
    real = None if simulated is None else not simulated
    return backends.make_mesh(tuple(shape), tuple(axis_names), device_type, real)


def as_mesh(mesh: Any, where: str) -> Mesh:
    """Accept a Mesh or a user's DeviceMesh with mesh_dim_names."""
    if isinstance(mesh, Mesh):
        return mesh
    adopted = adopt_mesh(mesh)  # a DeviceMesh: its backend's Mesh of it
    if adopted is not None:
        return adopted
    raise SpmdError(
        f"{where}: mesh= must be a named_spmd Mesh or a DeviceMesh with mesh_dim_names, got "
        f"{type(mesh).__name__}. Fix: mesh = named_spmd.make_mesh((2, 4), ('dp', 'tp'))."
    )
