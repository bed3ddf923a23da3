"""Fault scenarios of tests/faults_worker.py whose first exchange rides behind the start-of-call
check (``named_spmd/backends/_dist_carried.py``): a replayed ragged_all_to_all's offsets, an
uneven call's first ppermute and an even call's, and a call's ppermutes deferred together
(``carried_halos``, ``carried_uneven_halos``)."""

from __future__ import annotations

import contextlib

import torch
from _faults_common import good_call, report

import named_spmd as ns
from named_spmd import P
from named_spmd.backends import _dist_carried


def ragged_inputs(variant: int) -> tuple[torch.Tensor, ...]:
    """A ragged_all_to_all over ("dp", "tp") (member = rank) with one slot per member: member i
    sends ``c[i][j]`` rows of its 8 to member j, placed there in source order (global inputs:
    the members' blocks concatenated), and the dense result it must give."""
    n, rows, m = 4, 8, 16
    c = [[(i + 2 * j + variant) % 3 + (i == j) for j in range(n)] for i in range(n)]
    x = torch.arange(float(n * rows * 2)).reshape(n * rows, 2)
    send = torch.tensor(c)
    in_off = torch.cumsum(send, 1) - send
    out_off = torch.tensor([[sum(c[k][j] for k in range(i)) for j in range(n)] for i in range(n)])
    recv = send.T.contiguous()
    want = torch.zeros(n * m, 2)
    for j in range(n):
        at = j * m
        for i in range(n):
            start = i * rows + in_off[i, j].item()
            want[at : at + c[i][j]] = x[start : start + c[i][j]]
            at += c[i][j]
    meta = [t.reshape(-1) for t in (in_off, send, out_off, recv)]
    return (x, torch.zeros(n * m, 2), *meta, want)


def carried(mesh, rank):
    """A ragged_all_to_all replayed (its offsets' exchange carried behind the start-of-call
    check) with other values each call, a replay on some ranks only (the plan forgotten on
    rank 3), and calls that go apart before their first collective (rank 0 runs a psum first
    in its replay): right values, or one error on every rank, and the next call runs."""
    spec = P(("dp", "tp"))
    calls = {"n": 0}

    def f(x, out, *meta):
        if calls["n"] and rank == 0:  # (Python state that differs between ranks)
            x = x + ns.psum(x, ("dp", "tp")) * 0
        return ns.ragged_all_to_all(x, out, *meta, ("dp", "tp"))

    mapped = ns.spmd_map(f, mesh=mesh, in_specs=spec, out_specs=spec)
    g = ns.spmd_map(
        lambda x, out, *meta: ns.ragged_all_to_all(x, out, *meta, ("dp", "tp")),
        mesh=mesh,
        in_specs=spec,
        out_specs=spec,
    )

    def right(variant: int, forget: bool = False) -> None:
        *args, want = ragged_inputs(variant)
        if forget and rank == 3:
            g._signatures.clear()  # (its table of plans: the call is typed again here alone)
        with ns.CommMode() as comm:
            got = g(*args).full_tensor()
        if not torch.equal(got, want):
            raise ns.SpmdError(f"ragged_all_to_all gave {got.tolist()}, not {want.tolist()}")
        axes = ("dp", "tp")
        if comm.counts() != {
            ("forward", op, axes): 1 for op in ("all_to_all", "ragged_all_to_all")
        }:
            raise ns.SpmdError(f"counted {comm.counts()}")

    for variant in range(3):
        report(rank, f"carried_{variant}", lambda: right(variant))
    report(rank, "carried_forgotten", lambda: right(3, forget=True))
    report(rank, "carried_after", lambda: right(4))
    *args, _ = ragged_inputs(0)
    report(rank, "apart_plan", lambda: mapped(*args))
    calls["n"] = 1
    report(rank, "apart", lambda: mapped(*args))
    report(rank, "apart_then", lambda: good_call(mesh))


