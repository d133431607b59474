"""A GPT-style character language model cut into P pipeline stages.

Paper: GPT-2 (Radford et al. 2019) blocks: token + learned position embeddings, pre-LN causal
self-attention and MLP, a final LayerNorm and a linear head. Stage 0 holds the embeddings,
the last stage the final LayerNorm and head, and the blocks are cut as evenly as they go
(the first stages take the remainder). Chained, the stages are exactly the whole model: the
same modules in the same order, initialised once from one seed and then split, so a model
cut into 1, 2 or 4 stages starts from the same weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the model."""

    vocab_size: int
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    context: int = 128
    """Longest input (ids per window)."""


class Block(nn.Module):
    """Pre-LN causal self-attention + MLP."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"n_heads={cfg.n_heads} must divide d_model={cfg.d_model}")
        self.n_heads = cfg.n_heads
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: Tensor) -> Tensor:
        """``(b, t, d_model)`` -> the same shape, causally."""
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Stage(nn.Module):
    """Stage ``index`` of ``count``: ids -> hidden (first), hidden -> hidden, hidden -> logits
    (last); a single stage maps ids to logits."""

    def __init__(self, cfg: GPTConfig, index: int, count: int, blocks: list[Block]) -> None:
        super().__init__()
        self.cfg, self.index, self.count = cfg, index, count
        self.first, self.last = index == 0, index == count - 1
        if self.first:
            self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
            self.pos = nn.Embedding(cfg.context, cfg.d_model)
        self.blocks = nn.ModuleList(blocks)
        if self.last:
            self.ln_f = nn.LayerNorm(cfg.d_model)
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        """Ids ``(b, t)`` (first stage) or hidden ``(b, t, d_model)`` in; hidden, or logits
        ``(b, t, vocab_size)`` from the last stage. ValueError when t > ``context``."""
        if self.first:
            t = x.shape[1]
            if t > self.cfg.context:
                raise ValueError(f"{t} ids exceed the model's context of {self.cfg.context}")
            x = self.tok(x) + self.pos(torch.arange(t, device=x.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def split_blocks(n_layers: int, stages: int) -> list[int]:
    """Blocks per stage: as even as they go, the first stages taking the remainder."""
    if not 1 <= stages <= n_layers:
        raise ValueError(f"{stages} stages for {n_layers} blocks: need 1 <= P <= n_layers")
    q, r = divmod(n_layers, stages)
    return [q + (i < r) for i in range(stages)]


def build_stages(cfg: GPTConfig, stages: int, seed: int) -> list[Stage]:
    """The model of ``seed``, cut into ``stages`` stages (the same weights for any cut)."""
    torch.manual_seed(seed)
    tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
    pos = nn.Embedding(cfg.context, cfg.d_model)
    blocks = [Block(cfg) for _ in range(cfg.n_layers)]
    ln_f = nn.LayerNorm(cfg.d_model)
    head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
    for m in [tok, pos, head, *blocks]:
        for sub in m.modules():
            if isinstance(sub, nn.Linear | nn.Embedding):
                nn.init.normal_(sub.weight, std=0.02)
            if isinstance(sub, nn.Linear) and sub.bias is not None:
                nn.init.zeros_(sub.bias)
    out, at = [], 0
    for i, n in enumerate(split_blocks(cfg.n_layers, stages)):
        stage = Stage(cfg, i, stages, blocks[at : at + n])
        at += n
        if stage.first:
            stage.tok, stage.pos = tok, pos
        if stage.last:
            stage.ln_f, stage.head = ln_f, head
        out.append(stage)
    return out


def run_stages(stages: list[Stage], ids: Tensor) -> Tensor:
    """Logits of ``ids`` through every stage in order."""
    x = ids
    for stage in stages:
        x = stage(x)
    return x
