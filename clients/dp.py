"""DP-SGD for one silo's local training (Abadi et al. 2016), with opacus.

What it does: for one train message, the silo's MONAI network, SGD optimiser and data are
wrapped by opacus's ``PrivacyEngine``: per-sample gradients are clipped to ``max_grad_norm``
(flat clipping over all parameters), Gaussian noise of standard deviation
``noise_multiplier * max_grad_norm`` is added to their sum, and the result is divided by the
expected batch size. The message's privacy cost is what opacus's accountant saw:
``[(noise_multiplier, sample_rate, steps)]``, which ``clients.privacy`` adds to the silo's
persistent ledger.

Where it departs from ``clients.local.train_local`` (and why):
- Sampling. ``train_local`` draws ``batch_size`` samples with replacement per step. Here each
  step's batch is a *Poisson* sample (opacus's ``DPDataLoader``): every one of the silo's N
  samples is in the batch independently with probability q = 1/ceil(N/B) (B =
  ``batch_size``; q = B/N when B divides N, otherwise slightly above), so batches vary in
  size and may be empty (an empty step still adds noise and is still counted). This is the
  sampled Gaussian mechanism that opacus's RDP, PRV and GDP accountants analyse (add/remove
  neighbouring data sets), so the epsilon reported is a bound for exactly what ran. Fixed-size
  batches accounted at q = B/N would not be covered by that analysis.
- A fixed number of steps per message (``client.local_steps``), not epochs: the sampler is
  simply iterated that many times.
- The proximal term (``client.proximal_mu``) depends on the parameters only, not on any
  sample; opacus would drop its gradient (it rebuilds ``p.grad`` from per-sample gradients),
  so it is added after clipping and noising, before the optimiser's step. Weight decay and
  momentum are applied by the wrapped SGD, also after noising. All three are
  post-processing and cost no privacy.
- Randomness. The batch sampling and the noise never come from the seed the server sends
  (the server could then regenerate the noise and subtract it, and would know which samples
  each batch held, which voids the amplification by subsampling). Both generators are seeded
  from the operating system's entropy on every message; ``seed`` exists for tests only. A DP
  run is therefore not reproducible for a seed. opacus's ``secure_mode`` (a cryptographic
  generator, torchcsprng) is not used.
- The state dict keeps the network's own names: the model is wrapped for the message only,
  its state is read from the unwrapped network after opacus's hooks are removed, so the names
  the server sees carry no ``_module.`` prefix (``train_private`` checks that they are the
  names it was sent).

Networks: ``make_compatible`` runs opacus's ``ModuleValidator``; every network of
``medical_data.networks`` already uses GroupNorm and non-inplace activations, so nothing is
replaced. A network that would need BatchNorm swapped for GroupNorm has different state-dict
names than the server's model and is refused with the reason (build it with GroupNorm).

Run: ``fedasync simulate client.dp.noise_multiplier=1.0``; on many
devices nothing changes (each silo trains on its own). Cost: ``benchmarks/dp_overhead.py``.
"""

from __future__ import annotations

import math
import secrets
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from opacus import PrivacyEngine
from opacus.accountants.utils import get_noise_multiplier
from opacus.validators import ModuleValidator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from clients.local import objective
from clients.loop import run_steps
from clients.privacy import History, PrivacyLedger
from medical_data.federation import SiloData
from medical_data.tasks import score
from protocol.config import DPConfig
from protocol.keys import DP_DELTA, DP_EPSILON


def make_compatible(model: nn.Module) -> nn.Module:
    """``model`` in a form opacus can compute per-sample gradients for, with the same names.

    ``ModuleValidator.fix`` swaps BatchNorm for GroupNorm (and the like); if that changes the
    state-dict names, the server's model and this silo's would no longer match, so it raises
    ValueError instead. Returns ``model`` itself when it is already compatible.
    """
    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return model
    fixed = ModuleValidator.fix(model)
    if set(fixed.state_dict()) != set(model.state_dict()):
        raise ValueError(
            "this network is not opacus-compatible without changing its parameters "
            f"({'; '.join(str(e) for e in errors)[:300]}); build it with GroupNorm "
            "(medical_data.networks does) so that server and silos share one model"
        )
    return fixed


def sample_rate(num_samples: int, batch_size: int) -> float:
    """Poisson sampling rate q = 1/ceil(N/B), the rate opacus's DPDataLoader uses."""
    if num_samples < 1:
        raise ValueError("DP training needs at least one sample")
    return 1.0 / math.ceil(num_samples / min(batch_size, num_samples))


def resolve_noise(
    *,
    noise_multiplier: float | None,
    target_epsilon: float | None,
    delta: float,
    rate: float,
    steps: int,
    accountant: str,
) -> float:
    """The noise multiplier of one message: the configured one, or, with ``target_epsilon``,
    the smallest one (opacus's binary search) for which ``steps`` steps at ``rate`` cost at
    most ``target_epsilon`` at ``delta``."""
    if target_epsilon is None:
        assert noise_multiplier is not None  # (DP-SGD is on: one of the two is set)
        return float(noise_multiplier)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rdp: "optimal order is the largest alpha"
        return float(
            get_noise_multiplier(
                target_epsilon=target_epsilon,
                target_delta=delta,
                sample_rate=rate,
                steps=steps,
                accountant=accountant,
            )
        )


def _generator(seed: int | None) -> torch.Generator:
    return torch.Generator().manual_seed(secrets.randbits(63) if seed is None else seed)


def _batches(loader: DataLoader) -> Iterator[Any]:
    """The loader's batches, started again whenever it runs out (a fixed number of steps)."""
    while True:
        yield from loader


