# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 10 · Training a GPT-style model with dp x tp (+ sp)
#
# Everything from the earlier tutorials, in one training script: a small GPT (token and position
# embeddings, two blocks of causal attention and an MLP with LayerNorms, an LM head, the cross
# entropy) written as a **per-device function** from `ns.parallel`'s layers, on a `(dp, tp)`
# mesh of 4:
#
# * **data parallel** over `dp`: the batch is split, the parameters replicated (their gradients
#   are summed over `dp` by the implicit pvary of tutorial 05);
# * **tensor parallel** over `tp` (Megatron-LM): the attention heads and the MLP's hidden units
#   split (column-parallel, then row-parallel linears, the row-parallel bias added once after the
#   sum), the vocabulary split in the embedding, the LM head and the loss (the logits are never
#   gathered);
# * **sequence parallel** over `tp` too: between the layers each instance holds `1/tp` of its
#   batch's tokens instead of a copy of all of them, so LayerNorms, residuals and dropout do
#   `1/tp` of the work (tutorial 06's layout).
#
# It is trained with AdamW, with **activation checkpointing** per block, **dropout** whose masks
# differ over `dp` and `tp` (`ns.random`), and a **checkpoint to disk** with
# `torch.distributed.checkpoint` from which a "restarted job" continues. We check that the losses
# equal the single-device model's (float64), run the same script on 4 real processes with
# `torchrun`, and check that they give the same losses and parameters as the simulated mesh.

# %%
import importlib.util
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

import optree
import torch
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F

import named_spmd as ns
from named_spmd import P
from named_spmd import parallel as pl

f64 = torch.float64

# %% [markdown]
# ## The model
#
# As in tutorial 09, the code that runs on every process is a script (a string here, written to
# a file below) that this notebook also imports. First the model. The parameters are one pytree
# of global tensors in `torch.nn.functional`'s layouts (`linear`: `[out, in]`), and `SPECS`, a
# pytree of the same shape, says how each is laid out on the mesh. `block` is one transformer
# block for one instance: it reads like the single-device block, with `ns.parallel`'s layers in
# place of `F.linear` / `F.embedding`:
#
# | layer | weight spec | what the instance computes |
# |---|---|---|
# | `pl.vocab_embedding(..., scatter_dim=1)` | `P("tp")` (its rows of the vocabulary) | its rows' embeddings, summed over `tp` and split over the sequence in one `psum_scatter` |
# | `pl.gather_sequence` | | all the tokens again before attention (`all_gather`) |
# | `pl.column_linear` (q, k, v, fc1) | weight and bias `P("tp")` | its heads / hidden units |
# | `pl.row_linear(..., scatter_dim=1)` (o, fc2) | weight `P(None, "tp")`, bias `P()` | its partial product, summed and split over the sequence (`psum_scatter`), then the bias |
# | `pl.column_linear(..., gather_dim=1)` (LM head) | `P("tp")` | its slice of the vocabulary's logits |
# | `pl.vocab_cross_entropy` | | the loss from the split logits (three small reductions over `tp`) |
#
# The position table is split over `tp` like the sequence (`P("tp")`): each instance adds the
# rows of its own positions. q, k and v are separate weights here; a fused `[3 * d, d]` qkv
# weight would need `pl.interleave_packed` first (split as it is, instance 0 would get all of q
# and none of v).
#
# Dropout uses `ns.random.dropout(x, p, over=("dp", "tp"), seed=(step, layer, k))`: every
# instance draws its own mask (its tokens differ from the others'), from a seed that is the same
# everywhere and different for every draw. Each block runs under
# `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`, torch's own activation
# checkpointing: backward runs the block again, collectives and dropout included.

