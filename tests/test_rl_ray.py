"""The RL engine on Ray actors: the same groups as the one-process backend on the virtual
clock, a worker that really dies mid-trajectory, the wall clock, distillation on teacher actors
(one of which really dies), Ray unavailable, and no Ray process left behind by any test."""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from fedasync.events import read_events
from fedasync.processes import alive
from trainers.rl.backend import Job, build_policy, build_task
from trainers.rl.config import RLConfig, load_rl_config
from trainers.rl.engine import RLRun
from trainers.rl.local_backend import LocalBackend

TINY = [
    "policy.d_model=32",
    "policy.n_layers=1",
    "policy.n_heads=2",
    "policy.warm_start_steps=20",
    "rollout.workers=2",
    "rollout.group_size=4",
    "rollout.batch_groups=2",
    "run.max_steps=3",
    "run.eval_every=3",
    "run.eval_prompts=8",
    "run.progress=false",
    "run.plots=false",
    "clock.gen_token_s=0.001",
    "clock.learn_token_s=0.0005",
    "task.max_len=6",
]


def _cfg(tmp_path: Path, name: str, *extra: str) -> RLConfig:
    return load_rl_config(None, [*TINY, f"run.out_dir={tmp_path}", f"run.name={name}", *extra])


@pytest.fixture
def ray_backend() -> Iterator:
    """Makes RayBackends; afterwards every process of the Ray they started is gone."""
    from trainers.rl.ray_backend import RayBackend

    made: list[tuple[RayBackend, set[int]]] = []

    def make(cfg: RLConfig) -> RayBackend:
        b = RayBackend(cfg, build_task(cfg), torch.device("cpu"))
        assert b.started_ray, "a test must start (and stop) its own Ray"
        pids = set(b.session_pids()) | set(b.worker_pids())
        assert len(pids) > cfg.rollout.workers  # the actors, a raylet, a GCS, ...
        made.append((b, pids))
        return b

    yield make
    for b, pids in made:
        b.close()  # the run closed it already: a no-op then
        pids |= {p for seen in b.pids_seen for p in seen}
        deadline = time.monotonic() + 5.0
        while (left := sorted(p for p in pids if alive(p))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert left == [], f"Ray processes left alive: {left}"
        assert b.session is not None and not Path(b.session).exists()


def _events(run_dir: Path, kind: str) -> list[dict]:
    return [e for e in read_events(run_dir / "metrics.jsonl") if e["event"] == kind]


@pytest.mark.slow
def test_ray_backend_gives_the_local_backends_groups(tmp_path, ray_backend):
    # Prepare
    cfg = _cfg(tmp_path, "ray", "rollout.backend=ray")
    backend = ray_backend(cfg)
    task, cpu = build_task(cfg), torch.device("cpu")
    local = LocalBackend(cfg, task, cpu)
    weights = {k: v.clone() for k, v in build_policy(cfg).state_dict().items()}
    jobs: dict[str, list[Job]] = {}

    # Execute: the same jobs on both backends, then a whole run on each
    for b in (local, backend):
        b.publish(3, weights)
        jobs[b.kind] = [Job(g, g, g % 2, 3, 0, 0.0) for g in range(2)]
        for j in jobs[b.kind]:
            b.submit(j, die=False, nan=False)
        assert len(b.collect(jobs[b.kind], wait_all=True, timeout=math.inf)) == 2
    s_ray = RLRun(cfg, tmp_path / "ray", backend).run()
    s_local = RLRun(_cfg(tmp_path, "local"), tmp_path / "local").run()

    # Assert: tokens and rewards equal, log-probs to rounding (one thread in the actors)
    for a, b in zip(jobs["local"], jobs["ray"], strict=True):
        assert a.error is None and b.error is None and a.group and b.group
        assert (b.group.group_id, b.group.version, b.group.worker) == (
            a.group.group_id,
            3,
            a.worker,
        )
        for ta, tb in zip(a.group.trajectories, b.group.trajectories, strict=True):
            assert (tb.tokens, tb.reward, tb.versions) == (ta.tokens, ta.reward, ta.versions)
            assert tb.logprobs == pytest.approx(ta.logprobs, abs=1e-5)
    keys = ("group", "worker", "behaviour", "tokens", "outcome", "start", "t")
    rollouts = {
        name: [{k: e[k] for k in keys} for e in _events(tmp_path / name, "rollout")]
        for name in ("local", "ray")
    }
    assert rollouts["ray"] == rollouts["local"] and len(rollouts["ray"]) >= 6
    steps = {name: _events(tmp_path / name, "step") for name in ("local", "ray")}
    assert len(steps["ray"]) == len(steps["local"]) == 3
    for a, b in zip(steps["local"], steps["ray"], strict=True):
        assert (b["groups"], b["tokens"], b["reward"]) == (a["groups"], a["tokens"], a["reward"])
    assert s_ray["backend"] == "ray" and s_local["backend"] == "local"
    assert s_ray["time_s"] == s_local["time_s"]
    assert s_ray["final_accuracy"] == s_local["final_accuracy"]
    wa = torch.load(tmp_path / "local" / "policy.pt")
    wb = torch.load(tmp_path / "ray" / "policy.pt")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-4) for k in wa)


