"""The torch.distributed backend on real processes (gloo on 127.0.0.1), against the simulated one.

Each test is one multi-process launch (tests/dist_worker.py) with a hard timeout, so a hang fails
the test instead of stalling the suite. The workers run every program of the "Core" and
"Gradients" acceptance lists plus 50 sampled cases (tests/programs_dist.py, from the one sampler
tests/_sampler.py) on both backends in each process, and compare values, gradients, per-device
types (vma) of every value and communication counts.
Budget on a 2-core machine: 8-25 s for 4 processes, 16-40 s for 8, 6-25 s for the failure
tests, depending on load (mostly interpreter start-up of the processes).

Set NAMED_SPMD_TEST_DEVICE=cuda (and enough GPUs) to run the same tests on NCCL.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _dist_launch import ROOT, launch  # noqa: E402
from _dist_programs import SAMPLES, SEED  # noqa: E402
from _sampler import COLLECTIVES, features  # noqa: E402
from programs_dist import sampled_cases  # noqa: E402

pytestmark = pytest.mark.distributed

DEVICE = os.environ.get("NAMED_SPMD_TEST_DEVICE", "cpu")
WORKER = "tests/dist_worker.py"


def _report(finished, results) -> str:
    bad = [r for r in results if r["problems"]]
    lines = [f"{len(bad)} failing (case, rank) results; first ones:"]
    for r in bad[:6]:
        lines.append(f"  {r.get('case', r.get('check'))} rank {r['rank']}: {r['problems'][:2]}")
        if "traceback" in r:
            lines.append("    " + r["traceback"][-800:].replace("\n", "\n    "))
    if finished.timed_out or not results:
        lines.append(
            f"timed out: {finished.timed_out}; rank 0 output tail:\n" + finished.outputs[0][-3000:]
        )
    return "\n".join(lines)


@pytest.mark.parametrize(
    "world, late", [(4, False), (8, False), (4, True)], ids=["4", "8", "4-late-reductions"]
)
def test_sampled_cases_and_checks_agree_with_simulated(world, late, dist_launches):
    """The launch that also runs the catalogue for test_programs.py's ``distributed`` backends.

    ``late``: the overlapped gradient psums are delayed to their waits and read as NaN
    before, so a consumer that does not wait fails deterministically (dist_worker)."""
    run = dist_launches(world, late)
    finished, results, checks = run.finished, run.results, run.checks
    assert not finished.timed_out, _report(finished, results)
    assert len(results) == world * SAMPLES, _report(finished, results)
    assert all(not r["problems"] for r in results), _report(finished, results)
    # every sampled input is exercised by the gradient check somewhere
    assert sum(r["nonzero_grads"] for r in results) > len(results)
    assert len(checks) == 40 * world, _report(finished, checks)
    assert all(not c["problems"] for c in checks), _report(finished, checks)
    assert finished.returncodes == [0] * world


@pytest.mark.parametrize("world", [4, 8])
def test_sampled_cases_draw_every_collective(world):
    """What the launches above run: every collective, on meshes of the world's size."""
    cases = sampled_cases(world, SAMPLES, SEED)
    assert {c.world for c in cases} == {world}
    seen = set().union(*(features(c.sampled) for c in cases))
    assert set(COLLECTIVES) <= seen, f"never sampled: {set(COLLECTIVES) - seen}"


def test_failing_rank_and_mismatched_collectives_are_reported_not_hung():
    world, bad_rank = 4, 1
    finished = launch(
        [WORKER, "failures", "--bad-rank", str(bad_rank), "--device", DEVICE],
        world,
        120,
        NAMED_SPMD_TIMEOUT="60",
    )
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert not finished.timed_out, finished.outputs[0][-3000:]
    mismatch = sorted((o for o in outcomes if o["mode"] == "mismatch"), key=lambda o: o["rank"])
    fail = sorted((o for o in outcomes if o["mode"] == "fail"), key=lambda o: o["rank"])
    assert len(mismatch) == world and len(fail) == world, finished.outputs[0][-3000:]
    for o in mismatch:  # debug mode: every rank learns what every rank called
        assert o["error"] == "SpmdError", o
        assert "called different collectives" in o["message"], o
        assert "rank 0: psum([4], torch.float32" in o["message"], o
        assert "rank 1: psum([2], torch.float32" in o["message"], o
    for o in fail:
        assert o["seconds"] < 30, o  # bounded: nobody waits for the dead rank's collective
        if o["rank"] == bad_rank:
            assert o["error"] == "ValueError", o
        else:
            assert o["error"] == "RankFailedError", o
            assert (
                f"rank {bad_rank} (mesh coordinates dp=0, tp=1) failed inside spmd_map"
                in (o["message"])
            ), o
            assert "ValueError: injected failure on purpose" in o["message"], o