# %%
MODEL = r'''
import sys
import warnings

import optree
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import named_spmd as ns
from named_spmd import P
from named_spmd import parallel as pl

VOCAB, D, HEADS, LAYERS, SEQ, BATCH = 32, 16, 4, 2, 8, 4
FFN, HEAD_DIM = 4 * D, D // HEADS
P_DROP = 0.1  # dropout probability

BLOCK_SPECS = {
    "ln1.weight": P(), "ln1.bias": P(),
    "q.weight": P("tp"), "q.bias": P("tp"),  # column parallel: this instance's heads
    "k.weight": P("tp"), "k.bias": P("tp"),
    "v.weight": P("tp"), "v.bias": P("tp"),
    "o.weight": P(None, "tp"), "o.bias": P(),  # row parallel: the bias is added after the sum
    "ln2.weight": P(), "ln2.bias": P(),
    "fc1.weight": P("tp"), "fc1.bias": P("tp"),  # column parallel: this instance's hidden units
    "fc2.weight": P(None, "tp"), "fc2.bias": P(),  # row parallel
}
SPECS = {
    "wte": P("tp"),  # vocabulary parallel
    "wpe": P("tp"),  # positions split like the sequence (sequence parallel)
    "blocks": [BLOCK_SPECS] * LAYERS,
    "ln_f.weight": P(), "ln_f.bias": P(),
    "lm_head": P("tp"),  # column parallel: the logits split over the vocabulary
}


def init_params(seed=0):
    """Global float64 parameters in torch.nn.functional's layouts, the same on every rank."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape, std, mean=0.0):
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * std + mean
        return t.requires_grad_()

    def block():
        p, linears = {}, dict(q=(D, D), k=(D, D), v=(D, D), o=(D, D), fc1=(FFN, D), fc2=(D, FFN))
        for name, (n_out, n_in) in linears.items():
            p[f"{name}.weight"] = r(n_out, n_in, std=n_in**-0.5)
            p[f"{name}.bias"] = r(n_out, std=0.02)
        for ln in ("ln1", "ln2"):
            p[f"{ln}.weight"], p[f"{ln}.bias"] = r(D, std=0.1, mean=1.0), r(D, std=0.02)
        return p

    return {
        "wte": r(VOCAB, D, std=1.0), "wpe": r(SEQ, D, std=0.1),
        "blocks": [block() for _ in range(LAYERS)],
        "ln_f.weight": r(D, std=0.1, mean=1.0), "ln_f.bias": r(D, std=0.02),
        "lm_head": r(VOCAB, D, std=D**-0.5),
    }


def batch(step):
    """Token ids and next-token targets of one global batch, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def attention(q, k, v):
    """Causal softmax attention over the heads held here ([b, s, heads here * HEAD_DIM])."""
    b, s, _ = q.shape
    q, k, v = (t.reshape(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))
    scores = q @ k.transpose(-1, -2) / HEAD_DIM**0.5
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    probs = torch.softmax(scores.masked_fill(~causal, float("-inf")), dim=-1)
    return (probs @ v).transpose(1, 2).reshape(b, s, -1)


def block(x, p, step, layer, p_drop):
    """x: [b/dp, s/tp, D], this instance's tokens (the sequence is split over tp between layers)."""
    h = F.layer_norm(x, (D,), p["ln1.weight"], p["ln1.bias"])  # on 1/tp of the tokens
    h = pl.gather_sequence(h, "tp")  # [b/dp, s, D]: attention needs every position
    q, k, v = (pl.column_linear(h, p[f"{n}.weight"], p[f"{n}.bias"], axis_name="tp") for n in "qkv")
    a = pl.row_linear(attention(q, k, v), p["o.weight"], p["o.bias"], axis_name="tp", scatter_dim=1)
    x = x + ns.random.dropout(a, p_drop, over=("dp", "tp"), seed=(step, layer, 0))
    h = F.layer_norm(x, (D,), p["ln2.weight"], p["ln2.bias"])
    u = F.gelu(pl.column_linear(h, p["fc1.weight"], p["fc1.bias"], axis_name="tp", gather_dim=1))
    m = pl.row_linear(u, p["fc2.weight"], p["fc2.bias"], axis_name="tp", scatter_dim=1)
    return x + ns.random.dropout(m, p_drop, over=("dp", "tp"), seed=(step, layer, 1))


def build(mesh, p_drop=P_DROP, remat=True):
    """loss(ids, targets, params, step): the mean next-token cross entropy of the global batch."""

    def gpt_loss(ids, targets, p, step):
        x = pl.vocab_embedding(ids, p["wte"], axis_name="tp", scatter_dim=1) + p["wpe"]
        x = ns.random.dropout(x, p_drop, over=("dp", "tp"), seed=(step, "embed"))
        for i, bp in enumerate(p["blocks"]):
            if remat:  # keep only the block's input; run it again in backward
                x = checkpoint(block, x, bp, step, i, p_drop, use_reentrant=False)
            else:
                x = block(x, bp, step, i, p_drop)
        h = F.layer_norm(x, (D,), p["ln_f.weight"], p["ln_f.bias"])
        logits = pl.column_linear(h, p["lm_head"], axis_name="tp", gather_dim=1)  # [b, s, V/tp]
        return ns.pmean(pl.vocab_cross_entropy(logits, targets, axis_name="tp"), "dp")

    return ns.spmd_map(gpt_loss, mesh=mesh, in_specs=(P("dp"), P("dp"), SPECS, None), out_specs=P())
'''

