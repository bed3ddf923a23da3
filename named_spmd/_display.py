"""Text and HTML views: which instance holds which block, meshes, types, communication.

Every view is an object with ``__repr__`` / ``__str__`` (a terminal) and ``_repr_html_`` (Jupyter),
so ``ns.visualize(...)`` as the last line of a cell renders as a table and ``print(...)`` of it as
aligned text. Large meshes are elided in the middle (first and last blocks shown), so a view of a
4096-instance layout stays small.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._errors import SpecError, bullet_list
from ._mesh import Mesh
from ._spec import PartitionSpec, spec_problems
from ._types import VType, short_dtype, vma_text

_ELLIPSIS = -1  # marks an elided run of rows or columns


def _shown(n: int, limit: int) -> list[int]:
    """Indices 0..n-1 to display, with one _ELLIPSIS in place of the middle when n > limit."""
    if n <= limit:
        return list(range(n))
    return list(range(limit - 3)) + [_ELLIPSIS, n - 2, n - 1]


def _color(i: int) -> str:
    """A pastel colour per index (golden-angle hues: neighbours differ)."""
    return f"hsl({(i * 137.508) % 360:.0f}, 65%, 85%)"


def _unravel(index: int, sizes: Sequence[int]) -> list[int]:
    """Row-major coordinates of ``index`` in a grid of ``sizes`` (first size major)."""
    out = []
    for size in reversed(sizes):
        index, c = divmod(index, size)
        out.append(c)
    return out[::-1]


def _text_table(corner: str, cols: list[str], rows: list[tuple[str, list[str]]]) -> str:
    widths = [max(len(corner), *(len(r[0]) for r in rows))]
    for j, c in enumerate(cols):
        widths.append(max(len(c), *(len(r[1][j]) for r in rows)))
    lines = ["  ".join(s.ljust(w) for s, w in zip([corner, *cols], widths)).rstrip()]
    for head, cells in rows:
        lines.append("  ".join(s.ljust(w) for s, w in zip([head, *cells], widths)).rstrip())
    return "\n".join(lines)


def _html_table(corner: str, cols: list[str], rows: list[tuple[str, list[tuple[str, str, str]]]]):
    """rows: (header, [(text, background colour, tooltip)])."""
    e = html.escape
    cell = "padding:4px 8px;border:1px solid #888;text-align:center;font-family:monospace"
    out = [
        '<table style="border-collapse:collapse">',
        "<tr>",
        f'<th style="{cell}">{e(corner)}</th>',
    ]
    out += [f'<th style="{cell}">{e(c)}</th>' for c in cols]
    out.append("</tr>")
    for head, cells in rows:
        out.append(f'<tr><th style="{cell}">{e(head)}</th>')
        for text, color, tip in cells:
            out.append(
                f'<td style="{cell};background:{color};color:#000" title="{e(tip)}">{e(text)}</td>'
            )
        out.append("</tr>")
    out.append("</table>")
    return "".join(out)


# --- which instance holds which block ------------------------------------------------------------


class Layout:
    """How a global tensor of ``shape`` is laid out over ``mesh`` by ``spec``.

    ``str(layout)`` is a text table, ``layout._repr_html_()`` a coloured HTML table: one cell
    per block, labelled with the mesh coordinates of the instances that hold it (axes the spec
    does not name hold copies: every coordinate along them holds the same block).
    """

    def __init__(
        self,
        shape: Sequence[int],
        mesh: Mesh,
        spec: PartitionSpec,
        dtype: torch.dtype | None = None,
        max_blocks: int = 8,
    ):
        self.shape = tuple(int(s) for s in shape)
        self.mesh = mesh
        self.spec = spec
        self.dtype = dtype
        self.max_blocks = max(4, max_blocks)
        problems = spec_problems(spec, self.shape, mesh.shape, "visualize")
        if problems:
            raise SpecError(
                f"visualize: {spec!r} does not fit shape {list(self.shape)}:\n"
                + bullet_list(problems)
            )
        self.blocks = tuple(mesh.axis_size(spec.entry_axes(d)) for d in range(len(self.shape)))
        self.local_shape = tuple(s // b for s, b in zip(self.shape, self.blocks))
        self.replicated = tuple(a for a in mesh.axis_names if a not in spec.axes)

    # --- queries (also what the views are drawn from) ---------------------------------------
    def block_of(self, coords: dict[str, int]) -> tuple[slice, ...]:
        """The global slices that the instance at mesh coordinates ``coords`` holds."""
        out = []
        for d, local in enumerate(self.local_shape):
            b = 0
            for a in self.spec.entry_axes(d):
                b = b * self.mesh.shape[a] + coords[a]
            out.append(slice(b * local, (b + 1) * local))
        return tuple(out)

    def block_coords(self, block: Sequence[int]) -> dict[str, int]:
        """Coordinates on the spec's axes of the instances holding block index ``block``."""
        coords: dict[str, int] = {}
        for d, b in enumerate(block):
            axes = self.spec.entry_axes(d)
            coords.update(zip(axes, _unravel(b, [self.mesh.shape[a] for a in axes])))
        return coords

    def holders(self, block: Sequence[int]) -> list[int]:
        """Row-major linear indices of every instance holding block index ``block``."""
        fixed = self.block_coords(block)
        free = [a for a in self.mesh.axis_names if a not in fixed]
        out = []
        for k in range(math.prod(self.mesh.shape[a] for a in free)):
            coords = dict(fixed, **dict(zip(free, _unravel(k, [self.mesh.shape[a] for a in free]))))
            linear = 0
            for a in self.mesh.axis_names:
                linear = linear * self.mesh.shape[a] + coords[a]
            out.append(linear)
        return sorted(out)

    # --- drawing ---------------------------------------------------------------------------
    def _grid(self):
        """Row and column dims, and their displayed block indices."""
        rank = len(self.shape)
        row_dims = [0] if rank >= 2 else []
        col_dims = list(range(1 if rank >= 2 else 0, rank))
        nrows = math.prod(self.blocks[d] for d in row_dims)
        ncols = math.prod(self.blocks[d] for d in col_dims)
        return row_dims, col_dims, _shown(nrows, self.max_blocks), _shown(ncols, self.max_blocks)

    def _slice_text(self, dims: list[int], index: int) -> str:
        if not dims:
            return "all"
        parts = []
        for d, b in zip(dims, _unravel(index, [self.blocks[d] for d in dims])):
            step = self.local_shape[d]
            parts.append(f"{b * step}:{(b + 1) * step}" if self.blocks[d] > 1 else ":")
        return ", ".join(parts)

    def _cell(self, row_dims, col_dims, r, c) -> tuple[str, int, dict[str, int]]:
        block = [0] * len(self.shape)
        for d, b in zip(row_dims, _unravel(r, [self.blocks[d] for d in row_dims])):
            block[d] = b
        for d, b in zip(col_dims, _unravel(c, [self.blocks[d] for d in col_dims])):
            block[d] = b
        coords = self.block_coords(block)
        label = " ".join(f"{a}={coords[a]}" for a in self.mesh.axis_names if a in coords)
        linear = 0
        for d, b in enumerate(block):
            linear = linear * self.blocks[d] + b
        return label or "every instance", linear, coords

    def _rows(self):
        row_dims, col_dims, rows, cols = self._grid()
        corner = " \\ ".join(
            "dim " + ",".join(map(str, dims)) for dims in (row_dims, col_dims) if dims
        )
        col_heads = [
            "…" if c == _ELLIPSIS else ("[" + self._slice_text(col_dims, c) + "]") for c in cols
        ]
        body = []
        for r in rows:
            head = "⋮" if r == _ELLIPSIS else f"[{self._slice_text(row_dims, r)}]" * bool(row_dims)
            cells = []
            for c in cols:
                if _ELLIPSIS in (r, c):
                    cells.append(("⋮" if r == _ELLIPSIS else "…", None, None))
                else:
                    cells.append(self._cell(row_dims, col_dims, r, c))
            body.append((head, cells))
        return corner, col_heads, body

    def title(self) -> str:
        dt = short_dtype(self.dtype) if self.dtype is not None else ""
        local = f"{dt}[{','.join(map(str, self.local_shape))}]"
        return (
            f"{dt}[{','.join(map(str, self.shape))}] as {self.spec!r} on {self.mesh!r}: "
            f"each of {self.mesh.size} instances holds {local}"
        )

    def footer(self) -> str:
        if not self.replicated:
            return "every instance holds a different block"
        copies = self.mesh.axis_size(self.replicated)
        return (
            f"replicated over {', '.join(self.replicated)}: each block is held by {copies} "
            f"instance{'s' if copies > 1 else ''} (every coordinate along "
            f"{'that axis' if len(self.replicated) == 1 else 'those axes'})"
        )

    def __str__(self) -> str:
        corner, cols, body = self._rows()
        rows = [(head, [c[0] for c in cells]) for head, cells in body]
        return f"{self.title()}\n{_text_table(corner, cols, rows)}\n{self.footer()}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        corner, cols, body = self._rows()
        rows = []
        for head, cells in body:
            row = []
            for label, linear, coords in cells:
                if linear is None:
                    row.append((label, "#fff", ""))
                    continue
                ids = self._holder_ids(coords)
                row.append((label, _color(linear), f"instances {ids}"))
            rows.append((head, row))
        e = html.escape
        return (
            f'<div class="named-spmd-layout"><div><b>{e(self.title())}</b></div>'
            f"{_html_table(corner, cols, rows)}<div><i>{e(self.footer())}</i></div></div>"
        )

    def _holder_ids(self, coords: dict[str, int]) -> str:
        """Tooltip text: linear ids of the holders (the first few for large meshes)."""
        free = math.prod(self.mesh.shape[a] for a in self.replicated)
        if free > 16:
            return f"{free} instances with {coords}"
        block = [0] * len(self.shape)
        for d in range(len(self.shape)):
            axes = self.spec.entry_axes(d)
            for a in axes:
                block[d] = block[d] * self.mesh.shape[a] + coords[a]
        return ", ".join(map(str, self.holders(block)))


