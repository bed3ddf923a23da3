"""A piece of the per-device function compiled inside an eager call on a real mesh
(``ns.compile``, ``_compile.py``; docs/design.md section 7).

Dynamo traces ``_piece_body``: the call's twin (``CompiledContext.twin``: the compile path's
context sharing the eager call's token) made the active call, and ``CompiledVmaMode`` typing
every op, so the piece's collectives and implicit pvarys are functional collectives in its graph.
The eager call's own torch function modes are lifted off the stack around the compiled function:
torch runs compiled code under the modes active around it, which would type the graph's own
buffers again.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch

from .. import _calls
from .. import _torch_private as torch_private
from .._accounting import recording
from .._stamps import TrackedContext
from .._traced import CompiledVmaMode
from ._dist_compile import CompiledContext


def run_piece(ctx: TrackedContext, piece: Any, args: tuple, kwargs: dict) -> Any:
    """``piece`` (an ``ns.compile``) called in the eager call ``ctx``: compiled once per input
    types (Dynamo guards on the mesh, the inputs' types, block records and shapes, not on the
    call), and run with the call's own torch function modes off the stack, so that its graph
    runs under none of them (so the ppermute results a replay deferred are made first: the
    piece may read them, unseen by the call's modes)."""
    if ctx.deferred:
        ctx.make_deferred()
    if recording():  # under a CommMode: uncompiled, so that every collective is counted
        return piece.fn(*args, **kwargs)
    if piece.in_call is None:
        piece.in_call = torch.compile(functools.partial(_piece_body, piece.fn), **piece.options)
    torch_private.route_view_attributes_to_modes()
    with _calls.without_call_modes(ctx):
        return piece.in_call(ctx, *args, **kwargs)


def _piece_body(fn: Callable[..., Any], ctx: TrackedContext, *args: Any, **kwargs: Any) -> Any:
    """What Dynamo traces for a piece: the call's twin active, its mode typing every op."""
    twin = CompiledContext.twin(ctx)
    _calls.push(twin)
    try:
        with CompiledVmaMode(twin):
            return fn(*args, **kwargs)
    finally:
        _calls.pop()
