"""Did the erasure work? Accuracy, backdoor success and membership inference on a model.

Metrics used by the verification runs (no Flower imports). Papers: the loss-threshold
membership inference attack of Yeom et al. 2018 ("Privacy Risk in Machine Learning"), scored
threshold-free as a ROC AUC; the backdoor test of Halimi et al. 2022 (trigger from
`medical_data.backdoor`). After a good erasure the forget set looks like unseen data: its
accuracy drops towards test accuracy, the membership AUC (forget vs unseen test samples)
falls towards 0.5, and the attack success rate of a backdoor the erased silo planted falls
towards that of a model retrained without the silo (chance for classification; per pixel
for segmentation, where a clean model's misses already count).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

from fedasync.erasure_metrics import rank_auc
from medical_data.federation import SiloData
from medical_data.tasks import evaluate


def _per_sample_loss(out: torch.Tensor, y: torch.Tensor, task: str) -> torch.Tensor:
    """Loss per sample, shape ``(b,)``: cross-entropy, or DiceCE (MONAI's defaults) per image."""
    if task == "classification":
        return F.cross_entropy(out, y, reduction="none")
    from monai.losses import DiceLoss

    dice = DiceLoss(to_onehot_y=True, softmax=True, reduction="none")(out, y.unsqueeze(1))
    ce = F.cross_entropy(out, y, reduction="none")
    return dice.reshape(len(out), -1).mean(1) + ce.reshape(len(out), -1).mean(1)


@torch.no_grad()
def predict_losses(
    model: nn.Module,
    data: SiloData,
    task: str,
    batch_size: int = 256,
    device: torch.device | None = None,
) -> np.ndarray:
    """Per-sample loss of ``model`` on ``data``, float64 shape ``(N,)``.

    Their mean equals `medical_data.tasks.evaluate`'s loss (cross-entropy, or DiceCE per image).
    """
    device = device or torch.device("cpu")
    model.to(device).eval()
    losses = []
    for start in range(0, len(data), batch_size):
        x = torch.tensor(data.images[start : start + batch_size], device=device)
        y = torch.tensor(data.labels[start : start + batch_size], device=device)
        losses.append(_per_sample_loss(model(x), y, task).double().cpu())
    return torch.cat(losses).numpy() if losses else np.zeros(0)


def accuracy(
    model: nn.Module, data: SiloData, task: str, device: torch.device | None = None
) -> float:
    """The task's score on ``data``: accuracy (classification) or pooled foreground Dice."""
    return evaluate(model, data, task=task, device=device)["score"]


def _asr_images(pred: torch.Tensor, y: torch.Tensor, target: int) -> tuple[int, int]:
    """Hits and trials of a classification batch: images, ``pred`` shape ``(b,)``."""
    return int((pred == target).sum()), len(pred)


def _asr_pixels(pred: torch.Tensor, y: torch.Tensor, target: int) -> tuple[int, int]:
    """Hits and trials of a segmentation batch: the pixels whose true label is not
    ``target`` (the ones the attack has to flip), ``pred`` and ``y`` shape ``(b, H, W)``."""
    other = y != target
    return int((pred[other] == target).sum()), int(other.sum())


_ASR_COUNTS = {"classification": _asr_images, "segmentation": _asr_pixels}


@torch.no_grad()
def attack_success_rate(
    model: nn.Module,
    triggered: SiloData,
    target_label: int,
    task: str = "classification",
    batch_size: int = 256,
    device: torch.device | None = None,
) -> float:
    """How often the trigger gets ``target_label`` out of ``model``, on ``triggered``
    (`medical_data.backdoor.triggered_set`: trigger added, true labels kept).

    Classification: the share of ``triggered`` predicted as ``target_label`` (its true labels
    are not the target). Segmentation: of the pixels whose true label is not ``target_label``,
    pooled over ``triggered``, the share predicted as ``target_label``. A clean segmentation
    model scores above 0 there (with target background: 1 − its foreground recall on the
    triggered images), so the reference is the ASR of a model retrained without the poisoned
    silo, not 0.
    """
    count = _ASR_COUNTS.get(task)
    if count is None:
        raise ValueError(f"task must be one of {sorted(_ASR_COUNTS)}, got {task!r}")
    if len(triggered) == 0:
        raise ValueError("triggered set is empty")
    device = device or torch.device("cpu")
    model.to(device).eval()
    hits, total = 0, 0
    for start in range(0, len(triggered), batch_size):
        x = torch.tensor(triggered.images[start : start + batch_size], device=device)
        y = torch.tensor(triggered.labels[start : start + batch_size], device=device)
        h, n = count(model(x).argmax(dim=1), y, target_label)
        hits, total = hits + h, total + n
    if total == 0:
        raise ValueError(f"no pixel of the triggered set has a label other than {target_label}")
    return hits / total


def mia_auc(
    model: nn.Module,
    members: SiloData,
    non_members: SiloData,
    task: str,
    device: torch.device | None = None,
) -> float:
    """Loss-threshold membership inference (Yeom et al. 2018) as a ROC AUC.

    The membership score is ``−loss``: members (label 1) vs non-members (label 0). 0.5 means
    the attack cannot tell them apart (no leakage); 1.0 means every member has a lower loss
    than every non-member. Ties count one half (`fedasync.erasure_metrics.rank_auc`).
    """
    if len(members) == 0 or len(non_members) == 0:
        raise ValueError("mia_auc needs at least one member and one non-member")
    lm = predict_losses(model, members, task, device=device)
    ln = predict_losses(model, non_members, task, device=device)
    return rank_auc(-lm, -ln)


def subset(data: SiloData, idx: np.ndarray) -> SiloData:
    """The samples ``idx`` of ``data`` (copies)."""
    return SiloData(
        silo_id=data.silo_id,
        name=data.name,
        images=np.array(data.images[idx], copy=True),
        labels=np.array(data.labels[idx], copy=True),
        sample_ids=np.array(data.sample_ids[idx], copy=True),
        patch=data.patch,
    )


def mia_samples(n_forget: int, n_test: int) -> int:
    """How many members and how many non-members ``verification_report``'s ``mia_auc``
    compares: the smaller set's size, on each side."""
    return min(n_forget, n_test)


def sample_counts(forget: SiloData, test: SiloData) -> dict[str, float]:
    """The sample counts behind ``verification_report``'s figures, for the noise of each:
    ``forget_samples`` and ``test_samples`` (the two scores), ``mia_members`` and
    ``mia_nonmembers`` (the membership AUC)."""
    k = float(mia_samples(len(forget), len(test)))
    return {
        "forget_samples": float(len(forget)),
        "test_samples": float(len(test)),
        "mia_members": k,
        "mia_nonmembers": k,
    }


def verification_report(
    model: nn.Module,
    *,
    forget: SiloData,
    test: SiloData,
    triggered: SiloData | None,
    target_label: int | None,
    task: str,
    untriggered: SiloData | None = None,
    seed: int = 0,
    device: torch.device | None = None,
) -> dict[str, float]:
    """The verification metrics of one model.

    ``forget_accuracy`` and ``test_accuracy`` (task score); ``asr`` when ``triggered`` and
    ``target_label`` are given, and ``asr_without_trigger`` when ``untriggered`` (the same
    samples without the trigger) is: the backdoor is what the trigger adds to it; ``mia_auc`` of the forget set (members) against a seeded
    subset of ``test`` of the same size (non-members; all of ``test`` if it is smaller, in
    which case a seeded equal-size subset of ``forget`` is used as members).
    """
    report = {
        "forget_accuracy": accuracy(model, forget, task, device=device),
        "test_accuracy": accuracy(model, test, task, device=device),
    }
    if triggered is not None:
        if target_label is None:
            raise ValueError("a triggered set needs its target_label")
        report["asr"] = attack_success_rate(
            model, triggered, target_label, task=task, device=device
        )
        if untriggered is not None:
            report["asr_without_trigger"] = attack_success_rate(
                model, untriggered, target_label, task=task, device=device
            )
    rng = np.random.default_rng(seed)
    k = mia_samples(len(forget), len(test))
    members = (
        forget if k == len(forget) else subset(forget, np.sort(rng.permutation(len(forget))[:k]))
    )
    non_members = test if k == len(test) else subset(test, np.sort(rng.permutation(len(test))[:k]))
    report["mia_auc"] = mia_auc(model, members, non_members, task, device=device)
    return report
