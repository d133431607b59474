"""The RL engine: the modes' schedules, parity at S = 0, the staleness bound (also across a
kill and resume), faults, and the config's errors."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fedasync.events import read_events
from trainers.rl.config import load_rl_config
from trainers.rl.engine import RLRun

TINY = [
    "policy.d_model=32",
    "policy.n_layers=1",
    "policy.n_heads=2",
    "policy.warm_start_steps=60",
    "rollout.workers=3",
    "rollout.group_size=4",
    "rollout.batch_groups=3",
    "run.max_steps=4",
    "run.eval_every=2",
    "run.eval_prompts=8",
    "run.progress=false",
    "run.plots=false",
    "clock.gen_token_s=0.01",
    "clock.learn_token_s=0.002",
    "task.max_len=6",
]


def _run(tmp_path: Path, name: str, *extra: str) -> RLRun:
    cfg = load_rl_config(None, [*TINY, f"run.out_dir={tmp_path}", f"run.name={name}", *extra])
    run = RLRun(cfg, tmp_path / name)
    run.run()
    return run


def _steps(run_dir: Path) -> list[dict]:
    return [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == "step"]


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_async_and_streaming_at_staleness_zero_equal_sync_bit_for_bit(tmp_path):
    sync = _run(tmp_path, "sync", "rollout.mode=sync")
    others = [
        _run(tmp_path, m, f"rollout.mode={m}", "rollout.max_staleness=0")
        for m in ("async", "streaming")
    ]

    for run in others:
        assert _same_weights(run.policy.state_dict(), sync.policy.state_dict())
        assert [s["groups"] for s in _steps(run.run_dir)] == [
            s["groups"] for s in _steps(sync.run_dir)
        ]
    # and the learning moved the weights (parity of two runs that learnt nothing proves nothing)
    fresh = torch.load(tmp_path / "sync" / "policy.pt")
    assert _same_weights(fresh, sync.policy.state_dict())
    assert sync.version == 4 and any(s.get("grad_norm", 0.0) > 0 for s in _steps(sync.run_dir))


@pytest.mark.parametrize("mode", ["async", "streaming"])
def test_no_trajectory_staler_than_the_bound_is_learnt(tmp_path, mode):
    run = _run(tmp_path, mode, f"rollout.mode={mode}", "rollout.max_staleness=1", "run.max_steps=6")

    seen = {int(k) for s in _steps(run.run_dir) for k in s["staleness_hist"]}
    assert max(seen) <= 1
    assert 1 in seen  # it did run ahead of the learner


def test_one_step_off_learns_from_the_previous_version(tmp_path):
    run = _run(tmp_path, "osf", "rollout.mode=one_step_off")

    hists = [s["staleness_hist"] for s in _steps(run.run_dir)]
    assert hists[0] == {"0": 12}
    assert all(h == {"1": 12} for h in hists[1:])


def test_streaming_does_not_wait_for_the_long_tail(tmp_path):
    sync = _run(tmp_path, "s", "rollout.mode=sync", "run.max_steps=6")
    stream = _run(
        tmp_path, "st", "rollout.mode=streaming", "rollout.max_staleness=2", "run.max_steps=6"
    )

    # virtual time: the same number of versions in less time, with busier workers
    assert stream.clock.now < sync.clock.now
    assert stream.summary()["worker_utilisation"] > sync.summary()["worker_utilisation"]


def test_a_worker_that_dies_is_redone_and_a_nan_log_prob_is_rejected(tmp_path):
    run = _run(
        tmp_path, "f", "rollout.mode=async", "faults.die_on_groups=[1]", "faults.nan_on_groups=[2]"
    )

    s = run.summary()
    assert s["redone_groups"] == 1 and run.version == 4
    rejects = [e for e in read_events(run.run_dir / "metrics.jsonl") if e["event"] == "reject"]
    assert len(rejects) == 1 and "log-prob" in rejects[0]["reason"]
    outcomes = [
        e["outcome"]
        for e in read_events(run.run_dir / "metrics.jsonl")
        if e["event"] == "rollout" and e["group"] == 1
    ]
    assert outcomes == ["died", "done"]


def _fedasync() -> str:
    return str(Path(sys.executable).parent / "fedasync")


@pytest.mark.slow
def test_killed_and_resumed_run_ends_as_the_uninterrupted_one_within_the_bound(tmp_path):
    args = [
        *TINY,
        "rollout.mode=streaming",
        "rollout.max_staleness=1",
        "run.max_steps=10",
        "run.checkpoint_every=2",
        f"run.out_dir={tmp_path}",
    ]
    whole = subprocess.run(
        [_fedasync(), "rl", *args, "run.name=whole"], capture_output=True, text=True, timeout=600
    )
    assert whole.returncode == 0, whole.stderr[-2000:]

    proc = subprocess.Popen(
        [_fedasync(), "rl", *args, "run.name=killed"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    metrics = tmp_path / "killed" / "metrics.jsonl"
    deadline = time.monotonic() + 300
    try:
        while time.monotonic() < deadline:
            if metrics.is_file() and any(
                e["event"] == "checkpoint" and e["version"] >= 4 for e in read_events(metrics)
            ):
                break
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=30)
    assert not (tmp_path / "killed" / "summary.json").exists()  # it really died mid-run

    resumed = subprocess.run(
        [_fedasync(), "rl", *args, "run.name=killed", "run.resume=true"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]

    a = torch.load(tmp_path / "whole" / "policy.pt")
    b = torch.load(tmp_path / "killed" / "policy.pt")
    assert _same_weights(a, b)
    events = read_events(metrics)
    steps = [e for e in events if e["event"] == "step"]
    assert [s["version"] for s in steps] == list(range(1, 11))  # none twice, none lost
    assert max(int(k) for s in steps for k in s["staleness_hist"]) <= 1
    assert any(e["event"] == "resume" for e in events)
    summary = json.loads((tmp_path / "killed" / "summary.json").read_text())
    assert summary["versions"] == 10


@pytest.mark.parametrize(
    "override, words",
    [
        ("rollout.max_staleness=-1", "rollout.max_staleness must be"),
        ("rollout.group_size=1", "rollout.group_size must be"),
        ("learner.tis_cap=0.5", "learner.tis_cap must be"),
        ("rollout.mode=turbo", "rollout.mode must be one of"),
        ("rollout.nope=3", "rollout.nope"),
    ],
)
def test_a_bad_config_is_one_clear_line_and_exit_2(override, words, tmp_path, capsys):
    # the CLI's own entry point in this process (the process exit is checked below, once)
    from simulations.cli import main

    assert main(["rl", override, f"run.out_dir={tmp_path}"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], lines


def test_the_fedasync_process_exits_2_on_a_bad_rl_key(tmp_path):
    out = subprocess.run(
        [_fedasync(), "rl", "rollout.nope=3", f"run.out_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=120,
    )

    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "rollout.nope" in lines[0], out.stderr[-500:]


def test_a_checkpoint_of_the_old_flat_format_is_refused_with_one_clear_error(tmp_path):
    from fedasync.checkpoint import save_checkpoint
    from fedasync.errors import CheckpointError

    (tmp_path / "old").mkdir()  # a checkpoint written before the engine was split in parts
    save_checkpoint(tmp_path / "old" / "checkpoint.pt", {"config": {}, "version": 2})
    resumed = load_rl_config(None, [*TINY, f"run.out_dir={tmp_path}", "run.resume=true"])
    with pytest.raises(
        CheckpointError, match="written by an older fedasync .* start the run afresh"
    ):
        RLRun(resumed, tmp_path / "old").run()