def carried_permute(mesh, rank):
    """An uneven call's first ppermute, replayed (carried behind the start-of-call check): other
    values each call, halos of another shape on every rank (its flag set: moved again) or on
    rank 1 only (the simulated mesh's error on every rank), the plan forgotten on rank 3, and
    rank 0 running a psum first, then ranks whose first ppermutes differ only in their axes or
    dtype (:func:`permute_swapped`): right values, or one error on every rank, and the next
    call runs."""
    axes = ("dp", "tp")
    sizes = (3, 2, 2, 2)
    state = {"rows": {}, "psum_first": False}
    shift = [(j, j + 1) for j in range(3)]

    def f(u):
        if state["psum_first"] and rank == 0:  # (Python state that differs between ranks)
            u = u + ns.psum(u[:1], axes) * 0
        return ns.ppermute(u[-state["rows"].get(rank, 1) :], axes, shift)

    spec = P(ns.Blocks(axes, sizes), None)
    mapped = ns.spmd_map(f, mesh=mesh, in_specs=spec, out_specs=P(axes))

    def right(variant: int, forget: bool = False) -> None:
        u = torch.arange(18.0).reshape(9, 2) * (variant + 1)
        if forget and rank == 3:
            mapped._signatures.clear()  # (its table of plans: the call is typed again here alone)
        k = max(state["rows"].values(), default=1)
        ends = [sum(sizes[: j + 1]) for j in range(4)]
        want = torch.cat([torch.zeros(k, 2), *(u[e - k : e] for e in ends[:3])])
        _permuted_once(mapped, u, want, axes)

    for variant in range(3):
        report(rank, f"permute_{variant}", lambda: right(variant))
    state["rows"] = {r: 2 for r in range(4)}
    report(rank, "permute_rows", lambda: right(3))
    state["rows"] = {1: 2}
    report(rank, "permute_odd", lambda: right(4))
    state["rows"] = {}
    report(rank, "permute_odd_then", lambda: right(5))
    report(rank, "permute_forgotten", lambda: right(6, forget=True))
    report(rank, "permute_after", lambda: right(7))
    state["psum_first"] = True
    report(rank, "permute_apart", lambda: right(8))
    state["psum_first"] = False
    report(rank, "permute_apart_then", lambda: right(9))
    permute_swapped(mesh, rank)


def carried_even_permute(mesh, rank):
    """An even call's first ppermute, replayed: carried behind the start-of-call check (counted
    here), with other values each call; halos of another shape on every rank (their flags set:
    moved again, uncarried), the plan forgotten on rank 3, and rank 0 running a psum first:
    right values, or one error on every rank, and the next call runs."""
    axes = ("dp", "tp")
    state = {"rows": 1, "psum_first": False}
    shift = [(j, j + 1) for j in range(3)]
    carried = _count_carried_permutes()

    def f(u):
        if state["psum_first"] and rank == 0:  # (Python state that differs between ranks)
            u = u + ns.psum(u[:1], axes) * 0
        return ns.ppermute(u[-state["rows"] :], axes, shift)

    mapped = ns.spmd_map(f, mesh=mesh, in_specs=P(axes, None), out_specs=P(axes))

    def right(variant: int, rides: bool | None, forget: bool = False) -> None:
        u = torch.arange(16.0).reshape(8, 2) * (variant + 1)
        if forget and rank == 3:
            mapped._signatures.clear()  # (its table of plans: the call is typed again here alone)
        k, before = state["rows"], dict(carried)
        want = torch.cat([torch.zeros(k, 2), *(u[2 * j + 2 - k : 2 * j + 2] for j in range(3))])
        _permuted_once(mapped, u, want, axes)
        counted = (carried["rode"] - before["rode"], carried["runs"] - before["runs"])
        if counted != (rides, 1) and not (rides is None and counted[1] == 1):
            raise ns.SpmdError(f"carried {carried}, before the call {before}, rides {rides}")

    report(rank, "even_permute_plan", lambda: right(0, False))  # (the planned call)
    for variant in (1, 2):
        report(rank, f"even_permute_{variant}", lambda: right(variant, True))
    state["rows"] = 2
    report(rank, "even_permute_rows", lambda: right(3, False))  # (flagged: moved again)
    state["rows"] = 1
    report(rank, "even_permute_forgotten", lambda: right(4, False, forget=True))
    state["psum_first"] = True
    report(rank, "even_permute_apart", lambda: right(5, False))
    state["psum_first"] = False
    report(rank, "even_permute_apart_then", lambda: right(6, None))  # (typed, or replayed)
    report(rank, "even_permute_after", lambda: right(7, True))


