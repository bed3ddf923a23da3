"""Debug mode: ``NAMED_SPMD_DEBUG=1`` or :func:`set_debug`, read by every backend at each call."""

from __future__ import annotations

import os

_override: bool | None = None


def set_debug(enabled: bool | None = True) -> None:
    """Debug mode: check more on every call, at a cost (not for training runs).

    On a real mesh, before every collective all ranks check that their group calls the same one
    (a store round trip per collective and rank), plain-tensor inputs and invariant outputs are
    compared across ranks by digest. On a mesh of one instance (simulated, or one rank), every call
    is type-checked (otherwise only the first call per signature is; docs/design.md section 5.8).
    ``None`` goes back to the ``NAMED_SPMD_DEBUG`` environment variable.
    """
    global _override
    _override = enabled


def debug_enabled() -> bool:
    if _override is not None:
        return _override
    return os.environ.get("NAMED_SPMD_DEBUG", "") not in ("", "0")
