"""The values the RL config allows beyond its choices: every numeric key's range (RANGES) and
the checks of a Hugging Face policy (``policy.hf_config``'s fields, ``policy.hf_path``'s saved
config, and that either's vocabulary holds the task's tokens).

Paper: none. :mod:`trainers.rl.config` declares the keys and runs these checks as each
section is built.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from fedasync.errors import ConfigError
from fedasync.ranges import AT_LEAST_ONE, NON_NEGATIVE, POSITIVE, Range
from runkit.configload import check
from trainers.rl.tasks import VOCAB_SIZE

RANGES: dict[str, Range] = {
    "run.seed": NON_NEGATIVE,
    "run.max_steps": Range(1, 100_000),
    "run.target_accuracy": Range(0, 1),
    "run.eval_every": AT_LEAST_ONE,
    "run.eval_prompts": Range(1, 10_000),
    "run.checkpoint_every": NON_NEGATIVE,
    "task.min_len": Range(1, 64),
    "task.max_len": Range(1, 64),
    "task.tail": Range(0, 10, lo_open=True),
    "policy.d_model": Range(8, 4096),
    "policy.n_layers": Range(1, 64),
    "policy.n_heads": Range(1, 64),
    "policy.warm_start_steps": Range(0, 100_000),
    "policy.warm_start_lr": Range(0, 1, lo_open=True),
    "policy.warm_start_batch": Range(1, 4096),
    "rollout.workers": Range(1, 4096),
    "rollout.group_size": Range(2, 1024),
    "rollout.batch_groups": Range(1, 4096),
    "rollout.max_staleness": Range(0, 1000),
    "rollout.temperature": Range(0.05, 10),
    "learner.lr": Range(0, 1, lo_open=True),
    "learner.clip_eps": Range(0, 1, lo_open=True),
    "learner.tis_cap": Range(1, 1000),
    "learner.drop_beyond": Range(0, 1000),
    "learner.weight_a": Range(0, 100),
    "learner.weight_b": Range(0, 1000),
    "learner.minibatches": Range(1, 1024),
    "learner.max_grad_norm": POSITIVE,
    "distill.top_k": Range(0, 4096),
    "distill.mc_samples": Range(1, 64),
    "distill.teachers": Range(1, 256),
    "distill.teacher_d_model": Range(8, 4096),
    "distill.teacher_n_layers": Range(1, 64),
    "distill.teacher_n_heads": Range(1, 64),
    "distill.teacher_steps": Range(0, 1_000_000),
    "distill.teacher_lr": Range(0, 1, lo_open=True),
    "distill.teacher_batch": Range(1, 4096),
    "distill.teacher_min_accuracy": Range(0, 1),
    "distill.teacher_seed": NON_NEGATIVE,
    "distill.teacher_dagger_steps": Range(0, 1_000_000),
    "distill.teacher_dagger_lr": Range(0, 1, lo_open=True),
    "distill.teacher_weak_steps": Range(0, 1_000_000),
    "distill.teacher_weak_share": Range(0, 1),
    "clock.teacher_token_s": POSITIVE,
    "faults.teacher_die_on_groups[]": NON_NEGATIVE,
    "clock.gen_token_s": POSITIVE,
    "clock.learn_token_s": POSITIVE,
    "clock.jitter": Range(0, 1, hi_open=True),
    "faults.die_on_groups[]": NON_NEGATIVE,
    "faults.nan_on_groups[]": NON_NEGATIVE,
}
"""Every numeric key's allowed values; None, where a key allows it, means off."""


_FIELD_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,99}")
_MODEL_TYPE = re.compile(r"[A-Za-z0-9_-]{1,100}")


def check_hf_config(fields: Any) -> None:
    """``policy.hf_config``: a mapping of field names to values, a str model_type, and a
    vocab_size (if given) that holds the task's tokens."""
    check(
        isinstance(fields, dict),
        f"policy.hf_config must map config fields to values, got {type(fields).__name__}",
    )
    for key in fields:
        check(
            isinstance(key, str) and _FIELD_NAME.fullmatch(key) is not None,
            f"policy.hf_config key {str(key)!r:.40} is not a config field name (in YAML write "
            "{n_layer: 2} with a space after the colon, or policy.hf_config.n_layer=2)",
        )
    model_type = fields.get("model_type", "gpt2")
    check(
        isinstance(model_type, str) and _MODEL_TYPE.fullmatch(model_type) is not None,
        f"policy.hf_config.model_type must name a transformers model type, got "
        f"{str(model_type)!r:.40}",
    )
    check_vocab(fields.get("vocab_size", VOCAB_SIZE), "policy.hf_config.vocab_size")


def check_hf_path(path: str) -> None:
    """``policy.hf_path``: a directory with a config.json whose vocabulary (where it says
    one) holds the task's tokens."""
    where = f"policy.hf_path {path!r:.200}"
    d = Path(path)
    check(d.is_dir(), f"{where} is not a directory")
    check(
        (d / "config.json").is_file(),
        f"{where} has no config.json (a directory written by save_pretrained)",
    )
    try:
        saved = json.loads((d / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: config.json does not read: {str(e)[:100]}") from None
    check(isinstance(saved, dict), f"{where}: config.json is not a JSON object")
    vocab = saved.get("vocab_size")
    text = saved.get("text_config")
    if vocab is None and isinstance(text, dict):
        vocab = text.get("vocab_size")
    if vocab is not None:  # else checked on the model when it is built
        check_vocab(vocab, f"{where}: config.json's vocab_size")


def check_vocab(vocab: Any, name: str) -> None:
    """``vocab`` (named ``name`` in the error) holds the task's vocabulary."""
    check(
        isinstance(vocab, int) and not isinstance(vocab, bool) and vocab >= VOCAB_SIZE,
        f"{name} must be an integer >= {VOCAB_SIZE} (the task's vocabulary: its ids are the "
        f"model's first {VOCAB_SIZE}), got {str(vocab):.40}",
    )
