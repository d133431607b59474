"""Muon on CUDA: ``optim.muon_dtype=auto`` orthogonalises in bfloat16 there, as
``torch.optim.Muon`` does, and a stage trains with it. Skipped without a GPU; imports only
torch and the pipeline's model and optimiser (runs with ``--noconftest`` on a bare GPU
machine)."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from trainers.pipeline.model import GPTConfig, build_stages
from trainers.pipeline.optim import Muon, StageOptimizer, newton_schulz

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


def _steps(make: object) -> list[torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    params = [
        nn.Parameter(torch.randn(*s, device="cuda", generator=gen))
        for s in ((256, 768), (1024, 256))
    ]
    before = [p.detach().clone() for p in params]
    opt = make(params)  # type: ignore[operator]
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, device="cuda", generator=gen)
        opt.step()
    return [p.detach() - b for p, b in zip(params, before)]


def test_auto_is_bfloat16_on_cuda():
    first, _ = build_stages(GPTConfig(20, d_model=64, n_layers=2, n_heads=2, context=16), 2, 0)
    opt = StageOptimizer(first.cuda(), "muon", lr=1e-3)
    assert opt.muon_dtype == torch.bfloat16
    assert StageOptimizer(first, "muon", lr=1e-3, muon_dtype="float32").muon_dtype == torch.float32


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch has no torch.optim.Muon")
def test_bfloat16_muon_on_cuda_is_torch_muons_and_float32_follows_it():
    kw = dict(lr=1e-2, momentum=0.95, weight_decay=0.01)
    ref = _steps(lambda ps: torch.optim.Muon(ps, adjust_lr_fn="match_rms_adamw", **kw))
    bf = _steps(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))
    f32 = _steps(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    for r, b, f in zip(ref, bf, f32):
        assert torch.allclose(r, b, rtol=0, atol=1e-6), float((r - b).abs().max())
        assert _cos(r, f) > 0.99


def test_a_stage_trains_with_muon_on_cuda():
    torch.manual_seed(0)
    cfg = GPTConfig(32, d_model=128, n_layers=2, n_heads=4, context=32)
    (model,) = build_stages(cfg, 1, 0)
    model = model.cuda()
    opt = StageOptimizer(model, "muon", lr=3e-3)
    x = torch.randint(0, 32, (16, 33), device="cuda")
    losses = []
    for _ in range(60):
        logits = model(x[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 32), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0] - 1.0, (losses[0], losses[-1])


def test_newton_schulz_speed_on_cuda_is_printed(capsys):
    g = torch.randn(4096, 1024, device="cuda")
    took = {}
    for dtype in (torch.float32, torch.bfloat16):
        for _ in range(3):
            newton_schulz(g, dtype)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            newton_schulz(g, dtype)
        torch.cuda.synchronize()
        took[dtype] = (time.perf_counter() - t0) / 20
    with capsys.disabled():
        print(
            f"\nCUDA Newton-Schulz 4096x1024, 5 steps: float32 {took[torch.float32] * 1e3:.3f} ms,"
            f" bfloat16 {took[torch.bfloat16] * 1e3:.3f} ms"
        )
