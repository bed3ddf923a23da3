"""Backends: who runs a mapped call, picked per mesh by :func:`backend_for`; who makes and
recognises meshes (:func:`make_mesh`, :func:`adopt_mesh`).

A backend is an object with the :class:`Backend` interface; the collectives talk to the running
call through its :class:`~named_spmd._context.SpmdContext` subclass (the primitives). The
registry names backend modules by import path, each defining ``BACKEND``; a module is only asked
once it is loaded (einops' ``get_backend`` does the same), so ``import named_spmd`` never imports
torch.distributed: a distributed mesh exists only once its module was imported to make it.

See ``README.md`` beside this file for what each module holds and how to add a backend.
"""

from __future__ import annotations

import importlib
import sys
from typing import TYPE_CHECKING, Any, Protocol

from .._capabilities import Capabilities
from .._errors import SpmdError
from .._mesh import Mesh

if TYPE_CHECKING:
    from .._call import Call


class Backend(Protocol):
    """What runs a mapped call (see docs/design.md, "Adding a backend")."""

    name: str
    #: What its calls can be: traced whole by Dynamo, on this process's blocks, on blocks of
    #: unequal sizes (:class:`~named_spmd._capabilities.Capabilities`).
    capabilities: Capabilities

    def accepts(self, mesh: Mesh) -> bool:
        """Whether this backend runs calls on ``mesh``."""
        ...

    def uneven_state(self) -> bool:
        """Whether calls made now run on blocks of unequal sizes whatever their inputs
        (``ns.simulate_per_instance()``), on a backend that takes such blocks; a key of the
        input checks' cache, asked at every call."""
        ...

    def run(self, call: Call) -> list[Any]:
        """Run ``call.body(local_leaves, ctx)`` per instance on ``call.mesh``, the local
        leaves laid out from ``call.leaves`` per ``call.specs`` (``call.local``: they are this
        process's blocks already), with a context of this backend (the body pushes it); return
        the output tensors assembled to global values per ``call.out_specs()`` (known once the
        body ran)."""
        ...

    def explain(self, error: RuntimeError, where: str) -> SpmdError | None:
        """A clearer error for a torch error raised by the user's function on this backend
        (e.g. a vmap limit on the simulated mesh), or None."""
        ...


#: Backend modules, checked in order once loaded; the last one is the default and is loaded
#: on demand. A third backend registers its module here (``register``).
_MODULES = ["named_spmd.backends.distributed", "named_spmd.backends.simulated"]


def register(module: str) -> None:
    """Make the backend module ``module`` (defining ``BACKEND``) eligible, before the default."""
    if module not in _MODULES:
        _MODULES.insert(len(_MODULES) - 1, module)


#: Other libraries' mesh classes a backend adopts as its own Mesh (its ``BACKEND.adopt(obj)``):
#: (module defining the class, class name) -> backend module. An object of a class exists only
#: once the class's module is loaded, so recognising one loads nothing (``sys.modules``).
_ADOPTED = {("torch.distributed.device_mesh", "DeviceMesh"): "named_spmd.backends.distributed"}


def adopt_mesh(obj: Any) -> Mesh | None:
    """The Mesh a backend makes of another library's mesh ``obj`` (a torch ``DeviceMesh``), or
    None where no backend adopts it."""
    for (module, name), backend in _ADOPTED.items():
        cls = getattr(sys.modules.get(module), name, None)
        if isinstance(cls, type) and isinstance(obj, cls):
            return importlib.import_module(backend).BACKEND.adopt(obj)
    return None


#: The backend module that makes each kind of mesh (its ``BACKEND.make_mesh(shape, names,
#: device_type)``), by whether its instances are processes: loaded only to make one, so a
#: process making only simulated meshes never imports torch.distributed.
_MESH_MAKERS = {False: "named_spmd.backends.simulated", True: "named_spmd.backends.distributed"}


def make_mesh(
    shape: tuple[int, ...], names: tuple[str, ...], device_type: str | None, real: bool | None
) -> Mesh:
    """A mesh made by the backend of its kind: one instance per process where ``real`` (None:
    exactly when a torch.distributed process group is initialized), else simulated here."""
    if real is None:
        real = _processes_ready()
    return _loaded(_MESH_MAKERS[real]).BACKEND.make_mesh(shape, names, device_type)


def _processes_ready() -> bool:
    dist = sys.modules.get("torch.distributed")
    return dist is not None and dist.is_available() and dist.is_initialized()


def _loaded(module: str) -> Any:
    return sys.modules.get(module) or importlib.import_module(module)


def backend_for(mesh: Mesh) -> Backend:
    """The backend that runs calls on ``mesh``."""
    for name in _MODULES[:-1]:
        module = sys.modules.get(name)
        if module is not None and module.BACKEND.accepts(mesh):
            return module.BACKEND
    default = _loaded(_MODULES[-1]).BACKEND
    if not default.accepts(mesh):
        raise SpmdError(f"no named_spmd backend runs calls on {mesh!r}")
    return default