# %% [markdown]
# ## Training, and a checkpoint on disk
#
# `train` shards the parameters with `ns.shard` (on a real mesh: `DTensor`s laid out by the
# specs; on a simulated mesh: copies of the global tensors, which is what a call takes there) and
# trains them with AdamW. After step `save_at` it saves the parameters and the optimizer's state
# with `torch.distributed.checkpoint` (`dcp.save`: every rank writes its own shards), then
# continues as a restarted job would: new parameters (from another seed, so that nothing but the
# checkpoint can make the losses match), a new optimizer, and `dcp.load`, which fills their
# tensors in place. The same `dcp.save` / `dcp.load` calls work on the simulated mesh, where one
# process saves the global tensors (dcp warns that it saves from one process, which is the
# point; we silence that one warning).
#
# `main()` is what each process runs under torchrun: join the process group, make the (now real)
# mesh, train, and let rank 0 save the losses, the final parameters (`ns.unshard`: their global
# values) and the collectives of the first step.

# %%
TRAIN = r'''
def adamw(params):
    return torch.optim.AdamW(optree.tree_leaves(params), lr=1e-2, weight_decay=0.1, foreach=True)


def optimizer_state(opt):
    """A fresh AdamW's state_dict() with its state allocated: dcp.load fills tensors in place,
    and a fresh optimizer has no state before its first step."""
    for group in opt.param_groups:
        for p in group["params"]:
            opt.state[p] = {
                "step": torch.tensor(0.0),
                "exp_avg": torch.zeros_like(p),  # laid out like p: a DTensor on a real mesh
                "exp_avg_sq": torch.zeros_like(p),
            }
    return opt.state_dict()  # refers to the optimizer's own state tensors


def one_process(fn, *args, **kwargs):
    """dcp.save / dcp.load; without a process group (a simulated mesh) dcp warns that it saves
    from one process, which is what we want."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "torch.distributed is disabled")
        return fn(*args, **kwargs)


def train(mesh, steps, ckpt_dir, save_at, p_drop=P_DROP, remat=True):
    """AdamW for ``steps`` steps; after step ``save_at`` save a checkpoint, then continue as a
    restarted job would: fresh parameters and optimizer, loaded from disk.
    Returns the losses, the final parameters and the CommMode of the first step."""
    loss_fn = build(mesh, p_drop, remat)
    params = ns.shard(init_params(), mesh, SPECS)  # DTensors on a real mesh
    opt, losses = adamw(params), []
    for step in range(steps):
        ids, targets = batch(step)
        with ns.CommMode() as comms:
            loss = loss_fn(ids, targets, params, step)
            opt.zero_grad()
            loss.backward()
        if step == 0:
            first_step = comms
        opt.step()
        losses.append(loss.item())
        if step == save_at:
            state = {"params": params, "optim": opt.state_dict()}
            one_process(dcp.save, state, checkpoint_id=ckpt_dir)
            params = ns.shard(init_params(seed=1), mesh, SPECS)  # other values, to be overwritten
            opt = adamw(params)
            state = {"params": params, "optim": optimizer_state(opt)}
            one_process(dcp.load, state, checkpoint_id=ckpt_dir)
    return losses, params, first_step


def train_local(mesh, steps):
    """The same training on this process's blocks held as plain tensors (Megatron-style): no
    DTensor in the step. ``ns.shard(..., blocks=True)`` makes the blocks and ``loss_fn.local``
    takes and returns blocks; the loss (out_spec ``P()``) is the whole value on every rank."""
    loss_fn = build(mesh)
    blocks = ns.shard(init_params(), mesh, SPECS, blocks=True)  # plain tensors, this rank's
    opt, losses = adamw(blocks), []
    for step in range(steps):
        ids, targets = ns.shard(batch(step), mesh, P("dp"), blocks=True)
        loss = loss_fn.local(ids, targets, blocks, step)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def main(out_path, ckpt_dir):
    dist.init_process_group("gloo")
    mesh = ns.make_mesh((2, 2), ("dp", "tp"))  # real: one instance per process
    losses, params, comms = train(mesh, 4, ckpt_dir, save_at=1)
    local_losses = train_local(mesh, 2)
    full = ns.unshard(optree.tree_map(torch.Tensor.detach, params))  # collectives: every rank
    if dist.get_rank() == 0:
        print("rank 0:", mesh, "losses", [round(v, 6) for v in losses], flush=True)
        print("rank 0: wte is a", type(params["wte"]).__name__, params["wte"].placements)
        events = [(repr(e), e.boundary) for e in comms.events]
        saved = {"losses": losses, "params": full, "events": events, "local": local_losses}
        torch.save(saved, out_path)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
'''