def _count_carried_permutes() -> dict[str, int]:
    """Counts of the calls of ``_dist_carried.first_permute`` (``runs``) and of those whose
    ppermute rode behind the check (``rode``: a result, not None, or a deferred one read off
    the exchange's rows, not moved again)."""
    counts = {"runs": 0, "rode": 0}
    first, received = _dist_carried.first_permute, _dist_carried._received

    def counted(ctx, *args):
        out = first(ctx, *args)
        counts["runs"] += 1
        counts["rode"] += out is not None and not any(out is d for d in ctx.deferred)
        return out

    def counted_received(*args):
        counts["rode"] += 1
        return received(*args)

    _dist_carried.first_permute = counted
    _dist_carried._received = counted_received
    return counts


def permute_swapped(mesh, rank):
    """Members 0 and 1 swap their last rows (the same pairs on every rank), replayed; then rank
    0 alone runs it over "tp" (the pairs read there as its "tp" group's members), and rank 1
    alone sends int32 (the others float32, of the same element size): every rank must raise
    one error at once, not wait in exchanges that do not pair up, and the next call run."""
    axes = ("dp", "tp")
    sizes = (3, 2, 2, 2)
    state = {"apart": ""}

    def swap(u):
        h = u[-1:]
        if state["apart"] == "dtype" and rank == 1:  # (Python state that differs between ranks)
            h = h.to(torch.int32)
        over = "tp" if state["apart"] == "axes" and rank == 0 else axes
        return ns.ppermute(h, over, [(0, 1), (1, 0)]).float()

    spec = P(ns.Blocks(axes, sizes), None)
    mapped = ns.spmd_map(swap, mesh=mesh, in_specs=spec, out_specs=P(axes))

    def right(variant: int) -> None:
        u = torch.arange(18.0).reshape(9, 2) * (variant + 1)
        want = torch.cat([u[4:5], u[2:3], torch.zeros(2, 2)])  # member 1's last row to 0, ...
        _permuted_once(mapped, u, want, axes)

    for variant in range(2):
        report(rank, f"permute_swap_{variant}", lambda: right(variant))
    for apart in ("axes", "dtype"):
        state["apart"] = apart
        report(rank, f"permute_{apart}", lambda: right(2))
        state["apart"] = ""
        report(rank, f"permute_{apart}_then", lambda: right(3))


def _permuted_once(mapped, u, want, axes) -> None:
    """``mapped(u)`` equals ``want``, counted as one forward ppermute over ``axes``."""
    with ns.CommMode() as comm:
        got = mapped(u).full_tensor()
    if not torch.equal(got, want):
        raise ns.SpmdError(f"ppermute gave {got.tolist()}, not {want.tolist()}")
    if comm.counts() != {("forward", "ppermute", axes): 1}:
        raise ns.SpmdError(f"counted {comm.counts()}")


