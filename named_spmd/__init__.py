"""named_spmd: JAX's shard_map way of writing SPMD code, for PyTorch.

Write a per-device function, decorate it with ``@spmd_map(mesh=..., in_specs=..., out_specs=...)``
and talk to the other instances with collectives by axis name.
"""

from ._accounting import CommEvent, CommMode
from ._api import SpmdFunction, spmd_map
from ._collectives import (
    all_gather,
    all_to_all,
    axis_index,
    axis_size,
    pmax,
    pmean,
    pmin,
    ppermute,
    pshuffle,
    psum,
    psum_scatter,
    pvary,
    typeof,
    vma,
)
from ._display import visualize
from ._errors import CollectiveError, RankFailedError, SpecError, SpmdError, VmaError
from ._mesh import Mesh, make_mesh
from ._spec import P, PartitionSpec
from ._types import VType
from .backends.abstract import CheckReport, OutputCheck, ShapeDtype
from .backends.simulated import simulation_order

__version__ = "0.1.0"

# Real-backend helpers, loaded on first use: `import named_spmd` must not import the
# distributed backend (nor torch.distributed's heavier modules).
_LAZY = {
    "to_local": ("named_spmd.backends.distributed", "to_local"),
    "set_debug": ("named_spmd.backends._dist_failures", "set_debug"),
}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'named_spmd' has no attribute {name!r}")


__all__ = [
    "CheckReport",
    "CollectiveError",
    "CommEvent",
    "CommMode",
    "Mesh",
    "OutputCheck",
    "P",
    "PartitionSpec",
    "RankFailedError",
    "ShapeDtype",
    "SpecError",
    "SpmdError",
    "SpmdFunction",
    "VType",
    "VmaError",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "make_mesh",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pshuffle",
    "psum",
    "psum_scatter",
    "pvary",
    "set_debug",
    "simulation_order",
    "spmd_map",
    "to_local",
    "typeof",
    "visualize",
    "vma",
]