@pytest.mark.slow
def test_a_ray_worker_that_dies_mid_trajectory_is_restarted_and_its_group_redone(
    tmp_path, ray_backend, caplog
):
    # Prepare
    cfg = _cfg(tmp_path, "die", "rollout.backend=ray", "faults.die_on_groups=[1]")
    backend = ray_backend(cfg)
    first_pids = backend.worker_pids()

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedasync.rl"):
        summary = RLRun(cfg, tmp_path / "die", backend).run()

    # Assert: group 1 (worker 1's first job) died in a real process, was redone on a new one
    assert summary["versions"] == 3 and summary["redone_groups"] == 1
    assert summary["dropped"] == {}
    assert backend.restarts == [0, 1]
    assert first_pids[1] in backend.pids_seen[1] and len(backend.pids_seen[1]) == 2
    assert backend.pids_seen[0] == {first_pids[0]}
    assert not alive(first_pids[1])
    assert any("worker 1 died generating group 1" in r.getMessage() for r in caplog.records)
    rollouts = _events(tmp_path / "die", "rollout")
    died = [e for e in rollouts if e["outcome"] == "died"]
    assert [(e["group"], e["worker"]) for e in died] == [(1, 1)]
    assert [e["group"] for e in rollouts if e["outcome"] == "done"].count(1) == 1


@pytest.mark.slow
def test_streaming_on_the_wall_clock_with_ray_runs_to_the_end(tmp_path, ray_backend):
    # Prepare
    cfg = _cfg(
        tmp_path, "wall", "rollout.backend=ray", "rollout.clock=wall", "rollout.mode=streaming"
    )
    backend = ray_backend(cfg)

    # Execute
    summary = RLRun(cfg, tmp_path / "wall", backend).run()

    # Assert: structure only, never timings
    assert (summary["clock"], summary["backend"], summary["versions"]) == ("wall", "ray", 3)
    steps = _events(tmp_path / "wall", "step")
    assert [e["version"] for e in steps] == [1, 2, 3]
    assert all(len(e["groups"]) == 2 for e in steps)
    S = cfg.rollout.max_staleness
    for e in _events(tmp_path / "wall", "rollout"):
        assert e["worker"] in (0, 1)
        if e["outcome"] == "done":
            assert e["version"] - e["behaviour"] <= S  # staler ones are aborted in flight
    assert summary["final_accuracy"] is not None
    assert (tmp_path / "wall" / "summary.json").is_file()


