"""``Capabilities``: what a backend can run, fixed for the backend (``Backend.capabilities``).

Below the backends and the API, so that every backend declares its own and the API reads them
(docs/design.md section 5.6); what else decides a call per call (``simulate_per_instance``) is
the backend's ``uneven_state()``, not a capability.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True, kw_only=True)
class Capabilities:
    """What a backend's calls can be (each field stated: no default)."""

    #: Whether Dynamo traces a whole call on this backend. Where not, a call made inside a
    #: ``torch.compile``d function runs eagerly: a graph break around it (``SpmdFunction``).
    traceable: bool
    #: Whether a process holds only its own instances' blocks (a real mesh), so that
    #: ``SpmdFunction.local`` passes them in and out as they are (``Call.local``). Where not
    #: (the process holds every instance), a local call is the global call.
    local_blocks: bool
    #: Whether it takes inputs split into blocks of unequal sizes: a dim its axes do not
    #: divide (``torch.chunk``'s blocks) and the sizes a ``Blocks`` entry gives. Where not,
    #: such an input is a ``SpecError``.
    uneven_blocks: bool
