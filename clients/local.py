"""Local training of a MONAI network on one silo's data (plain SGD; DP-SGD is clients/dp.py),
on the silo's one loop (`clients.loop`).

No Flower imports: the ClientApp calls it for train messages, and the retraining baselines
reuse it. The task's loss and score are ``medical_data.tasks``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from clients.loop import FP32, Precision, run_steps, seeded_draws
from medical_data.federation import SiloData
from medical_data.tasks import loss_fn as task_loss
from medical_data.tasks import score, targets


def train_local(
    model: nn.Module,
    data: SiloData,
    *,
    task: str,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    proximal_mu: float = 0.0,
    seed: int = 0,
    device: torch.device | None = None,
    stop: Callable[[int, int], None] | None = None,
    precision: Precision = FP32,
) -> dict[str, float]:
    """Run ``steps`` SGD steps on mini-batches drawn (with replacement) from ``data``.

    With ``proximal_mu`` > 0 the loss gets the FedProx term mu/2 * ||w - w_base||^2, which
    keeps a slow silo's work close to the model it started from (less harmful when stale).
    ``stop(step, steps)`` runs before each step and may raise to end the job there (a deployed
    node's erasure: ``clients.preempt``). The steps are `clients.loop.run_steps`'s, under
    ``precision`` on CUDA. Returns the mean training loss and score over the steps.
    """
    if len(data) == 0:  # (torch.randint's "from < to" otherwise, with no word of why)
        raise ValueError("no training data: every sample of this silo is excluded")
    device = device or torch.device("cpu")
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    images = torch.tensor(data.images)  # a private copy: the federation's arrays are read-only
    labels = torch.tensor(data.labels)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    totals = run_steps(
        model,
        seeded_draws(images, labels, batch_size, gen, data.patch),
        objective(task, model, proximal_mu),
        lambda step: opt.step(),
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
        steps=steps,
        device=device,
        before=None if stop is None else lambda step: stop(step, steps),
        score=lambda out, y: score(out, y, task),
        precision=precision,
    )
    return {"train_loss": totals.loss / steps, "train_score": totals.score / steps}


def objective(
    task: str, model: nn.Module | None = None, proximal_mu: float = 0.0
) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The local training loss ``(out, y) -> scalar``: the task's (also the loss an erasure
    ascends), plus with ``proximal_mu`` > 0 FedProx's mu/2 * ||w - w_base||^2 around
    ``model``'s parameters as they are now."""
    loss_fn = task_loss(task)
    if proximal_mu <= 0 or model is None:
        return lambda out, y: loss_fn(out, targets(y, task))
    params = list(model.parameters())
    base = [p.detach().clone() for p in params]

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        prox = sum(((p - b) ** 2).sum() for p, b in zip(params, base))
        return loss_fn(out, targets(y, task)) + 0.5 * proximal_mu * prox

    return loss