def test_torch_func_transforms_inside_the_function_agree_with_simulated():
    """Types survive torch.func transforms inside the function (a varying result typed
    invariant was returned silently under P()); vmap over collectives and mixing; gradients
    through collectives (torch.autograd.grad was typed as an op, pvary-ing the loss)."""
    import torch
    import transforms_inside

    import named_spmd as ns

    finished = launch([os.path.join("tests", "transforms_inside.py")], 2, 120)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 2 * len(transforms_inside.PROGRAMS), finished.outputs[0][-3000:]
    mesh = ns.make_mesh((2,), ("x",), simulated=True)
    for o in outcomes:
        want = transforms_inside.run(o["name"], mesh)
        dense = transforms_inside.DENSE.get(o["name"])
        if dense is not None:  # both backends against the definition, not only each other
            assert "value" in want, want
            torch.testing.assert_close(
                torch.tensor(want["value"], dtype=torch.float64),
                dense(*transforms_inside.arguments()),
                rtol=1e-12,
                atol=1e-12,
            )
        if "error" in want:
            assert o.get("error") == want["error"], (o, want)
            assert o["message"] == want["message"], (o["message"], want["message"])
        else:
            assert "value" in o, o
            torch.testing.assert_close(
                torch.tensor(o["value"], dtype=torch.float64),
                torch.tensor(want["value"], dtype=torch.float64),
                rtol=1e-12,
                atol=1e-12,
                msg=o["name"],
            )


def test_calls_after_a_caught_error_run_or_fail_clearly_on_every_rank():
    world = 4
    finished = launch([os.path.join("tests", "recovery.py")], world, 120, NAMED_SPMD_TIMEOUT="60")
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    by_phase = {p: [o for o in outcomes if o["phase"] == p] for p in ("symmetric", "asymmetric")}
    assert len(by_phase["symmetric"]) == world, finished.outputs[0][-3000:]
    assert all(o.get("ok") for o in by_phase["symmetric"]), by_phase["symmetric"]
    assert len(by_phase["asymmetric"]) == world, finished.outputs[0][-3000:]
    for o in by_phase["asymmetric"]:
        assert "problem" not in o, o
        assert o["first"] == ("ValueError" if o["rank"] == 0 else "RankFailedError"), o
        assert o["next"] == "SpmdError", o
        assert "out of step" in o["message"] and "Fix: restart the job" in o["message"], o
        assert o["seconds"] < 30, o  # bounded: no rank waits out NAMED_SPMD_TIMEOUT


def test_debug_mode_checks_plain_inputs_and_replicated_outputs_agree():
    world = 4
    finished = launch([os.path.join("tests", "debug_checks.py")], world, 120, NAMED_SPMD_DEBUG="1")
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 9 * world, finished.outputs[0][-3000:]
    for o in outcomes:
        if o["case"].endswith("_agree"):
            assert o.get("ok"), o  # no false alarm
        elif o["case"] == "inputs_differ":  # every rank computes the same verdict
            assert o["error"] == "SpmdError", o
            assert "plain-tensor input leaves [1]" in o["message"] and "Fix:" in o["message"], o
            assert (  # the wording of the reason (it once read "they are a plain tensor is")
                "differ between ranks, but a plain tensor is the global value, the same on every "
                "rank." in o["message"]
            ), o
        elif o["case"] == "pairs_differ":  # every rank sees both signatures: its group's, or
            # the other group's failure where that is posted before its partner's value comes
            # (a store exchange leaves on any failure: test_faults.py, decides alike)
            assert o["error"] in ("SpmdError", "RankFailedError"), o
            assert "called different collectives" in o["message"], o
            assert "pairs=[(0, 1)]" in o["message"] and "pairs=[(1, 0)]" in o["message"], o
        else:  # ranks whose group differs raise; the others learn it from them
            assert o["error"] in ("SpmdError", "RankFailedError"), o
            assert "typed invariant over ('tp',)" in o["message"], o
            assert "torch.manual_seed(rank)" in o["message"], o


