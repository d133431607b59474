"""The distillation teacher: a larger TinyLM trained once on the task, cached on disk, and
the one-process scorer the engine uses when there is no Ray.

Paper: none for the supervised phase (as in :func:`trainers.rl.policy.warm_start`). The
teacher is trained with teacher forcing on the task's exact answers (prompt indices disjoint
from RL's and the evaluation's) until its held-out greedy accuracy is high; a weak one is
reported, not refused (tests use a tiny one).

Teacher forcing only ever shows the teacher right prefixes, so on a student's wrong prefix its
advice is untrained. ``distill.teacher_dagger_steps`` > 0 adds DAgger (Ross, Gordon and
Bagnell 2011, arXiv:1011.0686): each step samples completions from the teacher itself and
from a weaker model (its own weights after ``distill.teacher_weak_steps`` supervised steps),
labels every position with the task's expert next token (:meth:`Task.expert_labels`: what
best continues that prefix, right or wrong) and trains on them. Departures: fresh samples
each step instead of an aggregated dataset, and the weaker model fixed rather than a mixture
decaying with the round. Its effect is measured as *recovery*: on the weaker model's samples
of held-out prompts, how often the teacher's argmax is the expert's token at the positions
after the sample's first mistake (``recovery``), and before it (``on_path``); the engine
reports the same on the student's own samples at every evaluation.

The trained weights are cached by a key of everything that makes them (task, shape, steps,
learning rate, batch, seed, DAgger settings), written atomically, with a JSON sidecar of their
accuracy and recovery: a second run with the same teacher settings loads them instead of
training again. A cache file that does not load is trained again, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fedasync import seeds
from fedasync.errors import ConfigError
from trainers.rl.config import RLConfig
from trainers.rl.policy import (
    HELD_OUT_INDEX,
    PolicyConfig,
    TinyLM,
    sample_completions,
    sequence_distributions,
    warm_start,
)
from trainers.rl.tasks import EOS, VOCAB_SIZE, Prompt, Task, encode

log = logging.getLogger("fedasync.rl")

DAGGER_INDEX = 15_000_000
"""First prompt index of the DAgger steps (between the supervised and the held-out ones)."""
RECOVERY_PROMPTS = 256
"""Held-out prompts on whose weaker-model samples a trained teacher's recovery is measured."""


def build_teacher(cfg: RLConfig) -> TinyLM:
    """An untrained teacher of the configured shape (seeded)."""
    d = cfg.distill
    torch.manual_seed(seeds.linear_seed(d.teacher_seed, "rl.teacher"))
    return TinyLM(
        PolicyConfig(
            vocab_size=VOCAB_SIZE,
            d_model=d.teacher_d_model,
            n_layers=d.teacher_n_layers,
            n_heads=d.teacher_n_heads,
        )
    )


def teacher_key(cfg: RLConfig) -> str:
    """What determines a trained teacher, hashed: equal keys, equal weights."""
    d, t = cfg.distill, cfg.task
    what: dict[str, Any] = {
        "task": [t.name, t.min_len, t.max_len, t.tail],
        "shape": [d.teacher_d_model, d.teacher_n_layers, d.teacher_n_heads],
        "train": [d.teacher_steps, d.teacher_lr, d.teacher_batch],
        "seed": d.teacher_seed,
    }
    if d.teacher_dagger_steps:  # absent otherwise: supervised teachers keep their old keys
        what["dagger"] = [
            d.teacher_dagger_steps,
            d.teacher_dagger_lr,
            d.teacher_weak_steps,
            d.teacher_weak_share,
        ]
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def cache_dir(cfg: RLConfig) -> Path:
    """``distill.cache_dir``, else $FEDASYNC_DATA/teachers, else <run.out_dir>/teachers."""
    if cfg.distill.cache_dir:
        return Path(cfg.distill.cache_dir)
    data = os.environ.get("FEDASYNC_DATA")
    return Path(data) / "teachers" if data else Path(cfg.run.out_dir) / "teachers"


