"""A small GPT, written three ways for bench_gpt.py: dense functions, a named_spmd per-device
function (dp x tp, Megatron layout) and an ``nn.Module`` (for DDP and DTensor's parallelize_module).

The model: token + position embeddings, ``layers`` blocks of LayerNorm -> causal attention
(``F.scaled_dot_product_attention``) -> residual, LayerNorm -> MLP (GELU) -> residual, a final
LayerNorm, an untied LM head and the mean cross entropy of next-token targets.

Parameters live in one dict keyed like the module's ``state_dict`` (``blocks.0.q.weight``, ...),
with ``nn.Linear``'s ``[out, in]`` weights, so the three versions share one set of tensors: the
functional ones read the dict, the module loads it with ``load_state_dict``.

Tensor parallelism (Megatron-LM): q, k, v and fc1 are column-parallel (their output features, so
the attention heads, split over tp), o and fc2 row-parallel (a partial sum over tp, one psum, then
the replicated bias); the LM head is vocab-parallel with ``ns.parallel.vocab_cross_entropy`` (the
logits never gathered; torch's fused loss where tp has size 1); embeddings and LayerNorms are replicated. The batch splits over dp.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

import named_spmd as ns
from named_spmd import P


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    d: int = 64
    layers: int = 2
    heads: int = 4
    seq: int = 32
    batch: int = 8  # global batch: split over dp

    @property
    def ffn(self) -> int:
        return 4 * self.d

    @property
    def head_dim(self) -> int:
        return self.d // self.heads


# --- parameters ------------------------------------------------------------------------------------


def _block_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    d, f = cfg.d, cfg.ffn
    shapes: dict[str, tuple[int, ...]] = {"ln1.weight": (d,), "ln1.bias": (d,)}
    for name in ("q", "k", "v", "o"):
        shapes |= {f"{name}.weight": (d, d), f"{name}.bias": (d,)}
    shapes |= {"ln2.weight": (d,), "ln2.bias": (d,)}
    shapes |= {"fc1.weight": (f, d), "fc1.bias": (f,), "fc2.weight": (d, f), "fc2.bias": (d,)}
    return shapes


def param_shapes(cfg: Config) -> dict[str, tuple[int, ...]]:
    shapes: dict[str, tuple[int, ...]] = {
        "wte.weight": (cfg.vocab, cfg.d),
        "wpe.weight": (cfg.seq, cfg.d),
    }
    for i in range(cfg.layers):
        shapes |= {f"blocks.{i}.{k}": s for k, s in _block_shapes(cfg).items()}
    shapes |= {"ln_f.weight": (cfg.d,), "ln_f.bias": (cfg.d,), "lm_head.weight": (cfg.vocab, cfg.d)}
    return shapes


def init_params(cfg: Config, seed: int = 0, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """GPT-2-like initialisation, the same on every process for the same seed."""
    g = torch.Generator().manual_seed(seed)
    params = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith("ln1.weight") or name.endswith("ln2.weight") or name == "ln_f.weight":
            t = 1.0 + 0.1 * torch.randn(shape, generator=g, dtype=torch.float64, device="cpu")
        elif len(shape) == 1:
            t = 0.02 * torch.randn(shape, generator=g, dtype=torch.float64, device="cpu")
        else:
            t = torch.randn(shape, generator=g, dtype=torch.float64, device="cpu") / math.sqrt(
                shape[-1]
            )
        params[name] = t.to(dtype).to(torch.get_default_device())
    return params


def batch(cfg: Config, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets of one global batch (deterministic in ``step``)."""
    g = torch.Generator().manual_seed(1000 + step)
    seq = torch.randint(cfg.vocab, (cfg.batch, cfg.seq + 1), generator=g, device="cpu")
    seq = seq.to(torch.get_default_device())
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()


def param_specs(cfg: Config) -> dict[str, P]:
    """Each parameter's PartitionSpec in the dp x tp layout (nothing splits over dp)."""

    def spec(name: str) -> P:
        leaf = name.split(".")[-2:]
        layer, kind = leaf[0], leaf[1]
        if layer in ("q", "k", "v", "fc1"):  # column-parallel: output features over tp
            return P("tp", None) if kind == "weight" else P("tp")
        if layer in ("o", "fc2") and kind == "weight":  # row-parallel: input features over tp
            return P(None, "tp")
        if layer == "lm_head":  # vocab-parallel
            return P("tp", None)
        return P()

    return {name: spec(name) for name in param_shapes(cfg)}


# --- the dense model and the per-device function ------------------------------------------------------


def _attention(h, p, pre: str, head_dim: int):
    """Causal self-attention over the heads held here (all of them, or this tp instance's)."""
    b, s, _ = h.shape

    def heads(name):
        y = F.linear(h, p[pre + name + ".weight"], p[pre + name + ".bias"])
        return y.view(b, s, -1, head_dim).transpose(1, 2)

    a = F.scaled_dot_product_attention(heads("q"), heads("k"), heads("v"), is_causal=True)
    return a.transpose(1, 2).reshape(b, s, -1)


def _same(x):
    return x