def carried_halos(mesh, rank):
    """An even call's first ppermutes, replayed: a halo exchange's two directions ride in one
    exchange behind the start-of-call check (counted here), with gradients; an operand written
    after its ppermute (the copy taken at the call is sent); a ppermute of a deferred result (a
    ring's second step: the first made before it); results returned unread (made at the end of
    the body); and rank 0 running a psum between the two: right values and gradients against
    the dense ones, or one error on every rank, and the next call runs."""
    axes = ("dp", "tp")
    down, up = [(j, j + 1) for j in range(3)], [(j + 1, j) for j in range(3)]
    cycle = [(j, (j + 1) % 4) for j in range(4)]
    state = {"psum_between": False, "read_between": False, "raise_between": False}
    counts = _count_carried_permutes()

    def halos(u, write=False):
        h = u[-1:] * 1
        top = ns.ppermute(h, axes, down)
        if write:
            h.add_(100.0)  # (after the call: not sent)
        if state["psum_between"] and rank == 0:  # (Python state that differs between ranks)
            u = u + ns.psum(u[:1], axes) * 0
        if state["read_between"] and rank == 0:  # (a rank's own print of a result)
            str(top)
        bottom = ns.ppermute(u[:1], axes, up)
        if state["raise_between"] and rank == 0:
            raise ValueError("rank 0 fails before the results are read")
        return torch.cat([top, u * 2, bottom])

    def kinds(u):  # float64, then complex128 at the next 16 bytes; one made under inference mode
        with torch.inference_mode():
            a = ns.ppermute(u[-1:].double(), axes, down)
        b = ns.ppermute(torch.complex(u[:1], u[:1]).to(torch.complex128), axes, up)
        return torch.cat([a.float(), u * 2, b.real.float() + b.imag.float()])

    stacked = ns.compile(_stacked)  # (made here: a scenario that runs no piece imports no Dynamo)

    def piece(u):  # the results read by a compiled piece, which the call's modes do not see
        top, bottom = ns.ppermute(u[-1:], axes, down), ns.ppermute(u[:1], axes, up)
        return stacked(top, u, bottom)

    def derivative(u):  # the second call's replay diverges into a torch.func transform
        y = ns.ppermute(u, axes, down)
        if state["grad"]:
            return torch.func.grad(lambda a: (a * a).sum())(y)
        return y * 2

    def ring(u):
        return ns.ppermute(ns.ppermute(u[-1:], axes, down) * 3, axes, down)

    def caught(u):  # the exchange's error caught: its unmade result returned, not read
        top = ns.ppermute(u[-1:], axes, down)
        try:
            return halos_after(u, top)
        except ns.SpmdError:
            return top

    def halos_after(u, top):
        if state["psum_between"] and rank == 0:
            u = u + ns.psum(u[:1], axes) * 0
        return torch.cat([top, u * 2, ns.ppermute(u[:1], axes, up)])

    def unread(u):
        return ns.ppermute(u[-1:], axes, down), ns.ppermute(u[:1], axes, up)

    def nested(u):  # a result read two list levels deep in an op's arguments
        top, one = ns.ppermute(u[-1:], axes, down), ns.ppermute(torch.tensor(1.0), axes, cycle)
        scale = torch.tensor([[one]])
        return halos_after(u, top) * scale

    def pairs(u):  # results read in a ppermute's pairs
        ids = [ns.ppermute(torch.tensor(j), axes, cycle) for j in range(4)]  # (j on each member)
        top = ns.ppermute(u[-1:], axes, [(ids[j], ids[j + 1]) for j in range(3)])  # (down)
        return halos_after(u, top)

    def wide(u):  # rows of 4096 bytes: two fill the exchange's row, a third runs after it
        third = ns.ppermute(u[:1], axes, down)
        return halos(u) + torch.cat([third * 0, torch.zeros_like(u), third * 0])

    def dense(u):  # the global result of ``halos``, member j's block of 2 rows at 4 j
        zero, blocks = torch.zeros(1, u.shape[1]), u.reshape(4, 2, -1)
        return torch.cat(
            [
                torch.cat([blocks[j - 1][-1:] if j else zero, blocks[j] * 2, blocks[j + 1][:1]])
                if j < 3
                else torch.cat([blocks[j - 1][-1:], blocks[j] * 2, zero])
                for j in range(4)
            ]
        )

    spec = P(axes, None)
    mapped = {
        "halos": ns.spmd_map(halos, mesh=mesh, in_specs=spec, out_specs=spec),
        "write": ns.spmd_map(
            lambda u: halos(u, write=True), mesh=mesh, in_specs=spec, out_specs=spec
        ),
        "ring": ns.spmd_map(ring, mesh=mesh, in_specs=spec, out_specs=spec),
        "caught": ns.spmd_map(caught, mesh=mesh, in_specs=spec, out_specs=spec),
        "unread": ns.spmd_map(unread, mesh=mesh, in_specs=spec, out_specs=(spec, spec)),
        "wide": ns.spmd_map(wide, mesh=mesh, in_specs=spec, out_specs=spec),
        "nested": ns.spmd_map(nested, mesh=mesh, in_specs=spec, out_specs=spec),
        "pairs": ns.spmd_map(pairs, mesh=mesh, in_specs=spec, out_specs=spec),
        "kinds": ns.spmd_map(kinds, mesh=mesh, in_specs=spec, out_specs=spec),
        "piece": ns.spmd_map(piece, mesh=mesh, in_specs=spec, out_specs=spec),
        "derivative": ns.spmd_map(derivative, mesh=mesh, in_specs=spec, out_specs=spec),
    }

    def right(name: str, variant: int, rode: int | None, ppermutes: int = 2, grad=False, width=2):
        u = (torch.arange(8.0 * width).reshape(8, width) * (variant + 1)).requires_grad_(grad)
        before = counts["rode"]
        # (a compiled piece runs compiled only where no CommMode records: counted apart)
        with ns.CommMode() if name != "piece" else contextlib.nullcontext() as comm:
            got = mapped[name](u)
        blocks = u.detach().reshape(4, 2, -1)
        if name == "ring":
            got = got.full_tensor()
            # (member j's row: member j - 2's last row, times 3)
            want = torch.cat([torch.zeros(2, 2), blocks[0, -1:] * 3, blocks[1, -1:] * 3])
        elif name == "derivative":  # (y * 2 either way: the gradient of sum(y * y))
            got = got.full_tensor()
            want = torch.cat([torch.zeros(2, 2), u.detach()[:6] * 2])
        elif name == "unread":
            got = torch.cat([g.full_tensor() for g in got])
            want = torch.cat([dense(u.detach())[[0, 4, 8, 12]], dense(u.detach())[[3, 7, 11, 15]]])
        else:
            want = dense(u.detach())
            if name == "kinds":
                want[3::4] *= 2  # (the real and the imaginary part)
            got = got.full_tensor()
        if not torch.equal(got.detach(), want):
            raise ns.SpmdError(f"{name} gave {got.tolist()}, not {want.tolist()}")
        if grad:
            _same_gradient(got, u, dense)
        counted = comm.counts().get(("forward", "ppermute", axes)) if comm else ppermutes
        if counted != ppermutes or rode not in (None, counts["rode"] - before):
            raise ns.SpmdError(f"{name}: {comm.counts()}, rode {counts['rode'] - before}")

    for name in ("halos", "write", "ring", "unread"):
        report(rank, f"halos_{name}_plan", lambda: right(name, 0, 0))
        for variant in (1, 2):
            report(
                rank, f"halos_{name}_{variant}", lambda: right(name, variant, 1 + (name != "ring"))
            )
    for variant, rode in ((0, 0), (1, 2)):  # (rode 1 where the row held 4096 bytes)
        report(rank, f"halos_wide_{variant}", lambda: right("wide", variant, rode, 3, width=1024))
    for name, rode, ppermutes in (("nested", 2, 3), ("pairs", 4, 6)):
        for variant in range(3):
            run = lambda: right(name, variant, rode if variant else 0, ppermutes)  # noqa: E731
            report(rank, f"halos_{name}_{variant}", run)
    report(rank, "halos_grad_plan", lambda: right("halos", 3, 0, grad=True))
    report(rank, "halos_grad", lambda: right("halos", 4, 2, grad=True))
    report(rank, "halos_caught_plan", lambda: right("caught", 0, 0))
    state["psum_between"] = True
    report(rank, "halos_apart", lambda: right("halos", 5, 2))
    report(rank, "halos_caught", lambda: mapped["caught"](torch.arange(16.0).reshape(8, 2)))
    state["psum_between"] = False
    report(rank, "halos_apart_then", lambda: right("halos", 6, 2))
    report(rank, "halos_caught_then", lambda: right("caught", 7, 2))
    state["read_between"] = True  # rank 0 reads its first result early: the rest moves again
    report(rank, "halos_read", lambda: right("halos", 7, 1))
    state["read_between"] = False
    state["raise_between"] = True  # (the others return: their results are not gathered)
    report(rank, "halos_raise", lambda: mapped["halos"](torch.arange(16.0).reshape(8, 2)))
    state["raise_between"] = False
    report(rank, "halos_raise_then", lambda: right("halos", 9, None))
    report(rank, "halos_raise_then_then", lambda: right("halos", 10, 2))
    report(rank, "halos_kinds_plan", lambda: right("kinds", 0, 0))
    report(rank, "halos_kinds", lambda: right("kinds", 1, 2))
    report(rank, "halos_piece_plan", lambda: right("piece", 0, 0))
    report(rank, "halos_piece", lambda: right("piece", 1, 2))
    state["grad"] = False
    report(rank, "halos_derivative_plan", lambda: right("derivative", 0, 0, ppermutes=1))
    report(rank, "halos_derivative", lambda: right("derivative", 1, 1, ppermutes=1))
    state["grad"] = True
    report(rank, "halos_derivative_transform", lambda: right("derivative", 2, 1, ppermutes=1))


