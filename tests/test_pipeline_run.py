"""``fedasync pipeline`` end to end: the run folder (metrics, summary, PNGs), the measured
drift within PACI's bound, a killed stage named with its exit code, and resuming."""

import json

import pytest
import torch

from simulations.cli import main

TINY = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.context=32",
    "data.batch=8",
    "pipeline.micro=2",
    "run.eval_batches=2",
    "run.progress=false",
]


def _run(tmp_path, *extra):
    return main(["pipeline", f"run.out_dir={tmp_path}", *TINY, *extra])


def _lines(path):
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("schedule", ["1f1b", "paci"])
def test_an_emulated_run_writes_its_folder(tmp_path, schedule, capsys):
    before = torch.get_num_threads()
    try:
        rc = _run(
            tmp_path,
            "pipeline.backend=emulate",
            f"pipeline.schedule={schedule}",
            "run.steps=6",
            "run.eval_every=3",
            "run.checkpoint_every=0",
            "optim.warmup=0",  # six steps: learn from the first
            "optim.lr=0.01",
        )
    finally:
        torch.set_num_threads(before)
    assert rc == 0
    out = capsys.readouterr().out
    assert f"pipeline {schedule} (P=2, m=2" in out
    run = tmp_path / "pipeline"
    events = _lines(run / "metrics.jsonl")
    steps = [e for e in events if e["event"] == "step"]
    evals = [e for e in events if e["event"] == "eval"]
    assert [e["step"] for e in steps] == [1, 2, 3, 4, 5, 6]
    assert [e["step"] for e in evals] == [3, 6]
    assert all(e["time_s"] is not None and e["time_s"] > 0 for e in steps)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_val_loss"] == evals[-1]["val_loss"]
    # it learnt: an untrained model scores log(vocab) ≈ 4.2 nats; six steps reach about 3.4
    assert evals[-1]["val_loss"] < evals[0]["val_loss"]
    assert summary["final_val_loss"] < 3.9
    assert summary["max_drift_seen"] == (1 if schedule == "paci" else 0)
    for m in summary["memory"]:
        assert m["activation_peak_bytes"] > 0 and m["weight_peak_bytes"] > 0
    assert 0.0 <= summary["measured"]["bubble_fraction"] < 1.0
    assert (run / "timeline.png").stat().st_size > 0 and (run / "loss.png").stat().st_size > 0


def test_resuming_without_a_checkpoint_is_a_user_error(tmp_path, capsys):
    rc = _run(tmp_path, "pipeline.backend=emulate", "run.resume=true", "run.steps=4")
    assert rc == 2
    assert "no step that every one of the 2 stages saved" in capsys.readouterr().err


@pytest.mark.slow
def test_a_killed_stage_ends_the_run_named_and_resume_finishes_it(tmp_path, capsys):
    base = ["pipeline.schedule=1f1b", "run.steps=6", "run.eval_every=3", "run.checkpoint_every=2"]
    assert _run(tmp_path, *base, "faults.kill_stage=1", "faults.kill_at_step=5") == 1
    out = capsys.readouterr().out
    assert "pipeline stage 1 died: its process was killed by signal SIGKILL" in out
    assert "run.resume=true" in out
    # another config is refused, naming the key
    assert _run(tmp_path, *base, "run.resume=true", "optim.lr=0.01") == 2
    assert "optim.lr" in capsys.readouterr().err
    assert _run(tmp_path, *base, "run.resume=true") == 0
    run = tmp_path / "pipeline"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["start"] == 4 and summary["steps"] == 6
    events = _lines(run / "metrics.jsonl")
    assert {"event": "resume", "step": 4} in events
    assert [e["step"] for e in events if e["event"] == "eval"] == [3, 6]


@pytest.mark.slow
def test_the_gpu_check_script_dry_runs_on_the_cpu():
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run(
        [
            sys.executable,
            str(root / "benchmarks" / "pipeline_gpu_check.py"),
            "--cpu",
            "--steps",
            "12",
        ],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=root,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "pipeline_gpu_check=ok"
    for arm in ("gpipe", "1f1b", "2bw", "2bw+ef", "paci"):
        assert f"| {arm} |" in out.stdout
