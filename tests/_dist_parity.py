"""Checks of tests/dist_worker.py that the simulated mesh agrees with a real one on a sum of
-0.0s, a negative view, a deep copy of a replicated leaf that requires grad and an op vmap runs
through its fallback: the real mesh's values (and signs, types, gradients) against the
simulated mesh's, in the same process; the simulated side also against a dense reference."""

from __future__ import annotations

import copy
import warnings

import torch

import named_spmd as ns
from named_spmd import P


def _global(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _both(mesh, fn, in_specs, out_specs, *args) -> dict:
    """``fn``'s global result on the real mesh and on a simulated one of its shape, each with
    the warnings its call raised (an exception is reported under its name)."""
    simulated = ns.make_mesh(tuple(mesh.shape.values()), mesh.axis_names, simulated=True)
    got = {}
    for name, m in (("real", mesh), ("simulated", simulated)):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                out = _global(
                    ns.spmd_map(fn, mesh=m, in_specs=in_specs, out_specs=out_specs)(*args)
                )
            except Exception as e:  # noqa: BLE001 - what it raised is the outcome
                out = f"{type(e).__name__}: {e}"
        got[name] = (out, [str(w.message)[:120] for w in caught])
    return got


def _problems(got: dict, want: torch.Tensor) -> list[str]:
    problems = []
    for name, (out, caught) in got.items():
        if caught:
            problems.append(f"{name} warned: {caught}")
        if not isinstance(out, torch.Tensor):
            problems.append(f"{name} raised {out}")
            continue
        signs = [torch.signbit(torch.view_as_real(t) if t.is_complex() else t) for t in (out, want)]
        if out.dtype != want.dtype or not torch.equal(out, want) or not torch.equal(*signs):
            problems.append(f"{name}: {out} != {want} (signs {signs[0]} != {signs[1]})")
    return problems


def _negative_zero_sums(mesh, world) -> dict:
    x = torch.zeros(world, 3).neg()  # -0.0 everywhere, but a +0.0 and a 1 in two columns
    x[0, 1], x[1, 2] = 0.0, 1.0
    axes = ("dp", "tp")
    want = x.sum(0, keepdim=True)
    want[0, 0] = -0.0  # IEEE: a sum of -0.0s is -0.0 (torch.sum starts from +0.0)
    problems = []
    for name, fn, scale in (("psum", ns.psum, 1), ("pmean", ns.pmean, world)):
        got = _both(mesh, lambda v, f=fn: f(v, axes), P(axes), P(), x)
        problems += [f"{name}: {p}" for p in _problems(got, want / scale)]
    scatter = _both(
        mesh,
        lambda v: ns.psum_scatter(ns.pvary(v, axes), axes, tiled=True),
        P(),
        P(axes),
        x[0].repeat(world),
    )
    problems += [f"psum_scatter: {p}" for p in _problems(scatter, x[0].repeat(world) * world)]
    return {"check": "a sum of -0.0s is -0.0", "problems": problems}


def _negative_view(mesh, world) -> dict:
    c = torch.complex(torch.arange(2.0 * world), torch.arange(2.0 * world) - world)

    def prog(v):
        imag = v.conj().imag  # a negative view (is_neg): vmap has no batching rule of its own
        return torch.cat([ns.psum(imag * 2, ("dp", "tp")), imag.add(1)])

    blocks = c.conj().imag.chunk(world)
    want = torch.cat([torch.cat([sum(b * 2 for b in blocks), b + 1]) for b in blocks])
    got = _both(mesh, prog, P(("dp", "tp")), P(("dp", "tp")), c)
    return {"check": "a negative view inside the function", "problems": _problems(got, want)}


def _fallback_ops(mesh, world) -> dict:
    x = torch.eye(2).repeat(world, 1)  # each block: [[1, 0], [0, 1]]

    def prog(v):
        return torch.cat([torch.argwhere(v).float(), v.masked_scatter(v > 0, v * 3)])

    want = torch.cat([prog(b) for b in x.chunk(world)])
    got = _both(mesh, prog, P(("dp", "tp")), P(("dp", "tp")), x)
    return {
        "check": "ops vmap runs through its fallback, unwarned",
        "problems": _problems(got, want),
    }


def _deep_copy_of_a_replicated_leaf(mesh) -> dict:
    def prog(v):
        return copy.deepcopy(v) * 2 + v  # the copy is a new leaf: no gradient through it

    problems, grads = [], {}
    simulated = ns.make_mesh(tuple(mesh.shape.values()), mesh.axis_names, simulated=True)
    for name, m in (("real", mesh), ("simulated", simulated)):
        w = torch.tensor([1.0, -2.0, 3.0], requires_grad=True)
        try:
            out = _global(ns.spmd_map(prog, mesh=m, in_specs=P(), out_specs=P())(w))
            out.sum().backward()
        except Exception as e:  # noqa: BLE001 - what it raised is the outcome
            problems.append(f"{name} raised {type(e).__name__}: {e}")
            continue
        if not out.requires_grad or not torch.equal(out, 3 * w.detach()):
            problems.append(f"{name}: {out}")
        grads[name] = w.grad
    if len(grads) == 2 and not torch.equal(grads["real"], grads["simulated"]):
        problems.append(f"gradients differ: {grads}")
    return {"check": "copy.deepcopy of a replicated leaf", "problems": problems}


def parity_checks(mesh, world) -> list[dict]:
    """The checks above on ``mesh`` (axes ``dp`` and ``tp``, ``world`` ranks)."""
    return [
        _negative_zero_sums(mesh, world),
        _negative_view(mesh, world),
        _fallback_ops(mesh, world),
        _deep_copy_of_a_replicated_leaf(mesh),
    ]
