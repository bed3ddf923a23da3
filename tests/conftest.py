"""Shared test set-up.

JAX (the oracle in test_jax_oracle.py) reads XLA_FLAGS once, when it is first imported: ask for 8
fake CPU devices here, before any test module can import it.
"""

from __future__ import annotations

import os

_DEVICES_FLAG = "--xla_force_host_platform_device_count=8"
if "xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _DEVICES_FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
