"""The sampled cases that the multi-process tests run on both backends: cases of the one sampler,
tests/_sampler.py, on meshes of the world's size (the fixed programs are in the one catalogue,
tests/_programs.py).

:mod:`dist_worker` runs each case on a simulated mesh and on the real one in the same process
and compares values, gradients, taps and communication counts. Every rank rebuilds the same cases
from the seed. A case's program checks the vma of every value against the sampler's model and
taps the type (``ns.typeof``: per-device shape and vma) of every tensor value, so the backends
must agree on the types of all intermediate values, not only on the output's.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from _sampler import check_model, make_case, run

import named_spmd as ns

TAPE: list[str] = []


@dataclass
class Case:
    name: str
    sizes: tuple[int, ...]
    names: tuple[str, ...]
    in_specs: Any
    out_specs: Any
    prog: Callable[..., Any]
    args: Callable[[], tuple]  # the global arguments (deterministic)
    dtensor_inputs: bool = False  # also run with DTensor inputs on the real mesh
    sampled: Any = None  # the sampler's case (tests/_sampler.py)

    @property
    def world(self) -> int:
        return math.prod(self.sizes)


def _check_and_tap(case, pool: list) -> None:
    check_model(case, pool)
    TAPE.extend(repr(ns.typeof(v)) for v in pool if isinstance(v, torch.Tensor))


def sampled_cases(world: int, count: int, seed: int) -> list[Case]:
    """``count`` cases of the sampler on meshes of ``world`` instances: seeds seed, seed+1, ..."""
    cases = []
    for k in range(count):
        case = make_case(seed + k, world=world)
        cases.append(
            Case(
                f"sampled_{k}_seed{case.seed}",
                case.sizes,
                case.names,
                case.in_specs,
                case.out_specs,
                functools.partial(run, ns, case, on_values=functools.partial(_check_and_tap, case)),
                lambda case=case: case.args,
                dtensor_inputs=k % 3 == 0,
                sampled=case,
            )
        )
    return cases


__all__ = ["Case", "TAPE", "sampled_cases"]
