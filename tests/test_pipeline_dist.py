"""The real two-process pipeline (gloo) against the single-process emulator: the same
losses and weights for GPipe, 1F1B-flush and PipeDream-2BW; a failing stage is named."""

import pytest
import torch

from trainers.pipeline.dist import PipeJob, StageFailed, run_pipeline, synthetic_batches
from trainers.pipeline.emulate import Emulator
from trainers.pipeline.model import GPTConfig, build_stages

CFG = GPTConfig(vocab_size=20, d_model=32, n_layers=4, n_heads=2, context=16)


def _emulated(job: PipeJob):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stages = build_stages(job.cfg, job.stages, job.seed)
        emu = Emulator(
            stages,
            lambda s: torch.optim.AdamW(s.parameters(), lr=job.lr),
            job.schedule,
            job.micro,
            job.delay,
        )
        losses = [emu.step(x, y) for x, y in synthetic_batches(job)]
        return losses, [s.state_dict() for s in stages]
    finally:
        torch.set_num_threads(before)


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "2bw"])
def test_two_processes_compute_what_the_emulator_computes(schedule, tmp_path):
    job = PipeJob(CFG, stages=2, schedule=schedule, micro=4, steps=4, batch=8, lr=3e-3)
    got = run_pipeline(job, tmp_path)
    losses, weights = _emulated(job)
    assert got["losses"] == pytest.approx(losses, rel=1e-6, abs=1e-6)
    for mine, ref in zip(got["weights"], weights):
        for k in ref:
            assert torch.allclose(mine[k], ref[k], atol=1e-6), (schedule, k)
    assert got["losses"][-1] < got["losses"][0] + 0.5  # it ran and stayed finite


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
    with pytest.raises(StageFailed, match="pipeline stage [01]"):
        run_pipeline(bad, tmp_path)