work = Path(tempfile.mkdtemp(prefix="named_spmd_gpt_"))
script = work / "gpt_train.py"
script.write_text(MODEL + TRAIN)
spec = importlib.util.spec_from_file_location("gpt_train", script)
gpt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(gpt)
print(f"wrote {script}")

mesh = ns.make_mesh((2, 2), ("dp", "tp"))
print(repr(mesh), "parameters:", sum(t.numel() for t in optree.tree_leaves(gpt.init_params())))
print("the specs of block 0:", gpt.SPECS["blocks"][0])

# %% [markdown]
# ## Four real processes, started now
#
# `torchrun` starts 4 processes (gloo, over this machine's loopback), each running `main()`: a
# real `(2, 2)` mesh, `DTensor` parameters, a checkpoint directory written by all four. We start
# them now, in the background (each first imports torch, which takes a while), run the simulated
# mesh in this notebook meanwhile, and compare at the end. The launch has a timeout, so that a
# problem fails fast instead of hanging.


# %%
def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


results, real_ckpt = work / "rank0.pt", work / "ckpt_real"
command = [
    sys.executable, "-m", "torch.distributed.run",
    "--nproc-per-node", "4", "--master-addr", "127.0.0.1", "--master-port", str(free_port()),
    str(script), str(results), str(real_ckpt),
]  # fmt: skip
env = dict(os.environ, OMP_NUM_THREADS="1", GLOO_SOCKET_IFNAME="lo")
print("$", " ".join(command[1:]))
torchrun = subprocess.Popen(
    command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
)


# %% [markdown]
# ## Which axes a dropout mask varies over, in the types
#
# A dropout mask drawn with `over=A` differs between the instances of the axes `A`, and the
# result's type says so: `dropout(x: T{V}, p, over=A) -> T{V ∪ A}`. Which `over` is right
# depends on what the instances of an axis hold:
#
# * in the sequence-parallel layout above, the `tp` instances hold *different tokens*: each
#   needs its own mask, `over=("dp", "tp")`;
# * after a plain row-parallel layer (no sequence split) the `tp` instances hold *one value*
#   (invariant over `tp`): the mask must be the same along `tp`, `over="dp"`, or the copies stop
#   agreeing. Megatron-LM keeps two random states for this; here the type catches the mistake.

# %%
seen = {}


