"""Run every benchmark and write the results table: ``benchmarks/RESULTS.md``.

Run: ``python benchmarks/run_all.py [--quick] [--only NAME ...] [--out FILE] [--timeout S]``

Each ``bench_*.py`` runs as its own subprocess (so one benchmark's process groups, caches or
memory cannot leak into another's) under a timeout. The scripts built on ``_util`` write their
rows as a markdown table (``--markdown FILE``); bench_distributed.py writes JSON (``--json
FILE``), turned into tables here; any other ``bench_*.py`` is run bare and its output kept as
text. A table's rows "..., CPU time" (bench_gpt.py's) are folded into two columns of the
wall-clock rows of the same variants. The results file holds the latest run only (git keeps the
earlier ones): the machine (CPU, cores, load, torch version), the performance targets (the
library's, then the GPT training step's) with the figure measured for each and whether it is
met, then every benchmark's table. ``--quick`` passes ``--quick`` (fewer rounds; memory without
H=4096) to the scripts and 5 rounds to the distributed one.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


@dataclass
class Outcome:
    """What one benchmark script gave back."""

    name: str
    argv: list[str]
    seconds: float = 0.0
    error: str = ""  # non-empty: timed out or failed; holds the tail of its output
    tables: list[dict] = field(default_factory=list)  # rows parsed from its markdown table
    markdown: str = ""  # its table(s), ready for the results file
    data: dict = field(default_factory=dict)  # its JSON, when it writes one
    stdout: str = ""


# --- running ---------------------------------------------------------------------------------------


def _argv(name: str, quick: bool, timeout: float) -> tuple[list[str], str | None]:
    """The script's arguments, and the flag that names its output file (None: none)."""
    if name == "bench_distributed":
        rounds = ["--rounds", "5"] if quick else []
        return [*rounds, "--timeout", str(int(timeout))], "--json"
    if name in ("bench_simulated", "bench_fixed_cost", "bench_memory", "bench_gpt"):
        return (["--quick"] if quick else []), "--markdown"
    return [], None


def run_one(name: str, quick: bool, timeout: float) -> Outcome:
    with tempfile.TemporaryDirectory() as tmp:
        out_file = os.path.join(tmp, "out")
        argv, out_flag = _argv(name, quick, timeout)
        outcome = Outcome(name, argv)
        print(f"== {name} {' '.join(argv)}", flush=True)
        cmd = [sys.executable, os.path.join(HERE, name + ".py"), *argv]
        start = time.perf_counter()
        code, stdout, stderr = _run(cmd + ([out_flag, out_file] if out_flag else []), timeout)
        outcome.seconds = time.perf_counter() - start
        outcome.stdout = _clean(stdout)
        print(outcome.stdout, flush=True)
        if code is None:
            outcome.error = f"timed out after {timeout:.0f} s\n{_clean(stdout + stderr)[-3000:]}"
        elif code:
            outcome.error = f"exit status {code}\n{_clean(stdout + stderr)[-3000:]}"
        else:
            _collect(outcome, out_file)
    return outcome


def _run(cmd: list[str], timeout: float) -> tuple[int | None, str, str]:
    """Run ``cmd`` in its own process group; on timeout kill that group (bench_distributed's
    ranks included) and return None as the exit status."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return None, stdout, stderr


def _clean(text: str) -> str:
    """Drop the profiler's start/stop chatter."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("USDT:"))


def _collect(outcome: Outcome, out_file: str) -> None:
    if not os.path.exists(out_file):
        return
    with open(out_file) as fh:
        text = fh.read()
    if outcome.name == "bench_distributed":
        outcome.data = json.loads(text)
        outcome.markdown = distributed_markdown(outcome.data)
    else:
        outcome.markdown = fold_cpu_rows(text.strip())
        outcome.tables = parse_markdown_table(text)  # the script's own rows, "..., CPU time" too


