"""What a benchmark's task means for a model: its loss, targets and score, and evaluation.

Plain functions with no Flower imports, shared by the ClientApp (local training, evaluate
messages, erasure), the server (the global model on the held-out test set, in simulation) and
the verification runs. Classification uses cross-entropy and reports accuracy; segmentation
uses MONAI's DiceCE loss and reports the foreground Dice score. The *score* of a task is its
accuracy or Dice, whichever applies. Also the subsets a silo trains on (``training_data``,
``select``, ``concat``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch
from torch import nn

from fedasync import seeds
from medical_data.federation import SiloData


def training_data(fed: Any, silo: int, backdoor: dict | None, seed: int) -> SiloData:
    """Silo ``silo``'s training data; in backdoor verification runs, with the trigger applied."""
    if not 0 <= silo < len(fed.silos):
        raise ValueError(f"silo {silo} is not a silo of this federation (0..{len(fed.silos) - 1})")
    return backdoored(fed.silos[silo], silo, backdoor, seed)


def backdoored(data: SiloData, silo: int, backdoor: dict | None, seed: int) -> SiloData:
    """``data`` (silo ``silo``'s), poisoned when ``backdoor`` is on and names that silo."""
    if backdoor and backdoor.get("enabled") and int(backdoor["silo"]) == silo:
        from medical_data.backdoor import poison

        return poison(
            data,
            float(backdoor["fraction"]),
            int(backdoor["target_label"]),
            seed,
            size=int(backdoor.get("trigger_size", 3)),
            pattern=str(backdoor.get("trigger_pattern", "solid")),
        )
    return data


def site_heldout(fed: Any, silo: int, backdoor: dict | None, seed: int) -> SiloData:
    """Silo ``silo``'s own held-out samples: its share of the pooled test set (its site's
    shift, never trained on by any silo), the simulated counterpart of a hospital's
    validation list; in backdoor verification runs poisoned as its training data is (so that
    the two are drawn alike, as the erasure's membership test assumes)."""
    if not 0 <= silo < len(fed.silos):
        raise ValueError(f"silo {silo} is not a silo of this federation (0..{len(fed.silos) - 1})")
    mask = np.asarray(fed.info["test_sites"]) == silo
    own = replace(
        fed.test,
        silo_id=silo,
        name=f"{fed.silos[silo].name} (held out)",
        images=fed.test.images[mask],
        labels=fed.test.labels[mask],
        sample_ids=fed.test.sample_ids[mask],
    )
    return backdoored(own, silo, backdoor, seed)


def relearning_data(fed: Any, backdoor: dict, seed: int) -> SiloData:
    """What a relearning attacker adds to its own data: the backdoored silo's poisoned samples
    (:func:`training_data` of that silo, only the triggered ones), or a seeded
    ``backdoor["relearn_samples"]`` of them when that is set."""
    from medical_data.backdoor import poisoned_indices
    from medical_data.verification import subset

    silo = int(backdoor["silo"])
    data = training_data(fed, silo, backdoor, seed)
    idx = poisoned_indices(len(fed.silos[silo]), float(backdoor["fraction"]), seed)
    n = backdoor.get("relearn_samples")
    if n is not None and int(n) < len(idx):
        rng = seeds.rng(seed, "backdoor.relearn")
        idx = np.sort(rng.choice(idx, size=int(n), replace=False))
    return subset(data, idx)


def select(data: SiloData, ids: list[str], *, keep: bool = False) -> SiloData:
    """``data`` without the samples whose ids are listed (``keep=True``: only those).

    Without ids: all of ``data`` (both ways), so an empty forget list means the whole silo.
    """
    if not ids:
        return data
    mask = np.isin(data.sample_ids, np.asarray(ids, dtype=data.sample_ids.dtype))
    if not keep:
        mask = ~mask
    return replace(
        data, images=data.images[mask], labels=data.labels[mask], sample_ids=data.sample_ids[mask]
    )


