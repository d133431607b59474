"""Typed configuration of a silo's local work and of the data it holds.

Both travel from the server to every silo inside each train message (as JSON), so that a
SuperNode needs nothing but its silo id to join a run: the same ClientApp serves simulation
and deployment unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

ACCOUNTANTS = ("rdp", "prv", "gdp")
"""The opacus accountants a silo can keep its privacy ledger with."""

if TYPE_CHECKING:
    from medical_data.federation import Federation


@dataclass
class DPConfig:
    """Differential privacy: DP-SGD on every silo with opacus (clients/dp.py), each silo's
    epsilon accumulated across messages and runs in its ledger (clients/privacy.py)."""

    enabled: bool = False
    """Train with DP-SGD (per-sample clipping, Gaussian noise, Poisson-sampled batches)."""
    noise_multiplier: float = 1.0
    """Noise standard deviation as a multiple of max_grad_norm (unused with target_epsilon)."""
    target_epsilon: float | None = None
    """Instead of noise_multiplier: the smallest noise for which one train message costs at
    most this epsilon (at delta), by opacus's get_noise_multiplier."""
    max_grad_norm: float = 1.0
    """Per-sample gradient clipping norm C (L2 over all parameters)."""
    delta: float = 1e-5
    """The delta every reported epsilon is for."""
    epsilon_budget: float | None = None
    """A silo refuses any message that would take its accumulated epsilon past this (None: no
    budget)."""
    accountant: str = "rdp"
    """opacus accountant: rdp, prv, or gdp (one noise multiplier and sample rate only)."""

    def __post_init__(self) -> None:
        """Validated whenever built (omegaconf builds a run's config, the ClientApp the one it
        is sent); an error names the key."""
        checks = [
            (
                self.accountant in ACCOUNTANTS,
                "client.dp.accountant must be rdp, prv or gdp",
            ),
            (self.noise_multiplier > 0, "client.dp.noise_multiplier must be > 0"),
            (
                self.target_epsilon is None or self.target_epsilon > 0,
                "client.dp.target_epsilon must be > 0 (or null)",
            ),
            (self.max_grad_norm > 0, "client.dp.max_grad_norm must be > 0"),
            (0.0 < self.delta < 1.0, "client.dp.delta must be in (0, 1)"),
            (
                self.epsilon_budget is None or self.epsilon_budget > 0,
                "client.dp.epsilon_budget must be > 0 (or null)",
            ),
        ]
        for ok, msg in checks:
            if not ok:
                raise ValueError(msg)


@dataclass
class ClientConfig:
    """Local training of one silo for one message."""

    local_steps: int = 10
    """Optimiser steps per train message (mini-batches, sampled with replacement)."""
    batch_size: int = 32
    """Mini-batch size."""
    lr: float = 0.05
    """Local SGD learning rate."""
    momentum: float = 0.0
    """Local SGD momentum (reset every message: silos keep no optimiser state)."""
    weight_decay: float = 0.0
    """Local L2 weight decay."""
    proximal_mu: float = 0.0
    """FedProx / FedAsync proximal term rho: adds rho/2 * ||w - w_base||^2 to the loss."""
    device: str = "auto"
    """'auto' picks CUDA when present, else CPU; or 'cpu' / 'cuda' / 'cuda:1'."""
    num_threads: int = 1
    """torch intra-op threads per silo process (one CPU per silo in simulation)."""
    dp: DPConfig = field(default_factory=DPConfig)


@dataclass
class DataConfig:
    """Which benchmark and how it is split into silos (see medical_data)."""

    benchmark: str = "brain-tissue"
    """A name from medical_data.BENCHMARKS."""
    partition: str = "natural"
    """natural (groups such as slabs or patients), dirichlet (label skew) or iid."""
    dirichlet_alpha: float = 0.5
    """Concentration of the Dirichlet label skew (smaller is more skewed)."""
    site_shift: float = 1.0
    """Strength of the seeded per-silo scanner shift (MONAI intensity transforms); 0 = none."""
    test_fraction: float = 0.2
    """Held-out fraction pooled across sites for the global test set."""
    max_samples: int | None = None
    """Cap on the number of samples drawn from the benchmark (None = all)."""
    data_dir: str | None = None
    """Where fetched data lives (default $FEDASYNC_DATA or ~/.cache/fedasync/data)."""
    network: str | None = None
    """Override the benchmark's default network (cnn-small, densenet121, resnet18, unet-small)."""


def to_dict(cfg: object) -> dict:
    """A plain dict of a config dataclass (for JSON)."""
    return asdict(cfg)  # type: ignore[call-overload]


def build_silos(d: DataConfig, num_silos: int, seed: int) -> Federation:
    """The federation ``d`` describes (cached in-process by medical_data; treat as read-only)."""
    from medical_data.federation import build_federation

    return build_federation(
        d.benchmark,
        num_silos,
        seed,
        partition=d.partition,
        dirichlet_alpha=d.dirichlet_alpha,
        site_shift=d.site_shift,
        test_fraction=d.test_fraction,
        max_samples=d.max_samples,
        data_dir=d.data_dir,
    )