def row_then_dropout(x, w):
    y = pl.row_linear(x, w, axis_name="tp")  # summed over tp: one value along tp
    same = ns.random.dropout(y, 0.5, over="dp", seed=0)  # one mask along tp
    own = ns.random.dropout(y, 0.5, over=("dp", "tp"), seed=1)  # a mask per instance
    seen.update(y=ns.typeof(y), same=ns.typeof(same), own=ns.typeof(own))
    return same, own


def dropped(out_specs):
    return ns.spmd_map(
        row_then_dropout, mesh=mesh, in_specs=(P("dp", "tp"), P(None, "tp")), out_specs=out_specs
    )


x, w = torch.randn(4, 8, dtype=f64), torch.randn(6, 8, dtype=f64)
try:
    dropped((P("dp"), P("dp")))(x, w)  # "own" is no longer one value along tp
except ns.VmaError as e:
    print(e)
    assert "varies over ('tp',)" in str(e)
else:
    raise AssertionError("expected a VmaError")
print({k: repr(t) for k, t in seen.items()})
assert (seen["y"].vma, seen["same"].vma, seen["own"].vma) == ({"dp"}, {"dp"}, {"dp", "tp"})

# with out_specs saying "own" is split over tp, its 2 copies per dp instance come back side by side
same, own = dropped((P("dp"), P("dp", "tp")))(x, w)
assert own.shape == (4, 12)
assert not torch.equal(own[:, :6] == 0, own[:, 6:] == 0)  # different masks along tp

# %% [markdown]
# ## The single-device model, with the same dropout masks
#
# The reference is the dense model in float64 with `torch.nn.functional` (and torch's own
# `scaled_dot_product_attention`). For the losses to be comparable *with* dropout, it applies the
# masks the instances drew: `ns.random` documents how a draw is made (a `torch.Generator` seeded
# by `ns.random.generator_seed(seed, coordinates)` for each instance's coordinates along `over`),
# so the global mask of an activation `[batch, seq, d]` is the instances' blocks put side by
# side: `dp` splits the batch, `tp` the sequence. The masks depend on the mesh: a `(4, 1)` mesh
# would draw other ones (dropout differs per instance, by design).

# %%
P_DROP, DP, TP = gpt.P_DROP, mesh.shape["dp"], mesh.shape["tp"]


def dense_mask(seed):
    """The [BATCH, SEQ, D] mask of the draw ``seed``: each instance's block, as drawn there."""
    b, s = gpt.BATCH // DP, gpt.SEQ // TP
    mask = torch.empty(gpt.BATCH, gpt.SEQ, gpt.D, dtype=f64)
    for i in range(DP):
        for j in range(TP):
            g = torch.Generator().manual_seed(ns.random.generator_seed(seed, {"dp": i, "tp": j}))
            keep = torch.rand(b, s, gpt.D, generator=g) >= P_DROP
            mask[i * b : (i + 1) * b, j * s : (j + 1) * s] = keep.to(f64) * (1 / (1 - P_DROP))
    return mask


def dense_loss(ids, targets, p, step):
    d, heads = (gpt.D,), (gpt.HEADS, gpt.HEAD_DIM)
    x = (F.embedding(ids, p["wte"]) + p["wpe"]) * dense_mask((step, "embed"))
    for i, bp in enumerate(p["blocks"]):
        h = F.layer_norm(x, d, bp["ln1.weight"], bp["ln1.bias"])
        q, k, v = (
            F.linear(h, bp[f"{n}.weight"], bp[f"{n}.bias"]).unflatten(-1, heads).transpose(1, 2)
            for n in "qkv"
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)
        x = x + F.linear(a, bp["o.weight"], bp["o.bias"]) * dense_mask((step, i, 0))
        h = F.layer_norm(x, d, bp["ln2.weight"], bp["ln2.bias"])
        m = F.linear(F.gelu(F.linear(h, bp["fc1.weight"], bp["fc1.bias"])), bp["fc2.weight"])
        x = x + (m + bp["fc2.bias"]) * dense_mask((step, i, 1))
    logits = F.linear(F.layer_norm(x, d, p["ln_f.weight"], p["ln_f.bias"]), p["lm_head"])
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


