"""The distributed backend of the ``backend`` fixture: one launch of tests/dist_worker.py per world
size runs every catalogue program of that world on real processes (gloo on 127.0.0.1) and saves
each rank's :class:`_backends.Run` per program; tests then read them. The same launch runs the
sampled cases and the behaviour checks that tests/test_distributed.py asserts on.
"""

from __future__ import annotations

import json
import os

import torch
from _backends import compare_runs, reference_run, simulated_run
from _dist_launch import launch

DEVICE = os.environ.get("NAMED_SPMD_TEST_DEVICE", "cpu")
WORKER = "tests/dist_worker.py"
SAMPLES = 50  # sampled cases per launch: seeds SEED, SEED + 1, ...
SEED = 1234


class Launch:
    def __init__(self, world: int, late: bool, out_dir):
        self.world, self.late, self.out_dir = world, late, str(out_dir)
        flags = ["--late-reductions"] if late else []
        self.finished = launch(
            [
                WORKER,
                "programs",
                "--samples",
                str(SAMPLES),
                "--seed",
                str(SEED),
                "--device",
                DEVICE,
                "--out",
                self.out_dir,
                *flags,
            ],
            world,
            # 8 ranks of about 60 s of work each share 2 cores; with a second suite beside it
            # (a loaded machine): a kill at the limit would read as a rank failure
            900,
        )
        self.results = [json.loads(line) for line in self.finished.lines("RESULT")]
        self.checks = [json.loads(line) for line in self.finished.lines("CHECK")]
        self._runs = {}

    def tail(self) -> str:
        return (
            f"timed out: {self.finished.timed_out}; rank 0 output tail:\n"
            + (self.finished.outputs[0][-3000:])
        )

    def rank_runs(self, rank: int) -> dict:
        if rank not in self._runs:
            path = os.path.join(self.out_dir, f"rank{rank}.pt")
            assert os.path.exists(path), self.tail()
            self._runs[rank] = torch.load(path, weights_only=False)
        return self._runs[rank]

    def run(self, program):
        """Every rank's run of ``program`` (and with DTensor inputs) through the test body;
        returns rank 0's for the caller's own comparison."""
        ref, sim = reference_run(program), simulated_run(program)
        for rank in range(self.world):
            entry = self.rank_runs(rank).get(program.name)
            assert entry is not None, f"rank {rank} has no result for {program.name}"
            assert "error" not in entry, f"rank {rank}: {entry['error']}"
            replayed = entry["replayed"].extra["replays"]
            assert replayed == 1, f"rank {rank}: the second call was no replay of the first"
            for variant in ("run", "dtensor", "replayed"):
                if variant in entry:
                    try:
                        compare_runs(entry[variant], ref, sim, program)
                    except AssertionError as e:
                        raise AssertionError(f"rank {rank} ({variant}): {e}") from e
        return self.rank_runs(0)[program.name]["run"]