# --- the mesh itself -----------------------------------------------------------------------------


class MeshView:
    """A grid of a mesh's instances: linear index and coordinates, first axis down the rows."""

    def __init__(self, mesh: Mesh, max_blocks: int = 8):
        self.mesh = mesh
        self.max_blocks = max(4, max_blocks)

    def _rows(self):
        names, sizes = self.mesh.axis_names, self.mesh.axis_sizes
        row_axes, col_axes = names[:1], names[1:]
        nrows, ncols = sizes[0] if sizes else 1, math.prod(sizes[1:])
        rows, cols = _shown(nrows, self.max_blocks), _shown(ncols, self.max_blocks)
        col_sizes = [self.mesh.shape[a] for a in col_axes]

        def col_head(c):
            if c == _ELLIPSIS:
                return "…"
            return " ".join(f"{a}={v}" for a, v in zip(col_axes, _unravel(c, col_sizes))) or "-"

        body = []
        for r in rows:
            head = "⋮" if r == _ELLIPSIS else (f"{row_axes[0]}={r}" if row_axes else "-")
            cells = []
            for c in cols:
                if _ELLIPSIS in (r, c):
                    cells.append(("⋮" if r == _ELLIPSIS else "…", None))
                else:
                    cells.append((f"#{r * ncols + c}", r * ncols + c))
            body.append((head, cells))
        return "", [col_head(c) for c in cols], body

    def __str__(self) -> str:
        corner, cols, body = self._rows()
        table = _text_table(corner, cols, [(h, [c[0] for c in cells]) for h, cells in body])
        return f"{self.mesh!r}: {self.mesh.size} instances (#linear index, row-major)\n{table}"

    __repr__ = __str__

    def _repr_html_(self) -> str:
        corner, cols, body = self._rows()
        rows = [
            (
                h,
                [
                    (t, "#fff" if i is None else _color(i), "" if i is None else f"instance {i}")
                    for t, i in cells
                ],
            )
            for h, cells in body
        ]
        e = html.escape
        return (
            f'<div class="named-spmd-mesh"><div><b>{e(repr(self.mesh))}</b>: {self.mesh.size} '
            f"instances (#linear index, row-major)</div>{_html_table(corner, cols, rows)}</div>"
        )


def mesh_html(mesh: Mesh) -> str:
    return MeshView(mesh)._repr_html_()


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


def _comm_rows(events) -> list[_Row]:
    rows: dict[tuple, _Row] = {}
    for e in events:
        name = e.op + (" (implicit pvary)" if e.implicit else "")
        key = (0 if e.direction == "forward" else 1, name, e.axes)
        row = rows.setdefault(key, _Row(e.direction, name, e.axes, 0, 0))
        row.count += 1
        row.nbytes += e.nbytes
    return [rows[k] for k in sorted(rows)]


def _bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def comm_text(events) -> str:
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


def comm_html(events) -> str:
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


RENDERERS = {
    "vtype_html": vtype_html,
    "mesh_html": mesh_html,
    "spec_html": spec_html,
    "comm_html": comm_html,
    "comm_text": comm_text,
    "check_text": check_report_text,
    "check_html": check_report_html,
}

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
