"""Calls replayed from a plan on a real mesh (``named_spmd._plan``), on 2 processes:
``python tests/plan_worker.py`` under a 2-process job (tests/test_plans.py launches it).

Each case calls one mapped function several times, changing what the function does between
calls where the case says so (a flag read in the function, a branch on an invariant value, a step
number), and compares every call's outputs, gradients or error with the same calls typed one by
one (``_replay.ENABLED`` off: no plan is kept or replayed), which is the independent reference.
Prints one ``OUTCOME {json}`` line per case and rank: the problems found, and how many calls were
replayed from a plan.
"""

from __future__ import annotations

import contextlib
import gc
import os
import sys
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import report_outcomes  # noqa: E402

import named_spmd as ns  # noqa: E402
from named_spmd import P, _replay  # noqa: E402
from named_spmd._replay import checked_signatures  # noqa: E402
from named_spmd.backends import _dist_pvary  # noqa: E402

STATE: dict[str, Any] = {"flag": False, "record": False}


def _params(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shapes = {"x": (8, 6), "w1": (6, 8), "b1": (8,), "w2": (8, 6), "s": (1,), "v": (16,)}
    return {k: torch.randn(s, generator=g, dtype=torch.float64) for k, s in shapes.items()}


def _flag_adds_a_use(x, w1, b1, w2, s, v):
    """The flag adds a use of an invariant parameter beside a varying value (an implicit pvary
    the plan does not have)."""
    h = torch.tanh(x @ w1)
    if STATE["flag"]:
        h = h + b1
    return ns.pmean((h @ w2).pow(2).mean().reshape(1), "x")


def _flag_swaps_an_operand(x, w1, b1, w2, s, v):
    """The same ops either way; the flag picks an invariant operand instead of a varying one
    (whose gradient then needs the psum of an implicit pvary)."""
    h = torch.tanh(x @ w1)
    y = h * (b1 if STATE["flag"] else v)
    return ns.pmean((y @ w2).pow(2).mean().reshape(1), "x")


def _flag_drops_a_keyword_operand(x, w1, b1, w2, s, v):
    """Invariant operands passed by keyword beside a varying one (``F.layer_norm``'s weight and
    bias: implicit pvarys a replay makes at their keywords); the flag drops the bias."""
    h = F.layer_norm(torch.tanh(x @ w1), (8,), weight=b1, bias=None if STATE["flag"] else b1)
    return ns.pmean((h @ w2).pow(2).mean().reshape(1), "x")


def _megatron(x, w1, b1, w2, s, v):
    """Column- then row-parallel over "x" with a bias: the partial sum of the row-parallel
    product is inferred from the blocks (``_blocks``) and reduced; no branch."""
    h = F.gelu(x @ w1 + b1)
    y = ns.psum(h @ w2, "x")
    return (y * y).mean().reshape(1)


def _branch_on_invariant_value(x, w1, b1, w2, s, v):
    """A branch on the sign of an invariant input: the other branch returns a value that
    varies over "x" under out_specs P(), which typing refuses."""
    h = torch.tanh(x @ w1)
    if float(s) > 0:
        return ns.pmean((h @ w2).pow(2).mean().reshape(1), "x")
    return (h @ w2).pow(2).mean().reshape(1)


def _step_number(x, w1, b1, w2, s, v, step):
    """A Python step number as an argument: every other step uses the bias."""
    h = torch.tanh(x @ w1)
    if step % 2:
        h = h * b1
    return ns.pmean((h @ w2).pow(2).mean().reshape(1), "x")


def _flag_varies_a_collective_result(x, w1, b1, w2, s, v):
    """The flag makes an invariant collective result varying (``ns.pvary``: no op of the call
    made it), so the product of the blocks of ``b1`` and ``w2`` that it scales is varying, not
    a partial sum; adding to the partial sum is an error. The same ops either way."""
    r = ns.psum(b1, "x")
    if STATE["flag"]:
        r = ns.pvary(r, "x")
    z = (b1 * r) @ w2 + 1.0
    return ns.pmean(z.pow(2).mean().reshape(1), "x")


def _block(h, w2):
    return ns.psum(torch.tanh(h) @ w2, "x")


def _flag_checkpoints(x, w1, b1, w2, s, v):
    """The flag checkpoints a block holding a collective (non-reentrant): its recomputation in
    backward must find the call again."""
    h = x @ w1 + b1
    if STATE["flag"]:
        y = checkpoint(_block, h, w2, use_reentrant=False)
    else:
        y = _block(h, w2)
    return (y * y).mean().reshape(1)


def _flag_fills_an_integer(x, w1, b1, w2, s, v):
    """The flag fills a tensor with the int 1 instead of the float 1.0 (equal Python values,
    so equal arguments unless keyed with their types): the partial sum of the blocks of ``b1``
    and ``w2`` cast to its integer dtype is an error, where a replay of the float call's plan
    would sum the truncated parts."""
    t = torch.full((), 1 if STATE["flag"] else 1.0, dtype=None)
    z = ns.psum((b1 @ w2).type_as(t), "x").double()
    return z.pow(2).mean().reshape(1) + ns.pmean(x.sum().reshape(1), "x")


def _flag_gathers_varying(x, w1, b1, w2, s, v):
    """The flag makes one all_gather's result varying instead of reduced (the same ops and
    collectives either way): its product with the partial sum of the blocks of ``b1`` and
    ``w2`` is then an error, where a replay of the reduced call's steps would type it
    unreduced."""
    g = ns.all_gather(x, "x", tiled=True, to="varying" if STATE["flag"] else "reduced")
    return ns.psum(g * (b1 @ w2), "x").pow(2).mean().reshape(1)


def _reshapes_by_a_value(x, w1, b1, w2, s, v):
    """A size read off an invariant input (``reshape`` by a tensor; the same ops whatever its
    value): by the whole rows, the blocks of ``w1`` stay its columns' and its product with
    ``w2`` is a partial sum, whose ``exp`` is an error; by one row, no block survives."""
    rows = (1 + 5 * (s > 0).long()).reshape(())
    p = w1.reshape(rows, -1).reshape(6, 4) @ w2
    return ns.pmean(torch.exp(p).mean().reshape(1), "x")


def _flag_slices_by_a_varying_bound(x, w1, b1, w2, s, v):
    """The flag makes a slice's bound varying (``ns.axis_index``) instead of invariant (the same
    ops either way): reading it is a read of a varying value, whose value alone, equal to the
    invariant bound's on one instance, does not tell it."""
    bound = ns.axis_index("x") if STATE["flag"] else ns.pmax(ns.axis_index("x"), "x")
    return ns.pmean(x[bound:].pow(2).mean().reshape(1), "x")


# name -> (function, in_specs, per call: (flag, sign of s) or a step number)
CASES = {
    "flag_adds_a_use": (_flag_adds_a_use, False, [(False, 1), (False, 1), (True, 1), (False, 1)]),
    # planned with the use: a replay pvarys b1 with the other parameters at its entry, and a call
    # without the use must leave b1 no gradient (None, as typed), not zeros
    "flag_drops_a_use": (_flag_adds_a_use, False, [(True, 1), (True, 1), (False, 1), (True, 1)]),
    "flag_swaps_an_operand": (_flag_swaps_an_operand, False, [(False, 1), (False, 1), (True, 1)]),
    "flag_drops_a_keyword_operand": (
        _flag_drops_a_keyword_operand,
        False,
        [(False, 1), (False, 1), (True, 1), (False, 1)],
    ),
    "megatron": (_megatron, True, [(False, 1), (False, 1), (False, 1)]),
    "branch_on_invariant_value": (_branch_on_invariant_value, False, [(0, 1), (0, 1), (0, -1)]),
    "step_number": (_step_number, False, [0, 1, 2, 3]),
    "flag_checkpoints": (_flag_checkpoints, True, [(False, 1), (False, 1), (True, 1), (True, 1)]),
    "flag_varies_a_collective_result": (
        _flag_varies_a_collective_result,
        True,
        [(True, 1), (True, 1), (False, 1), (True, 1)],
    ),
    "flag_fills_an_integer": (
        _flag_fills_an_integer,
        True,
        [(False, 1), (False, 1), (True, 1), (False, 1)],
    ),
    "flag_gathers_varying": (
        _flag_gathers_varying,
        True,
        [(False, 1), (False, 1), (True, 1), (False, 1)],
    ),
    "reshapes_by_a_value": (_reshapes_by_a_value, True, [(False, -1), (False, -1), (False, 1)]),
    "flag_slices_by_a_varying_bound": (
        _flag_slices_by_a_varying_bound,
        False,
        [(False, 1), (False, 1), (True, 1), (False, 1)],
    ),
}


def _specs(split_w: bool, step: bool):
    w1, b1, w2 = (P(None, "x"), P("x"), P("x")) if split_w else (P(), P(), P())
    specs = (P("x"), w1, b1, w2, P(), P("x"))
    return (*specs, None) if step else specs


def _calls(name: str, mesh) -> tuple[list, int]:
    """Every call of the case: its loss and gradients, or its error (class and message)."""
    fn, split_w, calls = CASES[name]
    step = name == "step_number"
    f = ns.spmd_map(fn, mesh=mesh, in_specs=_specs(split_w, step), out_specs=P())
    results, hoisted = [], []
    for k, call in enumerate(calls):
        params = _params(k)
        if not step:
            STATE["flag"] = bool(call[0])
            params["s"] = params["s"].abs() * call[1]
        leaves = [t.requires_grad_() for t in params.values()]
        try:
            loss = f(*leaves, call) if step else f(*leaves)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            hoisted.append(_entry_node(loss) is not None)
            grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
            results.append((loss.detach(), [g if g is None else g.detach() for g in grads]))
        except ns.SpmdError as e:
            results.append((type(e).__name__, str(e)))
    plans = checked_signatures(f).values()
    counts = [sum(getattr(p, k, 0) for p in plans) for k in ("replays", "divergences")]
    return results, [*counts, hoisted]


def _entry_node(loss: torch.Tensor) -> Any:
    """The node of ``loss``'s graph by which a replay on a real mesh pvarys its parameters at
    its entry, all at once (``_dist_pvary.PvaryAll``); None: none."""
    todo, seen = [loss.grad_fn], set()
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        if type(node).__name__ == "PvaryAllBackward":
            return node
        seen.add(node)
        todo.extend(n for n, _ in node.next_functions)
    return None


def _scaled_rows(x, w):
    return x * w


def _local_then_global(mesh) -> tuple[list, list]:
    """A local call on blocks of 5 rows, then a global call on a value of 5 rows (the same
    shapes, dtypes and specs): the global call's blocks are unequal (3 and 2 rows), which the
    local call's plan must not decide. Each call's output (global value), and the gradients of
    its inputs; and the dense ``x * w`` and its gradients (the reference)."""
    f = ns.spmd_map(_scaled_rows, mesh=mesh, in_specs=(P("x"), P()), out_specs=P("x"))
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(5, 3, generator=g, dtype=torch.float64), torch.randn(3, generator=g)
    w = w.double()
    got, want = [], []
    for local in (True, True, False, False):
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        out = f.local(xs, ws) if local else f(xs, ws).full_tensor()
        gx, gw = torch.autograd.grad(out.sum(), (xs, ws))
        got.append((out.detach(), [gx, gw]))
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        dense = xs * ws
        gx, gw = torch.autograd.grad(dense.sum(), (xs, ws))
        # a local call's w is replicated: its gradient sums both ranks' blocks (equal here)
        want.append((dense.detach(), [gx, gw * 2 if local else gw]))
    return got, want


@contextlib.contextmanager
def _works_kept():
    """Every all-reduce work started in the block kept until its end, as a backend's worker
    thread may keep one past its wait (gloo lets go of it a moment later: under load, after the
    caller's next ``gc.collect``): what the work holds must not keep a call's context alive."""
    group = torch.distributed.ProcessGroup
    allreduce, kept = group.__dict__["allreduce"], []  # (the unbound method)

    def keep(self, *args, **kwargs):
        kept.append(allreduce.__get__(self, group)(*args, **kwargs))
        return kept[-1]

    group.allreduce = keep
    try:
        yield
    finally:
        group.allreduce = allreduce


def _steps(fn, mesh, n: int, recording=lambda k: (False, False)) -> tuple[list, dict]:
    """``n`` calls of ``fn`` (flag on), call ``k`` recorded by a ``CommMode`` around the call
    and inside the body as ``recording(k)`` says (``STATE["record"]``): each call's loss and
    gradients; whether its graph pvarys the parameters at its entry; whether its context is
    freed once the call's graph is (after ``gc.collect``, while the call's all-reduce works are
    still held: ``_works_kept``); and each recorded call's counts."""
    f = ns.spmd_map(fn, mesh=mesh, in_specs=_specs(False, False), out_specs=P())
    got, hoisted, freed, counts = [], [], [], {}
    STATE["flag"] = True
    for k in range(n):
        leaves = [t.requires_grad_() for t in _params(k).values()]
        around, STATE["record"] = recording(k)
        with _works_kept():
            with ns.CommMode() if around else contextlib.nullcontext() as comms:
                loss = f(*leaves).full_tensor()
                grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
            got.append((loss.detach(), list(grads)))
            node = _entry_node(loss)
            hoisted.append(node is not None)
            context = None if node is None else weakref.ref(node.spmd)
            del loss, node
            gc.collect()
            freed.append(context is None or context() is None)
        inside = STATE.pop("comms", None)
        if inside is not None:
            inside.__exit__(None, None, None)
            comms = inside
        if comms is not None:
            counts[k] = sorted([*key, n] for key, n in comms.counts().items())
    return got, {"hoisted": hoisted, "freed": freed, "counts": counts}


def _second_order(mesh) -> tuple[list, dict]:
    """A gradient differentiated again (``create_graph``) through replays whose parameters are
    pvary'd at their entry: each call's loss and second derivatives, and the hoisting seen."""
    f = ns.spmd_map(_flag_adds_a_use, mesh=mesh, in_specs=_specs(False, False), out_specs=P())
    got, hoisted = [], []
    STATE["flag"] = True
    for k in range(3):
        leaves = [t.requires_grad_() for t in _params(k).values()]
        loss = f(*leaves).full_tensor()
        hoisted.append(_entry_node(loss) is not None)
        g = torch.autograd.grad(loss.sum(), leaves[1:4], create_graph=True)
        second = torch.autograd.grad(sum(d.pow(2).sum() for d in g), leaves, allow_unused=True)
        got.append((loss.detach(), [d if d is None else d.detach() for d in second]))
    return got, {"hoisted": hoisted}


def _flag_records(x, w1, b1, w2, s, v):
    """``STATE["record"]``: a ``CommMode`` entered in the body, after the parameters' pvary at
    a replay's entry, and left by the caller after the backward (``_steps``)."""
    if STATE["record"]:
        STATE["comms"] = ns.CommMode().__enter__()
    return _flag_adds_a_use(x, w1, b1, w2, s, v)


def _recorded(mesh) -> tuple[list, dict]:
    """Replays of a call planned under a ``CommMode`` on rank 0 only: the next one recorded on
    rank 1 only (the ranks' backward all-reduces must still match: each rank pvarys the
    parameters at the entry alike), one on both ranks, one whose body enters the mode."""
    rank = torch.distributed.get_rank()
    around = [(rank == 0, False), (rank == 1, False), (False, False), (True, False), (False, True)]
    return _steps(_flag_records, mesh, len(around), around.__getitem__)


def _written_in_place(x, w1, b1, w2, s, v):
    """``w2`` written in place, without grad, before its first use."""
    with torch.no_grad():
        w2.mul_(1.0)
    return _flag_adds_a_use(x, w1, b1, w2, s, v)


def _in_place(mesh) -> tuple[list, dict]:
    """A parameter written in place in the body before its first use: the alias a replay made
    of it at its entry (no autograd view of it) serves it."""
    return _steps(_written_in_place, mesh, 3)


def _rank_local(x, w1, b1, w2, s, v):
    """What ``STATE["local"]`` sets on this rank alone: a type read (the call is not planned),
    or ``w2`` written in place, without grad, before its first use."""
    if STATE["local"] == "read":
        ns.vma(x)
    if STATE["local"] == "write":
        with torch.no_grad():
            w2.mul_(1.0)
    return _flag_adds_a_use(x, w1, b1, w2, s, v)


# call k: (what rank 0 does alone, what rank 1 does alone); rank 0 reads a type in the first
# call (rank 1 plans it, rank 0 plans the next, which rank 1 replays), rank 1 sets debug mode,
# another bucket size, writes w2 in place, passes inputs of other shapes
_RANK_LOCAL = [
    ("read", None),
    (None, None),
    (None, "debug"),
    (None, "bucket"),
    (None, "write"),
    (None, "shapes"),
    (None, None),
]


def _ranks_differ(mesh) -> tuple[list, dict]:
    """Calls in which one rank alone differs (:data:`_RANK_LOCAL`): where its backward's
    all-reduces would differ (a replay pvarying the parameters at its entry where the other
    rank types the call), neither rank makes those casts, and the call is the typed one; debug
    mode, a bucket size or inputs that differ raise on both ranks (the message naming the
    settings only where the inputs are alike): each call's loss and gradients, or its error."""
    f = ns.spmd_map(_rank_local, mesh=mesh, in_specs=_specs(False, False), out_specs=P())
    STATE["flag"], rank, got = True, torch.distributed.get_rank(), []
    for k, local in enumerate(_RANK_LOCAL):
        mine = local[rank]
        STATE["local"] = mine
        ns.set_debug(mine == "debug" or None)
        ns.set_grad_bucket_mb(1 if mine == "bucket" else None)
        leaves = [t.requires_grad_() for t in _params(k).values()]
        if mine == "shapes":
            leaves[0] = torch.zeros(10, 6, dtype=torch.float64, requires_grad=True)
        try:
            loss = f(*leaves).full_tensor()
            grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
            got.append((loss.detach(), list(grads)))
        except ns.SpmdError as e:
            got.append([type(e).__name__, "[settings: " in str(e)])
        finally:
            ns.set_debug(None)
            ns.set_grad_bucket_mb(None)
    errors = [k for k, g in enumerate(got) if isinstance(g, list)]
    return got, {"errors": errors, "settings named": [k for k in errors if got[k][1]]}


def _hoisted_apart(mesh) -> tuple[list, dict]:
    """Replays of one plan, which pvary the parameters at their entry before the start-of-call
    check is finished once a replay's check agreed; before call 3, rank 1 alone forgets that
    agreement (as a rank whose plan was made after a call that failed on some ranks only): call
    3 raises alike on both ranks, call 4 checks first, call 5 hoists early again. Each call's
    loss and gradients, or its error; per call, whether it hoisted early; the calls whose error
    names the early hoisting."""
    f = ns.spmd_map(_flag_adds_a_use, mesh=mesh, in_specs=_specs(False, False), out_specs=P())
    STATE["flag"], rank, got, early = True, torch.distributed.get_rank(), [], []
    for k in range(6):
        plans = [p for p in checked_signatures(f).values() if hasattr(p, "hoistable")]
        if k == 3 and rank == 1 and plans:
            plans[0].hoistable.agreed = False
        early.append(bool(plans) and _dist_pvary.hoists_early(plans[0].hoistable))
        leaves = [t.requires_grad_() for t in _params(k).values()]
        try:
            loss = f(*leaves).full_tensor()
            grads = torch.autograd.grad(loss.sum(), leaves, allow_unused=True)
            got.append((loss.detach(), list(grads)))
        except ns.SpmdError as e:
            got.append(["SpmdError", "before the start-of-call check finished" in str(e)])
    told = [k for k, g in enumerate(got) if isinstance(g, list) and g[1]]
    return got, {"early": early, "told": told}


# each call's gradient bucket size (on every rank) and whether b1 requires grad
_SETTINGS = [(None, True), (None, True), (1e-4, True), (1e-4, True), (None, False), (None, True)]


def _settings_change(mesh) -> tuple[list, dict]:
    """Calls of one function whose memos (a replay's groups pvary'd at its entry, per bucket
    size; a signature's leaves) must follow what changes between them on every rank: the
    gradient bucket size (100 bytes: below a group's size, which splits it) and whether ``b1``
    requires grad: each call's loss and gradients, and whether its graph pvarys at its entry."""
    f = ns.spmd_map(_flag_adds_a_use, mesh=mesh, in_specs=_specs(False, False), out_specs=P())
    STATE["flag"], got, hoisted = True, [], []
    for k, (mb, b1_grad) in enumerate(_SETTINGS):
        ns.set_grad_bucket_mb(mb)
        try:
            leaves = [t.requires_grad_() for t in _params(k).values()]
            leaves[2].requires_grad_(b1_grad)
            loss = f(*leaves).full_tensor()
            wrt = [t for t in leaves if t.requires_grad]
            grads = torch.autograd.grad(loss.sum(), wrt, allow_unused=True)
            got.append((loss.detach(), list(grads)))
            hoisted.append(_entry_node(loss) is not None)
        finally:
            ns.set_grad_bucket_mb(None)
    return got, {"hoisted": hoisted}


_MB = 1 << 17  # float64 elements in 1 MB


def _many_weights(x, *ws):
    """Each weight cast by its own implicit pvary (times a varying scalar)."""
    s = x.sum()
    return ns.pmean(sum((s * w).sum() for w in ws).reshape(1), "x")


def _large_inputs(mesh) -> tuple[list, dict]:
    """Parameters of 1 MB each, 5 MB together (above the old 4 MB limit per group), and one of
    2 MB: each replay pvarys the five at its entry, one node, and leaves the large one to its
    bucket: each call's loss and gradients, whether it pvarys at its entry, and how many inputs
    that node takes."""
    sizes = [_MB] * 5 + [2 * _MB]
    f = ns.spmd_map(_many_weights, mesh=mesh, in_specs=(P("x"), *[P()] * 6), out_specs=P())
    got, hoisted, taken = [], [], []
    for k in range(3):
        g = torch.Generator().manual_seed(k)
        x = torch.randn(8, 3, generator=g, dtype=torch.float64)
        ws = [torch.randn(n, generator=g, dtype=torch.float64).requires_grad_() for n in sizes]
        loss = f(x, *ws).full_tensor()
        node = _entry_node(loss)
        hoisted.append(node is not None)
        taken.append(0 if node is None else sum(n is not None for n, _ in node.next_functions))
        got.append((loss.detach(), list(torch.autograd.grad(loss.sum(), ws))))
    return got, {"hoisted": hoisted, "taken": taken}


def _gather(b, a2, v):
    """Gathered whole or stacked (``tiled=flag``: the same ops either way, another shape): the
    blocks of ``b`` and ``a2``'s columns meet on the contracted dim when whole, a partial sum,
    to which adding a bias is an error, where a replay of the stacked call's steps would type
    it varying."""
    gathered = ns.all_gather(v, "tp", tiled=STATE["flag"])
    return ns.psum(ns.psum(a2 @ (b * gathered) + 1.0, "dp"), "tp").sum().reshape(1)


def _gather_tiled_by_a_flag(mesh) -> tuple[list, dict]:
    """:func:`_gather` on a (2, 1) mesh, stacked, stacked, whole, stacked: each call's loss and
    gradients, or its error."""
    simulated = getattr(mesh, "device_mesh", None) is None
    mesh = ns.make_mesh((2, 1), ("dp", "tp"), simulated=simulated)
    f = ns.spmd_map(_gather, mesh=mesh, in_specs=(P("dp"), P(None, "dp"), P("tp")), out_specs=P())
    got = []
    for k, whole in enumerate([False, False, True, False]):
        STATE["flag"] = whole
        g = torch.Generator().manual_seed(k)
        shapes = [(2,), (3, 2), (1,)]
        leaves = [torch.randn(n, generator=g, dtype=torch.float64).requires_grad_() for n in shapes]
        try:
            loss = f(*leaves)
            loss = loss.full_tensor() if hasattr(loss, "full_tensor") else loss
            got.append((loss.detach(), list(torch.autograd.grad(loss.sum(), leaves))))
        except ns.SpmdError as e:
            got.append((type(e).__name__, str(e)))
    plans = checked_signatures(f).values()
    return got, {
        "replays": [sum(getattr(p, k, 0) for p in plans) for k in ("replays", "divergences")]
    }


def _problems(got: list, want: list) -> list[str]:
    problems = []
    for k, (g, w) in enumerate(zip(got, want)):
        if isinstance(w[0], str) or isinstance(g[0], str):
            if g != w:
                problems.append(f"call {k}: {g!r:.300} != typed {w!r:.300}")
            continue
        try:
            torch.testing.assert_close(g[0], w[0], rtol=1e-12, atol=1e-12)
            for a, b in zip(g[1], w[1]):
                assert (a is None) == (b is None), (a, b)
                if a is not None:
                    torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
        except AssertionError as e:
            problems.append(f"call {k}: {e}"[:600])
    return problems


def run(name: str, mesh) -> dict:
    if name == LOCAL_THEN_GLOBAL:
        got, want = _local_then_global(mesh)
        return {"problems": _problems(got, want), "calls": len(got)}
    if name in EVERY_CALL:
        got, seen = EVERY_CALL[name](mesh)
        _replay.ENABLED = False
        try:
            want, typed = EVERY_CALL[name](mesh)
        finally:
            _replay.ENABLED = True
        return {"problems": _problems(got, want), "calls": len(got), **seen, "typed": typed}
    got, (*replays, hoisted) = _calls(name, mesh)
    _replay.ENABLED = False
    try:
        want, _ = _calls(name, mesh)
    finally:
        _replay.ENABLED = True
    problems = _problems(got, want)
    return {"problems": problems, "replays": replays, "calls": len(got), "hoisted": hoisted}


LOCAL_THEN_GLOBAL = "local_then_global"
# name -> its calls, compared with the same calls typed: ([(loss, grads), ...], what it saw)
EVERY_CALL = {
    "second_order": _second_order,
    "recorded": _recorded,
    "in_place": _in_place,
    "ranks_differ": _ranks_differ,
    "hoisted_apart": _hoisted_apart,
    "settings_change": _settings_change,
    "large_inputs": _large_inputs,
    "gather_tiled_by_a_flag": _gather_tiled_by_a_flag,
}

if __name__ == "__main__":
    report_outcomes([*CASES, LOCAL_THEN_GLOBAL, *EVERY_CALL], run)
