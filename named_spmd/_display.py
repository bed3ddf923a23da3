"""Text and HTML renderings: the ``visualize`` entry point and the ``RENDERERS`` registry.

``RENDERERS`` holds the renderers of value types, specs, meshes, communication tables and check
reports; the value types reach them through ``_types.render`` (this module is a higher layer:
it registers them in ``_types.RENDERERS`` when the package loads). Every view is an object with ``__repr__`` / ``__str__`` (a terminal) and
``_repr_html_`` (Jupyter), so ``ns.visualize(...)`` as the last line of a cell renders as a table
and ``print(...)`` of it as aligned text. The layout and mesh views themselves are ``_views``'.
"""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from . import _types
from ._accounting import CommEvent
from ._errors import SpecError
from ._mesh import Mesh
from ._spec import PartitionSpec
from ._types import VType, short_dtype, vma_text
from ._views import Layout, MeshView, mesh_html

# --- public entry point --------------------------------------------------------------------------


def _shape_and_dtype(x: Any) -> tuple[tuple[int, ...], torch.dtype | None]:
    if isinstance(x, torch.Tensor):
        return tuple(x.shape), x.dtype
    shape = getattr(x, "shape", None)
    if shape is not None and not isinstance(x, Mesh):  # ShapeDtype, numpy arrays
        return tuple(int(s) for s in shape), getattr(x, "dtype", None) if isinstance(
            getattr(x, "dtype", None), torch.dtype
        ) else None
    if isinstance(x, int):
        return (x,), None
    if isinstance(x, Sequence) and all(isinstance(s, int) for s in x):
        return tuple(x), None
    raise SpecError(
        f"visualize: expected a tensor, a shape (tuple of ints), a ShapeDtype or a Mesh, got "
        f"{type(x).__name__}. Fix: e.g. ns.visualize((8, 16), mesh, P('dp', 'tp'))."
    )


def visualize(
    x: Any, mesh: Mesh | None = None, spec: PartitionSpec | None = None, *, max_blocks: int = 8
) -> Layout | MeshView:
    """Show which mesh instance holds which block of a global tensor.

    Args:
        x: a tensor, a shape such as ``(8, 16)``, a ``ShapeDtype``, or a ``Mesh`` (then the mesh
            grid itself is shown and ``mesh`` / ``spec`` are not needed).
        mesh: the mesh.
        spec: how the tensor is split (default ``P()``: replicated).
        max_blocks: rows and columns beyond this are elided in the middle.

    Returns:
        A view: ``print(view)`` draws a text table; as the last expression of a Jupyter cell it
        renders as a coloured HTML table. ``view.block_of(coords)`` and ``view.holders(block)``
        answer the same questions programmatically.

    Example:
        >>> import named_spmd as ns
        >>> mesh = ns.make_mesh((2, 2), ("dp", "tp"))
        >>> print(ns.visualize((4, 6), mesh, ns.P("dp")))
        [4,6] as P('dp') on Mesh(dp=2, tp=2; simulated): each of 4 instances holds [2,6]
        dim 0   [:]
        [0:2]   dp=0
        [2:4]   dp=1
        replicated over tp: each block is held by 2 instances (every coordinate along that axis)
    """
    if isinstance(x, Mesh):
        return MeshView(x, max_blocks)
    if not isinstance(mesh, Mesh):
        raise SpecError(
            f"visualize: mesh= must be a named_spmd Mesh, got {type(mesh).__name__}. "
            "Fix: ns.visualize(x, ns.make_mesh((2, 4), ('dp', 'tp')), P('dp'))."
        )
    spec = PartitionSpec() if spec is None else spec
    if not isinstance(spec, PartitionSpec):
        raise SpecError(f"visualize: spec must be a P(...), got {spec!r}. Fix: e.g. P('dp').")
    shape, dtype = _shape_and_dtype(x)
    return Layout(shape, mesh, spec, dtype, max_blocks)


# --- types, specs, communication, check reports --------------------------------------------------


def vtype_html(t: VType) -> str:
    """``f32[8,4]{dp}`` with the varying axes highlighted."""
    dims = ",".join(map(str, t.shape))
    axes = vma_text(t.vma, t.axis_order)
    tip = f"varies over {', '.join(sorted(t.vma))}" if t.vma else "invariant over every mesh axis"
    return (
        f'<code title="{html.escape(tip)}">{short_dtype(t.dtype)}[{dims}]'
        f'<span style="color:#b03060">{html.escape(axes)}</span></code>'
    )


def spec_text(spec: PartitionSpec) -> str:
    """One phrase per dim: ``dim 0 split over dp; dim 1 whole``."""
    if not spec:
        return "replicated: every instance holds the whole tensor"
    parts = []
    for d in range(len(spec)):
        axes = spec.entry_axes(d)
        parts.append(f"dim {d} split over {' x '.join(axes)}" if axes else f"dim {d} whole")
    return "; ".join(parts) + "; later dims whole"


