"""A tiny decoder-only transformer policy, batched sampling and differentiable log-probs.

Idea: the policy side of GRPO-style RL post-training (Shao et al. 2024, DeepSeekMath,
arXiv:2402.03300) at toy scale: a GPT-style model (Radford et al. 2019: token + learned
position embeddings, pre-LN causal self-attention blocks) over the character vocabulary of
:mod:`trainers.rl.tasks`, warm-started by a short supervised phase so RL begins from a working
but imperfect policy. Sampling records the behaviour log-prob of every token, as asynchronous
trainers need for their importance ratios (AReaL, arXiv:2505.24298).

Departures: no KV cache (every decoding step recomputes the full forward; the sequences are
short); sampling always draws on the CPU from CPU probabilities with a caller's CPU
``torch.Generator``, so a run reproduces on any device. Functions take ``device=None`` to mean
the device of the policy's parameters; :func:`fedasync.devices.pick_device` chooses CUDA when present.

One file (just over 400 lines) because the model, sampling, log-probs and the warm start share
one padding and sampling convention, which the workers, the learner and the teacher all rely
on being the same.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from fedasync.devices import pick_device  # noqa: F401  (re-exported)
from trainers.rl.tasks import EOS, PAD, Task, decode, encode

WARM_START_INDEX = 10_000_000
"""First prompt index of the warm-start phase (RL uses indices below it)."""
HELD_OUT_INDEX = 20_000_000
"""First prompt index of :func:`warm_start`'s held-out accuracy check."""


@runtime_checkable
class Policy(Protocol):
    """The narrow interface the trainer uses; an ``nn.Module`` LM fits it.

    ``policy(ids)`` maps token ids, shape ``(b, t)``, to next-token logits, shape
    ``(b, t, vocab)``, causally (position i sees positions ≤ i), so right padding leaves
    earlier logits unchanged. A Hugging Face causal LM fits behind
    :class:`trainers.rl.hf.HFPolicy` (``policy.kind=hf``), which returns its logits cut to
    the task's vocabulary and keeps its dropout off.
    """

    def __call__(self, ids: Tensor) -> Tensor:
        """Next-token logits ``(b, t, vocab)`` for ids ``(b, t)``, causal."""

    def state_dict(self) -> Mapping[str, Any]:
        """The weights by name (what a version publishes and a checkpoint keeps)."""

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True) -> Any:
        """Load weights by name, as ``nn.Module.load_state_dict``."""

    def parameters(self) -> Iterator[nn.Parameter]:
        """The parameters the optimiser steps."""

    def train(self, mode: bool = True) -> Any:
        """Training mode (dropout on, if any); evaluation mode when ``mode`` is false."""

    def eval(self) -> Any:
        """Evaluation mode, for sampling and scoring."""


@dataclass(frozen=True)
class PolicyConfig:
    """Shape of :class:`TinyLM`."""

    vocab_size: int
    """Number of token ids (``tasks.VOCAB_SIZE``)."""
    d_model: int = 64
    """Width of the residual stream."""
    n_layers: int = 2
    """Number of transformer blocks."""
    n_heads: int = 4
    """Attention heads per block (must divide ``d_model``)."""
    max_len: int = 96
    """Longest sequence (prompt + completion) the position embedding covers."""
    dropout: float = 0.0
    """Dropout in training mode; keep 0 for RL, where behaviour log-probs must be exact."""


