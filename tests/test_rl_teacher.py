"""The distillation teacher's DAgger training: the task's expert, recovery, the cache key."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from fedasync.errors import ConfigError
from trainers.rl.config import load_rl_config
from trainers.rl.engine import RLRun
from trainers.rl.tasks import EOS, Prompt, encode, make_task
from trainers.rl.teacher import agreement, expert_targets, teacher_key


def _prompt(task: str, text: str, answer: str) -> Prompt:
    return Prompt(0, task, text, (1, *encode(text)), answer)


def _ids(text: str) -> list[int]:
    return encode(text)


# ------------------------------------------------------------------ the expert
def test_the_sort_expert_writes_the_smallest_digit_left_even_after_a_mistake():
    task, p = make_task("sort"), _prompt("sort", "s:3141=", "1134")
    # right all the way, then EOS
    assert task.expert_labels(p, [*_ids("1134"), EOS]) == [*_ids("1134"), EOS]
    # "3" too early: the expert still asks for the smallest digit left, then the rest in order
    assert task.expert_labels(p, [*_ids("1314"), EOS]) == [*_ids("1114"), EOS]
    # a digit the prompt lacks is ignored; stopping early is answered with the next digit
    assert task.expert_labels(p, [*_ids("19"), EOS]) == _ids("111")
    # once every digit is written, EOS however long the completion goes on
    assert task.expert_labels(p, _ids("113455")) == [*_ids("1134"), EOS, EOS]


@pytest.mark.parametrize("name", ["reverse", "copy", "add"])
def test_the_other_experts_follow_the_answer_by_position(name):
    task, p = make_task(name), _prompt(name, "r:3141=", "1413")
    assert task.expert_labels(p, _ids("99999")) == [*_ids("1413"), EOS]
    assert task.expert_labels(p, []) == []


def test_recovery_counts_the_positions_after_the_first_mistake_only():
    task, p = make_task("sort"), _prompt("sort", "s:3141=", "1134")
    comps = [[*_ids("1314"), EOS], [*_ids("1134"), EOS]]  # a mistake at position 1; none
    labels, after = expert_targets(task, [p, p], comps, torch.device("cpu"))
    assert after.tolist() == [[False, False, True, True, True], [False] * 5]
    vocab = 21
    logp = torch.full((2, 5, vocab), -10.0)
    # the model says: row 0 the expert's token at positions 0, 2, 3 (not 1, not 4); row 1 all
    for i, j in [(0, 0), (0, 2), (0, 3), *[(1, j) for j in range(5)]]:
        logp[i, j, labels[i, j]] = 0.0
    mask = torch.ones(2, 5, dtype=torch.bool)
    got = agreement(logp, mask, labels, after)
    assert got["recovery"] == pytest.approx(2 / 3)  # positions 2, 3 of 2, 3, 4
    assert got["on_path"] == pytest.approx(6 / 7)  # row 0's 0 (not 1), row 1's five
    assert got["recovery_positions"] == 3
    none = agreement(logp[1:], mask[1:], labels[1:], after[1:])
    assert none["recovery"] is None and none["on_path"] == 1.0


# ------------------------------------------------------------------ config and cache key
def _cfg(*extra: str):
    return load_rl_config(None, ["distill.loss=forward_kl", *extra])


def test_a_supervised_teacher_keeps_its_cache_key_and_dagger_settings_change_it():
    cfg = _cfg()
    d, t = cfg.distill, cfg.task
    before = {
        "task": [t.name, t.min_len, t.max_len, t.tail],
        "shape": [d.teacher_d_model, d.teacher_n_layers, d.teacher_n_heads],
        "train": [d.teacher_steps, d.teacher_lr, d.teacher_batch],
        "seed": d.teacher_seed,
    }  # the key's recipe before DAgger existed: teachers cached then still load
    assert (
        teacher_key(cfg)
        == hashlib.sha256(json.dumps(before, sort_keys=True).encode()).hexdigest()[:16]
    )
    assert teacher_key(_cfg("distill.teacher_weak_steps=7")) == teacher_key(cfg)
    keys = {
        teacher_key(_cfg(*x))
        for x in (
            [],
            ["distill.teacher_dagger_steps=10"],
            ["distill.teacher_dagger_steps=11"],
            ["distill.teacher_dagger_steps=10", "distill.teacher_weak_steps=7"],
            ["distill.teacher_dagger_steps=10", "distill.teacher_weak_share=0.25"],
            ["distill.teacher_dagger_steps=10", "distill.teacher_dagger_lr=0.001"],
        )
    }
    assert len(keys) == 6


def test_a_weaker_model_past_the_supervised_steps_is_a_config_error():
    with pytest.raises(ConfigError, match="teacher_weak_steps=200 must be at most"):
        _cfg(
            "distill.teacher_dagger_steps=5",
            "distill.teacher_steps=100",
            "distill.teacher_weak_steps=200",
        )
    with pytest.raises(ConfigError, match="teacher_weak_share"):
        _cfg("distill.teacher_weak_share=1.5")


# ------------------------------------------------------------------ DAgger end to end
TINY = [
    "policy.d_model=32",
    "policy.n_layers=1",
    "policy.n_heads=2",
    "policy.warm_start_steps=10",
    "rollout.workers=3",
    "rollout.group_size=4",
    "rollout.batch_groups=3",
    "rollout.mode=sync",
    "run.max_steps=2",
    "run.eval_every=1",
    "run.eval_prompts=16",
    "run.progress=false",
    "run.plots=false",
    "clock.gen_token_s=0.01",
    "clock.learn_token_s=0.002",
    "clock.teacher_token_s=0.001",
    "task.max_len=6",
    "distill.loss=forward_kl",
    "distill.teacher_d_model=48",
    "distill.teacher_n_layers=2",
    "distill.teacher_n_heads=2",
    "distill.teacher_steps=150",
    "distill.teacher_batch=32",
    "distill.teacher_lr=0.003",
    "distill.teacher_weak_steps=15",
]


@pytest.mark.slow
def test_dagger_teaches_the_teacher_to_recover_and_runs_report_it(tmp_path):
    def run(name: str, *extra: str) -> dict:
        cfg = load_rl_config(
            None,
            [
                *TINY,
                f"run.out_dir={tmp_path}",
                f"run.name={name}",
                f"distill.cache_dir={tmp_path / 'teachers'}",
                *extra,
            ],
        )
        return RLRun(cfg, tmp_path / name).run()

    sup = run("sup")["distill"]["teacher"]
    dag_summary = run(
        "dagger", "distill.teacher_dagger_steps=120", "distill.teacher_dagger_lr=0.003"
    )
    dag = dag_summary["distill"]["teacher"]

    # the DAgger teacher starts from the same supervised weights, measured on the same prefixes
    assert dag["supervised_recovery"] == pytest.approx(sup["recovery"])
    assert dag["supervised_accuracy"] == pytest.approx(sup["accuracy"])
    assert dag["recovery_positions"] == sup["recovery_positions"] > 50
    # and learns what teacher forcing never showed it: the expert's move after a mistake
    assert dag["recovery"] > sup["recovery"] + 0.05, (sup, dag)
    # every evaluation reports the teacher's recovery on the student's own samples
    rows = dag_summary["evals"]
    assert len(rows) == 3
    for r in rows:
        for key in ("teacher_recovery", "teacher_on_path"):
            assert r[key] is None or 0.0 <= r[key] <= 1.0
    assert any(r["teacher_recovery"] is not None for r in rows)
