"""The real two-process pipeline (gloo) against the single-process emulator: the same
losses and weights, bit for bit, for GPipe, 1F1B-flush, PipeDream-2BW and PACI; the
synchronous schedules against torch.distributed.pipelining; a failing or killed stage is
named, and a killed run resumes from its checkpoint."""

import pytest
import torch

from trainers.pipeline.dist import (
    BatchSource,
    PipeJob,
    StageFailed,
    latest_checkpoint,
    make_worker,
    run_pipeline,
)
from trainers.pipeline.emulate import emulate
from trainers.pipeline.model import GPTConfig

CFG = GPTConfig(vocab_size=20, d_model=32, n_layers=4, n_heads=2, context=16)


def _emulated(job: PipeJob):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        ws = [make_worker(job, r, torch.device("cpu")) for r in range(job.stages)]
        emulate(ws, BatchSource(job), job.steps)
        ls = ws[-1].losses
        per_micro = [ls[k] for k in sorted(ls)]
        m = job.micro
        losses = [sum(per_micro[i : i + m]) / m for i in range(0, len(per_micro), m)]
        return losses, [w.stage.state_dict() for w in ws], ws
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw", "paci"])
def test_two_processes_compute_what_the_emulator_computes(schedule, tmp_path):
    job = PipeJob(CFG, stages=2, schedule=schedule, micro=2, steps=4, batch=8, lr=3e-3)
    got = run_pipeline(job, tmp_path)
    losses, weights, workers = _emulated(job)
    assert got["losses"] == losses  # bit for bit: one thread, the same operations per stage
    for mine, ref in zip(got["weights"], weights):
        for k in ref:
            assert torch.equal(mine[k], ref[k]), (schedule, k)
    for r, w in zip(got["ranks"], workers):
        assert r["drift"] == {str(k): v for k, v in sorted(w.drift_seen.items())}
        assert r["memory"]["activation_peak_bytes"] > 0
        kinds = {e["kind"] for e in r["events"]}
        assert kinds == {"F", "B", "S"}
    if schedule == "paci":  # stage 0's early micro-batches crossed a step; the last never
        assert got["ranks"][0]["drift"].get("1", 0) > 0
        assert set(got["ranks"][1]["drift"]) == {"0"}


@pytest.mark.slow
@pytest.mark.parametrize("ours, theirs", [("gpipe", "torch-gpipe"), ("1f1b", "torch-1f1b")])
def test_the_synchronous_schedules_match_torch_pipelining(ours, theirs, tmp_path):
    base = dict(cfg=CFG, stages=2, micro=4, steps=3, batch=8, lr=3e-3)
    mine = run_pipeline(PipeJob(schedule=ours, **base), tmp_path / "ours")
    ref = run_pipeline(PipeJob(schedule=theirs, **base), tmp_path / "torch")
    assert mine["losses"] == pytest.approx(ref["losses"], rel=1e-5, abs=1e-6)
    for a, b in zip(mine["weights"], ref["weights"]):
        for k in b:
            assert torch.allclose(a[k], b[k], atol=1e-5), (ours, k)


@pytest.mark.slow
def test_a_failing_stage_is_named(tmp_path):
    bad = PipeJob(CFG, stages=2, schedule="zero-bubble", micro=4, steps=1, batch=8, lr=1e-3)
    with pytest.raises(StageFailed, match="pipeline stage [01] failed"):
        run_pipeline(bad, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_killed_stage_is_named_and_the_run_resumes_to_the_same_weights(schedule, tmp_path):
    base = dict(cfg=CFG, stages=2, schedule=schedule, micro=2, steps=6, batch=8, lr=3e-3)
    whole = run_pipeline(PipeJob(**base), tmp_path / "whole")
    run = tmp_path / "killed"
    job = PipeJob(**base, checkpoint_every=2, kill_stage=1, kill_at_step=5)
    with pytest.raises(
        StageFailed, match="pipeline stage 1 died: its process was killed by signal SIGKILL"
    ):
        run_pipeline(job, run)
    step = latest_checkpoint(run, 2)
    assert step == 4
    resumed = run_pipeline(PipeJob(**base, checkpoint_every=2, start=step), run)
    # flushed schedules and 2BW compute each batch under fixed versions: resuming is exact
    for a, b in zip(resumed["weights"], whole["weights"]):
        for k in b:
            assert torch.equal(a[k], b[k]), k
    assert resumed["losses"] == whole["losses"][step:]
