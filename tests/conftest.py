"""Shared test set-up.

JAX (the oracle in test_jax_oracle.py) reads XLA_FLAGS once, when it is first imported: ask for 8
fake CPU devices here, before any test module can import it.
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


# --- the backend fixture: one test body on every backend ---------------------------------------

import pytest  # noqa: E402


class _Backend:
    def __init__(self, name, request):
        self.name, self.request = name, request

    def run(self, program):
        import _backends

        if self.name == "simulated":
            return _backends.evaluate(
                program, _backends._simulated_mesh(program.sizes, program.names)
            )
        if self.name == "abstract":
            return _backends.abstract_run(program)
        late = self.name == "distributed_late"
        assert program.distributed and (program.world == 4 or not late), program
        launch = self.request.getfixturevalue("dist_launches")(program.world, late)
        return launch.run(program)


@pytest.fixture(params=["simulated", "abstract", "distributed", "distributed_late"])
def backend(request):
    """Where a program runs: the simulated mesh, ``check`` (abstract), or real processes (gloo;
    ``distributed_late`` delays every overlapped gradient psum to its wait, see dist_worker)."""
    if request.param.startswith("distributed"):
        request.applymarker(pytest.mark.distributed)
    return _Backend(request.param, request)


@pytest.fixture(scope="session")
def dist_launches(tmp_path_factory):
    """One multi-process launch per (world, late) for every program of that world: launched on
    first use, shared by all tests of the session."""
    import _dist_programs

    cache = {}

    def get(world, late):
        if (world, late) not in cache:
            cache[world, late] = _dist_programs.Launch(
                world, late, tmp_path_factory.mktemp(f"dist{world}{'late' if late else ''}")
            )
        return cache[world, late]

    return get
