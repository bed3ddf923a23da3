"""The backend interface (docs/design.md section 5.6): what a backend declares and what it is
handed, and nothing else.

A backend written against the documented interface only (``capabilities``, ``accepts``,
``uneven_state``, ``run(call)``, ``explain``), registered as a third backend, runs calls,
checks and local calls; its capabilities alone decide which inputs a call takes; every backend
of the package declares the same members; ``make_mesh`` makes a mesh through the registry.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
import types

import pytest
import torch

import named_spmd as ns
from named_spmd import P, backends
from named_spmd._capabilities import Capabilities
from named_spmd._mesh import Mesh
from named_spmd.backends.abstract import AbstractBackend
from named_spmd.backends.simulated import BACKEND as SIMULATED

_MODULE = "named_spmd_test_narrow_backend"


class NarrowMesh(Mesh):
    """The mesh kind of the narrow backend (a plain mesh otherwise)."""


class NarrowBackend:
    """Exactly the ``Backend`` protocol's members, and ``make_mesh`` (a backend that makes
    meshes); runs each call as the simulated backend does and keeps the calls it was handed."""

    name = "narrow"

    def __init__(self, uneven_blocks: bool) -> None:
        self.capabilities = Capabilities(
            traceable=False, local_blocks=False, uneven_blocks=uneven_blocks
        )
        self.calls: list = []

    def accepts(self, mesh: Mesh) -> bool:
        return isinstance(mesh, NarrowMesh)

    def uneven_state(self) -> bool:
        return False

    def run(self, call):
        self.calls.append(call)
        return SIMULATED.run(call)

    def explain(self, error: RuntimeError, where: str):
        return SIMULATED.explain(error, where)

    def make_mesh(self, shape, names, device_type):
        return NarrowMesh(shape, names, device_type=device_type or "cpu")


@pytest.fixture(params=[True, False], ids=["uneven", "even-only"])
def narrow(request, monkeypatch):
    """A registered third backend (its module in ``sys.modules``, as once imported)."""
    module = types.ModuleType(_MODULE)
    module.BACKEND = NarrowBackend(request.param)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, _MODULE, module)
    monkeypatch.setattr(backends, "_MODULES", list(backends._MODULES))
    backends.register(_MODULE)
    return module.BACKEND


def _mlp(mesh):
    def mlp(x, w):
        return ns.psum(x @ w, "tp")

    return ns.spmd_map(mlp, mesh=mesh, in_specs=(P("dp", "tp"), P("tp")), out_specs=P("dp"))


def test_a_third_backend_runs_calls_handed_one_call_object(narrow):
    mesh = NarrowMesh((2, 2), ("dp", "tp"))
    f = _mlp(mesh)
    assert f.backend is narrow
    x, w = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    torch.testing.assert_close(f(x, w), x @ w)  # the dense computation
    (call,) = narrow.calls
    assert call.mapped is f and call.mesh is mesh and call.fn is f.fn
    assert call.local is False and call.specs == [P("dp", "tp"), P("tp")]
    assert call.leaves[0] is x and call.leaves[1] is w
    assert call.out_specs() == [P("dp")]  # recorded by the body the backend ran
    # a local call on a backend whose processes hold every instance is the global call
    torch.testing.assert_close(f.local(x, w), x @ w)
    assert narrow.calls[-1].local is False


def test_the_capabilities_decide_whether_unequal_blocks_are_taken(narrow):
    """5 rows over dp=2: blocks of 3 and 2 where the backend takes them (equal to the dense
    computation), a SpecError naming the function where it does not; ``.check()`` agrees."""
    mesh = NarrowMesh((2, 2), ("dp", "tp"))
    f = _mlp(mesh)
    x, w = torch.randn(5, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    if narrow.capabilities.uneven_blocks:
        torch.testing.assert_close(f(x, w), x @ w)
        assert f.check(x, w).out.shape == (5, 3)
        return
    for attempt in (lambda: f(x, w), lambda: f.check(x, w)):
        with pytest.raises(ns.SpecError, match=r"spmd_map of `_mlp.<locals>.mlp`") as info:
            attempt()
        assert "dim 0 has size 5, not divisible by 2 (dp=2)" in str(info.value)
    assert narrow.calls == []  # refused by the input checks, before the backend


def test_the_check_mirrors_its_backends_capabilities(narrow):
    abstract = AbstractBackend([], True, narrow)
    want = Capabilities(
        traceable=False, local_blocks=False, uneven_blocks=narrow.capabilities.uneven_blocks
    )
    assert abstract.capabilities == want
    assert abstract.uneven_state() is narrow.uneven_state()


def _package_backends() -> list:
    from named_spmd.backends.distributed import BACKEND as DISTRIBUTED

    return [SIMULATED, DISTRIBUTED, AbstractBackend([], True, SIMULATED)]


@pytest.mark.parametrize("index", range(3), ids=["simulated", "distributed", "abstract"])
def test_every_backend_declares_the_protocols_members(index):
    backend = _package_backends()[index]
    assert isinstance(backend.capabilities, Capabilities)
    with pytest.raises(dataclasses.FrozenInstanceError):
        backend.capabilities.traceable = True
    assert list(inspect.signature(backend.run).parameters) == ["call"]
    assert isinstance(backend.uneven_state(), bool)
    for gone in ("traceable", "local_blocks", "takes_uneven"):
        assert not hasattr(backend, gone), gone
    with ns.simulate_per_instance():
        assert backend.uneven_state() is True
    assert backend.uneven_state() is False


def test_a_member_context_must_say_its_member_and_where_its_values_live():
    """``MemberContext`` builds ``axis_index`` and ``per_member`` from ``member`` and
    ``member_device``: abstract, so a context lacking one cannot be made (not a
    NotImplementedError at the call's first ``axis_index``); each backend's defines both."""
    from named_spmd._stamps import MemberContext
    from named_spmd.backends.distributed import DistributedContext
    from named_spmd.backends.simulated._one_instance import OneInstanceContext
    from named_spmd.backends.simulated._per_instance import InstanceContext

    assert {"member", "member_device"} <= MemberContext.__abstractmethods__
    for context in (DistributedContext, OneInstanceContext, InstanceContext):
        assert issubclass(context, MemberContext) and not context.__abstractmethods__


def test_capabilities_state_every_field():
    with pytest.raises(TypeError):
        Capabilities(traceable=True, local_blocks=False)  # type: ignore[call-arg]


def test_make_mesh_asks_the_registry_for_the_backend_of_the_meshs_kind(narrow, monkeypatch):
    """The registry makes meshes (``backends.make_mesh``): a simulated one by default without a
    process group, and a real one by the module the registry names for it (here the narrow
    backend's, so no process group is needed), which then runs its calls."""
    plain = ns.make_mesh((2, 2), ("dp", "tp"))
    assert type(plain) is Mesh and plain.shape == {"dp": 2, "tp": 2}
    assert ns.spmd_map(lambda x: x, mesh=plain, in_specs=P(), out_specs=P()).backend is SIMULATED
    monkeypatch.setitem(backends._MESH_MAKERS, True, _MODULE)
    mesh = ns.make_mesh((2, 2), ("dp", "tp"), simulated=False)
    assert type(mesh) is NarrowMesh and mesh.shape == {"dp": 2, "tp": 2}
    f = _mlp(mesh)
    x, w = torch.randn(4, 6, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64)
    torch.testing.assert_close(f(x, w), x @ w)
    assert [c.mesh for c in narrow.calls] == [mesh]
