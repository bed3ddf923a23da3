"""What a script can check of docs/design.md and of what the repository says about itself.

The design document's claims that a script can test: its length, every file and module name it
gives, the module-size bound it states, the layer table (against tests/test_layers.py's), the
private-names rule (against tests/test_torch_private.py's scan), and that every citation of a
design.md section elsewhere in the repository names a section that exists. And, repository-wide,
that documents and code say what the design is, not how it came to be: no session or round
narration, no dates, no commit hashes, no issue numbers (the history is git's), and that
benchmarks/RESULTS.md holds one run's tables.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "named_spmd"
DOC = ROOT / "docs" / "design.md"
RESULTS = ROOT / "benchmarks" / "RESULTS.md"


def _load(name: str):
    """A sibling test module by file (the tests folder is not a package)."""
    spec = importlib.util.spec_from_file_location(f"_design_doc_{name}", ROOT / "tests" / name)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _text() -> str:
    return DOC.read_text()


def _code_spans(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", text)


# --- the document ----------------------------------------------------------------------------------


def test_the_design_document_has_at_most_600_lines():
    assert len(_text().splitlines()) <= 600


#: where a path the document gives may be relative to
_BASES = (ROOT, PACKAGE, PACKAGE / "backends", PACKAGE / "_collectives")
_PATH = re.compile(r"^[\w./*-]+(?:\.py|\.md|\.toml|/)$")


def named_paths(text: str) -> list[str]:
    """Every code span of ``text`` that is a file or folder path (``backends/_dist_*.py``)."""
    return sorted({s for s in _code_spans(text) if _PATH.match(s) and not s.startswith(".")})


def _exists(path: str) -> bool:
    if "/" not in path:  # a bare file name: somewhere in the repository
        return any(
            True for p in ROOT.rglob(path) if ".git" not in p.parts and ".venv" not in p.parts
        )
    return any(list(base.glob(path.rstrip("/"))) for base in _BASES)


def test_every_path_the_document_names_exists():
    paths = named_paths(_text())
    assert len(paths) > 40  # the scan sees the document's paths
    assert [p for p in paths if not _exists(p)] == []


def _modules() -> dict[str, list[pathlib.Path]]:
    """Module short name (``_record``, ``_dist_overlap``) -> its files in the package."""
    found: dict[str, list[pathlib.Path]] = {}
    for path in PACKAGE.rglob("*.py"):
        name = path.parent.name if path.name == "__init__.py" else path.stem
        found.setdefault(name, []).append(path)
    return found


def dangling_names(text: str, modules: dict[str, list[pathlib.Path]]) -> list[str]:
    """Code spans ``module.name`` (a package module, then an identifier) whose module does not
    define or mention ``name``."""
    missing = []
    for span in _code_spans(text):
        match = re.match(r"^(_?[a-z]\w*)\.(\w+)(?![*\w])", span)
        if match is None or match.group(1) not in modules or match.group(2) in ("py", "md"):
            continue  # not a module's attribute (a file name)
        module, name = match.groups()
        if any(
            (p.parent / name).exists() or (p.parent / f"{name}.py").exists()
            for p in modules[module]
        ):
            continue  # a submodule of a package
        sources = [p.read_text() for p in modules[module]]
        if not any(re.search(rf"\b{re.escape(name)}\b", s) for s in sources):
            missing.append(span)
    return sorted(set(missing))


def test_every_module_attribute_the_document_names_is_in_that_module():
    modules = _modules()
    assert dangling_names(_text(), modules) == []
    # the scan is not vacuous: a name the module lacks is reported
    assert dangling_names("`_plan.no_such_step`, `_plan.ReplayMode`", modules) == [
        "_plan.no_such_step"
    ]


def modules_over(limit: int, package: pathlib.Path = PACKAGE) -> dict[str, int]:
    """``{path: lines}`` of the package's modules over ``limit`` lines."""
    sizes = {
        str(p.relative_to(package.parent)): len(p.read_text().splitlines())
        for p in package.rglob("*.py")
    }
    return {p: n for p, n in sizes.items() if n > limit}


def test_the_module_size_the_document_states_holds():
    claim = re.search(
        r"No module of the package is over (\d+) lines(?! but)", " ".join(_text().split())
    )
    assert claim is not None, "the document states its bound on module sizes"
    assert int(claim.group(1)) == 500
    assert modules_over(500) == {}


def test_the_module_size_scan_reports_a_long_module(tmp_path):
    """The scan is not vacuous: a module of 501 lines is reported, one of 500 is not."""
    package = tmp_path / "named_spmd"
    (package / "backends").mkdir(parents=True)
    (package / "backends" / "_long.py").write_text("x = 1\n" * 501)
    (package / "_fits.py").write_text("x = 1\n" * 500)
    assert modules_over(500, package) == {"named_spmd/backends/_long.py": 501}


def doc_layers(text: str) -> dict[int, set[str]]:
    """The layer table of section 5.2, ``{layer: {module, ...}}``."""
    section = text.split("### 5.2 Layers", 1)[1].split("\n### ", 1)[0]
    rows = re.findall(r"^\| (\d+) \| (.+) \|$", section, flags=re.M)
    return {int(n): {m.strip("`") for m in re.findall(r"`[^`]+`", mods)} for n, mods in rows}


