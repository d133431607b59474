"""Cost profiles of the virtual clock: costs only, never the learning rule; the share they set;
the long tail; their config errors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from test_rl_engine import TINY as ENGINE_TINY

from fedasync.errors import ConfigError
from fedasync.events import read_events
from trainers.rl.config import PROFILE_NAMES, load_rl_config
from trainers.rl.engine import RLRun
from trainers.rl.profiles import PROFILES, calibrate, makespan, tail_factor
from trainers.rl.tasks import make_task

# the engine tests' tiny run, less the learner's cost, which a profile sets itself
TINY = [o for o in ENGINE_TINY if not o.startswith("clock.learn_token_s=")]


def _run(tmp_path: Path, name: str, *extra: str) -> RLRun:
    cfg = load_rl_config(None, [*TINY, f"run.out_dir={tmp_path}", f"run.name={name}", *extra])
    run = RLRun(cfg, tmp_path / name)
    run.run()
    return run


def _steps(run: RLRun) -> list[dict]:
    return [e for e in read_events(run.run_dir / "metrics.jsonl") if e["event"] == "step"]


def test_the_config_names_every_profile_and_only_those():
    assert set(PROFILE_NAMES) == set(PROFILES)


def test_sync_learns_the_same_weights_under_every_profile_in_different_times(tmp_path):
    runs = {
        p: _run(tmp_path, p, "rollout.mode=sync", f"clock.profile={p}")
        for p in ("gen45", "gen80", "gen80_tail")
    }
    local = _run(tmp_path, "local", "rollout.mode=sync", "clock.learn_token_s=0.002")
    runs["local"] = local

    ref = local.policy.state_dict()
    for p, run in runs.items():
        state = run.policy.state_dict()
        assert all(torch.equal(state[k], ref[k]) for k in ref), p
        assert [s["groups"] for s in _steps(run)] == [s["groups"] for s in _steps(local)]
    times = {p: run.clock.now for p, run in runs.items()}
    assert len(set(times.values())) == len(times)  # the clock, and only it, differs
    # a larger generation share is a cheaper learner: the same steps in less time
    assert times["gen80"] < times["gen45"]
    start = next(e for e in read_events(runs["gen45"].run_dir / "metrics.jsonl"))
    assert start["profile"]["name"] == "gen45"
    assert start["profile"]["limit"] == pytest.approx(1 / 0.55, rel=0.35)


def test_streaming_gains_more_where_generation_takes_more_of_the_step(tmp_path):
    ratio = {}
    for p in ("gen45", "gen80"):
        # 12 workers: enough to out-generate the learner (with 3 the workers bound the gain)
        common = ("run.max_steps=6", f"clock.profile={p}", "rollout.workers=12")
        sync = _run(tmp_path, f"sync-{p}", "rollout.mode=sync", *common)
        stream = _run(
            tmp_path, f"st-{p}", "rollout.mode=streaming", "rollout.max_staleness=2", *common
        )
        ratio[p] = sync.clock.now / stream.clock.now
        limit = sync.costs.profile["limit"]
        assert ratio[p] <= limit * 1.05, (p, ratio[p], limit)  # nothing beats the bound
    assert ratio["gen80"] > ratio["gen45"] > 1.0


@pytest.mark.parametrize("name", ["gen45", "gen70", "gen80", "gen80_tail"])
def test_calibration_puts_generation_at_the_profiles_share(name):
    task = make_task("sort", max_len=16)
    cal = calibrate(name, task, seed=3, batch_groups=16, group_size=8, workers=64, gen_token_s=4e-4)
    share = cal.makespan_s / cal.sync_step_s()
    assert share == pytest.approx(PROFILES[name].gen_fraction, abs=1e-9)
    # with ample workers the bound is Amdahl's 1 / (1 − f)
    assert cal.limit(workers=64) == pytest.approx(1 / (1 - cal.gen_fraction), rel=1e-6)
    # distillation: the teacher's scoring counts in the step, at half the learner's cost
    d = calibrate(
        name,
        task,
        seed=3,
        batch_groups=16,
        group_size=8,
        workers=64,
        gen_token_s=4e-4,
        distill=True,
        teachers=2,
    )
    assert d.teacher_token_s == pytest.approx(0.5 * d.learn_token_s)
    assert d.makespan_s / d.sync_step_s(2) == pytest.approx(d.gen_fraction, abs=1e-9)


def test_the_long_tail_has_p99_at_least_8x_its_median_and_is_deterministic():
    x = np.array([tail_factor(0.9, 0, g, 0) for g in range(20_000)])
    assert np.percentile(x, 99) / np.median(x) >= 8.0
    assert 0.9 < np.median(x) < 1.1
    assert tail_factor(0.9, 0, 5, 0) == tail_factor(0.9, 0, 5, 0)
    assert tail_factor(0.9, 0, 5, 1) != tail_factor(0.9, 0, 5, 0)  # a redo is a new draw
    assert tail_factor(0.0, 0, 5, 0) == 1.0


def test_makespan_is_list_scheduling_in_order():
    assert makespan([3.0, 1.0, 1.0, 1.0], 2) == 3.0
    assert makespan([1.0, 1.0, 1.0], 1) == 3.0
    assert makespan([2.0, 2.0, 2.0], 8) == 2.0


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["clock.profile=gen99"], "clock.profile.*gen80_tail"),
        (["clock.profile=gen45", "clock.learn_token_s=0.1"], "give one or the other"),
        (["clock.profile=gen80", "clock.teacher_token_s=0.1"], "give one or the other"),
        (
            ["clock.profile=gen45", "rollout.backend=ray", "rollout.clock=wall"],
            "needs rollout.clock=virtual",
        ),
    ],
)
def test_a_bad_profile_is_a_clear_config_error(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_rl_config(None, overrides)


def test_the_local_profile_keeps_the_costs_and_states_their_share_and_limit(tmp_path):
    run = _run(tmp_path, "local", "rollout.mode=sync", "clock.learn_token_s=0.002")

    assert run.costs.learn_token_s == 0.002
    info = run.costs.profile
    assert 0.0 < info["gen_fraction"] < 1.0
    assert info["limit"] >= 1.0
    share = info["reference_makespan_s"] / info["reference_sync_step_s"]
    assert share == pytest.approx(info["gen_fraction"])