def carried_uneven_halos(mesh, rank):
    """An uneven call's two ppermutes, replayed: the second rides with the first behind the
    start-of-call check (counted here), with gradients; halos of another row count on every
    rank (their flags set: the shapes exchanged, the data moved again) or on rank 1 only (the
    simulated mesh's error on every rank); and the next calls right."""
    axes, sizes = ("dp", "tp"), (3, 2, 2, 2)
    down, up = [(j, j + 1) for j in range(3)], [(j + 1, j) for j in range(3)]
    state: dict[str, dict[int, int]] = {"rows": {}}
    counts = _count_carried_permutes()

    def halos(u):
        r = state["rows"].get(rank, 1)
        top, bottom = ns.ppermute(u[-r:], axes, down), ns.ppermute(u[:r], axes, up)
        return torch.cat([top, u * 2, bottom])

    spec = P(ns.Blocks(axes, sizes), None)
    mapped = ns.spmd_map(halos, mesh=mesh, in_specs=spec, out_specs=P(axes))

    def dense(u, r):  # the global result of ``halos``: each member's rows in turn
        blocks, zero = u.split(sizes), torch.zeros(r, 2)
        return torch.cat(
            [
                torch.cat(
                    [
                        blocks[j - 1][-r:] if j else zero,
                        blocks[j] * 2,
                        blocks[j + 1][:r] if j < 3 else zero,
                    ]
                )
                for j in range(4)
            ]
        )

    def right(variant: int, rode: int, grad: bool = False) -> None:
        r = max(state["rows"].values(), default=1)
        u = (torch.arange(18.0).reshape(9, 2) * (variant + 1)).requires_grad_(grad)
        before = counts["rode"]
        with ns.CommMode() as comm:
            got = mapped(u).full_tensor()
        want = dense(u.detach(), r)
        if not torch.equal(got.detach(), want):
            raise ns.SpmdError(f"halos gave {got.tolist()}, not {want.tolist()}")
        if grad:
            _same_gradient(got, u, lambda v: dense(v, r))
        counted = comm.counts().get(("forward", "ppermute", axes))
        if counted != 2 or counts["rode"] - before != rode:
            raise ns.SpmdError(f"{comm.counts()}, rode {counts['rode'] - before}")

    report(rank, "uneven_halos_plan", lambda: right(0, 0))
    for variant in (1, 2):
        report(rank, f"uneven_halos_{variant}", lambda: right(variant, 2))
    report(rank, "uneven_halos_grad_plan", lambda: right(3, 0, grad=True))
    report(rank, "uneven_halos_grad", lambda: right(4, 2, grad=True))
    state["rows"] = {r: 2 for r in range(4)}
    report(rank, "uneven_halos_rows", lambda: right(5, 0))  # (flagged: moved again)
    report(rank, "uneven_halos_rows_then", lambda: right(6, 2))
    state["rows"] = {1: 1, 0: 2, 2: 2, 3: 2}
    report(rank, "uneven_halos_odd", lambda: right(7, 0))
    state["rows"] = {}
    report(rank, "uneven_halos_after", lambda: right(8, 0))  # (recalls 2 rows: flagged)
    report(rank, "uneven_halos_after_then", lambda: right(9, 2))


def _stacked(top: torch.Tensor, u: torch.Tensor, bottom: torch.Tensor) -> torch.Tensor:
    return torch.cat([top, u * 2, bottom])


def _same_gradient(got: torch.Tensor, u: torch.Tensor, dense) -> None:
    """The gradient of a weighted sum of ``got`` (made from ``u``) equals the dense one's."""
    weights = torch.arange(float(got.numel())).reshape(got.shape)
    (mine,) = torch.autograd.grad((got * weights).sum(), u)
    v = u.detach().requires_grad_(True)
    (theirs,) = torch.autograd.grad((dense(v) * weights).sum(), v)
    if not torch.equal(mine, theirs):
        raise ns.SpmdError(f"the gradient {mine.tolist()}, not {theirs.tolist()}")
