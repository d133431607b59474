"""Silo-side erasure: what the erasing silo runs on its forget set (no Flower imports).

Papers: projected gradient ascent follows Halimi et al. 2022, "Federated Unlearning: How to
Efficiently Erase a Client in FL?" (arXiv:2207.05521); the gradient signature is our reading
of AFU-IC (Cai & Zhang 2026, invariance calibration; only the abstract is public), see
`fedasync.unlearning`. Relabelling is the common "random label" baseline of the unlearning
literature (e.g. Graves et al. 2021, "Amnesiac Machine Learning").

Every method modifies ``model`` in place and returns scalar metrics. The erasing silo runs one
of them, then sends the server the erased model (or its delta) and
``forget_signature(model, forget, ...)``; the server projects later updates out of it.
``forget_signature_with_gradient`` also returns the forget set's mean loss gradient, for the
server's one-sided protection (``lab.erasure.protect=gradient/onesided``).

    reference = ledger.without(global_params, silo)   # server side
    model.load_state_dict(global_params)
    m = erase_pga(model, forget, reference=reference, radius=r, steps=50, lr=0.01,
                  batch_size=32, task="classification", seed=0)
    sig = forget_signature(model, forget, task="classification")
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch
from torch import nn

from clients.local import objective
from clients.loop import cap_guard, random_crops, run_steps, seeded_draws
from fedasync import seeds
from fedasync.erasure_metrics import logit_scale, true_label_confidence
from fedasync.membership import MembershipStop, Track
from fedasync.types import Params
from fedasync.unlearning import GradientSignature, params_to_vector
from medical_data.federation import SiloData
from medical_data.tasks import evaluate


def _batch(
    images: torch.Tensor,
    labels: torch.Tensor,
    n: int,
    gen: torch.Generator,
    crop: tuple[int, ...] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    idx = torch.randint(0, len(images), (min(n, len(images)),), generator=gen)
    return random_crops(images[idx], labels[idx], crop, gen)


class Samples(Protocol):
    """Some of one silo's samples as an erasure uses them (its forget set, its held-out
    samples): a built-in benchmark's arrays (:class:`ArraySamples`) or a MONAI bundle's items
    (``clients.task.BundleSamples``)."""

    def __len__(self) -> int:
        """How many samples."""
        ...

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """``loss`` and ``score`` of ``model`` on them."""
        ...

    def draws(
        self, batch_size: int, gen: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """Endless training batches drawn with replacement by ``gen``."""
        ...

    def chunk(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``idx`` as one batch, the same every call."""
        ...

    def statistic(self, model: nn.Module, idx: np.ndarray, device: torch.device) -> np.ndarray:
        """The membership statistic of samples ``idx``: ``(len(idx),)``."""
        ...

    def loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The loss an erasure ascends and the signature differentiates."""
        ...


@dataclass
class ArraySamples:
    """A built-in benchmark's samples (arrays in memory) as :class:`Samples`."""

    data: SiloData
    task: str

    def __len__(self) -> int:
        """How many samples."""
        return len(self.data)

    def evaluate(self, model: nn.Module, device: torch.device) -> dict[str, float]:
        """``medical_data.tasks.evaluate`` on them."""
        return evaluate(model, self.data, task=self.task, device=device)

    def draws(
        self, batch_size: int, gen: torch.Generator
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """``clients.loop.seeded_draws`` (random crops of volumes)."""
        images, labels = torch.tensor(self.data.images), torch.tensor(self.data.labels)
        return iter(seeded_draws(images, labels, batch_size, gen, self.data.patch))

    def chunk(self, idx: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """Samples ``idx``, whole."""
        return torch.tensor(self.data.images[idx]), torch.tensor(self.data.labels[idx])

    def statistic(self, model: nn.Module, idx: np.ndarray, device: torch.device) -> np.ndarray:
        """:func:`membership_statistic`."""
        return membership_statistic(model, self.data, idx, task=self.task, device=device)

    def loss(self) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
        """The task's loss."""
        return objective(self.task)


def as_samples(data: SiloData | Samples, task: str) -> Samples:
    """``data`` as :class:`Samples` (arrays are wrapped)."""
    return ArraySamples(data, task) if isinstance(data, SiloData) else data


def erase_pga(
    model: nn.Module,
    forget: SiloData | Samples,
    *,
    reference: Params,
    radius: float,
    steps: int,
    lr: float,
    batch_size: int,
    task: str,
    seed: int,
    loss_cap: float | None = None,
    device: torch.device | None = None,
    stop: MembershipStop | None = None,
    heldout: SiloData | Samples | None = None,
    check_every: int = 1,
    probe: int = 128,
) -> dict[str, float]:
    """Projected gradient ascent (Halimi et al. 2022) on the forget set, in place.

    Each step is one SGD step that *increases* the loss on a mini-batch of ``forget`` (drawn
    with replacement), after which the trainable parameters are projected back into the L2
    ball of ``radius`` around ``reference`` (`fedasync.unlearning.project_to_ball` arithmetic,
    over all trainable parameters together). The ball keeps the ascent from wandering into a
    useless model; its centre should be a model that has not seen the silo. Halimi et al. use
    the mean of the other silos' models; asynchronously the server sends instead the global
    model with the silo's recorded contributions removed
    (`fedasync.unlearning.ContributionLedger.without`), or the global model itself when it
    has none recorded. ``reference`` is a state dict with (at least) the trainable
    parameters' names.

    Early stop: before a step, if the batch loss already exceeds ``loss_cap`` the loop ends
    (default ``2 · log(C)`` with ``C`` the model's output channels: twice the loss of a
    uniform guess), since beyond it ascent only destroys the model.

    With ``stop`` (and ``heldout``, samples of this silo that no model trained on) ``steps``
    is a budget: before the first step and every ``check_every`` steps the forget samples'
    membership statistic is compared with the held-out samples' (``probe`` seeded samples of
    each, `fedasync.membership`). The ascent stops as soon as the two cannot be told apart, and
    returns to its best earlier state when it overshoots (forget samples less familiar than
    unseen ones: over-erasure).

    Returns forget-set loss and score before and after, the steps taken, the final distance
    to ``reference``, whether it stopped early, and the seconds spent; with ``stop`` also the
    AUC before and after, the band, the readings taken, whether the two sets ended
    indistinguishable and whether it reverted past an overshoot.
    """
    if radius < 0:
        raise ValueError(f"radius must be >= 0, got {radius}")
    if stop is not None and (heldout is None or len(heldout) == 0):
        raise ValueError("the stopping rule needs held-out samples of this silo")
    if check_every < 1 or probe < 1:
        raise ValueError(f"check_every and probe must be >= 1, got {check_every} and {probe}")
    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    forget = as_samples(forget, task)
    before = forget.evaluate(model, device)
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    ref = [reference[n].detach().to(device=device, dtype=p.dtype) for n, p in named]
    opt = torch.optim.SGD(params, lr=lr)
    dist = 0.0
    judge = None
    if stop is not None:
        assert heldout is not None
        judge = _Judge(
            stop, forget, as_samples(heldout, task), probe=probe, seed=seed, device=device
        )
        if judge.check(model, params, 0):
            steps = 0

    def apply(step: int) -> None:
        nonlocal dist
        opt.step()
        with torch.no_grad():
            diffs = [p - r for p, r in zip(params, ref)]
            dist = math.sqrt(sum(float(d.double().pow(2).sum()) for d in diffs))
            if dist > radius:
                c = radius / dist
                for p, r, d in zip(params, ref, diffs):
                    p.copy_(r + d * c)
                dist = radius

    def judged(step: int) -> bool:
        if judge is None or not ((step + 1) % check_every == 0 or step + 1 == steps):
            return False
        return judge.check(model, params, step + 1)

    totals = run_steps(
        model,
        forget.draws(batch_size, gen),
        forget.loss(),  # ascended
        apply,
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
        steps=steps,
        device=device,
        ascend=True,
        guard=cap_guard(loss_cap),
        after=judged,
    )
    taken, stopped = totals.steps, totals.ended_by == "guard"
    reading: dict[str, float] = {}
    if judge is not None and judge.track.readings[-1][0] != taken:
        judge.check(model, params, taken)  # (the loss cap ended it between two readings)
    if judge is not None:
        if judge.reverted_to is not None:
            with torch.no_grad():
                dist = math.sqrt(
                    sum(float((p - r).double().pow(2).sum()) for p, r in zip(params, ref))
                )
        reading = judge.summary()
    after = forget.evaluate(model, device)
    return {
        "forget_loss_before": before["loss"],
        "forget_score_before": before["score"],
        "forget_loss": after["loss"],
        "forget_score": after["score"],
        "steps": float(taken),
        "distance": dist,
        "stopped_early": float(stopped),
        "seconds": time.perf_counter() - t0,
        **reading,
    }


@torch.no_grad()
def membership_statistic(
    model: nn.Module, data: SiloData, idx: np.ndarray, *, task: str, device: torch.device
) -> np.ndarray:
    """Per-sample logit-scaled confidence in the true label (LiRA's statistic; pixels
    averaged for segmentation) of ``data``'s samples ``idx``, in eval mode."""
    was_training = model.training
    model.eval()
    out = []
    for start in range(0, len(idx), 256):
        sel = idx[start : start + 256]
        logits = model(torch.tensor(data.images[sel], device=device))
        out.append(logit_scale(true_label_confidence(logits, data.labels[sel])))
    model.train(was_training)
    return np.concatenate(out)


class _Judge:
    """The stopping rule's side of one erasure: fixed probe samples, the track of readings
    and the best state so far (to return to past an overshoot)."""

    def __init__(
        self,
        rule: MembershipStop,
        forget: Samples,
        heldout: Samples,
        *,
        probe: int,
        seed: int,
        device: torch.device,
    ) -> None:
        rng = seeds.rng(seed, "unlearn.probe")
        self.rule, self.forget, self.heldout = rule, forget, heldout
        self.f_idx = np.sort(rng.permutation(len(forget))[:probe])
        self.h_idx = np.sort(rng.permutation(len(heldout))[:probe])
        self.device = device
        self.track: Track = rule.track()
        self.best_state: list[torch.Tensor] | None = None
        self.reverted_to: int | None = None
        self.reason = ""

    def check(self, model: nn.Module, params: Sequence[torch.Tensor], step: int) -> bool:
        """Take a reading after ``step`` steps; True when the ascent is to stop (having
        restored the best earlier state on an overshoot)."""
        reading = self.rule.read(
            self.forget.statistic(model, self.f_idx, self.device),
            self.heldout.statistic(model, self.h_idx, self.device),
        )
        decision = self.track.add(step, reading)
        if self.track.best()[0] == step:
            self.best_state = [p.detach().clone() for p in params]
        self.reason = decision.reason
        if decision.revert_to is not None and decision.revert_to != step:
            assert self.best_state is not None
            with torch.no_grad():
                for p, b in zip(params, self.best_state):
                    p.copy_(b)
            self.reverted_to = decision.revert_to
        return decision.stop

    def summary(self) -> dict[str, float]:
        """The track's summary, with the AUC of the state kept (the best one after a revert)."""
        kept = self.track.best()[1] if self.reverted_to is not None else self.track.readings[-1][1]
        return {
            **self.track.summary(),
            "auc": kept.auc,
            "compared": float(len(self.f_idx) + len(self.h_idx)),
            "indistinguishable": float(kept.verdict == "indistinguishable"),
            "overshoot": float(self.reason == "over"),
            "reverted_to_step": float(-1 if self.reverted_to is None else self.reverted_to),
        }


def _wrong_labels(labels: np.ndarray, num_classes: int, seed: int) -> np.ndarray:
    """One seeded wrong class per sample: ``(y + r) mod C`` with ``r`` uniform in 1..C-1."""
    rng = np.random.default_rng(seed)
    shift = rng.integers(1, num_classes, size=len(labels))
    return ((labels + shift) % num_classes).astype(np.int64)


def erase_relabel(
    model: nn.Module,
    forget: SiloData,
    *,
    retain: SiloData | None,
    steps: int,
    lr: float,
    batch_size: int,
    num_classes: int,
    task: str,
    seed: int,
    device: torch.device | None = None,
) -> dict[str, float]:
    """Fine-tune on the forget set with wrong targets, in place.

    Classification: each forget sample gets one seeded random *wrong* class (fixed for the
    whole run, so the model cannot average the noise back into the true class).
    Segmentation: every forget mask becomes all background, so the model stops finding the
    forgotten structures. With ``retain`` each step trains on a forget batch and a retain
    batch of the same size (1:1) with their true targets, which keeps utility on the data
    that stays. Plain SGD, batches drawn with replacement.

    Returns the mean training loss and forget-set loss/score (true labels) before and after.
    """
    if task == "classification" and num_classes < 2:
        raise ValueError(f"relabelling needs num_classes >= 2, got {num_classes}")
    t0 = time.perf_counter()
    device = device or torch.device("cpu")
    before = evaluate(model, forget, task=task, device=device)
    model.to(device).train()
    gen = torch.Generator().manual_seed(seed)
    f_x = torch.tensor(forget.images)
    if task == "classification":
        f_y = torch.tensor(_wrong_labels(forget.labels, num_classes, seed))
    else:
        f_y = torch.zeros_like(torch.tensor(forget.labels))
    r_x = r_y = None
    if retain is not None and len(retain) > 0:
        r_x, r_y = torch.tensor(retain.images), torch.tensor(retain.labels)
    opt = torch.optim.SGD(model.parameters(), lr=lr)

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while True:
            x, y = _batch(f_x, f_y, batch_size, gen, forget.patch)
            if r_x is not None and r_y is not None:
                rx, ry = _batch(r_x, r_y, len(x), gen, forget.patch)
                x, y = torch.cat([x, rx]), torch.cat([y, ry])
            yield x, y

    totals = run_steps(
        model,
        batches(),
        objective(task),
        lambda step: opt.step(),
        zero_grad=lambda: opt.zero_grad(set_to_none=True),
        steps=steps,
        device=device,
    )
    total = totals.loss
    after = evaluate(model, forget, task=task, device=device)
    return {
        "train_loss": total / max(steps, 1),
        "forget_loss_before": before["loss"],
        "forget_score_before": before["score"],
        "forget_loss": after["loss"],
        "forget_score": after["score"],
        "seconds": time.perf_counter() - t0,
    }


def forget_signature(
    model: nn.Module,
    forget: SiloData | Samples,
    *,
    task: str,
    batches: int = 8,
    batch_size: int = 32,
    rank: int = 8,
    energy: float = 0.99,
    seed: int = 0,
    device: torch.device | None = None,
) -> GradientSignature:
    """Low-rank gradient signature of ``forget`` at ``model`` (call it on the *erased* model).

    Takes a seeded permutation of the forget set, keeps its first ``batches · batch_size``
    samples and splits them into ``min(batches, N)`` near-equal batches (so a small forget
    set still yields several gradients), computes the mean loss gradient of each, and keeps
    the top directions of their span (`GradientSignature.from_gradients`). The gradients run
    over all trainable floating parameters, in ``model.state_dict()`` name order. At the
    erased model these are the directions along which later training would lower the forget
    loss again, i.e. relearn; the server projects them out of every later update.
    """
    sig, _ = forget_signature_with_gradient(
        model,
        forget,
        task=task,
        batches=batches,
        batch_size=batch_size,
        rank=rank,
        energy=energy,
        seed=seed,
        device=device,
    )
    return sig


def forget_signature_with_gradient(
    model: nn.Module,
    forget: SiloData | Samples,
    *,
    task: str,
    batches: int = 8,
    batch_size: int = 32,
    rank: int = 8,
    energy: float = 0.99,
    seed: int = 0,
    device: torch.device | None = None,
) -> tuple[GradientSignature, torch.Tensor]:
    """:func:`forget_signature` and, from the same batches at no extra cost, the forget set's
    mean loss gradient g_f: ``(d,)`` float32 over the signature's tensor names (in its
    order), the batch gradients weighted by their batch sizes. A later change with
    ⟨Δ, g_f⟩ < 0 would lower the forget loss (``lab.erasure.protect=gradient/onesided``
    blocks that component, `fedasync.unlearning.ForgetGradient`)."""
    if len(forget) == 0:
        raise ValueError("forget set is empty")
    forget = as_samples(forget, task)
    device = device or torch.device("cpu")
    model.to(device).eval()
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    names = [n for n, v in model.state_dict().items() if n in trainable and v.is_floating_point()]
    params = dict(model.named_parameters())
    perm = np.random.default_rng(seed).permutation(len(forget))[: batches * batch_size]
    chunks = [c for c in np.array_split(perm, min(batches, len(perm))) if len(c)]
    grads: list[Params] = []

    def keep(step: int) -> None:
        grads.append(
            {
                n: params[n].grad.detach().cpu().clone()  # type: ignore[union-attr]
                if params[n].grad is not None
                else torch.zeros_like(params[n], device="cpu")
                for n in names
            }
        )

    chunk_batches = (forget.chunk(np.sort(c)) for c in chunks)
    run_steps(
        model,
        chunk_batches,
        forget.loss(),
        keep,
        zero_grad=lambda: model.zero_grad(set_to_none=True),
        steps=len(chunks),
        device=device,
    )
    model.zero_grad(set_to_none=True)
    sizes = torch.tensor([float(len(c)) for c in chunks])
    stacked = torch.stack([params_to_vector(g, names).float() for g in grads])
    mean = (sizes / sizes.sum()) @ stacked
    sig = GradientSignature.from_gradients(grads, rank=rank, energy=energy, names=names)
    return sig, mean
