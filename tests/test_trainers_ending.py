"""How `fedasync rl`, `fedasync pipeline` and `fedasync market` end on a signal.

The fast tests check the shared piece (fedasync/interrupt.py: the deferred stop, its grace,
the stop line, the resume command, children that start deaf to Ctrl-C) and each trainer's
stop in this process: the RL run saves where it stops and a resume ends as the uninterrupted
run; an exception of the backend once a stop was asked for is part of the stop; a market seed's
result is saved and loaded by ``run.resume``. The slow tests start each real command in a
session of its own (every process marked by a variable of the test), send SIGINT to the whole
process group once training has started, as a terminal sends Ctrl-C, and check: exit 130
within 30 s, one stop line, no traceback, the checkpoint, no process left, and that the
command the line gives resumes the run.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from commands import Command

from fedasync.events import read_events
from fedasync.interrupt import (
    DeferredStop,
    Interrupted,
    children_start_deaf,
    interruptible,
    resume_command,
    resume_or_afresh,
    signal_of,
    stop_line,
)

REPO = Path(__file__).resolve().parents[1]
STOP_WITHIN_S = 30.0


def _signal_self(sig: int = signal.SIGINT) -> None:
    """Send ``sig`` to this process and let its Python handler run."""
    os.kill(os.getpid(), sig)
    for _ in range(100):  # the handler runs at the next bytecode boundary of the main thread
        time.sleep(0.001)


# ---------------------------------------------------------------- fedasync/interrupt.py


def test_the_first_signal_is_only_recorded_and_check_raises_at_the_safe_point():
    before = signal.getsignal(signal.SIGINT)
    with DeferredStop(grace_s=5.0) as stop:
        _signal_self()  # nothing raised here
        assert stop.requested == signal.SIGINT
        with pytest.raises(Interrupted) as e:
            stop.check()
    assert e.value.at_safe_point and e.value.exit_code == 130 and e.value.name == "SIGINT"
    assert signal.getsignal(signal.SIGINT) is before, "the handlers are put back"
    assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0), "the grace alarm is disarmed"


def test_a_second_signal_raises_at_once():
    with DeferredStop(grace_s=5.0) as stop, pytest.raises(Interrupted) as e:
        _signal_self(signal.SIGTERM)
        assert stop.requested == signal.SIGTERM
        _signal_self(signal.SIGINT)
        pytest.fail("the second signal did not raise")
    assert not e.value.at_safe_point
    assert e.value.exit_code == 143, "the stop is the first signal's"


def test_the_grace_running_out_raises_where_the_loop_is():
    started = time.monotonic()
    with DeferredStop(grace_s=0.2), pytest.raises(Interrupted) as e:
        _signal_self()
        while time.monotonic() - started < 5.0:  # a loop that never reaches its safe point
            time.sleep(0.01)
        pytest.fail("the grace did not run out")
    assert not e.value.at_safe_point and time.monotonic() - started < 2.0


def test_the_resume_command_is_the_same_command_with_run_resume_true():
    cmd = resume_command("rl", "my config.yaml", ["run.name=a b", "run.resume=false", "x.y=1"])
    assert shlex.split(cmd) == [
        "fedasync", "rl", "--config", "my config.yaml", "run.name=a b", "x.y=1", "run.resume=true",
    ]  # fmt: skip
    assert resume_command("pipeline", None, []) == "fedasync pipeline run.resume=true"


def test_the_stop_line_says_what_stopped_it_where_and_how_to_resume():
    e = Interrupted(signal.SIGTERM)
    line = stop_line("rl", e, "at version 7", resume_or_afresh("rl", None, [], Path("c.pt")))
    assert line == (
        "fedasync rl: stopped by SIGTERM at version 7; checkpoint c.pt; resume with: "
        "fedasync rl run.resume=true"
    )
    # without a checkpoint it offers no resume that would fail
    assert resume_or_afresh("rl", None, [], None) == (
        "no checkpoint yet: run it again to start afresh"
    )
    assert signal_of(KeyboardInterrupt()) == ("SIGINT", 130)  # Ctrl-C before any handler
    assert Interrupted(signal.SIGHUP).exit_code == 129


def test_a_child_started_deaf_survives_ctrl_c_and_the_parent_gets_its_own_after(tmp_path):
    # the child would die of SIGINT with a KeyboardInterrupt traceback while it starts up
    code = "import time; time.sleep(1.0); print('alive')"
    with pytest.raises(Interrupted), interruptible():
        with children_start_deaf():
            child = subprocess.Popen(
                [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE
            )
            child.send_signal(signal.SIGINT)
            _signal_self()  # held: nothing raised within the block
        pytest.fail("the held SIGINT did not arrive when the block ended")
    out, err = child.communicate(timeout=30)
    assert child.returncode == 0 and out.strip() == b"alive" and not err


# ---------------------------------------------------------------- rl, in this process

RL_TINY = [
    "policy.d_model=32",
    "policy.n_layers=1",
    "policy.n_heads=2",
    "policy.warm_start_steps=60",
    "rollout.workers=3",
    "rollout.group_size=4",
    "rollout.batch_groups=3",
    "run.max_steps=6",
    "run.eval_every=2",
    "run.eval_prompts=8",
    "run.progress=false",
    "run.plots=false",
    "clock.gen_token_s=0.01",
    "clock.learn_token_s=0.002",
    "task.max_len=6",
    "rollout.mode=streaming",
    "rollout.max_staleness=1",
]


def _rl(tmp_path: Path, name: str, *extra: str):
    from trainers.rl.config import load_rl_config
    from trainers.rl.engine import RLRun

    cfg = load_rl_config(None, [*RL_TINY, f"run.out_dir={tmp_path}", f"run.name={name}", *extra])
    return RLRun(cfg, tmp_path / name)


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_an_rl_run_stopped_by_a_signal_saves_there_and_resumes_to_the_same_weights(
    tmp_path, monkeypatch
):
    from trainers.rl.engine import RLRun

    whole = _rl(tmp_path, "whole")
    whole.run()
    finish = RLRun._finish_step

    def signal_at_version_3(self: RLRun) -> None:
        finish(self)
        if self.version == 3:
            _signal_self()

    monkeypatch.setattr(RLRun, "_finish_step", signal_at_version_3)
    stopped = _rl(tmp_path, "stopped")
    with pytest.raises(Interrupted) as e:
        stopped.run()
    monkeypatch.undo()

    assert e.value.at_safe_point and e.value.checkpoint == tmp_path / "stopped" / "checkpoint.pt"
    assert e.value.where.startswith("at version 3 (t=")
    assert not (tmp_path / "stopped" / "summary.json").exists()
    resumed = _rl(tmp_path, "stopped", "run.resume=true")
    summary = resumed.run()
    assert summary["versions"] == 6
    assert _same_weights(whole.policy.state_dict(), resumed.policy.state_dict())
    events = read_events(tmp_path / "stopped" / "metrics.jsonl")
    assert [x["version"] for x in events if x["event"] == "resume"] == [3]
    assert [x["version"] for x in events if x["event"] == "step"] == [1, 2, 3, 4, 5, 6]


def test_an_exception_of_the_backend_once_a_stop_was_asked_for_is_part_of_the_stop(tmp_path):
    from trainers.rl.local_backend import LocalBackend

    class DyingWithTheSignal(LocalBackend):
        """A worker the signal reached: the submit after it fails."""

        def submit(self, job, die, nan):
            if job.group_id == 7:
                _signal_self()
                raise RuntimeError("the actor died")
            super().submit(job, die, nan)

    run = _rl(tmp_path, "r")
    run.backend = DyingWithTheSignal(run.cfg, run.task, run.device)
    with pytest.raises(Interrupted) as e:
        run.run()
    assert not e.value.at_safe_point, "not at a safe point: nothing saved"
    assert e.value.checkpoint is None and e.value.exit_code == 130
    assert not (tmp_path / "r" / "checkpoint.pt").exists()


def test_a_signal_while_a_finished_run_writes_its_outputs_leaves_a_checkpoint_to_finish(
    tmp_path, monkeypatch
):
    from trainers.rl.engine import RLRun

    outputs = RLRun._outputs

    def signal_first(self: RLRun):
        _signal_self()  # held until the outputs are written
        return outputs(self)

    monkeypatch.setattr(RLRun, "_outputs", signal_first)
    with pytest.raises(Interrupted) as e:
        _rl(tmp_path, "r").run()
    monkeypatch.undo()
    assert e.value.where == "after training (6 versions), writing its outputs"
    assert e.value.checkpoint == tmp_path / "r" / "checkpoint.pt"
    summary = _rl(tmp_path, "r", "run.resume=true").run()  # writes them again, trains no more
    assert summary["versions"] == 6
    steps = [x for x in read_events(tmp_path / "r" / "metrics.jsonl") if x["event"] == "step"]
    assert len(steps) == 6


# ---------------------------------------------------------------- market, in this process

MARKET_TINY = [
    "run.horizon=40",
    "run.window=10",
    "run.deviation_span=8",
    "run.seeds=2",
    "run.workers=1",
    "run.progress=false",
    "run.plots=false",
    "agent.hidden=8",
    "agent.warmup=8",
    "agent.batch_size=8",
]


def _market(*more: str):
    from trainers.market.config import load_market_config

    return load_market_config(None, [*MARKET_TINY, *more])


def test_a_finished_seed_is_saved_and_loaded_only_for_the_same_config(tmp_path):
    from trainers.market.results import RESULT, load_result
    from trainers.market.seed import run_seed

    cfg = _market()
    result = run_seed(cfg, 3, tmp_path / "seed-3")
    assert (tmp_path / "seed-3" / RESULT).is_file()
    loaded = load_result(tmp_path / "seed-3", cfg, 3)
    assert loaded == json.loads(json.dumps(result))
    # settings that do not change a seed's result may differ; others may not
    assert load_result(tmp_path / "seed-3", _market("run.workers=2", "run.seeds=5"), 3)
    assert load_result(tmp_path / "seed-3", _market("agent.hidden=9"), 3) is None
    assert load_result(tmp_path / "seed-3", cfg, 4) is None
    (tmp_path / "seed-3" / RESULT).write_text('{"result": {"se')  # torn
    assert load_result(tmp_path / "seed-3", cfg, 3) is None


def test_a_market_stopped_in_a_seed_resumes_with_the_seeds_it_finished_and_the_one_it_saved(
    tmp_path, monkeypatch
):
    import trainers.market.run as market_run

    whole = market_run.run_settings([_market()], tmp_path / "whole")
    run_seed = market_run.run_seed

    def signal_at_seed_1(cfg, seed, run_dir=None, **kw):
        if seed == 1:
            _signal_self()  # the seed stops at its first event, with a checkpoint
        return run_seed(cfg, seed, run_dir, **kw)

    monkeypatch.setattr(market_run, "run_seed", signal_at_seed_1)
    with pytest.raises(Interrupted) as e, interruptible():
        market_run.run_settings([_market()], tmp_path / "r")
    assert e.value.where == "with 1 of 2 seed runs done and 1 checkpointed mid-run (seed 1)"
    assert (
        e.value.at_safe_point
        and (tmp_path / "r" / "async-r1-d0" / "seed-1" / "checkpoint.pt").is_file()
    )

    ran = []

    def counted(cfg, seed, run_dir=None, **kw):
        ran.append(seed)
        return run_seed(cfg, seed, run_dir, **kw)

    monkeypatch.setattr(market_run, "run_seed", counted)
    resumed = market_run.run_settings([_market("run.resume=true")], tmp_path / "r")
    assert ran == [1], "seed 0 is loaded, seed 1 continues from its checkpoint"
    (label,) = whole
    assert resumed[label]["deltas"] == whole[label]["deltas"]
    # without run.resume every seed runs again
    ran.clear()
    market_run.run_settings([_market()], tmp_path / "r")
    assert ran == [0, 1]


# ---------------------------------------------------------------- the real commands


def _events(path: Path) -> list[dict]:
    try:
        return read_events(path, skip_bad=True)
    except OSError:
        return []


def _stop_line(cmd: Command, name: str, sig: str = "SIGINT") -> str:
    err, out = cmd.stderr(), cmd.stdout()
    for text in (err, out):
        assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
        assert "Fatal Python error" not in text, text
    lines = [ln for ln in err.splitlines() if "stopped by" in ln]
    assert len(lines) == 1, f"one stop line on stderr:\n{err}"
    assert lines[0].startswith(f"fedasync {name}: stopped by {sig}"), lines[0]
    return lines[0]


def _resume(tmp: Path, line: str, timeout_s: float = 120.0) -> Command:
    """Run the command the stop line gives; it must finish (exit 0) and leave nothing."""
    argv = shlex.split(line.split("resume with: fedasync ", 1)[1])
    assert argv[-1] == "run.resume=true"
    resumed = Command(tmp, argv)
    try:
        assert resumed.wait(timeout_s) == 0, resumed.stderr()[-4000:]
        assert not resumed.gone()
    finally:
        resumed.kill()
    return resumed


@pytest.mark.slow
def test_fedasync_rl_stops_on_ctrl_c_with_a_checkpoint_and_resumes(tmp_path):
    run_dir = tmp_path / "r"
    args = ["rl", *RL_TINY, "run.max_steps=30", f"run.out_dir={tmp_path}", "run.name=r"]
    cmd = Command(tmp_path, args)
    try:
        metrics = run_dir / "metrics.jsonl"
        cmd.wait_for(lambda: any(e["event"] == "step" for e in _events(metrics)), "a step")
        assert cmd.interrupt(timeout_s=STOP_WITHIN_S) == 130, cmd.stderr()
        line = _stop_line(cmd, "rl")
        ckpt = run_dir / "checkpoint.pt"
        assert f"checkpoint {ckpt}; resume with: fedasync rl " in line
        saved = [e for e in _events(metrics) if e["event"] == "checkpoint"]
        assert saved and f"at version {saved[-1]['version']} " in line
        assert not cmd.gone(), "no process of the run is left"
    finally:
        cmd.kill()
    _resume(tmp_path, line)
    events = _events(metrics)
    assert [e["version"] for e in events if e["event"] == "resume"] == [saved[-1]["version"]]
    assert [e["version"] for e in events if e["event"] == "step"] == list(range(1, 31))
    assert json.loads((run_dir / "summary.json").read_text())["versions"] == 30


PIPELINE_TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.context=32",
    "data.batch=8",
    "pipeline.micro=2",
    "run.eval_batches=2",
    "run.progress=false",
    "run.plots=false",
    "run.steps=200",
    "run.eval_every=100",
    "run.checkpoint_every=0",
]


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_fedasync_pipeline_stops_its_stages_with_a_common_checkpoint(tmp_path, sig, code):
    # run.checkpoint_every=0: the only checkpoint is the one the stop asks for
    run_dir = tmp_path / "r"
    args = ["pipeline", *PIPELINE_TINY, f"run.out_dir={tmp_path}", "run.name=r"]
    cmd = Command(tmp_path, args)
    try:
        metrics = run_dir / "metrics.jsonl"
        cmd.wait_for(lambda: any(e["event"] == "step" for e in _events(metrics)), "a step")
        assert len(cmd.seen) >= 3, "the command and its two stages were seen"
        assert cmd.interrupt(sig, timeout_s=STOP_WITHIN_S) == code, cmd.stderr()
        line = _stop_line(cmd, "pipeline", sig.name)
        assert not cmd.gone(), "no stage process is left"
    finally:
        cmd.kill()
    from trainers.pipeline.dist import latest_checkpoint

    step = latest_checkpoint(run_dir, 2)
    assert step is not None and 0 < step < 200, "the stop's checkpoint"
    assert f"checkpoint of step {step} in {run_dir / 'checkpoints'}; resume with: " in line
    if sig != signal.SIGINT:
        return
    _resume(tmp_path, line)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["start"] == step and summary["steps"] == 200
    assert {"event": "resume", "step": step} in _events(metrics)


@pytest.mark.slow
def test_fedasync_pipeline_stopped_before_a_checkpoint_says_it_starts_afresh(tmp_path):
    # metrics.jsonl is opened just before the stage processes start (seconds: spawn, torch)
    args = ["pipeline", *PIPELINE_TINY, f"run.out_dir={tmp_path}", "run.name=r"]
    cmd = Command(tmp_path, args)
    try:
        cmd.wait_for((tmp_path / "r" / "metrics.jsonl").exists, "the metrics file")
        assert cmd.interrupt(timeout_s=STOP_WITHIN_S) == 130, cmd.stderr()
        line = _stop_line(cmd, "pipeline")
        assert not cmd.gone(), "no stage process is left"
    finally:
        cmd.kill()
    assert line.endswith("; no checkpoint yet: run it again to start afresh"), line
    assert "stopped by SIGINT as the stages started (no step yet)" in line


MARKET_CLI = [
    "market",
    "run.horizon=200",
    "run.window=50",
    "run.deviation_span=10",
    "run.seeds=4",
    "run.workers=2",
    "run.progress=false",
    "run.plots=false",
    "agent.hidden=16",
]


@pytest.mark.slow
def test_fedasync_market_stops_its_pool_and_resumes_with_the_finished_seeds(tmp_path):
    run_dir = tmp_path / "r"
    cmd = Command(tmp_path, [*MARKET_CLI, f"run.out_dir={tmp_path}", "run.name=r"])
    try:
        cmd.wait_for(lambda: any(run_dir.glob("*/seed-*/result.json")), "a finished seed")
        assert len(cmd.seen) >= 3, "the command and its two workers were seen"
        assert cmd.interrupt(timeout_s=STOP_WITHIN_S) == 130, cmd.stderr()
        line = _stop_line(cmd, "market")
        assert not cmd.gone(), "no pool worker is left"
    finally:
        cmd.kill()
    done = sorted(p.parent.name for p in run_dir.glob("*/seed-*/result.json"))
    assert "of 4 seed runs done" in line
    assert (
        f"; finished seeds and checkpoints of unfinished ones in {run_dir}; resume with: " in line
    )
    saved = sorted(p.parent.name for p in run_dir.glob("*/seed-*/checkpoint.pt"))
    assert len(done) + len(saved) <= 4 and not set(done) & set(saved)
    if saved:  # the seeds running when the signal came stopped at an event, with a checkpoint
        assert "checkpointed mid-run" in line
    assert 1 <= len(done) < 4 and not (run_dir / "summary.json").exists()
    before = {d: (run_dir / "async-r1-d0" / d / "result.json").read_bytes() for d in done}
    resumed = _resume(tmp_path, line)
    assert "Delta" in resumed.stdout()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["settings"]["async-r1-d0"]["seeds"] == [0, 1, 2, 3]
    for d, data in before.items():  # loaded, not run again
        assert (run_dir / "async-r1-d0" / d / "result.json").read_bytes() == data