def parse_markdown_table(text: str) -> list[dict]:
    """Rows of a markdown table as dicts keyed by its header."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("|")]
    if len(lines) < 2:
        return []
    cells = [[c.strip() for c in ln.strip("|").split("|")] for ln in lines]
    header = cells[0]
    return [dict(zip(header, row)) for row in cells[2:]]


CPU_SUFFIX = ", CPU time"
CPU_COLUMNS = ("CPU (us)", "CPU ratio")


def fold_cpu_rows(text: str) -> str:
    """A ``_util`` table whose rows "CASE, CPU time" repeat the variants of case CASE in CPU
    time, with those rows folded into two columns of the wall-clock rows: "CPU (us)" and
    "CPU ratio" (over the same "vs"). A CPU-time row with no wall-clock row of its variant
    becomes a row of its own with the wall-clock cells empty; one with a target or another "vs"
    stays as it is. Any other text comes back unchanged."""
    lines = text.splitlines()
    if len(lines) < 2 or not all(ln.startswith("|") for ln in lines):
        return text
    rows = parse_markdown_table(text)
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    align = [c.strip() for c in lines[1].strip("|").split("|")]
    needed = {"case", "variant", "median (us)", "ratio", "vs", "target"}
    if not needed <= set(header) or not any(r["case"].endswith(CPU_SUFFIX) for r in rows):
        return text
    wall = {(r["case"], r["variant"]): r for r in rows if not r["case"].endswith(CPU_SUFFIX)}
    out = []
    for row in rows:
        if not row["case"].endswith(CPU_SUFFIX):
            out.append(row)
            continue
        key = (row["case"][: -len(CPU_SUFFIX)], row["variant"])
        partner = wall.get(key)
        if row["target"] or (partner is not None and partner["vs"] != row["vs"]):
            out.append(row)  # kept whole: its case still says CPU time
            continue
        cpu = {CPU_COLUMNS[0]: row["median (us)"], CPU_COLUMNS[1]: row["ratio"]}
        if partner is None:
            blank = dict.fromkeys(("median (us)", "ratio"), "")
            out.append({**row, **blank, "case": key[0], **cpu})
        else:
            partner.update(cpu)
    at = header.index("ratio") + 1
    header[at:at] = CPU_COLUMNS
    align[at:at] = ["---:"] * len(CPU_COLUMNS)
    table = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    table += ["| " + " | ".join(row.get(k, "") for k in header) + " |" for row in out]
    return "\n".join(table)


# --- the distributed benchmark's JSON as tables --------------------------------------------------


def _fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 1 else f"{value:,.2f}"
    return str(value)


def dict_table(rows: list[dict]) -> str:
    """A markdown table of dicts (columns: the union of their keys, in order of appearance)."""
    keys = list(dict.fromkeys(k for row in rows for k in row))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(_fmt(row.get(k, "")) for k in keys) + " |" for row in rows]
    return "\n".join(lines)


def distributed_markdown(data: dict) -> str:
    dist_part = data.get("distributed") or {}
    parts = []
    head = {k: v for k, v in dist_part.items() if not isinstance(v, list)}
    if head:
        parts.append(", ".join(f"{k}: {v}" for k, v in head.items()))
    titles = {
        "megatron": "Megatron MLP step (ms; ratio = spmd_map / hand-written)",
        "latency": "One all-reduce (us per call)",
        "tree": "Collectives of a pytree (us per call; ratio = ns / hand-written)",
        "ring": "A ring of ppermutes (us per ring)",
        "ragged": "One ragged_all_to_all (us per call; ratio = ns / hand-written, routing known)",
        "stencil": "Stencil step, halos by ppermute (us per call; ratio = ns / hand-written)",
        "replay": "vma tracking on every rank, 200 ops (CPU us per op; fixed cost in us)",
    }
    for key, rows in dist_part.items():
        if isinstance(rows, list) and rows:
            parts.append(f"**{titles.get(key, key)}**\n\n{dict_table(rows)}")
    if data.get("vma"):
        parts.append(
            "**vma tracking, 1 process, 200 small ops (us per op; fixed cost in us)**\n\n"
            + dict_table([data["vma"]])
        )
    return "\n\n".join(parts)


# --- targets ----------------------------------------------------------------------------------------


def _num(text: str) -> float | None:
    try:
        return float(str(text).rstrip("x").replace(",", ""))
    except ValueError:
        return None


def _find(outcome: Outcome | None, **match) -> dict | None:
    if outcome is None:
        return None
    return next(
        (row for row in outcome.tables if all(row.get(k) == v for k, v in match.items())), None
    )


def _target(
    name: str, value: float | None, unit: str, limit: float, context: str = "", peers: str = ""
) -> tuple[str, str, str, str, str]:
    """A row of the targets table; ``unit`` ending in "faster" means "at least ``limit``"."""
    if value is None:
        verdict = "no data"
    else:
        ok = value >= limit if unit.endswith("faster") else value <= limit
        verdict = "met" if ok else "**not met**"
    measured = "" if value is None else f"{value:.3g}{unit}"
    return name, measured, verdict, context, peers


def _col(row: dict | None, key: str) -> float | None:
    return _num(row[key]) if row and key in row else None


def targets(results: dict[str, Outcome]) -> list[tuple[str, str, str, str, str]]:
    """(target, measured, verdict, context from the same run, peers) per performance target.
    The context is the floor or bound that the figure should be read against."""
    dist_out = results.get("bench_distributed")
    data = dist_out.data if dist_out else {}
    vma = data.get("vma") or {}
    bare, dtensor = vma.get("bare_mode_overhead_us_per_op"), vma.get("dtensor_overhead_us_per_op")
    replayed = vma.get("replayed_overhead_us_per_op")
    rows = [
        _target(
            "vma tracking <= 2 us/op (real backend)",
            vma.get("vma_overhead_us_per_op"),
            " us/op",
            2.0,
            ""
            if bare is None
            else f"bare TorchFunctionMode {bare:.2f}, DTensor {dtensor:.1f}"
            + ("" if replayed is None else f"; replayed on one instance {replayed:.2f}"),
            "DTensor ~7 (~12 with grad); stamping mode ~1.7",
        )
    ]
    replays = (data.get("distributed") or {}).get("replay", [])
    replay = next(iter(replays), {})
    larger = "".join(
        f"; on {r['operands']} operands: replayed {r['replayed overhead us/op']:.2f}, bare "
        f"{r['bare TorchFunctionMode overhead us/op']:.2f}, plain op {r['plain us/op']:.2f}"
        for r in replays[1:]
    )
    rows.append(
        _target(
            f"replayed per-op overhead, {replay.get('ranks', 4)} ranks <= 0.3 us/op",
            replay.get("replayed overhead us/op"),
            " us/op",
            0.3,
            f"{replay.get('operands', '8x8')} operands; typed {replay['typed overhead us/op']:.2f}; "
            "a bare TorchFunctionMode's dispatch alone (the floor of a replay run by a mode) "
            f"{replay['bare TorchFunctionMode overhead us/op']:.2f}; plain op "
            f"{replay['plain us/op']:.2f}{larger}"
            if replay
            else "",
        )
    )
    megatron = {r.get("hidden"): r for r in (data.get("distributed") or {}).get("megatron", [])}
    dtensor_peer = {256: "DTensor 1.51x", 1024: "DTensor 1.16x"}
    for hidden, limit in ((256, 1.10), (1024, 1.05), (4096, 1.05)):
        row = megatron.get(hidden) or {}
        rows.append(
            _target(
                f"real step H={hidden} <= {limit:.2f}x hand-written",
                row.get("ratio"),
                "x",
                limit,
                (f"{row['rounds']} rounds" if "rounds" in row else "")
                + (
                    f"; vs DDP-style overlapped hand-written {row['ratio_overlapped']:.2f}x"
                    if "ratio_overlapped" in row
                    else ""
                ),
                dtensor_peer.get(hidden, ""),
            )
        )
    rows += uneven_targets(data.get("distributed") or {})
    sim = results.get("bench_simulated")
    for hidden, limit, jax in ((256, 1.75, "JAX ~1.5x"), (1024, 1.25, "JAX ~2.2x")):
        case = f"H={hidden}"
        ours = _find(sim, case=case, variant="spmd_map (2,4) default order")
        lt = _find(sim, case=case, variant="LocalTensorMode per-rank program")
        unsharded = _col(_find(sim, case=case, variant="unsharded single-device"), "median (us)")
        lt_us = _col(lt, "median (us)")
        bound = (
            f"bound if we cost >= unsharded: LocalTensorMode / unsharded = {lt_us / unsharded:.2f}x"
            if lt_us and unsharded
            else ""
        )
        rows.append(
            _target(
                f"simulated MLP {case} <= {limit}x unsharded",
                _col(ours, "ratio"),
                "x",
                limit,
                "",
                jax,
            )
        )
        row = _target(
            f"simulated MLP {case} >= 5x faster than LocalTensorMode",
            _col(lt, "ratio"),
            "x faster",
            5.0,
            bound,
        )
        if row[2] != "met" and lt_us and unsharded and lt_us / unsharded < 5.0:
            row = (row[0], row[1], row[2] + " (out of reach: bound < 5x)", *row[3:])
        rows.append(row)
        per_instance = _find(sim, case=case, variant="LocalTensorMode / per instance")
        vmap = _col(_find(sim, case=case, variant="per instance / vmap (default order)"), "ratio")
        rows.append(
            _target(
                f"simulated MLP {case} per instance faster than LocalTensorMode (goal)",
                _col(per_instance, "ratio"),
                "x faster",
                1.0,
                "" if vmap is None else f"per instance / vmap execution = {vmap:.2f}x",
            )
        )
    plain = _col(_find(sim, case="plain torch op (x + 1)"), "median (us)")
    rows.append(
        _target(
            "simulated psum from inside 2 levels <= 15 us",
            _col(_find(sim, case="psum"), "median (us)"),
            " us",
            15.0,
            "" if plain is None else f"plain x + 1 from 2 levels: {plain:.1f} us",
            "autograd.Function path ~120 us/level; torch.library spike ~9-10 us",
        )
    )
    mem = results.get("bench_memory")
    for row in mem.tables if mem else []:
        if row.get("variant") == "spmd_map (2,4) default order":
            rows.append(
                _target(
                    f"simulated peak memory {row['case']} <= 1.25x per-instance tensors",
                    _col(row, "ratio vs sum of the 8 per-instance peaks"),
                    "x",
                    1.25,
                    f"{row['peak (MiB)']} MiB vs {_sum_mib(mem, row['case'])} MiB",
                )
            )
    return rows


def _cpu(row: dict) -> str:
    text = f"; CPU time of the ranks {row['cpu ratio']:.2f}x" if "cpu ratio" in row else ""
    if "ns process-group calls" in row:  # each a round of the ranks' scheduling on gloo
        text += (
            f"; process-group calls per call: ns {row['ns process-group calls']}, "
            f"hand-written {row['hand process-group calls']}"
        )
    return text


def uneven_targets(dist_part: dict) -> list[tuple[str, str, str, str, str]]:
    """Uneven programs on the real backend: a ragged_all_to_all and a stencil step on a grid
    that does not divide, each against the same program hand-written."""
    rows = []
    for row in dist_part.get("ragged", []):
        rows.append(
            _target(
                f"real ragged_all_to_all {row['rows']} rows x {row['features']} <= 1.05x "
                "hand-written",
                row.get("ratio"),
                "x",
                1.05,
                f"routing known to every rank; vs hand-written with the sizes exchanged "
                f"{row['ratio vs sizes exchanged']:.2f}x; an empty spmd_map call with these "
                f"inputs {row['ns, empty call'] / row['hand, routing known']:.2f}x" + _cpu(row),
            )
        )
    stencil = dist_part.get("stencil", [])
    even = [r for r in stencil if len(set(r["blocks"].split("/"))) == 1]
    for row in stencil:
        if row in even:
            continue
        rows.append(
            _target(
                f"real stencil step, grid {row['grid']} (blocks {row['blocks']}) <= 1.05x "
                "hand-written",
                row.get("ratio"),
                "x",
                1.05,
                f"{row['steps']} step(s) per call"
                + _cpu(row)
                + "".join(f"; even grid {r['grid']}: {r['ratio']:.2f}x" for r in even),
            )
        )
    return rows


# (case, variant, limit, target text) of bench_gpt.py's rows that carry a target
_GPT_TARGETS = (
    ("simulated, 1 process", "named_spmd simulated (1, 1)", 1.15, "simulated (1,1) / dense"),
    (
        "(1,1), 1 gloo process",
        "named_spmd, plain parameters",
        1.05,
        "1 gloo process (1,1), plain parameters / dense",
    ),
    (
        "(1,1), 1 gloo process",
        "named_spmd / dense, both on DTensors",
        1.05,
        "1 gloo process (1,1) / dense, both on DTensor parameters",
    ),
    ("dp=2, 2 gloo processes", "named_spmd", 1.05, "dp=2 on 2 processes / DDP"),
    ("(2,2), 4 gloo processes", "named_spmd", 0.5, "(2,2) on 4 processes / DTensor TP + dp"),
    ("simulated, 1 process", "named_spmd simulated (2, 2)", 1.5, "simulated (2,2) / dense"),
    (
        "simulated, 1 process",
        "named_spmd (2, 2) / nested vmap tp outermost",
        1.10,
        "simulated (2,2) / plain nested vmap (the floor)",
    ),
)


# variants measured beside a target's row, quoted in its context
_GPT_BESIDE = {
    "(1,1), 1 gloo process": ("named_spmd", "dense step on DTensor parameters"),
    "dp=2, 2 gloo processes": (
        "named_spmd, plain parameters",
        "named_spmd, loss unreduced over dp",
    ),
}


def gpt_targets(results: dict[str, Outcome]) -> list[tuple[str, str, str, str, str]]:
    """The GPT training step's targets, from bench_gpt.py's table."""
    gpt = results.get("bench_gpt")
    rows = []
    for case, variant, limit, text in _GPT_TARGETS:
        row = _find(gpt, case=case, variant=variant)
        base = _find(gpt, case=case, variant=row["vs"]) if row else None
        context = (
            f"{row['median (us)']} us vs {base['median (us)']} us ({row['vs']})" if base else ""
        )
        cpu = _find(gpt, case=case + ", CPU time", variant=variant)
        context += f"; CPU time {cpu['ratio']}" if cpu else ""
        for other in _GPT_BESIDE.get(case, ()):  # rows that say where the time goes
            wall = _find(gpt, case=case, variant=other)
            cpu = _find(gpt, case=case + ", CPU time", variant=other)
            if wall and cpu:
                context += f"; {other}: {wall['ratio']} (CPU time {cpu['ratio']})"
        rows.append(
            _target(f"GPT step {text} <= {limit}x", _col(row, "ratio"), "x", limit, context)
        )
    return rows


def _sum_mib(mem: Outcome, case: str) -> str:
    row = _find(mem, case=case, variant="sum of the 8 per-instance peaks")
    return row["peak (MiB)"] if row else "?"


def fixed_costs(results: dict[str, Outcome]) -> list[str]:
    """Fixed cost of one spmd_map call on tiny tensors, both backends (no target)."""
    lines = []
    fixed = results.get("bench_fixed_cost")
    for case in ("identity, mesh (2,4)", "one psum, mesh (2,4)"):
        warm = _find(fixed, case=case, variant="spmd_map")
        cold = _find(fixed, case=case, variant="spmd_map, caches cleared")
        vmap = _find(fixed, case=case, variant="torch.func.vmap nested")
        if warm and cold and vmap:
            lines.append(
                f"- simulated, {case}: {warm['median (us)']} us warm, {cold['median (us)']} us "
                f"with the caches cleared; hand-written nested vmap {vmap['median (us)']} us"
            )
    dist_out = results.get("bench_distributed")
    vma = (dist_out.data if dist_out else {}).get("vma") or {}
    if "spmd_call_fixed_us" in vma:
        lines.append(
            f"- real backend, one process, mesh (1,): {vma['spmd_call_fixed_us']:.0f} us per "
            "call of an spmd_map with no ops"
        )
    return lines


# --- the results file ---------------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def machine(load_before: tuple[float, ...]) -> list[str]:
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    load_after = os.getloadavg()
    return [
        f"- CPU: {_cpu_model()}, {os.cpu_count()} cores, {mem_gb:.0f} GiB RAM",
        f"- torch {torch.__version__} ({torch.get_num_threads()} threads by default), "
        f"Python {platform.python_version()}, {platform.system()} {platform.release()}",
        f"- 1-minute load average: {load_before[0]:.2f} at the start, {load_after[0]:.2f} at the "
        "end (other work on the machine blurs timings; ratios are taken within one process, "
        "rounds interleaved, so drift hits baseline and candidate alike)",
    ]


def write_results(path: str, results: dict[str, Outcome], quick: bool, load_before) -> None:
    cmd = "python benchmarks/run_all.py" + (" --quick" if quick else "")
    lines = ["# Benchmark results", "", f"Generated by `{cmd}`; see README.md in this folder.", ""]
    lines += ["## Machine", "", *machine(load_before), ""]
    lines += [
        "## Targets",
        "",
        "| target | measured | verdict | context (same run) | peers |",
        "|---|---|---|---|---|",
    ]
    lines += ["| " + " | ".join(row) + " |" for row in targets(results)]
    if "bench_gpt" in results:
        lines += ["", "## Targets: GPT training step, eager", ""]
        lines += [
            "| target | measured | verdict | context (same run) | peers |",
            "|---|---|---|---|---|",
        ]
        lines += ["| " + " | ".join(row) + " |" for row in gpt_targets(results)]
    fixed = fixed_costs(results)
    if fixed:
        lines += ["", "Fixed cost of one spmd_map call (tiny tensors; no target):", "", *fixed]
    for name, outcome in results.items():
        cmd = " ".join(["python", f"benchmarks/{name}.py", *outcome.argv])
        lines += ["", f"## {name}", "", f"`{cmd}` ({outcome.seconds:.0f} s)", ""]
        if outcome.error:
            lines += ["**failed**:", "", "```", outcome.error.strip(), "```"]
        elif outcome.markdown:
            lines.append(outcome.markdown)
        else:
            lines += ["```", outcome.stdout.strip(), "```"]
    with open(path, "w") as fh:
        fh.write("\n".join(lines) + "\n")


#: Benchmarks that every run leaves out unless ``--only`` names them: bench_buckets compares
#: bucket sizes against the DDP baseline (a design choice's evidence, not a target).
RUN_ON_THEIR_OWN = {"bench_buckets"}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds and sizes")
    parser.add_argument("--only", nargs="+", help="benchmark names (e.g. bench_memory)")
    parser.add_argument("--out", default=os.path.join(HERE, "RESULTS.md"))
    parser.add_argument("--timeout", type=float, default=300, help="seconds per benchmark")
    args = parser.parse_args(argv)
    names = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(HERE, "bench_*.py")))
    if args.only:
        names = [n for n in names if n in args.only]
    else:  # run on their own (benchmarks/README.md)
        names = [n for n in names if n not in RUN_ON_THEIR_OWN]
    load_before = os.getloadavg()
    start = time.perf_counter()
    results = {name: run_one(name, args.quick, args.timeout) for name in names}
    write_results(args.out, results, args.quick, load_before)
    failed = [n for n, o in results.items() if o.error]
    print(f"wrote {args.out} in {time.perf_counter() - start:.0f} s; failed: {failed or 'none'}")
    if failed:
        sys.exit(1)


if __name__ == "__main__":
    main()