@pytest.mark.slow
def test_distillation_on_ray_teachers_restarts_a_dead_teacher_and_learns_the_local_policy(
    tmp_path, ray_backend
):
    # Prepare: two teacher actors; the one scoring group 3 dies before returning it
    distill = [
        "distill.loss=forward_kl",
        "distill.teachers=2",
        "distill.teacher_steps=20",
        "distill.teacher_d_model=32",
        "distill.teacher_n_layers=1",
        f"distill.cache_dir={tmp_path / 'teachers'}",
        "clock.teacher_token_s=0.0002",
        "faults.teacher_die_on_groups=[3]",
        "run.max_steps=4",
    ]
    cfg = _cfg(tmp_path, "ray", "rollout.backend=ray", *distill)
    backend = ray_backend(cfg)
    run = RLRun(cfg, tmp_path / "ray", backend)

    # Execute: the run on Ray, then the same run in one process; this process runs torch on
    # one thread as the actors do (with 2 threads the policies differ by ~7e-6, rounding)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        s_ray = run.run()
        s_local = RLRun(_cfg(tmp_path, "local", *distill), tmp_path / "local").run()
    finally:
        torch.set_num_threads(threads)

    # Assert: the death counted, group 3 re-sent, the same policy as the one-process teacher
    from trainers.rl.ray_teacher import RayTeacherPool

    pool = run.scoring.backend
    assert isinstance(pool, RayTeacherPool) and len(pool.pids_seen) >= 2
    assert (s_ray["backend"], s_local["backend"]) == ("ray", "local")
    assert s_ray["versions"] == s_local["versions"] == 4
    assert s_ray["distill"]["teacher_restarts"] == 1
    assert s_ray["distill"]["teacher_resent"] >= 1
    assert (s_local["distill"]["teacher_restarts"], s_local["distill"]["teacher_resent"]) == (1, 1)
    scores = _events(tmp_path / "ray", "score")
    assert any(e["group"] == 3 and e["attempts"] >= 2 for e in scores), scores
    steps = {name: _events(tmp_path / name, "step") for name in ("local", "ray")}
    assert [e["groups"] for e in steps["ray"]] == [e["groups"] for e in steps["local"]]
    wa = torch.load(tmp_path / "local" / "policy.pt")
    wb = torch.load(tmp_path / "ray" / "policy.pt")
    assert all(torch.allclose(wa[k], wb[k], atol=1e-5) for k in wa)
    # the run stopped its Ray: no teacher actor, no process of the session left
    from fedasync.processes import RAY_SESSION_ENV, pids_with_env

    deadline = time.monotonic() + 5.0
    while (left := sorted(p for p in pool.pids_seen if alive(p))) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert left == [], f"teacher actors left alive: {left}"
    assert backend.session is not None
    assert [p for p in pids_with_env(RAY_SESSION_ENV, backend.session) if alive(p)] == []


def test_without_ray_the_cli_runs_the_one_process_mode_and_says_why(monkeypatch, caplog):
    # Prepare
    import trainers.rl.ray_backend as rb
    from trainers.rl.cli import with_backend

    monkeypatch.setattr(rb, "ray_available", lambda: "cannot import ray: no module for tests")
    cfg = load_rl_config(None, ["rollout.backend=ray", "rollout.clock=wall"])

    # Execute
    with caplog.at_level(logging.WARNING, logger="fedasync.rl"):
        used, backend = with_backend(cfg)

    # Assert
    assert backend is None
    assert (used.rollout.backend, used.rollout.clock) == ("local", "virtual")
    assert (cfg.rollout.backend, cfg.rollout.clock) == ("ray", "wall")  # cfg itself unchanged
    messages = [r.getMessage() for r in caplog.records]
    assert any("Ray is not available" in m and "no module for tests" in m for m in messages), (
        messages
    )


def test_ray_available_says_none_when_ray_imports():
    from trainers.rl.ray_backend import ray_available

    assert ray_available() is None
