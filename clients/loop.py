"""The silo's one training loop: every gradient a silo computes is computed in `run_steps`.

Plain local training (SGD), DP-SGD (opacus's wrapped module and optimiser), the erasure's
projected gradient ascent, the relabelling erasure and the forget-gradient signature are this
loop with different parts:

- ``batches``: where ``(x, y)`` come from (seeded draws with replacement, opacus's Poisson
  batches, forget and retain batches side by side, the signature's fixed chunks);
- ``loss``: the objective ``(out, y) -> scalar`` (the task's loss, plus FedProx's term);
  ``ascend`` turns descent into ascent (the erasure);
- ``apply``: what happens to the gradient (an optimiser's step; opacus's clip, noise and
  step; a step and a projection into a ball; keeping it, for the signature);
- ``before`` (may raise to stop the job), ``guard`` (ends the loop before a backward pass, on
  the loss: the ascent's cap) and ``after`` (ends it after a step: the membership test).

It writes forward, loss and backward out once, with mixed precision on CUDA
(:class:`Precision`): bf16 needs no loss scaling; fp16 scales the loss, unscales the
gradients before ``apply`` and skips a step whose gradients are not finite. On a CPU the loop
runs in float32 whatever the precision asks (CPU autocast is slower than float32 on most
machines), so a run's numbers on the CPU do not depend on that setting.

    totals = run_steps(model, batches, loss, lambda step: opt.step(),
                       zero_grad=lambda: opt.zero_grad(set_to_none=True), steps=10, device=dev)
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from protocol.config import PRECISIONS


@dataclass
class Precision:
    """Mixed precision for the forward pass and the loss, on CUDA only.

    ``fp16`` keeps a dynamic loss scale: the loss is multiplied by ``scale`` before the
    backward pass, the gradients divided by it after; a step with a non-finite gradient is
    skipped and halves the scale, ``growth_interval`` finite steps in a row double it.
    """

    name: str = "fp32"
    scale: float = 2.0**16
    growth_interval: int = 2000
    _good: int = field(default=0, repr=False)

    def __post_init__(self) -> None:
        if self.name not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {self.name[:20]!r}")

    def active(self, device: torch.device) -> bool:
        """Whether it changes anything on ``device`` (CUDA and not fp32)."""
        return self.name != "fp32" and device.type == "cuda"

    def autocast(self, device: torch.device) -> contextlib.AbstractContextManager:
        """The forward pass's context on ``device``."""
        if not self.active(device):
            return contextlib.nullcontext()
        dtype = torch.bfloat16 if self.name == "bf16" else torch.float16
        return torch.autocast(device_type=device.type, dtype=dtype)

    def scaled(self, device: torch.device) -> bool:
        """Whether the loss is scaled on ``device`` (fp16 on CUDA)."""
        return self.name == "fp16" and self.active(device)

    def unscale(self, params: Iterable[torch.Tensor]) -> bool:
        """Divide the gradients by the scale; False (and halve it) when one is not finite."""
        grads = [p.grad for p in params if p.grad is not None]
        finite = all(bool(torch.isfinite(g).all()) for g in grads)
        if not finite:
            self.scale, self._good = max(self.scale / 2.0, 1.0), 0
            return False
        for g in grads:
            g.div_(self.scale)
        self._good += 1
        if self._good >= self.growth_interval:
            self.scale, self._good = self.scale * 2.0, 0
        return True


FP32 = Precision()


@dataclass
class Totals:
    """What a run of the loop did: sums over its non-empty batches (means are the caller's)."""

    steps: int = 0
    """Backward passes taken (a step ended by ``guard`` is not one)."""
    loss: float = 0.0
    """Sum of the batch losses (the objective, before ``ascend`` flips its sign)."""
    score: float = 0.0
    """Sum of ``score(out, y)`` (0 without one)."""
    nonempty: int = 0
    samples: int = 0
    skipped: int = 0
    """Steps whose fp16 gradients were not finite (``apply`` not called)."""
    ended_by: str = ""
    """"" (all steps), "guard" or "after"."""


