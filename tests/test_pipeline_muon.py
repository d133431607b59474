"""Muon's orthogonalisation in a chosen dtype (``optim.muon_dtype``): float32 on the CPU by
default, bfloat16 (``torch.optim.Muon``'s) on CUDA."""

from __future__ import annotations

import copy
import time

import pytest
import torch
from torch import nn

from fedasync.errors import ConfigError
from trainers.pipeline import config as pc
from trainers.pipeline.config import load_pipeline_config
from trainers.pipeline.model import GPTConfig, build_stages
from trainers.pipeline.optim import (
    MUON_DTYPES,
    Muon,
    StageOptimizer,
    newton_schulz,
    resolve_muon_dtype,
)

CFG = GPTConfig(vocab_size=20, d_model=32, n_layers=2, n_heads=2, context=16)


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten(), b.flatten(), dim=0))


@pytest.mark.parametrize("shape", [(48, 160), (160, 48), (128, 384), (512, 128)])
def test_float32_newton_schulz_is_near_orthogonal(shape):
    # G = U diag(s) V^T with singular values spread 20x (1 to 20), wide and tall
    gen = torch.Generator().manual_seed(0)
    k = min(shape)
    u, _ = torch.linalg.qr(torch.randn(shape[0], k, generator=gen))
    v, _ = torch.linalg.qr(torch.randn(shape[1], k, generator=gen))
    g = u @ torch.diag(torch.logspace(0, 1.3, k)) @ v.T

    o = newton_schulz(g, torch.float32)

    assert o.dtype == torch.float32 and o.shape == g.shape
    s = torch.linalg.svdvals(o)
    # the quintic with these coefficients lands in about [0.68, 1.14], not exactly 1
    assert 0.6 < float(s.min()) and float(s.max()) < 1.3, (float(s.min()), float(s.max()))
    # and keeps G's singular directions: O is close to U V^T
    assert _cosine(o, u @ v.T) > 0.97


def test_newton_schulz_refuses_a_vector():
    with pytest.raises(ValueError, match="2-D"):
        newton_schulz(torch.ones(4))


def test_bfloat16_newton_schulz_is_torch_muons():
    zeropower = pytest.importorskip("torch.optim._muon")._zeropower_via_newtonschulz
    g = torch.randn(96, 40, generator=torch.Generator().manual_seed(1))

    ours = newton_schulz(g, torch.bfloat16)

    assert torch.equal(ours, zeropower(g, (3.4445, -4.7750, 2.0315), 5, 1e-7))


def _two_steps(make: object, seed: int = 0) -> list[torch.Tensor]:
    """Each parameter's change over two steps of ``make(params)`` on fixed gradients."""
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(*s, generator=gen)) for s in ((64, 192), (256, 64))]
    before = [p.detach().clone() for p in params]
    opt = make(params)  # type: ignore[operator]
    for _ in range(2):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return [p.detach() - b for p, b in zip(params, before)]


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch has no torch.optim.Muon")
@pytest.mark.parametrize("nesterov", [True, False])
def test_float32_muon_follows_torch_muons_update(nesterov):
    kw = dict(lr=1e-2, momentum=0.95, weight_decay=0.01, nesterov=nesterov)
    ref = _two_steps(lambda ps: torch.optim.Muon(ps, adjust_lr_fn="match_rms_adamw", **kw))
    ours = _two_steps(lambda ps: Muon(ps, ns_dtype=torch.float32, **kw))
    same = _two_steps(lambda ps: Muon(ps, ns_dtype=torch.bfloat16, **kw))

    for r, o, b in zip(ref, ours, same):
        assert _cosine(r, o) > 0.99
        assert float(o.norm() / r.norm()) == pytest.approx(1.0, rel=0.05)  # the same scale
        assert torch.equal(r, b)  # in bfloat16 it is torch.optim.Muon's update exactly