def test_a_hanging_rank_is_named_by_its_peers_at_the_timeout(tmp_path):
    world = 4
    finished = launch(
        [os.path.join("tests", "hanging_rank.py")],
        world,
        120,
        HANG_TIMEOUT="4",
        HANG_DIR=str(tmp_path),
    )
    tail = f"returncodes {finished.returncodes}\n" + "\n".join(
        f"--- rank {r}\n{o[-1500:]}" for r, o in enumerate(finished.outputs)
    )
    assert not finished.timed_out, tail
    outcomes = {o["rank"]: o for o in map(json.loads, finished.lines("OUTCOME"))}
    assert sorted(outcomes) == list(range(world)), tail
    for rank, o in outcomes.items():
        assert o["error"] == "RankFailedError", o
        if rank != 2:  # the peers stop at the timeout and name the rank that never came
            assert o["seconds"] < 15, o
            assert "Rank 2 (mesh coordinates i=2) never reached a collective" in o["message"], o
        else:  # the hung rank ends once it finds its peers gone (seconds after its hang)
            assert o["seconds"] < 30, o


def test_checkpoint_around_the_call_differentiates_twice_as_simulated():
    """Non-reentrant checkpoint around a real-mesh call, differentiated twice: torch's own
    control-flow exception passes through (it was reported as a rank failure), and the second
    derivative through the psum equals the simulated mesh's."""
    import checkpoint_around
    import torch

    import named_spmd as ns

    finished = launch([os.path.join("tests", "checkpoint_around.py")], 2, 120)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 2, finished.outputs[0][-3000:]
    want = checkpoint_around.gradients(ns.make_mesh((2,), ("x",), simulated=True))
    for o in outcomes:
        assert "error" not in o, o
        for key in ("value", "gx", "gw", "hw"):
            torch.testing.assert_close(
                torch.tensor(o[key], dtype=torch.float64),
                torch.tensor(want[key], dtype=torch.float64),
                rtol=1e-12,
                atol=1e-12,
                msg=key,
            )


def _bucket_all_reduces(sizes: list[int], mb) -> int:
    """All-reduces of gradients of ``sizes`` bytes (one dtype, in the order backward reaches
    them) packed into buckets of ``mb`` MB (None: the 25 MB default): a gradient of at least a
    bucket's bytes, or of 2 MiB, goes alone, one that does not fit starts a new bucket."""
    cap = int((25.0 if mb is None else mb) * 2**20)
    count, room = 0, 0
    for size in sizes:
        if size >= min(cap, 2 * 2**20):
            count += 1
        elif size > room:
            count, room = count + 1, cap - size
        else:
            room -= size
    return count