STEPS, SAVE_AT = 4, 1
dense_params = gpt.init_params()
opt = gpt.adamw(dense_params)
dense_losses = []
for step in range(STEPS):
    loss = dense_loss(*gpt.batch(step), dense_params, step)
    opt.zero_grad()
    loss.backward()
    opt.step()
    dense_losses.append(loss.item())
print("dense losses:", [round(v, 6) for v in dense_losses])

# %% [markdown]
# ## Trained on the simulated mesh, with a restart from disk
#
# Two steps, `dcp.save`, new parameters and optimizer, `dcp.load`, two more steps. The losses
# equal the dense model's trained without a break: the model, the dropout masks, AdamW on the
# sharded parameters and the restart are all exact. (The parameters are compared to `1e-9`: the
# key bias has a zero gradient in exact arithmetic, softmax ignoring a constant added to a row of
# scores, and AdamW scales its rounding noise up to `1e-11`.)

# %%
sim_ckpt = work / "ckpt_simulated"
sim_losses, sim_params, sim_comms = gpt.train(mesh, STEPS, sim_ckpt, SAVE_AT)
print("simulated losses:", [round(v, 6) for v in sim_losses])
torch.testing.assert_close(sim_losses, dense_losses, rtol=1e-12, atol=1e-12)
for got, want in zip(optree.tree_leaves(sim_params), optree.tree_leaves(dense_params)):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
print("losses and parameters equal the single-device model's, restart included")
print("the checkpoint:", sorted(p.name for p in sim_ckpt.iterdir()))

# %% [markdown]
# ## What activation checkpointing changes: the backward's communication, not the numbers
#
# One step with and without checkpointing the blocks: the loss and every gradient are the same.
# The forward communicates the same; in backward each block runs its forward again, so its two
# `all_gather`s and two `psum_scatter`s over `tp` run once more (counted as backward
# communication). In exchange only each block's input stays in memory between forward and
# backward. (A selective policy,
# `context_fn=functools.partial(create_selective_checkpoint_contexts, policy)`, would keep chosen
# results, such as the matmuls', and recompute the rest.)


# %%
def one_step(remat):
    params = ns.shard(gpt.init_params(), mesh, gpt.SPECS)
    with ns.CommMode() as comms:
        loss = gpt.build(mesh, remat=remat)(*gpt.batch(0), params, 0)
        loss.backward()
    return loss, [p.grad for p in optree.tree_leaves(params)], comms


loss_plain, grads_plain, comms_plain = one_step(remat=False)
loss_remat, grads_remat, comms_remat = one_step(remat=True)
torch.testing.assert_close(loss_remat, loss_plain, rtol=0, atol=0)
for g_remat, g_plain in zip(grads_remat, grads_plain):
    torch.testing.assert_close(g_remat, g_plain, rtol=1e-13, atol=1e-13)
print(f"the same loss and {len(grads_plain)} gradients with and without checkpointing")
print(comms_remat.summary())

plain, remat = comms_plain.counts(), comms_remat.counts()
extra = {k: remat[k] - plain.get(k, 0) for k in remat if remat[k] != plain.get(k, 0)}
print("backward collectives added by the recomputation:", extra)
assert {k: n for k, n in remat.items() if k[0] == "forward"} == {
    k: n for k, n in plain.items() if k[0] == "forward"
}
assert extra == {
    ("backward", "all_gather", ("tp",)): 2 * gpt.LAYERS,
    ("backward", "psum_scatter", ("tp",)): 2 * gpt.LAYERS,
}
assert remat == sim_comms.counts()  # the training loop's first step