def test_muon_takes_only_matrices():
    with pytest.raises(ValueError, match="2-D"):
        Muon([nn.Parameter(torch.ones(3))])
    with pytest.raises(ValueError, match="adjust_lr_fn"):
        Muon([nn.Parameter(torch.ones(3, 3))], adjust_lr_fn="other")


def test_muon_dtype_resolves_per_device():
    assert resolve_muon_dtype("auto", "cpu") == torch.float32
    assert resolve_muon_dtype("auto", "cuda") == torch.bfloat16
    assert resolve_muon_dtype("float32", "cuda") == torch.float32
    assert resolve_muon_dtype("bfloat16", "cpu") == torch.bfloat16
    with pytest.raises(ValueError, match="muon_dtype"):
        resolve_muon_dtype("float16", "cpu")


def test_the_config_choices_are_the_optimisers():
    assert pc.MUON_DTYPES == MUON_DTYPES
    assert load_pipeline_config(None, []).optim.muon_dtype == "auto"
    cfg = load_pipeline_config(None, ["optim.name=muon", "optim.muon_dtype=bfloat16"])
    assert cfg.optim.muon_dtype == "bfloat16"


@pytest.mark.parametrize("bad", ["float16", "fp32", "FLOAT32", ""])
def test_a_bad_muon_dtype_is_a_config_error_naming_the_key(bad):
    with pytest.raises(ConfigError, match="optim.muon_dtype") as e:
        load_pipeline_config(None, ["optim.name=muon", f"optim.muon_dtype={bad}"])
    assert "\n" not in str(e.value)


def test_stage_optimizer_orthogonalises_in_the_chosen_dtype():
    first, _ = build_stages(CFG, 2, seed=0)

    assert StageOptimizer(first, "muon", lr=1e-3).muon_dtype == torch.float32  # auto, CPU
    opt = StageOptimizer(first, "muon", lr=1e-3, muon_dtype="bfloat16")
    assert opt.muon_dtype == torch.bfloat16
    assert isinstance(opt.opts[0], Muon) and opt.opts[0].ns_dtype == torch.bfloat16
    with pytest.raises(ValueError, match="muon_dtype"):
        StageOptimizer(first, "muon", lr=1e-3, muon_dtype="half")


def test_stage_optimizer_state_round_trips():
    torch.manual_seed(0)
    a, _ = build_stages(CFG, 2, seed=0)
    b, _ = build_stages(CFG, 2, seed=0)
    oa, ob = StageOptimizer(a, "muon", lr=1e-2), StageOptimizer(b, "muon", lr=1e-2)
    grads = [[torch.randn_like(p) for p in a.parameters()] for _ in range(3)]
    for p, g in zip(a.parameters(), grads[0]):
        p.grad = g.clone()
    oa.step()
    ob.load_state_dict(copy.deepcopy(oa.state_dict()))  # as through a checkpoint file
    b.load_state_dict(a.state_dict())
    for gs in grads[1:]:
        for m, o in ((a, oa), (b, ob)):
            for p, g in zip(m.parameters(), gs):
                p.grad = g.clone()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_float32_against_bfloat16_speed_is_printed_not_asserted(capsys):
    """A benchmark print only: the speed depends on the CPU (bfloat16 matrix units or not)."""
    g = torch.randn(512, 128, generator=torch.Generator().manual_seed(0))
    took = {}
    for dtype in (torch.float32, torch.bfloat16):
        newton_schulz(g, dtype)
        t0 = time.perf_counter()
        for _ in range(3):
            newton_schulz(g, dtype)
        took[dtype] = (time.perf_counter() - t0) / 3
    with capsys.disabled():
        print(
            f"\nNewton-Schulz on 512x128, 5 steps: float32 {took[torch.float32] * 1e3:.2f} ms, "
            f"bfloat16 {took[torch.bfloat16] * 1e3:.2f} ms "
            f"({took[torch.bfloat16] / took[torch.float32]:.1f}x float32's)"
        )
