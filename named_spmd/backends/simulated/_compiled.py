"""A compiled function called inside the per-device function on the simulated mesh.

Dynamo cannot trace a compiled function under the simulation's vmap levels (it raises
"Unsupported functorch tracing attempt"; ``torch.func.vmap(compiled_fn)`` from eager is refused
too). The simulated backend therefore runs such pieces uncompiled, with the same numbers as an
uncompiled piece: the first call that meets the refusal runs again under
``torch.compiler.set_stance("force_eager")`` (compiled functions run their original code), and
the mapped function is remembered, so that its later calls take that stance at once. The stance
costs tens of microseconds per call, paid only by such functions.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from ..._torch_private import is_dynamo_refusal

_EAGER: dict[
    int, Any
] = {}  # id(fn) -> fn (kept alive: its id stays unique) whose pieces run eagerly


def _refused(error: BaseException | None) -> bool:
    seen = 0
    while error is not None and seen < 8:  # the explained SpmdError carries torch's as its cause
        if is_dynamo_refusal(error):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def compiled_pieces_eagerly(run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` that runs compiled functions inside the per-device function uncompiled."""

    @functools.wraps(run)
    def run_pieces_eagerly(call):
        fn = call.fn
        if torch.compiler.is_compiling():  # a refusal is the trace's (no stance switch inside it)
            return run(call)
        if id(fn) in _EAGER:
            with torch.compiler.set_stance("force_eager"):
                return run(call)
        try:
            return run(call)
        except Exception as error:
            if not _refused(error):
                raise
        _EAGER[id(fn)] = fn
        with torch.compiler.set_stance("force_eager"):
            return run(call)

    return run_pieces_eagerly