def load_or_train_teacher(
    cfg: RLConfig, task: Task, device: torch.device, progress: bool = False
) -> tuple[TinyLM, dict[str, Any]]:
    """The teacher (eval mode, on ``device``) and what is known of it: ``accuracy`` (held-out
    greedy exact match), ``source`` (path loaded or trained), ``trained`` (bool)."""
    teacher = build_teacher(cfg)
    d = cfg.distill
    if d.teacher_path:
        path = Path(d.teacher_path)
        if not path.is_file():
            raise ConfigError(f"distill.teacher_path {str(path)[:200]} does not exist")
        try:
            teacher.load_state_dict(torch.load(path, map_location="cpu", weights_only=True))
        except Exception as e:
            raise ConfigError(
                f"distill.teacher_path {str(path)[:200]} does not hold a teacher of shape "
                f"d_model={d.teacher_d_model}, n_layers={d.teacher_n_layers}: "
                f"{type(e).__name__}"
            ) from e
        teacher.to(device).eval()
        return teacher, {"source": str(path), "trained": False, "accuracy": None}
    folder = cache_dir(cfg)
    key = teacher_key(cfg)
    weights, meta = folder / f"teacher-{key}.pt", folder / f"teacher-{key}.json"
    if weights.is_file() and meta.is_file():
        try:
            teacher.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
            saved = json.loads(meta.read_text())
            teacher.to(device).eval()
            log.info("teacher: loaded %s (held-out accuracy %s)", weights, saved.get("accuracy"))
            return teacher, {**saved, "source": str(weights), "trained": False}
        except Exception as e:  # a torn or foreign file: train again
            log.warning("teacher cache %s does not load (%s): training again", weights, e)
            teacher = build_teacher(cfg)
    if d.teacher_dagger_steps:
        teacher, info = _train_dagger(cfg, task, device, progress)
    else:
        teacher, info = _train_supervised(cfg, task, device, progress)
    info["key"] = key
    if info["accuracy"] < d.teacher_min_accuracy:
        log.warning(
            "teacher: held-out accuracy %.3f after %d steps is below "
            "distill.teacher_min_accuracy=%.2f (a weak teacher; raise distill.teacher_steps)",
            info["accuracy"],
            d.teacher_steps,
            d.teacher_min_accuracy,
        )
    folder.mkdir(parents=True, exist_ok=True)
    tmp = weights.with_suffix(f".tmp{os.getpid()}")
    torch.save({k: v.detach().cpu() for k, v in teacher.state_dict().items()}, tmp)
    os.replace(tmp, weights)
    tmp = meta.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(json.dumps(info, indent=2))
    os.replace(tmp, meta)
    log.info(
        "teacher: trained, held-out accuracy %.3f, recovery %s after a mistake (%s), cached as %s",
        info["accuracy"],
        "-" if info["recovery"] is None else f"{info['recovery']:.3f}",
        f"DAgger {d.teacher_dagger_steps} steps" if d.teacher_dagger_steps else "supervised",
        weights,
    )
    return teacher, {**info, "source": str(weights), "trained": True}


def _train(
    cfg: RLConfig,
    model: TinyLM,
    task: Task,
    steps: int,
    device: torch.device,
    progress: bool = False,
) -> dict[str, Any]:
    d = cfg.distill
    return warm_start(
        model,
        task,
        steps=steps,
        batch_size=d.teacher_batch,
        lr=d.teacher_lr,
        seed=seeds.linear_seed(d.teacher_seed, "rl.teacher"),
        device=device,
        progress=progress,
    )


def _weaker(cfg: RLConfig, task: Task, device: torch.device) -> TinyLM:
    """The teacher's own weights after ``distill.teacher_weak_steps`` supervised steps (the
    same initial weights and prompts as the teacher's, so the same as its run was then)."""
    weak = build_teacher(cfg).to(device)
    _train(cfg, weak, task, min(cfg.distill.teacher_weak_steps, cfg.distill.teacher_steps), device)
    return weak.eval()


def _train_supervised(
    cfg: RLConfig, task: Task, device: torch.device, progress: bool
) -> tuple[TinyLM, dict[str, Any]]:
    """A teacher trained by teacher forcing, its accuracy, and its recovery on the weaker
    model's samples."""
    d = cfg.distill
    teacher = build_teacher(cfg).to(device)
    stats = _train(cfg, teacher, task, d.teacher_steps, device, progress)
    teacher.eval()
    info = {"loss": stats["loss"], "steps": d.teacher_steps, "accuracy": stats["accuracy"]}
    seed = seeds.linear_seed(d.teacher_seed, "rl.teacher")
    return teacher, info | recovery(teacher, _weaker(cfg, task, device), task, seed, device)


def _train_dagger(
    cfg: RLConfig, task: Task, device: torch.device, progress: bool
) -> tuple[TinyLM, dict[str, Any]]:
    """The supervised teacher of the same settings (loaded from the cache, or trained and
    cached), then :func:`dagger`."""
    d = cfg.distill
    seed = seeds.linear_seed(d.teacher_seed, "rl.teacher")
    base = replace(cfg, distill=replace(d, teacher_dagger_steps=0))
    teacher, before = load_or_train_teacher(base, task, device, progress)
    weak = _weaker(cfg, task, device)
    supervised = recovery(teacher, weak, task, seed, device)
    dag = dagger(
        teacher,
        weak,
        task,
        steps=d.teacher_dagger_steps,
        batch_size=d.teacher_batch,
        lr=d.teacher_dagger_lr,
        weak_share=d.teacher_weak_share,
        seed=seed,
        device=device,
        progress=progress,
    )
    info = {
        "loss": before.get("loss"),
        "steps": d.teacher_steps,
        "dagger_steps": d.teacher_dagger_steps,
        "dagger_loss": dag["loss"],
        "supervised_accuracy": before.get("accuracy"),
        "supervised_recovery": supervised["recovery"],
        "supervised_on_path": supervised["on_path"],
        "accuracy": dag["accuracy"],
    }
    return teacher, info | recovery(teacher, weak, task, seed, device)