def concat(a: SiloData, b: SiloData) -> SiloData:
    """The samples of ``a`` followed by those of ``b`` (named after ``a``)."""
    return replace(
        a,
        images=np.concatenate([a.images, b.images]),
        labels=np.concatenate([a.labels, b.labels]),
        sample_ids=np.concatenate([a.sample_ids, b.sample_ids]),
    )


def loss_fn(task: str) -> nn.Module:
    """Cross-entropy for classification; MONAI's DiceCE (softmax, one-hot) for segmentation."""
    if task == "classification":
        return nn.CrossEntropyLoss()
    from monai.losses import DiceCELoss

    return DiceCELoss(to_onehot_y=True, softmax=True)


def targets(labels: torch.Tensor, task: str) -> torch.Tensor:
    """Classification labels ``(b,)``; segmentation masks ``(b, H, W)`` -> ``(b, 1, H, W)``."""
    return labels if task == "classification" else labels.unsqueeze(1)


def score(out: torch.Tensor, y: torch.Tensor, task: str) -> float:
    """Accuracy ``out (b, C)`` vs ``y (b,)``, or foreground Dice ``out (b, C, *spatial)`` vs
    ``y (b, *spatial)``: with more than two classes the mean over the foreground classes of
    each one's Dice (:func:`dice_sums`)."""
    pred = out.argmax(dim=1)
    if task == "classification":
        return float((pred == y).float().mean())
    return dice(dice_sums(pred, y, out.shape[1]))


def dice_sums(pred: torch.Tensor, y: torch.Tensor, classes: int) -> list[tuple[float, float]]:
    """Per foreground class, (intersection, |prediction| + |label|) voxel counts of
    ``pred`` against ``y`` (both class indices). Two classes: the one foreground class is
    everything above 0."""
    if classes <= 2:
        p, t = (pred > 0).float(), (y > 0).float()
        return [(float((p * t).sum()), float(p.sum() + t.sum()))]
    rows = []
    for c in range(1, classes):
        p, t = (pred == c).float(), (y == c).float()
        rows.append((float((p * t).sum()), float(p.sum() + t.sum())))
    return rows


def dice(sums: list[tuple[float, float]]) -> float:
    """The mean over classes of 2·intersection / denominator (1 where both are empty)."""
    per = [1.0 if d == 0 else 2.0 * i / d for i, d in sums]
    return per[0] if len(per) == 1 else float(np.mean(per))


@torch.no_grad()
def evaluate(
    model: nn.Module,
    data: SiloData,
    *,
    task: str,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Loss and score of ``model`` on all of ``data``.

    Classification: mean cross-entropy and accuracy. Segmentation: mean DiceCE and the Dice of
    all foreground pixels pooled over the set (so empty slices do not inflate it); with more
    than two classes, each foreground class's pooled Dice, averaged. Volumes (``data.patch``)
    are taken a few at a time (the network's sliding window sees each whole).
    """
    device = device or torch.device("cpu")
    model.to(device).eval()
    loss_fn_ = loss_fn(task)
    if data.patch is not None:
        batch_size = min(batch_size, 8)
    total_loss, correct, n = 0.0, 0.0, 0
    sums: list[tuple[float, float]] | None = None
    for start in range(0, len(data), batch_size):
        x = torch.tensor(data.images[start : start + batch_size], device=device)
        y = torch.tensor(data.labels[start : start + batch_size], device=device)
        out = model(x)
        total_loss += float(loss_fn_(out, targets(y, task))) * len(x)
        pred = out.argmax(dim=1)
        if task == "classification":
            correct += float((pred == y).sum())
        else:
            got = dice_sums(pred, y, out.shape[1])
            sums = got if sums is None else [(a + c, b + d) for (a, b), (c, d) in zip(sums, got)]
        n += len(x)
    n = max(n, 1)
    if task == "classification":
        score = correct / n
    else:
        score = dice(sums or [(0.0, 0.0)])
    return {"loss": total_loss / n, "score": score}
