"""The distillation teacher: a larger TinyLM trained once on the task, cached on disk, and
the one-process scorer the engine uses when there is no Ray.

Paper: none (supervised training as in :func:`trainers.rl.policy.warm_start`). The teacher is
trained with teacher forcing on the task's exact answers (prompt indices disjoint from RL's and
the evaluation's) until its held-out greedy accuracy is high; a weak one is reported, not
refused (tests use a tiny one). The trained weights are cached by a key of everything that
makes them (task, shape, steps, learning rate, batch, seed), written atomically, with a JSON
sidecar of their accuracy: a second run with the same teacher settings loads them instead of
training again. A cache file that does not load is trained again, with a warning.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from fedasync.errors import ConfigError
from trainers.rl.config import RLConfig
from trainers.rl.policy import PolicyConfig, TinyLM, warm_start
from trainers.rl.tasks import VOCAB_SIZE, Task

log = logging.getLogger("fedasync.rl")

TEACHER_SEED_OFFSET = 4_242
"""The teacher's initialisation and training prompts use distill.teacher_seed + this."""


def build_teacher(cfg: RLConfig) -> TinyLM:
    """An untrained teacher of the configured shape (seeded)."""
    d = cfg.distill
    torch.manual_seed(d.teacher_seed + TEACHER_SEED_OFFSET)
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
    what = {
        "task": [t.name, t.min_len, t.max_len, t.tail],
        "shape": [d.teacher_d_model, d.teacher_n_layers, d.teacher_n_heads],
        "train": [d.teacher_steps, d.teacher_lr, d.teacher_batch],
        "seed": d.teacher_seed,
    }
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
            info = json.loads(meta.read_text())
            teacher.to(device).eval()
            log.info("teacher: loaded %s (held-out accuracy %s)", weights, info.get("accuracy"))
            return teacher, {**info, "source": str(weights), "trained": False}
        except Exception as e:  # a torn or foreign file: train again
            log.warning("teacher cache %s does not load (%s): training again", weights, e)
            teacher = build_teacher(cfg)
    teacher.to(device)
    stats = warm_start(
        teacher,
        task,
        steps=d.teacher_steps,
        batch_size=d.teacher_batch,
        lr=d.teacher_lr,
        seed=d.teacher_seed + TEACHER_SEED_OFFSET,
        device=device,
        progress=progress,
    )
    teacher.eval()
    info = {
        "key": key,
        "accuracy": stats["accuracy"],
        "loss": stats["loss"],
        "steps": d.teacher_steps,
    }
    if stats["accuracy"] < d.teacher_min_accuracy:
        log.warning(
            "teacher: held-out accuracy %.3f after %d steps is below "
            "distill.teacher_min_accuracy=%.2f (a weak teacher; raise distill.teacher_steps)",
            stats["accuracy"],
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
    log.info("teacher: trained, held-out accuracy %.3f, cached as %s", stats["accuracy"], weights)
    return teacher, {**info, "source": str(weights), "trained": True}
