"""Local training of a MONAI network on one silo's data (plain SGD; DP-SGD is clients/dp.py).

No Flower imports: the ClientApp calls it for train messages, and the retraining baselines
reuse it. The task's loss and score are ``medical_data.tasks``'s.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

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
) -> dict[str, float]:
    """Run ``steps`` SGD steps on mini-batches drawn (with replacement) from ``data``.

    With ``proximal_mu`` > 0 the loss gets the FedProx term mu/2 * ||w - w_base||^2, which
    keeps a slow silo's work close to the model it started from (less harmful when stale).
    ``stop(step, steps)`` runs before each step and may raise to end the job there (a deployed
    node's erasure: ``clients.preempt``). Returns the mean training loss and score over the steps.
    """
    if len(data) == 0:  # (torch.randint's "from < to" otherwise, with no word of why)
        raise ValueError("no training data: every sample of this silo is excluded")
    device = device or torch.device("cpu")
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    images = torch.tensor(data.images)  # a private copy: the federation's arrays are read-only
    labels = torch.tensor(data.labels)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    loss_fn = task_loss(task)
    base = [p.detach().clone() for p in model.parameters()] if proximal_mu > 0 else []
    total_loss, total_score = 0.0, 0.0
    for step in range(steps):
        if stop is not None:
            stop(step, steps)
        idx = torch.randint(0, len(data), (min(batch_size, len(data)),), generator=gen)
        x, y = images[idx].to(device), labels[idx].to(device)
        opt.zero_grad(set_to_none=True)
        out = model(x)
        loss = loss_fn(out, targets(y, task))
        if proximal_mu > 0:
            prox = sum(((p - b) ** 2).sum() for p, b in zip(model.parameters(), base))
            loss = loss + 0.5 * proximal_mu * prox
        loss.backward()
        opt.step()
        total_loss += float(loss.detach())
        total_score += score(out.detach(), y, task)
    return {"train_loss": total_loss / steps, "train_score": total_score / steps}
