"""The views of where data lives: :class:`Layout` (which instance holds which block of a global
tensor) and :class:`MeshView` (a mesh's instances), as text and HTML tables.

The geometry (block slices, row-major instance indices) is ``_layout``'s; this module only draws
it. Large meshes are elided in the middle (first and last blocks shown), so a view of a
4096-instance layout stays small. ``_display.visualize`` builds these views.
"""

from __future__ import annotations

import html
import math
from collections.abc import Sequence

import torch

from ._errors import SpecError, bullet_list
from ._layout import coords_of, group_coords, group_size, index_of, local_shape
from ._mesh import Mesh
from ._spec import PartitionSpec, spec_problems
from ._types import short_dtype

_ELLIPSIS = -1  # marks an elided run of rows or columns

#: A layout cell: (label, the block's row-major index, the holders' coordinates); None, None
#: for an elided cell.
_Cell = tuple[str, int | None, dict[str, int] | None]


def _shown(n: int, limit: int) -> list[int]:
    """Indices 0..n-1 to display, with one _ELLIPSIS in place of the middle when n > limit."""
    if n <= limit:
        return list(range(n))
    return list(range(limit - 3)) + [_ELLIPSIS, n - 2, n - 1]


def _color(i: int) -> str:
    """A pastel colour per index (golden-angle hues: neighbours differ)."""
    return f"hsl({(i * 137.508) % 360:.0f}, 65%, 85%)"


def _text_table(corner: str, cols: list[str], rows: list[tuple[str, list[str]]]) -> str:
    widths = [max(len(corner), *(len(r[0]) for r in rows))]
    for j, c in enumerate(cols):
        widths.append(max(len(c), *(len(r[1][j]) for r in rows)))
    lines = ["  ".join(s.ljust(w) for s, w in zip([corner, *cols], widths)).rstrip()]
    for head, cells in rows:
        lines.append("  ".join(s.ljust(w) for s, w in zip([head, *cells], widths)).rstrip())
    return "\n".join(lines)


def _html_table(
    corner: str, cols: list[str], rows: list[tuple[str, list[tuple[str, str, str]]]]
) -> str:
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
        self.sizes = mesh.shape
        self.blocks = tuple(
            group_size(spec.entry_axes(d), self.sizes) for d in range(len(self.shape))
        )
        self.local_shape = local_shape(self.shape, spec, self.sizes)
        self.replicated = tuple(a for a in mesh.axis_names if a not in spec.axes)

    # --- queries (also what the views are drawn from) ---------------------------------------
    def block_of(self, coords: dict[str, int]) -> tuple[slice, ...]:
        """The global slices that the instance at mesh coordinates ``coords`` holds."""
        out = []
        for d, local in enumerate(self.local_shape):
            b = index_of(self.spec.entry_axes(d), coords, self.sizes)
            out.append(slice(b * local, (b + 1) * local))
        return tuple(out)

    def block_coords(self, block: Sequence[int]) -> dict[str, int]:
        """Coordinates on the spec's axes of the instances holding block index ``block``."""
        coords: dict[str, int] = {}
        for d, b in enumerate(block):
            coords.update(coords_of(b, self.spec.entry_axes(d), self.sizes))
        return coords

    def holders(self, block: Sequence[int]) -> list[int]:
        """Row-major linear indices of every instance holding block index ``block``."""
        return self._holders(self.block_coords(block))

    def _holders(self, fixed: dict[str, int]) -> list[int]:
        """Row-major linear indices of the instances with coordinates ``fixed`` on the spec's
        axes (any coordinate on the others)."""
        names = self.mesh.axis_names
        free = [a for a in names if a not in fixed]
        return sorted(index_of(names, c, self.sizes) for c in group_coords(free, fixed, self.sizes))

    def _axes(self, dims: list[int]) -> list[str]:
        """The spec's axes splitting ``dims``, in dim order: a row-major index over the blocks
        of ``dims`` is a row-major index over these axes."""
        return [a for d in dims for a in self.spec.entry_axes(d)]

    # --- drawing ---------------------------------------------------------------------------
    def _grid(self) -> tuple[list[int], list[int], list[int], list[int]]:
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
        coords = coords_of(index, self._axes(dims), self.sizes)
        parts = []
        for d in dims:
            b, step = index_of(self.spec.entry_axes(d), coords, self.sizes), self.local_shape[d]
            parts.append(f"{b * step}:{(b + 1) * step}" if self.blocks[d] > 1 else ":")
        return ", ".join(parts)

    def _cell(self, row_dims: list[int], col_dims: list[int], r: int, c: int) -> _Cell:
        # Row dims precede column dims, so ``coords`` lists the spec's axes in dim order.
        coords = coords_of(r, self._axes(row_dims), self.sizes)
        coords.update(coords_of(c, self._axes(col_dims), self.sizes))
        label = " ".join(f"{a}={coords[a]}" for a in self.mesh.axis_names if a in coords)
        linear = index_of(self.spec.axes, coords, self.sizes)  # the block's row-major index
        return label or "every instance", linear, coords

    def _rows(self) -> tuple[str, list[str], list[tuple[str, list[_Cell]]]]:
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
            cells: list[_Cell] = []
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
        copies = group_size(self.replicated, self.sizes)
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
                if linear is None or coords is None:  # an elided cell
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
        free = group_size(self.replicated, self.sizes)
        if free > 16:
            return f"{free} instances with {coords}"
        return ", ".join(map(str, self._holders(coords)))


# --- the mesh itself -----------------------------------------------------------------------------


class MeshView:
    """A grid of a mesh's instances: linear index and coordinates, first axis down the rows."""

    def __init__(self, mesh: Mesh, max_blocks: int = 8):
        self.mesh = mesh
        self.max_blocks = max(4, max_blocks)

    def _rows(self) -> tuple[str, list[str], list[tuple[str, list[tuple[str, int | None]]]]]:
        names, sizes = self.mesh.axis_names, self.mesh.shape
        row_axes, col_axes = names[:1], names[1:]
        nrows, ncols = group_size(row_axes, sizes), group_size(col_axes, sizes)
        rows, cols = _shown(nrows, self.max_blocks), _shown(ncols, self.max_blocks)

        def col_head(c: int) -> str:
            if c == _ELLIPSIS:
                return "…"
            return " ".join(f"{a}={v}" for a, v in coords_of(c, col_axes, sizes).items()) or "-"

        body = []
        for r in rows:
            head = "⋮" if r == _ELLIPSIS else (f"{row_axes[0]}={r}" if row_axes else "-")
            cells: list[tuple[str, int | None]] = []
            for c in cols:
                if _ELLIPSIS in (r, c):
                    cells.append(("⋮" if r == _ELLIPSIS else "…", None))
                else:
                    coords = {**coords_of(r, row_axes, sizes), **coords_of(c, col_axes, sizes)}
                    linear = index_of(names, coords, sizes)
                    cells.append((f"#{linear}", linear))
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
