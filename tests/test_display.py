"""Text and HTML views: visualize (which instance holds which block), Mesh, P, VType, CommMode.

The layout a view draws is checked against where the data actually goes: a simulated spmd_map
over ``arange`` reports, from every instance, its mesh coordinates and the global index of its
block's first element.
"""

from __future__ import annotations

import itertools
import math
from html.parser import HTMLParser

import pytest
import torch

import named_spmd as ns
from named_spmd import P

_VOID = {"br", "hr", "img", "meta", "input", "col", "wbr"}


class _Balance(HTMLParser):
    """Collects tags and text; fails on a closing tag that does not match the open one."""

    def __init__(self):
        super().__init__()
        self.stack: list[str] = []
        self.text: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in _VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, (tag, self.stack)
        self.stack.pop()

    def handle_data(self, data):
        self.text.append(data)


def well_formed(page: str) -> _Balance:
    parser = _Balance()
    parser.feed(page)
    parser.close()
    assert parser.stack == [], parser.stack
    return parser


# --- visualize: the layout matches where the data goes -----------------------------------------

CASES = [
    ((2, 4), ("dp", "tp"), (8, 16), P("dp", "tp")),
    ((2, 4), ("dp", "tp"), (8, 16), P("tp", "dp")),
    ((2, 4), ("dp", "tp"), (8, 16), P(("dp", "tp"))),
    ((2, 4), ("dp", "tp"), (8, 16), P(("tp", "dp"))),
    ((2, 4), ("dp", "tp"), (8, 16), P(None, "tp")),
    ((2, 4), ("dp", "tp"), (8, 16), P()),
    ((2, 2, 2), ("a", "b", "c"), (4, 2, 8), P("c", None, ("a", "b"))),
    ((8,), ("i",), (16,), P("i")),
]


def _holdings(mesh, shape, spec):
    """{linear instance index: (coords, flat global index of its block's first element)}."""
    names = mesh.axis_names
    x = torch.arange(math.prod(shape), dtype=torch.float64).reshape(shape)

    def report(x):
        first = x.reshape(-1)[:1]
        coords = [ns.axis_index(a).reshape(1).to(torch.float64) for a in names]
        return torch.cat([first, *coords]).reshape(1, -1)

    rows = ns.spmd_map(report, mesh=mesh, in_specs=spec, out_specs=P(names))(x)
    out = {}
    for linear, row in enumerate(rows.tolist()):
        coords = dict(zip(names, map(int, row[1:])))
        out[linear] = (coords, int(row[0]))
    return out


def _flat_start(slices, shape):
    index = [s.start for s in slices]
    return sum(i * math.prod(shape[d + 1 :]) for d, i in enumerate(index))