def spec_html(spec: PartitionSpec) -> str:
    return f'<code title="{html.escape(spec_text(spec))}">{html.escape(repr(spec))}</code>'


@dataclass
class _Row:
    direction: str
    op: str
    axes: tuple[str, ...]
    count: int
    nbytes: int


def _comm_rows(events: Iterable[CommEvent]) -> list[_Row]:
    rows: dict[tuple, _Row] = {}
    for e in events:
        name = e.op + (" (implicit pvary)" if e.implicit else "")
        key = (0 if e.direction == "forward" else 1, name, e.axes)
        row = rows.setdefault(key, _Row(e.direction, name, e.axes, 0, 0))
        row.count += 1
        row.nbytes += e.nbytes
    return [rows[k] for k in sorted(rows)]


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def comm_text(events: Iterable[CommEvent]) -> str:
    """The communication as an aligned text table, forward rows first."""
    rows = _comm_rows(events)
    head = ("direction", "collective", "axes", "count", "bytes / instance")
    body = [(r.direction, r.op, ",".join(r.axes), str(r.count), _bytes(r.nbytes)) for r in rows]
    if not body:
        return "(no collectives)"
    widths = [max(len(h), *(len(b[i]) for b in body)) for i, h in enumerate(head)]
    lines = ["  ".join(v.ljust(w) for v, w in zip(head, widths))]
    lines += ["  ".join(v.ljust(w) for v, w in zip(b, widths)) for b in body]
    return "\n".join(line.rstrip() for line in lines)


def comm_html(events: Iterable[CommEvent]) -> str:
    """The communication of a CommMode (or a check) as an HTML table, forward then backward."""
    e = html.escape
    cell = "padding:2px 8px;border:1px solid #888;font-family:monospace"
    head = "".join(
        f'<th style="{cell}">{h}</th>'
        for h in ("direction", "collective", "axes", "count", "bytes / instance")
    )
    out = [f'<table style="border-collapse:collapse"><tr>{head}</tr>']
    rows = _comm_rows(events)
    for r in rows:
        color = "#e8f0ff" if r.direction == "forward" else "#fff0e0"
        vals = (r.direction, r.op, ",".join(r.axes), str(r.count), _bytes(r.nbytes))
        out.append(
            f'<tr style="background:{color};color:#000">'
            + "".join(f'<td style="{cell}">{e(v)}</td>' for v in vals)
            + "</tr>"
        )
    if not rows:
        out.append(f'<tr><td style="{cell}" colspan="5">(no collectives)</td></tr>')
    out.append("</table>")
    return "".join(out)


def check_report_text(report: Any) -> str:
    lines = [
        f"check of {report.fn_label} on {report.mesh!r}, {report.mesh.size} instances",
        "outputs (per instance -> global):",
    ]
    for o in report.outputs:
        glob = f"{short_dtype(o.type.dtype)}[{','.join(map(str, o.global_shape))}]"
        lines.append(f"  {o.path:<14} {o.type!r:<24} {o.spec!r:<20} -> {glob}")
    if not report.outputs:
        lines.append("  (no tensor outputs)")
    lines.append("communication per instance:")
    lines.append(comm_text(report.events))
    return "\n".join(lines)


def check_report_html(report: Any) -> str:
    e = html.escape
    cell = "padding:2px 8px;border:1px solid #888;font-family:monospace"
    rows = "".join(
        f'<tr><td style="{cell}">{e(o.path)}</td><td style="{cell}">{vtype_html(o.type)}</td>'
        f'<td style="{cell}">{spec_html(o.spec)}</td><td style="{cell}">'
        f"{short_dtype(o.type.dtype)}[{','.join(map(str, o.global_shape))}]</td></tr>"
        for o in report.outputs
    )
    head = "".join(
        f'<th style="{cell}">{h}</th>' for h in ("output", "per instance", "out_spec", "global")
    )
    return (
        f'<div class="named-spmd-check"><div><b>check of {e(report.fn_label)}</b> on '
        f"{e(repr(report.mesh))}, {report.mesh.size} instances</div>"
        f'<table style="border-collapse:collapse"><tr>{head}</tr>{rows}</table>'
        f"<div>communication per instance:</div>{comm_html(report.events)}</div>"
    )


# registered with _types, which value types render through
RENDERERS: dict[str, Callable[[Any], str]] = {
    "vtype_html": vtype_html,
    "mesh_html": mesh_html,
    "spec_html": spec_html,
    "comm_html": comm_html,
    "comm_text": comm_text,
    "check_text": check_report_text,
    "check_html": check_report_html,
}
_types.RENDERERS.update(RENDERERS)

__all__ = [
    "RENDERERS",
    "Layout",
    "MeshView",
    "comm_html",
    "comm_text",
    "mesh_html",
    "spec_html",
    "visualize",
    "vtype_html",
]
