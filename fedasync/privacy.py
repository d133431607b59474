"""Central (server-side) differential privacy for asynchronous aggregation.

A trusted server clips each silo's delta to L2 norm ``C`` and adds Gaussian noise to what it
releases (the next global model), the user-level DP-FedAvg of McMahan et al. 2018
(arXiv:1710.06963), adapted to releases that happen one fold (FedAsync) or one flush (FedBuff)
at a time:

- **FedAsync**: x ← x + s·(clip(Δ) + N(0, σ²C²)). The release's L2 sensitivity to the silo's
  data is s·C and its noise std s·σC, so every fold is one Gaussian mechanism with noise
  multiplier σ *for that silo only*; the other silos' data is not touched by it.
- **FedBuff**: Δ̄ = Σ c_i clip(Δ_i) + N(0, (σ·C·max_j S_j)²) where S_j = Σ_{i from silo j} c_i is
  silo j's share of the buffer (a fast silo may have two updates in one buffer; its
  sensitivity is then the sum). Every silo in the buffer gets one Gaussian mechanism with
  noise multiplier σ·max S / S_j ≥ σ; it is accounted at σ (exact for the silo with the
  largest share, conservative for the others). The server optimiser's step is
  post-processing.

Sensitivity is add/remove of one silo's whole contribution (user-level, as DP-FedAvg). The
coefficients may depend on staleness (timing), never on a silo's data: FedBuff's sample
weighting uses reported sample counts, which are data, so the server refuses it with central
DP (server/config.py).

Accounting (``gaussian_epsilon``): Rényi DP of the Gaussian mechanism without subsampling is
α/(2σ²) at order α (Mironov 2017, Prop. 7); compositions add; the conversion to (ε, δ) is the
one opacus's ``get_privacy_spent`` uses (Balle et al. 2020, Thm. 21). A silo takes part in
every release it contributes to (no sampling, hence no amplification). A test checks the
figures against opacus's RDP accountant at sample rate 1.

Noise comes from OS entropy unless a seed is given (tests only): a seeded generator would let
anyone who knows the seed subtract the noise.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from functools import lru_cache

import torch

from fedasync.tensors import clip_by_norm, global_norm
from fedasync.types import Params

RDP_ORDERS: tuple[float, ...] = (
    *(1.0 + x / 10.0 for x in range(1, 100)),
    *(float(x) for x in range(12, 64)),
)
"""Rényi orders; the same grid as opacus's RDPAccountant.DEFAULT_ALPHAS."""


def gaussian_epsilon(releases: Mapping[float, int], delta: float) -> float:
    """(ε at ``delta``) of a composition of Gaussian mechanisms, ``{noise_multiplier: count}``.

    Without sampling: RDP(α) = Σ count·α/(2σ²); ε = min over α of
    RDP(α) − (log δ + log α)/(α − 1) + log((α − 1)/α). Zero releases cost 0; a noise
    multiplier of 0 costs infinity. Memoised: a server asks for the same counts again (the
    budget check before a fold, the report after it).
    """
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    items = tuple(sorted((float(s), int(n)) for s, n in releases.items() if int(n) > 0))
    return _epsilon(items, delta)


@lru_cache(maxsize=4096)
def _epsilon(items: tuple[tuple[float, int], ...], delta: float) -> float:
    if not items:
        return 0.0
    if any(s <= 0.0 for s, _ in items):
        return math.inf
    per_order = sum(n / (2.0 * s * s) for s, n in items)  # RDP(α) = α · per_order
    best = math.inf
    for a in RDP_ORDERS:
        eps = a * per_order - (math.log(delta) + math.log(a)) / (a - 1.0) + math.log((a - 1.0) / a)
        best = min(best, eps)
    return max(best, 0.0)


class GaussianMechanism:
    """Clip-then-noise for releases of the global model (see the module docstring).

    ``clip`` bounds one update; ``noise`` adds N(0, (σ·C·share)²) to every floating tensor of
    an aggregate in which the most exposed silo has coefficient ``share``. Integer tensors
    (BatchNorm counters) are never noised: the aggregators never fold them.
    """

    def __init__(self, clip_norm: float, noise_multiplier: float, seed: int | None = None):
        if not clip_norm > 0.0:
            raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
        if not noise_multiplier >= 0.0:
            raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
        self.clip_norm = float(clip_norm)
        self.noise_multiplier = float(noise_multiplier)
        self._seed = int(seed) if seed is not None else secrets.randbits(63)
        self._generators: dict[str, torch.Generator] = {}

    def clip(self, tensors: Params) -> tuple[Params, float]:
        """``tensors`` scaled to L2 norm at most C, and the factor used. Within the bound they
        come back as they are, not copied (the server has usually clipped them already; the
        norm is checked again so that the sensitivity never rests on the caller)."""
        n = global_norm(tensors)
        if n <= self.clip_norm:
            return tensors, 1.0
        return clip_by_norm(tensors, self.clip_norm, n)

    def std(self, share: float) -> float:
        """Noise std per coordinate for an aggregate whose largest silo coefficient is ``share``."""
        return self.noise_multiplier * self.clip_norm * float(share)

    def noise(self, tensors: Params, share: float) -> tuple[Params, float]:
        """``tensors`` plus Gaussian noise of std ``std(share)``, and that std."""
        std = self.std(share)
        out: Params = {}
        for name, t in tensors.items():
            if not t.is_floating_point() or std == 0.0:
                out[name] = t
                continue
            z = torch.randn(t.shape, generator=self._generator(t.device), device=t.device)
            out[name] = t + z.to(t.dtype) * std
        return out, std

    def _generator(self, device: torch.device) -> torch.Generator:
        key = str(device)
        g = self._generators.get(key)
        if g is None:
            g = torch.Generator(device=device)
            g.manual_seed(self._seed + len(self._generators))
            self._generators[key] = g
        return g


def largest_share(silos: Sequence[str], coeffs: Sequence[float]) -> tuple[float, list[str]]:
    """The largest per-silo sum of coefficients in a buffer, and its distinct silos in order."""
    shares: dict[str, float] = {}
    for s, c in zip(silos, coeffs):
        shares[s] = shares.get(s, 0.0) + abs(float(c))
    return (max(shares.values()) if shares else 0.0), list(shares)
