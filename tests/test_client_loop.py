"""The silo's one training loop (``clients.loop``): its parts, its order, and that every
gradient under ``clients/`` is computed there."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
from torch import nn

from clients.loop import Precision, cap_guard, run_steps, seeded_draws

ROOT = Path(__file__).resolve().parent.parent


def _backward_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text())
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backward"
    ]


def test_backward_is_called_in_one_place_under_clients():
    # Execute
    calls = {
        str(p.relative_to(ROOT)): lines
        for p in sorted((ROOT / "clients").rglob("*.py"))
        if (lines := _backward_calls(p))
    }
    # Assert
    assert list(calls) == ["clients/loop.py"] and len(calls["clients/loop.py"]) == 1, calls


def _linear() -> nn.Linear:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def test_one_sgd_step_is_the_step_worked_out_by_hand():
    # Prepare: loss = sum(W x + b) on x = (1, 2, 3): dL/dW = [x; x], dL/db = (1, 1)
    model = _linear()
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    x = torch.tensor([[1.0, 2.0, 3.0]])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    # Execute
    totals = run_steps(
        model,
        iter([(x, torch.zeros(1))]),
        lambda out, y: out.sum(),
        lambda step: opt.step(),
        zero_grad=opt.zero_grad,
        steps=1,
        device=torch.device("cpu"),
    )
    # Assert
    assert torch.allclose(model.weight, w0 - 0.1 * torch.stack([x[0], x[0]]))
    assert torch.allclose(model.bias, b0 - 0.1)
    assert (totals.steps, totals.nonempty, totals.samples, totals.ended_by) == (1, 1, 1, "")


def test_ascent_climbs_the_loss_and_the_guard_ends_before_a_backward_pass():
    # Prepare: ascend sum(out) with a cap just above the starting loss
    model = _linear()
    x = torch.tensor([[1.0, 2.0, 3.0]])
    start = float(model(x).sum().detach())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    applied = []

    def apply(step: int) -> None:
        applied.append(step)
        opt.step()

    # Execute
    totals = run_steps(
        model,
        iter([(x, torch.zeros(1))] * 10),
        lambda out, y: out.sum(),
        apply,
        zero_grad=opt.zero_grad,
        steps=10,
        device=torch.device("cpu"),
        ascend=True,
        guard=cap_guard(start + 1.0),
    )
    # Assert: each step raises sum(out) by 0.1 * (|x|^2 + 1) * 2 = 3.0, so the second loss
    # (start + 3) is past the cap: one step taken, the guard ended it
    assert applied == [0] and totals.steps == 1 and totals.ended_by == "guard"
    assert float(model(x).sum().detach()) == pytest.approx(start + 3.0, rel=1e-5)


def test_after_ends_the_loop_and_the_batches_may_run_out():
    model = _linear()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    batches = [(torch.ones(2, 3), torch.zeros(2))] * 3
    common = {
        "zero_grad": opt.zero_grad,
        "device": torch.device("cpu"),
        "score": lambda out, y: 0.5,
    }
    stopped = run_steps(
        model,
        iter(batches),
        lambda o, y: o.sum(),
        lambda s: opt.step(),
        steps=5,
        after=lambda s: s == 1,
        **common,
    )
    ran_out = run_steps(
        model, iter(batches), lambda o, y: o.sum(), lambda s: opt.step(), steps=5, **common
    )
    assert (stopped.steps, stopped.ended_by, stopped.score) == (2, "after", 1.0)
    assert (ran_out.steps, ran_out.samples, ran_out.ended_by) == (3, 6, "")


def test_fp16_loss_scaling_skips_a_step_whose_gradients_are_not_finite_and_halves_the_scale():
    # Prepare: scaled gradients, one of them infinite
    p = nn.Parameter(torch.zeros(2))
    prec = Precision("fp16", scale=8.0, growth_interval=2)
    # Execute / Assert: not finite -> skipped, scale halved
    p.grad = torch.tensor([16.0, float("inf")])
    assert not prec.unscale([p]) and prec.scale == 4.0
    # finite -> unscaled; two in a row double the scale
    p.grad = torch.tensor([8.0, 4.0])
    assert prec.unscale([p]) and torch.equal(p.grad, torch.tensor([2.0, 1.0]))
    p.grad = torch.tensor([4.0, 4.0])
    assert prec.unscale([p]) and prec.scale == 8.0


def test_mixed_precision_changes_nothing_on_a_cpu_and_rejects_an_unknown_name():
    cpu = torch.device("cpu")
    assert not Precision("bf16").active(cpu) and not Precision("fp16").scaled(cpu)
    assert Precision("bf16").active(torch.device("cuda"))
    with pytest.raises(ValueError, match="precision must be one of"):
        Precision("fp8")


def test_seeded_draws_repeat_for_a_seed():
    images, labels = torch.arange(10.0).reshape(10, 1), torch.arange(10)
    a = seeded_draws(images, labels, 4, torch.Generator().manual_seed(3))
    b = seeded_draws(images, labels, 4, torch.Generator().manual_seed(3))
    xa, ya = next(a)
    xb, yb = next(b)
    assert torch.equal(xa, xb) and torch.equal(ya, yb) and torch.equal(xa[:, 0].long(), ya)
