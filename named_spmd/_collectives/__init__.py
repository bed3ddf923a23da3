"""The collectives: one :class:`~._record.Collective` record each, applied by one path.

See ``README.md`` beside this file for where each piece lives and how to add a collective.
"""

from ._record import RECORDS, Collective, implicit_pvary, pvary
from .casts import pcast
from .movement import all_gather, all_to_all, psum_scatter
from .permutes import pbroadcast, ppermute, pshuffle
from .ragged import ragged_all_to_all
from .reductions import pmax, pmean, pmin, psum
from .typing import axis_index, axis_size, block_offsets, block_sizes, typeof, vma

__all__ = [
    "RECORDS",
    "Collective",
    "all_gather",
    "all_to_all",
    "axis_index",
    "axis_size",
    "block_offsets",
    "block_sizes",
    "implicit_pvary",
    "pbroadcast",
    "pcast",
    "pmax",
    "pmean",
    "pmin",
    "ppermute",
    "pshuffle",
    "psum",
    "psum_scatter",
    "pvary",
    "ragged_all_to_all",
    "typeof",
    "vma",
]