def _block(x, p, pre: str, cfg: Config, row_linear: Callable, col_input: Callable = _same):
    """One transformer block; ``row_linear(a, w, b)`` is the output projection (dense: F.linear;
    tensor-parallel: the row-parallel linear); ``col_input(h)`` marks the input of the
    column-parallel linears (by hand: Megatron's f, whose backward all-reduces over tp; named_spmd
    infers it)."""
    d = (cfg.d,)
    h = col_input(F.layer_norm(x, d, p[pre + "ln1.weight"], p[pre + "ln1.bias"]))
    a = _attention(h, p, pre, cfg.head_dim)
    x = x + row_linear(a, p[pre + "o.weight"], p[pre + "o.bias"])
    h = col_input(F.layer_norm(x, d, p[pre + "ln2.weight"], p[pre + "ln2.bias"]))
    u = F.gelu(F.linear(h, p[pre + "fc1.weight"], p[pre + "fc1.bias"]))
    return x + row_linear(u, p[pre + "fc2.weight"], p[pre + "fc2.bias"])


def _trunk(tokens, p, cfg: Config, row_linear: Callable, block: Callable = _block, col_input=_same):
    """Embeddings, the blocks and the final LayerNorm: the hidden states before the LM head."""
    x = F.embedding(tokens, p["wte.weight"]) + p["wpe.weight"][: tokens.shape[1]]
    for i in range(cfg.layers):
        x = block(x, p, f"blocks.{i}.", cfg, row_linear, col_input)
    return F.layer_norm(x, (cfg.d,), p["ln_f.weight"], p["ln_f.bias"])


def dense_loss(cfg: Config, row_linear: Callable = F.linear) -> Callable:
    """``loss(tokens, targets, params)`` on one device; ``row_linear``: the blocks' output
    projections (:func:`unfused_linear`: the per-device program's ops)."""

    def loss(tokens, targets, p):
        logits = F.linear(_trunk(tokens, p, cfg, row_linear), p["lm_head.weight"])
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    return loss


def unfused_linear(a, w, b):
    """``F.linear(a, w, b)`` as the row-parallel linear computes it where the axis has size 1:
    the product, then the bias (three ops forward and backward where ``F.linear`` runs one)."""
    return F.linear(a, w) + b


def _row_parallel(a, w, b):
    """Row-parallel linear: this instance's input features times its rows of ``w``, a partial
    sum over tp; one psum, then the bias (replicated: added once, after the sum)."""
    return ns.psum(F.linear(a, w), "tp") + b


def spmd_loss(cfg: Config, block: Callable = _block, reduced: bool = True) -> Callable:
    """The per-device ``loss(tokens, targets, params)`` for a ("dp", "tp") mesh, with the
    inputs laid out by :func:`in_specs`; the loss is the global mean, invariant everywhere.
    ``block``: the transformer block (``ns.compile(_block)`` compiles it per block).
    ``reduced=False``: the loss is left unreduced over dp (each dp member's share of the mean,
    out_specs ``P(unreduced={"dp"})``), so the step runs no collective for it in the forward,
    as a hand-written data-parallel step does."""

    def loss(tokens, targets, p):
        x = _trunk(tokens, p, cfg, _row_parallel, block)
        logits = F.linear(x, p["lm_head.weight"])  # [b/dp, s, V/tp]
        local = ns.parallel.vocab_cross_entropy(logits, targets, axis_name="tp")
        if not reduced:
            return ns.pcast(local / ns.axis_size("dp"), "dp", to="unreduced")
        return ns.pmean(local, "dp")

    return loss


def in_specs(cfg: Config) -> tuple:
    return (P("dp"), P("dp"), param_specs(cfg))


def spmd_step_fn(cfg: Config, mesh, reduced: bool = True) -> ns.SpmdFunction:
    out = P() if reduced else P(unreduced={"dp"})
    return ns.spmd_map(
        spmd_loss(cfg, reduced=reduced), mesh=mesh, in_specs=in_specs(cfg), out_specs=out
    )


# --- the nn.Module (for DDP and parallelize_module) ---------------------------------------------------


class Block(nn.Module):
    def __init__(self, cfg: Config):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d), nn.LayerNorm(cfg.d)
        self.q, self.k, self.v, self.o = (nn.Linear(cfg.d, cfg.d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(cfg.d, cfg.ffn), nn.Linear(cfg.ffn, cfg.d)

    def forward(self, x):
        h = self.ln1(x)
        b, s, _ = h.shape
        # view(..., -1, head_dim): under tensor parallelism q/k/v hold this rank's heads only
        q, k, v = (
            t(h).view(b, s, -1, self.head_dim).transpose(1, 2) for t in (self.q, self.k, self.v)
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """The same model as :func:`dense_loss`; ``forward`` returns the logits."""

    def __init__(self, cfg: Config):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(cfg.vocab, cfg.d), nn.Embedding(cfg.seq, cfg.d)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d)
        self.lm_head = nn.Linear(cfg.d, cfg.vocab, bias=False)

    def forward(self, tokens):
        x = self.wte(tokens) + self.wpe.weight[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


def module(cfg: Config, params: dict[str, torch.Tensor]) -> GPT:
    m = GPT(cfg).to(next(iter(params.values())).dtype)
    m.load_state_dict(params)
    return m