def expert_targets(
    task: Task, prompts: list[Prompt], completions: list[list[int]], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """The expert's labels, right-padded to ``(n, t_max)`` as :func:`sequence_distributions`
    lays completions out, and a mask of the positions after each completion's first mistake
    (its first token that is not the expert's)."""
    t_max = max((len(c) for c in completions), default=0)
    labels = torch.zeros(len(completions), t_max, dtype=torch.long)
    after = torch.zeros(len(completions), t_max, dtype=torch.bool)
    for i, (p, c) in enumerate(zip(prompts, completions)):
        lab = task.expert_labels(p, c)
        labels[i, : len(lab)] = torch.as_tensor(lab, dtype=torch.long)
        wrong = [j for j, (tok, want) in enumerate(zip(c, lab)) if tok != want]
        if wrong:
            after[i, wrong[0] + 1 : len(c)] = True
    return labels.to(device), after.to(device)


def agreement(
    logp_all: torch.Tensor,
    mask: torch.Tensor,
    labels: torch.Tensor,
    after: torch.Tensor,
) -> dict[str, float | None]:
    """How often a model's argmax (``logp_all`` over completions, from
    :func:`sequence_distributions`) is the expert's token: ``recovery`` at the positions after
    a completion's first mistake, ``on_path`` up to it; None where there is no such position."""
    hit = logp_all.argmax(-1) == labels
    off, on = mask & after, mask & ~after

    def frac(where: torch.Tensor) -> float | None:
        n = int(where.sum())
        return float((hit & where).sum()) / n if n else None

    return {"recovery": frac(off), "on_path": frac(on), "recovery_positions": float(off.sum())}


@torch.no_grad()
def recovery(
    model: torch.nn.Module, sampler: torch.nn.Module, task: Task, seed: int, device: torch.device
) -> dict[str, float | None]:
    """:func:`agreement` of ``model`` on one sample by ``sampler`` (temperature 1) of each of
    :data:`RECOVERY_PROMPTS` held-out prompts (fixed generator: the same prefixes for every
    model judged with the same sampler)."""
    prompts = [task.sample(HELD_OUT_INDEX + i, seed) for i in range(RECOVERY_PROMPTS)]
    toks = [p.tokens for p in prompts]
    gen = torch.Generator().manual_seed(seed)
    comps = sample_completions(sampler, toks, task.max_new_tokens, gen, device=device)
    logp_all, mask, _ = sequence_distributions(model, toks, comps, device=device)
    return agreement(logp_all, mask, *expert_targets(task, prompts, comps, logp_all.device))


def dagger(
    teacher: torch.nn.Module,
    weak: torch.nn.Module,
    task: Task,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    weak_share: float,
    seed: int,
    device: torch.device,
    progress: bool = False,
) -> dict[str, float]:
    """DAgger steps on ``teacher`` (in place): each samples one completion of ``batch_size``
    prompts (``task.sample(DAGGER_INDEX + s * batch_size + j, seed)``), the first
    ``round(weak_share * batch_size)`` by ``weak``, the rest by the teacher as it is now, and
    takes an Adam step on the mean cross-entropy of the teacher against the expert's label at
    every position of them and of the prompts' exact answers (teacher forcing: DAgger's
    aggregate keeps the expert's demonstrations). Returns the last ``loss`` and the greedy held-out ``accuracy``."""
    from tqdm import tqdm

    from fedasync.progress import progress as make_progress
    from trainers.rl.policy import greedy_accuracy

    opt = torch.optim.Adam(teacher.parameters(), lr=lr)
    gen = torch.Generator().manual_seed(seeds.linear_seed(seed, "rl.dagger"))
    n_weak = round(weak_share * batch_size)
    loss = torch.tensor(float("nan"))
    with make_progress(
        steps, f"teacher DAgger {task.name}", tty_bar=tqdm, disable=not progress, leave=False
    ) as bar:
        for s in range(steps):
            prompts = [
                task.sample(DAGGER_INDEX + s * batch_size + j, seed) for j in range(batch_size)
            ]
            toks = [p.tokens for p in prompts]
            comps: list[list[int]] = []
            for model, part in ((weak, toks[:n_weak]), (teacher, toks[n_weak:])):
                if part:
                    comps += sample_completions(
                        model, part, task.max_new_tokens, gen, device=device
                    )
            # the expert's own demonstrations stay in the data, as in DAgger's aggregate
            comps += [encode(p.answer) + [EOS] for p in prompts]
            prompts, toks = prompts * 2, toks * 2
            teacher.train()
            logp_all, mask, _ = sequence_distributions(teacher, toks, comps, device=device)
            labels, _ = expert_targets(task, prompts, comps, logp_all.device)
            nll = -logp_all.gather(2, labels[:, :, None]).squeeze(2)
            loss = (nll * mask).sum() / mask.sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            bar.update(1)
    teacher.eval()
    held_out = range(HELD_OUT_INDEX, HELD_OUT_INDEX + 64)
    return {"loss": loss.item(), "accuracy": greedy_accuracy(teacher, task, held_out, seed, device)}
