"""Shared test set-up.

JAX (the oracle in test_jax_oracle.py) reads XLA_FLAGS once, when it is first imported: ask for 8
fake CPU devices here, before any test module can import it.
"""

from __future__ import annotations

import json
import os
import tempfile

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
    first use, shared by all tests of the run."""
    import _dist_programs

    cache = {}

    def get(world, late):
        if (world, late) not in cache:
            cache[world, late] = _dist_programs.Launch(
                world, late, tmp_path_factory.mktemp(f"dist{world}{'late' if late else ''}")
            )
        return cache[world, late]

    return get


# --- running in two workers (pytest-xdist: ``-n 2`` in pyproject.toml) ----------------------------

# Every test that launches processes runs in one worker, one launch at a time (a launch's ranks
# need both cores; a launch cached by a module fixture or functools.cache then runs once), first,
# while the other worker runs the in-process tests; those are grouped by module (xdist's
# loadscope), so module fixtures are built once. Only a worker sees markers and parameters: each
# writes the launching tests' ids to the file ``$NAMED_SPMD_PROCESS_TESTS`` names, which the
# controller's scheduler reads. (xdist's own ``--dist loadgroup`` renames test ids in a way
# pytest 9 ignores.)

_PROCESS_TESTS = "NAMED_SPMD_PROCESS_TESTS"
# Modules whose every test runs in that worker: the tutorials launch torchrun and bound each
# tutorial's time.
_PROCESS_MODULES = {"test_tutorials.py", "test_torchrun.py"}


def _launches_processes(item) -> bool:
    params = getattr(item, "callspec", None)
    backend = params.params.get("backend") if params is not None else None
    return (
        item.get_closest_marker("distributed") is not None
        or (isinstance(backend, str) and backend.startswith("distributed"))
        or item.path.name in _PROCESS_MODULES
    )


def pytest_configure(config):
    if not hasattr(config, "workerinput") and config.getoption("numprocesses", None):
        fd, path = tempfile.mkstemp(prefix="named_spmd_process_tests_", suffix=".json")
        os.close(fd)
        os.environ[_PROCESS_TESTS] = path  # the workers, started later, inherit it


def pytest_unconfigure(config):
    if not hasattr(config, "workerinput") and _PROCESS_TESTS in os.environ:
        os.unlink(os.environ.pop(_PROCESS_TESTS))


def pytest_collection_modifyitems(config, items):
    path = os.environ.get(_PROCESS_TESTS)
    if not hasattr(config, "workerinput") or not path:
        return
    launching = {id(item) for item in items if _launches_processes(item)}
    items.sort(key=lambda item: id(item) not in launching)  # stable: the order within each kind
    written = f"{path}.{config.workerinput['workerid']}"
    with open(written, "w") as fh:
        json.dump([item.nodeid for item in items if id(item) in launching], fh)
    os.replace(written, path)  # whole, whichever worker writes last (they collect alike)


@pytest.hookimpl(optionalhook=True, tryfirst=True)  # before xdist's own
def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class ProcessesFirst(LoadScopeScheduling):
        """xdist's loadscope, with every launching test in one scope, scheduled first."""

        def __init__(self, config, log):
            super().__init__(config, log)
            config.option.loadscopereorder = False  # the collection's order: launching first
            self._launching: set[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._launching is None:  # read once every worker has collected
                with open(os.environ[_PROCESS_TESTS]) as fh:
                    self._launching = set(json.load(fh))
            return "processes" if nodeid in self._launching else super()._split_scope(nodeid)

    return ProcessesFirst(config, log)
