"""The ``dtypes`` scenario of tests/faults_worker.py: every dtype torch has through every
collective, compared by tests/test_faults.py with the simulated mesh."""

from __future__ import annotations

import json
import warnings

import torch
from _faults_common import good_call, report

import named_spmd as ns
from named_spmd import P

A = ("dp", "tp")
# quantized dtypes need a quantizer (a view of bytes is no valid quantized tensor) and their
# creation functions are deprecated: the one group of torch dtypes left out
QUANTIZED = frozenset(
    d for d in vars(torch).values() if isinstance(d, torch.dtype) and str(d)[6:7] == "q"
)
DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)} - QUANTIZED, key=str
)
# name -> (function, in_specs, out_specs, check_vma): each collective, a single-axis group, and
# the call boundary's own communication (a broadcast without check_vma, a non-mesh-order spec)
DTYPE_PROGRAMS = {
    "psum": (lambda x: ns.psum(x, A), P(A), P(), True),
    "psum_tp": (lambda x: ns.psum(x, "tp"), P(A), P("dp"), True),
    "pmean": (lambda x: ns.pmean(x, A), P(A), P(), True),
    "pmax": (lambda x: ns.pmax(x, A), P(A), P(), True),
    "pmin": (lambda x: ns.pmin(x, A), P(A), P(), True),
    "psum_scatter": (lambda x: ns.psum_scatter(x, A, tiled=True), P(A), P(A), True),
    "all_gather": (lambda x: ns.all_gather(x, A, tiled=True, to="invariant"), P(A), P(), True),
    "all_to_all": (lambda x: ns.all_to_all(x, A, 0, 0, tiled=True), P(A), P(A), True),
    "ppermute": (
        lambda x: ns.ppermute(x, A, [(i, (i + 1) % 4) for i in range(3)]),
        P(A),
        P(A),
        True,
    ),
    "pshuffle": (lambda x: ns.pshuffle(x, A, [2, 0, 3, 1]), P(A), P(A), True),
    "pbroadcast": (lambda x: ns.pbroadcast(x, A, 2), P(A), P(), True),
    "unchecked_broadcast": (lambda x: x, P(A), P(), False),
    "reordered": (lambda x: x, P(("tp", "dp")), P(("tp", "dp")), True),
}


# every case, and each complex dtype's again on a conjugate view (``x.conj()``, the conj bit
# set: torch has no real or byte view of one) as the collective's operand
CONJUGATED = " of x.conj()"
DTYPE_CASES = [(d, name) for d in DTYPES for name in DTYPE_PROGRAMS] + [
    (d, name + CONJUGATED) for d in DTYPES if d.is_complex for name in DTYPE_PROGRAMS
]


def dtype_input(dtype: torch.dtype) -> torch.Tensor:
    """16 elements of ``dtype``: small integers (exact sums in every float dtype, int8 sums
    that wrap), a pattern of truth values, or bytes viewed as a dtype that has no conversion."""
    base = (torch.arange(16) * 5 + 3) % 64
    if dtype is torch.bool:
        return base % 3 == 0
    try:
        with warnings.catch_warnings():  # torch's own note on complex32
            warnings.filterwarnings("ignore", "ComplexHalf support is experimental")
            return base.to(dtype)
    except (RuntimeError, TypeError):
        size = torch.empty(0, dtype=dtype).element_size()
        return torch.arange(16 * size, dtype=torch.uint8).mul(37).view(dtype)


def program(name: str) -> tuple:
    """``DTYPE_PROGRAMS``' entry of a case's name, its function taking ``x.conj()`` where the
    name says so."""
    fn, in_spec, out_spec, check_vma = DTYPE_PROGRAMS[name.removesuffix(CONJUGATED)]
    if name.endswith(CONJUGATED):
        fn = lambda x, fn=fn: fn(x.conj())  # noqa: E731
    return fn, in_spec, out_spec, check_vma


def case_input(dtype: torch.dtype, name: str) -> torch.Tensor:
    """``dtype_input``; for a conjugated case, with an imaginary part of no zeros: conjugated,
    no -0.0 (whose sum's sign differs between gloo and torch.sum, conjugates or not)."""
    x = dtype_input(dtype)
    return (x.to(torch.complex128) * (1 + 1j)).to(dtype) if name.endswith(CONJUGATED) else x


def dtype_call(mesh, dtype: torch.dtype, name: str):
    fn, in_spec, out_spec, check_vma = program(name)
    f = ns.spmd_map(fn, mesh=mesh, in_specs=in_spec, out_specs=out_spec, check_vma=check_vma)
    return f(case_input(dtype, name))


def described(t: torch.Tensor) -> dict:
    """A tensor as JSON: dtype, shape and its bytes (exact for every dtype, NaN payloads too)."""
    raw = t.detach().resolve_conj().contiguous().reshape(-1).view(torch.uint8)
    return {"dtype": str(t.dtype), "shape": list(t.shape), "bytes": raw.numpy().tobytes().hex()}


def dtypes(mesh, rank):
    """Every case on the real mesh: this rank's block, or the error (compared by the test with
    the simulated mesh's result); then a float psum, which must run (the mesh stays in step)."""
    for dtype, name in DTYPE_CASES:
        try:
            out = {"value": described(ns.to_local(dtype_call(mesh, dtype, name)))}
        except Exception as e:  # noqa: BLE001 - a bare torch error is a finding too
            out = {"error": type(e).__name__, "message": str(e)}
        line = {"rank": rank, "phase": "dtype", "dtype": str(dtype), "op": name, **out}
        print("OUTCOME " + json.dumps(line), flush=True)
    report(rank, "dtypes_then", lambda: good_call(mesh))