class _Block(nn.Module):
    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.dropout = cfg.dropout
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
            nn.Dropout(cfg.dropout),
        )

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, t, d)), p, self.training)
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A GPT-style decoder: ids, shape ``(b, t)`` -> logits, shape ``(b, t, vocab_size)``."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        if cfg.d_model % cfg.n_heads:
            raise ValueError(f"d_model {cfg.d_model} is not divisible by n_heads {cfg.n_heads}")
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.max_len, cfg.d_model)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for m in self.modules():
            if isinstance(m, nn.Linear | nn.Embedding):
                nn.init.normal_(m.weight, std=0.02)
            if isinstance(m, nn.Linear) and m.bias is not None:
                nn.init.zeros_(m.bias)

    def forward(self, ids: Tensor) -> Tensor:
        """Logits ``(b, t, vocab_size)`` for ids ``(b, t)``; ValueError when t > ``max_len``."""
        t = ids.shape[1]
        if t > self.cfg.max_len:
            raise ValueError(
                f"sequence of {t} tokens exceeds the policy's max_len {self.cfg.max_len}"
            )
        x = self.tok(ids) + self.pos(torch.arange(t, device=ids.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _device_of(policy: Policy, device: str | torch.device | None) -> torch.device:
    return torch.device(device) if device is not None else next(iter(policy.parameters())).device


def _right_pad(rows: Sequence[Sequence[int]], device: torch.device) -> tuple[Tensor, Tensor]:
    """Rows right-padded with PAD, shape ``(n, max len)``, and their lengths, shape ``(n,)``."""
    lens = torch.tensor([len(r) for r in rows], dtype=torch.long)
    ids = torch.full((len(rows), max((len(r) for r in rows), default=0)), PAD, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, : len(r)] = torch.as_tensor(list(r), dtype=torch.long)
    return ids.to(device), lens.to(device)


@dataclass
class Sample:
    """One completion: ids (ending with EOS unless cut), behaviour log-probs, text."""

    tokens: list[int]
    logprobs: list[float]
    """log_softmax(logits / temperature) of each token, under the policy that sampled it."""
    text: str
    extra_ids: list[list[int]] = field(default_factory=list)
    """With ``extra > 0`` in :func:`generate`: at each position, ``extra`` more ids drawn
    from the same distribution (Monte Carlo samples that do not continue the sequence)."""
    extra_logprobs: list[list[float]] = field(default_factory=list)
    """Behaviour log-probs of ``extra_ids``."""

    @property
    def done(self) -> bool:
        """Whether the completion ended with EOS (not cut at the token limit)."""
        return bool(self.tokens) and self.tokens[-1] == EOS


def _decode(
    policy: Policy,
    rows: list[list[int]],
    budgets: list[int],
    pick: Callable[[Tensor], tuple[Tensor, Tensor]],
    device: torch.device,
    extra: Callable[[Tensor], Tensor] | None = None,
) -> list[tuple[list[int], list[float], list[list[int]], list[list[float]]]]:
    """Extend each row by up to its budget of tokens, stopping a row at EOS.

    ``pick`` maps CPU float32 logits of the active rows, shape ``(a, vocab)``, to chosen ids,
    shape ``(a,)``, and their log-probs, shape ``(a, vocab)``; ``extra`` (optional) maps those
    log-probs to more ids per row, shape ``(a, e)``. Returns, per row, the new ids, the
    log-probs ``pick`` saw for them, and the extra ids and their log-probs at each position.
    """
    out: list[tuple[list[int], list[float], list[list[int]], list[list[float]]]] = [
        ([], [], [], []) for _ in rows
    ]
    active = [i for i, b in enumerate(budgets) if b > 0]
    while active:
        ids, lens = _right_pad([rows[i] for i in active], device)
        logits = policy(ids)
        last = logits[torch.arange(len(active), device=device), lens - 1].float().cpu()
        chosen, logp = pick(last)
        more = extra(logp) if extra is not None else None
        still = []
        for j, i in enumerate(active):
            tok = int(chosen[j])
            rows[i].append(tok)
            out[i][0].append(tok)
            out[i][1].append(float(logp[j, tok]))
            if more is not None:
                out[i][2].append([int(x) for x in more[j]])
                out[i][3].append([float(logp[j, int(x)]) for x in more[j]])
            if tok != EOS and len(out[i][0]) < budgets[i]:
                still.append(i)
        active = still
    return out


@torch.no_grad()
def generate(
    policy: Policy,
    prompt: Sequence[int],
    n: int,
    max_new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    device: str | torch.device | None = None,
    prefix: Sequence[Sequence[int]] | None = None,
    extra: int = 0,
    extra_generator: torch.Generator | None = None,
) -> list[Sample]:
    """``n`` samples for one prompt, decoded together; a row stops at EOS.

    ``max_new_tokens`` caps the whole completion, prefix included. With ``prefix`` (one
    already-generated completion prefix per sample, e.g. a partial rollout resumed under a
    newer policy version), row i continues from ``prompt + prefix[i]`` and its
    :class:`Sample` holds ONLY the newly generated tokens (empty if the prefix already ends
    with EOS or fills the cap). Tokens are drawn by ``torch.multinomial`` with ``generator``
    (a CPU generator) from CPU probabilities, so the same weights and generator state give
    the same samples and log-probs.

    With ``extra`` > 0, each position also draws ``extra`` ids (with replacement) from the
    same distribution with ``extra_generator``, a separate CPU generator, so the sampled
    sequences are the same with or without them (multi-sample Monte Carlo, AsyncOPD).
    """
    if extra > 0 and extra_generator is None:
        raise ValueError("extra samples need their own extra_generator")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if prefix is not None and len(prefix) != n:
        raise ValueError(f"prefix has {len(prefix)} rows for n={n} samples")
    pre = [list(p) for p in prefix] if prefix is not None else [[] for _ in range(n)]
    budgets = [0 if (p and p[-1] == EOS) else max(0, max_new_tokens - len(p)) for p in pre]

    def sample(logits: Tensor) -> tuple[Tensor, Tensor]:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1), logp

    def more(logp: Tensor) -> Tensor:
        return torch.multinomial(logp.exp(), extra, replacement=True, generator=extra_generator)

    was_training = policy.training if isinstance(policy, nn.Module) else False
    policy.eval()
    rows = [list(prompt) + p for p in pre]
    dev = _device_of(policy, device)
    out = _decode(policy, rows, budgets, sample, dev, more if extra > 0 else None)
    policy.train(was_training)
    return [Sample(toks, lps, decode(toks), ex, exl) for toks, lps, ex, exl in out]


def sequence_logprobs(
    policy: Policy,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    device: str | torch.device | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token log-probs of each completion given its prompt, in one batched forward.

    Rows are ``prompt + completion``, right-padded. Returns ``(logp, mask, entropy)``, each of
    shape ``(n, t_max)`` with ``t_max`` the longest completion: ``logp`` (float32,
    differentiable) is log_softmax(logits / temperature) at each completion token, ``mask``
    (bool) marks real tokens, ``entropy`` (float32, detached, nats) is the entropy of the
    tempered next-token distribution at each position. Padded positions hold 0.
    """
    logp_all, mask, targets = sequence_distributions(
        policy, prompts, completions, temperature, device
    )
    logp = logp_all.gather(2, targets[:, :, None]).squeeze(2).masked_fill(~mask, 0.0)
    with torch.no_grad():
        entropy = -(logp_all.exp() * logp_all).sum(-1).masked_fill(~mask, 0.0)
    return logp, mask, entropy


def sequence_distributions(
    policy: Policy,
    prompts: Sequence[Sequence[int]],
    completions: Sequence[Sequence[int]],
    temperature: float = 1.0,
    device: str | torch.device | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """The whole next-token distribution at each completion position, in one forward.

    Returns ``(logp_all, mask, targets)``: ``logp_all`` (float32, differentiable), shape
    ``(n, t_max, vocab)``, is log_softmax(logits / temperature) before completion token j of
    row i; ``mask`` (bool, ``(n, t_max)``) marks real tokens; ``targets`` (long) holds the
    completion's ids (0 where padded). Padded positions hold the distribution after the
    prompt's last token (ignore them through ``mask``).
    """
    dev = _device_of(policy, device)
    n = len(prompts)
    t_max = max((len(c) for c in completions), default=0)
    ids, _ = _right_pad([list(p) + list(c) for p, c in zip(prompts, completions)], dev)
    p_len = torch.tensor([len(p) for p in prompts], device=dev)
    c_len = torch.tensor([len(c) for c in completions], device=dev)
    steps = torch.arange(t_max, device=dev)
    mask = steps[None, :] < c_len[:, None]
    pos = (p_len[:, None] - 1 + steps[None, :]).clamp(max=ids.shape[1] - 1)
    pos = torch.where(mask, pos, torch.zeros_like(pos))
    logits = policy(ids).float() / temperature
    logits = logits.gather(1, pos[:, :, None].expand(n, t_max, logits.shape[-1]))
    logp_all = torch.log_softmax(logits, dim=-1)
    targets = ids.gather(1, torch.where(mask, pos + 1, torch.zeros_like(pos)))
    return logp_all, mask, targets.masked_fill(~mask, 0)


@torch.no_grad()
def greedy_completions(
    policy: Policy,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    device: str | torch.device | None = None,
) -> list[str]:
    """Greedy (argmax) completions of several prompts, decoded together, as text."""

    def argmax(logits: Tensor) -> tuple[Tensor, Tensor]:
        return logits.argmax(-1), torch.log_softmax(logits, dim=-1)

    was_training = policy.training if isinstance(policy, nn.Module) else False
    policy.eval()
    rows = [list(p) for p in prompts]
    out = _decode(policy, rows, [max_new_tokens] * len(rows), argmax, _device_of(policy, device))
    policy.train(was_training)
    return [decode(o[0]) for o in out]


@torch.no_grad()
def sample_completions(
    policy: Policy,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    generator: torch.Generator,
    temperature: float = 1.0,
    device: str | torch.device | None = None,
) -> list[list[int]]:
    """One sampled completion (ids, ending with EOS unless cut) of each of several prompts,
    decoded together: :func:`generate` across prompts instead of across samples of one."""

    def sample(logits: Tensor) -> tuple[Tensor, Tensor]:
        logp = torch.log_softmax(logits / temperature, dim=-1)
        return torch.multinomial(logp.exp(), 1, generator=generator).squeeze(1), logp

    was_training = policy.training if isinstance(policy, nn.Module) else False
    policy.eval()
    rows = [list(p) for p in prompts]
    out = _decode(policy, rows, [max_new_tokens] * len(rows), sample, _device_of(policy, device))
    policy.train(was_training)
    return [o[0] for o in out]


def greedy_accuracy(
    policy: Policy,
    task: Task,
    indices: Sequence[int],
    seed: int,
    device: str | torch.device | None = None,
) -> float:
    """Fraction of prompts ``task.sample(i, seed)``, i in ``indices``, answered exactly."""
    prompts = [task.sample(i, seed) for i in indices]
    texts = greedy_completions(policy, [p.tokens for p in prompts], task.max_new_tokens, device)
    return sum(task.score(p, t) for p, t in zip(prompts, texts)) / max(len(prompts), 1)


def warm_start(
    policy: Policy,
    task: Task,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    seed: int,
    device: str | torch.device | None = None,
    progress: bool = False,
) -> dict[str, float]:
    """Supervised warm start: teacher forcing on BOS + prompt -> answer + EOS, with Adam.

    Step s trains on prompts ``task.sample(WARM_START_INDEX + s * batch_size + j, seed)``;
    the loss is the mean negative log-prob of the answer tokens (EOS included). Returns the
    final ``loss`` and the greedy exact-match ``accuracy`` on 64 held-out prompts
    (indices from ``HELD_OUT_INDEX``). Deterministic given the initial weights and ``seed``.
    """
    from tqdm import tqdm

    from fedasync.progress import progress as make_progress

    opt = torch.optim.Adam(policy.parameters(), lr=lr)
    policy.train()
    loss = torch.tensor(float("nan"))
    with make_progress(
        steps, f"warm start {task.name}", tty_bar=tqdm, disable=not progress, leave=False
    ) as bar:
        for s in range(steps):
            batch = [
                task.sample(WARM_START_INDEX + s * batch_size + j, seed) for j in range(batch_size)
            ]
            answers = [encode(p.answer) + [EOS] for p in batch]
            logp, mask, _ = sequence_logprobs(
                policy, [p.tokens for p in batch], answers, device=device
            )
            loss = -(logp * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update(1)
    policy.eval()
    held_out = range(HELD_OUT_INDEX, HELD_OUT_INDEX + 64)
    return {"loss": loss.item(), "accuracy": greedy_accuracy(policy, task, held_out, seed, device)}