def train_local_dp(
    model: nn.Module,
    data: SiloData,
    *,
    task: str,
    steps: int,
    batch_size: int,
    lr: float,
    noise_multiplier: float,
    max_grad_norm: float,
    accountant: str = "rdp",
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    proximal_mu: float = 0.0,
    device: torch.device | None = None,
    seed: int | None = None,
    stop: Callable[[int, int], None] | None = None,
) -> tuple[dict[str, float], History]:
    """Run ``steps`` DP-SGD steps on Poisson-sampled batches of ``data``; train ``model`` in
    place and leave it unwrapped (its own state-dict names, no opacus hooks).

    ``seed`` seeds sampling and noise (tests only; None: the operating system's entropy).
    ``stop(step, steps)`` runs before each step and may raise to end the job (``clients.preempt``).
    Returns the mean training loss and score over the non-empty steps, the mean batch size
    (``train_dp_batch_mean``) and the noise multiplier (``train_dp_noise_multiplier``), and the
    accountant's history of this message, ``[(noise_multiplier, sample_rate, steps)]``.
    """
    device = device or torch.device("cpu")
    model.to(device).train()
    images = torch.tensor(data.images)  # a private copy: the federation's arrays are read-only
    labels = torch.tensor(data.labels)
    sample_gen = _generator(seed)
    noise_gen = _generator(None if seed is None else seed + 1)
    loader = DataLoader(
        TensorDataset(images, labels), batch_size=min(batch_size, len(data)), generator=sample_gen
    )
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=momentum, weight_decay=weight_decay)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "Secure RNG turned off" (see the module docstring)
        engine = PrivacyEngine(accountant=accountant)
        dp_model, dp_opt, dp_loader = engine.make_private(
            module=model,
            optimizer=opt,
            data_loader=loader,
            noise_multiplier=noise_multiplier,
            max_grad_norm=max_grad_norm,
            poisson_sampling=True,
            noise_generator=noise_gen,
        )
    params = [p for p in model.parameters() if p.requires_grad]
    base = [p.detach().clone() for p in params] if proximal_mu > 0 else []

    def apply(step: int) -> None:
        if dp_opt.pre_step():  # clip, noise, scale; the accountant counts the step
            for p, b in zip(params, base):
                if p.grad is None:  # (pre_step gives every trainable parameter one)
                    raise AttributeError("a trainable parameter has no gradient to add to")
                p.grad.add_(p.detach() - b, alpha=proximal_mu)
            dp_opt.original_optimizer.step()

    try:
        totals = run_steps(
            dp_model,
            _batches(dp_loader),
            objective(task, model),
            apply,
            zero_grad=lambda: dp_opt.zero_grad(set_to_none=True),
            steps=steps,
            device=device,
            before=None if stop is None else lambda step: stop(step, steps),
            score=lambda out, y: score(out, y, task),
            quiet=True,  # an empty batch's loss is NaN (no gradient), by design
        )
    finally:
        dp_opt.zero_grad(set_to_none=True)
        dp_model._close()  # remove opacus's hooks and per-sample attributes from ``model``
    history: History = [(float(s), float(q), int(n)) for s, q, n in engine.accountant.history]
    stats = {
        "train_loss": totals.loss / max(totals.nonempty, 1),
        "train_score": totals.score / max(totals.nonempty, 1),
        "train_dp_batch_mean": totals.samples / steps,
        "train_dp_noise_multiplier": float(noise_multiplier),
    }
    return stats, history


def train_private(
    model: nn.Module,
    data: SiloData,
    dp: DPConfig,
    *,
    ledger: Path,
    silo: int,
    job_id: int,
    task: str,
    steps: int,
    batch_size: int,
    lr: float,
    momentum: float = 0.0,
    weight_decay: float = 0.0,
    proximal_mu: float = 0.0,
    device: torch.device | None = None,
    stop: Callable[[int, int], None] | None = None,
) -> tuple[nn.Module, dict[str, float]]:
    """One train message under DP, with the silo's ledger at ``ledger``.

    Raises ``BudgetExhausted`` before training when this message's steps would take the silo's
    epsilon past ``dp.epsilon_budget``, and after training (nothing recorded; the result must
    not be released) when another message for this silo was recorded meanwhile. Otherwise
    records the message and returns the trained network (``model`` itself, or its
    opacus-compatible equivalent with the same names) and the training statistics with the
    silo's accumulated epsilon (``dp-epsilon``) and its delta (``dp-delta``).
    """
    rate = sample_rate(len(data), batch_size)
    sigma = resolve_noise(
        noise_multiplier=dp.noise_multiplier,
        target_epsilon=dp.target_epsilon,
        delta=dp.delta,
        rate=rate,
        steps=steps,
        accountant=dp.accountant,
    )
    acct = {"delta": dp.delta, "mechanism": dp.accountant, "budget": dp.epsilon_budget}
    names = set(model.state_dict())
    with PrivacyLedger(ledger) as book:
        if dp.epsilon_budget is not None:  # refuse before training, not after
            book.check([(sigma, rate, steps)], **acct)  # type: ignore[arg-type]
        model = make_compatible(model)
        stats, history = train_local_dp(
            model,
            data,
            task=task,
            steps=steps,
            batch_size=batch_size,
            lr=lr,
            noise_multiplier=sigma,
            max_grad_norm=dp.max_grad_norm,
            accountant=dp.accountant,
            momentum=momentum,
            weight_decay=weight_decay,
            proximal_mu=proximal_mu,
            device=device,
            stop=stop,
        )
        if set(model.state_dict()) != names:  # never opacus's "_module." names on the wire
            raise RuntimeError("DP training changed the network's state-dict names")
        eps = book.record(history, silo=silo, job_id=job_id, **acct)  # type: ignore[arg-type]
    return model, {**stats, DP_EPSILON: eps, DP_DELTA: dp.delta}
