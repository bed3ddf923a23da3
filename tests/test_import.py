"""``import named_spmd`` stays light: no real backend, no torch.distributed machinery, no Dynamo.

Measured with torch 2.13: ``import torch`` by itself already imports ``torch.distributed`` and
``torch.distributed.device_mesh``, so the check is what importing named_spmd *adds* on top of
``import torch``, plus the absolute absence of the heavier modules.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = [
    "torch.distributed._functional_collectives",
    "torch.distributed.tensor",
    "named_spmd.backends.distributed",
    "torch._dynamo",  # the compile paths' (a second more); trace-time constants are marked without it
]
NOT_ADDED = ["torch.distributed.device_mesh", "torch.distributed", *HEAVY]

SCRIPT = """
import json, sys
import torch
before = set(sys.modules)
import named_spmd
mesh = named_spmd.make_mesh((2, 2), ("a", "b"))  # a simulated mesh must not load them either
added = sorted(set(sys.modules) - before)
print(json.dumps({"added": added, "present": sorted(sys.modules)}))
"""


def _import_report() -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, check=True, timeout=120
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_does_not_load_the_real_backend_or_heavy_torch_distributed_modules():
    report = _import_report()
    added, present = set(report["added"]), set(report["present"])
    assert "named_spmd" in added  # the measurement works
    assert not [m for m in NOT_ADDED if m in added], sorted(added)
    assert not [m for m in HEAVY if m in present]
    assert not [m for m in added if m.startswith("torch.distributed")], sorted(added)