@pytest.mark.parametrize("mesh_shape,names,shape,spec", CASES)
def test_visualize_matches_where_the_data_goes(mesh_shape, names, shape, spec):
    mesh = ns.make_mesh(mesh_shape, names)
    view = ns.visualize(torch.zeros(shape), mesh, spec)
    held = _holdings(mesh, shape, spec)
    assert view.local_shape == tuple(s // b for s, b in zip(shape, view.blocks))
    for linear, (coords, start) in held.items():
        assert coords == mesh.coords(linear)
        slices = view.block_of(coords)
        assert [s.stop - s.start for s in slices] == list(view.local_shape)
        assert _flat_start(slices, shape) == start
    # holders(): every instance whose data starts at the block's start, and only those
    for block in itertools.product(*(range(b) for b in view.blocks)):
        start = sum(
            b * loc * math.prod(shape[d + 1 :])
            for d, (b, loc) in enumerate(zip(block, view.local_shape))
        )
        expect = sorted(i for i, (_, s) in held.items() if s == start)
        assert view.holders(block) == expect


def test_visualize_text_names_axes_blocks_and_replication():
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    text = str(ns.visualize(torch.zeros(8, 16), mesh, P(None, "tp")))
    lines = text.splitlines()
    assert lines[0] == (
        "f32[8,16] as P(None, 'tp') on Mesh(dp=2, tp=4; simulated): each of 8 instances holds f32[8,4]"
    )
    assert lines[1].split() == ["dim", "0", "\\", "dim", "1", "[0:4]", "[4:8]", "[8:12]", "[12:16]"]
    assert lines[2].split() == ["[:]", "tp=0", "tp=1", "tp=2", "tp=3"]
    assert "replicated over dp" in lines[3] and "2 instances" in lines[3]
    assert repr(ns.visualize((8, 16), mesh, P("dp", "tp"))) == str(
        ns.visualize((8, 16), mesh, P("dp", "tp"))
    )
    grid = str(ns.visualize((8, 16), mesh, P("dp", "tp"))).splitlines()
    assert grid[3].split() == [
        "[4:8]",
        "dp=1",
        "tp=0",
        "dp=1",
        "tp=1",
        "dp=1",
        "tp=2",
        "dp=1",
        "tp=3",
    ]
    assert grid[-1] == "every instance holds a different block"


def test_visualize_elides_large_meshes():
    mesh = ns.make_mesh((64, 64), ("dp", "tp"))
    view = ns.visualize(ns.ShapeDtype((128, 4096)), mesh, P("dp", "tp"))
    text = str(view)
    assert len(text.splitlines()) == 1 + 1 + 8 + 1  # title, header, 8 shown rows, footer
    assert "dp=63 tp=63" in text and "⋮" in text and "…" in text
    assert "each of 4096 instances holds f32[2,64]" in text
    page = view._repr_html_()
    well_formed(page)
    assert page.count("<tr") == 1 + 8
    assert len(page) < 20_000


def test_visualize_html_is_well_formed_and_has_coordinates():
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    page = ns.visualize(torch.zeros(8, 16), mesh, P("dp", "tp"))._repr_html_()
    parsed = well_formed(page)
    text = " ".join(parsed.text)
    for dp, tp in itertools.product(range(2), range(4)):
        assert f"dp={dp} tp={tp}" in text
    assert parsed.tags.count("td") == 8 and "table" in parsed.tags
    assert "[12:16]" in text
    # replicated blocks: the tooltip lists every holder
    page = ns.visualize(torch.zeros(8), mesh, P("tp"))._repr_html_()
    well_formed(page)
    assert 'title="instances 0, 4"' in page and 'title="instances 3, 7"' in page


def test_html_escapes_axis_names():
    mesh = ns.make_mesh((2,), ("<x>",))
    for page in (
        ns.visualize((4,), mesh, P("<x>"))._repr_html_(),
        mesh._repr_html_(),
        P("<x>")._repr_html_(),
    ):
        parsed = well_formed(page)
        assert "x" not in parsed.tags
        assert "<x>" not in page and "&lt;x&gt;" in page


def test_visualize_rejects_bad_input():
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    with pytest.raises(ns.SpecError, match="not divisible by 4"):
        ns.visualize((6,), mesh, P("tp"))
    with pytest.raises(ns.SpecError, match="unknown mesh axis 'pt'"):
        ns.visualize((8,), mesh, P("pt"))
    with pytest.raises(ns.SpecError, match="mesh= must be"):
        ns.visualize((8,), None, P())
    with pytest.raises(ns.SpecError, match="expected a tensor"):
        ns.visualize("x", mesh, P())


# --- mesh, spec, types, communication -----------------------------------------------------------


def test_mesh_views():
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    text = str(ns.visualize(mesh))
    lines = text.splitlines()
    assert lines[0].startswith("Mesh(dp=2, tp=4; simulated): 8 instances")
    assert lines[1].split() == ["tp=0", "tp=1", "tp=2", "tp=3"]
    assert lines[3].split() == ["dp=1", "#4", "#5", "#6", "#7"]
    parsed = well_formed(mesh._repr_html_())
    cells = [t for t in parsed.text if t.startswith("#")]
    assert cells == [f"#{i}" for i in range(8)]
    three = ns.make_mesh((2, 2, 2), ("a", "b", "c"))
    assert str(ns.visualize(three)).splitlines()[1].split() == [
        "b=0",
        "c=0",
        "b=0",
        "c=1",
        "b=1",
        "c=0",
        "b=1",
        "c=1",
    ]
    assert repr(mesh) == "Mesh(dp=2, tp=4; simulated)"


def test_spec_and_type_reprs():
    spec = P("dp", None, ("tp", "sp"))
    assert repr(spec) == "P('dp', None, ('tp', 'sp'))"
    page = spec._repr_html_()
    well_formed(page)
    assert "P(&#x27;dp&#x27;, None, (&#x27;tp&#x27;, &#x27;sp&#x27;))" in page
    assert "dim 0 split over dp; dim 1 whole; dim 2 split over tp x sp" in page
    assert "replicated" in P()._repr_html_()
    vt = ns.VType(torch.float32, (8, 4), frozenset({"tp", "dp"}), ("dp", "tp"))
    assert repr(vt) == "f32[8,4]{dp,tp}"
    parsed = well_formed(vt._repr_html_())
    assert "".join(parsed.text) == "f32[8,4]{dp,tp}"
    assert "{}" in repr(ns.VType(torch.bfloat16, (), frozenset()))


def test_typeof_inside_spmd_map():
    mesh = ns.make_mesh((2, 4), ("dp", "tp"))
    seen = []

    def f(x, w):
        h = x @ w
        seen.extend([ns.typeof(x), ns.typeof(w), ns.typeof(h), ns.typeof(ns.psum(h, "tp"))])
        return ns.psum(h, "tp")

    ns.spmd_map(f, mesh=mesh, in_specs=(P("dp", "tp"), P("tp")), out_specs=P("dp"))(
        torch.randn(8, 16), torch.randn(16, 3)
    )
    assert [repr(t) for t in seen] == [
        "f32[4,4]{dp,tp}",
        "f32[4,3]{tp}",
        "f32[4,3]{dp, U:tp}",  # the product contracts the dim split over tp on both sides
        "f32[4,3]{dp}",
    ]


def test_commmode_text_and_html():
    mesh = ns.make_mesh((4,), ("dp",))
    f = ns.spmd_map(
        lambda x, w: ns.psum((x @ w).sum(0, keepdim=True), "dp"),
        mesh=mesh,
        in_specs=(P("dp"), P()),
        out_specs=P(),
    )
    w = torch.randn(3, 2, requires_grad=True)
    with ns.CommMode() as comms:
        f(torch.randn(8, 3), w).sum().backward()
    assert "psum" in repr(comms)
    parsed = well_formed(comms._repr_html_())
    text = parsed.text
    assert "forward" in text and "psum" in text and "dp" in text
    with ns.CommMode() as nothing:
        pass
    assert "(no collectives)" in nothing._repr_html_()
