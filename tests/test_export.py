"""Strict ``torch.export`` (Dynamo) of a module calling a mapped function: no side effect of the
library's warned of (the call pushes its context and its torch-function modes and pops them;
its specs keep no memo written in the trace), so it exports with warnings as errors, and the
exported module computes the eager call's values on other inputs, on the simulated mesh and on
a real mesh of one gloo process (tests/export_worker.py); so does a mapped method that reads its
module's parameters."""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from _dist_launch import launch  # noqa: E402
from export_worker import (  # noqa: E402
    SPECS,
    Model,
    dense,
    exported,
    exported_module,
    inputs,
    megatron,
    method_dense,
    method_model,
)

import named_spmd as ns  # noqa: E402
from named_spmd import P  # noqa: E402


@pytest.mark.parametrize("shape", [(2, 2), (1, 1)])
def test_a_strict_export_on_the_simulated_mesh_warns_of_nothing_and_equals_eager(shape):
    mesh = ns.make_mesh(shape, ("dp", "tp"))
    f = ns.spmd_map(megatron, mesh=mesh, in_specs=SPECS, out_specs=P("dp"))
    module = exported(f)
    for seed in (0, 1):
        args = inputs(seed)
        got = module(*args)
        torch.testing.assert_close(got, Model(f)(*args), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, dense(*args) * 2, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("shape", [(2, 2), (1, 1)])
def test_a_strict_export_of_a_mapped_method_reading_parameters_equals_eager(shape):
    """The method reads ``self.w1``... (not arguments): Dynamo meets each parameter first inside
    the call's vmap levels, where functorch refuses its export-time copy's ``requires_grad_``."""
    model = method_model(ns.make_mesh(shape, ("dp", "tp")))
    module = exported_module(model, inputs(0)[:1])
    for seed in (0, 1):
        x = inputs(seed)[0]
        got = module(x)
        torch.testing.assert_close(got, model(x), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(got, method_dense(model, x), rtol=1e-12, atol=1e-12)
    # the parameters are the exported program's: their gradient flows through it
    x = inputs(1)[0]
    want = torch.autograd.grad(method_dense(model, x).sum(), list(model.parameters()))
    got = torch.autograd.grad(module(x).sum(), list(module.parameters()))
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)


@pytest.mark.distributed
def test_a_strict_export_on_a_real_mesh_of_one_rank_warns_of_nothing_and_equals_eager():
    finished = launch([os.path.join("tests", "export_worker.py")], 1, 300)
    assert not finished.timed_out and finished.returncodes == [0], finished.outputs[0][-3000:]
    (outcome,) = [json.loads(line) for line in finished.lines("EXPORT")]
    assert outcome["worst"] < 1e-12 and outcome["method"] < 1e-12, outcome
