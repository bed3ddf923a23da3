"""named_spmd: JAX's shard_map way of writing SPMD code, for PyTorch.

Write a per-device function, decorate it with ``@spmd_map(mesh=..., in_specs=..., out_specs=...)``
and talk to the other instances with collectives by axis name.
"""

from . import parallel as parallel
from . import random as random
from ._accounting import CommEvent as CommEvent
from ._accounting import CommMode as CommMode
from ._api import SpmdFunction as SpmdFunction
from ._api import make_mesh as make_mesh
from ._api import spmd_map as spmd_map
from ._check import CheckReport as CheckReport
from ._check import OutputCheck as OutputCheck
from ._check import ShapeDtype as ShapeDtype
from ._collectives import all_gather as all_gather
from ._collectives import all_to_all as all_to_all
from ._collectives import axis_index as axis_index
from ._collectives import axis_size as axis_size
from ._collectives import block_offsets as block_offsets
from ._collectives import block_sizes as block_sizes
from ._collectives import pbroadcast as pbroadcast
from ._collectives import pcast as pcast
from ._collectives import pmax as pmax
from ._collectives import pmean as pmean
from ._collectives import pmin as pmin
from ._collectives import ppermute as ppermute
from ._collectives import pshuffle as pshuffle
from ._collectives import psum as psum
from ._collectives import psum_scatter as psum_scatter
from ._collectives import pvary as pvary
from ._collectives import ragged_all_to_all as ragged_all_to_all
from ._collectives import typeof as typeof
from ._collectives import vma as vma
from ._compile import compile as compile
from ._debug import set_debug as set_debug
from ._display import visualize as visualize
from ._errors import CollectiveError as CollectiveError
from ._errors import RankFailedError as RankFailedError
from ._errors import SpecError as SpecError
from ._errors import SpmdError as SpmdError
from ._errors import VmaError as VmaError
from ._mesh import Mesh as Mesh
from ._shard import shard as shard
from ._shard import unshard as unshard
from ._spec import Blocks as Blocks
from ._spec import P as P
from ._spec import PartitionSpec as PartitionSpec
from ._types import Vma as Vma
from ._types import VType as VType
from .backends.simulated import simulate_per_instance as simulate_per_instance
from .backends.simulated import simulation_order as simulation_order

__version__ = "0.1.0"

# Real-backend helpers, loaded on first use: `import named_spmd` must not import the
# distributed backend (nor torch.distributed's heavier modules).
_LAZY = {
    "to_local": ("named_spmd.backends.distributed", "to_local"),
    "set_grad_bucket_mb": ("named_spmd.backends._dist_buckets", "set_grad_bucket_mb"),
}


def __getattr__(name: str) -> object:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        value = getattr(importlib.import_module(module), attr)
        globals()[name] = value  # later lookups skip this hook (``ns.to_local`` runs every step)
        return value
    raise AttributeError(f"module 'named_spmd' has no attribute {name!r}")


__all__ = [
    "CheckReport",
    "CollectiveError",
    "CommEvent",
    "CommMode",
    "Mesh",
    "OutputCheck",
    "Blocks",
    "P",
    "PartitionSpec",
    "RankFailedError",
    "ShapeDtype",
    "SpecError",
    "SpmdError",
    "SpmdFunction",
    "VType",
    "Vma",
    "VmaError",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "block_offsets",
    "block_sizes",
    "compile",
    "make_mesh",
    "parallel",
    "pbroadcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pcast",
    "pshuffle",
    "psum",
    "psum_scatter",
    "pvary",
    "ragged_all_to_all",
    "random",
    "set_debug",
    "set_grad_bucket_mb",
    "shard",
    "simulate_per_instance",
    "simulation_order",
    "spmd_map",
    "to_local",
    "typeof",
    "unshard",
    "visualize",
    "vma",
]
