"""Every public docstring example runs and prints what it shows (doctest)."""

import doctest
import importlib

import pytest

MODULES = [
    "named_spmd._collectives._record",
    "named_spmd._collectives.reductions",
    "named_spmd._collectives.movement",
    "named_spmd._collectives.permutes",
    "named_spmd._collectives.ragged",
    "named_spmd._collectives.typing",
    "named_spmd._api",
    "named_spmd._accounting",
    "named_spmd.backends.simulated",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(
        importlib.import_module(name), optionflags=doctest.NORMALIZE_WHITESPACE
    )
    assert result.failed == 0
    assert result.attempted > 0


def test_collective_docstrings_start_with_their_type():
    import named_spmd as ns

    for fn in (
        ns.psum,
        ns.pmean,
        ns.pmax,
        ns.pmin,
        ns.all_gather,
        ns.psum_scatter,
        ns.all_to_all,
        ns.ragged_all_to_all,
        ns.ppermute,
        ns.pshuffle,
        ns.pbroadcast,
        ns.pvary,
        ns.axis_index,
        ns.axis_size,
    ):
        first = fn.__doc__.strip().splitlines()[0]
        assert first.startswith(f"``{fn.__name__}("), first
        if fn not in (ns.axis_index, ns.axis_size):
            assert "Backward:" in fn.__doc__ and "Example:" in fn.__doc__, fn.__name__