# %% [markdown]
# Reading the table: forward, 5 `all_gather`s (the sequence before each attention, MLP and the
# LM head) and 5 `psum_scatter`s (the embedding and each row-parallel layer) over `tp`, the loss'
# `pmax` and 2 `psum`s over `tp`, and the `pmean` over `dp`; backward, their transposes, the
# recomputation's, and one psum per parameter from the implicit pvarys: over `dp` for the
# parameters split over `tp`, over `("dp", "tp")` for the replicated ones (LayerNorms, the
# row-parallel biases). On a real mesh those gradient psums share bucketed all-reduces.
#
# ## Real == simulated
#
# We wait for the four processes (they may have finished already). Their losses, final
# parameters (restart included) and the program's collectives of a step are the simulated
# mesh's. The real mesh also records its *boundary* collectives (`boundary=True`, outside the
# program: here the start-of-call check), which a simulated mesh does not have.

# %%
try:
    stdout, stderr = torchrun.communicate(timeout=180)
except subprocess.TimeoutExpired:
    torchrun.kill()
    raise
print(stdout)
if torchrun.returncode != 0:
    print(stderr[-3000:])
assert torchrun.returncode == 0, "torchrun failed"

real = torch.load(results)
torch.testing.assert_close(real["losses"], sim_losses, rtol=1e-12, atol=1e-12)
for got, want in zip(optree.tree_leaves(real["params"]), optree.tree_leaves(sim_params)):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
program = sorted(e for e, boundary in real["events"] if not boundary)
assert program == sorted(repr(e) for e in sim_comms.events)
n_params = len(optree.tree_leaves(real["params"]))
print(
    f"real == simulated: 4 losses, {n_params} parameters and {len(program)} collectives of a step"
)
print("and at the boundary:", [e for e, boundary in real["events"] if boundary])

# %% [markdown]
# ## Local calls: blocks in, blocks out
#
# A program that already holds its shards as plain tensors (a Megatron-style trainer, a data
# loader that reads each rank's part) calls `loss_fn.local(...)` instead: every tensor argument
# is this rank's block under its in_spec, every output is this rank's block under its out_spec
# (here the loss, `P()`: the whole value on every rank). Types, the out_specs check and the
# errors are those of a global call; what goes is the DTensor bookkeeping, so the optimizer steps
# plain tensors. `ns.shard(..., blocks=True)` makes the blocks. `main()` trained two steps that
# way (`train_local`); on the simulated mesh one process holds every instance, so there `.local`
# is the global call and the same function runs unchanged. Its losses equal the simulated run's
# and the first two of the DTensor run above:

# %%
sim_local = gpt.train_local(mesh, 2)
torch.testing.assert_close(real["local"], sim_local, rtol=1e-12, atol=1e-12)
torch.testing.assert_close(real["local"], real["losses"][:2], rtol=1e-12, atol=1e-12)
print("local calls, real and simulated:", [round(v, 6) for v in real["local"]])

# %% [markdown]
# The checkpoints are interchangeable too: `dcp` stores every tensor by its global shape and
# offsets, so this one process reads the four processes' shards into plain global tensors (and
# could load them into any other layout). The parameters and AdamW's moments saved after step 2
# agree:


# %%
def load(path):
    params = optree.tree_map(lambda t: torch.zeros_like(t.detach()), gpt.init_params())
    state = {"params": params, "optim": gpt.optimizer_state(gpt.adamw(params))}
    gpt.one_process(dcp.load, state, checkpoint_id=path)
    return [t for t in optree.tree_leaves(state) if isinstance(t, torch.Tensor)]


from_real, from_sim = load(real_ckpt), load(sim_ckpt)
for got, want in zip(from_real, from_sim):
    torch.testing.assert_close(got, want, rtol=0, atol=1e-9)
print(f"{len(from_real)} tensors read from the real run's checkpoint equal the simulated one's")

# %% [markdown]
# ## What this does not show
#
# * Speed: the model is tiny and runs on a CPU; `benchmarks/bench_gpt.py` times a step of a
#   similar GPT against plain torch, DDP and DTensor's tensor parallelism.
# * Gradient accumulation and gradient clipping, left out to keep the loop short.
# * Mixed precision: everything here is float64, so that the comparisons can be tight.
# * How much memory checkpointing saves: `tests/test_checkpointing.py` measures the saved
#   activations of checkpointed transformer blocks.
