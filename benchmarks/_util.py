"""Timing helpers shared by the benchmarks: warmup, interleaved repeats, medians, ratios.

Baseline and candidate run in the same process and are interleaved round by round, so slow drift
of the machine (frequency, other processes) hits both alike. Each round times ``number`` calls
and the reported figure is the median over rounds of the per-call time.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass


def _per_call(fn: Callable[[], object], number: int) -> float:
    start = time.perf_counter()
    for _ in range(number):
        fn()
    return (time.perf_counter() - start) / number


def calibrate(fn: Callable[[], object], target_s: float = 0.05) -> int:
    """How many calls make one round last about ``target_s`` (at least 1)."""
    fn()
    once = _per_call(fn, 1)
    return max(1, int(target_s / max(once, 1e-7)))


def compare(
    fns: dict[str, Callable[[], object]],
    *,
    rounds: int = 15,
    warmup: int = 3,
    target_s: float = 0.05,
) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds."""
    numbers = {name: calibrate(fn, target_s) for name, fn in fns.items()}
    for fn in fns.values():
        _per_call(fn, warmup)
    samples: dict[str, list[float]] = {name: [] for name in fns}
    gc_was_enabled = gc.isenabled()
    gc.disable()  # collections land at random points and blur the medians
    try:
        for _ in range(rounds):
            for name, fn in fns.items():
                samples[name].append(_per_call(fn, numbers[name]))
            gc.collect()
    finally:
        if gc_was_enabled:
            gc.enable()
    return {name: statistics.median(s) for name, s in samples.items()}


def paired_ratio(
    candidate: list[float], baseline: list[float], resamples: int = 2000
) -> tuple[float, float, float]:
    """The median over rounds of ``candidate[r] / baseline[r]`` (two timings of the same round,
    taken next to each other), and a 95% bootstrap interval of that median (rounds resampled
    with replacement, a fixed seed). Pairing cancels the machine's drift between rounds, which
    a ratio of the two medians keeps: it resolves a few percent where that does not."""
    ratios = [c / b for c, b in zip(candidate, baseline, strict=True)]
    rng = random.Random(0)
    medians = sorted(
        statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(resamples)
    )
    low, high = medians[int(0.025 * resamples)], medians[int(0.975 * resamples) - 1]
    return statistics.median(ratios), low, high


@dataclass
class Row:
    """One line of a results table: a benchmark case, its time and its ratio to a baseline."""

    bench: str
    case: str
    variant: str
    seconds: float
    baseline: str | None = None
    ratio: float | None = None
    target: str = ""

    def us(self) -> float:
        return self.seconds * 1e6


def rows_with_ratios(
    bench: str, case: str, medians: dict[str, float], baseline: str, targets: dict[str, str]
) -> list[Row]:
    """Rows for every variant of ``medians``, with its ratio to ``medians[baseline]``."""
    base = medians[baseline]
    rows = []
    for name, sec in medians.items():
        is_base = name == baseline
        rows.append(
            Row(
                bench,
                case,
                name,
                sec,
                None if is_base else baseline,
                None if is_base else sec / base,
                targets.get(name, ""),
            )
        )
    return rows


def print_rows(rows: list[Row]) -> None:
    """A plain table for the terminal: medians in microseconds and ratios."""
    print(f"{'case':<28} {'variant':<34} {'median us':>12} {'ratio':>8}  target")
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else "-"
        print(f"{r.case:<28} {r.variant:<34} {r.us():>12.1f} {ratio:>8}  {r.target}")


def markdown(rows: list[Row]) -> str:
    """The same rows as a markdown table (for the results file)."""
    lines = [
        "| benchmark | case | variant | median (us) | ratio | vs | target |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for r in rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio is not None else ""
        lines.append(
            f"| {r.bench} | {r.case} | {r.variant} | {r.us():.1f} | {ratio} | "
            f"{r.baseline or ''} | {r.target} |"
        )
    return "\n".join(lines)


def write_markdown(path: str | None, rows: list[Row]) -> None:
    """Write ``rows`` as a markdown table to ``path`` (run_all.py collects these); no-op on None."""
    if path:
        with open(path, "w") as fh:
            fh.write(markdown(rows) + "\n")


def compiled_copy(fn: Callable, tag: str, **options) -> Callable:
    """``torch.compile(**options)`` of a wrapper of ``fn`` with a code object of its own: Dynamo
    caches per code object, so copies compared in one process never check each other's guards."""
    import torch

    own = eval(compile("lambda *a: fn(*a)", f"<{tag}>", "eval"), {"fn": fn})
    return torch.compile(own, **options)


def use_device(device: str) -> None:
    """``"cuda"``: this process's GPU (``LOCAL_RANK``, one process per GPU) as the default device
    of the tensors a benchmark makes; ``"cpu"``: nothing to do."""
    if device == "cuda":
        import os

        import torch

        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        torch.set_default_device("cuda")


def spawn(script: str, nproc: int, argv: list[str], timeout: float) -> str:
    """Run ``script`` as ``nproc`` gloo ranks on 127.0.0.1 (env:// rendezvous through a store this
    process holds); returns rank 0's output. Each rank writes to a file, not a pipe: a rank that
    prints more than a pipe holds would block, and its peers with it in the next collective."""
    import os
    import subprocess
    import sys
    import tempfile

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    env = dict(
        os.environ,
        WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(store.port),
        OMP_NUM_THREADS="1",
        TORCHELASTIC_USE_AGENT_STORE="True",
        GLOO_SOCKET_IFNAME="lo",
    )
    logs = [tempfile.TemporaryFile(mode="w+") for _ in range(nproc)]
    procs = [
        subprocess.Popen(
            [sys.executable, script, *argv],
            env=dict(env, RANK=str(r), LOCAL_RANK=str(r)),
            stdout=logs[r],
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(nproc)
    ]
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        del store
    outs = []
    for log in logs:
        log.seek(0)
        outs.append(log.read())
        log.close()
    bad = [r for r, p in enumerate(procs) if p.returncode]
    if bad:
        raise SystemExit(f"rank {bad[0]} failed:\n{outs[bad[0]][-4000:]}")
    return outs[0]