def run_steps(
    model: nn.Module,
    batches: Iterable[tuple[torch.Tensor, torch.Tensor]],
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    apply: Callable[[int], None],
    *,
    zero_grad: Callable[[], None],
    steps: int,
    device: torch.device,
    ascend: bool = False,
    before: Callable[[int], None] | None = None,
    guard: Callable[[torch.Tensor, torch.Tensor], bool] | None = None,
    after: Callable[[int], bool] | None = None,
    score: Callable[[torch.Tensor, torch.Tensor], float] | None = None,
    quiet: bool = False,
    precision: Precision = FP32,
) -> Totals:
    """Take up to ``steps`` gradient steps on ``model`` (the module to call: opacus's wrapper
    under DP), one batch of ``batches`` each.

    Each step: ``before(step)``; the next batch, moved to ``device``; ``zero_grad()``; forward
    and ``loss(out, y)`` (under ``precision``'s autocast); ``guard(out, loss)`` True ends the
    loop here; backward of the loss (of its negative with ``ascend``); ``apply(step)``;
    ``after(step)`` True ends the loop. ``quiet`` silences warnings of the loss and the
    backward pass (an empty DP batch's loss is NaN by design). Returns the :class:`Totals`.
    """
    totals = Totals()
    it = iter(batches)
    params = [p for p in model.parameters() if p.requires_grad]
    scaled = precision.scaled(device)
    for step in range(steps):
        if before is not None:
            before(step)
        try:
            x, y = next(it)
        except StopIteration:
            break
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with warnings.catch_warnings():
            if quiet:
                warnings.simplefilter("ignore")
            zero_grad()
            with precision.autocast(device):
                out = model(x)
                value = loss(out, y)
            if guard is not None and guard(out, value):
                totals.ended_by = "guard"
                break
            objective = -value if ascend else value
            if scaled:
                objective = objective * precision.scale
            objective.backward()
        totals.steps += 1
        if scaled and not precision.unscale(params):
            totals.skipped += 1
        else:
            apply(step)
        if len(x):
            totals.loss += float(value.detach())
            if score is not None:
                totals.score += score(out.detach().float(), y)
            totals.nonempty += 1
        totals.samples += len(x)
        if after is not None and after(step):
            totals.ended_by = "after"
            break
    return totals


def cap_guard(cap: float | None) -> Callable[[torch.Tensor, torch.Tensor], bool]:
    """The ascent's guard: the batch loss above ``cap`` ends it; without a cap, above
    ``2 · log(C)`` (``C`` the output's channels, ``out (b, C, ...)``): twice the loss of a
    uniform guess, past which ascent only destroys the model."""

    def guard(out: torch.Tensor, value: torch.Tensor) -> bool:
        limit = cap if cap is not None else 2.0 * math.log(max(out.shape[1], 2))
        return float(value.detach()) > limit

    return guard


def seeded_draws(
    images: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int,
    gen: torch.Generator,
    crop: tuple[int, ...] | None = None,
) -> Iterable[tuple[torch.Tensor, torch.Tensor]]:
    """Endless batches of ``min(batch_size, N)`` samples drawn with replacement by ``gen``:
    images ``(N, C, *spatial)`` and labels, indexed alike; with ``crop``, each sample's
    random crop of that size (offsets drawn by ``gen`` too)."""
    n = len(images)
    while True:
        idx = torch.randint(0, n, (min(batch_size, n),), generator=gen)
        yield random_crops(images[idx], labels[idx], crop, gen)


def random_crops(
    x: torch.Tensor, y: torch.Tensor, crop: tuple[int, ...] | None, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each sample's crop of size ``crop`` at offsets drawn by ``gen``: images ``(b, C,
    *spatial)``, label maps ``(b, *spatial)``; without ``crop`` (or one as large as the
    samples) ``x`` and ``y`` themselves, drawing nothing."""
    spatial = tuple(x.shape[2:])
    if crop is None or all(c >= s for c, s in zip(crop, spatial)):
        return x, y
    room = torch.tensor([s - c + 1 for s, c in zip(spatial, crop)])
    starts = (torch.rand((len(x), len(crop)), generator=gen) * room).long()
    xs, ys = [], []
    for k, st in enumerate(starts.tolist()):
        box: list[Any] = [slice(a, a + c) for a, c in zip(st, crop)]
        xs.append(x[tuple([k, slice(None), *box])])
        ys.append(y[tuple([k, *box])])
    return torch.stack(xs), torch.stack(ys)