def _expected_all_reduces(mb) -> int:
    """All-reduces of one uniform backward pass (tests/grad_buckets.py): buckets per dtype."""
    import grad_buckets as gb

    per_dtype = ((gb.N64, gb.ITEM_BYTES), (gb.N32, gb.ITEM_BYTES // 2))
    return sum(_bucket_all_reduces([item] * n, mb) for n, item in per_dtype)


def _expected_view_all_reduces(mb) -> int:
    """All-reduces of the view chain's backward pass (tests/grad_buckets.py), its weights
    reached last first (taller and square ones alternate)."""
    import grad_buckets as gb

    sizes = [gb.SIDE * (gb.SIDE + 3 * (k % 2)) * 8 for k in reversed(range(gb.N_VIEWS))]
    return _bucket_all_reduces(sizes, mb)


@pytest.mark.parametrize("late", [False, True], ids=["overlapped", "late-reductions"])
def test_bucketed_gradient_psums_equal_unbucketed_and_simulated(late):
    """Gradient psums packed into buckets (size 0, room for 3 and 7 weights, the 25 MB default)
    on 2 gloo processes: gradients bitwise equal to the per-gradient run and equal to the
    simulated mesh; torch counts one all-reduce per bucket while ns.CommMode records one
    logical psum per gradient, as on the simulated mesh, also in a second backward pass that
    accumulates into existing .grad tensors; nothing left in torch's work registry, plain .grad
    tensors. ``late``: reductions and bucket starts delayed to their waits, pending
    gradients NaN until then (a read that does not wait fails)."""
    import grad_buckets as gb

    import named_spmd as ns

    finished = launch([os.path.join("tests", "grad_buckets.py")] + ["--late"] * late, 2, 180)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 2 * len(gb.SIZES_MB), finished.outputs[0][-3000:]
    sim = ns.make_mesh((2,), ("dp",), simulated=True)
    want, want_psums = gb.uniform_grads(sim)
    want_mixed = gb.mixed_grads(sim)
    want_accumulated = gb.accumulated_grads(sim)
    want_views, want_view_psums = gb.view_grads(sim)
    want_large = gb.large_grads(sim)[0]
    want_shared = {axis: _dense_shared_grads(axis) for axis in (None, "dp")}
    assert want_psums == gb.N64 + gb.N32 and want_view_psums == gb.N_VIEWS
    for o in outcomes:
        assert "error" not in o, o["message"]
        where = f"rank {o['rank']}, bucket size {o['size']}"
        assert o["bitwise"] and o["mixed_bitwise"] and o["accumulated_bitwise"], where
        expected = _expected_all_reduces(gb.SIZES_MB[o["size"]])
        assert o["all_reduces"] == expected, (where, o)
        assert o["accumulating_all_reduces"] == expected, (where, o)  # the buckets kept
        assert o["hooked_ok"], where  # a post-accumulate hook sees the accumulated gradient
        assert o["psums"] == want_psums, where
        assert o["left"] == 0 and o["plain"], (where, o)
        for kind, views in o["views"].items():  # weights used through views share buckets
            assert views["all_reduces"] == _expected_view_all_reduces(gb.SIZES_MB[o["size"]]), (
                where,
                kind,
                views["all_reduces"],
            )
            assert views["psums"] == want_view_psums, (where, kind)
            assert views["contexts"] == 0, (where, kind)  # the graph freed, the call's context too
            _close_to(views["grads"], want_views, where)
        large = o["large"]  # a 2 MiB weight's gradient reduced alone, whatever the bucket size
        large_sizes = [r * c * 8 for r, c in reversed(gb.LARGE_SHAPES)]
        want_reduces = _bucket_all_reduces(large_sizes, gb.SIZES_MB[o["size"]])
        assert large["all_reduces"] == want_reduces, (where, large["all_reduces"])
        assert large["psums"] == len(gb.LARGE_SHAPES), (where, large["psums"])
        _close_to(large["grads"], want_large, where)
        for kind, shared in o["shared"].items():  # one gradient tensor for two weights
            assert shared["plain"] and shared["own"], (where, kind)  # plain, own storage
            _close_to(shared["grads"], want_shared[gb.SHARED_KINDS[kind][1]], where)
        assert o["checkpointed_view"] == {"grad_ok": True, "contexts": 0}, (where, o)
        inputs = o["dtensor_inputs"]  # an activation's gradient alone: no parameter's psum
        assert inputs["activation_only"] == {"psums": 0, "grad_ok": True}, (where, inputs)
        assert inputs["none_stays_none"] == [True] * 3, (where, inputs)  # dense torch's None
        assert "argument leaf 0 is a DTensor with placements" in inputs["first_bad"], where
        got_all = o["grads"] + o["mixed"] + o["accumulated"]
        # float32 tolerance throughout: the chain's float64 gradients also flow back through
        # its float32 part, whose matmuls round differently batched (the simulated mesh) and
        # alone on some CPUs (1e-7 relative seen); the real runs are compared bitwise above
        _close_to(got_all, want + want_mixed + want_accumulated, where, rtol=1e-5, atol=1e-6)


def test_pytree_collectives_take_one_process_group_call_per_group_of_leaves():
    """psum, pmean, pmax, pmin, all_gather and psum_scatter of pytrees on 2 gloo processes
    (tests/tree_reductions.py): the leaves of one dtype, requires_grad and type go through one
    collective (torch's count per call: one per group, a leaf of 2 MiB or more alone, leaf by
    leaf where a leaf is replicated; complex and bfloat16 leaves too, which travel as other
    dtypes), beside the start-of-call check's all-reduce; in backward, a transpose's collectives
    per leaf that gets a gradient (``tr.BACKWARD``), beside the boundary's gathers; outputs and
    gradients equal to the simulated mesh's, which applies them leaf by leaf (bitwise: on 2
    ranks a + b is b + a), an unused result's operand getting none, with its types and CommMode
    events; the calls after the first typed one replayed."""
    import tree_reductions as tr

    finished = launch([os.path.join("tests", "tree_reductions.py")], 2, 180)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 2 * len(tr.CASES), finished.outputs[0][-3000:]
    for o in outcomes:
        where = (o["rank"], o["name"])
        assert "error" not in o, (where, o.get("message"))
        want = {kind: 3 * n for kind, n in tr.CASES[o["name"]][4].items()}
        want["allreduce"] = want.get("allreduce", 0) + 3  # (the start-of-call check's)
        assert o["collectives"] == want, (where, o["collectives"])
        back = {kind: 3 * n for kind, n in tr.BACKWARD.get(o["name"], {}).items()}
        if o["had_grads"]:  # (the boundary's gather of each gradient of a global input)
            back["gather"] = back.get("gather", 0) + o["had_grads"]
        assert o["backward"] == back, (where, o["backward"])
        assert o["outs"] == 0.0 and o["grads"] == 0.0, (where, o)
        assert o["types_equal"] and o["events_equal"] and o["events"] > 0, (where, o)
        assert o["had_grads"] or o["name"] == "psum_mixed", (where, o)  # (no leaf requires grad)
        assert o["nones_equal"], (where, o)  # (an unused result's operand gets no gradient)
        unused = o["name"] in ("psum_unused_leaves", "all_gather_unused_leaves")
        assert o["nones"] == (6 if unused else 0), (where, o)
        assert o["replays"] == 1, (where, o["replays"])


def _close_to(got: list, want: list, where: str, rtol: float = 1e-12, atol: float = 1e-12):
    """Each of ``got`` (nested lists, from a worker's JSON) close to its tensor in ``want``."""
    import torch

    for g, ref in zip(got, want):
        torch.testing.assert_close(
            torch.tensor(g, dtype=ref.dtype), ref, rtol=rtol, atol=atol, msg=where
        )


def _dense_shared_grads(axis) -> list:
    """tests/grad_buckets.py's ``shared`` case on one device (the blocks of ``x`` stacked, the
    weights those of each block or broadcast to all): its two backward passes, then the first
    weight's gradient doubled in place."""
    import grad_buckets as gb

    x, a, b, w = (t.view(-1, 3, gb.SIDE) for t in gb.shared_params(axis))
    a, b = a.requires_grad_(), b.requires_grad_()
    for step in range(2):
        ((step + 1) * x * (a + b) * w).sum().backward()
    a.grad.mul_(2)
    return [a.grad.flatten(0, 1), b.grad.flatten(0, 1)]


@pytest.mark.parametrize("bad", [-1, float("nan"), "25", True])
def test_bucket_size_must_be_a_number_of_megabytes(bad):
    from named_spmd.backends._dist_buckets import set_grad_bucket_mb

    with pytest.raises(Exception) as caught:
        set_grad_bucket_mb(bad)
    assert type(caught.value).__name__ == "SpmdError"
    assert f"set_grad_bucket_mb({bad!r})" in str(caught.value) and "Fix:" in str(caught.value)


def test_bucket_size_from_the_environment(monkeypatch):
    from named_spmd._errors import SpmdError
    from named_spmd.backends import _dist_buckets as b

    b.set_grad_bucket_mb(None)
    monkeypatch.setenv(b.ENV, "0.5")
    assert b.bucket_bytes() == 2**19
    b.set_grad_bucket_mb(2)  # the call wins over the environment
    assert b.bucket_bytes() == 2 * 2**20
    b.set_grad_bucket_mb(None)
    monkeypatch.setenv(b.ENV, "lots")
    with pytest.raises(SpmdError, match="NAMED_SPMD_GRAD_BUCKET_MB='lots'.*Fix: set it"):
        b.bucket_bytes()
    monkeypatch.delenv(b.ENV)
    assert b.bucket_bytes() == 25 * 2**20


# --- in-place reductions: never on a tensor someone else can see --------------------------------


class _DoublingComm:
    """Stands in for a group of two identical members: an all-reduce doubles, in place."""

    def __init__(self):
        self.ptrs: list[int] = []
        self.group = object()  # gradient buckets are per process group

    def all_reduce_(self, buf, op=None, name="psum"):
        self.ptrs.append(buf.data_ptr())
        return buf.mul_(2)

    def start_all_reduce_(self, buf, name="psum"):
        """The overlapped form: nothing happens to ``buf`` until the work is waited for, as
        when the reduction is still in flight; so a read that does not wait sees wrong values."""
        import torch.distributed as dist

        comm = self

        class LateDoubling(dist.Work):
            def __init__(self):
                super().__init__()
                self.done = False

            def wait(self, timeout=None):
                if not self.done:
                    self.done = True
                    comm.all_reduce_(buf)
                return True

        return LateDoubling()

    def finish(self, work, name="psum"):
        work.wait()


class _OneComm:
    """The distributed context's part in a pvary's backward, over one fake comm."""

    def __init__(self, comm):
        self.comm = comm
        # (``_dist_pvary.Pvary`` asks the mesh for the comm)
        self.mesh = types.SimpleNamespace(comm=lambda axes: comm)

    def forward(self, rec, x, axes, params):
        return x.view_as(x)

    def psum_in_backward(self, g, axes, node):
        from named_spmd.backends import _dist_overlap

        return _dist_overlap.psum_in_backward(g, self.comm, node)


def _pvary(t, comm, chain="bridge"):
    """A pvary on a real mesh: the generic bridge with pvary's record (its backward is the
    overlapped gradient psum), or (``chain="pvary"``) the real mesh's own implicit pvary
    (``_dist_pvary.Pvary``, whose backward reaches the psum by a shorter chain)."""
    from named_spmd._autodiff import apply
    from named_spmd._collectives._record import PVARY_RECORD
    from named_spmd.backends import _dist_pvary, distributed  # noqa: F401  (calibrates)

    if chain == "pvary":
        return _dist_pvary._apply(t, PVARY_RECORD, _OneComm(comm), ("i",), ())
    return apply(PVARY_RECORD, _OneComm(comm), t, ("i",), ())


def _aliasing_programs():
    import torch

    def mm_only(p, a, b, c, seen):
        return (p(a) @ c).sum()

    def add_leaf(p, a, b, c, seen):
        return ((p(a) + b) @ c).sum()

    def add_pending_mm(p, a, b, c, seen):  # the same gradient tensor goes to b @ c's backward
        return (((b @ c) + p(a)) @ c).sum()

    def two_pvary(p, a, b, c, seen):
        return ((p(a) + p(b)) @ c).sum()

    def mul_by_self(p, a, b, c, seen):
        h = a @ c
        return (p(h) * h).sum()

    def hook_keeps_grad(p, a, b, c, seen):
        y = p(a)
        y.register_hook(lambda g: seen.append(g))
        return (y @ c).sum()

    def retain_grad(p, a, b, c, seen):
        y = p(a)
        y.retain_grad()
        seen.append(y)
        return (y @ c).sum()

    def hook_keeps_storage(p, a, b, c, seen):  # the storage object, not the tensor
        y = p(a)
        y.register_hook(lambda g: seen.append(g.untyped_storage()))
        return (y @ c).sum()

    del torch
    return [
        *(mm_only, add_leaf, add_pending_mm, two_pvary, mul_by_self),
        *(hook_keeps_grad, retain_grad, hook_keeps_storage),
    ]


def _kept_value(t):
    import torch

    if isinstance(t, torch.UntypedStorage):
        return torch.tensor([]).set_(t)
    return t.grad if t.grad is not None and t.dim() else t


@pytest.fixture
def bucket_mb(request):
    """The gradient bucket size for one test (MB; 0: every gradient alone), then the default."""
    from named_spmd.backends._dist_buckets import set_grad_bucket_mb

    set_grad_bucket_mb(request.param)
    yield request.param
    set_grad_bucket_mb(None)


@pytest.mark.parametrize("chain", ["bridge", "pvary"])
@pytest.mark.parametrize("bucket_mb", [0, 25, 24 * 4 / 2**20], indirect=True)
@pytest.mark.parametrize("prog", _aliasing_programs(), ids=lambda f: f.__name__)
def test_pvary_backward_reduces_in_place_only_when_nothing_else_sees_the_gradient(
    prog, bucket_mb, chain
):
    """Unbucketed (0): in place only on a gradient nothing else holds. Bucketed (the default,
    and room for 1.5 4x4 float32 gradients, so the second starts the first): a copy in the
    bucket, read early by the same programs. Either way the values of a doubling backward."""
    import torch

    def run(pvary):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(4, 4, generator=g, requires_grad=True) for _ in range(2))
        c = torch.randn(4, 4, generator=g)
        seen: list = []
        prog(pvary, a, b, c, seen).backward()
        kept = [_kept_value(t) for t in seen]
        return [a.grad, b.grad], [k.detach().clone() for k in kept]

    from _autograd_functions import identity_function

    # the reference: an out-of-place doubling backward
    Doubled = identity_function(lambda g: g * 2)
    comm = _DoublingComm()
    got, got_kept = run(lambda t: _pvary(t, comm, chain))
    want, want_kept = run(Doubled.apply)
    for x, y in zip(got + got_kept, want + want_kept):
        assert (x is None and y is None) or torch.equal(x, y), prog.__name__
    if prog.__name__ == "mm_only" and bucket_mb == 0:  # in place where it is safe
        from named_spmd.backends import _dist_donation

        assert _dist_donation.LIMITS["backward" if chain == "bridge" else "pvary"] is not None


def test_forward_reductions_overwrite_only_temporaries():
    """The real mesh's context decides, through the user's call of each reduction: a temporary
    that only the call chain holds is reduced in place; a named operand, a list entry, a view,
    a tensor whose storage object is held, a pytree leaf, an operand that requires grad, or an
    internal call's operand (pmax's tie mask in its transpose) is copied. (The multi-process
    cases reuse_after_psum_no_grad and dist_worker's held-storage check compare the values.)"""
    import torch

    import named_spmd as ns
    from named_spmd import _calls
    from named_spmd._collectives import RECORDS
    from named_spmd.backends import _dist_donation, distributed

    in_place: list[bool] = []

    class Recording(_dist_donation._Probe, distributed.DistributedContext):
        def all_reduce(self, x, axes, op):
            in_place.append(x is self.donated)
            return x

    def decided(run) -> list[bool]:
        in_place.clear()
        _calls.push(_dist_donation._Probe.made(Recording))
        try:
            with torch.no_grad():
                run()
        finally:
            _calls.pop()
        return list(in_place)

    h, w = torch.randn(4, 3), torch.randn(3, 5)
    held, kept = [], [h @ w]
    for op in (ns.psum, ns.pmean, ns.pmax, ns.pmin):
        assert decided(lambda op=op: op(h @ w, "i")) == [True], op
        assert decided(lambda op=op: op(h, "i")) == [False], op  # named
        assert decided(lambda op=op: op(kept[0], "i")) == [False], op  # held by a list
        assert decided(lambda op=op: op((h @ w)[1:], "i")) == [False], op  # a view
        assert decided(lambda op=op: op({"a": h @ w}, "i")) == [False], op  # a pytree leaf
        grad = lambda op=op: op(torch.ones(2).requires_grad_(), "i")  # noqa: E731
        assert decided(grad) == [False], op
        storage = lambda op=op: op(_holding(h @ w, held), "i")  # noqa: E731
        assert decided(storage) == [False], op
        internal = lambda: Recording.apply(probe, RECORDS["psum"], h @ w, ("i",), ())  # noqa: E731
        probe = _dist_donation._Probe.made(Recording)
        assert decided(internal) == [False]  # not the user's operand


def test_donation_refuses_a_tensor_without_storage(monkeypatch):
    """A plain tensor without storage (what a subclass's wrapper that lost its Python class on
    its way through functorch is) is never reduced in place, whatever its counts: the
    reduction would read address 0."""
    import torch

    from named_spmd.backends import _dist_donation

    for chain in ("forward", "backward"):
        monkeypatch.setitem(_dist_donation.LIMITS, chain, (99, 99, 99, 99))
        assert _dist_donation.exclusive(torch.zeros(4), 2, chain)  # the limits let one through
        assert not _dist_donation.exclusive(torch.empty(4, device="meta"), 2, chain)


def _holding(t, held):
    held.append(t.untyped_storage())
    return t


@pytest.mark.parametrize("chain", ["bridge", "pvary"])
@pytest.mark.parametrize("bucket_mb", [0], indirect=True)
def test_pvary_backward_reuses_a_fresh_gradient_buffer(bucket_mb, chain):
    import torch

    comm = _DoublingComm()
    a = torch.randn(4, 4, requires_grad=True)
    y = _pvary(a, comm, chain)
    incoming: list[int] = []
    y.register_hook(lambda g: incoming.append(g.data_ptr()))  # records, keeps nothing
    (y @ torch.randn(4, 4)).sum().backward()
    assert comm.ptrs == incoming  # reduced in place: no copy of the gradient


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_nccl_one_rank_cuda_path_agrees_with_simulated():
    from _dist_launch import child_env

    done = subprocess.run(
        [sys.executable, "tests/dist_nccl_smoke.py"],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0 and "smoke OK" in done.stdout, done.stdout + done.stderr[-3000:]


def test_torch_func_transforms_and_double_backward_over_the_call_agree_with_simulated():
    """torch.func grad / vjp / jvp / jacrev / jacfwd / hessian / vmap over a real-mesh call (plain
    global outputs under a transform), forward-mode AD with dual_level and double backward with
    respect to split and replicated plain inputs (DTensor outputs): the simulated mesh's numbers.
    A DTensor that a transform wraps is refused with the fix. (The second derivatives through a
    psum were wrong on the real mesh until the bridge applied pvary before a transpose that makes
    an invariant cotangent varying: Collective.backward.)"""
    import torch
    import transforms_over

    import named_spmd as ns

    finished = launch([os.path.join("tests", "transforms_over.py")], 2, 120)
    assert not finished.timed_out, finished.outputs[0][-3000:]
    outcomes = [json.loads(line) for line in finished.lines("OUTCOME")]
    assert len(outcomes) == 2 * len(transforms_over.PROGRAMS), finished.outputs[0][-3000:]
    mesh = ns.make_mesh((2,), ("x",), simulated=True)
    refused = transforms_over.REAL_MESH_ERRORS
    failed = [o for o in outcomes if "error" in o and o["name"] not in refused]
    assert not failed, [(o["rank"], o["name"], o["error"], o["message"][:300]) for o in failed]
    for o in outcomes:
        want = transforms_over.run(o["name"], mesh)
        assert "value" in want, (o["name"], want)
        if o["name"] in refused:
            assert o.get("error") == refused[o["name"]] and "Fix:" in o["message"], o
            continue
        got = [torch.tensor(v, dtype=torch.float64) for v in o["value"]]
        expected = [torch.tensor(v, dtype=torch.float64) for v in want["value"]]
        assert [t.shape for t in got] == [t.shape for t in expected], o["name"]
        for a, b in zip(got, expected):
            torch.testing.assert_close(
                a,
                b,
                rtol=1e-12,
                atol=1e-12,
                msg=lambda m, o=o: f"{o['name']} rank {o['rank']}: {m}",
            )


def test_the_leaves_behind_a_sum_are_found_once_each():
    """``torch_private.leaves_reached`` walks each node of the sums once: ``h + h`` repeated
    doubles the paths to the two leaves, not the nodes; so too through packings and views."""
    import torch

    from named_spmd._torch_private import leaves_reached

    a, b = torch.ones(2, requires_grad=True), torch.ones(2, requires_grad=True)
    h = a + b
    for _ in range(16):
        h = h + h
    leaves = leaves_reached(h.grad_fn)
    assert len(leaves) == 2 and {id(x) for x in leaves} == {id(a), id(b)}
    # packed parameters, each through views, and one behind a product (its gradient is another
    # tensor, not reached); each leaf once, however many packings reach it
    ws = [torch.ones(2, 3, requires_grad=True) for _ in range(4)]
    packed = torch.cat([ws[0].t().t(), ws[1].unsqueeze(0).squeeze(0), ws[2] * 2, ws[3]])
    packed = torch.stack([packed, torch.cat([ws[3], ws[0], ws[1], ws[1]])])
    leaves = leaves_reached(packed.view(-1).grad_fn)
    assert len(leaves) == 3 and {id(x) for x in leaves} == {id(ws[0]), id(ws[1]), id(ws[3])}


def test_the_start_of_call_check_is_finished_in_one_place():
    """``DistributedMesh.finish_pending_check`` calls the check in flight only while one is set
    (the check clears it itself, so it runs once: ``_dist_agree``), and is the one place that
    calls it: every other site goes through it."""
    import pathlib
    import re

    from named_spmd.backends._dist_mesh import DistributedMesh

    calls = []
    mesh = types.SimpleNamespace(pending_check=None)
    DistributedMesh.finish_pending_check(mesh)  # none in flight: nothing
    assert calls == []
    mesh.pending_check = lambda: calls.append(1)  # a check that leaves itself set
    DistributedMesh.finish_pending_check(mesh)
    DistributedMesh.finish_pending_check(mesh)
    assert calls == [1, 1]
    mesh.pending_check = None
    DistributedMesh.finish_pending_check(mesh)
    assert calls == [1, 1]
    agree = (pathlib.Path(ROOT) / "named_spmd/backends/_dist_agree.py").read_text()
    finish = agree[agree.index("    def finish() -> None:") :]
    assert finish.splitlines()[1].strip() == "mesh.pending_check = None"  # cleared first
    package = pathlib.Path(ROOT) / "named_spmd"
    called = re.compile(r"(?<!finish_)pending_check\(\)")
    callers = [p.name for p in sorted(package.rglob("*.py")) if called.search(p.read_text())]
    assert callers == ["_dist_mesh.py"]
