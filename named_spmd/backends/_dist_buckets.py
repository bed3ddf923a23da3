"""Gradient buckets: the overlapped gradient psums of a backward pass, grouped into few all-reduces.

Data parallel training reduces one gradient per replicated parameter (the psum of each implicit
pvary, :mod:`._dist_overlap`). Most of them are small, and each all-reduce has a fixed cost
(a round trip through the group: benchmarks/bench_distributed.py's "One all-reduce" of 4
bytes), so DDP packs gradients into ~25 MB buckets, one all-reduce each. So does this module:

* A bucket belongs to one backward pass (autograd graph task), one process group, one dtype and
  one device: it never mixes them. Bucket boundaries depend only on the order and sizes of the
  gradients and on the configured size, so every rank of a group forms the same buckets (the
  same size must be set on every rank; debug mode reports ranks whose all-reduces differ).
* A gradient of at least a bucket's bytes (every gradient, when the size is 0), or of at least
  :data:`ALONE_BYTES`, is not bucketed: it is reduced alone, in place when nothing else holds
  it, as soon as it is made. Copying a large gradient into a bucket and its sum back out costs
  more than the all-reduce it would save (benchmarks/bench_distributed.py's Megatron MLP step at
  H=1024, whose two 8 MB weights would otherwise share a bucket).
* Otherwise it joins the open bucket of its key; a gradient that does not fit starts the open
  bucket first, and a bucket with no room left starts at once. Buckets still open start at the
  end of the backward pass, before the first wait. So buckets hold at most the configured bytes
  (DDP's hold at least that much).
* A member's gradient is handed to autograd behind an ``AsyncCollectiveTensor`` whose registered
  work (:class:`BucketWork`) starts the bucket if it is still open and waits for it: an op that
  reads a gradient early (a second contribution to the same ``.grad``) gets the right values, at
  the price of a smaller bucket.

Exact numbers: the sum of a concatenation is the concatenation of the sums, element by element;
on two ranks (a + b == b + a) it is bitwise the per-gradient result. On more, gloo's ring may add
an element's terms in another order, as DDP's buckets do: equal to rounding.
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as dist

from .._errors import SpmdError
from ._dist_comm import Comm

DEFAULT_MB = 25.0  # DDP's bucket_cap_mb
#: the smallest gradient reduced alone whatever the bucket size (module doc): on 2 gloo ranks
#: two all-reduces of 2 MB each cost what one of their 4 MB concatenation and its copies do
ALONE_BYTES = 2 * (1 << 20)
ENV = "NAMED_SPMD_GRAD_BUCKET_MB"
_MB = 1 << 20

_override: list[float | None] = [None]  # set_grad_bucket_mb's value; None: the environment


def set_grad_bucket_mb(mb: float | None = DEFAULT_MB) -> None:
    """Set the size of the buckets in which a real mesh reduces gradients, in MB (2**20 bytes).

    The gradient psums of a backward pass (one per replicated parameter of a data-parallel step)
    are packed into buckets of at most this size, one all-reduce each, started as they fill and
    overlapped with the rest of the backward pass, as DDP's ``bucket_cap_mb``. ``0`` reduces
    every gradient on its own; ``None`` goes back to ``NAMED_SPMD_GRAD_BUCKET_MB`` (default 25).
    A gradient of 2 MB or more is reduced on its own, in place, whatever the size: copying it
    into a bucket and back would cost more than the all-reduce it saves.
    Set the same size on every rank (each call checks it). Values and gradients do not depend on it.
    """
    if mb is not None:
        _check_mb(mb, f"set_grad_bucket_mb({mb!r})", "ns.set_grad_bucket_mb(25)")
    _override[0] = mb


def _check_mb(mb: Any, where: str, fix: str) -> float:
    ok = isinstance(mb, (int, float)) and not isinstance(mb, bool) and math.isfinite(mb)
    if not ok or mb < 0:
        raise SpmdError(
            f"{where}: the gradient bucket size is a number of megabytes >= 0 (0 reduces every "
            f"gradient on its own), got {mb!r}. Fix: {fix} (DDP's default)."
        )
    return float(mb)


def bucketed(nbytes: int, cap: int) -> bool:
    """Whether a gradient of ``nbytes`` joins a bucket of ``cap`` bytes (else: alone)."""
    return nbytes < cap and nbytes < ALONE_BYTES


def bucket_bytes(task: int = -1) -> int:
    """The configured bucket size in bytes, read at every gradient psum; the environment
    variable once per backward pass (autograd graph ``task``, when not -1: a read of
    ``os.environ`` costs three Python calls per gradient) and parsed once per distinct text."""
    mb = _override[0]
    if mb is not None:
        return int(mb * _MB)
    if task != -1 and _ENV_READ[0] == task:
        return _ENV_READ[1]
    raw = os.environ.get(ENV, "")
    size = _PARSED.get(raw)
    if size is None:
        size = _PARSED[raw] = _parse_env(raw)
    _ENV_READ[:] = [task, size]
    return size


_PARSED: dict[str, int] = {}  # environment variable text -> bucket size in bytes
_ENV_READ: list = [-1, 0]  # the graph task that last read the environment, and what it read


def _parse_env(raw: str) -> int:
    if not raw.strip():
        return int(DEFAULT_MB * _MB)
    try:
        value: Any = float(raw)
    except ValueError:
        value = raw
    return int(_check_mb(value, f"{ENV}={raw!r}", f"set it to a number such as {ENV}=25") * _MB)


class Bucket:
    """Gradients of one key, reduced by one all-reduce of their concatenation.

    Each member stays its own tensor (the gradient itself where nothing else holds it, else a
    copy): at the start the members are concatenated into one buffer, and once the sum is in,
    it is copied back into them. A gradient is then a plain tensor of its own, as unbucketed
    (a view into a shared buffer pins it, and torch cannot deep-copy or save a DTensor whose
    local tensor starts at an offset in its storage); DDP copies both ways too by default."""

    def __init__(self, key: tuple, comm: Comm, capacity_bytes: int):
        self.key = key
        self.comm = comm
        self.capacity = capacity_bytes
        self.members: list[torch.Tensor] = []
        self.nbytes = 0
        self.flat: torch.Tensor | None = None  # the concatenation, while it is reduced
        self.started: Any = None  # the all-reduce's work, once started
        self.copied = False  # the sums are back in the members

    def add(self, buf: torch.Tensor) -> bool:
        """``buf`` (contiguous, owned by the bucket) joins if it fits, and receives its sum at
        the wait; a bucket with no room left then starts. Whether it joined."""
        nbytes = self.nbytes + buf.numel() * buf.element_size()
        if nbytes > self.capacity:
            return False
        self.members.append(buf)
        self.nbytes = nbytes
        if nbytes >= self.capacity:
            self.start()
        return True

    def start(self) -> None:
        """Close the bucket and start its all-reduce (once)."""
        if OPEN.get(self.key) is not None and OPEN[self.key].bucket is self:
            del OPEN[self.key]
        if self.started is None:
            self.flat = torch.cat([m.view(-1) for m in self.members])
            self.started = self.comm.start_all_reduce_(self.flat)

    def wait(self) -> None:
        """Start if still open, wait (a failed peer raises RankFailedError), copy back (once:
        the registry calls this again for every member when its record is dropped)."""
        if self.copied:
            return
        self.start()
        self.comm.finish(self.started)
        assert self.flat is not None  # start made it
        sizes = [m.numel() for m in self.members]
        torch.split_with_sizes_copy(self.flat, sizes, out=[m.view(-1) for m in self.members])
        self.flat, self.copied = None, True

    def done(self) -> bool:
        return self.copied


class BucketWork(dist.Work):
    """What torch's work registry holds for a bucket's buffer: waiting for it (any read of a
    member's AsyncCollectiveTensor) starts the bucket if still open, then waits for its sum.
    It refers to the bucket, never the other way round (no cycle keeps a buffer alive)."""

    def __init__(self, bucket: Bucket):
        super().__init__()
        self.bucket = bucket

    def wait(self, timeout: Any = None) -> bool:
        self.bucket.wait()
        return True

    def is_completed(self) -> bool:
        return self.bucket.done()


# (graph task, id(process group), dtype, device) -> the work of the bucket being filled
OPEN: dict[tuple, BucketWork] = {}


def start_open(task: int | None = None) -> None:
    """Start every open bucket (of graph task ``task``, or all), in the order they opened: the
    same order on every rank."""
    for key in [k for k in OPEN if task is None or k[0] == task]:
        OPEN[key].bucket.start()