def test_the_layer_table_is_tests_test_layers_table():
    layers = _load("test_layers.py").LAYERS
    expected = {n: {m or "__init__" for m in mods} for n, mods in layers.items()}
    assert doc_layers(_text()) == expected


def test_private_torch_names_are_where_the_document_says():
    assert "private torch" in _text() and "`named_spmd/_torch_private/`" in _text()
    assert _load("test_torch_private.py").private_names_outside(PACKAGE) == []


def _sections(text: str) -> set[str]:
    return set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\. ", text, flags=re.M)) | set(
        re.findall(r"^### (\d+\.\d+) ", text, flags=re.M)
    )


#: "design.md section 2.3", "design.md, section 7", "design.md sections 2.2 and 3"
_CITED = re.compile(r"design(?:\.md)?,?\s+sections?\s+([\d.]+(?:(?:,|\s+and|-)\s*[\d.]+)*)")
#: "design.md, "Known torch limits"" (a title, a paragraph's bold lead or a table row's)
_TITLED = re.compile(r'design\.md,?\s+(?:section\s+[\d.]+,\s+)?"([^"]+)"')


def _citing_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("named_spmd", "tests", "tutorials", "benchmarks", "docs"):
        files += [p for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    return [f for f in files if f not in (DOC, pathlib.Path(__file__))]


def _name(path: pathlib.Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def bad_citations(files: list[pathlib.Path], text: str) -> list[str]:
    sections = _sections(text)
    flat = " ".join(text.split())
    bad = []
    for path in files:
        source = " ".join(re.sub(r"\n\s*#\s*", "\n", path.read_text()).split())
        for match in _CITED.finditer(source):
            for number in re.findall(r"\d+(?:\.\d+)?", match.group(1)):
                if number.rstrip(".") not in sections:
                    bad.append(f"{_name(path)}: section {number}")
        for match in _TITLED.finditer(source):
            if match.group(1) not in flat:
                bad.append(f"{_name(path)}: {match.group(1)!r}")
    return bad


def test_every_citation_of_the_design_document_names_a_section_it_has():
    assert {"2.3", "5.8", "7", "11"} <= _sections(_text())
    assert bad_citations(_citing_files(), _text()) == []


def test_the_citation_scan_reports_a_missing_section(tmp_path):
    cites = tmp_path / "cites.py"
    cites.write_text(
        '# docs/design.md section 42; docs/design.md, "No such title"; docs/design.md section 7\n'
    )
    assert bad_citations([cites], _text()) == ["cites.py: section 42", "cites.py: 'No such title'"]


# --- the repository says what is, not how it came to be --------------------------------------------

#: Narration of past work. Precise on purpose: "rounds" of a benchmark, "round trip" and
#: rounding are fine; what is caught is work numbered or told as history.
HISTORY = [
    re.compile(r"(?<!scope=\")\bsessions?\b", re.I),  # (pytest's fixture scope is no history)
    re.compile(r"\b(?:this|last|next|previous|earlier|later) round\b(?![- ]trip)", re.I),
    re.compile(r"\bround (?:\d+|one|two|three)\b", re.I),
    re.compile(r"\b(?:was|were) tried\b|\btried and (?:reverted|dropped)\b|\breverted\b", re.I),
    re.compile(r"\bpreviously\b", re.I),
    re.compile(r"\bissues? #?\d+\b", re.I),
    re.compile(r"\b20\d\d-\d\d-\d\d\b"),  # a date
    # a commit hash: 7-40 hex digits with at least one letter and one digit
    re.compile(r"\b(?=[0-9a-f]*[a-f])(?=[0-9a-f]*\d)[0-9a-f]{7,40}\b"),
]


def _history_files() -> list[pathlib.Path]:
    files = [ROOT / "README.md", ROOT / "pyproject.toml"]
    for folder in ("docs", "named_spmd", "benchmarks", "tutorials", "tests"):
        files += [
            p
            for p in sorted((ROOT / folder).rglob("*"))
            if p.is_file()
            and p.suffix in (".py", ".md", ".txt")
            and "__pycache__" not in p.parts
            and p.name != "test_design_doc.py"  # its examples of history
        ]
    return files


def history_lines(files: list[pathlib.Path]) -> list[str]:
    found = []
    for path in files:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if any(p.search(line) for p in HISTORY):
                found.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    return found


def test_documents_and_code_tell_no_history():
    assert history_lines(_history_files()) == []


@pytest.mark.parametrize(
    ("line", "caught"),
    [
        ("measured in the ninth session", True),
        ("done in this round, before the split", True),
        ("the fast path was tried and reverted", True),
        ("the targets of issue 13", True),
        ("benchmarks/RESULTS.md, 2026-11-27", True),
        ("fixed at 4a5ee58 (the baseline)", True),
        ("previously the call ran twice", True),
        ("median over 15 rounds", False),
        ("a round trip through the group", False),
        ("rounding: float64 to 1e-10", False),
        ("the first round of a benchmark", False),
        ("pytorch#168393", False),
        ("blake2b, 63 bits", False),
    ],
)
def test_the_history_patterns_are_precise(line, caught):
    assert bool(any(p.search(line) for p in HISTORY)) is caught


def test_benchmark_results_are_one_runs_tables():
    text = RESULTS.read_text()
    assert len(text.splitlines()) <= 300
    assert re.search(r"\b20\d\d-\d\d-\d\d", text) is None  # no dated log
    assert text.startswith("# Benchmark results")
